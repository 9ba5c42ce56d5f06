"""The drop-in API, SCAPE, the sparse DDP hook and FSDP2 over sparsecomm in one script, as users launch it.

Every rank writes ``<out>/rank<r>.json``: the result of a drop-in
``all_reduce``, and per path (``scape``, ``ddp-sparse-hook``) the losses and a
digest of the final parameters (FSDP2's gathered in full).
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

import optim
import sparsecomm.distributed as dist
from sparsecomm.hooks import SparseHookState, sparse_allreduce_hook
from tests.dist.torchrun import end_worker


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def digest(m: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in m.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(net: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 16, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), x[:, :4].sin() * 2.0)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    dist.init_process_group("gloo")  # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, ws = dist.get_rank(), dist.get_world_size()
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    out: dict[str, object] = {"all_reduce": t.tolist(), "world_size": ws}

    m = model()
    scape = optim.SCAPE(m.parameters(), lr=1e-2, density=0.1, warmup_steps=3)
    out["scape"] = {"losses": train(m, scape, rank, a.steps), "digest": digest(m)}
    scape.close()

    m = model()
    ddp = DistributedDataParallel(m)
    state = SparseHookState(density=0.1, start_iter=3)
    ddp.register_comm_hook(state, sparse_allreduce_hook)
    adamw = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    out["ddp-sparse-hook"] = {
        "losses": train(ddp, adamw, rank, a.steps),
        "digest": digest(m),
        "hook_bytes": state.stats.bytes_sent,
    }
    state.close()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sparsecomm.fsdp

    m = model()
    mesh = init_device_mesh("cpu", (ws,))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    sparsecomm.fsdp.use_sparsecomm(m)
    before = dist.get_stats().as_dict()
    losses = train(m, torch.optim.AdamW(m.parameters(), lr=1e-2), rank, a.steps)
    after = dist.get_stats().as_dict()
    full = hashlib.sha256()
    for p in m.parameters():
        full.update(p.full_tensor().detach().contiguous().numpy().tobytes())
    out["fsdp2"] = {
        "losses": losses,
        "digest": full.hexdigest(),
        "fsdp_bytes": sum(
            after[k]["bytes_sent"] - before.get(k, {}).get("bytes_sent", 0) for k in after if k.startswith("fsdp_")
        ),
    }
    end_worker(a.out, out)


if __name__ == "__main__":
    main()
