"""The inner Adam/AdamW second moment without each rank's small-batch noise excess.

Three ways, one cause (below): ``LocalSGDOptimizer(..., sync_moments=True)`` shares both moments
at every sync, the excess taken out there (``MomentSync``, 4x the sync's bytes);
``denoise_moments=True`` corrects every rank's own second moment at every step and sends nothing
(``LocalDenoise``); ``denoise_moments="sync"`` corrects it at every sync, from how far the rank
drifted from the consensus, and sends nothing either (``DriftDenoise``).

Why. Between syncs every rank's AdamW sees only its own share of the batch. Its second moment
``v_i`` sums the squares of those small-batch gradients, so where the gradient noise dominates it is
about M times what gradient all-reduce's ``v`` (the square of the averaged gradient) would be. Every
rank then takes shorter steps there than all-reduce would. Averaging the params cannot undo that,
and averaging ``v`` keeps the excess (K=1 averaging of every step trails all-reduce by 1.4-2.3% on
the 4-rank char LM, CONVERGENCE.md). With both moments shared, a window of local steps is linear
in the gradients to first order, so the averaged update is all-reduce's.

What. With ``w_i`` the ranks' work weights (the param consensus's: ``n_i ** gamma``, normalized),
``W2 = sum w_i^2`` and ``K`` the work-weighted window (steps since the last sync):

* ``m <- sum w_i m_i`` (the first moment is linear in the gradients: this is all-reduce's);
* the per-rank gradient noise ``s^2`` is read from the spread of the first moments, which all
  started the window equal: ``Var(m_i) = s^2 (1 - b1)(1 - b1^2K) / (1 + b1)``, estimated without
  bias as ``sum w_i (m_i - m)^2 / (1 - W2)``;
* ``v <- sum w_i v_i - (1 - b2^K)(1 - W2) s^2``: the window put ``(1 - b2^K) s^2`` of noise into each
  ``v_i`` where the weighted mean gradient carries ``W2 s^2``; floored at ``W2 * sum w_i v_i``.

After one step (K=1) from shared moments this is exactly the second moment of the averaged
gradient (tested in float64). Everything rides one fused float32 SUM of ``[w m, w m^2, w v]`` plus
three scalars, issued before the param consensus and written only after it succeeds, so a failure of
either leaves the moments and (with the pre-sync copy) the params as they were. The bytes: three
times the params' (a sync moves 4x the bytes of the plain one).

``sync_moments_wire="bf16"`` halves the moments' bytes (a sync moves 2.5x the plain one's): each
rank's ``[w m, w m^2, w v]`` is rounded to bf16 and summed in float32 by the owner of each section,
whose sum is rounded once more (wire.py's reduce-scatter + all-gather; the scalars stay a float32
SUM). Each moment is then off by at most two bf16 roundings (``2^-8`` relative) of its terms. The
spread ``m^2 - m_bar^2`` is a difference, so in coordinates where the ranks agree its rounding
error is a few ``2^-8`` of ``m^2``, and the formula multiplies it by about
``(1 - b2^K)(1 + b1)/(1 - b1)``: some 5% of ``m^2`` in ``v`` at b1 = 0.9, b2 = 0.99, K = 16, of
either sign, where ``v`` is ``m^2`` or more. bf16 keeps float32's exponent range, which the second moment needs
(values from 1e-20 up); fp16 and int8 would flush its small coordinates to zero, so they are
refused.

Every N-th sync (``sync_moments_every=N``). Between shares every rank keeps its own moments, and the
window above is the steps since the last share (the moments all started it equal), so the same
formula holds over N syncs. The excess re-enters ``v`` at ``1 - b2^t`` after t steps, so with
b2 = 0.99 and K = 16 most of the gain stays at N = 2 (CONVERGENCE.md): a sync's bytes average
``1 + 3/N`` times the plain one's.

Locally, at every step (``denoise_moments=True``). A rank can measure its own gradient noise
without its peers: with ``m`` its first moment before the step, ``g - m`` is the new gradient's noise
minus ``m``'s, ``E[(g - m)^2] = s^2 (1 + (1 - b1)/(1 + b1)) = 2 s^2 / (1 + b1)`` while the mean
gradient moves slowly against ``m``'s window of ``1/(1 - b1)`` steps. Averaged over M ranks of equal
batches, gradient all-reduce's square carries ``s^2 / M`` of that noise. So each step adds

    ``(1 - b2) * max(g^2 - c (g - m)^2, 0)``,  ``c = (1 - 1/M)(1 + b1) / 2``,

to ``v`` instead of ``(1 - b2) g^2``: in expectation all-reduce's ``E[gbar^2] = mu^2 + s^2/M``. The
clamp keeps ``v >= b2 v`` (never negative, never a NaN). The correction lands in ``v`` right after
Adam's own step, so that step's update still sees the newest term uncorrected (weight ``1 - b2``):
taking it out before would need ``v`` to go negative for an instant. Nothing is sent and nothing is added to the
state: exact resume, restore on failure and every sync mode are those of plain local SGD. It
assumes every rank's batch has the same size (M counts ranks, not samples).

At the sync, from the rank's own drift (``denoise_moments="sync"``). The consensus already tells
every rank how far it drifted: ``d = W_i - C``, its params before the sync minus the average. The
part of its steps that all ranks share cancels in ``d``; what is left is its first moment's
deviation from the cohort's, summed over the window and divided by Adam's denominator:
``d = -(lr / bc1) S / (sqrt(v / bc2) + eps)``, ``S = sum_t (m_i,t - mean_j m_j,t)``. Without shared
moments that deviation is a stationary AR(1) in ``b1``, driven by ``(1 - b1)`` times the rank's
gradient noise around the cohort's mean gradient (variance ``(1 - 1/M) s^2``), so

    ``E[S^2] = (1 - 1/M) s^2 (1 - b1) / (1 + b1) A_K``,  ``A_K = K + 2 sum_{j<K} (K - j) b1^j``,

and ``S^2`` over that factor is an unbiased reading of ``s^2`` per coordinate. It is exactly the
spread between the ranks that the average removes, where ``denoise_moments=True``'s ``(g - m)^2``
sees each rank's noise around its own drifting ``m``. The readings are averaged over syncs (an EMA
that forgets at ``b2^K`` per sync, as ``v`` does over the window) and the window's excess is taken
out of the rank's own ``v``: ``v <- max(v - (1 - b2^K)(1 - 1/M) s^2, v / M)``. The reading is capped at
``v / bc2`` (``E[v] = mu^2 + s^2``): a rank whose ``v`` fell below its peers' would otherwise read their
longer steps as its own noise and shrink ``v`` further. Nothing is sent. The state is one
param-sized EMA (in ``state_dict``, so resume is exact); it is written only after a consensus that
succeeded. It assumes ranks of equal work and batch size (M counts the ranks that moved).
"""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..sync.stats import SyncStats, gamma_mass
from ..errors import ConfigError, SyncError
from ..transport.codecs import DEFAULT_WIRE_BLOCK, make_codec, moment_wires
from ..transport.wire import narrow_sum, narrow_sum_bytes

_SCALARS = 3  # weight, weight^2, weight * window
MOMENT_WIRES = moment_wires()  # the codecs that keep each element's exponent (flodl_opt/transport/codecs.py)


def denoised_moments(m: torch.Tensor, m2: torch.Tensor, v: torch.Tensor, w2: float, window: float,
                     b1: float, b2: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(m, v)`` from the weighted means of ``m``, ``m^2`` and ``v`` (weights summing to 1), ``W2``
    the sum of the squared weights and ``window`` the steps since the shared start."""
    if w2 >= 1.0 - 1e-12 or window <= 0:  # one voter: nothing to estimate the noise from
        return m, v
    spread = (m2 - m * m).clamp_(min=0.0) / (1.0 - w2)
    noise = spread * ((1.0 + b1) / ((1.0 - b1) * (1.0 - b1 ** (2.0 * window))))
    excess = (1.0 - b2 ** window) * (1.0 - w2)
    return m, torch.maximum(v - excess * noise, v * w2)


class MomentSync:
    """Shares an Adam/AdamW inner optimizer's moments at every blocking sync (formula above).

    Example (2 ranks, each ``torchrun --nproc-per-node 2 train.py``)::

        opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model,
                                    sync_every=16, sync_moments=True)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                 param_flats: Sequence[torch.Tensor], gamma: float,
                 process_group: Optional[dist.ProcessGroup], comm_device: torch.device,
                 distributed: bool, rank: int, every: int = 1, wire: str = "fp32", world: int = 1):
        """``optimizer`` passed ``check_optimizer``; ``param_flats`` are the flat buffers ``params`` live in;
        ``every``: share at syncs number N, 2N, ... only; ``wire``: one of ``MOMENT_WIRES``."""
        self.optimizer, self.params, self.gamma = optimizer, list(params), float(gamma)
        self.every, self.wire, self.world = int(every), wire, int(world)
        # bf16: the moments ride a reduce-scatter + all-gather of bf16 (wire.py's), summed in float32 at
        # each owner; the three scalars a float32 SUM of their own, so the weights stay exact.
        self._codec = make_codec(wire, DEFAULT_WIRE_BLOCK) if wire != "fp32" else None
        self.window = 0   # this rank's steps in the syncs since the last share (those done, not this one)
        self.param_flats = list(param_flats)  # a few buffers: the finite check reads one flag each
        betas = {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                betas[id(p)] = tuple(float(b) for b in g["betas"])
        self.betas = [betas[id(p)] for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        self.group, self.device, self.distributed, self.rank = process_group, comm_device, distributed, rank

    @property
    def bytes_per_sync(self) -> int:
        if self._codec is None:
            return (3 * self.numel + _SCALARS) * 4
        return narrow_sum_bytes(self._codec, 3 * self.numel, self.world) + _SCALARS * 4

    @property
    def collectives_per_share(self) -> int:
        return 1 if self._codec is None else 3

    def _states(self) -> Optional[List[dict]]:
        states = [self.optimizer.state.get(p) for p in self.params]
        if any(s is None or "exp_avg" not in s or "exp_avg_sq" not in s for s in states):
            return None
        return states

    def due(self, sync_number: int) -> bool:
        return sync_number % self.every == 0

    def done(self, steps: int, shared: bool) -> None:
        """After a consensus that succeeded: a share starts the next window, a plain sync extends it."""
        self.window = 0 if shared else self.window + steps

    def state_dict(self) -> dict:
        return {"window": self.window}

    def load_state_dict(self, state: Optional[dict]) -> None:
        self.window = int(state["window"]) if state else 0

    def reduce(self, steps: int, sync_number: int) -> Optional[torch.Tensor]:
        """Issue the SUM; returns the reduced buffer (nothing is written yet), or None (world of one).
        ``steps``: this rank's work since the last sync; the window adds the syncs since the last share."""
        if not self.distributed:
            return None
        steps = self.window + steps
        states = self._states()
        w = gamma_mass(steps, self.gamma) if states is not None else 0.0
        n = self.numel
        buf = torch.zeros(3 * n + _SCALARS, dtype=torch.float32, device=self.device)
        if w > 0.0:
            with torch.no_grad():
                off = 0
                for st in states:
                    m, v = st["exp_avg"].detach().reshape(-1), st["exp_avg_sq"].detach().reshape(-1)
                    k = m.numel()
                    buf[off:off + k].copy_(m)
                    buf[n + off:n + off + k].copy_(m)
                    buf[2 * n + off:2 * n + off + k].copy_(v)
                    off += k
                if not bool(torch.isfinite(buf[:3 * n]).all()) or \
                        not all(bool(torch.isfinite(f).all()) for f in self.param_flats):
                    w = 0.0  # NaN/Inf moments or params: no vote (the non-finite guard)
                    buf.zero_()
                else:
                    buf[n:2 * n].mul_(buf[n:2 * n])
                    buf[:3 * n].mul_(w)
        buf[3 * n:] = torch.tensor([w, w * w, w * steps])
        try:
            if self._codec is None:
                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
            else:
                dist.all_reduce(buf[3 * n:], op=dist.ReduceOp.SUM, group=self.group)
                narrow_sum(buf[:3 * n], self._codec, self.world, self.rank, self.group)
        except Exception as exc:  # before the param consensus: nothing has been written yet
            raise SyncError(self.rank, sync_number, exc, restored=True,
                            state="params, buffers and inner optimizer moments untouched (the "
                                  "moments' reduce runs before the params')") from exc
        return buf

    def apply(self, buf: Optional[torch.Tensor]) -> None:
        """Write the shared moments into every rank's inner optimizer state (after the consensus)."""
        if buf is None:
            return
        n = self.numel
        total, total_sq, window_sum = buf[3 * n:].tolist()
        if total <= 0.0:
            return  # nobody voted (all idle or non-finite): every rank keeps its own
        states = self._states()
        if states is None:
            return  # this rank's state was reset (non-finite): Adam starts it afresh, as without the option
        with torch.no_grad():
            buf[:3 * n].div_(total)
            w2, window = total_sq / (total * total), window_sum / total
            off = 0
            for st, (b1, b2) in zip(states, self.betas):
                k = st["exp_avg"].numel()
                m, v = denoised_moments(buf[off:off + k], buf[n + off:n + off + k],
                                        buf[2 * n + off:2 * n + off + k], w2, window, b1, b2)
                st["exp_avg"].copy_(m.view_as(st["exp_avg"]))
                st["exp_avg_sq"].copy_(v.view_as(st["exp_avg_sq"]))
                off += k


class LocalDenoise:
    """Takes each rank's small-batch noise excess out of its own Adam/AdamW second moment at every
    step, with no communication (the formula above). Wraps the inner step: ``before()`` reads the
    gradients and first moments, ``after(pending)`` corrects the second moments the step wrote.

    Example (4 ranks, each ``torchrun --nproc-per-node 4 train.py``)::

        opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model,
                                    sync_every=16, denoise_moments=True)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, world_size: int):
        """``optimizer`` passed ``check_optimizer``; ``world_size`` the ranks whose batches all-reduce would average."""
        self.optimizer = optimizer
        self.shrink = 1.0 - 1.0 / max(1, int(world_size))
        # Per param group: (params, b2, c, Adam's L2 weight decay folded into the gradient, sign)
        self.groups = []
        decoupled_cls = isinstance(optimizer, torch.optim.AdamW)
        for g in optimizer.param_groups:
            b1, b2 = (float(b) for b in g["betas"])
            l2 = 0.0 if (decoupled_cls or g.get("decoupled_weight_decay", False)) else float(g["weight_decay"])
            self.groups.append((g["params"], b2, self.shrink * (1.0 + b1) / 2.0, l2,
                                -1.0 if g.get("maximize", False) else 1.0))

    @property
    def active(self) -> bool:
        return self.shrink > 0.0   # one rank: its batch is the whole batch, nothing to take out

    def before(self) -> Optional[List[Tuple[List[torch.Tensor], List[torch.Tensor]]]]:
        """The amounts to take out of ``v`` after the step, per group (None before Adam's first step)."""
        if not self.active:
            return None
        pending = []
        with torch.no_grad():
            for params, b2, c, l2, sign in self.groups:
                ps = [p for p in params if p.grad is not None and "exp_avg" in self.optimizer.state.get(p, {})]
                if not ps:
                    continue
                g = [p.grad for p in ps]
                if l2 != 0.0 or sign != 1.0:  # the gradient Adam's moments see
                    g = torch._foreach_mul(g, sign)
                    if l2 != 0.0:
                        torch._foreach_add_(g, ps, alpha=l2)
                m = [self.optimizer.state[p]["exp_avg"] for p in ps]
                dev = torch._foreach_sub(g, m)                  # g - m
                torch._foreach_mul_(dev, dev)
                torch._foreach_mul_(dev, c)                     # c (g - m)^2
                sq = torch._foreach_mul(g, g)
                torch._foreach_minimum_(dev, sq)                # never more than g^2: v stays >= b2 v
                torch._foreach_mul_(dev, 1.0 - b2)
                pending.append(([self.optimizer.state[p]["exp_avg_sq"] for p in ps], dev))
        return pending or None

    def after(self, pending: Optional[List[Tuple[List[torch.Tensor], List[torch.Tensor]]]]) -> None:
        if not pending:
            return
        with torch.no_grad():
            for vs, dev in pending:
                torch._foreach_sub_(vs, dev)


def ar_sum_var(k: int, b1: float) -> float:
    """Var of the sum of k consecutive terms of a stationary AR(1) in b1, in units of one term's: ``A_K``."""
    return k + 2.0 * sum((k - j) * b1 ** j for j in range(1, k))


def drift_reading(d: torch.Tensor, denom: torch.Tensor, lr: float, bc1: float, steps: int, ranks: int,
                  b1: float) -> torch.Tensor:
    """One rank's reading of its gradient noise ``s^2`` per coordinate from its drift ``d = W_i - C``
    after ``steps`` local Adam steps at mean lr ``lr``: ``S^2 / E[S^2 / s^2]`` (formula above).
    ``denom`` is Adam's ``sqrt(v / bc2) + eps``, ``bc1`` its first bias correction at the sync."""
    s = d.float() * denom * (bc1 / lr)
    return s.square_().div_((1.0 - 1.0 / ranks) * (1.0 - b1) / (1.0 + b1) * ar_sum_var(steps, b1))


def take_out_excess(v: torch.Tensor, s2: torch.Tensor, steps: int, ranks: int, b2: float) -> torch.Tensor:
    """``v`` without the ``(1 - b2^K)(1 - 1/M) s^2`` a window of K steps put in, floored at ``v / M``."""
    return torch.maximum(v - s2 * ((1.0 - b2 ** steps) * (1.0 - 1.0 / ranks)), v / ranks)


class DriftDenoise:
    """Takes each rank's small-batch noise excess out of its own Adam/AdamW second moment at every
    sync, read from how far its params drifted from the consensus (the formula above; nothing sent).

    Example (4 ranks, each ``torchrun --nproc-per-node 4 train.py``)::

        opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters()), model=model,
                                    sync_every=16, denoise_moments="sync")
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]):
        """``optimizer`` passed ``check_optimizer``; ``params`` in the order of the flat param groups."""
        self.optimizer, self.params = optimizer, list(params)
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.group_index = [group_of[id(p)] for p in self.params]
        self.lr_sum = [0.0] * len(optimizer.param_groups)   # the window's lr, per param group
        self.noise: List[Optional[torch.Tensor]] = [None] * len(self.params)   # EMA of s^2 readings
        # per param, 1 - prod(rho): the EMA's bias correction, as Adam's (rho follows its group's b2)
        self.weight: List[float] = [0.0] * len(self.params)

    def count(self) -> None:
        """After an inner step that moved the params: its lr joins the window (before the scheduler's step)."""
        for i, g in enumerate(self.optimizer.param_groups):
            self.lr_sum[i] += float(g["lr"])

    def reset_window(self) -> None:
        self.lr_sum = [0.0] * len(self.lr_sum)

    @staticmethod
    def applies(steps: int, stats: SyncStats) -> bool:
        """A window of this rank's own, and peers that moved to compare it with."""
        return steps > 0 and stats.movers >= 2 and not (stats.nonfinite or stats.skipped)

    def apply(self, deltas: Sequence[torch.Tensor], flats: Sequence, steps: int, ranks: int) -> None:
        """After a consensus that ``applies``: ``deltas[j]`` is ``W_i_pre - C`` of ``flats[j]`` (FlatGroups),
        ``ranks`` the ranks that moved."""
        views = {}
        for d, g in zip(deltas, flats):
            for t, off in zip(g.tensors, g.offsets):
                views[id(t)] = d[off:off + t.numel()]
        with torch.no_grad():
            for j, p in enumerate(self.params):
                st = self.optimizer.state.get(p)
                lr = self.lr_sum[self.group_index[j]] / steps
                if not st or "exp_avg_sq" not in st or lr <= 0.0:
                    continue
                g = self.optimizer.param_groups[self.group_index[j]]
                b1, b2 = (float(b) for b in g["betas"])
                t = float(st["step"])
                v = st["exp_avg_sq"]
                vf = v.float().reshape(-1)
                vhat = vf / (1.0 - b2 ** t)
                reading = drift_reading(views[id(p)], vhat.sqrt().add_(float(g["eps"])), lr, 1.0 - b1 ** t,
                                        steps, ranks, b1)
                rho = b2 ** steps
                if self.noise[j] is None:
                    self.noise[j] = torch.zeros_like(reading)
                self.noise[j].mul_(rho).add_(reading, alpha=1.0 - rho)
                self.weight[j] = 1.0 - (1.0 - self.weight[j]) * rho
                # capped at v / bc2: a reading above the second moment it is part of is another rank's step
                s2 = torch.minimum(self.noise[j] / self.weight[j], vhat)
                v.copy_(take_out_excess(vf, s2, steps, ranks, b2).view_as(v))
        self.reset_window()

    def state_dict(self) -> dict:
        return {"lr_sum": list(self.lr_sum), "weight": list(self.weight),
                "noise": [None if n is None else n.clone() for n in self.noise]}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if not state:
            raise ConfigError("flodl_opt: this checkpoint has no denoise_moments='sync' state (saved "
                              "without the option?): build the optimizer as it was saved")
        self.lr_sum, self.weight = [float(x) for x in state["lr_sum"]], [float(w) for w in state["weight"]]
        self.noise = [None if n is None else n.to(p.device, torch.float32).reshape(-1)
                      for n, p in zip(state["noise"], self.params)]


def check_optimizer(optimizer: torch.optim.Optimizer, option: str = "sync_moments=True") -> None:
    """``option`` needs Adam's moments: ``exp_avg``/``exp_avg_sq`` and ``betas``, no AMSGrad."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ConfigError(f"{option} works on Adam/AdamW moments; the inner optimizer is "
                          f"{type(optimizer).__name__}: use torch.optim.Adam or AdamW, or drop {option}")
    for g in optimizer.param_groups:
        if g.get("amsgrad"):
            raise ConfigError(f"{option} does not cover AMSGrad's running maximum: build the "
                              f"inner Adam/AdamW with amsgrad=False, or drop {option}")
        b1, b2 = g["betas"]
        if not (0.0 <= float(b1) < 1.0 and 0.0 <= float(b2) < 1.0):   # NaN fails the range too
            raise ConfigError(f"{option} needs betas in [0, 1), got {g['betas']!r}")
