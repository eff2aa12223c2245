"""What each way of batching (`dataset.MODES`) makes of a dataset's lengths: its worst micro-batch, the tokens that
set the step's peak, and its padding waste (padded tokens over real tokens). Pure arithmetic on a `dataset.Lengths`
histogram; `plan/dataset.py`'s docstring says what each mode is.

Lengths are taken after `--max-length` (truncation). Percentiles are nearest-rank on the lengths as read: the
smallest length that at least p% of samples do not exceed. `pad_longest`'s waste is its expectation over a random
order (the Trainer's sampler): a micro-batch of b rows drawn without replacement pads to its longest, whose
expectation is sum over lengths v of v x (P(max <= v) - P(max < v)), P(max <= v) = C(F(v), b) / C(n, b) with F(v)
the samples not longer than v.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .dataset import MODES, PERCENTILES, Lengths

# How a micro-batch reaches the model (`plan.mesh.Setup.batch_inputs`, traced so by plan/trace.py): no padding (no
# mask is built), padded rows (the attention mask becomes a 4-D mask), or one flattened row of several examples
# kept apart by position ids (a block-diagonal mask)
INPUTS = ("unpadded", "padded", "packed")


@dataclass(frozen=True)
class MicroBatch:
    """The worst micro-batch of a mode: rows x sequence length as the model sees them, and how (`INPUTS`)."""

    rows: int
    seq_len: int
    inputs: str

    @property
    def tokens(self) -> int:
        """The tokens that set the peak: padded tokens included."""
        return self.rows * self.seq_len


@dataclass(frozen=True)
class Batching:
    """One mode on one dataset: its worst micro-batch and its padding waste (None: no padding by construction)."""

    mode: str
    worst: MicroBatch
    padding_waste: float
    note: str = ""

    def as_dict(self) -> dict:
        return {"worst_micro_batch": {**asdict(self.worst), "tokens": self.worst.tokens},
                "padding_waste": self.padding_waste, **({"note": self.note} if self.note else {})}


def truncated(lengths: Lengths, max_length: int) -> list[tuple[int, int]]:
    """(length after `max_length`, samples) ascending, equal lengths merged."""
    out: dict[int, int] = {}
    for v, c in lengths.sorted_items():
        out[min(v, max_length)] = out.get(min(v, max_length), 0) + c
    return sorted(out.items())


def percentile(items: list[tuple[int, int]], p: float) -> int:
    """Nearest rank: the smallest length that at least p% of the samples do not exceed."""
    n = sum(c for _, c in items)
    rank, seen = max(1, math.ceil(p / 100 * n)), 0
    for v, c in items:
        seen += c
        if seen >= rank:
            return v
    return items[-1][0]


def expected_longest(items: list[tuple[int, int]], b: int) -> float:
    """The expected longest of b samples drawn without replacement (see the module docstring)."""
    n = sum(c for _, c in items)
    b = min(b, n)

    def at_most(f: int) -> float:  # C(f, b) / C(n, b)
        return 0.0 if f < b else math.prod((f - i) / (n - i) for i in range(b))

    total, seen, below = 0.0, 0, 0.0
    for v, c in items:
        seen += c
        upto = at_most(seen)
        total += v * (upto - below)
        below = upto
    return total


def sorted_padded(items: list[tuple[int, int]], b: int) -> int:
    """Padded tokens of micro-batches of b consecutive lengths in sorted order (the last one may be short)."""
    flat = [v for v, c in items for _ in range(c)]
    return sum(max(flat[i:i + b]) * len(flat[i:i + b]) for i in range(0, len(flat), b))


def longest(items: list[tuple[int, int]], b: int) -> list[int]:
    """The b longest lengths."""
    out = []
    for v, c in reversed(items):
        out += [v] * min(c, b - len(out))
        if len(out) == b:
            break
    return out


def data_facts(lengths: Lengths, max_length: int, micro_batch: int) -> dict:
    """The dataset as `plan --json`'s `data` object: samples, tokens (after truncation), percentiles of the lengths as
    read, truncated samples, each mode's padding waste and worst micro-batch."""
    items, cut = lengths.sorted_items(), truncated(lengths, max_length)
    tokens = sum(v * c for v, c in cut)
    modes = batchings(lengths, max_length, micro_batch)
    return {"samples": lengths.samples, "tokens": tokens, "rows_read": lengths.rows, "dropped": lengths.dropped,
            "sampled": lengths.sampled, "max_length": max_length, "micro_batch": micro_batch,
            "length_percentiles": {**{f"p{p}": percentile(items, p) for p in PERCENTILES}, "max": items[-1][0]},
            "truncated": sum(c for v, c in items if v > max_length),
            "padding_waste": {m.mode: m.padding_waste for m in modes.values()},
            "worst_micro_batch_tokens": {m.mode: m.worst.tokens for m in modes.values()},
            "batching": {m.mode: m.as_dict() for m in modes.values()}}


def batchings(lengths: Lengths, max_length: int, micro_batch: int) -> dict:
    """{mode: Batching} for every mode of `dataset.MODES` (see the module docstrings)."""
    cut = truncated(lengths, max_length)
    n, tokens, top = sum(c for _, c in cut), sum(v * c for v, c in cut), cut[-1][0]
    b = min(micro_batch, n)
    padded = "padded" if len(cut) > 1 else "unpadded"  # rows of one length: no padding, no mask
    fixed = "padded" if cut != [(max_length, n)] else "unpadded"
    longest_b = longest(cut, b)
    out = {
        "pad_longest": Batching("pad_longest", MicroBatch(b, top, padded), n * expected_longest(cut, b) / tokens - 1,
                                "expected over a random order"),
        "group_by_length": Batching("group_by_length", MicroBatch(b, top, padded), sorted_padded(cut, b) / tokens - 1,
                                    "its floor: micro-batches of sorted lengths; the Trainer sorts within groups of "
                                    "50 micro-batches"),
        "pad_fixed": Batching("pad_fixed", MicroBatch(b, max_length, fixed), n * max_length / tokens - 1),
        "packing": Batching("packing", MicroBatch(b, max_length, "unpadded"), 0.0,
                            f"{tokens % max_length:,} tokens past the last full block dropped; examples attend "
                            "across boundaries"),
        "padding_free": Batching("padding_free", MicroBatch(1, sum(longest_b), "packed"), 0.0,
                                 f"the {b} longest samples together: {' + '.join(map(str, longest_b))}"),
    }
    return {mode: out[mode] for mode in MODES}


def worst_step_shape(setup, batching: Batching):
    """`setup` at a mode's worst micro-batch: its rows, sequence length and inputs (`Setup.batch_inputs`)."""
    from dataclasses import replace

    w = batching.worst
    return replace(setup, micro_batch=w.rows, seq_len=w.seq_len, batch_inputs=w.inputs).validate()


def worst_step_peaks(spec, setup, modes: dict, traces_of, knobs=None) -> dict:
    """{mode: {strategy: {peak_bytes, fits}}}: each strategy's planned peak at each mode's worst micro-batch
    (`planner.estimate` at that shape; `traces_of(setup)`: {regime: StepTrace}, {} for the formula)."""
    from .planner import estimate

    out = {}
    for mode, batching in modes.items():
        shape = worst_step_shape(setup, batching)
        result = estimate(spec, shape, traces_of(shape), knobs)
        out[mode] = {row.strategy: {"peak_bytes": row.peak_bytes, "fits": row.fits} for row in result["rows"]}
    return out
