"""verl tests: the Megatron harness (tests/megatron/mcore_env.py) is importable from here (the seed
fixture is tests/conftest.py's)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "megatron"))
