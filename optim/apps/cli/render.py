"""``sparsecomm bench render``: the results tables of the READMEs, rendered from the committed result files.

A rendered table sits between two marker comments; the opening one names the
result files it comes from and the kind of table::

    <!-- table: benchmarks/results/link.json kind=link -->

    | link rate | ... |

    <!-- /table -->

Options after the kind (``key=value``) go to the kind's renderer, e.g.
``rate=1gbit`` for a wallclock table of one link rate, or ``against=best`` for
a suite table of ratios to the better of dense AdamS and dense AdamW. Every renderer reuses
the table of the command that wrote the file (:class:`optim.apps.benchmarks.output.Table`),
laid out in Markdown. ``--check`` renders into memory and reports every
marked table that differs from what is committed.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from optim.apps.benchmarks.output import Table, markdown_table
from optim.apps.benchmarks.suite_report import (
    AGAINST,
    merge_suites,
    rise_table,
    suite_table,
    summary_table,
    worst_table,
)
from optim.apps.cli.bench_checkpoint import loopback_table, recovery_split_table, snapshot_table
from optim.apps.cli.bench_hooks import hook_table
from optim.apps.cli.bench_link import link_table
from optim.apps.cli.bench_recovery import recovery_table
from optim.apps.cli.bench_wallclock import wallclock_table

__all__ = ["READMES", "RENDERERS", "RenderError", "add_render_parser", "check_file", "render_text"]

READMES = ("README.md", "benchmarks/README.md")
"""The files ``bench render`` covers by default, relative to the repository root."""

Renderer = Callable[[list[tuple[str, Any]], dict[str, str]], Table]
"""``(sources as (path, parsed JSON) pairs, options) -> table``."""


class RenderError(ValueError):
    """A marker that cannot be rendered: unclosed, unknown kind or option, or a missing result file."""


def _one(sources: list[tuple[str, Any]]) -> Any:
    if len(sources) != 1:
        raise RenderError(f"this kind takes one result file, got {len(sources)}")
    return sources[0][1]


def _digits(options: dict[str, str], default: int) -> int:
    return int(options.get("digits", default))


def _against(options: dict[str, str]) -> str:
    against = options.get("against", "reference")
    if against not in AGAINST:
        raise RenderError(f"against must be one of {', '.join(AGAINST)}, got {against!r}")
    return against


def _suite(sources: list[tuple[str, Any]], options: dict[str, str]) -> Table:
    suite = merge_suites([s for _, s in sources])
    return suite_table(suite, digits=_digits(options, 3), against=_against(options))


def _suite_worst(sources: list[tuple[str, Any]], options: dict[str, str]) -> Table:
    return worst_table(merge_suites([s for _, s in sources]), digits=_digits(options, 3))


def _suite_summary(sources: list[tuple[str, Any]], options: dict[str, str]) -> Table:
    labelled = [(f"`{Path(path).parent.name}`", suite) for path, suite in sources]
    return summary_table(labelled, digits=_digits(options, 2), against=_against(options))


def _suite_rise(sources: list[tuple[str, Any]], options: dict[str, str]) -> Table:
    return rise_table(merge_suites([s for _, s in sources]), digits=_digits(options, 2))


RENDERERS: dict[str, tuple[Renderer, frozenset[str]]] = {
    "suite": (_suite, frozenset({"digits", "against"})),
    "suite-worst": (_suite_worst, frozenset({"digits"})),
    "suite-summary": (_suite_summary, frozenset({"digits", "against"})),
    "suite-rise": (_suite_rise, frozenset({"digits"})),
    "wallclock": (lambda s, o: wallclock_table(_one(s), rate=o.get("rate")), frozenset({"rate"})),
    "link": (lambda s, o: link_table(_one(s)), frozenset()),
    "recovery": (lambda s, o: recovery_table(_one(s), fault=o.get("fault")), frozenset({"fault"})),
    "hooks": (lambda s, o: hook_table(_one(s)), frozenset()),
    "checkpoint-snapshot": (lambda s, o: snapshot_table(_one(s)), frozenset()),
    "checkpoint-recovery": (lambda s, o: recovery_split_table(_one(s)), frozenset()),
    "checkpoint-loopback": (lambda s, o: loopback_table(_one(s)), frozenset()),
}
"""Kind -> (renderer, the options it takes)."""

_OPEN = re.compile(r"^<!-- table: (?P<spec>[^>]*?) -->$")
_CLOSE = "<!-- /table -->"


def _render_marker(spec: str, root: Path) -> str:
    words = spec.split()
    options = dict(w.split("=", 1) for w in words if "=" in w)
    paths = [w for w in words if "=" not in w]
    kind = options.pop("kind", None)
    if kind not in RENDERERS:
        raise RenderError(f"marker {spec!r}: kind must be one of {', '.join(RENDERERS)}")
    renderer, known = RENDERERS[kind]
    unknown = set(options) - known
    if unknown or not paths:
        raise RenderError(f"marker {spec!r}: needs result files; unknown options {sorted(unknown)}")
    sources = []
    for p in paths:
        file = root / p
        if not file.is_file():
            raise RenderError(f"marker {spec!r}: no result file {p}")
        sources.append((p, json.loads(file.read_text())))
    return markdown_table(renderer(sources, options))


def render_text(text: str, root: Path) -> str:
    """``text`` with every marked table replaced by its render from the result files under ``root``.

    Raises:
        RenderError: A marker without its closing comment, or one that cannot be rendered.
    """
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        out.append(lines[i])
        i += 1
        if m is None:
            continue
        end = next((j for j in range(i, len(lines)) if lines[j] == _CLOSE), None)
        if end is None or any(_OPEN.match(x) for x in lines[i:end]):
            raise RenderError(f"line {i}: marker {m['spec']!r} has no {_CLOSE} before the next table")
        out += ["", _render_marker(m["spec"], root), ""]
        i = end
    return "\n".join(out)


def check_file(path: Path, root: Path) -> str:
    """A unified diff from ``path`` as it is to ``path`` with its marked tables rendered; empty when they agree."""
    text = path.read_text()
    rendered = render_text(text, root)
    name = str(path)
    diff = difflib.unified_diff(
        text.splitlines(keepends=True), rendered.splitlines(keepends=True), name, f"{name} (rendered)"
    )
    return "".join(diff)


def _cmd_render(args: argparse.Namespace) -> int:
    root = Path(args.root)
    files = [root / f for f in (args.files or READMES)]
    stale = 0
    for path in files:
        try:
            if args.check:
                diff = check_file(path, root)
                if diff:
                    stale += 1
                    sys.stdout.write(diff)
                continue
            text = path.read_text()
            rendered = render_text(text, root)
        except (RenderError, OSError, ValueError, KeyError) as exc:
            print(f"sparsecomm bench render: {path}: {exc}", file=sys.stderr)
            return 2
        if rendered != text:
            path.write_text(rendered)
            print(f"rendered {path}")
    if stale:
        print(f"sparsecomm bench render: {stale} file(s) differ from their render", file=sys.stderr)
        return 1
    return 0


def add_render_parser(inner: Any, readmes: Sequence[str] = READMES) -> None:
    """Register ``bench render``."""
    p = inner.add_parser(
        "render",
        help="render the READMEs' results tables from the committed result files (--check: only compare)",
        description="Re-renders every table between '<!-- table: FILE... kind=KIND -->' and '<!-- /table -->' "
        "from the result files it names. With --check nothing is written: a diff is printed and the exit status "
        "is 1 when a table differs from its render.",
    )
    p.add_argument("files", nargs="*", help=f"Markdown files (default: {' '.join(readmes)})")
    p.add_argument("--check", action="store_true", help="compare only; exit 1 and print a diff on a difference")
    p.add_argument("--root", default=".", help="repository root: result paths and files are relative to it")
    p.set_defaults(func=_cmd_render, cmd_parser=p)
