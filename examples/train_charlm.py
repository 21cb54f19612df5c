"""Train a small character-level transformer language model with local SGD, on CPUs or GPUs.

The corpus is the source of Python's own standard library (every machine that runs this script
has it, no download): the sorted ``.py`` files, capped to a few MB, read as bytes (vocabulary 256),
split deterministically into train and validation blocks.

    python examples/train_charlm.py                       # 2 local CPU ranks over Gloo (it launches them)
    python examples/train_charlm.py --nproc 1             # one process
    torchrun --nproc-per-node 4 examples/train_charlm.py --log-json run.json  # any launcher's ranks
    python examples/train_charlm.py --outer diloco --sync-every 64 --log run.json

The distributed part is the one-line wrap of AdamW in ``build_optimizer``; everything else is an
ordinary single-process training script. Each rank samples its own batches (seed + rank); every
``--sync-every`` steps the ranks agree on a work-weighted average of their weights (then the
``--outer`` step: plain averaging, DiLoCo, SlowMo or EASGD). ``--sync-every 1`` is the synchronous
baseline (model averaging every step); ``--mode allreduce`` averages gradients every step instead,
when ``flodl_opt.DistributedOptimizer`` is available.

Validation is measured on the same fixed windows for every run. When ``--eval-every`` is a multiple
of ``--sync-every`` each evaluation sees the consensus weights (it follows a sync); otherwise (say
``--sync-every auto``) it evaluates the mean of the ranks' weights, computed aside for the metric
only (not counted as communication, training untouched). The run always ends with a sync, so the
final validation loss is the consensus model's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

try:
    import flodl_opt as flo
except ImportError:  # running from a source checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import flodl_opt as flo

LAUNCHER_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=2,
                   help="local CPU ranks to launch when no launcher started this script (1 = one process)")
    p.add_argument("--mode", choices=("localsgd", "allreduce"), default="localsgd",
                   help="localsgd: LocalSGDOptimizer; allreduce: gradients averaged every step "
                        "(flodl_opt.DistributedOptimizer)")
    p.add_argument("--sync-every", type=_sync_every, default=16,
                   help="K: local steps between syncs, or 'auto' (flodl_opt.AdaptiveSync picks K)")
    p.add_argument("--auto-target", type=float, default=None,
                   help="with --sync-every auto: the divergence target (default: AdaptiveSync's)")
    p.add_argument("--warmup-syncs", type=int, default=0,
                   help="sync after every step for the first N steps (post-local SGD), then every K")
    p.add_argument("--outer", choices=("avg", "diloco", "slowmo", "easgd"), default="avg")
    p.add_argument("--wire", choices=("fp32", "bf16", "fp16", "int8"), default="fp32",
                   help="what a param sync sends: float32, or the difference from the anchor compressed")
    p.add_argument("--error-feedback", action="store_true",
                   help="carry the compression residual into the next sync (with --wire bf16/fp16/int8)")
    p.add_argument("--outer-lr", type=float, default=None, help="DiLoCo/SlowMo outer lr (default: theirs)")
    p.add_argument("--outer-momentum", type=float, default=None, help="DiLoCo/SlowMo outer momentum")
    p.add_argument("--fragments", type=int, default=1,
                   help="P: sync 1/P of the model at a time, staggered by K/P steps (streaming)")
    p.add_argument("--overlap-steps", type=int, default=0,
                   help="tau < K/P: keep training tau steps while a sync is in flight, then merge")
    p.add_argument("--sync-moments", action="store_true",
                   help="also share AdamW's moments at every sync, the noise of each rank's small batch "
                        "taken out of the second (closer to gradient all-reduce; 4x a sync's bytes)")
    p.add_argument("--sync-moments-every", type=int, default=1, metavar="N",
                   help="with --sync-moments, share them at every N-th sync only (1 + 3/N x a sync's bytes)")
    p.add_argument("--sync-moments-wire", choices=("fp32", "bf16"), default="fp32",
                   help="with --sync-moments, send the moments in bf16 (summed in float32): half their bytes")
    p.add_argument("--denoise-moments", nargs="?", const=True, default=False, choices=(True, "sync"), metavar="sync",
                   help="take each rank's small-batch noise out of its own AdamW second moment, nothing "
                        "sent: at every step (bare flag; helps frequent syncs and short runs), or with "
                        "'sync' at every sync, read from the rank's drift (helps K=16 at 3-4 ranks; "
                        "see CONVERGENCE.md)")
    p.add_argument("--steps", type=int, default=512, help="optimizer steps per rank")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW lr (cosine decay to 10%%)")
    p.add_argument("--warmup", type=int, default=30, help="linear lr warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--context", type=int, default=128, help="sequence length (bytes)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--corpus-mb", type=float, default=2.0, help="cap on the stdlib text read (MB)")
    p.add_argument("--eval-every", type=int, default=64, help="steps between validation passes")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches (split over ranks)")
    p.add_argument("--print-every", type=int, default=16, help="steps between progress lines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", "--log-json", dest="log", default=None,
                   help="write the loss curve and totals to this JSON file (under torchrun spell it "
                        "--log-json: torchrun's own parser takes --log as ambiguous)")
    return p.parse_args(argv)


def _sync_every(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sync-every takes an int >= 1 or 'auto', got {text!r}")


# ----------------------------------------------------------------------------- data
def stdlib_corpus(max_bytes: int) -> bytes:
    """The sorted .py files of Python's standard library, concatenated, capped at ``max_bytes``."""
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Third-party packages differ between machines; the stdlib of one Python version does not.
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(f for f in filenames if f.endswith(".py")):
            with open(os.path.join(dirpath, name), "rb") as fh:
                data = fh.read()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    return b"".join(chunks)


def split(data: bytes, block: int = 8192, every: int = 10):
    """Every ``every``-th block of ``block`` bytes is validation: both halves see every module kind."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    blocks = list(torch.split(t, block))
    val = torch.cat([b for i, b in enumerate(blocks) if i % every == every - 1])
    train = torch.cat([b for i, b in enumerate(blocks) if i % every != every - 1])
    return train, val


def batch(data: torch.Tensor, size: int, context: int, gen: torch.Generator):
    starts = torch.randint(0, data.numel() - context - 1, (size,), generator=gen)
    idx = starts[:, None] + torch.arange(context + 1)
    seq = data[idx]
    return seq[:, :-1], seq[:, 1:]


# ----------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    """A GPT-style decoder over bytes: token + position embeddings, pre-norm blocks, tied head."""

    def __init__(self, vocab: int = 256, d: int = 128, heads: int = 4, layers: int = 2, context: int = 128):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(context, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x) @ self.tok.weight.t()


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


# ----------------------------------------------------------------------------- optimizer
def build_optimizer(args, model: nn.Module):
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99),
                              weight_decay=args.weight_decay)

    def lr_at(step: int) -> float:  # linear warm-up, then cosine decay to 10% of the peak
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(inner, lr_at)
    if args.mode == "allreduce":
        if not hasattr(flo, "DistributedOptimizer"):
            raise SystemExit("--mode allreduce needs flodl_opt.DistributedOptimizer, which this "
                             "version lacks; use --sync-every 1 for a synchronous baseline")
        # The synchronous baseline: gradients averaged every step (Horovod's semantics).
        flo.broadcast_parameters(model.state_dict(), root_rank=0)
        return flo.DistributedOptimizer(inner, named_parameters=model.named_parameters()), sched
    outer = args.outer
    if args.outer in ("diloco", "slowmo") and (args.outer_lr is not None or args.outer_momentum is not None):
        cls = flo.DiLoCo if args.outer == "diloco" else flo.SlowMo
        kw = {}
        if args.outer_lr is not None:
            kw["lr"] = args.outer_lr
        if args.outer_momentum is not None:
            kw["momentum"] = args.outer_momentum
        outer = cls(**kw)
    sync_every = args.sync_every
    if sync_every == "auto" and args.auto_target is not None:
        sync_every = flo.AdaptiveSync(target=args.auto_target)
    # The one-line wrap: any torch optimizer becomes local SGD with a consensus every K steps.
    opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=sync_every, outer=outer,
                                warmup_steps=args.warmup_syncs, max_grad_norm=1.0, lr_scheduler=sched,
                                wire=args.wire, error_feedback=args.error_feedback,
                                fragments=args.fragments, overlap_steps=args.overlap_steps,
                                sync_moments=args.sync_moments, sync_moments_every=args.sync_moments_every,
                                sync_moments_wire=args.sync_moments_wire, denoise_moments=args.denoise_moments)
    return opt, None


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model, val, args, rank, world, train_sum, train_n, dev):
    """Mean validation loss over fixed windows (split across ranks) and mean train loss since last time."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)  # the same windows for every run and every step
    loss_sum, n = 0.0, 0
    for i in range(args.eval_batches):
        x, y = batch(val, args.batch_size, args.context, gen)
        if i % world == rank:
            loss_sum += loss_fn(model, x.to(dev), y.to(dev)).item()
            n += 1
    model.train()
    totals = torch.tensor([loss_sum, n, train_sum, train_n], dtype=torch.float64, device=dev)
    if world > 1:  # metrics only: not part of the training's communication budget
        dist.all_reduce(totals)
    v_sum, v_n, t_sum, t_n = totals.tolist()
    return v_sum / max(v_n, 1), (t_sum / t_n if t_n else float("nan"))


# ----------------------------------------------------------------------------- training
def train(args) -> dict:
    flo.init()
    rank, world, dev = flo.rank(), flo.size(), flo.device()
    torch.manual_seed(args.seed)  # the same initial model on every rank (rank 0's is broadcast anyway)

    train_data, val_data = split(stdlib_corpus(int(args.corpus_mb * 1e6)))
    model = CharLM(256, args.d_model, args.heads, args.layers, args.context).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt, sched = build_optimizer(args, model)
    gen = torch.Generator().manual_seed(args.seed + rank)  # each rank samples its own batches

    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"charlm: {world} rank(s) on {flo.backend()}, {n_params / 1e6:.2f}M params, "
        f"{train_data.numel() / 1e6:.2f}M train / {val_data.numel() / 1e6:.2f}M val bytes, "
        + ("mode=allreduce (gradients averaged every step)" if args.mode == "allreduce"
           else f"sync_every={args.sync_every} outer={args.outer} wire={args.wire}"
           + (f" fragments={args.fragments} overlap_steps={args.overlap_steps}"
              if args.fragments > 1 or args.overlap_steps > 0 else "")))

    curve, collectives, comm_bytes, syncs = [], 0, 0, 0
    last_seen, divergence, seen_count, next_every = None, None, 0, None
    train_sum, train_n = 0.0, 0
    t0 = time.perf_counter()
    tokens_per_step = args.batch_size * args.context * world
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def record(step: int) -> dict:
        nonlocal train_sum, train_n
        local = args.mode == "localsgd" and world > 1 and opt.steps_since_sync > 0
        if local:  # between syncs (sync_every auto): evaluate the ranks' mean, training untouched
            with torch.no_grad():
                kept = [p.detach().clone() for p in model.parameters()]
                for p in model.parameters():  # metrics only, like the loss reduction: not counted
                    dist.all_reduce(p.data)
                    p.data.div_(world)
        val_loss, train_loss = evaluate(model, val_data, args, rank, world, train_sum, train_n, dev)
        if local:
            with torch.no_grad():
                for p, k in zip(model.parameters(), kept):
                    p.data.copy_(k)
        train_sum, train_n = 0.0, 0
        point = {"step": step, "train_loss": train_loss, "val_loss": val_loss, "syncs": syncs,
                 "collectives": collectives, "bytes": comm_bytes, "divergence": divergence,
                 "sync_every": next_every,
                 "tokens": step * tokens_per_step, "wall_s": time.perf_counter() - t0}
        curve.append(point)
        return point

    def count_sync() -> None:
        nonlocal collectives, comm_bytes, syncs, last_seen, divergence, seen_count, next_every
        stats = getattr(opt, "last_sync", None)
        if stats is not None and stats is not last_seen:
            last_seen = stats
            # opt.sync() with fragments syncs each of them (near-equal bytes): count them all.
            n = max(1, opt.sync_count - seen_count)
            seen_count = opt.sync_count
            syncs += n if world > 1 else 0  # a world of one syncs with nobody
            collectives += n * stats.collectives
            comm_bytes += n * stats.bytes
            if stats.divergence is not None:
                divergence = stats.divergence
            next_every = getattr(stats, "next_every", None)  # K chosen for the next period

    record(0)
    say(f"step {0:5d} | val {curve[-1]['val_loss']:.4f}")
    for step in range(1, args.steps + 1):
        x, y = batch(train_data, args.batch_size, args.context, gen)
        loss = loss_fn(model, x.to(dev), y.to(dev))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.mode == "allreduce":  # Horovod's way: average the gradients, clip, step, schedule
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                opt.step()
            sched.step()
            if world > 1:  # one fused collective of all gradients
                syncs, collectives, comm_bytes = syncs + 1, collectives + 1, comm_bytes + grad_bytes
        else:
            opt.step()  # clip -> AdamW step -> scheduler -> every K steps: consensus (+ outer step)
            count_sync()
        train_sum += loss.item()
        train_n += 1
        streaming = args.fragments > 1 or args.overlap_steps > 0  # fragments may be out of step
        if step == args.steps and args.mode == "localsgd" and (opt.steps_since_sync > 0 or streaming):
            opt.sync()  # end on the consensus
            count_sync()
        if step % args.print_every == 0 or step % args.eval_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - t0
            line = (f"step {step:5d} | train {loss.item():.4f} | "
                    f"{step * tokens_per_step / elapsed / 1e3:7.1f}k tok/s | syncs {syncs} "
                    f"| {comm_bytes / 1e6:8.2f} MB sent")
            if divergence is not None:
                line += f" | div {divergence:.2e}"
            if args.sync_every == "auto" and next_every is not None:
                line += f" | K {next_every}"
            if step % args.eval_every == 0 or step == args.steps:
                p = record(step)
                line += f" | val {p['val_loss']:.4f}"
            say(line)

    wall = time.perf_counter() - t0
    final = dict(curve[-1])
    final.update(wall_s=wall, tokens_per_s=args.steps * tokens_per_step / wall)
    # Every rank's weights, summarized: after the closing sync they must be identical.
    with torch.no_grad():
        mine = torch.stack([p.double().sum() for p in model.parameters()]).sum().item()
    checksums = [mine]
    if world > 1:
        checksums = [None] * world
        dist.all_gather_object(checksums, mine)
    final["param_checksums"] = checksums
    result = {"config": {**vars(args), "world_size": world, "backend": flo.backend(), "params": n_params,
                         "train_bytes": train_data.numel(), "val_bytes": val_data.numel(),
                         "torch": torch.__version__},
              "curve": curve, "final": final}
    if rank == 0:
        say(f"done: val {final['val_loss']:.4f} after {args.steps} steps, {syncs} syncs, "
            f"{collectives} collectives, {comm_bytes / 1e6:.2f} MB sent per rank, {wall:.0f} s")
        if args.log:
            os.makedirs(os.path.dirname(os.path.abspath(args.log)), exist_ok=True)
            tmp = args.log + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(result, fh, indent=1)
            os.replace(tmp, args.log)
    flo.shutdown()
    return result


def _rank_main(rank: int, args, port: int) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(args.nproc), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(args.nproc)})
    train(args)


def launch_local(args) -> None:
    """No launcher started us: run ``--nproc`` local ranks, as torchrun would on one machine."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A rank that fails stops the others, and its traceback is raised here.
    mp.spawn(_rank_main, args=(args, port), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    args = parse_args()
    if args.nproc > 1 and not any(v in os.environ for v in LAUNCHER_VARS):
        launch_local(args)
    else:
        train(args)
