"""Framework glue that needs more than the optimizer line: HF ``Trainer``, Lightning, Accelerate.

Between syncs every rank holds its own weights and optimizer state, and the inner optimizer's
moments stay per rank even at a sync; these frameworks save rank 0's. Without the glue below a
resumed rank other than 0 loads rank 0's state and is told so (flodl_opt/provenance.py); with it
every rank resumes exactly:

* HF ``Trainer``: :class:`LocalSGDCallback`;
* Lightning: ``LocalSGDLightningCallback()`` (every rank's state inside Lightning's checkpoint);
* Accelerate: ``accelerate_state(accelerator, opt)`` before ``save_state``/``load_state``.

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
import weakref
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from . import provenance
from .errors import ConfigError, InexactResumeWarning
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

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # A resuming Trainer loads rank 0's optimizer.pt into every rank before any other event:
        # this rank's own goes in instead, found when that load happens.
        opt = find_local_sgd(kwargs.get("optimizer"))
        if opt is not None:
            ref = weakref.ref(opt)  # the registry holds opt weakly: so must this
            provenance.substitute(opt, lambda: self._own_state(args, ref()))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer has wrapped the model in DDP by now: make it local before the first
        # backward (found at the first step() instead, that backward would be averaged).
        self._optimizer(kwargs)._find_late_ddp()
        self._resume_checked = False

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Each rank's own state, before the first step of a resumed run (again, if on_init_end's
        # substitute already put it in; and also when the callback was added after __init__).
        if self._resume_checked:
            return
        self._resume_checked = True
        opt = self._optimizer(kwargs)
        provenance.substitute(opt, None)  # training has begun: no later load is the Trainer's resume
        if state.global_step > 0:
            self._load(args, state, opt)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = self._optimizer(kwargs)
        if control.should_save and not _at_sync(opt):
            opt.sync()  # the Trainer writes rank 0's model: make it every rank's

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = self._optimizer(kwargs)
        save_own_state(opt, os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = self._optimizer(kwargs)
        if not _at_sync(opt):
            opt.sync()

    def _own_path(self, args: Any, opt: LocalSGDOptimizer, global_step: Optional[int]) -> Optional[str]:
        where = self.resume_from or _trainer_resume_dir()
        given = getattr(args, "resume_from_checkpoint", None)
        if where is None and isinstance(given, str) and os.path.isdir(given):
            where = given
        if where is None and global_step is not None:
            where = os.path.join(args.output_dir, f"checkpoint-{global_step}")
        return os.path.join(where, STATE_FILE.format(rank=_rank(opt))) if where is not None else None

    def _own_state(self, args: Any, opt: Optional[LocalSGDOptimizer]) -> Optional[Dict[str, Any]]:
        path = self._own_path(args, opt, None) if opt is not None else None
        if path is None or not os.path.exists(path):
            return None
        return torch.load(path, map_location="cpu", weights_only=True)

    def _load(self, args: Any, state: Any, opt: LocalSGDOptimizer) -> None:
        path = self._own_path(args, opt, state.global_step)
        if not os.path.exists(path):
            warnings.warn(f"flodl_opt: resumed at step {state.global_step} but {path} does not exist: "
                          "every rank continues from rank 0's optimizer state (the Trainer's "
                          "optimizer.pt). Pass LocalSGDCallback(resume_from=<checkpoint dir>) if the "
                          "checkpoint is elsewhere.", InexactResumeWarning, stacklevel=2)
            return
        opt.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def save_own_state(opt: LocalSGDOptimizer, directory: str) -> str:
    """Write this rank's ``opt.state_dict()`` to ``<directory>/flodl_opt_rank<r>.pt``; return the path."""
    path = os.path.join(directory, STATE_FILE.format(rank=_rank(opt)))
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    torch.save(opt.state_dict(), tmp)
    os.replace(tmp, path)  # a killed write never leaves a truncated file under the real name
    return path


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


_at_sync = provenance.at_sync


def _rank(opt: LocalSGDOptimizer) -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ---------------------------------------------------------------- Accelerate
def accelerate_state(accelerator: Any, optimizer: Any) -> None:
    """Make ``accelerator.save_state`` / ``load_state`` resume every rank exactly.

    ``save_state`` writes rank 0's optimizer state only. After this call, ``save_state`` first
    syncs (when there were steps since the last sync: the model it writes is then every rank's)
    and every rank writes its own optimizer state beside it (``flodl_opt_rank<r>.pt``);
    ``load_state`` loads each rank's own instead of rank 0's. Call it once, on every rank, with
    the prepared optimizer (``model, opt = accelerator.prepare(model, opt)``); ``save_state``
    and ``load_state`` are then collective as before.
    """
    opt = find_local_sgd(optimizer)
    if opt is None:
        raise ConfigError("flodl_opt.integrations.accelerate_state needs the optimizer to be a "
                          "flo.LocalSGDOptimizer prepared by the accelerator: opt = "
                          "flo.LocalSGDOptimizer(torch_opt, model=model); model, opt = "
                          "accelerator.prepare(model, opt)")

    opt._find_late_ddp()  # prepare() built DDP after the optimizer: local from the first backward

    def before_save(models: List[Any], weights: List[Any], output_dir: str) -> None:
        if not _at_sync(opt):
            opt.sync()  # every rank calls save_state: the weights written are then every rank's
            weights[:] = [accelerator.get_state_dict(m, unwrap=False) for m in models]
        save_own_state(opt, output_dir)

    def before_load(models: List[Any], input_dir: str) -> None:
        path = os.path.join(input_dir, STATE_FILE.format(rank=_rank(opt)))
        if not os.path.exists(path):
            warnings.warn(f"flodl_opt: {path} does not exist (saved without accelerate_state?): this rank "
                          "loads the optimizer state accelerator.save_state wrote, rank 0's",
                          InexactResumeWarning, stacklevel=2)
            return
        provenance.substitute(opt, torch.load(path, map_location="cpu", weights_only=True))

    accelerator.register_save_state_pre_hook(before_save)
    accelerator.register_load_state_pre_hook(before_load)


# ---------------------------------------------------------------- Lightning
_LIGHTNING_KEY = "flodl_opt_ranks"


def _lightning_callback_class() -> type:
    try:
        from lightning.pytorch import Callback
    except ImportError:  # the older package name
        from pytorch_lightning import Callback

    class LocalSGDLightningCallback(Callback):
        """Every rank's state inside Lightning's checkpoint, and each rank's own back on resume.

        Lightning writes rank 0's checkpoint, with rank 0's optimizer state (and, between syncs,
        rank 0's weights). This callback gathers every rank's optimizer state (and its weights,
        when the ranks' differ) into the checkpoint under ``"flodl_opt_ranks"``; on resume each
        rank loads its own, so every rank continues exactly. Nothing extra is synced.

        Example::

            trainer = L.Trainer(..., callbacks=[LocalSGDLightningCallback()])
            trainer.fit(module, ckpt_path="last.ckpt")   # resumes every rank exactly
        """

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            # The strategy's DDP wrapper exists now: local from the first backward (found at the
            # first step() instead, that backward, the first after every resume, is averaged).
            for o in trainer.optimizers:
                if find_local_sgd(o) is not None:
                    find_local_sgd(o)._find_late_ddp()
            own, self._own_weights = getattr(self, "_own_weights", None), None
            if own is not None:  # after the optimizer's initial broadcast of rank 0's weights
                pl_module.load_state_dict(own)

        def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
            opts = [find_local_sgd(o) for o in trainer.optimizers]
            if not any(o is not None for o in opts):
                return
            own_weights = not all(provenance.at_sync(o) and getattr(o.outer, "name", "") != "easgd"
                                  for o in opts if o is not None)
            mine = {"optimizer_states": [o.state_dict() if o is not None else None for o in opts],
                    "state_dict": pl_module.state_dict() if own_weights else None}
            world = trainer.world_size
            if world > 1:  # Lightning calls this on every rank; rank 0 writes the file
                pieces: Optional[List[Any]] = [None] * world if trainer.global_rank == 0 else None
                dist.gather_object(mine, pieces, dst=0)
            else:
                pieces = [mine]
            if trainer.global_rank == 0:
                checkpoint[_LIGHTNING_KEY] = pieces

        def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
            pieces = checkpoint.get(_LIGHTNING_KEY)
            if pieces is None:
                return  # saved without this callback: provenance warns on the other ranks
            if len(pieces) != trainer.world_size:
                warnings.warn(f"flodl_opt: the checkpoint holds {len(pieces)} ranks' state and this run has "
                              f"{trainer.world_size}: every rank loads rank 0's", InexactResumeWarning,
                              stacklevel=2)
                return
            mine = pieces[trainer.global_rank]
            checkpoint["optimizer_states"] = [own if own is not None else saved for own, saved in
                                              zip(mine["optimizer_states"], checkpoint["optimizer_states"])]
            if mine["state_dict"] is not None:  # between syncs: this rank's weights, not rank 0's
                checkpoint["state_dict"] = mine["state_dict"]
                # the optimizer, built after this, broadcasts rank 0's: loaded again at train start
                self._own_weights = mine["state_dict"]

    return LocalSGDLightningCallback


def __getattr__(name: str) -> Any:
    # Built on first use: importing this module must not import Lightning.
    if name == "LocalSGDLightningCallback":
        cls = _lightning_callback_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
