"""Benchmark: per-step time of torch DDP, ``flo.DistributedOptimizer`` and the bare loop, side by side.

The same MLP (``--depth`` square layers sized to 1M, 10M, 50M parameters by default) trains with
plain SGD three ways on the same ranks: the bare loop (no communication at all), torch
``DistributedDataParallel`` (its defaults: 25 MiB buckets, reduced during backward), and
``flo.DistributedOptimizer`` (buckets of ``--bucket-mb``, reduced during backward). A step is
``zero_grad(); loss.backward(); opt.step()``. The variants run interleaved (one block of steps each,
in a rotating order, ``--reps`` times), every block starts after a barrier and counts the slowest
rank, and each ratio to DDP is the median of the per-rep ratios, so drift on a shared machine hits
all variants alike.

Run::

    python tools/bench_dp.py                                  # 2 spawned Gloo ranks, CPU
    python tools/bench_dp.py --sizes 10e6 --bucket-mb 4,25,64 --no-overlap   # bucket size study
    torchrun --nproc-per-node 2 tools/bench_dp.py             # under a launcher
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402


def _mlp(params: int, depth: int, seed: int = 0):
    import torch
    width = max(8, int(math.sqrt(params / depth)))
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]), width


def _variants(cfg) -> List[str]:
    names = ["bare", "ddp"]
    if cfg["ddp_view"]:
        names.append("ddp, bucket view")
    names += [f"flo {mb:g}MiB" for mb in cfg["bucket_mb"]]
    if cfg["no_overlap"]:
        names.append("flo, no overlap")
    return names


def _build(name: str, params: int, cfg):
    """(model, optimizer) for one variant; every variant starts from the same weights."""
    import torch
    import flodl_opt as flo
    model, width = _mlp(params, cfg["depth"])
    sgd = lambda ps: torch.optim.SGD(ps, lr=1e-4)  # noqa: E731
    if name == "bare":
        return model, sgd(model.parameters()), width
    if name.startswith("ddp"):
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=name.endswith("view"))
        return ddp, sgd(ddp.parameters()), width
    if name == "flo, no overlap":
        opt = flo.DistributedOptimizer(sgd(model.parameters()), overlap=False)
        return model, opt, width
    mb = float(name.split()[1][:-3])
    return model, flo.DistributedOptimizer(sgd(model.parameters()), bucket_bytes=int(mb * 2 ** 20)), width


def worker(rank: int, world: int, cfg: Dict[str, Any]) -> List[Dict[str, Any]]:
    import torch
    import torch.distributed as dist
    import flodl_opt as flo
    flo.init()
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    names = _variants(cfg)
    rows = []
    t_start = time.monotonic()
    for si, params in enumerate(cfg["sizes"]):
        built = {n: _build(n, params, cfg) for n in names}
        width = built["bare"][2]
        n_params = sum(p.numel() for p in built["bare"][0].parameters())
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(cfg["batch"], width, generator=g)
        y = torch.randn(cfg["batch"], width, generator=g)

        def step(name):
            model, opt, _ = built[name]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        def block(name, steps) -> float:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step(name)
            t = torch.tensor([(time.perf_counter() - t0) / steps * 1e3])
            # CPU time of every thread of this rank (Gloo's included): the work a step costs,
            # which other jobs on a shared machine disturb far less than the wall time.
            c = torch.tensor([(time.process_time() - c0) / steps * 1e3])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's step
            dist.all_reduce(c, op=dist.ReduceOp.SUM)
            cpu[name].append(float(c) / world)
            return float(t)

        for n in names:
            for _ in range(cfg["warmup"]):
                step(n)
        # Steps per block from DDP's warm step time (rank 0's choice, so every rank runs the same).
        cpu: Dict[str, List[float]] = {n: [] for n in names}
        probe = block("ddp", 1)
        steps = flo.broadcast_object(max(1, min(200, round(cfg["block_s"] * 1e3 / probe))), 0)
        ms: Dict[str, List[float]] = {n: [] for n in names}
        cpu: Dict[str, List[float]] = {n: [] for n in names}
        for rep in range(cfg["reps"]):
            k = rep % len(names)
            for n in names[k:] + names[:k]:  # rotate who goes first
                ms[n].append(block(n, steps))
            if rank == 0:
                done = (si * cfg["reps"] + rep + 1) / (len(cfg["sizes"]) * cfg["reps"])
                el = time.monotonic() - t_start
                print(f"[bench_dp] {n_params / 1e6:.1f}M params, rep {rep + 1}/{cfg['reps']} "
                      f"({steps} steps/block): " + ", ".join(f"{n} {ms[n][-1]:.1f} ms" for n in names)
                      + f" | {el:.0f}s elapsed, ETA {el / done - el:.0f}s", flush=True)
        row: Dict[str, Any] = {"params": n_params, "width": width, "depth": cfg["depth"],
                               "steps/block": steps}
        for n in names:
            row[f"{n} ms"] = bc.median(ms[n])
            row[f"{n} cpu ms"] = bc.median(cpu[n][-cfg["reps"]:])
            if n != "ddp":
                row[f"{n} / ddp"] = bc.median([a / b for a, b in zip(ms[n], ms["ddp"])])
                row[f"{n} / ddp cpu"] = bc.median([a / b for a, b in zip(cpu[n][-cfg["reps"]:],
                                                                          cpu["ddp"][-cfg["reps"]:])])
        row["reps"] = ms
        row["reps cpu"] = {n: v[-cfg["reps"]:] for n, v in cpu.items()}
        rows.append(row)
        del built
    return rows


def report(rows: List[Dict[str, Any]], cfg: Dict[str, Any]) -> None:
    names = _variants(cfg)
    for r in rows:
        r["size"] = f"{r['params'] / 1e6:.1f}M"
    cols = ["size"] + [f"{n} ms" for n in names] + [f"{n} / ddp" for n in names if n != "ddp"]
    print(f"\nbench_dp: {cfg['world']} Gloo ranks, {cfg['threads'] or 'default'} thread(s) each, "
          f"MLP of {cfg['depth']} layers, batch {cfg['batch']}, SGD; median of {cfg['reps']} "
          f"interleaved reps (target: flo / ddp <= 1.05)")
    fmt = {c: ".1f" for c in cols if c.endswith("ms")} | {c: ".3f" for c in cols if c.endswith("/ ddp")}
    print(bc.table(rows, cols, fmt))
    print("\nCPU time per step (all threads of a rank, mean of the ranks; median of the reps):")
    ccols = ["size"] + [f"{n} cpu ms" for n in names] + [f"{n} / ddp cpu" for n in names if n != "ddp"]
    print(bc.table(rows, ccols, {c: ".1f" for c in ccols if c.endswith("ms")}
                   | {c: ".3f" for c in ccols if c.endswith("cpu") and "/" in c}))
    bc.write_json(cfg["json"], {"benchmark": "bench_dp", "config": cfg, "machine": bc.machine(),
                                "rows": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    if cfg["json"]:
        print(f"wrote {cfg['json']}")
    if cfg["plot"]:
        plot(rows, names, cfg["plot"])


def plot(rows, names, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install flodl_opt[plot]); no plot")
        return
    others = [n for n in names if n != "ddp"]
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.8 / len(others)
    for k, n in enumerate(others):
        ax.bar([i + k * w for i in range(len(rows))], [r[f"{n} / ddp"] for r in rows], w, label=n)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.05, color="r", lw=0.8, ls="--", label="target 1.05")
    ax.set_xticks([i + w * (len(others) - 1) / 2 for i in range(len(rows))], [r["size"] for r in rows])
    ax.set_ylabel("step time / DDP's")
    ax.set_title("bench_dp: per-step time relative to torch DDP (Gloo)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1e6,10e6,50e6", help="parameter counts, comma separated")
    p.add_argument("--depth", type=int, default=8, help="Linear layers per MLP")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--bucket-mb", default="25", help="DistributedOptimizer bucket sizes (MiB), "
                                                      "one variant each")
    p.add_argument("--no-overlap", action="store_true", help="add DistributedOptimizer(overlap=False)")
    p.add_argument("--ddp-view", action="store_true", help="add DDP(gradient_as_bucket_view=True)")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--block-s", type=float, default=0.5, help="seconds per timed block (sets steps)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank (0: leave)")
    p.add_argument("--json", default="bench_dp.json")
    p.add_argument("--plot", default="bench_dp.png", help="'' for none")
    a = p.parse_args(argv)
    cfg = {"sizes": [int(float(s)) for s in a.sizes.split(",")], "depth": a.depth, "batch": a.batch,
           "bucket_mb": [float(s) for s in a.bucket_mb.split(",")], "no_overlap": a.no_overlap,
           "ddp_view": a.ddp_view, "reps": a.reps, "block_s": a.block_s, "warmup": a.warmup,
           "threads": a.threads, "json": a.json, "plot": a.plot, "world": a.ranks}
    if bc.under_launcher():
        import flodl_opt as flo
        flo.init()
        cfg["world"] = flo.size()
        rows = worker(flo.rank(), flo.size(), cfg)
        if flo.rank() == 0:
            report(rows, cfg)
        flo.shutdown()
        return
    rows = bc.spawn(worker, a.ranks, cfg)[0]
    report(rows, cfg)


if __name__ == "__main__":
    main()
