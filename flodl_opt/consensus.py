"""The consensus collective: every rank ends with the work-weighted average of all ranks' weights.

Per rank i with ``n_i`` optimizer steps since the last sync:

* params:  ``W <- sum_i m_i W_i / sum_j m_j`` with ``m_i = n_i ** gamma`` (0 when ``n_i == 0``);
* float buffers (BatchNorm running stats): equal weight among the ranks that moved;
* integer buffers are never handed to this module (they stay local);
* whole cohort idle: nothing changes, on every rank alike.

The sequence is the same on every rank, so nobody waits on a collective that a peer skipped:

1. ``count``: one tiny SUM of ``[mass, mover, active, non-finite, steps]`` gives the totals;
2. ``reduce``: per flat buffer, ONE in-place collective that leaves the weighted average in it.
   NCCL premultiplies inside the collective (``PREMUL_SUM``, the factor a device tensor);
   Gloo scales locally then SUMs, chunk by chunk, so the scale of chunk k+1 overlaps the
   reduction of chunk k;
3. ``readout``: divergence of this rank from the consensus, from the pre-sync copy.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .errors import ConfigError, NonFiniteError, NonFiniteWarning, SyncError
from .flat import FlatGroup

DEFAULT_GLOO_CHUNK_BYTES = 8 << 20


def _norm(t: torch.Tensor) -> torch.Tensor:
    # float32 accumulation without a float64 copy of the whole buffer; narrow dtypes upcast.
    if t.dtype in (torch.float32, torch.float64):
        return torch.linalg.vector_norm(t).double()
    return torch.linalg.vector_norm(t, dtype=torch.float32).double()


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


class Consensus:
    """Runs the count / reduce / readout sequence over fixed flat buffers.

    Args:
        params: flat parameter buffers (work-weighted).
        buffers: flat float buffers (mover-weighted).
        group: process group, or ``None`` for a world of one (no collectives at all).
        gamma: work-weighting exponent.
        keep_presync: keep a pre-sync copy of params and buffers: restores them if a collective
            fails, and gives the divergence readout. Costs one copy of the synced bytes.
        nonfinite_guard: a rank whose params are NaN/Inf gets zero weight and adopts the consensus.
    """

    def __init__(self, params: Sequence[FlatGroup], buffers: Sequence[FlatGroup],
                 group: Optional[dist.ProcessGroup], world_size: int, rank: int, backend: str,
                 gamma: float = 1.0, keep_presync: bool = True, nonfinite_guard: bool = True,
                 gloo_chunk_bytes: int = DEFAULT_GLOO_CHUNK_BYTES):
        self.params, self.buffers = list(params), list(buffers)
        self.group, self.world_size, self.rank = group, world_size, rank
        self.backend, self.gamma = backend, gamma
        self.keep_presync, self.nonfinite_guard = keep_presync, nonfinite_guard
        self.gloo_chunk_bytes = gloo_chunk_bytes
        self.distributed = world_size > 1
        dev = self.params[0].device if self.params else torch.device("cpu")
        self.comm_device = dev if backend == "nccl" else torch.device("cpu")
        self._count = torch.zeros(7, dtype=torch.float64, device=self.comm_device)
        self._factors = {}  # (device, dtype) -> 1-element device tensor for PREMUL_SUM
        self._scratch: dict = {}  # id(group) -> pre-sync copy

    # ------------------------------------------------------------------ steps
    def count(self, steps: int, active: bool, nonfinite: bool, sync_number: int = 0) -> Totals:
        """One small SUM of [mass, mover, active, non-finite, steps, sync, sync^2] over the cohort.

        The sync numbers ride along so that ranks which disagree on how many syncs they ran (one
        resumed from another checkpoint, or load_state_dict on some ranks only) all find out from
        the same totals, instead of averaging unrelated points of training silently.
        """
        mass = 0.0 if nonfinite else gamma_mass(steps, self.gamma)
        mover = 1.0 if (steps > 0 and not nonfinite) else 0.0
        c = self._count
        n = float(sync_number)
        c.copy_(torch.tensor([mass, mover, float(active), float(nonfinite), float(steps), n, n * n],
                             dtype=torch.float64))
        if self.distributed:
            dist.all_reduce(c, op=dist.ReduceOp.SUM, group=self.group)
        return Totals(*c.tolist())

    def presync_copy(self) -> None:
        for g in self.params + self.buffers:
            s = self._scratch.get(id(g))
            if s is None:
                s = self._scratch[id(g)] = torch.empty_like(g.flat)
            s.copy_(g.flat)

    def restore(self) -> bool:
        if not self._scratch:
            return False
        with torch.no_grad():
            for g in self.params + self.buffers:
                s = self._scratch.get(id(g))
                if s is not None:
                    g.flat.copy_(s)
        return True

    def reduce(self, groups: Sequence[FlatGroup], factor: float) -> int:
        """Leave ``sum_i factor_i * X_i`` in every group's flat buffer. Returns collectives issued."""
        if not self.distributed:
            return 0  # a world of one: factor is 1, the buffer already is the consensus
        issued = 0
        for g in groups:
            if self.backend == "nccl":
                issued += self._reduce_nccl(g, factor)
            else:
                issued += self._reduce_gloo(g, factor)
        return issued

    def _reduce_nccl(self, g: FlatGroup, factor: float) -> int:
        # Only groups of two or more get here (``distributed``): NCCL 2.28's one-rank PREMUL_SUM
        # leaves a few elements of some buffer sizes unscaled (seen on an H200, GPU_NOTES.md).
        buf = g.staging()
        if not g.wide:
            buf.copy_(g.flat)
        key = (buf.device, buf.dtype)
        f = self._factors.get(key)
        if f is None:
            f = self._factors[key] = torch.empty((), dtype=buf.dtype, device=buf.device)
        f.fill_(factor)  # a kernel with the scalar as argument: no host sync
        if factor == 0.0:
            buf.zero_()  # 0 * NaN is NaN: a non-finite rank must contribute exact zeros
        op = dist._make_nccl_premul_sum(f)
        dist.all_reduce(buf, op=op, group=self.group)
        if not g.wide:
            g.flat.copy_(buf)
        return 1

    def _reduce_gloo(self, g: FlatGroup, factor: float) -> int:
        buf = g.staging()
        step = max(1, self.gloo_chunk_bytes // buf.element_size())
        works = []
        for start in range(0, g.numel, step):
            src = g.flat[start:start + step]
            dst = buf[start:start + step]
            if factor == 0.0:
                dst.zero_()
            elif g.wide:
                if factor != 1.0:
                    dst.mul_(factor)
            else:
                dst.copy_(src).mul_(factor)
            # Async: the scale of the next chunk runs while Gloo reduces this one.
            works.append(dist.all_reduce(dst, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        for w in works:
            w.wait()
        if not g.wide:
            g.flat.copy_(buf)
        return len(works)

    def deltas(self) -> Optional[List[torch.Tensor]]:
        """After a successful sync with a pre-sync copy: ``W_i_pre - C`` per param group."""
        if not (self.keep_presync and self._scratch):
            return None
        return [self._scratch[id(g)] for g in self.params]

    def readout(self, stats: SyncStats, pre_sq: Optional[float]) -> None:
        """Divergence of this rank from the consensus: ||W_i_pre - W|| / ||W||."""
        post = [_norm(g.flat) for g in self.params]
        diff = []
        if self.keep_presync and self._scratch:
            for g in self.params:
                s = self._scratch[id(g)]
                s.sub_(g.flat)  # the copy is spent after a successful sync: reuse it in place
                diff.append(_norm(s))
        values = torch.stack(post + diff).tolist() if post else []
        post_sq = sum(v * v for v in values[:len(post)])
        stats.post_norm = math.sqrt(post_sq)
        if pre_sq is not None:
            stats.pre_norm = math.sqrt(pre_sq)
        if diff:
            diff_sq = sum(v * v for v in values[len(post):])
            stats.divergence = math.sqrt(diff_sq) / stats.post_norm if stats.post_norm > 1e-12 else 0.0

    # ------------------------------------------------------------------ the sync
    def run(self, steps: int, sync_number: int, active: bool = True) -> SyncStats:
        """count -> reduce -> readout. Raises SyncError (params restored) if a collective fails."""
        t0 = time.perf_counter()
        stats = SyncStats(sync=sync_number, steps=steps)
        pre_sq = self._pre_norm_sq()
        nonfinite = self.nonfinite_guard and pre_sq is not None and not math.isfinite(pre_sq)
        if self.keep_presync:
            self.presync_copy()
        try:
            totals = self.count(steps, active, nonfinite, sync_number)
            if self.world_size * totals.sync_sq != totals.sync * totals.sync:
                raise ConfigError(
                    f"flodl_opt: ranks disagree on the sync number (this is rank {self.rank}'s sync "
                    f"#{sync_number}; the cohort's mean is {totals.sync / self.world_size:g}): the ranks "
                    "resumed from different checkpoints or state dicts. Load the same checkpoint on "
                    "every rank (flo.load_checkpoint does), or call opt.load_state_dict on all of them.")
            stats.total_mass, stats.movers, stats.active = totals.mass, int(totals.movers), int(totals.active)
            stats.cohort_steps = int(totals.steps)
            stats.nonfinite = nonfinite
            stats.nonfinite_ranks = int(totals.nonfinite)
            stats.collectives = 1 if self.distributed else 0
            stats.bytes = self._count.numel() * self._count.element_size() if self.distributed else 0
            if totals.mass <= 0.0:
                if totals.nonfinite > 0:
                    raise NonFiniteError(
                        f"every rank that moved has non-finite params ({int(totals.nonfinite)} of "
                        f"{self.world_size}); refusing to average garbage. Lower the learning rate, "
                        "enable max_grad_norm, or resume from the last checkpoint.")
                stats.skipped = True
                stats.ms = (time.perf_counter() - t0) * 1e3
                return stats
            mass = 0.0 if nonfinite else gamma_mass(steps, self.gamma)
            stats.weight = mass / totals.mass
            with torch.no_grad():
                stats.collectives += self.reduce(self.params, stats.weight)
                if self.buffers:
                    mover = 0.0 if (nonfinite or steps <= 0) else 1.0
                    stats.collectives += self.reduce(self.buffers, mover / totals.movers)
            if self.distributed:
                stats.bytes += sum(g.numel * g.reduce_dtype.itemsize for g in self.params + self.buffers)
        except (ConfigError, FloatingPointError):
            raise  # decided from the shared totals, before any tensor changed, on every rank alike
        except Exception as exc:  # a failed collective: put the pre-sync weights back, then say so
            restored = self.restore()
            raise SyncError(self.rank, sync_number, exc, restored) from exc
        except BaseException:  # KeyboardInterrupt mid-reduce: leave nothing half-averaged either
            self.restore()
            raise
        if nonfinite:
            warnings.warn(f"flodl_opt: rank {self.rank}'s params were NaN/Inf at sync #{sync_number}: "
                          "it got no vote and adopted the consensus of the other ranks. Lower the "
                          "learning rate or set max_grad_norm if this repeats.",
                          NonFiniteWarning, stacklevel=3)
        self.readout(stats, None if nonfinite else pre_sq)
        stats.ms = (time.perf_counter() - t0) * 1e3
        return stats

    def _pre_norm_sq(self) -> Optional[float]:
        """||W_i||^2 before the sync: the readout's pre-norm and the non-finite guard in one pass."""
        if not self.params or not (self.nonfinite_guard or self.keep_presync):
            return None
        norms = [_norm(g.flat) for g in self.params]
        return float(sum(v * v for v in torch.stack(norms).tolist()))
