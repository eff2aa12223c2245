"""`shardscope plan`: exact formulas on hand-computable cases, the 12 B/param rule of thumb vs 16 B/param,
DeepSpeed's own estimators, the shipped 7B/70B configs, the CLI contract and bad input."""
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from transformers import LlamaConfig

from shardscope import cli, plan_vs_run, units
from shardscope.plan import formulas, mesh, planner
from shardscope.model import spec as specs
from shardscope.errors import UsageError
from shardscope.plan.formulas import strategy_row
from shardscope.plan.mesh import LibraryKnobs, Setup
from shardscope.model.spec import ModelSpec, model_spec
from shardscope.plan.planner import estimate
from shardscope.strategy import STRATEGIES, TP_STRATEGIES
from dataclasses import replace

GB = 1e9
ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512)

# A model small enough to check by hand: three tensors of 500, 400 and 100 elements (dims 10 x 50,
# 10 x 40, 10 x 10); FSDP1 units are the same three groups.
HAND = ModelSpec(name="hand", params_total=1000, num_layers=2, hidden_size=10, num_heads=1, vocab_size=0,
                 largest_layer_params=500, unit_numels=(500, 400, 100),
                 tensor_shapes=((10, 50), (10, 40), (10, 10)))


def rows(result):
    return {r.strategy: r for r in result["rows"]}


# ----------------------------------------------------------------------------- counting
@pytest.mark.parametrize("tied", [False, True])
def test_tiny_llama_counted_on_meta_equals_hand_formula_and_real_model(tied):
    import torch
    from transformers import AutoModelForCausalLM

    config = LlamaConfig(**TINY, tie_word_embeddings=tied)
    spec = specs.spec_from_config(config)
    h, i, L, V = 64, 128, 2, 512
    per_layer = 4 * h * h + 3 * h * i + 2 * h  # q, k, v, o; gate, up, down; two RMSNorms
    assert spec.params_total == V * h * (1 if tied else 2) + L * per_layer + h
    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(config)  # real weights, for this tiny model only
    assert spec.params_total == sum(p.numel() for p in real.parameters())
    assert spec.unit_numels == (per_layer, per_layer, spec.params_total - 2 * per_layer)
    assert spec.largest_layer_params == V * h
    assert len(spec.tensor_shapes) == len(list(real.parameters()))


def test_shipped_configs_have_the_real_parameter_counts():
    assert model_spec("llama-2-7b").params_total == 6_738_415_616
    mistral = model_spec("mistral-7b")
    assert mistral.params_total == 7_241_732_096
    assert (mistral.num_kv_heads, mistral.intermediate_size, mistral.tied_embeddings) == (8, 14336, False)
    assert {"llama-2-70b", "llama-2-7b", "mistral-7b"} <= set(specs.shipped_models())


def test_70b_plans_without_parameter_memory():
    """How long this plan takes: benchmarks/plan_speed.py (a timing, not a test)."""
    model_spec("llama-2-7b")  # load the libraries first: only the plan's own memory is measured
    process = psutil.Process()
    rss = process.memory_info().rss
    spec = model_spec("llama-2-70b")
    result = estimate(spec, Setup(gpus_per_node=8, nodes=4, gpu_memory_bytes=80 * 2 ** 30,
                                  activation_checkpointing=True))
    assert spec.params_total == 68_976_648_192
    # One fp32 decoder layer alone would be 3.5 GB; the whole plan must not grow the process by 0.3 GB.
    assert process.memory_info().rss - rss < 300e6
    assert rows(result)["fsdp_full_shard"].fits and not rows(result)["ddp"].fits


# ----------------------------------------------------------------------------- exact formulas
def test_fp32_adamw_two_ranks_by_hand():
    setup = Setup(gpus_per_node=2, precision="fp32", seq_len=0)
    r = {s: strategy_row(s, HAND, setup, activations=0) for s in STRATEGIES}
    steps_torch, steps_zero = 4 * 3, 4 * 2  # one `step` tensor per param tensor / per ZeRO param group
    assert (r["ddp"].params_bytes, r["ddp"].grads_bytes, r["ddp"].optimizer_bytes) == (4000, 4000, 8000 + steps_torch)
    assert r["ddp"].buffers_detail["ddp_buckets"] == 4000
    # ZeRO-1/2 on fp32: full fp32 params, grad partition, and a separate fp32 partition copy + moments.
    for s in ("zero1", "zero2"):
        assert (r[s].params_bytes, r[s].grads_bytes, r[s].optimizer_bytes) == (4000, 2000, 500 * 12 + steps_zero)
    # ZeRO-3 on fp32: partitions of params and grads, an fp32 partition copy + moments; the step
    # flattens the grad partition into a new fp32 tensor. The 100-element tensor is at the persistence
    # threshold ("auto": 10 x hidden = 100), so every rank also keeps it whole: + 100 * 4.
    assert (r["zero3"].params_bytes, r["zero3"].grads_bytes, r["zero3"].optimizer_bytes) == (2400, 2000, 6000 + steps_zero)
    assert r["zero3"].buffers_detail["fp32_grad_copy_in_step"] == 2000
    assert r["zero2"].buffers_detail["fp32_grad_copy_in_step"] == 0  # fp32 grads: cast is a no-op
    for s in ("fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard"):
        assert (r[s].params_bytes, r[s].grads_bytes, r[s].optimizer_bytes) == (2000, 2000, 4000 + steps_torch)
    assert r["fsdp_full_shard"].buffers_bytes == 4 * 500 * 4 and r["fsdp_shard_grad_op"].buffers_bytes == 4000 + 2 * 2000
    assert r["fsdp_offload"].model_states_bytes == 0 and r["fsdp_offload"].cpu_bytes == 2000 + 2000 + 4012
    assert r["zero3_offload"].model_states_bytes == 400 and r["zero3_offload"].cpu_bytes == 2000 + 4000 + 6008


def test_padding_with_three_ranks():
    setup = Setup(gpus_per_node=3, precision="fp32")
    # ZeRO-3 pads each flattened tensor: ceil(500/3) + ceil(400/3) + ceil(100/3) = 167 + 134 + 34,
    # and keeps the persistent 100-element tensor whole as well.
    assert strategy_row("zero3", HAND, setup, activations=0).params_bytes == 335 * 4 + 100 * 4
    # FSDP2 splits dim 0 (10 rows -> 4 per rank): 4 * (50 + 40 + 10); FSDP1 pads each flat unit.
    assert strategy_row("fsdp_full_shard", HAND, setup, activations=0).params_bytes == 400 * 4
    fsdp1 = LibraryKnobs(fsdp_version=1)
    assert strategy_row("fsdp_full_shard", HAND, setup, activations=0, knobs=fsdp1).params_bytes == 335 * 4
    # ZeRO-1/2 pad the flat group to a multiple of 2 * N: ceil(1000 / 6) * 2 = 334 per rank.
    assert strategy_row("zero1", HAND, setup, activations=0).grads_bytes == 334 * 4
    # ZeRO-2 keeps whole every gradient that starts in or straddles into a rank's partition: rank 1's
    # [334, 668) holds the 500-element tensor (straddling 334) and the 400 starting at 500: 900.
    assert strategy_row("zero2", HAND, setup, activations=0).grads_bytes == 900 * 4


def test_hybrid_shard_shards_within_a_node_only():
    two_nodes = Setup(gpus_per_node=2, nodes=2, precision="fp32")
    hybrid = strategy_row("fsdp_hybrid_shard", HAND, two_nodes, activations=0)
    full = strategy_row("fsdp_full_shard", HAND, two_nodes, activations=0)
    # FSDP2 splits 10 rows: 5 per rank within a node (hybrid), ceil(10/4) = 3 per rank over 4 ranks.
    assert hybrid.params_bytes == 5 * 100 * 4 and full.params_bytes == 3 * 100 * 4


def test_bytes_per_parameter_convention():
    eb = formulas.element_bytes
    ds, torch_ = eb("bf16-mixed", "deepspeed"), eb("bf16-mixed", "torch")
    assert (ds.param, ds.grad, ds.master + ds.moments) == (2, 2, 12)  # 16 B/param
    assert eb("bf16-mixed", "deepspeed", fp32_grads=True).grad == 4  # 18 B/param
    assert (torch_.param, torch_.grad, torch_.master + torch_.moments) == (4, 4, 8)  # autocast: fp32 params
    assert eb("bf16-mixed", "fsdp").param == 4  # accelerate upcasts FSDP flat params to fp32
    assert (eb("fp32", "deepspeed", zero_stage=2).master, eb("fp32", "deepspeed", zero_stage=3).master) == (4, 4)
    assert eb("bf16-pure", "torch").moments == 4 and eb("bf16-pure", "deepspeed").master == 4
    assert eb("fp32", "torch", "sgd").moments == 0 and eb("fp32", "torch", "adamw-8bit").moments < 2.1


def test_lora_trainable_fraction_from_target_shapes():
    spec = specs.spec_from_config(LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=False))
    r, h, kv_out = 8, 64, 2 * 16  # 2 kv heads of dim 16
    setup = Setup(precision="fp32", lora_rank=r)
    c = formulas.counts(spec, setup)
    lora = 2 * (r * (h + h) + r * (h + kv_out))  # q_proj and v_proj in two layers
    assert (c.trainable, c.total) == (lora, spec.params_total + lora)
    ddp = strategy_row("ddp", spec, setup, activations=0)
    assert ddp.params_bytes == 4 * (spec.params_total + lora) and ddp.grads_bytes == 4 * lora
    assert ddp.optimizer_bytes == 8 * lora + 4 * 8  # 8 LoRA tensors, one `step` each
    all_linear = formulas.counts(spec, Setup(lora_rank=r, lora_targets=("all-linear",))).trainable
    assert all_linear > lora


def test_activation_formula_and_checkpointing():
    spec = specs.spec_from_count(1e9, layers=4, hidden=256, vocab=1000, heads=4)
    s, b, h, L, V = 128, 2, 256, 4, 1000
    act = formulas.activation_bytes(spec, Setup(seq_len=s, micro_batch=b, attention="eager"))
    layer = s * b * h * (34 + 5 * 4 * s / h)  # 16-bit, Korthikanti et al.
    assert act["per_layer"] == int(layer) and act["layers"] == int(L * layer)
    assert act["head"] == b * s * V * (4 + 2)
    ckpt = formulas.activation_bytes(spec, Setup(seq_len=s, micro_batch=b, activation_checkpointing=True))
    assert ckpt["layers"] == int(L * s * b * h * 2 + s * b * h * 34)
    assert formulas.activation_bytes(spec, Setup(seq_len=s, micro_batch=b, precision="fp32"))["layers"] == 2 * L * s * b * h * 34


def test_vision_tokens_from_image_and_patch():
    from transformers import Dinov2Config

    spec = specs.spec_from_config(Dinov2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                 intermediate_size=128, image_size=224, patch_size=14))
    assert spec.kind == "vision"
    assert formulas.activation_bytes(spec, Setup())["tokens_per_sample"] == (224 // 14) ** 2 + 1
    assert formulas.activation_bytes(spec, Setup(image_size=518))["tokens_per_sample"] == 37 ** 2 + 1


# ----------------------------------------------------------------------- 12 vs 16 B/param, ordering
def test_rule_of_thumb_12_and_planner_16_bytes_per_param():
    table = planner.convention_table(7e9, 4)
    assert [table["rule-of-thumb-12"][k] / GB for k in ("none", "zero1", "zero2", "zero3")] == [84, 42, 31.5, 21]
    assert [table["planner-16"][k] / GB for k in ("none", "zero1", "zero2", "zero3")] == [112, 49, 38.5, 28]


def test_planner_rows_for_7b_on_4_gpus():
    result = estimate(model_spec(params=7e9), Setup(gpus_per_node=4, gpu_memory_bytes=80 * 2 ** 30))
    r = rows(result)
    states = {s: r[s].model_states_bytes / GB for s in r}  # within the `step` counters' bytes
    assert states["ddp"] == pytest.approx(112, abs=1e-5)  # 16 B/param, unsharded
    # The 16 B/param sharded figures of the convention table: ZeRO-2 2P + 14P/N, ZeRO-3 16P/N.
    assert states["zero2"] == pytest.approx(38.5, abs=1e-5)
    assert states["zero3"] == pytest.approx(28, abs=1e-5)
    assert states["fsdp_full_shard"] == pytest.approx(28, abs=1e-5)
    # Inside the step DeepSpeed adds an fp32 copy of the grad partition: 4P/N.
    assert r["zero2"].buffers_detail["fp32_grad_copy_in_step"] == 4 * 7e9 / 4
    assert states["ddp"] > states["zero1"] >= states["zero2"] > states["zero3"]
    assert r["zero2_offload"].peak_bytes < r["zero2"].peak_bytes
    assert r["zero3_offload"].peak_bytes < r["zero3"].peak_bytes
    assert r["fsdp_offload"].peak_bytes < r["fsdp_full_shard"].peak_bytes < r["fsdp_shard_grad_op"].peak_bytes
    assert not r["ddp"].fits and result["recommendation"]["strategy"] == "fsdp_shard_grad_op"


def test_zero1_holds_full_grads_at_the_end_of_backward_and_between_accumulation_steps():
    # Stage 1 reduces once backward is over: the full 16-bit grads are live then, beside the reduce bucket; with
    # gradient accumulation they also stay through the next micro-batch, beside its activations.
    spec = model_spec("llama-3-8b")
    one = strategy_row("zero1", spec, Setup(gpus_per_node=4, precision="bf16-mixed"))
    ga = strategy_row("zero1", spec, Setup(gpus_per_node=4, precision="bf16-mixed", grad_accum_steps=4))
    full = 2 * spec.params_total
    assert one.peak_breakdown["gradients"] == ga.peak_breakdown["gradients"] == full
    assert one.peak_breakdown["activations"] == 0 < ga.peak_breakdown["activations"]
    assert ga.peak_bytes == one.peak_bytes + ga.peak_breakdown["activations"] + ga.peak_breakdown["temporaries"]


def test_mistral_7b_ddp_on_one_80gb_gpu_does_not_fit_fsdp_on_four_does():
    spec = model_spec("mistral-7b")
    one = rows(estimate(spec, Setup(gpus_per_node=1, gpu_memory_bytes=units.gpu_memory("A100-80"))))
    assert not one["ddp"].fits and one["ddp"].model_states_bytes > 100 * GB
    four = estimate(spec, Setup(gpus_per_node=4, gpu_memory_bytes=units.gpu_memory("A100-80")))
    assert rows(four)["fsdp_full_shard"].fits and not rows(four)["ddp"].fits
    assert four["recommendation"]["strategy"] in ("fsdp_shard_grad_op", "fsdp_full_shard")


def test_recommendation_walks_the_decision_tree():
    spec = model_spec(params=1e9)
    big = estimate(spec, Setup(gpu_memory_bytes=200 * 2 ** 30))
    assert big["recommendation"]["strategy"] == "ddp"
    small = Setup(gpus_per_node=8, gpu_memory_bytes=int(7.5 * 2 ** 30))  # SHARD_GRAD_OP/ZeRO-2 just miss
    tiny_gpu = estimate(spec, small)
    assert tiny_gpu["recommendation"]["strategy"] == "fsdp_full_shard"
    assert "ddp" in tiny_gpu["recommendation"]["reason"] and "fsdp_shard_grad_op" in tiny_gpu["recommendation"]["reason"]
    deepspeed = estimate(spec, replace(small, prefer="deepspeed"))
    assert deepspeed["recommendation"]["strategy"] == "zero3"
    nothing = estimate(spec, Setup(gpu_memory_bytes=2 * 2 ** 30))
    assert nothing["recommendation"]["strategy"] is None and "nothing fits" in nothing["recommendation"]["reason"]


# ----------------------------------------------------------------------------- DeepSpeed's estimators
def test_deepspeed_estimators_agree_where_conventions_coincide():
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    spec = model_spec("llama-2-7b")
    P, LL = spec.params_total, spec.largest_layer_params
    for gpus, nodes in ((4, 1), (8, 2)):
        setup = Setup(gpus_per_node=gpus, nodes=nodes, precision="bf16-mixed")
        r = {s: strategy_row(s, spec, setup) for s in STRATEGIES}
        kw = dict(num_gpus_per_node=gpus, num_nodes=nodes)
        # ZeRO-2: 2P + 18P/N = 16-bit params; 2 grads + their fp32 copy in the step; 4 master; 8 moments.
        _, gpu = estimate_zero2_model_states_mem_needs(P, cpu_offload=False, **kw)
        copy32 = r["zero2"].buffers_detail["fp32_grad_copy_in_step"]
        # DeepSpeed's estimate leaves out the gradients straddling partition edges, which ZeRO-2 keeps whole.
        straddle = r["zero2"].grads_bytes - r["zero1"].grads_bytes
        assert 0 < straddle <= 2 * 2 * max(d * k for d, k in spec.tensor_shapes)  # at most 2 whole tensors
        assert abs(r["zero2"].model_states_bytes - straddle + copy32 - gpu) <= 64
        _, gpu = estimate_zero2_model_states_mem_needs(P, cpu_offload=True, **kw)
        assert r["zero2_offload"].model_states_bytes == gpu == 2 * P
        # ZeRO-3 with everything offloaded: 4 * largest layer (gathered 16-bit params + their grads).
        # On the GPU the planner also keeps the persistent small tensors (norms) whole, which
        # DeepSpeed's estimate leaves out; they are all the offloaded row's model states.
        _, gpu, _ = estimate_zero3_model_states_mem_needs(P, LL, cpu_offload=True, cpu_offload_params=True, **kw)
        assert r["zero3_offload"].buffers_detail["gathered_layer"] == gpu
        assert r["zero3_offload"].model_states_bytes == r["zero3_offload"].params_bytes < 0.001 * P


def test_deepspeed_estimators_differ_where_pinned():
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    P, N = 7 * 10 ** 9, 4
    spec = model_spec(params=P)
    # 1. DeepSpeed assumes 16-bit weights; an fp32 run holds 4P of params and no fp32 grad copy:
    #    planner 4P + (4 + 12)P/N vs DeepSpeed 2P + 18P/N.
    fp32 = strategy_row("zero2", spec, Setup(gpus_per_node=N, precision="fp32"))
    _, ds_gpu = estimate_zero2_model_states_mem_needs(P, N, 1, cpu_offload=False)
    assert fp32.model_states_bytes - 8 == 4 * P + 16 * P // N
    assert fp32.model_states_bytes - 8 - ds_gpu == 2 * P - 2 * P // N
    # 2. CPU with offload: DeepSpeed gives a node total with a 1.5 safety factor and, for ZeRO-2,
    #    max(4 x total GPUs, 16) B/param; the planner gives each rank's own bytes:
    #    ZeRO-2 s(T)*(4 fp32 grads + 2 staging + 12) = 18P/N, ZeRO-3 2 + 2 + 4 + 12 = 20P/N.
    z2 = strategy_row("zero2_offload", spec, Setup(gpus_per_node=N))
    ds_cpu, _ = estimate_zero2_model_states_mem_needs(P, N, 1, cpu_offload=True)
    assert z2.cpu_bytes - 8 == 18 * P // N and ds_cpu == int(P * 16 * 1.5)
    z3 = strategy_row("zero3_offload", spec, Setup(gpus_per_node=N))
    ds_cpu, _, _ = estimate_zero3_model_states_mem_needs(P, spec.largest_layer_params, N, 1)
    assert z3.cpu_bytes - 8 == 20 * P // N and ds_cpu == int(P * 18 * 1.5)
    # 3. ZeRO-3 without offload: DeepSpeed's 4*LL + 18P/N reuses ZeRO-2's 18 B multiplier but no
    #    longer adds the 16-bit params separately, so it leaves out the 2 B/param 16-bit partition,
    #    and it charges the 4 B/param fp32 grads for the whole partition where DeepSpeed's step builds
    #    them one sub-group (sub_group_size, default 1e9 elements) at a time: planner 2 params + 2 grads
    #    + 12 optimizer = 16P/N + 4*min(s(T), sub_group_size), plus the persistent small tensors every
    #    rank keeps whole (DeepSpeed's estimate has no term for them).
    for name, n in (("llama-2-7b", N), ("llama-2-70b", 8)):
        llama = model_spec(name)
        r = strategy_row("zero3", llama, Setup(gpus_per_node=n))
        _, ds_gpu, _ = estimate_zero3_model_states_mem_needs(llama.params_total, llama.largest_layer_params, n, 1,
                                                             cpu_offload=False)
        ours = r.model_states_bytes + r.buffers_detail["gathered_layer"] + r.buffers_detail["fp32_grad_copy_in_step"]
        threshold = 10 * llama.hidden_size  # the Trainer's "auto"
        persistent = 2 * sum(d * rows for d, rows, _ in formulas.counts(llama, Setup(gpus_per_node=n)).tensors
                             if d * rows <= threshold)
        assert 0 < persistent < 0.001 * llama.params_total
        shard = r.grads_bytes // 2  # s(T): bf16 grads
        assert r.buffers_detail["fp32_grad_copy_in_step"] == 4 * min(shard, 10 ** 9)
        assert abs(ours - ds_gpu - 2 * llama.params_total / n - persistent + 4 * (shard - 10 ** 9)) <= 64
        whole = strategy_row("zero3", llama, Setup(gpus_per_node=n), knobs=LibraryKnobs(zero_sub_group_size=shard))
        assert whole.buffers_detail["fp32_grad_copy_in_step"] == 4 * shard  # one sub-group: the whole partition
    assert round(ds_gpu / 1e9, 1) == 156.2  # Llama-2-70B on 8 GPUs, DeepSpeed's figure quoted in issue 20
    # 4. DeepSpeed has no ZeRO-1 estimator and counts no buckets or activations.
    assert strategy_row("zero1", spec, Setup(gpus_per_node=N)).buffers_bytes > 0


# ----------------------------------------------------------------------------- compare
def _summary(tmp_path, spec_dir, strategy, measured, **extra):
    summary = {"world_size": 2, "num_nodes": 1, "strategy": strategy, "strategy_detail": {"fsdp_version": 2},
               "precision": "fp32", "model": {"params_total": 1, "name_or_path": str(spec_dir)},
               "ranks": [{"rank": i, **measured, "peak_memory_bytes": 5e8, "memory_kind": "cpu_peak_rss",
                          "extra": 1} for i in range(2)], "unknown_key": {}, **extra}
    path = tmp_path / "shardscope_summary.json"
    path.write_text(json.dumps(summary))
    return path


def torch_counts(folder) -> tuple[int, int, int]:
    """(elements, tensors, elements of the norm weights) of a saved causal LM's parameters, counted by torch."""
    from transformers import AutoModelForCausalLM

    params = dict(AutoModelForCausalLM.from_pretrained(folder).named_parameters())
    return (sum(p.numel() for p in params.values()), len(params),
            sum(p.numel() for name, p in params.items() if name.endswith("norm.weight")))


def test_compare_puts_planned_beside_measured(tiny_llama, tmp_path, capsys):
    elements, tensors, _ = torch_counts(tiny_llama)
    # FSDP full shard on 2 ranks, fp32 AdamW, by hand: every tensor's first dimension is even, so a rank holds half
    # of each; 4 B weights, 4 B gradients, 8 B moments per element and AdamW's 4 B `step` per tensor. The
    # optimizer is measured 10% over that.
    half = elements // 2
    measured = {"params_bytes": 4 * half, "grads_bytes": 4 * half, "optimizer_bytes": int((8 * half + 4 * tensors) * 1.1)}
    path = _summary(tmp_path, tiny_llama, "fsdp_full_shard", measured)
    result = plan_vs_run(path)
    comps = {c["component"]: c for c in result["ranks"][1]["components"]}
    assert comps["params_bytes"]["rel_diff"] == comps["grads_bytes"]["rel_diff"] == 0
    assert comps["optimizer_bytes"]["rel_diff"] == pytest.approx(0.1, abs=1e-5)
    assert cli.main(["plan", "--against", str(path)]) == 0
    assert "optimizer_bytes" in capsys.readouterr().out


def test_compare_plans_the_measured_step_with_the_runs_zero_bucket(tiny_llama, tmp_path, capsys):
    """plan_vs_run plans each rank's instrumented step (`peak_step`) with the reduce bucket the run's ZeRO
    optimizer had (`strategy_detail`), exactly as `plan` would for that setup, and puts it beside the measured peak."""
    from shardscope.plan.trace_cache import cached_traces_for

    spec = model_spec(str(tiny_llama))
    step = {"micro_batch": 2, "seq_len": 32, "image_size": None, "gradient_checkpointing": True}
    setup = Setup(gpus_per_node=2, precision="fp32", micro_batch=2, seq_len=32, activation_checkpointing=True)
    traces, note = cached_traces_for(str(tiny_llama), setup)
    assert note is None
    row = strategy_row("zero2", spec, setup, trace=traces["fp32"],
                       knobs=LibraryKnobs(bucket_elements=12345, zero_overlap_comm=True))
    assert row.buffers_detail["reduce_buckets"] == 2 * 12345 * 4  # doubled with overlap_comm, fp32 gradients
    peak = 20_000_000  # a measured peak, stated: the error below is computed from it
    measured = {"params_bytes": row.params_bytes, "grads_bytes": row.grads_bytes, "optimizer_bytes": row.optimizer_bytes,
                "peak_tensor_bytes": peak, "peak_phase": "backward", "peak_step": step,
                "peak_breakdown": {"parameters": peak, "gradients": 0, "optimizer": 0, "activations": 0, "temporaries": 0}}
    detail = {"zero_stage": 2, "reduce_bucket_size": 12345, "overlap_comm": True}
    path = _summary(tmp_path, tiny_llama, "zero2", measured, strategy_detail=detail)
    result = plan_vs_run(path)
    assert result["bucket_elements"] == 12345 and result["planned_total_bytes"] == row.peak_bytes
    for rank in result["ranks"]:
        assert rank["peak"]["step"] == step and rank["peak"]["measured"]["peak_tensor_bytes"] == peak
        assert rank["peak"]["planned"] == {"peak_bytes": row.peak_bytes, "peak_breakdown": row.peak_breakdown,
                                           "peak_phase": row.peak_phase, "activations_source": "traced"}
        assert rank["peak"]["error"] == pytest.approx((row.peak_bytes - 20_000_000) / 20_000_000)
    assert cli.main(["plan", "--against", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{row.peak_bytes:>14,}{peak:>14,}" in out and "2 x 32 tokens, checkpointing on" in out
    # A summary that does not record the bucket (written before it did) plans the Trainer's "auto", hidden^2.
    path = _summary(tmp_path, tiny_llama, "zero2", measured, strategy_detail={"zero_stage": 2})
    older = plan_vs_run(path)
    assert older["bucket_elements"] is None
    auto = strategy_row("zero2", spec, setup, trace=traces["fp32"])
    assert older["ranks"][0]["peak"]["planned"]["peak_bytes"] == auto.peak_bytes != row.peak_bytes
    # ... by hand: the reduce buckets are held at every moment of the step, so the two plans differ by the buckets
    # alone: the run's, doubled by overlap_comm, against "auto" (hidden^2 elements, no overlap: ZeRO-2's default), 4 B each
    hidden = json.loads((tiny_llama / "config.json").read_text())["hidden_size"]
    assert result["planned_total_bytes"] - older["planned_total_bytes"] == 2 * 12345 * 4 - hidden ** 2 * 4
    # A step shape that is not one: one line naming the file and key.
    path = _summary(tmp_path, tiny_llama, "zero2", {**measured, "peak_step": {"micro_batch": "two"}})
    assert cli.main(["plan", "--against", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(path) in err and "key 'ranks[0].peak_step'" in err


def test_compare_plans_a_zero3_run_with_its_reuse_distance(tiny_llama, tmp_path):
    """The run's stage3_max_reuse_distance (the profiler records it): below a layer, backward gathers every layer
    again and nothing stays gathered from forward beyond the layer in use; plan_vs_run plans that, not the 1e9
    default."""
    spec, base = model_spec(str(tiny_llama)), Setup(gpus_per_node=2, precision="fp32")
    knobs = LibraryKnobs(bucket_elements=10 ** 3, zero3_persistence_threshold=10)
    near = strategy_row("zero3", spec, base, knobs=replace(knobs, zero3_max_reuse_distance=10))
    far = strategy_row("zero3", spec, base, knobs=knobs)
    assert near.buffers_detail["kept_gathered"] == 0 < far.buffers_detail["kept_gathered"]
    live = {"zero_stage": 3, "reduce_bucket_size": 10 ** 3, "stage3_param_persistence_threshold": 10,
            "stage3_max_reuse_distance": 10}
    measured = {k: getattr(near, k) for k in ("params_bytes", "grads_bytes", "optimizer_bytes")}
    result = plan_vs_run(_summary(tmp_path, tiny_llama, "zero3", measured, strategy_detail=live))
    assert result["planned_total_bytes"] == near.peak_bytes < far.peak_bytes
    assert result["planned_comm"] == near.comm != far.comm


def test_compare_plans_a_zero3_run_with_its_live_bucket_and_threshold(tiny_llama, tmp_path):
    """An accelerate yaml with an inline DeepSpeed config leaves DeepSpeed's own defaults (reduce bucket 5e8 elements,
    persistence threshold 1e5), not the Trainer's "auto" (hidden^2, 10 x hidden): plan_vs_run plans with what the
    summary recorded from the live optimizer (the prefetch bucket is recorded too; no planned figure depends on it)."""
    spec = model_spec(str(tiny_llama))
    live = {"zero_stage": 3, "reduce_bucket_size": 5 * 10 ** 8, "prefetch_bucket_size": 5 * 10 ** 7,
            "stage3_param_persistence_threshold": 10 ** 5}
    base = Setup(gpus_per_node=2, precision="fp32")
    expected = strategy_row("zero3", spec, base,
                            knobs=LibraryKnobs(bucket_elements=5 * 10 ** 8, zero3_persistence_threshold=10 ** 5))
    auto = strategy_row("zero3", spec, base)
    measured = {k: getattr(expected, k) for k in ("params_bytes", "grads_bytes", "optimizer_bytes")}
    result = plan_vs_run(_summary(tmp_path, tiny_llama, "zero3", measured, strategy_detail=live))
    assert result["bucket_elements"] == 5 * 10 ** 8
    assert result["planned_total_bytes"] == expected.peak_bytes != auto.peak_bytes
    planned = {c["component"]: c["planned"] for c in result["ranks"][0]["components"]}
    assert planned["params_bytes"] == expected.params_bytes != auto.params_bytes  # the threshold keeps more whole


def test_zero_buckets_reads_what_the_zero_optimizer_was_built_with():
    from shardscope.measure.detect import zero_buckets

    class Zero:  # DeepSpeed's ZeRO optimizer as the profiler meets it: its gradient partitions and bucket settings
        def __init__(self, **settings):
            self.averaged_gradients = {}
            self.__dict__.update(settings)

    class Wrapper:  # accelerate's optimizer wrapper
        def __init__(self, optimizer):
            self.optimizer = optimizer

    stage2 = Zero(reduce_bucket_size=500_000_000, overlap_comm=False, allgather_bucket_size=200_000_000)
    assert zero_buckets(Wrapper(stage2)) == {"reduce_bucket_size": 500_000_000, "overlap_comm": False,
                                             "allgather_bucket_size": 200_000_000}
    assert zero_buckets(Zero(reduce_bucket_size=4096)) == {"reduce_bucket_size": 4096}  # ZeRO-3: no overlap_comm
    import torch

    assert zero_buckets(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)) == {}
    assert zero_buckets(None) == {}


@pytest.mark.parametrize("content, message", [
    ("{not json", "malformed JSON"),
    ('{"world_size": 2, "strategy": "zero3"}', "has no key 'ranks'"),
    ('{"world_size": 2, "strategy": "zero3", "ranks": [{"rank": 0, "params_bytes": 1}]}', "ranks[0].grads_bytes"),
    ('{"world_size": 2, "strategy": "pipeline", "ranks": [{"params_bytes": 1, "grads_bytes": 1, '
     '"optimizer_bytes": 1}]}', "key 'strategy'"),
])
def test_bad_summary_names_file_and_key(tmp_path, capsys, content, message):
    path = tmp_path / "summary.json"
    path.write_text(content)
    assert cli.main(["plan", "--against", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(path) in err and message in err


# ----------------------------------------------------------------------------- CLI
def test_cli_json_contract(capsys):
    assert cli.main(["plan", "--params", "7e9", "--heads", "32", "--gpus", "4", "--gpu", "H100", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # one node, tp = its 4 GPUs: fsdp_tp and hsdp_tp would repeat tp's mesh, so they are left out
    assert [r["strategy"] for r in result["rows"]] == [s for s in STRATEGIES if s not in ("fsdp_tp", "hsdp_tp")]
    keys = {"strategy", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes",
            "peak_bytes", "peak_breakdown", "peak_phase", "activations_source", "total_bytes", "fits"}
    for row in result["rows"]:
        assert keys <= set(row) and row["total_bytes"] == row["peak_bytes"] == sum(row["peak_breakdown"].values())
        assert row["peak_breakdown"]["optimizer"] == row["optimizer_bytes"]  # held at every moment of a step
        assert row["activations_source"] == "formula (approximate)"  # --params: nothing to trace
    assert set(result["recommendation"]) == {"strategy", "reason", "not_chosen"}
    assert result["recommendation"]["strategy"] in STRATEGIES


def test_cli_table_and_rule_of_thumb_convention(capsys):
    assert cli.main(["plan", "--model", "mistral-7b", "--gpu", "A100-80"]) == 0
    out = capsys.readouterr().out
    assert "fsdp_full_shard" in out and "recommendation:" in out and "activations at the peak:" in out
    # the headroom is one stated margin, printed with the rule it enters
    assert "fits: peak <= 0.9 x GPU memory, the 10% left for the CUDA caching allocator's fragmentation" in out


def test_tp_rows_say_their_activations_are_approximate(capsys):
    """The trace does not split a layer by TP: the TP rows keep the formula and say so, in the JSON and the table."""
    argv = ["plan", "--model", "mistral-7b", "--gpus", "8", "--gpu", "H100", "--seq-len", "512"]
    assert cli.main([*argv, "--json"]) == 0
    sources = {r["strategy"]: r["activations_source"] for r in json.loads(capsys.readouterr().out)["rows"]}
    assert sources["tp"] == "formula (approximate)" and sources["fsdp_full_shard"] == "traced"
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "tp: a written-out formula, approximate" in out
    assert cli.main(["plan", "--params", "7e9", "--gpus", "4", "--convention", "rule-of-thumb-12"]) == 0
    out = capsys.readouterr().out
    assert "84" in out and "31.5" in out and "112" in out and "38.5" in out and "master" in out


def test_size_parsing():
    assert units.parse_size("80GB") == 80 * 10 ** 9
    assert units.parse_size("80GiB") == units.parse_size("80") == 80 * 2 ** 30
    assert units.parse_size("85899345920") == 85899345920
    assert units.parse_count("7B") == units.parse_count("7e9") == 7e9


@pytest.mark.parametrize("argv, message", [
    (["--model", "nobody/no-such-model-7b", "--gpu", "H100"], "is not a local folder and the hub cannot be reached"),
    (["--params", "7e9", "--gpus", "0", "--gpu", "H100"], "--gpus must be at least 1"),
    (["--params=-7e9", "--gpu", "H100"], "--params must be positive"),
    (["--params", "7e9", "--gpu-memory=-80GB"], "--gpu-memory must be positive"),
    (["--params", "7e9", "--gpu", "B9000"], "unknown GPU 'B9000'"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT / "plugin"))
    proc = subprocess.run([sys.executable, "-m", "shardscope", "plan", *argv], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardscope: error:") and message in lines[0]


# ----------------------------------------------------------------------------- tensor parallel rows
def test_tp_activations_are_the_korthikanti_tensor_parallel_formula():
    spec = specs.spec_from_config(LlamaConfig(**TINY, num_key_value_heads=2))
    s, b, h, a, L, V, t = 256, 2, 64, 4, 2, 512, 2
    setup = Setup(gpus_per_node=t, seq_len=s, micro_batch=b, tp_size=t)
    r = {name: strategy_row(name, spec, setup) for name in ("fsdp_full_shard", "tp", "fsdp_tp")}
    head = b * s * V * (4 + 2)  # logits gathered whole by lm_head's colwise_gather_output (fp32 + 16-bit)
    # Without sequence parallelism only the attention/MLP internals split: 34 -> 10 + 24/t per s*b*h (16-bit).
    assert r["fsdp_full_shard"].activations_bytes == L * s * b * h * 34 + head
    assert r["tp"].activations_bytes == r["fsdp_tp"].activations_bytes == L * s * b * h * (10 + 24 / t) + head
    eager = formulas.activation_bytes(spec, replace(setup, attention="eager"), tp=t)
    assert eager["per_layer"] == int(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    ckpt = formulas.activation_bytes(spec, replace(setup, activation_checkpointing=True), tp=t)
    assert ckpt["layers"] == int(L * s * b * h * 2 + s * b * h * (10 + 24 / t))  # layer inputs stay whole


def test_tp_rows_shard_each_tensor_as_the_plan_says_and_fsdp_splits_the_tp_shard():
    config = LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=False)
    spec = specs.spec_from_config(config)
    h, i, V, L, kv = 64, 128, 512, 2, 2 * 16
    t, S = 2, 2
    # colwise (dim 0 / t): q, k, v, gate, up, embed_tokens, lm_head; rowwise (dim 1 / t): o, down; norms whole.
    tp_local = (2 * V * h + L * (h * h + 2 * kv * h + 2 * i * h)) // t + L * (h * h + i * h) // t + (2 * L + 1) * h
    tensors = 2 + 9 * L + 1
    fp32 = Setup(gpus_per_node=t * S, precision="fp32", tp_size=t)
    tp = strategy_row("tp", spec, fp32)
    embed_grad_extra = (V - V // t) * h  # TP alone: the embedding's gradient is whole on every rank
    assert (tp.params_bytes, tp.grads_bytes) == (4 * tp_local, 4 * (tp_local + embed_grad_extra))
    assert tp.optimizer_bytes == 8 * tp_local + 4 * tensors and tp.buffers_bytes == 0
    fsdp_tp = strategy_row("fsdp_tp", spec, fp32)
    assert fsdp_tp.mesh.as_dict() == {"dp_replicate": 1, "dp_shard": S, "tp": t} and fsdp_tp.shard_degree == t * S
    # Every dim here divides evenly, so FSDP2 over S halves the TP shard exactly.
    assert (fsdp_tp.params_bytes, fsdp_tp.grads_bytes) == (4 * tp_local // S, 4 * tp_local // S)
    unit = max(spec.unit_numels)
    assert fsdp_tp.buffers_detail == {"gathered_units": 2 * -(-unit // t) * 4, "unit_grad": -(-unit // t) * 4}
    hsdp = strategy_row("hsdp_tp", spec, Setup(gpus_per_node=t * S, nodes=3, precision="fp32", tp_size=t))
    assert hsdp.mesh.as_dict() == {"dp_replicate": 3, "dp_shard": S, "tp": t}
    assert hsdp.params_bytes == fsdp_tp.params_bytes


def test_zero3_keeps_gathered_only_what_its_reuse_distance_reaches():
    """stage3_max_reuse_distance D (a run's, read by the profiler): backward re-gathers r = max(0, 1 - D/(2G)) of
    the G gathered elements, and what it does not re-gather stays gathered from forward, (1 - r) G beyond the layer
    in use. At a D below the largest layer nothing is kept and r is nearly 1."""
    spec, setup = model_spec("llama-2-7b"), Setup(gpus_per_node=2)  # bf16-mixed: 2-byte parameters
    G = sum(d * r for d, r, _ in formulas.counts(spec, setup).tensors if d * r > 10 * spec.hidden_size)
    for D in (10 ** 9, 10 ** 5):
        row = strategy_row("zero3", spec, setup, knobs=LibraryKnobs(zero3_max_reuse_distance=D))
        r = max(0.0, 1 - D / (2 * G))
        assert row.buffers_detail["kept_gathered"] == max(0, int((1 - r) * G) - spec.largest_layer_params) * 2
        assert abs(row.comm["param_all_gather"] - 0.5 * ((1 + r) * G + spec.params_total - G) * 2) <= 2, D
    assert row.buffers_detail["kept_gathered"] == 0


def test_comm_per_step_is_the_documented_ring_formula():
    spec = model_spec("llama-2-70b")
    setup = Setup(gpus_per_node=8, nodes=2, tp_size=8)  # bf16-mixed: e = 2, FSDP2 of transformers in fp32 (p = 4)
    r = rows(estimate(spec, setup))
    P, N, e, b, s = spec.params_total, 16, 2, 1, 2048
    h, L, V, t = spec.hidden_size, spec.num_layers, spec.vocab_size, 8
    once = spec.unit_numels[-1] - V * h  # not resharded after forward: final norm and head (FSDP2 via accelerate)
    assert r["fsdp_full_shard"].comm == {"param_all_gather": int((N - 1) / N * (2 * P - once) * e),
                                            "grad_reduce_scatter": int((N - 1) / N * P * e)}
    assert r["ddp"].comm_bytes_per_step == int(2 * (N - 1) / N * P * 4)  # autocast: fp32 grads
    tp_terms = {"tp_all_reduce": int(2 * (t - 1) / t * ((2 + 5) * L + 2) * b * s * h * e),  # 5 colwise: q k v gate up
                "tp_logits_all_gather": int((t - 1) / t * b * s * V * e)}
    assert r["tp"].comm == tp_terms
    S = r["fsdp_tp"].mesh.dp_shard
    local = r["tp"].params_bytes // 4  # elements of a TP shard (t = 8, no FSDP)
    assert r["fsdp_tp"].comm == {**tp_terms, "param_all_gather": int(2 * (S - 1) / S * local * 4),
                                    "grad_reduce_scatter": int((S - 1) / S * local * 4)}
    # The comparison the figure is for: FSDP x TP moves far less per step than FULL_SHARD over the same ranks.
    assert r["fsdp_tp"].comm_bytes_per_step < r["fsdp_full_shard"].comm_bytes_per_step / 4


def test_tp_default_degree_and_place_in_the_decision_tree():
    spec = model_spec("llama-2-70b")  # 64 heads, 8 KV heads
    assert mesh.tp_degree(spec, Setup(gpus_per_node=8)) == 8
    assert mesh.tp_degree(spec, Setup(gpus_per_node=6)) == 2
    assert mesh.tp_degree(model_spec("mistral-7b"), Setup(gpus_per_node=1)) == 1
    setup = Setup(gpus_per_node=8, nodes=2, activation_checkpointing=False)
    r = rows(estimate(spec, setup))
    # Memory between FULL_SHARD's total and FSDP x TP's: TP is what fits, and it is named with its mesh.
    assert r["fsdp_tp"].peak_bytes < r["fsdp_full_shard"].peak_bytes
    usable = (r["fsdp_tp"].peak_bytes + r["fsdp_full_shard"].peak_bytes) / 2
    result = estimate(spec, replace(setup, gpu_memory_bytes=int(usable / 0.9)))
    assert result["recommendation"]["strategy"] == "fsdp_tp"
    assert "tensor parallel 8 x FSDP 2" in result["recommendation"]["reason"]
    assert "fsdp_full_shard" in result["recommendation"]["reason"]  # tried first, did not fit
    # Enough memory for FULL_SHARD: it comes first (TP's win is activations, not model states).
    roomy = estimate(spec, replace(setup, gpu_memory_bytes=int(r["fsdp_full_shard"].peak_bytes / 0.89)))
    assert roomy["recommendation"]["strategy"] == "fsdp_full_shard"
    # At degree 1 the TP rows are not candidates; a model with no TP plan has no TP rows.
    one = estimate(model_spec(params=1e9), Setup(gpus_per_node=1, tp_size=1, gpu_memory_bytes=2 * 2 ** 30))
    assert one["recommendation"]["strategy"] not in TP_STRATEGIES


def test_tp_from_params_only_is_approximate():
    P, t, S = 7e9, 4, 2
    result = estimate(model_spec(params=P), Setup(gpus_per_node=t, nodes=S, tp_size=t))
    r = rows(result)
    assert r["fsdp_tp"].approximate and not r["fsdp_full_shard"].approximate
    assert r["fsdp_tp"].params_bytes == 4 * -(-int(P) // (t * S))  # fp32 under bf16-mixed
    assert r["tp"].params_bytes == 4 * -(-int(P) // t)
    assert result["tp"]["approximate"] and any("approximate" in n for n in result["notes"])


def test_vision_model_without_tp_plan_has_no_tp_rows():
    from transformers import Dinov2Config

    spec = specs.spec_from_config(Dinov2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                 intermediate_size=128))
    assert not spec.tp_plan
    result = estimate(spec, Setup(gpus_per_node=2))
    assert not set(rows(result)) & set(TP_STRATEGIES) and result["tp"] is None
    with pytest.raises(UsageError, match="--tp 2: .* cannot be tensor-parallel"):
        estimate(spec, Setup(gpus_per_node=2, tp_size=2))


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "8", "--tp", "3"], "--tp 3 must divide the GPUs per node (--gpus 8)"),
    (["--gpus", "6", "--tp", "3"], "--tp 3 must divide num_attention_heads (32) and num_key_value_heads (8)"),
    (["--gpus", "8", "--tp", "0"], "--tp must be at least 1, got 0"),
])
def test_bad_tp_degree_is_one_line_naming_flag_and_numbers(capsys, argv, message):
    assert cli.main(["plan", "--model", "mistral-7b", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("shardscope: error:") and message in err


def test_compare_reads_the_tp_mesh_from_the_summary(tiny_llama, tmp_path, capsys):
    mesh = {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
    elements, tensors, norms = torch_counts(tiny_llama)
    # 2 shards x tp 2, fp32 AdamW, by hand: the linear layers and the embeddings split four ways, the norms (which
    # TP replicates) two ways; 4 B weights, 4 B gradients, 8 B moments per element, AdamW's 4 B `step` per tensor
    shard = (elements - norms) // 4 + norms // 2
    measured = {"params_bytes": 4 * shard, "grads_bytes": 4 * shard, "optimizer_bytes": 8 * shard + 4 * tensors}
    path = _summary(tmp_path, tiny_llama, "fsdp_tp", measured, world_size=4, mesh=mesh)
    result = plan_vs_run(path)
    assert result["strategy"] == "fsdp_tp" and result["mesh"] == mesh
    assert all(c["rel_diff"] == 0 for rank in result["ranks"] for c in rank["components"])
    assert cli.main(["plan", "--against", str(path)]) == 0
    assert "fsdp_tp (mesh 1x2x2)" in capsys.readouterr().out
    for bad, message in (({"dp_replicate": 1, "dp_shard": 1, "tp": 2}, "disagrees with world_size 4"),
                         ({"dp_replicate": 2, "dp_shard": 1, "tp": 2}, "(which is hsdp_tp)"),
                         (None, "key 'mesh' must give")):
        path = _summary(tmp_path, tiny_llama, "fsdp_tp", measured, world_size=4, mesh=bad)
        assert cli.main(["plan", "--against", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and str(path) in err and message in err


def test_tensor_parallel_rows_show_each_mesh_once():
    spec = model_spec("llama-2-70b")
    meshes = {r.strategy: r.mesh.as_dict() for r in estimate(spec, Setup(gpus_per_node=8, nodes=2, tp_size=4))["rows"]
              if r.strategy in ("tp", "fsdp_tp", "hsdp_tp")}
    assert meshes == {"tp": {"dp_replicate": 1, "dp_shard": 1, "tp": 4},
                      "fsdp_tp": {"dp_replicate": 1, "dp_shard": 4, "tp": 4},
                      "hsdp_tp": {"dp_replicate": 2, "dp_shard": 2, "tp": 4}}
    one_node = estimate(spec, Setup(gpus_per_node=8, tp_size=4))
    assert [r.strategy for r in one_node["rows"] if r.mesh.tp > 1] == ["tp", "fsdp_tp"]
    assert any("hsdp_tp left out" in note for note in one_node["notes"])


def test_zero3_parameter_only_offload_is_not_full_offload():
    """offload_param without offload_optimizer (LibraryKnobs.zero3_offload="params"): only the parameter shard
    moves to CPU; gradients, optimizer state and the per-sub-group fp32 grads stay on the GPU."""
    from shardscope.doctor.deepspeed import planner_settings

    spec, setup = model_spec("llama-2-7b"), Setup(gpus_per_node=8)
    zero3 = strategy_row("zero3", spec, setup)
    full = strategy_row("zero3_offload", spec, setup)
    params = strategy_row("zero3_offload", spec, setup, knobs=LibraryKnobs(zero3_offload="params"))
    optim = strategy_row("zero3_offload", spec, setup, knobs=LibraryKnobs(zero3_offload="optimizer"))
    persistent = full.params_bytes
    assert 0 < persistent < zero3.params_bytes
    assert (params.params_bytes, params.grads_bytes, params.optimizer_bytes) == \
        (persistent, zero3.grads_bytes, zero3.optimizer_bytes)
    assert params.cpu_bytes == zero3.params_bytes - persistent  # the 16-bit parameter shard
    assert params.buffers_detail == zero3.buffers_detail
    assert optim.params_bytes == zero3.params_bytes and optim.grads_bytes == optim.optimizer_bytes == 0
    assert full.cpu_bytes == params.cpu_bytes + optim.cpu_bytes
    # read from a DeepSpeed file the way DeepSpeed reads it
    assert planner_settings({"stage": 3, "offload_param": {"device": "cpu"}, "sub_group_size": 5e8}) == \
        {"zero3_offload": "params", "zero_sub_group_size": 500000000}
    assert planner_settings({"stage": 3, "offload_param": {"device": "cpu"},
                             "offload_optimizer": {"device": "cpu"}})["zero3_offload"] == "all"
    assert planner_settings({"stage": 3, "cpu_offload": True})["zero3_offload"] == "optimizer"  # deprecated name


def test_plan_compare_is_read_as_plan_against_and_says_so(tmp_path, capsys):
    """`plan --compare` is `plan --against`'s name before this release (one name, one meaning: `shardscope compare`
    launches runs): still read, with one note on stderr, and not listed in --help."""
    from shardscope import cli
    from shardscope.summary import write_summary

    path = write_summary(tmp_path / "shardscope_summary.json", {
        "strategy": "ddp", "world_size": 1, "precision": "fp32",
        "model": {"name_or_path": None, "params_total": 1000, "trainable_params": 1000},
        "ranks": [{"params_bytes": 4000, "grads_bytes": 4000, "optimizer_bytes": 8000}]})
    assert cli.main(["plan", "--against", str(path), "--json"]) == 0
    new, _ = capsys.readouterr()
    assert cli.main(["plan", "--compare", str(path), "--json"]) == 0
    old, err = capsys.readouterr()
    assert old == new and err.count("\n") == 1 and "plan --compare is now plan --against" in err
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    listed = capsys.readouterr().out
    assert "--against" in listed and "--compare" not in listed
