"""Codecs: how a float32 vector travels in fewer bytes, and the registry every compressed path reads.

A codec encodes rows of ``c`` float32 elements into rows of ``section_bytes(c)`` bytes and back.
The compressed reduce (flodl_opt/transport/wire.py) uses one for the params of a blocking sync, of a
streaming fragment, and for the shared moments (``sync_moments_wire``), so a new codec is one class
with ``@register_codec`` and then works for all three.

``holds_second_moment``: whether the codec keeps every element's own exponent. Adam's second moment
spans many orders of magnitude within a block; a codec with one scale per section or block (fp16's,
int8's) flushes the small entries to zero, and ``1/sqrt(v)`` then blows up: such a codec is refused
for ``sync_moments_wire``.

Formats (``c`` elements per section):

* ``bf16``: round to nearest; ``|err| <= 2**-8 |x|`` per encode.
* ``fp16``: one power-of-two scale per section (sent along, 4 bytes) maps the section's absmax
  just under ``2**15``: no overflow whatever the magnitudes, and small differences are not lost to
  subnormals. Scaling by a power of two is exact, so ``|err| <= 2**-11 |x| + 2**-25 * scale``.
* ``int8``: blocks of ``wire_block`` elements, each with a float32 scale ``absmax/127``;
  ``q = round(x * (1/scale))``; ``|err| <= scale/2`` per element per encode (plus float32
  rounding); a block with ``absmax < 1.5e-36`` (float32's normal range times 127) is sent as zeros.

Example (a codec of one's own)::

    @register_codec
    class Half(Codec):
        name = "half"
        def section_bytes(self, c): return 2 * c
        def encode(self, x, out): out.view(torch.float16).copy_(x)
        def decode(self, inp, out): out.copy_(inp.view(torch.float16))
"""
from __future__ import annotations

from typing import Dict, Tuple, Type

import torch

from ..errors import ConfigError

DEFAULT_WIRE_BLOCK = 256
_BF16_U = 2.0 ** -8   # unit roundoff of bfloat16 (8 significant bits)
_FP16_U = 2.0 ** -11  # unit roundoff of float16 (11 significant bits)
_ALIGN = 64           # section length multiple for bf16/fp16 (even, so fp16's scale sits aligned)

CODECS: Dict[str, Type["Codec"]] = {}


def register_codec(cls: Type["Codec"]) -> Type["Codec"]:
    """Make ``cls`` available as ``wire=cls.name`` (and ``sync_moments_wire`` if it holds v)."""
    CODECS[cls.name] = cls
    return cls


def make_codec(name: str, block: int = DEFAULT_WIRE_BLOCK) -> "Codec":
    cls = CODECS.get(name)
    if cls is None:
        raise ConfigError(f"flodl_opt: unknown codec {name!r}; registered: {sorted(CODECS)}")
    return cls(block)


def wires() -> Tuple[str, ...]:
    return ("fp32",) + tuple(CODECS)


def moment_wires() -> Tuple[str, ...]:
    return ("fp32",) + tuple(n for n, c in CODECS.items() if c.holds_second_moment)


class Codec:
    """Encodes rows of ``c`` float32 elements into rows of ``section_bytes(c)`` bytes and back."""

    name = "?"
    holds_second_moment = False

    def __init__(self, block: int):
        self.block = block

    def section_len(self, numel: int, world: int) -> int:
        """Elements per owner section: ``world`` sections cover ``numel`` (zero padded)."""
        m = self.multiple()
        return max(m, -(-numel // (world * m)) * m)

    def multiple(self) -> int:
        return _ALIGN

    def section_bytes(self, c: int) -> int:
        raise NotImplementedError

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``x``: (k, c) float32; ``out``: (k, section_bytes) uint8."""
        raise NotImplementedError

    def decode(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        """``inp``: (k, section_bytes) uint8; ``out``: (k, c) float32."""
        raise NotImplementedError


@register_codec
class _BF16(Codec):
    name = "bf16"
    holds_second_moment = True  # 8 exponent bits per element, as float32

    def section_bytes(self, c: int) -> int:
        return 2 * c

    def encode(self, x, out) -> None:
        out.view(torch.bfloat16).copy_(x)  # round to nearest even

    def decode(self, inp, out) -> None:
        out.copy_(inp.view(torch.bfloat16))


def _absmax(xb: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dim. amax and amin apart: on CPU aminmax and abs().amax() over
    short rows run 5-20x slower than these two vectorized reductions."""
    return torch.maximum(xb.amax(-1), xb.amin(-1).neg_())


@register_codec
class _FP16(Codec):
    """float16 data, then one float32 power-of-two scale per row."""

    name = "fp16"

    def section_bytes(self, c: int) -> int:
        return 2 * c + 4

    def encode(self, x, out) -> None:
        k, c = x.shape
        absmax = _absmax(_absmax(x.view(k, c // _ALIGN, _ALIGN)))
        # absmax < 2**e exactly (frexp mantissa in [0.5, 1)), so |x| / 2**(e-15) < 2**15 < 65504.
        _, e = torch.frexp(absmax)
        e = torch.where(absmax > 0, e, torch.full_like(e, 15))  # all zeros: scale 1
        one = torch.ones_like(absmax)
        out[:, 2 * c:].view(torch.float32).copy_(torch.ldexp(one, e - 15).unsqueeze(1))
        # A power of two and its inverse are exact: the only rounding is the one to float16.
        torch.mul(x, torch.ldexp(one, 15 - e).unsqueeze(1), out=out[:, :2 * c].view(torch.float16))

    def decode(self, inp, out) -> None:
        c = out.shape[1]
        out.copy_(inp[:, :2 * c].view(torch.float16)).mul_(inp[:, 2 * c:].view(torch.float32))


@register_codec
class _Int8(Codec):
    """int8 data, then one float32 scale (absmax / 127) per block of ``block`` elements."""

    name = "int8"

    def multiple(self) -> int:
        return self.block

    def section_bytes(self, c: int) -> int:
        return c + 4 * (c // self.block)

    def encode(self, x, out) -> None:
        k, c = x.shape
        nb, b = c // self.block, self.block
        xb = x.view(k, nb, b)
        scale = _absmax(xb).div_(127.0)
        out[:, c:].view(torch.float32).copy_(scale)
        # Multiply by the reciprocal (a broadcast division is several times slower on CPU). Blocks
        # whose scale is below float32's normal range (absmax < 1.5e-36) or zero are sent as zeros.
        inv = torch.where(scale >= torch.finfo(torch.float32).tiny, 1.0 / scale, torch.zeros_like(scale))
        q = torch.mul(xb, inv.unsqueeze(2)).round_().clamp_(-127, 127)
        out[:, :c].view(torch.int8).view(k, nb, b).copy_(q)

    def decode(self, inp, out) -> None:
        k, c = out.shape
        nb, b = c // self.block, self.block
        ob = out.view(k, nb, b)
        ob.copy_(inp[:, :c].view(torch.int8).view(k, nb, b)).mul_(inp[:, c:].view(torch.float32).unsqueeze(2))


WIRES = wires()
