"""The float32 reduce of the blocking sync: one in-place collective that leaves ``sum_i f_i X_i``.

Two transports behind one ``reduce(group, factor) -> collectives issued``:

* :class:`NcclPremulSum`: NCCL premultiplies inside the collective (``PREMUL_SUM``, the factor a
  device tensor: no host sync), one collective per flat buffer;
* :class:`GlooChunks`: Gloo scales locally then SUMs, chunk by chunk, so the scale of chunk k+1
  overlaps the reduction of chunk k; the pre-sync copy and the pre-norm ride in the same
  cache-sized blocks as the scale (``issue``), and the readout of chunk k runs while the later
  chunks are still being reduced (``finish``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..sync.flat import FlatGroup
from ..sync.norms import BLOCK, sq
from ..sync.presync import PresyncCopy

# Measured with tools/bench_sync.py on 2 Gloo ranks: smaller chunks overlap more but each Gloo
# collective pays a fixed cost, and on a CPU-bound host the overlap buys little (BENCHMARKS.md).
DEFAULT_GLOO_CHUNK_BYTES = 64 << 20


class NcclPremulSum:
    """NCCL: ``PREMUL_SUM`` with the factor as a device tensor, one collective per buffer."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.group = group
        self._factors: dict = {}  # (device, dtype) -> 1-element device tensor for PREMUL_SUM

    def reduce(self, g: FlatGroup, factor: float) -> int:
        # Only groups of two or more get here (``distributed``): NCCL 2.28's one-rank PREMUL_SUM
        # leaves a few elements of some buffer sizes unscaled (seen on an H200, GPU_NOTES.md).
        buf = g.staging()
        if not g.wide:
            buf.copy_(g.flat)
        key = (buf.device, buf.dtype)
        f = self._factors.get(key)
        if f is None:
            f = self._factors[key] = torch.empty((), dtype=buf.dtype, device=buf.device)
        f.fill_(factor)  # a kernel with the scalar as argument: no host sync
        if factor == 0.0:
            buf.zero_()  # 0 * NaN is NaN: a non-finite rank must contribute exact zeros
        op = dist._make_nccl_premul_sum(f)
        dist.all_reduce(buf, op=op, group=self.group)
        if not g.wide:
            g.flat.copy_(buf)
        return 1


class GlooChunks:
    """Gloo: async SUMs chunk by chunk, the local passes fused per cache block around them.

    ``issue`` writes the pre-sync copy into ``presync`` as it goes, so a failure part-way restores
    exactly the elements copied so far.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], chunk_bytes: int, presync: PresyncCopy):
        self.group, self.chunk_bytes, self.presync = group, chunk_bytes, presync
        self._tmps: dict = {}     # (dtype, device) -> one block of scratch for the chunked readout

    def reduce(self, g: FlatGroup, factor: float) -> int:
        """Scale and reduce one buffer chunk by chunk, no readout (the NCCL-style ``reduce`` API)."""
        works: list = []
        self.issue(g, factor, False, None, works, False)
        self.finish(works, None, None)
        return len(works)

    def _tmp(self, dtype: torch.dtype, n: int, device: torch.device) -> torch.Tensor:
        # On the buffer's device: Gloo also reduces CUDA tensors (ranks sharing one GPU).
        t = self._tmps.get((dtype, device))
        if t is None:
            t = self._tmps[(dtype, device)] = torch.empty(BLOCK, dtype=dtype, device=device)
        return t[:n]

    def issue(self, g: FlatGroup, factor: float, copy_pre: bool,
              pre_norms: Optional[list], works: list, is_param: bool) -> None:
        """Issue the async SUMs of one buffer, chunk by chunk; returns before they finish.

        Each chunk is prepared in cache-sized blocks (pre-sync copy, pre-norm, scale: one trip
        through memory instead of three) while Gloo's threads reduce the chunks issued before it.
        """
        buf, flat = g.staging(), g.flat
        s = self.presync.buffer(g) if copy_pre else None
        valid = self.presync.valid
        if copy_pre:
            valid[id(g)] = 0
        step = max(1, self.chunk_bytes // buf.element_size())
        block = min(step, BLOCK)
        for start in range(0, g.numel, step):
            end = min(g.numel, start + step)
            for b in range(start, end, block):
                e = min(end, b + block)
                src, dst = flat[b:e], buf[b:e]
                if s is not None:
                    s[b:e].copy_(src)
                    valid[id(g)] = e
                if pre_norms is not None:
                    pre_norms.append(sq(src))
                if factor == 0.0:
                    dst.zero_()  # 0 * NaN is NaN: a rank without a vote contributes exact zeros
                elif g.wide:
                    if factor != 1.0:
                        dst.mul_(factor)
                else:
                    dst.copy_(src).mul_(factor)
            works.append((g, start, end, is_param,
                          dist.all_reduce(buf[start:end], op=dist.ReduceOp.SUM, group=self.group,
                                          async_op=True)))

    def finish(self, works: list, post_norms: Optional[list], diff_norms: Optional[list]) -> None:
        """Wait for the chunks in order; the readout of chunk k runs while later chunks reduce."""
        # On a failure the chunks still in flight are not waited for: with a hung peer each
        # would take the full collective timeout; a dead peer fails them all at once anyway.
        for g, start, end, is_param, w in works:
            w.wait()
            if not g.wide:
                g.flat[start:end].copy_(g.staging()[start:end])
            if not is_param or post_norms is None:
                continue
            s = self.presync.scratch.get(id(g)) if diff_norms is not None else None
            for b in range(start, end, BLOCK):
                e = min(end, b + BLOCK)
                c = g.flat[b:e]
                post_norms.append(sq(c))
                if s is not None:
                    t = self._tmp(g.reduce_dtype, e - b, g.device)
                    if g.wide:
                        torch.sub(s[b:e], c, out=t)  # one op instead of copy + sub
                    else:
                        t.copy_(s[b:e]).sub_(c)  # narrow: difference in float32
                    diff_norms.append(sq(t))
