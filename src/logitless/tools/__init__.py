"""The `logitless` command and what it runs: `bench` (single process and tensor-parallel), `doctor`.

Tools use the public op; nothing in the library imports them.
"""
