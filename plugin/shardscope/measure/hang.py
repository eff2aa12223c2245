"""The hang records a run leaves in `OUTPUT_DIR/shardscope_hang/` and the verdict read from them.

Written by the profiler's watchdog (`measure/watchdog.py`): one JSON record per rank (`rank<N>.json`) when that
rank's step runs past `hang_after` ("overdue") or when an exception ends it ("error"). Read by rank 0's watchdog
(its one-line verdict) and by `shardscope hang DIR`. Torch's own flight-recorder dumps found in the folder (the
file name ends in the rank) are read too (event "torch_dump"): as JSON, or as a pickle through torch's weights-only
unpickler only (plain containers and numbers; nothing in a dump runs). Every record is checked key by key before
the verdict reads it: one of the wrong shape is reported unreadable, with the rest still read.

A record: `kind`, `version`, `event`, `run_id`, `rank`, `world_size`, `pid`, `host`, `time` (UTC), `step` (the
last optimizer step this rank completed), `running_s` (how long the step after it has run), `hang_after_s`,
`stack` (the training thread's Python stack, outermost first), `collectives` (`collective_summary`: `source`,
`last_completed`, `pending`), `peers` ({rank: {step, pid, host, alive}} as this rank saw them) and `error`.
Pure: nothing here talks to other ranks.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

from ..errors import UsageError
from ..safe_io import load_json, read_bytes
from ..summary import SUMMARY_FILE

FOLDER = "shardscope_hang"
KIND, VERSION = "shardscope_hang_record", 1
FR_SOURCE, LOG_SOURCE = "torch flight recorder", "shardscope collective log"
DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
               "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1}
PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")
MAX_DUMP_BYTES = 64 << 20  # a flight-recorder dump of 2,000 entries is a few MB
# this package's own files, wherever the writing rank had it installed (not a user's folder that is named shardscope)
PACKAGE = Path(__file__).resolve().parents[1]
OWN_FILES = tuple(f"/shardscope/{p.relative_to(PACKAGE).as_posix()}:" for p in PACKAGE.rglob("*.py"))


def record_path(folder, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.json"


# --- torch's flight recorder, as records carry it ---------------------------------------------------------------
def fr_entry(entry: dict) -> dict:
    """One flight-recorder entry as {kind, seq, bytes, group, done}: `bytes` = the input tensors this rank gave."""
    sizes, dtypes = entry.get("input_sizes") or [], entry.get("input_dtypes") or []
    nbytes = sum(math.prod(size) * DTYPE_BYTES.get(dtype, 0) for size, dtype in zip(sizes, dtypes))
    group = entry.get("process_group") or ["?", "?"]
    seq = entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")
    return {"kind": str(entry.get("profiling_name", "?")).split(":")[-1], "seq": seq, "bytes": nbytes,
            "group": f"{group[1] or group[0]}" if isinstance(group, (list, tuple)) and len(group) == 2 else str(group),
            "done": bool(entry.get("retired")) or entry.get("state") == "completed"}


def collective_summary(entries: list[dict], source: str | None) -> dict:
    """{source, last_completed, pending} from normalised entries (oldest first): the last collective this rank
    saw complete, and those it entered that had not completed (oldest first)."""
    done = [e for e in entries if e["done"]]
    strip = lambda e: {k: e[k] for k in ("kind", "seq", "bytes", "group")}  # noqa: E731
    return {"source": source if entries else None, "last_completed": strip(done[-1]) if done else None,
            "pending": [strip(e) for e in entries if not e["done"]]}


# --- reading a folder -------------------------------------------------------------------------------------------
def read_folder(folder) -> tuple[list[dict], dict[str, str]]:
    """(records, {file: why it could not be read}) of a hang folder (or of an output dir holding one)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"{folder}: no such folder (give OUTPUT_DIR or OUTPUT_DIR/{FOLDER})")
    if (folder / FOLDER).is_dir() or (folder / SUMMARY_FILE).is_file():  # an output dir
        folder = folder / FOLDER
        if not folder.is_dir():
            return [], {}  # the watchdog wrote nothing: no hang
    records, unreadable = [], {}
    for path in sorted(p for p in folder.iterdir() if not p.name.startswith(".")):
        try:
            records.append(_read_one(path))
        except (UsageError, ValueError, TypeError, KeyError) as error:
            unreadable[path.name] = str(error)
    return records, unreadable


def _read_one(path: Path) -> dict:
    if path.suffix == ".json":
        data = load_json(path, "hang record", MAX_DUMP_BYTES)
        if isinstance(data, dict) and data.get("kind") == KIND:
            return _checked(data, path)
    else:
        data = _load_pickle(path)
    if isinstance(data, dict) and isinstance(data.get("entries"), list):  # torch's flight-recorder dump
        return _from_torch_dump(path, data)
    raise ValueError(f"{path}: neither a shardscope hang record nor a torch flight-recorder dump")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _checked(record: dict, path: Path) -> dict:
    """A record whose every key the verdict reads has its type (else ValueError naming the key)."""
    def fail(key):
        raise ValueError(f"{path}: key '{key}' is missing or of the wrong type")

    for key in ("rank", "world_size"):
        if not _is_int(record.get(key)) or record[key] < 0:
            fail(key)
    if record.get("step") is not None and not _is_int(record["step"]):
        fail("step")
    if not isinstance(record.get("stack", []), list) or not all(isinstance(f, str) for f in record.get("stack", [])):
        fail("stack")
    for key in ("run_id", "time", "event", "error"):
        if record.get(key) is not None and not isinstance(record[key], str):
            fail(key)
    running = record.get("running_s")
    if running is not None and (not isinstance(running, (int, float)) or isinstance(running, bool)):
        fail("running_s")
    seen = record.get("collectives") or {}
    if not isinstance(seen, dict):
        fail("collectives")
    seen = record["collectives"] = {"source": None, "last_completed": None, "pending": []} | seen
    if not isinstance(seen["pending"], list) or not isinstance(seen["source"], (str, type(None))):
        fail("collectives")
    entries = [seen["last_completed"]] if seen["last_completed"] is not None else []
    for entry in entries + seen.get("pending", []):
        if not (isinstance(entry, dict) and isinstance(entry.get("kind"), str) and isinstance(entry.get("group"), str)
                and _is_int(entry.get("bytes")) and (entry.get("seq") is None or _is_int(entry["seq"]))):
            fail("collectives")
    peers = record.get("peers") or {}
    if not isinstance(peers, dict) or not all(isinstance(p, dict) and (p.get("step") is None or _is_int(p["step"]))
                                              for p in peers.values()):
        fail("peers")
    return record


def _load_pickle(path: Path):
    """A torch flight-recorder dump (a bare pickle as `_dump_fr_trace` writes it, or a `torch.save` archive),
    loaded with torch's weights-only unpickler: plain containers and numbers only, no code runs."""
    import io

    import torch
    from torch._weights_only_unpickler import Unpickler

    data = read_bytes(path, "flight-recorder dump", MAX_DUMP_BYTES)
    try:
        if data.startswith(b"PK"):
            return torch.load(io.BytesIO(data), weights_only=True)
        return Unpickler(io.BytesIO(data)).load()
    except Exception as error:  # the unpickler refused it: a type outside the allowlist, or not a pickle
        raise ValueError(f"{path}: not loadable as a weights-only pickle ({type(error).__name__})") from None


def _from_torch_dump(path: Path, dump: dict) -> dict:
    rank = re.search(r"(\d+)(\.json)?$", path.name)
    if rank is None:
        raise ValueError(f"{path}: a flight-recorder dump whose file name does not end in its rank")
    entries = [fr_entry(e) for e in dump["entries"] if isinstance(e, dict)]
    return _checked({"kind": KIND, "event": "torch_dump", "rank": int(rank.group(1)), "world_size": 0, "run_id": None,
                     "file": path.name, "collectives": collective_summary(entries, FR_SOURCE)}, path)  # 0: unknown


# --- the verdict ------------------------------------------------------------------------------------------------
def verdict(records: list[dict], unreadable: dict | None = None) -> dict:
    """What the records of one run say: `hang` (some rank overdue or dead), `culprits` [{rank, why}], `waiting`
    [{rank, collective}], `missing` (ranks with no record), `unreadable`, `other_runs` (left out), `ranks`."""
    chosen, others = _one_run(records)
    by_rank = {}
    for record in chosen:
        by_rank.setdefault(record["rank"], record)
    world = max([r.get("world_size") or 0 for r in chosen] + [len(by_rank)])
    out = {"hang": any(r.get("event") in ("overdue", "error", "torch_dump") for r in chosen),
           "run_id": chosen[0].get("run_id") if chosen else None, "world_size": world,
           "missing": sorted(set(range(world)) - set(by_rank)), "unreadable": dict(unreadable or {}),
           "other_runs": others, "culprits": [], "waiting": [], "collective": None, "ranks": by_rank}
    dead = _dead(chosen)
    if dead:
        out["culprits"] = [{"rank": r, "why": "dead", "step": step} for r, step in sorted(dead.items())]
        return out
    _diverged(out, by_rank)
    errors = {r: rec.get("error") or "" for r, rec in by_rank.items() if rec.get("event") == "error"}
    own = [r for r, text in errors.items() if not any(word in text for word in PEER_ERRORS)]
    if not out["culprits"] and errors:  # the rank whose own error ended it, not those that lost it as a peer
        out["culprits"] = [{"rank": r, "why": "error", "error": errors[r]} for r in sorted(own or errors)]
    out["unlogged"] = bool(by_rank) and not any(collectives(r)["source"] for r in by_rank.values())
    if not out["culprits"] and out["unlogged"]:  # no collective known: the ranks whose step the others left
        out["culprits"] = _odd_steps(by_rank)
    if not out["culprits"] and out["hang"]:
        out["culprits"] = [{"rank": r, "why": "no record"} for r in out["missing"]]
    return out


def _odd_steps(by_rank: dict) -> list[dict]:
    """Without collectives: the ranks whose last step differs from the most common one (none when all agree)."""
    steps = Counter(r.get("step") for r in by_rank.values())
    common = max(steps, key=lambda step: (steps[step], -(step or 0)))
    return [{"rank": rank, "why": "other step", "step": r.get("step")} for rank, r in sorted(by_rank.items())
            if r.get("step") != common]


def _one_run(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """The newest run's records (torch dumps, which carry no run id, join it) and [{run_id, ranks}] of the others."""
    runs: dict = {}
    for record in records:
        runs.setdefault(record.get("run_id"), []).append(record)
    named = {k: v for k, v in runs.items() if k is not None}
    if not named:
        return records, []
    newest = max(named, key=lambda k: max(str(r.get("time", "")) for r in named[k]))
    others = [{"run_id": k, "ranks": sorted(r["rank"] for r in v)} for k, v in named.items() if k != newest]
    return named[newest] + runs.get(None, []), others


def _dead(records: list[dict]) -> dict[int, int | None]:
    """{rank: its last step seen} of the dead ranks: those a record saw gone (no process on its host), and, where
    some rank's loop ended in an error (gloo: "Connection closed by peer"), the ranks that wrote nothing although
    peers saw them run: a rank dying of a Python exception writes its own record, one killed (SIGKILL, the OOM
    killer, a crash, a lost node) cannot."""
    seen, dead = {}, {}
    for record in records:
        for rank, peer in (record.get("peers") or {}).items():
            if isinstance(peer, dict) and str(rank).isdigit():
                seen[int(rank)] = max(seen.get(int(rank), -1), peer.get("step") or 0)
                if peer.get("alive") is False:
                    dead[int(rank)] = peer.get("step")
    if any(r.get("event") == "error" for r in records):
        wrote = {r["rank"] for r in records}
        dead.update({rank: step for rank, step in seen.items() if rank not in wrote and rank not in dead})
    return dead


def _diverged(out: dict, by_rank: dict) -> None:
    """Fill `collective`, `waiting` and `culprits` from the ranks' pending collectives."""
    pending = {r: rec["collectives"]["pending"][0] for r, rec in by_rank.items()
               if (rec.get("collectives") or {}).get("pending")}
    if not pending:
        return
    first = min(pending.values(), key=lambda c: (c["seq"] is None, c["seq"] or 0))
    same = {r: c for r, c in pending.items() if c["group"] == first["group"] and c["seq"] == first["seq"]}
    signature = {r: (c["kind"], c["bytes"]) for r, c in same.items()}
    count, lowest_step = Counter(signature.values()), {}
    for rank, sig in signature.items():  # a tie goes to the ranks behind: the others skipped a collective
        lowest_step[sig] = min(lowest_step.get(sig, math.inf), by_rank[rank].get("step") or 0)
    common = max(count, key=lambda sig: (count[sig], -lowest_step[sig]))
    out["collective"] = {"kind": common[0], "bytes": common[1], "seq": first["seq"], "group": first["group"]}
    out["waiting"] = sorted(r for r, c in same.items() if (c["kind"], c["bytes"]) == common)
    steps = [by_rank[r].get("step") for r in out["waiting"]]
    for rank, record in sorted(by_rank.items()):
        if rank in out["waiting"]:
            continue
        mine = pending.get(rank)
        if mine is not None and mine["group"] == first["group"] and mine["seq"] == first["seq"]:
            why = "ahead" if (record.get("step") or 0) > max(s or 0 for s in steps) else "mismatch"
            out["culprits"].append({"rank": rank, "why": why, "collective": mine})
        elif mine is not None and mine["group"] == first["group"]:
            out["culprits"].append({"rank": rank, "why": "ahead", "collective": mine})
        else:
            out["culprits"].append({"rank": rank, "why": "not there", "collective": mine})
    out["culprits"] += [{"rank": r, "why": "no record"} for r in out["missing"]]


# --- saying it --------------------------------------------------------------------------------------------------
def where(record: dict) -> str | None:
    """The innermost frame of a record's stack outside torch and the installed libraries (else the innermost)."""
    stack = record.get("stack") or []
    own = [f for f in stack if "site-packages" not in f and "/torch/" not in f and not any(o in f for o in OWN_FILES)]
    return (own or stack or [None])[-1]


def _collective(c: dict | None) -> str:
    if not c:
        return "no collective"
    return f"{c['kind']} #{c['seq']} ({c['group']}, {c['bytes']:,} B)"


def line(result: dict) -> str:
    """The one-line verdict."""
    if not result["hang"]:
        return "no hang recorded" + (f" ({len(result['unreadable'])} unreadable file(s))" if result["unreadable"]
                                     else "")
    ranks, parts = result["ranks"], []
    if result["collective"] is not None:
        steps = sorted({ranks[r].get("step") for r in result["waiting"]} - {None})
        parts.append(f"rank(s) {_list(result['waiting'])} wait in {_collective(result['collective'])}"
                     + (f" after step {_list(steps)}" if steps else ""))
    for culprit in result["culprits"]:
        parts.append(_culprit(culprit, ranks.get(culprit["rank"], {})))
    if result.get("unlogged"):
        parts.insert(0, "no collective recorded (torch's flight recorder off: TORCH_FR_BUFFER_SIZE=0, or a process "
                        "group created before shardscope was imported); steps: " + ", ".join(
                            f"rank {r} after {ranks[r].get('step')}" for r in sorted(ranks)))
    elif not result["culprits"] and result["collective"] is None:
        parts.append("no rank is inside a collective: every rank that wrote is slow in its own code (see stacks)")
    silent = [r for r in result["missing"] if r not in {c["rank"] for c in result["culprits"]}]
    if silent:
        parts.append(f"no record from rank(s) {_list(silent)}")
    return "; ".join(parts)


def _culprit(culprit: dict, record: dict) -> str:
    rank, why = culprit["rank"], culprit["why"]
    if why == "dead":
        return f"rank {rank} is dead (gone without a record; last step seen {culprit.get('step')})"
    if why == "other step":
        return f"rank {rank} is at another step than the others (after step {culprit['step']}, at {where(record)})"
    if why == "error":
        return f"rank {rank} ended with an error after step {record.get('step')}: {culprit['error'][:200]}"
    if why == "no record":
        return f"rank {rank} wrote nothing (dead, stuck where Python cannot run, or on a filesystem not shared)"
    at = f"after step {record.get('step')}" + (f", at {where(record)}" if where(record) else "")
    if why == "not there":
        return f"rank {rank} is not there ({at}; last completed {_collective(collectives(record)['last_completed'])})"
    return f"rank {rank} diverged: {why}, in {_collective(culprit.get('collective'))} ({at})"


def collectives(record: dict) -> dict:
    return record.get("collectives") or {"source": None, "last_completed": None, "pending": []}


def _list(values) -> str:
    return ", ".join(map(str, values))
