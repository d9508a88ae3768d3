"""One watch-based view of the cluster's nodes and pods, shared by every job of the operator.

Each job's daemon reconciles its job every tick (half a second while all is well) and needs
to know the nodes, the job's pods and, to count free GPUs, every pod bound to a node. Listing
those on every tick costs a few list calls per job per tick: with 20 jobs, about a hundred
requests a second, each listing every pod of the cluster. A :class:`ClusterView` replaces
those lists with one list and then one long-running watch per resource (nodes, pods) for the
whole operator process: the apiserver streams each change once, the view applies it to an
in-memory copy and its indexes, and the jobs' passes read memory. It is the same idea as
client-go's shared informers (reflector + indexed store + event handlers), cut down to what
the operator reads: two resources, two indexes, and a per-job change counter that lets a
job's loop wake as soon as something it cares about changed instead of sleeping a fixed tick.

How each resource is kept (one background thread each):

* **list, then watch** from the list's resourceVersion, with bookmarks (the apiserver
  periodically sends the newest resourceVersion, so a quiet watch can resume from a recent
  one) and a server-side timeout of a few minutes; when the watch ends, a new one starts from
  the last resourceVersion seen: no list, nothing missed;
* **410 Gone** (the resourceVersion is older than the apiserver's watch history): list again
  and apply the difference between the stored objects and the fresh list as if it had come
  as events, so indexes and change counters stay right;
* **any other error**: logged with how many times in a row it happened, then retried after a
  capped exponential back-off (the thread never ends on an error; one that keeps failing
  keeps logging); a failed watch resumes from its resourceVersion, a failed list lists again.

The objects are the client's models (``V1Node``, ``V1Pod``), as ``Watch.stream`` yields them.
Accessors return new lists, but the objects in them are shared with the store: treat them as
read-only (an event replaces a stored object with a new one, it never changes one in place,
so a snapshot a caller holds never changes under it).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

JOB_LABEL = "dynatrain.io/job"
"""The label naming the DynaTrainJob a worker pod belongs to (the ``job_pods`` index key)."""

GONE = 410


class Gone(Exception):
    """The apiserver no longer has the watch history asked for: list again."""


@dataclass
class _Resource:
    """What one watch thread keeps: the objects and where the watch stands."""

    name: str                      # "nodes" or "pods", for logs and stats
    list_call: Callable            # e.g. CoreV1Api.list_node (bound): list and watch alike
    kind: str                      # "Node" / "Pod": list items carry no kind, watch objects do
    scope: dict = field(default_factory=dict)       # list_call's arguments: namespace, selector
    objects: dict = field(default_factory=dict)     # key -> model object
    rv: str | None = None          # where the next watch starts; None: list first
    synced: threading.Event = field(default_factory=threading.Event)
    watch: watch.Watch | None = None                # the running stream's Watch, to stop it
    thread: threading.Thread | None = None
    failures: int = 0              # consecutive errors, for the back-off and the logs
    last_error: str = ""
    stats: dict = field(default_factory=lambda: dict.fromkeys(
        ("lists", "relists", "watches", "gone", "errors", "events", "bookmarks"), 0))


class ClusterView:
    """Nodes and pods of the whole cluster, kept up to date by watches; see the module doc.

    Pods are watched in all namespaces, whatever namespace the operator serves: the free GPU
    (and CPU, memory) count of a node is its allocatable minus what *every* pod bound to it
    requests, and those pods may belong to anyone. That takes list/watch on pods cluster-wide
    (the chart's ClusterRole grants it).
    """

    def __init__(self, api: client.ApiClient, log: Callable[[str], object], *,
                 watch_timeout_s: int = 300, backoff_first_s: float = 0.5,
                 backoff_max_s: float = 30.0, page_size: int = 500,
                 pods_namespace: str | None = None, pods_selector: str = ""):
        """``pods_namespace`` and ``pods_selector`` (a label selector) narrow the pods kept
        to those the apiserver lists for them: for a reader that needs only its own pods (the
        dev cluster's pod runner), not the operator, whose free-capacity count needs all."""
        self.log = log
        self.watch_timeout_s = watch_timeout_s
        self.backoff_first_s, self.backoff_max_s = backoff_first_s, backoff_max_s
        self.page_size = page_size
        core = client.CoreV1Api(api)
        self._nodes = _Resource("nodes", core.list_node, "Node")
        # Arguments beside the call, not a functools.partial: Watch.stream reads the model
        # to deserialize into from the bound method's docstring.
        scope = {"label_selector": pods_selector} if pods_selector else {}
        if pods_namespace is None:
            self._pods = _Resource("pods", core.list_pod_for_all_namespaces, "Pod", scope)
        else:
            self._pods = _Resource("pods", core.list_namespaced_pod, "Pod",
                                   {"namespace": pods_namespace, **scope})
        self._resources = (self._nodes, self._pods)

        # One lock guards the objects, the indexes and the change counters; the jobs' waits
        # are Conditions on that lock, one per (namespace, job) being waited on, so a change
        # to one job's pods wakes that job's loop only (a node change wakes them all).
        self._lock = threading.Lock()
        self._by_job: dict[tuple[str, str], dict[str, client.V1Pod]] = {}
        self._by_node: dict[str, dict[str, client.V1Pod]] = {}
        self._seq = 0                                   # bumped on every relevant change
        self._job_seq: dict[tuple[str, str], int] = {}  # last change to a job's pods
        self._node_seq = 0                              # last relevant change to any node
        self._waiters: dict[tuple[str, str], list] = {}  # key -> [Condition, waiting count]
        self._stopping = threading.Event()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the two watch threads (list first, then watch); returns at once."""
        if self._stopping.is_set():
            raise RuntimeError("a stopped ClusterView cannot be started again")
        for r in self._resources:
            if r.thread is None:
                r.thread = threading.Thread(target=self._run, args=(r,), daemon=True,
                                            name=f"dynatrain-watch-{r.name}")
                r.thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the watch threads: each running stream is closed (its socket shut down), and
        the server-side timeout bounds the wait in any case. Wakes every ``wait_for_change``."""
        self._stopping.set()
        with self._lock:
            for cond, _ in self._waiters.values():
                cond.notify_all()
        deadline = time.monotonic() + timeout_s
        for r in self._resources:
            # Watch.stream() resets the Watch's stop flag when it (re)starts, so a stop that
            # lands just before a new stream begins would be forgotten: repeat it until the
            # thread has ended.
            while r.thread is not None and r.thread.is_alive() and time.monotonic() < deadline:
                w = r.watch
                if w is not None:
                    w.stop()
                r.thread.join(0.1)
            if r.thread is not None and r.thread.is_alive():
                self.log(f"cluster view: the {r.name} watch thread did not end within "
                         f"{timeout_s:.0f} s (it ends at its server timeout)")

    # -- reading ---------------------------------------------------------------------------------
    def nodes(self) -> list[client.V1Node]:
        """Every node (what the last list and the events since say)."""
        with self._lock:
            return list(self._nodes.objects.values())

    def job_pods(self, namespace: str, job: str) -> list[client.V1Pod]:
        """The pods of ``namespace`` labelled ``dynatrain.io/job=<job>``, whoever owns them."""
        with self._lock:
            return list(self._by_job.get((namespace, job), {}).values())

    def pods(self) -> list[client.V1Pod]:
        """Every pod kept (all of them, or those of the view's namespace and selector)."""
        with self._lock:
            return list(self._pods.objects.values())

    def pods_on_nodes(self) -> list[client.V1Pod]:
        """Every pod bound to a node, in every namespace and phase (for capacity: callers
        skip the Succeeded and Failed ones, which hold no resources)."""
        with self._lock:
            return [p for pods in self._by_node.values() for p in pods.values()]

    def synced(self) -> bool:
        """Whether nodes and pods have both been listed once (after that, the view stays
        synced: a relist after a 410 replaces the contents, it does not empty them first)."""
        return all(r.synced.is_set() for r in self._resources)

    def wait_synced(self, timeout_s: float) -> None:
        """Return once ``synced()``; raise TimeoutError naming what did not sync (and why,
        when its last attempt failed) after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for r in self._resources:
            r.synced.wait(max(0.0, deadline - time.monotonic()))
        missing = [r for r in self._resources if not r.synced.is_set()]
        if missing:
            what = "; ".join(f"{r.name}" + (f" (last error: {r.last_error})" if r.last_error
                                            else " (no answer yet)") for r in missing)
            started = "" if all(r.thread for r in self._resources) else " (start() not called)"
            raise TimeoutError(f"the cluster view did not sync within {timeout_s:g} s{started}: "
                               f"{what}")

    def wait_for_change(self, namespace: str, job: str, since: int, timeout_s: float) -> int:
        """Wait until something relevant to the job changed; return its change number.

        The change number of ``(namespace, job)`` grows (never shrinks) whenever one of the
        job's pods (labelled ``dynatrain.io/job=<job>`` in ``namespace``) is added, changed or
        deleted, and whenever a node is added, deleted or changes in a way a job can read
        (labels, spec such as taints and cordon, allocatable, capacity, condition statuses,
        deletion); heartbeat-only node updates wake nobody. Changes to other jobs' pods do
        not wake the job either, though they change free capacity: the caller's timeout
        (its tick) covers those.

        Returns at once if the number differs from ``since`` (pass the number returned by the
        previous call, or 0 the first time); otherwise waits up to ``timeout_s`` and returns
        the number then (equal to ``since`` if nothing changed). Also returns when the view
        is stopped. Typical loop::

            since = 0
            while True:
                reconcile()
                since = view.wait_for_change(ns, job, since, tick_s)
        """
        key = (namespace, job)
        deadline = time.monotonic() + timeout_s
        with self._lock:
            entry = self._waiters.setdefault(key, [threading.Condition(self._lock), 0])
            entry[1] += 1
            try:
                while True:
                    now = self._change_number(key)
                    left = deadline - time.monotonic()
                    if now != since or left <= 0 or self._stopping.is_set():
                        return now
                    entry[0].wait(left)
            finally:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._waiters[key]

    def stats(self) -> dict:
        """Requests made and events seen, summed over both resources, plus per resource
        (``by_resource``): lists (list requests, one per page), relists (full lists after the
        first one), watches (watch requests started), gone (410s), errors (any other failure),
        events (added/modified/deleted events of the watches), bookmarks."""
        with self._lock:
            per = {r.name: dict(r.stats) for r in self._resources}
        total = {k: sum(s[k] for s in per.values()) for k in self._nodes.stats}
        return {**total, "by_resource": per}

    # -- the watch threads -----------------------------------------------------------------------
    def _run(self, r: _Resource) -> None:
        """The thread of one resource: sync, then watch, forever, until stopped."""
        while not self._stopping.is_set():
            try:
                self._step(r)
                r.failures, r.last_error = 0, ""
            except Exception as e:          # never die: say it, wait, try again
                if self._stopping.is_set():
                    break
                r.failures += 1
                r.last_error = _describe(e)
                with self._lock:
                    r.stats["errors"] += 1
                delay = min(self.backoff_max_s, self.backoff_first_s * 2 ** (r.failures - 1))
                delay *= random.uniform(0.8, 1.0)       # operators restarted together spread
                self.log(f"cluster view: {'watching' if r.rv else 'listing'} {r.name} failed "
                         f"({r.failures} in a row): {r.last_error}; retrying in {delay:.1f} s")
                self._stopping.wait(delay)

    def _step(self, r: _Resource) -> None:
        """List if there is nothing to resume from, then watch until the watch ends (server
        timeout, stop). A 410 clears the resourceVersion, so that the next step lists."""
        try:
            if r.rv is None:
                self._list(r)
            self._watch(r)
        except Gone as e:
            r.rv = None
            with self._lock:
                r.stats["gone"] += 1
            self.log(f"cluster view: the {r.name} watch expired ({e}); listing again")

    def _list(self, r: _Resource) -> None:
        """List every object (in pages; the pages form one consistent snapshot) and make the
        store exactly that, bumping the change counters of what differs."""
        relist = r.synced.is_set()
        items, token, rv = [], None, None
        while True:
            with self._lock:
                r.stats["lists"] += 1
            kwargs = {"limit": self.page_size, "_request_timeout": 60}
            if token:
                kwargs["_continue"] = token
            try:
                page = r.list_call(**r.scope, **kwargs)
            except ApiException as e:       # an expired continue token: start over
                if e.status == GONE:
                    raise Gone(f"list: {e.reason}") from e
                raise
            items.extend(page.items or [])
            token, rv = page.metadata._continue, page.metadata.resource_version
            if not token:
                break
        for obj in items:                   # list items have no kind; watch objects do
            obj.api_version, obj.kind = "v1", r.kind
        with self._lock:
            if relist:
                r.stats["relists"] += 1
            fresh = {self._key(r, o): o for o in items}
            for key, old in list(r.objects.items()):
                if key not in fresh:
                    self._apply(r, "DELETED", old)
            for key, obj in fresh.items():
                old = r.objects.get(key)
                if old is None or old.metadata.resource_version != obj.metadata.resource_version:
                    self._apply(r, "MODIFIED" if old else "ADDED", obj)
        r.rv = rv
        if not relist:
            self.log(f"cluster view: {len(items)} {r.name} listed; watching from "
                     f"resourceVersion {rv}")
        r.synced.set()

    def _watch(self, r: _Resource) -> None:
        """One watch request from ``r.rv``, applying its events; returns when it ends."""
        w = watch.Watch()
        r.watch = w
        if self._stopping.is_set():      # stop() may have looked before r.watch was set
            return
        with self._lock:
            r.stats["watches"] += 1
        # The server ends the watch after timeout_seconds (jittered so the two watches, and
        # operators started together, do not all come back at once). The client-side read
        # timeout only catches a connection that died silently: a live watch sends at least
        # its end before then.
        timeout = int(self.watch_timeout_s * random.uniform(1.0, 1.2)) or 1
        try:
            for event in w.stream(r.list_call, **r.scope, resource_version=r.rv,
                                  allow_watch_bookmarks=True, timeout_seconds=timeout,
                                  _request_timeout=(30, timeout + 60)):
                self._on_event(r, event)
                if self._stopping.is_set():
                    break
        except ApiException as e:
            # With timeout_seconds set, Watch.stream does not retry: an ERROR event with code
            # 410 (the usual way a watch learns it is too old) arrives here as an ApiException,
            # as does an HTTP 410 answer to the request itself.
            if e.status == GONE:
                raise Gone(f"watch: {e.reason}") from e
            raise
        finally:
            r.watch = None

    def _on_event(self, r: _Resource, event: dict) -> None:
        """Apply one event of the stream to the store and note where the watch stands."""
        kind = event["type"]
        if kind == "ERROR":
            # Watch.stream raises these itself; kept for a client that passes them on.
            status = event.get("raw_object") or {}
            message = f"{status.get('reason')}: {status.get('message')}"
            if status.get("code") == GONE:
                raise Gone(f"watch: {message}")
            raise ApiException(status=status.get("code"), reason=message)
        if kind == "BOOKMARK":
            # Only metadata.resourceVersion is meaningful, and the client leaves the object
            # a dict (it does not deserialize bookmarks).
            r.rv = event["raw_object"]["metadata"]["resourceVersion"]
            with self._lock:
                r.stats["bookmarks"] += 1
            return
        obj = event["object"]
        with self._lock:
            r.stats["events"] += 1
            self._apply(r, kind, obj)
        r.rv = obj.metadata.resource_version

    # -- the store (called with the lock held) ---------------------------------------------------
    @staticmethod
    def _key(r: _Resource, obj) -> str:
        # Nodes by name (a node's name is its identity for pods' nodeName); pods by uid (a pod
        # deleted and created again under its name is another pod).
        return obj.metadata.name if r.kind == "Node" else obj.metadata.uid

    def _apply(self, r: _Resource, kind: str, obj) -> None:
        key = self._key(r, obj)
        old = r.objects.pop(key, None)
        if kind != "DELETED":
            r.objects[key] = obj
        if r.kind == "Node":
            if kind == "MODIFIED" and old is not None and _node_view(old) == _node_view(obj):
                return                      # a heartbeat: nothing a job reads changed
            self._seq += 1
            self._node_seq = self._seq
            for cond, _ in self._waiters.values():
                cond.notify_all()
            return
        changed = set()
        if old is not None:
            changed.add(self._unindex(key, old))
        if kind != "DELETED":
            changed.add(self._index(key, obj))
        changed.discard(None)
        for job in changed:
            self._seq += 1
            self._job_seq[job] = self._seq
            waiter = self._waiters.get(job)
            if waiter:
                waiter[0].notify_all()

    def _index(self, key: str, pod) -> tuple[str, str] | None:
        if pod.spec and pod.spec.node_name:
            self._by_node.setdefault(pod.spec.node_name, {})[key] = pod
        job = _job_key(pod)
        if job:
            self._by_job.setdefault(job, {})[key] = pod
        return job

    def _unindex(self, key: str, pod) -> tuple[str, str] | None:
        if pod.spec and pod.spec.node_name:
            _discard(self._by_node, pod.spec.node_name, key)
        job = _job_key(pod)
        if job:
            _discard(self._by_job, job, key)
        return job

    def _change_number(self, key: tuple[str, str]) -> int:
        return max(self._job_seq.get(key, 0), self._node_seq)


def _job_key(pod) -> tuple[str, str] | None:
    job = (pod.metadata.labels or {}).get(JOB_LABEL)
    return (pod.metadata.namespace, job) if job else None


def _discard(index: dict, bucket, key: str) -> None:
    items = index.get(bucket)
    if items is not None:
        items.pop(key, None)
        if not items:
            del index[bucket]


def _node_view(node) -> tuple:
    """What of a node a job may read: a change here wakes the jobs; heartbeats (condition
    times, images, the kubelet's status refreshes) change none of it."""
    status = node.status
    return (node.metadata.labels, node.metadata.deletion_timestamp, node.spec,
            status.allocatable if status else None, status.capacity if status else None,
            [(c.type, c.status, c.reason) for c in (status.conditions or [])] if status else [])


def _describe(e: Exception) -> str:
    if isinstance(e, ApiException):
        return f"HTTP {e.status} {e.reason}"
    return f"{type(e).__name__}: {e}"
