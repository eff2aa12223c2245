"""Hostile and broken input, in process: every case is one line on stderr with its documented exit code, and
nothing a file plants is ever executed.

Planted code: `Planted(marker)` unpickles to a call of `exec` that creates the marker file. The cases put it in a
ZeRO `*_model_states.pt` / `*_optim_states.pt` (also hidden from torch's static scan by protocol-4 framing, so the
weights_only load itself must refuse it), in a DCP `.metadata`, and as a non-tensor entry of a genuine DCP
checkpoint (which torch's own DCP loader does execute: `test_dcp_non_tensor_entries_are_never_unpickled`
shows the plant is live). A genuine ZeRO checkpoint exporting with --trust-pickle is in test_export.py.
"""
from __future__ import annotations

import io
import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from shardscope.cli import main


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
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_input(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "marker"
    argv = case.setup(tmp_path, marker)
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(argv)
    err = capsys.readouterr().err
    assert (code, err.count("\n")) == (case.code, 1), err
    assert case.fragment in err and "Traceback" not in err
    assert not marker.exists(), "planted code ran"
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a failed run left files behind"


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
    from shardscope.tiny import make_causal_lm

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
