"""The DDP drop-in on real Gloo ranks: a DistributedDataParallel model trains locally between syncs.

Each step every rank also computes its *local* gradient on an undistributed twin of the model
(same weights and buffers, same batch). In warm-up DDP's gradient must be the average of both
ranks' local gradients; afterwards it must be exactly the rank's own local gradient (no
all-reduce), the params must differ across ranks between syncs and be equal after each sync,
and BatchNorm's running stats must be the rank's own (no per-forward broadcast from rank 0).
A DDP model with uneven data (3x fewer batches on one rank) finishes under ``join()``.
"""
import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flodl_opt as flo
from dist_harness import run_ranks

K, WARMUP, STEPS = 3, 2, 8


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3)).double()


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.randn(6, 5, generator=g, dtype=torch.float64) * (1 + rank),
            torch.randn(6, 3, generator=g, dtype=torch.float64))


def _loss(model, x, y):
    return (model(x) - y).pow(2).mean()


def _grads(model):
    return np.concatenate([p.grad.detach().reshape(-1).numpy() for p in model.parameters()])


def _params(model):
    return np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()])


def rank_ddp_local_sgd(rank, world, ddp_kwargs):
    net = _net()
    twin = _net()  # undistributed: the rank's own gradient and buffer update, for reference
    model = DDP(net, **ddp_kwargs)
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                sync_every=K, warmup_steps=WARMUP)
    out = {"broadcast_buffers": bool(model.broadcast_buffers), "steps": []}
    for step in range(1, STEPS + 1):
        x, y = _batch(rank, step)
        twin.load_state_dict(net.state_dict())
        twin.zero_grad()
        _loss(twin, x, y).backward()
        opt.zero_grad()
        _loss(model, x, y).backward()
        out["steps"].append({
            "local_grad": _grads(twin), "grad": _grads(net),
            "rm_twin": twin[1].running_mean.detach().numpy().copy(),
            "rm": net[1].running_mean.detach().numpy().copy(),
        })
        opt.step()
        out["steps"][-1].update(params=_params(net), synced=opt.steps_since_sync == 0)
    return out


def rank_ddp_cases(rank, world, cases):
    out = [rank_ddp_local_sgd(rank, world, kwargs) for kwargs in cases]
    # uneven data after the warm-up: the rank with 3x fewer batches joins, nobody hangs
    net = _net()
    model = DDP(net)
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                sync_every=K, warmup_steps=1)
    with opt.join():
        for step in range(1, (12 if rank == 0 else 4) + 1):
            opt.zero_grad()
            _loss(model, *_batch(rank, step)).backward()
            opt.step()
    out.append({"uneven_params": _params(net), "syncs": opt.sync_count})
    hooked = DDP(_net())
    hooked.register_comm_hook(None, _noop_hook)
    try:
        flo.LocalSGDOptimizer(torch.optim.SGD(hooked.parameters(), lr=0.1), model=hooked, sync_every=K)
    except flo.ConfigError as e:
        out.append(str(e))
    return out


def _noop_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# find_unused_parameters: the reducer is bypassed in local phases; static_graph: only the hook acts.
CASES = [{"find_unused_parameters": True}, {"static_graph": True}]


def test_ddp_model_trains_locally_between_syncs():
    runs = run_ranks(rank_ddp_cases, 2, CASES, timeout=90)
    for c in range(len(CASES)):
        _check_case([runs[0][c], runs[1][c]])
    n = len(CASES)
    np.testing.assert_array_equal(runs[0][n]["uneven_params"], runs[1][n]["uneven_params"])
    assert runs[0][n]["syncs"] == runs[1][n]["syncs"] >= 4
    for r in runs:  # a DDP model with its own comm hook is refused, on every rank
        assert len(r) == n + 2 and "already has a communication hook" in r[-1]


def _check_case(out):
    assert [o["broadcast_buffers"] for o in out] == [False, False]
    for i in range(STEPS):
        step = i + 1
        s0, s1 = out[0]["steps"][i], out[1]["steps"][i]
        assert not np.allclose(s0["local_grad"], s1["local_grad"])  # the ranks' data differ
        if step <= WARMUP:  # synchronous DDP: the average of both ranks' local gradients
            avg = (s0["local_grad"] + s1["local_grad"]) / 2
            for s in (s0, s1):
                np.testing.assert_allclose(s["grad"], avg, rtol=0, atol=1e-14)
        else:               # local: exactly this rank's own gradient, nothing reduced
            for s in (s0, s1):
                np.testing.assert_array_equal(s["grad"], s["local_grad"])
        for s in (s0, s1):  # BatchNorm updated from this rank's own stats, never rank 0's
            np.testing.assert_array_equal(s["rm"], s["rm_twin"])
        expect_sync = step <= WARMUP or (step - WARMUP) % K == 0
        assert s0["synced"] == s1["synced"] == expect_sync, step
        if expect_sync:
            np.testing.assert_array_equal(s0["params"], s1["params"])
        else:
            assert not np.allclose(s0["params"], s1["params"]), step
    # a step after the warm-up really started from different buffers on the two ranks
    assert not np.allclose(out[0]["steps"][WARMUP + 1]["rm"], out[1]["steps"][WARMUP + 1]["rm"])
