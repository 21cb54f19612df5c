"""In-process cohort: many ranks and many runs of the char LM as one batched model, for long budgets.

A real run of ``examples/train_charlm.py`` costs one process per rank and one core per process;
16k steps of the demo model take ~50 minutes on one core. Here every replica of every run
(method x seed x rank) is one slice ``R`` of a batched model: params live in one ``[R, N]``
buffer, the forward is batched matmuls, so one GPU (or a few CPU cores) steps a whole grid of runs
at once. What it reproduces of a real run, exactly as the demo and the library do it:

* the model, its initialization (``CharLM`` built with ``torch.manual_seed(seed)``, per run), the
  data (each rank's own generator seeded ``seed + rank``), the validation windows;
* AdamW (lr 2e-3, betas 0.9/0.99, decoupled weight decay), 30 warm-up steps then cosine to 10%,
  gradient clipping at 1.0 per rank (after averaging, for gradient all-reduce);
* the sync schedule of ``LocalSGDOptimizer`` (``warmup_steps`` syncs after every step, then every
  K) and its outer step: the consensus is the mean of the group's replicas, and the library's own
  ``OuterOptimizer`` objects (``flodl_opt.hooks.outer``) step it, with the inner lr the wrapper would pass;
* bytes handed to collectives: the flat (256-byte aligned) float32 params and the 7-double count per
  sync, or all gradients per step for gradient all-reduce.

What differs: float32 arithmetic in a different order (batched kernels, TF32 matmuls on GPU),
AdamW's update applied to the batched buffer, and intermediate evaluations (between syncs) average
every rank's loss on all windows where the demo splits the windows over ranks. At a sync (every
final point) the ranks are identical and the two agree. ``--check`` compares one run against the
real multi-process demo (see CONVERGENCE.md for the figures).

    python tools/cohort_sim.py --steps 256 --ranks 2 --seeds 0 --methods allreduce,localsgd-k16 \\
        --json runs/sim.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import flodl_opt as flo  # noqa: E402
from flodl_opt.hooks.adaptive import DRIFT_BYTES, CohortDrift  # noqa: E402
from flodl_opt.sync.flat import aligned_offsets  # noqa: E402
from flodl_opt.hooks.moments import ar_sum_var, denoised_moments, drift_reading, take_out_excess  # noqa: E402
import train_charlm as demo  # noqa: E402

COUNT_BYTES = 7 * 8  # the sync's count tensor (float64[7]) in flodl_opt.sync.consensus


# ----------------------------------------------------------------------------- methods
def saw_factor(t: int, k: int, a: float) -> float:
    """``-saw{a}``'s inner lr multiplier at the t-th step (0-based) of a window of k: linear from 1 + a
    to 1 - a, mean 1 over the window."""
    return 1.0 if k <= 1 else 1.0 + a * (1.0 - 2.0 * t / (k - 1))


def drift_noise(d: torch.Tensor, denom: torch.Tensor, lr: float, bc1: float, k: int, ranks: int,
                b1: float = 0.9) -> Tuple[torch.Tensor, torch.Tensor]:
    """``-pvc``: ``(s^2 reading, S)`` of each rank from its own deviation ``d = W_i - C`` at a sync after
    ``k`` local steps, nothing sent: the library's ``denoise_moments="sync"`` reading
    (flodl_opt/hooks/moments.py has the formula and why), and ``S``, the window's first-moment deviations
    from the cohort's in raw ``m`` units, for ``-pvcm``."""
    return drift_reading(d, denom, lr, bc1, k, ranks, b1), d * (-bc1 / lr) * denom


def drift_m_share(k: int, b1: float = 0.9) -> float:
    """``-pvcm``: the regression of the last first-moment deviation on ``S`` (the stationary AR(1) above):
    ``E[dm_k | S] = beta S``, so ``m - beta S`` is the rank's best guess of the cohort's mean ``m``."""
    return sum(b1 ** j for j in range(k)) / ar_sum_var(k, b1)


def method_spec(name: str) -> Dict:
    """A method name -> how its group trains. Names:

    ``allreduce``, ``one-rank``, ``sync-k1``, ``localsgd-k{K}``, ``postlocal-w{W}-k{K}``,
    ``diloco-h{H}`` (library defaults), ``diloco-h{H}-lr{LR}-m{MU}`` (explicit outer lr, momentum),
    ``diloco-h{H}-paper`` (lr 0.7, Nesterov 0.9, no warm-up: the former defaults),
    ``diloco-h{H}-...-wd0`` (no inner weight decay), ``slowmo-k{K}``, ``localsgd-auto`` and
    ``localsgd-auto-t{TARGET}`` (``sync_every=flo.AdaptiveSync(target=TARGET)``: the library's rule
    decides each next K from the ranks' RMS divergence at the sync, as in the real sync).
    Suffixes on any name: ``-lrx{S}`` trains with the inner (AdamW) lr times S, warm-up and decay
    included; ``-clip{C}`` clips each rank's gradient (all-reduce: the mean) at norm C, ``-clip0``
    not at all (default 1.0, the demo's); ``-avgm`` also averages the inner AdamW first moments at every sync, ``-avgmv`` both moments,
    ``-avgmvc`` both, the second with each rank's small-batch noise excess taken out: the library's
    ``sync_moments=True`` (flodl_opt/hooks/moments.py has the formula and why; equal weights here);
    ``-lvc`` takes the small-batch noise excess out of each rank's own second moment at every step,
    with no communication (each rank's noise from its own ``(g - m)^2``); ``-svc`` takes the same
    excess out only at the sync, all of the window's at once, from an EMA of each rank's own
    ``(g - m)^2`` over the window (nothing sent; see ``sync``); ``-pvc`` takes it out at the sync too, with
    each rank's noise read from its own deviation from the mean params (``drift_noise``, nothing sent),
    an EMA over syncs; ``-pvcm`` also moves each rank's first moment to its estimate of the cohort's mean
    (``drift_m_share``); ``-me{N}`` shares the moments of
    ``-avgm*`` only at every N-th sync, over the window since the last share; ``-mbf16`` sends
    ``-avgmvc``'s moments as ``sync_moments_wire="bf16"`` does (each rank's share rounded to bf16,
    summed in float32, the sum rounded again); ``-saw{A}`` makes the inner lr fall linearly inside each
    window of K local steps, from (1 + A) times the schedule's lr at its first step to (1 - A) at the
    sync (``saw_factor``), the same lr on average over the window, so the ranks take their smallest
    steps just before they are averaged.
    """
    parts = name.split("-")
    spec = {"name": name, "kind": "local", "k": 1, "warmup": 0, "outer": None, "wd": 0.01, "ranks": None,
            "auto": None, "lr_scale": 1.0, "avg_m": False, "clip": 1.0, "lvc": False, "svc": False,
            "m_every": 1, "mbf16": False, "saw": 0.0, "pvc": False, "pvcm": False}
    while parts[-1] in ("wd0", "avgm", "avgmv", "avgmvc", "lvc", "svc", "mbf16", "pvc", "pvcm") or parts[-1].startswith(("lrx", "clip", "saw")) \
            or (parts[-1].startswith("me") and parts[-1][2:].isdigit()):
        if parts[-1] == "wd0":
            spec["wd"] = 0.0
        elif parts[-1] == "lvc":
            spec["lvc"] = True
        elif parts[-1] == "svc":
            spec["svc"] = True
        elif parts[-1] == "mbf16":
            spec["mbf16"] = True
        elif parts[-1] in ("pvc", "pvcm"):
            spec["pvc"], spec["pvcm"] = True, parts[-1] == "pvcm"
        elif parts[-1].startswith("me"):
            spec["m_every"] = int(parts[-1][2:])
        elif parts[-1].startswith("saw"):
            spec["saw"] = float(parts[-1][3:])
            if not 0.0 < spec["saw"] < 1.0:
                raise SystemExit(f"cohort_sim: -saw{{A}} needs 0 < A < 1; {name!r} has A={spec['saw']}")
        elif parts[-1].startswith("clip"):
            spec["clip"] = float(parts[-1][4:]) or math.inf
        elif parts[-1].startswith("avgm"):
            spec["avg_m"] = parts[-1][3:]   # "m", "mv" or "mvc"
        else:
            spec["lr_scale"] = float(parts[-1][3:])
        parts = parts[:-1]
    if spec["mbf16"] and spec["avg_m"] != "mvc":
        raise SystemExit(f"cohort_sim: -mbf16 narrows -avgmvc's moments; {name!r} shares none")
    head = parts[0]
    if spec["pvc"] and (spec["avg_m"] or spec["svc"] or spec["lvc"] or head not in ("localsgd", "sync")):
        raise SystemExit(f"cohort_sim: -pvc reads plain local SGD's drift (own moments, no outer step); {name!r}")
    if spec["saw"] and not (head in ("localsgd", "postlocal", "diloco", "slowmo") and parts[1] != "auto"):
        raise SystemExit(f"cohort_sim: -saw{{A}} shapes the lr inside a fixed K's window; {name!r} has none")
    if head == "allreduce":
        spec["kind"] = "allreduce"
    elif head == "one":
        spec.update(kind="single", ranks=1, k=10**9)
    elif head == "sync":
        spec["k"] = 1
    elif head == "localsgd" and parts[1] == "auto":   # localsgd-auto[-t0.03]: flo.AdaptiveSync
        kw = {"target": float(parts[2][1:])} if len(parts) > 2 else {}
        spec["auto"] = kw
        spec["k"] = flo.AdaptiveSync(**kw).every
    elif head == "localsgd":
        spec["k"] = int(parts[1][1:])
    elif head == "postlocal":
        spec.update(warmup=int(parts[1][1:]), k=int(parts[2][1:]))
    elif head in ("diloco", "slowmo"):
        spec["k"] = int(parts[1][1:])
        kw = {}
        rest = parts[2:]
        if rest and rest[0].startswith("w") and rest[0][1:].isdigit():   # sync-every-step warm-up
            spec["warmup"] = int(rest[0][1:])
            rest = rest[1:]
        for p in rest:
            if p == "paper":
                kw.update(lr=0.7, momentum=0.9, warmup=0)
            elif p.startswith("lr"):
                kw["lr"] = float(p[2:])
            elif p.startswith("m"):
                kw["momentum"] = float(p[1:])
            elif p.startswith("ow"):
                kw["warmup"] = int(p[2:])
            else:
                raise SystemExit(f"cohort_sim: unknown part {p!r} in method {name!r}")
        spec["outer"] = (head, kw)
    else:
        raise SystemExit(f"cohort_sim: unknown method {name!r}")
    return spec


def _bf16_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean over ranks ``[M, N]`` as ``sync_moments_wire="bf16"`` delivers it: each rank's share
    rounded to bf16, the shares summed in float32, the sum rounded to bf16 again."""
    q = lambda t: t.to(torch.bfloat16).float()
    return q(q(x / x.shape[0]).sum(0))


def shared_moments(m: torch.Tensor, v: torch.Tensor, window: int, b1: float = 0.9,
                           b2: float = 0.99, bf16: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``-avgmvc``'s shared AdamW moments ``(m, v)`` from the ranks' moments ``[M, N]`` after a window of
    ``window`` steps that began from shared moments: the library's ``sync_moments=True`` formula
    (flodl_opt/hooks/moments.py) with equal weights; ``bf16``: through the bf16 moment wire."""
    M = m.shape[0]
    mean = _bf16_mean if bf16 else (lambda x: x.mean(0))
    return denoised_moments(mean(m), mean(m * m), mean(v), 1.0 / M, window, b1, b2)


def build_outer(spec: Dict):
    if spec["outer"] is None:
        return None
    head, kw = spec["outer"]
    return flo.DiLoCo(**kw) if head == "diloco" else flo.SlowMo(**kw)


class _Group:
    """What an OuterOptimizer needs of a flodl_opt FlatGroup: one flat buffer."""

    def __init__(self, flat: torch.Tensor):
        self.flat, self.numel, self.device, self.reduce_dtype = flat, flat.numel(), flat.device, flat.dtype


# ----------------------------------------------------------------------------- batched model
class Batched:
    """``R`` replicas of ``demo.CharLM`` in one ``[R, N]`` buffer (N: the aligned flat size)."""

    def __init__(self, models: List[torch.nn.Module], heads: int, device: torch.device):
        ref = models[0]
        self.names = [n for n, _ in ref.named_parameters()]
        self.shapes = [tuple(p.shape) for _, p in ref.named_parameters()]
        numels = [p.numel() for p in ref.parameters()]
        self.offsets, self.numel = aligned_offsets(numels, 4)
        self.n_params = sum(numels)
        self.R, self.heads = len(models), heads
        flat = torch.zeros(self.R, self.numel)
        for r, m in enumerate(models):
            for off, p in zip(self.offsets, m.parameters()):
                flat[r, off:off + p.numel()] = p.detach().reshape(-1)
        self.flat = flat.to(device).requires_grad_(True)
        # One leaf per param, each a view of ``flat`` (same storage). Differentiating through
        # slices of ``flat`` itself would make every param's backward build a full [R, N] gradient
        # and add them up (one full-size pass per param); ``backward()`` gathers the leaves' grads
        # into ``flat.grad`` in one pass instead.
        self.leaves = {n: self.flat.detach()[:, o:o + math.prod(s)].view(self.R, *s).requires_grad_(True)
                       for n, o, s in zip(self.names, self.offsets, self.shapes)}
        self.layers = sum(1 for n in self.names if n.endswith("ln1.weight"))
        self.onehot = False   # token lookup as a one-hot matmul: no scatter-add in the backward

    def views(self) -> Dict[str, torch.Tensor]:
        return self.leaves

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss.backward()``; returns ``flat.grad`` ([R, N], zero in the alignment padding)."""
        loss.backward()
        if self.flat.grad is None:
            self.flat.grad = torch.zeros_like(self.flat)
        grad = self.flat.grad
        for leaf, o in zip(self.leaves.values(), self.offsets):
            grad[:, o:o + leaf[0].numel()].copy_(leaf.grad.view(self.R, -1))
            leaf.grad = None
        return grad

    def losses(self, x: torch.Tensor, y: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Per-replica mean cross-entropy; ``x``, ``y``: ``[R', B, T]`` for replicas ``rows``."""
        P = self.views()
        if rows is not None:
            P = {k: v[rows] for k, v in P.items()}
        R, B, T = x.shape
        V, d = P["tok.weight"].shape[1:]
        if self.onehot:
            tok = torch.bmm(F.one_hot(x.reshape(R, B * T), V).to(P["tok.weight"].dtype), P["tok.weight"])
            h = (tok.view(R, B, T, d) + P["pos"][:, None, :T]).reshape(R, B * T, d)
        else:
            offs = torch.arange(R, device=x.device).view(R, 1, 1) * V
            h = P["tok.weight"].reshape(R * V, d)[x + offs] + P["pos"][:, None, :T]     # [R,B,T,d]
            h = h.reshape(R, B * T, d)

        def ln(t, name):
            return F.layer_norm(t, (d,)) * P[name + ".weight"][:, None] + P[name + ".bias"][:, None]

        def lin(t, name):
            return torch.baddbmm(P[name + ".bias"][:, None], t, P[name + ".weight"].transpose(1, 2))

        H = self.heads
        for i in range(self.layers):
            pre = f"blocks.{i}."
            qkv = lin(ln(h, pre + "ln1"), pre + "qkv").view(R * B, T, 3, H, d // H).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
            h = h + lin(att.transpose(1, 2).reshape(R, B * T, d), pre + "proj")
            h = h + lin(F.gelu(lin(ln(h, pre + "ln2"), pre + "mlp.0")), pre + "mlp.2")
        logits = torch.bmm(ln(h, "ln"), P["tok.weight"].transpose(1, 2))            # [R,BT,V]
        ce = F.cross_entropy(logits.reshape(-1, V).float(), y.reshape(-1), reduction="none")
        return ce.view(R, -1).mean(1)


# ----------------------------------------------------------------------------- the cohort
ARGS = None


def dump(result: Dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as fh:
        json.dump(result, fh)
    os.replace(path + ".tmp", path)


def simulate(args) -> Dict:
    global ARGS
    ARGS = args
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    seeds = [int(s) for s in args.seeds.split(",")]
    groups: List[Dict] = []
    models = []
    for name in args.methods.split(","):
        spec = method_spec(name)
        for seed in seeds:
            m = spec["ranks"] or args.ranks
            torch.manual_seed(seed)
            model = demo.CharLM(256, args.d_model, args.heads, args.layers, args.context)
            g = dict(spec, seed=seed, ranks=m, start=len(models), rows=list(range(len(models), len(models) + m)))
            models += [model] * m
            groups.append(g)
    net = Batched(models, args.heads, dev)
    net.onehot = args.onehot
    R, N = net.R, net.numel
    flat = net.flat
    print(f"cohort_sim: {len(groups)} runs, {R} replicas of {net.n_params / 1e6:.2f}M params on {dev}, "
          f"{args.steps} steps", flush=True)

    train_data, val_data = demo.split(demo.stdlib_corpus(int(args.corpus_mb * 1e6)))
    train_dev, val_dev = train_data.to(dev), val_data.to(dev)
    gens = []
    for g in groups:
        gens += [torch.Generator().manual_seed(g["seed"] + r) for r in range(g["ranks"])]
    vgen = torch.Generator().manual_seed(1234)
    val_batches = [demo.batch(val_data, args.batch_size, args.context, vgen) for _ in range(args.eval_batches)]
    ar = torch.arange(args.context + 1)

    wd = torch.tensor([g["wd"] for g in groups for _ in g["rows"]], device=dev)[:, None]
    # Per-run inner lr multipliers: the shared AdamW steps every row with the base lr, then rows
    # with S != 1 take S times that step (decay included), i.e. AdamW at lr*S. Unused: untouched.
    lr_scale = torch.tensor([g["lr_scale"] for g in groups for _ in g["rows"]], device=dev)[:, None]
    saw_rows = [g for g in groups if g["saw"]]
    scaled = bool((lr_scale != 1.0).any()) or bool(saw_rows)
    base_scale, base_wd = lr_scale, wd
    wd = wd * lr_scale
    clip = torch.tensor([g["clip"] for g in groups for _ in g["rows"]], device=dev)[:, None]
    clip = clip if bool((clip != 1.0).any()) else None
    inner = torch.optim.AdamW([flat], lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0,
                              **({"fused": True} if dev.type == "cuda" else {}))

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return args.lr_floor + (1.0 - args.lr_floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(inner, lr_at)
    lvc_rows = [g["rows"] for g in groups if g["lvc"] and g["ranks"] > 1]
    lvc_idx = torch.tensor([r for rows in lvc_rows for r in rows], dtype=torch.long, device=dev)
    lvc_c = torch.tensor([(1 - 1 / g["ranks"]) for g in groups if g["lvc"] and g["ranks"] > 1
                          for _ in g["rows"]], device=dev)[:, None]
    # -svc: per row, an EMA (rate 1 - b2, as v's) of (g - m)^2, m the first moment before the step;
    # E[(g - m)^2] = 2 s^2 / (1 + b1) while the mean gradient moves slowly against m's window
    svc_rows = [r for g in groups if g["svc"] and g["ranks"] > 1 for r in g["rows"]]
    svc_idx = torch.tensor(svc_rows, dtype=torch.long, device=dev)
    noise = torch.zeros(len(svc_rows), N, device=dev) if svc_rows else None
    noise_w = [0.0]   # 1 - b2^t: the EMA's bias correction, as Adam's
    svc_pos = {r: i for i, r in enumerate(svc_rows)}
    sync_bytes = N * 4 + COUNT_BYTES
    grad_bytes = net.n_params * 4
    for g in groups:
        g.update(local_steps=0, since=0, msince=0, lr_sum=0.0, pvc_s2=None, pvc_w=0.0, syncs=0, bytes=0, curve=[], train_sum=0.0, train_n=0,
                 outer_obj=build_outer(g), pg_norm=None, outer_syncs=0,
                 auto_obj=flo.AdaptiveSync(**g["auto"]) if g["auto"] is not None else None, ks=[])
        if g["outer_obj"] is not None:
            g["outer_obj"].setup([_Group(flat.detach()[g["start"]].clone())], g["ranks"])  # DiLoCo(): lr by M

    @torch.no_grad()
    def evaluate(step: int, t0: float) -> None:
        vals = torch.zeros(R, device=dev)
        for x, y in val_batches:
            xs = x.to(dev).expand(R, *x.shape)
            ys = y.to(dev).expand(R, *y.shape)
            for lo in range(0, R, args.eval_chunk):
                rows = torch.arange(lo, min(R, lo + args.eval_chunk), device=dev)
                vals[lo:lo + len(rows)] += net.losses(xs[rows], ys[rows], rows)
        vals = (vals / len(val_batches)).tolist()
        sums = flat.detach()[:, :].sum(1).tolist()
        for g in groups:
            v = [vals[r] for r in g["rows"]]
            pt = {"step": step, "val_loss": sum(v) / len(v),
                  "train_loss": g["train_sum"] / g["train_n"] if g["train_n"] else float("nan"),
                  "syncs": g["syncs"], "bytes": g["bytes"], "k": g["k"], "param_sum": sums[g["start"]],
                  "wall_s": time.perf_counter() - t0}
            if g["outer_obj"] is not None and g["outer_obj"].momentum:
                pt["momentum_norm"] = float(g["outer_obj"].momentum[0].norm())
                pt["pseudo_grad_norm"] = g["pg_norm"]
            g["curve"].append(pt)
            g["train_sum"], g["train_n"] = 0.0, 0

    def drift_correct(g: Dict, rows: slice, c: torch.Tensor) -> None:
        """-pvc / -pvcm at the sync, before the average replaces each rank's params (see drift_noise)."""
        st = inner.state[flat]
        m, v = st["exp_avg"], st["exp_avg_sq"]
        b1, b2 = inner.param_groups[0]["betas"]
        k, ranks = max(1, g["since"]), g["ranks"]
        t = float(st["step"])
        vhat = v[rows] / (1 - b2 ** t)
        denom = vhat.sqrt().add_(inner.param_groups[0]["eps"])
        sample, s = drift_noise(flat.detach()[rows] - c, denom, g["lr_sum"] / k, 1 - b1 ** t, k, ranks, b1)
        rho = b2 ** k   # the EMA forgets over syncs as v does over the steps between them
        if g["pvc_s2"] is None:
            g["pvc_s2"] = torch.zeros_like(sample)
        g["pvc_s2"].mul_(rho).add_(sample, alpha=1 - rho)
        g["pvc_w"] = 1 - (1 - g["pvc_w"]) * rho
        # the noise cannot exceed the second moment it is part of (E[v] = mu^2 + s^2): without this cap a
        # rank whose v fell below its peers' reads their longer steps as its own noise and runs away
        v[rows] = take_out_excess(v[rows], torch.minimum(g["pvc_s2"] / g["pvc_w"], vhat), k, ranks, b2)
        if g["pvcm"]:
            m[rows] = m[rows] - drift_m_share(k, b1) * s

    def sync(g: Dict) -> None:
        rows = slice(g["start"], g["start"] + g["ranks"])
        with torch.no_grad():
            c = flat.detach()[rows].mean(0)
            if g["auto_obj"] is not None:   # the readout d_i = ||W_i - C|| / ||C||, shared as an RMS
                d = (flat.detach()[rows] - c).norm(dim=1) / c.norm()
                drift = CohortDrift(g["ranks"], float(d.double().square().mean().sqrt()), float(g["since"]))
                g["k"] = g["auto_obj"].next_period(drift)
                g["ks"].append((g["local_steps"], g["k"]))
                g["bytes"] += DRIFT_BYTES
            outer = g["outer_obj"]
            if outer is not None:
                if g["local_steps"] <= g["warmup"]:
                    outer.anchor[0].copy_(c)          # rebase: warm-up syncs are plain averaging
                else:
                    g["pg_norm"] = float((outer.anchor[0] - c).norm())
                    outer.step([_Group(c)], None, float(inner.param_groups[0]["lr"]) * g["lr_scale"])
                    g["outer_syncs"] += 1
            if g["pvc"] and "exp_avg_sq" in inner.state[flat]:
                drift_correct(g, rows, c)
            flat.detach()[rows] = c
            share = bool(g["avg_m"]) and (g["syncs"] + 1) % g["m_every"] == 0
            b1, b2 = inner.param_groups[0]["betas"]
            if g["svc"] and "exp_avg_sq" in inner.state[flat]:   # each rank's own window excess, nothing sent
                v = inner.state[flat]["exp_avg_sq"]
                idx = svc_idx[[svc_pos[r] for r in g["rows"]]]
                s2 = noise[[svc_pos[r] for r in g["rows"]]] / max(noise_w[0], 1e-12) * (1 + b1) / 2
                excess = (1 - b2 ** max(1, g["since"])) * (1 - 1 / g["ranks"]) * s2
                v[idx] = torch.maximum(v[idx] - excess, v[idx] / g["ranks"])
            if share:   # first moments are linear in the gradients: their mean is all-reduce's
                m, v = inner.state[flat]["exp_avg"], inner.state[flat]["exp_avg_sq"]
                if g["avg_m"] == "mvc":
                    m[rows], v[rows] = shared_moments(m[rows], v[rows], max(1, g["msince"]), b1, b2,
                                                              bf16=g["mbf16"])
                else:
                    if g["avg_m"] == "mv":
                        v[rows] = v[rows].mean(0, keepdim=True)
                    m[rows] = m[rows].mean(0, keepdim=True)
        g["syncs"] += 1
        extra = {"m": 1, "mv": 2, "mvc": 3}.get(g["avg_m"] or "", 0) if share else 0   # mvc: m, m^2, v
        g["bytes"] += sync_bytes + N * (2 if g["mbf16"] else 4) * extra
        g["since"], g["lr_sum"] = 0, 0.0
        if share:
            g["msince"] = 0

    ar_groups = [g for g in groups if g["kind"] == "allreduce"]
    local_groups = [g for g in groups if g["kind"] == "local"]
    t0 = time.perf_counter()
    first = 1
    if args.state and os.path.exists(args.state):   # go on from where a time-limited run stopped
        st = torch.load(args.state, map_location=dev, weights_only=False)
        with torch.no_grad():
            flat.copy_(st["flat"])
        inner.load_state_dict(st["inner"])
        sched.load_state_dict(st["sched"])
        for gen, gs in zip(gens, st["gens"]):
            gen.set_state(gs.cpu())   # map_location moved the CPU generators' states too
        for g, saved in zip(groups, st["groups"]):
            g.update(saved)
        if noise is not None:
            noise.copy_(st["noise"])
            noise_w[0] = st["noise_w"]
        first, t0 = st["step"] + 1, t0 - st["elapsed"]
        print(f"cohort_sim: resumed at step {st['step']} from {args.state}", flush=True)
    else:
        evaluate(0, t0)
    last_print = run_start = time.perf_counter()
    for step in range(first, args.steps + 1):
        if (args.time_limit and time.perf_counter() - run_start > args.time_limit) or \
                (args.stop_after and step > args.stop_after):
            if args.state:
                tmp = args.state + ".tmp"
                torch.save({"step": step - 1, "flat": flat.detach(), "inner": inner.state_dict(),
                            "sched": sched.state_dict(), "gens": [gen.get_state() for gen in gens],
                            "groups": groups, "elapsed": time.perf_counter() - t0,
                            "noise": noise, "noise_w": noise_w[0]}, tmp)
                os.replace(tmp, args.state)
                print(f"cohort_sim: time limit, state at step {step - 1} saved to {args.state}", flush=True)
            return pack(groups, net, t0, partial=True)
        starts = torch.stack([torch.randint(0, train_data.numel() - args.context - 1, (args.batch_size,),
                                            generator=gen) for gen in gens])
        seq = train_dev[(starts[..., None] + ar).to(dev)]
        if saw_rows:   # -saw: this step's place in its window sets its lr (1 inside a warm-up)
            fac = torch.ones(R)
            for g in saw_rows:
                if g["local_steps"] >= g["warmup"]:
                    fac[g["start"]:g["start"] + g["ranks"]] = saw_factor(g["since"], g["k"], g["saw"])
            lr_scale = base_scale * fac.to(dev)[:, None]
            wd = base_wd * lr_scale
        losses = net.losses(seq[..., :-1], seq[..., 1:])
        grad = net.backward(losses.sum())
        with torch.no_grad():
            for g in ar_groups:   # gradient all-reduce: every rank steps on the mean gradient
                rows = slice(g["start"], g["start"] + g["ranks"])
                grad[rows] = grad[rows].mean(0, keepdim=True)
            norms = grad.norm(dim=1, keepdim=True)
            grad.mul_(((1.0 if clip is None else clip) / (norms + 1e-6)).clamp_(max=1.0))
            flat.mul_(1.0 - inner.param_groups[0]["lr"] * wd)   # AdamW's decoupled decay, per run
            before = flat.detach().clone() if scaled else None
            excess = None
            if len(lvc_idx) and "exp_avg" in inner.state[flat]:
                b1, b2 = inner.param_groups[0]["betas"]
                gl, ml = grad[lvc_idx], inner.state[flat]["exp_avg"][lvc_idx]
                excess = torch.minimum(lvc_c * (1 + b1) / 2 * (gl - ml).square(), gl.square()) * (1 - b2)
            if noise is not None and "exp_avg" in inner.state[flat]:
                b2 = inner.param_groups[0]["betas"][1]
                noise.mul_(b2).add_((grad[svc_idx] - inner.state[flat]["exp_avg"][svc_idx]).square(), alpha=1 - b2)
                noise_w[0] = 1 - (1 - noise_w[0]) * b2
        step_lr = float(inner.param_groups[0]["lr"])
        inner.step()
        if excess is not None:
            with torch.no_grad():
                inner.state[flat]["exp_avg_sq"][lvc_idx] -= excess
        if scaled:
            with torch.no_grad():
                flat.copy_(torch.lerp(before, flat.detach(), lr_scale))   # before + S * (after - before)
        sched.step()
        lvals = losses.detach().tolist()
        for g in groups:
            g["train_sum"] += sum(lvals[r] for r in g["rows"]) / g["ranks"]
            g["train_n"] += 1
            if g["kind"] == "allreduce":
                g["syncs"] += 1
                g["bytes"] += grad_bytes
        for g in local_groups:
            g["lr_sum"] += step_lr * g["lr_scale"]
            g["local_steps"] += 1
            g["since"] += 1
            g["msince"] += 1
            if g["local_steps"] <= g["warmup"] or g["since"] >= g["k"] or \
                    (step == args.steps and g["since"] > 0):
                sync(g)
        if step % args.eval_every == 0 or step == args.steps:
            evaluate(step, t0)
            if args.partial and step < args.steps:
                dump(pack(groups, net, t0, partial=True), args.json)
        now = time.perf_counter()
        if now - last_print > args.progress_s or step == args.steps:
            last_print = now
            rate = step / (now - t0)
            print(f"  step {step}/{args.steps} | {rate:.1f} steps/s | ETA {(args.steps - step) / rate:.0f} s",
                  flush=True)

    return pack(groups, net, t0, partial=False)


def pack(groups, net, t0, partial: bool) -> Dict:
    args = ARGS
    out_groups = []
    for g in groups:
        out_groups.append({k: g[k] for k in ("name", "kind", "k", "warmup", "wd", "seed", "ranks", "syncs",
                                             "bytes", "curve", "outer_syncs", "ks", "lr_scale", "avg_m", "clip",
                                             "lvc", "svc", "m_every", "mbf16", "saw", "pvc", "pvcm") if k in g}
                          | {"outer": repr(g["outer_obj"]) if g["outer_obj"] is not None else None,
                             "final": g["curve"][-1]})
    return {"config": {**vars(args), "params": net.n_params, "flat_numel": net.numel, "replicas": net.R,
                       "torch": torch.__version__, "wall_s": time.perf_counter() - t0,
                       "partial": partial},
            "runs": out_groups}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="allreduce,sync-k1,localsgd-k16,diloco-h64,one-rank")
    p.add_argument("--seeds", default="0")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--lr-floor", type=float, default=0.1,
                   help="cosine decay ends at this fraction of the peak lr (1.0: constant after warm-up)")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--corpus-mb", type=float, default=2.0)
    p.add_argument("--eval-every", type=int, default=64)
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--eval-chunk", type=int, default=32, help="replicas per validation forward")
    p.add_argument("--onehot", action="store_true", help="token lookup as a one-hot matmul (faster backward on GPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--progress-s", type=float, default=30.0)
    p.add_argument("--partial", action="store_true", help="rewrite --json at every evaluation")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="stop after this many seconds of training (0: none); with --state, save to go on later")
    p.add_argument("--stop-after", type=int, default=0,
                   help="stop after this step as --time-limit would (0: never); a stop that does not hang on timing")
    p.add_argument("--state", default=None,
                   help="checkpoint file: resumed from when it exists, written when --time-limit or --stop-after "
                        "stops the run")
    p.add_argument("--json", required=True)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = simulate(args)
    dump(result, args.json)
    for r in result["runs"]:
        print(f"{r['name']:>28s} seed {r['seed']:>4d}: val {r['final']['val_loss']:.4f} "
              f"sum {r['final']['param_sum']:.0f} syncs {r['syncs']}")


if __name__ == "__main__":
    main()
