"""What one training step did, and what the FLOPs convention needs to know about a model.

`StepCounts` adds up a step's samples, tokens and FLOPs from the batches the loop gives (or, without any, from
the training forwards the profiler's hooks saw), plus the forward work of passes that do not train.
`describe_flops` reads a model's parameter counts and attention shape (`throughput.FlopsModel`).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from .throughput import FlopsModel, batch_counts

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

    def close(self, samples, tokens, flops_model, tp) -> tuple:
        """(samples, tokens, FLOPs) of the step; resets for the next one."""
        counted = self.batches if self.given else self.seen
        out_samples = counted[0] if samples is None else samples
        out_tokens, flops = counted[1], counted[2]
        if tokens is not None:
            out_tokens = tokens
            per_token = self.seq_flops_per_token
            if per_token is None and flops_model is not None:
                per_token = flops_model.per_token(0) / tp
            flops = None if per_token is None else tokens * per_token
        if self.inference_flops:
            flops = (flops or 0.0) + self.inference_flops
        self.__init__()
        return out_samples, out_tokens, flops


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
