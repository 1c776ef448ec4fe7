"""The tensor-parallel bench runs end to end on 2 gloo processes and returns well-formed rows."""
from __future__ import annotations

import json
import math

import pytest

from logitless.tools.bench_tp import format_tp_table, run_tp_bench


def test_tp_bench_rows(tmp_path):
    path = tmp_path / "tp.json"
    rows = run_tp_bench(2, (48, 32, 257), "float32", "cpu", ["chunked", "naive"], repeats=1, json_path=str(path))
    assert [r["backend"] for r in rows] == ["chunked", "naive"]
    ok, other = rows
    assert ok["status"] == "ok" and ok["reason"] is None, ok
    assert ok["vocab_per_rank"] == [129, 128] and ok["collectives"] == "gloo" and ok["world_size"] == 2
    for key in ("fwd_s", "fwd_bwd_s", "floor_fwd_s", "floor_fwd_bwd_s", "comm_fwd_s", "comm_bwd_s"):
        assert math.isfinite(ok[key]) and ok[key] > 0, key
    assert 0 < ok["comm_share_fwd"] <= 1 and 0 < ok["comm_share_fwd_bwd"] <= 1
    assert ok["fwd_x_floor"] == pytest.approx(ok["fwd_s"] / ok["floor_fwd_s"])
    assert other["status"] == "unavailable" and "not a logitless backend" in other["reason"]
    assert other["fwd_s"] is None
    assert json.loads(path.read_text()) == rows
    table = format_tp_table(rows)
    assert "chunked" in table and "unavailable" in table


@pytest.mark.parametrize("kwargs, match", [
    ({"world_size": 0}, "world_size"),
    ({"shape": (4, 8)}, "shape"),
    ({"shape": (4, 8, 1)}, "smaller than world_size"),
    ({"dtype": "int8"}, "dtype"),
    ({"device": "tpu"}, "device"),
    ({"repeats": 0}, "repeats"),
])
def test_tp_bench_bad_arguments(kwargs, match):
    args = {"world_size": 2, "shape": (4, 8, 16), "dtype": "float32", "device": "cpu", "backends": ["chunked"]}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        run_tp_bench(**args)
