"""QLoRA's quantised base (plan/quantized.py, `plan --quantize`): the planner's bytes per quantised weight, with its
quantisation state, held to the byte against a model bitsandbytes quantised on CPU here, and the callback's count of
the same model (measure/state_bytes.py)."""
import json

import pytest

from shardscope.cli import main

import bitsandbytes as bnb  # `make install` puts it in the venv's qlora/ (tests/launch.py); users: shardscope[qlora]
import torch
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

from shardscope.measure.state_bytes import count_state
from shardscope.plan.quantized import quantized_base
from shardscope.recipes.tiny import make_causal_lm

CASES = {  # name: (BitsAndBytesConfig arguments, bits, double quantisation, storage bytes)
    "nf4 double-quant bf16-storage": (dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                           bnb_4bit_quant_storage=torch.bfloat16), 4, True, 2),
    "fp4": (dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"), 4, False, 1),
    "int8": (dict(load_in_8bit=True), 8, False, 1),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    make_causal_lm(folder, intermediate_size=160)  # 160 x 64: a weight that does not fill its last 4-bit block
    return str(folder)


def independent_count(model) -> int:
    """Every parameter and quantisation-state tensor's storage, once (written apart from measure/state_bytes.py)."""
    seen, total = set(), 0
    for param in model.parameters():
        state = getattr(param, "quant_state", None)
        tensors = [param, getattr(param, "SCB", None)]
        if state is not None:
            tensors += [state.absmax, state.code, state.offset]
            tensors += [state.state2.absmax, state.state2.code] if state.state2 is not None else []
        for t in tensors:
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("case", CASES)
def test_planned_quantised_bytes_equal_a_model_quantised_on_cpu(tiny, case):
    arguments, bits, double_quant, storage = CASES[case]
    model = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=BitsAndBytesConfig(**arguments),
                                                 device_map="cpu", dtype=torch.bfloat16)
    planned = quantized_base(AutoConfig.from_pretrained(tiny), bits, double_quant, dtype_bytes=2,
                             storage_bytes=storage)
    held = independent_count(model)
    assert planned.total_bytes == held
    assert count_state(model).total("params") == held  # the callback's count of the rank's weights
    assert planned.state_bytes > 0 and planned.kept_modules == (
        "embed_tokens", "input_layernorm", "lm_head", "norm", "post_attention_layernorm")
    quantized = sum(p.numel() for m in model.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))
                    for p in [m.weight])
    assert planned.quantized_params == quantized * (2 * storage if bits == 4 else 1)  # two 4-bit values a byte


def test_the_cpu_backend_trains_a_4bit_layer():
    """bitsandbytes 0.50's CPU backend runs a 4-bit layer's forward and backward (what QLoRA's adapters need)."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 32, bias=False)
    layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                              compress_statistics=True, quant_storage=torch.bfloat16)
    layer.load_state_dict(dense.state_dict())
    layer = layer.to("cpu")
    x = torch.randn(4, 64, requires_grad=True)
    out = layer(x.to(torch.bfloat16))
    out.float().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert (out.float() - dense(x)).abs().mean() < 0.1 * dense(x).abs().mean()  # NF4's rounding, not noise


def test_plan_quantize_needs_lora_and_prints_the_quantised_base(capsys):
    assert main(["plan", "--model", "llama-3.1-70b", "--quantize", "4bit"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--lora-rank" in err
    args = ["plan", "--model", "llama-3.1-70b", "--lora-rank", "16", "--gpus", "2", "--gpu", "H100", "--checkpointing"]
    assert main([*args, "--quantize", "4bit"]) == 0  # QLoRA: a 70B fits 2 x 80 GB
    out = capsys.readouterr().out
    assert "quantised base (bitsandbytes 4-bit, double quantisation):" in out
    assert "left in bf16: embed_tokens, input_layernorm, lm_head, norm, post_attention_layernorm" in out
    main([*args, "--json"])
    plain = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    main([*args, "--quantize", "4bit", "--json"])
    quantized = json.loads(capsys.readouterr().out)
    rows = {r["strategy"]: r for r in quantized["rows"]}
    assert not {"tp", "fsdp_offload", "zero3_offload"} & set(rows)
    total, state = quantized["quantized"]["total_bytes"], quantized["quantized"]["state_bytes"]
    base = quantized["model"]["params_total"] - quantized["model"]["trainable_params"]
    for name, shards, param_bytes in (("ddp", 1, 4), ("fsdp_full_shard", 2, 4), ("zero3", 2, 2)):
        change = rows[name]["params_bytes"] - plain[name]["params_bytes"]  # the state whole on every rank
        assert change == -(-(total - state) // shards) + state - -(-base // shards) * param_bytes, name
