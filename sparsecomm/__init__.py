"""sparsecomm: mask-delayed sparse collectives over any transport of :mod:`bindings`.

``import sparsecomm.distributed as dist`` is a drop-in replacement for
``torch.distributed``.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
