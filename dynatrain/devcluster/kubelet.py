"""One node of the dev cluster run by a real kubelet, with containerd and runc.

The simulated nodes (kwok) run no containers; :mod:`.pods` starts their pods' commands as
local processes. A :class:`RealNode` is the real thing on this machine: containerd (Debian's
package) with runc, the CNI ``bridge`` plugin on a private bridge, and a kubelet built from the
same pinned Kubernetes module as the control plane (``tools/k8s``). Pods scheduled onto it run
in containers from images built here (:mod:`.images`: no registry is reachable), with their own
network namespace, cgroup limits, mounted ConfigMaps, Secrets and volumes, probes, logs
(``kubectl logs``) and the kubelet's own status reports.

What this host needs, checked before anything starts (:func:`preflight`): root, the
``containerd``, ``ctr`` and ``runc`` commands, the CNI plugins in ``/usr/lib/cni``
(``tools/install-debs.sh containerd runc containernetworking-plugins`` installs them) and cgroups.
Two settings make the kubelet run in the sandboxes this project is developed in, and are the
only departures from a default node:

- ``failCgroupV1: false``: the hosts here mount cgroup v1 (v1 is deprecated, not removed);
- containerd's ``restrict_oom_score_adj = true``: the process lacks ``CAP_SYS_RESOURCE``, so
  runc cannot lower a container's ``oom_score_adj`` below its own (every sandbox failed with
  "can't get final child's PID from pipe" without it; see ``KUBELET.md``).

Isolation from the host and from other dev clusters: containerd's root, state and socket, the
kubelet's root directory and the CNI configuration and IP allocations live in the cluster's work
directory; the bridge (``dt`` + 6 hex digits) and its /24 are chosen unused; pods' cgroups live
under their own cgroup root. The node's IP is the bridge's gateway address, which the host owns,
so the operator on the host reaches pods and pods reach the host (the rendezvous store) there.
:meth:`RealNode.stop` drains the node's pods through the kubelet, then kills whatever is left in
its cgroups, unmounts what lies under the work directory and removes the bridge.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .certs import CertPair
from .errors import DevClusterError
from .gobuild import TOOLS
from dynatrain.ports import free_port

from .processes import Component, check_output, wait_until

CNI_BIN_DIR = Path("/usr/lib/cni")
EVICTION_NODEFS_PERCENT = 1
"""The kubelet evicts pods once less than this share of its disk is free (``evictionHard``;
Kubernetes' default is 10 %, too much for a shared development disk)."""
_GIB = 1 << 30
CNI_PLUGINS = ("bridge", "host-local", "loopback")
REAL_NODE_LABEL = "dynatrain.io/real-node"
"""Set to ``"true"`` on a kubelet-run node (kwok's nodes carry kwok's annotation instead)."""
INSTALL_HINT = "tools/install-debs.sh containerd runc containernetworking-plugins debootstrap"


def preflight() -> list[str]:
    """What this host lacks to run a real node (empty: nothing)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (containerd, runc and the kubelet manage mounts, cgroups and "
                       "network namespaces)")
    for command in ("containerd", "ctr", "runc", "ip"):
        if shutil.which(command) is None:
            missing.append(f"the `{command}` command")
    for plugin in CNI_PLUGINS:
        if not (CNI_BIN_DIR / plugin).is_file():
            missing.append(f"the CNI plugin {CNI_BIN_DIR / plugin}")
    if not _cgroup_mounts():
        missing.append("cgroups mounted under /sys/fs/cgroup")
    return missing


def _cgroup_mounts() -> list[Path]:
    """Every cgroup hierarchy's mount point (v1 controllers, or the one v2 tree)."""
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            before, _, after = line.partition(" - ")
            fstype = after.split()[0] if after else ""
            if fstype in ("cgroup", "cgroup2"):
                mounts.append(Path(before.split()[4]))
    return mounts


def _addresses_in_use() -> list[ipaddress.IPv4Interface]:
    out = check_output(["ip", "-j", "-4", "addr", "show"], timeout=60,
                       what="listing this host's addresses")
    return [ipaddress.IPv4Interface(f"{a['local']}/{a['prefixlen']}")
            for link in json.loads(out) for a in link.get("addr_info", [])]


def _free_subnet(pool: ipaddress.IPv4Network, prefix: int = 24) -> ipaddress.IPv4Network:
    """The first /``prefix`` of ``pool`` that no address of this host touches."""
    used = [a.network for a in _addresses_in_use()]
    for subnet in pool.subnets(new_prefix=prefix):
        if not any(subnet.overlaps(u) for u in used):
            return subnet
    raise DevClusterError(f"no free /{prefix} left in {pool} for a real node's bridge")


def _suffix(workdir: Path) -> str:
    return hashlib.sha256(str(workdir).encode()).hexdigest()[:6]


def bridge_name(workdir: Path) -> str:
    """The bridge of the real node whose work directory is ``workdir`` (``dt`` + 6 hex)."""
    return f"dt{_suffix(workdir)}"


@dataclass(frozen=True, kw_only=True)
class RealNodeConfig:
    """A kubelet-run node: its name, labels, taints and pod network."""

    name: str = "real-node-0"
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[str, ...] = ()
    """``key=value:Effect`` strings, registered with the node."""
    bridge_pool: str = "10.89.0.0/16"
    """Where the node's /24 pod network is taken from (the first one not in use here)."""
    pod_images: tuple[str, ...] = ("worker",)
    """Images to build (:mod:`.images`) and import besides the pause image: ``worker`` is the
    project's own image, ``localhost/dynatrain:dev``; ``operator`` its slim operator image,
    ``localhost/dynatrain-operator:dev`` (no torch)."""


class RealNode:
    """containerd + kubelet for one node; :meth:`start` after the control plane is up."""

    def __init__(self, config: RealNodeConfig, *, workdir: Path, server: str, ca: Path,
                 client: CertPair, lease_s: int,
                 kubelet_binary: Path,
                 start_component: Callable[[str, list[str]], Component],
                 log: Callable[[str], None], repo_root: Path | None = None) -> None:
        self.config = config
        self.workdir = workdir
        self._server, self._ca, self._client = server, ca, client
        self._lease_s = lease_s
        self._kubelet_binary = kubelet_binary
        self._start_component = start_component
        self._log = log
        self._repo_root = repo_root
        self._suffix = _suffix(workdir)
        self.bridge = bridge_name(workdir)
        self.cgroup_root = f"/dynatrain-{self._suffix}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.node_ip: str | None = None
        self.containerd_socket = workdir / "containerd" / "containerd.sock"
        self.kubelet: Component | None = None
        self.containerd: Component | None = None
        self.images: dict[str, str] = {}
        """Image name (``pause``, ``worker``, ``operator``) -> its reference in containerd."""

    # -- start ---------------------------------------------------------------

    def start(self, start_timeout: datetime.timedelta) -> None:
        missing = preflight()
        if missing:
            raise DevClusterError("this host cannot run a real node: it lacks "
                                  + "; ".join(missing) + f" (install: {INSTALL_HINT})")
        wanted = self._build_images()       # first: a build can take minutes, cold
        self._make_bridge()
        self._make_cgroup_root()
        self._start_containerd(start_timeout, pause=wanted[0].ref)
        self._import_images(wanted)
        self._start_kubelet(start_timeout)

    def _make_bridge(self) -> None:
        # The bridge exists before the first pod (the CNI plugin adopts it), so that the node
        # IP, which the kubelet needs at start, is on it and the host can bind it at once.
        # Its name comes from the work directory's path: one of that name now is a leftover
        # of an earlier run killed in a directory of the same path (no live run shares it),
        # and it goes first, with its subnet.
        if subprocess.run(["ip", "link", "show", self.bridge],
                          capture_output=True).returncode == 0:
            self._log(f"[devcluster] real node {self.config.name}: removing bridge "
                      f"{self.bridge}, left by an earlier run in {self.workdir}")
            check_output(["ip", "link", "delete", self.bridge], timeout=60,
                         what="removing a stale bridge")
        self.subnet = _free_subnet(ipaddress.IPv4Network(self.config.bridge_pool))
        self.node_ip = str(self.subnet[1])
        check_output(["ip", "link", "add", self.bridge, "type", "bridge"], timeout=60,
                     what="creating the bridge")
        check_output(["ip", "addr", "add", f"{self.node_ip}/{self.subnet.prefixlen}", "dev",
                      self.bridge], timeout=60, what="addressing the bridge")
        check_output(["ip", "link", "set", self.bridge, "up"], timeout=60,
                     what="bringing the bridge up")
        cni = self.workdir / "cni"
        (cni / "net.d").mkdir(parents=True, exist_ok=True)
        (cni / "net.d" / "10-dynatrain.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": f"dynatrain-{self._suffix}",
            "plugins": [{
                "type": "bridge", "bridge": self.bridge, "isGateway": True,
                # No NAT: pods talk to the host and to each other on the bridge only.
                "ipMasq": False, "hairpinMode": True,
                "ipam": {"type": "host-local", "dataDir": str(cni / "ipam"),
                         "ranges": [[{"subnet": str(self.subnet),
                                      "gateway": self.node_ip}]]},
            }]}, indent=1))
        self._log(f"[devcluster] real node {self.config.name}: bridge {self.bridge} "
                  f"{self.node_ip}/{self.subnet.prefixlen}")

    def _make_cgroup_root(self) -> None:
        # The kubelet places its QoS cgroups (kubepods...) under --cgroup-root, which must
        # exist in every hierarchy; a root of our own keeps two dev clusters apart and lets
        # stop() find every process the node started.
        for mount in _cgroup_mounts():
            (mount / self.cgroup_root.lstrip("/")).mkdir(exist_ok=True)

    def _start_containerd(self, timeout: datetime.timedelta, *, pause: str) -> None:
        d = self.workdir / "containerd"
        d.mkdir(parents=True, exist_ok=True)
        config = d / "config.toml"
        config.write_text(f"""\
version = 2
root = "{d / 'root'}"
state = "{d / 'state'}"
[grpc]
  address = "{self.containerd_socket}"
[ttrpc]
  address = "{self.containerd_socket}.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  # The process lacks CAP_SYS_RESOURCE: clamp containers' oom_score_adj to containerd's own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{self.workdir / 'cni' / 'net.d'}"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      SystemdCgroup = false
""")
        self.containerd = self._start_component(
            "containerd", ["containerd", "--config", str(config), "--log-level", "warn"])

        def serving() -> bool:
            subprocess.run(["ctr", "-a", str(self.containerd_socket), "version"],
                           capture_output=True, timeout=10, check=True)
            return True

        wait_until(f"containerd at {self.containerd_socket}", serving, timeout=timeout,
                   component=self.containerd)

    def _build_images(self) -> list:
        """The pause image, then :attr:`RealNodeConfig.pod_images` (cached builds)."""
        from . import images

        unknown = [n for n in self.config.pod_images if n not in images.PROJECT_IMAGES]
        if unknown:
            raise DevClusterError(f"RealNodeConfig.pod_images: unknown image(s) {unknown}; "
                                  f"known: {sorted(images.PROJECT_IMAGES)}")
        return [images.pause_image(), *(images.project_image(name, self._repo_root or TOOLS.parent)
                                        for name in self.config.pod_images)]

    def _import_images(self, wanted: list) -> None:
        from . import images

        self._check_disk(wanted)
        started = time.monotonic()
        images.import_images(self.containerd_socket, wanted)
        self.images = {"pause": wanted[0].ref,
                       **{n: img.ref for n, img in zip(self.config.pod_images, wanted[1:])}}
        self._log(f"[devcluster] real node {self.config.name}: imported "
                  f"{', '.join(self.images.values())} in {time.monotonic() - started:.0f} s")

    def _check_disk(self, wanted: list) -> None:
        """Refuse to start, saying why, if importing ``wanted`` would leave the disk below the
        kubelet's eviction threshold: the kubelet would then evict the node's pods (the job's
        workers, the operator) for ``ephemeral-storage`` as they start, which a test sees only
        as a job that never trains. containerd keeps each image twice (its content store and
        the unpacked snapshot)."""
        need = 2 * sum(img.archive.stat().st_size for img in wanted)
        usage = shutil.disk_usage(self.workdir)
        floor = usage.total * EVICTION_NODEFS_PERCENT / 100
        if usage.free - need < floor + _GIB:
            raise DevClusterError(
                f"real node {self.config.name}: importing its images needs about "
                f"{need / _GIB:.1f} GiB under {self.workdir}, and the kubelet evicts pods once "
                f"less than {EVICTION_NODEFS_PERCENT}% of that disk ({floor / _GIB:.1f} GiB) is "
                f"free; {usage.free / _GIB:.1f} GiB is free now. Free some space (old "
                "/tmp/pytest-of-* directories; a real node's work directory left by a killed "
                "run) and start again")

    def _start_kubelet(self, timeout: datetime.timedelta) -> None:
        from .kubeconfig import build_kubeconfig, write_kubeconfig

        d = self.workdir / "kubelet"
        d.mkdir(parents=True, exist_ok=True)
        name = self.config.name
        kubeconfig = write_kubeconfig(d / "kubeconfig", build_kubeconfig(
            server=self._server, ca=self._ca, client=self._client, user=f"system:node:{name}"))
        healthz = free_port()
        socket = f"unix://{self.containerd_socket}"
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": socket, "imageServiceEndpoint": socket,
            "cgroupDriver": "cgroupfs", "cgroupRoot": self.cgroup_root,
            "failSwapOn": False,
            "failCgroupV1": False,           # cgroup v1 hosts (see the module docstring)
            # Only clients with a certificate of the cluster's CA (the apiserver, for logs
            # and exec) reach the kubelet's API, on the bridge address only.
            "address": self.node_ip, "port": free_port(), "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": healthz,
            "authentication": {"anonymous": {"enabled": False},
                               "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(self._ca)}},
            "authorization": {"mode": "AlwaysAllow"},
            # The heartbeat, as kwok's: the node lifecycle controller's grace period is short.
            "nodeLeaseDurationSeconds": self._lease_s,
            "nodeStatusUpdateFrequency": "2s",
            # A shared development disk is often fuller than the defaults allow (15 % free
            # for images): no eviction, and no image GC, for images cannot be pulled again.
            "evictionHard": {"memory.available": "100Mi",
                             "nodefs.available": f"{EVICTION_NODEFS_PERCENT}%",
                             "imagefs.available": f"{EVICTION_NODEFS_PERCENT}%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "podLogsDir": str(d / "pod-logs"),
            "resolvConf": "/etc/resolv.conf",
            "registerNode": True,
            "registerWithTaints": [_taint(t) for t in self.config.taints],
        }
        config_file = d / "config.yaml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        labels = {REAL_NODE_LABEL: "true", **self.config.labels}
        self.kubelet = self._start_component("kubelet", [
            str(self._kubelet_binary), f"--config={config_file}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={d / 'root'}", f"--cert-dir={d / 'pki'}",
            f"--hostname-override={name}", f"--node-ip={self.node_ip}",
            "--node-labels=" + ",".join(f"{k}={v}" for k, v in labels.items()),
            "--v=1"])

        def healthy() -> bool:
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{healthz}/healthz", timeout=5) as r:
                return r.status == 200

        wait_until(f"the kubelet of {name} at 127.0.0.1:{healthz}/healthz", healthy,
                   timeout=timeout, component=self.kubelet)

    # -- stop ----------------------------------------------------------------

    def stop(self, core, timeout: datetime.timedelta) -> list[str]:
        """Drain, stop and clean up; the problems met (empty: none)."""
        errors: list[str] = []
        if self.kubelet is not None and self.kubelet.process.poll() is None and core:
            try:
                self._drain(core, timeout)
            except Exception as exc:  # noqa: BLE001 - clean up the rest regardless
                errors.append(f"draining {self.config.name}: {exc}")
        for component in (self.kubelet, self.containerd):
            if component is not None:
                try:
                    component.stop(timeout)
                except Exception as exc:  # noqa: BLE001
                    errors.append(f"{component.name}: {exc}")
        errors += self._kill_cgroups()
        errors += self._kill_shims()
        errors += self._unmount()
        if self.subnet is not None:
            try:
                check_output(["ip", "link", "del", self.bridge], timeout=60,
                             what="removing the bridge")
            except DevClusterError as exc:
                if "Cannot find device" not in str(exc):
                    errors.append(str(exc))
            self.subnet = None
        errors += self._remove_cgroups()
        # containerd's content and snapshots hold the unpacked images (about 12 GB for the
        # worker image): never kept, even where the work directory (logs) is.
        if not any(e.startswith("umount") for e in errors):
            for sub in ("root", "state"):
                shutil.rmtree(self.workdir / "containerd" / sub, ignore_errors=True)
        return errors

    def _drain(self, core, timeout: datetime.timedelta) -> None:
        """Delete the node's pods and wait until the kubelet has stopped their sandboxes, so
        that it unmounts their volumes and removes their network namespaces itself."""
        field = f"spec.nodeName={self.config.name}"
        for pod in core.list_pod_for_all_namespaces(field_selector=field).items:
            core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace,
                                       grace_period_seconds=1)

        def drained() -> bool:
            if core.list_pod_for_all_namespaces(field_selector=field).items:
                return False
            out = subprocess.run(["ctr", "-a", str(self.containerd_socket), "-n", "k8s.io",
                                  "tasks", "ls", "-q"], capture_output=True, text=True,
                                 timeout=10, check=True).stdout
            return not out.strip()

        wait_until(f"the pods of {self.config.name} to stop", drained, timeout=timeout * 2,
                   component=self.kubelet)

    def _cgroup_dirs(self) -> list[Path]:
        found = []
        for mount in _cgroup_mounts():
            root = mount / self.cgroup_root.lstrip("/")
            if root.is_dir():
                found += [Path(p) for p, _, _ in os.walk(root)]
        return found

    def _kill_cgroups(self) -> list[str]:
        # Containers outlive a killed shim: their processes are found by cgroup.
        for _ in range(50):
            pids = set()
            for d in self._cgroup_dirs():
                try:
                    pids |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
                except OSError:
                    continue
            if not pids:
                return []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        return [f"processes left in cgroup {self.cgroup_root}: {sorted(pids)}"]

    def _kill_shims(self) -> list[str]:
        # containerd-shim-runc-v2 runs in its own session (it must outlive a containerd
        # restart); ours name our socket in their arguments.
        needle = str(self.containerd_socket).encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"containerd-shim" in cmdline and needle in cmdline:
                try:
                    os.kill(int(proc.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return []

    def _unmount(self) -> list[str]:
        # Overlay root file systems, shm, Secret tmpfs and the kubelet's own bind mount of
        # its root directory: deepest first, lazily if still busy.
        prefix = str(self.workdir) + "/"
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
        ours = sorted({p for p in points if p.startswith(prefix)}, key=len, reverse=True)
        errors = []
        for point in ours:
            if subprocess.run(["umount", point], capture_output=True).returncode != 0:
                out = subprocess.run(["umount", "-l", point], capture_output=True, text=True)
                if out.returncode != 0 and "not mounted" not in out.stderr:
                    errors.append(f"umount {point}: {out.stderr.strip()}")
        return errors

    def _remove_cgroups(self) -> list[str]:
        left = []
        for d in sorted(self._cgroup_dirs(), key=lambda p: len(p.parts), reverse=True):
            try:
                d.rmdir()
            except OSError as exc:
                left.append(f"{d}: {exc.strerror}")
        return [f"cgroups not removed: {left[:3]}"] if left else []


def _taint(text: str) -> dict:
    """``key=value:Effect`` (or ``key:Effect``) as the kubelet's registerWithTaints entry."""
    kv, sep, effect = text.rpartition(":")
    if not sep or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
        raise ValueError(f"taint {text!r}: expected key[=value]:Effect with Effect one of "
                         "NoSchedule, PreferNoSchedule, NoExecute")
    key, _, value = kv.partition("=")
    return {"key": key, "value": value, "effect": effect}
