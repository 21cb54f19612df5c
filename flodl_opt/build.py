"""Assembling a LocalSGDOptimizer's sync from its config: flat buffers, transport, schedule, hooks.

``build_sync`` is the one place that turns a ``SyncConfig`` into parts; ``LocalSGDOptimizer`` only
runs them. Order matters and is kept here: pack the tensors (their storage moves into the flat
buffers), check that every rank wraps the same thing, broadcast rank 0's start, then set up what
reads that start (the outer anchor, the wire's anchor, the streaming buffers).
"""
from __future__ import annotations

import functools
import hashlib
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import launch
from .checks import reset_nonfinite_state, unwrap_model
from .config import SyncConfig
from .sync.consensus import Consensus
from .sync.flat import FlatGroup, own_storage_state_dicts, pack, signature, unique
from .hooks.base import AdaptiveHook, DriftHook, Hook, MomentsHook, OuterHook, StateHook
from .hooks.moments import DriftDenoise, LocalDenoise, MomentSync
from .stall import StallWatchdog
from .sync.streaming import StreamingSync
from .transport.codecs import make_codec
from .transport.wire import CompressedWire, make_wire
from .wrapping import check_same_on_every_rank


@dataclass
class SyncParts:
    world: int
    rank: int
    params: List[torch.Tensor]
    param_groups: List[FlatGroup]
    buffer_groups: List[FlatGroup]
    consensus: Consensus
    wire: Optional[CompressedWire]
    stream: Optional[StreamingSync]
    denoise: Optional[LocalDenoise]
    drift: Optional[DriftDenoise]
    hooks: List[Hook]
    cuda_index: Optional[int]
    stall: Optional[StallWatchdog]
    param_slots: list


def build_sync(opt: Any, cfg: SyncConfig, optimizer: torch.optim.Optimizer, model: Optional[nn.Module],
               group: Optional[dist.ProcessGroup]) -> SyncParts:
    """Every part of ``opt``'s sync, built from ``cfg`` (``opt``: for the callbacks that read its lr and state)."""
    world = dist.get_world_size(group) if launch.size() > 1 else 1
    rank = dist.get_rank(group) if world > 1 else 0
    # The synced set, fixed now: trainable params (work-weighted), float buffers (mover-weighted).
    params = unique(p for g in optimizer.param_groups for p in g["params"])
    inner_model = unwrap_model(model) if model is not None else None
    float_buffers = [b for b in unique(inner_model.buffers()) if b.is_floating_point()] \
        if inner_model is not None else []
    param_groups = pack(params, "param")
    wire = make_wire(cfg.wire, cfg.wire_block, cfg.error_feedback)  # None: the float32 reduce
    if wire is not None:
        wire.check_groups(param_groups)
        if cfg.streaming:  # fragments carry their own compressed reduce (flodl_opt/transport/stream_wire.py)
            wire = None
    buffer_groups = pack(float_buffers, "buffer")
    if inner_model is not None:  # packed tensors share one storage: state_dict() hands out copies
        own_storage_state_dicts(inner_model)
    consensus = Consensus(param_groups, buffer_groups, group, world, rank, launch.backend(), gamma=cfg.gamma,
                          keep_presync=cfg.keep_presync, nonfinite_guard=cfg.nonfinite_guard,
                          gloo_chunk_bytes=cfg.gloo_chunk_bytes)
    moments = MomentSync(optimizer, params, [g.flat for g in param_groups], cfg.gamma, group,
                         consensus.comm_device, consensus.distributed, rank, every=cfg.sync_moments_every,
                         wire=cfg.sync_moments_wire, world=world) if cfg.sync_moments else None
    # a world of one has no small-batch excess to take out
    denoise = LocalDenoise(optimizer, world) if cfg.denoise_moments is True and world > 1 else None
    drift = DriftDenoise(optimizer, params) if cfg.denoise_moments == "sync" and world > 1 else None
    if world > 1:
        check_same_everywhere(config_record(cfg, param_groups + buffer_groups), model_layout(inner_model, params),
                              group)
        if cfg.broadcast_initial:
            broadcast_from_root(param_groups + buffer_groups, inner_model, group)
    cfg.outer.setup(param_groups, world)
    if wire is not None:  # shares the outer optimizer's anchor when it keeps one
        wire.bind(param_groups, cfg.outer.anchor if cfg.outer.needs_anchor else None, world, rank, group)
        consensus.wire = wire
    stream = None
    if cfg.streaming:
        stream = StreamingSync(
            param_groups, params, buffer_groups, float_buffers, cfg.outer, cfg.period, cfg.fragments,
            cfg.overlap_steps, group, world, rank, launch.backend(), gamma=cfg.gamma,
            nonfinite_guard=cfg.nonfinite_guard, gloo_chunk_bytes=cfg.gloo_chunk_bytes,
            inner_lr=lambda: optimizer.param_groups[0]["lr"],
            on_nonfinite=functools.partial(reset_nonfinite_state, optimizer, rank), waiting=opt._waiting,
            auto=cfg.adaptive,
            codec=make_codec(cfg.wire, cfg.wire_block) if cfg.compressed else None,
            error_feedback=cfg.error_feedback)
        stream.setup_outer()
    hooks: List[Hook] = []
    if moments is not None:
        hooks.append(MomentsHook(moments))
    if drift is not None:
        hooks.append(DriftHook(drift, consensus))
    hooks.append(OuterHook(cfg.outer, consensus, optimizer))
    if cfg.adaptive is not None:
        hooks.append(AdaptiveHook(cfg.adaptive, consensus, rank))
    if wire is not None:
        hooks.append(StateHook("wire", wire))
    if stream is not None:
        hooks.append(StateHook("stream", stream))
    # CUDA: packing copied every tensor into its flat buffer on the current stream and freed
    # the old storage, which the caching allocator may hand to another stream at once; the
    # anchor copies above are queued too. Let them land before any stream touches the params.
    cuda = [g.device for g in param_groups + buffer_groups if g.device.type == "cuda"]
    for index in sorted({d.index for d in cuda}):
        torch.cuda.synchronize(index)
    stall = None
    if world > 1 and cfg.stall_warning_s is not None:
        stall = make_watchdog(float(cfg.stall_warning_s), group)
        weakref.finalize(opt, stall.close)
    # (module, attribute, param) of every trainable param: a sync checks that none was
    # replaced, with dict lookups only (named_parameters() would walk the module tree).
    slots = [(mod, name, p) for mod in (inner_model.modules() if inner_model is not None else ())
             for name, p in mod._parameters.items() if p is not None and p.requires_grad]
    return SyncParts(world, rank, params, param_groups, buffer_groups, consensus, wire, stream, denoise, drift,
                     hooks, cuda[0].index if cuda else None, stall, slots)


def config_record(cfg: SyncConfig, groups: List[FlatGroup]) -> dict:
    """The options as checkpoints record them, and the synced tensors' layout (``opt.config()``)."""
    return {**cfg.record(), "flat": [(r, d, [list(s) for s in shapes]) for r, d, shapes in signature(groups)]}


def model_layout(model: Optional[nn.Module], params: List[torch.Tensor]) -> list:
    """The synced params in packing order (the optimizer's) by name, then the model's params and buffers
    with names, shapes, dtypes and requires_grad, in order: same-shaped params in another order, or a
    param frozen on one rank only, change it (shapes alone do not)."""
    names = {id(t): n for n, t in model.named_parameters()} if model is not None else {}
    order = [(names.get(id(p), "?"), tuple(p.shape), str(p.dtype)) for p in params]
    if model is None:
        return order
    return order + [(n, tuple(t.shape), str(t.dtype), bool(t.requires_grad))
                    for n, t in list(model.named_parameters()) + list(model.named_buffers())]


def check_same_everywhere(cfg: dict, layout: list, group: Optional[dist.ProcessGroup]) -> None:
    """Every rank must wrap the same tensors with the same config, or the collectives misalign, or
    (same shapes in another order) average each tensor with another rank's other tensor."""
    keys = list(SyncConfig.agreed(strict=True))
    desc = {"flat": cfg["flat"], "layout": layout, **{k: cfg[k] for k in keys}}
    summary = {"groups": [(r, d, len(s), sum(_numel(x) for x in s)) for r, d, s in cfg["flat"]],
               "layout": hashlib.sha1(repr(layout).encode()).hexdigest()[:10],
               "frozen": [t[0] for t in layout if len(t) == 4 and not t[3]][:4], **{k: cfg[k] for k in keys}}
    check_same_on_every_rank(desc, summary, group, "flodl_opt: ranks wrap different models or configs",
                             "groups are (role, dtype, tensors, elements); layout is a digest of the synced params' "
                             "order and the model's param and buffer names, shapes, dtypes and requires_grad; frozen "
                             "lists params with requires_grad=False", "LocalSGDOptimizer")


def broadcast_from_root(groups: List[FlatGroup], inner_model: Optional[nn.Module],
                        group: Optional[dist.ProcessGroup]) -> None:
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for g in groups:
            dist.broadcast(g.flat, src=src, group=group)
        if inner_model is not None:  # frozen params and integer buffers: few and small
            synced = {id(t) for g in groups for t in g.tensors}
            for t in list(inner_model.parameters()) + list(inner_model.buffers()):
                if id(t) not in synced:
                    dist.broadcast(t.data, src=src, group=group)


def make_watchdog(threshold_s: float, group: Optional[dist.ProcessGroup]) -> StallWatchdog:
    ranks = dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))
    tag = getattr(group, "group_name", None) or "world" if group is not None else "world"
    return StallWatchdog(threshold_s, ranks=ranks, rank=dist.get_rank(), tag=str(tag))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
