"""The job's worker pods: which of them are its workers, making them, replacing, deleting.

A :class:`WorkerPods` reads the job's pods from the operator's shared watch (pods of a
previous job of the same name are deleted, pods this job's operators did not create are
never trusted: their UIDs are not in ``status.workerUIDs``), replaces unhealthy ones with
back-off (the ``WorkersHealthy`` condition), creates pods up to the job's target while the
image is allowed and at most ``--max-pods-per-job`` (``ImageAllowed``, ``PodsCreated``,
``Schedulable``), sheds idle pods over the target, and deletes them when the job ends.

It is a room of its own because the pods' bookkeeping (what was created and not yet seen,
what is being deleted, whom to trust, which device id comes next) is state nothing else in
the runtime reads; the runtime's coordinator (:class:`~.runtime.JobRuntime`) decides when,
and hands the controller what comes of it. It is given what it uses explicitly rather than
the whole runtime.
"""

from __future__ import annotations

import random
import time

from kubernetes.client.rest import ApiException

from dynatrain.controller import decide
from dynatrain.controller import inbox as ev

from . import cluster as k
from . import guard, pki
from .basics import Backoff, JobContext, Room, api_message as _api_message


KUEUE_READ_S = 10.0
"""How often a job with queued pods reads their Workloads (why Kueue holds them)."""
KUEUE_READ_PODS = 32
"""The most pods whose Workloads one read asks for (the label selector's length)."""


class WorkerPods(Room):
    """One job's worker pods (see the module's docstring)."""

    def __init__(self, ctx: JobContext, *, view, secret_name, publish, worker_uids: set[str],
                 kueue=None):
        super().__init__(ctx)
        self.view = view
        self.kueue = kueue
        """A CustomObjectsApi for Kueue's Workloads (why a queued pod waits), or None."""
        self._kueue_read: tuple[float, dict[str, str]] = (float("-inf"), {})
        """(when, pod UID -> Kueue's reason) of the last read of the Workloads."""
        self._kueue_warned = False
        self._secret_name = secret_name
        """() -> the name of the Secret with the agents' token (the runtime's objects pass)."""
        self._publish = publish
        """(force) -> the status patched (a created pod's UID is kept there at once)."""
        settings = ctx.settings
        self.creation = Backoff(settings.backoff_first_s * 5, settings.backoff_max_s)
        self.replacing = Backoff(settings.replace_backoff_first_s, settings.replace_backoff_max_s)
        self.replaced = 0
        self.left: set[int] = set()
        """Devices whose pods were deleted or failed: never taken back in."""
        self.expected: dict[str, float] = {}
        """Pods created and not yet seen by the watch: name -> when."""
        self.deleting: dict[str, float] = {}
        """Pods this runtime deleted, until the watch sees them go."""
        self.warned: set[str] = set()
        self.worker_uids: set[str] = worker_uids
        """UIDs of the pods this job's operators created (``status.workerUIDs``, which the
        job's owners cannot write): only these pods get the token and a client."""
        self.uid_born: dict[str, float] = {}
        """UIDs created by this runtime -> when: kept while the watch has not shown them."""
        self.untrusted: set[str] = set()
        self.short_since: float | None = None
        """Since when the job, not started, holds part of its minimum (the gang wait)."""
        self.next_device = 0
        """Device ids are never reused within a job (a restarted operator starts after the
        highest id it finds)."""

    @property
    def secret_name(self) -> str:
        return self._secret_name()

    # -- which pods are the job's workers ---------------------------------------------------------
    def _distrust(self, pod) -> None:
        """A pod with the job's labels and owner that this job's operators did not create
        (its UID is not in ``status.workerUIDs``): no token, no client, never added. Said
        once per pod, in the log and as an Event."""
        name = pod.metadata.name
        if name in self.untrusted:
            return
        self.untrusted.add(name)
        text = (f"pod {name} (uid {pod.metadata.uid}) has the job's labels but the operator "
                "did not create it: it gets no token and is never a worker; delete it")
        self.log(f"job {self.name}: {text}")
        self._event("Warning", "UntrustedPod", text)

    def workers(self, nodes, now: float) -> dict[int, k.WorkerPod]:
        """This job's worker pods by device, from the watch (pods of a previous job of the
        same name are deleted, never counted)."""
        workers: dict[int, k.WorkerPod] = {}
        seen, seen_uids = set(), set()
        for p in self.view.job_pods(self.namespace, self.name):
            name = p.metadata.name
            seen.add(name)
            seen_uids.add(p.metadata.uid)
            if not k.owned_by(p, self.uid):
                owner = k.foreign_owner(p, self.uid)
                if owner.startswith("a previous DynaTrainJob") and name not in self.deleting:
                    self.log(f"job {self.name}: pod {name} belongs to {owner}: deleting it")
                    self.delete_pod(name, grace=0)
                elif not owner.startswith("a previous") and name not in self.warned:
                    self.warned.add(name)
                    self.log(f"job {self.name}: pod {name} has the job's label but belongs "
                             f"to {owner}: ignored")
                continue
            device = k.device_of(p)
            if device is None:
                if name not in self.warned:
                    self.warned.add(name)
                    self.log(f"job {self.name}: pod {name} has no valid {k.DEVICE_LABEL} "
                             "label: ignored")
                continue
            self.next_device = max(self.next_device, device + 1)
            if name in self.deleting:
                continue
            if p.metadata.uid not in self.worker_uids:
                self._distrust(p)
                continue
            workers[device] = k.read_worker(p, nodes)
        for name, when in list(self.expected.items()):
            if name in seen or now - when > 60:
                del self.expected[name]
        for name, when in list(self.deleting.items()):
            if name not in seen or now - when > 600:
                del self.deleting[name]
        for uid in list(self.uid_born):          # shown by the watch, or long gone
            if uid in seen_uids or now - self.uid_born[uid] > 60:
                del self.uid_born[uid]
        # UIDs of pods that are gone (not those just created: the watch may not show them yet)
        self.worker_uids -= self.worker_uids - seen_uids - set(self.uid_born)
        return workers

    def replace(self, w: k.WorkerPod) -> None:
        """An unhealthy worker pod: its device is failed (recovered from memory if it was a
        member) or forgotten, the pod deleted, and the next pod created after a back-off."""
        c = self.controller
        d = w.device
        left_out = d in c.slow and d not in c.members
        if d in c.leaving or left_out:
            # The worker left the job: the switch in flight takes it out (a shrink, a release;
            # it exits as its part ends), or a switch already made left it out as a straggler.
            # Either can be seen here before the switch's record: no replacement, no back-off.
            c.push(ev.DeviceFailed(d, f"its pod ended ({w.unhealthy}) as a switch took it out"))
            # (the controller counts it a failure only if the switch in flight fails)
            self.left.add(d)
            self.delete_pod(w.name)
            why = ("left out as slower than its peers" if left_out
                   else f"left in the switch in flight ({w.unhealthy})")
            self.log(f"job {self.name}: worker {d} (pod {w.name}) {why}: pod deleted")
            return
        if decide.exit_is_failure(member=d in c.members, released=d in self.left, code=None):
            c.push(ev.DeviceFailed(d, f"its pod is unhealthy: {w.unhealthy}"))
        elif d in c.state.agents:
            c.push(ev.DeviceLeft(d))
        self.left.add(d)
        self.delete_pod(w.name)
        self.replaced += 1
        delay = self.replacing.fail()
        text = (f"worker {d} (pod {w.name}) was unhealthy: {w.unhealthy}; deleted and "
                f"replaced ({self.replaced} so far); the next worker pod in {delay:.0f} s")
        self.conditions.set("WorkersHealthy", False, "WorkerReplaced", text, self._generation())
        self._event("Warning", "WorkerReplaced", text)
        self.log(f"job {self.name}: {text}")

    def target(self) -> int:
        """The workers the job would use: its maxWorkers (or ``kubectl scale``'s count), those
        that pay off under spec.elastic.minEfficiency (the policy's count)."""
        c = self.controller
        return c.policy.efficient_workers(self.job, c.decision_profile,
                                          self.job.workers or self.job.max_workers)

    def wanted(self) -> int:
        """The worker pods the job wants: :meth:`target`, at most --max-pods-per-job."""
        return min(self.target(), self.settings.max_pods_per_job)

    def scale(self, workers, nodes, share=None) -> None:
        """Create the worker pods the job could use, up to its target and the per-job cap; the
        scheduler places them. A pod it cannot place stays Pending: the job's unmet demand,
        which a cluster autoscaler sees, while the job trains on the pods that run (and grows
        live when the others do). Capacity is never counted here: the scheduler knows the
        taints, selectors, affinity and priorities, and says why a pod waits. While the job's
        pool is shared with a job waiting below its share (``share``, :mod:`.sharing`), the
        target is the job's share: pods over it are deleted, unplaced ones first."""
        gen, s = self._generation(), self.settings
        refused = guard.check_image(self.job.image, s.allowed_images)
        if refused:        # before any pod: the job waits (an admin may widen the list)
            if self.conditions.set("ImageAllowed", False, "ImageNotAllowed", refused, gen):
                self._event("Warning", "ImageNotAllowed", refused)
            return
        self.conditions.set("ImageAllowed", True, "Allowed", "any image" if not
                            s.allowed_images else "matches --allowed-images", gen)
        target = self.target()
        want = min(target, s.max_pods_per_job)
        if share is not None:
            want = share.cap(want)
        alive = [w for w in workers.values() if not w.doomed and w.device not in self.left]
        if len(alive) > want:
            self._shed(alive, len(alive) - want)
        self._report_unscheduled(alive, gen)
        self._report_queued(alive, gen)
        if self._release_partial_gang(alive):
            return
        if self.expected or len(alive) >= want:
            return
        if self.replacing.waiting or self.creation.waiting:
            return
        count = min(want - len(alive), s.create_batch)
        capped = (f"; capped at the operator's {s.max_pods_per_job} pods per job "
                  f"(--max-pods-per-job)" if target > s.max_pods_per_job else "")
        for _ in range(max(0, count)):
            device = self.next_device
            pod = k.worker_pod(self.body, device, secret=self.secret_name,
                               agent_port=self.job.agent_port,
                               defaults=(s.worker_cpu, s.worker_memory),
                               tls_items=pki.CERT_MANAGER_TLS_ITEMS if self.job.issuer_ref
                               else None)
            try:
                made = self.core.create_namespaced_pod(self.namespace, pod)
            except ApiException as e:
                if e.status not in (403, 422, 409):
                    raise
                delay = self.creation.fail()
                reason = ("QuotaExceeded" if "quota" in _api_message(e).lower() else
                          "Invalid" if e.status == 422 else
                          "AlreadyExists" if e.status == 409 else "Forbidden")
                text = (f"creating worker pod {pod['metadata']['name']} was refused: "
                        f"{_api_message(e)}; retrying in {delay:.0f} s")
                if self.conditions.set("PodsCreated", False, reason, text, gen):
                    self._event("Warning", reason, text)
                self.log(f"job {self.name}: {text}")
                if e.status == 409:       # a pod of that name exists: take the next id
                    self.next_device += 1
                return
            self.next_device += 1
            self.expected[pod["metadata"]["name"]] = time.monotonic()
            # Trusted by the UID the apiserver gave it, kept where a restarted operator (or
            # a new leader) reads it back: the status, at once.
            self.worker_uids.add(made.metadata.uid)
            self.uid_born[made.metadata.uid] = time.monotonic()
            self._publish(force=True)
            self.log(f"worker {device}: pod created")
        if count > 0 or not capped:
            self.creation.reset()
            self.conditions.set("PodsCreated", True, "Created" if not capped else "Capped",
                                f"{len(alive) + max(0, count)} worker pods{capped}", gen)

    def _report_unscheduled(self, alive, gen: int) -> None:
        """The ``Schedulable`` condition: False, with the scheduler's own message, while some
        worker pods wait for a node; an Event when they start to wait."""
        waiting = [w for w in alive if w.unschedulable]
        if not waiting:
            self.conditions.set("Schedulable", True, "Scheduled", "every worker pod is placed",
                                gen)
            return
        text = (f"{len(waiting)} of {len(alive)} worker pods wait for a node (the job trains "
                f"on the others): {waiting[0].name}: {waiting[0].unschedulable}")
        was = self.conditions.get("Schedulable")
        self.conditions.set("Schedulable", False, "Unschedulable", text, gen)
        if not was or was["status"] == "True":      # one Event when pods start to wait
            self._event("Warning", "Unschedulable", text)

    def _release_partial_gang(self, alive) -> bool:
        """A job that has not started, holding part of its minimum while its other pods wait
        (for a node, or for Kueue's quota) for longer than ``--gang-wait``, lets go of every
        pod (so the GPUs or quota it held go to jobs that can run) and creates them again
        after a back-off with jitter: it never holds GPUs while it cannot train. True if it
        let go now."""
        c, now = self.controller, time.monotonic()
        held = [w for w in alive if w.node]
        waiting = [w for w in alive if not w.node]
        if c.layout is not None or not held or not waiting \
                or len(held) >= self.job.min_workers:
            self.short_since = None
            return False
        if self.short_since is None:
            self.short_since = now
        if now - self.short_since < self.settings.gang_wait_s:
            return False
        self.short_since = None
        delay = self.creation.fail() * random.uniform(1.0, 1.5)
        self.creation.until = now + delay
        why = next((w.unschedulable for w in waiting if w.unschedulable), "") or (
            "Kueue's quota" if any(w.queued for w in waiting) else "a node")
        text = (f"holds {len(held)} of its minimum {self.job.min_workers} workers while "
                f"{len(waiting)} wait ({why}) for over {self.settings.gang_wait_s:g} s "
                f"(--gang-wait): lets all of them go, so that what it holds serves a job "
                f"that can run; its pods are created again in {delay:.0f} s")
        self._event("Normal", "GangReleased", text)
        self.log(f"job {self.name}: {text}")
        for w in alive:
            self.left.add(w.device)
            if w.device in c.state.agents:
                c.push(ev.DeviceLeft(w.device))
            self.delete_pod(w.name)
        return True

    def _report_queued(self, alive, gen: int) -> None:
        """The ``Admitted`` condition of a job with ``spec.queueName``: False while Kueue holds
        some of its worker pods for quota (its scheduling gate), with an Event when they start
        to wait; True once it has admitted them all."""
        queue = self.body["spec"].get("queueName")
        if not queue:
            return
        waiting = [w for w in alive if w.queued]
        if not waiting:
            if alive:
                self.conditions.set("Admitted", True, "Admitted", f"Kueue admitted every "
                                    f"worker pod (LocalQueue {queue})", gen)
            return
        why = self._kueue_why(waiting)
        text = (f"{len(waiting)} of {len(alive)} worker pods wait for Kueue to admit them "
                f"(LocalQueue {queue}: " + (f"Kueue says: {why}" if why else "quota")
                + "); the job trains on the others")
        was = self.conditions.get("Admitted")
        self.conditions.set("Admitted", False, "QuotaWait", text, gen)
        if not was or was["status"] == "True":
            self._event("Normal", "QuotaWait", text)

    def _kueue_why(self, waiting) -> str:
        """Kueue's own words for why these pods wait (their Workloads' ``QuotaReserved``
        message), read at most every :data:`KUEUE_READ_S`; "" when it has none or cannot be
        read (a missing rule is logged once: the chart grants ``list`` on Workloads)."""
        now = time.monotonic()
        if self.kueue is None:
            return ""
        if now - self._kueue_read[0] >= KUEUE_READ_S:
            uids = sorted(w.uid for w in waiting if w.uid)[:KUEUE_READ_PODS]
            group, version, plural = k.KUEUE_WORKLOADS
            try:
                items = self.kueue.list_namespaced_custom_object(
                    group, version, self.namespace, plural,
                    label_selector=f"{k.KUEUE_JOB_UID_LABEL} in ({','.join(uids)})")["items"]
                self._kueue_read = (now, k.kueue_waits(items))
            except ApiException as e:
                self._kueue_read = (now, {})
                if not self._kueue_warned:
                    self._kueue_warned = True
                    self.log(f"job {self.name}: cannot read Kueue's Workloads ({e.status} "
                             f"{e.reason}: {_api_message(e)}); the Admitted condition says "
                             "only that pods wait for quota")
        whys = {self._kueue_read[1].get(w.uid) for w in waiting} - {None, ""}
        return "; ".join(sorted(whys))

    def _shed(self, alive, surplus: int) -> None:
        """More worker pods than wanted (``kubectl scale`` down): delete pods that hold no
        part of the job, newest first. Members are left to the policy, which switches them
        out live (keeping the devices that move the fewest bytes); their pods are deleted once
        the switch is done (:meth:`~.runtime.JobRuntime._switched`)."""
        c = self.controller
        idle = sorted((w for w in alive if w.device not in c.members),
                      key=lambda w: (bool(w.node), -w.device))     # unplaced ones first
        for w in idle[:surplus]:
            self.log(f"worker {w.device}: pod {w.name} deleted: the job wants "
                     f"{len(alive) - surplus} workers")
            self.left.add(w.device)
            if w.device in c.state.agents:
                c.push(ev.DeviceLeft(w.device))
            self.delete_pod(w.name)

    # -- deleting --------------------------------------------------------------------------------
    def stop_workers(self) -> None:
        """The job was deleted: its workers have nothing left to hand over, and would train
        on (SIGTERM is notice) until their grace period ends. Delete their pods with grace 0
        (also those the garbage collector is deleting already: a shorter grace wins)."""
        try:
            for p in self.view.job_pods(self.namespace, self.name):
                if k.owned_by(p, self.uid):
                    self.log(f"job {self.name} deleted: stopping pod {p.metadata.name}")
                    self.delete_pod(p.metadata.name, grace=0)
        except ApiException as e:
            self.log(f"job {self.name}: stopping its pods failed ({e.status} {e.reason}); "
                     "they stop when their grace period ends")

    def delete_all_pods(self, why: str, grace: int | None = None) -> None:
        for p in self.view.job_pods(self.namespace, self.name):
            if (k.owned_by(p, self.uid) and p.metadata.deletion_timestamp is None
                    and (grace is not None or p.metadata.name not in self.deleting)):
                self.log(f"job {self.name}: deleting pod {p.metadata.name}: {why}")
                self.delete_pod(p.metadata.name, grace=grace)

    def delete_pod(self, name: str, grace: int | None = None) -> None:
        """With the pod's grace period: its worker gets SIGTERM and exits cleanly (one that
        left has nothing to lose; a standby one holds no state)."""
        self.deleting[name] = time.monotonic()
        try:
            self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=grace)
        except ApiException as e:
            if e.status != 404:
                raise

