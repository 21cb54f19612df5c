"""Squared norms of flat buffers, for the readout and the non-finite guard.

Blocks of ``BLOCK`` elements (1 MiB of float32) keep the fused local passes in L2 on a CPU.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

BLOCK = 1 << 18


def norm(t: torch.Tensor) -> torch.Tensor:
    # float32 accumulation without a float64 copy of the whole buffer; narrow dtypes upcast.
    if t.dtype in (torch.float32, torch.float64):
        return torch.linalg.vector_norm(t).double()
    return torch.linalg.vector_norm(t, dtype=torch.float32).double()


def sq_sum(norms: Sequence[torch.Tensor]) -> float:
    """Sum of squares of 0-dim norms, in float64 (one host read for the lot)."""
    if not norms:
        return 0.0
    return float(sum(v * v for v in torch.stack(list(norms)).tolist()))


def sq(t: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of one block, as a 0-dim tensor: BLAS dot for float32/64 (half the time
    of vector_norm on CPU), float32 accumulation for narrow dtypes."""
    if t.dtype in (torch.float32, torch.float64):
        return torch.dot(t, t)
    return torch.linalg.vector_norm(t, dtype=torch.float32).square()


def total(squares: Sequence[torch.Tensor]) -> float:
    """Sum of per-block squared norms, in float64 (one host read for the lot)."""
    if not squares:
        return 0.0
    return float(torch.stack([q.double() for q in squares]).sum())


def norm_sq(groups: Sequence, cpu: bool) -> Optional[float]:
    """``sum ||g.flat||^2`` over flat groups (None for none): on a CPU in blocks of BLAS dot (half
    the time of vector_norm), elsewhere one norm per buffer."""
    if not groups:
        return None
    if cpu:
        return total([sq(g.flat[b:b + BLOCK]) for g in groups for b in range(0, g.numel, BLOCK)])
    return sq_sum([norm(g.flat) for g in groups])
