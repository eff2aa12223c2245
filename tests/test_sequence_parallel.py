"""DeepSpeed's Ulysses sequence parallelism trained for real on 2 gloo ranks, held against the same batches trained
without it and against the planner.

Launches of the SFT recipe under the shipped accelerate_configs/zero3_sp.yaml (sp_size 2 on 2 ranks: one
data-parallel replica, each rank holding half of every 2,048-token sequence; and sp_size 4 on 4 ranks, a quarter:
losses and counted bytes held for it too) and one reference launch of
accelerate_configs/zero3.yaml on 1 rank with the same data, seed and micro-batch (the same optimizer steps on the
whole sequences). Every assertion of this file reads those two runs. torch's context parallelism does not run on
CPU (its attention handlers cover the CUDA SDPA kernels only): tests/test_sequence_split.py holds its config,
planner rows and doctor rules, benchmarks/context_parallel_gpu.sh runs it on a GPU machine.
"""
import json
from pathlib import Path

import pytest

from launch import ROOT, accelerate_launch
from shardscope import plan_vs_run
from shardscope.measure.parity_record import PARITY_ENV
from shardscope.model.spec import model_spec
from shardscope.plan.mesh import LibraryKnobs, Setup
from shardscope.plan.sequence import comm_terms, split_row
from shardscope.plan.trace_cache import cached_traces_for

SEQ, STEPS, SP = 2048, 4, 2
DEGREES = (SP, 4)  # the split trained on 2 and on 4 ranks
# Losses of the split and the unsplit run: fp32 on both, the same batches; they differ only by summation order
# (the attention of each head computed on another rank, the loss gathered as a token-weighted mean of 2 halves).
LOSS_RTOL = 1e-5
TOLERANCE = 0.05  # the planner's peak within 5% of the measured one, as for every other row (test_peak_runs.py)


@pytest.fixture(scope="module")
def sp_runs(tmp_path_factory):
    """{"sp": run folder (sp 2), "sp4": run folder (sp 4), "ref": run folder, "model": tiny Llama folder}."""
    from shardscope.recipes.tiny import make_sft_assets

    root = tmp_path_factory.mktemp("sp_runs")
    assets = make_sft_assets(root / "assets", "llama", n=512, max_position_embeddings=4 * SEQ)
    args = ["--config", ROOT / "recipes/llama/demo_tiny.yaml", "--model_name_or_path", assets["model"],
            "--dataset", assets["data"], "--max_seq_length", SEQ, "--packing", "true",
            "--per_device_train_batch_size", 1, "--max_steps", STEPS]
    parity = {PARITY_ENV: "parity"}  # each run records parity fingerprints (test_parity_compares_the_split)
    accelerate_launch(ROOT / "accelerate_configs/zero3_sp.yaml", ROOT / "recipes/causal_lm_sft.py", args,
                      root / "sp", num_processes=SP, launcher_args=["--parallelism_config_sp_size", SP],
                      env=parity).check()
    accelerate_launch(ROOT / "accelerate_configs/zero3_sp.yaml", ROOT / "recipes/causal_lm_sft.py", args,
                      root / "sp4", num_processes=4, launcher_args=["--parallelism_config_sp_size", 4],
                      env=parity).check()
    accelerate_launch(ROOT / "accelerate_configs/zero3.yaml", ROOT / "recipes/causal_lm_sft.py", args,
                      root / "ref", num_processes=1, env=parity).check()
    return {"sp": root / "sp", "sp4": root / "sp4", "ref": root / "ref", "model": assets["model"]}


def run_of(sp_runs, degree: int) -> Path:
    return sp_runs["sp" if degree == SP else f"sp{degree}"]


def summary(folder: Path) -> dict:
    return json.loads((folder / "shardscope_summary.json").read_text())


def losses(folder: Path) -> list[float]:
    state = json.loads((folder / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


@pytest.mark.parametrize("degree", DEGREES)
def test_parity_compares_the_split_by_loss_gradient_norm_and_updates(sp_runs, degree):
    """`shardscope parity`'s comparison against the one-rank run: equal at the fp32 tolerance, the slices' samples
    and outputs said to be left out."""
    from shardscope.parity.compare import TOLERANCE, compare

    def records(folder, ranks):
        return [json.loads((folder / "parity" / f"rank{r}.json").read_text()) for r in range(ranks)]

    result = compare(records(run_of(sp_runs, degree), degree), records(sp_runs["ref"], 1)[0])
    assert result.verdict == "equal" and result.tolerance == TOLERANCE["fp32"], (result.sentence(), result.notes)
    assert len(result.steps) == STEPS and any("sequence split" in note for note in result.notes)


@pytest.mark.parametrize("degree", DEGREES)
def test_losses_equal_the_same_batches_trained_without_sp(sp_runs, degree):
    split, whole = losses(run_of(sp_runs, degree)), losses(sp_runs["ref"])
    assert len(split) == len(whole) == STEPS
    assert split == pytest.approx(whole, rel=LOSS_RTOL)
    assert whole[-1] < whole[0]  # it trained: the comparison is of steps that changed the weights


def test_summary_records_the_split_and_counts_each_token_once(sp_runs):
    split, whole = summary(sp_runs["sp"]), summary(sp_runs["ref"])
    assert split["mesh"]["sp"] == SP and "sp" not in whole["mesh"]
    assert split["strategy_detail"]["sequence_parallel"] == {"kind": "sp", "degree": SP, "backend": "deepspeed",
                                                             "group": [0, 1]}
    log = (sp_runs["sp"] / "launch.log").read_text()
    for rank in range(SP):  # the logs name the split and each rank's group; the recipe's closing line its degree
        assert f'shardscope sequence split (rank {rank}): {{"kind": "sp", "degree": {SP}, "backend": "deepspeed", ' \
               f'"group": [0, 1]}}' in log
        assert f"[shardscope] rank={rank} world_size={SP}" in log and f"sp_size={SP}" in log
    # each rank holds half of each sequence: over the group, every token and sample once, attention FLOPs at the
    # full length; the reference trained the same sequences whole in the same (uninstrumented) steps
    ranks = [r["throughput"] for r in split["ranks"]]
    ref = whole["ranks"][0]["throughput"]
    assert sum(r["tokens"] for r in ranks) == ref["tokens"] > 0
    assert sum(r["samples"] for r in ranks) == pytest.approx(ref["samples"])
    flops = sum(r["tflops_per_device"] * r["seconds"] for r in ranks)
    assert flops == pytest.approx(ref["tflops_per_device"] * ref["seconds"], rel=1e-9)


@pytest.mark.parametrize("degree", DEGREES)
def test_counted_all_to_all_bytes_equal_the_planned_term(sp_runs, degree):
    spec = model_spec(str(sp_runs["model"]))
    planned = comm_terms(spec, Setup(gpus_per_node=degree, seq_len=SEQ, precision="fp32"), "sp", degree)[
        "sp_all_to_all"]
    ranks = summary(run_of(sp_runs, degree))["ranks"]
    assert len(ranks) == degree
    for rank in ranks:
        counted = rank["comm"]["all_to_all"]
        assert counted["sent_bytes"] == planned
        assert counted["calls"] == 8 * spec.num_layers  # q, k, v, output; forward and backward
    assert "all_to_all" not in summary(sp_runs["ref"])["ranks"][0]["comm"]
    # plan --against / report plan the run's split from its summary (the step's slice x sp): the same term
    assert plan_vs_run(run_of(sp_runs, degree) / "shardscope_summary.json")["planned_comm"]["sp_all_to_all"] == planned


def test_planned_row_model_states_exact_and_peak_within_5_percent(sp_runs):
    run = summary(sp_runs["sp"])
    spec = model_spec(str(sp_runs["model"]))
    setup = Setup(gpus_per_node=SP, seq_len=SEQ, precision="fp32")
    local = Setup(gpus_per_node=SP, seq_len=SEQ // SP, precision="fp32")
    traces, note = cached_traces_for(str(sp_runs["model"]), local)
    assert note is None
    detail = run["strategy_detail"]  # ZeRO's sizes as the run's optimizer was built with them (the inline yaml's)
    knobs = LibraryKnobs(bucket_elements=detail["reduce_bucket_size"],
                         zero3_persistence_threshold=detail["stage3_param_persistence_threshold"])
    row = split_row("zero3", spec, setup, "sp", SP, traces["fp32"], knobs)
    assert row.strategy == "zero3/sp2" and row.mesh.sp == SP
    for rank in run["ranks"]:
        assert rank["peak_step"]["seq_len"] == SEQ // SP  # the rank's slice, as the planner's row traces it
        assert (rank["params_bytes"], rank["grads_bytes"], rank["optimizer_bytes"]) == \
            (row.params_bytes, row.grads_bytes, row.optimizer_bytes)
        assert abs(row.peak_bytes - rank["peak_tensor_bytes"]) <= TOLERANCE * rank["peak_tensor_bytes"]
