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
import datetime
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


# A watchdog store call that takes longer than this counts as "the store is not answering".
# The store lives in rank 0's process: a hung rank 0 (SIGSTOP, a GIL-holding deadlock) takes it
# along, and a call with the store's own timeout (the process group's, minutes) would hold the
# watchdog thread past every warning it should give.
_STORE_CALL_S = 5.0


def _default_store(call_timeout_s: float = _STORE_CALL_S):
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # private API moved, or no store (a world of one): no peer report
        return None
    try:
        # A connection of the watchdog's own, so its thread never shares a socket with the
        # training thread's store calls (Store.clone, torch >= 2.5), and can have a short timeout.
        own = store.clone()
    except Exception:
        return store
    try:
        own.set_timeout(datetime.timedelta(seconds=call_timeout_s))
    except Exception:  # a store without set_timeout: its own timeout applies
        pass
    return own


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
        self.store = store if store is not None else (
            _default_store(min(_STORE_CALL_S, self.threshold_s / 2)) if self.ranks else None)
        self._store_down = False               # the last store call failed or timed out
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
        if self.store is None or n <= self._published:
            return
        try:
            self.store.set(self._key(self.rank), str(n))
            self._published = n
            self._store_down = False
        except Exception:  # the store is gone or hung with its host: the report says so
            self._store_down = True

    def missing(self, n: int) -> Optional[List[int]]:
        """Ranks of the group whose last published sync number is below ``n`` (None: unknown)."""
        if self.store is None:
            return None
        try:
            out = []
            for r in self.ranks:
                if r == self.rank:
                    continue
                key = self._key(r)
                # check() does not block on a missing key, get() would (until the store timeout).
                if not self.store.check([key]) or int(self.store.get(key)) < n:
                    out.append(r)
            self._store_down = False
            return out
        except Exception:
            self._store_down = True
            return None

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
