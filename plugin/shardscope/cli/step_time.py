"""The step-time model on the command line: the `--calibrate` argument and `plan`'s step-time block (the figures
themselves are decided in plan/calibration.py, the model in plan/time_model.py)."""
from __future__ import annotations

from ..plan.time_model import PARTS


def read_preflight(path) -> dict:
    """preflight/'s reader of a preflight.json, handed to plan.calibration (which does not import the tools)."""
    from ..preflight.calibration import calibration_from_preflight

    return calibration_from_preflight(path)


def expectation(spec, setup) -> dict:
    """What a calibration.json given to --calibrate must have been measured on, and this machine's fingerprint."""
    def fingerprint():
        from ..preflight.measurements import fingerprint as collect

        return collect()

    return {"params_total": spec.params_total, "precision": setup.precision, "fingerprint": fingerprint}


def add_calibrate_argument(group, default_help: str = "") -> None:
    group.add_argument("--calibrate", nargs="+", metavar="RUN_DIR",
                       help="a calibration.json (`shardscope calibrate`), profiled run folders "
                            "(shardscope_summary.json) or preflight.json files: the step-time model's figures "
                            f"measured there instead of the datasheet{default_help} (docs/fit.md)")


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
