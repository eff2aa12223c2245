"""How long `plan --dataset` takes on a large dataset: 100,000 Alpaca records of ~500 tokens (jsonl), a tiny Llama and
its byte-level tokenizer (shardscope.recipes.tiny), the command run as a user runs it (a fresh process: imports,
streamed reading, batched tokenisation, the traces of each batching's worst micro-batch), timed with wall clock, with
the child's peak RSS (VmHWM: bounded memory). The target (issue 53): within 60 s on 2 cores.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/plan_dataset.py --out benchmarks/results/plan_dataset.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # render_docs.stamped: the measured-at line
from render_docs import stamped  # noqa: E402

MEASURES = ("plugin/shardscope/plan/dataset.py", "plugin/shardscope/plan/batching.py", "plugin/shardscope/cli/plan_dataset.py")
TARGET_S = 60.0
WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "bird", "rock", "star"]


def write_data(path: Path, samples: int, words: int, seed: int = 0) -> None:
    """`samples` Alpaca records whose responses hold about `words` words (±20%), as jsonl."""
    rng = random.Random(seed)
    pool = [" ".join(rng.choice(WORDS) for _ in range(words * 6 // 5)) for _ in range(64)]
    with path.open("w") as out:
        for _ in range(samples):
            text = rng.choice(pool)[: rng.randint(words * 4, words * 6 // 5 * 5)]
            out.write(json.dumps({"instruction": "Repeat the words.", "input": "", "output": text}) + "\n")


def timed(command: list[str]) -> tuple[float, float, int, str]:
    """(wall seconds, CPU seconds, peak RSS bytes of the child, its stdout) of one run."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while child.poll() is None:
        try:
            status = Path(f"/proc/{child.pid}/status").read_text()
            peak = max(peak, int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) * 1024)
        except (OSError, StopIteration, ValueError):
            pass
        time.sleep(0.2)
    out, err = child.communicate()
    if child.returncode:
        raise SystemExit(f"plan --dataset failed ({child.returncode}): {err[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return time.perf_counter() - start, cpu, peak, out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--words", type=int, default=470, help="words per response (~1 token each)")
    parser.add_argument("--out", help="also write the table here (Markdown)")
    args = parser.parse_args(argv)
    from shardscope.recipes.tiny import make_sft_assets

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_sft_assets(root / "assets", "llama", n=64)["model"]
        data = root / "data.jsonl"
        write_data(data, args.samples, args.words)
        base = [sys.executable, "-m", "shardscope.cli.entry", "plan", "--model", str(model), "--dataset", str(data),
                "--max-length", "1024", "--micro-batch", "4", "--gpus", "2", "--precision", "fp32", "--json"]
        os.environ["SHARDSCOPE_CACHE"] = str(root / "cache")  # a first plan: every trace computed
        load = os.getloadavg()[0]
        wall, cpu, rss, out = timed(base)
        facts = json.loads(out)["data"]
        sample_wall, _, _, _ = timed([*base, "--sample", "10000"])
    pct = facts["length_percentiles"]
    lines = ["| samples | tokens | p50 / p99 / max | wall s (first run: traces too) | CPU s (both cores) | child peak "
             "RSS GB | --sample 10000 wall s | target | met |", "|---|---|---|---|---|---|---|---|---|",
             f"| {facts['samples']:,} | {facts['tokens']:,} | {pct['p50']} / {pct['p99']} / {pct['max']} | {wall:.1f} | "
             f"{cpu:.1f} | {rss / 1e9:.2f} | {sample_wall:.1f} | <= {TARGET_S:.0f} s wall | "
             f"{'yes' if wall <= TARGET_S else 'NO'} |", "",
             f"- date: {datetime.now().isoformat(timespec='seconds')}; command: `python benchmarks/plan_dataset.py`",
             f"- machine: {platform.platform()}, {os.cpu_count()} CPUs, load average (1 min) {load:.1f} at the start, "
             f"{os.getloadavg()[0]:.1f} at the end (other jobs on the same cores slow the wall clock, not the CPU s)",
             "- method: one `shardscope plan --dataset` process (tiny Llama, micro-batch 4, --max-length 1024, fp32, "
             "2 GPUs) on a fresh trace cache, wall clock, its CPU time (user + system, its threads included) and its "
             "VmHWM; tokenisation in batches of 1,000 rows (the fast tokenizer's backend encodes a batch on every core)"]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(stamped("# plan --dataset speed\n\n" + "\n".join(lines) + "\n", __file__, MEASURES))


if __name__ == "__main__":
    main()
