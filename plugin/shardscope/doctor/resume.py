"""Doctor's `resume-world-size` rule: a plain ZeRO checkpoint resumed at a world size other than the one that saved
it, with the reshard step that fixes it (the recipes refuse such a resume through `checkpoint.resume`)."""
from __future__ import annotations

from pathlib import Path

from ..safe_io import read_text


def saved_world_size(checkpoint: Path) -> int | None:
    """The number of ranks that wrote a plain ZeRO checkpoint (None: not one, or universal)."""
    latest = checkpoint / "latest"
    if not latest.is_file() or (checkpoint / "latest_universal").is_file():
        return None
    step = checkpoint / read_text(latest, "checkpoint file", max_bytes=4096).strip()
    if not step.resolve().is_relative_to(checkpoint.resolve()) or not step.is_dir():
        return None
    return len(list(step.glob("*_optim_states.pt"))) or None


def resume_problem(checkpoint, world_size: int) -> tuple[str, str] | None:
    """(problem, fix) when `checkpoint` cannot resume at `world_size` as it is, else None."""
    if not checkpoint:
        return None
    saved = saved_world_size(Path(checkpoint))
    if saved is None or saved == world_size:
        return None
    return (f"checkpoint '{checkpoint}' was saved by {saved} ZeRO ranks and this run has {world_size}: a ZeRO "
            "checkpoint loads only at the world size that wrote it",
            f"run `shardscope reshard {checkpoint} OUT` (DeepSpeed's universal checkpoint) and resume from OUT with "
            f'the same global batch and DeepSpeed\'s "checkpoint": {{"load_universal": true}} (the recipes set it '
            "themselves for such a checkpoint)")
