"""doctor's findings: the `Finding` record, every rule's code and level, and reading a config file.

Levels: "error" (the run stops, or trains/saves something other than asked), "warning" (a value the
libraries silently ignore or override: very likely a mistake), "notice" (legal and deliberate-looking,
but it costs something the user may not know: printed, never fails the check). `doctor` exits 1 when
any error or warning is found, 0 when only notices are. docs/doctor.md has the table with each rule's
source.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..configs.accelerate import accelerate_sections
from ..configs.deepspeed import DEEPSPEED_SECTIONS
from ..configs.files import not_mappings
from ..errors import UsageError
from ..safe_io import load_data

RULES = {  # code -> level
    "config": "error",           # the library's own loader rejects the file
    "ignored-key": "warning",    # the library loads the file but ignores this key
    "ds-mismatch": "error",      # DeepSpeed value vs Trainer argument: the Trainer stops
    "ds-string": "warning",
    "ds-ignored": "warning",
    "zero3-save": "warning",
    "fsdp-key": "warning",
    "wrap-class": "error",
    "default-config": "warning",
    "no-fit": "error",
    "precision": "warning",
    "fp16-cpu": "error",         # fp16 asked on CPU under DDP/FSDP: trains plain fp32 (doctor_precision)
    "offload": "error",
    "silent-offload": "notice",
    "tp-degree": "error",
    "tp-experts": "notice",      # an MoE whose TP plan splits no expert (gpt-oss): every TP rank holds them whole
    "processes": "error",
    "multinode": "error",
    "placeholder": "warning",
    "unresolved-host": "notice",
    "hostfile": "error",         # DeepSpeed refuses the hostfile, or its hosts/slots are not the nodes/GPUs
    "hostfile-ssh": "notice",    # `deepspeed --hostfile` needs ssh (and pdsh for several hosts) from here
    "master-env": "warning",     # MASTER_ADDR/MASTER_PORT exported here, ignored for the yaml's values
    "net-interface": "notice",   # NCCL_/GLOO_SOCKET_IFNAME names no interface of this machine
    "resume-world-size": "error",  # a ZeRO checkpoint resumed at another world size (checkpoint.resume)
    "sequence-split": "error",   # a cp/sp split its strategy, model, sequence, attention or world cannot run
    "sp-backend": "warning",     # sp_size without sp_backend: deepspeed
    "sequence-data": "warning",  # the batches are not what the sequence split is told they are
    "qlora-frozen": "error",     # a quantised base with no LoRA adapters: nothing trains (doctor/qlora.py)
    "qlora-strategy": "error",   # a quantised base under a strategy that cannot shard it (TP; 8-bit under FSDP/ZeRO-3)
    "qlora-quant-storage": "error",  # FSDP/ZeRO-3 with 4-bit weights stored in another dtype than the rest
}
LEVELS = ("error", "warning", "notice")


@dataclass(frozen=True)
class Finding:
    code: str
    file: str
    key: str
    problem: str
    fix: str

    @property
    def level(self) -> str:
        return RULES[self.code]

    def __str__(self) -> str:
        return f"{self.file}: {self.key}: {self.problem}\n    fix: {self.fix}"


def failing(findings: list[Finding]) -> list[Finding]:
    """The findings that make a check fail (errors and warnings; notices do not)."""
    return [f for f in findings if f.level != "notice"]


def read_raw(path) -> dict:
    """A config file's top-level mapping ({} for another top level), read by safe_io's bounded loaders: a file
    that cannot be read or parsed is unusable input (UsageError, exit 2), never a finding."""
    data = load_data(path)
    return data if isinstance(data, dict) else {}


def read_checked(path, kind: str) -> dict:
    """`read_raw`, refusing (exit 2) a top level or a section (zero_optimization, fsdp_config, ...) that is not a
    mapping: the rules and the libraries read keys from them."""
    data = load_data(path)
    if not isinstance(data, dict):
        raise UsageError(f"{path}: the top level must be a mapping, not {type(data).__name__}")
    sections = accelerate_sections() if kind == "accelerate" else DEEPSPEED_SECTIONS if kind == "deepspeed" else ()
    problems = not_mappings(data, sections)
    if problems:
        raise UsageError(f"{path}: {problems[0]}")
    return data


def get(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def is_true(value) -> bool:
    return str(value).strip().lower() == "true"
