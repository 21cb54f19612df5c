"""``sync_moments=True``: the inner AdamW moments shared at the sync, on real Gloo ranks.

The shared moments are checked against the formula of flodl_opt/hooks/moments.py written here in float64
from every rank's moments gathered test-side (unequal work, so the weights matter), and, after one
step from shared moments, against the moments of the averaged gradient (AdamW's own update rule
applied here to the gathered gradients). Also: identical on every rank, exact resume, a peer killed
mid-sync (nothing written), the non-finite guard, clear refusals, and the default bit-identical to
the commit before the option existed.
"""
from __future__ import annotations

import copy
import functools
import os
import signal

import numpy as np
import pytest
import torch
import torch.distributed as dist

import flodl_opt as flo
from adam_toy import adamw_option_off_runs
from adam_toy import flat as _flat, model as _model, moments as _moments, train as _train
from dist_harness import (assert_option_off_identical, gather_object, run_with_base,
                          survivor_verdict, sync_error_verdict)

BASE_COMMIT = "69c32cb"   # the last commit without sync_moments
B1, B2 = 0.9, 0.95


def _build(model, **kw):
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(B1, B2), weight_decay=0.01)
    return inner, flo.LocalSGDOptimizer(inner, model=model, stall_warning_s=None, **kw)


# ------------------------------------------------------------------ rank functions
def _reference_run(rank, world):
    """Two syncs after unequal work: every rank's moments before, the shared ones after."""
    model = _model()
    inner, opt = _build(model, sync_every=10 ** 9, sync_moments=True)
    return _two_shares(rank, model, inner, opt)


def _two_shares(rank, model, inner, opt):
    """Two syncs after unequal work (5/3/4 then 2/6/4 steps): each rank's moments before, the shared
    ones, the bytes, collectives and weights after."""
    rounds = []
    for steps in ((5, 3, 4), (2, 6, 4)):
        _train(model, opt, rank, steps[rank], start=10 * len(rounds))
        pre = gather_object((_moments(inner, model), steps[rank]))
        stats = opt.sync()
        rounds.append({"pre": pre, "post": _moments(inner, model), "bytes": stats.bytes,
                       "collectives": stats.collectives, "params": _flat(model)})
    return rounds


def _one_step_run(rank, world):
    """From shared moments, one step each: the gradients the ranks stepped on, and the result."""
    model = _model()
    inner, opt = _build(model, sync_every=10 ** 9, sync_moments=True)
    _train(model, opt, rank, 4)
    opt.sync()
    m0, v0 = _moments(inner, model)
    grads = []
    inner.register_step_pre_hook(lambda o, a, k: grads.append(
        torch.cat([p.grad.reshape(-1).double() for p in model.parameters()]).numpy()))
    _train(model, opt, rank, 1, start=4)
    opt.sync()
    return {"m0": m0, "v0": v0, "grads": gather_object(grads[0]), "post": _moments(inner, model)}


def _resume_run(rank, world):
    """Seven steps, a checkpoint, five more; against a fresh optimizer loaded from it."""
    model = _model()
    inner, opt = _build(model, sync_every=3, sync_moments=True)
    _train(model, opt, rank, 7)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    _train(model, opt, rank, 5, start=7)
    straight = (_flat(model), *_moments(inner, model))
    model2 = _model(seed=1)
    inner2, opt2 = _build(model2, sync_every=3, sync_moments=True)
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    _train(model2, opt2, rank, 5, start=7)
    resumed = (_flat(model2), *_moments(inner2, model2))
    return {"straight": straight, "resumed": resumed, "config": saved[1]["flodl_opt"]["config"]["sync_moments"]}


def _nonfinite_run(rank, world):
    """Rank 1's params go NaN before the sync: it gets no vote, the others share their moments."""
    model = _model()
    inner, opt = _build(model, sync_every=10 ** 9, sync_moments=True)
    _train(model, opt, rank, 3)
    if rank == 1:
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("nan")
    pre = gather_object((_moments(inner, model), 0 if rank == 1 else 3))   # the NaN rank: no vote
    with pytest.warns(flo.NonFiniteWarning) if rank == 1 else _nullcontext():
        opt.sync()
    return {"params": _flat(model), "moments": _moments(inner, model), "pre": pre}


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _defaults_run(rank, world, base_dir):
    """The default, sync_moments=False and the base commit's optimizer: the same bits."""
    return adamw_option_off_runs(rank, base_dir, "sync_moments", diloco_lr=0.85)


def _join_run(rank, world):
    """Uneven data: ranks run out after 9, 14 and 5 steps; join() ends them on one consensus."""
    model = _model()
    inner, opt = _build(model, sync_every=4, sync_moments=True)
    with opt.join():
        _train(model, opt, rank, (9, 14, 5)[rank])
    return {"params": _flat(model), "moments": _moments(inner, model), "steps": opt.local_steps}


def _every_run(rank, world):
    """``sync_moments_every=2``: a plain sync keeps each rank's moments; the next one shares them over
    both windows' work. Also a checkpoint taken between the two, resumed."""
    model = _model()
    inner, opt = _build(model, sync_every=10 ** 9, sync_moments=True, sync_moments_every=2)
    _train(model, opt, rank, (5, 3, 4)[rank])
    own = _moments(inner, model)
    plain = opt.sync()
    after_plain = _moments(inner, model)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    _train(model, opt, rank, (2, 6, 4)[rank], start=10)
    pre = gather_object((_moments(inner, model), (7, 9, 8)[rank]))   # the work since the shared start
    share = opt.sync()
    post = _moments(inner, model)
    model2 = _model(seed=1)
    inner2, opt2 = _build(model2, sync_every=10 ** 9, sync_moments=True, sync_moments_every=2)
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    _train(model2, opt2, rank, (2, 6, 4)[rank], start=10)
    opt2.sync()
    return {"own": own, "after_plain": after_plain, "pre": pre, "post": post,
            "bytes": (plain.bytes, share.bytes), "collectives": (plain.collectives, share.collectives),
            "resumed": (_flat(model2), *_moments(inner2, model2)), "straight_params": _flat(model),
            "config": saved[1]["flodl_opt"]["config"]["sync_moments_every"]}


def _bf16_run(rank, world):
    """``sync_moments_wire="bf16"``: two shares after unequal work (as ``_reference_run``), then a
    checkpoint, three more steps and a share, against a fresh optimizer resumed from it."""
    model = _model()
    kw = dict(sync_every=10 ** 9, sync_moments=True, sync_moments_wire="bf16")
    inner, opt = _build(model, **kw)
    rounds = _two_shares(rank, model, inner, opt)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    _train(model, opt, rank, 3, start=30)
    opt.sync()
    model2 = _model(seed=1)
    inner2, opt2 = _build(model2, **kw)
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    _train(model2, opt2, rank, 3, start=30)
    opt2.sync()
    return {"rounds": rounds, "config": saved[1]["flodl_opt"]["config"]["sync_moments_wire"],
            "straight": (_flat(model), *_moments(inner, model)),
            "resumed": (_flat(model2), *_moments(inner2, model2))}


def _all(rank, world, base_dir):
    return {"bf16": _bf16_run(rank, world), "every": _every_run(rank, world), "join": _join_run(rank, world),
            "reference": _reference_run(rank, world), "one_step": _one_step_run(rank, world),
            "resume": _resume_run(rank, world), "nonfinite": _nonfinite_run(rank, world),
            "defaults": _defaults_run(rank, world, base_dir)}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return run_with_base(_all, 3, tmp_path_factory.mktemp("base"), BASE_COMMIT)


# ------------------------------------------------------------------ the float64 references
def _formula(pre):
    """flodl_opt/hooks/moments.py's shared (m, v), in float64, from [((m_i, v_i), n_i)] of every rank."""
    n = np.array([s for _, s in pre], dtype=np.float64)
    w = n / n.sum()
    m = np.stack([mv[0] for mv, _ in pre])
    v = np.stack([mv[1] for mv, _ in pre])
    mbar, vbar = w @ m, w @ v
    w2, window = float((w * w).sum()), float(w @ n)
    var = (w[:, None] * (m - mbar) ** 2).sum(0) / (1 - w2)
    noise = var * (1 + B1) / ((1 - B1) * (1 - B1 ** (2 * window)))
    return mbar, np.maximum(vbar - (1 - B2 ** window) * (1 - w2) * noise, w2 * vbar)


def test_shared_moments_follow_the_formula_in_float64_with_unequal_work(shared):
    res, _ = shared
    for i in range(2):
        m_ref, v_ref = _formula(res[0]["reference"][i]["pre"])
        for r in res:
            m, v = r["reference"][i]["post"]
            np.testing.assert_allclose(m, m_ref, rtol=1e-5, atol=1e-7 * np.abs(m_ref).max())
            np.testing.assert_allclose(v, v_ref, rtol=1e-5, atol=1e-6 * np.abs(v_ref).max())
        # the noise term is not negligible here: plain averaging of v is far from the result
        vbar = np.mean([mv[1] for mv, _ in res[0]["reference"][i]["pre"]], axis=0)
        assert np.abs(vbar - v_ref).max() > 100 * 1e-6 * np.abs(v_ref).max()
    for i in range(2):   # identical on every rank, bit for bit
        for r in res[1:]:
            assert all(np.array_equal(a, b) for a, b in zip(r["reference"][i]["post"], res[0]["reference"][i]["post"]))
    n = sum(p.numel() for p in _model().parameters())
    stats = res[0]["reference"][0]
    assert stats["bytes"] >= (3 * n + 3) * 4 + n * 4 and stats["collectives"] >= 2


def test_after_one_step_from_shared_moments_they_are_those_of_the_averaged_gradient(shared):
    res, _ = shared
    a = res[0]["one_step"]
    for r in res[1:]:   # the start was shared
        assert np.array_equal(r["one_step"]["m0"], a["m0"]) and np.array_equal(r["one_step"]["v0"], a["v0"])
    gbar = np.mean(a["grads"], axis=0)
    m_ref = B1 * a["m0"] + (1 - B1) * gbar          # AdamW on the mean gradient: gradient all-reduce
    v_ref = B2 * a["v0"] + (1 - B2) * gbar ** 2
    for r in res:
        m, v = r["one_step"]["post"]
        np.testing.assert_allclose(m, m_ref, rtol=1e-5, atol=1e-7 * np.abs(m_ref).max())
        np.testing.assert_allclose(v, v_ref, rtol=1e-5, atol=1e-6 * np.abs(v_ref).max())
    v_avg = B2 * a["v0"] + (1 - B2) * np.mean(np.square(a["grads"]), axis=0)   # what averaging v gives
    assert np.abs(v_avg - v_ref).max() > 100 * 1e-6 * np.abs(v_ref).max()


def test_resume_is_bit_exact(shared):
    res, _ = shared
    for r in res:
        assert r["resume"]["config"] is True
        assert all(np.array_equal(a, b) for a, b in zip(r["resume"]["straight"], r["resume"]["resumed"]))
    assert all(np.array_equal(a, b) for a, b in zip(res[0]["resume"]["straight"], res[2]["resume"]["straight"]))


def test_every_second_sync_shares_over_both_windows_and_resumes_between_them(shared):
    res, _ = shared
    m_ref, v_ref = _formula(res[0]["every"]["pre"])   # window and weights: 7, 9 and 8 steps
    n = sum(p.numel() for p in _model().parameters())
    for r in res:
        e = r["every"]
        assert all(np.array_equal(a, b) for a, b in zip(e["own"], e["after_plain"]))   # the plain sync kept them
        m, v = e["post"]
        np.testing.assert_allclose(m, m_ref, rtol=1e-5, atol=1e-7 * np.abs(m_ref).max())
        np.testing.assert_allclose(v, v_ref, rtol=1e-5, atol=1e-6 * np.abs(v_ref).max())
        assert all(np.array_equal(a, b) for a, b in zip(e["post"], res[0]["every"]["post"]))
        assert e["bytes"][1] - e["bytes"][0] == (3 * n + 3) * 4 and e["collectives"][1] == e["collectives"][0] + 1
        assert e["config"] == 2
        assert all(np.array_equal(a, b) for a, b in zip(e["resumed"], (e["straight_params"], *e["post"])))
    # the moments did differ before the share, and the window counts both syncs: 4 and 5 steps give another v
    assert not np.array_equal(res[0]["every"]["own"][0], res[1]["every"]["own"][0])
    _, v_short = _formula([(mv, s - (5, 3, 4)[i]) for i, (mv, s) in enumerate(res[0]["every"]["pre"])])
    assert np.abs(v_short - v_ref).max() > 100 * 1e-6 * np.abs(v_ref).max()


def test_bf16_moment_wire_stays_within_its_rounding_of_the_float64_formula_and_resumes(shared):
    """Each rank's share and the owner's float32 sum are rounded to bf16 once each (u = 2^-8), so
    ``|m - m_ref| <= u (sum w_i |m_i| + |m_ref|)``; ``v``'s error follows through the formula's
    ``m^2 - m_bar^2`` (both inputs off by at most their own rounding)."""
    res, _ = shared
    u = 2.0 ** -8 * 1.001   # one bf16 rounding each, plus float32's in the sums and the division
    n = sum(p.numel() for p in _model().parameters())
    for i in range(2):
        pre = res[0]["bf16"]["rounds"][i]["pre"]
        m_ref, v_ref = _formula(pre)
        steps = np.array([s for _, s in pre], dtype=np.float64)
        w = steps / steps.sum()
        ms = np.stack([mv[0] for mv, _ in pre])
        vs = np.stack([mv[1] for mv, _ in pre])
        vbar, m2bar = w @ vs, w @ ms ** 2
        w2, window = float((w * w).sum()), float(w @ steps)
        c = (1 - B2 ** window) * (1 + B1) / ((1 - B1) * (1 - B1 ** (2 * window)))   # v = vbar - c (m2bar - m^2)
        bm = u * (w @ np.abs(ms) + np.abs(m_ref))
        bv = 2 * u * vbar + c * (2 * u * m2bar + 2 * np.abs(m_ref) * bm + bm ** 2)
        for r in res:
            m, v = r["bf16"]["rounds"][i]["post"]
            assert (np.abs(m - m_ref) <= bm).all() and (np.abs(v - v_ref) <= bv).all()
            assert all(np.array_equal(a, b) for a, b in zip(r["bf16"]["rounds"][i]["post"],
                                                            res[0]["bf16"]["rounds"][i]["post"]))
            assert np.array_equal(r["bf16"]["rounds"][i]["params"], res[0]["bf16"]["rounds"][i]["params"])
        # the narrowing is there: far from float32's agreement with the formula (1e-5 above)
        m, v = res[0]["bf16"]["rounds"][i]["post"]
        assert np.abs(m - m_ref).max() > 1e-4 * np.abs(m_ref).max()
        assert np.abs(v - v_ref).max() > 1e-4 * np.abs(v_ref).max()
    # bytes: the params' float32 sync plus 3 sections of bf16 (padded to 64 elements) and 3 float32 scalars
    c = max(64, -(-3 * n // (3 * 64)) * 64)
    fp32 = res[0]["reference"][0]
    b = res[0]["bf16"]["rounds"][0]
    assert b["bytes"] - (fp32["bytes"] - (3 * n + 3) * 4) == 3 * 2 * c + 12
    assert b["collectives"] == fp32["collectives"] + 2   # scalars, all_to_all, all_gather against one SUM
    for r in res:
        assert r["bf16"]["config"] == "bf16"
        assert all(np.array_equal(a, b) for a, b in zip(r["bf16"]["straight"], r["bf16"]["resumed"]))


def test_nonfinite_rank_gets_no_vote_and_the_others_share_their_moments(shared):
    res, _ = shared
    a, b, c = (r["nonfinite"] for r in res)
    assert np.isfinite(a["params"]).all() and np.array_equal(a["params"], b["params"])
    pre = [x for x in a["pre"] if x[1] > 0]   # ranks 0 and 2, equal work
    m_ref, v_ref = _formula(pre)
    for r in (a, b, c):   # the NaN rank's moments were finite: it adopts the shared ones, like the params
        np.testing.assert_allclose(r["moments"][0], m_ref, rtol=1e-5, atol=1e-7 * np.abs(m_ref).max())
        np.testing.assert_allclose(r["moments"][1], v_ref, rtol=1e-5, atol=1e-6 * np.abs(v_ref).max())
    assert all(np.array_equal(x, y) for r in (b, c) for x, y in zip(a["moments"], r["moments"]))


def test_join_with_uneven_data_ends_with_identical_params_and_moments(shared):
    res, _ = shared
    assert [r["join"]["steps"] for r in res] == [9, 14, 5]
    for r in res[1:]:
        assert np.array_equal(r["join"]["params"], res[0]["join"]["params"])
        assert all(np.array_equal(x, y) for x, y in zip(r["join"]["moments"], res[0]["join"]["moments"]))
    assert all(np.isfinite(x).all() for x in res[0]["join"]["moments"])


def test_default_is_bit_identical_to_the_commit_before_the_option(shared):
    res, base = shared
    assert_option_off_identical(res, base)
    assert not all(np.array_equal(x, y) for x, y in zip(res[0]["defaults"][("default", None)][1:],
                                                         res[1]["defaults"][("default", None)][1:])), \
        "without the option each rank keeps its own moments"
    if base is None:
        pytest.skip(f"git has no commit {BASE_COMMIT}: compared the default with sync_moments=False only")


# ------------------------------------------------------------------ a peer dies mid-sync
def _peer_dies(at_call, wire, fn, rank, world, out):
    model = _model()
    inner, opt = _build(model, sync_every=4, sync_moments=True, sync_moments_wire=wire)
    _train(model, opt, rank, 3)
    if rank == 1:   # all_reduce: call 1 is the moments' SUM (bf16: their scalars), call 2 the consensus's count
        real, calls = getattr(dist, fn), []

        def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) == at_call:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        setattr(dist, fn, dying)
    pre = (_flat(model), *_moments(inner, model))
    state = {}

    def step_and_keep():
        # the sync is at step 4: the inner step runs first, so keep what it left
        inner.register_step_post_hook(lambda o, a, k: state.setdefault(
            "after_step", (_flat(model), *_moments(inner, model))))
        _train(model, opt, rank, 1, start=3)
    return sync_error_verdict(
        out, step_and_keep,
        lambda exc: {"msg": str(exc), "restored": exc.restored, "syncs": opt.sync_count,
                     "unchanged": all(np.array_equal(x, y) for x, y in
                                      zip(state["after_step"], (_flat(model), *_moments(inner, model)))),
                     "moved": not np.array_equal(pre[0], state["after_step"][0])})


@pytest.mark.parametrize("at_call, wire, fn", [(1, "fp32", "all_reduce"), (2, "fp32", "all_reduce"),
                                               (1, "bf16", "all_to_all_single")],
                         ids=["in-the-moments-reduce", "after-it-in-the-consensus", "in-the-bf16-moments-reduce"])
def test_peer_killed_mid_sync_leaves_params_and_moments_as_they_were(tmp_path, at_call, wire, fn):
    out = str(tmp_path / "rank0.pt")
    r = survivor_verdict(functools.partial(_peer_dies, at_call, wire, fn), out, timeout=60, collective_timeout=15)
    assert r["msg"].startswith("flodl_opt: sync #1 failed on rank 0"), r["msg"]
    assert r["restored"] and r["unchanged"] and r["moved"], {k: v for k, v in r.items() if k != "msg"}
    assert r["syncs"] == 0


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("make, kw, says", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), {}, "use torch.optim.Adam or AdamW"),
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), {}, "amsgrad=False"),
    (lambda ps: torch.optim.AdamW(ps), {"fragments": 2, "sync_every": 4}, "fragments/overlap_steps"),
    (lambda ps: torch.optim.AdamW(ps), {"overlap_steps": 1, "sync_every": 4}, "fragments/overlap_steps"),
])
def test_refused_combinations_say_what_to_change(make, kw, says):
    model = _model()
    with pytest.raises(flo.ConfigError, match=says.replace("(", r"\(").replace("/", "/")):
        flo.LocalSGDOptimizer(make(model.parameters()), model=model, sync_moments=True, **kw)
    with pytest.raises(flo.ConfigError, match="True or False"):
        flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model, sync_moments=1)
    for every in (0, 1.5, True):
        with pytest.raises(flo.ConfigError, match="int >= 1"):
            flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model, sync_moments=True,
                                  sync_moments_every=every)
    with pytest.raises(flo.ConfigError, match="pass sync_moments=True"):
        flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model, sync_moments_every=2)
    with pytest.raises(flo.ConfigError, match="pass sync_moments=True"):
        flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model, sync_moments_wire="bf16")
    for wire in ("fp16", "int8", None, "BF 16"):
        with pytest.raises(flo.ConfigError, match="'fp32' or 'bf16'"):
            flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model, sync_moments=True,
                                  sync_moments_wire=wire)
