"""Wall-clock time to a target loss on a real rate-limited network: torch DDP against flodl_opt.

Every rank runs in its own Linux network namespace, joined to the others through a veth pair and a
bridge that lives in a hub namespace; each rank's egress is shaped with ``tc ... tbf`` to the rate
under test (bandwidth only: ``netem`` is not assumed, so there is no added latency). Gloo binds to
the rank's veth (``GLOO_SOCKET_IFNAME``) and ``MASTER_ADDR`` is rank 0's namespace address, so every
byte of the training's communication crosses the shaped link. Before the runs of each rate the tool
times a bulk TCP transfer from every rank to the next one; a measured rate more than 20% away from
the set rate stops the tool (shaping that silently does nothing would make every figure a lie).

    sudo python tools/bench_wan.py                                   # 1gbit,100mbit,25mbit; all methods
    sudo python tools/bench_wan.py --rates 100mbit --methods ddp,localsgd-k16 --json runs/wan.json
    python tools/bench_wan.py --replot runs/wan.json                 # table + plot from a JSON

Workload. The character-level transformer of ``examples/train_charlm.py`` (its model, corpus,
split and batch sampler are imported, not copied) at its default size (d_model 128, 2 layers,
0.44M params: a 1.8 MB fp32 gradient), with a small per-rank batch of 4 sequences x 64 bytes.
``--model large`` is the second workload: d_model 256, 4 layers (3.3M params, a 13 MB gradient).
Why: with one CPU core per rank a step then costs a few tens of ms of compute while the 1.8 MB
all-reduce costs ~150 ms at 100 Mbit/s and ~600 ms at 25 Mbit/s, so gradient communication is the
larger share of a synchronous step at the slow rates (as it is for a large model across sites) and a
negligible one at 1 Gbit/s, and the whole default comparison fits in minutes. Every method trains
the same model from the same initial weights on the same per-rank batch stream (seed + rank), with
AdamW (lr 2e-3, betas 0.9/0.99, wd 0.01), global-norm clipping at 1.0, a 30-step linear warm-up and
a cosine decay to 10% of the peak at ``--steps`` (held at 10% beyond it). Ranks use one thread each.

Methods are rows of ``METHODS`` (name -> kind, LocalSGDOptimizer keyword arguments): ``ddp`` (torch
``DistributedDataParallel``, its own bucketing and backward overlap: the anchor), ``distopt``
(``flodl_opt.DistributedOptimizer``: one fused gradient all-reduce per step), ``localsgd-k16``
(``LocalSGDOptimizer``, plain averaging every 16 steps) and ``diloco-h64`` (DiLoCo outer step every
64, library defaults), and one row per sync mode: ``-int8`` (``wire="int8"``: each rank's difference
from the anchor in int8 with per-block scales, ~1/4 of the bytes), ``-stream`` (``fragments=4,
overlap_steps=2``: a quarter of the model at a time, in flight while 2 more inner steps run) and
``localsgd-auto`` (``sync_every="auto"``), ``-moments`` (``sync_moments=True``: AdamW's moments
shared at every sync, 4x a plain sync's bytes) and ``-moments2`` (``sync_moments_every=2``: at every
second sync, 2.5x), ``-moments-bf16`` / ``-moments2-bf16`` (the same, ``sync_moments_wire="bf16"``: 2.5x
and 1.75x), ``-dsync`` (``denoise_moments="sync"``: each rank's AdamW second moment corrected at the
sync from its own drift, a plain sync's bytes). A new sync mode is one more row; ``--row NAME=JSON``
adds one for a single run (tuning). ``recommended`` is ``flodl_opt.recipes.SLOW_LINK``, the setting
the README gives a user with a slow link (defined once, there); ``diloco-h64-f4-o2-int8`` is that
streaming DiLoCo with the int8 wire. A row the library refuses (``ConfigError`` at construction, the
same on every rank) is reported as ``refused: <message>``, not as a failure.

Peers: what a torch user already has, each run the way its own documentation recommends.
``ddp-powersgd{2,4,8}``: DDP with ``powerSGD_hook`` (ranks 2/4/8; error feedback and warm start on,
vanilla all-reduce for the first ``start_powerSGD_iter=10`` steps; the gradients in ONE bucket: on
Gloo the hook's chained P and Q all-reduces of several buckets are issued in a different order on
each rank and the job aborts). ``ddp-fp16``: DDP with ``fp16_compress_hook``. ``postlocal-k16``:
``torch.distributed.optim.PostLocalSGDOptimizer`` with ``PeriodicModelAverager(period=16)`` and DDP's
``post_localSGD_hook``, DDP's all-reduce for the first 16 steps (its warm-up: of 16, 32 and the
docs' 100, the fewest steps to the target and bytes), each rank its own
local subgroup (one rank per site). ``accel-localsgd-k16``: Accelerate's ``LocalSGD`` (``K=16``) on
a model prepared by ``Accelerator(cpu=True)`` over the same Gloo group. The *best peer* of a rate is
the fastest non-flodl row that reaches the target (DDP included, the floor not); the table and the
JSON (``row["race"]``) give every row's speed-up over DDP and over the best peer (their time to
target / its own) and its time over the floor's.

Floor: the physical limit of any method that needs as many steps as DDP. Each rank runs DDP's steps
to target (``--steps`` without a DDP row) of the same loop, model, data and optimizer with no
collective at all (no DDP, no averaging: the ranks train independent models), in the same
namespaces on the same cores, right after the others; its time to target is the slowest rank's wall
time for those steps, evaluation excluded as for every row. Its losses are no model's and are not
reported.

Streaming rows never hold one consensus of the whole model (fragments sync at different steps), so
their evaluation uses the ranks' mean weights (one all-reduce, outside the clock and the byte count):
the model the next full sync would produce. Every run ends with ``opt.sync()`` where needed, so the
final params are identical on every rank.

Time to target, and how the local methods get their chance. The anchor (DDP) runs exactly
``--steps`` steps; the target is its final validation loss x ``--target-factor`` (1.01). Every other
method runs at least ``--steps`` steps (so equal-step losses exist) and then keeps training, at the
schedule's final lr, until it reaches the target or a cap: ``--cap-steps`` x ``--steps`` steps or
``--cap-wall`` x DDP's wall time, whichever comes first (a method still above the target when it has
spent 1.5x DDP's time has lost the race; its time to target is ``null``). Time to target is the
wall time of the first evaluation at or below the target (no interpolation: the figure is an upper
bound for every method alike).

Evaluation. The validation loss is measured on the same fixed windows for every method every
``--eval-every`` steps, rounded up to a multiple of the method's sync period so that it always sees
the consensus weights (identical on every rank); streaming rows, evaluated on the ranks' mean
weights, are not rounded. The run ends on a sync. Evaluation time (and its
tiny metric all-reduce) is excluded from the wall clock: each rank stops its clock around it. The
wall time of a point is the slowest rank's.

Bytes per rank: what the rank's veth transmitted during the timed part (``tx_bytes`` of
``/sys/class/net/<veth>/statistics`` inside its namespace: payload, TCP/IP headers and ACKs, and the
evaluation's few bytes), averaged over ranks; ``sync_bytes_per_rank`` is what the optimizer handed to
collectives (``SyncStats.bytes``; for DDP and distopt the gradient bytes x steps).

Output: a table per rate on stdout, ``--json`` (``{rate: {method: {"time_to_target_s",
"final_loss", "loss_at_ddp_time", "bytes_per_rank", "wall_s", ...}}}``) and a plot of validation
loss against wall-clock seconds, one panel per rate (``--plot``, default: the ``--json`` path with .png;
needs matplotlib, the ``plot`` extra; skipped with a message otherwise).

Needs root (network namespaces, tc). Everything it creates is named ``flwan<pid>-...`` and lives in
its own namespaces (subnet 10.213.0.0/24 behind a bridge in the hub namespace; nothing is added to
the host's namespace); it is removed on exit, on Ctrl-C/SIGTERM and on failure, and namespaces left
by a killed earlier run (a ``flwan<pid>`` whose process is gone) are removed at start. Every run has
a deadline (``--run-timeout``).
"""
from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (kind, keyword arguments). kind: "ddp" | "distopt" | "local" | "postlocal" | "accel" | "floor".
# "local" rows are LocalSGDOptimizer keyword arguments (a key "outer_args" builds the outer optimizer named
# by "outer" with those arguments), so a new sync mode is one row, e.g.
# "localsgd-k16-int8": ("local", {"sync_every": 16, "wire": "int8"}). "ddp" rows may name a comm hook.
sys.path.insert(0, ROOT)
from flodl_opt.recipes import SLOW_LINK  # noqa: E402  (the README's setting for a slow link)

STREAM_DILOCO = {"sync_every": 64, "outer": "diloco", "fragments": 4, "overlap_steps": 2}
# PowerSGD as its docs recommend: error feedback, warm start, vanilla all-reduce for the first
# start_powerSGD_iter steps; one bucket on Gloo (see the worker).
POWERSGD = {"hook": "powersgd", "start_iter": 10, "use_error_feedback": True, "warm_start": True}
METHODS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "ddp": ("ddp", {}),
    "distopt": ("distopt", {}),
    "localsgd-k16": ("local", {"sync_every": 16}),
    "diloco-h64": ("local", {"sync_every": 64, "outer": "diloco"}),
    "diloco-h32": ("local", {"sync_every": 32, "outer": "diloco"}),
    "localsgd-k16-int8": ("local", {"sync_every": 16, "wire": "int8"}),
    "diloco-h64-int8": ("local", {"sync_every": 64, "outer": "diloco", "wire": "int8"}),
    "localsgd-k16-stream": ("local", {"sync_every": 16, "fragments": 4, "overlap_steps": 2}),
    "diloco-h64-stream": ("local", dict(STREAM_DILOCO)),
    "localsgd-auto": ("local", {"sync_every": "auto"}),
    "localsgd-k16-moments": ("local", {"sync_every": 16, "sync_moments": True}),
    "localsgd-k16-moments2": ("local", {"sync_every": 16, "sync_moments": True, "sync_moments_every": 2}),
    "localsgd-k16-moments-bf16": ("local", {"sync_every": 16, "sync_moments": True, "sync_moments_wire": "bf16"}),
    "localsgd-k16-moments2-bf16": ("local", {"sync_every": 16, "sync_moments": True, "sync_moments_every": 2,
                                             "sync_moments_wire": "bf16"}),
    "localsgd-k16-dsync": ("local", {"sync_every": 16, "denoise_moments": "sync"}),
    # the README's setting for a slow link, defined once in flodl_opt.recipes
    "recommended": ("local", dict(SLOW_LINK)),
    # refused until streaming syncs accept a compressed wire (reported as "refused: ...")
    "diloco-h64-f4-o2-int8": ("local", {**STREAM_DILOCO, "wire": "int8"}),
    # peers a torch user already has
    "ddp-powersgd2": ("ddp", {**POWERSGD, "rank": 2}),
    "ddp-powersgd4": ("ddp", {**POWERSGD, "rank": 4}),
    "ddp-powersgd8": ("ddp", {**POWERSGD, "rank": 8}),
    "ddp-fp16": ("ddp", {"hook": "fp16"}),
    # torch's post-local SGD: DDP's all-reduce for the first warmup_steps, then PeriodicModelAverager
    "postlocal-k16": ("postlocal", {"period": 16, "warmup_steps": 16}),
    "accel-localsgd-k16": ("accel", {"local_sgd_steps": 16}),
    # DDP's steps to its target with no communication at all (see the module docstring)
    "floor": ("floor", {}),
}
ANCHOR = "ddp"
FLODL_KINDS = ("distopt", "local")      # the rows of this library; the others are peers (floor: neither)
PEER_KINDS = ("ddp", "postlocal", "accel")
LABELS = {"ddp": "torch DDP (anchor)", "distopt": "flo.DistributedOptimizer",
          "localsgd-k16": "local SGD, K=16", "diloco-h64": "DiLoCo, H=64", "diloco-h32": "DiLoCo, H=32",
          "localsgd-k16-int8": "local SGD, K=16, int8 wire", "diloco-h64-int8": "DiLoCo, H=64, int8 wire",
          "localsgd-k16-stream": "local SGD, K=16, 4 fragments, overlap 2",
          "diloco-h64-stream": "DiLoCo, H=64, 4 fragments, overlap 2",
          "localsgd-auto": "local SGD, sync_every='auto'",
          "localsgd-k16-moments": "local SGD, K=16, sync_moments",
          "localsgd-k16-moments2": "local SGD, K=16, sync_moments every 2nd sync",
          "localsgd-k16-moments-bf16": "local SGD, K=16, sync_moments, bf16 moments",
          "localsgd-k16-moments2-bf16": "local SGD, K=16, sync_moments every 2nd sync, bf16 moments",
          "localsgd-k16-dsync": "local SGD, K=16, denoise_moments='sync'",
          "recommended": "flo recommended (recipes.SLOW_LINK)",
          "diloco-h64-f4-o2-int8": "DiLoCo, H=64, 4 fragments, overlap 2, int8 wire",
          "ddp-powersgd2": "DDP + PowerSGD rank 2", "ddp-powersgd4": "DDP + PowerSGD rank 4",
          "ddp-powersgd8": "DDP + PowerSGD rank 8", "ddp-fp16": "DDP + fp16_compress_hook",
          "postlocal-k16": "torch PostLocalSGDOptimizer, period 16", "accel-localsgd-k16": "Accelerate LocalSGD, K=16",
          "floor": "floor: DDP's steps, no communication"}
# The second workload (--model large): the same race with a model ~7.5x larger (3.3M params).
MODELS = {"small": {"d_model": 128, "layers": 2}, "large": {"d_model": 256, "layers": 4}}

SUBNET = "10.213.0"      # rank i is SUBNET.(10 + i)/24
VETH = "flwan0"          # the rank's interface inside its namespace
PREFIX = "flwan"
MAX_RATE_ERROR = 0.20


def parse_rate(spec: str) -> float:
    """A tc rate (``1gbit``, ``100mbit``, ``25mbit``, ``500kbit``) in bit/s."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(gbit|mbit|kbit|bit)\s*", spec.lower())
    if not m:
        raise ValueError(f"rate {spec!r}: expected a number and gbit/mbit/kbit, e.g. 100mbit")
    return float(m.group(1)) * {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}[m.group(2)]


def period_of(kind: str, kwargs: Dict[str, Any]) -> int:
    """Steps between the points where the ranks hold one consensus (1 for the synchronous kinds)."""
    k = kwargs.get("sync_every", 16) if kind == "local" else kwargs.get("local_sgd_steps", 1)
    # "auto" and post-local SGD (averages at warmup_steps + 1 + j * period): evaluation waits for a sync
    return k if isinstance(k, int) else 1


# =============================================================================== worker (one rank)
def mean_params(params, world: int) -> None:
    """Every rank's params <- the ranks' mean (one all-reduce of the flat params)."""
    import torch
    import torch.distributed as dist
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= world
        torch._foreach_copy_([p.data for p in params],
                             [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in params]), params)])


def powersgd_bytes(params, rank: int, min_compression_rate: float = 2.0) -> int:
    """Bytes PowerSGD's hook hands to all-reduce per step once compressing: P and Q of every matrix
    worth compressing (its own rule), the rest (vectors, small matrices) uncompressed; float32."""
    total = 0
    for p in params:
        if p.dim() <= 1:
            total += p.numel()
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_compression_rate < n * m else n * m
    return 4 * total


def ddp_with_hook(model, kwargs: Dict[str, Any], grad_bytes: int):
    """torch DDP with the comm hook a row names (none, "fp16", "powersgd")."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel
    hook = kwargs.get("hook")
    if hook is None:
        return DistributedDataParallel(model)  # broadcasts rank 0's weights
    if hook == "fp16":
        net = DistributedDataParallel(model)
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return net
    if hook == "powersgd":
        # One bucket holding every gradient: on Gloo the hook chains the P and Q all-reduces of each
        # bucket from completion callbacks, and with several buckets the ranks issue them in
        # different orders and the job aborts. An explicit cap also sizes DDP's first bucket.
        net = DistributedDataParallel(model, bucket_cap_mb=math.ceil(grad_bytes / 2 ** 20) + 1)
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=kwargs["rank"],
            start_powerSGD_iter=kwargs["start_iter"], use_error_feedback=kwargs["use_error_feedback"],
            warm_start=kwargs["warm_start"], random_seed=0)
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return net
    raise ValueError(f"unknown DDP comm hook {hook!r}")


def build(kind: str, kwargs: Dict[str, Any], model, inner, sched, grad_bytes: int):
    """(module the loop runs forward on, optimizer it steps, the peer's helper or None) for a row."""
    import torch.distributed as dist
    import flodl_opt as flo
    if kind == "ddp":
        return ddp_with_hook(model, kwargs, grad_bytes), inner, None
    if kind == "distopt":
        flo.broadcast_parameters(model.state_dict(), root_rank=0)
        return model, flo.DistributedOptimizer(inner, named_parameters=model.named_parameters()), None
    if kind == "local":
        kw = dict(kwargs)
        outer_args = kw.pop("outer_args", None)
        if outer_args is not None:
            kw["outer"] = {"diloco": flo.DiLoCo, "slowmo": flo.SlowMo}[kw["outer"]](**outer_args)
        return model, flo.LocalSGDOptimizer(inner, model=model, max_grad_norm=1.0, lr_scheduler=sched, **kw), None
    if kind == "postlocal":
        # torch's recipe (PostLocalSGDOptimizer docs): DDP with post_localSGD_hook, whose all-reduce
        # runs for the first start_localSGD_iter steps, and the averager taking over from there.
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (PostLocalSGDState,
                                                                                     post_localSGD_hook)
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer
        from torch.nn.parallel import DistributedDataParallel
        w = kwargs["warmup_steps"]
        net = DistributedDataParallel(model)
        # One rank per site, so each rank's "local" subgroup is itself (the hook's default builds
        # intra-node subgroups from the CUDA device count, which a CPU rank does not have).
        subgroup, _ = dist.new_subgroups(group_size=1)
        net.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=w),
                               post_localSGD_hook)
        opt = PostLocalSGDOptimizer(optim=inner, averager=PeriodicModelAverager(period=kwargs["period"],
                                                                                warmup_steps=w))
        return net, opt, None
    if kind == "accel":
        # Accelerate's recipe: prepare the model (DDP over the process group already made), train
        # inside LocalSGD's context (DDP's no_sync) and call its step() after every optimizer step.
        from accelerate import Accelerator
        from accelerate.local_sgd import LocalSGD
        acc = Accelerator(cpu=True)
        net = acc.prepare_model(model)
        peer = LocalSGD(accelerator=acc, model=net, local_sgd_steps=kwargs["local_sgd_steps"], enabled=True)
        if not peer.enabled:
            raise RuntimeError(f"Accelerate sees {acc.distributed_type}, not a multi-process run: LocalSGD is off")
        peer.__enter__()
        return net, inner, peer
    if kind == "floor":
        return model, inner, None
    raise ValueError(f"unknown kind {kind!r}")


def peer_bytes(kind: str, kwargs: Dict[str, Any], grad_bytes: int, step: int, synced: bool,
               compressed: int) -> int:
    """Bytes a non-flodl row handed to collectives at this step (the flodl rows report SyncStats)."""
    if kind == "floor":
        return 0
    if kind == "ddp" and kwargs.get("hook") == "fp16":
        return grad_bytes // 2
    if kind == "ddp" and kwargs.get("hook") == "powersgd":
        return grad_bytes if step <= kwargs["start_iter"] else compressed
    return grad_bytes if synced else 0  # ddp, postlocal (warm-up, averages), accel (averages)


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """Linear warm-up, cosine decay to 10% at ``steps``, then held at 10%."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def read_tx(ifname: str) -> int:
    with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
        return int(f.read())


def worker(cfg: Dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]
    import flodl_opt as flo
    from train_charlm import CharLM, batch, loss_fn, split, stdlib_corpus

    torch.set_num_threads(1)
    flo.init(backend="gloo", timeout=cfg["collective_timeout"], set_cpu_threads=False)
    rank, world = flo.rank(), flo.size()
    kind, kwargs = cfg["kind"], cfg["kwargs"]
    m = cfg["model"]
    torch.manual_seed(cfg["seed"])
    train_data, val_data = split(stdlib_corpus(int(m["corpus_mb"] * 1e6)))
    model = CharLM(256, m["d_model"], m["heads"], m["layers"], m["context"])
    params = list(model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    inner = torch.optim.AdamW(params, lr=cfg["lr"], betas=(0.9, 0.99), weight_decay=0.01)
    steps = cfg["steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: lr_factor(s, cfg["warmup"], steps))
    try:
        net, opt, peer = build(kind, kwargs, model, inner, sched, grad_bytes)
    except flo.ConfigError as e:  # a row the library refuses (the same on every rank): reported as such
        with open(cfg["out"] + f".rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "refused": str(e)}, f)
        flo.shutdown()
        return
    compressed = powersgd_bytes(params, kwargs["rank"]) if kwargs.get("hook") == "powersgd" else 0
    streaming = kind == "local" and (kwargs.get("fragments", 1) > 1 or kwargs.get("overlap_steps", 0) > 0)
    # Streaming rows are evaluated on the ranks' mean weights, which exist at every step: no rounding.
    period = 1 if streaming else period_of(kind, kwargs)
    eval_every = -(-cfg["eval_every"] // period) * period
    gen = torch.Generator().manual_seed(cfg["seed"] + rank)

    @torch.no_grad()
    def val_loss() -> float:
        if streaming:  # the ranks' mean weights (see the module docstring)
            mine = [p.detach().clone() for p in params]
            mean_params(params, world)
            try:
                return _val_loss()
            finally:
                torch._foreach_copy_([p.data for p in params], mine)
        return _val_loss()

    @torch.no_grad()
    def _val_loss() -> float:
        model.eval()
        g = torch.Generator().manual_seed(1234)  # the same windows for every method and point
        s, n = 0.0, 0
        for i in range(cfg["eval_batches"]):
            x, y = batch(val_data, 16, m["context"], g)
            if i % world == rank:
                s += loss_fn(model, x, y).item()
                n += 1
        model.train()
        t = torch.tensor([s, n], dtype=torch.float64)
        dist.all_reduce(t)
        return t[0].item() / t[1].item()

    def slowest(wall: float) -> float:
        t = torch.tensor([wall], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def synced() -> bool:
        if kind == "local":
            return streaming or opt.steps_since_sync == 0
        if kind == "postlocal":  # the averager's own schedule: DDP's all-reduce, then every period
            a = opt.averager
            return a.step <= a.warmup_steps or (a.step - 1 - a.warmup_steps) % a.period == 0
        if kind == "accel":
            return peer.num_steps % peer.local_sgd_steps == 0
        return True  # ddp, distopt (identical every step); floor (independent ranks: nothing to wait for)

    anchor, target = cfg["anchor"], cfg["target"]
    # Without a target (no anchor in the run, no --target-loss) everyone runs exactly --steps.
    max_steps = steps if anchor or target is None else int(math.ceil(cfg["cap_steps"] * steps))
    wall_cap = None if anchor or cfg["ddp_wall"] is None else cfg["cap_wall"] * cfg["ddp_wall"]
    if kind == "floor":  # exactly DDP's steps to its target (--steps without an anchor), no target stop
        max_steps, target, wall_cap = cfg["floor_steps"] or steps, None, None
    say = print if rank == 0 else (lambda *a, **k: None)
    curve: List[List[float]] = []
    sync_bytes = 0
    last_stats = None

    dist.barrier()
    tx0 = read_tx(cfg["ifname"])
    t0 = time.perf_counter()
    excluded, tx_excluded = 0.0, 0  # evaluation: outside the clock and the byte count
    curve.append([0, 0.0, val_loss()])
    excluded += time.perf_counter() - t0
    tx_excluded += read_tx(cfg["ifname"]) - tx0
    next_eval, step, stop_reason, last_print = eval_every, 0, None, 0.0
    while stop_reason is None:
        step += 1
        x, y = batch(train_data, m["batch_size"], m["context"], gen)
        loss = loss_fn(net, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if kind in ("ddp", "postlocal", "accel", "floor"):  # torch's loop: clip, step, schedule
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()  # postlocal: + PeriodicModelAverager
            sched.step()
            if kind == "accel":
                peer.step()  # Accelerate's LocalSGD: every local_sgd_steps, average the params
            sync_bytes += peer_bytes(kind, kwargs, grad_bytes, step, synced(), compressed)
        elif kind == "distopt":  # Horovod's way: average, clip, step
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            with opt.skip_synchronize():
                opt.step()
            sched.step()
            sync_bytes += grad_bytes
        else:
            opt.step()  # clip -> AdamW -> scheduler -> every K steps: consensus (+ outer step)
        last = step >= max_steps
        if kind == "local" and last and (opt.steps_since_sync > 0 or streaming):
            opt.sync()  # end on the consensus (streaming: every fragment, what is in flight first)
        if kind in ("postlocal", "accel") and last and not synced():
            mean_params(params, world)  # end on the consensus, as the flodl rows do
            sync_bytes += grad_bytes
        if kind == "local" and opt.last_sync is not None and opt.last_sync is not last_stats:
            last_stats = opt.last_sync
            sync_bytes += last_stats.bytes
        # "auto" periods: wait for a sync, but never more than 4 eval intervals.
        if last or (step >= next_eval and (synced() or step >= next_eval + 4 * eval_every)):
            t_pause = time.perf_counter()
            wall = slowest(t_pause - t0 - excluded)
            # Read after that collective: the peer has then finished the sync and so received all
            # of it; read before, the sync's tail still queued at the shaped link (up to the socket
            # buffer) would be counted as evaluation traffic and left out.
            tx_pause = read_tx(cfg["ifname"])
            v = val_loss()
            curve.append([step, wall, v])
            while next_eval <= step:
                next_eval += eval_every
            # Every input of the stop decision is identical on every rank (all-reduced).
            if last:
                stop_reason = "steps" if anchor or kind == "floor" else "step cap"
            elif not anchor and step >= steps and target is not None and v <= target:
                stop_reason = "target"
            elif wall_cap is not None and step >= steps and wall >= wall_cap:
                stop_reason = "wall cap"
            excluded += time.perf_counter() - t_pause
            tx_excluded += read_tx(cfg["ifname"]) - tx_pause
        now = time.perf_counter()
        if rank == 0 and (now - last_print > 5.0 or stop_reason):
            last_print = now
            elapsed = now - t0 - excluded
            rate_s = step / max(elapsed, 1e-9)
            goal = steps if step < steps else max_steps
            eta = (goal - step) / rate_s
            tail = f"val {curve[-1][2]:.4f}" + (f" (target {target:.4f})" if target else "")
            extra = "" if step <= steps else " past --steps, until the target or a cap"
            say(f"  [{cfg['rate']} {cfg['method']}] step {step}/{goal}{extra} | {rate_s:.1f} steps/s "
                f"| {elapsed:.0f} s | ETA {eta:.0f} s | {tail}", flush=True)
    wall = slowest(time.perf_counter() - t0 - excluded)
    tx = read_tx(cfg["ifname"]) - tx0 - tx_excluded
    if kind == "local" and not last and (opt.steps_since_sync > 0 or streaming):
        # Stopped at the target or the wall cap between syncs (streaming: fragments merged at
        # different steps): end on the consensus, after the clock, so every rank holds the same model.
        opt.sync()
    h = hashlib.sha256()
    with torch.no_grad():
        for p in params:
            h.update(p.detach().contiguous().numpy().tobytes())
    out = {"rank": rank, "curve": curve, "steps": step, "wall_s": wall, "tx_bytes": tx,
           "sync_bytes": sync_bytes, "param_sha256": h.hexdigest(), "stop": stop_reason,
           "params": sum(p.numel() for p in params), "grad_bytes": grad_bytes, "eval_every": eval_every}
    with open(cfg["out"] + f".rank{rank}.json", "w") as f:
        json.dump(out, f)
    flo.shutdown()


# =============================================================================== network namespaces
def sh(*cmd: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def own_namespaces() -> List[str]:
    r = sh("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    return [n for n in names if re.fullmatch(rf"{PREFIX}\d+-(hub|r\d+)", n)]


def remove_stale() -> None:
    """Namespaces of an earlier run of this tool whose process is gone."""
    for ns in own_namespaces():
        pid = int(re.match(rf"{PREFIX}(\d+)-", ns).group(1))
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            sh("ip", "netns", "del", ns, check=False)
            print(f"removed stale namespace {ns}")


class Topology:
    """``ranks`` namespaces, each with one veth into a bridge in a hub namespace; all torn down by close()."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        tag = f"{PREFIX}{os.getpid()}"
        self.hub = f"{tag}-hub"
        self.ns = [f"{tag}-r{i}" for i in range(ranks)]
        self.addr = [f"{SUBNET}.{10 + i}" for i in range(ranks)]
        self.made: List[str] = []
        self.procs: List[subprocess.Popen] = []

    def build(self) -> None:
        for ns in [self.hub] + self.ns:
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
        sh("ip", "-n", self.hub, "link", "add", "flwanbr", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "flwanbr", "up")
        for i, ns in enumerate(self.ns):
            # Both ends are created directly in their namespaces: nothing appears in the host's.
            sh("ip", "link", "add", VETH, "netns", ns, "type", "veth", "peer", "name", f"flwanh{i}",
               "netns", self.hub)
            sh("ip", "-n", self.hub, "link", "set", f"flwanh{i}", "master", "flwanbr")
            sh("ip", "-n", self.hub, "link", "set", f"flwanh{i}", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", VETH)
            sh("ip", "-n", ns, "link", "set", VETH, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def shape(self, rate_bps: float, queue_ms: float = 50.0) -> Dict[str, Any]:
        """tbf on every rank's egress. burst >= 2 ms at the rate and >= 2 GSO frames (128 KiB), so
        that 1 Gbit/s is reached; ``latency`` bounds the queue (drops beyond, as a real link)."""
        burst = max(128 * 1024, int(rate_bps / 8 * 0.002))
        for ns in self.ns:
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", VETH, "root", "tbf",
               "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", f"{queue_ms:g}ms")
        return {"qdisc": "tbf", "rate_bit": int(rate_bps), "burst_bytes": burst, "latency_ms": queue_ms}

    def counters(self) -> List[Dict[str, int]]:
        """Per rank: packets the shaper dropped and TCP segments retransmitted (cumulative)."""
        out = []
        for ns in self.ns:
            q = sh("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", VETH, check=False).stdout
            m = re.search(r"dropped (\d+)", q)
            snmp = sh("ip", "netns", "exec", ns, "cat", "/proc/net/snmp", check=False).stdout.splitlines()
            tcp = [line.split()[1:] for line in snmp if line.startswith("Tcp:")]
            retrans = int(dict(zip(tcp[0], tcp[1])).get("RetransSegs", 0)) if len(tcp) == 2 else 0
            out.append({"dropped": int(m.group(1)) if m else 0, "retrans": retrans})
        return out

    def spawn(self, i: int, argv: List[str], env: Dict[str, str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[i]] + argv, env=env, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def kill(self, procs: Optional[List[subprocess.Popen]] = None) -> None:
        for p in list(procs if procs is not None else self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            if p in self.procs:
                self.procs.remove(p)

    def close(self) -> None:
        self.kill()
        for ns in reversed(self.made):
            sh("ip", "netns", "del", ns, check=False)  # takes its veth ends and the bridge with it
        self.made.clear()


_LINK_PROBE = r"""
import socket, sys, time
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "recv":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port)); s.listen(1); s.settimeout(20)
    c, _ = s.accept(); c.settimeout(30); buf = bytearray(1 << 20); n = 0; t0 = None
    while True:
        k = c.recv_into(buf)
        if not k:
            break
        if t0 is None:  # clock from the first bytes: connection set-up is not the link's rate
            t0, first = time.perf_counter(), k
        n += k
    print((n - first) * 8 / (time.perf_counter() - t0))
else:
    total = int(float(sys.argv[4]))
    s = socket.create_connection((host, port), timeout=20); chunk = b"\0" * (1 << 16); sent = 0
    while sent < total:
        s.sendall(chunk); sent += len(chunk)
    s.close()
"""


def measure_link(topo: Topology, rate_bps: float, seconds: float = 1.5) -> List[Dict[str, Any]]:
    """Timed TCP bulk transfer rank i -> rank i+1 (every shaped egress once); payload bit/s."""
    results = []
    pairs = [(i, (i + 1) % topo.ranks) for i in range(topo.ranks)] if topo.ranks > 2 else [(0, 1), (1, 0)]
    for src, dst in pairs:
        port = str(5201 + src)
        recv = topo.spawn(dst, [sys.executable, "-c", _LINK_PROBE, "recv", topo.addr[dst], port],
                          env=dict(os.environ), stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        send = topo.spawn(src, [sys.executable, "-c", _LINK_PROBE, "send", topo.addr[dst], port,
                                str(rate_bps / 8 * seconds)], env=dict(os.environ))
        try:
            send.wait(timeout=seconds * 4 + 20)
            out, _ = recv.communicate(timeout=20)
            bps = float(out.strip())
        except (subprocess.TimeoutExpired, ValueError) as e:
            raise RuntimeError(f"link probe {src}->{dst} failed: {e}")
        finally:
            topo.kill([recv, send])
        results.append({"src": src, "dst": dst, "measured_bit": bps})
    return results


# =============================================================================== driver
def run_method(topo: Topology, args, rate: str, method: str, target: Optional[float],
               ddp_wall: Optional[float], port: int, tmp: str,
               floor_steps: Optional[int] = None) -> Dict[str, Any]:
    kind, kwargs = METHODS[method]
    out = os.path.join(tmp, f"{rate}-{method}")
    cfg = {"kind": kind, "kwargs": kwargs, "method": method, "rate": rate, "steps": args.steps,
           "floor_steps": floor_steps,
           "anchor": method == ANCHOR, "target": target, "ddp_wall": ddp_wall,
           "cap_steps": args.cap_steps, "cap_wall": args.cap_wall, "eval_every": args.eval_every,
           "eval_batches": args.eval_batches, "seed": args.seed, "lr": args.lr, "warmup": 30,
           "ifname": VETH, "out": out, "collective_timeout": args.run_timeout,
           "model": {"d_model": args.d_model, "heads": 4, "layers": args.layers,
                     "context": args.context, "batch_size": args.batch_size, "corpus_mb": args.corpus_mb}}
    with open(out + ".cfg.json", "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ)
    env.update({"MASTER_ADDR": topo.addr[0], "MASTER_PORT": str(port), "WORLD_SIZE": str(topo.ranks),
                "LOCAL_WORLD_SIZE": "1", "GLOO_SOCKET_IFNAME": VETH, "OMP_NUM_THREADS": "1",
                "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", "")})
    for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        env.pop(v, None)
    procs = []
    for i in range(topo.ranks):
        e = dict(env, RANK=str(i), LOCAL_RANK="0")
        with open(out + f".rank{i}.err", "w") as err:
            procs.append(topo.spawn(i, [sys.executable, os.path.abspath(__file__), "--_worker",
                                        out + ".cfg.json"], env=e, stderr=err, text=True,
                                    stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL))

    def pump():  # rank 0's progress lines, as they come
        for line in procs[0].stdout:
            print(line.rstrip(), flush=True)
    th = threading.Thread(target=pump, daemon=True)
    th.start()
    deadline = time.monotonic() + args.run_timeout
    before = topo.counters()
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{rate} {method}: did not finish in --run-timeout {args.run_timeout:.0f} s")
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            refused = [i for i, p in enumerate(procs) if p.poll() == 0 and _refusal(out, i)]
            if failed or refused:
                time.sleep(1.0)  # let the others' errors (or refusals) land too
                break
            time.sleep(0.2)
    finally:
        topo.kill(procs)
        th.join(timeout=5)
    refusals = [m for m in (_refusal(out, i) for i in range(topo.ranks)) if m]
    if refusals:  # the library refused the row's settings: a result, not a failure of the tool
        return {"refused": refusals[0], "kind": kind, "kwargs": kwargs}
    ranks = []
    # A rank that failed on its own first; the ones this tool killed after it (-9) come last.
    for i, p in sorted(enumerate(procs), key=lambda ip: ip[1].returncode == -signal.SIGKILL):
        path = out + f".rank{i}.json"
        if p.returncode != 0 or not os.path.exists(path):
            with open(out + f".rank{i}.err") as f:
                err = f.read()[-3000:]
            raise RuntimeError(f"{rate} {method}: rank {i} failed (exit {p.returncode}):\n{err}")
        with open(path) as f:
            ranks.append(json.load(f))
    row = summarize(ranks, target, ddp_wall, kind, kwargs)
    # Diagnostics of the link, whole run (evaluation included): drops at the shaper, TCP retransmits.
    after = topo.counters()
    row["link_drops"] = sum(a["dropped"] - b["dropped"] for a, b in zip(after, before))
    row["tcp_retrans"] = sum(a["retrans"] - b["retrans"] for a, b in zip(after, before))
    return row


def _refusal(out: str, rank: int) -> Optional[str]:
    try:
        with open(out + f".rank{rank}.json") as f:
            return json.load(f).get("refused")
    except (OSError, ValueError):
        return None


def summarize(ranks: List[Dict[str, Any]], target, ddp_wall, kind, kwargs) -> Dict[str, Any]:
    r0 = ranks[0]
    curve = r0["curve"]
    ttt = next(((w, s) for s, w, v in curve if target is not None and v <= target), None)
    if kind == "floor":  # its time is the compute of DDP's steps to target; its losses are no model's
        ttt = (max(r["wall_s"] for r in ranks), r0["steps"])
    at_ddp = None
    if ddp_wall is not None:
        at_ddp = [v for s, w, v in curve if w <= ddp_wall * (1 + 1e-9)][-1]
    return {"time_to_target_s": ttt[0] if ttt else None, "steps_to_target": ttt[1] if ttt else None,
            "final_loss": curve[-1][2], "loss_at_ddp_time": at_ddp,
            "bytes_per_rank": int(sum(r["tx_bytes"] for r in ranks) / len(ranks)),
            "sync_bytes_per_rank": int(sum(r["sync_bytes"] for r in ranks) / len(ranks)),
            "wall_s": max(r["wall_s"] for r in ranks), "steps": r0["steps"], "stop": r0["stop"],
            "target_loss": target, "kind": kind, "kwargs": kwargs, "eval_every": r0["eval_every"],
            "params": r0["params"], "param_sha256": [r["param_sha256"] for r in ranks],
            "curve": [{"step": s, "wall_s": w, "val_loss": v} for s, w, v in curve]}


def race(rows: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """One rate's reading: DDP's time to target, the best peer (the fastest non-flodl row that reached
    the target), the floor, and per row its speed-up over DDP and over the best peer (their time / its
    time), its time over the floor's, and its steps to target over DDP's."""
    def ttt(name: Optional[str]) -> Optional[float]:
        return rows.get(name, {}).get("time_to_target_s") if name else None
    peers = [(r["time_to_target_s"], n) for n, r in rows.items()
             if r.get("kind") in PEER_KINDS and r.get("time_to_target_s") is not None]
    best = min(peers)[1] if peers else None
    ddp_t, best_t = ttt(ANCHOR), ttt(best)
    floor = next((n for n, r in rows.items() if r.get("kind") == "floor" and r.get("time_to_target_s")), None)
    floor_t = ttt(floor)
    ddp_steps = rows.get(ANCHOR, {}).get("steps_to_target")
    per_row = {}
    for n, r in rows.items():
        t, st = r.get("time_to_target_s"), r.get("steps_to_target")
        per_row[n] = {"vs_ddp": ddp_t / t if t and ddp_t else None,
                      "vs_best_peer": best_t / t if t and best_t and r.get("kind") != "floor" else None,
                      "x_floor": t / floor_t if t and floor_t else None,
                      "steps_vs_ddp": st / ddp_steps if st and ddp_steps else None}
    return {"ddp_s": ddp_t, "best_peer": best, "best_peer_s": best_t, "floor_s": floor_t,
            "ddp_steps_to_target": ddp_steps, "rows": per_row}


def stamp_race(rows: Dict[str, Dict[str, Any]]) -> None:
    """Write the race's reading into every row of the JSON (``row["race"]``: best peer named)."""
    rc = race(rows)
    for n, r in rows.items():
        r["race"] = {"best_peer": rc["best_peer"], "best_peer_s": rc["best_peer_s"], "floor_s": rc["floor_s"],
                     **rc["rows"][n]}


def fmt_table(rate: str, rows: Dict[str, Dict[str, Any]]) -> str:
    rc = race(rows)
    f = (lambda v, p=".4f": "-" if v is None else format(v, p))
    x = (lambda v: "-" if v is None else f"{v:.2f}x")
    best = rc["best_peer"]
    head = (f"best peer: {best} ({rc['best_peer_s']:.1f} s)" if best else "best peer: none reached the target")
    if rc["floor_s"]:
        head += f"; floor {rc['floor_s']:.1f} s (DDP's {rc['ddp_steps_to_target']} steps, no communication)"
    lines = [head,
             f"| {rate} | steps | steps to target (vs DDP) | wall s | time to target s | vs DDP | vs best peer "
             f"| x floor | loss at DDP's time | final loss | MB/rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "refused" in r:
            lines.append(f"| {name} | refused: {r['refused']} |" + " |" * 9)
            continue
        t, q = r["time_to_target_s"], rc["rows"][name]
        speed = x(q["vs_ddp"]) if t is not None else "never"
        st = r.get("steps_to_target")
        steps_col = "-" if st is None else f"{st}" + (f" ({x(q['steps_vs_ddp'])})" if q["steps_vs_ddp"] else "")
        floor = r.get("kind") == "floor"  # independent ranks: no model's loss
        lines.append(f"| {name} | {r['steps']} | {steps_col} | {r['wall_s']:.1f} | {f(t, '.1f')} | {speed} | "
                     f"{x(q['vs_best_peer'])} | {x(q['x_floor'])} | {'n/a' if floor else f(r['loss_at_ddp_time'])} "
                     f"| {'n/a' if floor else f(r['final_loss'])} | {r['bytes_per_rank'] / 1e6:.1f} |")
    return "\n".join(lines)


def plot(results: Dict[str, Dict[str, Any]], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install flodl-opt[plot]): plot skipped")
        return
    rates = list(results)
    fig, axes = plt.subplots(1, len(rates), figsize=(5.2 * len(rates), 4.2), squeeze=False)
    # One colour per method, one line style per kind of sync (dashed int8 wire, dotted streaming).
    colors = {"ddp": "black", "distopt": "tab:gray", "localsgd-k16": "tab:blue", "diloco-h64": "tab:orange",
              "localsgd-k16-int8": "tab:cyan", "diloco-h64-int8": "tab:brown",
              "localsgd-k16-stream": "tab:green", "diloco-h64-stream": "tab:red", "localsgd-auto": "tab:purple",
              "localsgd-k16-moments": "tab:pink", "localsgd-k16-moments2": "tab:olive",
              "localsgd-k16-moments-bf16": "magenta", "localsgd-k16-moments2-bf16": "darkgoldenrod",
              "localsgd-k16-dsync": "navy", "recommended": "tab:red", "diloco-h64-f4-o2-int8": "darkred",
              "ddp-powersgd2": "#9ecae1", "ddp-powersgd4": "#4292c6", "ddp-powersgd8": "#08306b",
              "ddp-fp16": "dimgray", "postlocal-k16": "#74c476", "accel-localsgd-k16": "#6a51a3"}

    def style(name: str) -> str:
        if name in METHODS and METHODS[name][0] in PEER_KINDS and name != ANCHOR:
            return "--"  # the peers dashed, the flodl rows solid
        return ("--" if name == "distopt" or name.endswith("-int8") else ":" if name.endswith("-stream")
                else "-." if "-moments" in name else "-")

    for ax, rate in zip(axes[0], rates):
        rows = results[rate]
        target = next((r["target_loss"] for r in rows.values() if r.get("target_loss")), None)
        for name, r in rows.items():
            if "refused" in r:
                continue
            if r.get("kind") == "floor":  # a time, not a model: where any method of DDP's steps ends
                ax.axvline(r["time_to_target_s"], color="gray", lw=1.0, ls="--",
                           label=f"{LABELS.get(name, name)}: {r['time_to_target_s']:.0f} s")
                continue
            xs = [p["wall_s"] for p in r["curve"]]
            ys = [p["val_loss"] for p in r["curve"]]
            ttt = r["time_to_target_s"]
            lab = LABELS.get(name, name) + (f": {ttt:.0f} s" if ttt is not None else ": not reached")
            line, = ax.plot(xs, ys, marker=".", ms=3, lw=1.4, color=colors.get(name), label=lab,
                            ls=style(name))
            if ttt is not None:
                ax.plot([ttt], [next(p["val_loss"] for p in r["curve"] if p["wall_s"] == ttt)], "o",
                        ms=7, mfc="none", color=line.get_color())
        if target is not None:
            ax.axhline(target, color="tab:red", lw=0.8, ls=":", label=f"target {target:.3f} (DDP final x1.01)")
        link = next(iter(rows.values())).get("link", {})
        meas = link.get("measured_mbit")
        ax.set_title(f"{rate}" + (f" (measured {meas:.0f} Mbit/s)" if meas else ""))
        ax.set_xlabel("wall-clock seconds (evaluation excluded)")
        ax.set_ylabel("validation loss")
        finals = [r["final_loss"] for r in rows.values() if "refused" not in r and r.get("kind") != "floor"]
        if target is not None:  # zoom on the race to the target: the first steps are off the chart
            lo = min(finals + [target])
            ax.set_ylim(lo - 0.05 * max(lo, 1e-3) * 0.5, target + 0.6)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7.5, loc="upper right")
    fig.suptitle("Time to loss on a rate-limited link (tc tbf), char-LM, "
                 f"{next(iter(next(iter(results.values())).values())).get('ranks', 2)} ranks", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def report(results: Dict[str, Dict[str, Any]]) -> None:
    for rate, rows in results.items():
        stamp_race(rows)
        link = next(iter(rows.values())).get("link", {})
        print(f"\n{rate}: link measured {link.get('measured_mbit', float('nan')):.1f} Mbit/s "
              f"(set {link.get('set_mbit', float('nan')):.0f}); target loss "
              f"{next(iter(rows.values())).get('target_loss')}")
        print(fmt_table(rate, rows))


_topology: Optional[Topology] = None


def _teardown(*_a) -> None:
    global _topology
    if _topology is not None:
        t, _topology = _topology, None
        t.close()


def _on_signal(signum, _frame) -> None:
    _teardown()
    print(f"\ninterrupted (signal {signum}): namespaces removed", file=sys.stderr)
    sys.exit(128 + signum)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rates", default="1gbit,100mbit,25mbit", help="comma-separated tc rates")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from: {', '.join(METHODS)}")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=512, help="DDP's steps (the others' minimum)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None,
                   help="PNG path (default: beside --json or --replot, same name; else ./wan_time_to_loss.png)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--replot", default=None, metavar="JSON", help="table + plot from an earlier --json; no runs")
    p.add_argument("--target-factor", type=float, default=1.01, help="target = DDP's final loss x this")
    p.add_argument("--target-loss", type=float, default=None, help="fixed target (default: from DDP)")
    p.add_argument("--cap-steps", type=float, default=3.0, help="non-anchor methods stop at this x --steps")
    p.add_argument("--cap-wall", type=float, default=1.5, help="... or at this x DDP's wall time")
    p.add_argument("--eval-every", type=int, default=32, help="rounded up to a multiple of the sync period")
    p.add_argument("--eval-batches", type=int, default=8, help="fixed validation windows of 16 sequences")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--model", choices=sorted(MODELS), default="small",
                   help="small: d_model 128, 2 layers (0.44M params); large: d_model 256, 4 layers (3.3M): "
                        "the second workload. --d-model/--layers override it")
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--row", action="append", default=[], metavar="NAME=JSON",
                   help='one more row for this run, e.g. \'h64-lr0.8={"kind": "local", "sync_every": 64, '
                        '"outer": "diloco", "outer_args": {"lr": 0.8}}\' (tuning without editing METHODS)')
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--corpus-mb", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-timeout", type=float, default=1200.0, help="deadline of one method's run (s)")
    p.add_argument("--queue-ms", type=float, default=50.0,
                   help="tbf latency: the shaper queues this many ms at the rate, drops beyond")
    p.add_argument("--link-seconds", type=float, default=1.5, help="duration of each link probe")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.d_model = MODELS[args.model]["d_model"] if args.d_model is None else args.d_model
    args.layers = MODELS[args.model]["layers"] if args.layers is None else args.layers
    if args.plot is None:  # beside the results, so a quick run cannot overwrite the committed figure
        src = args.json or args.replot
        args.plot = os.path.splitext(src)[0] + ".png" if src else "wan_time_to_loss.png"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._worker:
        with open(args._worker) as f:
            worker(json.load(f))
        return 0
    if args.replot:
        with open(args.replot) as f:
            results = json.load(f)
        report(results)
        if not args.no_plot:
            plot(results, args.plot)
        return 0
    try:
        for spec in args.row:
            add_row(spec)
    except ValueError as e:
        print(f"bench_wan: --row {e}", file=sys.stderr)
        return 2
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    methods += [spec.split("=", 1)[0].strip() for spec in args.row
                if spec.split("=", 1)[0].strip() not in methods]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        print(f"bench_wan: unknown method(s) {', '.join(unknown) or '(none given)'}; "
              f"valid: {', '.join(METHODS)}", file=sys.stderr)
        return 2
    try:
        rates = [(r.strip(), parse_rate(r)) for r in args.rates.split(",") if r.strip()]
    except ValueError as e:
        print(f"bench_wan: {e}", file=sys.stderr)
        return 2
    if args.ranks < 2 or args.steps < 1:
        print("bench_wan: --ranks must be >= 2 and --steps >= 1", file=sys.stderr)
        return 2
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print("bench_wan: needs root and iproute2 (ip, tc) to create network namespaces and shape "
              "them; run it with sudo", file=sys.stderr)
        return 2
    if ANCHOR in methods:  # the anchor sets the target and the time cap: it runs first
        methods = [ANCHOR] + [m for m in methods if m != ANCHOR]

    global _topology
    atexit.register(_teardown)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _on_signal)
    remove_stale()
    topo = _topology = Topology(args.ranks)
    results: Dict[str, Dict[str, Any]] = {}
    tmp = tempfile.mkdtemp(prefix="flwan-")
    t_start = time.monotonic()
    try:
        try:
            topo.build()
        except RuntimeError as e:
            print(f"bench_wan: cannot create network namespaces ({e})", file=sys.stderr)
            return 2
        port = 29500
        for rate, bps in rates:
            shaping = topo.shape(bps, args.queue_ms)
            probes = measure_link(topo, bps, args.link_seconds)
            worst = max(probes, key=lambda p: abs(p["measured_bit"] / bps - 1))
            mean = sum(p["measured_bit"] for p in probes) / len(probes)
            print(f"{rate}: link measured " + ", ".join(
                f"{p['src']}->{p['dst']} {p['measured_bit'] / 1e6:.1f}" for p in probes)
                + f" Mbit/s (set {bps / 1e6:.0f} Mbit/s, tbf burst {shaping['burst_bytes']} B)", flush=True)
            if abs(worst["measured_bit"] / bps - 1) > MAX_RATE_ERROR:
                print(f"bench_wan: the shaped link measured {worst['measured_bit'] / 1e6:.1f} Mbit/s "
                      f"({worst['src']}->{worst['dst']}), more than {MAX_RATE_ERROR:.0%} from the set "
                      f"{bps / 1e6:.0f} Mbit/s: refusing to report figures for it", file=sys.stderr)
                return 3
            link = {"set_mbit": bps / 1e6, "measured_mbit": mean / 1e6,
                    "probes_mbit": [p["measured_bit"] / 1e6 for p in probes], **shaping}
            target, ddp_wall = args.target_loss, None
            rows: Dict[str, Any] = {}
            for method in methods:
                port += 1
                print(f"{rate} {method}: {args.ranks} ranks, {args.steps} steps"
                      + (f", target {target:.4f}" if target is not None else ""), flush=True)
                floor_steps = rows.get(ANCHOR, {}).get("steps_to_target")
                row = run_method(topo, args, rate, method, target, ddp_wall, port, tmp, floor_steps)
                row["link"], row["ranks"], row["model"] = link, args.ranks, args.model
                if "refused" in row:
                    rows[method] = row
                    print(f"{rate} {method}: refused: {row['refused']}", flush=True)
                    continue
                if method == ANCHOR:
                    ddp_wall = row["wall_s"]
                    if target is None:
                        target = row["final_loss"] * args.target_factor
                    row["target_loss"] = target
                    s = summarize_target(row, target)
                    row.update(s)
                rows[method] = row
                print(f"{rate} {method}: {row['steps']} steps in {row['wall_s']:.1f} s, final val "
                      f"{row['final_loss']:.4f}, time to target "
                      + ("-" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.1f} s")
                      + f", {row['bytes_per_rank'] / 1e6:.1f} MB/rank, stop: {row['stop']} "
                        f"[{time.monotonic() - t_start:.0f} s total]", flush=True)
            stamp_race(rows)
            results[rate] = rows
            if args.json:
                write_json(args.json, results)
    finally:
        _teardown()
        shutil.rmtree(tmp, ignore_errors=True)
    report(results)
    if args.json:
        write_json(args.json, results)
        print(f"json: {args.json}")
    if not args.no_plot:
        plot(results, args.plot)
    return 0


def add_row(spec: str) -> None:
    """``NAME=JSON`` (``{"kind": ..., **keyword arguments}``) -> one more row of METHODS, for this run."""
    name, sep, text = spec.partition("=")
    try:
        kw = json.loads(text) if sep else None
    except ValueError as e:
        raise ValueError(f"{spec!r}: the part after NAME= is not JSON ({e})")
    if not name.strip() or not isinstance(kw, dict) or kw.get("kind") not in ("local",) + PEER_KINDS:
        raise ValueError(f"{spec!r}: expected NAME={{\"kind\": \"local\" | \"ddp\" | \"postlocal\" | "
                         f"\"accel\", ...keyword arguments}}")
    kind = kw.pop("kind")
    METHODS[name.strip()] = (kind, kw)


def summarize_target(row: Dict[str, Any], target: float) -> Dict[str, Any]:
    """The anchor learns the target only at its end: its own time to target and loss at its own time."""
    hit = next((p for p in row["curve"] if p["val_loss"] <= target), None)
    return {"time_to_target_s": hit["wall_s"] if hit else None,
            "steps_to_target": hit["step"] if hit else None,
            "loss_at_ddp_time": row["final_loss"]}


def write_json(path: str, payload: Dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
