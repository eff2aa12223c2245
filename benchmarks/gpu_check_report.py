"""`gpu_check.py`'s report: its raw figures (the plans, the workers' JSON lines) as results/gpu_check.md.

Pure: reads the raw dict, computes each comparison from a stated formula, writes Markdown. Error = (predicted -
measured) / measured. A run's steps: 1-10; the callback instruments steps 3 (memory, collectives) and 4 (time
breakdown), which its throughput window leaves out; step 1 starts at its first forward (after the callback's live
plan), as the callback's clock does.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugin"))
from shardscope.summary import upgraded  # noqa: E402
INSTRUMENTED = (3, 4)
MEMORY_STEP, TIME_STEP = 3, 4
LEFT_BEHIND = ("Allocated before the model: what the earlier settings of the same process left allocated (each "
               "process runs its strategy's four settings one after another); every measured peak is taken less it. "
               "DeepSpeed keeps each ZeRO-3 engine alive after its Trainer is gone, with or without the callback (seen "
               "on CPU too), so each later ZeRO-3 setting starts with the earlier ones' states allocated.")
OPTIMIZER = "the Trainer's default optimizer (adamw_torch_fused on torch 2.8 and later)"
BREAKDOWN = ("parameters", "gradients", "optimizer", "activations", "temporaries", "buffers")


def gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def pct(predicted, measured) -> str:
    if predicted is None or not measured:
        return "-"
    return f"{(predicted - measured) / measured:+.1%}"


def seconds(s) -> str:
    return "-" if s is None else f"{s * 1000:.1f} ms"


def runs(raw: dict) -> list[tuple[dict, dict]]:
    """(worker header, setting row) of every setting that trained."""
    out = []
    for worker in raw.get("workers", []):
        header = next((x for x in worker["lines"] if "device_used_before" in x), {})
        out += [(header, x) for x in worker["lines"] if "summary" in x]
    return out


def label(row: dict) -> str:
    return (f"{row['strategy']} {row['micro_batch']}x{row['seq_len']}"
            + (" ckpt" if row["checkpointing"] else ""))


def key(row: dict) -> str:
    return f"{row['micro_batch']}x{row['seq_len']}{'-ckpt' if row['checkpointing'] else ''}"


def planned(raw: dict, row: dict, plans: dict | None = None) -> dict:
    """The plan's row for this run's strategy and setting ({} where the plan failed); `plans`: other plans of the
    same settings (`replanned`), else the GPU machine's."""
    name = raw["strategies"][row["strategy"]]
    plans = raw["plans"] if plans is None else plans
    return next((r for r in plans.get(key(row), {}).get("rows", []) if r["strategy"] == name), {})


def by_step(mapping: dict) -> dict:
    return {int(k): v for k, v in mapping.items()}


def steady_peak(row: dict) -> tuple[int | None, int | None]:
    """(the largest allocator peak of steps 2 on, less what was allocated before the model; its step)."""
    peaks = {s: p["allocated"] for s, p in by_step(row["peaks"]).items() if s >= 2}
    if not peaks:
        return None, None
    step = max(peaks, key=peaks.get)
    return peaks[step], step


def window(row: dict) -> list[float]:
    """CUDA-event spans of the steps the callback's throughput window counts (instrumented steps left out)."""
    return [s for step, s in sorted(by_step(row["spans_s"]).items()) if step not in INSTRUMENTED]


def rank0(row: dict) -> dict:
    """Rank 0 of the run's summary, under today's key names (`summary.upgraded`: the raw figures keep what the
    profiler wrote then)."""
    return (upgraded(row["summary"]).get("ranks") or [{}])[0]


def memory_table(raw: dict) -> list[str]:
    lines = ["| run | planned peak (activations) | measured peak (step) | error | step 1 | max reserved | phase planned "
             "| measured: forward + backward / optimizer step | allocated before the model |",
             "|---|---|---|---|---|---|---|---|---|"]
    for _, row in runs(raw):
        plan = planned(raw, row)
        peak, step = steady_peak(row)
        first = by_step(row["peaks"]).get(1, {}).get("allocated")
        reserved = max((p["reserved"] for p in row["peaks"].values()), default=None)
        lines.append(f"| {label(row)} | {gb(plan.get('peak_bytes'))} ({plan.get('activations_source', '-')}) | "
                     f"{gb(peak)} ({step}) | "
                     f"{pct(plan.get('peak_bytes'), peak)} | {gb(first)} | {gb(reserved)} | "
                     f"{plan.get('peak_phase', '-')} | {phases(row)} | {gb(row['base_allocated'])} |")
    return lines


def replanned_table(raw: dict) -> list[str]:
    """This tree's plans of the same settings beside the same measurements: a development set (the planner was
    changed after these runs were seen), not an out-of-sample figure."""
    again = raw.get("replanned")
    if not again:
        return []
    v = again["versions"]
    lines = [f"The same runs against the planner at commit {again['commit'][:12]}"
             f"{' with uncommitted changes' if again.get('dirty') else ''}, planned on a CPU with torch {v['torch']}, "
             f"transformers {v['transformers']}: the planner was changed after these runs were seen, so this is a "
             "development set, not an out-of-sample figure.", "",
             "| run | planned peak | measured peak | error | activations |", "|---|---|---|---|---|"]
    for _, row in runs(raw):
        plan, (peak, _) = planned(raw, row, again["plans"]), steady_peak(row)
        lines.append(f"| {label(row)} | {gb(plan.get('peak_bytes'))} | {gb(peak)} | {pct(plan.get('peak_bytes'), peak)} "
                     f"| {plan.get('activations_source', '-')} |")
    return lines


def phases(row: dict) -> str:
    """The largest allocator peaks of steps 2 on before and during the optimizer step (the Trainer's
    on_pre_optimizer_step between them)."""
    steps = [p for s, p in by_step(row["peaks"]).items() if s >= 2 and p.get("forward_backward") is not None]
    if not steps:
        return "-"
    return f"{gb(max(p['forward_backward'] for p in steps))} / {gb(max(p['optimizer_step'] for p in steps))}"


def outside_table(raw: dict) -> list[str]:
    """The GPU-only terms: what the device holds beyond the allocator's peak, against the planner's headroom."""
    lines = ["| run | reserved - allocated | outside the allocator (context, NCCL, libraries) | device use - "
             "planned peak | planner's headroom |", "|---|---|---|---|---|"]
    for header, row in runs(raw):
        plan, setup = planned(raw, row), raw["plans"].get(key(row), {}).get("setup", {})
        peaks = by_step(row["peaks"])
        slack = max((p["reserved"] - p["allocated"] - row["base_allocated"] for p in peaks.values()), default=None)
        used = row.get("device_used_end")
        outside = None if used is None or header.get("device_used_before") is None else \
            used - header["device_used_before"] - row["reserved_end"]
        reserved = max((p["reserved"] for p in peaks.values()), default=0) - row["base_allocated"]
        need = None if outside is None or not plan else reserved + outside - plan["peak_bytes"]
        room = None if not setup.get("gpu_memory_bytes") else setup["gpu_memory_bytes"] * setup["headroom"]
        verdict = "" if need is None or room is None else (" (within)" if need <= room else " (exceeds)")
        lines.append(f"| {label(row)} | {gb(slack)} | {gb(outside)} | {gb(need)}{verdict} | {gb(room)} |")
    return lines


def outside_lines(raw: dict) -> list[str]:
    out, seen = [], set()
    for worker in raw.get("workers", []):
        header = next((x for x in worker["lines"] if "device_used_before" in x), None)
        if header and worker["strategy"] not in seen:  # (the first process of each strategy)
            seen.add(worker["strategy"])
            out.append(f"- {worker['strategy']}: the CUDA context {gb(header.get('context_bytes'))} GB"
                       + (f", NCCL's communicator (a one-rank group, one all_reduce) {gb(header['nccl_bytes'])} GB"
                          if header.get("nccl_bytes") is not None else "")
                       + " (NVML's device use less the allocator's reserved bytes)")
    return out


def callback_table(raw: dict) -> list[str]:

    lines = ["| run | callback's step-3 peak | allocator's step-3 peak | error | by category (GB) | phase | "
             "live plan | its error vs the run's peak |", "|---|---|---|---|---|---|---|---|"]
    for _, row in runs(raw):
        rank = rank0(row)
        tensor = rank.get("peak_tensor_bytes")
        step3 = by_step(row["peaks"]).get(MEMORY_STEP, {}).get("allocated")
        parts = rank.get("peak_breakdown") or {}
        split = ", ".join(f"{p} {gb(parts[p])}" for p in BREAKDOWN if parts.get(p))
        live = (upgraded(row["summary"]).get("live_plan") or {}).get("peak_bytes")  # (earlier: preflight_plan)
        peak, _ = steady_peak(row)
        lines.append(f"| {label(row)} | {gb(tensor)} | {gb(step3)} | {pct(tensor, step3)} | {split or '-'} | "
                     f"{rank.get('peak_phase', '-')} | {gb(live)} | {pct(live, peak)} |")
    return lines


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def time_table(raw: dict) -> list[str]:
    lines = ["| run | predicted step (compute + optimizer + overhead) | measured (CUDA events, median) | error | "
             "callback's step_seconds median | step 4 breakdown: forward, backward, optimizer |",
             "|---|---|---|---|---|---|"]
    for _, row in runs(raw):
        plan, rank = planned(raw, row), rank0(row)
        parts = plan.get("step_time_parts") or {}
        shown = " + ".join(f"{seconds(parts.get(p))}" for p in ("compute", "optimizer", "overhead"))
        measured = median(window(row))
        breakdown = rank.get("time_breakdown") or {}
        split = ", ".join(seconds(breakdown.get(p)) for p in ("forward_s", "backward_s", "optimizer_s"))
        lines.append(f"| {label(row)} | {seconds(plan.get('step_time_s'))} = {shown} | {seconds(measured)} | "
                     f"{pct(plan.get('step_time_s'), measured)} | "
                     f"{seconds((rank.get('step_seconds') or {}).get('median'))} | {split} |")
    return lines


def recompute_lines(raw: dict) -> list[str]:
    """Checkpointing's step-time ratio, measured against predicted, for each strategy and shape run both ways."""
    found = {(r["strategy"], r["micro_batch"], r["seq_len"], r["checkpointing"]): r for _, r in runs(raw)}
    out = []
    for (strategy, mb, seq, ckpt), row in sorted(found.items()):
        base = found.get((strategy, mb, seq, False))
        if not ckpt or base is None:
            continue
        measured = median(window(row)) / median(window(base))
        plan_on, plan_off = planned(raw, row), planned(raw, base)
        predicted = plan_on["step_time_s"] / plan_off["step_time_s"] if plan_on and plan_off else None
        fb = rank0(base).get("time_breakdown") or {}
        compute = (fb.get("forward_s") or 0) + (fb.get("backward_s") or 0)
        share = (median(window(row)) - median(window(base))) / compute if compute else None
        out.append(f"- {strategy} {mb}x{seq}: checkpointing's step-time ratio measured {measured:.3f}, predicted "
                   + (f"{predicted:.3f}" if predicted else "-")
                   + (f"; measured recompute share {share:.2f} of the step's forward + backward (step 4 without "
                      "checkpointing), the model's 0.23" if share is not None else ""))
    return out


def compute_table(raw: dict) -> list[str]:
    lines = ["| run | callback's compute_seconds | CUDA events less NCCL's durations, same steps | difference | "
             "NCCL durations subtracted | steps (callback / here) |", "|---|---|---|---|---|---|"]
    for _, row in runs(raw):
        rank, spans = rank0(row), window(row)
        comm = sum(v for step, v in by_step(row.get("comm_ms") or {}).items() if step not in INSTRUMENTED) / 1000
        compute = (rank.get("throughput") or {}).get("compute_seconds")
        total = sum(spans) - comm if spans else None
        lines.append(f"| {label(row)} | {seconds(compute)} | {seconds(total)} | {pct(compute, total)} | "
                     f"{seconds(comm)} | {(rank.get('step_seconds') or {}).get('steps', '-')} / {len(spans)} |")
    return lines


def flops_per_token(seq_len: int, params: int) -> float:
    """The callback's FLOPs convention for this model (every parameter in a matmul: its embedding is tied to the
    head): 6 x N + 12 x layers x heads x head_dim x seq."""
    config = json.loads((ROOT / "plugin/shardscope/model_configs/llama-3.2-1b/config.json").read_text())
    d_attn = config["num_attention_heads"] * config.get("head_dim", config["hidden_size"] //
                                                         config["num_attention_heads"])
    return 6 * params + 12 * config["num_hidden_layers"] * d_attn * seq_len


def mfu_table(raw: dict) -> list[str]:
    from shardscope.units import peak_flops

    peak = peak_flops(raw["gpu"]["name"], "bf16")
    lines = [f"Peak: {peak / 1e12:.1f} TFLOP/s (the datasheet's dense bf16 figure the callback looks up by device "
             f"name, '{raw['gpu']['name']}')." if peak else "No datasheet peak for this device: MFU is left out.", "",
             "| run | callback's MFU | FLOPs / CUDA-event time / peak | difference | callback's TFLOP/s |",
             "|---|---|---|---|---|"]
    for _, row in runs(raw):
        rank, spans = rank0(row), window(row)
        params = (raw["plans"].get(key(row), {}).get("model") or {}).get("params_total")
        tokens = row["micro_batch"] * row["seq_len"] * len(spans)
        mine = None if not (peak and params and spans) else \
            flops_per_token(row["seq_len"], params) * tokens / sum(spans) / peak
        throughput = rank.get("throughput") or {}
        mfu, tflops = throughput.get("mfu"), throughput.get("tflops_per_device")
        tflops = "-" if tflops is None else f"{tflops:.1f}"
        lines.append(f"| {label(row)} | {'-' if mfu is None else f'{mfu:.1%}'} | "
                     f"{'-' if mine is None else f'{mine:.1%}'} | {pct(mfu, mine)} | "
                     f"{tflops} |")
    return lines


def flight_recorder_lines(raw: dict) -> list[str]:
    found = [x["flight_recorder"] for w in raw.get("workers", []) for x in w["lines"] if "flight_recorder" in x]
    if not found:
        return ["Not run (the FSDP2 worker did not reach it)."]
    fr = found[0]
    if "error" in fr:
        return [f"Failed: `{fr['error']}`"]
    out = [f"- {name}: {d['entries']} entries, {d['with_duration']} with an NCCL duration; kinds: "
           f"{', '.join(d['kinds']) or '-'}" for name, d in (fr.get("dumpers") or {}).items()]
    read = fr.get("shardscope_entries") or {}
    out.append(f"- read by shardscope (`collective_log.ring_entries`, what cuda_compute and the hang records use): "
               f"{read.get('entries')} entries, {read.get('with_duration')} with a duration; a hang record's "
               f"collectives: {json.dumps(fr.get('recent'))}")
    for record in fr.get("records") or []:
        seen = record.get("collectives") or {}
        out.append(f"- `shardscope hang`'s reader, the ring dumped by {fr.get('pickle_dumper')} as on a timeout: "
                   f"event {record.get('event')}, rank {record.get('rank')}, source {seen.get('source')}, last "
                   f"completed {json.dumps(seen.get('last_completed'))}, pending {len(seen.get('pending') or [])}")
    if fr.get("unreadable"):
        out.append(f"- unreadable: {json.dumps(fr['unreadable'])}")
    return out


def failure_lines(raw: dict) -> list[str]:
    out = []
    for worker in raw.get("workers", []):
        for line in worker["lines"]:
            if "error" in line:
                out.append(f"- {worker['strategy']} {key(line)}: `{line['error'][:300]}`")
        if worker["exit"] != 0:
            tail = worker.get("log_tail", "").splitlines()[-6:]
            out.append(f"- {worker['strategy']} process: exit {worker['exit']}; log tail:")
            out += [f"    {t[:200]}" for t in tail]
    for name, plan in raw.get("plans", {}).items():
        if "error" in plan:
            out.append(f"- plan {name}: {plan['error']}")
    return out or ["None."]


def spread(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    low, high = min(values), max(values)
    return f"{low:+.1%}" if abs(high - low) < 5e-4 else f"{low:+.1%} to {high:+.1%}"


def error(predicted, measured) -> float | None:
    return None if predicted is None or not measured else (predicted - measured) / measured


def summary_lines(raw: dict) -> list[str]:
    """One line per check, each a range over the runs of a strategy (errors as in the tables below)."""
    out = []
    for strategy in raw["strategies"]:
        mine = [r for _, r in runs(raw) if r["strategy"] == strategy]
        if not mine:
            continue
        here = (raw.get("replanned") or {}).get("plans")
        plans = [error(planned(raw, r).get("peak_bytes"), steady_peak(r)[0]) for r in mine]
        again = [error(planned(raw, r, here).get("peak_bytes"), steady_peak(r)[0]) for r in mine] if here else []
        callback = [error(rank0(r).get("peak_tensor_bytes"), by_step(r["peaks"]).get(MEMORY_STEP, {}).get("allocated"))
                    for r in mine]
        compute = [error((rank0(r).get("throughput") or {}).get("compute_seconds"), sum(window(r)) - sum(
            v for s, v in by_step(r.get("comm_ms") or {}).items() if s not in INSTRUMENTED) / 1000) for r in mine]
        out.append(f"- {strategy} ({raw['strategies'][strategy]} row), {len(mine)} runs: planned peak vs CUDA's "
                   f"allocator {spread(plans)} (plans made on the GPU machine)"
                   + (f", {spread(again)} (this tree's plans: a development set)" if again else "")
                   + f"; the callback's step peak vs the allocator's {spread(callback)}; compute_s vs CUDA events "
                   f"{spread(compute)}")
    return out


def report(raw: dict, checks, two_gpus) -> str:
    v, gpu = raw["versions"], raw["gpu"]
    head = [
        "# GPU check: shardscope's CUDA paths against a real device", "",
        f"Generated by `benchmarks/gpu_check.py` on {raw['date']} at commit {raw['commit'][:12]}: {gpu['name']} "
        f"({gpu['memory_bytes'] / 2 ** 30:.1f} GiB), driver {gpu['driver']}, torch {v['torch']} (CUDA {v['cuda']}), "
        f"transformers {v['transformers']}, accelerate {v['accelerate']}, deepspeed {v['deepspeed']}, Python "
        f"{v['python']}. The llama-3.2-1b config with random weights, bf16 mixed precision, {raw.get('optimizer', OPTIMIZER)}, {raw['steps']} "
        f"steps per setting, random tokens (no padding). Plans took {raw.get('plan_seconds')} s, the whole check "
        f"{raw.get('seconds')} s. Error = (predicted - measured) / measured. GB = 1e9 bytes.", ""]
    head += ["<!-- part:summary -->", *summary_lines(raw), "<!-- /part:summary -->", ""]
    sections = [
        ("1. Planner peak vs CUDA's allocator", memory_table(raw) + ["", LEFT_BEHIND, "", *replanned_table(raw), ""]
         + outside_lines(raw) + [""] + outside_table(raw)),
        ("2. The callback's peak by category", callback_table(raw)),
        ("3. Step time vs the datasheet prediction", time_table(raw) + [""] + recompute_lines(raw)),
        ("4. cuda_compute's compute_s vs independent CUDA events", compute_table(raw)),
        ("5. MFU", mfu_table(raw)),
        ("6. The flight recorder on a one-rank NCCL group", flight_recorder_lines(raw)),
        ("7. What needs 2+ GPUs", [f"- {what}: `{command}`" for what, command in two_gpus]),
        ("Failures", failure_lines(raw)),
    ]
    body = []
    for (title, lines), check in zip(sections, [*checks, None, None, None]):
        body += [f"## {title}", ""]
        if check:
            body += [f"Runs: {check[2]}. Compared: {check[3]}.", ""]
        body += [*lines, ""]
    return "\n".join(head + body).rstrip() + "\n"
