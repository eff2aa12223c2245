"""A cache of counted model specs, so `shardscope plan --model NAME` imports neither torch nor transformers
after the first run on a config (issue 15: transformers' config and modeling imports are most of the time).

One JSON file per key in `SHARDSCOPE_CACHE` (a folder; `off` turns the cache off), by default
`$XDG_CACHE_HOME/shardscope/specs` (`~/.cache/...`). The key hashes the config.json bytes, the installed torch
and transformers versions and the source of `model_spec.py` (the code that counts), so a change to any of
them is a miss. Files are written atomically and read with safe_io's bounded JSON reader (never unpickled);
a file that cannot be read, parsed or written is a miss, never an error.
"""
from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

from .errors import UsageError
from .safe_io import atomic_write_text, load_json

ENV = "SHARDSCOPE_CACHE"
COUNTER_SOURCE = Path(__file__).with_name("model_spec.py")


def cache_dir() -> Path | None:
    """The cache folder, or None when `SHARDSCOPE_CACHE=off`."""
    chosen = os.environ.get(ENV, "").strip()
    if chosen.lower() in ("off", "0", "no", "false"):
        return None
    if chosen:
        return Path(os.path.expanduser(chosen))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(os.path.expanduser(base)) / "shardscope" / "specs"


def spec_key(config_bytes: bytes) -> str | None:
    """The key for a config.json's bytes under this install (None: torch or transformers not installed)."""
    try:
        versions = f"torch {metadata.version('torch')} transformers {metadata.version('transformers')}"
        counter = COUNTER_SOURCE.read_bytes()
    except (metadata.PackageNotFoundError, OSError):
        return None
    digest = hashlib.sha256()
    for part in (config_bytes, versions.encode(), counter):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()


def load(key: str, fields: tuple[str, ...]) -> dict | None:
    """The cached fields for `key`, or None on a miss or an unusable file (its fields must be `fields`)."""
    folder = cache_dir()
    path = folder / f"{key}.json" if folder else None
    if path is None or not path.is_file():
        return None
    try:
        data = load_json(path, "spec cache")
    except UsageError:
        return None
    return data if isinstance(data, dict) and tuple(data) == fields else None


def store(key: str, values: dict) -> None:
    """Write `values` for `key`; a folder that cannot be made or written leaves the run uncached."""
    folder = cache_dir()
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / f"{key}.json", json.dumps(values), "spec cache")
    except (OSError, UsageError):
        pass
