"""A dataset's real lengths, and the micro-batches each way of batching makes of them (`plan --dataset`, `fit --dataset`).

Reading: the file (jsonl, json, parquet, csv, arrow, or a `save_to_disk` folder) is streamed through `datasets` in
batches of `READ_BATCH` rows, tokenised a batch at a time (a fast tokenizer encodes a batch on every core, so no
process pool is added), and only a histogram of lengths is kept: memory grows with the longest sample, not with the
rows. Text is read the way the recipe reads it (`sample_lengths`): the Alpaca prompt and response (the prompt format
is defined here and used by recipes/data.py), one text column (`--text-field`), or chat `messages` through the
tokenizer's chat template. An Alpaca example whose response is cut off entirely by `--max-length` is dropped, as the
recipe drops it.

Batching (`MODES`), each as a micro-batch of b rows the model sees:
- `pad_longest`: padded to the longest sample of the micro-batch (the Trainer's default collator, the recipe's);
  worst micro-batch b x the longest (truncated) sample, with an attention mask; waste expected over a random order;
- `group_by_length`: the same collator, rows of similar length together (the Trainer's `group_by_length`): the same
  worst micro-batch, less waste (its floor: micro-batches of consecutive lengths in sorted order);
- `pad_fixed`: every row padded to `--max-length` (`padding="max_length"`);
- `packing`: the recipe's block packing: all examples concatenated and cut into `--max-length` blocks (the remainder
  dropped); no padding, but attention crosses example boundaries inside a block;
- `padding_free`: `DataCollatorWithFlattening` / TRL's `padding_free`: the b rows concatenated into one row, kept
  apart by position ids (a block-diagonal mask); no padding, the tokens vary per micro-batch: the worst is the b
  longest samples together.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

READ_BATCH = 1000  # rows tokenised per call
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
MODES = ("pad_longest", "group_by_length", "pad_fixed", "packing", "padding_free")
PERCENTILES = (50, 90, 99)

# The Stanford Alpaca prompt (recipes/data.py formats and tokenises with these)
PROMPT_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n"
                     "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
ALPACA_REQUIRED = ("instruction", "output")  # `input` is optional (empty when absent)


def format_prompt(record: dict) -> str:
    """The Stanford Alpaca prompt (with or without the `input` block); the response follows it."""
    if record.get("input"):
        return PROMPT_WITH_INPUT.format(instruction=record["instruction"], input=record["input"])
    return PROMPT_NO_INPUT.format(instruction=record["instruction"])


def special_ids(tokenizer) -> tuple[list, list]:
    """The BOS and EOS the recipe puts around each example (none where the tokenizer has none)."""
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else [],
            [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


@dataclass
class Lengths:
    """A histogram of sample lengths in tokens as read (before `--max-length`), and what was dropped."""

    counts: dict            # length -> samples of that length
    dropped: int = 0        # Alpaca examples whose response --max-length cuts off entirely (the recipe drops them)
    rows: int = 0           # rows read
    sampled: bool = False   # `--sample N` read only the first N rows

    def sorted_items(self) -> list[tuple[int, int]]:
        return sorted(self.counts.items())

    @property
    def samples(self) -> int:
        return sum(self.counts.values())


def open_rows(path: str):
    """The file or `save_to_disk` folder as an iterable of row batches (dicts of columns), streamed."""
    import datasets

    p = Path(path)
    if p.is_dir():
        if not (p / "dataset_info.json").is_file() and not (p / "state.json").is_file():
            raise UsageError(f"--dataset {path}: a folder must be written by datasets' save_to_disk (no state.json)")
        try:
            data = datasets.load_from_disk(str(p))
        except Exception as error:
            raise UsageError(f"--dataset {path}: {type(error).__name__}: {_first_line(error)}") from None
        if isinstance(data, datasets.DatasetDict):
            data = data["train"] if "train" in data else next(iter(data.values()))
        return data.to_iterable_dataset()
    if not p.is_file():
        raise UsageError(f"--dataset {path}: no such file or folder")
    builder = FORMATS.get(p.suffix.lower())
    if builder is None:
        raise UsageError(f"--dataset {path}: unknown format '{p.suffix}' (one of {', '.join(FORMATS)}, or a "
                         "save_to_disk folder)")
    try:
        return datasets.load_dataset(builder, data_files=str(p), split="train", streaming=True)
    except Exception as error:
        raise UsageError(f"--dataset {path}: {type(error).__name__}: {_first_line(error)}") from None


def _first_line(error) -> str:
    return str(error).splitlines()[0][:200] if str(error) else ""


def token_counts(tokenizer, texts: list[str], special: bool) -> list[int]:
    """Each text's token count: a fast tokenizer's backend encodes the batch on every core and is asked lengths only
    (no Python list of ids is built); another tokenizer through its own call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # (encode_batch_fast: tokenizers >= 0.20, no character offsets kept)
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [len(e) for e in encode(texts, add_special_tokens=special)]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=special)["input_ids"]]


def batch_lengths(batch: dict, tokenizer, text_field: str | None, max_length: int) -> tuple[list[int], int]:
    """(lengths of the kept samples, as read; samples dropped) of one batch of rows, tokenised as the recipe does:
    `text_field` (ids with the tokenizer's special tokens, then EOS), chat `messages` (the chat template), or Alpaca
    (BOS + prompt + response + EOS, the prompt and the response tokenised apart)."""
    if text_field is not None:
        ids = tokenizer([str(t) for t in batch[text_field]])["input_ids"]  # (the last id decides on the EOS)
        _, eos = special_ids(tokenizer)
        return [len(i) + (len(eos) if eos and (not i or i[-1] != eos[0]) else 0) for i in ids], 0
    if "messages" in batch:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError("the dataset has chat 'messages' but the tokenizer has no chat template (--tokenizer)")
        return [len(tokenizer.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"])
                for m in batch["messages"]], 0
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    prompts = token_counts(tokenizer, [format_prompt(r) for r in rows], special=False)
    responses = token_counts(tokenizer, [str(r["output"]) for r in rows], special=False)
    bos, eos = special_ids(tokenizer)
    kept, dropped = [], 0
    for prompt, response in zip(prompts, responses):
        if len(bos) + prompt >= max_length:  # no response token left: the recipe drops the example
            dropped += 1
        else:
            kept.append(len(bos) + prompt + response + len(eos))
    return kept, dropped


def read_lengths(path: str, tokenizer, max_length: int, text_field: str | None = None, sample: int | None = None,
                 progress=sys.stderr) -> Lengths:
    """`Lengths` of the dataset at `path` (see the module docstring); `sample`: the first N rows only. A progress line
    goes to `progress` every few seconds of a long read."""
    rows = open_rows(path)
    columns = _columns(rows, text_field)
    lengths, started, shown = Lengths({}, sampled=sample is not None), time.monotonic(), time.monotonic()
    for batch in rows.iter(batch_size=READ_BATCH):
        if sample is not None and lengths.rows >= sample:
            break
        if sample is not None and lengths.rows + len(next(iter(batch.values()))) > sample:
            batch = {k: v[:sample - lengths.rows] for k, v in batch.items()}
        kept, dropped = batch_lengths({k: batch[k] for k in columns}, tokenizer, text_field, max_length)
        for n in kept:
            lengths.counts[n] = lengths.counts.get(n, 0) + 1
        lengths.dropped += dropped
        lengths.rows += len(kept) + dropped
        if progress is not None and time.monotonic() - shown > 5:
            shown = time.monotonic()
            print(f"shardscope: reading {path}: {lengths.rows:,} rows, {shown - started:.0f} s", file=progress)
    if not lengths.counts:
        raise UsageError(f"--dataset {path}: no samples to train on" + (
            f" ({lengths.dropped} dropped: no response token within --max-length {max_length})" if lengths.dropped else ""))
    return lengths


def _columns(rows, text_field: str | None) -> tuple[str, ...]:
    """The columns the recipe reads, checked against the file's."""
    names = list(rows.column_names or next(iter(rows.iter(batch_size=1))).keys())
    wanted = (text_field,) if text_field else ("messages",) if "messages" in names else (*ALPACA_REQUIRED, "input")
    missing = [c for c in wanted if c not in names and c != "input"]
    if missing:
        expected = f"--text-field {text_field}" if text_field else "Alpaca's instruction/output, or chat messages"
        raise UsageError(f"--dataset: no column {', '.join(repr(c) for c in missing)} (columns: {', '.join(names)}; "
                         f"expected {expected})")
    return tuple(c for c in wanted if c in names)


def load_tokenizer(path: str):
    """The tokenizer of a local folder (`--tokenizer`, default the model's folder)."""
    if not path or not os.path.isdir(path):
        raise UsageError(f"--tokenizer {path}: not a local folder (give --tokenizer DIR; a shipped model name has no "
                         "tokenizer files)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:
        raise UsageError(f"--tokenizer {path}: {type(error).__name__}: {_first_line(error)}") from None
