"""doctor's multi-node rules: the DeepSpeed hostfile, the launcher's environment, and a fingerprint to compare
across nodes. Sources: DeepSpeed `launcher/runner.py` (`fetch_hostfile`, the ssh check, `--no_ssh`,
`apply_num_nodes_and_gpus`), accelerate `utils/launch.py` (`prepare_deepspeed_cmd_env`: `--hostfile`,
`--num_gpus` = num_processes // num_machines, no `--num_nodes`; `prepare_multi_gpu_env`: MASTER_ADDR/PORT
from main_process_ip/port), NCCL's and gloo's `*_SOCKET_IFNAME` variables."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
from importlib import metadata
from pathlib import Path

from .doctor_rules import Finding, read_raw
from .safe_io import read_bytes, read_text
from .units import as_int

SSH_LAUNCHERS = {"pdsh": "pdsh", "openmpi": "mpirun", "mvapich": "mpirun", "mpich": "mpirun", "impi": "mpirun",
                 "slurm": "srun"}  # DeepSpeed launcher -> the program it needs on the launching node
INTERFACE_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
FINGERPRINT_VARIABLES = ("MASTER_ADDR", "MASTER_PORT")
FINGERPRINT_PREFIXES = ("NCCL_", "GLOO_")
LIBRARIES = ("torch", "transformers", "accelerate", "deepspeed")


def yaml_hostfile(acc: dict | None) -> Path | None:
    """The hostfile an accelerate DEEPSPEED yaml hands to the `deepspeed` launcher, when it uses one."""
    section = (acc or {}).get("deepspeed_config") or {}
    if (acc or {}).get("distributed_type") != "DEEPSPEED" or not section.get("deepspeed_hostfile"):
        return None
    if str(section.get("deepspeed_multinode_launcher", "pdsh")).lower() == "standard":
        return None  # torchrun on each node: the hostfile is not read
    return Path(str(section["deepspeed_hostfile"]))


def read_hostfile(path: Path) -> tuple[dict[str, int] | None, list[Finding]]:
    """(host -> slots, findings) with DeepSpeed's own parser; a file DeepSpeed refuses is a `hostfile` error."""
    read_text(path, "hostfile")  # a regular, bounded UTF-8 file before DeepSpeed opens it (else exit 2)
    from deepspeed.launcher.runner import fetch_hostfile

    quiet = logging.getLogger("DeepSpeed")
    was, quiet.disabled = quiet.disabled, True  # it logs the whole file before raising
    try:
        return dict(fetch_hostfile(str(path)) or {}), []
    except ValueError as error:
        return None, [Finding("hostfile", str(path), "-", f"DeepSpeed refuses it: {error}",
                              "one line per node: HOST slots=GPUS, each host once")]
    finally:
        quiet.disabled = was


def check_hostfile(path: Path, hosts: dict[str, int], gpus: int | None, nodes: int, acc: dict | None,
                   launcher: str) -> list[Finding]:
    """Hosts against the nodes, slots against the GPUs per node, and what the launcher needs to reach them."""
    found, file = [], str(path)
    machines = as_int((acc or {}).get("num_machines")) if acc else None
    want = machines if machines and machines > 1 else nodes if nodes > 1 else None
    if want and len(hosts) != want:
        found.append(Finding("hostfile", file, "hosts", f"{len(hosts)} host(s) ({', '.join(hosts)}) but "
                             f"{'num_machines' if machines and machines > 1 else '--nodes'} {want}: `deepspeed` "
                             "starts ranks on every host in the file (accelerate passes no --num_nodes)",
                             f"list exactly {want} hosts"))
    if gpus:
        for host, slots in hosts.items():
            if slots != gpus:
                found.append(Finding("hostfile", file, host, f"slots={slots} but --gpus {gpus}: `deepspeed "
                                     f"--hostfile` starts {slots} rank(s) there, "
                                     + ("more than its GPUs" if slots > gpus else "leaving GPUs idle"),
                                     f"write: {host} slots={gpus}"))
    needed = ["ssh"] + ([SSH_LAUNCHERS.get(launcher, launcher)] if len(hosts) > 1 else [])
    missing = [program for program in needed if not shutil.which(program)]
    if launcher != "nossh" and missing:
        first = next(iter(hosts))
        then = f", then starts each host through {launcher}" if len(hosts) > 1 else ""
        found.append(Finding("hostfile-ssh", file, "hosts", f"with a hostfile `deepspeed` first checks passwordless "
                             f"ssh to {first} (even for one host){then}; {' and '.join(missing)} not found on this "
                             "machine",
                             "launch from a node that has them, or start one launcher per node: deepspeed "
                             f"--hostfile {file} --no_ssh --node_rank N --master_addr FIRST_NODE_IP --master_port "
                             "29500 ... (accelerate yaml: deepspeed_multinode_launcher: nossh)"))
    return found


def check_master_env(file: str, raw: dict, env=os.environ) -> list[Finding]:
    """A multi-node yaml filled in for a cluster (main_process_ip not loopback: the shipped yamls' 127.0.0.1 is
    meant to be overridden on the command line) beside MASTER_ADDR/MASTER_PORT exported here: accelerate
    passes the yaml's values (or its command line's) to torchrun, so the exported ones are silently ignored."""
    ip = str(raw.get("main_process_ip") or "").strip()
    if (as_int(raw.get("num_machines")) or 1) <= 1 or not ip or ip.startswith("127.") or ip == "localhost":
        return []
    found = []
    for variable, key in (("MASTER_ADDR", "main_process_ip"), ("MASTER_PORT", "main_process_port")):
        mine, theirs = str(env.get(variable, "")).strip(), str(raw.get(key) or "").strip()
        if mine and theirs and mine != theirs:
            found.append(Finding("master-env", file, key, f"{theirs} here but {variable}={mine} in this environment: "
                                 f"accelerate launch uses the yaml's value (or --{key} on its command line) and "
                                 f"ignores {variable}", f"make them agree, e.g. --{key} ${variable} on every node"))
    return found


def check_interfaces(env=os.environ) -> list[Finding]:
    """NCCL_SOCKET_IFNAME (prefixes; `=NAME` exact; `^...` excludes) and GLOO_SOCKET_IFNAME (exact names)
    naming no interface of this machine: the collectives cannot start here."""
    try:
        present = [name for _, name in socket.if_nameindex()]
    except OSError:
        return []
    found = []
    for variable in INTERFACE_VARIABLES:
        value = str(env.get(variable, "")).strip()
        if not value or value.startswith("^"):
            continue
        for name in filter(None, (n.strip() for n in value.split(","))):
            exact = variable == "GLOO_SOCKET_IFNAME" or name.startswith("=")
            wanted = name.lstrip("=")
            if not any(p == wanted if exact else p.startswith(wanted) for p in present):
                found.append(Finding("net-interface", f"${variable}", variable, f"{name!r} matches no network "
                                     f"interface of this machine ({', '.join(present)}); fine if this is not a node "
                                     "of the cluster", "set it to the interface the nodes reach each other on "
                                     "(ip -brief address on a node)"))
    return found


def fingerprint(files: list[Path], env=os.environ) -> str:
    """A short hash of what must be equal on every node: each config file (an accelerate yaml without
    machine_rank, which differs per node), the NCCL_*/GLOO_*/MASTER_* variables and the library versions."""
    digest = hashlib.sha256()
    for path in files:
        if path.suffix in (".yaml", ".yml"):
            raw = {k: v for k, v in read_raw(path).items() if k != "machine_rank"}
            digest.update(json.dumps(raw, sort_keys=True, default=str).encode())
        else:
            digest.update(read_bytes(path, "config"))
    digest.update(json.dumps(fingerprint_values(env), sort_keys=True).encode())
    return digest.hexdigest()[:12]


def fingerprint_values(env=os.environ) -> dict[str, str]:
    """The NCCL_*/GLOO_*/MASTER_* variables (by name) and library versions (by library) `fingerprint` hashes;
    `shardscope preflight` compares them key by key across nodes."""
    values = {name: env[name] for name in sorted(env)
              if name in FINGERPRINT_VARIABLES or name.startswith(FINGERPRINT_PREFIXES)}
    for library in LIBRARIES:
        try:
            values[library] = metadata.version(library)
        except metadata.PackageNotFoundError:
            pass
    return values


def cluster_checks(acc_path: Path | None, acc: dict | None, hostfile: Path | None, files: list[Path],
                   gpus: int | None, nodes: int, environment: bool) -> tuple[list[Finding], list[str], list[str]]:
    """(findings, notes, checks ran): the hostfile (given, or named by a DEEPSPEED yaml), this machine's
    launcher environment (`environment`), and on a multi-node setup the fingerprint to compare across nodes."""
    findings, notes, ran = [], [], []
    named = yaml_hostfile(acc)
    if hostfile is None and named is not None:
        if named.is_file():
            hostfile = named
        else:
            notes.append(f"hostfile {named} (deepspeed_config.deepspeed_hostfile) not found here: not checked")
    hosts = None
    if hostfile is not None:
        ran.append("DeepSpeed hostfile")
        hosts, findings = read_hostfile(hostfile)
        if hosts:  # the yaml's launcher when the yaml hands this hostfile on, else `deepspeed`'s default
            section = (acc or {}).get("deepspeed_config") or {} if named == hostfile else {}
            launcher = str(section.get("deepspeed_multinode_launcher") or "pdsh")
            findings += check_hostfile(hostfile, hosts, gpus, nodes, acc, launcher.lower())
    if environment:
        findings += check_interfaces() + (check_master_env(str(acc_path), acc) if acc else [])
    machines = as_int((acc or {}).get("num_machines")) or 1
    if nodes > 1 or machines > 1 or len(hosts or {}) > 1:
        files = [p for p in (acc_path, *files, hostfile) if p is not None]
        notes.append(f"multi-node fingerprint {fingerprint(files)} (these files, accelerate's machine_rank left "
                     "out; NCCL_*/GLOO_*/MASTER_* variables; torch/transformers/accelerate/deepspeed versions): run "
                     "this doctor command on every node, the fingerprints must match")
    return findings, notes, ran
