"""What the Horovod API (``flodl_opt.horovod``) and its collectives (``flodl_opt.horovod.ops``)
share: the reduction ops, compression, group helpers, and the signature every collective of this
package exchanges first so that ranks calling different things raise instead of crashing or hanging.
"""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import launch
from ..errors import CollectiveMismatchError, ConfigError


# ---------------------------------------------------------------- reduction ops
class ReduceOp:
    """A reduction for ``allreduce`` and ``DistributedOptimizer(op=...)`` (Horovod's names)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"flodl_opt.{self.name}"

    def __reduce__(self):  # pickles as the module-level singleton
        return self.name


Average = ReduceOp("Average")
Sum = ReduceOp("Sum")
Min = ReduceOp("Min")
Max = ReduceOp("Max")
Product = ReduceOp("Product")
Adasum = ReduceOp("Adasum")  # named so Horovod scripts import; rejected with a clear message

def _op(op: Optional[ReduceOp], average: Optional[bool] = None) -> ReduceOp:
    if op is None:
        return Average if average is None or average else Sum
    if average is not None:
        raise ConfigError("pass either op= or the deprecated average=, not both")
    if not isinstance(op, ReduceOp):
        raise ConfigError(f"op must be flodl_opt.Average, Sum, Min, Max or Product, got {op!r}")
    if op is Adasum:
        raise ConfigError("Adasum is not supported: use op=flodl_opt.Average (the default), or "
                          "LocalSGDOptimizer for communication-efficient training")
    return op


# ---------------------------------------------------------------- compression
class Compressor:
    """Gradient compression on the wire: reduce in ``wire_dtype`` instead of the gradient's dtype."""

    wire_dtype: Optional[torch.dtype] = None

    def __init__(self, name: str, wire_dtype: Optional[torch.dtype]):
        self.name, self.wire_dtype = name, wire_dtype

    def __repr__(self) -> str:
        return f"flodl_opt.Compression.{self.name}"

    def compress(self, tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Horovod's interface: ``(tensor on the wire, ctx for decompress)``; others pass through."""
        if self.wire_dtype is None or tensor.dtype not in (torch.float32, torch.float64):
            return tensor, None
        return tensor.to(self.wire_dtype), tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Back to the dtype ``compress`` saw (``ctx``)."""
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """Horovod's ``Compression.none`` / ``Compression.fp16`` (float32/64 grads reduced in float16).

    ``Compression.fp16.compress(t)`` returns ``(t.half(), t.dtype)`` for float32/64 tensors (any other
    dtype passes through) and ``decompress(t, ctx)`` casts back, as in Horovod.
    """

    none = Compressor("none", None)
    fp16 = Compressor("fp16", torch.float16)


# ---------------------------------------------------------------- small collective helpers
def _group_size(group) -> int:
    launch.ensure_init()
    if launch.size() == 1:
        return 1
    return dist.get_world_size(group)


def _global_rank(group, rank: int) -> int:
    size = dist.get_world_size(group)
    if not 0 <= rank < size:
        raise ConfigError(f"root_rank={rank} is outside the group of {size} ranks")
    return dist.get_global_rank(group, rank) if group is not None else rank


def _comm_device() -> torch.device:
    """Where host-side helpers stage tensors for a collective: NCCL needs CUDA, Gloo takes CPU."""
    return launch.device() if launch.backend() == "nccl" else torch.device("cpu")


def _agree(ok: bool, group) -> bool:
    """True on every rank iff ``ok`` on every rank (one tiny MIN), so a bad rank fails them all."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


# ---------------------------------------------------------------- the signature
_ALLREDUCE, _ALLGATHER, _BROADCAST, _BARRIER, _JOIN = 1, 2, 3, 4, 5
# The object collectives and DistributedOptimizer's build check exchange the same signature first,
# so a rank in one of them while its peer runs any other collective of this package raises instead
# of pairing two collectives of different sizes (Gloo aborts the process) or waiting out the timeout.
_ALLGATHER_OBJECT, _BROADCAST_OBJECT, _BROADCAST_PARAMETERS, _BROADCAST_OPTIMIZER_STATE = 6, 7, 8, 9
_DISTRIBUTED_OPTIMIZER = 10
_KIND_NAMES = {_ALLREDUCE: "allreduce", _ALLGATHER: "allgather", _BROADCAST: "broadcast",
               _BARRIER: "barrier", _JOIN: "join", _ALLGATHER_OBJECT: "allgather_object",
               _BROADCAST_OBJECT: "broadcast_object", _BROADCAST_PARAMETERS: "broadcast_parameters",
               _BROADCAST_OPTIMIZER_STATE: "broadcast_optimizer_state",
               _DISTRIBUTED_OPTIMIZER: "DistributedOptimizer"}
_TENSOR_KINDS = (_ALLREDUCE, _ALLGATHER, _BROADCAST)
_ROOTED_KINDS = (_BROADCAST, _BROADCAST_OBJECT, _BROADCAST_PARAMETERS, _BROADCAST_OPTIMIZER_STATE)
_OPS: List[ReduceOp] = [Average, Sum, Min, Max, Product]
_DTYPES: List[torch.dtype] = [d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
    getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None),
    getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None]
_DEVICES = {"cpu": 0, "cuda": 1}

# Field positions in the signature (int64 each).
_MAGIC, _KIND, _DTYPE, _DEVICE, _ARG, _GRAD, _NAME, _PRE, _POST, _ROUNDS, _ERR, _NDIM = range(12)
_DIMS, _NDIMS_KEPT = 12, 11          # the first 11 dims verbatim (enough to rebuild the numel) ...
_TAIL, _HASH = _DIMS + _NDIMS_KEPT, _DIMS + _NDIMS_KEPT + 1   # ... the product of the rest, a hash
_TEXT, _TEXT_WORDS = _HASH + 1, 4    # the name's first 32 UTF-8 bytes, so an error can print it
_SIG_LEN = _TEXT + _TEXT_WORDS
_MAGIC_VALUE = 0x464C4F44  # a misaligned collective shows up as a bad magic, not as a shape error


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _name_code(name: Optional[str]) -> int:
    return -1 if name is None else zlib.crc32(str(name).encode())


def _name_words(name: Optional[str]) -> List[int]:
    raw = b"" if name is None else str(name).encode()[:8 * _TEXT_WORDS]
    raw = raw.ljust(8 * _TEXT_WORDS, b"\0")
    return list(struct.unpack(f"<{_TEXT_WORDS}q", raw))


def _name_text(sig: List[int]) -> str:
    """The name a signature carries (its first 32 bytes; '...' marks a longer one)."""
    raw = struct.pack(f"<{_TEXT_WORDS}q", *sig[_TEXT:_TEXT + _TEXT_WORDS])
    text = raw.rstrip(b"\0").decode("utf-8", "replace")
    return repr(text) + ("..." if len(raw.rstrip(b"\0")) == len(raw) else "")


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


@dataclass
class _Call:
    """What this rank asks for; ``error`` is a refusal of its own arguments (sent, then raised)."""

    kind: int
    name: Optional[str] = None
    dtype: Optional[torch.dtype] = None
    device: str = "cpu"
    shape: Tuple[int, ...] = ()
    arg: int = 0                     # op index (allreduce) or root rank (the broadcasts)
    grad: bool = False
    pre: float = 1.0
    post: float = 1.0
    rounds: int = 0                  # join: rounds served so far
    error: Optional[str] = None

    def encode(self) -> List[int]:
        sig = [0] * _SIG_LEN
        sig[_MAGIC], sig[_KIND], sig[_ARG], sig[_GRAD] = _MAGIC_VALUE, self.kind, self.arg, int(self.grad)
        sig[_DTYPE] = _DTYPES.index(self.dtype) + 1 if self.dtype in _DTYPES else 0
        sig[_DEVICE] = _DEVICES.get(self.device, 2)
        sig[_NAME], sig[_PRE], sig[_POST] = _name_code(self.name), _bits(self.pre), _bits(self.post)
        sig[_ROUNDS], sig[_ERR], sig[_NDIM] = self.rounds, int(self.error is not None), len(self.shape)
        for i, d in enumerate(self.shape[:_NDIMS_KEPT]):
            sig[_DIMS + i] = d
        sig[_TAIL] = _numel(self.shape[_NDIMS_KEPT:])
        sig[_HASH] = zlib.crc32(repr(tuple(self.shape[1:])).encode())
        sig[_TEXT:_TEXT + _TEXT_WORDS] = _name_words(self.name)
        return sig


def _sig_shape(sig: List[int]) -> List[int]:
    kept = sig[_DIMS:_DIMS + min(sig[_NDIM], _NDIMS_KEPT)]
    return kept + ([f"...x{sig[_TAIL]}"] if sig[_NDIM] > _NDIMS_KEPT else [])  # type: ignore[list-item]


def _sig_numel(sig: List[int]) -> int:
    return _numel(sig[_DIMS:_DIMS + min(sig[_NDIM], _NDIMS_KEPT)]) * sig[_TAIL]


def _describe(sig: List[int]) -> str:
    if sig[_MAGIC] != _MAGIC_VALUE:
        return "another collective (not one of flodl_opt's Horovod-API calls)"
    kind = _KIND_NAMES.get(sig[_KIND], "?")
    if sig[_ERR]:
        return f"{kind} with arguments it refused (see its own error)"
    name = "name=<none>" if sig[_NAME] == -1 else f"name={_name_text(sig)}"
    if sig[_KIND] == _DISTRIBUTED_OPTIMIZER:
        return f"building {kind}"
    if sig[_KIND] in (_JOIN, _BARRIER):
        return f"{kind}()"
    if sig[_KIND] not in _TENSOR_KINDS:
        return f"{kind}({'root_rank=%d, ' % sig[_ARG] if sig[_KIND] in _ROOTED_KINDS else ''}{name})"
    dtype = _DTYPES[sig[_DTYPE] - 1] if sig[_DTYPE] else "unsupported dtype"
    dev = {v: k for k, v in _DEVICES.items()}.get(sig[_DEVICE], "other device")
    parts = [f"{str(dtype).replace('torch.', '')}{_sig_shape(sig)} on {dev}"]
    if sig[_KIND] == _ALLREDUCE:
        parts.append(f"op={_OPS[sig[_ARG]].name}")
        pre, post = (struct.unpack("<d", struct.pack("<q", sig[k]))[0] for k in (_PRE, _POST))
        if (pre, post) != (1.0, 1.0):
            parts.append(f"prescale={pre:g}, postscale={post:g}")
    if sig[_KIND] == _BROADCAST:
        parts.append(f"root_rank={sig[_ARG]}")
    parts.append(name)
    if sig[_GRAD]:
        parts.append("requires grad")
    return f"{kind}({', '.join(parts)})"


@dataclass
class _Agreement:
    """The verdict every rank computes alike from the gathered signatures."""

    sigs: List[List[int]]
    active: List[int]                # ranks running the collective (not inside join())
    joined: List[int]
    error: Optional[str] = None      # set: every active rank raises it, joined ranks skip the round

    @property
    def ref(self) -> List[int]:
        return self.sigs[self.active[0]]


def _same(kind: int, a: List[int], b: List[int]) -> bool:
    keys = [_MAGIC, _KIND, _DTYPE, _DEVICE, _ARG, _GRAD, _NAME, _PRE, _POST, _NDIM, _TAIL, _HASH]
    if kind == _ALLREDUCE or kind == _BROADCAST:
        keys += list(range(_DIMS, _DIMS + _NDIMS_KEPT))
    elif kind == _ALLGATHER:  # the first dim may differ
        keys += list(range(_DIMS + 1, _DIMS + _NDIMS_KEPT))
    elif kind in (_ALLGATHER_OBJECT, _BROADCAST_OBJECT, _BROADCAST_PARAMETERS, _BROADCAST_OPTIMIZER_STATE):
        keys = [_MAGIC, _KIND, _ARG, _NAME]  # what the objects hold is checked by the call itself
    else:
        keys = [_MAGIC, _KIND]
    return all(a[k] == b[k] for k in keys)


def _judge(sigs: List[List[int]]) -> _Agreement:
    n = len(sigs)
    bad_magic = [r for r, s in enumerate(sigs) if s[_MAGIC] != _MAGIC_VALUE]
    if bad_magic:  # not our signature at all: the ranks' collectives are out of step
        return _Agreement(sigs, list(range(n)), [],
                          f"ranks {bad_magic} are not in the same collective (their calls are out of "
                          "step: every rank must call the same collectives in the same order)")
    joined = [r for r, s in enumerate(sigs) if s[_KIND] == _JOIN]
    active = [r for r in range(n) if r not in joined]
    agreement = _Agreement(sigs, active, joined)
    if not active:
        return agreement
    refused = [r for r in active if sigs[r][_ERR]]
    if refused:
        agreement.error = (f"rank(s) {refused} refused the arguments of their "
                           f"{_KIND_NAMES.get(sigs[refused[0]][_KIND], '?')} call (see their error)")
        return agreement
    ref = sigs[active[0]]
    for r in active[1:]:
        if not _same(ref[_KIND], ref, sigs[r]):
            agreement.error = (f"ranks called different collectives: rank {active[0]}: "
                               f"{_describe(ref)}; rank {r}: {_describe(sigs[r])}")
            return agreement
    kind = ref[_KIND]
    if kind in _ROOTED_KINDS and not 0 <= ref[_ARG] < n:
        agreement.error = f"root_rank={ref[_ARG]} is outside the group of {n} ranks"
    elif joined and kind not in (_ALLREDUCE, _BARRIER):
        agreement.error = (f"rank(s) {joined} already called join(): while a rank is joined only "
                           "allreduce (and barrier) can run, as in Horovod")
    return agreement


def _exchange(call: _Call, group) -> _Agreement:
    """One all_gather of every rank's signature, then the shared verdict."""
    dev = _comm_device()
    mine = torch.tensor(call.encode(), dtype=torch.int64, device=dev)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return _judge(torch.stack(parts).tolist())


def _negotiate(call: _Call, group) -> _Agreement:
    """Exchange signatures; raise on every active rank unless all agree."""
    agreement = _exchange(call, group)
    if call.error is not None:
        raise ConfigError(call.error)
    if agreement.error is not None:
        what = _KIND_NAMES.get(call.kind, "collective")
        raise CollectiveMismatchError(
            f"{what}{f' {call.name!r}' if call.name is not None else ''}: {agreement.error}. "
            "Collectives are matched by call order (not by name, as in Horovod): every rank must call "
            "the same collectives in the same order, with the same name, dtype, device and shape "
            "(allgather: all but the first dim), the same op/scale factors (allreduce) and the same "
            "root_rank (broadcasts).")
    return agreement


def check_call(kind: int, group, name: Optional[str] = None, root_rank: int = 0,
               error: Optional[str] = None) -> None:
    """The signature round for a collective that is not a tensor collective (object collectives,
    DistributedOptimizer's build check): every rank raises unless all called the same thing.

    ``error`` is this rank's refusal of its own arguments: it raises it as a ``ConfigError`` and
    its peers a ``CollectiveMismatchError`` naming it, instead of waiting for it in the next step.
    """
    if _group_size(group) == 1:
        if error is not None:
            raise ConfigError(error)
        return
    if error is None and kind in _ROOTED_KINDS and (isinstance(root_rank, bool) or not isinstance(root_rank, int)):
        error = f"root_rank must be an int, got {root_rank!r}"
    if error is not None:
        root_rank = 0
    _negotiate(_Call(kind, name, arg=root_rank, error=error), group)
