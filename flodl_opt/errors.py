"""Exceptions raised by flodl_opt."""
from typing import Optional


class SyncError(RuntimeError):
    """A sync's collective failed (timeout, dead peer, broken group).

    The rank's params and buffers were restored to their pre-sync values when a pre-sync copy was
    kept (the default), so nothing half-averaged survives. ``rank``, ``sync`` and ``cause`` say
    where and why.
    """

    def __init__(self, rank: int, sync: int, cause: BaseException, restored: bool,
                 state: Optional[str] = None):
        self.rank, self.sync, self.cause, self.restored = rank, sync, cause, restored
        if state is None:
            state = ("params and buffers restored to their pre-sync values" if restored else
                     "params may be partially averaged (keep_presync=False)")
        super().__init__(f"flodl_opt: sync #{sync} failed on rank {rank}: "
                         f"{type(cause).__name__}: {cause}; {state}. A peer died, hung, or did not "
                         "call this sync (every rank must call step()/sync() alike). Exit and "
                         "resume from the last checkpoint (torchrun --max-restarts does it for you).")


class ConfigError(ValueError):
    """Bad input: the message says what to change."""


class CollectiveMismatchError(ConfigError, RuntimeError):
    """Ranks called a collective with different shapes, dtypes, roots, names or ops.

    Raised on every rank before any data moves. Also a ``RuntimeError``, which is what Horovod
    raises for the same mistake (``except RuntimeError`` in Horovod scripts keeps working).
    """


class NonFiniteError(FloatingPointError):
    """Every rank that moved since the last sync holds NaN/Inf params: there is nothing to average.

    Raised on every rank alike (the verdict comes from the shared count), params untouched.
    """


class NonFiniteWarning(RuntimeWarning):
    """This rank's params were NaN/Inf at a sync: it got no vote and adopted the others' consensus."""


class AveragedElsewhereWarning(UserWarning):
    """The ranks' weights were identical before a sync that followed several local steps.

    Something else averaged the gradients every step (a DDP model flodl_opt was not given, a
    framework's own DDP wrapper), so no local SGD happened; or every rank trains on the same data.
    """


class InexactResumeWarning(UserWarning):
    """A load that does not resume this rank exactly where it stopped (the message says why and
    what to do instead)."""


class ForeignRankStateWarning(InexactResumeWarning):
    """This rank loaded the optimizer state another rank saved between syncs: it continues as a
    copy of that rank, and its own steps since the last sync are lost."""


class ForeignMomentsWarning(ForeignRankStateWarning):
    """This rank loaded the optimizer state another rank saved at a consensus point: the weights
    and counters are every rank's, the inner optimizer's moments are that rank's."""


class UnsyncedExitWarning(UserWarning):
    """Training ended (``flo.shutdown()``, interpreter exit) with steps since the last sync: the
    ranks' weights differ. Call ``opt.sync()`` on every rank after the last step."""
