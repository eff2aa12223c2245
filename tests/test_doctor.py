"""`shardscope doctor`: one test per finding (a fixture with exactly that problem), no false positives on
every shipped config and recipe YAML, exit codes, and the recipes' start-up check. No launches."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardscope.cli import main
from shardscope.configs.catalog import shipped_configs
from shardscope.doctor.diagnose import Inputs, diagnose, parse_trainer_args, startup_checks
from shardscope.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "doctor"
SHIPPED = {c.path.name: c.path for c in shipped_configs()}


@pytest.fixture(autouse=True)
def empty_hf_home(tmp_path, monkeypatch):
    """No accelerate default config unless a test puts one there."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    return tmp_path / "hf_home"


def run(*trainer_args, **inputs):
    trainer = source = None
    if trainer_args:
        trainer, source = parse_trainer_args(list(trainer_args))
    findings, notes = diagnose(Inputs(trainer=trainer, trainer_source=source or "trainer arguments", **inputs))
    return findings


def only(findings, code, key):
    assert [(f.code, f.key) for f in findings] == [(code, key)], "\n".join(map(str, findings))
    return findings[0]


# ----------------------------------------------------------------------------- one test per finding


def test_deepspeed_value_disagrees_with_trainer_argument():
    f = only(run("--gradient_accumulation_steps", "8", deepspeed=FIX / "ds_mismatch.json"),
             "ds-mismatch", "gradient_accumulation_steps")
    assert "4" in f.problem and "gradient_accumulation_steps=8" in f.problem and '"auto"' in f.fix
    # the same file agrees with matching arguments
    assert run("--gradient_accumulation_steps", "4", deepspeed=FIX / "ds_mismatch.json") == []


@pytest.mark.parametrize("flag, value, key", [("--per_device_train_batch_size", "4", "train_micro_batch_size_per_gpu"),
                                               ("--learning_rate", "1e-4", "optimizer.params.lr"),
                                               ("--fp16", None, "bf16.enabled")])
def test_deepspeed_batch_lr_precision_disagree(tmp_path, flag, value, key):
    import json

    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "bf16": {"enabled": True},
              "fp16": {"enabled": False}, "zero_optimization": {"stage": 1}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    base = ["--per_device_train_batch_size", "8", "--learning_rate", "3e-4", "--bf16"]
    assert run(*base, deepspeed=path) == []
    changed = [a for a in base if a not in (flag, "--bf16")] if value is None else base
    args = changed + [flag] + ([value] if value else [])
    findings = run(*args, deepspeed=path)
    if flag == "--fp16":
        assert {(f.code, f.key) for f in findings} == {("ds-mismatch", "bf16.enabled"), ("ds-mismatch", "fp16.enabled")}
    else:
        only(findings, "ds-mismatch", key)


def test_deepspeed_number_written_as_string():
    f = only(run(deepspeed=FIX / "ds_string_number.json"), "ds-string", "gradient_accumulation_steps")
    assert "'4' is a string" in f.problem and "without quotes" in f.fix
    # with Trainer arguments it stays one finding (the Trainer's text-vs-number mismatch is the same problem)
    only(run("--gradient_accumulation_steps", "4", deepspeed=FIX / "ds_string_number.json"),
         "ds-string", "gradient_accumulation_steps")


def test_deepspeed_section_silently_overrides_trainer_argument():
    f = only(run("--optim", "adafactor", deepspeed=FIX / "ds_optimizer_section.json"), "ds-ignored", "optimizer")
    assert "adafactor" in f.problem and "silently ignored" in f.problem
    assert run(deepspeed=FIX / "ds_optimizer_section.json") == []


def test_deepspeed_without_gradient_clipping_ignores_max_grad_norm(tmp_path):
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}))
    f = only(run("--max_grad_norm", "0.5", deepspeed=path), "ds-ignored", "gradient_clipping")
    assert "0.5" in f.problem
    assert run("--max_grad_norm", "0", deepspeed=path) == []


def test_zero3_without_16bit_gather_on_save():
    f = only(run(deepspeed=FIX / "ds_zero3_no_gather.json"),
             "zero3-save", "zero_optimization.stage3_gather_16bit_weights_on_model_save")
    assert "no real weights" in f.problem


def test_fsdp1_key_under_fsdp2_names_the_current_key():
    f = only(run(accelerate_config=FIX / "fsdp2_with_fsdp1_key.yaml"), "fsdp-key", "fsdp_config.fsdp_sharding_strategy")
    assert "fsdp_reshard_after_forward" in f.fix and "FSDP1" in f.problem


def test_fsdp_config_key_from_another_version():
    f = only(run(fsdp_config=FIX / "fsdp_old_trainer_key.json"), "fsdp-key", "fsdp_transformer_layer_cls_to_wrap")
    assert f.fix == "rename it to transformer_layer_cls_to_wrap"


def test_layer_class_to_wrap_the_model_does_not_have():
    f = only(run(accelerate_config=FIX / "fsdp_wrong_layer_class.yaml", model="llama-2-7b"),
             "wrap-class", "fsdp_config.fsdp_transformer_layer_cls_to_wrap")
    assert "GPT2Block" in f.problem and "LlamaDecoderLayer" in f.problem and "LlamaRMSNorm" in f.problem
    assert f.fix == "wrap LlamaDecoderLayer"
    # a Trainer fsdp_config for Llama used with Mistral
    f = only(run(fsdp_config=SHIPPED["llama_full_shard.json"], model="mistral-7b"),
             "wrap-class", "transformer_layer_cls_to_wrap")
    assert f.fix == "wrap MistralDecoderLayer"


def test_default_accelerate_config_would_change_the_strategy(empty_hf_home):
    target = empty_hf_home / "accelerate" / "default_config.yaml"
    target.parent.mkdir(parents=True)
    shutil.copy(FIX / "default_config.yaml", target)
    f = only(run(), "default-config", "distributed_type")
    assert f.file == str(target) and "FSDP" in f.problem and "--config_file" in f.fix
    assert run(accelerate_config=SHIPPED["ddp.yaml"]) == []  # an explicit config file is what launch will use


def test_strategy_that_does_not_fit_the_gpus():
    from shardscope.units import gpu_memory

    fit = dict(model="llama-2-7b", gpus=8, gpu_memory_bytes=gpu_memory("A100-80"))
    f = only(run("--bf16", accelerate_config=SHIPPED["ddp.yaml"], **fit), "no-fit", "strategy")
    assert "ddp needs" in f.problem and "DDP/NO_SHARD" in f.problem and f.fix.startswith("use ")
    assert run("--bf16", "--gradient_checkpointing", accelerate_config=SHIPPED["zero3.yaml"], **fit) == []  # fits
    findings = run("--bf16", accelerate_config=SHIPPED["zero3.yaml"], model="llama-2-70b", gpus=2,
                   gpu_memory_bytes=gpu_memory("A100-40"))  # the yaml's 8 processes vs 2 GPUs: its own finding
    f = only([f for f in findings if f.code != "processes"], "no-fit", "strategy")
    assert "zero3 needs" in f.problem
    # a TP yaml is planned on its own mesh (fsdp_tp.yaml: 2 shards x tp 4), whatever --gpus says
    f = only(run("--bf16", accelerate_config=SHIPPED["fsdp_tp.yaml"], model="llama-2-70b", gpus=8,
                 gpu_memory_bytes=gpu_memory("A100-80")), "no-fit", "strategy")
    assert "fsdp_tp needs" in f.problem
    assert run("--bf16", "--gradient_checkpointing", "--per_device_train_batch_size", "1",
               accelerate_config=SHIPPED["fsdp_tp.yaml"], **fit) == []  # llama-2-7b


def test_mixed_precision_differs_between_accelerate_and_trainer():
    f = only(run("--fp16", accelerate_config=SHIPPED["ddp.yaml"]), "precision", "mixed_precision")
    assert "bf16 here but fp16" in f.problem
    assert run("--bf16", accelerate_config=SHIPPED["ddp.yaml"]) == []


def test_fsdp1_offload_without_orig_params():
    f = only(run(accelerate_config=FIX / "fsdp1_offload_flat_params.yaml"), "offload", "fsdp_config.fsdp_use_orig_params")
    assert "true" in f.fix


def test_zero_offload_without_a_way_to_build_cpu_adam(tmp_path, monkeypatch):
    assert run(deepspeed=SHIPPED["zero2_offload.json"]) == []  # this machine has a compiler
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "no_cache"))  # nothing JIT-built yet
    f = only(run(deepspeed=SHIPPED["zero2_offload.json"]), "offload", "zero_optimization.offload_optimizer.device")
    assert "DeepSpeedCPUAdam" in f.problem and "no-such-compiler" in f.problem


def test_tensor_parallel_degree_the_model_cannot_take(tmp_path):
    from transformers import Dinov2Config, MistralConfig

    key = "parallelism_config.parallelism_config_tp_size"
    MistralConfig(hidden_size=768, num_attention_heads=12, num_key_value_heads=4).save_pretrained(tmp_path / "mistral_12_4")
    f = only(run(accelerate_config=SHIPPED["tp.yaml"], model=str(tmp_path / "mistral_12_4")), "tp-degree", key)
    assert f.problem == "8 does not divide the model's attention heads (num_attention_heads 12, num_key_value_heads 4)"
    assert f.fix == "use a tp_size in 1, 2, 4"
    assert run(accelerate_config=SHIPPED["fsdp_tp.yaml"], model=str(tmp_path / "mistral_12_4")) == []  # tp 4
    Dinov2Config().save_pretrained(tmp_path / "dinov2")
    f = only(run(accelerate_config=SHIPPED["fsdp_tp.yaml"], model=str(tmp_path / "dinov2")), "tp-degree", key)
    assert "no tensor-parallel plan" in f.problem
    sft = ROOT / "recipes" / "causal_lm_sft.py"
    f = only(run(str(sft), "--config", str(ROOT / "recipes/llama/llama2_7b_full.yaml"), "--use_lora", "true",
                 accelerate_config=SHIPPED["tp.yaml"], model="llama-2-7b"), "tp-degree", key)
    assert "LoRA" in f.problem


def test_library_loader_problems_are_findings():
    findings = run(deepspeed=ROOT / "tests" / "fixtures" / "bad_configs" / "ds_bad_stage.json")
    assert findings and {f.code for f in findings} == {"config"}
    assert all(f.file.endswith("ds_bad_stage.json") for f in findings)


# ----------------------------------------------------------------------------- no false positives


@pytest.mark.parametrize("config", [c for c in shipped_configs() if c.kind != "slurm"], ids=lambda c: c.name)
def test_every_shipped_config_is_clean(config):
    model = {"fsdp/dinov2_full_shard": None, "fsdp/mistral_full_shard": "mistral-7b"}.get(config.name, "llama-2-7b")
    inputs = {"accelerate": "accelerate_config", "deepspeed": "deepspeed", "fsdp": "fsdp_config"}[config.kind]
    assert run(**{inputs: config.path}, model=model) == []
    # with the Trainer arguments the shipped recipes use (bf16, accumulation) and a world size
    if config.kind != "fsdp":
        assert run("--bf16", "--gradient_accumulation_steps", "4", **{inputs: config.path}, model=model) == []


RECIPE_YAMLS = sorted((ROOT / "recipes").rglob("*.yaml"))


@pytest.mark.parametrize("yaml_path", RECIPE_YAMLS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_recipe_yaml_is_clean(yaml_path):
    script = ROOT / "recipes" / ("image_classification.py" if yaml_path.parent.name == "dinov2" else "causal_lm_sft.py")
    trainer, source = parse_trainer_args([str(script), "--config", str(yaml_path)])
    assert source == str(yaml_path) and trainer["output_dir"]
    findings, notes = diagnose(Inputs(trainer=trainer, trainer_source=source, model=trainer["model_name_or_path"],
                                      model_from_args=True))
    assert findings == []
    if "demo" not in yaml_path.name:  # GPU recipes: also clean beside the DeepSpeed configs they are launched with
        for ds in ("zero2.json", "zero3.json", "zero3_offload.json"):
            assert run(str(script), "--config", str(yaml_path), deepspeed=SHIPPED[ds]) == []
        for acc in ("fsdp_full_shard.yaml", "zero3.yaml"):
            assert run(str(script), "--config", str(yaml_path), accelerate_config=SHIPPED[acc]) == []


# ----------------------------------------------------------------------------- command line and recipes


def test_exit_codes(capsys):
    assert main(["doctor", "--accelerate-config", str(SHIPPED["fsdp_full_shard.yaml"]), "--model", "llama-2-7b"]) == 0
    assert "no problems found" in capsys.readouterr().out
    assert main(["doctor", "--deepspeed", str(FIX / "ds_mismatch.json"), "--",
                 "--gradient_accumulation_steps", "8"]) == 1
    out = capsys.readouterr().out
    assert "[ds-mismatch]" in out and "fix:" in out and str(FIX / "ds_mismatch.json") in out
    assert main(["doctor", "--deepspeed", "no/such.json"]) == 2
    assert main(["doctor", "--model", "./no/such/folder", "--accelerate-config", str(SHIPPED["ddp.yaml"])]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_recipe_args_after_double_dash(capsys):
    script = ROOT / "recipes" / "causal_lm_sft.py"
    code = main(["doctor", "--accelerate-config", str(SHIPPED["ddp.yaml"]), "--", str(script),
                 "--config", str(ROOT / "recipes" / "llama" / "llama2_7b_full.yaml"), "--bf16", "false"])
    assert code == 1 and "[precision]" in capsys.readouterr().out


def test_recipe_start_up_check_refuses_a_mismatch(monkeypatch):
    """What the recipes call just before `parser.training_args()` builds TrainingArguments (no process group)."""
    for name in ("WORLD_SIZE", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_FSDP", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    script = str(ROOT / "recipes" / "causal_lm_sft.py")
    ok, _ = parse_trainer_args([script, "--deepspeed", str(SHIPPED["zero3.json"]), "--gradient_accumulation_steps", "8"])
    startup_checks(ok, None)
    bad, _ = parse_trainer_args([script, "--deepspeed", str(FIX / "ds_mismatch.json"), "--gradient_accumulation_steps", "8"])
    with pytest.raises(UsageError, match="refusing to start.*gradient_accumulation_steps"):
        startup_checks(bad, None)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.raises(UsageError, match="mixed_precision"):
        startup_checks(ok, None)


def test_doctor_and_plan_agree_on_fits_near_the_edge(tiny_llama, capsys):
    """A GPU whose usable memory lies between the formula's peak and the traced one: doctor's fit check
    and `plan --model` both decide with the traced step, so they agree where the formula would not."""
    import json

    from shardscope.plan.mesh import HEADROOM, Setup
    from shardscope.model.spec import model_spec
    from shardscope.plan.planner import estimate
    from shardscope.plan.trace_cache import cached_traces_for

    model = str(tiny_llama)
    setup = Setup(precision="bf16-mixed", micro_batch=1, seq_len=2048)  # doctor's defaults without Trainer arguments
    traces, note = cached_traces_for(model, setup)
    assert note is None
    formula, traced = (next(r.peak_bytes for r in estimate(model_spec(model), setup, t)["rows"]
                            if r.strategy == "ddp") for t in (None, traces))
    # The formula misses what the trace holds (the fp32 logits' copies at the loss, SwiGLU's tensors): traced > formula.
    # At usable = formula nothing fits one GPU (every strategy holds the traced step; the `tp` row of degree 1
    # is no option), so plan exits 1; at usable = traced - 1 only DDP misses, by a byte (ZeRO and FSDP hold no
    # DDP buckets): something fits, exit 0.
    assert traced > formula
    for usable, code in ((formula, 1), (traced - 1, 0)):  # the formula fits exactly one of the two
        memory = int(usable / (1 - HEADROOM)) + 1
        assert main(["plan", "--model", model, "--gpu-memory", str(memory), "--json"]) == code
        rows = json.loads(capsys.readouterr().out)["rows"]
        assert any(r["fits"] for r in rows if r["strategy"] != "tp") is (code == 0)
        row = next(r for r in rows if r["strategy"] == "ddp")
        assert row["activations_source"] == "traced" and row["peak_bytes"] == traced
        assert row["fits"] is (traced <= usable) and row["fits"] is not (formula <= usable)
        no_fit = [f for f in run(model=model, gpus=1, gpu_memory_bytes=memory) if f.code == "no-fit"]
        assert bool(no_fit) is not row["fits"]
