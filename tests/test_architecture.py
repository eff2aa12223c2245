"""The package's shape (docs/architecture.md): no import cycles, no reaching into another module's private
names, modules of one idea, and the planner's estimate in one pass."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import shardscope

PACKAGE = Path(shardscope.__file__).parent
MAX_LINES = 600


def module_name(path: Path) -> str:
    """'plan.planner' for plan/planner.py, 'plan' for plan/__init__.py, '' for the package's own __init__."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str | None:
    """The package-relative module an import names, or None for another distribution's."""
    if node.level == 0:
        name = node.module or ""
        return name[len("shardscope."):] if name.startswith("shardscope.") else "" if name == "shardscope" else None
    base = importer.split(".") if importer else []
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports() -> dict[str, set[tuple[str, str]]]:
    """Per module: (module imported, name imported) for every import of the package, lazy ones included; a name
    that is itself a module (`from . import cache`) is an edge to that module."""
    out = {}
    for name, path in MODULES.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(node, name, path.name == "__init__.py")
                if target is None:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}".lstrip(".")
                    edges.add((sub, "") if sub in MODULES else (target, alias.name))
            elif isinstance(node, ast.Import):
                edges |= {(a.name[len("shardscope."):], "") for a in node.names if a.name.startswith("shardscope.")}
        out[name] = edges
    return out


_imports_cache = _imports()


def test_no_undefined_name_and_no_unused_import():
    """pyflakes over the package: a name used but never bound (an import lost in a move) fails only on the line that
    runs it; an import nothing uses is a dependency nothing needs."""
    from pyflakes import api, messages, reporter

    class Collect(reporter.Reporter):
        def __init__(self):
            super().__init__(None, None)
            self.found = []

        def flake(self, message):
            if isinstance(message, (messages.UndefinedName, messages.UnusedImport, messages.ImportStarUsed)):
                self.found.append(str(message))

    collect = Collect()
    api.checkRecursive([str(PACKAGE)], collect)
    assert collect.found == []


def test_no_import_cycles_lazy_imports_included():
    """A package's __init__ re-exporting its own modules (cli) is not a cycle: edges into a package's __init__
    from inside that package are left out."""
    graph = {m: {t for t, _ in edges if t in _imports_cache and not (t and m.startswith(t + "."))}
             for m, edges in _imports_cache.items()}
    for start in graph:
        reached, todo = set(), list(graph[start])
        while todo:
            name = todo.pop()
            assert name != start, f"shardscope.{start} imports itself back through {sorted(reached)}"
            if name not in reached:
                reached.add(name)
                todo += graph.get(name, ())


def test_no_module_imports_another_modules_private_names():
    private = [(m, target, name) for m, edges in _imports_cache.items() for target, name in edges
               if name.startswith("_") and not name.startswith("__")]
    assert private == []


def test_the_planner_split_and_the_recipe_split_stay_apart():
    assert not any(t.startswith("doctor") for m in _imports_cache if m.startswith("recipes") for t, _ in _imports_cache[m])
    formulas_deps = {t for t, _ in _imports_cache["plan.formulas"]}
    assert not formulas_deps & {"plan.planner", "cli.plan", "plan.dry_run"}, "formulas never call back into the planner"


# --- layers (docs/architecture.md) -----------------------------------------------------------------
# docs/architecture.md's layer diagram, row by row from the top (test_the_diagram_is_this_table holds the two equal):
# a layer may import the layers drawn below it, never one beside it or above it.
DIAGRAM = (("cli",), ("preflight", "checkpoint", "parity"), ("doctor", "report"), ("recipes",), ("fit",), ("configs",),
           ("plan", "measure"), ("model",))
LAYERS = tuple(name for row in DIAGRAM for name in row)
FORBIDDEN = {name: {other for above in DIAGRAM[:i + 1] for other in above} - {name}  # layer -> what it must not import
             for i, row in enumerate(DIAGRAM) for name in row}
# The modules at the top of the package: the foundation every layer may use (they import no layer), and the
# named modules above the layers (the public surface, `python -m shardscope`, the bridge that hands measure/ the
# planner's plan for a live run).
ABOVE_LAYERS = {"", "__main__", "profiling"}
DOCS = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def test_the_diagram_is_this_table():
    """The rows of the diagram under "Layers and the rules between them" (the `name/` words a line starts with) are
    DIAGRAM's, and every module ABOVE_LAYERS names exists."""
    import re

    block = DOCS.read_text().split("## Layers and the rules between them", 1)[1].split("```")[1]
    rows = tuple(tuple(re.findall(r"(\w+)/", found.group(1))) for line in block.splitlines()
                 if (found := re.match(r"((?:\w+/ +)+)", line)))
    assert rows == DIAGRAM
    assert sorted(ABOVE_LAYERS - set(MODULES)) == []


# Functions still over MAX_FUNCTION_LINES, to be split (each named: none is silently exempt).
TO_SPLIT: set[str] = set()
MAX_FUNCTION_LINES = 60


def layer(module: str) -> str:
    """The layer a package-relative module belongs to: its folder, or 'top' for the modules at the top."""
    return module.split(".")[0] if module.split(".")[0] in LAYERS and "." in module or module in LAYERS else "top"


def test_every_folder_is_a_layer():
    """A folder left out of DIAGRAM would count as foundation, its imports unchecked."""
    folders = {m.split(".")[0] for m in MODULES if "." in m}
    assert sorted(folders - set(LAYERS)) == []


def test_every_module_is_in_a_layer_or_named_at_the_top():
    top = {m for m in MODULES if layer(m) == "top"} - ABOVE_LAYERS
    reaching_up = {m: sorted({t for t, _ in _imports_cache[m] if layer(t) != "top"}) for m in top}
    assert {m: up for m, up in reaching_up.items() if up} == {}, "a foundation module imports a layer"


@pytest.mark.parametrize("below", sorted(FORBIDDEN))
def test_layer_imports_only_what_it_may(below):
    crossing = sorted((m, t) for m, edges in _imports_cache.items() if layer(m) == below
                      for t, _ in edges if layer(t) in FORBIDDEN[below])
    assert crossing == []


def test_measure_does_not_reach_the_planner_through_another_module():
    """measure/ gets the planner's live-run plan injected (profiling.py): nothing it imports, at any depth, is plan/."""
    graph = {m: {t for t, _ in edges if t in _imports_cache} for m, edges in _imports_cache.items()}
    reached, todo = set(), [m for m in graph if layer(m) == "measure"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += graph[name]
    assert sorted(m for m in reached if layer(m) in ("plan", "configs", "fit", "doctor", "report", "cli")) == []


def test_only_the_command_line_and_the_recipes_parse_arguments():
    """argparse belongs to cli/ and to the recipes' programs (recipes/: their `--config` parsing, tiny's `-m`)."""
    parsing = sorted(m for m, path in MODULES.items() if layer(m) not in ("cli", "recipes")
                     and any(isinstance(n, (ast.Import, ast.ImportFrom)) and "argparse" in
                             {a.name for a in n.names} | {getattr(n, "module", None)}
                             for n in ast.walk(ast.parse(path.read_text()))))
    assert parsing == []


def _long_functions() -> dict[str, int]:
    out = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    out[f"{name}.{node.name}"] = length
    return out


def test_no_function_over_60_lines():
    long = _long_functions()
    assert {f: n for f, n in long.items() if f not in TO_SPLIT} == {}
    assert sorted(TO_SPLIT - set(long)) == [], "split already: take it off TO_SPLIT"


@pytest.mark.parametrize("path", MODULES.values(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_small(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES


def test_plan_from_a_count_imports_neither_torch_nor_transformers():
    code = ("import sys; from shardscope.cli import main; main(['plan', '--params', '7e9', '--gpus', '4']);"
            "print('HEAVY', sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out


# --- the planner's estimate in one pass -------------------------------------------------------------
def _stays(spec, setup, knobs=None) -> list[tuple[str, list[str]]]:
    """The modules the run being planned stays in, walked from `estimate`: each function of the package entered
    for the first time with the run among its arguments (a `Setup`, its `LibraryKnobs`, or a row's `FamilyRow`), in
    order, the consecutive ones of one module a stay. The run's own methods (`Setup.validate`, `world_size`) read
    it where it is: they are not a move."""
    from shardscope.plan.formulas import FamilyRow
    from shardscope.plan.mesh import LibraryKnobs, Setup
    from shardscope.plan.planner import estimate

    own = {getattr(m, "fget", m).__code__ for cls in (Setup, LibraryKnobs) for m in vars(cls).values()
           if hasattr(getattr(m, "fget", m), "__code__")}
    entered, order = set(), []

    def profile(frame, event, arg):
        code, module = frame.f_code, frame.f_globals.get("__name__", "")
        if event != "call" or code in entered or code in own or not module.startswith("shardscope."):
            return
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if any(isinstance(frame.f_locals.get(n), (Setup, LibraryKnobs, FamilyRow)) for n in names):
            entered.add(code)
            order.append((module, code.co_name))

    sys.setprofile(profile)
    try:
        estimate(spec, setup, knobs=knobs)
    finally:
        sys.setprofile(None)
    stays = []
    for module, name in order:
        if stays and stays[-1][0] == module:
            stays[-1][1].append(name)
        else:
            stays.append((module, [name]))
    return stays


@pytest.mark.parametrize("case", ["count, 2 nodes", "model, LoRA, FSDP1 and a ZeRO bucket", "MoE, one GPU"])
def test_the_run_being_planned_returns_to_a_module_it_left_at_most_twice(case):
    """Issue 31: walked from `estimate`, the run went formulas <-> mesh <-> planner, returning to a module it had
    left 5 times; it now goes down once (the rows' meshes, their bytes) and comes back up to choose."""
    from shardscope.model.spec import model_spec
    from shardscope.plan.mesh import LibraryKnobs, Setup

    gpu = 80 * 2 ** 30
    spec, setup, knobs = {
        "count, 2 nodes": (model_spec(None, params=7e9), Setup(gpus_per_node=8, nodes=2, gpu_memory_bytes=gpu), None),
        "model, LoRA, FSDP1 and a ZeRO bucket": (
            model_spec("llama-3-8b"), Setup(gpus_per_node=4, gpu_memory_bytes=gpu, lora_rank=8, tp_size=2),
            LibraryKnobs(fsdp_version=1, bucket_elements=10 ** 6, zero_overlap_comm=True)),
        "MoE, one GPU": (model_spec("mixtral-8x7b"), Setup(gpu_memory_bytes=gpu, precision="bf16-pure"), None),
    }[case]
    stays = _stays(spec, setup, knobs)
    modules = [module for module, _ in stays]
    assert {"shardscope.plan.planner", "shardscope.plan.mesh", "shardscope.plan.formulas"} <= set(modules), stays
    assert any("strategy_row" in names for _, names in stays) and any("recommend" in names for _, names in stays)
    returns = [module for i, module in enumerate(modules) if module in modules[:i]]
    assert len(returns) <= 2, stays
