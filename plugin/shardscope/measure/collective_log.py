"""The collectives this rank issued last, for the hang records: torch's flight recorder, on by default.

torch 2.13 records every collective of ProcessGroupGloo and ProcessGroupNCCL in one ring per process (its
`FlightRecorder`): kind, sequence number per process group, tensor sizes and dtypes, and whether the work
completed. The ring's size is read once, when the first process group is created, from `TORCH_FR_BUFFER_SIZE`
(or the deprecated `TORCH_NCCL_TRACE_BUFFER_SIZE`; the new name wins), 2,000 entries when neither is set on this
torch; older releases default to 0 (off). `record_by_default` sets the new name to `ENTRIES` where the user set
neither, so the recorder is on whatever the release; it must run before the process group exists: at the import
of the profiler (and so of the callback) and at the recipes' start; a process group created before that keeps its
setting. `ring_entries()` reads the rings in their JSON form (no pickle) from any thread, while the training thread
waits inside a collective; `recent()` is what a hang record carries of them.

Two rings: a CUDA build keeps ProcessGroupNCCL's entries in a ring of their own, dumped by `_dump_nccl_trace_json`;
`_dump_fr_trace_json` dumps the other backends' (gloo's). Seen on an H200 with torch 2.11 (benchmarks/results/
gpu_check.md): after an FSDP2 run over NCCL the second held no entry and the first every all-gather and
reduce-scatter. `ring_entries` reads every ring this build has, so NCCL's collectives are never missed.

On NCCL, torch's own watchdog can dump the ring when a collective times out (`TORCH_NCCL_DUMP_ON_TIMEOUT`, read at
the process group's creation; it needs the ring on): `record_by_default` turns it on where unset, and
`dump_into(folder)` points the dump (`TORCH_FR_DUMP_TEMP_FILE`, read when torch writes it) into the run's hang
folder, where `shardscope hang` reads it as a weights-only pickle. `record_by_default` also turns NCCL's timing of
each collective on where unset (`TORCH_NCCL_ENABLE_TIMING`: a start event beside the end event NCCL records anyway;
torch notes that querying it can add to a watchdog hang): the ring's `duration_ms` is what a CUDA rank's compute
time subtracts (`cuda_compute.py`). NCCL's ring, its durations and its pickled dump read by `shardscope hang` were
seen on one H200 (benchmarks/results/gpu_check.md); a real timeout's dump needs 2 GPUs.

Where the ring is empty (a backend that does not record, or a buffer set to 0), records carry no collective
(`source` None) and the verdict rests on the ranks' stacks and steps.
"""
from __future__ import annotations

import json
import os

from .hang import FR_SOURCE, collective_summary, fr_entry

VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # current name first
ENTRIES = 2000  # the ring's bound (torch 2.13's own default): ~0.5 MB of entries
KEEP = 32  # entries a record carries (the newest)


DUMP_ON_TIMEOUT, DUMP_FILES = "TORCH_NCCL_DUMP_ON_TIMEOUT", ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
TIMING = ("TORCH_NCCL_ENABLE_TIMING", "NCCL_ENABLE_TIMING")  # current name first


def record_by_default() -> None:
    """Turn torch's flight recorder on with a bounded ring where the user set neither variable (and NCCL's dump on
    a timeout and its collective timing where the user left them unset)."""
    if not any(name in os.environ for name in VARIABLES):
        os.environ[VARIABLES[0]] = str(ENTRIES)
    os.environ.setdefault(DUMP_ON_TIMEOUT, "1")
    if not any(name in os.environ for name in TIMING):
        os.environ[TIMING[0]] = "1"


def ring_off() -> str | None:
    """Why torch's ring records nothing in this process, where the environment says so (else None)."""
    name = next((n for n in VARIABLES if n in os.environ), None)
    if name is not None and os.environ[name].strip() == "0":
        return f"{name}=0: torch's flight recorder is off, so hang records carry no collectives (stacks and steps only)"
    return None


def dump_into(folder) -> None:
    """NCCL's dump on a timeout goes to `folder/torch_fr_rank_<rank>` where the user named no file (CUDA runs only:
    the folder is made now, as torch does not make it)."""
    import torch

    if torch.cuda.is_available() and not any(name in os.environ for name in DUMP_FILES):
        folder.mkdir(parents=True, exist_ok=True)
        os.environ[DUMP_FILES[0]] = str(folder / "torch_fr_rank_")


DUMPERS = ("_dump_nccl_trace_json", "_dump_fr_trace_json")  # NCCL's ring (CUDA builds), the other backends'


def ring_entries(c10d=None) -> list[dict]:
    """Every entry of torch's flight-recorder rings, in their JSON form, oldest first (by creation time); an entry
    two dumpers both return (a build where one name aliases the other) once. `c10d`: torch's `_distributed_c10d`."""
    if c10d is None:
        from torch._C import _distributed_c10d as c10d
    entries, seen = [], set()
    for name in DUMPERS:
        dump = getattr(c10d, name, None)
        for entry in (json.loads(dump(True, False)).get("entries") or []) if dump else []:
            key = (entry.get("profiling_name"), entry.get("record_id"), entry.get("time_created_ns"),
                   str(entry.get("process_group")))
            if key not in seen:
                seen.add(key)
                entries.append(entry)
    return sorted(entries, key=lambda e: e.get("time_created_ns", 0))


def recent(keep: int = KEEP) -> dict:
    """{source, last_completed, pending} from the newest `keep` entries of torch's rings (source None: empty)."""
    entries = [fr_entry(e) for e in ring_entries()[-keep:]]
    return collective_summary(entries, FR_SOURCE)
