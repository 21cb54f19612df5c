"""LocalSGDOptimizer: wrap any torch optimizer; ranks train locally and agree every K steps.

The data path of one ``step()``::

    clip (global norm)  ->  inner step  ->  scheduler step  ->  count  ->  every K steps: sync
    sync = count -> reduce (one fused in-place collective per flat buffer) -> readout -> outer step

With ``fragments=P`` / ``overlap_steps=tau`` (flodl_opt/sync/streaming.py) the sync is per fragment:
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
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from . import ddp, launch
from . import provenance  # who saved a state dict, live optimizers (flodl_opt/provenance.py)
from .amp import scaler_says_skip
from .build import build_sync
from .checks import check_grads, check_model_params, check_objects, reset_nonfinite_state
from .config import SyncConfig
from .cuda_streams import fence_before_sync, stream_key
from .errors import ConfigError
from .hooks.adaptive import AdaptiveSync
from .hooks.base import SyncPoint
from .hooks.outer import OuterSpec
from .stall import DEFAULT_STALL_WARNING_S
from .state import LocalSGDState
from .sync.schedule import round_period
from .sync.stats import SyncStats
from .transport.float32 import DEFAULT_GLOO_CHUNK_BYTES
from .transport.wire import DEFAULT_WIRE_BLOCK
from .wrapping import WrappedOptimizer, global_step_hooks

__all__ = ["LocalSGDOptimizer"]


class LocalSGDOptimizer(LocalSGDState, WrappedOptimizer):
    """Local SGD around any torch optimizer, with a work-weighted consensus every ``sync_every`` steps.

    Args:
        optimizer: an already built torch optimizer (its ``param_groups`` are shared, not copied).
        model: the model (or its DDP wrapper). Its float buffers (BatchNorm running stats) ride the
            sync, and its trainable params are checked against the optimizer's.
        sync_every: K, local steps between syncs (>= 1; K=1 is synchronous model averaging), or
            ``"auto"`` / an ``AdaptiveSync(...)``: K chosen after each sync from the cohort's
            all-reduced divergence, identically on every rank (flodl_opt/hooks/adaptive.py).
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
            (1/2, 1/2, ~1/4 of the bytes; flodl_opt/transport/wire.py says how and what it costs).
        wire_block: elements per int8 scale (``wire="int8"``).
        error_feedback: carry each rank's quantization residual into its next sync (compressed
            wires only; the residual is in ``state_dict``).
        fragments: P, sync the model a fragment (~1/P of the bytes, whole tensors in layer order)
            at a time, fragment p at the steps ``t % K == p*K/P`` (``K % P == 0``).
        overlap_steps: tau < K/P, keep training tau steps while a fragment's sync is in flight,
            then merge it as ``W <- G + (W - S)`` (flodl_opt/sync/streaming.py). Defaults (1, 0)
            are the blocking sync, bit for bit.
        sync_moments: also share an Adam/AdamW inner optimizer's moments at every sync, the
            second moment with the excess noise of each rank's small batch taken out, so local
            steps move as gradient all-reduce's would (flodl_opt/hooks/moments.py; 4x the sync's bytes).
        sync_moments_every: with ``sync_moments``, share the moments at every N-th sync only, over
            the steps since the last share: on average ``1 + 3/N`` times a plain sync's bytes.
        sync_moments_wire: with ``sync_moments``, how the moments travel: ``"fp32"`` (default) or
            ``"bf16"`` (half their bytes, summed in float32: ``1 + 1.5/N`` times a plain sync's).
        denoise_moments: take that excess out of each rank's own Adam/AdamW second moment
            instead, with nothing sent: ``True`` at every step, measured from the rank's own
            gradients (every sync mode); ``"sync"`` at every sync, read from how far the rank's
            params drifted from the consensus (blocking float32 syncs without an outer optimizer; one
            param-sized EMA of state). flodl_opt/hooks/moments.py has both formulas. Ranks' batches
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
        check_objects(optimizer, model, lr_scheduler, LocalSGDOptimizer)
        cfg = SyncConfig.build(
            optimizer, sync_every=sync_every, warmup_steps=warmup_steps, outer=outer, max_grad_norm=max_grad_norm,
            gamma=gamma, fragments=fragments, overlap_steps=overlap_steps, broadcast_initial=broadcast_initial,
            keep_presync=keep_presync, nonfinite_guard=nonfinite_guard, gloo_chunk_bytes=gloo_chunk_bytes,
            stall_warning_s=stall_warning_s, wire=wire, wire_block=wire_block, error_feedback=error_feedback,
            sync_moments=sync_moments, denoise_moments=denoise_moments, sync_moments_every=sync_moments_every,
            sync_moments_wire=sync_moments_wire)
        launch.ensure_init()
        self._share(optimizer)  # the inner optimizer's param_groups and state (flodl_opt/wrapping.py)
        self.options, self.model, self.lr_scheduler, self.process_group = cfg, model, lr_scheduler, process_group
        self.warmup_steps, self.max_grad_norm, self.gamma = cfg.warmup_steps, cfg.max_grad_norm, cfg.gamma
        self.fragments, self.overlap_steps, self.outer = cfg.fragments, cfg.overlap_steps, cfg.outer
        self._adaptive: Optional[AdaptiveSync] = cfg.adaptive
        if self._adaptive is not None and cfg.streaming:  # the fragment schedule runs multiples of P
            self._adaptive.every = round_period(self._adaptive.every, self._adaptive, cfg.fragments,
                                                cfg.overlap_steps)
        self.sync_every = cfg.period  # the period in effect now; "auto" updates it after every sync
        parts = build_sync(self, cfg, optimizer, model, process_group)
        self._world, self._rank, self._params = parts.world, parts.rank, parts.params
        self._param_groups_flat, self._buffer_groups_flat = parts.param_groups, parts.buffer_groups
        self._consensus, self._wire, self._stream = parts.consensus, parts.wire, parts.stream
        self._denoise, self._drift, self._hooks = parts.denoise, parts.drift, parts.hooks
        self._cuda_index, self._stall, self._param_slots = parts.cuda_index, parts.stall, parts.param_slots
        self._train_stream: Optional[tuple] = None  # stream of the last inner step (CUDA only)
        self._stream_fence = True  # private switch: the GPU tests turn it off to prove they can fail
        self._local_steps = 0        # step() calls on this rank, GradScaler-skipped ones too
        self._steps_since_sync = 0   # steps since the last sync (the schedule's clock)
        self._skipped_since_sync = 0  # of which GradScaler skipped (no work): n_i = the difference
        self._sync_count = 0
        self._global_steps = 0       # steps taken by the whole cohort, summed at syncs
        self._joined = False
        self._checked_grads = False
        self._watch_local = self._world > 1  # until a sync shows the ranks really trained apart
        self.last_sync: Optional[SyncStats] = None
        # A DDP model: stop its per-step gradient all-reduce after warm-up (flodl_opt/ddp.py).
        self._ddp = ddp.attach(model, self, self.warmup_steps, process_group) if self._world > 1 else None
        provenance.register(self)  # exit warnings, DCP in-place loads, framework-wrapped inner optimizers

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
        if self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks or global_step_hooks():
            return self._step_with_hooks(closure)
        return self._step(closure)

    step.hooked = True  # type: ignore[attr-defined]  # tells Optimizer._patch_step_function not to wrap it

    def _step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        if not self._checked_grads:  # once, at the first step
            check_grads(self._params)
            self._checked_grads = True
            self._find_late_ddp()
        # GradScaler found inf/NaN (None unless it called us), or no backward() reached any param:
        # no work, so no vote at the next sync
        skipped = scaler_says_skip(self, self._params) or \
            (closure is None and not any(p.grad is not None for p in self._params))
        loss = None if skipped else self._inner_step(closure)  # skipped: the step still counts (zero work)
        if self._drift is not None and not skipped:
            self._drift.count()   # the lr this step moved the params with, before the scheduler moves it
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        if self._cuda_index is not None:
            # Remember the stream the inner step ran on (a tuple, no Stream object: ~0.3 us),
            # so a sync issued from another stream can be ordered after it (see _sync).
            self._train_stream = stream_key(self._cuda_index)
        self._local_steps += 1           # count
        self._steps_since_sync += 1
        self._skipped_since_sync += bool(skipped)
        warmup = self._local_steps <= self.warmup_steps
        if self._stream is not None and not warmup:  # per fragment: issue (count + async reduce) / merge
            if self._stream.due(self._stream.clock + 1):
                self._check_before_sync()
            self._record(self._stream.on_step(worked=not skipped, active=True))
        elif warmup or self._steps_since_sync >= self.sync_every:
            if self._stream is not None and not skipped:
                self._stream.count_step()
            self._sync()                 # sync -> outer step (the hooks)
        return loss

    def _inner_step(self, closure: Optional[Callable[[], Any]]) -> Any:
        """clip -> the inner optimizer's step (with the per-step denoise around it when on)."""
        if self._denoise is not None:
            return self._denoised_inner_step(closure)
        if self.max_grad_norm is None:
            return self.optimizer.step() if closure is None else self.optimizer.step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        torch.nn.utils.clip_grad_norm_(self._params, self.max_grad_norm)
        self.optimizer.step()
        return loss

    def _denoised_inner_step(self, closure: Optional[Callable[[], Any]]) -> Any:
        """clip -> inner step, the step's second-moment noise excess taken out (flodl_opt/hooks/moments.py)."""
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
        """before-hooks -> consensus (count -> reduce -> readout) -> counters -> after-hooks."""
        for g in self._param_groups_flat + self._buffer_groups_flat:
            g.check_bound()
        train = fence_before_sync(self._train_stream, self._cuda_index, self._stream_fence)
        try:
            if self._stream is not None:  # merge what is in flight, then every fragment, blocking
                check_model_params(self._param_slots, self.model)
                self._record(self._stream.sync_all(active=not self._joined,
                                                   warmup=self._local_steps <= self.warmup_steps))
                assert self.last_sync is not None
                return self.last_sync
            point = SyncPoint(self._steps_since_sync - self._skipped_since_sync, self._sync_count + 1,
                              self._local_steps <= self.warmup_steps, self._waiting)
            for h in self._hooks:
                h.before(point)      # shared moments: reduced, not yet written
            point.stats = stats = self._run_consensus(point.steps, point.number, active=not self._joined)
            self._sync_count += 1
            self._global_steps += stats.cohort_steps
            self._steps_since_sync = self._skipped_since_sync = 0
            for h in self._hooks:
                h.after(point)       # moments written, drift read, outer step, next period
            if self._adaptive is not None:
                self.sync_every = self._adaptive.every
            if self._watch_local:  # warns if something else averaged the gradients (ddp.py)
                self._watch_local = ddp.watch_local_progress(stats, self._consensus.world_size)
            stats.next_every = self.sync_every
        finally:
            if train is not None:  # the next forward on the training stream comes after the sync
                train.wait_stream(torch.cuda.current_stream(train.device))
        self.last_sync = stats
        return stats

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
        check_model_params(self._param_slots, self.model)

    def _waiting(self, sync_number: int):
        return self._stall.waiting(sync_number) if self._stall is not None else contextlib.nullcontext()

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
        check_model_params(self._param_slots, self.model)
        with self._waiting(sync_number):
            stats = self._consensus.run(steps, sync_number, active=active)
        if stats.nonfinite:
            reset_nonfinite_state(self.optimizer, self._rank, sync_number)
        return stats

    # ------------------------------------------------------------ set-up checks
    def _find_late_ddp(self) -> None:
        """A DDP wrapper built after this optimizer (Accelerate's ``prepare(model, opt)``, the HF
        Trainer) would all-reduce every gradient: find it and make it local, as if passed."""
        if self._ddp is not None or self.model is None or not self._watch_local:
            return
        found = ddp.find_wrapper_of(self.model)
        if found is not None:
            self._ddp = ddp.attach(found, self, self.warmup_steps, self._consensus.group)


