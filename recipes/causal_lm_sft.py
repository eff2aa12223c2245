"""Supervised fine-tuning of a causal LM (Llama, Mistral, ...) on Alpaca-format instruction data.

The same command runs under every strategy; only the launcher's config changes:

    accelerate launch --config_file accelerate_configs/fsdp_full_shard.yaml recipes/causal_lm_sft.py \\
        --config recipes/mistral/mistral_7b_full.yaml
    deepspeed --num_gpus 8 recipes/causal_lm_sft.py --config recipes/llama/llama2_7b_full.yaml \\
        --deepspeed ds_configs/zero3.json

Data: a hub dataset (default `yahma/alpaca-cleaned`) or a local .json/.jsonl file with `instruction`,
`output` and optionally `input` columns. The prompt (Alpaca template) is masked out of the loss (-100);
only the response and EOS train (`--text_field NAME`: one text column, all of it trained). Batching: each
micro-batch padded to its longest row (the default); `--packing` concatenates examples into `max_seq_length` blocks,
so examples attend across their boundaries inside a block; `--padding_free` puts a micro-batch's examples in one row
kept apart by position ids (`DataCollatorWithFlattening`: no padding and no attention across examples, the tokens per
micro-batch vary). `shardscope plan --dataset FILE` plans each of them at the data's worst micro-batch.
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

import shardscope  # noqa: F401  first: its library-notice filter is in place before transformers imports bitsandbytes

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

from shardscope.checkpoint.resume import prepare_resume
from shardscope.doctor.diagnose import startup_checks
from shardscope.errors import UsageError
from shardscope.recipes.args import FitArguments, RecipeParser, RecipeTrainingArguments, check_causal_lm, run
from shardscope.model.spec import load_model_config
from shardscope.plan.dataset import ALPACA_REQUIRED
from shardscope.recipes.data import load_dataset_checked, prepare_sft_dataset
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
    packing: bool = field(default=False, metadata={
        "help": "Concatenate examples into max_seq_length blocks (attention crosses example boundaries in a block)"})
    padding_free: bool = field(default=False, metadata={
        "help": "Each micro-batch's examples in one row, kept apart by position ids (DataCollatorWithFlattening): "
                "no padding, no attention across examples; the tokens per micro-batch vary"})
    text_field: str | None = field(default=None, metadata={
        "help": "Train on this text column whole (with EOS) instead of the Alpaca columns"})
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
    load_in_4bit: bool = field(default=False, metadata={
        "help": "QLoRA: load the base quantised to 4 bits by bitsandbytes (with --use_lora; FSDP/ZeRO-3 shard it when "
                "--bnb_4bit_quant_storage is the dtype the other parameters load in)"})
    load_in_8bit: bool = field(default=False, metadata={"help": "LoRA on an LLM.int8 base (bitsandbytes; DDP only)"})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"choices": ["nf4", "fp4"]})
    bnb_4bit_use_double_quant: bool = field(default=True, metadata={"help": "quantise the absmax too (QLoRA)"})
    bnb_4bit_quant_storage: str = field(default="uint8", metadata={
        "help": "dtype the packed 4-bit weights are stored in; FSDP and ZeRO-3 need the other parameters' dtype",
        "choices": ["uint8", "bfloat16", "float16", "float32"]})
    tp_size: int | None = field(default=None, metadata={
        "help": "Tensor-parallel degree; default: the launcher config's parallelism_config_tp_size, else 1. "
                "The other ranks shard the TP pieces with FSDP2 (world = dp_replicate x dp_shard x tp)"})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "Run the model repository's own Python code (auto_map); only for code you trust"})


def quantization_arguments(model_args: ModelArguments, training_args) -> dict:
    """`from_pretrained`'s bitsandbytes arguments: the quantisation config, and each DDP rank's device (FSDP and
    ZeRO-3 place the weights themselves)."""
    if not (model_args.load_in_4bit or model_args.load_in_8bit):
        return {}
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=model_args.load_in_4bit, load_in_8bit=model_args.load_in_8bit,
        bnb_4bit_quant_type=model_args.bnb_4bit_quant_type, bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=model_args.bnb_4bit_use_double_quant,
        bnb_4bit_quant_storage=getattr(torch, model_args.bnb_4bit_quant_storage))
    from transformers.integrations import is_deepspeed_zero3_enabled

    # ZeRO-3 refuses a device_map ("DeepSpeed Zero-3 is not compatible with passing a `device_map`"); FSDP places the
    # shards itself
    sharded = is_deepspeed_zero3_enabled() or training_args.distributed_state.distributed_type == "FSDP"
    return {"quantization_config": config, **({} if sharded else {"device_map": {"": str(training_args.device)}})}


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
    if (model_args.load_in_4bit or model_args.load_in_8bit) and not model_args.use_lora:
        raise UsageError("--load_in_4bit/--load_in_8bit need --use_lora: a quantised base is frozen, only LoRA "
                         "adapters train (QLoRA)")
    if mesh and model_args.use_lora:
        raise UsageError("--use_lora with tensor parallelism is not supported by this recipe (PEFT adapters on "
                         "DTensor-sharded layers); use FSDP or DeepSpeed for LoRA")
    # context (cp_size) or sequence (sp_size) parallelism from the launcher config: each rank holds 1/degree of
    # every sequence; checked against the model, strategy and world here, before any process group exists
    split = sequence_split(config, model_args.model_name_or_path, script_args.max_seq_length,
                           model_args.attn_implementation)
    if script_args.padding_free and (script_args.packing or split):
        raise UsageError("--padding_free goes with neither --packing (blocks already hold no padding) nor a cp/sp "
                         "split (its collator pads to the split's unit)")
    raw = load_dataset_checked(script_args.dataset, script_args.dataset_split,
                               (script_args.text_field,) if script_args.text_field else ALPACA_REQUIRED,
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
        train_dataset = prepare_sft_dataset(raw, tokenizer, script_args.max_seq_length, script_args.packing,
                                            script_args.text_field)
    # padded to the longest row (with a split: to its unit, position_ids added), or flattened (--padding_free)
    collator = sft_collator(tokenizer, split, padding_free=script_args.padding_free)

    # --- Model (after TrainingArguments, so ZeRO-3 partitions it while loading) ---
    dtype = model_args.dtype if model_args.dtype == "auto" else getattr(torch, model_args.dtype)
    attention = split["attention"] if split else model_args.attn_implementation  # the kernel the split can cut
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=dtype,
                                                 attn_implementation=attention,
                                                 trust_remote_code=model_args.trust_remote_code,
                                                 distributed_config=distributed_config(mesh) if mesh else None,
                                                 **quantization_arguments(model_args, training_args))
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
