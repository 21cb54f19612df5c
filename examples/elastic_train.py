"""Elastic training that survives a killed rank: checkpoint at consensus points, resume exactly.

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 examples/elastic_train.py --ckpt /tmp/run/last.pt

Every ``--sync-every`` steps the ranks reach a consensus and the job writes an atomic checkpoint
(model, inner AdamW state per rank, DiLoCo anchor and momentum, counters, LR scheduler, RNG
states, the step). When a rank dies, torchrun restarts the whole job, which resumes from the last
checkpoint: at most one sync window of work is redone, and the result is bit-for-bit the same as
an uninterrupted run (the data of step s on rank r is a pure function of (seed, r, s), and
dropout draws from the restored RNG).

To watch it recover, make a rank kill itself on the first attempt::

    FLODL_KILL_AT_STEP=13 FLODL_KILL_RANK=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 1 examples/elastic_train.py --ckpt /tmp/run/last.pt --out /tmp/run/final.pt
"""
from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Dict, Optional

import torch
from torch import nn

try:
    import flodl_opt as flo
except ImportError:  # run from a source checkout without installing
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import flodl_opt as flo


def batch(seed: int, rank: int, step: int, n: int = 16, dim: int = 8):
    """Step ``step``'s batch on rank ``rank``: the same on every attempt, different per rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    x = torch.randn(n, dim, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def build(seed: int, sync_every: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=10, gamma=0.7)
    opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=sync_every, lr_scheduler=sched,
                                outer=flo.DiLoCo(lr=0.7, momentum=0.5))
    torch.manual_seed(seed + 1 + flo.rank())   # each rank its own dropout masks
    return model, opt


def train(ckpt: Optional[str], steps: int, seed: int = 0, sync_every: int = 4,
          out: Optional[str] = None, log_dir: Optional[str] = None,
          background: bool = False) -> Dict[str, torch.Tensor]:
    """Train to ``steps`` (resuming from ``ckpt`` when it exists); return the final state dict."""
    flo.init()
    torch.set_num_threads(1)   # the same arithmetic on every attempt
    rank = flo.rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_step = int(os.environ.get("FLODL_KILL_AT_STEP", "-1"))
    kill_rank = int(os.environ.get("FLODL_KILL_RANK", "1"))

    model, opt = build(seed, sync_every)
    extra = flo.load_checkpoint(ckpt, model, opt, missing_ok=True) if ckpt else None
    start = extra["step"] if extra else 0
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, f"attempt{attempt}_rank{rank}.json"), "w") as f:
            json.dump({"attempt": attempt, "rank": rank, "start": start,
                       "world_size": flo.size(), "sync_count": opt.sync_count}, f)

    for step in range(start, steps):
        if attempt == 0 and step == kill_step and rank == kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)   # a rank dies without a word
        x, y = batch(seed, rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if ckpt and opt.steps_since_sync == 0:    # a consensus point
            flo.save_checkpoint(ckpt, model, opt, extra={"step": step + 1}, background=background)
    if opt.steps_since_sync:
        opt.sync()                                # end on a consensus
    flo.wait_checkpoint()
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if out and rank == 0:
        torch.save(final, out)
    return final


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="checkpoint file (resumed from when it exists)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="rank 0 writes the final state dict here")
    p.add_argument("--log-dir", help="each attempt and rank writes where it started")
    p.add_argument("--background", action="store_true", help="write checkpoints from a thread")
    a = p.parse_args()
    train(a.ckpt, a.steps, a.seed, a.sync_every, a.out, a.log_dir, a.background)
    flo.shutdown()


if __name__ == "__main__":
    main()
