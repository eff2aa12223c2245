"""The step-time model held against measured steps on 2 CPU ranks (launched: one torchrun per strategy, each
training accumulation 1 and 2, checkpointing off and on one after another; tests/workers/train_time.py)."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

from launch import torchrun_launch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import time_prediction as bench  # noqa: E402  (the benchmark's strategies, configurations and model)

pytestmark = pytest.mark.launch
WORKER = ROOT / "tests" / "workers" / "train_time.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from shardscope.recipes.tiny import make_causal_lm

    root = tmp_path_factory.mktemp("time_prediction")
    make_causal_lm(root / "model", "llama", **bench.MODEL)
    for name, extra in bench.STRATEGIES.items():
        torchrun_launch(WORKER, ["--model", root / "model", "--configs", ",".join(bench.CONFIGS), *extra],
                        root / name, timeout=900).check()
    return root


def test_the_calibration_run_predicts_itself(runs):
    """Calibrated from a run, the model gives that run's measured median back (the figures add up)."""
    for source in ("ddp/a1c0", "zero3/a1c0"):
        own = next(r for r in bench.predictions(runs, source) if r["name"] == source)
        assert own["predicted_s"] == pytest.approx(own["measured"]["median"], rel=1e-6)


@pytest.mark.xfail(reason="not met reliably on a shared 2-core machine: measured compute per pass of the same "
                          "micro-batch moves more than 15% between runs (benchmarks/results/time_prediction.md)")
def test_every_strategy_within_15_percent_calibrated_from_ddp(runs):
    rows = bench.predictions(runs, "ddp/a1c0")
    assert len(rows) == len(bench.STRATEGIES) * len(bench.CONFIGS)
    off = {r["name"]: f"{r['error']:+.1%}" for r in rows if abs(r["error"]) > bench.TOLERANCE}
    ddp = [r for r in bench.predictions(runs, "zero3/a1c0") if r["strategy"] == "ddp"]
    off.update({f"{r['name']} (from zero3)": f"{r['error']:+.1%}" for r in ddp if abs(r["error"]) > bench.TOLERANCE})
    assert not off, off


@pytest.mark.xfail(reason="not met reliably on a shared 2-core machine: measured compute per pass of the same "
                          "micro-batch moves more than 15% between runs (benchmarks/results/time_prediction.md)")
def test_predicted_order_where_measured_medians_are_apart(runs):
    """Wherever two runs' measured medians differ by more than their p10-p90 spreads, the prediction orders them
    the same way (calibrated from DDP)."""
    rows = bench.predictions(runs, "ddp/a1c0")
    wrong = []
    for a, b in itertools.combinations(rows, 2):
        ma, mb = a["measured"], b["measured"]
        if ma["p90"] < mb["p10"] or mb["p90"] < ma["p10"]:  # spreads do not overlap
            if (ma["median"] < mb["median"]) != (a["predicted_s"] < b["predicted_s"]):
                wrong.append((a["name"], b["name"]))
    assert not wrong, wrong


def test_report_puts_predicted_beside_measured(runs, tmp_path, capsys):
    """`report` calibrates from the first run (or --calibrate) and prints each run's prediction and measured median."""
    from shardscope.cli import main
    from shardscope.safe_io import load_json
    from shardscope.report.time_prediction import measured

    dirs = [runs / "ddp" / "a1c0", runs / "zero3" / "a2c1"]
    assert main(["report", *map(str, dirs), "--output", str(tmp_path / "a")]) == 0
    text = (tmp_path / "a" / "report.md").read_text()
    assert "## Step time: predicted beside measured" in text and f"calibrated from {dirs[0]}" in text
    for d in dirs:
        median = measured(load_json(d / "shardscope_summary.json", "summary"))["median"]
        assert f"| {median:.3g} s |" in text
    assert main(["report", *map(str, dirs), "--output", str(tmp_path / "b"), "--calibrate", str(dirs[1])]) == 0
    assert f"calibrated from {dirs[1]}" in (tmp_path / "b" / "report.md").read_text()
    capsys.readouterr()
