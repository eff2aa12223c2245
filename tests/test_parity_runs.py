"""`shardscope parity` on real runs: every shipped single-node config that trains the tiny Llama on 2 CPU ranks
computes what one process computes; seeded defects in a user's Trainer script (tests/workers/train_tiny.py's
DefectiveTrainer) are diverged and localised; shadows of a shipped MoE and a shipped dense model are equal under
ZeRO-3; and the command end to end.

The launched runs are tests/strategy_runs.py's (they record parity fingerprints: strategy_runs.parity_flags; the
defects and shadows train in the same launches). Their references train together in one plain process
(tests/workers/several_runs.py, no launcher), each with the environment `shardscope parity` gives a reference.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launch import ROOT, SEVERAL_RUNS, cpu_env, shardscope_cli
from strategy_runs import COMMON, PARITY_FOLDER, SHADOWS, WORKER, strategy_model_for
from shardscope.configs.catalog import shipped_configs
from shardscope.measure.parity_record import WORLD_ENV
from shardscope.parity.compare import TOLERANCE, compare

pytestmark = pytest.mark.launch  # (the command's test launches without a launching fixture)

# the configs whose own strategy run trains the tiny Llama (tests/test_strategies.py's list, the Llama's part)
TENSOR_PARALLEL, SEQUENCE_SPLIT = {"tp", "fsdp_tp"}, {"zero3_sp", "fsdp_cp"}
LLAMA_CONFIGS = sorted(c.name for c in shipped_configs() if c.kind != "slurm" and not c.multinode and c.name not in
                       TENSOR_PARALLEL | SEQUENCE_SPLIT and strategy_model_for(c.name) == "shard_llama")
# reference name -> (model, gradient accumulation of the launched run, worker flags): the one-process runs
REFERENCES = {"clean": ("shard_llama", 1, ()), "same_batches": ("shard_llama", 1, ("--defect", "same_batches")),
              "accumulation_loss": ("shard_llama", 2, ("--defect", "accumulation_loss")),
              **{name: (name, 1, ()) for name in SHADOWS}}
# defect -> (its launched run's accumulation, its reference, where parity must say it first diverged:
# (step, phase, module, rank; None: every rank))
DEFECTS = {"same_batches": (1, "same_batches", (1, "data", None, 1)),
           "perturb_rank_1": (1, "clean", (1, "forward", "model.layers.1.mlp", 1)),  # inert on one process
           "accumulation_loss": (2, "accumulation_loss", (1, "forward", "loss", None))}


def records(folder, ranks: int) -> list[dict]:
    return [json.loads((folder / PARITY_FOLDER / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def references(strategy_model, tmp_path_factory):
    """{name: the one-process reference's record} of REFERENCES, trained in one process."""
    out = tmp_path_factory.mktemp("parity_references")
    args = []
    for name, (model, accum, flags) in REFERENCES.items():
        args += ["--run", name, WORKER, *COMMON, "--model", strategy_model(model), "--use_cpu",
                 "--gradient_accumulation_steps", accum, "--parity", PARITY_FOLDER, *flags]
    proc = subprocess.run([sys.executable, str(SEVERAL_RUNS), *map(str, args), "--output_dir", str(out)],
                          env=cpu_env(**{WORLD_ENV: "2"}), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: records(out / name, 1)[0] for name in REFERENCES}


@pytest.mark.parametrize("config", LLAMA_CONFIGS)
def test_every_shipped_config_computes_what_one_process_computes(strategy_runs, references, config):
    _, _, folder = strategy_runs(config)
    launched = records(folder, 2)
    result = compare(launched, references["clean"])
    assert result.tolerance == TOLERANCE["fp32"]
    assert result.verdict == "equal", (result.sentence(), result.notes)
    assert [row["step"] for row in result.steps] == [1, 2, 3]
    assert not [note for note in result.notes if "not recorded" in note]  # every parameter compared
    step = launched[0]["steps"][1]  # what was compared is there: samples, module outputs, updates
    assert step["samples"][0] and step["forward"] and step["update"], step["samples"]


@pytest.mark.parametrize("defect", DEFECTS)
def test_a_seeded_defect_is_diverged_and_localised(strategy_runs, references, defect):
    accum, reference, expected = DEFECTS[defect]
    _, _, folder = strategy_runs("ddp", grad_accum=accum, flags=("--defect", defect))
    result = compare(records(folder, 2), references[reference])
    found = result.first_divergence
    assert result.verdict == "diverged"
    assert (found.step, found.phase, found.module, found.rank) == expected, result.sentence()
    if defect == "accumulation_loss":  # divided again by the accumulation: the launched run's (2) over one's (4)
        assert found.ratio == pytest.approx(2, rel=TOLERANCE["fp32"])


@pytest.mark.parametrize("shadow", SHADOWS)
def test_a_shadow_of_a_shipped_model_is_equal_under_zero3(strategy_runs, references, shadow):
    _, _, folder = strategy_runs("zero3", shadow)
    launched = records(folder, 2)
    result = compare(launched, references[shadow])
    assert launched[0]["strategy"] == "zero3"
    assert result.verdict == "equal", (result.sentence(), result.notes)


def test_the_command_names_the_module_and_rank_of_a_shadow_perturbed_on_one_rank(tmp_path):
    """End to end: `shardscope parity` launches both runs of a shadow of a shipped 70B and localises the defect."""
    proc = shardscope_cli("parity", "--config", "ddp", "--script", WORKER, "--steps", 2, "--output-dir", tmp_path,
                          "--shadow-of", "llama-3-70b", "--json", "--", "--model", "{shadow}", *COMMON,
                          "--use_cpu", "--defect", "perturb_rank_1")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    rule = result["shadow"]["rule"]
    assert rule.startswith("llama: layers 80 -> 2") and "GQA ratio 8" in rule
    assert result["first_divergence"] == {**result["first_divergence"], "step": 1, "phase": "forward",
                                          "module": "model.layers.1.mlp", "rank": 1}
    assert [row["step"] for row in result["steps"]] == [1, 2] and result["tolerance"] == TOLERANCE["fp32"]
