"""Profiling beyond the plain Trainer, on 2 CPU ranks through the launchers users use: TRL's SFTTrainer, DPOTrainer
and LoRA-DPO with the callback (DDP and ZeRO-3), examples/accelerate_loop.py (DDP and ZeRO-3 through
`accelerator.prepare`) and examples/fsdp2_loop.py (torch `fully_shard`, a frozen reference) with ShardingProfiler.

Three launches in all (DDP and ZeRO-3 each run the Accelerate loop, then SFT, DPO (and LoRA-DPO) in one process,
then test_loop_shapes' shapes in the same launch: tests/loop_runs.py; torchrun runs the FSDP2 loop); each is shared
by every assertion on it. Bytes are compared with an independent count made in the launched process
(tests/workers/train_tiny.py's, through each library's own accessors).
"""
import inspect
import json

import pytest
from launch import ROOT, torchrun_launch
from loop_runs import TRL_STEPS as STEPS

from shardscope import ShardingProfiler, cli

BYTES_TOLERANCE = 0.01  # the bound; the counts agree exactly today (both count the same live tensors)
# Trainer's train_samples_per_second also times its set-up before the first step (callbacks' on_train_begin,
# the profiler's included); the profiler's window starts at that first step. A few % at this run length.
RATE_TOLERANCE = 0.05
# steps the examples' profilers instrument by default (memory, collectives, time): left out of throughput
DEFAULTS = inspect.signature(ShardingProfiler).parameters
INSTRUMENTED = {DEFAULTS[name].default for name in ("memory_step", "comm_step", "time_step")}


def _plain(per_step):
    """The sum over the steps that count towards throughput (1-based steps not instrumented)."""
    return sum(v for step, v in enumerate(per_step, start=1) if step not in INSTRUMENTED)


def _facts(run_dir):
    return [json.loads((run_dir / f"facts_rank{r}.json").read_text()) for r in range(2)]


def _summary(run_dir):
    return json.loads((run_dir / "shardscope_summary.json").read_text())


@pytest.fixture(scope="module")
def trl_runs(loop_runs):
    """`trl_runs(config)`: tests/workers/train_trl.py's folder in the launch under a shipped config
(tests/loop_runs.py): examples/accelerate_loop.py (folder `loop`), then SFT, DPO and, under DDP, LoRA-DPO."""
    return lambda config: loop_runs(config) / "trl"


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """examples/fsdp2_loop.py under torchrun, through tests/workers/run_example.py."""
    out = tmp_path_factory.mktemp("fsdp2_loop")
    torchrun_launch(ROOT / "tests" / "workers" / "run_example.py", ["fsdp2_loop"], out).check()
    return out


@pytest.mark.parametrize("config, strategy", [("ddp", "ddp"), ("zero3", "zero3")])
def test_trl_bytes_match_an_independent_count_reference_model_included(trl_runs, config, strategy):
    out = trl_runs(config)
    for name in ("sft", "dpo"):
        summary, facts = _summary(out / name), _facts(out / name)
        assert summary["strategy"] == strategy and summary["world_size"] == 2 and summary["global_step"] == STEPS
        for rank, fact in zip(summary["ranks"], facts):
            for key in ("params_bytes", "optimizer_bytes"):
                assert rank[key] == pytest.approx(fact[key], rel=BYTES_TOLERANCE), (name, key)
            if name == "sft":
                assert rank["frozen_models"] == {} and rank["frozen_models_bytes"] == 0
            else:  # DPO's reference: a full fp32 copy under DDP, its own engine's partitions under ZeRO-3
                assert rank["frozen_models"]["reference"] == pytest.approx(fact["reference_bytes"], rel=BYTES_TOLERANCE)
                assert rank["frozen_models_bytes"] == rank["frozen_models"]["reference"] == rank["params_bytes"]
    sft = _summary(out / "sft")["ranks"][0]
    full = sft["params_bytes"] if config == "ddp" else _summary(trl_runs("ddp") / "sft")["ranks"][0]["params_bytes"]
    assert (sft["params_bytes"] < 0.7 * full) is (config == "zero3")  # ZeRO-3 really shards the tiny model


@pytest.mark.parametrize("config", ["ddp", "zero3"])
def test_trl_samples_are_what_the_trainer_counts_and_tokens_those_fed(trl_runs, config):
    out = trl_runs(config)
    for name in ("sft", "dpo", "dpo_lora") if config == "ddp" else ("sft", "dpo"):
        summary, facts = _summary(out / name), _facts(out / name)
        throughput = [r["throughput"] for r in summary["ranks"]]
        # one preference pair is one sample: 2 per step per rank, as the Trainer counts
        assert [t["samples"] for t in throughput] == [2 * STEPS] * 2, name
        samples_per_s = sum(t["samples_per_s"] for t in throughput)
        assert samples_per_s == pytest.approx(facts[0]["train_samples_per_second"], rel=RATE_TOLERANCE), name
        # the Trainer's own count of the non-padding tokens fed (num_input_tokens_seen, all ranks) and a
        # training_step wrapper's on each rank: counted once, as fed; the reference pass (a second model, or LoRA's
        # adapter-disabled pass of the same one) adds none
        assert [t["tokens"] for t in throughput] == [f["tokens_fed"] for f in facts], name
        assert sum(t["tokens"] for t in throughput) == facts[0]["num_input_tokens_seen"], name


def test_dpo_flops_include_the_reference_forward(trl_runs):
    """Per training token: 6 FLOPs per matmul parameter for the policy, +2 for the reference's forward."""
    out = trl_runs("ddp")
    config = json.loads((out / "assets" / "rank0" / "tiny-llama" / "config.json").read_text())
    summary = _summary(out / "dpo")
    matmul_params = summary["model"]["params_total"] - config["vocab_size"] * config["hidden_size"]  # untied lookup
    for rank in summary["ranks"]:
        t = rank["throughput"]
        per_token = t["tflops_per_device"] * 1e12 * t["seconds"] / t["tokens"]
        # (2%: the attention term, 12+4 layers*d_attn*seq per token, is under 1% at these lengths)
        assert per_token / (6 * matmul_params) == pytest.approx(8 / 6, rel=0.02)
    assert "forward that does not train" in rank["throughput"]["flops_convention"]


@pytest.mark.parametrize("config, strategy", [("ddp", "ddp"), ("zero3", "zero3")])
def test_accelerate_loop_counts_bytes_and_tokens_fed(trl_runs, config, strategy):
    out = trl_runs(config) / "loop"
    summary = _summary(out)
    assert summary["strategy"] == strategy and summary["global_step"] == 8
    for rank, fact in zip(summary["ranks"], _facts(out)):
        for key in ("params_bytes", "optimizer_bytes"):
            assert rank[key] == pytest.approx(fact[key], rel=BYTES_TOLERANCE), key
        fed, rows = fact["tokens_fed"], fact["samples_fed"]
        # every step's non-padding tokens, once, less the instrumented steps (not throughput)
        assert rank["throughput"]["tokens"] == _plain(fed) and rank["throughput"]["samples"] == _plain(rows)
        assert rank["peak_tensor_bytes"] > 0


def test_fsdp2_loop_shards_the_trained_and_the_frozen_model(fsdp2_run):
    out = fsdp2_run
    summary = _summary(out)
    assert summary["strategy"] == "fsdp_full_shard" and summary["strategy_detail"]["fsdp_version"] == 2
    whole = summary["model"]["params_total"] * 4  # fp32
    for rank, fact in zip(summary["ranks"], _facts(out)):
        for key in ("params_bytes", "optimizer_bytes"):
            assert rank[key] == pytest.approx(fact[key], rel=BYTES_TOLERANCE), key
        assert rank["frozen_models"]["reference"] == pytest.approx(fact["reference_bytes"], rel=BYTES_TOLERANCE)
        assert rank["params_bytes"] < 0.6 * whole and rank["frozen_models"]["reference"] < 0.7 * whole  # shards
        fed = fact["tokens_fed"]
        assert rank["throughput"]["tokens"] == _plain(fed)


def test_report_reads_every_profiled_loop(fsdp2_run, trl_runs, tmp_path, capsys):
    runs = [trl_runs("ddp") / "loop", fsdp2_run, trl_runs("ddp") / "dpo"]
    assert cli.main(["report", *map(str, runs), "--output", str(tmp_path / "report")]) == 0
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert [r["status"] for r in report] == ["ok"] * 3
    assert [r["strategy"] for r in report] == ["ddp", "fsdp_full_shard", "ddp"]
    frozen = [r["frozen_models_bytes"]["max"] for r in report]
    assert frozen[0] == 0 and frozen[1] > 0 and frozen[2] == _summary(runs[2])["ranks"][0]["frozen_models_bytes"]
    assert "frozen models/rank" in (tmp_path / "report" / "report.md").read_text()
    # plan --against puts the DPO run's reference beside a planned frozen copy (DDP: a whole fp32 copy)
    capsys.readouterr()
    assert cli.main(["plan", "--against", str(runs[2] / "shardscope_summary.json"), "--json"]) == 0
    components = {c["component"]: c for c in json.loads(capsys.readouterr().out)["ranks"][0]["components"]}
    assert components["frozen_models_bytes"]["rel_diff"] == pytest.approx(0, abs=0.01)
