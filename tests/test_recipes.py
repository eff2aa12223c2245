"""The recipes, run for real: 2 CPU ranks through `accelerate launch` (shipped configs) and the `deepspeed` launcher.

Each launched run is started once (session cache) and checked by several tests: what strategy really ran
(world size, wrapper, share of parameters held per rank), that the loss goes down on the learnable
synthetic task, that the saved weights reproduce the in-memory model's logits, that resuming from a
mid-run checkpoint reproduces the uninterrupted loss curve, and that LoRA saves adapters only.
Runs use the shipped demo YAMLs shrunk by command-line overrides, like users' own overrides.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import ROOT, accelerate_launch, cpu_env
from precision_checks import BF16_OK, assert_bf16_mixed_ranks, assert_bytes_match_planner
from recipe_checks import losses, param_count, reload_logits, run_lines
from recipe_runs import ACC, IMAGE, SAVE_AT, SFT, STEPS



@pytest.fixture(scope="session")
def runs(recipe_runs):
    """`runs(kind, name)`: tests/recipe_runs.py's launched runs (each launched once, with its shared launch's)."""
    return recipe_runs


# --- Causal LM: every strategy end to end ---------------------------------------------------------------

EXPECTED = {  # name -> (distributed_type, wrapper, parameter share each rank holds)
    "ddp": ("MULTI_CPU", "DistributedDataParallel", 1.0),
    "fsdp": ("FSDP", "FSDPLlamaForCausalLM", 0.5),
    "zero2": ("DEEPSPEED", "DeepSpeedEngine", 1.0),
    # accelerate_configs/zero3.yaml keeps DeepSpeed's 1e5-element persistence threshold: every tensor of the
    # 64-wide test model is below it, so parameters stay whole (optimizer state is still partitioned).
    "zero3": ("DEEPSPEED", "DeepSpeedEngine", 1.0),
    # ds_configs/zero3.json lets the Trainer fill the threshold ("auto" = 10 x hidden): weights partitioned.
    "ds_zero3": ("DEEPSPEED", "DeepSpeedEngine", 0.5),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_sft_strategy_really_ran(runs, name):
    run = runs("sft", name)
    lines = run_lines(run)
    kind, wrapper, share = EXPECTED[name]
    assert sorted(line["rank"] for line in lines) == ["0", "1"], run.output[-3000:]
    assert "could not measure" not in run.output  # the profiler measured everything (it warns what it could not)
    # and reported nothing: no hang record, no verdict line, no straggler (equal ranks doing equal work)
    assert not (run.output_dir / "shardscope_hang").exists() and "shardscope hang:" not in run.output
    straggler = json.loads((run.output_dir / "shardscope_summary.json").read_text())["straggler"]
    assert (straggler or {}).get("rank") is None and "is a straggler" not in run.output, straggler
    for line in lines:
        assert (line["world_size"], line["distributed_type"], line["wrapped"]) == ("2", kind, wrapper)
        assert float(line["local_param_fraction"]) == pytest.approx(share, abs=0.02)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_sft_loss_decreases(runs, name):
    curve = losses(runs("sft", name).output_dir)
    assert sorted(curve) == list(range(1, STEPS + 1))
    first, last = curve[1], curve[STEPS]
    assert first > 5.0 and last < first - 1.5, curve  # ~6.0 -> ~3.4 on the echo/reverse task


@pytest.mark.parametrize("name", list(EXPECTED))
def test_sft_saved_model_reproduces_trained_model(runs, name, sft_assets):
    output_dir = runs("sft", name).output_dir
    assert param_count(output_dir) == param_count(sft_assets["model"])  # a full model, not a near-empty file
    reloaded, in_memory = reload_logits(output_dir)
    torch.testing.assert_close(reloaded, in_memory, atol=1e-5, rtol=1e-5)
    assert (output_dir / "tokenizer.json").is_file()


def test_sft_strategies_agree(runs):
    """Same data, random seed and global batch: DDP, FSDP and ZeRO give the same loss curve (fp32, float tolerance)."""
    reference = losses(runs("sft", "ddp").output_dir)
    for name in ("fsdp", "zero2", "zero3", "ds_zero3"):
        curve = losses(runs("sft", name).output_dir)
        assert curve == pytest.approx(reference, rel=1e-4), name


# --- Resume from a mid-run checkpoint --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ddp", "fsdp", "zero3", "fsdp1"])
def test_resume_matches_uninterrupted_run(runs, name):
    """FSDP1 (sharded checkpoints) needs `RecipeTrainer`'s fix, else Adam restarts from zero after resume."""
    full = runs("sft", name)
    checkpoint = full.output_dir / f"checkpoint-{SAVE_AT}"
    assert max(losses(checkpoint)) == SAVE_AT  # the checkpoint knows steps 1..k only
    resumed = runs("resume", name)
    after = {step: loss for step, loss in losses(resumed.output_dir).items() if step > SAVE_AT}
    assert sorted(after) == list(range(SAVE_AT + 1, STEPS + 1)), "the resumed run did not train steps k+1..2k"
    uninterrupted = {step: loss for step, loss in losses(full.output_dir).items() if step > SAVE_AT}
    assert after == pytest.approx(uninterrupted, rel=1e-5, abs=1e-6)


# --- LoRA: adapters only -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lora_zero3", "lora_fsdp"])
def test_lora_saves_and_reloads_adapters_only(runs, name, sft_assets):
    from safetensors import safe_open

    output_dir = runs("sft", name).output_dir
    assert (output_dir / "adapter_model.safetensors").is_file()
    assert not list(output_dir.glob("model*.safetensors")) and not list(output_dir.glob("pytorch_model*"))
    with safe_open(str(output_dir / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in key for key in keys), keys
    curve = losses(output_dir)
    assert curve[STEPS] < curve[1] - 0.2, curve
    reloaded, in_memory = reload_logits(output_dir, base_model=sft_assets["model"])
    torch.testing.assert_close(reloaded, in_memory, atol=1e-5, rtol=1e-5)


def qlora_shapes(model_dir) -> list[tuple[tuple, int]]:
    """(shape, bytes per element) of every parameter of the recipe's QLoRA model, built here as the recipe builds it
    (bitsandbytes NF4 with double quantisation and bf16 storage on CPU, PEFT's LoRA on all linear layers)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quantization, device_map="cpu",
                                                 dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, target_modules="all-linear"))
    return [(tuple(p.shape), p.element_size()) for p in model.parameters()]


@pytest.mark.parametrize("name", ["qlora_ddp", "qlora_fsdp", "qlora_zero3"])
def test_qlora_trains_a_4bit_base_on_2_ranks_holding_the_planned_bytes(runs, sft_assets, name):
    """QLoRA on 2 CPU ranks: bitsandbytes' CPU backend quantises the base to NF4 and the adapters learn. Under DDP each
    rank holds the quantised base as plan/quantized.py counts it (data and quantisation state, the rest in bf16)
    plus the fp32 adapters it saved, to the byte; under FSDP2 (accelerate_configs/fsdp_qlora.yaml) its padded row
    shard of every parameter, the 4-bit weights' included (bf16 storage), and the quantisation state whole; under
    ZeRO-3 (zero3.yaml) its flat partition of every parameter, and every parameter whole as well (all of this tiny
    model's tensors are below stage3_param_persistence_threshold), and the quantisation state."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from shardscope.plan.quantized import quantized_base

    output_dir = runs("sft", name).output_dir
    curve = losses(output_dir)
    assert curve[STEPS] < curve[1] - 0.2, curve
    with safe_open(str(output_dir / "adapter_model.safetensors"), "pt") as f:
        adapters = sum(torch.Size(f.get_slice(key).get_shape()).numel() for key in f.keys())
    base = quantized_base(AutoConfig.from_pretrained(sft_assets["model"]), 4, double_quant=True, dtype_bytes=2,
                          storage_bytes=2)
    summary = json.loads((output_dir / "shardscope_summary.json").read_text())
    held = [rank["params_bytes"] for rank in summary["ranks"]]
    if name == "qlora_ddp":
        assert held == [base.total_bytes + 4 * adapters] * 2
        return
    shapes = qlora_shapes(sft_assets["model"])
    whole = sum(math.prod(s) * size for s, size in shapes)
    assert whole == base.total_bytes - base.state_bytes + 4 * adapters
    if name == "qlora_fsdp":
        assert summary["strategy"] == "fsdp_full_shard"
        shard = sum(-(-shape[0] // 2) * math.prod(shape[1:]) * size for shape, size in shapes)  # ceil(rows / 2) rows
        assert held == [shard + base.state_bytes] * 2
        return
    assert summary["strategy"] == "zero3"
    assert max(math.prod(s) for s, _ in shapes) <= summary["strategy_detail"]["stage3_param_persistence_threshold"]
    partition = sum(-(-math.prod(shape) // 2) * size for shape, size in shapes)  # ceil(numel / 2) each
    assert held == [whole + partition + base.state_bytes] * 2


# --- DINOv2 image classification -----------------------------------------------------------------------


def eval_history(output_dir: Path) -> list[tuple[int, float, float]]:
    history = json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]
    return [(e["step"], e["eval_accuracy"], e["eval_loss"]) for e in history if "eval_accuracy" in e]


@pytest.mark.parametrize("name,kind", [("ddp", "MULTI_CPU"), ("zero2", "DEEPSPEED"), ("fsdp", "FSDP"),
                                       ("zero3_frozen", "DEEPSPEED")])
def test_dinov2_learns_and_reloads(runs, name, kind):
    run = runs("image", name)
    assert {(line["world_size"], line["distributed_type"]) for line in run_lines(run)} == {("2", kind)}
    evals = eval_history(run.output_dir)
    (step0, acc0, loss0), (_, acc, loss) = evals[0], evals[-1]
    assert step0 == 0 and acc0 <= 0.5 and acc >= acc0 + 0.4 and loss < loss0 / 2, evals  # 4 classes
    curve = losses(run.output_dir)
    assert curve[max(curve)] < curve[1] / 2, curve
    reloaded, in_memory = reload_logits(run.output_dir)
    torch.testing.assert_close(reloaded, in_memory, atol=1e-5, rtol=1e-5)


def test_dinov2_freeze_backbone_trains_only_the_head(runs, image_assets):
    from safetensors.torch import load_file

    initial = load_file(image_assets["model"] / "model.safetensors")
    frozen = load_file(runs("image", "zero3_frozen").output_dir / "model.safetensors")
    full = load_file(runs("image", "ddp").output_dir / "model.safetensors")
    backbone = [k for k in initial if k.startswith("dinov2.")]
    assert backbone and set(frozen) == set(initial)
    assert all(torch.equal(frozen[k], initial[k]) for k in backbone)
    assert not torch.equal(frozen["classifier.weight"], initial["classifier.weight"])
    assert any(not torch.equal(full[k], initial[k]) for k in backbone)  # without the flag the backbone trains
    assert "trainable params: 516" in runs("image", "zero3_frozen").output  # 4 x (2 x 64) + 4: the head only


# --- bf16: the recipes' own runs hold what test_precision_runs proves for the strategies -----------------


@pytest.mark.parametrize("kind,name,zero", [("sft", "fsdp1", False), ("image", "zero2", True)])
def test_bf16_recipe_runs_hold_what_the_planner_says(runs, kind, name, zero):
    run = runs(kind, name)
    summary = json.loads((run.output_dir / "shardscope_summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["precision_verdict"] == BF16_OK
    assert_bf16_mixed_ranks(summary, zero)
    assert_bytes_match_planner(run.output_dir / "shardscope_summary.json")
    logged = [line for line in run.output.splitlines() if "shardscope precision: " in line]
    assert len(logged) == 1 and '"effective": "bf16-mixed"' in logged[0], logged  # once, at train begin


# --- Prompt masking (in process, on a hand-built example) ---------------------------------------------


def test_prompt_tokens_are_masked_and_do_not_affect_loss(sft_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq

    from shardscope.plan.dataset import format_prompt
    from shardscope.recipes.data import IGNORE_INDEX, pack, tokenize_sft

    tokenizer = AutoTokenizer.from_pretrained(sft_assets["model"])
    record = {"instruction": "Repeat the words.", "input": "red cat sun", "output": "red cat sun"}
    example = tokenize_sft(record, tokenizer, max_length=512)
    prompt = [tokenizer.bos_token_id] + tokenizer(format_prompt(record), add_special_tokens=False)["input_ids"]
    response = tokenizer("red cat sun", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert example["input_ids"] == prompt + response
    assert example["labels"] == [IGNORE_INDEX] * len(prompt) + response

    model = AutoModelForCausalLM.from_pretrained(sft_assets["model"])
    short = tokenize_sft({"instruction": "Reverse the words.", "output": "sun"}, tokenizer, max_length=512)
    batch = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX,
                                   return_tensors="pt")([example, short])
    assert (batch["labels"][1, len(short["labels"]):] == IGNORE_INDEX).all()  # padding is masked too
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = lambda lg: model.loss_function(lg, batch["labels"], vocab_size=model.config.vocab_size)  # noqa: E731
    # Position t predicts token t+1: positions whose next label is -100 must not matter, the others must.
    predicts_masked = torch.zeros(batch["labels"].shape, dtype=torch.bool)
    predicts_masked[:, :-1] = batch["labels"][:, 1:] == IGNORE_INDEX
    noise = torch.randn_like(logits) * 10
    assert predicts_masked.sum() > len(prompt)  # the whole prompt of both examples, and padding
    torch.testing.assert_close(loss(logits + noise * predicts_masked[..., None]), loss(logits), rtol=0, atol=0)
    assert not torch.allclose(loss(logits + noise * (~predicts_masked)[..., None]), loss(logits))

    packed = pack({key: [example[key], short[key]] for key in example}, block_size=16)
    flat = example["labels"] + short["labels"]
    assert [label for block in packed["labels"] for label in block] == flat[:len(flat) // 16 * 16]


def test_yaml_config_with_cli_overrides(tmp_path):
    from shardscope.errors import UsageError
    from shardscope.recipes.args import RecipeParser, RecipeTrainingArguments

    sys.path.insert(0, str(SFT.parent))
    try:
        import causal_lm_sft as recipe
    finally:
        sys.path.pop(0)
    parser = RecipeParser(recipe.ScriptArguments, recipe.ModelArguments, training_type=RecipeTrainingArguments)
    script, model = parser.parse(["--config", str(ROOT / "recipes/llama/demo_tiny.yaml"), "--max_seq_length", "32"])
    assert (script.max_seq_length, script.dataset, model.model_name_or_path) == (32, "demo_out/alpaca.json",
                                                                                 "demo_out/tiny-llama")
    assert parser.namespace["learning_rate"] == pytest.approx(3e-3) and parser.namespace["max_steps"] == 30
    assert parser.namespace["use_cpu"] is (not torch.cuda.is_available())
    (tmp_path / "bad.yaml").write_text("learning_rate: 1.0e-3\nlerning_rate: 2\n")
    with pytest.raises(UsageError, match="bad.yaml: unknown key.*lerning_rate"):
        RecipeParser(recipe.ScriptArguments, recipe.ModelArguments,
                     training_type=RecipeTrainingArguments).parse(["--config", str(tmp_path / "bad.yaml")])


@pytest.mark.parametrize("text,message", [
    (None, "--config {path}: no such file"),
    ("learning_rate: [1.0e-3\n", "--config {path}:2:1: malformed YAML: expected ',' or ']'"),
    ("- learning_rate\n", "{path}: expected a mapping of argument names to values"),
])
def test_bad_yaml_config_is_one_line_naming_the_file(tmp_path, text, message):
    from shardscope.errors import UsageError
    from shardscope.recipes.args import load_yaml_config

    path = tmp_path / "recipe.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(UsageError) as error:
        load_yaml_config(str(path))
    assert str(error.value).startswith(message.format(path=path)) and "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["sft", "image"])
def test_every_shipped_recipe_yaml_parses(name):
    """Every per-model YAML names only real arguments of its recipe (a typo fails here, not on 8 GPUs)."""
    from shardscope.recipes.args import RecipeParser, RecipeTrainingArguments

    script = SFT if name == "sft" else IMAGE
    sys.path.insert(0, str(script.parent))
    try:
        module = __import__(script.stem)
    finally:
        sys.path.pop(0)
    folders = ["llama", "mistral"] if name == "sft" else ["dinov2"]
    yamls = [p for folder in folders for p in sorted((ROOT / "recipes" / folder).rglob("*.yaml"))]
    assert len(yamls) >= (3 if name == "sft" else 2)
    for path in yamls:
        parser = RecipeParser(module.ScriptArguments, module.ModelArguments, training_type=RecipeTrainingArguments)
        _, model = parser.parse(["--config", str(path)])
        assert model.model_name_or_path, path


# --- Bad input: one clear line, exit code 2, no traceback ----------------------------------------------


def run_recipe(script, *args):
    proc = subprocess.run([sys.executable, str(script), *map(str, args), "--output_dir", "/tmp/never_written"],
                          env=cpu_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


def run_recipe_in_process(capfd, monkeypatch, script, *args):
    """The recipe run as `__main__` in this process (its imports already paid): exit code and what it printed."""
    import runpy

    monkeypatch.setattr(sys, "argv", [str(script), *map(str, args), "--output_dir", "/tmp/never_written"])
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    out, err = capfd.readouterr()
    return exit_.value.code, out + err


# The image recipe's case runs as a subprocess, as a user runs it; the SFT recipe's cases run in process (its
# entry point meets bad input under `accelerate launch` in the last test of this file).
@pytest.mark.parametrize("case", ["missing_column", "not_causal_lm", "image_folder_no_classes"])
def test_bad_input_is_one_clear_line(case, tmp_path, sft_assets, image_assets, capfd, monkeypatch):
    if case == "missing_column":
        data = tmp_path / "qa.jsonl"
        data.write_text(json.dumps({"instruction": "Say hi.", "response": "hi"}) + "\n")
        code, output = run_recipe_in_process(capfd, monkeypatch, SFT, "--model_name_or_path", sft_assets["model"],
                                             "--dataset", data)
        expected = f"causal_lm_sft.py: error: dataset '{data}' has no column(s) 'output'"
    elif case == "not_causal_lm":
        code, output = run_recipe_in_process(capfd, monkeypatch, SFT, "--model_name_or_path", image_assets["model"],
                                             "--dataset", sft_assets["data"])
        expected = f"causal_lm_sft.py: error: model '{image_assets['model']}' is a dinov2 model"
    elif case == "image_folder_no_classes":
        flat = tmp_path / "flat"
        flat.mkdir()
        for png in list((image_assets["data"] / "train" / "red").glob("*.png"))[:3]:
            (flat / png.name).write_bytes(png.read_bytes())
        code, output = run_recipe(IMAGE, "--model_name_or_path", image_assets["model"], "--dataset", flat)
        expected = f"image_classification.py: error: image folder '{flat}' has no classes"
    assert code == 2, output
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(expected), output
    assert "Traceback" not in output


def test_model_checks_in_process(sft_assets, image_assets):
    """The same checks the recipes call first, without paying a subprocess: wrong family, missing config."""
    from shardscope.errors import UsageError
    from shardscope.model.spec import load_model_config
    from shardscope.recipes.args import check_causal_lm, check_dinov2

    check_causal_lm(load_model_config(str(sft_assets["model"])), "x")
    check_dinov2(load_model_config(str(image_assets["model"])), "x")
    with pytest.raises(UsageError, match="'llm' is a llama model, not a Dinov2 model"):
        check_dinov2(load_model_config(str(sft_assets["model"])), "llm")
    with pytest.raises(UsageError, match="is a folder without config.json"):
        load_model_config(str(image_assets["data"]))
    with pytest.raises(UsageError, match="'org/missing' is not a local folder and the hub cannot be reached"):
        load_model_config("org/missing")


@pytest.mark.launch
def test_bad_input_under_accelerate_launch_fails_before_training(tmp_path, sft_assets):
    """Under the launcher a rank prints one line before any process group or model exists. The launcher stops the
    other rank as soon as one fails, so the second rank may be killed before it prints its (identical) line."""
    data = tmp_path / "qa.json"
    data.write_text(json.dumps([{"instruction": "Say hi.", "response": "hi"}]))
    run = accelerate_launch(ACC / "ddp.yaml", SFT, ["--model_name_or_path", sft_assets["model"], "--dataset", data],
                            tmp_path / "out")
    assert run.returncode != 0
    lines = [line for line in run.output.splitlines() if line.startswith("causal_lm_sft.py: error:")]
    assert 1 <= len(lines) <= 2 and len(set(lines)) == 1 and "has no column(s) 'output'" in lines[0], run.output
    assert "[rank0]: Traceback" not in run.output and "Loading weights" not in run.output
