"""Hostile and broken input, in process: every case is one line on stderr with its documented exit code (0 ok,
1 findings, 2 bad input), within a time limit (a FIFO must not hang), and nothing a file plants is ever executed.

Planted code: `Planted(marker)` unpickles to a call of `exec` that creates the marker file. The cases put it in a
ZeRO `*_model_states.pt` / `*_optim_states.pt` (also hidden from torch's static scan by protocol-4 framing, so the
weights_only load itself must refuse it), in a DCP `.metadata`, and as a non-tensor entry of a genuine DCP
checkpoint (which torch's own DCP loader does execute: `test_dcp_non_tensor_entries_are_never_unpickled`
shows the plant is live), and at the top level of a recipe `doctor` reads. A genuine ZeRO checkpoint exporting
with --trust-pickle is in test_export.py. Then: the bounded JSON/YAML readers (hypothesis), atomic writes, the
hub look-up's speed and trust_remote_code.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from launch import ROOT, cpu_env
from shardscope.cli import main
from shardscope.errors import UsageError
from shardscope.safe_io import MAX_DEPTH, atomic_write_text, load_data, parse_json, parse_yaml

RECIPE = ROOT / "recipes" / "causal_lm_sft.py"


class Planted:
    """Unpickling this runs code: it creates the file `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').close()",)


def torch_archive(path: Path, data_pkl: bytes) -> Path:
    """A torch.save zip archive whose pickle is `data_pkl` (the other records from a real torch.save)."""
    buffer = io.BytesIO()
    torch.save({}, buffer)
    with zipfile.ZipFile(buffer) as real, zipfile.ZipFile(path, "w") as out:
        for name in real.namelist():
            out.writestr(name, data_pkl if name.endswith("data.pkl") else real.read(name))
    return path


def zero_checkpoint(root: Path, model=None, optim=None, latest: str = "global_step1") -> Path:
    """A one-rank ZeRO-3 checkpoint layout: `latest`, global_step1/*_model_states.pt and *_optim_states.pt;
    `model`/`optim` are the pickles to put in them (default: a harmless torch.save({}))."""
    folder = root / "ckpt"
    step = folder / "global_step1"
    step.mkdir(parents=True)
    (folder / "latest").write_text(latest)
    for kind, data in (("model", model), ("optim", optim)):
        file = step / f"zero_pp_rank_0_mp_rank_00_{kind}_states.pt"
        torch_archive(file, data) if data is not None else torch.save({}, file)
    return folder


def dcp_checkpoint(folder: Path, state: dict) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder


def edit_metadata(folder: Path, change: Callable) -> None:
    """Rewrite a DCP `.metadata` we wrote ourselves (so plain pickle is fine here) after `change(metadata)`."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    change(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


# ----------------------------------------------------------------------------- the table


GOOD_SUMMARY = {"world_size": 1, "strategy": "ddp", "device": "cpu",
                "ranks": [{"params_bytes": 100, "grads_bytes": 100, "optimizer_bytes": 200, "peak_memory_bytes": 900}]}


def _run(tmp: Path, name: str, summary) -> Path:
    """A run folder whose shardscope_summary.json is `summary` (text or bytes), or a FIFO for "FIFO"."""
    folder = tmp / name
    folder.mkdir()
    path = folder / "shardscope_summary.json"
    if summary == "FIFO":
        os.mkfifo(path)
    else:
        path.write_bytes(summary if isinstance(summary, bytes) else summary.encode())
    return folder


@dataclass
class Case:
    name: str
    setup: Callable[[Path, Path], list[str]]  # (tmp_path, marker) -> shardscope argv
    code: int
    fragment: str


def _zero_planted_model(tmp, marker):
    return ["export", str(zero_checkpoint(tmp, model=pickle.dumps(Planted(marker), protocol=2))), str(tmp / "out")]


def _zero_planted_optim(tmp, marker):
    return ["export", str(zero_checkpoint(tmp, optim=pickle.dumps(Planted(marker), protocol=2))), str(tmp / "out")]


def _zero_planted_hidden_from_scan(tmp, marker):
    # protocol 4 frames: torch's static scan cannot follow them, so only the weights_only load stands in the way
    return ["export", str(zero_checkpoint(tmp, model=pickle.dumps(Planted(marker), protocol=4))), str(tmp / "out")]


def _zero_latest_escapes(tag_of):
    def setup(tmp, marker):
        outside = zero_checkpoint(tmp / "elsewhere")  # a real-looking checkpoint outside the one exported
        folder = zero_checkpoint(tmp / "a" / "b")
        (folder / "latest").write_text(tag_of(folder, outside))
        return ["export", str(folder), str(tmp / "out")]

    return setup


def _dcp_planted_metadata(tmp, marker):
    folder = tmp / "ckpt" / "pytorch_model_fsdp_0"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    return ["export", str(folder.parent), str(tmp / "out"), "--model", "x"]


def _dcp_shard_escapes(tmp, marker):
    folder = dcp_checkpoint(tmp / "ckpt", {"w": torch.ones(4)})
    (tmp / "stolen.distcp").write_bytes(next(folder.glob("*.distcp")).read_bytes())

    def redirect(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = "../stolen.distcp"

    edit_metadata(folder, redirect)
    return ["export", str(folder), str(tmp / "out"), "--model", "x"]


def _dcp_metadata(data: bytes):
    def setup(tmp, marker):
        folder = dcp_checkpoint(tmp / "ckpt", {"w": torch.ones(4)})
        (folder / ".metadata").write_bytes(data or (folder / ".metadata").read_bytes()[:40])
        return ["export", str(folder), str(tmp / "out"), "--model", "x"]

    return setup


def _export_to_dangling_symlink(tmp, marker):
    (tmp / "out").symlink_to(tmp / "missing")
    return ["export", str(zero_checkpoint(tmp)), str(tmp / "out")]


def _file(name: str, content):
    def setup(tmp, marker):
        path = tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    return setup


def _cmd(*argv, file=None):
    """argv with FILE replaced by the path `file(tmp, marker)` creates."""
    def setup(tmp, marker):
        path = str(file(tmp, marker)) if file else None
        return [path if a == "FILE" else a for a in argv]

    return setup


def _fifo(tmp, marker):
    os.mkfifo(tmp / "fifo.json")
    return tmp / "fifo.json"


BINARY = bytes(range(256)) * 4
LATIN1 = "distributed_type: MULTI_GPU\n# caf\xe9\n".encode("latin-1")
DEEP_JSON = "[" * 100_000 + "]" * 100_000
DEEP_YAML = "a: " + "[" * 5_000 + "]" * 5_000 + "\n"
# nine levels of nine aliases: 9**9 (387 million) values once expanded, 300 bytes of text
BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"] + [f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]"
                                                         for p, n in zip("abcdefgh", "bcdefghi")]) + "\n"


def _deep_model(tmp: Path, marker: Path) -> Path:
    (tmp / "deep_model").mkdir()
    (tmp / "deep_model" / "config.json").write_text(DEEP_JSON)
    return tmp / "deep_model"


def _dangling(tmp: Path) -> Path:
    (tmp / "link").symlink_to(tmp / "missing")
    return tmp / "link"


def _remote_code_model(tmp: Path, marker: Path) -> Path:
    """A model folder whose config names its own Python class (auto_map); importing it creates the marker."""
    folder = tmp / "custom"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "shardscope_custom",
                                                    "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}))
    (folder / "configuration_custom.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nfrom transformers import PretrainedConfig\n\n\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'shardscope_custom'\n")
    return folder


def _planted_recipe(tmp, marker):
    """A recipe whose top level and whose field default would create the marker if it ran."""
    path = tmp / "planted_recipe.py"
    path.write_text(f"open({str(marker)!r}, 'w').close()\nfrom dataclasses import dataclass, field\n\n\n"
                    f"@dataclass\nclass ScriptArguments:\n    max_seq_length: int = field(default=512)\n"
                    f"    other: str = field(default=open({str(marker)!r}, 'w').name)\n")
    return path


CASES = [
    Case("zero model states plant code", _zero_planted_model, 2, "builtins.exec, which is not a DeepSpeed"),
    Case("zero optimizer states plant code", _zero_planted_optim, 2, "builtins.exec, which is not a DeepSpeed"),
    Case("zero plant hidden from the static scan", _zero_planted_hidden_from_scan, 2, "re-run with --trust-pickle"),
    Case("zero latest names ../../x", _zero_latest_escapes(lambda f, o: "../../elsewhere/ckpt/global_step1"), 2,
         "outside the checkpoint folder"),
    Case("zero latest names an absolute path", _zero_latest_escapes(lambda f, o: str(o / "global_step1")), 2,
         "outside the checkpoint folder"),
    Case("dcp .metadata plants code", _dcp_planted_metadata, 2, "builtins.exec, which is not a DCP metadata type"),
    Case("dcp .metadata names a shard outside", _dcp_shard_escapes, 2, "outside the checkpoint folder"),
    Case("dcp .metadata truncated", _dcp_metadata(b""), 2, "unreadable (truncated or corrupt)"),
    Case("dcp .metadata is a pickled dict", _dcp_metadata(pickle.dumps({"a": 1})), 2, "is not DCP metadata"),
    Case("export to a dangling symlink", _export_to_dangling_symlink, 2, "already exists (a symlink)"),
    # configs check: each file is unusable input, named with the problem
    Case("configs: binary file", _cmd("configs", "check", "FILE", file=_file("b.json", BINARY)), 2, "a binary file"),
    Case("configs: empty JSON", _cmd("configs", "check", "FILE", file=_file("e.json", "")), 2, "malformed JSON"),
    Case("configs: empty YAML", _cmd("configs", "check", "FILE", file=_file("e.yaml", "")), 2,
         "the top level must be a mapping"),
    Case("configs: invalid UTF-8", _cmd("configs", "check", "FILE", file=_file("l.yaml", LATIN1)), 2,
         "not UTF-8 text (byte 0xe9 at offset 33)"),
    Case("configs: deeply nested JSON", _cmd("configs", "check", "FILE", file=_file("d.json", DEEP_JSON)), 2,
         "nested too deeply"),
    Case("configs: deeply nested YAML", _cmd("configs", "check", "FILE", file=_file("d.yaml", DEEP_YAML)), 2,
         "nested too deeply"),
    Case("configs: YAML anchor bomb", _cmd("configs", "check", "FILE", file=_file("bomb.yaml", BOMB)), 2,
         "anchor bomb"),
    Case("configs: zero_optimization is a number", _cmd("configs", "check", "FILE",
         file=_file("z.json", '{"zero_optimization": 3}')), 2, "zero_optimization: expected a mapping"),
    Case("configs: fsdp_config is a list", _cmd("configs", "check", "FILE",
         file=_file("f.yaml", "distributed_type: FSDP\nfsdp_config: [1]\n")), 2, "fsdp_config: expected a mapping"),
    Case("configs: NaN", _cmd("configs", "check", "FILE", file=_file("n.json", '{"train_batch_size": NaN}')), 2,
         "NaN is not a JSON number"),
    Case("configs: 400-digit integer", _cmd("configs", "check", "FILE",
         file=_file("i.json", '{"train_batch_size": ' + "9" * 400 + "}")), 2, "(400 digits) is too large"),
    Case("configs: a FIFO", _cmd("configs", "check", "FILE", file=_fifo), 2, "not a regular file"),
    Case("configs: a folder", _cmd("configs", "check", "FILE", file=lambda t, m: t), 2, "a folder, not a file"),
    Case("configs: /dev/zero", _cmd("configs", "check", "/dev/zero"), 2, "not a regular file"),
    # doctor: unreadable input is 2, never a finding (1) or a crash
    Case("doctor: binary DeepSpeed JSON", _cmd("doctor", "--deepspeed", "FILE", file=_file("b.json", BINARY)), 2,
         "a binary file"),
    Case("doctor: zero_optimization is a number", _cmd("doctor", "--deepspeed", "FILE",
         file=_file("z.json", '{"zero_optimization": 3}')), 2, "zero_optimization: expected a mapping"),
    Case("doctor: YAML anchor bomb", _cmd("doctor", "--accelerate-config", "FILE", file=_file("bomb.yaml", BOMB)),
         2, "anchor bomb"),
    Case("doctor: a FIFO", _cmd("doctor", "--fsdp-config", "FILE", file=_fifo), 2, "not a regular file"),
    Case("doctor: --gpus 0", _cmd("doctor", "--gpus", "0", "--model", "llama-2-7b", "--gpu", "H100"), 2,
         "--gpus must be at least 1"),
    Case("doctor: --nodes 0", _cmd("doctor", "--nodes", "0"), 2, "--nodes must be at least 1"),
    Case("doctor: recipe YAML float for an int", _cmd("doctor", "--", str(RECIPE), "--config", "FILE",
         file=_file("r.yaml", "max_seq_length: 95.5\n")), 2, "r.yaml: max_seq_length: expected an integer, got 95.5"),
    Case("doctor: recipe YAML list for an int", _cmd("doctor", "--", str(RECIPE), "--config", "FILE",
         file=_file("r.yaml", "max_steps: [1, 2]\n")), 2, "max_steps: expected a single value, got [1, 2]"),
    Case("doctor: recipe YAML word for a bool", _cmd("doctor", "--", str(RECIPE), "--config", "FILE",
         file=_file("r.yaml", "packing: maybe\n")), 2, "packing: expected true or false"),
    Case("doctor: recipe YAML invalid UTF-8", _cmd("doctor", "--", str(RECIPE), "--config", "FILE",
         file=_file("r.yaml", "dataset: caf\xe9\n".encode("latin-1"))), 2, "not UTF-8 text"),
    Case("doctor: recipe is binary", _cmd("doctor", "--", "FILE", file=_file("r.py", BINARY)), 2, "a binary file"),
    Case("doctor: recipe is not Python", _cmd("doctor", "--", "FILE", file=_file("r.py", "def (:\n")), 2,
         "not a Python script"),
    Case("doctor: recipe does not exist", _cmd("doctor", "--", "no_such_recipe.py"), 2, "no such file"),
    Case("doctor: recipe code is read, not run", _cmd("doctor", "--", "FILE", "--max_seq_length", "64",
         file=_planted_recipe), 0, "no problems found"),
    # plan: numbers past what floats and hardware hold
    Case("plan: --params 1e400", _cmd("plan", "--params", "1e400"), 2, "more parameters than any model has"),
    Case("plan: --params 1e30", _cmd("plan", "--params", "1e30"), 2, "more parameters than any model has"),
    Case("plan: --gpu-memory 1e400", _cmd("plan", "--params", "7e9", "--gpu-memory", "1e400"), 2,
         "more than any accelerator holds"),
    Case("plan: nothing fits is 1", _cmd("plan", "--params", "70e9", "--gpu", "T4"), 1, "nothing fits"),
    Case("plan --against: a FIFO", _cmd("plan", "--against", "FILE", file=_fifo), 2, "not a regular file"),
    Case("plan: a model config.json nested 100,000 deep", _cmd("plan", "--model", "FILE", file=_deep_model), 2,
         "nested too deeply"),
    Case("plan: a model whose config needs its own code", _cmd("plan", "--model", "FILE", file=_remote_code_model),
         2, "needs its own Python code"),
    Case("report: --output is a dangling symlink", lambda t, m: [
         "report", str(_run(t, "good", json.dumps(GOOD_SUMMARY))), "--output", str(_dangling(t))], 2,
         "a dangling symlink, not a folder"),
    Case("compare: --output-dir is a file", lambda t, m: [
         "compare", "--recipe", str(RECIPE), "--configs", "ddp", "--output-dir", str(_file("out", "mine")(t, m))], 2,
         "exists and is not a folder"),
    Case("report: --output is a file", lambda t, m: ["report", str(_run(t, "good", json.dumps(GOOD_SUMMARY))),
                                                     "--output", str(_file("out.md", "mine")(t, m))], 2,
         "is a file, not a folder"),
]


TIME_LIMIT_S = 60  # generous for 2 busy cores; a FIFO read or an anchor-bomb expansion would never finish


def _timed_out(signum, frame):
    raise TimeoutError(f"still running after {TIME_LIMIT_S} s")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_input(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no accelerate default config from this machine
    marker = tmp_path / "marker"
    argv = case.setup(tmp_path, marker)
    before = sorted(p.name for p in tmp_path.iterdir())
    previous = signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(TIME_LIMIT_S)
    try:
        code = main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    out, err = capsys.readouterr()
    assert (code, err.count("\n")) == (case.code, int(case.code == 2)), err
    assert case.fragment in (err if case.code == 2 else out) and "Traceback" not in err
    assert not marker.exists(), "planted code ran"
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a failed run left files behind"


def test_a_crash_is_exit_2_not_a_finding(monkeypatch, capsys):
    """doctor's 1 means findings; a bug inside it must not look like one."""
    import shardscope.cli.doctor

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(shardscope.cli.doctor, "diagnose", broken)
    assert main(["doctor"]) == 2
    assert "internal error in 'doctor'" in capsys.readouterr().err


def test_planted_pickles_are_live(tmp_path):
    """The plants do run when unpickled plainly: the cases above prove something."""
    marker = tmp_path / "marker"
    pickle.loads(pickle.dumps(Planted(marker)))
    assert marker.exists()
    marker.unlink()
    torch.load(torch_archive(tmp_path / "f.pt", pickle.dumps(Planted(marker), protocol=4)), weights_only=False)
    assert marker.exists()


# ----------------------------------------------------------------------------- genuine DCP, in process


@pytest.fixture(scope="module")
def genuine_dcp(tmp_path_factory):
    """A tiny Llama's changed weights saved the way accelerate saves FSDP's SHARDED_STATE_DICT
    ({"model": state_dict}) plus a planted non-tensor entry; returns (checkpoint, base model, weights, marker)."""
    from shardscope.recipes.tiny import make_causal_lm

    root = tmp_path_factory.mktemp("dcp")
    base = root / "base"
    model = make_causal_lm(base, "llama")
    generator = torch.Generator().manual_seed(0)
    weights = {k: v + torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}
    marker = root / "marker"
    folder = dcp_checkpoint(root / "checkpoint-1" / "pytorch_model_fsdp_0",
                            {"model": weights, "extra": {"note": Planted(marker)}})
    return folder.parent, base, weights, marker


@pytest.mark.parametrize("trust", [False, True])
def test_genuine_dcp_exports(genuine_dcp, tmp_path, trust):
    from safetensors.torch import load_file

    checkpoint, base, weights, marker = genuine_dcp
    out = tmp_path / "model"
    assert main(["export", str(checkpoint), str(out), "--model", str(base)] + ["--trust-pickle"] * trust) == 0
    exported = load_file(out / "model.safetensors")
    for key, value in exported.items():
        assert torch.equal(value, weights[key]), key
    assert not marker.exists()
    umask = os.umask(0o022)
    os.umask(umask)
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o666 & ~umask)}
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~umask)


def test_dcp_non_tensor_entries_are_never_unpickled(genuine_dcp, tmp_path):
    """Exporting never reads the planted entry; torch's own DCP conversion does, and runs it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint, base, _, marker = genuine_dcp
    assert main(["export", str(checkpoint), str(tmp_path / "model"), "--model", str(base)]) == 0
    assert not marker.exists()
    dcp_to_torch_save(checkpoint / "pytorch_model_fsdp_0", tmp_path / "plain.pt")
    assert marker.exists()
    marker.unlink()


# ----------------------------------------------------------------------------- report: degrade, don't die

BAD_SUMMARIES = {  # run name -> (summary file content, what its failed row's reason says)
    "nan": (json.dumps(GOOD_SUMMARY).replace("900", "NaN"), "NaN is not a JSON number"),
    "inf": (json.dumps(GOOD_SUMMARY).replace("900", "1e999"), "inf is not a usable number"),
    "huge": (json.dumps(GOOD_SUMMARY).replace("900", "9" * 400), "(400 digits) is too large"),
    "truncated": (json.dumps(GOOD_SUMMARY)[:40], "malformed JSON"),
    "binary": (BINARY, "a binary file"),
    "fifo": ("FIFO", "not a regular file"),
    "foreign": (json.dumps({"hello": "world"}), "has no key 'world_size'"),
    "no_components": (json.dumps({**GOOD_SUMMARY, "ranks": [{"peak_memory_bytes": 1}]}), "ranks[0].params_bytes"),
}


def test_report_turns_bad_summaries_into_failed_rows(tmp_path, capsys):
    """One good run (and one without peak memory) among bad ones: exit 1, every bad run a failed row naming its
    file and reason, the report written, report.json strict JSON."""
    runs = [_run(tmp_path, "good", json.dumps(GOOD_SUMMARY))]
    no_peak = {**GOOD_SUMMARY, "ranks": [{k: v for k, v in GOOD_SUMMARY["ranks"][0].items() if "peak" not in k}]}
    runs.append(_run(tmp_path, "no_peak", json.dumps(no_peak)))
    runs += [_run(tmp_path, name, content) for name, (content, _) in BAD_SUMMARIES.items()]
    previous = signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(TIME_LIMIT_S)  # a FIFO read would block forever
    try:
        code = main(["report", *map(str, runs), "--output", str(tmp_path / "report")])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    out, err = capsys.readouterr()
    assert code == 1 and err == "", err
    assert f"(2/{len(runs)} runs succeeded)" in out

    def strict(name):
        raise AssertionError(f"report.json holds {name}")

    rows = {r["run"]: r for r in json.loads((tmp_path / "report" / "report.json").read_text(), parse_constant=strict)}
    assert rows["good"]["status"] == rows["no_peak"]["status"] == "ok"
    markdown = (tmp_path / "report" / "report.md").read_text()
    for name, (_, reason) in BAD_SUMMARIES.items():
        row = rows[name]
        assert row["status"] == "failed" and reason in row["reason"], row
        assert str(tmp_path / name / "shardscope_summary.json") in row["reason"] and row["reason"] in markdown
        assert f"failed: {name}: " in out
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["memory.png", "peak.png", "report.json",
                                                                        "report.md", "steps.png", "throughput.png",
                                                                        "time.png"]


def test_a_report_that_fails_half_way_leaves_the_old_markdown(tmp_path, monkeypatch):
    """Every report file is replaced atomically and the Markdown last: a crash while plotting leaves the
    previous report.md whole and no temporary files."""
    import shardscope.report.compare

    run = _run(tmp_path, "good", json.dumps(GOOD_SUMMARY))
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.md").write_text("the previous report")

    def broken(runs, path):
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(shardscope.report.compare, "plot_throughput", broken)
    assert main(["report", str(run), "--output", str(report)]) == 2
    assert (report / "report.md").read_text() == "the previous report"
    assert sorted(p.name for p in report.iterdir()) == ["memory.png", "report.md"]


# ----------------------------------------------------------------------------- bounded readers (property tests)

json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text(max_size=8)
                           | st.floats(allow_nan=False, allow_infinity=False),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                      max_size=4), max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_readers_return_what_was_written(value):
    assert parse_json(json.dumps(value), "x") == value
    assert parse_yaml(yaml.safe_dump(value), "x") == value


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_readers_never_raise_anything_but_usage_error(text):
    for parse in (parse_json, parse_yaml):
        try:
            parse(text, "x")
        except UsageError as error:
            assert "\n" not in str(error).strip()


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_files_of_any_bytes_are_read_or_refused_in_one_line(tmp_path_factory, data):
    for suffix in (".json", ".yaml"):
        path = tmp_path_factory.mktemp("bytes") / f"f{suffix}"
        path.write_bytes(data)
        try:
            load_data(path)
        except UsageError as error:
            assert str(error).startswith(str(path)) and "\n" not in str(error).strip()


@pytest.mark.parametrize("depth, refused", [(MAX_DEPTH, False), (MAX_DEPTH + 1, True)])
def test_depth_limit_is_exact(depth, refused):
    text = "[" * depth + "]" * depth
    for parse in (parse_json, parse_yaml):
        if refused:
            with pytest.raises(UsageError, match="nested too deeply"):
                parse(text, "x")
        else:
            assert parse(text, "x") is not None


def test_anchor_bomb_is_refused_in_bounded_memory():
    """Refused unexpanded (how long that takes: benchmarks/failure_speed.py)."""
    import tracemalloc

    tracemalloc.start()
    with pytest.raises(UsageError, match="anchor bomb"):
        parse_yaml(BOMB, "bomb.yaml")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 10 * 2**20  # bytes; expanded it would be ~3 GB
    shared = "base: &b {k: 1}\nuses: [*b, *b, *b]\n"  # ordinary aliases still load
    assert parse_yaml(shared, "x") == {"base": {"k": 1}, "uses": [{"k": 1}] * 3}
    with pytest.raises(UsageError, match="recursive"):
        parse_yaml("a: &a [1, *a]\n", "x")


# ----------------------------------------------------------------------------- atomic writes


def test_atomic_write_replaces_whole_files_with_ordinary_permissions(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    atomic_write_text(target, "new")
    umask = os.umask(0o022)
    os.umask(umask)
    assert target.read_text() == "new" and oct(target.stat().st_mode & 0o777) == oct(0o666 & ~umask)
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write_text(link, "through the link")  # a symlink is followed, not replaced
    assert link.is_symlink() and target.read_text() == "through the link"


@pytest.mark.parametrize("make, fragment", [
    (lambda p: p.symlink_to(p.parent / "missing"), "a dangling symlink"),
    (lambda p: p.mkdir(), "a folder; give a file path"),
    (lambda p: None, "does not exist"),  # the parent below is missing
])
def test_atomic_write_refuses_unusable_targets(tmp_path, make, fragment):
    target = tmp_path / "out.json" if fragment != "does not exist" else tmp_path / "no" / "out.json"
    make(target)
    with pytest.raises(UsageError, match=fragment):
        atomic_write_text(target, "x")


def test_a_failed_write_keeps_the_old_file(tmp_path):
    """A write that fails half-way (here: the file-size limit, which holds for root too) leaves the old file."""
    import resource

    target = tmp_path / "out.json"
    target.write_text("old")
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, limits[1]))
    try:
        with pytest.raises(UsageError, match="cannot be written"):
            atomic_write_text(target, "new " * 100)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.json"]


# ----------------------------------------------------------------------------- models: speed and remote code


def test_a_missing_model_asks_the_hub_once_without_hf_hub_offline(tmp_path):
    """Without HF_HUB_OFFLINE the hub is asked once (huggingface_hub alone retried an unreachable hub for ~25 s),
    and a missing local folder not at all. The hub here is a local socket (HF_ENDPOINT) that drops every
    connection and keeps each request line. (With HF_HUB_OFFLINE set: test_planner's missing hub id; how long
    it takes: benchmarks/failure_speed.py.)"""
    requests, stop = [], threading.Event()
    with socket.socket() as hub:
        hub.bind(("127.0.0.1", 0))
        hub.listen()
        hub.settimeout(0.2)

        def serve():
            while not stop.is_set():
                try:
                    conn, _ = hub.accept()
                except OSError:  # socket.timeout included: look at `stop` again
                    continue
                with conn:
                    requests.append(conn.recv(4096).split(b"\r\n", 1)[0].decode())

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        env = {k: v for k, v in cpu_env().items() if k != "HF_HUB_OFFLINE"}
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{hub.getsockname()[1]}"

        def recipe(model):
            proc = subprocess.run([sys.executable, str(RECIPE), "--model_name_or_path", model, "--output_dir",
                                   str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=180)
            assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
            assert f"'{model}'" in proc.stderr and "Traceback" not in proc.stderr
            return proc.stderr

        try:
            recipe("./no/such/folder")
            folder_requests = list(requests)
            stderr = recipe("shardscope-test/no-such-model")
        finally:
            stop.set()
            server.join()
    assert "is not a local folder" in stderr
    assert not [r for r in folder_requests if "/api/models/" in r or "/resolve/" in r], folder_requests
    model_requests = [r for r in requests if "no-such-model" in r]
    assert model_requests == ["GET /api/models/shardscope-test/no-such-model HTTP/1.1"], requests


def test_remote_code_never_runs_unless_asked(tmp_path):
    from shardscope.model.spec import load_model_config

    marker = tmp_path / "marker"
    folder = _remote_code_model(tmp_path, marker)
    with pytest.raises(UsageError, match="needs its own Python code to load"):
        load_model_config(str(folder))
    assert not marker.exists()
    assert load_model_config(str(folder), trust_remote_code=True).model_type == "shardscope_custom"
    assert marker.exists()  # the opt-in really runs it
