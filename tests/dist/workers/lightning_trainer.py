"""PyTorch Lightning with sparsecomm's strategy, as a user runs it under torchrun.

A small MLP learns a fixed regression task with each variant of ``--variants``:
``scape`` (SCAPE syncs, ``SparseDDPStrategy()``: DDP sends nothing),
``adamw-hook`` (AdamW over ``SparseDDPStrategy(SparseHookState(density=0.1))``)
and ``adamw`` (plain ``DDPStrategy``). Every rank writes ``<out>/rank<r>.json``:
per variant the training losses, a digest of the final parameters, the comm
hook DDP ran and the bytes of sparsecomm's groups.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

import optim
import sparsecomm.distributed as dist
from optim.integrations.lightning import SparseDDPStrategy
from sparsecomm.hooks import SparseHookState
from tests.dist.torchrun import end_worker


class Regression(L.LightningModule):
    def __init__(self, variant: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        self.variant = variant
        self.losses: list[float] = []
        self.comm_hook = ""

    def on_train_end(self) -> None:
        hooks = getattr(self.trainer.strategy.model, "_comm_hooks", [])  # what register_comm_hook recorded
        self.comm_hook = ",".join(h.__name__ for h, _ in hooks)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.variant == "scape":
            return optim.SCAPE(self.parameters(), lr=1e-2, density=0.1, warmup_steps=3)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 16, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :4].sin() * 2.0)


def run(variant: str, steps: int) -> dict:
    module = Regression(variant)
    hook_state = None
    if variant == "scape":
        strategy = SparseDDPStrategy()
    elif variant == "adamw-hook":
        hook_state = SparseHookState(density=0.1, start_iter=3)
        strategy = SparseDDPStrategy(hook_state)
    else:
        strategy = DDPStrategy()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    bytes0 = dist.get_stats().bytes_sent
    trainer.fit(module, torch.utils.data.DataLoader(data(), batch_size=16, shuffle=False))
    digest = hashlib.sha256()
    for p in module.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    opt = trainer.optimizers[0]
    if hasattr(opt, "close"):
        opt.close()
    out = {
        "losses": module.losses,
        "digest": digest.hexdigest(),
        "comm_hook": module.comm_hook,
        "optimizer_bytes": dist.get_stats().bytes_sent - bytes0,
        "hook_bytes": 0 if hook_state is None else hook_state.stats.bytes_sent,
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", default="scape,adamw-hook,adamw")
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")
    dist.init_process_group("gloo")
    results = {v: run(v, a.steps) for v in a.variants.split(",")}
    end_worker(a.out, results)


if __name__ == "__main__":
    main()
