"""The kopf handlers: one daemon per DynaTrainJob reconciles it with its :class:`~.runtime.JobRuntime`.

kopf gives us the watch of DynaTrainJob objects, a daemon thread per job (started on create
and on operator start for jobs that exist: that is how a restarted operator, or a standby
replica that won the leader Lease (:mod:`.leader`), takes over), and the liveness endpoint. The daemon never gives up on its job: every pass's error is a status
condition and a retry with back-off (the runtime's), and it returns only when the job is over
(Succeeded or Failed) or deleted. Deleting a job stops its daemon; its pods, Service, ConfigMap
and Secret carry owner references to it, so the cluster's garbage collector removes them.

All jobs share one :class:`~.informer.ClusterView` (one watch of nodes and one of pods for the
whole operator), so a pass reads memory, not the apiserver; a change to a job's pods or to a
node wakes that job's pass early.

Each job has its own :class:`~dynatrain.agent.metrics.Metrics` (every series labelled with its
namespace and name), all exposed on the operator's one ``/metrics`` endpoint through a
:class:`~dynatrain.agent.metrics.JobMetricsSet`, next to the operator's own metrics. A job's
series live as long as the DynaTrainJob object: a finished job's last values stay visible, a
deleted job's are dropped (:func:`forget_job`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import kopf
from kubernetes import client, config
from prometheus_client import CollectorRegistry, start_http_server

from dynatrain.agent.metrics import REASONS, JobMetricsSet, Metrics

from . import cluster as k
from . import pki
from . import guard, netpol
from .informer import ClusterView
from .sharing import Board, Priorities
from .runtime import GROUP, PLURAL, VERSION, JobRuntime, Settings, seconds_to_expiry
from .telemetry import CountingApiClient, OperatorMetrics

_state = {"jobs": None, "api": None, "view": None, "operator_metrics": None, "sharing": None}
_lock = threading.RLock()
USER_AGENT = "dynatrain-operator"
MAX_JOBS = int(os.environ.get("DYNATRAIN_MAX_JOBS", "1024"))
"""Jobs one operator runs at once (one daemon thread each)."""
TTL_CHECK_S = 1.0
"""How often a finished job with ``spec.ttlSecondsAfterFinished`` is looked at."""
CANCELLATION_POLL_S = 1.0
"""How often kopf checks whether a stopped job's timer and daemon have ended (see configure)."""


def settings() -> Settings:
    """From the environment ``dynatrain operator`` sets from its flags."""
    env = os.environ.get
    return Settings(tick_s=float(env("DYNATRAIN_OPERATOR_TICK_S", "0.5")),
                    max_pods_per_job=int(env("DYNATRAIN_MAX_PODS_PER_JOB", "256")),
                    gang_wait_s=float(env("DYNATRAIN_GANG_WAIT_S", "60")),
                    worker_cpu=env("DYNATRAIN_WORKER_CPU", k.DEFAULT_WORKER_CPU),
                    worker_memory=env("DYNATRAIN_WORKER_MEMORY", k.DEFAULT_WORKER_MEMORY),
                    cert_lifetime_s=float(env("DYNATRAIN_CERT_LIFETIME_S",
                                              str(pki.DEFAULT_CERT_LIFETIME_S))),
                    allowed_images=guard.parse_image_prefixes(
                        env("DYNATRAIN_ALLOWED_IMAGES", "")),
                    network_policy=env("DYNATRAIN_NETWORK_POLICY", "1") == "1",
                    # Where this operator's pods are (the downward API's POD_NAMESPACE in a
                    # cluster) and their labels: the job policies admit those pods.
                    operator_namespace=env("DYNATRAIN_OPERATOR_NAMESPACE")
                    or env("POD_NAMESPACE") or "default",
                    operator_pod_labels=guard.parse_labels(
                        env("DYNATRAIN_OPERATOR_POD_LABELS", ""), "--operator-pod-labels")
                    or dict(netpol.DEFAULT_OPERATOR_POD_LABELS),
                    metrics_namespaces=guard.parse_labels(
                        env("DYNATRAIN_METRICS_NAMESPACE_SELECTOR", ""),
                        "--metrics-namespace-selector"))


def _api() -> client.ApiClient:
    with _lock:
        if _state["api"] is None:
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config()
            else:   # read the path now: the client library fixed its default at import
                config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
            api = CountingApiClient(metrics=_operator_metrics())
            api.user_agent = USER_AGENT        # tells its requests apart in audit logs
            _state["api"] = api
        return _state["api"]


def _view() -> ClusterView:
    with _lock:
        if _state["view"] is None:
            view = ClusterView(_api(), log=logging.getLogger("dynatrain.informer").info)
            view.start()
            _state["view"] = view
    _state["view"].wait_synced(60)
    return _state["view"]


def _sharing() -> tuple[Board, Priorities]:
    """The one board every job's share of its pool is divided on (:mod:`.sharing`)."""
    with _lock:
        if _state["sharing"] is None:
            _state["sharing"] = (Board(), Priorities(
                _api(), log=logging.getLogger("dynatrain.sharing").info))
        return _state["sharing"]


def _operator_metrics() -> OperatorMetrics:
    _serve_metrics()
    return _state["operator_metrics"]


def _jobs() -> JobMetricsSet:
    _serve_metrics()
    return _state["jobs"]


def _serve_metrics() -> None:
    """One registry, served on ``/metrics``: the jobs' series and the operator's own."""
    with _lock:
        if _state["jobs"] is not None:
            return
        registry = CollectorRegistry()
        jobs = JobMetricsSet()
        registry.register(jobs)
        _state["operator_metrics"] = OperatorMetrics(registry)
        start_http_server(int(os.environ.get("DYNATRAIN_METRICS_PORT", "9090")),
                          addr=os.environ.get("DYNATRAIN_METRICS_ADDR", "0.0.0.0"),
                          registry=registry)
        _state["jobs"] = jobs


def forget_job(namespace: str, name: str, uid: str) -> None:
    """Drop the series of job ``uid`` (not those of a re-created job of the same name)."""
    if _jobs().remove(namespace, name, uid):
        _operator_metrics().forget(namespace, name)


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **kwargs):
    """The pod's service account in a cluster (:func:`in_cluster_login`), else $KUBECONFIG
    (read at login time)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster_login(settings)
    return kopf.login_with_kubeconfig(settings=settings, **kwargs)


SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def in_cluster_login(settings: kopf.OperatorSettings, *, env=os.environ,
                     account: Path = SERVICE_ACCOUNT) -> kopf.ConnectionInfo:
    """kopf's connection as the Kubernetes client's in-cluster config makes its own (and
    client-go's ``rest.InClusterConfig``): the API server at ``$KUBERNETES_SERVICE_HOST``:
    ``$KUBERNETES_SERVICE_PORT``, the pod's service account token and CA.

    kopf's ``login_with_service_account`` names ``https://kubernetes.default.svc`` instead,
    which needs the cluster's DNS: in a pod without it (host network, DNS down) kopf reached
    nothing while the operator's other client, on the environment's address, worked: the pod
    was Ready (kopf's liveness endpoint answers regardless) and handled no job. Seen running
    the chart's Deployment on the dev cluster's real node (tests/k8s/test_real_node.py)."""
    host, port = env["KUBERNETES_SERVICE_HOST"], env.get("KUBERNETES_SERVICE_PORT") or "443"
    token = account / "token"
    if not token.is_file():
        raise kopf.LoginError(
            f"KUBERNETES_SERVICE_HOST is {host!r} but {token} is missing: the pod has no "
            "service account token (automountServiceAccountToken: false?); the operator "
            "needs its ServiceAccount's token to reach the API server")
    namespace = account / "namespace"
    ca = account / "ca.crt"
    return kopf.ConnectionInfo(
        server=f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}",
        ca_path=str(ca) if ca.is_file() else None,
        token=token.read_text().strip() or None,
        default_namespace=namespace.read_text().strip() if namespace.is_file() else None,
        trust_env=settings.networking.trust_env)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    settings.persistence.finalizer = "dynatrain.io/finalizer"
    settings.posting.level = logging.WARNING        # our own Events say what happened
    # Each job's daemon holds one thread of kopf's executor for the job's whole life, and
    # the executor's default size is min(32, cores + 4): on a 2-core node only 6 jobs ran,
    # the others waited, silently, for one of those to end.
    settings.execution.max_workers = MAX_JOBS
    # A timer or daemon asked to stop (its job is being deleted) is checked for having ended
    # every `cancellation_polling` seconds, 60 by default, and the job's finalizer stays until
    # it has. The expire timer deletes its own job: when the deletion arrived while that
    # handler was still returning (about half the time on a loaded machine), the job outlived
    # its TTL by a minute.
    settings.background.cancellation_polling = CANCELLATION_POLL_S
    _serve_metrics()


@kopf.on.cleanup()
def stop_view(**_) -> None:
    view = _state["view"]
    if view is not None:
        view.stop()


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def drop_metrics(name, namespace, uid, **_) -> None:
    """A deleted job's series leave the operator's ``/metrics`` (a job that finished earlier
    has no daemon left to do it)."""
    forget_job(namespace, name, uid)


@kopf.timer(GROUP, VERSION, PLURAL, interval=TTL_CHECK_S,
            when=lambda body, **_: seconds_to_expiry(body) is not None)
def expire(body, name, namespace, logger, **_) -> None:
    """``spec.ttlSecondsAfterFinished``: a finished job is deleted once it passes (its pods,
    Service, ConfigMap and Secrets go with it: they are owned). A timer rather than the job's
    daemon, which ends with the job: the TTL may be set or changed after the end."""
    left = seconds_to_expiry(body)
    if left is None or left > 0:
        return
    logger.info(f"job {namespace}/{name} is {body['status']['phase']} and its "
                f"ttlSecondsAfterFinished has passed: deleting it")
    custom = client.CustomObjectsApi(_api())
    try:
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except client.exceptions.ApiException as e:
        if e.status != 404:
            raise


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=15, initial_delay=0)
def run_job(body, name, namespace, uid, stopped, logger, **_) -> None:
    view = _view()
    config = settings()
    metrics = _jobs().add(Metrics(namespace=namespace, job=name, reasons=REASONS), uid)
    board, priorities = _sharing()
    runtime = JobRuntime(dict(body), api=_api(), view=view,
                         rendezvous_host=os.environ.get("DYNATRAIN_RENDEZVOUS_HOST")
                         or os.environ.get("POD_IP") or "127.0.0.1",
                         metrics=metrics, log=logger.info, settings=config,
                         board=board, priorities=priorities)
    since = 0
    # Bound once: after forget_job, a pass still running records into a series nobody sees,
    # and does not bring it back.
    reconcile_seconds = _operator_metrics().reconcile.labels(namespace, name)
    try:
        while not stopped:
            with reconcile_seconds.time():
                delay = runtime.reconcile(dict(body))
            if delay is None:
                logger.info(f"job {namespace}/{name} is {runtime.phase}; its daemon ends")
                return
            # Wait out the delay: a back-off in steps of a tick (an edited spec cuts it
            # short), a tick woken early by a change to the job's pods or to a node.
            deadline = time.monotonic() + delay
            while not stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                changed = view.wait_for_change(namespace, name, since,
                                               min(left, config.tick_s))
                woke, since = changed != since, changed
                if (woke and delay <= config.tick_s) or body.get("spec") != runtime.seen_spec:
                    break
    finally:
        runtime.close()
        if stopped.reason is not None and kopf.DaemonStoppingReason.RESOURCE_DELETED in \
                stopped.reason:
            # A worker takes SIGTERM as notice and trains on until it is switched out, which
            # nobody will do now: stop the deleted job's workers at once (grace 0).
            runtime.stop_workers()
            # Also here: the deletion handler may have run before this daemon added them.
            forget_job(namespace, name, uid)
