"""The job secret and the signed store records (a real TCPStore, no processes)."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest

from bindings.store import open_store
from resilient_comm.auth import ENV_SECRET, ENV_SECRET_FILE, ControlStore, JobSecret, RecordError, is_loopback
from resilient_comm.config import CoordinatorConfig
from resilient_comm.inbox import MAX_PENDING, Inbox


def _store() -> object:
    return open_store("127.0.0.1", 0, server=True, timeout=timedelta(seconds=5))


def test_secret_sources_and_their_checks(tmp_path: Path) -> None:
    assert JobSecret.from_env({}) is None
    made = JobSecret.generate()
    assert "hidden" in repr(made) and made.env()[ENV_SECRET] not in repr(made)
    assert JobSecret.from_env(made.env()) is not None
    path = made.write(tmp_path / "s")
    assert (path.stat().st_mode & 0o777) == 0o600
    with pytest.raises(FileExistsError):
        made.write(path)  # never overwritten
    same = JobSecret.from_env({ENV_SECRET_FILE: str(path)})
    assert same is not None and same.sign("k", b"v") == made.sign("k", b"v")
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        JobSecret.from_file(path)
    with pytest.raises(ValueError, match="not both"):
        JobSecret.from_env({ENV_SECRET: "x" * 20, ENV_SECRET_FILE: str(path)})
    with pytest.raises(ValueError, match="at least 16"):
        JobSecret.from_env({ENV_SECRET: "short"})
    with pytest.raises(ValueError, match="job secret file"):
        JobSecret.from_file(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a regular file"):
        JobSecret.from_file(tmp_path)
    with pytest.raises(TypeError):
        JobSecret("a string" * 4)  # type: ignore[arg-type]


def test_records_are_bound_to_secret_key_and_value() -> None:
    a, b = JobSecret.generate(), JobSecret.generate()
    rec = a.sign("view/3", b'{"epoch": 3}')
    assert a.open("view/3", rec) == b'{"epoch": 3}'
    with pytest.raises(RecordError, match="bad signature"):
        b.open("view/3", rec)  # another job's secret
    with pytest.raises(RecordError, match="bad signature"):
        a.open("view/4", rec)  # moved to another key
    with pytest.raises(RecordError, match="bad signature"):
        a.open("view/3", rec[:-1] + b"4")  # value changed
    for junk in (b"", b"3", b"h1:", b"h1:" + b"0" * 32, b"h1:" + b"0" * 32 + b"x3"):
        with pytest.raises(RecordError, match="unsigned"):
            a.open("view/3", junk)


def test_control_store_signs_checks_and_hides_first_writer_keys() -> None:
    raw = _store()
    secret = JobSecret.generate()
    signed, plain, other = ControlStore(raw, secret), ControlStore(raw, None), ControlStore(raw, JobSecret.generate())
    signed.set("k", "1")
    assert signed.get("k") == b"1" and signed.check(["k"])
    with pytest.raises(RecordError):
        other.get("k")
    raw.set("forged", "1")  # type: ignore[attr-defined]
    assert not signed.check(["forged"]) and signed.multi_get(["k", "forged"]) == [b"1", None]
    assert plain.check(["forged"]) and plain.get("forged") == b"1"
    # first writer wins: a decision key nobody without the secret can name in advance
    key = signed.private("decision/0/7")
    assert key != "decision/0/7" and key == signed.private("decision/0/7") and key != other.private("decision/0/7")
    assert plain.private("decision/0/7") == "decision/0/7"
    raw.set("taken", "junk")  # type: ignore[attr-defined]
    with pytest.raises(RecordError):
        signed.create("taken", "1")
    assert signed.create(key, "1") == b"1" and signed.create(key, "0") == b"1"
    raw.set("big", b"x" * (2 << 20))  # type: ignore[attr-defined]
    with pytest.raises(RecordError, match="limit"):
        plain.get("big")


def test_inbox_skips_gaps_and_bounds_a_jump() -> None:
    raw = _store()
    store = ControlStore(raw, None)
    inbox = Inbox(store, "n", lambda i: f"r/{i}", patience=0.2)
    raw.add("n", 3)  # type: ignore[attr-defined]
    raw.set("r/1", "one")  # type: ignore[attr-defined]
    assert inbox.poll() == [(1, b"one")]  # 0 and 2 have no record yet: they do not hold up 1
    raw.set("r/0", "zero")  # type: ignore[attr-defined]
    assert inbox.poll() == [(0, b"zero")]
    time.sleep(0.3)
    assert inbox.poll() == []  # 2 dropped after patience
    raw.set("r/2", "late")  # type: ignore[attr-defined]
    assert inbox.poll() == []
    raw.add("n", 10**9)  # type: ignore[attr-defined]
    n = raw.add("n", 0)  # type: ignore[attr-defined]
    raw.set(f"r/{n - 1}", "newest")  # type: ignore[attr-defined]
    assert inbox.poll() == [(n - 1, b"newest")]
    assert len(inbox._pending) <= MAX_PENDING


def test_binding_beyond_loopback_needs_a_secret() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1") and is_loopback("[::1]")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("node7")
    with pytest.raises(ValueError, match="needs a job secret"):
        CoordinatorConfig(world_size=2, host="0.0.0.0")
    with pytest.raises(TypeError, match="JobSecret"):
        CoordinatorConfig(world_size=2, secret="s" * 32)  # type: ignore[arg-type]
    cfg = CoordinatorConfig(world_size=2, host="0.0.0.0", secret=JobSecret.generate())
    assert "hidden" not in repr(cfg) and "secret" not in repr(cfg)
