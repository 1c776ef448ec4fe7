"""A broken megatron-core install must fail CI (LOGITLESS_REQUIRE_INTEGRATIONS=1), not skip the
Megatron suite and leave the run green; without the variable it is a skip that says why."""
import os
import re
import subprocess
import sys

import pytest

from required import REQUIRE_ENV, import_or_skip

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))


def test_import_or_skip(monkeypatch):
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(ImportError, match="logitless_absent_module.*LOGITLESS_REQUIRE_INTEGRATIONS=1"):
        import_or_skip("logitless_absent_module", "only a test")
    assert import_or_skip("json", "only a test").__name__ == "json"
    monkeypatch.delenv(REQUIRE_ENV)
    with pytest.raises(pytest.skip.Exception, match="logitless_absent_module"):
        import_or_skip("logitless_absent_module", "only a test")


@pytest.fixture(scope="module")
def broken_megatron(tmp_path_factory):
    """A directory whose ``megatron`` package fails to import, to put first on PYTHONPATH."""
    root = tmp_path_factory.mktemp("broken")
    (root / "megatron").mkdir()
    broken = "raise ImportError('megatron-core built against another torch')\n"
    (root / "megatron" / "__init__.py").write_text(broken)
    return str(root)


@pytest.mark.parametrize("require", ["1", ""])
def test_broken_megatron_fails_the_required_run(broken_megatron, require):
    env = dict(os.environ, PYTHONPATH=broken_megatron, **{REQUIRE_ENV: require})
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "tests", "-k", "ci_guard or test_import_or_skip"],  # as `make test` does
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert "megatron-core built against another torch" in out, out[-3000:]
    if require:
        assert proc.returncode != 0 and "passed" not in out and REQUIRE_ENV in out, out[-3000:]
    else:
        # the guard ran and passed; every module that needs megatron (one or more) skipped, saying why
        skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
        assert proc.returncode == 0 and re.search(r"\b1 passed, \d+ skipped", out) and skips, out[-3000:]
        assert all("megatron.core does not import" in line for line in skips), out[-3000:]
