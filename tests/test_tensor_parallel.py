"""Tensor parallelism and FSDP2 x TP through the SFT recipe, for real: `accelerate launch` with the shipped
tp.yaml (TP=2 on 2 ranks, Llama) and fsdp_tp.yaml (2 shards x TP=2 on 4 ranks, Mistral), each checked
against a single-process run of the same recipe, model and data with the same global batch.

The launcher overrides only the process count and the mesh degrees (`--parallelism_config_*`), as a user
shrinking the 8-GPU configs would. On CPU, accelerate refuses a parallelism config outright; the test
shim (cpu_shim/sitecustomize.py, item 3) lifts that one check.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch

from launch import ROOT, accelerate_launch, cpu_env
from recipe_checks import losses, reload_logits
from shardscope.measure.parity_record import PARITY_ENV

SFT = ROOT / "recipes" / "causal_lm_sft.py"
STEPS = 6
# name -> (config, family, processes, mesh, per-device batch); global batch 8 in both runs
RUNS = {
    "tp": ("tp", "llama", 2, {"dp_replicate": 1, "dp_shard": 1, "tp": 2}, 8),
    "fsdp_tp": ("fsdp_tp", "mistral", 4, {"dp_replicate": 1, "dp_shard": 2, "tp": 2}, 4),
    # the smallest layout with hsdp_tp's shape: 2 replicas x 2 shards x TP 2 (the shipped 2 nodes x 8 GPUs halved)
    "hsdp_tp": ("hsdp_tp", "mistral", 8, {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, 2),
}
GLOBAL_BATCH = 8
# every run records parity fingerprints (the environment `shardscope parity` sets; the reference already trains the
# global batch in one process): test_parity_equals_one_process compares them
PARITY = {PARITY_ENV: "parity"}
TP_SHARDED_DIM = {"colwise": 0, "colwise_gather_output": 0, "embedding_rowwise": 0, "rowwise": 1}


@pytest.fixture(scope="module")
def assets(sft_assets, tmp_path_factory):
    from shardscope.recipes.tiny import make_sft_assets

    return {"llama": sft_assets, "mistral": make_sft_assets(tmp_path_factory.mktemp("sft_mistral"), "mistral", n=256)}


def recipe_args(assets, family, batch, *extra):
    return ["--config", ROOT / "recipes/llama/demo_tiny.yaml", "--model_name_or_path", assets[family]["model"],
            "--dataset", assets[family]["data"], "--max_steps", STEPS, "--per_device_train_batch_size", batch, *extra]


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """`runs(name)`: the launched TP run; `runs(family)`: the single-process reference. Each starts once."""
    cache = {}

    def get(name):
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            if name in RUNS:
                config, family, processes, mesh, batch = RUNS[name]
                launcher = [arg for key in mesh for arg in (f"--parallelism_config_{key}_size", mesh[key])]
                accelerate_launch(ROOT / "accelerate_configs" / f"{config}.yaml", SFT,
                                  recipe_args(assets, family, batch, "--save_final_logits", "true"), out,
                                  num_processes=processes, launcher_args=launcher, env=PARITY).check()
            else:  # plain `python recipe.py`: one process, no launcher, the whole global batch
                proc = subprocess.run([sys.executable, str(SFT), *map(str, recipe_args(assets, name, GLOBAL_BATCH)),
                                       "--output_dir", str(out)],
                                      capture_output=True, text=True, env=cpu_env(**PARITY), timeout=300)
                assert proc.returncode == 0, proc.stderr[-4000:]
            cache[name] = out
        return cache[name]

    return get


def expected_local_elements(model_dir, mesh) -> tuple[int, list[int], int]:
    """(elements per rank, each tensor's local elements, embedding elements whole) under `mesh`, from the
    model's TP plan: a planned Linear/Embedding splits its sharded dim over tp; FSDP2 then splits each
    TP piece's rows over dp_shard. The test models divide evenly, so every rank holds the same."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    plan = {re.compile(key.replace(".", r"\.").replace("*", r"\d+")): style for key, style in model.tp_plan.items()}
    locals_ = []
    for name, param in model.named_parameters():
        module, kind = name.rsplit(".", 1)
        style = next((s for key, s in plan.items() if key.fullmatch(module)), None)
        dim = TP_SHARDED_DIM.get(style) if kind == "weight" else None
        shape = list(param.shape)
        if dim is not None:
            assert shape[dim] % mesh["tp"] == 0
            shape[dim] //= mesh["tp"]
        assert shape[0] % mesh["dp_shard"] == 0
        shape[0] //= mesh["dp_shard"]
        locals_.append(math.prod(shape))
    return sum(locals_), locals_, model.get_input_embeddings().weight.numel()


@pytest.mark.launch
@pytest.mark.parametrize("name", list(RUNS))
def test_losses_equal_a_single_process_run(runs, name):
    family = RUNS[name][1]
    parallel, single = losses(runs(name)), losses(runs(family))
    assert sorted(parallel) == sorted(single) == list(range(1, STEPS + 1))
    assert [parallel[s] for s in parallel] == pytest.approx([single[s] for s in parallel], rel=1e-5)
    assert parallel[STEPS] < parallel[1] - 0.5  # and it learned


@pytest.mark.launch
@pytest.mark.parametrize("name", list(RUNS))
def test_parity_equals_one_process(runs, name):
    """`shardscope parity`'s comparison of the fingerprints: equal at the summation-order tolerance, said to be so."""
    from shardscope.parity.compare import TOLERANCE, compare

    def records(folder, ranks):
        return [json.loads((folder / "parity" / f"rank{r}.json").read_text()) for r in range(ranks)]

    _, family, processes, _, _ = RUNS[name]
    launched = records(runs(name), processes)
    result = compare(launched, records(runs(family), 1)[0])
    assert result.verdict == "equal" and result.tolerance == TOLERANCE["fp32"], (result.sentence(), result.notes)
    assert [row["step"] for row in result.steps] == list(range(1, STEPS + 1))
    assert "no one process repeats its arithmetic exactly" in result.notes[0]
    step = launched[0]["steps"][1]  # what was compared is there: samples, module outputs, gradients
    assert step["samples"][0] and step["forward"] and step["grads"], step["samples"]


@pytest.mark.launch
@pytest.mark.parametrize("name", list(RUNS))
def test_per_rank_bytes_follow_the_mesh(runs, assets, name):
    _, family, processes, mesh, _ = RUNS[name]
    summary = json.loads((runs(name) / "shardscope_summary.json").read_text())
    assert summary["strategy"] == name and summary["mesh"] == mesh and summary["world_size"] == processes
    elements, tensors, embedding = expected_local_elements(assets[family]["model"], mesh)
    # the whole model would be 4 x the parameter count; each rank holds ~1/(tp x shard) of it
    assert 4 * elements < 1.1 * 4 * summary["model"]["params_total"] / (mesh["tp"] * mesh["dp_shard"])
    # Under TP alone the embedding's gradient comes back Replicate (the whole vocabulary on every rank,
    # torch's DTensor embedding backward); FSDP2 reduce-scatters it into the shard under FSDP x TP.
    extra_grad = embedding - embedding // mesh["tp"] if mesh["dp_shard"] == 1 else 0
    assert len(summary["ranks"]) == processes
    for rank in summary["ranks"]:
        assert rank["params_bytes"] == 4 * elements
        assert rank["grads_bytes"] == 4 * (elements + extra_grad)
        assert rank["optimizer_bytes"] == 2 * 4 * elements + 4 * len(tensors)  # AdamW moments + fp32 step


@pytest.mark.launch
@pytest.mark.parametrize("name", list(RUNS))
def test_planner_rows_equal_the_measured_bytes(runs, name):
    """`shardscope plan --against`: the tp / fsdp_tp row for the summary's mesh, against every rank."""
    from shardscope import plan_vs_run as compare

    result = compare(runs(name) / "shardscope_summary.json")
    assert result["strategy"] == name and len(result["ranks"]) == RUNS[name][2]
    for rank in result["ranks"]:
        components = {c["component"]: c for c in rank["components"]}
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert components[key]["planned"] == components[key]["measured"], (rank["rank"], key)


@pytest.mark.launch
def test_planned_tp_communication_matches_counted_collectives(runs):
    """The planner's TP terms for the counted step's own tokens (batch x padded length: the recipe pads each
    batch to its longest example) against the all-reduces and the logits all-gather each rank issued."""
    from dataclasses import replace

    from shardscope import plan_vs_run as compare
    from shardscope.plan.mesh import Setup

    summary = json.loads((runs("tp") / "shardscope_summary.json").read_text())
    tokens = summary["ranks"][0]["comm_padded_tokens"]
    result = compare(runs("tp") / "shardscope_summary.json", setup=replace(Setup(), micro_batch=1, seq_len=tokens))
    planned = result["planned_comm"]
    for rank in summary["ranks"]:
        assert rank["comm_padded_tokens"] == tokens  # a TP group shares its batch
        sent = {kind: rank["comm"].get(kind, {}).get("sent_bytes", 0) for kind in ("all_reduce", "all_gather")}
        assert sent["all_reduce"] == pytest.approx(planned["tp_all_reduce"], rel=0.05), (rank["comm"], planned)
        assert sent["all_gather"] == pytest.approx(planned["tp_logits_all_gather"], rel=0.05), (rank["comm"], planned)


@pytest.mark.launch
@pytest.mark.parametrize("name", list(RUNS))
def test_saved_model_reloads_with_from_pretrained(runs, name):
    reloaded, trained = reload_logits(runs(name))
    torch.testing.assert_close(reloaded, trained, rtol=1e-4, atol=1e-4)


@pytest.mark.launch
def test_throughput_counts_each_replica_once(runs):
    """The ranks of a TP group share one batch: global tokens/s = sum over ranks / tp, in the logs and
    in `shardscope report`."""
    from shardscope.report.compare import load_run

    for name, (_, _, processes, mesh, _) in RUNS.items():
        summary = json.loads((runs(name) / "shardscope_summary.json").read_text())
        row = load_run(runs(name))
        for key in ("tokens_per_s", "samples_per_s"):
            per_rank = [rank["throughput"][key] for rank in summary["ranks"]]
            assert row[key] == pytest.approx(sum(per_rank) / mesh["tp"])
        history = json.loads((runs(name) / "trainer_state.json").read_text())["log_history"]
        logged = [entry for entry in history if "shardscope/tokens_per_s" in entry]
        assert logged
        for entry in logged:
            per_device = float(entry["shardscope/tokens_per_s_per_device_mean"])
            assert float(entry["shardscope/tokens_per_s"]) == pytest.approx(per_device * processes / mesh["tp"],
                                                                             rel=1e-3)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("env, tp_size, message", [
    ({"WORLD_SIZE": "4"}, 4, "tp_size 4 must divide the attention heads of 'M' (num_attention_heads 4, "
                             "num_key_value_heads 2)"),
    ({"WORLD_SIZE": "2"}, 4, "tp_size 4 x dp_replicate_size 1 does not divide the 2 processes"),
    ({"WORLD_SIZE": "4", "PARALLELISM_CONFIG_TP_SIZE": "4"}, 2,
     "--tp_size 2 disagrees with the launcher config's parallelism_config_tp_size 4"),
    ({"WORLD_SIZE": "8", "PARALLELISM_CONFIG_TP_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"}, None,
     "dp_replicate_size 1 x dp_shard_size 2 x tp_size 2 = 4, but the launcher started 8 processes"),
    ({"WORLD_SIZE": "2", "ACCELERATE_USE_FSDP": "true"}, 2, "tensor parallelism was asked for under an FSDP"),
])
def test_bad_mesh_is_one_clear_error(monkeypatch, env, tp_size, message):
    from transformers import MistralConfig

    from shardscope.errors import UsageError
    from shardscope.recipes.tp import MESH_ENV, tensor_parallel_mesh

    for var in [*MESH_ENV.values(), "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"]:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    config = MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(UsageError) as error:
        tensor_parallel_mesh(config, "M", tp_size)
    assert message in str(error.value)


def test_bad_tp_degree_stops_the_recipe_before_weights_load(assets):
    """What a rank of `torchrun --nproc_per_node 4 ... --tp_size 4` sees with a 2-KV-head model."""
    proc = subprocess.run([sys.executable, str(SFT), *map(str, recipe_args(assets, "mistral", 1)), "--tp_size", "4",
                           "--output_dir", "unused"], capture_output=True, text=True,
                          env=cpu_env(WORLD_SIZE="4"), timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("causal_lm_sft.py: error:")]
    assert lines == [f"causal_lm_sft.py: error: tp_size 4 must divide the attention heads of "
                     f"'{assets['mistral']['model']}' (num_attention_heads 4, num_key_value_heads 2)"]
    assert "Loading weights" not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr
