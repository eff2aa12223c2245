"""A profiled run's step time, predicted (`time_model.step_time` at the run's own setup) beside measured.

The run's setup comes from its summary (read and checked by `summary.read_summary`, `run_of`, `step_shape`): the
model (`model.name_or_path`, read as `plan --model` reads it, else its parameter count), the strategy, world size and
nodes, precision, and the step shape the profiler recorded (`peak_step`: micro-batch, sequence length,
checkpointing) with `gradient_accumulation_steps`. Measured: the mean over ranks of `step_seconds` {median, p10, p90}.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from ..model.spec import model_spec
from ..plan.calibration.figures import assumed_figures, calibrate
from ..plan.calibration.run_dirs import run_sources, scaled_breakdown, timed_ranks
from ..plan.mesh import Setup
from ..plan.planner import estimate
from ..plan.time_model import PARTS, Figures, step_time
from ..summary import SUMMARY_FILE, read_summary, run_of, step_shape

EXPLAINED = 0.02  # a prediction within 2% of the median has nothing to explain


def run_setup(doc: dict, where) -> tuple:
    """(spec, setup, strategy, note) of a summary's run; `note` says when the model's folder could not be read and
    its parameter count stood for it (a Llama shape of that size), else ""."""
    run = run_of(doc, where)
    step = step_shape(doc["ranks"][0], f"summary '{where}': key 'ranks[0].peak_step'")
    if step is None:
        raise UsageError(f"summary '{where}': no recorded step shape ('peak_step')")
    name, note = doc["model"].get("name_or_path"), ""
    try:
        if not name or not Path(name).exists():
            raise UsageError(f"its model folder {name or '(not recorded)'} is not on this machine")
        spec = model_spec(name)
    except UsageError as error:
        spec = model_spec(None, params=doc["model"]["params_total"])
        note = (f"predicted from the parameter count ({doc['model']['params_total']:,}, a Llama shape assumed): "
                f"{str(error).rstrip('.')}")
    nodes = run["num_nodes"]
    setup = Setup(gpus_per_node=run["world_size"] // nodes, nodes=nodes, precision=run["precision"],
                  micro_batch=step["micro_batch"], seq_len=step["seq_len"] or 2048,
                  grad_accum_steps=run["grad_accum_steps"] or 1,
                  activation_checkpointing=bool(step["gradient_checkpointing"])).validate()
    return spec, setup, run["strategy"], note


def measured(doc: dict) -> dict | None:
    """Mean over ranks of the median, p10 and p90 plain step (None: not measured)."""
    times = [r["step_seconds"] for r in doc.get("ranks") or [] if r.get("step_seconds")]
    if not times:
        return None
    return {k: sum(t[k] for t in times) / len(times) for k in ("median", "p10", "p90")}


def predict_run(path, fig: Figures) -> dict:
    """{run, strategy, accumulation, checkpointing, predicted_s, parts, measured {median, p10, p90}, error} of a run."""
    path = Path(path)
    file = path / SUMMARY_FILE if path.is_dir() else path
    doc = read_summary(file)
    spec, setup, strategy, note = run_setup(doc, file)
    planned = estimate(spec, setup)
    row = next(r for r in planned["rows"] if r.strategy == strategy)
    predicted = step_time(row, spec, planned["model"], setup, planned["activations"]["tokens_per_sample"], fig)
    real = measured(doc)
    error = (predicted["step_time_s"] - real["median"]) / real["median"] if real else None
    return {"run": str(path), "strategy": strategy, "accumulation": setup.grad_accum_steps,
            "checkpointing": setup.activation_checkpointing, "model_note": note,
            "predicted_s": predicted["step_time_s"],
            "parts": predicted["step_time_parts"], "measured": real, "error": error,
            "measured_parts": measured_parts(doc)}


def measured_parts(doc: dict) -> dict | None:
    """The timed step's breakdown in the model's parts, scaled to the median plain step (mean over ranks)."""
    ranks = timed_ranks(doc)
    if not ranks:
        return None
    b = scaled_breakdown(ranks)
    library = b.get("library_s", 0.0)
    return {"compute": b["forward_s"] + b["backward_s"] - library, "exposed_comm": b["exposed_comm_s"],
            "library": library, "optimizer": b["optimizer_s"], "offload": 0.0,
            "overhead": b["data_wait_s"] + b["other_s"]}


def explaining_part(prediction: dict) -> str | None:
    """The part whose predicted-minus-measured difference is largest, signed ("compute +0.1 s": predicted more),
    None when nothing to explain (no breakdown, or within EXPLAINED of the measured median)."""
    real = prediction.get("measured_parts")
    if not real or prediction.get("error") is None or abs(prediction["error"]) < EXPLAINED:
        return None
    part = max(PARTS, key=lambda p: abs(prediction["parts"][p] - real[p]))
    return f"{part} {prediction['parts'][part] - real[part]:+.2g} s"


def attach(runs: list[dict], measured: list[tuple[str, dict]] | None = None) -> None:
    """`report`/`compare`: each run row that finished gets `predicted_step` (`predict_run`), the model calibrated
    on `measured` [(source, figures)] (the user's --calibrate) or else on the first run that finished."""
    done = [r for r in runs if r.get("status") == "ok" and r.get("dir")]
    if not done and not measured:
        return
    try:
        measured = measured or run_sources(done[0]["dir"])
    except UsageError as error:  # the first run has no timed step: every row says so, the report goes on
        for r in done:
            r["predicted_step"] = {"error": str(error)}
        return
    fig, _ = calibrate(measured, assumed_figures("the runs' GPU not read"))
    sources = [source for source, _ in measured]
    for r in done:
        try:
            r["predicted_step"] = {**predict_run(r["dir"], fig), "calibrated_from": sources}
        except (UsageError, StopIteration, KeyError, TypeError, ValueError, ZeroDivisionError) as error:
            # a summary the report could read but the model cannot use: said in its row, the report goes on
            r["predicted_step"] = {"error": f"not predicted ({type(error).__name__}: {error or 'no planner row'})"}


def markdown_lines(runs: list[dict]) -> list[str]:
    """Predicted beside measured step time per run, and the part that explains the difference."""
    rows = [r for r in runs if r.get("predicted_step")]
    if not rows:
        return []
    source = next((r["predicted_step"]["calibrated_from"] for r in rows if "calibrated_from" in r["predicted_step"]),
                  None)
    lines = ["## Step time: predicted beside measured", "",
             f"The step-time model (docs/fit.md) at each run's own setup, calibrated from {', '.join(source or ['-'])} "
             "(`--calibrate` to choose); measured: the median plain step (p10-p90). The part named is the one whose "
             "prediction is furthest from the run's timed step breakdown (scaled to the median).", "",
             "| run | predicted | measured median | p10-p90 | error | part that explains it |", "|---|---|---|---|---|---|"]
    for r in rows:
        p = r["predicted_step"]
        if "error" in p and "predicted_s" not in p:
            lines.append(f"| {r['run']} | - | - | - | - | {p['error']} |")
            continue
        m = p["measured"]
        real = f"{m['median']:.3g} s" if m else "-"
        spread = f"{m['p10']:.3g}-{m['p90']:.3g} s" if m else "-"
        error = f"{p['error']:+.1%}" if p["error"] is not None else "-"
        lines.append(f"| {r['run']} | {p['predicted_s']:.3g} s | {real} | {spread} | {error} | "
                     f"{explaining_part(p) or '-'} |")
    notes = [f"- {r['run']}: {r['predicted_step']['model_note']}" for r in rows if r["predicted_step"].get("model_note")]
    return lines + [""] + (notes + [""] if notes else [])
