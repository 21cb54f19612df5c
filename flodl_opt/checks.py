"""Checks on the objects ``LocalSGDOptimizer`` wraps (optimizer, model, scheduler) and on the ranks
agreeing about them, before the first step and before each sync; and the inner state a rank drops
after a non-finite sync. The options themselves are checked in flodl_opt/config.py."""
from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence, Tuple

import torch
from torch import nn

from . import ddp
from .errors import ConfigError, NonFiniteWarning
from .sync.flat import unique


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside DistributedDataParallel, also under ``torch.compile(DDP(net))``."""
    found = ddp.find_ddp(model)
    return found.module if found is not None else model


def check_objects(optimizer: Any, model: Optional[nn.Module], lr_scheduler: Any, wrapper_cls: type) -> None:
    """The optimizer, model and scheduler a LocalSGDOptimizer is built on, before anything is touched."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"LocalSGDOptimizer wraps a built torch.optim.Optimizer, got "
                          f"{type(optimizer).__name__}; e.g. LocalSGDOptimizer(torch.optim.AdamW(model.parameters()))")
    if isinstance(optimizer, wrapper_cls):
        raise ConfigError("LocalSGDOptimizer is already wrapped; wrap the inner optimizer once")
    if model is not None and not isinstance(model, nn.Module):
        raise ConfigError(f"model must be an nn.Module (or its DDP wrapper), got {type(model).__name__}")
    if lr_scheduler is not None:
        if not hasattr(lr_scheduler, "step") or getattr(lr_scheduler, "optimizer", None) is not optimizer:
            raise ConfigError("lr_scheduler must be a scheduler built on the inner optimizer you are "
                              "wrapping (its .optimizer is that optimizer)")
    opt_params = unique(p for g in optimizer.param_groups for p in g["params"])
    for p in opt_params:
        if not isinstance(p, torch.Tensor):
            raise ConfigError(f"optimizer params must be tensors, got {type(p).__name__}")
    odd = sorted({str(p.dtype) for p in opt_params if not p.is_floating_point()})
    if odd:  # a weighted mean of integers is no integer, and the float32 reduce drops imaginary parts
        raise ConfigError(f"flodl_opt: the optimizer holds params of dtype {odd}; the consensus averages "
                          "real floating-point params only. Keep integer tensors as buffers "
                          "(module.register_buffer), and train complex params as real ones "
                          "(torch.view_as_real) or leave them out of the optimizer.")
    if model is None:
        return
    inner = unwrap_model(model)
    for name, m in inner.named_modules():
        if getattr(m, "sparse", False) is True:
            raise ConfigError(f"flodl_opt: module {name or type(m).__name__} produces sparse gradients; "
                              "build it with sparse=False")
    opt_ids = {id(p) for p in opt_params}
    model_ids = {id(p) for p in inner.parameters()}
    missing = [n for n, p in inner.named_parameters() if p.requires_grad and id(p) not in opt_ids]
    if missing:
        raise ConfigError(f"flodl_opt: trainable params of the model are not in the optimizer: "
                          f"{missing[:8]}{' ...' if len(missing) > 8 else ''}. Build the optimizer on "
                          "model.parameters(), or set requires_grad=False on params you freeze.")
    extra = [tuple(p.shape) for p in opt_params if id(p) not in model_ids]
    if extra:
        raise ConfigError(f"flodl_opt: the optimizer holds {len(extra)} tensor(s) that are not params of "
                          f"the model (shapes {extra[:4]}); pass the model those params belong to")


def check_grads(params: Sequence[torch.Tensor]) -> None:
    """At the first step: the gradients the sync schedule can handle."""
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise ConfigError("flodl_opt: sparse gradients are not supported (an nn.Embedding with "
                              "sparse=True?); use sparse=False")


def check_model_params(param_slots: Sequence[Tuple[nn.Module, str, torch.Tensor]],
                       model: Optional[nn.Module]) -> None:
    """Before a sync: a param replaced on the model after wrapping would be neither stepped nor synced."""
    for mod, attr, p in param_slots:
        if mod._parameters.get(attr) is not p:
            name = next((n for n, m in unwrap_model(model).named_modules() if m is mod), "?")
            name = f"{name}.{attr}" if name else attr
            raise ConfigError(
                f"flodl_opt: model param {name!r} was replaced after LocalSGDOptimizer was built "
                "(a new nn.Parameter assigned to the module), so it is neither stepped nor synced. "
                "Change weights in place (model.load_state_dict, param.data.copy_), or build the "
                "inner optimizer and LocalSGDOptimizer after replacing it.")


def reset_nonfinite_state(optimizer: torch.optim.Optimizer, rank: int, sync_number: int) -> None:
    """A rank that adopted the consensus after NaN/Inf drops inner state that would re-poison it."""
    bad = [p for p, st in optimizer.state.items()
           if any(torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all())
                  for v in st.values())]
    for p in bad:
        del optimizer.state[p]
    if bad:
        # stacklevel: the caller of the sync (step() or sync()), called directly or as a partial
        warnings.warn(f"flodl_opt: rank {rank} reset the inner optimizer state of {len(bad)} "
                      f"param(s) holding NaN/Inf at sync #{sync_number}", NonFiniteWarning,
                      stacklevel=4)
