"""calibration.json, what `shardscope calibrate` writes and `--calibrate` reads: the figures each of its runs measured.

    {"calibration_version": 1, "model": {"name", "params_total", "trainable_params"}, "precision",
     "fingerprint": {machine facts: host, gpu, gpu_count, backend, library versions},
     "runs": [{"family", "strategy", "config", "run_dir", "log", "status": "ok" | "failed", "reason",
               "log_tail": [...], "figures": [{"source", "figures"}]}]}

The figures are `plan.calibration.run_sources` of each run folder at the time, so the file stands alone.
"""
from __future__ import annotations

import sys

from ..errors import UsageError

VERSION = 1
RUN_STRATEGY = "strategy"  # in a run's figures: the strategy it ran (not a figure; its rows take them first)
MACHINE_KEYS = ("host", "gpu", "gpu_count", "backend", "torch", "cuda", "deepspeed", "accelerate", "transformers")


def machine(fingerprint: dict) -> dict:
    """The fingerprint's facts a calibration depends on."""
    return {k: fingerprint[k] for k in MACHINE_KEYS if k in fingerprint}


def read_calibration(doc: dict, path, expect: dict | None = None) -> list[tuple[str, dict]]:
    """[(source, figures)] of the runs that finished, in the order they ran; a file for another model or precision
    is one UsageError line naming it; another machine's is used with one warning line naming what differs.
    `expect`: {"params_total", "precision", "fingerprint": a function giving this machine's}."""
    where = f"--calibrate {path}"
    if doc.get("calibration_version") != VERSION:
        raise UsageError(f"{where}: 'calibration_version' is {doc.get('calibration_version')!r}, not {VERSION}")
    try:
        model, precision, runs = doc["model"], doc["precision"], doc["runs"]
        expect = expect or {}
        for key, have in (("params_total", model["params_total"]), ("precision", precision)):
            want = expect.get(key)
            if want is not None and have != want:
                raise UsageError(f"{where}: measured with {key} {have!r} ({model.get('name')}), this plan has "
                                 f"{want!r}: calibrate on the same model and precision")
        if expect.get("fingerprint"):
            here = machine(expect["fingerprint"]())
            there = machine(doc.get("fingerprint") or {})
            differ = [f"{k} {there.get(k)!r} there, {here.get(k)!r} here" for k in MACHINE_KEYS
                      if k in here and here.get(k) != there.get(k)]
            if differ:
                print(f"shardscope: warning: {where}: measured on another machine ({'; '.join(differ)}): its "
                      "figures are used as they are", file=sys.stderr)
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
