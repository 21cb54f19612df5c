"""Working the way framework users already write code: safetensors saves, GradScaler, DDP detection.

Each test here guards a failure that used to be silent (weights dropped on save, ranks drifting
apart under GradScaler, DDP averaging every step without a word).
"""
import os

import pytest
import torch
from torch import nn

import flodl_opt as flo
from dist_harness import run_ranks

try:
    import safetensors.torch as st
except ImportError:  # an optional test extra
    st = None

needs_safetensors = pytest.mark.skipif(st is None, reason="safetensors is not installed "
                                       "(pip install safetensors; the 'test' extra has it)")


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 3), nn.LayerNorm(3))


def _train(model: nn.Module, opt, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 5, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()


# ---------------------------------------------------------------- safetensors
@needs_safetensors
def test_wrapped_model_saves_and_loads_bit_for_bit_through_safetensors(tmp_path):
    model = _net()
    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, sync_every=2)
    _train(model, opt, 3)
    want = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    assert len(want) == 11  # 8 params, BatchNorm's 2 running stats and its step count

    # save_model refused the packed model outright ("None is covering the entire storage");
    # save_file of the views must write every tensor too.
    st.save_model(model, str(tmp_path / "m.safetensors"))
    st.save_file(model.state_dict(), str(tmp_path / "f.safetensors"))
    for name in ("m.safetensors", "f.safetensors"):
        got = st.load_file(str(tmp_path / name))
        assert sorted(got) == sorted(want), name
        for k, v in want.items():
            assert torch.equal(_bits(got[k]), _bits(v)), (name, k)

    # Load into a fresh wrapped model: the values land in the flat views, so syncs still see them.
    fresh = _net(seed=5)
    opt2 = flo.LocalSGDOptimizer(torch.optim.AdamW(fresh.parameters(), lr=1e-2), model=fresh, sync_every=2)
    missing, unexpected = st.load_model(fresh, str(tmp_path / "m.safetensors"))
    assert not missing and not unexpected
    for k, v in fresh.state_dict().items():
        assert torch.equal(_bits(v), _bits(want[k])), k
    for g in opt2.flat_params + opt2.flat_buffers:
        assert g.check_bound() == 0  # still views of the flat buffers, nothing to adopt
    p0 = next(fresh.parameters())
    with torch.no_grad():
        p0.add_(1.0)
    assert torch.equal(opt2.flat_params[0].flat[:p0.numel()], p0.detach().flatten())
    opt2.sync()


def test_state_dict_copies_only_shared_entries_and_keep_vars_stays_live():
    model = _net()
    flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=2)
    sd = model.state_dict()
    ptrs = [v.untyped_storage().data_ptr() for v in sd.values()]
    assert len(set(ptrs)) == len(ptrs)  # no two entries share storage
    for k, v in sd.items():
        assert v.untyped_storage().nbytes() == v.numel() * v.element_size(), k
    live = model.state_dict(keep_vars=True)
    assert all(live[n] is p for n, p in model.named_parameters())
    # A submodule's own state_dict is covered too (its hooks run for its part).
    sub = model[0].state_dict()
    assert sub["weight"].untyped_storage().data_ptr() != model[0].weight.untyped_storage().data_ptr()
    # Inside state_dict_views() (what save_checkpoint uses, as it copies anyway): the views.
    from flodl_opt.sync.flat import state_dict_views
    with state_dict_views():
        views = model.state_dict()
    assert views["0.weight"].untyped_storage().data_ptr() == model[0].weight.untyped_storage().data_ptr()


# ---------------------------------------------------------------- GradScaler
_AMP_STEPS, _AMP_K, _AMP_LR, _AMP_SKIP = 7, 3, 0.05, (1, 4)   # rank 1 overflows at step 4


def _amp_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 2, generator=g, dtype=torch.float64)


def _amp_rank(rank, world, explicit_unscale):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=_AMP_LR), model=model,
                                sync_every=_AMP_K)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6)
    synced_at = []
    for step in range(1, _AMP_STEPS + 1):
        x, y = _amp_batch(rank, step)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x.float()), y.float())).backward()
        if (rank, step) == _AMP_SKIP:
            model.weight.grad[0, 0] = float("inf")  # an fp16 overflow, on this rank only
        if explicit_unscale and step % 2 == 0:
            scaler.unscale_(opt)  # as before clipping: step() then gets unscaled gradients
        before = opt.sync_count
        scaler.step(opt)
        scaler.update()
        if opt.sync_count != before:
            synced_at.append((step, opt.last_sync.steps, opt.last_sync.cohort_steps))
    opt.sync()
    return synced_at, [p.detach().clone() for p in model.parameters()], opt.global_steps


def _amp_reference():
    """float64 local SGD; a skipped step moves nothing and weighs nothing (gamma=1: mass = n)."""
    torch.manual_seed(0)
    init = [p.detach().double().clone() for p in nn.Linear(4, 2).parameters()]
    w = [[t.clone() for t in init] for _ in range(2)]
    worked = [0, 0]

    def average():
        total = sum(worked)
        avg = [sum(worked[r] * w[r][i] for r in range(2)) / total for i in range(len(init))]
        for r in range(2):
            w[r] = [t.clone() for t in avg]
            worked[r] = 0

    for step in range(1, _AMP_STEPS + 1):
        for r in range(2):
            if (r, step) == _AMP_SKIP:
                continue
            x, y = _amp_batch(r, step)
            weight, bias = (t.clone().requires_grad_(True) for t in w[r])
            nn.functional.mse_loss(x @ weight.T + bias, y).backward()
            w[r] = [weight.detach() - _AMP_LR * weight.grad, bias.detach() - _AMP_LR * bias.grad]
            worked[r] += 1
        if step % _AMP_K == 0:
            average()
    average()
    return w[0]


@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_gradscaler_overflow_on_one_rank_keeps_the_sync_points(explicit_unscale):
    out = run_ranks(_amp_rank, 2, explicit_unscale, timeout=60, collective_timeout=10)
    (sync0, params0, global0), (sync1, params1, global1) = out
    # Same sync points on both ranks; the skipped step counts on the clock, not in the work.
    assert [s for s, _, _ in sync0] == [s for s, _, _ in sync1] == [3, 6]
    assert [(n, c) for _, n, c in sync0] == [(3, 6), (3, 5)]
    assert [(n, c) for _, n, c in sync1] == [(3, 6), (2, 5)]
    assert global0 == global1 == 2 * _AMP_STEPS - 1
    for a, b, ref in zip(params0, params1, _amp_reference()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.double(), ref, rtol=0, atol=1e-6)


def _amp_single(supports_amp: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, sync_every=2,
                                max_grad_norm=0.5)
    opt._step_supports_amp_scaling = supports_amp  # False: GradScaler unscales and skips, as before
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step in range(1, 8):
        x, y = _amp_batch(0, step)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x.float()), y.float())).backward()
        scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in model.parameters()], scaler.get_scale()


def test_gradscaler_steps_are_bit_identical_to_gradscaler_unscaling_itself():
    (got, scale_got), (want, scale_want) = _amp_single(True), _amp_single(False)
    assert scale_got == scale_want
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- DDP that would average every step
_DDP_K, _DDP_STEPS = 3, 6


def _ddp_run(rank, world, wrap):
    """``wrap``: "plain" (no DDP, the reference), "compiled_ddp" (torch.compile(DDP(net))),
    "ddp_not_given" (a DDP model trains, LocalSGDOptimizer is given the inner net)."""
    import warnings
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    model = {"plain": lambda: net, "ddp_not_given": lambda: DDP(net), "own_allreduce": lambda: net,
             "compiled_ddp": lambda: torch.compile(DDP(net), backend="eager")}[wrap]()
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                model=net if wrap == "ddp_not_given" else model, sync_every=_DDP_K)
    differ = []
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        _ddp_steps(rank, world, model, net, opt, differ, average_grads=wrap == "own_allreduce")
    warned = [str(w.message) for w in caught if issubclass(w.category, flo.AveragedElsewhereWarning)]
    return [p.detach().clone() for p in net.parameters()], differ, type(opt._ddp).__name__, warned


def _ddp_steps(rank, world, model, net, opt, differ, average_grads=False):
    for step in range(1, _DDP_STEPS + 1):
        x, y = _amp_batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.float()), y.float()).backward()
        if average_grads:  # the script's own gradient all-reduce, left in by mistake
            for p in net.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(world)
        opt.step()
        if opt.steps_since_sync:
            mine = torch.cat([p.detach().flatten() for p in net.parameters()])
            both = [torch.empty_like(mine) for _ in range(world)]
            torch.distributed.all_gather(both, mine)
            differ.append(not torch.equal(both[0], both[1]))


def test_ddp_inside_torch_compile_trains_locally():
    pytest.importorskip("torch._dynamo")
    ref = run_ranks(_ddp_run, 2, "plain", timeout=60)
    got = run_ranks(_ddp_run, 2, "compiled_ddp", timeout=90)
    for r in range(2):
        params, differ, bridge, warned = got[r]
        assert bridge == "DDPBridge"      # the DDP inside the compiled wrapper was found
        assert len(differ) == 4 and all(differ), differ  # ranks apart between syncs: local steps
        for a, b in zip(params, ref[r][0]):
            assert torch.equal(a, b)      # exactly the run without DDP
        assert warned == [] and ref[r][3] == []


def test_ddp_built_around_the_model_is_found_at_the_first_step():
    """model=net, with a DDP wrapper around net that flodl was not given (what Accelerate's
    prepare(model, opt) and the HF Trainer build after the optimizer): found and made local."""
    out = run_ranks(_ddp_run, 2, "ddp_not_given", timeout=60)
    for params, differ, bridge, warned in out:
        assert bridge == "DDPBridge" and warned == []
        # step 1's backward ran before the first step() found DDP: averaged, so the ranks are
        # still equal; then local steps (2, 4, 5) leave them apart
        assert differ == [False, True, True, True], differ
    for a, b in zip(out[0][0], out[1][0]):
        assert torch.equal(a, b)  # the sync at step 6


def test_gradients_averaged_elsewhere_are_reported():
    for params, differ, bridge, warned in run_ranks(_ddp_run, 2, "own_allreduce", timeout=60):
        assert bridge == "NoneType" and not any(differ)  # averaged every step: no local SGD
        assert len(warned) == 1 and "something else averaged the gradients" in warned[0], warned
        assert "model=ddp_model" in warned[0] and "sync #1" in warned[0]


# ---------------------------------------------------------------- init() before the launcher
def test_init_in_a_world_of_one_then_launcher_variables_is_an_error(monkeypatch):
    flo.init()
    assert flo.size() == 1
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = nn.Linear(3, 1)
    with pytest.raises(flo.ConfigError, match=r"world of one.*rank 1 of 2.*drop flo.init\(\)"):
        flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=2)


def _late_group(rank, world, port):
    """As under Lightning: flo.init() sees one process; the framework creates the group later."""
    import warnings
    flo.shutdown()  # leave the harness's group: start as a plain script would
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE")}
    flo.init()
    alone = flo.size()
    os.environ.update(saved, MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)  # different starting weights: the optimizer's broadcast must align them
    model = nn.Linear(3, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=2)
    for step in range(2):
        opt.zero_grad()
        model(torch.full((4, 3), float(rank + step))).sum().backward()
        opt.step()
    return alone, flo.size(), opt.sync_count, [p.detach().clone() for p in model.parameters()], \
        [str(w.message) for w in caught if "adopting the process group" in str(w.message)]


def test_init_in_a_world_of_one_adopts_a_process_group_created_later():
    from dist_harness import free_port
    out = run_ranks(_late_group, 2, free_port(), timeout=60)
    for alone, size, syncs, params, warned in out:
        assert (alone, size, syncs, len(warned)) == (1, 2, 1, 1)
    for a, b in zip(out[0][3], out[1][3]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- Accelerate's prepare() order
def test_params_copied_after_wrapping_are_adopted_and_a_dtype_change_is_refused():
    torch.manual_seed(0)
    ref = nn.Linear(3, 2)
    model = nn.Linear(3, 2)
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=2)
    flat = opt.flat_params[0].flat
    model.to(torch.device("cpu", 0))  # what accelerator.prepare(model) does: a copy, same device
    assert model.weight.data_ptr() != flat.data_ptr()
    for step in range(4):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            m(torch.full((1, 3), float(step + 1))).square().sum().backward()
            o.step()
    # back in the buffer since the sync at step 2, and trained exactly like the unwrapped model
    assert model.weight.data_ptr() == flat.data_ptr()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    model.double()  # the buffer is float32: this cannot be adopted
    model(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    with pytest.raises(flo.ConfigError, match=r"was replaced or moved after the optimizer was wrapped "
                       r"\(now torch.float64 on cpu.*Move the model"):
        opt.step(), opt.step()


# ---------------------------------------------------------------- torch.distributed.checkpoint
def _dcp_build(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2))
    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, sync_every=3,
                                outer="diloco")
    return model, opt


def _dcp_steps(rank, model, opt, first, last):
    for step in range(first, last + 1):
        x, y = _amp_batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.float()), y.float()).backward()
        opt.step()


def _dcp_rank(rank, world, root):
    import torch.distributed.checkpoint as dcp
    model, opt = _dcp_build(0)
    _dcp_steps(rank, model, opt, 1, 9)
    want = [t.clone() for t in model.state_dict().values()], opt.state_dict()["flodl_opt"]["counters"]
    out = {}
    for save_at, replicated in ((4, False), (6, True)):
        model, opt = _dcp_build(0)
        _dcp_steps(rank, model, opt, 1, save_at)
        path = os.path.join(root, f"{save_at}")
        dcp.save({"train": flo.DCPState(model, opt, replicated_weights=replicated)}, checkpoint_id=path)
        model, opt = _dcp_build(7)  # other weights, empty optimizer state: all must come from the file
        dcp.load({"train": flo.DCPState(model, opt, replicated_weights=replicated)}, checkpoint_id=path)
        _dcp_steps(rank, model, opt, save_at + 1, 9)
        got = [t.clone() for t in model.state_dict().values()], opt.state_dict()["flodl_opt"]["counters"]
        out[save_at] = all(torch.equal(a, b) for a, b in zip(got[0], want[0])) and got[1] == want[1]
    try:
        model, opt = _dcp_build(0)
        _dcp_steps(rank, model, opt, 1, 2)
        flo.DCPState(model, opt, replicated_weights=True).state_dict()
    except flo.ConfigError as e:
        out["between_syncs"] = str(e)
    return out


def test_dcp_save_and_load_resume_every_rank_exactly(tmp_path):
    pytest.importorskip("torch.distributed.checkpoint")
    for out in run_ranks(_dcp_rank, 2, str(tmp_path), timeout=90):
        assert out[4] and out[6], out  # between syncs (all per rank) and at a sync (weights once)
        assert "2 step(s) after the last sync" in out["between_syncs"]


# ---------------------------------------------------------------- Accelerate (optional extra)
def _accelerate_rank(rank, world, root, order):
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    if order == "documented":  # prepare(model, opt) copies the params after the wrap
        opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=2)
        model, opt = acc.prepare(model, opt)
    else:                      # the recipe: prepare the model, wrap, prepare the optimizer
        model = acc.prepare(model)
        opt = acc.prepare(flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                model=model, sync_every=2))
    differ = []
    try:
        for step in range(1, 6):
            x, _ = _amp_batch(rank, step)
            opt.zero_grad()
            acc.backward(model(x.float()).square().mean())
            opt.step()
            mine = torch.cat([p.detach().flatten() for p in model.parameters()])
            both = [torch.empty_like(mine) for _ in range(world)]
            torch.distributed.all_gather(both, mine)
            differ.append(not torch.equal(both[0], both[1]))
        opt.optimizer.sync()  # the final sync: 5 steps is not a multiple of K
    except flo.ConfigError as e:
        return str(e)
    acc.save_state(root)
    acc.wait_for_everyone()
    import safetensors.torch as st
    saved = st.load_file(os.path.join(root, "model.safetensors"))
    ours = acc.unwrap_model(model).state_dict()
    return differ, sorted(saved) == sorted(ours) and all(torch.equal(saved[k], ours[k]) for k in ours)


def test_accelerate_recipe_trains_locally_and_saves_every_tensor(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed (optional integration extra)")
    pytest.importorskip("safetensors", reason="safetensors is not installed")
    for differ, saved_ok in run_ranks(_accelerate_rank, 2, str(tmp_path), "recipe", timeout=90):
        assert differ == [True, False, True, False, True], differ  # apart but at the syncs (steps 2, 4)
        assert saved_ok
    # prepare(model, opt) in one call copies the params and wraps DDP after the optimizer: the
    # copies are adopted at the first sync and the DDP is found at the first step (whose
    # backward it already averaged: equal after step 1)
    for differ, saved_ok in run_ranks(_accelerate_rank, 2, str(tmp_path / "d"), "documented", timeout=90):
        assert differ == [False, False, True, False, True], differ
        assert saved_ok


# ---------------------------------------------------------------- Lightning (optional extra)
def _lightning_rank(rank, world, root):
    import warnings
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))

        def training_step(self, batch, i):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            inner = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(inner, step_size=2, gamma=0.5)
            # model=self: the strategy's DDP wrapper around it is found and made local
            self.flo = flo.LocalSGDOptimizer(inner, model=self, sync_every=3, lr_scheduler=sched)
            return self.flo

        def on_train_end(self):
            self.flo.sync()  # the final sync: max_steps=5 is not a multiple of K=3

    g = torch.Generator().manual_seed(rank)
    data = TensorDataset(torch.randn(40, 4, generator=g), torch.randn(40, 2, generator=g))
    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(data, batch_size=4))
    opt = module.flo
    return (type(opt._ddp).__name__, opt.last_sync.steps, opt.last_sync.divergence, opt.sync_count,
            opt.param_groups[0]["lr"], [p.detach().clone() for p in module.parameters()],
            [str(w.message) for w in caught if issubclass(w.category, flo.AveragedElsewhereWarning)])


def test_lightning_ddp_with_model_self_trains_locally(tmp_path):
    pytest.importorskip("lightning", reason="lightning is not installed (optional integration extra)")
    out = run_ranks(_lightning_rank, 2, str(tmp_path), timeout=120)
    for bridge, steps, divergence, syncs, lr, params, warned in out:
        assert bridge == "DDPBridge" and warned == []
        assert syncs == 2 and steps == 2 and lr == 0.025  # synced at 3, then the final sync after 5
        assert divergence > 1e-3  # the ranks trained apart (DDP averaging every step gives 0.0)
    for a, b in zip(out[0][5], out[1][5]):
        assert torch.equal(a, b)


def _amp_stream_rank(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = flo.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=_AMP_LR), model=model,
                                sync_every=4, fragments=2, overlap_steps=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6)
    counts = []
    for step in range(1, 10):
        x, y = _amp_batch(rank, step)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x.float()), y.float())).backward()
        if (rank, step) in ((1, 3), (0, 6)):
            model[0].weight.grad[0, 0] = float("nan")
        scaler.step(opt)
        scaler.update()
        counts.append(opt.sync_count)
    opt.sync()
    return counts, opt.global_steps, [p.detach().clone() for p in model.parameters()]


def test_gradscaler_overflow_keeps_streaming_syncs_aligned():
    (c0, g0, p0), (c1, g1, p1) = run_ranks(_amp_stream_rank, 2, timeout=60, collective_timeout=10)
    assert c0 == c1 and c0[-1] >= 3  # the same fragment syncs at the same steps on both ranks
    assert g0 == g1 == 2 * 9 - 2     # the two skipped steps did no work
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- HF Trainer (optional extra)
def _hf_rank(rank, world, root, resume_from, max_steps, callback=True):
    import transformers
    from flodl_opt.integrations import LocalSGDCallback
    transformers.logging.set_verbosity_error()

    class Net(nn.Module):
        def __init__(self, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": nn.functional.mse_loss(out, labels), "logits": out}

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x, self.y = torch.randn(96, 4, generator=g), torch.randn(96, 2, generator=g)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    # a resumed run starts from other weights: everything must come from the checkpoint
    model = Net(seed=0 if resume_from is None else 9)
    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05), model=model, sync_every=3)
    args = transformers.TrainingArguments(
        output_dir=root, max_steps=max_steps, save_steps=4, per_device_train_batch_size=4, use_cpu=True,
        report_to=[], logging_steps=1000, disable_tqdm=True, save_only_model=False)
    differ = []

    class Watch(transformers.TrainerCallback):  # are the ranks apart? (a test probe, not the recipe)
        def on_step_end(self, args, state, control, **kwargs):
            mine = torch.cat([p.detach().flatten() for p in model.parameters()])
            both = [torch.empty_like(mine) for _ in range(world)]
            torch.distributed.all_gather(both, mine)
            differ.append(not torch.equal(both[0], both[1]))

    trainer = transformers.Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None),
                                   callbacks=([LocalSGDCallback()] if callback else []) + [Watch()])
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume_from)
    return (type(opt._ddp).__name__, differ, opt.sync_count, opt.local_steps,
            [p.detach().clone() for p in model.parameters()], opt.state_dict()["state"],
            [w.category.__name__ for w in caught if issubclass(w.category, flo.InexactResumeWarning)])


def test_hf_trainer_trains_locally_and_resumes_every_rank_exactly(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (optional integration extra)")
    full = run_ranks(_hf_rank, 2, str(tmp_path / "full"), None, 10, timeout=150)
    for bridge, differ, syncs, steps, params, _, _ in full:
        assert bridge == "DDPBridge"  # Trainer's DDP wrapper, built after the optimizer, was found
        # syncs at 3, 4 and 8 (checkpoints), 7, and a final one at 10
        assert differ == [True, True, False, False, True, True, False, False, True, False], differ
        assert syncs == 5 and steps == 10
    for a, b in zip(full[0][4], full[1][4]):
        assert torch.equal(a, b)
    ckpt = str(tmp_path / "full" / "checkpoint-4")
    resumed = run_ranks(_hf_rank, 2, str(tmp_path / "resumed"), ckpt, 10, timeout=150)
    for r in range(2):
        assert resumed[r][2:4] == full[r][2:4]  # the counters survive the resume
        for a, b in zip(resumed[r][4], full[r][4]):
            assert torch.equal(a, b)        # and so does every rank's own AdamW state: exact
        for k, v in full[r][5].items():
            assert all(torch.equal(v[n], resumed[r][5][k][n]) for n in ("exp_avg", "exp_avg_sq"))
        assert resumed[r][6] == []  # each rank's own state went in instead of rank 0's optimizer.pt


def test_hf_trainer_resume_without_the_callback_warns_the_other_ranks(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (optional integration extra)")
    run_ranks(_hf_rank, 2, str(tmp_path / "full"), None, 4, False, timeout=150)  # saved at 4, K=3
    ckpt = str(tmp_path / "full" / "checkpoint-4")
    resumed = run_ranks(_hf_rank, 2, str(tmp_path / "resumed"), ckpt, 6, False, timeout=150)
    assert resumed[0][6] == []                          # rank 0 loads its own optimizer.pt
    assert resumed[1][6] == ["ForeignRankStateWarning"]  # rank 1 gets rank 0's, one step after a sync


# ---------------------------------------------------------------- under the frameworks' own launchers
def _launch_script(tmp_path, source, args, timeout=240):
    import json
    import sys
    import textwrap
    from dist_harness import launcher_env, run_launcher
    script = tmp_path / "script.py"
    script.write_text(_RESULT + textwrap.dedent(source))
    out = run_launcher([sys.executable, *args(str(script))], launcher_env(), cwd=str(tmp_path), timeout=timeout)
    # one file per rank: the ranks' stdout and stderr interleave in the launcher's output
    lines = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("result_rank*.json"))]
    assert sorted(r["rank"] for r in lines) == [0, 1], out[-4000:]
    return sorted(lines, key=lambda r: r["rank"])


_RESULT = '''
def result(opt, params):
    import json, os, torch.distributed as dist
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"result_rank{dist.get_rank()}.json"), "w") as fh:
        json.dump({"rank": dist.get_rank(), "bridge": type(opt._ddp).__name__, "syncs": opt.sync_count,
                   "steps": opt.local_steps, "divergence": opt.last_sync.divergence,
                   "checksum": repr(sum(float(p.double().sum()) for p in params))}, fh)
'''


def test_lightning_ddp_spawn_trains_locally(tmp_path):
    pytest.importorskip("lightning", reason="lightning is not installed (optional integration extra)")
    out = _launch_script(tmp_path, '''
        import torch, lightning as L
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        import flodl_opt as flo

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))

            def training_step(self, batch, i):
                return nn.functional.mse_loss(self.net(batch[0]), batch[1])

            def configure_optimizers(self):
                self.flo = flo.LocalSGDOptimizer(torch.optim.SGD(self.parameters(), lr=0.1), model=self,
                                                 sync_every=3)
                return self.flo

            def on_train_end(self):
                self.flo.sync()  # max_steps=5 is not a multiple of K=3
                result(self.flo, self.parameters())

        if __name__ == "__main__":
            g = torch.Generator().manual_seed(0)
            data = TensorDataset(torch.randn(80, 4, generator=g), torch.randn(80, 2, generator=g))
            trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=5, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(Module(), DataLoader(data, batch_size=4))
    ''', lambda s: [s])
    for r in out:
        assert r["bridge"] == "DDPBridge" and r["syncs"] == 2 and r["steps"] == 5
        assert r["divergence"] > 1e-3  # the ranks trained apart: DDP's all-reduce was off
    assert out[0]["checksum"] == out[1]["checksum"]


def test_accelerate_under_torchrun_in_the_documented_order(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed (optional integration extra)")
    out = _launch_script(tmp_path, '''
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        from accelerate import Accelerator
        import flodl_opt as flo

        acc = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
        opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model=model, sync_every=4)
        g = torch.Generator().manual_seed(0)
        loader = DataLoader(TensorDataset(torch.randn(80, 4, generator=g), torch.randn(80, 2, generator=g)),
                            batch_size=4, shuffle=True)
        model, opt, loader = acc.prepare(model, opt, loader)  # one call, as Accelerate documents
        for x, y in loader:
            opt.zero_grad()
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
        opt.optimizer.sync()  # 10 steps is not a multiple of K=4
        result(opt.optimizer, model.parameters())
    ''', lambda s: ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", s])
    for r in out:
        # syncs at 4 and 8, the final one at 10; the ranks trained apart (DDP's all-reduce was off)
        assert r["bridge"] == "DDPBridge" and r["syncs"] == 3 and r["steps"] == 10
        assert r["divergence"] > 1e-4
    assert out[0]["checksum"] == out[1]["checksum"]


# ---------------------------------------------------------------- framework resumes (rank 0's files)
def test_dcp_plain_state_dict_between_syncs_is_refused_on_every_rank(tmp_path):
    """dcp.save({"model": ..., "optim": opt.state_dict()}) keeps one rank's copy of each tensor."""
    out = run_ranks(_dcp_plain_rank, 2, str(tmp_path), timeout=90)
    for rank, msg in enumerate(out):
        assert f"rank {rank} was given an optimizer state whose tensors are not those" in msg, msg
        assert "per-tensor mix of several ranks' state" in msg and "flo.DCPState(model, opt)" in msg


def _dcp_plain_rank(rank, world, root):
    import torch.distributed.checkpoint as dcp
    model, opt = _dcp_build(0)
    _dcp_steps(rank, model, opt, 1, 5)  # synced at 3: two steps of its own
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=root)
    model2, opt2 = _dcp_build(7)
    _dcp_steps(rank, model2, opt2, 1, 1)  # some optimizer state for dcp.load to fill in place
    template = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    dcp.load(template, checkpoint_id=root)
    counters = opt2.state_dict()["flodl_opt"]["counters"]
    try:
        opt2.load_state_dict(template["optim"])
    except flo.ConfigError as e:
        assert opt2.state_dict()["flodl_opt"]["counters"] == counters  # refused: nothing loaded
        return str(e)
    return "loaded"


_LT_K, _LT_STEPS = 4, 10


def _lightning_resume_rank(rank, world, root, ckpt, callback):
    """Lightning DDP, 5 steps an epoch, a checkpoint at the end of epoch 0 (one step after a sync)."""
    import warnings
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    from flodl_opt.integrations import LocalSGDLightningCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0 if ckpt is None else 9)  # resumed: everything from the checkpoint
            self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))

        def training_step(self, batch, i):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            self.flo = flo.LocalSGDOptimizer(torch.optim.AdamW(self.parameters(), lr=0.05), model=self,
                                             sync_every=_LT_K)
            return self.flo

        def _snapshot(self):
            return ([p.detach().clone() for p in self.parameters()],
                    [v.clone() for s in self.flo.optimizer.state.values() for v in s.values()],
                    (self.flo.local_steps, self.flo.sync_count, self.flo.steps_since_sync))

        def on_train_epoch_end(self):  # the state the checkpoint at the end of epoch 0 holds
            if self.current_epoch == 0 and ckpt is None:
                self.at_save = self._snapshot()

        def on_train_batch_start(self, batch, i):  # the state a resumed run starts from
            if ckpt is not None and not hasattr(self, "at_save"):
                self.at_save = self._snapshot()

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 4, generator=g), torch.randn(40, 2, generator=g))
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=-1,
                                                save_on_train_epoch_end=True)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=_LT_STEPS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                        callbacks=[saver] + ([LocalSGDLightningCallback()] if callback else []))
    module = Module()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(data, batch_size=4), ckpt_path=ckpt)
    return (module.at_save,  # weights, inner state and counters at the save / at the resume
            [w.category.__name__ for w in caught if issubclass(w.category, flo.InexactResumeWarning)])


def test_lightning_resume_restores_every_ranks_own_state_with_the_callback_and_warns_without(tmp_path):
    pytest.importorskip("lightning", reason="lightning is not installed (optional integration extra)")
    full = run_ranks(_lightning_resume_rank, 2, str(tmp_path / "full"), None, True, timeout=180)
    assert not all(torch.equal(a, b) for a, b in zip(full[0][0][0], full[1][0][0]))  # apart at the save
    ckpt = str(tmp_path / "full" / "epoch=0-step=5.ckpt")
    resumed = run_ranks(_lightning_resume_rank, 2, str(tmp_path / "cb"), ckpt, True, timeout=180)
    for r in range(2):
        (w_saved, m_saved, c_saved), (w_got, m_got, c_got) = full[r][0], resumed[r][0]
        assert c_saved == c_got == (5, 1, 1)
        assert all(torch.equal(a, b) for a, b in zip(w_saved, w_got)), r  # this rank's own weights
        assert all(torch.equal(a, b) for a, b in zip(m_saved, m_got)), r  # and its own moments
        assert "ForeignRankStateWarning" not in resumed[r][1] and full[r][1] == []
    plain = run_ranks(_lightning_resume_rank, 2, str(tmp_path / "plain"), ckpt, False, timeout=180)
    assert plain[0][1] == [] and plain[1][1] == ["ForeignRankStateWarning"]
    assert not all(torch.equal(a, b) for a, b in zip(full[1][0][1], plain[1][0][1]))  # rank 0's moments


def _accelerate_resume_rank(rank, world, root, helper, phase):
    import warnings
    from accelerate import Accelerator
    from flodl_opt.integrations import accelerate_state
    acc = Accelerator(cpu=True)
    torch.manual_seed(0 if phase != "load" else 7)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if phase.startswith("wrap_after"):  # prepare the torch optimizer, then wrap: the documented mistake
            model, inner = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05))
            opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=2)
        else:
            opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05), model=model,
                                        sync_every=2)
            model, opt = acc.prepare(model, opt)
        if helper:
            accelerate_state(acc, opt)
        local = flo.integrations.find_local_sgd(opt)
        first = 1
        if phase in ("load", "wrap_after_load"):
            acc.load_state(root)
            first = 6
        for step in range(first, 10 if phase in ("load", "reference", "wrap_after_load") else 6):
            if phase == "reference" and step == 6:
                local.sync()  # what save_state does with accelerate_state, 1 step after a sync
            x, _ = _amp_batch(rank, step)
            opt.zero_grad()
            acc.backward(model(x.float()).square().mean())
            opt.step()
        if phase in ("save", "wrap_after"):
            acc.save_state(root)
            acc.wait_for_everyone()
    return ((local.local_steps, local.sync_count, local.steps_since_sync),
            [p.detach().clone() for p in acc.unwrap_model(model).parameters()],
            [v.clone() for s in local.optimizer.state.values() for v in s.values()] if phase != "wrap_after" else [],
            [(w.category.__name__, str(w.message)) for w in caught if issubclass(w.category, flo.InexactResumeWarning)])


def test_accelerate_save_state_resumes_every_rank_exactly_with_accelerate_state(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed (optional integration extra)")
    ref = run_ranks(_accelerate_resume_rank, 2, None, True, "reference", timeout=120)
    run_ranks(_accelerate_resume_rank, 2, str(tmp_path / "a"), True, "save", timeout=120)
    got = run_ranks(_accelerate_resume_rank, 2, str(tmp_path / "a"), True, "load", timeout=120)
    for r in range(2):
        assert got[r][0] == ref[r][0] == (9, 5, 0), r  # syncs at 2, 4, the save (5), 7, 9
        assert all(torch.equal(a, b) for a, b in zip(ref[r][1], got[r][1])), r
        assert all(torch.equal(a, b) for a, b in zip(ref[r][2], got[r][2])), r
        assert got[r][3] == []


def test_accelerate_rank_0_save_state_warns_the_other_ranks(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed (optional integration extra)")
    run_ranks(_accelerate_resume_rank, 2, str(tmp_path / "p"), False, "save", timeout=120)
    got = run_ranks(_accelerate_resume_rank, 2, str(tmp_path / "p"), False, "load", timeout=120)
    assert got[0][3] == []
    (cls, msg), = got[1][3]
    assert cls == "ForeignRankStateWarning" and "accelerate_state(accelerator, opt)" in msg


def test_accelerate_wrapping_after_prepare_warns_at_the_wrap_and_at_the_load(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed (optional integration extra)")
    saved = run_ranks(_accelerate_resume_rank, 2, str(tmp_path / "w"), False, "wrap_after", timeout=120)
    got = run_ranks(_accelerate_resume_rank, 2, str(tmp_path / "w"), False, "wrap_after_load", timeout=120)
    for r in range(2):
        (cls, msg), = saved[r][3]
        assert cls == "InexactResumeWarning" and "Wrap first, then prepare" in msg
        warned = [m for _, m in got[r][3]]
        assert len(warned) == 2 and "loaded an optimizer state around LocalSGDOptimizer" in warned[1]
        assert got[r][0][0] == 4  # the counters restarted at 0 (4 steps since the load)
