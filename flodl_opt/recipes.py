"""Settings the documentation recommends, each defined once.

The README quotes them and ``tools/bench_wan.py`` races them as its ``recommended`` row, so the
setting a user is told to use is the one that was measured (a test holds the three together).

    import flodl_opt as flo
    from flodl_opt.recipes import SLOW_LINK
    opt = flo.LocalSGDOptimizer(inner, model=model, **SLOW_LINK)
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

# For a link of 100 Mbit/s or slower between ranks: DiLoCo every 64 steps, a quarter of the model at
# a time, in flight while 2 more inner steps run, each fragment's pseudo-gradient sent in int8 (about
# 1/4 of the bytes). Why: on tools/bench_wan.py (2 ranks, 100 and 25 Mbit/s) streaming DiLoCo was the
# fastest mode to DDP's loss, and the int8 wire takes 3/4 of its bytes off the link (BENCHMARKS.md).
SLOW_LINK: Mapping[str, Any] = MappingProxyType(
    {"sync_every": 64, "outer": "diloco", "fragments": 4, "overlap_steps": 2, "wire": "int8"})


def as_call(setting: Mapping[str, Any]) -> str:
    """``setting`` as the keyword arguments of a call, the way the README writes them:
    ``sync_every=64, outer="diloco", ...`` (strings in double quotes, in the setting's order)."""
    return ", ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v!r}" for k, v in setting.items())
