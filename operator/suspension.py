"""A job held at a checkpoint with no workers: ``spec.suspend``, and parking under its minimum.

Two ways lead a training job to hold no GPU while it keeps its training:

- **Suspend** (``spec.suspend: true``, the user's or Kueue-style tooling's call): every member
  writes one checkpoint at a step they agree on (to the job's ``spec.checkpoint`` claim), the
  pods go, and the job stays ``Suspended`` until the field is false again; then it creates pods
  and continues from that checkpoint under whatever layout fits them.
- **Park** (the controller's :class:`~dynatrain.controller.decide.Park`): notices (the
  scheduler's preemption for a higher priority, Kueue's, a drain) leave fewer workers than
  ``spec.elastic.minWorkers``, so no layout fits. Every member, the ones with a notice inside
  their grace period too, writes one checkpoint; the pods go, so the job holds no GPU while it
  cannot train, and it waits ``Pending`` like any job short of its minimum (the share rule,
  the gang release); once the minimum is up it continues from there. Condition ``Suspended``,
  reason ``BelowMinimum``, then ``Resumed``.

Either way the checkpoint is kept in ``status.suspension`` ({checkpoint, step, time}), so a
restarted operator (a new leader) continues from it, and cleared once the job has started
from it. A room of its own: the runtime's coordinator (:class:`~.runtime.JobRuntime`) owns the
phase and the pass, and acts on what :meth:`Suspension.suspended` and :meth:`Suspension.park`
return.
"""

from __future__ import annotations

from dynatrain.controller import inbox as ev
from dynatrain.controller.errors import SuspendFailed

from .basics import JobContext, Room, now as _now

BELOW_MINIMUM = "BelowMinimum"
"""The ``Suspended`` condition's reason while a job is parked under its minimum."""


class Suspension(Room):
    """One job's suspend and park (see the module's docstring)."""

    def __init__(self, ctx: JobContext, *, pods, publish_phase, published: dict | None):
        super().__init__(ctx)
        self.pods = pods
        self._publish_phase = publish_phase
        """(phase) -> the job's phase set and its status patched at once (the checkpoint is
        kept, with the phase and the condition, before the pods go)."""
        self.checkpoint: dict | None = published
        """``status.suspension`` ({checkpoint, step, time}): where the job continues from,
        kept until it has started from it."""

    # -- spec.suspend -----------------------------------------------------------------------------
    def suspended(self, phase: str) -> str:
        """``spec.suspend`` against the job's ``phase``: "suspended" while it holds the job
        (the pass ends; the pods are gone), "resumed" on the pass it was set back to false
        (the job waits for its pods as a new one does), "" otherwise (it trains on; a suspend
        whose checkpoint cannot be written yet is retried on the next pass)."""
        c, gen = self.controller, self._generation()
        if not self.job.suspend:
            if phase != "Suspended":
                return ""
            text = (f"continuing from the checkpoint of step {self.checkpoint['step']}"
                    if self.checkpoint else "starting")
            self.conditions.set("Suspended", False, "Resumed", text, gen)
            self._event("Normal", "Resumed", text)
            self.log(f"job {self.name}: resumed: {text}")
            return "resumed"
        wrote = False
        if c.layout is not None:          # training: its state goes to the claim first
            if not self.job.recovery.checkpoint_dir:
                text = ("spec.suspend is set, but the job has no spec.checkpoint claim to "
                        "write its state to, so suspending would lose its training: it trains "
                        "on (delete the job, or run it again with spec.checkpoint)")
                if self.conditions.set("Suspended", False, "NoCheckpointClaim", text, gen):
                    self._event("Warning", "NoCheckpointClaim", text)
                return ""
            try:
                path, step = c.suspend()
            except SuspendFailed as e:
                text = f"the checkpoint of the suspend was not written: {e}; trying again"
                if self.conditions.set("Suspended", False, "CheckpointFailed", text, gen):
                    self._event("Warning", "CheckpointFailed", text)
                self.log(f"job {self.name}: {text}")
                return ""
            self._keep(path, step)
            c.restart_from(path, step)    # the clients go; resumed, it starts from there
            wrote = True
        text = ("no worker pods while spec.suspend is true" + (
            f"; the job continues from the checkpoint of step {self.checkpoint['step']} "
            f"({self.checkpoint['checkpoint']}) when it is set to false"
            if self.checkpoint else ""))
        changed = self.conditions.set("Suspended", True, "Suspended", text, gen)
        if wrote:
            # Kept before the pods go (nothing else holds it), and in one status with the
            # phase and the condition: a reader never sees the one without the other.
            self._publish_phase("Suspended")
        if changed:
            self._event("Normal", "Suspended", text)
            self.log(f"job {self.name}: suspended: {text}")
        for d in sorted(c.state.agents):  # pods not yet members (standby, joining)
            c.push(ev.DeviceLeft(d))
        c.take_in()
        # The default grace: a suspended worker holds nothing the checkpoint does not and
        # stops at once on SIGTERM.
        self.pods.delete_all_pods("the job is suspended")
        return "suspended"

    # -- under the minimum ------------------------------------------------------------------------
    def park(self, parked) -> None:
        """The controller parked the job (:attr:`~dynatrain.controller.core.JobController.parked`,
        its checkpoint written by every member): kept in the status, said on the job, and its
        pods deleted. The runtime then treats it as a job that has not started."""
        self.controller.parked = None
        self._keep(parked.checkpoint, parked.step)
        text = (f"{parked.why}: every worker wrote the checkpoint of step {parked.step} "
                f"({parked.checkpoint}); the job holds no workers and continues from there "
                f"once {self.job.min_workers} are up")
        self.conditions.set("Suspended", True, BELOW_MINIMUM, text, self._generation())
        self._publish_phase("Pending")   # the checkpoint is kept before the pods go
        self._event("Warning", BELOW_MINIMUM, text)
        self.log(f"job {self.name}: parked: {text}")
        self.pods.delete_all_pods("the job waits below its minimum")

    def started(self, workers: int) -> None:
        """The job's first generation started (from the checkpoint, if one is kept): a parked
        job says it resumed; the checkpoints go on as usual."""
        cond = self.conditions.get("Suspended") or {}
        if self.checkpoint and cond.get("status") == "True" and \
                cond.get("reason") == BELOW_MINIMUM:
            text = (f"continued from the checkpoint of step {self.checkpoint['step']} on "
                    f"{workers} workers")
            self.conditions.set("Suspended", False, "Resumed", text, self._generation())
            self._event("Normal", "Resumed", text)
        self.checkpoint = None

    def _keep(self, path: str, step: int) -> None:
        self.checkpoint = {"checkpoint": path, "step": step, "time": _now().isoformat()}
