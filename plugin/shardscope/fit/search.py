"""`shardscope fit`'s search: strategy x micro-batch x checkpointing x accumulation, the global batch kept.

Every candidate keeps `micro_batch * grad_accum * data-parallel size == global batch` exactly; it is
kept when the planner's `peak_bytes` fits `planner.usable_bytes` (the memory left after the stated
headroom) and, for offload, its CPU bytes fit the host memory given; it is ranked by the step-time model
`plan` shares (`time_model.step_time`: compute, exposed communication, optimizer, offload, overhead),
on datasheet figures (`time_model.Hardware`, `time_model.datasheet_figures`) or figures measured on runs
(plan/calibration/).

Nothing here imports torch or transformers.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ..errors import UsageError
from ..model.spec import ModelSpec
from ..plan.formulas import Row
from ..plan.mesh import LibraryKnobs, Setup, tp_mesh, valid_tp_degrees
from ..plan.planner import chosen_tp_rows, estimate, fits, host_fits as planner_host_fits, usable_bytes
from ..plan.sequence import KINDS, SPLIT_STRATEGIES, named_rows, parse_row_name, row_name, search_groups
from ..plan.time_model import Figures, Hardware, datasheet_figures, model_error, step_time
from ..strategy import OFFLOAD, REGISTRY, STRATEGIES, TP_STRATEGIES, Mesh, family, simplicity_order, strategy_record
from ..units import gb

# Candidates tied within the model's error: the most memory headroom first, then the simplest: the registry's order
# (`simplicity_order`, the one `recommend` walks), then the sequence-split rows of plan/sequence.py, "zero3/sp4",
# lower degrees first.
SPLIT_ROWS = tuple(row_name(s, kind, 2 ** i) for i in range(1, 11) for kind in KINDS for s in SPLIT_STRATEGIES[kind])


def tier_rank(name: str) -> int:
    """The simplicity tier of a candidate's strategy (`strategy.tier`); a sequence-split row after every tier."""
    return REGISTRY[name].simplicity if name in REGISTRY else 1 + max(r.simplicity for r in REGISTRY.values())


def simplicity(name: str, prefer: str) -> int:
    """A candidate's place in the simplicity order (`prefer`: the family first inside a tier, as `recommend`)."""
    return (simplicity_order(prefer) + SPLIT_ROWS).index(name)


# ----------------------------------------------------------------------------- search
@dataclass
class Candidate:
    strategy: str
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    gradient_checkpointing: bool
    tp: int
    mesh: Mesh
    peak_bytes: int
    fits: bool
    step_time_s: float
    step: dict = field(default_factory=dict)
    cpu_bytes: int = 0
    model_states_bytes: int = 0

    def key(self, prefer: str) -> tuple:
        """Ranking: predicted time, then simplicity, then fewer micro-batches."""
        return (round(self.step_time_s, 9), simplicity(self.strategy, prefer), self.gradient_accumulation_steps,
                self.tp)

    def public(self) -> dict:
        out = asdict(self)
        out["mesh"] = self.mesh.as_dict()
        out["data_parallel_size"] = self.mesh.dp
        return out

    def considered(self) -> dict:
        """What `fit --json` lists of every fitting candidate: its setting, predicted step and planned peak."""
        return {"strategy": self.strategy, "tp": self.tp, "per_device_train_batch_size": self.per_device_train_batch_size,
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "gradient_checkpointing": self.gradient_checkpointing, "step_time_s": self.step_time_s,
                "peak_bytes": self.peak_bytes}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def strategy_groups(spec: ModelSpec, setup: Setup, allowed) -> list[tuple[int | None, tuple, int]]:
    """(tp_size, strategies, data-parallel size) of each mesh family to search: the non-TP strategies over
    all GPUs; per TP degree t (`setup.tp_size`, else each that divides both head counts) the TP rows a run on
    every GPU can use (`planner.chosen_tp_rows`), dp = world / t."""
    world, groups = setup.world_size, []
    plain = tuple(s for s in allowed if s in STRATEGIES and s not in TP_STRATEGIES  # hybrid: not on one node
                  and not strategy_record(s).repeats(tp_mesh(s, setup, 1)))
    if plain:
        groups.append((None, plain, world))
    if spec.tp_plan:
        for t in [setup.tp_size] if setup.tp_size else valid_tp_degrees(*spec.heads):
            names = chosen_tp_rows(setup, t, allowed)
            if names:
                groups.append((t, names, world // t))
    return groups + search_groups(spec, setup, allowed)  # each sequence split cp/sp ways: dp = world / degree


def rows_for(spec: ModelSpec, setup: Setup, names: tuple, traces=None,
             knobs: LibraryKnobs | None = None) -> tuple[list[Row], dict]:
    """The planner's rows for `names` at this setup (`estimate`: what `fits` and `peak_bytes` come from);
    `traces`: trace.tracer(config) when the model's config is at hand, else the formula; `knobs`: what the
    run's libraries decide. Split rows ("zero3/sp4") come from plan/sequence.py, `result` then at the rank's
    share of each sequence."""
    if "/" in names[0]:
        rows, local = named_rows(spec, setup, names, traces, knobs)
        for row in rows:
            row.fits = fits(row, setup)
        result = estimate(spec, local, traces(local) if traces else None, knobs)
        return rows, {**result, "activations": {**result["activations"], "tokens_per_sample": setup.seq_len}}
    result = estimate(spec, setup, traces(setup) if traces else None, knobs)
    return [r for r in result["rows"] if r.strategy in names], result


def search(spec: ModelSpec, setup: Setup, global_batch: int, hw: Hardware | Figures, allowed=STRATEGIES,
           traces=None, knobs: LibraryKnobs | None = None) -> dict:
    """Every (strategy, micro-batch, checkpointing, accumulation) that keeps `global_batch` exactly;
    fitting ones sorted by predicted step time. Larger micro-batches of a (mesh, checkpointing) are not
    tried once none of its strategies fits (activations grow with the micro-batch)."""
    fig = hw if isinstance(hw, Figures) else datasheet_figures(hw)
    if usable_bytes(setup) is None:
        raise UsageError("give --gpu NAME or --gpu-memory SIZE: fit needs the memory per GPU")
    if global_batch < 1:
        raise UsageError(f"--global-batch must be at least 1, got {global_batch}")
    groups = strategy_groups(spec, setup, allowed)
    if not groups:
        raise UsageError(f"no strategy to search on this setup (--strategy {', '.join(allowed)})")
    fitting, smallest, skipped, tokens, model, host = [], {}, [], 0, None, {}
    for tp_size, names, dp in groups:
        if global_batch % dp:
            skipped.append((names, dp))
            continue
        per_rank = global_batch // dp
        for checkpointing in (False, True):
            for micro in divisors(per_rank):
                trial = replace(setup, micro_batch=micro, grad_accum_steps=per_rank // micro,
                                activation_checkpointing=checkpointing, tp_size=tp_size)
                rows, result = rows_for(spec, trial, names, traces, knobs)
                tokens, model = result["activations"]["tokens_per_sample"], result["model"]
                any_fit = False
                for row in rows:
                    cand = candidate(row, spec, model, trial, tokens, fig)
                    if gpu_fits(cand, trial) and not host_fits(cand, trial):
                        keep_least_host(host, cand, trial)
                        any_fit = True
                    elif cand.fits:
                        fitting.append(cand)
                        any_fit = True
                    best = smallest.get(row.strategy)
                    if best is None or cand.peak_bytes < best.peak_bytes:
                        smallest[row.strategy] = cand
                if not any_fit:
                    break
    if not smallest:
        raise UsageError(not_divisible_message(global_batch, skipped))
    fitting.sort(key=lambda c: c.key(setup.prefer))
    tie = break_tie(fitting, setup, model_error(fig))
    notes = [f"{', '.join(names)} left out: --global-batch {global_batch} is not a multiple of their data-parallel "
             f"size {dp} (nearest: {nearest_multiples(global_batch, dp)})" for names, dp in skipped]
    return {"fitting": fitting, "smallest": smallest, "tokens_per_sample": tokens, "model": model, "notes": notes,
            "host": host, "tie": tie}


TIE_RULE = ("tied within the model's error: the simplest tier of strategies wins, then no recomputation, then the "
            "most memory headroom, then --prefer's library, then fewer micro-batches")


def break_tie(fitting: list[Candidate], setup: Setup, error: float) -> dict | None:
    """Every candidate predicted within `error` (a fraction) of the fastest is a tie, inside a strategy too (another
    micro-batch, checkpointing, accumulation): the model cannot tell them apart. The winner (`TIE_RULE`): the
    simplest tier of strategies (the registry's; FSDP's and DeepSpeed's ways to one sharding share a tier), then
    checkpointing off (its recompute is a cost measured apart from the model's error: docs/gpu.md), then the most
    memory headroom (the smaller micro-batch of a strategy, the lighter library of a tier), then `prefer`'s
    library, then fewer micro-batches. It moves to the front of `fitting`; None when the fastest candidate is clearly
    fastest."""
    if not fitting:
        return None
    fastest = fitting[0]  # sorted fastest first
    tied = [c for c in fitting if c.step_time_s <= fastest.step_time_s * (1 + error)]
    if len(tied) < 2:
        return None
    usable = usable_bytes(setup)
    tied.sort(key=lambda c: (tier_rank(c.strategy), c.gradient_checkpointing, -(usable - c.peak_bytes),
                             simplicity(c.strategy, setup.prefer), c.gradient_accumulation_steps))
    fitting.remove(tied[0])
    fitting.insert(0, tied[0])
    return {"error": error, "strategies": list(dict.fromkeys(label(c) for c in tied)), "candidates": len(tied),
            "fastest_predicted": fastest.strategy,
            "rule": TIE_RULE}


def label(cand: Candidate) -> str:
    """A candidate's strategy, with its TP degree where it has one."""
    return cand.strategy + (f" (tp {cand.tp})" if cand.tp > 1 else "")


# ----------------------------------------------------------------------------- host memory
def host_bytes_per_node(cand: Candidate, setup: Setup) -> int:
    """The planner's CPU bytes of an offload candidate on one node (formulas.Row.cpu_bytes x GPUs per node)."""
    return cand.cpu_bytes * setup.gpus_per_node


def gpu_fits(cand: Candidate, setup: Setup) -> bool:
    return cand.peak_bytes <= usable_bytes(setup)


def host_fits(cand: Candidate, setup: Setup) -> bool:
    """An offload candidate is kept only when `--cpu-memory` is given and holds its CPU bytes per node
    (`planner.host_fits`, unknown host memory counting as not held)."""
    return cand.strategy not in OFFLOAD or planner_host_fits(cand.cpu_bytes, setup) is True


def keep_least_host(host: dict, cand: Candidate, setup: Setup) -> None:
    """Per offload strategy that fits the GPU but not the host rule: its least host memory per node."""
    need = host_bytes_per_node(cand, setup)
    if cand.strategy not in host or need < host[cand.strategy]["cpu_bytes_per_node"]:
        host[cand.strategy] = {"cpu_bytes_per_node": need, "peak_bytes": cand.peak_bytes,
                               "cpu_memory_bytes": setup.cpu_memory_bytes}


def host_lines(host: dict, bound: str = "--cpu-memory") -> list[str]:
    """One line per offload strategy left out for host memory: what it needs, and `bound`, what was given."""
    lines = []
    for name, h in sorted(host.items()):
        need = f"{name} fits the GPU ({gb(h['peak_bytes'])} GB) but needs {gb(h['cpu_bytes_per_node'])} GB of host " \
               "memory per node (offloaded states, planner cpu_bytes x GPUs per node)"
        given = h["cpu_memory_bytes"]
        lines.append(need + (f": more than {bound} {gb(given)} GB" if given is not None else
                             ": not a candidate without --cpu-memory SIZE (the host RAM per node)"))
    return lines


def candidate(row: Row, spec, model, setup: Setup, tokens: int, fig: Figures) -> Candidate:
    split = parse_row_name(row.strategy)  # a rank computes 1/degree of each sequence, attention at its full length:
    timed = replace(row, mesh=replace(row.mesh, tp=row.mesh.tp * split[2])) if split else row  # timed as a TP share
    step = step_time(timed, spec, model, setup, setup.seq_len if split else tokens, fig)
    return Candidate(row.strategy, setup.micro_batch, setup.grad_accum_steps, setup.activation_checkpointing,
                     row.mesh.tp, row.mesh, row.peak_bytes, bool(row.fits), step["step_time_s"],
                     step, row.cpu_bytes, row.model_states_bytes)


def nearest_multiples(value: int, unit: int) -> str:
    below, above = value // unit * unit, (value // unit + 1) * unit
    return " or ".join(str(v) for v in (below, above) if v >= 1)


def not_divisible_message(global_batch: int, skipped) -> str:
    sizes = sorted({dp for _, dp in skipped})
    return (f"--global-batch {global_batch} is not a multiple of the data-parallel size "
            f"({' or '.join(map(str, sizes))}) of any strategy searched: micro-batch x accumulation x data-parallel "
            f"size must equal it; nearest: {nearest_multiples(global_batch, sizes[0])}")


# ----------------------------------------------------------------------------- explaining
def tie_breaker(cand: Candidate, winner: Candidate) -> str:
    """Which step of `TIE_RULE` put `winner` before `cand`, in words."""
    name = label(winner)
    if tier_rank(cand.strategy) != tier_rank(winner.strategy):
        return f"{name} is simpler"
    if cand.gradient_checkpointing != winner.gradient_checkpointing:
        return f"it recomputes the forward, {name} does not"
    if cand.peak_bytes != winner.peak_bytes:
        return f"less memory headroom than {name}"
    if cand.strategy != winner.strategy:
        return f"{name} is --prefer's library"
    return f"more micro-batches than {name}"


def why_lost(cand: Candidate, winner: Candidate, tie: dict | None = None) -> str:
    """One line: which part of the predicted step makes `cand` slower than the winner (or what breaks the tie)."""
    delta = cand.step_time_s - winner.step_time_s
    if tie and label(cand) in tie["strategies"]:
        return (f"{delta / winner.step_time_s:+.1%} step time, within the model's error of {tie['error']:.0%}: a tie; "
                f"{tie_breaker(cand, winner)}")
    if delta <= 1e-9 * max(winner.step_time_s, 1e-12):
        if cand.strategy != winner.strategy:
            return (f"same predicted time; {winner.strategy} comes first in the planner's order (fewer "
                    "collectives or simpler set-up)")
        return "same predicted time; fewer micro-batches per step come first"
    parts = {"compute": "compute" + (" (checkpointing recomputes the forward: +33% matmul FLOPs)"
                                     if cand.gradient_checkpointing and not winner.gradient_checkpointing else ""),
             "exposed_comm": "communication not hidden behind compute",
             "optimizer": "the optimizer step" + (" (DeepSpeed ZeRO's copies around the update)"
                                                  if family(cand.strategy) == "deepspeed" != family(winner.strategy)
                                                  else " over more parameters per rank"),
             "offload": "offload copies over PCIe and the CPU optimizer step",
             "overhead": f"{cand.gradient_accumulation_steps} micro-batches per step instead of "
                         f"{winner.gradient_accumulation_steps} (per-micro-batch overhead)"}
    mine, best = cand.step["step_time_parts"], winner.step["step_time_parts"]
    worst = max(parts, key=lambda k: mine[k] - best[k])
    return f"+{delta / winner.step_time_s:.1%} step time ({delta:.3g} s): {parts[worst]}"


def alternatives(fitting: list[Candidate], count: int = 4, tie: dict | None = None) -> list[dict]:
    """The best candidate of each other (strategy, tp) after the winner, up to `count`, with why each lost."""
    winner, seen, out = fitting[0], set(), []
    for cand in fitting[1:]:
        if (cand.strategy, cand.tp) in seen or (cand.strategy, cand.tp) == (winner.strategy, winner.tp):
            continue
        seen.add((cand.strategy, cand.tp))
        out.append({**cand.public(), "why": why_lost(cand, winner, tie)})
        if len(out) == count:
            break
    return out


def nothing_fits(spec: ModelSpec, setup: Setup, found: dict, allowed, traces=None,
                 knobs: LibraryKnobs | None = None) -> str:
    """One line naming the smallest need and what would meet it: more GPUs, offload, shorter sequences."""
    usable = usable_bytes(setup)
    others = [c for name, c in found["smallest"].items() if name not in found["host"]]  # host-blocked: own line
    best = min(others or found["smallest"].values(), key=lambda c: c.peak_bytes)
    ways = []
    more = more_gpus(spec, setup, allowed, traces=traces, knobs=knobs)
    if more:
        ways.append(more)
    if not any(s in allowed for s in OFFLOAD):
        offload = fits_at_least_once(spec, setup, OFFLOAD, traces, knobs)
        if offload:
            ways.append(f"offload ({offload})")
    if spec.kind == "text":
        seq = setup.seq_len // 2
        while seq >= 64 and not fits_at_least_once(spec, replace(setup, seq_len=seq), allowed, traces, knobs):
            seq //= 2
        if seq >= 64:
            ways.append(f"--seq-len {seq}")
    how = ("; it would fit with " + ", or ".join(ways)) if ways else "; no more GPUs, offload or shorter sequence found"
    kept = " and the host memory" if found["host"] else ""
    return (f"nothing fits in {gb(usable)} GB usable per GPU ({setup.headroom:.0%} headroom kept){kept}: the smallest "
            f"GPU need{' of the rest' if found['host'] else ''} is {gb(best.peak_bytes)} GB ({best.strategy}, "
            f"micro-batch 1, checkpointing on){how}")


def fits_at_least_once(spec: ModelSpec, setup: Setup, names, traces=None,
                       knobs: LibraryKnobs | None = None) -> str | None:
    """The first of `names` that fits at micro-batch 1 with checkpointing, or None."""
    for tp_size, group, _ in strategy_groups(spec, setup, names):
        trial = replace(setup, micro_batch=1, grad_accum_steps=1, activation_checkpointing=True, tp_size=tp_size)
        rows, _ = rows_for(spec, trial, group, traces, knobs)
        for row in rows:
            if row.fits and (row.strategy not in OFFLOAD or trial.cpu_memory_bytes is not None):
                return row.strategy
    return None


def more_gpus(spec: ModelSpec, setup: Setup, allowed, max_nodes: int = 64, traces=None,
              knobs: LibraryKnobs | None = None) -> str | None:
    """The fewest GPUs (first filling a node up to 8, then more nodes) with which something fits."""
    shapes = [(g, 1) for g in range(setup.gpus_per_node + 1, 9)] if setup.nodes == 1 else []
    per_node = max(setup.gpus_per_node, 8) if setup.nodes == 1 else setup.gpus_per_node
    shapes += [(per_node, n) for n in range(setup.nodes + 1, max_nodes + 1)]
    for gpus, nodes in shapes:
        name = fits_at_least_once(spec, replace(setup, gpus_per_node=gpus, nodes=nodes), allowed, traces, knobs)
        if name:
            return f"{gpus * nodes} GPUs ({nodes} node{'s' * (nodes > 1)} x {gpus}, {name})"
    return None


def larger_micro_batch(spec: ModelSpec, setup: Setup, winner: Candidate, global_batch: int, limit: int = 64,
                       traces=None) -> dict | None:
    """When the kept global batch forces a smaller micro-batch than fits (no divisor in between), the
    largest micro-batch that fits and the nearest global batches that allow it."""
    dp = winner.mesh.dp
    per_rank, micro, best = global_batch // dp, winner.per_device_train_batch_size, None
    for m in range(micro + 1, min(per_rank, micro + limit)):
        trial = replace(setup, micro_batch=m, grad_accum_steps=1, activation_checkpointing=winner.gradient_checkpointing,
                        tp_size=winner.tp if winner.strategy in TP_STRATEGIES else None)
        rows, _ = rows_for(spec, trial, (winner.strategy,), traces)
        if not rows or not rows[0].fits:
            break
        best = m
    if best is None or any(per_rank % m == 0 for m in range(micro + 1, best + 1)):
        return None  # a larger divisor fits too: the micro-batch was the tie rule's choice, not the global batch's
    unit = dp * best
    return {"micro_batch_that_fits": best, "nearest_global_batches": [v for v in (global_batch // unit * unit,
                                                                                  (global_batch // unit + 1) * unit) if v],
            "note": f"{global_batch} / {dp} = {per_rank} sequences per GPU has no divisor between {micro + 1} and {best}, "
                    f"so the micro-batch is {micro} although {best} fits: --global-batch "
                    f"{nearest_multiples(global_batch, unit)} keeps micro-batch {best}"}


def below_model_states(found: dict, setup: Setup) -> str | None:
    """The one line when the usable memory is below every searched strategy's model states (bad input)."""
    usable = usable_bytes(setup)
    least = min(found["smallest"].values(), key=lambda c: c.model_states_bytes)
    if least.model_states_bytes <= usable:
        return None
    return (f"{gb(usable)} GB usable per GPU ({setup.headroom:.0%} headroom kept) is below the model states alone of "
            f"every strategy searched (smallest: {least.strategy}, {gb(least.model_states_bytes)} GB per GPU): give "
            "more GPU memory or allow offload")
