"""Ranks that would disagree without a word: swapped layers, a param frozen on one rank only, a rank
that never called backward(), integer and complex params, a NaN/Inf float buffer. Real Gloo ranks."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import flodl_opt as flo
from dist_harness import run_ranks


def _net(seed=0, freeze=False):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    if freeze:
        net[0].weight.requires_grad_(False)
    return net


def _refusal(rank, world, kind):
    net = _net(freeze=kind == "freeze" and rank == 1)
    params = list(net.parameters())
    if kind == "swap" and rank == 1:  # two same-shaped layers handed over in another order
        params = params[2:4] + params[:2] + params[4:]
    try:
        flo.LocalSGDOptimizer(torch.optim.SGD(params, lr=0.1), model=net, sync_every=2, stall_warning_s=None)
    except flo.ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kind", ["swap", "freeze"])
def test_a_model_laid_out_differently_on_one_rank_is_refused_on_every_rank(kind):
    msgs = run_ranks(_refusal, 2, kind, timeout=60)
    for m in msgs:
        assert m is not None and "ranks wrap different models" in m and "layout" in m, m
    assert msgs[0] == msgs[1]


def _train(net, opt, rank, steps, backward=True):
    for t in range(steps):
        g = torch.Generator().manual_seed(100 * rank + t)
        opt.zero_grad()
        if backward:
            net(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
        opt.step()


def _no_backward(rank, world):
    net = _net()
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model=net, sync_every=4,
                                stall_warning_s=None)
    _train(net, opt, rank, 3, backward=rank == 0)
    mine = [p.detach().clone() for p in net.parameters()]
    _train(net, opt, rank, 1, backward=rank == 0)   # the 4th step syncs
    s = opt.last_sync
    return {"weight": s.weight, "movers": s.movers, "params": [p.detach().numpy().copy() for p in net.parameters()],
            "steps": s.steps, "mine": [m.numpy() for m in mine]}


def test_a_rank_that_never_called_backward_gets_no_vote():
    a, b = run_ranks(_no_backward, 2, timeout=60)
    assert (a["weight"], b["weight"]) == (1.0, 0.0) and a["movers"] == 1 and b["steps"] == 0
    for x, y in zip(a["params"], b["params"]):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
@pytest.mark.parametrize("lean", [False, True])
def test_integer_and_complex_params_are_refused_at_construction(dtype, lean):
    p = nn.Parameter(torch.ones(3, dtype=dtype), requires_grad=dtype.is_complex)
    opts = {"keep_presync": False, "nonfinite_guard": False} if lean else {}
    with pytest.raises(flo.ConfigError, match="real floating-point params only") as e:
        flo.LocalSGDOptimizer(torch.optim.SGD([p], lr=0.1), **opts)
    assert "register_buffer" in str(e.value) and "view_as_real" in str(e.value)


def _bad_buffer(rank, world, streaming):
    net = _net()
    kw = {"fragments": 2, "overlap_steps": 1, "sync_every": 4} if streaming else {"sync_every": 4}
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), model=net, stall_warning_s=None, **kw)
    _train(net, opt, rank, 1)
    if rank == 1:
        with torch.no_grad():
            net[3].running_var[0] = float("inf")   # finite params, a non-finite float buffer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(net, opt, rank, 7)
        opt.sync()
    flat = np.concatenate([t.detach().reshape(-1).numpy() for t in list(net.parameters()) + list(net.buffers())
                           if t.is_floating_point()])
    return {"flat": flat, "warned": any(issubclass(w.category, flo.NonFiniteWarning) for w in caught)}


@pytest.mark.parametrize("streaming", [False, True])
def test_a_nonfinite_float_buffer_gets_no_vote_and_never_reaches_a_peer(streaming):
    a, b = run_ranks(_bad_buffer, 2, streaming, timeout=90)
    assert np.isfinite(a["flat"]).all() and np.array_equal(a["flat"], b["flat"])
    assert b["warned"] and not a["warned"]
