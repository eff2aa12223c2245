"""A thread that speaks before the collective timeout: when this rank's step runs past `hang_after`, it writes the
rank's record into `OUTPUT_DIR/shardscope_hang/` (`hang.py` says what a record holds) and rank 0 logs the
verdict in one line. It never stops training.

Ranks waiting inside a collective cannot exchange anything through that process group: each rank watches its own
clock and writes its own file; rank 0 reads the folder (the output directory must be one filesystem shared by the
ranks, as the Trainer's checkpoints already need) after a short grace for the others' files. What every rank
also keeps in the launcher's key-value store (the default process group's store, `TCPStore` under torchrun and
accelerate launch): its pid, host and last step, so that a record can say which peer's process is gone (on the
same host) and at which step it was last seen. An exception that ends the training thread (a peer died: gloo's
"Connection closed by peer") writes an "error" record through `sys.excepthook` (or the profiler's `with`).

`hang_after`: seconds, "auto" (10 x the median step, at least `AUTO_FLOOR`; `FIRST_STEP_S` until a step has
completed) or None (off). A pause (evaluation, a checkpoint save) gets at least `PAUSE_FLOOR`.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import sys
import threading
import time
import traceback
import uuid
import weakref
from collections import deque
from pathlib import Path

from . import hang
from ..safe_io import atomic_write_text
from . import collective_log
from .guard import GUARDED, Instrument

logger = logging.getLogger("shardscope")

AUTO_FLOOR, FIRST_STEP_S, PAUSE_FLOOR = 120.0, 600.0, 600.0
GRACE_S = 30.0  # rank 0 waits at most this long for the other ranks' records
BEAT_S = 0.5  # the thread looks at the clock this often, and puts this rank's step into the store when it changed
collective_log.record_by_default()  # at the profiler's (and the callback's) import: before the process group, mostly
_STARTED = [0]  # watchdogs started in this process: the n-th run of a process agrees on its id with its peers'


class Watchdog:
    """`start()` once the process group exists, `step_done(step, pause)` at each optimizer step's end (training
    thread; a few attribute writes), `failed(error)` where the loop ends with an exception, `stop()` at the end."""

    def __init__(self, output_dir, hang_after, instrument: Instrument, owner=None):
        import torch.distributed as dist

        self.folder, self.hang_after, self.instrument = Path(output_dir) / hang.FOLDER, hang_after, instrument
        # the thread ends with its owner (a profiler dropped without close()); None: with stop() only
        self._owner = (lambda: True) if owner is None else weakref.ref(owner)
        on = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.run_id, self._store, self._prefix = None, None, None
        self._durations: deque = deque(maxlen=100)  # the last 100 steps
        self._step, self._started, self._paused = 0, time.monotonic(), False
        self._thread_id = threading.get_ident()
        self._reported, self._beaten = None, None
        self._stop = threading.Event()
        self._thread = self._previous_hook = self._hook = self._n = None

    def start(self) -> "Watchdog":
        if self.hang_after is None:
            return self
        collective_log.dump_into(self.folder)
        if collective_log.ring_off():
            self.instrument.warn("flight recorder off", collective_log.ring_off(), note=True)
        self._n = _STARTED[0]
        _STARTED[0] += 1
        self._thread = threading.Thread(target=self.instrument.wrap(self._watch), name="shardscope-watchdog",
                                        daemon=True)
        self._thread.start()
        self._previous_hook, self._hook = sys.excepthook, self._excepthook  # (one bound method: `is` finds it)
        sys.excepthook = self._hook
        return self

    def step_done(self, step: int, pause: bool = False) -> None:
        now = time.monotonic()
        if not self._paused:
            self._durations.append(now - self._started)
        self._step, self._started, self._paused, self._thread_id = step, now, pause, threading.get_ident()

    def failed(self, error: BaseException) -> None:
        """Record the exception that ends this rank's loop (once)."""
        if self._thread is not None and self.instrument.ok and self._reported != "error":
            self._reported = "error"
            self.instrument.wrap(self._write)("error", error=error)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._hook is not None and sys.excepthook is self._hook:
            sys.excepthook = self._previous_hook

    @property
    def watching(self) -> bool:
        """Whether the thread runs (it ends at `stop()`, with its owner, or when its instrument failed)."""
        return self._thread is not None and self._thread.is_alive()

    def limit(self) -> float:
        """Seconds the current step may run before it is overdue."""
        if self.hang_after != "auto":
            limit = float(self.hang_after)
        else:
            limit = max(AUTO_FLOOR, 10 * statistics.median(self._durations)) if self._durations else FIRST_STEP_S
        return max(limit, PAUSE_FLOOR) if self._paused else limit

    # --- the thread -------------------------------------------------------------------------------------------
    def _excepthook(self, kind, value, tb):
        if issubclass(kind, Exception):
            self.failed(value)
        (self._previous_hook or sys.__excepthook__)(kind, value, tb)

    def _watch(self) -> None:
        self._join_store()
        while not self._stop.wait(BEAT_S) and self._owner() is not None:
            self._beat()
            step, started = self._step, self._started
            running = time.monotonic() - started
            if running > self.limit() and self._reported not in ((step, started), "error"):
                self._reported = (step, started)
                self._write("overdue", running=running)
                if self.rank == 0:
                    self._log_verdict()
        if self._owner() is None:  # its profiler was dropped without close(): hand the hook back too
            self.stop()

    def _join_store(self) -> None:
        """The run's id (rank 0 draws it; the others read it) and this rank's pid and host, in the store."""
        import torch.distributed as dist

        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        fallback = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}-{os.environ.get('MASTER_PORT', '')}-{self._n}"
        self.run_id = uuid.uuid4().hex[:12] if self.world == 1 else fallback
        try:  # (no store: records without peers, the run told apart by the launcher's run id and port)
            self._store = dist.distributed_c10d._get_default_store() if self.world > 1 else None
        except (RuntimeError, ValueError, AttributeError) as error:
            self.instrument.warn("no store", f"the watchdog runs without the launcher's store ({error})", note=True)
        if self._store is None:
            return
        key = f"shardscope/run/{restart}/{self._n}"
        if self.rank == 0:
            self._store.set(key, uuid.uuid4().hex[:12])
        while not self._stop.is_set() and not self._store.check([key]):
            time.sleep(0.2)
        self.run_id = self._store.get(key).decode() if self._store.check([key]) else fallback
        self._prefix = f"shardscope/{self.run_id}/rank/"
        self._beat()

    def _beat(self) -> None:
        if self._store is not None and self._beaten != self._step:
            self._beaten = self._step
            self._store.set(f"{self._prefix}{self.rank}",
                            json.dumps({"pid": self.pid, "host": self.host, "step": self._step}))

    def _peers(self) -> dict:
        """{rank: {step, pid, host, alive}} from the store (alive: None where the peer is on another host)."""
        peers = {}
        for rank in range(self.world) if self._store is not None else ():
            key = f"{self._prefix}{rank}"
            if rank != self.rank and self._store.check([key]):
                peer = json.loads(self._store.get(key))
                peer["alive"] = _alive(peer["pid"]) if peer.get("host") == self.host else None
                peers[str(rank)] = peer
        return peers

    def _write(self, event: str, running: float | None = None, error: BaseException | None = None) -> None:
        frame = sys._current_frames().get(self._thread_id) if error is None else None
        frames = traceback.extract_stack(frame) if frame is not None else \
            traceback.extract_tb(error.__traceback__) if error is not None else []
        stack = [f"{f.filename}:{f.lineno} in {f.name}: {f.line}" for f in frames]
        record = {"kind": hang.KIND, "version": hang.VERSION, "event": event, "run_id": self.run_id,
                  "rank": self.rank, "world_size": self.world, "pid": self.pid, "host": self.host,
                  "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "step": self._step,
                  "running_s": running, "hang_after_s": self.limit(), "stack": stack,
                  "collectives": _guarded(collective_log.recent, hang.collective_summary([], None)),
                  "peers": _guarded(self._peers, {}),
                  "error": None if error is None else f"{type(error).__name__}: {error}"}
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(hang.record_path(self.folder, self.rank), json.dumps(record, indent=1), "hang record")

    def _log_verdict(self) -> None:
        deadline = time.monotonic() + min(GRACE_S, max(5.0, self.limit()))
        while True:
            records, unreadable = hang.read_folder(self.folder)
            mine = [r for r in records if r.get("run_id") == self.run_id]
            if len(mine) >= self.world or time.monotonic() > deadline or self._stop.is_set():
                break
            time.sleep(0.5)
        logger.warning("shardscope hang: %s (records in %s: `shardscope hang %s` for the stacks)",
                       hang.line(hang.verdict(mine, unreadable)), self.folder, self.folder)


setattr(Watchdog._excepthook, GUARDED, "watchdog")


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed and not yet reaped by its launcher, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True


def _guarded(read, default):
    try:
        return read()
    except Exception as error:  # the record is still written, without this part
        return {**default, "unreadable": f"{type(error).__name__}: {error}"} if isinstance(default, dict) else default
