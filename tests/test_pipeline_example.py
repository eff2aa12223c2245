"""examples/pipeline_parallel.py: 2 pipeline stages under real torchrun train like the whole model in one process."""
import json
import subprocess
import sys

import pytest
from launch import ROOT, cpu_env, torchrun_launch

EXAMPLE = ROOT / "examples" / "pipeline_parallel.py"
STEPS = 5


@pytest.mark.launch
def test_pipeline_matches_single_process(tmp_path):
    args = ["--steps", STEPS, "--microbatches", 4]
    run = torchrun_launch(EXAMPLE, args, tmp_path / "pipeline").check()  # appends --output_dir: losses.json there
    single = subprocess.run([sys.executable, str(EXAMPLE), *map(str, args), "--no-pipeline",
                             "--losses_out", str(tmp_path / "single.json")],
                            env=cpu_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stdout + single.stderr
    pp = json.loads((tmp_path / "pipeline" / "losses.json").read_text())
    ref = json.loads((tmp_path / "single.json").read_text())

    assert (pp["mode"], pp["world_size"], ref["mode"], ref["world_size"]) == ("pipeline", 2, "single", 1)
    assert pp["microbatches"] > 1
    # same model, init, data and optimizer: micro-batched GPipe gives the full-batch losses, step by step
    assert len(pp["losses"]) == len(ref["losses"]) == STEPS
    assert pp["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=0)
    assert pp["losses"][-1] < pp["losses"][0]
    # the last stage printed the losses that were written
    assert f"stage 2/2] step {STEPS} loss {pp['losses'][-1]:.6f}" in run.output

    # each stage holds a strict part of the model; together exactly the whole (params, grads, AdamW state)
    stages, whole = pp["stages"], ref["stages"][0]
    assert [s["stage"] for s in stages] == [0, 1]
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert all(0 < s[key] < whole[key] for s in stages), (key, stages, whole)
        assert sum(s[key] for s in stages) == whole[key], (key, stages, whole)
    assert all(s["peak_rss_bytes"] > 0 for s in stages)
