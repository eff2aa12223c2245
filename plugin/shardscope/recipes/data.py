"""A recipe's training data: loaded, checked for the columns it needs and turned into model inputs.

- Causal LM SFT: Alpaca prompt format (or one text column), tokenisation with prompt tokens masked (-100), packing,
  padding-free batching.
- Image classification: a hub dataset or a local imagefolder, checked for classes; transform, collate
  and the accuracy metric.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import UsageError
from ..plan.dataset import format_prompt, special_ids

IGNORE_INDEX = -100


# --- Causal LM SFT data (the Alpaca prompt: plan/dataset.py, which `plan --dataset` reads lengths with) ----------


def load_dataset_checked(name: str, split: str, required: tuple[str, ...], config_name: str | None = None):
    """Load a hub dataset or a local .json/.jsonl file, and check that `required` columns exist."""
    import datasets

    local = Path(name).suffix in (".json", ".jsonl")
    if local and not Path(name).is_file():
        raise UsageError(f"dataset '{name}': no such file")
    try:
        if local:
            dataset = datasets.load_dataset("json", data_files={split: name}, split=split)
        else:
            dataset = datasets.load_dataset(name, config_name, split=split)
    except Exception as error:  # datasets raises many types; the first line says what went wrong
        raise UsageError(f"dataset '{name}' (split '{split}') could not be loaded: "
                         f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from error
    missing = [c for c in required if c not in dataset.column_names]
    if missing:
        raise UsageError(f"dataset '{name}' has no column(s) {', '.join(repr(c) for c in missing)} "
                         f"(columns: {', '.join(dataset.column_names)}; expected {', '.join(required)})")
    return dataset


def tokenize_sft(record: dict, tokenizer, max_length: int) -> dict:
    """Token ids for prompt + response + EOS; labels are -100 on the prompt (and BOS) so only the response trains.

    Prompt and response are tokenised separately so the boundary is exact (no BPE merge across it).
    """
    prompt_ids = tokenizer(format_prompt(record), add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(str(record["output"]), add_special_tokens=False)["input_ids"]
    bos, eos = special_ids(tokenizer)
    input_ids = (bos + prompt_ids + response_ids + eos)[:max_length]
    n_masked = min(len(bos) + len(prompt_ids), len(input_ids))
    labels = [IGNORE_INDEX] * n_masked + input_ids[n_masked:]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def tokenize_text(record: dict, tokenizer, max_length: int, text_field: str) -> dict:
    """Token ids of one text column (the tokenizer's special tokens, then EOS unless it ends so); every token trains."""
    ids = tokenizer(str(record[text_field]))["input_ids"]
    _, eos = special_ids(tokenizer)
    if eos and (not ids or ids[-1] != eos[0]):
        ids = ids + eos
    ids = ids[:max_length]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": list(ids)}


def pack(batch: dict, block_size: int) -> dict:
    """Concatenate tokenised examples and cut them into `block_size` blocks (the remainder is dropped).

    Use with `dataset.map(pack, batched=True)`; labels keep their -100 prompt masks. Attention crosses
    example boundaries inside a block (the usual cheap packing).
    """
    out = {}
    for key in ("input_ids", "attention_mask", "labels"):
        flat = [token for example in batch[key] for token in example]
        n = len(flat) // block_size * block_size
        out[key] = [flat[i:i + block_size] for i in range(0, n, block_size)]
    return out


def prepare_sft_dataset(raw, tokenizer, max_length: int, packing: bool, text_field: str | None = None):
    """Tokenise (masking prompts; `text_field`: one text column, all of it trained), drop examples with no response
    token left, optionally pack. `plan --dataset` reads lengths the same way (plan/dataset.py)."""
    if text_field is not None:
        dataset = raw.map(tokenize_text, fn_kwargs=dict(tokenizer=tokenizer, max_length=max_length,
                                                        text_field=text_field),
                          remove_columns=raw.column_names, desc="tokenising")
    else:
        dataset = raw.map(tokenize_sft, fn_kwargs=dict(tokenizer=tokenizer, max_length=max_length),
                          remove_columns=raw.column_names, desc="tokenising")
    dataset = dataset.filter(lambda ex: any(label != IGNORE_INDEX for label in ex["labels"]), desc="dropping "
                             "prompts longer than max_seq_length")
    if packing:
        dataset = dataset.map(pack, batched=True, fn_kwargs=dict(block_size=max_length), desc="packing")
    if len(dataset) == 0:
        raise UsageError(f"no training examples left after tokenising to max_seq_length={max_length}")
    return dataset


# --- Image classification data -----------------------------------------------------------------------


def load_image_dataset(name: str, train_split: str, eval_split: str | None, eval_fraction: float, seed: int):
    """Return (train, eval, class_names) from a hub dataset or a local imagefolder (`<dir>/[split/]<class>/*.jpg`).

    Without an eval split, `eval_fraction` of train is held out.
    """
    import datasets

    local = os.path.isdir(name)
    if not local and (name.startswith((".", "/", "~")) or name.count("/") > 1):  # a path, not a hub name
        raise UsageError(f"dataset '{name}': no such folder")
    try:
        data = datasets.load_dataset("imagefolder", data_dir=name) if local else datasets.load_dataset(name)
    except Exception as error:
        hint = " (expected <dir>/<class>/<image> or <dir>/<split>/<class>/<image>)" if local else ""
        raise UsageError(f"dataset '{name}' could not be loaded{hint}: {type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}") from error
    if train_split not in data:
        raise UsageError(f"dataset '{name}' has no split '{train_split}' (splits: {', '.join(data)})")
    train = data[train_split]
    label = train.features.get("label")
    if "image" not in train.column_names or not isinstance(label, datasets.ClassLabel) or label.num_classes < 2:
        where = f"image folder '{name}'" if local else f"dataset '{name}'"
        raise UsageError(f"{where} has no classes: expected an 'image' column and a 'label' class column with "
                         f"at least 2 classes (an imagefolder needs one sub-folder per class); "
                         f"columns: {', '.join(train.column_names)}")
    if eval_split and eval_split in data:
        evaluation = data[eval_split]
    else:
        parts = train.train_test_split(test_size=eval_fraction, seed=seed, stratify_by_column="label")
        train, evaluation = parts["train"], parts["test"]
    return train, evaluation, label.names


def image_transform(processor, train: bool):
    """`set_transform` function: PIL images -> processor pixel values (random horizontal flip when training)."""
    import torch
    from PIL import ImageOps

    def transform(batch):
        images = [image.convert("RGB") for image in batch["image"]]
        if train:
            images = [ImageOps.mirror(im) if torch.rand(()) < 0.5 else im for im in images]
        return {"pixel_values": processor(images, return_tensors="pt")["pixel_values"], "labels": batch["label"]}

    return transform


def collate_images(examples):
    import torch

    return {"pixel_values": torch.stack([e["pixel_values"] for e in examples]),
            "labels": torch.tensor([e["labels"] for e in examples])}


def accuracy(eval_pred) -> dict:
    import numpy as np

    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}
