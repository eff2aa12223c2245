"""Checkpoints that move: `export` (a sharded training checkpoint -> a `from_pretrained` folder, in bounded
memory) and `reshard` (a checkpoint that resumes at another world size). `sources` reads ZeRO and DCP
checkpoints safely, a few tensors at a time."""
