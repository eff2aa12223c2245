"""Config mistakes found before launch: findings and their rules (`rules`), grouped by the library or launcher they
come from (`deepspeed`, `fsdp`, `launch`, `precision`), the multi-node checks (`cluster`), and `diagnose` (all of
them over configs, model, GPUs and Trainer arguments; the recipes' `startup_checks`). May import configs/ (a file read
and checked by its library), plan/ (the fit check), model/, recipes/'s source reader and the foundation modules; never
measure/, report/ or cli/."""
