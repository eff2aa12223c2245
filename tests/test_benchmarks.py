"""Smoke test of the overhead benchmark: it runs end to end and writes its table (no timing thresholds)."""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "callback_overhead.py"


def test_callback_overhead_benchmark_writes_both_settings(tmp_path):
    out = tmp_path / "overhead.md"
    tiny = ["--hidden", "32", "--intermediate", "64", "--layers", "1", "--seq", "8", "--batch", "2",
            "--interval", "2", "--pairs", "2", "--blocks-default", "1", "--blocks-every-step", "2", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), *tiny], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| default interval")
            or line.startswith("| log every step")}
    settings = ("default interval (2 steps)", "log every step")
    assert set(rows) == {f"{name}, {clock} time" for name in settings for clock in ("wall", "cpu")}, text
    for line in rows.values():
        cells = [c.strip() for c in line.strip("|").split("|")]
        ratio_of_medians = float(cells[4])
        block_ratio = float(re.match(r"([\d.]+) \[", cells[5]).group(1))
        for ratio in (ratio_of_medians, block_ratio):
            assert math.isfinite(ratio) and ratio > 0
    assert "torch" in text and "command:" in text and "model:" in text
