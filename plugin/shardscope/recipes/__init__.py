"""Helpers of the training recipes and examples, apart from the library: their argument parsing (`args`: `--config`
YAML plus flags, the recipes being programs), data (`data`), tensor-parallel loading (`tp`), Trainer set-up and
`end_of_run` (`training`), reading a recipe's dataclasses without running it (`source`), and the tiny random models
of the tests and the demo (`tiny`). May import fit/, plan/, model/ and the foundation modules."""
