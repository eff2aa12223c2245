"""A shadow of a large model: its architecture class and structure at a size a CPU checks in seconds
(`shardscope parity --shadow-of`), random-initialised and saved with `save_pretrained`.

Kept: the model type and class, the attention kind (sliding windows, the layer-type pattern), the GQA ratio
(attention heads per key/value head), tied embeddings, the norms and activation, the MoE top-k. Shrunk (SHRINK):
layers, width (head dimension and key/value heads, so heads and hidden size follow from the kept ratio), the MLP
width in proportion to the hidden size, experts, vocabulary.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import UsageError

# the shrink rule: the largest each dimension may stay
SHRINK = {"layers": 2, "head_dim": 16, "kv_heads": 2, "experts": 4, "vocab": 512}
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "top_k")
MLP_KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def shrink(config) -> str:
    """Shrink a transformers config in place (module docstring); returns the rule as applied, in words."""
    said, kept = [], []
    layers = config.num_hidden_layers
    config.num_hidden_layers = min(layers, SHRINK["layers"])
    said.append(f"layers {layers} -> {config.num_hidden_layers}")
    if isinstance(getattr(config, "layer_types", None), list):  # the pattern's first layers kept
        config.layer_types = config.layer_types[:config.num_hidden_layers]
    heads, hidden = config.num_attention_heads, config.hidden_size
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv:
        raise UsageError(f"--shadow-of: {heads} attention heads are not a multiple of {kv} key/value heads")
    group = heads // kv
    new_kv = min(kv, SHRINK["kv_heads"])
    config.num_attention_heads, config.num_key_value_heads = new_kv * group, new_kv
    config.hidden_size = config.num_attention_heads * SHRINK["head_dim"]
    if getattr(config, "head_dim", None):
        config.head_dim = SHRINK["head_dim"]
    said.append(f"hidden {hidden} -> {config.hidden_size} (heads {heads} -> {config.num_attention_heads}, key/value "
                f"heads {kv} -> {new_kv}, head dim {SHRINK['head_dim']})")
    kept.append(f"GQA ratio {group}")
    for key in MLP_KEYS:
        if getattr(config, key, None):
            old = getattr(config, key)
            setattr(config, key, max(8, 8 * round(old * config.hidden_size / hidden / 8)))
            said.append(f"{key} {old} -> {getattr(config, key)} (its ratio to hidden kept)")
    said += _shrink_experts(config, kept)
    vocab = config.vocab_size
    config.vocab_size = min(vocab, SHRINK["vocab"])
    said.append(f"vocab {vocab} -> {config.vocab_size}")
    for key in TOKEN_KEYS:  # special tokens inside the smaller vocabulary
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= config.vocab_size:
            setattr(config, key, config.vocab_size - 1)
    kept.append(f"tied embeddings {bool(getattr(config, 'tie_word_embeddings', False))}")
    window = getattr(config, "sliding_window", None)
    kept.append(f"attention {'sliding window ' + str(window) if window else 'full'}")
    return f"{config.model_type}: " + "; ".join(said) + "; kept: " + ", ".join(kept) + ", norms, activation"


def _shrink_experts(config, kept: list) -> list[str]:
    said = []
    for key in EXPERT_KEYS:
        experts = getattr(config, key, None)
        if isinstance(experts, int) and experts > 0:
            top_k = next((getattr(config, k) for k in TOP_K_KEYS if isinstance(getattr(config, k, None), int)), 1)
            new = min(experts, max(SHRINK["experts"], top_k))
            setattr(config, key, new)
            said.append(f"experts {experts} -> {new}")
            kept.append(f"top-{top_k} routing")
            break  # (transformers names one count by several keys)
    return said


def build_shadow(model: str, folder: Path) -> tuple[Path, str]:
    """The shadow of `model` (a shipped name or a config folder) saved into `folder`; (folder, the rule applied)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..model.spec import load_model_config

    config = load_model_config(model)
    if not all(hasattr(config, k) for k in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")):
        raise UsageError(f"--shadow-of {model}: not a decoder language model this can shrink ({config.model_type})")
    rule = shrink(config)
    torch.manual_seed(0)
    built = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = Path(folder)
    built.save_pretrained(folder)
    params = sum(p.numel() for p in built.parameters())
    return folder, f"{rule} ({params / 1e6:.2f}M parameters, torch.manual_seed(0))"

