"""`shardscope calibrate` on 2 CPU ranks: fit's search on a tiny Llama, then one short profiled run of the SFT recipe
per library family that fits (here DDP and FSDP2 full shard: `--strategy` keeps DeepSpeed's JIT-built ops out of
the suite), calibration.json written, and `fit --calibrate calibration.json` ranking from it; then what a user can
give wrongly (another precision or model, a broken file, another machine) without a launch.

FSDP on CPU needs tests/cpu_shim on PYTHONPATH (accelerate would silently run DDP): the launched runs inherit it."""
import json

import pytest

from launch import shardscope_cli as shardscope

pytestmark = pytest.mark.launch
SEQ = 96  # recipes/llama/demo_tiny.yaml's max_seq_length: the search plans what the runs train
# A run predicted from its own figures gives its median back but for the collectives the planner's terms leave
# out: the calibrated bandwidth divides all counted all-reduce bytes (the Trainer's loss all-reduces too) by the
# measured seconds, the prediction sends only the planned gradient bytes; on this tiny model about 1e-4 of a step.
ADDS_UP = 1e-3


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    from shardscope.recipes.tiny import make_sft_assets

    root = tmp_path_factory.mktemp("calibrate")
    assets = make_sft_assets(root / "assets", "llama", n=64)
    search = ["--model", assets["model"], "--gpus", 2, "--gpu-memory", "4GB", "--seq-len", SEQ, "--global-batch", 8,
              "--precision", "fp32"]
    done = shardscope("calibrate", *search, "--strategy", "ddp", "--strategy", "fsdp_full_shard",
                      "--recipe", "recipes/causal_lm_sft.py", "--steps", 6, "--output-dir", root / "out",
                      "--launcher-args", "--num_processes 2 --mixed_precision no", "--",
                      "--config", "recipes/llama/demo_tiny.yaml", "--model_name_or_path", assets["model"],
                      "--dataset", assets["data"])
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    return done, root / "out", search


def test_one_run_per_library_family_and_their_figures(calibrated):
    done, out, _ = calibrated
    lines = done.stdout.splitlines()
    assert lines[0].startswith("[1/2] DDP or ZeRO-1/2: ddp, micro-batch ") and lines[1].startswith("      done in ")
    assert lines[2].startswith("[2/2] FSDP: fsdp_full_shard, micro-batch ") and lines[3].startswith("      done in ")
    doc = json.loads((out / "calibration.json").read_text())
    assert [(r["strategy"], r["status"]) for r in doc["runs"]] == [("ddp", "ok"), ("fsdp_full_shard", "ok")]
    assert doc["precision"] == "fp32" and doc["fingerprint"]["backend"] == "gloo"
    for run in doc["runs"]:  # each run's own figures, as --calibrate RUN_DIR reads them
        from shardscope.plan.calibration.run_dirs import run_sources

        assert [e["figures"] for e in run["figures"]] == [f for _, f in run_sources(run["run_dir"])]
        first = run["figures"][0]["figures"]
        assert first["flops_per_s"] > 0 and first["optimizer_s_per_param"] > 0
    fsdp = doc["runs"][1]["figures"][0]["figures"]
    assert set(fsdp["library_s_per_byte"]) == {"fsdp"}  # FSDP's own work, which the DDP run cannot time


def fit(capsys, *argv):
    """`shardscope fit ARGV` in this process: (exit code, stdout, stderr)."""
    from shardscope.cli import main

    code = main(["fit", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_fit_ranks_from_the_calibration_file(calibrated, capsys):
    """The file gives every figure the runs measured, the first run first, and each strategy's rows its own run's
    first: each calibration run is predicted at its own measured median; FSDP rows count FSDP's measured work. `fit`
    ranks by those figures: every listed candidate's step is the model's from the file (computed here from the
    planner's row, FSDP's from FSDP's own run first), the candidates come fastest first (a tie's winner, the simplest
    within the bar (`search.TIE_RULE`), moved to the front), and the winner is the fastest or that."""
    from dataclasses import replace

    from shardscope.model.spec import model_spec
    from shardscope.plan.calibration.figures import calibrate, hardware, measured_figures
    from shardscope.plan.mesh import Setup
    from shardscope.plan.planner import estimate
    from shardscope.plan.time_model import datasheet_figures, model_error, step_time
    from shardscope.report.time_prediction import predict_run
    from shardscope.fit.search import simplicity, tier_rank

    _, out, search = calibrated
    file = out / "calibration.json"
    code, out_text, err = fit(capsys, *search, "--calibrate", file, "--json")
    assert code == 0, err[-3000:]
    result = json.loads(out_text)
    record = result["calibration"]
    assert record["flops_per_s"]["run"].startswith(f"{file} ({out / 'ddp'}")  # the DDP run came first
    assert record["library_s_per_byte"]["fsdp"]["run"].startswith(f"{file} ({out / 'fsdp_full_shard'}")
    assert not any(t.startswith("library work of FSDP") for t in result["assumptions"]["text"])
    fig, _ = calibrate(measured_figures([file]), datasheet_figures(hardware("H100", "fp32")))
    assert set(fig.own) == {"fsdp_full_shard"} and set(result["assumptions"]["own"]) == {"fsdp_full_shard"}
    for name in ("ddp", "fsdp_full_shard"):
        predicted = predict_run(out / name, fig)  # from the file: its own strategy's run first
        assert predicted["predicted_s"] == pytest.approx(predicted["measured"]["median"], rel=ADDS_UP)
    spec = model_spec(str(search[search.index("--model") + 1]))
    for c in result["candidates"]:
        trial = Setup(gpus_per_node=2, precision="fp32", seq_len=SEQ, micro_batch=c["per_device_train_batch_size"],
                      grad_accum_steps=c["gradient_accumulation_steps"],
                      activation_checkpointing=c["gradient_checkpointing"])
        planned = estimate(spec, trial)
        r = next(r for r in planned["rows"] if r.strategy == c["strategy"])
        tokens = planned["activations"]["tokens_per_sample"]
        assert c["step_time_s"] == pytest.approx(step_time(r, spec, planned["model"], trial, tokens, fig)["step_time_s"])
        if c["strategy"] == "fsdp_full_shard":  # its own run's figures, not the DDP run's
            assert c["step_time_s"] != pytest.approx(
                step_time(r, spec, planned["model"], trial, tokens, replace(fig, own={}))["step_time_s"])
    steps = [c["step_time_s"] for c in result["candidates"]]
    assert steps[1:] == sorted(steps[1:]) and result["step_time_s"] == steps[0]
    assert {"ddp", "fsdp_full_shard"} <= {c["strategy"] for c in result["candidates"]}
    fastest = min(steps)
    tied = [c for c in result["candidates"] if c["step_time_s"] <= fastest * (1 + model_error(fig))]
    simplest = min(tied, key=lambda c: (tier_rank(c["strategy"]), c["gradient_checkpointing"], c["peak_bytes"],
                                        simplicity(c["strategy"], "fsdp"), c["gradient_accumulation_steps"]))
    assert steps[0] == fastest if len(tied) == 1 else result["candidates"][0] == simplest


def test_a_calibration_from_elsewhere_is_refused_or_flagged(calibrated, tmp_path, capsys):
    _, out, search = calibrated
    doc = json.loads((out / "calibration.json").read_text())
    cases = {"bf16": (["--precision", "bf16-mixed"], doc, "precision 'fp32'"),
             "model": (["--params", "7e9"], doc, "params_total"),
             "broken": ([], {**doc, "runs": [{"status": "ok"}]}, "malformed calibration file"),
             "version": ([], {**doc, "calibration_version": 9}, "'calibration_version' is 9")}
    for name, (extra, content, words) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(content))
        argv = [a for a in search if a != "--precision" and a != "fp32"] + ["--precision", "fp32"]
        if extra[:1] == ["--params"]:
            argv = argv[2:]  # --model out, --params in
        code, _, err = fit(capsys, *argv, *extra, "--calibrate", path)
        assert code == 2 and words in err and err.count("\n") == 1, (name, err)
        assert str(path) in err and "Traceback" not in err
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps({**doc, "fingerprint": {**doc["fingerprint"], "host": "another-host"}}))
    code, _, err = fit(capsys, *search, "--calibrate", moved)
    assert code == 0 and "measured on another machine (host 'another-host' there" in err


def test_a_failing_script_is_reported_with_its_log(tmp_path):
    """Your own script (`--script`) that dies at start: the run is a failed row with the last lines of its log, the
    file is still written, exit 1."""
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint('loading my model')\nraise SystemExit('my_training: CUDA out of memory')\n")
    done = shardscope("calibrate", "--params", "1e6", "--gpus", 2, "--gpu-memory", "4GB", "--seq-len", 64,
                      "--global-batch", 8, "--precision", "fp32", "--strategy", "ddp", "--script", script,
                      "--steps", 6, "--output-dir", tmp_path / "out",
                      "--launcher-args", "--num_processes 2 --mixed_precision no")
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert "failed after" in done.stdout and "my_training: CUDA out of memory" in done.stdout
    doc = json.loads((tmp_path / "out" / "calibration.json").read_text())
    (run,) = doc["runs"]
    assert run["status"] == "failed" and run["reason"] == "my_training: CUDA out of memory"
    log = (tmp_path / "out" / "ddp" / "launch.log").read_text().splitlines()
    assert run["log_tail"] == log[-len(run["log_tail"]):] and "loading my model" in "\n".join(log)
