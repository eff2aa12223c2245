"""Reading a finished recipe run: its logged losses, per-rank strategy lines, saved model and logits."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from launch import Run


def losses(output_dir: Path) -> dict[int, float]:
    history = json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def run_lines(run: Run) -> list[dict]:
    """The recipe's `[shardscope] rank=.. world_size=..` records, one per rank, parsed. Two ranks share one pipe and
    `print` writes a line and its newline apart, so one rank's record can land at the end of another's line: each
    record runs from its marker to the next marker or the line's end."""
    records = re.findall(r"\[shardscope\] (rank=.*?)(?=\[shardscope\]|$)", run.output, flags=re.MULTILINE)
    return [dict(item.split("=", 1) for item in record.split()) for record in records]


def reload_logits(output_dir: Path, base_model: Path | None = None):
    """Logits of the saved model (or base + saved LoRA adapter) on the batch the recipe logged at the end."""
    saved = torch.load(Path(output_dir) / "final_logits.pt")
    batch = {k: v for k, v in saved["batch"].items() if k != "labels"}
    if base_model is not None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model), output_dir)
    elif "pixel_values" in batch:
        from transformers import Dinov2ForImageClassification

        model = Dinov2ForImageClassification.from_pretrained(output_dir)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(output_dir)
    with torch.no_grad():
        return model.eval()(**batch).logits.float(), saved["logits"]  # a bf16 run saves (and reloads) bf16


def param_count(folder: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
