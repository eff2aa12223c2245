"""Run real 2-process CPU training the way users launch it, with only the CPU overrides a test needs.

The shipped configs are written for GPUs; a CPU run overrides, on the launcher's own command line,
only what CPU cannot honour (the process count, mixed precision, FSDP1's rank-0 loading). FSDP and
the `deepspeed` launcher additionally need `cpu_shim/` on PYTHONPATH (see its docstring).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
SHIM = Path(__file__).resolve().parent / "cpu_shim"
BIN = Path(sys.executable).parent
SEVERAL_RUNS = ROOT / "tests" / "workers" / "several_runs.py"
# bitsandbytes, installed apart from the venv's packages (Makefile: PEFT imports it in every process that can find
# it, ~1.3 s of CPU each): on the path of this test process (conftest.py) and of the launches that quantise
QLORA_SITE = Path(sys.prefix) / "qlora"
PATHS = [str(SHIM), str(ROOT / "plugin")]  # a launch's PYTHONPATH
QLORA_ENV = {"PYTHONPATH": os.pathsep.join([*PATHS, str(QLORA_SITE)])}  # what a launch that quantises sets


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
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=os.pathsep.join(PATHS))
    env.update(extra)
    return env


def shardscope_cli(*args, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python -m shardscope ARGS` from the checkout, in the CPU environment (the runs it launches inherit the shim)."""
    return subprocess.run([sys.executable, "-m", "shardscope", *map(str, args)], env=cpu_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


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


def accelerate_launch(config_file, script, script_args, output_dir, num_processes=2, timeout=600,
                      launcher_args=(), env=None) -> Run:
    """`env`: variables set on top of the CPU environment."""
    return _run(accelerate_cmd(config_file, script, script_args, output_dir, num_processes, launcher_args), output_dir,
                timeout, env)


def launch_together(runs, output_dir, launcher="accelerate", num_processes=2, env=None) -> dict[str, Run]:
    """Runs `(name, accelerate yaml or None, script, args)` one after another in one launch (tests/workers/
    several_runs.py: one start-up for all) through `launcher`: "accelerate" (under the first run's yaml), "deepspeed"
    or "torchrun" (their runs' configs are script arguments: no yaml). A launch of several yamls gives every run its
    own yaml's launch environment (several_runs.py --launch_config), and the one several_runs computes for the
    launcher's own yaml is held equal to what the launcher exported. Returns each run's `Run`: the launch's output,
    then that run's rank logs, and its folder. `env`: variables set on top of the CPU environment (accelerate)."""
    several = len({config for _, config, _, _ in runs}) > 1
    args = []
    for name, config, script, script_args in runs:
        args += [*(["--launch_config", config] if several else []), "--run", name, script, *script_args]
    if launcher == "accelerate":
        launched = accelerate_launch(runs[0][1], SEVERAL_RUNS, args, output_dir, num_processes=num_processes, env=env)
    elif launcher == "deepspeed":  # as on a GPU node; cpu_shim gives accelerate DeepSpeed's gloo
        launched = deepspeed_launch(SEVERAL_RUNS, args, output_dir, num_processes=num_processes)
    else:  # `--`: torchrun's own parser would read `--run` as short for its --run-path
        launched = torchrun_launch(SEVERAL_RUNS, ["--", *args], output_dir, num_processes=num_processes)
    logs = Path(output_dir) / "logs"
    if several and launched.returncode == 0:
        for rank in range(num_processes):
            record = json.loads((logs / f"{runs[0][0]}.launch_env.rank{rank}.json").read_text())
            assert record["launched"] == record["computed"], record
    return {name: Run(launched.cmd, launched.returncode,
                      launched.output + "".join(log.read_text() for log in sorted(logs.glob(f"{name}.rank*.log"))),
                      Path(output_dir) / name) for name, *_ in runs}


class SharedLaunches:
    """Runs trained together in one launch (its start-up is most of a tiny run's time), launched the first time any
    of them is asked for and kept for the session: `groups` holds each shared launch's run keys in order (a key in
    none is launched alone), `launch(keys)` launches those runs and returns {key: result}. A launch that fails fails
    each of its runs: it is not launched again for the next test that asks."""

    def __init__(self, groups, launch):
        self.groups, self.launch, self.results = [tuple(group) for group in groups], launch, {}

    def __call__(self, key):
        if key not in self.results:
            keys = next((group for group in self.groups if key in group), (key,))
            try:
                self.results.update(self.launch(keys))
            except Exception as error:
                self.results.update(dict.fromkeys(keys, error))
        if isinstance(self.results[key], Exception):
            raise self.results[key]
        return self.results[key]


def deepspeed_launch(script, script_args, output_dir, num_processes=2, timeout=600) -> Run:
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(num_processes), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), *map(str, script_args), "--output_dir", str(output_dir)]
    return _run(cmd, output_dir, timeout)


def torchrun_launch(script, script_args, output_dir, num_processes=2, timeout=600) -> Run:
    return _run(torchrun_cmd(script, script_args, output_dir, num_processes), output_dir, timeout)


def torchrun_cmd(script, script_args, output_dir, num_processes=2) -> list[str]:
    return [str(BIN / "torchrun"), "--nproc_per_node", str(num_processes), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), str(script), *map(str, script_args), "--output_dir", str(output_dir)]


def accelerate_cmd(config_file, script, script_args, output_dir, num_processes=2, launcher_args=()) -> list[str]:
    return [str(BIN / "accelerate"), "launch", "--config_file", str(config_file),
            *accelerate_cpu_overrides(config_file, num_processes), *map(str, launcher_args), str(script),
            *map(str, script_args), "--output_dir", str(output_dir)]


def background(cmd, output_dir) -> subprocess.Popen:
    """Start `cmd` in a session of its own (its log in output_dir/launch.log): `os.killpg(proc.pid, ...)` ends the
    launcher and every rank it started."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(output_dir) / "launch.log", "w") as log:
        return subprocess.Popen(cmd, env=cpu_env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)


def wait_until(done, timeout: float, every: float = 0.5) -> bool:
    """Poll `done()` until it is true or `timeout` seconds passed (a harness bound, not a timing claim)."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def left_processes(processes, text: str = "") -> list[tuple[psutil.Process, str]]:
    """(process, why) for each of `processes` whose command line contains `text` and that is not known to be gone:
    "running", or "cannot tell: ERROR" where psutil could not say (AccessDenied, any other error), so that a "no
    process left" check that cannot see fails rather than passes. Gone: no such process (psutil checks the create
    time, so a reused pid is gone too) or a zombie (ended, not yet reaped)."""
    left = []
    for proc in processes:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE and text in " ".join(proc.cmdline()):
                left.append((proc, "running"))
        except psutil.NoSuchProcess:  # psutil.ZombieProcess too
            pass
        except Exception as error:
            left.append((proc, f"cannot tell: {type(error).__name__}: {error}"))
    return left


def end_launch(proc: subprocess.Popen, output_dir) -> list[tuple[psutil.Process, str]]:
    """End a `background` launch as a job scheduler does (SIGTERM to the launcher, which ends its ranks); returns the
    processes of the run still there 30 s later (a run's output dir names its launcher and every rank; left_processes
    says why each counts), those known to be running then killed, so that none outlives the test."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    wait_until(lambda: not left_processes(psutil.process_iter(), str(output_dir)), 30)
    left = left_processes(psutil.process_iter(), str(output_dir))
    for process, why in left:
        if why == "running":
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
    return left


def _run(cmd, output_dir, timeout, env=None) -> Run:
    proc = subprocess.run(cmd, env=cpu_env(**(env or {})), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    output = proc.stdout + proc.stderr
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / "launch.log").write_text(" ".join(cmd) + "\n\n" + output)
    return Run(cmd, proc.returncode, output, Path(output_dir))


# ----------------------------------------------------------------------------- multi-node on loopback
@dataclass
class MultiNodeRun:
    """Several launchers (one per "node") started together; every process they started is tracked."""

    cmds: list
    returncodes: list        # per launcher; None where it had to be killed
    outputs: list            # per launcher: stdout + stderr
    output_dir: Path
    timed_out: bool
    seconds: float
    processes: list          # psutil.Process of every launcher and every descendant seen while running

    def survivors(self) -> list[tuple[psutil.Process, str]]:
        """This run's processes not known to be gone, each with why (left_processes)."""
        return left_processes(self.processes)

    def check(self) -> "MultiNodeRun":
        text = "\n".join(f"--- launcher {i} (exit {rc}): {' '.join(cmd)}\n{out[-4000:]}"
                         for i, (cmd, rc, out) in enumerate(zip(self.cmds, self.returncodes, self.outputs)))
        assert not self.timed_out and self.returncodes == [0] * len(self.cmds), text
        return self


def accelerate_multinode_flags(config_file: Path, machine_rank: int, num_machines: int, procs_per_machine: int,
                               main_process_ip: str, main_process_port: int) -> list[str]:
    """Launcher flags that run a shipped multi-node config as `num_machines` "nodes" of `procs_per_machine`
    CPU ranks: the real per-node flags a cluster user passes, plus the CPU overrides (`--mixed_precision no`
    except DeepSpeed; an FSDP2 HSDP mesh of nodes x processes per node)."""
    config = yaml.safe_load(Path(config_file).read_text())
    flags = ["--num_machines", str(num_machines), "--machine_rank", str(machine_rank),
             "--main_process_ip", main_process_ip, "--main_process_port", str(main_process_port),
             "--num_processes", str(num_machines * procs_per_machine)]
    if config.get("distributed_type") != "DEEPSPEED":
        flags += ["--mixed_precision", "no"]
    if config.get("parallelism_config"):
        flags += ["--parallelism_config_dp_replicate_size", str(num_machines),
                  "--parallelism_config_dp_shard_size", str(procs_per_machine)]
    return flags


def accelerate_multinode_launch(config_file, script, script_args, output_dir, num_machines=2, procs_per_machine=2,
                                main_process_ip="127.0.0.1", main_process_port=None, machine_ranks=None,
                                launcher_flags=(), timeout=120) -> MultiNodeRun:
    """Start one `accelerate launch` per machine rank on this host (each in its own session), wait for all,
    and on `timeout` kill every process they started. `machine_ranks` picks which "nodes" start (default
    all), e.g. `[1]` for a node whose main node never comes up."""
    config = yaml.safe_load(Path(config_file).read_text())
    # accelerate reports a non-distributed state on CPU ranks of a MULTI_GPU/FSDP launch unless told it is
    # a CPU run; DeepSpeed must not get it (the Trainer would wrap the ZeRO-3 model in DDP instead).
    env = cpu_env(**({} if config.get("distributed_type") == "DEEPSPEED" else {"ACCELERATE_USE_CPU": "1"}))
    port = main_process_port or free_port()
    ranks = list(range(num_machines)) if machine_ranks is None else list(machine_ranks)
    cmds = {rank: [str(BIN / "accelerate"), "launch", "--config_file", str(config_file),
                   *accelerate_multinode_flags(config_file, rank, num_machines, procs_per_machine, main_process_ip,
                                               port), *map(str, launcher_flags), str(script), *map(str, script_args)]
            for rank in ranks}
    return multinode_launch(cmds, env, output_dir, timeout)


def deepspeed_multinode_launch(hostfile, script, script_args, output_dir, num_machines=2, timeout=120) -> MultiNodeRun:
    """DeepSpeed's own multi-node launch without ssh, one `deepspeed` launcher per host of `hostfile` on this
    machine: `deepspeed --hostfile F --no_ssh --node_rank N --master_addr 127.0.0.1 --master_port P`."""
    port = free_port()
    cmds = {rank: [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(rank),
                   "--master_addr", "127.0.0.1", "--master_port", str(port), str(script), *map(str, script_args)]
            for rank in range(num_machines)}
    return multinode_launch(cmds, cpu_env(), output_dir, timeout)


def multinode_launch(cmds: dict, env: dict, output_dir, timeout) -> MultiNodeRun:
    """Start each node's launcher command (node rank -> argv) on this host, each in its own session, wait for
    all, and on `timeout` kill every process they started."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    launchers, logs = [], []
    start = time.monotonic()
    for rank, cmd in cmds.items():
        log = open(output_dir / f"launcher{rank}.log", "w+")
        launchers.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        logs.append(log)
    seen = {}

    def track():
        for launcher in launchers:
            try:
                root = psutil.Process(launcher.pid)
                for proc in [root, *root.children(recursive=True)]:
                    seen.setdefault(proc.pid, proc)
            except psutil.Error:
                pass

    timed_out = False
    while any(p.poll() is None for p in launchers):
        track()
        if time.monotonic() - start > timeout:
            timed_out = True
            break
        time.sleep(0.2)
    if timed_out:
        track()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for launcher in launchers:
                try:
                    os.killpg(launcher.pid, sig)  # the launcher's session: its agent and ranks
                except ProcessLookupError:
                    pass
            for proc in seen.values():  # anything that left the session
                try:
                    proc.send_signal(sig)
                except psutil.Error:
                    pass
            _, alive = psutil.wait_procs(list(seen.values()), timeout=5)
            if not alive:
                break
    returncodes = []
    for launcher in launchers:
        try:
            launcher.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        returncodes.append(None if timed_out else launcher.returncode)
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return MultiNodeRun(list(cmds.values()), returncodes, outputs, output_dir, timed_out, time.monotonic() - start,
                        list(seen.values()))


# ----------------------------------------------------------------------------- SLURM on one machine
SBATCH = ROOT / "accelerate_configs" / "slurm_multinode.sbatch"
# srun as SLURM runs a one-task-per-node step: the command on every node at once, each with its SLURM_NODEID
SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift 2; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def slurm_stand_ins(folder: Path, nodelist: str, hostnames: list[str], env: dict) -> dict:
    """Write stand-ins for `srun` and `scontrol show hostnames NODELIST` into `folder`; `env` as a job of
    len(hostnames) nodes sees it (its own SLURM_* set, the stand-ins first on PATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = "\\n".join(hostnames)
    scontrol = f'#!/bin/bash\n[[ "$*" == "show hostnames {nodelist}" ]] && printf "{names}\\n"\n'
    for name, text in (("srun", SRUN), ("scontrol", scontrol)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    return dict(env, PATH=f"{folder}{os.pathsep}{env['PATH']}", SLURM_NNODES=str(len(hostnames)),
                SLURM_JOB_NODELIST=nodelist)


def slurm_launch(config_file, script, script_args, output_dir, procs_per_node=2, timeout=150) -> MultiNodeRun:
    """`bash slurm_multinode.sbatch CONFIG --mixed_precision no SCRIPT ARGS` as a 2-node SLURM job would run it,
    both "nodes" on 127.0.0.1 (the CPU override goes before the script, where the launcher reads it)."""
    env = slurm_stand_ins(Path(output_dir) / "slurm_bin", "node-[0-1]", ["127.0.0.1", "127.0.0.1"], cpu_env())
    env.update(GPUS_PER_NODE=str(procs_per_node), MAIN_PROCESS_PORT=str(free_port()), ACCELERATE_USE_CPU="1")
    cmd = ["bash", str(SBATCH), str(config_file), "--mixed_precision", "no", str(script), *map(str, script_args)]
    return multinode_launch({0: cmd}, env, output_dir, timeout)
