"""precision.py on plain tensors and torch optimizers, in process (the launched runs are in
tests/test_precision_runs.py)."""
import pytest
import torch

from shardscope.measure.precision import ForwardProbe, classify, dtype_name, verdict
from shardscope.strategy import PRECISION_ALIASES, configured_precision, trainer_precision


def model_and_optimizer(dtype=torch.float32, master=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(dtype)
    params = [p.detach().float().clone().requires_grad_() for p in model.parameters()] if master \
        else list(model.parameters())
    return model, torch.optim.AdamW(params)


def test_dtype_names_and_unknown_dtype_never_guessed():
    assert [dtype_name(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == ["fp32", "bf16", "fp16"]
    assert dtype_name(torch.float8_e4m3fn) == "unknown: float8_e4m3fn"
    model, optimizer = model_and_optimizer()
    model[0].weight.data = model[0].weight.data.to(torch.float8_e4m3fn)
    facts = classify(model, optimizer)
    assert "unknown: float8_e4m3fn" in facts["dtypes"]["params"]


def test_fp32_params_are_their_own_master():
    model, optimizer = model_and_optimizer()
    facts = classify(model, optimizer)
    assert facts["dtypes"] == {"params": "fp32", "grads": "fp32", "optimizer": "fp32", "master_params": None}
    assert facts["master_params_bytes"] == 0 and facts["compute_dtype"] == "fp32"
    assert verdict("fp32", facts) == {"configured": "fp32", "effective": "fp32", "ok": True, "reason": None}


def test_bf16_weights_stepped_directly_are_pure_and_not_mixed():
    model, optimizer = model_and_optimizer(torch.bfloat16)
    model(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()  # moments now exist, in the parameters' dtype
    facts = classify(model, optimizer)
    assert facts["dtypes"] == {"params": "bf16", "grads": "bf16", "optimizer": "bf16", "master_params": None}
    assert verdict("bf16-pure", facts)["ok"]
    mixed = verdict("bf16-mixed", facts)
    assert mixed["effective"] == "bf16-pure" and not mixed["ok"] and "no fp32 master" in mixed["reason"]


def test_separate_fp32_master_copy_is_counted():
    model, optimizer = model_and_optimizer(torch.bfloat16, master=True)
    facts = classify(model, optimizer)
    numel = sum(p.numel() for p in model.parameters())
    assert facts["dtypes"]["master_params"] == "fp32" and facts["master_params_bytes"] == 4 * numel
    assert verdict("bf16-mixed", facts)["ok"]


def test_autocast_compute_seen_in_the_forward():
    model, optimizer = model_and_optimizer()
    probe = ForwardProbe(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 8))
    probe.remove()
    assert probe.seen == "bf16"
    facts = {**classify(model, optimizer), "compute_dtype": probe.seen}
    assert verdict("bf16-mixed", facts)["ok"]
    # fp16 asked, but nothing cast the forward: plain fp32 training
    plain = verdict("fp16-mixed", classify(model, optimizer))
    assert plain["effective"] == "fp32" and not plain["ok"] and "fp32" in plain["reason"]


def test_installed_autocast_wrapper_and_zero3_built_fp32():
    model, optimizer = model_and_optimizer()
    model._original_forward = model.forward  # what accelerate leaves when it wraps the forward in autocast
    assert classify(model, optimizer, autocast="bf16")["compute_dtype"] == "bf16"
    assert classify(model, optimizer, autocast=None)["compute_dtype"] == "fp32"
    built = verdict("fp32", classify(torch.nn.Linear(2, 2), None), strategy="zero3", loaded_dtype="bf16")
    assert not built["ok"] and "--bf16" in built["reason"]
    assert verdict("fp32", classify(torch.nn.Linear(2, 2), None), strategy="ddp", loaded_dtype="bf16")["ok"]


@pytest.mark.parametrize("bf16, fp16, short, name", [(True, False, "bf16", "bf16-mixed"),
                                                     (False, True, "fp16", "fp16-mixed"), (False, False, "fp32", "fp32")])
def test_configured_precision(bf16, fp16, short, name):
    """The Trainer's flags mapped once: the summary's name (the callback's), the planner's, and back from the summary
    (report/, plan --against)."""
    assert trainer_precision(bf16, fp16) == short and configured_precision(bf16, fp16) == name
    assert PRECISION_ALIASES[short] == name
