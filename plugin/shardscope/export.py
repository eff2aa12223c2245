"""`shardscope export CHECKPOINT_DIR OUT_DIR`: a sharded ZeRO-3 or FSDP checkpoint -> a normal model folder.

The consolidation is the libraries' own: DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint` (what
`zero_to_fp32.py` runs) for `global_stepN/*_states.pt`, torch's `dcp_to_torch_save` (what accelerate's
`merge_fsdp_weights` runs) for an FSDP `SHARDED_STATE_DICT` folder (`pytorch_model_fsdp_0/.metadata`).
The weights are then loaded into the model built from its config on the meta device and written with
`save_pretrained` (safetensors); LoRA runs write the adapter (`adapter_model.safetensors`), loadable with
`PeftModel.from_pretrained(base, OUT_DIR)`.

Accepted checkpoints: a Trainer `checkpoint-N` folder, a Trainer output folder (its newest `checkpoint-N`),
a ZeRO `global_stepN` folder, or a DCP folder. Everything is written to a temporary folder beside OUT_DIR
and renamed into place at the end: an error leaves nothing behind, and an existing OUT_DIR is refused.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

from .errors import UsageError

WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt", "chat_template.jinja", "preprocessor_config.json")


# ----------------------------------------------------------------------------- find the checkpoint


def find_checkpoint(path: Path) -> tuple[str, Path, str | None]:
    """("zero", folder holding `latest`/global_stepN, tag) or ("dcp", DCP folder, None)."""
    if not path.is_dir():
        raise UsageError(f"checkpoint '{path}' is not a folder")
    if list(path.glob("*_model_states.pt")):  # a global_stepN folder given directly
        return "zero", path.parent, path.name
    if (path / "latest").is_file() or list(path.glob("global_step*/*_model_states.pt")):
        return "zero", path, None
    if (path / ".metadata").is_file():
        return "dcp", path, None
    models = sorted(path.glob("pytorch_model_fsdp_*"))
    if models:
        if len(models) > 1:
            raise UsageError(f"checkpoint '{path}' holds {len(models)} FSDP models ({', '.join(m.name for m in models)}); "
                             "pass the one to export")
        return "dcp", models[0], None
    steps = sorted((p for p in path.glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name)),
                   key=lambda p: int(p.name.split("-")[1]))
    if steps:
        print(f"shardscope: exporting the newest checkpoint, {steps[-1]}")
        return find_checkpoint(steps[-1])
    hint = " (it already holds a full model; use from_pretrained on it)" if list(path.glob("*.safetensors")) else ""
    raise UsageError(f"checkpoint '{path}' is neither a ZeRO checkpoint (global_stepN/*_model_states.pt) nor an "
                     f"FSDP sharded one (pytorch_model_fsdp_0/.metadata){hint}")


# ----------------------------------------------------------------------------- consolidate


def _check_archive(file: Path) -> None:
    """torch.save writes a zip archive whose directory is at the end: a cut-off file has none."""
    if not zipfile.is_zipfile(file):
        raise UsageError(f"checkpoint file '{file}' is truncated or corrupt (not a complete torch.save archive)")


def zero_state_dict(folder: Path, tag: str | None) -> dict:
    """DeepSpeed's own ZeRO consolidation (fp32 master weights), after checking every rank's files are there."""
    if tag is None:
        latest = folder / "latest"
        if not latest.is_file():
            tags = sorted(p.name for p in folder.glob("global_step*") if p.is_dir())
            if len(tags) != 1:
                raise UsageError(f"checkpoint '{folder}' has no 'latest' file and {len(tags)} global_step folders")
            tag = tags[0]
        else:
            tag = latest.read_text().strip()
    step = folder / tag
    if not step.is_dir():
        raise UsageError(f"checkpoint '{folder}': 'latest' names {tag}, which is missing")
    ranks = {}
    for kind in ("model", "optim"):
        files = sorted(step.glob(f"*zero_pp_rank_*_mp_rank_*_{kind}_states.pt"))
        ranks[kind] = {int(re.search(r"zero_pp_rank_(\d+)_", f.name).group(1)) for f in files}
        for file in files:
            _check_archive(file)
    expected = set(range(max(ranks["model"] | ranks["optim"], default=-1) + 1))
    for kind, found in ranks.items():
        if found != expected:
            missing = sorted(expected - found)
            raise UsageError(f"checkpoint '{step}' is missing a shard: no {kind} states for rank(s) "
                             f"{', '.join(map(str, missing)) or '0'} (every rank writes one)")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        return get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)
    except Exception as error:  # ValueError for a missing rank, RuntimeError/pickle errors for corrupt files
        raise UsageError(f"checkpoint '{step}' cannot be consolidated: {type(error).__name__}: "
                         f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}") from error


def dcp_state_dict(folder: Path, scratch: Path) -> dict:
    """torch's own DCP -> torch.save conversion, after checking every file the metadata names is whole."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as error:
        raise UsageError(f"checkpoint '{folder}/.metadata' is unreadable (truncated or corrupt): "
                         f"{type(error).__name__}") from error
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = folder / name
        if not file.is_file():
            raise UsageError(f"checkpoint '{folder}' is missing a shard: {name} (named in .metadata)")
        if file.stat().st_size < size:
            raise UsageError(f"checkpoint file '{file}' is truncated: {file.stat().st_size} bytes, "
                             f".metadata needs {size}")
    target = scratch / "consolidated.pt"
    try:
        dcp_to_torch_save(str(folder), str(target))
        state = torch.load(target, weights_only=True, map_location="cpu")
    except Exception as error:
        raise UsageError(f"checkpoint '{folder}' cannot be consolidated: {type(error).__name__}: "
                         f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}") from error
    finally:
        target.unlink(missing_ok=True)
    state = state.get("model", state)  # accelerate saves {"model": model_state_dict}
    return {_strip_wrappers(k): v for k, v in state.items() if hasattr(v, "shape")}


def _strip_wrappers(key: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        key = key.replace(prefix, "")
    return key.removeprefix("module.")


# ----------------------------------------------------------------------------- rebuild and save


def _first_with(name: str, *folders: Path | None) -> Path | None:
    for folder in folders:
        if folder is not None and (folder / name).is_file():
            return folder
    return None


def _model_from_config(source: str):
    """The model class named by the config's `architectures`, built on the meta device."""
    import torch
    import transformers

    from .model_spec import load_model_config

    config = load_model_config(source)
    cls = next((getattr(transformers, a) for a in (config.architectures or []) if hasattr(transformers, a)), None)
    with torch.device("meta"):
        if cls is not None:
            return cls(config)
    from .model_spec import meta_model

    return meta_model(config)


def _load(module, state: dict, what: str) -> None:
    """Load `state` into a meta-device module; every parameter must come from the checkpoint."""
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    empty = [name for name, p in module.named_parameters() if p.is_meta]
    if unexpected:
        raise UsageError(f"the checkpoint has weights {what} does not: {', '.join(unexpected[:5])}"
                         f"{' ...' if len(unexpected) > 5 else ''} (wrong --model?)")
    if empty:
        raise UsageError(f"the checkpoint lacks weights of {what}: {', '.join(empty[:5])}"
                         f"{' ...' if len(empty) > 5 else ''}")


def write_model(state: dict, checkpoint: Path, out: Path, base: str | None) -> str:
    """Save a full model (or a LoRA adapter) from a consolidated state dict into `out`; returns what it wrote."""
    parents = [checkpoint, checkpoint.parent, checkpoint.parent.parent]
    lora = any(".lora_" in key for key in state)
    if lora:
        adapter_dir = _first_with("adapter_config.json", *parents)
        if adapter_dir is None:
            raise UsageError(f"the checkpoint holds LoRA weights but no adapter_config.json is beside it "
                             f"({checkpoint}); copy the run's adapter_config.json there")
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig.from_pretrained(str(adapter_dir))
        base = base or lora_config.base_model_name_or_path
        if not base:
            raise UsageError("adapter_config.json names no base model; pass --model BASE")
        peft_model = get_peft_model(_model_from_config(base), lora_config)
        # ZeRO keeps the adapter name (lora_A.default.weight); accelerate's FSDP save drops it, as peft's files do
        adapter = {k if ".default." in k else re.sub(r"\.(lora_\w+?)\.(weight|bias)$", r".\1.default.\2", k): v
                   for k, v in state.items() if ".lora_" in k}
        missing, unexpected = peft_model.load_state_dict(adapter, strict=False, assign=True)
        empty = [n for n, p in peft_model.named_parameters() if ".lora_" in n and p.is_meta]
        if unexpected or empty:
            raise UsageError(f"the checkpoint's LoRA weights do not match adapter_config.json: "
                             f"{', '.join((unexpected or empty)[:5])}")
        peft_model.save_pretrained(str(out), safe_serialization=True)
        what = f"LoRA adapter for {base}"
    else:
        source = base or (str(_first_with("config.json", *parents) or "") or None)
        if source is None:
            raise UsageError(f"no config.json in '{checkpoint}' or its parent folders; pass --model BASE "
                             "(the model the run started from)")
        model = _model_from_config(source)
        _load(model, state, f"the model from '{source}'")
        model.save_pretrained(str(out), safe_serialization=True)
        what = f"{type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters)"
    for name in COPIED_FILES:
        found = _first_with(name, *parents)
        if found is not None:
            shutil.copy2(found / name, out / name)
    return what


def export(checkpoint, out_dir, base: str | None = None) -> Path:
    """Consolidate `checkpoint` and write a `from_pretrained`-loadable folder at `out_dir` (atomically)."""
    checkpoint, out = Path(checkpoint), Path(out_dir)
    if out.exists():
        raise UsageError(f"output folder '{out}' already exists; export never overwrites, choose a new one")
    if not out.parent.is_dir():
        raise UsageError(f"the parent of output folder '{out}' does not exist")
    kind, folder, tag = find_checkpoint(checkpoint)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        state = zero_state_dict(folder, tag) if kind == "zero" else dcp_state_dict(folder, staging)
        what = write_model(state, folder if kind == "dcp" else (folder / tag if tag else folder), staging, base)
        if out.exists():
            raise UsageError(f"output folder '{out}' appeared while exporting; left it alone")
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    print(f"exported {what} from {'ZeRO' if kind == 'zero' else 'FSDP sharded'} checkpoint {folder} to {out}")
    return out


# ----------------------------------------------------------------------------- command line


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export", help="turn a ZeRO-3/FSDP sharded checkpoint into a normal save_pretrained model",
        description="Consolidate a DeepSpeed ZeRO or FSDP SHARDED_STATE_DICT checkpoint (a Trainer checkpoint-N "
                    "folder) into a safetensors model folder that from_pretrained loads (LoRA: the adapter).")
    parser.add_argument("checkpoint", type=Path, help="checkpoint-N, global_stepN, pytorch_model_fsdp_0 or an output dir")
    parser.add_argument("out_dir", type=Path, help="new folder to create (refused if it exists)")
    parser.add_argument("--model", help="base model (folder or hub id) when the checkpoint has no config.json, "
                                        "or to override the LoRA adapter's base")
    parser.set_defaults(func=lambda args: export(args.checkpoint, args.out_dir, args.model) and 0)
