"""The DynaTrainJob CRD against a real kube-apiserver: admission, columns, status and scale.

Every invalid manifest here is the valid :func:`base_job` with exactly one thing changed, and
must be refused by the apiserver at admission (HTTP 422, reason Invalid) with an error that names
the field to fix, both in the structured causes (``details.causes[].field``, what ``kubectl``
and client libraries show per field) and in the message text. The valid manifests (the base,
its variants and the examples) must be accepted by the apiserver *and* by the Python parser
that ``dynatrain run`` and the operator use (``job_from_manifest``), so the two never disagree
about what a valid job is; for the invalid manifests whose fields the parser checks, it must
refuse them too.
"""

from __future__ import annotations

import copy
import datetime
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from dynatrain.controller.job import JobError, job_from_manifest
from dynatrain.devcluster.processes import wait_until

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "dynatrainjob.yaml"
EXAMPLES = (REPO / "examples" / "quickstart.yaml", REPO / "examples" / "dynatrainjob.yaml",
            REPO / "examples" / "dev-job.yaml", REPO / "examples" / "dev-job-containers.yaml")
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
    Case("limits-with-fixed", setting("spec.parallelism.mode", "fixed"),
         "spec.parallelism.limits", False),
    Case("limits-maxtp-zero", setting("spec.parallelism.limits.maxTP", 0),
         "spec.parallelism.limits.maxTP", True),
    Case("limits-zero-stage-2", setting("spec.parallelism.limits.zeroStages", [1, 2]),
         "spec.parallelism.limits.zeroStages[1]", True),
    Case("batch-zero", setting("spec.globalBatchSize", 0), "spec.globalBatchSize", True),
    Case("batch-not-multiple", setting("spec.globalBatchSize", 63), "spec.globalBatchSize",
         False),
    Case("lr-zero", setting("spec.training.learningRate", 0), "spec.training.learningRate",
         True),
    Case("seqlen-negative", setting("spec.training.seqLen", -1), "spec.training.seqLen", True),
    Case("port-too-big", setting("spec.agent.port", 70000), "spec.agent.port", True),
    Case("secret-bad-name", setting("spec.agent.authSecret", "Agent_Token"),
         "spec.agent.authSecret", False),
    Case("policy-unknown", setting("spec.preemptionPolicy", "Evict"), "spec.preemptionPolicy",
         True),
    Case("restart-without-checkpoint", lambda d: (d["spec"].pop("checkpoint"), d["spec"].update(
        preemptionPolicy="Restart")), "spec.checkpoint", False),
    Case("checkpoint-relative-path", setting("spec.checkpoint.path", "checkpoints"),
         "spec.checkpoint.path", False),
    Case("checkpoint-no-claim", dropping("spec.checkpoint.claimName"),
         "spec.checkpoint.claimName", False),
    Case("checkpoint-interval-zero", setting("spec.checkpoint.intervalSteps", 0),
         "spec.checkpoint.intervalSteps", True),
    Case("checkpoint-keep-zero", setting("spec.checkpoint.keep", 0), "spec.checkpoint.keep",
         True),
    Case("recovery-mirror-not-bool", setting("spec.recovery", {"mirror": "yes"}),
         "spec.recovery.mirror", True),
    Case("name-not-dns-label", setting("metadata.name", "7b.job"), "metadata.name", False),
]

# Variants of the base that are valid, each for a reason a too-strict rule could miss.
VALID = {
    "base": lambda d: None,
    "fixed-layout": lambda d: d["spec"].__setitem__(
        "parallelism", {"mode": "fixed",
                        "layout": "dp=2,tp=2,pp=2,zero=1,stages=12+12,order=tp-dp-pp"}),
    "minimal": lambda d: d.__setitem__("spec", {
        "image": "dynatrain:0.1.0", "model": {"preset": "gpt-tiny"}, "resources": {"gpus": 0},
        "elastic": {"minWorkers": 1, "maxWorkers": 1}}),
    "inline-model": setting("spec.model", {"spec": {
        "name": "small", "arch": "gpt", "vocab_size": 1024, "hidden_size": 128,
        "num_layers": 2, "num_heads": 4, "ffn_hidden_size": 512, "max_seq_len": 1024}}),
    "restart-with-checkpoint": setting("spec.preemptionPolicy", "Restart"),
    "integer-quantities": lambda d: d["spec"]["resources"].update(cpu=8, memory=68719476736),
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

@pytest.fixture(scope="module")
def crd(devcluster, kubectl):
    """The CRD applied (server-side, so other modules' copies of it are simply updated)."""
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    api = client.ApiextensionsV1Api(devcluster.api_client())

    def established():
        obj = api.read_custom_resource_definition(name=CRD_NAME)
        return any(c.type == "Established" and c.status == "True"
                   for c in (obj.status.conditions or []))
    wait_until(f"CRD {CRD_NAME} Established", established, timeout=datetime.timedelta(seconds=30))
    return api.read_custom_resource_definition(name=CRD_NAME)


@pytest.fixture
def custom(devcluster, crd):
    return client.CustomObjectsApi(devcluster.api_client())


def _create(custom, namespace: str, doc: dict) -> dict:
    return custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)


def _invalid(err: ApiException) -> tuple[str, list[str]]:
    """(message, cause fields) of a 422 Invalid answer."""
    assert err.status == 422, f"expected 422 Invalid, got {err.status}: {err.body}"
    body = json.loads(err.body)
    assert body["reason"] == "Invalid", body
    return body["message"], [c.get("field", "") for c in body["details"].get("causes", [])]


def test_crd_is_structural_and_established(crd):
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
    assert created["spec"].get("preemptionPolicy", "Switch") in ("Switch", "Restart")
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


def test_model_and_global_batch_are_immutable(custom, namespace):
    _create(custom, namespace, base_job("frozen"))

    def patch(spec: dict):
        return custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "frozen", {"spec": spec},
            _content_type="application/merge-patch+json")

    for spec, field in (({"model": {"preset": "llama-7b"}}, "spec.model"),
                        ({"globalBatchSize": 128}, "spec.globalBatchSize")):
        with pytest.raises(ApiException) as err:
            patch(spec)
        message, fields = _invalid(err.value)
        assert field in fields and "immutable" in message, message
    # Everything elastic stays editable.
    patched = patch({"elastic": {"maxWorkers": 16}, "preemptionPolicy": "Ignore"})
    assert patched["spec"]["elastic"]["maxWorkers"] == 16


def _table(text: str) -> list[dict[str, str]]:
    """kubectl's table output as rows of {column: value}; columns are two or more spaces apart,
    which keeps a header like "LAST SWITCH" and a value like "preemption 0.41s" whole."""
    lines = text.rstrip("\n").splitlines()
    header = lines[0]
    starts = [m.start() for m in re.finditer(r"(?:^|(?<=\s\s))\S", header)]
    names = [header[s:e].strip() for s, e in zip(starts, starts[1:] + [None])]
    return [{n: line[s:e].strip() for n, s, e in zip(names, starts, starts[1:] + [None])}
            for line in lines[1:]]


def test_kubectl_columns_show_status(custom, namespace, kubectl):
    _create(custom, namespace, base_job("gpt"))
    out = kubectl("get", "dynatrainjobs", "-n", namespace).stdout
    assert re.split(r"\s{2,}", out.splitlines()[0].strip()) == [
        "NAME", "PHASE", "LAYOUT", "WORKERS", "LAST SWITCH", "AGE"]
    (row,) = _table(out)
    assert row["NAME"] == "gpt" and row["PHASE"] == row["LAYOUT"] == row["LAST SWITCH"] == ""

    # Status is a subresource: only its endpoint writes it, and its schema is enforced too.
    status = {
        "phase": "Running", "layout": "dp=4,tp=1,pp=1", "workers": 4, "gpus": 4,
        "selector": "dynatrain.io/job=gpt", "generation": 3, "step": 1200,
        "observedGeneration": 1,
        "lastSwitch": {"from": "dp=2,tp=1,pp=1", "to": "dp=4,tp=1,pp=1", "reason": "scale-up",
                       "result": "success", "pauseSeconds": 0.41, "bytes": 2_800_000_000,
                       "step": 1100, "time": "2026-01-02T03:04:05Z",
                       "summary": "scale-up 0.41s"},
        "conditions": [{"type": "Ready", "status": "True", "reason": "Training",
                        "lastTransitionTime": "2026-01-02T03:04:05Z"}],
    }
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "gpt", {"status": status},
        _content_type="application/merge-patch+json")
    stored = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gpt")
    assert stored["status"]["lastSwitch"] == status["lastSwitch"]
    (row,) = _table(kubectl("get", "dynatrainjobs", "-n", namespace).stdout)
    assert {k: row[k] for k in ("NAME", "PHASE", "LAYOUT", "WORKERS", "LAST SWITCH")} == {
        "NAME": "gpt", "PHASE": "Running", "LAYOUT": "dp=4,tp=1,pp=1", "WORKERS": "4",
        "LAST SWITCH": "scale-up 0.41s"}
    assert row["AGE"]
    (wide,) = _table(kubectl("get", "dtj", "gpt", "-n", namespace, "-o", "wide").stdout)
    assert (wide["GENERATION"], wide["PAUSE"]) == ("3", "0.41")
    assert wide["SWITCHED"]  # a relative age, e.g. "300d"

    with pytest.raises(ApiException) as err:
        custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, "gpt", {"status": {"phase": "Exploded"}},
            _content_type="application/merge-patch+json")
    _, fields = _invalid(err.value)
    assert "status.phase" in fields


def test_kubectl_scale_sets_desired_workers(custom, namespace, kubectl):
    _create(custom, namespace, base_job("gpt"))
    kubectl("scale", "dtj/gpt", "--replicas=3", "-n", namespace)
    obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gpt")
    assert obj["spec"]["elastic"]["workers"] == 3
    # The scale subresource goes through the same validation: beyond maxWorkers is refused.
    refused = kubectl("scale", "dtj/gpt", "--replicas=20", "-n", namespace, check=False)
    assert refused.returncode != 0
    assert "spec.elastic.workers" in refused.stderr, refused.stderr
    obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gpt")
    assert obj["spec"]["elastic"]["workers"] == 3


# -- the Python parser agrees ------------------------------------------------------------

@pytest.mark.parametrize("key", list(valid_manifests()))
def test_parser_accepts_every_valid_manifest(key):
    doc = copy.deepcopy(valid_manifests()[key])
    job = job_from_manifest(doc, source=key)
    assert job.name == doc["metadata"]["name"]
    assert job.min_workers == doc["spec"]["elastic"]["minWorkers"]


@pytest.mark.parametrize("case", [c for c in INVALID if c.parser_rejects], ids=lambda c: c.id)
def test_parser_rejects_what_it_checks(case):
    with pytest.raises(JobError):
        job_from_manifest(case.manifest(), source=case.id)


@pytest.mark.parametrize("case", [c for c in INVALID if not c.parser_rejects],
                         ids=lambda c: c.id)
def test_parser_ignores_cluster_only_fields(case):
    # These fields matter only on a cluster (quantities, Secret and claim names, checkpoint):
    # the apiserver is the one to refuse them (the parser checks the limits: the solver uses
    # them). Documented here so that a parser change
    # that starts checking one of them flips the flag above rather than going unnoticed.
    job_from_manifest(case.manifest(), source=case.id)
