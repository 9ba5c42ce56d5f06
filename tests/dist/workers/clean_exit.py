"""A short job that ends with ``destroy_process_group()`` and a normal interpreter exit.

Under torchrun: ``python clean_exit.py [--steps N] [--optimizer] [--api sparsecomm|torch]``.
On processes of :mod:`bindings.spawn`: :func:`run` as the rank function. Each step all-reduces a
small tensor; the last collective comes right before ``destroy_process_group()``. The job keeps
to the end what scripts keep (module globals): the default group and its tensors, and with
``optimizer`` a model and a ``torch.optim`` optimizer made after ``init_process_group``, whose
gradients are all-reduced. (The first ``torch.optim`` optimizer imports ``torch._dynamo``, and that
import binds the default group of the moment into ``torch.distributed.nn.functional``'s default
arguments.) The process must exit 0.
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType
from typing import Any

import torch

#: What the job holds until the interpreter exits.
KEPT: list[Any] = []


def steps_then_destroy(dist: ModuleType, steps: int, optimizer: bool) -> float:
    """Run ``steps`` steps on the initialized default group, destroy it, return the last sum."""
    world_size = dist.get_world_size()
    KEPT.append(dist.group.WORLD)
    t = torch.ones(16)
    KEPT.append(t)
    if optimizer:
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        KEPT.extend([model, opt])
    for _ in range(steps):
        if optimizer:
            opt.zero_grad()
            model(t.reshape(1, 16)).square().mean().backward()
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
            opt.step()
        t.fill_(1.0)
        dist.all_reduce(t)
    total = float(t[0])
    assert total == world_size, total
    dist.destroy_process_group()
    return total


def run(rank: int, world_size: int, steps: int = 30, optimizer: bool = False) -> float:
    """Rank function for processes started as :func:`bindings.spawn.run_local` starts them (environment rendezvous)."""
    import sparsecomm.distributed as dist

    dist.init_process_group("gloo")
    assert (dist.get_rank(), dist.get_world_size()) == (rank, world_size)
    return steps_then_destroy(dist, steps, optimizer)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--optimizer", action="store_true", help="also train a model with a torch.optim optimizer")
    ap.add_argument("--api", choices=("sparsecomm", "torch"), default="sparsecomm")
    a = ap.parse_args()
    dist = importlib.import_module("sparsecomm.distributed" if a.api == "sparsecomm" else "torch.distributed")
    dist.init_process_group("gloo")
    steps_then_destroy(dist, a.steps, a.optimizer)


if __name__ == "__main__":
    main()
