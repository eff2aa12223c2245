"""Every single-node shipped accelerate config, launched for real on 2 CPU ranks: does it shard as promised?

One run per config (session-scoped) serves two checks: the profiler's per-rank bytes equal what the
worker counts independently from the same live objects, and the bytes follow the strategy's promise
relative to the full model (a silent fallback to DDP fails here even though the run exits 0).
"""
import json

import pytest

from launch import ROOT, accelerate_launch
from shardscope.configs import shipped_configs

SINGLE_NODE = sorted(c.name for c in shipped_configs() if c.kind == "accelerate" and not c.multinode)
WORKER = ROOT / "tests" / "workers" / "train_tiny.py"

# What each strategy promises on 2 ranks, as fractions of the full model's fp32 bytes P (params) and
# of the full AdamW state M = 2P (moments); DeepSpeed ZeRO-1/2/3 also keep an fp32 master partition
# even when training in fp32 (P/2). ZeRO-3 additionally keeps parameters smaller than
# `stage3_param_persistence_threshold` whole on every rank (added below), and with offload it holds a
# CPU copy of the gradient partition beside the device one.
#                   strategy name          params grads  moments master
PROMISES = {
    "ddp":                ("ddp",                1.0, 1.0, 1.0, 0.0),
    "fsdp_full_shard":    ("fsdp_full_shard",    0.5, 0.5, 0.5, 0.0),
    "fsdp1_full_shard":   ("fsdp_full_shard",    0.5, 0.5, 0.5, 0.0),
    "fsdp_shard_grad_op": ("fsdp_shard_grad_op", 0.5, 0.5, 0.5, 0.0),  # params resharded after backward
    "fsdp_offload":       ("fsdp_offload",       0.5, 0.5, 0.5, 0.0),
    "zero1":              ("zero1",              1.0, 0.5, 0.5, 0.5),
    "zero2":              ("zero2",              1.0, 0.5, 0.5, 0.5),
    "zero2_offload":      ("zero2_offload",      1.0, 0.5, 0.5, 0.5),
    "zero3":              ("zero3",              0.5, 0.5, 0.5, 0.5),
    "zero3_offload":      ("zero3_offload",      0.5, 1.0, 0.5, 0.5),
}


ZERO3_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default; the inline accelerate yamls keep it


@pytest.fixture(scope="session")
def shard_llama(tmp_path_factory):
    """A small Llama whose bytes sit mostly in tensors above ZeRO-3's persistence threshold."""
    from shardscope.tiny import make_causal_lm

    path = tmp_path_factory.mktemp("shard_llama")
    make_causal_lm(path, "llama", vocab_size=1600, intermediate_size=1600)
    return path


@pytest.fixture(scope="session")
def strategy_runs(shard_llama, tmp_path_factory):
    """Launch each config once, lazily; returns {config: (summary, [independent count per rank])}."""
    cache = {}

    def run(name):
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            args = ["--model", shard_llama, "--max_steps", 3, "--logging_steps", 1, "--per_device_train_batch_size",
                    2, "--use_cpu", "--report_to", "none", "--save_strategy", "no"]
            accelerate_launch(ROOT / "accelerate_configs" / f"{name}.yaml", WORKER, args, out).check()
            summary = json.loads((out / "shardscope_summary.json").read_text())
            independent = [json.loads((out / f"independent_count_rank{r}.json").read_text()) for r in range(2)]
            cache[name] = summary, independent
        return cache[name]

    return run


@pytest.fixture(scope="session")
def model_bytes(shard_llama):
    """(all parameter bytes, bytes of parameters ZeRO-3 keeps whole on every rank), in fp32."""
    from transformers import AutoModelForCausalLM

    sizes = [p.numel() for p in AutoModelForCausalLM.from_pretrained(shard_llama).parameters()]
    return 4 * sum(sizes), 4 * sum(n for n in sizes if n < ZERO3_PERSISTENCE_THRESHOLD)


def test_every_single_node_config_has_a_promise():
    assert SINGLE_NODE and set(SINGLE_NODE) == set(PROMISES)


@pytest.mark.launch
@pytest.mark.parametrize("config", SINGLE_NODE)
def test_config_shards_as_promised(config, strategy_runs, model_bytes):
    summary, independent = strategy_runs(config)
    strategy, params, grads, moments, master = PROMISES[config]
    P, persistent = model_bytes
    assert persistent < 0.05 * P  # so "about half" below really means sharded
    assert summary["world_size"] == 2 and len(summary["ranks"]) == 2
    assert summary["strategy"] == strategy
    for rank, counted in zip(summary["ranks"], independent):
        assert rank["params_bytes"] == counted["params_bytes"]
        assert rank["optimizer_bytes"] == counted["optimizer_bytes"]
        expected_params = params * P + (persistent if strategy.startswith("zero3") else 0)
        assert rank["params_bytes"] == pytest.approx(expected_params, rel=0.01)
        assert rank["grads_bytes"] == pytest.approx(grads * P, rel=0.01)
        # Adam's per-tensor step counters add a few bytes on top of moments and master copies.
        assert rank["optimizer_bytes"] == pytest.approx((2 * moments + master) * P, rel=0.01)
