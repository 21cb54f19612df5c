"""Benchmark: the cost of one sync against the raw all_reduce floor and PyTorch's model averagers.

For a model-like parameter set (many tensors of mixed sizes) of each requested size, times in the
same run, with the same tensors and the same process group:

* ``floor``: one ``dist.all_reduce`` (SUM) of a single flat float32 tensor of the same element count;
* ``floor, chunked``: the same tensor reduced in chunks issued async (the pipeline shape the
  library uses on Gloo), a second, fairer anchor;
* ``flo avg``: ``LocalSGDOptimizer.sync()`` with plain averaging, with its default config and with
  ``keep_presync=False`` / ``nonfinite_guard=False`` so each feature's cost is visible;
* ``flo diloco``: the same with ``outer="diloco"``;
* ``flo ..., wire X``: compressed syncs (``wire="bf16" | "fp16" | "int8"``), each rank's difference
  from the anchor sent narrow (a random untimed update before each sync, so there is one to send);
  ``bytes x floor`` is their bytes handed to collectives over the float32 all_reduce's;
* ``torch average_parameters`` / ``torch PeriodicModelAverager``: PyTorch's
  ``torch.distributed.algorithms.model_averaging`` on the same parameters.

With ``--base COMMIT`` every ``flo ...`` method is also timed with that commit's package (extracted
with ``git archive``, imported as ``flodl_opt_base`` in the ranks), interleaved with the current
one rep by rep, and a second table gives both medians and the ratio now/base. ``--base`` also takes
a folder that already holds a ``flodl_opt_base`` package (for a machine without the git history).

Each is reported as the median over repetitions (a barrier before each, the slowest rank's time
per repetition), as a ratio to the floor, with the bytes handed to collectives per rank and the peak
memory above the params themselves (RSS on CPU, ``torch.cuda.max_memory_allocated`` on GPU).

Run::

    python tools/bench_sync.py                       # 2 spawned Gloo ranks on CPU, 1M/10M/50M
    python tools/bench_sync.py --ranks 4 --sizes 10M --reps 15 --json out.json
    python tools/bench_sync.py --sizes 10M,50M --only "flo avg,flo diloco,wire int8" --base fe50f4b
    torchrun --nproc-per-node 2 tools/bench_sync.py  # under a launcher: NCCL on GPUs, else Gloo
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
import warnings
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402

FLOOR = "floor: all_reduce"
FLOOR_CHUNKED = "floor: chunked all_reduce"
BASE_PACKAGE = "flodl_opt_base"  # the name --base's package is imported under
BASE_SUFFIX = " [base]"          # appended to a method's name when it runs the base package


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


# ------------------------------------------------------------------ variants
class Variant:
    """One way of averaging ``total`` float32 elements. ``prepare`` is untimed, ``run`` is timed."""

    name = "?"

    def __init__(self, sizes: List[int], device, group_size: int, rank: int, chunk_bytes: int):
        self.sizes, self.device, self.world, self.rank = sizes, device, group_size, rank
        self.total = sum(sizes)
        self.chunk_bytes = chunk_bytes
        self.bytes = self.total * 4

    def make_params(self):
        import torch
        gen = torch.Generator().manual_seed(1234 + self.rank)
        out = []
        for n in self.sizes:
            t = torch.empty(bc.shape_of(n)).uniform_(-1.0, 1.0, generator=gen)
            out.append(torch.nn.Parameter(t.to(self.device)))
        return out

    def prepare(self) -> None:
        pass

    def run(self) -> None:
        raise NotImplementedError

    def extra(self) -> Dict[str, Any]:
        return {}


class Floor(Variant):
    name = FLOOR

    def __init__(self, *a):
        super().__init__(*a)
        import torch
        self.flat = torch.empty(self.total, device=self.device).uniform_(-1.0, 1.0)

    def run(self) -> None:
        import torch.distributed as dist
        dist.all_reduce(self.flat, op=dist.ReduceOp.SUM)


class FloorChunked(Floor):
    name = FLOOR_CHUNKED

    def run(self) -> None:
        import torch.distributed as dist
        step = max(1, self.chunk_bytes // 4)
        works = [dist.all_reduce(self.flat[s:s + step], op=dist.ReduceOp.SUM, async_op=True)
                 for s in range(0, self.total, step)]
        for w in works:
            w.wait()


class Flo(Variant):
    """``LocalSGDOptimizer.sync()``; one untimed local step first so the rank has work to vote."""

    kwargs: Dict[str, Any] = {}
    package = "flodl_opt"

    def __init__(self, *a):
        super().__init__(*a)
        import importlib
        import torch
        flo = importlib.import_module(self.package)
        self.params = self.make_params()
        kw = dict(self.kwargs)
        kw.setdefault("broadcast_initial", False)
        if self.device.type == "cpu":
            kw["gloo_chunk_bytes"] = self.chunk_bytes
        self.opt = flo.LocalSGDOptimizer(torch.optim.SGD(self.params, lr=0.1), sync_every=10 ** 9, **kw)
        self.stats = None

    def prepare(self) -> None:
        self.opt.step()  # no grads: a no-op inner step that still counts as this rank's work

    def run(self) -> None:
        self.stats = self.opt.sync()

    def extra(self) -> Dict[str, Any]:
        s = self.stats
        if s is None:
            return {}
        self.bytes = s.bytes
        # which package really ran it: the current one or --base's
        return {"collectives": s.collectives, "package": type(self.opt).__module__.split(".")[0]}


class FloWire(Flo):
    """A compressed sync: each rank first moves its params by a small random update (untimed)."""

    def prepare(self) -> None:
        import torch
        with torch.no_grad():
            for q in self.params:
                q.add_(torch.randn_like(q), alpha=1e-3)
        super().prepare()


def flo_variant(label: str, **kwargs) -> type:
    base = FloWire if "wire" in kwargs else Flo
    if "wire" in kwargs:
        kwargs.setdefault("broadcast_initial", True)  # compressed syncs need a common anchor
    return type("Flo_" + label, (base,), {"name": label, "kwargs": kwargs})


class TorchAverageParameters(Variant):
    name = "torch average_parameters"

    def __init__(self, *a):
        super().__init__(*a)
        self.params = self.make_params()

    def run(self) -> None:
        from torch.distributed.algorithms.model_averaging import utils
        utils.average_parameters(iter(self.params), None)


class TorchPeriodic(Variant):
    name = "torch PeriodicModelAverager"

    def __init__(self, *a):
        super().__init__(*a)
        import torch
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        self.params = self.make_params()
        for q in self.params:  # it averages only params with a grad; a zero view costs no memory
            q.grad = torch.zeros((), device=q.device).expand_as(q)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # it warns that period=1 is plain averaging: on purpose
            self.averager = PeriodicModelAverager(period=1, warmup_steps=0)

    def run(self) -> None:
        self.averager.average_parameters(self.params)


VARIANTS = [
    Floor, FloorChunked,
    flo_variant("flo avg"),
    flo_variant("flo avg, keep_presync=False", keep_presync=False),
    flo_variant("flo avg, nonfinite_guard=False", nonfinite_guard=False),
    flo_variant("flo avg, both off", keep_presync=False, nonfinite_guard=False),
    flo_variant("flo diloco", outer="diloco"),
    flo_variant("flo diloco, keep_presync=False", outer="diloco", keep_presync=False),
    flo_variant("flo avg, wire bf16", wire="bf16"),
    flo_variant("flo avg, wire fp16", wire="fp16"),
    flo_variant("flo avg, wire int8", wire="int8"),
    flo_variant("flo avg, wire int8 + error feedback", wire="int8", error_feedback=True),
    flo_variant("flo diloco, wire bf16", outer="diloco", wire="bf16"),
    flo_variant("flo diloco, wire int8", outer="diloco", wire="int8"),
    TorchAverageParameters, TorchPeriodic,
]


def base_twin(cls: type) -> type:
    """``cls`` (a ``Flo`` variant) run with the base package, under its name plus ``BASE_SUFFIX``."""
    return type(cls.__name__ + "_base", (cls,), {"name": cls.name + BASE_SUFFIX, "package": BASE_PACKAGE})


def resolve_base(spec: str) -> str:
    """The folder to put on ``sys.path`` for ``flodl_opt_base``: ``spec`` itself where it holds that
    package, else ``spec``'s commit extracted (tests/dist_harness.py's ``base_package``)."""
    if os.path.isdir(os.path.join(spec, BASE_PACKAGE)):
        return os.path.abspath(spec)
    import tempfile
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from dist_harness import base_package
    out = base_package(tempfile.mkdtemp(prefix="bench_sync_base_"), spec)
    if out is None:
        raise SystemExit(f"bench_sync: --base {spec!r} is neither a folder holding {BASE_PACKAGE}/ nor a "
                         "commit git can archive here; extract the package (git archive) and pass its folder")
    return out


# ------------------------------------------------------------------ per rank
def _sync_device(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(v: Variant, device) -> float:
    import torch.distributed as dist
    v.prepare()
    _sync_device(device)
    dist.barrier()
    t0 = time.perf_counter()
    v.run()
    _sync_device(device)
    return (time.perf_counter() - t0) * 1e3


def worker(rank: int, world: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    import flodl_opt as flo
    device = flo.device()
    probe = bc.MemoryProbe(device)
    wanted = [v for v in VARIANTS if not cfg["only"] or any(
        k == v.name if cfg.get("exact") else k in v.name for k in cfg["only"])]
    if not any(v is Floor for v in wanted):
        wanted.insert(0, Floor)
    if cfg.get("base_dir"):
        sys.path.insert(0, cfg["base_dir"])
        # Each method right after its base twin: both see the same drift of the machine.
        wanted = [c for v in wanted for c in ((v, base_twin(v)) if issubclass(v, Flo) else (v,))]
    out: Dict[str, Any] = {}
    # Warm every variant once on a small set: lazy imports and one-off buffers stay out of the figures.
    small = (bc.model_like_sizes(100_000, cfg["tensors"]), device, world, rank, cfg["chunk_bytes"])
    for cls in wanted:
        _timed(cls(*small), device)
    gc.collect()
    for total in cfg["sizes"]:
        sizes = bc.model_like_sizes(total, cfg["tensors"], seed=total)
        args = (sizes, device, world, rank, cfg["chunk_bytes"])
        res: Dict[str, Any] = {"tensors": len(sizes)}
        # Memory, one variant at a time: peak above the baseline, minus the params themselves.
        mem: Dict[str, int] = {}
        for cls in wanted:
            gc.collect()
            base = probe.now()
            v = cls(*args)
            for _ in range(2):
                _timed(v, device)           # first sync allocates persistent scratch: keep it
            probe.reset_peak()
            for _ in range(2):
                _timed(v, device)
            mem[cls.name] = probe.peak() - base - total * 4
            del v
        # Time, all variants alive, interleaved rep by rep so drift hits them all alike.
        variants = [cls(*args) for cls in wanted]
        times: Dict[str, List[float]] = {v.name: [] for v in variants}
        for _ in range(cfg["warmup"]):
            for v in variants:
                _timed(v, device)
        for _ in range(cfg["reps"]):
            for v in variants:
                times[v.name].append(_timed(v, device))
        # extra() first: it records the bytes a sync really handed over (SyncStats.bytes).
        info = {v.name: {**v.extra(), "bytes": v.bytes} for v in variants}
        del variants
        gc.collect()
        res.update({"times": times, "mem": mem, "info": info})
        out[str(total)] = res
    return out


def combine(per_rank: List[Dict[str, Any]], cfg: Dict[str, Any]) -> List[Dict[str, Any]]:
    rows = []
    for total in cfg["sizes"]:
        key = str(total)
        r0 = per_rank[0][key]
        names = list(r0["times"])
        # The slowest rank's time per repetition, then the median over repetitions.
        med = {n: bc.median([max(r[key]["times"][n][i] for r in per_rank)
                             for i in range(len(r0["times"][n]))]) for n in names}
        for n in names:
            mem = max(r[key]["mem"][n] for r in per_rank)
            rows.append({
                "params": bc_size(total), "elements": total, "tensors": r0["tensors"], "method": n,
                "ms": med[n],
                "x floor": med[n] / med[FLOOR],
                "x chunked": med[n] / med[FLOOR_CHUNKED] if FLOOR_CHUNKED in med else None,
                "MB moved": r0["info"][n]["bytes"] / 1e6,
                "bytes x floor": r0["info"][n]["bytes"] / r0["info"][FLOOR]["bytes"],
                "collectives": r0["info"][n].get("collectives", 1 if "chunked" not in n else None),
                "package": r0["info"][n].get("package"),
                "extra MB": mem / 1e6,
                "extra copies": mem / (total * 4),
                "reps": len(r0["times"][n]),
                "all ms": [max(r[key]["times"][n][i] for r in per_rank)
                           for i in range(len(r0["times"][n]))],
            })
    return rows


def compare_rows(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each method timed with both packages: both medians and now/base."""
    base = {(r["params"], r["method"][:-len(BASE_SUFFIX)]): r for r in rows if r["method"].endswith(BASE_SUFFIX)}
    out = []
    for r in rows:
        b = base.get((r["params"], r["method"]))
        if b is not None:
            out.append({"params": r["params"], "method": r["method"], "now ms": r["ms"], "base ms": b["ms"],
                        "now/base": r["ms"] / b["ms"], "now x floor": r["x floor"], "base x floor": b["x floor"],
                        "MB moved now": r["MB moved"], "MB moved base": b["MB moved"], "reps": r["reps"]})
    return out


def bc_size(n: int) -> str:
    for unit, div in (("G", 10 ** 9), ("M", 10 ** 6), ("K", 10 ** 3)):
        if n >= div and n % (div // 10 or 1) == 0:
            return f"{n / div:g}{unit}"
    return str(n)


def report(rows, cfg, world, backend) -> None:
    cols = ["params", "method", "ms", "x floor", "x chunked", "MB moved", "bytes x floor", "extra MB",
            "extra copies"]
    print(f"\nbench_sync: {world} ranks, {backend}, {cfg['tensors']} tensors per set, "
          f"chunk {cfg['chunk_bytes'] >> 10} KiB, median of {cfg['reps']} reps (slowest rank per rep)")
    print(bc.table(rows, cols, {"ms": ".1f", "x floor": ".3f", "x chunked": ".3f", "MB moved": ".1f",
                                "bytes x floor": ".3f",
                                "extra MB": ".0f", "extra copies": ".2f"}))
    compare = compare_rows(rows)
    if compare:
        print(f"\nnow vs base ({cfg['base']}): the same methods, interleaved in the same run")
        print(bc.table(compare, ["params", "method", "now ms", "base ms", "now/base", "MB moved now",
                                 "MB moved base"],
                       {"now ms": ".1f", "base ms": ".1f", "now/base": ".3f", "MB moved now": ".1f",
                        "MB moved base": ".1f"}))
    payload = {"benchmark": "bench_sync", "world": world, "backend": backend, "config": cfg,
               "machine": bc.machine(), "rows": rows, "compare": compare,
               "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    bc.write_json(cfg["json"], payload)
    if cfg["json"]:
        print(f"wrote {cfg['json']}")


def main(argv=None) -> None:
    from flodl_opt.transport.float32 import DEFAULT_GLOO_CHUNK_BYTES
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="Gloo ranks to spawn (ignored under a launcher)")
    p.add_argument("--sizes", default="1M,10M,50M", help="comma-separated param counts (K/M/G suffix)")
    p.add_argument("--tensors", type=int, default=160, help="tensors per parameter set")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_GLOO_CHUNK_BYTES,
                   help="Gloo chunk size for the library and the chunked floor")
    p.add_argument("--only", default="", help="comma-separated substrings of method names to run (a comma "
                   "followed by a space belongs to a name: 'flo avg,flo avg, wire int8')")
    p.add_argument("--exact", action="store_true", help="--only names whole method names, not substrings")
    p.add_argument("--json", default="bench_sync.json", help="where to write the medians ('' = nowhere)")
    p.add_argument("--base", default="", help="also time every flo method with this commit's package "
                   "(or a folder holding flodl_opt_base/); prints now/base")
    a = p.parse_args(argv)
    cfg = {"base": a.base, "base_dir": resolve_base(a.base) if a.base else "","sizes": [parse_size(s) for s in a.sizes.split(",") if s], "tensors": a.tensors,
           "reps": a.reps, "warmup": a.warmup, "chunk_bytes": a.chunk_bytes, "json": a.json,
           "only": [s for s in re.split(r",(?! )", a.only) if s], "exact": a.exact}
    if bc.under_launcher():
        import torch.distributed as dist
        import flodl_opt as flo
        flo.init()
        mine = worker(flo.rank(), flo.size(), cfg)
        gathered = [None] * flo.size()
        dist.all_gather_object(gathered, mine)
        if flo.rank() == 0:
            report(combine(gathered, cfg), cfg, flo.size(), flo.backend())
        flo.shutdown()
    else:
        per_rank = bc.spawn(worker, a.ranks, cfg)
        report(combine(per_rank, cfg), cfg, a.ranks, "gloo")


if __name__ == "__main__":
    main()
