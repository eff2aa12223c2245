"""The step-time model and its calibration, against hand-computed values (no launches)."""
from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from shardscope.cli import main
from shardscope.errors import UsageError
from shardscope.model.spec import spec_from_count
from shardscope.plan.calibration.figures import calibrate as calibrate_figures, hardware, measured_figures
from shardscope.plan.formulas import Row
from shardscope.plan.mesh import Setup
from shardscope.plan.planner import estimate
from shardscope.plan.time_model import (PARTS, Figures, datasheet_figures, describe, model_error, pipelined, step_time,
                                        term_seconds)
from shardscope.fit.search import simplicity, tier_rank
from shardscope.strategy import Mesh


def calibrate(paths, base):
    """What `--calibrate PATH ...` does: read each path, then calibrate `base`."""
    return calibrate_figures(measured_figures(paths), base)


SPEC = SimpleNamespace(kind="text", vocab_size=0, hidden_size=8, untied_embedding_params=0, params_total=10 ** 6,
                       num_layers=2, unit_numels=(1, 1, 1, 1), linear_shapes=(),  # 4 FSDP units
                       active_without_input_embedding=0)  # dense
MODEL = {"params_total": 10 ** 6, "trainable_params": 10 ** 6}
KINDS = ("all_reduce", "all_gather", "reduce_scatter")
FIG = Figures(flops_per_s=1e12, bus_bytes_per_s=dict.fromkeys(KINDS, 1e9), network_bytes_per_s=1e8,
              hidden_share=dict.fromkeys(KINDS, 0.75), optimizer_s_per_param=1e-9, overhead_s=0.01,
              pcie_bytes_per_s=1e9, cpu_adam_params_per_s=1e9, zero_step_s_per_param=0.5e-9, sources=dict.fromkeys(
                  ("flops_per_s", "bus_bytes_per_s", "hidden_share", "optimizer_s_per_param", "overhead_s",
                   "zero_step_s_per_param"), "test"))
MESH = Mesh(dp_shard=4)


def row(strategy, comm, shard=4):
    """A planner row with only what the step time reads by hand (no bytes)."""
    return Row(strategy, 0, 0, 0, 0, 0, comm=comm, mesh=MESH, shard_degree=shard)


def test_parts_by_hand():
    setup = Setup(gpus_per_node=4, micro_batch=2, grad_accum_steps=3, seq_len=10)
    micro = 2 * 10 * (6 * 10 ** 6 + 12 * 2 * 8 * 10) / 1e12  # samples x tokens x flops/token / FLOP/s
    compute = 3 * micro
    zero2 = step_time(row("zero2", {"grad_all_reduce": 4e9, "param_all_gather": 1e9}), SPEC, MODEL, setup, 10, FIG)
    assert zero2["step_time_parts"] == pytest.approx({"compute": compute, "exposed_comm": 5.0,  # nothing hidden
                                                      "library": 0.0,
                                                      "optimizer": 10 ** 6 / 4 * (1e-9 + 0.5e-9), "offload": 0.0,
                                                      "overhead": 0.03})  # DeepSpeed's step around the update too
    fsdp = step_time(row("fsdp_full_shard", {}), SPEC, MODEL, setup, 10, FIG)
    assert fsdp["step_time_parts"]["optimizer"] == pytest.approx(10 ** 6 / 4 * 1e-9)  # torch's step: the update
    measured_fsdp = replace(FIG, library_s_per_byte={"fsdp": 2e-9})  # FSDP's per-module work, per byte moved
    library_comm = {"param_all_gather": 3e6, "grad_reduce_scatter": 1.5e6, "grad_all_reduce": 9e6}  # ring bytes
    # whole tensors through the gathers and reduce-scatters: 4.5e6 sent over the ring's 3/4 on 4 shards
    for strategy, library in (("fsdp_full_shard", 6e6 * 2e-9), ("fsdp_shard_grad_op", 6e6 * 2e-9),
                              ("zero3", 0.0), ("zero2", 0.0)):  # DeepSpeed's not measured; ZeRO-2 gathers nothing
        parts = step_time(row(strategy, library_comm), SPEC, MODEL, setup, 10, measured_fsdp)["step_time_parts"]
        assert parts["library"] == pytest.approx(library)
    alone = step_time(row("fsdp_full_shard", library_comm, shard=1), SPEC, MODEL, setup, 10, measured_fsdp)
    assert alone["step_time_parts"]["library"] == 0.0  # one shard: nothing gathered
    ddp = step_time(row("ddp", {"grad_all_reduce": 4e9}, shard=1), SPEC, MODEL, setup, 10, FIG)
    # the last micro-batch's backward (2/3 of its compute) hides at most its own length, and of that the hidden
    # share 75%; the rest of the 4 s (its last 25 MiB bucket included) is exposed
    backward = micro * 2 / 3
    assert ddp["step_time_parts"]["exposed_comm"] == pytest.approx(4.0 - 0.75 * backward)
    assert ddp["step_time_s"] == pytest.approx(sum(ddp["step_time_parts"].values()))
    tp = step_time(row("fsdp_tp", {"tp_all_reduce": 2e9}), SPEC, MODEL, setup, 10, FIG)
    assert tp["step_time_parts"]["exposed_comm"] == pytest.approx(2.0)  # tensor-parallel: never hidden


def test_a_sequence_splits_own_collectives_are_priced():
    """A split row's own terms (`time_model.SPLIT_TERMS`): Ulysses' all-to-all (sp) is exposed whole, each of them
    feeding attention; torch's ring (cp) runs beside that micro-batch's compute and only its excess is exposed. Each
    is called per micro-batch, pass and layer (2 x 2 x 2 calls here) and pays the ring's hops (3 of 4 ranks)."""
    from shardscope.plan.time_model import exposure

    setup, micro, latency = Setup(gpus_per_node=4, grad_accum_steps=2), 0.01, 1e-6
    fig = replace(FIG, latency_s={"node": latency})
    hops = 2 * 2 * 2 * 3 * latency
    assert exposure(row("zero3", {"sp_all_to_all": 2e7}, shard=1), SPEC, setup, fig, micro) == \
        pytest.approx((0.02 + hops, 0.0))  # 2e7 B at 1 GB/s: all exposed
    assert exposure(row("fsdp_full_shard", {"cp_ring": 3e7}, shard=1), SPEC, setup, fig, micro) == \
        pytest.approx((0.03 + hops - 2 * micro, 2 * micro))  # hidden as long as the 2 micro-batches compute
    assert exposure(row("fsdp_full_shard", {"cp_ring": 1e7}, shard=1), SPEC, setup, fig, micro) == \
        pytest.approx((0.0, 0.01 + hops))  # shorter than the compute: all hidden


def test_a_gathering_pass_hides_each_units_collective_behind_its_predecessor():
    """FSDP full shard, 4 units, one micro-batch of 0.3 s compute (forward 0.1, backward 0.2): forward gathers
    0.2 s, backward gathers 0.2 s and reduce-scatters 0.2 s on the same link."""
    assert pipelined(1.0, 0.5, 4) == pytest.approx(0.25 + 3 * (0.25 - 0.125))  # each unit's excess is exposed
    assert pipelined(1.0, 8.0, 4) == pytest.approx(0.25)  # compute covers all but the first unit's
    setup = Setup(gpus_per_node=4, micro_batch=1, grad_accum_steps=1, seq_len=10)
    fig = replace(FIG, flops_per_s=10 * (6 * 10 ** 6 + 12 * 2 * 8 * 10) / 0.3, comm_sm_share=0.1)
    parts = step_time(row("fsdp_full_shard", {"param_all_gather": 0.4e9, "grad_reduce_scatter": 0.2e9}), SPEC, MODEL,
                      setup, 10, fig)["step_time_parts"]
    forward = (0.05 + 3 * (0.05 - 0.025), 0.2 - (0.05 + 3 * (0.05 - 0.025)))  # (exposed, hidden)
    backward = (0.1 + 3 * (0.1 - 0.05), 0.4 - (0.1 + 3 * (0.1 - 0.05)))
    hidden = forward[1] + backward[1]
    assert parts["exposed_comm"] == pytest.approx(forward[0] + backward[0] + 0.25 * hidden)  # hidden share 75%
    assert parts["compute"] == pytest.approx(0.3 + 0.75 * hidden * 0.1)  # SMs lost beside the hidden part
    host = replace(fig, library_host_s={"fsdp": 0.05})  # 4 units x 0.05 s per pass on the host
    parts = step_time(row("fsdp_full_shard", {}), SPEC, MODEL, setup, 10, host)["step_time_parts"]
    assert parts["library"] == pytest.approx((0.2 - 0.1) + 0)  # exceeds forward's 0.1 s, not backward's 0.2 s
    latency = replace(FIG, latency_s={"node": 1e-3})
    assert term_seconds(row("fsdp_full_shard", {}), setup, latency, "param_all_gather", 1e9, 8) == \
        pytest.approx(1.0 + 8 * 3 * 1e-3)  # 8 calls of a 3-step ring
    checkpointed = replace(setup, activation_checkpointing=True)
    assert step_time(row("fsdp_full_shard", {}), SPEC, MODEL, checkpointed, 10,
                     replace(fig, recompute_share=0.25))["step_time_parts"]["compute"] == pytest.approx(0.3 * 1.25)


def summary(strategy="ddp", accumulation=2, checkpointing=False):
    """A two-rank summary whose figures are worked out by hand in `test_calibration_from_a_summary`."""
    breakdown = {"forward_s": 0.2, "backward_s": 0.4, "optimizer_s": 0.1, "comm_s": 0.3, "exposed_comm_s": 0.05,
                 "data_wait_s": 0.02, "other_s": 0.03, "step_s": 0.8}
    rank = {"time_breakdown": breakdown, "step_time_s": {"median": 0.4, "p10": 0.39, "p90": 0.41, "steps": 10},
            "throughput": {"tflops_per_device": 0.003, "seconds": 4.0},
            "comm": {"all_reduce": {"calls": 3, "bytes": 6e6, "sent_bytes": 6e6}},
            "peak_step": {"gradient_checkpointing": checkpointing},
            "params_bytes": 4 * 10 ** 6, "grads_bytes": 4 * 10 ** 6, "optimizer_bytes": 8 * 10 ** 6}
    return {"strategy": strategy, "gradient_accumulation_steps": accumulation, "world_size": 2,
            "mesh": {"dp_replicate": 2, "dp_shard": 1, "tp": 1} if strategy == "ddp" else
            {"dp_replicate": 1, "dp_shard": 2, "tp": 1},
            "model": {"params_total": 10 ** 6, "trainable_params": 10 ** 6}, "ranks": [rank, dict(rank)]}


def write_run(folder, doc):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "shardscope_summary.json").write_text(json.dumps(doc))
    return folder


def test_calibration_from_a_summary(tmp_path):
    run = write_run(tmp_path / "ddp", summary())
    fig, record = calibrate([run], FIG)
    scale = 0.4 / 0.8  # median plain step / timed step
    assert fig.flops_per_s == pytest.approx(0.003e12 * 4.0 / 10 / ((0.2 + 0.4) * scale))
    assert fig.bus_bytes_per_s["all_reduce"] == pytest.approx(6e6 / (0.3 * scale))
    assert fig.hidden_share["all_reduce"] == pytest.approx((0.3 - 0.05) / 0.3)
    assert fig.optimizer_s_per_param == pytest.approx(0.1 * scale / 10 ** 6)  # DDP: every rank steps all
    assert fig.overhead_s == pytest.approx((0.02 + 0.03) * scale / 2)
    # a kind the run did not issue crosses the same link: the measured kind's figures
    assert fig.bus_bytes_per_s["all_gather"] == fig.bus_bytes_per_s["all_reduce"]
    assert fig.hidden_share["reduce_scatter"] == fig.hidden_share["all_reduce"]
    assert record["flops_per_s"]["run"] == str(run) and record["bus_bytes_per_s"]["all_reduce"]["run"] == str(run)
    assert fig.sources["flops_per_s"] == f"measured on {run}"
    assert fig.recompute_share == pytest.approx(0.2 / 0.6)  # forward over compute: the part recompute adds again
    checkpointed, _ = calibrate([write_run(tmp_path / "ckpt", summary(checkpointing=True))], FIG)
    # backward holds the forward again: the matmuls' rate leaves it out, and the recompute is that forward
    assert checkpointed.flops_per_s == pytest.approx(fig.flops_per_s * 0.6 / 0.4)
    assert checkpointed.recompute_share == pytest.approx(0.2 / 0.4)
    assert fig.comm_sm_share == 0 and fig.copy_s_per_byte == 0 and fig.sources["comm_sm_share"] == \
        f"inside what {run} measured"  # a run's times hold their own contention
    zero2, _ = calibrate([write_run(tmp_path / "zero2", summary("zero2"))], FIG)
    assert zero2.hidden_share == FIG.hidden_share  # ZeRO-2 overlaps nothing: no hidden share measured, kept
    assert zero2.optimizer_s_per_param == pytest.approx(0.1 * scale / (10 ** 6 / 2))  # each rank steps half


def test_a_zero_run_splits_deepspeeds_step_into_the_update_and_the_rest(tmp_path):
    """optimizer_update_s (the torch optimizer's step inside DeepSpeed's) gives the per-parameter update every
    strategy runs; the rest of ZeRO's step is DeepSpeed's own, per parameter stepped."""
    doc = summary("zero3")
    for rank in doc["ranks"]:
        rank["time_breakdown"] = {**rank["time_breakdown"], "optimizer_update_s": 0.04}
    fig, record = calibrate([write_run(tmp_path / "zero3", doc)], FIG)
    scale, stepped = 0.4 / 0.8, 10 ** 6 / 2
    assert fig.optimizer_s_per_param == pytest.approx(0.04 * scale / stepped)
    assert fig.zero_step_s_per_param == pytest.approx((0.1 - 0.04) * scale / stepped)
    assert record["zero_step_s_per_param"]["run"] == str(tmp_path / "zero3")
    ddp_doc = summary()
    for rank in ddp_doc["ranks"]:
        rank["time_breakdown"] = {**rank["time_breakdown"], "optimizer_update_s": 0.1}
    ddp, ddp_record = calibrate([write_run(tmp_path / "ddp", ddp_doc)], FIG)
    assert "zero_step_s_per_param" not in ddp_record and ddp.zero_step_s_per_param == FIG.zero_step_s_per_param


def test_a_gathering_run_keeps_its_librarys_module_work_out_of_the_flops(tmp_path):
    """library_s (ZeRO-3's or FSDP's per-module work inside forward and backward) is left out of the achieved
    FLOP/s and becomes that library's figure per byte of whole tensors it gathered and reduce-scattered; DDP's
    summary carries none."""
    counted = {"all_gather": {"calls": 8, "bytes": 4e6, "sent_bytes": 2e6},  # 2 ranks: half of each byte is sent
               "reduce_scatter": {"calls": 4, "bytes": 2e6, "sent_bytes": 1e6},
               "all_reduce": {"calls": 1, "bytes": 8, "sent_bytes": 8}}  # a loss scalar: not the library's
    for strategy, library in (("zero3", "deepspeed"), ("fsdp_full_shard", "fsdp")):
        doc = summary(strategy)
        for rank in doc["ranks"]:
            rank["time_breakdown"] = {**rank["time_breakdown"], "library_s": 0.06}
            rank["comm"] = counted
        fig, record = calibrate([write_run(tmp_path / strategy, doc)], FIG)
        scale = 0.4 / 0.8
        assert fig.flops_per_s == pytest.approx(0.003e12 * 4.0 / 10 / ((0.2 + 0.4 - 0.06) * scale))
        assert fig.library_s_per_byte == pytest.approx({library: 0.06 * scale / 6e6})  # (2e6 + 1e6) x 2 / (2 - 1)
        assert record["library_s_per_byte"][library]["run"] == str(tmp_path / strategy)
        assert any(line.startswith("library work inside forward + backward") for line in describe(fig))
        other = {"deepspeed": "FSDP", "fsdp": "DeepSpeed ZeRO-3"}[library]
        assert [line.split(":")[0] for line in describe(fig) if line.startswith("library work of")] == \
            [f"library work of {other}"]  # the other library's rows count none, and say so
    ddp, ddp_record = calibrate([write_run(tmp_path / "ddp", summary())], FIG)
    assert "library_s_per_byte" not in ddp_record and ddp.library_s_per_byte == {}
    assert [line.split(":")[0] for line in describe(ddp) if line.startswith("library work")] == \
        ["library work of DeepSpeed ZeRO-3 and FSDP"]
    assert not any(line.startswith("library work") for line in describe(FIG))  # datasheet: no run to ask for


def test_the_first_run_given_wins_and_preflight_gives_links(tmp_path):
    a = write_run(tmp_path / "a", summary())
    b_doc = summary()
    b_doc["ranks"] = [{**r, "step_time_s": {**r["step_time_s"], "median": 0.8}} for r in b_doc["ranks"]]
    b = write_run(tmp_path / "b", b_doc)
    first, record = calibrate([a, b], FIG)
    assert record["overhead_s"]["run"] == str(a) and first.overhead_s == pytest.approx(0.05 * 0.5 / 2)
    preflight = tmp_path / "preflight.json"
    preflight.write_text(json.dumps({"schema_version": 1, "dtype": "bf16", "backend": "nccl",
                                     "links": [{"kind": "all_gather", "scope": "intra", "size_bytes": 1 << 20,
                                                "busbw_bytes_per_s": 5e10}],
                                     "compute": [{"rank": 0, "flops_per_s": 2e14}, {"rank": 1, "flops_per_s": 1e14}]}))
    fig, record = calibrate([preflight, a], FIG)
    assert fig.flops_per_s == 1e14 and record["flops_per_s"]["run"] == str(preflight)  # the slowest rank
    assert fig.bus_bytes_per_s["all_gather"] == 5e10
    assert fig.bus_bytes_per_s["all_reduce"] == pytest.approx(6e6 / 0.15)  # the run's, preflight had none
    assert fig.bus_bytes_per_s["reduce_scatter"] == pytest.approx(6e6 / 0.15)  # neither: the slowest measured
    both = tmp_path / "both" / "preflight.json"
    both.parent.mkdir()
    both.write_text(json.dumps({"schema_version": 1, "dtype": "bf16", "backend": "gloo", "compute": [],
                                "links": [{"kind": kind, "scope": "intra", "size_bytes": 1 << 20,
                                           "busbw_bytes_per_s": speed}
                                          for kind, speed in (("all_reduce", 8e7), ("all_gather", 2e7))]}))
    run_first, record = calibrate([a, both], FIG)
    # the run's all_reduce (half the preflight's 8e7) wins; the kind it never issued is the preflight's, as measured
    assert run_first.bus_bytes_per_s["all_reduce"] == pytest.approx(6e6 / 0.15)
    assert run_first.bus_bytes_per_s["all_gather"] == 2e7 and record["bus_bytes_per_s"]["all_gather"]["run"] == str(both)


def test_a_row_takes_its_own_strategys_run_first(tmp_path):
    """`--calibrate DDP_DIR ZERO3_DIR`: the ZeRO-3 rows take the ZeRO-3 run's figures first and the DDP run's after,
    so a ZeRO-3 row predicts the run it was calibrated from (issue 51: from the DDP run's compute, links and overhead
    it came out 26% short of it, and nothing said so); every other row, and the record, keep the order given. A
    calibration.json written before runs named their strategy gives each run's own."""
    from shardscope.plan.calibration.calibration_json import read_calibration
    from shardscope.plan.calibration.run_dirs import RUN_STRATEGY

    ddp = write_run(tmp_path / "ddp", summary())
    doc = summary("zero3")
    for rank in doc["ranks"]:  # a slower step: more compute, exposed communication and overhead than DDP's
        rank["time_breakdown"] = {**rank["time_breakdown"], "forward_s": 0.3, "exposed_comm_s": 0.1, "other_s": 0.06}
    zero3 = write_run(tmp_path / "zero3", doc)
    fig, record = calibrate([ddp, zero3], FIG)
    assert set(fig.own) == {"zero3"} and record["flops_per_s"]["run"] == str(ddp)
    setup = Setup(gpus_per_node=2, grad_accum_steps=2)
    gathered = row("zero3", {"param_all_gather": 1e6, "grad_reduce_scatter": 1e6}, shard=2)
    replicated = row("ddp", {"grad_all_reduce": 2e6}, shard=1)

    def step(r, figures):
        return step_time(r, SPEC, MODEL, setup, 10, figures)["step_time_s"]

    assert step(gathered, fig) == step(gathered, calibrate([zero3, ddp], FIG)[0]) > step(gathered, replace(fig, own={}))
    assert step(replicated, fig) == step(replicated, replace(fig, own={}))
    assert any(line.startswith("rows of zero3: the figures of their own strategy's") for line in describe(fig))
    written = {"calibration_version": 1, "model": {"params_total": 10 ** 6}, "precision": "fp32",
               "runs": [{"strategy": name, "status": "ok", "figures": [
                   {"source": str(path), "figures": {k: v for k, v in figures.items() if k != RUN_STRATEGY}}
                   for path, figures in measured_figures([path])]}
                   for name, path in (("ddp", ddp), ("zero3", zero3))]}
    assert [f[RUN_STRATEGY] for _, f in read_calibration(written, "calibration.json")] == ["ddp", "zero3"]


def test_a_runs_link_probe_gives_the_kinds_it_never_issued(tmp_path):
    """A summary's `link_probe` (each kind timed at the run's end) is a source after the run: the kinds the run
    issued keep the run's speed, the others take the probe's as measured; a malformed probe is one --calibrate
    line."""
    doc = summary()
    doc["link_probe"] = {"size_bytes": 1 << 20, "ranks": 2, "backend": "gloo", "seconds": {},
                         "bus_bytes_per_s": {"all_reduce": 1.6e8, "all_gather": 4e7, "reduce_scatter": 2e7}}
    run = write_run(tmp_path / "ddp", doc)
    fig, record = calibrate([run], FIG)
    in_training = 6e6 / 0.15  # the run's all_reduce (test_calibration_from_a_summary): a quarter of the probe's
    assert fig.bus_bytes_per_s == pytest.approx({"all_reduce": in_training, "all_gather": 4e7, "reduce_scatter": 2e7})
    assert record["bus_bytes_per_s"]["all_gather"]["run"] == f"{run}'s link probe"
    assert "measures each kind" not in fig.sources["bus_bytes_per_s"]  # every kind measured
    doc["link_probe"] = {"bus_bytes_per_s": ["all_reduce"]}
    write_run(tmp_path / "bad", doc)
    with pytest.raises(UsageError, match="malformed 'link_probe'"):
        calibrate([tmp_path / "bad"], FIG)
    for strategy in (None, 5):  # a run whose strategy the profiler could not tell: one line, not a traceback
        write_run(tmp_path / "unknown", {**summary(), "strategy": strategy})
        with pytest.raises(UsageError, match="'strategy' is"):
            calibrate([tmp_path / "unknown"], FIG)


def test_fit_calibrated_from_a_preflight_file(capsys, tmp_path):
    """`shardscope fit --calibrate preflight.json`: the preflight's slowest matmul rank and its link bandwidths
    replace the datasheet figures, each said to be measured on that file."""
    preflight = tmp_path / "preflight.json"
    preflight.write_text(json.dumps({"schema_version": 1, "dtype": "bf16", "backend": "nccl",
                                     "links": [{"kind": kind, "scope": "intra", "size_bytes": 1 << 20,
                                                "busbw_bytes_per_s": 5e10} for kind in KINDS],
                                     "compute": [{"rank": 0, "flops_per_s": 2e14}, {"rank": 1, "flops_per_s": 1e14}]}))
    argv = ["fit", "--params", "7e9", "--gpus", "8", "--gpu", "H100", "--seq-len", "4096", "--global-batch", "64",
            "--calibrate", str(preflight)]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["calibration"]["flops_per_s"] == {"value": 1e14, "run": str(preflight)}
    assert {k: v["value"] for k, v in result["calibration"]["bus_bytes_per_s"].items()} == dict.fromkeys(KINDS, 5e10)
    assert result["assumptions"]["flops_per_s"] == 1e14
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "compute: 100 TFLOP/s per rank" in out and f"(measured on {preflight})" in out


def test_the_figures_of_a_gpu_without_a_datasheet_are_decided_in_one_place(capsys, tmp_path):
    """plan/calibration/figures.py decides the H100 fallback (issue 51: it was decided in 4 places): a GPU without a
    datasheet entry takes the assumed GPU's links, said so; one whose dense peak is unknown is an error, no datasheet
    or the assumed GPU's, as the command asks (`hardware_for`); measured figures without a datasheet go over the
    assumed GPU's, each figure not measured said to be assumed. No other module names the H100 as a fallback."""
    from pathlib import Path

    import shardscope
    from shardscope.plan.calibration import figures as home

    h100 = hardware(home.ASSUMED_GPU, "bf16-mixed")
    own_peak = hardware("RTX-4090", "bf16-mixed", peak_tflops=100)
    assert own_peak.peak_flops == 1e14 and own_peak.nvlink_bytes_per_s == h100.nvlink_bytes_per_s
    assert own_peak.datasheet == f"assumed ({home.ASSUMED_GPU}'s: no datasheet entry for RTX-4090)"
    with pytest.raises(UsageError, match="no dense peak FLOP/s known for RTX-4090"):
        home.hardware_for("RTX-4090", "bf16-mixed")
    assert home.hardware_for("RTX-4090", "bf16-mixed", unknown="none") is None
    ranked = home.hardware_for("RTX-4090", "bf16-mixed", unknown="assume", mfu=0.5)
    assert (ranked.peak_flops, ranked.mfu) == (h100.peak_flops, 0.5) and ranked.peak_source.startswith("assumed")
    run = write_run(tmp_path / "ddp", summary())
    code, out, _ = plan(capsys, "--params", "7e9", "--gpus", 8, "--gpu", "RTX-4090", "--calibrate", run)
    assert code == 0 and f"(measured on {run})" in out and f"assumed ({home.ASSUMED_GPU}'s: --gpu not known)" in out
    package = Path(shardscope.__file__).parent
    tables = {package / "units.py", package / "plan" / "time_model.py", Path(home.__file__)}
    assert [str(p) for p in package.rglob("*.py") if p not in tables and '"H100"' in p.read_text()] == []


def plan(capsys, *argv):
    code = main(["plan", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_rows_carry_step_times_and_say_where_figures_come_from(capsys, tmp_path):
    run = write_run(tmp_path / "ddp", summary())
    argv = ["--params", "7e9", "--gpus", 8, "--gpu", "H100", "--seq-len", 4096, "--grad-accum", 2]
    code, out, _ = plan(capsys, *argv, "--json")
    datasheet = json.loads(out)
    assert code == 0 and "calibration" not in datasheet
    for r in datasheet["rows"]:
        assert set(r["step_time_parts"]) == set(PARTS)
        assert r["step_time_s"] == pytest.approx(sum(r["step_time_parts"].values()))
    code, out, _ = plan(capsys, *argv, "--calibrate", run, "--json")
    calibrated = json.loads(out)
    assert calibrated["calibration"]["optimizer_s_per_param"]["run"] == str(run)
    ddp = next(r for r in calibrated["rows"] if r["strategy"] == "ddp")
    assert ddp["step_time_parts"]["overhead"] == pytest.approx(2 * (0.02 + 0.03) * 0.5 / 2)  # accumulation 2
    code, out, _ = plan(capsys, *argv, "--calibrate", run)
    assert f"measured on {run}" in out and "predicted step time (micro-batch 1, accumulation 2)" in out
    code, _, err = plan(capsys, *argv, "--calibrate", tmp_path / "nothing")
    assert code == 2 and "--calibrate" in err and err.count("\n") == 1 and "Traceback" not in err


def test_fit_lists_every_fitting_candidate_ranked_by_the_calibrated_model(capsys, tmp_path):
    """`fit --calibrate RUN --json`: `candidates` is every (strategy, micro-batch, checkpointing) at the global batch
    whose planned peak fits, each with the step the model predicts from the run's figures, computed here from the
    planner's rows (not through fit's search); the winner is the fastest, or, within the model's error of it, the
    simplest (`search.TIE_RULE`: the simplest tier, then no recomputation, then the most headroom, then --prefer's
    library, then fewer micro-batches)."""
    run = write_run(tmp_path / "ddp", summary())
    allowed = ("ddp", "zero2", "zero3")
    code = main(["fit", "--params", "7e9", "--gpus", "8", "--gpu", "H100", "--seq-len", "4096", "--global-batch", "64",
                 "--calibrate", str(run), "--json", *[flag for name in allowed for flag in ("--strategy", name)]])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["calibration"]["flops_per_s"]["run"] == str(run)
    fig, _ = calibrate([run], datasheet_figures(hardware("H100", "bf16-mixed")))
    spec, expected = spec_from_count(7e9), {}
    for micro in (1, 2, 4, 8):  # 64 sequences over 8 GPUs: 8 per GPU
        for checkpointing in (False, True):
            trial = Setup(gpus_per_node=8, gpu_memory_bytes=80 * 2 ** 30, seq_len=4096, micro_batch=micro,
                          grad_accum_steps=8 // micro, activation_checkpointing=checkpointing)
            planned = estimate(spec, trial)
            for r in (r for r in planned["rows"] if r.strategy in allowed and r.fits):
                step = step_time(r, spec, planned["model"], trial, planned["activations"]["tokens_per_sample"], fig)
                expected[r.strategy, micro, checkpointing] = (pytest.approx(step["step_time_s"]), r.peak_bytes)
    listed = {(c["strategy"], c["per_device_train_batch_size"], c["gradient_checkpointing"]):
              (c["step_time_s"], c["peak_bytes"]) for c in result["candidates"]}
    assert len(listed) == len(result["candidates"]) > 1 and listed == expected
    fastest = min(step for step, _ in listed.values())
    tied = [(tier_rank(name), ckpt, peak, simplicity(name, "fsdp"), 8 // micro, name, micro)
            for (name, micro, ckpt), (step, peak) in listed.items() if step <= fastest * (1 + model_error(fig))]
    *_, name, micro = min(tied)
    assert (result["strategy"], result["per_device_train_batch_size"]) == (name, micro)
    assert result["step_time_s"] == fastest if len(tied) == 1 else result["tie"]["candidates"] == len(tied)


@pytest.mark.parametrize("change, message", [
    ({"precision": "fp8"}, "key 'precision' ('fp8') is not one of"),
    ({"num_nodes": "2"}, "key 'num_nodes' must be a positive integer"),
    ({"gradient_accumulation_steps": 0}, "key 'gradient_accumulation_steps' must be a positive integer"),
    ({"strategy": "fsdp_tp", "mesh": {"dp_replicate": 1, "dp_shard": 1, "tp": 4}}, "disagrees with world_size 2"),
    ({"strategy": "pipeline"}, "key 'strategy' ('pipeline') is not one of")])
def test_a_run_is_read_with_the_checks_plan_compare_reads_it_with(tmp_path, capsys, change, message):
    """The summary's fields have one owner (`summary.run_of`): the prediction and `plan --against` refuse the same
    bad key with the same line."""
    from shardscope.report.time_prediction import predict_run

    doc = {**summary(), **change}
    for rank in doc["ranks"]:
        rank["peak_step"].update(micro_batch=1, seq_len=64)
    run = write_run(tmp_path / "run", doc)
    with pytest.raises(UsageError) as raised:
        predict_run(run, FIG)
    assert message in str(raised.value)
    assert main(["plan", "--against", str(run / "shardscope_summary.json")]) == 2
    assert capsys.readouterr().err == f"shardscope: error: {raised.value}\n"


def test_a_run_is_predicted_at_its_own_setup(tmp_path):
    """`predict_run` reads the run's step shape: accumulation 2 doubles the compute, checkpointing adds a third of
    the training FLOPs (8N + 16 L h s instead of 6N + 12 L h s), the overhead counts micro-batches."""
    from shardscope.report.time_prediction import predict_run

    def run(name, accumulation, checkpointing):
        doc = summary(accumulation=accumulation, checkpointing=checkpointing)
        doc["model"]["name_or_path"] = str(tmp_path / "gone")  # no folder: the parameter count gives the shapes
        doc["precision"] = "fp32"
        for rank in doc["ranks"]:
            rank["peak_step"].update(micro_batch=2, seq_len=64)
        return predict_run(write_run(tmp_path / name, doc), FIG)

    base, double, recompute = run("a1", 1, False), run("a2", 2, False), run("c1", 1, True)
    assert double["parts"]["compute"] == pytest.approx(2 * base["parts"]["compute"])
    assert recompute["parts"]["compute"] == pytest.approx(4 / 3 * base["parts"]["compute"])
    assert double["parts"]["overhead"] == pytest.approx(2 * FIG.overhead_s)
    assert base["measured"]["median"] == 0.4 and base["error"] == pytest.approx(base["predicted_s"] / 0.4 - 1)
    assert (base["strategy"], double["accumulation"], recompute["checkpointing"]) == ("ddp", 2, True)
    # the folder is gone: the prediction says what stood for the model, and report prints it under its table
    from shardscope.report.time_prediction import markdown_lines

    assert base["model_note"] == (f"predicted from the parameter count (1,000,000, a Llama shape assumed): its model "
                                  f"folder {tmp_path / 'gone'} is not on this machine")
    lines = markdown_lines([{"run": "a1", "predicted_step": base}])
    assert f"- a1: {base['model_note']}" in lines


def test_moe_flops_per_token_count_the_routed_experts_only():
    from shardscope.model.spec import model_spec
    from shardscope.plan.time_model import flops_per_token

    spec = model_spec("qwen3-30b-a3b")
    model = {"params_total": spec.params_total, "trainable_params": spec.params_total}
    attention = 12 * spec.num_layers * spec.hidden_size * 4096
    assert flops_per_token(spec, model, 4096, False) == 6 * spec.active_without_input_embedding + attention
    assert spec.active_without_input_embedding < spec.params_total / 9  # 8 of 128 experts: an order less
