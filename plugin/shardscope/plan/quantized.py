"""A base model quantised by bitsandbytes for QLoRA (`plan --quantize 4bit|8bit`): which modules transformers
quantises, the bytes of each quantised weight with its quantisation state, and what stays in the compute dtype.

Which modules: what transformers' bitsandbytes integration replaces (`replace_with_bnb_linear`): every
`nn.Linear` (and GPT-2's Conv1D) except `get_keys_to_not_convert`'s (the output head, tied weights, the last
parameter's module). Everything else keeps the load dtype (`dtype=`, 16-bit here): embeddings, norms, biases,
and the fused experts of transformers 5's MoE models (3-D parameters, not Linear layers).

Bytes of one quantised weight of n = in x out elements (bitsandbytes 0.50 `quantize_4bit`, `Int8Params`):
- 4-bit (NF4 and FP4 alike): the packed data ceil(n/2) B, stored as `bnb_4bit_quant_storage` (uint8, or bf16
  for FSDP: the same bytes in ceil(n/4) elements); one absmax per block of 64: fp32 (4 B), or with double
  quantisation uint8 (1 B) plus an fp32 absmax per 256 of those, an fp32 offset and the 256-entry fp32 code of
  that second quantisation (1 KiB); the 16-entry fp32 code (64 B). Each weight holds its own copy of both codes
  (counted on a model bitsandbytes quantised on CPU: distinct storages).
- 8-bit (LLM.int8): the int8 data n B and one fp32 scale per output row (`SCB`, 4 x out B).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..units import ceil_div

BLOCK_4BIT = 64              # quantize_4bit's default blocksize (BitsAndBytesConfig does not set one)
BLOCK_NESTED = 256           # the blocksize double quantisation quantises the absmax with
CODE_4BIT_BYTES = 16 * 4     # get_4bit_type: 16 fp32 values, one tensor per quantised weight
NESTED_CODE_BYTES = 256 * 4  # create_dynamic_map's fp32 table, in each double-quantised weight's state2
QUANTIZE = ("4bit", "8bit")


@dataclass(frozen=True)
class QuantizedBase:
    """A model's base as bitsandbytes holds it: quantised weights and what stays in `dtype_bytes`."""

    bits: int
    double_quant: bool
    quantized_params: int          # elements of the quantised weights
    quantized_bytes: int           # their data and quantisation state
    state_bytes: int               # of which quantisation state (absmax, codes, offsets, scales)
    kept_params: int               # parameters left in the load dtype
    kept_bytes: int
    kept_modules: tuple[str, ...] = field(default=())  # kinds of modules left unquantised, by leaf name

    @property
    def total_bytes(self) -> int:
        return self.quantized_bytes + self.kept_bytes

    def as_dict(self) -> dict:
        return {"bits": self.bits, "double_quant": self.double_quant, "quantized_params": self.quantized_params,
                "quantized_bytes": self.quantized_bytes, "state_bytes": self.state_bytes,
                "kept_params": self.kept_params, "kept_bytes": self.kept_bytes,
                "kept_modules": list(self.kept_modules), "total_bytes": self.total_bytes}


def weight_bytes(n: int, out_features: int, bits: int, double_quant: bool = True,
                 storage_bytes: int = 1) -> tuple[int, int]:
    """(data bytes, quantisation-state bytes) of one quantised weight of n elements (module docstring)."""
    if bits == 8:
        return n, 4 * out_features
    data = ceil_div(ceil_div(n, 2), storage_bytes) * storage_bytes
    blocks = ceil_div(n, BLOCK_4BIT)
    absmax = blocks + 4 * ceil_div(blocks, BLOCK_NESTED) + 4 + NESTED_CODE_BYTES if double_quant else 4 * blocks
    return data, absmax + CODE_4BIT_BYTES


def quantized_base(config, bits: int, double_quant: bool = True, dtype_bytes: int = 2,
                   storage_bytes: int = 1) -> QuantizedBase:
    """Count `config`'s model as transformers quantises it with bitsandbytes (built on the meta device)."""
    import torch
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    from ..model.spec import meta_model

    model = meta_model(config)
    skip = get_keys_to_not_convert(model)
    quantized, data, state, weights = 0, 0, 0, set()
    for name, module in model.named_modules():
        if not (type(module) is torch.nn.Linear or isinstance(module, Conv1D)) or not should_convert_module(name, skip):
            continue
        n, out = module.weight.numel(), module.weight.shape[0 if type(module) is torch.nn.Linear else 1]
        d, s = weight_bytes(n, out, bits, double_quant, storage_bytes)
        quantized, data, state = quantized + n, data + d, state + s
        weights.add(id(module.weight))
    kept, kinds = 0, set()
    for name, param in model.named_parameters():  # tied weights once
        if id(param) not in weights:
            kept += param.numel()
            kinds.add(name.rsplit(".", 2)[-2] if "." in name else name)
    return QuantizedBase(bits, double_quant, quantized, data + state, state, kept, kept * dtype_bytes,
                         tuple(sorted(kinds)))


def with_quantized_base(result: dict, spec, base: QuantizedBase) -> dict:
    """`estimate`'s result with each row's base weights at `base`'s bytes (`plan --quantize`), fits and the
    recommendation taken again. A row held its frozen base as ceil(P / n) x its family's parameter element bytes
    (n: the data-parallel shards where the strategy shards parameters, FSDP full/hybrid and ZeRO-3, else 1); it
    holds ceil((quantised bytes - quantisation state) / n) + the state instead: FSDP and ZeRO-3 shard 4-bit weights
    stored in the other parameters' dtype (`bnb_4bit_quant_storage`) and leave each layer's quantisation state whole
    on every rank (measured on 2 CPU ranks, tests/test_recipes.py). TP and offload rows are left out: transformers' TP plans split no
    bitsandbytes weight, and offloading a 4-bit base is not what QLoRA recipes do (not planned)."""
    from dataclasses import replace

    from .formulas import element_bytes
    from .planner import Note, fits, recommend
    from ..strategy import strategy_record

    setup = result["setup"]
    rows = []
    for row in result["rows"]:
        record = strategy_record(row.strategy)
        if record.family == "tp" or record.offload:
            continue
        n = row.mesh.dp_shard if record.gathers else 1
        eb = element_bytes(setup.precision, record.family, setup.optimizer, zero_stage=record.zero_stage)
        held = ceil_div(base.total_bytes - base.state_bytes, n) + base.state_bytes  # the state stays whole
        delta = held - ceil_div(spec.params_total, n) * eb.param
        new = replace(row, params_bytes=row.params_bytes + delta, peak_bytes=row.peak_bytes + delta,
                      peak_breakdown={**row.peak_breakdown,
                                      "parameters": row.peak_breakdown.get("parameters", 0) + delta})
        new.fits = fits(new, setup)
        rows.append(new)
    kept = ", ".join(base.kept_modules)
    note = (f"quantised base (bitsandbytes {base.bits}-bit{', double quantisation' if base.double_quant else ''}): "
            f"{base.quantized_params:,} params quantised in {base.quantized_bytes:,} B ({base.state_bytes:,} B of "
            f"quantisation state); {base.kept_params:,} params left in {'fp32' if setup.precision == 'fp32' else 'bf16'}: "
            f"{kept}; rows hold it whole, or / dp_shard where the strategy shards parameters (the state whole); tp "
            "and offload rows "
            "left out (not planned with a quantised base); the step's other terms are the unquantised model's "
            "(FSDP's gathered units, autocast's 16-bit weight copies under ddp): upper bounds")
    return {**result, "rows": rows, "recommendation": recommend(rows, setup), "tp": None,
            "quantized": base.as_dict(), "notes": [*result["notes"], Note(note)]}
