"""`ShardingProfiler` in a custom loop, one process: what it counts, where metrics go, and bad input."""
import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardscope import ShardingProfiler
from shardscope.summary import read_summary


# the collective counter's and the step timer's steps (issue 21) are instrumented, hence left out of throughput:
# off here, where what is counted is checked step by step
UNSAMPLED = dict(comm_step=None, time_step=None)


def padded(vocab=500, rows=2, seq=12, seed=0):
    """A batch of `rows` rows right-padded to `seq`: every row has its own number of real tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, seq + 1, (rows,), generator=g)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def train(model, optimizer, profiler, batches, extra_forward=None):
    fed = []
    for batch in batches:
        model(**batch).loss.backward()
        if extra_forward is not None:
            extra_forward(batch)
        optimizer.step()
        optimizer.zero_grad()
        profiler.step(batch)
        fed.append(int(batch["attention_mask"].sum()))
    return fed


@pytest.fixture()
def llama(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama)


def test_a_custom_loop_counts_what_it_fed_and_logs_through_the_accelerator(llama, tmp_path):
    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker

    class Recorder(GeneralTracker):
        name, requires_logging_directory, logged = "recorder", False, []

        def __init__(self):
            super().__init__()

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            pass

        def log(self, values, step=None, **kwargs):
            self.logged.append((step, dict(values)))

    accelerator = Accelerator(cpu=True, log_with=[Recorder()])
    accelerator.init_trackers("test")
    optimizer = torch.optim.AdamW(llama.parameters(), lr=1e-4)
    llama, optimizer = accelerator.prepare(llama, optimizer)
    batches = [padded(seed=i) for i in range(6)]
    with ShardingProfiler(llama, optimizer, accelerator, output_dir=tmp_path, every_n_steps=2, **UNSAMPLED,
                          memory_step=3) as prof:
        fed = train(llama, optimizer, prof, batches)
    summary = read_summary(tmp_path / "shardscope_summary.json")
    rank = summary["ranks"][0]
    n_params = sum(p.numel() for p in llama.parameters())
    assert summary["strategy"] == "single" and summary["global_step"] == 6 and summary["precision"] == "fp32"
    assert rank["params_bytes"] == 4 * n_params and rank["optimizer_bytes"] >= 8 * n_params
    assert rank["grads_bytes"] == 4 * n_params  # snapshotted as the optimizer stepped, before zero_grad
    # every non-padding token fed, once; the instrumented memory step (3) is left out of throughput
    assert rank["throughput"]["tokens"] == sum(fed) - fed[2] and rank["throughput"]["samples"] == 2 * 5
    parts = rank["peak_breakdown"]  # one instrumented step, measured as in the callback
    assert sum(parts.values()) == rank["peak_tensor_bytes"] and parts["parameters"] >= rank["params_bytes"]
    # the shape of that step, what a plan of the same step needs (report.plan_vs_run)
    assert rank["peak_step"] == {"micro_batch": 2, "seq_len": 12, "image_size": None, "gradient_checkpointing": False}
    assert rank["frozen_models"] == {} and rank["frozen_models_bytes"] == 0
    logged = Recorder.logged
    assert [step for step, _ in logged] == [2, 4, 6]
    assert logged[-1][1]["shardscope/params_bytes_max"] == 4 * n_params and logged[-1][1]["shardscope/tokens_per_s"] > 0


def test_micro_batches_and_explicit_counts(llama, tmp_path):
    optimizer = torch.optim.SGD(llama.parameters(), lr=1e-3)
    micro = [padded(seed=1), padded(seed=2)]
    with ShardingProfiler(llama, optimizer, output_dir=tmp_path, **UNSAMPLED, memory_step=None) as profiler:
        for batch in micro:
            llama(**batch).loss.backward()
        optimizer.step()
        profiler.step(micro)  # a list: the step's micro-batches
        llama(**micro[0]).loss.backward()
        optimizer.step()
        profiler.step(tokens=1000, samples=7)  # counts given: they win over the forwards seen
    throughput = read_summary(tmp_path / "shardscope_summary.json")["ranks"][0]["throughput"]
    assert throughput["samples"] == 4 + 7
    assert throughput["tokens"] == sum(int(b["attention_mask"].sum()) for b in micro) + 1000


def test_a_collators_batch_encoding_is_counted_like_its_dict(llama, tmp_path, caplog):
    """The Trainer hands over what its collator returned: for transformers' collators a BatchEncoding (a Mapping,
    not a dict), counted with the callback's sample count, not left to the forwards seen."""
    from transformers import BatchEncoding

    optimizer = torch.optim.SGD(llama.parameters(), lr=1e-3)
    batches = [padded(seed=1), padded(seed=2)]
    with ShardingProfiler(llama, optimizer, output_dir=tmp_path, **UNSAMPLED, memory_step=None) as profiler:
        for batch in batches:
            profiler.add_batch(BatchEncoding(batch), samples=3)  # 3: samples as a Trainer counts them
            llama(**batch).loss.backward()
            optimizer.step()
            profiler.step()
    assert "could not measure" not in caplog.text
    throughput = read_summary(tmp_path / "shardscope_summary.json")["ranks"][0]["throughput"]
    assert throughput["samples"] == 2 * 3
    assert throughput["tokens"] == sum(int(b["attention_mask"].sum()) for b in batches)


def test_step_wraps_of_one_optimizer_come_off_in_any_order():
    """The profiler's gradient snapshot and a sampled step's timer both wrap a ZeRO optimizer's `step`: removing
    the later one first must leave the earlier one working, and every removal must succeed."""
    from shardscope.measure.guard import Instrument, MethodWrap, WarnOnce

    class Zero:  # DeepSpeed's ZeRO optimizers: a plain `step` method, no step hooks
        def step(self):
            calls.append("step")

    for order in ((1, 0), (0, 1)):
        calls, optimizer = [], Zero()
        instrument = Instrument("test", WarnOnce())
        wraps = [MethodWrap(instrument, optimizer, "step", lambda: calls.append("snapshot")),
                 MethodWrap(instrument, optimizer, "step", lambda: calls.append("timer"), lambda: calls.append("timed"))]
        optimizer.step()
        assert calls == ["timer", "snapshot", "step", "timed"]
        wraps[order[0]].remove()
        calls.clear()
        optimizer.step()
        assert calls == {1: ["snapshot", "step"], 0: ["timer", "step", "timed"]}[order[0]]
        wraps[order[1]].remove()
        calls.clear()
        optimizer.step()
        assert calls == ["step"]


def test_passes_that_do_not_train_add_flops_but_no_tokens(tiny_llama, tmp_path):
    """A frozen reference model's forward, and the trained model run with its LoRA adapter disabled (TRL's
    reference pass), add forward FLOPs; tokens and samples stay those of the training forward."""
    from peft import LoraConfig, get_peft_model

    def run(name, extra):
        torch.manual_seed(0)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama), LoraConfig(r=4))
        reference = AutoModelForCausalLM.from_pretrained(tiny_llama).eval().requires_grad_(False)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        with ShardingProfiler(model, optimizer, output_dir=tmp_path / name, **UNSAMPLED, memory_step=None,
                              frozen_models={"reference": reference}) as profiler:
            for seed in range(3):
                batch = padded(seed=seed)
                model(**batch).loss.backward()
                extra(model, reference, batch)
                optimizer.step()
                optimizer.zero_grad()
                profiler.step()  # no batch: the training forwards the profiler saw count
        summary = read_summary(tmp_path / name / "shardscope_summary.json")
        rank = summary["ranks"][0]
        ref_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
        assert rank["frozen_models"] == {"reference": ref_bytes} == {"reference": rank["frozen_models_bytes"]}
        t = rank["throughput"]
        return t["tokens"], t["samples"], t["tflops_per_device"] * 1e12 * t["seconds"]

    def nothing(model, reference, batch):
        pass

    def adapter_disabled(model, reference, batch):
        with model.disable_adapter():  # grad enabled, adapter off: not training
            model(**batch)

    def reference_pass(model, reference, batch):
        with torch.no_grad():
            reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])

    plain, disabled, referenced = run("plain", nothing), run("disabled", adapter_disabled), run("ref", reference_pass)
    tokens = sum(int(padded(seed=s)["attention_mask"].sum()) for s in range(3))
    assert plain[:2] == disabled[:2] == referenced[:2] == (tokens, 6)
    # forward work = 2 FLOPs per matmul parameter per token (+ attention): about a third of the training step's
    # 6 FLOPs per trainable / 4 per frozen parameter; the same for both kinds of reference pass (same model)
    assert disabled[2] / plain[2] == pytest.approx(1.5, rel=0.02)
    # (1%: the adapter-disabled pass is charged for the adapter's own parameters too, r*(in+out) per target)
    assert referenced[2] == pytest.approx(disabled[2], rel=0.01)


def test_images_without_input_ids_count_samples_and_note_once(tmp_path, caplog):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="shardscope"):
        with ShardingProfiler(model, optimizer, output_dir=tmp_path, every_n_steps=1, **UNSAMPLED, memory_step=None) as profiler:
            for _ in range(3):
                batch = {"pixel_values": torch.randn(5, 3, 8, 8), "labels": torch.randint(0, 4, (5,))}
                torch.nn.functional.cross_entropy(model(batch["pixel_values"]), batch["labels"]).backward()
                optimizer.step()
                profiler.step(batch)
    rank = read_summary(tmp_path / "shardscope_summary.json")["ranks"][0]
    assert rank["throughput"]["samples"] == 15 and rank["throughput"]["tokens"] is None
    assert rank["throughput"]["tokens_per_s"] is None and rank["throughput"]["samples_per_s"] > 0
    notes = [r.getMessage() for r in caplog.records if "no input_ids" in r.getMessage()]
    assert len(notes) == 1 and "tokens" in notes[0]
    assert not [r for r in caplog.records if "warned once" in r.getMessage()]  # a note, not a failure


def test_an_unknown_wrapper_counts_what_it_sees_with_one_warning(tmp_path, caplog):
    class Wrapper:  # not a torch module: something the profiler has never heard of
        def __init__(self, module):
            self.module = module

        def __call__(self, x):
            return self.module(x)

    inner = torch.nn.Linear(16, 16)
    model = Wrapper(inner)
    optimizer = torch.optim.SGD(inner.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="shardscope"):
        with ShardingProfiler(model, optimizer, output_dir=tmp_path, every_n_steps=1, **UNSAMPLED, memory_step=None) as profiler:
            for _ in range(3):
                model(torch.randn(4, 16)).sum().backward()
                optimizer.step()
                profiler.step(samples=4)
    summary = read_summary(tmp_path / "shardscope_summary.json")
    assert summary["strategy"] == "unknown" and summary["ranks"][0]["params_bytes"] == (16 * 16 + 16) * 4
    warnings = [r.getMessage() for r in caplog.records if "warned once" in r.getMessage()]
    assert len(warnings) == 1 and "Wrapper" in warnings[0] and "unknown" in warnings[0]
    assert summary["ranks"][0]["throughput"]["samples"] == 12


def test_instruments_bracket_each_step_and_report_per_rank(llama, tmp_path, caplog):
    class Counter:
        name = "counter"

        def __init__(self):
            self.calls = []

        def start(self, step):
            self.calls.append(("start", step))

        def stop(self, step):
            self.calls.append(("stop", step))

        def result(self):
            return {"steps": sum(1 for c in self.calls if c[0] == "stop")}

    class Broken:
        name = "broken"

        def start(self, step):
            raise RuntimeError("simulated failure")

        stop = start

        def result(self):
            return {}

    counter = Counter()
    optimizer = torch.optim.SGD(llama.parameters(), lr=1e-3)
    with caplog.at_level(logging.WARNING, logger="shardscope"):
        with ShardingProfiler(llama, optimizer, output_dir=tmp_path, **UNSAMPLED, memory_step=None,
                              instruments=[counter, Broken()]) as profiler:
            train(llama, optimizer, profiler, [padded(seed=i) for i in range(2)])
    assert counter.calls == [("start", 1), ("stop", 1), ("start", 2), ("stop", 2), ("start", 3)]
    rank = read_summary(tmp_path / "shardscope_summary.json")["ranks"][0]
    assert rank["counter"] == {"steps": 2} and rank["broken"] == {}
    assert len([r for r in caplog.records if "simulated failure" in r.getMessage()]) == 1


def test_step_after_close_and_a_second_close_do_nothing(llama, tmp_path, caplog):
    optimizer = torch.optim.SGD(llama.parameters(), lr=1e-3)
    profiler = ShardingProfiler(llama, optimizer, output_dir=tmp_path, **UNSAMPLED, memory_step=None)
    train(llama, optimizer, profiler, [padded()])
    assert profiler.close() == tmp_path / "shardscope_summary.json"
    first = (tmp_path / "shardscope_summary.json").read_text()
    with caplog.at_level(logging.WARNING, logger="shardscope"):
        assert profiler.step(padded()) == {} and profiler.close() is None
    assert (tmp_path / "shardscope_summary.json").read_text() == first
    assert json.loads(first)["global_step"] == 1 and not llama._forward_pre_hooks


def test_a_reference_forward_inside_the_instrumented_step(llama, tiny_llama, tmp_path, caplog):
    """DPO's order, policy forward, reference forward (no_grad), then backward, in the step MemTracker tracks: the
    loop runs on, the peak is measured, the reference counted as held."""
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(llama.parameters(), lr=1e-4)
    with caplog.at_level(logging.WARNING, logger="shardscope"):
        with ShardingProfiler(llama, optimizer, output_dir=tmp_path, **UNSAMPLED, memory_step=2,
                              frozen_models={"reference": reference}) as profiler:
            for seed in range(3):
                batch = padded(seed=seed)
                loss = llama(**batch).loss
                with torch.no_grad():
                    reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                profiler.step(batch)
    rank = read_summary(tmp_path / "shardscope_summary.json")["ranks"][0]
    assert rank["peak_tensor_bytes"] > 0 and sum(rank["peak_breakdown"].values()) == rank["peak_tensor_bytes"]
    assert rank["frozen_models_bytes"] == sum(p.numel() * p.element_size() for p in reference.parameters())
    assert not [r for r in caplog.records if "warned once" in r.getMessage()]


def test_default_sampled_steps_in_a_custom_loop(llama, tmp_path):
    """With the defaults, step 3 carries the tensor tracker and the collective counter together and step 4 the
    timer; both leave the loop as they found it (a later counter counts alone) and out of throughput."""
    from shardscope.measure.comm_count import CollectiveCounter

    optimizer = torch.optim.SGD(llama.parameters(), lr=1e-3)
    with ShardingProfiler(llama, optimizer, output_dir=tmp_path) as profiler:
        train(llama, optimizer, profiler, [padded(seed=i) for i in range(5)])
    rank = read_summary(tmp_path / "shardscope_summary.json")["ranks"][0]
    assert rank["peak_tensor_bytes"] > 0 and rank["comm"] == {} and rank["time_breakdown"]["timed_steps"] == 1
    assert rank["throughput"]["samples"] == 2 * 3  # steps 1, 2 and 5
    with CollectiveCounter() as counter:  # no mode left behind on torch's dispatch stack
        pass
    assert torch._C._len_torch_dispatch_stack() == 0 and counter.result()["comm"] == {}


def test_the_metric_table_carries_each_row_through_the_gather_into_the_summary_and_the_logs():
    """Each row of `metrics.METRICS` reads the fields it declares from one measurement's readings (none left NaN when
    every source was read), writes its summary key back from them, and the logs reduce exactly the rows that say so."""
    import contextlib
    import math
    from types import SimpleNamespace

    from shardscope.measure import metrics, step_log
    from shardscope.measure.run_facts import RunFacts
    from shardscope.measure.step_log import StepLog
    from shardscope.measure.throughput import WindowTotals

    state = SimpleNamespace(total={"params": 40, "grads": 40, "optimizer": 80}.get, trainable_params=40,
                            by_device={"params": {"cpu": 40}, "grads": {"cpu": 40}, "optimizer": {"cpu": 80}})
    breakdown = dict.fromkeys(("parameters", "gradients", "optimizer", "activations", "temporaries", "buffers"), 10)
    timed = {"forward_s": 0.2, "backward_s": 0.4, "optimizer_s": 0.1, "optimizer_update_s": 0.05, "comm_s": 0.2,
             "exposed_comm_s": 0.1, "data_wait_s": 0.1, "other_s": 0.1, "step_s": 1.0, "library_s": 0.0}
    readings = metrics.Readings(
        cuda=False, state=state, frozen={"reference": 12}, memory={"cpu_peak_rss_bytes": 1000},
        memory_step={"peak_tensor_bytes": 60, "peak_breakdown": breakdown, "peak_phase": "backward",
                     "peak_step": {"micro_batch": 2, "seq_len": 8, "image_size": None, "gradient_checkpointing": False}},
        window=WindowTotals(4, 32, 6400.0, 2.0, 1.5), durations=[1.0, 1.0],
        comm={"comm": {"all_reduce": {"calls": 1, "bytes": 40, "sent_bytes": 40}}, "comm_sent_bytes_per_step": 40,
              "comm_padded_tokens": 16}, timed=[timed], steps=StepLog())
    for step, (tokens, seq_len, measured) in enumerate([(10, 8, None), (12, 8, {"peak_tensor_bytes": 60})], 1):
        readings.steps.add(tokens, 2, seq_len)  # 2 rows of 8: 16 padded tokens a step
        readings.steps.close(step, measured)
    guards = {m.source: contextlib.nullcontext() for m in metrics.METRICS}
    facts = RunFacts({"strategy": "ddp"}, torch.device("cpu"), "fp32", peak_flops=1e4)
    mine = metrics.read(readings, guards, ("reference",), summary=True)
    assert tuple(mine) == metrics.fields(("reference",), summary=True)
    unmeasured = [k for k, v in mine.items() if math.isnan(v)]  # a text model's image size; the measured steps past 1
    assert unmeasured == ["peak_step_image_size"] + list(step_log.MEASURED_FIELDS[len(step_log.STEP_KEYS):])
    rank = metrics.written(mine, facts, guards, summary=True)
    assert list(rank) == [m.key for m in metrics.METRICS] and None not in rank.values()
    assert (rank["params_bytes"], rank["frozen_models"], rank["frozen_models_bytes"]) == (40, {"reference": 12}, 12)
    assert rank["peak_memory_bytes"] == 60 and rank["peak_phase"] == "backward" and rank["peak_breakdown"] == breakdown
    assert rank["throughput"]["mfu"] == pytest.approx(6400 / 2 / 1e4) and rank["time_breakdown"]["timed_steps"] == 1
    assert rank["comm"] == readings.comm["comm"] and rank["comm_padded_tokens"] == 16
    worst = {"step": 2, "tokens": 12, "padded_tokens": 16, "peak_tensor_bytes": 60}
    assert rank["worst_step"] == worst and rank["measured_steps"] == [worst]
    assert rank["padding_waste"] == pytest.approx(32 / 22 - 1)

    logged = metrics.log_metrics([metrics.written(metrics.read(readings, guards, ("reference",), summary=False),
                                                  facts, guards, summary=False)] * 2)
    names = {name for m in metrics.METRICS for _, name in m.reductions()}
    assert set(logged) == {f"shardscope/{n}_{s}" for n in names for s in ("min", "max", "mean")} | {
        "shardscope/samples_per_s", "shardscope/tokens_per_s"}
    assert logged["shardscope/peak_tensor_bytes_max"] == 60 and logged["shardscope/samples_per_s"] == 2 * 4 / 2.0
    assert (logged["shardscope/step_tokens_max"], logged["shardscope/step_padded_tokens_max"]) == (12, 16)
