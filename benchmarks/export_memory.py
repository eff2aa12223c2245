"""Peak host memory of `shardscope export` beside the checkpoint's size (issue 34).

A random Llama (default ~134 M parameters, 0.54 GB of fp32 weights; largest tensor the 16,000 x 1,024
embedding, 65.5 MB) trains three steps on 2 CPU ranks under ZeRO-3, ZeRO-2 and FSDP2 (SHARDED_STATE_DICT), each
saving `checkpoint-3` through the Trainer, launched as tests/launch.py launches (`accelerate launch`, gloo).
Each checkpoint is then exported (`--model` names the model folder: an FSDP checkpoint holds no config) by:

- `shardscope export --max-shard-size S` (S = 100 MB by default: the weights are ~5x the shard size);
- the whole state dict in memory, then one safetensors file: what `export` did before (ZeRO: DeepSpeed's
  `get_fp32_state_dict_from_zero_checkpoint`; DCP: one `dcp.load` of every model tensor);
- ZeRO only: DeepSpeed's own `convert_zero_checkpoint_to_state_dict(max_shard_size=S, safe_serialization=True)`
  (lazy mode; the library's answer to the same problem).

Every export runs in a fresh child process that reports its own peak resident set (`VmHWM` from
/proc/self/status at its end: the peak over its whole life, mapped file pages included); the parent imports
neither torch nor transformers. The baseline is a child that imports what the exporters import and builds the
model on the meta device (what `export` does before it reads a tensor; importing the model's class alone
costs ~47 MB). Memory bound claimed by `export --help`: baseline + one shard + the largest tensor (DCP: up to twice the
largest tensor).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/export_memory.py --out benchmarks/results/export_memory.md

`--checkpoint C --model M` measures a checkpoint already saved (its model folder M) instead of training one: one
`--only` name labels its rows (tests/test_export.py runs `--quick` so on its own ZeRO-3 checkpoint).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the launch helpers the tests use
sys.path.insert(0, str(Path(__file__).resolve().parent))  # render_docs.stamped: the measured-at line
from render_docs import stamped  # noqa: E402

import yaml  # noqa: E402
from launch import accelerate_launch, cpu_env  # noqa: E402

MEASURES = ("plugin/shardscope/checkpoint", "plugin/shardscope/cli/export.py")  # render_docs.stale

PEAK = "print('VMHWM', next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))"
IMPORTS = ("import torch, transformers, safetensors.torch, deepspeed, torch.distributed.checkpoint; "
           "import shardscope.checkpoint.export; ")
EXPORTERS = {
    "baseline (imports, model built on the meta device)": "shardscope.checkpoint.export.model_from_config(MODEL)",
    "shardscope export --max-shard-size S": "from shardscope.cli import main; assert main(['export', CKPT, OUT, "
                                            "'--max-shard-size', SHARD, '--model', MODEL]) == 0",
    "whole state dict, one file (export before)": (
        "from pathlib import Path; from safetensors.torch import save_file; "
        "from shardscope.checkpoint.sources import open_source\n"
        "src = open_source(Path(CKPT))\n"
        "if src.kind == 'zero':\n"
        "    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as whole\n"
        "    state = whole(str(src.folder), tag=src.step.name)\n"
        "else:\n"
        "    state = src.read(list(src.shapes))\n"
        "Path(OUT).mkdir(); save_file({k: v.contiguous() for k, v in state.items() if k != 'lm_head.weight' "
        "or not torch.equal(v, state['model.embed_tokens.weight'])}, OUT + '/model.safetensors')"),
    "DeepSpeed convert_zero_checkpoint_to_state_dict (lazy, max_shard_size=S)": (
        "from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict as convert\n"
        "convert(CKPT, OUT, max_shard_size=SHARD, safe_serialization=True)"),
}
RUNS = {  # name -> (shipped accelerate yaml, fsdp_config overrides)
    "ZeRO-3": ("zero3.yaml", {}),
    "ZeRO-2": ("zero2.yaml", {}),
    "FSDP2 SHARDED_STATE_DICT (DCP)": ("fsdp_full_shard.yaml", {"fsdp_state_dict_type": "SHARDED_STATE_DICT"}),
}


def child(code: str, ckpt: Path, out: Path, shard: str, model: Path) -> tuple[int, float]:
    """(peak RSS in bytes, wall seconds) of a fresh process running `code`."""
    prelude = f"CKPT, OUT, SHARD, MODEL = {str(ckpt)!r}, {str(out)!r}, {shard!r}, {str(model)!r}\n"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", IMPORTS + "\n" + prelude + code + "\n" + PEAK], env=cpu_env(),
                          capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"exporter failed:\n{code}\n{done.stderr[-3000:]}")
    kib = int(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("VMHWM")))
    return kib * 1024, seconds


def train(work: Path, name: str, model: Path) -> Path:
    config, fsdp = RUNS[name]
    config_file = ROOT / "accelerate_configs" / config
    if fsdp:
        data = yaml.safe_load(config_file.read_text())
        data["fsdp_config"].update(fsdp)
        config_file = work / f"{config_file.stem}-sharded.yaml"
        config_file.write_text(yaml.safe_dump(data))
    out = work / name.split()[0]
    args = ["--model", model, "--max_steps", 3, "--save_steps", 3, "--per_device_train_batch_size", 1,
            "--samples", 4, "--use_cpu", "--report_to", "none"]
    accelerate_launch(config_file, ROOT / "tests" / "workers" / "train_tiny.py", args, out, timeout=1200).check()
    return out / "checkpoint-3"


def build_model(model: Path, args) -> Path:
    """The random Llama of the sizes asked for, saved in a child process (this one imports no torch)."""
    sizes = dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                 num_attention_heads=8, num_key_value_heads=8)
    subprocess.run([sys.executable, "-c", f"from shardscope.recipes.tiny import make_causal_lm; "
                    f"make_causal_lm({str(model)!r}, 'llama', vocab_size={args.vocab}, **{sizes!r})"],
                   env=cpu_env(), check=True, cwd=ROOT)
    return model


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--shard", default="100MB")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "export_memory.md")
    parser.add_argument("--only", nargs="+", choices=list(RUNS), default=list(RUNS), help="these checkpoints only")
    parser.add_argument("--quick", action="store_true", help="a tiny ZeRO-3 checkpoint, the baseline and `shardscope "
                        "export` only: checks the script works, not a result")
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint already saved, instead of training")
    parser.add_argument("--model", type=Path, help="the model folder of --checkpoint (its sizes replace the above)")
    args = parser.parse_args(argv)
    if bool(args.checkpoint) != bool(args.model):
        parser.error("give --checkpoint and --model together")
    exporters = dict(list(EXPORTERS.items())[:2]) if args.quick else EXPORTERS
    if args.quick:
        args.hidden, args.intermediate, args.layers, args.vocab, args.shard, args.only = 64, 128, 2, 512, "1MB", ["ZeRO-3"]
    if args.checkpoint and len(args.only) != 1:
        parser.error("--checkpoint: one --only name labels its rows")
    work = Path(tempfile.mkdtemp(prefix="export-memory-"))
    model = args.model or build_model(work / "model", args)
    config = json.loads((model / "config.json").read_text())
    args.hidden, args.intermediate = config["hidden_size"], config["intermediate_size"]
    args.layers, args.vocab = config["num_hidden_layers"], config["vocab_size"]
    weights = folder_bytes(model) - sum(p.stat().st_size for p in model.glob("*.json"))
    largest = 4 * args.vocab * args.hidden  # the embedding (and the untied lm_head), fp32
    rows = []
    for name in args.only:
        checkpoint = args.checkpoint or train(work, name, model)
        for exporter, code in exporters.items():
            if "DeepSpeed" in exporter and not name.startswith("ZeRO"):
                continue
            peak, seconds = child(code, checkpoint, work / f"out-{len(rows)}", args.shard, model)
            rows.append((name, folder_bytes(checkpoint), exporter, peak, seconds))
            print(rows[-1], flush=True)
    write(args, rows, weights, largest)


def write(args, rows, weights: int, largest: int) -> None:
    import importlib.metadata as md

    mb = lambda n: f"{n / 1e6:,.0f} MB"  # noqa: E731
    versions = ", ".join(f"{p} {md.version(p)}" for p in ("torch", "transformers", "deepspeed", "safetensors"))
    lines = ["# Export: peak host memory beside the checkpoint's size", "",
             f"command: `python benchmarks/export_memory.py --hidden {args.hidden} --intermediate {args.intermediate} "
             f"--layers {args.layers} --vocab {args.vocab} --shard {args.shard}"
             + ("" if args.only == list(RUNS) else " --only " + " ".join(shlex.quote(n) for n in args.only))
             + (" (--quick: the baseline and shardscope export only)" if args.quick else "") + "`", "",
             f"model: random Llama, {mb(weights)} of fp32 weights (`save_pretrained` folder), largest tensor "
             f"{mb(largest)}; shard size S = {args.shard}; three steps on 2 CPU ranks saved `checkpoint-3`.", "",
             f"machine: {platform.machine()}, {os.cpu_count()} cores; {versions}; peak = VmHWM of the exporting "
             "process (resident set, mapped file pages included); baseline = importing torch, transformers, "
             "safetensors, DeepSpeed and shardscope's exporter, and building the model on the meta device.", "",
             "| checkpoint | on disk (weights + optimizer) | exporter | peak RSS | above baseline | wall |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, disk, exporter, peak, seconds in rows:
        base = next(p for n, _, e, p, _ in rows if n == name and e.startswith("baseline"))
        above = "" if exporter.startswith("baseline") else mb(peak - base)
        lines.append(f"| {name} | {mb(disk)} | {exporter} | {mb(peak)} | {above} | {seconds:.1f} s |")
    shard = int(float(args.shard[:-2]) * 1e6) if args.shard.endswith("MB") else None
    lines += ["", "The bound `export --help` states, above the baseline: one shard + the largest tensor = "
              + (f"{mb(shard + largest)} (ZeRO); DCP: one shard + twice the largest tensor = {mb(shard + 2 * largest)}."
                 if shard else "S + largest (ZeRO), S + 2 x largest (DCP).")]
    args.out.write_text(stamped("\n".join(lines) + "\n", __file__, MEASURES))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
