import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
from launch import QLORA_SITE
from loop_runs import loop_runs  # noqa: F401  (shared launching fixtures, each defined beside its launches' spec)
from recipe_runs import accelerate_yaml, image_assets, long_tail_data, recipe_runs  # noqa: F401
from strategy_runs import parameter_shapes, strategy_model, strategy_plans, strategy_runs  # noqa: F401

sys.path.append(str(QLORA_SITE))  # bitsandbytes, for the tests that quantise here (tests/launch.py QLORA_SITE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Model specs are cached per config (shardscope.model.cache): a fresh folder per session, never the user's.
os.environ.setdefault("SHARDSCOPE_CACHE", tempfile.mkdtemp(prefix="shardscope-spec-cache-"))

# Fixtures that start multi-process training: every test using one is a `launch` test, so that
# `pytest -m "not launch"` (the fast subset) never waits on a launch.
LAUNCHING_FIXTURES = {"strategy_runs", "strategy_plans", "runs", "recipe_runs", "comparison", "trained", "loop_runs",
                      "fsdp2_run", "sp_runs", "hang_runs"}


@pytest.fixture(autouse=True)
def no_excepthook_outlives_its_test():
    """A profiler a test leaves open keeps its watchdog's sys.excepthook, which writes a record into that profiler's
    output_dir (".": the checkout) when a later test calls the hook: put the test's own back."""
    hook = sys.excepthook
    yield
    sys.excepthook = hook


# Session-scoped launching fixtures (tests/strategy_runs.py, tests/loop_runs.py, tests/recipe_runs.py), by the runs
# they share: several test files use them.
SHARED_RUNS = {"strategy_runs": "strategy_runs", "strategy_plans": "strategy_runs", "loop_runs": "loop_runs",
               "recipe_runs": "recipe_runs"}
HERE = Path(__file__).parent
GROUPS = {f"{HERE.name}/{path.name}": group for path in sorted(HERE.glob("test_*.py"))
          for name, group in SHARED_RUNS.items() if name in path.read_text()}


def scope(nodeid: str) -> str:
    """The unit one xdist worker runs whole: a test file, or the group of files sharing a launched run."""
    file = nodeid.split("::", 1)[0]
    return GROUPS.get(file, file)


def scope_seconds(nodeids) -> dict[str, float]:
    """Each scope's seconds in a recorded run (tests/file_seconds.json, scripts/file_seconds.py), a new file the
    median file's."""
    recorded = json.loads((HERE / "file_seconds.json").read_text())
    median = sorted(recorded.values())[len(recorded) // 2]
    seconds: dict[str, float] = {}
    for file in {nodeid.split("::", 1)[0] for nodeid in nodeids}:
        seconds[scope(file)] = seconds.get(scope(file), 0.0) + recorded.get(Path(file).name, median)
    return seconds


def pytest_collection_modifyitems(items):
    """Mark the launch tests; order the scopes longest first (xdist hands them out in this order, so the last ones
    are short and both workers finish together), tests inside a scope as written."""
    for item in items:
        if LAUNCHING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.launch)
    seconds = scope_seconds(item.nodeid for item in items)
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-seconds[scope(item.nodeid)], scope(item.nodeid), order[id(item)]))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers: a 2-rank launch leaves a core idle about a third of its time.
    Fixtures are per worker, so tests that share a launched run must run on one worker: each test file goes to one
    worker whole (module-scoped runs), and every file that uses a fixture of SHARED_RUNS joins that fixture's group.
    Scopes go out in the collection's order (longest first, pytest_collection_modifyitems), not xdist's default
    of the most tests first."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class SharedRunScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:  # what xdist's own loadfile and loadgroup override
            return scope(nodeid)

    return SharedRunScheduling(config, log)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama saved with save_pretrained; runs load it back with from_pretrained."""
    from shardscope.recipes.tiny import make_causal_lm

    path = tmp_path_factory.mktemp("tiny_llama")
    make_causal_lm(path, "llama")
    return path


@pytest.fixture(scope="session")
def sft_assets(tmp_path_factory):
    """Alpaca JSON + a tiny Llama with its byte-level tokenizer (shardscope.recipes.tiny), for recipe runs."""
    from shardscope.recipes.tiny import make_sft_assets

    return make_sft_assets(tmp_path_factory.mktemp("sft_assets"), "llama", n=256)
