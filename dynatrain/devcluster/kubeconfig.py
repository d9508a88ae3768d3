"""Kubeconfig files for the dev cluster's identities (pure file writing).

Each client of the apiserver (the admin user, kube-scheduler, kwok) gets a
kubeconfig that embeds its client certificate and the cluster CA, so that the
file alone is enough to connect: it can be copied elsewhere and outlives
nothing but the cluster itself. A ServiceAccount's kubeconfig embeds its bearer
token instead (:meth:`.cluster.DevCluster.service_account_kubeconfig`).
"""

from __future__ import annotations

import base64
from pathlib import Path

import yaml

from .certs import CertPair


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def build_kubeconfig(*, server: str, ca: Path, client: CertPair, user: str,
                     context: str = "dynatrain-dev") -> dict:
    """A one-cluster, one-user kubeconfig as a dict (pure, apart from reading the PEMs)."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {
            "server": server, "certificate-authority-data": _b64(ca)}}],
        "users": [{"name": user, "user": {
            "client-certificate-data": _b64(client.cert),
            "client-key-data": _b64(client.key)}}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": user}}],
        "current-context": context,
        "preferences": {},
    }


def build_token_kubeconfig(*, server: str, ca: Path, token: str, user: str,
                           namespace: str | None = None,
                           context: str = "dynatrain-dev") -> dict:
    """A one-cluster kubeconfig whose user authenticates with a bearer token (a
    ServiceAccount's, as a pod would), as a dict (pure, apart from reading the CA)."""
    ctx = {"cluster": context, "user": user, **({"namespace": namespace} if namespace else {})}
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {
            "server": server, "certificate-authority-data": _b64(ca)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": context, "context": ctx}],
        "current-context": context,
        "preferences": {},
    }


def write_kubeconfig(path: Path, config: dict) -> Path:
    """Write ``config`` to ``path`` atomically, readable by the owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    tmp.chmod(0o600)
    # A reader polling for the file (a script waiting for the cluster) must
    # never see it half written.
    tmp.replace(path)
    return path
