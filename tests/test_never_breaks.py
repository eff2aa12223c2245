"""Never breaks training, by construction (1 process): each instrument made to fail at construction, inside a hook, in
the gather and at summary time; everything the profiler installs goes in through `guard.Instrument`; nothing is left
behind after the run."""
import ast
import gc
import importlib
import json
import logging
import weakref
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from shardscope import ShardingProfiler, ShardingProfilerCallback
from shardscope.measure.guard import GUARDED

PACKAGE = Path(__file__).resolve().parents[1] / "plugin" / "shardscope"
STEPS = 4
STEP_OPTIONS = dict(time_step=1, memory_step=2, comm_step=3, every_n_steps=2)
# What each instrument fills in every rank's summary entry: None after it failed.
FIELDS = {"memory": ("peak_tensor_bytes", "peak_breakdown", "peak_phase", "peak_step"),
          "collectives": ("comm", "comm_sent_bytes_per_step", "comm_padded_tokens"), "step_time": ("time_breakdown",)}
# (instrument, where it fails) -> "module:attribute" made to raise
FAULTS = {
    ("memory", "construction"): "measure.step_hooks:StepPeak",
    ("memory", "hook"): "measure.peak:StepPeak._mark",
    ("memory", "tracker hook"): "mem_tracker:MemTracker._pre_fw_hook",
    ("memory", "gather"): "measure.peak:breakdown_fields",
    ("memory", "summary"): "measure.peak:breakdown_of",
    ("collectives", "construction"): "measure.comm_count:CollectiveCounter",
    ("collectives", "hook"): "measure.comm_count:collective_size",
    ("collectives", "gather"): "measure.comm_count:to_fields",
    ("collectives", "summary"): "measure.comm_count:from_fields",
    ("step_time", "construction"): "measure.time_breakdown:StepTimer.start",
    ("step_time", "hook"): "measure.time_breakdown:StepTimer._mark",
    ("step_time", "gather"): "measure.time_breakdown:to_fields",
    ("step_time", "summary"): "measure.time_breakdown:from_fields",
    ("throughput", "construction"): "measure.step_hooks:first_adapter_layer",
    ("throughput", "hook"): "measure.step_hooks:StepHooks.on_forward",
    ("state_bytes", "construction"): "measure.step_hooks:base_optimizer",
    ("state_bytes", "hook"): "measure.step_hooks:held_gradients",
    ("precision", "construction"): "measure.profiler:PrecisionWatch",
    ("precision", "hook"): "measure.precision:ForwardProbe._record",
    ("batch_feed", "hook"): "measure.profiler:ShardingProfiler.add_batch",
    ("watchdog", "thread"): "measure.watchdog:Watchdog._join_store",  # its thread's first call
}


def _broken(*args, **kwargs):
    raise RuntimeError("simulated failure")


class Rows(torch.utils.data.Dataset):
    def __init__(self, vocab, n=16, seq=8):
        g = torch.Generator().manual_seed(0)
        self.rows = [{"input_ids": (ids := torch.randint(3, vocab, (seq,), generator=g)), "labels": ids}
                     for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A 1-rank gloo group, so that a step issues a collective for the counter to count (`train`)."""
    store = torch.distributed.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def make_trainer(model_path, out, callbacks=()):
    """A Trainer of 4 steps of the tiny Llama, each training forward issuing one all_reduce (a user's collective)."""
    model = AutoModelForCausalLM.from_pretrained(model_path)
    model.register_forward_hook(lambda *_: torch.distributed.all_reduce(torch.ones(4)))
    args = TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, logging_steps=1,
                             learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=Rows(model.config.vocab_size), callbacks=list(callbacks))


def train(model_path, out, callbacks=()):
    """`make_trainer(...).train()`; returns (trainer, losses)."""
    trainer = make_trainer(model_path, out, callbacks)
    trainer.train()
    return trainer, [log["loss"] for log in trainer.state.log_history if "loss" in log]


@pytest.fixture(scope="module")
def plain_losses(tiny_llama, one_rank_group, tmp_path_factory):
    return train(tiny_llama, tmp_path_factory.mktemp("plain"))[1]


@pytest.mark.parametrize("instrument, where", sorted(FAULTS))
def test_an_instrument_that_fails_is_disabled_and_training_goes_on(tiny_llama, plain_losses, tmp_path, monkeypatch,
                                                                   caplog, instrument, where):
    module, _, attribute = FAULTS[instrument, where].partition(":")
    module = importlib.import_module("torch.distributed._tools.mem_tracker" if module == "mem_tracker" else
                                     f"shardscope.{module}")
    owner, _, name = attribute.rpartition(".")
    monkeypatch.setattr(getattr(module, owner) if owner else module, name, _broken)
    with caplog.at_level(logging.WARNING, logger="shardscope"):
        trainer, losses = train(tiny_llama, tmp_path, [ShardingProfilerCallback(**STEP_OPTIONS)])
    assert trainer.state.global_step == STEPS and losses == plain_losses  # every step, the same numerics
    failures = [r.getMessage() for r in caplog.records if "simulated failure" in r.getMessage()]
    assert len(failures) == 1 and f"{instrument} disabled for the rest of the run" in failures[0], failures
    summary = json.loads((tmp_path / "shardscope_summary.json").read_text())
    statuses = summary["instruments"]
    assert "simulated failure" in statuses.pop(instrument)
    assert statuses == dict.fromkeys(statuses, "ok")
    for rank in summary["ranks"]:
        assert all(rank[field] is None for field in FIELDS.get(instrument, ())), rank
        for other, fields in FIELDS.items():
            assert other == instrument or all(rank[field] is not None for field in fields), (other, rank)


class FailAtStep(TrainerCallback):
    """A user's callback that raises at the end of optimizer step `step` (None: never)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError("the user's own failure")


def test_a_users_own_training_step_wrapper_keeps_running(tiny_llama, one_rank_group, tmp_path, monkeypatch):
    """A wrapper the user set on `trainer.training_step` before train() runs once per micro-batch beside the
    callback's batch feed, also in a train() after one that raised (whose feed is removed, not stacked), and is
    `trainer.training_step` again after the run."""
    fed = []
    add_batch = ShardingProfiler.add_batch
    monkeypatch.setattr(ShardingProfiler, "add_batch", lambda self, *a, **k: fed.append(1) or add_batch(self, *a, **k))
    failing = FailAtStep(2)
    # no instrumented step: a train() that raises leaves the dispatch mode of a step it had armed on torch's stack
    callback = ShardingProfilerCallback(memory_step=None, comm_step=None, time_step=None)
    trainer = make_trainer(tiny_llama, tmp_path, [callback, failing])
    calls, original = [], trainer.training_step

    def counting(model, inputs, *args, **kwargs):  # the user's own wrapper (TRL scripts, other libraries)
        calls.append(len(inputs["input_ids"]))
        return original(model, inputs, *args, **kwargs)

    trainer.training_step = counting
    with pytest.raises(RuntimeError, match="the user's own failure"):
        trainer.train()
    assert (calls, len(fed)) == ([2, 2], 2)  # one micro-batch of 2 rows per step, each seen by both
    failing.step = None
    trainer.train()  # starts again from step 0: STEPS more micro-batches
    assert (calls, len(fed)) == ([2] * (2 + STEPS), 2 + STEPS)
    assert vars(trainer)["training_step"] is counting


def _hook_dicts(model, optimizer) -> dict:
    """Every place a hook or a wrapped method can sit on a model, an optimizer, or torch's global registries."""
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module

    places = {f"global.{name}": getattr(nn_module, name) for name in dir(nn_module) if name.startswith("_global_")
              and name.endswith("hooks") and isinstance(getattr(nn_module, name), dict)}
    places.update({f"global.{name}": getattr(optim_module, name) for name in dir(optim_module)
                   if name.startswith("_global_optimizer") and isinstance(getattr(optim_module, name), dict)})
    for path, sub in model.named_modules():
        places.update({f"{path}.{k}": v for k, v in vars(sub).items() if k.endswith("hooks") and isinstance(v, dict)})
    places.update({f"optimizer.{k}": v for k, v in vars(optimizer).items() if k.endswith("hooks")})
    places["optimizer.step"] = {"step": vars(optimizer)["step"]} if "step" in vars(optimizer) else {}
    return places


def test_what_the_profiler_installs_is_guarded_and_gone_after_close(tiny_llama, one_rank_group, tmp_path):
    """During every instrumented step each hook the profiler added (module, optimizer, global) is an
    `Instrument`'s guarded callable, and torch's dispatch stack holds only its modes; after `close()` the model,
    the optimizer and torch's registries are as they were, and the profiler keeps no reference to them."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {place: dict(hooks) for place, hooks in _hook_dicts(model, optimizer).items()}
    seen, modes = {}, set()

    def new_hooks():
        for place, hooks in _hook_dicts(model, optimizer).items():
            for key, hook in hooks.items():
                if key not in before.get(place, {}):
                    seen[f"{place}[{key}]"] = getattr(hook, GUARDED, None) or getattr(hook, "__qualname__", hook)
        modes.update(type(mode).__name__ for mode in _get_current_dispatch_mode_stack())

    profiler = ShardingProfiler(model, optimizer, output_dir=tmp_path, summary_file=None, **STEP_OPTIONS)
    vocab = model.config.vocab_size
    for step in range(STEPS):
        batch = {"input_ids": torch.randint(3, vocab, (2, 8)), "labels": torch.randint(3, vocab, (2, 8))}
        model(**batch).loss.backward()
        new_hooks()  # mid-step: every instrument of this step is installed
        optimizer.step()
        optimizer.zero_grad()
        profiler.step(batch)
    profiler.close()
    unguarded = {place: owner for place, owner in seen.items() if owner not in
                 ("throughput", "state_bytes", "memory", "precision", "collectives", "step_time")}
    # torch's MemTracker registers two closures of its own on the optimizer registry; their work,
    # `_track_optimizer_states`, is guarded (peak.TRACKER_CALLBACKS)
    assert set(unguarded.values()) <= {"MemTracker._register_global_optimizer_hook.<locals>._opt_step_pre_hook",
                                       "MemTracker._register_global_optimizer_hook.<locals>._opt_step_post_hook"}
    assert {"memory", "state_bytes", "throughput", "step_time"} <= set(seen.values())
    assert modes == {"StepTracker", "CollectiveCounter"}
    assert {place: dict(hooks) for place, hooks in _hook_dicts(model, optimizer).items()} == before
    assert _get_current_dispatch_mode_stack() == []
    alive = weakref.ref(model), weakref.ref(optimizer)
    del model, optimizer
    gc.collect()
    assert [ref() for ref in alive] == [None, None] and profiler is not None


def test_only_guard_registers_hooks_or_replaces_methods():
    """No module of the package calls a `register_*hook` method, replaces a method of an object it does not own, or
    defines a dispatch mode, except through guard.py's `Instrument` (`hook`, `wrap`, `MethodWrap`)."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "measure" / "guard.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr.startswith("register") and node.func.attr.endswith("hook"):
                offenders.append(f"{path.name}:{node.lineno} calls {node.func.attr}")
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr in ("step", "forward",
                                                    "training_step", "backward") for t in node.targets):
                offenders.append(f"{path.name}:{node.lineno} replaces a method")
            if isinstance(node, ast.FunctionDef) and node.name == "__torch_dispatch__":
                calls = {c.func.attr for c in ast.walk(node) if isinstance(c, ast.Call)
                         and isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name)
                         and c.func.value.id == "self"}
                if calls - {"_count"}:  # CollectiveCounter counts through `_count = instrument.wrap(_record)`
                    offenders.append(f"{path.name}:{node.lineno} dispatches through {sorted(calls)}")
    assert offenders == []
