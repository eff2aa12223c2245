"""`shardscope parity` in one process: the comparison's localisation on fingerprint records built here (each phase,
shards against replicas, the tolerance's edge), the fingerprints' arithmetic across shards, the shadow's shrink rule
on shipped configs, and bad input (one line, exit 2)."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from shardscope.cli.entry import main
from shardscope.measure.parity_record import fingerprint, per_sample
from shardscope.parity.compare import TOLERANCE, compare, distance, run_precision

MODULES = ("model.layers.0", "model.layers.1.mlp", "model.layers.1", "lm_head")
PARAMS = ("model.embed_tokens.weight", "model.layers.1.mlp.up_proj.weight", "lm_head.weight")


def fp(scale: float, n: int = 64) -> list:
    """A fingerprint of n elements all equal to `scale`."""
    return [scale * n, scale * scale * n, abs(scale), n]


def reference_record(steps: int = 2, samples: int = 4) -> dict:
    """One process: `samples` samples per step, each module's and parameter's fingerprint."""
    out = {"rank": 0, "world_size": 1, "precision": "fp32", "mixed_precision": "no", "weight_dtypes": ["float32"],
           "grads_visible": True, "strategy": "single", "steps": [{"step": 0, "params": {p: fp(1.0) for p in PARAMS}}]}
    for step in range(1, steps + 1):
        digests = [f"s{step}-{i}" for i in range(samples)]
        out["steps"].append({
            "step": step, "samples": [digests[:2], digests[2:]], "forward_order": list(MODULES),
            "forward": {m: {d: fp(1.0 + i + k) for i, d in enumerate(digests)} for k, m in enumerate(MODULES)},
            "grads": {p: fp(0.1 * (k + 1)) for k, p in enumerate(PARAMS)},
            "update": {p: fp(0.01) for p in PARAMS}, "loss": 7.0 + step, "grad_norm": 2.0})
    return out


def launched_records(reference: dict, shard: str = "") -> list[dict]:
    """Two DP ranks that split each step's samples as the reference's micro-batches; `shard`: that parameter's
    fingerprints are halves held one per rank (what ZeRO-3 / FSDP record)."""
    ranks = []
    for rank in range(2):
        record = copy.deepcopy(reference)
        record.update(rank=rank, world_size=2, strategy="ddp")
        for step in record["steps"]:
            for key in ("params", "grads", "update"):
                for name, value in step.get(key, {}).items():
                    s, q, m, n = value
                    if name == shard:
                        step[key][name] = [s / 2, q / 2, m, n // 2]
            if step["step"]:
                mine = step["samples"][rank]
                step["samples"] = [mine]
                step["forward"] = {m: {d: v for d, v in per.items() if d in mine} for m, per in step["forward"].items()}
        ranks.append(record)
    return ranks


def where(result):
    found = result.first_divergence
    return found and (found.step, found.phase, found.module, found.rank)


def test_equal_records_are_equal_and_shards_add_up():
    reference = reference_record()
    result = compare(launched_records(reference, shard=PARAMS[1]), reference)
    assert result.verdict == "equal" and result.sentence() == "equal within 1.5e-05 over 2 steps"
    assert [row["loss"] for row in result.steps] == [row["loss_reference"] for row in result.steps] == [8.0, 9.0]


@pytest.mark.parametrize("phase", ["initial weights", "data", "forward", "loss", "backward", "optimizer"])
def test_each_phase_is_where_a_difference_first_shows(phase):
    reference = reference_record()
    ranks = launched_records(reference)
    step = ranks[1]["steps"][2]
    if phase == "initial weights":
        ranks[1]["steps"][0]["params"][PARAMS[2]][0] *= 1.5
    elif phase == "data":  # rank 1 trains on rank 0's samples
        step["samples"] = ranks[0]["steps"][2]["samples"]
    elif phase == "forward":  # rank 1's layers.1.mlp, and everything after it
        for module in MODULES[1:]:
            for value in step["forward"][module].values():
                value[1] *= 1.1
    elif phase == "loss":
        for record in ranks:
            record["steps"][2]["loss"] *= 2
    elif phase == "backward":
        step["grads"][PARAMS[1]][1] *= 9  # rank 1's copy: norm 3x
    else:
        step["update"][PARAMS[0]][2] *= 2
    expected = {"initial weights": (0, "initial weights", PARAMS[2], 1), "data": (2, "data", None, 1),
                "forward": (2, "forward", "model.layers.1.mlp", 1), "loss": (2, "forward", "loss", None),
                "backward": (2, "backward", PARAMS[1], 1), "optimizer": (2, "optimizer", PARAMS[0], 1)}[phase]
    result = compare(ranks, reference)
    assert where(result) == expected, result.sentence()
    if phase == "backward":
        assert result.sentence() == f"diverged at step 2, backward: {PARAMS[1]} on rank 1, gradients 3x the reference"


def test_a_difference_inside_the_tolerance_passes_and_one_beyond_it_fails():
    reference = reference_record()
    tolerance = TOLERANCE["fp32"]
    for factor, verdict in ((0.5, "equal"), (2.0, "diverged")):
        ranks = launched_records(reference)
        for record in ranks:
            record["steps"][1]["loss"] *= 1 + factor * tolerance
        assert compare(ranks, reference).verdict == verdict
    ranks = launched_records(reference)
    ranks[0]["steps"][1]["loss"] *= 1 + 2 * tolerance
    assert compare(ranks, reference, tolerance=4 * tolerance).verdict == "equal"  # --tolerance


def test_a_sharded_tensor_is_judged_whole():
    reference = reference_record()
    ranks = launched_records(reference, shard=PARAMS[0])
    ranks[0]["steps"][1]["grads"][PARAMS[0]][1] *= 1.2  # one shard's part of the sum of squares
    assert where(compare(ranks, reference)) == (1, "backward", PARAMS[0], None)


def test_a_run_that_stopped_early_diverges():
    reference = reference_record()
    ranks = launched_records(reference)
    for record in ranks:
        del record["steps"][2]
    result = compare(ranks, reference)
    assert result.verdict == "diverged" and "stopped before step 2" in result.notes[0]
    assert result.sentence() == "diverged at step 2, data: the launched run stopped before this step"


def test_the_tolerance_follows_the_lowest_precision_of_either_run():
    assert TOLERANCE["fp32"] == 2 ** -24 * math.sqrt(2 ** 16) and TOLERANCE["bf16"] == 2 * 2 ** -7
    reference = reference_record()
    ranks = launched_records(reference)
    ranks[0]["mixed_precision"] = "bf16"
    assert run_precision(ranks[0]) == "bf16" and run_precision({"weight_dtypes": ["float16"]}) == "fp16"
    assert compare(ranks, reference).tolerance == TOLERANCE["bf16"]


def test_fingerprints_of_shards_add_to_the_whole_tensors():
    torch.manual_seed(0)
    whole = torch.randn(10, 6)
    pieces = [fingerprint(piece) for piece in whole.split(4)]  # three uneven shards
    added = [sum(p[0] for p in pieces), sum(p[1] for p in pieces), max(p[2] for p in pieces), sum(p[3] for p in pieces)]
    assert distance(added, fingerprint(whole)) < TOLERANCE["fp32"]
    rows = per_sample(whole.reshape(2, 5, 6), 2)  # per sample: the row's own fingerprint; the sequence split adds
    halves = [per_sample(whole.reshape(2, 5, 6)[:, cut], 2) for cut in (slice(0, 2), slice(2, 5))]
    for sample in range(2):
        assert rows[sample] == pytest.approx(fingerprint(whole.reshape(2, 30)[sample]))
        split = [h[sample] for h in halves]
        assert distance([split[0][0] + split[1][0], split[0][1] + split[1][1], max(split[0][2], split[1][2]), 30],
                        rows[sample]) < TOLERANCE["fp32"]
    assert per_sample(whole, 3) is None  # not led by the batch's rows: not fingerprinted per sample


@pytest.mark.parametrize("model, kept", [
    ("mixtral-8x7b", dict(model_type="mixtral", num_experts_per_tok=2, tie_word_embeddings=False)),
    ("llama-3-70b", dict(model_type="llama", tie_word_embeddings=False)),
    ("gemma-2-9b", dict(model_type="gemma2", tie_word_embeddings=True, sliding_window=4096)),
])
def test_a_shadow_keeps_the_structure_and_shrinks_the_sizes(model, kept):
    from shardscope.model.spec import load_model_config
    from shardscope.parity.shadow import SHRINK, shrink

    config = load_model_config(model)
    ratio = config.num_attention_heads // config.num_key_value_heads
    experts = getattr(config, "num_local_experts", None)
    rule = shrink(config)
    assert {key: getattr(config, key) for key in kept} == kept
    assert config.num_attention_heads // config.num_key_value_heads == ratio and f"GQA ratio {ratio}" in rule
    assert config.num_hidden_layers == SHRINK["layers"] and config.vocab_size == SHRINK["vocab"]
    assert config.hidden_size == config.num_attention_heads * SHRINK["head_dim"]
    if experts:
        assert config.num_local_experts == SHRINK["experts"] and "top-2 routing" in rule


@pytest.mark.parametrize("args, says", [
    (["--config", "ddp", "--script", "missing.py"], "--script missing.py: not a Python file"),
    (["--config", "ddp", "--script", __file__, "--ranks", "1"], "--ranks 1: at least 2"),
    (["--config", "ddp", "--script", __file__, "--steps", "0"], "--steps 0: at least 1"),
    (["--config", "ddp", "--script", __file__, "--tolerance", "nan"], "--tolerance nan: a positive number"),
    (["--config", "no_such_config", "--script", __file__], "no_such_config"),
    (["--config", "fsdp/llama_full_shard", "--script", __file__], "'fsdp/llama_full_shard' is a fsdp config"),
    (["--config", "zero3_multinode", "--script", __file__], "is a multi-node accelerate config"),
    (["--config", "ddp", "--script", __file__, "--", "--output_dir", "x"], "--output_dir is parity's"),
    (["--config", "ddp", "--script", __file__, "--shadow-of", "llama-3-8b"], "put {shadow} where the script"),
    (["--config", "ddp", "--script", __file__, "--shadow-of", "no-such-model", "--", "--model", "{shadow}"],
     "no-such-model"),
])
def test_bad_input_is_one_line_and_exit_2(args, says, capsys, tmp_path):
    assert main(["parity", *args[:4], "--output-dir", str(tmp_path), *args[4:]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardscope: error:") and "\n" not in err and says in err, err


def test_tensor_parallel_ranks_share_samples_and_hold_copies_or_shards_of_outputs():
    """Two tensor-parallel ranks train on the same samples (data_parallel 1): a module's output is a shard on each
    (its elements add up to the reference's: added) or a copy on each (as large as the reference's: each judged)."""
    reference = reference_record(steps=1)
    ranks = []
    for rank in range(2):
        record = copy.deepcopy(reference)
        record.update(rank=rank, world_size=2, strategy="tp", data_parallel=1)
        step = record["steps"][1]
        for k, module in enumerate(MODULES):
            for digest, (s, q, m, n) in step["forward"][module].items():
                step["forward"][module][digest] = [s / 2, q / 2, m, n // 2] if k % 2 else [s, q, m, n]
        ranks.append(record)
    result = compare(ranks, reference)
    assert result.verdict == "equal" and "no one process repeats its arithmetic" in result.notes[0]
    ranks[1]["steps"][1]["forward"][MODULES[2]]["s1-3"][1] *= 1.1  # one copy drifted on rank 1
    assert where(compare(ranks, reference)) == (1, "forward", MODULES[2], 1)
    ranks[0]["steps"][1]["samples"] = [["s1-0", "s1-1"]]  # rank 0 missed half the batch its tensor group trains on
    assert where(compare(ranks, reference)) == (1, "data", None, None)


def test_a_run_that_failed_prints_its_log_tail_and_exits_1(monkeypatch, tmp_path, capsys):
    from shardscope.fit.launching import LOG_FILE
    from shardscope.parity import runs

    folder = tmp_path / "launched"
    folder.mkdir()
    (folder / LOG_FILE).write_text("$ accelerate launch train.py\n\nTraceback (most recent call last):\n"
                                   "ValueError: the script's own mistake\n\n[shardscope] exit code 1 after 3.0 s\n")
    monkeypatch.setattr(runs, "launch_both", lambda *args: {"launched": (1, 3.0, folder)})
    assert main(["parity", "--config", "ddp", "--script", __file__, "--output-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("launched run failed: ValueError: the script's own mistake") and "exit code 1" in out


def test_a_run_without_the_callback_is_named(tmp_path):
    from shardscope.parity.runs import read_records

    found, problem = read_records(tmp_path / "reference", 1)
    assert found == [] and "rank 0" in problem and "ShardingProfilerCallback" in problem


def test_samples_are_digested_from_any_mapping_of_inputs():
    """A BatchEncoding (the recipes' batches) is a Mapping, not a dict: its rows are digested all the same."""
    from transformers import BatchEncoding

    from shardscope.measure.parity_record import sample_digests

    ids = torch.tensor([[5, 6, 7], [5, 6, 8], [5, 6, 7]])
    digests = sample_digests(BatchEncoding({"input_ids": ids}))
    assert digests == sample_digests({"input_ids": ids}) and len(set(digests)) == 2 and digests[0] == digests[2]
    assert sample_digests({"pixel_values": torch.zeros(2, 3, 4, 4)})[0] and sample_digests([ids]) == []


@pytest.mark.parametrize("config, launcher", [("ds/zero3", "deepspeed"), ("fsdp1_full_shard", "accelerate")])
def test_the_two_runs_are_the_launch_and_one_process_with_the_launched_worlds_batch(monkeypatch, tmp_path, config,
                                                                                   launcher):
    """What `launch_both` runs: the config's launcher with N processes (on CPU: the overrides a GPU config needs),
    then `python SCRIPT` with the same arguments and the environment that makes it the reference."""
    from shardscope.measure.parity_record import PARITY_ENV, STEPS_ENV, WORLD_ENV
    from shardscope.parity import runs

    seen = []
    monkeypatch.setattr(runs, "launch", lambda cmd, folder, env: seen.append((cmd, env)) or (0, 1.0))
    runs.launch_both(tmp_path / "train.py", runs.read_config(config), ["--model", "m"], tmp_path, 2, 3, gpus=0)
    (launched, env), (reference, env_ref) = seen
    assert Path(launched[0]).name == launcher and launched[launched.index("--output_dir") + 1] == str(tmp_path /
                                                                                                     "launched")
    if launcher == "deepspeed":
        assert launched[launched.index("--num_gpus") + 1] == "2" and "--deepspeed" in launched
    else:
        assert "--mixed_precision" in launched and "--fsdp_sync_module_states" in launched
    assert reference[1:] == [str(tmp_path / "train.py"), "--model", "m", "--output_dir", str(tmp_path / "reference")]
    assert env[PARITY_ENV] == str(tmp_path / "launched" / "parity") and WORLD_ENV not in env and env[STEPS_ENV] == "3"
    assert env_ref[WORLD_ENV] == "2" and env_ref[PARITY_ENV] == str(tmp_path / "reference" / "parity")


def test_a_sequence_split_is_compared_by_loss_gradients_and_updates_only():
    """Sequence-split ranks train on slices (digests no reference sample has): data and outputs are left out and
    said to be; the loss, gradients and updates are still compared."""
    reference = reference_record(steps=1)
    ranks = launched_records(reference)
    for rank, record in enumerate(ranks):
        record.update(data_parallel=1, sequence_split=2)
        record["steps"][1]["samples"] = [[f"slice{rank}-{i}" for i in range(4)]]
        record["steps"][1]["forward"] = {}
    result = compare(ranks, reference)
    assert result.verdict == "equal" and any("sequence split" in note for note in result.notes)
    ranks[1]["steps"][1]["grads"][PARAMS[2]][1] *= 4
    assert where(compare(ranks, reference)) == (1, "backward", PARAMS[2], 1)


def test_a_closed_recorder_lets_its_model_and_kept_copies_go(tmp_path):
    """Several Trainers in one process (a notebook, the tests' shared launches): the recorder of a finished run must
    not keep that run's parameter copies alive (seen: the next run's measured peak 12% higher on the rank that kept
    them)."""
    import gc
    import weakref

    import torch

    from shardscope.measure.guard import Instrument
    from shardscope.measure.parity_record import ParityRecorder

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    recorder = ParityRecorder(tmp_path, 0, 1, Instrument("parity", lambda *a, **k: None), {})
    recorder.start(None, model)
    recorder.step_end(1)
    kept = [weakref.ref(copy) for copy in recorder.previous.values()]
    gone = weakref.ref(model)
    recorder.close()
    del model
    gc.collect()
    assert kept and all(ref() is None for ref in kept) and gone() is None
    assert (tmp_path / "rank0.json").exists()
