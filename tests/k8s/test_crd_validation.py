"""The DynaTrainJob CRD against a real kube-apiserver: admission of new jobs.

Every invalid manifest here is the valid :func:`base_job` with exactly one thing changed, and
must be refused by the apiserver at admission (HTTP 422, reason Invalid) with an error that names
the field to fix, both in the structured causes (``details.causes[].field``, what ``kubectl``
and client libraries show per field) and in the message text. The valid manifests (the base,
its variants and the examples) must be accepted by the apiserver *and* by the Python parser
that ``dynatrain run`` and the operator use (``job_from_manifest``), so the two never disagree
about what a valid job is; for the invalid manifests whose fields the parser checks, it must
refuse them too, naming the same field.

What a job may change once it exists (its spec's updates, its status, kubectl's columns and
scale) is in test_crd_updates.py.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from dynatrain.spec.job import JobError, job_from_manifest

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "dynatrainjob.yaml"
EXAMPLES = (REPO / "examples" / "quickstart.yaml", REPO / "examples" / "dynatrainjob.yaml",
            REPO / "examples" / "dev-job.yaml", REPO / "examples" / "dev-job-containers.yaml",
            REPO / "examples" / "gpu-pool-job.yaml")
GROUP, VERSION, PLURAL = "dynatrain.io", "v1alpha1", "dynatrainjobs"
CRD_NAME = f"{PLURAL}.{GROUP}"

pytestmark = pytest.mark.k8s


# -- the manifests ------------------------------------------------------------------------

def base_job(name: str = "gpt") -> dict:
    """A valid job that uses every section of the spec, so each can be broken on its own."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "DynaTrainJob",
        "metadata": {"name": name},
        "spec": {
            "image": "registry.example.com/dynatrain:0.1.0",
            "command": ["dynatrain"],
            "args": ["worker"],
            "model": {"preset": "gpt-350m"},
            "resources": {"gpus": 1, "cpu": "8", "memory": "64Gi"},
            "elastic": {"minWorkers": 2, "maxWorkers": 8, "workers": 4},
            "parallelism": {"mode": "auto", "layout": "dp=2,tp=2",
                            "limits": {"maxTP": 4, "maxPP": 2, "maxEP": 1,
                                       "zeroStages": [0, 1]}},
            "globalBatchSize": 64,
            "training": {"steps": 1000, "seqLen": 1024, "microBatchSize": 2,
                         "learningRate": 3e-4, "adamEpsilon": 1e-8, "seed": 7,
                         "data": "synthetic"},
            "checkpoint": {"claimName": "gpt-ckpt", "path": "/checkpoints",
                           "intervalSteps": 500},
            "agent": {"port": 50051, "authSecret": "gpt-agent-token"},
            "preemptionPolicy": "Switch",
            # A tainted GPU pool chosen by its product label, a dataset claim, a token.
            "template": {
                "metadata": {"labels": {"team": "llm"}},
                "spec": {
                    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                     "effect": "NoSchedule"}],
                    "priorityClassName": "training",
                    "volumes": [{"name": "data",
                                 "persistentVolumeClaim": {"claimName": "corpus"}}],
                    "containers": [{
                        "name": "worker",
                        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                            "name": "hf-token", "key": "token"}}}],
                        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                        "resources": {"limits": {"rdma/ib": 1}}}]}},
        },
    }


def _walk(doc: dict, path: str) -> tuple[dict, str]:
    *parents, leaf = path.split(".")
    for key in parents:
        doc = doc.setdefault(key, {})
    return doc, leaf


def setting(path: str, value: Any) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        parent, leaf = _walk(doc, path)
        parent[leaf] = value
    return mutate


def dropping(path: str) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        parent, leaf = _walk(doc, path)
        del parent[leaf]
    return mutate


@dataclass(frozen=True)
class Case:
    id: str
    mutate: Callable[[dict], None]
    field: str
    """The field the apiserver must name (``details.causes[].field`` and the message)."""
    parser_rejects: bool
    """Whether ``job_from_manifest`` checks this too (it ignores cluster-only fields)."""

    def manifest(self, name: str = "bad") -> dict:
        doc = base_job(name)
        self.mutate(doc)
        return doc


# One mutation each; together they cover the schema (types, bounds, enums, patterns, required)
# and every CEL rule that can fire on create.
INVALID = [
    Case("min-above-max", setting("spec.elastic.minWorkers", 9), "spec.elastic.minWorkers", True),
    Case("workers-above-max", setting("spec.elastic.workers", 9), "spec.elastic.workers", True),
    Case("min-zero", setting("spec.elastic.minWorkers", 0), "spec.elastic.minWorkers", True),
    Case("max-missing", dropping("spec.elastic.maxWorkers"), "spec.elastic.maxWorkers", True),
    Case("model-missing", dropping("spec.model"), "spec.model", True),
    Case("model-both", setting("spec.model.spec", {"num_layers": 2}), "spec.model", True),
    Case("preset-bad-name", setting("spec.model.preset", "GPT 350M"), "spec.model.preset", True),
    Case("image-empty", setting("spec.image", ""), "spec.image", True),
    Case("gpus-negative", setting("spec.resources.gpus", -1), "spec.resources.gpus", True),
    Case("cpu-not-quantity", setting("spec.resources.cpu", "8 cores"), "spec.resources.cpu",
         False),
    Case("memory-not-quantity", setting("spec.resources.memory", "lots"),
         "spec.resources.memory", False),
    Case("mode-unknown", setting("spec.parallelism.mode", "sometimes"), "spec.parallelism.mode",
         True),
    Case("fixed-without-layout", lambda d: d["spec"].__setitem__(
        "parallelism", {"mode": "fixed"}), "spec.parallelism.layout", True),
    Case("layout-old-syntax", setting("spec.parallelism.layout", "dp4-tp2"),
         "spec.parallelism.layout", True),
    Case("layout-zero-2", setting("spec.parallelism.layout", "dp=2,zero=2"),
         "spec.parallelism.layout", True),
    Case("layout-key-twice", setting("spec.parallelism.layout", "dp=2,tp=2,dp=4"),
         "spec.parallelism.layout", True),
    Case("layout-stages-vs-pp", setting("spec.parallelism.layout", "dp=2,pp=2,stages=8+8+8"),
         "spec.parallelism.layout", True),
    Case("layout-schedule-unknown", setting("spec.parallelism.layout", "dp=2,pp=2,schedule=zb"),
         "spec.parallelism.layout", True),
    Case("layout-schedule-twice",
         setting("spec.parallelism.layout", "dp=2,pp=2,schedule=1f1b,schedule=gpipe"),
         "spec.parallelism.layout", True),
    Case("limits-with-fixed", setting("spec.parallelism.mode", "fixed"),
         "spec.parallelism.limits", False),
    Case("limits-maxtp-zero", setting("spec.parallelism.limits.maxTP", 0),
         "spec.parallelism.limits.maxTP", True),
    Case("limits-zero-stage-2", setting("spec.parallelism.limits.zeroStages", [1, 2]),
         "spec.parallelism.limits.zeroStages[1]", True),
    Case("min-efficiency-one", setting("spec.elastic.minEfficiency", 1.0),
         "spec.elastic.minEfficiency", True),
    Case("rebalance-threshold-one", setting("spec.parallelism.rebalance.threshold", 1.0),
         "spec.parallelism.rebalance.threshold", True),
    Case("rebalance-payback-zero", setting("spec.parallelism.rebalance.paybackSteps", 0),
         "spec.parallelism.rebalance.paybackSteps", True),
    Case("rebalance-shares-not-boolean", setting("spec.parallelism.rebalance.shares", "no"),
         "spec.parallelism.rebalance.shares", True),
    Case("batch-zero", setting("spec.globalBatchSize", 0), "spec.globalBatchSize", True),
    Case("batch-not-multiple", setting("spec.globalBatchSize", 63), "spec.globalBatchSize",
         True),
    # globalBatchSize defaults to 8: a micro-batch of 3 cannot divide it, set or not.
    Case("micro-batch-vs-default-batch", lambda d: (d["spec"].pop("globalBatchSize"),
         d["spec"]["training"].update(microBatchSize=3)), "spec.globalBatchSize", True),
    # A fixed layout is the only one the job runs: it must fit maxWorkers (8) and split the
    # batch (64 = dp * microBatchSize (2) * micro-batches per rank).
    Case("fixed-layout-above-max", lambda d: d["spec"].__setitem__(
        "parallelism", {"mode": "fixed", "layout": "dp=4,tp=2,pp=2"}),
        "spec.parallelism.layout", True),
    Case("fixed-layout-above-max-by-dp", lambda d: d["spec"].__setitem__(
        "parallelism", {"mode": "fixed", "layout": "dp=16"}), "spec.parallelism.layout", True),
    Case("fixed-layout-dp-not-dividing-batch", lambda d: d["spec"].__setitem__(
        "parallelism", {"mode": "fixed", "layout": "dp=3,tp=2"}),
        "spec.parallelism.layout", True),
    # 10+10+10 micro-batches of 2 are 60 sequences, not the batch of 64.
    Case("fixed-layout-shares-not-the-batch", lambda d: d["spec"].__setitem__(
        "parallelism", {"mode": "fixed", "layout": "dp=3,tp=2,shares=10+10+11"}),
        "spec.parallelism.layout", True),
    Case("layout-shares-vs-dp", setting("spec.parallelism.layout", "dp=2,shares=8+8+16"),
         "spec.parallelism.layout", True),
    Case("layout-shares-with-ep", setting("spec.parallelism.layout", "dp=2,ep=2,shares=8+24"),
         "spec.parallelism.layout", True),
    Case("lr-zero", setting("spec.training.learningRate", 0), "spec.training.learningRate",
         True),
    Case("seqlen-negative", setting("spec.training.seqLen", -1), "spec.training.seqLen", True),
    Case("port-too-big", setting("spec.agent.port", 70000), "spec.agent.port", True),
    # The worker runs as UID 10001 (no privileged ports) and serves metrics on 9400.
    Case("port-privileged", setting("spec.agent.port", 80), "spec.agent.port", True),
    Case("port-below-1024", setting("spec.agent.port", 1023), "spec.agent.port", True),
    Case("port-is-metrics-port", setting("spec.agent.port", 9400), "spec.agent.port", True),
    # ... and its plaintext health port (the kubelet's probe) on 9401.
    Case("port-is-health-port", setting("spec.agent.port", 9401), "spec.agent.port", True),
    Case("issuer-kind-unknown", setting("spec.agent.issuerRef", {"name": "ca",
                                                                 "kind": "Vault"}),
         "spec.agent.issuerRef.kind", True),
    Case("issuer-no-name", setting("spec.agent.issuerRef", {"kind": "ClusterIssuer"}),
         "spec.agent.issuerRef.name", True),
    Case("secret-bad-name", setting("spec.agent.authSecret", "Agent_Token"),
         "spec.agent.authSecret", False),
    Case("policy-unknown", setting("spec.preemptionPolicy", "Evict"), "spec.preemptionPolicy",
         True),
    Case("policy-restart", setting("spec.preemptionPolicy", "Restart"),
         "spec.preemptionPolicy", True),     # never carried out: no longer accepted
    Case("checkpoint-relative-path", setting("spec.checkpoint.path", "checkpoints"),
         "spec.checkpoint.path", True),
    # The claim must not be mounted over / or a system directory, nor over the operator's own
    # mounts (the job file in /etc/dynatrain, the agent token in /var/run/secrets).
    Case("checkpoint-path-root", setting("spec.checkpoint.path", "/"), "spec.checkpoint.path",
         True),
    Case("checkpoint-path-proc", setting("spec.checkpoint.path", "/proc"),
         "spec.checkpoint.path", True),
    Case("checkpoint-path-dev-trailing-slash", setting("spec.checkpoint.path", "/dev/"),
         "spec.checkpoint.path", True),
    Case("checkpoint-path-under-usr", setting("spec.checkpoint.path", "/usr/local/ckpt"),
         "spec.checkpoint.path", True),
    Case("checkpoint-path-var-run", setting("spec.checkpoint.path", "/var/run"),
         "spec.checkpoint.path", True),
    Case("checkpoint-path-job-file", setting("spec.checkpoint.path", "/etc/dynatrain"),
         "spec.checkpoint.path", True),
    Case("checkpoint-path-token", setting("spec.checkpoint.path", "/var/run/secrets/dynatrain"),
         "spec.checkpoint.path", True),
    Case("checkpoint-path-backstep", setting("spec.checkpoint.path", "/checkpoints/../etc"),
         "spec.checkpoint.path", True),
    Case("checkpoint-path-empty-segment", setting("spec.checkpoint.path", "/checkpoints//a"),
         "spec.checkpoint.path", True),
    Case("checkpoint-no-claim", dropping("spec.checkpoint.claimName"),
         "spec.checkpoint.claimName", False),
    Case("checkpoint-interval-zero", setting("spec.checkpoint.intervalSteps", 0),
         "spec.checkpoint.intervalSteps", True),
    Case("checkpoint-keep-zero", setting("spec.checkpoint.keep", 0), "spec.checkpoint.keep",
         True),
    Case("recovery-mirror-not-bool", setting("spec.recovery", {"mirror": "yes"}),
         "spec.recovery.mirror", True),
    Case("timeouts-out-of-order", setting("spec.recovery", {"timeouts": {
         "watchdogSeconds": 90}}), "spec.recovery.timeouts", True),
    Case("timeouts-negative", setting("spec.recovery", {"timeouts": {"statusSeconds": -1}}),
         "spec.recovery.timeouts.statusSeconds", True),
    Case("name-not-dns-label", setting("metadata.name", "7b.job"), "metadata.name", False),
    Case("model-hf-and-preset", setting("spec.model.hf", "/checkpoints/llama"), "spec.model",
         True),
    Case("hf-config-without-hf", setting("spec.model.hfConfig", {"architectures": []}),
         "spec.model", False),
    Case("precision-unknown", setting("spec.training.precision", "fp8"),
         "spec.training.precision", True),
    Case("grad-clip-negative", setting("spec.training.gradClip", -1),
         "spec.training.gradClip", True),
    Case("lr-decay-unknown", setting("spec.training.lrSchedule", {"decay": "step"}),
         "spec.training.lrSchedule.decay", True),
    Case("output-hf-empty", setting("spec.output", {"hf": ""}), "spec.output.hf", True),
    Case("output-tensorboard-empty", setting("spec.output", {"tensorboard": ""}),
         "spec.output.tensorboard", True),
    Case("output-log-every-zero", setting("spec.output", {"logEverySteps": 0}),
         "spec.output.logEverySteps", True),
    # spec.template: what the operator owns is refused, saying why (cluster-only fields).
    Case("template-security-context", setting("spec.template.spec.securityContext",
                                              {"runAsUser": 0}),
         "spec.template.spec.securityContext", False),
    Case("template-host-network", setting("spec.template.spec.hostNetwork", True),
         "spec.template.spec", False),
    Case("template-restart-policy", setting("spec.template.spec.restartPolicy", "Always"),
         "spec.template.spec.restartPolicy", False),
    Case("template-owned-label", setting("spec.template.metadata.labels",
                                         {"dynatrain.io/job": "other"}),
         "spec.template.metadata.labels", False),
    Case("template-volume-name", setting("spec.template.spec.volumes",
                                         [{"name": "token", "emptyDir": {}}]),
         "spec.template.spec.volumes[0]", False),
    Case("template-container-name", setting("spec.template.spec.containers",
                                            [{"name": "sidecar"}]),
         "spec.template.spec.containers[0].name", False),
    Case("template-container-command", lambda d: d["spec"]["template"]["spec"]["containers"][
        0].__setitem__("command", ["sh"]), "spec.template.spec.containers[0]", False),
    Case("template-container-ports", lambda d: d["spec"]["template"]["spec"]["containers"][
        0].__setitem__("ports", [{"containerPort": 80}]), "spec.template.spec.containers[0]",
         False),
    Case("template-container-security", lambda d: d["spec"]["template"]["spec"]["containers"][
        0].__setitem__("securityContext", {"privileged": True}),
         "spec.template.spec.containers[0]", False),
    Case("template-env-owned", lambda d: d["spec"]["template"]["spec"]["containers"][
        0]["env"].append({"name": "POD_IP", "value": "10.0.0.1"}),
         "spec.template.spec.containers[0].env[1]", False),
    Case("template-mount-owned", lambda d: d["spec"]["template"]["spec"]["containers"][
        0]["volumeMounts"].append({"name": "data", "mountPath": "/var/run/secrets/dynatrain"}),
         "spec.template.spec.containers[0].volumeMounts[1]", False),
    Case("template-mount-on-checkpoint", lambda d: d["spec"]["template"]["spec"]["containers"][
        0]["volumeMounts"].append({"name": "data", "mountPath": "/checkpoints"}),
         "spec.template.spec.containers", False),
    Case("template-resources-gpu", lambda d: d["spec"]["template"]["spec"]["containers"][
        0]["resources"]["limits"].__setitem__("nvidia.com/gpu", 8),
         "spec.template.spec.containers[0].resources", False),
    Case("hardware-unknown", setting("spec.hardware", {"profile": "t4"}),
         "spec.hardware.profile", False),
    Case("ttl-negative", setting("spec.ttlSecondsAfterFinished", -1),
         "spec.ttlSecondsAfterFinished", False),
    Case("suspend-not-boolean", setting("spec.suspend", "yes"), "spec.suspend", True),
    Case("queue-name-not-a-label-value", setting("spec.queueName", "team a!"),
         "spec.queueName", False),
    Case("shm-size-not-quantity", setting("spec.resources.shmSize", "big"),
         "spec.resources.shmSize", False),
]

# A Hugging Face model as a cluster job names it: the directory on the workers' volume, and
# its config inline for the operator (what `dynatrain hf-config` prints).
HF_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1001,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "dtype": "bfloat16"}

# Variants of the base that are valid, each for a reason a too-strict rule could miss.
VALID = {
    "base": lambda d: None,
    "fixed-layout": lambda d: d["spec"].__setitem__(
        "parallelism", {"mode": "fixed",
                        "layout": "dp=2,tp=2,pp=2,zero=1,stages=12+12,order=tp-dp-pp"}),
    "fixed-layout-1f1b": lambda d: d["spec"].__setitem__(
        "parallelism", {"mode": "fixed", "layout": "dp=2,tp=2,pp=2,schedule=1f1b"}),
    # Uneven shares: 10+11+11 micro-batches of 2 are the batch of 64, which dp=3 alone is not.
    "fixed-layout-shares": lambda d: d["spec"].__setitem__(
        "parallelism", {"mode": "fixed", "layout": "dp=3,tp=2,shares=10+11+11"}),
    "minimal": lambda d: d.__setitem__("spec", {
        "image": "dynatrain:0.1.0", "model": {"preset": "gpt-tiny"}, "resources": {"gpus": 0},
        "elastic": {"minWorkers": 1, "maxWorkers": 1}}),
    "inline-model": setting("spec.model", {"spec": {
        "name": "small", "arch": "gpt", "vocab_size": 1024, "hidden_size": 128,
        "num_layers": 2, "num_heads": 4, "ffn_hidden_size": 512, "max_seq_len": 1024}}),
    "policy-ignore": setting("spec.preemptionPolicy", "Ignore"),
    "integer-quantities": lambda d: d["spec"]["resources"].update(cpu=8, memory=68719476736),
    # EP ranks are carved out of DP: dp=4,tp=2,ep=4 is 8 workers, not 32.
    "fixed-moe-ep-within-max": lambda d: (
        d["spec"].update(model={"preset": "moe-tiny"},
                         parallelism={"mode": "fixed", "layout": "dp=4,tp=2,ep=4"}),
        d["spec"]["training"].update(seqLen=128)),
    # minWorkers may exceed what a fixed layout needs (world 4 < minWorkers 6).
    "fixed-layout-below-min": lambda d: d["spec"].update(
        elastic={"minWorkers": 6, "maxWorkers": 8},
        parallelism={"mode": "fixed", "layout": "dp=2,tp=2"}),
    # In auto mode the layout is not used (the solver picks), so it need not fit maxWorkers.
    "auto-layout-above-max": setting("spec.parallelism.layout", "dp=4,tp=4"),
    # The default batch (8) with a micro-batch that divides it.
    "default-batch-micro-batch-4": lambda d: (d["spec"].pop("globalBatchSize"),
                                              d["spec"]["training"].update(microBatchSize=4)),
    # Lowest allowed agent port; paths that only look like system directories, a trailing /.
    "agent-port-1024": setting("spec.agent.port", 1024),
    "checkpoint-path-lookalike": setting("spec.checkpoint.path", "/etcetera/proc/"),
    "checkpoint-path-var-runner": setting("spec.checkpoint.path", "/var/runner"),
    # A Hugging Face model with its config inline, trained on text with a schedule,
    # clipping and bf16, and written back out when done.
    "hf-model-real-workload": lambda d: (
        d["spec"].update(model={"hf": "/checkpoints/models/llama", "hfConfig": HF_LLAMA_CONFIG},
                         output={"hf": "/checkpoints/out/llama-ft"}),
        d["spec"]["training"].update(
            seqLen=128, precision="bf16", gradClip=1.0,
            lrSchedule={"warmupSteps": 100, "decay": "cosine", "minLearningRate": 3e-5},
            data={"path": "/checkpoints/data/corpus.jsonl", "dtype": "uint32",
                  "tokenizer": "/checkpoints/models/llama"})),
    # A shorter watchdog, the rest of the hierarchy from the defaults.
    "timeouts-watchdog-only": setting("spec.recovery", {"timeouts": {"watchdogSeconds": 5}}),
}


def valid_manifests() -> dict[str, dict]:
    docs = {}
    for key, mutate in VALID.items():
        doc = base_job(key)
        mutate(doc)
        docs[key] = doc
    for path in EXAMPLES:
        docs[f"examples/{path.name}"] = yaml.safe_load(path.read_text())
    return docs


# -- the apiserver side --------------------------------------------------------------------

def _create(custom, namespace: str, doc: dict) -> dict:
    return custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)


def _invalid(err: ApiException) -> tuple[str, list[str]]:
    """(message, cause fields) of a 422 Invalid answer."""
    assert err.status == 422, f"expected 422 Invalid, got {err.status}: {err.body}"
    body = json.loads(err.body)
    assert body["reason"] == "Invalid", body
    return body["message"], [c.get("field", "") for c in body["details"].get("causes", [])]


def test_crd_is_structural_and_established(dynatrain_crd):
    crd = dynatrain_crd
    # A CRD whose schema is not structural, or whose CEL rules exceed the cost budget, is
    # refused or flagged NonStructuralSchema; Established means the apiserver serves it.
    conditions = {c.type: c.status for c in crd.status.conditions}
    assert conditions.get("Established") == "True"
    assert "NonStructuralSchema" not in conditions
    assert crd.spec.versions[0].subresources.scale.spec_replicas_path == ".spec.elastic.workers"


def test_the_invalid_cases_are_distinct_single_mutations():
    assert len(INVALID) >= 15
    assert len({c.id for c in INVALID}) == len(INVALID)
    manifests = [json.dumps(c.manifest(), sort_keys=True) for c in INVALID]
    assert len(set(manifests)) == len(manifests)
    assert json.dumps(base_job("bad"), sort_keys=True) not in manifests


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.id)
def test_invalid_manifest_is_rejected_naming_the_field(custom, namespace, case):
    with pytest.raises(ApiException) as err:
        _create(custom, namespace, case.manifest())
    message, fields = _invalid(err.value)
    assert case.field in message, f"{case.field!r} not named in: {message}"
    # Root-level rules (metadata.name) cannot point fieldPath into metadata: the apiserver
    # only accepts paths into the declared schema. Their message names the field instead.
    if not case.field.startswith("metadata."):
        assert case.field in fields, f"{case.field!r} not among the causes {fields}: {message}"
    # Nothing was stored.
    with pytest.raises(ApiException) as missing:
        custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                            case.manifest()["metadata"]["name"])
    assert missing.value.status == 404


@pytest.mark.parametrize("key", list(valid_manifests()))
def test_valid_manifest_is_accepted(custom, namespace, key):
    doc = valid_manifests()[key]
    created = _create(custom, namespace, doc)
    assert created["spec"]["image"] == doc["spec"]["image"]
    # Defaults filled in by the schema.
    assert created["spec"].get("preemptionPolicy", "Switch") in ("Switch", "Ignore")
    stored = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                 doc["metadata"]["name"])
    assert stored["metadata"]["uid"] == created["metadata"]["uid"]


def test_defaults_are_applied(custom, namespace):
    doc = valid_manifests()["minimal"]
    stored = _create(custom, namespace, doc)["spec"]
    assert stored["preemptionPolicy"] == "Switch"
    doc = base_job("defaults")
    del doc["spec"]["agent"]["port"], doc["spec"]["checkpoint"]["path"]
    del doc["spec"]["checkpoint"]["intervalSteps"], doc["spec"]["parallelism"]["mode"]
    stored = _create(custom, namespace, doc)["spec"]
    assert stored["agent"]["port"] == 50051
    assert stored["checkpoint"] == {"claimName": "gpt-ckpt", "path": "/checkpoints",
                                    "intervalSteps": 1000, "keep": 2}
    assert stored["parallelism"]["mode"] == "auto"
    del doc["spec"]["globalBatchSize"]
    doc["metadata"]["name"] = "defaults-batch"
    assert _create(custom, namespace, doc)["spec"]["globalBatchSize"] == 8


def test_every_reserved_checkpoint_directory_is_refused_by_both(custom, namespace):
    # Each directory of the list, itself, with a trailing slash and below it, is refused by
    # the apiserver and the parser alike; a name that only starts like one is accepted by both.
    from dynatrain.spec.job import OPERATOR_MOUNTS, SYSTEM_DIRS

    reserved = [*OPERATOR_MOUNTS, *SYSTEM_DIRS]
    for n, d in enumerate(["/", *reserved]):
        for path in {d, d.rstrip("/") + "/", d.rstrip("/") + "/sub/dir"} - {"/sub/dir"}:
            doc = base_job(f"ckpt-{n}")
            doc["spec"]["checkpoint"]["path"] = path
            with pytest.raises(ApiException) as err:
                _create(custom, namespace, doc)
            message, fields = _invalid(err.value)
            assert "spec.checkpoint.path" in fields and f'"{path}"' in message, message
            with pytest.raises(JobError, match="spec.checkpoint.path"):
                job_from_manifest(doc)
        if d != "/" and not any(d.startswith(r + "/") for r in reserved):
            doc = base_job(f"ckpt-{n}")
            doc["spec"]["checkpoint"]["path"] = d + "x"
            _create(custom, namespace, doc)
            job_from_manifest(doc)


# -- the Python parser agrees ------------------------------------------------------------

@pytest.mark.parametrize("key", list(valid_manifests()))
def test_parser_accepts_every_valid_manifest(key):
    doc = copy.deepcopy(valid_manifests()[key])
    job = job_from_manifest(doc, source=key)
    assert job.name == doc["metadata"]["name"]
    assert job.min_workers == doc["spec"]["elastic"]["minWorkers"]


@pytest.mark.parametrize("case", [c for c in INVALID if c.parser_rejects], ids=lambda c: c.id)
def test_parser_rejects_what_it_checks(case):
    with pytest.raises(JobError) as err:
        job_from_manifest(case.manifest(), source=case.id)
    # The same field as the apiserver names (a list item's index aside: the parser names the
    # list and its value).
    field = re.sub(r"\[\d+\]$", "", case.field)
    assert field in str(err.value), f"{field!r} not named in: {err.value}"


def test_reserved_ports_and_paths_match_the_operator():
    # The port and the mounts the CRD and the parser keep free are the worker pod's.
    from dynatrain.spec import job
    from dynatrain.operator import cluster

    assert job.WORKER_METRICS_PORT == cluster.METRICS_PORT
    assert job.WORKER_HEALTH_PORT == cluster.HEALTH_PORT
    for path in (cluster.JOB_FILE, cluster.TOKEN_FILE):
        assert any(path.startswith(m + "/") for m in job.OPERATOR_MOUNTS), path
    spec = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"][
        "openAPIV3Schema"]["properties"]["spec"]["properties"]
    path_rule = spec["checkpoint"]["properties"]["path"]["x-kubernetes-validations"][1]["rule"]
    # self != '/' && ![<the directories>].exists(s, self == s || self.startsWith(s + '/'))
    dirs = re.findall(r"'(/[^']*)'", path_rule)
    assert dirs == ["/", *job.OPERATOR_MOUNTS, *job.SYSTEM_DIRS, "/"], dirs
    port_rule = spec["agent"]["properties"]["port"]["x-kubernetes-validations"][0]["rule"]
    assert port_rule == (f"self >= {job.MIN_AGENT_PORT} && self != {cluster.METRICS_PORT} "
                         f"&& self != {cluster.HEALTH_PORT}")


@pytest.mark.parametrize("case", [c for c in INVALID if not c.parser_rejects],
                         ids=lambda c: c.id)
def test_parser_ignores_cluster_only_fields(case):
    # These fields matter only on a cluster (quantities, Secret and claim names, the checkpoint
    # claim, the job name): the apiserver is the one to refuse them (the parser checks the
    # limits, which the solver uses, and the checkpoint path). Documented here so that a parser
    # change that starts checking one of them flips the flag above rather than going unnoticed.
    job_from_manifest(case.manifest(), source=case.id)
