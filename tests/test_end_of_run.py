"""`end_of_run()` on a gloo group: the process leaves at once with code 0, after its exit handlers and with its
output flushed (see the function's docstring for the abort it avoids)."""
import pytest

from launch import ROOT, torchrun_launch

PROBE = ROOT / "tests" / "workers" / "end_of_run_probe.py"


@pytest.mark.launch
def test_a_gloo_run_ends_at_end_of_run_after_its_exit_handlers(tmp_path):
    run = torchrun_launch(PROBE, [], tmp_path).check()
    for rank in range(2):
        assert f"rank {rank} printed before the end" in run.output
        assert (tmp_path / f"atexit_rank{rank}").read_text() == "ran"
        assert not (tmp_path / f"after_end_rank{rank}").exists()
