"""Every existing sync mode is bit-identical to the commit before the options moved into SyncConfig.

One 2-rank Gloo launch trains the same short run with ``fe50f4b``'s package (extracted by
tests/dist_harness.py, imported as ``flodl_opt_base``) and with this checkout's, for each mode in
``MODES``: a small MLP with BatchNorm, AdamW under an lr scheduler, ``max_grad_norm``, a checkpoint
round trip into freshly built objects in the middle of a window, then more steps. Params, buffers,
the inner optimizer's state and lr, and the step counters must match bit for bit on every rank.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import flodl_opt as flo
from dist_harness import load_base, run_with_base

BASE_COMMIT = "fe50f4b"  # the last commit before SyncConfig / hooks / build_sync
WORLD, K = 2, 4
# Phase 1 stops two steps into a window (14 = 3 * K + 2), so the checkpoint holds a half-done window.
PHASE1, PHASE2 = 14, 18
JOIN_PHASE2 = (PHASE2, 11)  # the uneven-work mode: rank 1 runs out first and joins with zero work

# name -> keyword arguments; a callable value is built from the package under test (its own class).
MODES = {
    "default": {},
    "warmup": {"warmup_steps": 3},
    "diloco": {"outer": "diloco"},
    "slowmo": {"outer": "slowmo"},
    "easgd": {"outer": "easgd"},
    "int8_ef_diloco": {"wire": "int8", "error_feedback": True, "outer": "diloco"},
    "bf16": {"wire": "bf16"},
    "fragments_overlap_diloco": {"fragments": 2, "overlap_steps": 1, "outer": "diloco"},
    # initial=4: the period adapts before the checkpoint, so its state crosses the round trip
    "auto": {"sync_every": lambda lib: lib.AdaptiveSync(min_every=2, max_every=16, initial=4)},
    "sync_moments": {"sync_moments": True},
    "sync_moments_bf16": {"sync_moments": True, "sync_moments_wire": "bf16"},
    "denoise": {"denoise_moments": True},
    "denoise_sync": {"denoise_moments": "sync"},
    "gamma_join": {"gamma": 0.5},
    "no_presync_no_guard": {"keep_presync": False, "nonfinite_guard": False},
}
# Modes meant to give the same bits as the default (options that only drop a copy or a check).
SAME_AS_DEFAULT = {"no_presync_no_guard"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _build(lib, mode: str):
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda t: 1.0 / (1.0 + 0.05 * t))
    kw = {k: (v(lib) if callable(v) else v) for k, v in MODES[mode].items()}
    opt = lib.LocalSGDOptimizer(inner, model=model, lr_scheduler=sched, max_grad_norm=0.5,
                                stall_warning_s=None, **{"sync_every": K, **kw})
    return model, inner, opt


def _train(model: nn.Module, opt, rank: int, start: int, steps: int) -> None:
    for t in range(start + 1, start + steps + 1):
        g = torch.Generator().manual_seed(1000 * rank + t)
        x = torch.randn(8, 6, generator=g)
        opt.zero_grad()
        (model(x) - x[:, :3]).pow(2).mean().backward()
        opt.step()


def _arrays(ts) -> list:
    return [t.detach().cpu().clone().numpy() for t in ts]


def _snapshot(model: nn.Module, inner: torch.optim.Optimizer, opt) -> dict:
    state = [inner.state[p] for p in model.parameters()]
    return {"params": _arrays(model.parameters()), "buffers": _arrays(model.buffers()),
            "inner": [_arrays(st[k] for k in sorted(st)) for st in state],
            "inner_keys": [sorted(st) for st in state],
            "lr": [g["lr"] for g in inner.param_groups],
            "counters": (opt.local_steps, opt.sync_count, opt.global_steps, opt.steps_since_sync)}


def _run(lib, mode: str, rank: int) -> dict:
    """Phase 1, a state_dict round trip into fresh objects, phase 2 (under join() for gamma_join)."""
    model, inner, opt = _build(lib, mode)
    _train(model, opt, rank, 0, PHASE1)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    model, inner, opt = _build(lib, mode)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    if mode == "gamma_join":
        with opt.join():
            _train(model, opt, rank, PHASE1, JOIN_PHASE2[rank])
    else:
        _train(model, opt, rank, PHASE1, PHASE2)
    return _snapshot(model, inner, opt)


def _all_modes(rank: int, world: int, base_dir) -> dict:
    if base_dir is None:  # git lacks the commit: the fixture skips
        return {}
    base = load_base(base_dir)
    return {(lib_name, mode): _run(lib, mode, rank)
            for mode in MODES for lib_name, lib in (("base", base), ("now", flo))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results, base_dir = run_with_base(_all_modes, WORLD, tmp_path_factory.mktemp("base"), BASE_COMMIT)
    if base_dir is None:
        pytest.skip(f"git has no commit {BASE_COMMIT}: nothing to compare the sync modes with")
    return results


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))


def _same(x: dict, y: dict) -> bool:
    return (_equal(x["params"], y["params"]) and _equal(x["buffers"], y["buffers"])
            and x["inner_keys"] == y["inner_keys"] and all(_equal(a, b) for a, b in zip(x["inner"], y["inner"]))
            and x["lr"] == y["lr"] and x["counters"] == y["counters"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", list(MODES))
def test_mode_bit_identical_to_base_commit(runs, mode):
    for rank, res in enumerate(runs):
        now, base = res[("now", mode)], res[("base", mode)]
        for part in ("params", "buffers"):
            assert _equal(now[part], base[part]), f"rank {rank}, {mode}: {part} differ from {BASE_COMMIT}"
        assert now["inner_keys"] == base["inner_keys"], f"rank {rank}, {mode}: inner state keys differ"
        for i, (a, b) in enumerate(zip(now["inner"], base["inner"])):
            assert _equal(a, b), f"rank {rank}, {mode}: inner state of param {i} differs from {BASE_COMMIT}"
        assert now["lr"] == base["lr"], f"rank {rank}, {mode}: lr differs"
        assert now["counters"] == base["counters"], f"rank {rank}, {mode}: step/sync counters differ"


@pytest.mark.timeout(180)
def test_the_modes_really_train_apart(runs):
    """Guards the comparison itself: every run synced, each option changed the result (so it was
    applied, not silently dropped), and BatchNorm's running stats moved."""
    for res in runs:
        default = res[("now", "default")]
        init = _model()
        assert not np.array_equal(default["buffers"][0], init[1].running_mean.numpy())
        for mode in MODES:
            r = res[("now", mode)]
            assert r["counters"][1] > 2, f"{mode}: only {r['counters'][1]} syncs"
            if mode != "default":
                assert _same(r, default) == (mode in SAME_AS_DEFAULT), mode
