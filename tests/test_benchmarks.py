"""The benchmarks: the overhead benchmark runs end to end and writes its table (no timing thresholds); every
script is documented with its results; and timings live there, not in the test suite."""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "callback_overhead.py"
# A clock read in a test means a timed assertion; tests/launch.py's launch timeout is a harness bound, not a claim.
CLOCKS = re.compile(r"perf_counter|process_time|monotonic|time\.time\(|getrusage")


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


def test_every_benchmark_is_documented_with_its_results_file():
    readme = (BENCHMARKS / "README.md").read_text()
    scripts = sorted(p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh"))
    assert {"plan_startup.py", "plan_speed.py", "failure_speed.py", "dry_run_speed.py"} <= set(scripts)
    assert [name for name in scripts if f"`{name}`" not in readme] == []
    named = set(re.findall(r"results/(\w+\.md)", readme))
    assert named and [name for name in sorted(named) if not (BENCHMARKS / "results" / name).is_file()] == []


def test_no_test_reads_a_clock():
    """Performance claims live in benchmarks/ with results files, not in timed unit tests."""
    tests = Path(__file__).resolve().parent
    found = [f"{path.name}:{n}: {line.strip()}" for path in sorted(tests.glob("test_*.py"))
             if path.name != Path(__file__).name
             for n, line in enumerate(path.read_text().splitlines(), 1) if CLOCKS.search(line)]
    assert found == []
