"""Notice when a module swaps in a new Parameter object for one an optimizer holds.

``module.load_state_dict(sd, assign=True)``, ``module.weight = nn.Parameter(...)``
and re-tying weights replace the *object* a module holds; an optimizer that was
built before keeps the old object, which the model no longer uses (every torch
optimizer then silently trains nothing for it). torch calls a global hook on
every parameter registration while the old object is still registered, so a
:class:`ParamWatch` learns which of its parameters was replaced, by what and
where. Its owner decides at its next step what to do with that.

One global hook serves every watch in the process; it is installed with the
first watch and removed with the last one.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["ParamWatch", "Replacement"]

_lock = threading.Lock()
_watches: dict[int, list[weakref.ref[ParamWatch]]] = {}  # id(param) -> watches holding it
_hook: Any = None


@dataclass(frozen=True, kw_only=True)
class Replacement:
    """Slot ``index`` of a watch now stands for ``param``, registered as ``where``.

    ``dropped`` names the registrations of an earlier replacement of the same
    slot that a later one superseded (a tie broken by the replacements: both
    objects may still be in use).
    """

    index: int
    param: Tensor
    where: str
    dropped: tuple[str, ...] = ()


def _on_register(module: torch.nn.Module, name: str, param: Tensor | None) -> None:
    old = module._parameters.get(name)
    if old is None or param is None or old is param:
        return
    with _lock:
        refs = list(_watches.get(id(old), ()))
    for ref in refs:
        watch = ref()
        if watch is not None:
            watch._replaced(old, param, f"{type(module).__name__}.{name}")


def _add(watch: ParamWatch, key: int) -> None:
    global _hook
    _watches.setdefault(key, []).append(weakref.ref(watch))
    if _hook is None:
        _hook = torch.nn.modules.module.register_module_parameter_registration_hook(_on_register)


def _remove_all(slots: dict[int, int], ref_id: int) -> None:
    global _hook
    with _lock:
        for key in list(slots):
            refs = [r for r in _watches.get(key, ()) if id(r) != ref_id and r() is not None]
            if refs:
                _watches[key] = refs
            else:
                _watches.pop(key, None)
        if not _watches and _hook is not None:
            _hook.remove()
            _hook = None


class ParamWatch:
    """Records replacements of the given parameters in any module.

    Args:
        params: The parameters to watch, in slot order.
    """

    def __init__(self, params: list[Tensor]) -> None:
        self._slot: dict[int, int] = {}
        self._pending: dict[int, Replacement] = {}
        self._first: dict[int, tuple[Tensor, str]] = {}  # per slot: the first replacement since take()
        self._ref = weakref.ref(self)
        with _lock:
            for i, p in enumerate(params):
                self._slot[id(p)] = i
                _add(self, id(p))
        self._finalizer = weakref.finalize(self, _remove_all, self._slot, id(self._ref))

    def _replaced(self, old: Tensor, new: Tensor, where: str) -> None:
        with _lock:
            i = self._slot.get(id(old))
            if i is None:
                return
            # The new object is watched at once: a second replacement before the next take() is seen too.
            if id(new) not in self._slot:
                self._slot[id(new)] = i
                _add(self, id(new))
            first = self._first.setdefault(i, (new, where))
            # A later, different object supersedes the first one unless the slot went back to it (re-tied).
            dropped = () if first[0] is new else (first[1],)
            self._pending[i] = Replacement(index=i, param=new, where=where, dropped=dropped)

    def take(self) -> list[Replacement]:
        """The replacements since the last call, newest per slot, in slot order."""
        with _lock:
            out = [self._pending[i] for i in sorted(self._pending)]
            self._pending.clear()
            self._first.clear()
        return out

    def forget(self, param: Tensor) -> None:
        """Stop watching ``param`` (a replaced object the owner has let go of)."""
        with _lock:
            if self._slot.pop(id(param), None) is None:
                return
        _remove_all({id(param): 0}, id(self._ref))

    def close(self) -> None:
        """Stop watching (also done when the watch is garbage-collected)."""
        self._finalizer.detach()
        _remove_all(self._slot, id(self._ref))
        self._slot.clear()
