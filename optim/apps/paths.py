"""Where this checkout is, for the child processes that the jobs and benchmarks start with ``python -m``."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["REPO_ROOT", "pythonpath_env"]

REPO_ROOT = str(Path(__file__).resolve().parents[2])
"""The directory that holds the ``optim`` package (and ``bindings``, ``sparsecomm``, ``resilient_comm``)."""


def pythonpath_env() -> dict[str, str]:
    """``{"PYTHONPATH": ...}`` with this checkout first, then the caller's own ``PYTHONPATH``.

    A child started as ``python -m optim...`` from another working directory
    then imports the same code as its parent, installed or not.
    """
    return {"PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH", "")]))}
