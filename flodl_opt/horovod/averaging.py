"""DistributedOptimizer's gradient average: its options, its buffers and the contributor count.

The gradients live in persistent flat buffers (one per device and dtype, bucketed:
flodl_opt/transport/grad_buckets.py). Each round's SUMs carry one more number, the contributor
count (1 per contributing rank, 0 per joined rank, a large negative value from a rank that
accumulated too many backward passes), so every rank learns from the same collective how many
ranks to average over and whether to raise.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..transport.grad_buckets import BucketReducer, GradBuffer
from ..wrapping import check_same_on_every_rank
from .common import _DISTRIBUTED_OPTIMIZER, Average, Compression, Compressor, ReduceOp, Sum, _op, check_call


def check_options(optimizer: Any, wrappers: tuple, compression: Optional[Compressor],
                  backward_passes_per_step: int, op: ReduceOp, gradient_predivide_factor: float,
                  bucket_bytes: int, sparse: Any) -> Tuple[ReduceOp, Compressor]:
    """DistributedOptimizer's arguments, before anything is touched; returns ``(op, compression)``.

    ``wrappers``: flodl_opt's optimizer classes, which must not be wrapped a second time."""
    if sparse:
        raise ConfigError("DistributedOptimizer(sparse=True) (Horovod's allgather of sparse gradients) is "
                          "not supported: pass sparse_as_dense=True to average them densely (SparseAdam "
                          "then gets the averages back as sparse gradients)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"DistributedOptimizer wraps a built torch.optim.Optimizer, got "
                          f"{type(optimizer).__name__}")
    if isinstance(optimizer, wrappers):
        raise ConfigError("the optimizer is already wrapped by flodl_opt; wrap the inner optimizer once")
    op = _op(op)
    if op not in (Average, Sum):
        raise ConfigError(f"DistributedOptimizer averages or sums gradients: op must be "
                          f"flodl_opt.Average or flodl_opt.Sum, got {op!r}")
    check_passes_per_step(backward_passes_per_step)
    if compression is None:
        compression = Compression.none
    if not isinstance(compression, Compressor):
        raise ConfigError(f"compression must be flodl_opt.Compression.none or .fp16, got {compression!r}")
    if not gradient_predivide_factor > 0:
        raise ConfigError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and op is not Average:
        raise ConfigError("gradient_predivide_factor only applies to op=flodl_opt.Average")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ConfigError(f"bucket_bytes must be an int >= 1 (bytes of gradients per collective, "
                          f"e.g. 25 * 2**20), got {bucket_bytes!r}")
    return op, compression


def check_passes_per_step(passes: Any) -> None:
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ConfigError(f"backward_passes_per_step must be an int >= 1, got {passes!r}")


def param_names(params: List[torch.Tensor], named_parameters) -> List[str]:
    if named_parameters is None:
        return [f"param #{i} (shape {tuple(p.shape)})" for i, p in enumerate(params)]
    named = list(named_parameters)
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ConfigError(f"named_parameters has duplicate names: {dups[:8]}")
    by_id = {id(p): n for n, p in named}
    unnamed = [tuple(p.shape) for p in params if id(p) not in by_id]
    if unnamed:
        raise ConfigError(f"named_parameters was given but {len(unnamed)} optimizer param(s) are not in it "
                          f"(shapes {unnamed[:4]}); pass the model's named_parameters()")
    return [by_id[id(p)] for p in params]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _exact_int_limit(dtype: torch.dtype) -> int:
    """Largest integer count a reduction in ``dtype`` still carries exactly."""
    return {torch.float16: 2048, torch.bfloat16: 256}.get(dtype, 1 << 24)


class GradientAverage:
    """The buffers, the bucket reducer and the count check of one DistributedOptimizer (2+ ranks)."""

    def __init__(self, params: List[torch.Tensor], names: List[str], op: ReduceOp, compression: Compressor,
                 predivide: float, sparse_as_dense: bool, bucket_bytes: int, overlap: bool, size: int,
                 group: Optional[dist.ProcessGroup]):
        self.params, self.names, self.op, self.compression = params, names, op, compression
        self.predivide, self.sparse_as_dense = predivide, sparse_as_dense
        self.bucket_bytes, self.overlap, self.size, self.group = bucket_bytes, overlap, size, group
        self.buffers: List[GradBuffer] = []
        self.reducer: Optional[BucketReducer] = None
        self.too_many_here = 0
        self._pending: Optional[Tuple[torch.Tensor, Any]] = None
        self._count_host: Optional[torch.Tensor] = None
        self._count_event: Any = None

    def start(self, passes_per_step: int, error: Optional[str]) -> None:
        """Build the buffers, agree with the peers (every rank raises alike), hook the params."""
        slots = None
        if error is None:
            try:
                slots = self._build_buffers()
            except ConfigError as e:
                error = str(e)
        # A signature round first, as every collective of this package: a peer in another
        # collective makes both raise here instead of aborting inside Gloo.
        check_call(_DISTRIBUTED_OPTIMIZER, self.group, error=error)
        self._check_same_everywhere()
        self.reducer = BucketReducer(self.buffers, self.params, slots, self.group, passes_per_step,
                                     1.0 / self.predivide, self.overlap)

    def _build_buffers(self) -> list:
        """One GradBuffer per (device, dtype), laid out in reverse parameter order (backward's)."""
        by_key: "OrderedDict[Tuple[torch.device, torch.dtype], List[int]]" = OrderedDict()
        for i, p in enumerate(self.params):
            if not p.is_floating_point():
                raise ConfigError(f"DistributedOptimizer: {self.names[i]} is {p.dtype}; only floating "
                                  "point params get gradients")
            by_key.setdefault((p.device, p.dtype), []).append(i)
        wire_of = {}
        for (_, dtype) in by_key:
            w = self.compression.wire_dtype
            wire_of[dtype] = w if (w is not None and dtype in (torch.float32, torch.float64)) else dtype
        # The contributor count rides in the first buffer that carries the world size exactly.
        keys = list(by_key)
        exact = [k for k in keys if _exact_int_limit(wire_of[k[1]]) >= 2 * self.size + 1]
        count_key = exact[0] if exact else keys[0]
        slots: list = [None] * len(self.params)
        for key, idx in by_key.items():
            wire = wire_of[key[1]]
            if key == count_key and not exact:
                wire = torch.float32  # a narrow-only model on a huge world: count needs float32
            idx = idx[::-1]
            buf = GradBuffer([self.params[i] for i in idx], [self.names[i] for i in idx],
                             key == count_key, wire, self.bucket_bytes)
            self.buffers.append(buf)
            for j, i in enumerate(idx):
                slots[i] = (buf, j)
        self._count_buffer = next(b for b in self.buffers if b.count_slot)
        return slots

    def reduce(self, contribute: bool, too_many: bool) -> torch.Tensor:
        """Finish the round's SUMs, then scale; returns the contributor count (a 0-dim tensor)."""
        # 1 = contributing, 0 = joined, a large negative = too many backward passes (all raise).
        value = -2.0 * self.size if too_many else (1.0 if contribute else 0.0)
        cb = self._count_buffer
        if self.op is not Average:
            self.reducer.finish(value, self.sparse_as_dense)
            return cb.wire[-1]
        f = self.predivide
        if cb.device.type == "cpu":
            # Scale each bucket by f/n as soon as it arrives (hidden behind the later buckets'
            # collectives); in the rare round where not every rank contributed (join), correct by
            # n/count once the count is known. The count is read on the host for free on CPU.
            self.reducer.finish(value, self.sparse_as_dense, scale=f / self.size)
            count = cb.wire[-1]
            n = float(count)
            if n != self.size and n > 0:
                for b in self.buffers:
                    b.grads.mul_(torch.tensor(self.size / n, dtype=torch.float64).to(b.dtype))
            return count
        # CUDA: the count stays on the device (no host sync); one scale after all the collectives.
        self.reducer.finish(value, self.sparse_as_dense)
        count = cb.wire[-1]
        scale = f / count.double().clamp(min=1.0)
        for b in self.buffers:
            b.grads.mul_(scale.to(b.dtype))
        return count

    def check_passes(self, count: torch.Tensor, too_many: bool) -> None:
        """Raise on every rank when any rank accumulated too many backward passes.

        On CPU the count is read at once. On CUDA it is copied to pinned memory without waiting
        and checked at the next step, so a step never stalls the host on the collective.
        """
        if count.is_cuda and not too_many:
            pending, self._pending = self._pending, None
            if pending is not None:
                pending[1].synchronize()
                self.raise_if_negative(float(pending[0]), False)
            if self._count_host is None:
                self._count_host = torch.empty((), dtype=count.dtype, pin_memory=True)
                self._count_event = torch.cuda.Event()
            self._count_host.copy_(count, non_blocking=True)  # read back at the next step
            self._count_event.record()
            self._pending = (self._count_host, self._count_event)
            return
        self.raise_if_negative(float(count), too_many)

    def raise_if_negative(self, count: float, too_many: bool) -> None:
        if count >= 0:
            return
        here = self.too_many_here
        raise ConfigError(f"DistributedOptimizer: gradients were accumulated over more backward passes "
                          f"than backward_passes_per_step={self.reducer.passes_per_step} before step()"
                          f"{f' (this rank: {here})' if too_many else ' on another rank'}; "
                          "raise backward_passes_per_step or call step() after every backward")

    def _check_same_everywhere(self) -> None:
        desc = [(str(b.dtype), str(b.wire.dtype), b.count_slot, [tuple(p.shape) for p in b.params],
                 b.layout()) for b in self.buffers]
        desc.append((self.op.name, self.compression.name, self.predivide,
                     self.bucket_bytes, self.overlap))
        summary = [(d[0], len(d[3]), sum(_numel(s) for s in d[3])) for d in desc[:-1]] + [desc[-1]]
        check_same_on_every_rank(desc, summary, self.group,
                                 "DistributedOptimizer: ranks wrap different models or options",
                                 "(dtype, tensors, elements) per buffer, then op/compression",
                                 "DistributedOptimizer")
