"""Taking over a job whose agents already run: :meth:`.core.JobController.adopt`.

A controller that restarts (a new operator leader, a restarted local runner) finds the job's
generation, layout and step from its agents' Status, and settles a switch the old controller
left between its two phases: finished if any agent already holds its Commit, else aborted.
The function works on the controller's state; :class:`.core.JobController` calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynatrain.agent.client import AgentCallError
from dynatrain.agent.v1 import agent_pb2 as pb

from . import jobstate as js
from .errors import JobFailed, layout_text as _text

if TYPE_CHECKING:
    from .core import JobController

State = pb.StatusResponse.State


def adopt(ctl: JobController) -> str:
    """Take over a job whose agents already run (the controller restarted).

    The running generation is the highest that any agent runs; its layout and devices come
    from those agents. A generation prepared but not switched is finished when every device
    of it is ready and one of them already holds its Commit (the old controller was inside
    phase two: the others must commit too, or the committed ones wait forever), and is
    aborted otherwise (phase one: nothing moved; the policy will decide again).
    Returns what was found, for the log.
    """
    statuses = {}
    for d, c in ctl.clients.items():
        try:
            statuses[d] = c.status(since_step=1 << 62)
        except AgentCallError:
            continue
    running = [st for st in statuses.values()
               if st.state in (State.TRAINING, State.FINISHED, State.SWITCHING)
               and st.generation > 0]
    ctl.generation = max([ctl.generation] + [st.generation for st in statuses.values()]
                         + [st.prepared_generation for st in statuses.values()] + [0])
    if not running:
        return "no running generation: starting fresh"
    top = max(st.generation for st in running)
    lead = next(st for st in running if st.generation == top and st.layout)
    from dynatrain.vps.layout import parse_layout

    ctl._apply(js.Adopted(parse_layout(lead.layout).with_devices(lead.devices)))
    ctl.generation_running = top
    for d in ctl.layout.device_of:
        if d in statuses:
            ctl._seen[d] = statuses[d].step
    ctl.progress.step = max(st.step for st in running)
    found = f"running generation {top}: {ctl.layout.to_text()} on {list(lead.devices)}"
    pending = {d: st for d, st in statuses.items() if st.prepared_generation > top}
    if not pending:
        return found
    g = max(st.prepared_generation for st in pending.values())
    sample = next(st for st in pending.values() if st.prepared_generation == g)
    new = parse_layout(sample.prepared_layout).with_devices(sample.prepared_devices)
    members = sorted(set(ctl.layout.device_of) | set(new.device_of))
    ready = all(d in pending and pending[d].prepared_generation == g
                and pending[d].prepared_ready for d in members)
    if ready and any(st.prepared_committed for st in pending.values()):
        from .orchestrator import _fan_out

        replies = _fan_out(lambda d: ctl.clients[d].commit(
            g, 0, timeout_s=ctl.timeouts.commit_s), members)
        bad = [(d, r) for d, r in zip(members, replies) if isinstance(r, Exception)]
        if bad:
            raise JobFailed(f"finishing generation {g} after a restart failed: {bad}")
        old = ctl.layout
        ctl._apply(js.Adopted(new))
        ctl.generation_running = g
        ctl.metrics.set_layout(new)
        ctl.metrics.set_generation(g)
        return found + f"; finished the committed switch to generation {g} ({_text(old)} " \
                       f"-> {new.to_text()})"
    for d, st in pending.items():
        try:
            ctl.clients[d].abort(st.prepared_generation, "controller restarted")
        except AgentCallError:
            pass
    return found + f"; aborted the uncommitted generation {g}"
