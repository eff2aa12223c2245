"""The shipped configs and their checks by the libraries that consume them: `catalog` (the shipped files, a name or
path resolved, the file a launcher reads), `files` (reading a config file, the checks every kind shares), `validate`
(`validate_config`: a file's kind, then its library's check: `accelerate`, `deepspeed`, `fsdp`), `launcher` (the
launcher's view of an accelerate yaml: its arguments, the environment it exports, the DeepSpeed fields it passes).
Used by fit/ (the winner's shipped config), doctor/ (its rules read files through it) and cli/ (`configs`,
`compare`, `calibrate`). May import plan/, measure/, model/ and the foundation modules; never fit/ or above."""
