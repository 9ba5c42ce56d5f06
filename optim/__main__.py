"""``python -m optim``: the ``sparsecomm`` command line (see :mod:`optim.apps.cli.main`)."""

from __future__ import annotations

import sys

from optim.apps.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
