"""The settings of the torchft recovery benchmark (:mod:`optim.apps.benchmarks.torchft_baseline`) and their JSON.

:class:`TorchftRecoveryConfig` holds one run's settings, durations as ``timedelta``; :func:`settings_json` writes
them into the result in the benchmark's units (``*_s`` seconds, ``*_ms`` milliseconds).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from bindings.json_object import JsonObject

__all__ = ["TorchftRecoveryConfig", "settings_json", "whole_ms"]


@dataclass(frozen=True, kw_only=True)
class TorchftRecoveryConfig:
    """One run of the torchft recovery benchmark: kill one replica group mid-training, watch the rest recover.

    Attributes:
        n: Number of replica groups (one process and one rank each; >= 3).
        kill_step: The victim is SIGKILLed once it has committed this many steps (``0 < kill_step < steps``).
        steps: Steps every replica runs; moved forward while the replacement has not committed yet.
        numel: Float32 elements allreduced per step.
        timeout: Hard wall-clock deadline for the whole run, children included.
        victim: Index of the replica group that is killed.
        restart: Whether to start a replacement for the victim right after the kill.
        prewarm: If True the replacement process is spawned at the start, imports torch/torchft and waits; the
            kill releases it (a warm spare).  If False it is spawned cold right after the kill.
        kill_phase: ``"compute"`` kills the victim once it has finished the quorum of step ``kill_step`` (it is in
            the simulated compute, so the survivors hit the dead peer inside the allreduce); ``"quorum"`` kills it
            right after its commit of step ``kill_step`` (it is entering the next quorum, so the survivors only
            see it missing from the lighthouse quorum).
        step_sleep: Sleep between quorum and allreduce that stands in for compute.
        heartbeat_timeout: Lighthouse: heartbeat age after which a replica counts as dead (whole milliseconds).
        join_timeout: Lighthouse: how long a valid quorum waits for heartbeating stragglers (whole milliseconds).
        quorum_tick: Lighthouse: quorum re-evaluation period (whole milliseconds).
        heartbeat_interval: Manager: heartbeat period to the lighthouse.
        manager_timeout: Manager ``timeout`` (should_commit RPC, checkpoint transfer, futures).
        quorum_timeout: Manager ``quorum_timeout``.
        connect_timeout: Manager ``connect_timeout``.
        pg_timeout: ``ProcessGroupGloo(timeout=...)``, the collective timeout.
        rust_log: ``RUST_LOG`` for the children and the lighthouse unless already set (torchft's Rust side logs
            every quorum at INFO).
        min_replicas: Lighthouse ``min_replicas`` and Manager ``min_replica_size``; None means ``n - 1`` (the
            survivors alone form a valid quorum).
        events_dir: If set, the raw per-replica JSON-lines event files are copied into this directory.

    Raises:
        ValueError: On inconsistent settings.
    """

    n: int = 4
    kill_step: int = 20
    steps: int = 40
    numel: int = 1 << 16
    timeout: timedelta = timedelta(seconds=120)
    victim: int = 2
    restart: bool = True
    prewarm: bool = False
    kill_phase: str = "compute"
    step_sleep: timedelta = timedelta(seconds=0.05)
    heartbeat_timeout: timedelta = timedelta(milliseconds=1000)
    join_timeout: timedelta = timedelta(milliseconds=1000)
    quorum_tick: timedelta = timedelta(milliseconds=50)
    heartbeat_interval: timedelta = timedelta(milliseconds=100)
    manager_timeout: timedelta = timedelta(seconds=5)
    quorum_timeout: timedelta = timedelta(seconds=30)
    connect_timeout: timedelta = timedelta(seconds=5)
    pg_timeout: timedelta = timedelta(seconds=5)
    rust_log: str = "warn"
    min_replicas: int | None = None
    events_dir: str | None = None

    def __post_init__(self) -> None:
        n, victim = self.n, self.victim
        if n < 3 or not 0 <= victim < n or not 0 < self.kill_step < self.steps:
            raise ValueError(f"need n >= 3, 0 <= victim < n and 0 < kill_step < steps (n={n}, victim={victim})")
        if self.kill_phase not in ("compute", "quorum"):
            raise ValueError(f"kill_phase must be 'compute' or 'quorum', got {self.kill_phase!r}")

    @property
    def quorum_min(self) -> int:
        """``min_replicas``, or ``n - 1`` when it is None."""
        return self.n - 1 if self.min_replicas is None else self.min_replicas


def whole_ms(duration: timedelta) -> int:
    """Returns ``duration`` in whole milliseconds, as the lighthouse takes them."""
    return duration // timedelta(milliseconds=1)


def settings_json(config: TorchftRecoveryConfig, *, torchft_version: str | None, rust_log: str | None) -> JsonObject:
    """Describes the run's settings for its result, in the benchmark's units (``*_s`` seconds, ``*_ms`` ms).

    Args:
        config: The run's settings.
        torchft_version: The installed torchft version.
        rust_log: The ``RUST_LOG`` in effect.

    Returns:
        The ``settings`` object of the result.
    """
    return {
        "torchft_version": torchft_version,
        "n": config.n,
        "kill_step": config.kill_step,
        "steps": config.steps,
        "numel": config.numel,
        "timeout_s": config.timeout.total_seconds(),
        "victim": config.victim,
        "restart": config.restart,
        "prewarm": config.prewarm,
        "kill_phase": config.kill_phase,
        "rust_log": rust_log,
        "step_sleep_s": config.step_sleep.total_seconds(),
        "lighthouse": {
            "min_replicas": config.quorum_min,
            "heartbeat_timeout_ms": whole_ms(config.heartbeat_timeout),
            "join_timeout_ms": whole_ms(config.join_timeout),
            "quorum_tick_ms": whole_ms(config.quorum_tick),
        },
        "manager": {
            "min_replica_size": config.quorum_min,
            "use_async_quorum": False,
            "timeout_s": config.manager_timeout.total_seconds(),
            "quorum_timeout_s": config.quorum_timeout.total_seconds(),
            "connect_timeout_s": config.connect_timeout.total_seconds(),
            "heartbeat_interval_ms": whole_ms(config.heartbeat_interval),
            "world_size": 1,
            "checkpoint_transport": "HTTPTransport (default)",
            "init_sync": True,
        },
        "process_group": {"class": "torchft.ProcessGroupGloo", "timeout_s": config.pg_timeout.total_seconds()},
        "processes": "multiprocessing spawn, 1 rank per replica group, own TCPStore each",
    }
