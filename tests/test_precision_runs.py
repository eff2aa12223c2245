"""Mixed precision on 2 CPU ranks, launched for real (`accelerate launch --bf16/--fp16 --use_cpu`).

One run per mode serves every assertion about it: the dtypes each rank holds, the bytes per category
against the planner's row for that precision, the verdict, and the loss against fp32. The fp32
reference is the DDP `--fp16` run: on CPU accelerate turns fp16 autocast off, so it trains plain fp32
(asserted from its dtypes and the forward's compute dtype), which is exactly the mismatch its verdict
must report.
"""
import json

import pytest

from precision_checks import (BF16, BF16_OK, PRECISION_STEPS, assert_bf16_mixed_ranks, assert_bytes_match_planner,
                              precision_flags)

pytestmark = pytest.mark.launch

STEPS = PRECISION_STEPS
# Loss after STEPS steps, bf16 against fp32: bf16 compute drifts the loss by ~1e-2 over a few steps, and
# FSDP2 returns a bf16-rounded loss (at ~7 one bf16 step is 2^-5 = 0.031: rounding is up to 0.016).
LOSS_TOL = 0.03


def fp16_on_cpu() -> bool:
    """What DeepSpeed's CPU accelerator asks (`is_fp16_supported`): oneDNN's fp16 check. A torch built without
    oneDNN, or without that check, has no fp16 on CPU; any error of the check itself is a broken probe and fails
    the collection loudly instead of passing for "no fp16"."""
    import torch

    mkldnn = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not hasattr(mkldnn, "_is_mkldnn_fp16_supported"):
        return False
    return bool(mkldnn._is_mkldnn_fp16_supported())


@pytest.fixture(scope="module")
def precision_run(strategy_runs):
    """(summary, final loss, summary path) of tests/workers/train_tiny.py under `config` with `flags` for STEPS steps:
    a strategy_runs run, launched with the other runs of its config (tests/strategy_runs.py, PRECISION_RUNS) or alone."""

    def run(config, *flags):
        summary, _, folder = strategy_runs(config, flags=precision_flags(*flags))
        losses = [e["loss"] for e in json.loads((folder / "log_history.json").read_text()) if "loss" in e]
        assert len(losses) == STEPS
        return summary, float(losses[-1]), folder / "shardscope_summary.json"

    return run


def test_fp16_under_ddp_on_cpu_trains_fp32_and_says_so(precision_run):
    summary, _, _ = precision_run("ddp", "--fp16")
    assert summary["precision"] == "fp16"  # the existing label, unchanged
    verdict = summary["precision_verdict"]
    assert verdict["configured"] == "fp16-mixed" and verdict["effective"] == "fp32" and not verdict["ok"]
    assert "plain fp32" in verdict["reason"] and "--bf16" in verdict["reason"]
    for rank in summary["ranks"]:
        assert rank["dtypes"] == {"params": "fp32", "grads": "fp32", "optimizer": "fp32", "master_params": None}
        assert rank["compute_dtype"] == "fp32" and rank["master_params_bytes"] == 0


@pytest.mark.parametrize("config", sorted(BF16))
def test_bf16_holds_what_the_planner_says_and_trains_like_fp32(config, precision_run):
    summary, loss, path = precision_run(config, "--bf16")
    _, fp32_loss, _ = precision_run("ddp", "--fp16")
    strategy, zero = BF16[config]
    assert summary["strategy"] == strategy and summary["world_size"] == 2
    assert summary["precision_verdict"] == BF16_OK
    assert_bf16_mixed_ranks(summary, zero)
    assert_bytes_match_planner(path)
    assert loss == pytest.approx(fp32_loss, abs=LOSS_TOL)


def test_bf16_loaded_model_under_ddp_steps_without_master(precision_run):
    summary, _, _ = precision_run("ddp", "--bf16", "--dtype", "bfloat16")
    verdict = summary["precision_verdict"]
    assert verdict["configured"] == "bf16-mixed" and verdict["effective"] == "bf16-pure" and not verdict["ok"]
    assert "no fp32 master" in verdict["reason"]
    for rank in summary["ranks"]:
        assert rank["dtypes"]["params"] == rank["dtypes"]["optimizer"] == "bf16"
        assert rank["dtypes"]["master_params"] is None


@pytest.mark.skipif(not fp16_on_cpu(), reason="this CPU has no fp16 support (mkldnn): DeepSpeed refuses fp16")
def test_fp16_under_zero2_keeps_an_fp32_master(precision_run):
    summary, loss, path = precision_run("zero2", "--fp16")
    assert summary["precision_verdict"]["effective"] == "fp16-mixed" and summary["precision_verdict"]["ok"]
    for rank in summary["ranks"]:
        assert rank["dtypes"] == {"params": "fp16", "grads": "fp16", "optimizer": "fp32", "master_params": "fp32"}
    assert_bytes_match_planner(path)
