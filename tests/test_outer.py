"""Outer optimizers over several syncs on 2 Gloo ranks, against hand-written float64 references."""
import copy
import functools

import numpy as np
import pytest
import torch
from torch import nn

import flodl_opt as flo
from dist_harness import gather_object, run_ranks

DIM = 257
INNER_LR = 0.1
STEPS = [(3, 3), (2, 5), (4, 1), (0, 3), (3, 2)]  # n_i per window, per rank (one idle rank too)


def _centers(world):
    g = torch.Generator().manual_seed(42)
    return [torch.randn(DIM, generator=g, dtype=torch.float64) * (r + 1) for r in range(world)]


def _make(outer, dtype=torch.float64, inner="sgd"):
    torch.manual_seed(1)
    p = nn.Parameter(torch.randn(DIM, dtype=dtype))
    inner_opt = (torch.optim.SGD([p], lr=INNER_LR) if inner == "sgd"
                 else torch.optim.Adam([p], lr=INNER_LR))
    return p, flo.LocalSGDOptimizer(inner_opt, sync_every=10**9, outer=outer)


def _local_steps(p, opt, center, n):
    for _ in range(n):
        opt.zero_grad()
        (0.5 * (p - center.to(p.dtype)).pow(2).sum()).backward()
        opt.step()


def _reference_step(name, cfg, pre, steps, anchor, mom, rank, window=0):
    """One outer step in float64, written from the papers' update rules."""
    mass = np.array([float(n) for n in steps])
    w = mass / mass.sum()
    C = sum(w[r] * pre[r] for r in range(len(pre)))
    if name == "avg":
        return C, C, mom
    if name == "diloco":
        k = window + 1                               # outer steps are 1-based
        t = min(1.0, (k - 1) / cfg["warmup"]) if cfg["warmup"] else 1.0
        lr, mu = 1.0 + t * (cfg["lr"] - 1.0), t * cfg["momentum"]   # warm-up from plain averaging
        d = anchor - C                               # pseudo-gradient: anchor minus consensus
        mom = mu * mom + d
        step = d + mu * mom if cfg["nesterov"] else mom
        W = anchor - lr * step
        return W, W, mom
    if name == "slowmo":
        mom = cfg["momentum"] * mom + (anchor - C) / INNER_LR
        W = anchor - cfg["lr"] * INNER_LR * mom
        return W, W, mom
    if name == "easgd":
        W = pre[rank] + cfg["alpha"] * (C - pre[rank])
        return W, anchor, mom
    raise ValueError(name)


CASES = {
    "avg": (lambda: "avg", {}),
    # the defaults (changed: momentum 0.9 -> 0.5, warm-up of 8 outer steps from plain averaging)
    "diloco": (lambda: flo.DiLoCo(), dict(lr=1.0, momentum=0.5, nesterov=True, warmup=8)),
    "diloco_paper": (lambda: flo.DiLoCo(lr=0.7, momentum=0.9, warmup=0),
                     dict(lr=0.7, momentum=0.9, nesterov=True, warmup=0)),
    "diloco_warmup2": (lambda: flo.DiLoCo(lr=0.6, momentum=0.9, warmup=2),   # reaches (lr, mu) at step 3
                       dict(lr=0.6, momentum=0.9, nesterov=True, warmup=2)),
    "diloco_plain_momentum": (lambda: flo.DiLoCo(lr=0.5, momentum=0.8, nesterov=False, warmup=0),
                              dict(lr=0.5, momentum=0.8, nesterov=False, warmup=0)),
    "slowmo": (lambda: flo.SlowMo(lr=1.0, momentum=0.5), dict(lr=1.0, momentum=0.5)),
    "easgd": (lambda: flo.EASGD(alpha=0.3), dict(alpha=0.3)),
}


def rank_outer_reference(rank, world, case, table=STEPS, cfg=None):
    make, case_cfg = CASES[case]
    cfg = cfg or case_cfg
    name = case.split("_")[0]
    p, opt = _make(make())
    if name == "diloco":
        assert opt.outer.lr == cfg["lr"] and opt.outer.config()["lr"] == cfg["lr"]
    centers = _centers(world)
    anchor = p.detach().double().numpy().copy()      # the broadcast start is the first anchor
    mom = np.zeros(DIM)
    for window, steps in enumerate(table):
        _local_steps(p, opt, centers[rank], steps[rank])
        pre = gather_object(p.detach().double().numpy().copy())
        want, anchor, mom = _reference_step(name, cfg, pre, steps, anchor, mom, rank, window)
        stats = opt.sync()
        np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-12, atol=1e-12,
                                   err_msg=f"{case}: window {window}")
        assert stats.outer == (None if name == "avg" else name)
    finals = gather_object(p.detach().clone())
    return all(torch.equal(finals[0], f) for f in finals[1:])


@pytest.mark.parametrize("case", sorted(CASES))
def test_outer_matches_float64_reference_over_syncs(case):
    identical = run_ranks(rank_outer_reference, 2, case, timeout=60)
    # replicated outers keep ranks identical; EASGD keeps each rank's drift by design
    assert identical == [case != "easgd"] * 2


STEPS_4 = [(3, 3, 1, 2), (2, 5, 0, 4), (4, 1, 3, 3), (0, 3, 2, 1), (3, 2, 5, 1)]


@pytest.mark.parametrize("world", [3, 4])
def test_default_diloco_outer_lr_follows_the_number_of_ranks(world):
    """``DiLoCo()`` resolves its outer lr from the group size at setup: 1.0 from 2 ranks (2: the case
    above), where the value before setup is the one-rank 0.7."""
    cfg = CASES["diloco"][1]
    assert run_ranks(rank_outer_reference, world, "diloco", [s[:world] for s in STEPS_4], cfg,
                     timeout=90) == [True] * world


def test_default_outer_lr_table_and_explicit_lr_wins():
    assert [flo.DiLoCo.default_lr(m) for m in (1, 2, 3, 4, 8, 64)] == [0.7, 1.0, 1.0, 1.0, 1.0, 1.0]
    d = flo.DiLoCo()
    assert d.lr == 0.7 and d.lr_by_ranks            # before setup: the one-rank value
    explicit = flo.DiLoCo(lr=0.7)
    explicit.setup([], world_size=4)
    assert explicit.lr == 0.7 and not explicit.lr_by_ranks
    d.setup([], world_size=4)
    assert d.lr == 1.0 and d.coefficients(9) == (1.0, 0.5)
    with pytest.raises(flo.ConfigError, match="world_size"):
        flo.DiLoCo.default_lr(0)


def rank_pseudo_gradient_sign(rank, world):
    """All ranks move +1 per step; DiLoCo must move the params further along +, not back."""
    p, opt = _make(flo.DiLoCo(lr=0.7, momentum=0.0, warmup=0))   # no warm-up: step 1 is not the average
    start = p.detach().clone()
    for _ in range(4):
        opt.zero_grad()
        p.grad = -torch.ones_like(p) / INNER_LR      # one SGD step = +1 on every coordinate
        opt.step()
    consensus_shift = 4.0                             # every rank moved +4
    opt.sync()
    moved = (p.detach() - start)
    # W = A - 0.7 * (A - C) = A + 0.7 * 4: along the ranks' direction (a flipped sign gives -2.8)
    torch.testing.assert_close(moved, torch.full_like(moved, 0.7 * consensus_shift), rtol=1e-12, atol=1e-12)
    return True


def test_pseudo_gradient_sign_moves_with_the_ranks():
    run_ranks(rank_pseudo_gradient_sign, 2)


def _trajectory(rank, world, outer, inner="sgd", windows=4):
    p, opt = _make(outer, inner=inner)
    centers = _centers(world)
    out = []
    for window in range(windows):
        _local_steps(p, opt, centers[rank], 3 + window % 2)
        opt.sync()
        out.append(p.detach().clone())
    return out, opt


def rank_equivalences(rank, world):
    avg, _ = _trajectory(rank, world, "avg")
    for outer in (flo.SlowMo(lr=1.0, momentum=0.0), flo.DiLoCo(lr=1.0, momentum=0.0)):
        got, _ = _trajectory(rank, world, outer)
        for a, b in zip(avg, got):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{outer!r} != plain averaging")
    diloco, _ = _trajectory(rank, world, flo.DiLoCo(lr=0.7, momentum=0.9, warmup=0))
    torch_outer = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    custom, _ = _trajectory(rank, world, torch_outer)
    for a, b in zip(diloco, custom):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg="torch SGD outer != flo.DiLoCo")
    # and they really differ from plain averaging (or the comparison above proves nothing)
    assert not torch.allclose(diloco[-1], avg[-1])
    return True


def test_outer_equivalences():
    run_ranks(rank_equivalences, 2, timeout=60)


def rank_reset_inner(rank, world):
    _, kept = _trajectory(rank, world, flo.DiLoCo(), inner="adam", windows=2)
    _, reset = _trajectory(rank, world, flo.DiLoCo(reset_inner=True), inner="adam", windows=2)
    return len(kept.optimizer.state), len(reset.optimizer.state)


def test_reset_inner_clears_inner_state_only_when_asked():
    for kept, reset in run_ranks(rank_reset_inner, 2):
        assert kept == 1 and reset == 0


def rank_torch_outer_resume(rank, world, which="torch"):
    def make():
        return (functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True) if which == "torch"
                else flo.DiLoCo(lr=0.6, momentum=0.9, warmup=3))   # resume mid warm-up: steps checkpointed

    def run(cut):
        p, opt = _make(make())
        centers = _centers(world)
        for window in range(4):
            if cut and window == 2:
                sd = copy.deepcopy(opt.state_dict())
                value = p.detach().clone()
                p, opt = _make(make())
                with torch.no_grad():
                    p.copy_(value)
                opt.load_state_dict(sd)
            _local_steps(p, opt, centers[rank], 3)
            opt.sync()
        return p.detach().clone()
    assert torch.equal(run(False), run(True))
    return True


def test_torch_outer_resumes_exactly():
    run_ranks(rank_torch_outer_resume, 2)


def test_diloco_warmup_resumes_exactly():
    run_ranks(rank_torch_outer_resume, 2, "diloco")


def test_outer_arguments_validated():
    with pytest.raises(flo.ConfigError, match="momentum"):
        flo.DiLoCo(momentum=1.5)
    with pytest.raises(flo.ConfigError, match="alpha"):
        flo.EASGD(alpha=0)
    with pytest.raises(flo.ConfigError, match="factory"):
        flo.init()
        p = nn.Parameter(torch.zeros(3))
        flo.LocalSGDOptimizer(torch.optim.SGD([p], lr=0.1), outer=torch.optim.SGD([p], lr=0.1))
    with pytest.raises(flo.ConfigError, match="pre-sync copy"):
        p = nn.Parameter(torch.zeros(3))
        flo.LocalSGDOptimizer(torch.optim.SGD([p], lr=0.1), outer="easgd", keep_presync=False)
