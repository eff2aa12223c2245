"""The step-time model on the command line: `--calibrate`, the figures `plan`, `fit` and `report` use, `plan`'s rows."""
from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from ..plan.calibration import calibrate, from_links, run_sources
from ..plan.time_model import PARTS, Figures, datasheet_figures, describe, hardware, step_time
from ..summary import SUMMARY_FILE


def add_calibrate_argument(group, default_help: str = "") -> None:
    group.add_argument("--calibrate", nargs="+", metavar="RUN_DIR",
                       help="profiled run folders (shardscope_summary.json) or preflight.json files: the step-time "
                            f"model's figures measured there instead of the datasheet{default_help} (docs/fit.md)")


def measured_figures(paths) -> list[tuple[str, dict]]:
    """[(path, figures)] of each --calibrate path: a run folder (its summary) or a preflight.json."""
    from ..preflight.calibration import calibration_from_preflight

    out = []
    for path in map(Path, paths):
        if path.is_dir() and (path / SUMMARY_FILE).is_file() or path.name == SUMMARY_FILE and path.is_file():
            out.extend(run_sources(path))
            continue
        preflight = path / "preflight.json" if path.is_dir() else path
        if not preflight.is_file():
            raise UsageError(f"--calibrate {path}: neither a run folder with {SUMMARY_FILE} nor a preflight.json")
        out.append((str(path), from_links(calibration_from_preflight(preflight))))
    return out


def figures(hw, paths) -> tuple[Figures | None, dict | None]:
    """Datasheet figures of `hw` (None: no datasheet), with what `paths` measured in their place."""
    if not paths:
        return (datasheet_figures(hw) if hw is not None else None), None
    base = datasheet_figures(hw) if hw is not None else None
    if base is None:  # no datasheet: every figure the model needs must be measured
        base = datasheet_figures(hardware("H100", "bf16-mixed"))
        base = Figures(**{**vars(base), "sources": dict.fromkeys(base.sources, "H100 datasheet (--gpu not known)")})
    fig, record = calibrate(measured_figures(paths), base)
    if hw is None and "flops_per_s" not in record:
        raise UsageError(f"--calibrate {' '.join(map(str, paths))}: no achieved FLOP/s measured and no datasheet "
                         "peak (give --gpu with a known GPU)")
    return fig, record


def annotate_rows(result: dict, spec, setup, fig: Figures | None) -> None:
    """Each `plan` row gets `step_time_s` and `step_time_parts` at the plan's micro-batch, accumulation and
    checkpointing (None without a GPU name or --calibrate)."""
    tokens = result["activations"]["tokens_per_sample"]
    for row in result["rows"]:
        if fig is not None:
            predicted = step_time(row, spec, result["model"], setup, tokens, fig)
            row.step_time_s, row.step_time_parts = predicted["step_time_s"], predicted["step_time_parts"]
    result["step_time_assumptions"] = describe(fig) if fig else ["no step time: give --gpu NAME or --calibrate"]


def format_step_times(result: dict) -> list[str]:
    """`plan`'s step-time block: one line per row, then the assumptions."""
    rows = [r for r in result["rows"] if r.get("step_time_s") is not None]
    if not rows:
        return ["", *result["step_time_assumptions"]]
    lines = ["", f"predicted step time (micro-batch {result['setup']['micro_batch']}, accumulation "
                 f"{result['setup'].get('grad_accum_steps', 1)}):"]
    for r in rows:
        parts = ", ".join(f"{p.replace('_', ' ')} {r['step_time_parts'][p]:.3g}" for p in PARTS
                          if r["step_time_parts"][p])
        lines.append(f"  {r['strategy']:<20}{r['step_time_s']:.3g} s = {parts}")
    return lines + ["step-time assumptions (docs/fit.md):", *(f"  {t}" for t in result["step_time_assumptions"])]
