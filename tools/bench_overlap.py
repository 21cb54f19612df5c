"""Benchmark: what syncs cost a real training loop, blocking vs overlapped vs fragmented.

Two Gloo ranks train the same MLP (forward, backward, AdamW) with ``LocalSGDOptimizer`` in
several sync modes, each on its own copy of the model, and the same loop with no sync at all
(``sync_every`` larger than the run) is the anchor timed in the same run. The variants run
interleaved, block by block, in a rotating order, so drift on a shared machine hits all alike; the
ratio a variant reports is the median over blocks of (its block time / the no-sync block time).
The raw ``all_reduce`` of the whole model and of one fragment, timed in the same run, says whether
tau inner steps take longer than the collective (the condition for hiding it).

Run::

    python tools/bench_overlap.py                          # 2 spawned Gloo ranks, CPU
    python tools/bench_overlap.py --params 4e6 --sync-every 16 --fragments 4 --overlap-steps 2
    python tools/bench_overlap.py --plot bench_overlap.png

    python tools/bench_overlap.py --device cuda            # 2 Gloo ranks sharing cuda:0
    python tools/bench_overlap.py --device cuda --backend nccl --ranks 1 --width 4096
                                                           # NCCL world of one, collectives forced

Peak bytes in flight per sync come from ``SyncStats.bytes`` (the largest over the run).

On CUDA every block ends with ``torch.cuda.synchronize()`` (the time includes the GPU's work).
Gloo ranks may share one GPU (CUDA tensors go through host copies). NCCL refuses two ranks on one
GPU, so ``--backend nccl --ranks 1`` makes a world of one and switches the sync's collectives on
by hand (a world of one normally makes none): the NCCL path (count, async all_reduce on NCCL's own
stream, the merge) really runs, but a one-rank all_reduce moves nothing over a link, so what this
measures is the sync's own GPU and host work (snapshot, scaling, merge, host reads), not hiding a
transfer.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402


def variants(cfg: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    k, p, tau = cfg["sync_every"], cfg["fragments"], cfg["overlap_steps"]
    return {
        "no sync (anchor)": {"sync_every": 10 ** 9},
        f"blocking K={k}": {"sync_every": k},
        f"overlapped tau={cfg['overlap_full']}": {"sync_every": k, "overlap_steps": cfg["overlap_full"]},
        f"fragmented P={p}": {"sync_every": k, "fragments": p},
        f"streaming P={p} tau={tau}": {"sync_every": k, "fragments": p, "overlap_steps": tau},
    }


def _model(cfg, seed):
    import torch
    torch.manual_seed(seed)
    w, layers = cfg["width"], cfg["layers"]
    mods = [torch.nn.Linear(cfg["inputs"], w), torch.nn.GELU()]
    for _ in range(layers - 2):
        mods += [torch.nn.Linear(w, w), torch.nn.GELU()]
    mods.append(torch.nn.Linear(w, 1))
    return torch.nn.Sequential(*mods)


def _bind(rank: int) -> None:
    """Pin this rank's threads (Gloo's included: they exist once the group does) to one core each,
    as ``mpirun --bind-to core`` does, so the OS cannot move a rank onto its peer's core."""
    cores = sorted(os.sched_getaffinity(0))
    core = {cores[rank % len(cores)]}
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), core)


def worker(rank: int, world: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    import flodl_opt as flo
    torch.set_num_threads(cfg["threads"])
    if cfg.get("bind"):
        _bind(rank)
    cuda = cfg["device"] == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    if world == 1 and not dist.is_initialized():
        # A world of one has no process group: make one of one rank (flo.init() adopts it), so the
        # forced collectives below have a group to run on.
        flo.shutdown()
        dist.init_process_group(cfg["backend"], init_method=f"tcp://127.0.0.1:{bc._free_port()}",
                                rank=0, world_size=1)
        flo.init()
    runs = {}
    for name, kw in variants(cfg).items():
        model = _model(cfg, 0).to(dev)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if cuda else {}))
        opt = flo.LocalSGDOptimizer(inner, model=model, outer=cfg["outer"], stall_warning_s=None, **kw)
        if world == 1:  # force the collectives of a world of one
            opt._consensus.distributed = True
            if opt._stream is not None:
                opt._stream.distributed = True
        runs[name] = (model, opt, [])
    n_params = sum(p.numel() for p in runs["no sync (anchor)"][0].parameters())
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(cfg["batch"], cfg["inputs"], generator=g).to(dev) for _ in range(8)]

    def block(name, model, opt) -> float:
        if cuda:
            torch.cuda.synchronize(dev)
        if cfg["align"] and world > 1:
            # Start every block with the ranks together, untimed: otherwise the drift the ranks
            # pick up in the previous block (the anchor's above all, which never waits) is paid by
            # the first sync of whichever variant comes next, not by the variant that made it.
            dist.barrier()
        t0 = time.perf_counter()
        for i in range(cfg["steps"]):
            opt.zero_grad(set_to_none=True)
            model(xs[i % len(xs)]).pow(2).mean().backward()
            opt.step()
            s = opt.last_sync  # an attribute read in every variant alike
            if s is not None and s.bytes > peak[name]:
                peak[name] = s.bytes
        if cuda:
            torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) * 1e3 / cfg["steps"]

    names = list(runs)
    peak: Dict[str, int] = {n: 0 for n in names}
    t_start = time.perf_counter()
    total = cfg["warmup"] + cfg["reps"]
    for rep in range(total):
        order = names[rep % len(names):] + names[:rep % len(names)]  # rotate who goes first
        for n in order:
            model, opt, times = runs[n]
            ms = block(n, model, opt)
            if rep >= cfg["warmup"]:
                times.append(ms)
        if rank == 0:
            done = rep + 1
            el = time.perf_counter() - t_start
            print(f"  rep {done}/{total}  {done * len(names) * cfg['steps'] / el:.0f} steps/s  "
                  f"ETA {el / done * (total - done):.0f}s", flush=True)
    # The collective alone: the whole model, and one fragment, as a raw all_reduce.
    raw = {}
    for label, numel in (("model", n_params), ("fragment", n_params // cfg["fragments"])):
        t = torch.zeros(numel, device=dev if cfg["backend"] == "nccl" or cuda else "cpu")
        ms = []
        for _ in range(cfg["raw_reps"]):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            dist.all_reduce(t)
            if cuda:
                torch.cuda.synchronize(dev)
            ms.append((time.perf_counter() - t0) * 1e3)
        raw[label] = bc.median(ms)
    anchor = runs[names[0]][2]
    rows = []
    for n in names:
        times = runs[n][2]
        rows.append({"mode": n, "ms/step": bc.median(times),
                     "ratio": bc.median([a / b for a, b in zip(times, anchor)]),
                     "peak bytes/sync": peak[n], "syncs": runs[n][1].sync_count})
    for _, opt, _ in runs.values():
        opt.sync() if opt.sync_every < 10 ** 9 else None
    return {"rows": rows, "raw_ms": raw, "params": n_params}


def report(results: List[Dict[str, Any]], cfg: Dict[str, Any]) -> Dict[str, Any]:
    r0 = results[0]
    step_ms = r0["rows"][0]["ms/step"]
    rows = []
    blocking_bytes = max(r["peak bytes/sync"] for r in r0["rows"])
    for k, row in enumerate(r0["rows"]):
        other = results[1]["rows"][k] if len(results) > 1 else row
        rows.append({**row, "ratio rank 1": other["ratio"],
                     "bytes vs blocking": row["peak bytes/sync"] / blocking_bytes if blocking_bytes else 0.0})
    where = (f"{cfg['ranks']} {cfg['backend'].upper()} rank(s) on {cfg['device']}"
             + (" (world of one, collectives forced)" if cfg["ranks"] == 1 else ""))
    print(f"\nbench_overlap: {r0['params'] / 1e6:.2f}M params MLP, AdamW, outer={cfg['outer']}, {where} "
          f"x {cfg['threads']} thread(s); {cfg['steps']} steps per block, median of {cfg['reps']} "
          "interleaved blocks")
    print(f"no-sync step {step_ms:.2f} ms; raw all_reduce: model {r0['raw_ms']['model']:.2f} ms, "
          f"1/{cfg['fragments']} fragment {r0['raw_ms']['fragment']:.2f} ms; "
          f"tau={cfg['overlap_steps']} steps = {cfg['overlap_steps'] * step_ms:.2f} ms")
    cols = ["mode", "ms/step", "ratio", "ratio rank 1", "peak bytes/sync", "bytes vs blocking", "syncs"]
    print(bc.table(rows, cols, {"ms/step": ".3f", "ratio": ".4f", "ratio rank 1": ".4f",
                                "bytes vs blocking": ".3f"}))
    print("target: ratio <= 1.05 for the overlapped modes when tau steps take longer than the collective")
    payload = {"benchmark": "bench_overlap", "config": cfg, "machine": bc.machine(), "rows": rows,
               "raw_allreduce_ms": r0["raw_ms"], "no_sync_step_ms": step_ms,
               "per_rank": results, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    bc.write_json(cfg["json"], payload)
    if cfg["json"]:
        print(f"wrote {cfg['json']}")
    return payload


def plot(payload: Dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = payload["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [r["mode"] for r in rows]
    axes[0].barh(names, [r["ratio"] for r in rows], color="tab:blue")
    axes[0].axvline(1.05, color="k", ls="--", lw=1)
    axes[0].set_xlabel("loop time / no-sync loop time")
    axes[1].barh(names, [r["bytes vs blocking"] for r in rows], color="tab:orange")
    axes[1].set_xlabel("peak bytes in flight per sync / blocking")
    axes[1].set_yticklabels([])
    c = payload["config"]
    fig.suptitle(f"bench_overlap: loop with syncs vs without, {c.get('ranks', 2)} {c.get('backend', 'gloo')} "
                 f"rank(s), {c.get('device', 'cpu')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--layers", type=int, default=9,
                   help="Linear layers (layers-1 equal width x width ones: fragments of equal bytes)")
    p.add_argument("--inputs", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--sync-every", type=int, default=16)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--overlap-steps", type=int, default=2, help="tau of the streaming row (< K/P)")
    p.add_argument("--overlap-full", type=int, default=4, help="tau of the overlapped, one-fragment row")
    p.add_argument("--outer", default="avg", choices=["avg", "diloco"])
    p.add_argument("--steps", type=int, default=32, help="steps per timed block (a multiple of K)")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--raw-reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--ranks", type=int, default=2, help="ranks (nccl on one GPU: 1)")
    p.add_argument("--bind", action="store_true",
                   help="pin rank r and its threads to core r (as mpirun --bind-to core; Linux)")
    p.add_argument("--no-align", dest="align", action="store_false",
                   help="do not start each block with a barrier (the runs before 2026-12-04 did not)")
    p.add_argument("--json", default="bench_overlap.json")
    p.add_argument("--plot", default=None, help="write a PNG of the ratios (needs matplotlib)")
    a = p.parse_args(argv)
    cfg = {k: getattr(a, k) for k in ("width", "layers", "inputs", "batch", "sync_every", "fragments",
                                      "overlap_steps", "overlap_full", "outer", "steps", "reps",
                                      "warmup", "raw_reps", "threads", "json", "device", "backend",
                                      "ranks", "bind", "align")}
    if a.backend == "nccl" and a.device != "cuda":
        p.error("--backend nccl needs --device cuda")
    results = bc.spawn(worker, a.ranks, cfg, backend=a.backend)
    payload = report(results, cfg)
    if a.plot:
        plot(payload, a.plot)


if __name__ == "__main__":
    main()
