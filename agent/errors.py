"""The errors of the agent's protocol, each with the gRPC status it is answered with.

The request checks (:mod:`dynatrain.agent.requests`) raise them for a malformed request, the
training side (a :class:`~dynatrain.agent.server.Control`, such as
:class:`~dynatrain.agent.worker_control.WorkerControl`) for a call its state does not allow;
the servicer (:class:`~dynatrain.agent.server.AgentServicer`) answers each with its status.
They were defined in :mod:`dynatrain.agent.server`, which re-exports them.
"""

from __future__ import annotations

import grpc


class AgentError(Exception):
    """A rule of the agent's protocol was broken; ``code`` is the gRPC status to answer with.

    The control raises it (or a subclass) for anything the caller should learn about; the
    message becomes the status details, so it should name the value and what would be valid.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, code: grpc.StatusCode | None = None, message: str = ""):
        # Allow both AgentError(code, message) and Subclass(message).
        if isinstance(code, str) and not message:
            code, message = None, code
        if code is not None:
            self.code = code
        super().__init__(message)
        self.message = message


class PreconditionFailed(AgentError):
    """Wrong state for the call (busy, nothing prepared, stale or skipped generation)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class InvalidRequest(AgentError):
    """A request that is well-formed but does not fit this agent (e.g. a device it lacks)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class SwitchAborted(AgentError):
    """The switch failed on some device and was rolled back or abandoned."""

    code = grpc.StatusCode.ABORTED


class CommitTimeout(AgentError):
    """The Commit did not complete within its timeout."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class PermissionDenied(AgentError):
    """The caller may not ask for this (e.g. a rendezvous store that is not its own)."""

    code = grpc.StatusCode.PERMISSION_DENIED

