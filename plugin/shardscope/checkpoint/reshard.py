"""`shardscope reshard CHECKPOINT OUT`: a Trainer checkpoint that resumes at any world size, optimizer state kept.

- DeepSpeed ZeRO-1/2/3 (`global_stepN/`): a ZeRO checkpoint holds each rank's flat partitions, so it loads only
  at the world size that wrote it. DeepSpeed's own converter (`deepspeed/checkpoint/ds_to_universal.py`, run
  in process, one worker) writes its universal format: one folder per parameter (`zero/NAME/fp32.pt`,
  `exp_avg.pt`, `exp_avg_sq.pt`) plus `latest_universal`. A run loads it with the one DeepSpeed config switch
  `"checkpoint": {"load_universal": true}` (printed; shardscope's recipes set it themselves when the checkpoint
  they resume holds `latest_universal`). No `latest` is written, so a run without the switch fails at once
  ("failed to resume from checkpoint") instead of loading the wrong layout.
- FSDP `SHARDED_STATE_DICT` (DCP: `pytorch_model_fsdp_0/`, `optimizer_0/`): torch's DCP reshards on load, so
  the checkpoint already resumes at any world size. `reshard` checks that every DCP folder is readable (its
  `.metadata` unpickled safely, every file it names present and long enough, every tensor's chunks covering
  it) and copies the checkpoint to OUT.

The Trainer's own files (trainer_state.json, rng states, scheduler, config, tokenizer) are copied beside it,
so `--resume_from_checkpoint OUT` works. Same safety as `export`: nothing is unpickled beyond tensors and the
libraries' own types (the conversion's loads are forced to weights_only), paths named inside the checkpoint
stay inside it, links are refused, and OUT is written beside itself and renamed into place at the end.
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import secrets
import shutil
from argparse import Namespace
from pathlib import Path

from ..errors import UsageError
from ..safe_io import ordinary_permissions
from .sources import (
    TRUST_HINT, check_dcp_files, find_checkpoint, first_line, read_dcp_metadata, refusal, weights_only_loads,
    zero_files, zero_step,
)

UNIVERSAL_SWITCH = '"checkpoint": {"load_universal": true}'
SKIPPED = ("latest", "zero_to_fp32.py", "zero_to_torch.py")  # ZeRO's step pointer, its scripts for the old layout


def check_no_links(folder: Path) -> None:
    """Refuse a checkpoint holding links or special files: copying would follow them outside it."""
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink() or not (path.is_dir() or path.is_file()):
            raise UsageError(f"checkpoint '{folder}' holds '{path.relative_to(folder)}', which is a link or "
                             "special file; reshard copies regular files only")


def copy_trainer_files(folder: Path, out: Path, skip_dirs: bool) -> list[str]:
    """Copy the Trainer's files (and, unless `skip_dirs`, its folders) from `folder` into `out`."""
    copied = []
    for path in sorted(folder.iterdir()):
        if path.name in SKIPPED or (path.is_dir() and (skip_dirs or path.name.startswith("global_step"))):
            continue
        if path.is_dir():
            shutil.copytree(path, out / path.name)
        else:
            shutil.copy2(path, out / path.name)
        copied.append(path.name)
    return copied


def to_universal(folder: Path, tag: str | None, out: Path, trust_pickle: bool) -> str:
    """DeepSpeed's ds_to_universal of the step `tag` names, into `out/<tag>` plus `out/latest_universal`."""
    step = zero_step(folder, tag)
    zero_files(step, trust_pickle)  # every rank's files present, whole, and only DeepSpeed's types pickled
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = Namespace(input_folder=str(step), output_folder=str(out / step.name), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), (contextlib.nullcontext() if trust_pickle else weights_only_loads()):
            ds_to_universal(args)
    except pickle.UnpicklingError as error:
        raise UsageError(f"checkpoint '{step}' holds pickled data that is not a DeepSpeed checkpoint's "
                         f"({refusal(error)}): loading it could run code on your machine; {TRUST_HINT}") from error
    except Exception as error:  # DeepSpeed asserts and raises ValueError/FileNotFoundError on odd checkpoints
        raise UsageError(f"DeepSpeed's universal conversion of '{step}' failed: {type(error).__name__}: "
                         f"{first_line(error)}") from error
    params = sum(1 for p in (out / step.name / "zero").iterdir() if p.is_dir())
    return f"ZeRO checkpoint {step} -> DeepSpeed universal checkpoint ({params} parameters with their Adam moments)"


def check_dcp(folder: Path, trust_pickle: bool) -> int:
    """A DCP folder is readable and whole: safe metadata, files present and long enough, each tensor's chunks
    adding up to the tensor. Returns the number of tensors."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(folder, trust_pickle)
    check_dcp_files(folder, metadata)
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    for key, md in tensors.items():
        covered = sum(math.prod(chunk.sizes) for chunk in md.chunks)
        if covered != math.prod(md.size):
            raise UsageError(f"checkpoint '{folder}' is missing part of '{key}': its chunks hold {covered} of "
                             f"{math.prod(md.size)} elements (a rank's shard is missing from .metadata)")
    return len(tensors)


def reshard(checkpoint, out_dir, trust_pickle: bool = False) -> Path:
    """Write at `out_dir` (atomically) a copy of the Trainer checkpoint that resumes at any world size."""
    checkpoint, out = Path(checkpoint), Path(out_dir)
    if out.exists() or out.is_symlink():
        raise UsageError(f"output folder '{out}' already exists; reshard never overwrites, choose a new one")
    if not out.parent.is_dir():
        raise UsageError(f"the parent of output folder '{out}' does not exist")
    kind, folder, tag = find_checkpoint(checkpoint, "resharding")
    trainer_dir = folder if kind == "zero" else folder.parent
    check_no_links(trainer_dir)
    staging = out.parent / f".{out.name}.partial-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        if kind == "zero":
            what = to_universal(folder, tag, staging, trust_pickle)
            copy_trainer_files(trainer_dir, staging, skip_dirs=True)
        else:
            found = [p for p in sorted(trainer_dir.iterdir()) if p.is_dir() and (p / ".metadata").is_file()]
            counts = {p.name: check_dcp(p, trust_pickle) for p in found}
            copy_trainer_files(trainer_dir, staging, skip_dirs=False)
            what = (f"FSDP sharded checkpoint {trainer_dir} (DCP: " + ", ".join(
                f"{name} {n} tensors" for name, n in counts.items()) + ") checked and copied")
        if out.exists():
            raise UsageError(f"output folder '{out}' appeared while resharding; left it alone")
        ordinary_permissions(staging)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    print(f"resharded {what} to {out}")
    print(next_step(kind, out))
    return out


def next_step(kind: str, out: Path) -> str:
    """What the resumed run needs, printed after a reshard (and named by doctor)."""
    if kind == "zero":
        return (f"resume at any world size (keep the global batch: processes x per-device batch x accumulation) "
                f"with `--resume_from_checkpoint {out}` and this DeepSpeed config switch:\n"
                f"  {UNIVERSAL_SWITCH}\n"
                "(in the DeepSpeed JSON the Trainer or accelerate reads; shardscope's recipes set it themselves "
                "when the checkpoint holds latest_universal)")
    return (f"resume at any world size (keep the global batch) with `--resume_from_checkpoint {out}`: "
            "torch's DCP reshards the model and optimizer state on load")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "reshard", help="make a ZeRO/FSDP Trainer checkpoint resumable at another number of GPUs",
        description="Turn a Trainer checkpoint (DeepSpeed ZeRO-1/2/3, or FSDP SHARDED_STATE_DICT) into one that "
                    "resumes at any world size with the optimizer state kept: ZeRO -> DeepSpeed's universal "
                    f"checkpoint (resume with {UNIVERSAL_SWITCH} in the DeepSpeed config); DCP -> checked readable "
                    "and copied (torch reshards it on load).")
    parser.add_argument("checkpoint", type=Path, help="checkpoint-N (or a Trainer output dir: its newest)")
    parser.add_argument("out_dir", type=Path, help="new folder to create (refused if it exists)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="unpickle the checkpoint's files without restriction (a crafted checkpoint can then run "
                             "any code on your machine)")
    parser.set_defaults(func=lambda args: reshard(args.checkpoint, args.out_dir, args.trust_pickle) and 0)
