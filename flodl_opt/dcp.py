"""torch.distributed.checkpoint (DCP) for a LocalSGDOptimizer run: every rank gets its own state back.

DCP takes a plain tensor that every rank saves under the same key for a replica and keeps one
rank's copy of it. Under local SGD much of the state is per rank (the inner optimizer's moments
always, the weights between syncs), so ``dcp.save({"optim": opt.state_dict()})`` would restore,
say, one param's ``exp_avg`` from rank 0 and its ``exp_avg_sq`` from rank 1. ``DCPState`` saves
what is per rank under a key of its own per rank; with ``replicated_weights=True`` the weights,
which every rank holds bit for bit at a sync point, go in as DCP replicas, stored once.

A plain ``dcp.load({"model": model.state_dict(), ...})`` loads in place, into the tensors of the
dict it is given; a wrapped model's ``state_dict()`` hands out copies (its params are views of
one flat buffer, flodl_opt/sync/flat.py), so in place alone would restore nothing. The state dict a
wrapped model returns is therefore also a DCP ``Stateful``: ``dcp.load`` calls its
``load_state_dict`` after filling it, which loads the model (:func:`load_in_place`).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .errors import ConfigError
from .checks import unwrap_model
from .optimizer import LocalSGDOptimizer

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


class ModelStateDict(OrderedDict):
    """A wrapped model's ``state_dict()``: a plain state dict that ``dcp.load`` also loads back.

    ``torch.distributed.checkpoint`` treats a value with ``state_dict``/``load_state_dict``
    as ``Stateful``: on load it fills ``state_dict()``'s tensors in place, then calls
    ``load_state_dict`` with them, which copies them into the model. It pickles as a plain
    ``OrderedDict`` (``torch.load(weights_only=True)`` reads it without flodl_opt).
    """

    _flodl_module: Any = None  # weakref to the module it came from

    def state_dict(self) -> "OrderedDict[str, Any]":
        out = OrderedDict(self)  # the same tensors: dcp.load fills them in place
        meta = getattr(self, "_metadata", None)
        if meta is not None:
            out._metadata = meta  # type: ignore[attr-defined]
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        module = self._flodl_module() if self._flodl_module is not None else None
        if module is None:
            raise ConfigError("flodl_opt: the model this state dict came from is gone; load it with "
                              "model.load_state_dict(sd)")
        loaded = OrderedDict(state_dict)
        meta = getattr(state_dict, "_metadata", None) or getattr(self, "_metadata", None)
        if meta is not None:
            loaded._metadata = meta  # type: ignore[attr-defined]
        module.load_state_dict(loaded)

    def __reduce__(self):
        cls, args, state, listitems, dictitems = super().__reduce__()[:5]
        state = {k: v for k, v in (state or {}).items() if k != "_flodl_module"} or None
        return OrderedDict, args, state, listitems, dictitems


def _as_loading(module: nn.Module, state_dict: Any, prefix: str, local_metadata: Any) -> Any:
    if prefix or not isinstance(state_dict, OrderedDict) or isinstance(state_dict, ModelStateDict):
        return None  # a submodule's part (the top-level call returns the dict), or done already
    out = ModelStateDict(state_dict)
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        out._metadata = meta  # type: ignore[attr-defined]
    out._flodl_module = weakref.ref(module)
    return out


def load_in_place(model: nn.Module) -> None:
    """Make ``model.state_dict()`` (and its unwrapped module's) a :class:`ModelStateDict`."""
    for m in {id(m): m for m in (model, unwrap_model(model))}.values():
        if not getattr(m, "_flodl_opt_dcp_hook", False):
            m._register_state_dict_hook(_as_loading)
            m._flodl_opt_dcp_hook = True
