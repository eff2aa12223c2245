"""The tests' own launch helper (tests/launch.py), without a launch: which runs share a launch and how often it starts,
what tests/workers/several_runs.py is told, and the check that no process is left, which fails where it cannot tell."""
import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import launch
from launch import MultiNodeRun, Run, SharedLaunches, launch_together, left_processes, wait_until


def test_the_runs_of_a_group_share_one_launch_and_a_run_in_none_launches_alone():
    started = []

    def start(keys):
        started.append(keys)
        return {key: f"run {key}" for key in keys}

    runs = SharedLaunches([("a", "b"), ("c",)], start)
    assert [runs("b"), runs("a"), runs("d"), runs("b")] == ["run b", "run a", "run d", "run b"]
    assert started == [("a", "b"), ("d",)]


def test_a_failed_launch_fails_each_of_its_runs_and_is_not_started_again():
    started = []

    def start(keys):
        started.append(keys)
        raise AssertionError("the launch exited 1")

    runs = SharedLaunches([("a", "b")], start)
    for key in ("a", "b", "a"):
        with pytest.raises(AssertionError, match="exited 1"):
            runs(key)
    assert started == [("a", "b")]


@pytest.fixture
def launcher(monkeypatch, tmp_path):
    """launch.py's launchers replaced by a recorder: each call's (launcher, its positional arguments before the
    script's, the script's arguments, processes); each run's rank log and launch-environment record written as
    several_runs.py writes them, the environment it computed being `computed` (default: the one launched)."""
    calls, computed = [], {}

    def recorder(kind):
        def start(*args, num_processes=2, env=None):  # (env: the recipe runs' QLoRA path, not recorded)
            *before, script_args, out = [*args[:-2], [str(a) for a in args[-2]], Path(args[-1])]
            calls.append((kind, [str(a) for a in before], script_args, num_processes))
            for name in (script_args[i + 1] for i, token in enumerate(script_args) if token == "--run"):
                for rank in range(num_processes):
                    (out / "logs").mkdir(parents=True, exist_ok=True)
                    (out / "logs" / f"{name}.rank{rank}.log").write_text(f"{name} on rank {rank}\n")
                    record = {"launched": {"ACCELERATE_USE_CPU": "true"}}
                    record["computed"] = computed.get(name, record["launched"])
                    (out / "logs" / f"{name}.launch_env.rank{rank}.json").write_text(json.dumps(record))
            return Run([kind], 0, "launch output\n", out)
        return start

    for kind in ("accelerate", "deepspeed", "torchrun"):
        monkeypatch.setattr(launch, f"{kind}_launch", recorder(kind))
    return calls, computed


def test_one_yaml_runs_in_the_launchers_environment_and_several_each_in_its_own(launcher, tmp_path):
    calls, _ = launcher
    runs = launch_together([("a", "ddp.yaml", "train.py", ["--x", 1]), ("b", "ddp.yaml", "train.py", [])], tmp_path)
    assert calls[-1] == ("accelerate", ["ddp.yaml", str(launch.SEVERAL_RUNS)],
                         ["--run", "a", "train.py", "--x", "1", "--run", "b", "train.py"], 2)
    assert runs["b"].output == "launch output\nb on rank 0\nb on rank 1\n" and runs["b"].output_dir == tmp_path / "b"
    launch_together([("a", "ddp.yaml", "train.py", []), ("b", "zero3.yaml", "train.py", []),
                     ("c", "zero3.yaml", "train.py", [])], tmp_path)
    assert calls[-1][2] == ["--launch_config", "ddp.yaml", "--run", "a", "train.py",
                            "--launch_config", "zero3.yaml", "--run", "b", "train.py",
                            "--launch_config", "zero3.yaml", "--run", "c", "train.py"]


def test_the_deepspeed_and_torchrun_launchers_take_the_runs_as_their_scripts_arguments(launcher, tmp_path):
    calls, _ = launcher
    launch_together([("a", None, "train.py", ["--deepspeed", "zero3.json"])], tmp_path, launcher="deepspeed")
    launch_together([("a", None, "train.py", [])], tmp_path, launcher="torchrun", num_processes=4)
    assert calls == [("deepspeed", [str(launch.SEVERAL_RUNS)], ["--run", "a", "train.py", "--deepspeed", "zero3.json"],
                      2), ("torchrun", [str(launch.SEVERAL_RUNS)], ["--", "--run", "a", "train.py"], 4)]


def test_a_launch_environment_computed_otherwise_than_the_launcher_exported_fails(launcher, tmp_path):
    _, computed = launcher
    computed["a"] = {"ACCELERATE_USE_CPU": "true", "ACCELERATE_MIXED_PRECISION": "bf16"}
    with pytest.raises(AssertionError, match="ACCELERATE_MIXED_PRECISION"):
        launch_together([("a", "ddp.yaml", "train.py", []), ("b", "zero3.yaml", "train.py", [])], tmp_path)


def test_a_running_process_is_left_and_a_zombie_or_a_reaped_one_is_gone():
    # the child says when it runs: before its exec, a forked child's command line is still pytest's (seen on a busy machine)
    child = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE)
    proc = psutil.Process(child.pid)
    try:
        child.stdout.readline()
        assert left_processes([proc], "time.sleep(60)") == [(proc, "running")]
        assert left_processes([proc], "another run's folder") == []
        child.kill()  # ended, not yet reaped: a zombie
        assert wait_until(lambda: proc.status() == psutil.STATUS_ZOMBIE, 30, every=0.05)
        assert left_processes([proc]) == []
    finally:
        child.kill()
        child.wait()
    assert left_processes([proc]) == []


@pytest.mark.parametrize("error", [psutil.AccessDenied, PermissionError])
def test_a_process_that_cannot_be_read_is_left_so_no_process_left_fails(error):
    class Unreadable(psutil.Process):  # this process, as psutil sees one it may not read
        def status(self):
            raise error(self.pid)

    (proc, why), = left_processes([Unreadable()])
    assert why.startswith(f"cannot tell: {error.__name__}")
    assert MultiNodeRun([], [], [], Path("."), False, 0.0, [Unreadable()]).survivors() != []
