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
   reduction of chunk k; the pre-sync copy and the pre-norm ride in the same cache-sized blocks
   as the scale, and the non-finite check reads the consensus instead of making a pass first;
   (the two transports: flodl_opt/transport/float32.py; the pre-sync copy: presync.py);
3. ``readout``: divergence of this rank from the consensus, from the pre-sync copy (on Gloo,
   chunk by chunk while the later chunks are still being reduced).
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError, SyncError
from ..transport.float32 import DEFAULT_GLOO_CHUNK_BYTES, GlooChunks, NcclPremulSum
from .flat import FlatGroup
from .norms import norm, norm_sq, total
from .presync import PresyncCopy
from .stats import SyncStats, Totals, all_nonfinite, gamma_mass, set_readout, warn_nonfinite

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
        self._presync = PresyncCopy()
        # How the float32 sum travels (flodl_opt/transport/float32.py): the Gloo pipeline also
        # fills the pre-sync copy as it goes.
        self.transport = NcclPremulSum(group) if backend == "nccl" else \
            GlooChunks(group, gloo_chunk_bytes, self._presync)
        self.wire = None          # a CompressedWire (flodl_opt/transport/wire.py) replaces the float32 reduce

    # ------------------------------------------------------------------ steps
    def shares(self, steps: int, nonfinite: bool) -> "tuple[float, float]":
        """This rank's ``(mass, mover)``: its work weight, and 1 if it moved; both 0 if non-finite."""
        if nonfinite:
            return 0.0, 0.0
        return gamma_mass(steps, self.gamma), 1.0 if steps > 0 else 0.0

    def weigh(self, stats: SyncStats, totals: Totals, steps: int, nonfinite: bool) -> float:
        """This rank's param weight into ``stats.weight``; returns its float buffers' factor."""
        mass, mover = self.shares(steps, nonfinite)
        stats.weight = mass / totals.mass
        return mover / totals.movers

    def count(self, steps: int, active: bool, nonfinite: bool, sync_number: int = 0) -> Totals:
        """One small SUM of [mass, mover, active, non-finite, steps, sync, sync^2] over the cohort.

        The sync numbers ride along so that ranks which disagree on how many syncs they ran (one
        resumed from another checkpoint, or load_state_dict on some ranks only) all find out from
        the same totals, instead of averaging unrelated points of training silently.
        """
        mass, mover = self.shares(steps, nonfinite)
        c = self._count
        n = float(sync_number)
        c.copy_(torch.tensor([mass, mover, float(active), float(nonfinite), float(steps), n, n * n],
                             dtype=torch.float64))
        if self.distributed:
            dist.all_reduce(c, op=dist.ReduceOp.SUM, group=self.group)
        return Totals(*c.tolist())

    def presync_copy(self) -> None:
        self._presync.take(self.params + self.buffers)

    def restore(self) -> bool:
        """Put the pre-sync values back (the part of each buffer copied so far: the rest is untouched)."""
        if not self.keep_presync:
            return False  # no copy
        return self._presync.restore(self.params + self.buffers)

    def reduce(self, groups: Sequence[FlatGroup], factor: float) -> int:
        """Leave ``sum_i factor_i * X_i`` in every group's flat buffer. Returns collectives issued."""
        if not self.distributed:
            return 0  # a world of one: factor is 1, the buffer already is the consensus
        issued = 0
        for g in groups:
            issued += self.transport.reduce(g, factor)
        return issued

    def _reduce_pipelined(self, stats: SyncStats, totals: "Totals", steps: int, nonfinite: bool,
                          copy_pre: bool, pre_norms: Optional[list], post_norms: list,
                          diff_norms: Optional[list]) -> None:
        """Params (work-weighted) and float buffers (mover-weighted), all chunks in flight at once."""
        buffer_factor = self.weigh(stats, totals, steps, nonfinite)
        works: list = []
        with torch.no_grad():
            for g in self.params:
                self.transport.issue(g, stats.weight, copy_pre, pre_norms, works, True)
            for g in self.buffers:
                self.transport.issue(g, buffer_factor, copy_pre, None, works, False)
            stats.collectives += len(works)
            self.transport.finish(works, post_norms, diff_norms)
        self._presync.is_delta = False
        stats.bytes += sum(g.numel * g.reduce_dtype.itemsize for g in self.params + self.buffers)

    def deltas(self) -> Optional[List[torch.Tensor]]:
        """After a successful sync with a pre-sync copy: ``W_i_pre - C`` per param group."""
        if not self.keep_presync:
            return None
        if not self.distributed:  # a world of one: the consensus is the rank's own weights
            for g in self.params:
                self._presync.buffer(g).zero_()
            self._presync.is_delta = True
        if not self._presync.scratch:
            return None
        return self._presync.deltas(self.params)  # the Gloo path keeps W_i_pre whole until now

    def readout(self, stats: SyncStats, pre_sq: Optional[float]) -> None:
        """Divergence of this rank from the consensus: ||W_i_pre - W|| / ||W||."""
        post = [norm(g.flat) for g in self.params]
        diff = []
        if self.keep_presync and self._presync.scratch:
            for g in self.params:
                s = self._presync.scratch[id(g)]
                s.sub_(g.flat)  # the copy is spent after a successful sync: reuse it in place
                diff.append(norm(s))
            self._presync.is_delta = True
        values = torch.stack(post + diff).tolist() if post else []
        post_sq = sum(v * v for v in values[:len(post)])
        diff_sq = sum(v * v for v in values[len(post):]) if diff else None
        set_readout(stats, pre_sq, post_sq, diff_sq)

    # ------------------------------------------------------------------ the sync
    def run(self, steps: int, sync_number: int, active: bool = True) -> SyncStats:
        """count -> reduce -> readout. Raises SyncError (params restored) if a collective fails."""
        if self.wire is not None and self.distributed:  # compressed differences (flodl_opt/transport/wire.py)
            return self.wire.run(self, steps, sync_number, active)
        if self.backend == "nccl":  # GPUs, a world of one included: the snapshot path, unchanged
            return self._run_nccl(steps, sync_number, active)
        return self._run_pipelined(steps, sync_number, active)

    def _count_checked(self, steps: int, active: bool, nonfinite: bool, sync_number: int) -> Totals:
        totals = self.count(steps, active, nonfinite, sync_number)
        if self.world_size * totals.sync_sq != totals.sync * totals.sync:
            raise ConfigError(
                f"flodl_opt: ranks disagree on the sync number (this is rank {self.rank}'s sync "
                f"#{sync_number}; the cohort's mean is {totals.sync / self.world_size:g}): the ranks "
                "resumed from different checkpoints or state dicts. Load the same checkpoint on "
                "every rank (flo.load_checkpoint does), or call opt.load_state_dict on all of them.")
        return totals

    def _count_or_skip(self, stats: SyncStats, steps: int, active: bool, nonfinite: bool,
                       sync_number: int, t0: float) -> Optional[Totals]:
        """Step 1 of a sync: the totals, or None when the whole cohort is idle (nothing to reduce).

        Every rank sees the same totals, so every rank skips, or raises, alike.
        """
        totals = self._count_checked(steps, active, nonfinite, sync_number)
        self._apply_totals(stats, totals, nonfinite)
        if self.distributed:
            stats.collectives = 1
            stats.bytes = self._count.numel() * self._count.element_size()
        if totals.mass > 0.0:
            return totals
        if totals.nonfinite > 0:
            raise all_nonfinite(totals.nonfinite, self.world_size)
        stats.skipped = True
        stats.ms = (time.perf_counter() - t0) * 1e3
        return None

    def _apply_totals(self, stats: SyncStats, totals: Totals, nonfinite: bool) -> None:
        stats.total_mass, stats.movers, stats.active = totals.mass, int(totals.movers), int(totals.active)
        stats.cohort_steps = int(totals.steps)
        stats.nonfinite = nonfinite
        stats.nonfinite_ranks = int(totals.nonfinite)

    def _warn_nonfinite(self, sync_number: int) -> None:
        warn_nonfinite(self.rank, sync_number)

    @contextlib.contextmanager
    def _restore_on_failure(self, sync_number: int) -> Iterator[None]:
        """Around the collectives: a failure restores the pre-sync tensors, then says so."""
        try:
            yield
        except (ConfigError, FloatingPointError):
            raise  # decided from the shared totals on every rank alike; params untouched/restored
        except Exception as exc:  # a failed collective: put the pre-sync weights back, then say so
            restored = self.restore()
            raise SyncError(self.rank, sync_number, exc, restored) from exc
        except BaseException:  # KeyboardInterrupt mid-reduce: leave nothing half-averaged either
            self.restore()
            raise

    def _run_pipelined(self, steps: int, sync_number: int, active: bool) -> SyncStats:
        """Gloo and a world of one: pre-sync copy, pre-norm and scale fused into the chunk pipeline.

        A moving rank with a pre-sync copy checks for NaN/Inf during the reduce instead of in a
        pass before it: its NaN/Inf would make the consensus non-finite, identically on every
        rank, and then the whole cohort restores, recounts with the true flags and reduces again
        without it (the rare case pays twice; the common case pays nothing). Idle ranks and
        ranks without the copy check up front, as on NCCL.
        """
        t0 = time.perf_counter()
        stats = SyncStats(sync=sync_number, steps=steps)
        # A NaN/Inf float buffer (BatchNorm running_var) would reach every rank: checked up front (small).
        bad_buffers = self.buffers_nonfinite()
        optimistic = self.distributed and self.keep_presync and steps > 0 and not bad_buffers
        self._presync.start()  # nothing copied yet at this sync; the last sync's copy is spent
        pre_sq, nonfinite = None, False
        if not optimistic:
            pre_sq = self._pre_norm_sq()
            nonfinite = bad_buffers or (self.nonfinite_guard and pre_sq is not None and not math.isfinite(pre_sq))
        count_bytes = self._count.numel() * self._count.element_size()
        with self._restore_on_failure(sync_number):
            totals = self._count_or_skip(stats, steps, active, nonfinite, sync_number, t0)
            if totals is None:
                return stats
            if not self.distributed:  # the params already are the consensus
                stats.weight = 1.0
                post_sq = pre_sq if pre_sq is not None else (norm_sq(self.params, self.comm_device.type == "cpu") or 0.0)
                set_readout(stats, pre_sq, post_sq, 0.0 if self.keep_presync else None)
                stats.ms = (time.perf_counter() - t0) * 1e3
                return stats
            # keep_presync=False with nonfinite_guard=False is the lean sync: no readout pass at all.
            lean = not (self.keep_presync or self.nonfinite_guard)
            post, diff = (None if lean else []), ([] if self.keep_presync else None)
            pre = [] if optimistic else None
            self._reduce_pipelined(stats, totals, steps, nonfinite, self.keep_presync, pre, post, diff)
            if optimistic:
                pre_sq = total(pre)
                if self.nonfinite_guard and not math.isfinite(total(post)):
                    # The consensus is bit-identical on every rank, so every rank is here too.
                    nonfinite = not math.isfinite(pre_sq)
                    totals = self._count_checked(steps, active, nonfinite, sync_number)
                    stats.collectives += 1
                    stats.bytes += count_bytes
                    if totals.nonfinite > 0:
                        self.restore()
                        self._apply_totals(stats, totals, nonfinite)
                        if totals.mass <= 0.0:
                            raise all_nonfinite(totals.nonfinite, self.world_size)
                        post, diff = [], []
                        self._reduce_pipelined(stats, totals, steps, nonfinite, True, None, post, diff)
                    else:  # finite everywhere, the sum itself overflowed: as the NCCL path would
                        nonfinite = False
        if nonfinite:
            self._warn_nonfinite(sync_number)
        set_readout(stats, None if nonfinite else pre_sq, None if post is None else total(post),
                          None if diff is None else total(diff))
        stats.ms = (time.perf_counter() - t0) * 1e3
        return stats

    def begin(self, steps: int, sync_number: int) -> "tuple[float, SyncStats, Optional[float], bool]":
        """Start of a one-shot sync: clock, stats, pre-sync norm, non-finite flag, pre-sync copy."""
        t0 = time.perf_counter()
        stats = SyncStats(sync=sync_number, steps=steps)
        pre_sq = self._pre_norm_sq()
        nonfinite = self.buffers_nonfinite() or \
            (self.nonfinite_guard and pre_sq is not None and not math.isfinite(pre_sq))
        if self.keep_presync:
            self.presync_copy()
        return t0, stats, pre_sq, nonfinite

    def reduce_buffers(self, stats: SyncStats, factor: float) -> None:
        """The float buffers in one fused float32 reduce each, scaled by ``factor`` (mover-weighted)."""
        if self.buffers:
            stats.collectives += self.reduce(self.buffers, factor)
            stats.bytes += sum(g.numel * g.reduce_dtype.itemsize for g in self.buffers)

    def run_one_shot(self, steps: int, sync_number: int, active: bool,
                     reduce: Callable[[SyncStats, float], None]) -> SyncStats:
        """begin -> count -> ``reduce(stats, buffer_factor)`` -> readout, restored on failure:
        the NCCL float32 sync and the compressed wire (flodl_opt/transport/wire.py) alike."""
        t0, stats, pre_sq, nonfinite = self.begin(steps, sync_number)
        with self._restore_on_failure(sync_number):
            totals = self._count_or_skip(stats, steps, active, nonfinite, sync_number, t0)
            if totals is None:
                return stats
            buffer_factor = self.weigh(stats, totals, steps, nonfinite)
            with torch.no_grad():
                reduce(stats, buffer_factor)
        if nonfinite:
            warn_nonfinite(self.rank, sync_number)  # from here: the warning names the caller of step()/sync()
        self.readout(stats, None if nonfinite else pre_sq)
        stats.ms = (time.perf_counter() - t0) * 1e3
        return stats

    def _run_nccl(self, steps: int, sync_number: int, active: bool) -> SyncStats:
        return self.run_one_shot(steps, sync_number, active, self._reduce_float32)

    def _reduce_float32(self, stats: SyncStats, buffer_factor: float) -> None:
        """NCCL: one PREMUL_SUM per buffer (the pre-norm and pre-sync copy were taken by ``begin``)."""
        stats.collectives += self.reduce(self.params, stats.weight)
        self.reduce_buffers(stats, buffer_factor)
        stats.bytes += sum(g.numel * g.reduce_dtype.itemsize for g in self.params)

    def buffers_nonfinite(self) -> bool:
        """Any NaN/Inf in this rank's float buffers (one host read; buffers are small)."""
        if not (self.nonfinite_guard and self.buffers):
            return False
        return not bool(torch.stack([torch.isfinite(g.flat).all() for g in self.buffers]).all())

    def _pre_norm_sq(self) -> Optional[float]:
        """||W_i||^2 before the sync: the readout's pre-norm and the non-finite guard in one pass."""
        if not self.params or not (self.nonfinite_guard or self.keep_presync):
            return None
        return norm_sq(self.params, self.comm_device.type == "cpu")
