"""Supervised fine-tuning of a causal LM (Llama, Mistral, ...) on Alpaca-format instruction data.

The same command runs under every strategy; only the launcher's config changes:

    accelerate launch --config_file accelerate_configs/fsdp_full_shard.yaml recipes/causal_lm_sft.py \\
        --config recipes/mistral/mistral_7b_full.yaml
    deepspeed --num_gpus 8 recipes/causal_lm_sft.py --config recipes/llama/llama2_7b_full.yaml \\
        --deepspeed ds_configs/zero3.json

Data: a hub dataset (default `yahma/alpaca-cleaned`) or a local .json/.jsonl file with `instruction`,
`output` and optionally `input` columns. The prompt (Alpaca template) is masked out of the loss (-100);
only the response and EOS train. `--packing` concatenates examples into `max_seq_length` blocks.
Full fine-tuning by default; `--use_lora` trains PEFT LoRA adapters and saves only those.
Tensor parallelism (TP) and 2D FSDP2 x TP: launch with accelerate_configs/tp.yaml, fsdp_tp.yaml or
hsdp_tp.yaml (or pass `--tp_size N` under torchrun); transformers shards the model while loading it.
Long sequences: launch with accelerate_configs/zero3_sp.yaml (DeepSpeed Ulysses, sp_size) or fsdp_cp.yaml (torch
context parallelism, cp_size, GPU only); each batch is padded to a multiple of the degree and carries position_ids,
and the split is checked against the model, strategy and world before any process group starts
(recipes/llama/llama31_8b_long.yaml).
Any `TrainingArguments` flag works (`--bf16`, `--gradient_checkpointing`, `--resume_from_checkpoint`...).
`--auto_fit true` lets shardscope choose the micro-batch, accumulation and checkpointing for the global batch
the arguments give (docs/fit.md; `--fit_memory_budget 2GB` on CPU).
"""
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

from shardscope.checkpoint.resume import prepare_resume
from shardscope.doctor.diagnose import startup_checks
from shardscope.errors import UsageError
from shardscope.recipes.args import FitArguments, RecipeParser, RecipeTrainingArguments, check_causal_lm, run
from shardscope.model.spec import load_model_config
from shardscope.recipes.data import ALPACA_REQUIRED, load_dataset_checked, prepare_sft_dataset
from shardscope.recipes.sequence import collator as sft_collator, sequence_split
from shardscope.recipes.tp import (
    compact_tp_shards, distributed_config, tensor_parallel_mesh, tensor_parallel_training_args,
)
from shardscope.recipes.training import RecipeTrainer, auto_fit, describe_run, save_outputs


@dataclass
class ScriptArguments:
    dataset: str = field(default="yahma/alpaca-cleaned",
                         metadata={"help": "Hub dataset name or a local .json/.jsonl file (Alpaca columns)"})
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration name"})
    dataset_split: str = field(default="train")
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N records"})
    max_seq_length: int = field(default=512, metadata={"help": "Truncate (or, with packing, block) length"})
    packing: bool = field(default=False, metadata={"help": "Concatenate examples into max_seq_length blocks"})
    profile: bool = field(default=True, metadata={"help": "Attach shardscope.ShardingProfilerCallback"})
    save_final_logits: bool = field(default=False, metadata={
        "help": "Write the trained model's logits on the first training examples to output_dir/final_logits.pt "
                "(check that the saved weights reproduce them)"})


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "Hub id or local folder of a causal LM"})
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "Defaults to the model's"})
    dtype: str = field(default="float32", metadata={
        "help": "Dtype to load weights in: float32 (recommended with --bf16/--fp16 mixed precision), "
                "bfloat16, float16 or auto", "choices": ["float32", "bfloat16", "float16", "auto"]})
    attn_implementation: str | None = field(default=None, metadata={"help": "e.g. sdpa, flash_attention_2"})
    use_lora: bool = field(default=False, metadata={"help": "Train LoRA adapters (PEFT) instead of all weights"})
    lora_r: int = field(default=16)
    lora_alpha: int = field(default=32)
    lora_dropout: float = field(default=0.05)
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"],
                                           metadata={"help": "Module names, or all-linear"})
    tp_size: int | None = field(default=None, metadata={
        "help": "Tensor-parallel degree; default: the launcher config's parallelism_config_tp_size, else 1. "
                "The other ranks shard the TP pieces with FSDP2 (world = dp_replicate x dp_shard x tp)"})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "Run the model repository's own Python code (auto_map); only for code you trust"})


def main():
    # --- Arguments (YAML via --config, command-line flags override it) ---
    parser = RecipeParser(ScriptArguments, ModelArguments, FitArguments, training_type=RecipeTrainingArguments)
    script_args, model_args, fit_args = parser.parse()

    # --- Check inputs before any process group starts ---
    if model_args.model_name_or_path is None:
        raise UsageError("model_name_or_path is required (YAML key or --model_name_or_path)")
    config = load_model_config(model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code)
    check_causal_lm(config, model_args.model_name_or_path)
    mesh = tensor_parallel_mesh(config, model_args.model_name_or_path, model_args.tp_size)
    if mesh and model_args.use_lora:
        raise UsageError("--use_lora with tensor parallelism is not supported by this recipe (PEFT adapters on "
                         "DTensor-sharded layers); use FSDP or DeepSpeed for LoRA")
    # context (cp_size) or sequence (sp_size) parallelism from the launcher config: each rank holds 1/degree of
    # every sequence; checked against the model, strategy and world here, before any process group exists
    split = sequence_split(config, model_args.model_name_or_path, script_args.max_seq_length,
                           model_args.attn_implementation)
    raw = load_dataset_checked(script_args.dataset, script_args.dataset_split, ALPACA_REQUIRED,
                               script_args.dataset_config)
    if script_args.max_train_samples:
        raw = raw.select(range(min(script_args.max_train_samples, len(raw))))

    # --- shardscope doctor's checks (DeepSpeed/FSDP files, layer classes, precision): refuse to start on a finding ---
    startup_checks(parser.namespace, model_args.model_name_or_path)

    # --- Training arguments (this initialises the process group) ---
    training_args = parser.training_args()
    set_seed(training_args.seed)
    if mesh:
        tensor_parallel_training_args(training_args, mesh)

    # --- Tokenizer and data ---
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name_or_path or model_args.model_name_or_path,
                                              trust_remote_code=model_args.trust_remote_code)
    if tokenizer.pad_token is None:  # Llama/Mistral ship none; padded positions are masked out anyway
        tokenizer.pad_token = tokenizer.eos_token
    with training_args.main_process_first(desc="tokenising"):
        train_dataset = prepare_sft_dataset(raw, tokenizer, script_args.max_seq_length, script_args.packing)
    collator = sft_collator(tokenizer, split)  # with a split: padded to its unit, position_ids added

    # --- Model (after TrainingArguments, so ZeRO-3 partitions it while loading) ---
    dtype = model_args.dtype if model_args.dtype == "auto" else getattr(torch, model_args.dtype)
    attention = split["attention"] if split else model_args.attn_implementation  # the kernel the split can cut
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=dtype,
                                                 attn_implementation=attention,
                                                 trust_remote_code=model_args.trust_remote_code,
                                                 distributed_config=distributed_config(mesh) if mesh else None)
    if mesh:
        compact_tp_shards(model)
    if model_args.use_lora:
        from peft import LoraConfig, get_peft_model

        target = model_args.lora_target_modules
        model = get_peft_model(model, LoraConfig(
            task_type="CAUSAL_LM", r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout, target_modules=target[0] if target == ["all-linear"] else target))
        if training_args.process_index == 0:
            model.print_trainable_parameters()
    # --auto_fit: micro-batch, accumulation and checkpointing chosen by the planner, the global batch kept
    training_args = auto_fit(fit_args, training_args, model, seq_len=script_args.max_seq_length)
    if training_args.gradient_checkpointing:
        model.config.use_cache = False

    # --- Trainer ---
    callbacks = []
    if script_args.profile:
        from shardscope import ShardingProfilerCallback

        callbacks.append(ShardingProfilerCallback())
    trainer = RecipeTrainer(model=model, args=training_args, train_dataset=train_dataset, data_collator=collator,
                      processing_class=tokenizer, callbacks=callbacks)

    # --- Train (resuming at another world size: `shardscope reshard` first, docs/checkpoints.md) ---
    prepare_resume(trainer, training_args.resume_from_checkpoint)
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    print(describe_run(trainer), flush=True)
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()

    # --- Save (ZeRO-3 gathers 16-bit weights, FSDP a full state dict; LoRA saves adapters only) ---
    batch = collator([train_dataset[i] for i in range(min(4, len(train_dataset)))])
    save_outputs(trainer, tokenizer, batch if script_args.save_final_logits else None)


if __name__ == "__main__":
    run(main)
