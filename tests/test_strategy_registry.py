"""The strategy registry (strategy.py): every record has what each tool needs of it, strategy names are tested
nowhere else, and one simplicity order serves `recommend` and `fit`. A new record that lacks something fails
`test_record_has_what_every_tool_needs` with the list of what it lacks."""
import ast
import math
from pathlib import Path

import pytest

import shardscope
from shardscope.strategy import (RECORDS, STRATEGIES, family, simplicity_order, strategy_from_summary,
                                 strategy_of_config, tier)

PACKAGE = Path(shardscope.__file__).parent
GIB = 2 ** 30
# A run on which no record's mesh repeats a simpler one's: 2 nodes of 8 GPUs, TP 4 (hsdp_tp: 2 x 1 x 4 would not
# tell replicas from shards; tp alone spans the TP group of one node).
NODES, GPUS, TP = 2, 8, 4


def _prefix_tests(tree: ast.AST):
    """Every string a `.startswith(...)` call tests, with its line."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
            for arg in node.args:
                for const in ast.walk(arg):
                    if isinstance(const, ast.Constant) and isinstance(const.value, str):
                        yield node.lineno, const.value


# Prefixes of a strategy name that test something else: accelerate's fsdp_config keys ("fsdp_sharding_strategy").
NOT_A_STRATEGY = {("configs/accelerate.py", "fsdp_")}


def test_no_strategy_name_is_tested_by_its_prefix_outside_the_registry():
    """`startswith("zero3")` on a strategy name is what the registry's records replace (its zero_stage, family,
    sharding, offload): a prefix of any strategy's name, tested anywhere in the package but strategy.py, fails."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        if where == "strategy.py":
            continue
        for line, prefix in _prefix_tests(ast.parse(path.read_text())):
            if prefix and any(s.startswith(prefix) for s in STRATEGIES) and (where, prefix) not in NOT_A_STRATEGY:
                found.append(f"{where}:{line}: startswith({prefix!r})")
    assert found == []


def test_the_prefix_test_finds_a_strategy_prefix():
    tree = ast.parse('if name.startswith(("zero1", "zero2")):\n    pass\nok = path.startswith("ds/")')
    assert [p for _, p in _prefix_tests(tree) if any(s.startswith(p) for s in STRATEGIES)] == ["zero1", "zero2"]


# --- one simplicity order ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefer", ["fsdp", "deepspeed"])
def test_one_simplicity_order_ranks_every_strategy_once(prefer):
    order = simplicity_order(prefer)
    assert sorted(order) == sorted(STRATEGIES) and len(order) == len(set(order))
    for name in order:  # a tier: one way of each library to the same sharding, next to each other in the order
        same = tier(name)
        assert len({family(s) for s in same}) == len(same) and name in same
        places = sorted(order.index(s) for s in same)
        assert places == list(range(places[0], places[0] + len(same)))
        assert family(order[places[0]]) == prefer or len(same) == 1 or prefer not in {family(s) for s in same}


def test_the_order_is_the_decision_tree_and_places_zero1():
    """recommend's documented tree: DDP -> ZeRO-2/SHARD_GRAD_OP -> ZeRO-1 -> HYBRID_SHARD -> ZeRO-3/FULL_SHARD ->
    HSDP x TP -> TP -> FSDP x TP -> ZeRO-2 offload -> ZeRO-3/FSDP offload (FSDP first by default)."""
    assert simplicity_order() == ("ddp", "fsdp_shard_grad_op", "zero2", "zero1", "fsdp_hybrid_shard",
                                  "fsdp_full_shard", "zero3", "hsdp_tp", "tp", "fsdp_tp", "zero2_offload",
                                  "fsdp_offload", "zero3_offload")


def _planned(prefer: str = "fsdp"):
    from shardscope.model.spec import model_spec
    from shardscope.plan.mesh import Setup
    from shardscope.plan.planner import estimate

    spec = model_spec(None, params=7e9)
    setup = Setup(gpus_per_node=GPUS, nodes=NODES, gpu_memory_bytes=80 * GIB, tp_size=TP, prefer=prefer)
    return spec, setup, estimate(spec, setup)


@pytest.mark.parametrize("prefer", ["fsdp", "deepspeed"])
def test_recommend_walks_the_registry_order(prefer):
    """With only the strategies from the k-th of the order on fitting, recommend picks the k-th: on this run every
    row can be recommended but tp alone (4 of the 16 GPUs: it leaves the others idle)."""
    from shardscope.plan.planner import recommend

    _, setup, result = _planned(prefer)
    rows, order = result["rows"], simplicity_order(prefer)
    assert sorted(r.strategy for r in rows) == sorted(order)
    for k in range(len(order)):
        for row in rows:
            row.fits = order.index(row.strategy) >= k
        assert recommend(rows, setup)["strategy"] == next(s for s in order[k:] if s != "tp"), order[k]


@pytest.mark.parametrize("prefer", ["fsdp", "deepspeed"])
def test_fit_breaks_a_tie_in_the_registry_order(prefer):
    """Candidates tied on time, headroom and micro-batches rank in the registry's order; the tie goes to the first."""
    from shardscope.fit.search import Candidate, break_tie

    _, setup, result = _planned(prefer)
    tied = [Candidate(r.strategy, 1, 1, False, r.mesh.tp, r.mesh, 10 * GIB, True, 1.0)
            for r in reversed(result["rows"])]
    assert [c.strategy for c in sorted(tied, key=lambda c: c.key(prefer))] == list(simplicity_order(prefer))
    break_tie(tied, setup, 0.2)
    assert tied[0].strategy == simplicity_order(prefer)[0]


# --- each record complete -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run():
    from shardscope.model.spec import model_spec
    from shardscope.plan.mesh import Setup

    return model_spec(None, params=7e9), Setup(gpus_per_node=GPUS, nodes=NODES, gpu_memory_bytes=80 * GIB, tp_size=TP)


@pytest.fixture(scope="module")
def doctor_model(tmp_path_factory):
    """A tiny Llama config.json with 8 heads and 8 KV heads: every shipped TP degree (2, 4, 8) splits it."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("registry_llama")
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=8, max_position_embeddings=4096).save_pretrained(path)
    return str(path)


def _planner_row(record, run) -> tuple[list[str], object]:
    """What `estimate` does for it: its mesh on this run (`row_meshes`), its row from its family's formulas."""
    from shardscope.plan.formulas import strategy_row
    from shardscope.plan.mesh import row_meshes

    spec, setup = run
    mesh = row_meshes(spec, setup, STRATEGIES).get(record.name)
    if mesh is None:
        return [f"a planner row (no mesh on {NODES} x {GPUS} GPUs, tp {TP}: plan/mesh.py's row_meshes)"], None
    try:
        return [], strategy_row(record.name, spec, setup, mesh=mesh)
    except Exception as error:  # noqa: BLE001 - what a record lacks, named
        return [f"a planner row (its family's formulas: {type(error).__name__}: {error})"], None


def _time_model_path(record, row, run) -> list[str]:
    """step_time prices the row: finite, every collective it plans of a kind the model times, and the figures its
    family's library work, host cost and offload need."""
    from shardscope.plan.calibration.figures import hardware
    from shardscope.plan.time_model import (GATHERING_LIBRARIES, HOST_S_PER_MODULE, KIND_OF_TERM, datasheet_figures,
                                            step_time)

    spec, setup = run
    model = {"params_total": spec.params_total, "trainable_params": spec.params_total}
    try:
        step = step_time(row, spec, model, setup, setup.seq_len, datasheet_figures(hardware("H100", setup.precision)))
    except Exception as error:  # noqa: BLE001 - what a record lacks, named
        return [f"a time-model path (step_time: {type(error).__name__}: {error})"]
    lacks = [] if math.isfinite(step["step_time_s"]) and step["step_time_s"] > 0 else ["a finite step time"]
    unknown = sorted(term for term in row.comm if term not in KIND_OF_TERM)
    if unknown:
        lacks.append(f"a collective kind for {', '.join(unknown)} (time_model.KIND_OF_TERM)")
    if record.gathers and record.family not in HOST_S_PER_MODULE.keys() & GATHERING_LIBRARIES.keys():
        lacks.append(f"its library's host cost and name (time_model.HOST_S_PER_MODULE, GATHERING_LIBRARIES: "
                     f"{record.family})")
    if record.offload and step["step_time_parts"]["offload"] <= 0:
        lacks.append("an offload term (time_model.offload_seconds)")
    return lacks


def _shipped_configs(record) -> list[str]:
    """Its shipped files exist (the accelerate yaml, its multi-node one, the library's own), each read as it."""
    from shardscope.doctor.rules import read_raw
    from shardscope.errors import UsageError
    from shardscope.configs.catalog import find_config

    lacks = []
    for name, kind in ((record.config, "accelerate"), (record.multinode_config, "accelerate"),
                       (record.library_config, "deepspeed")):
        if not name:
            continue
        try:
            path = find_config(name).path
        except UsageError:
            lacks.append(f"a shipped config '{name}' (configs/catalog.py's folders)")
            continue
        found = strategy_of_config(kind, read_raw(path))
        if found != record.name:
            lacks.append(f"a config read as it ('{name}' is read as {found})")
    return lacks


def _detection(record) -> list[str]:
    """What a live run's library says (measure/detect.py's `strategy_name`: ZeRO's stage and offload, FSDP's sharding
    and offload, the TP mesh, DDP) and a summary naming it, each read back as this strategy."""
    from shardscope.measure.detect import strategy_name

    live = strategy_name(record.family, zero_stage=record.zero_stage, sharding=record.sharding,
                         offload=bool(record.offload), mesh=record.mesh_on(NODES * GPUS, NODES, TP))
    lacks = [] if live == record.name else [f"a detection rule (measure/detect.py names a live run with its "
                                            f"settings {live})"]
    if strategy_from_summary({"strategy": record.name}) != record.name:
        lacks.append("a summary reader (strategy_from_summary)")
    return lacks


def _doctor_entry(record, model: str) -> list[str]:
    """doctor reads its shipped accelerate config, plans it and names it when it does not fit."""
    from shardscope.doctor.diagnose import Inputs, diagnose
    from shardscope.configs.catalog import find_config

    try:
        path = find_config(record.config).path
        findings, _ = diagnose(Inputs(accelerate_config=path, model=model, gpus=GPUS, nodes=NODES,
                                      gpu_memory_bytes=1024), validate=False, environment=False)
    except Exception as error:  # noqa: BLE001 - what a record lacks, named
        return [f"a doctor entry (doctor on its config: {type(error).__name__}: {error})"]
    if not any(f.code == "no-fit" and f.problem.startswith(f"{record.name} needs") for f in findings):
        return [f"a doctor entry (doctor's fit check of {record.config} does not plan it)"]
    return []


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.name)
def test_record_has_what_every_tool_needs(record, run, doctor_model):
    """A planner row, a time-model path, its shipped configs, a detection rule, a doctor entry."""
    lacks, row = _planner_row(record, run)
    lacks += _time_model_path(record, row, run) if row is not None else ["a time-model path (no row to price)"]
    lacks += _shipped_configs(record) + _detection(record) + _doctor_entry(record, doctor_model)
    assert not lacks, f"{record.name} lacks: " + "; ".join(lacks)
