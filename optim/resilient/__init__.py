"""Failure-transparent training for any training loop (the DeadPool client): :class:`ResilientTraining`.

``loop`` is the step, ``loop_recovery`` the run's state and its recovery after a failure, ``loop_config`` the
settings and plug-in types, ``step_health`` what every rank reports about its step. The state it snapshots and
restores is :mod:`optim.state`'s.
"""

from __future__ import annotations

from optim.resilient.loop import BadStepsError, ResilientConfig, ResilientTraining, Stateful, UnrecoverableStateError
from optim.resilient.loop_recovery import RecoveryPhases, RecoveryRecord

__all__ = [
    "BadStepsError",
    "RecoveryPhases",
    "RecoveryRecord",
    "ResilientConfig",
    "ResilientTraining",
    "Stateful",
    "UnrecoverableStateError",
]
