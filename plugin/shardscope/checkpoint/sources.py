"""Reading a Trainer's sharded checkpoint (DeepSpeed ZeRO-1/2/3 or FSDP SHARDED_STATE_DICT via DCP) a few
tensors at a time, never the whole model at once.

`open_source(path)` finds the checkpoint and returns a `ZeroSource` or a `DcpSource`; both give `shapes`
(name -> (shape, dtype), wrapper prefixes stripped) and `read(names)` (those tensors, full, on the CPU).

ZeRO: the fp32 master weights are the optimizer partitions of every rank (`*_optim_states.pt`), laid out as
DeepSpeed's `zero_to_fp32` reads them (ZeRO-1/2: each parameter group's flat vector cut into equal partitions;
ZeRO-3: each parameter cut into equal pieces, one per rank). The rank files are memory-mapped; the mapping is
dropped and made again before the bytes read through it would pass the largest tensor's size, so the
checkpoint's pages it touched leave the process's resident memory (mapped file pages count in RSS while
mapped): at most one largest tensor of them is resident at a time.
DCP: torch's own `FileSystemReader` reads only the keys asked for.

Checkpoints are pickles, and unpickling can run code. By default nothing runs: ZeRO files load with
`torch.load(weights_only=True)` allowing only the DeepSpeed types below (DeepSpeed's own loaders, where called,
through torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD); a DCP `.metadata` is unpickled allowing only DCP's metadata
classes, and only tensor entries are read (DCP unpickles non-tensor entries with `weights_only=False`; a model
needs none). `trust_pickle` restores plain unpickling. Paths named inside the checkpoint (`latest`, DCP shard
files) must stay inside its folder.
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import re
from pathlib import Path

from ..errors import UsageError
from ..safe_io import read_bytes, read_text

WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
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


# ----------------------------------------------------------------------------- find the checkpoint


def find_checkpoint(path: Path, verb: str = "exporting") -> tuple[str, Path, str | None]:
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
                             "pass the one to use")
        return "dcp", models[0], None
    steps = newest_first(path)
    if steps:
        print(f"shardscope: {verb} the newest checkpoint, {steps[0]}")
        return find_checkpoint(steps[0], verb)
    hint = " (it already holds a full model; use from_pretrained on it)" if list(path.glob("*.safetensors")) else ""
    raise UsageError(f"checkpoint '{path}' is neither a ZeRO checkpoint (global_stepN/*_model_states.pt) nor an "
                     f"FSDP sharded one (pytorch_model_fsdp_0/.metadata){hint}")


def newest_first(path: Path) -> list[Path]:
    """The Trainer's `checkpoint-N` folders in `path`, newest first."""
    steps = [p for p in path.glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name) and p.is_dir()]
    return sorted(steps, key=lambda p: -int(p.name.split("-")[1]))


def inside(folder: Path, name: str, what: str) -> Path:
    """`folder / name`, refused unless it resolves inside `folder` (names read from checkpoint files)."""
    path = folder / name
    if not path.resolve().is_relative_to(folder.resolve()):
        raise UsageError(f"checkpoint '{folder}': {what} names '{name}', which is outside the checkpoint folder")
    return path


def strip_wrappers(key: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        key = key.replace(prefix, "")
    return key.removeprefix("module.")


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def refusal(error: Exception) -> str:
    """What torch's weights_only unpickler refused, in one line."""
    return str(error).partition("WeightsUnpickler error:")[2].strip().split("\n")[0] or first_line(error)


def open_source(path: Path, trust_pickle: bool = False, verb: str = "exporting"):
    kind, folder, tag = find_checkpoint(path, verb)
    return ZeroSource(folder, tag, trust_pickle) if kind == "zero" else DcpSource(folder, trust_pickle)


# ----------------------------------------------------------------------------- ZeRO


@contextlib.contextmanager
def weights_only_loads():
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


def zero_step(folder: Path, tag: str | None) -> Path:
    """The global_stepN folder `tag` (or `latest`) names, kept inside `folder`."""
    if tag is None:
        latest = folder / "latest"
        if not latest.is_file():
            tags = sorted(p.name for p in folder.glob("global_step*") if p.is_dir())
            if len(tags) != 1:
                raise UsageError(f"checkpoint '{folder}' has no 'latest' file and {len(tags)} global_step folders")
            tag = tags[0]
        else:
            tag = read_text(latest, "checkpoint file", max_bytes=4096).strip()
    step = inside(folder, tag, "'latest'")
    if not step.is_dir():
        raise UsageError(f"checkpoint '{folder}': 'latest' names {tag}, which is missing")
    return step


def zero_files(step: Path, trust_pickle: bool) -> tuple[list[Path], list[Path]]:
    """(model state files, optimizer state files), in rank order, after checking every rank wrote its files,
    each is a whole torch.save archive, and (unless trusted) pickles nothing but DeepSpeed's types."""
    import zipfile

    import torch

    rank = lambda f: int(re.search(r"zero_pp_rank_(\d+)_", f.name).group(1))  # noqa: E731
    files = {kind: sorted(step.glob(f"*zero_pp_rank_*_mp_rank_*_{kind}_states.pt"), key=rank)
             for kind in ("model", "optim")}
    ranks = {kind: {rank(f) for f in found} for kind, found in files.items()}
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
        if not zipfile.is_zipfile(file):  # torch.save's zip directory is at the end: a cut-off file has none
            raise UsageError(f"checkpoint file '{file}' is truncated or corrupt (not a complete torch.save archive)")
        if not trust_pickle:  # name the file and type here; the weights_only loads are what enforce it
            with weights_only_loads():
                try:
                    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
                except Exception:  # opcodes the static scan does not follow (protocol 4 frames), odd archives
                    unsafe = []
            if unsafe:
                raise UsageError(f"checkpoint file '{file}' pickles {', '.join(sorted(unsafe)[:3])}, which is not "
                                 f"a DeepSpeed checkpoint type: loading it could run code on your machine; "
                                 f"{TRUST_HINT}")
    return files["model"], files["optim"]


def zero_load(file: Path, trust_pickle: bool, mmap: bool = True):
    """One ZeRO file, memory-mapped, weights_only unless trusted; refusals and corruption as one line."""
    import torch

    try:
        with contextlib.nullcontext() if trust_pickle else weights_only_loads():
            return torch.load(file, map_location="cpu", mmap=mmap, weights_only=not trust_pickle)
    except pickle.UnpicklingError as error:  # weights_only refused something the scan did not see
        raise UsageError(f"checkpoint file '{file}' holds pickled data that is not a DeepSpeed checkpoint's "
                         f"({refusal(error)}): loading it could run code on your machine; {TRUST_HINT}") from error
    except Exception as error:
        raise UsageError(f"checkpoint file '{file}' is unreadable: {type(error).__name__}: "
                         f"{first_line(error)}") from error


class ZeroSource:
    """The fp32 master weights (and buffers) of a ZeRO-1/2/3 checkpoint, read a few tensors at a time; with
    `state="exp_avg"` (or "exp_avg_sq") each trained parameter's Adam moment instead, gathered the same way."""

    kind = "zero"

    def __init__(self, folder: Path, tag: str | None, trust_pickle: bool = False, state: str = "fp32"):
        self.folder, self.step, self.trust, self.state = folder, zero_step(folder, tag), trust_pickle, state
        self.model_files, self.optim_files = zero_files(self.step, trust_pickle)
        try:
            models, optims = self._map()
            self._layout(models[0], optims)
        except (KeyError, TypeError, AttributeError, IndexError) as error:
            raise UsageError(f"checkpoint '{self.step}' is not a ZeRO checkpoint this version reads: "
                             f"{type(error).__name__}: {first_line(error)}") from None
        self.largest = max(math.prod(s) * d.itemsize for s, d in self.shapes.values())

    def _map(self):
        return ([zero_load(f, self.trust) for f in self.model_files],
                [zero_load(f, self.trust)["optimizer_state_dict"] for f in self.optim_files])

    def _layout(self, model: dict, optims: list) -> None:
        """name -> how to build it (`entries`) and its (shape, dtype) (`shapes`), from rank 0's files."""
        import torch

        self.stage = int(optims[0]["zero_stage"])
        world = optims[0]["partition_count"]
        self.world_size = max(world) if isinstance(world, list) else int(world)
        if self.world_size != len(optims):
            raise UsageError(f"checkpoint '{self.step}' is missing a shard: {len(optims)} optimizer state files "
                             f"for a world size of {self.world_size}")
        self.entries, self.shapes = {}, {}
        buffers = set(model["buffer_names"])  # as zero_to_fp32 reads them: the saved module's entries named buffers
        for name, value in model["module"].items():
            if name in buffers:
                self._add(name, ("buffer", name), value.shape, torch.float32 if value.is_floating_point() else value.dtype)
        for name, shape in (model.get("frozen_param_shapes") or {}).items():
            self._add(name, ("frozen", name, shape), shape, torch.float32)
        groups = optims[0]["fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"]
        dtype = groups[0].dtype
        if self.stage == 3:
            shapes = {k: v for group in model["param_shapes"] for k, v in group.items()}
            self.group_offsets = [0, *torch.tensor([g.numel() for g in groups]).cumsum(0).tolist()]
            offset = 0
            for name, shape in shapes.items():
                piece = math.ceil(math.prod(shape) / self.world_size)
                self._add(name, ("zero3", offset, piece, shape), shape, dtype)
                offset += piece
            consumed, available = offset, self.group_offsets[-1]
        else:
            paddings = optims[0].get("param_alignment_paddings")
            for index, shapes in enumerate(model["param_shapes"]):
                offset = 0
                for position, (name, shape) in enumerate(shapes.items()):
                    self._add(name, ("zero2", index, offset, shape), shape, dtype)
                    offset += math.prod(shape) + (paddings[index][position] if paddings else 0)
                align = 2 * self.world_size  # DeepSpeed's zero_to_fp32: ZeRO-2 pads each group to 2 x world
                consumed = align * math.ceil(offset / align)
                available = align * math.ceil(groups[index].numel() * self.world_size / align)
                if consumed != available:
                    break
        if consumed != available:
            raise UsageError(f"checkpoint '{self.step}' is inconsistent: its parameters take {consumed} elements, "
                             f"its optimizer partitions hold {available}")
        for name, source in model.get("shared_params", {}).items():
            if strip_wrappers(source) in self.entries:
                self._add(name, self.entries[strip_wrappers(source)], *self.shapes[strip_wrappers(source)])

    def _add(self, name, entry, shape, dtype) -> None:
        import torch

        self.entries[strip_wrappers(name)] = entry
        self.shapes[strip_wrappers(name)] = (torch.Size(shape), dtype)

    def read(self, names) -> dict:
        """The full tensors `names`. The rank files are mapped again before the bytes read through one mapping
        would pass the largest tensor's size, so at most that much of them is resident at once."""
        import torch

        out, since, maps = {}, 0, None
        for name in names:
            size = math.prod(self.shapes[name][0]) * self.shapes[name][1].itemsize
            if maps is None or since + size > self.largest:
                maps, since = None, 0  # drop the old mapping before making the new one
                maps = self._map()
            with torch.no_grad():  # the partitions are saved requiring grad: a graph would keep the mapping alive
                out[name] = self._build(name, *maps)
            since += size
        return out

    def _build(self, name: str, models: list, optims: list):
        import torch

        kind, *where = self.entries[name]
        if kind == "buffer":
            value = models[0]["module"][where[0]]  # copied: a view would keep the mapping alive
            return value.to(torch.float32, copy=True) if value.is_floating_point() else value.clone()
        if kind == "frozen" and self.stage <= 2:
            return models[0]["frozen_param_fragments"][where[0]].float().clone()
        if kind == "frozen":  # ZeRO-3: one padded piece per rank
            pieces = [m["frozen_param_fragments"][where[0]] for m in models]
            return torch.cat(pieces).narrow(0, 0, math.prod(where[1])).view(where[1]).float()
        if kind == "zero3":
            from deepspeed.utils.zero_to_fp32 import GatheredTensor

            offset, piece, shape = where
            flat = [self._flat(o, "fp32_flat_groups", "optimizer_state_dict") for o in optims]
            return GatheredTensor(flat, self.group_offsets, offset, piece, torch.Size(shape)).contiguous()
        index, offset, shape = where  # ZeRO-1/2: a slice of the group's flat vector, cut across ranks
        parts = [self._flat(o, "single_partition_of_fp32_groups", "base_optimizer_state")[index] for o in optims]
        return slice_of_concat(parts, offset, math.prod(shape)).view(shape)

    def _flat(self, optim: dict, master: str, base: str) -> list:
        """A rank's flat partitions, one per parameter group: the fp32 master's, or an Adam state's."""
        if self.state == "fp32":
            return optim[master]
        states = optim[base]["state"]
        return [states[index][self.state] for index in range(len(optim[master]))]


def slice_of_concat(parts: list, start: int, length: int):
    """`torch.cat(parts)[start:start + length]`, copying only the slice."""
    import torch

    pieces, position = [], 0
    for part in parts:
        low, high = max(start, position), min(start + length, position + part.numel())
        if low < high:
            pieces.append(part[low - position:high - position])
        position += part.numel()
    return torch.cat(pieces)


# ----------------------------------------------------------------------------- DCP


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
        inside(folder, info.relative_path, ".metadata")
    return metadata


def check_dcp_files(folder: Path, metadata) -> None:
    """Every file the metadata names is there and long enough."""
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


class DcpSource:
    """The model tensors of a DCP checkpoint, read by torch's own FileSystemReader (tensors load weights_only)
    a few keys at a time. Non-tensor entries are never read. With `state="exp_avg"` (or another optimizer state)
    and an optimizer folder (`optimizer_0`): that state of each parameter, named by the parameter."""

    kind = "dcp"

    def __init__(self, folder: Path, trust_pickle: bool = False, state: str | None = None):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.folder, self.step = folder, folder
        self.metadata = read_dcp_metadata(folder, trust_pickle)
        check_dcp_files(folder, self.metadata)
        # accelerate saves {"model": model_state_dict}: the planner data maps each flat key back to that nesting
        paths = {k: tuple(v) for k, v in (self.metadata.planner_data or {}).items() if isinstance(v, (tuple, list))}
        nested = any(path[:1] == ("model",) for path in paths.values())

        def name(key):  # the model tensor (or the parameter whose optimizer `state`) a key holds, else None
            path = paths.get(key, ())
            if state is not None:
                return path[2] if path[:2] == ("optimizer", "state") and path[-1:] == (state,) else None
            return ".".join(map(str, path[1:])) if nested and path[:1] == ("model",) else None if nested else key

        self.keys = {strip_wrappers(name(key)): key for key, md in self.metadata.state_dict_metadata.items()
                     if isinstance(md, TensorStorageMetadata) and name(key) is not None}
        self.shapes = {name: (md.size, md.properties.dtype) for name, key in self.keys.items()
                       for md in [self.metadata.state_dict_metadata[key]]}

    def read(self, names) -> dict:
        import torch
        import torch.distributed.checkpoint as dcp

        metadata = self.metadata

        class Reader(dcp.FileSystemReader):  # the metadata read safely above, not a second plain unpickling
            def read_metadata(self, *args, **kwargs):
                return metadata

        state = {self.keys[name]: torch.empty(self.shapes[name][0], dtype=self.shapes[name][1]) for name in names}
        try:
            dcp.load(state, storage_reader=Reader(str(self.folder)), no_dist=True)
        except Exception as error:
            raise UsageError(f"checkpoint '{self.folder}' cannot be read: {type(error).__name__}: "
                             f"{first_line(error)}") from error
        return {name: state[self.keys[name]] for name in names}
