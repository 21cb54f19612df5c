"""LocalSGDOptimizer: wrap any torch optimizer; ranks train locally and agree every K steps.

The data path of one ``step()``::

    clip (global norm)  ->  inner step  ->  scheduler step  ->  count  ->  every K steps: sync
    sync = count -> reduce (one fused in-place collective per flat buffer) -> readout -> outer step

With ``fragments=P`` / ``overlap_steps=tau`` (flodl_opt/streaming.py) the sync is per fragment:
``count -> snapshot + async reduce`` at the fragment's step, then ``tau`` steps later
``wait -> readout -> outer step -> merge`` (``W <- G + (W - S)``).

Example (``torchrun --nproc-per-node 2 train.py``, or ``python train.py`` for one rank)::

    import torch, flodl_opt as flo
    flo.init()
    model = torch.nn.Linear(10, 1)
    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                model=model, sync_every=16, max_grad_norm=1.0)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.sync()   # end on a consensus
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from . import ddp, launch
from . import provenance  # who saved a state dict, live optimizers (flodl_opt/provenance.py)
from .adaptive import AdaptiveSync, make_adaptive, share_drift
from .amp import scaler_says_skip
from .consensus import Consensus, SyncStats, DEFAULT_GLOO_CHUNK_BYTES
from .wrapping import WrappedOptimizer, check_same_on_every_rank
from .errors import ConfigError, NonFiniteWarning
from .flat import FlatGroup, own_storage_state_dicts, pack, signature, unique
from .outer import OuterAvg, OuterOptimizer, OuterSpec, make_outer
from .stall import DEFAULT_STALL_WARNING_S, StallWatchdog
from .wire import DEFAULT_WIRE_BLOCK, make_wire, wire_config
from .streaming import Schedule, StreamingSync, round_period
from .moments import MOMENT_WIRES, DriftDenoise, LocalDenoise, MomentSync, check_optimizer

STATE_KEY = "flodl_opt"
STATE_VERSION = 1
# Config that must agree between a checkpoint and the optimizer loading it, and across ranks.
_STRICT_CONFIG = ("sync_every", "warmup_steps", "gamma", "outer", "wire")
# Must agree even with strict=False (a checkpoint may hold a fragment in flight); absent = default.
_STREAM_CONFIG = {"fragments": 1, "overlap_steps": 0}
# Must agree with strict=True; absent from older checkpoints = default.
_DEFAULTED_CONFIG = {"sync_moments": False, "denoise_moments": False, "sync_moments_every": 1,
                     "sync_moments_wire": "fp32"}


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside DistributedDataParallel, also under ``torch.compile(DDP(net))``."""
    found = ddp.find_ddp(model)
    return found.module if found is not None else model


class LocalSGDOptimizer(WrappedOptimizer):
    """Local SGD around any torch optimizer, with a work-weighted consensus every ``sync_every`` steps.

    Args:
        optimizer: an already built torch optimizer (its ``param_groups`` are shared, not copied).
        model: the model (or its DDP wrapper). Its float buffers (BatchNorm running stats) ride the
            sync, and its trainable params are checked against the optimizer's.
        sync_every: K, local steps between syncs (>= 1; K=1 is synchronous model averaging), or
            ``"auto"`` / an ``AdaptiveSync(...)``: K chosen after each sync from the cohort's
            all-reduced divergence, identically on every rank (flodl_opt/adaptive.py).
        warmup_steps: sync after every step for the first N steps (post-local SGD).
        outer: ``None``/``"avg"``, ``"diloco"``, ``"slowmo"``, ``"easgd"``, an ``OuterOptimizer``,
            or a callable building a torch optimizer from a list of tensors.
        max_grad_norm: clip gradients to this global norm before each inner step.
        lr_scheduler: a scheduler built on ``optimizer``; stepped once per ``step()``.
        gamma: work-weighting exponent (0 = equal weight among ranks that moved).
        process_group: the group to sync over (default: the world).
        broadcast_initial: start every rank from rank 0's weights (default True).
        keep_presync: keep a pre-sync copy of the synced tensors so a failed sync restores them,
            and for the divergence readout. Costs one copy of the params (default True).
        nonfinite_guard: a rank whose params are NaN/Inf gets no vote and adopts the consensus.
        gloo_chunk_bytes: on Gloo, reduce in chunks of this size so scaling overlaps the reduction.
        stall_warning_s: log a warning naming the sync and the ranks that have not arrived when
            this rank waits at one sync longer than this (``None``: no watchdog thread).
        wire: what the param sync sends: ``"fp32"`` (the float32 reduce, default), or the
            rank's difference from the common anchor in ``"bf16"``, ``"fp16"`` or ``"int8"``
            (1/2, 1/2, ~1/4 of the bytes; flodl_opt/wire.py says how and what it costs).
        wire_block: elements per int8 scale (``wire="int8"``).
        error_feedback: carry each rank's quantization residual into its next sync (compressed
            wires only; the residual is in ``state_dict``).
        fragments: P, sync the model a fragment (~1/P of the bytes, whole tensors in layer order)
            at a time, fragment p at the steps ``t % K == p*K/P`` (``K % P == 0``).
        overlap_steps: tau < K/P, keep training tau steps while a fragment's sync is in flight,
            then merge it as ``W <- G + (W - S)`` (flodl_opt/streaming.py). Defaults (1, 0)
            are the blocking sync, bit for bit.
        sync_moments: also share an Adam/AdamW inner optimizer's moments at every sync, the
            second moment with the excess noise of each rank's small batch taken out, so local
            steps move as gradient all-reduce's would (flodl_opt/moments.py; 4x the sync's bytes).
        sync_moments_every: with ``sync_moments``, share the moments at every N-th sync only, over
            the steps since the last share: on average ``1 + 3/N`` times a plain sync's bytes.
        sync_moments_wire: with ``sync_moments``, how the moments travel: ``"fp32"`` (default) or
            ``"bf16"`` (half their bytes, summed in float32: ``1 + 1.5/N`` times a plain sync's).
        denoise_moments: take that excess out of each rank's own Adam/AdamW second moment
            instead, with nothing sent: ``True`` at every step, measured from the rank's own
            gradients (every sync mode); ``"sync"`` at every sync, read from how far the rank's
            params drifted from the consensus (blocking float32 syncs without an outer optimizer; one
            param-sized EMA of state). flodl_opt/moments.py has both formulas. Ranks' batches
            of equal size.
    """

    # GradScaler then calls step() even when it found inf/NaN, so a skipped step still ticks the
    # sync schedule (with zero work) and the ranks keep syncing at the same steps (flodl_opt/amp.py).
    _step_supports_amp_scaling = True

    def __init__(self, optimizer: torch.optim.Optimizer, model: Optional[nn.Module] = None,
                 sync_every: Union[int, str, AdaptiveSync] = 16, warmup_steps: int = 0,
                 outer: OuterSpec = None,
                 max_grad_norm: Optional[float] = None, lr_scheduler: Any = None,
                 gamma: float = 1.0, process_group: Optional[dist.ProcessGroup] = None, *,
                 fragments: int = 1, overlap_steps: int = 0, broadcast_initial: bool = True, keep_presync: bool = True,
                 nonfinite_guard: bool = True, gloo_chunk_bytes: int = DEFAULT_GLOO_CHUNK_BYTES,
                 stall_warning_s: Optional[float] = DEFAULT_STALL_WARNING_S,
                 wire: str = "fp32", wire_block: int = DEFAULT_WIRE_BLOCK, error_feedback: bool = False,
                 sync_moments: bool = False, denoise_moments: Union[bool, str] = False, sync_moments_every: int = 1,
                 sync_moments_wire: str = "fp32"):
        _validate(optimizer, model, sync_every, warmup_steps, max_grad_norm, lr_scheduler, gamma)
        self._adaptive: Optional[AdaptiveSync] = make_adaptive(sync_every)
        if self._adaptive is not None and not keep_presync:
            raise ConfigError("sync_every='auto' decides from the divergence readout, which needs the "
                              "pre-sync copy: drop keep_presync=False or pass an int sync_every")
        if self._adaptive is not None and (fragments > 1 or overlap_steps > 0):
            _validate_stream(fragments, overlap_steps, fragments * (overlap_steps + 1), warmup_steps,
                             keep_presync)
            # the fragment schedule runs multiples of P with overlap_steps < K/P only
            self._adaptive.every = round_period(self._adaptive.every, self._adaptive, fragments,
                                                overlap_steps)
        _validate_stream(fragments, overlap_steps, self._adaptive.every if self._adaptive is not None
                         else sync_every, warmup_steps, keep_presync)
        self._wire = make_wire(wire, wire_block, error_feedback)  # None: the float32 reduce
        if self._wire is not None and not broadcast_initial:
            raise ConfigError(f"flodl_opt: wire={wire!r} sends differences from an anchor every rank "
                              "must hold bit for bit: drop broadcast_initial=False")
        if self._wire is not None and (fragments > 1 or overlap_steps > 0):
            raise ConfigError(f"flodl_opt: wire={wire!r} is not supported with fragments/overlap_steps "
                              "yet (streaming syncs send float32): use wire='fp32', or fragments=1 and "
                              "overlap_steps=0")
        if not isinstance(sync_moments, bool):
            raise ConfigError(f"sync_moments must be True or False, got {sync_moments!r}")
        if sync_moments:
            check_optimizer(optimizer)
            if fragments > 1 or overlap_steps > 0:
                raise ConfigError("sync_moments=True is not supported with fragments/overlap_steps (the "
                                  "moments are shared at blocking syncs only): drop one of them")
        if isinstance(sync_moments_every, bool) or not isinstance(sync_moments_every, int) or sync_moments_every < 1:
            raise ConfigError(f"sync_moments_every must be an int >= 1 (share at every N-th sync), "
                              f"got {sync_moments_every!r}")
        if sync_moments_every != 1 and not sync_moments:
            raise ConfigError(f"sync_moments_every={sync_moments_every} says how often sync_moments shares "
                              "the moments: pass sync_moments=True with it, or drop it")
        if not isinstance(sync_moments_wire, str) or sync_moments_wire not in MOMENT_WIRES:
            raise ConfigError(f"sync_moments_wire must be 'fp32' or 'bf16', got {sync_moments_wire!r} (fp16 "
                              "and int8 cannot hold the second moment's range of magnitudes)")
        if sync_moments_wire != "fp32" and not sync_moments:
            raise ConfigError(f"sync_moments_wire={sync_moments_wire!r} says how sync_moments sends the "
                              "moments: pass sync_moments=True with it, or drop it")
        if not (isinstance(denoise_moments, bool) or denoise_moments == "sync"):
            raise ConfigError(f"denoise_moments must be False, True (at every step) or 'sync' (at every "
                              f"sync), got {denoise_moments!r}")
        if denoise_moments:
            check_optimizer(optimizer, f"denoise_moments={denoise_moments!r}")
            if sync_moments:
                raise ConfigError("sync_moments=True already takes the noise excess out at every sync; "
                                  f"with denoise_moments={denoise_moments!r} it would be taken out twice: "
                                  "pick one")
        if denoise_moments == "sync":
            _validate_drift_denoise(fragments, overlap_steps, keep_presync, outer, wire)
        launch.ensure_init()
        # Share the inner optimizer's param_groups and state (flodl_opt/wrapping.py).
        self._share(optimizer)

        self.model = model
        # sync_every is the period in effect now; "auto" updates it after every sync.
        self.sync_every = self._adaptive.every if self._adaptive is not None else int(sync_every)
        self.warmup_steps = int(warmup_steps)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.lr_scheduler, self.gamma = lr_scheduler, float(gamma)
        self.fragments, self.overlap_steps = int(fragments), int(overlap_steps)
        self.outer: OuterOptimizer = make_outer(outer)
        if self.outer.needs_deltas and not keep_presync:
            raise ConfigError(f"outer={self.outer.name!r} needs the pre-sync copy: "
                              "drop keep_presync=False")
        self.process_group = process_group
        group_size = dist.get_world_size(process_group) if launch.size() > 1 else 1
        self._rank = dist.get_rank(process_group) if group_size > 1 else 0

        # The synced set, fixed now: trainable params (work-weighted), float buffers (mover-weighted).
        self._params: List[torch.Tensor] = unique(p for g in optimizer.param_groups for p in g["params"])
        inner_model = unwrap_model(model) if model is not None else None
        float_buffers = [b for b in unique(inner_model.buffers()) if b.is_floating_point()] \
            if inner_model is not None else []
        self._param_groups_flat: List[FlatGroup] = pack(self._params, "param")
        if self._wire is not None:
            self._wire.check_groups(self._param_groups_flat)
        self._buffer_groups_flat: List[FlatGroup] = pack(float_buffers, "buffer")
        if inner_model is not None:  # packed tensors share one storage: state_dict() hands out copies
            own_storage_state_dicts(inner_model)

        self._consensus = Consensus(
            self._param_groups_flat, self._buffer_groups_flat,
            process_group, group_size, self._rank, launch.backend(), gamma=self.gamma,
            keep_presync=keep_presync, nonfinite_guard=nonfinite_guard,
            gloo_chunk_bytes=gloo_chunk_bytes)
        self._moments: Optional[MomentSync] = None  # None: each rank keeps its own inner moments
        if sync_moments:
            self._moments = MomentSync(optimizer, self._params, [g.flat for g in self._param_groups_flat],
                                       self.gamma, process_group, self._consensus.comm_device,
                                       self._consensus.distributed, self._rank, every=sync_moments_every,
                                       wire=sync_moments_wire, world=group_size)
        # None: each rank's Adam keeps the second moment of its own small batch
        self._denoise: Optional[LocalDenoise] = LocalDenoise(optimizer, group_size) \
            if denoise_moments is True and group_size > 1 else None
        self._denoise_on = denoise_moments   # as configured (a world of one has nothing to take out)
        # None: each rank's Adam keeps its excess; else it is taken out at the syncs, from the drift
        self._drift: Optional[DriftDenoise] = DriftDenoise(optimizer, self._params) \
            if denoise_moments == "sync" and group_size > 1 else None
        if group_size > 1:
            self._check_same_everywhere()
            if broadcast_initial:
                self._broadcast_from_root(inner_model)
        self.outer.setup(self._param_groups_flat, group_size)
        if self._wire is not None:  # shares the outer optimizer's anchor when it keeps one
            self._wire.bind(self._param_groups_flat, self.outer.anchor if self.outer.needs_anchor else None,
                            group_size, self._rank, process_group)
            self._consensus.wire = self._wire
        self._stream: Optional[StreamingSync] = None  # None: the blocking sync
        if self.fragments > 1 or self.overlap_steps > 0:
            self._stream = StreamingSync(
                self._param_groups_flat, self._params, self._buffer_groups_flat, float_buffers,
                self.outer, self.sync_every, self.fragments, self.overlap_steps, process_group,
                group_size, self._rank, launch.backend(), gamma=self.gamma,
                nonfinite_guard=nonfinite_guard, gloo_chunk_bytes=gloo_chunk_bytes,
                inner_lr=lambda: self.optimizer.param_groups[0]["lr"],
                on_nonfinite=self._reset_nonfinite_inner_state, waiting=self._waiting,
                auto=self._adaptive)
            self._stream.setup_outer()
        # CUDA: packing copied every tensor into its flat buffer on the current stream and freed
        # the old storage, which the caching allocator may hand to another stream at once; the
        # anchor copies above are queued too. Let them land before any stream touches the params.
        cuda = [g.device for g in self._param_groups_flat + self._buffer_groups_flat if g.device.type == "cuda"]
        self._cuda_index: Optional[int] = cuda[0].index if cuda else None
        for index in sorted({d.index for d in cuda}):
            torch.cuda.synchronize(index)
        self._train_stream: Optional[tuple] = None  # stream of the last inner step (CUDA only)
        self._stream_fence = True  # private switch: the GPU tests turn it off to prove they can fail

        self._stall: Optional[StallWatchdog] = None
        if group_size > 1 and stall_warning_s is not None:
            self._stall = _make_watchdog(float(stall_warning_s), process_group)
            weakref.finalize(self, self._stall.close)
        # (module, attribute, param) of every trainable param: a sync checks that none was
        # replaced, with dict lookups only (named_parameters() would walk the module tree).
        self._param_slots = [(mod, name, p) for mod in (inner_model.modules() if inner_model is not None else ())
                             for name, p in mod._parameters.items() if p is not None and p.requires_grad]

        self._local_steps = 0        # step() calls on this rank, GradScaler-skipped ones too
        self._steps_since_sync = 0   # steps since the last sync (the schedule's clock)
        self._skipped_since_sync = 0  # of which GradScaler skipped (no work): n_i = the difference
        self._sync_count = 0
        self._global_steps = 0       # steps taken by the whole cohort, summed at syncs
        self._joined = False
        self._checked_grads = False
        self._watch_local = group_size > 1  # until a sync shows the ranks really trained apart
        self.last_sync: Optional[SyncStats] = None
        # A DDP model: stop its per-step gradient all-reduce after warm-up (flodl_opt/ddp.py).
        self._ddp = ddp.attach(model, self, self.warmup_steps, process_group) if group_size > 1 else None

    # ------------------------------------------------------------ Optimizer surface
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise ConfigError("flodl_opt: the synced tensors are fixed when LocalSGDOptimizer is built; "
                          "add the param group to the inner optimizer before wrapping it")

    def __repr__(self) -> str:
        every = self._adaptive if self._adaptive is not None else self.sync_every
        return (f"LocalSGDOptimizer({type(self.optimizer).__name__}, sync_every={every}, "
                f"warmup_steps={self.warmup_steps}, outer={self.outer!r}, gamma={self.gamma}, "
                f"max_grad_norm={self.max_grad_norm})")

    # ------------------------------------------------------------ the data path
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """clip -> inner step -> scheduler -> count -> sync when due. Returns the closure's loss."""
        # Step hooks run only when some are registered: torch's generic wrapper (a profiler range
        # plus hook checks) would cost ~20 us on every step, more than the rest of this wrapper.
        if self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks or _global_step_hooks():
            return self._step_with_hooks(closure)
        return self._step(closure)

    step.hooked = True  # type: ignore[attr-defined]  # tells Optimizer._patch_step_function not to wrap it

    def _step_with_hooks(self, closure: Optional[Callable[[], Any]]) -> Any:
        """``step`` with torch's optimizer step hooks, per instance and global, as Optimizer runs them."""
        from torch.optim import optimizer as torch_optimizer
        args, kwargs = (closure,), {}
        for hook in (*torch_optimizer._global_optimizer_pre_hooks.values(),
                     *self._optimizer_step_pre_hooks.values()):
            result = hook(self, args, kwargs)
            if result is not None:
                args, kwargs = result
        loss = self._step(*args, **kwargs)
        for hook in (*self._optimizer_step_post_hooks.values(),
                     *torch_optimizer._global_optimizer_post_hooks.values()):
            hook(self, args, kwargs)
        return loss

    def _step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        if not self._checked_grads:  # once, at the first step
            self._check_grads()
            self._find_late_ddp()
        skipped = scaler_says_skip(self, self._params)  # None unless GradScaler.step called us
        if skipped:
            loss = None  # inf/NaN gradients: no inner step, but the step still counts (zero work)
        elif self._denoise is not None:
            loss = self._denoised_inner_step(closure)
        elif self.max_grad_norm is not None:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            torch.nn.utils.clip_grad_norm_(self._params, self.max_grad_norm)
            self.optimizer.step()
        else:
            loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        if self._drift is not None and not skipped:
            self._drift.count()   # the lr this step moved the params with, before the scheduler moves it
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        if self._cuda_index is not None:
            # Remember the stream the inner step ran on (a tuple, no Stream object: ~0.3 us),
            # so a sync issued from another stream can be ordered after it (see _sync).
            self._train_stream = _stream_key(self._cuda_index)
        self._local_steps += 1
        self._steps_since_sync += 1
        self._skipped_since_sync += bool(skipped)
        if self._stream is not None:  # per fragment: issue (count + async reduce) / merge when due
            pending = self._stream.pending
            if self._stream.schedule.issue_at(self._stream.clock + 1) is not None or \
                    (pending is not None and self._stream.clock + 1 >= pending.merge_at):
                self._check_before_sync()
            self._record(self._stream.on_step(worked=not skipped, active=True))
        elif self._local_steps <= self.warmup_steps or self._steps_since_sync >= self.sync_every:
            self._sync()
        return loss

    def _denoised_inner_step(self, closure: Optional[Callable[[], Any]]) -> Any:
        """clip -> inner step, the step's second-moment noise excess taken out (flodl_opt/moments.py)."""
        assert self._denoise is not None
        loss = None
        if closure is not None:  # the gradients must exist before the step reads them
            with torch.enable_grad():
                loss = closure()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._params, self.max_grad_norm)
        pending = self._denoise.before()
        self.optimizer.step()
        self._denoise.after(pending)
        return loss

    def sync(self) -> SyncStats:
        """Average now. Collective: every rank of the group must call it."""
        return self._sync()

    def _sync(self) -> SyncStats:
        for g in self._param_groups_flat + self._buffer_groups_flat:
            g.check_bound()
        train = self._fence_before_sync()
        if self._stream is not None:  # merge what is in flight, then every fragment, blocking
            try:
                self._check_model_params()
                self._record(self._stream.sync_all(active=not self._joined))
            finally:
                if train is not None:
                    train.wait_stream(torch.cuda.current_stream(train.device))
            assert self.last_sync is not None
            return self.last_sync
        try:
            steps = self._steps_since_sync - self._skipped_since_sync
            moments = self._reduce_moments(steps, self._sync_count + 1)   # shared, not yet written
            stats = self._run_consensus(steps, self._sync_count + 1, active=not self._joined)  # count -> reduce -> readout
            self._apply_moments(moments, stats)
            self._apply_drift(steps, stats)
            if self._moments is not None:
                self._moments.done(steps, shared=self._moments.due(self._sync_count + 1))
            self._sync_count += 1
            self._global_steps += stats.cohort_steps
            self._steps_since_sync = self._skipped_since_sync = 0
            if not stats.skipped:
                self._outer_step(stats)
                if self._adaptive is not None:
                    self._next_period(stats)
            if self._watch_local:  # warns if something else averaged the gradients (ddp.py)
                self._watch_local = ddp.watch_local_progress(stats, self._consensus.world_size)
            stats.next_every = self.sync_every
        finally:
            if train is not None:  # the next forward on the training stream comes after the sync
                train.wait_stream(torch.cuda.current_stream(train.device))
        self.last_sync = stats
        return stats

    def _reduce_moments(self, steps: int, sync_number: int) -> Optional[torch.Tensor]:
        if self._moments is None or not self._moments.due(sync_number):
            return None
        with self._waiting(sync_number):
            return self._moments.reduce(steps, sync_number)

    def _apply_moments(self, moments: Optional[torch.Tensor], stats: SyncStats) -> None:
        """After a consensus that succeeded: every rank adopts the shared inner moments."""
        if moments is None:
            return
        assert self._moments is not None
        self._moments.apply(moments)
        stats.collectives += self._moments.collectives_per_share
        stats.bytes += self._moments.bytes_per_sync

    def _apply_drift(self, steps: int, stats: SyncStats) -> None:
        """denoise_moments="sync", after a consensus that succeeded: this rank's drift ``W_i_pre - C``
        takes its noise excess out of its own second moment (flodl_opt/moments.py)."""
        if self._drift is None:
            return
        deltas = self._consensus.deltas() if self._drift.applies(steps, stats) else None
        if deltas is None:   # nothing to read (or no params at all): the window ends unread
            self._drift.reset_window()
            return
        self._drift.apply(deltas, self._param_groups_flat, steps, stats.movers)

    def _record(self, done: List[SyncStats]) -> None:
        """Counters after streaming syncs: global steps from fragment 0 (each step counted once)."""
        for stats in done:
            self._sync_count += 1
            if stats.fragment == 0:
                self._global_steps += stats.cohort_steps
            self.last_sync = stats
        if done and self._stream is not None:
            self._steps_since_sync = self._stream.since[0]
            if self._adaptive is not None:  # a round may have ended with a new period
                self.sync_every = self._stream.schedule.period

    def _check_before_sync(self) -> None:
        for g in self._param_groups_flat + self._buffer_groups_flat:
            g.check_bound()
        self._check_model_params()

    def _waiting(self, sync_number: int):
        return self._stall.waiting(sync_number) if self._stall is not None else contextlib.nullcontext()

    def _next_period(self, stats: SyncStats) -> None:
        """sync_every="auto": the next K from one tiny SUM of the ranks' readouts, never local data.

        ``stats.skipped`` comes from the shared totals, so every rank takes part here, or none.
        """
        c = self._consensus
        with self._waiting(stats.sync):
            drift = share_drift(stats.divergence, stats.steps, stats, self.process_group, c.distributed,
                                c.comm_device, self._rank)
        self.sync_every = self._adaptive.next_period(drift)

    def _fence_before_sync(self) -> Optional["torch.cuda.Stream"]:
        """Order a sync issued on another CUDA stream after the last inner step's kernels.

        A sync inside ``step()`` runs on the stream of the inner step: stream order is the fence,
        and NCCL's own stream waits on it at issue. An explicit ``sync()`` (or ``join()``) from a
        different stream than the one that trained (say, the default stream after a loop under
        ``torch.cuda.stream(s)``) would otherwise snapshot, scale and reduce params that fused
        optimizer kernels on ``s`` are still writing. Returns the training stream to re-fence
        after the sync, or ``None`` when the streams are the same (no cost).
        """
        key = self._train_stream
        if key is None or not self._stream_fence or _stream_key(self._cuda_index) == key:
            return None
        train = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        torch.cuda.current_stream(train.device).wait_stream(train)
        return train

    def _outer_step(self, stats: SyncStats) -> None:
        groups = self._param_groups_flat
        if isinstance(self.outer, OuterAvg):
            return
        if self._local_steps <= self.warmup_steps:
            # Warm-up syncs are plain averaging; the outer optimizer starts from their result.
            self.outer.rebase(groups)
            return
        deltas = self._consensus.deltas() if self.outer.needs_deltas else None
        if deltas is not None and stats.nonfinite:
            for d in deltas:
                d.zero_()  # a non-finite rank adopts the consensus outright
        self.outer.step(groups, deltas, float(self.optimizer.param_groups[0]["lr"]))
        if self.outer.resets_inner:
            self.optimizer.state.clear()
        stats.outer = self.outer.name

    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
        """For uneven data: after the block, keep joining syncs with zero work until all ranks are done.

        Every rank wraps its loop in ``with opt.join():``. A rank that runs out of batches first
        flushes its own steps into a sync, then keeps answering its peers' syncs with zero
        weight, so nobody waits on a collective that never comes.
        """
        yield
        if launch.size() == 1:
            self._sync()
            return
        self._joined = True
        if self._stream is not None:
            # Tick the schedule without training, answering every fragment sync with zero work,
            # until a merge shows no active rank (same totals everywhere: same tick); then end
            # on a full consensus.
            try:
                while True:
                    done = self._stream.on_step(worked=False, active=False)
                    self._record(done)
                    if any(s.active == 0 for s in done):
                        break
                self._sync()
            finally:
                self._joined = False
            return
        try:
            while True:
                stats = self._sync()
                if stats.active == 0:
                    break
        finally:
            self._joined = False

    def _run_consensus(self, steps: int, sync_number: int, active: bool) -> SyncStats:
        """The consensus, under the stall watchdog, with the reliability checks around it."""
        self._check_model_params()
        with self._waiting(sync_number):
            stats = self._consensus.run(steps, sync_number, active=active)
        if stats.nonfinite:
            self._reset_nonfinite_inner_state(sync_number)
        return stats

    def _check_model_params(self) -> None:
        """A param replaced on the model after wrapping would be neither stepped nor synced."""
        for mod, attr, p in self._param_slots:
            if mod._parameters.get(attr) is not p:
                name = next((n for n, m in unwrap_model(self.model).named_modules() if m is mod), "?")
                name = f"{name}.{attr}" if name else attr
                raise ConfigError(
                    f"flodl_opt: model param {name!r} was replaced after LocalSGDOptimizer was built "
                    "(a new nn.Parameter assigned to the module), so it is neither stepped nor synced. "
                    "Change weights in place (model.load_state_dict, param.data.copy_), or build the "
                    "inner optimizer and LocalSGDOptimizer after replacing it.")

    def _reset_nonfinite_inner_state(self, sync_number: int) -> None:
        """A rank that adopted the consensus after NaN/Inf drops inner state that would re-poison it."""
        bad = [p for p, st in self.optimizer.state.items()
               if any(torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all())
                      for v in st.values())]
        for p in bad:
            del self.optimizer.state[p]
        if bad:
            warnings.warn(f"flodl_opt: rank {self._rank} reset the inner optimizer state of {len(bad)} "
                          f"param(s) holding NaN/Inf at sync #{sync_number}", NonFiniteWarning,
                          stacklevel=4)

    # ------------------------------------------------------------ checkpoints
    def config(self) -> Dict[str, Any]:
        every = self._adaptive.config() if self._adaptive is not None else self.sync_every
        return {"sync_every": every, "warmup_steps": self.warmup_steps, "gamma": self.gamma,
                "fragments": self.fragments, "overlap_steps": self.overlap_steps,
                "outer": self.outer.name, "outer_config": self.outer.config(),
                "max_grad_norm": self.max_grad_norm, "sync_moments": self._moments is not None,
                "denoise_moments": self._denoise_on,
                "sync_moments_every": self._moments.every if self._moments is not None else 1,
                "sync_moments_wire": self._moments.wire if self._moments is not None else "fp32",
                "wire": self._wire.config() if self._wire is not None else wire_config(),
                "flat": [(r, d, [list(s) for s in shapes]) for r, d, shapes in
                         signature(self._param_groups_flat + self._buffer_groups_flat)]}

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's state dict plus everything flodl_opt needs, under ``"flodl_opt"``."""
        if self._stream is not None:
            self._stream.drain()  # a fragment in flight is saved reduced; it merges on schedule
        sd = self.optimizer.state_dict()
        sd[STATE_KEY] = {
            "version": STATE_VERSION,
            "config": self.config(),
            "counters": {"local_steps": self._local_steps, "steps_since_sync": self._steps_since_sync,
                         "sync_count": self._sync_count, "global_steps": self._global_steps,
                         "skipped_since_sync": self._skipped_since_sync},
            "outer": self.outer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
        }
        if self._wire is not None:
            sd[STATE_KEY]["wire"] = self._wire.state_dict()
        if self._stream is not None:
            sd[STATE_KEY]["stream"] = self._stream.state_dict()
        if self._adaptive is not None:
            sd[STATE_KEY]["adaptive"] = self._adaptive.state_dict()
        if self._moments is not None and self._moments.every > 1:
            sd[STATE_KEY]["moments"] = self._moments.state_dict()
        if self._drift is not None:
            sd[STATE_KEY]["drift"] = self._drift.state_dict()
        provenance.stamp(self, sd)  # which rank saved it, when (flodl_opt/provenance.py)
        return sd

    def check_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> None:
        """Raise ``ConfigError`` if ``load_state_dict(state_dict, strict)`` would refuse it; writes nothing.

        Lets a caller (``load_checkpoint``) validate the optimizer's part before it touches the model."""
        ours = state_dict.get(STATE_KEY) if isinstance(state_dict, dict) else None
        if ours is None:
            raise ConfigError("flodl_opt: this state dict has no 'flodl_opt' entry: it was not saved by "
                              "LocalSGDOptimizer.state_dict() (torch.distributed.checkpoint's "
                              "get_state_dict/set_state_dict drop it: use flo.DCPState(model, opt)). "
                              "Load a plain optimizer checkpoint with opt.optimizer.load_state_dict(sd).")
        saved, now = {"wire": wire_config(), **ours["config"]}, self.config()
        if saved["flat"] != now["flat"]:
            raise ConfigError("flodl_opt: the checkpoint was saved for a different model (the synced "
                              "tensors' shapes or dtypes differ); build the same model before loading")
        keys = ("outer", "wire") if not strict else _STRICT_CONFIG
        diff = {k: (saved[k], now[k]) for k in keys if saved[k] != now[k]}
        diff.update({k: (saved.get(k, d), now[k]) for k, d in
                     {**_STREAM_CONFIG, **(_DEFAULTED_CONFIG if strict else {})}.items()
                     if saved.get(k, d) != now[k]})
        if diff:
            raise ConfigError(f"flodl_opt: the checkpoint's config differs from this optimizer's "
                              f"(saved, now): {diff}; build it with the saved values, or pass "
                              "strict=False to resume with the new sync_every/gamma/warmup_steps")
        groups = state_dict.get("param_groups", [])
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.optimizer.param_groups]:
            raise ConfigError("flodl_opt: the checkpoint's inner optimizer has other param groups than "
                              "this one (their number or sizes differ); build the same optimizer")
        self.outer.check_state_dict(ours["outer"])
        if self._drift is not None and not ours.get("drift"):
            raise ConfigError("flodl_opt: this checkpoint has no denoise_moments='sync' state (saved "
                              "without the option?): build the optimizer as it was saved")

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> None:  # type: ignore[override]
        """Restore an exact resume point. ``strict=False`` allows a changed sync_every/gamma/warmup.

        Everything is checked first (``check_state_dict``): a refused state dict changes nothing."""
        state_dict = provenance.on_load(self, state_dict, strict)  # another rank's? (provenance.py)
        self.check_state_dict(state_dict, strict)
        sd = dict(state_dict)
        ours = sd.pop(STATE_KEY)
        self.optimizer.load_state_dict(sd)
        c = ours["counters"]
        self._local_steps, self._steps_since_sync = c["local_steps"], c["steps_since_sync"]
        self._sync_count, self._global_steps = c["sync_count"], c["global_steps"]
        self._skipped_since_sync = c.get("skipped_since_sync", 0)
        with torch.no_grad():
            self.outer.load_state_dict(ours["outer"])
        if self.lr_scheduler is not None and ours["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(ours["lr_scheduler"])
        if self._wire is not None:
            self._wire.load_state_dict(ours.get("wire"))
        if self._stream is not None:
            self._stream.load_state_dict(ours["stream"])
        if self._moments is not None:
            self._moments.load_state_dict(ours.get("moments"))
        if self._drift is not None:
            self._drift.load_state_dict(ours.get("drift"))
        if self._adaptive is not None and ours.get("adaptive") is not None:
            self._adaptive.load_state_dict(ours["adaptive"])
            self.sync_every = self._adaptive.every

    # ------------------------------------------------------------ counters
    @property
    def local_steps(self) -> int:
        return self._local_steps

    @property
    def steps_since_sync(self) -> int:
        return self._steps_since_sync

    @property
    def sync_count(self) -> int:
        return self._sync_count

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken by all ranks together, as of the last sync."""
        return self._global_steps

    # ------------------------------------------------------------ set-up checks
    def _check_same_everywhere(self) -> None:
        """Every rank must wrap the same tensors with the same config, or the collectives misalign."""
        cfg = self.config()
        keys = _STRICT_CONFIG + tuple(_STREAM_CONFIG) + tuple(_DEFAULTED_CONFIG)
        desc = {"flat": cfg["flat"], **{k: cfg[k] for k in keys}}
        summary = {"groups": [(r, d, len(s), sum(_numel(x) for x in s)) for r, d, s in cfg["flat"]],
                   **{k: cfg[k] for k in keys}}
        check_same_on_every_rank(desc, summary, self.process_group,
                                 "flodl_opt: ranks wrap different models or configs",
                                 "groups are (role, dtype, tensors, elements)", "LocalSGDOptimizer")

    def _broadcast_from_root(self, inner_model: Optional[nn.Module]) -> None:
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        with torch.no_grad():
            for g in self._param_groups_flat + self._buffer_groups_flat:
                dist.broadcast(g.flat, src=src, group=self.process_group)
            if inner_model is not None:  # frozen params and integer buffers: few and small
                synced = {id(t) for g in self._param_groups_flat + self._buffer_groups_flat for t in g.tensors}
                for t in list(inner_model.parameters()) + list(inner_model.buffers()):
                    if id(t) not in synced:
                        dist.broadcast(t.data, src=src, group=self.process_group)

    def _find_late_ddp(self) -> None:
        """A DDP wrapper built after this optimizer (Accelerate's ``prepare(model, opt)``, the HF
        Trainer) would all-reduce every gradient: find it and make it local, as if passed."""
        if self._ddp is not None or self.model is None or not self._watch_local:
            return
        found = ddp.find_wrapper_of(self.model)
        if found is not None:
            self._ddp = ddp.attach(found, self, self.warmup_steps, self._consensus.group)

    def _check_grads(self) -> None:
        for p in self._params:
            if p.grad is not None and p.grad.is_sparse:
                raise ConfigError("flodl_opt: sparse gradients are not supported (an nn.Embedding with "
                                  "sparse=True?); use sparse=False")
        self._checked_grads = True


def _global_step_hooks() -> bool:
    from torch.optim import optimizer as torch_optimizer
    return bool(torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks)


def _stream_key(index: int) -> tuple:
    """(stream id, device index, device type) of the current CUDA stream of one device."""
    return tuple(torch._C._cuda_getCurrentStream(index))


def _make_watchdog(threshold_s: float, group: Optional[dist.ProcessGroup]) -> StallWatchdog:
    ranks = dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))
    tag = getattr(group, "group_name", None) or "world" if group is not None else "world"
    return StallWatchdog(threshold_s, ranks=ranks, rank=dist.get_rank(), tag=str(tag))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _validate_stream(fragments, overlap_steps, sync_every, warmup_steps, keep_presync) -> None:
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ConfigError(f"fragments must be an int >= 1 (1 = sync the whole model at once), got {fragments!r}")
    if isinstance(overlap_steps, bool) or not isinstance(overlap_steps, int) or overlap_steps < 0:
        raise ConfigError(f"overlap_steps must be an int >= 0 (0 = blocking syncs), got {overlap_steps!r}")
    if fragments == 1 and overlap_steps == 0:
        return
    if warmup_steps:
        raise ConfigError("fragments/overlap_steps do not combine with warmup_steps (warm-up syncs the "
                          "whole model every step): use warmup_steps=0, or run the warm-up with a "
                          "blocking optimizer and load its state")
    if not keep_presync:
        raise ConfigError("fragments/overlap_steps always keep a send snapshot (2/P of the synced "
                          "bytes): drop keep_presync=False")
    Schedule(sync_every, fragments, overlap_steps)  # K % P == 0 and tau < K/P, or ConfigError


def _validate_drift_denoise(fragments, overlap_steps, keep_presync, outer, wire) -> None:
    """denoise_moments="sync" reads each rank's drift from the consensus of a blocking sync of plain averaging."""
    if fragments > 1 or overlap_steps > 0:
        raise ConfigError("denoise_moments='sync' reads the drift at blocking syncs; with fragments/"
                          "overlap_steps use denoise_moments=True (at every step) or drop one of them")
    if not keep_presync:
        raise ConfigError("denoise_moments='sync' reads the drift from the pre-sync copy: drop "
                          "keep_presync=False")
    if wire != "fp32":
        raise ConfigError(f"denoise_moments='sync' is measured with the float32 sync only (a compressed "
                          f"consensus adds its rounding to the drift it reads): drop wire={wire!r}, or use "
                          "denoise_moments=True")
    if not isinstance(make_outer(outer), OuterAvg):
        raise ConfigError(f"denoise_moments='sync' is measured for plain averaging only (the outer "
                          f"step changes what a window's drift says); drop outer={outer!r}, or use "
                          "denoise_moments=True")


def _validate(optimizer, model, sync_every, warmup_steps, max_grad_norm, lr_scheduler, gamma) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"LocalSGDOptimizer wraps a built torch.optim.Optimizer, got "
                          f"{type(optimizer).__name__}; e.g. LocalSGDOptimizer(torch.optim.AdamW(model.parameters()))")
    if isinstance(optimizer, LocalSGDOptimizer):
        raise ConfigError("LocalSGDOptimizer is already wrapped; wrap the inner optimizer once")
    if model is not None and not isinstance(model, nn.Module):
        raise ConfigError(f"model must be an nn.Module (or its DDP wrapper), got {type(model).__name__}")
    make_adaptive(sync_every)  # raises on anything but an int >= 1, "auto" or an AdaptiveSync
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or
                                      not isinstance(max_grad_norm, (int, float)) or max_grad_norm <= 0):
        raise ConfigError(f"max_grad_norm must be a number > 0 or None, got {max_grad_norm!r}")
    if not isinstance(gamma, (int, float)) or isinstance(gamma, bool) or gamma < 0:
        raise ConfigError(f"gamma must be a number >= 0 (0 = equal weight among movers), got {gamma!r}")
    if lr_scheduler is not None:
        if not hasattr(lr_scheduler, "step") or getattr(lr_scheduler, "optimizer", None) is not optimizer:
            raise ConfigError("lr_scheduler must be a scheduler built on the inner optimizer you are "
                              "wrapping (its .optimizer is that optimizer)")
    opt_params = unique(p for g in optimizer.param_groups for p in g["params"])
    for p in opt_params:
        if not isinstance(p, torch.Tensor):
            raise ConfigError(f"optimizer params must be tensors, got {type(p).__name__}")
    if model is None:
        return
    inner = unwrap_model(model)
    for name, m in inner.named_modules():
        if getattr(m, "sparse", False) is True:
            raise ConfigError(f"flodl_opt: module {name or type(m).__name__} produces sparse gradients; "
                              "build it with sparse=False")
    opt_ids = {id(p) for p in opt_params}
    model_ids = {id(p) for p in inner.parameters()}
    missing = [n for n, p in inner.named_parameters() if p.requires_grad and id(p) not in opt_ids]
    if missing:
        raise ConfigError(f"flodl_opt: trainable params of the model are not in the optimizer: "
                          f"{missing[:8]}{' ...' if len(missing) > 8 else ''}. Build the optimizer on "
                          "model.parameters(), or set requires_grad=False on params you freeze.")
    extra = [tuple(p.shape) for p in opt_params if id(p) not in model_ids]
    if extra:
        raise ConfigError(f"flodl_opt: the optimizer holds {len(extra)} tensor(s) that are not params of "
                          f"the model (shapes {extra[:4]}); pass the model those params belong to")
