"""`shardscope plan`'s long-sequence flags: `--sp N` / `--cp N` add the rows of a sequence split of degree N,
`--max-seq-len` prints, per strategy and degree, the longest sequence that fits (formulas: plan/sequence.py)."""
from __future__ import annotations

from dataclasses import replace

from ..errors import UsageError
from ..plan.planner import fits, usable_bytes
from ..plan.sequence import KINDS, NAMES, degrees, max_seq_len, spec_problems, split_facts, split_rows
from ..units import gb

SEARCH_STEP = 1024  # --max-seq-len answers in multiples of this many tokens per rank
NO_POSITIONS = 131072  # --max-seq-len's bound where no config gives max_position_embeddings (--params)


def add_sequence_arguments(group) -> None:
    group.add_argument("--sp", type=int, default=1, metavar="N",
                       help="add rows with each sequence split N ways by DeepSpeed's Ulysses sequence parallelism "
                            "(zero2/spN, zero3/spN; accelerate_configs/zero3_sp.yaml)")
    group.add_argument("--cp", type=int, default=1, metavar="N",
                       help="add rows with each sequence split N ways by torch context parallelism "
                            "(fsdp_full_shard/cpN; accelerate_configs/fsdp_cp.yaml)")
    group.add_argument("--max-seq-len", action="store_true",
                       help="print, per strategy and cp/sp degree (powers of 2 up to the GPUs), the longest sequence "
                            f"that fits (multiples of {SEARCH_STEP} tokens per GPU; needs --gpu or --gpu-memory)")


def requested_split(args) -> tuple[str, int] | None:
    """("sp"|"cp", degree) from --sp / --cp, None for neither; one of them only."""
    asked = [(kind, getattr(args, kind)) for kind in KINDS if getattr(args, kind) != 1]
    if len(asked) > 1:
        raise UsageError("give --sp or --cp, not both (accelerate runs one sequence split at a time)")
    if asked and asked[0][1] < 1:
        raise UsageError(f"--{asked[0][0]} must be at least 1, got {asked[0][1]}")
    return asked[0] if asked else None


def max_positions(model: str | None) -> int | None:
    if not model:
        return None
    from ..model.spec import load_model_config

    config = load_model_config(model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None)


def add_split_rows(result: dict, args, spec, setup, traces_of) -> None:
    """Append the requested split's rows to `result["rows"]` and its facts as `result["sequence"]`; `traces_of(setup)`:
    {regime: StepTrace} (empty: the formula)."""
    asked = requested_split(args)
    if asked is None:
        return
    kind, degree = asked
    problems = spec_problems(spec, setup, kind, degree, max_positions(args.model))
    if problems:
        raise UsageError("; ".join(problems))
    local = replace(setup, seq_len=setup.seq_len // degree)
    rows = split_rows(spec, setup, kind, degree, traces_of(local))
    for row in rows:
        row.fits = fits(row, setup)
    result["rows"] += rows
    result["sequence"] = split_facts(spec, setup, kind, degree)
    fitting = [row for row in rows if row.fits]
    if result["recommendation"]["strategy"] is None and fitting:  # the whole sequences do not fit, a split does
        result["recommendation"] = {**result["recommendation"], "reason": result["recommendation"]["reason"] + (
            "; with each sequence split: " + ", ".join(f"{r.strategy} fits ({gb(r.peak_bytes)} GB)" for r in fitting))}


def add_fitting_split(result: dict, args, spec, setup, traces_of) -> None:
    """Where nothing fits whole because of the activations (a row fits without them) and no split was asked for
    (text models, GPU memory given): the rows of the smallest cp/sp degree that makes a row fit (the degrees `fit`
    searches, cp before sp at each), or a note that none does and why."""
    if (requested_split(args) is not None or setup.gpu_memory_bytes is None or result["recommendation"]["strategy"]
            or spec.kind != "text"):
        return
    if not any(r.peak_bytes - r.activations_bytes <= usable_bytes(setup) for r in result["rows"]):
        return  # the model states alone do not fit: a split of the sequence divides activations only
    positions = max_positions(args.model)
    tried, problems = sorted({(n, kind) for kind in KINDS for n in degrees(spec, setup, kind)[1:]}), []
    for degree, kind in tried:
        problems = spec_problems(spec, setup, kind, degree, positions)
        if problems:
            continue
        rows = split_rows(spec, setup, kind, degree, traces_of(replace(setup, seq_len=setup.seq_len // degree)))
        for row in rows:
            row.fits = fits(row, setup)
        if any(row.fits for row in rows):
            result["rows"] += rows
            result["sequence"] = split_facts(spec, setup, kind, degree)
            result["recommendation"] = {**result["recommendation"], "reason": result["recommendation"]["reason"] + (
                f"; each sequence split {degree} ways ({'--' + kind} {degree}, its rows in the table): " + ", ".join(
                    f"{r.strategy} fits ({gb(r.peak_bytes)} GB)" for r in rows if r.fits))}
            return
    if tried:
        why = f" ({problems[0]})" if problems else ""  # the last degree's: a sequence past the positions, say
        result["recommendation"] = {**result["recommendation"], "reason": result["recommendation"]["reason"] + (
            f"; no cp/sp split up to degree {tried[-1][0]} fits either{why}")}


def format_sequence(facts: dict | None) -> list[str]:
    """The lines under the table for a split: what a rank holds, the tiled options, the communication terms."""
    if not facts:
        return []
    kind, n = facts["kind"], facts["degree"]
    inside = (f"Ulysses gathers heads: inside attention each GPU holds the full {facts['seq_len']:,} tokens for "
              f"{facts['attention_heads_per_rank']} heads" if kind == "sp" else
              f"ring attention: each GPU's {facts['tokens_per_rank']:,} queries meet every key; one layer's "
              f"all-gathered K/V is {gb(facts['cp_kv_gathered_bytes'])} GB (in peak)")
    terms = ", ".join(f"{k} {gb(v)} GB ({'overlapped' if facts['overlapped'][k] else 'not overlapped'})"
                      for k, v in facts["comm"].items())
    return ["", f"{NAMES[kind]}, degree {n}: {facts['tokens_per_rank']:,} of {facts['seq_len']:,} tokens per GPU "
                f"outside attention; {inside}",
            f"  logits at the loss {gb(facts['logits_bytes'])} GB per GPU (3 fp32 copies of micro-batch x tokens x "
            f"vocab); a tiled logits loss (DeepSpeed TiledFusedLogitsLoss) {gb(facts['logits_tiled_bytes'])} GB",
            f"  MLP intermediates {gb(facts['mlp_bytes'])} GB over the layers; TiledMLP (recomputed in backward) "
            f"{gb(facts['mlp_tiled_bytes'])} GB at a time",
            f"  communication per step, in comm/step: {terms}; data-parallel size = GPUs / {n}"]


def max_seq_len_lines(spec, setup, traces_of, model: str | None) -> tuple[list[dict], list[str]]:
    """(rows, printed lines) of --max-seq-len."""
    if setup.gpu_memory_bytes is None:
        raise UsageError("--max-seq-len needs GPU memory: --gpu NAME or --gpu-memory SIZE")
    positions = max_positions(model)
    limit = positions or NO_POSITIONS
    rows = max_seq_len(spec, setup, traces_of, fits, limit, SEARCH_STEP)
    bound = "the model's max_position_embeddings" if positions else "no model config: a bound of the search"
    lines = [f"longest sequence that fits in {gb(usable_bytes(setup))} GB usable per GPU ({setup.headroom:.0%} "
             f"headroom kept), micro-batch {setup.micro_batch}, checkpointing "
             f"{'on' if setup.activation_checkpointing else 'off'}; searched in multiples of {SEARCH_STEP} tokens "
             f"per GPU up to {limit:,} ({bound}):",
             f"{'strategy':<24}{'degree':>7}{'max tokens':>12}"]
    for r in rows:
        value = "none" if not r["max_seq_len"] else f"{r['max_seq_len']:,}" + ("+" if r["capped"] else "")
        lines.append(f"{r['strategy']:<24}{r['degree']:>7}{value:>12}")
    how = (f"traced at {SEARCH_STEP} tokens and extended along the line of 1 and 2 micro-batches (tokens per GPU)"
           if model else "from the written-out formula (approximate: --params has no model code to trace)")
    lines.append(f"+ fits at {limit:,} ({bound}); activations {how}; degrees the heads or GPUs do not allow are left "
                 "out")
    return rows, lines
