"""The pre-sync copy of the synced buffers, ``W_i_pre``.

It restores the buffers when a collective fails (only the part copied so far: the rest was never
written) and, once the sync succeeded, is spent in place on ``W_i_pre - C``: the divergence
readout and the deltas the outer step and the drift denoiser read. One copy of the synced bytes.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from .flat import FlatGroup


class PresyncCopy:
    def __init__(self) -> None:
        self.scratch: Dict[int, torch.Tensor] = {}  # id(group) -> pre-sync copy
        self.valid: Dict[int, int] = {}             # id(group) -> elements of the copy taken at this sync
        self.is_delta = False  # holds W_i_pre - C (after the readout) rather than W_i_pre

    def buffer(self, g: FlatGroup) -> torch.Tensor:
        s = self.scratch.get(id(g))
        if s is None:
            s = self.scratch[id(g)] = torch.empty_like(g.flat)
        return s

    def take(self, groups: Sequence[FlatGroup]) -> None:
        for g in groups:
            self.buffer(g).copy_(g.flat)
            self.valid[id(g)] = g.numel
        self.is_delta = False

    def start(self) -> None:
        """Nothing copied yet at this sync: a restore must not write the last sync's stale data."""
        self.valid.clear()
        self.is_delta = False

    def restore(self, groups: Sequence[FlatGroup]) -> bool:
        """Put the copied values back; False when the copy is already spent on the readout."""
        if self.is_delta:
            return False
        # Nothing copied yet (a count that failed): nothing was written either, the params are intact.
        with torch.no_grad():
            for g in groups:
                s, n = self.scratch.get(id(g)), self.valid.get(id(g), 0)
                if s is not None and n:
                    g.flat[:n].copy_(s[:n])
        return True

    def deltas(self, params: Sequence[FlatGroup]) -> List[torch.Tensor]:
        """``W_i_pre - C`` per param group (the copy is spent in place, once)."""
        if not self.is_delta:
            with torch.no_grad():
                for g in params:
                    self.scratch[id(g)].sub_(g.flat)
            self.is_delta = True
        return [self.scratch[id(g)] for g in params]
