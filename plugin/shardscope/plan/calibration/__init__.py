"""The step-time model's figures for a machine, in one home: which figures a GPU and a precision get, datasheet or
measured, the H100 fallback decided once (`figures`), and the three readers of what was measured: a profiled run's
folder (`run_dirs`), `shardscope calibrate`'s calibration.json (`calibration_json`), a preflight.json
(`preflight_json`). The model itself is `plan/time_model.py`; `shardscope calibrate`'s runs are fit/calibrate_runs.py.
"""
