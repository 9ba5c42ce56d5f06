"""The ``sparsecomm`` command line: ``main`` dispatches to the subcommands."""

from __future__ import annotations

from optim.cli.main import main

__all__ = ["main"]
