"""One place for how benchmark commands write their JSON (the result plus the environment it ran in)."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["bench_env", "write_bench_json"]


def bench_env() -> dict[str, str]:
    """torch, Python and machine of this run."""
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()}


def write_bench_json(path: str | Path, bench: dict[str, Any]) -> Path:
    """Write ``bench`` plus an ``env`` entry to ``path`` (parents created); return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**bench, "env": bench_env()}, indent=1, default=str) + "\n")
    return out
