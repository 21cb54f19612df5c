"""torch.distributed.checkpoint (DCP) for a LocalSGDOptimizer run: every rank gets its own state back.

DCP takes a plain tensor that every rank saves under the same key for a replica and keeps one
rank's copy of it. Under local SGD much of the state is per rank (the inner optimizer's moments
always, the weights between syncs), so ``dcp.save({"optim": opt.state_dict()})`` would restore,
say, one param's ``exp_avg`` from rank 0 and its ``exp_avg_sq`` from rank 1. ``DCPState`` saves
what is per rank under a key of its own per rank; with ``replicated_weights=True`` the weights,
which every rank holds bit for bit at a sync point, go in as DCP replicas, stored once.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .errors import ConfigError
from .optimizer import LocalSGDOptimizer, unwrap_model

_REPLICATED, _PER_RANK = "replicated", "per_rank"


class DCPState:
    """A ``Stateful`` for ``dcp.save`` / ``dcp.load`` that resumes a run exactly, on every rank.

    Save and load it on every rank, with the same world size (per-rank state cannot be
    resharded) and the same ``replicated_weights``. The inner optimizer state, flodl_opt's
    counters and the outer optimizer are stored per rank; the model too, unless
    ``replicated_weights=True``: then its float tensors are stored once, and saving is allowed
    only at a sync point (``opt.steps_since_sync == 0``), where every rank holds the same ones.
    RNG state is the caller's, as with plain DCP.

    Example (every rank)::

        import torch.distributed.checkpoint as dcp
        import flodl_opt as flo
        state = {"train": flo.DCPState(model, opt)}
        dcp.save(state, checkpoint_id="ckpt/step_1000")
        ...  # later, in a new run with the same model, optimizer and world size:
        dcp.load(state, checkpoint_id="ckpt/step_1000")
    """

    def __init__(self, model: nn.Module, optimizer: LocalSGDOptimizer, replicated_weights: bool = False):
        if not isinstance(optimizer, LocalSGDOptimizer):
            raise ConfigError(f"DCPState saves a LocalSGDOptimizer run, got {type(optimizer).__name__}; "
                              "wrap it first: flo.LocalSGDOptimizer(opt, model=model)")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"DCPState needs the model (an nn.Module), got {type(model).__name__}")
        if replicated_weights and getattr(optimizer.outer, "name", "") == "easgd":
            raise ConfigError("DCPState: EASGD ranks keep weights of their own after a sync: drop "
                              "replicated_weights=True")
        self.model, self.optimizer = model, optimizer
        self.replicated_weights = bool(replicated_weights)

    def _rank_key(self) -> str:
        return f"rank{dist.get_rank() if dist.is_initialized() else 0}"

    def state_dict(self) -> Dict[str, Any]:
        opt = self.optimizer
        if self.replicated_weights and opt.steps_since_sync != 0:
            raise ConfigError(
                f"DCPState(replicated_weights=True): saved {opt.steps_since_sync} step(s) after the "
                "last sync, when the ranks' weights differ (DCP would keep one rank's copy of each). "
                "Save right after a sync (opt.steps_since_sync == 0), call opt.sync() first, or "
                "drop replicated_weights=True to store every rank's weights.")
        model_sd = unwrap_model(self.model).state_dict()
        # At a sync point the synced (float) weights are equal on every rank: DCP replicas, once.
        replicated = {k: v for k, v in model_sd.items()
                      if self.replicated_weights and torch.is_tensor(v) and v.is_floating_point()}
        own = {k: v for k, v in model_sd.items() if k not in replicated}
        # A tuple is one opaque DCP item (saved with torch.save, never split into replicas).
        mine: Tuple[Dict[str, Any], Dict[str, Any]] = (own, opt.state_dict())
        return {_REPLICATED: replicated, _PER_RANK: {self._rank_key(): mine}}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        mine = state_dict[_PER_RANK].get(self._rank_key())
        if not isinstance(mine, tuple) or len(mine) != 2:
            raise ConfigError("flodl_opt: this DCP checkpoint holds no state for this rank; load it "
                              "with the world size it was saved with")
        own, opt_sd = mine
        model_sd = dict(state_dict[_REPLICATED])
        model_sd.update(own)
        inner = unwrap_model(self.model)
        saved = set(model_sd)
        expected = set(inner.state_dict())
        if saved != expected:
            raise ConfigError(f"flodl_opt: the DCP checkpoint was saved for a different model (keys "
                              f"missing: {sorted(expected - saved)[:4]}, unexpected: "
                              f"{sorted(saved - expected)[:4]})")
        inner.load_state_dict(model_sd)
        self.optimizer.load_state_dict(opt_sd)
