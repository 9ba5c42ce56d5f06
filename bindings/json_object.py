"""The one name for a JSON object in this project's signatures.

A ``dict[str, Any]`` in a signature says nothing of what it holds. Where a value is a JSON object by nature — it is
read from or written to a file, a socket, an HTTP body or another process as JSON — its type is
:data:`JsonObject`; what stays inside one process is a typed record instead.
"""

from __future__ import annotations

from typing import Any, TypeAlias

__all__ = ["JsonObject"]

#: A JSON object as ``json.loads`` returns it and ``json.dumps`` writes it.
JsonObject: TypeAlias = dict[str, Any]
