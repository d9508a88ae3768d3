"""DynaTrain's Prometheus metrics, defined once for every process that exposes them.

Each training worker's agent and the controller create one :class:`Metrics` object per
job, which owns its own :class:`~prometheus_client.CollectorRegistry` (never the
process-global ``REGISTRY``: tests and a local run put several agents in one process, and each
must expose only its own numbers), and serve it over HTTP with :meth:`Metrics.serve`. The
operator runs many jobs in one process: it keeps one :class:`Metrics` per job in a
:class:`JobMetricsSet`, which exposes them all on its one endpoint and drops a job's series
when the job is deleted.

**Every series carries the job's identity**, ``namespace`` and ``job`` (the DynaTrainJob's
``metadata.namespace`` and ``metadata.name``; a manifest run locally with ``dynatrain run``
and no namespace is in ``default``), so that many jobs share one operator, one Prometheus and
one dashboard without overwriting each other's gauges or adding into each other's counters.
Prometheus also sets a ``job`` label on every scraped series (the scrape config's job name)
and service discovery may set ``namespace`` (the Prometheus Operator does: the namespace of
the scraped pod or Service, which for the operator is its own, not the job's). The metrics'
own labels must win, so **scrape DynaTrain with** ``honor_labels: true`` (the chart's
ServiceMonitor and PodMonitor set ``honorLabels: true``); without it Prometheus renames them
to ``exported_job`` and ``exported_namespace``. (A label name of our own, ``dynatrain_job``,
would need no such setting; ``job`` is used so that a job's series are
``{namespace="<ns>", job="<name>"}``, the DynaTrainJob's own coordinates. The scrape job's
name stays on ``up`` and on series without a ``job`` label, e.g.
``dynatrain_operator_api_requests_total``.) Which process a series came from is told by
the target labels Prometheus attaches (``instance``, ``pod``, and ``role``: ``controller`` or
``worker``, which the chart's monitors and ``dynatrain run --prometheus-sd`` add).

Metrics (names as exposed, each also labelled ``namespace`` and ``job``; all times in seconds,
sizes in bytes, per Prometheus conventions):

``dynatrain_switch_duration_seconds{phase, reason}`` (histogram)
    Time spent in each phase of a layout switch: ``prepare`` (background preparation while
    training goes on), ``pause`` (training stopped, the whole stop-the-world window) and
    ``transfer`` (the part of the pause moving state between devices). ``reason`` is why the
    switch happened (``preemption``, ``scale-up``, ``scale-down``, ``better-layout``,
    ``requested``, ``failure``). Buckets 1 ms .. 60 s.
``dynatrain_switch_bytes_total{reason}`` (counter)
    Bytes of training state moved between devices by switches.
``dynatrain_switches_total{result, reason}`` (counter)
    Switches attempted, by outcome: ``success``, ``aborted`` (called off before the commit,
    training continued on the old layout) or ``failed``.
``dynatrain_step_duration_seconds`` (histogram)
    Wall time of one training step.
``dynatrain_tokens_per_second`` (gauge)
    Training throughput measured over the last step.
``dynatrain_step`` (gauge)
    The last completed training step.
``dynatrain_workers`` (gauge)
    Workers currently in the job.
``dynatrain_generation`` (gauge)
    The running generation: 1 for the job's first layout, higher after each switch (an
    aborted attempt also uses up a number).
``dynatrain_layout_info{dp, tp, pp, ep, zero}`` (gauge, info style)
    Always 1, for the current layout only; the previous label set is removed on a change, so
    ``dynatrain_layout_info`` has exactly one series per job and can be joined onto other
    metrics ``on (namespace, job)``.

Training figures (workers only). The job-wide ones are exported by **one worker at a time,
the job's rank 0** (every rank learns the loss from the step's all-reduce, so any could; one
does, so that no sum or count over workers counts a step twice). When a switch makes another
device rank 0, the old one stops exporting them at that step and the new one starts, so the
series moves from one pod to the other with no overlap (aggregate ``max by (namespace, job)``
to draw it as one line):

``dynatrain_loss`` (gauge)
    Mean next-token cross-entropy of the last step's global batch.
``dynatrain_learning_rate`` (gauge)
    The learning rate the last step's update used (the schedule's, at that step).
``dynatrain_grad_norm`` (gauge)
    Global L2 norm of the last step's gradient before clipping (the logical model's, each
    element counted once).
``dynatrain_samples_total`` (counter)
    Samples of the global batch consumed since the job began (steps x global batch; the
    new rank 0 after a switch goes on from the same total).
``dynatrain_mfu`` (gauge)
    Modelled model-FLOPs utilisation: the model's training FLOPs per token (the cost model's
    count, :func:`dynatrain.vps.stagecost.training_flops_per_token`) times the job's
    tokens per second, over the peak FLOP/s of all the job's devices (their device profile's
    datasheet peak: H100, A100, ...; on the CPU, the profile's nominal rate).
``dynatrain_training_step`` (gauge)
    The step the figures above belong to (equal to ``dynatrain_step`` of the same worker;
    kept beside them so that a scrape always reads a figure with its own step).
``dynatrain_checkpoint_age_seconds``, ``dynatrain_checkpoint_step`` (gauges)
    Seconds since the newest periodic checkpoint was written (computed at scrape time) and
    its step; only while the job has one (``spec.checkpoint``).

And every worker, for its own device:

``dynatrain_step_phase_seconds{phase}`` (gauge)
    The last step's wall time split into ``compute``, ``communication`` (waiting for
    collectives and pipeline messages: communication not hidden behind compute) and
    ``redundancy`` (waiting for the in-memory mirrors within the step, plus taking the
    snapshot after it).
``dynatrain_gpu_memory_bytes{kind}`` (gauge)
    The CUDA caching allocator's ``allocated`` and ``reserved`` bytes after the last step;
    only on a GPU (a CPU worker has no such series).

And the controller (the operator's per-job series, the local runner's endpoint), once the
running layout has been measured (:mod:`dynatrain.controller.measured`):

``dynatrain_cost_model_step_seconds{kind}`` (gauge)
    The running layout's step time, ``measured`` (smoothed over its steps, its slowest
    device's) and ``predicted`` by the cost model the solver chooses layouts with; their
    ratio is how far off the solver's figures are on this job and machine.

prometheus_client also exposes a ``<name>_created`` timestamp series for every counter and
histogram; Prometheus 2.x stores those as ordinary series, which only add noise here, so this
module filters them out of its own registry (without the process-wide switch
``disable_created_metrics()``, which would affect other libraries' metrics too).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dynatrain.vps.layout import Layout, parse_layout

PHASES = ("prepare", "pause", "transfer")
"""The phases a switch's duration is reported in."""
RESULTS = ("success", "aborted", "failed")
"""The outcomes of a switch."""
REASONS = ("preemption", "scale-up", "scale-down", "release", "better-layout", "rebalance",
           "requested", "failure")
"""Why the controller's policy switches (``reason``); their series exist from the start, so
that rate() sees a job's first switch of each kind."""

# Switches range from a few milliseconds (a tiny model on one host) to tens of seconds (a
# 235B model re-sharded across nodes); roughly 1-2.5-5 per decade keeps quantile error small.
SWITCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                  1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
# Steps: milliseconds for CPU test models, up to minutes for large global batches.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)

STEP_PHASES = ("compute", "communication", "redundancy")
"""How a worker's step time is split (``dynatrain_step_phase_seconds{phase}``)."""

_LAYOUT_LABELS = ("dp", "tp", "pp", "ep", "zero")
JOB_LABELS = ("namespace", "job")
"""The labels every series carries: the DynaTrainJob's namespace and name."""


@dataclass(frozen=True)
class TrainingSample:
    """One step's job-wide training figures, as the job's rank 0 exports them."""

    step: int
    loss: float
    learning_rate: float
    grad_norm: float
    samples: int
    """Samples consumed since the job began, through this step."""
    mfu: float
    """Modelled model-FLOPs utilisation of the job's devices over this step (0..1)."""


class _JobTraining:
    """The job-wide training figures of the worker that is rank 0 (nothing on the others):
    one frozen sample replaced per step, read whole by a scrape."""

    def __init__(self, namespace: str, job: str):
        self.labels = (namespace, job)
        self.sample: TrainingSample | None = None
        self.checkpoint: tuple[int, float] | None = None
        """(step, wall time) of the newest checkpoint, while this worker exports."""

    def families(self):
        sample, labels = self.sample, self.labels
        if sample is None:
            return []
        out = []
        for name, text, value in (
                ("dynatrain_loss", "Mean next-token cross-entropy of the last step's global "
                 "batch (exported by the job's rank 0).", sample.loss),
                ("dynatrain_learning_rate", "Learning rate of the last step's update.",
                 sample.learning_rate),
                ("dynatrain_grad_norm", "Global gradient L2 norm of the last step, before "
                 "clipping.", sample.grad_norm),
                ("dynatrain_mfu", "Modelled model-FLOPs utilisation of the job's devices "
                 "over the last step.", sample.mfu),
                ("dynatrain_training_step", "The step the training figures belong to.",
                 sample.step)):
            family = GaugeMetricFamily(name, text, labels=JOB_LABELS)
            family.add_metric(labels, value)
            out.append(family)
        samples = CounterMetricFamily("dynatrain_samples", "Samples consumed since the job "
                                      "began.", labels=JOB_LABELS)
        samples.add_metric(labels, sample.samples)
        out.append(samples)
        if self.checkpoint is not None:
            step, at = self.checkpoint
            age = GaugeMetricFamily("dynatrain_checkpoint_age_seconds",
                                    "Seconds since the newest checkpoint was written.",
                                    labels=JOB_LABELS)
            age.add_metric(labels, max(0.0, time.time() - at))
            ckpt = GaugeMetricFamily("dynatrain_checkpoint_step",
                                     "Step of the newest checkpoint.", labels=JOB_LABELS)
            ckpt.add_metric(labels, step)
            out += [age, ckpt]
        return out


class _WithoutCreated(Collector):
    """Exposes a set of metrics minus their ``_created`` samples (see the module docstring),
    plus the job's training figures, all read under the Metrics' lock so that one scrape sees
    one step's values together."""

    def __init__(self, metrics, training: _JobTraining, lock):
        self._metrics = tuple(metrics)
        self._training = training
        self._lock = lock

    def describe(self):
        # Lets the registry check for duplicate names without collecting values.
        return [family for metric in self._metrics for family in metric.describe()]

    def collect(self):
        with self._lock:       # materialised here: a generator must not hold a lock
            families = [family for metric in self._metrics for family in metric.collect()]
            families += self._training.families()
        for family in families:  # a fresh Metric object on every collect
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class Metrics:
    """The metrics of one job in one process, in their own registry (a new one unless
    ``registry`` given); every series is labelled with ``namespace`` and ``job``.

    ``reasons``: switch reasons known in advance. Their series are created at zero right away;
    a labelled series only appears when first used, and ``rate()``/``increase()`` cannot see an
    event that creates the series it is counted in, so the very first switch of a reason would
    otherwise be invisible to them. A reason seen for the first time by :meth:`observe_switch`
    gets all its series created then (its first switch is missed by ``rate``, later ones not).
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, namespace: str, job: str,
                 reasons: Iterable[str] = ()):
        for label, value, field in (("namespace", namespace, "metadata.namespace"),
                                    ("job", job, "metadata.name")):
            if not isinstance(value, str) or not value:
                raise ValueError(f"Metrics: {label}={value!r}; must be the DynaTrainJob's "
                                 f"{field}, a non-empty string")
        self.namespace, self.job = namespace, job
        self._job_labels = {"namespace": namespace, "job": job}
        self.registry = registry if registry is not None else CollectorRegistry()
        # registry=None: the metric objects are not registered on their own (in particular not
        # on the global REGISTRY); _WithoutCreated registers them all at once below. Metrics
        # with labels of their own (phase, reason...) stay families, labelled per use; those
        # without are bound to this job's series right away, so that they exist from the start.
        self.switch_duration = Histogram(
            "dynatrain_switch_duration_seconds",
            "Duration of a layout switch, by phase (prepare, pause, transfer).",
            [*JOB_LABELS, "phase", "reason"], buckets=SWITCH_BUCKETS, registry=None)
        # prometheus_client appends _total to a counter's name: exposed as
        # dynatrain_switch_bytes_total.
        self.switch_bytes = Counter(
            "dynatrain_switch_bytes", "Bytes of training state moved by layout switches.",
            [*JOB_LABELS, "reason"], registry=None)
        self.switches = Counter(
            "dynatrain_switches", "Layout switches, by result (success, aborted, failed).",
            [*JOB_LABELS, "result", "reason"], registry=None)
        step_duration = Histogram(
            "dynatrain_step_duration_seconds", "Wall time of one training step.",
            JOB_LABELS, buckets=STEP_BUCKETS, registry=None)
        tokens_per_second = Gauge(
            "dynatrain_tokens_per_second", "Training throughput over the last step.",
            JOB_LABELS, registry=None)
        step = Gauge("dynatrain_step", "The last completed training step.", JOB_LABELS,
                     registry=None)
        workers = Gauge("dynatrain_workers", "Workers currently in the job.", JOB_LABELS,
                        registry=None)
        generation = Gauge(
            "dynatrain_generation", "Layout generation: 0 at start, +1 per committed switch.",
            JOB_LABELS, registry=None)
        self.layout_info = Gauge(
            "dynatrain_layout_info", "The current parallelism layout (value always 1).",
            [*JOB_LABELS, *_LAYOUT_LABELS], registry=None)
        self.step_phases = Gauge(
            "dynatrain_step_phase_seconds", "This worker's last step, split into compute, "
            "communication and redundancy.", [*JOB_LABELS, "phase"], registry=None)
        self.gpu_memory = Gauge(
            "dynatrain_gpu_memory_bytes", "CUDA allocator bytes (allocated, reserved) after "
            "the last step.", [*JOB_LABELS, "kind"], registry=None)
        self.cost_model = Gauge(
            "dynatrain_cost_model_step_seconds", "The running layout's step time, measured "
            "and as the cost model predicted it.", [*JOB_LABELS, "kind"], registry=None)
        self._training = _JobTraining(namespace, job)
        # Guards the layout's "add new, remove old", the set of initialised reasons, and a
        # step's values against a scrape reading half of them (reentrant: the collector holds
        # it while the metric objects take their own locks).
        self._lock = threading.RLock()
        self._collector = _WithoutCreated([
            self.switch_duration, self.switch_bytes, self.switches, step_duration,
            tokens_per_second, step, workers, generation, self.layout_info, self.step_phases,
            self.gpu_memory, self.cost_model], self._training, self._lock)
        self.registry.register(self._collector)
        self.step_duration = step_duration.labels(namespace, job)
        self.tokens_per_second = tokens_per_second.labels(namespace, job)
        self.step = step.labels(namespace, job)
        self.workers = workers.labels(namespace, job)
        self.generation = generation.labels(namespace, job)
        self._layout_labels: tuple[str, ...] | None = None
        self._reasons: set[str] = set()
        for reason in reasons:
            self._init_reason(reason)

    # -- recording -------------------------------------------------------------------------

    def observe_step(self, seconds: float, tokens_per_second: float, step: int, *,
                     phases: dict[str, float] | None = None,
                     training: TrainingSample | None = None, owner: bool = False) -> None:
        """Record one finished training step, all of it at once for a scrape. A worker also
        gives its step's ``phases`` (:data:`STEP_PHASES`) and, with ``owner`` (it is the job's
        rank 0), the job-wide ``training`` figures; ``owner=False`` stops exporting them."""
        if phases is not None:
            unknown = sorted(set(phases) - set(STEP_PHASES))
            if unknown:
                raise ValueError(f"step phases {unknown} unknown; valid: "
                                 f"{', '.join(STEP_PHASES)}")
        with self._lock:
            self.step_duration.observe(seconds)
            self.tokens_per_second.set(tokens_per_second)
            self.step.set(step)
            for phase, value in (phases or {}).items():
                self.step_phases.labels(self.namespace, self.job, phase).set(value)
            self._training.sample = training if owner else None
            if not owner:
                self._training.checkpoint = None

    def observe_training_owner(self, owner: bool) -> None:
        """``False``: this worker is no longer the job's rank 0 (a switch moved it): stop
        exporting the job's training figures now, not at its next step."""
        if not owner:
            with self._lock:
                self._training.sample = self._training.checkpoint = None

    def observe_checkpoint(self, step: int, wall_time: float | None = None) -> None:
        """The job's newest checkpoint (exported by the job's rank 0 with its training
        figures; ``wall_time`` defaults to now)."""
        with self._lock:
            self._training.checkpoint = (step, time.time() if wall_time is None else wall_time)

    def set_gpu_memory(self, allocated: int, reserved: int) -> None:
        """The CUDA allocator's figures (a GPU worker's only)."""
        with self._lock:
            self.gpu_memory.labels(self.namespace, self.job, "allocated").set(allocated)
            self.gpu_memory.labels(self.namespace, self.job, "reserved").set(reserved)

    def observe_switch(self, reason: str, result: str, phases: dict[str, float],
                       bytes_moved: int) -> None:
        """Record one switch attempt: its outcome, the seconds of each phase it went through
        (a subset of :data:`PHASES`; an aborted switch may have only ``prepare``) and the bytes
        it moved. Unknown phases or results raise ValueError before anything is recorded."""
        if result not in RESULTS:
            raise ValueError(f"switch result {result!r} is not one of {', '.join(RESULTS)}")
        unknown = sorted(set(phases) - set(PHASES))
        if unknown:
            raise ValueError(f"switch phases {unknown} unknown; valid: {', '.join(PHASES)}")
        if bytes_moved < 0:
            raise ValueError(f"bytes_moved={bytes_moved} must be >= 0")
        self._init_reason(reason)
        job = self._job_labels
        for phase, seconds in phases.items():
            self.switch_duration.labels(**job, phase=phase, reason=reason).observe(seconds)
        self.switch_bytes.labels(**job, reason=reason).inc(bytes_moved)
        self.switches.labels(**job, result=result, reason=reason).inc()

    def set_layout(self, layout: Layout | str | None) -> None:
        """Make ``layout`` (a Layout or its text, e.g. ``dp=4,tp=2``) the one series of
        ``dynatrain_layout_info``; None removes it (no layout yet)."""
        if isinstance(layout, str):
            layout = parse_layout(layout)
        labels = None if layout is None else tuple(str(getattr(layout, k)) for k in _LAYOUT_LABELS)
        with self._lock:
            if labels is not None:
                # Add the new series before removing the old one, so a scrape in between sees
                # two layouts for an instant rather than none.
                self.layout_info.labels(self.namespace, self.job, *labels).set(1)
            if self._layout_labels is not None and self._layout_labels != labels:
                self.layout_info.remove(self.namespace, self.job, *self._layout_labels)
            self._layout_labels = labels

    def set_workers(self, n: int) -> None:
        self.workers.set(n)

    def set_generation(self, generation: int) -> None:
        self.generation.set(generation)

    def set_measured(self, measured_seconds: float, predicted_seconds: float) -> None:
        """The running layout's measured and predicted step seconds (a prediction of 0, none
        made, is left out)."""
        with self._lock:
            self.cost_model.labels(self.namespace, self.job, "measured").set(measured_seconds)
            if predicted_seconds > 0:
                self.cost_model.labels(self.namespace, self.job, "predicted").set(
                    predicted_seconds)

    def _init_reason(self, reason: str) -> None:
        """Create every series of ``reason`` at zero (see the class docstring)."""
        with self._lock:
            if reason in self._reasons:
                return
            self._reasons.add(reason)
        job = self._job_labels
        for phase in PHASES:
            self.switch_duration.labels(**job, phase=phase, reason=reason)
        for result in RESULTS:
            self.switches.labels(**job, result=result, reason=reason)
        self.switch_bytes.labels(**job, reason=reason)

    # -- exposition ------------------------------------------------------------------------

    def serve(self, port: int = 0, addr: str = "127.0.0.1"):
        """Serve ``/metrics`` from this registry on a daemon thread; returns ``(server, port)``.

        ``port=0`` picks a free port, and the one bound is returned. Stop with
        ``server.shutdown(); server.server_close()``. The default address is loopback; a pod
        serving Prometheus in a cluster passes ``addr="0.0.0.0"``.
        """
        # Since prometheus_client 0.20 (our floor) start_http_server returns the WSGI server
        # and its thread; the server knows the port the OS picked.
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server, server.server_port

    def collect(self):
        """This job's metric families, as its registry exposes them (a :class:`JobMetricsSet`
        merges them with the other jobs')."""
        return self._collector.collect()


class JobMetricsSet(Collector):
    """The :class:`Metrics` of many jobs on one endpoint: the operator's.

    Register it on the endpoint's registry; :meth:`add` a job's Metrics when its controller
    starts and :meth:`remove` them when the job is deleted, which drops every series of the
    job at once (label by label removal would have to know every phase, reason and layout the
    job ever used). The jobs' families are merged by name: the exposition formats allow each
    metric name once.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, str], tuple[str, Metrics]] = {}

    def add(self, metrics: Metrics, uid: str = "") -> Metrics:
        """Expose ``metrics`` (they replace those of an earlier job of the same namespace and
        name: a job deleted and re-created). ``uid``: the job's ``metadata.uid``, which
        :meth:`remove` checks. Returns ``metrics``."""
        with self._lock:
            self._jobs[(metrics.namespace, metrics.job)] = (uid, metrics)
        return metrics

    def remove(self, namespace: str, job: str, uid: str | None = None) -> bool:
        """Stop exposing the job's series; with ``uid``, only if they belong to that object
        (not to a re-created job of the same name). Returns whether something was removed."""
        with self._lock:
            found = self._jobs.get((namespace, job))
            if found is None or (uid is not None and found[0] != uid):
                return False
            del self._jobs[(namespace, job)]
            return True

    def jobs(self) -> list[tuple[str, str]]:
        """``(namespace, job)`` of every job exposed."""
        with self._lock:
            return sorted(self._jobs)

    def describe(self):
        # Which names the set exposes depends on its jobs; describing none skips the registry's
        # duplicate-name check for this collector (its names are only ever the dynatrain_ ones).
        return []

    def collect(self):
        with self._lock:
            jobs = [metrics for _, (_, metrics) in sorted(self._jobs.items())]
        merged: dict[str, object] = {}
        for metrics in jobs:
            for family in metrics.collect():
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family     # a fresh object per collect: ours to extend
        yield from merged.values()
