"""When each fragment syncs: the step counter and the config decide, never timing, so every rank
issues the same collectives in the same order."""
from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

from ..errors import ConfigError
from ..hooks.adaptive import AdaptiveSync
from .stats import SyncStats


class Schedule:
    """Which fragment is issued at step ``t`` and when it is merged: config and counter only.

    Fragment ``p`` is issued at every step ``t >= 1`` with ``t % K == p * K/P`` and merged
    ``tau`` steps later (in the same ``step()`` when ``tau == 0``).
    """

    def __init__(self, sync_every: int, fragments: int, overlap_steps: int):
        if sync_every % fragments:
            raise ConfigError(f"sync_every={sync_every} must be a multiple of fragments={fragments} "
                              "(fragment p is synced at offset p*sync_every/fragments)")
        self.period, self.parts, self.tau = sync_every, fragments, overlap_steps
        self.stride = sync_every // fragments
        if not 0 <= overlap_steps < self.stride:
            raise ConfigError(f"overlap_steps={overlap_steps} must be >= 0 and < sync_every/fragments "
                              f"= {self.stride} (one fragment in flight at a time)")

    def issue_at(self, t: int) -> Optional[int]:
        if t < 1:
            return None
        r = t % self.period
        return r // self.stride if r % self.stride == 0 else None

    def offset(self, p: int) -> int:
        return p * self.stride


class RoundSchedule(Schedule):
    """``sync_every="auto"``: a :class:`Schedule` whose period may change once per round.

    A round ends when fragment 0 is issued (its offset is K: fragments 1..P-1 go first). The next
    round starts at that step, with the period decided at fragment 0's merge, ``tau`` steps later
    and so before the round's first issue (``tau < K'/P``): every offset is ``p*K'/P`` of the new
    period, counted from the round's start. With a fixed period it issues exactly as Schedule.
    """

    def __init__(self, sync_every: int, fragments: int, overlap_steps: int):
        super().__init__(sync_every, fragments, overlap_steps)
        self.origin = 0  # the step the current round started at
        self.readouts: List[Tuple[float, float, int]] = []  # (diff^2, post^2, steps) per merge

    def issue_at(self, t: int) -> Optional[int]:
        r = t - self.origin
        if r < 1 or r % self.stride:
            return None
        return (r // self.stride) % self.parts

    def set_period(self, k: int) -> None:
        Schedule.__init__(self, k, self.parts, self.tau)  # the same checks: K % P == 0, tau < K/P

    def keep(self, done: List[SyncStats]) -> Optional[SyncStats]:
        """Keep the round's readouts; returns fragment 0's stats when they close the round."""
        for st in done:
            if not st.skipped and st.divergence is not None and st.post_norm is not None and \
                    math.isfinite(st.divergence):
                self.readouts.append(((st.divergence * st.post_norm) ** 2, st.post_norm ** 2, st.steps))
        return next((st for st in done if st.fragment == 0), None)

    def round_drift(self) -> Tuple[Optional[float], float]:
        """The whole model's divergence over the round (the sum of the fragments' squares) and the
        mean steps per merge; the readouts start over."""
        r = self.readouts
        diff, post = sum(x[0] for x in r), sum(x[1] for x in r)
        steps = sum(x[2] for x in r) / len(r) if r else 0
        self.readouts = []
        return (math.sqrt(diff / post) if post > 0.0 else None), steps

    def next_round(self, auto: AdaptiveSync, drift: Any) -> None:
        """The next round's period, from the cohort's drift (the same numbers on every rank)."""
        k = round_period(auto.next_period(drift), auto, self.parts, self.tau)
        auto.every = k
        self.set_period(k)


def round_period(k: int, auto: AdaptiveSync, fragments: int, overlap_steps: int) -> int:
    """The nearest period the fragment schedule can run: a multiple of P with ``tau < K/P``,
    within the controller's bounds (rounded inwards to multiples of P)."""
    lo = max(fragments * (overlap_steps + 1), -(-auto.min_every // fragments) * fragments)
    hi = (auto.max_every // fragments) * fragments
    if hi < lo:
        raise ConfigError(
            f"flodl_opt: sync_every={auto!r} with fragments={fragments}, overlap_steps={overlap_steps} "
            f"needs periods that are multiples of {fragments} and at least {lo} (overlap_steps < "
            f"K/fragments), but max_every={auto.max_every}: raise max_every to >= {lo}, or use fewer "
            "fragments or overlap steps")
    return min(hi, max(lo, fragments * int(math.floor(k / fragments + 0.5))))
