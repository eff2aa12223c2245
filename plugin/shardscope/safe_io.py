"""Reading files a user hands us, and writing our own outputs, without hanging, exploding or half-writing.

- `read_bytes` / `read_text`: regular files only (a FIFO, device or socket is refused, never opened for a
  blocking read), a size cap, UTF-8 checked; every problem is one `UsageError` line naming the file.
- `load_json` / `load_yaml` / `load_data`: bounded parsing. Nesting deeper than `MAX_DEPTH`, YAML aliases that
  would expand past `MAX_NODES` nodes (anchor bombs), NaN/Infinity and integers past 64 bits are refused.
- `atomic_write_bytes` / `atomic_write_text`: a temporary file beside the target, renamed over it, with
  ordinary (umask) permissions: a killed writer leaves the old file or the new one, never a half.
  `ordinary_permissions`: the same permissions for a folder staged before its rename (exported models).
"""
from __future__ import annotations

import json
import math
import os
import secrets
import stat
from pathlib import Path

from .errors import UsageError

MAX_TEXT_BYTES = 4 << 20  # configs, recipe YAML and summaries are kilobytes
MAX_DEPTH = 64            # nesting levels (real configs use fewer than 10)
MAX_NODES = 1_000_000     # values after YAML aliases are expanded
MAX_INT = 2 ** 64


def read_bytes(path, what: str = "", max_bytes: int = MAX_TEXT_BYTES, tail: bool = False) -> bytes:
    """The bytes of a regular file of at most `max_bytes` (`tail`: its last `max_bytes`, for logs);
    errors read "WHAT PATH: problem"."""
    path, label = Path(path), f"{what} {path}".strip()
    try:  # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then tells what was opened
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise UsageError(f"{label}: no such file{' (a dangling symlink)' if path.is_symlink() else ''}") from None
    except IsADirectoryError:
        raise UsageError(f"{label}: a folder, not a file") from None
    except OSError as error:
        raise UsageError(f"{label}: cannot be opened ({error.strerror})") from None
    info = os.fstat(fd)
    problem = ("a folder, not a file" if stat.S_ISDIR(info.st_mode) else
               "not a regular file (a FIFO, device or socket)" if not stat.S_ISREG(info.st_mode) else
               f"{info.st_size:,} bytes, more than the {max_bytes:,} this reads" if info.st_size > max_bytes
               and not tail else None)
    if problem:
        os.close(fd)
        raise UsageError(f"{label}: {problem}")
    with os.fdopen(fd, "rb") as file:
        file.seek(max(0, info.st_size - max_bytes) if tail else 0)
        data = file.read(max_bytes if tail else max_bytes + 1)
    if len(data) > max_bytes:
        raise UsageError(f"{label}: more than the {max_bytes:,} bytes this reads")
    return data


def read_text(path, what: str = "", max_bytes: int = MAX_TEXT_BYTES) -> str:
    """A regular UTF-8 text file (a leading BOM is dropped); binary files are refused."""
    data, label = read_bytes(path, what, max_bytes), f"{what} {path}".strip()
    if b"\0" in data:
        raise UsageError(f"{label}: a binary file (NUL byte at offset {data.index(0)}), not text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise UsageError(f"{label}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start})") from None


# ----------------------------------------------------------------------------- bounded parsing


def parse_json(text: str, where: str):
    """`json.loads` with NaN/Infinity refused and nesting, integers bounded; errors name `where`:LINE:COL."""
    def no_constant(name):
        raise ValueError(f"{name} is not a JSON number")

    try:
        data = json.loads(text, parse_constant=no_constant)
    except json.JSONDecodeError as error:
        raise UsageError(f"{where}:{error.lineno}:{error.colno}: malformed JSON: {error.msg}") from None
    except RecursionError:
        raise UsageError(f"{where}: nested too deeply (more than {MAX_DEPTH} levels)") from None
    except ValueError as error:  # NaN/Infinity, or an integer beyond Python's digit limit
        raise UsageError(f"{where}: malformed JSON: {str(error).splitlines()[0]}") from None
    _check_tree(data, where)
    return data


def parse_yaml(text: str, where: str):
    """YAML's safe loader, refusing documents whose aliases expand past `MAX_NODES` before building them."""
    import yaml

    loader = None
    try:
        loader = yaml.SafeLoader(text)  # its reader refuses control characters here
        node = loader.get_single_node()
        if node is None:
            return None
        _check_node_graph(node, where)
        data = loader.construct_document(node)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark else where
        problem = str(getattr(error, "problem", None) or error).strip().splitlines() or [type(error).__name__]
        raise UsageError(f"{at}: malformed YAML: {problem[0]}") from None
    except RecursionError:
        raise UsageError(f"{where}: nested too deeply (more than {MAX_DEPTH} levels)") from None
    finally:
        if loader is not None:
            loader.dispose()
    _check_tree(data, where)
    return data


def load_json(path, what: str = "", max_bytes: int = MAX_TEXT_BYTES):
    return parse_json(read_text(path, what, max_bytes), f"{what} {path}".strip())


def load_yaml(path, what: str = "", max_bytes: int = MAX_TEXT_BYTES):
    return parse_yaml(read_text(path, what, max_bytes), f"{what} {path}".strip())


def load_data(path, what: str = "", max_bytes: int = MAX_TEXT_BYTES):
    """JSON or YAML by the file's suffix (.yaml/.yml: YAML, anything else: JSON)."""
    load = load_yaml if Path(path).suffix in (".yaml", ".yml") else load_json
    return load(path, what, max_bytes)


def _check_node_graph(root, where: str) -> None:
    """Size and depth of a composed YAML document as if every alias were copied out (memoised, so a bomb
    costs as much as its text); a recursive alias is refused."""
    import yaml

    def children(node):
        if isinstance(node, yaml.SequenceNode):
            return node.value
        if isinstance(node, yaml.MappingNode):
            return [part for pair in node.value for part in pair]
        return []

    done: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, depth)
    open_ids, stack = set(), [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            open_ids.discard(id(node))
            parts = [done[id(c)] for c in children(node)]
            size, depth = 1 + sum(s for s, _ in parts), 1 + max((d for _, d in parts), default=0)
            if size > MAX_NODES:
                raise UsageError(f"{where}: its aliases expand to more than {MAX_NODES:,} values (a YAML anchor "
                                 "bomb?); write the values out")
            if depth > MAX_DEPTH:
                raise UsageError(f"{where}: nested too deeply (more than {MAX_DEPTH} levels)")
            done[id(node)] = size, depth
        elif id(node) in open_ids:
            raise UsageError(f"{where}: a YAML alias refers to a value that contains it (recursive)")
        elif id(node) not in done:
            open_ids.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children(node))


def _check_tree(data, where: str) -> None:
    """Depth, integer size and finiteness of parsed data (YAML's .inf/.nan included)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise UsageError(f"{where}: nested too deeply (more than {MAX_DEPTH} levels)")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for pair in value.items() for v in pair)
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{where}: {value} is not a usable number")
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= MAX_INT:
            raise UsageError(f"{where}: the integer {str(value)[:20]}... ({len(str(abs(value)))} digits) is too large")


# ----------------------------------------------------------------------------- atomic writes


def writable_target(path, what: str = "output") -> Path:
    """Where writing `path` lands: a symlink is followed; a dangling one, a folder or a missing parent is refused."""
    path = Path(path)
    if path.is_symlink():
        if not path.exists():
            raise UsageError(f"{what} {path}: a dangling symlink (to '{os.readlink(path)}'); remove it or choose "
                             "another path")
        path = Path(os.path.realpath(path))
    if path.is_dir():
        raise UsageError(f"{what} {path}: a folder; give a file path")
    if path.exists() and not path.is_file():
        raise UsageError(f"{what} {path}: not a regular file (a FIFO, device or socket)")
    if not path.parent.is_dir():
        raise UsageError(f"{what} {path}: folder '{path.parent}' does not exist")
    return path


def atomic_write_bytes(path, data: bytes, what: str = "output") -> Path:
    """Write `data` to a temporary file beside `path`, then rename it over `path`; returns the path written."""
    target = writable_target(path, what)
    temp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask decides, as for any file
    except OSError as error:
        raise UsageError(f"{what} {target}: cannot be written ({error.strerror})") from None
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, target)
    except BaseException as error:
        temp.unlink(missing_ok=True)
        if isinstance(error, OSError):  # disk full, quota, a folder made read-only meanwhile
            raise UsageError(f"{what} {target}: cannot be written ({error.strerror or error})") from None
        raise
    return target


def atomic_write_text(path, text: str, what: str = "output") -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), what)


def ordinary_permissions(folder) -> None:
    """Give `folder` and everything in it the permissions a new file gets here (0666/0777 less the umask)."""
    umask = os.umask(0o022)
    os.umask(umask)
    for path in [Path(folder), *Path(folder).rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
