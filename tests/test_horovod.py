"""The Horovod-shaped API on real Gloo ranks, against float64 references written here.

* DistributedOptimizer == single-process SGD on the concatenated batch (also with
  backward_passes_per_step=2), one collective per gradient dtype per step;
* synchronize()/skip_synchronize() for clipping; fp16 compression; bad input on every rank;
* join() for uneven data, for DistributedOptimizer and LocalSGDOptimizer (3x fewer batches on one
  rank), each against a float64 simulation of the weighting;
* broadcast_parameters / broadcast_optimizer_state / broadcast_object / allreduce leave every rank
  equal to root (Adam state intact, a rank with empty state included).
"""
import copy
import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import flodl_opt as flo
from dist_harness import run_ranks

D_IN, D_OUT, LR = 5, 3, 0.1


def _net(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, 4), nn.Tanh(), nn.Linear(4, D_OUT)).to(dtype)


def _batches(n, rows, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, D_IN, generator=g, dtype=torch.float64),
             torch.randn(rows, D_OUT, generator=g, dtype=torch.float64)) for _ in range(n)]


def _loss(model, x, y):
    return (model(x) - y).pow(2).mean()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _to_np(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return type(obj)((k, _to_np(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_np(v) for v in obj)
    return obj


def _to_torch(obj):
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _to_torch(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_torch(v) for v in obj)
    return obj


def portable(fn):
    """Rank results travel as numpy arrays (plain pickles, no shared-memory handoff between
    processes); the test side gets tensors back from ``_run``."""
    @functools.wraps(fn)
    def wrapper(*args):
        return _to_np(fn(*args))
    return wrapper


def _run(fn, world, *args, **kw):
    return _to_torch(run_ranks(fn, world, *args, **kw))


class _CountAllReduce:
    """Counts torch.distributed.all_reduce calls (test-side patch)."""

    def __init__(self):
        self.calls = 0
        self._orig = dist.all_reduce

    def __enter__(self):
        def counted(*a, **k):
            self.calls += 1
            return self._orig(*a, **k)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


# ---------------------------------------------------------------- DistributedOptimizer vs concat batch
@portable
def rank_matches_concat_batch(rank, world, configs, steps, rows):
    out = []
    for passes, momentum in configs:
        model = _net()
        opt = flo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum),
                                       named_parameters=model.named_parameters(),
                                       backward_passes_per_step=passes)
        reduces = []
        for x, y in _batches(steps, rows * world, seed=7):
            opt.zero_grad()
            micro = rows // passes
            for k in range(passes):
                part = slice(rank * rows + k * micro, rank * rows + (k + 1) * micro)
                (_loss(model, x[part], y[part]) / passes).backward()
            with _CountAllReduce() as c:
                opt.step()
            reduces.append(c.calls)
        out.append((_flat(model), reduces))
    return out


def test_distributed_optimizer_equals_single_process_on_the_concatenated_batch():
    steps, rows, world = 4, 4, 2
    configs = [(1, 0.0), (2, 0.9)]  # (backward_passes_per_step, momentum)
    out = _run(rank_matches_concat_batch, world, configs, steps, rows)
    for c, (passes, momentum) in enumerate(configs):
        # float64 reference: one process, the whole batch, plain SGD
        ref = _net()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=momentum)
        for x, y in _batches(steps, rows * world, seed=7):
            ref_opt.zero_grad()
            _loss(ref, x, y).backward()
            ref_opt.step()
        for r in range(world):
            params, reduces = out[r][c]
            err = (params - _flat(ref)).abs().max()
            assert torch.allclose(params, _flat(ref), rtol=0, atol=1e-13), (passes, r, err)
            assert reduces == [1] * steps  # one fused collective per step (a single dtype here)
        assert torch.equal(out[0][c][0], out[1][c][0])
        # the reference moved: a no-op optimizer could not pass
        assert not torch.allclose(_flat(ref), _flat(_net()), atol=1e-3)


# ---------------------------------------------------------------- mixed dtypes, clipping, compression
class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(D_IN, D_OUT).double()
        self.b = nn.Parameter(torch.randn(D_OUT, dtype=torch.float32))

    def forward(self, x):
        return self.a(x) * self.b.double()


@portable
def rank_mixed_clip_compress(rank, world):
    out = {}
    # two dtypes -> two collectives per step; synchronize()+skip_synchronize() adds none
    model = _Mixed()
    opt = flo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    x, y = _batches(1, 6, seed=3 + rank)[0]
    opt.zero_grad()
    _loss(model, x, y).backward()
    local = [p.grad.clone() for p in model.parameters()]
    with _CountAllReduce() as c:
        opt.synchronize()
        synced = [p.grad.clone() for p in model.parameters()]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        clipped = [p.grad.clone() for p in model.parameters()]
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.synchronize()
        opt.step()  # already synchronized: no second reduction
    out["calls"] = c.calls
    out["local"], out["synced"], out["clipped"] = local, synced, clipped
    out["params"] = [p.detach().clone() for p in model.parameters()]
    # AMP as in Horovod: synchronize, unscale_, then the scaler's step without a second reduce
    amp = _net(torch.float32)
    aopt = flo.DistributedOptimizer(torch.optim.SGD(amp.parameters(), lr=LR))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    xa, ya = _batches(1, 6, seed=50 + rank)[0]
    aopt.zero_grad()
    scaler.scale(_loss(amp, xa.float(), ya.float())).backward()
    out["amp_local"] = [p.grad.clone() / 1024.0 for p in amp.parameters()]
    with _CountAllReduce() as c:
        aopt.synchronize()
        scaler.unscale_(aopt)
        out["amp_unscaled"] = [p.grad.clone() for p in amp.parameters()]
        with aopt.skip_synchronize():
            scaler.step(aopt)
        scaler.update()
    out["amp_calls"] = c.calls
    out["amp_params"] = [p.detach().clone() for p in amp.parameters()]
    # fp16 on the wire: close to the exact average, not equal
    model16 = _net(torch.float32)
    opt16 = flo.DistributedOptimizer(torch.optim.SGD(model16.parameters(), lr=LR),
                                     compression=flo.Compression.fp16)
    xb, yb = _batches(1, 6, seed=30 + rank)[0]
    opt16.zero_grad()
    _loss(model16, xb.float(), yb.float()).backward()
    out["local16"] = [p.grad.clone() for p in model16.parameters()]
    opt16.synchronize()
    out["synced16"] = [p.grad.clone() for p in model16.parameters()]
    out["wire16"] = [b.wire.dtype for b in opt16._average.buffers]
    return out


def test_mixed_dtypes_synchronize_clip_and_fp16_compression():
    out = _run(rank_mixed_clip_compress, 2)
    for o in out:
        assert o["calls"] == 4  # 2 steps x 2 dtypes, nothing per parameter, no double reduce
        for i, s in enumerate(o["synced"]):
            avg = (out[0]["local"][i].double() + out[1]["local"][i].double()) / 2
            assert torch.allclose(s.double(), avg, rtol=1e-6, atol=1e-7)
            assert s.dtype == out[0]["local"][i].dtype
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in o["synced"]))
        assert norm > 0.05  # the clip really clipped
        for s, c in zip(o["synced"], o["clipped"]):
            assert torch.allclose(c.double(), s.double() * (0.05 / norm), rtol=1e-5)
        assert o["wire16"] == [torch.float16]
        for i, s in enumerate(o["synced16"]):
            avg = (out[0]["local16"][i] + out[1]["local16"][i]) / 2
            assert torch.allclose(s, avg, rtol=2e-3, atol=1e-4)
    for a, b in zip(out[0]["params"], out[1]["params"]):
        assert torch.equal(a, b)
    for o in out:
        assert o["amp_calls"] == 1
        for i, g in enumerate(o["amp_unscaled"]):
            avg = (out[0]["amp_local"][i] + out[1]["amp_local"][i]) / 2
            assert torch.allclose(g, avg, rtol=1e-5, atol=1e-7)
    for a, b, init in zip(out[0]["amp_params"], out[1]["amp_params"], _net(torch.float32).parameters()):
        assert torch.equal(a, b) and not torch.equal(a, init.detach())  # stepped, identically


# ---------------------------------------------------------------- bad input fails on every rank
@portable
def rank_bad_input(rank, world):
    errors = {}
    try:  # different models
        flo.DistributedOptimizer(torch.optim.SGD(nn.Linear(D_IN, D_OUT + rank).double().parameters(), lr=LR))
    except flo.ConfigError as e:
        errors["models"] = str(e)
    try:  # rank 1 accumulates 2 passes with backward_passes_per_step=1
        model = _net()
        opt = flo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
        x, y = _batches(1, 4, seed=rank)[0]
        for _ in range(1 + rank):
            _loss(model, x, y).backward()
        opt.step()
    except flo.ConfigError as e:
        errors["passes"] = str(e)
    try:  # different tensors to broadcast
        flo.broadcast_parameters(nn.Linear(D_IN, 2 + rank).state_dict(), root_rank=0)
    except flo.ConfigError as e:
        errors["broadcast"] = str(e)
    try:  # different optimizer layouts
        params = [nn.Parameter(torch.zeros(2)) for _ in range(2 + rank)]
        flo.broadcast_optimizer_state(torch.optim.SGD(params, lr=LR), root_rank=0)
    except flo.ConfigError as e:
        errors["optimizer"] = str(e)
    # the group still works after every refusal
    errors["after"] = flo.allreduce(torch.tensor([1.0]), op=flo.Sum).item()
    return errors


def test_bad_input_raises_on_every_rank_and_leaves_the_group_usable():
    out = _run(rank_bad_input, 2, timeout=60)
    want = {"models": "ranks wrap different models", "passes": "backward_passes_per_step=1",
            "broadcast": "ranks hold different tensors", "optimizer": "different param groups"}
    for r, errors in enumerate(out):
        for case, text in want.items():
            assert text in errors.get(case, ""), (r, case, errors)
        assert errors["after"] == 2.0
    assert "this rank: 2" in out[1]["passes"] and "on another rank" in out[0]["passes"]


def test_world_of_one_is_the_plain_optimizer():
    model, twin = _net(), _net()
    opt = flo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    ref = torch.optim.SGD(twin.parameters(), lr=LR, momentum=0.9)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is opt.optimizer.param_groups
    for x, y in _batches(3, 4, seed=1):
        for o, m in ((opt, model), (ref, twin)):
            o.zero_grad()
            _loss(m, x, y).backward()
            o.step()
    assert torch.equal(_flat(model), _flat(twin))
    assert flo.allreduce(torch.tensor([3.0])).item() == 3.0
    with pytest.raises(flo.ConfigError, match="Adasum"):
        flo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), op=flo.Adasum)


# ---------------------------------------------------------------- uneven data: join()
@portable
def rank_join_distopt(rank, world, counts):
    model = _net()
    opt = flo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5))
    with opt.join():
        for x, y in _batches(counts[rank], 4, seed=100 + rank):
            opt.zero_grad()
            _loss(model, x, y).backward()
            opt.step()
    return _flat(model)


def test_distributed_optimizer_join_averages_only_ranks_with_data():
    counts = (6, 2)
    out = _run(rank_join_distopt, 2, counts)
    # float64 reference: round k averages the gradients of the ranks that still have batch k
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.5)
    data = [_batches(c, 4, seed=100 + r) for r, c in enumerate(counts)]
    for k in range(max(counts)):
        grads = []
        for r in range(2):
            if k < counts[r]:
                ref_opt.zero_grad()
                _loss(ref, *data[r][k]).backward()
                grads.append([p.grad.clone() for p in ref.parameters()])
        for p, *gs in zip(ref.parameters(), *grads):
            p.grad = sum(gs) / len(gs)
        ref_opt.step()
    assert torch.equal(out[0], out[1])
    assert torch.allclose(out[0], _flat(ref), rtol=0, atol=1e-13), (out[0] - _flat(ref)).abs().max()


@portable
def rank_join_local_sgd(rank, world, counts, k):
    model = _net()
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model=model, sync_every=k)
    weights = []
    with opt.join():
        for x, y in _batches(counts[rank], 4, seed=200 + rank):
            opt.zero_grad()
            _loss(model, x, y).backward()
            opt.step()
            if opt.steps_since_sync == 0:
                weights.append(opt.last_sync.weight)
    return _flat(model), opt.sync_count, weights


def _simulate_local_sgd(counts, k):
    """Float64 local SGD with work-weighted syncs; a rank out of data syncs its leftover, then zeros."""
    nets = [_net() for _ in counts]
    opts = [torch.optim.SGD(n.parameters(), lr=LR) for n in nets]
    data = [_batches(c, 4, seed=200 + r) for r, c in enumerate(counts)]
    pos, joined, syncs = [0] * len(counts), [False] * len(counts), 0
    while True:
        ns = []
        for r in range(len(counts)):
            n = 0
            while not joined[r] and pos[r] < counts[r] and n < k:
                opts[r].zero_grad()
                _loss(nets[r], *data[r][pos[r]]).backward()
                opts[r].step()
                pos[r] += 1
                n += 1
            if n < k:
                joined[r] = True
            ns.append(n)
        syncs += 1
        if sum(ns) > 0:
            avg = sum(n * _flat(net) for n, net in zip(ns, nets)) / sum(ns)
            with torch.no_grad():
                for net in nets:
                    offset = 0
                    for p in net.parameters():
                        p.copy_(avg[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
        if all(joined) and all(n < k for n in ns):
            return _flat(nets[0]), syncs


def test_local_sgd_join_with_three_times_fewer_batches_matches_the_reference_weighting():
    counts, k = (12, 4), 3
    out = _run(rank_join_local_sgd, 2, counts, k, timeout=60)
    ref, _ = _simulate_local_sgd(counts, k)
    assert torch.equal(out[0][0], out[1][0])
    assert torch.allclose(out[0][0], ref, rtol=0, atol=1e-13), (out[0][0] - ref).abs().max()
    # rank 1's leftover step rode the second sync with weight 1/4 (3 steps vs 1)
    assert out[1][2][:1] == [0.5]
    assert out[0][2][:2] == [0.5, 0.75]
    assert out[0][1] == out[1][1]


# ---------------------------------------------------------------- broadcasts and allreduce
@portable
def rank_broadcasts(rank, world, root):
    torch.manual_seed(10 + rank)  # every rank starts different
    model = nn.Sequential(nn.Linear(D_IN, 4), nn.BatchNorm1d(4), nn.Linear(4, D_OUT))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    if rank == root:  # root trained a little: it has Adam state, a counted BN, another lr
        for x, y in _batches(3, 8, seed=5):
            opt.zero_grad()
            _loss(model, x.float(), y.float()).backward()
            opt.step()
        opt.param_groups[0]["lr"] = 0.0123
    before = copy.deepcopy(opt.state_dict()) if rank == root else None
    flo.broadcast_parameters(model.state_dict(), root_rank=root)
    flo.broadcast_optimizer_state(opt, root_rank=root)
    sd = opt.state_dict()
    root_untouched = None
    if rank == root:
        root_untouched = all(torch.equal(before["state"][i][k], sd["state"][i][k])
                             for i in before["state"] for k in before["state"][i])
    # one more identical step everywhere: equal state must give equal params
    x, y = _batches(1, 8, seed=99)[0]
    opt.zero_grad()
    _loss(model, x.float(), y.float()).backward()
    opt.step()
    torch.manual_seed(20 + rank)
    extra = nn.Linear(3, 2)
    flo.broadcast_parameters(extra.named_parameters(), root_rank=root)  # a generator of (name, param)
    obj = flo.broadcast_object({"epoch": 3 + rank, "tag": f"r{rank}"}, root_rank=root)
    mean = flo.allreduce(torch.tensor([float(rank + 1), 10.0]), name="m")
    total = flo.allreduce(torch.tensor([rank + 1]), op=flo.Sum)
    gathered = flo.allgather(torch.full((1 + rank, 2), float(rank)))
    objs = flo.allgather_object({"rank": rank})
    return {"extra": extra.state_dict(), "gathered": gathered, "objs": objs, "sd": sd, "model": model.state_dict(), "root_untouched": root_untouched, "obj": obj,
            "mean": mean, "total": total, "state_keys": sorted(sd["state"][0])}


def test_broadcasts_leave_every_rank_equal_to_root():
    root = 1
    out = _run(rank_broadcasts, 2, root)
    r, o = out[root], out[1 - root]
    assert r["root_untouched"] is True
    assert o["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]  # rank 0 had empty state
    assert o["sd"]["param_groups"] == r["sd"]["param_groups"]
    assert o["sd"]["param_groups"][0]["lr"] == 0.0123
    for i in r["sd"]["state"]:
        for k, v in r["sd"]["state"][i].items():
            assert torch.equal(o["sd"]["state"][i][k], v), (i, k)
            assert o["sd"]["state"][i][k].dtype == v.dtype and o["sd"]["state"][i][k].device == v.device
    assert float(r["sd"]["state"][0]["step"]) == 4.0  # 3 steps on root + 1 after: no zero-grad step
    for k, v in r["model"].items():
        assert torch.equal(o["model"][k], v), k
    assert int(r["model"]["1.num_batches_tracked"]) == 4
    assert o["obj"] == {"epoch": 3 + root, "tag": f"r{root}"}
    for k, v in r["extra"].items():
        assert torch.equal(o["extra"][k], v), k
    for x in out:
        assert torch.equal(x["mean"], torch.tensor([1.5, 10.0]))
        assert torch.equal(x["total"], torch.tensor([3]))
        assert torch.equal(x["gathered"], torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))
        assert x["objs"] == [{"rank": 0}, {"rank": 1}]
