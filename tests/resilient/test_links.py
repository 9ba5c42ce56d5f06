"""Shaped links: a rate set on the hosts' links is the rate a bulk TCP transfer gets (within 15%), and the
dense gloo all_reduce between two hosts cannot beat it; ``sparsecomm bench link`` reports both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from optim.apps.benchmarks.links import LinkBenchConfig, measure_link, tcp_bytes_for
from optim.apps.cli.main import main as cli_main
from optim.testing.hosts import Hosts, parse_rate, unavailable

WHY = unavailable(shaped=True)
needs_hosts = pytest.mark.skipif(WHY is not None, reason=str(WHY))


def test_rates_parse_as_tc_spells_them() -> None:
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1gbit") == 1_000_000_000
    assert parse_rate("2.5gbit") == 2_500_000_000
    assert parse_rate("none") is None and parse_rate(None) is None
    for bad in ("1 gbit", "1Gbps", "fast", "", "0mbit", "500kbit", "200gbit", 1e9):
        with pytest.raises(ValueError, match="link rate"):
            parse_rate(bad)  # type: ignore[arg-type]


def test_bad_settings_raise_before_anything_is_made() -> None:
    with pytest.raises(ValueError, match="link rate"):
        Hosts(2, link_rate="1gbps")
    with pytest.raises(ValueError, match="link rate"):
        LinkBenchConfig(link_rates=("1gbit", "lots"))
    with pytest.raises(ValueError, match="allreduce_bytes"):
        LinkBenchConfig(allreduce_bytes=6)
    with pytest.raises(ValueError, match="iters"):
        LinkBenchConfig(iters=0)
    assert tcp_bytes_for(10**9, 1.0) == 125_000_000 // (1 << 20) * (1 << 20)
    assert tcp_bytes_for(10**6, 1.0) == 4 << 20  # never less than 4 MiB


@needs_hosts
@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("rate", ["100mbit", "1gbit"])
def test_a_shaped_link_delivers_its_rate(rate: str, tmp_path: Path) -> None:
    bits = parse_rate(rate)
    assert bits is not None
    with Hosts(2, link_rate=rate) as hosts:
        # Half a second of all_reduce: the token buckets' 10 ms bursts are 2% of it, not the 30% of a 4 MiB one.
        size = tcp_bytes_for(bits, 0.5)
        got = measure_link(hosts, tmp_path, tcp_bytes=tcp_bytes_for(bits, 1.0), allreduce_bytes=size, iters=1)
    print(f"\n{rate}: TCP {got['tcp_gbps']:.3f} Gbit/s, all_reduce busbw {got['allreduce_busbw_gbps']:.3f} Gbit/s")
    assert got["set_gbps"] == bits / 1e9
    assert abs(got["tcp_gbps"] / got["set_gbps"] - 1) <= 0.15, got
    assert got["allreduce_busbw_gbps"] <= 1.15 * got["set_gbps"], got  # both directions are shaped


@needs_hosts
@pytest.mark.dist
@pytest.mark.timeout(180)
def test_bench_link_cli_writes_the_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "link.json"
    argv = ["bench", "link", "--link-rate", "100mbit,none", "--tcp-seconds", "0.5", "--bytes", str(1 << 20)]
    assert cli_main([*argv, "--iters", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "TCP Gbit/s" in table and "100mbit" in table
    bench = json.loads(out.read_text())
    shaped, unshaped = bench["rows"]
    assert shaped["link_rate"] == "100mbit" and unshaped["set_gbps"] is None
    assert unshaped["tcp_gbps"] > 2 * shaped["tcp_gbps"]  # the shaping, not the machine, held the first back
    assert bench["env"]["torch"]
