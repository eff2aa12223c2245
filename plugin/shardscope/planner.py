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

STRATEGIES = ("ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload",
              "fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard", "fsdp_offload")
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
    )


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
        return self


@dataclass(frozen=True)
class ElementBytes:
    param: int    # model weights as held by the rank
    grad: int     # gradients as held between backward and step
    master: int   # separate fp32 master copy owned by the optimizer (0: the params are the master)
    moments: float  # optimizer moments per trainable parameter (AdamW: 2 x state dtype)
    compute: int  # dtype of gathered (unsharded) params and of activations


def family(strategy: str) -> str:
    return "deepspeed" if strategy.startswith("zero") else "fsdp" if strategy.startswith("fsdp") else "torch"


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
def activation_bytes(spec: ModelSpec, setup: Setup) -> dict:
    """Estimated activation memory per GPU for one micro-batch (an estimate, not a count).

    s = tokens per sample (text: seq_len; vision: (image/patch)^2 + CLS/registers), b = micro-batch,
    h = hidden, a = heads, L = layers, V = vocab, e = compute bytes (2 for 16-bit, 4 for fp32).
    Per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation", no tensor parallelism):
        layer = s*b*h*(34 + 5*a*s/h) * e/2 bytes   (the 5as/h attention-score term only for eager
                                                  attention; SDPA/flash attention keeps no s x s)
    No checkpointing: L * layer. Checkpointing: L * s*b*h*e (each layer's input) + one layer
    (recomputed during backward). Text adds logits: b*s*V*4 (fp32 upcast for the loss) plus
    b*s*V*e when e = 2 (the 16-bit logits). Vision adds b*num_labels*4.
    """
    if spec.kind == "vision":
        image = setup.image_size or spec.image_size
        s = (image // spec.patch_size) ** 2 + spec.extra_tokens
    else:
        s = setup.seq_len
    b, h, a, L = setup.micro_batch, spec.hidden_size, spec.num_heads, spec.num_layers
    e = 2 if setup.precision != "fp32" else 4
    scores = 5 * a * s / h if setup.attention == "eager" else 0
    layer = s * b * h * (34 + scores) * e / 2
    layers = L * s * b * h * e + layer if setup.activation_checkpointing else L * layer
    if spec.kind == "vision":
        head = b * spec.num_labels * 4
    else:
        head = b * s * spec.vocab_size * (4 + (e if e == 2 else 0))
    return {"tokens_per_sample": s, "per_layer": int(layer), "layers": int(layers), "head": int(head),
            "total": int(layers + head)}


# ----------------------------------------------------------------------------- model states
@dataclass(frozen=True)
class Counts:
    """Parameter counts after LoRA: every tensor (dim 0, rest, trainable) and the FSDP1 units."""

    tensors: tuple[tuple[int, int, bool], ...]  # () when counted from --params
    total: int
    trainable: int
    units: tuple[int, ...]
    n_trainable_tensors: int


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
    if not setup.lora_rank:
        return Counts(base, spec.params_total, spec.params_total, spec.unit_numels, spec.num_tensors)
    lora = lora_params(spec, setup.lora_rank, setup.lora_targets)
    if not lora:
        raise UsageError(f"no Linear layer of {spec.name} matches LoRA targets {','.join(setup.lora_targets)}")
    added = sum(d * r for d, r in lora)
    tensors = base + tuple((d, r, True) for d, r in lora) if base else ()
    blocks = spec.unit_numels[:-1] or spec.unit_numels
    units = tuple(u + added // len(blocks) for u in blocks) + (spec.unit_numels[-1:] if spec.unit_numels[:-1] else ())
    return Counts(tensors, spec.params_total + added, added, units, len(lora))


def _shard_tensors(c: Counts, n: int, trainable_only: bool = False, by_rows: bool = False) -> int:
    """Each tensor partitioned on its own: ZeRO-3 pads the flattened tensor, ceil(numel/n);
    FSDP2 (`by_rows`) splits dim 0, ceil(dim0/n) * rest. Without a tensor list: ceil(total/n)."""
    if not c.tensors:
        return _ceil_div(c.trainable if trainable_only else c.total, n)
    return sum(_ceil_div(d, n) * r if by_rows else _ceil_div(d * r, n)
               for d, r, train in c.tensors if train or not trainable_only)


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
    """
    c = c or counts(spec, setup)
    act = activation_bytes(spec, setup)["total"] if activations is None else activations
    fam = family(strategy)
    stage = int(strategy[4]) if fam == "deepspeed" else 0
    eb = element_bytes(setup.precision, fam, setup.optimizer, setup.fp32_grads, stage)
    p, g, m, o, e = eb.param, eb.grad, eb.master, eb.moments, eb.compute
    n = setup.gpus_per_node if strategy == "fsdp_hybrid_shard" else setup.world_size
    adam = setup.optimizer == "adamw"
    bucket = setup.bucket_elements if setup.bucket_elements is not None else spec.hidden_size ** 2
    cpu, detail = 0, {}

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
    return Row(strategy=strategy, activations_bytes=act, buffers_bytes=int(sum(detail.values())),
               cpu_bytes=int(cpu), buffers_detail=detail, shard_degree=n, **row)


# ----------------------------------------------------------------------------- plan
TIERS = (("ddp",), ("fsdp_shard_grad_op", "zero2"), ("fsdp_hybrid_shard",), ("fsdp_full_shard", "zero3"),
         ("zero2_offload",), ("fsdp_offload", "zero3_offload"))


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
    (HYBRID_SHARD on several nodes) -> ZeRO-3/FULL_SHARD -> ZeRO-2 offload -> ZeRO-3/FSDP offload;
    within a tier `setup.prefer` ("fsdp" or "deepspeed") goes first."""
    if setup.gpu_memory_bytes is None:
        return {"strategy": None, "reason": "no GPU memory given (--gpu NAME or --gpu-memory SIZE)"}
    by_name = {r.strategy: r for r in rows}
    usable = _usable(setup)
    tried = []
    for tier in TIERS:
        if tier == ("fsdp_hybrid_shard",) and setup.nodes == 1:
            continue  # one node: identical to full shard
        names = sorted(tier, key=lambda s: family(s) != setup.prefer)
        for name in names:
            row = by_name[name]
            if row.fits:
                why = (f"{name} needs {gb(row.total_bytes)} GB per GPU of {gb(usable)} GB usable "
                       f"({gb(setup.gpu_memory_bytes)} GB less {setup.headroom:.0%} headroom)")
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
    rows = [strategy_row(s, spec, setup, c, act["total"]) for s in STRATEGIES]
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
        "notes": ["model states (params, grads, optimizer) are exact counts; activations are an estimate",
                  "optimizer_bytes includes fp32 master weights; bytes per GPU; see docs/planner.md"],
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
            "precision": precision, "model": spec.name, "planned_total_bytes": row.total_bytes,
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
        "",
        "per GPU, GB (1e9 B)   params   grads  optim  activ*  buffers   total  | CPU/rank  fits",
    ]
    for r in result["rows"]:
        fits = {True: "yes", False: "no", None: "?"}[r["fits"]]
        lines.append(f"{r['strategy']:<20} {gb(r['params_bytes']):>8} {gb(r['grads_bytes']):>7} "
                     f"{gb(r['optimizer_bytes']):>6} {gb(r['activations_bytes']):>7} {gb(r['buffers_bytes']):>8} "
                     f"{gb(r['total_bytes']):>7}  | {gb(r['cpu_bytes']) if r['cpu_bytes'] else '':>8}  {fits}")
    rec = result["recommendation"]
    lines += ["", f"recommendation: {rec['strategy'] or 'none'}: {rec['reason']}",
              "* activations are an estimate; params/grads/optimizer are exact counts "
              "(optimizer includes fp32 master weights). Formulas: docs/planner.md"]
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
    lines = [f"{result['summary']}: {result['strategy']}, world size {result['world_size']}, {result['precision']}, "
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
                 fp32_grads=args.fp32_grads, headroom=args.headroom, prefer=args.prefer,
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
