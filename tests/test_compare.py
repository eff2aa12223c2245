"""`shardscope compare` / `shardscope report`: one real comparison (2 CPU ranks, tiny Llama, the SFT recipe)
under DDP, FSDP2 full shard and a ZeRO-2 config that makes the Trainer stop; then the report's table, JSON
and plots are checked against the runs' own summaries, and `report`'s errors through the CLI.

FSDP on CPU needs tests/cpu_shim on PYTHONPATH (accelerate would silently run DDP); the launched runs
inherit it from the environment given to `shardscope compare`, which itself knows nothing of the shim.
(FSDP rather than ZeRO-2 as the second strategy: a DeepSpeed run JIT-loads its shm_comm op, which costs
35-80 s whenever another build has replaced it in the shared ~/.cache/torch_extensions.)"""
import json
import os
import subprocess

import pytest
from PIL import Image, ImageStat

from launch import ROOT, shardscope_cli as shardscope
from shardscope.fit import launching
from shardscope.configs.catalog import launcher_config
from shardscope.report import compare

# ZeRO-2 whose gradient clipping disagrees with the Trainer's max_grad_norm (1.0): the Trainer raises on
# every rank after start-up, a realistic failure ("DeepSpeed config values that mismatch").
CLIP_MISMATCH = "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 2\n  gradient_clipping: 0.5\n"


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    from shardscope.recipes.tiny import make_sft_assets

    root = tmp_path_factory.mktemp("compare")
    out = root / "out"
    assets = make_sft_assets(out / "assets", "llama", n=32)  # where benchmarks/strategies_cpu.sh puts them
    (root / "clip_mismatch.yaml").write_text(CLIP_MISMATCH)
    done = shardscope("compare", "--recipe", "recipes/causal_lm_sft.py", "--configs", "ddp", "fsdp_full_shard",
                      root / "clip_mismatch.yaml", "--output-dir", out,
                      "--launcher-args", "--num_processes 2 --mixed_precision no", "--",
                      "--config", "recipes/llama/demo_tiny.yaml", "--model_name_or_path", assets["model"],
                      "--dataset", assets["data"], "--max_steps", "3")
    assert done.returncode == 1, done.stdout + done.stderr[-4000:]  # 1: a run failed; the report is written
    return done, out


def summary_of(run_dir):
    return json.loads((run_dir / "shardscope_summary.json").read_text())


def table_rows(markdown):
    rows = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in markdown.splitlines()
            if line.startswith("| ") and not line.startswith("| run ")]
    return rows


def test_compare_runs_each_config_and_reports_the_failure(comparison):
    done, out = comparison
    progress = done.stdout.splitlines()
    assert progress[0].startswith("[1/3] ddp: started") and progress[1].startswith("[1/3] ddp: finished in ")
    assert progress[3].startswith("[2/3] fsdp_full_shard: finished in ")
    assert progress[5].startswith("[3/3] clip_mismatch: failed after ") and "ValueError" in progress[5]
    assert progress[6] == f"report: {out / 'report.md'} (2/3 runs succeeded)"
    assert progress[7].startswith("  failed: clip_mismatch: ValueError") and len(progress) == 8
    for name in ("ddp", "fsdp_full_shard", "clip_mismatch"):
        log = (out / name / "launch.log").read_text()
        assert log.startswith("$ ") and f"--output_dir {out / name}" in log.splitlines()[0]
    assert not (out / "clip_mismatch" / "shardscope_summary.json").exists()

    rows = {r["run"]: r for r in json.loads((out / "report.json").read_text())}
    failed = rows["clip_mismatch"]
    assert failed["status"] == "failed" and failed["exit_code"] != 0
    assert failed["reason"].startswith("ValueError: Please correct the following DeepSpeed config values")
    assert "gradient_clipping=0.5" in failed["reason"]
    md_rows = {r[0]: r for r in table_rows((out / "report.md").read_text())}
    assert md_rows["clip_mismatch"][-1] == f"failed: {failed['reason']}"


def test_report_values_equal_the_summaries(comparison):
    _, out = comparison
    rows = {r["run"]: r for r in json.loads((out / "report.json").read_text())}
    markdown = (out / "report.md").read_text()
    assert "CPU figures" in markdown and "![memory.png](memory.png)" in markdown
    md_rows = table_rows(markdown)
    for name in ("ddp", "fsdp_full_shard"):
        summary, row = summary_of(out / name), rows[name]
        ranks = summary["ranks"]
        assert row["status"] == "ok" and row["strategy"] == summary["strategy"] == name
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "peak_memory_bytes"):
            assert row[key] == {"min": min(r[key] for r in ranks), "max": max(r[key] for r in ranks)}
        assert row["tokens_per_s"] == pytest.approx(sum(r["throughput"]["tokens_per_s"] for r in ranks))
        assert row["samples_per_s"] == pytest.approx(sum(r["throughput"]["samples_per_s"] for r in ranks))
        state = json.loads((out / name / "trainer_state.json").read_text())["log_history"]
        assert row["final_loss"] == [e["loss"] for e in state if "loss" in e][-1]
        assert row["train_runtime_s"] == state[-1]["train_runtime"]
        # the Markdown row shows the same numbers; the planner's row follows it and agrees on model states
        i = next(i for i, r in enumerate(md_rows) if r[0] == name)
        measured, planned = md_rows[i], md_rows[i + 1]
        assert measured[2:5] == [compare.human_bytes(ranks[0][k]) for k in ("params_bytes", "grads_bytes",
                                                                            "optimizer_bytes")]
        assert measured[5] == "0 B"  # frozen models/rank: the Trainer holds no other model here
        assert measured[7] == f"{sum(r['throughput']['tokens_per_s'] for r in ranks):,.0f}"
        assert measured[10] == "-"  # MFU: no CPU peak, omitted
        assert measured[12] == f"{row['final_loss']:.4g}" and measured[-1] == "ok"
        assert planned[0] == "↳ planner" and planned[2:5] == measured[2:5]
        assert planned[-1] == "model states +0.0% vs plan"
    # FSDP really sharded (not accelerate's silent DDP fallback): each rank holds about half of everything
    ddp, fsdp = rows["ddp"], rows["fsdp_full_shard"]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert fsdp[key]["max"] == pytest.approx(ddp[key]["max"] / 2, rel=0.02), key


@pytest.mark.parametrize("name, size, colours", [
    ("memory.png", (800, 320), [(31, 119, 180), (255, 127, 14), (44, 160, 44), (148, 103, 189)]),
    ("throughput.png", (480, 320), [(23, 190, 207)]),
])
def test_plots_are_drawn(comparison, name, size, colours):
    _, out = comparison
    image = Image.open(out / name).convert("RGB")
    assert image.size == size
    assert max(ImageStat.Stat(image.convert("L")).stddev) > 20  # not blank
    present = {colour for _, colour in image.getcolors(maxcolors=size[0] * size[1])}
    for colour in colours:  # params / grads / optimizer stacks and peak bars; throughput bars
        assert colour in present, f"{name}: no bar drawn in {colour}"


def test_peak_planned_beside_measured(comparison, capsys):
    """The peak table: per run, the measured peak is the summary's (its largest rank); the planned one is what
    `plan --model` gives for that run's setup, stated here from the summary's raw figures (its model folder, 2 ranks,
    fp32, the rank's step: demo_tiny's micro-batch 8, its tokens); the error is computed here from the two."""
    from shardscope.cli import main

    _, out = comparison
    markdown = (out / "report.md").read_text()
    section = markdown.split("## Peak memory of one step: planned vs measured", 1)[1].split("\n## ", 1)[0]
    cells = {r[0]: r for r in table_rows(section)}
    assert set(cells) == {"ddp", "fsdp_full_shard"}  # the failed run has no summary, hence no row
    rows = {r["run"]: r for r in json.loads((out / "report.json").read_text())}
    for name in ("ddp", "fsdp_full_shard"):
        summary = summary_of(out / name)
        worst = max(summary["ranks"], key=lambda r: r["peak_tensor_bytes"])
        step = worst["peak_step"]
        assert step["micro_batch"] == 8 and step["seq_len"] <= 96 and not step["gradient_checkpointing"]  # demo_tiny
        assert summary["world_size"] == 2 and summary["precision"] == "fp32"
        assert main(["plan", "--model", summary["model"]["name_or_path"], "--gpus", "2", "--precision", "fp32",
                     "--micro-batch", "8", "--seq-len", str(step["seq_len"]), "--json"]) == 0  # no GPU given: 0
        planned = next(r for r in json.loads(capsys.readouterr().out)["rows"] if r["strategy"] == name)
        measured = worst["peak_tensor_bytes"]
        assert cells[name][1] == f"8 x {step['seq_len']} tokens"
        assert cells[name][2] == f"{planned['peak_bytes']:,}"
        assert cells[name][3] == f"{measured:,} (rank {worst['rank']})"
        assert cells[name][4] == f"{(planned['peak_bytes'] - measured) / measured:+.2%}"
        assert cells[name][6] == f"{planned['peak_phase']} / {worst['peak_phase']}"
        assert cells[name][7] == "traced"
        peak = rows[name]["peak"]  # report.json: what the plot stacks
        assert peak["measured"]["peak_breakdown"] == worst["peak_breakdown"]
        assert peak["planned"]["peak_breakdown"] == planned["peak_breakdown"]
        assert sum(peak["planned"]["peak_breakdown"].values()) == planned["peak_bytes"]
    assert rows["clip_mismatch"].get("peak") is None
    assert "![peak.png](peak.png)" in markdown
    image = Image.open(out / "peak.png").convert("RGB")
    present = {colour for _, colour in image.getcolors(maxcolors=image.size[0] * image.size[1])}
    for colour in ((31, 119, 180), (44, 160, 44), (214, 39, 40)):  # parameters, optimizer, activations stacked
        assert colour in present, f"peak.png: no bar drawn in {colour}"


def test_report_from_run_dirs_matches_compare(comparison, tmp_path):
    _, out = comparison
    done = shardscope("report", out, "--output", tmp_path)  # a folder of run folders works too
    assert done.returncode == 1, done.stderr  # clip_mismatch failed
    # same rows (a folder's runs come in name order, compare's in --configs order)
    assert sorted(table_rows((tmp_path / "report.md").read_text())) == sorted(table_rows((out / "report.md").read_text()))


def test_strategies_cpu_benchmark_tables_the_comparison(comparison, tmp_path):
    """benchmarks/strategies_cpu.sh with COMPARED=1 on this comparison (its table and plots from a `compare`
    output, no launch of its own; its compare command is the one `comparison` runs, at its own sizes)."""
    _, out = comparison
    env = {**os.environ, "COMPARED": "1", "SKIP": "1", "RESULT": str(tmp_path / "strategies.md"),
           "IMG": str(tmp_path / "img"), "OUT": str(out)}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "strategies_cpu.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {}
    for row in table_rows((tmp_path / "strategies.md").read_text()):
        rows.setdefault(row[0], row)  # its own table first; compare's report.md, appended below, has rows too
    for name in ("ddp", "fsdp_full_shard"):
        assert rows[name][-1] == "ok" and float(rows[name][1].split()[0]) > 0 and int(rows[name][4]) >= 1
    assert rows["clip_mismatch"][-1].startswith("failed: ValueError")
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == [
        "strategies_cpu_memory.png", "strategies_cpu_peak.png", "strategies_cpu_throughput.png", "strategies_cpu_time.png"]


def test_report_errors_name_the_file(tmp_path):
    """No run at all is a usage error (2); a run whose summary is unusable is a failed row naming the file (1),
    and the report is still written, Markdown last."""
    empty = tmp_path / "empty"
    empty.mkdir()
    done = shardscope("report", empty, "--output", tmp_path / "report", timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("shardscope: error: ") and str(empty / "shardscope_summary.json") in done.stderr
    assert not (tmp_path / "report").exists()
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "shardscope_summary.json").write_text('{"world_size": 2, "strategy": ')
    done = shardscope("report", corrupt, "--output", tmp_path / "report", timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    row = json.loads((tmp_path / "report" / "report.json").read_text())[0]
    assert row["status"] == "failed" and str(corrupt / "shardscope_summary.json") in row["reason"]
    assert "malformed JSON" in row["reason"] and row["reason"] in (tmp_path / "report" / "report.md").read_text()


def test_launch_commands(tmp_path):
    acc = launching.launch_command("accelerate", "train.py", launcher_config("zero3", "accelerate"),
                                 ["--max_steps", "3"], tmp_path / "zero3", 2, ["--mixed_precision", "no"])
    assert acc[1:3] == ["launch", "--config_file"] and acc[3].endswith("accelerate_configs/zero3.yaml")
    assert acc[4:6] == ["--num_processes", "2"] and acc[6] == "--main_process_port"
    assert acc[8:] == ["--mixed_precision", "no", "train.py", "--max_steps", "3", "--output_dir", str(tmp_path / "zero3")]
    ds = launching.launch_command("deepspeed", "train.py", launcher_config("zero3", "deepspeed"), [],
                                tmp_path / "zero3", 2, ["--master_port", "1234"])
    assert ds[0].endswith("deepspeed") and ds[1:5] == ["--num_gpus", "2", "--master_port", "1234"]
    assert ds[5:9] == ["train.py", "--output_dir", str(tmp_path / "zero3"), "--deepspeed"]
    assert ds[9].endswith("ds_configs/zero3.json")
    with pytest.raises(compare.UsageError, match="'ddp' is not one of the shipped"):
        launcher_config("ddp", "deepspeed")


def test_failure_reason_picks_the_error_line():
    oom = ("[rank1]: Traceback (most recent call last):\n[rank1]: torch.OutOfMemoryError: CUDA out of memory. "
           "Tried to allocate 2.00 GiB\nsubprocess.CalledProcessError: Command '[...]' returned non-zero exit status 1.\n"
           "[shardscope compare] exit code 1 after 9.0 s\n")
    assert launching.failure_reason(oom) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    killed = "step 3\n  traceback : Signal 9 (SIGKILL) received by PID 42\n[shardscope compare] exit code 1 after 9.0 s\n"
    assert launching.failure_reason(killed) == "traceback : Signal 9 (SIGKILL) received by PID 42"
