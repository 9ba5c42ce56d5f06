"""Both fault-aware communicators satisfy :class:`resilient_comm.ResilientCommunicator`, member by member.

``isinstance`` against a runtime-checkable protocol only looks at names; this
compares each member's kind (property, method, classmethod) and signature:
every call the protocol allows must be accepted by the implementation, with
the same parameter names, kinds, defaults and annotations (extra parameters
of an implementation must be optional). Return annotations are compared for
the members the resilient protocol declares; for the inherited
:class:`~bindings.base.Communicator` members the implementations return
subtypes, which mypy checks (``resilient_comm/protocol.py``).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from bindings.base import Communicator
from resilient_comm import FaultAwareCommunicator, ResilientCommunicator
from resilient_comm.ulfm_communicator import UlfmCommunicator

IMPLEMENTATIONS = (FaultAwareCommunicator, UlfmCommunicator)
#: Public members only one implementation has, and why.
OWN_MEMBERS = {
    # the coordinator's view, the store registration, the second transport per epoch, and asking the
    # coordinator (which holds the spares) to replace a straggler
    FaultAwareCommunicator: {"view", "membership", "side_channel", "report_straggler"},
    # the configured reconfiguration mode, and the name of connect that says what it is collective over
    UlfmCommunicator: {"mode", "from_world"},
}


def _protocol_members(proto: type) -> dict[str, tuple[type, Any]]:
    """Public members declared by ``proto`` and the protocols it extends: name -> (declaring protocol, raw attr)."""
    out: dict[str, tuple[type, Any]] = {}
    for cls in reversed(proto.__mro__):
        if not getattr(cls, "_is_protocol", False) or cls.__module__ == "typing":
            continue
        for name, value in vars(cls).items():
            if not name.startswith("_"):
                out[name] = (cls, value)
    return out


def _raw(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    raise AttributeError(name)


def _kind(attr: Any) -> str:
    if isinstance(attr, property):
        return "property"
    if isinstance(attr, classmethod):
        return "classmethod"
    if isinstance(attr, staticmethod):
        return "staticmethod"
    return "method" if inspect.isfunction(attr) else type(attr).__name__


def _function(attr: Any) -> Any:
    if isinstance(attr, property):
        return attr.fget
    if isinstance(attr, (classmethod, staticmethod)):
        return attr.__func__
    return attr


def _mismatches(name: str, proto_attr: Any, impl: type, own: bool) -> list[str]:
    """Why ``impl``'s member ``name`` does not satisfy the protocol's (empty: it does)."""
    try:
        impl_attr = _raw(impl, name)
    except AttributeError:
        return [f"{impl.__name__}.{name}: missing"]
    where = f"{impl.__name__}.{name}"
    if _kind(proto_attr) != _kind(impl_attr):
        return [f"{where}: a {_kind(impl_attr)}, the protocol has a {_kind(proto_attr)}"]
    want, got = inspect.signature(_function(proto_attr)), inspect.signature(_function(impl_attr))
    bad: list[str] = []
    if own:
        ret = want.return_annotation
        allowed = {ret, impl.__name__} if ret == "ResilientCommunicator" else {ret}
        if got.return_annotation not in allowed:
            bad.append(f"{where}: returns {got.return_annotation}, the protocol {ret}")
    if _kind(proto_attr) == "property":
        return bad
    want_params, got_params = list(want.parameters.values()), list(got.parameters.values())
    by_name = {p.name: p for p in got_params}
    for i, p in enumerate(want_params):
        if i == 0:  # self / cls
            continue
        q = got_params[i] if p.kind is not p.KEYWORD_ONLY and i < len(got_params) else by_name.get(p.name)
        if q is None or q.name != p.name:
            bad.append(f"{where}: no parameter {p.name!r} (position {i})")
            continue
        if p.kind is not q.kind and not (p.kind is p.KEYWORD_ONLY and q.kind is q.POSITIONAL_OR_KEYWORD):
            bad.append(f"{where}({p.name}): {q.kind.description}, the protocol {p.kind.description}")
        if p.default != q.default:
            bad.append(f"{where}({p.name}): default {q.default!r}, the protocol {p.default!r}")
        if p.annotation != q.annotation:
            bad.append(f"{where}({p.name}): annotated {q.annotation}, the protocol {p.annotation}")
    known = {p.name for p in want_params}
    for q in got_params[1:]:
        required = q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)
        if q.name not in known and required:
            bad.append(f"{where}({q.name}): required, but not in the protocol")
    return bad


MEMBERS = _protocol_members(ResilientCommunicator)


def test_protocol_declares_the_lifecycle() -> None:
    own = {n for n, (cls, _) in MEMBERS.items() if cls is ResilientCommunicator}
    assert own == {
        "connect",
        "epoch",
        "member",
        "slot",
        "healthy",
        "committed_step",
        "wait_for_promotion",
        "commit",
        "reconfigure",
    }
    inherited = {n for n, (cls, _) in MEMBERS.items() if cls is Communicator}
    assert {"all_reduce", "barrier", "abort", "close", "rank", "world_size"} <= inherited
    doc = ResilientCommunicator.__doc__ or ""
    order = [doc.index(word) for word in ("**connect**", "**wait for promotion**", "**collectives**", "**commit**")]
    assert order == sorted(order) and "**reconfigure**" in doc


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", sorted(MEMBERS))
def test_member_matches_the_protocol(impl: type, name: str) -> None:
    proto_cls, attr = MEMBERS[name]
    assert not _mismatches(name, attr, impl, own=proto_cls is ResilientCommunicator)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_public_surfaces_differ_only_in_their_own_members(impl: type) -> None:
    other = next(c for c in IMPLEMENTATIONS if c is not impl)

    def public(cls: type) -> set[str]:
        return {n for n in dir(cls) if not n.startswith("_")}

    assert set(MEMBERS) <= public(impl)
    assert public(impl) - public(other) == OWN_MEMBERS[impl]
    assert not OWN_MEMBERS[impl] & set(MEMBERS)


def test_the_check_catches_a_drifted_implementation() -> None:
    class Drifted:
        @property
        def epoch(self) -> str:
            return ""

        def slot(self) -> int | None:
            return None

        def commit(self, step: int, ok: bool = False, timeout: float | None = None) -> bool:
            return True

        def reconfigure(self, when: int, timeout: Any = None) -> Any:
            return None

        @classmethod
        def connect(cls, *, timeout: Any = None, address: str) -> int:
            return 0

    assert _mismatches("epoch", MEMBERS["epoch"][1], Drifted, own=True)
    assert _mismatches("slot", MEMBERS["slot"][1], Drifted, own=True) == [
        "Drifted.slot: a method, the protocol has a property"
    ]
    commit = _mismatches("commit", MEMBERS["commit"][1], Drifted, own=True)
    assert any("default False" in m for m in commit) and any("annotated float | None" in m for m in commit)
    assert _mismatches("reconfigure", MEMBERS["reconfigure"][1], Drifted, own=True)
    connect = _mismatches("connect", MEMBERS["connect"][1], Drifted, own=True)
    assert any("address): required" in m for m in connect) and any("returns int" in m for m in connect)
    assert _mismatches("member", MEMBERS["member"][1], Drifted, own=True) == ["Drifted.member: missing"]
