"""``denoise_moments="sync"``: at every sync each rank reads its small-batch gradient noise from its own
drift ``W_i - C`` and takes the window's excess out of its own Adam/AdamW second moment; real Gloo ranks.

The syncs are checked against the formula of flodl_opt/hooks/moments.py written here in float64 from the
ranks' own Adam steps (AdamW with weight decay, an lr scheduler, two syncs so the EMA carries over).
Also: identical params after a sync with each rank's own moments, exact resume from the middle of a
window, a NaN rank, uneven data under ``join()``, a peer killed in the consensus (nothing written),
refusals, and the default bit-identical to the commit before the option.
"""
from __future__ import annotations

import copy
import os
import signal

import numpy as np
import pytest
import torch
import torch.distributed as dist

import flodl_opt as flo
from adam_toy import adamw_option_off_runs
from adam_toy import flat as _flat, model as _model, moments as _moments, train as _train
from adam_toy import recorded_steps as _recorded_steps
from dist_harness import assert_default_identical, run_ranks, run_with_base, survivor_verdict, sync_error_verdict

BASE_COMMIT = "594da5f"   # the last commit without denoise_moments="sync"
B1, B2, LR, EPS, WD = 0.9, 0.95, 1e-2, 1e-8, 0.01
WORLD, K = 3, 4


def _lr_factor(t: int) -> float:
    return 1.0 / (1.0 + 0.1 * t)


def _build(model, scheduled=True, **kw):
    inner = torch.optim.AdamW(model.parameters(), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, _lr_factor) if scheduled else None
    opt = flo.LocalSGDOptimizer(inner, model=model, lr_scheduler=sched, stall_warning_s=None,
                                **{"sync_every": K, "denoise_moments": "sync", **kw})
    return inner, opt


# ------------------------------------------------------------------ rank functions
def _reference_run(rank, world):
    """Two windows of K steps (a sync inside the K-th and 2K-th step()): the state before every step,
    the lr it used, and the state after it."""
    model = _model()
    inner, opt = _build(model)
    return _recorded_steps(model, inner, opt, rank, 2 * K, with_lr=True)


def _resume_run(rank, world):
    """A sync, two steps into the next window a checkpoint, six more steps; against a fresh optimizer
    loaded from it. Optimizers built without the option, or with the per-step one, refuse it."""
    model = _model(0)
    inner, opt = _build(model)
    _train(model, opt, rank, K + 2)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    _train(model, opt, rank, 6, start=K + 2)
    straight = (_flat(model), *_moments(inner, model))
    model2 = _model(1)
    inner2, opt2 = _build(model2)
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    _train(model2, opt2, rank, 6, start=K + 2)
    resumed = (_flat(model2), *_moments(inner2, model2))
    refusals = []
    for other in (False, True):
        m3 = _model(1)
        _, opt3 = _build(m3, denoise_moments=other)
        try:
            opt3.load_state_dict(saved[1])
            refusals.append(None)
        except flo.ConfigError as exc:
            refusals.append(str(exc))
    return {"straight": straight, "resumed": resumed, "refusals": refusals,
            "config": saved[1]["flodl_opt"]["config"]["denoise_moments"],
            "lr_sum": saved[1]["flodl_opt"]["drift"]["lr_sum"]}


def _nonfinite_run(rank, world):
    """Rank 1's params go NaN before an explicit sync: it gets no vote; ranks 0 and 2 read their drift
    against their own consensus (two movers)."""
    model = _model()
    inner, opt = _build(model, scheduled=False, sync_every=10 ** 9)
    _train(model, opt, rank, 3)
    if rank == 1:
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("nan")
    pre = (_flat(model), *_moments(inner, model))
    with pytest.warns(flo.NonFiniteWarning) if rank == 1 else _nullcontext():
        opt.sync()
    return {"pre": pre, "post": (_flat(model), *_moments(inner, model))}


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


GROUP_B2 = (0.95, 0.8)   # first layer, second layer


def _groups_run(rank, world):
    """Two param groups with different b2, two explicit syncs of 3 steps: params and v before and after each."""
    model = _model()
    first, second = list(model[0].parameters()), list(model[2].parameters())
    inner = torch.optim.AdamW([{"params": first, "betas": (B1, GROUP_B2[0])},
                               {"params": second, "betas": (B1, GROUP_B2[1])}], lr=LR, eps=EPS, weight_decay=WD)
    opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=10 ** 9, stall_warning_s=None, denoise_moments="sync")
    out = []
    for window in range(2):
        _train(model, opt, rank, 3, start=3 * window)
        pre = (_flat(model), _moments(inner, model)[1])
        opt.sync()
        out.append((pre, _moments(inner, model)[1]))
    return out


def _join_run(rank, world):
    """Uneven data: ranks run out after 9, 14 and 5 steps; join() ends them on one consensus."""
    model = _model()
    inner, opt = _build(model)
    with opt.join():
        _train(model, opt, rank, (9, 14, 5)[rank])
    return {"params": _flat(model), "moments": _moments(inner, model)}


def _defaults_run(rank, world, base_dir):
    """The default, denoise_moments=False and the base commit's optimizer: the same bits."""
    return adamw_option_off_runs(rank, base_dir, "denoise_moments", diloco_lr=1.0)


def _all(rank, world, base_dir):
    return {"reference": _reference_run(rank, world), "resume": _resume_run(rank, world),
            "nonfinite": _nonfinite_run(rank, world), "join": _join_run(rank, world),
            "groups": _groups_run(rank, world),
            "defaults": _defaults_run(rank, world, base_dir)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_with_base(_all, WORLD, tmp_path_factory.mktemp("base"), BASE_COMMIT)


# ------------------------------------------------------------------ the float64 reference
def _adamw(pre, t):
    """AdamW's step in float64 from the state before it."""
    p, g, lr = pre["p"] * (1 - pre["lr"] * WD), pre["g"], pre["lr"]
    m0, v0 = (pre["m"], pre["v"]) if t > 1 else (np.zeros_like(p), np.zeros_like(p))
    m = B1 * m0 + (1 - B1) * g
    v = B2 * v0 + (1 - B2) * g * g
    return p - lr / (1 - B1 ** t) * m / (np.sqrt(v / (1 - B2 ** t)) + EPS), m, v


def _a(k):
    return k + 2 * sum((k - j) * B1 ** j for j in range(1, k))


def _corrected(d, v, t, k, lr, ranks, noise, weight, b2=B2):
    """moments.py's sync-time correction of one rank's v from its drift d, in float64."""
    denom = np.sqrt(v / (1 - b2 ** t)) + EPS
    reading = (d * denom * (1 - B1 ** t) / lr) ** 2 / ((1 - 1 / ranks) * (1 - B1) / (1 + B1) * _a(k))
    rho = b2 ** k
    noise = rho * noise + (1 - rho) * reading
    weight = 1 - (1 - weight) * rho
    s2 = np.minimum(noise / weight, v / (1 - b2 ** t))
    cut = v - (1 - b2 ** k) * (1 - 1 / ranks) * s2
    return np.maximum(cut, v / ranks), noise, weight, (noise / weight < v / (1 - b2 ** t)) & (cut > v / ranks)


def test_each_sync_takes_the_drifts_noise_excess_out_of_each_ranks_v_in_float64(ranks):
    res, _ = ranks
    noise, weight, interior = [0.0] * WORLD, [0.0] * WORLD, 0
    for t in range(1, 2 * K + 1):
        steps = [r["reference"][t - 1] for r in res]
        ref = [_adamw(pre, t) for pre, _ in steps]
        if t % K:   # a local step: AdamW, nothing else
            for (p, m, v), (_, post) in zip(ref, steps):
                np.testing.assert_allclose(post["p"], p, rtol=1e-6, atol=1e-7)
                np.testing.assert_allclose(post["v"], v, rtol=1e-5, atol=1e-9)
            continue
        c = np.mean([p for p, _, _ in ref], axis=0)                       # equal work: the plain mean
        lr = np.mean([pre["lr"] for pre, _ in res[0]["reference"][t - K:t]])   # the window's mean lr
        for i, ((p, m, v), (_, post)) in enumerate(zip(ref, steps)):
            want, noise[i], weight[i], inside = _corrected(p - c, v, t, K, lr, WORLD, noise[i], weight[i])
            np.testing.assert_allclose(post["p"], c, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(post["m"], m, rtol=1e-5, atol=1e-9)   # m stays the rank's own
            np.testing.assert_allclose(post["v"], want, rtol=1e-4, atol=1e-9)
            assert np.abs(want - v).max() > 1e-3 * np.abs(v).max()         # the correction is far above the tolerance
            interior += int(inside.sum())
    assert interior > 0, "every coordinate sat at the cap or the floor: the formula itself went untested"
    for r in res[1:]:
        assert np.array_equal(r["reference"][-1][1]["p"], res[0]["reference"][-1][1]["p"])
        assert not np.array_equal(r["reference"][-1][1]["v"], res[0]["reference"][-1][1]["v"])


def test_resume_from_the_middle_of_a_window_is_bit_exact_and_other_settings_refuse_it(ranks):
    res, _ = ranks
    for r in res:
        rr = r["resume"]
        assert rr["config"] == "sync"
        assert rr["lr_sum"] == [pytest.approx(LR * (_lr_factor(K) + _lr_factor(K + 1)))]   # two steps in
        assert all(np.array_equal(a, b) for a, b in zip(rr["straight"], rr["resumed"]))
        assert all(m is not None and "denoise_moments" in m for m in rr["refusals"]), rr["refusals"]


def test_a_nan_rank_gets_no_vote_and_the_others_read_their_drift_against_their_own_consensus(ranks):
    res, _ = ranks
    pre = [r["nonfinite"]["pre"] for r in res]
    c = (pre[0][0] + pre[2][0]) / 2
    for i, r in enumerate(res):
        p, m, v = r["nonfinite"]["post"]
        assert np.isfinite(p).all() and np.isfinite(v).all()
        np.testing.assert_allclose(p, c, rtol=1e-6, atol=1e-7)
        if i != 1:   # t = K = 3 steps, constant lr, two movers; the first reading is the EMA's
            want, *_ = _corrected(pre[i][0] - c, pre[i][2], 3, 3, LR, 2, 0.0, 0.0)
            np.testing.assert_allclose(v, want, rtol=1e-4, atol=1e-9)
            assert not np.allclose(v, pre[i][2])


def test_param_groups_with_their_own_b2_each_keep_their_own_ema_across_syncs(ranks):
    res, _ = ranks
    split = 7 * 5 + 7   # the first layer's weight and bias come first in the flat vectors
    state = [[(0.0, 0.0), (0.0, 0.0)] for _ in res]   # per rank, per group: (noise, weight)
    for w in range(2):
        c = np.mean([r["groups"][w][0][0] for r in res], axis=0)
        for i, r in enumerate(res):
            (p, v), post = r["groups"][w]
            for gi, sl in enumerate((slice(0, split), slice(split, None))):
                want, noise, weight, _ = _corrected((p - c)[sl], v[sl], 3 * (w + 1), 3, LR, WORLD,
                                                    *state[i][gi], b2=GROUP_B2[gi])
                state[i][gi] = (noise, weight)
                np.testing.assert_allclose(post[sl], want, rtol=1e-4, atol=1e-9)


def test_join_with_uneven_data_ends_with_identical_params(ranks):
    res, _ = ranks
    for r in res[1:]:
        assert np.array_equal(r["join"]["params"], res[0]["join"]["params"])
    assert all(np.isfinite(x).all() for r in res for x in r["join"]["moments"])


def test_default_is_bit_identical_to_the_commit_before_the_option(ranks):
    assert_default_identical(*ranks, BASE_COMMIT, "denoise_moments")


# ------------------------------------------------------------------ a peer dies in the consensus
def _peer_dies(rank, world, out):
    model = _model()
    inner, opt = _build(model)
    _train(model, opt, rank, K - 1)
    if rank == 1:   # all_reduce call 1 at the sync: the consensus's count
        real = dist.all_reduce

        def dying(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        dist.all_reduce = dying
    state = {}

    def step_and_keep():
        inner.register_step_post_hook(lambda o, a, k: state.setdefault(
            "after_step", (_flat(model), *_moments(inner, model))))
        _train(model, opt, rank, 1, start=K - 1)
    return sync_error_verdict(
        out, step_and_keep,
        lambda exc: {"msg": str(exc), "restored": exc.restored, "syncs": opt.sync_count,
                     "unchanged": all(np.array_equal(x, y) for x, y in
                                      zip(state["after_step"], (_flat(model), *_moments(inner, model)))),
                     "drift": opt.state_dict()["flodl_opt"]["drift"]})


def test_peer_killed_in_the_consensus_leaves_params_moments_and_the_noise_estimate_as_they_were(tmp_path):
    r = survivor_verdict(_peer_dies, str(tmp_path / "rank0.pt"), timeout=60, collective_timeout=15)
    assert r["msg"].startswith("flodl_opt: sync #1 failed on rank 0"), r["msg"]
    assert r["restored"] and r["unchanged"] and r["syncs"] == 0, {k: v for k, v in r.items() if k != "msg"}
    assert all(n is None for n in r["drift"]["noise"]) and all(w == 0.0 for w in r["drift"]["weight"])
    assert r["drift"]["lr_sum"] == [pytest.approx(LR * sum(_lr_factor(t) for t in range(K)))]   # kept for a retry


# ------------------------------------------------------------------ refusals (a world of one: test_denoise.py)
@pytest.mark.parametrize("make, kw, says", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), {}, "denoise_moments='sync' works on Adam/AdamW moments"),
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), {}, "amsgrad=False"),
    (lambda ps: torch.optim.AdamW(ps), {"sync_moments": True}, "pick one"),
    (lambda ps: torch.optim.AdamW(ps), {"fragments": 2}, "with fragments/overlap_steps use denoise_moments=True"),
    (lambda ps: torch.optim.AdamW(ps), {"overlap_steps": 1}, "with fragments/overlap_steps use denoise_moments=True"),
    (lambda ps: torch.optim.AdamW(ps), {"keep_presync": False}, "drop keep_presync=False"),
])
def test_refused_combinations_say_what_to_change(make, kw, says):
    model = _model()
    with pytest.raises(flo.ConfigError, match=says.replace("(", r"\(")):
        flo.LocalSGDOptimizer(make(model.parameters()), model=model, sync_every=4, denoise_moments="sync", **kw)
    for bad in ("step", "SYNC", 1, None):
        with pytest.raises(flo.ConfigError, match=r"False, True \(at every step\) or 'sync'"):
            flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model, denoise_moments=bad)


def _outer_wire_run(rank, world):
    """The first sync with plain averaging, with DiLoCo and with an int8 wire, from the same start."""
    out = {}
    for name, kw in (("avg", {}), ("diloco", {"outer": flo.DiLoCo(lr=0.8, momentum=0.5, warmup=0)}),
                     ("int8", {"wire": "int8"})):
        model = _model(0)
        inner, opt = _build(model, **kw)
        _train(model, opt, rank, K)
        p = next(iter(model.parameters()))
        out[name] = {"v": inner.state[p]["exp_avg_sq"].double().numpy().copy(), "p": p.detach().double().numpy().copy()}
    return out


def test_drift_is_read_against_the_consensus_with_diloco_and_a_compressed_wire():
    """The drift W_i - C is the rank's own noise whatever follows the consensus: DiLoCo's outer step
    leaves the correction of v exactly as with plain averaging; an int8 consensus moves it by its rounding."""
    res = run_ranks(_outer_wire_run, WORLD, timeout=90)
    for r in res:
        assert np.array_equal(r["diloco"]["v"], r["avg"]["v"])       # read against C, not the outer step's G
        assert not np.array_equal(r["diloco"]["p"], r["avg"]["p"])   # the outer step did move the params
        np.testing.assert_allclose(r["int8"]["v"], r["avg"]["v"], rtol=0.05, atol=1e-9)
        assert not np.array_equal(r["int8"]["v"], r["avg"]["v"])
    for r in res[1:]:
        assert np.array_equal(r["diloco"]["p"], res[0]["diloco"]["p"]) and np.array_equal(r["int8"]["p"], res[0]["int8"]["p"])
