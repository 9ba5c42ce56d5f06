"""Who may speak on a job's control plane: the job secret and the signed store records.

The store (torch's ``TCPStore``) accepts any client that reaches its port and
lets it read, list and write every key. A job with a :class:`JobSecret` keeps
its control plane to its members anyway: every record a member or the
coordinator writes carries an HMAC-SHA256 tag over the key and the value
(:class:`ControlStore`), and every record read is checked before it is used.
A process without the secret, or with another job's, cannot register, beat a
heartbeat, vote, publish a view or abort an epoch: what it writes is rejected
(and logged) by whoever reads it.

The secret travels only through the environment (``SPARSECOMM_JOB_SECRET``)
or a file readable by its owner alone (``SPARSECOMM_JOB_SECRET_FILE``, mode
0600), never on a command line. What this does not give: secrecy of the
records (the link is not encrypted) and protection of the data-plane
rendezvous keys, which torch's process groups write unsigned; an intruder that
can reach the port can still delete or overwrite keys, which members then treat
as silence (a denial of service, never a forged decision).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "MAX_RECORD_BYTES",
    "ControlStore",
    "JobSecret",
    "RecordError",
    "is_loopback",
]

logger = logging.getLogger(__name__)

#: The job secret itself (at least 16 characters).
ENV_SECRET = "SPARSECOMM_JOB_SECRET"
#: A file holding the job secret, readable by its owner only.
ENV_SECRET_FILE = "SPARSECOMM_JOB_SECRET_FILE"
#: Records larger than this are rejected unread (a view of thousands of members fits easily).
MAX_RECORD_BYTES = 1 << 20

_TAG = b"h1:"  # the signed-record format: b"h1:" + 32 hex digits of HMAC-SHA256 + b":" + value
_TAG_HEX = 32
_MIN_SECRET = 16


class RecordError(ValueError):
    """A record read from the store is not one the job wrote (unsigned, forged, garbled or oversized)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``localhost`` too); a name or other address is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class JobSecret:
    """The key that makes a process a member of one job.

    Args:
        key: The secret (at least 16 bytes; :meth:`generate` makes 32 random ones).

    Raises:
        TypeError: ``key`` is not bytes.
        ValueError: ``key`` is too short.
    """

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes):
            raise TypeError(f"key: expected bytes, got {type(key).__name__}")
        if len(key) < _MIN_SECRET:
            raise ValueError(f"job secret: must be at least {_MIN_SECRET} bytes, got {len(key)}")
        self._key = key

    def __repr__(self) -> str:
        return "JobSecret(<hidden>)"

    @classmethod
    def generate(cls) -> JobSecret:
        """A fresh random secret (32 bytes, written as 64 hex digits)."""
        return cls(secrets.token_hex(32).encode())

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> JobSecret:
        """Read a secret file; it must be a regular file that only its owner can read or write.

        Raises:
            ValueError: Missing, not a regular file, open to others, or too short.
        """
        p = Path(path)
        try:
            st = p.stat()
        except OSError as exc:
            raise ValueError(f"job secret file {p}: {exc.strerror or exc}") from exc
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"job secret file {p}: not a regular file")
        if st.st_mode & 0o077:
            mode = stat.S_IMODE(st.st_mode)
            raise ValueError(f"job secret file {p}: mode {mode:04o} lets others read it (chmod 600 {p})")
        return cls(p.read_bytes().strip())

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobSecret | None:
        """The secret the environment names (``SPARSECOMM_JOB_SECRET`` or ``..._FILE``), or ``None``.

        Raises:
            ValueError: Both variables are set, or the one set is unusable.
        """
        env = os.environ if env is None else env
        text, path = env.get(ENV_SECRET), env.get(ENV_SECRET_FILE)
        if text and path:
            raise ValueError(f"set one of {ENV_SECRET} and {ENV_SECRET_FILE}, not both")
        if path:
            return cls.from_file(path)
        return cls(text.encode()) if text else None

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the secret to a new file of mode 0600 (an existing file is never overwritten)."""
        p = Path(path)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self._key + b"\n")
        return p

    def env(self) -> dict[str, str]:
        """The environment that hands this secret to a child process."""
        return {ENV_SECRET: self._key.decode()}

    def _tag(self, key: str, value: bytes) -> bytes:
        mac = hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256)
        return mac.hexdigest()[:_TAG_HEX].encode()

    def key_name(self, name: str) -> str:
        """``name`` with a suffix only holders of this secret can compute."""
        return f"{name}/{self._tag('name:' + name, b'')[:16].decode()}"

    def sign(self, key: str, value: bytes) -> bytes:
        """The record to store at ``key``: ``value`` with its tag."""
        return _TAG + self._tag(key, value) + b":" + value

    def open(self, key: str, record: bytes) -> bytes:
        """The value of a record read at ``key``, or ``RecordError`` if this secret did not sign it there."""
        head = len(_TAG) + _TAG_HEX
        if not record.startswith(_TAG) or len(record) <= head or record[head : head + 1] != b":":
            raise RecordError(f"{key}: unsigned record")
        value = record[head + 1 :]
        if not hmac.compare_digest(record[len(_TAG) : head], self._tag(key, value)):
            raise RecordError(f"{key}: bad signature (another job's secret, or forged)")
        return value


class _KV(Protocol):
    """The store calls :class:`ControlStore` needs (a ``TCPStore`` or a ``BoundedStore``)."""

    def add(self, key: str, value: int) -> int: ...

    def set(self, key: str, value: str | bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...

    def multi_get(self, keys: list[str]) -> list[bytes]: ...

    def delete_key(self, key: str) -> bool: ...


class ControlStore:
    """The control plane's view of the store: records signed with the job secret and checked on read.

    Without a secret (a loopback job) values pass unchanged, still subject to
    the size limit. Counters (:meth:`add`) cannot be signed: they only number
    records or hint that a record may be ready; nothing is decided on a
    counter alone.

    Args:
        store: The underlying store.
        secret: The job secret (``None``: unsigned records).
    """

    def __init__(self, store: Any, secret: JobSecret | None) -> None:
        if secret is not None and not isinstance(secret, JobSecret):
            raise TypeError(f"secret: expected a JobSecret or None, got {type(secret).__name__}")
        self.raw: _KV = store
        self.secret = secret
        self._warned: set[str] = set()

    @property
    def signed(self) -> bool:
        """Whether records are signed."""
        return self.secret is not None

    def _open(self, key: str, record: bytes) -> bytes:
        if len(record) > MAX_RECORD_BYTES:
            raise RecordError(f"{key}: record of {len(record)} bytes (limit {MAX_RECORD_BYTES})")
        return record if self.secret is None else self.secret.open(key, record)

    def private(self, name: str) -> str:
        """The key for ``name`` that only holders of the secret can compute (``name`` itself without one).

        For keys where the first writer wins (a decision, the next registration):
        an intruder can list the keys written so far, but cannot write one of
        these before its owner does.
        """
        return name if self.secret is None else self.secret.key_name(name)

    def reject(self, key: str, exc: Exception) -> None:
        """Log a record that was not accepted (once per key)."""
        if key not in self._warned and len(self._warned) < 10_000:
            self._warned.add(key)
            logger.warning("rejected store record: %s", exc)

    def add(self, key: str, value: int) -> int:
        """Bump a counter; returns its new value."""
        return int(self.raw.add(key, value))

    def set(self, key: str, value: str | bytes) -> None:
        """Write a record (signed when the job has a secret)."""
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.raw.set(key, data if self.secret is None else self.secret.sign(key, data))

    def get(self, key: str) -> bytes:
        """Read a record that exists; ``RecordError`` when it is not the job's."""
        return self._open(key, bytes(self.raw.get(key)))

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key holds a record of the job (a rejected one counts as absent, and is logged)."""
        names = list(keys)
        if not self.raw.check(names):
            return False
        if self.secret is None:
            return True
        for key in names:
            try:
                self.get(key)
            except RecordError as exc:
                self.reject(key, exc)
                return False
        return True

    def multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Read records that exist; a rejected one reads as ``None`` (and is logged)."""
        out: list[bytes | None] = []
        for key, record in zip(keys, self.raw.multi_get(list(keys)), strict=True):
            try:
                out.append(self._open(key, bytes(record)))
            except RecordError as exc:
                self.reject(key, exc)
                out.append(None)
        return out

    def create(self, key: str, value: str) -> bytes:
        """Write ``key`` only if it does not exist (compare-and-set); returns the value it holds after.

        Raises:
            RecordError: The key holds a record that is not the job's.
        """
        data = value.encode()
        desired = data if self.secret is None else self.secret.sign(key, data)
        return self._open(key, bytes(self.raw.compare_set(key, "", desired)))  # type: ignore[arg-type]

    def unverified(self, key: str) -> bytes:
        """The value at ``key`` with any tag stripped, unchecked: only for saying who was refused in a log."""
        record = bytes(self.raw.get(key))[:MAX_RECORD_BYTES]
        head = len(_TAG) + _TAG_HEX
        return record[head + 1 :] if record.startswith(_TAG) else record

    def close(self) -> None:
        """Close the underlying connection where it can be closed."""
        close = getattr(self.raw, "close", None)
        if callable(close):
            close()
