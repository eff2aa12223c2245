"""test_peak_runs' runs: tests/workers/train_tiny.py on the "peak_llama" model (tests/strategy_runs.py STRATEGY_MODELS),
each trained in the strategy_runs launch of its accelerate config (tests/strategy_runs.py, shared_launches), and the
small-bucket ZeRO runs in the launch of the shipped DeepSpeed JSONs (benchmarks/peak_agreement.py launches the same)."""
import json
from pathlib import Path

BATCH, SEQ = 2, 256  # tokens per rank: activations, gradients and optimizer state all weigh in
RUNS = [  # (config, checkpointing, precision): each strategy with checkpointing on and off, fp32 and bf16
    ("ddp", False, "fp32"), ("ddp", True, "bf16-mixed"),
    ("fsdp_full_shard", True, "fp32"), ("fsdp_full_shard", False, "bf16-mixed"),
    ("zero2", False, "fp32"), ("zero3", True, "fp32"),
]
# ZeRO under the shipped configs allocates DeepSpeed's default 5e8-element reduce bucket (2 GB in fp32), 95% of those
# rows' peak, so the 5% bound there cannot see activations. These runs set every bucket DeepSpeed sizes (elements) far
# below one layer of the model, at twice the micro-batch, so that activations are most of the peak.
SMALL_BUCKETS = {"reduce_bucket_size": 10 ** 5, "allgather_bucket_size": 10 ** 5,
                 "stage3_prefetch_bucket_size": 10 ** 5, "stage3_max_live_parameters": 10 ** 5,
                 "stage3_max_reuse_distance": 10 ** 5}
SMALL_BUCKET_RUNS = ["ds/zero2", "ds/zero3"]  # the shipped DeepSpeed JSONs they start from (fp32, no checkpointing)
SMALL_BUCKET_BATCH = 2 * BATCH


def peak_flags(checkpointing: bool, precision: str) -> tuple:
    """train_tiny.py's arguments for a RUNS entry, after strategy_runs' own (a repeated one overrides; its micro-batch
    is BATCH, its 3 steps these runs' too): SEQ-token samples, no log in those steps (the Trainer's default interval,
    500), and checkpointing and bf16 as the entry asks."""
    return ("--seq_len", SEQ, "--samples", 12, "--logging_steps", 500,
            *(["--gradient_checkpointing"] if checkpointing else []), *(["--bf16"] if precision != "fp32" else []))


def small_bucket_config(config: str) -> dict:
    """The shipped DeepSpeed JSON `config` (ds/zero2, ds/zero3) with SMALL_BUCKETS for its stage (the stage3_ keys
    for ZeRO-3, allgather_bucket_size for ZeRO-1/2)."""
    shipped = json.loads((Path(__file__).resolve().parents[1] / "ds_configs" / f"{config[3:]}.json").read_text())
    zero = shipped["zero_optimization"]
    keys = [k for k in SMALL_BUCKETS if k.startswith("stage3_") == (zero["stage"] == 3) or k == "reduce_bucket_size"]
    shipped.pop("_comment", None)
    return {**shipped, "zero_optimization": {**zero, **{k: SMALL_BUCKETS[k] for k in keys}}}


def small_bucket_flags(config: str) -> tuple:
    """train_tiny.py's arguments for a SMALL_BUCKET_RUNS entry under the `deepspeed` launcher (after its
    `--deepspeed CONFIG`): peak_flags' fp32 step at SMALL_BUCKET_BATCH and the config as inline JSON (the Trainer
    reads a JSON string as well as a path)."""
    return (*peak_flags(False, "fp32"), "--per_device_train_batch_size", SMALL_BUCKET_BATCH,
            "--samples", 3 * 2 * SMALL_BUCKET_BATCH, "--deepspeed", json.dumps(small_bucket_config(config),
                                                                                separators=(",", ":")))
