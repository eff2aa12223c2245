"""doctor's findings: the `Finding` record, every rule's code and level, and reading a config file.

Levels: "error" (the run stops, or trains/saves something other than asked), "warning" (a value the
libraries silently ignore or override: very likely a mistake), "notice" (legal and deliberate-looking,
but it costs something the user may not know: printed, never fails the check). `doctor` exits 1 when
any error or warning is found, 0 when only notices are. docs/doctor.md has the table with each rule's
source.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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
    "processes": "error",
    "multinode": "error",
    "placeholder": "warning",
    "unresolved-host": "notice",
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
    """A config file's top-level mapping, or {} when unreadable (the library loaders report why)."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except Exception:
        return {}
    return data if isinstance(data, dict) else {}


def get(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def as_int(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def is_true(value) -> bool:
    return str(value).strip().lower() == "true"
