"""`shardscope preflight` (arguments: cli/preflight.py): the cluster checked before the first multi-node run (docs/cluster.md).

- node check (`node_check`): one process per node, before any launcher; missing nodes named by the deadline.
- full check (`full_check`): launched like training; fingerprints, links and compute per rank.
- `calibration_from_preflight(path)`: the measured link bandwidths and FLOP/s, for the step-time model (the reader,
  with the file's name, schema version and "largest size" rule: plan/calibration/preflight_json.py).
"""
from ..plan.calibration.preflight_json import calibration_from_preflight

__all__ = ["calibration_from_preflight"]
