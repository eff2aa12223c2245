"""What a new user meets in the first hour: words they can know, help that explains itself, a TP line that
agrees with itself, GPU memory as sold, why alternatives lost, the CPU hint in compare, quiet output."""
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from shardscope import cli, compare
from shardscope.configs import find_config
from shardscope.mesh import Setup
from shardscope.model_spec import model_spec
from shardscope.planner import estimate

ROOT = Path(__file__).resolve().parents[1]
# "seed" for random seeds only: a yaml/keyword argument, torch/transformers calls, a `seed: int` parameter,
# `random.Random(seed)`-style calls; the old --convention spelling where it is kept as an alias.
RANDOM_SEED = re.compile(r"^seed: \d+$|seed=|manual_seed|set_seed|seed: int|\(seed\)|one seed and|seed-12")
ALIAS_PLACES = {"plugin/shardscope/plan_cli.py", "docs/planner.md"}


def shipped_text_files():
    for pattern in ("README.md", "docs/*.md", "recipes/**/*", "benchmarks/*.md", "plugin/shardscope/**/*.py",
                    "accelerate_configs/*", "ds_configs/*", "fsdp_configs/*", "examples/*.py", "scripts/*"):
        yield from (p for p in ROOT.glob(pattern) if p.is_file() and p.suffix in (".md", ".py", ".yaml", ".json",
                                                                                    ".sh", ".sbatch"))


def help_texts():
    parser = cli.build_parser()
    yield "shardscope --help", parser.format_help()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    for name, sub in subparsers.choices.items():
        yield f"shardscope {name} --help", sub.format_help()
        for action in sub._actions:  # nested subcommands (configs list/path/check)
            if isinstance(action.choices, dict):
                for nested_name, nested in action.choices.items():
                    yield f"shardscope {name} {nested_name} --help", nested.format_help()


def test_seed_means_a_random_seed_only():
    found = []
    for path in shipped_text_files():
        rel = str(path.relative_to(ROOT))
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "seed" in line.lower() and not RANDOM_SEED.search(line.strip()):
                found.append(f"{rel}:{n}: {line.strip()}")
            elif "seed-12" in line and rel not in ALIAS_PLACES:
                found.append(f"{rel}:{n}: {line.strip()}")
    for where, text in help_texts():
        found += [f"{where}: {line}" for line in text.splitlines() if "seed" in line.lower()]
    assert not found, "\n".join(found)


def test_top_level_help_is_for_users_with_an_example_per_command():
    text = cli.build_parser().format_help()
    assert "registers" not in text and "module" not in text
    examples = text.split("examples:")[1]
    for name in cli.build_parser()._subparsers._group_actions[0].choices:
        assert re.search(rf"^  shardscope {name}\b", examples, re.M), name


def test_old_convention_spelling_is_a_hidden_alias(capsys):
    assert cli.main(["plan", "--params", "7e9", "--gpus", "4", "--convention", "rule-of-thumb-12"]) == 0
    new = capsys.readouterr().out
    assert cli.main(["plan", "--params", "7e9", "--gpus", "4", "--convention", "seed-12"]) == 0
    assert capsys.readouterr().out == new and "rule-of-thumb-12 (2+2+8)" in new
    assert cli.main(["plan", "--params", "7e9", "--gpus", "4", "--convention", "seed-12", "--json"]) == 0
    assert '"rule-of-thumb-12"' in capsys.readouterr().out
    help_text = dict(help_texts())["shardscope plan --help"]
    assert "{rule-of-thumb-12}" in help_text and "seed" not in help_text


@pytest.mark.parametrize("params", ["1e9", "7e9", "8e9", "13e9", "70e9"])
@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_default_tp_line_agrees_with_itself(params, gpus, capsys):
    assert cli.main(["plan", "--params", params, "--gpus", str(gpus)]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("tensor parallel degree"))
    m = re.match(r"tensor parallel degree (\d+) \(default: gcd\(GPUs per node (\d+), heads(?: assumed)? (\d+), "
                 r"KV heads (\d+)\) = (\d+)", line)
    assert m, line
    degree, per_node, heads, kv, stated = map(int, m.groups())
    assert degree == stated == math.gcd(per_node, heads, kv) and per_node == gpus
    assert heads % degree == 0 and kv % degree == 0 and gpus % degree == 0
    assert ("give --heads or --tp" in line) == (degree == 1)


def test_heads_for_params_give_the_tp_degree(capsys):
    assert cli.main(["plan", "--params", "8e9", "--heads", "32", "--gpus", "8"]) == 0
    assert "tensor parallel degree 8 (default: gcd(GPUs per node 8, heads 32, KV heads 32) = 8)" in capsys.readouterr().out
    assert cli.main(["plan", "--model", "mistral-7b", "--heads", "32"]) == 2


def test_gpu_memory_as_sold_and_why_alternatives_lost(capsys):
    for prefer, pick, other in (("fsdp", "fsdp_shard_grad_op", "zero2"), ("deepspeed", "zero2", "fsdp_shard_grad_op")):
        assert cli.main(["plan", "--model", "mistral-7b", "--gpus", "4", "--gpu", "A100-80", "--prefer", prefer]) == 0
        out = capsys.readouterr().out
        assert "4 GPUs (4 x 1 nodes, 80 GiB (85.9 GB) each)" in out
        assert f"recommendation: {pick}:" in out
        assert re.search(rf"^  not {other}: fits too .*--prefer {prefer}.* puts {pick} first$", out, re.M), out
        assert re.search(r"^  not tp: fits too .* ranks after sharding", out, re.M), out
    rec = estimate(model_spec("mistral-7b"), Setup(gpus_per_node=4, gpu_memory_bytes=80 * 2 ** 30))["recommendation"]
    assert set(rec["not_chosen"]) == {"zero2", "tp"}  # fsdp_tp would repeat tp's mesh on 4 GPUs
    # nothing fits on one GPU: no alternative to explain
    one = estimate(model_spec("mistral-7b"), Setup(gpu_memory_bytes=2 ** 30))["recommendation"]
    assert one["strategy"] is None and "not_chosen" not in one


def test_compare_without_gpu_or_process_count_names_the_launcher_arguments():
    zero3 = find_config("zero3").path
    problem = compare.cpu_launch_problem([zero3], "accelerate", None, [], gpus=0)
    assert "zero3.yaml: num_processes 8" in problem and '--launcher-args "--num_processes 2 --mixed_precision no"' in problem
    assert compare.cpu_launch_problem([zero3], "accelerate", None, [], gpus=8) is None
    assert compare.cpu_launch_problem([zero3], "accelerate", 2, [], gpus=0) is None
    assert compare.cpu_launch_problem([zero3], "accelerate", None, ["--num_processes=2"], gpus=0) is None
    assert "deepspeed launcher" in compare.cpu_launch_problem([zero3], "deepspeed", None, [], gpus=0)


def test_compare_cli_stops_before_launching_on_cpu(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    code = cli.main(["compare", "--recipe", "recipes/causal_lm_sft.py", "--configs", "ddp", "zero3",
                     "--output-dir", str(tmp_path / "out"), "--", "--config", "recipes/llama/demo_tiny.yaml"])
    assert code == 2 and not (tmp_path / "out").exists()
    assert "--num_processes 2" in capsys.readouterr().err


def test_failed_runs_plot_without_warnings(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    failed = [{"run": "zero3", "dir": str(tmp_path), "exit_code": 1, "status": "failed", "reason": "boom"}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compare.plot_memory(failed, tmp_path / "memory.png")
    assert (tmp_path / "memory.png").stat().st_size > 0


def test_configs_check_output_is_its_own():
    proc = subprocess.run([sys.executable, "-m", "shardscope", "configs", "check", "ds_configs/zero3.json",
                           "accelerate_configs/zero3.yaml"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["ok  ds_configs/zero3.json", "ok  accelerate_configs/zero3.yaml"]
    assert "Setting accelerator" not in proc.stderr
