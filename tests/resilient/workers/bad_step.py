"""A user's loop on optim.resilient with a NaN or Inf injected for real (run under ``sparsecomm launch``).

``--nan-grad SLOT@STEP`` writes a NaN into one gradient of that slot's worker
after its backward at that step; ``--inf-loss SLOT@STEP`` makes its loss
infinite there; ``--nan-input SLOT@STEP`` puts a NaN into its batch, so the
forward itself (BatchNorm's running statistics included) goes bad (all
repeatable). Each member writes ``<out>/slot<s>.json``:
its losses, the skipped steps, digests of its final parameters and of its
buffers, whether the buffers are finite, and the error that ended the run (if any).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import optim
from optim.resilient import BadStepsError, ResilientConfig, ResilientTraining


def at(text: str) -> tuple[int, int]:
    slot, step = text.split("@")
    return int(slot), int(step)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--optimizer", choices=("scape", "adamw"), default="scape")
    p.add_argument("--nan-grad", type=at, action="append", default=[])
    p.add_argument("--inf-loss", type=at, action="append", default=[])
    p.add_argument("--nan-input", type=at, action="append", default=[])
    p.add_argument("--max-bad-steps", type=int, default=3)
    a = p.parse_args()
    torch.manual_seed(0)
    # BatchNorm: its running statistics are the buffers a bad step must not leave behind
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
    build = {
        "scape": lambda m: optim.SCAPE(m.parameters(), lr=3e-3, density=0.1, warmup_steps=3),
        "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),
    }[a.optimizer]
    ft = ResilientTraining(model, build, config=ResilientConfig(max_bad_steps=a.max_bad_steps))
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    error = None
    try:
        for step in ft.steps(a.steps):
            with ft.step(step):
                g = torch.Generator().manual_seed(1_000_003 * step + ft.rank)
                x = torch.randn(32, 16, generator=g)
                y = (x @ teacher).argmax(dim=1)
                if (ft.rank, step) in a.nan_input:
                    x[0, 0] = float("nan")
                ft.optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y)
                if (ft.rank, step) in a.inf_loss:
                    loss = loss * float("inf")
                loss.backward()
                if (ft.rank, step) in a.nan_grad:
                    next(model.parameters()).grad[0, 0] = float("nan")
                ft.optimizer_step(loss)
    except BadStepsError as exc:
        error = str(exc)
    member, slot = ft.is_member, ft.rank if ft.is_member else -1
    if error is None:
        ft.finish()
    else:
        ft.close()
    if member:
        digest, buffers = hashlib.sha256(), hashlib.sha256()
        for t in model.parameters():
            digest.update(t.detach().contiguous().numpy().tobytes())
        for t in model.buffers():  # this rank's own BatchNorm statistics (its own batches)
            buffers.update(t.detach().contiguous().numpy().tobytes())
        report = {
            "losses": {str(k): v for k, v in sorted(ft.losses.items())},
            "skipped": ft.skipped,
            "digest": digest.hexdigest(),
            "buffers": buffers.hexdigest(),
            "finite_buffers": all(bool(b.isfinite().all()) for b in model.buffers() if b.is_floating_point()),
            "error": error,
        }
        (a.out / f"slot{slot}.json").write_text(json.dumps(report))
    return 3 if error else 0


if __name__ == "__main__":
    raise SystemExit(main())
