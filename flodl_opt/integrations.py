"""Framework glue that needs more than the optimizer line: the Hugging Face ``Trainer``.

The Trainer takes a flodl_opt optimizer as it is (``optimizers=(opt, None)``): it copies the
params and wraps the model in DDP after the optimizer was built, and the optimizer adopts both
(the copies at the first sync, the DDP wrapper at the first step). What the Trainer cannot know
is that between syncs every rank holds its own weights and optimizer state, while its checkpoints
keep rank 0's. :class:`LocalSGDCallback` closes that gap:

* before a checkpoint is written it syncs (the saved model is then every rank's model);
* every rank saves its own optimizer state (inner state, counters, outer state) next to it, and
  a resumed run loads each rank's own back, so a resume continues exactly;
* at the end of training it syncs what is left (``max_steps`` need not be a multiple of K).

Example::

    import flodl_opt as flo
    from flodl_opt.integrations import LocalSGDCallback
    from transformers import Trainer, TrainingArguments

    flo.init()                                   # before the Trainer: it adopts the process group
    opt = flo.LocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), model=model,
                                sync_every=16)
    trainer = Trainer(model=model, args=TrainingArguments("out", max_steps=1000, save_steps=200),
                      train_dataset=data, optimizers=(opt, None), callbacks=[LocalSGDCallback()])
    trainer.train()                              # trainer.train(resume_from_checkpoint=True) resumes

transformers is never imported here: the callback answers every ``on_*`` event the Trainer sends,
doing nothing for those it does not need.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch

from .errors import ConfigError
from .optimizer import LocalSGDOptimizer

STATE_FILE = "flodl_opt_rank{rank}.pt"


def find_local_sgd(optimizer: Any) -> Optional[LocalSGDOptimizer]:
    """The LocalSGDOptimizer inside framework wrappers (Accelerate's ``AcceleratedOptimizer``)."""
    for _ in range(8):
        if isinstance(optimizer, LocalSGDOptimizer) or optimizer is None:
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


class LocalSGDCallback:
    """A ``transformers.TrainerCallback``: checkpoints at a sync, per-rank resume, a final sync.

    Args:
        resume_from: the checkpoint directory a resumed run reads the ranks' state from;
            default: the one ``trainer.train(resume_from_checkpoint=...)`` resumes from, else
            ``resume_from_checkpoint`` of the TrainingArguments, else
            ``<output_dir>/checkpoint-<global step>``.
    """

    def __init__(self, resume_from: Optional[str] = None):
        self.resume_from = resume_from
        self._resume_checked = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):  # events this callback has no use for
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def _optimizer(self, kwargs: dict) -> LocalSGDOptimizer:
        opt = find_local_sgd(kwargs.get("optimizer"))
        if opt is None:
            raise ConfigError("flodl_opt: LocalSGDCallback needs the Trainer to train with a "
                              "flo.LocalSGDOptimizer: pass Trainer(..., optimizers=(opt, None)) "
                              "with opt = flo.LocalSGDOptimizer(...)")
        return opt

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer has wrapped the model in DDP by now: make it local before the first
        # backward (found at the first step() instead, that backward would be averaged).
        self._optimizer(kwargs)._find_late_ddp()
        self._resume_checked = False

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer loads rank 0's optimizer.pt into every rank after on_train_begin: each
        # rank's own state goes in on top, before the first step of the resumed run.
        if self._resume_checked:
            return
        self._resume_checked = True
        if state.global_step > 0:
            self._load(args, state, self._optimizer(kwargs))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = self._optimizer(kwargs)
        if control.should_save and not _at_sync(opt):
            opt.sync()  # the Trainer writes rank 0's model: make it every rank's

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = self._optimizer(kwargs)
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}",
                            STATE_FILE.format(rank=_rank(opt)))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp"
        torch.save(opt.state_dict(), tmp)
        os.replace(tmp, path)  # a killed write never leaves a truncated file under the real name

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = self._optimizer(kwargs)
        if not _at_sync(opt):
            opt.sync()

    def _load(self, args: Any, state: Any, opt: LocalSGDOptimizer) -> None:
        where = self.resume_from or _trainer_resume_dir()
        given = getattr(args, "resume_from_checkpoint", None)
        if where is None and isinstance(given, str) and os.path.isdir(given):
            where = given
        if where is None:
            where = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        path = os.path.join(where, STATE_FILE.format(rank=_rank(opt)))
        if not os.path.exists(path):
            warnings.warn(f"flodl_opt: resumed at step {state.global_step} but {path} does not exist: "
                          "every rank continues from rank 0's optimizer state (the Trainer's "
                          "optimizer.pt). Pass LocalSGDCallback(resume_from=<checkpoint dir>) if the "
                          "checkpoint is elsewhere.", stacklevel=2)
            return
        opt.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))


def _trainer_resume_dir() -> Optional[str]:
    """The checkpoint ``trainer.train(resume_from_checkpoint=...)`` is resuming from.

    The Trainer tells callbacks neither the path nor itself; the path is a local of its training
    loop (already resolved when ``True`` was passed), which calls this callback: read it there.
    """
    import sys
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_inner_training_loop":
            path = frame.f_locals.get("resume_from_checkpoint")
            return path if isinstance(path, str) and os.path.isdir(path) else None
        frame = frame.f_back
    return None


def _at_sync(opt: LocalSGDOptimizer) -> bool:
    """Nothing to sync: no step since the last sync and, with fragments, none in flight."""
    stream = getattr(opt, "_stream", None)
    if stream is None:
        return opt.steps_since_sync == 0
    return stream.pending is None and not any(stream.since)  # every fragment, not only fragment 0


def _rank(opt: LocalSGDOptimizer) -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
