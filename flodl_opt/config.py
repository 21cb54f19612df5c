"""The options of ``LocalSGDOptimizer``: one frozen object, one table of rules.

``SyncConfig.build(**kwargs)`` checks every value (``_VALUES``: one check per option), then every
rule between options (``RULES``: a predicate that names a forbidden combination, and the message
that says what to change), in that order, and returns the frozen config. Nothing else in the
library decides whether two options combine.

What must agree across ranks and with a checkpoint is derived from the options' ``Agree`` marks
(``SyncConfig.agreed``), not listed by hand: a new option declares its mark where it is defined.

Example::

    cfg = SyncConfig.build(sync_every=64, outer="diloco", fragments=4, overlap_steps=2)
    cfg.streaming, cfg.compressed     # (True, False)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from .hooks.adaptive import AdaptiveSync, make_adaptive
from .transport.float32 import DEFAULT_GLOO_CHUNK_BYTES
from .errors import ConfigError
from .hooks.moments import MOMENT_WIRES, check_optimizer
from .hooks.outer import OuterAvg, OuterOptimizer, OuterSpec, make_outer
from .stall import DEFAULT_STALL_WARNING_S
from .transport.wire import DEFAULT_WIRE_BLOCK, WIRES, wire_config

_MISSING = object()


@dataclass(frozen=True)
class Agree:
    """How an option must agree. ``always``: across ranks and with any checkpoint; else across ranks
    and with a checkpoint loaded ``strict=True`` only. ``old``: its value in checkpoints that predate it."""

    always: bool = False
    old: Any = _MISSING


def _opt(default: Any, agree: Optional[Agree] = None) -> Any:
    return field(default=default, metadata={"agree": agree})


@dataclass(frozen=True)
class SyncConfig:
    """Every option of ``LocalSGDOptimizer`` but the objects it wraps (optimizer, model, scheduler,
    process group). ``LocalSGDOptimizer``'s docstring says what each one does."""

    sync_every: Union[int, AdaptiveSync] = _opt(16, Agree())
    warmup_steps: int = _opt(0, Agree())
    outer: OuterOptimizer = _opt(None, Agree(always=True))
    max_grad_norm: Optional[float] = _opt(None)
    gamma: float = _opt(1.0, Agree())
    fragments: int = _opt(1, Agree(always=True, old=1))
    overlap_steps: int = _opt(0, Agree(always=True, old=0))
    broadcast_initial: bool = _opt(True)
    keep_presync: bool = _opt(True)
    nonfinite_guard: bool = _opt(True)
    gloo_chunk_bytes: int = _opt(DEFAULT_GLOO_CHUNK_BYTES)
    stall_warning_s: Optional[float] = _opt(DEFAULT_STALL_WARNING_S)
    wire: str = _opt("fp32", Agree(always=True, old=wire_config()))
    wire_block: int = _opt(DEFAULT_WIRE_BLOCK)
    error_feedback: bool = _opt(False)
    sync_moments: bool = _opt(False, Agree(old=False))
    denoise_moments: Union[bool, str] = _opt(False, Agree(old=False))
    sync_moments_every: int = _opt(1, Agree(old=1))
    sync_moments_wire: str = _opt("fp32", Agree(old="fp32"))

    # ------------------------------------------------------------ derived
    @property
    def adaptive(self) -> Optional[AdaptiveSync]:
        return self.sync_every if isinstance(self.sync_every, AdaptiveSync) else None

    @property
    def streaming(self) -> bool:
        return self.fragments > 1 or self.overlap_steps > 0

    @property
    def compressed(self) -> bool:
        return self.wire != "fp32"

    @property
    def period(self) -> int:
        """K in effect at the start (an adaptive controller's current period)."""
        return self.adaptive.every if self.adaptive is not None else int(self.sync_every)

    @classmethod
    def agreed(cls, strict: bool = True) -> Dict[str, Any]:
        """``{option: value in older checkpoints (or _MISSING)}`` of what must agree."""
        out = {}
        for f in dataclasses.fields(cls):
            a = f.metadata.get("agree")
            if a is not None and (a.always or strict):
                out[f.name] = a.old
        return out

    # ------------------------------------------------------------ building
    @classmethod
    def build(cls, optimizer: Optional[torch.optim.Optimizer] = None, **options: Any) -> "SyncConfig":
        """Check each value, then every rule of ``RULES``; ``optimizer`` is what the moment options read."""
        unknown = set(options) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"flodl_opt: unknown option(s) {sorted(unknown)}")
        values = {f.name: options.get(f.name, f.default) for f in dataclasses.fields(cls)}
        for name, check in _VALUES:
            values[name] = check(values[name], values)
        cfg = cls(**values)
        for rule in RULES:
            if rule.broken(cfg, optimizer):
                raise ConfigError(rule.message(cfg))
        return cfg

    def record(self) -> Dict[str, Any]:
        """The options as ``state_dict()["flodl_opt"]["config"]`` records them (the checkpoint format)."""
        a = self.adaptive
        return {"sync_every": a.config() if a is not None else self.sync_every,
                "warmup_steps": self.warmup_steps, "gamma": self.gamma,
                "fragments": self.fragments, "overlap_steps": self.overlap_steps,
                "outer": self.outer.name, "outer_config": self.outer.config(),
                "max_grad_norm": self.max_grad_norm, "sync_moments": self.sync_moments,
                "denoise_moments": self.denoise_moments, "sync_moments_every": self.sync_moments_every,
                "sync_moments_wire": self.sync_moments_wire,
                "wire": wire_config(self.wire, self.wire_block, self.error_feedback)}


# ---------------------------------------------------------------- one check per value
def _int(name: str, lowest: int, what: str) -> Callable[[Any, dict], int]:
    def check(v: Any, _: dict) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lowest:
            raise ConfigError(f"{name} must be an int >= {lowest}{what}, got {v!r}")
        return v
    return check


def _flag(name: str) -> Callable[[Any, dict], bool]:
    def check(v: Any, _: dict) -> bool:
        if not isinstance(v, bool):
            raise ConfigError(f"{name} must be True or False, got {v!r}")
        return v
    return check


def _sync_every(v: Any, _: dict) -> Union[int, AdaptiveSync]:
    a = make_adaptive(v)  # raises on anything but an int >= 1, "auto" or an AdaptiveSync
    return a if a is not None else v


def _max_grad_norm(v: Any, _: dict) -> Optional[float]:
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
        raise ConfigError(f"max_grad_norm must be a number > 0 or None, got {v!r}")
    return None if v is None else float(v)


def _gamma(v: Any, _: dict) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
        raise ConfigError(f"gamma must be a number >= 0 (0 = equal weight among movers), got {v!r}")
    return float(v)


def _wire(v: Any, values: dict) -> str:
    if not isinstance(v, str) or v.lower() not in WIRES:
        raise ConfigError(f"flodl_opt: unknown wire={v!r}; use one of {list(WIRES)} "
                          "(fp32 = uncompressed, the default)")
    return v.lower()


def _wire_block(v: Any, values: dict) -> int:
    if values["wire"] != "fp32" and (isinstance(v, bool) or not isinstance(v, int) or v < 16
                                      or v % 4 or v > 1 << 20):
        raise ConfigError(f"wire_block must be an int in [16, 2**20] and a multiple of 4 (elements "
                          f"per int8 scale), got {v!r}")
    return v


def _moment_wire(v: Any, _: dict) -> str:
    if not isinstance(v, str) or v not in MOMENT_WIRES:
        raise ConfigError(f"sync_moments_wire must be {' or '.join(map(repr, MOMENT_WIRES))}, got {v!r} (fp16 and "
                          "int8 scale a whole section or block by its largest value, so they cannot "
                          "hold the second moment's range of magnitudes)")
    return v


def _denoise(v: Any, _: dict) -> Union[bool, str]:
    if not (isinstance(v, bool) or v == "sync"):
        raise ConfigError(f"denoise_moments must be False, True (at every step) or 'sync' (at every "
                          f"sync), got {v!r}")
    return v


_VALUES: List[Tuple[str, Callable[[Any, dict], Any]]] = [
    ("sync_every", _sync_every),
    ("warmup_steps", _int("warmup_steps", 0, "")),
    ("max_grad_norm", _max_grad_norm),
    ("gamma", _gamma),
    ("outer", lambda v, _: make_outer(v)),
    ("fragments", _int("fragments", 1, " (1 = sync the whole model at once)")),
    ("overlap_steps", _int("overlap_steps", 0, " (0 = blocking syncs)")),
    ("wire", _wire),
    ("error_feedback", _flag("error_feedback")),
    ("wire_block", _wire_block),
    ("sync_moments", _flag("sync_moments")),
    ("sync_moments_every", _int("sync_moments_every", 1, " (share at every N-th sync)")),
    ("sync_moments_wire", _moment_wire),
    ("denoise_moments", _denoise),
]


# ---------------------------------------------------------------- rules between options
def _schedule_broken(cfg: SyncConfig) -> bool:
    """K % P == 0 and tau < K/P (Schedule raises its own message); an adaptive K is rounded to fit."""
    from .sync.schedule import Schedule, round_period
    a = cfg.adaptive
    k = cfg.fragments * (cfg.overlap_steps + 1) if a is not None else cfg.period
    Schedule(k, cfg.fragments, cfg.overlap_steps)
    if a is not None:
        round_period(a.every, a, cfg.fragments, cfg.overlap_steps)  # raises if no period fits
    return False

@dataclass(frozen=True)
class Rule:
    """A forbidden combination: ``when(cfg, optimizer)`` is True when it is present."""

    name: str
    when: Callable[[SyncConfig, Any], bool]
    message: Callable[[SyncConfig], str]

    def broken(self, cfg: SyncConfig, optimizer: Any) -> bool:
        return bool(self.when(cfg, optimizer))


def _adam_rule(option: str, on: Callable[[SyncConfig], bool]) -> List[Rule]:
    """The moment options read Adam's ``exp_avg``/``exp_avg_sq`` and ``betas``: check_optimizer raises."""
    def when(cfg: SyncConfig, optimizer: Any) -> bool:
        if on(cfg) and optimizer is not None:
            check_optimizer(optimizer, option if option != "denoise_moments" else
                            f"denoise_moments={cfg.denoise_moments!r}")
        return False
    return [Rule(f"{option} needs Adam", when, lambda cfg: "")]


RULES: List[Rule] = [
    Rule("auto needs the readout", lambda c, _: c.adaptive is not None and not c.keep_presync,
         lambda c: "sync_every='auto' decides from the divergence readout, which needs the pre-sync "
                   "copy: drop keep_presync=False or pass an int sync_every"),
    Rule("streaming keeps a snapshot", lambda c, _: c.streaming and not c.keep_presync,
         lambda c: "fragments/overlap_steps always keep a send snapshot (2/P of the synced bytes): "
                   "drop keep_presync=False"),
    Rule("error feedback needs a narrow wire", lambda c, _: c.error_feedback and not c.compressed,
         lambda c: "flodl_opt: error_feedback=True needs a compressed wire (wire='bf16', 'fp16' or "
                   "'int8'); fp32 loses nothing to feed back"),
    Rule("a wire sends differences from a common anchor", lambda c, _: c.compressed and not c.broadcast_initial,
         lambda c: f"flodl_opt: wire={c.wire!r} sends differences from an anchor every rank must hold "
                   "bit for bit: drop broadcast_initial=False"),
    *_adam_rule("sync_moments=True", lambda c: c.sync_moments),
    Rule("sync_moments_every says how often sync_moments shares",
         lambda c, _: c.sync_moments_every != 1 and not c.sync_moments,
         lambda c: f"sync_moments_every={c.sync_moments_every} says how often sync_moments shares the "
                   "moments: pass sync_moments=True with it, or drop it"),
    Rule("sync_moments_wire says how sync_moments sends",
         lambda c, _: c.sync_moments_wire != "fp32" and not c.sync_moments,
         lambda c: f"sync_moments_wire={c.sync_moments_wire!r} says how sync_moments sends the moments: "
                   "pass sync_moments=True with it, or drop it"),
    *_adam_rule("denoise_moments", lambda c: bool(c.denoise_moments)),
    Rule("one noise correction", lambda c, _: bool(c.denoise_moments) and c.sync_moments,
         lambda c: "sync_moments=True already takes the noise excess out at every sync; with "
                   f"denoise_moments={c.denoise_moments!r} it would be taken out twice: pick one"),
    Rule("drift needs the pre-sync copy", lambda c, _: c.denoise_moments == "sync" and not c.keep_presync,
         lambda c: "denoise_moments='sync' reads the drift from the pre-sync copy: drop "
                   "keep_presync=False"),
    Rule("the fragment schedule", lambda c, _: c.streaming and _schedule_broken(c), lambda c: ""),
    Rule("moments at blocking syncs", lambda c, _: c.sync_moments and c.streaming,
         lambda c: "sync_moments=True is not supported with fragments/overlap_steps (the moments are "
                   "shared at blocking syncs only): drop one of them"),
    Rule("drift at blocking syncs", lambda c, _: c.denoise_moments == "sync" and c.streaming,
         lambda c: "denoise_moments='sync' reads the drift at blocking syncs; with fragments/"
                   "overlap_steps use denoise_moments=True (at every step) or drop one of them"),
    Rule("an outer that needs W_i - C needs the pre-sync copy",
         lambda c, _: c.outer.needs_deltas and not c.keep_presync,
         lambda c: f"outer={c.outer.name!r} needs the pre-sync copy: drop keep_presync=False"),
]
