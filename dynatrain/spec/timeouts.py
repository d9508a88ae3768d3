"""The timeout hierarchy of a job (``spec.recovery.timeouts``), a plain value.

Apart from the orchestrator that waits by it, so the job spec's parser and the decisions
(:mod:`.decide`) read it without importing anything that talks to agents.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Timeouts:
    """The timeout hierarchy, shortest first (``spec.timeouts`` sets them; README "Timeouts"):
    a hung worker is found by the watchdog long before a collective, a switch or the job
    would give up on it."""

    status_s: float = 2.0
    """Deadline of one Status or health call: an agent that does not answer within it missed
    one (a loaded machine can be slow: one miss is not a failure)."""
    watchdog_s: float = 8.0
    """A member that answers no Status for this long (a hung or stopped process), or that
    makes no progress this long while its peers wait for it in a collective, is declared
    failed and recovered like a dead one."""
    group_s: float = 60.0
    """Timeout of every wait inside the generation's groups (transfer rounds included): the
    backstop for a hang the watchdog cannot attribute."""
    prepare_s: float = 60.0
    """Longest wait for every device to report the generation ready."""
    commit_s: float = 120.0
    """Longest wait for every device to switch after Commit."""
    give_up_s: float = 600.0
    """The job fails when it has trained no step for this long although it runs a layout
    (every shorter timeout above has had its chance to recover it)."""
