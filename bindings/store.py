"""The key-value store of a job's control plane: torch's ``TCPStore`` (no home-made server)."""

from __future__ import annotations

from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore

__all__ = ["Store", "open_store", "prefix_store"]


def open_store(host: str, port: int, *, server: bool, timeout: timedelta) -> TCPStore:
    """Open the job's ``TCPStore``: the server side (``server=True``, ``port`` 0 picks one) or a client.

    Clients never wait for other workers, so a process can join at any time.
    """
    return TCPStore(host, port, None, server, timeout=timeout, wait_for_workers=False)


def prefix_store(prefix: str, store: Store) -> Store:
    """A view of ``store`` whose keys all start with ``prefix`` (one per transport epoch)."""
    return PrefixStore(prefix, store)
