"""Horovod's raw collectives on real Gloo ranks (2 and 3), against what Horovod's own tests expect.

* ranks that disagree on shape, dtype, root, name, op or kind get CollectiveMismatchError (a
  RuntimeError and a ConfigError) on EVERY rank, never a crash inside Gloo, a hang or garbage, and
  the group stays usable;
* integer Average/prescale/postscale (float64 math truncated toward zero), int16/uint8/int8/bool
  gathers and broadcasts, Min/Max/Product, against float64 references computed here;
* allreduce/allgather/broadcast are differentiable, against hand-derived gradients of the summed
  loss (allgather and broadcast average the upstream gradient over ranks, as Horovod); async
  handles, join() (a joined rank contributes zeros), barrier();
* Compression.compress/decompress; DistributedOptimizer on sparse gradients (SparseAdam included);
* object collectives, broadcasts and DistributedOptimizer's build against every other collective
  raise CollectiveMismatchError on every rank at once; a reordered named pair raises (call order);
* broadcast_optimizer_state leaves zero gradients as Horovod's does.
"""
import os

import numpy as np
import pytest
import torch
from torch import nn

import flodl_opt as hvd
from dist_harness import run_ranks


def _catch(fn):
    """(exception class names, message) of what fn raised, or None; then prove the group works."""
    try:
        fn()
        out = None
    except Exception as e:  # noqa: BLE001 - the test inspects it
        out = ([c.__name__ for c in type(e).__mro__], str(e))
    alive = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    return out, alive


# ---------------------------------------------------------------- mismatched input
def rank_mismatch(rank, world):
    f = torch.FloatTensor
    cases = {
        "allreduce_dims": lambda: hvd.allreduce(f(*([17 + rank] * 3)).fill_(1)),
        "allreduce_rank": lambda: hvd.allreduce(f(17, 23 * 57) if rank == 0 else f(17, 23, 57)),
        "allreduce_dtype": lambda: hvd.allreduce(torch.ones(17, dtype=torch.int32 if rank % 2 == 0
                                                            else torch.float32)),
        "allreduce_op": lambda: hvd.allreduce(torch.ones(3), op=hvd.Sum if rank == 0 else hvd.Average),
        "allreduce_name": lambda: hvd.allreduce(torch.ones(3), name=f"loss{rank}"),
        "allreduce_scale": lambda: hvd.allreduce(torch.ones(3), prescale_factor=1.0 + rank),
        "allgather_dim1": lambda: hvd.allgather(torch.ones(17, 10 * (rank + 1), 17)),
        "allgather_dtype": lambda: hvd.allgather(torch.ones(17, 3, dtype=torch.int32 if rank % 2 == 0
                                                            else torch.float32)),
        "broadcast_shape": lambda: hvd.broadcast(torch.ones(17, 10 * (rank + 1), 17), 0),
        "broadcast_larger": lambda: hvd.broadcast(torch.ones(4 if rank else 8), 0),
        "broadcast_dtype": lambda: hvd.broadcast(torch.ones(17, dtype=torch.int32 if rank % 2 == 0
                                                            else torch.float32), 0),
        "broadcast_root": lambda: hvd.broadcast(torch.ones(17), rank),
        "broadcast_root_range": lambda: hvd.broadcast(torch.ones(3), world),
        "kind": lambda: (hvd.allreduce(torch.ones(3)) if rank == 0 else hvd.broadcast(torch.ones(3), 0)),
        "grad": lambda: hvd.allreduce(torch.ones(3, requires_grad=rank == 0)),
        "one_rank_refuses": lambda: hvd.allreduce(torch.ones(3), op=hvd.Product if rank else hvd.Sum,
                                                  average=True if rank == world - 1 else None),
    }
    out = {k: _catch(fn) for k, fn in cases.items()}

    def duplicate():  # Horovod: a name still in flight is a ValueError
        hvd.allreduce_async(torch.ones(17), name="dup")
        hvd.allreduce_async(torch.ones(17), name="dup")
    out["duplicate_name"] = _catch(duplicate)
    # other kinds have their own namespace, as in Horovod ("allgather.dup" != "allreduce.dup")
    out["other_kind_same_name"] = _catch(lambda: hvd.synchronize(hvd.allgather_async(torch.ones(2),
                                                                                     name="dup")))
    ok = hvd.allgather(torch.full((1 + rank, 2), float(rank)))  # first dims may differ
    return {"cases": out, "gathered": ok.numpy()}


@pytest.mark.parametrize("world", [2, 3])
def test_mismatched_collectives_raise_on_every_rank(world):
    out = run_ranks(rank_mismatch, world, timeout=90)
    for rank, res in enumerate(out):
        for case, (err, alive) in res["cases"].items():
            assert alive == world, (rank, case)
            if case == "other_kind_same_name":
                assert err is None, (rank, err)
                continue
            assert err is not None, (rank, case, "did not raise")
            classes, msg = err
            if case == "duplicate_name":
                assert "ValueError" in classes and "still in flight" in msg, (rank, msg)
            elif case == "one_rank_refuses":
                # the refusing rank raises its own ConfigError, the others a mismatch naming it
                want = "either op= or the deprecated average=" if rank == world - 1 else \
                    f"rank(s) [{world - 1}] refused"
                assert want in msg and "ValueError" in classes, (rank, msg)
            else:
                assert "CollectiveMismatchError" in classes and "RuntimeError" in classes, (rank, case, err)
                assert "ConfigError" in classes, (rank, case)
        assert "float32[17, 17, 17]" in res["cases"]["allreduce_dims"][0][1]
        assert "float32[17, 18, 18]" not in res["cases"]["allreduce_dims"][0][1]
        assert "float32[18, 18, 18]" in res["cases"]["allreduce_dims"][0][1]
        assert "root_rank=0" in res["cases"]["broadcast_root"][0][1]
        assert "outside the group" in res["cases"]["broadcast_root_range"][0][1]
        want = np.concatenate([np.full((1 + r, 2), float(r)) for r in range(world)]).astype(np.float32)
        np.testing.assert_array_equal(res["gathered"], want)


# ---------------------------------------------------------------- integers and other dtypes
def _ints(rank, shape=(5, 7)):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(-100, 100, shape, generator=g)


def rank_dtypes(rank, world):
    out = {}
    for dt in (torch.int32, torch.int64):
        x = _ints(rank).to(dt)
        out[f"avg_{dt}"] = hvd.allreduce(x, op=hvd.Average)
        out[f"pre_{dt}"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.37)
        out[f"post_{dt}"] = hvd.allreduce(x, op=hvd.Sum, postscale_factor=0.37)
        out[f"avg_post_{dt}"] = hvd.allreduce(x, average=True, postscale_factor=2.5)
        y = x.clone()
        hvd.allreduce_(y, average=True)
        out[f"inplace_avg_{dt}"] = y
    x = _ints(rank).double() / 7
    out["float_pre_post"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.37, postscale_factor=3.0)
    out["float_avg"] = hvd.allreduce(x)
    out["fp16_compressed"] = hvd.allreduce(x.float(), op=hvd.Sum, compression=hvd.Compression.fp16)
    for op in ("Min", "Max", "Product"):
        out[f"op_{op}"] = hvd.allreduce((_ints(rank) % 5).float(), op=getattr(hvd, op))
    out["int16_sum"] = hvd.allreduce(_ints(rank).to(torch.int16), op=hvd.Sum)
    out["int16_avg"] = hvd.allreduce(_ints(rank).to(torch.int16), op=hvd.Average)
    out["bool_max"] = hvd.allreduce(torch.tensor([rank == 0, False, True]), op=hvd.Max)
    for dt in (torch.int16, torch.uint8, torch.int8, torch.bool, torch.float16, torch.bfloat16):
        key = str(dt).replace("torch.", "")
        local = (_ints(rank, (1 + rank, 3)).abs() % 2 if dt == torch.bool else
                 _ints(rank, (1 + rank, 3)).abs()).to(dt)
        out[f"gather_{key}"] = hvd.allgather(local)
        root = world - 1
        out[f"bcast_{key}"] = hvd.broadcast(_ints(rank, (4, 3)).abs().to(dt), root)
        inplace = _ints(rank, (4, 3)).abs().to(dt)
        hvd.broadcast_(inplace, root)
        out[f"bcast_inplace_{key}"] = inplace
    out["gather_scalar"] = hvd.allgather(torch.tensor(rank, dtype=torch.int16))
    return {k: (v.to(torch.float64).numpy() if v.dtype in (torch.bfloat16,) else v.numpy(), str(v.dtype))
            for k, v in out.items()}


def _trunc(a):
    return np.trunc(a).astype(np.int64)


@pytest.mark.parametrize("world", [2, 3])
def test_integer_scaling_and_unsupported_dtypes_match_horovod(world):
    out = run_ranks(rank_dtypes, world, timeout=90)
    xs = [_ints(r).numpy().astype(np.float64) for r in range(world)]
    total = sum(xs)
    ref = {
        "avg": _trunc(total / world),                                   # truncated toward zero
        "pre": sum(_trunc(x * 0.37) for x in xs),                       # each rank scales, then sums
        "post": _trunc(total * 0.37),
        "avg_post": _trunc(total * 2.5 / world),
        "inplace_avg": _trunc(total / world),
    }
    for res in out:
        for dt in ("int32", "int64"):
            for k, want in ref.items():
                got, dtype = res[f"{k}_torch.{dt}"]
                assert dtype == f"torch.{dt}", (k, dtype)
                np.testing.assert_array_equal(got, want, err_msg=f"{k} {dt}")
        fx = [x / 7 for x in xs]
        np.testing.assert_allclose(res["float_pre_post"][0], sum(x * 0.37 for x in fx) * 3.0, rtol=1e-12)
        np.testing.assert_allclose(res["float_avg"][0], sum(fx) / world, rtol=1e-12)
        np.testing.assert_allclose(res["fp16_compressed"][0], sum(fx), rtol=2e-3, atol=2e-2)
        assert res["fp16_compressed"][1] == "torch.float32"
        m = [x % 5 for x in (_ints(r).numpy() for r in range(world))]
        np.testing.assert_array_equal(res["op_Min"][0], np.minimum.reduce(m))
        np.testing.assert_array_equal(res["op_Max"][0], np.maximum.reduce(m))
        np.testing.assert_array_equal(res["op_Product"][0], np.multiply.reduce(m))
        np.testing.assert_array_equal(res["int16_sum"][0], total.astype(np.int16))
        assert res["int16_sum"][1] == "torch.int16"
        np.testing.assert_array_equal(res["int16_avg"][0], ref["avg"].astype(np.int16))
        np.testing.assert_array_equal(res["bool_max"][0], [True, False, True])
        for key in ("int16", "uint8", "int8", "bool", "float16", "bfloat16"):
            parts = [_ints(r, (1 + r, 3)).abs().numpy() for r in range(world)]
            if key == "bool":
                parts = [p % 2 for p in parts]
            got, dtype = res[f"gather_{key}"]
            assert dtype == f"torch.{key}", (key, dtype)
            np.testing.assert_array_equal(got.astype(np.float64),
                                          np.concatenate(parts).astype(getattr(np, key, np.float64))
                                          .astype(np.float64) if key != "bfloat16"
                                          else torch.tensor(np.concatenate(parts)).bfloat16().double().numpy())
            root_val = torch.tensor(_ints(world - 1, (4, 3)).abs().numpy()).to(
                getattr(torch, key)).to(torch.float64).numpy()
            for b in ("bcast", "bcast_inplace"):
                got, dtype = res[f"{b}_{key}"]
                assert dtype == f"torch.{key}", (b, key, dtype)
                np.testing.assert_array_equal(got.astype(np.float64), root_val, err_msg=f"{b} {key}")
        np.testing.assert_array_equal(res["gather_scalar"][0], np.arange(world, dtype=np.int16))


# ---------------------------------------------------------------- autograd
def rank_grads(rank, world):
    out = {}
    g = torch.Generator().manual_seed(7)
    w = torch.randn(4, 3, generator=g, dtype=torch.float64)  # same loss weights on every rank
    for op in ("Sum", "Average"):
        x = torch.full((4, 3), float(rank + 1), dtype=torch.float64, requires_grad=True)
        y = hvd.allreduce(x, op=getattr(hvd, op), prescale_factor=0.5, postscale_factor=3.0)
        (y * w * (rank + 1)).sum().backward()  # each rank's own loss: weight (rank + 1)
        out[f"allreduce_{op}"] = x.grad
    x = torch.tensor([float(rank), 5.0 - rank, 1.0], dtype=torch.float64, requires_grad=True)
    (hvd.allreduce(x, op=hvd.Max) * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)).sum().backward()
    out["allreduce_Max"] = x.grad
    rows = [3, 2, 4][:world]
    x = torch.full((rows[rank], 2), float(rank), dtype=torch.float64, requires_grad=True)
    gathered = hvd.allgather(x)
    (gathered * torch.arange(sum(rows), dtype=torch.float64)[:, None] * (rank + 1)).sum().backward()
    out["allgather"] = x.grad
    for root in range(world):
        x = torch.full((2, 2), float(rank), dtype=torch.float64, requires_grad=True)
        b = hvd.broadcast(x, root)
        (b * (rank + 1)).sum().backward()
        out[f"broadcast_{root}"] = x.grad
        out[f"broadcast_value_{root}"] = b.detach()
    # the simplest case: a gradient of ones through allgather is ones, as in Horovod (not world)
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    hvd.allgather(x).backward(torch.ones(2 * world, dtype=torch.float64))
    out["allgather_ones"] = x.grad
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    hvd.broadcast(x, 0).backward(torch.ones(2, dtype=torch.float64))
    out["broadcast_ones"] = x.grad
    return {k: v.numpy() for k, v in out.items()}


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_are_differentiable(world):
    out = run_ranks(rank_grads, world, timeout=90)
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64).numpy()
    loss_weight = sum(r + 1 for r in range(world))  # d(sum of the ranks' losses)/dy = w * this
    rows = [3, 2, 4][:world]
    for rank, res in enumerate(out):
        np.testing.assert_allclose(res["allreduce_Sum"], w * loss_weight * 0.5 * 3.0, rtol=1e-12)
        np.testing.assert_allclose(res["allreduce_Average"], w * loss_weight * 0.5 * 3.0 / world, rtol=1e-12)
        # Max of [r, 5-r, 1] over ranks: element 0 on the last rank, 1 on rank 0, 2 tied everywhere
        # (every rank's loss has weight 1 here, so the summed upstream gradient is world * [1, 2, 3])
        want = [world * 1.0 * (rank == world - 1), world * 2.0 * (rank == 0), world * 3.0 / world]
        np.testing.assert_allclose(res["allreduce_Max"], want, rtol=1e-12)
        # allgather and broadcast average the upstream gradients over ranks, as Horovod's
        # HorovodAllgather/HorovodBroadcast.backward do (allreduce(grad, average=True))
        start = sum(rows[:rank])
        coeff = np.arange(sum(rows), dtype=np.float64)[start:start + rows[rank], None] * loss_weight / world
        np.testing.assert_allclose(res["allgather"], np.broadcast_to(coeff, (rows[rank], 2)), rtol=1e-12)
        for root in range(world):
            np.testing.assert_allclose(res[f"broadcast_{root}"],
                                       np.full((2, 2), loss_weight / world if rank == root else 0.0),
                                       rtol=1e-12)
            np.testing.assert_array_equal(res[f"broadcast_value_{root}"], np.full((2, 2), float(root)))
        np.testing.assert_array_equal(res["allgather_ones"], np.ones(2))
        np.testing.assert_array_equal(res["broadcast_ones"], np.ones(2) if rank == 0 else np.zeros(2))


# ---------------------------------------------------------------- async handles, join, barrier
def rank_async_join(rank, world, first_join):
    out = {}
    # A 17x17 reduce can finish between post and poll (negotiation keeps ranks in step), so the
    # asynchrony is shown on a 32 MB reduce, which takes milliseconds where poll() takes microseconds.
    big = hvd.allreduce_async(torch.full((1 << 23,), float(rank)), op=hvd.Sum, name="big")
    polled_false = not hvd.poll(big)
    out["big"] = hvd.synchronize(big)[:4].double().numpy()
    handles = []
    for i, dt in enumerate((torch.int32, torch.int64, torch.float32, torch.float64, torch.float16)):
        h = hvd.allreduce_async(torch.full((17, 17), float(i + rank), dtype=dt), op=hvd.Sum, name=f"t{i}")
        polled_false |= not hvd.poll(h)
        handles.append((i, h))
    out["sums"] = [hvd.synchronize(h).double().numpy() for _, h in handles]
    out["polled_false"] = polled_false
    hg = hvd.allgather_async(torch.full((1 + rank, 2), float(rank)))
    buf = torch.full((3,), float(rank))
    hb = hvd.broadcast_async_(buf, root_rank=world - 1)
    out["gathered"] = hvd.synchronize(hg).numpy()
    assert hvd.synchronize(hb) is buf
    out["bcast"] = buf.numpy()
    hvd.barrier()
    # uneven data: first_join leaves at once, the others reduce twice more, one of them once more
    a = torch.arange(-6, 6, dtype=torch.int64).reshape(3, 4) * (rank + 1)
    b = torch.linspace(-1, 1, 5, dtype=torch.float64) * (rank + 1)
    results = []
    def step():
        results.append((hvd.allreduce(a, name="a").numpy(), hvd.allreduce(b, op=hvd.Max, name="b").numpy(),
                        hvd.allreduce(b.clone().requires_grad_(), name="g").detach().numpy()))
    if rank != first_join:
        for _ in range(2):
            step()
        out["gather_while_joined"] = _catch_local(lambda: hvd.allgather(torch.ones(2)))
        hvd.barrier()
        if world == 3 and rank == world - 1:
            step()  # alone: both peers are joined by now
    out["results"] = results
    out["last"] = hvd.join()
    out["after"] = hvd.allreduce(torch.tensor([rank]), op=hvd.Sum).item()
    return out


def _catch_local(fn):
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world", [2, 3])
def test_async_handles_join_and_barrier(world):
    first_join = 0
    out = run_ranks(rank_async_join, world, first_join, timeout=90)
    last = world - 1 if world == 3 else 1  # the rank that ran the extra step, or the only one left
    for rank, res in enumerate(out):
        assert res["polled_false"], "poll() was never False: not asynchronous"
        np.testing.assert_array_equal(res["big"], np.full(4, float(sum(range(world)))))
        for i, s in enumerate(res["sums"]):
            np.testing.assert_array_equal(s, np.full((17, 17), sum(float(i + r) for r in range(world))))
        np.testing.assert_array_equal(res["gathered"], np.concatenate(
            [np.full((1 + r, 2), float(r)) for r in range(world)]).astype(np.float32))
        np.testing.assert_array_equal(res["bcast"], np.full(3, float(world - 1), dtype=np.float32))
        assert res["last"] == last, (rank, res["last"])
        assert res["after"] == sum(range(world))
        if rank == first_join:
            assert res["results"] == []
            continue
        assert "already called join()" in res["gather_while_joined"]
        a = np.arange(-6, 6, dtype=np.float64).reshape(3, 4)
        b = np.linspace(-1, 1, 5)
        for step, (ra, rb, rg) in enumerate(res["results"]):
            live = [r for r in range(world) if r != first_join and (step < 2 or r == world - 1)]
            # joined ranks add zeros and Average still divides by the world size, as in Horovod
            np.testing.assert_array_equal(ra, np.trunc(a * sum(r + 1 for r in live) / world))
            np.testing.assert_allclose(rb, np.max([b * (r + 1) for r in live], axis=0), rtol=1e-12)
            np.testing.assert_allclose(rg, b * sum(r + 1 for r in live) / world, rtol=1e-12)


# ---------------------------------------------------------------- compression, world of one
def test_compression_interface_matches_horovod():
    for dt in (torch.float32, torch.float64):
        t = torch.ones(5, 5, 5, dtype=dt)
        c, ctx = hvd.Compression.fp16.compress(t)
        assert c.dtype == torch.float16
        d = hvd.Compression.fp16.decompress(c, ctx)
        assert d.dtype == dt and torch.equal(d, t)
    for dt in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        t = torch.ones(5, dtype=dt)
        c, ctx = hvd.Compression.fp16.compress(t)
        assert c.dtype == dt and hvd.Compression.fp16.decompress(c, ctx).dtype == dt
    t = torch.ones(3)
    c, ctx = hvd.Compression.none.compress(t)
    assert c is t and hvd.Compression.none.decompress(c, ctx) is t


def test_world_of_one_keeps_the_semantics():
    x = torch.tensor([-7, 5, 3])
    assert torch.equal(hvd.allreduce(x, prescale_factor=0.5), torch.tensor([-3, 2, 1]))  # truncated
    h = hvd.allreduce_async(torch.ones(2), name="one")
    assert hvd.poll(h) and torch.equal(hvd.synchronize(h), torch.ones(2))
    with pytest.raises(ValueError, match="unknown handle"):
        hvd.synchronize(h)
    t = torch.ones(3, requires_grad=True)
    hvd.allgather(t).sum().backward()
    assert torch.equal(t.grad, torch.ones(3))
    assert hvd.join() == 0
    hvd.barrier()


# ---------------------------------------------------------------- sparse gradients
def rank_sparse(rank, world, sparse_as_dense):
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5), sparse_as_dense=sparse_as_dense)
    idx = torch.tensor([[1, 2, 4], [4, 3, 9]]) if rank == 0 else torch.tensor([[0, 4, 4], [7, 7, 1]])
    for _ in range(2):
        opt.zero_grad()
        (emb(idx) * (rank + 1)).sum().backward()
        try:
            opt.step()
        except hvd.ConfigError as e:
            return str(e)
    return emb.weight.detach().numpy()


def test_sparse_gradients_densify_or_refuse_on_every_rank():
    refused = run_ranks(rank_sparse, 2, False, timeout=60)
    assert all("sparse gradient" in r and "sparse_as_dense=True" in r for r in refused), refused
    out = run_ranks(rank_sparse, 2, True, timeout=60)
    torch.manual_seed(0)
    ref = nn.Embedding(10, 3).double().weight.detach().numpy().copy()
    grad = np.zeros_like(ref)  # the same every step: the loss is linear in the weights
    for rank, idx in enumerate(([1, 2, 4, 4, 3, 9], [0, 4, 4, 7, 7, 1])):
        for i in idx:
            grad[i] += (rank + 1) / 2  # averaged over the 2 ranks
    for _ in range(2):
        ref -= 0.5 * grad
    for w in out:
        np.testing.assert_allclose(w, ref, rtol=1e-12)


# ---------------------------------------------------------------- found by Horovod's own test file
def rank_non_tensor(rank, world):
    # e.g. Horovod's test_broadcast_state_no_grad broadcasts a .grad that is None here
    calls = {
        "allreduce": lambda t: hvd.allreduce(t, name="x"),
        "allreduce_async_": lambda t: hvd.synchronize(hvd.allreduce_async_(t)),
        "allgather": lambda t: hvd.allgather(t),
        "broadcast": lambda t: hvd.broadcast(t, 0),
        "broadcast_": lambda t: hvd.broadcast_(t, 0),
    }
    out = {}
    for kind, call in calls.items():
        for who in ("one", "all"):  # only rank 0 passes None / every rank does
            bad = rank == 0 or who == "all"
            out[f"{kind}_{who}"] = _catch(lambda: call(None if bad else torch.ones(3)))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_non_tensor_input_raises_on_every_rank(world):
    out = run_ranks(rank_non_tensor, world, timeout=90)
    for rank, res in enumerate(out):
        for case, (err, alive) in res.items():
            assert alive == world, (rank, case)  # the group is still in step
            assert err is not None, (rank, case, "did not raise")
            classes, msg = err
            assert "ConfigError" in classes, (rank, case, classes, msg)
            if rank == 0 or case.endswith("_all"):
                assert "takes a torch.Tensor, got NoneType" in msg, (rank, case, msg)
            else:  # a peer that passed a tensor learns of rank 0's refusal
                assert "CollectiveMismatchError" in classes and "refused" in msg, (rank, case, msg)


def rank_step_after_synchronize(rank, world):
    import warnings
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False).double()
    w0 = model.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters())
    x = torch.full((1, 3), float(rank + 1), dtype=torch.float64)
    counts = []
    for mode in ("sync_then_step", "skip", "plain"):
        opt.zero_grad()
        model(x).sum().backward()
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            if mode == "sync_then_step":
                opt.synchronize()
                opt.step()  # Horovod warns here
            elif mode == "skip":
                opt.synchronize()
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        counts.append([str(w.message) for w in ws])
    return {"warnings": counts, "w0": w0.numpy(), "w": model.weight.detach().numpy()}


def test_step_after_synchronize_warns_as_horovod_and_reduces_once():
    world = 2
    out = run_ranks(rank_step_after_synchronize, world, timeout=60)
    # float64 reference: d(sum(w.x))/dw = x, averaged over ranks = mean(rank + 1) per entry;
    # three steps of lr 0.5, each reducing once (a second reduction of an average is the same
    # average, so the count of collectives is what test_horovod.py checks; here: the values)
    avg = np.mean([r + 1.0 for r in range(world)])
    for res in out:
        sync_step, skip, plain = res["warnings"]
        assert len(sync_step) == 1 and "optimizer.step() called without optimizer.skip_synchronize()" \
            in sync_step[0], sync_step
        assert skip == [] and plain == [], (skip, plain)
        np.testing.assert_allclose(res["w"], res["w0"] - 3 * 0.5 * avg, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(out[0]["w"], out[1]["w"])


def rank_grouped(rank, world):
    out = {}
    base = torch.arange(-8, 9, dtype=torch.float64).reshape(17)
    ts = [(base * (i + 1) * (rank + 1)).to(dt) for i, dt in
          enumerate((torch.int32, torch.int64, torch.float32, torch.float64, torch.float16))]
    out["sum"] = [t.double().numpy() for t in hvd.grouped_allreduce(ts, op=hvd.Sum, name="g")]
    out["avg"] = [t.double().numpy() for t in hvd.grouped_allreduce(ts, average=True)]
    inplace = [t.clone() for t in ts]
    res = hvd.grouped_allreduce_(inplace, op=hvd.Sum)
    out["inplace_same"] = all(a is b for a, b in zip(res, inplace))
    out["inplace"] = [t.double().numpy() for t in inplace]
    h = hvd.grouped_allreduce_async([t.clone() for t in ts], op=hvd.Max, name="ga")
    out["async_max"] = [t.double().numpy() for t in hvd.synchronize(h)]
    # differentiable, each tensor as allreduce: d/dt_i of sum_i w_i*out_i.sum() = sum_r w_i(r)
    leaves = [torch.ones(4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    outs = hvd.grouped_allreduce(leaves, op=hvd.Sum)
    sum((i + 1.0) * (rank + 1) * o.sum() for i, o in enumerate(outs)).backward()
    out["grads"] = [leaf.grad.numpy() for leaf in leaves]
    out["count_mismatch"] = _catch(lambda: hvd.grouped_allreduce(
        [torch.ones(3)] * (3 if rank == 0 else 2), name="m"))
    out["empty"] = _catch(lambda: hvd.grouped_allreduce([] if rank == world - 1 else [torch.ones(1)]))
    # grouped_allgather: allgather per tensor (first dims may differ), with allgather's gradient
    parts = [torch.full((1 + rank, 2), float(rank + i), dtype=torch.float64, requires_grad=True)
             for i in range(3)]
    gathered = hvd.grouped_allgather(parts, name="gg")
    out["gathered"] = [g.detach().numpy() for g in gathered]
    rows = sum(1 + r for r in range(world))
    sum(((i + 1.0) * (rank + 1) * torch.arange(rows, dtype=torch.float64)[:, None] * g).sum()
        for i, g in enumerate(gathered)).backward()
    out["gather_grads"] = [p.grad.numpy() for p in parts]
    h = hvd.grouped_allgather_async([torch.full((2,), rank), torch.full((1,), -rank)])
    out["gather_async"] = [t.numpy() for t in hvd.synchronize(h)]
    out["gather_count_mismatch"] = _catch(lambda: hvd.grouped_allgather([torch.ones(1)] * (2 + rank)))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_grouped_allreduce_and_allgather_are_the_collective_per_tensor(world):
    out = run_ranks(rank_grouped, world, timeout=90)
    base = np.arange(-8, 9, dtype=np.float64)
    ranks = np.arange(world) + 1.0
    for rank, res in enumerate(out):
        for i in range(5):
            per_rank = [base * (i + 1) * r for r in ranks]
            np.testing.assert_array_equal(res["sum"][i], np.sum(per_rank, axis=0))
            np.testing.assert_array_equal(res["inplace"][i], np.sum(per_rank, axis=0))
            np.testing.assert_array_equal(res["async_max"][i], np.max(per_rank, axis=0))
            mean = np.mean(per_rank, axis=0)
            np.testing.assert_array_equal(res["avg"][i], np.trunc(mean) if i < 2 else mean)
        assert res["inplace_same"]
        for i, g in enumerate(res["grads"]):
            np.testing.assert_array_equal(g, np.full(4, (i + 1.0) * ranks.sum()))
        for case in ("count_mismatch", "empty"):
            err, alive = res[case]
            assert alive == world, (rank, case)
            assert err is not None and "ConfigError" in err[0], (rank, case, err)
        assert "CollectiveMismatchError" in res["count_mismatch"][0][0]
        start = sum(1 + r for r in range(rank))
        coeff = np.arange(sum(1 + r for r in range(world)), dtype=np.float64)[start:start + 1 + rank, None]
        for i in range(3):
            np.testing.assert_array_equal(res["gathered"][i], np.concatenate(
                [np.full((1 + r, 2), float(r + i)) for r in range(world)]))
            # averaged over ranks, as allgather's: (i + 1) * mean of (r + 1) * row index
            np.testing.assert_allclose(res["gather_grads"][i],
                                       np.broadcast_to((i + 1.0) * ranks.mean() * coeff, (1 + rank, 2)),
                                       rtol=1e-12)
        np.testing.assert_array_equal(res["gather_async"][0], np.repeat(np.arange(world), 2))
        np.testing.assert_array_equal(res["gather_async"][1], -np.arange(world))
        err, alive = res["gather_count_mismatch"]
        assert alive == world and "CollectiveMismatchError" in err[0], (rank, err)


def test_build_introspection_answers_for_the_installed_torch():
    assert hvd.nccl_built() == 0 or hvd.nccl_built() >= 2000  # 0 without CUDA NCCL
    assert hvd.mpi_enabled() is False and hvd.ccl_built() is False and hvd.ddl_built() is False
    assert hvd.gloo_built() is torch.distributed.is_gloo_available()
    assert hvd.cuda_built() is (torch.version.cuda is not None)
    if not torch.cuda.is_available():
        assert hvd.nccl_built() == 0


def test_horovod_sparse_option_is_refused_clearly():
    emb = nn.Embedding(10, 3, sparse=True)
    with pytest.raises(hvd.ConfigError, match="sparse_as_dense=True"):
        hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters())), sparse=True)


# ---------------------------------------------------------------- object collectives against the others
def _object_calls(rank):
    """The calls that share the raw collectives' signature round; before they did, one against a
    peer's raw collective aborted the process inside Gloo or waited out the collective timeout."""
    def dist_opt():
        return hvd.DistributedOptimizer(torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1))
    return {
        "DistributedOptimizer": dist_opt,
        "allgather_object": lambda: hvd.allgather_object({"rank": rank}),
        "broadcast_object": lambda: hvd.broadcast_object({"rank": rank}, root_rank=0),
        "broadcast_parameters": lambda: hvd.broadcast_parameters(nn.Linear(3, 2).state_dict(), root_rank=0),
        "broadcast_optimizer_state": lambda: hvd.broadcast_optimizer_state(
            torch.optim.Adam(nn.Linear(3, 2).parameters()), root_rank=0),
    }


def _raw_calls():
    return {
        "allreduce": lambda: hvd.allreduce(torch.ones(3)),
        "allreduce_async": lambda: hvd.synchronize(hvd.allreduce_async(torch.ones(3), name="m")),
        "allgather": lambda: hvd.allgather(torch.ones(2, 3)),
        "broadcast": lambda: hvd.broadcast(torch.ones(3), 0),
        "barrier": lambda: hvd.barrier(),
    }


def rank_object_mismatch(rank, world):
    import time
    mine = _object_calls(rank)
    everything = {**mine, **_raw_calls()}
    out = {}
    for a in mine:
        for b in everything:
            if a == b:
                continue
            for first in (0, 1):  # which rank runs the object call
                t0 = time.monotonic()
                out[(a, b, first)] = _catch(mine[a] if rank == first else everything[b]) + \
                    (time.monotonic() - t0,)
    # the same call with different names or roots
    out["names"] = _catch(lambda: hvd.broadcast_object(1, 0, name=f"epoch{rank}")) + (0.0,)
    out["gather_names"] = _catch(lambda: hvd.allgather_object(1, name=f"n{rank}")) + (0.0,)
    out["roots"] = _catch(lambda: hvd.broadcast_object(1, root_rank=rank)) + (0.0,)
    # arguments one rank refuses: its own ConfigError, a mismatch naming it on the peer
    out["refused_params"] = _catch(lambda: hvd.broadcast_parameters(
        {"w": torch.ones(2) if rank else "not a tensor"}, root_rank=0)) + (0.0,)
    out["refused_optimizer"] = _catch(lambda: hvd.broadcast_optimizer_state(
        torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1) if rank else "not an optimizer")) + (0.0,)
    # a joined peer: only allreduce and barrier run while a rank is joined, as in Horovod
    if rank == 0:
        out["joined"] = _catch_local(lambda: hvd.broadcast_object(1, root_rank=0))
    hvd.join()
    # matched calls still work after all of it
    out["matched"] = (hvd.broadcast_object({"rank": rank}, root_rank=1), hvd.allgather_object(rank))
    return out


def test_object_collectives_against_other_collectives_raise_on_every_rank_quickly():
    # a 60 s collective timeout and a 150 s test limit: a pairing that waited out the timeout (or
    # aborted inside Gloo) fails the test; each pairing must raise in a fraction of that
    out = run_ranks(rank_object_mismatch, 2, timeout=150, collective_timeout=60.0)
    for rank, res in enumerate(out):
        pairs = [k for k in res if isinstance(k, tuple)]
        assert len(pairs) == 5 * 9 * 2
        for key in pairs + ["names", "gather_names", "roots"]:
            err, alive, took = res[key]
            assert alive == 2, (rank, key)
            assert err is not None, (rank, key, "did not raise")
            classes, msg = err
            assert "CollectiveMismatchError" in classes, (rank, key, msg)
            assert "different collectives" in msg, (rank, key, msg)
            assert took < 10.0, (rank, key, took)
        err = res[("DistributedOptimizer", "allreduce", 0)][0][1]
        assert "building DistributedOptimizer" in err and "allreduce(float32[3]" in err, err
        assert "broadcast_object(root_rank=0, name='epoch0')" in res["names"][0][1]
        assert "broadcast_object(root_rank=0, name='epoch1')" in res["names"][0][1]
        for key in ("refused_params", "refused_optimizer"):
            (classes, msg), alive, _ = res[key]
            assert alive == 2 and "ConfigError" in classes, (rank, key, msg)
            if rank == 0:
                assert "not a tensor" in msg or "takes a torch optimizer" in msg, (key, msg)
            else:
                assert "CollectiveMismatchError" in classes and "rank(s) [0] refused" in msg, (key, msg)
        assert res["matched"] == ({"rank": 1}, [0, 1])
    assert "already called join()" in out[0]["joined"], out[0]["joined"]


# ---------------------------------------------------------------- matched by call order, not by name
def rank_reordered_names(rank, world):
    # Horovod pairs these by name; here they pair by call order, so a reordered pair must raise
    # (the same shapes: ignoring the names would sum "loss" with "acc" without a word)
    names = ["loss", "acc"] if rank == 0 else ["acc", "loss"]
    out = {}
    for i, name in enumerate(names):
        out[i] = _catch(lambda: hvd.synchronize(hvd.allreduce_async(torch.full((3,), float(i)), name=name)))
    # the same order on every rank works
    h = [hvd.allreduce_async(torch.full((3,), float(rank)), name=n, op=hvd.Sum) for n in ("loss", "acc")]
    out["ordered"] = [hvd.synchronize(x).tolist() for x in h]
    return out


def test_reordered_named_collectives_raise_naming_both_names():
    out = run_ranks(rank_reordered_names, 2, timeout=60)
    for rank, res in enumerate(out):
        for i in (0, 1):
            err, alive = res[i]
            assert alive == 2 and err is not None, (rank, i)
            classes, msg = err
            assert "CollectiveMismatchError" in classes, (rank, msg)
            assert "name='loss'" in msg and "name='acc'" in msg and "call order" in msg, msg
        assert res["ordered"] == [[1.0] * 3, [1.0] * 3]


# ---------------------------------------------------------------- SparseAdam, gradients after broadcasts
_SPARSE_IDX = ([[1, 2, 4], [4, 3, 9]], [[0, 4, 4], [7, 7, 1]])


def rank_sparse_adam(rank, world, steps):
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True).double()
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                   sparse_as_dense=True)
    idx = torch.tensor(_SPARSE_IDX[rank])
    for _ in range(steps):
        opt.zero_grad()
        (emb(idx) * (rank + 1)).sum().backward()
        opt.step()
    return emb.weight.detach().numpy()


def test_sparse_as_dense_with_sparse_adam_matches_sparse_adam_on_the_averaged_gradient():
    steps = 3
    out = run_ranks(rank_sparse_adam, 2, steps, timeout=60)
    # reference: one process, SparseAdam fed the rank-averaged gradient as a sparse tensor
    torch.manual_seed(0)
    ref = nn.Embedding(10, 3, sparse=True).double()
    ref_opt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.1)
    grad = torch.zeros(10, 3, dtype=torch.float64)
    for rank, idx in enumerate(_SPARSE_IDX):
        for i in np.ravel(idx):
            grad[i] += (rank + 1) / 2
    for _ in range(steps):
        ref.weight.grad = grad.to_sparse(1)
        ref_opt.step()
    untouched = [5, 6, 8]  # no rank looked these rows up: SparseAdam leaves them
    torch.manual_seed(0)
    init = nn.Embedding(10, 3).double().weight.detach().numpy()
    for w in out:
        np.testing.assert_allclose(w, ref.weight.detach().numpy(), rtol=1e-12, atol=1e-14)
        np.testing.assert_array_equal(w[untouched], init[untouched])
        assert not np.allclose(w, init)
    np.testing.assert_array_equal(out[0], out[1])


class _NoGrad(nn.Module):
    """Horovod's test_broadcast_state_no_grad model: an int param without a gradient, one with."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
        self.b = nn.Parameter(torch.arange(4.0))

    def forward(self, x):
        return torch.index_select(self.b, 0, self.a.long()) * x


def rank_state_no_grad(rank, world):
    out = {}
    model = _NoGrad()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out["a_grad"] = model.a.grad
    grad = model.b.grad
    out["b_grad"] = None if grad is None else grad.numpy().copy()
    out["bgrad"] = hvd.broadcast(grad, root_rank=0).numpy()  # Horovod's test does this
    model(torch.ones(2)).sum().backward()   # adds to the zero gradient as to None
    opt.step()
    out["b"] = model.b.detach().numpy()
    # SparseAdam: the zero gradients are sparse (it refuses dense ones)
    emb = nn.Embedding(5, 2, sparse=True)
    sparse_opt = torch.optim.SparseAdam(list(emb.parameters()))
    hvd.broadcast_optimizer_state(sparse_opt, root_rank=0)
    out["sparse_grad"] = emb.weight.grad.is_sparse
    sparse_opt.step()  # accepted
    # a rank whose optimizer already has state is left alone (nothing to initialise)
    m2 = nn.Linear(2, 1)
    o2 = torch.optim.Adam(m2.parameters())
    m2(torch.ones(1, 2)).sum().backward()
    o2.step()
    o2.zero_grad()
    hvd.broadcast_optimizer_state(o2, root_rank=0)
    out["stateful_grads"] = [p.grad for p in m2.parameters()]
    return out


def test_broadcast_optimizer_state_leaves_zero_grads_as_horovod():
    out = run_ranks(rank_state_no_grad, 2, timeout=60)
    for res in out:
        assert res["a_grad"] is None  # requires_grad=False: no gradient
        np.testing.assert_array_equal(res["b_grad"], np.zeros(4, dtype=np.float32))
        np.testing.assert_array_equal(res["bgrad"], np.zeros(4, dtype=np.float32))
        # one SGD step on d/db of b[1] + b[3] (averaged over 2 identical ranks)
        np.testing.assert_allclose(res["b"], np.arange(4.0) - 0.1 * np.array([0, 1, 0, 1]), rtol=1e-6)
        assert res["sparse_grad"] is True
        assert res["stateful_grads"] == [None, None]


def test_broadcast_optimizer_state_world_of_one_leaves_zero_grads():
    model = _NoGrad()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert model.a.grad is None and torch.equal(model.b.grad, torch.zeros(4))


def rank_parameter_names(rank, world):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1))
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    return ([opt._parameter_names[p] for p in model.parameters()],
            [named._parameter_names[p] for p in model.parameters()])


def test_parameter_names_map_as_horovod():
    # Horovod's test_optimizer_no_named_parameters reads the {param: name} map: unique names, the
    # same on every rank, and the given names where named_parameters was passed
    out = run_ranks(rank_parameter_names, 2, timeout=60)
    unnamed, named = out[0]
    assert len(set(unnamed)) == 4 and out[1] == out[0]
    assert named == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_duplicate_names_are_refused_before_init():
    # Horovod's test_duplicate_names builds the optimizer without hvd.init(): the names are
    # checked first, whether or not the launch is initialized
    import flodl_opt
    net1, net2 = nn.Linear(2, 1), nn.Linear(2, 1)
    opt = torch.optim.SGD(list(net1.parameters()) + list(net2.parameters()), lr=0.1)
    named = list(net1.named_parameters()) + list(net2.named_parameters())
    was = flodl_opt.is_initialized()
    flodl_opt.shutdown()
    env = {k: os.environ.pop(k, None) for k in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK="0", WORLD_SIZE="2")  # as under a launcher, before init()
    try:
        with pytest.raises(ValueError, match="duplicate names"):
            hvd.DistributedOptimizer(opt, named_parameters=named)
    finally:
        for k, v in env.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
        if was:
            flodl_opt.init()
