"""A recipe script's argument dataclasses, read from its source without running it (`shardscope doctor -- recipe.py`).

Only what `HfArgumentParser` needs is rebuilt from each top-level `@dataclass` class: field names, simple types
(int, float, str, bool, `X | None`, `Optional[X]`, `list[X]`) and literal defaults (`= 3`, `field(default=3)`,
`field(default_factory=lambda: [...])`). Anything else (a computed default, another type) becomes an optional
string. The TrainingArguments class is the one the script imports from shardscope (trusted package code), else
transformers' own; a dataclass deriving from it adds its fields to it.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import importlib
import typing
from pathlib import Path

from ..errors import UsageError
from ..safe_io import read_text

SIMPLE = {"int": int, "float": float, "str": str, "bool": bool}


def recipe_dataclasses(script: Path) -> tuple[list[type], type]:
    """(the script's own argument dataclasses, its TrainingArguments class)."""
    from transformers import TrainingArguments

    try:
        tree = ast.parse(read_text(script, "recipe"), filename=str(script))
    except (SyntaxError, ValueError, RecursionError) as error:
        raise UsageError(f"recipe {script}: not a Python script ({type(error).__name__}: {error})") from None
    training, imported = TrainingArguments, {}
    for node in tree.body:  # `from shardscope.x import A, B`: shardscope's own classes may be used
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "shardscope":
            try:
                module = importlib.import_module(node.module)
            except ImportError:
                continue
            for alias in node.names:
                value = getattr(module, alias.name, None)
                imported[alias.asname or alias.name] = value
                if isinstance(value, type) and issubclass(value, training):
                    training = value
    script_types = []
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and any(_name(d) == "dataclass" for d in node.decorator_list)):
            continue
        fields = [_field(stmt) for stmt in node.body
                  if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)]
        bases = [imported.get(_name(b)) for b in node.bases]
        try:
            if any(isinstance(b, type) and issubclass(b, TrainingArguments) for b in bases):
                training = dataclasses.make_dataclass(node.name, fields, bases=(training,))
            else:
                script_types.append(dataclasses.make_dataclass(node.name, fields))
        except (TypeError, ValueError) as error:
            raise UsageError(f"recipe {script}: class {node.name}: {error}") from None
    return script_types, training


def _name(node) -> str:
    """`dataclass`, `dataclasses.dataclass`, `dataclass(...)` -> "dataclass"; a Name/Attribute's last part."""
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _type(node):
    """A simple annotation's type, or None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(node, ast.Name):
        return SIMPLE.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # X | None
        parts = [p for p in (node.left, node.right) if not (isinstance(p, ast.Constant) and p.value is None)]
        inner = _type(parts[0]) if len(parts) == 1 else None
        return typing.Optional[inner] if inner else None
    if isinstance(node, ast.Subscript) and _name(node.value) in ("Optional", "list", "List"):
        inner = _type(node.slice)
        if inner is None:
            return None
        return typing.Optional[inner] if _name(node.value) == "Optional" else list[inner]
    return None


def _field(stmt: ast.AnnAssign):
    """(name, type, dataclasses.field) for one annotated class attribute."""
    name, kind, value, help_text = stmt.target.id, _type(stmt.annotation), stmt.value, ""
    if isinstance(value, ast.Call) and _name(value) == "field":
        keywords = {k.arg: k.value for k in value.keywords}
        help_text = _literal(_dict_get(keywords.get("metadata"), "help"), "")
        factory = keywords.get("default_factory")
        value = factory.body if isinstance(factory, ast.Lambda) else keywords.get("default", factory)
    default = dataclasses.MISSING if value is None else _literal(value, _MISSING)
    metadata = {"help": help_text if isinstance(help_text, str) else ""}
    if default is _MISSING or kind is None:  # a computed default or another type: accept any text
        return name, typing.Optional[str], dataclasses.field(default=None, metadata=metadata)
    if isinstance(default, (list, dict, set)):
        return name, kind, dataclasses.field(default_factory=functools.partial(copy.deepcopy, default),
                                             metadata=metadata)
    return name, kind, dataclasses.field(default=default, metadata=metadata)


_MISSING = object()


def _literal(node, fallback):
    try:
        return ast.literal_eval(node) if node is not None else fallback
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return fallback


def _dict_get(node, key: str):
    if isinstance(node, ast.Dict):
        for k, v in zip(node.keys, node.values):
            if isinstance(k, ast.Constant) and k.value == key:
                return v
    return None
