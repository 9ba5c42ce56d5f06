"""What the training loop, export and re-shard ask an optimizer: its capabilities, not its class.

An optimizer states how its state is laid out over the ranks and what the
loop must do for it in one frozen record, :class:`OptimizerCapabilities`,
as its ``capabilities`` attribute (:class:`DeclaresCapabilities`). Every
optimizer of this package declares one on its base class; any other
optimizer (a plain ``torch.optim`` one) gets the plain answer from
:func:`capabilities`: a whole replica on every rank that the loop keeps in
step by averaging the gradients, snapshotted as its ``state_dict()`` and the
parameters.

Each answer promises methods: ``own_snapshots`` those of
:class:`SnapshotOptimizer` (and, in the replicated layout, of
:class:`ReplicaSnapshotOptimizer`), ``replicas_drift`` those of
:class:`AveragingOptimizer`. :func:`capabilities` checks the record, not the
methods; ``tests/unit/test_capabilities.py`` checks both for ours.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

from torch import Tensor
from torch.optim.optimizer import StateDict

__all__ = [
    "PLAIN",
    "AveragingOptimizer",
    "DeclaresCapabilities",
    "OptimizerCapabilities",
    "ParamGroup",
    "ReplicaSnapshotOptimizer",
    "SnapshotOptimizer",
    "StateLayout",
    "capabilities",
]

#: A ``torch.optim`` parameter group, or an optimizer's defaults: ``params`` and the hyperparameters by name.
ParamGroup: TypeAlias = dict[str, Any]


class StateLayout(enum.Enum):
    """How an optimizer's state is spread over the ranks."""

    SHARDED = "sharded"
    """Each rank holds a shard of the state (ZeRO-1): a new world size cuts it again."""
    REPLICATED = "replicated"
    """Each rank holds a whole replica, which the optimizer synchronizes itself."""
    PLAIN = "plain"
    """Each rank holds a whole replica of a torch optimizer: the loop must synchronize the ranks."""


@dataclass(frozen=True, kw_only=True)
class OptimizerCapabilities:
    """What an optimizer's state is and what the loop must do for it.

    Attributes:
        layout: How the state is spread over the ranks.
        replicas_drift: The ranks' parameters differ between averagings (local
            steps): the run ends with :meth:`AveragingOptimizer.average_params`,
            evaluation and export use the replicas' average. Replicated layout only.
        own_snapshots: The optimizer snapshots and restores its state itself
            (:class:`SnapshotOptimizer`); ``False``: the loop snapshots its
            ``state_dict()`` and the parameters. Required by the sharded layout,
            refused by the plain one.

    Raises:
        ValueError: A combination no optimizer can honour.
    """

    layout: StateLayout
    replicas_drift: bool
    own_snapshots: bool

    def __post_init__(self) -> None:
        if not isinstance(self.layout, StateLayout):
            raise ValueError(f"layout: expected a StateLayout, got {self.layout!r}")
        if self.replicas_drift and self.layout is not StateLayout.REPLICATED:
            raise ValueError(f"replicas_drift: only a replicated layout drifts, this one is {self.layout.value}")
        fixed = {StateLayout.SHARDED: True, StateLayout.PLAIN: False}.get(self.layout, self.own_snapshots)
        if self.own_snapshots != fixed:
            raise ValueError(f"own_snapshots={self.own_snapshots} does not fit the {self.layout.value} layout")

    @property
    def synchronizes(self) -> bool:
        """Whether the optimizer exchanges what the ranks need itself (else the loop averages the gradients)."""
        return self.layout is not StateLayout.PLAIN


PLAIN = OptimizerCapabilities(layout=StateLayout.PLAIN, replicas_drift=False, own_snapshots=False)
"""The answer for an optimizer that declares none: a plain ``torch.optim`` optimizer."""


class DeclaresCapabilities(Protocol):
    """An optimizer that says what it is (a class attribute or a property)."""

    @property
    def capabilities(self) -> OptimizerCapabilities: ...


def capabilities(optimizer: object) -> OptimizerCapabilities:
    """What ``optimizer`` declares (:class:`DeclaresCapabilities`); :data:`PLAIN` for one that declares nothing."""
    declared = getattr(optimizer, "capabilities", None)
    return declared if isinstance(declared, OptimizerCapabilities) else PLAIN


class SnapshotOptimizer(Protocol):
    """What ``own_snapshots`` promises: in-memory snapshots of this rank's state, and a flat layout to cut again."""

    @property
    def bucket(self) -> Any:
        """The flat layout of the parameters (:class:`optim.optimizers.buckets.FlatBucket`)."""

    @property
    def shard_state(self) -> dict[str, Tensor]:
        """This rank's sharded state tensors, by name (empty for a replicated layout)."""

    def snapshot_state(self) -> StateDict:
        """This rank's state after the last step (live tensors: encode it before the next step)."""

    def restore_snapshot(self, snap: StateDict) -> None:
        """Load a :meth:`snapshot_state` of this rank's layout. Collective."""

    def resync_params(self) -> None:
        """Rebuild the parameters from the restored state. Collective."""

    def checkpoint_decay(self) -> dict[str, float]:
        """Paths in :meth:`snapshot_state` of tensors that decay by a factor every step."""

    def checkpoint_first_moment(self) -> list[str]:
        """Paths in :meth:`snapshot_state` of the first moment."""

    def snapshot_growth(self) -> int:
        """Bytes a later :meth:`snapshot_state` may hold beyond the current one."""


class ReplicaSnapshotOptimizer(SnapshotOptimizer, Protocol):
    """What ``own_snapshots`` promises in the replicated layout: a replica loads under any world size."""

    def restore_replica(self, snap: StateDict) -> None:
        """Load a :meth:`snapshot_state` taken under any world size. Local."""


class AveragingOptimizer(Protocol):
    """What ``replicas_drift`` promises: the replicas averaged, for good or for a while."""

    def average_params(self) -> None:
        """Average every rank's replica into the parameters, for good. Collective."""

    def averaged(self) -> contextlib.AbstractContextManager[None]:
        """Inside the block the parameters hold the replicas' average. Collective."""
