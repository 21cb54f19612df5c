"""The CUDA path: NCCL PREMUL_SUM consensus, narrow dtypes reduced in float32, and stream ordering.

Skipped without a CUDA device (conftest.py). ``tools/gpu_check.py`` runs this file on a GPU.

* A world of one on NCCL makes no collectives (the consensus of one is the identity), so these tests
  build an explicit NCCL group of one and switch ``Consensus.distributed`` on: the count and the
  PREMUL_SUM reduce then really run through NCCL, with the factor a device tensor.
* NCCL refuses two ranks on one GPU, so several ranks on one GPU go through Gloo with CUDA tensors.
* The stream stress trains a 32M-parameter model with fused AdamW on a non-default stream through
  thousands of syncs and compares every forward and the final weights with a float64 replay. The
  gradients are constant within each tensor, so every weight stays ``alpha * w0 + beta`` with scalar
  ``alpha, beta`` per tensor: the replay is exact scalar arithmetic, whatever the model size. A sync
  that snapshots, scales or reduces params while AdamW kernels are still writing them loses updates
  (the final weights move off the replay) or shows a non-zero divergence at a world of one; a forward
  that runs before the outer step has landed reads the wrong sums.
  ``FLODL_GPU_BREAK=fence`` (flodl_opt's cross-stream fence off) or ``=nccl_wait`` (the reduce does
  not wait for NCCL's stream) removes a fence on purpose: ``tools/gpu_check.py`` runs the stress so
  and expects it to fail, which shows the test can fail.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flodl_opt as flo
from dist_harness import free_port, gather_object, run_ranks
from flodl_opt.sync.consensus import Consensus
from flodl_opt.sync.flat import pack

pytestmark = pytest.mark.gpu

BREAK = os.environ.get("FLODL_GPU_BREAK", "")
STRESS_NUMEL = int(os.environ.get("FLODL_GPU_STRESS_NUMEL", str(4 << 20)))  # per tensor, 8 tensors
STRESS_STEPS = int(os.environ.get("FLODL_GPU_STRESS_STEPS", "2000"))


# ------------------------------------------------------------------ NCCL world of one
@pytest.fixture
def nccl_one():
    """An explicit NCCL process group of one on cuda:0, adopted by flodl_opt.init()."""
    assert not dist.is_initialized()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    flo.init()
    assert flo.backend() == "nccl" and flo.size() == 1
    try:
        yield torch.device("cuda", 0)
    finally:
        flo.shutdown()
        dist.destroy_process_group()


def _force_collectives(cons: Consensus) -> Consensus:
    # A group of one normally skips every collective; drive the real NCCL path instead.
    cons.distributed = True
    return cons


def _mixed_tensors(dev, seed=0):
    # Odd tensor sizes, but every flat buffer a multiple of 4096 elements: NCCL 2.28's one-rank
    # PREMUL_SUM leaves a few tail elements of some other sizes unscaled (see GPU_NOTES.md; a
    # world of one never reduces in flodl_opt, so only this test meets it).
    g = torch.Generator().manual_seed(seed)
    specs = [((257, 33), torch.float32), ((3807,), torch.float32), ((1 << 20,), torch.float32),
             ((513, 7), torch.bfloat16), ((98_809,), torch.bfloat16),
             ((1001,), torch.float16), ((3095,), torch.float16),
             ((77, 5), torch.float64), ((3711,), torch.float64)]
    return [(torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype).to(dev)
            for shape, dtype in specs]


def _max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float(((out - ref).abs() / ref.abs().clamp_min(1e-30)).max())


# Bound on |out - ref| / |ref| per element: the float32 factor and the float32 product each round
# once (2 * 2^-24, with slack); narrow dtypes add their own rounding of the float32 result.
REL_TOL = {torch.float64: 1e-15, torch.float32: 2.5e-7, torch.bfloat16: 2.0 ** -8 + 3e-7,
           torch.float16: 2.0 ** -11 + 3e-7}


@pytest.mark.parametrize("factor", [0.3713, 1.0, 2.5e-3, 7.0])
def test_nccl_premul_sum_matches_float64(nccl_one, factor):
    tensors = _mixed_tensors(nccl_one, seed=int(factor * 1000))
    groups = pack(tensors, "param")
    refs = [t.detach().double() * factor for t in tensors]  # float64 reference, before the reduce
    cons = _force_collectives(Consensus(groups, [], None, 1, 0, "nccl"))
    issued = cons.reduce(groups, factor)
    torch.cuda.synchronize()
    assert issued == len(groups) == 4  # ONE collective per flat buffer (f32, bf16, f16, f64)
    bad = []
    for t, ref in zip(tensors, refs):
        # float16 results below 2^-14 are subnormal: allow half their spacing (2^-25) as well.
        slack = 2.0 ** -25 if t.dtype == torch.float16 else 0.0
        rel = ((t.double() - ref).abs() - slack).clamp_min(0) / ref.abs().clamp_min(1e-30)
        wrong = int((rel > REL_TOL[t.dtype]).sum())
        if wrong:
            unscaled = int((t.double() == (ref / factor).to(t.dtype).double()).sum())
            bad.append(f"{t.dtype} {tuple(t.shape)}: {wrong} of {t.numel()} off (max rel err "
                       f"{float(rel.max()):.3g}, {unscaled} equal to the unscaled input)")
        if not bool((t != 0).all()):
            bad.append(f"{t.dtype} {tuple(t.shape)}: zeros in the result (bf16 PREMUL_SUM bug?)")
    assert not bad, "\n".join(bad)
    # The factor is a device tensor of the reduce dtype (float32 for bf16/fp16): no host sync.
    assert {(f.device.type, f.dtype) for f in cons.transport._factors.values()} == \
        {("cuda", torch.float32), ("cuda", torch.float64)}
    for g in groups:
        if not g.wide:
            assert g.staging().dtype == torch.float32


def test_nccl_large_bf16_reduced_in_float32(nccl_one):
    """64M bf16 weights through the float32 staging buffer: the copy back must wait for NCCL."""
    n = 64 << 20
    x = (torch.rand(n, device=nccl_one, dtype=torch.float32) + 0.5).to(torch.bfloat16)
    ref = x.double() * 0.3713
    groups = pack([x], "param")
    cons = _force_collectives(Consensus(groups, [], None, 1, 0, "nccl"))
    cons.reduce(groups, 0.3713)  # staging copy -> PREMUL_SUM in float32 -> copy back, all queued
    rel = (x.double() - ref).abs() / ref
    wrong = int((rel > REL_TOL[torch.bfloat16]).sum())
    assert groups[0].staging().dtype == torch.float32
    assert wrong == 0, f"{wrong} of {n} bf16 weights off the float64 reference (max rel err {float(rel.max()):.3g})"


def test_nccl_reduce_makes_no_host_sync(nccl_one):
    tensors = _mixed_tensors(nccl_one, seed=5)
    groups = pack(tensors, "param")
    cons = _force_collectives(Consensus(groups, [], None, 1, 0, "nccl"))
    cons.reduce(groups, 0.5)  # first call allocates the factors and staging buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cons.reduce(groups, 0.25)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_nccl_zero_factor_gives_exact_zeros_from_nan(nccl_one):
    """A non-finite rank's factor is 0; 0 * NaN is NaN, so its contribution must be exact zeros."""
    tensors = _mixed_tensors(nccl_one, seed=9)
    for t in tensors:
        t.view(-1)[::7] = float("nan")
    groups = pack(tensors, "param")
    cons = _force_collectives(Consensus(groups, [], None, 1, 0, "nccl"))
    cons.reduce(groups, 0.0)
    torch.cuda.synchronize()
    for t in tensors:
        assert bool((t == 0).all()), f"{t.dtype}: non-zero or NaN left after a zero-factor reduce"


class _Net(nn.Module):
    """float32 layers with BatchNorm buffers, plus a bfloat16 and a float16 parameter."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 16))
        self.bf = nn.Parameter(torch.randn(4097).to(torch.bfloat16))
        self.hf = nn.Parameter(torch.randn(1023).to(torch.float16))

    def forward(self, x):
        return self.body(x).sum(1) * (self.bf.float().mean() + self.hf.float().mean())


def test_nccl_world_of_one_optimizer_sync_is_identity(nccl_one):
    """The whole sync through NCCL at a world of one: count + one PREMUL_SUM per buffer, identity."""
    torch.manual_seed(0)
    model = _Net().to(nccl_one)
    # SGD: AdamW's eps underflows in float16 state, which would make the fp16 param non-finite.
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9), model=model,
                                sync_every=3)
    _force_collectives(opt.consensus)
    n_buffers = len(opt.flat_params) + len(opt.flat_buffers)
    assert n_buffers == 4  # f32 params, bf16 params, f16 params, f32 BatchNorm stats
    syncs = 0
    for _ in range(12):
        opt.zero_grad()
        model(torch.randn(32, 64, device=nccl_one)).pow(2).mean().backward()
        opt.step()
        if opt.steps_since_sync == 0:
            syncs += 1
            s = opt.last_sync
            assert s.collectives == 1 + n_buffers and s.weight == 1.0 and s.divergence == 0.0
            assert s.bytes > 0
    assert syncs == 4
    # An explicit sync right after a sync: every tensor bit-identical (PREMUL_SUM by exactly 1.0).
    opt.zero_grad()
    model(torch.randn(32, 64, device=nccl_one)).pow(2).mean().backward()
    opt.step()
    snap = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]
    stats = opt.sync()
    assert stats.collectives == 1 + n_buffers and stats.divergence == 0.0
    for a, b in zip(snap, list(model.parameters()) + list(model.buffers())):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ stream-ordering stress
def _grad_table(steps: int, tensors: int, rank: int = 0):
    """g[t][k]: constant within tensor k at step t; sign flips every 64 steps (W stays bounded)."""
    table = []
    for t in range(steps):
        row = []
        for k in range(tensors):
            sign = 1.0 if ((t + 13 * k + 29 * rank) // 64) % 2 == 0 else -1.0
            row.append(sign * (0.5 + 0.125 * ((7 * t + 3 * k + rank) % 5)))  # exact in float32
        table.append(row)
    return table


class _Replay:
    """Float64 replay of one tensor: W = aw*w0 + bw, anchor A and momentum u alike, AdamW's m, v."""

    def __init__(self):
        self.aw, self.bw = 1.0, 0.0
        self.aa, self.ba = 1.0, 0.0
        self.au, self.bu = 0.0, 0.0
        self.m = self.v = 0.0

    def adamw(self, t: int, g: float, lr, betas, eps, wd):
        b1, b2 = betas
        c = 1.0 - lr * wd
        self.aw *= c
        self.bw *= c
        self.m = b1 * self.m + (1 - b1) * g
        self.v = b2 * self.v + (1 - b2) * g * g
        denom = math.sqrt(self.v) / math.sqrt(1 - b2 ** t) + eps
        self.bw -= (lr / (1 - b1 ** t)) * self.m / denom

    def diloco(self, lr, mu):
        """World of one: C = W. d = A - C; u = mu*u + d; W = C + (1-lr)*d - lr*mu*u; A = W."""
        ad, bd = self.aa - self.aw, self.ba - self.bw
        self.au, self.bu = mu * self.au + ad, mu * self.bu + bd
        self.aw += (1 - lr) * ad - lr * mu * self.au
        self.bw += (1 - lr) * bd - lr * mu * self.bu
        self.aa, self.ba = self.aw, self.bw


# Float32 against the float64 replay drifts by ~4e-5 (relative, over 2000 steps) on the final
# weights and ~1e-5 on the forward sums; one lost AdamW update moves a weight by ~lr = 1e-2, and a
# forward that runs before the outer step misses a shift of ~1e-2 in every weight. The bounds below
# sit between the two.
ADAM = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
OUTER_LR, OUTER_MU = 0.7, 0.5


def _break_nccl_wait(monkeypatch):
    """Negative control: the reduce returns without making the current stream wait for NCCL."""
    import flodl_opt.sync.consensus as consensus_mod
    import flodl_opt.transport.float32 as float32_mod
    real, pending = consensus_mod.dist, []

    class _NoWait:
        def __getattr__(self, name):
            return getattr(real, name)

        def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            pending.append(real.all_reduce(tensor, op=op, group=group, async_op=True))

    for mod in (consensus_mod, float32_mod):  # the count and the reduce
        monkeypatch.setattr(mod, "dist", _NoWait())
    return pending


@pytest.mark.parametrize("mode,outer,sync_every", [
    ("in_step", "diloco", 1),      # sync inside step(), on the training stream: NCCL's fences
    ("in_step", "avg", 1),         # fewest host syncs after the reduce: the tightest window
    ("cross_stream", "diloco", 2),  # steps on stream s, opt.sync() from the default stream
])
def test_stream_stress_matches_float64_replay(nccl_one, monkeypatch, mode, outer, sync_every):
    dev, n_tensors, steps = nccl_one, 8, STRESS_STEPS
    gen = torch.Generator(device=dev).manual_seed(1234)
    params = [nn.Parameter(torch.randn(STRESS_NUMEL, generator=gen, device=dev)) for _ in range(n_tensors)]
    w0 = [p.detach().clone() for p in params]
    s0 = [float(w.double().sum()) for w in w0]
    abs0 = [float(w.double().abs().sum()) for w in w0]
    model = nn.Module()
    model.w = nn.ParameterList(params)
    inner = torch.optim.AdamW(params, fused=True, **ADAM)
    slim = outer == "avg"  # no pre-sync copy, no non-finite probe: no host sync before the reduce
    opt = flo.LocalSGDOptimizer(
        inner, model=model, outer=flo.DiLoCo(lr=OUTER_LR, momentum=OUTER_MU, warmup=0) if outer == "diloco" else None,
        sync_every=sync_every if mode == "in_step" else 10 ** 9,
        keep_presync=not slim, nonfinite_guard=not slim)
    _force_collectives(opt.consensus)
    if BREAK == "fence":
        opt._stream_fence = False
    elif BREAK == "nccl_wait":
        _break_nccl_wait(monkeypatch)
    for p in params:
        p.grad = torch.zeros_like(p)
    table = _grad_table(steps, n_tensors)
    grads = torch.tensor(table, dtype=torch.float32, device=dev)
    fwd = torch.full((steps, n_tensors), float("nan"), dtype=torch.float64, device=dev)
    divergences = []
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    for t in range(steps):
        with torch.cuda.stream(s):
            for k, p in enumerate(params):
                p.grad.copy_(grads[t, k].expand_as(p))  # device-side: no host sync
            fwd[t].copy_(torch.stack([p.detach().sum(dtype=torch.float64) for p in params]))  # the forward
            opt.step()
            if mode == "in_step" and opt.steps_since_sync == 0:
                divergences.append(opt.last_sync.divergence)
        if mode == "cross_stream" and (t + 1) % sync_every == 0:
            divergences.append(opt.sync().divergence)  # on the default stream
    torch.cuda.synchronize(dev)

    replay = [_Replay() for _ in range(n_tensors)]
    expect_fwd, expect_abs = [], []
    for t in range(steps):
        expect_fwd.append([r.aw * s0[k] + r.bw * STRESS_NUMEL for k, r in enumerate(replay)])
        expect_abs.append([abs(r.aw) * abs0[k] + (abs(r.bw) + 1.0) * STRESS_NUMEL for k, r in enumerate(replay)])
        for k, r in enumerate(replay):
            r.adamw(t + 1, table[t][k], ADAM["lr"], ADAM["betas"], ADAM["eps"], ADAM["weight_decay"])
            if (t + 1) % sync_every == 0 and outer == "diloco":
                r.diloco(OUTER_LR, OUTER_MU)
    assert len(divergences) == steps // sync_every
    if not slim:  # world of one: the pre-sync weights ARE the consensus, bit for bit
        bad = [(i, d) for i, d in enumerate(divergences) if d != 0.0]
        assert not bad, f"{len(bad)} syncs saw a non-zero divergence (snapshot raced the optimizer): {bad[:5]}"
    # Every forward read the weights the replay says (sums over 4M weights: float32 rounding only).
    exp = torch.tensor(expect_fwd, dtype=torch.float64, device=dev)
    size = torch.tensor(expect_abs, dtype=torch.float64, device=dev)  # ~ sum |W| + n
    fwd_err = ((fwd - exp).abs() / size).amax(1)
    bad_steps = (fwd_err.isnan() | (fwd_err > 2e-4)).nonzero().flatten().tolist()
    assert not bad_steps, (f"{len(bad_steps)} forwards read wrong weights, first at steps "
                           f"{bad_steps[:8]} (rel err {float(fwd_err.max()):.3g})")
    # Final weights, element by element.
    worst = 0.0
    for k, (p, r) in enumerate(zip(params, replay)):
        ref = w0[k].double() * r.aw + r.bw
        err = float(((p.detach().double() - ref).abs() / (1.0 + ref.abs())).max())
        worst = max(worst, err)
    print(f"stress {mode}/{outer}: {steps} steps, {len(divergences)} syncs, "
          f"{n_tensors * STRESS_NUMEL / 1e6:.0f}M params, max rel err vs float64 replay {worst:.3g}, "
          f"forward max rel err {float(fwd_err.max()):.3g}")
    assert worst < 5e-4, f"final weights off the float64 replay by {worst:.3g} (lost updates?)"


# ------------------------------------------------------------------ several ranks on one GPU (Gloo)
class _RankNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
        self.bf = nn.Parameter(torch.randn(3000).to(torch.bfloat16))
        self.hf = nn.Parameter(torch.randn(1500).to(torch.float16))
        self.big = nn.Parameter(torch.randn(3 << 20))  # 12 MiB: reduced in 4 MiB chunks on Gloo


def rank_gloo_cuda_weighted(rank, world, steps, gamma):
    dev = torch.device("cuda", 0)
    model = _RankNet().to(dev)
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model,
                                sync_every=10 ** 6, gamma=gamma, gloo_chunk_bytes=4 << 20)
    assert flo.backend() == "gloo" and model.big.is_cuda
    g = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():  # rank-specific weights and BatchNorm stats, written in place
        for t in list(model.parameters()) + [model.body[1].running_mean, model.body[1].running_var]:
            t.copy_((torch.rand(t.shape, generator=g, dtype=torch.float64) + 0.5 + rank).to(t.dtype))
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):  # count the steps on a side stream; SGD with lr 0 leaves the weights
        for _ in range(steps[rank]):
            opt.step()
    pre = gather_object([t.detach().cpu().double() for t in model.parameters()] +
                        [model.body[1].running_mean.cpu().double(), model.body[1].running_var.cpu().double()])
    stats = opt.sync()
    post = [t.detach().cpu() for t in model.parameters()] + \
        [model.body[1].running_mean.cpu(), model.body[1].running_var.cpu()]
    mass = [0.0 if n == 0 else float(n) ** gamma for n in steps]
    mover = [1.0 if n > 0 else 0.0 for n in steps]
    n_params = len(list(model.parameters()))
    worst = {}
    for i, out in enumerate(post):
        w = mass if i < n_params else mover
        ref = sum(w[r] * pre[r][i] for r in range(world)) / sum(w)
        err = float(((out.double() - ref).abs() / ref.abs()).max())
        tol = {torch.float32: 1e-6, torch.bfloat16: 2.0 ** -8 + 1e-6, torch.float16: 2.0 ** -11 + 1e-6}[out.dtype]
        assert err <= tol, f"tensor {i} ({out.dtype}): max rel err {err:.3g} > {tol:.3g}"
        worst[str(out.dtype)] = max(worst.get(str(out.dtype), 0.0), err)
    everyone = gather_object(post)
    for r in range(world):
        for a, b in zip(everyone[0], everyone[r]):
            assert torch.equal(a, b), f"rank {r} differs from rank 0 after the sync"
    return {"weight": stats.weight, "collectives": stats.collectives, "worst": worst}


@pytest.mark.parametrize("world,steps,gamma", [(2, (1, 3), 1.0), (3, (2, 5, 0), 0.5)])
def test_gloo_cuda_ranks_on_one_gpu_match_float64(world, steps, gamma):
    out = run_ranks(rank_gloo_cuda_weighted, world, steps, gamma, timeout=180, collective_timeout=60)
    mass = [0.0 if n == 0 else float(n) ** gamma for n in steps]
    assert [o["weight"] for o in out] == pytest.approx([m / sum(mass) for m in mass], rel=1e-12)
    assert all(o["collectives"] > 1 + 4 for o in out)  # the count, 4 buffers, the big one in chunks


def rank_gloo_cuda_stress(rank, world, steps, sync_every, numel):
    """Each rank trains on its own side stream with fused AdamW; syncs inside step(); float64 replay."""
    dev = torch.device("cuda", 0)
    n_tensors = 4
    gen = torch.Generator(device=dev).manual_seed(77)  # same w0 on every rank
    params = [nn.Parameter(torch.randn(numel, generator=gen, device=dev)) for _ in range(n_tensors)]
    w0 = [p.detach().clone() for p in params]
    model = nn.Module()
    model.w = nn.ParameterList(params)
    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(params, fused=True, **ADAM), model=model,
                                sync_every=sync_every)
    for p in params:
        p.grad = torch.zeros_like(p)
    tables = [_grad_table(steps, n_tensors, rank=r) for r in range(world)]
    grads = torch.tensor(tables[rank], dtype=torch.float32, device=dev)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    syncs = 0
    with torch.cuda.stream(s):
        for t in range(steps):
            for k, p in enumerate(params):
                p.grad.copy_(grads[t, k].expand_as(p))
            opt.step()
            syncs += opt.steps_since_sync == 0
    torch.cuda.synchronize(dev)
    # Replay every rank; at a sync each rank adopts the equal-weight mean (equal step counts).
    replay = [[_Replay() for _ in range(n_tensors)] for _ in range(world)]
    for t in range(steps):
        for r in range(world):
            for k in range(n_tensors):
                replay[r][k].adamw(t + 1, tables[r][t][k], ADAM["lr"], ADAM["betas"], ADAM["eps"],
                                   ADAM["weight_decay"])
        if (t + 1) % sync_every == 0:
            for k in range(n_tensors):
                aw = sum(replay[r][k].aw for r in range(world)) / world
                bw = sum(replay[r][k].bw for r in range(world)) / world
                for r in range(world):
                    replay[r][k].aw, replay[r][k].bw = aw, bw
    worst = 0.0
    for k, p in enumerate(params):
        ref = w0[k].double() * replay[rank][k].aw + replay[rank][k].bw
        worst = max(worst, float(((p.detach().double() - ref).abs() / (1.0 + ref.abs())).max()))
    final = gather_object([p.detach().cpu() for p in params])
    same = all(torch.equal(a, b) for r in range(world) for a, b in zip(final[0], final[r]))
    return {"syncs": syncs, "worst": worst, "same": same}


def test_gloo_cuda_two_ranks_stream_stress():
    steps, sync_every = 300, 3
    out = run_ranks(rank_gloo_cuda_stress, 2, steps, sync_every, 1 << 20, timeout=240, collective_timeout=60)
    for o in out:
        assert o["syncs"] == steps // sync_every
        assert o["same"], "ranks differ after the last sync"
        assert o["worst"] < 5e-4, f"weights off the float64 replay by {o['worst']:.3g}"


# ------------------------------------------------------------------ two or more GPUs (NCCL)
def rank_nccl_multi_gpu(rank, world):
    """A real NCCL group, one GPU per rank: PREMUL_SUM of odd-sized buffers against float64."""
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    nccl = dist.new_group(backend="nccl")  # beside the harness's Gloo group
    g = torch.Generator().manual_seed(500 + rank)
    sizes = [(103_594, torch.float32), (100_003, torch.bfloat16), (4097, torch.float16)]  # n % 16 != 0
    tensors = [(torch.rand(n, generator=g, dtype=torch.float64) + 0.5 + rank).to(dt).to(dev) for n, dt in sizes]
    pre = gather_object([t.cpu().double() for t in tensors])
    cons = Consensus(pack(tensors, "param"), [], nccl, world, rank, "nccl", gamma=1.0)
    stats = cons.run(steps=rank + 1, sync_number=1)
    mass = [r + 1.0 for r in range(world)]
    for i, t in enumerate(tensors):
        ref = sum(mass[r] * pre[r][i] for r in range(world)) / sum(mass)
        err = float(((t.cpu().double() - ref).abs() / ref.abs()).max())
        tol = REL_TOL[t.dtype] * max(2, world)  # one float32 rounding per rank's term
        assert err <= tol, f"{t.dtype} n={t.numel()}: max rel err {err:.3g} (unscaled tail?)"
    post = gather_object([t.cpu() for t in tensors])
    assert all(torch.equal(a, b) for r in range(world) for a, b in zip(post[0], post[r]))
    return stats.weight


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two or more GPUs (NCCL refuses two ranks on one GPU)")
def test_nccl_multi_gpu_premul_odd_sizes_match_float64():
    world = torch.cuda.device_count()
    weights = run_ranks(rank_nccl_multi_gpu, world, timeout=240, collective_timeout=60)
    assert weights == pytest.approx([(r + 1) / sum(range(1, world + 1)) for r in range(world)])


# ------------------------------------------------------------------ the newer sync modes on CUDA
# wire="bf16"/"int8", streaming (fragments, overlap_steps), sync_every="auto" and
# DistributedOptimizer's gradient buckets, each on CUDA tensors: Gloo ranks sharing cuda:0 against
# float64 references, and (streaming) the NCCL path of a world of one with its collectives forced.
# FLODL_GPU_DRY_RUN=1 runs the Gloo cases below on CPU tensors: a check of the test code itself
# on a machine without CUDA (the suite's conftest still skips them there otherwise).
_DRY = os.environ.get("FLODL_GPU_DRY_RUN") == "1"


def _gdev() -> torch.device:
    return torch.device("cpu") if _DRY else torch.device("cuda", 0)


def _side_stream(dev):
    """Train on a non-default stream (ordered after what the default stream queued so far)."""
    import contextlib
    if dev.type != "cuda":
        return contextlib.nullcontext()
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    return torch.cuda.stream(s)


def _cpu64(t: torch.Tensor):
    return t.detach().double().cpu().numpy().copy()


def rank_wire_bound_cuda(rank, world, mode):
    """tests/test_wire.py's consensus-within-bound case, with the param on cuda:0."""
    import numpy as np
    import test_wire as tw
    dev = _gdev()
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(tw.N).to(dev))
    opt = flo.LocalSGDOptimizer(torch.optim.SGD([p], lr=0.1), sync_every=10 ** 9, wire=mode,
                                stall_warning_s=None)
    assert opt.wire is not None and opt.wire._groups[0].x.device == dev
    cases = {2: [(1, 3), (0, 2), (2, 2)], 3: [(1, 4, 2), (0, 3, 1), (2, 2, 2), (1, 2, 3)]}[world]
    worst = []
    for t, steps in enumerate(cases):
        anchor = _cpu64(p)
        assert all(np.array_equal(anchor, a) for a in gather_object(anchor)), "anchor differs across ranks"
        nan_rank = 1 if t == 3 else None
        with torch.no_grad():
            p.add_(tw._diff(rank, t).to(dev))
            if rank == nan_rank:
                p[5] = float("nan")
        opt._steps_since_sync = steps[rank]
        pre = gather_object(_cpu64(p))
        stats = opt.sync()
        got = _cpu64(p)
        votes = np.array([0.0 if r == nan_rank else float(n) for r, n in enumerate(steps)])
        f = votes / votes.sum()
        x = np.stack([f[r] * (pre[r] - anchor) if f[r] > 0 else np.zeros(tw.N) for r in range(world)])
        ref = anchor + x.sum(0)
        err, bound = np.abs(got - ref), tw._bound(mode, x, anchor, ref)
        assert np.all(err <= bound), (mode, t, float((err / bound).max()))
        worst.append(float((err / bound).max()))
        post = gather_object(p.detach().cpu().clone())
        assert all(torch.equal(post[0], q) for q in post), f"params differ across ranks after sync {t}"
    return worst, stats.bytes, stats.collectives


@pytest.mark.parametrize("mode,world", [("bf16", 2), ("int8", 2), ("int8", 3)])
def test_gloo_cuda_wire_consensus_within_bound_and_identical(mode, world):
    import warnings
    import test_wire as tw
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = run_ranks(rank_wire_bound_cuda, world, mode, timeout=180, collective_timeout=60)
    worst, nbytes, collectives = out[0]
    assert max(worst) > 0.05, worst   # the bound is not vacuous
    payload = {"bf16": 2 * tw.N, "int8": tw.N + 4 * tw.N // tw.BLOCK}[mode]
    assert nbytes == tw.COUNT_BYTES + payload and collectives == 3


def _mlp_cuda(dev):
    torch.manual_seed(0)
    mods = []
    for _ in range(4):
        mods += [nn.Linear(6, 6), nn.Tanh()]
    return nn.Sequential(*mods).to(dev)


def _train_cuda(model, opt, rank, steps, dev, after=None):
    """The rank's batches (seeded by rank and step) on ``dev``; ``after(t)`` follows step t."""
    for t in range(1, steps + 1):
        g = torch.Generator().manual_seed(1000 * rank + t)
        x = torch.randn(8, 6, generator=g).to(dev)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if after is not None:
            after(t)


def _params_np(model):
    return [_cpu64(p) for p in model.parameters()]


def rank_stream_merge_cuda(rank, world, sync_every, fragments, tau, steps):
    """Streaming on cuda:0, trained on a side stream; records what the float64 reference needs."""
    dev = _gdev()
    model = _mlp_cuda(dev)
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=sync_every, fragments=fragments,
                                overlap_steps=tau, outer=flo.DiLoCo(lr=0.7, momentum=0.9, nesterov=True,
                                                                    warmup=0), stall_warning_s=None)
    init, pre, post = _params_np(model), {}, {}
    step = [0]

    def hook(optimizer, args, kwargs):  # after the inner step, before the wrapper issues / merges
        step[0] += 1
        pre[step[0]] = _params_np(model)
    inner.register_step_post_hook(hook)
    with _side_stream(dev):
        _train_cuda(model, opt, rank, steps, dev, after=lambda t: post.__setitem__(t, _params_np(model)))
    opt.sync()   # from the default stream: drain + blocking sync of every fragment
    final = [p.detach().cpu() for p in model.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(gather_object(final)[0], final))
    return {"init": init, "pre": pre, "post": post, "same": same,
            "frag_tensors": [f.tensors for f in opt.stream.fragments]}


def _check_stream_reference(r0, r1, sync_every, fragments, tau, steps):
    """Delayed-update merge with per-fragment DiLoCo (lr 0.7, Nesterov 0.9), in float64."""
    import numpy as np
    frag_of = [q for q, n in enumerate(r0["frag_tensors"]) for _ in range(n)]
    n_t = len(frag_of)
    lr, mu = 0.7, 0.9
    anchor = [t.copy() for t in r0["init"]]
    assert all(np.array_equal(x, y) for x, y in zip(r0["init"], r1["init"]))
    mom = [np.zeros_like(t) for t in anchor]
    last = {q: 0 for q in range(fragments)}
    stride = sync_every // fragments
    issue, merges = {}, 0
    for t in range(1, steps + 1):
        r = t % sync_every
        p = r // stride if r % stride == 0 else None
        merged = issue.pop(t - tau, None)
        if merged is not None:
            merges += 1
            q, sent, m = merged
            for k in [k for k in range(n_t) if frag_of[k] == q]:
                c = (m[0] * sent[0][k] + m[1] * sent[1][k]) / (m[0] + m[1])
                d = anchor[k] - c
                mom[k] = mu * mom[k] + d
                anchor[k] = anchor[k] - lr * (d + mu * mom[k])
                for rr, rec in enumerate((r0, r1)):
                    want = anchor[k] + (rec["pre"][t][k] - sent[rr][k])
                    np.testing.assert_allclose(rec["post"][t][k], want, rtol=0, atol=5e-6,
                                               err_msg=f"step {t} tensor {k} rank {rr}")
        for rr, rec in enumerate((r0, r1)):
            for k in range(n_t):
                if merged is None or frag_of[k] != merged[0]:
                    assert np.array_equal(rec["post"][t][k], rec["pre"][t][k]), (t, k, rr)
        if p is not None:
            issue[t] = (p, [r0["pre"][t], r1["pre"][t]], [t - last[p], t - last[p]])
            last[p] = t
    return merges


@pytest.mark.parametrize("sync_every,fragments,tau,steps", [(4, 2, 1, 9), (16, 4, 2, 38)])
def test_gloo_cuda_streaming_merge_matches_float64(sync_every, fragments, tau, steps):
    out = run_ranks(rank_stream_merge_cuda, 2, sync_every, fragments, tau, steps, timeout=180,
                    collective_timeout=60)
    assert len(out[0]["frag_tensors"]) == fragments
    merges = _check_stream_reference(out[0], out[1], sync_every, fragments, tau, steps)
    assert merges >= fragments
    assert out[0]["same"] and out[1]["same"], "ranks differ after the closing sync()"


def _stream_nccl_run(dev, force: bool, steps: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8)).to(dev)
    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), model=model,
                                sync_every=16, fragments=4, overlap_steps=2, outer="diloco",
                                stall_warning_s=None)
    if force:   # a world of one makes no collectives: drive the NCCL async path anyway
        opt.stream.distributed = True
    seen = {"collectives": 0, "bytes": 0}
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    g = torch.Generator(device=dev).manual_seed(3)
    with torch.cuda.stream(s):
        for t in range(steps):
            x = torch.randn(32, 64, generator=g, device=dev)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            st = opt.last_sync
            if st is not None and opt.sync_count > seen.get("n", 0):
                seen["n"] = opt.sync_count
                seen["collectives"] += st.collectives
                seen["bytes"] += st.bytes
    opt.sync()   # the default stream: fenced after the side stream's steps
    torch.cuda.synchronize()
    return [p.detach().cpu().clone() for p in model.parameters()], seen, opt.sync_count


def test_nccl_streaming_world_of_one_forced_matches_local(nccl_one):
    """fragments=4, overlap_steps=2: async NCCL all_reduce (its own stream) of each fragment,
    training on a side stream meanwhile. With one rank the result must equal the run without
    collectives bit for bit (SUM of one rank), with every fragment sync's collectives issued."""
    steps = 80
    local, seen_local, n_local = _stream_nccl_run(nccl_one, False, steps)
    forced, seen_forced, n_forced = _stream_nccl_run(nccl_one, True, steps)
    assert n_local == n_forced >= steps // 4
    assert seen_local["collectives"] == 0 and seen_forced["collectives"] >= 2 * (steps // 4 - 1)
    for a, b in zip(local, forced):
        assert torch.equal(a, b), "NCCL streaming path differs from the local one at a world of one"


def rank_auto_cuda(rank, world):
    """sync_every='auto' on cuda:0: ranks with different readouts agree on every K (the rule)."""
    import test_adaptive as ta
    dev = _gdev()
    ctl = flo.AdaptiveSync(min_every=1, max_every=12, target=0.02, initial=4)
    model = ta._model().to(dev)
    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-2), model=model,
                                sync_every=ctl, stall_warning_s=None)
    seen, log = None, []
    for i in range(60):
        x, y = ta._batch(rank, i)
        opt.zero_grad()
        (model(x.to(dev)) - y.to(dev)).pow(2).mean().backward()
        opt.step()
        s = opt.last_sync
        if s is not None and s is not seen:
            seen = s
            log.append({"steps": s.steps, "div": s.divergence, "k": s.next_every, "every": opt.sync_every,
                        "cohort": s.cohort_divergence,
                        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()})
    everyone = gather_object([{k: v for k, v in e.items() if k != "params"} for e in log])
    params = gather_object([e["params"] for e in log])
    for r in range(world):
        for a, b in zip(params[r], params[0]):
            assert torch.equal(a, b)
    return everyone


def test_gloo_cuda_auto_ranks_agree_and_follow_the_rule():
    import test_adaptive as ta
    # 3 ranks: with 2, both are equally far from their midpoint and the readouts always agree
    everyone = run_ranks(rank_auto_cuda, 3, timeout=180, collective_timeout=60)[0]
    syncs = list(zip(*everyone))
    assert len(syncs) >= 5
    k = 4
    for recs in syncs:
        divs = [e["div"] for e in recs]
        assert len({round(d, 12) for d in divs}) == len(divs), divs
        want = ta._reference_next(k, divs, [e["steps"] for e in recs], 1, 12, 0.02, 2.0)
        assert all(e["k"] == want == e["every"] for e in recs)
        rms = math.sqrt(sum(d * d for d in divs) / len(divs))
        assert all(e["cohort"] == pytest.approx(rms, rel=1e-12) for e in recs)
        k = want
    assert len({recs[0]["k"] for recs in syncs}) > 1


def rank_buckets_cuda(rank, world, steps, rows):
    import test_grad_buckets as tg
    dev = _gdev()
    model = tg._Net().to(dev)
    opt = flo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=tg.LR, momentum=0.9),
                                   named_parameters=model.named_parameters(), bucket_bytes=tg.TINY)
    counts = []
    for x, y in tg._batches(steps, rows * world, seed=7):
        x, y = x.to(dev), y.to(dev)
        opt.zero_grad()
        part = slice(rank * rows, (rank + 1) * rows)
        with tg._Counting() as c:
            loss = (model(x[part]) - y[part]).pow(2).mean()
            c.backward = True
            loss.backward()
            c.backward = False
            opt.step()
        counts.append((c.calls, c.in_backward))
    n_buckets = sum(len(b.buckets) for b in opt._buffers)
    return tg._flat(model).cpu().numpy(), counts, n_buckets


def test_gloo_cuda_gradient_buckets_equal_the_concatenated_batch():
    import test_grad_buckets as tg
    steps, rows = 3, 4
    out = run_ranks(rank_buckets_cuda, 2, steps, rows, timeout=180, collective_timeout=60)
    ref = tg._reference(2, steps, rows)
    for r, (params, counts, n_buckets) in enumerate(out):
        assert n_buckets == 10
        err = (torch.from_numpy(params) - ref).abs().max()
        assert err < 1e-12, (r, err)   # float64 on the GPU against float64 on the CPU
        for calls, in_backward in counts:
            assert calls == n_buckets and in_backward >= 2, counts
    assert (out[1][0] == out[0][0]).all()


# ------------------------------------------------------------------ sync_moments on CUDA tensors
def rank_moments_cuda(rank, world):
    """Fused AdamW on cuda:0 (Gloo ranks sharing it), unequal work, the moments before and after."""
    import test_moments as tm
    dev = _gdev()
    model = _mlp_cuda(dev)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(tm.B1, tm.B2), fused=True)
    opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=10 ** 9, sync_moments=True,
                                stall_warning_s=None)

    def moments():
        st = [inner.state[p] for p in model.parameters()]
        return tuple(torch.cat([s[k].double().reshape(-1) for s in st]).cpu().numpy()
                     for k in ("exp_avg", "exp_avg_sq"))
    steps = (3, 5, 4)[rank]
    _train_cuda(model, opt, rank, steps, dev)
    pre = gather_object((moments(), steps))
    opt.sync()
    return {"pre": pre, "post": moments()}


def test_gloo_cuda_sync_moments_match_float64():
    import numpy as np
    import test_moments as tm
    out = run_ranks(rank_moments_cuda, 3, timeout=180, collective_timeout=60)
    m_ref, v_ref = tm._formula(out[0]["pre"])
    for r in out:
        np.testing.assert_allclose(r["post"][0], m_ref, rtol=1e-5, atol=1e-7 * np.abs(m_ref).max())
        np.testing.assert_allclose(r["post"][1], v_ref, rtol=1e-5, atol=1e-6 * np.abs(v_ref).max())
        assert all(np.array_equal(a, b) for a, b in zip(r["post"], out[0]["post"]))


def test_nccl_sync_moments_world_of_one_forced_keeps_the_moments(nccl_one):
    """The NCCL path of the moments' SUM (a group of one, forced): one voter, nothing to denoise."""
    model = _mlp_cuda(nccl_one)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=4, sync_moments=True, stall_warning_s=None)
    opt._moments.distributed = True
    for t in range(3):
        opt.zero_grad()
        model(torch.randn(8, 6, device=nccl_one)).pow(2).mean().backward()
        opt.step()
    before = [inner.state[p][k].clone() for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")]
    stats = opt.sync()
    after = [inner.state[p][k] for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")]
    # The SUM carries each moment times its rank's work weight and the mean divides it back out:
    # on CUDA that division is a multiply by the reciprocal, so a value may move in its last bit
    # or two (never more: two roundings). Denoising must not touch it (one voter).
    for a, b in zip(before, after):
        torch.testing.assert_close(b, a, rtol=3e-7, atol=0.0)
    assert any(not torch.equal(a, 0 * a) for a in after)
    assert stats.bytes >= opt._moments.bytes_per_sync


# ------------------------------------------------------------------ denoise_moments on CUDA tensors
def rank_denoise_cuda(rank, world):
    """Fused AdamW on cuda:0 (Gloo ranks sharing it): the state before and after every step."""
    import test_denoise as td
    dev = _gdev()
    model = _mlp_cuda(dev)
    inner = torch.optim.AdamW(model.parameters(), lr=td.LR, betas=(td.B1, td.B2), eps=td.EPS,
                              weight_decay=0.1, fused=dev.type == "cuda")
    opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=10 ** 9, stall_warning_s=None,
                                denoise_moments=True)
    cpu = lambda ts: td._vec(t.detach().cpu() for t in ts)   # noqa: E731
    steps = []
    for t in range(1, 5):
        g = torch.Generator().manual_seed(1000 * rank + t)
        x = torch.randn(8, 6, generator=g).to(dev)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        ps = list(model.parameters())
        pre = {"p": cpu(ps), "g": cpu(p.grad for p in ps)}
        if t > 1:
            pre["m"], pre["v"] = (cpu(inner.state[p][k] for p in ps) for k in ("exp_avg", "exp_avg_sq"))
        opt.step()
        steps.append((pre, {"p": cpu(ps), **{n: cpu(inner.state[p][k] for p in ps)
                                             for n, k in (("m", "exp_avg"), ("v", "exp_avg_sq"))}}))
    return steps


def test_gloo_cuda_denoise_moments_match_float64():
    import numpy as np
    import test_denoise as td
    out = run_ranks(rank_denoise_cuda, td.WORLD, timeout=180, collective_timeout=60)
    for r in out:
        for t, (pre, post) in enumerate(r, start=1):
            p_ref, m_ref, v_ref, v_adam, _ = td._adam_step(pre, t, "adamw")
            np.testing.assert_allclose(post["p"], p_ref, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(post["m"], m_ref, rtol=1e-5, atol=1e-7 * np.abs(m_ref).max())
            np.testing.assert_allclose(post["v"], v_ref, rtol=1e-5, atol=1e-6 * np.abs(v_ref).max())
            if t > 1:
                assert np.abs(v_adam - v_ref).max() > 100 * 1e-6 * np.abs(v_ref).max()


# ------------------------------------------------------------------ denoise_moments="sync" on CUDA tensors
def rank_drift_cuda(rank, world):
    """Fused AdamW on cuda:0 (Gloo ranks sharing it; its step count is a device tensor): params and
    moments before and after one explicit sync."""
    import numpy as np
    import test_drift_denoise as tdd
    dev = _gdev()
    model = _mlp_cuda(dev)
    inner = torch.optim.AdamW(model.parameters(), lr=tdd.LR, betas=(tdd.B1, tdd.B2), eps=tdd.EPS,
                              weight_decay=tdd.WD, fused=dev.type == "cuda")
    opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=10 ** 9, stall_warning_s=None,
                                denoise_moments="sync")
    _train_cuda(model, opt, rank, 3, dev)
    cpu = lambda ts: np.concatenate([t.detach().double().reshape(-1).cpu().numpy() for t in ts])  # noqa: E731
    state = lambda: (cpu(model.parameters()), cpu(inner.state[p]["exp_avg_sq"] for p in model.parameters()))  # noqa: E731
    pre = state()
    opt.sync()
    return {"pre": pre, "post": state()}


def test_gloo_cuda_drift_denoise_matches_float64():
    import numpy as np
    import test_drift_denoise as tdd
    out = run_ranks(rank_drift_cuda, 3, timeout=180, collective_timeout=60)
    c = np.mean([r["pre"][0] for r in out], axis=0)
    for r in out:
        want, *_ = tdd._corrected(r["pre"][0] - c, r["pre"][1], 3, 3, tdd.LR, 3, 0.0, 0.0)
        np.testing.assert_allclose(r["post"][0], c, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["post"][1], want, rtol=1e-4, atol=1e-9)
        assert np.abs(want - r["pre"][1]).max() > 1e-3 * np.abs(want).max()
        assert np.array_equal(r["post"][0], out[0]["post"][0])


def rank_stream_wire_cuda(rank, world, dev_name):
    """Streaming DiLoCo with an int8 wire on ``dev_name``; a checkpoint mid-flight resumed there too."""
    import io
    dev = torch.device(dev_name)

    def build():
        model = _mlp_cuda(dev)
        opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model=model,
                                    sync_every=8, fragments=2, overlap_steps=2, outer="diloco", wire="int8",
                                    error_feedback=True, stall_warning_s=None)
        return model, opt
    model, opt = build()
    _train_cuda(model, opt, rank, 21, dev)
    straight = _params_np(model)
    model, opt = build()
    _train_cuda(model, opt, rank, 13, dev)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    msd = {k: v.clone() for k, v in model.state_dict().items()}
    buf.seek(0)
    model, opt = build()
    model.load_state_dict(msd)
    opt.load_state_dict(torch.load(buf, weights_only=False))
    for t in range(14, 22):   # the same batches as steps 14..21 of the straight run
        g = torch.Generator().manual_seed(1000 * rank + t)
        opt.zero_grad()
        model(torch.randn(8, 6, generator=g).to(dev)).pow(2).mean().backward()
        opt.step()
    resumed = _params_np(model)
    opt.sync()
    return {"straight": straight, "resumed": resumed, "final": _params_np(model),
            "on": str(next(model.parameters()).device)}


def test_gloo_cuda_compressed_streaming_matches_cpu_and_resumes_exactly():
    import numpy as np
    gpu = run_ranks(rank_stream_wire_cuda, 2, "cuda:0", timeout=180, collective_timeout=60)
    cpu = run_ranks(rank_stream_wire_cuda, 2, "cpu", timeout=180, collective_timeout=60)
    assert gpu[0]["on"].startswith("cuda")
    for r in gpu:
        assert all(np.array_equal(a, b) for a, b in zip(r["straight"], r["resumed"])), "resume mid-flight"
    assert all(np.array_equal(a, b) for a, b in zip(gpu[0]["final"], gpu[1]["final"]))
    for a, b in zip(gpu[0]["final"], cpu[0]["final"]):  # kernels differ in rounding, not in the maths
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-3)
