"""Your DDP loop with sparsecomm: the sparse comm hook for your own optimizer, or SCAPE syncing by itself.

    torchrun --nproc-per-node 2 examples/ddp_sparse_hook.py                  # AdamW + sparse hook at 1%
    torchrun --nproc-per-node 2 examples/ddp_sparse_hook.py --scape          # SCAPE; DDP sends nothing

Prints the loss every 50 steps and the bytes one rank sent (rank 0).
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel

import optim
import sparsecomm.distributed as dist
from sparsecomm.hooks import SparseHookState, let_optimizer_sync, sparse_allreduce_hook


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scape", action="store_true", help="SCAPE synchronizes; DDP sends nothing")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    ddp = DistributedDataParallel(model)
    state = None
    if args.scape:
        let_optimizer_sync(ddp)  # added line
        opt: torch.optim.Optimizer = optim.SCAPE(model.parameters(), lr=3e-3, density=args.density)
    else:
        state = SparseHookState(density=args.density, start_iter=10)  # added line
        ddp.register_comm_hook(state, sparse_allreduce_hook)  # added line
        opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    w = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(step * 100 + rank))
        loss = torch.nn.functional.mse_loss(ddp(x), torch.tanh(x @ w))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    sent = (state.stats if state is not None else dist.get_stats()).bytes_sent
    if rank == 0:
        print(f"final loss {loss.item():.4f}; {sent / 1e6:.2f} MB sent by rank 0", flush=True)
    if state is not None:
        state.close()
    if hasattr(opt, "close"):  # SCAPE: finish the mask gathers in flight
        opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
