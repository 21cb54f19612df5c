"""Outer optimizers: what a sync does with the consensus once every rank holds it.

Each runs replicated and deterministic on every rank (same consensus, same replicated state,
same arithmetic), so the cohort stays in lock-step with no extra collective. Their state (the
anchor ``A`` = the previous global params, and momentum) lives in flat buffers beside the params.

On entry to ``step`` the params hold the consensus ``C``; ``deltas`` (when the outer asks for
them) hold ``W_i_pre - C`` per flat group. The pseudo-gradient is ``d = A - C``: positive where
the ranks moved down, so stepping *against* it moves the params the way the ranks moved.

Example::

    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model,
                                sync_every=64, outer=flo.DiLoCo(momentum=0.5, warmup=8))  # lr by ranks
    # any torch optimizer as the outer one, stepped with the pseudo-gradient as .grad:
    outer = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    opt = flo.LocalSGDOptimizer(inner, model=model, sync_every=64, outer=outer)
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

from ..errors import ConfigError
from ..sync.flat import FlatGroup


# On CPU the update runs block by block: the blocks of W, A and u stay in cache across the update's
# several elementwise passes (DiLoCo's step over 50M params: ~90-115 ms blocked, ~145-185 ms whole).
# On GPU each pass is one kernel over the whole buffer.
CPU_BLOCK = 1 << 16


class OuterOptimizer:
    """Base class. Subclasses override ``_update`` (and ``needs_deltas`` / ``resets_inner``)."""

    name = "outer"
    needs_anchor = True      # keeps A, the previous global params
    needs_deltas = False     # wants W_i_pre - C (forces the pre-sync copy)
    momentum_buffers = 0     # flat buffers of state per group beside the anchor
    resets_inner = False     # clear the inner optimizer's state after each outer step

    def __init__(self) -> None:
        self.anchor: List[torch.Tensor] = []
        self.momentum: List[torch.Tensor] = []

    # -- lifecycle ---------------------------------------------------------------
    def setup(self, groups: Sequence[FlatGroup], world_size: int = 1) -> None:
        """Allocate state once; the anchor starts at the (already broadcast) params.

        ``world_size`` is the number of ranks in the sync (the optimizer passes its group's size).
        """
        if self.needs_anchor:
            self.anchor = [g.flat.detach().to(g.reduce_dtype, copy=True) for g in groups]
        if self.momentum_buffers:
            self.momentum = [torch.zeros(g.numel, dtype=g.reduce_dtype, device=g.device) for g in groups]

    def rebase(self, groups: Sequence[FlatGroup]) -> None:
        """Make the current params the anchor (after a warm-up sync, which is plain averaging)."""
        with torch.no_grad():
            for a, g in zip(self.anchor, groups):
                a.copy_(g.flat)

    def step(self, groups: Sequence[FlatGroup], deltas: Optional[Sequence[torch.Tensor]],
             inner_lr: float) -> None:
        with torch.no_grad():
            for i, g in enumerate(groups):
                parts = (g.flat, self.anchor[i] if self.anchor else None,
                         self.momentum[i] if self.momentum else None,
                         None if deltas is None else deltas[i])
                block = CPU_BLOCK if g.device.type == "cpu" else g.numel
                for start in range(0, g.numel, block):
                    self._update(*(None if t is None else t[start:start + block] for t in parts),
                                 inner_lr=inner_lr)

    def _update(self, w: torch.Tensor, a: Optional[torch.Tensor], u: Optional[torch.Tensor],
                delta: Optional[torch.Tensor], inner_lr: float) -> None:
        """Update one block in place: params ``w`` (holding C), anchor ``a``, momentum ``u``."""
        raise NotImplementedError

    # -- checkpoints -------------------------------------------------------------
    def config(self) -> Dict:
        return {}

    def state_dict(self) -> Dict:
        return {"name": self.name, "config": self.config(),
                "anchor": [a.detach().clone() for a in self.anchor],
                "momentum": [m.detach().clone() for m in self.momentum]}

    def check_state_dict(self, sd: Dict) -> None:
        """Raise ``ConfigError`` if ``load_state_dict(sd)`` would refuse it; writes nothing."""
        if sd.get("name") != self.name:
            raise ConfigError(f"flodl_opt: checkpoint holds outer optimizer {sd.get('name')!r} but this "
                              f"optimizer uses {self.name!r}; build it with outer={sd.get('name')!r}")
        for dst_list, key in ((self.anchor, "anchor"), (self.momentum, "momentum")):
            src_list = sd.get(key, [])
            if len(src_list) != len(dst_list) or any(s.shape != d.shape for s, d in zip(src_list, dst_list)):
                raise ConfigError(f"flodl_opt: outer {key} in the checkpoint does not match this model's "
                                  "flat buffers (a different model or dtype?)")

    def load_state_dict(self, sd: Dict) -> None:
        self.check_state_dict(sd)
        for dst_list, key in ((self.anchor, "anchor"), (self.momentum, "momentum")):
            src_list = sd.get(key, [])
            for d, s in zip(dst_list, src_list):
                d.copy_(s)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"


class OuterAvg(OuterOptimizer):
    """Plain model averaging: the params are the consensus. No state."""

    name = "avg"
    needs_anchor = False

    def step(self, groups, deltas, inner_lr) -> None:
        pass


class DiLoCo(OuterOptimizer):
    """DiLoCo (Douillard et al. 2023): Nesterov SGD on the pseudo-gradient ``d = A - C``.

    Outer step ``k`` (1, 2, ...) with coefficients ``lr_k``, ``mu_k``::

        u <- mu_k*u + d;   step = d + mu_k*u (Nesterov) or u;   W <- A - lr_k*step;   A <- W

    With ``warmup=0`` (``lr_k = lr``, ``mu_k = mu``) this equals ``torch.optim.SGD(lr, momentum,
    nesterov)`` stepped on the anchor, in two flat buffers. ``reset_inner=True`` clears the inner
    optimizer's state after each outer step.

    ``lr=None`` (the default) takes the outer lr from the number of ranks ``M`` at ``setup``:
    ``DiLoCo.default_lr(M)`` = 1.0 for M >= 2 (0.7 for one rank, where nothing was measured). Why:
    on our char-LM at 4 ranks and 16k steps, lr 1.0 beat 0.7 on 6 of 6 seeds (+2.03% against +3.12%
    from gradient all-reduce), and at 2 ranks on every seed at 1k, 4k and 16k steps (+6.17/+1.18/
    +0.09% against +9.73/+3.04/+0.93%; CONVERGENCE.md). Against lr 0.7 and 1.4 at H=16 and H=256
    (16k steps) it is the best at 4 ranks and within 0.3 points of the best at 2. It stays <= 1:
    above 1 the step extrapolates past the consensus (lr 1.4 at H=16 ends 12-15% worse). The
    resolved value is what ``lr`` and ``config()`` report.

    ``warmup=N`` starts from plain averaging and reaches ``(lr, mu)`` at outer step ``N``:
    ``t = min(1, (k - 1)/N)``, ``lr_k = 1 + t*(lr - 1)``, ``mu_k = t*mu`` (so step 1 is exactly
    the average, ``W = C``). Why: a pseudo-gradient that recurs in every window is applied
    ``lr*(1 + mu/(1 - mu)) = lr/(1 - mu)`` times over (7x at lr 0.7, mu 0.9), and the first
    windows' pseudo-gradients (the jump away from the random init, taken at the peak inner lr)
    are both the largest and the most aligned; under a constant ``mu`` they keep being re-applied
    for ~``1/(1 - mu)`` outer steps. Ramping ``mu`` lets that early mass decay out of ``u``.

    ``momentum`` stays 0.5 at every ``H``. At long budgets and ``H >= 256`` (few outer steps), pass
    ``momentum=0.9``: with the warm-up it was the best setting measured at H=256 and 16k steps, at 2
    and at 4 ranks (-1.48% and -0.09% from gradient all-reduce, against -0.57% and +1.29% at 0.5;
    CONVERGENCE.md). It has not been measured at shorter budgets, so it is not the default.
    """

    name = "diloco"
    momentum_buffers = 1

    def __init__(self, lr: Optional[float] = None, momentum: float = 0.5, nesterov: bool = True,
                 reset_inner: bool = False, warmup: int = 8):
        super().__init__()
        if lr is not None and lr <= 0:
            raise ConfigError(f"DiLoCo: lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ConfigError(f"DiLoCo: momentum must be in [0, 1), got {momentum}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ConfigError(f"DiLoCo: warmup must be an int >= 0 (outer steps), got {warmup!r}")
        if nesterov and momentum == 0:
            nesterov = False  # identical maths; saves a pass
        self.lr_by_ranks = lr is None   # resolved from the world size at setup
        self.lr = self.default_lr(1) if lr is None else float(lr)
        self.mu, self.nesterov, self.resets_inner = float(momentum), nesterov, reset_inner
        self.warmup = warmup
        self.steps = 0          # outer steps taken (checkpointed: the warm-up depends on it)
        self._lr_k, self._mu_k = self.lr, self.mu

    @staticmethod
    def default_lr(world_size: int) -> float:
        """The outer lr of ``DiLoCo()`` for ``world_size`` ranks: 1.0 from 2 ranks, 0.7 for one."""
        if world_size < 1:
            raise ConfigError(f"DiLoCo: world_size must be >= 1, got {world_size}")
        return 0.7 if world_size == 1 else 1.0

    def setup(self, groups, world_size: int = 1) -> None:
        if self.lr_by_ranks:
            self.lr = self.default_lr(world_size)
            self._lr_k = self.lr
        super().setup(groups, world_size)

    def config(self) -> Dict:
        return {"lr": self.lr, "momentum": self.mu, "nesterov": self.nesterov, "reset_inner": self.resets_inner,
                "warmup": self.warmup}

    def coefficients(self, k: int) -> "tuple[float, float]":
        """``(lr_k, mu_k)`` of outer step ``k`` (1-based)."""
        if self.warmup == 0:
            return self.lr, self.mu
        t = min(1.0, (k - 1) / self.warmup)
        return 1.0 + t * (self.lr - 1.0), t * self.mu

    def step(self, groups, deltas, inner_lr) -> None:
        self.steps += 1
        self._lr_k, self._mu_k = self.coefficients(self.steps)
        super().step(groups, deltas, inner_lr)

    def _update(self, w, a, u, delta, inner_lr) -> None:
        lr, mu = self._lr_k, self._mu_k
        a.sub_(w)                      # a = d = A - C (the anchor is rebuilt from w below)
        torch.add(a, u, alpha=mu, out=u)   # u = mu*u + d, one pass
        if self.nesterov:              # W = A - lr*(d + mu*u) = C + (1-lr)*d - lr*mu*u
            w.add_(a, alpha=1.0 - lr).add_(u, alpha=-lr * mu)
        else:                          # W = A - lr*u = C + d - lr*u
            w.add_(a).add_(u, alpha=-lr)
        a.copy_(w)

    def state_dict(self) -> Dict:
        sd = super().state_dict()
        sd["steps"] = self.steps
        return sd

    def load_state_dict(self, sd: Dict) -> None:
        super().load_state_dict(sd)
        self.steps = int(sd.get("steps", 0))


class SlowMo(OuterOptimizer):
    """SlowMo (Wang et al. 2020): slow momentum on the averaged displacement.

    ``u <- beta*u + (A - C)/lr_inner``; ``W <- A - alpha*lr_inner*u``. Inner state continues.
    ``lr_inner`` is the inner optimizer's current learning rate (first param group).
    """

    name = "slowmo"
    momentum_buffers = 1

    def __init__(self, lr: float = 1.0, momentum: float = 0.5):
        super().__init__()
        if lr <= 0:
            raise ConfigError(f"SlowMo: lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ConfigError(f"SlowMo: momentum must be in [0, 1), got {momentum}")
        self.lr, self.beta = float(lr), float(momentum)

    def config(self) -> Dict:
        return {"lr": self.lr, "momentum": self.beta}

    def step(self, groups, deltas, inner_lr) -> None:
        if inner_lr <= 0:
            raise ConfigError("SlowMo needs the inner optimizer's lr > 0")
        super().step(groups, deltas, inner_lr)

    def _update(self, w, a, u, delta, inner_lr) -> None:
        a.sub_(w)                                          # d = A - C
        u.mul_(self.beta).add_(a, alpha=1.0 / inner_lr)    # u = beta*u + d/lr_inner
        w.add_(a).add_(u, alpha=-self.lr * inner_lr)       # W = C + d - alpha*lr*u = A - alpha*lr*u
        a.copy_(w)


class EASGD(OuterOptimizer):
    """Elastic averaging (Zhang et al. 2015): each rank moves ``alpha`` of the way to the consensus.

    ``W_i <- W_i + alpha*(C - W_i)``; ranks keep their own drift by design.
    """

    name = "easgd"
    needs_anchor = False
    needs_deltas = True

    def __init__(self, alpha: float = 0.5):
        super().__init__()
        if not 0 < alpha <= 1:
            raise ConfigError(f"EASGD: alpha must be in (0, 1], got {alpha}")
        self.alpha = float(alpha)

    def config(self) -> Dict:
        return {"alpha": self.alpha}

    def _update(self, w, a, u, delta, inner_lr) -> None:
        # W_i + alpha*(C - W_i) = C + (1 - alpha)*(W_i - C)
        w.add_(delta, alpha=1.0 - self.alpha)


class TorchOuter(OuterOptimizer):
    """Any torch optimizer as the outer one: it steps the anchor with ``A - C`` as ``.grad``.

    ``factory`` takes the list of anchor tensors and returns an optimizer, e.g.
    ``functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)``.
    """

    name = "torch"

    def __init__(self, factory: Callable[[List[torch.Tensor]], torch.optim.Optimizer]):
        super().__init__()
        self.factory = factory
        self.optimizer: Optional[torch.optim.Optimizer] = None

    def setup(self, groups, world_size: int = 1) -> None:
        super().setup(groups, world_size)
        self.anchor = [torch.nn.Parameter(a, requires_grad=True) for a in self.anchor]
        for a in self.anchor:
            a.grad = torch.zeros_like(a)
        self.optimizer = self.factory(self.anchor)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ConfigError("outer: the callable must return a torch.optim.Optimizer built on the "
                              f"tensors it is given, got {type(self.optimizer).__name__}")

    def config(self) -> Dict:
        return {"optimizer": type(self.optimizer).__name__ if self.optimizer else None}

    def step(self, groups, deltas, inner_lr) -> None:
        with torch.no_grad():
            for a, g in zip(self.anchor, groups):
                torch.sub(a, g.flat, out=a.grad)   # pseudo-gradient A - C
        self.optimizer.step()
        with torch.no_grad():
            for a, g in zip(self.anchor, groups):
                g.flat.copy_(a)

    def state_dict(self) -> Dict:
        sd = super().state_dict()
        sd["optimizer"] = self.optimizer.state_dict()
        return sd

    def load_state_dict(self, sd: Dict) -> None:
        with torch.no_grad():
            super().load_state_dict(sd)
        self.optimizer.load_state_dict(sd["optimizer"])


OUTER_BY_NAME = {"avg": OuterAvg, "diloco": DiLoCo, "slowmo": SlowMo, "easgd": EASGD}

OuterSpec = Union[None, str, OuterOptimizer, Callable[[List[torch.Tensor]], torch.optim.Optimizer]]


def make_outer(spec: OuterSpec) -> OuterOptimizer:
    """``None`` / a name / an instance / a torch optimizer factory -> an OuterOptimizer."""
    if spec is None:
        return OuterAvg()
    if isinstance(spec, OuterOptimizer):
        return spec
    if isinstance(spec, str):
        cls = OUTER_BY_NAME.get(spec.lower())
        if cls is None:
            raise ConfigError(f"flodl_opt: unknown outer optimizer {spec!r}; use one of "
                              f"{sorted(OUTER_BY_NAME)}, an OuterOptimizer instance, or a callable "
                              "that builds a torch optimizer from a list of tensors")
        return cls()
    if isinstance(spec, torch.optim.Optimizer):
        raise ConfigError("flodl_opt: outer= takes a factory, not a built optimizer (its params would "
                          "not be the anchor); pass functools.partial(torch.optim.SGD, lr=...) instead")
    if callable(spec):
        return TorchOuter(spec)
    raise ConfigError(f"flodl_opt: outer must be None, a name, an OuterOptimizer or a callable, "
                      f"got {type(spec).__name__}")
