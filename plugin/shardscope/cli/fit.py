"""`shardscope fit`: arguments and printing (the search: fit/search.py; the ready-to-launch files: fit/launch_files.py)."""
from __future__ import annotations

import json

from dataclasses import replace

from ..errors import UsageError
from ..fit.launch_files import ACCELERATE_FILE, RESULT_FILE, TRAINING_FILE, write_files
from ..fit.search import alternatives, below_model_states, host_lines, larger_micro_batch, nothing_fits, search
from ..model.spec import LORA_DEFAULT_TARGETS, load_model_config, model_spec, shipped_models, spec_from_config
from ..plan.calibration.calibration_json import expectation
from ..plan.calibration.figures import figures_for, hardware_for
from ..plan.mesh import Setup
from ..plan.planner import usable_bytes
from ..plan.sequence import SEARCHED
from ..plan.time_model import Figures, describe as describe_figures
from ..plan.trace_cache import cached_tracer
from ..strategy import OPTIMIZERS, PRECISIONS, STRATEGIES
from ..units import gb, gpu_size, parse_count
from .fit_dataset import fit_on_dataset, format_decision
from .plan import add_calibrate_argument, add_hardware_arguments, memory_from_args
from .plan_dataset import add_dataset_arguments


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "fit", help="the strategy, micro-batch, checkpointing and accumulation that fit, fastest where the model can "
                    "tell, global batch kept",
        description="Search strategy x micro-batch x activation checkpointing x gradient accumulation for a fixed "
                    "global batch; keep what the planner says fits, rank by a predicted step time (assumptions "
                    "printed). docs/fit.md explains the model.",
        epilog="Exit status: 0 a fit found, 1 nothing fits (one line says what would), 2 bad input.")
    add_search_arguments(p)
    add_dataset_arguments(p, batching=False)
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="machine-readable")
    out.add_argument("--output-dir", help=f"write {ACCELERATE_FILE}, {TRAINING_FILE} (a recipe --config) and "
                                          f"{RESULT_FILE} there")
    out.add_argument("--top", type=int, default=4, help="alternatives shown (default 4)")
    p.set_defaults(func=fit_command)


def add_search_arguments(p) -> None:
    """The model, hardware, training and step-time-model arguments `fit` and `calibrate` share."""
    src = p.add_argument_group("model (one of)")
    src.add_argument("--model", help=f"shipped name ({', '.join(shipped_models())}), local folder or hub id")
    src.add_argument("--params", help="parameter count, e.g. 7e9 or 7B (shapes assumed)")
    add_hardware_arguments(p)
    tr = p.add_argument_group("training")
    tr.add_argument("--global-batch", type=int, required=True, help="sequences (samples) per optimizer step")
    tr.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    tr.add_argument("--image-size", type=int, help="vision models: overrides the config's image size")
    tr.add_argument("--precision", choices=PRECISIONS, default="bf16-mixed")
    tr.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    tr.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa")
    tr.add_argument("--lora-rank", type=int, default=0)
    tr.add_argument("--lora-targets", default=",".join(LORA_DEFAULT_TARGETS), help="comma list or all-linear")
    tr.add_argument("--strategy", action="append", choices=STRATEGIES + SEARCHED,
                    help="repeatable; default: all, and fsdp_cp, zero3_sp (each sequence split cp/sp ways, every "
                         "degree) when nothing fits with whole sequences")
    sm = p.add_argument_group("step-time model (defaults from --gpu; docs/fit.md)")
    sm.add_argument("--peak-tflops", type=float, help="dense peak TFLOP/s per GPU (needed for GPUs not in the table)")
    sm.add_argument("--mfu", type=float, default=0.40, help="fraction of the peak the matmuls reach (default 0.40)")
    sm.add_argument("--nvlink-bandwidth", type=float, help="GB/s per GPU, one direction, inside a node")
    sm.add_argument("--network-bandwidth", type=float, default=25.0, help="GB/s per GPU across nodes (default 25)")
    sm.add_argument("--pcie-bandwidth", type=float, help="GB/s per GPU to the host, for offload")
    sm.add_argument("--micro-step-overhead-ms", type=float, default=5.0, help="fixed cost per micro-batch (default 5)")
    add_calibrate_argument(sm)


def setup_and_hardware(args, assume_gpu: bool = False) -> tuple[Setup, object]:
    """Validate the cheap inputs (before any model is read)."""
    memory, cpu_memory = memory_from_args(args)
    if memory is None:
        raise UsageError("give --gpu NAME or --gpu-memory SIZE: fit needs the memory per GPU")
    if args.global_batch < 1:
        raise UsageError(f"--global-batch must be at least 1, got {args.global_batch}")
    if args.seq_len < 1:
        raise UsageError(f"--seq-len must be at least 1, got {args.seq_len}")
    if getattr(args, "top", 0) < 0:
        raise UsageError(f"--top must not be negative, got {args.top}")
    if not 0 < args.mfu <= 1:
        raise UsageError(f"--mfu must be in (0, 1], got {args.mfu}")
    for flag in ("peak_tflops", "nvlink_bandwidth", "network_bandwidth", "pcie_bandwidth", "micro_step_overhead_ms"):
        value = getattr(args, flag)
        low_ok = value is None or value > 0 or (value == 0 and flag == "micro_step_overhead_ms")
        if not low_ok or (value is not None and not value < float("inf")):
            raise UsageError(f"--{flag.replace('_', '-')} must be a positive number, got {value}")
    setup = Setup(gpus_per_node=args.gpus, nodes=args.nodes, gpu_memory_bytes=memory, precision=args.precision,
                  optimizer=args.optimizer, seq_len=args.seq_len, image_size=args.image_size,
                  attention=args.attention, lora_rank=args.lora_rank, headroom=args.headroom,
                  lora_targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()),
                  cpu_memory_bytes=cpu_memory).validate()
    gbs = {k: getattr(args, k) * 1e9 if getattr(args, k) is not None else None
           for k in ("nvlink_bandwidth", "network_bandwidth", "pcie_bandwidth")}
    # a GPU whose peak is unknown: measured figures stand in for its datasheet; `calibrate` ranks with the assumed
    # GPU's only to choose what to run; else one line asking for --gpu or --peak-tflops
    unknown = "none" if args.calibrate else "assume" if assume_gpu else "raise"
    hw = hardware_for(args.gpu, args.precision, args.peak_tflops, unknown, mfu=args.mfu,
                      nvlink_bytes_per_s=gbs["nvlink_bandwidth"], network_bytes_per_s=gbs["network_bandwidth"],
                      pcie_bytes_per_s=gbs["pcie_bandwidth"], micro_step_overhead_s=args.micro_step_overhead_ms / 1e3)
    return setup, hw


def searched(args, assume_gpu: bool = False) -> tuple:
    """`fit`'s search from its arguments (and `calibrate`'s, which may rank with an assumed GPU's datasheet): (spec,
    setup, hw, figures, calibration record, found, traces); bad input raises UsageError."""
    setup, hw = setup_and_hardware(args, assume_gpu)
    params = parse_count(args.params) if args.params is not None else None
    if args.model and params is not None:
        raise UsageError("give --model or --params, not both")
    if args.model:  # the model's own code, traced on fake tensors, gives its activations (else the formula)
        config = load_model_config(args.model)
        spec, traces = spec_from_config(config, name=args.model), cached_tracer(args.model, args.global_batch)
    else:
        spec, traces = model_spec(None, params=params), None
    allowed = tuple(args.strategy or STRATEGIES)
    fig, record = figures_for(hw, args.calibrate, expectation(spec, setup))

    def search_at(trial: Setup) -> dict:
        found = search(spec, trial, args.global_batch, fig, allowed, traces)
        if not args.strategy and not found["fitting"]:  # no sequence fits whole: split it (cp/sp, every degree)
            found = search(spec, trial, args.global_batch, fig, allowed + SEARCHED, traces)
        return found

    if getattr(args, "dataset", None):  # decided on the data's worst micro-batch (cli/fit_dataset.py)
        found, data = fit_on_dataset(args, lambda seq_len, inputs: search_at(
            replace(setup, seq_len=seq_len, batch_inputs=inputs)))
        setup, found["data"] = replace(setup, seq_len=data["fit"]["seq_len"], batch_inputs=data["fit"]["batch_inputs"]), data
    else:
        found = search_at(setup)
    below = below_model_states(found, setup)
    if below:
        raise UsageError(below)
    return spec, setup, hw, fig, record, found, traces


def nothing_fits_lines(spec, setup, found: dict, args, traces) -> list[str]:
    return [nothing_fits(spec, setup, found, tuple(args.strategy or STRATEGIES), traces), *host_lines(found["host"])]


def fit_command(args) -> int:
    spec, setup, hw, fig, record, found, traces = searched(args)
    if not found["fitting"]:
        lines = nothing_fits_lines(spec, setup, found, args, traces)
        print(json.dumps({"strategy": None, "reason": lines[0], "reasons": lines}) if args.json else "\n".join(lines))
        return 1
    result = fit_result(spec, setup, fig, found, args, traces, hw)
    if found.get("data"):
        result["data"] = found["data"]
    if record:
        result["calibration"] = record
    if args.output_dir:
        result["files"] = write_files(result, args, spec, setup)
    print(json.dumps(result, indent=1) if args.json else format_fit(result))
    return 0


def fit_result(spec, setup: Setup, fig: Figures, found: dict, args, traces=None, hw=None) -> dict:
    winner = found["fitting"][0]
    usable = usable_bytes(setup)
    out = {key: getattr(winner, key) for key in ("strategy", "per_device_train_batch_size",
                                                 "gradient_accumulation_steps", "gradient_checkpointing", "tp",
                                                 "peak_bytes", "step_time_s")}
    out["alternatives"] = alternatives(found["fitting"], args.top, found["tie"])
    out["tie"] = found["tie"]
    out["candidates"] = [c.considered() for c in found["fitting"]]  # every fitting one, in the order ranked
    fitting = {c.strategy for c in found["fitting"]}
    out.update({
        "mesh": winner.mesh.as_dict(), "data_parallel_size": winner.mesh.dp,
        "global_batch": args.global_batch, "step": winner.step,
        "usable_bytes": int(usable), "gpu_memory_bytes": setup.gpu_memory_bytes, "headroom": setup.headroom,
        "not_fitting": {name: {"smallest_peak_bytes": c.peak_bytes, "at": f"micro-batch {c.per_device_train_batch_size}"
                               f", checkpointing {'on' if c.gradient_checkpointing else 'off'}"}
                        for name, c in sorted(found["smallest"].items())
                        if name not in fitting and name not in found["host"]},  # host-blocked: their own list
        "larger_micro_batch": larger_micro_batch(spec, setup, winner, args.global_batch, traces=traces),
        "model": {**found["model"], "source": args.model or f"--params {args.params}"},
        "setup": {"gpus_per_node": setup.gpus_per_node, "nodes": setup.nodes, "world_size": setup.world_size,
                  "precision": setup.precision, "optimizer": setup.optimizer, "lora_rank": setup.lora_rank,
                  "tokens_per_sample": found["tokens_per_sample"], "seq_len": setup.seq_len,
                  "image_size": setup.image_size},
        "assumptions": {**(vars(hw) if hw else {"gpu": args.gpu or "GPU"}), **vars(fig), "headroom": setup.headroom,
                        "memory": "planner peak_bytes per GPU (formulas.Row.peak_bytes) <= usable = GPU memory x "
                                  "(1 - headroom) (planner.usable_bytes)",
                        "text": describe_figures(fig)},
        "notes": found["notes"],
        "offload_host_memory": {name: {**h, "why": line} for (name, h), line in
                                zip(sorted(found["host"].items()), host_lines(found["host"]))},
    })
    return out


# ----------------------------------------------------------------------------- printing
def format_fit(r: dict) -> str:
    s, m, step = r["setup"], r["model"], r["step"]
    lines = [
        f"fit: {m['name']} ({m['params_total']:,} params, {m['trainable_params']:,} trained) on {s['world_size']} x "
        f"{r['assumptions']['gpu']} ({s['gpus_per_node']} per node x {s['nodes']}), {s['precision']}, "
        f"{s['tokens_per_sample']} tokens/sample, global batch {r['global_batch']}",
        f"usable per GPU: {gb(r['usable_bytes'])} GB = {gpu_size(r['gpu_memory_bytes'])} less {r['headroom']:.0%} "
        "headroom (planner.usable_bytes); a candidate fits when the planner's peak_bytes is at most that",
        "",
        f"winner: {describe(r)}",
        *([f"  a tie within the model's error of {r['tie']['error']:.0%} (docs/fit.md): {r['tie']['candidates']} "
           f"candidates of {', '.join(r['tie']['strategies'])}; {r['tie']['rule'].split(': ', 1)[1]} "
           f"(predicted fastest: {r['tie']['fastest_predicted']})"] if r.get("tie") else []),
        f"  step {r['step_time_s']:.3g} s = " + " + ".join(f"{k.replace('_', ' ')} {v:.3g}"
                                                      for k, v in step["step_time_parts"].items()),
    ]
    if r["alternatives"]:
        lines += ["", "next best (the best of each other strategy):"]
        lines += [f"  {describe(a)}\n      lost: {a['why']}" for a in r["alternatives"]]
    if r["not_fitting"]:
        lines += ["", "does not fit (smallest planned peak per GPU):  " + ", ".join(
            f"{name} {gb(v['smallest_peak_bytes'])} GB" for name, v in r["not_fitting"].items())]
    if r["offload_host_memory"]:
        lines += ["", "offload left out (host memory):", *(f"  {h['why']}" for h in r["offload_host_memory"].values())]
    if r["larger_micro_batch"]:
        lines += ["", "global batch: " + r["larger_micro_batch"]["note"]]
    lines += ["", *(f"note: {n}" for n in r["notes"])] if r["notes"] else []
    if r.get("data"):
        lines += ["", *format_decision(r["data"], r)]
    lines += ["", "assumptions (docs/fit.md):", *(f"  {t}" for t in r["assumptions"]["text"]),
              "  memory: " + r["assumptions"]["memory"]]
    if r.get("files"):
        lines += ["", f"written: {r['files']['accelerate_config']}, {r['files']['training_args']}, "
                      f"{r['files']['result']}", f"run: {r['files']['launch']}"]
    return "\n".join(lines)


def describe(c: dict) -> str:
    tp = f", tp {c['tp']}" if c["tp"] > 1 else ""
    dp = c["mesh"]["dp_replicate"] * c["mesh"]["dp_shard"]
    return (f"{c['strategy']}{tp}: micro-batch {c['per_device_train_batch_size']} x accumulation "
            f"{c['gradient_accumulation_steps']} x data-parallel {dp}, checkpointing "
            f"{'on' if c['gradient_checkpointing'] else 'off'}; peak {gb(c['peak_bytes'])} GB per GPU, "
            f"step {c['step_time_s']:.3g} s")
