"""What runs around a blocking sync's consensus, one feature per hook.

``base.py``: ``SyncPoint``, ``Hook`` and one hook per feature (each owns its ``state_dict`` entry);
``outer.py``: the outer optimizers (DiLoCo, SlowMo, EASGD, averaging, any torch optimizer);
``moments.py``: shared Adam moments and the two denoisers; ``adaptive.py``: ``sync_every="auto"``.
"""
