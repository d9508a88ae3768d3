"""Runs the containers of simulated pods as local processes: the part of a kubelet kwok lacks.

kwok makes pods Running with a pod IP but starts nothing. For the operator's tests the worker
pods must really train and switch, so this harness watches a namespace and, for every Running
pod with an IP, starts its (single) container's command as a process here, the way a kubelet
would: ``command`` + ``args`` with ``$(VAR)`` references expanded from the container's env
(downward-API ``status.podIP`` and ``metadata.name`` included), ConfigMap and Secret volumes
written to a directory per pod and their mount paths mapped onto it. The dev cluster hands out
pod IPs from 127.0.0.0/8, so a worker binds its pod IP on loopback and the operator reaches it
there as it would on a cluster network. A pod being deleted gets SIGTERM, and SIGKILL when its
grace period ends; a pod that is gone is killed.

The image is not pulled: ``dynatrain`` in a command means this checkout's console script.
"""

from __future__ import annotations

import base64
import datetime
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kubernetes.client.rest import ApiException

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass
class _Proc:
    proc: subprocess.Popen
    log: Path
    terminated: bool = False
    kill_at: float | None = None


class PodProcesses:
    def __init__(self, core, namespace: str, workdir: Path, *, selector: str = ""):
        self.core, self.namespace, self.selector = core, namespace, selector
        self.workdir = Path(workdir)
        self.procs: dict[str, _Proc] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pod-processes", daemon=True)
        self.errors: list[str] = []

    def __enter__(self) -> "PodProcesses":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        for p in self.procs.values():
            if p.proc.poll() is None:
                p.proc.kill()
        for p in self.procs.values():
            p.proc.wait(10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except ApiException as e:   # the apiserver is busy: try again next round
                self.errors.append(f"{e.status} {e.reason}")
            self._stop.wait(0.2)

    def sync(self) -> None:
        pods = {p.metadata.name: p for p in self.core.list_namespaced_pod(
            self.namespace, label_selector=self.selector).items}
        now = time.monotonic()
        for name, p in self.procs.items():
            pod = pods.get(name)
            if p.proc.poll() is not None:
                continue
            if pod is None:
                p.proc.kill()
            elif pod.metadata.deletion_timestamp is not None and not p.terminated:
                p.terminated = True
                p.proc.send_signal(signal.SIGTERM)
                left = (pod.metadata.deletion_timestamp
                        - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
                p.kill_at = now + max(0.0, left)
            elif p.kill_at is not None and now >= p.kill_at:
                p.proc.kill()
        for name, pod in pods.items():
            if (name not in self.procs and pod.status and pod.status.phase == "Running"
                    and pod.status.pod_ip and pod.metadata.deletion_timestamp is None):
                self.procs[name] = self._start(pod)

    def log(self, pod_name: str) -> str:
        p = self.procs.get(pod_name)
        return p.log.read_text() if p and p.log.exists() else ""

    # -- one container ----------------------------------------------------------------------------
    def _start(self, pod) -> _Proc:
        name = pod.metadata.name
        root = self.workdir / name
        root.mkdir(parents=True, exist_ok=True)
        container = pod.spec.containers[0]
        env = self._env(pod, container)
        mounts = self._volumes(pod, container, root)

        def expand(text: str) -> str:
            text = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)
            for mount_path, local in mounts.items():
                if text == mount_path or text.startswith(mount_path + "/"):
                    text = str(local) + text[len(mount_path):]
            return text

        argv = [expand(a) for a in (container.command or []) + (container.args or [])]
        if argv and argv[0] == "dynatrain":
            argv = [sys.executable, "-m", "dynatrain", *argv[1:]]
        log = root / "container.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**os.environ, **env})
        return _Proc(proc, log)

    @staticmethod
    def _env(pod, container) -> dict[str, str]:
        fields = {"status.podIP": pod.status.pod_ip, "metadata.name": pod.metadata.name,
                  "metadata.namespace": pod.metadata.namespace,
                  "spec.nodeName": pod.spec.node_name}
        env = {}
        for e in container.env or []:
            if e.value is not None:
                env[e.name] = e.value
            elif e.value_from and e.value_from.field_ref:
                env[e.name] = fields.get(e.value_from.field_ref.field_path) or ""
        return env

    def _volumes(self, pod, container, root: Path) -> dict[str, Path]:
        volumes = {v.name: v for v in pod.spec.volumes or []}
        mounts = {}
        for m in container.volume_mounts or []:
            v = volumes[m.name]
            local = root / "volumes" / m.name
            local.mkdir(parents=True, exist_ok=True)
            if v.config_map is not None:
                cm = self.core.read_namespaced_config_map(v.config_map.name, self.namespace)
                for key, value in (cm.data or {}).items():
                    (local / key).write_text(value)
            elif v.secret is not None:
                sec = self.core.read_namespaced_secret(v.secret.secret_name, self.namespace)
                items = {i.key: i.path for i in v.secret.items or []} or \
                    {k: k for k in (sec.data or {})}
                for key, path in items.items():
                    (local / path).write_bytes(base64.b64decode(sec.data[key]))
                    (local / path).chmod(0o600)
            mounts[m.mount_path] = local
        return mounts
