"""``sync_every="auto"``: a sync period that follows how far the ranks drift apart.

The rule (``AdaptiveSync``): keep the cohort's divergence at each sync near a target.

* After every sync each rank that moved knows its divergence from the consensus,
  ``d_i = ||W_i_pre - C|| / ||C||`` (the readout of the sync), and its steps ``n_i`` since the
  previous sync. One tiny SUM of ``[reporting, d_i**2, n_i]`` (24 bytes, float64) gives every rank
  the same numbers: the cohort's RMS divergence ``d`` and mean period ``n``.
* The next period is ``K' = n * target / d``, at most ``max_change`` times larger or smaller than
  the current ``K``, clipped to ``[min_every, max_every]`` and rounded half-up. A sync without
  reporters (every rank idle or non-finite) keeps ``K``, and so does ``d == 0``: identical ranks
  (a DDP warm-up averages gradients, a world of one) say nothing about how fast local steps drift.

Why this shape:

* The target is met whatever the drift law is. Ranks drift like a random walk
  (``d ~ lr * sqrt(K)``) or, over longer horizons, linearly (``d ~ lr * K``); in log space the
  update ``log K' = log n + log(target / d)`` has gain ``1 - a`` for a drift law ``d ~ K**a``, so it
  settles for any ``0 < a < 2`` (assuming ``a = 1`` is the conservative choice: assuming ``a = 0.5``
  would oscillate forever when the drift is linear). ``max_change`` bounds a noisy reading.
* The learning rate enters through what is measured: as a schedule decays the learning rate, the
  same ``K`` drifts less and ``K`` grows; with random-walk drift a constant target gives
  ``K ~ 1/lr**2``, the quadratic synchronization rule, without assuming it. Schedules need no
  hook, and nothing local (time, a rank's own scheduler, which stops under ``join()``) decides.
* Every rank computes ``K'`` from the same float64 numbers (the result of one all_reduce is the same
  tensor on every rank) with the same code, so the cohort never disagrees on when to sync.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from ..errors import ConfigError, SyncError


@dataclass(frozen=True)
class CohortDrift:
    """What the cohort measured at one sync, identical on every rank (out of one all_reduce)."""

    reporters: int      # ranks that moved since the previous sync and have a finite readout
    divergence: float   # RMS over reporters of ||W_i_pre - C|| / ||C||
    steps: float        # mean steps of the reporters since the previous sync


class AdaptiveSync:
    """An adaptive sync period: ``LocalSGDOptimizer(..., sync_every=AdaptiveSync(...))``.

    ``sync_every="auto"`` is ``AdaptiveSync()`` with its defaults. After each sync the next
    period ``K`` is ``n * target / d`` (``n``: steps since the previous sync, ``d``: the cohort's
    RMS divergence at this sync), changed at most ``max_change``-fold per sync and clipped to
    ``[min_every, max_every]`` (the module docstring says why). Warm-up syncs (every step) feed
    it too; the chosen ``K`` applies once warm-up is over.

    Args:
        min_every: the smallest period (>= 1).
        max_every: the largest period (>= min_every).
        target: the relative divergence ``||W_i - C|| / ||C||`` to hold at each sync (> 0, < 1).
            Smaller syncs more often. The default comes from the char-LM study (CONVERGENCE.md).
        initial: the period before the first decision (default: 16, clipped to the bounds).
        max_change: the most ``K`` may grow or shrink at one sync (> 1).

    Example::

        import torch, flodl_opt as flo
        flo.init()
        model = torch.nn.Linear(4, 1)
        auto = flo.AdaptiveSync(min_every=2, max_every=64, target=0.02)
        opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                    sync_every=auto)
        for _ in range(40):
            opt.zero_grad()
            model(torch.randn(8, 4)).square().mean().backward()
            opt.step()
        print(opt.sync_every, opt.last_sync.next_every)   # the period in effect now
    """

    def __init__(self, min_every: int = 2, max_every: int = 256, target: float = 0.02,
                 initial: Optional[int] = None, max_change: float = 2.0):
        _check_int("min_every", min_every, 1)
        _check_int("max_every", max_every, 1)
        if max_every < min_every:
            raise ConfigError(f"AdaptiveSync: max_every ({max_every}) must be >= min_every "
                              f"({min_every}); raise max_every or lower min_every")
        if isinstance(target, bool) or not isinstance(target, (int, float)) or \
                not math.isfinite(target) or not 0.0 < target < 1.0:
            raise ConfigError(f"AdaptiveSync: target is a relative divergence ||W_i - C|| / ||C||, "
                              f"a number in (0, 1) such as 0.02; got {target!r}")
        if isinstance(max_change, bool) or not isinstance(max_change, (int, float)) or \
                not math.isfinite(max_change) or max_change <= 1.0:
            raise ConfigError(f"AdaptiveSync: max_change must be a number > 1 (the most K may "
                              f"grow or shrink at one sync, e.g. 2.0); got {max_change!r}")
        if initial is None:
            initial = min(max(16, min_every), max_every)
        _check_int("initial", initial, 1)
        if not min_every <= initial <= max_every:
            raise ConfigError(f"AdaptiveSync: initial ({initial}) must lie in [min_every, "
                              f"max_every] = [{min_every}, {max_every}]")
        self.min_every, self.max_every = int(min_every), int(max_every)
        self.target, self.max_change = float(target), float(max_change)
        self.initial = int(initial)
        self.every = self.initial     # the period in effect now
        self.decisions = 0            # syncs that updated it

    def next_period(self, drift: CohortDrift) -> int:
        """The next period from the cohort's readout; deterministic in float64, updates ``every``."""
        k = self.every
        if drift.reporters > 0 and drift.divergence > 0.0:
            proposal = drift.steps * self.target / drift.divergence
            lo = max(self.min_every, math.ceil(k / self.max_change))
            hi = min(self.max_every, math.floor(k * self.max_change))
            k = min(hi, max(lo, int(math.floor(proposal + 0.5))))
            self.decisions += 1
        self.every = k
        return k

    def config(self) -> Dict[str, Any]:
        """What must agree across ranks and between a checkpoint and the optimizer loading it."""
        return {"auto": {"min_every": self.min_every, "max_every": self.max_every,
                         "target": self.target, "initial": self.initial,
                         "max_change": self.max_change}}

    def state_dict(self) -> Dict[str, Any]:
        return {"every": self.every, "decisions": self.decisions}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        # A checkpoint of another configuration (strict=False) may hold a K outside these bounds.
        self.every = min(self.max_every, max(self.min_every, int(state["every"])))
        self.decisions = int(state["decisions"])

    def __repr__(self) -> str:
        return (f"AdaptiveSync(min_every={self.min_every}, max_every={self.max_every}, "
                f"target={self.target}, initial={self.initial}, max_change={self.max_change})")


def make_adaptive(sync_every: Any) -> Optional[AdaptiveSync]:
    """``"auto"`` -> default controller, an AdaptiveSync -> itself, an int -> None (fixed K)."""
    if isinstance(sync_every, AdaptiveSync):
        return sync_every
    if isinstance(sync_every, str) and sync_every == "auto":
        return AdaptiveSync()
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ConfigError(f"sync_every must be an int >= 1 (local steps between syncs), 'auto', or "
                          f"a flodl_opt.AdaptiveSync(...); got {sync_every!r}")
    return None


def share_drift(divergence: Optional[float], steps: float, stats: Any, group: Optional[dist.ProcessGroup],
                distributed: bool, device: torch.device, rank: int) -> CohortDrift:
    """One tiny SUM of this rank's readout: the cohort's drift, the same on every rank.

    Only a rank that moved and has a finite readout reports; the others add zeros (a joined or
    non-finite rank has nothing to say about drift, but must still take part in the collective).
    ``stats`` (the SyncStats of the sync that decides) counts the collective and its bytes and
    records the cohort's divergence.
    """
    report = steps > 0 and divergence is not None and math.isfinite(divergence)
    d = float(divergence) if report else 0.0
    buf = torch.tensor([1.0 if report else 0.0, d * d, float(steps) if report else 0.0],
                       dtype=torch.float64, device=device)
    if distributed:
        try:
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        except Exception as exc:  # the consensus itself completed: the params hold it
            raise SyncError(rank, stats.sync, exc, restored=False,
                            state="params hold the completed consensus; only the adaptive "
                                  "period's readout failed") from exc
        stats.collectives += 1
        stats.bytes += DRIFT_BYTES
    reporters, d2, n = buf.tolist()
    drift = CohortDrift(0, 0.0, 0.0) if reporters <= 0 else \
        CohortDrift(int(reporters), math.sqrt(d2 / reporters), n / reporters)
    stats.cohort_divergence = drift.divergence if drift.reporters else None
    return drift


DRIFT_BYTES = 3 * 8  # the share's payload, counted in SyncStats.bytes


def _check_int(name: str, value: Any, lowest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ConfigError(f"AdaptiveSync: {name} must be an int >= {lowest}, got {value!r}")
