"""The work-weighted consensus against a float64 reference, on real Gloo ranks.

Each case drives every rank to known, rank-specific weights with a known step count ``n_i``, gathers
every rank's pre-sync state (test-side, independent of flodl_opt), calls ``opt.sync()`` and compares
the result with the consensus computed here in float64.
"""
import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import flodl_opt as flo
from dist_harness import gather_object, run_ranks

GAMMAS = (0.0, 0.5, 1.0, 2.0)
# steps per rank: equal work, unequal work, a rank that did none
STEP_CASES = {2: [(3, 3), (1, 4), (0, 5)], 3: [(2, 2, 2), (1, 4, 2), (0, 5, 2)]}


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)


def _train_local(model, opt, rank, steps, seed_base=1000):
    g = torch.Generator().manual_seed(seed_base + rank)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g).to(dtype) * (1 + rank)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


def _state64(model):
    params = [p.detach().double().numpy().copy() for p in model.parameters()]
    bufs = {n: b.detach().double().numpy().copy() for n, b in model.named_buffers()}
    return params, bufs


def _reference(pre, steps, gamma):
    """Float64 consensus: params by n^gamma (idle ranks 0), float buffers equal among movers."""
    mass = np.array([0.0 if n == 0 else float(n) ** gamma for n in steps])
    mover = np.array([1.0 if n > 0 else 0.0 for n in steps])
    w, v = mass / mass.sum(), mover / mover.sum()
    params = [sum(w[r] * pre[r][0][i] for r in range(len(steps))) for i in range(len(pre[0][0]))]
    bufs = {k: sum(v[r] * pre[r][1][k] for r in range(len(steps)))
            for k in pre[0][1] if "num_batches" not in k}
    return params, bufs, w


def rank_consensus_cases(rank, world, dtype_name):
    dtype = getattr(torch, dtype_name)
    checked = 0
    for steps in STEP_CASES[world]:
        for gamma in GAMMAS:
            model = _model(dtype)
            inner = torch.optim.SGD(model.parameters(), lr=0.05)
            opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=10**9, gamma=gamma)
            # the initial broadcast made every rank start equal
            start = gather_object([p.detach().clone() for p in model.parameters()])
            assert all(torch.equal(a, b) for a, b in zip(start[0], start[rank]))
            _train_local(model, opt, rank, steps[rank])
            pre = gather_object(_state64(model))
            local_nbt = model[1].num_batches_tracked.item()
            stats = opt.sync()
            ref_p, ref_b, w = _reference(pre, steps, gamma)
            tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=2 ** -8, atol=1e-6)
            for got, want in zip(model.parameters(), ref_p):
                np.testing.assert_allclose(got.detach().double().numpy(), want, **tol)
            for name, b in model.named_buffers():
                if "num_batches" in name:
                    assert b.item() == local_nbt == steps[rank], "integer buffers must stay local"
                else:
                    np.testing.assert_allclose(b.detach().double().numpy(), ref_b[name], **tol)
            assert stats.weight == pytest.approx(w[rank])
            assert stats.steps == steps[rank] and stats.cohort_steps == sum(steps)
            # params and buffers bit-identical on every rank after the sync
            post = gather_object([t.detach().clone() for t in list(model.parameters()) +
                                  [b for n, b in model.named_buffers() if "num_batches" not in n]])
            assert all(torch.equal(a, b) for a, b in zip(post[0], post[rank]))
            checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 3])
def test_consensus_matches_float64_reference(world):
    counts = run_ranks(rank_consensus_cases, world, "float32", timeout=120)
    assert counts == [len(STEP_CASES[world]) * len(GAMMAS)] * world


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_low_precision_params_reduced_in_float32(dtype_name):
    run_ranks(rank_low_precision, 3, dtype_name, timeout=90)


def rank_low_precision(rank, world, dtype_name):
    """Three ranks whose weighted sum in the narrow dtype itself would be off by several ulps."""
    dtype = getattr(torch, dtype_name)
    p = nn.Parameter(torch.zeros(4096, dtype=dtype))
    opt = flo.LocalSGDOptimizer(torch.optim.SGD([p], lr=1.0), sync_every=10**9)
    g = torch.Generator().manual_seed(7)
    values = [(1 + torch.rand(4096, generator=g, dtype=torch.float64)) for _ in range(world)]
    steps = [1, 2, 4]
    with torch.no_grad():
        p.copy_(values[rank].to(dtype))
    opt._steps_since_sync = steps[rank]  # the count only: weights are n_i / sum n
    opt.sync()
    w = np.array(steps, dtype=np.float64) / sum(steps)
    exact = sum(w[r] * values[r].to(dtype).double().numpy() for r in range(world))
    want = torch.from_numpy(exact).to(dtype)  # float64 consensus, rounded once
    # float32 accumulation rounds once at the end: within one narrow ulp of the exact answer
    ulp = torch.finfo(dtype).eps
    np.testing.assert_allclose(p.detach().double().numpy(), want.double().numpy(), rtol=ulp, atol=0)
    assert p.dtype == dtype


def rank_whole_cohort_idle(rank, world):
    model = _model()
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                sync_every=10**9, outer=flo.EASGD(alpha=0.5))
    _train_local(model, opt, rank, 2)
    opt.sync()  # EASGD leaves ranks different on purpose
    before = [p.detach().clone() for p in model.parameters()]
    stats = opt.sync()  # nobody moved: nothing may change, not even toward each other
    assert stats.skipped and stats.total_mass == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return gather_object(before[0].sum().item())


def test_whole_cohort_idle_changes_nothing():
    sums = run_ranks(rank_whole_cohort_idle, 2)
    assert sums[0][0] != sums[0][1], "EASGD ranks should differ, or the idle check proves nothing"


def rank_mismatched_models(rank, world):
    torch.manual_seed(0)
    width = 5 if rank == 0 else 6
    model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 1))
    try:
        flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    except flo.ConfigError as e:
        return str(e)
    return None


def test_mismatched_models_fail_on_every_rank():
    msgs = run_ranks(rank_mismatched_models, 3, timeout=30)
    for m in msgs:
        assert m is not None and "ranks [1, 2] differ from rank 0" in m and "same model" in m


def rank_mismatched_config(rank, world):
    model = _model()
    try:
        flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                              sync_every=4 + rank)
    except flo.ConfigError as e:
        return str(e)


def test_mismatched_sync_every_fails_on_every_rank():
    for m in run_ranks(rank_mismatched_config, 2, timeout=30):
        assert m is not None and "sync_every" in m


# ---------------------------------------------------------------- world of one: no cost, bit-identical
def _bare_and_wrapped(make_opt, steps=25, clip=0.5):
    torch.manual_seed(3)
    m1 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    m2 = copy.deepcopy(m1)
    o1, o2 = make_opt(m1.parameters()), make_opt(m2.parameters())
    s1 = torch.optim.lr_scheduler.StepLR(o1, step_size=5, gamma=0.7)
    s2 = torch.optim.lr_scheduler.StepLR(o2, step_size=5, gamma=0.7)
    flo.init()
    w = flo.LocalSGDOptimizer(o2, model=m2, sync_every=10**9, max_grad_norm=clip, lr_scheduler=s2)
    g = torch.Generator().manual_seed(11)
    for _ in range(steps):
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g)
        for m, o in ((m1, o1), (m2, w)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
        torch.nn.utils.clip_grad_norm_(list(m1.parameters()), clip)
        o1.step()
        s1.step()
        w.step()
    return m1, m2, w


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_world_of_one_is_bit_identical_to_bare_loop(name):
    m1, m2, w = _bare_and_wrapped(OPTIMIZERS[name])
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert w.local_steps == 25 and w.sync_count == 0
    assert isinstance(w, torch.optim.Optimizer)
    assert w.param_groups is w.optimizer.param_groups


def test_world_of_one_sync_makes_no_collective():
    flo.init()
    assert not dist.is_initialized()
    model = _model()
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=2)
    _train_local(model, opt, 0, 4)
    assert opt.sync_count == 2 and opt.last_sync.collectives == 0 and opt.last_sync.bytes == 0
    assert not dist.is_initialized()


# ---------------------------------------------------------------- exact resume
def _resume_run(rank, total, cut, outer, sync_every=3):
    """Train `total` steps; if `cut`, checkpoint at `cut`, rebuild everything fresh and continue."""
    def build():
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 1.0 / (1 + 0.1 * s))
        opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=sync_every, outer=outer,
                                    max_grad_norm=1.0, lr_scheduler=sched)
        return model, opt

    model, opt = build()
    g = torch.Generator().manual_seed(500 + rank)
    batches = [torch.randn(8, 6, generator=g) for _ in range(total)]
    for i, x in enumerate(batches):
        if cut and i == cut:
            saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
            model, opt = build()
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return [t.detach().clone() for t in model.state_dict().values()], opt.state_dict()["flodl_opt"]["counters"]


def rank_exact_resume(rank, world, outers):
    for outer in outers:
        # cut mid-window (7 % 3 != 0): steps_since_sync must survive the round trip
        ref, ref_counters = _resume_run(rank, 14, None, outer)
        got, got_counters = _resume_run(rank, 14, 7, outer)
        assert ref_counters == got_counters
        for a, b in zip(ref, got):
            assert torch.equal(a, b), f"resume with outer={outer} is not exact"
    return True


OUTER_NAMES = ["avg", "diloco", "slowmo", "easgd"]


def test_exact_resume_world_of_one():
    flo.init()
    rank_exact_resume(0, 1, OUTER_NAMES)


def test_exact_resume_two_ranks_each_outer():
    run_ranks(rank_exact_resume, 2, OUTER_NAMES, timeout=120)


def test_load_state_dict_from_other_model_or_config_fails_clearly():
    flo.init()
    model = _model()
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=4)
    sd = opt.state_dict()
    other = nn.Linear(3, 3)
    opt2 = flo.LocalSGDOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), model=other, sync_every=4)
    with pytest.raises(flo.ConfigError, match="different model"):
        opt2.load_state_dict(sd)
    model3 = _model()
    opt3 = flo.LocalSGDOptimizer(torch.optim.SGD(model3.parameters(), lr=0.1), model=model3, sync_every=8)
    with pytest.raises(flo.ConfigError, match="sync_every"):
        opt3.load_state_dict(sd)
    opt3.load_state_dict(sd, strict=False)  # a deliberate change of K is allowed
    with pytest.raises(flo.ConfigError, match="not saved by"):
        opt3.load_state_dict(torch.optim.SGD(model3.parameters(), lr=0.1).state_dict())


# ---------------------------------------------------------------- warm-up, cadence, bad input
def rank_cadence(rank, world):
    model = _model()
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                sync_every=4, warmup_steps=3)
    syncs = []
    for i in range(11):
        _train_local(model, opt, rank, 1, seed_base=100 * i)
        syncs.append(opt.sync_count)
        if opt.steps_since_sync == 0:
            post = gather_object([p.detach().clone() for p in model.parameters()])
            assert all(torch.equal(a, b) for a, b in zip(post[0], post[rank]))
    return syncs


def test_warmup_then_every_k_steps():
    # steps 1-3 sync every step (warm-up), then after every 4 local steps since the last sync
    want = [1, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5]
    assert run_ranks(rank_cadence, 2) == [want, want]


@pytest.mark.parametrize("kwargs, match", [
    (dict(sync_every=0), "sync_every must be an int >= 1"),
    (dict(sync_every=2.5), "sync_every must be an int >= 1"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(gamma=-0.5), "gamma must be a number >= 0"),
    (dict(max_grad_norm=0), "max_grad_norm"),
    (dict(outer="lookahead"), "unknown outer optimizer 'lookahead'"),
])
def test_bad_arguments_say_what_to_change(kwargs, match):
    flo.init()
    model = _model()
    with pytest.raises(flo.ConfigError, match=match):
        flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, **kwargs)


def test_unknown_keyword_is_rejected():
    flo.init()
    model = _model()
    with pytest.raises(TypeError, match="sync_evry"):
        flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_evry=4)


def test_model_params_missing_from_optimizer():
    flo.init()
    model = _model()
    with pytest.raises(flo.ConfigError, match="not in the optimizer"):
        flo.LocalSGDOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), model=model)


def test_sparse_gradients_rejected():
    flo.init()
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    with pytest.raises(flo.ConfigError, match="sparse=False"):
        flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)


def test_use_before_init_under_a_launcher(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = _model()
    with pytest.raises(RuntimeError, match=r"call flodl_opt.init\(\) on every rank"):
        flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)


def test_torch_distributed_checkpoint_keeps_our_state(tmp_path):
    """dcp.save/dcp.load of {"model", "optim"} round-trips the namespaced flodl_opt entry."""
    import warnings
    import torch.distributed.checkpoint as dcp
    flo.init()

    def build():
        model = _model()
        opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model,
                                    sync_every=3, outer="diloco")
        return model, opt

    model, opt = build()
    _train_local(model, opt, 0, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(tmp_path))
        model2, opt2 = build()
        _train_local(model2, opt2, 1, 1)  # different state, so a no-op load would be caught
        template = {"model": model2.state_dict(), "optim": opt2.state_dict()}
        dcp.load(template, checkpoint_id=str(tmp_path))
    model2.load_state_dict(template["model"])
    opt2.load_state_dict(template["optim"])
    assert opt2.state_dict()["flodl_opt"]["counters"] == opt.state_dict()["flodl_opt"]["counters"]
    assert all(torch.equal(a, b) for a, b in zip(opt.outer.anchor + opt.outer.momentum,
                                                 opt2.outer.anchor + opt2.outer.momentum))
    _train_local(model, opt, 2, 4)
    _train_local(model2, opt2, 2, 4)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_step_hooks_and_a_scheduler_on_the_wrapper_still_work():
    from torch.optim import optimizer as torch_optimizer
    flo.init()
    model = _model()
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=2)
    calls = []
    h1 = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o is opt)))
    h2 = opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o is opt)))
    h3 = torch_optimizer.register_optimizer_step_post_hook(
        lambda o, args, kwargs: calls.append(("global", type(o).__name__)))
    _train_local(model, opt, 0, 1)
    h1.remove(), h2.remove(), h3.remove()
    # the global hook also fires for the inner SGD step, before the wrapper's post hooks
    assert calls == [("pre", True), ("global", "SGD"), ("post", True), ("global", "LocalSGDOptimizer")]
    _train_local(model, opt, 0, 1)
    assert len(calls) == 4  # removed hooks stay removed
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # built on the wrapper
    _train_local(model, opt, 0, 1)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05) and opt.local_steps == 3
