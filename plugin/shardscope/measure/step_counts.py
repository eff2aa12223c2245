"""What one training step did, and what the FLOPs convention needs to know about a model.

`StepCounts` adds up a step's samples, tokens and FLOPs from the batches the loop gives (or, without any, from
the training forwards the profiler's hooks saw), plus the forward work of passes that do not train.
`Counting`: how this rank counts a batch or a forward (the models' FLOPs per token, patch sizes, the ranks sharing a
batch); `describe_flops` reads a model's parameter counts and attention shape (`throughput.FlopsModel`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .throughput import FlopsModel, batch_counts, sequence_share

WRAPPERS = ("DistributedDataParallel", "FullyShardedDataParallel", "DeepSpeedEngine")


def count_batch(batch, patch_size: int | None = None) -> tuple:
    """(samples, tokens, sequence length) of a batch a loop hands over: the mapping fed to the model (a dict, or
    the BatchEncoding transformers' collators return), a tensor of token ids (a float tensor: samples only), or a
    tuple whose first item is the input tensor."""
    if type(batch) is dict or isinstance(batch, Mapping):  # (an ABC's check costs a few us per step)
        return batch_counts((), batch, patch_size)
    if isinstance(batch, tuple) and batch and isinstance(batch[0], torch.Tensor):
        batch = batch[0]
    if isinstance(batch, torch.Tensor):
        return batch_counts((batch,), {}) if not batch.is_floating_point() else (batch.shape[0], None, 0)
    raise TypeError(f"a batch is a mapping, a tensor or a list of micro-batches, got {type(batch).__name__}")


class StepCounts:
    """One step's samples, tokens and FLOPs: from the batches given, else from the training forwards seen;
    plus the forward work of passes that do not train."""

    def __init__(self):
        self.batches = [0.0, None, None]  # samples, tokens, FLOPs of add_batch calls
        self.given = False
        self.seen = [0.0, None, None]     # ... of training forwards the hooks saw
        self.seq_flops_per_token = None   # FLOPs per token of the last training forward (for tokens= alone)
        self.inference_flops = 0.0

    @staticmethod
    def _add(into: list, samples, tokens, flops):
        into[0] += samples
        into[1] = tokens if into[1] is None else (into[1] if tokens is None else into[1] + tokens)
        into[2] = flops if into[2] is None else (into[2] if flops is None else into[2] + flops)

    def add_batch(self, samples, tokens, flops):
        self.given = True
        self._add(self.batches, samples, tokens, flops)

    def saw_training(self, samples, tokens, flops):
        self._add(self.seen, samples, tokens, flops)
        if tokens is not None and flops is not None:
            self.seq_flops_per_token = flops / tokens if tokens else self.seq_flops_per_token

    def close(self, samples, tokens, counting: Counting) -> tuple:
        """(samples, tokens, FLOPs) of the step (`samples`, `tokens`: the loop's own counts, when given); resets for
        the next one."""
        counted = self.batches if self.given else self.seen
        out_samples = counted[0] if samples is None else samples
        out_tokens, flops = counted[1], counted[2]
        if tokens is not None:
            out_tokens = tokens
            per_token = self.seq_flops_per_token
            if per_token is None and counting.flops_model is not None:
                per_token = counting.flops_model.per_token(0) / counting.tp
            flops = None if per_token is None else tokens * per_token
        if self.inference_flops:
            flops = (flops or 0.0) + self.inference_flops
        self.__init__()
        return out_samples, out_tokens, flops


@dataclass
class Counting:
    """How this rank counts a batch or a forward: the trained model's `FlopsModel` and vision patch size, the frozen
    models' (by name), and the ranks sharing each batch (`tp`: tp x cp) or each sequence's tokens (`sp`)."""

    flops_model: FlopsModel | None = None
    patch_size: int | None = None
    frozen_flops: dict = field(default_factory=dict)
    frozen_patch_sizes: dict = field(default_factory=dict)
    tp: int = 1
    sp: int = 1

    def training(self, samples, tokens, seq_len: int) -> tuple:
        """(samples, tokens, FLOPs) this rank counts of a training batch: its share of each sequence's samples (sp),
        the FLOPs at the sequence's full length, split over the ranks sharing the batch."""
        flops = tokens * (self.flops_model.per_token(seq_len * self.sp) / self.tp) \
            if tokens is not None and self.flops_model else None
        return sequence_share(samples, self.sp), tokens, flops

    def forward_flops(self, tokens, seq_len: int, frozen: str | None = None) -> float | None:
        """FLOPs of a forward that does not train: of the trained model, or of the frozen model named `frozen`."""
        model = self.flops_model if frozen is None else self.frozen_flops.get(frozen)
        return None if tokens is None or model is None else tokens * (model.forward_per_token(seq_len) / self.tp)


def counting_of(module, frozen: dict, flops_model: FlopsModel | None, split: tuple[int, int]) -> Counting:
    """`module`'s and the `frozen` models' parameter counts and patch sizes (`flops_model`: the trained model's,
    counted before a wrapper sharded it), `split`: (tp, sp)."""
    return Counting(flops_model or describe_flops(module), patch_size(module),
                    {name: describe_flops(m) for name, m in frozen.items()},
                    {name: patch_size(m) for name, m in frozen.items()}, *split)


def model_facts(module, flops_model: FlopsModel) -> dict:
    """The summary's `model`: {name_or_path, params_total, trainable_params}."""
    return {"name_or_path": getattr(getattr(module, "config", None), "_name_or_path", None),
            "params_total": flops_model.total_params, "trainable_params": flops_model.trainable_total}


def patch_size(module) -> int | None:
    """A vision model's patch size (its tokens are patches), None for others."""
    return getattr(getattr(module, "config", None), "patch_size", None)


def first_adapter_layer(module):
    """A PEFT adapter layer of `module` (its `disable_adapters` says whether adapters are off), or None."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return None
    return next((m for m in module.modules() if isinstance(m, BaseTunerLayer)), None)


def describe_flops(model):
    """Parameter counts (full, unsharded) and attention shape for the FLOPs convention (no attention term
    for a model without a transformers config)."""
    model = unwrap(model)
    config = getattr(model, "config", None)
    trainable = frozen = 0
    for p in model.parameters():
        numel = _full_numel(p)
        if p.requires_grad:
            trainable += numel
        else:
            frozen += numel
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embedding_params, trainable_total = 0, trainable
    if isinstance(embedding, torch.nn.Embedding) and not getattr(config, "tie_word_embeddings", False):
        embedding_params = _full_numel(embedding.weight)
        if embedding.weight.requires_grad:
            trainable -= embedding_params
        else:
            frozen -= embedding_params
    if config is None or not hasattr(config, "num_hidden_layers") and not hasattr(config, "get_text_config"):
        return FlopsModel(trainable, frozen, 0, 0, embedding_params, trainable_total)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return FlopsModel(trainable, frozen, text_config.num_hidden_layers, heads * head_dim, embedding_params,
                      trainable_total)


def _full_numel(p) -> int:
    if hasattr(p, "ds_numel"):  # DeepSpeed ZeRO-3 partitioned parameter
        return p.ds_numel
    return p.numel()  # DTensor.numel() is the global size


def unwrap(model):
    while type(model).__name__ in WRAPPERS and hasattr(model, "module"):
        model = model.module
    return model
