"""The comparison of a launched run's parity fingerprints with a one-process reference's (measure/parity_record.py
writes them): the tolerance, each step's table row, and where the two first differ.

Per step, in the order the step computes: data (the samples all ranks trained on against the reference's), forward
(each module's output per sample, modules in the order their forwards completed, then the loss), backward (each
parameter's gradient, then the gradient norm), optimizer (each parameter's update); step 0 compares the initial
weights. The first fingerprint beyond the tolerance is the first divergence, with the rank it can be pinned on.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

# The tolerance, relative, from the run's precision (stated once; `--tolerance` overrides it, never a test):
# fp32: both runs compute the same sums in different orders (ranks, shards, buckets, accumulation); the difference of
# two orders of an n-term sum is, for rounding errors of random sign, about u * sqrt(n) of the sum's scale (Higham,
# Accuracy and Stability of Numerical Algorithms, 2nd ed., section 4.2; Higham and Mary 2019), u = 2^-24 the unit
# roundoff; n = 2^16 terms bounds the sums of a check-sized model (hidden x sequence x accumulation x ranks).
# bf16 / fp16: each result is rounded to the low precision in both runs, so a change of order shows as a few units
# in the last place: EPS_ULPS x the type's machine epsilon (2^-7, 2^-10).
UNIT_ROUNDOFF_FP32 = 2.0 ** -24
ORDER_TERMS = 2 ** 16
EPSILON = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10}
EPS_ULPS = 2
TOLERANCE = {"fp32": UNIT_ROUNDOFF_FP32 * math.sqrt(ORDER_TERMS), **{k: EPS_ULPS * e for k, e in EPSILON.items()}}
TOLERANCE_RULE = {"fp32": "fp32 summation order: 2^-24 x sqrt(2^16 terms)",
                  "bf16": f"bf16: {EPS_ULPS} x its epsilon 2^-7", "fp16": f"fp16: {EPS_ULPS} x its epsilon 2^-10"}
# the weights' machine epsilon: one unit in the last place of a parameter, relative (an update's resolution)
WEIGHT_EPSILON = {"fp32": 2.0 ** -23, **EPSILON}
WHAT = {"initial weights": "weights", "forward": "outputs", "backward": "gradients", "optimizer": "update"}
# strategies whose arithmetic no one process repeats exactly (the summation order is split across ranks)
ORDER_CHANGING = ("tp", "sp", "cp")


def run_precision(record: dict) -> str:
    """The lowest precision a run computes in: its Trainer flags, accelerate's mixed precision, its weights."""
    said = {record.get("precision"), record.get("mixed_precision"), *record.get("weight_dtypes", ())}
    said = {"bf16" if s in ("bfloat16", "bf16") else "fp16" if s in ("float16", "fp16") else s for s in said}
    return "bf16" if "bf16" in said else "fp16" if "fp16" in said else "fp32"


def distance(value, reference, norm_floor: float = 0.0, max_floor: float = 0.0) -> float:
    """How far a fingerprint [sum, sum of squares, abs-max, n] is from the reference's, relative to the reference:
    the largest of its norm's change, its sum's change over sqrt(n) x the norm (the largest a sum can be) and its
    abs-max's change, each over the reference's (or the floor given, where that is larger)."""
    s, q, m = value[:3]
    rs, rq, rm, n = reference[:4]
    if not all(map(math.isfinite, (s, q, m))):
        return math.inf
    norm, top = max(math.sqrt(rq), norm_floor), max(rm, max_floor)
    if norm == 0:
        return 0.0 if q == 0 else math.inf
    return max(abs(math.sqrt(q) - math.sqrt(rq)) / norm, abs(s - rs) / (math.sqrt(max(n, 1)) * norm),
               abs(m - rm) / top if top else math.inf)


def update_distance(value, reference, param, tolerance: float, epsilon: float) -> float:
    """`distance` of an update, which is read as the difference of two parameter values and so known only to one
    unit in the last place of the parameter: a difference within max(tolerance x the update, `epsilon` x the
    parameter) (norm, sum bound and abs-max alike) is no difference."""
    floor = epsilon / tolerance
    return distance(value, reference, floor * math.sqrt(param[1]), floor * param[2])


def ratio(value, reference) -> float:
    """The norm of `value` over the reference's (what the verdict prints)."""
    return math.sqrt(value[1] / reference[1]) if reference[1] else math.inf


def scalar_distance(value, reference) -> float:
    if value is None or reference is None:
        return 0.0 if value is reference else math.inf
    if not math.isfinite(value):
        return math.inf
    return abs(value - reference) / abs(reference) if reference else abs(value)


def added(prints: list) -> list:
    """Fingerprints of the pieces of one tensor (shards, sequence slices) as one: sums add, abs-max takes the max."""
    return [sum(p[0] for p in prints), sum(p[1] for p in prints), max(p[2] for p in prints),
            sum(p[3] for p in prints)]


@dataclass
class Divergence:
    step: int
    phase: str
    module: str | None
    rank: int | None  # None: every rank, or not one rank's
    relative_difference: float
    ratio: float | None = None

    def as_dict(self) -> dict:
        return {"step": self.step, "phase": self.phase, "module": self.module, "rank": self.rank,
                "relative_difference": self.relative_difference}

    def sentence(self) -> str:
        head = f"diverged at step {self.step}, {self.phase}: "
        who = "every rank" if self.rank is None else f"rank {self.rank}"
        if self.phase == "data" and math.isinf(self.relative_difference):
            return head + "the launched run stopped before this step"
        if self.phase == "data":
            return head + (f"{who} trained on samples the reference did not train on at this step "
                           f"({self.relative_difference:.0%} of the reference's samples not trained on)")
        size = (f"{self.ratio:.3g}x the reference" if self.ratio is not None and math.isfinite(self.ratio) else
                f"relative difference {self.relative_difference:.3g}")
        if self.module in ("loss", "grad norm"):
            return head + f"the {self.module} on {who}, {size}"
        return head + f"{self.module} on {who}, {WHAT[self.phase]} {size}"


@dataclass
class Comparison:
    tolerance: float
    tolerance_rule: str
    steps: list = field(default_factory=list)
    first_divergence: Divergence | None = None
    notes: list = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return "equal" if self.first_divergence is None else "diverged"

    def sentence(self) -> str:
        if self.first_divergence is not None:
            return self.first_divergence.sentence()
        return f"equal within {self.tolerance:.2g} over {len(self.steps)} steps"

    def as_dict(self) -> dict:
        return {"verdict": self.verdict, "tolerance": self.tolerance, "tolerance_rule": self.tolerance_rule,
                "steps": self.steps, "first_divergence": self.first_divergence and self.first_divergence.as_dict(),
                "notes": self.notes}


def tensor_divergence(step, phase, name, per_rank: dict, reference: list, tolerance, far_of=distance):
    """One parameter's (or gradient's, update's) fingerprints {rank: fingerprint} against the reference's. Where every
    rank holds it whole (DDP, ZeRO-1/2, a tensor-parallel copy) each rank is compared (the first beyond the tolerance
    named); else the pieces add up, over the number of ranks holding each element (their elements over the
    reference's, rounded: ZeRO-3 pads its partitions by fewer elements than ranks). `far_of`: the distance."""
    values = list(per_rank.values())
    if len(values) == 1 or any(v[3] != reference[3] for v in values):
        s, q, m, n = added(values)
        copies = max(1, round(n / reference[3])) if reference[3] else 1
        whole = [s / copies, q / copies, m, reference[3]]
        far = far_of(whole, reference)
        return Divergence(step, phase, name, None, far, ratio(whole, reference)) if far > tolerance else None
    for rank, value in sorted(per_rank.items()):
        far = far_of(value, reference)
        if far > tolerance:
            others = [r for r, v in per_rank.items() if far_of(v, reference) > tolerance]
            return Divergence(step, phase, name, rank if len(others) < len(per_rank) else None, far,
                              ratio(value, reference))
    return None


def tensors_divergence(step, phase, key, ranks: list, reference: dict, tolerance, notes,
                       epsilon: float | None = None) -> Divergence | None:
    """The first of `reference[key]`'s tensors (in the reference's order) that diverges (`epsilon`: judged as
    updates, against the reference's parameters after them: `update_distance`)."""
    wanted = reference.get(key) or {}
    held = [r.get(key) or {} for r in ranks]
    missing = [name for name in wanted if not any(name in h for h in held)]
    if missing and any(held):
        notes.append(f"step {step} {phase}: {len(missing)} of {len(wanted)} tensors not recorded by the launched run "
                     f"(not compared), e.g. {missing[0]}")
    for name, value in wanted.items():
        per_rank = {rank: h[name] for rank, h in enumerate(held) if name in h}
        param = (reference.get("params") or {}).get(name)
        far_of = distance if epsilon is None or param is None else \
            (lambda v, r: update_distance(v, r, param, tolerance, epsilon))
        found = per_rank and tensor_divergence(step, phase, name, per_rank, value, tolerance, far_of)
        if found:
            return found
    return None


def data_divergence(step: int, ranks: list, reference: dict, sharing: int) -> Divergence | None:
    """The samples the ranks trained on at `step` against the reference's, each `sharing` times (the ranks that
    train on one batch together: tensor parallel's): the first rank whose samples the reference did not train on
    at that step (or trained on fewer times)."""
    left = Counter({d: n * sharing for d, n in Counter(d for batch in reference["samples"] for d in batch).items()})
    total = sum(left.values())
    for rank, record in enumerate(ranks):
        for digest in (d for batch in record["samples"] for d in batch):
            if left[digest] <= 0:
                missing = sum(max(v, 0) for v in left.values())
                return Divergence(step, "data", None, rank, max(missing, 1) / max(total, 1))
            left[digest] -= 1
    missing = sum(left.values())
    return Divergence(step, "data", None, None, missing / total) if missing else None


def sample_distance(pieces: list, reference) -> tuple[float, list, list]:
    """(distance, the ranks beyond the tolerance's reach, the fingerprint judged) of one sample's output held by
    several ranks: pieces whose elements add up to the reference's are slices or shards (added); pieces each as
    large as the reference are copies (each judged, the farthest kept)."""
    values = [v for _, v in pieces]
    if len(values) > 1 and all(v[3] == reference[3] for v in values):
        judged = [(distance(v, reference), rank, v) for rank, v in pieces]
        far, _, worst = max(judged, key=lambda j: j[0])
        return far, [rank for d, rank, _ in judged if d == far], worst
    whole = added(values)
    return distance(whole, reference), [rank for rank, _ in pieces], whole


def forward_divergence(step, ranks: list, reference: dict, tolerance) -> Divergence | None:
    """The first module (in the reference's forward order) whose outputs, per sample, differ; the rank named when
    the differing samples are all one rank's."""
    for module in reference["forward_order"]:
        pieces: dict[str, list] = {}
        for rank, record in enumerate(ranks):
            for digest, value in (record["forward"].get(module) or {}).items():
                pieces.setdefault(digest, []).append((rank, value))
        far, diverging, norms = 0.0, set(), [0.0, 0.0]
        for digest, value in reference["forward"][module].items():
            if digest in pieces:
                d, who, judged = sample_distance(pieces[digest], value)
                if d > tolerance:
                    far, diverging = max(far, d), diverging | set(who)
                    norms[0], norms[1] = norms[0] + judged[1], norms[1] + value[1]
        if diverging:
            rank = diverging.pop() if len(diverging) == 1 and len(ranks) > 1 else None
            return Divergence(step, "forward", module, rank, far, math.sqrt(norms[0] / norms[1]) if norms[1] else None)
    return None


def step_row(number: int, ranks: list, reference: dict) -> dict:
    """The table's row: the Trainer's logged loss and gradient norm (every rank logs the same; rank 0's)."""
    return {"step": number, "loss": ranks[0].get("loss"), "loss_reference": reference.get("loss"),
            "grad_norm": ranks[0].get("grad_norm"), "grad_norm_reference": reference.get("grad_norm")}


def step_divergence(number, ranks: list, reference: dict, tolerance, notes, epsilon, sharing) -> Divergence | None:
    """The first divergence within one step, phase by phase (module docstring); `sharing`: the ranks that train on
    one batch together (0: a sequence split's, whose samples and outputs are not compared)."""
    if sharing:  # (a sequence split's ranks train on slices of samples: not compared, `compare` says so)
        found = data_divergence(number, ranks, reference, sharing) or forward_divergence(number, ranks, reference,
                                                                                          tolerance)
        if found:
            return found
    loss = scalar_distance(ranks[0].get("loss"), reference.get("loss"))
    if loss > tolerance:
        rel = ranks[0]["loss"] / reference["loss"] if reference.get("loss") and ranks[0].get("loss") is not None \
            else None
        return Divergence(number, "forward", "loss", None, loss, rel)
    found = tensors_divergence(number, "backward", "grads", ranks, reference, tolerance, notes)
    if found:
        return found
    norm = scalar_distance(ranks[0].get("grad_norm"), reference.get("grad_norm"))
    if norm > tolerance:
        rel = ranks[0]["grad_norm"] / reference["grad_norm"] if reference.get("grad_norm") and \
            ranks[0].get("grad_norm") is not None else None
        return Divergence(number, "backward", "grad norm", None, norm, rel)
    return tensors_divergence(number, "optimizer", "update", ranks, reference, tolerance, notes, epsilon)


def compare(launched: list[dict], reference: dict, tolerance: float | None = None) -> Comparison:
    """The launched run's rank records (rank order) against the one-process reference's record."""
    precision = max((run_precision(r) for r in [*launched, reference]), key=lambda p: TOLERANCE[p])
    weights = max((run_precision({"weight_dtypes": r.get("weight_dtypes", ())}) for r in [*launched, reference]),
                  key=lambda p: TOLERANCE[p])
    rule = TOLERANCE_RULE[precision] if tolerance is None else "given (--tolerance)"
    result = Comparison(TOLERANCE[precision] if tolerance is None else tolerance, rule)
    strategy = launched[0].get("strategy") or ""
    if any(part in strategy.split("_") or strategy.startswith(part) for part in ORDER_CHANGING):
        result.notes.append(f"{strategy} splits each sum across ranks: no one process repeats its arithmetic "
                            f"exactly; compared at the summation-order tolerance")
    if not all(r.get("grads_visible") for r in launched):
        result.notes.append("gradients not visible in the launched run (DeepSpeed steps inside backward): "
                            "backward is judged by the gradient norm, then the update")
    steps = {s["step"]: s for s in reference["steps"]}
    if not any(d for s in steps.values() for batch in s.get("samples", ()) for d in batch):
        result.notes.append("no samples recorded (the inputs hold no input_ids or pixel_values): data and forward "
                            "not compared")
    sharing = max(1, len(launched) // (launched[0].get("data_parallel") or len(launched)))
    if launched[0].get("sequence_split", 1) > 1:
        sharing = 0
        result.notes.append("a sequence split trains each rank on slices of samples, which no reference sample "
                            "matches: data and module outputs not compared; loss, gradients and updates are")
    by_rank = [{s["step"]: s for s in r["steps"]} for r in launched]
    start = [r.get(0, {}) for r in by_rank]
    result.first_divergence = tensors_divergence(0, "initial weights", "params", start, steps.get(0, {}),
                                                 result.tolerance, result.notes)
    for number in sorted(n for n in steps if n > 0):
        ranks = [r.get(number) for r in by_rank]
        if any(r is None for r in ranks):
            result.notes.append(f"the launched run stopped before step {number}")
            result.first_divergence = result.first_divergence or Divergence(number, "data", None, None, math.inf)
            break
        result.steps.append(step_row(number, ranks, steps[number]))
        if result.first_divergence is None:
            result.first_divergence = step_divergence(number, ranks, steps[number], result.tolerance, result.notes,
                                                      WEIGHT_EPSILON[weights], sharing)
    return result
