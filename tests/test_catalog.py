"""The shipped model catalog (plugin/shardscope/model_configs) and the spec cache (shardscope.model.cache).

Counts are the planner's own (built on the meta device from the shipped config.json) held against the figure
each model's publisher states: its model card, or the hub page's safetensors count where the card gives only
the rounded name (Llama-2-70B's card says 70B; its weights hold 69.0B).
"""
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from shardscope.cli import main
from shardscope.plan.mesh import Setup
from shardscope.model.spec import (MODEL_CONFIGS_DIR, ModelSpec, load_model_config, meta_model, model_spec,
                                   routed_experts, shipped_models, spec_from_config)
from shardscope.plan.planner import estimate, moe_note

ROOT = Path(__file__).resolve().parents[1]

# Published counts, in parameters. Cards and hub pages round to 2-3 significant figures (Qwen2.5-0.5B "0.49B",
# Qwen2.5-32B "32.5B" for 32.76B), so the planner's exact count must be within this of the figure:
PUBLISHED_TOLERANCE = 0.01
PUBLISHED = {
    "llama-2-7b": 6.74e9, "llama-2-13b": 13.0e9, "llama-2-70b": 69.0e9,        # hub pages (safetensors)
    "llama-3-8b": 8.03e9, "llama-3-70b": 70.6e9,                               # hub pages
    "llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.6e9, "llama-3.1-405b": 405e9,  # hub pages; 405B: the card
    "llama-3.2-1b": 1.24e9,                                                    # hub page (safetensors: 1.24B)
    "mistral-7b": 7.24e9,                                                      # hub page (Mistral: "7.3B")
    "mixtral-8x7b": 46.7e9,                                                    # Mistral's announcement: 46.7B total
    "qwen2.5-0.5b": 0.49e9, "qwen2.5-1.5b": 1.54e9, "qwen2.5-3b": 3.09e9,     # Qwen2.5 model cards
    "qwen2.5-7b": 7.61e9, "qwen2.5-14b": 14.7e9, "qwen2.5-32b": 32.5e9, "qwen2.5-72b": 72.7e9,
    "gemma-2-2b": 2.61e9, "gemma-2-9b": 9.24e9, "gemma-2-27b": 27.2e9,       # hub pages
    "phi-3-mini": 3.8e9,                                                       # Phi-3 card: "3.8B parameters"
    "dinov2-small": 22.1e6, "dinov2-base": 86.6e6, "dinov2-large": 304e6,     # hub pages (the paper: 21M, 86M,
    "dinov2-giant": 1.14e9,                                                    # 300M, 1.1B, without pos. embeddings)
    "qwen3-0.6b": 0.6e9, "qwen3-4b": 4.0e9, "qwen3-8b": 8.2e9,                # Qwen3 model cards
    "qwen3-14b": 14.8e9, "qwen3-32b": 32.8e9, "qwen3-30b-a3b": 30.5e9, "qwen3-235b-a22b": 235e9,
    "llama-3.2-3b": 3.21e9, "llama-3.3-70b": 70.6e9,                           # hub pages (safetensors)
    # Gemma 3: 1B is text-only (Gemma3ForCausalLM); 4B/12B/27B are counted as published, with the SigLIP vision
    # tower (Gemma3ForConditionalGeneration, what AutoModelForCausalLM builds for them): hub pages
    "gemma-3-1b": 1.0e9, "gemma-3-4b": 4.30e9, "gemma-3-12b": 12.2e9, "gemma-3-27b": 27.4e9,
    "gpt-oss-20b": 20.91e9, "gpt-oss-120b": 116.83e9,                          # OpenAI's gpt-oss model card
    "phi-4": 14.7e9, "smollm3-3b": 3.08e9, "mistral-small-24b": 23.6e9,        # hub pages
}
# Figures a card gives to two significant figures only, which it may round or truncate (Qwen3-30B-A3B's
# 3,353,032,704 active are printed "3.3B"): the count must lie within one unit of the last digit given.
TWO_FIGURES = {"qwen3-1.7b": 1.7e9}                                            # Qwen3-1.7B card: "1.7B"
# Active parameters per token as each publisher counts them: Mistral and Qwen with the input embedding
# (`params_active`), OpenAI without it (`active_without_input_embedding`; gpt-oss card: 3.61B and 5.13B).
ACTIVE_WITH_EMBEDDING = {"mixtral-8x7b": 12.9e9,  # Mistral's announcement: "only uses 12.9B parameters per token"
                         "qwen3-30b-a3b": 3.3e9, "qwen3-235b-a22b": 22e9}
ACTIVE_WITHOUT_EMBEDDING = {"gpt-oss-20b": 3.61e9, "gpt-oss-120b": 5.13e9}


def published_within(count: int, figure: float, two_figures: bool = False) -> bool:
    """Within PUBLISHED_TOLERANCE of the figure, or within one unit of its last digit for a two-figure one."""
    if two_figures:
        return abs(count - figure) < 10 ** (math.floor(math.log10(figure)) - 1)
    return abs(count / figure - 1) < PUBLISHED_TOLERANCE


@pytest.fixture(scope="module")
def catalog():
    return {name: model_spec(name) for name in shipped_models()}


def test_every_shipped_model_has_its_published_parameter_count(catalog):
    assert set(catalog) == set(PUBLISHED) | set(TWO_FIGURES)  # a new config comes with its published figure
    for name, spec in catalog.items():
        assert spec.exact and spec.params_total > 0
        figure = PUBLISHED.get(name) or TWO_FIGURES[name]
        assert published_within(spec.params_total, figure, name in TWO_FIGURES), (name, spec.params_total)


def test_moe_active_parameters_match_each_publishers_convention(catalog):
    for name, figure in ACTIVE_WITH_EMBEDDING.items():
        assert published_within(catalog[name].params_active, figure, name.startswith("qwen3")), name
    for name, figure in ACTIVE_WITHOUT_EMBEDDING.items():
        spec = catalog[name]
        assert published_within(spec.active_without_input_embedding, figure), name
        assert spec.params_active - spec.active_without_input_embedding == spec.vocab_size * spec.hidden_size
    moe = {name for name, spec in catalog.items() if spec.num_experts}
    assert moe == set(ACTIVE_WITH_EMBEDDING) | set(ACTIVE_WITHOUT_EMBEDDING)


def test_gpt_oss_tp_plan_splits_no_expert_and_the_plan_says_so(catalog):
    spec = catalog["gpt-oss-20b"]
    assert spec.tp_whole_expert_params == routed_experts(meta_model(load_model_config("gpt-oss-20b")))[0]
    assert catalog["qwen3-30b-a3b"].tp_whole_expert_params == 0  # transformers 5.24 splits Qwen3-MoE's experts
    notes = estimate(spec, Setup(gpus_per_node=8, gpu_memory_bytes=80 * 2 ** 30))["notes"]
    assert any(n.startswith("tp rows: transformers' tensor-parallel plan for this model splits none") for n in notes)
    assert any(n.startswith("weights published in mxfp4") for n in notes)
    assert not any(n.startswith("tp rows") for n in estimate(catalog["qwen3-30b-a3b"], Setup(gpus_per_node=8))["notes"])


def test_shipped_configs_name_their_hub_model_and_load_without_remote_code():
    for name in shipped_models():
        raw = json.loads((MODEL_CONFIGS_DIR / name / "config.json").read_text())
        assert "/" in raw["_name_or_path"] and "auto_map" not in raw, name
        assert load_model_config(name).model_type == raw["model_type"]


def test_mixtral_counts_every_expert_and_the_active_share_by_hand(catalog):
    spec = catalog["mixtral-8x7b"]
    h, i, kv, layers, vocab, experts, k = 4096, 14336, 1024, 32, 32000, 8, 2
    expert = 3 * h * i  # gate, up and down projections of one expert
    layer = 2 * h * h + 2 * h * kv + experts * h + experts * expert + 2 * h  # q, o; k, v; router; experts; 2 norms
    assert spec.params_total == 2 * vocab * h + layers * layer + h
    assert spec.params_active == spec.params_total - layers * (experts - k) * expert
    assert (spec.num_experts, spec.experts_per_token) == (8, 2)
    dense = catalog["mistral-7b"]
    assert (dense.num_experts, dense.params_active) == (0, 0)


def test_moe_plan_says_total_vs_active_and_what_zero3_needs(catalog, capfd, caplog, monkeypatch):
    result = estimate(catalog["mixtral-8x7b"], Setup(gpus_per_node=8, gpu_memory_bytes=80 * 2 ** 30))
    assert result["model"]["params_active"] == catalog["mixtral-8x7b"].params_active
    note = next(n for n in result["notes"] if n.startswith("mixture of experts"))
    # transformers 5 fuses a layer's experts into one module (MixtralExperts): nothing to mark for ZeRO-3
    assert "all 8 experts" in note and "no leaf-module setting is needed" in note
    assert "params_active" not in estimate(catalog["mistral-7b"], Setup())["model"]
    capfd.readouterr()
    monkeypatch.setenv("SHARDSCOPE_CACHE", "off")  # the trace runs here, not read from an earlier test's cache
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--gpu", "H100"]) == 0
    out, err = capfd.readouterr()
    assert "12,879,925,248 active per token with the input embedding, 12,748,853,248 without (2 of 8 experts" in out
    # the fused experts' grouped matmul has no fake kernel at fp32 under autocast: transformers' own fallback
    # stands in there (plan/trace.py), so the model is traced, and nothing reaches the terminal's stderr
    assert "could not be traced" not in out and "traced from the model's code" in out and err == ""
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]


def test_per_expert_modules_get_the_zero3_leaf_advice():
    import torch

    class Block(torch.nn.Module):  # the shape of an MoE block with one module per expert (remote-code models)
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(4, 3, bias=False)
            self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4, bias=False) for _ in range(3))

    model = torch.nn.Sequential(Block(), Block())
    assert routed_experts(model) == (2 * 3 * 16, "Block")
    spec = replace(model_spec(params=1e9), num_experts=3, experts_per_token=1, params_active=10,
                   zero3_leaf_module="Block")
    assert "deepspeed_moe_layer_cls_names: Block" in moe_note(spec)


def test_list_models_prints_every_name_with_its_count(catalog, capsys):
    assert main(["plan", "--list-models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, spec in catalog.items():
        line = next(line for line in lines if line.startswith(name + " "))
        assert f"{spec.params_total:,}" in line
    assert "12.9B active per token with the input embedding, 12.7B without; 2 of 8 experts" in next(line for line in lines if line.startswith("mixtral"))
    assert main(["plan", "--list-models", "--json"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert {n: m["params_total"] for n, m in listed.items()} == {n: s.params_total for n, s in catalog.items()}
    assert listed["llama-3-8b"]["hub_id"] == "meta-llama/Meta-Llama-3-8B"


@pytest.mark.parametrize("typed, close", [("llama-3-7b", "llama-3-8b"), ("qwen-7b", "qwen2.5-7b"),
                                          ("Mixtral-8x7", "mixtral-8x7b"), ("gemma2-9b", "gemma-2-9b")])
def test_unknown_name_is_one_line_with_the_close_shipped_names(typed, close, capsys):
    assert main(["plan", "--model", typed]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"'{typed}'" in err
    assert close in err.split("close shipped names: ")[1]


def test_bare_names_resolve_case_insensitively(catalog):
    assert model_spec("Qwen2.5-7B").params_total == catalog["qwen2.5-7b"].params_total


# ----------------------------------------------------------------------------- the spec cache


def _plan_json(args, capsys):
    assert main(["plan", *args, "--json"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("args", [["--model", "llama-2-7b", "--gpus", "8", "--gpu", "H100"],
                                  ["--model", "mixtral-8x7b", "--gpus", "4", "--nodes", "2", "--gpu", "A100-40",
                                   "--checkpointing", "--lora-rank", "16"],
                                  ["--model", "qwen2.5-0.5b", "--precision", "fp16-mixed", "--tp", "2", "--gpus", "2"],
                                  ["--model", "dinov2-large", "--gpus", "2", "--gpu", "L4"]])
def test_cached_plan_is_byte_identical_to_a_counted_one(args, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARDSCOPE_CACHE", "off")
    counted = _plan_json(args, capsys)
    monkeypatch.setenv("SHARDSCOPE_CACHE", str(tmp_path))
    first, second = _plan_json(args, capsys), _plan_json(args, capsys)
    assert len(list(tmp_path.glob("*.json"))) == 2  # the spec and the step traces
    assert counted == first == second


def test_traces_are_cached_per_step_shape_not_per_gpu_count(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARDSCOPE_CACHE", str(tmp_path))
    _plan_json(["--model", "qwen2.5-0.5b", "--gpus", "2"], capsys)
    _plan_json(["--model", "qwen2.5-0.5b", "--gpus", "8", "--gpu", "H100", "--prefer", "deepspeed"], capsys)
    assert len(list(tmp_path.glob("*.json"))) == 2  # same step: the GPUs only change the formulas
    traced = _plan_json(["--model", "qwen2.5-0.5b", "--seq-len", "512"], capsys)
    assert len(list(tmp_path.glob("*.json"))) == 3  # another step shape: traced again
    for entry in tmp_path.glob("*.json"):  # JSON of the right outline, wrong inside: counted and traced again
        entry.write_text('{"traces": {"pure": {"moments": 1}}, "note": null}')
    assert _plan_json(["--model", "qwen2.5-0.5b", "--seq-len", "512"], capsys) == traced


def test_a_warm_plan_imports_neither_torch_nor_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDSCOPE_CACHE", str(tmp_path))
    assert main(["plan", "--model", "llama-2-7b"]) == 0  # counted and traced here: the cache now holds both
    code = ("import sys; from shardscope.cli import main; code = main(['plan', '--model', 'llama-2-7b']); "
            "print(code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "plugin")}).stdout
    assert out.splitlines()[-1] == "0 []"


def test_an_edited_config_is_counted_again_not_served_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDSCOPE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    raw = json.loads((MODEL_CONFIGS_DIR / "llama-2-7b" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw))
    before = model_spec(str(folder))
    (folder / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 16}))
    after = model_spec(str(folder))
    assert after.num_layers == 16 and after.params_total < before.params_total
    assert after == spec_from_config(load_model_config(str(folder)), name=str(folder))
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2


@pytest.mark.parametrize("damage", ["truncated", "foreign", "folder"])
def test_an_unusable_cache_is_a_miss_never_an_error(damage, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SHARDSCOPE_CACHE", str(cache))
    counted = model_spec("qwen2.5-0.5b")
    (entry,) = cache.glob("*.json")
    if damage == "truncated":
        entry.write_text(entry.read_text()[:100])
    elif damage == "foreign":
        entry.write_text(json.dumps({"params_total": 1}))
    else:  # the cache folder is a file: nothing can be written, the plan still comes
        entry.unlink()
        cache.rmdir()
        cache.write_text("not a folder")
    assert model_spec("qwen2.5-0.5b") == counted
    if damage != "folder":
        assert json.loads(entry.read_text())["params_total"] == counted.params_total  # rewritten whole
    assert isinstance(counted, ModelSpec)


@pytest.mark.parametrize("model, found", [("gpt-oss-20b", ["tp-experts"]), ("qwen3-30b-a3b", [])])
def test_doctor_says_when_tp_splits_no_expert(model, found, tmp_path, monkeypatch):
    from shardscope.doctor.diagnose import Inputs, diagnose

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    findings, _ = diagnose(Inputs(accelerate_config=ROOT / "accelerate_configs" / "tp.yaml", model=model),
                           validate=False, environment=False)
    assert [f.code for f in findings if f.code == "tp-experts"] == found
    assert all(f.level == "notice" for f in findings if f.code == "tp-experts")
