"""Predicted beside measured step time on 2 CPU ranks: the step-time model calibrated from a few runs, tallied out of sample.

    python benchmarks/time_prediction.py [--runs RUNS_DIR ... | --repeat N] [--small] [--output FILE]
        # -> benchmarks/results/time_prediction.md

Without --runs it trains them first (tests/workers/train_time.py under torchrun, at the highest CPU priority the
machine allows: DDP, ZeRO-1/2/3 through the Trainer's DeepSpeed integration, FSDP2 full shard and shard-grad-op
through tests/cpu_shim), every strategy's configurations (accumulation 1 and 2, checkpointing off and on) one after
another in one launched process, each strategy after a warm-up run, STEPS steps each (instrumented steps 1-3, plain
steps 4 on; each run's profiler times every collective kind once at its end: the summary's `link_probe`). Then:
calibrated from the DDP run at accumulation 1 without checkpointing alone (the collective kinds DDP never issues,
all_gather and reduce_scatter, from its link probe), every run's prediction beside its measured median; the
predicted order against the measured one wherever two runs' p10-p90 spreads do not overlap; the same without the
link probe; DDP predicted from the ZeRO-3 run alone; every run from one run of each library (`ONE_PER_LIBRARY`,
what `shardscope calibrate` runs); and, with several sets, how far the same configuration's median moved between
sets. Every tally counts only the runs the model was not calibrated from.
`--small`: DDP and ZeRO-3 only, two configurations (the test suite's size).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugin"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # render_docs.stamped: the measured-at line
from render_docs import git, machine, stamped  # noqa: E402
from shardscope.plan.time_model import CALIBRATED_BAR as TOLERANCE, ERROR_STATISTIC as STATISTIC, error_of  # noqa: E402,I001

MEASURES = ("plugin/shardscope/plan", "plugin/shardscope/report/time_prediction.py", "plugin/shardscope/measure",
            "tests/workers/train_time.py")  # render_docs.stale: the model, the planner it prices, the measurements
LIBRARIES = ("torch", "transformers", "accelerate", "deepspeed")

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp_full_shard", "fsdp_shard_grad_op")  # train_time.py's names
CONFIGS = ("a1c0", "a2c0", "a1c1", "a2c1")  # accumulation x checkpointing
MODEL = dict(vocab_size=408, hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=6)  # benchmarks/strategies_cpu.sh's model: a step is compute, not launch overhead


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def priority_raised() -> bool:
    """Whether this machine lets a process raise its CPU priority (`nice -n -20`: root, or CAP_SYS_NICE)."""
    return subprocess.run([sys.executable, "-c", "import os; os.nice(-20)"], capture_output=True).returncode == 0


def where_it_ran() -> dict:
    """The commit, date, machine and library versions of runs trained now (each set's own, in its set.json)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {"commit": (git("rev-parse", "--short=12", "HEAD") or "").strip() or None,
            "uncommitted_changes": bool(git("status", "--porcelain", "--", *MEASURES)),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(), "python": platform.python_version(),
            "libraries": {name: installed(name) for name in LIBRARIES}}


def sets_table(roots: list[Path]) -> list[str]:
    """Where and when each folder of runs was trained (its set.json): one row per set, its own commit
    (render_docs --check judges each set by it)."""
    lines = ["## Where each set was trained", "",
             "| set | folder | commit | date | machine | Python | libraries |", "| --- " * 7 + "|"]
    for root in roots:
        try:
            doc = json.loads((root / "set.json").read_text())
        except (OSError, ValueError):
            doc = {"set": "-", "commit": "-", "date": "not recorded (no set.json)"}
        commit = (doc.get("commit") or "-") + (" (with uncommitted changes)" if doc.get("uncommitted_changes") else "")
        libraries = ", ".join(f"{k} {v}" for k, v in (doc.get("libraries") or {}).items() if v)
        lines.append(f"| {doc.get('set')} | {root.name} | {commit} | {doc.get('date')} | {doc.get('machine', '-')} | "
                     f"{doc.get('python', '-')} | {libraries or '-'} |")
    return lines + [""]


SMALL = {"strategies": ("ddp", "zero3"), "configs": ("a1c0", "a2c1")}
# What `shardscope calibrate` runs here: one run of each library family at the candidates' micro-batch, no
# accumulation, no checkpointing (DDP's compute and links first, then each gathering library's own per-module work).
# Every tally counts only the other runs (out of sample).
ONE_PER_LIBRARY = ("ddp/a1c0", "zero3/a1c0", "fsdp_full_shard/a1c0")
TARGET = 0.90  # of the other configurations within TOLERANCE, calibrated from ONE_PER_LIBRARY
STEPS = 16  # optimizer steps per run: 13 plain steps for each median and p10-p90 (the test suite's runs take 8)
# The development set: what the model was reworked against while its runs were watched (MODEL, fp32, micro-batch 2
# x 128 tokens, accumulation 1 and 2). Its tallies are out of sample of the calibration runs only.
DEVELOPMENT = dict(model=MODEL, micro_batch=2, seq_len=128, precision="fp32", configs=CONFIGS)
# The held-out set, fixed before any of its runs was trained or seen: a model shape (hidden 512, 3 layers, grouped
# KV heads, a larger vocabulary), a sequence length (320), a micro-batch (1), an accumulation (3) and a precision
# (bf16 mixed) the development set never used. Calibrated from its own ONE_PER_LIBRARY runs, tallied on the others:
# out of sample of the calibration and of the development. Do not change it after its runs have been looked at.
HELD_OUT = dict(model=dict(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=3,
                           num_attention_heads=8, num_key_value_heads=4),
                micro_batch=1, seq_len=320, precision="bf16", configs=("a1c0", "a3c0", "a1c1", "a3c1"))


def train_all(root: Path, strategies=STRATEGIES, configs=CONFIGS, priority: bool = False, warmup: bool = False,
              timeout: int = 900, model: dict = MODEL, steps: int | None = None, micro_batch: int = 2,
              seq_len: int = 128, precision: str = "fp32", name: str = "development") -> None:
    """The strategies' configurations in one torchrun launch per library (the Trainer refuses FSDP in a process where a
    DeepSpeed run set its flag), `timeout` seconds per strategy; with `priority`, at a raised CPU priority where the
    machine allows it (the benchmark: other work on the machine then takes less of the timed steps' cores; not in
    the test suite, whose other worker runs tests with deadlines of their own); with `warmup`, each strategy first
    trains its first configuration once more into root/warmup/, so that no recorded run is its strategy's first in
    the process (a process's first steps ran slower: the first run of a launch was the slowest per pass of its
    strategy in 5 of 6 launches before any warm-up). `model`: the random Llama's config sizes (default MODEL, the
    benchmark's); `steps`: optimizer steps per run (default train_time.py's); `micro_batch`, `seq_len`, `precision`
    (fp32 or bf16 mixed): each run's step. root/set.json records the set (`name`), its shape and where it ran."""
    from shardscope.recipes.tiny import make_causal_lm

    make_causal_lm(root / "model", "llama", **model)
    shape = dict(model=model, micro_batch=micro_batch, seq_len=seq_len, precision=precision, configs=list(configs))
    (root / "set.json").write_text(json.dumps({"set": name, "shape": shape, **where_it_ran()}, indent=1))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "cpu_shim"), str(ROOT / "plugin")]))
    nice = ["nice", "-n", "-20"] if priority and priority_raised() else []
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    launch = [*nice, torchrun, "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    groups = [g for g in ([s for s in strategies if not s.startswith("fsdp")],
                          [s for s in strategies if s.startswith("fsdp")]) if g]
    commands = [([*launch, "--master_port", free_port(), str(ROOT / "tests" / "workers" / "train_time.py"), "--model",
                  str(root / "model"), "--configs", ",".join(configs), "--strategies", ",".join(group),
                  "--micro_batch", str(micro_batch), "--seq_len", str(seq_len), "--precision", precision,
                  "--output_dir", str(root), *["--warmup"] * warmup, *(["--steps", str(steps)] if steps else [])],
                 timeout * len(group) * (1 + warmup))
                for group in groups]
    for cmd, seconds in commands:
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=seconds)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def calibrated(root: Path, *runs: str, probe: bool = True):
    """The model's figures calibrated from `runs` under `root`, read as `--calibrate RUN ...` reads them (each run's
    link probe included unless `probe` is false: then one run alone)."""
    from shardscope.plan.calibration.figures import calibrate, hardware, measured_figures
    from shardscope.plan.time_model import datasheet_figures

    measured = measured_figures([root / run for run in runs])
    return calibrate(measured if probe else measured[:1], datasheet_figures(hardware("H100", "fp32")))[0]


def predictions(root: Path, run: str) -> list[dict]:
    """Every run under `root` predicted by the model calibrated from `run` alone."""
    return predicted(root, calibrated(root, run))


def predicted(root: Path, fig) -> list[dict]:
    """Every run under `root` predicted with the figures `fig`."""
    from shardscope.report.time_prediction import explaining_part, predict_run

    out = []
    for name in STRATEGIES:
        for config in dict.fromkeys(CONFIGS + HELD_OUT["configs"]):
            run = root / name / config
            if (run / "shardscope_summary.json").is_file():
                p = predict_run(run, fig)
                out.append({**p, "name": f"{name}/{config}", "explains": explaining_part(p)})
    return out


def compute_per_pass(r: dict) -> float:
    """Measured compute seconds per forward + backward of one micro-batch (a checkpointed one counts 4/3): the
    same FLOPs in every run, so its spread is what no single compute rate can predict."""
    return r["measured_parts"]["compute"] / (r["accumulation"] * (4 / 3 if r["checkpointing"] else 1))


def table(rows: list[dict]) -> list[str]:
    lines = ["| run | accumulation | checkpointing | predicted (s) | measured median (s) | p10-p90 (s) | error | "
             "largest part difference | measured compute per pass (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["measured"]
        flag = "" if abs(r["error"]) <= TOLERANCE else " **over 15%**"
        lines.append(f"| {r['name']} | {r['accumulation']} | {'on' if r['checkpointing'] else 'off'} | "
                     f"{r['predicted_s']:.3f} | {m['median']:.3f} | {m['p10']:.3f}-{m['p90']:.3f} | "
                     f"{r['error']:+.1%}{flag} | {r['explains'] or '-'} | {compute_per_pass(r):.3f} |")
    return lines


def order_disagreements(rows: list[dict]) -> tuple[int, list[tuple[str, str]]]:
    """(pairs whose measured p10-p90 spreads do not overlap, those of them the prediction orders the other way)."""
    apart, wrong = 0, []
    for a, b in itertools.combinations(rows, 2):
        ma, mb = a["measured"], b["measured"]
        if ma["p90"] < mb["p10"] or mb["p90"] < ma["p10"]:
            apart += 1
            if (ma["median"] < mb["median"]) != (a["predicted_s"] < b["predicted_s"]):
                wrong.append((a["name"], b["name"]))
    return apart, wrong


def within(rows: list[dict]) -> int:
    return sum(abs(r["error"]) <= TOLERANCE for r in rows)


def others(rows: list[dict], *calibration: str) -> list[dict]:
    """The rows not calibrated from: what a tally counts."""
    return [r for r in rows if r["name"] not in calibration]


def links_line(root: Path, fig) -> str:
    bus = ", ".join(f"{kind} {speed / 1e9:.3g} GB/s" for kind, speed in sorted(fig.bus_bytes_per_s.items()))
    return f"Bus bandwidth per collective kind ({fig.sources['bus_bytes_per_s'].replace(f'{root}/', '')}): {bus}."


def per_library(root: Path) -> dict:
    """Every run under `root` predicted from one run of each library (ONE_PER_LIBRARY: what `shardscope calibrate`
    runs); its tallies count only the other runs: within the bar, the predicted order, the calibrated error."""
    libraries = [run for run in ONE_PER_LIBRARY if (root / run / "shardscope_summary.json").is_file()]
    fig = calibrated(root, *libraries)
    rows = predicted(root, fig)
    tallied = others(rows, *libraries)
    apart, wrong = order_disagreements(tallied)
    return {"libraries": libraries, "fig": fig, "rows": rows, "within": within(tallied), "runs": len(tallied),
            "order": f"{apart - len(wrong)} of {apart}", "wrong": wrong,
            "error": error_of([r["error"] for r in tallied]) if tallied else None}


def per_library_lines(root: Path, lib: dict, title: str, intro: tuple = ()) -> list[str]:
    """The part of a section calibrated from one run of each library: `title`, `intro` lines, the table."""
    work = ", ".join(f"{k} {v * 1e9:.3g} ns" for k, v in sorted(lib["fig"].library_s_per_byte.items()))
    error = f"{lib['error']:.1%}" if lib["error"] is not None else "-"
    return [f"{title}: calibrated from one run of each library ({', '.join(lib['libraries'])}: what `shardscope "
            f"calibrate` runs), {lib['within']} of the {lib['runs']} other runs within {TOLERANCE:.0%}; the calibrated "
            f"error over them {error} ({STATISTIC})", "", *intro,
            f"Library work per byte of whole tensors gathered or reduce-scattered: {work}. "
            f"{links_line(root, lib['fig'])}", "", *table(lib["rows"]), "",
            f"Predicted order (the other runs): {lib['order']} clearly separated pairs ordered as measured" + (
                f"; not: {', '.join(f'{a} / {b}' for a, b in lib['wrong'])}." if lib["wrong"] else "."), ""]


def section(root: Path) -> tuple[list[str], dict]:
    """The section of one folder of development runs, and its counts for the summary (`summary`)."""
    main_fig, zero3_fig = calibrated(root, "ddp/a1c0"), calibrated(root, "zero3/a1c0")
    all_rows = predicted(root, main_fig)
    main_rows = others(all_rows, "ddp/a1c0")
    passes = [compute_per_pass(r) for r in all_rows]
    apart, wrong = order_disagreements(main_rows)
    text = [f"## Runs in {root.name} (development): calibrated from ddp/a1c0 alone (DDP, accumulation 1, "
            f"checkpointing off), {within(main_rows)} of the {len(main_rows)} other runs within {TOLERANCE:.0%}",
            "", links_line(root, main_fig), "", *table(all_rows), "",
            f"Predicted order: {apart - len(wrong)} of the {apart} pairs of runs whose measured p10-p90 spreads do not "
            "overlap are ordered as measured" + (f"; not: {', '.join(f'{a} / {b}' for a, b in wrong)}." if wrong
                                                 else "."), "",
            f"Measured compute per forward + backward pass of the same micro-batch (same FLOPs in every run): "
            f"{min(passes):.3f} to {max(passes):.3f} s, a {max(passes) / min(passes):.2f}x spread between runs; the "
            "model has one achieved FLOP/s, so the compute part alone is off by up to that spread.", ""]
    unprobed_fig = calibrated(root, "ddp/a1c0", probe=False)
    unprobed = others(predicted(root, unprobed_fig), "ddp/a1c0")
    text += [f"From ddp/a1c0 without its link probe: {within(unprobed)} of {len(unprobed)} within "
             f"{TOLERANCE:.0%}. {links_line(root, unprobed_fig)}", ""]
    from_zero3 = [r for r in predicted(root, zero3_fig) if r["strategy"] == "ddp"]
    lib = per_library(root)
    stats = {"within": within(main_rows), "runs": len(main_rows), "order": f"{apart - len(wrong)} of {apart}",
             "unprobed": within(unprobed), "reverse": within(from_zero3), "reverse_runs": len(from_zero3),
             "per_library": lib["within"], "library_runs": lib["runs"], "library_order": lib["order"],
             "libraries": ", ".join(lib["libraries"]), "error": lib["error"],
             "medians": {r["name"]: r["measured"]["median"] for r in all_rows},
             "update_ddp": main_fig.optimizer_s_per_param, "update_zero3": zero3_fig.optimizer_s_per_param,
             "zero_step": zero3_fig.zero_step_s_per_param}
    return text + [f"### Runs in {root.name}: DDP calibrated from zero3/a1c0 alone, "
                   f"{within(from_zero3)} of {len(from_zero3)} within {TOLERANCE:.0%}", "",
                   links_line(root, zero3_fig), "", *table(from_zero3), "",
                   *per_library_lines(root, lib, f"### Runs in {root.name}")], stats


def held_out_section(root: Path) -> tuple[list[str], dict]:
    """The section of one folder of held-out runs (HELD_OUT), and its counts for the summary."""
    lib = per_library(root)
    return per_library_lines(root, lib, f"## Held-out runs in {root.name}"), lib


def summary(stats: list[dict], held: list[dict]) -> list[str]:
    """The part docs/fit.md places: each set of runs' counts, in the order of the sections below."""
    def each(key, sets=stats):
        return ", ".join(str(s[key]) for s in sets)

    def errors(sets):
        return ", ".join(f"{s['error']:.1%}" if s["error"] is not None else "-" for s in sets)

    first = stats[0]
    met = all(s["per_library"] >= TARGET * s["library_runs"] for s in stats)
    kept = (f"{each('within', held)} of {held[0]['runs']} other runs within {TOLERANCE:.0%}; calibrated error "
            f"{errors(held)}; predicted order right for {each('order', held)} clearly separated pairs") if held else \
        "not run yet"
    return ["<!-- part:summary -->",
            f"- Calibrated from what `shardscope calibrate` runs ({first['libraries']}: DDP's compute and links, "
            "each gathering library's own per-module work, which a DDP run cannot time), in each of "
            f"{len(stats)} development set(s) of runs: {each('per_library')} of the {first['library_runs']} other "
            f"runs within {TOLERANCE:.0%} of their measured median (target {TARGET:.0%}: {'met' if met else 'not met'}"
            f"); predicted order right for {each('library_order')} clearly separated pairs of them. Out of sample of "
            "the calibration runs, in sample of the development: the model was reworked while these runs were "
            "watched.",
            f"- Held out (HELD_OUT: a shape, sequence length, accumulation and precision not used while developing, "
            f"fixed before its runs were seen), calibrated the same way: {kept}.",
            f"- The calibrated error ({STATISTIC}, the statistic of the datasheet error): development "
            f"{errors(stats)}; held out {errors(held) if held else 'not run yet'}. `fit`'s tie bound with calibrated "
            f"figures is the {TOLERANCE:.0%} bar (`time_model.CALIBRATED_BAR`), not these figures.",
            f"- Calibrated from ddp/a1c0 alone (its steps and the link probe at its end): {each('within')} of the "
            f"{first['runs']} other runs within {TOLERANCE:.0%}; predicted order right for {each('order')} clearly "
            "separated pairs.",
            f"- Without the link probe (all_gather and reduce_scatter taken at all_reduce's speed): {each('unprobed')} "
            f"of {first['runs']} within {TOLERANCE:.0%}.",
            f"- DDP calibrated from zero3/a1c0 alone: {each('reverse')} of {first['reverse_runs']} within "
            f"{TOLERANCE:.0%}. Optimizer, per parameter a rank steps (first set): the update "
            f"{first['update_ddp'] * 1e9:.2g} ns on DDP (torch's AdamW), {first['update_zero3'] * 1e9:.2g} ns inside "
            f"DeepSpeed's step on ZeRO-3, and DeepSpeed's step around it {first['zero_step'] * 1e9:.2g} ns.",
            *repeatability(stats), "<!-- /part:summary -->", ""]


def repeatability(stats: list[dict]) -> list[str]:
    """With several sets: how far the same configuration's measured median moved between sets (the measurement's
    own spread, which no prediction from one set can be closer than)."""
    names = set.intersection(*(set(s["medians"]) for s in stats))
    if len(stats) < 2 or not names:
        return []
    moved = {n: max(m) / min(m) - 1 for n, m in ((n, [s["medians"][n] for s in stats]) for n in names)}
    spread, worst = sorted(moved.values()), max(moved, key=moved.get)
    return [f"- The same configuration measured in each set: its median moved between sets by {spread[0]:.0%} to "
            f"{spread[-1]:.0%} (median {spread[len(spread) // 2]:.0%}; most: {worst}), the runs' own repeatability."]


def trained(count: int, shape: dict, name: str, small: bool) -> list[Path]:
    """`count` new folders of runs of `shape` (DEVELOPMENT or HELD_OUT), trained here; `small`: DDP and ZeRO-3, the
    shape's first and last configuration."""
    roots = [Path(tempfile.mkdtemp(prefix=f"time_prediction-{name}-")) for _ in range(count)]
    configs = (shape["configs"][0], shape["configs"][-1]) if small else shape["configs"]
    for root in roots:
        train_all(root, SMALL["strategies"] if small else STRATEGIES, configs, priority=True, warmup=True,
                  model=shape["model"], steps=STEPS, micro_batch=shape["micro_batch"], seq_len=shape["seq_len"],
                  precision=shape["precision"], name=name)
    return roots


def header() -> list[str]:
    priority = "the launches ran at CPU priority nice -20" if priority_raised() else \
        "this machine refused a raised CPU priority: the launches shared the cores at the same priority as other work"
    return ["# Step time predicted beside measured (2 CPU ranks, gloo)", "",
            "Generated by `benchmarks/time_prediction.py` (this file is its output; each folder of runs is one "
            f"section; the last table says the commit, date, machine and library versions each was trained at; "
            f"{priority}). "
            "Development set: random Llama, hidden 384, 4 layers, vocab 408 (7.4M parameters), fp32, micro-batch 2 "
            "x 128 tokens per rank, accumulation 1 and 2. Held-out set (`HELD_OUT`): hidden 512, 3 layers, 8 heads "
            "over 4 KV heads, vocab 2048, bf16 mixed, micro-batch 1 x 320 tokens, accumulation 1 and 3. "
            f"{STEPS} optimizer steps per run, profiler instruments at steps "
            "1-3, each strategy's runs begin with one unrecorded warm-up run of its first configuration, "
            "medians over the plain steps. The largest part difference is the part (compute, exposed_comm, "
            "optimizer, overhead) whose prediction is furthest from the timed step's breakdown scaled to the median "
            "(signed: + predicted more).", ""]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", nargs="+", type=Path, help="folders of development runs already trained (one "
                                                             "section each)")
    parser.add_argument("--held-out", nargs="+", type=Path, default=[],
                        help="folders of held-out runs already trained (HELD_OUT; one section each)")
    parser.add_argument("--small", action="store_true", help="DDP and ZeRO-3, two configurations")
    parser.add_argument("--repeat", type=int, default=1, help="without --runs: train this many development sets "
                                                              "(and, without --held-out, one held-out set)")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "time_prediction.md")
    args = parser.parse_args(argv)
    roots, held_roots = args.runs, args.held_out
    if not roots:
        roots = trained(args.repeat, DEVELOPMENT, "development", args.small)
        held_roots = held_roots or trained(1, HELD_OUT, "held_out", args.small)
    sections = [section(root) for root in roots]
    held = [held_out_section(root) for root in held_roots]
    text = header() + summary([stats for _, stats in sections], [stats for _, stats in held])
    for lines, _ in sections + held:
        text += lines
    text += sets_table([*roots, *held_roots])
    args.output.write_text(stamped("\n".join(text), __file__, MEASURES))
    print("\n".join(text))


if __name__ == "__main__":
    main()
