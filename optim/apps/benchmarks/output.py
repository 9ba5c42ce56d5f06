"""One place for how benchmark commands write their JSON and lay out their tables.

A result file holds the result, the environment it ran in and the commit of
the code that produced it (:func:`bench_env`). A table is built once as a
:class:`Table` of formatted cells and laid out either as the fixed-width text
the commands print (:func:`text_table`) or as a Markdown table for the
READMEs (:func:`markdown_table`), so both show the same numbers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
import subprocess
from pathlib import Path

import torch

from bindings.json_object import JsonObject

__all__ = ["Table", "bench_env", "git_commit", "markdown_table", "text_table", "write_bench_json"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Table:
    """Formatted cells of one table.

    Attributes:
        columns: Column headings.
        rows: One tuple of cell strings per row, as long as ``columns``.
        left: Indices of the columns that hold text (left-aligned in Markdown);
            the others hold numbers (right-aligned).
    """

    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    left: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"row {row} has {len(row)} cells for {len(self.columns)} columns")


def text_table(table: Table, *, width: int | None = None, sep: str = "  ") -> str:
    """Lay ``table`` out right-aligned in fixed-width columns (``width`` each, or each column's widest cell)."""
    cols = range(len(table.columns))
    widths = [
        width if width is not None else max(len(c) for c in (table.columns[i], *(r[i] for r in table.rows)))
        for i in cols
    ]
    lines = [sep.join(f"{c:>{w}}" for c, w in zip(table.columns, widths, strict=True))]
    lines += [sep.join(f"{c:>{w}}" for c, w in zip(row, widths, strict=True)) for row in table.rows]
    return "\n".join(lines)


def markdown_table(table: Table) -> str:
    """Lay ``table`` out as a Markdown table (text columns left-aligned, numbers right-aligned)."""
    rule = "|" + "|".join("---" if i in table.left else "---:" for i in range(len(table.columns))) + "|"
    lines = [_md_row(table.columns), rule]
    lines += [_md_row(row) for row in table.rows]
    return "\n".join(lines)


def _md_row(cells: tuple[str, ...] | list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def git_commit(where: str | Path | None = None) -> str:
    """The commit checked out where this package lives (``git rev-parse HEAD``), or ``"unknown"`` outside git."""
    cwd = Path(where) if where is not None else Path(__file__).resolve().parent
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        logger.debug("no git commit for %s: %s", cwd, exc)
        return "unknown"
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else "unknown"


def bench_env() -> dict[str, str]:
    """torch, Python, machine and the code's commit of this run."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "commit": git_commit(),
    }


def write_bench_json(path: str | Path, bench: JsonObject) -> Path:
    """Write ``bench`` plus an ``env`` entry (:func:`bench_env`) to ``path`` (parents created); return the path.

    ``bench`` should hold the resolved configuration of the run (under
    ``config``, or per part such as a suite's ``settings``), so that the file
    says what was measured as well as what came out.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**bench, "env": bench_env()}, indent=1, default=str) + "\n")
    return out
