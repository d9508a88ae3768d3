"""The objects a job's workers need besides their pods, kept as the job says.

The agent token Secret (the operator's own, or the one ``spec.agent.authSecret`` names, which
must carry the label that is its owner's consent), the ConfigMap with the job manifest the
workers read, the headless Service, the NetworkPolicy (:mod:`.netpol`) and, through
:mod:`.jobtls`, the TLS material. Each is created when missing and patched when it differs;
one left by a previous job of the same name is replaced, one that somebody else owns makes
the job wait with a condition saying so. A room of :class:`~.runtime.JobRuntime` (#32: it was
part of that class).
"""

from __future__ import annotations

import base64
import secrets
import time

from kubernetes import client
from kubernetes.client.rest import ApiException

from dynatrain.controller.core import JobFailed
from dynatrain.spec.job import JobError

from . import cluster as k
from . import guard, netpol
from .basics import JobContext, Room, Waiting as _Waiting
from .basics import now as _now


class JobObjects(Room):
    """The job's Secret, ConfigMap, Service and NetworkPolicy; :attr:`token` and
    :attr:`secret_name` are the agent token and its Secret once :meth:`ensure` has run."""

    def __init__(self, ctx: JobContext, *, net, pki):
        super().__init__(ctx)
        self.net = net
        """The NetworkingV1Api."""
        self._pki = pki
        """() -> the job's :class:`~.jobtls.JobTls` (made after this room: it uses ours)."""
        self.token, self.secret_name = "", ""
        self.checked = float("-inf")
        """When :meth:`ensure` last went through every object (-inf: at the next pass)."""

    def ensure(self) -> None:
        """Every object the job needs, at most every ``objects_every_s`` (or when its PKI is
        due): the token Secret, the ConfigMap, the Service, the NetworkPolicy, the TLS."""
        if (time.monotonic() - self.checked < self.settings.objects_every_s
                and not (self._pki().pki_due is not None and _now() >= self._pki().pki_due)):
            return
        ns, body, names = self.namespace, self.body, k.names(self.name)
        secret = self.job.auth_secret
        if secret is None:
            secret = names["secret"]
            self.ensure_one(self.core.read_namespaced_secret, self.core.create_namespaced_secret,
                         self.core.delete_namespaced_secret, None, "Secret", secret,
                         lambda: k.token_secret(body, secrets.token_urlsafe(32)), None)
        self.secret_name = secret
        token_secret = self.core.read_namespaced_secret(secret, ns)
        # A Secret the job names must be labelled for it; the operator's own (made above,
        # labelled since, unlabelled if an older operator made it) is this job's already.
        refused = guard.check_auth_secret(token_secret, ns) if self.job.auth_secret else ""
        if refused:                # never mounted, never read: the job fails (the Secret's
            #                        label is its owner's consent; spec.agent cannot change)
            if self.conditions.set("AuthSecretAllowed", False, "SecretNotLabelled", refused,
                                   self._generation()):
                self._event("Warning", "SecretNotLabelled", refused)
            raise JobFailed(refused)
        self.conditions.set("AuthSecretAllowed", True, "Labelled",
                            f"{guard.AGENT_TOKEN_LABEL}=true", self._generation())
        data = token_secret.data or {}
        if "token" not in data:
            raise JobError(f"secret {ns}/{secret} (spec.agent.authSecret) has no key 'token'")
        self.token = base64.b64decode(data["token"]).decode().strip()
        self.ensure_one(self.core.read_namespaced_config_map, self.core.create_namespaced_config_map,
                     self.core.delete_namespaced_config_map,
                     self.core.patch_namespaced_config_map, "ConfigMap", names["configmap"],
                     lambda: k.spec_configmap(body), lambda obj, want: obj.data != want["data"])
        self.ensure_one(self.core.read_namespaced_service, self.core.create_namespaced_service,
                     self.core.delete_namespaced_service, self.core.patch_namespaced_service,
                     "Service", names["service"],
                     lambda: k.headless_service(body, self.job.agent_port),
                     lambda obj, want: sorted((p.name, p.port) for p in obj.spec.ports or [])
                     != sorted((p["name"], p["port"]) for p in want["spec"]["ports"]))
        if self.settings.network_policy:     # who may reach the workers (operator/netpol.py)
            s = self.settings
            self.ensure_one(self.net.read_namespaced_network_policy,
                         self.net.create_namespaced_network_policy,
                         self.net.delete_namespaced_network_policy,
                         self.net.patch_namespaced_network_policy,
                         "NetworkPolicy", netpol.policy_name(self.name),
                         lambda: netpol.worker_policy(
                             body, agent_port=self.job.agent_port,
                             operator_namespace=s.operator_namespace,
                             operator_pod_labels=s.operator_pod_labels,
                             metrics_namespaces=s.metrics_namespaces),
                         netpol.spec_differs)
        self._pki().ensure_pki()
        self.conditions.set("ObjectsReady", True, "Ready", "", self._generation())
        self.checked = time.monotonic()

    def ensure_one(self, read, create, delete, patch, kind: str, name: str, manifest, differs):
        """Make the object ``name`` this job's and as ``manifest()`` says.

        One of a previous job of the same name (its owner is another UID: the old job was
        deleted and this one created before the garbage collector got to it) is deleted and
        created anew; adopting it would let the collector delete it under this job. One that
        no DynaTrainJob owns is somebody else's: the job waits, with a condition saying so.
        """
        ns = self.namespace
        try:
            obj = read(name, ns)
        except ApiException as e:
            if e.status != 404:
                raise
            obj = None
        if obj is not None:
            owner = k.foreign_owner(obj, self.uid)
            if owner.startswith("a previous DynaTrainJob"):
                self.log(f"job {self.name}: {kind} {name} belongs to {owner}: replacing it")
                try:
                    delete(name, ns, body=client.V1DeleteOptions(
                        preconditions=client.V1Preconditions(uid=obj.metadata.uid)))
                except ApiException as e:
                    if e.status not in (404, 409):
                        raise
                obj = None
            elif owner:
                text = (f"{kind} {ns}/{name} exists and belongs to {owner}; the job needs "
                        "that name: delete the object or rename the job")
                if self.conditions.set("ObjectsReady", False, "NameTaken", text,
                                       self._generation()):
                    self._event("Warning", "NameTaken", text)
                raise _Waiting(text)
        want = manifest()
        if obj is None:
            create(ns, want)          # a 409 here (deletion not finished) retries the pass
            self.log(f"job {self.name}: {kind} {name} created")
        elif differs is not None and differs(obj, want):
            patch(name, ns, want)
            self.log(f"job {self.name}: {kind} {name} updated to the spec")
