"""Planned vs measured peak of one training step on 2 CPU ranks: the table in docs/planner.md.

    nice python benchmarks/peak_agreement.py --launch OUT          # launch the runs below into OUT/<run>/
    python benchmarks/peak_agreement.py OUT                        # or rebuild the table from OUT's run folders
    python benchmarks/render_docs.py                               # then place the table into docs/planner.md

Each run is `accelerate launch` of tests/workers/train_tiny.py (a Trainer with the profiling callback) under a
shipped config, through `shardscope compare`'s own launcher (`launching.launch_command`, log in launch.log), on a
4-layer Llama (hidden 256, vocab 2048) at 2 x 256 tokens per rank, 3 steps; the callback measures step 3. The
`*_small_buckets` runs are the `deepspeed` launcher's, with a DeepSpeed JSON written into OUT (small buckets, 4 x 256
tokens: activations are most of their peak; the shipped ZeRO configs' peak is mostly DeepSpeed's reduce bucket).
FSDP runs need tests/cpu_shim (accelerate never runs FSDP on CPU by itself), put on PYTHONPATH here. The table
is `report`'s peak section (`peak_section.markdown_lines`: planned from `report.plan_vs_run`, the same plan
as `plan --against`), written to benchmarks/results/peak_agreement.md (with peak_agreement.png), which
benchmarks/render_docs.py places into docs/planner.md. A run that fails is listed, not fatal. Run folders given
on the command line (a folder of them works too) are read as they are; the table's header describes the runs
`--launch` makes. `--small` launches a 2-layer model of hidden 64 at 2 x 32 tokens instead (a check that the
script works, not a result).
"""
import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # render_docs.stamped: the measured-at line
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))  # peak_spec: the small-bucket ZeRO config
from peak_spec import SMALL_BUCKET_BATCH, SMALL_BUCKET_RUNS, SMALL_BUCKETS, small_bucket_config  # noqa: E402
from render_docs import stamped  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "train_tiny.py"
# render_docs.stale: the planner's peak (and the trace behind it), the profiler's measured peak, the report's table
MEASURES = ("plugin/shardscope/plan", "plugin/shardscope/measure", "plugin/shardscope/report/peak_section.py",
            "plugin/shardscope/report/plan_vs_run.py", "plugin/shardscope/data", "tests/workers/train_tiny.py")
RESULTS = ROOT / "benchmarks" / "results" / "peak_agreement.md"
MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4)
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
BATCH, SEQ = 2, 256
# (shipped config, precision, activation checkpointing): each strategy with checkpointing on and off; fp32 and bf16
# where the strategy runs bf16 on CPU (the ZeRO runs: fp32; DeepSpeed takes bf16 from a JSON config, not the yaml)
RUNS = [(config, precision, ckpt) for config, precisions in (("ddp", ("fp32", "bf16")),
                                                             ("fsdp_full_shard", ("fp32", "bf16")),
                                                             ("zero2", ("fp32",)), ("zero3", ("fp32",)))
        for precision in precisions for ckpt in (False, True)]
# ZeRO with every bucket DeepSpeed sizes far below a layer (tests/peak_spec.py SMALL_BUCKETS; the shipped JSON's other
# settings), at SMALL_BUCKET_BATCH rows per rank: activations are most of the peak, where the shipped configs'
# default reduce bucket is. Launched with the `deepspeed` launcher and the config written into OUT.
SMALL = {f"{config[3:]}_small_buckets": config for config in SMALL_BUCKET_RUNS}
RUNS += [(name, "fp32", False) for name in SMALL]


def run_name(config: str, precision: str, ckpt: bool) -> str:
    return f"{config}-{precision}" + ("-ckpt" if ckpt else "")


def launch_all(out: Path, only: list[str], small: bool = False) -> list[Path]:
    from shardscope.configs.catalog import resolve_config
    from shardscope.fit.launching import launch, launch_command
    from shardscope.recipes.tiny import make_causal_lm
    from shardscope.safe_io import atomic_write_text

    os.environ.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                      PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "cpu_shim"), str(ROOT / "plugin")]))
    model = out / "model"
    if not (model / "config.json").exists():
        make_causal_lm(model, **(SMALL if small else MODEL))
    run_dirs = []
    for config, precision, ckpt in RUNS:
        name = run_name(config, precision, ckpt)
        if only and name not in only:
            continue
        batch = SMALL_BUCKET_BATCH if config in SMALL else BATCH
        args = ["--model", model, "--seq_len", 32 if small else SEQ, "--samples", 6 * batch,
                "--per_device_train_batch_size", batch, "--max_steps", 3, "--report_to", "none", "--save_strategy",
                "no", *(["--gradient_checkpointing"] if ckpt else []), *(["--bf16"] if precision == "bf16" else [])]
        run_dir = out / name
        (run_dir / "shardscope_summary.json").unlink(missing_ok=True)  # never report a previous run's summary
        if config in SMALL:
            ds_config = out / f"{config}.json"
            atomic_write_text(ds_config, json.dumps(small_bucket_config(SMALL[config]), indent=1), "DeepSpeed config")
            cmd = launch_command("deepspeed", str(WORKER), ds_config, list(map(str, args)), run_dir, num_processes=2,
                                 launcher_args=["--master_addr", "127.0.0.1"])
        else:
            launcher = ["--num_processes", "2"] + ([] if config.startswith("zero") else ["--mixed_precision", "no"])
            cmd = launch_command("accelerate", str(WORKER), resolve_config(config, "accelerate"),
                                 list(map(str, [*args, "--use_cpu"])), run_dir, launcher_args=launcher)
        code, seconds = launch(cmd, run_dir)
        print(f"{name}: exit {code} after {seconds:.0f} s", flush=True)
        run_dirs.append(run_dir)
    return run_dirs


def table(run_dirs: list[Path], command: str, small: bool = False) -> tuple[str, list[dict]]:
    import torch

    from shardscope.report.compare import collect
    from shardscope.report.peak_section import markdown_lines

    order = [run_name(*run) for run in RUNS]
    rows = sorted(collect(run_dirs), key=lambda r: order.index(r["run"]) if r["run"] in order else len(order))
    failed = [f"- {r['run']}: {r['status']}: {r.get('reason')}" for r in rows
              if r["status"] != "ok" or not r.get("peak")]
    lines = markdown_lines(rows)[2:]  # without its heading: the docs section has its own
    model, seq = (SMALL, 32) if small else (MODEL, SEQ)
    header = [f"Generated by `benchmarks/peak_agreement.py` on {time.strftime('%Y-%m-%d')} ({os.cpu_count()} CPU "
              f"cores, {platform.machine()}, torch {torch.__version__}, gloo, 2 ranks, no GPU): a random Llama "
              f"(hidden {model['hidden_size']}, {model['num_hidden_layers']} layers, {model['num_attention_heads']} "
              f"heads / {model['num_key_value_heads']} KV heads, MLP {model['intermediate_size']}, vocab "
              f"{model['vocab_size']}), {BATCH} x {seq} tokens per rank, AdamW, shipped accelerate configs (FSDP "
              "through tests/cpu_shim). The `*_small_buckets` runs: the shipped DeepSpeed JSON with DeepSpeed's "
              "bucket and window sizes set small (tests/peak_spec.py, in elements: "
              + ", ".join(f"`{key}` {value:,}" for key, value in SMALL_BUCKETS.items())
              + f"; the stage3_ ones for ZeRO-3, all-gather for ZeRO-2) at {SMALL_BUCKET_BATCH} x {seq} tokens per "
              "rank, through the `deepspeed` launcher. Command: `" + command + "`.", ""]
    shares = [f"{r['run']} {share(r['peak']['measured']):.1%}" for r in rows if r.get("peak")]
    share_line = ["Activations' share of the measured peak (activations / `peak_tensor_bytes`, the rank shown): "
                  + ", ".join(shares) + ".", ""] if shares else []
    failed_lines = ["Runs without a measured peak:", *failed, ""] if failed else []
    return "\n".join(header + lines + share_line + failed_lines), rows


def share(measured: dict) -> float:
    """Activations' share of a measured peak."""
    return measured["peak_breakdown"]["activations"] / measured["peak_tensor_bytes"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="*", type=Path, help="existing run folders (instead of --launch)")
    parser.add_argument("--launch", type=Path, metavar="OUT", help="launch the runs into OUT/<run>/ first")
    parser.add_argument("--only", nargs="*", default=[], help="with --launch: only these runs, e.g. ddp-fp32 zero3-fp32")
    parser.add_argument("--small", action="store_true", help="with --launch: a tiny model (checks the script works)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the results file (and its .png beside it)")
    args = parser.parse_args(argv)
    if bool(args.launch) == bool(args.run_dirs):
        parser.error("give --launch OUT or run folders, not both")
    run_dirs = launch_all(args.launch, args.only, args.small) if args.launch else args.run_dirs
    command = "python benchmarks/peak_agreement.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text, rows = table(run_dirs, command, args.small)
    import io

    import matplotlib

    from shardscope.report.peak_section import plot_peak
    from shardscope.safe_io import atomic_write_bytes, atomic_write_text

    matplotlib.use("Agg")
    image = io.BytesIO()
    plot_peak([r for r in rows if r.get("peak")], image, "2 CPU ranks, 4-layer Llama")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = args.out.with_suffix(".png")
    atomic_write_bytes(png, image.getvalue(), "results")
    atomic_write_text(args.out, stamped("# Peak memory of one step: planned vs measured\n\n" + text
                                        + f"\n![{png.name}]({png.name})\n", __file__, MEASURES), "results")
    print(text)


if __name__ == "__main__":
    main()
