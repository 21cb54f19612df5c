"""Compressed syncs (wire="bf16" | "fp16" | "int8") against float64 references, on real Gloo ranks.

Each case puts every rank at known weights ``W_i = A + D_i`` (``A`` the common anchor, ``D_i``
spanning eight orders of magnitude plus a block far beyond float16's range), with a known step
count, gathers them test-side, syncs, and checks the consensus against ``sum_i f_i W_i`` computed
here in float64, element by element, within the error bound each format states
(flodl_opt/transport/wire.py): ``sum_i err(x_i) + err(S)``, the rank's encode plus the owner's re-encode.
"""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import flodl_opt as flo
from dist_harness import gather_object, run_ranks

N = 3072          # elements of the test param: a multiple of 2*3*256, so no section padding
BLOCK = 256
COUNT_BYTES = 7 * 8
MODES = ("bf16", "fp16", "int8")


def _diff(rank: int, t: int) -> torch.Tensor:
    """A rank's update: blocks of magnitudes 1e-6 .. 1e1, and one block of 1e6 (float16 overflows)."""
    g = torch.Generator().manual_seed(1000 * t + rank)
    mags = 10.0 ** (torch.rand(N // BLOCK, generator=g) * 7 - 6)
    mags[3] = 1e6
    return (torch.randn(N // BLOCK, BLOCK, generator=g) * mags[:, None]).view(-1)


def _bound(mode: str, x: np.ndarray, anchor: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per-element bound on |consensus - ref| for rows ``x[i] = f_i (W_i - A)`` (float64)."""
    ax = np.abs(x)
    s = np.abs(x.sum(0))
    if mode == "bf16":
        u = 2.0 ** -8
        b1 = u * ax.sum(0)
        b2 = u * (s + b1)
    elif mode == "fp16":  # scaled into the normal range: relative error, plus a subnormal floor
        u, floor = 2.0 ** -11, 2.0 ** -25 * 2.0 ** -14
        b1 = u * ax.sum(0) + floor * 2 * ax.max()
        b2 = u * (s + b1) + floor * 2 * (s + b1).max()
    else:  # int8: scale/2 per element per encode, scale = block absmax / 127
        blocks = ax.reshape(len(x), -1, BLOCK).max(2) / 127.0
        b1 = np.repeat(blocks.sum(0) / 2, BLOCK)
        b2 = np.repeat((s + b1).reshape(-1, BLOCK).max(1) / 127.0 / 2, BLOCK)
    # float32 arithmetic of W - A, the scaling, the sums and A + D (a few roundings each).
    slack = 2.0 ** -21 * (ax.sum(0) + np.abs(anchor) + np.abs(ref)) + 1e-6 * (b1 + b2)
    return b1 + b2 + slack


# ------------------------------------------------------------------ consensus within its bound
def rank_bound(rank, world, mode):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(N))
    opt = flo.LocalSGDOptimizer(torch.optim.SGD([p], lr=0.1), sync_every=10 ** 9, wire=mode,
                                stall_warning_s=None)
    # unequal work, an idle rank, equal work, and (3 ranks) a NaN rank that must get no vote
    cases = {2: [(1, 3), (0, 2), (2, 2)], 3: [(1, 4, 2), (0, 3, 1), (2, 2, 2), (1, 2, 3)]}[world]
    worst = []
    for t, steps in enumerate(cases):
        anchor = p.detach().clone()
        assert all(torch.equal(anchor, a) for a in gather_object(anchor)), "anchor differs across ranks"
        nan_rank = 1 if t == 3 else None
        with torch.no_grad():
            p.add_(_diff(rank, t))
            if rank == nan_rank:
                p[5] = float("nan")
        opt._steps_since_sync = steps[rank]  # the count only: weights are n_i / sum n
        pre = gather_object(p.detach().double().numpy().copy())
        stats = opt.sync()
        got = p.detach().double().numpy()
        votes = np.array([0.0 if r == nan_rank else float(n) for r, n in enumerate(steps)])
        f = votes / votes.sum()
        a64 = anchor.double().numpy()
        x = np.stack([f[r] * (pre[r] - a64) if f[r] > 0 else np.zeros(N) for r in range(world)])
        ref = a64 + x.sum(0)   # = sum_i f_i W_i, as sum_i f_i = 1
        err, bound = np.abs(got - ref), _bound(mode, x, a64, ref)
        assert np.all(err <= bound), (mode, t, float((err / bound).max()), int((err / bound).argmax()))
        worst.append(float((err / bound).max()))
        assert stats.weight == pytest.approx(f[rank])
        assert stats.nonfinite == (rank == nan_rank) and stats.nonfinite_ranks == (nan_rank is not None)
        post = gather_object(p.detach().clone())
        assert all(torch.equal(post[0], q) for q in post), f"params differ across ranks after sync {t}"
        assert np.isfinite(got).all()
    return worst, stats.bytes, stats.collectives


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_consensus_within_bound_and_identical(mode, world):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_ranks(rank_bound, world, mode, timeout=90)
    worst, nbytes, collectives = results[0]
    # The bound is not vacuous: the error reaches a fair part of it somewhere.
    assert max(worst) > 0.05, worst
    # Bytes handed to collectives: the count, then (N-1)/N of the payload + 1/N of it.
    payload = {"bf16": 2 * N, "fp16": 2 * N + 4 * world, "int8": N + 4 * N // BLOCK}[mode]
    assert nbytes == COUNT_BYTES + payload
    assert collectives == 3
    fp32 = COUNT_BYTES + 4 * N
    ratio = (nbytes - COUNT_BYTES) / (fp32 - COUNT_BYTES)
    assert ratio <= {"bf16": 0.5, "fp16": 0.502, "int8": 0.2657}[mode]


# ------------------------------------------------------------------ training: identical every sync
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 40), nn.BatchNorm1d(40), nn.Tanh(), nn.Linear(40, 3))


def rank_training(rank, world, mode, outer, ef):
    model = _model()
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), model=model, sync_every=2,
                                outer=outer, wire=mode, error_feedback=ef, stall_warning_s=None)
    if outer == "diloco" and opt.wire is not None:  # the wire shares DiLoCo's anchor, no second copy
        assert opt.wire._groups[0].anchor is opt.outer.anchor[0]
    g = torch.Generator().manual_seed(rank)
    syncs = 0
    for step in range(1, 7 + rank % 2):  # rank 1 of 3 does one more step: uneven work at the end
        x = torch.randn(16, 12, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if opt.steps_since_sync == 0:
            syncs += 1
            tensors = [t.detach().clone() for t in model.parameters()] + \
                      [b.clone() for b in model.buffers() if b.is_floating_point()]
            allt = gather_object(tensors)
            assert all(torch.equal(a, b) for a, b in zip(allt[0], tensors)), f"ranks differ at sync {syncs}"
    assert model[1].num_batches_tracked.item() == opt.local_steps, "integer buffers stay local"
    if world == 3:
        opt.sync()  # the extra step of rank 1
        allt = gather_object([t.detach().clone() for t in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(allt[0], allt[rank]))
    return torch.cat([t.detach().view(-1) for t in model.parameters()]).numpy()


@pytest.mark.parametrize("mode,outer,ef,world", [
    ("int8", "avg", False, 3), ("bf16", "diloco", True, 2), ("fp16", "avg", False, 2),
    ("int8", "diloco", True, 3)])
def test_training_ranks_identical_after_every_sync(mode, outer, ef, world):
    out = run_ranks(rank_training, world, mode, outer, ef, timeout=90)
    ref = run_ranks(rank_training, world, "fp32", outer, False, timeout=90)
    # Close to the float32 run (a loose sanity check; the bound test is the precise one).
    np.testing.assert_allclose(out[0], ref[0], atol=2e-2)


# ------------------------------------------------------------------ error feedback
def rank_error_feedback(rank, world, mode):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(N))

    def build(param):
        return flo.LocalSGDOptimizer(torch.optim.SGD([param], lr=0.1), sync_every=10 ** 9, wire=mode,
                                     error_feedback=True, stall_warning_s=None)
    opt = build(p)
    steps = [1, 3, 2][:world]
    anchor = p.detach().double().numpy().copy()
    with torch.no_grad():
        p.add_(_diff(rank, 0))
    opt._steps_since_sync = steps[rank]
    pre = gather_object(p.detach().double().numpy().copy())
    opt.sync()
    f = np.array(steps, dtype=np.float64) / sum(steps)
    exact = sum(f[r] * pre[r] for r in range(world))
    c1 = p.detach().double().numpy().copy()
    wire_sd = opt.state_dict()["flodl_opt"]["wire"]
    e = gather_object(wire_sd["residual"][0].double().numpy()[:N])
    o = gather_object(wire_sd["owner_residual"][0].double().numpy())
    # What was lost is exactly what the residuals carry: C1 = A + sum x_i - sum f_i e_i - O.
    x = sum(f[r] * (pre[r] - anchor) for r in range(world))
    lost = sum(f[r] * e[r] for r in range(world)) + np.concatenate(o)[:N]
    assert np.abs(e[rank]).max() > 0 and np.abs(np.concatenate(o)).max() > 0
    scale = np.abs(x).max()
    np.testing.assert_allclose(c1, anchor + x - lost, rtol=0, atol=2.0 ** -20 * scale)
    err1 = np.abs(c1 - exact).max()

    # A sync with no new work sends only the residuals: the consensus moves onto the exact average.
    opt._steps_since_sync = steps[rank]
    opt.sync()
    err2 = np.abs(p.detach().double().numpy() - exact).max()
    assert err2 < 0.1 * err1, (err1, err2)

    # Exact resume from state_dict: the residuals continue as if nothing happened.
    saved_p, saved_sd = p.detach().clone(), copy.deepcopy(opt.state_dict())

    def third_sync(param, o):
        with torch.no_grad():
            param.add_(_diff(rank, 1))
        o._steps_since_sync = steps[rank]
        o.sync()
        return param.detach().clone()
    want = third_sync(p, opt)
    results = {}
    for label in ("resumed", "residuals dropped"):
        q = nn.Parameter(saved_p.clone())
        o2 = build(q)
        sd = copy.deepcopy(saved_sd)
        if label == "residuals dropped":
            for t in sd["flodl_opt"]["wire"]["residual"] + sd["flodl_opt"]["wire"]["owner_residual"]:
                t.zero_()
        if label == "residuals dropped":  # an edited state dict: the digest check would refuse it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                o2.load_state_dict(sd, strict=False)
        else:
            o2.load_state_dict(sd)
        results[label] = torch.equal(third_sync(q, o2), want)
    return results, float(err1), float(err2)


@pytest.mark.parametrize("mode,world", [("int8", 3), ("bf16", 2), ("fp16", 2)])
def test_error_feedback_residual_carried_and_resumed_exactly(mode, world):
    out = run_ranks(rank_error_feedback, world, mode, timeout=90)
    for results, err1, err2 in out:
        assert results["resumed"], "resume from state_dict is not bit-exact"
        assert not results["residuals dropped"], "the residuals made no difference: the test has no teeth"


# ------------------------------------------------------------------ a failed collective
def rank_failure(rank, world, mode):
    from flodl_opt.transport import wire as wire_mod
    model = _model()
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), model=model,
                                sync_every=10 ** 9, wire=mode, error_feedback=True, stall_warning_s=None)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 12, generator=g)).pow(2).mean().backward()
        opt.step()
    opt.sync()
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(16, 12, generator=g)).pow(2).mean().backward()
        opt.step()
    before = copy.deepcopy(opt.state_dict()["flodl_opt"]["wire"])
    pre = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]
    real = wire_mod._all_gather

    def broken(*a, **k):
        raise RuntimeError("injected: connection reset by peer")
    wire_mod._all_gather = broken  # every rank fails at the same collective: nobody hangs
    try:
        opt.sync()
        raised = None
    except flo.SyncError as exc:
        raised = (exc.sync, exc.restored, type(exc.cause).__name__)
    finally:
        wire_mod._all_gather = real
    now = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]
    after = opt.state_dict()["flodl_opt"]["wire"]
    untouched = all(torch.equal(a, b) for a, b in zip(pre, now)) and all(
        torch.equal(a, b) for k in ("anchor", "residual", "owner_residual")
        for a, b in zip(before[k], after[k]) if a is not None)
    counters = (opt.sync_count, opt.steps_since_sync)
    opt.sync()  # the retry succeeds and leaves the ranks identical
    allp = gather_object([t.detach().clone() for t in model.parameters()])
    same = all(torch.equal(a, b) for a, b in zip(allp[0], allp[rank]))
    # A sync with no work anywhere skips: nothing is sent, nothing changes.
    idle = opt.sync()
    same = same and idle.skipped and idle.collectives == 1 and all(
        torch.equal(a, b) for a, b in zip(allp[rank], model.parameters()))
    return raised, untouched, counters, same


def test_failed_collective_restores_params_anchor_and_residuals():
    for raised, untouched, counters, same in run_ranks(rank_failure, 2, "int8", timeout=60):
        assert raised == (2, True, "RuntimeError")
        assert untouched, "params, buffers, anchor or residuals changed by a failed sync"
        assert counters == (1, 2)
        assert same


# ------------------------------------------------------------------ fp32 stays today's path
def rank_fp32(rank, world, explicit):
    model = _model()
    kw = {"wire": "fp32"} if explicit else {}
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), model=model, sync_every=2,
                                outer="diloco", stall_warning_s=None, **kw)
    assert opt.consensus.wire is None  # the float32 reduce, untouched
    g = torch.Generator().manual_seed(rank)
    for _ in range(6):
        opt.zero_grad()
        model(torch.randn(16, 12, generator=g)).pow(2).mean().backward()
        opt.step()
    numel = sum(gr.numel for gr in opt.flat_params + opt.flat_buffers)
    assert opt.last_sync.bytes == COUNT_BYTES + 4 * numel  # count + every float32 element handed over
    return torch.cat([t.detach().view(-1) for t in model.parameters()]).numpy()


def test_fp32_default_and_explicit_identical():
    a = run_ranks(rank_fp32, 2, False, timeout=60)
    b = run_ranks(rank_fp32, 2, True, timeout=60)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------ bad input
def _opt(model=None, **kw):
    model = model or _model()
    return flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(wire="int4"), r"unknown wire='int4'.*'fp32', 'bf16', 'fp16', 'int8'"),
    (dict(wire=8), r"unknown wire=8"),
    (dict(error_feedback=True), r"error_feedback=True needs a compressed wire"),
    (dict(wire="int8", error_feedback="yes"), r"error_feedback must be True or False"),
    (dict(wire="int8", wire_block=10), r"wire_block must be"),
    (dict(wire="int8", wire_block=0), r"wire_block must be"),
    (dict(wire="bf16", broadcast_initial=False), r"drop broadcast_initial=False"),
])
def test_bad_wire_options(kw, match):
    with pytest.raises(flo.ConfigError, match=match):
        _opt(**kw)


def test_narrow_params_refused_for_compressed_wire():
    with pytest.raises(flo.ConfigError, match=r"compresses float32 params.*bfloat16.*wire='fp32'"):
        _opt(_model().to(torch.bfloat16), wire="int8")
    _opt(_model().to(torch.bfloat16), wire="fp32")  # the float32 reduce handles them


def test_world_of_one_sends_nothing_and_checkpoint_keeps_wire():
    model = _model()
    opt = _opt(model, wire="int8", error_feedback=True)
    before = [t.detach().clone() for t in model.parameters()]
    stats = opt.sync()
    assert stats.bytes == 0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.config()["wire"] == {"mode": "int8", "block": 256, "error_feedback": True}
    sd = opt.state_dict()
    for strict in (True, False):
        with pytest.raises(flo.ConfigError, match=r"config differs.*wire"):
            _opt(_model()).load_state_dict(copy.deepcopy(sd), strict=strict)
    plain = _opt(_model()).state_dict()
    del plain["flodl_opt"]["config"]["wire"]  # a checkpoint from before wire= existed is fp32
    _opt(_model()).load_state_dict(plain)


def rank_mismatched_wire(rank, world):
    try:
        _opt(wire="int8" if rank == 0 else "bf16", stall_warning_s=None)
    except flo.ConfigError as exc:
        return str(exc)
    return "no error"


def test_ranks_with_different_wires_fail_on_every_rank():
    for msg in run_ranks(rank_mismatched_wire, 2, timeout=60):
        assert "ranks wrap different models or configs" in msg and "wire" in msg
