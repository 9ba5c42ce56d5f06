"""The key-value store of a job's control plane: torch's ``TCPStore`` (no home-made server).

A ``TCPStore`` client call waits on its socket past the store's own timeout
when the connection goes silent (a cut link: no reset, no answer; measured:
a ``check`` with a 2 s timeout still waiting after 60 s). :class:`BoundedStore`
makes each call on one thread of its own and gives the caller up at the
deadline with :class:`~bindings.errors.CommTimeoutError`; after that the store
counts as unreachable and every later call fails at once (the stuck call may
still return on its thread; its answer is dropped).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore

from bindings.errors import CommTimeoutError

__all__ = [
    "Store",
    "BoundedStore",
    "check_address",
    "connect_store",
    "is_etcd",
    "open_store",
    "parse_address",
    "prefix_store",
]


def parse_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` too), or raise ``ValueError``."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"address: expected 'host:port', got {address!r}")
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address: expected 'host:port', got {address!r}")
    return host, int(port)


def is_etcd(address: str) -> bool:
    """Whether ``address`` names an etcd-kept store (``etcd://...``) rather than a coordinator's ``host:port``."""
    return isinstance(address, str) and address.startswith("etcd://")


def check_address(address: str) -> str:
    """``address`` if it is ``host:port`` or a well-formed ``etcd://`` address; else ``ValueError``."""
    if is_etcd(address):
        from bindings.etcd_store import parse_etcd

        parse_etcd(address)
    else:
        parse_address(address)
    return address


def connect_store(address: str, timeout: timedelta) -> Store:
    """A client of the job's store: the coordinator's ``TCPStore`` at ``host:port``, or an etcd cluster."""
    if is_etcd(address):
        from bindings.etcd_store import EtcdStore

        return EtcdStore(address, timeout)
    host, port = parse_address(address)
    return open_store(host, port, server=False, timeout=timeout)


def open_store(host: str, port: int, *, server: bool, timeout: timedelta) -> TCPStore:
    """Open the job's ``TCPStore``: the server side (``server=True``, ``port`` 0 picks one) or a client.

    Clients never wait for other workers, so a process can join at any time.
    """
    return TCPStore(host, port, None, server, timeout=timeout, wait_for_workers=False)


def prefix_store(prefix: str, store: Store) -> Store:
    """A view of ``store`` whose keys all start with ``prefix`` (one per transport epoch).

    A store written in Python (e.g. :class:`~bindings.etcd_store.EtcdStore`)
    must stay referenced from Python while the view is used: the view holds
    only its C++ side.
    """
    return PrefixStore(prefix, store)


class BoundedStore:
    """The store calls of a control-plane client, each ended by a deadline even on a silent connection.

    Args:
        store: The store (one connection, used only through this object from now on).
        timeout: Deadline of each call.
        name: What the store is, for error messages (e.g. the coordinator's address).
    """

    def __init__(self, store: Store, timeout: timedelta, name: str) -> None:
        self._store = store
        self._timeout = timeout.total_seconds()
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._lost: str | None = None
        self._current: Future[Any] | None = None
        self._thread = threading.Thread(target=self._serve, name=f"sparsecomm-store-{name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            self._current = fut
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                self._settle(fut, exc, None)
            else:
                self._settle(fut, None, result)

    @staticmethod
    def _settle(fut: Future[Any], exc: BaseException | None, result: Any) -> None:
        try:
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)
        except InvalidStateError:  # given up on meanwhile (give_up)
            pass

    def _call(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        if self._lost is not None:
            raise CommTimeoutError(self._lost)
        fut: Future[Any] = Future()
        self._jobs.put((fut, fn, args))
        try:
            return fut.result(self._timeout)
        except FutureTimeout:
            fut.cancel()
            self._lost = f"store {self._name}: {op} got no answer within {self._timeout:g} s (unreachable)"
            raise CommTimeoutError(self._lost) from None

    def give_up(self, reason: str) -> None:
        """Count the store as unreachable from now on; a call waiting for an answer raises at once."""
        self._lost = reason
        fut = self._current
        if fut is not None and not fut.done():
            self._settle(fut, CommTimeoutError(reason), None)

    @property
    def lost(self) -> str | None:
        """Why the store counts as unreachable (``None``: it does not)."""
        return self._lost

    def add(self, key: str, value: int) -> int:
        return int(self._call("add", self._store.add, key, value))

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", self._store.set, key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._call("get", self._store.get, key))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._call("check", self._store.check, list(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", self._store.delete_key, key))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [bytes(v) for v in self._call("multi_get", self._store.multi_get, list(keys))]

    def compare_set(self, key: str, expected: str, desired: str | bytes) -> bytes:
        return bytes(self._call("compare_set", self._store.compare_set, key, expected, desired))

    def close(self) -> None:
        """Stop the call thread once the calls posted so far are done (it is a daemon if one is stuck)."""
        self._jobs.put(None)
