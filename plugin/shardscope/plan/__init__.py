"""Predictions before launch: the run being planned (`mesh.Setup`, the mesh, the TP rule), the per-strategy state,
communication and activation formulas (`formulas`), the step traced on fake tensors (`trace`, `trace_cache`), the
predicted peak (`peak`), estimate / fits / recommend (`planner`) and the meta-device dry run (`dry_run`). May import
model/ and the top-level foundation modules; never measure/, fit/, doctor/, report/ or cli/."""
