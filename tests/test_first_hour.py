"""What a new user meets in the first hour: words they can know, help that explains itself, a TP line that
agrees with itself, GPU memory as sold, why alternatives lost, the CPU hint in compare, quiet output."""
import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from shardscope import cli
from shardscope.fit import launching
from shardscope.report import compare
from shardscope.configs.catalog import find_config
from shardscope.plan.mesh import Setup
from shardscope.model.spec import model_spec
from shardscope.plan.planner import estimate

ROOT = Path(__file__).resolve().parents[1]
# "seed" for random seeds only: a yaml/keyword argument, torch/transformers calls, a `seed: int` parameter,
# `random.Random(seed)`-style calls; the old --convention spelling where it is kept as an alias.
RANDOM_SEED = re.compile(r"^seed: \d+$|seed=|manual_seed|set_seed|seed: int|\(seed\)|one seed and|seed-12")
ALIAS_PLACES = {"plugin/shardscope/cli/plan.py"}  # hidden: no doc names it; its user is told on use


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
    assert capsys.readouterr().err == ""
    assert cli.main(["plan", "--params", "7e9", "--gpus", "4", "--convention", "seed-12"]) == 0
    old = capsys.readouterr()
    assert old.out == new and "rule-of-thumb-12 (2+2+8)" in new
    assert old.err.splitlines() == ["shardscope: note: --convention seed-12 is now --convention rule-of-thumb-12 "
                                    "(also the --json key); the old spelling goes in the next release"]
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
    assert cli.main(["doctor", "--accelerate-config", "ddp", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "A100-40",
                     "--", "--bf16"]) == 1  # doctor's no-fit finding says it the same way
    assert re.search(r"per GPU at its peak \(\w+\); a 40 GiB \(42.9 GB\) GPU has 38.7 GB usable \(10% headroom kept\)",
                     capsys.readouterr().out)
    rec = estimate(model_spec("mistral-7b"), Setup(gpus_per_node=4, gpu_memory_bytes=80 * 2 ** 30))["recommendation"]
    assert set(rec["not_chosen"]) == {"zero2", "tp"}  # fsdp_tp would repeat tp's mesh on 4 GPUs
    # nothing fits on one GPU: no alternative to explain
    one = estimate(model_spec("mistral-7b"), Setup(gpu_memory_bytes=2 ** 30))["recommendation"]
    assert one["strategy"] is None and "not_chosen" not in one


def test_compare_without_gpu_or_process_count_names_the_launcher_arguments():
    zero3 = find_config("zero3").path
    problem = launching.cpu_launch_problem([zero3], "accelerate", None, [], gpus=0)
    assert "zero3.yaml: num_processes 8" in problem and '--launcher-args "--num_processes 2 --mixed_precision no"' in problem
    assert launching.cpu_launch_problem([zero3], "accelerate", None, [], gpus=8) is None
    assert launching.cpu_launch_problem([zero3], "accelerate", 2, [], gpus=0) is None
    assert launching.cpu_launch_problem([zero3], "accelerate", None, ["--num_processes=2"], gpus=0) is None
    assert "deepspeed launcher" in launching.cpu_launch_problem([zero3], "deepspeed", None, [], gpus=0)


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


def test_configs_check_output_is_its_own(capfd):
    proc = subprocess.run([sys.executable, "-m", "shardscope", "configs", "check", "ds_configs/zero3.json",
                           "accelerate_configs/zero3.yaml"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["ok  ds_configs/zero3.json", "ok  accelerate_configs/zero3.yaml"]
    assert "Setting accelerator" not in proc.stderr
    # doctor reads the same files through DeepSpeed's own config classes: its output is its own too (in process:
    # the import-time notice is the subprocess's above; file descriptors captured, so a library's print shows)
    assert cli.main(["doctor", "--deepspeed", "ds/zero3", "--accelerate-config", "zero3"]) == 0
    out, err = capfd.readouterr()
    assert err == "" and out.splitlines()[-1] == "no problems found (checked: accelerate file; DeepSpeed file)"


def test_readme_names_the_extensions_folder_the_makefile_sets():
    """DeepSpeed's JIT builds land in TORCH_EXTENSIONS_DIR: the README's export reuses the Makefile's folder."""
    makefile, readme = (ROOT / "Makefile").read_text(), (ROOT / "README.md").read_text()
    assert re.search(r"^export TORCH_EXTENSIONS_DIR \?= \$\(CURDIR\)/\$\(VENV\)/torch_extensions$", makefile, re.M)
    assert re.search(r"^VENV +\?= \.venv$", makefile, re.M)
    assert "`export TORCH_EXTENSIONS_DIR=$PWD/.venv/torch_extensions`" in readme


# --- The README and docs stay true: every command in their shell blocks parses, the cheap ones run ----------

DOCS = ["README.md", "docs/planner.md", "docs/compare.md", "docs/doctor.md", "docs/cluster.md", "docs/precision.md",
        "docs/parity.md",
        "docs/fit.md", "docs/configs.md", "docs/summary.md", "benchmarks/README.md", "recipes/llama/README.md", "recipes/mistral/README.md", "recipes/dinov2/README.md",
        "ds_configs/README.md", "fsdp_configs/README.md", "SECURITY.md"]
PROGRAMS = ("shardscope", "accelerate", "torchrun", "deepspeed", "python", "python3", "make", "pytest", "export")
# Inputs that stand for the user's own (a hub id, a folder, a finished run): offline here they must end in
# one line naming them and exit 2; each stays in the docs as the example it is.
USERS_OWN = {"meta-llama/Llama-2-7b-hf": "hub id", "./my_model_folder": "folder",
             "output/shardscope_summary.json": "summary"}
# Parsed, not run here: they launch training (compare, calibrate, parity), write files into the checkout (fit --output-dir; its
# own tests run it), take a minute of CPU (--dry-run on 512 ranks) or wait for other nodes (preflight).
PARSE_ONLY = ("compare", "calibrate", "parity", "fit", "--dry-run", "preflight")
# Folders named in the text that a run creates (outputs), not files the checkout must have.
# What a user sets for the shell variables the docs use (multi-node launches).
SHELL_VARIABLES = {"NODE_RANK": "0", "MAIN_NODE_IP": "10.0.0.1"}
OUTPUTS = ("demo_out/", "compare_out/", "out/", "output/", "runs/", "assets/", "model_out", "pp.json", "single.json")


GENERATED = re.compile(r"<!-- results:([\w.#-]+) -->.*?<!-- /results:\1 -->", re.S)


def fenced_blocks(doc: str, languages=("bash", "sh", "shell", "")):
    """The text of each fenced block in `doc` whose info string is one of `languages` (fences paired in order).
    Blocks placed from a results file are left out: tests/test_docs_results.py holds them to the file, and the
    script that writes the file is tested against what the commands print (tests/test_benchmarks.py)."""
    blocks, current, language = [], None, None
    for line in GENERATED.sub("", (ROOT / doc).read_text()).splitlines():
        fence = re.match(r"^\s*```(\w*)\s*$", line)
        if fence and current is None:
            current, language = [], fence.group(1)
        elif fence:
            if language in languages:
                blocks.append("\n".join(current) + "\n")
            current = None
        elif current is not None:
            current.append(line.strip())
    return blocks


def shell_commands(doc: str):
    """(doc, command as argv) for every command line in the doc's fenced shell blocks (continuations joined,
    comments dropped); `$(shardscope configs path NAME)` and $VARIABLES resolved as the shell would."""
    for block in fenced_blocks(doc):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.removeprefix("$ ")  # a shell prompt before a command shown with its output
            program = re.sub(r"^(?:[A-Z_]+=\S+\s+)*", "", line).split(" ")[0]  # after VAR=value words
            if program not in PROGRAMS or "[" in line:  # output, prose, or a usage synopsis ("[...]")
                continue
            line = re.sub(r"\$\(shardscope configs path (\S+)\)", lambda m: str(find_config(m.group(1)).path), line)
            line = re.sub(r"\$([A-Z_]+)", lambda m: SHELL_VARIABLES[m.group(1)], line)
            argv = shlex.split(line, comments=True)
            yield doc, argv[argv.index(program):]


def synopsis_flags(doc: str):
    """(subcommand, --flags) of each usage synopsis (`shardscope doctor [--gpus N] ... [-- RECIPE ARGS]`)."""
    for block in fenced_blocks(doc, languages=("",)):
        if block.startswith("shardscope ") and "[" in block:
            own = re.split(r"\[?-- ", block)[0]  # what follows a bare `--` is the recipe's
            yield block.split()[1], re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", own)


ALL_COMMANDS = [c for doc in DOCS for c in shell_commands(doc)]


def recipe_parser(script: Path):
    from shardscope.recipes.args import RecipeParser, RecipeTrainingArguments

    sys.path.insert(0, str(script.parent))
    try:
        module = __import__(script.stem)
    finally:
        sys.path.pop(0)
    return RecipeParser(module.ScriptArguments, module.ModelArguments, training_type=RecipeTrainingArguments)


def check_script(script: str, args: list[str], module: bool = False):
    """The script exists; a recipe accepts its arguments (flags and the YAML's keys) as written; a module
    (`-m shardscope preflight`) is importable, and shardscope's own parser takes its arguments."""
    if module:
        assert importlib.util.find_spec(script), script
        if script == "shardscope":
            cli.build_parser().parse_args(args)
        return
    assert (ROOT / script).is_file(), script
    if script.startswith("recipes/"):
        recipe_parser(ROOT / script).parse(args)


def test_docs_show_commands():
    seen = {doc for doc, _ in ALL_COMMANDS}
    assert {"README.md", "docs/planner.md", "docs/compare.md", "docs/cluster.md"} <= seen, seen
    assert sum(argv[0] == "shardscope" for _, argv in ALL_COMMANDS) >= 12


@pytest.mark.parametrize("doc,argv", [c for c in ALL_COMMANDS if c[1][0] != "shardscope"],
                         ids=lambda v: " ".join(v)[:70] if isinstance(v, list) else v)
def test_every_launch_command_in_the_docs_parses(doc, argv):
    """Launcher flags are the launcher's own (accelerate, torchrun), scripts exist, recipe flags parse,
    make targets exist: what a user pastes reaches the training script."""
    if argv[:2] == ["accelerate", "launch"]:
        from accelerate.commands.launch import launch_command_parser

        parsed = launch_command_parser().parse_args(argv[2:])
        check_script(parsed.training_script, parsed.training_script_args, parsed.module)
        if parsed.config_file:
            assert Path(parsed.config_file).is_file(), parsed.config_file
    elif argv[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        parsed = get_args_parser().parse_args(argv[1:])
        check_script(parsed.training_script, parsed.training_script_args, parsed.module)
    elif argv[0] == "deepspeed":
        module = "--module" in argv
        script = argv.index("--module") + 1 if module else next(i for i, a in enumerate(argv) if a.endswith(".py"))
        check_script(argv[script], argv[script + 1:], module)
    elif argv[0] in ("python", "python3"):
        if argv[1] == "-m":
            assert importlib.util.find_spec(argv[2]), argv
        else:
            assert (ROOT / argv[1]).is_file(), argv
    elif argv[0] == "make":
        assert re.search(rf"^{argv[1]}:", (ROOT / "Makefile").read_text(), re.M), argv
    else:  # export VAR=..., pytest ...
        assert argv[0] in ("export", "pytest"), argv


@pytest.mark.parametrize("doc,argv", [c for c in ALL_COMMANDS if c[1][0] == "shardscope"],
                         ids=lambda v: " ".join(v)[:70] if isinstance(v, list) else v)
def test_every_shardscope_command_in_the_docs_runs(doc, argv, capsys):
    """Parsed by shardscope's own parser; run in process unless it launches training; exit 0, or for an
    input that stands for the user's own, exit 2 with one line naming it."""
    args = cli.build_parser().parse_args(argv[1:])  # an unknown flag exits here
    if argv[1] == "compare":  # what it hands on: the recipe's arguments, the launcher's
        from accelerate.commands.launch import launch_command_parser

        check_script(str(args.recipe), args.recipe_args)
        launch_command_parser().parse_args([*shlex.split(args.launcher_args), str(args.recipe)])
    if argv[1] in PARSE_ONLY or any(flag in argv for flag in PARSE_ONLY):
        return
    code = cli.main(argv[1:])
    out, err = capsys.readouterr()
    own = [value for value in USERS_OWN if value in argv]
    if own:
        assert code == 2 and len(err.splitlines()) == 1 and own[0] in err, err
    else:
        assert code == 0, (out, err)
        assert out.strip() and "Traceback" not in err


def inline_commands(doc: str):
    """`shardscope ...` commands written inline in the doc's prose, whole (a subcommand and at least two more
    words, or a word that is no flag after a command that takes none: `plan NAME`; no placeholder such as NAME,
    [...], {a,b} or <x>); a bare flag mentioned (`plan --dry-run`) is not one."""
    text = " ".join((ROOT / doc).read_text().split())
    for command in re.findall(r"`(shardscope [^`]+)`", text):
        argv = shlex.split(command)
        whole = len(argv) >= 4 or (len(argv) == 3 and argv[1] in ("plan", "fit", "doctor") and argv[2][0] != "-")
        if whole and not re.search(r"[\[\]{}<>]|\.\.\.|\b[A-Z][A-Z_]+\b", command):
            yield argv


INLINE = [(doc, argv) for doc in DOCS for argv in inline_commands(doc)]


@pytest.mark.parametrize("doc,argv", INLINE, ids=[" ".join(a)[:70] for _, a in INLINE])
def test_inline_commands_in_the_docs_parse(doc, argv):
    cli.build_parser().parse_args(argv[1:])  # an unknown flag or a stray positional exits here
    if "--model" in argv:  # the model named is one the planner ships, so the command runs offline as written
        assert model_spec(argv[argv.index("--model") + 1]).params_total > 0


def test_usage_synopses_name_real_flags():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    checked = 0
    for doc in DOCS:
        for command, flags in synopsis_flags(doc):
            known = {s for action in subparsers[command]._actions for s in action.option_strings}
            assert set(flags) <= known, (doc, command, set(flags) - known)
            checked += 1
    assert checked >= 2


def named_paths(doc: str) -> set[str]:
    """Repository paths the doc names: link targets and backticked paths under the checkout's folders."""
    text = (ROOT / doc).read_text()
    tops = "|".join(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
    names = set(re.findall(r"\]\(([^)#\s]+)\)", text))
    names |= set(re.findall(rf"`((?:{tops})/[\w./-]+)`", text))
    names |= {a for _, argv in shell_commands(doc) for a in argv if re.match(rf"^(?:{tops})/[\w./-]+$", a)}
    return {n for n in names if not n.startswith(("http", "mailto")) and not n.startswith(OUTPUTS)}


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_the_docs_name_exists(doc):
    base = (ROOT / doc).parent
    missing = [n for n in named_paths(doc) if not (base / n).exists() and not (ROOT / n).exists()]
    assert not missing, missing


def test_configs_list_wraps_without_cutting_a_literal(capsys, monkeypatch):
    from shardscope.configs.catalog import shipped_configs

    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(["configs"]) == 0
    out = capsys.readouterr().out
    assert "fsdp_config='fsdp_configs/llama_full_shard.json')" in out  # whole on one line, copyable
    assert all(len(line) <= 80 or " " not in line.strip() for line in out.splitlines())  # over: one literal
    joined = " ".join(out.split())
    for config in shipped_configs():  # every description whole (tp's is the longest), wrapped, not cut
        assert " ".join(config.description.split()) in joined, config.name


def test_output_cut_short_by_the_reader_is_no_traceback():
    """`shardscope plan ... | head -1`: the closed pipe ends the command quietly (as a SIGPIPE'd tool)."""
    proc = subprocess.Popen([sys.executable, "-m", "shardscope", "plan", "--params", "7e9", "--gpus", "4"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the interpreter has even started: every write of the command meets a closed pipe
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and err == "", err


def test_tiny_assets_print_only_their_paths(tmp_path, capfd):
    from shardscope.recipes.tiny import _main

    _main(["sft", str(tmp_path), "-n", "16"])
    _main(["image", str(tmp_path)])
    out, err = capfd.readouterr()
    assert out.splitlines() == [f"data: {tmp_path}/alpaca.json", f"model: {tmp_path}/tiny-llama",
                                f"data: {tmp_path}/images", f"model: {tmp_path}/tiny-dinov2"]
    assert err.strip() == "", err


def test_recipe_startup_checks_name_the_launcher_not_the_file(monkeypatch):
    """`accelerate launch --mixed_precision no ... --bf16`: the value came from a flag, the yaml may say bf16."""
    from shardscope.doctor.diagnose import startup_checks
    from shardscope.errors import UsageError

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    with pytest.raises(UsageError, match=r"accelerate launch \(--config_file or its flags\): mixed_precision: no "
                                         r"here but bf16 in the recipe arguments"):
        startup_checks({"bf16": True})


def test_plan_says_each_note_once(capsys):
    """A note the table's footnotes (*, **, ~) already say carries the kind "footnoted" and is not printed again."""
    from shardscope.plan.planner import estimate as plan_estimate

    assert cli.main(["plan", "--params", "7e9", "--gpus", "4", "--gpu", "H100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len([l for l in lines if l]) == len({l for l in lines if l})
    notes = plan_estimate(model_spec(None, params=7e9), Setup(gpus_per_node=4))["notes"]
    footnoted = [n for n in notes if n.kind == "footnoted"]
    assert footnoted[:4] == notes[:4] and not set(footnoted) & set(lines)  # the footnotes say them
    assert [n for n in notes if n.kind == "note"] and all(n in lines for n in notes if n.kind == "note")


def test_prefer_states_its_default_in_help():
    help_text = " ".join(dict(help_texts())["shardscope plan --help"].split())
    assert re.search(r"--prefer \{fsdp,deepspeed\} which goes first .*; default fsdp", help_text), help_text


def test_plan_with_checkpointing_prints_only_its_own_output(tiny_llama):
    """The trace turns checkpointing on: no transformers deprecation or use_cache notice on stderr."""
    proc = subprocess.run([sys.executable, "-m", "shardscope", "plan", "--model", str(tiny_llama), "--gpus", "2",
                           "--gpu", "A100-80", "--checkpointing"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "SHARDSCOPE_CACHE": "off"})  # off: the trace must run
    assert proc.returncode == 0 and "checkpointing on" in proc.stdout, proc.stderr
    assert proc.stderr == ""


def test_planner_doc_cases_are_what_plan_prints(capsys):
    """docs/planner.md's table of the published comparison's cases (GB per GPU, 1 decimal) is the planner's."""
    cases = {"Mistral-7B, DDP, 1 GPU": ("ddp", "mistral-7b", "--gpus", "1"),
             "Mistral-7B, FSDP FULL_SHARD, 4 GPUs": ("fsdp_full_shard", "mistral-7b", "--gpus", "4"),
             "Mistral-7B, FSDP FULL_SHARD, 4 GPUs, checkpointing": ("fsdp_full_shard", "mistral-7b", "--gpus", "4",
                                                                   "--checkpointing"),
             "Llama-2-70B, FSDP FULL_SHARD, 32 GPUs (4 nodes), checkpointing": (
                 "fsdp_full_shard", "llama-2-70b", "--gpus", "8", "--nodes", "4", "--checkpointing")}
    rows = [line.split("|")[1:5] for line in (ROOT / "docs/planner.md").read_text().splitlines()
            if line.startswith(("| Mistral-7B, ", "| Llama-2-70B, "))]
    assert [r[0].strip() for r in rows] == list(cases)
    for case, states, total, fits in rows:
        strategy, model, *flags = cases[case.strip()]
        # exit 0 in every case: something fits (on one A100-80, the offload rows; elsewhere sharding)
        assert cli.main(["plan", "--model", model, "--gpu", "A100-80", *flags, "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["recommendation"]["strategy"] is not None
        row = next(r for r in result["rows"] if r["strategy"] == strategy)
        assert (f"{row['model_states_bytes'] / 1e9:.1f}", f"{row['total_bytes'] / 1e9:.1f}",
                ("no", "yes")[row["fits"]]) == (states.strip(), total.strip(), fits.strip()), case


def test_readme_gives_the_callbacks_whole_signature():
    import inspect

    from shardscope import ShardingProfilerCallback

    readme = " ".join((ROOT / "README.md").read_text().split())
    shown = re.search(r"`ShardingProfilerCallback\(([^)]*)\)`", readme).group(1).replace('"', "'")
    params = inspect.signature(ShardingProfilerCallback).parameters.values()
    assert shown == ", ".join(f"{p.name}={p.default!r}" for p in params)


def test_readme_strategy_table_is_the_convention_table():
    """README's 12 vs 16 B/param table (and docs/planner.md's) is `convention_table()` for 7e9 on 4 GPUs, the
    command they name; ZeRO-1 = ZeRO-2 in plan's own rows is the sentence under it, not the table."""
    from shardscope.plan.planner import convention_table

    table = convention_table(7e9, 4)
    for doc in ("README.md", "docs/planner.md"):
        rows = [[c.strip() for c in line.split("|")[2:6]] for line in (ROOT / doc).read_text().splitlines()
                if re.match(r"^\| \**1[26] B/param", line)]
        expected = [[f"{table[basis][k] / 1e9:g} GB" for k in ("none", "zero1", "zero2", "zero3")]
                    for basis in ("rule-of-thumb-12", "planner-16")]
        assert rows == expected, doc
    assert "--params 7e9 --gpus 4 --convention rule-of-thumb-12" in (ROOT / "README.md").read_text()


def test_readme_install_and_demo_paths_are_the_makefiles_and_scripts():
    makefile, readme = (ROOT / "Makefile").read_text(), " ".join((ROOT / "README.md").read_text().split())
    demo = (ROOT / "scripts/demo.sh").read_text()
    torch_pin = re.search(r"pip install [^\n']*?(torch==[\d.]+)\n", makefile).group(1)
    assert f"runs a plain `pip install {torch_pin}`" in readme
    assert "pip install -q --disable-pip-version-check -e '.[deepspeed,peft,recipes,test]'" in makefile
    assert "then `pip install -e '.[deepspeed,peft,recipes,test]'`" in readme
    assert "OUT=demo_out" in demo and '"$OUT/sft.log"' in demo and '--output_dir "$OUT/sft"' in demo
    assert "`demo_out/sft/`" in readme and "the launch log `demo_out/sft.log`" in readme
