"""After runs: `compare` (launching a recipe per config, collecting run folders, tables and plots), its time and
peak sections (`time_section`, `peak_section`) and `plan_vs_run` (the planner's figures beside a run summary's).
Reads summaries (the top-level `summary`) and a run folder's launch log (fit/'s `launching` writes it); may import
plan/, model/ and the foundation modules; never measure/'s live instruments, fit/'s search, doctor/ or cli/."""
