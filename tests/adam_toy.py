"""The toy problem of the inner-moment tests (``test_moments.py``, ``test_denoise.py``): a small MLP,
a data stream that differs by rank and step, and the Adam state read out in float64."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dist_harness import option_off_runs


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def backward(net: nn.Module, rank: int, t: int) -> torch.Tensor:
    """Step ``t``'s loss on ``rank``'s batch, backpropagated."""
    g = torch.Generator().manual_seed(1000 * rank + t)
    x = torch.randn(8, 5, generator=g)
    loss = (net(x) - x[:, :3]).pow(2).mean()
    loss.backward()
    return loss


def train(net: nn.Module, opt, rank: int, steps: int, start: int = 0) -> None:
    for t in range(start + 1, start + steps + 1):
        opt.zero_grad()
        backward(net, rank, t)
        opt.step()


def recorded_steps(net: nn.Module, inner: torch.optim.Optimizer, opt, rank: int, steps: int,
                   with_lr: bool = False) -> list:
    """Steps 1..steps as ``(pre, post)``: params, gradients and (after step 1) moments before each step,
    with ``with_lr`` the lr it used; params and moments after it."""
    out = []
    for t in range(1, steps + 1):
        opt.zero_grad()
        backward(net, rank, t)
        pre = {"p": flat(net), "g": vec(p.grad for p in net.parameters())}
        if with_lr:
            pre["lr"] = inner.param_groups[0]["lr"]
        if t > 1:
            pre["m"], pre["v"] = moments(inner, net)
        opt.step()
        out.append((pre, {"p": flat(net), **dict(zip("mv", moments(inner, net)))}))
    return out


def vec(ts) -> np.ndarray:
    return np.concatenate([t.detach().double().reshape(-1).numpy() for t in ts])


def moments(inner: torch.optim.Optimizer, net: nn.Module):
    """``(exp_avg, exp_avg_sq)`` of every param, flattened."""
    st = [inner.state[p] for p in net.parameters()]
    return vec(s["exp_avg"] for s in st), vec(s["exp_avg_sq"] for s in st)


def flat(net: nn.Module) -> np.ndarray:
    return vec(net.parameters())


def adamw_option_off_runs(rank: int, base_dir, option: str, diloco_lr: float) -> dict:
    """``option_off_runs`` of 10 AdamW steps with a sync every 3 and clipping: params and moments."""
    def run(lib, outer, kw):
        net = model()
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        opt = lib.LocalSGDOptimizer(inner, model=net, sync_every=3, outer=outer, max_grad_norm=1.0,
                                    stall_warning_s=None, **kw)
        train(net, opt, rank, 10)
        opt.sync()
        return (flat(net), *moments(inner, net))
    return option_off_runs(base_dir, option, run, diloco_lr=diloco_lr)
