"""Compressed syncs: send each rank's difference from a common anchor in bf16, fp16 or int8.

``LocalSGDOptimizer(..., wire="bf16" | "fp16" | "int8")`` replaces the float32 reduce of the
params by a :class:`CompressedWire`. What travels is a *difference*, never the weights: rank i
sends ``Q(f_i * (W_i - A))`` against the anchor ``A`` every rank holds bit for bit (the last
consensus for plain averaging, the outer optimizer's anchor for DiLoCo/SlowMo, so the DiLoCo
payload is the pseudo-gradient), and the consensus is

    ``C = A + sum_i deQ(Q(f_i * (W_i - A)))``      (``f_i`` the work-weight factors of the count)

Small updates keep their precision in a narrow format, which weights near 1.0 would not.

The reduction is a reduce-scatter then an all-gather, both of the narrow payload:

1. every rank encodes its whole difference, split into ``N`` sections (one per owner rank);
2. ``all_to_all`` hands section ``j`` to rank ``j`` (the own section stays local: zero split);
3. the owner decodes the ``N`` sections and sums them in float32, in rank order;
4. the owner re-encodes its sum (``Q`` again) and ``all_gather`` gives every section to everyone;
5. every rank, the owner included, decodes the gathered sections: ``W <- A + deQ(...)``.

Step 5 reads the same bytes on every rank with the same arithmetic, so params are bit-identical
across ranks. Bytes handed to collectives per rank: ``(N-1)/N`` of the payload to ``all_to_all``
plus ``1/N`` to ``all_gather`` = one payload, i.e. 1/2 (bf16, fp16) and about 1/4 (int8) of the
float32 all_reduce's input; the same ratio holds for the bytes a ring all_reduce sends.

Why not a SUM all_reduce in bf16/fp16? Gloo supports it but rounds every partial sum to the narrow
dtype (``N-1`` roundings; measured on 3 ranks: 1.5x the error of one rounding), and fp16 partial
sums can overflow; NCCL's bf16 PREMUL_SUM is unreliable (DESIGN.md). Summing in float32 at the
owner costs the second rounding of step 4 only, whatever ``N`` is.

The formats and their error bounds are in flodl_opt/transport/codecs.py (the registry ``wire=`` reads).

Every element is encoded twice (step 1 by its rank, step 4 by its owner), so the consensus error
per element is at most ``sum_i err(x_i) + err(S)`` with ``S`` the float32 sum.

``error_feedback=True``: each rank adds the residual ``(x_i - deQ(Q(x_i))) / f_i`` of its last
encode to its next difference, and each owner adds the residual of its re-encode to its next sum,
so over many syncs nothing is lost (the sum of the decoded updates stays within one quantization
of the exact sum). Both residuals are in ``state_dict`` (per rank) for an exact resume.

Memory, per float32 param element (4 bytes; the fp32 sync's own pre-sync copy not counted):
a float32 work buffer (4 B); the payload's send, own, receive, gather and re-encode buffers (about
3 payloads: 6 B for bf16/fp16, 3 B for int8); two float32 sections (8/N B); a float32 temporary
while encoding (up to 4 B, freed after). Plain averaging and EASGD add the anchor (4 B); DiLoCo,
SlowMo and a torch outer optimizer share their own anchor (0 B). Error feedback adds 4 B + 4/N B.
Measured with tools/bench_sync.py on 2 ranks: int8 +4.2 param copies over the fp32 sync with plain
averaging, +3.2 with DiLoCo; bf16 +4.9 / +3.9 (BENCHMARKS.md).

Float buffers (BatchNorm running stats) are small, are not differences from an anchor, and ride
the float32 path unchanged; integer buffers are never synced. A world of one sends nothing and
runs the usual float32 path (the params already are the consensus).

Example::

    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model,
                                sync_every=64, outer="diloco", wire="int8", wire_block=256)
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .codecs import (CODECS, DEFAULT_WIRE_BLOCK, WIRES, Codec, _ALIGN, _BF16_U, _FP16_U,  # noqa: F401
                     make_codec)
from ..sync.flat import FlatGroup

if TYPE_CHECKING:  # consensus imports nothing from here: no cycle at run time
    from ..sync.consensus import Consensus
    from ..sync.stats import SyncStats



def wire_config(wire: str = "fp32", wire_block: int = DEFAULT_WIRE_BLOCK,
                error_feedback: bool = False) -> Dict[str, Any]:
    """The wire settings as the optimizer's config records them (fp32: today's defaults)."""
    return {"mode": wire, "block": wire_block if wire == "int8" else None,
            "error_feedback": bool(error_feedback)}


def make_wire(wire: str, wire_block: int, error_feedback: bool) -> Optional["CompressedWire"]:
    """Validate the options; ``None`` for ``"fp32"`` (the optimizer keeps its float32 reduce)."""
    if not isinstance(wire, str) or wire.lower() not in WIRES:
        raise ConfigError(f"flodl_opt: unknown wire={wire!r}; use one of {list(WIRES)} "
                          "(fp32 = uncompressed, the default)")
    wire = wire.lower()
    if not isinstance(error_feedback, bool):
        raise ConfigError(f"error_feedback must be True or False, got {error_feedback!r}")
    if wire == "fp32":
        if error_feedback:
            raise ConfigError("flodl_opt: error_feedback=True needs a compressed wire "
                              "(wire='bf16', 'fp16' or 'int8'); fp32 loses nothing to feed back")
        return None
    if isinstance(wire_block, bool) or not isinstance(wire_block, int) or wire_block < 16 \
            or wire_block % 4 or wire_block > 1 << 20:
        raise ConfigError(f"wire_block must be an int in [16, 2**20] and a multiple of 4 (elements "
                          f"per int8 scale), got {wire_block!r}")
    return CompressedWire(make_codec(wire, wire_block), error_feedback)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False) -> Any:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _owner_sum(codec: Codec, own: torch.Tensor, recv: torch.Tensor, rank: int, acc: torch.Tensor,
               part: torch.Tensor) -> None:
    """Step 3: the owner's sum into ``acc``, in float32, in rank order (its own section from its own
    payload, the peers' from ``recv``, one row per peer)."""
    acc.zero_()
    for r in range(recv.shape[0] + 1):
        codec.decode(own if r == rank else recv[r if r < rank else r - 1].unsqueeze(0), part)
        acc.add_(part)


def narrow_sum_bytes(codec: Codec, numel: int, world: int) -> int:
    """Bytes ``narrow_sum`` hands to its two collectives per rank: one payload."""
    return world * codec.section_bytes(codec.section_len(numel, world))


def narrow_sum(x: torch.Tensor, codec: Codec, world: int, rank: int,
               group: Optional[dist.ProcessGroup]) -> None:
    """Sum the float32 vector ``x`` over the ranks through ``codec``, in place: steps 1-5 above on
    ``x`` itself (no anchor, no residual). Every rank decodes the same gathered bytes, so ``x`` ends
    bit-identical everywhere; nothing but ``x`` is written, and only after both collectives."""
    n, c = x.numel(), codec.section_len(x.numel(), world)
    sec = codec.section_bytes(c)
    rows = torch.zeros(world, c, dtype=torch.float32, device=x.device)
    rows.view(-1)[:n].copy_(x)
    enc = torch.empty(world, sec, dtype=torch.uint8, device=x.device)
    codec.encode(rows, enc)
    splits = [0 if r == rank else sec for r in range(world)]
    recv = torch.empty((world - 1) * sec, dtype=torch.uint8, device=x.device)
    dist.all_to_all_single(recv, torch.cat([enc[:rank], enc[rank + 1:]]).view(-1), output_split_sizes=splits,
                           input_split_sizes=splits, group=group)
    acc, part = rows[rank:rank + 1].clone(), torch.empty(1, c, dtype=torch.float32, device=x.device)
    _owner_sum(codec, enc[rank:rank + 1], recv.view(world - 1, sec), rank, acc, part)
    mine = torch.empty(1, sec, dtype=torch.uint8, device=x.device)
    codec.encode(acc, mine)
    _all_gather(enc.view(-1), mine.view(-1), group)   # enc is spent: it now holds every owner's sum
    codec.decode(enc, rows)
    x.copy_(rows.view(-1)[:n])


# ------------------------------------------------------------------ per flat group
class _GroupState:
    """The buffers of one float32 vector (a flat param group, or one fragment's slice of it), sized for
    ``world`` sections of ``c`` elements, with its anchor and residuals."""

    def __init__(self, flat: torch.Tensor, codec: Codec, world: int, rank: int,
                 anchor: Optional[torch.Tensor], error_feedback: bool):
        self.flat, self.numel, self.world, self.rank = flat, flat.numel(), world, rank
        self.c = codec.section_len(self.numel, world)
        self.sec = codec.section_bytes(self.c)
        dev = flat.device
        # The anchor: the outer optimizer's (shared, no copy) or our own copy of the last consensus.
        self.own_anchor = anchor is None
        self.anchor = flat.detach().clone() if anchor is None else anchor
        self.x = torch.zeros(world * self.c, dtype=torch.float32, device=dev)       # f_i (W_i - A + e_i)
        # This rank's encoded sections: the peers' ones (sent) and its own (kept) apart, so the
        # all_to_all input needs no gather copy.
        self.send = torch.empty(world - 1, self.sec, dtype=torch.uint8, device=dev)
        self.own = torch.empty(1, self.sec, dtype=torch.uint8, device=dev)
        self.recv = torch.empty((world - 1) * self.sec, dtype=torch.uint8, device=dev)
        self.mine = torch.empty(1, self.sec, dtype=torch.uint8, device=dev)          # re-encoded sum
        self.gathered = torch.empty(world, self.sec, dtype=torch.uint8, device=dev)
        self.acc = torch.empty(1, self.c, dtype=torch.float32, device=dev)
        self.part = torch.empty(1, self.c, dtype=torch.float32, device=dev)   # one decoded section
        self.residual = self.owner_residual = None
        if error_feedback:
            self.residual = torch.zeros(self.numel, dtype=torch.float32, device=dev)
            self.owner_residual = torch.zeros(self.c, dtype=torch.float32, device=dev)

    @property
    def splits(self) -> List[int]:
        return [0 if r == self.rank else self.sec for r in range(self.world)]

    def parts(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(rows of x, their encoded rows) for the sections before, at and after this rank's."""
        x, r = self.x.view(self.world, self.c), self.rank
        out = [(x[:r], self.send[:r]), (x[r:r + 1], self.own), (x[r + 1:], self.send[r:])]
        return [(a, b) for a, b in out if a.shape[0]]


def encode_difference(st: _GroupState, w: torch.Tensor, f: float, codec: Codec) -> None:
    """Step 1: ``x = f (w - A + e)`` in ``st.x``, encoded into ``st.send``/``st.own`` (f == 0: exact zeros)."""
    x, n = st.x, st.numel
    if f == 0.0:
        x.zero_()  # no vote (idle or non-finite): exact zeros, never 0 * NaN
    else:
        torch.sub(w, st.anchor, out=x[:n])
        if st.residual is not None:
            x[:n].add_(st.residual)
        x[:n].mul_(f)
    for rows, enc in st.parts():
        codec.encode(rows, enc)


def encode_residual(st: _GroupState, f: float, codec: Codec, out: torch.Tensor) -> None:
    """This rank's encode residual, back in unscaled units: ``(x - deQ(Q(x))) / f`` (``st.x`` is spent)."""
    for rows, enc in st.parts():
        sent = torch.empty_like(rows)
        codec.decode(enc, sent)
        rows.sub_(sent)  # x now holds x - deQ(Q(x))
    torch.div(st.x[:st.numel], f, out=out)


def decode_consensus(st: _GroupState, codec: Codec, out: torch.Tensor) -> None:
    """Step 5: ``out <- A + deQ(gathered)``, section by section."""
    n, c, part = st.numel, st.c, st.part
    for j in range(st.world):
        lo, hi = j * c, min(n, (j + 1) * c)
        if lo >= n:
            break
        codec.decode(st.gathered[j:j + 1], part)
        torch.add(st.anchor[lo:hi], part.view(-1)[:hi - lo], out=out[lo:hi])


class CompressedWire:
    """The compressed param reduce of one optimizer (see the module docstring for the maths).

    ``run`` is the whole sync (count -> compressed reduce -> readout) and keeps every guarantee of
    the float32 one: the count step, work weights, skip-when-idle, the non-finite guard (a NaN
    rank sends exact zeros), restore-on-failure (params, anchor and residuals are written only
    after every collective succeeded) and the divergence readout.
    """

    def __init__(self, codec: Codec, error_feedback: bool):
        self.codec, self.error_feedback = codec, error_feedback
        self.name = codec.name
        self._groups: List[_GroupState] = []
        self._bound: Optional[Tuple] = None

    def config(self) -> Dict[str, Any]:
        return wire_config(self.name, self.codec.block, self.error_feedback)

    def check_groups(self, groups: Sequence[FlatGroup]) -> None:
        """Compressed syncs handle float32 params only: refuse anything else at construction."""
        bad = sorted({str(g.dtype) for g in groups if g.dtype != torch.float32})
        if bad:
            raise ConfigError(f"flodl_opt: wire={self.name!r} compresses float32 params; this model has "
                              f"{bad} params. Use wire='fp32' (narrow params are reduced in float32 "
                              "already) or keep the master weights in float32.")

    def bind(self, groups: Sequence[FlatGroup], anchors: Optional[Sequence[torch.Tensor]],
             world: int, rank: int, group: Optional[dist.ProcessGroup]) -> None:
        """Allocate the buffers once (after the initial broadcast: the anchor starts identical)."""
        self.check_groups(groups)
        self.world, self.rank, self.group = world, rank, group
        if world <= 1:
            return
        self._groups = [_GroupState(g.flat, self.codec, world, rank, None if anchors is None else anchors[i],
                                    self.error_feedback) for i, g in enumerate(groups)]

    # ------------------------------------------------------------------ the sync
    def run(self, c: "Consensus", steps: int, sync_number: int, active: bool) -> "SyncStats":
        """count -> compressed reduce -> readout, as ``Consensus`` does in float32 on NCCL."""
        def reduce(stats: "SyncStats", buffer_factor: float) -> None:
            f = stats.weight
            pending = [self._reduce(st, f, stats) for st in self._groups]  # params untouched
            c.reduce_buffers(stats, buffer_factor)  # float buffers: the float32 path
            for st, owner_res in zip(self._groups, pending):
                self._commit(st, f, owner_res)
        return c.run_one_shot(steps, sync_number, active, reduce)

    def _reduce(self, st: _GroupState, f: float, stats: "SyncStats") -> Optional[torch.Tensor]:
        """Steps 1-4 for one group: ``st.gathered`` holds every owner's encoded sum afterwards.

        Returns the owner's new re-encode residual (committed only once everything succeeded).
        """
        codec, world = self.codec, st.world
        encode_difference(st, st.flat, f, codec)
        dist.all_to_all_single(st.recv, st.send.view(-1), output_split_sizes=st.splits,
                               input_split_sizes=st.splits, group=self.group)
        acc, part = st.acc, st.part
        _owner_sum(codec, st.own, st.recv.view(world - 1, st.sec), st.rank, acc, part)
        owner_res = None
        if st.owner_residual is not None:
            acc.add_(st.owner_residual)
        codec.encode(acc, st.mine)
        if st.owner_residual is not None:
            codec.decode(st.mine, part)
            owner_res = (acc - part).view(-1)
        _all_gather(st.gathered.view(-1), st.mine.view(-1), self.group)
        stats.collectives += 2
        stats.bytes += st.send.numel() + st.mine.numel()
        return owner_res

    def _commit(self, st: _GroupState, f: float, owner_res: Optional[torch.Tensor]) -> None:
        """Step 5, then the anchor and residuals: every collective of the sync has succeeded."""
        if st.residual is not None and f != 0.0:
            encode_residual(st, f, self.codec, st.residual)
        if owner_res is not None:
            st.owner_residual.copy_(owner_res)
        decode_consensus(st, self.codec, st.flat)
        if st.own_anchor:
            st.anchor.copy_(st.flat)  # the next sync's anchor is this consensus

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Per rank: the residuals (error feedback) and, for plain averaging, the own anchor."""
        return {"world": self.world,
                "anchor": [st.anchor.detach().clone() if st.own_anchor else None for st in self._groups],
                "residual": [None if st.residual is None else st.residual.detach().clone()
                             for st in self._groups],
                "owner_residual": [None if st.owner_residual is None else st.owner_residual.detach().clone()
                                   for st in self._groups]}

    def load_state_dict(self, sd: Optional[Dict[str, Any]]) -> None:
        if not self._groups:
            return
        if sd is None or len(sd.get("anchor", ())) != len(self._groups):
            raise ConfigError(f"flodl_opt: the checkpoint holds no wire={self.name!r} state for this "
                              "model; resume with the wire settings it was saved with")
        same_world = sd.get("world") == self.world
        with torch.no_grad():
            for st, a, r, o in zip(self._groups, sd["anchor"], sd["residual"], sd["owner_residual"]):
                if st.own_anchor and a is not None:
                    st.anchor.copy_(a)
                # Residuals belong to this world's ranks and sections: a new world starts them at zero.
                if st.residual is not None:
                    st.residual.copy_(r) if same_world and r is not None else st.residual.zero_()
                if st.owner_residual is not None:
                    st.owner_residual.copy_(o) if same_world and o is not None else st.owner_residual.zero_()
