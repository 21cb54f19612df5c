"""What one sync tells: the per-rank metrics (``opt.last_sync``) and the count's totals."""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Optional

from ..errors import NonFiniteError, NonFiniteWarning


def warn_nonfinite(rank: int, sync_number: int) -> None:
    """The rank that had NaN/Inf says so (every sync mode, the same words)."""
    warnings.warn(f"flodl_opt: rank {rank}'s params or float buffers were NaN/Inf at sync #{sync_number}: "
                  "it got no vote and adopted the consensus of the other ranks. Lower the "
                  "learning rate or set max_grad_norm if this repeats.",
                  NonFiniteWarning, stacklevel=5)


def all_nonfinite(ranks: float, world_size: int, where: str = "") -> NonFiniteError:
    """The refusal when every rank that moved has NaN/Inf (decided from the shared totals)."""
    return NonFiniteError(
        f"every rank that moved has non-finite params{where} ({int(ranks)} of {world_size}); "
        "refusing to average garbage. Lower the learning rate, enable max_grad_norm, or resume "
        "from the last checkpoint.")


def gamma_mass(n: int, gamma: float) -> float:
    """Work mass of a rank that did ``n`` steps: an idle rank has no vote for any gamma."""
    return 0.0 if n <= 0 else float(n) ** gamma


@dataclass
class SyncStats:
    """Metrics of one sync, as seen by this rank (``opt.last_sync``)."""

    sync: int = 0                  # 1-based number of this sync
    steps: int = 0                 # this rank's optimizer steps since the previous sync
    cohort_steps: int = 0          # all ranks' steps since the previous sync
    weight: float = 0.0            # this rank's share of the param consensus
    total_mass: float = 0.0        # sum of all ranks' work mass
    movers: int = 0                # ranks that did at least one step
    active: int = 0                # ranks not yet joined (uneven data)
    skipped: bool = False          # whole cohort idle: nothing was reduced
    nonfinite: bool = False        # this rank's params were NaN/Inf and got no vote
    nonfinite_ranks: int = 0       # ranks whose params were NaN/Inf at this sync
    divergence: Optional[float] = None   # ||W_i_pre - W|| / ||W||
    pre_norm: Optional[float] = None     # ||W_i_pre||
    post_norm: Optional[float] = None    # ||W||
    ms: float = 0.0                # wall time of the sync on this rank
    bytes: int = 0                 # bytes this rank handed to collectives
    collectives: int = 0           # collectives issued
    outer: Optional[str] = None    # outer step applied, if any
    fragment: Optional[int] = None  # streaming syncs: the fragment synced (flodl_opt/sync/streaming.py)
    next_every: Optional[int] = None     # K: local steps until the next sync (after warm-up)
    cohort_divergence: Optional[float] = None  # sync_every="auto": RMS divergence of the cohort

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Totals:
    mass: float
    movers: float
    active: float
    nonfinite: float
    steps: float
    sync: float = 0.0       # sum of the ranks' sync numbers
    sync_sq: float = 0.0    # sum of their squares: all equal iff world * sync_sq == sync ** 2


def set_readout(stats: SyncStats, pre_sq: Optional[float], post_sq: Optional[float],
                diff_sq: Optional[float]) -> None:
    """The readout from squared norms: ``||W_i_pre||``, ``||W||`` and ``||W_i_pre - W|| / ||W||``."""
    if post_sq is None:
        return
    stats.post_norm = math.sqrt(post_sq)
    if pre_sq is not None:
        stats.pre_norm = math.sqrt(pre_sq)
    if diff_sq is not None:
        stats.divergence = math.sqrt(diff_sq) / stats.post_norm if stats.post_norm > 1e-12 else 0.0
