"""Horovod's raw collectives: ``allreduce``, ``allgather``, ``broadcast``, their ``_async`` forms,
``grouped_allreduce``, ``poll``/``synchronize``, ``join`` and ``barrier``, with Horovod's guarantees.

Every call first exchanges a small fixed-size signature (kind, dtype, device, shape, op or root,
name, scale factors, whether it needs a gradient) with one ``all_gather``, then moves the data.
So ranks that disagree get a ``CollectiveMismatchError`` on every rank instead of a crash inside
Gloo, a hang or silently wrong numbers, and a rank inside ``join()`` learns what its peers reduce
and answers with a neutral contribution. Calls pair across ranks by call order, not by name as in
Horovod (the package docstring, ``flodl_opt/horovod/__init__.py``, says why): a reordered pair of
named calls raises on every rank, naming both. The extra round costs one tiny collective per call:
these functions are for metrics and other small tensors (``DistributedOptimizer`` does not use them).

Example::

    import torch, flodl_opt as hvd
    hvd.init()
    loss = hvd.allreduce(torch.tensor(0.5), name="loss")             # mean over ranks
    rows = hvd.allgather(torch.full((1 + hvd.rank(), 2), 1.0))       # first dims may differ
    h = hvd.allreduce_async(torch.arange(4), op=hvd.Sum, name="n")
    total = hvd.synchronize(h)
    last = hvd.join()                       # this rank is out of data; serve peers' allreduces
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .common import (_ALLGATHER, _ALLREDUCE, _ARG, _BARRIER, _BROADCAST, _DIMS, _DTYPE, _DTYPES, _JOIN,
                     _KIND, _KIND_NAMES, _OPS, _ROUNDS, Average, Compression, Max, Min, Product, ReduceOp,
                     Sum, _Agreement, _Call, _comm_device, _exchange, _group_size, _negotiate, _op,
                     _sig_numel)

__all__ = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "allgather", "allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "poll", "synchronize", "join",
    "barrier", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_allgather", "grouped_allgather_async",
]

# ---------------------------------------------------------------- staging
_TORCH_OP = {"Sum": dist.ReduceOp.SUM, "Average": dist.ReduceOp.SUM, "Min": dist.ReduceOp.MIN,
             "Max": dist.ReduceOp.MAX, "Product": dist.ReduceOp.PRODUCT}

# Gloo has no kernels for these: reductions run in int64, gathers and broadcasts move raw bytes.
_INT_STAGED = {d for d in (torch.int16, getattr(torch, "uint16", None), getattr(torch, "uint32", None))
               if d is not None}
_BYTES_ONLY = {d for d in (torch.int16, getattr(torch, "uint16", None), getattr(torch, "uint32", None),
                           getattr(torch, "uint64", None), getattr(torch, "float8_e4m3fn", None),
                           getattr(torch, "float8_e5m2", None)) if d is not None}


# ---------------------------------------------------------------- handles
@dataclass
class _Pending:
    works: List[Any]
    finish: Callable[[], torch.Tensor]
    key: Optional[Tuple[int, str]]


_handles: Dict[int, _Pending] = {}
_in_flight: Set[Tuple[int, str]] = set()
_next_handle = itertools.count(1)


def _reserve(kind: int, name: Optional[str]) -> Tuple[Optional[Tuple[int, str]], Optional[str]]:
    if name is None:
        return None, None
    key = (kind, str(name))
    if key in _in_flight:
        return None, (f"a {_KIND_NAMES[kind]} named {name!r} is still in flight: synchronize() its "
                      "handle first, or give this one another name")
    return key, None


def _submit(works: List[Any], finish: Callable[[], torch.Tensor], key) -> int:
    handle = next(_next_handle)
    if key is not None:
        _in_flight.add(key)
    _handles[handle] = _Pending(works, finish, key)
    return handle


def poll(handle: int) -> bool:
    """True once the collective behind ``handle`` has finished (``synchronize`` will not block)."""
    pending = _handles.get(handle)
    if pending is None:
        raise ConfigError(f"poll(): unknown handle {handle!r} (already synchronized, or not a handle)")
    return all(w.is_completed() for w in pending.works)


def synchronize(handle: int) -> torch.Tensor:
    """Wait for the collective behind ``handle`` and return its result tensor (a list of them for
    a ``grouped_allreduce_async`` handle).

    Example::

        h = hvd.allreduce_async(torch.ones(3), name="ones")
        ...                                   # overlap other work
        mean = hvd.synchronize(h)
    """
    pending = _handles.pop(handle, None)
    if pending is None:
        raise ConfigError(f"synchronize(): unknown handle {handle!r} (already synchronized, or not a handle)")
    try:
        for w in pending.works:
            w.wait()
        return pending.finish()
    finally:
        if pending.key is not None:
            _in_flight.discard(pending.key)


def _done(result: torch.Tensor, key) -> int:
    return _submit([], lambda: result, key)


# ---------------------------------------------------------------- allreduce
def _is_int(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _reduce_wire_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.bool:
        return torch.int32
    if dtype in _INT_STAGED:
        return torch.int64
    return dtype


def _identity(op: ReduceOp, dtype: torch.dtype) -> float:
    """What a joined rank contributes: the op's neutral element (zero for Sum/Average)."""
    if op is Min or op is Max:
        if dtype == torch.bool:
            return 1 if op is Min else 0
        if dtype.is_floating_point:
            return math.inf if op is Min else -math.inf
        info = torch.iinfo(dtype)
        return info.max if op is Min else info.min
    return 1 if op is Product else 0


def _check_reduce_args(tensor: torch.Tensor, op: ReduceOp, pre: float, post: float,
                       grad: bool) -> Optional[str]:
    dt = tensor.dtype
    if dt not in _DTYPES or dt in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)):
        return f"allreduce of a {dt} tensor is not supported; convert it (e.g. .float()) first"
    if dt == getattr(torch, "uint64", None) and op is not Sum:
        return f"allreduce of a uint64 tensor supports op=Sum only, got {op!r}"
    if dt == torch.bool and (op is Average or pre != 1.0 or post != 1.0):
        return "allreduce of a bool tensor: Average and scale factors need numbers; convert it with .int()"
    if tensor.is_complex() and op in (Min, Max):
        return f"allreduce of a complex tensor with {op!r}: complex numbers have no order"
    if grad and op is Product:
        return "allreduce(op=Product) is not differentiable here: detach the tensor or use Sum/Average"
    return None


def _scale(t: torch.Tensor, factor: float, divide_by: int = 1) -> torch.Tensor:
    """Scale in place; integers are scaled in float64 and truncated toward zero (as Horovod does)."""
    if factor == 1.0 and divide_by == 1:
        return t
    if _is_int(t.dtype):
        d = t.double().mul_(factor)
        if divide_by != 1:
            d.div_(divide_by)
        return t.copy_(d.trunc_())
    return t.mul_(factor / divide_by)  # floats: one multiply by post/n, as before


def _reduce_work(flat: torch.Tensor, op: ReduceOp, group) -> Tuple[torch.Tensor, Any]:
    """Stage ``flat`` (on the comm device) for Gloo/NCCL and start the reduction."""
    wire_dtype = _reduce_wire_dtype(flat.dtype)
    if flat.dtype == getattr(torch, "uint64", None):
        wire = flat.view(torch.int64)  # Sum only: two's complement addition is the same bits
    else:
        wire = flat if wire_dtype == flat.dtype else flat.to(wire_dtype)
    return wire, dist.all_reduce(wire, op=_TORCH_OP[op.name], group=group, async_op=True)


def _unstage(wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return wire != 0
    if wire.dtype == dtype:
        return wire
    if dtype == getattr(torch, "uint64", None):
        return wire.view(dtype)
    return wire.to(dtype)


def _start_allreduce(tensor: torch.Tensor, out: torch.Tensor, op: ReduceOp, pre: float, post: float,
                     name: Optional[str], group, grad: bool = False, error: Optional[str] = None) -> int:
    """Negotiate, prescale, start the reduction; the handle's finish writes ``out``."""
    n = _group_size(group)
    key, busy = _reserve(_ALLREDUCE, name)
    error = error or busy or _check_reduce_args(tensor, op, pre, post, grad)
    if n == 1:
        if error:
            raise ConfigError(error)
        with torch.no_grad():
            if out is not tensor:
                out.copy_(tensor)
            _scale(out, pre)
            _scale(out, post, 1)  # Average over one rank divides by one
        return _done(out, key)
    call = _Call(_ALLREDUCE, name, tensor.dtype, tensor.device.type, tuple(tensor.shape),
                 _OPS.index(op), grad, float(pre), float(post), error=error)
    _negotiate(call, group)
    dev = _comm_device()
    with torch.no_grad():
        flat = tensor.detach().reshape(-1).to(dev, copy=True)  # ours to scale and reduce in place
        _scale(flat, pre)
        wire, work = _reduce_work(flat, op, group)

    def finish() -> torch.Tensor:
        with torch.no_grad():
            res = _unstage(wire, tensor.dtype)
            _scale(res, post, n if op is Average else 1)
            out.copy_(res.view(out.shape))
        return out

    return _submit([work], finish, key)


def _serve_allreduce(agreement: _Agreement, group) -> None:
    """A joined rank's part in its peers' allreduce: the op's neutral element, same size and dtype."""
    ref = agreement.ref
    dtype, op = _DTYPES[ref[_DTYPE] - 1], _OPS[ref[_ARG]]
    flat = torch.full((_sig_numel(ref),), _identity(op, dtype), dtype=dtype, device=_comm_device())
    _reduce_work(flat, op, group)[1].wait()


class _AllreduceFn(torch.autograd.Function):
    """allreduce with a gradient: the gradient's own allreduce (the loss is the sum over ranks)."""

    @staticmethod
    def forward(ctx, tensor, op, pre, post, name, group):  # type: ignore[override]
        ctx.op, ctx.pre, ctx.post, ctx.group = op, pre, post, group
        out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        if op is Min or op is Max:
            # Keep the unscaled extreme: the gradient goes where this rank's (prescaled) value is it.
            raw = synchronize(_start_allreduce(tensor, out, op, pre, 1.0, name, group, grad=True))
            ctx.save_for_backward(_scale(tensor.detach().clone(), pre) == raw)
            return _scale(raw.clone(), post)
        return synchronize(_start_allreduce(tensor, out, op, pre, post, name, group, grad=True))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        op, group = ctx.op, ctx.group
        if op is Min or op is Max:
            # d max_r(x_r) / d x_r = 1 on the rank(s) holding the extreme; ties share it.
            mask = ctx.saved_tensors[0].to(grad.dtype)
            both = allreduce(torch.stack([grad.contiguous(), mask]), op=Sum, process_group=group)
            scale = ctx.pre * ctx.post
            return both[0] * mask / both[1].clamp(min=1) * scale, None, None, None, None, None
        return allreduce(grad, op=op, prescale_factor=ctx.pre, postscale_factor=ctx.post,
                         process_group=group), None, None, None, None, None


def _require_tensor(kind: int, tensor: Any, name: Optional[str], group) -> None:
    """Refuse a non-tensor on every rank (it still sends a refusing signature, so peers raise too)."""
    if isinstance(tensor, torch.Tensor):
        return
    error = (f"{_KIND_NAMES[kind]} takes a torch.Tensor, got {type(tensor).__name__}"
             + (" (e.g. the .grad of a parameter that has none yet)" if tensor is None else ""))
    if _group_size(group) > 1:
        _negotiate(_Call(kind, name, error=error), group)
    raise ConfigError(error)


def _reduce_args(average, op, prescale_factor, postscale_factor) -> Tuple[ReduceOp, float, float, Optional[str]]:
    """The op and factors, or a refusal that travels in the signature (so every rank raises)."""
    try:
        return _op(op, average), float(prescale_factor), float(postscale_factor), None
    except (ConfigError, TypeError, ValueError) as e:
        return Sum, 1.0, 1.0, str(e)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_group=None) -> int:
    """Start an in-place allreduce of ``tensor``; returns a handle for ``poll``/``synchronize``."""
    _require_tensor(_ALLREDUCE, tensor, name, process_group)
    op_, pre, post, error = _reduce_args(average, op, prescale_factor, postscale_factor)
    return _start_allreduce(tensor, tensor, op_, pre, post, name, process_group, error=error)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_group=None) -> int:
    """Start an allreduce into a new tensor (``tensor`` is not modified); returns a handle.

    Example::

        h = hvd.allreduce_async(torch.tensor([n_correct]), op=hvd.Sum, name="correct")
        correct = hvd.synchronize(h)
    """
    _require_tensor(_ALLREDUCE, tensor, name, process_group)
    op_, pre, post, error = _reduce_args(average, op, prescale_factor, postscale_factor)
    out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _start_allreduce(tensor, out, op_, pre, post, name, process_group, error=error)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_group=None, compression=None) -> torch.Tensor:
    """In-place ``allreduce`` (Horovod's ``allreduce_``); returns ``tensor``."""
    _require_tensor(_ALLREDUCE, tensor, name, process_group)
    if compression is not None and compression is not Compression.none:
        with torch.no_grad():
            return tensor.copy_(allreduce(tensor.detach(), average, name, op, prescale_factor,
                                          postscale_factor, process_group, compression))
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_group))


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_group=None, compression=None) -> torch.Tensor:
    """The reduction of ``tensor`` over all ranks, in a new tensor (default: the average).

    Horovod's semantics: the same name/dtype/shape/op on every rank or every rank raises
    ``CollectiveMismatchError``; integer tensors average and scale in float64, truncated toward
    zero; differentiable (the gradient is the allreduce of the gradients, with the same op).
    ``compression`` (``Compression.fp16``) reduces in its wire dtype. A collective: every rank
    calls it in the same order.

    Example::

        val_loss = hvd.allreduce(torch.tensor(local_loss), name="val_loss")   # mean over ranks
        correct = hvd.allreduce(torch.tensor(n_correct), op=hvd.Sum)
    """
    _require_tensor(_ALLREDUCE, tensor, name, process_group)
    op_, pre, post, error = _reduce_args(average, op, prescale_factor, postscale_factor)
    ctx = None
    if compression is not None:
        tensor, ctx = compression.compress(tensor)
    if error is not None:  # refused: still take part in the signature round, then raise
        return synchronize(_start_allreduce(tensor, tensor, op_, pre, post, name, process_group,
                                            error=error))
    if torch.is_grad_enabled() and tensor.requires_grad:
        out = _AllreduceFn.apply(tensor, op_, pre, post, name, process_group)
    else:
        out = synchronize(allreduce_async(tensor, None, name, op_, pre, post, process_group))
    return out if compression is None else compression.decompress(out, ctx)


# ---------------------------------------------------------------- grouped allreduce
def _group_names(tensors: Sequence[torch.Tensor], name: Optional[str], group,
                 kind: int = _ALLREDUCE) -> List[str]:
    """One name per tensor; the group size is in every name, so ranks passing lists of different
    lengths disagree on the first tensor's signature (every rank raises) instead of pairing the
    extra tensor with whatever collective a peer calls next."""
    what = f"grouped_{_KIND_NAMES[kind]}"
    if not isinstance(tensors, (list, tuple)) or not tensors:
        error = (f"{what} takes a non-empty list or tuple of tensors, got "
                 f"{type(tensors).__name__}{' (empty)' if isinstance(tensors, (list, tuple)) else ''}")
        if _group_size(group) > 1:
            _negotiate(_Call(kind, name, error=error), group)
        raise ConfigError(error)
    base = what if name is None else str(name)
    return [f"{base}[{i}/{len(tensors)}]" for i in range(len(tensors))]


def _grouped(starts: List[Callable[[], int]]) -> int:
    """One handle over the collectives ``starts`` begin; ``synchronize`` returns their results as a list."""
    subs: List[int] = []
    try:
        for begin in starts:
            subs.append(begin())
    except BaseException:
        for h in subs:  # every rank started these: finish them so the group stays in step
            synchronize(h)
        raise
    works = [w for h in subs for w in _handles[h].works]
    return _submit(works, lambda: [synchronize(h) for h in subs], None)  # type: ignore[arg-type,return-value]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[ReduceOp] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_group=None, _inplace: bool = False) -> int:
    """Start an allreduce of every tensor of the list; ``synchronize`` returns the list of results.

    Unnamed groups in flight at the same time need names (``name=``), as their tensors are named
    after the group.
    """
    names = _group_names(tensors, name, process_group)
    start = allreduce_async_ if _inplace else allreduce_async
    return _grouped([lambda t=t, n=n: start(t, average, n, op, prescale_factor, postscale_factor, process_group)
                     for t, n in zip(tensors, names)])


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[ReduceOp] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_group=None) -> int:
    """In-place ``grouped_allreduce_async``."""
    return grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                   process_group, _inplace=True)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, op: Optional[ReduceOp] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_group=None) -> List[torch.Tensor]:
    """Horovod's ``grouped_allreduce``: ``allreduce`` of each tensor of the list, same arguments.

    Each tensor keeps every guarantee of ``allreduce`` (signature check, integer rules, gradient);
    the tensors are reduced one after another, not fused (these are for small tensors).

    Example::

        loss, acc = hvd.grouped_allreduce([torch.tensor(l), torch.tensor(a)], name="metrics")
    """
    names = _group_names(tensors, name, process_group)
    return [allreduce(t, average, n, op, prescale_factor, postscale_factor, process_group)
            for t, n in zip(tensors, names)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[ReduceOp] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_group=None) -> List[torch.Tensor]:
    """In-place ``grouped_allreduce``; returns the same tensors."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,  # type: ignore[return-value]
                                                postscale_factor, process_group))


# ---------------------------------------------------------------- allgather
def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a contiguous tensor: Gloo moves any dtype this way (int16, uint32, ...)."""
    return t.reshape(-1).view(torch.uint8)


def _wire_of(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in _BYTES_ONLY:
        return _bytes_view(t)
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _start_allgather(tensor: torch.Tensor, name: Optional[str], group,
                     grad: bool = False) -> Tuple[int, List[int]]:
    n = _group_size(group)
    key, error = _reserve(_ALLGATHER, name)
    if error is None and tensor.dtype not in _DTYPES:
        error = f"allgather of a {tensor.dtype} tensor is not supported"
    src = tensor.detach()
    shape = tuple(src.shape) if src.dim() else (1,)
    if n == 1:
        if error:
            raise ConfigError(error)
        return _done(src.reshape(shape).clone(), key), [shape[0]]
    call = _Call(_ALLGATHER, name, tensor.dtype, tensor.device.type, shape, 0, grad, error=error)
    agreement = _negotiate(call, group)
    counts = [s[_DIMS] for s in agreement.sigs]
    dev = _comm_device()
    rows = max(counts)
    padded = torch.zeros((rows,) + shape[1:], dtype=src.dtype, device=dev)
    padded[:shape[0]].copy_(src.reshape(shape))
    parts = [torch.empty_like(padded) for _ in range(n)]
    work = dist.all_gather([_wire_of(p) for p in parts], _wire_of(padded), group=group, async_op=True)

    def finish() -> torch.Tensor:
        return torch.cat([p[:c] for p, c in zip(parts, counts)]).to(tensor.device)

    return _submit([work], finish, key), counts


class _AllgatherFn(torch.autograd.Function):
    """allgather with a gradient: this rank's rows of the gradient averaged over ranks.

    Averaged, not summed, as in Horovod's ``HorovodAllgather.backward``: a ported script's
    gradients (and learning rates tuned for them) stay what they were under Horovod.
    """

    @staticmethod
    def forward(ctx, tensor, name, group):  # type: ignore[override]
        handle, counts = _start_allgather(tensor, name, group, grad=True)
        ctx.shape, ctx.counts, ctx.group = tensor.shape, counts, group
        ctx.rank = dist.get_rank(group) if _group_size(group) > 1 else 0
        return synchronize(handle)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        mean = allreduce(grad, op=Average, process_group=ctx.group)
        start = sum(ctx.counts[:ctx.rank])
        return mean.narrow(0, start, ctx.counts[ctx.rank]).reshape(ctx.shape), None, None


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None, process_group=None) -> int:
    """Start an ``allgather``; returns a handle for ``poll``/``synchronize``."""
    _require_tensor(_ALLGATHER, tensor, name, process_group)
    return _start_allgather(tensor, name, process_group)[0]


def allgather(tensor: torch.Tensor, name: Optional[str] = None, process_group=None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0, in rank order.

    First dims may differ; every other dim and the dtype must match (or every rank raises
    ``CollectiveMismatchError``). Differentiable, as in Horovod: the gradient is this rank's
    rows of the gradient averaged over ranks (not summed).

    Example::

        all_preds = hvd.allgather(preds)          # (sum of ranks' rows, ...)
    """
    _require_tensor(_ALLGATHER, tensor, name, process_group)
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _AllgatherFn.apply(tensor, name, process_group)
    return synchronize(allgather_async(tensor, name, process_group))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_group=None) -> int:
    """Start an allgather of every tensor of the list; ``synchronize`` returns the list of results."""
    names = _group_names(tensors, name, process_group, _ALLGATHER)
    return _grouped([lambda t=t, n=n: allgather_async(t, n, process_group) for t, n in zip(tensors, names)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_group=None) -> List[torch.Tensor]:
    """Horovod's ``grouped_allgather``: ``allgather`` of each tensor of the list (each with its
    guarantees and its gradient), one after another.

    Example::

        preds, labels = hvd.grouped_allgather([preds, labels], name="eval")
    """
    names = _group_names(tensors, name, process_group, _ALLGATHER)
    return [allgather(t, n, process_group) for t, n in zip(tensors, names)]


# ---------------------------------------------------------------- broadcast
def _start_broadcast(tensor: torch.Tensor, out: torch.Tensor, root_rank: int, name: Optional[str],
                     group, grad: bool = False) -> int:
    n = _group_size(group)
    key, error = _reserve(_BROADCAST, name)
    if error is None and tensor.dtype not in _DTYPES:
        error = f"broadcast of a {tensor.dtype} tensor is not supported"
    if error is None and (isinstance(root_rank, bool) or not isinstance(root_rank, int)):
        error = f"root_rank must be an int, got {root_rank!r}"
    if n == 1:
        if error or root_rank != 0:
            raise ConfigError(error or f"root_rank={root_rank} is outside the group of 1 rank")
        if out is not tensor:
            out.copy_(tensor.detach())
        return _done(out, key)
    call = _Call(_BROADCAST, name, tensor.dtype, tensor.device.type, tuple(tensor.shape),
                 root_rank if error is None else 0, grad, error=error)
    _negotiate(call, group)
    root = dist.get_global_rank(group, root_rank) if group is not None else root_rank
    dev = _comm_device()
    is_root = dist.get_rank() == root
    src = tensor.detach()
    buf = src.to(dev, memory_format=torch.contiguous_format) if is_root else \
        torch.empty(src.shape, dtype=src.dtype, device=dev)
    work = dist.broadcast(_wire_of(buf.reshape(-1) if buf.dim() == 0 else buf), src=root, group=group,
                          async_op=True)

    def finish() -> torch.Tensor:
        with torch.no_grad():
            if not (is_root and out is tensor):
                out.copy_(buf)
        return out

    return _submit([work], finish, key)


class _BroadcastFn(torch.autograd.Function):
    """broadcast with a gradient: the gradients averaged over ranks land on root (zero elsewhere),
    as in Horovod's ``HorovodBroadcast.backward``."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, group):  # type: ignore[override]
        ctx.root, ctx.group = root_rank, group
        out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        return synchronize(_start_broadcast(tensor, out, root_rank, name, group, grad=True))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        mean = allreduce(grad, op=Average, process_group=ctx.group)
        me = dist.get_rank(ctx.group) if _group_size(ctx.group) > 1 else 0
        if me != ctx.root:
            mean.zero_()
        return mean, None, None, None


def broadcast_async_(tensor: torch.Tensor, root_rank: int = 0, name: Optional[str] = None,
                     process_group=None) -> int:
    """Start overwriting ``tensor`` with root's value in place; returns a handle."""
    _require_tensor(_BROADCAST, tensor, name, process_group)
    return _start_broadcast(tensor, tensor, root_rank, name, process_group)


def broadcast_async(tensor: torch.Tensor, root_rank: int = 0, name: Optional[str] = None,
                    process_group=None) -> int:
    """Start a broadcast of root's ``tensor`` into a new tensor; returns a handle."""
    _require_tensor(_BROADCAST, tensor, name, process_group)
    out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _start_broadcast(tensor, out, root_rank, name, process_group)


def broadcast_(tensor: torch.Tensor, root_rank: int = 0, name: Optional[str] = None,
               process_group=None) -> torch.Tensor:
    """Overwrite ``tensor`` with root's value, in place (Horovod's ``broadcast_``)."""
    _require_tensor(_BROADCAST, tensor, name, process_group)
    return synchronize(broadcast_async_(tensor, root_rank, name, process_group))


def broadcast(tensor: torch.Tensor, root_rank: int = 0, name: Optional[str] = None,
              process_group=None) -> torch.Tensor:
    """Root's value of ``tensor``, in a new tensor (``tensor`` is not modified).

    The same shape and dtype on every rank, and the same ``root_rank``, or every rank raises
    ``CollectiveMismatchError``. Differentiable, as in Horovod: root's gradient is the average
    of every rank's gradient (not the sum), the other ranks' is zero.

    Example::

        w = hvd.broadcast(torch.randn(3), root_rank=0, name="w")   # rank 0's draw everywhere
    """
    _require_tensor(_BROADCAST, tensor, name, process_group)
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _BroadcastFn.apply(tensor, root_rank, name, process_group)
    return synchronize(broadcast_async(tensor, root_rank, name, process_group))


# ---------------------------------------------------------------- join and barrier
def join(device: int = -1) -> int:
    """This rank is out of data: answer the peers' collectives until every rank has joined.

    While joined, the rank contributes the op's neutral element to its peers' ``allreduce`` calls
    (zeros for Sum/Average, so an average still divides by the full world size, as in Horovod); a
    peer's ``allgather`` or ``broadcast`` raises on the peers. Returns the rank that joined last
    (the same on every rank). ``device`` is accepted for Horovod compatibility.

    Serves this module's collectives on the default group only; for ``DistributedOptimizer`` or
    ``LocalSGDOptimizer`` training use ``with opt.join():`` around the loop instead.

    Example::

        for batch in my_shard:          # ranks may hold different numbers of batches
            ...
            hvd.allreduce(metric, name="metric")
        hvd.join()
    """
    if _group_size(None) == 1:
        return 0
    rounds = 0
    while True:
        agreement = _exchange(_Call(_JOIN, rounds=rounds), None)
        if not agreement.active:
            # Fewest rounds served = joined last (lowest rank on ties): the same answer everywhere.
            return min(range(len(agreement.sigs)), key=lambda r: (agreement.sigs[r][_ROUNDS], r))
        if agreement.error is None and agreement.ref[_KIND] == _ALLREDUCE:
            _serve_allreduce(agreement, None)
        rounds += 1


def barrier(process_group=None) -> None:
    """Wait until every rank reaches this call (ranks inside ``join()`` count as arrived)."""
    if _group_size(process_group) == 1:
        return
    _negotiate(_Call(_BARRIER), process_group)
