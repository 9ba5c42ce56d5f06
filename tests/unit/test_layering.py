"""Imports point one way: bindings <- sparsecomm, resilient_comm <- optim."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "bindings": {"sparsecomm", "resilient_comm", "optim"},
    "sparsecomm": {"resilient_comm", "optim"},
    "resilient_comm": {"sparsecomm", "optim"},
    "optim": set(),
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_direction(package: str) -> None:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path) & FORBIDDEN[package]:
            bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


#: Files outside bindings allowed to use a transport, and why.
TRANSPORT_EXCEPTIONS = {
    # The torchft baseline of the recovery benchmark drives torchft's own
    # process groups and stores, as torchft's users do.
    "optim/benchmarks/torchft_baseline.py",
    # The train job's DDP choices (and the DDP hook benchmark) run torch's DDP with torch's own hooks
    # (all-reduce, PowerSGD) as their users do, and count their bytes around torch.distributed's collectives.
    "optim/train_job/ddp.py",
}


def test_only_bindings_touches_transports() -> None:
    transports = ("mpi4py", "cupy", "torch.distributed")
    bad = []
    for package in ("sparsecomm", "resilient_comm", "optim"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if str(path.relative_to(ROOT)) in TRANSPORT_EXCEPTIONS:
                continue
            for name in _imported_modules(path):
                if any(name == t or name.startswith(t + ".") for t in transports):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_optim_library_imports_no_application() -> None:
    """optim's top level (optimizers, snapshots, the DeadPool client) stands without the job, benchmarks and CLI."""
    apps = ("optim.train_job", "optim.benchmarks", "optim.cli")
    bad = []
    for path in sorted((ROOT / "optim").glob("*.py")):
        if path.name == "__main__.py":  # ``python -m optim`` is the command line itself
            continue
        for name in _imported_modules(path):
            if any(name == a or name.startswith(a + ".") for a in apps):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)
