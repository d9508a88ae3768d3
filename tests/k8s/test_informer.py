"""The operator's shared ClusterView against a real apiserver (kwok nodes).

Each check reads the view, never the API, and waits only as long as a watch event needs
to arrive; the opposite cases (a pod without the job label, another job's pod, an idle
window) are checked too, so a view that showed everything, woke everyone or quietly
listed again would fail.
"""

from __future__ import annotations

import functools
import json
import threading
import time

import pytest
from kubernetes import client

from dynatrain.devcluster import nodes as dn
from dynatrain.operator.informer import JOB_LABEL, ClusterView, Gone

pytestmark = [pytest.mark.k8s]

SOON_S = 5.0
"""How long a change may take to reach the view (it takes milliseconds)."""


def eventually(what: str, probe, timeout_s: float = SOON_S):
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"the view did not show {what} within {timeout_s} s")
        time.sleep(0.02)


def pod(name: str, *, job: str | None = None, node: str | None = None,
        unscheduled: bool = False) -> dict:
    spec: dict = {"containers": [{"name": "c", "image": "dynatrain/worker:dev"}],
                  "terminationGracePeriodSeconds": 0}
    if node:
        spec["nodeName"] = node
    if unscheduled:      # no scheduler will bind it: the test binds it itself
        spec["schedulerName"] = "nobody"
    meta: dict = {"name": name}
    if job:
        meta["labels"] = {JOB_LABEL: job}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def bind(core, namespace: str, name: str, node: str) -> None:
    # The client cannot read the Binding the API answers with (its model insists on a
    # `target`), hence the raw response.
    core.create_namespaced_pod_binding(name, namespace, body={
        "apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node}}, _preload_content=False)


def names(pods) -> set[str]:
    return {p.metadata.name for p in pods}


def in_namespace(pods, namespace: str) -> set[str]:
    return {p.metadata.name for p in pods if p.metadata.namespace == namespace}


@pytest.fixture(scope="module")
def gpu_node(devcluster) -> str:
    core = devcluster.core()
    return sorted(n.metadata.name for n in core.list_node().items
                  if n.metadata.name.startswith("gpu-node-"))[0]


@pytest.fixture(scope="module")
def view(devcluster):
    """One view for the module, with a 2 s server timeout so its watches end and are
    resumed several times while the tests run."""
    logs: list[str] = []
    v = ClusterView(devcluster.api_client(), log=logs.append, watch_timeout_s=2)
    v.logs = logs
    v.start()
    v.wait_synced(30)
    yield v
    v.stop()
    assert v.stats()["errors"] == 0, logs


def test_job_pod_lifecycle_and_indexes(view, core, namespace, gpu_node):
    core.create_namespaced_pod(namespace, pod("w0", job="llama", unscheduled=True))
    core.create_namespaced_pod(namespace, pod("plain", node=gpu_node))
    try:
        # In the job's index at once, and not on a node while unbound.
        eventually("w0 among llama's pods", lambda: names(view.job_pods(namespace, "llama")))
        assert names(view.job_pods(namespace, "llama")) == {"w0"}
        assert view.job_pods(namespace, "other") == [] and view.job_pods("default", "llama") == []
        # The label-less pod counts for capacity (it is on a node), but is nobody's worker.
        eventually("plain on its node", lambda: "plain" in in_namespace(view.pods_on_nodes(),
                                                                        namespace))
        assert "w0" not in in_namespace(view.pods_on_nodes(), namespace)

        bind(core, namespace, "w0", gpu_node)
        on_node = eventually("w0 bound", lambda: [p for p in view.pods_on_nodes()
                                                  if p.metadata.namespace == namespace
                                                  and p.metadata.name == "w0"])
        assert on_node[0].spec.node_name == gpu_node
        assert isinstance(on_node[0], client.V1Pod) and on_node[0].kind == "Pod"

        # kwok runs it: the status change reaches the job index.
        running = eventually("w0 Running", lambda: [
            p for p in view.job_pods(namespace, "llama")
            if p.status.phase == "Running" and p.status.pod_ip])
        assert running[0].metadata.name == "w0"

        core.delete_namespaced_pod("w0", namespace, grace_period_seconds=0)
        eventually("w0 gone", lambda: not view.job_pods(namespace, "llama")
                   and "w0" not in in_namespace(view.pods_on_nodes(), namespace))
        assert "plain" in in_namespace(view.pods_on_nodes(), namespace)
    finally:
        _delete_pods(core, namespace, ("w0", "plain"))
    eventually("every pod of the namespace gone",
               lambda: not in_namespace(view.pods_on_nodes(), namespace))


def test_a_node_taint_is_seen_and_wakes_the_jobs(view, core):
    key = "dynatrain.io/test-informer"
    node = "cpu-node-0"

    def tainted():
        n = next(n for n in view.nodes() if n.metadata.name == node)
        return any(t.key == key for t in (n.spec.taints or []))

    since = view.wait_for_change("nowhere", "nojob", 0, 0)
    assert not tainted()
    dn.taint(core, node, dn.Taint(key=key, effect="PreferNoSchedule"))
    try:
        eventually(f"the taint on {node}", tainted)
        # A node change wakes every job, even one with no pods.
        assert view.wait_for_change("nowhere", "nojob", since, 0) != since
    finally:
        dn.untaint(core, node, key)
    eventually(f"the taint off {node}", lambda: not tainted())


def test_nodes_come_and_go_and_heartbeats_wake_nobody(view, core):
    probe = "informer-probe"
    since = view.wait_for_change("nowhere", "nojob", 0, 0)
    core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": probe},
                      "spec": {"unschedulable": True, "taints": [
                          {"key": "dynatrain.io/test-informer", "effect": "NoSchedule"}]}})
    try:
        eventually("the new node", lambda: probe in names(view.nodes()))
        since = view.wait_for_change("nowhere", "nojob", since, 5)
    finally:
        core.delete_node(probe)
    eventually("the node gone", lambda: probe not in names(view.nodes()))
    since = view.wait_for_change("nowhere", "nojob", since, 0)

    # A heartbeat (only a condition's time changes) is stored, but wakes nobody.
    node = "cpu-node-0"
    stamp = "2030-01-01T00:00:00Z"
    ready = next(c for c in core.read_node_status(node).status.conditions if c.type == "Ready")
    core.patch_node_status(node, {"status": {"conditions": [
        {"type": "Ready", "status": ready.status, "lastHeartbeatTime": stamp}]}})

    def beat_seen():
        n = next(n for n in view.nodes() if n.metadata.name == node)
        return any(c.type == "Ready" and c.last_heartbeat_time.year == 2030
                   for c in n.status.conditions)
    eventually("the heartbeat", beat_seen)
    assert view.wait_for_change("nowhere", "nojob", since, 0.5) == since


def test_wait_for_change_wakes_early_only_for_its_job(view, core, namespace, gpu_node):
    since = view.wait_for_change(namespace, "llama", 0, 0)
    assert view.wait_for_change(namespace, "llama", since, 0) == since   # nothing new: at once

    # Another job's pod does not wake llama: the wait runs to its timeout.
    t0 = time.monotonic()
    core.create_namespaced_pod(namespace, pod("other-0", job="other", node=gpu_node))
    assert view.wait_for_change(namespace, "llama", since, 1.5) == since
    assert time.monotonic() - t0 >= 1.4
    assert names(view.job_pods(namespace, "other")) == {"other-0"}

    # One of llama's pods does, long before the timeout.
    woke: list = []
    waiter = threading.Thread(target=lambda: woke.append(
        (view.wait_for_change(namespace, "llama", since, 20), time.monotonic())))
    waiter.start()
    time.sleep(0.3)                               # the waiter is waiting
    assert not woke
    created = time.monotonic()
    core.create_namespaced_pod(namespace, pod("llama-0", job="llama", node=gpu_node))
    waiter.join(SOON_S)
    assert woke, "wait_for_change did not return after a change to the job's pod"
    number, when = woke[0]
    assert number != since and when - created < 3.0
    # Numbers never go back. (Not "== number": the node's status update of llama-0 may
    # already have come, a change of its own, as it did under a loaded CI machine.)
    assert view.wait_for_change(namespace, "llama", number, 0) >= number

    # Deletion is a change too.
    core.delete_namespaced_pod("llama-0", namespace, grace_period_seconds=0)
    assert view.wait_for_change(namespace, "llama", number, 10) != number
    core.delete_namespaced_pod("other-0", namespace, grace_period_seconds=0)


def test_an_idle_view_only_watches(view):
    """No list request while nothing happens: the watches end at their 2 s server timeout
    and are resumed from the last resourceVersion, without listing again."""
    before = view.stats()
    time.sleep(5)
    after = view.stats()
    for counter in ("lists", "relists", "gone", "errors"):
        assert after[counter] == before[counter], (counter, before, after)
    for resource in ("nodes", "pods"):
        assert after["by_resource"][resource]["watches"] > before["by_resource"][resource][
            "watches"], (resource, before, after)
    assert view.synced()


class _ExpiredWatch:
    """What the apiserver answers a watch whose resourceVersion it no longer has: 200, then
    one ERROR event carrying a 410 Status (the body urllib3 would stream)."""

    status = 200

    def stream(self, amt=None, decode_content=None):
        yield json.dumps({"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
            "reason": "Expired", "message": "too old resource version: 1 (300)"}}).encode() + b"\n"

    def close(self):
        pass

    def release_conn(self):
        pass


def test_410_gone_relists_and_the_view_catches_up(devcluster, core, namespace, gpu_node):
    """The apiserver keeps this dev cluster's whole watch history (its watch cache never
    evicts within a test), so it never answers 410 by itself: the next watch request of the
    running pods thread is held back while the test changes pods (events it will never see),
    then answered with a 410 ERROR event. The thread must list again and catch up."""
    logs: list[str] = []
    v = ClusterView(devcluster.api_client(), log=logs.append, watch_timeout_s=1)
    for name in ("a", "b"):
        core.create_namespaced_pod(namespace, pod(name, job="j", node=gpu_node))
    real = v._pods.list_call
    held, release = threading.Event(), threading.Event()

    @functools.wraps(real)          # Watch.stream reads the return type from its docstring
    def list_or_watch(*args, **kwargs):
        if kwargs.get("watch") and not held.is_set():
            held.set()
            release.wait(20)
            return _ExpiredWatch()
        return real(*args, **kwargs)

    v._pods.list_call = list_or_watch
    v.start()
    try:
        v.wait_synced(30)
        assert names(v.job_pods(namespace, "j")) == {"a", "b"}
        assert held.wait(10), "the pods thread never started its watch"
        since = v.wait_for_change(namespace, "j", 0, 0)
        # Missed: b deleted, c created, a relabelled to another job.
        core.delete_namespaced_pod("b", namespace, grace_period_seconds=0)
        core.create_namespaced_pod(namespace, pod("c", job="j", node=gpu_node))
        core.patch_namespaced_pod("a", namespace, {"metadata": {"labels": {JOB_LABEL: "k"}}})
        time.sleep(0.5)
        assert names(v.job_pods(namespace, "j")) == {"a", "b"}     # nothing seen yet
        assert v.stats()["relists"] == 0

        release.set()
        eventually("the relist", lambda: v.stats()["relists"] == 1)
        assert names(v.job_pods(namespace, "j")) == {"c"}
        assert names(v.job_pods(namespace, "k")) == {"a"}
        assert "b" not in in_namespace(v.pods_on_nodes(), namespace)
        assert {"a", "c"} <= in_namespace(v.pods_on_nodes(), namespace)
        assert v.wait_for_change(namespace, "j", since, 0) != since   # the relist woke the job
        stats = v.stats()
        assert stats["gone"] == 1 and stats["errors"] == 0, (stats, logs)
        assert any("pods watch expired" in line and "too old" in line for line in logs), logs

        # And it keeps watching after the relist: a change arrives as an event again.
        core.delete_namespaced_pod("c", namespace, grace_period_seconds=0)
        eventually("c gone", lambda: not v.job_pods(namespace, "j"))
        assert v.stats()["relists"] == 1
    finally:
        release.set()
        v.stop()
    _delete_pods(core, namespace, ("a", "c"))

    # An ERROR event with 410 that reaches the handler (a client that passes errors on) is a
    # Gone as well; another code is an error.
    with pytest.raises(Gone):
        v._on_event(v._pods, {"type": "ERROR", "object": {}, "raw_object": {
            "kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}})
    with pytest.raises(client.ApiException):
        v._on_event(v._pods, {"type": "ERROR", "object": {}, "raw_object": {
            "kind": "Status", "code": 500, "reason": "InternalError", "message": "boom"}})


def test_stop_is_prompt_and_wakes_waiters(devcluster):
    v = ClusterView(devcluster.api_client(), log=lambda line: None)   # 300 s server timeout
    v.start()
    v.wait_synced(30)
    woke: list = []
    waiter = threading.Thread(target=lambda: woke.append(v.wait_for_change("x", "y", -1, 60)))
    waiter2 = threading.Thread(target=lambda: woke.append(
        v.wait_for_change("x", "y", v.wait_for_change("x", "y", 0, 0), 60)))
    waiter.start()
    waiter2.start()
    waiter.join(5)
    time.sleep(0.2)
    t0 = time.monotonic()
    v.stop()
    waiter2.join(5)
    assert time.monotonic() - t0 < 3.0
    assert not v._nodes.thread.is_alive() and not v._pods.thread.is_alive()
    assert len(woke) == 2
    assert v.stats()["errors"] == 0


def test_a_failing_watch_keeps_saying_so():
    """An apiserver that cannot be reached: the threads retry with back-off and log every
    failure; wait_synced names what did not sync and why."""
    config = client.Configuration()
    config.host = "https://127.0.0.1:1"       # nothing listens there
    logs: list[str] = []
    v = ClusterView(client.ApiClient(config), log=logs.append, backoff_first_s=0.05,
                    backoff_max_s=0.2)
    v.start()
    try:
        with pytest.raises(TimeoutError) as err:
            v.wait_synced(1.0)
        assert "nodes" in str(err.value) and "pods" in str(err.value)
        assert "last error" in str(err.value)
        assert not v.synced()
        assert v.stats()["errors"] >= 4
        assert any("listing nodes failed (3 in a row)" in line for line in logs), logs
    finally:
        v.stop()


def _delete_pods(core, namespace: str, names) -> None:
    """Delete these pods now; one already gone is fine."""
    for name in names:
        try:
            core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        except client.ApiException as e:
            if e.status != 404:
                raise
