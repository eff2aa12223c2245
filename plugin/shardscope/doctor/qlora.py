"""doctor's QLoRA rules: a base quantised by bitsandbytes (the SFT recipe's --load_in_4bit / --load_in_8bit) with
what cannot train or shard it. Sources: transformers' bitsandbytes integration (`Trainer` refuses a purely quantised
model: "You cannot perform fine-tuning on purely quantized models"), PEFT's FSDP-QLoRA and DeepSpeed-QLoRA guides
(`bnb_4bit_quant_storage` set to the other parameters' dtype so FSDP can flatten them: torch's FlatParameter
"Must flatten tensors with uniform dtype"; accelerate 1.15's `fsdp2_prepare_model` excludes integer-stored
Params4bit from FSDP2 sharding; ZeRO-3 partitions every parameter of the one dtype it trains in),
transformers' tensor-parallel plans (they shard `nn.Linear` weights, not bitsandbytes' packed ones)."""
from __future__ import annotations

from .rules import Finding


def quantized_bits(trainer: dict | None) -> int:
    """4 or 8 when the recipe arguments load a bitsandbytes base, else 0."""
    trainer = trainer or {}
    return 4 if trainer.get("load_in_4bit") else 8 if trainer.get("load_in_8bit") else 0


def check_quantized(trainer: dict | None, source: str, sharding: str, tp: int) -> list[Finding]:
    """`sharding`: "fsdp", "zero3" or "" (the run keeps whole weights); `tp`: the tensor-parallel degree."""
    bits = quantized_bits(trainer)
    if not bits:
        return []
    key, found = f"load_in_{bits}bit", []
    if not trainer.get("use_lora"):
        found.append(Finding("qlora-frozen", source, key, "a quantised base is frozen and nothing else trains "
                             "(the Trainer refuses: 'You cannot perform fine-tuning on purely quantized models')",
                             "add --use_lora (QLoRA trains LoRA adapters on the quantised base)"))
    if tp > 1:
        found.append(Finding("qlora-strategy", source, key, f"tensor parallelism (degree {tp}) splits nn.Linear "
                             "weights by transformers' TP plan; bitsandbytes' packed weights are not in it",
                             "shard the quantised base with FSDP (accelerate_configs/fsdp_qlora.yaml) or ZeRO-3"))
    if sharding and bits == 8:
        found.append(Finding("qlora-strategy", source, key, f"{sharding} cannot shard LLM.int8 weights (Int8Params "
                             "keep their row scales beside the int8 data); only 4-bit weights with "
                             "bnb_4bit_quant_storage shard", "use --load_in_4bit with --bnb_4bit_quant_storage "
                             "bfloat16, or DDP for an 8-bit base"))
    storage, dtype = str(trainer.get("bnb_4bit_quant_storage") or "uint8"), str(trainer.get("dtype") or "float32")
    if sharding and bits == 4 and storage != dtype:
        why = ("FSDP1 flattens each unit's parameters into one tensor of one dtype ('Must flatten tensors with "
               "uniform dtype', 'Cannot flatten integer dtype tensors'); under FSDP2 accelerate leaves weights "
               "stored as uint8 out of sharding, whole on every GPU" if sharding == "fsdp" else
               "ZeRO-3 partitions the parameters in the one dtype it trains in")
        found.append(Finding("qlora-quant-storage", source, "bnb_4bit_quant_storage", f"{storage} beside the other "
                             f"parameters loaded in {dtype}: {why}",
                             "load in bfloat16 and store the 4-bit weights in it: --dtype bfloat16 "
                             "--bnb_4bit_quant_storage bfloat16"))
    return found
