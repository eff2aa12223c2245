"""`shardscope export CHECKPOINT OUT_DIR`: a sharded ZeRO-1/2/3 or FSDP checkpoint -> a normal model folder,
written shard by shard in bounded host memory.

The model is built from its config on the meta device (no weights), which names the tensors to write and
their shapes; tied weights are dropped as `save_pretrained` drops them. The tensors are then split into
`model-0000k-of-0000n.safetensors` shards of at most `--max-shard-size` (huggingface_hub's
`split_torch_state_dict_into_shards`, as `save_pretrained` splits; one shard is `model.safetensors`) plus
`model.safetensors.index.json`, and each shard is read from the checkpoint (`sources`), written and freed
before the next: peak host memory is the process's baseline plus one shard plus the largest tensor (ZeRO:
the mapped checkpoint pages, `sources.ZeroSource.read`; DCP: up to twice the largest tensor, torch's reader
holding a chunk's bytes beside its tensor); measured in benchmarks/export_memory.py. A tensor larger than
the shard size gets a shard of its own. ZeRO gives the fp32 master weights; DCP the dtype it saved.
LoRA runs write the adapter (`adapter_model.safetensors`, small), loadable with
`PeftModel.from_pretrained(base, OUT_DIR)`.

Accepted checkpoints: a Trainer `checkpoint-N` folder, a Trainer output folder (its newest `checkpoint-N`),
a ZeRO `global_stepN` folder, or a DCP folder. Everything is written to a temporary folder beside OUT_DIR
and renamed into place at the end: an error leaves nothing behind, and an existing OUT_DIR is refused.
What is unpickled, and how: `sources`' docstring.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path

from ..errors import UsageError
from ..safe_io import ordinary_permissions
from ..units import gb, parse_size
from .sources import open_source

DEFAULT_MAX_SHARD_SIZE = "5GB"
MEMORY_BOUND = ("peak host memory is the process's baseline plus one shard (--max-shard-size, or the largest tensor "
                "where that is bigger) plus the largest tensor (ZeRO: the checkpoint pages mapped at once; DCP: "
                "torch's reader holds a saved chunk's bytes and its tensor, so up to twice the largest tensor)")
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt", "chat_template.jinja", "preprocessor_config.json")


def _first_with(name: str, *folders: Path | None) -> Path | None:
    for folder in folders:
        if folder is not None and (folder / name).is_file():
            return folder
    return None


def model_from_config(source: str):
    """The model class named by the config's `architectures`, built on the meta device."""
    import torch
    import transformers

    from ..model_spec import load_model_config

    config = load_model_config(source)
    cls = next((getattr(transformers, a) for a in (config.architectures or []) if hasattr(transformers, a)), None)
    with torch.device("meta"):
        if cls is not None:
            return cls(config)
    from ..model_spec import meta_model

    return meta_model(config)


def _names(names, limit: int = 5) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")


def tensors_to_write(model, shapes: dict, what: str) -> dict:
    """name -> meta tensor (the checkpoint's shape and dtype) of every tensor `save_pretrained` would write,
    after checking the checkpoint holds exactly the model's tensors."""
    import torch
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    if hasattr(model, "tie_weights"):
        model.tie_weights()
    state = model.state_dict()
    unexpected = set(shapes) - set(state)
    if unexpected:
        raise UsageError(f"the checkpoint has weights {what} does not: {_names(unexpected)} (wrong --model?)")
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    missing = set(kept) - set(shapes)
    if missing:
        raise UsageError(f"the checkpoint lacks weights of {what}: {_names(missing)}")
    wrong = [n for n in kept if tuple(shapes[n][0]) != tuple(state[n].shape)]
    if wrong:
        raise UsageError(f"the checkpoint's shapes differ from {what}'s: " + ", ".join(
            f"{n} {tuple(shapes[n][0])} vs {tuple(state[n].shape)}" for n in wrong[:3]))
    return {n: torch.empty(shapes[n][0], dtype=shapes[n][1], device="meta") for n in kept}


def give_back_freed_memory() -> None:
    """glibc keeps freed heap blocks (tensors below its mmap threshold) inside the process, fragmented: return
    them to the system between shards so the next shard does not stack on them (a no-op without glibc)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def write_shards(source, meta: dict, out: Path, max_shard_size: int) -> tuple[int, int]:
    """Write `meta`'s tensors from `source` as safetensors shards plus the index, one shard in memory at a
    time; returns (shards, largest shard's bytes)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    largest = 0
    for filename, names in split.filename_to_tensors.items():
        tensors = source.read(names)
        largest = max(largest, sum(t.nbytes for t in tensors.values()))
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
        del tensors
        give_back_freed_memory()
    if split.is_sharded:
        parameters = sum(t.numel() for t in meta.values())
        index = {"metadata": {"total_parameters": parameters, **split.metadata}, "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return len(split.filename_to_tensors), largest


def write_full_model(source, parents: list, out: Path, base: str | None, max_shard_size: int) -> str:
    config_source = base or (str(_first_with("config.json", *parents) or "") or None)
    if config_source is None:
        raise UsageError(f"no config.json in '{parents[0]}' or its parent folders; pass --model BASE "
                         "(the model the run started from)")
    model = model_from_config(config_source)
    meta = tensors_to_write(model, source.shapes, f"the model from '{config_source}'")
    dtype = next((t.dtype for t in meta.values() if t.is_floating_point()), None)
    if dtype is not None:  # what save_pretrained records: the dtype the weights are stored in
        model.config.dtype = str(dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(str(out))
    if model.can_generate():
        model.generation_config.save_pretrained(str(out))
    shards, largest = write_shards(source, meta, out, max_shard_size)
    count = sum(p.numel() for p in model.parameters())
    return (f"{type(model).__name__} ({count:,} parameters) in {shards} shard{'s' * (shards > 1)} "
            f"(largest {gb(largest)} GB)")


def write_adapter(source, parents: list, out: Path, base: str | None) -> str:
    """A LoRA run: only the adapter's tensors are read, and written with peft's save_pretrained."""
    adapter_dir = _first_with("adapter_config.json", *parents)
    if adapter_dir is None:
        raise UsageError(f"the checkpoint holds LoRA weights but no adapter_config.json is beside it "
                         f"({parents[0]}); copy the run's adapter_config.json there")
    from peft import LoraConfig, get_peft_model

    lora_config = LoraConfig.from_pretrained(str(adapter_dir))
    base = base or lora_config.base_model_name_or_path
    if not base:
        raise UsageError("adapter_config.json names no base model; pass --model BASE")
    peft_model = get_peft_model(model_from_config(base), lora_config)
    state = source.read([name for name in source.shapes if ".lora_" in name])
    # ZeRO keeps the adapter name (lora_A.default.weight); accelerate's FSDP save drops it, as peft's files do
    adapter = {k if ".default." in k else re.sub(r"\.(lora_\w+?)\.(weight|bias)$", r".\1.default.\2", k): v
               for k, v in state.items()}
    missing, unexpected = peft_model.load_state_dict(adapter, strict=False, assign=True)
    empty = [n for n, p in peft_model.named_parameters() if ".lora_" in n and p.is_meta]
    if unexpected or empty:
        raise UsageError(f"the checkpoint's LoRA weights do not match adapter_config.json: "
                         f"{', '.join((unexpected or empty)[:5])}")
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return f"LoRA adapter for {base}"


def export(checkpoint, out_dir, base: str | None = None, trust_pickle: bool = False,
           max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write a `from_pretrained`-loadable folder at `out_dir` (atomically) from a sharded checkpoint, one
    shard of at most `max_shard_size` in memory at a time. `trust_pickle`: unpickle the checkpoint's files
    without restriction (they may run code)."""
    checkpoint, out = Path(checkpoint), Path(out_dir)
    text = str(max_shard_size).strip()
    limit = int(text) if text.isdigit() else parse_size(text, "--max-shard-size")  # a bare number: bytes
    if out.exists() or out.is_symlink():
        raise UsageError(f"output folder '{out}' already exists{' (a symlink)' if out.is_symlink() else ''}; "
                         "export never overwrites, choose a new one")
    if not out.parent.is_dir():
        raise UsageError(f"the parent of output folder '{out}' does not exist")
    source = open_source(checkpoint, trust_pickle)
    parents = [source.step, source.step.parent, source.step.parent.parent]
    staging = out.parent / f".{out.name}.partial-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        if any(".lora_" in name for name in source.shapes):
            what = write_adapter(source, parents, staging, base)
        else:
            what = write_full_model(source, parents, staging, base, limit)
        for name in COPIED_FILES:
            found = _first_with(name, *parents)
            if found is not None:
                shutil.copy2(found / name, staging / name)
        if out.exists():
            raise UsageError(f"output folder '{out}' appeared while exporting; left it alone")
        ordinary_permissions(staging)  # safetensors writes 0600 files
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    kind = "ZeRO" if source.kind == "zero" else "FSDP sharded"
    print(f"exported {what} from {kind} checkpoint {source.step} to {out}")
    return out


# ----------------------------------------------------------------------------- command line


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export", help="turn a ZeRO/FSDP sharded checkpoint into a normal save_pretrained model, in bounded memory",
        description="Consolidate a DeepSpeed ZeRO-1/2/3 or FSDP SHARDED_STATE_DICT checkpoint (a Trainer "
                    "checkpoint-N folder) into safetensors shards and their index, a folder from_pretrained "
                    "loads (LoRA: the adapter). Tensor by tensor, one shard in memory at a time; "
                    f"{MEMORY_BOUND}.")
    parser.add_argument("checkpoint", type=Path, help="checkpoint-N, global_stepN, pytorch_model_fsdp_0 or an output dir")
    parser.add_argument("out_dir", type=Path, help="new folder to create (refused if it exists)")
    parser.add_argument("--model", help="base model (folder or hub id) when the checkpoint has no config.json, "
                                        "or to override the LoRA adapter's base")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help="largest shard file (default 5GB; 5GB = 5e9 bytes, 5GiB = 5 x 2^30, a bare number is "
                             f"bytes). It bounds the memory export needs: {MEMORY_BOUND}")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="unpickle the checkpoint's files without restriction. A crafted checkpoint can then run "
                             "any code on your machine: use only for files you made or whose source you trust. "
                             "Without it, only tensors and the known DeepSpeed/DCP types are loaded.")
    parser.set_defaults(func=lambda args: export(args.checkpoint, args.out_dir, args.model, args.trust_pickle,
                                                 args.max_shard_size) and 0)
