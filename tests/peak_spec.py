"""test_peak_runs' runs: tests/workers/train_tiny.py on the "peak_llama" model (tests/conftest.py STRATEGY_MODELS),
each trained in the strategy_runs launch of its accelerate config (tests/conftest.py, shared_launches)."""
BATCH, SEQ = 2, 256  # tokens per rank: activations, gradients and optimizer state all weigh in
RUNS = [  # (config, checkpointing, precision): each strategy with checkpointing on and off, fp32 and bf16
    ("ddp", False, "fp32"), ("ddp", True, "bf16-mixed"),
    ("fsdp_full_shard", True, "fp32"), ("fsdp_full_shard", False, "bf16-mixed"),
    ("zero2", False, "fp32"), ("zero3", True, "fp32"),
]


def peak_flags(checkpointing: bool, precision: str) -> tuple:
    """train_tiny.py's arguments for a RUNS entry, after strategy_runs' own (a repeated one overrides; its micro-batch
    is BATCH, its 3 steps these runs' too): SEQ-token samples, no log in those steps (the Trainer's default interval,
    500), and checkpointing and bf16 as the entry asks."""
    return ("--seq_len", SEQ, "--samples", 12, "--logging_steps", 500,
            *(["--gradient_checkpointing"] if checkpointing else []), *(["--bf16"] if precision != "fp32" else []))
