"""`shardscope fit` and `fit_training_args` keep an offload candidate only when the host memory holds it."""
from __future__ import annotations

import json

import pytest

from shardscope.cli import main
from shardscope.errors import UsageError
from shardscope.strategy import OFFLOAD
from shardscope.plan.mesh import Setup
from shardscope.model.spec import spec_from_count
from shardscope.plan.planner import estimate
from shardscope.units import gb

L4_70B = ["--params", "70e9", "--gpus", 1, "--gpu", "L4", "--seq-len", 4096, "--global-batch", 8]


def fit(capsys, *argv):
    code = main(["fit", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def host_need(params: float, strategy: str, gpus: int) -> int:
    """The planner's CPU bytes of `strategy` per node (cpu_bytes per GPU x GPUs), micro-batch 1: the oracle."""
    trial = Setup(gpus_per_node=gpus, precision="bf16-mixed", seq_len=4096, micro_batch=1)
    row = next(r for r in estimate(spec_from_count(params), trial)["rows"] if r.strategy == strategy)
    return row.cpu_bytes * gpus


def test_70b_on_one_l4_without_cpu_memory_is_exit_1_one_line_per_reason(capsys):
    code, out, err = fit(capsys, *L4_70B)
    lines = out.strip().split("\n")
    assert code == 1 and "Traceback" not in err
    assert lines[0].startswith("nothing fits in ")
    offload_lines = lines[1:]
    assert offload_lines and all(line.split()[0] in OFFLOAD and "--cpu-memory" in line for line in offload_lines)
    zero3 = next(line for line in offload_lines if line.startswith("zero3_offload"))
    # the states the issue counts (fp32 master weights and Adam moments, 16-bit weights) are 14 B/param alone
    assert f"needs {gb(host_need(70e9, 'zero3_offload', 1))} GB of host memory" in zero3
    assert host_need(70e9, "zero3_offload", 1) >= 14 * 70e9
    as_json = json.loads(fit(capsys, *L4_70B, "--json")[1])
    assert as_json["strategy"] is None and as_json["reasons"] == lines


def test_cpu_memory_below_the_need_is_a_reason_and_above_it_a_winner(capsys):
    need = host_need(70e9, "zero3_offload", 1)
    code, out, _ = fit(capsys, *L4_70B, "--cpu-memory", f"{need // 2}B")
    assert code == 1 and f"more than --cpu-memory {gb(need // 2)} GB" in out
    code, out, _ = fit(capsys, *L4_70B, "--cpu-memory", f"{2 * need}B", "--json")
    assert code == 0 and json.loads(out)["strategy"] in OFFLOAD


def test_offload_is_never_the_winner_without_cpu_memory_and_its_need_is_printed(capsys):
    argv = ["--params", "7e9", "--gpus", 8, "--gpu", "L4", "--seq-len", 2048, "--global-batch", 16]
    code, out, _ = fit(capsys, *argv, "--json")
    result = json.loads(out)
    assert code == 0 and result["strategy"] not in OFFLOAD
    assert all(a["strategy"] not in OFFLOAD for a in result["alternatives"])
    host = result["offload_host_memory"]
    assert set(host) == set(OFFLOAD)  # each fits an L4 but none may win
    for name, h in host.items():
        assert h["cpu_bytes_per_node"] <= host_need(7e9, name, 8)  # the least over its candidates
    text = fit(capsys, *argv)[1]
    assert "offload left out (host memory):" in text and text.count("not a candidate without --cpu-memory") == 3
    code, out, _ = fit(capsys, *argv, "--strategy", "zero2_offload")
    assert code == 1 and out.split("\n")[1].startswith("zero2_offload fits the GPU")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from shardscope.recipes.tiny import make_causal_lm

    path = tmp_path_factory.mktemp("tiny_llama")
    make_causal_lm(path, "llama", num_key_value_heads=4)
    return AutoModelForCausalLM.from_pretrained(path)


def test_fit_training_args_bounds_offload_by_the_available_ram(monkeypatch, tmp_path, tiny_model):
    from transformers import TrainingArguments

    from shardscope import fit_training_args
    from shardscope.fit import training_args as fit_training

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    budget = 10 ** 9
    fitted = fit_training_args(args, tiny_model, global_batch_size=4, memory_budget=budget, seq_len=64)
    assert fitted.shardscope_fit["strategy"] == "fsdp_offload"  # this machine's RAM holds a tiny model
    monkeypatch.setattr(fit_training, "available_host_memory", lambda: 1)
    with pytest.raises(UsageError) as error:
        fit_training_args(args, tiny_model, global_batch_size=4, memory_budget=budget, seq_len=64)
    assert "fsdp_offload fits the GPU" in str(error.value) and "more than this node's available RAM" in str(error.value)
