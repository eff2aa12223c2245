"""Long sequences split across ranks: torch context parallelism (`cp`, FSDP2 only) and DeepSpeed's Ulysses
sequence parallelism (`sp`, ZeRO only).

Owns the one validity rule of a sequence split (`split_problems`), used by the planner, fit, doctor and the
recipes, and the formulas of what a split changes on a rank (`SequenceSplit`).
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("cp", "sp")
NAMES = {"cp": "context parallelism (cp_size, torch)", "sp": "sequence parallelism (sp_size, DeepSpeed Ulysses)"}
# The strategy families each backend runs under (accelerate 1.15: cp needs FSDP2, sp needs DeepSpeed ZeRO).
BACKEND_STRATEGIES = {"cp": ("fsdp2",), "sp": ("zero1", "zero2", "zero3")}
# Attention implementations each backend can split: torch's CP patches SDPA only (the Trainer refuses others);
# Ulysses swaps heads around any core kernel but eager and flex attention (accelerate refuses them).
ATTENTION = {"cp": ("sdpa",), "sp": ("sdpa", "flash_attention_2", "flash_attention_3")}


def split_problems(kind: str, degree: int, *, seq_len: int | None = None, heads: int | None = None,
                   kv_heads: int | None = None, world: int | None = None, tp: int = 1,
                   strategy: str | None = None, attention: str | None = None,
                   max_positions: int | None = None) -> list[str]:
    """Each reason `degree`-way `kind` ("cp"/"sp") cannot run with what is known (None: not checked), one line
    naming the setting and the fix. `strategy`: a family of BACKEND_STRATEGIES' keys' values or "ddp", "fsdp1"."""
    if degree < 1:
        return [f"{kind}_size must be at least 1, got {degree}"]
    if degree == 1:
        return []
    name, problems = f"{kind}_size {degree}", []
    if strategy is not None and strategy not in BACKEND_STRATEGIES[kind]:
        need = "FSDP2 (fsdp_version: 2; accelerate_configs/fsdp_cp.yaml)" if kind == "cp" else \
            "DeepSpeed ZeRO (accelerate_configs/zero3_sp.yaml)"
        problems.append(f"{name}: {NAMES[kind]} runs only under {need}, not {strategy}")
    if attention is not None and attention not in ATTENTION[kind]:
        problems.append(f"{name}: attn_implementation '{attention}' cannot be split by {NAMES[kind]}; "
                        f"use {' or '.join(ATTENTION[kind])}")
    if seq_len is not None and seq_len % (degree * (2 if kind == "cp" else 1)):
        unit = degree * (2 if kind == "cp" else 1)  # torch's load-balanced CP cuts each sequence into 2 x cp chunks
        problems.append(f"{name}: the sequence length {seq_len} is not a multiple of {unit}; pad to a multiple "
                        f"of {unit} (max_seq_length / pad_to_multiple_of)")
    if max_positions is not None and seq_len is not None and seq_len > max_positions:
        problems.append(f"max_seq_length {seq_len} is longer than the model's max_position_embeddings "
                        f"{max_positions}; shorten it or use a model (or RoPE scaling) for that length")
    if kind == "sp" and heads is not None:
        if heads % degree:
            problems.append(f"{name} must divide num_attention_heads {heads} (Ulysses gives each rank "
                            f"heads / sp_size); pick a divisor of {heads}")
        elif kv_heads is not None and kv_heads % degree and degree % kv_heads:
            problems.append(f"{name} and num_key_value_heads {kv_heads} must divide one another "
                            f"(Ulysses splits or replicates the KV heads)")
    if world is not None and world % (degree * tp):
        problems.append(f"{name} x tp_size {tp} = {degree * tp} does not divide the {world} processes; "
                        f"the data-parallel size is processes / ({kind}_size x tp_size)")
    return problems


@dataclass(frozen=True)
class SequenceSplit:
    """A `degree`-way split of each sequence over `kind` ("cp"/"sp") ranks; degree 1 is no split."""

    kind: str = "sp"
    degree: int = 1
