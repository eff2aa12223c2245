"""The `shardscope fit` outputs docs/fit.md shows, from the commands that print them.

Deterministic (the search and the step-time model are computed on datasheet figures, not timed) and fast: four
searches in one process, run in a scratch folder (the first writes `fit_out/`). The results file holds each
command and its output as a part that benchmarks/render_docs.py places into docs/fit.md; tests/test_benchmarks.py
writes it again and compares.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/fit_examples.py --out benchmarks/results/fit_examples.md
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "fit_examples.md"
EXAMPLES = {
    "llama-7b-h100": ["--model", "llama-2-7b", "--gpus", "8", "--gpu", "H100", "--seq-len", "4096",
                      "--global-batch", "64", "--output-dir", "fit_out"],
    "mistral-7b-a100": ["--model", "mistral-7b", "--gpus", "4", "--gpu", "A100-80", "--seq-len", "512",
                        "--global-batch", "64"],
    "mistral-7b-a100-lora": ["--model", "mistral-7b", "--gpus", "4", "--gpu", "A100-80", "--seq-len", "512",
                             "--global-batch", "64", "--lora-rank", "16", "--lora-targets", "all-linear"],
    "70b-one-l4": ["--params", "70e9", "--gpus", "1", "--gpu", "L4", "--seq-len", "4096", "--global-batch", "8"],
}


def fit(argv: list[str]) -> tuple[int, str]:
    from shardscope.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["fit", *argv])
    return code, out.getvalue()


def written(folder: Path) -> dict:
    """The files the first example's `--output-dir` wrote, as parts of their own."""
    return {name.removesuffix(".yaml").replace("_", "-"): ["```yaml", (folder / name).read_text().rstrip("\n"), "```"]
            for name in ("accelerate_config.yaml", "training_args.yaml")}


def markdown(outputs: dict, files: dict) -> str:
    lines = ["# `shardscope fit` outputs shown in docs/fit.md", "",
             "Written by `benchmarks/fit_examples.py` (computed on datasheet figures, not measured). Each part is one "
             "command, its output and its exit status.", ""]
    for name, (code, text) in outputs.items():
        lines += [f"<!-- part:{name} -->", "```", f"$ shardscope fit {' '.join(EXAMPLES[name])}", text.rstrip("\n"),
                  f"$ echo $?  # {code}", "```", f"<!-- /part:{name} -->", ""]
    for name, block in files.items():
        lines += [f"<!-- part:{name} -->", *block, f"<!-- /part:{name} -->", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "plugin"))
    from shardscope.safe_io import atomic_write_text

    out = args.out.resolve()
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
        outputs = {name: fit(argv) for name, argv in EXAMPLES.items()}
        text = markdown(outputs, written(Path("fit_out")))
    atomic_write_text(out, text, "results")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
