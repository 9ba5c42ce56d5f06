"""A torch ``Store`` kept in an etcd v3 cluster: a control plane with no single process to lose.

:class:`EtcdStore` speaks etcd's v3 API through its JSON gateway (the
``etcd3gw`` client, imported when first used) and implements what the job's
control plane and gloo's rendezvous ask of a ``Store``: ``set``, ``get``
(waits for the key), ``add``, ``check``, ``wait``, ``compare_set``,
``delete_key``, ``multi_get`` and ``num_keys``. Every key lives under one
prefix, so several jobs can share a cluster. A request that finds its member
down goes to the next endpoint; only when every endpoint failed within the
store's timeout does the call raise.

Two extras serve the coordinator's election (:mod:`resilient_comm.standby`):
leases (:meth:`EtcdStore.grant`, :meth:`EtcdStore.refresh`,
:meth:`EtcdStore.create_leased`) and a *fence*: with :meth:`EtcdStore.fence`
set, every write is a transaction that goes through only while the given key
still holds the given value (the leader's own lease-bound record), and raises
:class:`FencedError` once it does not, so a coordinator that lost its lease
(paused, cut off) can never write over its successor.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from torch.distributed import DistStoreError, Store

from bindings.errors import CommError, CommTimeoutError
from bindings.json_object import JsonObject

__all__ = ["EtcdAddress", "EtcdStore", "FencedError", "parse_etcd"]

logger = logging.getLogger(__name__)

SCHEME = "etcd://"
#: Words of an etcd error that another try (on this member or the next) may not meet: elections, overload.
_TRANSIENT = ("leader", "unavailable", "timed out", "deadline", "too many requests")
DEFAULT_PREFIX = "sparsecomm"


class FencedError(CommError):
    """A fenced write was refused: the fence key no longer holds this writer's value."""


@dataclass(frozen=True, kw_only=True)
class EtcdAddress:
    """Where an etcd-kept store is: the cluster's client endpoints and the key prefix."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str = DEFAULT_PREFIX

    def __str__(self) -> str:
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        return f"{SCHEME}{hosts}/{self.prefix}"


def parse_etcd(address: str) -> EtcdAddress:
    """Parse ``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]``, or raise ``ValueError``."""
    if not isinstance(address, str) or not address.startswith(SCHEME):
        raise ValueError(f"etcd address: expected '{SCHEME}HOST:PORT[,HOST:PORT...][/PREFIX]', got {address!r}")
    rest = address[len(SCHEME) :]
    hosts, _, prefix = rest.partition("/")
    prefix = prefix.strip("/") or DEFAULT_PREFIX
    endpoints = []
    for part in hosts.split(","):
        split = urlsplit("//" + part.strip())
        try:
            port = split.port
        except ValueError:
            port = None
        if not split.hostname or port is None or not 0 < port < 65536:
            raise ValueError(f"etcd address {address!r}: {part!r} is not HOST:PORT")
        endpoints.append((split.hostname, port))
    if len(set(endpoints)) != len(endpoints):
        raise ValueError(f"etcd address {address!r}: an endpoint is named twice")
    if any(c in prefix for c in "\0 "):
        raise ValueError(f"etcd address {address!r}: bad prefix {prefix!r}")
    return EtcdAddress(endpoints=tuple(endpoints), prefix=prefix)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(Store):
    """A ``torch.distributed.Store`` whose keys live in an etcd v3 cluster.

    Args:
        address: ``etcd://HOST:PORT[,...][/PREFIX]`` or a parsed :class:`EtcdAddress`.
        timeout: How long ``get`` and ``wait`` wait for a key, and how long one
            call may try the endpoints before it raises
            :class:`~bindings.errors.CommTimeoutError`.
    """

    def __init__(self, address: str | EtcdAddress, timeout: timedelta = timedelta(seconds=30)) -> None:
        super().__init__()
        self.address = address if isinstance(address, EtcdAddress) else parse_etcd(address)
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"timeout: must be a positive datetime.timedelta, got {timeout!r}")
        self.set_timeout(timeout)
        try:
            import etcd3gw
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise ImportError("an etcd store needs the etcd3gw package: pip install 'sparsecomm[etcd]'") from exc
        self._exceptions = etcd3gw.exceptions
        request_s = min(timeout.total_seconds(), 2.0)
        self._clients = [
            etcd3gw.Etcd3Client(host=h, port=p, timeout=request_s, api_path="/v3/") for h, p in self.address.endpoints
        ]
        self._current = 0
        self._lock = threading.Lock()  # one request at a time per store (the requests session is not thread-safe)
        self._root = f"/{self.address.prefix}/".encode()
        self._fence: tuple[bytes, bytes] | None = None

    def __repr__(self) -> str:
        return f"EtcdStore({str(self.address)!r})"

    # ------------------------------------------------------------------ transport
    def _limit(self) -> float:
        """The store's timeout in seconds (``set_timeout`` changes it)."""
        return float(self.timeout.total_seconds())  # type: ignore[attr-defined]

    def _post(self, path: str, payload: JsonObject) -> JsonObject:
        """One request, tried on each endpoint in turn (from the last one that answered) until the deadline."""
        deadline = time.monotonic() + self._limit()
        errors: list[str] = []
        with self._lock:
            while True:
                client = self._clients[self._current]
                try:
                    return dict(client.post(client.get_url(path), json=payload))
                except (self._exceptions.ConnectionFailedError, self._exceptions.ConnectionTimeoutError) as exc:
                    errors.append(f"{client.host}:{client.port}: {type(exc).__name__}")
                except self._exceptions.Etcd3Exception as exc:
                    text = str(getattr(exc, "detail_text", "") or exc)
                    if not any(w in text.lower() for w in _TRANSIENT):
                        raise CommError(f"etcd {client.host}:{client.port}: {path}: {text[:300]}") from exc
                    errors.append(f"{client.host}:{client.port}: {text[:100]}")
                self._current = (self._current + 1) % len(self._clients)
                if time.monotonic() > deadline:
                    raise CommTimeoutError(f"etcd store {self.address}: no endpoint answered {path}: {errors[-3:]}")
                if self._current == 0:
                    time.sleep(0.05)

    def _key(self, key: str) -> bytes:
        return self._root + key.encode()

    def _range(self, key: str, **extra: Any) -> JsonObject:
        return {"key": _b64(self._key(key)), **extra}

    def _put(self, key: str, value: bytes, lease: int | None = None) -> JsonObject:
        put: JsonObject = {"key": _b64(self._key(key)), "value": _b64(value)}
        if lease is not None:
            put["lease"] = lease
        return {"request_put": put}

    def _txn(self, compare: list[JsonObject], success: list[JsonObject], failure: list[JsonObject]) -> JsonObject:
        """A transaction; with a fence set, it goes through only while the fence holds (else :class:`FencedError`)."""
        if self._fence is not None and any("request_range" not in op for op in success):
            fkey, fvalue = self._fence
            fence = {"key": _b64(fkey), "result": "EQUAL", "target": "VALUE", "value": _b64(fvalue)}
            result = self._post(
                "/kv/txn",
                {
                    "compare": [fence],
                    "success": [{"request_txn": {"compare": compare, "success": success, "failure": failure}}],
                    "failure": [],
                },
            )
            if not result.get("succeeded", False):
                raise FencedError(f"etcd store {self.address}: {fkey.decode()!r} no longer holds this writer's lease")
            return dict(result["responses"][0]["response_txn"])
        return self._post("/kv/txn", {"compare": compare, "success": success, "failure": failure})

    @staticmethod
    def _kvs(response: JsonObject) -> list[JsonObject]:
        return list(response.get("kvs", []))

    def _read(self, key: str) -> tuple[bytes, int] | None:
        """``(value, mod_revision)`` of ``key``, or ``None`` if it is absent."""
        kvs = self._kvs(self._post("/kv/range", self._range(key)))
        if not kvs:
            return None
        return _unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"])

    # ------------------------------------------------------------------ Store
    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        self._txn([], [self._put(key, _bytes(value))], [])

    def get(self, key: str) -> bytes:  # type: ignore[override]
        """The value of ``key``, waiting up to the store's timeout for it to be set."""
        deadline = time.monotonic() + self._limit()
        pause = 0.001
        while True:
            found = self._read(key)
            if found is not None:
                return found[0]
            if time.monotonic() > deadline:
                raise DistStoreError(f"etcd store {self.address}: key {key!r} not set within {self._limit():g} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def add(self, key: str, value: int) -> int:  # type: ignore[override]
        """Add ``value`` to the integer at ``key`` (absent: 0) atomically; the new value."""
        while True:
            found = self._read(key)
            current = 0 if found is None else int(found[0])
            new = current + int(value)
            if found is None:
                cond = {"key": _b64(self._key(key)), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
            else:
                cond = {"key": _b64(self._key(key)), "result": "EQUAL", "target": "MOD", "mod_revision": str(found[1])}
            if self._txn([cond], [self._put(key, str(new).encode())], []).get("succeeded", False):
                return new

    def check(self, keys: Sequence[str]) -> bool:  # type: ignore[override]
        """Whether every key in ``keys`` is set."""
        return all(v is not None for v in self._multi_read(keys))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        """Wait until every key in ``keys`` is set (up to ``timeout``, default the store's)."""
        limit = timeout.total_seconds() if timeout is not None else self._limit()
        deadline = time.monotonic() + limit
        pause = 0.001
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise DistStoreError(f"etcd store {self.address}: keys {list(keys)[:4]} not set within {limit:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:  # type: ignore[override]
        """Set ``desired`` where ``key`` holds ``expected`` (absent: ``""``); the value held now (as ``TCPStore``)."""
        want, new = _bytes(expected), _bytes(desired)
        k = _b64(self._key(key))
        if want:
            cond = {"key": k, "result": "EQUAL", "target": "VALUE", "value": _b64(want)}
        else:
            cond = {"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
        result = self._txn([cond], [self._put(key, new)], [{"request_range": self._range(key)}])
        if result.get("succeeded", False):
            return new
        kvs = self._kvs(result["responses"][0].get("response_range", {}))
        return _unb64(kvs[0].get("value", "")) if kvs else want

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        result = self._txn([], [{"request_delete_range": self._range(key)}], [])
        return int(result["responses"][0].get("response_delete_range", {}).get("deleted", 0)) > 0

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:  # type: ignore[override]
        """The values of ``keys`` in one request; raises if one is absent."""
        values = self._multi_read(keys)
        missing = [k for k, v in zip(keys, values, strict=True) if v is None]
        if missing:
            raise DistStoreError(f"etcd store {self.address}: keys not set: {missing[:4]}")
        return [v for v in values if v is not None]

    def _multi_read(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        ops = [{"request_range": self._range(k)} for k in keys]
        result = self._post("/kv/txn", {"compare": [], "success": ops, "failure": []})
        out: list[bytes | None] = []
        for resp in result.get("responses", []):
            kvs = self._kvs(resp.get("response_range", {}))
            out.append(_unb64(kvs[0].get("value", "")) if kvs else None)
        return out

    def num_keys(self) -> int:  # type: ignore[override]
        end = self._root[:-1] + bytes([self._root[-1] + 1])
        result = self._post("/kv/range", {"key": _b64(self._root), "range_end": _b64(end), "count_only": True})
        return int(result.get("count", 0))

    def clone(self) -> EtcdStore:  # type: ignore[override]
        """A store on its own connections with the same address, timeout and fence (gloo takes one per group)."""
        twin = EtcdStore(self.address, timedelta(seconds=self._limit()))
        twin._fence = self._fence
        return twin

    # ------------------------------------------------------------------ leases and fence
    def grant(self, ttl: timedelta) -> int:
        """A new lease of ``ttl`` (whole seconds, at least 1); its id."""
        seconds = max(1, round(ttl.total_seconds()))
        return int(self._post("/lease/grant", {"TTL": seconds, "ID": 0})["ID"])

    def refresh(self, lease: int) -> bool:
        """Keep ``lease`` alive for another TTL; ``False`` if it expired already."""
        result = self._post("/lease/keepalive", {"ID": lease})
        return int(result.get("result", {}).get("TTL", 0)) > 0

    def revoke(self, lease: int) -> None:
        """End ``lease`` now (its keys go with it)."""
        self._post("/kv/lease/revoke", {"ID": lease})

    def create_leased(self, key: str, value: str | bytes, lease: int) -> bool:
        """Set ``key`` bound to ``lease`` only if it is absent; whether it was."""
        cond = {"key": _b64(self._key(key)), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
        payload = {"compare": [cond], "success": [self._put(key, _bytes(value), lease)], "failure": []}
        return bool(self._post("/kv/txn", payload).get("succeeded", False))

    def fence(self, key: str | None, value: str | bytes = b"") -> None:
        """From now on, write only while ``key`` holds ``value`` (``None``: no fence)."""
        self._fence = None if key is None else (self._key(key), _bytes(value))
