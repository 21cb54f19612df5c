"""Streaming syncs: the model synced a fragment at a time, each sync optionally hidden behind training.

``LocalSGDOptimizer(..., fragments=P, overlap_steps=tau)`` hands its syncs to :class:`StreamingSync`:

* **Fragments.** The synced tensors are split, in layer order and on tensor boundaries, into ``P``
  contiguous fragments of about equal bytes (float buffers are split the same way, on their own).
  Fragment ``p`` is synced every ``K = sync_every`` steps, at the steps ``t`` with
  ``t % K == p * K/P`` (``K % P == 0`` is required), so one sync moves ~1/P of the bytes and the
  peak bandwidth drops by ``P``. Each fragment keeps its own work count (the steps since *its*
  last sync) and its own outer state: slices of the outer optimizer's flat anchor and momentum.
* **Overlap.** At its step the fragment is copied into a send snapshot (the live weights keep
  training), scaled by this rank's work mass and handed to asynchronous collectives (Gloo
  ``async_op``; NCCL runs them on its own stream, ordered after the inner step by stream order).
  Training goes on for ``tau`` steps; then the result is waited for and merged.
* **The merge** (delayed update): with ``S`` the snapshot sent, ``C`` the consensus of the
  snapshots, ``G = outer(C)`` (DiLoCo/SlowMo step on the fragment's anchor and momentum, or
  ``G = C``) and ``W`` the local weights now, ``W <- G + (W - S)``. The ``tau`` local steps made
  during the flight are kept, on top of the new global point, as if the sync had happened
  instantly and the same steps were taken after it. Streaming DiLoCo's mix
  ``(1 - alpha) G + alpha W`` instead throws away ``1 - alpha`` of those steps and pulls the
  fragment ``alpha`` of the way back to its stale local point; the delayed update keeps every
  step and with ``tau = 0`` is exactly the blocking sync (``W = S``, so ``W <- G``).
* Everything (fragments, offsets, issue and merge steps) follows from the config and the step
  counter, never from timing, so every rank issues the same collectives in the same order.

At most one fragment is in flight (``tau < K/P``). ``drain()`` waits for it without merging, so a
checkpoint taken mid-flight saves the reduced result and the merge happens at the same step after
a resume (bit-exact). A collective that fails leaves the live weights as they were (nothing of the
failed consensus is written), gives the fragment its steps back and raises ``SyncError``.

Example (2 ranks, ``torchrun --nproc-per-node 2 train.py``)::

    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model,
                                sync_every=16, outer="diloco", fragments=4, overlap_steps=2)
    for x, y in batches:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    opt.sync()   # drain, then sync every fragment: the ranks end identical
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, ContextManager, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError, SyncError
from ..hooks.adaptive import AdaptiveSync, share_drift
from ..hooks.outer import DiLoCo, OuterAvg, OuterOptimizer, SlowMo
from ..transport.codecs import Codec
from ..transport.stream_wire import FragmentWire
from .flat import FlatGroup
from .fragments import Fragment, outer_slices, split_fragments
from .norms import total
from .passes import apply_pass, consensus_pass, snapshot_pass
from .schedule import RoundSchedule, Schedule
from .stats import SyncStats, all_nonfinite, gamma_mass, set_readout, warn_nonfinite
from .stream_state import Flight, StreamCheckpoint


class _Proxy:
    """What OuterOptimizer.step needs of a flat group (``flat``, ``numel``, ``device``)."""

    def __init__(self, flat: torch.Tensor):
        self.flat, self.numel, self.device = flat, flat.numel(), flat.device


def check_outer(outer: OuterOptimizer) -> None:
    """The outer optimizers that work on slices of their flat state (block-local updates)."""
    elementwise = type(outer).step in (OuterOptimizer.step, SlowMo.step, OuterAvg.step)
    if not isinstance(outer, (OuterAvg, DiLoCo, SlowMo)) and not (elementwise and not outer.needs_deltas):
        raise ConfigError(f"fragments/overlap_steps work with outer=None/'avg', 'diloco' or 'slowmo' "
                          f"(per-fragment slices of the outer state); outer={outer.name!r} is not "
                          "supported with them: use fragments=1, overlap_steps=0")
    if outer.needs_deltas:
        raise ConfigError(f"outer={outer.name!r} needs W_i - C per rank; not supported with "
                          "fragments/overlap_steps")
    if outer.resets_inner:
        raise ConfigError("DiLoCo(reset_inner=True) clears the whole inner state at every outer step; "
                          "with fragments/overlap_steps each fragment steps on its own: use "
                          "reset_inner=False")


class StreamingSync(StreamCheckpoint):
    """Issues, waits for and merges fragment syncs on the schedule. Used by LocalSGDOptimizer.

    One interface: ``on_step(worked, active)`` at every step (issue / merge when due),
    ``drain()`` (wait for what is in flight, merge nothing), ``sync_all(active)`` (drain, merge,
    then a blocking sync of every fragment), ``state_dict()`` / ``load_state_dict()``.

    Example (what LocalSGDOptimizer does; ``groups`` are its flat param groups)::

        stream = StreamingSync(groups, params, [], [], outer, sync_every=16, fragments=4,
                               overlap_steps=2, group=None, world_size=1, rank=0, backend="gloo")
        for t in range(32):
            ...  # inner step
            for stats in stream.on_step(worked=True, active=True):
                print(stats.fragment, stats.sync)
    """

    def __init__(self, param_groups: Sequence[FlatGroup], params: Sequence[torch.Tensor],
                 buffer_groups: Sequence[FlatGroup], buffers: Sequence[torch.Tensor],
                 outer: OuterOptimizer, sync_every: int, fragments: int, overlap_steps: int,
                 group: Optional[dist.ProcessGroup], world_size: int, rank: int, backend: str,
                 gamma: float = 1.0, nonfinite_guard: bool = True, readout: bool = True,
                 gloo_chunk_bytes: int = 64 << 20,
                 inner_lr: Callable[[], float] = lambda: 0.0,
                 on_nonfinite: Optional[Callable[[int], None]] = None,
                 waiting: Optional[Callable[[int], ContextManager]] = None,
                 auto: Optional[AdaptiveSync] = None, codec: Optional[Codec] = None,
                 error_feedback: bool = False):
        check_outer(outer)
        # a world of one sends nothing: the float32 path (the params already are the consensus)
        self.codec = codec if world_size > 1 else None
        self.error_feedback = error_feedback
        self.wire: Optional[FragmentWire] = None  # built with the outer state (setup_outer)
        # auto: the period changes at round boundaries, decided from the round's fragment readouts
        self.auto = auto
        self.schedule = Schedule(sync_every, fragments, overlap_steps) if auto is None else \
            RoundSchedule(sync_every, fragments, overlap_steps)
        self.param_groups, self.buffer_groups = list(param_groups), list(buffer_groups)
        self.fragments = split_fragments(param_groups, params, buffer_groups, buffers, fragments)
        self.outer = outer
        self.group, self.world_size, self.rank, self.backend = group, world_size, rank, backend
        self.distributed = world_size > 1
        self.gamma, self.nonfinite_guard, self.readout = gamma, nonfinite_guard, readout
        self.gloo_chunk_bytes = gloo_chunk_bytes
        self.inner_lr, self.on_nonfinite = inner_lr, on_nonfinite
        # every wait on the cohort runs inside this (the optimizer's stall watchdog)
        self.waiting = waiting if waiting is not None else (lambda sync: contextlib.nullcontext())
        dev = param_groups[0].device if param_groups else torch.device("cpu")
        self.comm_device = dev if backend == "nccl" else torch.device("cpu")
        # Persistent per-fragment buffers (float32 for narrow dtypes): ``sent`` the snapshot,
        # ``buf`` what is reduced. Both 1/P of the synced bytes; allocated once.
        self._sent: List[List[torch.Tensor]] = []
        self._buf: List[List[torch.Tensor]] = []
        for f in self.fragments:
            lives = self._live(f)
            self._sent.append([torch.empty(v.numel(), dtype=_rdt(v), device=v.device) for v in lives])
            self._buf.append([torch.empty(v.numel(), dtype=_rdt(v), device=v.device) for v in lives])
        self._outers: List[OuterOptimizer] = []
        self.clock = 0                               # steps of the schedule (a joined rank ticks too)
        self.since = [0] * fragments                 # real steps since each fragment's last issue
        self.syncs = 0                               # fragment syncs merged
        self.pending: Optional[Flight] = None

    def setup_outer(self) -> None:
        """Per-fragment views of the outer state (call after ``outer.setup``)."""
        self._outers = outer_slices(self.outer, self.fragments)
        if self.codec is not None:  # anchors: the outer optimizer's slices, or own copies (plain averaging)
            lives = [self._live(f)[:len(f.params)] for f in self.fragments]
            anchors = [o.anchor if self.outer.needs_anchor else None for o in self._outers]
            self.wire = FragmentWire(self.codec, self.error_feedback, lives, anchors, self.world_size,
                                     self.rank, self.group)

    # -------------------------------------------------------------- views
    def _live(self, f: Fragment) -> List[torch.Tensor]:
        return [self.param_groups[s.index].flat[s.start:s.end] for s in f.params] + \
               [self.buffer_groups[s.index].flat[s.start:s.end] for s in f.buffers]

    # -------------------------------------------------------------- the interface
    def due(self, t: int) -> bool:
        """Whether tick ``t`` issues or merges a fragment (the optimizer checks the model first)."""
        return self.schedule.issue_at(t) is not None or (self.pending is not None and t >= self.pending.merge_at)

    def on_step(self, worked: bool, active: bool) -> List[SyncStats]:
        """One tick of the schedule after an inner step (``worked``) or a joined rank's idle tick."""
        self.clock += 1
        if worked:
            self.since = [n + 1 for n in self.since]
            if self.pending is not None:
                self.pending.local_steps += 1
        out: List[SyncStats] = []
        f = self.pending
        if f is not None and self.wire is not None and f.phase == 1 and self.clock >= f.gather_at \
                and self.clock < f.merge_at:
            self._gather(f)
        if self.pending is not None and self.clock >= self.pending.merge_at:
            out += self._merge_checked()
        p = self.schedule.issue_at(self.clock)
        if p is not None:
            self._issue(p, active)
            if self.auto is not None and p == 0:
                self.schedule.origin = self.clock  # fragment 0 closes the round: the next starts here
            if self.schedule.tau == 0:
                out += self._merge_checked()
        if self.auto is not None and out:
            self._observe(out)
        return out

    # -------------------------------------------------------------- sync_every="auto"
    def _observe(self, done: List[SyncStats]) -> None:
        """Keep this round's readouts; at fragment 0's merge, choose the next round's period from
        the blocking rule's one tiny SUM, so every rank picks the same period from the same numbers."""
        closing = self.schedule.keep(done)
        if closing is not None:
            mine, steps = self.schedule.round_drift()
            with self.waiting(closing.sync):
                drift = share_drift(mine, steps, closing, self.group, self.distributed, self.comm_device,
                                    self.rank)
            self.schedule.next_round(self.auto, drift)
        for st in done:
            st.next_every = self.schedule.period

    def drain(self) -> None:
        """Wait for the collectives in flight; the merge stays at its scheduled step."""
        f = self.pending
        if f is None or f.done:
            return
        try:
            f.wait(self.waiting)
        except Exception as exc:
            self._fail(f, exc)

    def sync_all(self, active: bool, warmup: bool = False) -> List[SyncStats]:
        """Merge what is in flight now, then sync every fragment, blocking: ranks end identical.

        ``warmup``: a warm-up sync (every step for the first N): plain averaging, after which each
        fragment's outer anchor is the consensus, as a blocking warm-up sync rebases the outer optimizer."""
        out: List[SyncStats] = []
        if self.pending is not None:
            out += self._merge_checked()
        for p in range(len(self.fragments)):
            self._issue(p, active)
            out += self._merge_checked(recover=False, plain=warmup)
        return out

    def count_step(self) -> None:
        """A warm-up step: it counts as work for every fragment; the schedule starts after warm-up."""
        self.since = [n + 1 for n in self.since]

    # -------------------------------------------------------------- issue
    def _issue(self, p: int, active: bool) -> None:
        t0 = time.perf_counter()
        frag = self.fragments[p]
        steps = self.since[p]
        self.since[p] = 0
        mass = gamma_mass(steps, self.gamma)
        mover = 1.0 if steps > 0 else 0.0
        n_params = len(frag.params)
        sent, buf, lives = self._sent[p], self._buf[p], self._live(frag)
        with torch.no_grad():
            pre_sq = snapshot_pass(lives, sent, buf, n_params, mass, mover, wired=self.wire is not None)
            # a NaN/Inf float buffer (BatchNorm running_var) would reach every rank too
            bad_buffers = self.nonfinite_guard and any(not bool(torch.isfinite(v).all()) for v in lives[n_params:])
            nonfinite = self.nonfinite_guard and (not math.isfinite(pre_sq) or bad_buffers)
            if nonfinite:  # no vote: exact zeros (0 * NaN is NaN)
                mass = mover = 0.0
                for b in buf:
                    b.zero_()
            number = self.syncs + 1
            count = torch.tensor([mass, mover, float(active), float(nonfinite), float(steps),
                                  float(number), float(number) ** 2], dtype=torch.float64,
                                 device=self.comm_device)
        tau = self.schedule.tau
        flight = Flight(p, number, self.clock, self.clock + tau, steps, nonfinite, pre_sq,
                         count, [], 0.0, active=active, gather_at=self.clock + (1 if tau >= 2 else tau))
        self.pending = flight
        if self.distributed:
            try:
                flight.works.append(dist.all_reduce(count, op=dist.ReduceOp.SUM, group=self.group,
                                                    async_op=True))
                if self.wire is not None:
                    self.wire.issue(p, sent[:n_params], mass, flight.works)
                for b in (buf[n_params:] if self.wire is not None else buf):
                    step = b.numel() if self.backend == "nccl" else \
                        max(1, self.gloo_chunk_bytes // b.element_size())
                    for i in range(0, b.numel(), step):
                        flight.works.append(dist.all_reduce(b[i:i + step], op=dist.ReduceOp.SUM,
                                                            group=self.group, async_op=True))
            except Exception as exc:
                self._fail(flight, exc)
            flight.collectives = len(flight.works)
        else:
            flight.done = True
        flight.t_issue_ms = (time.perf_counter() - t0) * 1e3

    # -------------------------------------------------------------- wait / merge
    def _fail(self, f: Flight, exc: BaseException) -> None:
        # The live weights were never written: they are the pre-merge values. Give the steps back.
        self.pending = None
        self.since[f.fragment] += f.steps
        raise SyncError(self.rank, f.sync, exc, True) from exc

    def _merge_checked(self, recover: bool = True, plain: bool = False) -> List[SyncStats]:
        f_active = self.pending.active if self.pending is not None else True
        stats = self._merge(plain)
        out = [stats]
        if recover and stats.nonfinite_ranks > 0:
            # A rank that went NaN/Inf is NaN everywhere after its next backward: one fragment
            # adopted alone would be re-poisoned. The totals are the same on every rank, so every
            # rank runs this blocking recovery sync of all fragments alike.
            out += self.sync_all(active=f_active)
        return out

    def _gather(self, f: Flight) -> None:
        """Compressed wire, phase 2: the all_to_all and the count waited for, start the all_gather."""
        try:
            if not f.done:
                f.wait(self.waiting)
            f.phase = 2
            mass = float(f.count[0])   # the cohort's total, the same on every rank
            if mass > 0.0:  # else nothing is gathered, on every rank alike
                f.works, f.done = [], False
                self.wire.gather(f.fragment, mass, f.works)
                f.collectives += len(f.works)
        except Exception as exc:
            self._fail(f, exc)

    def _merge(self, plain: bool = False) -> SyncStats:
        f = self.pending
        assert f is not None
        t0 = time.perf_counter()
        if self.wire is not None and f.phase == 1:
            self._gather(f)
        if not f.done:
            try:
                f.wait(self.waiting)
            except Exception as exc:
                self._fail(f, exc)
        self.pending = None
        frag = self.fragments[f.fragment]
        totals = f.count.tolist()
        mass, movers, active, nonfinite_ranks, cohort_steps, snum, snum_sq = totals
        if self.world_size * snum_sq != snum * snum:
            self.since[f.fragment] += f.steps
            raise ConfigError(
                f"flodl_opt: ranks disagree on the sync number (this is rank {self.rank}'s sync "
                f"#{f.sync}): the ranks resumed from different checkpoints or state dicts. Load the "
                "same checkpoint on every rank, or call opt.load_state_dict on all of them.")
        stats = SyncStats(sync=f.sync, steps=f.steps, cohort_steps=int(cohort_steps), total_mass=mass,
                          movers=int(movers), active=int(active), nonfinite=f.nonfinite,
                          nonfinite_ranks=int(nonfinite_ranks),
                          collectives=f.collectives, fragment=f.fragment)
        stats.bytes = self._bytes(frag, f.fragment) + f.count.numel() * 8 if self.distributed else 0
        self.syncs += 1
        if mass <= 0.0:
            if nonfinite_ranks > 0:
                raise all_nonfinite(nonfinite_ranks, self.world_size, f" in fragment {f.fragment}")
            stats.skipped = True  # the whole cohort idle for this fragment: nothing changes
            stats.ms = f.t_issue_ms + (time.perf_counter() - t0) * 1e3
            return stats
        n_params = len(frag.params)
        sent, buf = self._sent[f.fragment], self._buf[f.fragment]
        lives = self._live(frag)
        outer_step = bool(self._outers) and not isinstance(self.outer, OuterAvg) and not plain
        keep_steps = f.local_steps > 0 and not f.nonfinite  # else: exactly the blocking result
        wired = self.wire is not None
        with torch.no_grad():
            if wired:  # C = A + deQ(gathered) in the params' buffers: already normalized
                self.wire.decode(f.fragment, buf[:n_params])
            post: List[torch.Tensor] = []
            diff: List[torch.Tensor] = []
            if outer_step:  # C, its readout; then G = outer(C) over the whole fragment; then W
                consensus_pass(buf, sent, mass, movers, n_params, post, diff, self.readout, normalized=wired)
                if wired:
                    self.wire.commit(f.fragment, buf[:n_params])
                self._outers[f.fragment].step([_Proxy(b) for b in buf[:n_params]], None,
                                              float(self.inner_lr()))
                stats.outer = self.outer.name
                apply_pass(lives, sent, buf, keep_steps)
            else:           # G = C: one pass, block by block, while each block is in cache
                consensus_pass(buf, sent, mass, movers, n_params, post, diff, self.readout, lives, keep_steps,
                               normalized=wired)
                if wired:
                    self.wire.commit(f.fragment, buf[:n_params])
                if plain and self._outers and self.outer.needs_anchor:  # the outer starts from the warm-up's C
                    self._outers[f.fragment].rebase([_Proxy(b) for b in buf[:n_params]])
        if self.readout and post:
            set_readout(stats, None if f.nonfinite else f.pre_sq, total(post), total(diff))
        m = 0.0 if f.nonfinite else gamma_mass(f.steps, self.gamma)
        stats.weight = m / mass
        if f.nonfinite:
            warn_nonfinite(self.rank, f.sync)
            if self.on_nonfinite is not None:
                self.on_nonfinite(f.sync)
        stats.ms = f.t_issue_ms + (time.perf_counter() - t0) * 1e3
        return stats

    def _bytes(self, frag: Fragment, p: int) -> int:
        """Bytes one sync of fragment ``p`` reduces: float32, or the encoded params and float32 buffers."""
        if self.wire is None:
            return frag.bytes
        return self.wire.bytes(p) + sum(s.numel * self.buffer_groups[s.index].reduce_dtype.itemsize
                                        for s in frag.buffers)


def _rdt(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32

