"""`shardscope plan`: per-GPU memory for every strategy, before launch, from a model's config only.

Layout (like accelerate's commands/estimate.py): model spec (`model_spec`, `spec_from_config`,
`spec_from_count`) -> pure estimate (`estimate`, `strategy_row`, `recommend`) -> printing
(`format_table`) -> CLI (`register`, `plan_command`). Nothing here imports the Trainer or loads a
weight: models are built on the meta device to count their parameters exactly.

Conventions (docs/planner.md has the full derivation):
- Bytes per element, by precision and by who owns the optimizer (see `element_bytes`).
  Mixed-precision AdamW is 16 B/param (2 B 16-bit weights + 2 B grads + 12 B optimizer = 4 B fp32
  master + 8 B moments), 18 B with fp32 gradients. `optimizer_bytes` includes master weights.
- Model states (params, grads, optimizer) are exact counts of what each rank holds in steady state
  (after the optimizer step); activations are an estimate; buffers are temporaries (gathered
  layers, communication buckets, DeepSpeed's fp32 gradient partition during the step).
- Sizes are bytes per GPU; printed GB are 10**9 bytes; GPU capacities are GiB (2**30).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .errors import UsageError
from .strategy import tp_strategy

TP_STRATEGIES = ("tp", "fsdp_tp", "hsdp_tp")  # transformers DistributedConfig(tp_size, fsdp_size, dp_replicate_size)
STRATEGIES = ("ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload",
              "fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard", "fsdp_offload", *TP_STRATEGIES)
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-pure")
OPTIMIZERS = ("adamw", "adamw-8bit", "sgd", "sgd-momentum")
COMPONENTS = ("params_bytes", "grads_bytes", "optimizer_bytes")

# Nominal memory per GPU (datasheet "GB" as GiB, which is what nvidia-smi totals show for A100).
GPUS = {
    "A100-40": (40, "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    "A100-80": (80, "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    "H100": (80, "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (SXM and PCIe: 80 GB)"),
    "H100-NVL": (94, "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (NVL: 94 GB)"),
    "H200": (141, "https://www.nvidia.com/en-us/data-center/h200/"),
    "L4": (24, "https://www.nvidia.com/en-us/data-center/l4/"),
    "L40S": (48, "https://www.nvidia.com/en-us/data-center/l40s/"),
    "A10G": (24, "https://aws.amazon.com/ec2/instance-types/g5/"),
    "A10": (24, "https://www.nvidia.com/en-us/data-center/products/a10-gpu/"),
    "V100-16": (16, "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"),
    "V100-32": (32, "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"),
    "T4": (16, "https://www.nvidia.com/en-us/data-center/tesla-t4/"),
    "RTX-4090": (24, "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4090/"),
    "RTX-A6000": (48, "https://www.nvidia.com/en-us/design-visualization/rtx-a6000/"),
    "MI300X": (192, "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"),
}

MODEL_CONFIGS_DIR = Path(__file__).parent / "model_configs"
LORA_DEFAULT_TARGETS = ("q_proj", "v_proj")  # peft's default for Llama/Mistral


# ----------------------------------------------------------------------------- model spec
@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model. `assumed` names values that were guessed."""

    name: str
    params_total: int                      # distinct parameters (tied weights counted once)
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int                        # 0 for vision models
    largest_layer_params: int              # DeepSpeed's definition: largest module's own params
    unit_numels: tuple[int, ...]           # FSDP wrap units: each block, then the rest (root)
    tensor_shapes: tuple[tuple[int, int], ...] = ()  # (dim 0, numel / dim 0) per distinct tensor; () from a count
    linear_shapes: tuple[tuple[str, int, int, int], ...] = ()  # (leaf name, in, out, how many)
    num_kv_heads: int = 0
    intermediate_size: int = 0
    tied_embeddings: bool = False
    kind: str = "text"                     # "text" or "vision"
    image_size: int = 0
    patch_size: int = 0
    extra_tokens: int = 0                  # vision: CLS + register tokens
    num_labels: int = 0
    exact: bool = True                     # counted on the meta device
    assumed: tuple[str, ...] = ()
    # Tensor parallelism, per tensor of `tensor_shapes`: (full shape, dim the TP plan splits or -1, whether its
    # gradient is whole under TP alone), from transformers' resolved TP plan; () from a count. `tp_plan` False:
    # transformers has no TP plan for the model.
    tp_layout: tuple[tuple[tuple[int, ...], int, bool], ...] = ()
    tp_plan: bool = True
    tp_note: str = ""

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_shapes) if self.tensor_shapes else 9 * self.num_layers + 3


def resolve_model(model: str) -> str:
    """A shipped name (`llama-2-7b`, `mistral-7b`, `llama-2-70b`), a local folder, or a hub id."""
    shipped = MODEL_CONFIGS_DIR / model.lower()
    if "/" not in model and (shipped / "config.json").is_file():
        return str(shipped)
    return model


def shipped_models() -> list[str]:
    return sorted(p.parent.name for p in MODEL_CONFIGS_DIR.glob("*/config.json"))


def load_config(model: str):
    """`AutoConfig.from_pretrained` with the hub/offline errors turned into one-line `UsageError`s."""
    path = resolve_model(model)
    looks_local = os.path.isdir(path) or path.startswith((".", "/", "~")) or os.sep + os.sep in path
    if looks_local and not os.path.isdir(path):
        raise UsageError(f"model folder '{model}' does not exist")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if os.path.isdir(path):
            raise UsageError(f"model folder '{model}' has no usable config.json: {message}") from None
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
        if offline or "connect" in message.lower() or "offline" in message.lower():
            raise UsageError(f"model '{model}' is not a local folder and the hub cannot be reached") from None
        raise UsageError(f"model '{model}' cannot be loaded from the hub: {message}") from None


def _meta_model(config):
    """Build the model on the meta device (no memory for weights) with the matching Auto class."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageClassification

    for auto in (AutoModelForCausalLM, AutoModelForImageClassification, AutoModel):
        if type(config) in auto._model_mapping:
            with torch.device("meta"):
                return auto.from_config(config)
    raise UsageError(f"model type '{config.model_type}' has no transformers model class to count")


def _get(config, *names, default=0):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def spec_from_config(config, name: str | None = None) -> ModelSpec:
    """Count a config's parameters exactly by building the model on the meta device."""
    import torch

    model = _meta_model(config)
    params = list(model.parameters())  # deduplicated: tied weights appear once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    units, seen = [], set()
    for module in model.modules():
        if type(module).__name__ in block_classes and not any(id(p) in seen for p in module.parameters()):
            block = list(module.parameters())
            seen.update(id(p) for p in block)
            units.append(sum(p.numel() for p in block))
    units.append(sum(p.numel() for p in params if id(p) not in seen))
    linears: dict[tuple[str, int, int], int] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            key = (module_name.rsplit(".", 1)[-1], module.in_features, module.out_features)
            linears[key] = linears.get(key, 0) + 1
    tp_layout, tp_note = _tp_layout(model, params)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = _get(text, "vocab_size")
    vision = not vocab and bool(_get(config, "image_size"))
    return ModelSpec(
        name=name or getattr(config, "_name_or_path", "") or config.model_type,
        params_total=sum(p.numel() for p in params),
        num_layers=_get(text, "num_hidden_layers", "n_layer", "num_layers"),
        hidden_size=_get(text, "hidden_size", "n_embd", "d_model"),
        num_heads=_get(text, "num_attention_heads", "n_head"),
        num_kv_heads=_get(text, "num_key_value_heads", "num_attention_heads"),
        intermediate_size=_get(text, "intermediate_size"),
        vocab_size=vocab,
        tied_embeddings=bool(_get(text, "tie_word_embeddings", default=False)),
        largest_layer_params=largest,
        unit_numels=tuple(u for u in units if u),
        tensor_shapes=tuple((p.shape[0], p.numel() // p.shape[0]) if p.dim() else (1, 1) for p in params),
        linear_shapes=tuple((n, i, o, c) for (n, i, o), c in linears.items()),
        kind="vision" if vision else "text",
        image_size=_get(config, "image_size") if vision else 0,
        patch_size=_get(config, "patch_size") if vision else 0,
        extra_tokens=(1 + _get(config, "num_register_tokens")) if vision else 0,
        num_labels=_get(config, "num_labels") if vision else 0,
        tp_layout=tp_layout or (), tp_plan=tp_layout is not None, tp_note=tp_note,
    )


def _tp_style_dim(style, leaf: str, ndim: int) -> int | None:
    """The tensor dim a transformers TP style shards a parameter on (-1: kept whole; None: unknown style).

    Mirrors each style's `shard_param` (transformers/distributed/tensor_parallel.py): colwise and
    packed_colwise Shard(ndim - 2) (a 1-D bias: dim 0); rowwise Shard(-1) with the bias replicated;
    packed_rowwise Shard(-1), 1-D replicated; embedding_rowwise / embedding_colwise their `shard_dim`;
    styles that only hook the forward (all_reduce, sequence_parallel, replicate, ...) keep it whole.
    """
    from transformers.distributed.tensor_parallel import (ColwiseParallel, EmbeddingParallel, PackedColwiseParallel,
                                                          PackedRowwiseParallel, RowwiseParallel, TensorParallelLayer)

    if ndim == 0:
        return -1
    if isinstance(style, (ColwiseParallel, PackedColwiseParallel)):
        return max(ndim - 2, 0)
    if isinstance(style, RowwiseParallel):
        return -1 if leaf == "bias" else ndim - 1
    if isinstance(style, PackedRowwiseParallel):
        return -1 if ndim == 1 else ndim - 1
    if isinstance(style, EmbeddingParallel):
        return style.shard_dim % ndim
    if type(style).shard_param is TensorParallelLayer.shard_param:
        return -1
    return None


def _tp_layout(model, params) -> tuple[tuple | None, str]:
    """(shape, TP dim, gradient whole) per parameter, from the plan transformers itself would apply,
    or (None, why not).

    The plan is `model._resolve_parallel_plans(DistributedConfig(tp_size=2))`, the call
    `maybe_distribute_model` makes: config.base_model_tp_plan + the class `_tp_plan` (+ `embed_tokens:
    embedding_rowwise`), expanded to one style per parameter name. The degree does not change which
    dim a style splits, so 2 stands for any.
    """
    try:
        from transformers.distributed import DistributedConfig
        from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    except ImportError:  # transformers without native tensor parallelism
        return None, "this transformers has no transformers.distributed"
    if not getattr(model, "tp_plan", None):
        return None, f"transformers has no tensor-parallel plan for {type(model).__name__}"
    try:
        plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=2))
    except (ValueError, AttributeError) as error:
        return None, f"transformers cannot resolve a tensor-parallel plan: {str(error).splitlines()[0]}"
    names = {}
    for name, param in model.named_parameters():  # tied weights: the first name, as `parameters()` dedups
        names.setdefault(id(param), name)
    layout, unknown = [], set()
    for param in params:
        name = names[id(param)]
        style = ALL_PARALLEL_STYLES[plan[name]] if name in plan else None
        dim = -1 if style is None else _tp_style_dim(style, name.rsplit(".", 1)[-1], param.dim())
        if dim is None:
            unknown.add(plan[name])
            dim = -1
        # embedding_rowwise runs DTensor's embedding op (vocab-sharded weight, replicated ids): its weight
        # gradient comes back Replicate, the whole (V, h) on every TP rank (measured: torch 2.13,
        # transformers 5.23; `plan --dry-run` runs a backward to see it). Under FSDP2 the reduce-scatter
        # leaves each rank its shard instead.
        grad_whole = dim == 0 and type(style).__name__ == "EmbeddingParallel"
        layout.append((tuple(param.shape), dim, grad_whole))
    note = f"TP styles {', '.join(sorted(unknown))} counted as replicated (not modelled)" if unknown else ""
    return tuple(layout), note


def spec_from_count(params: float, layers: int | None = None, hidden: int | None = None,
                    vocab: int | None = None, heads: int | None = None) -> ModelSpec:
    """A Llama-shaped model of `params` parameters; missing sizes are assumed and listed.

    layers default 32; hidden = sqrt(P / (12 * layers)) rounded to 64 (P ~ 12 L h^2);
    heads = hidden / 128; vocab 32000; MLP width 8h/3; untied embeddings; FSDP units are
    `layers` equal blocks plus a root of 2 * vocab * hidden.
    """
    p = int(params)
    if p <= 0:
        raise UsageError(f"--params must be positive, got {params:g}")
    assumed = []
    if not layers:
        layers, _ = 32, assumed.append("layers=32")
    if not hidden:
        hidden = max(64, int(round(math.sqrt(p / (12 * layers)) / 64)) * 64)
        assumed.append(f"hidden={hidden}")
    if not heads:
        heads = max(1, hidden // 128)
        assumed.append(f"heads={heads}")
    if vocab is None:
        vocab = 32000
        assumed.append("vocab=32000")
    inter = int(8 * hidden / 3)
    root = min(2 * vocab * hidden, p // 2)
    block = (p - root) // layers
    linears = [(n, hidden, hidden, layers) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [("gate_proj", hidden, inter, layers), ("up_proj", hidden, inter, layers),
                ("down_proj", inter, hidden, layers)]
    return ModelSpec(
        name=f"{p:.3g} parameters", params_total=p, num_layers=layers, hidden_size=hidden,
        num_heads=heads, num_kv_heads=heads, intermediate_size=inter, vocab_size=vocab,
        largest_layer_params=max(min(vocab * hidden, root), hidden * inter) if root else block,
        unit_numels=(block,) * layers + (p - block * layers,), linear_shapes=tuple(linears),
        exact=False, assumed=tuple(assumed))


def model_spec(model=None, *, params: float | None = None, layers: int | None = None,
               hidden: int | None = None, vocab: int | None = None, heads: int | None = None) -> ModelSpec:
    """From a shipped name / local folder / hub id / `PretrainedConfig`, or from a parameter count."""
    if model is None:
        if params is None:
            raise UsageError("give a model (--model NAME|FOLDER|HUB_ID) or a parameter count (--params 7e9)")
        return spec_from_count(params, layers, hidden, vocab, heads)
    if isinstance(model, str):
        return spec_from_config(load_config(model), name=model)
    return spec_from_config(model)


# ----------------------------------------------------------------------------- setup and bytes
@dataclass(frozen=True)
class Setup:
    """The run being planned. `gpus_per_node` x `nodes` ranks, one GPU each."""

    gpus_per_node: int = 1
    nodes: int = 1
    gpu_memory_bytes: int | None = None
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    micro_batch: int = 1
    seq_len: int = 2048                    # text; vision derives tokens from image/patch size
    image_size: int | None = None          # vision: overrides the config's image size
    activation_checkpointing: bool = False
    attention: str = "sdpa"                # "sdpa" (no s^2 scores kept) or "eager"
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = LORA_DEFAULT_TARGETS  # or ("all-linear",)
    fp32_grads: bool = False               # DeepSpeed data_types.grad_accum_dtype=fp32
    ddp_bucket_view: bool = False          # DDP(gradient_as_bucket_view=True): no bucket copy
    bucket_elements: int | None = None     # DeepSpeed reduce bucket; None: hidden^2 (Trainer "auto")
    zero3_persistence_threshold: int | None = None  # None: 10 * hidden (Trainer "auto")
    zero_param_groups: int = 2             # Trainer: decay / no-decay groups
    grad_accum_steps: int = 1
    fsdp_version: int = 2                  # 2: per-tensor shards (shipped default); 1: flat params
    headroom: float = 0.10                 # fraction of GPU memory kept free (context, fragmentation)
    cpu_memory_bytes: int | None = None    # per node; checked for offload rows when given
    prefer: str = "fsdp"                   # within a tier of the decision tree: "fsdp" or "deepspeed"
    tp_size: int | None = None             # tensor-parallel degree of tp/fsdp_tp/hsdp_tp; None: `tp_degree` default

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def validate(self) -> "Setup":
        flag = {"gpus_per_node": "--gpus", "gpu_memory_bytes": "--gpu-memory", "cpu_memory_bytes": "--cpu-memory"}
        for key in ("gpus_per_node", "nodes", "micro_batch", "grad_accum_steps"):
            if getattr(self, key) < 1:
                name = flag.get(key, "--" + key.replace("_", "-"))
                raise UsageError(f"{name} must be at least 1, got {getattr(self, key)}")
        for key in ("seq_len", "lora_rank", "gpu_memory_bytes", "cpu_memory_bytes", "image_size"):
            if getattr(self, key) is not None and getattr(self, key) < (0 if key in ("seq_len", "lora_rank") else 1):
                name = flag.get(key, "--" + key.replace("_", "-"))
                raise UsageError(f"{name} must not be negative, got {getattr(self, key)}" if key in ("seq_len", "lora_rank")
                                 else f"{name} must be positive, got {getattr(self, key)}")
        if self.precision not in PRECISIONS:
            raise UsageError(f"unknown precision '{self.precision}' (choose from {', '.join(PRECISIONS)})")
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"unknown optimizer '{self.optimizer}' (choose from {', '.join(OPTIMIZERS)})")
        if not 0 <= self.headroom < 1:
            raise UsageError(f"headroom must be in [0, 1), got {self.headroom}")
        if self.tp_size is not None:
            if self.tp_size < 1:
                raise UsageError(f"--tp must be at least 1, got {self.tp_size}")
            if self.gpus_per_node % self.tp_size:
                raise UsageError(f"--tp {self.tp_size} must divide the GPUs per node (--gpus {self.gpus_per_node}): "
                                 f"a tensor-parallel group stays inside one node")
        return self


@dataclass(frozen=True)
class ElementBytes:
    param: int    # model weights as held by the rank
    grad: int     # gradients as held between backward and step
    master: int   # separate fp32 master copy owned by the optimizer (0: the params are the master)
    moments: float  # optimizer moments per trainable parameter (AdamW: 2 x state dtype)
    compute: int  # dtype of gathered (unsharded) params and of activations


def family(strategy: str) -> str:
    if strategy in TP_STRATEGIES:
        return "tp"  # torch AdamW on DTensors, bytes per element as DDP / FSDP
    return "deepspeed" if strategy.startswith("zero") else "fsdp" if strategy.startswith("fsdp") else "torch"


def tp_degree(spec: ModelSpec, setup: Setup) -> int:
    """The tensor-parallel degree t of the tp / fsdp_tp / hsdp_tp rows.

    `setup.tp_size` (`--tp`) when given: it must divide num_attention_heads and num_key_value_heads
    (each rank keeps whole heads) and the GPUs per node (checked by `Setup.validate`). Default: the
    GPUs per node capped to the largest degree that divides both head counts, i.e.
    gcd(GPUs per node, num_attention_heads, num_key_value_heads): 8 for Llama-2-70B (64 / 8 heads) on
    8 GPUs, 1 on one GPU (then the TP rows equal ddp / fsdp and are not recommended). With head
    counts assumed from `--params`, the GPUs per node and nothing is checked against the heads.
    """
    heads = spec.num_heads or 1
    kv = spec.num_kv_heads or heads
    assumed = any(a.startswith("heads=") for a in spec.assumed)  # --params without --heads: not checked
    if setup.tp_size is None:
        return setup.gpus_per_node if assumed else math.gcd(setup.gpus_per_node, heads, kv)
    t = setup.tp_size
    if not spec.tp_plan:
        raise UsageError(f"--tp {t}: {spec.name} cannot be tensor-parallel here ({spec.tp_note})")
    if not assumed:
        check_tp_heads(t, heads, kv, spec.name)
    return t


def check_tp_heads(t: int, heads: int, kv_heads: int, name: str) -> None:
    """One-line `UsageError` unless TP degree t divides both head counts (each rank keeps whole heads)."""
    if heads % t or kv_heads % t:
        raise UsageError(f"--tp {t} must divide num_attention_heads ({heads}) and num_key_value_heads ({kv_heads}) "
                         f"of {name}")


def tp_mesh(strategy: str, setup: Setup, t: int) -> dict:
    """The `{"dp_replicate", "dp_shard", "tp"}` degrees of a row (the profiler summary's `mesh`).

    tp: t ranks of one node (world = t); fsdp_tp: FSDP2 over the other world / t ranks;
    hsdp_tp: replicated across the nodes, FSDP2 over gpus_per_node / t ranks inside each node.
    Ranks are laid out row-major over (dp_replicate, dp_shard, tp), as transformers' mesh
    (pp, dp_replicate, fsdp, tp) does, so a TP group is t consecutive ranks inside a node.
    """
    if strategy == "tp":
        return {"dp_replicate": 1, "dp_shard": 1, "tp": t}
    if strategy == "fsdp_tp":
        return {"dp_replicate": 1, "dp_shard": setup.world_size // t, "tp": t}
    if strategy == "hsdp_tp":
        return {"dp_replicate": setup.nodes, "dp_shard": setup.gpus_per_node // t, "tp": t}
    n = setup.world_size
    if strategy == "ddp":
        return {"dp_replicate": n, "dp_shard": 1, "tp": 1}
    if strategy == "fsdp_hybrid_shard":
        return {"dp_replicate": setup.nodes, "dp_shard": setup.gpus_per_node, "tp": 1}
    return {"dp_replicate": 1, "dp_shard": n, "tp": 1}


def setup_for_mesh(setup: Setup, mesh: dict) -> tuple[str, Setup]:
    """The TP strategy name and a Setup whose row reproduces `mesh` (a summary's `{"dp_replicate",
    "dp_shard", "tp"}`): nodes = dp_replicate, GPUs per node = dp_shard x tp, tp_size = tp."""
    r, s, t = (int(mesh[k]) for k in ("dp_replicate", "dp_shard", "tp"))
    return tp_strategy(mesh), replace(setup, gpus_per_node=s * t, nodes=r, tp_size=t)


def element_bytes(precision: str, fam: str, optimizer: str = "adamw", fp32_grads: bool = False,
                  zero_stage: int = 0) -> ElementBytes:
    """Bytes per element of each model state.

    | precision | torch DDP / FSDP              | DeepSpeed ZeRO                       |
    | fp32      | 4 param, 4 grad, 0 master     | 4, 4, +4 fp32 partition copy (ZeRO-1/2   |
    |           |                               | `single_partition_of_fp32_groups`, ZeRO-3 `fp32_partitioned_groups_flat`: clones) |
    | *-mixed   | 4, 4, 0 (autocast; accelerate | 2, 2 (4 with fp32_grads), +4 master  |
    |           | upcasts FSDP flat params)     |                                      |
    | bf16-pure | 2, 2, 0                       | 2, 2, +4 master (ZeRO always keeps fp32) |
    Moments: adamw 2 x state dtype (fp32 for DeepSpeed; param dtype for torch); adamw-8bit 2 x
    (1 + 4/256) (bitsandbytes blockwise, fp32 absmax per 256); sgd 0 (Trainer's SGD has no
    momentum); sgd-momentum 1 x state dtype. The 16-bit compute dtype is used for gathered layers
    and activations under mixed/pure 16-bit, fp32 otherwise.
    """
    half = precision != "fp32"
    if fam == "deepspeed":
        param = 2 if half else 4
        grad = 4 if (fp32_grads or not half) else 2
        master = 4  # ZeRO keeps its own fp32 partition (a clone even when training in fp32)
        state = 4
    else:
        param = grad = 2 if precision == "bf16-pure" else 4
        master, state = 0, param
    moments = {"adamw": 2 * state, "adamw-8bit": 2 * (1 + 4 / 256), "sgd": 0, "sgd-momentum": state}[optimizer]
    return ElementBytes(param, grad, master, moments, 2 if half else 4)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- activations
def activation_bytes(spec: ModelSpec, setup: Setup, tp: int = 1) -> dict:
    """Estimated activation memory per GPU for one micro-batch (an estimate, not a count).

    s = tokens per sample (text: seq_len; vision: (image/patch)^2 + CLS/registers), b = micro-batch,
    h = hidden, a = heads, L = layers, V = vocab, e = compute bytes (2 for 16-bit, 4 for fp32).
    Per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation", no tensor parallelism):
        layer = s*b*h*(34 + 5*a*s/h) * e/2 bytes   (the 5as/h attention-score term only for eager
                                                  attention; SDPA/flash attention keeps no s x s)
    No checkpointing: L * layer. Checkpointing: L * s*b*h*e (each layer's input) + one layer
    (recomputed during backward). Text adds logits: b*s*V*4 (fp32 upcast for the loss) plus
    b*s*V*e when e = 2 (the 16-bit logits). Vision adds b*num_labels*4.

    Tensor parallelism of degree t (`tp`; Korthikanti et al. Table 2, tensor parallel without
    sequence parallelism): layer = s*b*h*(10 + 24/t + 5*a*s/(h*t)) * e/2. Only the attention and MLP
    internals are split; the 10*s*b*h part (layer norms, dropouts, the inputs of the attention and
    MLP blocks) stays whole on every TP rank, because transformers does not wire sequence parallelism
    yet (`DistributedConfig(enable_sequence_parallel=...)` is reserved). Checkpointed layer inputs
    (s*b*h*e) are not split either, and the logits stay whole: lm_head's `colwise_gather_output`
    all-gathers them before the loss. t = 1 gives the 34 above.
    """
    if spec.kind == "vision":
        image = setup.image_size or spec.image_size
        s = (image // spec.patch_size) ** 2 + spec.extra_tokens
    else:
        s = setup.seq_len
    b, h, a, L = setup.micro_batch, spec.hidden_size, spec.num_heads, spec.num_layers
    e = 2 if setup.precision != "fp32" else 4
    scores = 5 * a * s / (h * tp) if setup.attention == "eager" else 0
    layer = s * b * h * (10 + 24 / tp + scores) * e / 2
    layers = L * s * b * h * e + layer if setup.activation_checkpointing else L * layer
    if spec.kind == "vision":
        head = b * spec.num_labels * 4
    else:
        head = b * s * spec.vocab_size * (4 + (e if e == 2 else 0))
    return {"tokens_per_sample": s, "per_layer": int(layer), "layers": int(layers), "head": int(head),
            "total": int(layers + head), "tp": tp}


# ----------------------------------------------------------------------------- model states
@dataclass(frozen=True)
class Counts:
    """Parameter counts after LoRA: every tensor (dim 0, rest, trainable) and the FSDP1 units."""

    tensors: tuple[tuple[int, int, bool], ...]  # () when counted from --params
    total: int
    trainable: int
    units: tuple[int, ...]
    n_trainable_tensors: int
    tp_layout: tuple[tuple[tuple[int, ...], int, bool], ...] = ()  # aligned with `tensors`; LoRA adapters whole


def lora_params(spec: ModelSpec, rank: int, targets=LORA_DEFAULT_TARGETS) -> list[tuple[int, int]]:
    """LoRA adds A (rank x in) and B (out x rank) per targeted Linear: their shapes, one per tensor.
    `all-linear` targets every Linear except the output head (lm_head / classifier)."""
    out = []
    for leaf, fan_in, fan_out, count in spec.linear_shapes:
        hit = leaf not in ("lm_head", "classifier") if "all-linear" in targets else leaf in targets
        if hit:
            out += [(rank, fan_in), (fan_out, rank)] * count
    return out


def counts(spec: ModelSpec, setup: Setup) -> Counts:
    base = tuple((d, r, not setup.lora_rank) for d, r in spec.tensor_shapes)
    layout = spec.tp_layout if len(spec.tp_layout) == len(base) else tuple(((d, r), -1, False)
                                                                             for d, r in spec.tensor_shapes)
    if not setup.lora_rank:
        return Counts(base, spec.params_total, spec.params_total, spec.unit_numels, spec.num_tensors, layout)
    lora = lora_params(spec, setup.lora_rank, setup.lora_targets)
    if not lora:
        raise UsageError(f"no Linear layer of {spec.name} matches LoRA targets {','.join(setup.lora_targets)}")
    added = sum(d * r for d, r in lora)
    tensors = base + tuple((d, r, True) for d, r in lora) if base else ()
    blocks = spec.unit_numels[:-1] or spec.unit_numels
    units = tuple(u + added // len(blocks) for u in blocks) + (spec.unit_numels[-1:] if spec.unit_numels[:-1] else ())
    # LoRA adapters are not in the model's TP plan: counted whole on every TP rank (not measured).
    layout = layout + tuple(((d, r), -1, False) for d, r in lora) if base else ()
    return Counts(tensors, spec.params_total + added, added, units, len(lora), layout)


def _shard_tensors(c: Counts, n: int, trainable_only: bool = False, by_rows: bool = False) -> int:
    """Each tensor partitioned on its own: ZeRO-3 pads the flattened tensor, ceil(numel/n);
    FSDP2 (`by_rows`) splits dim 0, ceil(dim0/n) * rest. Without a tensor list: ceil(total/n)."""
    if not c.tensors:
        return _ceil_div(c.trainable if trainable_only else c.total, n)
    return sum(_ceil_div(d, n) * r if by_rows else _ceil_div(d * r, n)
               for d, r, train in c.tensors if train or not trainable_only)


def _chunk(size: int, parts: int, index: int) -> int:
    """Rows that chunk `index` of `size` split into `parts` gets (torch.chunk / DTensor Shard / FSDP2:
    chunks of ceil(size / parts), the last ones shorter or empty)."""
    k = _ceil_div(size, parts)
    return max(0, min(k, size - index * k))


def _tp_fsdp_shard(c: Counts, t: int, s: int, trainable_only: bool = False, tp_grads: bool = False) -> int:
    """Elements of the heaviest rank's (rank 0's) storage under TP degree t then FSDP2 over s ranks.

    Per tensor: the TP plan's dim split in t (colwise / embedding_rowwise: dim 0, rowwise: the last
    dim, replicated: whole), then FSDP2 splits the local TP shard's dim 0 in s padded chunks of
    ceil(rows / s) rows. `tp_grads` (TP without FSDP): gradients, whole for the tensors whose
    gradient DTensor comes back Replicate (embedding_rowwise). Without a tensor list (`--params`):
    ceil(total / (t * s)), approximate.
    """
    if not c.tensors:
        return _ceil_div(c.trainable if trainable_only else c.total, t * s)
    total = 0
    for (_, _, train), (shape, dim, grad_whole) in zip(c.tensors, c.tp_layout):
        if trainable_only and not train:
            continue
        local = list(shape) or [1]
        if dim >= 0 and not (tp_grads and grad_whole):
            local[dim] = _chunk(local[dim], t, 0)
        total += _ceil_div(local[0], s) * math.prod(local[1:])
    return total


@dataclass
class Row:
    strategy: str
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    buffers_bytes: int
    total_bytes: int = 0
    fits: bool | None = None
    cpu_bytes: int = 0
    model_states_bytes: int = 0
    buffers_detail: dict = field(default_factory=dict)
    shard_degree: int = 1
    mesh: dict = field(default_factory=dict)  # {"dp_replicate", "dp_shard", "tp"}
    comm_bytes_per_step: int = 0              # computed: bytes each rank sends per optimizer step
    comm: dict = field(default_factory=dict)  # its terms
    approximate: bool = False                 # TP rows from --params: totals / (t x s)

    def __post_init__(self):
        self.model_states_bytes = self.params_bytes + self.grads_bytes + self.optimizer_bytes
        self.total_bytes = self.model_states_bytes + self.activations_bytes + self.buffers_bytes


def strategy_row(strategy: str, spec: ModelSpec, setup: Setup, c: Counts | None = None,
                 activations: int | None = None) -> Row:
    """Per-rank bytes of one strategy. P = all params, T = trainable, N = ranks sharding, s(X) = the
    rank's padded shard of X, U = largest FSDP unit, LL = largest layer (DeepSpeed's definition),
    B = bucket elements, steps = 4 B per AdamW `step` tensor (one per trainable tensor for torch
    optimizers, one per param group for ZeRO's flat partitions); p, g, m, o, e from `element_bytes`.

    ddp:              params P*p, grads T*g, optim T*(m+o) + steps, buffers T*g (DDP's reducer
                      buckets are a second copy of the grads unless gradient_as_bucket_view)
    zero1, zero2:     params P*p, grads s(T)*g, optim s(T)*(m+o), buffers 2*B*g + copy32; zero1
                      with gradient accumulation > 1 also holds the full T*g between micro-steps
                      (at an accumulation boundary DeepSpeed reduces and frees grads bucket by
                      bucket in stage 1 too)
    zero2_offload:    GPU params P*p, buffers 2*B*g; CPU s(T)*(4 + p) + optim
                      (fp32 grad partition, 16-bit staging copy, master, moments)
    zero3:            params s(P)*p + persistent*p (each tensor's `ds_tensor` partition; tensors
                      <= stage3_param_persistence_threshold also stay whole on every rank), grads
                      s(T)*g, optim s(T)*(m+o), buffers LL*(p+g) + B*(p+g) + copy32
    zero3_offload:    GPU params persistent*p, buffers as zero3 without copy32;
                      CPU s(P)*p + s(T)*(g + 4) + optim
    fsdp_full_shard:  params s(P)*p, grads s(T)*g, optim s(T)*o + steps, buffers 3*U*e
                      (current and prefetched unit gathered, plus the unit's unsharded grad);
                      s() per tensor by rows for FSDP2, per unit (flat parameter) for FSDP1
    fsdp_shard_grad_op: as full shard but buffers P*e + U*e (all units stay gathered from forward
                      to backward; steady state holds only the shards)
    fsdp_hybrid_shard: as full shard with N = GPUs per node (replicated across nodes)
    fsdp_offload:     GPU buffers 3*U*e only; CPU s(P)*p + s(T)*g + optim
    Grads are what a rank holds as the optimizer step begins (what the callback measures). Inside
    the step DeepSpeed makes an fp32 copy of the grad partition, copy32 = s(T)*4: ZeRO-1/2 only when
    grads are 16-bit (they cast a pre-flattened partition), ZeRO-3 always (it flattens the partition
    into a new tensor). With bf16, model states + copy32 are DeepSpeed's own 18 B/param estimate.
    ZeRO-1/2 flatten all trainable params and pad to a multiple of 2*N elements.

    Tensor parallel rows (transformers `DistributedConfig`; t = `tp_degree`, S = dp_shard, R =
    dp_replicate from `tp_mesh`), torch AdamW on DTensors, bytes per element as fsdp:
    tp:               params s_t(P)*p, grads s_t(T)*g, optim s_t(T)*o + steps, no buffers; s_t() =
                      each tensor split as the model's TP plan says (colwise and embedding_rowwise:
                      dim 0 / t, rowwise: last dim / t, norms and other unplanned tensors whole);
                      except that the embedding_rowwise weight's gradient is whole (V*h*g) on every
                      TP rank: DTensor's embedding backward returns it Replicate (measured)
    fsdp_tp, hsdp_tp: as tp, then FSDP2 splits each local TP shard's dim 0 over S (padded
                      ceil(rows / S) rows, as fsdp); buffers 3*ceil(U/t)*p (current + prefetched unit
                      gathered, + its unsharded grad; transformers' FSDP2 has no MixedPrecisionPolicy
                      unless DistributedConfig(fsdp_mixed_precision=True), so they are in the param dtype)
    From `--params` (no tensor list): ceil(P / (t*S)) and the row is `approximate`.
    Activations: `activation_bytes(spec, setup, t)`.

    Communication, `comm_bytes_per_step`: a computed figure (not measured), bytes each rank sends
    per optimizer step of A = grad_accum_steps micro-batches, with ring collectives: all-reduce of X
    bytes over n ranks sends 2(n-1)/n*X, all-gather and reduce-scatter (n-1)/n*X. P, T in elements:
    ddp:              grad all-reduce 2(N-1)/N*T*g (once per step: the Trainer's no_sync)
    zero1, zero2(_offload): grad reduce-scatter (N-1)/N*T*g (zero2: every micro-batch, x A) + all-gather
                      of the updated 16-bit params (N-1)/N*P*p
    zero3(_offload):  (N-1)/N * (2*A*P*p + A*T*g): params gathered in forward and in backward, grads
                      reduce-scattered in every backward
    fsdp_full_shard, fsdp_offload: (N-1)/N * (2*A*P*e + T*e); fsdp_shard_grad_op gathers once: A*P*e;
                      fsdp_hybrid_shard: N = GPUs per node, + 2(R-1)/R*s(T)*e across nodes
    tp:               A * [2(t-1)/t * ((4 + 2*ckpt)*L + 2) * b*s*h*e + (t-1)/t * b*s*V*e]: per layer 2
                      all-reduces of b*s*h*e in forward (after o_proj, down_proj) and 2 in backward
                      (input grads of q/k/v and gate/up), 2 more with activation checkpointing (the
                      recomputed forward); the embedding's forward all-reduce and lm_head's backward
                      input-grad all-reduce; lm_head's all-gather of the logits
    fsdp_tp, hsdp_tp: tp + (S-1)/S * (2*A*s_t(P)*p + s_t(T)*g) (FSDP2 over the TP shards, param
                      dtype) + hsdp_tp's 2(R-1)/R * s(s_t(T))*g across nodes
    """
    c = c or counts(spec, setup)
    fam = family(strategy)
    t = tp_degree(spec, setup) if fam == "tp" else 1
    act = activation_bytes(spec, setup, t)["total"] if activations is None else activations
    stage = int(strategy[4]) if fam == "deepspeed" else 0
    eb = element_bytes(setup.precision, fam, setup.optimizer, setup.fp32_grads, stage)
    p, g, m, o, e = eb.param, eb.grad, eb.master, eb.moments, eb.compute
    n = setup.gpus_per_node if strategy == "fsdp_hybrid_shard" else setup.world_size
    adam = setup.optimizer == "adamw"
    bucket = setup.bucket_elements if setup.bucket_elements is not None else spec.hidden_size ** 2
    cpu, detail, comm = 0, {}, {}
    mesh = tp_mesh(strategy, setup, t)
    A = setup.grad_accum_steps
    approximate = False

    def ring(k: int) -> float:  # bytes sent per byte all-gathered / reduce-scattered over k ranks
        return (k - 1) / k

    if fam == "torch":
        steps = 4 * c.n_trainable_tensors if adam else 0
        row = dict(params_bytes=c.total * p, grads_bytes=c.trainable * g,
                   optimizer_bytes=int(c.trainable * (m + o)) + steps)
        detail["ddp_buckets"] = 0 if setup.ddp_bucket_view or setup.world_size == 1 else c.trainable * g
        n = 1
    elif fam == "deepspeed" and stage in (1, 2):
        shard = _ceil_div(c.trainable, 2 * n) * 2
        steps = 4 * setup.zero_param_groups if adam else 0
        optim = int(shard * (m + o)) + steps
        detail["reduce_buckets"] = 2 * bucket * g
        if strategy == "zero2_offload":
            row = dict(params_bytes=c.total * p, grads_bytes=0, optimizer_bytes=0)
            cpu = shard * (4 + p) + optim
        else:
            row = dict(params_bytes=c.total * p, grads_bytes=shard * g, optimizer_bytes=optim)
            detail["fp32_grad_copy_in_step"] = shard * 4 if g < 4 else 0
            if stage == 1 and setup.grad_accum_steps > 1:
                detail["accumulated_full_grads"] = c.trainable * g
    elif fam == "deepspeed":
        threshold = (setup.zero3_persistence_threshold if setup.zero3_persistence_threshold is not None
                     else 10 * spec.hidden_size)
        pshard, tshard = _shard_tensors(c, n), _shard_tensors(c, n, trainable_only=True)
        steps = 4 * setup.zero_param_groups if adam else 0
        optim = int(tshard * (m + o)) + steps
        detail["gathered_layer"] = spec.largest_layer_params * (p + g)
        detail["buckets"] = bucket * (p + g)
        # Tensors at or below the persistence threshold also stay whole on every rank, on the GPU.
        persistent = sum(d * r for d, r, _ in c.tensors if d * r <= threshold) * p
        if strategy == "zero3_offload":
            row = dict(params_bytes=persistent, grads_bytes=0, optimizer_bytes=0)
            cpu = pshard * p + tshard * (g + 4) + optim
        else:
            row = dict(params_bytes=pshard * p + persistent, grads_bytes=tshard * g, optimizer_bytes=optim)
            detail["fp32_grad_copy_in_step"] = tshard * 4
    elif fam == "tp":
        S, R = mesh["dp_shard"], mesh["dp_replicate"]
        pshard, tshard = _tp_fsdp_shard(c, t, S), _tp_fsdp_shard(c, t, S, trainable_only=True)
        gshard = tshard if R * S > 1 else _tp_fsdp_shard(c, t, 1, trainable_only=True, tp_grads=True)
        steps = 4 * c.n_trainable_tensors if adam else 0
        row = dict(params_bytes=pshard * p, grads_bytes=gshard * g, optimizer_bytes=int(tshard * (m + o)) + steps)
        approximate = not c.tensors
        comm.update(_tp_comm(spec, setup, t, e))
        if R * S > 1:  # transformers applies FSDP2 over (dp_replicate, fsdp) when dp_size > 1
            unit = _ceil_div(max(c.units), t)
            detail["gathered_units"], detail["unit_grad"] = 2 * unit * p, unit * g
            ptp, ttp = _tp_fsdp_shard(c, t, 1), _tp_fsdp_shard(c, t, 1, trainable_only=True)
            comm["param_all_gather"] = 2 * A * ring(S) * ptp * p
            comm["grad_reduce_scatter"] = ring(S) * ttp * g
            if R > 1:
                comm["grad_all_reduce"] = 2 * ring(R) * tshard * g
        n = t * S
    else:  # fsdp
        if setup.fsdp_version == 1:  # one padded flat parameter per unit
            pshard = sum(_ceil_div(u, n) for u in c.units)
            tshard = pshard if c.trainable == c.total else _ceil_div(c.trainable, n)
        else:
            pshard = _shard_tensors(c, n, by_rows=True)
            tshard = _shard_tensors(c, n, trainable_only=True, by_rows=True)
        steps = 4 * c.n_trainable_tensors if adam else 0
        optim = int(tshard * (m + o)) + steps
        unit = max(c.units)
        if strategy == "fsdp_shard_grad_op":
            detail["gathered_params"], detail["unit_grad"] = c.total * e, unit * e
        else:
            detail["gathered_units"], detail["unit_grad"] = 2 * unit * e, unit * e
        if strategy == "fsdp_offload":
            row = dict(params_bytes=0, grads_bytes=0, optimizer_bytes=0)
            cpu = pshard * p + tshard * g + optim
        else:
            row = dict(params_bytes=pshard * p, grads_bytes=tshard * g, optimizer_bytes=optim)
    if fam == "torch":
        comm["grad_all_reduce"] = 2 * ring(setup.world_size) * c.trainable * g
    elif fam == "deepspeed":
        N = setup.world_size
        if stage in (1, 2):
            comm["grad_reduce_scatter"] = ring(N) * c.trainable * g * (A if stage == 2 else 1)
            comm["param_all_gather"] = ring(N) * c.total * p
        else:
            comm["param_all_gather"] = 2 * A * ring(N) * c.total * p
            comm["grad_reduce_scatter"] = A * ring(N) * c.trainable * g
    elif fam == "fsdp":
        gathers = 1 if strategy == "fsdp_shard_grad_op" else 2
        comm["param_all_gather"] = gathers * A * ring(n) * c.total * e
        comm["grad_reduce_scatter"] = ring(n) * c.trainable * e
        if strategy == "fsdp_hybrid_shard" and setup.nodes > 1:
            comm["grad_all_reduce"] = 2 * ring(setup.nodes) * _ceil_div(c.trainable, n) * e
    comm = {k: int(v) for k, v in comm.items()}
    return Row(strategy=strategy, activations_bytes=act, buffers_bytes=int(sum(detail.values())),
               cpu_bytes=int(cpu), buffers_detail=detail, shard_degree=n, mesh=mesh,
               comm_bytes_per_step=sum(comm.values()), comm=comm, approximate=approximate, **row)


def _tp_comm(spec: ModelSpec, setup: Setup, t: int, e: int) -> dict:
    """Tensor-parallel traffic per rank per optimizer step (see `strategy_row`): activation
    all-reduces of b*s*h*e bytes and lm_head's all-gather of the b*s*V*e logits, over t ranks."""
    if t == 1:
        return {}
    tokens = setup.micro_batch * activation_bytes(spec, setup)["tokens_per_sample"] * setup.grad_accum_steps
    per_layer = 4 + (2 if setup.activation_checkpointing else 0)
    all_reduces = per_layer * spec.num_layers + 2
    out = {"tp_all_reduce": 2 * (t - 1) / t * all_reduces * tokens * spec.hidden_size * e}
    if spec.vocab_size:
        out["tp_logits_all_gather"] = (t - 1) / t * tokens * spec.vocab_size * e
    return out


# ----------------------------------------------------------------------------- plan
TIERS = (("ddp",), ("fsdp_shard_grad_op", "zero2"), ("fsdp_hybrid_shard",), ("fsdp_full_shard", "zero3"),
         ("hsdp_tp",), ("tp",), ("fsdp_tp",), ("zero2_offload",), ("fsdp_offload", "zero3_offload"))


def _usable(setup: Setup) -> float | None:
    return None if setup.gpu_memory_bytes is None else setup.gpu_memory_bytes * (1 - setup.headroom)


def _fits(row: Row, setup: Setup) -> bool | None:
    usable = _usable(setup)
    if usable is None:
        return None
    cpu_ok = setup.cpu_memory_bytes is None or row.cpu_bytes * setup.gpus_per_node <= setup.cpu_memory_bytes
    return row.total_bytes <= usable and cpu_ok


def recommend(rows: list[Row], setup: Setup) -> dict:
    """The fastest strategy that fits with headroom, in the order DDP -> ZeRO-2/SHARD_GRAD_OP ->
    (HYBRID_SHARD on several nodes) -> ZeRO-3/FULL_SHARD -> (HSDP x TP on several nodes) -> TP
    (when it spans all the GPUs: world = t) -> FSDP x TP -> ZeRO-2 offload -> ZeRO-3/FSDP offload;
    within a tier `setup.prefer` ("fsdp" or "deepspeed") goes first. TP comes after full sharding:
    FSDP over the same N ranks already divides the model states by N; what TP adds is smaller
    activations (the attention/MLP internals / t) and smaller gathered units (/ t), for per-layer
    all-reduces of the activations. The TP rows are skipped at degree 1 (absent without a TP plan)."""
    if setup.gpu_memory_bytes is None:
        return {"strategy": None, "reason": "no GPU memory given (--gpu NAME or --gpu-memory SIZE)"}
    by_name = {r.strategy: r for r in rows}
    usable = _usable(setup)
    tried = []
    for tier in TIERS:
        if tier == ("fsdp_hybrid_shard",) and setup.nodes == 1:
            continue  # one node: identical to full shard
        if tier[0] in TP_STRATEGIES:
            row = by_name.get(tier[0])
            if row is None or row.mesh["tp"] == 1:  # estimate() leaves out rows that repeat a mesh
                continue
            if tier == ("tp",) and row.mesh["tp"] != setup.world_size:
                continue  # TP alone uses t GPUs of one node, not all of them
        names = sorted(tier, key=lambda s: family(s) != setup.prefer)
        for name in names:
            row = by_name[name]
            if row.fits:
                why = (f"{name} needs {gb(row.total_bytes)} GB per GPU of {gb(usable)} GB usable "
                       f"({gb(setup.gpu_memory_bytes)} GB less {setup.headroom:.0%} headroom)")
                if name in TP_STRATEGIES:
                    mesh = row.mesh
                    why += (f", tensor parallel {mesh['tp']} x FSDP {mesh['dp_shard']}"
                            + (f" x replicas {mesh['dp_replicate']}" if mesh["dp_replicate"] > 1 else ""))
                if tried:
                    why += "; faster options do not fit: " + ", ".join(tried)
                return {"strategy": name, "reason": why}
            tried.append(f"{name} {gb(row.total_bytes)} GB")
    hint = "" if setup.activation_checkpointing else ", activation checkpointing"
    return {"strategy": None, "reason": f"nothing fits in {gb(usable)} GB usable per GPU; try more GPUs, "
                                         f"a smaller micro-batch{hint} or LoRA"}


def estimate(spec: ModelSpec, setup: Setup) -> dict:
    """Rows for every strategy, the recommendation, and what they were computed from."""
    setup.validate()
    c = counts(spec, setup)
    act = activation_bytes(spec, setup)
    notes = []
    if spec.tp_plan:
        t = tp_degree(spec, setup)
        act_tp = activation_bytes(spec, setup, t)
        # fsdp_tp is tp when tp spans every GPU, hsdp_tp is fsdp_tp on one node: show each mesh once
        same = {"fsdp_tp": setup.world_size == t, "hsdp_tp": setup.nodes == 1}
        strategies = tuple(s for s in STRATEGIES if not same.get(s))
        if any(same.values()):
            notes.append("rows " + " and ".join(s for s, dup in same.items() if dup) + " left out: on this setup "
                         "their mesh is the one of the row above them")
        kv = spec.num_kv_heads or spec.num_heads
        tp_info = {"degree": t, "source": "--tp" if setup.tp_size is not None else
                   f"default: gcd(GPUs per node {setup.gpus_per_node}, heads {spec.num_heads}, KV heads {kv})",
                   "activations": act_tp, "approximate": not c.tensors}
        if not c.tensors:
            notes.append("tp/fsdp_tp/hsdp_tp rows from --params are approximate: totals / (tp x dp_shard)")
        if spec.tp_note:
            notes.append(spec.tp_note)
    else:
        if setup.tp_size is not None:
            tp_degree(spec, setup)  # raises: no plan
        strategies = tuple(s for s in STRATEGIES if s not in TP_STRATEGIES)
        tp_info, act_tp = None, None
        notes.append(f"no tp/fsdp_tp/hsdp_tp rows: {spec.tp_note}")
    rows = [strategy_row(s, spec, setup, c, (act_tp if s in TP_STRATEGIES else act)["total"]) for s in strategies]
    for row in rows:
        row.fits = _fits(row, setup)
    return {
        "rows": [asdict(r) for r in rows],
        "recommendation": recommend(rows, setup),
        "model": {"name": spec.name, "params_total": c.total, "trainable_params": c.trainable,
                  "exact": spec.exact, "assumed": list(spec.assumed), "largest_layer_params": spec.largest_layer_params,
                  "largest_unit_params": max(c.units), "hidden_size": spec.hidden_size, "num_layers": spec.num_layers,
                  "vocab_size": spec.vocab_size, "tied_embeddings": spec.tied_embeddings},
        "setup": {**asdict(setup), "world_size": setup.world_size},
        "activations": act,
        "tp": tp_info,
        "notes": ["model states (params, grads, optimizer) are exact counts; activations are an estimate",
                  "optimizer_bytes includes fp32 master weights; bytes per GPU; see docs/planner.md",
                  "comm_bytes_per_step is computed from ring-collective formulas, not measured", *notes],
    }


# ----------------------------------------------------------------------------- seed convention
def seed_table(params: float = 7e9, gpus: int = 4) -> dict:
    """The seed article's 12 B/param (2 weights + 2 grads + 8 Adam moments) beside the planner's
    16 B/param (+4 B fp32 master weights), model states only, per GPU:
        none = (p+g+k)*P;  ZeRO-1 = (p+g)*P + k*P/N;  ZeRO-2 = p*P + (g+k)*P/N;  ZeRO-3 = (p+g+k)*P/N
    7e9 on 4 GPUs: 84 / 42 / 31.5 / 21 GB (k=8) and 112 / 49 / 38.5 / 28 GB (k=12)."""
    def row(p, g, k):
        return {"none": (p + g + k) * params, "zero1": (p + g) * params + k * params / gpus,
                "zero2": p * params + (g + k) * params / gpus, "zero3": (p + g + k) * params / gpus}
    return {"params": params, "gpus": gpus,
            "seed-12": {"bytes_per_param": "2+2+8", **row(2, 2, 8)},
            "planner-16": {"bytes_per_param": "2+2+12", **row(2, 2, 12)},
            "explanation": ("the seed's 12 B/param leaves out the 4 B fp32 master copy of the weights that "
                            "mixed-precision Adam updates (bf16 alone cannot hold small updates); the ZeRO "
                            "paper's K=12 is 4 master + 4 momentum + 4 variance, so 2+2+12 = 16 B/param, "
                            "18 with fp32 gradients. Sharded terms differ by 4 B x P/N.")}


# ----------------------------------------------------------------------------- compare
_PRECISION_ALIASES = {"no": "fp32", "fp32": "fp32", "float32": "fp32", "bf16": "bf16-mixed",
                      "fp16": "fp16-mixed", "bf16-mixed": "bf16-mixed", "fp16-mixed": "fp16-mixed",
                      "bf16-pure": "bf16-pure", "bf16-true": "bf16-pure"}


def _strategy_from_summary(summary: dict) -> str | None:
    name = str(summary.get("strategy", "")).lower().replace("-", "_")
    if name in STRATEGIES:
        return name
    detail = summary.get("strategy_detail") or {}
    if name.startswith(("deepspeed", "zero")) and detail.get("stage") is not None:
        offload = detail.get("offload_optimizer") or detail.get("offload_param")
        return f"zero{int(detail['stage'])}" + ("_offload" if offload and int(detail["stage"]) in (2, 3) else "")
    if name.startswith("fsdp"):
        sharding = str(detail.get("sharding_strategy", "FULL_SHARD")).lower()
        if detail.get("cpu_offload") or detail.get("offload_params"):
            return "fsdp_offload"
        return "fsdp_" + sharding.split(".")[-1] if "fsdp_" + sharding.split(".")[-1] in STRATEGIES else None
    if name in ("single", "multi_gpu", "multi_cpu", "no"):
        return "ddp"
    return None


def read_summary(path: str | Path) -> dict:
    """Load a callback summary; one-line `UsageError` naming the file and key when it is bad."""
    try:
        summary = json.loads(Path(path).read_text())
    except OSError as error:
        raise UsageError(f"summary '{path}' cannot be read: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise UsageError(f"summary '{path}' is not valid JSON: {error.msg} at line {error.lineno} "
                         f"column {error.colno}") from None
    if not isinstance(summary, dict):
        raise UsageError(f"summary '{path}' is not a JSON object")
    for key in ("world_size", "strategy", "ranks"):
        if key not in summary:
            raise UsageError(f"summary '{path}' has no key '{key}'")
    if not isinstance(summary["ranks"], list) or not summary["ranks"]:
        raise UsageError(f"summary '{path}': key 'ranks' must be a non-empty list")
    for i, rank in enumerate(summary["ranks"]):
        for key in COMPONENTS:
            value = rank.get(key) if isinstance(rank, dict) else None
            if not isinstance(value, (int, float)):
                raise UsageError(f"summary '{path}': key 'ranks[{i}].{key}' is missing or not a number")
    return summary


def compare(summary_path: str | Path, spec: ModelSpec | None = None, setup: Setup | None = None) -> dict:
    """Planner estimate for the summary's strategy, world size, precision and model beside each
    rank's measured bytes: per component planned, measured, rel_diff = (measured - planned)/planned."""
    summary = read_summary(summary_path)
    strategy = _strategy_from_summary(summary)
    if strategy is None:
        raise UsageError(f"summary '{summary_path}': key 'strategy' ({summary['strategy']!r}) is not one of "
                         f"{', '.join(STRATEGIES)}")
    world, nodes = int(summary["world_size"]), int(summary.get("num_nodes") or 1)
    precision = _PRECISION_ALIASES.get(str(summary.get("precision", "fp32")).lower())
    if precision is None:
        raise UsageError(f"summary '{summary_path}': key 'precision' ({summary.get('precision')!r}) is not one of "
                         f"{', '.join(PRECISIONS)}")
    info = summary.get("model") or {}
    if spec is None:
        source = info.get("name_or_path")
        if source and (os.path.isdir(source) or resolve_model(source) != source):
            spec = model_spec(source)
        elif info.get("params_total"):
            spec = spec_from_count(info["params_total"])
        else:
            raise UsageError(f"summary '{summary_path}': key 'model.name_or_path' is not a local folder; "
                             f"pass --model")
    setup = replace(setup or Setup(), gpus_per_node=max(1, world // nodes), nodes=nodes, precision=precision)
    mesh = summary.get("mesh")
    if strategy in TP_STRATEGIES:
        if not isinstance(mesh, dict) or not all(isinstance(mesh.get(k), int) and mesh[k] >= 1
                                                 for k in ("dp_replicate", "dp_shard", "tp")):
            raise UsageError(f"summary '{summary_path}': key 'mesh' must give positive integers dp_replicate, "
                             f"dp_shard and tp for strategy {strategy}, got {mesh!r}")
        degrees = mesh["dp_replicate"] * mesh["dp_shard"] * mesh["tp"]
        if degrees != world:
            raise UsageError(f"summary '{summary_path}': key 'mesh' ({mesh['dp_replicate']} x {mesh['dp_shard']} x "
                             f"{mesh['tp']} = {degrees}) disagrees with world_size {world}")
        by_mesh, setup = setup_for_mesh(setup, mesh)
        if by_mesh != strategy:
            raise UsageError(f"summary '{summary_path}': key 'strategy' ({strategy}) disagrees with key 'mesh' "
                             f"{mesh} (which is {by_mesh})")
    detail = summary.get("strategy_detail") or {}
    if strategy.startswith("zero3") and isinstance(detail.get("stage3_param_persistence_threshold"), (int, float)):
        setup = replace(setup, zero3_persistence_threshold=int(detail["stage3_param_persistence_threshold"]))
    if strategy.startswith("fsdp") and detail.get("fsdp_version") in (1, 2, "1", "2"):
        setup = replace(setup, fsdp_version=int(detail["fsdp_version"]))
    row = strategy_row(strategy, spec, setup)
    planned = {k: getattr(row, k) for k in COMPONENTS}
    planned["model_states_bytes"] = row.model_states_bytes
    ranks = []
    for rank in summary["ranks"]:
        measured = {k: rank[k] for k in COMPONENTS}
        measured["model_states_bytes"] = sum(measured.values())
        ranks.append({"rank": rank.get("rank"), "components": [
            {"component": k, "planned": planned[k], "measured": measured[k],
             "rel_diff": (measured[k] - planned[k]) / planned[k] if planned[k] else None} for k in planned],
            "peak_memory_bytes": rank.get("peak_memory_bytes"), "memory_kind": rank.get("memory_kind")})
    trainable = info.get("trainable_params")
    return {"summary": str(summary_path), "strategy": strategy, "world_size": world, "num_nodes": nodes,
            "mesh": row.mesh, "precision": precision, "model": spec.name, "planned_total_bytes": row.total_bytes,
            "params_total_planned": spec.params_total, "params_total_measured": info.get("params_total"),
            "trainable_params_measured": trainable, "ranks": ranks}


# ----------------------------------------------------------------------------- printing
def gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.3g}" if n < 1e10 else f"{n / 1e9:.1f}"


def format_table(result: dict) -> str:
    m, s = result["model"], result["setup"]
    gpu = f"{gb(s['gpu_memory_bytes'])} GB" if s["gpu_memory_bytes"] else "no GPU memory given"
    lines = [
        f"model {m['name']}: {m['params_total']:,} params ({'exact, meta device' if m['exact'] else 'from --params'}"
        + (f"; assumed {', '.join(m['assumed'])}" if m["assumed"] else "") + f"), trainable {m['trainable_params']:,}",
        f"{s['world_size']} GPUs ({s['gpus_per_node']} x {s['nodes']} nodes, {gpu} each), {s['precision']}, "
        f"{s['optimizer']}, micro-batch {s['micro_batch']}, "
        f"{result['activations']['tokens_per_sample']} tokens/sample, checkpointing "
        f"{'on' if s['activation_checkpointing'] else 'off'}" + (f", LoRA r={s['lora_rank']}" if s["lora_rank"] else ""),
    ]
    tp = result.get("tp")
    if tp:
        meshes = {r["strategy"]: r["mesh"] for r in result["rows"]}
        lines.append(f"tensor parallel degree {tp['degree']} ({tp['source']}); dp_replicate x dp_shard x tp: "
                     + ", ".join(f"{n} {m['dp_replicate']}x{m['dp_shard']}x{m['tp']}" for n, m in meshes.items()
                                 if n in TP_STRATEGIES) + ("; approximate (--params)" if tp["approximate"] else ""))
    lines += ["", "per GPU, GB (1e9 B)   params   grads  optim  activ*  buffers   total  | CPU/rank  fits  comm/step**"]
    for r in result["rows"]:
        fits = {True: "yes", False: "no", None: "?"}[r["fits"]]
        lines.append(f"{r['strategy'] + ('~' if r.get('approximate') else ''):<20} {gb(r['params_bytes']):>8} "
                     f"{gb(r['grads_bytes']):>7} {gb(r['optimizer_bytes']):>6} {gb(r['activations_bytes']):>7} "
                     f"{gb(r['buffers_bytes']):>8} {gb(r['total_bytes']):>7}  | "
                     f"{gb(r['cpu_bytes']) if r['cpu_bytes'] else '':>8}  {fits:<4}  "
                     f"{gb(r['comm_bytes_per_step']):>10}")
    rec = result["recommendation"]
    lines += ["", f"recommendation: {rec['strategy'] or 'none'}: {rec['reason']}",
              "* activations are an estimate; params/grads/optimizer are exact counts "
              "(optimizer includes fp32 master weights). Formulas: docs/planner.md",
              "** GB each GPU sends per optimizer step: computed from ring-collective formulas, not measured"]
    if any(r.get("approximate") for r in result["rows"]):
        lines.append("~ approximate: no per-tensor shapes (--params), totals divided by tp x dp_shard")
    lines += [n for n in result.get("notes", [])[3:] if not n.startswith("tp/fsdp_tp/hsdp_tp rows from --params")]
    return "\n".join(lines)


def format_seed(table: dict) -> str:
    lines = [f"{table['params']:.3g} params on {table['gpus']} GPUs, model states per GPU (GB)",
             f"{'basis':<24}{'none':>8}{'ZeRO-1':>8}{'ZeRO-2':>8}{'ZeRO-3':>8}"]
    for key in ("seed-12", "planner-16"):
        r = table[key]
        lines.append(f"{key + ' (' + r['bytes_per_param'] + ')':<24}" +
                     "".join(f"{r[k] / 1e9:>8.4g}" for k in ("none", "zero1", "zero2", "zero3")))
    return "\n".join(lines + ["", table["explanation"]])


def format_compare(result: dict) -> str:
    mesh = result.get("mesh") or {}
    where = f" (mesh {mesh['dp_replicate']}x{mesh['dp_shard']}x{mesh['tp']})" if mesh.get("tp", 1) > 1 else ""
    lines = [f"{result['summary']}: {result['strategy']}{where}, world size {result['world_size']}, "
             f"{result['precision']}, "
             f"model {result['model']} (planned {result['params_total_planned']:,} params, "
             f"measured {result['params_total_measured'] or '?'})",
             f"{'rank':<5}{'component':<20}{'planned':>14}{'measured':>14}{'rel diff':>10}"]
    for rank in result["ranks"]:
        for comp in rank["components"]:
            diff = "-" if comp["rel_diff"] is None else f"{comp['rel_diff']:+.2%}"
            lines.append(f"{str(rank['rank']):<5}{comp['component']:<20}{comp['planned']:>14,}"
                         f"{comp['measured']:>14,}{diff:>10}")
        if rank.get("peak_memory_bytes"):
            lines.append(f"{'':<5}{'peak (' + str(rank['memory_kind']) + ')':<20}{result['planned_total_bytes']:>14,}"
                         f"{int(rank['peak_memory_bytes']):>14,}   (whole-process; not like for like on CPU)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30,
          "ti": 2 ** 40}


def parse_size(text: str, what: str = "--gpu-memory") -> int:
    """'80GB' (1e9), '80GiB' (2**30), '8.6e10' (bytes); a bare number below 1e6 is GiB."""
    if str(text).strip().startswith("-"):
        raise UsageError(f"{what} must be positive, got '{text}'")
    match = _SIZE.match(str(text))
    if not match:
        raise UsageError(f"{what} '{text}' is not a size (e.g. 80GB, 80GiB, 85899345920)")
    value, unit = float(match.group(1)), (match.group(2) or "").lower().rstrip("b")
    if not unit and (match.group(2) or "") == "" and value < 1e6:
        unit = "gi"
    if value <= 0:
        raise UsageError(f"{what} must be positive, got '{text}'")
    return int(value * _UNITS[unit])


def parse_count(text: str, what: str = "--params") -> float:
    """'7e9', '7B', '350M', '70b'."""
    match = re.match(r"^\s*(-?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*$", str(text), re.IGNORECASE)
    if not match:
        raise UsageError(f"{what} '{text}' is not a number (e.g. 7e9 or 7B)")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
    if value <= 0:
        raise UsageError(f"{what} must be positive, got '{text}'")
    return value


def gpu_memory(name: str) -> int:
    key = {k.lower(): k for k in GPUS}.get(name.lower().replace("_", "-"))
    if key is None:
        raise UsageError(f"unknown GPU '{name}' (known: {', '.join(GPUS)}; or give --gpu-memory 80GiB)")
    return GPUS[key][0] * 2 ** 30


def build_parser(subparsers):
    p = subparsers.add_parser("plan", help="per-GPU memory of every strategy, and which to use",
                              description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("model (one of)")
    src.add_argument("--model", help=f"shipped name ({', '.join(shipped_models())}), local folder or hub id")
    src.add_argument("--params", help="parameter count, e.g. 7e9 or 7B")
    src.add_argument("--layers", type=int)
    src.add_argument("--hidden", type=int)
    src.add_argument("--vocab", type=int)
    hw = p.add_argument_group("hardware")
    hw.add_argument("--gpus", type=int, default=1, help="GPUs per node (default 1)")
    hw.add_argument("--nodes", type=int, default=1)
    hw.add_argument("--gpu", help=f"GPU name: {', '.join(GPUS)}")
    hw.add_argument("--gpu-memory", help="memory per GPU: 80GB, 80GiB, bytes; bare number < 1e6 = GiB")
    hw.add_argument("--cpu-memory", help="CPU memory per node, checked for offload rows")
    hw.add_argument("--headroom", type=float, default=0.10, help="fraction kept free (default 0.10)")
    tr = p.add_argument_group("training")
    tr.add_argument("--precision", choices=PRECISIONS, default="bf16-mixed")
    tr.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    tr.add_argument("--fp32-grads", action="store_true", help="DeepSpeed grad_accum_dtype fp32 (18 B/param)")
    tr.add_argument("--micro-batch", type=int, default=1)
    tr.add_argument("--seq-len", type=int, default=2048)
    tr.add_argument("--image-size", type=int, help="vision models: overrides the config's image size")
    tr.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    tr.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa")
    tr.add_argument("--lora-rank", type=int, default=0)
    tr.add_argument("--lora-targets", default=",".join(LORA_DEFAULT_TARGETS), help="comma list or all-linear")
    tr.add_argument("--prefer", choices=("fsdp", "deepspeed"), default="fsdp")
    tr.add_argument("--tp", type=int, help="tensor-parallel degree of the tp/fsdp_tp/hsdp_tp rows (default: the "
                                           "largest that divides --gpus, num_attention_heads and num_key_value_heads)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="machine-readable, bytes per GPU")
    out.add_argument("--convention", choices=("seed-12",), help="print the 12 vs 16 B/param seed table")
    out.add_argument("--compare", metavar="SUMMARY_JSON", help="planned vs measured, from the callback's summary")
    p.set_defaults(func=plan_command)
    return p


def register(subparsers) -> None:
    from .dry_run import add_arguments  # `--dry-run`: plugin/shardscope/dry_run.py

    add_arguments(build_parser(subparsers))


def setup_from_args(args) -> Setup:
    if args.gpu and args.gpu_memory:
        raise UsageError("give --gpu or --gpu-memory, not both")
    memory = gpu_memory(args.gpu) if args.gpu else parse_size(args.gpu_memory) if args.gpu_memory else None
    return Setup(gpus_per_node=args.gpus, nodes=args.nodes, gpu_memory_bytes=memory, precision=args.precision,
                 optimizer=args.optimizer, micro_batch=args.micro_batch, seq_len=args.seq_len,
                 image_size=args.image_size, activation_checkpointing=args.checkpointing,
                 attention=args.attention, lora_rank=args.lora_rank,
                 lora_targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()),
                 fp32_grads=args.fp32_grads, headroom=args.headroom, prefer=args.prefer, tp_size=args.tp,
                 cpu_memory_bytes=parse_size(args.cpu_memory, "--cpu-memory") if args.cpu_memory else None).validate()


def plan_command(args) -> int:
    setup = setup_from_args(args)  # validate cheap inputs before any model is loaded
    for key in ("layers", "hidden", "vocab"):
        if getattr(args, key) is not None and getattr(args, key) <= 0:
            raise UsageError(f"--{key} must be positive, got {getattr(args, key)}")
    params = parse_count(args.params) if args.params is not None else None
    if args.model and params is not None:
        raise UsageError("give --model or --params, not both")
    if args.convention:
        table = seed_table(params or 7e9, args.gpus * args.nodes)
        print(json.dumps(table, indent=1) if args.json else format_seed(table))
        return 0
    if args.compare:
        spec = model_spec(args.model, params=params, layers=args.layers, hidden=args.hidden,
                          vocab=args.vocab) if (args.model or params) else None
        result = compare(args.compare, spec, setup)
        print(json.dumps(result, indent=1) if args.json else format_compare(result))
        return 0
    spec = model_spec(args.model, params=params, layers=args.layers, hidden=args.hidden, vocab=args.vocab)
    result = estimate(spec, setup)
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0
