"""A tiny Qwen3-MoE (fused experts, 8 of 2 per token) on 2 CPU ranks under ZeRO-3 and FSDP2: tests/strategy_runs.py's
MOE runs, trained together in an accelerate launch of their own. Each rank's model states as the worker
counts them independently; the planned peak within 5% of the measured one; the expert load the profiler logged at
the first step, summed over the ranks, equal to a count from the router logits of the whole data set (the two
ranks' first batches) in one process at the same initial weights."""

import pytest
import torch

from strategy_runs import MOE_CONFIGS, MOE_FLAGS
from test_peak_runs import held_peaks
from test_strategies import fsdp2_shard_bytes

pytestmark = pytest.mark.launch


def moe_run(strategy_runs, config):
    return strategy_runs(config, "moe_qwen3", flags=MOE_FLAGS)


@pytest.mark.parametrize("config", MOE_CONFIGS)
def test_model_states_are_exact_per_rank(config, strategy_runs, parameter_shapes):
    summary, independent, _ = moe_run(strategy_runs, config)
    assert summary["world_size"] == 2 and summary["strategy"] == config
    for rank, counted in zip(summary["ranks"], independent):
        if config == "fsdp_full_shard":  # FSDP2: padded row chunks of every tensor, the fused experts' included
            local, padded = fsdp2_shard_bytes(parameter_shapes("moe_qwen3"), rank["rank"])
            assert (rank["params_bytes"], counted["params_bytes"]) == (padded, local)
        else:
            assert rank["params_bytes"] == counted["params_bytes"]
        assert rank["optimizer_bytes"] == counted["optimizer_bytes"]


@pytest.mark.parametrize("config", MOE_CONFIGS)
def test_planned_peak_within_5_percent(config, strategy_runs):
    _, _, folder = moe_run(strategy_runs, config)
    held_peaks(folder / "shardscope_summary.json", config, "fp32",
               {"micro_batch": 2, "seq_len": MOE_FLAGS[1], "gradient_checkpointing": False})


@pytest.mark.parametrize("config", MOE_CONFIGS)
def test_logged_expert_load_equals_the_router_logits_count(config, strategy_runs, strategy_model):
    from transformers import AutoModelForCausalLM

    summary, _, _ = moe_run(strategy_runs, config)
    assert summary["instruments"]["expert load"] == "ok"
    first = [rank["expert_load"]["steps"]["1"]["tokens"] for rank in summary["ranks"]]
    logged = [[sum(counts) for counts in zip(*layers)] for layers in zip(*first)]  # both ranks' first step
    model = AutoModelForCausalLM.from_pretrained(strategy_model("moe_qwen3"))
    samples, seq_len = MOE_FLAGS[3], MOE_FLAGS[1]
    ids = torch.randint(3, model.config.vocab_size, (samples, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the worker's data set (train_tiny.py RandomTokens): its 4 samples are both first batches
        logits = model(input_ids=ids, output_router_logits=True).router_logits
    k, experts = model.config.num_experts_per_tok, model.config.num_experts
    counted = [torch.bincount(layer.topk(k, dim=-1).indices.reshape(-1), minlength=experts).tolist()
               for layer in logits]
    assert logged == counted
    for rank in summary["ranks"]:
        step = rank["expert_load"]["steps"]["1"]
        assert step["max_over_mean"] >= 1 and step["busiest_tokens"] == max(map(max, step["tokens"]))
