"""Bad etcd addresses and store settings are refused before anything connects (no etcd needed)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from bindings.etcd_store import EtcdStore, parse_etcd
from bindings.store import check_address, is_etcd
from resilient_comm.auth import JobSecret
from resilient_comm.config import CoordinatorConfig
from resilient_comm.launcher import LaunchConfig
from resilient_comm.membership import StoreMembership


def test_addresses_parse() -> None:
    a = parse_etcd("etcd://10.0.0.1:2379,[::1]:2380,host-b:1/jobs/x")
    assert a.endpoints == (("10.0.0.1", 2379), ("::1", 2380), ("host-b", 1)) and a.prefix == "jobs/x"
    assert str(a) == "etcd://10.0.0.1:2379,[::1]:2380,host-b:1/jobs/x"
    assert parse_etcd(str(a)) == a
    assert parse_etcd("etcd://h:1").prefix == "sparsecomm" and is_etcd("etcd://h:1") and not is_etcd("h:1")


@pytest.mark.parametrize(
    "bad",
    ["h:1", "etcd://", "etcd://h", "etcd://h:0", "etcd://h:99999", "etcd://h:x", "etcd://h:1,h:1", "etcd://:1", 3],
)
def test_bad_addresses_are_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_etcd(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["etcd://h", "nohost", "h:0", "etcd://h:1,h:1"])
def test_bad_store_addresses_are_refused_before_connecting(bad: str) -> None:
    with pytest.raises(ValueError):
        check_address(bad)
    with pytest.raises(ValueError):
        StoreMembership(bad, "job", timeout=timedelta(seconds=1))


def test_store_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="etcd"):
        CoordinatorConfig(world_size=2, store="zookeeper://h:1")
    with pytest.raises(ValueError):
        CoordinatorConfig(world_size=2, store="etcd://h")
    with pytest.raises(ValueError, match="secret"):
        CoordinatorConfig(world_size=2, store="etcd://10.1.2.3:2379")  # beyond loopback, no secret
    cfg = CoordinatorConfig(world_size=2, store="etcd://10.1.2.3:2379/p", secret=JobSecret.generate(), job="j")
    assert cfg.store_address == "etcd://10.1.2.3:2379/p/j"
    with pytest.raises(ValueError):
        LaunchConfig(nproc=2, store="etcd://h:1,h:1")
    with pytest.raises(ValueError):
        EtcdStore("etcd://127.0.0.1:1", timedelta(0))
