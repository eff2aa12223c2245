"""Reading a config file before any library does (bounded, its parse errors naming FILE:LINE:COL), and the checks
every kind shares: keys a library never read (`ReadTracker`), numbers written as strings, sections that are not
mappings. Every problem is one line, `FILE: KEY: what is wrong` (`ConfigProblems`)."""
from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from ..safe_io import parse_json, read_text


class ConfigProblems(UsageError):
    """One or more problems in config files; `problems` holds one line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


class ReadTracker(dict):
    """A dict that records which keys its reader asked for, to find keys a library silently ignores."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def setdefault(self, key, default=None):
        self.read.add(key)
        return super().setdefault(key, default)

    def pop(self, key, *default):
        self.read.add(key)
        return super().pop(key, *default)

    def unread(self) -> list[str]:
        return sorted(k for k in self if k not in self.read and not str(k).startswith("_"))


def config_text(path: Path) -> str:
    """The file's text; missing, special, oversized, binary and non-UTF-8 files refused as `ConfigProblems`."""
    try:
        return read_text(path)
    except UsageError as error:
        raise ConfigProblems([str(error)]) from None


def parsed(path: Path, parse) -> object:
    """`parse` (safe_io's bounded JSON/YAML) of the file, its errors as `ConfigProblems` naming FILE:LINE:COL."""
    try:
        return parse(config_text(path), str(path))
    except ConfigProblems:
        raise
    except UsageError as error:
        raise ConfigProblems([str(error)]) from None


def json_object(path: Path) -> dict:
    """The file's top-level JSON object."""
    config = parsed(path, parse_json)
    if not isinstance(config, dict):
        raise ConfigProblems([f"{path}: the top level must be a JSON object, not {type(config).__name__}"])
    return config


def strings_that_should_be_values(config, prefix="") -> list[str]:
    """Keys whose value is a number or boolean written as a string (libraries compare or coerce them silently)."""
    found = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found += strings_that_should_be_values(value, name + ".")
        elif isinstance(value, str) and value != "auto" and not str(key).startswith("_"):
            if value.strip().lower() in ("true", "false") or _is_number(value):
                found.append(f"{name}: {value!r} is a string; write it without quotes (or \"auto\")")
    return found


def not_mappings(config: dict, sections) -> list[str]:
    """Dotted `sections` that are present but not mappings (libraries call .get on them and crash)."""
    found = []
    for dotted in sections:
        parent, _, key = dotted.rpartition(".")
        holder = _dig(config, parent) if parent else config
        value = holder.get(key) if isinstance(holder, dict) else None
        if value is not None and not isinstance(value, dict):
            found.append(f"{dotted}: expected a mapping of keys to values, got {value!r}")
    return found


def _dig(config, dotted: str):
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
