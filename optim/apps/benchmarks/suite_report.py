"""Tables and a plot of convergence-suite records (:func:`optim.apps.benchmarks.suite.run_suite`), for the CLI."""

from __future__ import annotations

from pathlib import Path
from statistics import median

from bindings.json_object import JsonObject
from optim.apps.benchmarks.output import Table, text_table
from optim.apps.benchmarks.suite import best_dense, ratio_key, reference

__all__ = [
    "AGAINST",
    "format_suite_table",
    "format_worst_table",
    "merge_suites",
    "suite_table",
    "summary_table",
    "worst_table",
    "write_suite_plot",
]


AGAINST = ("reference", "best")
"""What a table's ratios are to: each run's dense reference (:func:`optim.apps.benchmarks.suite.reference`) or the
better of dense AdamS and dense AdamW in the same cell (``best``)."""


def _check_against(against: str) -> None:
    if against not in AGAINST:
        raise ValueError(f"against must be one of {AGAINST}, got {against!r}")


def _cells(suite: JsonObject) -> dict[tuple[str, int], dict[str, JsonObject]]:
    out: dict[tuple[str, int], dict[str, JsonObject]] = {}
    for r in suite["rows"]:
        out.setdefault((r["setting"], r["horizon"]), {})[r["name"]] = r
    return out


def _ratio(row: JsonObject, cell: dict[str, JsonObject], against: str) -> float:
    """``row``'s ratio: to its reference, or to the better dense run of its cell (also for files made before
    ``ratio_to_best_dense`` was recorded)."""
    if against == "reference":
        return float(row[ratio_key(row)])
    if "ratio_to_best_dense" in row:
        return float(row["ratio_to_best_dense"])
    return float(row["val_loss"]) / min(float(cell["adams"]["val_loss"]), float(cell["adamw"]["val_loss"]))


def _order(names: list[str]) -> list[str]:
    dense = [n for n in ("adamw", "adams") if n in names]
    return dense + sorted((n for n in names if n not in dense), key=lambda n: (-float(n.split("@")[1]), n))


def suite_table(suite: JsonObject, *, digits: int = 4, against: str = "reference") -> Table:
    """One row per setting and horizon: each run's ratio of validation loss to dense AdamS's.

    An AdamW-based run (name marked ``/w``) is given against dense AdamW's
    instead. ``dense AdamS`` is its validation loss (the reference, not
    repeated as a ratio column), ``seed spread`` its own spread over the seeds
    (largest over smallest validation loss; only with several seeds), the
    noise floor a ratio is read against. The last row is each run's largest
    wire bytes per step relative to dense AdamS's.

    With ``against="best"`` every ratio, dense AdamS's and AdamW's included,
    is to the better of dense AdamS and dense AdamW in the same cell, and a
    column ``best`` says which one that is.

    Raises:
        ValueError: ``against`` is not one of :data:`AGAINST`.
    """
    _check_against(against)
    best = against == "best"
    names = [n for n in _order(sorted({r["name"] for r in suite["rows"]})) if best or n != "adams"]
    vs_w = set() if best else {r["name"] for r in suite["rows"] if reference(r.get("optimizer", "")) == "adamw"}
    seeded = _several_seeds(suite)
    columns = (
        "setting",
        "steps",
        "dense AdamS",
        *(("seed spread",) if seeded else ()),
        *(("best",) if best else ()),
        *(n + ("/w" if n in vs_w else "") for n in names),
    )
    settings = list(suite["settings"])
    by_cell = _cells(suite)
    rows = []
    for setting, h in sorted(by_cell, key=lambda k: (settings.index(k[0]), k[1])):
        cells = by_cell[(setting, h)]
        spread = cells["adams"].get("dense_seed_spread")
        ratios = (f"{_ratio(cells[n], cells, against):.{digits}f}" if n in cells else "-" for n in names)
        spreads = (f"{spread:.{digits}f}" if spread is not None else "-",) if seeded else ()
        which = (_best_name(cells),) if best else ()
        rows.append((setting, str(h), f"{cells['adams']['val_loss']:.{digits}f}", *spreads, *which, *ratios))
    wire: dict[str, list[float]] = {}
    for r in suite["rows"]:
        if r["wire_ratio_to_adams"] is not None:
            wire.setdefault(r["name"], []).append(r["wire_ratio_to_adams"])
    wire_cells = (f"{max(wire[n]):.{digits}f}" if n in wire else "-" for n in names)
    blanks = ("",) * (int(seeded) + int(best))
    rows.append(("wire bytes / dense AdamS", "", "", *blanks, *wire_cells))
    return Table(columns=columns, rows=tuple(rows), left=frozenset({0, *((columns.index("best"),) if best else ())}))


def _best_name(cells: dict[str, JsonObject]) -> str:
    return best_dense(float(cells["adams"]["val_loss"]), float(cells["adamw"]["val_loss"]))


def format_suite_table(suite: JsonObject, *, against: str = "reference") -> str:
    """:func:`suite_table` as fixed-width text."""
    return text_table(suite_table(suite, against=against), sep=" ")


def worst_table(suite: JsonObject, *, digits: int = 4) -> Table:
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


def rise_table(suite: JsonObject, *, digits: int = 2) -> Table:
    """One row per setting and trained run length: the largest one-step rise of the training loss after the
    warm-up, of the larger dense run (AdamS, AdamW) and of each sparse run (``!``: above the dense one)."""
    seen: dict[tuple[str, int], dict[str, JsonObject]] = {}
    for r in suite["rows"]:
        if "largest_loss_rise" in r:
            seen.setdefault((r["setting"], r.get("trained_steps", r["horizon"])), {})[r["name"]] = r
    names = _order(sorted({n for cell in seen.values() for n in cell if n not in ("adams", "adamw")}))
    columns = ("setting", "steps", "dense", *names)
    rows = []
    for (setting, steps), cell in seen.items():
        dense = max(float(r["dense_largest_loss_rise"]) for r in cell.values())
        out = [setting, str(steps), f"{dense:.{digits}f}"]
        for n in names:
            rise = cell.get(n, {}).get("largest_loss_rise")
            out.append("-" if rise is None else f"{rise:.{digits}f}{'!' if rise > dense else ''}")
        rows.append(tuple(out))
    return Table(columns=columns, rows=tuple(rows), left=frozenset({0}))


def _several_seeds(suite: JsonObject) -> bool:
    return any(len(r.get("seeds", [])) > 1 for r in suite["rows"])


def format_worst_table(suite: JsonObject) -> str:
    """:func:`worst_table` as fixed-width text."""
    return text_table(worst_table(suite), sep=" ")


def summary_table(suites: list[tuple[str, JsonObject]], *, digits: int = 2, against: str = "reference") -> Table:
    """Median / worst ratio to the dense reference over every cell of a suite, per run and density.

    Args:
        suites: ``(label, suite record)`` pairs; every sparse run of each
            suite gives one row, labelled with the run's method and ``label``
            (the result it comes from).
        digits: Decimals of the ratios.
        against: ``"reference"`` (each run's dense reference) or ``"best"``
            (the better of dense AdamS and dense AdamW in each cell).

    Returns:
        Columns ``run``, ``result``, then ``median / worst`` at each density
        found, largest first.

    Raises:
        ValueError: ``against`` is not one of :data:`AGAINST`.
    """
    _check_against(against)
    densities = sorted({float(r["density"]) for _, s in suites for r in s["rows"] if "@" in r["name"]}, reverse=True)
    rows = []
    for label, suite in suites:
        methods = sorted({r["name"].split("@")[0] for r in suite["rows"] if "@" in r["name"]})
        by_cell = _cells(suite)
        for method in methods:
            cells = [method, label]
            for d in densities:
                ratios = [
                    _ratio(r, by_cell[(r["setting"], r["horizon"])], against)
                    for r in suite["rows"]
                    if r["name"].split("@")[0] == method and r["density"] == d
                ]
                cells.append(f"{median(ratios):.{digits}f} / {max(ratios):.{digits}f}" if ratios else "-")
            rows.append(tuple(cells))
    columns = ("run", "result", *(f"density {d:g}" for d in densities))
    return Table(columns=columns, rows=tuple(rows), left=frozenset({0, 1}))


def merge_suites(suites: list[JsonObject]) -> JsonObject:
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


def write_suite_plot(suite: JsonObject, path: str | Path) -> Path:
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
