"""Gradient buckets that are reduced while backward is still running (DistributedOptimizer's data path).

Each (device, dtype) gets one persistent flat gradient buffer (:class:`GradBuffer`); every ``p.grad``
becomes a view of it, so the inner optimizer's fused kernels read contiguous, aligned gradients. The
buffer is laid out in reverse parameter order (the order backward produces gradients for a model
whose parameters are registered in forward order, as DDP assumes) and cut into contiguous buckets of
about ``bucket_bytes`` (the first one small, so communication starts early).

:class:`BucketReducer` owns the per-round state. A post-accumulate-grad hook on every parameter counts
backward passes; on the last pass (``backward_passes_per_step``) it moves the gradient into its view and,
once every gradient of a bucket is in, starts that bucket's async SUM. Buckets start strictly in one
order that every rank derives from the parameter list alone, never from local timing, so the ranks'
collectives always pair up: a bucket that is not complete on this rank (a layer its graph skipped,
an unused parameter) holds the later ones back until ``finish()``, which fills the missing gradients
with zeros and starts whatever is left. The last bucket of each dtype is always started by
``finish()``: it holds the model's first layers, complete only when backward ends, so starting it there
costs nothing, and it carries the contributor count that is only known then.

``register_post_accumulate_grad_hook`` needs torch >= 2.1; flodl_opt requires torch >= 2.4, so there is
no fallback.
"""
from __future__ import annotations

import weakref
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..sync.flat import aligned_offsets

# DDP's defaults: 25 MiB buckets, the first one 1 MiB. tools/bench_dp.py measured 25 MiB against 64 MiB
# (Horovod's fusion threshold) and smaller ones on Gloo; see BENCHMARKS.md.
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
FIRST_BUCKET_BYTES = 1024 * 1024


class Bucket:
    """One contiguous slice ``[lo, hi)`` of a buffer, reduced by one collective."""

    def __init__(self, buffer: "GradBuffer", members: List[int], lo: int, hi: int, grad_hi: int):
        self.buffer, self.members = buffer, members  # members: indices into buffer.params
        self.lo, self.hi, self.grad_hi = lo, hi, grad_hi  # grad_hi: end of gradients (count slot after)
        self.flat = buffer.flat[lo:hi]
        self.wire = buffer.wire[lo:hi] if buffer.wire is not buffer.flat else self.flat
        self.pending = len(members)
        self.work: Any = None
        self.held = False  # started by finish() only

    @property
    def nbytes(self) -> int:
        return (self.hi - self.lo) * self.flat.element_size()

    def launch(self, predivide: float, group) -> None:
        n = self.grad_hi - self.lo
        if self.wire is not self.flat:
            self.wire.copy_(self.flat)
        if predivide != 1.0:
            self.wire[:n].mul_(predivide)
        self.work = dist.all_reduce(self.wire, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def wait(self, scale: Optional[torch.Tensor]) -> None:
        self.work.wait()
        self.work = None
        n = self.grad_hi - self.lo
        if self.wire is not self.flat:
            self.flat[:n].copy_(self.wire[:n])
        if scale is not None:
            self.flat[:n].mul_(scale)


class GradBuffer:
    """The persistent flat gradient buffer of one (device, dtype), cut into buckets.

    ``flat`` holds the gradients (in the buffer that carries it, one trailing element: the contributor
    count that rides the last bucket's collective). ``wire`` is what the collectives reduce: ``flat``
    itself, or a staging twin in the compression dtype.
    """

    def __init__(self, params: List[torch.Tensor], names: List[str], count_slot: bool,
                 wire_dtype: Optional[torch.dtype], bucket_bytes: int):
        self.params, self.names = params, names
        self.dtype, self.device = params[0].dtype, params[0].device
        # Aligned like the params' flat buffers (the optimizer's fused kernels read these grads);
        # the zero gaps ride the collectives and stay zero.
        offsets, self.numel = aligned_offsets([p.numel() for p in params], params[0].element_size())
        self.count_slot = count_slot
        self.flat = torch.zeros(self.numel + int(count_slot), dtype=self.dtype, device=self.device)
        self.views: List[torch.Tensor] = [self.flat[o:o + p.numel()].view(p.shape)
                                          for p, o in zip(params, offsets)]
        self._view_ptrs = [v.data_ptr() for v in self.views]
        self.wire = self.flat if wire_dtype in (None, self.dtype) else torch.empty(
            self.flat.numel(), dtype=wire_dtype, device=self.device)
        self.buckets: List[Bucket] = []
        item = params[0].element_size()
        members: List[int] = []
        start, cap = 0, min(FIRST_BUCKET_BYTES, bucket_bytes)
        for i, o in enumerate(offsets):
            members.append(i)
            end = offsets[i + 1] if i + 1 < len(offsets) else self.numel
            if (end - start) * item >= cap and i + 1 < len(offsets):
                self.buckets.append(Bucket(self, members, start, end, end))
                members, start, cap = [], end, bucket_bytes
        self.buckets.append(Bucket(self, members, start, self.flat.numel(), self.numel))
        self.buckets[-1].held = True
        self.bucket_of = [b for b in self.buckets for _ in b.members]

    @property
    def grads(self) -> torch.Tensor:
        return self.flat[:self.numel]

    def layout(self) -> List[int]:
        return [b.hi - b.lo for b in self.buckets]

    def bind(self, i: int) -> bool:
        """Make ``params[i].grad`` its view, holding its current value; False for a sparse grad."""
        p, view = self.params[i], self.views[i]
        g = p.grad
        if g is not None and g.is_sparse:  # before data_ptr(): a sparse tensor has none
            return False
        if g is None or (g.data_ptr() == self._view_ptrs[i] and g.shape == view.shape):
            return g is not None
        view.copy_(g)
        p.grad = view
        return True

    def gather(self, members: Sequence[int], sparse_as_dense: bool) -> None:
        """Make every listed ``p.grad`` a view of the buffer, holding its current value (zero if none)."""
        copy_dst, copy_src, zero, rebind = [], [], [], []
        for i in members:
            p, view = self.params[i], self.views[i]
            g = p.grad
            if g is None:
                zero.append(view)
            elif g.is_sparse:  # before data_ptr(): a sparse tensor has none
                if not sparse_as_dense:
                    raise ConfigError(f"DistributedOptimizer: {self.names[i]} has a sparse gradient; "
                                      "pass sparse_as_dense=True or build the module with sparse=False")
                copy_dst.append(view)
                copy_src.append(g.to_dense())
            elif g.data_ptr() == self._view_ptrs[i] and g.shape == view.shape:
                continue  # already ours: autograd accumulated in place, or a hook moved it
            else:
                copy_dst.append(view)
                copy_src.append(g)
            rebind.append(i)
        if zero:
            torch._foreach_zero_(zero)
        if copy_dst:
            torch._foreach_copy_(copy_dst, copy_src)
        for i in rebind:
            self.params[i].grad = self.views[i]

    def clear(self) -> None:
        """Zero contribution (a joined rank): grads zeroed and bound to the buffer."""
        self.flat.zero_()
        for p, view, ptr in zip(self.params, self.views, self._view_ptrs):
            if p.grad is None or p.grad.is_sparse or p.grad.data_ptr() != ptr:
                p.grad = view


class _GradReadyHook:
    """A post-accumulate-grad hook; holds the reducer weakly so params do not keep it alive."""

    def __init__(self, reducer: "BucketReducer", index: int):
        self.reducer, self.index = weakref.ref(reducer), index

    def __call__(self, _param: torch.Tensor) -> None:
        r = self.reducer()
        if r is not None:
            r.grad_ready(self.index)


class BucketReducer:
    """Starts each bucket's SUM as soon as backward completes it; ``finish()`` completes the round.

    Args:
        buffers: the gradient buffers (one per device/dtype); ``params`` is their union, in the
            optimizer's order, and ``slots[i]`` is ``(buffer, index in it)`` for ``params[i]``.
        passes_per_step: ``backward_passes_per_step`` (the owner updates the attribute).
        overlap: start buckets from the hooks; False starts every bucket in ``finish()``.
    """

    def __init__(self, buffers: List[GradBuffer], params: List[torch.Tensor], slots, group,
                 passes_per_step, predivide: float, overlap: bool = True):
        self.buffers, self.params, self.slots, self.group = buffers, params, slots, group
        self.passes_per_step, self.predivide, self.overlap = passes_per_step, predivide, overlap
        self.passes = [0] * len(params)
        # One order on every rank, from the parameter list alone: by the position of a bucket's
        # latest-registered parameter, descending (reverse registration, as backward runs);
        # the held buckets last.
        pos = {id(p): k for k, p in enumerate(params)}

        def last_param(b: Bucket) -> int:
            return max(pos[id(b.buffer.params[i])] for i in b.members)
        buckets = [b for buf in buffers for b in buf.buckets]
        self.order = (sorted((b for b in buckets if not b.held), key=last_param, reverse=True)
                      + sorted((b for b in buckets if b.held), key=last_param, reverse=True))
        self.n_early = sum(1 for b in self.order if not b.held)
        self.next = 0  # the next bucket of ``order`` to start
        self.hooks = [p.register_post_accumulate_grad_hook(_GradReadyHook(self, i))
                      for i, p in enumerate(params)]

    # ---------------------------------------------------------------- during backward
    def grad_ready(self, i: int) -> None:
        self.passes[i] += 1
        if not self.overlap or self.passes[i] != self.passes_per_step:
            return  # accumulating locally, or too many passes (finish() raises on every rank)
        buf, j = self.slots[i]
        # Into the buffer now, while the gradient is still in cache (held buckets too).
        if not buf.bind(j):
            return  # sparse: finish() densifies it or refuses it
        bucket = buf.bucket_of[j]
        if bucket.held or bucket.work is not None:
            return
        bucket.pending -= 1
        while self.next < self.n_early and self.order[self.next].pending == 0:
            self.order[self.next].launch(self.predivide, self.group)
            self.next += 1

    # ---------------------------------------------------------------- at synchronize()
    @property
    def open(self) -> bool:
        """A backward pass ran since the last ``finish()``."""
        return max(self.passes, default=0) > 0

    def too_many(self) -> bool:
        return max(self.passes, default=0) > self.passes_per_step

    def finish(self, count_value: float, sparse_as_dense: bool, scale: Optional[float] = None) -> None:
        """Start every bucket not started yet (missing grads as zeros), then wait for all of them.

        ``count_value`` is written into the count slot before its bucket starts. On return every
        ``p.grad`` is a view of its buffer holding the SUM over ranks, times ``scale`` if given
        (each bucket scaled as soon as its own collective is done, while later ones still run).
        """
        try:
            for buf in self.buffers:
                if buf.count_slot:
                    buf.flat[-1].fill_(count_value)
            for b in self.order[self.next:]:
                b.buffer.gather(b.members, sparse_as_dense)
                b.launch(self.predivide, self.group)
            self.next = len(self.order)
            scales = {}
            if scale is not None:  # 0-dim in the grads' dtype: the same rounding as one final multiply
                scales = {buf: torch.tensor(scale, dtype=torch.float64).to(buf.dtype) for buf in self.buffers}
            for b in self.order:
                b.wait(scales.get(b.buffer))
        finally:
            self.reset()

    def reset(self) -> None:
        for b in self.order:
            b.pending = len(b.members)
            b.work = None
        self.next = 0
        self.passes[:] = [0] * len(self.passes)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
