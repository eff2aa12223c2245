"""The strategy runs: tests/workers/train_tiny.py under each shipped single-node config on 2 CPU ranks, shared by
test_strategies.py, test_planner_agreement.py, test_comm_agreement.py, test_precision_runs.py, test_peak_runs.py and
test_parity_runs.py (tests/conftest.py registers the fixtures and keeps those files on one xdist worker), and the
models they train (STRATEGY_MODELS, also built for test_multinode.py and test_export.py).
"""
import hashlib
import json

import pytest

from launch import ROOT, SharedLaunches, launch_together

# Models the strategy runs use, by name: (family, config sizes on top of shardscope.recipes.tiny's defaults).
STRATEGY_MODELS = {
    # bytes mostly in tensors above ZeRO-3's persistence threshold, so ZeRO-3 really shards them
    "shard_llama": ("llama", dict(vocab_size=1600, intermediate_size=1600)),
    "shard_mistral": ("mistral", dict(vocab_size=1600, intermediate_size=1600, num_key_value_heads=2)),
    "shard_dinov2": ("dinov2", dict(intermediate_size=1600, num_labels=4)),
    # ~50M parameters (hidden 512, 8 layers), for the planner agreement at a realistic shape
    "llama_50m": ("llama", dict(vocab_size=16000, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                                num_attention_heads=8)),
    # test_moe_runs' tiny Qwen3-MoE: 8 experts of 2 per token in 2 layers, fused (transformers 5's Qwen3MoeExperts)
    "moe_qwen3": ("qwen3_moe", dict(vocab_size=1600, hidden_size=128, moe_intermediate_size=256)),
    # test_peak_runs' 4-layer Llama (tests/peak_spec.py)
    "peak_llama": ("llama", dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=4)),
}
# test_parity_runs' shadows (shardscope.parity.shadow) of a shipped MoE and a shipped dense model, by name
SHADOWS = {"shadow_mixtral": "mixtral-8x7b", "shadow_llama": "llama-3-70b"}


@pytest.fixture(scope="session")
def strategy_model(tmp_path_factory):
    """Build a STRATEGY_MODELS entry once, lazily; returns its folder."""
    from shardscope.recipes.tiny import make_causal_lm, make_dinov2

    built = {}

    def build(name):
        if name in SHADOWS and name not in built:
            from shardscope.parity.shadow import build_shadow

            built[name] = build_shadow(SHADOWS[name], tmp_path_factory.mktemp(name))[0]
        if name not in built:
            family, sizes = STRATEGY_MODELS[name]
            built[name] = tmp_path_factory.mktemp(name)
            if family == "dinov2":
                make_dinov2(built[name], **sizes)
            else:
                make_causal_lm(built[name], family, **sizes)
        return built[name]

    return build


def strategy_model_for(config: str) -> str:
    """The STRATEGY_MODELS model a shipped config is for: its family's where its name says one, else the Llama."""
    return "shard_mistral" if "mistral" in config else "shard_dinov2" if "dinov2" in config else "shard_llama"


# Runs (config, model, lora_r, grad_accum, flags) that one launch trains together (tests/workers/several_runs.py): a
# launch's start-up is most of a tiny run's time, so the first test that asks for any of them pays one launch. Per
# accelerate config, the planner agreement's two shapes (and DDP's LoRA run), then test_precision_runs' and
# test_peak_runs' runs of that config (precision_checks.PRECISION_RUNS, peak_spec.RUNS); the single-node accelerate
# configs (DDP's, FSDP's, then DeepSpeed's) under one `accelerate launch`, each run in its own config's launch
# environment (several_runs.py --launch_config); every single-node DeepSpeed JSON under one `deepspeed` launch with
# test_peak_runs' small-bucket ZeRO runs (peak_spec.SMALL_BUCKET_RUNS), every
# single-node FSDP JSON under one `torchrun` (their configs are script arguments).
AGREEING = ("ddp", "zero1", "zero2", "zero3", "fsdp_full_shard", "fsdp_shard_grad_op")
# test_moe_runs' runs of the tiny Qwen3-MoE: 4 samples of 64 tokens, so that each rank's first step (2 samples) and
# the other rank's together are the whole data set, and no log inside the 3 steps. In a launch of their own (FSDP's
# run, then DeepSpeed's), as users run: in the shared launch CI once measured one rank's FSDP2 peak 11% above its plan
# (never seen here, in that launch or alone), and a first run in a new process leaves nothing of other runs to doubt.
MOE_CONFIGS = ("fsdp_full_shard", "zero3")
MOE_FLAGS = ("--seq_len", 64, "--samples", 4, "--logging_steps", 500)
# Parity (test_parity_runs.py): every shard_llama run of a config's own (no LoRA, no accumulation, no flags) records
# parity fingerprints (parity_flags); the seeded defects train under DDP and the shadows under ZeRO-3 in the same
# launch. Their one-process references train together in one process (test_parity_runs.py).
PARITY_DEFECT_RUNS = (("ddp", "shard_llama", 0, 1, ("--defect", "same_batches")),
                      ("ddp", "shard_llama", 0, 1, ("--defect", "perturb_rank_1")),
                      ("ddp", "shard_llama", 0, 2, ("--defect", "accumulation_loss")))
PARITY_SHADOW_RUNS = tuple(("zero3", name, 0, 1, ()) for name in SHADOWS)
PARITY_FOLDER = "parity"  # under each run's folder


def parity_flags(model, lora_r, grad_accum, flags) -> list:
    """The worker's --parity for a run test_parity_runs compares (the env `shardscope parity` sets, set by it)."""
    own = model in ("shard_llama", *SHADOWS) and lora_r == 0 and (flags == () or flags[0] == "--defect")
    return ["--parity", PARITY_FOLDER] if own else []


def accelerate_families() -> dict[str, list[str]]:
    """The single-node accelerate configs without a parallelism mesh, by distributed_type."""
    import yaml

    from shardscope.configs.catalog import shipped_configs

    families: dict[str, list[str]] = {}
    for config in shipped_configs():
        text = yaml.safe_load(config.path.read_text()) if config.kind == "accelerate" else {}
        if config.kind == "accelerate" and not config.multinode and "parallelism_config" not in text:
            families.setdefault(text["distributed_type"], []).append(config.name)
    return families


def shared_launches() -> list[tuple]:
    from peak_spec import RUNS as PEAK_RUNS
    from peak_spec import SMALL_BUCKET_RUNS, peak_flags, small_bucket_flags
    from precision_checks import PRECISION_RUNS, precision_flags
    from shardscope.configs.catalog import shipped_configs

    def runs_of(c):  # the agreement runs, or the config's own run; then its precision and peak runs
        own = ([(c, "shard_llama", 0, 1, ()), (c, "llama_50m", 0, 2, ()),
                *([(c, "shard_llama", 4, 1, ())] if c == "ddp" else [])] if c in AGREEING
               else [(c, strategy_model_for(c), 0, 1, ())])
        return [*own, *((c, "shard_llama", 0, 1, precision_flags(*flags)) for flags in PRECISION_RUNS.get(c, ())),
                *((c, "peak_llama", 0, 1, peak_flags(*run)) for config, *run in PEAK_RUNS if config == c)]

    def in_order(family):
        return [run for c in sorted(family, key=lambda c: c not in AGREEING) for run in runs_of(c)]

    families = accelerate_families()  # one launch: DDP's runs, FSDP's, then DeepSpeed's (several_runs.py)
    parity = {"MULTI_GPU": PARITY_DEFECT_RUNS, "DEEPSPEED": PARITY_SHADOW_RUNS}  # test_parity_runs' own, in place
    launches = [tuple(run for name in ("MULTI_GPU", "FSDP", "DEEPSPEED")
                      for run in [*in_order(families.pop(name)), *parity.get(name, ())])]
    assert not families, f"a family of accelerate configs no launch trains: {families}"
    launches.append(tuple((c, "moe_qwen3", 0, 1, MOE_FLAGS) for c in MOE_CONFIGS))
    small_buckets = tuple((c, "peak_llama", 0, 1, small_bucket_flags(c)) for c in SMALL_BUCKET_RUNS)
    for kind in ("deepspeed", "fsdp"):
        launches.append(tuple((c.name, strategy_model_for(c.name), 0, 1, ()) for c in shipped_configs()
                              if c.kind == kind and not c.multinode) + (small_buckets if kind == "deepspeed" else ()))
    return launches


WORKER = ROOT / "tests" / "workers" / "train_tiny.py"
COMMON = ("--max_steps", 3, "--logging_steps", 1, "--per_device_train_batch_size", 2, "--report_to", "none",
          "--save_strategy", "no")
LAUNCHERS = {"accelerate": "accelerate", "deepspeed": "deepspeed", "fsdp": "torchrun"}  # a config kind: its launcher


def run_name(key: tuple, stem: str) -> str:
    """A run's folder: its config file's stem, model, LoRA rank, accumulation and flags (a long one, an inline JSON,
    by its digest)."""
    _, model, lora_r, grad_accum, flags = key
    suffix = "".join(map(str, flags)).replace("-", "_")
    suffix = suffix if len(suffix) < 120 else "-" + hashlib.sha1(suffix.encode()).hexdigest()[:12]
    return f"{stem}-{model}-lora{lora_r}-accum{grad_accum}{suffix}"


@pytest.fixture(scope="session")
def strategy_runs(strategy_model, tmp_path_factory):
    """Train tests/workers/train_tiny.py for 3 steps on 2 CPU ranks under a shipped config, through the
    launcher that config is for (accelerate yaml: `accelerate launch`; DeepSpeed JSON: `deepspeed`;
    fsdp JSON: `torchrun` with the Trainer's own fsdp arguments), with `flags` (train_tiny.py arguments after the
    common ones: a repeated one overrides). Once per (config, model, lora_r, grad_accum, flags), in one launch with
    the runs shared_launches() puts beside it; returns (profiler summary, [independent count per rank], the run's
    folder)."""
    from shardscope.configs.catalog import find_config

    def launch(keys):
        shipped = {key: find_config(key[0]) for key in keys}
        kinds = {s.kind for s in shipped.values()}
        assert len(kinds) == 1, keys
        kind, names, runs = kinds.pop(), {}, []
        for key, config in shipped.items():
            _, model, lora_r, grad_accum, flags = key
            names[key] = run_name(key, config.path.stem)
            runs.append((names[key], config.path if kind == "accelerate" else None, WORKER, [
                *COMMON, "--model", strategy_model(model), "--lora_r", lora_r, "--gradient_accumulation_steps",
                grad_accum, *{"accelerate": ["--use_cpu"], "deepspeed": ["--deepspeed", config.path],
                              "fsdp": ["--use_cpu", "--fsdp", "--fsdp_config", config.path]}[kind], *flags,
                *parity_flags(model, lora_r, grad_accum, flags)]))
        launched = launch_together(runs, tmp_path_factory.mktemp("launch"), LAUNCHERS[kind])
        results = {}
        for key, name in names.items():
            folder = launched[name].check().output_dir
            summary = json.loads((folder / "shardscope_summary.json").read_text())
            independent = [json.loads((folder / f"independent_count_rank{r}.json").read_text()) for r in range(2)]
            results[key] = summary, independent, folder
        return results

    launches = SharedLaunches(shared_launches(), launch)

    def run(config, model="shard_llama", lora_r=0, grad_accum=1, flags=()):
        return launches((config, model, lora_r, grad_accum, tuple(flags)))

    return run


@pytest.fixture(scope="session")
def strategy_plans(strategy_runs, tmp_path_factory):
    """`strategy_plans(config, model, grad_accum)`: (summary, `report.plan_vs_run` of it, what `plan --against`
    prints) of a `strategy_runs` run, planned once however many tests read it."""
    from shardscope import plan_vs_run

    cache = {}

    def plan(config, model="shard_llama", grad_accum=1):
        key = (config, model, grad_accum)
        if key not in cache:
            summary, _, _ = strategy_runs(config, model, grad_accum=grad_accum)
            path = tmp_path_factory.mktemp(f"plan-{config.replace('/', '_')}-{model}-accum{grad_accum}") / "summary.json"
            path.write_text(json.dumps(summary))
            cache[key] = summary, plan_vs_run(path)
        return cache[key]

    return plan


@pytest.fixture(scope="session")
def parameter_shapes(strategy_model):
    """Shape of every parameter tensor of a STRATEGY_MODELS model (built, not launched)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageClassification

    def sizes(name):
        auto = AutoModelForImageClassification if STRATEGY_MODELS[name][0] == "dinov2" else AutoModelForCausalLM
        return [tuple(p.shape) for p in auto.from_pretrained(strategy_model(name)).parameters()]

    return sizes
