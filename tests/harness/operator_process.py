"""`dynatrain operator` as a separate process, as in a cluster, for the operator tests.

Shared by the tests on simulated nodes (test_operator.py) and on the real kubelet-run node
(test_real_node.py); they differ in where the job's workers reach the operator.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from harness.chart_rbac import RELEASE_NAMESPACE
from dynatrain.ports import free_port


ROOT = Path(__file__).resolve().parents[2]

OPERATOR_PYTHON = ROOT / ".venv-operator" / "bin" / "python"
"""The operator runs from the slim image's environment (`make operator-env`: the project without
its dependencies plus operator/requirements.txt, so no torch), as the chart runs it."""


def operator_python() -> str:
    if not OPERATOR_PYTHON.is_file():
        raise RuntimeError(f"{OPERATOR_PYTHON} is missing: the operator tests run the operator "
                           "from the slim image's environment; build it with "
                           "`make operator-env` (`make test` does)")
    return str(OPERATOR_PYTHON)


def wait(what: str, fn, timeout: float = 90.0, interval: float = 0.3):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class Operator:
    """`dynatrain operator` as a separate process, restartable.

    It runs as the chart's ServiceAccount (:func:`chart_rbac.chart_identity`: the chart's
    RBAC applied to the cluster, a token of the TokenRequest API), never as the admin, so a
    verb missing from the chart fails the tests; ``kubeconfig`` names another identity."""

    def __init__(self, devcluster, namespace: str, workdir: Path, *,
                 rendezvous_host: str = "127.0.0.1", standalone: bool = False,
                 tick_s: float = 0.3, kubeconfig: Path | None = None):
        from harness.chart_rbac import chart_identity

        chart = chart_identity(devcluster)       # also makes the release namespace (the Lease's)
        self.kubeconfig = kubeconfig or chart.kubeconfig
        self.namespace, self.workdir = namespace, workdir
        # Where the job's rendezvous store listens: an address its worker pods reach.
        self.rendezvous_host = rendezvous_host
        self.standalone = standalone
        self.tick_s = tick_s
        self.metrics_port = free_port()
        self.proc = None
        self.starts = 0
        self.env: dict[str, str] = {}
        """Extra environment of the next start (e.g. a fault point)."""
        self.args: list[str] = []
        """Extra `dynatrain operator` arguments of the next start (e.g. --allowed-images)."""

    def start(self) -> None:
        self.starts += 1
        log = open(self.workdir / f"operator-{self.starts}.log", "w")
        self.proc = subprocess.Popen(
            [operator_python(), "-m", "dynatrain", "operator", "--kubeconfig",
             str(self.kubeconfig), "--namespace", self.namespace, "--metrics-port",
             str(self.metrics_port), "--rendezvous-host", self.rendezvous_host,
             *(["--standalone"] if self.standalone else
               # The chart's leader election, on a Lease of this test's own, in the release
               # namespace (where the chart's Role grants Leases), with a short lease.
               ["--leader-lease", f"operator-{self.namespace}", "--lease-seconds", "4",
                "--lease-namespace", RELEASE_NAMESPACE]), *self.args],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "DYNATRAIN_OPERATOR_TICK_S": str(self.tick_s),
                 "DYNATRAIN_METRICS_ADDR": "127.0.0.1", **self.env})

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def logs(self) -> str:
        return "\n".join((self.workdir / f"operator-{i}.log").read_text()
                         for i in range(1, self.starts + 1))

    def metrics(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=5) as r:
            text = r.read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out


GROUP, VERSION, PLURAL = "dynatrain.io", "v1alpha1", "dynatrainjobs"


def job(name: str, **over) -> dict:
    """A small gpt-tiny job (from examples/dynatrainjob.yaml) that trains until deleted."""
    import yaml

    doc = yaml.safe_load((ROOT / "examples" / "dynatrainjob.yaml").read_text())
    doc["metadata"] = {"name": name}
    spec = doc["spec"]
    spec["model"] = {"preset": "gpt-tiny"}
    spec["resources"] = {"gpus": over.get("gpus", 1)}
    spec["elastic"] = {"minWorkers": 1, "maxWorkers": over.get("max_workers", 4)}
    spec["parallelism"] = {"mode": "auto"}
    spec["globalBatchSize"] = 12
    spec["training"] = {"steps": 100000, "seqLen": 32, "learningRate": 0.0003}
    spec.pop("checkpoint", None)
    spec["agent"] = {"port": 50051}
    return doc


def claim(core, namespace: str, name: str) -> None:
    """A ReadWriteMany claim for checkpoints; the dev cluster's pod runner provisions it (a
    directory every pod mounting it shares) and kube-controller-manager's binder binds it."""
    core.create_namespaced_persistent_volume_claim(namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteMany"],
                 "resources": {"requests": {"storage": "1Gi"}}}})


def get(custom, namespace, name) -> dict:
    return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def events(core, namespace, name) -> list:
    return [e for e in core.list_namespaced_event(namespace).items
            if e.involved_object.name == name and e.involved_object.kind == "DynaTrainJob"]


def agent_client(core, namespace: str, job_name: str, pod, **kwargs):
    """A client of worker ``pod``'s agent as the operator makes one: mutual TLS with the
    operator's client certificate (from the job's ``<job>-agent-pki`` Secret), verifying the
    pod's name under the job's Service, and the job's token (``<job>-agent-token``)."""
    import base64

    from dynatrain.agent.auth import ClientTls
    from dynatrain.agent.client import AgentClient
    from dynatrain.operator import pki

    data = pki.secret_bytes(core.read_namespaced_secret(pki.pki_secret_name(job_name),
                                                        namespace).data)
    token = base64.b64decode(core.read_namespaced_secret(f"{job_name}-agent-token", namespace)
                             .data["token"]).decode()
    tls = ClientTls(data["serving-ca.crt"], data["client.crt"], data["client.key"],
                    server_name=pki.server_name(pod.metadata.name, job_name, namespace))
    return AgentClient(f"{pod.status.pod_ip}:50051", token=token, tls=tls, **kwargs)


def condition(custom, namespace, name, kind) -> dict | None:
    """The job's status condition of this type, if it has one."""
    for c in get(custom, namespace, name).get("status", {}).get("conditions", []):
        if c["type"] == kind:
            return c
    return None


def apply(kubectl, namespace, tmp_path, doc) -> None:
    """``kubectl apply`` of ``doc`` (a fresh file per call: a test may apply a job twice)."""
    path = tmp_path / f"{doc['metadata']['name']}-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(doc))
    kubectl("apply", "-n", namespace, "-f", str(path))


def job_pods(core, namespace, name) -> list:
    return core.list_namespaced_pod(namespace, label_selector=f"dynatrain.io/job={name}").items


def running_on(custom, namespace: str, name: str, workers: int):
    """For :func:`wait`: the job's status once it is Running on ``workers`` workers."""
    def check():
        st = get(custom, namespace, name).get("status", {})
        return st if st.get("phase") == "Running" and st.get("workers") == workers else None
    return check


def audited_past(custom, namespace: str, name: str, step: int):
    """For :func:`wait`: the job's data audit once it covers a few steps past ``step``."""
    def check():
        data = get(custom, namespace, name).get("status", {}).get("data", {})
        return data if data.get("auditedStep", 0) > step + 2 else None
    return check


def remove_jobs(kubectl, core, namespace: str, names, nodes=(), timeout: float = 120) -> None:
    """A test's end: its jobs deleted, their pods gone, then its own nodes deleted."""
    from dynatrain.devcluster.nodes import delete_node

    for name in names:
        kubectl("delete", "dynatrainjob", name, "-n", namespace, "--wait=false", check=False)
    for name in names:
        wait(f"{name}'s pods to go", lambda: not job_pods(core, namespace, name),
             timeout=timeout)
    for n in nodes:
        delete_node(core, n)


POOL_LABEL = "dynatrain.io/test-pool"


def pool_node(prefix: str, index: int, pool: str, gpus: int = 2):
    """One simulated node of a test's own GPU pool: tainted as managed GPU pools are and
    labelled ``pool``, so only jobs placed with :func:`on_pool` run there."""
    from dynatrain.devcluster.nodes import NodePool, Taint

    return NodePool(count=1, gpus_per_node=gpus, name_prefix=prefix, first_index=index,
                    labels={POOL_LABEL: pool},
                    taints=(Taint(key="nvidia.com/gpu", value="present", effect="NoSchedule"),))


def on_pool(doc: dict, pool: str) -> dict:
    """``doc`` (a DynaTrainJob) with a pod template that places its workers on ``pool``."""
    doc["spec"]["template"] = {"spec": {
        "nodeSelector": {POOL_LABEL: pool},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                         "effect": "NoSchedule"}]}}
    return doc
