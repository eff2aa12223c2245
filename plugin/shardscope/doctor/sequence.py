"""doctor's long-sequence rules: an accelerate yaml's context (cp_size) or sequence (sp_size) split checked against
its strategy, the model, the sequence length, the attention kernel and the world (the one rule:
`plan.sequence.split_problems`), plus what the rule cannot see from the numbers alone (the backend left unset, a
fixed sp_seq_length the data does not have)."""
from __future__ import annotations

from dataclasses import replace

from .rules import Finding
from ..model.spec import attention_heads
from ..plan.sequence import split_problems, split_rows
from ..units import as_int

SECTION = "parallelism_config"


def split_settings(acc: dict) -> dict:
    """The yaml's parallelism_config without the `parallelism_config_` prefix (accelerate accepts both)."""
    raw = acc.get(SECTION) or {}
    return {str(k).removeprefix("parallelism_config_"): v for k, v in raw.items()} if isinstance(raw, dict) else {}


def split_of(acc: dict) -> tuple[str, int] | None:
    """("cp"|"sp", degree) of an accelerate yaml's split, None without one."""
    pc = split_settings(acc)
    sizes = {kind: as_int(pc.get(f"{kind}_size", 1)) or 1 for kind in ("sp", "cp")}
    return next(((kind, n) for kind, n in sizes.items() if n > 1), None)


def with_split_rows(result: dict, spec, setup, split: tuple | None, model: str, knobs) -> dict:
    """`estimate`'s `result` with the split's rows (`plan --sp/--cp`'s, fitted) added; as it is without a split."""
    if not split:
        return result
    from ..plan.planner import fits
    from ..plan.trace_cache import cached_traces_for

    traces, _ = cached_traces_for(model, replace(setup, seq_len=setup.seq_len // split[1]))
    rows = split_rows(spec, setup, *split, traces, knobs)
    for row in rows:
        row.fits = fits(row, setup)
    return {**result, "rows": result["rows"] + rows}


def launched_strategy(acc: dict) -> str:
    """fsdp1 / fsdp2 / zero1-3 / ddp of an accelerate yaml."""
    kind = acc.get("distributed_type")
    if kind == "FSDP":
        return f"fsdp{(acc.get('fsdp_config') or {}).get('fsdp_version', 1)}"
    if kind == "DEEPSPEED":
        return f"zero{(acc.get('deepspeed_config') or {}).get('zero_stage', 3)}"
    return "ddp"


def check_sequence_split(file: str, acc: dict, trainer: dict | None, source: str, config=None,
                         world: int | None = None) -> list[Finding]:
    """Findings for the yaml's cp/sp split (none without one); `config`: the model's transformers config (heads,
    positions) when known; `trainer`: parsed Trainer/recipe arguments (max_seq_length, attn_implementation) read
    from `source`."""
    pc, split = split_settings(acc), split_of(acc)
    if split is None:
        return []
    (kind, degree), findings, trainer = split, [], trainer or {}
    if kind == "sp" and "sp_backend" not in pc:
        findings.append(Finding("sp-backend", file, f"{SECTION}.parallelism_config_sp_backend", "sp_size is set but "
                                "sp_backend is not: accelerate 1.15 falls back to deepspeed, the only backend it has",
                                "write parallelism_config_sp_backend: deepspeed"))
    seq = as_int(trainer.get("max_seq_length"))
    fixed = as_int(pc.get("sp_seq_length")) if kind == "sp" else None
    if fixed and seq and fixed != seq and str(pc.get("sp_seq_length_is_variable", True)).lower() == "false":
        findings.append(Finding("sequence-data", file, f"{SECTION}.parallelism_config_sp_seq_length",
                                f"{fixed} fixed (sp_seq_length_is_variable false) but the batches are "
                                f"{seq} tokens (max_seq_length): Ulysses' attention shapes would not match",
                                "set it to max_seq_length, or sp_seq_length_is_variable: true"))
    heads, kv = attention_heads(config) if config is not None else (None, None)
    attention = trainer.get("attn_implementation") or (pc.get("sp_attn_implementation") if kind == "sp" else None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for problem in split_problems(kind, degree, seq_len=seq, heads=heads, kv_heads=kv, world=world,
                                  tp=as_int(pc.get("tp_size", 1)) or 1, strategy=launched_strategy(acc),
                                  attention=attention,
                                  max_positions=getattr(text, "max_position_embeddings", None)):
        where, key = file, f"{SECTION}.parallelism_config_{problem.setting}"
        if problem.setting == "max_seq_length" or problem.setting == "attn_implementation" and \
                trainer.get("attn_implementation"):
            where, key = source, problem.setting  # the Trainer's value, not the yaml's
        elif problem.setting == "attn_implementation":
            key = f"{SECTION}.parallelism_config_sp_attn_implementation"
        findings.append(Finding("sequence-split", where, key, problem.problem, problem.fix))
    return findings
