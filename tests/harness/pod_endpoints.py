"""`kubectl logs`, `port-forward` and `exec` of one pod, through the apiserver and the node's
kubelet endpoint: the same checks for a simulated node (kwok's server, test_pod_endpoints.py)
and a real kubelet (test_real_node.py).

The pod (:func:`endpoint_pod`) prints three lines to stdout and one to stderr and fails (exit 3)
on its first run; restarted (``restartPolicy: OnFailure``), it serves a worker's Prometheus
metrics (the worker's own :class:`~dynatrain.agent.metrics.Metrics`) on its pod IP, port 9400,
and prints a numbered line every 0.2 s. An emptyDir marks the first run, as it survives a
container's restart on both kinds of node.
"""

from __future__ import annotations

import datetime
import queue
import re
import subprocess
import threading
import time
import urllib.request

from dynatrain.devcluster.processes import wait_until

METRICS_PORT = 9400
SCRIPT = """\
import os, pathlib, sys, time
mark = pathlib.Path(os.environ["SCRATCH"]) / "ran-before"
run = "second" if mark.exists() else "first"
mark.touch()
for i in range(3):
    print(f"{run} run: line {i}", flush=True)
print(f"{run} run: to stderr", file=sys.stderr, flush=True)
if run == "first":
    sys.exit(3)
from dynatrain.agent.metrics import Metrics
metrics = Metrics(namespace=os.environ["POD_NAMESPACE"], job="endpoints")
metrics.serve(port=int(os.environ["METRICS_PORT"]),
              addr=os.environ.get("METRICS_HOST") or os.environ["POD_IP"])
i = 3
while True:
    metrics.observe_step(0.2, 100.0, i)
    print(f"second run: line {i}", flush=True)
    i += 1
    time.sleep(0.2)
"""
_LINE = re.compile(r"^second run: line (\d+)$")


def endpoint_pod(name: str, python: str, *, node_selector: dict[str, str],
                 image: str = "unused") -> dict:
    """The pod described above; ``python`` is the interpreter's path where it runs.

    Its metrics listen on every address of the pod ("0.0.0.0"), as a worker's do
    (``--metrics-host 0.0.0.0``): a real node's runtime (containerd) forwards a port to
    ``localhost`` inside the pod's network namespace. On a simulated node every pod shares the
    machine's network, and the pod runner binds the pod's IP for the wildcard, which kwok
    forwards to: one pod spec for both kinds of node."""
    field = lambda path: {"valueFrom": {"fieldRef": {"fieldPath": path}}}  # noqa: E731
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "restartPolicy": "OnFailure", "nodeSelector": node_selector,
        "terminationGracePeriodSeconds": 2,
        "containers": [{
            "name": "main", "image": image, "command": [python, "-c", SCRIPT],
            "env": [{"name": "POD_IP", **field("status.podIP")},
                    {"name": "POD_NAMESPACE", **field("metadata.namespace")},
                    {"name": "SCRATCH", "value": "/scratch"},
                    {"name": "METRICS_PORT", "value": str(METRICS_PORT)},
                    {"name": "METRICS_HOST", "value": "0.0.0.0"}],
            "ports": [{"name": "metrics", "containerPort": METRICS_PORT}],
            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}],
        "volumes": [{"name": "scratch", "emptyDir": {}}]}}


class _Lines:
    """A long-running kubectl (``logs -f``, ``port-forward``): its output lines, as they come."""

    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def until(self, what: str, match, timeout_s: float):
        """The first ``match(line)`` that is truthy; fails naming ``what`` and the output."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.seen.append(line)
            found = match(line)
            if found:
                return found
        raise AssertionError(f"{what}: not within {timeout_s} s; kubectl "
                             f"(exit {self.proc.poll()}) printed: {self.seen[-20:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _numbers(text: str) -> list[int]:
    return [int(m.group(1)) for m in map(_LINE.match, text.splitlines()) if m]


def check_pod_endpoints(kubectl: list[str], core, namespace: str, name: str, *,
                        exec_refusal: str | None, timeout: datetime.timedelta) -> None:
    """Every check, against the running :func:`endpoint_pod` ``namespace/name``. ``kubectl``:
    the command and its ``--kubeconfig``. ``exec_refusal``: the message ``kubectl exec`` must
    fail with, or None where exec runs in the container."""
    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([*kubectl, "-n", namespace, *args], capture_output=True,
                             text=True, timeout=60)
        assert not check or out.returncode == 0, f"kubectl {' '.join(args)}: {out.stderr}"
        return out

    def restarted_and_serving():
        pod = core.read_namespaced_pod(name, namespace)
        statuses = pod.status.container_statuses or []
        if not (statuses and statuses[0].restart_count >= 1 and statuses[0].state.running):
            return None
        # The new container's output reaches `kubectl logs` (so its rules are published).
        out = run("logs", name, check=False)
        return pod if out.returncode == 0 and _numbers(out.stdout) else None

    pod = wait_until(f"{namespace}/{name} to fail once, restart and log", restarted_and_serving,
                     timeout=timeout)

    # --previous: the first container's output, stdout and stderr, and nothing of the second.
    # (Two pipes: the stderr line's place among stdout's is the reader's, as with containerd.)
    previous = run("logs", name, "--previous").stdout.splitlines()
    assert sorted(previous) == sorted([f"first run: line {i}" for i in range(3)]
                                      + ["first run: to stderr"]), previous
    assert [p for p in previous if "line" in p] == [f"first run: line {i}" for i in range(3)]
    # The running container's output only, in order, from its first line.
    current = run("logs", name).stdout
    assert "first run" not in current and current.count("second run: to stderr\n") == 1, current
    numbers = _numbers(current)
    assert numbers == list(range(len(numbers))) and len(numbers) >= 4, current
    # --tail with --timestamps: the last two lines, each with the time it was written (once
    # two numbered lines follow the stderr line: in a CI run the tail was that line and line 3).
    wait_until("two numbered lines after the stderr line",
               lambda: len(_numbers(run("logs", name).stdout)) >= 6,
               timeout=datetime.timedelta(seconds=30))
    tail = run("logs", name, "--tail=2", "--timestamps").stdout.splitlines()
    assert len(tail) == 2 and all(re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z second run: line \d+", t) for t in tail), tail

    # -f: what was there, then lines written after kubectl started (so, followed).
    last = max(_numbers(run("logs", name).stdout))
    follow = _Lines([*kubectl, "-n", namespace, "logs", "-f", name])
    try:
        follow.until(f"`kubectl logs -f {name}` to print line {last + 5}, written after it "
                     f"started", lambda line: (m := _LINE.match(line)) and
                     int(m.group(1)) >= last + 5, 30)
    finally:
        follow.stop()

    # port-forward to the metrics port: the worker's Prometheus text, through the node.
    forward = _Lines([*kubectl, "-n", namespace, "port-forward", f"pod/{name}",
                      f":{METRICS_PORT}"])
    try:
        port = int(forward.until(
            "kubectl port-forward to say where it listens",
            lambda line: re.match(rf"Forwarding from 127\.0\.0\.1:(\d+) -> {METRICS_PORT}",
                                  line), 30).group(1))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        steps = re.findall(r'^dynatrain_step\{[^}]*job="endpoints"[^}]*\} (\S+)$', text, re.M)
        assert steps and float(steps[0]) >= 3, text[:2000]
        assert f'namespace="{namespace}"' in text, text[:2000]
    finally:
        forward.stop()

    # exec: in the container on a real node; on a simulated one, refused saying why.
    out = run("exec", name, "--", "python", "-c",
              "import os; print(os.environ['POD_IP'])", check=False)
    if exec_refusal is None:
        assert out.returncode == 0 and out.stdout.strip() == pod.status.pod_ip, out
    else:
        assert out.returncode != 0 and "is forbidden" in out.stderr, out
        assert " ".join(exec_refusal.split()) in " ".join(out.stderr.split()), out.stderr
