"""`shardscope plan`: arguments and printing (the answers are computed in `planner`, the dry run in `dry_run`); the
hardware and `--calibrate` arguments `fit` and `compare` share; plan's step-time block."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from ..errors import UsageError
from ..model.spec import LORA_DEFAULT_TARGETS, load_model_config, model_spec, shipped_models, shipped_source
from ..plan.calibration.calibration_json import expectation
from ..plan.calibration.figures import figures_for, hardware_for
from ..plan.dry_run import DRY_RUN_STRATEGIES, NOT_DRY_RUN, dry_run_all, check_mesh
from ..plan.mesh import HEADROOM, LibraryKnobs, Setup
from ..plan.batching import worst_step_peaks
from ..plan.planner import convention_table, estimate, fit_rule, plan_dict
from ..plan.quantized import QUANTIZE, quantized_base, with_quantized_base
from ..plan.time_model import PARTS, annotate_rows
from ..plan.trace_cache import cached_traces_for
from ..report.peak_section import percent, step_size
from ..report.plan_vs_run import plan_vs_run
from ..strategy import OPTIMIZERS, PRECISIONS, TP_STRATEGIES
from ..units import GPUS, gb, gpu_memory, gpu_size, parse_count, parse_size
from .plan_dataset import add_dataset_arguments, dataset_plan_setup, format_data
from .plan_sequence import (SEARCH_STEP, add_fitting_split, add_sequence_arguments, add_split_rows, format_sequence,
                            max_seq_len_lines)

CONVENTIONS = ("rule-of-thumb-12",)
OLD_CONVENTIONS = {"seed-12": "rule-of-thumb-12"}  # accepted, not listed in --help; drop after one release


def convention_name(value: str) -> str:
    """`--convention`'s value, with the old spelling mapped to its new name (said once, to who typed it)."""
    if value in OLD_CONVENTIONS:
        print(f"shardscope: note: --convention {value} is now --convention {OLD_CONVENTIONS[value]} (also the --json "
              "key); the old spelling goes in the next release", file=sys.stderr)
    return OLD_CONVENTIONS.get(value, value)


class OldSpelling(argparse.Action):
    """`--compare`, `--against`'s name before `shardscope compare` (which launches runs) and it meant two things:
    still accepted, not listed in --help, said once to who typed it; drop after one release."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"shardscope: note: plan {option_string} is now plan --against (`shardscope compare` launches runs); "
              "the old spelling goes in the next release", file=sys.stderr)
        setattr(namespace, self.dest, values)


def short_count(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 999.5e6 else f"{n / 1e6:.3g}M"  # 999.9M prints as 1B, not 1e+03M


def list_models() -> list[dict]:
    """The shipped names with their exact counts (MoE: total, and active per token) and hub ids."""
    out = []
    for name in shipped_models():
        spec = model_spec(name)
        out.append({"name": name, "params_total": spec.params_total, "hub_id": shipped_source(name),
                    **({"params_active": spec.params_active,
                        "params_active_without_input_embedding": spec.active_without_input_embedding,
                        "num_experts": spec.num_experts, "experts_per_token": spec.experts_per_token}
                       if spec.num_experts else {})})
    return out


def format_models(models: list[dict]) -> str:
    lines = ["shipped models (--model NAME; config.json as published, counted on the meta device):",
             f"{'name':<18}{'params':>9}  {'exact count':>17}  hub id"]
    for m in models:
        moe = (f"  (MoE: {short_count(m['params_active'])} active per token with the input embedding, "
               f"{short_count(m['params_active_without_input_embedding'])} without; {m['experts_per_token']} of "
               f"{m['num_experts']} experts; memory holds all)") if "params_active" in m else ""
        lines.append(f"{m['name']:<18}{short_count(m['params_total']):>9}  {m['params_total']:>17,}  "
                     f"{m['hub_id']}{moe}")
    return "\n".join(lines)




def format_table(result: dict) -> str:
    m, s = result["model"], result["setup"]
    gpu = gpu_size(s["gpu_memory_bytes"]) if s["gpu_memory_bytes"] else "no GPU memory given"
    moe = (f", {m['params_active']:,} active per token with the input embedding, "
           f"{m['params_active_without_input_embedding']:,} without ({m['experts_per_token']} of {m['num_experts']} "
           "experts; memory holds all)") if "params_active" in m else ""
    lines = [
        f"model {m['name']}: {m['params_total']:,} params ({'exact, meta device' if m['exact'] else 'from --params'}"
        + (f"; assumed {', '.join(m['assumed'])}" if m["assumed"] else "") + f"){moe}, trainable {m['trainable_params']:,}",
        f"{s['world_size']} GPUs ({s['gpus_per_node']} x {s['nodes']} nodes, {gpu} each), {s['precision']}, "
        f"{s['optimizer']}, micro-batch {s['micro_batch']}, "
        f"{result['activations']['tokens_per_sample']} tokens/sample, checkpointing "
        f"{'on' if s['activation_checkpointing'] else 'off'}" + (f", LoRA r={s['lora_rank']}" if s["lora_rank"] else "")
        + (", a frozen reference copy of the model" if s.get("reference_model") else ""),
    ]
    tp = result.get("tp")
    if tp:
        meshes = {r["strategy"]: r["mesh"] for r in result["rows"]}
        lines.append(f"tensor parallel degree {tp['degree']} ({tp['source']}); dp_replicate x dp_shard x tp: "
                     + ", ".join(f"{n} {m['dp_replicate']}x{m['dp_shard']}x{m['tp']}" for n, m in meshes.items()
                                 if n in TP_STRATEGIES) + ("; approximate (--params)" if tp["approximate"] else ""))
    frozen = s.get("reference_model")  # the frozen copy's column, only when one is planned
    lines += ["", "per GPU, GB (1e9 B)   params   grads  optim  activ*  buffers" + ("  frozen" if frozen else "")
              + "    peak  | CPU/rank  fits  comm/step**"]
    for r in result["rows"]:
        fits = {True: "yes", False: "no", None: "?"}[r["fits"]]
        lines.append(f"{r['strategy'] + ('~' if r.get('approximate') else ''):<20} {gb(r['params_bytes']):>8} "
                     f"{gb(r['grads_bytes']):>7} {gb(r['optimizer_bytes']):>6} {gb(r['activations_bytes']):>7} "
                     f"{gb(r['buffers_bytes']):>8}" + (f" {gb(r['frozen_bytes']):>7}" if frozen else "")
                     + f" {gb(r['peak_bytes']):>7}  | "
                     f"{gb(r['cpu_bytes']) if r['cpu_bytes'] else '':>8}  {fits:<4}  "
                     f"{gb(r['comm_bytes_per_step']):>10}")
    lines += ["", "bytes per trainable parameter (weights + grads + master + moments = total):"]
    by_states = {}
    for r in result["rows"]:
        if r.get("per_param"):
            by_states.setdefault(tuple(r["per_param"].items()), []).append(r["strategy"])
    for states, names in by_states.items():
        b = dict(states)
        lines.append(f"  {', '.join(names)}: {b['weights']:g} + {b['grads']:g} + {b['master']:g} + "
                     f"{b['moments']:g} = {b['total']:g} B")
    rec = result["recommendation"]
    lines += ["", f"recommendation: {rec['strategy'] or 'none'}: {rec['reason']}",
              *(f"  not {name}: {why}" for name, why in rec.get("not_chosen", {}).items()),
              "* activations at the peak: " + _activation_source(result["rows"]) + "; params/grads/optimizer are "
              "exact counts (optimizer includes fp32 master weights). peak = the worst moment of a step (phase "
              "in --json), not the sum of the columns. Formulas: docs/planner.md",
              "** GB each GPU sends per optimizer step: computed from ring-collective formulas (held against counted "
              "collectives, docs/planner.md)"]
    if s["gpu_memory_bytes"]:
        lines.append(fit_rule(Setup(headroom=s["headroom"])))
    if any(r.get("approximate") for r in result["rows"]):
        lines.append("~ approximate: no per-tensor shapes (--params), totals divided by tp x dp_shard")
    lines += [n for n in result.get("notes", []) if getattr(n, "kind", "note") != "footnoted"]  # (*, **, ~) say those
    return "\n".join(lines)


def format_convention(table: dict) -> str:
    lines = [f"{table['params']:.3g} params on {table['gpus']} GPUs, model states per GPU (GB)",
             f"{'basis':<24}{'none':>8}{'ZeRO-1':>8}{'ZeRO-2':>8}{'ZeRO-3':>8}"]
    for key in ("rule-of-thumb-12", "planner-16"):
        r = table[key]
        lines.append(f"{key + ' (' + r['bytes_per_param'] + ')':<24}" +
                     "".join(f"{r[k] / 1e9:>8.4g}" for k in ("none", "zero1", "zero2", "zero3")))
    return "\n".join(lines + ["", table["explanation"]])


PEAK_KINDS = {  # what a measured peak is, beside the planned total (states + activations + buffers, estimated)
    "tensor_peak": "live tensors at the step's peak; the planned total is an estimate",
    "cuda_max_allocated": "CUDA max allocated; the planned total is an estimate",
    "cpu_peak_rss": "whole-process RSS, libraries included: not like for like",
}


def format_compare(result: dict) -> str:
    mesh = result.get("mesh") or {}
    where = f" (mesh {mesh['dp_replicate']}x{mesh['dp_shard']}x{mesh['tp']})" if mesh.get("tp", 1) > 1 else ""
    lines = [f"{result['summary']}: {result['strategy']}{where}, world size {result['world_size']}, "
             f"{result['precision']}, "
             f"model {result['model']} (planned {result['params_total_planned']:,} params, "
             f"measured {format(result['params_total_measured'], ',') if result['params_total_measured'] else '?'})",
             f"{'rank':<5}{'component':<20}{'planned':>14}{'measured':>14}{'rel diff':>10}"]
    for rank in result["ranks"]:
        for comp in rank["components"]:
            diff = "-" if comp["rel_diff"] is None else f"{comp['rel_diff']:+.2%}"
            lines.append(f"{str(rank['rank']):<5}{comp['component']:<20}{comp['planned']:>14,}"
                         f"{comp['measured']:>14,}{diff:>10}")
        peak = rank.get("peak")
        if peak:  # the same step planned: its shape from the summary
            step, shape = peak["step"], step_size(peak["step"])
            error = percent(peak["error"])
            lines.append(f"{'':<5}{'peak of one step':<20}{peak['planned']['peak_bytes']:>14,}"
                         f"{peak['measured']['peak_tensor_bytes']:>14,}{error:>10}   (planned - measured) / measured; "
                         f"{shape}, checkpointing {'on' if step['gradient_checkpointing'] else 'off'}, activations "
                         f"{peak['planned']['activations_source']}")
        elif rank.get("peak_memory_bytes"):
            lines.append(f"{'':<5}{'peak (' + str(rank['memory_kind']) + ')':<20}{result['planned_total_bytes']:>14,}"
                         f"{int(rank['peak_memory_bytes']):>14,}   ({PEAK_KINDS.get(rank['memory_kind'], 'as measured')})")
    if result.get("trace_note"):
        lines.append(result["trace_note"])
    return "\n".join(lines)


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


def format_dry_run(out: dict) -> str:
    lines = [f"dry run: {out['model']} ({out['params_total']:,} params), {out['world_size']} ranks on "
             f"{out['nodes']} node(s), {out['precision']}, {out['optimizer']}; meta device + fake process group: "
             f"real FSDP2 fully_shard per decoder layer + root; TP rows: transformers' maybe_distribute_model",
             f"{'per rank, GB (1e9 B)':<38}{'params':>9}{'grads':>9}{'optim':>9}{'states':>9}  diff vs formula"]
    keys = ("params_bytes", "grads_bytes", "optimizer_bytes", "model_states_bytes")
    for r in out["results"]:
        planned = r["planned"]
        lines.append(f"{r['strategy'] + ' formula':<38}" + "".join(f"{gb(planned[k]):>9}" for k in keys))
        if r.get("dry_run", True) is None:
            lines.append(f"{r['strategy'] + ' dry run':<38}  {r['note']}")
            continue
        for label in ("max", "min"):
            rank = r["ranks"][label]
            how = "built" if rank["built"] else "computed"
            diff = max(rank["rel_diff"].values(), key=abs)
            lines.append(f"{'  dry run ' + label + ': rank ' + str(rank['rank']) + ' (' + how + ')':<38}"
                         + "".join(f"{gb(rank[k]):>9}" for k in keys) + f"  {diff:+.3%}")
        mesh = ", ".join(f"{n} {m}" for n, m in zip(r["mesh_dim_names"], r["mesh"]))
        lines.append(f"  {r['world_size']} ranks, mesh ({mesh}), model states over {r['shard_degree']}, "
                     f"{r['dtype']} shards, built ranks {r['built_ranks']}, computed = built: "
                     f"{'yes' if r['computed_matches_built'] else 'NO'}, {r['seconds']:.2f} s")
    lines += ["params include FSDP2's padding of uneven shards (storage of ceil(dim0/n) rows); grads the same "
              "(TP alone: as the meta backward left them); AdamW moments follow the unpadded local shard (+4 B step "
              "per tensor). Formulas: docs/planner.md; dry run: docs/cluster.md"]
    return "\n".join(lines)


def _activation_source(rows: list) -> str:
    sources = {r["activations_source"] for r in rows if r["strategy"] not in TP_STRATEGIES}
    tp = [r["strategy"] for r in rows if r["strategy"] in TP_STRATEGIES]
    if sources <= {"traced", "simulated"}:
        return ("simulated: the full-depth model run on fake tensors" if "simulated" in sources else
                "traced from the model's code on fake tensors (1 and 2 layers, scaled)") + \
            (f"; {', '.join(tp)}: a written-out formula, approximate (the trace does not split a layer by TP)"
             if tp else "")
    return "a written-out formula, approximate"


def add_hardware_arguments(parser) -> None:
    """The hardware flags `plan` and `fit` share (read back by `memory_from_args`)."""
    hw = parser.add_argument_group("hardware")
    hw.add_argument("--gpus", type=int, default=1, help="GPUs per node (default 1)")
    hw.add_argument("--nodes", type=int, default=1)
    hw.add_argument("--gpu", help=f"GPU name: {', '.join(GPUS)}")
    hw.add_argument("--gpu-memory", help="memory per GPU: 80GB, 80GiB, bytes; bare number < 1e6 = GiB")
    hw.add_argument("--cpu-memory", help="CPU memory per node, checked for offload strategies")
    hw.add_argument("--headroom", type=float, default=HEADROOM,
                    help=f"fraction of GPU memory kept free for the CUDA caching allocator's fragmentation, the CUDA "
                         f"context and NCCL (default {HEADROOM:g})")


def add_calibrate_argument(group, default_help: str = "") -> None:
    """`--calibrate` (plan, fit, compare, report): measured figures in place of the datasheet's (plan/calibration/)."""
    group.add_argument("--calibrate", nargs="+", metavar="RUN_DIR",
                       help="a calibration.json (`shardscope calibrate`), profiled run folders "
                            "(shardscope_summary.json) or preflight.json files: the step-time model's figures "
                            f"measured there instead of the datasheet{default_help} (docs/fit.md)")


def memory_from_args(args) -> tuple[int | None, int | None]:
    """(GPU memory, CPU memory per node) in bytes from the hardware flags; None where not given."""
    if args.gpu and args.gpu_memory:
        raise UsageError("give --gpu or --gpu-memory, not both")
    memory = gpu_memory(args.gpu) if args.gpu else parse_size(args.gpu_memory) if args.gpu_memory else None
    return memory, parse_size(args.cpu_memory, "--cpu-memory") if args.cpu_memory else None


def build_parser(subparsers):
    p = subparsers.add_parser("plan", help="per-GPU memory of every strategy, and which to use",
                              description="Per-GPU memory for every strategy, before launch, from a model's config only.",
                              epilog="Exit status: 0 ok, 1 when no strategy fits the GPUs given, 2 for bad input.")
    src = p.add_argument_group("model (one of)")
    src.add_argument("--model", help="shipped name (llama-3-8b, qwen2.5-7b, ...: --list-models), local folder "
                                      "or hub id")
    src.add_argument("--list-models", action="store_true", help="print the shipped names with their parameter "
                                                                "counts and exit")
    src.add_argument("--params", help="parameter count, e.g. 7e9 or 7B")
    src.add_argument("--layers", type=int)
    src.add_argument("--hidden", type=int)
    src.add_argument("--vocab", type=int)
    src.add_argument("--heads", type=int, help="attention heads, with --params (default: hidden / 128)")
    add_hardware_arguments(p)
    tr = p.add_argument_group("training")
    tr.add_argument("--precision", choices=PRECISIONS, default="bf16-mixed")
    tr.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    tr.add_argument("--fp32-grads", action="store_true", help="DeepSpeed grad_accum_dtype fp32 (18 B/param)")
    tr.add_argument("--micro-batch", type=int, default=1)
    tr.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (the step time's micro-batches)")
    tr.add_argument("--seq-len", type=int, default=2048)
    tr.add_argument("--image-size", type=int, help="vision models: overrides the config's image size")
    tr.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    tr.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa")
    tr.add_argument("--simulate", action="store_true",
                    help="trace the full-depth model on fake tensors (exact for one rank; seconds per layer) "
                         "instead of 1 and 2 layers scaled")
    tr.add_argument("--reference-model", action="store_true",
                    help="a frozen copy of the model is held too (DPO's reference): its parameters, sharded as the "
                         "strategy shards parameters")
    tr.add_argument("--lora-rank", type=int, default=0)
    tr.add_argument("--lora-targets", default=",".join(LORA_DEFAULT_TARGETS), help="comma list or all-linear")
    tr.add_argument("--quantize", choices=QUANTIZE, help="QLoRA: the frozen base quantised by bitsandbytes (with "
                                                        "--lora-rank; plan/quantized.py)")
    tr.add_argument("--no-double-quant", action="store_true", help="with --quantize 4bit: bnb_4bit_use_double_quant "
                                                                  "off (default on, as QLoRA)")
    tr.add_argument("--prefer", choices=("fsdp", "deepspeed"), default="fsdp",
                    help="which goes first when both of a pair of equally fast strategies fit (fsdp_shard_grad_op "
                         "or zero2, fsdp_full_shard or zero3); default fsdp")
    tr.add_argument("--tp", type=int, help="tensor-parallel degree of the tp/fsdp_tp/hsdp_tp rows (default: the "
                                           "largest that divides --gpus, num_attention_heads and num_key_value_heads)")
    add_sequence_arguments(p.add_argument_group("long sequences (docs/planner.md, \"Long sequences\")"))
    add_dataset_arguments(p)
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="machine-readable, bytes per GPU")
    out.add_argument("--convention", type=convention_name, choices=CONVENTIONS,
                     help="print the 12 B/param rule of thumb (2 + 2 + 8, no fp32 master copy) beside the "
                          "planner's 16 B/param, per ZeRO stage")
    out.add_argument("--against", metavar="SUMMARY_JSON",
                     help="the plan of a finished run beside what it measured, from the callback's summary")
    out.add_argument("--compare", dest="against", action=OldSpelling, help=argparse.SUPPRESS)
    add_calibrate_argument(out)
    p.set_defaults(func=plan_command)
    return p


def register(subparsers) -> None:
    add_dry_run_arguments(build_parser(subparsers))


def setup_from_args(args) -> Setup:
    memory, cpu_memory = memory_from_args(args)
    return Setup(gpus_per_node=args.gpus, nodes=args.nodes, gpu_memory_bytes=memory, precision=args.precision,
                 optimizer=args.optimizer, micro_batch=args.micro_batch, grad_accum_steps=args.grad_accum,
                 seq_len=args.seq_len,
                 image_size=args.image_size, activation_checkpointing=args.checkpointing,
                 attention=args.attention, lora_rank=args.lora_rank,
                 lora_targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()),
                 headroom=args.headroom, prefer=args.prefer, tp_size=args.tp,
                 reference_model=args.reference_model,
                 cpu_memory_bytes=cpu_memory).validate()


def knobs_from_args(args) -> LibraryKnobs:
    """What `plan`'s flags set of the libraries' own settings (DeepSpeed's gradient dtype)."""
    return LibraryKnobs(fp32_grads=args.fp32_grads)


def checked_model_args(args) -> float | None:
    """The model arguments checked before any model is loaded; --params as a count (None: not given)."""
    for key in ("layers", "hidden", "vocab", "heads"):
        if getattr(args, key) is not None and getattr(args, key) <= 0:
            raise UsageError(f"--{key} must be positive, got {getattr(args, key)}")
    params = parse_count(args.params) if args.params is not None else None
    if args.model and params is not None:
        raise UsageError("give --model or --params, not both")
    if args.heads is not None and params is None:
        raise UsageError("--heads goes with --params (a model's config gives its own heads)")
    if args.quantize and not (args.lora_rank and args.model):
        raise UsageError(f"--quantize {args.quantize} needs --model and --lora-rank: a quantised base is frozen, "
                         "only LoRA adapters train (QLoRA)")
    return params


def plan_command(args) -> int:
    if args.list_models:
        models = list_models()
        print(json.dumps(models, indent=1) if args.json else format_models(models))
        return 0
    setup = setup_from_args(args)  # validate cheap inputs before any model is loaded
    params = checked_model_args(args)
    if args.convention:
        table = convention_table(params or 7e9, args.gpus * args.nodes)
        print(json.dumps(table, indent=1) if args.json else format_convention(table))
        return 0
    if args.against:
        spec = model_spec(args.model, params=params, layers=args.layers, hidden=args.hidden,
                          vocab=args.vocab, heads=args.heads) if (args.model or params) else None
        result = plan_vs_run(args.against, spec, setup, model=args.model, knobs=knobs_from_args(args))
        print(json.dumps(result, indent=1) if args.json else format_compare(result))
        return 0
    data, modes, base, setup = dataset_plan_setup(args, setup)  # --dataset: its worst micro-batch (cli/plan_dataset.py)
    if args.model:  # both cached per config (model/cache.py): a later run imports neither torch nor transformers
        spec = model_spec(args.model)
        traces, note = cached_traces_for(args.model, setup, simulate=args.simulate)
    else:
        if args.simulate:
            raise UsageError("--simulate needs --model (a config to run; --params has no layer code)")
        spec, traces, note = model_spec(None, params=params, layers=args.layers, hidden=args.hidden,
                                        vocab=args.vocab, heads=args.heads), {}, None
    traces_of = (lambda shape: cached_traces_for(args.model, shape)[0]) if args.model else (lambda shape: {})
    if args.max_seq_len:
        rows, lines = max_seq_len_lines(spec, setup, _token_line(args.model) if args.model else traces_of, args.model)
        print(json.dumps({"max_seq_len": rows}, indent=1) if args.json else "\n".join(lines))
        return 0
    result = estimate(spec, setup, traces, knobs_from_args(args))
    if note:
        result["notes"].append(note)
    if args.quantize:
        base = quantized_base(load_model_config(args.model), int(args.quantize[0]), not args.no_double_quant,
                              dtype_bytes=4 if args.precision == "fp32" else 2, storage_bytes=2)
        result = with_quantized_base(result, spec, base)
    hw = hardware_for(args.gpu, args.precision, unknown="none")  # no known GPU: no datasheet step time
    fig, record = figures_for(hw, args.calibrate, expectation(spec, setup))
    annotate_rows(result, spec, setup, fig)
    if record:
        result["calibration"] = record
    add_split_rows(result, args, spec, setup, traces_of)  # --sp / --cp: rows of that sequence split
    add_fitting_split(result, args, spec, setup, traces_of)  # nothing fits whole: the smallest split that fits
    out = plan_dict(result)
    lines = []
    if data is not None:
        lines = dataset_rows(out, data, worst_step_peaks(spec, base, modes, traces_of, knobs_from_args(args)),
                             args.batching)
    print(json.dumps(out, indent=1) if args.json else "\n".join([*lines, format_table(out), *format_sequence(
        out.get("sequence")), *format_step_times(out)]))
    nothing_fits = setup.gpu_memory_bytes is not None and not result["recommendation"]["strategy"]
    return 1 if nothing_fits else 0  # 1: nothing fits the GPUs given (the table says by how much)


def dataset_rows(out: dict, data: dict, peaks: dict, chosen: str) -> list[str]:
    """`plan --dataset`: each row's `worst_step_peak_bytes` (the --batching mode's), the `data` object; the printed
    lines above the table."""
    for row in out["rows"]:
        row["worst_step_peak_bytes"] = row["peak_bytes"]
    out["data"] = {**data, "worst_step_peak_bytes": {mode: {s: p["peak_bytes"] for s, p in by.items()}
                                                      for mode, by in peaks.items()}}
    return format_data(out["data"], peaks, chosen)


def _token_line(model: str):
    """{regime: StepTrace} for any tokens per GPU: traced at SEARCH_STEP tokens x micro-batches 1 and 2 and extended
    along that line (`trace.tracer`), so --max-seq-len traces twice whatever it searches."""
    from ..plan.trace_cache import cached_tracer

    line = cached_tracer(model, 2)
    return lambda shape: line(replace(shape, seq_len=SEARCH_STEP,
                                      micro_batch=max(1, shape.micro_batch * shape.seq_len // SEARCH_STEP)))


def add_dry_run_arguments(parser: argparse.ArgumentParser) -> None:
    """`shardscope plan` flags for the dry run; `--dry-run` routes the command here."""
    group = parser.add_argument_group("dry run (real FSDP2 / TP sharding on the meta device, fake process group)")
    group.add_argument("--dry-run", action="store_true",
                       help="shard the model for the given ranks (FSDP2; TP with transformers) and count each "
                            "rank's bytes")
    group.add_argument("--world-size", type=int, help="total ranks (default: --gpus x --nodes)")
    group.add_argument("--strategy", action="append", choices=(*DRY_RUN_STRATEGIES, *NOT_DRY_RUN),
                       help="repeatable; default: the FSDP strategies (hybrid only with --nodes > 1), the TP ones "
                            "when the TP degree is above 1 (hsdp_tp only with --nodes > 1), and zero3")
    formula_command = parser.get_default("func")

    def command(args) -> int:
        return dry_run_command(args) if args.dry_run else formula_command(args)

    parser.set_defaults(func=command)


def dry_run_command(args) -> int:
    if not args.model:
        raise UsageError("--dry-run needs --model (a config to build; --params has no layer shapes)")
    if args.lora_rank:
        raise UsageError("--dry-run does not apply LoRA; drop --lora-rank")
    nodes = args.nodes
    world = args.world_size if args.world_size is not None else args.gpus * nodes
    if args.world_size is not None and args.gpus != 1 and args.gpus * nodes != world:
        raise UsageError(f"--world-size {world} disagrees with --gpus {args.gpus} x --nodes {nodes}")
    check_mesh(world, nodes)  # before anything heavy is imported
    setup = replace(setup_from_args(args), gpus_per_node=world // nodes, nodes=nodes).validate()
    out = dry_run_all(args.model, args.strategy, world, nodes, setup, knobs_from_args(args))
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(format_dry_run(out))
    return 0
