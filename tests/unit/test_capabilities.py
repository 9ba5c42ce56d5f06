"""Every optimizer says what it is (optim.optimizers.capabilities); nothing outside the optimizers asks its class."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import cast

import pytest
import torch

import optim
import sparsecomm.distributed as dist
from bindings.store import open_store
from optim.optimizers.capabilities import (
    PLAIN,
    AveragingOptimizer,
    OptimizerCapabilities,
    ReplicaSnapshotOptimizer,
    SnapshotOptimizer,
    StateLayout,
    capabilities,
)
from optim.optimizers.wrapping import check_inner

ROOT = Path(__file__).resolve().parents[2]
SHARDED = OptimizerCapabilities(layout=StateLayout.SHARDED, replicas_drift=False, own_snapshots=True)
REPLICA = OptimizerCapabilities(layout=StateLayout.REPLICATED, replicas_drift=False, own_snapshots=True)
LOCAL = OptimizerCapabilities(layout=StateLayout.REPLICATED, replicas_drift=True, own_snapshots=True)
WRAPPED = OptimizerCapabilities(layout=StateLayout.REPLICATED, replicas_drift=True, own_snapshots=False)
IN_STEP = OptimizerCapabilities(layout=StateLayout.REPLICATED, replicas_drift=False, own_snapshots=False)

Build = Callable[[torch.nn.Module], torch.optim.Optimizer]
EXPECTED: dict[str, tuple[Build, OptimizerCapabilities]] = {
    "AdamS": (lambda m: optim.AdamS(m.parameters()), PLAIN),
    "CodedGradients": (lambda m: optim.CodedGradients(torch.optim.AdamW(m.parameters()), m), IN_STEP),
    "DeMo": (lambda m: optim.DeMo(torch.optim.SGD(m.parameters(), lr=0.01), m), IN_STEP),
    "DiLoCo": (lambda m: optim.DiLoCo(torch.optim.AdamW(m.parameters()), m), WRAPPED),
    "LocalAdamS": (lambda m: optim.LocalAdamS(m.parameters()), LOCAL),
    "LocalOptimizer": (lambda m: optim.LocalOptimizer(torch.optim.AdamW(m.parameters()), m), WRAPPED),
    "SCAPE": (lambda m: optim.SCAPE(m.parameters(), density=0.25), SHARDED),
    "ShardedAdamS": (lambda m: optim.ShardedAdamS(m.parameters()), SHARDED),
    "ShardedAdamW": (lambda m: optim.ShardedAdamW(m.parameters()), SHARDED),
    "SparseLoCo": (lambda m: optim.SparseLoCo(torch.optim.AdamW(m.parameters()), m, density=0.1), WRAPPED),
    "MaskedLoCo": (lambda m: optim.MaskedLoCo(torch.optim.AdamW(m.parameters()), m, density=0.1), WRAPPED),
    "TopKAdamS": (lambda m: optim.TopKAdamS(m.parameters()), REPLICA),
    "TopKGradients": (lambda m: optim.TopKGradients(torch.optim.AdamW(m.parameters()), m), IN_STEP),
    "torch.optim.AdamW": (lambda m: torch.optim.AdamW(m.parameters()), PLAIN),
    "torch.optim.SGD": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), PLAIN),
}
"""Every optimizer class in ``optim.__all__`` (and two of torch's) with the answer it must give."""


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    store = open_store("127.0.0.1", 0, server=True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, world_size=1, rank=0, timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_every_optimizer_class_is_listed() -> None:
    classes = {n for n in optim.__all__ if isinstance(getattr(optim, n), type)}
    assert classes == {n for n in EXPECTED if not n.startswith("torch.")}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_answers_and_keeps_its_promises(one_rank: None, name: str) -> None:
    build, expected = EXPECTED[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = build(model)
    try:
        caps = capabilities(opt)
        assert caps == expected
        assert caps.synchronizes == (caps.layout is not StateLayout.PLAIN)
        promised: list[type] = []
        if caps.own_snapshots:
            promised.append(SnapshotOptimizer)
            if caps.layout is StateLayout.REPLICATED:
                promised.append(ReplicaSnapshotOptimizer)
        if caps.replicas_drift:
            promised.append(AveragingOptimizer)
        for protocol in promised:  # the methods each answer promises
            members = [m for m in vars(protocol) if not m.startswith("_")]
            assert members, protocol.__name__
            missing = [m for m in members if not hasattr(opt, m)]
            assert not missing, (name, protocol.__name__, missing)
        if caps.own_snapshots:
            assert cast(SnapshotOptimizer, opt).snapshot_growth() >= 0
        if caps.synchronizes:  # a wrapper refuses what synchronizes the ranks itself
            with pytest.raises(TypeError, match="synchronizes the ranks itself"):
                check_inner(opt, model)
        else:
            check_inner(opt, model)  # a plain one may be wrapped
    finally:
        close = getattr(opt, "close", None)
        if close is not None:
            close()


def test_undeclared_or_foreign_answers_are_plain() -> None:
    class Odd:
        capabilities = "sharded"  # not a record: ignored

    assert capabilities(object()) is PLAIN
    assert capabilities(Odd()) is PLAIN
    assert not PLAIN.synchronizes and not PLAIN.replicas_drift and not PLAIN.own_snapshots


@pytest.mark.parametrize(
    ("layout", "drift", "own"),
    [
        (StateLayout.SHARDED, False, False),  # a shard is cut again from its own snapshots
        (StateLayout.SHARDED, True, True),
        (StateLayout.PLAIN, False, True),
        (StateLayout.PLAIN, True, False),
        ("replicated", False, False),
    ],
)
def test_impossible_answers_are_refused(layout: StateLayout, drift: bool, own: bool) -> None:
    with pytest.raises(ValueError):
        OptimizerCapabilities(layout=layout, replicas_drift=drift, own_snapshots=own)


# ---------------------------------------------------------------------- no class checks outside the optimizers
SCANNED = ("bindings", "sparsecomm", "resilient_comm", "optim", "examples")


def _optimizer_classes() -> list[type]:
    """Every optimizer class of ``optim.optimizers`` (every module imported) and of torch."""
    import optim.optimizers

    for info in pkgutil.iter_modules(optim.optimizers.__path__, "optim.optimizers."):
        importlib.import_module(info.name)
    seen: list[type] = []
    todo = [torch.optim.Optimizer]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen and sub.__module__.split(".")[0] in ("optim", "torch"):
                seen.append(sub)
                todo.append(sub)
    return seen


def _names(node: ast.expr) -> Iterator[str]:
    """The class names a second argument of isinstance/issubclass refers to (``a.b.C`` -> ``C``)."""
    if isinstance(node, ast.Tuple):
        for elt in node.elts:
            yield from _names(elt)
    elif isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr
    elif isinstance(node, ast.BinOp):  # X | Y
        yield from _names(node.left)
        yield from _names(node.right)


def test_no_class_checks_on_optimizers_outside_their_modules() -> None:
    classes = _optimizer_classes()
    forbidden = {c.__name__ for c in classes}
    assert {"ShardedAdamS", "LocalOptimizer", "WrappingOptimizer", "AdamW"} <= forbidden
    private = {c.__name__ for c in classes if c.__name__.startswith("_")}
    home = {f"{c.__module__.replace('.', '/')}.py" for c in classes if c.__module__.startswith("optim.")}
    home.add("optim/optimizers/capabilities.py")
    bad: list[str] = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(), filename=rel)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    leaked = [a.name for a in node.names if a.name in private]
                    if leaked and rel not in home:
                        bad.append(f"{rel}:{node.lineno} imports {leaked}")
                    continue
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                    continue
                if node.func.id not in ("isinstance", "issubclass") or len(node.args) != 2 or rel in home:
                    continue
                hit = sorted(set(_names(node.args[1])) & forbidden)
                if hit:
                    bad.append(f"{rel}:{node.lineno} {node.func.id}(..., {', '.join(hit)})")
    assert not bad, "ask optim.optimizers.capabilities.capabilities(optimizer) instead:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", ["AdamS", "ShardedAdamS", "ShardedAdamW", "SCAPE", "LocalAdamS", "TopKAdamS"])
def test_constructors_take_only_params_and_lr_by_position(name: str) -> None:
    """Every other setting is named: the same call reads the same across the optimizers."""
    import inspect

    import optim

    params = list(inspect.signature(getattr(optim, name).__init__).parameters.values())[1:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert positional == ["params", "lr"], positional
