"""Multi-node launches, for real, on one machine: two `accelerate launch` processes on 127.0.0.1 act as two nodes
(`--num_machines 2 --machine_rank 0|1 --main_process_ip 127.0.0.1`), 2 CPU ranks each, 4 gloo ranks in all (the DDP
one through the SLURM script, under stand-ins for srun and scontrol). The shipped multi-node configs train the tiny
Llama for 2 steps; the profiler's summary must show the world size, the node count and the sharding layout each
config promises. Bad input (port in use, unreachable main address, a node whose main node never comes up) must
fail, not hang (each launch's timeout bounds it), and leave no process behind; how long each takes is in
benchmarks/failure_speed.py.
"""
import json
import math
import socket

import pytest

from launch import ROOT, accelerate_multinode_launch, deepspeed_multinode_launch, free_port, slurm_launch

from shardscope.configs.catalog import find_config
from shardscope.doctor.diagnose import Inputs, diagnose
from shardscope.doctor.rules import failing
from shardscope import plan_vs_run as compare

WORKER = ROOT / "tests" / "workers" / "train_tiny.py"
HELLO = WORKER  # the bad-input launches fail before any rank starts
FP32 = 4  # the CPU runs train in fp32 (--mixed_precision no; DeepSpeed without bf16)


TRAIN_ARGS = ["--max_steps", 2, "--logging_steps", 1, "--per_device_train_batch_size", 2, "--report_to", "none",
              "--save_strategy", "no", "--use_cpu"]


def _train(config, model, out):
    args = ["--model", model, *TRAIN_ARGS, "--output_dir", out]
    return _summary(accelerate_multinode_launch(find_config(config).path, WORKER, args, out, timeout=150), out)


def _summary(run, out):
    assert run.survivors() == [], f"processes left behind: {run.survivors()}"
    assert len(run.processes) >= 2 + 4, "expected 2 launchers and 4 ranks among the tracked processes"
    run.check()
    summary = json.loads((out / "shardscope_summary.json").read_text())
    independent = [json.loads((out / f"independent_count_rank{r}.json").read_text()) for r in range(4)]
    assert summary["world_size"] == 4 and summary["num_nodes"] == 2
    assert sorted(r["rank"] for r in summary["ranks"]) == [0, 1, 2, 3]
    for rank, count in zip(sorted(summary["ranks"], key=lambda r: r["rank"]), independent):
        assert rank["params_bytes"] == count["params_bytes"]  # the profiler's storage walk = the library accessors
    return summary


@pytest.mark.launch
def test_ddp_multinode_under_the_slurm_script_replicates_everything(strategy_model, parameter_shapes, tmp_path):
    """accelerate_configs/slurm_multinode.sbatch with ddp_multinode.yaml as a 2-node job runs it: stand-ins for
    `srun` (the script's launcher on every node at once, each with its SLURM_NODEID) and `scontrol` (both nodes
    are 127.0.0.1); the script derives machine rank, main address and process counts, the launchers meet."""
    args = ["--model", strategy_model("shard_llama"), *TRAIN_ARGS, "--output_dir", tmp_path]
    summary = _summary(slurm_launch(find_config("ddp_multinode").path, WORKER, args, tmp_path), tmp_path)
    full = sum(math.prod(s) for s in parameter_shapes("shard_llama")) * FP32
    assert summary["strategy"] == "ddp"
    assert [r["params_bytes"] for r in summary["ranks"]] == [full] * 4
    assert [r["grads_bytes"] for r in summary["ranks"]] == [full] * 4


@pytest.mark.launch
def test_fsdp_hybrid_shard_shards_within_a_node_replicates_across(strategy_model, parameter_shapes, tmp_path):
    summary = _train("fsdp_hybrid_shard", strategy_model("shard_llama"), tmp_path)
    shapes = parameter_shapes("shard_llama")
    full = sum(math.prod(s) for s in shapes) * FP32
    # FSDP2 gives each of a node's 2 ranks ceil(dim0 / 2) rows of every tensor: half, not a quarter.
    half = sum(math.ceil(s[0] / 2) * math.prod(s[1:]) for s in shapes) * FP32
    assert summary["strategy"] == "fsdp_hybrid_shard"
    assert summary["strategy_detail"]["sharding_strategy"] == "HYBRID_SHARD"
    assert summary["strategy_detail"]["fsdp_version"] == 2
    assert [r["params_bytes"] for r in summary["ranks"]] == [half] * 4
    assert half < 0.51 * full
    row = compare(tmp_path / "shardscope_summary.json")  # planner: N = GPUs per node for HYBRID_SHARD
    assert all(c["rel_diff"] == 0 for r in row["ranks"] for c in r["components"] if c["component"] == "params_bytes")


@pytest.mark.launch
def test_zero3_multinode_shards_over_all_four_ranks(strategy_model, parameter_shapes, tmp_path):
    summary = _train("zero3_multinode", strategy_model("shard_llama"), tmp_path)
    _zero3_over_four_ranks(summary, parameter_shapes("shard_llama"), tmp_path)


@pytest.mark.launch
def test_deepspeed_hostfile_launch_as_two_loopback_nodes(strategy_model, parameter_shapes, tmp_path):
    """DeepSpeed's own multi-node launch: a hostfile of two hosts x 2 slots that doctor passes, one `deepspeed
    --hostfile F --no_ssh --node_rank N --master_addr 127.0.0.1` launcher per "node" (no ssh on this machine)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    findings, _ = diagnose(Inputs(hostfile=hostfile, gpus=2, nodes=2))
    assert failing(findings) == [], findings
    out = tmp_path / "run"
    args = ["--model", strategy_model("shard_llama"), "--max_steps", 2, "--logging_steps", 1,
            "--per_device_train_batch_size", 2, "--report_to", "none", "--save_strategy", "no", "--output_dir", out,
            "--deepspeed", find_config("ds/zero3").path]
    summary = _summary(deepspeed_multinode_launch(hostfile, WORKER, args, out, timeout=150), out)
    _zero3_over_four_ranks(summary, parameter_shapes("shard_llama"), out)


def _zero3_over_four_ranks(summary, shapes, out):
    numels = [math.prod(s) for s in shapes]
    threshold = summary["strategy_detail"]["stage3_param_persistence_threshold"]
    # Each tensor's ds_tensor partition is ceil(numel / 4); tensors at or below the persistence threshold
    # also keep their whole .data on every rank (on this tiny model: the attention projections and norms).
    expected = (sum(math.ceil(n / 4) for n in numels) + sum(n for n in numels if n <= threshold)) * FP32
    assert summary["strategy"] == "zero3"
    assert [r["params_bytes"] for r in summary["ranks"]] == [expected] * 4
    sharded = sum(n for n in numels if n > threshold) * FP32
    assert sharded > 0.9 * sum(numels) * FP32  # most bytes are in sharded tensors: a quarter each
    row = compare(out / "shardscope_summary.json")
    assert all(c["rel_diff"] == 0 for r in row["ranks"] for c in r["components"] if c["component"] == "params_bytes")


# ----------------------------------------------------------------------------- bad input
def _bad_launch(tmp_path, **kwargs):
    return accelerate_multinode_launch(find_config("ddp_multinode").path, HELLO, ["--help"], tmp_path, **kwargs)


@pytest.fixture(scope="module")
def bad_launches(tmp_path_factory):
    """The three bad launches at once (each mostly waits: on a refused port, a rendezvous timeout, the helper's
    timeout): {case: run}, and the ports they were given."""
    from concurrent.futures import ThreadPoolExecutor

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        # The main node's address answers nothing: a loopback port no process listens on (tests send traffic to
        # loopback only). Without a rendezvous timeout the node waits for its main node for 10 minutes (torch's
        # static rendezvous default); --rdzv_conf timeout=3 bounds it. Without one at all, the helper's timeout
        # kills the launcher's whole session (agent and anything it started).
        ports = {"port_in_use": busy.getsockname()[1], "unreachable": free_port()}
        cases = {"port_in_use": dict(main_process_port=ports["port_in_use"], machine_ranks=[0], timeout=30),
                 "unreachable": dict(main_process_ip="127.0.0.1", main_process_port=ports["unreachable"],
                                     machine_ranks=[1], launcher_flags=["--rdzv_conf", "timeout=3"], timeout=40),
                 "no_main_node": dict(machine_ranks=[1], timeout=8)}
        with ThreadPoolExecutor(len(cases)) as pool:
            started = {case: pool.submit(_bad_launch, tmp_path_factory.mktemp(case), **kwargs)
                       for case, kwargs in cases.items()}
            return {case: future.result() for case, future in started.items()}, ports


@pytest.mark.launch
def test_port_in_use_fails_at_once_with_a_clear_error(bad_launches):
    runs, ports = bad_launches
    run = runs["port_in_use"]
    assert not run.timed_out and run.returncodes == [1], run.outputs
    assert f"port `{ports['port_in_use']}`, but another process is utilizing it" in run.outputs[0]
    assert run.survivors() == []


@pytest.mark.launch
def test_unreachable_main_address_fails_within_the_rendezvous_timeout(bad_launches):
    runs, ports = bad_launches
    run = runs["unreachable"]
    assert not run.timed_out and run.returncodes == [1], run.outputs
    assert f"timed out after 3000ms while trying to connect to (127.0.0.1, {ports['unreachable']})" in run.outputs[0]
    assert run.survivors() == []


@pytest.mark.launch
def test_node_without_its_main_node_is_killed_on_timeout(bad_launches):
    run = bad_launches[0]["no_main_node"]
    assert run.timed_out
    assert run.processes, "the launcher was tracked"
    assert run.survivors() == []
