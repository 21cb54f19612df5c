"""Benchmark: what ``LocalSGDOptimizer.step()`` adds to a step that does not sync.

Against the bare loop written by hand on an identical model (same sizes, same values, same
gradients): ``clip_grad_norm_`` + ``opt.step()`` + ``sched.step()``. The wrapped optimizer gets the
same ``max_grad_norm`` and scheduler and a ``sync_every`` so large that no sync happens, so the
ratio is the wrapper's own per-step overhead. The two run interleaved (A B A B ...), each rep a
block of steps, and the ratio is the median of the per-pair ratios, so drift on a shared machine
hits both alike.

Run::

    python tools/bench_step.py                    # world of one and 2 spawned Gloo ranks, CPU
    python tools/bench_step.py --device cuda      # on a GPU (world of one)
    torchrun --nproc-per-node 2 tools/bench_step.py --device cuda
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402


def optimizers(device: str) -> Dict[str, Any]:
    """Inner optimizers to compare: SGD and AdamW, foreach and fused where this torch has them."""
    import torch
    out = {
        "SGD momentum, for-loop": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, foreach=False),
        "SGD momentum, foreach": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, foreach=True),
        "AdamW, for-loop": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False),
        "AdamW, foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
        "AdamW, fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    }
    probe = [torch.nn.Parameter(torch.zeros(4, device=device))]
    probe[0].grad = torch.zeros(4, device=device)
    for name in list(out):
        try:
            out[name](probe).step()
        except (RuntimeError, TypeError, ValueError):
            del out[name]  # this torch / device has no such implementation
    return out


def _params(sizes, device, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    ps = []
    for n in sizes:
        p = torch.nn.Parameter((torch.rand(bc.shape_of(n), generator=g) - 0.5).to(device))
        p.grad = ((torch.rand(p.shape, generator=g) - 0.5) * 0.1).to(device)
        ps.append(p)
    return ps


def _sched(opt):
    import torch
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 1000))


def worker(rank: int, world: int, cfg: Dict[str, Any]) -> List[Dict[str, Any]]:
    import torch
    import flodl_opt as flo
    flo.init()
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])  # a fixed share: fewer threads, less noise when shared
    device = cfg["device"] if cfg["device"] != "cuda" else str(flo.device() if flo.size() > 1 else "cuda")
    sizes = bc.model_like_sizes(cfg["params"], cfg["tensors"], seed=7)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    rows = []
    for name, make in optimizers(device).items():
        bare_p = _params(sizes, device, 0)
        bare_opt = make(bare_p)
        bare_sched = _sched(bare_opt)
        wrap_p = _params(sizes, device, 0)
        inner = make(wrap_p)
        wrap = flo.LocalSGDOptimizer(inner, sync_every=10 ** 9, max_grad_norm=cfg["clip"],
                                     lr_scheduler=_sched(inner))

        def bare_step():
            torch.nn.utils.clip_grad_norm_(bare_p, cfg["clip"])
            bare_opt.step()
            bare_sched.step()

        def block(fn) -> float:
            sync()
            t0 = time.perf_counter()
            for _ in range(cfg["steps"]):
                fn()
            sync()
            return (time.perf_counter() - t0) / cfg["steps"] * 1e3

        for _ in range(cfg["warmup"]):
            block(bare_step)
            block(wrap.step)
        bare_ms, wrap_ms = [], []
        for i in range(cfg["reps"]):
            # A B, then B A: each variant goes first half the time.
            if i % 2 == 0:
                bare_ms.append(block(bare_step))
                wrap_ms.append(block(wrap.step))
            else:
                wrap_ms.append(block(wrap.step))
                bare_ms.append(block(bare_step))
        assert wrap.sync_count == 0
        rows.append({"optimizer": name, "bare ms": bc.median(bare_ms), "wrapped ms": bc.median(wrap_ms),
                     "ratio": bc.median([w / b for w, b in zip(wrap_ms, bare_ms)]),
                     "pairs": [[b, w] for b, w in zip(bare_ms, wrap_ms)]})
        del bare_p, wrap_p, bare_opt, inner, wrap
    return rows


def report(all_rows, cfg) -> None:
    cols = ["world", "device", "optimizer", "bare ms", "wrapped ms", "ratio", "target"]
    print(f"\nbench_step: {cfg['params'] / 1e6:g}M params in {cfg['tensors']} tensors, clip + LambdaLR, "
          f"no sync; {cfg['steps']} steps per block, median of {cfg['reps']} interleaved pairs")
    print(bc.table(all_rows, cols, {"bare ms": ".3f", "wrapped ms": ".3f", "ratio": ".4f"}))
    bc.write_json(cfg["json"], {"benchmark": "bench_step", "config": cfg, "machine": bc.machine(),
                                "rows": all_rows,
                                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    if cfg["json"]:
        print(f"wrote {cfg['json']}")


def _tag(rows, world, device, rank=None):
    for r in rows:
        r.update({"world": world if rank is None else f"{world} (rank {rank})", "device": device,
                  "target": "<= 1.01" if world == 1 else "<= 1.02"})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--params", type=float, default=2e6, help="total parameter count")
    p.add_argument("--tensors", type=int, default=40)
    p.add_argument("--steps", type=int, default=20, help="steps per timed block")
    p.add_argument("--reps", type=int, default=15, help="interleaved pairs of blocks")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--ranks", type=int, default=2, help="spawned Gloo ranks for the multi-rank case "
                                                         "(0: world of one only)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank (0: leave)")
    p.add_argument("--json", default="bench_step.json")
    a = p.parse_args(argv)
    cfg = {"device": a.device, "params": int(a.params), "tensors": a.tensors, "steps": a.steps,
           "reps": a.reps, "warmup": a.warmup, "clip": a.clip, "json": a.json,
           "threads": a.threads}
    if bc.under_launcher():
        import torch.distributed as dist
        import flodl_opt as flo
        flo.init()
        rows = worker(flo.rank(), flo.size(), cfg)
        gathered = [None] * flo.size()
        dist.all_gather_object(gathered, rows)
        if flo.rank() == 0:
            report([r for k, rs in enumerate(gathered) for r in _tag(rs, flo.size(), a.device, k)], cfg)
        flo.shutdown()
        return
    rows = _tag(worker(0, 1, cfg), 1, a.device)
    if a.ranks > 1 and a.device == "cpu":
        per_rank = bc.spawn(worker, a.ranks, cfg)
        for k, rs in enumerate(per_rank):
            rows += _tag(rs, a.ranks, a.device, k)
    report(rows, cfg)


if __name__ == "__main__":
    main()
