"""The settings of a job's coordinator (:class:`CoordinatorConfig`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import timedelta

from bindings.validate import check_choice, check_int
from resilient_comm.auth import JobSecret, is_loopback
from resilient_comm.view import MODES

__all__ = ["CoordinatorConfig"]


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """Settings of one job's coordinator.

    Attributes:
        world_size: Active members of the first epoch.
        job: Job id; members presenting another id are refused.
        host: Address the store binds to (loopback unless told otherwise; any
            other address needs a ``secret``).
        port: Store port (0: any free port).
        mode: ``hotswap`` or ``shrink`` (see :data:`resilient_comm.view.MODES`).
        min_world_size: No epoch with fewer members forms; the job fails instead.
        heartbeat_timeout: A member whose heartbeat counter did not move for this
            long is dead (this is what catches a hung, e.g. SIGSTOPped, process).
        ack_timeout: How long a reconfiguration waits for acknowledgements.
        configure_timeout: How long members may take to build an epoch's transport.
        stall_grace: Extra time given to silent members when declaring them dead on
            silence alone would leave no majority (see step 3 above); after it the
            job fails with a clear error, it never hangs.
        start_timeout: How long to wait for the first ``world_size`` members.
        spares: Spares started with the job (by the launcher): the first epoch
            waits for them to register as well, up to ``spare_wait``, so that a
            failure in the first steps finds them (a hot-swap, not a shrink).
        spare_wait: How long the first epoch waits for those spares.
        poll_interval: Period of the control loop.
        events: File for the JSON-lines event log (``None``: memory only).
        secret: The job secret that signs every record (see
            :mod:`resilient_comm.auth`); ``None`` only on loopback.
        store: Where the job's control-plane store lives. ``"tcp"`` (the
            default): this coordinator hosts a ``TCPStore`` at ``host:port``,
            and the job ends when it is lost. ``"etcd://HOST:PORT,...[/PREFIX]"``:
            an etcd v3 cluster; the job's keys go under ``PREFIX/JOB``, any
            number of coordinators started with the same job id and secret
            share the job (one active, the others standby, see
            :mod:`resilient_comm.standby`), and ``host``/``port`` are unused.
    """

    world_size: int
    job: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    host: str = "127.0.0.1"
    port: int = 0
    mode: str = "hotswap"
    min_world_size: int = 1
    heartbeat_timeout: timedelta = timedelta(seconds=2)
    ack_timeout: timedelta = timedelta(seconds=2)
    configure_timeout: timedelta = timedelta(seconds=30)
    stall_grace: timedelta = timedelta(seconds=20)
    start_timeout: timedelta = timedelta(seconds=120)
    spares: int = 0
    spare_wait: timedelta = timedelta(seconds=30)
    poll_interval: timedelta = timedelta(milliseconds=10)
    events: str | None = None
    secret: JobSecret | None = field(default=None, repr=False)
    store: str = "tcp"

    @property
    def store_address(self) -> str:
        """What members connect to for a job kept in etcd: the store's address with the job id added to its prefix."""
        from bindings.etcd_store import EtcdAddress, parse_etcd

        where = parse_etcd(self.store)
        return str(EtcdAddress(endpoints=where.endpoints, prefix=f"{where.prefix}/{self.job}"))

    def __post_init__(self) -> None:
        if self.store != "tcp":
            from bindings.etcd_store import parse_etcd

            if not isinstance(self.store, str) or not self.store.startswith("etcd://"):
                raise ValueError(f"store: expected 'tcp' or 'etcd://HOST:PORT,...', got {self.store!r}")
            where = parse_etcd(self.store)
            if self.secret is None and not all(is_loopback(h) for h, _ in where.endpoints):
                raise ValueError(f"store {self.store!r}: an etcd cluster beyond loopback needs a job secret")
        if self.secret is not None and not isinstance(self.secret, JobSecret):
            raise TypeError(f"secret: expected a JobSecret or None, got {type(self.secret).__name__}")
        if self.secret is None and not is_loopback(self.host):
            raise ValueError(f"host {self.host!r}: binding beyond loopback needs a job secret (secret=JobSecret...)")
        check_int("spares", self.spares, low=0)
        for name in ("world_size", "min_world_size"):
            check_int(name, getattr(self, name), low=1)
        if self.min_world_size > self.world_size:
            raise ValueError(f"min_world_size ({self.min_world_size}) is larger than world_size ({self.world_size})")
        check_choice("mode", self.mode, MODES)
        if not isinstance(self.job, str) or not self.job or "/" in self.job:
            raise ValueError(f"job: must be a non-empty string without '/', got {self.job!r}")
        check_int("port", self.port, low=0, high=65535)
        for name in (
            "heartbeat_timeout",
            "ack_timeout",
            "configure_timeout",
            "stall_grace",
            "start_timeout",
            "spare_wait",
            "poll_interval",
        ):
            v = getattr(self, name)
            if not isinstance(v, timedelta) or v.total_seconds() <= 0:
                raise ValueError(f"{name}: must be a positive datetime.timedelta, got {v!r}")
