"""`shardscope fit` and `fit_training_args`, in process: the search's invariants, bad input, output files."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from shardscope.cli import main
from shardscope.errors import UsageError
from shardscope.fit.search import divisors, search
from shardscope.plan.calibration.figures import hardware
from shardscope.plan.time_model import flops_per_token
from shardscope.plan.mesh import Setup
from shardscope.model.spec import spec_from_count
from shardscope.plan.planner import estimate
from shardscope.strategy import STRATEGIES, TP_STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
SPEC = spec_from_count(7e9, hidden=4096, heads=32)  # Llama-shaped, 32 heads: TP degrees 2, 4, 8 apply
H100 = hardware("H100", "bf16-mixed")


def setup(**kw):
    return Setup(**{"gpus_per_node": 8, "gpu_memory_bytes": 80 * 2 ** 30, "seq_len": 4096, **kw})


@pytest.mark.parametrize("kw,global_batch", [({}, 64), ({"nodes": 2}, 96), ({"gpus_per_node": 4}, 12)])
def test_global_batch_is_kept_by_every_candidate(kw, global_batch):
    found = search(SPEC, setup(**kw), global_batch, H100)
    candidates = found["fitting"] + list(found["smallest"].values())
    assert found["fitting"] and len({c.strategy for c in candidates}) >= 5
    for c in candidates:
        dp = c.mesh.dp_replicate * c.mesh.dp_shard
        assert c.per_device_train_batch_size * c.gradient_accumulation_steps * dp == global_batch, c


def fitting_set(found) -> set:
    return {(c.strategy, c.tp, c.per_device_train_batch_size, c.gradient_accumulation_steps, c.gradient_checkpointing,
             c.peak_bytes) for c in found["fitting"]}


def test_fitting_candidates_are_a_brute_force_over_the_planners_rows():
    """Every candidate that keeps the global batch, planned one at a time (no pruning) and kept when its peak is
    under 90% of the GPU (10% headroom): exactly what fit calls fitting. The meshes, by hand for 8 GPUs and 32
    heads on one node: the plain strategies over 8 ranks (hybrid shard needs nodes; offload needs the host memory
    given, and none is), FSDP x TP at t = 2 and 4, TP alone at t = 8."""
    base, usable, global_batch = setup(), 0.9 * 80 * 2 ** 30, 64
    plain = [s for s in STRATEGIES if s not in TP_STRATEGIES and s != "fsdp_hybrid_shard" and "offload" not in s]
    expected = set()
    for tp, names, dp in [(None, plain, 8), (2, ["fsdp_tp"], 4), (4, ["fsdp_tp"], 2), (8, ["tp"], 1)]:
        per_rank = global_batch // dp
        for micro in [m for m in range(1, per_rank + 1) if per_rank % m == 0]:
            for checkpointing in (False, True):
                trial = replace(base, micro_batch=micro, grad_accum_steps=per_rank // micro,
                                activation_checkpointing=checkpointing, tp_size=tp)
                expected |= {(r.strategy, r.mesh.tp, micro, per_rank // micro, checkpointing, r.peak_bytes)
                             for r in estimate(SPEC, trial)["rows"] if r.strategy in names and r.peak_bytes <= usable}
    assert len(expected) > 20 and fitting_set(search(SPEC, base, global_batch, H100)) == expected


def ddp_peak(spec, micro, accumulation, checkpointing, seq_len) -> int:
    """DDP's peak per GPU by hand, bf16 mixed precision (AMP: fp32 weights and gradients), AdamW, activations from
    the written-out formula (docs/planner.md: Korthikanti et al. 2022 per layer, 34 s b h x e/2; checkpointing keeps
    each layer's input plus one layer; fp32 and 16-bit logits):
        states  = 4 P weights + 8 P moments + 4 B AdamW step per tensor (9 per Llama layer, embeddings, norm, head)
                  + 4 P DDP reducer buckets (a copy of the gradients, allocated when DDP wraps the model)
        forward = activations + gradients already held (all of them when checkpointing recomputes in backward;
                  without, those an earlier micro-batch carried)
        backward's end / the optimizer step = 4 P gradients"""
    P, L, h, V, s, b, e = spec.params_total, spec.num_layers, spec.hidden_size, spec.vocab_size, seq_len, micro, 2
    layer = s * b * h * 34 * e // 2
    activations = (L * s * b * h * e + layer if checkpointing else L * layer) + b * s * V * (4 + e)
    held = 4 * P if checkpointing or accumulation > 1 else 0
    return 16 * P + 4 * (9 * L + 3) + max(activations + held, 4 * P)


def test_ddp_candidates_are_a_brute_force_with_a_peak_written_here():
    """fit's DDP candidates for a 1.3B Llama shape on 8 x 80 GiB, against every (micro-batch, checkpointing) at
    global batch 64 planned with `ddp_peak` above: the same fitting set, the same peaks."""
    spec, base = spec_from_count(1.3e9, hidden=2048, heads=16), setup()
    expected = {("ddp", 1, micro, 8 // micro, checkpointing, ddp_peak(spec, micro, 8 // micro, checkpointing, 4096))
                for micro in (1, 2, 4, 8) for checkpointing in (False, True)}
    expected = {c for c in expected if c[-1] <= 0.9 * 80 * 2 ** 30}
    assert 0 < len(expected) < 8  # the edge lies inside the grid
    assert fitting_set(search(spec, base, 64, H100, ("ddp",))) == expected


@pytest.mark.parametrize("allowed", [STRATEGIES, ("zero3",)])
def test_the_tie_rule_holds_for_every_candidate_inside_a_strategy_too(allowed):
    """Every candidate predicted within the model's error of the fastest is a tie, another micro-batch or
    checkpointing of one strategy too (issue 51: ZeRO-3 at micro-batch 2 was chosen over micro-batch 1, 19 GB less,
    predicted 4% slower): the winner is the simplest (`TIE_RULE`: tier, then no recomputation, then the most memory
    headroom, then --prefer's library, then fewer micro-batches); with no error, the fastest wins."""
    from shardscope.fit.search import break_tie, simplicity, tier_rank
    from shardscope.plan.time_model import DATASHEET_ERROR

    found = search(SPEC, setup(), 64, H100, allowed)
    fitting, win = found["fitting"], found["fitting"][0]
    fastest = min(fitting, key=lambda c: c.step_time_s)
    tied = [c for c in fitting if c.step_time_s <= fastest.step_time_s * (1 + DATASHEET_ERROR)]
    assert found["tie"]["candidates"] == len(tied) and win in tied
    rule = lambda c: (tier_rank(c.strategy), c.gradient_checkpointing, c.peak_bytes, simplicity(c.strategy, "fsdp"),  # noqa: E731
                      c.gradient_accumulation_steps)
    assert win is min(tied, key=rule) and win.peak_bytes < fastest.peak_bytes  # the rule changed the winner
    assert not win.gradient_checkpointing  # a setting that recomputes the forward is not chosen in a tie
    assert len([c for c in tied if c.strategy == win.strategy]) > 1  # a tie inside the winner's own strategy
    ranked = sorted(fitting, key=lambda c: c.key("fsdp"))
    assert break_tie(ranked, setup(), 0.0) is None and ranked[0] is fastest


def test_checkpointing_costs_a_third_more_compute():
    model = {"params_total": SPEC.params_total, "trainable_params": SPEC.params_total}
    plain, ckpt = (flops_per_token(SPEC, model, 4096, c) for c in (False, True))
    assert ckpt == pytest.approx(plain * 4 / 3)
    lora = {"params_total": SPEC.params_total + 10 ** 6, "trainable_params": 10 ** 6}
    assert flops_per_token(SPEC, lora, 4096, False) < plain  # frozen weights: no weight gradients (4 N, not 6 N)


def test_divisors():
    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(7) == [1, 7]



@pytest.mark.parametrize("gpus, nodes, t, planned, searched", [
    (8, 1, 2, ("tp", "fsdp_tp"), ("fsdp_tp",)),  # tp alone on 2 of 8 GPUs: planned, never searched nor recommended
    (8, 1, 8, ("tp",), ("tp",)),                 # fsdp_tp would repeat tp's mesh
    (4, 2, 4, ("tp", "fsdp_tp", "hsdp_tp"), ("fsdp_tp", "hsdp_tp")),
    (8, 1, 1, ("tp", "fsdp_tp"), ())])           # degree 1 repeats ddp / fsdp
def test_fit_searches_the_tp_rows_the_planner_can_recommend(gpus, nodes, t, planned, searched):
    """Which TP rows exist (plan/mesh.py) and which a run on every GPU can use (the planner's recommendation and
    fit's search) have one owner each: fit's groups, the planner's rows and its recommendation agree."""
    from shardscope.fit.search import strategy_groups

    setup = Setup(gpus_per_node=gpus, nodes=nodes, tp_size=t, gpu_memory_bytes=10 ** 15)
    result = estimate(SPEC, setup)
    assert tuple(r.strategy for r in result["rows"] if r.strategy in TP_STRATEGIES) == planned
    assert [(d, names) for d, names, _ in strategy_groups(SPEC, setup, TP_STRATEGIES)] == \
        ([(t, searched)] if searched else [])
    rec = result["recommendation"]  # everything fits: ddp, and the TP rows it lists as fitting alternatives
    assert rec["strategy"] == "ddp" and tuple(s for s in TP_STRATEGIES if s in rec["not_chosen"]) == searched


# ----------------------------------------------------------------------------- command line
def fit(capsys, *argv):
    code = main(["fit", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


PARAMS = ["--params", "7B", "--gpus", 8, "--gpu", "H100", "--seq-len", 4096]


def test_json_keys_and_alternatives(capsys):
    code, out, _ = fit(capsys, *PARAMS, "--global-batch", 64, "--json")
    result = json.loads(out)
    assert code == 0
    for key in ("strategy", "per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing",
                "tp", "peak_bytes", "step_time_s", "alternatives", "assumptions"):
        assert key in result
    assert result["peak_bytes"] <= result["usable_bytes"]
    assert result["alternatives"] and all(a["why"] and (a["step_time_s"] >= result["step_time_s"] or "a tie" in a["why"])
                                          for a in result["alternatives"])
    # The H100 SXM datasheet and whitepaper, and the documented defaults (docs/fit.md), written out here:
    # 989.4 dense BF16 TFLOP/s; NVLink 4 900 GB/s and PCIe 5.0 x16 128 GB/s, both directions (half each way);
    # 200 Gb/s InfiniBand HDR per GPU = 25 GB/s; MFU 0.40; 10% headroom; the optimizer step reads and writes
    # 28 bytes per parameter at 3.35 TB/s of HBM (torch's fused AdamW on fp32 parameters: the parameter and both
    # moments read and written, the fp32 gradient read).
    expected = {"peak_flops": 989.4e12, "mfu": 0.40, "flops_per_s": 0.40 * 989.4e12, "nvlink_bytes_per_s": 900e9 / 2,
                "pcie_bytes_per_s": 128e9 / 2, "network_bytes_per_s": 200e9 / 8, "headroom": 0.10,
                "optimizer_s_per_param": (3 * 8 + 4) / 3.35e12}
    assert {key: result["assumptions"][key] for key in expected} == pytest.approx(expected)


def test_text_output_states_the_assumptions(capsys):
    code, out, _ = fit(capsys, *PARAMS, "--global-batch", 64)
    assert code == 0 and out.startswith("fit: ") and "winner: " in out
    for words in ("MFU 40%", "headroom", "GB/s inside a node", "per micro-batch", "lost: "):
        assert words in out


def test_nothing_fits_is_exit_1_and_one_line_naming_what_would(capsys):
    code, out, err = fit(capsys, "--params", "7B", "--gpus", 8, "--gpu", "L4", "--seq-len", 131072, "--global-batch", 8,
                         "--strategy", "zero3", "--strategy", "fsdp_full_shard")
    assert code == 1 and out.count("\n") == 1 and "Traceback" not in err
    assert out.startswith("nothing fits in ") and "it would fit with" in out
    assert "--seq-len" in out or "GPUs" in out


@pytest.mark.parametrize("argv,message", [
    (["--params", "70B", "--gpus", 2, "--gpu", "A100-40", "--strategy", "ddp", "--global-batch", 8],
     "below the model states"),
    ([*PARAMS, "--global-batch", 30, "--strategy", "ddp", "--strategy", "zero3"], "nearest: 24 or 32"),
    ([*PARAMS, "--global-batch", 0], "--global-batch must be at least 1"),
    (["--params", "7B", "--gpus", 8, "--global-batch", 8], "--gpu NAME or --gpu-memory"),
    (["--params", "7B", "--gpus", 8, "--gpu-memory", "24GiB", "--global-batch", 8], "--peak-tflops"),
    ([*PARAMS, "--global-batch", 8, "--mfu", 0], "--mfu"),
    ([*PARAMS, "--global-batch", 8, "--network-bandwidth", -1], "--network-bandwidth"),
    ([*PARAMS, "--global-batch", 8, "--output-dir", __file__], "not a folder"),
    ([*PARAMS, "--global-batch", 8, "--strategy", "fsdp_hybrid_shard"], "no strategy to search"),
])
def test_bad_input_is_exit_2_and_one_line(capsys, argv, message):
    code, out, err = fit(capsys, *argv)
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_kept_global_batch_says_when_a_larger_micro_batch_would_fit(capsys):
    """56 on 8 GPUs is 7 per GPU (divisors 1 and 7): when 7 does not fit but 2 does, the fit keeps the global batch
    with micro-batch 1 (micro-batch 7 with checkpointing is tied with it, and the tie rule does not recompute) and
    names the nearest global batches that allow a larger one."""
    def fits(micro):
        row = estimate(spec_from_count(7e9), setup(micro_batch=micro))["rows"]  # what --params 7B plans
        return next(r for r in row if r.strategy == "fsdp_full_shard").fits

    assert fits(2) and not fits(7)  # the case under test, by the planner's own figures
    code, out, _ = fit(capsys, *PARAMS, "--global-batch", 56, "--strategy", "fsdp_full_shard", "--json")
    result = json.loads(out)
    note = result["larger_micro_batch"]
    assert code == 0 and result["per_device_train_batch_size"] * result["gradient_accumulation_steps"] == 7
    assert (result["per_device_train_batch_size"], result["gradient_checkpointing"]) == (1, False)
    assert 2 <= note["micro_batch_that_fits"] < 7
    assert all(g % (8 * note["micro_batch_that_fits"]) == 0 for g in note["nearest_global_batches"])
    assert min(abs(g - 56) for g in note["nearest_global_batches"]) < 8 * note["micro_batch_that_fits"]


# ----------------------------------------------------------------------------- files
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from shardscope.recipes.tiny import make_causal_lm

    path = tmp_path_factory.mktemp("fit_tiny")
    make_causal_lm(path, "llama", num_key_value_heads=4)
    return path


def recipe_parser():
    from shardscope.recipes.args import FitArguments, RecipeParser, RecipeTrainingArguments

    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import causal_lm_sft
    finally:
        sys.path.pop(0)
    return RecipeParser(causal_lm_sft.ScriptArguments, causal_lm_sft.ModelArguments, FitArguments,
                        training_type=RecipeTrainingArguments)


@pytest.mark.parametrize("strategy,extra", [("ddp", []), ("zero3", []), ("fsdp_tp", []),
                                            ("fsdp_hybrid_shard", ["--nodes", 2]),
                                            ("zero2_offload", ["--cpu-memory", "2TB"])])
def test_output_files_load_in_accelerate_and_the_recipe(capsys, tmp_path, tiny, strategy, extra):
    from accelerate.commands.config.config_args import load_config_from_file

    code, out, _ = fit(capsys, "--model", tiny, "--gpus", 4, *extra, "--gpu", "H100", "--seq-len", 256,
                       "--global-batch", 32, "--strategy", strategy, "--output-dir", tmp_path, "--json")
    result = json.loads(out)
    assert code == 0 and result["strategy"] == strategy
    config = load_config_from_file(result["files"]["accelerate_config"])
    nodes = 2 if "--nodes" in extra else 1
    assert config.num_processes == 4 * nodes and config.num_machines == nodes
    if strategy == "fsdp_tp":
        assert config.parallelism_config["parallelism_config_tp_size"] == result["tp"] > 1
    parser = recipe_parser()
    script, model, fit_args = parser.parse(["--config", result["files"]["training_args"]])
    assert model.model_name_or_path == str(tiny) and script.max_seq_length == 256 and not fit_args.auto_fit
    ns = parser.namespace
    assert (ns["per_device_train_batch_size"], ns["gradient_accumulation_steps"], bool(ns["gradient_checkpointing"])) \
        == (result["per_device_train_batch_size"], result["gradient_accumulation_steps"],
            result["gradient_checkpointing"])
    assert json.loads(Path(result["files"]["result"]).read_text())["strategy"] == strategy
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporaries


# ----------------------------------------------------------------------------- fit_training_args
@pytest.fixture(scope="module")
def tiny_model(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny)


@pytest.fixture(scope="module")
def cpu_args(tmp_path_factory):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path_factory.mktemp("args")), use_cpu=True, report_to="none",
                             per_device_train_batch_size=16)


def test_fit_training_args_applies_the_search_winner(cpu_args, tiny_model):
    from shardscope import fit_training_args
    from shardscope.model.spec import spec_from_config

    from shardscope.plan.trace import tracer

    spec = spec_from_config(tiny_model.config)
    budget = 4 * spec.params_total * 16  # states (16 B/param) and room for some activations
    fitted = fit_training_args(cpu_args, tiny_model, global_batch_size=16, memory_budget=budget, seq_len=128)
    # Brute force over every DDP candidate of global batch 16 on one device, each planned with the traced step
    # fit_training_args plans with, kept when its peak is under 90% of the budget (10% headroom). On one device the
    # tiny model's compute is microseconds against fit's stated 5 ms per micro-batch, so the fastest candidates have
    # the fewest micro-batches: the largest micro-batch that fits; checkpointing's recompute adds microseconds, a tie
    # within the model's error (fit's tie rule): the smaller peak, checkpointing on where both fit, wins.
    traces, fits = tracer(tiny_model.config, 16), {}
    for micro in (1, 2, 4, 8, 16):
        for checkpointing in (False, True):
            trial = Setup(gpu_memory_bytes=budget, precision="fp32", seq_len=128, micro_batch=micro,
                          grad_accum_steps=16 // micro, activation_checkpointing=checkpointing)
            peak = next(r for r in estimate(spec, trial, traces(trial))["rows"] if r.strategy == "ddp").peak_bytes
            if peak <= 0.9 * budget:
                fits[micro, checkpointing] = peak
    (micro, checkpointing), peak = max(fits.items(), key=lambda item: (item[0][0], -item[1]))
    assert (16, False) not in fits and micro > 1  # the budget rules out the naive setting, not every larger one
    assert (fitted.per_device_train_batch_size, fitted.gradient_accumulation_steps, fitted.gradient_checkpointing) \
        == (micro, 16 // micro, checkpointing)
    assert fitted.per_device_train_batch_size * fitted.gradient_accumulation_steps == 16
    assert fitted.activation_checkpointing == fitted.gradient_checkpointing
    assert cpu_args.per_device_train_batch_size == 16  # a copy: the caller's arguments are unchanged
    as_float = fit_training_args(cpu_args, tiny_model, global_batch_size=16, memory_budget=float(budget), seq_len=128)
    assert as_float.shardscope_fit == fitted.shardscope_fit  # 40e9-style floats are bytes too
    record = fitted.shardscope_fit
    assert record["budget_bytes"] == budget and record["predicted_peak_bytes"] == peak
    assert "shardscope_fit" not in fitted.to_dict()  # not a Trainer argument


@pytest.mark.parametrize("kw,message", [
    ({}, "give memory_budget"),
    ({"memory_budget": 1000}, "below the model states"),
    ({"memory_budget": "lots"}, "memory_budget 'lots' is not a size"),
    ({"memory_budget": 2.5e9 + 0.5}, "a whole float like 40e9"),
    ({"memory_budget": float("nan")}, "a whole float like 40e9"),
    ({"memory_budget": 10 ** 9, "global_batch_size": 0}, "global_batch_size must be a positive integer"),
])
def test_fit_training_args_bad_input_is_one_usage_error(cpu_args, tiny_model, kw, message):
    from shardscope import fit_training_args

    kw = {"global_batch_size": 16, **kw}
    with pytest.raises(UsageError) as error:
        fit_training_args(cpu_args, tiny_model, seq_len=128, **kw)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("env,strategy", [
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": "true"}, "fsdp_offload"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_VERSION": "2"}, "fsdp_shard_grad_op"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_VERSION": "2"}, "fsdp_full_shard"),
    ({}, "ddp"),
])
def test_run_strategy_reads_the_launchers_environment(monkeypatch, cpu_args, tiny_model, env, strategy):
    from shardscope.fit.training_args import run_strategy

    for key in ("ACCELERATE_USE_FSDP", "FSDP_OFFLOAD_PARAMS", "FSDP_RESHARD_AFTER_FORWARD", "FSDP_VERSION",
                "PARALLELISM_CONFIG_TP_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert run_strategy(cpu_args, tiny_model)[0] == strategy


def test_hardware_links_from_table_and_cuda_device_names():
    assert hardware("NVIDIA H100 80GB HBM3", "bf16-mixed").nvlink_bytes_per_s == 450e9
    assert hardware("NVIDIA H100 NVL", "bf16-mixed").nvlink_bytes_per_s == 300e9
    assert hardware("A100-80", "bf16-mixed").peak_flops == 312e12
    assert hardware("L4", "bf16-mixed").nvlink_bytes_per_s == hardware("L4", "bf16-mixed").pcie_bytes_per_s  # no NVLink


def test_step_peak_survives_gradient_accumulation(tiny_model):
    """MemTracker refuses a second outermost forward in one tracked step; StepPeak clears its per-module stats
    between micro-batches (also under a wrapper, and with checkpointing), keeping the peak."""
    import torch

    from shardscope.measure.peak import StepPeak

    class Wrapper(torch.nn.Module):  # stands in for DDP's module wrapper
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kw):
            return self.module(**kw)

    model = tiny_model.train()
    wrapped, optimizer = Wrapper(model), torch.optim.AdamW(model.parameters())
    batch = torch.randint(0, 100, (2, 16))

    def step(accumulation):
        for _ in range(accumulation):
            wrapped(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(1)
    hooks = len(torch.nn.modules.module._global_forward_pre_hooks)
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
        with StepPeak(model, optimizer) as peak:
            step(3)
        result = peak.result()
        # from the second micro-batch on, the first one's gradients are held through the step
        assert result["peak_breakdown"]["gradients"] > 0 and result["peak_tensor_bytes"] > 0
        assert checkpointing or result["peak_breakdown"]["activations"] > 0
    model.gradient_checkpointing_disable()
    assert len(torch.nn.modules.module._global_forward_pre_hooks) == hooks  # nothing left installed
