"""A training loop of your own, failure-transparent: a worker killed mid-run changes nothing in the result.

Run it as a fault-tolerant job (4 workers, 1 spare)::

    sparsecomm launch --nproc 4 --spares 1 -- python examples/resilient_loop.py --steps 60 --out run.json

Kill any worker (``kill -9``) while it trains: the spare takes its slot, the
members restore the newest step every slot still holds, and the losses and
final parameters in ``run.json`` are bit-identical to a run without failures.

With ``--checkpoint-dir DIR --checkpoint-every N`` every N-th committed step
is also written to disk; kill the whole job (the launcher too) and run it
again with ``--resume``: it goes on from the newest complete checkpoint, bit
for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import optim
from optim.resilient import ResilientConfig, ResilientTraining

FEATURES, CLASSES, BATCH = 16, 4, 32
TEACHER = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(1234))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data contract: a step's batch is a function of (step, rank), so a step run again sees the same data."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, (x @ TEACHER).argmax(dim=1)


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 10)


OPTIMIZERS = {
    "scape": lambda m: optim.SCAPE(m.parameters(), lr=3e-3, density=0.1),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),  # gradients averaged by optimizer_step()
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="scape")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", type=Path, required=True, help="JSON: the loss of every committed step")
    p.add_argument("--checkpoint-dir", default=None, help="also write persistent checkpoints there")
    p.add_argument("--checkpoint-every", type=int, default=0, help="committed steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="start from the newest complete checkpoint")
    p.add_argument("--step-seconds", type=float, default=0.0, help="extra 'compute' per step (s); results unchanged")
    args = p.parse_args()

    torch.manual_seed(0)  # the same model on every process, spares included
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))
    ft = ResilientTraining(
        model,
        OPTIMIZERS[args.optimizer],
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup),
        config=ResilientConfig(
            checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, resume=args.resume
        ),
    )
    for step in ft.steps(args.steps):  # a spare waits here until it takes a dead worker's slot
        with ft.step(step):  # a failure anywhere inside: recover, then steps() goes on from the restored step
            x, y = batch(step, ft.rank)
            ft.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            time.sleep(args.step_seconds)
            ft.optimizer_step(loss)
            ft.scheduler.step()  # type: ignore[union-attr]
    member = ft.is_member
    rank, world_size = (ft.rank, ft.world_size) if member else (-1, 0)
    ft.finish()  # collective: drains the replication, closes the communicator
    if member and rank == 0:
        digest = hashlib.sha256()
        for name, param in model.named_parameters():
            digest.update(name.encode() + param.detach().numpy().tobytes())
        report = {
            "losses": {str(k): v for k, v in sorted(ft.losses.items())},
            "params_sha256": digest.hexdigest(),
            "world_size": world_size,
            "recoveries": [r.to_json() for r in ft.recoveries],
        }
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
