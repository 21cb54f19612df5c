"""Compressed streaming syncs: each fragment's pseudo-gradient travels through a codec, overlapped.

``LocalSGDOptimizer(..., fragments=P, overlap_steps=tau, wire="int8")`` is Streaming DiLoCo's recipe:
fragments, overlap and low-precision payloads. Per fragment ``p`` (flodl_opt/sync/streaming.py says when):

1. **issue** (at the fragment's step): ``x_i = m_i (S_i - A + e_i)`` with ``S_i`` the send snapshot,
   ``A`` the fragment's anchor (the outer optimizer's, or the last consensus for plain averaging),
   ``m_i`` the rank's work mass and ``e_i`` its error-feedback residual; encoded, and section ``j``
   handed to rank ``j`` by one asynchronous ``all_to_all`` (wire.py's reduce-scatter);
2. **gather** (one step later when ``tau >= 2``, else at the merge; a fixed step, so every rank issues
   it at the same point): the count is known, so each owner sums its sections in float32, divides by
   the cohort's mass ``M``, re-encodes and starts the asynchronous ``all_gather``;
3. **merge** (``tau`` steps after the issue): ``C = A + deQ(gathered)`` on every rank from the same
   bytes, then the streaming merge (outer step, ``W <- G + (W - S)``) as in float32.

The work weights are applied before encoding (``m_i``) and normalized once at the owner (``1/M``), since
the count travels with the payload and ``M`` is not known at the issue. Residuals and the own anchor are
written at the merge only (a failed collective leaves them as they were); the rank's residual is
computed at the issue (it depends on its own encode only) and held until then. A checkpoint taken with
a fragment in flight saves the encoded bytes of whichever phase finished, and the merge happens at the
same step after a resume.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .codecs import Codec
from .wire import _all_gather, _GroupState, _owner_sum, decode_consensus, encode_difference, encode_residual

_FLIGHT = ("own", "recv", "gathered", "pending_res", "pending_owner")


class FragmentWire:
    """The compressed reduce of every fragment's params (float buffers stay float32, in streaming.py).

    ``lives[p]``: fragment ``p``'s param slices; ``anchors[p]``: the outer optimizer's anchor slices
    for them, or None (plain averaging: an own copy of the last consensus)."""

    def __init__(self, codec: Codec, error_feedback: bool, lives: Sequence[Sequence[torch.Tensor]],
                 anchors: Sequence[Optional[Sequence[torch.Tensor]]], world: int, rank: int,
                 group: Optional[dist.ProcessGroup]):
        self.codec, self.error_feedback = codec, error_feedback
        self.world, self.rank, self.group = world, rank, group
        self.states: List[List[_GroupState]] = []
        for live, anchor in zip(lives, anchors):
            sts = [_GroupState(t, codec, world, rank, None if anchor is None else anchor[k], error_feedback)
                   for k, t in enumerate(live)]
            for st in sts:
                st.pending_res = torch.zeros_like(st.residual) if error_feedback else None
                st.pending_owner = torch.zeros_like(st.owner_residual) if error_feedback else None
                st.has_res = False  # a pending residual to commit (not when the rank had no vote)
            self.states.append(sts)

    def bytes(self, p: int) -> int:
        """Bytes fragment ``p``'s params hand to collectives per rank: one payload."""
        return sum(st.send.numel() + st.mine.numel() for st in self.states[p])

    # ---------------------------------------------------------------- the phases
    def issue(self, p: int, sent: Sequence[torch.Tensor], mass: float, works: list) -> None:
        """Encode ``mass * (S - A + e)`` and start the all_to_all (nothing of ours is written)."""
        for st, s in zip(self.states[p], sent):
            encode_difference(st, s, mass, self.codec)
            st.has_res = st.residual is not None and mass != 0.0
            if st.has_res:
                encode_residual(st, mass, self.codec, st.pending_res)
        for st in self.states[p]:
            works.append(dist.all_to_all_single(st.recv, st.send.view(-1), output_split_sizes=st.splits,
                                                input_split_sizes=st.splits, group=self.group, async_op=True))

    def gather(self, p: int, total_mass: float, works: list) -> None:
        """The owner's float32 sum over ``M``, re-encoded, and the all_gather started."""
        for st in self.states[p]:
            _owner_sum(self.codec, st.own, st.recv.view(self.world - 1, st.sec), self.rank, st.acc, st.part)
            st.acc.div_(total_mass)
            if st.owner_residual is not None:
                st.acc.add_(st.owner_residual)
            self.codec.encode(st.acc, st.mine)
            if st.owner_residual is not None:
                self.codec.decode(st.mine, st.part)
                torch.sub(st.acc.view(-1), st.part.view(-1), out=st.pending_owner)
            works.append(_all_gather(st.gathered.view(-1), st.mine.view(-1), self.group, async_op=True))

    def decode(self, p: int, out: Sequence[torch.Tensor]) -> None:
        """``out[k] <- A + deQ(gathered)``: the consensus ``C``, bit-identical on every rank."""
        for st, o in zip(self.states[p], out):
            decode_consensus(st, self.codec, o)

    def commit(self, p: int, consensus: Sequence[torch.Tensor]) -> None:
        """After a merge that succeeded: residuals, and the own anchor becomes ``C``."""
        for st, c in zip(self.states[p], consensus):
            if st.has_res:
                st.residual.copy_(st.pending_res)
            if st.owner_residual is not None:
                st.owner_residual.copy_(st.pending_owner)
            if st.own_anchor:
                st.anchor.copy_(c)

    # ---------------------------------------------------------------- checkpoints
    def flight_state(self, p: int) -> List[Dict[str, Any]]:
        """What a finished phase left for the merge of fragment ``p`` (bytes and pending residuals)."""
        return [{k: (getattr(st, k).detach().clone() if getattr(st, k) is not None else None) for k in _FLIGHT}
                | {"has_res": st.has_res} for st in self.states[p]]

    def load_flight_state(self, p: int, saved: List[Dict[str, Any]]) -> None:
        with torch.no_grad():
            for st, s in zip(self.states[p], saved):
                for k in _FLIGHT:
                    if getattr(st, k) is not None and s.get(k) is not None:
                        getattr(st, k).copy_(s[k])
                st.has_res = bool(s["has_res"])

    def state_dict(self) -> Dict[str, Any]:
        """Per rank: residuals and, for plain averaging, the own anchors (per fragment, per slice)."""
        def grab(name: str) -> list:
            return [[None if getattr(st, name) is None or (name == "anchor" and not st.own_anchor)
                     else getattr(st, name).detach().clone() for st in sts] for sts in self.states]
        return {"world": self.world, "anchor": grab("anchor"), "residual": grab("residual"),
                "owner_residual": grab("owner_residual")}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        same_world = sd.get("world") == self.world  # residuals belong to this world's ranks and sections
        with torch.no_grad():
            for p, sts in enumerate(self.states):
                for k, st in enumerate(sts):
                    a, r, o = sd["anchor"][p][k], sd["residual"][p][k], sd["owner_residual"][p][k]
                    if st.own_anchor and a is not None:
                        st.anchor.copy_(a)
                    for mine, saved in ((st.residual, r), (st.owner_residual, o)):
                        if mine is not None:
                            mine.copy_(saved) if same_world and saved is not None else mine.zero_()
