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
    # The replicas of the recovery benchmark's torchft baseline drive torchft's
    # own process groups and stores, as torchft's users do.
    "optim/apps/benchmarks/torchft_replica.py",
    # The train job's DDP choices (and the DDP hook benchmark) run torch's DDP with torch's own hooks
    # (all-reduce, PowerSGD) as their users do, and count their bytes around torch.distributed's collectives.
    "optim/apps/train_job/ddp.py",
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


#: optim's library: what a user imports. The applications (optim.apps) and the harnesses of the tests and
#: benchmarks (optim.testing) are built on it, never the other way round.
LIBRARY = ("optim/optimizers", "optim/state", "optim/resilient", "optim/integrations", "optim/__init__.py")
APPLICATIONS = ("optim.apps", "optim.testing")


def test_optim_library_imports_no_application() -> None:
    """The optimizers, the DeadPool state and the resilient loop stand without the apps and the harnesses."""
    bad = []
    for entry in LIBRARY:
        paths = [ROOT / entry] if entry.endswith(".py") else sorted((ROOT / entry).rglob("*.py"))
        for path in paths:
            for name in _imported_modules(path):
                if any(name == a or name.startswith(a + ".") for a in APPLICATIONS):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_every_optim_module_has_a_place() -> None:
    """optim's top level holds only the package's face (``__init__``, ``__main__``); the rest sits in a subpackage."""
    loose = sorted(p.name for p in (ROOT / "optim").glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert not loose, f"modules outside optim's subpackages: {loose}"


#: Names that do the same job in every package they appear in: the package's own exceptions.
SAME_JOB = {"errors"}


def test_no_two_library_modules_share_a_name() -> None:
    """A module's name says its job: no two modules of the packages are called the same (``__init__`` aside)."""
    seen: dict[str, list[str]] = {}
    for package in FORBIDDEN:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name not in ("__init__.py", "__main__.py"):
                seen.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    twice = {name: where for name, where in seen.items() if len(where) > 1 and name not in SAME_JOB}
    assert not twice, twice


def test_the_checkout_the_children_import_is_this_one() -> None:
    """Jobs and benchmarks start children with this checkout first on their path (``optim.apps.paths``)."""
    from optim.apps.paths import REPO_ROOT

    assert Path(REPO_ROOT) == ROOT
    assert all((ROOT / package / "__init__.py").is_file() for package in FORBIDDEN)


#: Where the names of the untyped dicts are defined: a JSON object, a torch param group.
UNTYPED_DICT_NAMES = {"bindings/json_object.py", "optim/optimizers/capabilities.py"}


def test_every_untyped_dict_says_what_it_is() -> None:
    """No bare ``dict[str, Any]`` in a signature or annotation: a record, or a name for the boundary it crosses.

    ``JsonObject`` (read or written as JSON), torch's ``StateDict`` (a state tree) or ``ParamGroup`` (a
    ``torch.optim`` param group); anything that stays in one process is a typed record.
    """
    bare = []
    for package in FORBIDDEN:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in UNTYPED_DICT_NAMES:
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
                if isinstance(node, ast.Subscript) and ast.unparse(node).replace(" ", "") == "dict[str,Any]":
                    bare.append(f"{rel}:{node.lineno}")
    assert not bare, f"bare dict[str, Any] at {bare}"


def test_no_module_imports_a_private_name_of_another() -> None:
    """``from our.module import _name`` reaches into another module's insides: what is shared is public."""
    bad = []
    for package in FORBIDDEN:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                    continue
                if node.module.split(".")[0] not in FORBIDDEN:
                    continue
                bad += [
                    f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")
                ]
    assert not bad, bad
