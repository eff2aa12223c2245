"""The strategy vocabulary (shardscope.strategy) and the live run's detection (measure/detect.py), in process: which
strategy a TP mesh, a config file or a summary names, the world size a process alone under a launcher reports, and
the nodes each launcher's environment says. Launched: test_strategies.py (each shipped config shards as promised)."""
import pytest

from shardscope.strategy import STRATEGIES, family, strategy_from_summary, strategy_of_config, tp_strategy


@pytest.mark.parametrize("mesh, name", [({"dp_replicate": 1, "dp_shard": 1, "tp": 2}, "tp"),
                                        ({"dp_replicate": 1, "dp_shard": 4, "tp": 2}, "fsdp_tp"),
                                        ({"dp_replicate": 2, "dp_shard": 4, "tp": 2}, "hsdp_tp"),
                                        ({"dp_replicate": 2, "dp_shard": 1, "tp": 4}, "hsdp_tp")])
def test_tp_strategy_names_each_mesh(mesh, name):
    assert tp_strategy(mesh) == name and family(name) == "tp"


@pytest.mark.parametrize("kind, raw, name", [
    ("deepspeed", {"zero_optimization": {"stage": 2}}, "zero2"),
    ("deepspeed", {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "zero3_offload"),
    ("deepspeed", {"zero_optimization": {"stage": "1"}}, "zero1"),
    ("deepspeed", {"zero_optimization": 3}, "ddp"),  # malformed section: no stage read
    ("accelerate", {"distributed_type": "MULTI_GPU"}, "ddp"),
    ("accelerate", {"distributed_type": "FSDP", "fsdp_config": {"fsdp_reshard_after_forward": False}},
     "fsdp_shard_grad_op"),
    ("accelerate", {"distributed_type": "FSDP", "fsdp_config": {"fsdp_offload_params": True}}, "fsdp_offload"),
    ("accelerate", {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3}}, "zero3"),
    ("accelerate", {"parallelism_config": {"parallelism_config_tp_size": 2, "parallelism_config_dp_shard_size": 2}},
     "fsdp_tp"),
    ("fsdp", {"sharding_strategy": "HYBRID_SHARD"}, "fsdp_hybrid_shard"),
])
def test_strategy_of_a_config_file(kind, raw, name):
    assert strategy_of_config(kind, raw) == name and name in STRATEGIES


def test_strategy_of_an_accelerate_yaml_reads_the_deepspeed_file_it_names():
    raw = {"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": "ds.json"}}
    files = {"ds.json": {"zero_optimization": {"stage": 1}}}
    assert strategy_of_config("accelerate", raw, read=files.__getitem__) == "zero1"


@pytest.mark.parametrize("summary, name", [
    ({"strategy": "zero3_offload"}, "zero3_offload"),
    ({"strategy": "deepspeed", "strategy_detail": {"stage": 2, "offload_optimizer": "cpu"}}, "zero2_offload"),
    ({"strategy": "fsdp", "strategy_detail": {"sharding_strategy": "ShardingStrategy.SHARD_GRAD_OP"}},
     "fsdp_shard_grad_op"),
    ({"strategy": "single"}, "ddp"),
    ({"strategy": "pipeline"}, None),
])
def test_strategy_from_a_summary(summary, name):
    assert strategy_from_summary(summary) == name


def test_world_size_above_one_with_each_process_alone_is_named(monkeypatch):
    """torchrun on CPU without use_cpu: WORLD_SIZE=N, yet accelerate's state holds one process (issue 20)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from shardscope.measure.detect import detect_strategy

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)  # a new process's: not what a test before it left here
    Accelerator(cpu=True)  # this process alone, as transformers leaves it
    assert detect_strategy()["strategy"] == "single"
    monkeypatch.setenv("WORLD_SIZE", "4")
    found = detect_strategy()
    assert (found["strategy"], found["world_size"], found["launched_world_size"]) == ("independent_copies", 1, 4)
    assert "4 unsynchronized copies" in found["problem"] and "use_cpu" in found["problem"]
    assert strategy_from_summary({"strategy": "independent_copies"}) is None  # nothing the planner can compare


@pytest.mark.parametrize("env, nodes", [
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, 2),     # torchrun / accelerate launch
    ({"WORLD_SIZE": "8", "LOCAL_SIZE": "2"}, 4),           # the deepspeed launcher (launcher/launch.py)
    ({"WORLD_SIZE": "8"}, 1),                              # no local size: one node assumed
])
def test_num_nodes_from_each_launchers_environment(monkeypatch, env, nodes):
    from shardscope.strategy import num_nodes

    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert num_nodes() == nodes

