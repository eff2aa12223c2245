"""The shipped configs: catalogue, validation by the consuming libraries, the CLI, multi-node launcher
arguments and the SLURM script.

Real launches of every single-node config live in test_strategies.py (sharding) and
test_tensor_parallel.py (TP, FSDP x TP); checkpoints and resume in test_recipes.py.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launch import ROOT, SBATCH, free_port, slurm_stand_ins
from shardscope.configs.catalog import find_config, shipped_configs
from shardscope.configs.validate import validate_config
from shardscope.configs.files import ConfigProblems
from shardscope.configs.launcher import launch_args, launch_env
from shardscope.errors import UsageError

BAD = Path(__file__).parent / "fixtures" / "bad_configs"
# Every file in the three config folders, found recursively, with the kind it must validate as.
SHIPPED = sorted(
    [(p, "accelerate") for p in (ROOT / "accelerate_configs").rglob("*.yaml")]
    + [(p, "slurm") for p in (ROOT / "accelerate_configs").rglob("*.sbatch")]
    + [(p, "deepspeed") for p in (ROOT / "ds_configs").rglob("*.json")]
    + [(p, "fsdp") for p in (ROOT / "fsdp_configs").rglob("*.json")]
)
MULTINODE = ["ddp_multinode", "fsdp_hybrid_shard", "hsdp_tp", "zero3_multinode"]


def rel(path):
    return str(path.relative_to(ROOT))


def shardscope(*args, env=None):
    return subprocess.run([sys.executable, "-m", "shardscope", *args], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, **(env or {})), timeout=120)


# ----------------------------------------------------------------------------- catalogue


def test_catalogue_is_every_file_in_the_config_folders():
    assert len(SHIPPED) >= 25
    assert sorted((c.path, c.kind) for c in shipped_configs()) == sorted((p.resolve(), k) for p, k in SHIPPED)
    names = [c.name for c in shipped_configs()]
    assert len(set(names)) == len(names)
    file_names = [c.path.name for c in shipped_configs()]
    assert len(set(file_names)) == len(file_names), "file names must be unique so `configs path X.json` is unambiguous"
    assert all(c.description for c in shipped_configs())
    assert sorted(c.name for c in shipped_configs() if c.multinode) == sorted(
        MULTINODE + ["slurm_multinode"])


@pytest.mark.parametrize("name, kind, file", [
    ("zero3", "accelerate", "accelerate_configs/zero3.yaml"),
    ("zero3.yaml", "accelerate", "accelerate_configs/zero3.yaml"),
    ("ds/zero3", "deepspeed", "ds_configs/zero3.json"),
    ("deepspeed/zero3", "deepspeed", "ds_configs/zero3.json"),
    ("zero3.json", "deepspeed", "ds_configs/zero3.json"),
    ("ds_configs/zero3.json", "deepspeed", "ds_configs/zero3.json"),
    ("fsdp/llama_full_shard", "fsdp", "fsdp_configs/llama_full_shard.json"),
    ("fsdp_full_shard", "accelerate", "accelerate_configs/fsdp_full_shard.yaml"),
    ("slurm_multinode", "slurm", "accelerate_configs/slurm_multinode.sbatch"),
])
def test_find_config_resolution(name, kind, file):
    config = find_config(name)
    assert (config.kind, config.path) == (kind, (ROOT / file).resolve())


def test_find_config_unknown_name_lists_close_matches():
    with pytest.raises(UsageError, match=r"unknown config 'zero4'.*did you mean: .*zero3"):
        find_config("zero4")


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("path, kind", SHIPPED, ids=[rel(p) for p, _ in SHIPPED])
def test_shipped_config_is_loaded_by_its_library(path, kind):
    from accelerate.commands.config.config_args import ClusterConfig
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import TrainingArguments

    loaded = validate_config(path)  # kind guessed from the folder and suffix
    if kind == "accelerate":
        assert isinstance(loaded, ClusterConfig)
        raw = yaml.safe_load(path.read_text())
        assert loaded.distributed_type.value == raw["distributed_type"]
        assert loaded.num_processes == raw["num_processes"]
        if loaded.distributed_type.value == "DEEPSPEED":
            stage = int(path.stem[len("zero")])
            assert loaded.deepspeed_config["zero_stage"] == stage
            assert loaded.deepspeed_config.get("zero3_save_16bit_model", False) == (stage == 3)
        split = {k.removeprefix("parallelism_config_"): v for k, v in (loaded.parallelism_config or {}).items()}
        if split.get("sp_size", 1) > 1:  # Ulysses: DeepSpeed ZeRO, sp dividing the processes and the heads
            assert loaded.distributed_type.value == "DEEPSPEED" and split["sp_backend"] == "deepspeed"
            assert loaded.num_processes % split["sp_size"] == 0 and split["sp_attn_implementation"] == "sdpa"
        if split.get("cp_size", 1) > 1:  # torch CP: FSDP2, dp_shard x cp = processes
            assert loaded.fsdp_config["fsdp_version"] == 2 and split["cp_backend"] == "torch"
            assert split["dp_shard_size"] * split["cp_size"] == loaded.num_processes
        if loaded.distributed_type.value == "FSDP":
            assert loaded.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
            expected_version = 1 if path.stem.startswith("fsdp1") else 2
            assert loaded.fsdp_config["fsdp_version"] == expected_version
    elif kind == "deepspeed":
        assert isinstance(loaded, DeepSpeedConfig)
        stage = int(path.stem[len("zero")])
        assert loaded.zero_optimization_stage == stage
        assert loaded.world_size == 8 and loaded.train_batch_size == 8 * loaded.train_micro_batch_size_per_gpu
        assert (loaded.zero_config.offload_optimizer is not None) == ("offload" in path.stem)
        if stage == 3:  # Trainer-filled "auto" ZeRO-3 sizes, and a real model on save
            assert loaded.zero_config.gather_16bit_weights_on_model_save
            assert loaded.zero_config.param_persistence_threshold == 10 * 4096
            assert (loaded.zero_config.offload_param is not None) == ("offload" in path.stem)
    elif kind == "fsdp":
        assert isinstance(loaded, TrainingArguments)
        family = path.stem.split("_")[0]
        layer = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "dinov2": "Dinov2Layer"}[family]
        assert loaded.fsdp_plugin_args["transformer_cls_names_to_wrap"] == layer
        assert loaded.fsdp_plugin_args.get("cpu_offload", False) == ("offload" in path.stem)
    else:
        assert loaded.startswith("#!/bin/bash")


# (fixture, text every problem line must contain besides the file name)
BAD_CASES = {
    "fsdp_unknown_nested_key.yaml": "fsdp_config.fsdp_reshard_after_foward: not a launcher argument",
    "malformed.yaml": "malformed YAML",
    "ds_accumulation_as_string.json": "gradient_accumulation_steps: '4' is a string",
    "ds_bad_stage.json": "zero_optimization.stage:",
    "fsdp_unknown_key.json": "transformer_layer_cls_to_warp: not read by TrainingArguments",
    "malformed.json": "malformed JSON",
    "fsdp1_hybrid_shard.json": "reshard_after_forward: 'hybrid_shard' is not what FSDP1 trains: accelerate wraps with "
                               "its sharding_strategy, FULL_SHARD",
    "cp_under_deepspeed.yaml": "parallelism_config.parallelism_config_cp_size: 4 needs distributed_type FSDP",
    "sp_under_fsdp.yaml": "parallelism_config.parallelism_config_sp_size: 4 needs distributed_type DEEPSPEED",
    "sp_not_dividing.yaml": "parallelism_config.parallelism_config_sp_size: 3 x tp_size 1 does not divide",
}


def test_every_bad_fixture_is_used():
    assert sorted(p.name for p in BAD.iterdir()) == sorted(BAD_CASES)


@pytest.mark.parametrize("name", sorted(BAD_CASES))
def test_bad_config_names_file_and_key(name):
    with pytest.raises(ConfigProblems) as error:
        validate_config(BAD / name)  # kind guessed from the content
    assert len(error.value.problems) == 1
    assert error.value.problems[0].startswith(str(BAD / name))
    assert BAD_CASES[name] in error.value.problems[0]


def test_malformed_files_report_line_numbers():
    for name, where in [("malformed.yaml", ":6:"), ("malformed.json", ":4:")]:
        with pytest.raises(ConfigProblems, match=f"{name}{where}"):
            validate_config(BAD / name)


def test_fsdp1_reshard_after_forward_is_flagged(tmp_path):
    """accelerate 1.15's launcher always exports FSDP_SHARDING_STRATEGY, which beats reshard_after_forward in FSDP1:
    the yaml's own words for the rule a Trainer fsdp_config meets too (BAD_CASES' fsdp1_hybrid_shard.json)."""
    config = tmp_path / "fsdp1_grad_op.yaml"
    config.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 1\n"
                      "  fsdp_reshard_after_forward: SHARD_GRAD_OP\n")
    with pytest.raises(ConfigProblems, match="fsdp_config.fsdp_reshard_after_forward: 'SHARD_GRAD_OP' is not what "
                                             "FSDP1 trains: accelerate wraps with its sharding_strategy, FULL_SHARD"):
        validate_config(config)
    config.write_text(config.read_text() + "  fsdp_sharding_strategy: SHARD_GRAD_OP\n")  # what is asked is trained
    assert validate_config(config).fsdp_config["fsdp_sharding_strategy"] == "SHARD_GRAD_OP"


def test_check_command_one_line_per_problem_exit_2():
    bad = [BAD / name for name in sorted(BAD_CASES)]
    good = ROOT / "ds_configs" / "zero2.json"
    proc = shardscope("configs", "check", str(good), *map(str, bad))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("shardscope: error: ")]
    assert [line.split(": ")[2].split(":")[0] for line in errors] == [str(p) for p in bad]
    assert [line for line in proc.stdout.splitlines() if line.startswith("ok")] == [f"ok  {good}"]


# ----------------------------------------------------------------------------- CLI


def test_configs_lists_every_shipped_config_wrapped_not_cut():
    proc = shardscope("configs", env={"COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    entries = []  # one per config: its first line and the indented lines that continue it
    for line in proc.stdout.splitlines():
        # wrapped at 80 columns; only a literal longer than the space left keeps its own line whole
        assert len(line) <= 80 or " " not in line.strip(), line
        if line.startswith(" "):
            entries[-1] += " " + line.strip()
        else:
            entries.append(line)
    rows = {e.split()[0]: e.split()[1] for e in entries}
    assert rows == {c.name: c.kind for c in shipped_configs()}
    tp = next(e for e in entries if e.split()[0] == "tp")
    # the whole first sentence of tp.yaml's comment, which spans four comment lines
    assert tp.endswith("and 1/8 of most activations."), tp


@pytest.mark.parametrize("name, file", [("zero3", "accelerate_configs/zero3.yaml"),
                                        ("ds/zero3", "ds_configs/zero3.json")])
def test_configs_path_prints_the_file(name, file):
    proc = shardscope("configs", "path", name)
    assert proc.returncode == 0, proc.stderr
    printed = Path(proc.stdout.strip())
    assert printed.is_absolute() and printed.is_file()
    assert printed.read_bytes() == (ROOT / file).read_bytes()


def test_configs_path_unknown_name_is_one_line_exit_2():
    proc = shardscope("configs", "path", "zero4")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("shardscope: error: unknown config 'zero4'") and "zero3" in proc.stderr


def test_installed_wheel_ships_every_config(tmp_path):
    """`configs path` works from a pip-installed wheel: package data resolves the data/ symlinks into files."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # offline build with the venv's setuptools; a venv without it (Python >= 3.12) lets pip fetch it
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run([*pip, "wheel", "--no-deps", *isolation, "-w", tmp_path / "dist", ROOT],
                   check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("shardscope-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", tmp_path / "site", wheel], check=True,
                   capture_output=True, timeout=300)
    proc = shardscope("configs", "path", "ds/zero3", env={"PYTHONPATH": str(tmp_path / "site")})
    assert proc.returncode == 0, proc.stderr
    printed = Path(proc.stdout.strip())
    assert printed.is_relative_to(tmp_path / "site") and not printed.is_symlink()
    assert printed.read_bytes() == (ROOT / "ds_configs" / "zero3.json").read_bytes()
    shipped = {p.name for p in (tmp_path / "site" / "shardscope" / "data").rglob("*") if p.is_file()}
    assert {p.name for p, _ in SHIPPED} <= shipped


# ----------------------------------------------------------------------------- multi-node launcher arguments


def torchrun_config(args):
    """The environment and torchrun LaunchConfig accelerate's launcher would start for `args` (nothing starts)."""
    import torch.distributed.run as distrib_run
    from accelerate.utils.launch import _filter_args

    env = launch_env(args)  # also sets the torchrun fields (nnodes, node_rank, rdzv_endpoint) on args
    torchrun_args = _filter_args(args, distrib_run.get_args_parser(),
                                 ["--training_script", args.training_script, "--training_script_args", []])
    return env, distrib_run.config_from_args(torchrun_args)[0]


@pytest.mark.parametrize("name", MULTINODE)
@pytest.mark.parametrize("machine_rank", [0, 1])
def test_multinode_launcher_arguments(name, machine_rank):
    config = ROOT / "accelerate_configs" / f"{name}.yaml"
    port = free_port()
    args = launch_args(config, "--machine_rank", str(machine_rank), "--main_process_ip", "10.1.2.3",
                       "--main_process_port", str(port))
    assert (args.num_machines, args.num_processes) == (2, 16)
    env, launch = torchrun_config(args)
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node) == (2, 2, 8)  # world size 16
    assert launch.rdzv_backend == "static" and launch.rdzv_endpoint == f"10.1.2.3:{port}"
    assert launch.rdzv_configs["rank"] == machine_rank
    if name == "zero3_multinode":  # the "standard" launcher is torchrun: no pdsh/ssh command, no hostfile
        assert (env["ACCELERATE_USE_DEEPSPEED"], env["ACCELERATE_DEEPSPEED_ZERO_STAGE"]) == ("true", "3")
        assert args.deepspeed_multinode_launcher == "standard"
    elif name == "fsdp_hybrid_shard":
        assert (env["ACCELERATE_USE_FSDP"], env["FSDP_VERSION"]) == ("true", "2")
        assert (env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("2", "8")
    else:
        assert "ACCELERATE_USE_FSDP" not in env and "ACCELERATE_USE_DEEPSPEED" not in env
    if name == "hsdp_tp":  # replicas = nodes; shard x tp = GPUs per node; the recipe reads these
        assert [env[f"PARALLELISM_CONFIG_{k}_SIZE"] for k in ("DP_REPLICATE", "DP_SHARD", "TP")] == ["2", "2", "4"]


def run_sbatch(tmp_path, *args, **slurm_env):
    """The script under the srun and scontrol stand-ins (tests/launch.py), with an `accelerate` that prints its
    arguments: what each node's launcher would be given."""
    env = slurm_stand_ins(tmp_path, "gpu-node-[07-08]", ["gpu-node-07", "gpu-node-08"], dict(os.environ))
    # one write per line: both "nodes" print at once into the same pipe
    (tmp_path / "accelerate").write_text(f'#!{sys.executable}\nimport json, os\nimport sys\n'
                                         'os.write(1, (json.dumps(sys.argv[1:]) + "\\n").encode())\n')
    (tmp_path / "accelerate").chmod(0o755)
    env = {k: v for k, v in {**env, **slurm_env}.items() if v is not None}  # None: not set
    return subprocess.run(["bash", str(SBATCH), *args], capture_output=True, text=True, env=env, timeout=60)


def test_slurm_script_syntax():
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert validate_config(SBATCH, "slurm").startswith("#!/bin/bash")


def test_slurm_script_derives_launcher_flags(tmp_path):
    config = ROOT / "accelerate_configs" / "zero3_multinode.yaml"
    port = str(free_port())  # rank 0's launcher checks the port is free
    proc = run_sbatch(tmp_path, str(config), "train.py", "--bf16", MAIN_PROCESS_PORT=port,
                      SLURM_GPUS_ON_NODE="8")
    assert proc.returncode == 0, proc.stderr
    calls = sorted((json.loads(line) for line in proc.stdout.splitlines()), key=lambda argv: argv[2])
    assert len(calls) == 2  # one launcher per node (started at once: sorted by machine rank)
    for node, argv in enumerate(calls):
        assert argv[0] == "launch" and argv[-2:] == ["train.py", "--bf16"]
        flags = dict(zip(argv[1:-2:2], argv[2:-2:2]))
        assert flags == {"--machine_rank": str(node), "--config_file": str(config), "--num_machines": "2",
                         "--num_processes": "16", "--main_process_ip": "gpu-node-07", "--main_process_port": port}
        # what accelerate makes of those flags with the yaml
        args = launch_args(config, *argv[1:-2], script="train.py")
        _, launch = torchrun_config(args)
        assert (launch.max_nodes, launch.nproc_per_node, launch.rdzv_configs["rank"]) == (2, 8, node)
        assert launch.rdzv_endpoint == f"gpu-node-07:{port}"


def test_slurm_script_outside_slurm_fails_clearly(tmp_path):
    proc = run_sbatch(tmp_path, "x.yaml", "train.py", SLURM_NNODES=None, SLURM_JOB_NODELIST=None)
    assert proc.returncode != 0 and "SLURM_NNODES" in proc.stderr and proc.stdout == ""
