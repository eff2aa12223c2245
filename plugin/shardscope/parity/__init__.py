"""`shardscope parity` (arguments: cli/parity.py; docs/parity.md): a script run under a config on N ranks against the
same script as one process, compared step by step from the fingerprints measure/parity_record.py records.

- `runs`: the config read, both runs launched (fit/launching.py), their records read;
- `compare`: the tolerance from the precision, each step's row, the first divergence (step, phase, module, rank);
- `shadow`: a large model's architecture at a CPU size (`--shadow-of`), by a stated shrink rule.
"""
