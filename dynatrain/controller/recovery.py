"""Recovery from unplanned failures: bringing a job back after devices died without notice.

:func:`recover` (a tick's :class:`.decide.Recover`) first checks whether the survivors already
run a newer generation (:func:`reconcile`), then asks the job's state where the job goes over
the devices left (:class:`.jobstate.PlaceRecovery`), asks the survivors what they hold and
the job's state what to restore from (:class:`.jobstate.Holdings`: the newest step whose state
survives in memory, every survivor's snapshot and the failed devices' unique state from their
buddies' mirrors; or of the generation before the last switch; or else the newest
checkpoint), and runs the restoring switch. These functions are the executor's: they do the
I/O and call the controller's switch machinery; the choices are :func:`.jobstate.decide`'s.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from dynatrain.agent.client import AgentCallError
from dynatrain.agent.v1 import agent_pb2 as pb

from .decide import GiveUp
from . import inbox as ev
from . import jobstate as js
from .errors import JobFailed, layout_text as _text
from .orchestrator import Restore, SwitchFailed, SwitchRecord

if TYPE_CHECKING:
    from .core import JobController

State = pb.StatusResponse.State


def recover(ctl: JobController) -> SwitchRecord | None:
    """Bring the job back after devices died without notice: a new layout over the
    devices left, started from the last step whose state survives in memory (every
    survivor's snapshot; the failed devices' unique state from their buddies' mirrors), or
    from the newest checkpoint when no in-memory copy survives."""
    if reconcile(ctl) and not ctl.failed and ctl.interrupted_since is None:
        ctl.metrics.set_layout(ctl.layout)
        ctl.metrics.set_generation(ctl.generation_running)
        return None                    # the survivors train on: nothing to recover
    old, t0 = ctl.layout, time.monotonic()
    ctl._apply(js.Progressed(ctl.progress.step))
    (placed,) = ctl._apply(js.PlaceRecovery(ctl.policy, ctl.decision_profile))
    if isinstance(placed, GiveUp):
        raise JobFailed(placed.why)
    new, failed = placed.layout, placed.failed
    ctl._decided("failure", new)
    holdings = {}
    for d in sorted(set(ctl.clients) & (set(old.device_of) | set(new.device_of)
                                        | set(ctl.previous_devices))):
        try:
            holdings[d] = ctl.clients[d].status(since_step=ctl._seen.get(d, 0),
                                                timeout_s=ctl.timeouts.watchdog_s)
        except AgentCallError as e:
            # Lost too: recover again over the devices that answer.
            ctl._apply(ev.DeviceFailed(d, "does not answer during the recovery from the "
                                          f"failure of devices {list(failed)}: {e}"))
            return None
        if d in old.device_of:
            ctl._ingest(d, holdings[d])        # steps reported since the last poll
    ctl._apply(js.Progressed(ctl.progress.step))
    (where,) = ctl._apply(js.Holdings(new, failed, holdings,
                                      tuple(sorted(ctl.device_nodes.items())),
                                      ctl.devices_per_node))
    if isinstance(where, GiveUp):
        raise JobFailed(where.why)
    lost_from = ctl.progress.step
    ctl.generation += 1
    if isinstance(where, js.RestoreFrom):
        start, dead = where.start, where.dead
        restore = Restore(where.step, dead, dict(where.proxies))
        what = (f"restoring step {restore.step}{where.earlier} from memory"
                + (f" (mirrors of {sorted(restore.proxies)} on "
                   f"{[restore.proxies[k] for k in sorted(restore.proxies)]})"
                   if restore.proxies else ""))
        ctl.log(f"recovering: {_text(old)} -> {new.to_text()}, {what}")
        kw = dict(restore=restore)
    else:
        ctl.log(f"recovering: no in-memory copy of the state of {list(failed)} survives; "
                f"restarting {new.to_text()} from checkpoint {where.path} (step {where.step})")
        kw = dict(checkpoint=where.path)
        start, dead = None, failed
    involved = (set(start.device_of if start else old.device_of) | set(new.device_of)) \
        - set(dead)
    try:
        record = ctl._run_switch(ctl.generation, start, new, "failure", involved, **kw)
    except SwitchFailed as e:
        ctl.metrics.observe_switch("failure", "aborted" if e.retryable else "failed",
                                   {}, 0)
        if e.superseded or (e.retryable and ctl._drop_unreachable(involved)):
            # A newer signal (another device lost, a notice on the target): recover again
            # at once over what is left; the snapshots are still there.
            ctl.log(f"recovery {_text(old)} -> {new.to_text()} superseded while "
                    f"preparing: {e}; recovering again")
            return None
        raise JobFailed(f"recovery {_text(old)} -> {new.to_text()} failed: {e}") from e
    record.from_layout = _text(old)
    record.phases["recovery_seconds"] = time.monotonic() - t0
    record.phases["restored_step"] = record.step
    record.phases["lost_steps"] = max(0, lost_from - record.step)
    record.phases["from_checkpoint"] = 0.0 if isinstance(where, js.RestoreFrom) else 1.0
    ctl._rewind(record.step)
    ctl._infer_unreported_reads(record.step)
    ctl._after_switch(old, new, record, recovered=True,
                      displaced=f"superseded by the failure of devices {list(failed)} "
                                f"(recovered to {new.to_text()} at step {record.step}): "
                                "re-requested after the recovery")
    ctl.interrupted_since = None
    ctl.recoveries.append(record)
    return record


def reconcile(ctl: JobController) -> bool:
    """A switch the controller saw fail may have completed on every survivor (the device
    that died had already done its part): then they run the new generation, and the
    recovery starts from that, not from the layout the controller last recorded."""
    from dynatrain.vps.layout import parse_layout

    seen = []
    for d in sorted(ctl.clients):
        try:
            st = ctl.clients[d].status(since_step=1 << 62,
                                       timeout_s=ctl.timeouts.status_s)
        except AgentCallError:
            continue
        if st.layout and st.state in (State.TRAINING, State.FINISHED, State.INTERRUPTED):
            seen.append((st.generation, st.layout, tuple(st.devices)))
    if not seen:
        return False
    generation, text, devices = max(seen)
    if generation > ctl.generation_running and ctl.layout is not None \
            and (text, devices) != (ctl.layout.to_text(), tuple(ctl.layout.device_of)):
        new = parse_layout(text).with_devices(devices)
        ctl.log(f"generation {generation} ({new.to_text()} on {list(devices)}) completed "
                "on the survivors; recovering from it")
        ctl.previous_devices = tuple(ctl.layout.device_of)
        ctl._apply(js.Reconciled(new, generation))
        ctl.generation_running = generation
        return True
    return False
