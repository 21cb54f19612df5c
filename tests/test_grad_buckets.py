"""DistributedOptimizer's buckets reduced during backward, on real Gloo ranks.

* several buckets (tiny ``bucket_bytes``) == single-process SGD on the concatenated batch (float64
  reference), with collectives really started inside backward, for 2 and 3 ranks, also with
  backward_passes_per_step=2 (nothing starts before the last pass);
* overlap on vs off (everything reduced in synchronize()): bit-identical on 2 ranks;
* an unused parameter and ranks whose graphs skip different layers: no deadlock, zeros from the
  rank that skipped, against a float64 reference;
* fp16 compression across buckets; gradients discarded by zero_grad() mid-round; bad bucket_bytes.
"""
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flodl_opt as flo
from dist_harness import run_ranks

D_IN, H, D_OUT, LR = 5, 8, 3, 0.1
TINY = 256  # bytes: every float64 parameter gets a bucket of its own


class _Net(nn.Module):
    """Four layers; ``skip`` names hidden layers this rank's graph leaves out; ``spare`` is never used."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.l3 = nn.Linear(D_IN, H), nn.Linear(H, H), nn.Linear(H, H)
        self.spare = nn.Linear(H, H)
        self.head = nn.Linear(H, D_OUT)
        self.to(dtype)

    def forward(self, x, skip=()):
        x = torch.tanh(self.l1(x))
        for name in ("l2", "l3"):
            if name not in skip:
                x = torch.tanh(getattr(self, name)(x))
        return self.head(x)


def _batches(n, rows, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, D_IN, generator=g, dtype=dtype),
             torch.randn(rows, D_OUT, generator=g, dtype=dtype)) for _ in range(n)]


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class _Counting:
    """Counts torch.distributed.all_reduce calls, and how many happened inside backward()."""

    def __init__(self):
        self.calls = self.in_backward = 0
        self.backward = False
        self._orig = dist.all_reduce

    def __enter__(self):
        def counted(*a, **k):
            self.calls += 1
            self.in_backward += int(self.backward)
            return self._orig(*a, **k)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


def _train(rank, world, steps, rows, passes=1, momentum=0.9, skips=None, **kw):
    """Each rank trains on its slice of the concatenated batch; returns params and call counts."""
    model = _Net()
    opt = flo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **kw)
    counts = []
    for t, (x, y) in enumerate(_batches(steps, rows * world, seed=7)):
        skip = (skips or {}).get((rank, t), ())
        opt.zero_grad()
        micro = rows // passes
        with _Counting() as c:
            for k in range(passes):
                part = slice(rank * rows + k * micro, rank * rows + (k + 1) * micro)
                loss = (model(x[part], skip) - y[part]).pow(2).mean() / passes
                c.backward = True
                loss.backward()
                c.backward = False
                if k < passes - 1:
                    counts.append(("early", c.calls))  # nothing may start before the last pass
            opt.step()
        counts.append((c.calls, c.in_backward))
    spare = model.spare.weight.grad
    n_buckets = sum(len(b.buckets) for b in opt._average.buffers)
    return _flat(model).numpy(), counts, n_buckets, None if spare is None else spare.numpy()


def _reference(world, steps, rows, momentum=0.9, skips=None):
    """float64, one process: the average over ranks of each rank's gradient (zero where skipped)."""
    ref = _Net()
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=momentum)
    for t, (x, y) in enumerate(_batches(steps, rows * world, seed=7)):
        total = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(world):
            ref.zero_grad(set_to_none=True)
            part = slice(r * rows, (r + 1) * rows)
            (ref(x[part], (skips or {}).get((r, t), ())) - y[part]).pow(2).mean().backward()
            for acc, p in zip(total, ref.parameters()):
                if p.grad is not None:
                    acc += p.grad
        for p, acc in zip(ref.parameters(), total):
            p.grad = acc / world
        opt.step()
    return _flat(ref)


@pytest.mark.parametrize("world", [2, 3])
def test_several_buckets_started_in_backward_equal_the_concatenated_batch(world):
    steps, rows = 3, 4
    out = run_ranks(_run_cfg, world, steps, rows, {"bucket_bytes": TINY}, timeout=60)
    ref = _reference(world, steps, rows)
    for r, (params, counts, n_buckets, spare) in enumerate(out):
        assert n_buckets == 10  # one per parameter (the count slot rides the last one)
        err = (torch.from_numpy(params) - ref).abs().max()
        assert err < 1e-13, (r, err)
        for calls, in_backward in counts:
            # one collective per bucket, the head's started while backward still ran
            assert calls == n_buckets and in_backward >= 2, counts
        assert (spare == 0).all()  # unused parameter: reduced as zeros, as Horovod does
    for o in out[1:]:
        assert (o[0] == out[0][0]).all()
    assert not torch.allclose(ref, _flat(_Net()), atol=1e-3)  # training moved the reference


def _run_cfg(rank, world, steps, rows, kw, passes=1, skips=None):
    return _train(rank, world, steps, rows, passes, 0.9, skips, **kw)


def test_passes_per_step_2_starts_only_on_the_last_pass():
    steps, rows = 3, 4
    out = run_ranks(_run_cfg, 2, steps, rows, {"bucket_bytes": TINY}, 2, timeout=60)
    ref = _reference(2, steps, rows)
    for params, counts, n_buckets, _ in out:
        assert (torch.from_numpy(params) - ref).abs().max() < 1e-13
        early = [c for c in counts if c[0] == "early"]
        assert early == [("early", 0)] * steps  # the first pass only accumulated
        assert all(c == (n_buckets, c[1]) and c[1] >= 2 for c in counts if c[0] != "early"), counts


def test_overlap_is_bit_identical_to_reducing_everything_in_synchronize():
    steps, rows = 3, 4
    on = run_ranks(_run_cfg, 2, steps, rows, {"bucket_bytes": TINY}, timeout=60)
    off = run_ranks(_run_cfg, 2, steps, rows, {"overlap": False}, timeout=60)
    for a, b in zip(on, off):
        assert (a[0] == b[0]).all()
        assert b[2] == 1 and all(c == (1, 0) for c in b[1])  # one bucket, nothing during backward


# (rank, step) -> layers that rank's graph leaves out in that step; a layer skipped after a step
# that used it must contribute zeros, not its stale gradient
@pytest.mark.parametrize("world,skips", [(2, {(0, 1): ("l2",), (1, 1): ("l3",), (1, 2): ("l2",)}),
                                         (3, {(1, 0): ("l2", "l3"), (2, 2): ("l3",)})])
def test_ranks_whose_graphs_skip_different_layers_do_not_deadlock(world, skips):
    steps, rows = 4, 4
    out = run_ranks(_run_cfg, world, steps, rows, {"bucket_bytes": TINY}, 1, skips, timeout=60)
    ref = _reference(world, steps, rows, skips=skips)
    for r, (params, counts, n_buckets, _) in enumerate(out):
        assert (torch.from_numpy(params) - ref).abs().max() < 1e-13, r
        assert all(c[0] == n_buckets for c in counts)
    for o in out[1:]:
        assert (o[0] == out[0][0]).all()


def _fp16_and_discard(rank, world):
    out = {}
    model = _Net(torch.float32)
    opt = flo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   compression=flo.Compression.fp16, bucket_bytes=TINY)
    x, y = _batches(1, 6, seed=30 + rank, dtype=torch.float32)[0]
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    out["local"] = [None if p.grad is None else p.grad.clone().numpy() for p in model.parameters()]
    opt.synchronize()
    out["synced"] = [p.grad.clone().numpy() for p in model.parameters()]
    out["wire"] = sorted({str(b.wire.dtype) for b in opt._average.buffers})
    out["buckets"] = sum(len(b.buckets) for b in opt._average.buffers)
    with opt.skip_synchronize():
        opt.step()
    # gradients thrown away mid-round (buckets in flight), then a normal step
    (model(x) - y).pow(2).mean().backward()
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    out["local2"] = [p.grad.clone().numpy() for p in model.parameters() if p.grad is not None]
    opt.synchronize()
    out["synced2"] = [p.grad.clone().numpy() for p in model.parameters() if p is not model.spare.weight
                      and p is not model.spare.bias]
    return out


def test_fp16_compression_across_buckets_and_zero_grad_mid_round():
    out = run_ranks(_fp16_and_discard, 2, timeout=60)
    for o in out:
        assert o["wire"] == ["torch.float16"] and o["buckets"] == 10
        for i, s in enumerate(o["synced"]):
            a, b = out[0]["local"][i], out[1]["local"][i]
            if a is None:  # the unused layer
                assert (s == 0).all()
                continue
            avg = (torch.from_numpy(a) + torch.from_numpy(b)) / 2
            assert torch.allclose(torch.from_numpy(s), avg, rtol=2e-3, atol=1e-4)
        for s, a, b in zip(o["synced2"], out[0]["local2"], out[1]["local2"]):
            avg = (torch.from_numpy(a) + torch.from_numpy(b)) / 2
            assert torch.allclose(torch.from_numpy(s), avg, rtol=2e-3, atol=1e-4)


def test_bucket_bytes_must_be_a_positive_int():
    model = _Net()
    for bad in (0, -1, 1.5, True, "25MB"):
        with pytest.raises(flo.ConfigError, match="bucket_bytes"):
            flo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), bucket_bytes=bad)


def _join(rank, world, counts):
    model = _Net()
    opt = flo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5),
                                   bucket_bytes=TINY)
    with opt.join():
        for x, y in _batches(counts[rank], 4, seed=100 + rank):
            opt.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            opt.step()
    return _flat(model).numpy()


def test_join_with_several_buckets_averages_only_ranks_with_data():
    counts = (3, 1, 2)
    out = run_ranks(_join, 3, counts, timeout=60)
    ref = _Net()
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.5)
    data = [_batches(c, 4, seed=100 + r) for r, c in enumerate(counts)]
    for k in range(max(counts)):
        total, n = [torch.zeros_like(p) for p in ref.parameters()], 0
        for r in range(3):
            if k < counts[r]:
                ref.zero_grad(set_to_none=True)
                (ref(data[r][k][0]) - data[r][k][1]).pow(2).mean().backward()
                n += 1
                for acc, p in zip(total, ref.parameters()):
                    if p.grad is not None:
                        acc += p.grad
        for p, acc in zip(ref.parameters(), total):
            p.grad = acc / n  # rounds 2 and 3: 2 then 1 contributors, not 3
        opt.step()
    for o in out:
        assert (o == out[0]).all()
        assert (torch.from_numpy(o) - _flat(ref)).abs().max() < 1e-13
