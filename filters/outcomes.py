"""Whose outcome a call's failure is: the backend's (what a breaker, a router or a verdict must
learn from), or the client's own (what none of them may learn from). Issue 26 found one client
opening a route's breaker for everyone with a one-microsecond deadline; round 3 of the red team
found the same door open through a model version that does not exist (four calls opened the
breaker, and with a lighter level configured the bad version was answered 200 by it) and in the
modality router, which moved every client's traffic off a healthy path. One reading, shared.
"""

from __future__ import annotations

from proxy.call import CLIENT_DEADLINE, Call, LocalReply, Reply
from proxy.errors import ErrorKind


def missing_version(call: Call, reply: Reply) -> bool:
    """NOT_FOUND for a call that named a model version: the version the client asked for does
    not exist (an unversioned NOT_FOUND, a model gone from the backend, stays the backend's)."""
    return (isinstance(reply, LocalReply) and reply.kind is ErrorKind.NOT_FOUND
            and bool(call.version))


def clients_own(call: Call, reply: Reply, enough_s: float | None) -> bool:
    """Whether ``reply`` is a failure the client made:

    - NOT_FOUND for a call that named a model version: the version the client asked for does
      not exist (an unversioned NOT_FOUND, a model gone from the backend, stays the backend's);
    - DEADLINE_EXCEEDED under a deadline the client set shorter than ``enough_s`` (what a call
      on this path normally needs: a breaker's slow-call bar, a router path's mean latency;
      None: any deadline the client set), its budget ran out, the backend did not fail.
    """
    if missing_version(call, reply):
        return True
    if not isinstance(reply, LocalReply) or reply.kind is not ErrorKind.DEADLINE_EXCEEDED:
        return False
    asked = call.state.get(CLIENT_DEADLINE)
    if asked is None:
        return False
    return enough_s is None or asked - call.started < enough_s
