"""The DeadPool state machinery: in-memory snapshots and their replication (``snapshot``), what a snapshot of a
training run holds (``training_state``), the agreement on what to restore (``restore``), persistent checkpoints
(``checkpoint``, with lossless ``delta`` and ``lossy`` files), the re-shard after a shrink (``reshard``) and the
export of the weights (``export``).

The failure-transparent loop that drives them is :mod:`optim.resilient`.
"""
