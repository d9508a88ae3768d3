"""Recovery from unplanned failures: bringing a job back after devices died without notice.

:func:`recover` (a tick's :class:`.decide.Recover`) first checks whether the survivors already
run a newer generation (:func:`reconcile`), then asks the policy for a layout over the devices
left, picks the newest step whose state survives in memory (every survivor's snapshot, the
failed devices' unique state from their buddies' mirrors; :func:`.decide.choose_restore`), or
of the generation before the last switch (:func:`previous_restore`), or else the newest
checkpoint, and runs the restoring switch. These functions work on a
:class:`.core.JobController`'s state and call its switch machinery.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from dynatrain.agent.client import AgentCallError
from dynatrain.agent.v1 import agent_pb2 as pb
from dynatrain.vps.layout import Layout

from .decide import GiveUp, choose_restore
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
    choice = choose_restore(ctl.job.model, old, new, failed, holdings,
                            devices_per_node=ctl._nodes_for(old, new))
    start, dead, earlier = old, failed, ""
    if choice is None:
        found = previous_restore(ctl, new, holdings)
        if found is not None:
            start, dead, choice = found
            earlier = (f" of the generation before the last switch ({start.to_text()} on "
                       f"{list(start.device_of)}; the running one has no whole copy yet)")
    lost_from = ctl.progress.step
    ctl.generation += 1
    if choice is not None:
        restore = Restore(choice[0], dead, choice[1])
        what = (f"restoring step {restore.step}{earlier} from memory"
                + (f" (mirrors of {sorted(restore.proxies)} on "
                   f"{[restore.proxies[k] for k in sorted(restore.proxies)]})"
                   if restore.proxies else ""))
        ctl.log(f"recovering: {_text(old)} -> {new.to_text()}, {what}")
        kw = dict(restore=restore)
    else:
        ckpt = max(((st.checkpoint_step, st.checkpoint) for st in holdings.values()
                    if st.checkpoint), default=None)
        if ckpt is None:
            raise JobFailed(
                f"devices {list(failed)} failed and no copy of their state survives in "
                f"memory (their buddies are gone too, or spec.recovery.mirror is off), and "
                f"there is no checkpoint to fall back on (set spec.checkpoint."
                f"intervalSteps); the job stops at step {ctl.progress.step}")
        ctl.log(f"recovering: no in-memory copy of the state of {list(failed)} survives; "
                f"restarting {new.to_text()} from checkpoint {ckpt[1]} (step {ckpt[0]})")
        kw = dict(checkpoint=ckpt[1])
        start = None
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
    record.phases["from_checkpoint"] = 0.0 if choice is not None else 1.0
    ctl._rewind(record.step)
    ctl._infer_unreported_reads(record.step)
    ctl._after_switch(old, new, record, recovered=True,
                      displaced=f"superseded by the failure of devices {list(failed)} "
                                f"(recovered to {new.to_text()} at step {record.step}): "
                                "re-requested after the recovery")
    ctl.interrupted_since = None
    ctl.recoveries.append(record)
    return record


def previous_restore(ctl: JobController, new: Layout, holdings: dict):
    """Recovery from the generation before the running one, whose snapshots its members
    keep for two steps after a planned switch (and a member whose switch out of it failed
    still holds as its own): (its layout, its devices that are gone, (step, proxies)), or
    None. The way back when the running generation holds no whole copy yet (a member that
    just joined and has not mirrored its state, a new stage)."""
    from types import SimpleNamespace

    from dynatrain.vps.layout import parse_layout

    kept = {d: st for d, st in holdings.items() if st.previous_generation}
    if not kept:
        return None
    g = max(st.previous_generation for st in kept.values())
    lead = next(st for st in kept.values() if st.previous_generation == g)
    prev = parse_layout(lead.previous_layout).with_devices(lead.previous_devices)
    held = {d: SimpleNamespace(snapshot_steps=list(st.previous_snapshot_steps),
                               mirror_of=st.previous_mirror_of,
                               mirror_steps=list(st.previous_mirror_steps))
            for d, st in kept.items() if st.previous_generation == g}
    for d, st in holdings.items():
        # A member whose own switch out of generation g failed (e.g. in the mirror exchange
        # with a joiner that died as its part ended) still runs g: its snapshots are g's, and
        # the worker restores from them for g's layout (WorkerControl.redundancy_for).
        if d not in held and st.generation == g and st.layout == lead.previous_layout \
                and tuple(st.devices) == tuple(lead.previous_devices):
            held[d] = SimpleNamespace(snapshot_steps=list(st.snapshot_steps),
                                      mirror_of=st.mirror_of,
                                      mirror_steps=list(st.mirror_steps))
    dead = tuple(sorted(d for d in prev.device_of if d not in held))
    choice = choose_restore(ctl.job.model, prev, new, dead, held,
                            devices_per_node=ctl._nodes_for(prev, new))
    return (prev, dead, choice) if choice is not None else None


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
