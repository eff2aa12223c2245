import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama saved with save_pretrained; runs load it back with from_pretrained."""
    from shardscope.tiny import make_causal_lm

    path = tmp_path_factory.mktemp("tiny_llama")
    make_causal_lm(path, "llama")
    return path


ZERO3_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default; the inline accelerate yamls keep it

# Models the strategy runs use, by name: LlamaConfig sizes on top of shardscope.tiny's defaults.
STRATEGY_MODELS = {
    # bytes mostly in tensors above ZeRO-3's persistence threshold, so ZeRO-3 really shards them
    "shard_llama": dict(vocab_size=1600, intermediate_size=1600),
    # ~50M parameters (hidden 512, 8 layers), for the planner agreement at a realistic shape
    "llama_50m": dict(vocab_size=16000, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                      num_attention_heads=8),
}


@pytest.fixture(scope="session")
def strategy_model(tmp_path_factory):
    """Build a STRATEGY_MODELS entry once, lazily; returns its folder."""
    from shardscope.tiny import make_causal_lm

    built = {}

    def build(name):
        if name not in built:
            built[name] = tmp_path_factory.mktemp(name)
            make_causal_lm(built[name], "llama", **STRATEGY_MODELS[name])
        return built[name]

    return build


@pytest.fixture(scope="session")
def strategy_runs(strategy_model, tmp_path_factory):
    """Launch tests/workers/train_tiny.py under a shipped accelerate config on 2 CPU ranks, once per
    (config, model); returns (profiler summary, [independent count per rank])."""
    from launch import ROOT, accelerate_launch

    cache = {}

    def run(config, model="shard_llama", lora_r=0):
        if (config, model, lora_r) not in cache:
            out = tmp_path_factory.mktemp(f"{config}-{model}-lora{lora_r}")
            args = ["--model", strategy_model(model), "--max_steps", 3, "--logging_steps", 1, "--lora_r", lora_r,
                    "--per_device_train_batch_size", 2, "--use_cpu", "--report_to", "none", "--save_strategy", "no"]
            worker = ROOT / "tests" / "workers" / "train_tiny.py"
            accelerate_launch(ROOT / "accelerate_configs" / f"{config}.yaml", worker, args, out).check()
            summary = json.loads((out / "shardscope_summary.json").read_text())
            independent = [json.loads((out / f"independent_count_rank{r}.json").read_text()) for r in range(2)]
            cache[config, model, lora_r] = summary, independent
        return cache[config, model, lora_r]

    return run


@pytest.fixture(scope="session")
def model_bytes(strategy_model):
    """(all parameter bytes, bytes of parameters ZeRO-3 keeps whole on every rank), in fp32."""
    from transformers import AutoModelForCausalLM

    sizes = [p.numel() for p in AutoModelForCausalLM.from_pretrained(strategy_model("shard_llama")).parameters()]
    return 4 * sum(sizes), 4 * sum(n for n in sizes if n < ZERO3_PERSISTENCE_THRESHOLD)
