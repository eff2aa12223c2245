"""Tiny random-initialised models, a byte-level tokenizer and small data, built offline.

Used by `make demo` and the tests: every artefact goes through the same loading code a user's
hub model or dataset does (`from_pretrained`, `AutoTokenizer`, `datasets` JSON loading).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

TINY_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def make_tokenizer(out_dir: str | Path, texts: list[str], vocab_size: int = 512):
    """Train a byte-level BPE on `texts` and save it as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out_dir)
    return fast


def make_causal_lm(out_dir: str | Path, family: str = "llama", vocab_size: int = 512, seed: int = 0, **sizes):
    """Save a tiny random Llama or Mistral (hidden 64, 2 layers unless `sizes` says otherwise)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    config_cls = {"llama": LlamaConfig, "mistral": MistralConfig}[family]
    config = config_cls(vocab_size=vocab_size, max_position_embeddings=512, **{**TINY_SIZES, **sizes})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir)
    return model


def make_alpaca_json(path: str | Path, n: int = 64, seed: int = 0) -> Path:
    """Write `n` Alpaca-format records of a learnable task (echo and reverse short words)."""
    rng = random.Random(seed)
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "bird", "rock", "star"]
    records = []
    for i in range(n):
        picked = rng.sample(words, 3)
        if i % 2:
            records.append({"instruction": "Repeat the words.", "input": " ".join(picked), "output": " ".join(picked)})
        else:
            records.append({"instruction": "Reverse the words.", "input": " ".join(picked),
                            "output": " ".join(reversed(picked))})
    path = Path(path)
    path.write_text(json.dumps(records, indent=1))
    return path
