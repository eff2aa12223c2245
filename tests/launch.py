"""Run real 2-process CPU training the way users launch it, with only the CPU overrides a test needs.

The shipped configs are written for GPUs; a CPU run overrides, on the launcher's own command line,
only what CPU cannot honour (the process count, mixed precision, FSDP1's rank-0 loading). FSDP and
the `deepspeed` launcher additionally need `cpu_shim/` on PYTHONPATH (see its docstring).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SHIM = Path(__file__).resolve().parent / "cpu_shim"
BIN = Path(sys.executable).parent


@dataclass
class Run:
    cmd: list[str]
    returncode: int
    output: str
    output_dir: Path

    def check(self) -> "Run":
        assert self.returncode == 0, f"{' '.join(self.cmd)}\nexited {self.returncode}:\n{self.output[-6000:]}"
        return self


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=os.pathsep.join([str(SHIM), str(ROOT / "plugin")]))
    env.update(extra)
    return env


def accelerate_cpu_overrides(config_file: Path, num_processes: int = 2) -> list[str]:
    """Launcher flags that shrink a shipped GPU config to a CPU run with `num_processes` gloo ranks."""
    config = yaml.safe_load(Path(config_file).read_text())
    flags = ["--num_processes", str(num_processes), "--num_machines", "1", "--machine_rank", "0",
             "--main_process_port", str(free_port())]
    if config.get("distributed_type") != "DEEPSPEED":  # DeepSpeed takes precision from its own JSON
        flags += ["--mixed_precision", "no"]
    fsdp = config.get("fsdp_config") or {}
    if config.get("distributed_type") == "FSDP" and str(fsdp.get("fsdp_version", 1)) == "1":
        # FSDP1's rank-0 loading needs an accelerator device to broadcast from ("no available devices").
        flags += ["--fsdp_cpu_ram_efficient_loading", "false", "--fsdp_sync_module_states", "false"]
    return flags


def accelerate_launch(config_file, script, script_args, output_dir, num_processes=2, timeout=600) -> Run:
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(config_file),
           *accelerate_cpu_overrides(config_file, num_processes), str(script), *map(str, script_args),
           "--output_dir", str(output_dir)]
    return _run(cmd, output_dir, timeout)


def deepspeed_launch(script, script_args, output_dir, num_processes=2, timeout=600) -> Run:
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(num_processes), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), *map(str, script_args), "--output_dir", str(output_dir)]
    return _run(cmd, output_dir, timeout)


def torchrun_launch(script, script_args, output_dir, num_processes=2, timeout=600) -> Run:
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(num_processes), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), *map(str, script_args), "--output_dir", str(output_dir)]
    return _run(cmd, output_dir, timeout)


def _run(cmd, output_dir, timeout) -> Run:
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    output = proc.stdout + proc.stderr
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / "launch.log").write_text(" ".join(cmd) + "\n\n" + output)
    return Run(cmd, proc.returncode, output, Path(output_dir))
