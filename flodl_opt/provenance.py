"""Whose state is this? A LocalSGDOptimizer state dict says which rank saved it, and when.

Between syncs every rank holds its own weights and inner moments, and even at a sync the inner
moments stay per rank. Frameworks that save rank 0's file and hand it to every rank (Lightning's
checkpoint, the HF Trainer's ``optimizer.pt``, Accelerate's ``save_state``) or that keep one
rank's copy of each tensor (``torch.distributed.checkpoint`` with a plain ``opt.state_dict()``)
resume every rank from state that is not its own. So ``state_dict()`` records, under
``"flodl_opt"``/``"saved_by"``: the rank and world size, the counters, whether it was saved at a
consensus point (nothing since the last sync, nothing in flight), and an exact integer digest of
its per-rank tensors and of the params it was saved with. ``load_state_dict()`` reads it:

* its tensors do not add up to the digest (a per-tensor mix of several ranks' state): refused
  (``ConfigError``; ``strict=False`` warns instead);
* saved by another rank between syncs: :class:`~flodl_opt.errors.ForeignRankStateWarning`
  (this rank resumes as a copy of that rank: its own last steps are lost);
* saved by another rank at a consensus point: :class:`~flodl_opt.errors.ForeignMomentsWarning`
  (weights and counters are every rank's; only the inner moments are that rank's);
* the params are not those it was saved with (the model was not loaded, or loaded after it):
  :class:`~flodl_opt.errors.InexactResumeWarning`.

A state dict without the record (saved before it existed) loads as before.

The module also keeps weak references to the live optimizers, to warn at ``flo.shutdown()``
and at interpreter exit on every rank that still has steps since its last sync.
"""
from __future__ import annotations

import atexit
import warnings
import weakref
import zlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .errors import (ConfigError, ForeignMomentsWarning, ForeignRankStateWarning, InexactResumeWarning,
                     UnsyncedExitWarning)

STATE_KEY = "flodl_opt"
RECORD_KEY = "saved_by"
# Entries of the flodl_opt state that are replicated (the outer anchor and momentum: every rank
# holds the same, and save_checkpoint stores one copy): not part of a rank's own digest.
_REPLICATED = ("outer", RECORD_KEY)
EXACT_WAYS = ("flo.save_checkpoint / flo.load_checkpoint, flo.DCPState with torch.distributed.checkpoint, "
              "LocalSGDCallback (HF Trainer), LocalSGDLightningCallback (Lightning) or "
              "accelerate_state(accelerator, opt) (Accelerate) from flodl_opt.integrations")

_live: "weakref.WeakSet[Any]" = weakref.WeakSet()
_world: "weakref.WeakKeyDictionary[Any, Tuple[int, int]]" = weakref.WeakKeyDictionary()  # (rank, size)
_warned_at: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # local_steps warned at
_substitute: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_via_wrapper: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------ where am I
def _group_rank_size(opt: Any) -> Tuple[int, int]:
    if opt in _world:
        return _world[opt]
    if dist.is_available() and dist.is_initialized():
        group = getattr(opt, "process_group", None)
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def at_sync(opt: Any) -> bool:
    """Nothing to sync: no step since the last sync and, with fragments, none in flight."""
    stream = getattr(opt, "_stream", None)
    if stream is None:
        return opt.steps_since_sync == 0
    return stream.pending is None and not any(stream.since)  # every fragment, not only fragment 0


def _at_consensus(opt: Any) -> bool:
    """Every rank holds these very weights (EASGD ranks keep weights of their own by design)."""
    return at_sync(opt) and getattr(opt.outer, "name", "") != "easgd"


# ------------------------------------------------------------------ digests
def _tensors(obj: Any, path: str = "") -> Iterator[Tuple[str, torch.Tensor]]:
    if torch.is_tensor(obj):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}/{i}")


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _int_sum(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers, summed in int64: exact, so independent of reduction order,
    thread count and device (a float sum is none of these)."""
    flat = t.detach().reshape(-1)
    if flat.is_complex() or flat.dtype == torch.bool:
        flat = flat.view(torch.uint8) if flat.dtype == torch.bool else torch.view_as_real(flat).reshape(-1)
    size = flat.element_size()
    ints = flat.view(_SAME_SIZE_INT[size]) if size in _SAME_SIZE_INT else flat.view(torch.int32)
    return ints.sum(dtype=torch.int64)


def digest(named: List[Tuple[str, torch.Tensor]]) -> int:
    """One integer for a set of named tensors; a tensor swapped for another rank's changes it."""
    if not named:
        return 0
    by_device: Dict[torch.device, List[int]] = {}
    sums: Dict[torch.device, List[torch.Tensor]] = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault(t.device, []).append(i)
        sums.setdefault(t.device, []).append(_int_sum(t))
    values = [0] * len(named)
    for dev, idx in by_device.items():  # one host transfer per device
        for i, v in zip(idx, torch.stack(sums[dev]).tolist()):
            values[i] = v
    total = 0
    for (name, _), v in zip(named, values):
        total = (total + (zlib.crc32(name.encode()) | 1) * v) % (1 << 64)
    return total


def _state_digest(sd: Dict[str, Any]) -> int:
    """The rank's own tensors: the inner optimizer's state and flodl_opt's per-rank entries."""
    ours = {k: v for k, v in sd.get(STATE_KEY, {}).items() if k not in _REPLICATED}
    return digest(list(_tensors(sd.get("state", {}), "state")) + list(_tensors(ours, STATE_KEY)))


def _params_digest(opt: Any) -> int:
    params = [p for g in opt.param_groups for p in g["params"]]
    return digest([(f"param/{i}", p) for i, p in enumerate(params)])


# ------------------------------------------------------------------ save and load
def stamp(opt: Any, sd: Dict[str, Any]) -> None:
    """Record in ``sd["flodl_opt"]`` who saved it and when (``LocalSGDOptimizer.state_dict``)."""
    rank, size = _group_rank_size(opt)
    stream = getattr(opt, "_stream", None)
    sd[STATE_KEY][RECORD_KEY] = {
        "rank": rank, "world": size,
        "local_steps": opt.local_steps, "global_steps": opt.global_steps, "sync_count": opt.sync_count,
        "steps_since_sync": opt.steps_since_sync,
        "in_flight": stream is not None and stream.pending is not None,
        "consensus": _at_consensus(opt),
        "state_digest": _state_digest(sd),
        "params_digest": _params_digest(opt),
    }


def substitute(opt: Any, own: Union[Dict[str, Any], Callable[[], Optional[Dict[str, Any]]], None]) -> None:
    """The next ``opt.load_state_dict(x)`` loads ``own`` (this rank's own state) instead of ``x``.

    For integrations whose framework loads rank 0's file into every rank. ``own`` may be a
    callable, asked at each load until it returns a state dict (it can find the checkpoint the
    framework is loading from); ``None`` cancels."""
    if own is None:
        _substitute.pop(opt, None)
    else:
        _substitute[opt] = own


def on_load(opt: Any, sd: Dict[str, Any], strict: bool = True) -> Dict[str, Any]:
    """Check ``sd`` before ``LocalSGDOptimizer.load_state_dict`` loads it; return what to load."""
    own = _substitute.get(opt)
    if callable(own):  # kept until cancelled: a framework may load more than once
        own = own()
    elif own is not None:
        _substitute.pop(opt, None)
    if own is not None:
        sd = own
    opt.check_state_dict(sd, strict)  # a foreign or old state dict gets the usual error first
    record = sd[STATE_KEY].get(RECORD_KEY)
    if record is not None:
        _check_record(opt, sd, record, strict)
    _via_wrapper[opt] = True  # the inner optimizer's own load comes next: no bypass warning
    return sd


def _check_record(opt: Any, sd: Dict[str, Any], record: Dict[str, Any], strict: bool) -> None:
    rank, size = _group_rank_size(opt)
    saver, steps = record["rank"], record["steps_since_sync"]
    where = (f"rank {saver} of {record['world']} at local step {record['local_steps']}, sync "
             f"#{record['sync_count']}, {steps} step(s) after it"
             + (" with a fragment in flight" if record.get("in_flight") else ""))
    if _state_digest(sd) != record["state_digest"]:
        msg = (f"flodl_opt: rank {rank} was given an optimizer state whose tensors are not those that "
               f"{where} saved: a per-tensor mix of several ranks' state (torch.distributed.checkpoint "
               "keeps one rank's copy of each tensor of a plain opt.state_dict()). No rank's run can "
               "continue from it. Save with flo.DCPState(model, opt), which keeps each rank's own "
               "(pass strict=False to load this one anyway).")
        if strict:
            raise ConfigError(msg)
        warnings.warn(msg, InexactResumeWarning, stacklevel=4)
    if _params_digest(opt) != record["params_digest"]:
        warnings.warn(
            f"flodl_opt: rank {rank} loads an optimizer state saved by {where} with other weights than "
            "the model holds now: the model was not loaded (dcp.load fills a plain model.state_dict() "
            "in place, and a wrapped model's state_dict() holds copies: call model.load_state_dict(...) "
            "or use flo.DCPState), or it is loaded after the optimizer (load the model first).",
            InexactResumeWarning, stacklevel=4)
    if saver == rank or size == 1:
        return
    if record["consensus"]:
        warnings.warn(
            f"flodl_opt: rank {rank} resumes from the optimizer state saved by {where}, a consensus "
            f"point: weights and counters are every rank's, but the inner optimizer's moments are rank "
            f"{saver}'s, not this rank's own (every rank continues with rank {saver}'s, so the run is "
            f"not the uninterrupted one). For an exact resume save each rank's own: {EXACT_WAYS}.",
            ForeignMomentsWarning, stacklevel=4)
    else:
        warnings.warn(
            f"flodl_opt: rank {rank} resumes from the optimizer state saved by {where}, between syncs, "
            f"when every rank had weights and moments of its own: this rank continues as a copy of rank "
            f"{saver} (weights, if the model came from the same file, and inner moments); the other "
            f"ranks' {steps} step(s) since the last sync are lost. Call opt.sync() on every rank before "
            f"the framework saves, or save each rank's own: {EXACT_WAYS}.",
            ForeignRankStateWarning, stacklevel=4)


# ------------------------------------------------------------------ the live optimizers
def register(opt: Any) -> None:
    """Track a built optimizer: exit warnings, DCP in-place loads, framework-wrapped inner optimizers."""
    _live.add(opt)
    _world[opt] = (_group_rank_size(opt) if getattr(opt._consensus, "distributed", False) else (0, 1))
    model = getattr(opt, "model", None)
    if model is not None:
        from .dcp import load_in_place
        load_in_place(model)
    _watch_wrapped_inner(opt)


def _watch_wrapped_inner(opt: Any) -> None:
    """The wrapped optimizer is itself a framework's wrapper (``accelerator.prepare(opt)`` before
    ``LocalSGDOptimizer``): the framework saves and loads the inner state around flodl_opt."""
    wrapped = opt.optimizer
    base = getattr(wrapped, "optimizer", None)
    if not isinstance(base, torch.optim.Optimizer):
        return
    while isinstance(getattr(base, "optimizer", None), torch.optim.Optimizer):
        base = base.optimizer
    what = f"{type(wrapped).__module__}.{type(wrapped).__name__}"
    fix = ("Wrap first, then prepare: opt = flo.LocalSGDOptimizer(torch_opt, model=model); "
           "model, opt = accelerator.prepare(model, opt)")
    warnings.warn(f"flodl_opt: LocalSGDOptimizer wraps {what}, a framework's wrapper: the framework "
                  "saves and loads the optimizer without flodl_opt's counters, outer state and scheduler "
                  f"(a resume would start at step 0). {fix}.", InexactResumeWarning, stacklevel=4)
    ref = weakref.ref(opt)

    def before_load(_optimizer: Any, state_dict: Dict[str, Any]) -> None:
        me = ref()
        if me is None or _via_wrapper.pop(me, False):
            return
        warnings.warn(f"flodl_opt: {what} loaded an optimizer state around LocalSGDOptimizer: its "
                      "counters, outer state and scheduler are not restored, so the run restarts its sync "
                      f"schedule at step 0 (with an outer optimizer, from its initial anchor). {fix}, and "
                      "save again.", InexactResumeWarning, stacklevel=3)

    base.register_load_state_dict_pre_hook(before_load)


def unsynced(opt: Any) -> Optional[str]:
    """What to tell about ``opt`` if its ranks hold weights of their own now, else None."""
    rank, size = _world.get(opt, (0, 1))
    if size <= 1 or at_sync(opt):
        return None
    return (f"flodl_opt: rank {rank}: {opt!r} has {opt.steps_since_sync} step(s) since its last sync "
            f"(sync #{opt.sync_count}), so the ranks' weights differ (each keeps its own last "
            f"{opt.steps_since_sync} step(s)). Call opt.sync() on every rank after the last step, before "
            "saving the model or exiting.")


def warn_unsynced(where: str) -> List[str]:
    """Warn once per optimizer and position for every live one with steps since its last sync."""
    told = []
    for opt in list(_live):
        try:
            msg = unsynced(opt)
        except Exception:  # noqa: BLE001 - a half-torn-down optimizer at exit: nothing to say
            continue
        if msg is None or _warned_at.get(opt) == opt.local_steps:
            continue
        _warned_at[opt] = opt.local_steps
        told.append(f"{msg} (at {where})")
        warnings.warn(told[-1], UnsyncedExitWarning, stacklevel=3)
    return told


atexit.register(warn_unsynced, "interpreter exit")
