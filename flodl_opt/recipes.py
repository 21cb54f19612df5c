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

# For a link of 100 Mbit/s or slower between ranks: DiLoCo every 32 steps, a quarter of the model at
# a time, in flight while 2 more inner steps run, each fragment's pseudo-gradient sent in int8 (about
# 1/4 of the bytes), after 8 warm-up steps that sync every step. Why: on tools/bench_wan.py (2 ranks,
# 100 and 25 Mbit/s) H=32 reaches DDP's loss in 608 steps where H=64 needs 704-768; the 8 warm-up
# syncs take streaming's 704 steps at H=32 down to 608; overlap and int8 keep the link off the step's
# path (BENCHMARKS.md#race-against-the-peers).
SLOW_LINK: Mapping[str, Any] = MappingProxyType(
    {"sync_every": 32, "outer": "diloco", "fragments": 4, "overlap_steps": 2, "warmup_steps": 8,
     "wire": "int8"})


def as_call(setting: Mapping[str, Any]) -> str:
    """``setting`` as the keyword arguments of a call, the way the README writes them:
    ``sync_every=64, outer="diloco", ...`` (strings in double quotes, in the setting's order)."""
    return ", ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v!r}" for k, v in setting.items())
