"""Fine-tune DINOv2 (`Dinov2ForImageClassification`) on Food-101-format image classification data.

The same command runs under every strategy; only the launcher's config changes:

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/image_classification.py \\
        --config recipes/dinov2/dinov2_base_food101.yaml
    deepspeed --num_gpus 8 recipes/image_classification.py --config recipes/dinov2/dinov2_large_food101.yaml \\
        --deepspeed ds_configs/zero3.json

Data: a hub dataset with `image` and `label` (ClassLabel) columns (default `ethz/food101`) or a local
imagefolder (`<dir>/[train|validation]/<class>/<image>`). Images go through the model's image processor
(resize, centre crop, normalise) plus a random horizontal flip when training. The classification head
is sized from the dataset's classes; `--freeze_backbone` trains only the head (linear probing).
"""
import importlib.util
from dataclasses import dataclass, field

import shardscope  # noqa: F401  first: its library-notice filter is in place before transformers imports bitsandbytes

import torch
from transformers import AutoImageProcessor, Dinov2ForImageClassification, set_seed

from shardscope.checkpoint.resume import prepare_resume
from shardscope.doctor.diagnose import startup_checks
from shardscope.recipes.args import FitArguments, RecipeParser, RecipeTrainingArguments, check_dinov2, run
from shardscope.model.spec import load_model_config
from shardscope.recipes.data import accuracy, collate_images, image_transform, load_image_dataset
from shardscope.recipes.training import RecipeTrainer, auto_fit, describe_run, save_outputs


@dataclass
class ScriptArguments:
    dataset: str = field(default="ethz/food101", metadata={"help": "Hub dataset name or a local imagefolder"})
    train_split: str = field(default="train")
    eval_split: str | None = field(default="validation", metadata={"help": "Held out from train when absent"})
    eval_fraction: float = field(default=0.1, metadata={"help": "Share of train held out without an eval split"})
    max_train_samples: int | None = field(default=None)
    max_eval_samples: int | None = field(default=None)
    profile: bool = field(default=True, metadata={"help": "Attach shardscope.ShardingProfilerCallback"})
    save_final_logits: bool = field(default=False, metadata={
        "help": "Write the trained model's logits on the first eval images to output_dir/final_logits.pt"})


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="facebook/dinov2-base", metadata={"help": "Hub id or local folder"})
    freeze_backbone: bool = field(default=False, metadata={"help": "Train only the classification head"})
    dtype: str = field(default="float32", metadata={
        "help": "Dtype to load weights in (float32 with --bf16 is mixed precision)",
        "choices": ["float32", "bfloat16", "float16", "auto"]})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "Run the model repository's own Python code (auto_map); only for code you trust"})


def main():
    # --- Arguments (YAML via --config, command-line flags override it) ---
    parser = RecipeParser(ScriptArguments, ModelArguments, FitArguments, training_type=RecipeTrainingArguments)
    script_args, model_args, fit_args = parser.parse()

    # --- Check inputs before any process group starts ---
    config = load_model_config(model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code)
    check_dinov2(config, model_args.model_name_or_path)
    train_data, eval_data, class_names = load_image_dataset(
        script_args.dataset, script_args.train_split, script_args.eval_split, script_args.eval_fraction, seed=0)
    if script_args.max_train_samples:
        train_data = train_data.shuffle(seed=0).select(range(min(script_args.max_train_samples, len(train_data))))
    if script_args.max_eval_samples:
        eval_data = eval_data.shuffle(seed=0).select(range(min(script_args.max_eval_samples, len(eval_data))))

    # --- shardscope doctor's checks (DeepSpeed/FSDP files, layer classes, precision): refuse to start on a finding ---
    startup_checks(parser.namespace, model_args.model_name_or_path)

    # --- Training arguments (this initialises the process group) ---
    training_args = parser.training_args()
    training_args.remove_unused_columns = False  # the transform needs the `image` column the model never sees
    set_seed(training_args.seed)

    # --- Image processor and transforms ---
    backend = None if importlib.util.find_spec("torchvision") else "pil"  # PIL when torchvision is absent
    processor = AutoImageProcessor.from_pretrained(model_args.model_name_or_path, backend=backend,
                                                   trust_remote_code=model_args.trust_remote_code)
    train_data.set_transform(image_transform(processor, train=True))
    eval_data.set_transform(image_transform(processor, train=False))

    # --- Model (after TrainingArguments, so ZeRO-3 partitions it while loading) ---
    dtype = model_args.dtype if model_args.dtype == "auto" else getattr(torch, model_args.dtype)
    model = Dinov2ForImageClassification.from_pretrained(
        model_args.model_name_or_path, dtype=dtype, num_labels=len(class_names),
        id2label=dict(enumerate(class_names)), label2id={n: i for i, n in enumerate(class_names)},
        ignore_mismatched_sizes=True,  # a new head when the checkpoint's classes differ
        trust_remote_code=model_args.trust_remote_code)
    if model_args.freeze_backbone:
        model.dinov2.requires_grad_(False)
    if training_args.process_index == 0:
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
        print(f"classes: {len(class_names)}, train {len(train_data)}, eval {len(eval_data)}, "
              f"trainable params: {trainable:,}", flush=True)
    # --auto_fit: micro-batch, accumulation and checkpointing chosen by the planner, the global batch kept
    training_args = auto_fit(fit_args, training_args, model,
                             image_size=(getattr(processor, "crop_size", None) or {}).get("height"))

    # --- Trainer ---
    callbacks = []
    if script_args.profile:
        from shardscope import ShardingProfilerCallback

        callbacks.append(ShardingProfilerCallback())
    trainer = RecipeTrainer(model=model, args=training_args, train_dataset=train_data, eval_dataset=eval_data,
                      data_collator=collate_images, compute_metrics=accuracy, processing_class=processor,
                      callbacks=callbacks)

    # --- Train and evaluate (resuming at another world size: `shardscope reshard` first, docs/checkpoints.md) ---
    prepare_resume(trainer, training_args.resume_from_checkpoint)
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    print(describe_run(trainer), flush=True)
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    trainer.save_state()

    # --- Save (ZeRO-3 gathers 16-bit weights, FSDP a full state dict) ---
    batch = collate_images([eval_data[i] for i in range(min(4, len(eval_data)))])
    save_outputs(trainer, processor, batch if script_args.save_final_logits else None)


if __name__ == "__main__":
    run(main)
