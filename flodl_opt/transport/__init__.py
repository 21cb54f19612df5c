"""How a sync's bytes travel: the collectives and the payload formats.

``codecs.py``: bf16, fp16, int8 payloads (the ``@register_codec`` registry);
``wire.py``: the compressed reduce of a blocking sync (reduce-scatter, owner sum, all-gather);
``stream_wire.py``: the same reduce for one streaming fragment, in two asynchronous phases;
``grad_buckets.py``: bucketed gradient all-reduce during backward (``DistributedOptimizer``).
"""
