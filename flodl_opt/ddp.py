"""DDP drop-in: make a ``DistributedDataParallel`` model really train locally between syncs.

A DDP script keeps its model wrapper and changes one line, the optimizer::

    model = DistributedDataParallel(net)
    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model,
                                sync_every=16, warmup_steps=100)

Left alone, DDP would still all-reduce every gradient in every backward pass and broadcast
rank 0's buffers before every forward, so local SGD would save nothing. ``attach`` therefore

* registers a DDP communication hook that all-reduces and averages the gradient buckets while
  the optimizer is in warm-up (plain synchronous DDP, as in post-local SGD) and hands each rank
  its own local gradient afterwards (no communication);
* in local phases also lets DDP's reducer sit out the forward/backward entirely (no bucket
  copies, and no per-iteration unused-parameter bitmap all-reduce under
  ``find_unused_parameters=True``), the way ``no_sync()`` does; a user's own ``no_sync()``
  keeps working;
* turns off the per-forward buffer broadcast: float buffers ride the optimizer's sync instead.

The phase is read from the optimizer's step counter when the hook runs, so a resumed run
(``load_state_dict``) is in the right phase from its first backward pass.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .errors import AveragedElsewhereWarning, ConfigError

_ATTR = "_flodl_opt_bridge"


def is_ddp(model: Optional[nn.Module]) -> bool:
    from torch.nn.parallel import DistributedDataParallel
    return isinstance(model, DistributedDataParallel)


def find_ddp(model: Optional[nn.Module]) -> Optional[nn.Module]:
    """The DDP wrapper ``model`` is or holds under ``torch.compile`` (``_orig_mod``), else None.

    ``torch.compile(DDP(net))`` hides the DDP model; missed, it would all-reduce every gradient.
    """
    for _ in range(8):  # compile(compile(...)) nests; a few levels is plenty
        if model is None or is_ddp(model):
            return model
        model = model.__dict__.get("_modules", {}).get("_orig_mod")
    return None


def _trainer_ddp(model: Optional[nn.Module]) -> Optional[nn.Module]:
    """Lightning: the strategy's DDP wrapper around a LightningModule passed as ``model=self``.

    Read by duck typing (``module._trainer.strategy.model``), so Lightning is never imported.
    """
    trainer = model.__dict__.get("_trainer") if model is not None else None
    wrapper = getattr(getattr(trainer, "strategy", None), "model", None)
    if is_ddp(wrapper) and any(m is model for m in wrapper.module.modules()):
        return wrapper
    return None


def find_wrapper_of(model: Optional[nn.Module]) -> Optional[nn.Module]:
    """A DDP model built around ``model`` after the optimizer was (Accelerate, HF Trainer).

    ``accelerator.prepare(model, opt)`` and ``Trainer(optimizers=(opt, sched))`` wrap the model
    in DDP after the user built the optimizer, so ``model=`` never named the wrapper. Nothing
    points from a module to the DDP around it, so this looks through the live objects, once,
    at the first step (tens of ms for a million objects).
    """
    if model is None or is_ddp(model):
        return None
    import gc
    from torch.nn.parallel import DistributedDataParallel
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance() asks proxy objects for __class__, which can have
        # side effects (torch.distributed's deprecated reduce_op warns when asked)
        if issubclass(type(obj), DistributedDataParallel):
            wrapped = obj.__dict__.get("_modules", {}).get("module")
            if wrapped is not None and any(m is model for m in wrapped.modules()):
                return obj
    return None


class _Phase:
    """The hook's state: whether the optimizer that owns this DDP model is past its warm-up."""

    def __init__(self, optimizer: Any, warmup_steps: int, group, world_size: int):
        self.retarget(optimizer, warmup_steps)
        self.group, self.world_size = group, world_size

    def retarget(self, optimizer: Any, warmup_steps: int) -> None:
        self._opt = weakref.ref(optimizer)
        self.warmup_steps = warmup_steps

    @property
    def local(self) -> bool:
        opt = self._opt()
        # The backward being reduced belongs to step local_steps + 1: local once that is past warm-up.
        return opt is not None and opt.local_steps >= self.warmup_steps


def _local_sgd_hook(state, bucket):
    """DDP comm hook: average across ranks in warm-up, keep the local gradient afterwards.

    (No annotations: DDP checks them by identity, and this module's are strings.)
    """
    buf = bucket.buffer()
    if state.local:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut
    buf.div_(state.world_size)
    work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=state.group, async_op=True)
    return work.get_future().then(lambda f: f.value()[0])


class DDPBridge:
    """What ``LocalSGDOptimizer`` installs on a DDP model (one per model; re-wrapping retargets it)."""

    def __init__(self, ddp_model: nn.Module, optimizer: Any, warmup_steps: int):
        self.ddp = ddp_model
        group = getattr(ddp_model, "process_group", None)
        self.phase = _Phase(optimizer, warmup_steps, group, dist.get_world_size(group))
        try:
            ddp_model.register_comm_hook(self.phase, _local_sgd_hook)
        except RuntimeError as e:
            raise ConfigError(
                "flodl_opt: this DistributedDataParallel model already has a communication hook "
                "(register_comm_hook can be called once per model); LocalSGDOptimizer needs its own "
                f"to skip the gradient all-reduce between syncs. Remove the other hook. ({e})") from e
        _stop_buffer_broadcast(ddp_model)
        self._bypassed = False
        # static_graph replays a recorded reducer schedule: leave its reducer engaged (the hook
        # alone keeps local phases local there).
        self._handles = [] if getattr(ddp_model, "static_graph", False) else [
            ddp_model.register_forward_pre_hook(self._pre_forward),
            ddp_model.register_forward_hook(self._post_forward),
        ]

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if self.phase.local and module.require_backward_grad_sync:
            module.require_backward_grad_sync = False  # as no_sync(): the reducer sits this one out
            self._bypassed = True

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._bypassed:
            module.require_backward_grad_sync = True
            self._bypassed = False


def _stop_buffer_broadcast(ddp_model: nn.Module) -> None:
    """Turn off DDP's broadcast of rank 0's buffers before each forward.

    torch <= 2.12 reads the plain attribute ``broadcast_buffers``; later versions read
    ``forward_sync_buffers`` (``broadcast_buffers`` became a property over it). Set both.
    """
    if hasattr(ddp_model, "forward_sync_buffers"):
        ddp_model.forward_sync_buffers = False
    ddp_model.broadcast_buffers = False


def attach(model: Optional[nn.Module], optimizer: Any, warmup_steps: int,
           process_group=None) -> Optional[DDPBridge]:
    """Install the local-SGD bridge on ``model`` if it is (or compiles) a DDP model; None otherwise."""
    model = find_ddp(model) or _trainer_ddp(model)
    if model is None or not dist.is_initialized():
        return None
    ddp_group = getattr(model, "process_group", None)
    if dist.get_world_size(ddp_group) != dist.get_world_size(process_group):
        raise ConfigError("flodl_opt: the DistributedDataParallel model and LocalSGDOptimizer use "
                          "process groups of different sizes; pass the DDP model's group as "
                          "process_group=")
    bridge = getattr(model, _ATTR, None)
    if bridge is not None:
        bridge.phase.retarget(optimizer, warmup_steps)
        return bridge
    bridge = DDPBridge(model, optimizer, warmup_steps)
    setattr(model, _ATTR, bridge)
    return bridge


# Identical weights averaged with equal weights come back exact (divergence 0.0); other weights
# or more ranks can leave a few float32 roundings. Real local steps leave far more than this.
_SAME_WEIGHTS = 1e-6


def watch_local_progress(stats: Any, world_size: int) -> bool:
    """Warn if the ranks were identical before a sync after several local steps; keep watching?

    Decided once, at the first sync where every rank took 2+ steps since the previous one. A
    sync in warm-up (one step) or of a partly idle cohort cannot tell, so watching goes on.
    """
    if world_size < 2 or stats.skipped or stats.nonfinite_ranks or stats.divergence is None:
        return True
    if stats.steps < 2 or stats.movers < world_size or stats.cohort_steps < 2 * world_size:
        return True
    if stats.divergence <= _SAME_WEIGHTS:
        warnings.warn(
            f"flodl_opt: sync #{stats.sync} found this rank's weights equal to the consensus "
            f"(divergence {stats.divergence:.1e}) after {stats.steps} local steps on every rank: "
            "something else averaged the gradients every step, so no local SGD happened (and no "
            "communication was saved). Pass the DistributedDataParallel wrapper as model= (e.g. "
            "model=ddp_model or model=torch.compile(ddp_model)); under Lightning, "
            "model=self.trainer.strategy.model, or a strategy without DDP's all-reduce. "
            "Or: every rank reads the same batches (use a DistributedSampler).",
            AveragedElsewhereWarning, stacklevel=5)
    return False
