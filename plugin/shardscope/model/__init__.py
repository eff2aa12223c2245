"""A model, before any training: its config -> `ModelSpec` (exact counts on the meta device, the tensor-parallel
layout, MoE experts) in `spec`, the shipped catalog (the package's `model_configs/`), and the keyed JSON cache of what is computed
from a config (`cache`). May import the top-level foundation modules only (errors, units, safe_io, strategy)."""
