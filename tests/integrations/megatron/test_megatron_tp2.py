"""Two spawned CPU processes (gloo): tensor parallelism 2, with and without sequence parallelism
(the hook, the legacy patch and the batch entry points against the unfused model, per rank),
then context parallelism 2 (zigzag THD split and gather in forward_padded / forward_packed).

Both ranks run every case once in one spawn (tp2_worker.py); each test below reads its case.
"""
import json
import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from tp2_worker import CASES  # noqa: E402


def _tp_supported():
    """The fused op's tp_group support (logitless.parallel) must be importable."""
    try:
        from logitless.parallel import VocabParallel, gather_sequence  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def tp2_results(seed):
    missing = _tp_supported()
    assert missing is None, missing
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "gloo_init")
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(2)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE)] +
                                                           [p for p in [os.environ.get("PYTHONPATH")] if p]),
                   OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "tp2_worker.py"), str(r), "2", init,
                                   str(seed), outs[r]], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for r in range(2)]
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=420)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        results = []
        for r in range(2):
            assert os.path.exists(outs[r]), f"rank {r} wrote nothing:\n{logs[r][-3000:]}"
            with open(outs[r]) as f:
                results.append(json.load(f))
        for r, p in enumerate(procs):
            assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[r][-3000:]}"
    return results


@pytest.fixture(scope="module")
def seed():
    s = int.from_bytes(os.urandom(4), "little") if "LOGITLESS_SEED" not in os.environ else int(os.environ["LOGITLESS_SEED"])
    print(f"seed={s}")
    return s


@pytest.mark.parametrize("case", CASES)
def test_tp2(tp2_results, case):
    for rank, res in enumerate(tp2_results):
        assert case in res, f"rank {rank} did not reach {case}"
        ok, msg = res[case]
        assert ok, f"rank {rank}: {msg}"
