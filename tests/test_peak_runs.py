"""The planner's peak held against the callback's measured peak on 2 CPU ranks, per strategy.

A 4-layer Llama (hidden 256, vocab 2048) at 2 x 256 tokens per rank, so activations, gradients and
optimizer state all weigh in. Each run is a real `accelerate launch` of tests/workers/train_tiny.py
with a shipped config; the callback measures step 3 with torch's MemTracker (`peak_tensor_bytes`), and
the plan for the same setup comes from the model's saved config, traced on fake tensors.
"""
import json

import pytest

from shardscope.mesh import Setup
from shardscope.model_spec import load_model_config, spec_from_config
from shardscope.planner import estimate
from shardscope.step_trace import traces_for

pytestmark = pytest.mark.launch

TOLERANCE = 0.05  # the bound: planned peak_bytes within 5% of the measured peak, per rank
BATCH, SEQ = 2, 256
RUNS = [  # (config, checkpointing, precision): each strategy with checkpointing on and off, fp32 and bf16
    ("ddp", False, "fp32"), ("ddp", True, "bf16-mixed"),
    ("fsdp_full_shard", True, "fp32"), ("fsdp_full_shard", False, "bf16-mixed"),
    ("zero2", False, "fp32"), ("zero3", True, "fp32"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from shardscope.tiny import make_causal_lm

    path = tmp_path_factory.mktemp("peak_llama")
    make_causal_lm(path, vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4)
    return path


@pytest.mark.parametrize("config,checkpointing,precision", RUNS)
def test_planned_peak_within_5_percent_of_each_rank(config, checkpointing, precision, model_dir, tmp_path):
    from launch import ROOT, accelerate_launch

    args = ["--model", str(model_dir), "--seq_len", SEQ, "--samples", 12, "--per_device_train_batch_size", BATCH,
            "--max_steps", 3, "--use_cpu", "--report_to", "none", "--save_strategy", "no",
            *(["--gradient_checkpointing"] if checkpointing else []), *(["--bf16"] if precision != "fp32" else [])]
    accelerate_launch(ROOT / "accelerate_configs" / f"{config}.yaml", ROOT / "tests" / "workers" / "train_tiny.py",
                      args, tmp_path).check()
    summary = json.loads((tmp_path / "shardscope_summary.json").read_text())

    model = load_model_config(str(model_dir))
    # the shipped ZeRO yamls set no reduce_bucket_size: DeepSpeed's default of 5e8 elements applies
    setup = Setup(gpus_per_node=2, precision=precision, micro_batch=BATCH, seq_len=SEQ,
                  activation_checkpointing=checkpointing, bucket_elements=int(5e8) if "zero" in config else None)
    traces, note = traces_for(model, setup)
    assert note is None, note
    row = next(r for r in estimate(spec_from_config(model, "tiny"), setup, traces)["rows"] if r["strategy"] == config)
    for rank in summary["ranks"]:
        measured = rank["peak_tensor_bytes"]
        assert abs(row["peak_bytes"] - measured) / measured <= TOLERANCE, (rank["rank"], row["peak_breakdown"],
                                                                         rank["peak_breakdown"])
        assert row["peak_phase"] == rank["peak_phase"]
