"""``denoise_moments=True``: each rank's own Adam/AdamW second moment, its small-batch noise excess
taken out at every step, on real Gloo ranks.

Every step is checked against Adam's update written here in float64 (AdamW, Adam with L2 weight
decay, ``maximize``, clipping), with the correction of flodl_opt/hooks/moments.py applied to the second
moment after the update. Also: the clamp (``v`` never below ``b2 v``), identical ranks after a sync,
exact resume, every sync mode (fragments and overlap, a compressed wire, DiLoCo), ranks that disagree
get a clear error, clear refusals, and the default bit-identical to the commit before the option.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import flodl_opt as flo
from adam_toy import adamw_option_off_runs
from adam_toy import backward as _backward, flat as _flat, model as _model, moments as _moments, train as _train
from adam_toy import recorded_steps as _recorded_steps, vec as _vec
from dist_harness import assert_default_identical, run_ranks, run_with_base

BASE_COMMIT = "1069516"   # the last commit without denoise_moments
B1, B2, LR, EPS = 0.9, 0.95, 1e-2, 1e-8
WORLD = 3


INNERS = {   # name: (builder, weight decay, decoupled, maximize, max_grad_norm)
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=0.1), 0.1, True, False, None),
    "adam-l2": (lambda ps: torch.optim.Adam(ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=0.1), 0.1, False, False, None),
    "adamw-maximize": (lambda ps: torch.optim.AdamW(ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=0.1,
                                                    maximize=True), 0.1, True, True, None),
    "adamw-clipped": (lambda ps: torch.optim.AdamW(ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=0.1),
                      0.1, True, False, 0.05),
}


# ------------------------------------------------------------------ rank functions
def _reference_run(rank, world, name):
    """Five local steps: the state before each (params, gradients, moments) and after it."""
    model = _model()
    build, _, _, _, clip = INNERS[name]
    inner = build(model.parameters())
    opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=10 ** 9, max_grad_norm=clip,
                                stall_warning_s=None, denoise_moments=True)
    return _recorded_steps(model, inner, opt, rank, 5)


def _closure_run(rank, world):
    """step(closure): the closure's loss comes back and the step is the one without it."""
    out = []
    for use_closure in (False, True):
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=LR, betas=(B1, B2))
        opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=10 ** 9, stall_warning_s=None,
                                    denoise_moments=True)
        losses = []
        for t in range(1, 5):
            opt.zero_grad()
            if use_closure:
                def closure(t=t):
                    opt.zero_grad()
                    return _backward(model, rank, t)
                losses.append(float(opt.step(closure)))
            else:
                losses.append(float(_backward(model, rank, t)))
                opt.step()
        out.append((losses, _flat(model), *_moments(inner, model)))
    return out


def _resume_run(rank, world):
    """Seven steps, a checkpoint, five more; against a fresh optimizer loaded from it."""
    def build(seed):
        model = _model(seed)
        inner = torch.optim.AdamW(model.parameters(), lr=LR, betas=(B1, B2), weight_decay=0.01)
        return model, inner, flo.LocalSGDOptimizer(inner, model=model, sync_every=3, max_grad_norm=1.0,
                                                   stall_warning_s=None, denoise_moments=True)
    model, inner, opt = build(0)
    _train(model, opt, rank, 6)
    after_sync = _flat(model)
    _train(model, opt, rank, 1, start=6)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    _train(model, opt, rank, 5, start=7)
    straight = (_flat(model), *_moments(inner, model))
    model2, inner2, opt2 = build(1)
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    _train(model2, opt2, rank, 5, start=7)
    resumed = (_flat(model2), *_moments(inner2, model2))
    plain = _model(1)   # the checkpoint into an optimizer built without the option: refused
    plain_opt = flo.LocalSGDOptimizer(torch.optim.AdamW(plain.parameters()), model=plain, sync_every=3,
                                      max_grad_norm=1.0, stall_warning_s=None)
    try:
        plain_opt.load_state_dict(saved[1])
        refusal = None
    except flo.ConfigError as exc:
        refusal = str(exc)
    return {"straight": straight, "resumed": resumed, "after_sync": after_sync, "refusal": refusal,
            "config": saved[1]["flodl_opt"]["config"]["denoise_moments"]}


SYNC_MODES = {
    "fragments-overlap": {"sync_every": 4, "fragments": 2, "overlap_steps": 1},
    "wire-bf16": {"sync_every": 4, "wire": "bf16", "error_feedback": True},
    "diloco": {"sync_every": 4, "outer": "diloco"},
    "warmup": {"sync_every": 4, "warmup_steps": 3},
}


def _modes_run(rank, world):
    """Each sync mode with and without the option: identical ranks after the last sync."""
    out = {}
    for mode, kw in SYNC_MODES.items():
        for on in (False, True):
            model = _model()
            inner = torch.optim.AdamW(model.parameters(), lr=LR, betas=(B1, B2))
            opt = flo.LocalSGDOptimizer(inner, model=model, stall_warning_s=None, denoise_moments=on, **kw)
            _train(model, opt, rank, 10)
            opt.sync()
            out[(mode, on)] = (_flat(model), *_moments(inner, model))
    return out


def _defaults_run(rank, world, base_dir):
    """The default, denoise_moments=False and the base commit's optimizer: the same bits."""
    return adamw_option_off_runs(rank, base_dir, "denoise_moments", diloco_lr=0.7)


def _all(rank, world, base_dir):
    return {"reference": {n: _reference_run(rank, world, n) for n in INNERS},
            "closure": _closure_run(rank, world), "resume": _resume_run(rank, world),
            "modes": _modes_run(rank, world), "defaults": _defaults_run(rank, world, base_dir)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_with_base(_all, WORLD, tmp_path_factory.mktemp("base"), BASE_COMMIT)


# ------------------------------------------------------------------ the float64 reference
def _adam_step(pre, t, name):
    """Adam/AdamW's step in float64 from the state before it, then the correction of moments.py."""
    _, wd, decoupled, maximize, clip = INNERS[name]
    p, g = pre["p"].copy(), pre["g"].copy()
    if clip is not None:
        g *= min(1.0, clip / (np.sqrt((g * g).sum()) + 1e-6))
    g = -g if maximize else g
    if decoupled:
        p *= 1 - LR * wd
    else:
        g = g + wd * pre["p"]
    m0, v0 = (pre["m"], pre["v"]) if t > 1 else (np.zeros_like(p), np.zeros_like(p))
    m = B1 * m0 + (1 - B1) * g
    v = B2 * v0 + (1 - B2) * g * g
    p = p - LR / (1 - B1 ** t) * m / (np.sqrt(v / (1 - B2 ** t)) + EPS)
    c = (1 - 1 / WORLD) * (1 + B1) / 2
    # the update used Adam's own v; the correction lands in v after it (none at the first step:
    # there is no first moment to measure the noise against yet)
    if t == 1:
        return p, m, v, v, np.zeros(p.shape, bool)
    raw = c * (g - m0) ** 2
    return p, m, v - np.minimum(raw, g * g) * (1 - B2), v, raw > g * g


@pytest.mark.parametrize("name", list(INNERS))
def test_every_step_follows_adam_and_the_correction_in_float64(ranks, name):
    res, _ = ranks
    changed = clamped = 0
    for r in res:
        for t, (pre, post) in enumerate(r["reference"][name], start=1):
            p_ref, m_ref, v_ref, v_adam, at_clamp = _adam_step(pre, t, name)
            np.testing.assert_allclose(post["p"], p_ref, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(post["m"], m_ref, rtol=1e-5, atol=1e-7 * np.abs(m_ref).max())
            np.testing.assert_allclose(post["v"], v_ref, rtol=1e-5, atol=1e-6 * np.abs(v_ref).max())
            assert (post["v"] >= B2 * pre.get("v", 0.0) * (1 - 1e-6)).all()   # the clamp: never below b2 v
            if t > 1:   # the correction is far larger than the tolerance, and the clamp is reached
                changed += int(np.abs(v_adam - v_ref).max() > 100 * 1e-6 * np.abs(v_ref).max())
                clamped += int(at_clamp.sum())
    assert changed == WORLD * 4
    assert clamped > 0, "no coordinate reached the clamp: the test data does not exercise it"


def test_after_a_sync_params_are_identical_and_each_rank_keeps_its_own_moments(ranks):
    res, _ = ranks
    for r in res[1:]:
        assert np.array_equal(r["resume"]["after_sync"], res[0]["resume"]["after_sync"])
        assert not np.array_equal(r["reference"]["adamw"][-1][1]["v"], res[0]["reference"]["adamw"][-1][1]["v"])


def test_step_with_a_closure_returns_its_loss_and_takes_the_same_step(ranks):
    res, _ = ranks
    for r in res:
        (l0, *a), (l1, *b) = r["closure"]
        assert l0 == l1
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_resume_is_bit_exact_and_a_plain_optimizer_refuses_the_checkpoint(ranks):
    res, _ = ranks
    for r in res:
        assert r["resume"]["config"] is True
        assert all(np.array_equal(a, b) for a, b in zip(r["resume"]["straight"], r["resume"]["resumed"]))
        assert r["resume"]["refusal"] is not None and "denoise_moments" in r["resume"]["refusal"]


@pytest.mark.parametrize("mode", list(SYNC_MODES))
def test_every_sync_mode_ends_with_identical_ranks_and_the_option_acts(ranks, mode):
    res, _ = ranks
    for on in (False, True):
        for r in res[1:]:
            assert np.array_equal(r["modes"][(mode, on)][0], res[0]["modes"][(mode, on)][0])
        assert all(np.isfinite(x).all() for x in res[0]["modes"][(mode, on)])
    off, on = res[0]["modes"][(mode, False)], res[0]["modes"][(mode, True)]
    assert not np.array_equal(off[0], on[0]) and (on[2] <= off[2] * (1 + 1e-3) + 1e-12).mean() > 0.9


def test_default_is_bit_identical_to_the_commit_before_the_option(ranks):
    assert_default_identical(*ranks, BASE_COMMIT, "denoise_moments")


# ------------------------------------------------------------------ one rank, ranks that disagree
def _one_rank(rank, world, value):
    out = []
    for on in (False, value):
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=LR)
        opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=3, stall_warning_s=None, denoise_moments=on)
        _train(model, opt, rank, 7)
        out.append((_flat(model), *_moments(inner, model), opt.config()["denoise_moments"]))
    return out


@pytest.mark.parametrize("value", [True, "sync"])
def test_a_world_of_one_has_nothing_to_take_out(value):
    """At every step or at the sync (``denoise_moments="sync"``, tests/test_drift_denoise.py)."""
    (off, on), = run_ranks(_one_rank, 1, value, timeout=60)
    assert all(np.array_equal(x, y) for x, y in zip(off[:3], on[:3]))
    assert (off[3], on[3]) == (False, value)


def _disagree(rank, world, on_rank0, elsewhere):
    model = _model()
    try:
        flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model, sync_every=3,
                              stall_warning_s=None, **(on_rank0 if rank == 0 else elsewhere))
    except flo.ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("on_rank0, elsewhere, key", [
    ({"denoise_moments": True}, {}, "denoise_moments"),
    ({"denoise_moments": "sync"}, {"denoise_moments": True}, "denoise_moments"),
    ({"sync_moments": True, "sync_moments_every": 2}, {"sync_moments": True}, "sync_moments_every"),
    ({"sync_moments": True, "sync_moments_wire": "bf16"}, {"sync_moments": True}, "sync_moments_wire"),
])
def test_ranks_that_disagree_on_the_option_all_get_a_clear_error(on_rank0, elsewhere, key):
    msgs = run_ranks(_disagree, 2, on_rank0, elsewhere, timeout=60)
    assert all(m is not None and key in m for m in msgs), msgs


@pytest.mark.parametrize("make, kw, says", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), {}, "denoise_moments=True works on Adam/AdamW moments"),
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), {}, "amsgrad=False"),
    (lambda ps: torch.optim.AdamW(ps), {"sync_moments": True}, "pick one"),
])
def test_refused_combinations_say_what_to_change(make, kw, says):
    model = _model()
    with pytest.raises(flo.ConfigError, match=says.replace("(", r"\(")):
        flo.LocalSGDOptimizer(make(model.parameters()), model=model, denoise_moments=True, **kw)
    with pytest.raises(flo.ConfigError, match=r"False, True \(at every step\) or 'sync'"):
        flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model, denoise_moments=1)
