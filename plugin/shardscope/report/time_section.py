"""`report`/`compare`'s view of where each strategy's step time goes, beside the bytes it puts on the wire.

From each summary: `time_breakdown` (per rank, `measure/time_breakdown.py`) averaged over ranks into five stacked parts,
compute (forward + backward), exposed communication, optimizer, data and other, and
`comm_sent_bytes_per_step` (`comm_count.py`, the most any rank sends). One sentence per strategy says where
its extra time went against the fastest run: the parts that grew most, and the bytes it sends beside the
fastest run's. A run whose summary names a straggler gets one sentence more.
"""
from __future__ import annotations

from ..measure.stragglers import line as straggler_line
from ..summary import numbers

STACK = (("compute", ("forward_s", "backward_s"), "tab:blue"), ("exposed comm", ("exposed_comm_s",), "tab:red"),
         ("optimizer", ("optimizer_s",), "tab:green"), ("data", ("data_wait_s",), "tab:gray"),
         ("other", ("other_s",), "tab:olive"))


def row_facts(summary: dict) -> dict:
    """{"time": {part: seconds, "step", "comm in flight"} averaged over ranks (None when no rank was timed),
    "comm_sent_bytes_per_step": max over ranks, "straggler": the summary's}."""
    ranks = [r for r in summary["ranks"] if isinstance(r, dict)]
    timed = [r["time_breakdown"] for r in ranks if isinstance(r.get("time_breakdown"), dict)]
    keys = ("step_s", "comm_s", *(k for _, parts, _ in STACK for k in parts))
    time = None
    if timed and all(len(numbers(t.get(k) for k in keys)) == len(keys) for t in timed):
        def mean(parts):
            return sum(sum(t[k] for k in parts) for t in timed) / len(timed)

        time = {name: mean(parts) for name, parts, _ in STACK} | {"step": mean(("step_s",)),
                                                                    "comm in flight": mean(("comm_s",))}
    sent = numbers(r.get("comm_sent_bytes_per_step") for r in ranks)
    return {"time": time, "comm_sent_bytes_per_step": max(sent) if sent else None,
            "straggler": summary.get("straggler")}


def where_time_went(row: dict, fastest: dict, human_bytes) -> str:
    """One sentence: this run's step against the fastest run's, by the parts that grew most."""
    time, base = row["time"], fastest["time"]
    wire = f"it sends {human_bytes(row['comm_sent_bytes_per_step'])} per rank per step"
    if row is fastest:
        return f"{row['run']}: the fastest step here, {time['step']:.3g} s; {wire}."
    extra = time["step"] - base["step"]
    grew = sorted(((time[name] - base[name], name) for name, _, _ in STACK), reverse=True)
    parts = ", ".join(f"{name} +{delta:.2g} s" for delta, name in grew if delta > 0.1 * max(extra, 1e-9))
    return (f"{row['run']}: {time['step']:.3g} s per step, {extra:+.2g} s against {fastest['run']}, "
            f"mostly {parts or 'spread over every part'}; {wire} "
            f"(vs {human_bytes(fastest['comm_sent_bytes_per_step'])}).")


def straggler_lines(runs: list[dict]) -> list[str]:
    """One sentence per run whose summary names a straggler (`measure/stragglers.py`)."""
    named = [(r["run"], straggler_line(r.get("straggler"))) for r in runs]
    named = [f"- {run}: {said}" for run, said in named if said]
    return ["## Stragglers", "", *named, ""] if named else []


def markdown_lines(runs: list[dict], human_bytes) -> list[str]:
    """The time table and one sentence per timed run (nothing when no run was timed), then the stragglers."""
    timed = [r for r in runs if r.get("time")]
    if not timed:
        return straggler_lines(runs)
    fastest = min(timed, key=lambda r: r["time"]["step"])
    lines = ["## Where the step time goes", "",
             "One sampled step per run (`time_breakdown`, mean over ranks; excluded from throughput). Compute is "
             "forward + backward less the communication they waited on; exposed comm is the time a collective was "
             "in flight while no compute ran; comm in flight counts overlapped time too. Sent/rank/step: the "
             "collectives counted on one step, ring convention (`comm_sent_bytes_per_step`).", "",
             "| run | step | " + " | ".join(name for name, _, _ in STACK) + " | comm in flight | sent/rank/step |",
             "|" + "---|" * (len(STACK) + 4)]
    for r in timed:
        t = r["time"]
        cells = [r["run"], f"{t['step']:.3g} s", *(f"{t[name]:.3g} s" for name, _, _ in STACK),
                 f"{t['comm in flight']:.3g} s", human_bytes(r["comm_sent_bytes_per_step"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [f"- {where_time_went(r, fastest, human_bytes)}" for r in timed] + [""]
    return lines + straggler_lines(runs)


def plot_time(runs: list[dict], path, title: str = ""):
    """Left: the sampled step stacked by part, per run. Right: bytes each rank sends per step."""
    import matplotlib.pyplot as plt

    fig, (steps, wire) = plt.subplots(1, 2, figsize=(10, 4))
    first = next((i for i, r in enumerate(runs) if r.get("time")), None)  # labels the legend once
    for i, r in enumerate(runs):
        if r.get("time"):
            bottom = 0.0
            for name, _, colour in STACK:
                steps.bar(i, r["time"][name] * 1e3, bottom=bottom * 1e3, color=colour, label=name if i == first else None)
                bottom += r["time"][name]
        if r.get("comm_sent_bytes_per_step") is not None:
            wire.bar(i, r["comm_sent_bytes_per_step"] / 1e6, color="tab:red")
    steps.set(title="one sampled step (ms), mean over ranks", ylabel="ms")
    steps.set_ylim(0, (steps.get_ylim()[1] or 1) * 1.3)
    if first is not None:
        steps.legend(fontsize=8, loc="upper center", ncol=3)
    wire.set(title="bytes sent per rank per step (MB, ring convention)", ylabel="MB (1e6 B)")
    for ax in (steps, wire):
        ax.set_xticks(range(len(runs)), [r["run"] for r in runs], rotation=20, ha="right")
    fig.suptitle(f"Where the step time goes ({title})" if title else "Where the step time goes")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
