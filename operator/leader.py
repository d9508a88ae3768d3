"""One active operator among replicas: leader election on a coordination.k8s.io Lease.

The chart runs two operator replicas so that a lost one is replaced within seconds, not after
a pod reschedule. Exactly one may act: two would orchestrate the same switches. Each replica
is a candidate for the Lease ``--leader-lease`` in its own namespace (the kubernetes client's
:class:`~kubernetes.leaderelection.leaderelection.LeaderElection`, with its
:class:`~kubernetes.leaderelection.resourcelock.leaselock.LeaseLock`: updates carry the
object's resourceVersion, so two candidates can never both win). A candidate waits until the
Lease is free or its holder stopped renewing it for ``lease_seconds`` (judged on this
replica's own clock from when it last saw the record change, so clocks need not agree); then
it renews it every ``retry_seconds`` and runs the operator.

A leader that cannot renew within ``renew_seconds`` (cut off from the apiserver) exits at
once: after ``lease_seconds`` another replica may take over, and two must never act. A leader
that stops cleanly (SIGTERM on a rollout) releases the Lease, so the standby takes over at
once instead of waiting the lease out. A replica that takes over adopts each running job
from its agents (:meth:`~dynatrain.controller.core.JobController.adopt`), finishing a switch
whose Commit had gone out and aborting one that was only prepared.

This replaces kopf's peering, under which replicas of equal priority all pause, and a
restarted operator waits out its dead predecessor's peering lifetime (60 s).
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from kubernetes.client.rest import ApiException
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

# The client's election logs every retry at INFO ("yet to finish lease_duration ...").
logging.getLogger("leaderelection").setLevel(logging.WARNING)

DEFAULT_LEASE_SECONDS = 10
"""A dead leader is replaced after at most this long (plus one retry)."""


def identity() -> str:
    """This replica's name in the Lease: its pod name, else host and process id."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


class Election:
    def __init__(self, name: str, namespace: str, *, lease_seconds: int = DEFAULT_LEASE_SECONDS,
                 who: str | None = None):
        if lease_seconds < 3:
            raise ValueError(f"lease_seconds={lease_seconds} must be at least 3 (a leader "
                             "renews every second or more, and must get two tries in)")
        self.who = who or identity()
        self.lock = LeaseLock(name, namespace, self.who)
        retry = max(1.0, lease_seconds / 5)
        renew = lease_seconds * 0.7
        self.config = electionconfig.Config(
            self.lock, lease_duration=lease_seconds, renew_deadline=renew,
            retry_period=retry, onstarted_leading=lambda: None, onstopped_leading=None)
        self.election = leaderelection.LeaderElection(self.config)
        self.name, self.namespace = name, namespace

    def acquire(self) -> None:
        """Block until this replica holds the Lease."""
        print(f"leader election: {self.who} waiting for Lease {self.namespace}/{self.name}",
              flush=True)
        self.election.acquire()
        print(f"leader election: {self.who} leads (Lease {self.namespace}/{self.name})",
              flush=True)

    def keep(self, on_lost) -> threading.Thread:
        """Renew the Lease in the background; ``on_lost()`` when a renewal fails for
        ``renew_seconds`` (the caller must stop acting at once)."""
        def renew():
            self.election.renew_loop()
            print(f"leader election: {self.who} lost Lease {self.namespace}/{self.name}",
                  flush=True)
            on_lost()

        t = threading.Thread(target=renew, name="dynatrain-lease", daemon=True)
        t.start()
        return t

    def release(self) -> None:
        """Give the Lease up (a clean stop): the standby takes over without waiting. The
        update carries the resourceVersion read here, so it never clears a new holder."""
        found, _ = self.lock.get(self.name, self.namespace)
        lease = self.lock.lease_reference
        if not found or lease.spec is None or lease.spec.holder_identity != self.who:
            return
        lease.spec.holder_identity = ""
        try:
            self.lock.api_instance.replace_namespaced_lease(self.name, self.namespace, lease)
        except ApiException as e:
            print(f"leader election: releasing the Lease failed ({e.status} {e.reason}); "
                  "the standby takes over when it expires", flush=True)
            return
        print(f"leader election: {self.who} released Lease {self.namespace}/{self.name}",
              flush=True)
