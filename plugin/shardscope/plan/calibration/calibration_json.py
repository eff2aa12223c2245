"""calibration.json, what `shardscope calibrate` writes and `--calibrate` reads: the figures each of its runs measured.

    {"calibration_version": 1, "model": {"name", "params_total", "trainable_params"}, "precision",
     "fingerprint": {machine facts: host, gpu, gpu_count, backend, library versions},
     "runs": [{"family", "strategy", "config", "run_dir", "log", "status": "ok" | "failed", "reason",
               "log_tail": [...], "figures": [{"source", "figures"}]}]}

The figures are `run_dirs.run_sources` of each run folder at the time, so the file stands alone; the fingerprint is
`this_machine()` where it ran, compared with this machine's when a plan reads the file.
"""
from __future__ import annotations

import socket
import sys
from importlib import metadata

from ...errors import UsageError
from .run_dirs import RUN_STRATEGY

CALIBRATION_FILE = "calibration.json"  # what `shardscope calibrate` writes in its output folder
VERSION = 1
MACHINE_KEYS = ("host", "gpu", "gpu_count", "backend", "torch", "cuda", "deepspeed", "accelerate", "transformers")
LIBRARIES = ("torch", "deepspeed", "accelerate", "transformers")


def machine(fingerprint: dict) -> dict:
    """The fingerprint's facts a calibration depends on."""
    return {k: fingerprint[k] for k in MACHINE_KEYS if k in fingerprint}


def this_machine(device=None) -> dict[str, str]:
    """This process's facts a calibration depends on, every value a string (`device`: the GPU this process uses, None:
    the current one): what `shardscope calibrate` writes, what a plan compares, the start of preflight's fingerprint."""
    import torch

    facts = {"host": socket.gethostname(), "cuda": torch.version.cuda or "none (CPU build)"}
    for library in LIBRARIES:
        try:
            facts[library] = metadata.version(library)
        except metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        index = torch.cuda.current_device() if device is None else torch.device(device).index or 0
        facts.update(backend="nccl", gpu=torch.cuda.get_device_name(index), gpu_count=str(torch.cuda.device_count()))
    else:
        facts.update(backend="gloo", gpu_count="0")
    return machine(facts)


def expectation(spec, setup) -> dict:
    """What a calibration.json read for this plan must have been measured on: its model and precision."""
    return {"params_total": spec.params_total, "precision": setup.precision}


def read_calibration(doc: dict, path, expect: dict | None = None) -> list[tuple[str, dict]]:
    """[(source, figures)] of the runs that finished, in the order they ran. With `expect` (`expectation`): a file for
    another model or precision is one UsageError line naming it; another machine's is used with one warning line
    naming what differs."""
    where = f"--calibrate {path}"
    if doc.get("calibration_version") != VERSION:
        raise UsageError(f"{where}: 'calibration_version' is {doc.get('calibration_version')!r}, not {VERSION}")
    try:
        model, precision, runs = doc["model"], doc["precision"], doc["runs"]
        if expect is not None:
            for key, have in (("params_total", model["params_total"]), ("precision", precision)):
                if have != expect[key]:
                    raise UsageError(f"{where}: measured with {key} {have!r} ({model.get('name')}), this plan has "
                                     f"{expect[key]!r}: calibrate on the same model and precision")
            warn_if_elsewhere(doc, where)
        out = []
        for run in runs:
            if run["status"] != "ok":
                continue
            out.extend((f"{path} ({entry['source']})", {RUN_STRATEGY: run.get("strategy"), **entry["figures"]})
                       for entry in run["figures"])  # (files written before runs named their strategy: the run's)
        if not out:
            raise UsageError(f"{where}: no run finished ('runs' has no status 'ok'): nothing measured")
        return out
    except (KeyError, TypeError, AttributeError) as error:
        raise UsageError(f"{where}: malformed calibration file ({type(error).__name__}: {error})") from None


def warn_if_elsewhere(doc: dict, where: str) -> None:
    """One warning line when the file was measured on another machine (its figures are used as they are)."""
    here, there = this_machine(), machine(doc.get("fingerprint") or {})
    differ = [f"{k} {there.get(k)!r} there, {here.get(k)!r} here" for k in MACHINE_KEYS
              if k in here and here.get(k) != there.get(k)]
    if differ:
        print(f"shardscope: warning: {where}: measured on another machine ({'; '.join(differ)}): its figures are used "
              "as they are", file=sys.stderr)
