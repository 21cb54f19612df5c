"""Shared plumbing for the benchmarks in tools/: rank spawning, parameter sets, memory, tables.

Every benchmark measures its anchor in the same run and reports ratios to it, so that the
numbers stay comparable on a machine that is shared or noisy.
"""
from __future__ import annotations

import gc
import json
import math
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Large CPU tensors are mmap-ed and unmapped on free, so RSS goes down when a tensor dies and a
# per-variant RSS delta means what it says (glibc otherwise raises the threshold after a free).
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 17))


# ------------------------------------------------------------------ launching
def under_launcher() -> bool:
    """True when started by torchrun (or any launcher flodl_opt.init understands) with >1 rank."""
    for r, s in (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                 ("PMI_RANK", "PMI_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if r in os.environ and int(os.environ.get(s, "1")) > 1:
            return True
    return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world, port, args, queue, backend="gloo"):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world)})
    try:
        import flodl_opt as flo
        flo.init(backend=backend)
        queue.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - report anything to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import flodl_opt as flo
            flo.shutdown()
        except Exception:
            pass


def spawn(fn: Callable, world: int, *args: Any, timeout: float = 3600.0, backend: str = "gloo") -> List[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh ranks (Gloo unless ``backend``); results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, queue, backend), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results))} did not finish "
                                   f"in {timeout:.0f}s")
            try:
                rank, ok, value = queue.get(timeout=min(left, 5.0))
            except Exception:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} died without a result "
                                       f"(exit codes {[procs[r].exitcode for r in dead]})")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


# ------------------------------------------------------------------ parameter sets
def model_like_sizes(total: int, count: int, seed: int = 0) -> List[int]:
    """``count`` tensor sizes summing to ``total``, mixed like a model's.

    About a third are small (biases, norms: a few hundred to a few thousand elements); the rest
    share the remainder with log-normal weights (weight matrices of very different sizes).
    """
    import random
    rng = random.Random(seed)
    count = max(1, min(count, total))
    n_small = count // 3
    small = [rng.randint(256, 4096) for _ in range(n_small)]
    if sum(small) > total // 10:  # tiny totals: keep the small ones a small share
        small = [max(1, s * (total // 10) // max(1, sum(small))) for s in small]
    rest = total - sum(small)
    weights = [math.exp(rng.gauss(0.0, 1.0)) for _ in range(count - n_small)]
    big = [max(1, int(rest * w / sum(weights))) for w in weights]
    big[big.index(max(big))] += rest - sum(big)
    sizes = small + big
    rng.shuffle(sizes)
    return sizes


def shape_of(n: int):
    """A 2-D shape for a matrix-sized tensor (rows x cols with a few rows), 1-D for small ones."""
    if n < 8192:
        return (n,)
    for rows in (1024, 768, 512, 384, 256, 128, 64, 32, 16, 8, 4, 2):
        if n % rows == 0:
            return (rows, n // rows)
    return (n,)


# ------------------------------------------------------------------ memory
def rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss()


class MemoryProbe:
    """Peak memory above a baseline: RSS on CPU, ``torch.cuda.max_memory_allocated`` on GPU."""

    def __init__(self, device):
        import torch
        self.torch, self.cuda = torch, device.type == "cuda"
        self.device = device

    def now(self) -> int:
        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            return self.torch.cuda.memory_allocated(self.device)
        return rss()

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_peak_rss()

    def peak(self) -> int:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            return self.torch.cuda.max_memory_allocated(self.device)
        return peak_rss()


# ------------------------------------------------------------------ reporting
def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def machine() -> Dict[str, Any]:
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "host": platform.node()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def table(rows: List[Dict[str, Any]], cols: Sequence[str], fmt: Dict[str, str] = None) -> str:
    """A GitHub-flavoured markdown table of ``rows`` restricted to ``cols``."""
    fmt = fmt or {}

    def cell(r, c):
        v = r.get(c, "")
        if v is None or v == "":
            return "-"
        if isinstance(v, float):
            return format(v, fmt.get(c, ".3g"))
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(cell(r, c) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: str, payload: Dict[str, Any]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
