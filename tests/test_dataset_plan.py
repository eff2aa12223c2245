"""`plan --dataset`'s reading of a dataset (plan/dataset.py) and what each batching makes of it (plan/batching.py),
held against a count made here from the recipe's own per-record tokenisation (recipes/data.py's `tokenize_sft`);
bad input. The planned peaks at the worst micro-batch are held against launched runs in test_dataset_runs.py."""
from __future__ import annotations

import itertools
import json
import math

import pytest

from shardscope.cli.entry import main
from shardscope.plan.batching import data_facts
from shardscope.plan.dataset import load_tokenizer, read_lengths
from shardscope.recipes.data import tokenize_sft
from shardscope.recipes.tiny import make_long_tail_json

MAX_LENGTH, BATCH = 200, 3  # the long-tail data's longest are ~400 tokens: some are truncated


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_long_tail_json(tmp_path_factory.mktemp("tail") / "tail.jsonl", n=40, seed=3, at_longest=0.1)


@pytest.fixture(scope="module")
def counted(data, sft_assets):
    """Each record's length as the recipe tokenises it (one record at a time, no limit), sorted."""
    tokenizer = load_tokenizer(str(sft_assets["model"]))
    records = [json.loads(line) for line in data.read_text().splitlines()]
    return sorted(len(tokenize_sft(r, tokenizer, 10 ** 6)["input_ids"]) for r in records)


def nearest_rank(lengths: list[int], p: int) -> int:
    return lengths[math.ceil(p / 100 * len(lengths)) - 1]


def test_counts_percentiles_truncation_and_padding_waste_equal_a_count(data, sft_assets, counted):
    facts = data_facts(read_lengths(str(data), load_tokenizer(str(sft_assets["model"])), MAX_LENGTH, progress=None),
                       MAX_LENGTH, BATCH)
    cut = [min(n, MAX_LENGTH) for n in counted]
    tokens = sum(cut)
    assert counted[-1] > 3 * nearest_rank(counted, 50) and counted[-1] > MAX_LENGTH  # a long tail, cut by the limit
    assert (facts["samples"], facts["tokens"], facts["dropped"]) == (len(counted), tokens, 0)
    assert facts["length_percentiles"] == {"p50": nearest_rank(counted, 50), "p90": nearest_rank(counted, 90),
                                           "p99": nearest_rank(counted, 99), "max": counted[-1]}
    assert facts["truncated"] == sum(n > MAX_LENGTH for n in counted)
    # pad_longest: every micro-batch of BATCH samples a random order can make, each padded to its longest
    groups = list(itertools.combinations(cut, BATCH))
    padded = len(cut) * sum(max(g) for g in groups) / len(groups)
    waste = facts["padding_waste"]
    assert waste["pad_longest"] == pytest.approx(padded / tokens - 1, rel=1e-9)
    ordered = sorted(cut)
    assert waste["group_by_length"] == pytest.approx(sum(max(ordered[i:i + BATCH]) * len(ordered[i:i + BATCH])
                                                         for i in range(0, len(ordered), BATCH)) / tokens - 1)
    assert waste["pad_fixed"] == pytest.approx(len(cut) * MAX_LENGTH / tokens - 1)
    assert waste["packing"] == waste["padding_free"] == 0
    worst = facts["worst_micro_batch_tokens"]
    assert worst["pad_longest"] == worst["group_by_length"] == BATCH * MAX_LENGTH == worst["pad_fixed"]
    assert worst["padding_free"] == sum(ordered[-BATCH:])
    assert facts["batching"]["padding_free"]["worst_micro_batch"]["inputs"] == "packed"


def test_every_format_reads_the_same_lengths_and_a_sample_says_so(data, sft_assets, tmp_path):
    import datasets

    tokenizer = load_tokenizer(str(sft_assets["model"]))
    whole = read_lengths(str(data), tokenizer, MAX_LENGTH, progress=None)
    rows = datasets.load_dataset("json", data_files=str(data), split="train")
    rows.to_parquet(tmp_path / "tail.parquet")
    rows.to_csv(tmp_path / "tail.csv")
    rows.save_to_disk(tmp_path / "saved")
    for path in ("tail.parquet", "tail.csv", "saved"):
        assert read_lengths(str(tmp_path / path), tokenizer, MAX_LENGTH, progress=None).counts == whole.counts, path
    sample = read_lengths(str(data), tokenizer, MAX_LENGTH, sample=7, progress=None)
    assert (sample.rows, sample.samples, sample.sampled) == (7, 7, True)


@pytest.mark.parametrize("args, says", [
    (["--dataset", "missing.jsonl"], "--dataset missing.jsonl: no such file or folder"),
    (["--dataset", "DATA", "--text-field", "nope"], "no column 'nope'"),
    (["--dataset", "BAD.txt"], "unknown format '.txt'"),
    (["--dataset", "DATA", "--sample", "0"], "--sample must be at least 1"),
    (["--dataset", "DATA", "--tokenizer", "nowhere"], "--tokenizer nowhere: not a local folder"),
])
def test_bad_dataset_input_is_one_line_and_exit_2(args, says, data, sft_assets, tmp_path, capsys):
    bad = tmp_path / "BAD.txt"
    bad.write_text("x")
    args = [str(data) if a == "DATA" else str(bad) if a == "BAD.txt" else a for a in args]
    code = main(["plan", "--model", str(sft_assets["model"]), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and err.count("\n") == 0, err


def _fit(args, capsys) -> dict:
    assert main(["fit", *args, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_fit_on_a_budget_of_the_median_picks_a_setting_that_fits_the_tail_and_says_why(data, sft_assets, capsys):
    """A budget just above the median-length winner's peak: at the tail that setting does not fit; `fit --dataset`
    decides on the worst micro-batch (the longest sample) and its winner fits there."""
    from shardscope.model.spec import model_spec
    from shardscope.plan.mesh import Setup
    from shardscope.plan.planner import estimate, usable_bytes
    from shardscope.plan.trace_cache import cached_traces_for

    model = str(sft_assets["model"])
    common = ["--model", model, "--gpus", "2", "--precision", "fp32", "--peak-tflops", "100", "--global-batch", "4"]
    facts = data_facts(read_lengths(str(data), load_tokenizer(model), MAX_LENGTH, progress=None), MAX_LENGTH, 1)
    median, tail = facts["length_percentiles"]["p50"], MAX_LENGTH
    at_median = _fit([*common, "--seq-len", str(median), "--gpu-memory", "1GB"], capsys)
    budget = int(at_median["peak_bytes"] * 1.02 / 0.9)  # usable = 0.9 x GPU memory: 2% above the median's peak
    fitted = _fit([*common, "--gpu-memory", str(budget), "--dataset", str(data), "--max-length", str(MAX_LENGTH)],
                  capsys)
    decision = fitted["data"]["fit"]
    setup = Setup(gpus_per_node=2, gpu_memory_bytes=budget, precision="fp32", seq_len=tail, batch_inputs="padded",
                  micro_batch=at_median["per_device_train_batch_size"],
                  activation_checkpointing=at_median["gradient_checkpointing"])
    rows = estimate(model_spec(model), setup, cached_traces_for(model, setup)[0])["rows"]
    median_setting_at_tail = next(r for r in rows if r.strategy == at_median["strategy"])
    assert median_setting_at_tail.peak_bytes > usable_bytes(setup)  # the median's setting does not fit the tail
    assert decision["seq_len"] == tail and decision["batch_inputs"] == "padded"
    assert fitted["peak_bytes"] <= usable_bytes(setup) and "the longest sample" in decision["decided_by"]
    assert decision["at_median"]["strategy"] == at_median["strategy"]
    assert f"--per_device_train_batch_size {fitted['per_device_train_batch_size']}" in decision["flags"]


def test_a_text_column_and_chat_messages_are_read_as_their_tokenisers_count_them(sft_assets, tmp_path):
    """`--text-field` as the recipe's tokenize_text counts it (special tokens, then EOS); chat `messages` through the
    tokenizer's chat template; a tokenizer without a template is one line naming what is missing."""
    from shardscope.errors import UsageError
    from shardscope.recipes.data import tokenize_text

    tokenizer = load_tokenizer(str(sft_assets["model"]))
    texts = ["red blue green " * n for n in (1, 5, 30)]
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    read = read_lengths(str(tmp_path / "text.jsonl"), tokenizer, 10 ** 6, text_field="body", progress=None)
    assert read.counts == {n: 1 for n in (len(tokenize_text({"body": t}, tokenizer, 10 ** 6, "body")["input_ids"])
                                          for t in texts)}
    chats = [[{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}] for t in texts]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    with pytest.raises(UsageError, match="no chat template"):
        read_lengths(str(tmp_path / "chat.jsonl"), tokenizer, 10 ** 6, progress=None)
    tokenizer.chat_template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    read = read_lengths(str(tmp_path / "chat.jsonl"), tokenizer, 10 ** 6, progress=None)
    expected = [len(tokenizer(tokenizer.apply_chat_template(m, tokenize=False), add_special_tokens=False)["input_ids"])
                for m in chats]
    assert sorted(n for n, c in read.counts.items() for _ in range(c)) == sorted(expected)
