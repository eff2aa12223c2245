"""Long sequences split across ranks: torch context parallelism (`cp`, FSDP2 only) and DeepSpeed's Ulysses
sequence parallelism (`sp`, ZeRO only).

Owns the one validity rule of a sequence split (`split_problems`), used by the planner, fit, doctor and the
recipes, and the formulas of what a split changes on a rank: its row (`split_row`: the strategy's row at s / n
tokens, plus the split's communication terms `comm_terms`), what tiling would bound (`split_facts`), the longest
sequence that fits (`max_seq_len`) and fit's search groups (docs/planner.md, "Long sequences").
"""
from __future__ import annotations

from dataclasses import replace

from .formulas import Row, strategy_row
from .mesh import LibraryKnobs, Setup
from .trace import regime_for
from ..model.spec import ModelSpec

KINDS = ("cp", "sp")
NAMES = {"cp": "context parallelism (cp_size, torch)", "sp": "sequence parallelism (sp_size, DeepSpeed Ulysses)"}
# The strategy families each backend runs under (accelerate 1.15: cp needs FSDP2, sp needs DeepSpeed ZeRO).
BACKEND_STRATEGIES = {"cp": ("fsdp2",), "sp": ("zero1", "zero2", "zero3")}
# Attention implementations each backend can split: torch's CP patches SDPA only (the Trainer refuses others);
# Ulysses swaps heads around any core kernel but eager and flex attention (accelerate refuses them).
ATTENTION = {"cp": ("sdpa",), "sp": ("sdpa", "flash_attention_2", "flash_attention_3")}


class Problem(str):
    """One reason a split cannot run: its text (problem; fix) with `setting` (what to change), `problem`, `fix`."""

    def __new__(cls, setting: str, problem: str, fix: str):
        text = super().__new__(cls, f"{problem}; {fix}")
        text.setting, text.problem, text.fix = setting, problem, fix
        return text


def split_problems(kind: str, degree: int, *, seq_len: int | None = None, heads: int | None = None,
                   kv_heads: int | None = None, world: int | None = None, tp: int = 1,
                   strategy: str | None = None, attention: str | None = None,
                   max_positions: int | None = None) -> list[Problem]:
    """Each reason `degree`-way `kind` ("cp"/"sp") cannot run with what is known (None: not checked), naming the
    setting and the fix. `strategy`: fsdp1, fsdp2, zero1-3 or ddp."""
    size = f"{kind}_size"
    if degree < 1:
        return [Problem(size, f"{size} must be at least 1, got {degree}", "use 1 for no split")]
    if degree == 1:
        return []
    name, problems, step = f"{size} {degree}", [], unit(kind, degree)
    if strategy is not None and strategy not in BACKEND_STRATEGIES[kind]:
        need, config = ("FSDP2", "fsdp_cp.yaml") if kind == "cp" else ("DeepSpeed ZeRO", "zero3_sp.yaml")
        other = "sp_size under DeepSpeed" if kind == "cp" else "cp_size under FSDP2"
        problems.append(Problem(size, f"{name}: {NAMES[kind]} runs only under {need}, not {strategy}",
                                f"launch with accelerate_configs/{config}, or use {other}"))
    if attention is not None and attention not in ATTENTION[kind]:
        problems.append(Problem("attn_implementation", f"{name}: attn_implementation '{attention}' cannot be split "
                                f"by {NAMES[kind]}", f"use {' or '.join(ATTENTION[kind])}"))
    if seq_len is not None and seq_len % step:  # torch's load-balanced CP cuts each sequence into 2 x cp chunks
        problems.append(Problem("max_seq_length", f"{name}: the sequence length {seq_len} is not a multiple of "
                                f"{step}", f"use a multiple of {step} (the recipe pads each batch to one)"))
    if max_positions is not None and seq_len is not None and seq_len > max_positions:
        problems.append(Problem("max_seq_length", f"max_seq_length {seq_len} is longer than the model's "
                                f"max_position_embeddings {max_positions}",
                                "shorten it, or use a model (or RoPE scaling) made for that length"))
    if kind == "sp" and heads is not None and heads % degree:
        problems.append(Problem(size, f"{name} does not divide num_attention_heads {heads} (Ulysses gives each "
                                "rank heads / sp_size)", f"use a divisor of {heads}"))
    elif kind == "sp" and kv_heads is not None and kv_heads % degree and degree % kv_heads:
        problems.append(Problem(size, f"{name} and num_key_value_heads {kv_heads} do not divide one another "
                                "(Ulysses splits the KV heads, or copies them when fewer)",
                                f"use a divisor or a multiple of {kv_heads}"))
    if world is not None and world % (degree * tp):
        problems.append(Problem(size, f"{name} x tp_size {tp} = {degree * tp} does not divide the {world} "
                                "processes", f"use a {size} that divides {world // tp if world % tp == 0 else world}"
                                " (the data-parallel size is processes / (size x tp_size))"))
    return problems


# The rows a split adds: the strategies its backend runs under, as `plan` names them.
SPLIT_STRATEGIES = {"cp": ("fsdp_full_shard",), "sp": ("zero3",)}
SPLIT_CONFIGS = {"cp": "fsdp_cp", "sp": "zero3_sp"}  # the shipped accelerate yaml of each (fit --strategy names)
SEARCHED = tuple(SPLIT_CONFIGS.values())
# Whether the library hides the term behind compute (the step-time model reads it): torch's ring attention passes
# the next K/V chunk while the current one is computed; Ulysses' all-to-alls sit between the projections and the
# attention kernel and wait (DeepSpeed 0.19's UlyssesSPAttentionHF calls them synchronously).
OVERLAPPED = {"cp_ring": True, "sp_all_to_all": False}


def row_name(strategy: str, kind: str, degree: int) -> str:
    return f"{strategy}/{kind}{degree}"


def parse_row_name(name: str) -> tuple[str, str, int] | None:
    """(strategy, kind, degree) of a split row's name ("zero3/sp4"), None for a plain strategy."""
    strategy, _, split = name.partition("/")
    if split[:2] in KINDS and split[2:].isdigit():
        return strategy, split[:2], int(split[2:])
    return None


def search_groups(spec: ModelSpec, setup: Setup, allowed) -> list[tuple[None, tuple, int]]:
    """`fit`'s split groups, (None, row names, data-parallel size): for each split whose shipped config
    (SPLIT_CONFIGS: fsdp_cp, zero3_sp) is `allowed` and each degree above 1 that `degrees` allows (the sequence
    checked too), its rows; dp = world / degree."""
    groups = []
    for kind in KINDS:
        names = list(SPLIT_STRATEGIES[kind]) if SPLIT_CONFIGS[kind] in allowed else []
        for degree in degrees(spec, setup, kind)[1:] if names else []:
            if not split_problems(kind, degree, seq_len=setup.seq_len):
                groups.append((None, tuple(row_name(s, kind, degree) for s in names), setup.world_size // degree))
    return groups


def named_rows(spec: ModelSpec, setup: Setup, names: tuple, traces=None, knobs=None) -> tuple[list[Row], Setup]:
    """The split rows `names` (all of one kind and degree) and the per-rank setup they were traced at; `traces`:
    `setup -> {regime: StepTrace}` or None (the formula)."""
    strategy, kind, degree = parse_row_name(names[0])
    local = replace(setup, seq_len=setup.seq_len // degree)
    wanted, traced = {parse_row_name(n)[0] for n in names}, traces(local) if traces else {}
    rows = [split_row(s, spec, setup, kind, degree, traced.get(regime_for(s, setup.precision)), knobs)
            for s in SPLIT_STRATEGIES[kind] if s in wanted]
    return rows, local


def unit(kind: str, degree: int) -> int:
    """The sequence length must be a multiple of this (torch's load-balanced CP cuts 2 x cp chunks)."""
    return degree * (2 if kind == "cp" else 1)


def _head_dim(spec: ModelSpec) -> int:
    return spec.hidden_size // (spec.num_heads or 1)


def comm_terms(spec: ModelSpec, setup: Setup, kind: str, degree: int) -> dict:
    """Bytes each rank sends per optimizer step for the split, e = compute bytes, b = micro-batch, s = sequence,
    L = layers, A = micro-batches, d = head dim, a / k = attention / KV heads, n = degree, passes = 2 (forward and
    backward; 3 with checkpointing, which recomputes the forward):

    sp_all_to_all = A * passes * L * b * (s/n) * d * (2a + 2*max(k, n)) * e * (n-1)/n
        four all-to-alls per layer forward (q, k, v in; the attention output back), each of a rank's
        b x s/n x heads x d slice; KV heads below n are replicated to n first; backward is the same four.
    cp_ring = A * L * 2 * b * s * k * d * (passes * e * (n-1)/n + 4)
        torch's ring attention (torch/distributed/tensor/experimental/_context_parallel/_attention.py): K and V of
        the whole sequence reach every rank once per forward and again in backward (all-gathered, the default
        rotate method, or passed around the ring: the same bytes); backward also passes each chunk's K/V gradients
        around the whole ring, n hops of the rank's 2 b s/n k d accumulated in fp32 (`convert_to_f32`).
        k: the KV heads as they reach SDPA (transformers may repeat them to the attention heads first).
    """
    if degree <= 1:
        return {}
    b, s, L, e = setup.micro_batch, setup.seq_len, spec.num_layers, 2 if setup.precision != "fp32" else 4
    heads, kv = spec.heads
    share, passes = (degree - 1) / degree, 3 if setup.activation_checkpointing else 2
    if kind == "sp":
        per_pass = L * b * (s // degree) * _head_dim(spec) * (2 * heads + 2 * max(kv, degree)) * e
        return {"sp_all_to_all": int(setup.grad_accum_steps * passes * per_pass * share)}
    kv_bytes = L * 2 * b * s * kv * _head_dim(spec)  # elements of one sequence's K and V over the layers
    return {"cp_ring": int(setup.grad_accum_steps * kv_bytes * (passes * e * share + 4))}


def split_facts(spec: ModelSpec, setup: Setup, kind: str, degree: int) -> dict:
    """What a rank holds of one sequence under the split, and what the tiled options bound (formulas, bytes):
    logits = 3 fp32 copies of b x s/n x V at the loss; DeepSpeed's TiledFusedLogitsLoss computes them in
    tiles of at most `hidden` tokens (as TiledMLP picks its tiles), so 3 x b x min(s/n, h) x V x 4 remain.
    The MLP keeps 4 intermediate-size tensors per token per layer (gate, up, activation, product); TiledMLP
    recomputes them in backward from tiles of h tokens: b x min(s/n, h) x 4 x I x e live at a time."""
    b, s, h, e = setup.micro_batch, setup.seq_len, spec.hidden_size, 2 if setup.precision != "fp32" else 4
    local = s // degree
    heads, kv = spec.heads
    tile = min(local, h)
    return {
        "kind": kind, "degree": degree, "seq_len": s, "tokens_per_rank": local,
        # inside attention: Ulysses gives each rank the whole sequence for heads / n; ring attention keeps
        # s / n queries against every key
        "attention_tokens_per_rank": s if kind == "sp" else local,
        "attention_heads_per_rank": heads // degree if kind == "sp" else heads,
        "logits_bytes": 3 * b * local * spec.vocab_size * 4,
        "logits_tiled_bytes": 3 * b * tile * spec.vocab_size * 4,
        "mlp_bytes": spec.num_layers * b * local * 4 * spec.intermediate_size * e,
        "mlp_tiled_bytes": b * tile * 4 * spec.intermediate_size * e,
        "cp_kv_gathered_bytes": 2 * b * s * kv * _head_dim(spec) * e if kind == "cp" else 0,
        "comm": comm_terms(spec, setup, kind, degree),
        "overlapped": {k: OVERLAPPED[k] for k in comm_terms(spec, setup, kind, degree)},
    }


def split_row(strategy: str, spec: ModelSpec, setup: Setup, kind: str, degree: int, trace=None,
              knobs: LibraryKnobs | None = None) -> Row:
    """One strategy's row with each sequence split `degree` ways: model states as the strategy shards them over
    every rank (ZeRO's and FSDP2's shard groups include the split's ranks), activations of s / n tokens (`trace`:
    the step traced at that length), and the split's communication terms. Under cp the all-gathered K/V of one
    layer (`cp_kv_gathered`) is a temporary at the peak."""
    local = replace(setup, seq_len=setup.seq_len // degree)
    row = strategy_row(strategy, spec, local, trace=trace, knobs=knobs)
    terms = comm_terms(spec, setup, kind, degree)
    extra = split_facts(spec, setup, kind, degree)["cp_kv_gathered_bytes"]
    breakdown = {**row.peak_breakdown, "temporaries": row.peak_breakdown.get("temporaries", 0) + extra}
    # accelerate's mesh: dp_replicate x dp_shard x tp x degree = world (the shards themselves span the world:
    # `shard_degree`), so dp_replicate x dp_shard stays the data-parallel size
    mesh = replace(row.mesh, dp_shard=max(1, row.mesh.dp_shard // degree), **{kind: degree})
    return replace(row, strategy=row_name(strategy, kind, degree), mesh=mesh,
                   comm={**row.comm, **terms}, comm_bytes_per_step=row.comm_bytes_per_step + sum(terms.values()),
                   peak_bytes=row.peak_bytes + extra, peak_breakdown=breakdown,
                   buffers_detail={**row.buffers_detail, **({"cp_kv_gathered": extra} if extra else {})})


def split_rows(spec: ModelSpec, setup: Setup, kind: str, degree: int, traces: dict, knobs=None) -> list[Row]:
    """`split_row` for each strategy of the backend; `traces`: {regime: StepTrace} at s / degree tokens."""
    return [split_row(s, spec, setup, kind, degree, traces.get(regime_for(s, setup.precision)), knobs)
            for s in SPLIT_STRATEGIES[kind]]


def spec_problems(spec: ModelSpec, setup: Setup, kind: str, degree: int, max_positions=None) -> list[str]:
    """`split_problems` for a planned model and run."""
    heads, kv = spec.heads
    return split_problems(kind, degree, seq_len=setup.seq_len, heads=heads, kv_heads=kv, world=setup.world_size,
                          tp=1, attention=setup.attention, max_positions=max_positions)


def degrees(spec: ModelSpec, setup: Setup, kind: str) -> list[int]:
    """The degrees a search tries: powers of two up to the world that pass `split_problems` (sequence aside)."""
    heads, kv = spec.heads
    out, n = [1], 2
    while n <= setup.world_size:
        if not split_problems(kind, n, heads=heads, kv_heads=kv, world=setup.world_size):
            out.append(n)
        n *= 2
    return out


def max_seq_len(spec: ModelSpec, setup: Setup, traces_at, fits, limit: int, step: int = 1024,
                knobs: LibraryKnobs | None = None) -> list[dict]:
    """Per strategy and degree, the longest sequence (a multiple of `step` x unit, up to `limit`) whose row
    `fits` (the planner's fit rule). `traces_at(local_setup)`: {regime: StepTrace} at that many tokens per rank.
    Degree 1 is the backends' strategies with whole sequences."""
    out = []
    for kind in KINDS:
        for degree in degrees(spec, setup, kind):
            for strategy in SPLIT_STRATEGIES[kind]:
                grain = step * unit(kind, degree)

                def ok(k: int) -> bool:
                    run = replace(setup, seq_len=k * grain)
                    traces = traces_at(replace(run, seq_len=run.seq_len // degree))
                    row = split_row(strategy, spec, run, kind, degree,
                                    traces.get(regime_for(strategy, setup.precision)), knobs)
                    return bool(fits(row, setup))

                best = _largest(ok, limit // grain)
                out.append({"strategy": strategy if degree == 1 else row_name(strategy, kind, degree),
                            "kind": kind, "degree": degree, "max_seq_len": best * grain if best else 0,
                            "capped": best == limit // grain and best > 0})
    return out


def _largest(ok, high: int) -> int:
    """The largest k in 1..high with ok(k) (ok monotone: true up to some k), 0 when none."""
    if high < 1 or not ok(1):
        return 0
    low = 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if ok(mid) else (low, mid - 1)
    return low
