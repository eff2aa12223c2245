"""What must be equal on every node, read on this process, and the differences across nodes or ranks.

The variables and library versions are doctor's cluster fingerprint (`doctor/cluster.py`'s `fingerprint_values`);
this adds what only a process on the node can see: Python, peft, CUDA, NCCL, the GPUs and the driver, and
every `*_SOCKET_IFNAME` variable (NCCL's and gloo's are already there; TP_SOCKET_IFNAME and the like too)."""
from __future__ import annotations

import os
import platform
import socket
from collections import Counter
from importlib import metadata
from pathlib import Path

from ..doctor.cluster import fingerprint_values

UNSET = "(unset)"
NOT_COMPARED = ("host",)  # differs on every node by design
DRIVER_FILE = Path("/proc/driver/nvidia/version")


def collect(device=None, env=os.environ) -> dict[str, str]:
    """This process's fingerprint, every value a string; `device` is the GPU this process uses (None: the first)."""
    import torch

    values = {"host": socket.gethostname(), "python": platform.python_version(), **fingerprint_values(env)}
    values.update({name: env[name] for name in env if name.endswith("_SOCKET_IFNAME")})
    try:
        values["peft"] = metadata.version("peft")
    except metadata.PackageNotFoundError:
        pass
    values["cuda"] = torch.version.cuda or "none (CPU build)"
    if torch.cuda.is_available():
        index = torch.cuda.current_device() if device is None else torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        values.update({"backend": "nccl", "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                       "gpu": props.name, "gpu_memory": f"{props.total_memory / 2 ** 30:.1f} GiB",
                       "gpu_count": str(torch.cuda.device_count()), "driver": driver_version()})
    else:
        values.update({"backend": "gloo", "gpu_count": "0"})
    return values


def driver_version() -> str:
    """The NVIDIA kernel driver's version from /proc (no nvidia-smi needed), or 'unknown'."""
    try:
        words = DRIVER_FILE.read_text().split()
    except OSError:
        return "unknown"
    return next((w for w in words if w.count(".") >= 1 and w.replace(".", "").isdigit()), "unknown")


def differences(prints: dict[int, dict[str, str]], who: str = "node", where=None) -> list[dict]:
    """One finding per key whose value is not the same everywhere: the key, the odd members, the majority value
    (on a tie, the value of the lowest-numbered member). `where(member)` adds e.g. a rank's node to its name."""
    found = []
    keys = sorted({k for values in prints.values() for k in values} - set(NOT_COMPARED))
    for key in keys:
        seen = {member: values.get(key, UNSET) for member, values in sorted(prints.items())}
        if len(set(seen.values())) < 2:
            continue
        counts = Counter(seen.values())
        order = list(dict.fromkeys(seen.values()))  # first seen first: the tie-break
        majority = max(order, key=lambda value: (counts[value], -order.index(value)))
        odd = [member for member, value in seen.items() if value != majority]
        named = ", ".join(f"{who} {m}{where(m) if where else ''} has {seen[m]!r}" for m in odd)
        found.append({"code": "fingerprint", "key": key, who + "s": odd,
                      "values": {str(m): seen[m] for m in odd}, "majority": majority,
                      "message": f"{key} differs: {named}; the majority ({counts[majority]} of {len(seen)}) has "
                                 f"{majority!r}"})
    return found
