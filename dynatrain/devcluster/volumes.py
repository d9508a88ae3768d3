"""What a pod's container sees of the API in the dev cluster, as a kubelet and a local-path
provisioner make it for :class:`.pods.PodRunner`:

- :func:`container_env`: its environment (``env``, ``envFrom``, field, ConfigMap and Secret
  references);
- :func:`mount_volumes`: its volume mounts as local directories (emptyDir, ConfigMap, Secret,
  PersistentVolumeClaim), the ConfigMap and Secret ones to be re-synced (:func:`volume_data`);
- :func:`project`: a ConfigMap's or Secret's keys written into a pod's volume directory the
  way the kubelet's atomic writer does (files behind a ``..data`` symlink swapped in one
  step), so a running process never reads half an update;
- :func:`provision_claims`: a ``hostPath`` PersistentVolume for each Pending claim of the
  dev cluster's default StorageClass (:data:`STORAGE_CLASS`), which kube-controller-manager's
  volume binder then binds, as a local-path provisioner does.
"""

from __future__ import annotations

import base64
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from kubernetes import client

STORAGE_CLASS = "dynatrain-local"
"""The dev cluster's default StorageClass; the pod runner provisions its claims."""
PROVISIONER = "dynatrain.io/local-dir"


def storage_class_manifest() -> dict:
    """The default StorageClass whose claims :class:`.pods.PodRunner` provisions (pure)."""
    return {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
            "metadata": {"name": STORAGE_CLASS, "annotations": {
                "storageclass.kubernetes.io/is-default-class": "true"}},
            "provisioner": PROVISIONER, "reclaimPolicy": "Retain",
            "volumeBindingMode": "Immediate"}


def provision_claims(core: client.CoreV1Api, namespace: str | None,
                     claim_dir: Callable[[str, str], Path], say: Callable[[str], None]) -> None:
    """A PersistentVolume (hostPath on ``claim_dir(namespace, claim)``) for every Pending
    claim of :data:`STORAGE_CLASS` (in ``namespace``, or all of them with None);
    kube-controller-manager's binder binds the two."""
    from kubernetes.client.rest import ApiException

    if namespace is None:
        claims = core.list_persistent_volume_claim_for_all_namespaces().items
    else:
        claims = core.list_namespaced_persistent_volume_claim(namespace).items
    for pvc in claims:
        if (pvc.status.phase != "Pending" or pvc.spec.volume_name
                or pvc.spec.storage_class_name != STORAGE_CLASS):
            continue
        ns, name = pvc.metadata.namespace, pvc.metadata.name
        path = claim_dir(ns, name)
        path.mkdir(parents=True, exist_ok=True)
        size = ((pvc.spec.resources.requests or {}).get("storage") if pvc.spec.resources
                else None) or "1Gi"
        pv = {"apiVersion": "v1", "kind": "PersistentVolume",
              "metadata": {"name": f"pvc-{pvc.metadata.uid}",
                           "annotations": {
                               "pv.kubernetes.io/provisioned-by": PROVISIONER}},
              "spec": {"capacity": {"storage": size},
                       "accessModes": pvc.spec.access_modes or ["ReadWriteOnce"],
                       "persistentVolumeReclaimPolicy": "Retain",
                       "storageClassName": STORAGE_CLASS,
                       "claimRef": {"namespace": ns, "name": name,
                                    "uid": pvc.metadata.uid},
                       "hostPath": {"path": str(path), "type": "DirectoryOrCreate"}}}
        try:
            core.create_persistent_volume(pv)
            say(f"[pods] provisioned {ns}/{name} at {path}")
        except ApiException as e:
            if e.status != 409:                   # made on an earlier round
                raise


def project(local: Path, items, data: dict[str, bytes], *, mode: int | None) -> bool:
    """Write a ConfigMap's or Secret's keys into a volume directory: the ``items`` listed
    (key -> relative path), or every key under its own name. As the kubelet's atomic writer
    does: the files go to a new ``..<time>`` directory, the ``..data`` symlink is swapped to it
    in one rename, and each top-level name is a symlink into ``..data``, so a reader never sees
    half an update. Returns whether anything changed."""
    paths = {i.key: i.path for i in items or []} or {k: k for k in data}
    payload = {path: data[key] for key, path in paths.items()}
    current = local / "..data"
    old = current.resolve() if current.is_symlink() else None
    if old is not None and sorted(str(p.relative_to(old)) for p in old.rglob("*")
                                  if p.is_file()) == sorted(payload) and all(
            (old / p).read_bytes() == b for p, b in payload.items()):
        return False
    stamp = local / f"..{time.time_ns()}"
    for path, content in payload.items():
        target = stamp / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        if mode is not None:
            target.chmod(mode)
    tmp = local / "..data_tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(stamp.name)
    os.replace(tmp, current)
    tops = {Path(p).parts[0] for p in payload}
    for entry in local.iterdir():
        if entry.name.startswith(".."):
            continue
        if entry.name not in tops or not entry.is_symlink():   # a key that left, or stale
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    for top in tops:
        link = local / top
        if not link.is_symlink():
            link.symlink_to(Path("..data") / top)
    if old is not None and old.parent == local:
        shutil.rmtree(old, ignore_errors=True)
    return True


def config_map_data(core: client.CoreV1Api, namespace: str, name: str) -> dict[str, str]:
    return dict(core.read_namespaced_config_map(name, namespace).data or {})


def secret_bytes(core: client.CoreV1Api, namespace: str, name: str) -> dict[str, bytes]:
    data = core.read_namespaced_secret(name, namespace).data or {}
    return {k: base64.b64decode(v) for k, v in data.items()}


def volume_data(core: client.CoreV1Api, namespace: str, kind: str, name: str) -> dict[str, bytes]:
    """The bytes of a ``kind`` ("secret" or "configmap") volume's source, key by key."""
    if kind == "secret":
        return secret_bytes(core, namespace, name)
    return {k: t.encode() for k, t in config_map_data(core, namespace, name).items()}


def container_env(core: client.CoreV1Api, pod, container) -> dict[str, str]:
    """The container's environment as a kubelet makes it: ``envFrom`` sources first, then
    ``env`` (a value, a field of the pod, or a ConfigMap's or Secret's key; a missing key is
    empty)."""
    fields = {"status.podIP": pod.status.pod_ip, "status.hostIP": pod.status.host_ip,
              "metadata.name": pod.metadata.name,
              "metadata.namespace": pod.metadata.namespace,
              "metadata.uid": pod.metadata.uid, "spec.nodeName": pod.spec.node_name,
              "spec.serviceAccountName": pod.spec.service_account_name}
    ns = pod.metadata.namespace

    def secret(name: str) -> dict[str, str]:
        return {k: v.decode(errors="replace") for k, v in secret_bytes(core, ns, name).items()}

    env: dict[str, str] = {}
    for source in container.env_from or []:
        prefix = source.prefix or ""
        if source.config_map_ref is not None:
            data = config_map_data(core, ns, source.config_map_ref.name)
        elif source.secret_ref is not None:
            data = secret(source.secret_ref.name)
        else:
            continue
        env.update({prefix + k: v for k, v in data.items()})
    for e in container.env or []:
        if e.value is not None:
            env[e.name] = e.value
        elif e.value_from is None:
            env[e.name] = ""
        elif e.value_from.field_ref is not None:
            env[e.name] = fields.get(e.value_from.field_ref.field_path) or ""
        elif e.value_from.config_map_key_ref is not None:
            ref = e.value_from.config_map_key_ref
            env[e.name] = config_map_data(core, ns, ref.name).get(ref.key, "")
        elif e.value_from.secret_key_ref is not None:
            ref = e.value_from.secret_key_ref
            env[e.name] = secret(ref.name).get(ref.key, "")
    return env


def mount_volumes(core: client.CoreV1Api, pod, container, root: Path,
                  claim_dir: Callable[[str, str], Path],
                  projections: list | None = None) -> dict[str, Path]:
    """Mount path -> local directory (or file, with subPath) for each of the container's volume
    mounts, under ``root/volumes`` or a claim's ``claim_dir``; the Secret and ConfigMap volumes
    are added to ``projections`` as (directory, kind, name, items, mode), to be re-synced."""
    projections = [] if projections is None else projections
    ns = pod.metadata.namespace
    volumes = {v.name: v for v in pod.spec.volumes or []}
    mounts = {}
    for m in container.volume_mounts or []:
        v = volumes[m.name]
        if v.persistent_volume_claim is not None:
            local = claim_dir(ns, v.persistent_volume_claim.claim_name)
        else:
            local = root / "volumes" / m.name
        local.mkdir(parents=True, exist_ok=True)
        if v.config_map is not None:
            source = ("configmap", v.config_map.name, v.config_map.items, None)
        elif v.secret is not None:
            source = ("secret", v.secret.secret_name, v.secret.items, 0o600)
        else:
            source = None
        if source is not None:
            kind, name, items, mode = source
            project(local, items, volume_data(core, ns, kind, name), mode=mode)
            projections.append((local, *source))
        mounts[m.mount_path.rstrip("/") or "/"] = local / m.sub_path if m.sub_path else local
    return mounts
