"""`shardscope compare` and `shardscope report`: one recipe under several strategies, side by side.

    shardscope compare --recipe recipes/causal_lm_sft.py --configs ddp fsdp_full_shard zero2 zero3 \\
        --output-dir compare_out -- --config recipes/llama/llama2_7b_full.yaml --max_steps 50
    shardscope report compare_out/ddp compare_out/zero3 --output report/

`compare` launches the recipe once per config, one after the other, each into OUTPUT_DIR/<config>/ with
its combined output in OUTPUT_DIR/<config>/launch.log; a run that fails (non-zero exit, or no profiler
summary) is a result, not an error: it is reported as failed with the last error line of its log and
the other runs still go. Then it writes the report, exactly as `report` does from existing run folders.

Report (OUTPUT/report.md, report.json, memory.png, throughput.png, time.png, peak.png, steps.png: each measured
step's peak against its tokens): per run the profiler's per-rank model-state bytes (params, grads, optimizer incl.
fp32 masters; min-max across ranks), peak memory, throughput (tokens/s and samples/s summed over ranks; TFLOP/s and MFU per rank, mean), the Trainer's
train_runtime and last logged loss (from trainer_state.json), and the planner's estimate beside each
measured row (`report.plan_vs_run`). Runs on CPU are labelled CPU figures (peak = the instrumented step's
tensor peak, MemTracker). Where the step time goes, beside the bytes on the wire: `time_section.py`; the peak
of one step planned beside measured, by part: `peak_section.py`; a mixture of experts' load: `expert_section.py`.

Layout: launching (`shardscope.fit.launching`) -> collecting (`load_run`, `collect`) -> writing (`markdown`, `plot_memory`, `plot_throughput`, `write_report`) -> CLI.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

from ..errors import UsageError
from ..fit.launching import LOG_FILE, MAX_LOG_BYTES, exit_footer, failure_reason, no_summary_reason
from ..safe_io import atomic_write_bytes, atomic_write_text, load_json, read_bytes
from ..summary import COMPONENTS, SUMMARY_FILE, read_summary, reduce_ranks, spread
from . import expert_section, peak_section, time_prediction
from .time_section import markdown_lines, plot_time, row_facts

# Memory shown per rank: the trained model's states, then models held but not trained (a DPO reference).
HELD = (*COMPONENTS, "frozen_models_bytes")



# ----------------------------------------------------------------------------- collecting
def _run_dirs(paths: list[Path]) -> list[Path]:
    """Each path that is a run folder (summary or launch log), else its run subfolders (compare's output)."""
    found = []
    for path in paths:
        if not path.is_dir():
            raise UsageError(f"'{path}' is not a directory")
        if (path / SUMMARY_FILE).exists() or (path / LOG_FILE).exists():
            found.append(path)
            continue
        subdirs = sorted(p for p in path.iterdir() if (p / SUMMARY_FILE).exists() or (p / LOG_FILE).exists())
        if not subdirs:
            raise UsageError(f"no {SUMMARY_FILE} in '{path}' or its subdirectories (expected "
                             f"'{path / SUMMARY_FILE}', or a {LOG_FILE} for a failed run)")
        found += subdirs
    return found


def _trainer_facts(run_dir: Path) -> dict:
    """train_runtime and the last logged loss from trainer_state.json, when the recipe saved it."""
    path = run_dir / "trainer_state.json"
    if not os.path.lexists(path):
        return {}
    state = load_json(path, "trainer state", max_bytes=MAX_LOG_BYTES)
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise UsageError(f"'{path}' is not a valid trainer state (JSON object with log_history)")
    entries = [e for e in history if isinstance(e, dict)]
    losses = [e["loss"] for e in entries if isinstance(e.get("loss"), (int, float))]
    runtimes = [e["train_runtime"] for e in entries if isinstance(e.get("train_runtime"), (int, float))]
    return {"final_loss": losses[-1] if losses else None, "train_runtime_s": runtimes[-1] if runtimes else None}


def load_run(run_dir: Path) -> dict:
    """One run folder -> one report row (raw numbers). A run whose files cannot be used (a corrupt or foreign
    summary, a FIFO, ...) is a failed row whose reason names the file: the other rows still get reported."""
    row = {"run": run_dir.name, "dir": str(run_dir), "exit_code": None, "launch_s": None}
    try:
        return _load_run(run_dir, row)
    except UsageError as error:
        return {**row, "status": "failed", "reason": str(error)}


def _load_run(run_dir: Path, row: dict) -> dict:
    from .plan_vs_run import plan_vs_run

    log = run_dir / LOG_FILE
    log_text = read_bytes(log, "launch log", MAX_LOG_BYTES, tail=True).decode(errors="replace") \
        if os.path.lexists(log) else ""
    footer = exit_footer(log_text)
    exit_code, launch_s = (int(footer[1]), float(footer[2])) if footer else (None, None)
    row.update(exit_code=exit_code, launch_s=launch_s)
    summary_path = run_dir / SUMMARY_FILE
    if not os.path.lexists(summary_path):
        return {**row, "status": "failed", "reason": no_summary_reason(exit_code, log_text)}
    summary = read_summary(summary_path)
    ranks = summary["ranks"]
    throughput = [r.get("throughput") if isinstance(r.get("throughput"), dict) else {} for r in ranks]
    rates = reduce_ranks(throughput, ("tflops_per_device", "mfu"), (summary.get("mesh") or {}).get("tp") or 1)
    row.update(
        status="ok" if not exit_code else "failed",
        reason=failure_reason(log_text) if exit_code else None,
        strategy=summary["strategy"], world_size=summary["world_size"], device=summary.get("device"),
        precision=summary.get("precision"), memory_kind=ranks[0].get("memory_kind"),
        model=(summary.get("model") or {}).get("name_or_path"),
        ranks=[{**{k: r.get(k) for k in (*COMPONENTS, "peak_memory_bytes")},
                "frozen_models_bytes": r.get("frozen_models_bytes") or 0} for r in ranks],
        **{k: spread([r.get(k) for r in ranks]) for k in (*HELD, "peak_memory_bytes")},
        tokens_per_s=rates["global_tokens_per_s"], samples_per_s=rates["global_samples_per_s"],
        tflops_per_device=(rates.get("tflops_per_device") or {}).get("mean"), mfu=(rates.get("mfu") or {}).get("mean"),
        **_trainer_facts(run_dir), **row_facts(summary), **expert_section.row_facts(ranks),
        measured_steps=peak_section.steps_of(summary),
    )
    try:
        planned = plan_vs_run(summary_path)
        row["planned"] = {c["component"]: c["planned"] for c in planned["ranks"][0]["components"]}
        row["planned"]["total_bytes"] = planned["planned_total_bytes"]
        row["planned"]["strategy"] = planned["strategy"]
        row.update(peak_section.row_facts(planned))
    except UsageError as error:  # e.g. a model folder that only existed on the cluster: report without it
        row.update(planned={"error": str(error)}, peak=None)
    return row


def collect(paths: list[Path]) -> list[dict]:
    return [load_run(d) for d in _run_dirs([Path(p) for p in paths])]


# ----------------------------------------------------------------------------- writing
def human_bytes(n) -> str:
    """Decimal units like the planner (1 GB = 1e9 B), 3 significant digits."""
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def human_range(spread: dict) -> str:
    low, high = human_bytes(spread["min"]), human_bytes(spread["max"])
    if low == high:
        return low
    same_unit = low.split()[-1] == high.split()[-1]
    return f"{low.split()[0] if same_unit else low}–{high}"


def _num(value, digits=3) -> str:
    return "-" if value is None else f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"


def _is_cpu(runs: list[dict]) -> bool:
    return any(r.get("device") == "cpu" for r in runs)


def caption(runs: list[dict]) -> str:
    ok = [r for r in runs if r["status"] == "ok"]
    ranks = sorted({r["world_size"] for r in ok})
    where = "CPU figures" if _is_cpu(runs) else ", ".join(sorted({str(r.get("device")) for r in ok})) or "no device"
    return f"{where}, {'/'.join(map(str, ranks)) or '?'} ranks"


HEADER = ("run", "strategy", "params/rank", "grads/rank", "optimizer/rank", "frozen models/rank", "peak memory/rank",
          "tokens/s",
          "samples/s", "TFLOP/s/rank", "MFU", "wall time", "final loss", "status")


def _cells(row: dict) -> list[str]:
    if "ranks" not in row:
        return [row["run"], "-", *["-"] * 11, f"failed: {row['reason']}"]
    wall = f"{_num(row.get('train_runtime_s'))} s" if row.get("train_runtime_s") is not None else "-"
    if row.get("launch_s") is not None:
        wall += f" (launch {row['launch_s']:.0f} s)"
    status = "ok" if row["status"] == "ok" else f"failed: {row['reason']}"
    return [row["run"], row["strategy"], *(human_range(row[k]) for k in HELD),
            human_range(row["peak_memory_bytes"]), _num(row["tokens_per_s"]), _num(row["samples_per_s"]),
            _num(row["tflops_per_device"]), "-" if row["mfu"] is None else f"{row['mfu']:.1%}", wall,
            _num(row.get("final_loss"), 4), status]


def _planner_cells(row: dict) -> list[str] | None:
    planned = row.get("planned")
    if not planned:
        return None
    if "error" in planned:
        return ["↳ planner", "-", *["-"] * 11, f"no estimate: {planned['error']}"]
    measured = sum(row[k]["max"] for k in COMPONENTS)
    states = sum(planned[k] for k in COMPONENTS)
    diff = f"model states {round((measured - states) / states, 3) + 0.0:+.1%} vs plan" if states else ""
    return ["↳ planner", planned["strategy"], *(human_bytes(planned[k]) for k in COMPONENTS),
            human_bytes(planned.get("frozen_models_bytes")), f"{human_bytes(planned['total_bytes'])} (est. total)",
            *["-"] * 6, diff]


def markdown(runs: list[dict], images: tuple[str, ...] = ()) -> str:
    cpu = _is_cpu(runs)
    lines = [f"# Strategy comparison ({caption(runs)})", ""]
    if cpu:
        lines += ["**CPU figures** (gloo ranks on CPU): peak memory is the peak of live tensors in one instrumented "
                  "step (torch's MemTracker), not GPU memory and not the process RSS; MFU is omitted (no CPU peak FLOP/s). Use them to compare "
                  "strategies' bytes per rank, not as GPU throughput.", ""]
    lines += ["Bytes are per rank (min–max across ranks, 1 kB = 1000 B); optimizer includes fp32 master copies; "
              "frozen models are models held but not trained (a DPO reference; `-`: not counted by that summary). "
              "tokens/s and samples/s are summed over ranks (whole run); TFLOP/s and MFU are per rank (mean). "
              "Wall time is the Trainer's train_runtime (launch: the whole launch, start-up included). "
              "Each `↳ planner` row is `shardscope plan`'s estimate for that run's strategy, world size and model "
              "(est. total: the planned peak of the run's instrumented step, where its summary records that step).",
              "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for row in runs:
        for cells in (_cells(row), _planner_cells(row)):
            if cells:
                lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines.append("")
    lines += markdown_lines(runs, human_bytes)
    lines += time_prediction.markdown_lines(runs)
    lines += peak_section.markdown_lines(runs)
    lines += expert_section.markdown_lines(runs)
    lines += [f"![{name}]({name})" for name in images]
    return "\n".join(lines) + "\n"


def _bar_labels(ax, runs: list[dict]):
    ax.set_xticks(range(len(runs)), [r["run"] for r in runs], rotation=20, ha="right")
    for i, r in enumerate(runs):
        if r["status"] != "ok":
            ax.text(i, 0, "failed", ha="center", va="bottom", color="tab:red", rotation=90)


def plot_memory(runs: list[dict], path):
    """Left: model states per rank (the rank holding most), stacked by component, planner estimate as a
    marker. Right: peak memory per rank (bar: max, tick: min)."""
    import matplotlib.pyplot as plt

    fig, (states, peak) = plt.subplots(1, 2, figsize=(10, 4))
    first = next((i for i, r in enumerate(runs) if "ranks" in r), None)  # labels the legend once
    for i, r in enumerate(runs):
        if "ranks" not in r:
            continue
        worst = max(r["ranks"], key=lambda rank: sum(rank[k] for k in HELD))
        bottom = 0
        for k, colour in zip(HELD, ("tab:blue", "tab:orange", "tab:green", "tab:gray")):
            states.bar(i, worst[k] / 1e6, bottom=bottom / 1e6, color=colour, label=k.split("_")[0] if i == first else None)
            bottom += worst[k]
        planned = r.get("planned") or {}
        if all(k in planned for k in COMPONENTS):
            states.plot(i, sum(planned[k] for k in COMPONENTS) / 1e6, "k_", markersize=28, mew=2,
                        label="planner" if not any(l.get_label() == "planner" for l in states.lines) else None)
        spread = r["peak_memory_bytes"]
        if spread["max"] is not None:
            peak.bar(i, spread["max"] / 1e6, color="tab:purple")
            peak.plot(i, spread["min"] / 1e6, "w_", markersize=20, mew=2)
    states.set(title="model states per rank (MB)", ylabel="MB (1e6 B)")
    states.set_ylim(0, states.get_ylim()[1] * 1.25)  # room for the legend above the bars
    if first is not None:  # every run failed: nothing to label
        states.legend(fontsize=8, loc="upper center", ncol=4)
    kind = "tensor peak of one step" if _is_cpu(runs) else "peak allocated"
    peak.set(title=f"peak memory per rank, {kind} (MB)\nbar: max over ranks, white tick: min")
    for ax in (states, peak):
        _bar_labels(ax, runs)
    fig.suptitle(f"Memory per rank by strategy ({caption(runs)})")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_throughput(runs: list[dict], path):
    """tokens/s (summed over ranks) per strategy, or samples/s where a run counts no tokens."""
    import matplotlib.pyplot as plt

    use_tokens = all(r.get("tokens_per_s") is not None for r in runs if "ranks" in r)
    key, label = ("tokens_per_s", "tokens/s") if use_tokens else ("samples_per_s", "samples/s")
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, r in enumerate(runs):
        if r.get(key) is not None:
            ax.bar(i, r[key], color="tab:cyan")
            ax.text(i, r[key], _num(r[key]), ha="center", va="bottom", fontsize=8)
    ax.set(title=f"Throughput by strategy ({caption(runs)})", ylabel=f"{label}, all ranks")
    _bar_labels(ax, runs)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_report(run_dirs: list[Path], output: Path, measured: list[tuple[str, dict]] | None = None) -> list[dict]:
    """Collect the runs, then write output/memory.png, throughput.png, time.png, peak.png, steps.png, report.json and,
    last,
    report.md; each file atomically (a reader sees the old file or the new one). Returns the rows. `measured`:
    the step-time model's figures [(source, figures)] from --calibrate (default: the first run's)."""
    import matplotlib

    matplotlib.use("Agg")
    runs = collect(run_dirs)
    time_prediction.attach(runs, measured)
    if output.exists() and not output.is_dir() or output.is_symlink() and not output.exists():
        raise UsageError(f"--output '{output}' is {'a file' if output.exists() else 'a dangling symlink'}, "
                         "not a folder")
    output.mkdir(parents=True, exist_ok=True)
    plots = {"memory.png": plot_memory, "throughput.png": plot_throughput,
             "time.png": lambda rows, image: plot_time(rows, image, caption(rows)),
             "peak.png": lambda rows, image: peak_section.plot_peak(rows, image, caption(rows)),
             "steps.png": lambda rows, image: peak_section.plot_steps(rows, image, caption(rows))}
    for name, plot in plots.items():
        image = io.BytesIO()
        plot(runs, image)
        atomic_write_bytes(output / name, image.getvalue(), "report")
    atomic_write_text(output / "report.json", json.dumps(runs, indent=2, allow_nan=False), "report")
    atomic_write_text(output / "report.md", markdown(runs, images=tuple(plots)), "report")
    return runs


def outcome(runs: list[dict], output: Path) -> int:
    """Print where the report is and how many runs failed; 1 when any did."""
    failed = [r for r in runs if r["status"] != "ok"]
    print(f"report: {output / 'report.md'} ({len(runs) - len(failed)}/{len(runs)} runs succeeded)")
    for row in failed:
        print(f"  failed: {row['run']}: {row['reason']}")
    return 1 if failed else 0
