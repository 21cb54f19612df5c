"""Horovod-shaped API: the synchronous baseline, broadcasts and metric reductions.

A Horovod script runs with renames only (``import flodl_opt as hvd``)::

    import torch, flodl_opt as hvd
    hvd.init()
    model = torch.nn.Linear(10, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()                      # gradients averaged across ranks, then the inner step
    loss = hvd.allreduce(torch.tensor(1.0), name="avg_loss")   # metrics

``DistributedOptimizer`` averages gradients before every inner step, bucket by bucket while
backward still runs (a persistent flat buffer per gradient dtype, each ``p.grad`` a view of it;
``flodl_opt/transport/grad_buckets.py``), not one collective per parameter. Swapping it for
``LocalSGDOptimizer`` is the one-argument change to local SGD.

Layout: this module is the API (``DistributedOptimizer``, the broadcasts, the object collectives);
``flodl_opt/horovod/averaging.py`` the gradient average behind ``DistributedOptimizer`` (its buffers,
the contributor count, the argument checks);
``flodl_opt/horovod/ops.py`` holds the raw collectives (``allreduce``, ``allgather``, ``broadcast``,
their ``_async`` forms, ``join``, ``barrier``), re-exported here; ``flodl_opt/horovod/common.py`` what
both use (reduction ops, compression, the signature round).

Matching across ranks: by call order, not by name. Horovod pairs collectives by name (its
background thread waits until every rank has submitted a tensor of that name, so named async calls
may be issued in different orders on different ranks). Here every collective of this package, the
object collectives, broadcasts and ``DistributedOptimizer``'s build included, first exchanges a small
signature (kind, name, dtype, shape, op, root); the n-th call of one rank pairs with the n-th call of
every other, and if any of that differs, names included, every rank raises
``CollectiveMismatchError`` at once, printing both calls (``allreduce(..., name='loss')`` against
``allreduce(..., name='acc')``), never a hang, a crash inside Gloo or a silent sum of two different
tensors. A script that issues its collectives in the same order on every rank (almost every script)
runs unchanged; one that relies on name matching to reorder them must issue them in one order. Call
order keeps the training loop's thread the only one that touches the process group (no background
thread to race the optimizer's own collectives).

Gradients through the collectives are Horovod's: ``allreduce``'s is the allreduce of the gradient
(same op and scale factors); ``allgather``'s is this rank's rows of the gradient averaged over ranks;
``broadcast``'s is the gradient averaged over ranks on root and zero elsewhere.
"""
from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import launch
from ..wrapping import WrappedOptimizer
from ..errors import ConfigError
from ..sync.flat import unique
from ..transport.grad_buckets import DEFAULT_BUCKET_BYTES
from .averaging import GradientAverage, check_options, check_passes_per_step, param_names
from .common import (_ALLGATHER_OBJECT, _BROADCAST_OBJECT, _BROADCAST_OPTIMIZER_STATE, _BROADCAST_PARAMETERS,
                     Adasum, Average, Compression, Compressor, Max, Min, Product, ReduceOp, Sum, _agree,
                     _comm_device, _global_rank, _group_size, check_call)
from .ops import (allgather, allgather_async, allreduce, allreduce_, allreduce_async, allreduce_async_,
                  barrier, broadcast, broadcast_, broadcast_async, broadcast_async_, grouped_allgather,
                  grouped_allgather_async, grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                  grouped_allreduce_async_, join, poll, synchronize)

__all__ = [
    "ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Adasum", "Compression",
    "DistributedOptimizer", "allgather_object",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
    "nccl_built", "gloo_built", "gloo_enabled", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "cuda_built", "rocm_built", "ccl_built", "ddl_built",
    # the raw collectives, from flodl_opt/horovod/ops.py
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "allgather", "allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "poll", "synchronize", "join",
    "barrier", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_allgather", "grouped_allgather_async",
]


# ---------------------------------------------------------------- fused tensor broadcast
def _wire_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _broadcast_into(targets: Sequence[torch.Tensor], root: int, group) -> None:
    """Broadcast ``targets`` from global rank ``root`` into the same tensors elsewhere.

    One collective per dtype (the tensors are packed into a flat buffer on the comm device),
    not one per tensor. On the root the targets are only read.
    """
    dev = _comm_device()
    by_dtype: "OrderedDict[torch.dtype, List[torch.Tensor]]" = OrderedDict()
    for t in targets:
        by_dtype.setdefault(t.dtype, []).append(t)
    is_root = dist.get_rank() == root
    with torch.no_grad():
        for dtype, ts in by_dtype.items():
            if is_root:
                flat = torch.cat([_wire_view(t.detach()).reshape(-1).to(dev) for t in ts])
            else:
                wire = torch.uint8 if dtype == torch.bool else dtype
                flat = torch.empty(sum(t.numel() for t in ts), dtype=wire, device=dev)
            dist.broadcast(flat, src=root, group=group)
            if is_root:
                continue
            offset = 0
            for t in ts:
                n = t.numel()
                _wire_view(t).copy_(flat[offset:offset + n].view(t.shape))
                offset += n


# ---------------------------------------------------------------- object collectives and broadcasts
# Each public call below first runs the signature round (common.check_call), like the raw
# collectives: a rank that calls another collective meanwhile makes every rank raise at once.
def allgather_object(obj: Any, name: Optional[str] = None, process_group=None) -> List[Any]:
    """Every rank's ``obj`` (picklable), as a list in rank order."""
    n = _group_size(process_group)
    if n == 1:
        return [obj]
    check_call(_ALLGATHER_OBJECT, process_group, name)
    out: List[Any] = [None] * n
    dist.all_gather_object(out, obj, group=process_group)
    return out


def _send_object(obj: Any, root: int, group) -> Any:
    """Root's ``obj`` on every rank (``root`` a global rank); no signature round of its own."""
    box = [obj]
    dist.broadcast_object_list(box, src=root, group=group)
    return box[0]


def broadcast_object(obj: Any = None, root_rank: int = 0, name: Optional[str] = None,
                     process_group=None) -> Any:
    """Root's ``obj`` (any picklable object) on every rank.

    Example::

        epoch = flo.broadcast_object(resume_epoch, root_rank=0)
    """
    if _group_size(process_group) == 1:
        return obj
    check_call(_BROADCAST_OBJECT, process_group, name, root_rank)
    return _send_object(obj, _global_rank(process_group, root_rank), process_group)


def _named_tensors(params) -> List[Tuple[str, torch.Tensor]]:
    if isinstance(params, dict):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))  # same order on every rank
    else:
        items = [p if isinstance(p, tuple) else (f"#{i}", p) for i, p in enumerate(params)]
    out = []
    for name, t in items:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"broadcast_parameters: {name!r} is a {type(t).__name__}, not a tensor; "
                              "pass model.state_dict() or model.named_parameters(), and send other "
                              "objects with broadcast_object()")
        out.append((str(name), t))
    return out


def broadcast_parameters(params, root_rank: int = 0, process_group=None) -> None:
    """Overwrite every rank's tensors with root's, in place.

    Args:
        params: ``model.state_dict()`` (buffers included), ``model.named_parameters()``, a dict
            of tensors, or a list of tensors. The same names/shapes/dtypes on every rank, or
            every rank raises ``ConfigError``.
        root_rank: the rank whose values win.

    One fused collective per dtype; call it once after building the model.

    Example::

        flo.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if _group_size(process_group) == 1:
        return
    named, error = [], None
    try:
        named = _named_tensors(params)
    except ConfigError as e:  # refused on every rank, in the signature round
        error = str(e)
    check_call(_BROADCAST_PARAMETERS, process_group, root_rank=root_rank, error=error)
    root = _global_rank(process_group, root_rank)
    mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in named]
    theirs = _send_object(mine, root, process_group)
    ok = mine == theirs
    if not _agree(ok, process_group):
        diff = "" if ok else _first_difference(mine, theirs)
        raise ConfigError("broadcast_parameters: ranks hold different tensors (names, shapes or dtypes "
                          f"differ from root rank {root_rank}){diff}; build the same model on every rank")
    _broadcast_into([t for _, t in named], root, process_group)


def _first_difference(mine: list, theirs: list) -> str:
    if len(mine) != len(theirs):
        return f": this rank has {len(mine)} tensors, root has {len(theirs)}"
    for a, b in zip(mine, theirs):
        if a != b:
            return f": this rank {a}, root {b}"
    return ""


@dataclass(frozen=True)
class _Slot:
    """Where a tensor sat in root's optimizer state (the tensors travel separately, fused)."""

    index: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool


def _strip(obj: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1, tuple(obj.shape), obj.dtype, obj.device.type == "cpu")
    if isinstance(obj, dict):
        return type(obj)((k, _strip(v, tensors)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _slots(obj: Any, out: List[_Slot]) -> None:
    if isinstance(obj, _Slot):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _slots(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _slots(v, out)


def _fill(obj: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return type(obj)((k, _fill(v, tensors)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def _inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    from ..optimizer import LocalSGDOptimizer
    if isinstance(optimizer, (LocalSGDOptimizer, DistributedOptimizer)):
        return optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"broadcast_optimizer_state takes a torch optimizer, got {type(optimizer).__name__}")
    return optimizer


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0, model=None,
                              process_group=None) -> None:
    """Give every rank root's optimizer state and hyperparameters.

    Root's ``state_dict()`` is sent as is (structure as one object, the tensors in one fused
    collective per dtype) and loaded on the other ranks; root's own state is not touched. Unlike
    Horovod's version, nothing is stepped with zero gradients to create missing state (which
    advances Adam's step count and moments), and a rank whose state is still empty simply
    receives root's. Works on plain torch optimizers and on flodl_opt's wrappers (their inner
    optimizer).

    As after Horovod's version, on a rank whose optimizer had no state yet every parameter that
    requires a gradient and has none gets a zero gradient (sparse for ``SparseAdam``, and for
    ``SGD`` on the sparse embeddings of ``model``), so code that reads ``p.grad`` right after it
    runs unchanged; the next backward adds to it as to ``None``.

    Example::

        flo.broadcast_optimizer_state(opt, root_rank=0)   # e.g. after rank 0 loaded a checkpoint
    """
    inner, error = None, None
    try:
        inner = _inner_optimizer(optimizer)
    except ConfigError as e:  # refused on every rank, in the signature round
        error = str(e)
    n = _group_size(process_group)
    if n == 1 and error is not None:
        raise ConfigError(error)
    had_state = inner is not None and len(inner.state) > 0
    if n > 1:
        check_call(_BROADCAST_OPTIMIZER_STATE, process_group, root_rank=root_rank, error=error)
        _receive_optimizer_state(inner, root_rank, process_group)
    if not had_state:
        _zero_missing_grads(inner, model)


def _receive_optimizer_state(inner: torch.optim.Optimizer, root_rank: int, process_group) -> None:
    root = _global_rank(process_group, root_rank)
    is_root = dist.get_rank() == root
    tensors: List[torch.Tensor] = []
    skeleton: Any = None
    if is_root:
        try:
            skeleton = _strip(inner.state_dict(), tensors)
        except Exception as e:  # noqa: BLE001 - sent to every rank (a str), raised there
            skeleton = f"{type(e).__name__}: {e}"
    skeleton = _send_object(skeleton, root, process_group)
    if isinstance(skeleton, str):
        raise ConfigError(f"broadcast_optimizer_state: root rank {root_rank} could not read its "
                          f"optimizer's state_dict(): {skeleton}")
    layout = [len(g["params"]) for g in inner.param_groups]
    root_layout = [len(g["params"]) for g in skeleton["param_groups"]]
    if not _agree(layout == root_layout, process_group):
        raise ConfigError("broadcast_optimizer_state: ranks' optimizers hold different param groups "
                          f"(params per group here {layout}, on root rank {root_rank} {root_layout}); "
                          "build the same optimizer on every rank")
    if not is_root:
        slots: List[_Slot] = []
        _slots(skeleton, slots)
        slots.sort(key=lambda s: s.index)
        dev = launch.device()
        tensors = [torch.empty(s.shape, dtype=s.dtype, device="cpu" if s.on_cpu else dev) for s in slots]
    _broadcast_into(tensors, root, process_group)
    error: Optional[BaseException] = None
    if not is_root:
        try:
            inner.load_state_dict(_fill(skeleton, tensors))
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = e
    if not _agree(error is None, process_group):
        raise ConfigError(f"broadcast_optimizer_state: loading root's state failed"
                          f"{f' here: {error}' if error else ' on another rank'}") from error


def _zero_missing_grads(inner: torch.optim.Optimizer, model) -> None:
    """Horovod's broadcast_optimizer_state leaves a zero ``.grad`` on every parameter that requires
    one (its zero-gradient step creates them); scripts read them right after (e.g. to broadcast)."""
    sparse_ids = set()
    if model is not None and isinstance(inner, torch.optim.SGD):
        sparse_ids = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.sparse
                      for p in m.parameters()}
    with torch.no_grad():
        for group in inner.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    grad = torch.zeros_like(p)
                    sparse = isinstance(inner, torch.optim.SparseAdam) or id(p) in sparse_ids
                    p.grad = grad.to_sparse(min(1, grad.dim())) if sparse else grad


# ---------------------------------------------------------------- DistributedOptimizer
class DistributedOptimizer(WrappedOptimizer):
    """Synchronous data parallelism with Horovod's semantics, around any torch optimizer.

    Before every inner step the gradients are summed over ranks and (``op=Average``) divided by
    the number of contributing ranks. Each ``p.grad`` is a view of a persistent flat buffer per
    gradient dtype, cut into buckets of about ``bucket_bytes``; as in Horovod and DDP, a bucket's
    collective starts during backward as soon as its last gradient is accumulated, so communication
    overlaps the rest of backward, and ``step()``/``synchronize()`` wait for what is in flight
    (``flodl_opt/transport/grad_buckets.py``). Gradients accumulate locally over ``backward_passes_per_step``
    backward passes between steps (only the last pass starts collectives; scale the loss yourself,
    as in Horovod: the accumulated sum is what gets averaged). A parameter that got no gradient on
    a rank (unused, or a layer that rank's graph skipped) contributes zeros there; its bucket is
    then started by ``synchronize()``, on every rank in the same order, so nothing deadlocks.

    Args:
        optimizer: an already built torch optimizer (its ``param_groups`` are shared).
        named_parameters: ``model.named_parameters()``, for error messages naming tensors.
        compression: ``Compression.none`` or ``Compression.fp16`` (float32 grads reduced in fp16).
        backward_passes_per_step: backward passes before each ``step()``; more raises on every rank.
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: with ``Average``, scale by ``1/f`` before the sum and by
            ``f/n`` after it (guards low-precision sums against overflow).
        sparse_as_dense: densify sparse gradients instead of refusing them (a ``SparseAdam``
            gets the averaged gradients back as sparse tensors, as in Horovod).
        process_group: the group to average over (default: the world).
        bucket_bytes: gradient bytes per collective (Horovod's fusion threshold; DDP's
            ``bucket_cap_mb``). Default 25 MiB, as DDP (see BENCHMARKS.md); the first bucket is
            at most 1 MiB, so communication starts early.
        overlap: start collectives during backward (default); False reduces everything in
            ``synchronize()`` instead.

    Clipping and AMP, as in Horovod::

        loss.backward()
        opt.synchronize()                       # grads are averaged now
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()

    Uneven data: wrap the loop in ``with opt.join():``; a rank that runs out keeps answering its
    peers' steps with zero gradients that do not count in the average (and applies the same
    averaged step, so parameters stay identical), until every rank has joined.

    ``num_groups``/``groups`` are accepted for Horovod compatibility and ignored (buckets are
    set by ``bucket_bytes``); Horovod's ``sparse=True`` is refused with a ``ConfigError``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None,
                 compression: Compressor = Compression.none, backward_passes_per_step: int = 1,
                 op: ReduceOp = Average, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                 process_group: Optional[dist.ProcessGroup] = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True, sparse: Any = False):
        from ..optimizer import LocalSGDOptimizer
        op, compression = check_options(optimizer, (DistributedOptimizer, LocalSGDOptimizer), compression,
                                        backward_passes_per_step, op, gradient_predivide_factor, bucket_bytes,
                                        sparse)
        params = [p for p in unique(p for g in optimizer.param_groups for p in g["params"]) if p.requires_grad]
        names_error = None
        try:
            names = param_names(params, named_parameters)
        except ConfigError as e:
            # Before init (no group to tell) or alone: here, as Horovod does. Else every rank
            # raises in the signature round (GradientAverage.start), instead of the peers waiting.
            if not launch.is_initialized() or _group_size(process_group) == 1:
                raise
            names, names_error = [f"param #{i}" for i in range(len(params))], str(e)
        launch.ensure_init()

        # Share the inner optimizer's param_groups and state (flodl_opt/wrapping.py).
        self._share(optimizer)

        self.op, self.compression = op, compression
        self._passes_per_step = backward_passes_per_step
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.sparse_as_dense = sparse_as_dense
        self.process_group = process_group
        self.bucket_bytes, self.overlap = bucket_bytes, bool(overlap)
        self._size = _group_size(process_group)
        self._params, self._names = params, names
        self._should_synchronize = True
        self._synchronized = False
        self._joined = False
        self._average = GradientAverage(params, names, op, compression, self.gradient_predivide_factor,
                                        sparse_as_dense, bucket_bytes, self.overlap, self._size, process_group)
        if self._size > 1:
            self._average.start(backward_passes_per_step, names_error)

    # ------------------------------------------------------------ Optimizer surface
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise ConfigError("DistributedOptimizer's fused gradient buffers are fixed when it is built; "
                          "add the param group to the inner optimizer before wrapping it")

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        r = self._average.reducer
        if r is not None and r.open:
            # Gradients discarded before a step: collectives may be in flight (the peers started
            # the same buckets); finish the round so they pair up and stop touching the buffer.
            r.finish(0.0, self.sparse_as_dense)
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def backward_passes_per_step(self) -> int:
        return self._passes_per_step

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:
        self.set_backward_passes_per_step(passes)

    def set_backward_passes_per_step(self, passes: int) -> None:
        check_passes_per_step(passes)
        self._passes_per_step = passes
        if self._average.reducer is not None:
            self._average.reducer.passes_per_step = passes

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, op={self.op!r}, "
                f"compression={self.compression!r}, "
                f"backward_passes_per_step={self.backward_passes_per_step})")

    # ------------------------------------------------------------ the data path
    def synchronize(self) -> None:
        """Average the gradients now (collective); ``step()`` then skips it until the next step."""
        if self._synchronized:
            return
        if self._size > 1:
            avg = self._average
            too_many = avg.reducer.too_many()
            avg.too_many_here = max(avg.reducer.passes, default=0)
            count = avg.reduce(contribute=True, too_many=too_many)
            avg.check_passes(count, too_many)
            self._sparse_for_inner()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not synchronize (call ``synchronize()`` first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """(closure ->) average gradients -> inner step. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_synchronize:
            if self._synchronized:
                # Horovod warns here (it would reduce a second time); nothing is reduced twice
                # here, but the warning keeps a Horovod script's behaviour and points at the fix.
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() after "
                              "optimizer.synchronize(): the gradients are not reduced again, but "
                              "Horovod reduces them twice here; wrap the step in "
                              "`with optimizer.skip_synchronize():`", stacklevel=2)
            self.synchronize()
        elif not self._synchronized and self._average.reducer is not None and self._average.reducer.open:
            # step() in skip_synchronize() without synchronize(): collectives are already in
            # flight (started during backward) and every rank started the same ones.
            warnings.warn("DistributedOptimizer: step() inside skip_synchronize() without calling "
                          "synchronize() first; synchronizing now (call opt.synchronize() before "
                          "the block)", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        self.optimizer.step()
        return loss

    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
        """Uneven data: after the block, answer the peers' steps with zero gradients until all joined.

        Every rank wraps its loop in ``with opt.join():``. A joined rank's zero gradients do not
        count in the average (a contributor count rides the same collective), and it applies
        the averaged gradients like its peers, so all ranks end with the same parameters; they
        are finally broadcast from the last rank to join (which ran any clipping or scaling the
        joined ranks could not replay).
        """
        yield
        if self._size == 1:
            return
        rounds = 0
        self._joined = True
        try:
            while True:
                for b in self._average.buffers:
                    b.clear()
                count = self._average.reduce(contribute=False, too_many=False)
                n = int(count.item())
                self._average.raise_if_negative(n, False)
                if n == 0:
                    break
                rounds += 1
                self._sparse_for_inner()
                self.optimizer.step()
        finally:
            self._joined = False
            self._synchronized = False
        # The last rank to join (fewest joined rounds; lowest rank on ties) holds the reference.
        key = torch.tensor([rounds * self._size + dist.get_rank(self.process_group)],
                           dtype=torch.int64, device=_comm_device())
        dist.all_reduce(key, op=dist.ReduceOp.MIN, group=self.process_group)
        last = int(key.item()) % self._size
        _broadcast_into(self._params, _global_rank(self.process_group, last), self.process_group)

    @property
    def _parameter_names(self) -> Dict[torch.Tensor, str]:
        """Horovod's ``{param: name}`` map (its private attribute, read by some scripts)."""
        return {p: n for p, n in zip(self._params, self._names)}

    # ------------------------------------------------------------ internals
    def _sparse_for_inner(self) -> None:
        """SparseAdam takes sparse gradients only: after the dense average (``sparse_as_dense``)
        hand it the averaged gradients back as sparse tensors, as Horovod does."""
        if not isinstance(self.optimizer, torch.optim.SparseAdam):
            return
        for p in self._params:
            if p.grad is not None and not p.grad.is_sparse:
                p.grad = p.grad.to_sparse(min(1, p.grad.dim()))


# ---------------------------------------------------------------- build introspection
# Horovod scripts (and Horovod's own tests) ask which backends the library was built with. Here
# the collectives are torch.distributed's, so the answers describe the installed torch.
def nccl_built() -> int:
    """NCCL's version code (e.g. 22105 for 2.21.5) if torch.distributed has NCCL, else 0."""
    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()
    return major * (10000 if (major, minor) >= (2, 9) else 1000) + minor * 100 + patch


def gloo_built() -> bool:
    """Whether torch.distributed has Gloo (the CPU collectives)."""
    return dist.is_available() and dist.is_gloo_available()


def gloo_enabled() -> bool:
    """As ``gloo_built()``: CPU tensors always go through Gloo here."""
    return gloo_built()


def mpi_built() -> bool:
    """Whether torch.distributed has an MPI backend (flodl_opt never uses it for collectives)."""
    return dist.is_available() and dist.is_mpi_available()


def mpi_enabled() -> bool:
    """False: mpirun may launch the ranks, but no collective goes through MPI."""
    return False


def mpi_threads_supported() -> bool:
    return False


def cuda_built() -> bool:
    return torch.version.cuda is not None


def rocm_built() -> bool:
    return getattr(torch.version, "hip", None) is not None


def ccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False
