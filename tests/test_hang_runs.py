"""Hung, dead and slow ranks on 2 CPU ranks over gloo, named from the run itself: a raw torch DDP loop with
`ShardingProfiler` under torchrun (tests/workers/hang_loop.py: one rank skips a collective, sleeps inside a step,
SIGKILLs itself, or busy-loops every step) and one Trainer run with the callback under accelerate launch
(tests/workers/hang_trainer.py: one rank sleeps after a step). All five launch at once (one module-scoped fixture);
a hung launch is ended once rank 0 has logged its verdict, through its launcher (SIGTERM, as a job scheduler
ends a job), and no process of any launch may be left. The verdicts are asserted, not the clocks; the one time
bound is the issue's: each record written within hang_after + 30 s of its step's start (the record says when)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import ROOT, accelerate_cmd, background, end_launch, torchrun_cmd, wait_until
from shardscope.measure import hang
from shardscope.cli import main

HANG_AFTER = 5.0  # seconds, in the hung runs: their steps take milliseconds, the first one (start-up) a few seconds
# at most, with five launches sharing 2 cores; the killed and the slow run keep the default ("auto": 600 s before
# the first step, then 10 x the median step and at least 120 s), as a normal run does
LOOP, TRAINER = ROOT / "tests" / "workers" / "hang_loop.py", ROOT / "tests" / "workers" / "hang_trainer.py"
HUNG = ("skip", "sleep", "trainer")  # ended by the test once rank 0 has logged its verdict
DEADLINE_S = 240  # the whole fixture (five launches start together on 2 cores); a run still going then fails


def scenario_cmd(name: str, out: Path) -> list[str]:
    if name == "trainer":
        return accelerate_cmd(ROOT / "accelerate_configs" / "ddp.yaml", TRAINER, ["--hang_after", HANG_AFTER], out)
    return torchrun_cmd(LOOP, ["--scenario", name, "--hang_after", HANG_AFTER if name in HUNG else "auto",
                               "--steps", 12], out)


@pytest.fixture(scope="module")
def hang_runs(tmp_path_factory):
    """{scenario: {out, returncode, ended_itself, left}} of the five launches, all run to their verdict."""
    runs = {}
    try:
        for name in ("kill", "slow", *HUNG):
            out = tmp_path_factory.mktemp(f"hang-{name}")
            runs[name] = {"out": out, "proc": background(scenario_cmd(name, out), out)}
        wait_until(lambda: all(r["proc"].poll() is not None or verdict_logged(n, r["out"]) for n, r in runs.items()),
                   DEADLINE_S)
    finally:  # (also when starting or waiting failed: no launch outlives the fixture)
        for run in runs.values():
            run["ended_itself"] = run["proc"].poll() is not None
            run["left"] = end_launch(run["proc"], run["out"])
            run["returncode"] = run["proc"].returncode
            run["log"] = (run["out"] / "launch.log").read_text()
    return runs


def verdict_logged(name: str, out: Path) -> bool:
    return name in HUNG and "shardscope hang:" in (out / "launch.log").read_text()


def cli_verdict(out: Path, capsys) -> tuple[int, dict]:
    code = main(["hang", str(out), "--json"])
    return code, json.loads(capsys.readouterr().out)


def culprits(result: dict) -> list[tuple]:
    return [(c["rank"], c["why"]) for c in result["culprits"]]


def test_no_launch_leaves_a_process_behind(hang_runs):
    assert {name: run["left"] for name, run in hang_runs.items()} == dict.fromkeys(hang_runs, [])


@pytest.mark.parametrize("name", HUNG)
def test_every_rank_writes_its_record_in_time_and_rank_0_logs_the_verdict(hang_runs, name):
    run = hang_runs[name]
    assert not run["ended_itself"], run["log"][-3000:]  # the watchdog never stops training
    records, unreadable = hang.read_folder(run["out"])
    assert unreadable == {} and sorted(r["rank"] for r in records) == [0, 1]
    assert all(r["event"] == "overdue" and HANG_AFTER < r["running_s"] < HANG_AFTER + 30 for r in records)
    assert len({r["run_id"] for r in records}) == 1
    assert all(r["collectives"]["source"] == hang.FR_SOURCE for r in records)  # gloo records on this torch
    logged = [line for line in run["log"].splitlines() if "shardscope hang:" in line]
    assert len(logged) == 1 and "rank(s) 0 wait in" in logged[0]


def test_a_rank_sleeping_inside_the_step_is_not_there(hang_runs, capsys):
    code, result = cli_verdict(hang_runs["sleep"]["out"], capsys)
    assert code == 1 and culprits(result) == [(1, "not there")] and result["waiting"] == [0]
    assert result["collective"]["kind"] == "all_reduce"  # DDP's gradient all-reduce, in rank 0's backward
    assert "time.sleep(3600)" in hang.where(result["ranks"]["1"])
    assert {r: result["ranks"][r]["step"] for r in ("0", "1")} == {"0": 2, "1": 2}


def test_a_rank_that_skipped_a_collective_is_ahead(hang_runs, capsys):
    code, result = cli_verdict(hang_runs["skip"]["out"], capsys)
    assert code == 1 and culprits(result) == [(1, "ahead")] and result["waiting"] == [0]
    assert result["collective"]["kind"] == "all_reduce" and result["collective"]["bytes"] == 4  # the loss, fp32
    assert {r: result["ranks"][r]["step"] for r in ("0", "1")} == {"0": 2, "1": 3}


def test_a_trainer_rank_that_stops_after_a_step_is_named_under_accelerate_launch(hang_runs, capsys):
    code, result = cli_verdict(hang_runs["trainer"]["out"], capsys)
    assert code == 1 and culprits(result) == [(1, "not there")] and result["waiting"] == [0]
    assert "in on_step_end: time.sleep(3600)" in hang.where(result["ranks"]["1"])
    assert result["ranks"]["1"]["step"] == 3


def test_a_killed_rank_ends_the_run_and_the_survivor_names_it_with_its_last_step(hang_runs, capsys):
    run = hang_runs["kill"]
    assert run["ended_itself"] and run["returncode"] != 0  # torchrun's error, not a hang to the timeout
    assert "exitcode  : -9" in run["log"]
    code, result = cli_verdict(run["out"], capsys)
    assert code == 1 and result["culprits"] == [{"rank": 1, "why": "dead", "step": 2}]
    survivor = result["ranks"]["0"]  # its next collective fails on the closed connection, unless the launcher's
    # agent, which saw rank 1 die too, ends it first (a race on a loaded machine): then its last heartbeat stands
    assert survivor["event"] != "error" or "Connection closed by peer" in survivor["error"], survivor


def test_a_rank_busy_every_step_is_named_the_straggler_and_nothing_else_is_reported(hang_runs):
    run = hang_runs["slow"]
    assert run["ended_itself"] and run["returncode"] == 0, run["log"][-3000:]
    assert not (run["out"] / hang.FOLDER).exists() and "shardscope hang:" not in run["log"]
    straggler = json.loads((run["out"] / "shardscope_summary.json").read_text())["straggler"]
    assert straggler["straggler_rank"] == 1 and straggler["slow_windows"][1] > straggler["windows"] / 2
    assert straggler["waiting_share"]["0"] > 0 and straggler["compute_s"][1] > straggler["compute_s"][0]
    assert "rank 1 is a straggler" in run["log"]
