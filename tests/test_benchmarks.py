"""The benchmarks: each script runs at a small size and writes its results file in the expected format, into
tmp_path (no timing thresholds: a figure is a positive number, not a bound); every script is documented with its
results; and timings live there, not in the test suite. Scripts that can read runs already made are checked beside
the tests that make them, with no launch of their own (benchmarks/README.md names where)."""
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SCRIPT = BENCHMARKS / "callback_overhead.py"
# A clock read in a test means a timed assertion; tests/launch.py's launch timeout is a harness bound, not a claim.
CLOCKS = re.compile(r"perf_counter|process_time|monotonic|time\.time\(|getrusage")


def test_callback_overhead_benchmark_writes_both_settings(tmp_path):
    out = tmp_path / "overhead.md"
    tiny = ["--hidden", "32", "--intermediate", "64", "--layers", "1", "--seq", "8", "--batch", "2",
            "--interval", "2", "--pairs", "2", "--blocks-default", "1", "--blocks-every-step", "2", "--ranks", "1",
            "--out", str(out)]  # one process: the table's shape; the 2-rank launch is the benchmark's own
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
        for cell in (cells[4], cells[5]):  # end-to-end overhead and the A/A control, each inside its interval
            point, low, high = map(float, re.match(r"([-+\d.]+)% \[([-+\d.]+)% to ([-+\d.]+)%\]", cell).groups())
            assert math.isfinite(point) and low <= point <= high
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


def script(name: str):
    """A benchmark script as a module, to run its main() in this process."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def table_rows(text: str) -> list[list[str]]:
    """The cells of every data row of the Markdown tables in `text` (header and rule rows left out)."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    rule = [set(line) <= set("|-: ") for line in lines]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for i, line in enumerate(lines)
            if not rule[i] and not (i + 1 < len(lines) and rule[i + 1])]


def seconds(cell: str) -> float:
    value = float(cell.rstrip("sx").replace(",", ""))
    assert math.isfinite(value) and value >= 0, cell
    return value


def test_dry_run_speed_writes_its_table_and_the_import_comparison(tmp_path):
    module = script("dry_run_speed")
    module.main(["--quick", "--out", str(tmp_path / "cases.md")])
    [row] = table_rows((tmp_path / "cases.md").read_text())
    assert row[:5] == ["llama-2-7b", "fsdp_full_shard", "8", "1", "-"] and all(seconds(c) for c in row[5:])
    module.main(["--quick", "--vs-import", "1", "--out", str(tmp_path / "vs.md")])
    rows = table_rows((tmp_path / "vs.md").read_text())
    assert [r[0] for r in rows] == ["import torch, transformers", "plan --dry-run 7B, 2 ranks, --strategy fsdp_full_shard"]
    assert rows[0][3:] == ["1.00x", "1.00x"] and all(seconds(c) > 0 for r in rows for c in r[1:])


def test_plan_speed_writes_a_row_per_model(tmp_path, monkeypatch):
    from shardscope.model.spec import model_spec

    monkeypatch.setenv("SHARDSCOPE_CACHE", "off")  # the script turns the cache off; put it back afterwards
    script("plan_speed").main(["--models", "llama-2-7b", "--out", str(tmp_path / "speed.md")])
    [row] = table_rows((tmp_path / "speed.md").read_text())
    assert row[:2] == ["llama-2-7b", f"{model_spec('llama-2-7b').params_total:,}"]
    assert all(seconds(c) > 0 for c in row[2:4])


def test_plan_startup_writes_its_ratios_to_the_import(tmp_path):
    script("plan_startup").main(["--quick", "--model", "llama-2-7b", "--out", str(tmp_path / "startup.md")])
    rows = table_rows((tmp_path / "startup.md").read_text())
    assert [r[0] for r in rows] == ["import torch, transformers", "plan warm (cached spec)"]
    assert rows[0][3:] == ["1.00", "1.00"] and all(seconds(c) > 0 for c in rows[1][1:3])


def test_failure_speed_writes_the_refusals_it_timed(tmp_path):
    script("failure_speed").main(["--quick", "--out", str(tmp_path / "failures.md")])
    rows = table_rows((tmp_path / "failures.md").read_text())
    assert [r[0] for r in rows] == ["YAML anchor bomb (in-process)",
                                    "plan --dry-run --world-size 10 --nodes 4 (fresh process)"]
    assert "anchor bomb" in rows[0][3] and rows[1][3].startswith("exit 2: shardscope: error: world size 10")
    assert all(seconds(c) > 0 for r in rows for c in r[1:3])


def test_planner_figures_are_what_the_planner_gives_now(tmp_path):
    """The figures docs/planner.md quotes are computed: the committed file is what the script writes today."""
    out = tmp_path / "planner_figures.md"
    assert script("planner_figures").main(["--out", str(out)]) == 0
    assert out.read_text() == (BENCHMARKS / "results" / "planner_figures.md").read_text(), \
        "run `python benchmarks/planner_figures.py` then `python benchmarks/render_docs.py`"


def test_fit_examples_are_what_fit_prints_now(tmp_path):
    """The `shardscope fit` outputs docs/fit.md shows are computed: the committed file is what the script writes
    today, and each example's exit status is the one its text says (1 only where nothing fits)."""
    out = tmp_path / "fit_examples.md"
    assert script("fit_examples").main(["--out", str(out)]) == 0
    text = out.read_text()
    assert text == (BENCHMARKS / "results" / "fit_examples.md").read_text(), \
        "run `python benchmarks/fit_examples.py` then `python benchmarks/render_docs.py`"
    statuses = re.findall(r"\n(winner: |nothing fits in ).*?\$ echo \$\?  # (\d)", text, re.S)
    assert [(kind, code) for kind, code in statuses] == [("winner: ", "0")] * 3 + [("nothing fits in ", "1")]


def test_published_ratios_are_what_the_time_model_gives_now(tmp_path):
    """Datasheet predictions (computed, no launch): the committed file is what the script writes today."""
    out = tmp_path / "published_ratios.md"
    script("published_ratios").main(["--out", str(out)])
    assert out.read_text() == (BENCHMARKS / "results" / "published_ratios.md").read_text(), \
        "run `python benchmarks/published_ratios.py` then `python benchmarks/render_docs.py`"
    from shardscope.plan.time_model import DATASHEET_ERROR

    ratios = script("published_ratios")
    rows = ratios.comparisons(ratios.read_groups())
    assert DATASHEET_ERROR == round(ratios.verdict(rows)["error"], 3)  # fit's tie bound is the measured error
    groups = ratios.read_groups()
    assert set(groups) == set(ratios.GROUPS) | set(ratios.NOT_EXPRESSED)  # every published group accounted for
    # Every counted comparison is out of sample: a group whose model the time model's constants cite (a constant set
    # from it) is in sample and counted in no tally; a counted one is cited nowhere in the time model.
    cited = (ROOT / "plugin" / "shardscope" / "plan" / "time_model.py").read_text()
    for name, expr in ratios.GROUPS.items():
        assert any(row["model"] in cited for row in groups[name]) == bool(expr.get("in_sample")), name
    counted = [r for r in rows if not r["in_sample"]]
    assert ratios.verdict(rows)["total"] == len(counted) < len(rows)
    assert ratios.verdict(counted) == ratios.verdict(rows)
    for row in (r for name in ratios.GROUPS for r in groups[name]):  # counted: a source a user can find (an address)
        assert re.search(r"https?://|github\.com/|huggingface\.co/", row["source"]), row["source"]


def test_the_time_models_host_work_is_the_measured_one():
    """`time_model.HOST_S_PER_MODULE` is what benchmarks/library_host_cost.py measured (its results file)."""
    from shardscope.plan.time_model import HOST_S_PER_MODULE

    text = (BENCHMARKS / "results" / "library_host_cost.md").read_text()
    measured = {m[0]: float(m[1]) for m in re.findall(r"^\| (fsdp|deepspeed) \| (\d+) \|$", text, re.M)}
    assert measured == {k: round(v * 1e6) for k, v in HOST_S_PER_MODULE.items()}


def test_suite_time_keeps_every_run_and_shows_the_median(tmp_path):
    """Each recorded row keeps its own commit and machine (a row recorded before those columns reads them as "-")."""
    suite_time, part, out = script("suite_time"), script("render_docs").result, tmp_path / "suite_time.md"
    out.write_text("| target | date | nproc | 1-min load at the end | fresh clone | passed | skipped | seconds | printed |\n"
                   "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
                   "| demo | 2026-11-27 19:44 | 2 | 1.6 | no | - | - | 32.5 | - |\n")
    assert suite_time.main(["record", str(out), "--target", "demo", "--seconds", "30", "--commit", "abc123",
                            "--out", str(out)]) == 0
    old, new = suite_time.read_rows(out.read_text())
    assert (old["commit"], old["machine"], old["seconds"]) == ("-", "-", "32.5")
    assert new["commit"] == "abc123" and new["machine"] == script("render_docs").machine()
    out.unlink()
    for passed, took in ((1000, 700.0), (1001, 600.0), (1001, 650.0)):
        log = tmp_path / "make_test.log"
        log.write_text(f"...\n{passed} passed, 1 skipped, 14 warnings in {took}s (0:11:40)\nrc 0\n")
        assert suite_time.main(["record", str(log), "--fresh-clone", "--out", str(out)]) == 0
    text = out.read_text()
    assert len([r for r in table_rows(text) if r[0] == "test"]) == 3
    assert part("suite_time#test", tmp_path) == (
        "1,001 passed, 1 skipped in 10 min 50 s (median of 3 runs on "
        f"{os.cpu_count()}-core machines, from a fresh clone)")
    assert part("suite_time#demo", tmp_path).startswith("not recorded yet")
    assert suite_time.main(["record", str(log), "--target", "demo", "--seconds", "301", "--out", str(out)]) == 0
    assert part("suite_time#demo", tmp_path).startswith("5 min 1 s (one run on a ")
    log.write_text("2 failed, 998 passed in 700.0s\n")
    assert suite_time.main(["record", str(log), "--out", str(out)]) == 2
    assert len(table_rows(out.read_text())) == 4  # the failed run is not recorded


@pytest.mark.launch
def test_exit_abort_rate_counts_a_profiled_run(tmp_path):
    """One launch: the profiled arm (the plain one is the same launch without the profiler)."""
    out = tmp_path / "aborts.md"
    script("exit_abort_rate").main(["--runs", "1", "--arms", "profiled", "--out", str(out)])
    [row] = table_rows(out.read_text())
    assert row[:2] == ["profiled", "1"] and row[2] in ("0", "1") and 0 < float(row[3].rstrip("%")) <= 100
    assert "--runs 1 --arms profiled`" in out.read_text()


def test_hang_overhead_writes_both_arms_and_the_per_step_calls(tmp_path):
    """One pair of launches, few calls: the table's shape, each figure a positive number."""
    out = tmp_path / "hang.md"
    script("hang_overhead").main(["--pairs", "1", "--collectives", "20", "--out", str(out)])
    rows = table_rows(out.read_text())
    assert [r[0] for r in rows] == ["1 KiB", "1 MiB", "Watchdog.step_done", "compute clock (2 x time.thread_time)"]
    assert all(float(r[-1]) > 0 for r in rows) and "hang_overhead.py --pairs 1 --collectives 20" in out.read_text()


GPU_CHECK = BENCHMARKS / "gpu_check.py"


def test_gpu_check_dry_run_names_every_check_and_what_it_compares():
    """The GPU check's plan, printed without a GPU: each numbered check with what it runs and compares, every run
    (plain Trainer, FSDP2, ZeRO-3) and setting, and what needs 2+ GPUs with its command."""
    done = subprocess.run([sys.executable, str(GPU_CHECK), "--dry-run"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    gpu_check = script("gpu_check")
    for number, title, _, _ in gpu_check.CHECKS:
        assert f"{number}. {title}" in done.stdout
    assert done.stdout.count("   runs: ") == done.stdout.count("   compares: ") == len(gpu_check.CHECKS)
    for strategy, (row, _) in gpu_check.STRATEGIES.items():
        assert f"{strategy} (plan row {row}" in done.stdout
    for what, command in gpu_check.TWO_GPUS:
        assert f"- {what}: {command}" in done.stdout
    assert all(gpu_check.setting_name(s) in done.stdout for s in gpu_check.SETTINGS)


def test_gpu_check_refuses_in_one_line_where_there_is_no_cuda_device(tmp_path):
    out = tmp_path / "gpu_check.md"
    done = subprocess.run([sys.executable, str(GPU_CHECK), "--out", str(out)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2 and not out.exists()
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1 and "no CUDA device" in done.stderr


@pytest.mark.parametrize("name", ["gpu_check", "gpu_check_first_run"])
def test_gpu_check_reports_are_what_their_raw_figures_give(name, tmp_path):
    """The committed GPU reports (docs/gpu.md renders them) are computed from the committed raw figures of the runs:
    made again here without a GPU, they are the same text."""
    out = tmp_path / f"{name}.md"
    done = subprocess.run([sys.executable, str(GPU_CHECK), "--from-raw", str(BENCHMARKS / "results" / f"{name}.json"),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == (BENCHMARKS / "results" / f"{name}.md").read_text(), \
        f"run `python benchmarks/gpu_check.py --from-raw benchmarks/results/{name}.json --out ...{name}.md`"
