"""The built distributions, installed the way a user installs them.

`make test` runs against an editable install, which finds every folder of the
checkout, so a subpackage left out of the wheel goes unnoticed there. These
tests build the sdist from the checkout and the wheel from that sdist (no
network: the venv's setuptools, ``--no-build-isolation``), install the wheel
with ``pip install --no-deps --target`` into a temporary folder and import
from it in subprocesses that run outside the checkout, with the checkout and
the editable install's finder taken off the import machinery; every module
they load must come from the installed folder. About 15 s on two cores, so
not marked ``slow``.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bindings", "sparsecomm", "resilient_comm", "optim")
# Import names of the optional extras' dependencies (pyproject's optional-dependencies). A module may fail to
# import only with ModuleNotFoundError for one of these, and only where it is not installed at all.
OPTIONAL_IMPORTS = frozenset(
    {"mpi4py", "cupy", "numba", "transformers", "accelerate", "lightning", "sklearn", "etcd3gw", "torchft"}
)
# Folders of the checkout that are not packages of the distribution.
NOT_PACKAGES = ("tests", "examples", "benchmarks")

# Runs in a subprocess with PYTHONPATH set to the installed folder and its working directory outside the checkout.
PROBE = r'''
import contextlib
import importlib
import importlib.util
import io
import json
import os
import pkgutil
import runpy
import sys
import traceback

request = json.loads(sys.argv[1])
checkout = os.path.realpath(request["checkout"])
packages = request["packages"]


def editable(obj):
    return str(getattr(obj, "__module__", "")).startswith("__editable__")


preloaded = sorted(name for name in sys.modules if name.split(".")[0] in packages)
# The editable install's finder would find in the checkout whatever the installed folder lacks.
sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]
site = os.path.realpath(request["site"])


def shadows(entry):
    """Whether a sys.path entry other than the installed folder holds one of the project's packages."""
    entry = os.path.realpath(entry or os.getcwd())
    if entry == site:
        return False
    return entry == checkout or "__editable__" in entry or any(
        os.path.exists(os.path.join(entry, top)) or os.path.exists(os.path.join(entry, top + ".py")) for top in packages
    )


sys.path[:] = [p for p in sys.path if not shadows(p)]
sys.path_importer_cache.clear()


def error(exc):
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    installed = None
    if missing:
        try:
            installed = importlib.util.find_spec(missing.split(".")[0]) is not None
        except (ImportError, ValueError):
            installed = True
    return {
        "type": type(exc).__name__,
        "missing": missing,
        "installed": installed,
        "traceback": traceback.format_exc(),
    }


def load(name):
    try:
        module = importlib.import_module(name)
    except BaseException as exc:  # any failure is a finding, reported to the test
        return None, error(exc)
    return module, None


result = {"preloaded": preloaded, "sys_path": list(sys.path)}
if request["action"] == "walk":
    modules = {}
    for top in packages:
        package, err = load(top)
        modules[top] = err
        if package is None:
            continue
        for info in pkgutil.walk_packages(package.__path__, top + ".", onerror=lambda name: None):
            modules[info.name] = load(info.name)[1]
    result["modules"] = modules
    readme = {}
    for module_name, names in request["imports"]:
        module, err = load(module_name)
        if module is not None:
            absent = [n for n in names if not hasattr(module, n) and load(module_name + "." + n)[0] is None]
            if absent:
                err = {"type": "ImportError", "missing": None, "installed": None,
                       "traceback": "cannot import " + ", ".join(absent) + " from " + module_name}
        readme[module_name] = err
    result["readme"] = readme
else:
    sys.argv = list(request["argv"])
    out, err_out = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err_out):
        try:
            if request["action"] == "script":
                runpy.run_path(request["target"], run_name="__main__")
            else:
                runpy.run_module(request["target"], run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            code = "raised"
            err_out.write(traceback.format_exc())
    result.update(code=code, stdout=out.getvalue(), stderr=err_out.getvalue())
result["files"] = {
    name: getattr(module, "__file__", None)
    for name, module in sorted(sys.modules.items())
    if name.split(".")[0] in packages and module is not None
}
with open(request["out"], "w") as f:
    json.dump(result, f)
'''


@dataclass(frozen=True)
class Dists:
    """The built distributions and the folder the wheel was installed into.

    Attributes:
        sdist: The source distribution built from the checkout.
        wheel: The wheel built from that sdist.
        site: Where ``pip install --target`` put the wheel's contents.
        work: A working directory outside the checkout for the probes.
    """

    sdist: Path
    wheel: Path
    site: Path
    work: Path


def _env(**extra: str) -> dict[str, str]:
    """The test's environment without PYTHONPATH, pip quiet and offline, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    env.update(extra)
    return env


def _run(cmd: list[str], cwd: Path) -> None:
    """Runs ``cmd`` and fails the test with its output if it fails."""
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


def _checkout_files() -> set[str]:
    """The modules and ``py.typed`` markers of the project's packages in the checkout, as relative paths."""
    files = set()
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and (path.suffix == ".py" or path.name == "py.typed"):
                files.add(path.relative_to(ROOT).as_posix())
    return files


def _checkout_modules() -> set[str]:
    """The dotted names of every module and package in the checkout's project packages."""
    names = set()
    for rel in _checkout_files():
        if rel.endswith(".py"):
            parts = rel[: -len(".py")].split("/")
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _readme_imports() -> list[tuple[str, list[str]]]:
    """The project modules the README's Python blocks import, each with the names it imports from them.

    Returns:
        ``(module, names)`` pairs in README order; ``names`` is empty for ``import module``.
    """
    text = (ROOT / "README.md").read_text()
    found: dict[str, list[str]] = {}
    for block in re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.splitlines():
            stripped = line.strip()
            if not stripped.startswith(("import ", "from ")):
                continue
            node = ast.parse(stripped.split("#")[0]).body[0]
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.setdefault(alias.name, [])
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.setdefault(node.module, []).extend(a.name for a in node.names)
    return [(m, names) for m, names in found.items() if m.split(".")[0] in PACKAGES]


def _is_optional_missing(err: dict[str, Any]) -> bool:
    """Whether an import failed only because an optional extra's dependency is not installed."""
    missing = err.get("missing") or ""
    return (
        err["type"] == "ModuleNotFoundError"
        and missing.split(".")[0] in OPTIONAL_IMPORTS
        and err.get("installed") is False
    )


def _assert_loaded_from(result: dict[str, Any], site: Path) -> None:
    """Every project module the probe loaded came from ``site``, none was loaded before it started."""
    assert result["preloaded"] == [], f"project modules imported before the probe ran: {result['preloaded']}"
    root = os.path.realpath(site)
    stray = {
        name: file
        for name, file in result["files"].items()
        if file is None or not os.path.realpath(file).startswith(root + os.sep)
    }
    assert not stray, f"modules not loaded from the installed wheel in {site}: {stray}"
    assert not any(os.path.realpath(p or ".") == str(ROOT) for p in result["sys_path"])


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    """Builds the sdist from the checkout and the wheel from the sdist, and installs the wheel (once per module)."""
    base = tmp_path_factory.mktemp("packaging")
    sdist_dir, wheel_dir, site, work = (base / n for n in ("sdist", "wheel", "site", "work"))
    for d in (sdist_dir, wheel_dir, work):
        d.mkdir()
    # What `python -m build --sdist --no-isolation` calls: the PEP 517 backend, here the venv's setuptools.
    backend = "import sys\nfrom setuptools import build_meta\nbuild_meta.build_sdist(sys.argv[1])"
    _run([sys.executable, "-c", backend, str(sdist_dir)], cwd=ROOT)
    (sdist,) = sdist_dir.glob("*.tar.gz")
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheel_dir), str(sdist)], work)
    (wheel,) = wheel_dir.glob("*.whl")
    _run([*pip, "install", "--no-deps", "--no-index", "--no-compile", "--target", str(site), str(wheel)], work)
    (work / "probe.py").write_text(PROBE)
    return Dists(sdist=sdist, wheel=wheel, site=site, work=work)


def _probe(dists: Dists, action: str, **request: Any) -> dict[str, Any]:
    """Runs the probe with only the installed folder on PYTHONPATH, from outside the checkout.

    Args:
        dists: The installed distribution.
        action: ``walk`` (import every module and the README's imports), ``script`` or ``module``.
        **request: The rest of the probe's request (``argv``, ``target``, ``imports``).

    Returns:
        The probe's JSON result.
    """
    out = dists.work / f"{action}.json"
    out.unlink(missing_ok=True)
    request.update(action=action, checkout=str(ROOT), site=str(dists.site), packages=list(PACKAGES), out=str(out))
    proc = subprocess.run(
        [sys.executable, str(dists.work / "probe.py"), json.dumps(request)],
        cwd=dists.work,
        env=_env(PYTHONPATH=str(dists.site)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and out.exists(), f"probe failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    result: dict[str, Any] = json.loads(out.read_text())
    _assert_loaded_from(result, dists.site)
    return result


@pytest.fixture(scope="module")
def walked(dists: Dists) -> dict[str, Any]:
    """Every module of every installed package and every README import, imported in one probe."""
    return _probe(dists, "walk", imports=_readme_imports())


def test_wheel_ships_every_package_and_nothing_else(dists: Dists) -> None:
    names = zipfile.ZipFile(dists.wheel).namelist()
    shipped = {n for n in names if n.split("/")[0] in PACKAGES}
    missing = sorted(_checkout_files() - shipped)
    assert not missing, f"files of the checkout's packages missing from {dists.wheel.name}: {missing}"
    tops = {n.split("/")[0] for n in names}
    (dist_info,) = (t for t in tops if t.endswith(".dist-info"))
    assert tops == {*PACKAGES, dist_info}, f"unexpected top-level entries in the wheel: {tops}"
    assert not tops & set(NOT_PACKAGES)
    for top in PACKAGES:
        assert f"{top}/py.typed" in names
    entry_points = zipfile.ZipFile(dists.wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert re.search(r"^sparsecomm\s*=\s*optim\.apps\.cli\.main:main$", entry_points, flags=re.M)


def test_sdist_holds_sources_readme_and_examples(dists: Dists) -> None:
    with tarfile.open(dists.sdist) as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    required = {"pyproject.toml", "README.md", "PKG-INFO", *_checkout_files()}
    required |= {p.name for p in ROOT.iterdir() if p.is_file() and p.name.upper().startswith(("LICENSE", "COPYING"))}
    # the examples ship with the source: the README tells readers to run them
    required |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").glob("*.py")}
    readme_examples = set(re.findall(r"\bexamples/[\w/]+\.py\b", (ROOT / "README.md").read_text()))
    assert readme_examples, "the README names no example"
    assert all((ROOT / p).is_file() for p in readme_examples), readme_examples
    required |= readme_examples
    missing = sorted(required - names)
    assert not missing, f"missing from {dists.sdist.name}: {missing}"


def test_every_module_imports_from_the_installed_wheel(walked: dict[str, Any]) -> None:
    modules: dict[str, dict[str, Any] | None] = walked["modules"]
    not_installed = sorted(_checkout_modules() - set(modules))
    assert not not_installed, f"modules of the checkout the installed wheel lacks: {not_installed}"
    failed = {name: err for name, err in modules.items() if err is not None and not _is_optional_missing(err)}
    assert not failed, "\n\n".join(f"{name}:\n{err['traceback']}" for name, err in sorted(failed.items()))


def test_readme_imports_work_from_the_installed_wheel(walked: dict[str, Any]) -> None:
    imports = dict(_readme_imports())
    assert "optim.integrations.huggingface" in imports and "sparsecomm.distributed" in imports, imports
    readme: dict[str, dict[str, Any] | None] = walked["readme"]
    assert set(readme) == set(imports)
    failed = {name: err for name, err in readme.items() if err is not None and not _is_optional_missing(err)}
    assert not failed, "\n\n".join(f"{name}:\n{err['traceback']}" for name, err in sorted(failed.items()))


def _assert_help(result: dict[str, Any]) -> None:
    assert result["code"] == 0, f"exit {result['code']}\n{result['stdout']}\n{result['stderr']}"
    assert result["stdout"].startswith("usage:") and "train" in result["stdout"], result["stdout"]


def test_console_script_help(dists: Dists) -> None:
    script = dists.site / "bin" / "sparsecomm"
    assert script.is_file(), sorted(p.name for p in (dists.site / "bin").glob("*"))
    _assert_help(_probe(dists, "script", target=str(script), argv=[str(script), "--help"]))


def test_python_m_optim_help(dists: Dists) -> None:
    _assert_help(_probe(dists, "module", target="optim", argv=["optim", "--help"]))
