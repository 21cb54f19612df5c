"""The block passes of a streaming sync, each block handled while it sits in cache: the snapshot at
the issue, ``C`` and its readout at the merge, and the delayed update ``W <- G + (W - S)``."""
from __future__ import annotations

from typing import List, Optional

import torch

from .norms import BLOCK, sq, total


def block_of(t: torch.Tensor) -> int:
    """Elements per block for ``t``: cache-sized on the CPU; on a GPU one block per tensor, since
    there blocking only multiplies kernel launches (host time, right before a host sync)."""
    return BLOCK if t.device.type == "cpu" else max(1, t.numel())


def snapshot_pass(lives: List[torch.Tensor], sent: List[torch.Tensor], buf: List[torch.Tensor],
                  n_params: int, mass: float, mover: float, wired: bool) -> float:
    """One pass at the issue: snapshot ``S``, the scaled send copy and ``||S||^2`` of the params.

    Buffers get equal weight among movers (``mover``); with ``wired`` the params are not scaled:
    they travel as encoded differences (flodl_opt/transport/stream_wire.py)."""
    squares = []
    for k, (live, s, b) in enumerate(zip(lives, sent, buf)):
        factor = mass if k < n_params else mover
        blk = block_of(live)
        for i in range(0, live.numel(), blk):
            j = min(live.numel(), i + blk)
            s[i:j].copy_(live[i:j])
            if k < n_params:
                squares.append(sq(s[i:j]))
                if wired:
                    continue
            torch.mul(s[i:j], factor, out=b[i:j])
    return total(squares)


def consensus_pass(buf: List[torch.Tensor], sent: List[torch.Tensor], mass: float, movers: float,
                   n_params: int, post: List[torch.Tensor], diff: List[torch.Tensor], readout: bool,
                   lives: Optional[List[torch.Tensor]] = None, keep_steps: bool = False,
                   normalized: bool = False) -> None:
    """``C = sum_i m_i S_i / sum_j m_j`` in ``buf``, with the readout's squares of ``C`` and
    ``C - S``. Given ``lives`` (no outer step: ``G = C``) it also merges, in the same block.
    ``normalized``: the params' buffers already hold ``C`` (the compressed wire decoded it)."""
    for k, (s, b) in enumerate(zip(sent, buf)):
        param = k < n_params
        blk = block_of(b)
        for i in range(0, b.numel(), blk):
            j = min(b.numel(), i + blk)
            bb, ss = b[i:j], s[i:j]
            if not (param and normalized):
                bb.div_(mass if param else movers)
            if readout and param:
                post.append(sq(bb))
            if lives is None:
                if readout and param:
                    diff.append(sq(bb - ss))   # S is still needed after the outer step
                continue
            torch.sub(bb, ss, out=ss)          # G - S; the snapshot is spent
            if readout and param:
                diff.append(sq(ss))
            merge_block(lives[k][i:j], ss, bb, keep_steps)


def apply_pass(lives: List[torch.Tensor], sent: List[torch.Tensor], buf: List[torch.Tensor],
               keep_steps: bool) -> None:
    """``W <- W + (G - S)`` (or ``W <- G``), block by block."""
    for live, s, b in zip(lives, sent, buf):
        blk = block_of(b)
        for i in range(0, b.numel(), blk):
            j = min(b.numel(), i + blk)
            ss = s[i:j]
            torch.sub(b[i:j], ss, out=ss)
            merge_block(live[i:j], ss, b[i:j], keep_steps)


def merge_block(live: torch.Tensor, g_minus_s: torch.Tensor, g: torch.Tensor, keep_steps: bool) -> None:
    """One block of the delayed update: ``W <- W + (G - S)``, or ``W <- G`` when no steps count."""
    if not keep_steps:
        live.copy_(g)             # no steps in flight (or NaN ones): exactly the blocking result
    elif live.dtype in (torch.float32, torch.float64):
        live.add_(g_minus_s)
    else:
        live.copy_(g_minus_s.add_(live))  # in float32, rounded once
