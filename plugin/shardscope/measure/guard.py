"""Measuring never stops training: `Guard`, the context manager each measurement of the profiler and the callback
runs in."""
from __future__ import annotations


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
