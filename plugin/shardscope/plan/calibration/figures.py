"""The figures the step-time model uses for a GPU and a precision: its datasheet's, or measured (`--calibrate`).

Datasheet: `hardware(gpu, precision)`, the GPU's dense peak (`units.PEAK_TFLOPS`) and its `time_model.DATASHEETS`
entry (HBM, SMs, links). The H100 fallback is decided here and nowhere else (`ASSUMED_GPU`): a GPU without a datasheet
entry takes the H100's entry, said to be assumed; a GPU whose dense peak is unknown (no --gpu, a CPU run, a GPU the
table lacks) has no datasheet figures, and each command says what then (`hardware_for`): an error, no step time, the
measured figures alone over the H100's (`assumed_figures`), or the H100's to rank with.

Measured: each --calibrate path read by its reader (`measured_figures`: a run folder, `run_dirs`; a calibration.json,
`calibration_json`; a preflight.json, `preflight_json`), then merged over the datasheet's (`calibrate`). A figure
several sources give is taken from the first that has it (so a run with its link probe, or `RUN_DIR preflight.json`:
the run's figures, and for the collective kinds the run never issued the probe's or preflight's bandwidth as
measured: not scaled by the run's speed of another kind, which for DDP is an all-reduce slowed by the backward it
overlaps, while ZeRO-3's and FSDP's gathers run alone on CPU); a kind nothing measured takes the slowest measured
kind's bandwidth and hidden share (the same link: NCCL's bus bandwidths compare across kinds, gloo's do not, its
all_gather and reduce_scatter being far slower than its all_reduce: benchmarks/results/time_prediction.md); figures
no run measured stay datasheet. A run's figures name the strategy it ran (`run_dirs.RUN_STRATEGY`, not a figure):
the rows of that strategy take that run's figures first and the other sources' after (`Figures.own`), so a row
calibrated from a run of its own strategy reproduces that run; every other row takes the order given.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ...errors import UsageError
from ...safe_io import load_json
from ...summary import SUMMARY_FILE
from ...units import peak_flops
from ..time_model import DATASHEETS, Figures, Hardware, datasheet_figures
from .calibration_json import CALIBRATION_FILE, read_calibration
from .preflight_json import PREFLIGHT_FILE, calibration_from_preflight, preflight_figures
from .run_dirs import INSIDE_A_RUN, RUN_STRATEGY, run_sources

ASSUMED_GPU = "H100"  # a GPU without a datasheet entry, or without a peak where a command allows, takes its figures
PER_KIND = ("bus_bytes_per_s", "hidden_share", "library_s_per_byte")  # dicts: per collective kind, per library


# ----------------------------------------------------------------------------- the datasheet's
def datasheet_key(gpu: str | None) -> str | None:
    """The `DATASHEETS` entry of a GPU name, or None."""
    name = (gpu or "").upper().replace(" ", "-")
    key = next((k for k in DATASHEETS if k in name), None)  # "NVIDIA H100 NVL" too; H100-NVL before H100
    return "A100-40" if key == "A100" and "40GB" in name else key  # a device's own name: "A100-SXM4-40GB"


def hardware(gpu: str | None, precision: str, peak_tflops: float | None = None, **overrides) -> Hardware:
    """The stated assumptions for a GPU name (`units.GPUS`); `peak_tflops` where the table has none; a GPU without a
    datasheet entry: the ASSUMED_GPU's, said so."""
    dtype = {"fp32": "fp32", "fp16-mixed": "fp16"}.get(precision, "bf16")
    name = gpu or "unknown GPU"
    if peak_tflops is not None:
        peak, source = peak_tflops * 1e12, "--peak-tflops"
    else:
        peak = peak_flops((gpu or "").replace("-", " "), dtype)
        source = f"{name} datasheet, {dtype}"
        if peak is None:
            raise UsageError(f"no dense peak FLOP/s known for {name} at {dtype}: give --peak-tflops "
                             "(the step-time ranking needs it), or --gpu with a known GPU")
    key = datasheet_key(gpu)
    hbm, sms, nvlink, pcie, links = DATASHEETS[key or ASSUMED_GPU]
    whose = f"{key} datasheet" if key else f"assumed ({ASSUMED_GPU}'s: no datasheet entry for {name})"
    values = dict(gpu=name, peak_flops=peak, peak_source=source, nvlink_bytes_per_s=nvlink * 1e9,
                  pcie_bytes_per_s=pcie * 1e9, link_source=f"{links} ({whose})", hbm_bytes_per_s=hbm, sms=sms,
                  datasheet=whose)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Hardware(**values)


def hardware_for(gpu: str | None, precision: str, peak_tflops: float | None = None, unknown: str = "raise",
                 **overrides) -> Hardware | None:
    """`hardware`, and where the GPU's dense peak is unknown what `unknown` says: "raise" its UsageError, "none" no
    datasheet (no step time, or measured figures over `assumed_figures`), "assume" the ASSUMED_GPU's (only to rank
    candidates with: its `peak_source` starts "assumed")."""
    try:
        return hardware(gpu, precision, peak_tflops, **overrides)
    except UsageError:
        if unknown == "none":
            return None
        if unknown != "assume":
            raise
    return replace(hardware(ASSUMED_GPU, precision, **overrides),
                   peak_source=f"assumed ({ASSUMED_GPU}'s: no dense peak known for {gpu or 'this device'})")


def assumed_figures(why: str) -> Figures:
    """The ASSUMED_GPU's datasheet figures (bf16), every source said to be assumed (`why`): what measured figures go
    over when there is no datasheet."""
    base = datasheet_figures(hardware(ASSUMED_GPU, "bf16-mixed"))
    return replace(base, sources=dict.fromkeys(base.sources, f"assumed ({ASSUMED_GPU}'s: {why})"))


# ----------------------------------------------------------------------------- measured, over the datasheet's
def calibrate(measured: list[tuple[str, dict]], base: Figures) -> tuple[Figures, dict]:
    """`base` with the figures `measured` [(source, figures)] gave, the first source first, and for each strategy a
    run ran, what its rows take with that run's sources first (`Figures.own`: the figures that differ); and the
    `calibration` record {figure: {value, run}} (per collective kind for bandwidth and hidden share, per library for
    its work) of the order given."""
    fig, record = merged(measured, base)
    own = {}
    for strategy in dict.fromkeys(f[RUN_STRATEGY] for _, f in measured if f.get(RUN_STRATEGY)):
        first = [m for m in measured if m[1].get(RUN_STRATEGY) == strategy]
        mine = merged(first + [m for m in measured if m[1].get(RUN_STRATEGY) != strategy], base)[0]
        changed = {k: v for k, v in vars(mine).items() if v != getattr(fig, k)}
        if changed:
            own[strategy] = changed
    return replace(fig, own=own), record


def merged(measured: list[tuple[str, dict]], base: Figures) -> tuple[Figures, dict]:
    """`base` with the figures `measured` gave, each taken from the first source that has it; the record."""
    record: dict = {}
    for source, figures in measured:
        for name, value in figures.items():
            if name == RUN_STRATEGY:
                continue
            if name in PER_KIND:
                kinds = record.setdefault(name, {})
                for kind, v in value.items():
                    kinds.setdefault(kind, {"value": v, "run": str(source)})
            else:
                record.setdefault(name, {"value": value, "run": str(source)})
    changes, sources = {}, dict(base.sources)
    for name, entry in record.items():
        if name in PER_KIND:  # a kind no run issued crosses the same link: the measured kinds' slowest figure
            least = min(e["value"] for e in entry.values())
            changes[name] = {**dict.fromkeys(getattr(base, name), least), **{k: e["value"] for k, e in entry.items()}}
            runs = sorted({e["run"] for e in entry.values()})
            missing = sorted(set(getattr(base, name)) - set(entry))
            sources[name] = "measured on " + ", ".join(runs) + (
                f" ({', '.join(missing)}: as {', '.join(sorted(entry))}; a run's link probe or a preflight.json measures each kind)"
                if missing else "")
        else:
            changes[name] = entry["value"]
            sources[name] = (f"inside what {entry['run']} measured" if name in INSIDE_A_RUN else
                             f"measured on {entry['run']}")
    return replace(base, **changes, sources=sources), record


# ----------------------------------------------------------------------------- which figures a command uses
def measured_figures(paths, expect: dict | None = None) -> list[tuple[str, dict]]:
    """[(source, figures)] of each --calibrate path, read by its reader: a run folder (its summary), a
    calibration.json (`shardscope calibrate`; `expect`: `calibration_json.expectation`, what it must have been
    measured on) or a preflight.json."""
    out = []
    for path in map(Path, paths):
        if path.is_dir() and (path / SUMMARY_FILE).is_file() or path.name == SUMMARY_FILE and path.is_file():
            out.extend(run_sources(path))
            continue
        if path.is_dir() and (path / CALIBRATION_FILE).is_file():
            path = path / CALIBRATION_FILE
        doc = load_json(path, "--calibrate file") if path.is_file() else None
        if isinstance(doc, dict) and "calibration_version" in doc:
            out.extend(read_calibration(doc, path, expect))
            continue
        preflight = path / PREFLIGHT_FILE if path.is_dir() else path
        if not preflight.is_file():
            raise UsageError(f"--calibrate {path}: neither a run folder with {SUMMARY_FILE}, a {CALIBRATION_FILE} "
                             f"nor a {PREFLIGHT_FILE}")
        out.append((str(path), preflight_figures(calibration_from_preflight(preflight))))
    return out


def figures_for(hw: Hardware | None, paths, expect: dict | None = None) -> tuple[Figures | None, dict | None]:
    """The figures a command ranks with: the datasheet of `hw` (None: no datasheet, no figures), with what `paths`
    measured in their place; without a datasheet every figure the model needs must be measured, the rest are the
    ASSUMED_GPU's and say so."""
    if not paths:
        return (datasheet_figures(hw) if hw is not None else None), None
    base = datasheet_figures(hw) if hw is not None else assumed_figures("--gpu not known")
    fig, record = calibrate(measured_figures(paths, expect), base)
    if hw is None and "flops_per_s" not in record:
        raise UsageError(f"--calibrate {' '.join(map(str, paths))}: no achieved FLOP/s measured and no datasheet "
                         "peak (give --gpu with a known GPU)")
    return fig, record
