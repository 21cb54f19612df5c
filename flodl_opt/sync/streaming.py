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
import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..hooks.adaptive import AdaptiveSync, share_drift
from .stats import SyncStats, gamma_mass, warn_nonfinite
from ..errors import ConfigError, NonFiniteError, SyncError
from .flat import FlatGroup
from ..transport.codecs import Codec
from ..hooks.outer import DiLoCo, OuterAvg, OuterOptimizer, SlowMo
from ..transport.stream_wire import FragmentWire

_BLOCK = 1 << 18  # elements per block of the fused local passes (1 MiB of float32 stays in cache)


def _block(t: torch.Tensor) -> int:
    """Elements per block for ``t``: cache-sized on the CPU; on a GPU one block per tensor, since
    there blocking only multiplies kernel launches (host time, right before a host sync)."""
    return _BLOCK if t.device.type == "cpu" else max(1, t.numel())


# ------------------------------------------------------------------ fragments
@dataclass(frozen=True)
class Slice:
    """Elements ``[start, end)`` of one flat buffer (``index`` into the param or buffer groups)."""

    index: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class Fragment:
    """A run of whole tensors, as at most one slice per flat buffer."""

    params: List[Slice] = field(default_factory=list)
    buffers: List[Slice] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0   # bytes one sync of this fragment reduces


def _runs(groups: Sequence[FlatGroup], order: Sequence[torch.Tensor], parts: int,
          allow_empty: bool) -> List[List[Slice]]:
    """Split ``order`` (tensors in layer order) into ``parts`` contiguous runs of ~equal bytes."""
    where: Dict[int, Tuple[int, int, int]] = {}   # id -> (group index, start, end incl. padding)
    for gi, g in enumerate(groups):
        for k, (t, off) in enumerate(zip(g.tensors, g.offsets)):
            end = g.offsets[k + 1] if k + 1 < len(g.offsets) else g.numel
            where[id(t)] = (gi, off, end)
    items = [where[id(t)] for t in order if id(t) in where]
    if not allow_empty and len(items) < parts:
        raise ConfigError(f"fragments={parts} is more than the {len(items)} synced param tensors: a "
                          "fragment is made of whole tensors; use fragments <= the number of tensors")
    sizes = [(e - s) * groups[gi].reduce_dtype.itemsize for gi, s, e in items]
    total = sum(sizes)
    # Cut after the tensor whose cumulative bytes come nearest each p/P of the total, keeping at
    # least one tensor per fragment (when there are enough).
    cuts: List[int] = []
    prefix = [0]
    for n in sizes:
        prefix.append(prefix[-1] + n)
    for p in range(1, parts):
        target = total * p / parts
        lo = (cuts[-1] if cuts else 0) + (0 if allow_empty else 1)
        hi = len(items) - (0 if allow_empty else parts - p)
        best = min(range(lo, max(lo, hi) + 1), key=lambda c: (abs(prefix[c] - target), c))
        cuts.append(best)
    bounds = [0] + cuts + [len(items)]
    runs: List[List[Slice]] = []
    for p in range(parts):
        by_group: Dict[int, List[int]] = {}
        for gi, s, e in items[bounds[p]:bounds[p + 1]]:
            r = by_group.get(gi)
            if r is None:
                by_group[gi] = [s, e]
                continue
            if s != r[1]:  # tensors of one dtype in layer order are adjacent in their buffer
                raise AssertionError("fragment is not contiguous in its flat buffer")
            r[1] = e
        runs.append([Slice(gi, s, e) for gi, (s, e) in sorted(by_group.items())])
    return runs


def split_fragments(param_groups: Sequence[FlatGroup], params: Sequence[torch.Tensor],
                    buffer_groups: Sequence[FlatGroup], buffers: Sequence[torch.Tensor],
                    parts: int) -> List[Fragment]:
    """``parts`` fragments of about equal bytes, on tensor boundaries, in layer order."""
    p_runs = _runs(param_groups, params, parts, allow_empty=False)
    b_runs = _runs(buffer_groups, buffers, parts, allow_empty=True) if buffer_groups else [[]] * parts
    frags = []
    for pr, br in zip(p_runs, b_runs):
        n = sum(1 for s in pr for off in param_groups[s.index].offsets if s.start <= off < s.end)
        nbytes = sum(s.numel * param_groups[s.index].reduce_dtype.itemsize for s in pr) + \
            sum(s.numel * buffer_groups[s.index].reduce_dtype.itemsize for s in br)
        frags.append(Fragment(list(pr), list(br), n, nbytes))
    return frags


# ------------------------------------------------------------------ schedule
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

    def issue_at(self, t: int) -> Optional[int]:
        r = t - self.origin
        if r < 1 or r % self.stride:
            return None
        return (r // self.stride) % self.parts

    def set_period(self, k: int) -> None:
        Schedule.__init__(self, k, self.parts, self.tau)  # the same checks: K % P == 0, tau < K/P


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


# ------------------------------------------------------------------ one sync in flight
@dataclass
class _Flight:
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


class StreamingSync:
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
        self._round: List[Tuple[float, float, int]] = []  # (diff^2, post^2, steps) per merge
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
        self.pending: Optional[_Flight] = None

    def setup_outer(self) -> None:
        """Per-fragment views of the outer state (call after ``outer.setup``)."""
        self._outers = []
        for f in self.fragments:
            o = copy.copy(self.outer)  # shares config; its state lists become views of the full state
            o.anchor = [self.outer.anchor[s.index][s.start:s.end] for s in f.params] if self.outer.anchor else []
            o.momentum = [self.outer.momentum[s.index][s.start:s.end] for s in f.params] \
                if self.outer.momentum else []
            self._outers.append(o)
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
        """Keep this round's readouts; at fragment 0's merge, choose the next round's period."""
        for st in done:
            if not st.skipped and st.divergence is not None and st.post_norm is not None and \
                    math.isfinite(st.divergence):
                self._round.append(((st.divergence * st.post_norm) ** 2, st.post_norm ** 2, st.steps))
        closing = next((st for st in done if st.fragment == 0), None)
        if closing is not None:
            self._decide(closing)
        for st in done:
            st.next_every = self.schedule.period

    def _decide(self, stats: SyncStats) -> None:
        """The whole model's divergence over the round (sum of the fragments' squares), then the
        blocking rule's one tiny SUM, so every rank picks the same period from the same numbers."""
        diff = sum(r[0] for r in self._round)
        post = sum(r[1] for r in self._round)
        steps = sum(r[2] for r in self._round) / len(self._round) if self._round else 0
        mine = math.sqrt(diff / post) if post > 0.0 else None
        self._round = []
        with self.waiting(stats.sync):
            drift = share_drift(mine, steps, stats, self.group, self.distributed, self.comm_device, self.rank)
        k = round_period(self.auto.next_period(drift), self.auto, self.schedule.parts, self.schedule.tau)
        self.auto.every = k
        self.schedule.set_period(k)

    def drain(self) -> None:
        """Wait for the collectives in flight; the merge stays at its scheduled step."""
        f = self.pending
        if f is None or f.done:
            return
        try:
            self._wait(f)
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
            # One pass, block by block: snapshot, scaled send copy and (params) the snapshot's norm.
            squares = []
            wired = self.wire is not None
            for k, (live, s, b) in enumerate(zip(lives, sent, buf)):
                factor = mass if k < n_params else mover  # buffers: equal weight among movers
                blk = _block(live)
                for i in range(0, live.numel(), blk):
                    j = min(live.numel(), i + blk)
                    s[i:j].copy_(live[i:j])
                    if k < n_params:
                        squares.append(_sq(s[i:j]))
                        if wired:
                            continue  # the params travel as encoded differences (stream_wire.py)
                    torch.mul(s[i:j], factor, out=b[i:j])
            sq = float(torch.stack([q.double() for q in squares]).sum()) if squares else 0.0
            # a NaN/Inf float buffer (BatchNorm running_var) would reach every rank too
            bad_buffers = self.nonfinite_guard and any(not bool(torch.isfinite(v).all()) for v in lives[n_params:])
            nonfinite = self.nonfinite_guard and (not math.isfinite(sq) or bad_buffers)
            if nonfinite:  # no vote: exact zeros (0 * NaN is NaN)
                mass = mover = 0.0
                for b in buf:
                    b.zero_()
            number = self.syncs + 1
            count = torch.tensor([mass, mover, float(active), float(nonfinite), float(steps),
                                  float(number), float(number) ** 2], dtype=torch.float64,
                                 device=self.comm_device)
        tau = self.schedule.tau
        flight = _Flight(p, number, self.clock, self.clock + tau, steps, nonfinite, sq,
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
    def _wait(self, f: _Flight) -> None:
        with self.waiting(f.sync):
            for w in f.works:
                w.wait()
        f.works, f.done = [], True

    def _fail(self, f: _Flight, exc: BaseException) -> None:
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

    def _gather(self, f: _Flight) -> None:
        """Compressed wire, phase 2: the all_to_all and the count waited for, start the all_gather."""
        try:
            if not f.done:
                self._wait(f)
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
                self._wait(f)
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
                raise NonFiniteError(f"every rank that moved has non-finite params in fragment "
                                     f"{f.fragment} ({int(nonfinite_ranks)} of {self.world_size}); "
                                     "refusing to average garbage. Lower the learning rate, enable "
                                     "max_grad_norm, or resume from the last checkpoint.")
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
                self._consensus_pass(buf, sent, mass, movers, n_params, post, diff, normalized=wired)
                if wired:
                    self.wire.commit(f.fragment, buf[:n_params])
                self._outers[f.fragment].step([_Proxy(b) for b in buf[:n_params]], None,
                                              float(self.inner_lr()))
                stats.outer = self.outer.name
                self._apply_pass(lives, sent, buf, keep_steps)
            else:           # G = C: one pass, block by block, while each block is in cache
                self._consensus_pass(buf, sent, mass, movers, n_params, post, diff, lives, keep_steps,
                                     normalized=wired)
                if wired:
                    self.wire.commit(f.fragment, buf[:n_params])
                if plain and self._outers and self.outer.needs_anchor:  # the outer starts from the warm-up's C
                    self._outers[f.fragment].rebase([_Proxy(b) for b in buf[:n_params]])
        if self.readout and post:
            post_sq = float(torch.stack([q.double() for q in post]).sum())
            diff_sq = float(torch.stack([q.double() for q in diff]).sum())
            stats.post_norm = math.sqrt(post_sq)
            stats.pre_norm = None if f.nonfinite else math.sqrt(f.pre_sq)
            stats.divergence = math.sqrt(diff_sq) / stats.post_norm if stats.post_norm > 1e-12 else 0.0
        m = 0.0 if f.nonfinite else gamma_mass(f.steps, self.gamma)
        stats.weight = m / mass
        if f.nonfinite:
            warn_nonfinite(self.rank, f.sync)
            if self.on_nonfinite is not None:
                self.on_nonfinite(f.sync)
        stats.ms = f.t_issue_ms + (time.perf_counter() - t0) * 1e3
        return stats

    def _consensus_pass(self, buf: List[torch.Tensor], sent: List[torch.Tensor], mass: float, movers: float,
                        n_params: int, post: List[torch.Tensor], diff: List[torch.Tensor],
                        lives: Optional[List[torch.Tensor]] = None, keep_steps: bool = False,
                        normalized: bool = False) -> None:
        """``C = sum_i m_i S_i / sum_j m_j`` in ``buf``, with the readout's squares of ``C`` and
        ``C - S``. Given ``lives`` (no outer step: ``G = C``) it also merges, in the same block.
        ``normalized``: the params' buffers already hold ``C`` (the compressed wire decoded it)."""
        for k, (s, b) in enumerate(zip(sent, buf)):
            param = k < n_params
            blk = _block(b)
            for i in range(0, b.numel(), blk):
                j = min(b.numel(), i + blk)
                bb, ss = b[i:j], s[i:j]
                if not (param and normalized):
                    bb.div_(mass if param else movers)
                if self.readout and param:
                    post.append(_sq(bb))
                if lives is None:
                    if self.readout and param:
                        diff.append(_sq(bb - ss))   # S is still needed after the outer step
                    continue
                torch.sub(bb, ss, out=ss)          # G - S; the snapshot is spent
                if self.readout and param:
                    diff.append(_sq(ss))
                _merge_block(lives[k][i:j], ss, bb, keep_steps)

    @staticmethod
    def _apply_pass(lives: List[torch.Tensor], sent: List[torch.Tensor], buf: List[torch.Tensor],
                    keep_steps: bool) -> None:
        """``W <- W + (G - S)`` (or ``W <- G``), block by block."""
        for live, s, b in zip(lives, sent, buf):
            blk = _block(b)
            for i in range(0, b.numel(), blk):
                j = min(b.numel(), i + blk)
                ss = s[i:j]
                torch.sub(b[i:j], ss, out=ss)
                _merge_block(live[i:j], ss, b[i:j], keep_steps)

    def _bytes(self, frag: Fragment, p: int) -> int:
        """Bytes one sync of fragment ``p`` reduces: float32, or the encoded params and float32 buffers."""
        if self.wire is None:
            return frag.bytes
        return self.wire.bytes(p) + sum(s.numel * self.buffer_groups[s.index].reduce_dtype.itemsize
                                        for s in frag.buffers)

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Counters and, if a fragment is in flight, its finished result (call ``drain()`` first)."""
        sd: Dict[str, Any] = {"clock": self.clock, "since": list(self.since), "syncs": self.syncs,
                              "pending": None,
                              # each fragment's own outer step count (DiLoCo's warm-up depends on it)
                              "outer_steps": [getattr(o, "steps", None) for o in self._outers]}
        if self.auto is not None:  # the round in progress: its start, its period, its readouts
            sd["round"] = {"origin": self.schedule.origin, "period": self.schedule.period,
                           "readouts": [list(r) for r in self._round]}
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
            self._round = [(float(a), float(b), int(c)) for a, b, c in rd["readouts"]]
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
        self.pending = _Flight(k, p["sync"], p["issued_at"], p["merge_at"], p["steps"], p["nonfinite"],
                               p["pre_sq"], p["count"].to(self.comm_device), [], 0.0,
                               local_steps=p["local_steps"], done=True)
        if self.wire is not None:
            self.pending.phase, self.pending.gather_at = int(p["phase"]), int(p["gather_at"])
            self.wire.load_flight_state(k, p["wire"])


def _merge_block(live: torch.Tensor, g_minus_s: torch.Tensor, g: torch.Tensor, keep_steps: bool) -> None:
    """One block of the delayed update: ``W <- W + (G - S)``, or ``W <- G`` when no steps count."""
    if not keep_steps:
        live.copy_(g)             # no steps in flight (or NaN ones): exactly the blocking result
    elif live.dtype in (torch.float32, torch.float64):
        live.add_(g_minus_s)
    else:
        live.copy_(g_minus_s.add_(live))  # in float32, rounded once


def _rdt(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32


def _sq(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.float32, torch.float64):
        return torch.dot(t, t)
    return torch.linalg.vector_norm(t, dtype=torch.float32).square()
