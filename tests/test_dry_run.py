"""`shardscope plan --dry-run`: real FSDP2 `fully_shard` on the meta device under torch's fake process group.

The fake backend is internal torch API (torch.testing._internal.distributed.fake_pg): the first test pins
what the dry run relies on, so a torch upgrade that moves it fails here, by name.
"""
import math
import os
import subprocess
import sys

import psutil
import pytest

from shardscope.plan import dry_run as dr
from shardscope.cli import main
from shardscope.plan.formulas import strategy_row
from shardscope.plan.mesh import Setup, setup_for_mesh
from shardscope.model.spec import load_model_config as load_config, model_spec

MODELS = ("llama-2-7b", "mistral-7b", "llama-2-70b")
WORLD_SIZES = (8, 64, 512)


def test_fake_process_group_api_is_where_the_dry_run_expects_it():
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=64)
    try:
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (5, 64, "fake")
        t = torch.ones(3)
        dist.all_reduce(t)  # a no-op: nothing is sent, the value is untouched
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def configs():
    return {name: load_config(name) for name in MODELS}


@pytest.fixture(scope="module")
def specs(configs):
    return {name: model_spec(config) for name, config in configs.items()}


def test_shipped_models_at_8_64_512_ranks_no_memory_and_equal_to_the_formula(configs, specs):
    # How long each takes is benchmarks/dry_run_speed.py's question (a wall-clock limit here failed under load).
    dr.dry_run(configs["llama-2-7b"], "fsdp_full_shard", 8)  # warm-up: imports and model classes
    process = psutil.Process()
    for name in MODELS:
        spec = specs[name]
        for world in WORLD_SIZES:
            rss = process.memory_info().rss
            result = dr.dry_run(configs[name], "fsdp_full_shard", world)
            # No parameter memory: a fp32 shard of even the 7B model on 64 ranks is 420 MB.
            assert process.memory_info().rss - rss < 150e6, (name, world)
            assert result.computed_matches_built and [r.rank for r in result.ranks if r.built] == [0, world - 1]
            assert len(result.ranks) == world
            # Every element is owned by exactly one rank (no double counting, nothing lost).
            assert sum(r.params_elements for r in result.ranks) == spec.params_total
            row = strategy_row("fsdp_full_shard", spec, Setup(gpus_per_node=world))
            # The padded storage is the same on every rank and is exactly the formula's s(P) (rows rounded up).
            assert {r.params_bytes for r in result.ranks} == {row.params_bytes}
            assert {r.grads_bytes for r in result.ranks} == {row.grads_bytes}
            # AdamW moments follow the unpadded local shard: rank 0 (a full chunk of every tensor) equals
            # the formula, which books the padded shard; ranks past the end of an uneven tensor hold less.
            assert result.ranks[0].optimizer_bytes == row.optimizer_bytes
            tensors = spec.num_tensors
            for r in result.ranks:
                assert r.optimizer_bytes == 8 * r.params_elements + 4 * tensors
            lightest = min(r.optimizer_bytes for r in result.ranks)
            compare = dr.compare_rows(result, spec, Setup(gpus_per_node=world))
            assert compare["ranks"]["max"]["rel_diff"] == {k: 0.0 for k in compare["planned"]}
            if world == 512:
                # vocab 32000 = 62.5 x 512: 63-row chunks end at rank 507, so ranks 508-511 own no embedding or
                # lm_head rows (2 tensors x 63 rows x hidden); Llama-2-7B's MLP width 11008 = 21.5 x 512 also
                # leaves ranks 501-511 without gate/up rows (2 x 32 layers x 22 rows x 4096). 8 B per element.
                missing = 2 * 63 * spec.hidden_size + (2 * 32 * 22 * 4096 if name == "llama-2-7b" else 0)
                assert row.optimizer_bytes - lightest == 8 * missing
                assert [r.rank for r in result.ranks if r.optimizer_bytes == lightest] == [508, 509, 510, 511]
            else:  # every dimension divides: all ranks equal, the formula within 0%
                assert lightest == row.optimizer_bytes


def test_hybrid_shard_mesh_shards_over_a_node_and_agrees_with_the_formula(configs, specs):
    result = dr.dry_run(configs["mistral-7b"], "fsdp_hybrid_shard", 64, nodes=8)
    assert result.mesh == (8, 8) and result.shard_degree == 8
    row = strategy_row("fsdp_hybrid_shard", specs["mistral-7b"], Setup(gpus_per_node=8, nodes=8))
    assert {r.params_bytes for r in result.ranks} == {row.params_bytes}
    assert {r.optimizer_bytes for r in result.ranks} == {row.optimizer_bytes}
    # Replicated across nodes: each element is owned once per node, so 8 times in all.
    assert sum(r.params_elements for r in result.ranks) == 8 * specs["mistral-7b"].params_total
    assert result.computed_matches_built


def test_cli_dry_run_prints_rows_beside_the_formula_and_says_zero3_is_not_dry_run(capsys):
    import json

    # --tp 1: no tensor-parallel rows (they are in test_tp_dry_run_cli_on_a_tiny_model below)
    assert main(["plan", "--model", "llama-2-7b", "--dry-run", "--gpus", "4", "--nodes", "2", "--tp", "1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    by_name = {r["strategy"]: r for r in out["results"]}
    assert list(by_name) == ["fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard", "zero3"]
    assert by_name["fsdp_full_shard"]["shard_degree"] == 8 and by_name["fsdp_hybrid_shard"]["shard_degree"] == 4
    for name in ("fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard"):
        assert by_name[name]["ranks"]["max"]["rel_diff"]["model_states_bytes"] == 0.0
        assert by_name[name]["mesh"] == ([2, 4] if name == "fsdp_hybrid_shard" else [8])
    # SHARD_GRAD_OP differs from FULL_SHARD only while a step runs: the steady-state shards are the same.
    assert by_name["fsdp_shard_grad_op"]["per_rank"] == by_name["fsdp_full_shard"]["per_rank"]
    assert by_name["zero3"]["dry_run"] is None and "not dry-run" in by_name["zero3"]["note"]
    assert main(["plan", "--model", "mistral-7b", "--dry-run", "--world-size", "8", "--strategy", "zero3",
                 "--strategy", "fsdp_full_shard"]) == 0
    text = capsys.readouterr().out
    assert "fsdp_full_shard formula" in text and "dry run max: rank 0 (built)" in text
    assert "zero3 dry run" in text and "no meta-device/fake-process-group path" in text


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "10", "--nodes", "4"], "world size 10 does not divide into 4 nodes"),
    (["--world-size", "8", "--gpus", "3", "--nodes", "2"], "--world-size 8 disagrees with --gpus 3 x --nodes 2"),
])
def test_world_size_that_does_not_fit_the_mesh_is_one_line_exit_2(argv, message):
    """Refused before torch or transformers is imported (how long that takes: benchmarks/failure_speed.py)."""
    code = ("import sys; from shardscope.cli import main; code = main(sys.argv[1:]); "
            "print('HEAVY', sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", code, "plan", "--model", "llama-2-7b", "--dry-run", *argv],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 2 and proc.stdout == "HEAVY []\n"  # the command itself printed nothing
    assert proc.stderr.strip().splitlines() == [f"shardscope: error: {proc.stderr.split('error: ', 1)[1].strip()}"]
    assert message in proc.stderr


# ----------------------------------------------------------------------------- tensor parallel (transformers)
def _tiny_config(family):
    """Tiny Llama / Mistral whose vocabularies split unevenly under TP 2 then FSDP 2 (502 -> 251 -> 126 + 125)."""
    from transformers import LlamaConfig, MistralConfig

    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    if family == "llama":
        return LlamaConfig(vocab_size=502, **sizes)
    return MistralConfig(vocab_size=510, num_key_value_heads=2, **sizes)


def _expected_rank(config, mesh, rank):
    """Independent oracle, from the config's shapes and the Llama/Mistral TP plan written out by hand:
    q/k/v/gate/up, embed_tokens (embedding_rowwise) and lm_head (colwise_gather_output) split dim 0 over tp,
    o/down (rowwise) dim 1, norms whole; then FSDP2 chunks dim 0 of the TP shard over dp_shard, padded to
    the first chunk. TP alone: the embedding's gradient is whole (DTensor returns it Replicate).
    Returns (params, grads, optimizer) bytes in fp32 with AdamW (2 moments of the unpadded shard + 4 B step)."""
    r, s, t = mesh
    tp, shard = rank % t, (rank // t) % s
    h, i, V, L = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    hd = h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    layer = [((q, h), 0), ((kv, h), 0), ((kv, h), 0), ((h, q), 1), ((i, h), 0), ((i, h), 0), ((h, i), 1),
             ((h,), None), ((h,), None)]
    tensors = [((V, h), 0)] + layer * L + [((h,), None), ((V, h), 0)]

    def cut(n, parts, index):
        k = math.ceil(n / parts)
        return max(0, min(k, n - index * k)), k

    params = grads = optim = 0
    for number, (shape, dim) in enumerate(tensors):
        local = list(shape)
        if dim is not None:
            local[dim] = cut(local[dim], t, tp)[0]
        rest = math.prod(local[1:])
        held, padded = cut(local[0], s, shard) if r * s > 1 else (local[0], local[0])
        params += 4 * padded * rest
        grads += 4 * (math.prod(shape) if (r * s == 1 and number == 0) else padded * rest)
        optim += 8 * held * rest + 4
    return params, grads, optim


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("strategy, mesh", [("tp", (1, 1, 2)), ("fsdp_tp", (1, 2, 2)), ("hsdp_tp", (2, 2, 2))])
def test_tp_planner_equals_transformers_sharding_on_every_rank(family, strategy, mesh):
    """Planner formula == transformers' own TP + FSDP2 (maybe_distribute_model) on the fake process group ==
    the hand oracle, for the built ranks and for every computed rank."""
    config = _tiny_config(family)
    r, s, t = mesh
    world = r * s * t
    result = dr.dry_run(config, strategy, world, nodes=r, precision="fp32", tp=t)
    assert result.mesh == mesh and result.mesh_dim_names == ("dp_replicate", "fsdp", "tp")
    assert result.computed_matches_built and [x.rank for x in result.ranks if x.built] == [0, world - 1]
    for rank in result.ranks:
        assert (rank.params_bytes, rank.grads_bytes, rank.optimizer_bytes) == _expected_rank(config, mesh, rank.rank)
    spec = model_spec(config)
    _, setup = setup_for_mesh(Setup(precision="fp32"), {"dp_replicate": r, "dp_shard": s, "tp": t})
    row = strategy_row(strategy, spec, setup)
    assert row.mesh.as_dict() == {"dp_replicate": r, "dp_shard": s, "tp": t}
    heaviest = result.ranks[0]
    assert (row.params_bytes, row.grads_bytes, row.optimizer_bytes) == (
        heaviest.params_bytes, heaviest.grads_bytes, heaviest.optimizer_bytes)
    # Each element once per TP group and replica, except the norms, whole on each of the t TP ranks.
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size
    assert sum(x.params_elements for x in result.ranks) == r * (spec.params_total + (t - 1) * norms)


def test_tp_dry_run_of_70b_on_64_ranks_equals_the_formula_without_parameter_memory(configs, specs):
    # How long it takes is benchmarks/dry_run_speed.py's question, not a unit test's.
    process = psutil.Process()
    for strategy, nodes, mesh in (("fsdp_tp", 8, (1, 8, 8)), ("hsdp_tp", 8, (8, 1, 8))):
        rss = process.memory_info().rss
        result = dr.dry_run(configs["llama-2-70b"], strategy, 64, nodes=nodes, tp=8)
        assert process.memory_info().rss - rss < 300e6, strategy  # a fp32 64th of 70B is 4.3 GB
        assert result.mesh == mesh and result.computed_matches_built and len(result.ranks) == 64
        compare = dr.compare_rows(result, specs["llama-2-70b"], Setup())
        assert compare["ranks"]["max"]["rel_diff"] == {k: 0.0 for k in compare["planned"]}


def test_tp_dry_run_cli_on_a_tiny_model(tiny_llama, capsys):
    import json

    assert main(["plan", "--model", str(tiny_llama), "--dry-run", "--gpus", "2", "--nodes", "2", "--tp", "2",
                 "--strategy", "tp", "--strategy", "fsdp_tp", "--strategy", "hsdp_tp", "--json"]) == 0
    by_name = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert {n: (r["world_size"], r["mesh"]) for n, r in by_name.items()} == {
        "tp": (2, [1, 1, 2]), "fsdp_tp": (4, [1, 2, 2]), "hsdp_tp": (4, [2, 1, 2])}
    for r in by_name.values():
        assert r["computed_matches_built"] and r["ranks"]["max"]["rel_diff"]["model_states_bytes"] == 0.0
    assert main(["plan", "--model", str(tiny_llama), "--dry-run", "--gpus", "4", "--strategy", "fsdp_tp"]) == 0
    assert "transformers' maybe_distribute_model" in capsys.readouterr().out


def test_tp_dry_run_of_a_model_with_tied_embeddings_is_built_as_from_pretrained_builds_it(tmp_path, capsys):
    """tie_word_embeddings (Qwen2.5-0.5B, Gemma, Llama-3.2): from_pretrained distributes the weights, then ties them;
    the head's colwise shard is the embedding's, and its gradient (the head's Shard(0) plus the embedding's) stays a
    shard. Distributing a tied model instead fails inside transformers (KeyError 'lm_head.weight')."""
    import json

    from shardscope.recipes.tiny import make_causal_lm

    make_causal_lm(tmp_path / "tied", "llama", tie_word_embeddings=True)
    assert main(["plan", "--model", str(tmp_path / "tied"), "--dry-run", "--gpus", "2", "--strategy", "tp",
                 "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["computed_matches_built"] and row["ranks"]["max"]["rel_diff"] == dict.fromkeys(
        ("params_bytes", "grads_bytes", "optimizer_bytes", "model_states_bytes"), 0.0)


def test_a_strategy_transformers_refuses_is_a_row_that_says_so(tiny_llama, monkeypatch, capsys):
    """transformers' own sharding code failing on a model is that strategy's note; the other rows are built."""
    from transformers import PreTrainedModel

    def refuse(*_, **__):
        raise KeyError("lm_head.weight")

    monkeypatch.setattr(PreTrainedModel, "maybe_distribute_model", classmethod(refuse))
    monkeypatch.setenv("SHARDSCOPE_CACHE", "off")
    assert main(["plan", "--model", str(tiny_llama), "--dry-run", "--gpus", "2", "--strategy", "tp",
                 "--strategy", "fsdp_full_shard"]) == 0
    out = capsys.readouterr().out
    assert "tp dry run" in out and "could not apply its tensor-parallel plan to this model (KeyError: " \
        "'lm_head.weight')" in out
    assert "dry run max: rank 0 (built)" in out  # fsdp_full_shard's row


@pytest.mark.parametrize("strategy, world, nodes, tp, message", [
    ("fsdp_tp", 6, 1, 3, "--tp 3 must divide num_attention_heads (4) and num_key_value_heads (2)"),
    ("fsdp_tp", 4, 2, 4, "--tp 4 must divide the GPUs per node (--gpus 2)"),
    ("tp", 4, 1, 2, "tensor parallelism alone runs on --tp ranks of one node"),
])
def test_tp_dry_run_bad_degree_is_one_line(strategy, world, nodes, tp, message):
    from shardscope.errors import UsageError

    with pytest.raises(UsageError) as error:
        dr.dry_run(_tiny_config("mistral"), strategy, world, nodes=nodes, tp=tp)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("strategy, world, nodes", [("fsdp_full_shard", 6, 1), ("fsdp_hybrid_shard", 4, 2),
                                                    ("tp", 2, 1), ("fsdp_tp", 4, 1), ("hsdp_tp", 8, 2)])
def test_one_decoder_layer_standing_for_all_counts_what_the_whole_model_does(strategy, world, nodes):
    """The dry run shards one decoder layer and counts it once per layer: every rank of the whole model,
    sharded the same way, holds the same bytes (an uneven vocabulary and three layers, so padding shows)."""
    import torch

    from shardscope.model.spec import meta_model

    config = _tiny_config("mistral")
    config.num_hidden_layers = 3
    stand_in = dr.one_layer_model(config, torch.float32)
    assert stand_in[1:] == ("model.layers", 3) and len(stand_in[0].model.layers) == 1
    whole = (meta_model(config).to(torch.float32), None, 1)
    if strategy in dr.TP_STRATEGIES:
        mesh = dr.tp_mesh_shape(config, strategy, world, nodes, 2)
    else:
        mesh = (nodes, world // nodes) if strategy == "fsdp_hybrid_shard" else (world,)
    for rank in range(world):
        one, layouts, _ = dr._build_rank(stand_in, config, strategy, rank, mesh, 2)
        assert one == dr._build_rank(whole, config, strategy, rank, mesh, 2)[0], rank
        assert sum(layout[-1] for layout in layouts) == 9 * 3 + 3  # tensors: 9 per layer, embedding, norm, head


def test_decoder_layers_that_differ_are_all_built():
    """Qwen2-MoE with `mlp_only_layers=[0]`: the first layer's MLP is dense, the others' are experts, so no
    layer stands for the rest."""
    import torch
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, mlp_only_layers=[0])
    model, layer_list, layers = dr.one_layer_model(config, torch.float32)
    assert (layer_list, layers, len(model.model.layers)) == (None, 1, 3)
    result = dr.dry_run(config, "fsdp_full_shard", 4, precision="fp32")
    assert result.computed_matches_built
    assert sum(r.params_elements for r in result.ranks) == model_spec(config).params_total


# ----------------------------------------------------------------------------- the cache
RUN = """import json, sys
from shardscope.plan.dry_run import dry_run_all
from shardscope.plan.mesh import Setup
out = dry_run_all(sys.argv[1], None, 4, 2, Setup(gpus_per_node=2, nodes=2, tp_size=2))
files = sorted({m.__file__ for n, m in list(sys.modules.items()) if n.startswith("shardscope.") and m.__file__})
print(json.dumps({"out": out, "files": files, "heavy": [n for n in ("torch", "transformers") if n in sys.modules]}))
"""


def test_a_warm_dry_run_gives_the_same_rows_importing_neither_torch_nor_transformers(tiny_llama, tmp_path):
    """The second identical dry run reads the first's rows from the cache: the same rows, no torch; the key
    hashes the source of every module of the package the cold run used (so an edit to any of them is a miss)."""
    import json

    env = {**os.environ, "SHARDSCOPE_CACHE": str(tmp_path)}
    cold, warm = (json.loads(subprocess.run([sys.executable, "-c", RUN, str(tiny_llama)], capture_output=True,
                                            text=True, env=env, timeout=300, check=True).stdout) for _ in range(2))
    assert [r["strategy"] for r in cold["out"]["results"]] == [
        "fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard", "tp", "fsdp_tp", "hsdp_tp", "zero3"]
    assert warm["out"] == cold["out"]
    assert cold["heavy"] == ["torch", "transformers"] and warm["heavy"] == []
    package = os.path.dirname(os.path.dirname(dr.__file__))
    used = {os.path.relpath(f, package) for f in cold["files"]}
    # the package's own import (its lazy names, and notices.py's logging filter) computes no row
    assert used - {"__init__.py", "notices.py"} <= set(dr.dry_run_sources())


@pytest.mark.parametrize("strategy", ["fsdp_full_shard", "tp"])
def test_moe_dry_run_runs_its_fused_experts_on_meta_and_equals_the_formula(strategy, tmp_path, capsys):
    """transformers' fused experts call grouped_mm, whose meta kernel takes bf16 only (torch 2.13): the dry run's meta
    backward runs them with transformers' batched_mm instead (same parameters, same gradient layout); under tp,
    transformers 5.24's plan splits Qwen3-MoE's experts."""
    import json

    from shardscope.recipes.tiny import make_causal_lm

    make_causal_lm(tmp_path / "moe", "qwen3_moe")
    capsys.readouterr()  # what building it printed (DeepSpeed's accelerator notice, when it is imported first here)
    assert main(["plan", "--model", str(tmp_path / "moe"), "--dry-run", "--gpus", "2", "--strategy", strategy,
                 "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["computed_matches_built"] and row["ranks"]["max"]["rel_diff"] == dict.fromkeys(
        ("params_bytes", "grads_bytes", "optimizer_bytes", "model_states_bytes"), 0.0)
