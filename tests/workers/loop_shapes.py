"""Loop shapes people run, each trained twice in one launched process: without the profiler, then with every instrument
on at an early step (`PROFILED`). Each rank writes `<shape>/<plain|profiled>/result_rank{R}.json` (the loss per
optimizer step, a checksum of the trained weights); rank 0's profiled run also writes its summary there. tests/test_loop_shapes.py holds them.

Shapes: TRL SFT (packing, gradient checkpointing), DPO full and LoRA (the reference is the same model with its adapter
disabled), GRPO (generates during training, a tiny reward function), a reward model (`RewardTrainer`), a Trainer whose
`compute_loss` runs the model twice, gradient checkpointing with `use_reentrant` True and False, a `torch.compile`d
model, DINOv2 classification, and the Accelerate and raw FSDP2 (`fully_shard`) loops under `ShardingProfiler`.
"""
import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from trl_dpo import WORDS, preference_pairs  # noqa: E402

from shardscope import ShardingProfiler, ShardingProfilerCallback  # noqa: E402
from shardscope.recipes.training import end_of_run  # noqa: E402

STEPS = 4
# The timer first: a compiled model whose first forward runs under a dispatch mode (the memory tracker, the
# collective counter) is never compiled by dynamo (README, "Never breaks training").
PROFILED = dict(time_step=1, memory_step=2, comm_step=3, every_n_steps=2)
COMMON = dict(max_steps=STEPS, per_device_train_batch_size=2, logging_steps=1, learning_rate=1e-3, use_cpu=True,
              report_to="none", save_strategy="no", seed=0, disable_tqdm=True, bf16=False)


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def token_rows(vocab: int, n=32, seed=0, length=None):
    """Token rows of varied lengths (the collator pads them), or all of `length` tokens."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": (ids := torch.randint(3, vocab, (length or int(torch.randint(8, 24, (1,), generator=g)),),
                                                generator=g).tolist()), "labels": ids} for _ in range(n)]


def texts(n=32, seed=0):
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_list([{"text": " ".join(rng.choices(WORDS, k=rng.randint(10, 30)))} for _ in range(n)])


def trainer_losses(trainer) -> dict:
    trainer.train()
    return result([log["loss"] for log in trainer.state.log_history if "loss" in log], trainer.model)


def result(losses: list[float], model) -> dict:
    """The loss per step and a checksum of the trained weights (this rank's shards): equal with and without the
    profiler when it changes no numerics."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return {"losses": losses, "weights": sum(float(local(p).double().square().sum()) for p in trained)}


def local(p):
    return p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p)


def callbacks(profiled: bool) -> list:
    return [ShardingProfilerCallback(**PROFILED)] if profiled else []


def causal_lm(ctx):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ctx.model)


def tokenizer(ctx):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ctx.model)


def sft(ctx, out, profiled):
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(output_dir=str(out), packing=True, gradient_checkpointing=True, max_length=64, **COMMON)
    return trainer_losses(SFTTrainer(model=causal_lm(ctx), args=config, train_dataset=texts(),
                                     processing_class=tokenizer(ctx), callbacks=callbacks(profiled)))


def dpo(ctx, out, profiled, lora=False):
    from trl import DPOConfig, DPOTrainer

    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    config = DPOConfig(output_dir=str(out), max_length=64, gradient_checkpointing=False, **COMMON)
    return trainer_losses(DPOTrainer(model=causal_lm(ctx), args=config, train_dataset=preference_pairs(32),
                                     processing_class=tokenizer(ctx), peft_config=peft_config,
                                     callbacks=callbacks(profiled)))


def grpo(ctx, out, profiled):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def shorter_is_better(completions, **_):
        return [-float(len(c)) for c in completions]

    prompts = Dataset.from_list([{"prompt": f"Repeat: {' '.join(random.Random(i).sample(WORDS, 3))}\n"}
                                 for i in range(32)])
    config = GRPOConfig(output_dir=str(out), num_generations=2, max_completion_length=8,
                        gradient_checkpointing=False, **COMMON)
    return trainer_losses(GRPOTrainer(model=causal_lm(ctx), reward_funcs=[shorter_is_better], args=config,
                                      train_dataset=prompts, processing_class=tokenizer(ctx),
                                      callbacks=callbacks(profiled)))


def reward(ctx, out, profiled):
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    tok = tokenizer(ctx)
    model = AutoModelForSequenceClassification.from_pretrained(ctx.model, num_labels=1)
    model.config.pad_token_id = tok.pad_token_id
    config = RewardConfig(output_dir=str(out), max_length=64, gradient_checkpointing=False, **COMMON)
    return trainer_losses(RewardTrainer(model=model, args=config, train_dataset=preference_pairs(32),
                                        processing_class=tok, callbacks=callbacks(profiled)))


def plain_trainer(ctx, out, profiled, trainer_class=None, model=None, data=None, collator=None, **args):
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    model = model or causal_lm(ctx)
    collator = collator or DataCollatorForSeq2Seq(tokenizer(ctx), label_pad_token_id=-100)
    trainer = (trainer_class or Trainer)(model=model, args=TrainingArguments(output_dir=str(out), **COMMON, **args),
                                         train_dataset=data or token_rows(model.config.vocab_size), data_collator=collator,
                                         callbacks=callbacks(profiled))
    return trainer_losses(trainer)


def twice(ctx, out, profiled):
    """A consistency loss: the model runs forward twice per micro-batch, both passes training."""
    from transformers import Trainer

    class TwoPasses(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            first, second = model(**inputs), model(**inputs)
            return first.loss + 0.1 * torch.nn.functional.mse_loss(first.logits, second.logits)

    return plain_trainer(ctx, out, profiled, trainer_class=TwoPasses)


def checkpointing(ctx, out, profiled, reentrant):
    return plain_trainer(ctx, out, profiled, gradient_checkpointing=True,
                         gradient_checkpointing_kwargs={"use_reentrant": reentrant})


def compiled(ctx, out, profiled):
    """Rows of one length: each new length recompiles every graph once more (dynamo's automatic dynamic shapes,
    half this shape's time under ZeRO-3) in the plain run, whose graphs the profiled run reuses either way."""
    model = causal_lm(ctx)
    return plain_trainer(ctx, out, profiled, model=model, data=token_rows(model.config.vocab_size, length=16),
                         torch_compile=True, torch_compile_backend=ctx.compile_backend)


def dinov2(ctx, out, profiled):
    from transformers import AutoModelForImageClassification

    g = torch.Generator().manual_seed(0)
    rows = [{"pixel_values": torch.randn(3, 28, 28, generator=g), "labels": i % 4} for i in range(32)]
    return plain_trainer(ctx, out, profiled, model=AutoModelForImageClassification.from_pretrained(ctx.dinov2),
                         data=rows, collator=lambda batch: {k: torch.stack([torch.as_tensor(r[k]) for r in batch])
                                                            for k in batch[0]})


def loop_batches(vocab: int):
    """2 rows per rank and step, each rank's own (a DataLoader the Accelerator shards, or this rank's share)."""
    from accelerate_loop import padded_batches

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return padded_batches(vocab, batch_size=2, n=2 * STEPS * world)


def accelerate_loop(ctx, out, profiled):
    from accelerate import Accelerator

    accelerator = Accelerator()  # the launched config's strategy (DDP, DeepSpeed), as examples/accelerate_loop.py
    model = causal_lm(ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loop_batches(model.config.vocab_size))

    def step(batch):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return run_loop(step, loader, profiled and (
        lambda: ShardingProfiler(model, optimizer, accelerator, output_dir=out, **PROFILED)), model)


def fsdp2_loop(ctx, out, profiled):
    from torch.distributed.fsdp import fully_shard

    model = causal_lm(ctx)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DTensor norms: sharding propagation on FakeTensors
        optimizer.step()
        optimizer.zero_grad()
        return loss

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    mine = list(loop_batches(model.config.vocab_size))[rank()::world]
    return run_loop(step, mine, profiled and (lambda: ShardingProfiler(model, optimizer, output_dir=out, **PROFILED)),
                    model)


def run_loop(step, batches, make_profiler, model) -> dict:
    """`step(batch)` over this rank's `batches`, STEPS of them (the loss, averaged over ranks, per step)."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    profiler, losses = make_profiler() if make_profiler else None, []
    for batch, _ in zip(batches, range(STEPS)):
        loss = step(batch).detach()
        if profiler is not None:
            profiler.step(batch)
        if world > 1:
            torch.distributed.all_reduce(loss)
        losses.append(loss.item() / world)
    if profiler is not None:
        profiler.close()
    return result(losses, model)


SHAPES = {
    "sft": sft, "dpo": dpo, "dpo_lora": lambda c, o, p: dpo(c, o, p, lora=True), "grpo": grpo, "reward": reward,
    "twice": twice, "checkpointing_reentrant": lambda c, o, p: checkpointing(c, o, p, True),
    "checkpointing": lambda c, o, p: checkpointing(c, o, p, False), "compiled": compiled, "dinov2": dinov2,
    "accelerate_loop": accelerate_loop, "fsdp2_loop": fsdp2_loop,
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    # aot_eager: dynamo's tracing and AOTAutograd's graphs, where hooks and dispatch modes meet compilation, without
    # inductor's C++ code generation (minutes on 2 loaded cores)
    parser.add_argument("--compile_backend", default="aot_eager")
    # Built by the test (tests/loop_runs.py), read by every rank: once a process group is up (an earlier run in
    # the same launch), transformers' save_pretrained writes on rank 0 only, so ranks could not build their own.
    parser.add_argument("--model", type=Path, required=True, help="a tiny causal LM folder, with its tokenizer")
    parser.add_argument("--dinov2", type=Path, required=True, help="a tiny DINOv2 classifier (4 labels) folder")
    args = parser.parse_args()
    for name in args.shapes:
        for profiled in (False, True):
            out = args.output_dir / name / ("profiled" if profiled else "plain")
            # The last run's garbage collected, what is left is frozen (never scanned again): the full collections
            # each Trainer starts (accelerate's free_memory, DeepSpeed's) then scan this run's objects only.
            gc.collect()
            gc.freeze()
            torch.manual_seed(0)  # heads a checkpoint does not hold (the reward model's score) start alike
            started = time.perf_counter()
            trained = SHAPES[name](args, out, profiled)
            print(f"loop_shapes: {name} {'profiled' if profiled else 'plain'} {time.perf_counter() - started:.1f} s")
            out.mkdir(parents=True, exist_ok=True)
            (out / f"result_rank{rank()}.json").write_text(json.dumps(trained))
    end_of_run()


if __name__ == "__main__":
    main()
