"""The ``sparsecomm train`` job end to end: 2 spawned gloo ranks, a tiny model, ~20 steps."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from bindings.spawn import LocalRunError
from bindings.stats import ring_bytes
from optim.apps.cli.main import build_parser
from optim.apps.cli.options import model_settings
from optim.apps.cli.report import build_report, write_report
from optim.apps.train_job.job_config import TrainConfig, lr_at
from optim.apps.train_job.train import OnStep, launch_local, run_training
from tests.dist.harness import clear_launcher_env

pytestmark = pytest.mark.dist

TINY = {
    "nproc": 2,
    "steps": 20,
    "d_model": 32,
    "n_layers": 1,
    "n_heads": 2,
    "context": 32,
    "batch": 8,
    "lr": 1e-2,
    "warmup_steps": 2,
    "eval_interval": 10,
    "eval_batches": 2,
    "max_corpus_bytes": 300_000,
    "comm_timeout_s": 60.0,
    "job_timeout_s": 90.0,
}


@pytest.mark.timeout(150)
def test_train_job_end_to_end_allreduce_adamw(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clear_launcher_env(monkeypatch)
    config = TrainConfig(**TINY, optimizer="allreduce-adamw", out=str(tmp_path / "run"))
    result = run_training(config)
    assert result is not None and result.launcher == "local"
    report = build_report(config, result)
    json_path, png_path = write_report(report, config.out)

    data = json.loads(json_path.read_text())
    for key in (
        "config",
        "world_size",
        "backend",
        "versions",
        "wall_time_s",
        "steps",
        "evals",
        "wire_bytes",
        "final",
        "model",
        "corpus",
        "comm_stats",
    ):
        assert key in data, key
    assert data["world_size"] == 2 and data["backend"] == "gloo"
    assert data["config"]["steps"] == 20 and data["config"]["nproc"] == 2
    assert {"python", "torch", "sparsecomm"} <= set(data["versions"])
    assert data["wall_time_s"] > 0 and data["corpus"]["num_bytes"] == 300_000
    steps = data["steps"]
    assert [s["step"] for s in steps] == list(range(1, 21))
    for s in steps:
        assert s["step_time_s"] > 0 and s["train_loss"] > 0
    assert [e["step"] for e in data["evals"]] == [0, 10, 20]

    # One all-reduce of the flat bucket (all grads + the loss) per step.
    bucket = data["wire_bytes"]["bucket_bytes"]
    assert bucket == 4 * (data["model"]["num_parameters"] + 1)
    sent, received = ring_bytes("all_reduce", bucket, 2)
    assert all(s["bytes_sent"] == sent and s["bytes_received"] == received for s in steps)
    assert data["wire_bytes"]["per_step"] == sent
    assert data["wire_bytes"]["total"] == 20 * sent
    assert data["comm_stats"]["all_reduce"]["calls"] >= 20
    assert data["optimizer"]["name"] == "allreduce-adamw"
    assert data["wire_bytes"]["by_op"] == {"all_reduce": {"per_step": sent, "total": 20 * sent}}

    # The loss fell: train (first vs last steps) and validation (start vs end).
    losses = [s["train_loss"] for s in steps]
    assert sum(losses[-5:]) / 5 < sum(losses[:3]) / 3 - 0.5, losses
    assert data["final"]["val_loss"] < data["final"]["initial_val_loss"] - 0.5, data["evals"]

    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png_path.stat().st_size > 5_000


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("optimizer", "extra", "cls", "ops"),
    [
        ("adamw", {}, "optim.ShardedAdamW", {"reduce_scatter", "all_gather", "grad_clip", "loss"}),
        ("adams", {}, "optim.ShardedAdamS", {"reduce_scatter", "all_gather", "grad_clip", "loss"}),
        (
            "scape",
            {"density": 0.1, "sparse_warmup_steps": 5, "mask_delay": 1},
            "optim.SCAPE",
            {"sparse_reduce_scatter", "sparse_all_gather", "mask_sync", "grad_clip", "loss"},
        ),
    ],
)
def test_train_job_sharded_optimizers(
    optimizer: str,
    extra: dict[str, Any],
    cls: str,
    ops: set[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clear_launcher_env(monkeypatch)
    config = TrainConfig(**TINY, optimizer=optimizer, **extra, out=str(tmp_path / optimizer))
    result = run_training(config)
    assert result is not None
    report = build_report(config, result)
    json_path, png_path = write_report(report, config.out)
    data = json.loads(json_path.read_text())

    opt = data["optimizer"]
    assert opt["name"] == optimizer and opt["class"] == cls
    assert opt["lr"] == TINY["lr"] and opt["max_grad_norm"] == 1.0 and opt["betas"] == [0.9, 0.95]
    if optimizer == "scape":
        assert (opt["density"], opt["warmup_steps"], opt["mask_delay"]) == (0.1, 5, 1)
        assert [s["sparse"] for s in data["steps"]] == [False] * 5 + [True] * 15
    steps = data["steps"]
    assert [s["step"] for s in steps] == list(range(1, 21))
    assert all(s["grad_norm"] is not None and s["grad_norm"] > 0 for s in steps)

    # The optimizer synchronizes: no gradient all-reduce; the loss takes its own 1-element one.
    wire = data["wire_bytes"]
    assert "all_reduce" not in wire["by_op"]
    assert ops <= set(wire["by_op"]), wire["by_op"]
    loss_sent, _ = ring_bytes("all_reduce", 4, 2)
    assert all(s["bytes_sent_by_op"]["loss"] == loss_sent for s in steps)
    assert all(s["bytes_sent"] == sum(s["bytes_sent_by_op"].values()) for s in steps)
    assert wire["total"] == sum(s["bytes_sent"] for s in steps)
    assert wire["per_step"] == pytest.approx(wire["total"] / 20)
    assert wire["optimizer_per_step"] == pytest.approx(wire["per_step"] - loss_sent)
    assert sum(v["total"] for v in wire["by_op"].values()) == wire["total"]
    if optimizer == "scape":  # sparse steps move far fewer bytes than the dense warm-up steps
        assert max(s["bytes_sent"] for s in steps[6:]) < 0.5 * min(s["bytes_sent"] for s in steps[:5])

    losses = [s["train_loss"] for s in steps]
    assert sum(losses[-5:]) / 5 < sum(losses[:3]) / 3 - 0.5, losses
    assert data["final"]["val_loss"] < data["final"]["initial_val_loss"] - 0.5, data["evals"]
    assert png_path.stat().st_size > 5_000


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("optimizer", "extra", "hook_ops"),
    [
        ("ddp-powersgd-adamw", {"powersgd_rank": 1}, {"all_reduce"}),
        ("ddp-sparse-adamw", {"density": 0.1}, {"ddp_hook", "mask_sync"}),
    ],
)
def test_train_job_under_ddp_with_a_comm_hook(
    optimizer: str, extra: dict[str, Any], hook_ops: set[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch DDP + AdamW with PowerSGD's or our sparse hook: dense steps first, then far fewer bytes, and it learns."""
    clear_launcher_env(monkeypatch)
    config = TrainConfig(**TINY, optimizer=optimizer, sparse_warmup_steps=5, **extra, out=str(tmp_path / optimizer))
    result = run_training(config)
    assert result is not None
    data = json.loads(write_report(build_report(config, result), config.out)[0].read_text())
    opt = data["optimizer"]
    assert opt["class"] == "torch.optim.AdamW" and opt["start_iter"] == 5
    assert opt["hook"] == optimizer.split("-")[1] and opt["grad_clip"] == 1.0
    steps = data["steps"]
    assert [s["sparse"] for s in steps] == [False] * 5 + [True] * 15
    assert all(s["comm_time_s"] is None and s["grad_norm"] > 0 for s in steps)
    dense, _ = ring_bytes("all_reduce", 4 * data["model"]["num_parameters"], 2)
    loss_sent, _ = ring_bytes("all_reduce", 4, 2)
    assert all(s["bytes_sent_by_op"]["loss"] == loss_sent for s in steps)
    hook_bytes = [s["bytes_sent"] - loss_sent for s in steps]
    assert all(b >= 0.99 * dense for b in hook_bytes[:5]), (hook_bytes[:5], dense)  # the dense warm-up
    assert max(hook_bytes[6:]) < 0.5 * dense, (hook_bytes, dense)
    assert hook_ops <= set(data["wire_bytes"]["by_op"]), data["wire_bytes"]["by_op"]
    assert data["wire_bytes"]["bucket_bytes"] == 4 * data["model"]["num_parameters"]
    losses = [s["train_loss"] for s in steps]
    assert sum(losses[-5:]) / 5 < sum(losses[:3]) / 3 - 0.5, losses
    assert data["final"]["val_loss"] < data["final"]["initial_val_loss"] - 0.5, data["evals"]


def test_ddp_choices_refuse_bad_settings() -> None:
    with pytest.raises(ValueError, match="gloo"):
        TrainConfig(optimizer="ddp-sparse-adamw", backend="mpi")
    with pytest.raises(ValueError, match="powersgd_rank"):
        TrainConfig(optimizer="ddp-powersgd-adamw", powersgd_rank=0)
    args = build_parser().parse_args(["train", "--optimizer", "ddp-powersgd-adamw", "--powersgd-rank", "2"])
    assert args.powersgd_rank == 2 and args.optimizer == "ddp-powersgd-adamw"


def test_cli_optimizer_options() -> None:
    args = build_parser().parse_args(
        ["train", "--optimizer", "scape", "--density", "0.05", "--warmup-steps", "7", "--mask-delay", "2"]
    )
    assert (args.optimizer, args.density, args.warmup_steps, args.mask_delay) == ("scape", 0.05, 7, 2)
    # constant learning rate, no weight decay: the setting of the held-out convergence checks
    args = build_parser().parse_args(["train", "--warmup", "0", "--min-lr-ratio", "1", "--weight-decay", "0"])
    settings = model_settings(args)
    assert (settings["warmup_steps"], settings["min_lr_ratio"], settings["weight_decay"]) == (0, 1.0, 0.0)
    config = TrainConfig(**settings, steps=50)
    assert {lr_at(config, s) for s in (1, 25, 50)} == {config.lr}
    d = TrainConfig()
    args = build_parser().parse_args(["train"])
    assert (args.optimizer, args.density, args.warmup_steps) == (d.optimizer, d.density, d.sparse_warmup_steps)
    assert d.optimizer == "adamw" and d.density == 0.01
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--optimizer", "sgd"])
    with pytest.raises(ValueError, match="density"):
        TrainConfig(optimizer="scape", density=0.0)


# Workers for the failure tests: module level, so that spawned ranks can import them.
def _raise_on_rank1(config: TrainConfig, rank: int, world_size: int, on_step: OnStep | None) -> Any:
    if rank == 1:
        raise ValueError("boom from rank 1")
    time.sleep(120)  # rank 0 hangs: the launcher must kill it


def _die_on_rank1(config: TrainConfig, rank: int, world_size: int, on_step: OnStep | None) -> Any:
    if rank == 1:
        os._exit(3)
    time.sleep(120)


@pytest.mark.timeout(90)
def test_launcher_reports_failing_rank_and_kills_the_rest() -> None:
    t0 = time.monotonic()
    with pytest.raises(LocalRunError) as info:
        launch_local(TrainConfig(**TINY), worker=_raise_on_rank1)
    assert "rank 1 raised" in str(info.value)
    assert "boom from rank 1" in str(info.value) and "Traceback" in str(info.value)
    assert time.monotonic() - t0 < 60


@pytest.mark.timeout(90)
def test_launcher_reports_rank_that_died() -> None:
    with pytest.raises(LocalRunError, match="rank 1 exited with code 3"):
        launch_local(TrainConfig(**TINY), worker=_die_on_rank1)


def test_launcher_refuses_local_mpi() -> None:
    with pytest.raises(ValueError, match="mpirun"):
        launch_local(TrainConfig(backend="mpi"))


def test_cli_defaults_match_train_config() -> None:
    args = build_parser().parse_args(["train"])
    d = TrainConfig()
    assert (args.nproc, args.steps, args.backend, args.out) == (d.nproc, d.steps, d.backend, d.out)
    assert (args.lr, args.batch, args.seed, args.data) == (d.lr, d.batch, d.seed, d.data)
    assert (args.weight_decay, args.min_lr_ratio) == (d.weight_decay, d.min_lr_ratio)
    assert args.func is not None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--backend", "nccl"])
