"""Long-sequence splits without a launch: the one validity rule (plan/sequence.py) as the recipe, doctor, plan and fit
apply it, the planner's cp/sp rows and their communication terms, plan --sp/--cp/--max-seq-len, fit's split search,
and what the callback reads of a split. The sp run itself trains in tests/test_sequence_parallel.py; torch's
context parallelism cannot run on CPU (benchmarks/context_parallel_gpu.sh runs it on a GPU machine)."""
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardscope.cli import main
from shardscope.doctor.sequence import check_sequence_split
from shardscope.errors import UsageError
from shardscope.fit.search import search
from shardscope.measure.throughput import sequence_share, split_degrees
from shardscope.model.spec import spec_from_count
from shardscope.plan.formulas import strategy_row
from shardscope.plan.mesh import Setup
from shardscope.plan.planner import fits
from shardscope.plan.sequence import comm_terms, max_seq_len, split_facts, split_problems, split_row, unit
from shardscope.plan.calibration.figures import hardware
from shardscope.recipes.sequence import sequence_split
from shardscope.strategy import STRATEGIES
from shardscope.strategy import sequence_split as run_split

ROOT = Path(__file__).resolve().parents[1]
BAD = ROOT / "tests" / "fixtures" / "bad_configs"
SPEC = spec_from_count(8e9, hidden=4096, heads=32)  # Llama-shaped: 32 heads, 32 KV heads, 32 layers
H100 = 80 * 2 ** 30


def settings(problems):
    return [p.setting for p in problems]


# ----------------------------------------------------------------------------- the one rule
@pytest.mark.parametrize("kind, degree, kw, setting, text", [
    ("sp", 3, dict(heads=32, kv_heads=8), "sp_size", "does not divide num_attention_heads 32"),
    ("sp", 16, dict(heads=32, kv_heads=8), None, None),  # 8 KV heads copied to 16: Ulysses allows it
    ("sp", 4, dict(heads=32, kv_heads=6), "sp_size", "num_key_value_heads 6 do not divide one another"),
    ("sp", 4, dict(world=6), "sp_size", "does not divide the 6 processes"),
    ("cp", 2, dict(world=8, tp=8), "cp_size", "cp_size 2 x tp_size 8 = 16 does not divide the 8 processes"),
    ("cp", 4, dict(seq_len=32772), "max_seq_length", "not a multiple of 8"),  # load-balanced: 2 x cp chunks
    ("sp", 4, dict(seq_len=32772), None, None),
    ("sp", 4, dict(seq_len=32770), "max_seq_length", "not a multiple of 4"),
    ("cp", 4, dict(strategy="zero3"), "cp_size", "runs only under FSDP2, not zero3"),
    ("cp", 4, dict(strategy="ddp"), "cp_size", "runs only under FSDP2, not ddp"),
    ("cp", 4, dict(strategy="fsdp1"), "cp_size", "runs only under FSDP2, not fsdp1"),
    ("sp", 4, dict(strategy="fsdp2"), "sp_size", "runs only under DeepSpeed ZeRO, not fsdp2"),
    ("cp", 4, dict(attention="flash_attention_2"), "attn_implementation", "cannot be split"),
    ("sp", 4, dict(attention="eager"), "attn_implementation", "cannot be split"),
    ("sp", 4, dict(seq_len=262144, max_positions=131072), "max_seq_length", "longer than the model's"),
])
def test_split_problems_name_the_setting_and_the_fix(kind, degree, kw, setting, text):
    problems = split_problems(kind, degree, **kw)
    if setting is None:
        assert problems == []
        return
    assert settings(problems) == [setting] and text in problems[0].problem and problems[0].fix
    assert str(problems[0]) == f"{problems[0].problem}; {problems[0].fix}"


# ----------------------------------------------------------------------------- recipe: before any process group
def llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**{"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
                          "max_position_embeddings": 131072, **kw})


SP_ENV = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "WORLD_SIZE": "8",
          "PARALLELISM_CONFIG_SP_SIZE": "4", "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed"}
CP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "WORLD_SIZE": "8", "PARALLELISM_CONFIG_CP_SIZE": "4"}


@pytest.mark.parametrize("env, seq, attention, text", [
    (SP_ENV, 32768, None, None),
    (CP_ENV, 32768, None, None),
    ({**SP_ENV, "PARALLELISM_CONFIG_SP_SIZE": "3"}, 32769, None, "does not divide num_attention_heads 32"),
    ({**SP_ENV, "WORLD_SIZE": "6"}, 32768, None, "does not divide the 6 processes"),
    (SP_ENV, 32766, None, "not a multiple of 4"),
    (SP_ENV, 262144, None, "longer than the model's max_position_embeddings 131072"),
    ({**SP_ENV, "ACCELERATE_USE_DEEPSPEED": "false", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, 32768,
     None, "runs only under DeepSpeed ZeRO, not fsdp2"),
    ({**CP_ENV, "ACCELERATE_USE_FSDP": "false"}, 32768, None, "runs only under FSDP2, not ddp"),
    ({**CP_ENV, "ACCELERATE_USE_FSDP": "false", "ACCELERATE_USE_DEEPSPEED": "true"}, 32768, None,
     "runs only under FSDP2, not zero3"),
    (CP_ENV, 32768, "eager", "attn_implementation 'eager' cannot be split"),
    (SP_ENV, 32768, "flash_attention_2", "disagrees with the launcher config's parallelism_config_sp_attn"),
    ({**SP_ENV, "PARALLELISM_CONFIG_CP_SIZE": "2"}, 32768, None, "sets both cp_size and sp_size"),
])
def test_recipe_refuses_a_split_that_cannot_run(env, seq, attention, text):
    if text is None:
        split = sequence_split(llama_config(), "llama", seq, attention, env=env)
        assert split == {"kind": "sp" if "PARALLELISM_CONFIG_SP_SIZE" in env else "cp", "degree": 4,
                         "attention": "sdpa"}
        return
    with pytest.raises(UsageError, match=text):
        sequence_split(llama_config(), "llama", seq, attention, env=env)


def test_recipe_exits_2_with_one_line_before_any_process_group(sft_assets, monkeypatch, capfd):
    """The SFT recipe run as __main__ under a sequence-parallel launch whose degree does not divide the tiny
    Llama's 4 heads: one line, exit 2, and no process group was ever started."""
    import runpy
    import sys

    import torch.distributed as dist

    for key, value in {**SP_ENV, "PARALLELISM_CONFIG_SP_SIZE": "3", "WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", ["causal_lm_sft.py", "--model_name_or_path", str(sft_assets["model"]),
                                      "--dataset", str(sft_assets["data"]), "--max_seq_length", "96",
                                      "--output_dir", "/tmp/never_written"])
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "recipes/causal_lm_sft.py"), run_name="__main__")
    err = capfd.readouterr().err
    assert exit_.value.code == 2 and not dist.is_initialized()
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "sp_size 3 does not divide num_attention_heads 4" in lines[0], err


# ----------------------------------------------------------------------------- doctor
def test_doctor_rules_one_line_each_with_the_fix():
    import yaml

    def found(name, trainer=None, config=None, world=8, source="recipe.yaml"):
        acc = yaml.safe_load((BAD / name).read_text()) if isinstance(name, str) else name
        return [(f.code, f.file, f.key, f.problem, f.fix)
                for f in check_sequence_split("acc.yaml", acc, trainer, source, config, world)]

    assert found("cp_under_deepspeed.yaml") == [("sequence-split", "acc.yaml", "parallelism_config."
                                                 "parallelism_config_cp_size", "cp_size 4: context parallelism "
                                                 "(cp_size, torch) runs only under FSDP2, not zero3",
                                                 "launch with accelerate_configs/fsdp_cp.yaml, or use sp_size under "
                                                 "DeepSpeed")]
    assert [f[0] for f in found("sp_under_fsdp.yaml")] == ["sequence-split"]
    no_backend = yaml.safe_load((BAD / "sp_not_dividing.yaml").read_text())
    del no_backend["parallelism_config"]["parallelism_config_sp_backend"]
    assert [f[0] for f in found(no_backend)] == ["sp-backend", "sequence-split"]
    assert "does not divide the 8 processes" in found("sp_not_dividing.yaml")[-1][3]
    shipped = yaml.safe_load((ROOT / "accelerate_configs/zero3_sp.yaml").read_text())
    assert found(shipped, {"max_seq_length": 32768}, llama_config()) == []  # the shipped config is clean
    six = llama_config(hidden_size=4104, num_attention_heads=6, num_key_value_heads=6)
    heads = found(shipped, {"max_seq_length": 32768}, six)
    assert [(f[2], f[0]) for f in heads] == [("parallelism_config.parallelism_config_sp_size", "sequence-split")]
    trainer = {"max_seq_length": 200002, "attn_implementation": "eager"}
    assert [(f[1], f[2]) for f in found(shipped, trainer, llama_config())] == [
        ("recipe.yaml", "attn_implementation"), ("recipe.yaml", "max_seq_length"), ("recipe.yaml", "max_seq_length")]
    fixed = {**shipped, "parallelism_config": {**shipped["parallelism_config"], "parallelism_config_sp_seq_length":
                                               8192, "parallelism_config_sp_seq_length_is_variable": False}}
    assert [f[0] for f in found(fixed, {"max_seq_length": 32768})] == ["sequence-data"]
    cp = yaml.safe_load((ROOT / "accelerate_configs/fsdp_cp.yaml").read_text())
    assert found(cp, {"max_seq_length": 32768, "attn_implementation": "sdpa"}, llama_config()) == []
    assert found({"distributed_type": "FSDP"}) == []  # no split: nothing to say


def test_doctor_cli_exit_1_one_finding_per_mistake(capsys):
    code = main(["doctor", "--accelerate-config", str(BAD / "cp_under_deepspeed.yaml")])
    out = capsys.readouterr().out
    assert code == 1 and out.count("[sequence-split]") == 1
    assert "fix: launch with accelerate_configs/fsdp_cp.yaml" in out


# ----------------------------------------------------------------------------- planner rows and terms
def test_comm_terms_by_hand():
    """Llama-shaped 8B, 32 layers, head dim 128, 32 heads (no GQA here), bf16, micro-batch 1, 32k tokens."""
    setup = Setup(gpus_per_node=8, seq_len=32768, precision="bf16-mixed")
    L, s, d, a, k, e = 32, 32768, 128, 32, 32, 2
    sp = comm_terms(SPEC, setup, "sp", 4)
    assert sp == {"sp_all_to_all": int(2 * L * (s // 4) * d * (2 * a + 2 * k) * e * 3 / 4)}
    assert comm_terms(SPEC, replace(setup, activation_checkpointing=True), "sp", 4)["sp_all_to_all"] == \
        int(3 * L * (s // 4) * d * (2 * a + 2 * k) * e * 3 / 4)  # the recomputed forward's four again
    # ring attention: K/V gathered in forward and again in backward, K/V gradients (fp32) around the whole ring
    assert comm_terms(SPEC, setup, "cp", 4) == {"cp_ring": int(L * 2 * s * k * d * (2 * e * 3 / 4 + 4))}
    assert comm_terms(SPEC, replace(setup, grad_accum_steps=2), "cp", 4)["cp_ring"] == 2 * comm_terms(
        SPEC, setup, "cp", 4)["cp_ring"]
    assert comm_terms(SPEC, setup, "sp", 1) == {}
    facts = split_facts(SPEC, setup, "sp", 4)
    assert facts["overlapped"] == {"sp_all_to_all": False}
    assert (facts["attention_tokens_per_rank"], facts["attention_heads_per_rank"]) == (32768, 8)
    assert facts["logits_bytes"] == 3 * 8192 * SPEC.vocab_size * 4
    assert facts["logits_tiled_bytes"] == 3 * 4096 * SPEC.vocab_size * 4  # tiles of hidden-size tokens


def test_split_row_divides_activations_not_model_states():
    setup = Setup(gpus_per_node=8, seq_len=32768, gpu_memory_bytes=H100)
    whole = strategy_row("zero3", SPEC, setup)
    for kind, strategy in (("sp", "zero3"), ("cp", "fsdp_full_shard")):
        row = split_row(strategy, SPEC, setup, kind, 4)
        plain = strategy_row(strategy, SPEC, setup)
        local = strategy_row(strategy, SPEC, replace(setup, seq_len=8192))
        assert (row.params_bytes, row.grads_bytes, row.optimizer_bytes) == \
            (plain.params_bytes, plain.grads_bytes, plain.optimizer_bytes)  # shards span all 8 ranks either way
        assert row.activations_bytes == local.activations_bytes < whole.activations_bytes
        assert row.mesh.as_dict() == {**plain.mesh.as_dict(), "dp_shard": 2, kind: 4}
        assert row.shard_degree == plain.shard_degree
        extra = row.comm_bytes_per_step - plain.comm_bytes_per_step
        assert extra == sum(comm_terms(SPEC, setup, kind, 4).values()) > 0
        kv = split_facts(SPEC, setup, kind, 4)["cp_kv_gathered_bytes"]
        assert row.peak_bytes == local.peak_bytes + kv and (kv > 0) == (kind == "cp")


def test_max_seq_len_is_the_boundary_of_the_fit_rule():
    """Each reported length fits and one step more does not (the formula's activations: --params has no code)."""
    setup = Setup(gpus_per_node=8, gpu_memory_bytes=H100, activation_checkpointing=True)
    rows = max_seq_len(SPEC, setup, lambda shape: {}, fits, limit=1 << 20)
    assert {(r["strategy"], r["degree"]) for r in rows} >= {("zero3", 1), ("zero3/sp8", 8), ("fsdp_full_shard/cp8", 8)}
    for r in rows:
        strategy = r["strategy"].split("/")[0]
        grain = 1024 * unit(r["kind"], r["degree"])
        at = replace(setup, seq_len=r["max_seq_len"])
        assert fits(split_row(strategy, SPEC, at, r["kind"], r["degree"]), setup), r
        assert not fits(split_row(strategy, SPEC, replace(at, seq_len=at.seq_len + grain), r["kind"], r["degree"]),
                        setup), r
    by = {(r["strategy"]): r["max_seq_len"] for r in rows}
    assert by["zero3"] < by["zero3/sp2"] < by["zero3/sp4"] < by["zero3/sp8"]


def test_plan_cli_rows_and_bad_input(capsys, tiny_llama):
    code = main(["plan", "--model", str(tiny_llama), "--gpus", "2", "--seq-len", "256", "--sp", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    rows = {r["strategy"]: r for r in out["rows"]}
    assert code == 0 and rows["zero3/sp2"]["mesh"]["sp"] == 2 and rows["zero3/sp2"]["activations_source"] == "traced"
    assert rows["zero3/sp2"]["comm"]["sp_all_to_all"] == out["sequence"]["comm"]["sp_all_to_all"] > 0
    assert out["sequence"]["tokens_per_rank"] == 128
    for argv, text in [(["--sp", "3"], "sp_size 3 does not divide num_attention_heads 4"),
                       (["--sp", "2", "--cp", "2"], "give --sp or --cp, not both"),
                       (["--cp", "2", "--seq-len", "1024"], "longer than the model's max_position_embeddings 512"),
                       (["--max-seq-len"], "--max-seq-len needs GPU memory")]:
        code = main(["plan", "--model", str(tiny_llama), "--gpus", "2", "--seq-len", "256", *argv])
        err = capsys.readouterr().err
        assert code == 2 and text in err and "Traceback" not in err, err
    code = main(["plan", "--model", str(tiny_llama), "--gpus", "2", "--gpu-memory", "200MB", "--max-seq-len"])
    out = capsys.readouterr().out
    assert code == 0 and "zero3/sp2" in out and "fsdp_full_shard/cp2" in out


def test_plan_recommendation_names_the_split_when_nothing_fits_whole():
    """128k tokens of an 8B model on 8 x 80 GB: no strategy fits with whole sequences (the formula's activations:
    --params has no code), so the recommendation is none, and with --sp 8 it names the split row that fits."""
    from shardscope.cli.plan_sequence import add_split_rows
    from shardscope.plan.planner import estimate

    setup = Setup(gpus_per_node=8, gpu_memory_bytes=H100, seq_len=131072, activation_checkpointing=True)
    result = estimate(SPEC, setup)
    assert result["recommendation"]["strategy"] is None and not any(r.fits for r in result["rows"])
    add_split_rows(result, SimpleNamespace(sp=8, cp=1, model=None), SPEC, setup, lambda shape: {})
    row = result["rows"][-1]
    assert row.strategy == "zero3/sp8" and row.fits and result["recommendation"]["strategy"] is None
    assert result["recommendation"]["reason"].endswith(f"; with each sequence split: zero3/sp8 fits "
                                                       f"({row.peak_bytes / 1e9:.3g} GB)")


def test_plan_shows_the_smallest_split_that_fits_when_nothing_fits_whole():
    """Without --sp/--cp, a plan where nothing fits whole (128k tokens of an 8B model on 8 x 80 GB) gets the rows of
    the smallest degree (cp before sp) at which a row fits, and the recommendation names it; half that degree does not
    fit."""
    from shardscope.cli.plan_sequence import add_fitting_split, add_split_rows
    from shardscope.plan.planner import estimate

    setup = Setup(gpus_per_node=8, gpu_memory_bytes=H100, seq_len=131072, activation_checkpointing=True)
    result = estimate(SPEC, setup)
    add_fitting_split(result, SimpleNamespace(sp=1, cp=1, model=None), SPEC, setup, lambda shape: {})
    split = [r for r in result["rows"] if "/" in r.strategy]
    kind, degree = result["sequence"]["kind"], result["sequence"]["degree"]
    assert split and any(r.fits for r in split) and all(r.strategy.endswith(f"/{kind}{degree}") for r in split)
    assert f"each sequence split {degree} ways (--{kind} {degree}" in result["recommendation"]["reason"]
    assert result["recommendation"]["strategy"] is None  # nothing fits whole: still exit 1
    for smaller in ("cp", "sp"):
        half = estimate(SPEC, setup)
        add_split_rows(half, SimpleNamespace(**{"sp": 1, "cp": 1, smaller: degree // 2}, model=None), SPEC, setup,
                       lambda shape: {})
        assert not any(r.fits for r in half["rows"]), smaller


# ----------------------------------------------------------------------------- fit
def test_fit_searches_the_degree_and_keeps_the_global_batch():
    setup = Setup(gpus_per_node=8, gpu_memory_bytes=H100, seq_len=65536, activation_checkpointing=True)
    found = search(SPEC, setup, 16, hardware("H100", "bf16-mixed"), STRATEGIES + ("fsdp_cp", "zero3_sp"))
    split = [c for c in found["fitting"] if "/" in c.strategy]
    assert {c.strategy for c in split} >= {"zero3/sp4", "zero3/sp8", "fsdp_full_shard/cp4", "fsdp_full_shard/cp8"}
    for c in split:
        degree = c.mesh.sp * c.mesh.cp  # one of them split
        dp = c.mesh.dp_replicate * c.mesh.dp_shard
        assert dp * degree == 8 and c.per_device_train_batch_size * c.gradient_accumulation_steps * dp == 16
    plain = search(SPEC, setup, 16, hardware("H100", "bf16-mixed"))  # the split configs only when named
    assert plain["fitting"] and not any("/" in c.strategy for c in plain["fitting"])


# ----------------------------------------------------------------------------- what the callback reads
def test_callback_split_degrees_and_groups():
    assert split_degrees({"dp_replicate": 1, "dp_shard": 2, "tp": 1, "sp": 4}) == (1, 4)  # tokens split: count all
    assert split_degrees({"dp_replicate": 1, "dp_shard": 2, "tp": 2, "cp": 2}) == (4, 1)  # whole batch on cp ranks
    assert split_degrees(None) == (1, 1)
    assert sequence_share(3, 1) == 3 and isinstance(sequence_share(3, 1), int) and sequence_share(3, 2) == 1.5
    pc = SimpleNamespace(sp_size=1, cp_size=4, tp_size=1, cp_backend="torch", sp_backend="deepspeed")
    assert run_split(pc) == {"mesh": {"cp": 4}, "degree": 4, "details": {"sequence_parallel": {
        "kind": "cp", "degree": 4, "backend": "torch", "group": [0, 1, 2, 3]}}}
    assert run_split(replace_ns(pc, tp_size=2))["details"]["sequence_parallel"]["group"] == [0, 2, 4, 6]
    assert run_split(replace_ns(pc, cp_size=1)) == {} and run_split(None) == {}


def replace_ns(ns, **kw):
    return SimpleNamespace(**{**vars(ns), **kw})


def test_doctor_fit_check_plans_the_split_row(tiny_llama):
    """doctor's no-fit check under a split yaml plans that split's row (what `plan --sp` plans), not the whole
    sequence on each GPU."""
    from shardscope.doctor.diagnose import Inputs, diagnose, parse_trainer_args

    trainer, source = parse_trainer_args([str(ROOT / "recipes/causal_lm_sft.py"), "--max_seq_length", "512"])
    inputs = Inputs(accelerate_config=ROOT / "accelerate_configs/zero3_sp.yaml", model=str(tiny_llama),
                    trainer=trainer, trainer_source=source, gpus=8, gpu_memory_bytes=10 ** 6)
    findings, _ = diagnose(inputs, validate=False, environment=False)
    assert [f.problem.split(" needs")[0] for f in findings if f.code == "no-fit"] == ["zero3/sp4"]
    assert "seq 512" in next(f.problem for f in findings if f.code == "no-fit")


@pytest.mark.parametrize("config", ["zero3_sp", "fsdp_cp"])
def test_fit_writes_the_split_config_the_library_loads(config, tmp_path, capsys, tiny_llama):
    """`fit --strategy zero3_sp|fsdp_cp --output-dir`: the shipped split config with the winner's degree (and, for cp,
    dp_shard x cp = processes), loaded by accelerate like every shipped config."""
    from shardscope.configs.validate import validate_config

    code = main(["fit", "--model", str(tiny_llama), "--gpus", "4", "--gpu", "H100", "--seq-len", "512",
                 "--global-batch", "4", "--strategy", config, "--output-dir", str(tmp_path), "--json"])
    result = json.loads(capsys.readouterr().out)
    kind = "sp" if config == "zero3_sp" else "cp"
    degree = result["mesh"][kind]
    assert code == 0 and result["strategy"].endswith(f"/{kind}{degree}") and degree > 1
    loaded = validate_config(tmp_path / "accelerate_config.yaml")
    pc = loaded.parallelism_config
    assert pc[f"parallelism_config_{kind}_size"] == degree and loaded.num_processes == 4
    assert result["data_parallel_size"] * degree == 4
    if kind == "cp":
        assert pc["parallelism_config_dp_shard_size"] * degree == 4
