"""doctor's launcher rules: what `accelerate launch` takes from the yaml (or its default config) before the
script runs: process counts, the multi-node rendezvous, mixed precision. Source: accelerate
`commands/launch.py` and `utils/launch.py` (`prepare_multi_gpu_env`), transformers `TrainingArguments`
(section "Mixed Precision": the Trainer's --bf16/--fp16 override ACCELERATE_MIXED_PRECISION)."""
from __future__ import annotations

import ipaddress
import os
import re
import socket
from pathlib import Path

from .rules import Finding, read_raw
from ..units import as_int

PRECISION_FLAGS = ("bf16", "fp16")
PLACEHOLDER = re.compile(r"^(x+|[x.]+|.*[<>{}$].*|your.*|ip|ip_address|host(name)?|main_node_ip|changeme)$", re.I)
EXAMPLE_PORTS = {1234}  # the port in accelerate's multi-node examples


def default_config_file() -> Path:
    """accelerate's default config location, from HF_HOME / XDG_CACHE_HOME as they are now."""
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.path.expanduser(home)) / "accelerate" / "default_config.yaml"


def check_default_config() -> list[Finding]:
    """`accelerate launch` without --config_file reads this file: a strategy in it applies silently."""
    path = default_config_file()
    if not path.is_file():
        return []
    raw = read_raw(path)
    changes = [f"{k}: {raw[k]}" for k in ("distributed_type", "mixed_precision", "num_processes", "use_cpu")
               if k in raw and str(raw[k]).upper() not in ("NO", "FALSE", "1")]
    if not changes:
        return []
    return [Finding("default-config", str(path), changes[0].split(":")[0],
                    f"accelerate launch without --config_file applies it silently ({'; '.join(changes)})",
                    f"always pass --config_file, or delete {path}")]


def check_precision(file: str, raw: dict, trainer: dict, source: str) -> list[Finding]:
    """The yaml's mixed_precision against the Trainer's flags, which win at start-up (under DeepSpeed an
    unset yaml value leaves precision to the Trainer and the DeepSpeed file)."""
    yaml_value = str(raw.get("mixed_precision") or "no").lower()
    args_value = next((f for f in PRECISION_FLAGS if trainer.get(f)), "no")
    if yaml_value == args_value or (raw.get("distributed_type") == "DEEPSPEED" and yaml_value == "no"):
        return []
    given = f"{args_value} in {source}" if args_value != "no" else f"{source} set neither --bf16 nor --fp16"
    return [Finding("precision", file, "mixed_precision", f"{yaml_value} here but {given} (the Trainer's flags "
                    "override the launcher's value at start-up)",
                    f"set mixed_precision: {args_value}, or pass --{yaml_value} to the script"
                    if yaml_value != "no" else f"set mixed_precision: {args_value}")]


def check_processes(file: str, raw: dict, gpus: int | None, nodes: int) -> list[Finding]:
    """num_processes is the total over all machines; accelerate starts num_processes / num_machines per node."""
    total, machines = as_int(raw.get("num_processes")), as_int(raw.get("num_machines")) or 1
    if total is None or total < 1:
        return []
    found = []
    if total % machines:
        found.append(Finding("processes", file, "num_processes", f"{total} over num_machines {machines} is not a "
                             "whole number per node (accelerate starts num_processes // num_machines on each)",
                             f"set num_processes to a multiple of {machines}"))
    if gpus:
        machines = max(machines, nodes)
        if total != gpus * machines:
            found.append(Finding("processes", file, "num_processes", f"{total} processes here but --gpus {gpus} x "
                                 f"{machines} node(s) = {gpus * machines} GPUs: accelerate starts {total}, "
                                 "so GPUs sit idle or ranks share a GPU", f"set num_processes: {gpus * machines}"))
        if nodes > 1 and (as_int(raw.get("num_machines")) or 1) != nodes:
            found.append(Finding("processes", file, "num_machines", f"{raw.get('num_machines', 1)} here but "
                                 f"--nodes {nodes}", f"set num_machines: {nodes}"))
    return found


def check_multinode(file: str, raw: dict) -> list[Finding]:
    """The rendezvous of a multi-node yaml: every node must reach main_process_ip:main_process_port."""
    machines = as_int(raw.get("num_machines")) or 1
    if machines <= 1:
        return []
    found = []
    rank = raw.get("machine_rank", 0)
    if as_int(rank) is None or not 0 <= as_int(rank) < machines:
        found.append(Finding("multinode", file, "machine_rank", f"{rank!r} cannot be a node rank of num_machines "
                             f"{machines} (0 to {machines - 1})", "set machine_rank: 0 and pass --machine_rank N "
                             "on node N"))
    ip = str(raw.get("main_process_ip") or "").strip()
    if not ip or ip.lower() in ("none", "null"):
        found.append(Finding("multinode", file, "main_process_ip", "empty: the other nodes have nowhere to connect",
                             "set it to the first node's address, or pass --main_process_ip"))
    elif PLACEHOLDER.match(ip):
        found.append(Finding("placeholder", file, "main_process_ip", f"{ip!r} is a placeholder, not an address",
                             "set it to the first node's address, or pass --main_process_ip on every node"))
    elif re.fullmatch(r"[\d.]+", ip):
        try:
            ipaddress.IPv4Address(ip)
        except ValueError:
            found.append(Finding("multinode", file, "main_process_ip", f"{ip!r} is not an IPv4 address",
                                 "set it to the first node's address"))
    elif not _resolves(ip):
        found.append(Finding("unresolved-host", file, "main_process_ip", f"{ip!r} does not resolve from this "
                             "machine (fine if this is not a node of the cluster)",
                             "check the name from a node, or use the first node's IP address"))
    port = raw.get("main_process_port")
    number = as_int(port)
    if port is not None and (number is None or not 1 <= number <= 65535):
        found.append(Finding("multinode", file, "main_process_port", f"{port!r} is not a TCP port (1 to 65535)",
                             "set main_process_port: 29500 (or any free port above 1024)"))
    elif number is not None and (number in EXAMPLE_PORTS or number < 1024):
        why = "the example value from the docs" if number in EXAMPLE_PORTS else "a privileged port (below 1024)"
        found.append(Finding("placeholder", file, "main_process_port", f"{number} is {why}: it must be free and "
                             "open between the nodes", "set main_process_port: 29500 (or any free port above 1024)"))
    return found


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
        return True
    except (OSError, UnicodeError):
        return False
