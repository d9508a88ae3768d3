"""DynaTrain's Prometheus metrics: the exposition text, and the numbers a real Prometheus reads.

The unit tests parse what :class:`Metrics` exposes with prometheus_client's own parsers (both
the classic text format and OpenMetrics, which Prometheus prefers when scraping). The last tests
run the real ``prometheus`` binary against in-process endpoints and check the values come back
through PromQL as observed, each series under its own job's ``namespace`` and ``job`` labels.
"""

from __future__ import annotations

import math
import urllib.request

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families

from dynatrain.agent.metrics import (PHASES, STEP_PHASES, SWITCH_BUCKETS, JobMetricsSet, Metrics,
                                     TrainingSample)
from dynatrain.vps.layout import Layout
from harness.prometheus_server import PrometheusServer, require_prometheus, sample_value
from harness.prometheus_server import prometheus  # noqa: F401  (a fixture)

JOB = {"namespace": "research", "job": "llama"}
"""The identity of the job the metrics below belong to: every series carries it."""

EXPOSED = {
    "dynatrain_switch_duration_seconds_bucket", "dynatrain_switch_duration_seconds_sum",
    "dynatrain_switch_duration_seconds_count", "dynatrain_switch_bytes_total",
    "dynatrain_switches_total", "dynatrain_step_duration_seconds_bucket",
    "dynatrain_step_duration_seconds_sum", "dynatrain_step_duration_seconds_count",
    "dynatrain_tokens_per_second", "dynatrain_workers", "dynatrain_layout_info",
    "dynatrain_step", "dynatrain_generation",
}


def samples(metrics: Metrics) -> list:
    """Every sample of the classic text exposition, as prometheus_client parses it."""
    text = generate_latest(metrics.registry).decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(metrics: Metrics, name: str, **labels) -> float:
    """The sample of ``name`` with exactly ``labels`` plus the job's namespace and job."""
    labels = {**JOB, **labels}
    found = [s.value for s in samples(metrics) if s.name == name and s.labels == labels]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def busy_metrics() -> Metrics:
    m = Metrics(**JOB)
    m.set_layout("dp=2,tp=2,pp=2,zero=1")
    m.set_workers(8)
    m.set_generation(3)
    for step in (1, 2, 3):
        m.observe_step(0.2 * step, 1000.0 * step, step)
    m.observe_switch("scale-down", "success", {"prepare": 0.5, "pause": 0.04, "transfer": 0.03},
                     12_345)
    m.observe_switch("scale-down", "aborted", {"prepare": 2.0}, 0)
    return m


def test_exposes_exactly_the_documented_names():
    names = {s.name for s in samples(busy_metrics())}
    # No `_created` series either: Metrics filters them out.
    assert names == EXPOSED


def test_openmetrics_exposition_parses_and_has_no_created_series():
    # Prometheus asks for OpenMetrics first; that format must be valid too.
    text = generate_openmetrics(busy_metrics().registry).decode()
    families = {f.name: f for f in parse_om(text)}
    assert families["dynatrain_switch_bytes"].type == "counter"
    assert families["dynatrain_switch_duration_seconds"].type == "histogram"
    assert families["dynatrain_layout_info"].type == "gauge"
    names = {s.name for f in families.values() for s in f.samples}
    assert names == EXPOSED


def test_histograms_counters_and_gauges_hold_what_was_observed():
    m = busy_metrics()
    sw = "dynatrain_switch_duration_seconds"
    prepare = {"phase": "prepare", "reason": "scale-down"}
    assert value(m, sw + "_count", **prepare) == 2
    assert value(m, sw + "_sum", **prepare) == pytest.approx(2.5)
    # Cumulative buckets from 1 ms to 60 s, then +Inf.
    buckets = [(s.labels["le"], s.value) for s in samples(m)
               if s.name == sw + "_bucket" and s.labels["phase"] == "prepare"]
    assert [float(le) for le, _ in buckets] == [*SWITCH_BUCKETS, math.inf]
    counts = dict(buckets)
    assert (counts["0.25"], counts["0.5"], counts["1.0"], counts["2.5"], counts["+Inf"]) == \
        (0, 1, 1, 2, 2)
    assert value(m, sw + "_bucket", phase="pause", reason="scale-down", le="0.05") == 1
    assert value(m, sw + "_bucket", phase="pause", reason="scale-down", le="0.025") == 0

    assert value(m, "dynatrain_switch_bytes_total", reason="scale-down") == 12_345
    assert value(m, "dynatrain_switches_total", result="success", reason="scale-down") == 1
    assert value(m, "dynatrain_switches_total", result="aborted", reason="scale-down") == 1
    # Every result of a seen reason exists (at 0), so rate() sees its first increment.
    assert value(m, "dynatrain_switches_total", result="failed", reason="scale-down") == 0

    assert value(m, "dynatrain_step_duration_seconds_count") == 3
    assert value(m, "dynatrain_step_duration_seconds_sum") == pytest.approx(1.2)
    assert value(m, "dynatrain_step_duration_seconds_bucket", le="0.5") == 2
    assert value(m, "dynatrain_tokens_per_second") == 3000
    assert value(m, "dynatrain_step") == 3
    assert value(m, "dynatrain_workers") == 8
    assert value(m, "dynatrain_generation") == 3


def test_every_series_carries_the_job():
    assert all({k: s.labels.get(k) for k in JOB} == JOB for s in samples(busy_metrics()))
    with pytest.raises(ValueError, match="metadata.name"):
        Metrics(namespace="research", job="")


def test_known_reasons_are_exposed_at_zero_before_any_switch():
    m = Metrics(**JOB, reasons=["preemption"])
    for phase in PHASES:
        assert value(m, "dynatrain_switch_duration_seconds_count",
                     phase=phase, reason="preemption") == 0
    assert value(m, "dynatrain_switch_bytes_total", reason="preemption") == 0
    for result in ("success", "aborted", "failed"):
        assert value(m, "dynatrain_switches_total", result=result, reason="preemption") == 0


def test_layout_info_keeps_only_the_current_layout():
    m = Metrics(**JOB)

    def info():
        return [s for s in samples(m) if s.name == "dynatrain_layout_info"]

    assert info() == []
    m.set_layout("dp=2,tp=2,pp=2,zero=1")
    [s] = info()
    assert s.labels == {**JOB, "dp": "2", "tp": "2", "pp": "2", "ep": "1", "zero": "1"} and \
        s.value == 1
    m.set_layout(Layout(dp=4, tp=2, ep=2, zero=3, stages=(2,)))  # a Layout works as well
    [s] = info()
    assert s.labels == {**JOB, "dp": "4", "tp": "2", "pp": "1", "ep": "2", "zero": "3"}
    m.set_layout("dp=4,tp=2,ep=2,zero=3")  # the same labels again: still one series
    assert len(info()) == 1
    m.set_layout(None)
    assert info() == []


def test_bad_input_is_rejected_and_nothing_recorded():
    m = Metrics(**JOB)
    with pytest.raises(ValueError, match="result 'ok'"):
        m.observe_switch("manual", "ok", {"pause": 1.0}, 10)
    with pytest.raises(ValueError, match="rebuild"):
        m.observe_switch("manual", "success", {"pause": 1.0, "rebuild": 0.1}, 10)
    assert not [s for s in samples(m) if s.name.startswith("dynatrain_switch")]
    with pytest.raises(ValueError, match="unknown key"):
        m.set_layout("dp=2,xp=3")


TRAINING = {"dynatrain_loss", "dynatrain_learning_rate", "dynatrain_grad_norm", "dynatrain_mfu",
            "dynatrain_training_step", "dynatrain_samples_total"}
"""The job-wide training figures, exported by the job's rank 0 only."""


def _sample(step: int) -> TrainingSample:
    return TrainingSample(step=step, loss=8.0 / step, learning_rate=3e-4, grad_norm=1.5,
                          samples=12 * step, mfu=0.4)


def test_training_figures_come_from_rank_0_only_and_move_with_it():
    phases = {"compute": 0.07, "communication": 0.02, "redundancy": 0.01}
    rank0, rank1 = Metrics(**JOB), Metrics(**JOB)
    rank0.observe_step(0.1, 1000.0, 3, phases=phases, training=_sample(3), owner=True)
    rank1.observe_step(0.1, 1000.0, 3, phases=phases, training=_sample(3), owner=False)
    names0 = {s.name for s in samples(rank0)}
    assert TRAINING <= names0
    assert not TRAINING & {s.name for s in samples(rank1)}      # never counted twice
    assert value(rank0, "dynatrain_loss") == pytest.approx(8.0 / 3)
    assert value(rank0, "dynatrain_training_step") == value(rank0, "dynatrain_step") == 3
    assert value(rank0, "dynatrain_samples_total") == 36
    assert value(rank0, "dynatrain_mfu") == pytest.approx(0.4)
    for m in (rank0, rank1):               # each worker's own split, on every worker
        for phase in STEP_PHASES:
            assert value(m, "dynatrain_step_phase_seconds", phase=phase) == phases[phase]
    # No GPU: no GPU-memory series; with one, both kinds.
    assert "dynatrain_gpu_memory_bytes" not in names0
    rank1.set_gpu_memory(10, 20)
    assert value(rank1, "dynatrain_gpu_memory_bytes", kind="reserved") == 20
    # A switch makes device 1 rank 0: the series leave device 0 at once, and device 1's
    # samples total goes on from the same count.
    rank0.observe_training_owner(False)
    assert not TRAINING & {s.name for s in samples(rank0)}
    rank1.observe_step(0.1, 1000.0, 4, training=_sample(4), owner=True)
    assert value(rank1, "dynatrain_samples_total") == 48


def test_checkpoint_age_is_computed_when_scraped():
    import time

    m = Metrics(**JOB)
    m.observe_checkpoint(100, wall_time=time.time() - 30)
    assert "dynatrain_checkpoint_age_seconds" not in {s.name for s in samples(m)}  # not rank 0
    m.observe_step(0.1, 1000.0, 101, training=_sample(101), owner=True)
    assert value(m, "dynatrain_checkpoint_step") == 100
    assert 30 <= value(m, "dynatrain_checkpoint_age_seconds") < 60
    m.observe_step(0.1, 1000.0, 102, training=_sample(102), owner=False)
    assert "dynatrain_checkpoint_step" not in {s.name for s in samples(m)}


def test_a_scrape_reads_one_steps_figures_together():
    """Step and loss are replaced under one lock: a scrape racing the updates never pairs a
    step with another step's loss."""
    import threading

    m = Metrics(**JOB)
    done = threading.Event()

    def train():
        step = 1
        while not done.is_set():
            m.observe_step(0.001, 1.0, step, training=_sample(step), owner=True)
            step += 1

    t = threading.Thread(target=train)
    t.start()
    try:
        for _ in range(200):
            got = {s.name: s.value for s in samples(m)
                   if s.name in ("dynatrain_step", "dynatrain_loss", "dynatrain_training_step")}
            if "dynatrain_loss" in got:
                assert got["dynatrain_step"] == got["dynatrain_training_step"]
                assert got["dynatrain_loss"] == pytest.approx(8.0 / got["dynatrain_step"])
    finally:
        done.set()
        t.join()


def test_unknown_step_phase_is_refused():
    m = Metrics(**JOB)
    with pytest.raises(ValueError, match=r"step phases \['io'\] unknown"):
        m.observe_step(0.1, 1.0, 1, phases={"io": 0.1})


def test_each_metrics_object_has_its_own_registry():
    a, b = Metrics(**JOB), Metrics(**JOB)  # a shared registry: "Duplicated timeseries"
    a.set_workers(5)
    assert value(a, "dynatrain_workers") == 5 and value(b, "dynatrain_workers") == 0
    assert REGISTRY.get_sample_value("dynatrain_workers") is None  # the global one is untouched


def test_serve_binds_a_free_port_and_exposes_the_registry():
    m = busy_metrics()
    server, port = m.serve()
    try:
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            body = r.read().decode()
        assert ('dynatrain_switch_bytes_total{job="llama",namespace="research",'
                'reason="scale-down"} 12345.0') in body
    finally:
        server.shutdown()
        server.server_close()


def _exposed(registry) -> dict:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_job_metrics_set_exposes_many_jobs_apart_and_forgets_a_deleted_one():
    # The operator's endpoint: every job's series in one exposition, one family per name.
    registry = CollectorRegistry()
    jobs = JobMetricsSet()
    registry.register(jobs)
    a = jobs.add(Metrics(namespace="team-a", job="train", reasons=["preemption"]), "uid-a")
    b = jobs.add(Metrics(namespace="team-b", job="train", reasons=["preemption"]), "uid-b")
    a.set_workers(4)
    b.set_workers(2)
    a.observe_switch("preemption", "success", {"pause": 0.1}, 100)
    text = generate_latest(registry).decode()
    assert text.count("# TYPE dynatrain_workers gauge") == 1
    exposed = _exposed(registry)
    workers = {k: v for k, v in exposed.items() if k[0] == "dynatrain_workers"}
    assert workers == {("dynatrain_workers", (("job", "train"), ("namespace", "team-a"))): 4,
                       ("dynatrain_workers", (("job", "train"), ("namespace", "team-b"))): 2}
    switches = {dict(k[1])["namespace"]: v for k, v in exposed.items()
                if k[0] == "dynatrain_switches_total" and dict(k[1])["result"] == "success"}
    assert switches == {"team-a": 1, "team-b": 0}        # counted for its own job only

    # A re-created job of the same name replaces the old one's series; deleting the old
    # object (its uid) then leaves the new one's alone.
    jobs.add(Metrics(namespace="team-b", job="train"), "uid-b2")
    assert not jobs.remove("team-b", "train", "uid-b")
    assert jobs.jobs() == [("team-a", "train"), ("team-b", "train")]
    assert jobs.remove("team-a", "train", "uid-a")
    a.set_workers(5)                                     # a late write of a deleted job
    assert {dict(k[1])["namespace"] for k in _exposed(registry)} == {"team-b"}


@pytest.mark.slow
def test_real_prometheus_scrapes_and_queries(prometheus):  # noqa: F811  (imported fixture)
    m = Metrics(**JOB, reasons=["scale-down"])
    m.set_layout("dp=2,tp=2,pp=2,zero=1")
    m.set_workers(8)
    for step in (1, 2, 3):
        m.observe_step(0.25, 1234.5, step)
    server, port = m.serve()
    try:
        prometheus.add_targets("dynatrain", [f"127.0.0.1:{port}"], {"device": "0"})
        [up] = prometheus.wait_for('up{job="dynatrain"} == 1', timeout=20)
        assert up["metric"]["device"] == "0"  # target labels reach every series
        # honor_labels: the series' own job label wins over the target's ("dynatrain").
        [workers] = prometheus.wait_for("dynatrain_workers", timeout=10)
        assert {k: workers["metric"].get(k) for k in ("namespace", "job", "device")} == \
            {**JOB, "device": "0"}
        assert "exported_job" not in workers["metric"]

        # The switch happens after Prometheus has scraped its series at zero, so rate() over
        # the window sees the increment.
        m.observe_switch("scale-down", "success",
                         {"prepare": 0.3, "pause": 0.04, "transfer": 0.03}, 5_000_000)
        m.set_layout("dp=4,tp=2,zero=1")
        m.set_generation(1)
        prometheus.wait_for("dynatrain_generation == 1", timeout=10)

        assert sample_value(prometheus.query("dynatrain_tokens_per_second")) == 1234.5
        assert sample_value(prometheus.query("dynatrain_step")) == 3
        assert sample_value(prometheus.query("dynatrain_workers")) == 8
        assert sample_value(prometheus.query(
            'dynatrain_switches_total{result="success"}'), reason="scale-down") == 1

        # Three observations 0.03, 0.04 (in the bucket 0.025..0.05) and 0.3: the median, by
        # linear interpolation inside that bucket, is 0.025 + 0.025 * 1.5 / 2 = 0.04375. Every
        # bucket's rate is extrapolated by the same factor, so the ratio is exact.
        quantile = ("histogram_quantile(0.5, sum by (le) "
                    "(rate(dynatrain_switch_duration_seconds_bucket[1m])))")
        result = prometheus.wait_for(
            quantile, lambda r: r and not math.isnan(float(r[0]["value"][1])), timeout=10)
        assert sample_value(result) == pytest.approx(0.04375, rel=1e-6)
        assert sample_value(prometheus.query(
            "increase(dynatrain_switch_bytes_total[1m])")) > 0

        # The old layout's series went stale at the first scrape without it.
        [layout] = prometheus.query("dynatrain_layout_info")
        assert {k: layout["metric"][k] for k in ("dp", "tp", "pp", "ep", "zero")} == \
            {"dp": "4", "tp": "2", "pp": "1", "ep": "1", "zero": "1"}
        assert layout["value"][1] == "1"

        assert prometheus.validate_promql(quantile)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_without_honor_labels_prometheus_renames_the_job_label():
    # Why the chart's monitors (and every scrape config of DynaTrain) set honor_labels: the
    # target's `job` label (the scrape config's) would take the place of the series' own, which
    # Prometheus keeps as exported_job, and the dashboard's job="$job" would match nothing.
    m = Metrics(**JOB)
    m.set_workers(3)
    server, port = m.serve()
    try:
        with PrometheusServer(require_prometheus(), honor_labels=False) as prom:
            prom.add_targets("operator", [f"127.0.0.1:{port}"], {"namespace": "dynatrain-system"})
            [workers] = prom.wait_for("dynatrain_workers", timeout=20)
            assert {k: workers["metric"].get(k) for k in
                    ("job", "exported_job", "namespace", "exported_namespace")} == {
                "job": "operator", "exported_job": "llama",
                "namespace": "dynatrain-system", "exported_namespace": "research"}
    finally:
        server.shutdown()
        server.server_close()
