"""`shardscope parity`: does the script compute under CONFIG on N ranks what one process computes? (parity/: the two
runs and the comparison; docs/parity.md)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import UsageError

SHADOW_PLACEHOLDER = "{shadow}"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "parity", help="run a Trainer script sharded and as one process; name the first step, phase, layer and rank "
                       "where they differ",
        description="Run TRAIN.PY under CONFIG on N ranks, then as one process with the same global batch "
                    "(accumulation x N), weights, samples and random state; compare each optimizer step's samples, module "
                    "outputs, loss, gradients, gradient norm and update, and name where they first differ beyond "
                    "the tolerance. The script is a Trainer script (TRL's trainers too) with "
                    "ShardingProfilerCallback among its callbacks; it gets --output_dir. Exit 0 equal, 1 diverged "
                    "or a run failed, 2 bad input.")
    parser.add_argument("--config", required=True, help="an accelerate yaml or a DeepSpeed JSON (a path or a "
                                                        "shipped name: `shardscope configs`)")
    parser.add_argument("--script", required=True, type=Path, help="the training script (TRAIN.PY)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the launched run (default 2)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps compared (default 4)")
    parser.add_argument("--output-dir", type=Path, default=Path("parity_out"))
    parser.add_argument("--tolerance", type=float, help="relative tolerance (default: from the precision)")
    parser.add_argument("--shadow-of", metavar="MODEL", help="a shipped model name or a config folder: build a "
                        f"small random model of its architecture and put its folder where {SHADOW_PLACEHOLDER} "
                        "stands in the script's arguments")
    parser.add_argument("--json", action="store_true", help="the verdict, the steps and the first divergence as JSON")
    parser.add_argument("script_args", nargs="*", help="after --: the script's arguments (both runs get them)")
    parser.set_defaults(func=run)


def checked(args) -> None:
    """Bad input as one line (exit 2), before anything is launched."""
    if not args.script.is_file() or args.script.suffix != ".py":
        raise UsageError(f"--script {args.script}: not a Python file")
    if args.ranks < 2:
        raise UsageError(f"--ranks {args.ranks}: at least 2 (one process is the reference)")
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: at least 1")
    if args.tolerance is not None and not (math.isfinite(args.tolerance) and args.tolerance > 0):
        raise UsageError(f"--tolerance {args.tolerance}: a positive number")
    if "--output_dir" in args.script_args:
        raise UsageError("script arguments: --output_dir is parity's (each run gets its own folder under "
                         "--output-dir)")
    if args.shadow_of and SHADOW_PLACEHOLDER not in " ".join(args.script_args):
        raise UsageError(f"--shadow-of {args.shadow_of}: put {SHADOW_PLACEHOLDER} where the script takes its model, "
                         f"e.g. -- --model {SHADOW_PLACEHOLDER}")


def run(args) -> int:
    import torch

    from ..parity import runs
    from ..parity.compare import compare

    checked(args)
    config = runs.read_config(args.config)
    out = args.output_dir.resolve()
    script_args, shadow = list(args.script_args), None
    if args.shadow_of:
        from ..parity.shadow import build_shadow

        folder, rule = build_shadow(args.shadow_of, out / "shadow")
        script_args = [a.replace(SHADOW_PLACEHOLDER, str(folder)) for a in script_args]
        shadow = {"of": args.shadow_of, "folder": str(folder), "rule": rule}
        if not args.json:
            print(f"shadow of {args.shadow_of}: {rule}", flush=True)
    done = runs.launch_both(args.script.resolve(), config, script_args, out, args.ranks, args.steps,
                            torch.cuda.device_count())
    for name, (code, _, folder) in done.items():
        if code:
            print(runs.log_tail(folder))
            return 1
    launched, problem = runs.read_records(done["launched"][2], args.ranks)
    reference, problem_ref = runs.read_records(done["reference"][2], 1)
    if problem or problem_ref:
        print(f"shardscope parity: {problem or problem_ref}")
        return 1
    result = compare(launched, reference[0], args.tolerance)
    seconds = {name: round(s, 1) for name, (_, s, _) in done.items()}
    if args.json:
        print(json.dumps({**result.as_dict(), "strategy": launched[0].get("strategy"), "ranks": args.ranks,
                          "seconds": seconds, "shadow": shadow}, indent=1))
    else:
        print(text(result, launched[0].get("strategy"), args.ranks, seconds))
    return 0 if result.verdict == "equal" else 1


def _number(value) -> str:
    return "-" if value is None else f"{value:.6g}"


def text(result, strategy, ranks: int, seconds: dict) -> str:
    lines = [f"launched: {strategy} on {ranks} ranks ({seconds['launched']} s); reference: one process "
             f"({seconds['reference']} s); tolerance {result.tolerance:.2g} ({result.tolerance_rule})",
             f"{'step':>4}  {'loss':>12}  {'reference':>12}  {'grad norm':>12}  {'reference':>12}"]
    for row in result.steps:
        lines.append(f"{row['step']:>4}  {_number(row['loss']):>12}  {_number(row['loss_reference']):>12}  "
                     f"{_number(row['grad_norm']):>12}  {_number(row['grad_norm_reference']):>12}")
    lines += [f"note: {note}" for note in result.notes]
    lines.append(f"shardscope parity: {result.sentence()}")
    return "\n".join(lines)
