"""What a job shows: its status, its conditions, its data audit and its Events.

A :class:`Report` keeps the job's :class:`Conditions`, patches ``status`` when it changed
(progress alone at most every ``status_every_s``), recomputes the data audit of
``status.data`` and records Events on the job. It is a module of its own because every other
room of the runtime (the spec, the objects, TLS, the pods) reports through it, and none of
them decides how and when the apiserver is told; :class:`~.runtime.JobRuntime` assembles the
status from its state and hands it to :meth:`Report.publish`.
"""

from __future__ import annotations

import datetime
import time
from datetime import timedelta

from kubernetes import client
from kubernetes.client.rest import ApiException

from .basics import now as _now

GROUP, VERSION, PLURAL = "dynatrain.io", "v1alpha1", "dynatrainjobs"
TERMINAL = ("Succeeded", "Failed")
AUDIT_EVERY_S = 5.0
"""How often the data audit in ``status.data`` is recomputed."""


class Conditions:
    """The job's status conditions by type, with transition times kept across passes."""

    def __init__(self, published: list[dict] | None = None):
        # The published ones, so a restarted operator keeps their transition times (and a
        # finished job its Complete or Failed).
        self.items: dict[str, dict] = {c["type"]: dict(c) for c in published or []
                                       if c.get("type")}

    def set(self, kind: str, ok: bool, reason: str, message: str = "",
            generation: int = 0) -> bool:
        """Returns whether the condition changed (status, reason or message)."""
        status = "True" if ok else "False"
        old = self.items.get(kind)
        if old and (old["status"], old["reason"], old["message"]) == (status, reason,
                                                                       message[:4000]):
            return False
        self.items[kind] = {
            "type": kind, "status": status, "reason": reason, "message": message[:4000],
            "observedGeneration": generation,
            "lastTransitionTime": old["lastTransitionTime"] if old and old["status"] == status
            else _now().isoformat()}
        return True

    def get(self, kind: str) -> dict | None:
        return self.items.get(kind)

    def as_list(self) -> list[dict]:
        return [self.items[t] for t in sorted(self.items)]


class Report:
    """The job's conditions, status patches and Events (see the module's docstring)."""

    def __init__(self, *, core: client.CoreV1Api, custom: client.CustomObjectsApi,
                 namespace: str, name: str, body, log, settings,
                 published_conditions: list[dict] | None = None):
        self.core, self.custom = core, custom
        self.namespace, self.name = namespace, name
        self._body = body
        """() -> the job's body as last read (it changes every pass)."""
        self.log = log
        self.settings = settings
        self.conditions = Conditions(published_conditions)
        self.data_audit: dict | None = None
        self.audited_at = float("-inf")
        self.published: dict | None = None
        self.published_at = 0.0

    def running_condition(self, phase: str, generation: int) -> None:
        """``Running``: True while the job trains (a switch included), False with the phase
        as the reason otherwise; with ``Complete`` and ``Failed`` (set when the job ends),
        what ``kubectl wait --for=condition=...`` waits on."""
        training = phase in ("Running", "Switching")
        self.conditions.set("Running", training, phase,
                            "training" if training else
                            "waiting for workers" if phase == "Pending" else
                            "suspended (spec.suspend)" if phase == "Suspended" else "ended",
                            generation)

    def audit(self, controller, job, took_over: bool) -> dict:
        """``status.data``: whether every step's batch was read exactly once (from the
        workers' own reports of their reads) and how many steps were trained twice. Over the
        steps this controller has records of (an adopted job: the workers' recent ones);
        recomputed at most every ``AUDIT_EVERY_S``."""
        now = time.monotonic()
        if self.data_audit is not None and now - self.audited_at < AUDIT_EVERY_S:
            return self.data_audit
        p = controller.progress
        known = set(p.reads) | set(p.inferred)
        # A job taken over mid-flight knows only each worker's window of recent reads, and
        # the windows need not start at the same step, so its earliest known step can be
        # partial: audit from the step after it. A job this operator started has every record.
        first = min(known) if known else p.step + 1
        since = first if took_over else first - 1
        last = controller.reported_step()
        problems = p.audit(job.global_batch_size, last, since=since)
        self.data_audit = {"auditedFrom": since + 1, "auditedStep": last,
                           "exactlyOnce": not problems, "retrainedSteps": p.retrained,
                           "problems": problems[:3]}
        self.audited_at = now
        return self.data_audit

    def publish(self, st: dict, force: bool = False) -> None:
        """Patch the status ``st`` when it changed; the step alone at most every
        status_every_s."""
        if st == self.published:
            return
        # Progress alone (step, loss, tokens/s) is patched at most
        # every status_every_s; anything else at once.
        progress = {"step": 0, "loss": 0, "tokensPerSecond": 0}
        only_step = (self.published is not None and
                     {**st, **progress} == {**self.published, **progress})
        if (only_step and not force
                and time.monotonic() - self.published_at < self.settings.status_every_s):
            return
        try:
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, self.name, {"status": st})
        except ApiException as e:
            if e.status != 404:
                self.log(f"status update failed: {e.status} {e.reason}")
            return
        self.published, self.published_at = st, time.monotonic()

    def event(self, kind: str, reason: str, message: str) -> None:
        meta = self._body()["metadata"]
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{self.name}."),
            involved_object=client.V1ObjectReference(
                api_version=f"{GROUP}/{VERSION}", kind="DynaTrainJob", name=self.name,
                namespace=self.namespace, uid=meta.get("uid")),
            reason=reason, message=message[:1000], type=kind,
            first_timestamp=_now(), last_timestamp=_now(), count=1,
            source=client.V1EventSource(component="dynatrain-operator"))
        try:
            self.core.create_namespaced_event(self.namespace, event)
        except ApiException as e:
            self.log(f"event not recorded: {e.reason}")


def seconds_to_expiry(body: dict, now: datetime.datetime | None = None) -> float | None:
    """Seconds until a finished job's ``spec.ttlSecondsAfterFinished`` passes (<= 0: due),
    counted from its Complete or Failed condition's transition, as for a batch Job; None for
    a job that has not finished or sets no TTL."""
    ttl = (body.get("spec") or {}).get("ttlSecondsAfterFinished")
    status = body.get("status") or {}
    end = next((c for c in status.get("conditions") or []
                if c.get("type") in ("Complete", "Failed") and c.get("status") == "True"),
               None)
    if ttl is None or status.get("phase") not in TERMINAL or end is None:
        return None
    ended = datetime.datetime.fromisoformat(end["lastTransitionTime"].replace("Z", "+00:00"))
    return (ended + timedelta(seconds=ttl) - (now or _now())).total_seconds()

