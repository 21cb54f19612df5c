"""LocalSGDOptimizer's resume point: its state dict (checked, saved, loaded) and its read-outs.

The state dict is the inner optimizer's plus everything flodl_opt needs under ``"flodl_opt"``:
the config (what must agree is marked ``Agree`` in flodl_opt/config.py), the counters, the lr
scheduler, and one entry per hook (each hook owns its own, flodl_opt/hooks/base.py).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from . import provenance  # who saved a state dict, live optimizers (flodl_opt/provenance.py)
from .build import config_record
from .config import _MISSING, SyncConfig
from .errors import ConfigError
from .provenance import STATE_KEY
from .sync.consensus import Consensus
from .sync.flat import FlatGroup
from .sync.streaming import StreamingSync
from .transport.wire import CompressedWire

STATE_VERSION = 1


class LocalSGDState:
    """The state-dict and read-out half of :class:`~flodl_opt.optimizer.LocalSGDOptimizer`: it
    reads the counters, options and sync parts the optimizer sets up, and writes only the counters."""

    # ------------------------------------------------------------ checkpoints
    def config(self) -> Dict[str, Any]:
        """The options as checkpoints record them, and the synced tensors' layout."""
        cfg = config_record(self.options, self._param_groups_flat + self._buffer_groups_flat)
        if self._adaptive is None:
            cfg["sync_every"] = self.sync_every
        return cfg

    def _agreed(self, cfg: Dict[str, Any], strict: bool = True) -> Dict[str, Any]:
        """What must agree across ranks and with a checkpoint (SyncConfig's Agree marks), from ``cfg``."""
        return {k: (cfg[k] if old is _MISSING else cfg.get(k, old))
                for k, old in SyncConfig.agreed(strict).items()}

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's state dict plus everything flodl_opt needs, under ``"flodl_opt"``."""
        if self._stream is not None:
            self._stream.drain()  # a fragment in flight is saved reduced; it merges on schedule
        sd = self.optimizer.state_dict()
        sd[STATE_KEY] = {
            "version": STATE_VERSION,
            "config": self.config(),
            "counters": {"local_steps": self._local_steps, "steps_since_sync": self._steps_since_sync,
                         "sync_count": self._sync_count, "global_steps": self._global_steps,
                         "skipped_since_sync": self._skipped_since_sync},
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
        }
        for h in self._hooks:
            state = h.state_dict()
            if h.key is not None and state is not None:
                sd[STATE_KEY][h.key] = state
        provenance.stamp(self, sd)  # which rank saved it, when (flodl_opt/provenance.py)
        return sd

    def check_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> None:
        """Raise ``ConfigError`` if ``load_state_dict(state_dict, strict)`` would refuse it; writes nothing.

        Lets a caller (``load_checkpoint``) validate the optimizer's part before it touches the model."""
        ours = state_dict.get(STATE_KEY) if isinstance(state_dict, dict) else None
        if ours is None:
            raise ConfigError("flodl_opt: this state dict has no 'flodl_opt' entry: it was not saved by "
                              "LocalSGDOptimizer.state_dict() (torch.distributed.checkpoint's "
                              "get_state_dict/set_state_dict drop it: use flo.DCPState(model, opt)). "
                              "Load a plain optimizer checkpoint with opt.optimizer.load_state_dict(sd).")
        saved, now = ours["config"], self.config()
        if saved["flat"] != now["flat"]:
            raise ConfigError("flodl_opt: the checkpoint was saved for a different model (the synced "
                              "tensors' shapes or dtypes differ); build the same model before loading")
        was, want = self._agreed(saved, strict), self._agreed(now, strict)
        diff = {k: (was[k], want[k]) for k in want if was[k] != want[k]}
        if diff:
            raise ConfigError(f"flodl_opt: the checkpoint's config differs from this optimizer's "
                              f"(saved, now): {diff}; build it with the saved values, or pass "
                              "strict=False to resume with the new sync_every/gamma/warmup_steps")
        groups = state_dict.get("param_groups", [])
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.optimizer.param_groups]:
            raise ConfigError("flodl_opt: the checkpoint's inner optimizer has other param groups than "
                              "this one (their number or sizes differ); build the same optimizer")
        for h in self._hooks:
            if h.key is not None:
                h.check_state(ours.get(h.key))

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> None:  # type: ignore[override]
        """Restore an exact resume point. ``strict=False`` allows a changed sync_every/gamma/warmup.

        Everything is checked first (``check_state_dict``): a refused state dict changes nothing."""
        state_dict = provenance.on_load(self, state_dict, strict)  # another rank's? (provenance.py)
        self.check_state_dict(state_dict, strict)
        sd = dict(state_dict)
        ours = sd.pop(STATE_KEY)
        self.optimizer.load_state_dict(sd)
        c = ours["counters"]
        self._local_steps, self._steps_since_sync = c["local_steps"], c["steps_since_sync"]
        self._sync_count, self._global_steps = c["sync_count"], c["global_steps"]
        self._skipped_since_sync = c.get("skipped_since_sync", 0)
        if self.lr_scheduler is not None and ours["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(ours["lr_scheduler"])
        for h in self._hooks:
            if h.key is not None:
                h.load_state_dict(ours.get(h.key))
        if self._adaptive is not None:
            self.sync_every = self._adaptive.every

    # ------------------------------------------------------------ counters
    @property
    def local_steps(self) -> int:
        return self._local_steps

    @property
    def steps_since_sync(self) -> int:
        return self._steps_since_sync

    @property
    def sync_count(self) -> int:
        return self._sync_count

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken by all ranks together, as of the last sync."""
        return self._global_steps

    # ------------------------------------------------------------ the sync's parts
    @property
    def consensus(self) -> Consensus:
        """The blocking sync's consensus collective (its flat ``params`` and ``buffers`` groups)."""
        return self._consensus

    @property
    def stream(self) -> Optional[StreamingSync]:
        """The streaming sync (``fragments``/``overlap_steps``), or None for blocking syncs."""
        return self._stream

    @property
    def wire(self) -> Optional[CompressedWire]:
        """The compressed param reduce (``wire=`` other than "fp32"), or None."""
        return self._wire

    @property
    def flat_params(self) -> List[FlatGroup]:
        """The flat buffers the trainable params live in (one per device and dtype)."""
        return self._param_groups_flat

    @property
    def flat_buffers(self) -> List[FlatGroup]:
        """The flat buffers the model's float buffers live in."""
        return self._buffer_groups_flat
