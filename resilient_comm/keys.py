"""Names of the store keys shared by the coordinator and the members (one place for the wire layout)."""

from __future__ import annotations

__all__ = [
    "JOB",
    "AUTH",
    "AUTH_HMAC",
    "EPOCH",
    "FAILED",
    "SHUTDOWN",
    "COMPLETED",
    "BEACON",
    "LEFT_NEXT",
    "COMMITTED",
    "MEMBERS_NEXT",
    "SUSPECT_NEXT",
    "REFUSED_NEXT",
    "refused",
    "member",
    "heartbeat",
    "left",
    "suspect",
    "view",
    "abort",
    "ack",
    "configured",
    "vote",
    "decision",
    "transport_prefix",
]

JOB = "job"  # the job id (signed, where the job has a secret)
AUTH = "auth"  # unsigned: how records are signed (absent: they are not)
AUTH_HMAC = b"hmac-sha256"  # the value of AUTH for a job with a secret
EPOCH = "epoch"  # the newest published epoch ("-1" before the first)
FAILED = "failed"  # why the job cannot continue (set once)
SHUTDOWN = "shutdown"  # the job is over: spares stop waiting
COMPLETED = "completed"  # set with SHUTDOWN when the job ended because its work ended (the final epoch, as JSON)
BEACON = "beacon"  # the active coordinator's datagram heartbeat address, "host:port"
LEFT_NEXT = "left/next"  # counter bumped by every member that leaves: the coordinator then looks at left/<i>
COMMITTED = "committed"  # the newest step committed everywhere
MEMBERS_NEXT = "members/next"  # counter handing out member indices
SUSPECT_NEXT = "suspect/next"  # counter numbering suspicion records
REFUSED_NEXT = "refused/next"  # counter numbering the notes of refused processes
LEADER = "coordinator/leader"  # etcd only, unsigned: the active coordinator's id, bound to its lease
COORDINATOR_STATE = "coordinator/state"  # etcd only: dead, left and spare members, for a standby taking over


def member(i: int) -> str:
    """Registration record of member ``i`` (JSON :class:`~resilient_comm.view.MemberInfo`)."""
    return f"member/{i}"


def heartbeat(i: int) -> str:
    """Heartbeat of member ``i``: the number of beats so far, rewritten by each beat."""
    return f"hb/{i}"


def left(i: int) -> str:
    """Set when member ``i`` leaves cleanly (not a failure)."""
    return f"left/{i}"


def refused(n: int) -> str:
    """Unsigned note ``n`` of a process that was refused (JSON: host, pid, reason); read only for the log."""
    return f"refused/{n}"


def suspect(n: int) -> str:
    """Suspicion record ``n`` (JSON: member, epoch, reason)."""
    return f"suspect/{n}"


def view(epoch: int) -> str:
    """View of ``epoch`` (JSON :class:`~resilient_comm.view.View`)."""
    return f"view/{epoch}"


def abort(epoch: int) -> str:
    """Set when ``epoch`` is over: members abort its transport."""
    return f"abort/{epoch}"


def ack(epoch: int, i: int) -> str:
    """Member ``i`` aborted ``epoch``'s transport and is alive."""
    return f"ack/{epoch}/{i}"


def configured(epoch: int, i: int) -> str:
    """Member ``i`` built ``epoch``'s transport."""
    return f"configured/{epoch}/{i}"


def vote(epoch: int, step: int, i: int) -> str:
    """Member ``i``'s vote for ``step`` in ``epoch`` (``1``: ok)."""
    return f"vote/{epoch}/{step}/{i}"


def decision(epoch: int, step: int) -> str:
    """Commit decision of ``step`` in ``epoch``: ``1`` (everywhere) or ``0`` (nowhere), set once."""
    return f"decision/{epoch}/{step}"


def transport_prefix(epoch: int) -> str:
    """Store prefix of ``epoch``'s data-plane rendezvous (never reused)."""
    return f"ep{epoch}/"
