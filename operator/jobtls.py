"""The job's TLS material and the agents' clients made with it.

The operator talks to the agents over mutual TLS. A :class:`JobTls` keeps what the clients
need: with no ``spec.agent.issuerRef``, the job's own two CAs and certificates (:mod:`.pki`),
made here and renewed in place before they expire; with one, cert-manager's ``Certificate``
objects and the Secrets it fills. When the material changes, every agent's client is re-made
(a gRPC channel keeps the credentials it was made with), and the old ones are closed once no
switch holds them.

It is a room of its own because the two kinds of PKI are the runtime's most intricate upkeep
and touch nothing of the pods or the controller but the clients. It is given what it uses
explicitly (the APIs, the settings, how to log, raise an Event, set a condition, read the job,
its body and generation, and :meth:`~.runtime.JobRuntime._ensure` for its Secrets) rather than
the whole runtime.
"""

from __future__ import annotations

import datetime
from datetime import timedelta

from kubernetes import client
from kubernetes.client.rest import ApiException

from dynatrain.agent.auth import ClientTls
from dynatrain.agent.client import AgentClient

from . import cluster as k
from . import pki
from .basics import JobContext, Room, Waiting as _Waiting, now as _now


class JobTls(Room):
    """One job's TLS material and the clients it makes (see the module's docstring)."""

    def __init__(self, ctx: JobContext, *, cert_manager: client.CustomObjectsApi, token,
                 ensure):
        super().__init__(ctx)
        self.cert_manager = cert_manager
        """For cert-manager's Certificates (spec.agent.issuerRef): a rule of their own in the
        chart; tests/k8s/test_operator_rbac.py lists these calls (CERT_MANAGER)."""
        self._token = token
        """() -> the agents' token, asked at every call (a rotated authSecret is used at once)."""
        self._ensure = ensure
        """The runtime's ``_ensure``: (read, create, delete, patch, kind, name, manifest,
        differs) -> the object made this job's and as the manifest says."""
        self.tls: tuple[bytes, bytes, bytes] | None = None
        """(CA bundle the agents' certificates chain to, client certificate, client key)."""
        self.pki_due: datetime.datetime | None = None
        """When the TLS material needs a look before the next objects pass (a renewal)."""
        self.agents_at: dict[int, tuple[str, str]] = {}
        """Device -> (pod IP, pod name) its client dials (to re-make it with new TLS)."""
        self.retired: list[AgentClient] = []

    def ensure_pki(self) -> None:
        """The job's TLS material: its own two CAs and certificates, made and renewed here
        (:mod:`.pki`), or, with ``spec.agent.issuerRef``, cert-manager's. When the client
        certificate or the CAs the operator trusts change, the agents' clients are re-made
        (a gRPC channel keeps the credentials it was made with)."""
        if self.job.issuer_ref is None:
            material = self._own_pki()
        else:
            material = self._issued_pki()
        if material != self.tls:
            renewed = self.tls is not None
            self.tls = material
            if renewed:
                self._retls()

    def _own_pki(self) -> tuple[bytes, bytes, bytes]:
        ns, body, now = self.namespace, self.body, _now()
        name = pki.pki_secret_name(self.name)
        try:
            obj = self.core.read_namespaced_secret(name, ns)
        except ApiException as e:
            if e.status != 404:
                raise
            obj = None
        current = None
        if obj is not None and not k.foreign_owner(obj, self.uid):   # else _ensure says why
            try:
                current = pki.from_secret(pki.secret_bytes(obj.data), f"secret {ns}/{name}")
            except pki.PkiError as e:      # edited by hand: start over (the workers follow)
                self.log(f"job {self.name}: {e}; making the job's CAs anew")
        want, changes = pki.advance(current, job=self.name, namespace=ns, now=now,
                                    lifetime_s=self.settings.cert_lifetime_s)
        stored, mounted = pki.pki_secret(body, want), pki.tls_secret(body, want)
        for manifest in (stored, mounted):
            # Rotation patches the Secrets in place: a kubelet updates a running pod's
            # mounted copy, and the agent re-reads its files for new connections.
            self._ensure(self.core.read_namespaced_secret, self.core.create_namespaced_secret,
                         self.core.delete_namespaced_secret, self.core.patch_namespaced_secret,
                         "Secret", manifest["metadata"]["name"], lambda m=manifest: m,
                         lambda obj, want: (obj.data or {}) != want["data"])
        self.pki_due = pki.next_change(want)
        if changes:
            text = "; ".join(changes)
            self.log(f"job {self.name}: TLS: {text}")
            if current is not None:
                self._event("Normal", "CertificatesRenewed", text)
        self.conditions.set("CertificatesReady", True, "Issued",
                            f"the job's own CAs; next renewal {self.pki_due.isoformat()}",
                            self._generation())
        return want.serving_ca_bundle, want.client.cert, want.client.key

    def _issued_pki(self) -> tuple[bytes, bytes, bytes]:
        """cert-manager's certificates (``spec.agent.issuerRef``): the two ``Certificate``
        objects made, and the Secrets it fills read (the job waits until it has)."""
        ns, gen = self.namespace, self._generation()
        group, version, plural = pki.CERT_MANAGER
        api = self.cert_manager

        def waiting(reason: str, text: str):
            if self.conditions.set("CertificatesReady", False, reason, text, gen):
                self._event("Warning", reason, text)
            return _Waiting(text)

        for cert in pki.certificates(self.body, self.job.issuer_ref,
                                     self.settings.cert_lifetime_s):
            name = cert["metadata"]["name"]
            try:
                obj = api.get_namespaced_custom_object(group, version, ns, plural, name)
            except ApiException as e:
                if e.status != 404:      # 404: no such Certificate, or no such API at all
                    raise
                obj = None
            owners = [r.get("uid") for r in (obj or {}).get("metadata", {}).get(
                "ownerReferences") or []]
            if obj is not None and self.uid not in owners:
                raise waiting("NameTaken", f"Certificate {ns}/{name} exists and does not "
                              "belong to this job; delete it or rename the job")
            try:
                if obj is None:
                    api.create_namespaced_custom_object(group, version, ns, plural, cert)
                    self.log(f"job {self.name}: Certificate {name} created")
                elif any(obj.get("spec", {}).get(f) != v for f, v in cert["spec"].items()):
                    api.patch_namespaced_custom_object(group, version, ns, plural, name,
                                                       {"spec": cert["spec"]})
            except ApiException as e:
                if e.status != 404:
                    raise
                raise waiting("CertManagerMissing", (
                    f"spec.agent.issuerRef names {self.job.issuer_ref['kind']} "
                    f"{self.job.issuer_ref['name']!r}, but this cluster has no cert-manager "
                    f"Certificate API ({group}/{version}): install cert-manager, or remove "
                    "spec.agent.issuerRef (on a new job) to let the operator make the job's "
                    "CAs")) from None
        found = {}
        for name, keys in ((pki.tls_secret_name(self.name), ("ca.crt", "tls.crt", "tls.key")),
                           (pki.client_secret_name(self.name), ("tls.crt", "tls.key"))):
            try:
                data = pki.secret_bytes(self.core.read_namespaced_secret(name, ns).data)
            except ApiException as e:
                if e.status != 404:
                    raise
                data = {}
            missing = [key for key in keys if not data.get(key)]
            if missing == ["ca.crt"]:
                raise waiting("IssuerHasNoCA", (
                    f"Secret {ns}/{name} from {self.job.issuer_ref['kind']} "
                    f"{self.job.issuer_ref['name']!r} has no ca.crt: the workers must trust "
                    "the CA that signs the operator's certificate; use a CA Issuer"))
            if missing:
                raise waiting("Issuing", (
                    f"waiting for cert-manager to issue Certificate {ns}/{name} (its Secret "
                    f"lacks {', '.join(missing)}; see `kubectl describe certificate -n {ns} "
                    f"{name}`)"))
            found[name] = data
        serving = found[pki.tls_secret_name(self.name)]
        client_ = found[pki.client_secret_name(self.name)]
        # Re-read when cert-manager renews the operator's certificate (a third of its
        # lifetime before it ends), else at the next objects pass.
        due = pki.renewal_time(client_["tls.crt"]) + timedelta(seconds=10)
        self.pki_due = due if due > _now() else None
        self.conditions.set("CertificatesReady", True, "Issued",
                            f"by {self.job.issuer_ref['kind']} {self.job.issuer_ref['name']}",
                            gen)
        return serving["ca.crt"], client_["tls.crt"], client_["tls.key"]

    def agent(self, ip: str, pod: str) -> AgentClient:
        """A client of the agent in ``pod``: mutual TLS (the name verified is the pod's name
        under the job's Service, which the serving certificate carries) and the token, read
        at every call (a rotated authSecret is used at once)."""
        ca, cert, key = self.tls
        tls = ClientTls(ca, cert, key, server_name=pki.server_name(pod, self.name,
                                                                   self.namespace))
        return AgentClient(f"{ip}:{self.job.agent_port}", token=self._token, tls=tls,
                           timeout_s=5.0)

    def _retls(self) -> None:
        """New TLS material: every agent's client is re-made with it. The old clients are
        closed at the next rotation, once no switch runs (a switch in flight holds them)."""
        c = self.controller
        if self.retired and not c.switching:
            for old in self.retired:
                old.close()
            self.retired = []
        fresh = {d: self.agent(*self.agents_at[d]) for d in c.state.agents
                 if d in self.agents_at}
        self.retired += c.reconnect(fresh)
        self.log(f"job {self.name}: TLS credentials changed: {len(fresh)} agent clients "
                 "re-made")

    def close(self) -> None:
        for cl in self.retired:
            cl.close()
