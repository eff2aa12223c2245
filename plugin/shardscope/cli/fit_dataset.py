"""`fit --dataset`: the search decides on the dataset's worst micro-batch, not on one sequence length.

The recipe's default collator pads each micro-batch to its longest sample, so a micro-batch of b rows holds at worst
b x the longest sample (after `--max-length`), with an attention mask: `fit` searches at that length. Where nothing
fits there, a shorter `--max-length` (the lengths' p99, then p90: the samples above it are truncated) is searched.
The decision says what set it: the longest sample against the median (what fits at the median length does not fit
the tail), and what padding-free batching and packing would change at the winner's micro-batch (plan/batching.py).
"""
from __future__ import annotations

from ..plan.batching import batchings, data_facts, percentile, truncated
from .plan_dataset import dataset_lengths


def dataset_trials(lengths, max_length: int) -> list[tuple[int, str, str]]:
    """(length limit, batch inputs, why) to search in order: the whole data, then p99 and p90 as the limit."""
    items = lengths.sorted_items()
    longest = min(items[-1][0], max_length)
    inputs = "padded" if len(truncated(lengths, max_length)) > 1 else "unpadded"
    trials = [(longest, inputs, f"the longest sample ({longest:,} tokens after --max-length {max_length:,})")]
    for p in (99, 90):
        cut = percentile(items, p)
        if cut < trials[-1][0]:
            over = sum(c for v, c in items if v > cut)
            trials.append((cut, "padded", f"--max-length {cut:,} (p{p}): truncates {over:,} samples"))
    return trials


def fit_on_dataset(args, search_at) -> tuple[dict, dict]:
    """(`search_at(seq_len, batch_inputs)`'s found of the first trial that fits (or the last), the `data` facts with
    the decision). `search_at` runs fit's search at that sequence length and inputs."""
    lengths, max_length = dataset_lengths(args)
    median = percentile(lengths.sorted_items(), 50)
    trials = dataset_trials(lengths, max_length)
    for seq_len, inputs, why in trials:
        found = search_at(seq_len, inputs)
        if found["fitting"]:
            break
    facts = data_facts(lengths, min(seq_len, max_length), 1)
    decision = {"seq_len": seq_len, "batch_inputs": inputs, "decided_by": why, "median": median}
    if found["fitting"]:
        winner = found["fitting"][0]
        at_median = search_at(median, "unpadded")
        fastest = at_median["fitting"][0] if at_median["fitting"] else None
        decision["at_median"] = None if fastest is None else _setting(fastest)
        decision["flags"] = _flags(winner, seq_len)
        modes = batchings(lengths, seq_len, winner.per_device_train_batch_size)
        decision["batching"] = {m: b.as_dict() for m, b in modes.items()}
    return found, {**facts, "path": args.dataset, "fit": decision}


def _setting(c) -> dict:
    return {"strategy": c.strategy, "per_device_train_batch_size": c.per_device_train_batch_size,
            "gradient_checkpointing": c.gradient_checkpointing, "peak_bytes": c.peak_bytes}


def _flags(winner, seq_len: int) -> str:
    return (f"--max_seq_length {seq_len} --per_device_train_batch_size {winner.per_device_train_batch_size} "
            f"--gradient_accumulation_steps {winner.gradient_accumulation_steps}"
            + (" --gradient_checkpointing true" if winner.gradient_checkpointing else ""))


def format_decision(data: dict, winner: dict) -> list[str]:
    """`fit --dataset`'s lines: what the worst micro-batch is, what fits at the median instead, the flags."""
    d, pct = data["fit"], data["length_percentiles"]
    lines = [f"dataset {data['path']}: {data['samples']:,} samples, lengths p50 {pct['p50']:,}, p90 {pct['p90']:,}, "
             f"p99 {pct['p99']:,}, max {pct['max']:,} tokens" + ("; a sample of the rows: the tail may be missed"
                                                               if data["sampled"] else ""),
             f"decided on the worst micro-batch: {winner['per_device_train_batch_size']} x {d['seq_len']:,} tokens, "
             f"{d['batch_inputs']}, set by {d['decided_by']}"]
    median = d.get("at_median")
    if median and (median["strategy"], median["per_device_train_batch_size"], median["gradient_checkpointing"]) != (
            winner["strategy"], winner["per_device_train_batch_size"], winner["gradient_checkpointing"]):
        lines.append(f"  at the median length ({d['median']:,} tokens) {median['strategy']}, micro-batch "
                     f"{median['per_device_train_batch_size']}, checkpointing "
                     f"{'on' if median['gradient_checkpointing'] else 'off'} would be chosen: it does not fit the "
                     "tail, the setting above does")
    modes = d.get("batching") or {}
    if modes:
        free, longest = modes["padding_free"], modes["pad_longest"]
        lines.append(f"  padding: the recipe's default pads each micro-batch to its longest ({longest['padding_waste']:.0%}"
                     f" padded tokens, expected); --padding_free true removes them (worst micro-batch "
                     f"{free['worst_micro_batch']['tokens']:,} tokens in one row); --packing true fills "
                     f"{d['seq_len']:,}-token blocks (examples attend across boundaries). group_by_length lowers the "
                     "waste, not the worst micro-batch")
    lines.append(f"  recipe and Trainer flags: --dataset {data['path']} {d.get('flags', '')}".rstrip())
    return lines

