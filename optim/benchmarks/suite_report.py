"""Tables and a plot of a convergence-suite record (:func:`optim.benchmarks.suite.run_suite`), for the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from optim.benchmarks.suite import ratio_key, reference

__all__ = ["format_suite_table", "format_worst_table", "write_suite_plot"]


def _order(names: list[str]) -> list[str]:
    dense = [n for n in ("adamw", "adams") if n in names]
    return dense + sorted((n for n in names if n not in dense), key=lambda n: (-float(n.split("@")[1]), n))


def format_suite_table(suite: dict[str, Any]) -> str:
    """One line per setting and horizon: each run's ratio of validation loss to dense AdamS's.

    An AdamW-based run (name marked ``/w``) is given against dense AdamW's
    instead. ``seed_spr`` is dense AdamS's own spread over the seeds (largest over
    smallest validation loss), the noise floor a ratio is read against.
    """
    names = _order(sorted({r["name"] for r in suite["rows"]}))
    vs_w = {r["name"] for r in suite["rows"] if reference(r.get("optimizer", "")) == "adamw"}
    head = f"{'setting':>26} {'steps':>5} {'adams_val':>9} {'seed_spr':>8} " + " ".join(
        f"{n + ('/w' if n in vs_w else ''):>12}" for n in names
    )
    lines = [head]
    keys = sorted(
        {(r["setting"], r["horizon"]) for r in suite["rows"]}, key=lambda k: (list(suite["settings"]).index(k[0]), k[1])
    )
    for setting, h in keys:
        cells = {r["name"]: r for r in suite["rows"] if r["setting"] == setting and r["horizon"] == h}
        ref = cells["adams"]["val_loss"]
        spread = cells["adams"].get("dense_seed_spread")
        spr = f"{spread:>8.3f}" if spread is not None and len(cells["adams"].get("seeds", [])) > 1 else f"{'-':>8}"
        row = f"{setting:>26} {h:>5} {ref:>9.4f} {spr} " + " ".join(
            f"{cells[n][ratio_key(cells[n])]:>12.4f}" if n in cells else f"{'-':>12}" for n in names
        )
        lines.append(row)
    wire: dict[str, list[float]] = {}
    for r in suite["rows"]:
        if r["wire_ratio_to_adams"] is not None:
            wire.setdefault(r["name"], []).append(r["wire_ratio_to_adams"])
    lines.append(
        f"{'wire bytes / dense AdamS':>26} {'':>5} {'':>9} {'':>8} "
        + " ".join(f"{max(wire[n]):>12.4f}" if n in wire else f"{'-':>12}" for n in names)
    )
    return "\n".join(lines)


def format_worst_table(suite: dict[str, Any]) -> str:
    """One line per run name: worst ratio to dense AdamS per horizon (where, each seed's range), and the verdict."""
    hs = [str(h) for h in suite["horizons"]]
    head = f"{'run':>12} " + " ".join(f"{'worst@' + h:>10} {'setting':>26} {'seeds':>13}" for h in hs)
    head += f" {'target':>10}"
    lines = [head]
    for name in _order(list(suite["worst"])):
        w = suite["worst"][name]
        cells = []
        for h in hs:
            c = w["by_horizon"].get(h)
            if not c:
                cells.append(f"{'-':>10} {'':>26} {'':>13}")
                continue
            rs = c.get("seed_ratios") or []
            seeds = f"{min(rs):.3f}..{max(rs):.3f}" if len(rs) > 1 else "-"
            cells.append(f"{c['ratio']:>10.4f} {c['setting']:>26} {seeds:>13}")
        verdict = "-" if w["met"] is None else f"{'ok' if w['met'] else 'MISS'}<={w['max_ratio']:g}"
        lines.append(f"{name:>12} " + " ".join(cells) + f" {verdict:>10}")
    return "\n".join(lines)


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
