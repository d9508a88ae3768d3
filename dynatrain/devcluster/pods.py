"""Pods that run: the part of a kubelet that kwok lacks, as local processes.

kwok makes pods Running with a pod IP but starts nothing. :class:`PodRunner` watches the
cluster and, for every Running pod on a live simulated node, starts its (first) container's
command as a process on this machine, the way a kubelet would:

- ``command`` + ``args`` with ``$(VAR)`` references expanded from the container's environment:
  ``value``, the downward API (``metadata.name``/``namespace``/``uid``, ``spec.nodeName``,
  ``status.podIP``/``hostIP``), ``configMapKeyRef``, ``secretKeyRef`` and ``envFrom``;
- the wildcard address ``0.0.0.0`` as a whole argument (what a pod binds to listen on all its
  addresses) becomes the pod's IP (a process has no network namespace of its own);
- volumes as directories (:mod:`.volumes`): ConfigMap and Secret volumes written per pod (as
  the kubelet's atomic writer does: files behind a ``..data`` symlink swapped in one step) and
  re-synced every ``volume_sync_s`` while the pod runs, as a real kubelet updates a mounted
  Secret or ConfigMap in place (a rotated certificate or token reaches a running worker);
  ``emptyDir`` per pod, and every PersistentVolumeClaim backed by one directory per claim that
  every pod mounting it shares (as a ReadWriteMany volume would). Mount paths in the command,
  the arguments and the environment are mapped onto those directories (a process has no mount
  namespace of its own);
- a claim of the runner's StorageClass (:data:`.volumes.STORAGE_CLASS`, the dev cluster's
  default) is provisioned as a ``hostPath`` PersistentVolume on that directory, which
  kube-controller-manager's volume binder binds, as a local-path provisioner does;
- a process that exits makes its pod ``Succeeded`` or ``Failed`` with the exit code in the
  container's status, or is restarted per ``restartPolicy`` (with the kubelet's back-off:
  10 s, doubling, at most 5 minutes, shown as ``CrashLoopBackOff``);
- a pod being deleted gets SIGTERM, and SIGKILL when its grace period ends; once its process
  has exited the pod is removed (grace 0), as a kubelet confirms a deletion; a pod that is
  gone, or whose node stopped heart-beating or was deleted, is killed (the machine is gone);
- the node's kubelet endpoints (:mod:`.endpoints`): for each pod it runs, the runner publishes
  kwok's ``Logs`` and ``PortForward`` rules, so that ``kubectl logs`` (``-f``, ``--tail``,
  ``--previous``...) and ``kubectl port-forward`` reach the process through the apiserver and
  kwok's server, as they reach a kubelet.

The image is not pulled: ``dynatrain`` as the command means this checkout's console script
(``python -m dynatrain``); any other command runs as it is. The dev cluster hands out pod IPs
from 127.0.0.0/8, so a process binds its pod IP on loopback and others reach it there, as on a
cluster network. Logs are in ``<workdir>/<namespace>/<pod>/container.log`` (every run of the
pod's container, each restart marked), and, in the CRI format kwok's server reads, in
``<workdir>/<namespace>/<pod>/kubelet/current.log`` and ``previous.log``.

The simulated GPU nodes have no CUDA, and a worker of a GPU job asks for NCCL on a GPU
(``--backend auto``): it stops at start, as on a real node without CUDA. Only with
``cpu_for_gpu_pods=True`` (tests' fixtures, ``dynatrain dev cluster --run-pods
--gpu-pods-on-cpu``) does the runner append ``--backend gloo --threads 1`` to the ``dynatrain
worker`` command of a pod that requests ``nvidia.com/gpu``, so it trains on the CPU with one
thread (several such workers share one machine), and, with ``cpu_step_floor_s``, at most one
step per that many seconds; nothing else about the pod changes.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..controller import workerstart
from . import endpoints
from .nodes import KWOK_ANNOTATION, NODE_LEASE_NAMESPACE, heartbeat_stopped
from .processes import _die_with_parent
from .volumes import container_env, mount_volumes, project, provision_claims, volume_data

WILDCARD = "0.0.0.0"
"""An address to bind in a pod's command or arguments that the runner replaces by the pod's IP:
in a pod it means every address of the pod's own network namespace; a process here shares the
machine's, where it would collide with every other pod's port."""

if TYPE_CHECKING:
    from kubernetes import client

    from ..operator.informer import ClusterView

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_STRATEGIC = "application/strategic-merge-patch+json"

BACKOFF_FIRST_S = 10.0
BACKOFF_MAX_S = 300.0


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Container:
    """The process of one pod (by uid) and what the runner knows of it."""

    namespace: str
    name: str
    node: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    restart_policy: str
    container: str
    proc: subprocess.Popen | None = None
    started_at: str = ""
    restarts: int = 0
    terminated: bool = False
    """SIGTERM sent (the pod is being deleted)."""
    kill_at: float | None = None
    restart_at: float | None = None
    """Back-off: when the exited process is started again."""
    done: bool = False
    """Exited for good: the pod's phase is Succeeded or Failed."""
    projections: list = field(default_factory=list)
    """(local dir, "secret" or "configmap", name, items, mode) of each such volume: re-synced."""
    uid: str = ""
    pod_ip: str = ""
    ports: list[int] = field(default_factory=list)
    """The container's declared ports: what ``kubectl port-forward`` may reach."""
    output: endpoints.ContainerOutput | None = None
    published: bool = False
    """kwok's Logs and PortForward rules for the pod exist."""


class PodRunner:
    """Runs the Running pods of ``namespace`` (all namespaces if None) matching ``selector``.

    Use as a context manager (a background thread syncs every ``interval_s``), or call
    :meth:`sync` yourself. ``workdir`` holds each pod's files and logs and the claims' data.
    """

    def __init__(self, core: client.CoreV1Api, workdir: Path, *, namespace: str | None = None,
                 selector: str = "", interval_s: float = 0.2, nodes_interval_s: float = 1.0,
                 backoff_first_s: float = BACKOFF_FIRST_S,
                 log: Callable[[str], None] | None = None, cpu_for_gpu_pods: bool = False,
                 volume_sync_s: float = 2.0, fork_workers: bool = False,
                 cpu_step_floor_s: float = 0.0):
        self.core, self.namespace, self.selector = core, namespace, selector
        self.fork_workers = fork_workers
        """Start a ``dynatrain worker`` container by forking it from the fork server of
        :mod:`dynatrain.trainer.processes` (torch imported once) instead of a new interpreter
        (:func:`dynatrain.controller.workerstart.fork_worker`): the same main, arguments,
        environment, session, output pipes and exit codes, without ~5 s of CPU for imports
        per pod. A real container starts a new interpreter, so this is off unless asked:
        the tests' fixtures turn it on (``DYNATRAIN_TEST_POD_START=exec`` turns it off
        there) to keep a 2-core CI machine's CPU for the training the tests check."""
        self.volume_sync_s = volume_sync_s
        """How often a running pod's Secret and ConfigMap volumes are re-synced (a kubelet:
        its sync period, a minute, plus its cache; shorter here so tests need not wait)."""
        self._synced_volumes = 0.0
        self.cpu_for_gpu_pods = cpu_for_gpu_pods
        """Run the ``dynatrain worker`` of a pod that requests ``nvidia.com/gpu`` on the CPU
        (``--backend gloo --threads 1`` appended): the simulated GPU nodes have no CUDA. Off,
        such a worker asks for NCCL and stops at start with exit code 2, as it would on a node
        without CUDA; tests and ``dynatrain dev cluster --run-pods --gpu-pods-on-cpu`` turn it
        on."""
        self.cpu_step_floor_s = cpu_step_floor_s
        """With :attr:`cpu_for_gpu_pods`, a floor on each training step's wall time of those
        CPU workers (``--min-step-seconds``; 0: none). A real GPU trains without taking the
        node's CPU; a stand-in training flat out would take the cores that the control plane,
        the operator and the other pods of this one machine need."""
        self.workdir = Path(workdir)
        self.interval_s, self.backoff_first_s = interval_s, backoff_first_s
        self.nodes_interval_s = nodes_interval_s
        """How often the nodes' heartbeat leases (which nodes are alive) and the pending claims
        are read. A node that stops heart-beating is noticed within this, as a kubelet's
        machine that dies takes its processes with it a moment later; a pod on a node not seen
        before has them read at once (a new node's pods start without waiting)."""
        self.view: ClusterView | None = None
        """The runner's pods (its namespace and selector) and the nodes, listed once and then
        watched, as a kubelet watches its pods, so a round reads memory (listing all four every
        0.2 s took ~7.5% of a 2-core machine with no pod to run). Made by :meth:`start`."""
        self._alive: set[str] = set()
        self._known: set[str] = set()
        self._nodes_read = -float("inf")
        self._say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.containers: dict[str, _Container] = {}
        """Pod uid -> its container process."""
        self.errors: list[str] = []
        """API errors met while syncing (retried on the next round)."""
        self._coordination = None
        self._custom = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pod-runner", daemon=True)

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> PodRunner:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._watch()
        self._thread.start()

    def stop(self) -> None:
        """Stop syncing and kill every process (the node's kubelet and its machine stop)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        if self.view is not None:
            self.view.stop()
        for c in self.containers.values():
            if c.proc is not None and c.proc.poll() is None:
                c.proc.kill()
        for c in self.containers.values():
            if c.proc is not None:
                c.proc.wait(10)
        for c in self.containers.values():
            if c.output is not None:   # the last lines into the logs (a child may hold on)
                c.output.join(2)

    def _loop(self) -> None:
        from kubernetes.client.rest import ApiException

        while not self._stop.is_set():
            try:
                self.sync()
            except (ApiException, OSError) as e:   # apiserver busy or restarting: next round
                self.errors.append(f"{type(e).__name__}: {e}")
                del self.errors[:-50]
            self._stop.wait(self.interval_s)

    # -- queries ------------------------------------------------------------------------------
    def process(self, namespace: str, pod: str) -> subprocess.Popen | None:
        """The newest process started for pod ``namespace/pod`` (running or not), if any."""
        found = [c for c in self.containers.values() if (c.namespace, c.name) == (namespace, pod)
                 and c.proc is not None]
        return found[-1].proc if found else None

    def log(self, namespace: str, pod: str) -> str:
        """What the pod's container printed so far ('' if it never ran)."""
        for c in list(self.containers.values()):
            if ((c.namespace, c.name) == (namespace, pod) and c.output is not None
                    and c.proc is not None and c.proc.poll() is not None):
                # Exited: its last output is read from the pipes into the file first, as it
                # was there at once when the process wrote the file itself.
                c.output.join(1)
        path = self.workdir / namespace / pod / "container.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def claim_dir(self, namespace: str, claim: str) -> Path:
        """The directory behind PersistentVolumeClaim ``namespace/claim``."""
        return self.workdir / "claims" / namespace / claim

    # -- one round ----------------------------------------------------------------------------
    def _watch(self) -> ClusterView:
        if self.view is None:
            from ..operator.informer import ClusterView

            # A short back-off: an apiserver that restarts (the HA tests) is back in seconds,
            # and the pods wait on the runner to start.
            self.view = ClusterView(self.core.api_client, self._say, backoff_max_s=2.0,
                                    pods_namespace=self.namespace, pods_selector=self.selector)
            self.view.start()
        return self.view

    def sync(self) -> None:
        view = self._watch()
        view.wait_synced(5.0)       # at once after the first list (a TimeoutError is retried)
        pods = view.pods()
        now = time.monotonic()
        if (now - self._nodes_read >= self.nodes_interval_s
                or any(p.spec.node_name and p.spec.node_name not in self._known for p in pods)):
            self._alive, self._known = self._live_nodes()
            # A pod's node is in the list read after it unless it was deleted since: its pods
            # need no read every round until the pod garbage collector removes them.
            self._known |= {p.spec.node_name for p in pods if p.spec.node_name}
            provision_claims(self.core, self.namespace, self.claim_dir, self._say)
            self._nodes_read = now
        alive = self._alive
        by_uid = {p.metadata.uid: p for p in pods}
        for uid, c in self.containers.items():
            self._tend(c, by_uid.get(uid), c.node in alive, now)
            if not c.published and not c.done and uid in by_uid:
                self._publish(c)
        if now - self._synced_volumes >= self.volume_sync_s:
            self._synced_volumes = now
            for c in self.containers.values():
                if c.proc is not None and c.proc.poll() is None:
                    self._resync(c)
        for uid, pod in by_uid.items():
            if (uid not in self.containers and pod.status and pod.status.phase == "Running"
                    and pod.status.pod_ip and pod.metadata.deletion_timestamp is None
                    and pod.spec.node_name in alive):
                c = self._prepare(pod)
                self.containers[uid] = c
                self._run(c)
                self._publish(c)

    def _live_nodes(self) -> tuple[set[str], set[str]]:
        """Simulated nodes that exist and still heart-beat (their kubelet, so their processes,
        live), and every node that exists. A real node's kubelet (:mod:`.kubelet`) runs its own
        pods' containers."""
        from kubernetes import client

        if self._coordination is None:
            self._coordination = client.CoordinationV1Api(self.core.api_client)
        stopped = {lease.metadata.name for lease in self._coordination.list_namespaced_lease(
            NODE_LEASE_NAMESPACE).items if heartbeat_stopped(lease)}
        key, value = KWOK_ANNOTATION
        nodes = self._watch().nodes()
        return ({n.metadata.name for n in nodes
                 if (n.metadata.annotations or {}).get(key) == value} - stopped,
                {n.metadata.name for n in nodes})

    def _tend(self, c: _Container, pod, node_alive: bool, now: float) -> None:
        running = c.proc is not None and c.proc.poll() is None
        if pod is None or not node_alive:            # gone, or its machine is gone
            if running:
                c.proc.kill()
            c.done = True
            return
        if running:
            if pod.metadata.deletion_timestamp is not None and not c.terminated:
                c.terminated = True
                c.proc.send_signal(signal.SIGTERM)
                left = (pod.metadata.deletion_timestamp
                        - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
                c.kill_at = now + max(0.0, left)
            elif c.kill_at is not None and now >= c.kill_at:
                c.proc.kill()
            return
        if c.done or c.proc is None:
            return
        if c.restart_at is not None:                  # backing off
            if now >= c.restart_at and pod.metadata.deletion_timestamp is None:
                c.restart_at = None
                c.restarts += 1
                self._run(c)
            return
        # As a kubelet reports it: a process killed by signal N exited with 128 + N.
        code = c.proc.returncode if c.proc.returncode >= 0 else 128 - c.proc.returncode
        if c.terminated:                              # deleted: the pod goes away
            c.done = True
            self._remove(c, pod.metadata.uid)
            return
        restart = (c.restart_policy == "Always"
                   or (c.restart_policy == "OnFailure" and code != 0))
        if restart:
            delay = min(BACKOFF_MAX_S, self.backoff_first_s * 2 ** c.restarts)
            c.restart_at = now + delay
            self._say(f"[pods] {c.namespace}/{c.name} exited with code {code}; restarting in "
                      f"{delay:.0f} s (restartPolicy {c.restart_policy})")
            self._report(c, exited=code, waiting="CrashLoopBackOff")
        else:
            c.done = True
            phase = "Succeeded" if code == 0 else "Failed"
            self._say(f"[pods] {c.namespace}/{c.name} exited with code {code}: {phase}")
            self._report(c, exited=code, phase=phase)

    def _publish(self, c: _Container) -> None:
        """kwok's rules for the pod (:mod:`.endpoints`): its logs and its declared ports, now
        that its log file exists. An API error is kept and retried on the next round."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        if self._custom is None:
            self._custom = client.CustomObjectsApi(self.core.api_client)
        try:
            endpoints.publish(self._custom, endpoints.logs_rule(
                c.namespace, c.name, c.uid, c.container, c.output.cri_dir))
            endpoints.publish(self._custom, endpoints.port_forward_rule(
                c.namespace, c.name, c.uid, c.pod_ip, c.ports))
            c.published = True
        except ApiException as e:
            hint = (f" (are kwok's {'/'.join(endpoints.KINDS)} CRDs of {endpoints.GROUP} "
                    "installed? a DevCluster installs them)" if e.status == 404 else "")
            self.errors.append(f"publishing the kubelet endpoints of {c.namespace}/{c.name}: "
                               f"{e.status} {e.reason}{hint}")
            del self.errors[:-50]

    def _remove(self, c: _Container, uid: str) -> None:
        """A deleted pod whose process has exited is removed at once (grace 0), as a kubelet
        does once its containers stop; kwok would keep it until its grace period ends."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        try:
            self.core.delete_namespaced_pod(c.name, c.namespace, body=client.V1DeleteOptions(
                grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)))
        except ApiException as e:
            if e.status not in (404, 409):     # gone already, or another pod of that name
                raise

    # -- status, as a kubelet reports it --------------------------------------------------------
    def _report(self, c: _Container, *, exited: int | None = None, phase: str | None = None,
                waiting: str | None = None) -> None:
        from kubernetes.client.rest import ApiException

        terminated = None
        if exited is not None:
            terminated = {"exitCode": exited, "reason": "Completed" if exited == 0 else "Error",
                          "startedAt": c.started_at, "finishedAt": _now()}
        status = {"name": c.container, "image": "", "imageID": "", "ready": False,
                  "restartCount": c.restarts, "started": False}
        if waiting is not None:
            status["state"] = {"waiting": {"reason": waiting}}
            status["lastState"] = {"terminated": terminated} if terminated else {}
        elif terminated is not None:
            status["state"] = {"terminated": terminated}
        else:
            status.update(ready=True, started=True,
                          state={"running": {"startedAt": c.started_at}})
        ready = "True" if status["ready"] else "False"
        body: dict = {"status": {"containerStatuses": [status], "conditions": [
            {"type": "Ready", "status": ready, "lastTransitionTime": _now()},
            {"type": "ContainersReady", "status": ready, "lastTransitionTime": _now()}]}}
        if phase is not None:
            body["status"]["phase"] = phase
        try:
            self.core.patch_namespaced_pod_status(c.name, c.namespace, body,
                                                  _content_type=_STRATEGIC)
        except ApiException as e:
            if e.status != 404:                       # a pod that is gone reports nothing
                raise

    # -- starting a container ---------------------------------------------------------------------
    def _run(self, c: _Container) -> None:
        c.log.parent.mkdir(parents=True, exist_ok=True)
        if c.output is None:
            c.output = endpoints.ContainerOutput(c.log, c.log.parent / endpoints.CRI_DIR)
        if c.restarts:
            with open(c.log, "a") as f:
                f.write(f"--- restart {c.restarts} ---\n")
            c.output.rotate()     # for `kubectl logs --previous`
        else:
            c.output.reset()
        try:
            # Killed with the runner's thread (a test session killed outright must not
            # leave workers training on, as a dead kubelet's machine leaves none).
            # stdout and stderr are pipes, read as a container runtime reads them: into the
            # plain log and the CRI-format one that kwok serves to `kubectl logs`.
            worker_args = _worker_args(c.argv)
            if self.fork_workers and worker_args is not None:
                c.proc = workerstart.fork_worker(worker_args, {**os.environ, **c.env},
                                                 new_session=True)
            else:
                c.proc = subprocess.Popen(c.argv, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                          env={**os.environ, **c.env}, start_new_session=True,
                                          preexec_fn=_die_with_parent)
            c.output.start(c.proc.stdout, c.proc.stderr)
        except OSError as e:                          # no such program: as a kubelet, fail
            c.output.note(f"cannot start {c.argv[:1]}: {e}\n")
            c.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(127)"])
        c.started_at = _now()
        if c.restarts:
            self._report(c)

    def _prepare(self, pod) -> _Container:
        ns, name = pod.metadata.namespace, pod.metadata.name
        root = self.workdir / ns / name
        root.mkdir(parents=True, exist_ok=True)
        container = pod.spec.containers[0]
        env = container_env(self.core, pod, container)
        projections: list = []
        mounts = mount_volumes(self.core, pod, container, root, self.claim_dir, projections)

        pod_ip = pod.status.pod_ip if pod.status else ""

        def expand(text: str) -> str:
            text = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)
            if text == WILDCARD and pod_ip:
                return pod_ip
            for mount_path, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
                if text == mount_path or text.startswith(mount_path + "/"):
                    return str(local) + text[len(mount_path):]
            return text

        env = {k: expand(v) for k, v in env.items()}
        argv = [expand(a) for a in (container.command or []) + (container.args or [])]
        if not argv:
            argv = [sys.executable, "-c", "import sys; sys.exit('the pod runner runs only "
                    "containers with a command: images are not pulled or run')"]
        elif argv[0] == "dynatrain":
            argv = [sys.executable, "-m", "dynatrain", *argv[1:]]
        if self.cpu_for_gpu_pods and _requests_gpu(container) and _is_worker(argv):
            # The last --backend and --threads win. One thread: torch's default (one per
            # core) in each of several workers on one machine oversubscribes it, and its
            # OpenMP threads spin at every barrier (measured in CI, 2 cores: gpt-tiny steps
            # of 3.6-7 s under dp=4; ~0.17 s with one thread).
            argv = [*argv, "--backend", "gloo", "--threads", "1"]
            if self.cpu_step_floor_s:
                argv += ["--min-step-seconds", f"{self.cpu_step_floor_s:g}"]
        return _Container(ns, name, pod.spec.node_name, argv, env, root / "container.log",
                          pod.spec.restart_policy or "Always", container.name,
                          projections=projections, uid=pod.metadata.uid,
                          pod_ip=pod.status.pod_ip if pod.status else "",
                          ports=[p.container_port for p in container.ports or []])

    def _resync(self, c: _Container) -> None:
        """Rewrite the pod's Secret and ConfigMap volumes whose data changed (one that is gone
        keeps its last content, as with a kubelet)."""
        from kubernetes.client.rest import ApiException

        for local, kind, name, items, mode in c.projections:
            try:
                data = volume_data(self.core, c.namespace, kind, name)
            except ApiException as e:
                if e.status == 404:
                    continue
                raise
            if project(local, items, data, mode=mode):
                self._say(f"[pods] {c.namespace}/{c.name}: {kind} {name} updated in its volume")


GPU_RESOURCE = "nvidia.com/gpu"


def _requests_gpu(container) -> bool:
    """Whether the container asks for ``nvidia.com/gpu`` (limits, or requests alone)."""
    res = container.resources
    if res is None:
        return False
    for amounts in (res.limits or {}, res.requests or {}):
        try:
            if int(amounts.get(GPU_RESOURCE, 0) or 0) > 0:
                return True
        except ValueError:
            pass                                   # not a count: the API server rejects it
    return False


def _is_worker(argv: list[str]) -> bool:
    """Whether ``argv`` (after ``dynatrain`` was made ``python -m dynatrain``) starts a
    DynaTrain worker: ``dynatrain worker ...`` or ``python -m dynatrain.agent.worker ...``."""
    return argv[1:4] == ["-m", "dynatrain", "worker"] or argv[1:3] == [
        "-m", "dynatrain.agent.worker"]


def _worker_args(argv: list[str]) -> list[str] | None:
    """The worker's own arguments, if ``argv`` starts a worker (:func:`_is_worker`) with this
    interpreter (what a fork of it would run the same)."""
    if argv[:1] != [sys.executable] or not _is_worker(argv):
        return None
    return argv[4:] if argv[2] == "dynatrain" else argv[3:]
