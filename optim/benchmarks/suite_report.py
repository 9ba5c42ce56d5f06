"""Tables and a plot of convergence-suite records (:func:`optim.benchmarks.suite.run_suite`), for the CLI."""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Any

from optim.benchmarks.output import Table, text_table
from optim.benchmarks.suite import ratio_key, reference

__all__ = [
    "format_suite_table",
    "format_worst_table",
    "merge_suites",
    "suite_table",
    "summary_table",
    "worst_table",
    "write_suite_plot",
]


def _order(names: list[str]) -> list[str]:
    dense = [n for n in ("adamw", "adams") if n in names]
    return dense + sorted((n for n in names if n not in dense), key=lambda n: (-float(n.split("@")[1]), n))


def suite_table(suite: dict[str, Any], *, digits: int = 4) -> Table:
    """One row per setting and horizon: each run's ratio of validation loss to dense AdamS's.

    An AdamW-based run (name marked ``/w``) is given against dense AdamW's
    instead. ``dense AdamS`` is its validation loss (the reference, not
    repeated as a ratio column), ``seed spread`` its own spread over the seeds
    (largest over smallest validation loss; only with several seeds), the
    noise floor a ratio is read against. The last row is each run's largest
    wire bytes per step relative to dense AdamS's.
    """
    names = [n for n in _order(sorted({r["name"] for r in suite["rows"]})) if n != "adams"]
    vs_w = {r["name"] for r in suite["rows"] if reference(r.get("optimizer", "")) == "adamw"}
    seeded = _several_seeds(suite)
    columns = (
        "setting",
        "steps",
        "dense AdamS",
        *(("seed spread",) if seeded else ()),
        *(n + ("/w" if n in vs_w else "") for n in names),
    )
    settings = list(suite["settings"])
    keys = sorted({(r["setting"], r["horizon"]) for r in suite["rows"]}, key=lambda k: (settings.index(k[0]), k[1]))
    rows = []
    for setting, h in keys:
        cells = {r["name"]: r for r in suite["rows"] if r["setting"] == setting and r["horizon"] == h}
        spread = cells["adams"].get("dense_seed_spread")
        ratios = (f"{cells[n][ratio_key(cells[n])]:.{digits}f}" if n in cells else "-" for n in names)
        spreads = (f"{spread:.{digits}f}" if spread is not None else "-",) if seeded else ()
        rows.append((setting, str(h), f"{cells['adams']['val_loss']:.{digits}f}", *spreads, *ratios))
    wire: dict[str, list[float]] = {}
    for r in suite["rows"]:
        if r["wire_ratio_to_adams"] is not None:
            wire.setdefault(r["name"], []).append(r["wire_ratio_to_adams"])
    wire_cells = (f"{max(wire[n]):.{digits}f}" if n in wire else "-" for n in names)
    rows.append(("wire bytes / dense AdamS", "", "", *(("",) if seeded else ()), *wire_cells))
    return Table(columns=columns, rows=tuple(rows), left=frozenset({0}))


def format_suite_table(suite: dict[str, Any]) -> str:
    """:func:`suite_table` as fixed-width text."""
    return text_table(suite_table(suite), sep=" ")


def worst_table(suite: dict[str, Any], *, digits: int = 4) -> Table:
    """One row per run but dense AdamS: worst ratio to its reference per horizon (where, each seed's range), verdict."""
    hs = [str(h) for h in suite["horizons"]]
    per = ("setting", "seeds") if _several_seeds(suite) else ("setting",)
    columns = ("run", *(c for h in hs for c in (f"worst at {h}", *per)), "target")
    rows = []
    for name in (n for n in _order(list(suite["worst"])) if n != "adams"):
        w = suite["worst"][name]
        cells: list[str] = [name]
        for h in hs:
            c = w["by_horizon"].get(h)
            if not c:
                cells += ["-", *("" for _ in per)]
                continue
            rs = c.get("seed_ratios") or []
            seeds = f"{min(rs):.{min(digits, 3)}f}..{max(rs):.{min(digits, 3)}f}" if len(rs) > 1 else "-"
            cells += [f"{c['ratio']:.{digits}f}", c["setting"], *((seeds,) if len(per) > 1 else ())]
        verdict = "-" if w["met"] is None else f"{'ok' if w['met'] else 'MISS'}<={w['max_ratio']:g}"
        rows.append((*cells, verdict))
    text_cols = frozenset(i for i, c in enumerate(columns) if c in ("run", "setting", "seeds", "target"))
    return Table(columns=columns, rows=tuple(rows), left=text_cols)


def _several_seeds(suite: dict[str, Any]) -> bool:
    return any(len(r.get("seeds", [])) > 1 for r in suite["rows"])


def format_worst_table(suite: dict[str, Any]) -> str:
    """:func:`worst_table` as fixed-width text."""
    return text_table(worst_table(suite), sep=" ")


def summary_table(suites: list[tuple[str, dict[str, Any]]], *, digits: int = 2) -> Table:
    """Median / worst ratio to the dense reference over every cell of a suite, per run and density.

    Args:
        suites: ``(label, suite record)`` pairs; every sparse run of each
            suite gives one row, labelled with the run's method and ``label``
            (the result it comes from).
        digits: Decimals of the ratios.

    Returns:
        Columns ``run``, ``result``, then ``median / worst`` at each density
        found, largest first.
    """
    densities = sorted({float(r["density"]) for _, s in suites for r in s["rows"] if "@" in r["name"]}, reverse=True)
    rows = []
    for label, suite in suites:
        methods = sorted({r["name"].split("@")[0] for r in suite["rows"] if "@" in r["name"]})
        for method in methods:
            cells = [method, label]
            for d in densities:
                ratios = [
                    r[ratio_key(r)] for r in suite["rows"] if r["name"].split("@")[0] == method and r["density"] == d
                ]
                cells.append(f"{median(ratios):.{digits}f} / {max(ratios):.{digits}f}" if ratios else "-")
            rows.append(tuple(cells))
    columns = ("run", "result", *(f"density {d:g}" for d in densities))
    return Table(columns=columns, rows=tuple(rows), left=frozenset({0, 1}))


def merge_suites(suites: list[dict[str, Any]]) -> dict[str, Any]:
    """One suite record from several runs of the same settings and horizons: the first's dense rows, all sparse rows.

    Raises:
        ValueError: Two suites that differ in settings or horizons, or a run name in two of them.
    """
    first = suites[0]
    rows = [r for r in first["rows"] if "@" not in r["name"]]
    worst = {n: w for n, w in first["worst"].items() if "@" not in n}
    for suite in suites:
        if list(suite["settings"]) != list(first["settings"]) or suite["horizons"] != first["horizons"]:
            raise ValueError("suites to merge must share settings and horizons")
        for name, w in suite["worst"].items():
            if "@" in name:
                if name in worst:
                    raise ValueError(f"run {name} is in two of the suites to merge")
                worst[name] = w
        rows += [r for r in suite["rows"] if "@" in r["name"]]
    return {**first, "rows": rows, "worst": worst}


def write_suite_plot(suite: dict[str, Any], path: str | Path) -> Path:
    """Ratio to dense AdamS of every sparse run, one panel per horizon, one line per method and density."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    hs = suite["horizons"]
    settings = list(suite["settings"])
    fig = Figure(figsize=(6.0 * len(hs), 4.8), dpi=110)
    FigureCanvasAgg(fig)
    names = [n for n in _order(sorted({r["name"] for r in suite["rows"]})) if n != "adams"]
    for i, h in enumerate(hs):
        ax = fig.add_subplot(1, len(hs), i + 1)
        for n in names:
            ys = []
            for s in settings:
                cell = [r for r in suite["rows"] if r["setting"] == s and r["horizon"] == h and r["name"] == n]
                ys.append(cell[0][ratio_key(cell[0])] if cell else float("nan"))
            vs_w = any(reference(r.get("optimizer", "")) == "adamw" for r in suite["rows"] if r["name"] == n)
            ax.plot(range(len(settings)), ys, "o-", ms=4, lw=1.2, label=n + (" (vs AdamW)" if vs_w else ""))
        ax.axhline(1.0, color="black", lw=0.8)
        for limit in sorted(set(suite["targets"].values())):
            ax.axhline(limit, color="gray", lw=0.6, ls="--")
        ax.set_xticks(range(len(settings)))
        ax.set_xticklabels(settings, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("validation loss / dense AdamS")
        ax.set_title(f"{h} steps", fontsize=10)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    return out
