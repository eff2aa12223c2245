"""What a running job really does: `ShardingProfiler` (any loop) and `ShardingProfilerCallback` (Trainer events),
and their instruments: counts and throughput, memory readings, the instrumented peak step, precision, collectives,
the step timer, the sampled steps and the cross-rank exchange. Writes the run summary (the top-level `summary`).
May import the foundation modules (and model/); never plan/, fit/, doctor/, report/ or cli/: the planner's plan for a
live run reaches the profiler as an injected function (`plan_for_live_run`, set by the top-level `profiling` bridge)."""
