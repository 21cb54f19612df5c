"""A plain DistributedDataParallel script, switched to local SGD by wrapping its optimizer.

The diff against the DDP script it started as::

    +import flodl_opt as flo
     ...
     opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    +opt = flo.LocalSGDOptimizer(opt, model=model, sync_every=args.sync_every, warmup_steps=args.warmup)
     ...
    +opt.sync()   # end on a consensus (optional: the ranks agree at the next sync anyway)

``LocalSGDOptimizer`` sees the ``DistributedDataParallel`` model, stops DDP's gradient all-reduce
after ``warmup_steps`` and its per-forward buffer broadcast, and averages the weights (and
BatchNorm statistics) every ``sync_every`` steps instead. ``--sync-every 0`` runs the unchanged
DDP script, for comparison. Launch it like any DDP script::

    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host0:29500 examples/ddp_train.py
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

try:
    import flodl_opt as flo
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import flodl_opt as flo


def dataset(n: int, seed: int = 0) -> TensorDataset:
    """A smooth regression target the model can learn: y = sin(x A) B."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(16, 32, generator=g) / 4, torch.randn(32, 4, generator=g) / 6
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, torch.sin(x @ a) @ b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sync-every", type=int, default=8, help="0: plain DDP (gradient all-reduce every step)")
    p.add_argument("--warmup", type=int, default=10, help="synchronous steps before going local")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Linear(64, 4)).to(device)
    model = DDP(net, device_ids=[local_rank] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.sync_every > 0:  # the one-line change
        opt = flo.LocalSGDOptimizer(opt, model=model, sync_every=args.sync_every, warmup_steps=args.warmup)

    data = dataset(args.samples)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    loss_fn = nn.MSELoss()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch}: train loss {loss.item():.5f}", flush=True)

    divergence = 0.0
    if args.sync_every > 0:
        stats = opt.sync()  # end on a consensus
        divergence = stats.divergence or 0.0
    model.eval()
    with torch.no_grad():
        x, y = data.tensors
        eval_loss = loss_fn(model(x.to(device)), y.to(device)).item()
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    # one write per line, so the ranks' lines do not interleave on a shared pipe
    sys.stdout.write(f"rank {rank} of {world}: eval_loss={eval_loss:.6f} "
                     f"last_sync_divergence={divergence:.3e} param_checksum={checksum:.17g}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
