"""The DeadPool state machinery: in-memory snapshots and their replication (``snapshot``), what a snapshot of a
training run holds (``training_state``), the agreement on what to restore (``restore``), persistent checkpoints
(``checkpoint``, with lossless ``delta`` and ``lossy`` files), the re-shard after a shrink (``reshard``), the
export of the weights (``export``) and the records of what they did in a run (``run_stats``).

The failure-transparent loop that drives them is :mod:`optim.resilient`.
"""
