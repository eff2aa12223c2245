"""Measuring never stops training. One owner for the three ways the profiler keeps that promise:

- `Guard`: the context manager each of the profiler's own measurements runs in (a failure is warned about once
  and that figure is left out; the next measurement tries again); `Guards`: one per figure, made once.
- `Instrument`: everything an instrument puts into the user's code path (module and optimizer hooks, wrapped
  methods, dispatch-mode callbacks) goes in through `Instrument.hook`, `Instrument.wrap` or `MethodWrap`. A
  failure inside disables that instrument for the rest of the run: whatever of it is still called passes straight
  through (and is removed at the next step end), it is warned about once (naming the instrument and the reason), and the user's
  code gets what it expects (a hook returns None, a wrapped method still runs the original once).
  `with instrument:` guards the profiler's own work for that instrument (set-up, the gather, the summary) the same
  way. `Instrument.status` is "ok" or the reason: the summary's `instruments`. `Instruments`: the profiler's own,
  each by what it installs, and those the loop's adapter adds; `CallerInstruments`: the caller's `instruments=[...]`.
- `WarnOnce`: the one warning per key.
- `validate_arguments`: a wrong argument fails where the profiler (or callback) is made, before the loop runs.
"""
from __future__ import annotations

import functools
import logging
import math

from ..summary import SUMMARY_FILE

logger = logging.getLogger("shardscope")

GUARDED = "__shardscope_guarded__"  # set on every callable an instrument installs (tests/test_never_breaks.py)
UNWRAP = "__shardscope_unwrap__"  # a `MethodWrap`'s `remove`, on the method it installed


class WarnOnce:
    """`warn(key, message, note=False)` logs `message` the first time `key` is met; a note is a fact about the
    input, not a failure."""

    __slots__ = ("seen",)

    def __init__(self):
        self.seen: set[str] = set()

    def __call__(self, key: str, message: str, note: bool = False) -> None:
        if key not in self.seen:
            self.seen.add(key)
            logger.warning("shardscope: %s" + ("" if note else " (warned once; training continues)"), message)


class Guard:
    """`with Guard(warn_once, what):` an exception inside is reported as `warn_once(what, message)` and swallowed.

    A class, not a `contextlib.contextmanager` generator: a measuring step enters about fifteen guards, and a
    generator costs ~2 us each (a class ~0.4 us).
    """

    __slots__ = ("warn", "what")

    def __init__(self, warn, what: str):
        self.warn, self.what = warn, what

    def __enter__(self) -> "Guard":
        return self

    def __exit__(self, kind, error, _traceback) -> bool:
        if kind is None or not issubclass(kind, Exception):
            return False
        self.warn(self.what, f"could not measure {self.what}: {kind.__name__}: {error}")
        return True


class Guards:
    """`guards(what)`: the `Guard` of one figure, made once (a `Guard` holds no state of its own)."""

    __slots__ = ("warn", "made")

    def __init__(self, warn):
        self.warn, self.made = warn, {}

    def __call__(self, what: str) -> Guard:
        guard = self.made.get(what)
        return guard if guard is not None else self.made.setdefault(what, Guard(self.warn, what))


def _returns_none(*_args, **_kwargs):
    return None


class Instrument:
    """One instrument of the profiler and what it installed (see the module docstring)."""

    def __init__(self, name: str, warn):
        self.name, self.warn = name, warn
        self.failure: str | None = None  # the reason it was disabled
        self._installed: list = []  # handles with `remove()`

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def status(self) -> str:
        return "ok" if self.failure is None else self.failure

    def fail(self, reason: str) -> None:
        """Disable the instrument for the rest of the run (first reason kept, warned about once). What it installed
        passes straight through from now on and is removed at the profiler's next step end (`remove`): taken out
        here, inside one of its own hooks, it would change the hook registry torch is walking."""
        if self.failure is None:
            self.failure = reason
            self.warn(f"instrument {self.name}", f"{self.name} disabled for the rest of the run: {reason}")

    def wrap(self, fn, fallback=_returns_none):
        """`fn`, safe to call from the user's code: it runs while the instrument is ok; an exception disables the
        instrument, and then (as on every later call) `fallback(*args, **kwargs)` answers instead."""
        def guarded(*args, **kwargs):
            if self.failure is None:
                try:
                    return fn(*args, **kwargs)
                except Exception as error:
                    self.fail(f"{type(error).__name__}: {error}")
            return fallback(*args, **kwargs)

        setattr(guarded, GUARDED, self.name)
        return guarded

    def hook(self, register, fn, **options):
        """`register(wrap(fn), **options)` (a `register_*hook` method), its handle removed with the instrument."""
        return self.keep(register(self.wrap(fn), **options))

    def keep(self, handle):
        """Remove `handle` (anything with `remove()`) with the instrument."""
        self._installed.append(handle)
        return handle

    def remove(self) -> None:
        """Take out everything installed (also at the instrument's normal end)."""
        installed, self._installed = self._installed, []
        for handle in installed:
            handle.remove()

    def __enter__(self) -> "Instrument":
        return self

    def __exit__(self, kind, error, _traceback) -> bool:
        """`with instrument:` the profiler's own work for it; a failure disables it like one in a hook."""
        if kind is None or not issubclass(kind, Exception):
            return False
        self.fail(f"{kind.__name__}: {error}")
        return True


class Instruments:
    """The profiler's own instruments, each named by what it installs (`throughput`: the forward hooks that count;
    `state_bytes`: the gradient snapshot; `memory`: the memory step's tracker; `precision`: the compute-dtype probe;
    `gpu_compute`: a CUDA rank's step events), then those added (`add`: the sampled steps', the loop adapter's).
    `all`: every one, in the summary's order (`gpu_compute` on a CUDA rank only)."""

    NAMES = ("throughput", "state_bytes", "memory", "precision", "gpu compute")

    def __init__(self, warn, cuda: bool):
        self.warn = warn
        self.throughput, self.state_bytes, self.memory, self.precision, self.gpu_compute = (
            Instrument(name, warn) for name in self.NAMES)
        self.all = (self.throughput, self.state_bytes, self.memory, self.precision, *((self.gpu_compute,) if cuda else ()))

    def add(self, instrument: "Instrument | str") -> Instrument:
        """`instrument` (or a new one of that name) taken in: warned, reported and removed as the others."""
        instrument = instrument if isinstance(instrument, Instrument) else Instrument(instrument, self.warn)
        self.all += (instrument,)
        return instrument

    def statuses(self) -> dict:
        return {i.name: i.status for i in self.all}

    def remove(self, failed_only: bool = False) -> None:
        """Take out what each installed (`failed_only`: of those that failed: outside their hooks, at a step's end)."""
        for instrument in self.all:
            if not failed_only or instrument.failure is not None:
                instrument.remove()


class CallerInstruments:
    """The caller's `instruments=[...]`: objects with `name`, `start(step)`, `stop(step)` and `result()`; `call`
    calls one method on each, each under its own guard."""

    def __init__(self, objects, guards: Guards):
        self.objects, self.guards = list(objects), guards

    def call(self, method: str, *args) -> dict:
        """{name: what `method` returned} (an instrument that failed is left out, warned about once)."""
        out = {}
        for instrument in self.objects:
            name = getattr(instrument, "name", type(instrument).__name__)
            with self.guards(f"instrument {name}"):
                out[name] = getattr(instrument, method)(*args)
        return out


def instrument_statuses(ranks: list[dict]) -> dict:
    """The summary's `instruments`: {name: "ok", or the first failing rank's reason as "rank R: reason"}."""
    out = {}
    for rank, statuses in enumerate(ranks):
        for name, status in statuses.items():
            if out.get(name, "ok") == "ok":
                out[name] = status if status == "ok" or len(ranks) == 1 else f"rank {rank}: {status}"
    return out


class MethodWrap:
    """`before()` and `after()` (guarded by `instrument`) around `owner.<name>` on this one instance (DeepSpeed's
    ZeRO optimizers have no step hooks; the Trainer's `training_step`); the original always runs, once. Several may
    wrap one method and be removed in any order: one removed under another passes straight through."""

    def __init__(self, instrument: Instrument, owner, name: str, before=_returns_none, after=_returns_none):
        original, before = getattr(owner, name), instrument.wrap(before)
        after = None if after is _returns_none else instrument.wrap(after)  # (none: two calls fewer per call)

        def wrapped(*args, **kwargs):
            if not self.active:
                return original(*args, **kwargs)
            before(*args, **kwargs)
            if after is None:
                return original(*args, **kwargs)
            try:
                return original(*args, **kwargs)
            finally:
                after()

        setattr(wrapped, GUARDED, instrument.name)
        setattr(wrapped, UNWRAP, self.remove)
        self.owner, self.name, self.wrapped, self.active = owner, name, wrapped, True
        self.previous = vars(owner).get(name)  # a wrap set on the instance before this one
        setattr(owner, name, wrapped)
        instrument.keep(self)

    def remove(self) -> None:
        self.active = False
        if vars(self.owner).get(self.name) is self.wrapped:  # on top: unwrap
            if self.previous is None:
                delattr(self.owner, self.name)  # the class's own method shows through again
            else:
                setattr(self.owner, self.name, self.previous)


def unwrap_stale(owner, name: str, instrument_name: str) -> None:
    """Remove a `MethodWrap` of `instrument_name` still on `owner.<name>` (left by a run that raised before its
    end): only what the profiler put there; whatever the user set on the instance stays and is wrapped next."""
    stale = vars(owner).get(name)
    if getattr(stale, GUARDED, None) == instrument_name and callable(getattr(stale, UNWRAP, None)):
        getattr(stale, UNWRAP)()


def never_raises(default=lambda: None):
    """Decorator for a method the user's loop calls (a profiler call, a Trainer event): whatever its own guards
    miss is warned about once through `self.warn_once`, and `default()` is returned."""
    def decorate(method):
        @functools.wraps(method)
        def safe(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception as error:
                self.warn_once(method.__name__, f"{method.__name__} failed: {type(error).__name__}: {error}")
            return default()

        return safe

    return decorate


def validate_arguments(every_n_steps=None, peak_tflops=None, summary_file=SUMMARY_FILE, hang_after="auto",
                       **steps) -> None:
    """A wrong type fails when the profiler (or callback) is made, not at step 0 inside the user's loop.
    `steps`: memory_step, comm_step, time_step, time_every_n_steps (positive integers or None)."""
    if hang_after not in (None, "auto") and (isinstance(hang_after, bool) or not isinstance(hang_after, (int, float))
                                             or not 0 < hang_after < math.inf):
        raise ValueError(f"hang_after must be a positive number of seconds, 'auto' or None, got {hang_after!r}")
    for name, value in (("every_n_steps", every_n_steps), *steps.items()):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    if peak_tflops is not None and (not isinstance(peak_tflops, (int, float)) or isinstance(peak_tflops, bool)
                                    or not 0 < peak_tflops < math.inf):
        raise ValueError(f"peak_tflops must be a positive number of TFLOP/s or None, got {peak_tflops!r}")
    if summary_file is not None and (not isinstance(summary_file, str) or not summary_file.strip()):
        raise ValueError(f"summary_file must be a file name or None, got {summary_file!r}")
