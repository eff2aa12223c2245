"""`report`/`compare`'s peak section: the planner's peak of one step beside the measured one, by part.

From each run's `report.plan_vs_run` result (the same plan as `plan --against`): per rank, the measured
`peak_tensor_bytes` / `peak_breakdown` of the profiler's instrumented step and the planner's `peak_bytes` /
`peak_breakdown` for that rank's own step (its micro-batch, sequence or image size and checkpointing, from
the summary's `peak_step`; ZeRO's reduce bucket as the run's optimizer had it). A run is shown by the rank
whose measured peak is largest (the one that decides whether a run fits), with the spread of the
error over all ranks. Error = (planned - measured) / measured, as the planner's 5% bound reads.
Both breakdowns have `buffers`: planned, ZeRO's reduce buckets and DDP's reducer buckets; measured, DDP's reducer
buckets only (torch's MemTracker files ZeRO's under the tensors they hold, gradients), so the totals compare like
for like and the parts only roughly.
"""
from __future__ import annotations

# Stack order and colour of each part (the measured parts are peak.BREAKDOWN; planned adds frozen).
COLOURS = {"parameters": "tab:blue", "gradients": "tab:orange", "optimizer": "tab:green", "activations": "tab:red",
           "temporaries": "tab:purple", "buffers": "tab:gray", "frozen": "tab:brown"}


def row_facts(plan: dict | None) -> dict:
    """{"peak": {rank, step, planned, measured, error, errors: [min, max]} of the rank with the largest measured
    peak}, or {"peak": None} when no rank has a measured peak and step shape (or there is no plan)."""
    ranks = [r for r in (plan or {}).get("ranks", []) if r.get("peak")]
    if not ranks:
        return {"peak": None}
    worst = max(ranks, key=lambda r: r["peak"]["measured"]["peak_tensor_bytes"])
    errors = [r["peak"]["error"] for r in ranks if r["peak"]["error"] is not None]
    return {"peak": {"rank": worst["rank"], **worst["peak"], "errors": [min(errors), max(errors)] if errors else None,
                     "trace_note": plan.get("trace_note")}}


def step_size(step: dict) -> str:
    """`2 x 256 tokens`, `2 x 224 px images` or `2 rows`: the planned step's micro-batch and input size."""
    size = f" x {step['seq_len']} tokens" if step.get("seq_len") is not None else \
        f" x {step['image_size']} px images" if step.get("image_size") else " rows"
    return f"{step['micro_batch']}{size}"


def step_label(step: dict) -> str:
    """`2 x 256 tokens, checkpointing`: what the planned step was."""
    return step_size(step) + (", checkpointing" if step.get("gradient_checkpointing") else "")


def percent(error) -> str:
    return "-" if error is None else f"{round(error, 4) + 0.0:+.2%}"


def markdown_lines(runs: list[dict]) -> list[str]:
    """The planned-vs-measured peak table (nothing when no run has a measured peak)."""
    shown = [r for r in runs if r.get("peak")]
    if not shown:
        return []
    lines = ["## Peak memory of one step: planned vs measured", "",
             "Measured: the profiler's instrumented step (torch's MemTracker, live tensors; `peak_tensor_bytes`), the "
             "rank with the largest peak. Planned: `shardscope plan`'s `peak_bytes` for that rank's own step "
             "(`report.plan_vs_run`, as `plan --against`). Error = (planned - measured) / measured; the range is "
             "over all ranks. Bytes exact (B).", "",
             "| run | step | planned peak | measured peak | error | error, all ranks | phase planned / measured "
             "| activations |", "|" + "---|" * 8]
    for r in shown:
        p = r["peak"]
        spread = "-" if p["errors"] is None else f"{percent(p['errors'][0])} .. {percent(p['errors'][1])}"
        lines.append(f"| {r['run']} | {step_label(p['step'])} | {p['planned']['peak_bytes']:,} | "
                     f"{p['measured']['peak_tensor_bytes']:,} (rank {p['rank']}) | {percent(p['error'])} | {spread} | "
                     f"{p['planned']['peak_phase']} / {p['measured']['peak_phase']} | "
                     f"{p['planned']['activations_source']} |")
    notes = sorted({r["peak"]["trace_note"] for r in shown if r["peak"].get("trace_note")})
    return lines + [""] + [f"- {note}" for note in notes] + ([""] if notes else [])


def plot_peak(runs: list[dict], path, title: str = ""):
    """One panel per run (each its own scale: a 2 GB ZeRO bucket would flatten a 100 MB DDP run), with two bars,
    planned (hatched) and measured, each stacked by part, in MB."""
    import math

    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    cols = max(1, min(4, len(runs)))
    rows = max(1, math.ceil(len(runs) / cols))
    height = 2.6 * rows + 1.2
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols + 0.6, height), squeeze=False)
    used = set()
    for ax, r in zip(axes.flat, runs):
        p = r.get("peak")
        ax.set_title(r["run"] + (f"\nplanned {percent(p['error'])}" if p else ""), fontsize=9)
        if not p:  # a failed run, or a summary without a measured step
            ax.set_axis_off()
            ax.text(0.5, 0.5, "failed" if r.get("status") != "ok" else "no measured peak", ha="center",
                    transform=ax.transAxes, fontsize=9, color="tab:red" if r.get("status") != "ok" else "black")
            continue
        ax.set_xticks([0, 1], ["planned", "measured"], fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
        for x, parts, hatch in ((0, p["planned"]["peak_breakdown"], "//"), (1, p["measured"]["peak_breakdown"], None)):
            bottom = 0.0
            for part, colour in COLOURS.items():
                value = (parts.get(part) or 0) / 1e6
                if value:
                    ax.bar(x, value, 0.7, bottom=bottom, color=colour, hatch=hatch, edgecolor="white")
                    used.add(part)
                    bottom += value
        ax.set_ylim(0, ax.get_ylim()[1] * 1.05)
    for ax in axes.flat[len(runs):]:
        ax.set_visible(False)
    fig.supylabel("MB (1e6 B) per rank", fontsize=8)
    handles = [Patch(color=colour, label=part) for part, colour in COLOURS.items() if part in used]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="planned"))
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Peak of one step per rank: planned vs measured" + (f" ({title})" if title else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0.55 / height, 1, 1))  # the legend's two rows below the panels
    fig.savefig(path, dpi=80)
    plt.close(fig)


def steps_of(summary: dict) -> list[dict]:
    """Each rank's measured steps (the summary's `measured_steps`: tokens, padded tokens, peak), rank added."""
    return [{**step, "rank": i} for i, rank in enumerate(summary.get("ranks") or [])
            for step in (rank.get("measured_steps") or []) if isinstance(step, dict)]


def plot_steps(runs: list[dict], path, title: str = ""):
    """Each measured step's peak against its padded tokens (what sets it), one colour per run, the worst ringed."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    shown = 0
    for r in runs:
        steps = [s for s in r.get("measured_steps") or [] if s.get("padded_tokens") and s.get("peak_tensor_bytes")]
        if not steps:
            continue
        shown += 1
        points = ax.scatter([s["padded_tokens"] for s in steps], [s["peak_tensor_bytes"] / 1e6 for s in steps],
                            s=18, label=r["run"])
        worst = max(steps, key=lambda s: s["peak_tensor_bytes"])
        ax.scatter([worst["padded_tokens"]], [worst["peak_tensor_bytes"] / 1e6], s=90, facecolors="none",
                   edgecolors=points.get_facecolor()[0])
    if not shown:
        ax.text(0.5, 0.5, "no measured steps (summaries before measured_steps)", ha="center", transform=ax.transAxes,
                fontsize=9)
    else:
        ax.legend(fontsize=7, frameon=False)
    ax.set_xlabel("padded tokens in the step (rows x length, per rank)", fontsize=8)
    ax.set_ylabel("peak, MB (1e6 B) per rank", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_title("Each measured step's peak against its tokens (ringed: the worst)" + (f" ({title})" if title else ""),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
