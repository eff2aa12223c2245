"""The SFT recipe resumes at another world size with the same global batch (issue 34), on CPU ranks over gloo.

For ZeRO-2, ZeRO-3 and FSDP2 (SHARDED_STATE_DICT, i.e. DCP) a 2-rank run trains STEPS steps and saves
checkpoint-SAVE_AT (in test_recipes' launches of their families, tests/recipe_runs.py); `shardscope reshard` turns it
into a checkpoint for any world size (DeepSpeed's universal format; DCP checked and copied); the resumes are launches
at the same global batch (WORLD_GLOBAL = ranks x per-device batch): each strategy on 1 rank and on 4, the three
one after the other in one launch per world size (each a fresh Trainer resuming from files: two launches of this
file's own). The two DeepSpeed stages load the universal format by different code (stage3.py's own loader vs the
ZeRO-1/2 fragment mapping), and DCP's resharding plans differ when the saved chunks must be split (4 ranks) or joined
(1 rank): each way is run.

Checks: each resumed run really ran at its world size and strategy; its losses for steps SAVE_AT+1..STEPS equal
the uninterrupted 2-rank run's (TOLERANCE); the Adam moments it holds at train begin (gathered on every rank by
tests/workers/resume_probe.py, after the checkpoint is loaded and before any step) equal the saved ones gathered
from the 2-rank checkpoint (`shardscope.checkpoint.sources`), exactly: loading copies them.
"""
from __future__ import annotations

import functools

import pytest
import torch

from launch import ROOT, SharedLaunches, launch_together
from recipe_checks import losses, run_lines
from recipe_runs import SAVE_AT, SFT, STEPS, WORLD_CONFIGS, world_args
from shardscope.cli import main

pytestmark = pytest.mark.launch

PROBE = ROOT / "tests" / "workers" / "resume_probe.py"
# fp32 throughout: a different world size sums gradients over ranks in a different order, so losses may differ
# in the last bits (measured: at most 1.4e-7 relative over steps 7-12); that, with margin, is the tolerance.
TOLERANCE = dict(rel=1e-5, abs=1e-6)
STRATEGIES = {  # name (tests/recipe_runs.py WORLD_CONFIGS) -> (distributed_type, wrapper), in launch order
    "fsdp2": ("FSDP", "FSDPLlamaForCausalLM"),
    "zero2": ("DEEPSPEED", "DeepSpeedEngine"),
    "zero3": ("DEEPSPEED", "DeepSpeedEngine"),
}
RESUMES = [(name, ranks) for name in STRATEGIES for ranks in (1, 4)]


@pytest.fixture(scope="module")
def resumed(sft_assets, recipe_runs, accelerate_yaml, tmp_path_factory):
    """`resumed(name, ranks)`: (uninterrupted 2-rank run, resharded checkpoint, resumed run), each launched once; the
    resumes at one world size in one launch (launch.launch_together)."""

    @functools.cache
    def resharded(name):
        full = recipe_runs("world", name)
        anywhere = tmp_path_factory.mktemp(f"{name}_resharded") / "checkpoint"
        assert main(["reshard", str(full.output_dir / f"checkpoint-{SAVE_AT}"), str(anywhere)]) == 0
        return full, anywhere

    def launch(keys):
        ranks = keys[0][1]
        out = tmp_path_factory.mktemp(f"resume{ranks}")
        runs = []
        for other, _ in keys:
            (out / other).mkdir()  # the probe's file goes into the run's folder before the Trainer makes it
            runs.append((other, accelerate_yaml(*WORLD_CONFIGS[other]), PROBE, [
                "--moments_out", out / other / "moments.pt", SFT,
                *world_args(sft_assets, ranks, "--resume_from_checkpoint", resharded(other)[1])]))
        launched = launch_together(runs, out, num_processes=ranks)
        return {(other, ranks): launched[other].check() for other, _ in keys}

    launches = SharedLaunches([[(name, ranks) for name in STRATEGIES] for ranks in sorted({r for _, r in RESUMES})],
                              launch)
    return lambda name, ranks: (*resharded(name), launches((name, ranks)))


@pytest.mark.parametrize("name, ranks", RESUMES)
def test_resume_at_another_world_size_continues_the_run(resumed, name, ranks):
    full, _, resume = resumed(name, ranks)
    kind, wrapper = STRATEGIES[name]
    lines = run_lines(resume)
    assert sorted(int(line["rank"]) for line in lines) == list(range(ranks)), resume.output[-3000:]
    assert {(line["world_size"], line["distributed_type"], line["wrapped"]) for line in lines} == {
        (str(ranks), kind, wrapper)}
    after = {step: loss for step, loss in losses(resume.output_dir).items() if step > SAVE_AT}
    assert sorted(after) == list(range(SAVE_AT + 1, STEPS + 1)), "the resumed run did not train steps k+1..N"
    uninterrupted = {step: loss for step, loss in losses(full.output_dir).items() if step > SAVE_AT}
    assert after == pytest.approx(uninterrupted, **TOLERANCE)


@pytest.mark.parametrize("name, ranks", RESUMES)
def test_resumed_moments_equal_the_saved_ones_gathered(resumed, sft_assets, name, ranks):
    from transformers import AutoModelForCausalLM

    from shardscope.checkpoint.sources import DcpSource, ZeroSource

    full, _, resume = resumed(name, ranks)
    checkpoint = full.output_dir / f"checkpoint-{SAVE_AT}"
    held = torch.load(resume.output_dir / "moments.pt")
    params = sorted({key.rsplit("/", 1)[0] for key in held})
    assert params == sorted(n for n, _ in AutoModelForCausalLM.from_pretrained(sft_assets["model"]).named_parameters())
    for key in ("exp_avg", "exp_avg_sq"):
        saved = (DcpSource(checkpoint / "optimizer_0", state=key) if name == "fsdp2"
                 else ZeroSource(checkpoint, None, state=key)).read(params)
        for param in params:
            assert torch.equal(held[f"{param}/{key}"].view(saved[param].shape), saved[param]), (key, param)
            assert saved[param].abs().sum() > 0  # six steps of Adam: not a fresh optimizer's zeros
