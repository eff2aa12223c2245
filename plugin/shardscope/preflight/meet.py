"""Meeting in a store that never waits for everyone, with a deadline, so that who never came can be named.

torchrun's and accelerate's static rendezvous block in their `TCPStore` until every node connects (600 s by
default) before any worker starts. Here the host of the store opens it with `wait_for_workers=False`; each
member writes its record and bumps a counter; the leader (member 0) waits until all are there or the deadline
passes and writes the verdict (who joined); the others read it. Every wait is a poll against a deadline, so
nothing blocks past it. The leader keeps the store open until every joined member says it is done."""
from __future__ import annotations

import json
import socket
import time
from datetime import timedelta

PREFIX = "shardscope-preflight"
POLL_S = 0.2
GRACE_S = 5.0  # after the deadline: for the leader's verdict to arrive, and for the members' last words


class Unreachable(Exception):
    """The store's host could not be reached, or stopped answering, before the deadline."""


def deadline_in(seconds: float) -> float:
    """The deadline `seconds` from now, on the clock every wait here reads (time.monotonic)."""
    return time.monotonic() + seconds


def wait_for_port(host: str, port: int, deadline: float) -> bool:
    """Poll a TCP connection to host:port until it is accepted or the deadline passes (quietly: torch's own
    client retries log a C++ error per attempt)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            with socket.create_connection((host, port), timeout=min(left, 2.0)):
                return True
        except OSError:
            time.sleep(min(POLL_S * 2, max(deadline - time.monotonic(), 0)))


def open_store(host: str, port: int, hosting: bool, deadline: float):
    """A TCPStore at host:port, hosted here (`wait_for_workers=False`) or reached as a client by the deadline."""
    import torch.distributed as dist

    seconds = timedelta(seconds=max(deadline - time.monotonic(), 1.0) + GRACE_S)
    if hosting:
        return dist.TCPStore(host, port, None, True, seconds, wait_for_workers=False)
    if not wait_for_port(host, port, deadline):
        raise Unreachable(f"nothing answered at {host}:{port}")
    try:
        return dist.TCPStore(host, port, None, False, seconds)
    except (RuntimeError, OSError) as error:  # torch's DistNetworkError is a RuntimeError
        raise Unreachable(f"{host}:{port} refused the store's handshake ({str(error).splitlines()[0]})") from None


def key(*parts) -> str:
    return "/".join([PREFIX, *map(str, parts)])


def poll(store, name: str, deadline: float) -> bool:
    """Whether `name` is in the store by the deadline (store.check, polled)."""
    while not store.check([name]):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def meet(store, me: int, count: int, record: dict, deadline: float) -> tuple[list[int], dict[int, dict]]:
    """(joined members, their records) as the leader (member 0) saw them at the deadline or when all came."""
    try:
        store.set(key("member", me), json.dumps(record))
        store.add(key("arrived"), 1)
        if me == 0:
            while store.add(key("arrived"), 0) < count and time.monotonic() < deadline:
                time.sleep(POLL_S)
            joined = [m for m in range(count) if store.check([key("member", m)])]
            store.set(key("verdict"), json.dumps({"joined": joined, "count": count}))
        elif not poll(store, key("verdict"), deadline + GRACE_S):
            raise Unreachable("member 0 (node 0 / rank 0) gave no verdict by the deadline")
        verdict = json.loads(store.get(key("verdict")))
        if verdict["count"] != count:
            raise Unreachable(f"member 0 expects {verdict['count']} members, this one was started with {count}")
        joined = verdict["joined"]
        return joined, {m: json.loads(store.get(key("member", m))) for m in joined}
    except RuntimeError as error:  # the store's host went away
        raise Unreachable(str(error).splitlines()[0]) from None


def finish(store, me: int, joined: list[int], outcome: dict | None, wait_s: float) -> dict | None:
    """The leader publishes the outcome and waits (up to GRACE_S) for every joined member to read it before its
    store closes; a member waits up to `wait_s` for it (the leader may still be writing its report). Returns the
    outcome (None where the leader is gone)."""
    try:
        if me == 0:
            store.set(key("outcome"), json.dumps(outcome))
            end = deadline_in(GRACE_S)
            for member in joined:
                if member != 0 and not poll(store, key("done", member), end):
                    break
            return outcome
        if not poll(store, key("outcome"), deadline_in(wait_s)):
            return None
        outcome = json.loads(store.get(key("outcome")))
        store.set(key("done", me), "1")
        return outcome
    except RuntimeError:
        return None
