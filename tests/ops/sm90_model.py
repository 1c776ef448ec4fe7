"""The model-sized calls of ``sm90_drive`` alone (H 128, V 151936, recorded, not run): with
``TRITON_DUMP_PTXAS_LOG=1``, ``env -u TRITON_INTERPRET python -m sm90_launches --stage cubin --drive sm90_model``
prints ptxas' registers and spills of each build as the GPU would run it (docs/development.md)."""
from sm90_drive import model_sized as drive  # noqa: F401
