"""Choosing a configuration: `search` (strategy x micro-batch x checkpointing x accumulation at a fixed global
batch, kept where plan/'s peak fits, ranked by its step-time model), `training_args` (`fit_training_args`: the
decision for a live Trainer run, made on rank 0 and applied on every rank), `launch_files` (the winner's files, from
configs/' shipped ones); `launching` (a script launched under `accelerate launch` / `deepspeed` into a run folder:
calibrate's runs, compare's). May import configs/, plan/, model/, measure/'s tables and the foundation modules;
never doctor/, report/ or cli/."""
