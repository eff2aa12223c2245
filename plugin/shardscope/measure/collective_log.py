"""The collectives this rank issued last, for the hang records: torch's flight recorder, on by default.

torch 2.13 records every collective of ProcessGroupGloo and ProcessGroupNCCL in one ring per process (its
`FlightRecorder`): kind, sequence number per process group, tensor sizes and dtypes, and whether the work
completed. The ring's size is read once, when the first process group is created, from `TORCH_FR_BUFFER_SIZE`
(or the deprecated `TORCH_NCCL_TRACE_BUFFER_SIZE`; the new name wins), 2,000 entries when neither is set on this
torch; older releases default to 0 (off). `record_by_default` sets the new name to `ENTRIES` where the user set
neither, so the recorder is on whatever the release; it must run before the process group exists: at the import
of the profiler (and so of the callback) and at the recipes' start; a process group created before that keeps its
setting. `recent()` reads the ring in its JSON form (`_dump_fr_trace_json`, no pickle) from any thread, while the
training thread waits inside a collective.

On NCCL, torch's own watchdog can dump the ring when a collective times out (`TORCH_NCCL_DUMP_ON_TIMEOUT`, read at
the process group's creation; it needs the ring on): `record_by_default` turns it on where unset, and
`dump_into(folder)` points the dump (`TORCH_FR_DUMP_TEMP_FILE`, read when torch writes it) into the run's hang
folder, where `shardscope hang` reads it as a weights-only pickle. `record_by_default` also turns NCCL's timing of
each collective on where unset (`TORCH_NCCL_ENABLE_TIMING`: a start event beside the end event NCCL records anyway;
torch notes that querying it can add to a watchdog hang): the ring's `duration_ms` is what a CUDA rank's compute
time subtracts (`cuda_compute.py`). Not exercised here: no NCCL on CPU.

Where the ring is empty (a backend that does not record, or a buffer set to 0), records carry no collective
(`source` None) and the verdict rests on the ranks' stacks and steps.
"""
from __future__ import annotations

import json
import os

from ..hang import FR_SOURCE, collective_summary, fr_entry

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


def recent(keep: int = KEEP) -> dict:
    """{source, last_completed, pending} from the newest `keep` entries of torch's ring (source None: empty)."""
    from torch._C import _distributed_c10d

    dump = json.loads(_distributed_c10d._dump_fr_trace_json(True, False))
    entries = [fr_entry(e) for e in (dump.get("entries") or [])[-keep:]]
    return collective_summary(entries, FR_SOURCE)
