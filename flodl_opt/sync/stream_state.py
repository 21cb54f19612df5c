"""A fragment sync in flight, and the streaming state a checkpoint keeps.

``state_dict()`` holds the counters and, for a fragment in flight, its finished result (the
collectives drained first), so after a resume it merges at the same step, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict

import torch

from ..errors import ConfigError


@dataclass
class Flight:
    """One fragment sync: issued (count and reduce in flight), merged ``tau`` steps later."""

    fragment: int
    sync: int
    issued_at: int
    merge_at: int
    steps: int
    nonfinite: bool
    pre_sq: float
    count: torch.Tensor
    works: list
    t_issue_ms: float
    local_steps: int = 0      # real steps this rank took since the issue
    done: bool = False        # collectives finished (waited, or restored from a checkpoint)
    active: bool = True       # this rank had not joined (uneven data) when it issued
    collectives: int = 0
    gather_at: int = 0        # compressed wire: the tick its second phase (all_gather) starts
    phase: int = 1            # compressed wire: 1 = the all_to_all, 2 = the all_gather issued

    def wait(self, waiting: Callable[[int], ContextManager]) -> None:
        """Wait for the collectives in flight (inside ``waiting``: the stall watchdog)."""
        with waiting(self.sync):
            for w in self.works:
                w.wait()
        self.works, self.done = [], True


class StreamCheckpoint:
    """``state_dict`` / ``load_state_dict`` of :class:`~flodl_opt.sync.streaming.StreamingSync`
    (its counters, schedule, outer slices, wire state and the fragment in flight)."""

    def state_dict(self) -> Dict[str, Any]:
        """Counters and, if a fragment is in flight, its finished result (call ``drain()`` first)."""
        sd: Dict[str, Any] = {"clock": self.clock, "since": list(self.since), "syncs": self.syncs,
                              "pending": None,
                              # each fragment's own outer step count (DiLoCo's warm-up depends on it)
                              "outer_steps": [getattr(o, "steps", None) for o in self._outers]}
        if self.auto is not None:  # the round in progress: its start, its period, its readouts
            sd["round"] = {"origin": self.schedule.origin, "period": self.schedule.period,
                           "readouts": [list(r) for r in self.schedule.readouts]}
        f = self.pending
        if f is not None:
            assert f.done, "drain() before state_dict()"
            sd["pending"] = {
                "fragment": f.fragment, "sync": f.sync, "issued_at": f.issued_at, "merge_at": f.merge_at,
                "steps": f.steps, "nonfinite": f.nonfinite, "pre_sq": f.pre_sq,
                "count": f.count.detach().cpu().clone(), "local_steps": f.local_steps,
                "sent": [t.detach().clone() for t in self._sent[f.fragment]],
                "buf": [t.detach().clone() for t in self._buf[f.fragment]],
            }
            if self.wire is not None:  # the finished phase's bytes and pending residuals
                sd["pending"].update(phase=f.phase, gather_at=f.gather_at,
                                     wire=self.wire.flight_state(f.fragment))
        if self.wire is not None:
            sd["wire"] = self.wire.state_dict()
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.clock, self.since, self.syncs = int(sd["clock"]), list(sd["since"]), int(sd["syncs"])
        if len(self.since) != len(self.fragments):
            raise ConfigError("flodl_opt: the checkpoint's streaming state has "
                              f"{len(self.since)} fragments, this optimizer {len(self.fragments)}")
        for o, n in zip(self._outers, sd.get("outer_steps") or []):
            if n is not None:
                o.steps = int(n)
        if self.auto is not None and sd.get("round") is not None:
            rd = sd["round"]
            self.schedule.set_period(int(rd["period"]))
            self.schedule.origin = int(rd["origin"])
            self.schedule.readouts = [(float(a), float(b), int(c)) for a, b, c in rd["readouts"]]
        self.pending = None
        if self.wire is not None:
            if sd.get("wire") is None:
                raise ConfigError("flodl_opt: the checkpoint's streaming state holds no compressed-wire "
                                  "state; resume with the wire settings it was saved with")
            self.wire.load_state_dict(sd["wire"])
        p = sd.get("pending")
        if p is None:
            return
        k = p["fragment"]
        with torch.no_grad():
            for dst, src in zip(self._sent[k] + self._buf[k], p["sent"] + p["buf"]):
                if dst.shape != src.shape:
                    raise ConfigError("flodl_opt: the checkpoint's in-flight fragment does not match "
                                      "this model's fragments")
                dst.copy_(src)
        self.pending = Flight(k, p["sync"], p["issued_at"], p["merge_at"], p["steps"], p["nonfinite"],
                               p["pre_sq"], p["count"].to(self.comm_device), [], 0.0,
                               local_steps=p["local_steps"], done=True)
        if self.wire is not None:
            self.pending.phase, self.pending.gather_at = int(p["phase"]), int(p["gather_at"])
            self.wire.load_flight_state(k, p["wire"])
