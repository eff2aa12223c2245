"""Every command below prints, byte for byte, what it printed when its output was recorded (before the package
was moved into folders by layer): a refactor changes no output and no `--json` key. Left out: the checkout's root
(`<ROOT>`), a library's install folder (`<SITE>`), the dry run's own timing (`<T>`) and torch's log lines
(`E1125 21:29:05.818000 PID file:line]`, not shardscope's output). `python tests/test_cli_outputs.py --record`
records them again, after a change that means to change output.

The recordings are `python -m shardscope` subprocesses' output. The tests run each command in process through
`shardscope.cli.main(argv)` (file descriptors captured; the exit code main returns, or argparse's SystemExit),
saving a subprocess's imports per command, and ENTRY_POINT's commands again as subprocesses: the entry point
itself prints the same."""
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
# torch's log handlers keep the stderr they were made with: made here, at collection (as other test files' imports
# do in a whole run), not inside one test's capture that has closed by the next test. Their lines are left out.
import torch  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
RECORDED = Path(__file__).parent / "fixtures" / "cli_outputs"
DOCTOR = "tests/fixtures/doctor"
SITE = re.compile(r"\S*/site-packages/")  # a library's warning names its file: where it is installed varies
TIMING = re.compile(r"(computed = built: \w+, |\"seconds\": )[0-9.]+( s)?")
TORCH_LOG = re.compile(r"[EWI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")

COMMANDS = {
    "configs": ["configs"],
    "configs_path": ["configs", "path", "zero3"],
    "configs_check_bad": ["configs", "check", "tests/fixtures/bad_configs/ds_bad_stage.json"],
    "plan_list_models": ["plan", "--list-models"],
    "plan_params": ["plan", "--params", "7e9", "--gpus", "4"],
    "plan_params_json": ["plan", "--params", "7e9", "--gpus", "4", "--json"],
    "plan_params_convention": ["plan", "--params", "70B", "--gpus", "8", "--nodes", "2", "--gpu", "H100",
                               "--convention", "rule-of-thumb-12", "--optimizer", "adamw-8bit"],
    "plan_nothing_fits": ["plan", "--params", "70B", "--gpus", "2", "--gpu", "T4"],
    "plan_bad_input": ["plan", "--params", "seven"],
    "plan_model": ["plan", "--model", "mistral-7b", "--gpus", "4", "--gpu", "A100-80"],
    "plan_model_json": ["plan", "--model", "mistral-7b", "--gpus", "4", "--gpu", "A100-80", "--json"],
    "plan_model_tp": ["plan", "--model", "llama-3-8b", "--gpus", "8", "--gpu", "H100", "--tp", "2",
                      "--micro-batch", "2", "--seq-len", "2048", "--checkpointing", "--precision", "fp16-mixed"],
    "plan_model_lora": ["plan", "--model", "qwen2.5-0.5b", "--gpus", "2", "--gpu", "L4", "--lora-rank", "8",
                        "--lora-targets", "all-linear", "--reference-model", "--prefer", "deepspeed"],
    "plan_model_moe": ["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--nodes", "2", "--gpu", "H100",
                       "--json"],
    "plan_vision": ["plan", "--model", "dinov2-large", "--gpus", "2", "--gpu", "A100-40", "--image-size", "448",
                    "--micro-batch", "4"],
    "plan_dry_run": ["plan", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "H100", "--dry-run"],
    "plan_dry_run_json": ["plan", "--model", "llama-3-8b", "--gpus", "4", "--tp", "2", "--dry-run", "--json"],
    "plan_dry_run_hybrid": ["plan", "--model", "llama-3-8b", "--gpus", "4", "--nodes", "2", "--dry-run",
                            "--strategy", "fsdp_hybrid_shard", "--strategy", "hsdp_tp"],
    "fit": ["fit", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "H100", "--seq-len", "4096",
            "--global-batch", "64"],
    "fit_json": ["fit", "--params", "13B", "--gpus", "4", "--nodes", "2", "--gpu", "A100-80", "--seq-len", "2048",
                 "--global-batch", "32", "--json", "--top", "5"],
    "fit_nothing": ["fit", "--params", "70B", "--gpus", "1", "--gpu", "T4", "--global-batch", "8"],
    "doctor_zero3": ["doctor", "--accelerate-config", "zero3", "--model", "mistral-7b", "--gpus", "4",
                     "--gpu", "A100-40"],
    "doctor_ds_mismatch": ["doctor", "--deepspeed", f"{DOCTOR}/ds_mismatch.json", "--",
                           "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--bf16"],
    "doctor_fsdp": ["doctor", "--fsdp-config", f"{DOCTOR}/fsdp_wrong_layer_class.yaml", "--model", "llama-2-7b"],
    "doctor_accelerate": ["doctor", "--accelerate-config", f"{DOCTOR}/fsdp1_offload_flat_params.yaml"],
    "doctor_hostfile": ["doctor", "--hostfile", "ds_configs/hostfile", "--nodes", "2", "--gpus", "4"],
    "report_missing": ["report", "no/such/run"],
}


def env_of(cache: str) -> dict:
    """The commands' environment: the caller's, less what doctor's multi-node fingerprint reads."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("NCCL_", "GLOO_", "MASTER_"))}
    env.update(PYTHONPATH=str(ROOT / "plugin"), SHARDSCOPE_CACHE=cache, COLUMNS="100")
    return env


def as_recorded(argv: list[str], code: int, stdout: str, stderr: str) -> str:
    text = f"$ shardscope {' '.join(argv)}\n--- exit {code}\n--- stdout\n{stdout}--- stderr\n{stderr}"
    text = TIMING.sub(r"\1<T>\2", SITE.sub("<SITE>/", text).replace(str(ROOT), "<ROOT>"))
    return "".join(line for line in text.splitlines(keepends=True) if not TORCH_LOG.match(line))


def run(argv: list[str], cache: str) -> str:
    """What `python -m shardscope ARGV` prints, as recorded."""
    done = subprocess.run([sys.executable, "-m", "shardscope", *argv], cwd=ROOT, env=env_of(cache),
                          capture_output=True, text=True, timeout=600)
    return as_recorded(argv, done.returncode, done.stdout, done.stderr)


def run_in_process(argv: list[str], cache: str, capfd, monkeypatch) -> str:
    """The same command through `cli.main(argv)` in this process, in the subprocess's environment and folder."""
    from shardscope.cli import main

    for name in os.environ:
        if name.startswith(("NCCL_", "GLOO_", "MASTER_")):
            monkeypatch.delenv(name)
    for name, value in env_of(cache).items():
        if name != "PYTHONPATH":  # this process imports the checkout's plugin/ already
            monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)
    capfd.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's usage errors; the interpreter's exit status for them
        code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
    out, err = capfd.readouterr()
    return as_recorded(argv, code, out, err)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("spec_cache"))


# Also run as real subprocesses (`python -m shardscope`): an error (exit 2, one line on stderr) and a table.
ENTRY_POINT = ["plan_bad_input", "plan_params"]


@pytest.mark.parametrize("name", COMMANDS)
def test_output_is_as_recorded(cache, capfd, monkeypatch, name):
    assert run_in_process(COMMANDS[name], cache, capfd, monkeypatch) == (RECORDED / f"{name}.txt").read_text()


@pytest.mark.parametrize("name", ENTRY_POINT)
def test_entry_point_output_is_as_recorded(cache, name):
    assert run(COMMANDS[name], cache) == (RECORDED / f"{name}.txt").read_text()


def test_every_recording_has_its_command():
    assert sorted(p.stem for p in RECORDED.glob("*.txt")) == sorted(COMMANDS)


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    RECORDED.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(2) as pool:
        for name, text in zip(COMMANDS, pool.map(lambda argv: run(argv, folder), COMMANDS.values())):
            (RECORDED / f"{name}.txt").write_text(text)
    print(json.dumps(sorted(COMMANDS)))
