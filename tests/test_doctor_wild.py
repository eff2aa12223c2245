"""doctor on files shaped like the ones people copy from public repositories (issue 20) and its output
(issue 23): aliases DeepSpeed accepts, agreeing precision, "refuses" vs "ignores", accelerate yaml values
vs Trainer arguments, process counts, multi-node rendezvous, silent offload, one verdict with `configs
check`, shipped names, the checks that ran, the cheapest no-fit fix. Each file is written here."""
from __future__ import annotations

import json

import pytest
import yaml

from shardscope.cli import main
from shardscope.configs.catalog import shipped_configs
from shardscope.doctor.diagnose import Inputs, diagnose, parse_trainer_args
from shardscope.doctor.rules import failing

SHIPPED = {c.path.name: c.path for c in shipped_configs()}


@pytest.fixture(autouse=True)
def empty_hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if name.endswith(".yaml") else json.dumps(data))
    return path


def run(*trainer_args, **inputs):
    trainer = source = None
    if trainer_args:
        trainer, source = parse_trainer_args(list(trainer_args))
    return diagnose(Inputs(trainer=trainer, trainer_source=source or "trainer arguments", **inputs))[0]


def codes(findings):
    return sorted((f.code, f.key) for f in findings)


ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}


# ----------------------------------------------------------------------------- false alarms


@pytest.mark.parametrize("zero, saved", [
    ({"stage": 3, "gather_16bit_weights_on_model_save": True}, True),             # DeepSpeed's field name
    ({"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}, True),      # its alias
    ({"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}, True),       # the deprecated name
    ({"stage": 3}, False),
    ({"stage": 3, "gather_16bit_weights_on_model_save": False}, False)])
def test_zero3_save_reads_every_name_deepspeed_accepts(tmp_path, zero, saved):
    findings = run(deepspeed=write(tmp_path, "ds.json", {**ZERO3, "zero_optimization": zero}))
    assert codes(findings) == ([] if saved else [("zero3-save", "zero_optimization.stage3_gather_16bit_weights_on_model_save")])


def test_accelerate_deepspeed_precision_from_the_deepspeed_file_is_not_flagged(tmp_path):
    ds = write(tmp_path, "ds.json", {**ZERO3, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    acc = write(tmp_path, "acc.yaml", {"distributed_type": "DEEPSPEED", "num_processes": 8,
                                       "deepspeed_config": {"deepspeed_config_file": str(ds)}})
    assert run("--bf16", accelerate_config=acc) == []
    assert run(accelerate_config=acc) == []  # no Trainer arguments: the DeepSpeed file sets it
    # the Trainer's flag disagrees with the DeepSpeed file
    assert ("precision", "mixed_precision") in codes(run("--fp16", accelerate_config=acc))


def test_accelerate_mixed_precision_beside_a_deepspeed_file_is_refused_as_accelerate_refuses_it(tmp_path):
    """accelerate's launcher passes the yaml's DeepSpeed fields, mixed_precision among them, to its DeepSpeed plugin,
    which refuses any beside `deepspeed_config_file` at start-up (seen: `accelerate launch` raises ValueError "When
    using `deepspeed_config_file`, the following accelerate config variables will be ignored"), even where they agree."""
    ds = write(tmp_path, "ds.json", {**ZERO3, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    acc = write(tmp_path, "acc.yaml", {"distributed_type": "DEEPSPEED", "mixed_precision": "bf16", "num_processes": 8,
                                       "deepspeed_config": {"deepspeed_config_file": str(ds)}})
    [finding] = run("--bf16", accelerate_config=acc)
    assert (finding.code, finding.key, finding.level) == ("config", "mixed_precision", "error")
    assert "accelerate rejects it at launch beside deepspeed_config_file" in finding.problem


def test_ignored_and_refused_keys_are_worded_apart(tmp_path):
    ignored = write(tmp_path, "ds.json", {**ZERO3, "zero_optimization": {"stage": 2}, "wall_clock_breakdow": True})
    f, = run(deepspeed=ignored)
    assert (f.code, f.key, f.level) == ("ignored-key", "wall_clock_breakdow", "warning")
    assert "ignores" in f.problem and "refuse" not in f.problem + f.fix
    refused = write(tmp_path, "ds2.json", {**ZERO3, "zero_optimization": {"stage": 2}, "compile": {"disable": True}})
    f, = run(deepspeed=refused)
    assert (f.code, f.key, f.level) == ("config", "compile.disable", "error")  # named with its section
    assert "refuses" in f.problem and "ignore" not in f.problem + f.fix


# ----------------------------------------------------------------------------- missed checks


def test_accelerate_deepspeed_section_vs_trainer_arguments(tmp_path):
    acc = write(tmp_path, "zero2.yaml", {"distributed_type": "DEEPSPEED", "num_processes": 8, "deepspeed_config": {
        "zero_stage": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0}})
    assert run("--gradient_accumulation_steps", "4", accelerate_config=acc) == []
    f, = run("--gradient_accumulation_steps", "8", accelerate_config=acc)
    assert (f.code, f.key, f.level) == ("ds-mismatch", "deepspeed_config.gradient_accumulation_steps", "error")
    assert "gradient_accumulation_steps=8" in f.problem and f.fix.startswith("remove deepspeed_config.gradient_acc")
    assert codes(run("--gradient_accumulation_steps", "4", "--max_grad_norm", "0.3", accelerate_config=acc)) == \
        [("ds-mismatch", "deepspeed_config.gradient_clipping")]


def test_num_processes_against_gpus_and_nodes(tmp_path):
    acc = write(tmp_path, "ddp.yaml", {"distributed_type": "MULTI_GPU", "num_processes": 8})
    f, = run(accelerate_config=acc, gpus=4)
    assert (f.code, f.key) == ("processes", "num_processes") and "--gpus 4" in f.problem and f.fix.endswith(": 4")
    assert run(accelerate_config=acc, gpus=8) == []
    two = write(tmp_path, "two.yaml", {"distributed_type": "MULTI_GPU", "num_processes": 16, "num_machines": 2,
                                       "machine_rank": 0, "main_process_ip": "10.0.0.1", "main_process_port": 29500})
    assert run(accelerate_config=two, gpus=8, nodes=2) == []
    assert codes(run(accelerate_config=two, gpus=4, nodes=2)) == [("processes", "num_processes")]
    odd = write(tmp_path, "odd.yaml", {"distributed_type": "MULTI_GPU", "num_processes": 15, "num_machines": 2,
                                       "main_process_ip": "10.0.0.1", "main_process_port": 29500})
    assert codes(run(accelerate_config=odd)) == [("processes", "num_processes")]


@pytest.mark.parametrize("change, code, key", [
    ({"main_process_ip": "xxx"}, "placeholder", "main_process_ip"),
    ({"main_process_ip": "<MAIN_NODE_IP>"}, "placeholder", "main_process_ip"),
    ({"main_process_ip": ""}, "multinode", "main_process_ip"),
    ({"main_process_ip": "10.0.0.300"}, "multinode", "main_process_ip"),
    ({"main_process_port": 1234}, "placeholder", "main_process_port"),
    ({"main_process_port": "xxx"}, "multinode", "main_process_port"),
    ({"main_process_port": 70000}, "multinode", "main_process_port"),
    ({"machine_rank": 2}, "multinode", "machine_rank"),
    ({"machine_rank": -1}, "multinode", "machine_rank")])
def test_multinode_rendezvous(tmp_path, change, code, key):
    good = {"distributed_type": "MULTI_GPU", "num_processes": 16, "num_machines": 2, "machine_rank": 1,
            "main_process_ip": "10.1.2.3", "main_process_port": 29500, "rdzv_backend": "static"}
    assert run(accelerate_config=write(tmp_path, "good.yaml", good)) == []
    findings = [f for f in run(accelerate_config=write(tmp_path, "bad.yaml", {**good, **change}))
                if f.code != "config"]  # accelerate's own loader may add its message for the same key
    assert codes(findings) == [(code, key)]
    assert failing(findings)  # placeholders and impossible values both fail the check


def test_silent_offload_is_a_notice_that_says_what_it_costs(tmp_path, capsys):
    config = {**ZERO3, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    f, = run(deepspeed=write(tmp_path, "zero2.json", config))
    assert (f.code, f.key, f.level) == ("silent-offload", "zero_optimization.offload_optimizer.device", "notice")
    assert "CPU" in f.problem and "slower" in f.problem
    assert run(deepspeed=write(tmp_path, "zero2_offload.json", config)) == []  # the name says it: asked for
    param = {**ZERO3, "zero_optimization": {"stage": 3, "gather_16bit_weights_on_model_save": True,
                                            "offload_param": {"device": "cpu"}}}
    assert codes(run(deepspeed=write(tmp_path, "zero3.json", param))) == \
        [("silent-offload", "zero_optimization.offload_param.device")]
    acc = write(tmp_path, "zero2.yaml", {"distributed_type": "DEEPSPEED", "num_processes": 8,
                                         "deepspeed_config": {"zero_stage": 2, "offload_optimizer_device": "cpu"}})
    assert codes(run(accelerate_config=acc)) == [("silent-offload", "deepspeed_config.offload_optimizer_device")]
    assert main(["doctor", "--deepspeed", str(tmp_path / "zero2.json")]) == 0  # a notice does not fail
    out = capsys.readouterr().out
    assert "notice [silent-offload]" in out and "1 notice(s) found" in out


# ----------------------------------------------------------------------------- one verdict


def test_configs_check_and_doctor_give_one_verdict(tmp_path, capsys):
    from pathlib import Path

    root = Path(__file__).resolve().parent / "fixtures"
    files = [(p, "deepspeed" if p.suffix == ".json" and "ds" in p.name else
              "fsdp" if p.suffix == ".json" else "accelerate")
             for p in sorted((root / "bad_configs").iterdir()) + sorted((root / "doctor").iterdir())
             if p.suffix in (".json", ".yaml") and p.name != "default_config.yaml"]
    files += [(write(tmp_path, "zero2.json", {**ZERO3, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}}), "deepspeed"),
              (write(tmp_path, "z3.json", {**ZERO3, "zero_optimization": {"stage": 3}}), "deepspeed")]
    files += [(c.path, c.kind) for c in shipped_configs() if c.kind != "slurm"]
    flag = {"accelerate": "--accelerate-config", "deepspeed": "--deepspeed", "fsdp": "--fsdp-config"}
    verdicts = []
    for path, kind in files:
        check = main(["configs", "check", "--kind", kind, str(path)])
        doctor = main(["doctor", flag[kind], str(path)])
        capsys.readouterr()
        verdicts.append((path.name, check == 0, doctor == 0))
    assert [v for v in verdicts if v[1] != v[2]] == []
    assert {v[1] for v in verdicts} == {True, False}  # both verdicts occur


# ----------------------------------------------------------------------------- output (issue 23)


@pytest.mark.parametrize("flag, name", [("--deepspeed", "zero3"), ("--deepspeed", "ds/zero3"),
                                        ("--accelerate-config", "zero3"), ("--fsdp-config", "llama_full_shard"),
                                        ("--fsdp-config", "fsdp/llama_full_shard")])
def test_shipped_names_are_accepted(flag, name, capsys):
    assert main(["doctor", flag, name]) == 0
    assert "no problems found" in capsys.readouterr().out


@pytest.mark.parametrize("flag, name, kind", [("--deepspeed", "ds/zero3", "deepspeed"),
                                              ("--fsdp_config", "llama_full_shard", "fsdp")])
def test_a_shipped_name_in_the_trainer_arguments_names_the_path_to_give(flag, name, kind, capsys):
    """The Trainer reads a path where doctor's own flags take a name too: one line with the path to pass."""
    from shardscope.configs.catalog import resolve_config

    assert main(["doctor", "--", flag, name]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flag} {name}: no such file" in err
    assert f"{flag} {resolve_config(name, kind)} " in err


def test_unknown_or_wrong_kind_name_is_one_line(capsys):
    assert main(["doctor", "--deepspeed", "zero4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "zero4" in err and "ds/zero3" in err
    assert main(["doctor", "--accelerate-config", "ds/zero3"]) == 2
    assert "deepspeed config, not a accelerate" in capsys.readouterr().err.replace("an accelerate", "a accelerate")


def test_clean_run_says_which_checks_ran_and_which_were_skipped(capsys):
    assert main(["doctor", "--deepspeed", "zero3"]) == 0
    out = capsys.readouterr().out
    assert "model checks skipped" in out and "fit check skipped" in out
    assert "no problems found (checked: DeepSpeed file)" in out
    assert main(["doctor", "--accelerate-config", "fsdp_full_shard", "--model", "llama-2-7b", "--gpus", "8",
                 "--gpu", "A100-80", "--", "--bf16", "--gradient_checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "skipped" not in out and "model (llama-2-7b" in out and "fit (8 GPUs" in out


def test_no_fit_proposes_the_cheapest_change_first():
    # 32 GB GPUs, 28.8 GB usable: between what llama-2-7b under zero3 on 8 GPUs needs with each change and
    # without it (planner peak, traced, at 2,048 tokens: fp32 micro-batch 1 42.1 GB, bf16 27.6; bf16 micro-batch 8
    # 119.1, with checkpointing 25.7; fp32 micro-batch 8 with checkpointing 34.7)
    fit = dict(model="llama-2-7b", gpus=8, gpu_memory_bytes=32 * 10 ** 9)
    f, = run("--per_device_train_batch_size", "1", accelerate_config=SHIPPED["zero3.yaml"], **fit)
    assert f.code == "no-fit" and f.fix.startswith("pass --bf16: zero3 then needs")
    f, = run("--bf16", accelerate_config=SHIPPED["zero3.yaml"], **fit)
    assert f.fix.startswith("pass --gradient_checkpointing: zero3 then needs")
    f, = run("--per_device_train_batch_size", "8", accelerate_config=SHIPPED["zero3.yaml"], **fit)  # fp32, micro-batch 8: both flags, bf16 first
    assert f.fix.startswith("pass --bf16 --gradient_checkpointing:")


def test_precision_wording_when_the_arguments_set_no_precision():
    f, = run("--bf16", "false", accelerate_config=SHIPPED["ddp.yaml"])
    assert f.problem.startswith("bf16 here but trainer arguments set neither --bf16 nor --fp16")


def test_docs_list_every_rule_with_its_level():
    from pathlib import Path

    from shardscope.doctor.rules import RULES

    rows = {line.split("|")[1].strip(" `"): line.split("|")[2].strip()
            for line in (Path(__file__).resolve().parents[1] / "docs" / "doctor.md").read_text().splitlines()
            if line.startswith("| `")}
    assert {code: rows.get(code) for code in RULES} == RULES
