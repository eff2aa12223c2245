"""doctor's precision rules that the library-specific modules do not cover: fp16 asked on a path that
cannot honour it (CPU under DDP/FSDP), and FSDP2's missing autocast (a notice, returned as a note).

The yaml-vs-flags rule is `launch.check_precision`; the DeepSpeed file against the yaml and the
flags is `deepspeed.check_deepspeed_precision` / `check_deepspeed`.
"""
from __future__ import annotations

from .rules import Finding

FLAGS = ("bf16", "fp16")


def precision_findings(acc_file, acc: dict | None, deepspeed: bool, trainer: dict | None,
                       source: str) -> tuple[list[Finding], list[str]]:
    """(findings, notes) for the accelerate yaml `acc` (None: none given), whether a DeepSpeed file is in
    use, and the parsed Trainer arguments."""
    found, notes = [], []
    kind = (acc or {}).get("distributed_type")
    yaml_value = str((acc or {}).get("mixed_precision") or "no").lower()
    flag = next((f for f in FLAGS if (trainer or {}).get(f)), None)
    asked = flag or yaml_value  # the Trainer's flag wins over the yaml at start-up
    on_cpu = bool((trainer or {}).get("use_cpu")) or bool((acc or {}).get("use_cpu"))
    if asked == "fp16" and on_cpu and not deepspeed and kind != "DEEPSPEED":
        where, key = (source, "fp16") if flag else (str(acc_file), "mixed_precision")
        found.append(Finding("fp16-cpu", where, key,
                             "fp16 on CPU under DDP/FSDP trains plain fp32: accelerate turns fp16 autocast off on "
                             "CPU (no autocast, no loss scaler), while the run is labelled fp16",
                             "use bf16 on CPU (--bf16), or run fp16 on a GPU"))
    fsdp = (acc or {}).get("fsdp_config") or {}
    if kind == "FSDP" and str(fsdp.get("fsdp_version", 1)) == "2" and asked in FLAGS:
        notes.append(f"{acc_file}: FSDP2 with {asked}: the MixedPrecisionPolicy casts parameters to {asked} but "
                     "accelerate never wraps the forward in autocast, so every op computes in the dtype of its "
                     f"inputs and the returned loss is {asked}-rounded (losses differ from DDP by ~1e-2 at a "
                     "loss of ~7 for this alone); parameters, gradients and Adam state stay fp32")
    return found, notes
