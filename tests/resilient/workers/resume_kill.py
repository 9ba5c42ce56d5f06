"""A user's loop on optim.resilient that resumes from a checkpoint, with a worker SIGKILLed for real while it loads.

``--kill-on-resume`` makes the first worker to build its optimizer during the
resume (the optimizer factory runs inside the collective checkpoint load)
SIGKILL itself, once per output directory: the failure comes before the
resumed run's first snapshot. Member 0 writes ``<out>/report.json``: the
losses of every committed step, a digest of the final parameters and the
recoveries.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import optim
from optim.resilient import ResilientConfig, ResilientTraining


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--kill-on-resume", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def build(m: nn.Module) -> torch.optim.Optimizer:
        if a.kill_on_resume:
            try:
                os.close(os.open(a.out / "killed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return optim.SCAPE(m.parameters(), lr=3e-3, density=0.1, warmup_steps=3)

    config = ResilientConfig(checkpoint_dir=a.checkpoint_dir, checkpoint_every=a.checkpoint_every, resume=a.resume)
    ft = ResilientTraining(model, build, config=config)
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    for step in ft.steps(a.steps):
        with ft.step(step):
            g = torch.Generator().manual_seed(1_000_003 * step + ft.rank)
            x = torch.randn(32, 16, generator=g)
            ft.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), (x @ teacher).argmax(dim=1))
            loss.backward()
            ft.optimizer_step(loss)
    member, rank = ft.is_member, ft.rank if ft.is_member else -1
    ft.finish()
    if member and rank == 0:
        digest = hashlib.sha256()
        for t in model.parameters():
            digest.update(t.detach().contiguous().numpy().tobytes())
        report = {"losses": ft.losses, "digest": digest.hexdigest(), "recoveries": [r.to_json() for r in ft.recoveries]}
        (a.out / "report.json").write_text(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
