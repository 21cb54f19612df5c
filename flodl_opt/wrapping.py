"""The part every flodl_opt optimizer shares: being a torch Optimizer around a built one.

``Optimizer.__init__`` is deliberately not called (it would rebuild ``param_groups`` and state, the
way Horovod's dynamic subclasses re-run user optimizers' constructors). The wrapper shares the inner
optimizer's ``param_groups`` and ``state`` instead, so schedulers, ``GradScaler``, step hooks and
``isinstance(opt, torch.optim.Optimizer)`` all keep working.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .errors import ConfigError


def global_step_hooks() -> bool:
    """Whether any global optimizer step hook is registered (``register_optimizer_step_*_hook``)."""
    from torch.optim import optimizer as torch_optimizer
    return bool(torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks)


class WrappedOptimizer(torch.optim.Optimizer):
    """Base of LocalSGDOptimizer and DistributedOptimizer. Subclasses call ``_share(optimizer)``."""

    optimizer: torch.optim.Optimizer

    def _share(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

    def _step_with_hooks(self, closure: Optional[Callable[[], Any]]) -> Any:
        """``self._step`` with torch's optimizer step hooks, per instance and global, as Optimizer
        runs them: for a ``step`` that skips torch's generic wrapper (``step.hooked = True``)."""
        from torch.optim import optimizer as torch_optimizer
        args, kwargs = (closure,), {}
        for hook in (*torch_optimizer._global_optimizer_pre_hooks.values(),
                     *self._optimizer_step_pre_hooks.values()):
            result = hook(self, args, kwargs)
            if result is not None:
                args, kwargs = result
        loss = self._step(*args, **kwargs)  # type: ignore[attr-defined]
        for hook in (*self._optimizer_step_post_hooks.values(),
                     *torch_optimizer._global_optimizer_post_hooks.values()):
            hook(self, args, kwargs)
        return loss

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        # the inner optimizer's load_state_dict replaces the list: keep reading through to it
        self.optimizer.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def check_same_on_every_rank(desc: Any, summary: Any, group: Optional[dist.ProcessGroup],
                             what: str, legend: str, build: str) -> None:
    """All ranks must wrap the same tensors with the same options, or the collectives misalign.

    One all_gather of a digest of ``desc`` (plus a readable ``summary``); every rank raises the same
    ``ConfigError`` listing each rank's summary, so a mismatch never turns into a hang.
    """
    digest = hashlib.sha1(repr(desc).encode()).hexdigest()
    gathered: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (digest, summary), group=group)
    bad = [r for r, (d, _) in enumerate(gathered) if d != gathered[0][0]]
    if bad:
        lines = "\n".join(f"  rank {r}: {s}" for r, (_, s) in enumerate(gathered))
        raise ConfigError(f"{what} (ranks {bad} differ from rank 0; {legend}):\n{lines}\n"
                          f"Build the same model, optimizer and {build} arguments on every rank.")
