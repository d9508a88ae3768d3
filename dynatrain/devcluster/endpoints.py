"""The kubelet endpoints of the simulated nodes: ``kubectl logs`` and ``port-forward``.

The apiserver answers ``kubectl logs``, ``exec``, ``attach`` and ``port-forward`` by calling
the pod's node: HTTPS to the node's ``InternalIP`` at ``status.daemonEndpoints.kubeletEndpoint
.Port``. For the simulated nodes that endpoint is kwok's own server (``kwok --server-address``;
the dev cluster gives the nodes InternalIP 127.0.0.1 and that port). kwok serves a pod from
rules it reads from the apiserver (``kwok --enable-crds``), one of each kind per pod, named as
the pod, in its namespace:

- ``Logs`` (kwok.x-k8s.io/v1alpha1): the container's log file and its previous container's,
  which kwok reads as a kubelet reads a CRI runtime's log files, with ``--follow``, ``--tail``,
  ``--since``, ``--timestamps``, ``--limit-bytes`` and ``--previous``;
- ``PortForward``: each port the container declares, forwarded to the pod's own IP and that
  port (where the pod runner's process listens, on loopback).

The pod runner (:mod:`.pods`) publishes both when it starts a pod's process, owned by the pod,
so the garbage collector deletes them with it, and writes the log files in the CRI format
(:class:`ContainerOutput`: one ``<RFC 3339 time> <stream> <F|P> <text>`` line per line the
process printed) beside the plain ``container.log``; at a restart the current file becomes the
previous one. The CRDs (:func:`crd_manifests`) are the dev cluster's own definition of kwok's
kinds (their fields, types and limits, as in kwok v0.8.0).

``kubectl exec`` and ``attach`` are refused (:func:`exec_refusal_manifests`, a
ValidatingAdmissionPolicy on the CONNECT of ``pods/exec`` and ``pods/attach``), with a message
that says why: a pod's process runs on this machine as the user who started the dev cluster,
and kwok's server has no authentication at all (any local process, and a web page that finds
its port through a browser's WebSocket, could call it), so an exec rule there would let anyone
on the machine run commands as that user. Its log and port-forward endpoints are open the same
way; they reveal a pod's output, and reach ports that already listen on loopback.
"""

from __future__ import annotations

import datetime
import os
import selectors
import threading
import time
from pathlib import Path
from typing import IO

GROUP = "kwok.x-k8s.io"
VERSION = "v1alpha1"
KINDS = ("Logs", "PortForward")
"""kwok's ``--enable-crds``: the kinds it reads from the apiserver. No Exec: see above."""
LOGS_PLURAL = "logs"
PORT_FORWARD_PLURAL = "portforwards"
EXEC_POLICY = "dynatrain-devcluster-no-exec"
EXEC_REFUSAL = (
    "kubectl exec and attach are refused on the dev cluster's simulated (kwok) nodes: their "
    "pods run as local processes of the user who started the dev cluster, and kwok's kubelet "
    "server, which would run the command, has no authentication (any local user, or a web page "
    "that finds its port, could run commands as that user). Read a pod with kubectl logs and "
    "reach its declared ports with kubectl port-forward; a real node (dynatrain dev cluster "
    "--real-node) runs exec in the container.")
"""Why ``kubectl exec`` fails; the apiserver returns it as the Forbidden error's message."""
CRI_DIR = "kubelet"
"""The directory, in a pod's directory, of the CRI-format log files kwok reads."""
CURRENT_LOG = "current.log"
PREVIOUS_LOG = "previous.log"
_PARTIAL_MAX = 16 * 1024
"""A line longer than this is written in parts (tag ``P``), as containerd does."""


def _crd(kind: str, plural: str, singular: str, spec: dict) -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP, "scope": "Namespaced",
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural,
                      "singular": singular},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "required": ["spec"],
                                               "properties": {
                    "spec": spec,
                    # kwok writes conditions here; their shape is kwok's business.
                    "status": {"type": "object",
                               "x-kubernetes-preserve-unknown-fields": True}}}},
            }],
        },
    }


def crd_manifests() -> list[dict]:
    """The CustomResourceDefinitions of kwok's ``Logs`` and ``PortForward`` kinds (pure).

    kwok's client reads them as kwok.x-k8s.io/v1alpha1. The schemas hold the fields of kwok
    v0.8.0's types, with their types and limits, so the apiserver checks what the pod runner
    writes; kwok's own CRDs (its kustomize/crd) are not in the built binaries."""
    strings = {"type": "array", "items": {"type": "string"}}
    log = {"type": "object", "properties": {
        "containers": strings, "logsFile": {"type": "string"},
        "previousLogsFile": {"type": "string"}, "follow": {"type": "boolean"}}}
    forward = {"type": "object", "properties": {
        "ports": {"type": "array", "items": {"type": "integer", "format": "int32"}},
        "target": {"type": "object", "required": ["port", "address"], "properties": {
            "port": {"type": "integer", "format": "int32", "minimum": 0, "maximum": 65535},
            "address": {"type": "string", "minLength": 1}}},
        "command": strings}}
    return [
        _crd("Logs", LOGS_PLURAL, "logs", {
            "type": "object", "required": ["logs"],
            "properties": {"logs": {"type": "array", "items": log}}}),
        _crd("PortForward", PORT_FORWARD_PLURAL, "portforward", {
            "type": "object", "required": ["forwards"],
            "properties": {"forwards": {"type": "array", "items": forward}}}),
    ]


def exec_refusal_manifests() -> list[dict]:
    """A ValidatingAdmissionPolicy and its binding that refuse ``kubectl exec``/``attach`` to
    every pod, saying why (:data:`EXEC_REFUSAL`) (pure). For a cluster whose nodes are all
    simulated; a real node's kubelet runs exec honestly, and the policy cannot tell the pods
    apart (a CONNECT request carries the exec options, not the pod)."""
    return [
        {"apiVersion": "admissionregistration.k8s.io/v1",
         "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": EXEC_POLICY},
         "spec": {
             "failurePolicy": "Fail",
             "matchConstraints": {"resourceRules": [{
                 "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CONNECT"],
                 "resources": ["pods/exec", "pods/attach"]}]},
             "validations": [{"expression": "false", "reason": "Forbidden",
                              "message": EXEC_REFUSAL}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1",
         "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": EXEC_POLICY},
         "spec": {"policyName": EXEC_POLICY, "validationActions": ["Deny"]}},
    ]


def _owned_by(namespace: str, pod: str, uid: str) -> dict:
    # Owned by the pod: the garbage collector deletes the rule with it, and a later pod of the
    # same name (another uid) gets its own.
    return {"name": pod, "namespace": namespace, "ownerReferences": [{
        "apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid}]}


def logs_rule(namespace: str, pod: str, uid: str, container: str, directory: Path) -> dict:
    """kwok's ``Logs`` for ``container`` of pod ``namespace/pod`` (pure): the CRI-format files
    that :class:`ContainerOutput` writes in ``directory``."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Logs",
            "metadata": _owned_by(namespace, pod, uid),
            "spec": {"logs": [{"containers": [container],
                               "logsFile": str(directory / CURRENT_LOG),
                               "previousLogsFile": str(directory / PREVIOUS_LOG)}]}}


def port_forward_rule(namespace: str, pod: str, uid: str, pod_ip: str,
                      ports: list[int]) -> dict:
    """kwok's ``PortForward`` for pod ``namespace/pod`` (pure): each declared port to the same
    port on the pod's IP. A port the pod does not declare has no rule (kwok names it in its
    error): kwok's targets are fixed, there is no "the same port as asked"."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PortForward",
            "metadata": _owned_by(namespace, pod, uid),
            "spec": {"forwards": [{"ports": [p], "target": {"address": pod_ip, "port": p}}
                                  for p in sorted(set(ports))]}}


def publish(custom, rule: dict) -> None:
    """Create ``rule`` (a Logs or PortForward), or replace one left by an earlier pod of the
    same name that the garbage collector has not deleted yet."""
    from kubernetes.client.rest import ApiException

    plural = {"Logs": LOGS_PLURAL, "PortForward": PORT_FORWARD_PLURAL}[rule["kind"]]
    ns, name = rule["metadata"]["namespace"], rule["metadata"]["name"]
    try:
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, plural, rule)
        return
    except ApiException as e:
        if e.status != 409:
            raise
    old = custom.get_namespaced_custom_object(GROUP, VERSION, ns, plural, name)
    rule = {**rule, "metadata": {**rule["metadata"],
                                 "resourceVersion": old["metadata"]["resourceVersion"]}}
    custom.replace_namespaced_custom_object(GROUP, VERSION, ns, plural, name, rule)


def _stamp() -> bytes:
    ns = time.time_ns()
    seconds, nanos = divmod(ns, 1_000_000_000)
    day = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return f"{day:%Y-%m-%dT%H:%M:%S}.{nanos:09d}Z".encode()


class ContainerOutput:
    """Copies a process's stdout and stderr, as they come, into its plain log (appended, as
    before: what ``PodRunner.log`` and people read) and into a CRI-format log for kwok.

    One thread per process reads both pipes; it ends when both are closed (the process and
    anything it started that kept them have exited). :meth:`rotate` makes the current CRI file
    the previous one before a restart; output that the old process's last children still write
    follows the renamed file, which is where ``--previous`` looks.
    """

    def __init__(self, plain: Path, cri_dir: Path):
        self.plain_path, self.cri_dir = plain, cri_dir
        self._thread: threading.Thread | None = None

    @property
    def current(self) -> Path:
        return self.cri_dir / CURRENT_LOG

    def reset(self) -> None:
        """A new pod: no current or previous container output (an earlier pod of the same
        name may have left some; a writer still draining keeps its unlinked file)."""
        self.cri_dir.mkdir(parents=True, exist_ok=True)
        for name in (CURRENT_LOG, PREVIOUS_LOG):
            (self.cri_dir / name).unlink(missing_ok=True)

    def rotate(self) -> None:
        """The container restarts: its output so far is the previous container's."""
        self.cri_dir.mkdir(parents=True, exist_ok=True)
        if self.current.exists():
            os.replace(self.current, self.cri_dir / PREVIOUS_LOG)

    def note(self, text: str) -> None:
        """A line the runner itself reports as the container's output (a command that cannot
        be started), in both logs."""
        data = text.encode()
        with open(self.plain_path, "ab") as plain, open(self.current, "ab") as cri:
            plain.write(data)
            cri.write(b"%s stderr F %s" % (_stamp(), data))

    def start(self, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        """Copy the two pipes (read ends, owned from now on) until both close."""
        plain = open(self.plain_path, "ab")
        cri = open(self.current, "ab")
        self._thread = threading.Thread(target=self._pump, args=(stdout, stderr, plain, cri),
                                        name=f"pod-output-{self.plain_path.parent.name}",
                                        daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @staticmethod
    def _pump(stdout: IO[bytes], stderr: IO[bytes], plain: IO[bytes], cri: IO[bytes]) -> None:
        pending = {b"stdout": b"", b"stderr": b""}
        with selectors.DefaultSelector() as sel, plain, cri:
            sel.register(stdout, selectors.EVENT_READ, b"stdout")
            sel.register(stderr, selectors.EVENT_READ, b"stderr")
            while sel.get_map():
                for key, _ in sel.select():
                    stream = key.data
                    data = os.read(key.fd, 65536)
                    if not data:                  # closed: a last partial line is partial
                        sel.unregister(key.fileobj)
                        key.fileobj.close()
                        if pending[stream]:
                            cri.write(b"%s %s P %s\n" % (_stamp(), stream, pending[stream]))
                            pending[stream] = b""
                    else:
                        plain.write(data)
                        pending[stream] = _cri_lines(cri, stream, pending[stream] + data)
                plain.flush()
                cri.flush()


def _cri_lines(cri: IO[bytes], stream: bytes, data: bytes) -> bytes:
    """Write each complete line of ``data`` as a CRI log entry (tag F: full); a rest longer
    than :data:`_PARTIAL_MAX` goes out in parts (tag P); returns what is left for later."""
    stamp = _stamp()
    *lines, rest = data.split(b"\n")
    for line in lines:
        cri.write(b"%s %s F %s\n" % (stamp, stream, line))
    while len(rest) > _PARTIAL_MAX:
        cri.write(b"%s %s P %s\n" % (stamp, stream, rest[:_PARTIAL_MAX]))
        rest = rest[_PARTIAL_MAX:]
    return rest
