"""Kueue in the dev cluster: built from its Go module, started with its webhooks and controllers.

``dynatrain dev cluster --kueue`` (and the Kueue tests) run the real Kueue manager
(``sigs.k8s.io/kueue/cmd/kueue``), compiled by the project's one Go builder (:mod:`.gobuild`)
from the wrapper module ``tools/kueue``, whose go.mod pins the release; nothing of Kueue is
imitated. What a Kueue installation's manifests would do is done here from the same module's
own files (``config/components`` in the Go module cache):

- **CRDs** (``crd/bases``): applied server-side (the Workload CRD is too large for a client-side
  apply's annotation). Only ``v1beta2``, the storage version, is used; the conversion webhook
  that serves ``v1beta1`` is not installed.
- **Webhooks** (``webhook/manifests.yaml``): the ones for Kueue's own kinds and for plain pods
  (the only integration enabled), with the apiserver calling the manager on loopback
  (``clientConfig.url``) and trusting the dev cluster's CA; the pod webhooks skip
  ``kube-system`` and ``kueue-system``, as Kueue's kustomization patches them, and see only
  pods labelled with a queue name (the only ones it manages here).
- **Certificates**: the manager's webhook and metrics serving pair is signed by the dev
  cluster's CA for 127.0.0.1 (Kueue's internal certificate manager would sign one for a
  Service DNS name the host cannot resolve). Kueue reads the metrics pair from a fixed path,
  ``/etc/kueue/metrics/certs``; the manager runs in a private mount namespace where ``/etc``
  is an overlay whose upper layer (in the work directory) holds that pair, so nothing on the
  host is written. That needs root (``unshare``, ``mount``): without it ``--kueue`` says so.
- **Configuration**: one manager, no leader election, the ``pod`` integration only, jobs
  without a queue name left alone, the visibility API off (it would need an APIService).

The built binary is cached under ``~/.cache/dynatrain/kueue/<hash>/bin/kueue``
(``DYNATRAIN_KUEUE_CACHE`` overrides the root); a cold build takes 4-8 min on 2 cores.
"""

from __future__ import annotations

import base64
import datetime
import os
import shutil
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml
from kubernetes import client

from ..ports import free_port
from .certs import CertPair, write_serving_pair
from .crds import wait_established
from .errors import DevClusterError
from .gobuild import TOOLS, GoModule, cache_root, ensure_built, run_go
from .processes import Component, check_output, wait_until

KUEUE_MODULE = "sigs.k8s.io/kueue"
NAMESPACE = "kueue-system"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""The label that puts a pod (or a job) in a LocalQueue."""
METRICS_CERT_DIR = "/etc/kueue/metrics/certs"
"""Where Kueue's manager reads its metrics serving pair when it does not mint its own."""
_KUEUE_GROUP = "kueue.x-k8s.io"


def default_toolchain() -> GoModule:
    """This checkout's ``tools/kueue``, cached under ``$XDG_CACHE_HOME/dynatrain/kueue``."""
    return GoModule(
        label="kueue",
        module_dir=TOOLS / "kueue",
        cache_root=cache_root("kueue", "DYNATRAIN_KUEUE_CACHE"),
        binaries={"kueue": f"{KUEUE_MODULE}/cmd/kueue"},
        env={"CGO_ENABLED": "0"},
        timeout=datetime.timedelta(
            seconds=float(os.environ.get("DYNATRAIN_KUEUE_BUILD_TIMEOUT_S", 1800))),
    )


def ensure_kueue(toolchain: GoModule | None = None, *,
                 log: Callable[[str], None] | None = None) -> Path:
    """Path of the ``kueue`` manager binary for the current pin, built first if not cached."""
    return ensure_built(toolchain or default_toolchain(), log=log).path("kueue")


def source_dir(toolchain: GoModule | None = None) -> Path:
    """Kueue's module source (its ``config/`` manifests), from the Go module cache; downloaded
    there first when it is not (the binary was cached by an earlier build, then Go's module
    cache was cleaned or is another user's)."""
    toolchain = toolchain or default_toolchain()

    def listed() -> str:
        return run_go(toolchain, "list", "-m", "-f", "{{.Dir}}", KUEUE_MODULE,
                      timeout=300).strip()

    out = listed()
    if not out:
        run_go(toolchain, "mod", "download", KUEUE_MODULE, timeout=900)
        out = listed()
    if not out or not (Path(out) / "config" / "components").is_dir():
        raise DevClusterError(f"`go list -m {KUEUE_MODULE}` in tools/kueue gave {out!r}, "
                              "which has no config/components (a download of it was tried)")
    return Path(out)


def crds(src: Path) -> list[dict]:
    """Kueue's CustomResourceDefinitions, as its release ships them (``crd/bases``)."""
    docs = []
    for path in sorted((src / "config" / "components" / "crd" / "bases").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    if not docs:
        raise DevClusterError(f"no CRDs under {src}/config/components/crd/bases")
    return docs


def webhook_configurations(src: Path, *, url: str, ca_pem: bytes) -> list[dict]:
    """Kueue's admission webhooks for its own kinds and for pods, calling ``url`` (the
    manager's webhook server) and trusting ``ca_pem``; the pod webhooks skip the system
    namespaces."""
    text = (src / "config" / "components" / "webhook" / "manifests.yaml").read_text()
    bundle = base64.b64encode(ca_pem).decode()
    skip = {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                                  "values": ["kube-system", NAMESPACE]}]}
    out = []
    for doc in yaml.safe_load_all(text):
        if not doc:
            continue
        kept = []
        for hook in doc.get("webhooks") or []:
            groups = {g for rule in hook.get("rules") or [] for g in rule.get("apiGroups", [])}
            resources = {r for rule in hook.get("rules") or [] for r in rule.get("resources", [])}
            if not (groups <= {_KUEUE_GROUP} or (groups == {""} and "pods" in resources)):
                continue            # another framework's (jobs, Ray, ...): not enabled here
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"{url}{path}", "caBundle": bundle}
            if groups == {""}:
                hook["namespaceSelector"] = skip
                # Only pods with a queue name reach the manager: with
                # manageJobsWithoutQueueName false it leaves the others alone anyway, and so
                # a manager that is down cannot refuse every other pod of the cluster.
                hook["objectSelector"] = {"matchExpressions": [
                    {"key": QUEUE_LABEL, "operator": "Exists"}]}
            kept.append(hook)
        doc["metadata"]["name"] = f"kueue-{doc['metadata']['name']}"
        doc["webhooks"] = kept
        out.append(doc)
    return out


def configuration(*, webhook_port: int, cert_dir: Path, metrics_port: int,
                  health_port: int) -> dict:
    """The manager's ``Configuration`` (config.kueue.x-k8s.io/v1beta2); see the module."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": NAMESPACE,
        "manageJobsWithoutQueueName": False,
        "internalCertManagement": {"enable": False},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "leaderElection": {"leaderElect": False},
        "integrations": {"frameworks": ["pod"]},
        "featureGates": {"VisibilityOnDemand": False},
    }


def check_can_run() -> None:
    """``--kueue`` needs root: the manager runs in a private mount namespace (see module)."""
    if os.geteuid() != 0:
        raise DevClusterError(
            "Kueue's manager reads its metrics certificate from /etc/kueue/metrics/certs; the "
            "dev cluster gives it that path in a private mount namespace (unshare --mount, "
            "an overlay on /etc), which needs root. Run as root, or without --kueue")
    for tool in ("unshare", "mount"):
        if shutil.which(tool) is None:
            raise DevClusterError(f"--kueue needs `{tool}` (util-linux) on PATH")


def manager_argv(binary: Path, *, config: Path, kubeconfig: Path, etc_upper: Path,
                 etc_work: Path) -> list[str]:
    """The manager in a private mount namespace whose /etc is an overlay (see the module)."""
    script = ('mount -t overlay overlay -o "lowerdir=/etc,upperdir=$1,workdir=$2" /etc '
              '&& shift 2 && exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh",
            str(etc_upper), str(etc_work), str(binary), f"--config={config}",
            f"--kubeconfig={kubeconfig}", "--zap-log-level=info"]


def wait_ready(manager: Component, health_port: int, *, timeout: datetime.timedelta) -> None:
    """Until the manager's readiness endpoint answers 200 (its webhooks serve then); a manager
    that exits meanwhile is reported at once, with its log."""
    def ready() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/readyz", timeout=3) as r:
            return r.status == 200

    wait_until("Kueue's manager to be ready", ready, timeout=timeout, component=manager)


def kubectl_apply(kubectl: Path, kubeconfig: Path, docs: list[dict], work: Path,
                  name: str) -> None:
    """``docs`` applied server-side (written to ``work/NAME.yaml``, kept with the logs)."""
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    check_output([str(kubectl), f"--kubeconfig={kubeconfig}", "apply", "--server-side",
                  "--force-conflicts", "-f", str(path)], what=f"applying Kueue's {name}",
                 timeout=120)


def install(*, kubectl: Path, kubeconfig: Path, core, ca: CertPair, work: Path,
            timeout: datetime.timedelta, start: Callable[[str, list[str]], Component],
            log: Callable[[str], None]) -> None:
    """Kueue into a running dev cluster: its CRDs, its manager (webhooks and controllers,
    started with ``start`` as one of the cluster's components) and then its webhook
    configurations, once the manager serves them."""
    check_can_run()
    binary = ensure_kueue(log=log)
    src = source_dir()
    docs = crds(src)
    kubectl_apply(kubectl, kubeconfig, docs, work, "kueue-crds")
    # The manager's caches need the CRDs served.
    wait_established(core.api_client, [d["metadata"]["name"] for d in docs])
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
    home = work / "kueue"
    certs = home / "certs"
    write_serving_pair(ca, certs, name="kueue-webhook")
    upper, scratch = home / "etc-upper", home / "etc-work"
    write_serving_pair(ca, upper / METRICS_CERT_DIR.removeprefix("/etc/"), name="kueue-metrics")
    scratch.mkdir(parents=True, exist_ok=True)
    webhook_port, health_port = free_port(), free_port()
    config = home / "config.yaml"
    config.write_text(yaml.safe_dump(configuration(
        webhook_port=webhook_port, cert_dir=certs, metrics_port=free_port(),
        health_port=health_port)))
    manager = start("kueue", manager_argv(binary, config=config, kubeconfig=kubeconfig,
                                          etc_upper=upper, etc_work=scratch))
    wait_ready(manager, health_port, timeout=timeout)
    kubectl_apply(kubectl, kubeconfig, webhook_configurations(
        src, url=f"https://127.0.0.1:{webhook_port}", ca_pem=ca.cert.read_bytes()),
        work, "kueue-webhooks")
    log(f"[devcluster] kueue: manager up (webhooks on 127.0.0.1:{webhook_port})")
