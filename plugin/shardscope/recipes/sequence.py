"""Long sequences in a recipe: the context- or sequence-parallel split the launcher asked for (checked against
the model, the strategy and the world before any process group starts) and the collator such a run needs.

accelerate's launcher exports the split as PARALLELISM_CONFIG_CP_SIZE / PARALLELISM_CONFIG_SP_SIZE; the Trainer
then shards each batch along the sequence: torch CP in `Trainer._prepare_context_parallel_inputs`, DeepSpeed's
Ulysses through `UlyssesSPDataLoaderAdapter`, which needs `position_ids` in every batch (a rank's slice keeps
its global positions) and a sequence length divisible by the degree.
"""
from __future__ import annotations

import os

from transformers import DataCollatorForSeq2Seq

from ..errors import UsageError
from ..model.spec import attention_heads
from ..plan.sequence import split_problems, unit


def launched_strategy(env=os.environ) -> str:
    """The strategy family accelerate's launcher set up: fsdp1/fsdp2, zero1-3, or ddp."""
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return f"fsdp{env.get('FSDP_VERSION', '1')}"
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return f"zero{env.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '3')}"
    return "ddp"


def sequence_split(config, name_or_path: str, seq_len: int, attention: str | None, env=os.environ) -> dict | None:
    """`{"kind": "cp"|"sp", "degree": N, "attention": the kernel to load the model with}` of the launched run, or None
    without a split; raises `UsageError` naming every setting that cannot work (`plan.sequence.split_problems`)."""
    degrees = {kind: int(env.get(f"PARALLELISM_CONFIG_{kind.upper()}_SIZE") or 1) for kind in ("cp", "sp")}
    split = [(kind, degree) for kind, degree in degrees.items() if degree != 1]
    if not split:
        return None
    if len(split) > 1:
        raise UsageError("parallelism_config sets both cp_size and sp_size; accelerate runs one of them")
    kind, degree = split[0]
    heads, kv_heads = attention_heads(config)
    if kind == "sp":
        launched = env.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION") or "sdpa"
        if attention and attention != launched:  # DeepSpeed refuses a model loaded with another kernel
            raise UsageError(f"--attn_implementation {attention} disagrees with the launcher config's "
                             f"parallelism_config_sp_attn_implementation {launched}; give the same one")
        attention = launched
        backend = env.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
        if backend != "deepspeed":
            raise UsageError(f"parallelism_config_sp_backend is '{backend}'; sp_size needs sp_backend: deepspeed")
    tp = int(env.get("PARALLELISM_CONFIG_TP_SIZE") or 1)
    problems = split_problems(kind, degree, seq_len=seq_len, heads=heads, kv_heads=kv_heads,
                              world=int(env.get("WORLD_SIZE", degree)), tp=tp,
                              strategy=launched_strategy(env), attention=attention or "sdpa",
                              max_positions=getattr(config, "max_position_embeddings", None))
    if problems:
        raise UsageError(f"'{name_or_path}' at max_seq_length {seq_len}: " + "; ".join(problems))
    return {"kind": kind, "degree": degree, "attention": attention or "sdpa"}


class SequenceSplitCollator(DataCollatorForSeq2Seq):
    """Pads each batch to a multiple of the split's unit and adds `position_ids` 0..length-1 per row, so a rank's
    slice of the sequence keeps its global positions (the Trainer's own fallback numbers each slice from 0)."""

    def __call__(self, features, return_tensors=None):
        import torch

        batch = super().__call__(features, return_tensors)
        rows, length = batch["input_ids"].shape
        batch["position_ids"] = torch.arange(length).expand(rows, length).clone()
        return batch


def collator(tokenizer, split: dict | None, padding_free: bool = False):
    """The recipe's collator: padding to the longest row, prompts masked, padded to the split's unit; `padding_free`:
    the micro-batch's examples in one row with position ids restarting at each (transformers' DataCollatorWithFlattening,
    which also masks each example's first label), no padding."""
    if padding_free:
        from transformers import DataCollatorWithFlattening

        return DataCollatorWithFlattening(return_position_ids=True)
    if split is None:
        return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100, return_tensors="pt")
    return SequenceSplitCollator(tokenizer, padding=True, label_pad_token_id=-100, return_tensors="pt",
                                 pad_to_multiple_of=unit(split["kind"], split["degree"]))
