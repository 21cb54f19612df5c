"""GradScaler: every ``scaler.step(opt)`` reaches the optimizer, overflow or not.

GradScaler skips ``optimizer.step()`` when a rank's fp16 gradients overflow. Under local SGD the
ranks do not share gradients, so one rank may overflow alone; had its step vanished, its step
count would fall behind its peers' and the ranks would sync at different points (a hang, then a
``SyncError``). ``LocalSGDOptimizer`` therefore sets ``_step_supports_amp_scaling``: GradScaler
then calls its ``step()`` every time, with ``found_inf`` and ``grad_scale`` set on it, and the
optimizer itself unscales the gradients, or skips the inner step and counts a tick of zero work.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence

import torch


def scaler_says_skip(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> Optional[bool]:
    """``None`` outside ``GradScaler.step``; else True to skip (inf/NaN found), False to step.

    On False the gradients are unscaled in place first, with the kernel and the float64
    reciprocal GradScaler's own ``unscale_`` uses, so the step is the one it would have taken.
    """
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is None:
        return None
    if bool(found_inf.item()):  # one host sync, as GradScaler's own skip test does
        return True
    scale = getattr(optimizer, "grad_scale", None)  # None: the user already called scaler.unscale_
    if scale is not None:
        inv = scale.double().reciprocal().float()
        groups = defaultdict(list)
        for p in params:
            if p.grad is not None:
                groups[(p.grad.device, p.grad.dtype)].append(p.grad)
        for (device, _), grads in groups.items():
            dummy = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, dummy, inv.to(device))
    return False
