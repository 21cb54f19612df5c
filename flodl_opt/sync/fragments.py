"""Fragments: the synced tensors split, in layer order and on tensor boundaries, into ``P``
contiguous runs of about equal bytes (float buffers split the same way, on their own)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import torch

from ..errors import ConfigError
from ..hooks.outer import OuterOptimizer
from .flat import FlatGroup


@dataclass(frozen=True)
class Slice:
    """Elements ``[start, end)`` of one flat buffer (``index`` into the param or buffer groups)."""

    index: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class Fragment:
    """A run of whole tensors, as at most one slice per flat buffer."""

    params: List[Slice] = field(default_factory=list)
    buffers: List[Slice] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0   # bytes one sync of this fragment reduces


def _runs(groups: Sequence[FlatGroup], order: Sequence[torch.Tensor], parts: int,
          allow_empty: bool) -> List[List[Slice]]:
    """Split ``order`` (tensors in layer order) into ``parts`` contiguous runs of ~equal bytes."""
    where: Dict[int, Tuple[int, int, int]] = {}   # id -> (group index, start, end incl. padding)
    for gi, g in enumerate(groups):
        for k, (t, off) in enumerate(zip(g.tensors, g.offsets)):
            end = g.offsets[k + 1] if k + 1 < len(g.offsets) else g.numel
            where[id(t)] = (gi, off, end)
    items = [where[id(t)] for t in order if id(t) in where]
    if not allow_empty and len(items) < parts:
        raise ConfigError(f"fragments={parts} is more than the {len(items)} synced param tensors: a "
                          "fragment is made of whole tensors; use fragments <= the number of tensors")
    sizes = [(e - s) * groups[gi].reduce_dtype.itemsize for gi, s, e in items]
    total = sum(sizes)
    # Cut after the tensor whose cumulative bytes come nearest each p/P of the total, keeping at
    # least one tensor per fragment (when there are enough).
    cuts: List[int] = []
    prefix = [0]
    for n in sizes:
        prefix.append(prefix[-1] + n)
    for p in range(1, parts):
        target = total * p / parts
        lo = (cuts[-1] if cuts else 0) + (0 if allow_empty else 1)
        hi = len(items) - (0 if allow_empty else parts - p)
        best = min(range(lo, max(lo, hi) + 1), key=lambda c: (abs(prefix[c] - target), c))
        cuts.append(best)
    bounds = [0] + cuts + [len(items)]
    runs: List[List[Slice]] = []
    for p in range(parts):
        by_group: Dict[int, List[int]] = {}
        for gi, s, e in items[bounds[p]:bounds[p + 1]]:
            r = by_group.get(gi)
            if r is None:
                by_group[gi] = [s, e]
                continue
            if s != r[1]:  # tensors of one dtype in layer order are adjacent in their buffer
                raise AssertionError("fragment is not contiguous in its flat buffer")
            r[1] = e
        runs.append([Slice(gi, s, e) for gi, (s, e) in sorted(by_group.items())])
    return runs


def split_fragments(param_groups: Sequence[FlatGroup], params: Sequence[torch.Tensor],
                    buffer_groups: Sequence[FlatGroup], buffers: Sequence[torch.Tensor],
                    parts: int) -> List[Fragment]:
    """``parts`` fragments of about equal bytes, on tensor boundaries, in layer order."""
    p_runs = _runs(param_groups, params, parts, allow_empty=False)
    b_runs = _runs(buffer_groups, buffers, parts, allow_empty=True) if buffer_groups else [[]] * parts
    frags = []
    for pr, br in zip(p_runs, b_runs):
        n = sum(1 for s in pr for off in param_groups[s.index].offsets if s.start <= off < s.end)
        nbytes = sum(s.numel * param_groups[s.index].reduce_dtype.itemsize for s in pr) + \
            sum(s.numel * buffer_groups[s.index].reduce_dtype.itemsize for s in br)
        frags.append(Fragment(list(pr), list(br), n, nbytes))
    return frags


def outer_slices(outer: OuterOptimizer, fragments: Sequence[Fragment]) -> List[OuterOptimizer]:
    """One outer optimizer per fragment whose anchor and momentum are views of ``outer``'s (call
    after ``outer.setup``): each fragment steps on its own slices of the shared state."""
    out = []
    for f in fragments:
        o = copy.copy(outer)  # shares config; its state lists become views of the full state
        o.anchor = [outer.anchor[s.index][s.start:s.end] for s in f.params] if outer.anchor else []
        o.momentum = [outer.momentum[s.index][s.start:s.end] for s in f.params] if outer.momentum else []
        out.append(o)
    return out
