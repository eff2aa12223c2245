"""Launching a training script under `accelerate launch` or `deepspeed`, one run per folder, its output in a log:
what `shardscope compare` and `shardscope calibrate` share (commands, free ports, the CPU check, reading why a
run failed)."""
from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..summary import SUMMARY_FILE

LOG_FILE = "launch.log"
MAX_LOG_BYTES = 16 * 2 ** 20  # the end of a launch log (its exit-code footer and last errors) is what is read
# the footer `launch` writes ("[shardscope compare]" in logs written before calibrate shared it)
_FOOTER = re.compile(r"^\[shardscope(?: compare)?\] exit code (-?\d+) after ([\d.]+) s$", re.MULTILINE)


def exit_footer(log_text: str):
    """The launch log's footer match (exit code, seconds), or None for a run that did not finish."""
    found = list(_FOOTER.finditer(log_text))
    return found[-1] if found else None


def executable(name: str) -> str:
    """The launcher beside this Python (the venv's), else whatever PATH finds."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(launcher: str, recipe: str, config: Path, recipe_args: list[str], output_dir: Path,
                   num_processes: int | None = None, launcher_args: list[str] = ()) -> list[str]:
    """accelerate: `accelerate launch --config_file C [--num_processes N] [port] ARGS recipe ... --output_dir D`;
    deepspeed: `deepspeed [--num_gpus N] [port] ARGS recipe ... --output_dir D --deepspeed C`.
    A free port is added unless the launcher arguments name one, so consecutive runs never collide."""
    launcher_args = list(launcher_args)
    if launcher == "accelerate":
        cmd = [executable("accelerate"), "launch", "--config_file", str(config)]
        count, port = "--num_processes", "--main_process_port"
        tail = ["--output_dir", str(output_dir)]
    else:
        cmd, count, port = [executable("deepspeed")], "--num_gpus", "--master_port"
        tail = ["--output_dir", str(output_dir), "--deepspeed", str(config)]
    if num_processes:
        cmd += [count, str(num_processes)]
    if not any(a.split("=")[0] == port for a in launcher_args):
        cmd += [port, str(free_port())]
    return cmd + launcher_args + [str(recipe), *recipe_args] + tail


CPU_LAUNCHER_ARGS = "--num_processes 2 --mixed_precision no"


def cpu_launch_problem(configs: list[Path], launcher: str, num_processes: int | None, launcher_args: list[str],
                       gpus: int) -> str | None:
    """On a machine with no GPU, why the launch would fail and which launcher arguments to pass, or None.

    The shipped configs start one process per GPU (num_processes 8, bf16); without a GPU and without a
    process count the launcher would start them all on this machine's cores."""
    import yaml

    given = num_processes or any(a.split("=")[0] in ("--num_processes", "--num_gpus") for a in launcher_args)
    if gpus or given:
        return None
    cores = os.cpu_count() or 1
    if launcher == "accelerate":
        asked = {}
        for config in configs:
            try:
                asked[config.name] = int((yaml.safe_load(config.read_text()) or {}).get("num_processes") or 1)
            except (yaml.YAMLError, ValueError, TypeError, AttributeError):
                continue  # the launcher names the bad file itself
        too_many = {name: n for name, n in asked.items() if n > cores}
        if not too_many:
            return None
        what = ", ".join(f"{name}: num_processes {n}" for name, n in too_many.items())
    else:
        what = "the deepspeed launcher starts one process per GPU"
    return (f"no GPU on this machine and no process count given ({what}; {cores} CPU cores). On CPU pass "
            f"--launcher-args \"{CPU_LAUNCHER_ARGS}\" (2 processes over gloo, fp32); FSDP configs then train as "
            f"plain DDP, see docs/compare.md")


def launch(cmd: list[str], run_dir: Path, env: dict | None = None) -> tuple[int, float]:
    """Run `cmd` (in `env`, else this process's environment), stdout and stderr together into run_dir/launch.log
    (command first, exit code last)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(run_dir / LOG_FILE, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n\n")
        log.flush()
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env).returncode
        seconds = time.perf_counter() - start
        log.write(f"\n[shardscope] exit code {code} after {seconds:.1f} s\n")
    return code, seconds


# What went wrong, best first: a Python exception / OOM / a script's one-line usage error; then a signal
# (e.g. the kernel's OOM killer: SIGKILL); launcher lines that only say a child failed are skipped.
_ERRORS = (re.compile(r"^([\w.]*(Error|Exception|Interrupt)\b.*|.*out of memory.*|\S+\.py: error: .*)$", re.I),
           re.compile(r".*Signal \d+ \(SIG\w+\).*"))
_LAUNCHER_NOISE = ("CalledProcessError", "ChildFailedError", "elastic", "exits with return code")


def no_summary_reason(exit_code: int | None, log_text: str) -> str:
    return f"exited 0 but wrote no {SUMMARY_FILE} (profiler not attached?)" if exit_code == 0 else \
        failure_reason(log_text)


def failure_reason(log_text: str) -> str:
    """The last meaningful error line of a launch log (rank prefixes dropped; an error ending in ':' gets
    its next line), else the log's last line."""
    lines = [re.sub(r"^\[(rank|default)\d+\]:\s*", "", line).strip() for line in log_text.splitlines()]
    lines = [line for line in lines if line and not _FOOTER.match(line)]
    for pattern in _ERRORS:
        hits = [i for i, line in enumerate(lines) if pattern.match(line) and not any(n in line for n in _LAUNCHER_NOISE)]
        if hits:
            i = hits[-1]
            reason = lines[i] + (" " + lines[i + 1] if lines[i].endswith(":") and i + 1 < len(lines) else "")
            break
    else:
        reason = lines[-1] if lines else "empty log"
    return reason if len(reason) <= 240 else reason[:237] + "..."


