"""The small values every room of a job's runtime shares: the operator's settings, back-off.

:class:`Settings` (the ``dynatrain operator`` flags), :class:`Backoff`, the :class:`Waiting`
exception a pass raises when somebody must act, and two helpers (the apiserver's message, the
time in UTC). They are a module of their own because :mod:`.runtime`, :mod:`.jobtls`,
:mod:`.pods` and :mod:`.status` all use them and none of those should import another just for
them (runtime.py re-exports them for the modules and tests that import them from there).
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass, field

from kubernetes.client.rest import ApiException

from . import cluster as k
from . import netpol, pki


@dataclass(frozen=True)
class Settings:
    """Operator-wide settings (``dynatrain operator`` flags, Helm chart values)."""

    tick_s: float = 0.5
    """Longest wait between passes while all is well (a watched change wakes a pass early)."""
    max_pods_per_job: int = 256
    """No job gets more worker pods than this, whatever its maxWorkers."""
    gang_wait_s: float = 60.0
    """A job that has not started may hold part of its minimum this long while its other pods
    wait; then it lets go of them (--gang-wait; :meth:`.pods.WorkerPods.scale`)."""
    create_batch: int = 16
    """Pods created per pass at most (the rest follow on the next passes)."""
    worker_cpu: str = k.DEFAULT_WORKER_CPU
    worker_memory: str = k.DEFAULT_WORKER_MEMORY
    """Requests and limits of workers whose job sets none."""
    backoff_first_s: float = 1.0
    backoff_max_s: float = 60.0
    replace_backoff_first_s: float = 10.0
    replace_backoff_max_s: float = 300.0
    status_every_s: float = 5.0
    """The status is patched at once when phase, layout, workers or a condition change; the
    step alone is refreshed at most this often (it changes every training step)."""
    cert_lifetime_s: float = pki.DEFAULT_CERT_LIFETIME_S
    """Lifetime of the agents' serving and the operator's client certificates (--cert-lifetime);
    each is renewed when a third of it is left (operator/pki.py)."""
    objects_every_s: float = 60.0
    """How often the job's Secret, ConfigMap and Service are checked when nothing changed."""
    allowed_images: tuple[str, ...] = ()
    """Image prefixes a job's spec.image must start with (--allowed-images); () = any."""
    network_policy: bool = True
    """Create each job's NetworkPolicy (:mod:`.netpol`; --network-policy)."""
    operator_namespace: str = "default"
    operator_pod_labels: dict = field(
        default_factory=lambda: dict(netpol.DEFAULT_OPERATOR_POD_LABELS))
    """Where the operator's pods run and their labels: the policies admit them to the agents."""
    metrics_namespaces: dict = field(default_factory=dict)
    """matchLabels of the namespaces that may scrape workers' metrics ({} = every one)."""


class Backoff:
    """Capped exponential back-off: ``first``, ``2 first``, ... ``cap``; ``reset`` on success."""

    def __init__(self, first: float, cap: float):
        self.first, self.cap, self.failures, self.until = first, cap, 0, 0.0

    def fail(self) -> float:
        delay = min(self.cap, self.first * 2 ** self.failures)
        self.failures += 1
        self.until = time.monotonic() + delay
        return delay

    def reset(self) -> None:
        self.failures, self.until = 0, 0.0

    @property
    def waiting(self) -> float:
        return max(0.0, self.until - time.monotonic())


class Waiting(Exception):
    """The pass cannot go on until somebody acts (the condition says what); retried with
    back-off like an API error."""


def api_message(e: ApiException) -> str:
    """The apiserver's message from an error's Status body, else its reason."""
    try:
        return json.loads(e.body).get("message") or str(e.reason)
    except (TypeError, ValueError, AttributeError):
        return str(e.body or e.reason)


def now():
    return datetime.datetime.now(datetime.timezone.utc)


@dataclass(frozen=True)
class JobContext:
    """What every room of one job's runtime is handed (:mod:`.pods`, :mod:`.jobtls`): the job's
    identity, the operator's settings and API, and callables for what changes between passes.
    One value instead of a back-reference to the whole runtime, so a room's reach is visible."""

    core: object
    """The CoreV1Api."""
    namespace: str
    name: str
    uid: str
    settings: Settings
    log: object
    """(text) -> a log line."""
    event: object
    """(type, reason, message) -> an Event on the job."""
    conditions: object
    """The job's :class:`~.status.Conditions`."""
    job: object
    """() -> the job (the parsed spec)."""
    body: object
    """() -> the DynaTrainJob as last read."""
    generation: object
    """() -> its metadata.generation."""
    controller: object
    """() -> its JobController."""


class Room:
    """A room of a job's runtime: the context's parts as attributes, the changing ones as
    properties (read at use, as the runtime's own attributes were)."""

    def __init__(self, ctx: JobContext):
        self.ctx = ctx
        self.core = ctx.core
        self.namespace, self.name, self.uid = ctx.namespace, ctx.name, ctx.uid
        self.settings, self.log, self.conditions = ctx.settings, ctx.log, ctx.conditions
        self._event, self._generation = ctx.event, ctx.generation

    @property
    def job(self):
        return self.ctx.job()

    @property
    def body(self) -> dict:
        return self.ctx.body()

    @property
    def controller(self):
        return self.ctx.controller()
