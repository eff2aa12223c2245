"""Expert load (measure/expert_load.py): the tokens the profiler counts per expert, per MoE layer and step, held
against a count from the router logits of the same batch, in one process (Qwen3-MoE and gpt-oss: both run on CPU);
activation checkpointing's recompute is not counted twice."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GptOssConfig, Qwen3MoeConfig

from shardscope import ShardingProfiler
from shardscope.measure.expert_load import load_summary
from shardscope.report import expert_section
from shardscope.report.compare import load_run

EXPERTS, TOP_K, LAYERS = 8, 2, 2


def tiny_moe(family: str):
    """A tiny Qwen3-MoE, or a tiny gpt-oss (its kernels run on CPU: eager attention with sinks, grouped_mm experts)."""
    shared = dict(vocab_size=256, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts_per_tok=TOP_K, output_router_logits=True)
    if family == "gpt_oss":
        config = GptOssConfig(**shared, intermediate_size=64, num_local_experts=EXPERTS, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"])
    else:
        config = Qwen3MoeConfig(**shared, intermediate_size=128, moe_intermediate_size=32, num_experts=EXPERTS)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def counted_from_logits(router_logits) -> list[list[int]]:
    """Tokens per expert per layer from the model's returned router logits: each token's top-k experts."""
    return [torch.bincount(logits.topk(TOP_K, dim=-1).indices.reshape(-1), minlength=EXPERTS).tolist()
            for logits in router_logits]


@pytest.mark.parametrize("family, checkpointing", [("qwen3_moe", False), ("qwen3_moe", True), ("gpt_oss", False)])
def test_logged_expert_load_equals_the_router_logits_count(tmp_path, family, checkpointing):
    model = tiny_moe(family)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters())
    batches = [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    expected = []
    with ShardingProfiler(model, optimizer, output_dir=tmp_path, every_n_steps=1) as profiler:
        for ids in batches:
            out = model(input_ids=ids, labels=ids)
            expected.append((counted_from_logits(out.router_logits), float(out.aux_loss)))
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            profiler.step(ids)
    summary = json.loads((tmp_path / "shardscope_summary.json").read_text())
    load = summary["ranks"][0]["expert_load"]
    assert summary["instruments"]["expert load"] == "ok"
    assert load["layers"] == [f"model.layers.{i}.mlp" for i in range(LAYERS)] and load["num_experts"] == [EXPERTS] * 2
    for step, (tokens, aux) in enumerate(expected, start=1):
        logged = load["steps"][str(step)]
        assert logged["tokens"] == tokens
        assert all(sum(layer) == ids.numel() * TOP_K for layer in logged["tokens"])  # each token routed to k
        assert logged["aux_loss"] == pytest.approx(aux)
        assert {k: logged[k] for k in load_summary(tokens)} == load_summary(tokens)
    row = load_run(tmp_path)  # `shardscope report`'s row of this run, and its expert-load section
    worst = max((s for s in load["steps"].values()), key=lambda s: s["max_over_mean"])
    assert row["expert_load"]["max_over_mean"] == worst["max_over_mean"] and row["expert_load"]["steps"] == 2
    section = "\n".join(expert_section.markdown_lines([row]))
    assert "## Expert load (mixture of experts)" in section and f"{worst['max_over_mean']:.2f}" in section


def test_load_summary_names_the_busiest_expert():
    summary = load_summary([[4, 4, 4, 4], [1, 1, 10, 4]])
    assert summary["max_over_mean"] == 10 / 4 and summary["max_over_mean_by_layer"] == [1.0, 2.5]
    assert (summary["busiest_layer"], summary["busiest_expert"], summary["busiest_tokens"]) == (1, 2, 10)
