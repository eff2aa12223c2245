"""Choosing a configuration: `search` (strategy x micro-batch x checkpointing x accumulation at a fixed global
batch, kept where plan/'s peak fits, ranked by its step-time model) and `training_args` (`fit_training_args`: the
decision for a live Trainer run, made on rank 0 and applied on every rank); `configs` (the shipped configs, each
checked by the library that consumes it: fit's written config, doctor's rules, `shardscope configs`). May import
plan/, model/, measure/'s tables and the foundation modules; never doctor/, report/ or cli/."""
