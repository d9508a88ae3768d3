"""A real Prometheus server for tests: started per test on a free port, queried over its HTTP API.

Tests that check DynaTrain's metrics end to end (exposition -> scrape -> PromQL) run the
``prometheus`` binary from Debian's package (``tools/install-prometheus.sh`` installs it) rather
than a fake, so that names, label handling and PromQL behave exactly as in production. The
server gets a temporary data directory, scrapes every second, and discovers its targets from a
``file_sd`` JSON file that :meth:`PrometheusServer.add_targets` rewrites while it runs.

Import it the way the other helpers here are imported (pytest puts ``tests/`` on ``sys.path``)::

    from harness.prometheus_server import PrometheusServer, prometheus  # `prometheus` is a fixture

The scrape config sets ``honor_labels: true``, as the Helm chart's ServiceMonitor and
PodMonitor do: DynaTrain's series carry their own ``job`` (the DynaTrainJob's name) and
``namespace`` labels, which must win over the target's ``job`` (the target group's, below).

Timing to expect: Prometheus's discovery and scrape managers pass target changes on at most
every 5 s each (not configurable in 2.x), so a newly added target is scraped after roughly
5-10 s; use :meth:`PrometheusServer.wait_for` rather than sleeps.

If the binary is missing, the fixture (and :func:`require_prometheus`) fails under CI (``CI``
set), where a missing dependency must not pass silently, and skips otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from dynatrain.ports import free_port as _free_port

INSTALL_HINT = "run tools/install-prometheus.sh (installs Debian's 'prometheus' package)"


class PrometheusError(RuntimeError):
    """The server answered an API call with an error (the message is Prometheus's own)."""


def find_prometheus() -> str | None:
    """Path of the ``prometheus`` binary, or None."""
    found = shutil.which("prometheus")
    if found:
        return found
    # /usr/bin is not on PATH in every environment tests run in (e.g. a stripped-down env).
    return "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None


def require_prometheus() -> str:
    """The binary's path; fails the test under CI, skips it elsewhere, when it is missing."""
    path = find_prometheus()
    if path is None:
        message = f"the 'prometheus' binary is not installed: {INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return path


class PrometheusServer:
    """One ``prometheus`` process on 127.0.0.1; use as a context manager or call start/stop.

    Targets are grouped per Prometheus ``job``: the single scrape config reads one file_sd
    file, and each target group in it carries a ``job`` label, which takes precedence over the
    scrape config's ``job_name`` — so jobs can be added while the server runs, without a
    configuration reload.
    """

    def __init__(self, binary: str | None = None, *, scrape_interval: str = "1s",
                 startup_timeout: float = 30.0, honor_labels: bool = True):
        self.binary = binary or require_prometheus()
        self.scrape_interval = scrape_interval
        self.honor_labels = honor_labels
        self.startup_timeout = startup_timeout
        self.port: int | None = None
        self.workdir: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._groups: list[dict] = []

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PrometheusServer:
        self.workdir = Path(tempfile.mkdtemp(prefix="dynatrain-prometheus-"))
        self._write_targets()
        config = self.workdir / "prometheus.yml"
        # JSON is valid YAML, which spares a yaml dependency on the writing side.
        config.write_text(json.dumps({
            "global": {"scrape_interval": self.scrape_interval,
                       "evaluation_interval": self.scrape_interval},
            "scrape_configs": [{
                "job_name": "file_sd",  # overridden per target group by its `job` label
                "scrape_timeout": self.scrape_interval,
                # A label the series carry (job, namespace) wins over the target's; False:
                # the target's wins and the series' own becomes exported_<name>.
                "honor_labels": self.honor_labels,
                # The file is also watched with inotify; refresh_interval is the fallback
                # re-read (default 5 m) for filesystems where notifications do not arrive.
                "file_sd_configs": [{"files": [str(self._targets_file)],
                                     "refresh_interval": "1s"}],
            }],
        }, indent=2))
        for attempt in range(3):
            self.port = _free_port()
            # The child keeps its own copy of the log's descriptor; ours is closed right away.
            with open(self.workdir / "prometheus.log", "wb") as log:
                self._proc = subprocess.Popen(
                    [self.binary, f"--config.file={config}",
                     f"--storage.tsdb.path={self.workdir / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}",
                     "--log.level=info"],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    cwd=self.workdir, start_new_session=True)
            try:
                self.wait_ready(self.startup_timeout)
                return self
            except RuntimeError:
                lost_port = "address already in use" in self.log()
                self._terminate()
                if not lost_port or attempt == 2:
                    self.stop()
                    raise
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until ``/-/ready`` answers 200 (TSDB opened, config loaded)."""
        deadline = time.monotonic() + timeout
        while True:
            if self._proc is None or self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited before it was ready:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while starting
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready after {timeout} s:\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the server and delete its data directory; safe to call twice."""
        self._terminate()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)  # clean shutdown: closes the TSDB
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def log(self) -> str:
        """The server's log so far (for failure messages)."""
        path = self.workdir and self.workdir / "prometheus.log"
        return path.read_text(errors="replace") if path and path.exists() else ""

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- targets -----------------------------------------------------------------------------

    @property
    def _targets_file(self) -> Path:
        return self.workdir / "targets.json"

    def add_targets(self, job: str, targets: list[str], labels: dict[str, str] | None = None
                    ) -> None:
        """Scrape ``targets`` (``host:port``) as Prometheus job ``job``, with extra target
        labels. Picked up while running (allow 5-10 s, see the module docstring)."""
        self._groups.append({"targets": list(targets), "labels": {**(labels or {}), "job": job}})
        self._write_targets()

    def clear_targets(self, job: str | None = None) -> None:
        """Stop scraping the targets of ``job`` (all jobs when None)."""
        self._groups = [g for g in self._groups if job is not None and g["labels"]["job"] != job]
        self._write_targets()

    def _write_targets(self) -> None:
        if self.workdir is None:
            return  # not started: start() writes the file
        # Write then rename: Prometheus reacts to the file changing and must never read a
        # half-written file (it would drop every target until the next valid read).
        tmp = self._targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._groups, indent=2))
        os.replace(tmp, self._targets_file)

    def targets(self, state: str = "active") -> list[dict]:
        """Targets as ``/api/v1/targets`` reports them (``labels``, ``health``, ``lastError``...)."""
        data = self._api("/api/v1/targets", {"state": state})
        return data["activeTargets"] if state == "active" else data.get("droppedTargets", [])

    # -- queries -----------------------------------------------------------------------------

    def _api(self, path: str, params: dict) -> dict:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            # Errors (400 bad_data, 422 execution ...) still carry the JSON error body.
            try:
                body = json.load(e)
            except ValueError:
                raise PrometheusError(f"{path}: HTTP {e.code} {e.reason}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{body.get('errorType', 'error')}: {body.get('error')}")
        return body["data"]

    @staticmethod
    def _result(data: dict) -> list:
        # A vector or matrix is a list already; wrap a scalar/string so callers always get one.
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query(self, promql: str, at: float | None = None) -> list:
        """Instant query: ``[{"metric": {...}, "value": [ts, "1.5"]}, ...]``.
        Raises PrometheusError with Prometheus's message on a bad query."""
        params = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self._result(self._api("/api/v1/query", params))

    def query_range(self, promql: str, start: float, end: float, step: float = 1.0) -> list:
        """Range query: ``[{"metric": {...}, "values": [[ts, "1.5"], ...]}, ...]``."""
        return self._result(self._api("/api/v1/query_range", {
            "query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": step}))

    def label_values(self, label: str, match: str) -> list[str]:
        """The values of ``label`` among the series ``match`` selects, as Grafana's
        ``label_values(match, label)`` variable query asks them of ``/api/v1/label/.../values``."""
        return sorted(self._api(f"/api/v1/label/{label}/values", {"match[]": match}))

    def wait_for(self, promql: str, predicate=lambda result: bool(result),
                 timeout: float = 20.0, interval: float = 0.25) -> list:
        """Query until ``predicate(result)`` holds and return that result; on timeout raise
        AssertionError with the last result and the targets' health."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                health = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in self.targets()]
                raise AssertionError(f"{promql!r} did not satisfy the predicate within "
                                     f"{timeout} s; last result {result}; targets {health}")
            time.sleep(interval)

    def validate_promql(self, expr: str) -> str:
        """Check that ``expr`` parses (syntax and types), without evaluating it; returns the
        server's canonical formatting. Raises PrometheusError with the parser's message.

        Uses ``/api/v1/format_query``, which only parses, so it needs no data and no time
        range. Grafana variables (``$__rate_interval``...) must be substituted first."""
        return self._api("/api/v1/format_query", {"query": expr})


def sample_value(result: list, **labels) -> float:
    """The value of the one series of an instant-query result whose labels include ``labels``."""
    matches = [r for r in result if all(r["metric"].get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, f"expected one series with {labels}, got {result}"
    return float(matches[0]["value"][1])


@pytest.fixture
def prometheus():
    """A running :class:`PrometheusServer`, stopped after the test."""
    server = PrometheusServer(require_prometheus())
    server.start()
    try:
        yield server
    finally:
        server.stop()
