"""A cache of what `shardscope plan --model NAME` counts from a config (the `ModelSpec`, the step traces, the
`--dry-run` rows), so later runs import neither torch nor transformers (issue 15: transformers' config and
modeling imports are most of the start-up).

One JSON file per key in `SHARDSCOPE_CACHE` (a folder; `off` turns the cache off), by default
`$XDG_CACHE_HOME/shardscope/specs` (`~/.cache/...`). A key hashes the config.json bytes, the installed torch
and transformers versions (and peft's, for LoRA traces), the source of the module that computes the value, and whatever else the value
depends on, so a change to any of them is a miss. Files are written atomically and read with safe_io's
bounded JSON reader (never unpickled); a file that cannot be read, parsed or written is a miss, never an error.
"""
from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

from ..errors import UsageError
from ..safe_io import atomic_write_text, load_json

ENV = "SHARDSCOPE_CACHE"
LIBRARIES = ("torch", "transformers")  # whose versions every key includes
PACKAGE = Path(__file__).parents[1]  # module files are named from the package root ("model/spec.py")


def cache_dir() -> Path | None:
    """The cache folder, or None when `SHARDSCOPE_CACHE=off`."""
    chosen = os.environ.get(ENV, "").strip()
    if chosen.lower() in ("off", "0", "no", "false"):
        return None
    if chosen:
        return Path(os.path.expanduser(chosen))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(os.path.expanduser(base)) / "shardscope" / "specs"


def cache_key(config_bytes: bytes, module: str | tuple, *parts: str, libraries: tuple = LIBRARIES) -> str | None:
    """The key of what `module` (a file of this package from its root, e.g. "model/spec.py", or a tuple of the files it runs)
    computes from a config.json's bytes and `parts`, under this install's versions of `libraries` (None: one of
    them not installed)."""
    try:
        versions = " ".join(f"{library} {metadata.version(library)}" for library in libraries)
        code = b"".join((PACKAGE / name).read_bytes() for name in ((module,) if isinstance(module, str) else module))
    except (metadata.PackageNotFoundError, OSError):
        return None
    digest = hashlib.sha256()
    for part in (config_bytes, versions.encode(), code, *(p.encode() for p in parts)):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()


def load(key: str):
    """The cached value for `key` (parsed JSON), or None on a miss or an unusable file."""
    folder = cache_dir()
    path = folder / f"{key}.json" if folder else None
    if path is None or not path.is_file():
        return None
    try:
        return load_json(path, "spec cache")
    except UsageError:
        return None


def store(key: str, value) -> None:
    """Write `value` (JSON) for `key`; a folder that cannot be made or written leaves the run uncached."""
    folder = cache_dir()
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / f"{key}.json", json.dumps(value), "spec cache")
    except (OSError, UsageError):
        pass
