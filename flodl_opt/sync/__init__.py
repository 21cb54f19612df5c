"""The sync sequence and what decides when it runs.

``consensus.py``: the blocking sync (count -> reduce -> readout, restored on failure);
``streaming.py``: fragments, the schedule, one fragment in flight, the delayed merge;
``flat.py``: the region a sync covers, params and float buffers as views of flat buffers.
How the bytes travel is in ``flodl_opt/transport/``; what runs around a sync in ``flodl_opt/hooks/``.
"""
