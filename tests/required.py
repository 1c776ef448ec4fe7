"""Optional integration dependencies (megatron-core, transformers' peft): skipped with the reason
when they do not import, except where the suite must run (CI's `make test` sets
LOGITLESS_REQUIRE_INTEGRATIONS=1): there a missing or broken install fails the run instead of
silently skipping the whole integration suite."""
import importlib
import os

import pytest

REQUIRE_ENV = "LOGITLESS_REQUIRE_INTEGRATIONS"


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") == "1"


def import_or_skip(name: str, why: str):
    """The module ``name``; when it fails to import (for any reason, e.g. a release built against
    another torch): ImportError if LOGITLESS_REQUIRE_INTEGRATIONS=1, else a skip saying why."""
    try:
        return importlib.import_module(name)
    except Exception as exc:
        msg = f"{name} does not import ({type(exc).__name__}: {exc}); {why}"
        if required():
            raise ImportError(f"{msg}. {REQUIRE_ENV}=1, so this fails instead of skipping.") from exc
        pytest.skip(msg, allow_module_level=True)
