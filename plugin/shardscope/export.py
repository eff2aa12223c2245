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

Checkpoints are pickles, and unpickling can run code. By default nothing runs: ZeRO files are loaded with
`torch.load(weights_only=True)` (forced for DeepSpeed's own loader through torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD)
allowing only the DeepSpeed types below; a DCP `.metadata` is unpickled allowing only DCP's metadata classes,
and only tensor entries are read (DCP unpickles non-tensor entries with `weights_only=False`; a model needs
none). `--trust-pickle` restores plain unpickling. Paths named inside the checkpoint (`latest`, DCP shard
files) must stay inside its folder.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import secrets
import shutil
import zipfile
from pathlib import Path

from .errors import UsageError
from .safe_io import ordinary_permissions, read_bytes, read_text

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

TRUST_HINT = "if you trust where it came from, re-run with --trust-pickle"
# What DeepSpeed's ZeRO-1/2/3 `*_states.pt` files pickle besides tensors and containers (seen in fp32 and bf16
# runs of deepspeed 0.19; fp16 runs save their DynamicLossScaler).
ZERO_GLOBALS = [("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
                ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
                ("deepspeed.utils.tensor_fragment", "fragment_address")]
# What a DCP `.metadata` pickles (torch.distributed.checkpoint.FileSystemWriter).
DCP_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},  # and the dtypes (torch.float32, ...), checked by type
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


def _inside(folder: Path, name: str, what: str) -> Path:
    """`folder / name`, refused unless it resolves inside `folder` (names read from checkpoint files)."""
    path = folder / name
    if not path.resolve().is_relative_to(folder.resolve()):
        raise UsageError(f"checkpoint '{folder}': {what} names '{name}', which is outside the checkpoint folder")
    return path


def _check_archive(file: Path) -> None:
    """torch.save writes a zip archive whose directory is at the end: a cut-off file has none."""
    if not zipfile.is_zipfile(file):
        raise UsageError(f"checkpoint file '{file}' is truncated or corrupt (not a complete torch.save archive)")


@contextlib.contextmanager
def _weights_only_loads():
    """Every torch.load inside (DeepSpeed's included) runs with weights_only=True and the ZeRO types allowed."""
    import importlib

    import torch

    allowed = [getattr(importlib.import_module(module), name) for module, name in ZERO_GLOBALS]
    saved = {k: os.environ.pop(k, None) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(allowed):
            yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def zero_state_dict(folder: Path, tag: str | None, trust_pickle: bool = False) -> dict:
    """DeepSpeed's own ZeRO consolidation (fp32 master weights), after checking every rank's files are there."""
    import torch

    if tag is None:
        latest = folder / "latest"
        if not latest.is_file():
            tags = sorted(p.name for p in folder.glob("global_step*") if p.is_dir())
            if len(tags) != 1:
                raise UsageError(f"checkpoint '{folder}' has no 'latest' file and {len(tags)} global_step folders")
            tag = tags[0]
        else:
            tag = read_text(latest, "checkpoint file", max_bytes=4096).strip()
    step = _inside(folder, tag, "'latest'")
    if not step.is_dir():
        raise UsageError(f"checkpoint '{folder}': 'latest' names {tag}, which is missing")
    files = {kind: sorted(step.glob(f"*zero_pp_rank_*_mp_rank_*_{kind}_states.pt")) for kind in ("model", "optim")}
    ranks = {kind: {int(re.search(r"zero_pp_rank_(\d+)_", f.name).group(1)) for f in found}
             for kind, found in files.items()}
    if not files["model"]:  # ZeRO-1/2: one mp_rank_00_model_states.pt, optimizer states per rank
        files["model"] = sorted(step.glob("mp_rank_*_model_states.pt"))
        ranks.pop("model")
        if not files["model"]:
            raise UsageError(f"checkpoint '{step}' is missing a shard: no *_model_states.pt")
    expected = set(range(max(set().union(*ranks.values()), default=-1) + 1))
    for kind, found in ranks.items():
        if found != expected:
            missing = sorted(expected - found)
            raise UsageError(f"checkpoint '{step}' is missing a shard: no {kind} states for rank(s) "
                             f"{', '.join(map(str, missing)) or '0'} (every rank writes one)")
    for file in files["model"] + files["optim"]:
        _check_archive(file)
        if not trust_pickle:  # name the file and type here; the weights_only loads below are what enforce it
            with _weights_only_loads():
                try:
                    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
                except Exception:  # opcodes the static scan does not follow (protocol 4 frames), odd archives
                    unsafe = []
            if unsafe:
                raise UsageError(f"checkpoint file '{file}' pickles {', '.join(sorted(unsafe)[:3])}, which is not "
                                 f"a DeepSpeed checkpoint type: loading it could run code on your machine; "
                                 f"{TRUST_HINT}")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        with contextlib.nullcontext() if trust_pickle else _weights_only_loads():
            return get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)
    except pickle.UnpicklingError as error:  # weights_only refused something the scan above did not see
        reason = str(error).partition("WeightsUnpickler error:")[2].strip().split("\n")[0] or _first_line(error)
        raise UsageError(f"checkpoint '{step}' holds pickled data that is not a DeepSpeed checkpoint's "
                         f"({reason}): loading it could run code on your machine; {TRUST_HINT}") from error
    except Exception as error:  # ValueError for a missing rank, RuntimeError/pickle errors for corrupt files
        raise UsageError(f"checkpoint '{step}' cannot be consolidated: {type(error).__name__}: "
                         f"{_first_line(error)}") from error


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` allowing only DCP_GLOBALS (the Python docs' "restricting globals")."""

    def find_class(self, module, name):
        import torch

        value = super().find_class(module, name) if name in DCP_GLOBALS.get(module, ()) or module == "torch" else None
        if value is None or (module == "torch" and name != "Size" and not isinstance(value, torch.dtype)):
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type")
        return value


def read_dcp_metadata(folder: Path, trust_pickle: bool = False):
    """The checkpoint's `.metadata`, unpickled safely unless `trust_pickle`; its shard paths checked."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    file = folder / ".metadata"
    data = read_bytes(file, "checkpoint file", max_bytes=1 << 30)
    try:
        metadata = pickle.loads(data) if trust_pickle else _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as error:
        if "is not a DCP metadata type" not in str(error):
            raise UsageError(f"checkpoint file '{file}' is unreadable (truncated or corrupt): {error}") from None
        raise UsageError(f"checkpoint file '{file}' pickles {str(error).split(' is not')[0]}, which is not a DCP "
                         f"metadata type: loading it could run code on your machine; {TRUST_HINT}") from None
    except Exception as error:
        raise UsageError(f"checkpoint file '{file}' is unreadable (truncated or corrupt): "
                         f"{type(error).__name__}") from None
    if not isinstance(metadata, Metadata):
        raise UsageError(f"checkpoint file '{file}' is not DCP metadata (it holds a {type(metadata).__name__})")
    metadata.storage_meta = metadata.storage_meta or StorageMeta()
    for info in metadata.storage_data.values():
        if not (isinstance(info.relative_path, str) and isinstance(info.offset, int) and isinstance(info.length, int)):
            raise UsageError(f"checkpoint file '{file}' is corrupt: a storage entry is not (path, offset, length)")
        _inside(folder, info.relative_path, ".metadata")
    return metadata


def dcp_state_dict(folder: Path, trust_pickle: bool = False) -> dict:
    """The tensors of a DCP checkpoint, read by torch's own FileSystemReader (tensors load weights_only) after
    checking every file the metadata names is whole. Non-tensor entries are never read."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(folder, trust_pickle)
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

    class Reader(dcp.FileSystemReader):  # the metadata read above, not a second plain unpickling
        def read_metadata(self, *args, **kwargs):
            return metadata

    # accelerate saves {"model": model_state_dict}: the planner data maps each flat key back to that nesting
    paths = {k: tuple(v) for k, v in (metadata.planner_data or {}).items() if isinstance(v, (tuple, list))}
    nested = any(path[:1] == ("model",) for path in paths.values())
    names = {key: ".".join(map(str, paths[key][1:])) if nested else key
             for key, md in metadata.state_dict_metadata.items()
             if isinstance(md, TensorStorageMetadata) and (not nested or paths.get(key, ())[:1] == ("model",))}
    try:
        state = {key: torch.empty(metadata.state_dict_metadata[key].size,
                                  dtype=metadata.state_dict_metadata[key].properties.dtype) for key in names}
        dcp.load(state, storage_reader=Reader(str(folder)), no_dist=True)
    except Exception as error:
        raise UsageError(f"checkpoint '{folder}' cannot be consolidated: {type(error).__name__}: "
                         f"{_first_line(error)}") from error
    return {_strip_wrappers(names[key]): value for key, value in state.items()}


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

    from .model.spec import load_model_config

    config = load_model_config(source)
    cls = next((getattr(transformers, a) for a in (config.architectures or []) if hasattr(transformers, a)), None)
    with torch.device("meta"):
        if cls is not None:
            return cls(config)
    from .model.spec import meta_model

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


def export(checkpoint, out_dir, base: str | None = None, trust_pickle: bool = False) -> Path:
    """Consolidate `checkpoint` and write a `from_pretrained`-loadable folder at `out_dir` (atomically).
    `trust_pickle`: unpickle the checkpoint's files without restriction (they may run code)."""
    checkpoint, out = Path(checkpoint), Path(out_dir)
    if out.exists() or out.is_symlink():
        raise UsageError(f"output folder '{out}' already exists{' (a symlink)' if out.is_symlink() else ''}; "
                         "export never overwrites, choose a new one")
    if not out.parent.is_dir():
        raise UsageError(f"the parent of output folder '{out}' does not exist")
    kind, folder, tag = find_checkpoint(checkpoint)
    staging = out.parent / f".{out.name}.partial-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        state = zero_state_dict(folder, tag, trust_pickle) if kind == "zero" else dcp_state_dict(folder, trust_pickle)
        what = write_model(state, folder if kind == "dcp" else (folder / tag if tag else folder), staging, base)
        if out.exists():
            raise UsageError(f"output folder '{out}' appeared while exporting; left it alone")
        ordinary_permissions(staging)  # safetensors writes 0600 files
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
    parser.add_argument("--trust-pickle", action="store_true",
                        help="unpickle the checkpoint's files without restriction. A crafted checkpoint can then run "
                             "any code on your machine: use only for files you made or whose source you trust. "
                             "Without it, only tensors and the known DeepSpeed/DCP types are loaded.")
    parser.set_defaults(func=lambda args: export(args.checkpoint, args.out_dir, args.model, args.trust_pickle) and 0)
