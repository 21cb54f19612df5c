"""What a blocking sync does around its consensus: features as hooks, each with its own state.

The sync (``LocalSGDOptimizer._sync``) is one short sequence::

    for h in hooks: h.before(point)      # e.g. shared moments: their reduce, nothing written yet
    point.stats = consensus.run(...)     # count -> reduce -> readout, restored on failure
    for h in hooks: h.after(point)       # moments written, drift read, outer step, next period

A hook owns its entry of ``state_dict()["flodl_opt"]`` (``key``; ``None`` = nothing saved) and
checks a state before anything is written (``check_state``). A new feature is one class here and one
line in ``build_hooks``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, List, Optional

import torch

from .adaptive import AdaptiveSync, share_drift
from ..sync.consensus import Consensus
from ..sync.stats import SyncStats
from ..errors import ConfigError
from .moments import DriftDenoise, MomentSync
from .outer import OuterAvg, OuterOptimizer


@dataclass
class SyncPoint:
    """One blocking sync, as the hooks see it."""

    steps: int                       # this rank's work since the last sync
    number: int                      # 1-based sync number
    warmup: bool                     # a warm-up sync (plain averaging)
    waiting: Callable[[int], ContextManager]
    stats: Optional[SyncStats] = None  # set once the consensus succeeded


class Hook:
    """Base: does nothing, saves nothing."""

    key: Optional[str] = None

    def before(self, point: SyncPoint) -> None:
        pass

    def after(self, point: SyncPoint) -> None:
        pass

    def state_dict(self) -> Any:
        return None

    def check_state(self, state: Any) -> None:
        pass

    def load_state_dict(self, state: Any) -> None:
        pass


class MomentsHook(Hook):
    """``sync_moments``: the inner moments reduced before the consensus, written after it succeeded."""

    key = "moments"

    def __init__(self, moments: MomentSync):
        self.moments = moments
        self._pending: Optional[torch.Tensor] = None

    def before(self, point: SyncPoint) -> None:
        self._pending = None
        if self.moments.due(point.number):
            with point.waiting(point.number):
                self._pending = self.moments.reduce(point.steps, point.number)

    def after(self, point: SyncPoint) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self.moments.apply(pending)
            point.stats.collectives += self.moments.collectives_per_share
            point.stats.bytes += self.moments.bytes_per_sync
        self.moments.done(point.steps, shared=self.moments.due(point.number))

    def state_dict(self) -> Any:
        return self.moments.state_dict() if self.moments.every > 1 else None

    def load_state_dict(self, state: Any) -> None:
        self.moments.load_state_dict(state)


class DriftHook(Hook):
    """``denoise_moments="sync"``: the rank's drift ``W_i_pre - C`` takes its noise excess out of its own v."""

    key = "drift"

    def __init__(self, drift: DriftDenoise, consensus: Consensus):
        self.drift, self.consensus = drift, consensus

    def after(self, point: SyncPoint) -> None:
        stats = point.stats
        deltas = self.consensus.deltas() if self.drift.applies(point.steps, stats) else None
        if deltas is None:   # nothing to read (or no params at all): the window ends unread
            self.drift.reset_window()
            return
        self.drift.apply(deltas, self.consensus.params, point.steps, stats.movers)

    def state_dict(self) -> Any:
        return self.drift.state_dict()

    def check_state(self, state: Any) -> None:
        if not state:
            raise ConfigError("flodl_opt: this checkpoint has no denoise_moments='sync' state (saved "
                              "without the option?): build the optimizer as it was saved")

    def load_state_dict(self, state: Any) -> None:
        self.drift.load_state_dict(state)


class OuterHook(Hook):
    """The outer step on the consensus (warm-up syncs are plain averaging: the anchor follows them)."""

    key = "outer"

    def __init__(self, outer: OuterOptimizer, consensus: Consensus, optimizer: torch.optim.Optimizer):
        self.outer, self.consensus, self.optimizer = outer, consensus, optimizer

    def after(self, point: SyncPoint) -> None:
        stats, groups = point.stats, self.consensus.params
        if stats.skipped or isinstance(self.outer, OuterAvg):
            return
        if point.warmup:
            self.outer.rebase(groups)
            return
        deltas = self.consensus.deltas() if self.outer.needs_deltas else None
        if deltas is not None and stats.nonfinite:
            for d in deltas:
                d.zero_()  # a non-finite rank adopts the consensus outright
        self.outer.step(groups, deltas, float(self.optimizer.param_groups[0]["lr"]))
        if self.outer.resets_inner:
            self.optimizer.state.clear()
        stats.outer = self.outer.name

    def state_dict(self) -> Any:
        return self.outer.state_dict()

    def check_state(self, state: Any) -> None:
        self.outer.check_state_dict(state)

    def load_state_dict(self, state: Any) -> None:
        with torch.no_grad():
            self.outer.load_state_dict(state)


class AdaptiveHook(Hook):
    """``sync_every="auto"``: the next K from one tiny SUM of the ranks' readouts, never local data.

    ``stats.skipped`` comes from the shared totals, so every rank takes part here, or none."""

    key = "adaptive"

    def __init__(self, auto: AdaptiveSync, consensus: Consensus, rank: int):
        self.auto, self.consensus, self.rank = auto, consensus, rank

    def after(self, point: SyncPoint) -> None:
        stats, c = point.stats, self.consensus
        if stats.skipped:
            return
        with point.waiting(stats.sync):
            drift = share_drift(stats.divergence, stats.steps, stats, c.group, c.distributed,
                                c.comm_device, self.rank)
        self.auto.next_period(drift)

    def state_dict(self) -> Any:
        return self.auto.state_dict()

    def load_state_dict(self, state: Any) -> None:
        if state is not None:
            self.auto.load_state_dict(state)


class StateHook(Hook):
    """A part that only saves state (the compressed wire's residuals, the streaming schedule)."""

    def __init__(self, key: str, part: Any):
        self.key, self.part = key, part

    def state_dict(self) -> Any:
        return self.part.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.part.load_state_dict(state)
