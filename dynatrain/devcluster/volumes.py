"""The dev cluster's volumes, as a kubelet and a local-path provisioner make them for
:class:`.pods.PodRunner`:

- :func:`project`: a ConfigMap's or Secret's keys written into a pod's volume directory the
  way the kubelet's atomic writer does (files behind a ``..data`` symlink swapped in one
  step), so a running process never reads half an update;
- :func:`provision_claims`: a ``hostPath`` PersistentVolume for each Pending claim of the
  dev cluster's default StorageClass (:data:`STORAGE_CLASS`), which kube-controller-manager's
  volume binder then binds, as a local-path provisioner does.
"""

from __future__ import annotations

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
