"""What a link between two hosts delivers: a bulk TCP transfer and a dense gloo all_reduce, measured.

A rate set on a link (``Hosts(n, link_rate="1gbit")``, a token bucket on both
directions of every host's link) is a promise of the kernel's; a benchmark
that reports time to a loss over a "1 Gbit/s link" prints what the link
actually carried beside it. :func:`measure_link` runs both probes between two
hosts of a :class:`~optim.testing.hosts.Hosts`; :func:`run_link_bench`
does it for several rates (``sparsecomm bench link``).

Each probe is a real process in its host, started as ``python -m
optim.apps.benchmarks.links recv|send|allreduce ...``; it prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bindings.json_object import JsonObject
from bindings.validate import check_float, check_int
from optim.apps.paths import pythonpath_env
from optim.testing.hosts import HostProcess, Hosts, parse_rate, unavailable, wait_for

__all__ = ["LinkBenchConfig", "measure_link", "run_link_bench", "main"]

_CHUNK = 1 << 20
_MB = 1 << 20


def _recv(host: str, port: int) -> JsonObject:
    """Accept one connection, read to EOF; bytes and seconds from the first byte to EOF."""
    with socket.create_server((host, port)) as server:
        server.settimeout(60)
        print(json.dumps({"listening": port}), flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(120)
            buf = bytearray(_CHUNK)
            first = conn.recv_into(buf)
            t0, total = time.perf_counter(), 0
            while True:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                total += n
            seconds = time.perf_counter() - t0
    return {"bytes": total, "seconds": seconds, "first_bytes": first}


def _send(host: str, port: int, nbytes: int) -> JsonObject:
    """Connect (retrying for 30 s) and send ``nbytes``."""
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    with conn:
        conn.settimeout(120)
        chunk, left = bytes(_CHUNK), nbytes
        while left > 0:
            conn.sendall(chunk[: min(left, _CHUNK)])
            left -= _CHUNK
        conn.shutdown(socket.SHUT_WR)
    return {"sent": nbytes}


def _allreduce(nbytes: int, iters: int) -> JsonObject:
    """One rank of a dense gloo all_reduce through the drop-in API (torchrun environment): seconds per all_reduce
    of ``nbytes``."""
    import torch

    import sparsecomm.distributed as dist

    dist.init_process_group("gloo")
    try:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        dist.all_reduce(x)  # warm-up: connections made, buffers touched
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        world = dist.get_world_size()
    finally:
        dist.destroy_process_group()
    return {"seconds": sorted(times)[len(times) // 2], "world_size": world}


@dataclass(frozen=True, kw_only=True)
class LinkBenchConfig:
    """What :func:`run_link_bench` measures.

    Args:
        link_rates: Rates to set (``"100mbit"``, ``"1gbit"``, ``"none"`` for an unshaped link).
        tcp_seconds: About how long the TCP transfer lasts at the set rate (more: a steadier number).
        allreduce_bytes: Size of the dense all_reduce (nccl-tests' bytes: the tensor's size).
        iters: Timed all_reduces (the median is reported).
    """

    link_rates: tuple[str, ...] = ("100mbit", "1gbit", "none")
    tcp_seconds: float = 2.0
    allreduce_bytes: int = 64 * _MB
    iters: int = 3

    def __post_init__(self) -> None:
        if not self.link_rates or not isinstance(self.link_rates, tuple):
            raise ValueError(f"link_rates: expected a non-empty tuple, got {self.link_rates!r}")
        for rate in self.link_rates:
            parse_rate(rate)
        check_float("tcp_seconds", self.tcp_seconds, low=0.1, high=60.0)
        if check_int("allreduce_bytes", self.allreduce_bytes, low=4, high=1 << 30) % 4:
            raise ValueError(f"Invalid allreduce_bytes: {self.allreduce_bytes!r} (must be a multiple of 4)")
        check_int("iters", self.iters, low=1, high=100)


def _probe(hosts: Hosts, host: int, args: Sequence[str], out: Path, env: dict[str, str] | None = None) -> HostProcess:
    argv = [sys.executable, "-m", "optim.apps.benchmarks.links", *args]
    return hosts.run(host, argv, env={**pythonpath_env(), **(env or {})}, output=str(out))


def _result(proc: HostProcess, out: Path, timeout: float) -> JsonObject:
    code = proc.wait(timeout=timeout)
    lines = [ln for ln in out.read_text().splitlines() if ln.startswith("{")] if out.exists() else []
    if code != 0 or not lines:
        raise RuntimeError(f"link probe failed (exit {code}): {out.read_text()[-2000:] if out.exists() else ''}")
    result: JsonObject = json.loads(lines[-1])
    return result


def measure_link(
    hosts: Hosts, workdir: Path, *, a: int = 0, b: int = 1, tcp_bytes: int, allreduce_bytes: int, iters: int = 3
) -> JsonObject:
    """Measure the link between hosts ``a`` and ``b``: a TCP transfer of ``tcp_bytes`` from ``a`` to ``b`` and a
    dense gloo all_reduce of ``allreduce_bytes`` between them (one rank in each).

    Returns:
        ``tcp_gbps`` (payload Gbit/s seen by the receiver), ``allreduce_s`` (median seconds per all_reduce),
        ``allreduce_busbw_gbps`` (nccl-tests' bus bandwidth: 2(n-1)/n bytes per second, as Gbit/s) and the
        set rate (``set_gbps``, ``None``: unshaped).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port = 29600
    recv_out, send_out = workdir / "tcp-recv.out", workdir / "tcp-send.out"
    receiver = _probe(hosts, b, ["recv", hosts.address(b), str(port)], recv_out)
    wait_for(lambda: recv_out.exists() and "listening" in recv_out.read_text(), 60, "the TCP receiver", 0.01)
    sender = _probe(hosts, a, ["send", hosts.address(b), str(port), str(tcp_bytes)], send_out)
    _result(sender, send_out, 300)
    tcp = _result(receiver, recv_out, 60)
    env = {"MASTER_ADDR": hosts.address(a), "MASTER_PORT": str(port + 1), "WORLD_SIZE": "2"}
    ranks = []
    for rank, host in enumerate((a, b)):
        more = {**env, "RANK": str(rank), "LOCAL_RANK": "0", "GLOO_SOCKET_IFNAME": hosts.interface(host)}
        out = workdir / f"allreduce-{rank}.out"
        ranks.append((_probe(hosts, host, ["allreduce", str(allreduce_bytes), str(iters)], out, more), out))
    reduced = [_result(p, out, 600) for p, out in ranks]
    seconds = max(r["seconds"] for r in reduced)
    rate = hosts.link_rate
    return {
        "set_gbps": None if rate is None else rate / 1e9,
        "tcp_bytes": tcp["bytes"],
        "tcp_s": tcp["seconds"],
        "tcp_gbps": tcp["bytes"] * 8 / tcp["seconds"] / 1e9,
        "allreduce_bytes": allreduce_bytes,
        "allreduce_s": seconds,
        "allreduce_busbw_gbps": allreduce_bytes * 8 / seconds / 1e9,  # 2(n-1)/n = 1 for two ranks
    }


def tcp_bytes_for(rate: int | None, seconds: float) -> int:
    """Bytes a transfer of about ``seconds`` at ``rate`` bit/s carries (unshaped: 512 MiB), at least 4 MiB."""
    if rate is None:
        return 512 * _MB
    return max(4 * _MB, int(rate / 8 * seconds) // _MB * _MB)


def run_link_bench(
    config: LinkBenchConfig, workdir: Path, on_row: Callable[[JsonObject], None] | None = None
) -> JsonObject:
    """For each rate of ``config``: two fresh hosts with that rate, :func:`measure_link` between them.

    Raises:
        RuntimeError: Network namespaces cannot be made here (not root, no ``ip``), or a probe failed.
    """
    why = unavailable(shaped=True)
    if why is not None:
        raise RuntimeError(f"shaped links need network namespaces: {why}")
    rows = []
    for i, text in enumerate(config.link_rates):
        rate = parse_rate(text)
        with Hosts(2, link_rate=text) as hosts:
            row = measure_link(
                hosts,
                workdir / f"{i}-{text}",
                tcp_bytes=tcp_bytes_for(rate, config.tcp_seconds),
                allreduce_bytes=config.allreduce_bytes,
                iters=config.iters,
            )
        row = {"link_rate": text, **row}
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return {"bench": "link", "config": config.__dict__, "rows": rows, "cpus": os.cpu_count()}


def main(argv: Sequence[str] | None = None) -> int:
    """The probes: ``recv HOST PORT``, ``send HOST PORT BYTES``, ``allreduce BYTES ITERS``."""
    parser = argparse.ArgumentParser(prog="python -m optim.apps.benchmarks.links")
    sub = parser.add_subparsers(dest="probe", required=True)
    recv = sub.add_parser("recv")
    recv.add_argument("host")
    recv.add_argument("port", type=int)
    send = sub.add_parser("send")
    send.add_argument("host")
    send.add_argument("port", type=int)
    send.add_argument("nbytes", type=int)
    red = sub.add_parser("allreduce")
    red.add_argument("nbytes", type=int)
    red.add_argument("iters", type=int)
    args = parser.parse_args(argv)
    if args.probe == "recv":
        result = _recv(args.host, args.port)
    elif args.probe == "send":
        result = _send(args.host, args.port, args.nbytes)
    else:
        result = _allreduce(args.nbytes, args.iters)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
