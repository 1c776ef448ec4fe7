"""Integration suites. pytest puts this directory on sys.path when it loads this file, so the
nested suites (megatron/) can import the shared helper ``required``."""
