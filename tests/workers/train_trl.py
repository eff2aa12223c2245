"""Train TRL's SFTTrainer, then DPOTrainer (examples/trl_dpo.py), then optionally LoRA-DPO, one after the other in
one launched process (one start-up for all runs), each with the shardscope callback in its own output folder;
optionally first the custom loop of examples/accelerate_loop.py (ShardingProfiler) under the same config.

Besides each run's summary, every rank writes `facts_rank{R}.json` there: the bytes it holds counted through each
library's own accessors (train_tiny's independent count, the reference model's included) and what the Trainer
itself reports (train_samples_per_second, num_input_tokens_seen: the non-padding tokens it was fed), beside a
`training_step` wrapper's own count of the tokens fed (`tokens_fed`, as a user counts them).
"""
import argparse
import json
import random
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import accelerate_loop  # noqa: E402
from run_example import write_facts  # noqa: E402  (same folder)
from shardscope.recipes.training import end_of_run  # noqa: E402
from train_tiny import local_param_bytes, optimizer_state_bytes  # noqa: E402
from trl_dpo import WORDS, build_trainer, tiny_model  # noqa: E402


def uninstrumented():
    """The callback with no instrumented step: every step counts towards throughput, as every step counts towards
    the Trainer's train_samples_per_second, which these runs are held against."""
    from shardscope import ShardingProfilerCallback

    return ShardingProfilerCallback(memory_step=None, comm_step=None, time_step=None)


class Facts(TrainerCallback):
    def __init__(self):
        self.trainer = None

    def on_train_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        ref = getattr(self.trainer, "ref_model", None)
        self.counts = {"params_bytes": local_param_bytes(model), "optimizer_bytes": optimizer_state_bytes(optimizer, model),
                       "reference_bytes": None if ref is None else local_param_bytes(getattr(ref, "module", ref)),
                       "num_input_tokens_seen": state.num_input_tokens_seen, "global_step": state.global_step}


def sft_trainer(model_path, output_dir, steps, use_cpu, callbacks):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    rng = random.Random(0)
    rows = [{"text": " ".join(rng.choices(WORDS, k=rng.randint(20, 60)))} for _ in range(64)]
    config = SFTConfig(output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=2, logging_steps=4,
                       max_length=128, bf16=False, use_cpu=use_cpu, gradient_checkpointing=False, report_to="none",
                       save_strategy="no", include_num_input_tokens_seen="non_padding")
    return SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model_path), args=config,
                      train_dataset=Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(model_path),
                      callbacks=[uninstrumented(), *callbacks])


def count_fed(trainer) -> dict:
    """The user's own count of what is fed: each `training_step`'s non-padding tokens (its attention mask)."""
    fed, step = {"tokens_fed": 0}, trainer.training_step

    def counting(model, inputs, *args, **kwargs):
        mask = inputs.get("attention_mask")
        fed["tokens_fed"] += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
        return step(model, inputs, *args, **kwargs)

    trainer.training_step = counting
    return fed


def run(name, make, output_dir):
    facts = Facts()
    trainer = make(output_dir / name, [facts])
    facts.trainer = trainer
    fed = count_fed(trainer)
    output = trainer.train()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    record = {**facts.counts, **fed, "train_samples_per_second": output.metrics["train_samples_per_second"]}
    (output_dir / name / f"facts_rank{rank}.json").write_text(json.dumps(record))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lora", action="store_true", help="also run LoRA-DPO")
    parser.add_argument("--loop", action="store_true", help="first run examples/accelerate_loop.py (ShardingProfiler)")
    args = parser.parse_args()
    model = tiny_model(args.output_dir / "assets")
    if args.loop:  # the same launch, config and model: one start-up for the custom loop and the trainers
        loop_dir = args.output_dir / "loop"
        write_facts(accelerate_loop.main(["--use_cpu", "--model", str(model), "--output_dir", str(loop_dir)]), loop_dir)
    run("sft", lambda out, cbs: sft_trainer(model, out, args.steps, True, cbs), args.output_dir)
    run("dpo", lambda out, cbs: build_trainer(model, out, args.steps, use_cpu=True, callbacks=cbs,
                                              profiler=uninstrumented()), args.output_dir)
    if args.lora:
        run("dpo_lora", lambda out, cbs: build_trainer(model, out, args.steps, lora=True, use_cpu=True, callbacks=cbs,
                                                       profiler=uninstrumented()), args.output_dir)
    end_of_run()


if __name__ == "__main__":
    main()
