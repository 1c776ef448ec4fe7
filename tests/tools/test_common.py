"""tools.common.run_each: the GPU scripts' loop over shapes."""
from logitless.tools.common import run_each


def test_run_each_records_a_failure_and_goes_on(capsys):
    ran, saved, results = [], [], {"A": {"kept": 1}}

    def run(tag):
        ran.append(tag)
        if tag == "A":
            raise RuntimeError("out of memory at A")

    run_each(["A", "B"], run, results, after=lambda: saved.append(len(ran)))
    assert ran == ["A", "B"] and saved == [1, 2]           # B still ran; after() followed each tag
    assert results["A"]["kept"] == 1 and "out of memory at A" in results["A"]["error"]
    assert "B" not in results                               # a tag that succeeds adds nothing
    assert "RuntimeError: out of memory at A" in capsys.readouterr().out
