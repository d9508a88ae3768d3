"""A real Kubernetes control plane on loopback, with simulated GPU nodes.

:class:`DevCluster` starts, in order and each only once the previous one is
ready: etcd, kube-apiserver (TLS with a throw-away PKI, Node+RBAC
authorization, the default admission plugins), kube-controller-manager,
kube-scheduler and kwok, then creates the simulated nodes and waits until they
are Ready and schedulable. Everything listens on 127.0.0.1 at ports chosen
free, keeps its state and logs in one work directory, and runs in its own
process group, so :meth:`DevCluster.stop` leaves nothing behind.

kube-controller-manager runs the controllers a job's life depends on (see
:data:`CONTROLLERS`): garbage collection of a deleted job's pods, Service,
ConfigMap and Secret through their owner references; node lifecycle (a node
whose heartbeat stops turns NotReady and is tainted, and the taint-eviction
controller evicts its pods with the ``DisruptionTarget`` condition); namespace
deletion; the ``default`` ServiceAccount and its tokens; the pod garbage
collector; and the PersistentVolume binder. Its timings are shortened
(:class:`NodeTimings`) so that a test sees a lost node within seconds.

kwok plays the simulated nodes' kubelets: it keeps their leases (the heartbeat) and
status and moves scheduled pods to Running. It runs no containers; the
:mod:`.pods` runner does that part, as local processes. kwok's server is also the
nodes' kubelet endpoint (their InternalIP is 127.0.0.1, their kubelet port kwok's): the
apiserver proxies ``kubectl logs`` and ``port-forward`` there, and kwok serves them from the
rules the pod runner publishes (:mod:`.endpoints`, whose CRDs are installed before kwok
starts); ``kubectl exec`` is refused by an admission policy that says why. A node of
:attr:`ClusterConfig.real_nodes` is run by a real kubelet with containerd instead
(:mod:`.kubelet`): its pods run in containers.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import ssl
import sys
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kubernetes import client
from kubernetes import config as k8s_config

from .build import ensure_built
from .gobuild import Built
from . import kueue
from .certs import ClientIdentity, Pki, write_pki
from .crds import wait_established
from .endpoints import KINDS as KWOK_CRD_KINDS
from .endpoints import crd_manifests, exec_refusal_manifests
from .errors import DevClusterError
from .kubeconfig import build_kubeconfig, build_token_kubeconfig, write_kubeconfig
from .kubelet import RealNode, RealNodeConfig
from .nodes import KWOK_ANNOTATION, NodePool, add_nodes, node_is_ready
from .volumes import storage_class_manifest
from dynatrain.ports import free_port

from .processes import Component, wait_until

STAGES_FILE = Path(__file__).with_name("kwok-stages.yaml")

_ADMIN = ClientIdentity(name="admin", user="dynatrain-admin", groups=("system:masters",))
_SCHEDULER = ClientIdentity(name="kube-scheduler", user="system:kube-scheduler")
# RBAC's bootstrap policy knows this user; with --use-service-account-credentials each
# controller then acts as its own ServiceAccount (system:controller:*), as on kubeadm clusters.
_CONTROLLER_MANAGER = ClientIdentity(name="kube-controller-manager",
                                     user="system:kube-controller-manager")
# kwok writes node and pod status, leases and events for every simulated
# node; no built-in role covers that, and in a throw-away cluster a
# dedicated ClusterRole would only be a copy of the list to keep up to date.
_KWOK = ClientIdentity(name="kwok", user="kwok-controller", groups=("system:masters",))
# The apiserver's identity towards kubelets (logs, exec, port-forward); a real node's kubelet
# accepts certificates of the cluster CA and authorizes them all.
_APISERVER_KUBELET_CLIENT = ClientIdentity(name="apiserver-kubelet-client",
                                           user="kube-apiserver-kubelet-client")


def _node_identity(name: str) -> ClientIdentity:
    """A kubelet's identity: the Node authorizer and NodeRestriction admission read it."""
    return ClientIdentity(name=f"node-{name}", user=f"system:node:{name}",
                          groups=("system:nodes",))


def _seconds(name: str, default: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get(name, default)))


CONTROLLERS = (
    "garbage-collector-controller",        # a deleted job's pods, Service, ConfigMap, Secret
    "node-lifecycle-controller",           # NotReady/unreachable taints on silent nodes
    "taint-eviction-controller",           # evicts pods from NoExecute-tainted nodes
    "pod-garbage-collector-controller",    # pods of deleted nodes, terminated pods
    "namespace-controller",                # finishes namespace deletion
    "serviceaccount-controller",           # the `default` ServiceAccount of each namespace
    "serviceaccount-token-controller",     # legacy token Secrets; the controllers' own tokens
    "persistentvolume-binder-controller",  # binds claims to the volumes the pod runner makes
    "root-ca-certificate-publisher-controller",  # kube-root-ca.crt, for real pods' SA volume
    "resourcequota-controller",            # a quota's usage, which quota admission needs
)
"""The kube-controller-manager controllers the dev cluster runs. Workload controllers
(Deployment, ReplicaSet, Job...) are left out: nothing the tests or the operator's jobs create
needs them, and each one costs CPU on a 2-core machine."""


@dataclass(frozen=True, kw_only=True)
class NodeTimings:
    """How fast a lost node is noticed. Real clusters use a 40 s lease, a 40-50 s grace period
    and a 300 s default toleration; these are shortened so a test sees the whole chain (lease
    expires, NotReady, taint, eviction) in about :attr:`monitor_grace_s` +
    :attr:`toleration_s` seconds, and kept long enough that a busy 2-core machine does not
    make healthy nodes flap."""

    lease_s: int = 8
    """kwok's node lease duration (it renews well within it): the heartbeat."""
    monitor_period_s: int = 1
    """How often the node lifecycle controller looks at the heartbeats."""
    monitor_grace_s: int = 12
    """A node silent for this long is NotReady (Unknown) and tainted unreachable."""
    toleration_s: int = 2
    """The default not-ready / unreachable toleration given to pods that set none (the
    DefaultTolerationSeconds admission plugin): how long they stay on a silent node."""

    def __post_init__(self) -> None:
        if not 0 < self.lease_s < self.monitor_grace_s:
            raise ValueError(f"NodeTimings: lease_s={self.lease_s} must be positive and below "
                             f"monitor_grace_s={self.monitor_grace_s}, or every node flaps")
        if self.monitor_period_s <= 0 or self.toleration_s < 0:
            raise ValueError(f"NodeTimings: monitor_period_s={self.monitor_period_s} must be "
                             f"positive and toleration_s={self.toleration_s} not negative")


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """What to start. Every timeout can be raised by an environment variable."""

    pools: tuple[NodePool, ...] = (NodePool(),)
    """Simulated nodes to create once the control plane is up."""
    real_nodes: tuple[RealNodeConfig, ...] = ()
    """Nodes run by a real kubelet with containerd (:mod:`.kubelet`; root only)."""
    repo_root: Path | None = None
    """The source checkout the real nodes' worker image is built from (default: this one)."""
    kubeconfig: Path | None = None
    """Where to write the admin kubeconfig; default ``<workdir>/admin.kubeconfig``."""
    workdir: Path | None = None
    """State and logs; default a fresh temporary directory, removed by stop()."""
    keep_workdir: bool = False
    """Keep the work directory (logs!) after stop(); a given workdir is always kept."""
    service_cidr: str = "10.96.0.0/16"
    """ClusterIP range; its first address is the ``kubernetes`` Service."""
    pod_cidr: str = "10.244.0.0/16"
    """Range kwok assigns pod IPs from."""
    node_timings: NodeTimings = field(default_factory=NodeTimings)
    """How fast a node whose heartbeat stops is noticed and its pods evicted."""
    kueue: bool = False
    """Also start Kueue's manager with its CRDs and webhooks (:mod:`.kueue`; root only)."""
    controllers: tuple[str, ...] = CONTROLLERS
    """kube-controller-manager's ``--controllers``."""
    start_timeout: datetime.timedelta = field(
        default_factory=lambda: _seconds("DYNATRAIN_DEVCLUSTER_START_TIMEOUT_S", 120))
    """Limit for each component to become ready and for the nodes to be Ready."""
    stop_timeout: datetime.timedelta = field(
        default_factory=lambda: _seconds("DYNATRAIN_DEVCLUSTER_STOP_TIMEOUT_S", 15))
    """Grace period for each component after SIGTERM, before SIGKILL."""

    def __post_init__(self) -> None:
        names = ([n for pool in self.pools for n in pool.node_names()]
                 + [n.name for n in self.real_nodes])
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"ClusterConfig.pools name the same nodes twice: {duplicates}; "
                             "give the pools different name_prefix or first_index")
        for name in ("start_timeout", "stop_timeout"):
            if getattr(self, name) <= datetime.timedelta(0):
                raise ValueError(f"ClusterConfig.{name}={getattr(self, name)} must be positive")


def _first_ip(cidr: str) -> str:
    return str(ipaddress.ip_network(cidr)[1])


class DevCluster:
    """A running dev cluster; use as a context manager or call start()/stop()."""

    def __init__(self, config: ClusterConfig | None = None, *,
                 binaries: Built | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.config = config or ClusterConfig()
        self._binaries = binaries
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._components: list[Component] = []
        self._owns_workdir = self.config.workdir is None
        self.workdir: Path | None = None
        self.server: str | None = None
        self.kubeconfig: Path | None = None
        """The admin kubeconfig, once the cluster and its nodes are ready."""
        self._admin_kubeconfig: Path | None = None
        self._ca: Path | None = None
        self.nodes: list[str] = []
        self.real_nodes: list[RealNode] = []
        """The kubelet-run nodes, started."""
        self.kubelet_port: int | None = None
        """The simulated nodes' kubelet port: kwok's server, on 127.0.0.1."""
        self._api: client.ApiClient | None = None

    # -- lifecycle ---------------------------------------------------------

    def __enter__(self) -> DevCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> DevCluster:
        try:
            self._start()
        except BaseException:
            # Includes KeyboardInterrupt: a half-started cluster must not leak processes.
            self.stop()
            raise
        return self

    def _start(self) -> None:
        cfg = self.config
        binaries = self._binaries or ensure_built(log=self._log)
        if cfg.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="dynatrain-devcluster-"))
        else:
            self.workdir = cfg.workdir
            self.workdir.mkdir(parents=True, exist_ok=True)
        work = self.workdir
        logs = work / "logs"
        self._log(f"[devcluster] work dir {work}, logs in {logs}")

        nodes = tuple(_node_identity(n.name) for n in cfg.real_nodes)
        pki = write_pki(work / "pki", clients=(_ADMIN, _SCHEDULER, _CONTROLLER_MANAGER, _KWOK,
                                               _APISERVER_KUBELET_CLIENT, *nodes),
                        service_ip=_first_ip(cfg.service_cidr))
        self._ca = pki.ca.cert

        etcd_url = self._start_etcd(binaries, work, logs)
        self._start_apiserver(binaries, work, logs, pki, etcd_url)
        admin = build_kubeconfig(server=self.server, ca=pki.ca.cert,
                                 client=pki.clients["admin"], user=_ADMIN.user)
        self._admin_kubeconfig = write_kubeconfig(work / "admin.kubeconfig", admin)
        # Before kube-controller-manager: its garbage collector then watches kwok's rules
        # from the start (it looks for new resource types only every 30 s).
        self._install_pod_endpoints()
        self._start_controller_manager(binaries, work, logs, pki)
        self._start_scheduler(binaries, work, logs, pki)
        self._start_kwok(binaries, work, logs, pki)
        if cfg.kueue:
            kueue.install(kubectl=binaries.path("kubectl"), kubeconfig=self._admin_kubeconfig,
                          core=self.core(), ca=pki.ca, work=work, timeout=cfg.start_timeout,
                          start=lambda name, argv: self._start_component(name, argv, logs),
                          log=self._log)
        # The default StorageClass: claims of it are provisioned by the pod runner (.pods).
        client.StorageV1Api(self.api_client()).create_storage_class(storage_class_manifest())
        for pool in cfg.pools:
            self.add_pool(pool)
        for node in cfg.real_nodes:
            self._start_real_node(binaries, work, pki, node)
        # Written last: whoever waits for this file (a script, a person) may
        # use the cluster as soon as it appears, nodes included.
        self.kubeconfig = (write_kubeconfig(cfg.kubeconfig, admin) if cfg.kubeconfig
                           else self._admin_kubeconfig)

    def stop(self) -> None:
        """Stop every component (newest first) and remove an owned work dir."""
        errors = []
        # Real nodes first, while the apiserver still answers: their kubelets stop their own
        # pods, which unmounts volumes and removes network namespaces the proper way.
        for node in reversed(self.real_nodes):
            try:
                core = self.core() if self._admin_kubeconfig else None
            except Exception:  # noqa: BLE001 - no API: clean up without draining
                core = None
            errors += [f"real node {node.config.name}: {e}"
                       for e in node.stop(core, self.config.stop_timeout)]
        self.real_nodes.clear()
        for component in reversed(self._components):
            try:
                component.stop(self.config.stop_timeout)
            except Exception as exc:  # noqa: BLE001 - keep stopping the rest, report below
                errors.append(f"{component.name}: {type(exc).__name__}: {exc} "
                              f"(log: {component.log})")
        self._components.clear()
        if self._api is not None:
            self._api.close()
            self._api = None
        if self.workdir and self._owns_workdir and not self.config.keep_workdir and not errors:
            shutil.rmtree(self.workdir, ignore_errors=False)
            self.workdir = None
        if errors:
            raise DevClusterError("stopping the dev cluster failed: " + "; ".join(errors))

    # -- clients -----------------------------------------------------------

    def api_client(self) -> client.ApiClient:
        """An ApiClient for the admin identity (shared, closed by stop())."""
        if self._admin_kubeconfig is None:
            raise DevClusterError("the dev cluster is not started: no kubeconfig yet")
        if self._api is None:
            self._api = k8s_config.new_client_from_config(
                config_file=str(self._admin_kubeconfig))
        return self._api

    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api_client())

    def wait_established(self, *names: str) -> None:
        """Until the apiserver serves the CRDs ``names`` (after applying them): see
        :mod:`.crds` for why not ``kubectl wait``."""
        wait_established(self.api_client(), names)

    def service_account_kubeconfig(
            self, namespace: str, name: str, path: Path | None = None, *,
            expiration: datetime.timedelta = datetime.timedelta(hours=24)) -> Path:
        """A kubeconfig that acts as the ServiceAccount ``namespace/name``, as a pod of it would.

        Its bearer token comes from the TokenRequest API (the apiserver signs it with the
        service-account key; no Secret is made), valid for ``expiration`` and bound to nothing
        else, so it outlives any pod; the account may do what RBAC grants it and nothing more.
        Written to ``path`` (default ``<workdir>/sa-<namespace>-<name>.kubeconfig``)."""
        if self._ca is None or self.server is None:
            raise DevClusterError("the dev cluster is not started: no apiserver yet")
        review = self.core().create_namespaced_service_account_token(name, namespace, {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": int(expiration.total_seconds())}})
        config = build_token_kubeconfig(
            server=self.server, ca=self._ca, token=review.status.token,
            user=f"system:serviceaccount:{namespace}:{name}", namespace=namespace)
        return write_kubeconfig(path or self.workdir / f"sa-{namespace}-{name}.kubeconfig",
                                config)

    # -- nodes -------------------------------------------------------------

    def add_pool(self, pool: NodePool) -> list[str]:
        """Create the nodes of ``pool`` and wait until kwok has made them Ready."""
        core = self.core()
        names = add_nodes(core, pool)
        kwok = next(c for c in self._components if c.name == "kwok")

        def all_ready() -> bool:
            # Ready, and the node lifecycle controller has lifted the not-ready taint that
            # admission puts on every new node (TaintNodesByCondition): pods can land there.
            ready = {n.metadata.name for n in core.list_node().items
                     if node_is_ready(n) and not any(
                         t.key.startswith("node.kubernetes.io/")
                         for t in (n.spec.taints or []))}
            return set(names) <= ready

        wait_until(f"nodes {names} to become Ready and schedulable (kwok marks them, "
                   "the node lifecycle controller lifts their not-ready taint)", all_ready,
                   timeout=self.config.start_timeout, component=kwok)
        self.nodes.extend(names)
        return names

    # -- components ----------------------------------------------------------

    def _start_component(self, name: str, argv: list[str], logs: Path) -> Component:
        component = Component.start(name, argv, log=logs / f"{name}.log", cwd=self.workdir)
        self._components.append(component)
        return component

    def _start_etcd(self, binaries: Built, work: Path, logs: Path) -> str:
        client_port, peer_port = free_port(), free_port()
        client_url = f"http://127.0.0.1:{client_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        etcd = self._start_component("etcd", [
            str(binaries.path("etcd")),
            "--name=dev",
            f"--data-dir={work / 'etcd'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=dev={peer_url}",
            # Test data is disposable: skipping fsync makes writes ~10x faster
            # on slow disks, and crash safety is meaningless here.
            "--unsafe-no-fsync",
            "--log-level=warn",
        ], logs)

        def healthy() -> bool:
            with urllib.request.urlopen(f"{client_url}/health", timeout=2) as resp:
                return json.load(resp).get("health") == "true"

        wait_until(f"etcd at {client_url}/health", healthy,
                   timeout=self.config.start_timeout, component=etcd)
        return client_url

    def _start_apiserver(self, binaries: Built, work: Path, logs: Path, pki: Pki,
                         etcd_url: str) -> None:
        port = free_port()
        self.server = f"https://127.0.0.1:{port}"
        apiserver = self._start_component("kube-apiserver", [
            str(binaries.path("kube-apiserver")),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={work / 'apiserver-certs'}",
            f"--tls-cert-file={pki.apiserver.cert}",
            f"--tls-private-key-file={pki.apiserver.key}",
            f"--kubelet-client-certificate={pki.clients['apiserver-kubelet-client'].cert}",
            f"--kubelet-client-key={pki.clients['apiserver-kubelet-client'].key}",
            # Node names do not resolve here; a real node's InternalIP is its bridge address,
            # a simulated node's 127.0.0.1, where kwok's server is its kubelet (.endpoints).
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            f"--client-ca-file={pki.ca.cert}",
            f"--service-account-key-file={pki.service_account_pub}",
            f"--service-account-signing-key-file={pki.service_account_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={self.config.service_cidr}",
            "--authorization-mode=Node,RBAC",
            # Every default admission plugin is on (ServiceAccount, TaintNodesByCondition,
            # DefaultTolerationSeconds...): kube-controller-manager does what they wait for.
            "--default-not-ready-toleration-seconds="
            f"{self.config.node_timings.toleration_s}",
            "--default-unreachable-toleration-seconds="
            f"{self.config.node_timings.toleration_s}",
            # The `kubernetes` Service's endpoints may not be a loopback
            # address, so the apiserver must not try to publish itself.
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
        ], logs)
        ctx = ssl.create_default_context(cafile=str(pki.ca.cert))

        def ready() -> bool:
            # /readyz is open to anonymous users (system:public-info-viewer)
            # and turns 200 only when every post-start hook, RBAC bootstrap
            # included, has finished.
            with urllib.request.urlopen(f"{self.server}/readyz", timeout=5, context=ctx) as resp:
                return resp.status == 200

        wait_until(f"kube-apiserver at {self.server}/readyz", ready,
                   timeout=self.config.start_timeout, component=apiserver)

    def _write_component_kubeconfig(self, pki: Pki, ident: ClientIdentity) -> Path:
        return write_kubeconfig(
            self.workdir / f"{ident.name}.kubeconfig",
            build_kubeconfig(server=self.server, ca=pki.ca.cert,
                             client=pki.clients[ident.name], user=ident.user))

    def _start_controller_manager(self, binaries: Built, work: Path, logs: Path,
                                  pki: Pki) -> None:
        kubeconfig = self._write_component_kubeconfig(pki, _CONTROLLER_MANAGER)
        port = free_port()
        t = self.config.node_timings
        kcm = self._start_component("kube-controller-manager", [
            str(binaries.path("kube-controller-manager")),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--authentication-skip-lookup=true",   # as for the scheduler, below
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={work / 'controller-manager-certs'}",
            "--leader-elect=false",
            f"--controllers={','.join(self.config.controllers)}",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki.service_account_key}",
            f"--root-ca-file={pki.ca.cert}",
            f"--node-monitor-period={t.monitor_period_s}s",
            f"--node-monitor-grace-period={t.monitor_grace_s}s",
            # kwok assigns pod IPs itself (--cidr); no cloud provider, no node IPAM.
            "--allocate-node-cidrs=false",
            "--profiling=false",
            "--v=1",
        ], logs)
        self._wait_healthz(kcm, port)

    def _start_scheduler(self, binaries: Built, work: Path, logs: Path, pki: Pki) -> None:
        kubeconfig = self._write_component_kubeconfig(pki, _SCHEDULER)
        port = free_port()
        scheduler = self._start_component("kube-scheduler", [
            str(binaries.path("kube-scheduler")),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            # Only /healthz and /metrics are served; without this the
            # scheduler polls for a front-proxy CA that this cluster has no
            # use for and logs an error about it several times a second.
            "--authentication-skip-lookup=true",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={work / 'scheduler-certs'}",
            # One scheduler per cluster: leader election would only add a
            # lease round-trip (seconds) before the first pod is scheduled.
            "--leader-elect=false",
            "--profiling=false",
            "--v=1",
        ], logs)
        self._wait_healthz(scheduler, port)

    def _wait_healthz(self, component: Component, port: int) -> None:
        """Wait for a control-plane component's ``https://127.0.0.1:PORT/healthz``.

        kube-scheduler and kube-controller-manager serve it with a self-signed
        certificate they generate themselves; on loopback, the status code is enough."""
        ctx = ssl._create_unverified_context()  # noqa: S323 - loopback health probe only
        url = f"https://127.0.0.1:{port}/healthz"

        def healthy() -> bool:
            with urllib.request.urlopen(url, timeout=5, context=ctx) as resp:
                return resp.status == 200

        wait_until(f"{component.name} at {url}", healthy, timeout=self.config.start_timeout,
                   component=component)

    def _install_pod_endpoints(self) -> None:
        """What kwok's server needs before kwok starts (it lists them at once): the CRDs of the
        rules it serves pods' logs and port-forwards from; and, where every node is simulated,
        the policy that refuses ``kubectl exec`` saying why (:mod:`.endpoints`)."""
        api = self.api_client()
        extensions = client.ApiextensionsV1Api(api)
        names = [extensions.create_custom_resource_definition(crd).metadata.name
                 for crd in crd_manifests()]
        wait_established(api, names, timeout=self.config.start_timeout)
        if not self.config.real_nodes:
            policy, binding = exec_refusal_manifests()
            admission = client.AdmissionregistrationV1Api(api)
            admission.create_validating_admission_policy(policy)
            admission.create_validating_admission_policy_binding(binding)

    def _start_kwok(self, binaries: Built, work: Path, logs: Path, pki: Pki) -> None:
        kubeconfig = self._write_component_kubeconfig(pki, _KWOK)
        port = free_port()
        key, value = KWOK_ANNOTATION
        kwok = self._start_component("kwok", [
            str(binaries.path("kwok")),
            f"--kubeconfig={kubeconfig}",
            f"--config={STAGES_FILE}",
            f"--manage-nodes-with-annotation-selector={key}={value}",
            f"--cidr={self.config.pod_cidr}",
            # The nodes' InternalIP, where the apiserver calls their kubelet: kwok's server.
            "--node-ip=127.0.0.1",
            # The heartbeat the node lifecycle controller watches (kube-node-lease).
            f"--node-lease-duration-seconds={self.config.node_timings.lease_s}",
            f"--server-address=127.0.0.1:{port}",
            # The port the nodes report as their kubelet's (kwok-stages.yaml, NodePort); the
            # server listens on --server-address, which wins over --node-port for that.
            f"--node-port={port}",
            # Rules read from the apiserver, published per pod by the pod runner. kwok serves
            # HTTPS with a certificate of its own; the apiserver, given no
            # --kubelet-certificate-authority, does not check kubelets' serving certificates.
            f"--enable-crds={','.join(KWOK_CRD_KINDS)}",
        ], logs)
        self.kubelet_port = port

        def healthy() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
                return resp.status == 200

        wait_until(f"kwok at http://127.0.0.1:{port}/healthz", healthy,
                   timeout=self.config.start_timeout, component=kwok)

    def _start_real_node(self, binaries: Built, work: Path, pki: Pki,
                         node: RealNodeConfig) -> None:
        ident = _node_identity(node.name)
        real = RealNode(
            node, workdir=work / "nodes" / node.name, server=self.server, ca=pki.ca.cert,
            client=pki.clients[ident.name],
            lease_s=self.config.node_timings.lease_s, kubelet_binary=binaries.path("kubelet"),
            start_component=lambda name, argv: self._start_component(
                f"{node.name}-{name}", argv, work / "logs"),
            log=self._log, repo_root=self.config.repo_root)
        # Listed before it starts, so that a failed start is cleaned up by stop().
        self.real_nodes.append(real)
        real.start(self.config.start_timeout)
        core = self.core()

        def ready() -> bool:
            n = core.read_node(node.name)
            return node_is_ready(n) and not any(
                t.key.startswith("node.kubernetes.io/") for t in (n.spec.taints or []))

        wait_until(f"real node {node.name} to register, become Ready and schedulable", ready,
                   timeout=self.config.start_timeout, component=real.kubelet)
        self.nodes.append(node.name)

    def component_logs(self) -> dict[str, Path]:
        """Log file of each running component, by name."""
        return {c.name: c.log for c in self._components}
