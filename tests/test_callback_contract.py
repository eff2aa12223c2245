"""Contract: the callback never breaks training, whatever the model, inputs or failures (1 process)."""
import importlib
import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import shardscope.measure.profiler as profiler_module
from shardscope import ShardingProfiler, ShardingProfilerCallback
from shardscope.measure.memory import read_memory


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def token_rows(n=8, seq=8, with_mask=True):
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, 500, (seq,), generator=g)
        row = {"input_ids": ids, "labels": ids}
        if with_mask:
            row["attention_mask"] = torch.ones_like(ids)
        rows.append(row)
    return Rows(rows)


def run_trainer(model, data, tmp_path, steps=4, **callback_kwargs) -> Trainer:
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2,
                             logging_steps=1, use_cpu=True, report_to=[], save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[ShardingProfilerCallback(**callback_kwargs)])
    trainer.train()
    return trainer


def train(model, data, tmp_path, steps=4, **callback_kwargs):
    trainer = run_trainer(model, data, tmp_path, steps, **callback_kwargs)
    return trainer, json.loads((tmp_path / "shardscope_summary.json").read_text())


@pytest.fixture()
def llama(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama)


def test_logs_carry_metrics_and_the_callback_runs_before_reporters(llama, tmp_path):
    trainer, summary = train(llama, token_rows(), tmp_path)
    callbacks = trainer.callback_handler.callbacks
    assert isinstance(callbacks[1], ShardingProfilerCallback)
    logged = [entry for entry in trainer.state.log_history if "shardscope/params_bytes_max" in entry]
    assert len(logged) == 4  # one per logging step
    n_params = sum(p.numel() for p in llama.parameters())
    assert logged[-1]["shardscope/params_bytes_max"] == 4 * n_params
    assert logged[0]["shardscope/tokens_per_s"] > 0  # steps 3 and 4 are instrumented (left out of throughput)
    # the training thread's CPU time over wall time: one thread cannot use more (2% for the two clocks' reads)
    assert 0 < logged[0]["shardscope/compute_share_max"] <= 1.02
    throughput = summary["ranks"][0]["throughput"]
    assert 0 < throughput["compute_seconds"] <= throughput["seconds"] * 1.02
    assert summary["strategy"] == "single" and summary["world_size"] == 1
    assert summary["ranks"][0]["params_bytes"] == 4 * n_params
    assert summary["model"]["params_total"] == n_params


def test_survives_train_begin_and_end_twice(llama, tmp_path):
    trainer, first = train(llama, token_rows(), tmp_path)
    trainer.args.max_steps = 8
    trainer.train()
    second = json.loads((tmp_path / "shardscope_summary.json").read_text())
    assert (first["global_step"], second["global_step"]) == (4, 8)
    assert not llama._forward_pre_hooks  # hooks are removed at train end, not stacked
    assert second["ranks"][0]["throughput"]["samples_per_s"] > 0


def test_model_without_attention_mask_counts_every_token(llama, tmp_path):
    _, with_mask = train(llama, token_rows(with_mask=True), tmp_path / "a")
    _, without = train(llama, token_rows(with_mask=False), tmp_path / "b")
    for summary in (with_mask, without):
        throughput = summary["ranks"][0]["throughput"]
        assert throughput["tokens_per_s"] == pytest.approx(8 * throughput["samples_per_s"])


def test_image_inputs_without_tokenizer(tmp_path):
    from transformers import Dinov2Config, Dinov2ForImageClassification

    config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          image_size=28, patch_size=14, num_labels=3)
    model = Dinov2ForImageClassification(config)
    g = torch.Generator().manual_seed(0)
    data = Rows([{"pixel_values": torch.randn(3, 28, 28, generator=g), "labels": torch.tensor(i % 3)}
                 for i in range(8)])
    _, summary = train(model, data, tmp_path)
    throughput = summary["ranks"][0]["throughput"]
    assert throughput["tokens_per_s"] == pytest.approx(5 * throughput["samples_per_s"])  # 4 patches + CLS
    assert throughput["tflops_per_device"] > 0


def test_a_failing_measurement_warns_once_and_training_finishes(llama, tmp_path, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(profiler_module, "count_state", broken)
    with caplog.at_level(logging.WARNING, logger="shardscope"):
        trainer, summary = train(llama, token_rows(), tmp_path)
    assert trainer.state.global_step == 4
    warnings = [r for r in caplog.records if "simulated failure" in r.getMessage()]
    assert len(warnings) == 1
    assert summary["ranks"][0]["params_bytes"] is None
    assert summary["ranks"][0]["throughput"]["samples_per_s"] > 0  # the rest is still measured


def test_cuda_memory_branch_reads_the_allocator(monkeypatch):
    """GPU-only branch, with torch.cuda's queries faked (no GPU here)."""
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3_000)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 4_096)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": 2, "num_ooms": 1})
    reading = read_memory(torch.device("cuda", 0))
    assert reading["memory_kind"] == "cuda_max_allocated"
    assert (reading["peak_memory_bytes"], reading["cuda_max_reserved_bytes"]) == (3_000, 4_096)
    assert (reading["cuda_alloc_retries"], reading["cuda_ooms"]) == (2, 1)
    assert read_memory(torch.device("cpu"))["memory_kind"] == "cpu_peak_rss"


def test_peak_flops_override_gives_mfu_on_any_device(llama, tmp_path):
    """MFU = tokens/s x FLOPs per token / peak, the FLOPs convention of docs/summary.md written out here: every
    parameter trains, so 6 N (N without an untied input embedding) + 12 x layers x heads x head_dim x seq_len."""
    config, seq = llama.config, 8  # token_rows: 8 tokens a row, none padding
    untied_embedding = 0 if config.tie_word_embeddings else llama.get_input_embeddings().weight.numel()
    n = sum(p.numel() for p in llama.parameters()) - untied_embedding
    flops_per_token = 6 * n + 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq
    _, summary = train(llama, token_rows(), tmp_path, peak_tflops=2.0)
    throughput = summary["ranks"][0]["throughput"]
    assert throughput["tflops_per_device"] == pytest.approx(throughput["tokens_per_s"] * flops_per_token / 1e12)
    assert throughput["mfu"] == pytest.approx(throughput["tokens_per_s"] * flops_per_token / 2.0e12)


@pytest.mark.parametrize("gpu_bytes, fits", [(1_000_000, False), (80 * 10**9, True)])
def test_the_live_run_plan_warns_with_the_planners_advice_when_the_strategy_will_not_fit(
        llama, gpu_bytes, fits, monkeypatch, caplog, tmp_path):
    """GPU-only branch, with the device's total memory faked."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=gpu_bytes))
    profiler = ShardingProfiler(llama, None, output_dir=tmp_path, summary_file=None, memory_step=None)
    profiler.facts.device = torch.device("cuda", 0)
    profiler.facts.detected = {"strategy": "ddp", "world_size": 1}
    ids = torch.zeros(1, 32, dtype=torch.long)
    with caplog.at_level(logging.WARNING, logger="shardscope"):
        profiler.hooks.plan_live_run({"input_ids": ids})
    plan = profiler.facts.live_plan
    assert plan["strategy"] == "ddp" and plan["fits"] is fits and plan["gpu_memory_bytes"] == gpu_bytes
    assert not hasattr(profiler, "preflight") and "plan" not in profiler.detected  # one name: the live-run plan
    warned = [r.getMessage() for r in caplog.records if "usable on this GPU" in r.getMessage()]
    assert bool(warned) is (not fits)
    if not fits:
        assert "recommended" in warned[0] and "ddp" in warned[0]


def test_the_live_run_plan_plans_a_tensor_parallel_run_on_its_mesh(llama, monkeypatch, tmp_path):
    """GPU-only branch: an FSDP x TP run (2 shards x tp 2) is planned on that mesh, not the planner's
    default TP degree for 4 GPUs (4 here)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from shardscope.plan.mesh import Setup, setup_for_mesh
    from shardscope.model.spec import spec_from_config
    from shardscope.plan.planner import estimate

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 10**9))
    mesh = {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
    profiler = ShardingProfiler(llama, None, output_dir=tmp_path, summary_file=None, memory_step=None)
    profiler.facts.device = torch.device("cuda", 0)
    profiler.facts.detected = {"strategy": "fsdp_tp", "world_size": 4, "mesh": mesh}
    profiler.hooks.plan_live_run({})  # no batch: model states and buffers
    _, setup = setup_for_mesh(Setup(precision="fp32", seq_len=0, micro_batch=1, gpu_memory_bytes=80 * 10**9), mesh)
    default = estimate(spec_from_config(llama.config), replace(setup, tp_size=None))["rows"]
    assert mesh not in [r.mesh.as_dict() for r in default]  # only the mesh gives this row
    assert profiler.facts.live_plan["strategy"] == "fsdp_tp"
    # By hand, fp32 AdamW on 2 shards x tp 2 with no batch (states and what FSDP gathers; the peak is at the end
    # of backward): a rank holds the linear layers and embeddings split four ways, the norms (TP replicates them)
    # two ways: 4 B weights + 4 B gradients + 8 B moments per element, AdamW's 4 B `step` per tensor; plus the
    # largest FSDP unit (the root: embeddings, lm_head, final norm) gathered and its fresh gradient, 4 B per
    # element, split tp ways (docs/planner.md's FSDP x TP rows divide a gathered unit by t).
    params = dict(llama.named_parameters())
    elements = sum(p.numel() for p in params.values())
    norms = sum(p.numel() for name, p in params.items() if name.endswith("norm.weight"))
    root = sum(p.numel() for name, p in params.items() if ".layers." not in name)
    shard = (elements - norms) // 4 + norms // 2
    assert root > max(sum(p.numel() for name, p in params.items() if f".layers.{i}." in name) for i in range(2))
    assert profiler.facts.live_plan["total_bytes"] == 16 * shard + 4 * len(params) + 2 * 4 * root // 2


def test_the_live_run_plan_plans_the_traced_peak_at_the_first_training_batch(llama, monkeypatch):
    """GPU-only branch: at the first training forward the live-run plan plans the batch's shape with the step traced
    as `plan --model` traces it (the same row), once, and its seconds are left out of the step's time."""
    from types import SimpleNamespace

    from shardscope.plan.mesh import Setup
    from shardscope.model.spec import spec_from_config
    from shardscope.plan.planner import estimate
    from shardscope.plan.trace import traces_for

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 10**9))
    profiler = ShardingProfiler(llama, None, summary_file=None, memory_step=None, comm_step=None, time_step=None)
    profiler.facts.device, profiler.hooks.state.plan_due = torch.device("cuda", 0), True
    profiler.facts.detected = {"strategy": "ddp", "world_size": 1}
    profiler.begin_step()
    anchored = profiler.clock.interval.anchor  # where the step's time starts
    ids = torch.zeros(2, 48, dtype=torch.long)
    llama.train()
    llama(input_ids=ids, labels=ids).loss.backward()
    plan, profiler.facts.live_plan = profiler.facts.live_plan, None
    setup = Setup(precision="fp32", micro_batch=2, seq_len=48, gpu_memory_bytes=80 * 10**9)
    row = next(r for r in estimate(spec_from_config(llama.config), setup, traces_for(llama.config, setup)[0])["rows"]
               if r.strategy == "ddp")
    assert (plan["micro_batch"], plan["seq_len"], plan["activations_source"]) == (2, 48, "traced")
    assert plan["peak_bytes"] == row.peak_bytes and plan["fits"] is True
    assert profiler.clock.interval.anchor > anchored  # the step's time restarts after the plan
    llama(input_ids=ids, labels=ids)
    assert profiler.facts.live_plan is None  # once per run
    profiler.close()


def test_peak_tensor_memory_by_category_from_one_instrumented_step(llama, tmp_path):
    """One warm step is instrumented (MemTracker): its peak is split by category, the model states in it
    agree with the callback's own counts (an independent walk), and the step is left out of throughput."""
    rows = token_rows(seq=256)  # long enough that activations, not the tiny weights, make the peak
    trainer, summary = train(llama, rows, tmp_path / "plain", memory_step=2, comm_step=2, time_step=None)
    rank = summary["ranks"][0]
    parts = rank["peak_breakdown"]
    assert sum(parts.values()) == rank["peak_tensor_bytes"] == rank["peak_memory_bytes"]
    assert rank["memory_kind"] == "tensor_peak" and rank["cpu_peak_rss_bytes"] > rank["peak_tensor_bytes"]
    buffers = sum(b.numel() * b.element_size() for b in llama.buffers())  # MemTracker books buffers with parameters
    assert parts["parameters"] == rank["params_bytes"] + buffers and parts["optimizer"] == rank["optimizer_bytes"]
    # The peak falls in backward, while activations are still live and not every gradient exists yet.
    assert rank["peak_phase"] == "backward" and parts["gradients"] < rank["params_bytes"] and parts["activations"] > 0
    assert rank["throughput"]["samples"] == 2 * 3  # 4 steps of 2 samples, the instrumented one left out

    llama.gradient_checkpointing_enable()
    _, ckpt = train(llama, rows, tmp_path / "ckpt", memory_step=2)
    assert ckpt["ranks"][0]["peak_breakdown"]["activations"] < parts["activations"]


@pytest.mark.parametrize("name, bad", [
    *[("memory_step", bad) for bad in (0, "2", 1.5, True)],
    *[("every_n_steps", bad) for bad in (0, -1, "2", 1.5, True)],
    *[("peak_tflops", bad) for bad in (0, -1.0, "989", float("inf"), float("nan"), True)],
    *[("summary_file", bad) for bad in (5, "", "  ")],
    *[("hang_after", bad) for bad in (0, -3, "120", "Auto", float("nan"), float("inf"), True)],
])
def test_arguments_are_validated_at_construction(name, bad):
    """A wrong type fails when the callback is made, not at step 0 inside the user's training."""
    with pytest.raises(ValueError, match=name):
        ShardingProfilerCallback(**{name: bad})


def _broken(*args, **kwargs):
    raise RuntimeError("simulated failure")


# ("module:" where it is looked up, the profiler unless named; what to break) -> the warning that names it; each
# piece the callback relies on
FAULTS = {
    "count_state": "model-state bytes", "step_hooks:held_gradients": "state_bytes disabled", "read_memory": "peak memory",
    "reset_peak": "peak memory", "step_hooks:count_batch": "batch counting", "throughput:rates": "throughput",
    "start_gather": "cross-rank gather", "write_summary": "summary file", "step_hooks:StepPeak": "memory disabled",
    "PrecisionWatch": "precision disabled", "gather_reports": "precision", "live_strategy": "strategy",
    "metrics:log_metrics": "metric logging", "callback:describe_flops": "parameter counts",
    "throughput:ThroughputWindow.step_end": "throughput", "callback:ShardingProfilerCallback._run_before_reporters": "callback order",
    "callback:frozen_models_of": "frozen models",
}


@pytest.mark.parametrize("target", sorted(FAULTS))
def test_each_piece_failing_warns_once_and_training_finishes(llama, tmp_path, monkeypatch, caplog, target):
    module, _, target_name = target.rpartition(":")
    module = importlib.import_module(f"shardscope.measure.{module or 'profiler'}")
    owner, _, name = target_name.rpartition(".")
    monkeypatch.setattr(getattr(module, owner) if owner else module, name, _broken)
    with caplog.at_level(logging.WARNING, logger="shardscope"):
        trainer = run_trainer(llama, token_rows(), tmp_path)
    assert trainer.state.global_step == 4
    warnings = [r.getMessage() for r in caplog.records if "simulated failure" in r.getMessage()]
    assert len(warnings) == 1 and FAULTS[target] in warnings[0], warnings
    assert (tmp_path / "shardscope_summary.json").is_file() == (name != "write_summary")


def test_an_unwritable_summary_path_warns_once_and_training_finishes(llama, tmp_path, caplog):
    """A real failure, not a patched one (root ignores read-only folders): the summary's path is a folder."""
    (tmp_path / "shardscope_summary.json").mkdir()
    with caplog.at_level(logging.WARNING, logger="shardscope"):
        trainer = run_trainer(llama, token_rows(), tmp_path)
    assert trainer.state.global_step == 4
    warnings = [r.getMessage() for r in caplog.records if "summary file" in r.getMessage()]
    assert len(warnings) == 1 and "a folder" in warnings[0]


def test_an_event_that_fails_outside_every_guard_still_never_raises(llama, tmp_path, monkeypatch, caplog):
    """The net around each event: a failure no inner guard covers is one warning per event, not a crash."""
    monkeypatch.setattr(ShardingProfiler, "begin_step", _broken)  # the profiler's own net bypassed
    monkeypatch.setattr(ShardingProfiler, "step", _broken)
    with caplog.at_level(logging.WARNING, logger="shardscope"):
        trainer, _ = train(llama, token_rows(), tmp_path)
    assert trainer.state.global_step == 4
    warnings = sorted(r.getMessage().split(" failed")[0] for r in caplog.records
                      if "simulated failure" in r.getMessage())
    assert warnings == ["shardscope: on_step_begin", "shardscope: on_step_end", "shardscope: on_train_begin"]


def test_frozen_models_are_the_modules_a_trainer_holds_besides_the_trained_one():
    from types import SimpleNamespace

    from shardscope.measure.callback import frozen_models_of

    def tiny():
        return torch.nn.Linear(4, 4)

    model, ref, teacher, reward = tiny(), tiny(), tiny(), tiny()
    wrapper = torch.nn.Sequential(model)  # shares the trained parameters, as DDP or a DeepSpeed engine does
    trainer = SimpleNamespace(model=model, model_wrapped=wrapper, ref_model=ref, teacher_model=teacher,
                              reward_funcs=[reward, "a reward function by name"], loss_fn=torch.nn.MSELoss(),
                              _value_model=None)
    assert frozen_models_of(trainer, model) == {"reference": ref, "teacher": teacher, "reward_funcs_0": reward}
    assert frozen_models_of(None, model) == {}
