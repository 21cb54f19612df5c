"""Stall warning: a rank stuck at a sync says which sync it waits at and who has not arrived.

A dead or hung peer makes every other rank wait in a collective until the process group's
timeout (``flo.init(timeout=...)``, 10 minutes by default). Long before that, the
:class:`StallWatchdog` logs a warning like Horovod's::

    flodl_opt: rank 0 has waited 60s at sync #412; ranks [3] have not arrived

How it knows: each rank's watchdog thread writes "I reached sync #n" under its own key
(``flodl/sync/<group>/<rank>``) in the launcher's key-value store (the default process
group's store). A rank still waiting after the threshold reads its peers' keys; a peer whose
last sync number is below n has not arrived. One key per rank, overwritten, so the store does
not grow with the number of syncs.

The training thread never touches the store (a store on a dead host could block it): it only
hands the sync number to the watchdog thread, which does the writes and the reads.

Example::

    watch = StallWatchdog(threshold_s=60)
    with watch.waiting(sync_number):
        consensus.run(...)
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref
from typing import Iterator, List, Optional, Sequence

import torch.distributed as dist

log = logging.getLogger("flodl_opt")

DEFAULT_STALL_WARNING_S = 60.0

# Watchdogs whose thread may still run. A daemon thread that is inside a store call (C++,
# GIL released) when the interpreter finalizes is killed as it takes the GIL back, and that
# aborts the process ("terminate called without an active exception", SIGABRT) after training
# has finished. So every live watchdog is stopped and joined at exit, while Python still runs.
_live: "weakref.WeakSet[StallWatchdog]" = weakref.WeakSet()
_JOIN_S = 5.0  # a store call on a dead host fails well within this


def close_all(timeout: float = _JOIN_S) -> None:
    """``flo.shutdown()``: warn of optimizers with steps since their last sync, then stop every
    live watchdog and wait for its thread."""
    from .provenance import warn_unsynced
    warn_unsynced("flo.shutdown()")
    _close_all(timeout)


def _close_all(timeout: float = _JOIN_S) -> None:
    for watch in list(_live):
        watch.close(timeout)


atexit.register(_close_all)


# A store answer that takes longer than this counts as "the store is not answering". The store
# lives in rank 0's process (or torchrun's agent): a hung rank 0 takes it along, and a store call
# then blocks past its own timeout, so the watchdog never waits on one itself (_StoreCalls).
_STORE_ANSWER_S = 5.0


def _default_store():
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # private API moved, or no store (a world of one): no peer report
        return None
    try:
        # A connection of the watchdog's own, so its thread never shares a socket with the
        # training thread's store calls (Store.clone, torch >= 2.5).
        return store.clone()
    except Exception:
        return store


class _StoreCalls:
    """The watchdog's store calls, run one at a time on a thread of their own.

    The watchdog thread hands a call over and waits a bounded time for its answer, so a store
    that never answers delays no warning; the call itself is left to finish (or not) there."""

    def __init__(self, store):
        self.store = store
        self._cond = threading.Condition()
        self._jobs: List = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="flodl-stall-store", daemon=True)
        self._thread.start()

    def submit(self, fn) -> dict:
        job = {"fn": fn, "done": threading.Event(), "ok": False, "value": None}
        with self._cond:
            self._jobs.append(job)
            self._cond.notify()
        return job

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._jobs.pop(0)
            try:
                job["value"], job["ok"] = job["fn"](self.store), True
            except Exception:  # the store is gone: job["ok"] stays False
                pass
            job["done"].set()

    def close(self, timeout: Optional[float]) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if timeout is not None:
            self._thread.join(timeout)


class StallWatchdog:
    """A daemon thread that warns when this rank waits at one sync longer than ``threshold_s``.

    Args:
        threshold_s: seconds at one sync before the first warning (then again every
            ``threshold_s`` until the sync ends).
        ranks: global ranks of the group (to name the missing ones); ``None``: no peer report.
        rank: this rank's global rank.
        tag: distinguishes groups sharing one store.
        store: the key-value store; default: the default process group's store.
    """

    def __init__(self, threshold_s: float, ranks: Optional[Sequence[int]] = None, rank: int = 0,
                 tag: str = "world", store=None):
        self.threshold_s = float(threshold_s)
        self.ranks: List[int] = list(ranks) if ranks is not None else []
        self.rank, self.tag = rank, tag
        self.store = store if store is not None else (_default_store() if self.ranks else None)
        self._calls = _StoreCalls(self.store) if self.store is not None else None
        self._answer_s = min(_STORE_ANSWER_S, max(self.threshold_s / 2, 0.05))
        self._asking: Optional[dict] = None    # the peer query still waiting for the store
        self._store_down = False               # the last store call failed or did not answer
        self._cond = threading.Condition()
        self._current: Optional[int] = None   # sync number this rank is in, None between syncs
        self._entered = 0.0
        self._published = 0                    # last sync number written to the store
        self._closed = False
        self.warnings: List[str] = []          # the last few warnings (tests, post-mortems)
        self._thread = threading.Thread(target=self._loop, name="flodl-stall-watchdog", daemon=True)
        self._thread.start()
        _live.add(self)

    def _key(self, rank: int) -> str:
        return f"flodl/sync/{self.tag}/{rank}"

    @contextlib.contextmanager
    def waiting(self, sync_number: int) -> Iterator[None]:
        """Mark this rank as inside sync ``sync_number`` for the duration of the block."""
        with self._cond:
            self._current, self._entered = sync_number, time.monotonic()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._current = None
                self._cond.notify()

    def close(self, timeout: Optional[float] = _JOIN_S) -> None:
        """Stop the thread and wait up to ``timeout`` s for it (``None``: do not wait)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        _live.discard(self)
        if timeout is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._calls is not None:
            self._calls.close(timeout)

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._current is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                n, entered = self._current, self._entered
            self._publish(n)  # (a close() meanwhile is seen below, before any other store call)
            deadline = entered + self.threshold_s
            with self._cond:
                while self._current == n and self._entered == entered and not self._closed:
                    left = deadline - time.monotonic()
                    if left > 0:
                        self._cond.wait(left)
                        continue
                    self._cond.release()
                    try:
                        self._report(n, time.monotonic() - entered)
                    finally:
                        self._cond.acquire()
                    deadline += self.threshold_s

    def _publish(self, n: int) -> None:
        """Tell the store this rank reached sync n (monotonic: a skipped number is implied)."""
        if self._calls is None or n <= self._published:
            return
        self._published = n  # handed over: the store thread writes it (in order) when it can
        key, value = self._key(self.rank), str(n)
        self._calls.submit(lambda store: store.set(key, value))

    def missing(self, n: int) -> Optional[List[int]]:
        """Ranks of the group whose last published sync number is below ``n`` (None: unknown)."""
        if self._calls is None:
            return None
        if self._asking is None or self._asking["done"].is_set():  # one query in flight at most
            peers = [(r, self._key(r)) for r in self.ranks if r != self.rank]
            self._asking = self._calls.submit(lambda store: {r: store.get(k) if store.check([k]) else None
                                                             for r, k in peers})
        job = self._asking
        if not job["done"].wait(self._answer_s) or not job["ok"]:
            self._store_down = True
            return None
        self._store_down = False
        # check() does not block on a missing key, get() would (until the store timeout).
        return [r for r, v in job["value"].items() if v is None or int(v) < n]

    def _report(self, n: int, waited: float) -> None:
        missing = self.missing(n)
        if missing is None and self._store_down:
            who = ("the key-value store is not answering (it lives in rank 0's process, or in the "
                   "launcher's agent under torchrun), so rank 0 or its host may be hung or dead; which "
                   "ranks have not arrived cannot be told")
        elif missing is None:
            who = "the store cannot tell which ranks have not arrived"
        elif missing:
            who = f"ranks {missing} have not arrived (dead, hung, or slower by that much?)"
        else:
            who = "every rank has arrived; the collective itself is slow or stuck"
        msg = (f"flodl_opt: rank {self.rank} has waited {waited:.0f}s at sync #{n}; {who}. "
               "It fails with SyncError at the process group's timeout (flo.init(timeout=...)).")
        self.warnings = (self.warnings + [msg])[-8:]
        log.warning(msg)
