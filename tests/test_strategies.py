"""Every single-node shipped accelerate config, launched for real on 2 CPU ranks: does it shard as promised?

One run per config (session-scoped) serves two checks: the profiler's per-rank bytes equal what the
worker counts independently from the same live objects, and the bytes follow the strategy's promise
relative to the full model (a silent fallback to DDP fails here even though the run exits 0).
"""
import math

import pytest

from strategy_runs import strategy_model_for as model_for
from shardscope.configs.catalog import shipped_configs

# tp.yaml and fsdp_tp.yaml shard while the model loads (transformers DistributedConfig), which the recipe
# does and this worker does not: test_tensor_parallel.py runs them (and the multi-node hsdp_tp.yaml) through the recipe.
TENSOR_PARALLEL = {"tp", "fsdp_tp"}
# The sequence splits: zero3_sp trains through the SFT recipe in test_sequence_parallel.py (its losses, bytes and peak
# held there); torch context parallelism (fsdp_cp) has no CPU attention kernel: its config is loaded, not trained.
SEQUENCE_SPLIT = {"zero3_sp", "fsdp_cp"}
SINGLE_NODE = sorted(c.name for c in shipped_configs()
                     if c.kind != "slurm" and not c.multinode and c.name not in TENSOR_PARALLEL | SEQUENCE_SPLIT)

# What each strategy promises on 2 ranks, as fractions of the full model's fp32 bytes P (params) and
# of the full AdamW state M = 2P (moments); DeepSpeed ZeRO-1/2/3 also keep an fp32 master partition
# even when training in fp32 (P/2). ZeRO-3 additionally keeps parameters at or below
# `stage3_param_persistence_threshold` whole on every rank (added below), and with offload it holds a
# CPU copy of the gradient partition beside the device one.
#                         strategy name          params grads moments master
ZERO = {
    "zero1":              ("zero1",              1.0, 0.5, 0.5, 0.5),
    "zero2":              ("zero2",              1.0, 0.5, 0.5, 0.5),
    "zero2_offload":      ("zero2_offload",      1.0, 0.5, 0.5, 0.5),
    "zero3":              ("zero3",              0.5, 0.5, 0.5, 0.5),
    "zero3_offload":      ("zero3_offload",      0.5, 1.0, 0.5, 0.5),
}
FULL_SHARD = ("fsdp_full_shard", 0.5, 0.5, 0.5, 0.0)
PROMISES = {
    "ddp":                      ("ddp",                1.0, 1.0, 1.0, 0.0),
    "fsdp_full_shard":          FULL_SHARD,
    "fsdp1_full_shard":         FULL_SHARD,
    "fsdp_qlora":               FULL_SHARD,  # FSDP2 full shard; its 4-bit base: tests/test_quantized.py
    "fsdp_shard_grad_op":       ("fsdp_shard_grad_op", 0.5, 0.5, 0.5, 0.0),  # params resharded after backward
    "fsdp_offload":             ("fsdp_offload",       0.5, 0.5, 0.5, 0.0),
    "fsdp/llama_full_shard":    FULL_SHARD,
    "fsdp/mistral_full_shard":  FULL_SHARD,
    "fsdp/dinov2_full_shard":   FULL_SHARD,
    "fsdp/llama_shard_grad_op": ("fsdp_shard_grad_op", 0.5, 0.5, 0.5, 0.0),
    "fsdp/llama_offload":       ("fsdp_offload",       0.5, 0.5, 0.5, 0.0),
    **ZERO,
    **{f"ds/{name}": promise for name, promise in ZERO.items()},
}


def fsdp2_shard_bytes(shapes, rank, world=2) -> tuple[int, int]:
    """fp32 bytes of `rank`'s FSDP2 shards: (its rows, the padded storage it allocates). Each tensor is
    split into ceil(rows / world)-row chunks; a rank whose chunk is short (or empty) pads it."""
    local = padded = 0
    for shape in shapes:
        chunk = math.ceil(shape[0] / world)
        rows = max(0, min(chunk, shape[0] - rank * chunk))
        local, padded = local + rows * math.prod(shape[1:]), padded + chunk * math.prod(shape[1:])
    return 4 * local, 4 * padded


def test_every_single_node_config_has_a_promise():
    from test_tensor_parallel import RUNS

    assert SINGLE_NODE and set(SINGLE_NODE) == set(PROMISES)
    multinode = {c.name for c in shipped_configs() if c.multinode}
    assert TENSOR_PARALLEL == {config for config, *_ in RUNS.values()} - multinode


@pytest.mark.launch
@pytest.mark.parametrize("config", SINGLE_NODE)
def test_config_shards_as_promised(config, strategy_runs, parameter_shapes):
    summary, independent, _ = strategy_runs(config, model_for(config))
    strategy, params, grads, moments, master = PROMISES[config]
    shapes = parameter_shapes(model_for(config))
    sizes = [math.prod(shape) for shape in shapes]
    P = 4 * sum(sizes)
    threshold = summary["strategy_detail"].get("stage3_param_persistence_threshold", 0)
    persistent = 4 * sum(n for n in sizes if n <= threshold)
    assert persistent < 0.05 * P  # so "about half" below really means sharded
    assert summary["world_size"] == 2 and len(summary["ranks"]) == 2
    assert summary["strategy"] == strategy
    fsdp2 = summary["strategy_detail"].get("fsdp_version") == 2
    for rank, counted in zip(summary["ranks"], independent):
        if fsdp2:  # parameters in padded row chunks; Adam's moments follow the unpadded local rows
            local, padded = fsdp2_shard_bytes(shapes, rank["rank"])
            expected_params, expected_moments, padding = padded, local, padded - local
        else:
            expected_params = params * P + (persistent if strategy.startswith("zero3") else 0)
            expected_moments, padding = moments * P, 0
        assert rank["params_bytes"] == counted["params_bytes"] + padding  # the worker counts elements
        assert rank["optimizer_bytes"] == counted["optimizer_bytes"]
        assert rank["params_bytes"] == pytest.approx(expected_params, rel=0.01)
        assert rank["grads_bytes"] == pytest.approx(grads * P, rel=0.01)
        # Adam's per-tensor step counters add a few bytes on top of moments and master copies.
        assert rank["optimizer_bytes"] == pytest.approx(2 * expected_moments + master * P, rel=0.01)
        # DDP's reducer buckets, allocated where torch's MemTracker does not see them, are a part of the measured
        # peak: the profiler reads the reducer's buckets, the worker sums the gradients they hold; exact (same bytes)
        if summary["strategy_detail"].get("fsdp_version") == 1:  # MemTracker refuses FSDP1's flat parameters
            assert rank["peak_breakdown"] is None and "FSDP1" in summary["instruments"]["memory"]
            continue
        assert rank["peak_breakdown"]["buffers"] == counted.get("ddp_bucket_bytes", 0)
        assert rank["peak_tensor_bytes"] == sum(rank["peak_breakdown"].values())
        assert (rank["peak_breakdown"]["buffers"] > 0) == (strategy == "ddp")
    if strategy.startswith("zero"):  # the reduce bucket the summary records (and plan_vs_run plans) is the engine's:
        # DeepSpeed's default 5e8 elements under the inline yamls, the Trainer's hidden^2 where a JSON says "auto"
        detail = summary["strategy_detail"]
        assert detail["reduce_bucket_size"] == independent[0]["reduce_bucket_size"] > 0
        assert detail.get("overlap_comm", independent[0]["overlap_comm"]) == independent[0]["overlap_comm"]
        assert ("overlap_comm" in detail) == (not strategy.startswith("zero3"))  # ZeRO-3 keeps it as a stream only
        if not strategy.startswith("zero3"):  # ZeRO-1/2 all-gather the updated partitions in buckets of this size
            assert detail["allgather_bucket_size"] == independent[0]["allgather_bucket_size"] > 0
        if strategy.startswith("zero3"):  # read from the live ZeRO-3 optimizer, as the engine's config resolved them
            assert detail["prefetch_bucket_size"] == independent[0]["prefetch_bucket_size"] > 0
            assert detail["stage3_param_persistence_threshold"] == independent[0]["persistence_threshold"] > 0
            assert detail["stage3_max_reuse_distance"] == independent[0]["max_reuse_distance"] > 0


@pytest.mark.launch
def test_lora_counts_trainable_adapter_state_only(strategy_runs, strategy_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    summary, independent, _ = strategy_runs("ddp", "shard_llama", lora_r=4)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(strategy_model("shard_llama")),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    adapters = [p for p in model.parameters() if p.requires_grad]
    adapter_bytes = 4 * sum(p.numel() for p in adapters)
    all_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert summary["model"]["trainable_params"] == adapter_bytes // 4
    for rank, counted in zip(summary["ranks"], independent):
        assert rank["params_bytes"] == counted["params_bytes"] == all_bytes
        assert rank["trainable_params_bytes"] == adapter_bytes
        assert rank["grads_bytes"] == adapter_bytes  # frozen weights get no gradient
        assert rank["optimizer_bytes"] == counted["optimizer_bytes"] == 2 * adapter_bytes + 4 * len(adapters)
