"""`--auto_fit` on 2 CPU ranks: the recipe run with a memory budget that rules out the naive setting, beside
the same recipe with the naive setting and the same global batch (one launch trains both, one after the other,
reused by every test).

Budget: on CPU it is given explicitly; the measured figure is the profiler's `peak_tensor_bytes` (torch's
MemTracker over one warm step, `peak.py`), per rank.
"""
from __future__ import annotations

import json
import re

import pytest

from launch import ROOT, launch_together
from recipe_checks import losses

pytestmark = pytest.mark.launch

SFT = ROOT / "recipes" / "causal_lm_sft.py"
RANKS, GLOBAL, NAIVE_MICRO, STEPS, SEQ = 2, 16, 8, 4, 96
HEADROOM = 0.10  # fit_training_args' default
# Losses of the two runs: the same samples per optimizer step in the same order, fp32; only the micro-batch
# shapes differ, so sums are taken in another order (~1e-7 relative per operation). 1e-4 relative leaves room
# for Adam amplifying that over STEPS steps and is far below what one step changes the loss by (~1e-2 here).
LOSS_RTOL = 1e-4
# "Uses most of the budget": the fit keeps HEADROOM free and moves in whole divisors of the per-rank batch
# (8: 1, 2, 4, 8), so the next larger micro-batch can need up to twice the activations; at least half the
# budget measured leaves both, and still rules out a micro-batch 1 chosen out of caution (see the budget below).
MIN_USED = 0.5
# The budget, stated: micro-batch 4 (half the naive 8) fits it, 8 does not. By hand for the tiny Llama of
# `make_sft_assets` (P = 134,464 parameters in 21 tensors; hidden 64, 2 layers, vocab 408), DDP, fp32 AdamW, 96
# tokens, micro-batch 4 and 2 accumulation steps (`hand_need` below):
#   states       4 B weights + 4 B gradients carried from the first micro-batch + 4 B DDP reducer buckets (a
#                gradient copy, allocated when DDP wraps the model) + 8 B moments, x P, + AdamW's 4 B step per
#                tensor                                                            = 2,689,364 B
#   activations  2 layers x 96 tokens x 4 x 64 hidden x 34 x 4 B / 2 (Korthikanti et al. 2022, per layer)
#                + 4 x 96 x 408 vocab x 4 B (the fp32 logits)                      = 3,969,024 B
#   6,658,388 B / (1 - HEADROOM) = 7,398,209 B, + 2% margin                         -> 7,550,000 B
BUDGET = 7_550_000


def plan(spec, micro, checkpointing=False):
    from shardscope.plan.mesh import Setup
    from shardscope.plan.planner import estimate

    setup = Setup(gpus_per_node=RANKS, precision="fp32", seq_len=SEQ, micro_batch=micro,
                  grad_accum_steps=GLOBAL // (RANKS * micro), activation_checkpointing=checkpointing)
    return next(r for r in estimate(spec, setup)["rows"] if r.strategy == "ddp")


def hand_need(model, micro) -> int:
    """The peak of DDP, fp32 AdamW at `micro` x SEQ tokens (GLOBAL / RANKS per rank), by the formula above."""
    config, params = model.config, list(model.parameters())
    elements, h, layers = sum(p.numel() for p in params), config.hidden_size, config.num_hidden_layers
    carried = 4 * elements if GLOBAL // (RANKS * micro) > 1 else 0  # gradients an earlier micro-batch left
    activations = layers * SEQ * micro * h * 34 * 4 // 2 + micro * SEQ * config.vocab_size * 4
    return 16 * elements + carried + 4 * len(params) + activations  # 4 B weights + 4 B buckets + 8 B moments


@pytest.fixture(scope="module")
def fit_case(sft_assets):
    """BUDGET, and the planner's rows for the naive micro-batch (8, no accumulation) and for micro-batch 1."""
    from transformers import AutoModelForCausalLM

    from shardscope.model.spec import spec_from_config

    model = AutoModelForCausalLM.from_pretrained(sft_assets["model"])
    spec = spec_from_config(model.config)
    return {"spec": spec, "budget": BUDGET, "naive": plan(spec, NAIVE_MICRO), "half": plan(spec, NAIVE_MICRO // 2),
            "micro1": plan(spec, 1), "need": {micro: hand_need(model, micro) for micro in (NAIVE_MICRO // 2, NAIVE_MICRO)}}


@pytest.fixture(scope="module")
def launched(fit_case, sft_assets, tmp_path_factory):
    common = ["--config", ROOT / "recipes/llama/demo_tiny.yaml", "--model_name_or_path", sft_assets["model"],
              "--dataset", sft_assets["data"], "--packing", "true", "--max_seq_length", SEQ, "--max_steps", STEPS,
              "--learning_rate", "1e-3", "--per_device_train_batch_size", NAIVE_MICRO,
              "--gradient_accumulation_steps", 1]
    args = {"fitted": [*common, "--auto_fit", "true", "--fit_memory_budget", f"{fit_case['budget']}B"],
            "naive": common}
    ddp = ROOT / "accelerate_configs" / "ddp.yaml"
    runs = launch_together([(name, ddp, SFT, args[name]) for name in args], tmp_path_factory.mktemp("fit_runs"))
    for run in runs.values():
        run.check()
    summaries = {name: json.loads((run.output_dir / "shardscope_summary.json").read_text())
                 for name, run in runs.items()}
    return {**runs, "summaries": summaries}


def test_budget_rules_out_the_naive_setting(fit_case):
    usable = BUDGET * (1 - HEADROOM)
    need = fit_case["need"]  # the derivation above, from the model's own counts
    assert need[NAIVE_MICRO // 2] == 6_658_388 and need[NAIVE_MICRO // 2] <= usable < need[NAIVE_MICRO]
    assert fit_case["half"].peak_bytes == need[NAIVE_MICRO // 2]  # the planner's formula path, by hand
    assert fit_case["naive"].peak_bytes > usable  # the planner agrees: what the run would do unfitted
    assert fit_case["micro1"].peak_bytes < MIN_USED * BUDGET  # micro-batch 1 would waste it


def test_every_rank_applies_rank0_decision(launched, fit_case):
    """Both ranks log the same values; the global batch is kept; the summary records the decision."""
    lines = re.findall(r"shardscope fit \(rank (\d)\): per_device_train_batch_size=(\d+) "
                       r"gradient_accumulation_steps=(\d+) gradient_checkpointing=(\w+)", launched["fitted"].output)
    by_rank = {int(rank): values for rank, *values in lines}
    assert sorted(by_rank) == list(range(RANKS)) and len(set(map(tuple, by_rank.values()))) == 1
    micro, accumulation, checkpointing = by_rank[0]
    assert int(micro) * int(accumulation) * RANKS == GLOBAL
    assert int(micro) > 1  # not micro-batch 1 out of caution
    fit = launched["summaries"]["fitted"]["fit"]
    assert fit["budget_bytes"] == fit_case["budget"]
    assert (fit["per_device_train_batch_size"], fit["gradient_accumulation_steps"],
            str(fit["gradient_checkpointing"])) == (int(micro), int(accumulation), checkpointing)
    assert fit["predicted_peak_bytes"] <= fit_case["budget"] * (1 - HEADROOM)
    assert launched["summaries"]["naive"]["fit"] is None


def test_fitted_peak_is_under_the_budget_and_uses_most_of_it(launched, fit_case):
    """The measured peak (MemTracker, every rank) stays under the budget and is at least MIN_USED of it."""
    budget = fit_case["budget"]
    peaks = [rank["peak_tensor_bytes"] for rank in launched["summaries"]["fitted"]["ranks"]]
    assert len(peaks) == RANKS and all(isinstance(p, int) for p in peaks)
    assert max(peaks) <= budget, f"measured {peaks} over the budget {budget} (planned " \
                                 f"{launched['summaries']['fitted']['fit']['predicted_peak_bytes']})"
    assert min(peaks) >= MIN_USED * budget, f"measured {peaks} use less than {MIN_USED:.0%} of {budget}"
    naive = [rank["peak_tensor_bytes"] for rank in launched["summaries"]["naive"]["ranks"]]
    assert min(naive) > budget  # measured too: the naive setting does not fit the budget


def test_fitted_losses_equal_the_naive_run(launched):
    """Same samples per optimizer step in the same order: the logged loss of every step agrees."""
    fitted, naive = losses(launched["fitted"].output_dir), losses(launched["naive"].output_dir)
    assert sorted(fitted) == sorted(naive) == list(range(1, STEPS + 1))
    for step in fitted:
        assert fitted[step] == pytest.approx(naive[step], rel=LOSS_RTOL), (step, fitted, naive)
    assert naive[STEPS] != pytest.approx(naive[1], rel=100 * LOSS_RTOL)  # training moved: the check can fail

