"""The hang verdict (`measure/hang.py`, `shardscope hang DIR`) on synthetic record folders, in process: which rank,
which collective, which step, and every kind of bad input (empty, partial, two runs mixed, corrupt, foreign,
a planted pickle) answered without a traceback; the watchdog's records in one process. The launched scenarios that
write real records and name a real straggler: test_hang_runs.py; the straggler verdict: test_stragglers.py."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from launch import wait_until
from shardscope.measure import hang
from shardscope.cli import main
from shardscope.measure import collective_log
from shardscope.measure.guard import Instrument, WarnOnce
from shardscope.measure.watchdog import Watchdog


def collective(kind="all_reduce", seq=14, nbytes=4096, group="default_pg"):
    return {"kind": kind, "seq": seq, "bytes": nbytes, "group": group}


def record(rank, step=2, pending=(), last=None, run="run-b", event="overdue", world=2, peers=None, stack=None,
           time="2026-11-27T10:00:00Z"):
    return {"kind": hang.KIND, "version": hang.VERSION, "event": event, "run_id": run, "rank": rank,
            "world_size": world, "pid": 100 + rank, "host": "node0", "time": time, "step": step, "running_s": 5.0,
            "hang_after_s": 3.0, "stack": stack or [f"train.py:{40 + rank} in <module>: work()"],
            "collectives": {"source": hang.FR_SOURCE, "last_completed": last or collective(seq=13),
                            "pending": list(pending)},
            "peers": peers or {}, "error": None}


def folder_of(tmp_path, *records, name=hang.FOLDER):
    folder = tmp_path / name
    folder.mkdir(parents=True, exist_ok=True)
    for i, r in enumerate(records):
        (folder / f"rank{r['rank']}{'' if r['run_id'] == 'run-b' else '-' + str(i)}.json").write_text(json.dumps(r))
    return folder


def culprit_list(result):
    return [(c["rank"], c["why"]) for c in result["culprits"]]


def cli(capsys, *args):
    code = main(["hang", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_rank_that_never_reaches_the_collective_is_named_with_its_stack(tmp_path, capsys):
    folder = folder_of(tmp_path, record(0, pending=[collective()]),
                       record(1, stack=["train.py:42 in <module>: time.sleep(3600)"]))
    result = hang.verdict(*hang.read_folder(folder))
    assert result["waiting"] == [0] and result["collective"] == collective()
    assert [(c["rank"], c["why"]) for c in result["culprits"]] == [(1, "not there")]
    code, out, err = cli(capsys, tmp_path)  # the output dir works as well as its hang folder
    assert code == 1 and err == ""
    assert out.splitlines()[0] == ("shardscope hang: rank(s) 0 wait in all_reduce #14 (default_pg, 4,096 B) after "
                                   "step 2; rank 1 is not there (after step 2, at train.py:42 in <module>: "
                                   "time.sleep(3600); last completed all_reduce #13 (default_pg, 4,096 B))")


def test_a_rank_that_skipped_a_collective_is_ahead_in_another(tmp_path):
    folder = folder_of(tmp_path, record(0, step=2, pending=[collective(nbytes=4)]),
                       record(1, step=3, pending=[collective("broadcast", nbytes=32)]))
    result = hang.verdict(*hang.read_folder(folder))
    assert result["waiting"] == [0] and result["collective"]["bytes"] == 4
    assert [(c["rank"], c["why"], c["collective"]["kind"]) for c in result["culprits"]] == [(1, "ahead", "broadcast")]


def test_the_odd_rank_out_of_a_mismatched_collective_is_named(tmp_path):
    same = [record(r, pending=[collective()], world=3) for r in (0, 2)]
    folder = folder_of(tmp_path, *same, record(1, pending=[collective("all_gather", nbytes=8)], world=3))
    result = hang.verdict(*hang.read_folder(folder))
    assert result["waiting"] == [0, 2]
    assert [(c["rank"], c["why"]) for c in result["culprits"]] == [(1, "mismatch")]


def test_a_dead_rank_is_named_with_its_last_step_from_a_survivors_record(tmp_path, capsys):
    survivor = record(0, event="error", peers={"1": {"pid": 101, "host": "node0", "step": 5, "alive": False}})
    folder = folder_of(tmp_path, survivor)
    result = hang.verdict(*hang.read_folder(folder))
    assert result["culprits"] == [{"rank": 1, "why": "dead", "step": 5}] and result["missing"] == [1]
    code, out, _ = cli(capsys, folder)
    assert code == 1 and "rank 1 is dead (gone without a record; last step seen 5)" in out.splitlines()[0]
    assert "no record from" not in out.splitlines()[0]  # said once, as dead


def test_a_rank_missing_where_a_survivor_saw_an_error_is_dead_and_one_that_wrote_its_own_error_is_not(tmp_path):
    seen = {"1": {"pid": 101, "host": "node0", "step": 5, "alive": True}}  # looked at while it was being killed
    result = hang.verdict(*hang.read_folder(folder_of(tmp_path, record(0, event="error", peers=seen))))
    assert result["culprits"] == [{"rank": 1, "why": "dead", "step": 5}]
    own = record(1, event="error", peers={"0": {"pid": 100, "host": "node0", "step": 5, "alive": True}})
    lost = {**record(0, event="error", peers=seen), "error": "RuntimeError: [pair.cc:553] Connection closed by peer"}
    result = hang.verdict(*hang.read_folder(folder_of(tmp_path / "b", lost, {**own, "error": "ValueError: bad"})))
    assert culprit_list(result) == [(1, "error")]  # its own error, not the one its peer saw as a closed socket
    assert hang.line(result) == "rank 1 ended with an error after step 2: ValueError: bad"


def test_a_partial_folder_names_the_ranks_that_wrote_nothing(tmp_path, capsys):
    folder = folder_of(tmp_path, *(record(r, pending=[collective()], world=4) for r in (0, 1)))
    result = hang.verdict(*hang.read_folder(folder))
    assert result["missing"] == [2, 3] and [c["rank"] for c in result["culprits"]] == [2, 3]
    assert all(c["why"] == "no record" for c in result["culprits"])
    code, out, _ = cli(capsys, folder, "--json")
    assert code == 1 and json.loads(out)["missing"] == [2, 3]


def test_two_runs_mixed_keeps_the_newest_and_names_the_other(tmp_path, capsys):
    old = [record(r, run="run-a", pending=[collective(seq=3)], time="2026-11-26T09:00:00Z") for r in (0, 1)]
    folder = folder_of(tmp_path, *old, record(0, pending=[collective()]), record(1))
    result = hang.verdict(*hang.read_folder(folder))
    assert result["run_id"] == "run-b" and result["other_runs"] == [{"run_id": "run-a", "ranks": [0, 1]}]
    assert [(c["rank"], c["why"]) for c in result["culprits"]] == [(1, "not there")]
    _, out, _ = cli(capsys, folder)
    assert "left out: records of another run (run-a, rank(s) 0, 1)" in out


def test_a_corrupt_record_is_named_and_the_rest_still_read(tmp_path, capsys):
    folder = folder_of(tmp_path, record(0, pending=[collective()]))
    (folder / "rank1.json").write_text('{"kind": "shardscope_hang_rec')  # truncated mid-write by a dying node
    (folder / "notes.json").write_text('{"hello": 1}')
    (folder / "rank3.json").write_text(json.dumps({**record(3), "rank": "three"}))
    (folder / "rank4.json").write_text(json.dumps({**record(4), "collectives": {"pending": [1, 2]}}))
    (folder / "rank5.json").write_text(json.dumps({**record(5), "peers": {"0": {"step": "two"}}}))
    (folder / "rank6.json").mkdir()
    (folder / "rank7.json").write_text(json.dumps({**record(7), "collectives": [1], "running_s": "long"}))
    code, out, err = cli(capsys, folder)
    assert code == 1 and err == "" and "Traceback" not in out
    assert {line.split(":")[1].strip() for line in out.splitlines() if line.startswith("unreadable:")} == \
        {"notes.json", "rank1.json", "rank3.json", "rank4.json", "rank5.json", "rank6.json", "rank7.json"}
    assert "rank 1 wrote nothing" in out.splitlines()[0]


@pytest.mark.parametrize("content, code", [(None, 0), ("not json at all", 2)])
def test_an_empty_or_wholly_unreadable_folder(tmp_path, capsys, content, code):
    folder = tmp_path / hang.FOLDER
    folder.mkdir()
    if content is not None:
        (folder / "rank0.json").write_text(content)
    got, out, err = cli(capsys, folder)
    assert got == code and err == "" and out.startswith("shardscope hang: no hang recorded")


def test_an_output_dir_without_records_is_no_hang_and_a_missing_folder_one_line(tmp_path, capsys):
    (tmp_path / "shardscope_summary.json").write_text("{}")
    assert cli(capsys, tmp_path)[:2] == (0, "shardscope hang: no hang recorded\n")
    code, out, err = cli(capsys, tmp_path / "nowhere")
    assert code == 2 and out == "" and err.startswith("shardscope: error: ") and len(err.splitlines()) == 1


def test_every_rank_slow_outside_collectives_is_a_hang_with_no_culprit(tmp_path):
    folder = folder_of(tmp_path, record(0), record(1))
    result = hang.verdict(*hang.read_folder(folder))
    assert result["hang"] and result["culprits"] == []
    assert "no rank is inside a collective" in hang.line(result)


def test_without_a_collective_log_the_rank_at_another_step_is_named(tmp_path):
    unlogged = {"source": None, "last_completed": None, "pending": []}
    folder = folder_of(tmp_path, *({**record(r, step=3 if r == 2 else 2, world=3), "collectives": unlogged}
                                   for r in range(3)))
    result = hang.verdict(*hang.read_folder(folder))
    assert result["unlogged"] and culprit_list(result) == [(2, "other step")]
    assert hang.line(result).startswith("no collective recorded (torch's flight recorder off")
    assert "rank 2 is at another step than the others (after step 3" in hang.line(result)


def fr_dump(pending_seq):
    """A torch flight-recorder dump as `_dump_fr_trace` pickles it (plain containers; entries as on gloo)."""
    entry = {"collective_seq_id": 7, "p2p_seq_id": 0, "is_p2p": False, "profiling_name": "gloo:all_reduce",
             "process_group": ["0", "default_pg"], "input_sizes": [[1000]], "input_dtypes": ["Float"],
             "retired": True, "state": "scheduled"}
    return {"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": [
        entry, {**entry, "collective_seq_id": pending_seq, "retired": False}]}


def test_torch_flight_recorder_dumps_are_read_weights_only_and_a_planted_pickle_never_runs(tmp_path):
    class Planted:
        def __reduce__(self):
            return exec, (f"open({str(tmp_path / 'planted')!r}, 'w').close()",)

    folder = tmp_path / "dumps"
    folder.mkdir()
    (folder / "nccl_trace_rank_0").write_bytes(pickle.dumps(fr_dump(8), protocol=2))  # as torch's C++ writes it
    buffer = io.BytesIO()
    torch.save(fr_dump(8), buffer)
    (folder / "nccl_trace_rank_1").write_bytes(buffer.getvalue())
    (folder / "nccl_trace_rank_2").write_bytes(pickle.dumps({"entries": [Planted()]}, protocol=2))
    odd = fr_dump(8)
    odd["entries"][1]["collective_seq_id"] = "eight"  # a value of the wrong type: unreadable, not a traceback
    (folder / "nccl_trace_rank_3").write_bytes(pickle.dumps(odd, protocol=2))
    records, unreadable = hang.read_folder(folder)
    assert not (tmp_path / "planted").exists() and list(unreadable) == ["nccl_trace_rank_2", "nccl_trace_rank_3"]
    assert sorted(r["rank"] for r in records) == [0, 1]
    seen = hang.collectives(records[0])
    assert seen["last_completed"] == collective(seq=7, nbytes=4000) and seen["pending"] == [collective(seq=8,
                                                                                                      nbytes=4000)]


# --- the watchdog in one process (world size 1; tests/test_hang_runs.py has the launched ranks) -----------------
@pytest.fixture
def watchdog(tmp_path):
    dog = Watchdog(tmp_path, 0.5, Instrument("watchdog", WarnOnce())).start()
    yield dog
    dog.stop()


def test_a_step_past_hang_after_writes_the_record_with_the_training_threads_stack(watchdog, tmp_path, caplog):
    watchdog.step_done(7)
    with caplog.at_level(logging.WARNING, logger="shardscope"):
        assert wait_until(lambda: "shardscope hang:" in caplog.text, 20)
    [record], unreadable = hang.read_folder(tmp_path)
    assert unreadable == {} and (record["event"], record["step"], record["rank"], record["world_size"]) == \
        ("overdue", 7, 0, 1)
    assert "in wait_until" in hang.where(record)  # the training thread's stack: it waits in the line above
    assert watchdog.instrument.ok and sys.excepthook.__name__ == "_excepthook"


def test_a_watchdog_whose_profiler_is_dropped_without_close_ends_and_hands_the_hook_back(tmp_path):
    class Owner:
        pass

    previous, owner = sys.excepthook, Owner()
    dog = Watchdog(tmp_path, 0.3, Instrument("watchdog", WarnOnce()), owner).start()
    assert sys.excepthook is not previous and dog.watching
    del owner
    assert wait_until(lambda: not dog.watching, 10)
    assert sys.excepthook is previous and not (tmp_path / hang.FOLDER).exists()


def test_an_exception_that_ends_the_loop_writes_an_error_record_and_the_hook_is_handed_back(tmp_path):
    previous = sys.excepthook
    dog = Watchdog(tmp_path, 60.0, Instrument("watchdog", WarnOnce())).start()
    dog.step_done(4)
    try:
        raise ValueError("a bad batch")
    except ValueError as error:
        sys.excepthook(ValueError, error, error.__traceback__)  # what Python calls for an uncaught exception
    dog.stop()
    assert sys.excepthook is previous
    [record], _ = hang.read_folder(tmp_path)
    assert (record["event"], record["step"], record["error"]) == ("error", 4, "ValueError: a bad batch")
    assert "raise ValueError" in record["stack"][-1]


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=4),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=8)
KEYS = st.sampled_from(["rank", "world_size", "step", "stack", "collectives", "peers", "event", "run_id", "time",
                        "running_s", "error", "host"])


@settings(max_examples=60, deadline=None)
@given(changes=st.lists(st.tuples(st.integers(0, 2), KEYS, JSON), max_size=4))
def test_any_record_a_file_can_hold_is_read_or_named_unreadable_never_a_traceback(changes):
    records = [record(0, pending=[collective()]), record(1, world=3), record(2, world=3, event="error",
                                                                          peers={"1": {"step": 1, "alive": False}})]
    for index, key, value in changes:
        records[index][key] = value
    with tempfile.TemporaryDirectory() as folder:
        for i, r in enumerate(records):
            (Path(folder) / f"rank{i}.json").write_text(json.dumps(r))
        errors, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(out):
            code = main(["hang", folder])
            assert main(["hang", folder, "--json"]) == code
        assert code in (0, 1, 2) and "internal error" not in errors.getvalue(), errors.getvalue()


def test_a_flight_recorder_turned_off_by_the_user_is_kept_off_and_said_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    collective_log.record_by_default()
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "0"  # the user's setting wins
    with caplog.at_level(logging.WARNING, logger="shardscope"):
        Watchdog(tmp_path, 60.0, Instrument("watchdog", WarnOnce())).start().stop()
    assert [r.getMessage() for r in caplog.records] == [
        "shardscope: TORCH_FR_BUFFER_SIZE=0: torch's flight recorder is off, so hang records carry no collectives "
        "(stacks and steps only)"]


def test_where_leaves_out_this_packages_frames_not_a_users_folder_named_shardscope():
    """A user's checkout named shardscope (as `git clone` names this repository) is the user's code; the package's
    own files are not, wherever the rank had it installed."""
    own = f"/opt/checkout/plugin/shardscope/{hang.OWN_FILES[0].split('/shardscope/', 1)[1]}1 in f: g"
    record = {"stack": ["/home/me/shardscope/train.py:42 in <module>: step()", own]}
    assert hang.where(record) == "/home/me/shardscope/train.py:42 in <module>: step()"
