"""Time to a target loss over rate-limited links: the train job, one rank per host, per method and link rate.

Every *cell* (a link rate, a method, a seed) is one training run of the train
job's model on :class:`~optim.testing.hosts.Hosts` whose links are shaped
to the rate, one rank in each host (torchrun's environment, gloo over the
hosts' own interfaces), and writes its own result file: a long sweep runs
cell by cell, survives being stopped, and goes on where it left off
(:func:`run_wallclock_bench` skips the cells that have a file). Each rate's
link is measured first (:func:`optim.apps.benchmarks.links.measure_link`), so every
number is printed beside what the link delivered.

:func:`summarize` reads the cell files: per cell the median step time, the
time waiting on the network per step (the optimizer step's collectives, or
the bucket all-reduce), the bytes one rank sent per step, the validation
losses against training time (the steps' own times, evaluation left out),
and the time to reach the *target loss*: dense AdamS's validation loss at
``target_step`` on the same link, data and seed. Ratios are to dense AdamS on
the same link.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bindings.json_object import JsonObject
from bindings.validate import check_int
from optim.apps.benchmarks.links import measure_link, tcp_bytes_for
from optim.apps.paths import pythonpath_env
from optim.testing.hosts import Hosts, kill_all, parse_rate, unavailable

__all__ = ["METHODS", "WallclockConfig", "cell_name", "run_cell", "run_wallclock_bench", "summarize", "main"]

#: Methods: a train-job optimizer, and ``@density`` for the sparse ones. ``adams`` (dense sharded AdamS) is the
#: reference every ratio is to; ``allreduce-adamw`` is what DDP + AdamW does (a bucketed gradient all-reduce),
#: ``ddp-powersgd-adamw`` DDP with PowerSGD (rank 4), ``ddp-sparse-adamw`` DDP with sparsecomm's sparse hook,
#: ``local-adams-overlap`` LocalAdamS with each averaging beside the next step's compute (``overlap=True``).
METHODS = (
    "adams",
    "allreduce-adamw",
    "ddp-powersgd-adamw",
    "ddp-sparse-adamw@0.1",
    "ddp-sparse-adamw@0.01",
    "local-adams@0.1",
    "local-adams@0.01",
    "local-adams-overlap@0.1",
    "local-adams-overlap@0.01",
    "scape@0.1",
    "scape@0.01",
)
REFERENCE = "adams"
_PORT = 29700


@dataclass(frozen=True, kw_only=True)
class WallclockConfig:
    """A sweep: every method at every link rate and seed, the same model, data and schedule.

    Args:
        methods: Entries of :data:`METHODS` (``adams`` must be one: the reference).
        link_rates: ``tc`` rates (``"100mbit"``, ``"1gbit"``; ``"none"``: unshaped).
        seeds: Seeds of the initialisation and the data order.
        hosts: Hosts, one rank each.
        steps: Training steps per cell.
        target_step: The target loss is dense AdamS's validation loss at this step.
        eval_interval: Steps between validation passes (must divide ``target_step``).
        d_model, n_layers, n_heads, batch, context: The train job's GPT and batch per rank.
        lr, warmup_steps: The schedule (the same for every method).
    """

    methods: tuple[str, ...] = METHODS
    link_rates: tuple[str, ...] = ("100mbit", "1gbit", "none")
    seeds: tuple[int, ...] = (0,)
    hosts: int = 2
    steps: int = 400
    target_step: int = 400
    eval_interval: int = 25
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    batch: int = 8
    context: int = 64
    lr: float = 3e-3
    warmup_steps: int = 30

    def __post_init__(self) -> None:
        for name in ("methods", "link_rates", "seeds"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not value or len(set(value)) != len(value):
                raise ValueError(f"{name}: expected a non-empty tuple without repeats, got {value!r}")
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ValueError(f"methods: unknown {bad}; choose from {', '.join(METHODS)}")
        if REFERENCE not in self.methods:
            raise ValueError(f"methods: {REFERENCE!r} (dense AdamS, the reference) must be one of them")
        for rate in self.link_rates:
            parse_rate(rate)
        for name in ("hosts", "steps", "target_step", "eval_interval", "d_model", "n_layers", "n_heads", "batch"):
            check_int(name, getattr(self, name), low=1)
        if not 2 <= self.hosts <= 8:
            raise ValueError(f"hosts: expected 2..8, got {self.hosts}")
        if self.target_step > self.steps or self.target_step % self.eval_interval:
            raise ValueError(
                f"target_step: expected a multiple of eval_interval ({self.eval_interval}) <= steps ({self.steps}), "
                f"got {self.target_step}"
            )

    def train_config(self, method: str, seed: int) -> JsonObject:
        """The train job's settings of one cell (``TrainConfig`` keywords)."""
        optimizer, _, density = method.partition("@")
        settings: JsonObject = {
            "optimizer": optimizer,
            "steps": self.steps,
            "eval_interval": self.eval_interval,
            "d_model": self.d_model,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "batch": self.batch,
            "context": self.context,
            "lr": self.lr,
            "warmup_steps": self.warmup_steps,
            "seed": seed,
            "nproc": self.hosts,
            "threads": 1,
            "job_timeout_s": 6 * 3600.0,
            "comm_timeout_s": 600.0,
        }
        if density:
            settings["density"] = float(density)
        if optimizer == "local-adams-overlap":
            settings.update(optimizer="local-adams", local_overlap=True)
        return settings


def cell_name(rate: str, method: str, seed: int) -> str:
    """The file stem of a cell's result."""
    return f"{rate}-{method.replace('@', '-d')}-s{seed}"


def run_cell(config: WallclockConfig, rate: str, method: str, seed: int, out: Path) -> JsonObject:
    """Train one cell on fresh shaped hosts; write and return rank 0's result (plus the cell's identity)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f".{out.stem}"
    work.mkdir(exist_ok=True)
    settings = config.train_config(method, seed)
    with Hosts(config.hosts, link_rate=rate) as hosts:
        env = {
            **pythonpath_env(),
            "MASTER_ADDR": hosts.address(0),
            "MASTER_PORT": str(_PORT),
            "WORLD_SIZE": str(config.hosts),
        }
        procs = []
        for rank in range(config.hosts):
            more = {"RANK": str(rank), "LOCAL_RANK": "0", "GLOO_SOCKET_IFNAME": hosts.interface(rank)}
            argv = [sys.executable, "-m", "optim.apps.benchmarks.wallclock", "rank", json.dumps(settings)]
            argv.append(str(work / f"rank{rank}.json"))
            procs.append(hosts.run(rank, argv, env={**env, **more}, output=str(work / f"rank{rank}.log")))
        t0 = time.perf_counter()
        try:
            codes = [p.wait(timeout=settings["job_timeout_s"]) for p in procs]
        finally:
            kill_all(procs)
        if any(codes):
            log = (work / f"rank{codes.index(next(c for c in codes if c))}.log").read_text()[-3000:]
            raise RuntimeError(f"cell {out.stem}: ranks exited {codes}:\n{log}")
    result = json.loads((work / "rank0.json").read_text())
    cell = {"link_rate": rate, "method": method, "seed": seed, "settings": settings}
    cell.update(result=result, wall_s=time.perf_counter() - t0)
    out.write_text(json.dumps(cell) + "\n")
    return cell


def run_wallclock_bench(
    config: WallclockConfig, out_dir: Path, on_cell: Callable[[str, JsonObject | None], None] | None = None
) -> JsonObject:
    """Run every cell of ``config`` that has no result file in ``out_dir`` yet (each rate's link measured once,
    to ``out_dir/link-RATE.json``); return :func:`summarize` of the directory.

    Raises:
        RuntimeError: Network namespaces cannot be made here, or a cell failed (the cells before it are kept).
    """
    why = unavailable(shaped=True)
    if why is not None:
        raise RuntimeError(f"shaped links need network namespaces: {why}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1) + "\n")
    for rate in config.link_rates:
        link_file = out_dir / f"link-{rate}.json"
        if not link_file.exists():
            bits = parse_rate(rate)
            with Hosts(2, link_rate=rate) as hosts:
                link = measure_link(
                    hosts, out_dir / f".link-{rate}", tcp_bytes=tcp_bytes_for(bits, 2.0), allreduce_bytes=64 << 20
                )
            link_file.write_text(json.dumps({"link_rate": rate, **link}) + "\n")
        for seed in config.seeds:
            for method in config.methods:
                path = out_dir / f"{cell_name(rate, method, seed)}.json"
                if path.exists():
                    if on_cell is not None:
                        on_cell(path.stem, None)
                    continue
                cell = run_cell(config, rate, method, seed, path)
                if on_cell is not None:
                    on_cell(path.stem, cell)
    return summarize(out_dir)


def _time_curve(result: JsonObject) -> list[tuple[int, float, float]]:
    """``(step, training seconds so far, validation loss)`` at every evaluation."""
    elapsed, t = {0: 0.0}, 0.0
    for rec in result["steps"]:
        t += rec["step_time_s"]
        elapsed[rec["step"]] = t
    return [(e["step"], elapsed[e["step"]], e["val_loss"]) for e in result["evals"]]


def summarize(out_dir: Path) -> JsonObject:
    """Read the cell files of ``out_dir``: one row per cell, with time to the target loss and ratios to dense."""
    config = json.loads((out_dir / "config.json").read_text())
    links = {}
    for path in sorted(out_dir.glob("link-*.json")):
        link = json.loads(path.read_text())
        links[link["link_rate"]] = link
    cells = {}
    for path in sorted(out_dir.glob("*.json")):
        if path.name in ("config.json",) or path.name.startswith("link-"):
            continue
        cell = json.loads(path.read_text())
        cells[(cell["link_rate"], cell["method"], cell["seed"])] = cell
    rows = []
    for (rate, method, seed), cell in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        result = cell["result"]
        steps = result["steps"][min(10, len(result["steps"]) - 1) :]  # the first steps warm up (and are dense)
        curve = _time_curve(result)
        ref = cells.get((rate, REFERENCE, seed))
        target = None
        if ref is not None:
            target = next((loss for step, _, loss in _time_curve(ref["result"]) if step == config["target_step"]), None)
        reached = None if target is None else next((t for _, t, loss in curve if loss <= target), None)
        rows.append(
            {
                "link_rate": rate,
                "method": method,
                "seed": seed,
                "step_s": statistics.median(r["step_time_s"] for r in steps),
                # DDP's hooks communicate inside the backward pass: no wait of their own to time
                "wait_s": None
                if any(r["comm_time_s"] is None for r in steps)
                else statistics.median(r["comm_time_s"] for r in steps),
                "bytes_per_step": statistics.median(r["bytes_sent"] for r in steps),
                "final_val_loss": curve[-1][2],
                "train_s": curve[-1][1],
                "target_loss": target,
                "time_to_target_s": reached,
                "curve": curve,
                "link_tcp_gbps": links.get(rate, {}).get("tcp_gbps"),
                "num_parameters": result["num_parameters"],
            }
        )
    for row in rows:
        ref_row = next(
            (r for r in rows if (r["link_rate"], r["method"], r["seed"]) == (row["link_rate"], REFERENCE, row["seed"])),
            None,
        )
        ref_t = None if ref_row is None else ref_row["time_to_target_s"]
        t = row["time_to_target_s"]
        row["speedup_vs_dense"] = None if ref_t is None or t is None else ref_t / t
        row["step_speedup_vs_dense"] = None if ref_row is None else ref_row["step_s"] / row["step_s"]
    bench = {"bench": "wallclock", "config": config, "links": links, "rows": rows, "cpus": os.cpu_count()}
    return {**bench, "wins": wins_by_rate(rows)}


def _bits(rate: str) -> float:
    bits = parse_rate(rate)
    return math.inf if bits is None else float(bits)


def wins_by_rate(rows: list[JsonObject]) -> dict[str, JsonObject]:
    """Per method: the link rates it was measured at (slowest first), the median speed-up to dense AdamS's time
    to the target at each (over seeds; ``None`` where either never reached it), and ``wins_up_to``: the fastest
    of those rates at which it reached the target sooner than dense AdamS (``None``: at none of them)."""
    out: dict[str, JsonObject] = {}
    for method in sorted({r["method"] for r in rows}):
        speedups: dict[str, float | None] = {}
        for rate in sorted({r["link_rate"] for r in rows if r["method"] == method}, key=_bits):
            got = [r["speedup_vs_dense"] for r in rows if (r["method"], r["link_rate"]) == (method, rate)]
            speedups[rate] = None if None in got else statistics.median(got)
        won = [rate for rate, x in speedups.items() if x is not None and x > 1.0]
        out[method] = {"speedup_by_rate": speedups, "wins_up_to": max(won, key=_bits) if won else None}
    return out


def _rank(settings_json: str, out: str) -> int:
    """One rank of a cell, launched with torchrun's environment: train, rank 0 writes its result to ``out``."""
    from optim.apps.train_job.job_config import TrainConfig
    from optim.apps.train_job.train import run_training

    settings = json.loads(settings_json)
    config = TrainConfig(**settings)
    result = run_training(config)
    if result is not None:
        Path(out).write_text(json.dumps(result.to_json()) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m optim.apps.benchmarks.wallclock rank SETTINGS_JSON OUT``: one rank of a cell."""
    parser = argparse.ArgumentParser(prog="python -m optim.apps.benchmarks.wallclock")
    sub = parser.add_subparsers(dest="cmd", required=True)
    rank = sub.add_parser("rank")
    rank.add_argument("settings")
    rank.add_argument("out")
    args = parser.parse_args(argv)
    return _rank(args.settings, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
