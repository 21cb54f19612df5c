"""Flat storage: the synced tensors live as views into one persistent buffer per dtype.

Packing once at construction is what lets a sync be ONE in-place collective per buffer, with no
``torch.cat`` and no allocation per sync. The parameters keep their identity (the same
``Parameter`` objects, so the inner optimizer's state, hooks and the model all still see them);
only their storage moves, once, into the flat buffer.
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import Dict, Iterable, Iterator, List, Sequence, Tuple

import torch
from torch import nn

from ..errors import ConfigError

# Dtypes reduced as they are; anything narrower is staged to float32 for the reduction
# (PREMUL_SUM in bf16 returns zeros on some NCCL builds, and fp16 sums lose digits).
WIDE_DTYPES = (torch.float32, torch.float64)

# Every tensor starts on a 256-byte boundary: fused and foreach optimizer kernels take their
# vectorized path only when all tensors are aligned (packed back to back, a memory-bound AdamW ran
# 13-19% slower on an H200). The same rule on every device keeps layouts, and so checkpoints of
# flat-sized state (outer anchor and momentum), portable. Gaps are zeros and stay zeros: every
# reduce and outer step is linear in them.
ALIGN_BYTES = 256


def aligned_offsets(numels: Sequence[int], itemsize: int) -> Tuple[List[int], int]:
    """Start offsets (in elements) of tensors laid out on ALIGN_BYTES boundaries, and the total."""
    step = max(1, ALIGN_BYTES // itemsize)
    offsets, end = [], 0
    for n in numels:
        offsets.append(end)
        end += -(-n // step) * step
    return offsets, end


class FlatGroup:
    """Same-device, same-dtype tensors packed into one contiguous buffer.

    ``flat`` is the buffer; each tensor's ``.data`` is rebound to a view of it. ``reduce_view``
    is what a collective reduces: ``flat`` itself for float32/float64, else a float32 staging copy
    allocated on first use (the only extra memory narrow dtypes cost).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], role: str):
        if not tensors:
            raise ValueError("FlatGroup needs at least one tensor")
        first = tensors[0]
        self.role = role
        self.dtype = first.dtype
        self.device = first.device
        self.tensors: List[torch.Tensor] = list(tensors)
        self.shapes = [tuple(t.shape) for t in tensors]
        self.offsets, self.numel = aligned_offsets([t.numel() for t in tensors], first.element_size())
        self.flat = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for t, offset in zip(self.tensors, self.offsets):
                view = self.flat[offset:offset + t.numel()].view(t.shape)
                view.copy_(t)
                t.data = view
        self._ptrs = [t.data_ptr() for t in self.tensors]
        self._staging: torch.Tensor | None = None

    @property
    def wide(self) -> bool:
        return self.dtype in WIDE_DTYPES

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.dtype if self.wide else torch.float32

    def staging(self) -> torch.Tensor:
        """The float32 twin of a narrow-dtype buffer (allocated once, reused every sync)."""
        if self.wide:
            return self.flat
        if self._staging is None:
            self._staging = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        return self._staging

    @property
    def nbytes(self) -> int:
        return self.numel * self.flat.element_size()

    def check_bound(self) -> int:
        """Keep every tensor in the buffer; fail loudly where that cannot be done.

        A tensor whose ``.data`` was replaced by a copy of the same dtype, device and shape (a
        ``.to()`` that copies, as Accelerate's ``prepare()`` and the HF Trainer do even onto the
        device the model is on, or ``p.data = ...``) is adopted: its current values go into its
        slot of the buffer and it becomes a view again, so the sync averages the real weights.
        Returns how many were adopted. A change of dtype or device (``model.half()``,
        ``.cuda()`` after wrapping) cannot be adopted: the buffer and the outer state live in
        the old dtype and device, so that raises.
        """
        adopted = 0
        for i, (t, ptr) in enumerate(zip(self.tensors, self._ptrs)):
            if t.data_ptr() == ptr and t.dtype == self.dtype and t.device == self.device:
                continue
            if t.dtype == self.dtype and t.device == self.device and tuple(t.shape) == self.shapes[i]:
                offset = self.offsets[i]
                view = self.flat[offset:offset + t.numel()].view(self.shapes[i])
                with torch.no_grad():
                    view.copy_(t.data)
                    t.data = view
                adopted += 1
                continue
            raise ConfigError(
                f"flodl_opt: {self.role} #{i} (shape {tuple(t.shape)}) was replaced or moved after "
                f"the optimizer was wrapped (now {t.dtype} on {t.device}, shape {tuple(t.shape)}; was "
                f"{self.dtype} on {self.device}, shape {self.shapes[i]}). Move the model "
                "(.to/.cuda/.half) and load weights before building LocalSGDOptimizer, or load them "
                "in place with model.load_state_dict / param.copy_.")
        return adopted


def pack(tensors: Iterable[torch.Tensor], role: str) -> List[FlatGroup]:
    """Group tensors by (device, dtype) in first-seen order and pack each group."""
    by_key: "OrderedDict[Tuple[torch.device, torch.dtype], List[torch.Tensor]]" = OrderedDict()
    for t in tensors:
        by_key.setdefault((t.device, t.dtype), []).append(t)
    return [FlatGroup(ts, role) for ts in by_key.values()]


def unique(tensors: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """Tensors in order, each once (tied weights appear once)."""
    seen: Dict[int, None] = {}
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen[id(t)] = None
            out.append(t)
    return out


def signature(groups: Sequence[FlatGroup]) -> List[Tuple[str, str, List[Tuple[int, ...]]]]:
    """What must be identical on every rank for the collectives to line up."""
    return [(g.role, str(g.dtype), g.shapes) for g in groups]


# ---------------------------------------------------------------- state dicts of a packed model
# Packed params are views of one buffer, so a plain ``model.state_dict()`` would hand out tensors
# that share storage. torch.save copes, but safetensors (``save_model``, Accelerate's
# ``save_state``, HF ``save_pretrained``) reads them as tied weights: it drops all but one and
# then refuses to load. A post-hook gives each packed entry its own storage instead.
_HOOKED = "_flodl_opt_state_dict_hook"
_views = threading.local()


def own_storage_state_dicts(module: nn.Module) -> None:
    """Make ``module.state_dict()`` (and every submodule's) return packed tensors as own copies.

    Costs one copy of the packed tensors per ``state_dict()`` call. ``keep_vars=True`` still
    returns the params themselves; ``load_state_dict`` copies into the views as before.
    """
    for m in module.modules():
        if (m._parameters or m._buffers) and not getattr(m, _HOOKED, False):
            m.register_state_dict_post_hook(_copy_shared_entries)
            setattr(m, _HOOKED, True)


@contextlib.contextmanager
def state_dict_views() -> Iterator[None]:
    """Inside: ``state_dict()`` returns the views (for code that copies every tensor anyway)."""
    before = getattr(_views, "on", False)
    _views.on = True
    try:
        yield
    finally:
        _views.on = before


def _copy_shared_entries(module: nn.Module, state_dict: Dict, prefix: str, local_metadata) -> None:
    if getattr(_views, "on", False):
        return
    for name, t in list(module._parameters.items()) + list(module._buffers.items()):
        key = prefix + name
        v = state_dict.get(key)
        # v is t itself under keep_vars=True: the caller asked for the live tensors.
        if t is None or v is None or v is t or not _shares_storage(v):
            continue
        state_dict[key] = v.clone(memory_format=torch.contiguous_format)


def _shares_storage(t: torch.Tensor) -> bool:
    """A strided tensor that covers only part of its storage (a view of a flat buffer)."""
    if type(t) not in (torch.Tensor, nn.Parameter) or t.layout != torch.strided or t.is_meta:
        return False
    return t.untyped_storage().nbytes() != t.numel() * t.element_size()
