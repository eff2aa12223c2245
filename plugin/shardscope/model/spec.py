"""A model's config -> `ModelSpec`: the numbers the planner's formulas need, counted on the meta device.

Sources: a shipped name (`model_configs/NAME/config.json`, the models' published configs), a local folder,
a hub id, a `PretrainedConfig`, or a bare parameter count (`spec_from_count`, shapes assumed and listed).
No weight is ever loaded. A name or folder is counted once per config.json and library versions (`model/cache.py`).
"""
from __future__ import annotations

import difflib
import logging
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from . import cache
from ..errors import UsageError
from ..safe_io import load_json, read_bytes

MODEL_CONFIGS_DIR = Path(__file__).parents[1] / "model_configs"  # package data, beside data/
LORA_DEFAULT_TARGETS = ("q_proj", "v_proj")  # peft's default for Llama/Mistral


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
    # Mixture of experts: experts per layer, experts each token is routed to, and the parameters one token
    # uses (`params_total` less the unrouted experts' share); 0 for a dense model. Memory holds every expert.
    num_experts: int = 0
    experts_per_token: int = 0
    params_active: int = 0
    zero3_leaf_module: str = ""            # the MoE block class, when each expert is its own module
    tp_whole_expert_params: int = 0        # routed experts' parameters the TP plan keeps whole on every rank (gpt-oss)
    # The format the weights are published in when it is not the training one (gpt-oss: "mxfp4"); the counts are
    # the model's parameters as transformers builds them to train (dequantised), whatever the published format.
    published_quantization: str = ""

    @property
    def heads(self) -> tuple[int, int]:
        """(attention heads, KV heads): KV heads are the attention heads without grouped-query attention."""
        heads = self.num_heads or 1
        return heads, self.num_kv_heads or heads

    @property
    def untied_embedding_params(self) -> int:
        """The input embedding's parameters when it is its own tensor (not tied to the output head), else 0."""
        return self.vocab_size * self.hidden_size if self.vocab_size and not self.tied_embeddings else 0

    @property
    def active_without_input_embedding(self) -> int:
        """Active parameters less the input embedding's lookup table where it is its own tensor (OpenAI's convention
        for gpt-oss, "3.61B active"); `params_active` keeps it (Mistral's and Qwen's: "12.9B", "3.3B"). 0 if dense."""
        return self.params_active - self.untied_embedding_params if self.params_active else 0

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_shapes) if self.tensor_shapes else 9 * self.num_layers + 3


def resolve_model(model: str) -> str:
    """A shipped name (`llama-3-8b`, `qwen2.5-7b`: `shipped_models()`), a local folder, or a hub id."""
    shipped = MODEL_CONFIGS_DIR / model.lower()
    if "/" not in model and (shipped / "config.json").is_file():
        return str(shipped)
    return model


def shipped_models() -> list[str]:
    return sorted(p.parent.name for p in MODEL_CONFIGS_DIR.glob("*/config.json"))


def shipped_source(name: str) -> str:
    """The hub id a shipped config was published under (its `_name_or_path`)."""
    return str(load_json(MODEL_CONFIGS_DIR / name / "config.json", "model config").get("_name_or_path", ""))


def shipped_hint(model: str) -> str:
    """For an error line: the shipped names close to `model` (difflib), or where to find them all."""
    close = difflib.get_close_matches(model.lower(), shipped_models(), n=3, cutoff=0.6)
    listing = "shardscope plan --list-models lists the shipped names"
    return f" (close shipped names: {', '.join(close)}; {listing})" if close else f" ({listing})"


HUB_TIMEOUT_S = 5


def load_model_config(model: str, trust_remote_code: bool = False):
    """The transformers config of a shipped name, a local folder or a hub id; every failure is one
    `UsageError` line, within seconds whether or not HF_HUB_OFFLINE is set.

    Order: a shipped name or local folder, the local Hugging Face cache, then one hub request with a timeout
    (`HfApi.model_info`, no retries: huggingface_hub alone retries an unreachable hub for ~25 s) before the
    download. A repository's own code (`auto_map`) runs only with `trust_remote_code=True`, and transformers
    never stops to ask on a terminal."""
    path = resolve_model(model)
    shipped = shipped_hint(model)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise UsageError(f"model '{model}' is a folder without config.json")
        load_json(os.path.join(path, "config.json"), "model config")  # bounded first: size, UTF-8, nesting, NaN
        try:
            return _auto_config(model, path, trust_remote_code)
        except OSError as error:
            raise UsageError(f"model folder '{model}' has no usable config.json: {_first_line(error)}") from None
    if path.startswith((".", "/", "~")) or os.sep + os.sep in path or path.count("/") > 1 or not path.strip():
        raise UsageError(f"model folder '{model}' does not exist{shipped}")
    try:
        return _auto_config(model, path, trust_remote_code, local_files_only=True)  # the Hugging Face cache
    except OSError:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on"):
        raise UsageError(f"model '{model}' is not a local folder and the hub cannot be reached (HF_HUB_OFFLINE is "
                         f"set, and it is not in the Hugging Face cache){shipped}")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().model_info(path, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise UsageError(f"model '{model}' is gated on the hub: accept its licence there and log in "
                         "(hf auth login)") from None
    except RepositoryNotFoundError:
        raise UsageError(f"model '{model}' is not a local folder nor a model on the hub{shipped}") from None
    except Exception as error:  # no network, DNS, proxy, timeout, an invalid repo id
        raise UsageError(f"model '{model}' is not a local folder and the hub cannot be reached "
                         f"({type(error).__name__}: {_first_line(error)}){shipped}") from None
    try:
        return _auto_config(model, path, trust_remote_code)
    except OSError as error:
        raise UsageError(f"model '{model}' cannot be loaded from the hub: {_first_line(error)}") from None


def _auto_config(model: str, path: str, trust_remote_code: bool, **kwargs):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except ValueError as error:
        if "trust_remote_code" in str(error):
            raise UsageError(f"model '{model}' needs its own Python code to load (trust_remote_code); allow it "
                             "only for a model whose code you trust") from None
        raise UsageError(f"model '{model}': {_first_line(error)}") from None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def auto_class(config):
    """The transformers Auto class that builds `config`'s model with its training head (causal LM, image
    classifier), else the bare model's; None when transformers has none."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageClassification

    return next((auto for auto in (AutoModelForCausalLM, AutoModelForImageClassification, AutoModel)
                 if type(config) in auto._model_mapping), None)


def meta_model(config):
    """Build the model on the meta device (no memory for weights) with the matching Auto class."""
    import torch

    auto = auto_class(config)
    if auto is None:
        raise UsageError(f"model type '{config.model_type}' has no transformers model class to count")
    with torch.device("meta"):
        return auto.from_config(config)


def live_config(model) -> tuple:
    """(transformers config, {lora_rank, lora_targets} or {}) of a live model, wrapped by peft's LoRA or not."""
    peft = getattr(model, "peft_config", None)
    if not peft:
        return model.config, {}
    lora = next(iter(peft.values()))
    targets = lora.target_modules
    return model.get_base_model().config, {"lora_rank": int(lora.r), "lora_targets": (targets,) if isinstance(
        targets, str) else tuple(sorted(targets))}


def config_value(config, *names, default=0):
    """The first of `names` the config sets (families spell sizes differently), else `default`."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def attention_heads(config) -> tuple[int | None, int | None]:
    """A config's (attention heads, KV heads), KV heads defaulting to the attention heads; None where unset."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config_value(text, "num_attention_heads", "n_head", default=None)
    return heads, config_value(text, "num_key_value_heads", default=None) or heads


def spec_from_config(config, name: str | None = None) -> ModelSpec:
    """Count a config's parameters exactly by building the model on the meta device."""
    import torch

    model = meta_model(config)
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
    experts, per_token = config_value(text, "num_local_experts", "num_experts"), config_value(text, "num_experts_per_tok")
    moe = routed_experts(model) if experts and per_token else (0, "")
    quantization = getattr(config, "quantization_config", None) or {}
    vocab = config_value(text, "vocab_size")
    vision = not vocab and bool(config_value(config, "image_size"))
    return ModelSpec(
        name=name or getattr(config, "_name_or_path", "") or config.model_type,
        params_total=sum(p.numel() for p in params),
        num_layers=config_value(text, "num_hidden_layers", "n_layer", "num_layers"),
        hidden_size=config_value(text, "hidden_size", "n_embd", "d_model"),
        num_heads=config_value(text, "num_attention_heads", "n_head"),
        num_kv_heads=config_value(text, "num_key_value_heads", "num_attention_heads"),
        intermediate_size=config_value(text, "intermediate_size"),
        vocab_size=vocab,
        tied_embeddings=bool(config_value(text, "tie_word_embeddings", default=False)),
        largest_layer_params=largest,
        unit_numels=tuple(u for u in units if u),
        tensor_shapes=tuple((p.shape[0], p.numel() // p.shape[0]) if p.dim() else (1, 1) for p in params),
        linear_shapes=tuple((n, i, o, c) for (n, i, o), c in linears.items()),
        kind="vision" if vision else "text",
        image_size=config_value(config, "image_size") if vision else 0,
        patch_size=config_value(config, "patch_size") if vision else 0,
        extra_tokens=(1 + config_value(config, "num_register_tokens")) if vision else 0,
        num_labels=config_value(config, "num_labels") if vision else 0,
        tp_layout=tp_layout or (), tp_plan=tp_layout is not None, tp_note=tp_note,
        num_experts=experts if moe[0] else 0, experts_per_token=per_token if moe[0] else 0,
        params_active=sum(p.numel() for p in params) - moe[0] // experts * (experts - per_token) if moe[0] else 0,
        zero3_leaf_module=moe[1],
        tp_whole_expert_params=_tp_whole_experts(model, params, tp_layout) if moe[0] and tp_layout else 0,
        published_quantization=str(quantization.get("quant_method", "") if isinstance(quantization, dict) else
                                   getattr(quantization, "quant_method", "")),
    )


def _tp_whole_experts(model, params, tp_layout) -> int:
    """The routed experts' parameters (modules named `experts`) that the TP layout keeps whole (dim -1)."""
    experts = {id(p) for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == "experts"
               for p in module.parameters()}
    return sum(p.numel() for p, (_, dim, _) in zip(params, tp_layout) if id(p) in experts and dim == -1)


def routed_experts(model) -> tuple[int, str]:
    """(parameters of the routed experts, the MoE block's class when each expert is its own module, else "").
    The experts are the modules named `experts` (transformers' MoE families; a shared expert is always used)."""
    import torch

    total, leaf = 0, ""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        total += sum(p.numel() for p in module.parameters())
        if isinstance(module, torch.nn.ModuleList):  # one module per expert: ZeRO-3 fetches only those called
            leaf = type(model.get_submodule(name.rpartition(".")[0])).__name__
    return total, leaf


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
    # transformers warns (on stderr) that the dense-MLP rules of an MoE model's plan "match nothing in" it: the
    # layout below says what the plan splits, so the count stays quiet
    log, quiet = logging.getLogger("transformers.distributed.mixin"), lambda r: "match nothing in" not in r.getMessage()
    log.addFilter(quiet)
    try:
        plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=2))
    except (ValueError, AttributeError) as error:
        return None, f"transformers cannot resolve a tensor-parallel plan: {str(error).splitlines()[0]}"
    finally:
        log.removeFilter(quiet)
    names: dict = {}
    for name, param in model.named_parameters(remove_duplicate=False):  # tied weights: every name, the first first
        names.setdefault(id(param), []).append(name)
    layout, unknown = [], set()
    for param in params:
        name, *tied = names[id(param)]
        style = ALL_PARALLEL_STYLES[plan[name]] if name in plan else None
        dim = -1 if style is None else _tp_style_dim(style, name.rsplit(".", 1)[-1], param.dim())
        if dim is None:
            unknown.add(plan[name])
            dim = -1
        # embedding_rowwise runs DTensor's embedding op (vocab-sharded weight, replicated ids): its weight
        # gradient comes back Replicate, the whole (V, h) on every TP rank (measured: torch 2.13,
        # transformers 5.23; `plan --dry-run` runs a backward to see it). Under FSDP2 the reduce-scatter
        # leaves each rank its shard instead. Tied to a colwise head (tie_word_embeddings), the head's Shard(0)
        # gradient is added in and the sum stays a shard (the dry run's backward, transformers 5.24).
        grad_whole = dim == 0 and type(style).__name__ == "EmbeddingParallel" and not any(
            t in plan and type(ALL_PARALLEL_STYLES[plan[t]]).__name__ != "EmbeddingParallel" for t in tied)
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
        return _named_spec(model)
    return spec_from_config(model)


def _named_spec(model: str) -> ModelSpec:
    """`spec_from_config` of a name or folder, from `model/cache.py` when this config.json was counted before
    under the same library versions (then neither torch nor transformers is imported)."""
    config = config_bytes(model)
    key = cache.cache_key(config, "model/spec.py", "spec") if config is not None else None
    cached = cache.load(key) if key else None
    if isinstance(cached, dict) and tuple(cached) == tuple(f.name for f in fields(ModelSpec)):
        return ModelSpec(**{name: _tuples(value) for name, value in cached.items()} | {"name": model})
    spec = spec_from_config(load_model_config(model), name=model)
    if key:
        cache.store(key, asdict(spec))
    return spec


def config_bytes(model: str) -> bytes | None:
    """The config.json bytes of a shipped name or local folder (None: a hub id, or a file `load_model_config`
    will explain)."""
    try:
        return read_bytes(os.path.join(resolve_model(model), "config.json"))
    except UsageError:
        return None


def _tuples(value):
    """JSON's lists back to the tuples a `ModelSpec` holds."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
