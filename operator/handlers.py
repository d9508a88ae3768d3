"""The kopf handlers: one daemon per DynaTrainJob runs its :class:`~.runtime.JobRuntime`.

kopf gives us the watch of DynaTrainJob objects, a daemon thread per job (started on create
and on operator start for jobs that exist: that is how a restarted operator takes over),
peering (only one operator of a peering group acts at a time: HA by standby replicas), and
the liveness endpoint. Everything the job does happens in the daemon's tick loop. Deleting a
job stops its daemon; its pods, Service, ConfigMap and Secret carry owner references to it, so
the cluster's garbage collector removes them (the operator deletes nothing itself).
"""

from __future__ import annotations

import logging
import os
import threading

import kopf
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from dynatrain.agent.metrics import REASONS, Metrics
from dynatrain.controller.core import JobFailed
from dynatrain.controller.job import JobError

from . import cluster as k
from .runtime import GROUP, PLURAL, VERSION, JobRuntime

TICK_S = float(os.environ.get("DYNATRAIN_OPERATOR_TICK_S", "0.5"))
_state = {"metrics": None, "api": None}
_lock = threading.Lock()


def _api() -> client.ApiClient:
    with _lock:
        if _state["api"] is None:
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config()
            else:   # read the path now: the client library fixed its default at import
                config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
            _state["api"] = client.ApiClient()
        return _state["api"]


def _metrics() -> Metrics:
    with _lock:
        if _state["metrics"] is None:
            m = Metrics(reasons=REASONS)
            m.serve(port=int(os.environ.get("DYNATRAIN_METRICS_PORT", "9090")),
                    addr=os.environ.get("DYNATRAIN_METRICS_ADDR", "0.0.0.0"))
            _state["metrics"] = m
        return _state["metrics"]


@kopf.on.login()
def login(**kwargs):
    """The pod's service account in a cluster, else $KUBECONFIG (read at login time)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return kopf.login_with_service_account(**kwargs)
    return kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    settings.peering.lifetime = int(os.environ.get("DYNATRAIN_PEERING_LIFETIME_S", "60"))
    settings.persistence.finalizer = "dynatrain.io/finalizer"
    settings.posting.level = logging.WARNING        # our own Events say what happened
    _metrics()


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=15, initial_delay=0)
def run_job(body, name, namespace, stopped, logger, **_) -> None:
    def log(text: str) -> None:
        logger.info(text)

    try:
        runtime = JobRuntime(dict(body), api=_api(),
                             rendezvous_host=os.environ.get("DYNATRAIN_RENDEZVOUS_HOST")
                             or os.environ.get("POD_IP") or "127.0.0.1",
                             metrics=_metrics(), log=log)
        runtime.ensure_objects()
    except JobError as e:
        logger.error(f"job {namespace}/{name} cannot run: {e}")
        _patch_failed(namespace, name, str(e))
        return
    try:
        while not stopped:
            runtime.update(dict(body))
            try:
                runtime.tick()
            except JobFailed:
                logger.error(f"job {namespace}/{name} failed; see its status and events")
                return
            except ApiException as e:
                logger.warning(f"API error, retrying: {e.status} {e.reason}")
            stopped.wait(TICK_S)
    finally:
        runtime.close()


def _patch_failed(namespace: str, name: str, message: str) -> None:
    api = client.CustomObjectsApi(_api())
    api.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, {
        "status": {"phase": "Failed", "conditions": [{
            "type": "Failed", "status": "True", "reason": "InvalidSpec",
            "message": message[:1000]}]}})
