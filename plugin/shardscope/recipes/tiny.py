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
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out_dir)
    return fast


def make_causal_lm(out_dir: str | Path, family: str = "llama", vocab_size: int = 512, seed: int = 0, **sizes):
    """Save a tiny random Llama, Mistral or Qwen3-MoE (hidden 64, 2 layers unless `sizes` says otherwise; the MoE:
    8 experts of width 32, 2 per token)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen3MoeConfig

    config_cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen3_moe": Qwen3MoeConfig}[family]
    if family in ("mistral", "qwen3_moe"):  # their configs default to 8 KV heads, more than our 4 query heads
        sizes.setdefault("num_key_value_heads", 2)
    if family == "qwen3_moe":
        sizes = {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, **sizes}
    config = config_cls(vocab_size=vocab_size, **{"max_position_embeddings": 512, **TINY_SIZES, **sizes})
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


def make_long_tail_json(path: str | Path, n: int = 64, seed: int = 0, longest: int = 360,
                        at_longest: float = 0.0) -> Path:
    """Write `n` Alpaca-format records whose responses have a long tail of lengths (a Pareto draw: most of a few dozen
    words, a few several times the median, capped at `longest` words; a share `at_longest` of them drawn at the cap),
    as jsonl."""
    rng = random.Random(seed)
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "bird", "rock", "star"]
    lines = []
    for _ in range(n):
        count = longest if rng.random() < at_longest else min(longest, int(12 * rng.paretovariate(1.3)))
        picked = [rng.choice(words) for _ in range(count)]
        lines.append(json.dumps({"instruction": "Repeat the words.", "input": " ".join(picked[:3]),
                                 "output": " ".join(picked)}))
    path = Path(path)
    path.write_text("\n".join(lines) + "\n")
    return path


def make_sft_assets(root: str | Path, family: str = "llama", n: int = 256, seed: int = 0, **sizes) -> dict:
    """Alpaca JSON + a byte-level tokenizer trained on its prompts + a tiny random causal LM, under `root`.

    Returns the paths: {"data": root/alpaca.json, "model": root/tiny-<family>}; the model folder holds the
    tokenizer too, as a hub checkpoint does.
    """
    from ..plan.dataset import format_prompt

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    data = make_alpaca_json(root / "alpaca.json", n=n, seed=seed)
    records = json.loads(data.read_text())
    model_dir = root / f"tiny-{family}"
    tokenizer = make_tokenizer(model_dir, [format_prompt(r) + r["output"] for r in records])
    make_causal_lm(model_dir, family, vocab_size=len(tokenizer), seed=seed, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **sizes)
    return {"data": data, "model": model_dir}


DINO_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  image_size=32, patch_size=8)


def make_dinov2(out_dir: str | Path, num_labels: int = 2, seed: int = 0, **sizes):
    """Save a tiny random `Dinov2ForImageClassification` and a 32x32 `BitImageProcessor` (DINOv2's) in `out_dir`."""
    import torch
    import transformers
    from transformers import Dinov2Config, Dinov2ForImageClassification

    # the PIL flavour needs no torchvision (and saves the same BitImageProcessor file); older transformers lack it
    processor = getattr(transformers, "BitImageProcessorPil", None) or transformers.BitImageProcessor

    config = Dinov2Config(num_labels=num_labels, **{**DINO_SIZES, **sizes})
    torch.manual_seed(seed)
    model = Dinov2ForImageClassification(config)
    model.save_pretrained(out_dir)
    side = config.image_size
    processor(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
              do_convert_rgb=True, image_mean=[0.485, 0.456, 0.406],
              image_std=[0.229, 0.224, 0.225]).save_pretrained(out_dir)
    return model


COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}


def make_image_folder(root: str | Path, per_class: int = 24, eval_per_class: int = 8, size: int = 40,
                      seed: int = 0, classes: tuple[str, ...] = tuple(COLOURS)) -> Path:
    """Write a Food-101-style imagefolder `root/{train,validation}/<class>/*.png`: class = dominant colour.

    Each image is noise tinted towards its class colour with a random rectangle of another colour, so
    the task is learnable but not trivial for a random network.
    """
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    root = Path(root)
    for split, count in (("train", per_class), ("validation", eval_per_class)):
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                base = np.array(COLOURS[name], dtype=np.float32)
                pixels = 0.7 * base + 0.3 * rng.uniform(0, 255, (size, size, 3))
                other = np.array(COLOURS[classes[rng.integers(len(classes))]], dtype=np.float32)
                x, y = rng.integers(0, size // 2, 2)
                pixels[y:y + size // 3, x:x + size // 3] = other
                Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / f"{name}_{i}.png")
    return root


def _main(argv=None) -> None:
    """`python -m shardscope.recipes.tiny sft|image ROOT`: build the demo/test assets (used by scripts/demo.sh)."""
    import argparse

    from transformers.utils import logging as hf_logging

    from ..notices import quiet_library_notices

    quiet_library_notices()  # the output is the two paths below, not the libraries' notices and progress bars
    hf_logging.disable_progress_bar()
    parser = argparse.ArgumentParser(prog="python -m shardscope.recipes.tiny", description=_main.__doc__)
    parser.add_argument("kind", choices=["sft", "image"])
    parser.add_argument("root")
    parser.add_argument("--family", default="llama", choices=["llama", "mistral"])
    parser.add_argument("-n", type=int, default=256, help="number of Alpaca records (sft)")
    parser.add_argument("--hidden_size", type=int, help="sft model width (default 64)")
    parser.add_argument("--intermediate_size", type=int, help="sft model MLP width (default 128)")
    args = parser.parse_args(argv)
    if args.kind == "sft":
        sizes = {k: getattr(args, k) for k in ("hidden_size", "intermediate_size") if getattr(args, k)}
        paths = make_sft_assets(args.root, args.family, n=args.n, **sizes)
    else:
        paths = {"data": make_image_folder(Path(args.root) / "images"), "model": Path(args.root) / "tiny-dinov2"}
        make_dinov2(paths["model"], num_labels=len(COLOURS))
    for key, path in paths.items():
        print(f"{key}: {path}")


if __name__ == "__main__":
    _main()
