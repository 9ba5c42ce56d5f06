"""Hugging Face Trainer with our optimizers, as a user runs it under torchrun.

A tiny GPT-2 built from a config (no download) learns a synthetic sequence
task for a few steps with each optimizer named by ``--optimizers``, passed as
``Trainer(optimizers=(opt, None))`` after ``sparsecomm.distributed``
initialized the job. A name may end in ``+sync`` (``DDPCommCallback(trainer)``: the optimizer syncs,
DDP sends nothing; Trainer's clipping off, it would clip each rank's own
gradient), ``+noclip`` (Trainer's clipping off, nothing else) or ``+hookD``
(``DDPCommCallback(trainer, SparseHookState(density=D))``: the sparse DDP hook).
Every rank writes ``<out>/rank<r>.json``: per optimizer, the logged losses,
how many parameters changed, a digest of the final parameters (equal on every
rank when the replicas agree), the comm hook DDP ran and the bytes of
sparsecomm's groups.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

import optim
import sparsecomm.distributed as dist
from optim.integrations.huggingface import DDPCommCallback
from sparsecomm.hooks import SparseHookState
from tests.dist.torchrun import end_worker


class Sequences(torch.utils.data.Dataset):
    """Token i of sample n is (i * (n % 7 + 1) + n % 5) % vocab: learnable in a few steps."""

    def __init__(self, vocab: int, length: int) -> None:
        self.vocab, self.length = vocab, length

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, n: int) -> dict[str, torch.Tensor]:
        x = (torch.arange(self.length) * (n % 7 + 1) + n % 5) % self.vocab
        return {"input_ids": x, "labels": x}


def make_optimizer(name: str, params: object) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=3e-3)
    if name == "adams":
        return optim.AdamS(params, lr=3e-3)
    if name == "sharded_adams":
        return optim.ShardedAdamS(params, lr=3e-3)
    if name == "sharded_adamw":
        return optim.ShardedAdamW(params, lr=3e-3)
    if name.startswith("scape"):
        return optim.SCAPE(params, lr=3e-3, density=float(name.removeprefix("scape")))
    raise ValueError(f"unknown optimizer {name!r}")


def run(full_name: str, out_dir: Path, steps: int) -> dict:
    name, _, comm = full_name.partition("+")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    opt = make_optimizer(name, model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(
        output_dir=str(out_dir / "trainer"),
        use_cpu=True,
        ddp_backend="gloo",
        max_steps=steps,
        max_grad_norm=0.0 if comm in ("sync", "noclip") else 1.0,
        per_device_train_batch_size=8,
        logging_steps=10,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Sequences(97, 32), optimizers=(opt, None))
    hook_state = None
    if comm == "sync":
        trainer.add_callback(DDPCommCallback(trainer))
    elif comm.startswith("hook"):
        hook_state = SparseHookState(density=float(comm.removeprefix("hook")), start_iter=5)
        trainer.add_callback(DDPCommCallback(trainer, hook_state))
    bytes0 = dist.get_stats().bytes_sent
    trainer.train()
    ddp_hook = trainer.model_wrapped._get_ddp_logging_data().get("comm_hook", "")
    trained = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
    after = dict(trained.named_parameters())
    digest = hashlib.sha256()
    for n in sorted(after):
        digest.update(after[n].detach().contiguous().numpy().tobytes())
    if hasattr(opt, "close"):
        opt.close()
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "changed": sum(not torch.equal(before[n], p.detach()) for n, p in after.items()),
        "params": len(after),
        "digest": digest.hexdigest(),
        "comm_hook": ddp_hook,
        "optimizer_bytes": dist.get_stats().bytes_sent - bytes0,
        "hook_bytes": 0 if hook_state is None else hook_state.stats.bytes_sent,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--optimizers", default="adams,sharded_adams,scape1.0,scape0.01")
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    hf_logging.set_verbosity_error()
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    results = {name: run(name, a.out, a.steps) for name in a.optimizers.split(",")}
    end_worker(a.out, results)


if __name__ == "__main__":
    main()
