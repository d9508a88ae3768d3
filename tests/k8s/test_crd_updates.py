"""The DynaTrainJob CRD against a real kube-apiserver: what a job may change once it exists.

Updates: a running job may change only ``spec.elastic``, ``spec.parallelism`` and
``spec.preemptionPolicy`` (the operator applies them live), ``spec.suspend``,
``spec.queueName`` and ``spec.ttlSecondsAfterFinished`` (read once the job ends). Every other
spec field is immutable (CEL transition rules): changing, adding or removing it is refused with
a message that names it, while updates that leave the spec alone (status, finalizers,
annotations) always pass. The status subresource's schema is enforced and shown by kubectl's
columns; ``kubectl scale`` sets the desired workers through the same validation. Admission of
new jobs, and the manifests and helpers used here, are in test_crd_validation.py.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from test_crd_validation import (CRD_FILE, GROUP, HF_LLAMA_CONFIG, PLURAL, VERSION, _create,
                                 _invalid, base_job)

from dynatrain.devcluster.processes import wait_until
from dynatrain.spec.job import job_from_manifest

pytestmark = pytest.mark.k8s


# -- updates: what a running job may change ---------------------------------------------

def _patch(custom, namespace: str, name: str, body: dict) -> dict:
    return custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name, body,
        _content_type="application/merge-patch+json")


def _get(custom, namespace: str, name: str) -> dict:
    return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def running_job(name: str) -> dict:
    """The base job with every optional immutable field set (recovery too)."""
    doc = base_job(name)
    # Relative to spec.checkpoint.path, so it stays on the claim when an edit moves the mount.
    doc["spec"]["recovery"] = {"mirror": True, "resumeFrom": "old-run/step-00000100"}
    doc["spec"]["output"] = {"hf": "/checkpoints/out/gpt"}
    doc["spec"]["hardware"] = {"profile": "a100-40gb"}
    return doc


@dataclass(frozen=True)
class Edit:
    id: str
    field: str
    """The immutable spec field the edit touches (``spec.training``)."""
    patch: dict
    """A JSON merge patch of ``spec``, valid on a new job (so only immutability refuses it)."""
    created_without: bool = False
    """Create the job without the field, so that the patch adds it."""


# Every immutable field: changed (a nested value where it is an object), added where it is
# optional, removed where it is optional (a required field's removal is refused as Required).
IMMUTABLE = [
    Edit("image-change", "spec.image", {"image": "registry.example.com/dynatrain:0.2.0"}),
    Edit("command-change", "spec.command", {"command": ["python", "-m", "dynatrain"]}),
    Edit("command-add", "spec.command", {"command": ["dynatrain"]}, created_without=True),
    Edit("command-remove", "spec.command", {"command": None}),
    Edit("args-change", "spec.args", {"args": ["worker", "--verbose"]}),
    Edit("args-add", "spec.args", {"args": ["worker"]}, created_without=True),
    Edit("args-remove", "spec.args", {"args": None}),
    Edit("model-change", "spec.model", {"model": {"preset": "gpt-125m"}}),
    Edit("model-to-inline", "spec.model", {"model": {"preset": None, "spec": {
        "name": "small", "arch": "gpt", "vocab_size": 1024, "hidden_size": 128,
        "num_layers": 2, "num_heads": 4, "ffn_hidden_size": 512, "max_seq_len": 1024}}}),
    Edit("resources-gpus", "spec.resources", {"resources": {"gpus": 2}}),
    Edit("resources-memory", "spec.resources", {"resources": {"memory": "128Gi"}}),
    Edit("resources-cpu-remove", "spec.resources", {"resources": {"cpu": None}}),
    Edit("batch-change", "spec.globalBatchSize", {"globalBatchSize": 128}),
    # Created without it, the job has the default (8); setting it later is an edit.
    Edit("batch-add", "spec.globalBatchSize", {"globalBatchSize": 16}, created_without=True),
    # Removing it brings back the default (8), which differs from 64.
    Edit("batch-remove", "spec.globalBatchSize", {"globalBatchSize": None}),
    Edit("training-steps", "spec.training", {"training": {"steps": 2000}}),
    Edit("training-micro-batch", "spec.training", {"training": {"microBatchSize": 4}}),
    Edit("training-seqlen-remove", "spec.training", {"training": {"seqLen": None}}),
    Edit("training-add", "spec.training", {"training": {"steps": 10}}, created_without=True),
    Edit("training-remove", "spec.training", {"training": None}),
    Edit("checkpoint-claim", "spec.checkpoint", {"checkpoint": {"claimName": "other-ckpt"}}),
    Edit("checkpoint-path", "spec.checkpoint", {"checkpoint": {"path": "/data/ckpt"}}),
    Edit("checkpoint-interval", "spec.checkpoint", {"checkpoint": {"intervalSteps": 100}}),
    Edit("checkpoint-add", "spec.checkpoint", {"checkpoint": {"claimName": "gpt-ckpt"}},
         created_without=True),
    Edit("checkpoint-remove", "spec.checkpoint", {"checkpoint": None}),
    Edit("recovery-mirror", "spec.recovery", {"recovery": {"mirror": False}}),
    Edit("recovery-resume-remove", "spec.recovery", {"recovery": {"resumeFrom": None}}),
    Edit("recovery-add", "spec.recovery", {"recovery": {"mirror": False}}, created_without=True),
    Edit("recovery-remove", "spec.recovery", {"recovery": None}),
    Edit("model-to-hf", "spec.model", {"model": {"preset": None, "hf": "/checkpoints/llama",
                                                 "hfConfig": HF_LLAMA_CONFIG}}),
    # data is free-form (a string or a mapping): the rule compares it all the same.
    Edit("training-data-mapping", "spec.training", {"training": {"data": {
        "path": "/checkpoints/tokens.bin", "dtype": "uint32"}}}),
    Edit("training-schedule", "spec.training", {"training": {"lrSchedule": {"warmupSteps": 5}}}),
    Edit("output-change", "spec.output", {"output": {"hf": "/checkpoints/out/other"}}),
    Edit("output-add", "spec.output", {"output": {"hf": "/checkpoints/out/gpt"}},
         created_without=True),
    Edit("output-remove", "spec.output", {"output": None}),
    Edit("agent-port", "spec.agent", {"agent": {"port": 50052}}),
    Edit("agent-secret", "spec.agent", {"agent": {"authSecret": "other-token"}}),
    Edit("agent-add", "spec.agent", {"agent": {"port": 50051}}, created_without=True),
    Edit("agent-remove", "spec.agent", {"agent": None}),
    Edit("hardware-change", "spec.hardware", {"hardware": {"profile": "h200"}}),
    Edit("hardware-add", "spec.hardware", {"hardware": {"profile": "l4"}}, created_without=True),
    Edit("hardware-remove", "spec.hardware", {"hardware": None}),
    Edit("template-change", "spec.template", {"template": {"spec": {
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}}}}),
    Edit("template-add", "spec.template", {"template": {"spec": {"priorityClassName": "low"}}},
         created_without=True),
    Edit("template-remove", "spec.template", {"template": None}),
]

# Edits a running job may make: the operator applies them live. Each is accepted, and the
# stored spec shows it.
MUTABLE = {
    "elastic": {"elastic": {"minWorkers": 1, "maxWorkers": 16, "workers": 12,
                            "minEfficiency": 0.3}},
    "elastic-workers-remove": {"elastic": {"workers": None}},
    "parallelism-layout": {"parallelism": {"layout": "dp=4,tp=2"}},
    "parallelism-limits": {"parallelism": {"limits": {"maxTP": 2, "zeroStages": [0, 1, 3]}}},
    "parallelism-rebalance": {"parallelism": {"rebalance": {"enabled": True, "threshold": 1.2,
                                                            "paybackSteps": 30,
                                                            "shares": False}}},
    "parallelism-to-fixed": {"parallelism": {"mode": "fixed", "layout": "dp=2,tp=2,pp=2",
                                             "limits": None}},
    "parallelism-remove": {"parallelism": None},
    "preemption-policy": {"preemptionPolicy": "Ignore"},
    "preemption-policy-remove": {"preemptionPolicy": None},
    "ttl-after-finished": {"ttlSecondsAfterFinished": 600},
    "suspend": {"suspend": True},
    "queue-name": {"queueName": "team-b"},        # pods created from then on use it
}


def test_every_spec_field_is_classified():
    # A new spec field must be added to one list or the other (and to the CRD's rules).
    schema = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]
    fields = set(schema["openAPIV3Schema"]["properties"]["spec"]["properties"])
    immutable = {e.field.removeprefix("spec.") for e in IMMUTABLE}
    mutable = {"elastic", "parallelism", "preemptionPolicy", "suspend",
               "ttlSecondsAfterFinished", "queueName"}
    assert fields == immutable | mutable and not immutable & mutable
    assert {k for p in MUTABLE.values() for k in p} == mutable
    for f in immutable - {"image", "model", "resources"}:    # the optional ones
        kinds = {e.id.rsplit("-", 1)[-1] for e in IMMUTABLE if e.field == f"spec.{f}"}
        assert {"add", "remove"} <= kinds, f


@pytest.mark.parametrize("edit", IMMUTABLE, ids=lambda e: e.id)
def test_immutable_field_edit_is_refused(custom, namespace, edit):
    doc = running_job("frozen")
    if edit.created_without:
        del doc["spec"][edit.field.removeprefix("spec.")]
    created = _create(custom, namespace, doc)
    with pytest.raises(ApiException) as err:
        _patch(custom, namespace, "frozen", {"spec": edit.patch})
    message, fields = _invalid(err.value)
    assert edit.field in fields, f"{edit.field!r} not among the causes {fields}: {message}"
    assert f"{edit.field} is immutable" in message and "create a new DynaTrainJob" in message, \
        message
    assert _get(custom, namespace, "frozen")["spec"] == created["spec"]


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386: what a JSON merge patch makes of ``target``."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out


def test_every_edit_is_valid_on_a_new_job(custom, namespace):
    # So an edit refused above is refused for its immutability, not for a bad value.
    for n, edit in enumerate(IMMUTABLE):
        doc = running_job(f"new-{n}")
        if edit.created_without:
            del doc["spec"][edit.field.removeprefix("spec.")]
        doc["spec"] = _merge(doc["spec"], edit.patch)
        _create(custom, namespace, doc)
        job_from_manifest(doc, source=edit.id)


@pytest.mark.parametrize("key", list(MUTABLE))
def test_mutable_field_edit_is_accepted(custom, namespace, key):
    created = _create(custom, namespace, running_job("live"))["spec"]
    patched = _patch(custom, namespace, "live", {"spec": MUTABLE[key]})["spec"]
    expected = _merge(created, MUTABLE[key])
    expected.setdefault("preemptionPolicy", "Switch")          # removed: the default again
    assert patched == expected


def test_a_job_created_without_global_batch_keeps_the_default(custom, namespace):
    doc = base_job("nobatch")
    del doc["spec"]["globalBatchSize"]
    assert _create(custom, namespace, doc)["spec"]["globalBatchSize"] == 8
    # Writing down the value it already has is no edit.
    assert _patch(custom, namespace, "nobatch",
                  {"spec": {"globalBatchSize": 8}})["spec"]["globalBatchSize"] == 8
    with pytest.raises(ApiException) as err:
        _patch(custom, namespace, "nobatch", {"spec": {"globalBatchSize": 64}})
    message, fields = _invalid(err.value)
    assert "spec.globalBatchSize" in fields and "immutable" in message, message


def test_status_and_metadata_updates_pass_the_transition_rules(custom, namespace):
    # What kopf and the operator write to a running job: finalizers, annotations, labels (a
    # metadata patch), the status subresource, and a whole-object PUT of what was read. None
    # changes the spec, so no immutability rule may refuse it.
    doc = running_job("busy")
    doc["spec"]["parallelism"] = {"mode": "fixed", "layout": "dp=2,tp=2,pp=2"}
    _create(custom, namespace, doc)
    meta = _patch(custom, namespace, "busy", {"metadata": {
        "finalizers": ["kopf.zalando.org/KopfFinalizerMarker"],
        "annotations": {"kopf.zalando.org/last-handled-configuration": "{}"},
        "labels": {"team": "ml"}}})
    assert meta["metadata"]["finalizers"] == ["kopf.zalando.org/KopfFinalizerMarker"]
    status = custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "busy",
        {"status": {"phase": "Running", "layout": "dp=2,tp=2,pp=2", "workers": 8}},
        _content_type="application/merge-patch+json")
    assert status["status"]["phase"] == "Running"
    obj = _get(custom, namespace, "busy")
    obj["metadata"]["annotations"]["dynatrain.io/note"] = "put"
    custom.replace_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "busy", obj)
    obj = _get(custom, namespace, "busy")
    custom.replace_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, "busy", obj)
    _patch(custom, namespace, "busy", {"metadata": {"finalizers": None}})
    final = _get(custom, namespace, "busy")
    assert final["metadata"]["annotations"]["dynatrain.io/note"] == "put"
    assert final["spec"]["parallelism"]["layout"] == "dp=2,tp=2,pp=2"
    assert final["metadata"]["generation"] == 1       # the spec never changed


def test_global_batch_default_reaches_objects_stored_before_it(devcluster, namespace):
    """The immutability rule for globalBatchSize relies on oldSelf having it. An object stored
    before the schema had the default has none in etcd; the apiserver applies defaults when it
    reads an object from storage, so oldSelf has 8 there too. Checked on a copy of the CRD
    under another group (an upgrade, without touching the CRD the other tests use)."""
    group = "legacy.dynatrain.test"
    ext = client.ApiextensionsV1Api(devcluster.api_client())
    custom = client.CustomObjectsApi(devcluster.api_client())
    crd = yaml.safe_load(CRD_FILE.read_text())
    crd["metadata"]["name"] = f"{PLURAL}.{group}"
    crd["spec"]["group"] = group
    for key in ("shortNames", "categories"):
        crd["spec"]["names"].pop(key)
    spec_props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]
    assert spec_props["globalBatchSize"].pop("default") == 8
    ext.create_custom_resource_definition(body=crd)
    try:
        def served():
            try:
                custom.list_namespaced_custom_object(group, VERSION, namespace, PLURAL)
                return True
            except ApiException:
                return False
        wait_until(f"CRD {PLURAL}.{group} served", served, timeout=datetime.timedelta(seconds=30))
        doc = base_job("old")
        doc["apiVersion"] = f"{group}/{VERSION}"
        del doc["spec"]["globalBatchSize"]
        custom.create_namespaced_custom_object(group, VERSION, namespace, PLURAL, doc)
        assert "globalBatchSize" not in custom.get_namespaced_custom_object(
            group, VERSION, namespace, PLURAL, "old")["spec"]

        # The upgrade: the schema gains the default.
        current = ext.read_custom_resource_definition(name=f"{PLURAL}.{group}")
        crd["metadata"]["resourceVersion"] = current.metadata.resource_version
        spec_props["globalBatchSize"]["default"] = 8
        ext.replace_custom_resource_definition(name=f"{PLURAL}.{group}", body=crd)
        wait_until("the stored object read with the default", lambda: (
            custom.get_namespaced_custom_object(group, VERSION, namespace, PLURAL, "old")
            ["spec"].get("globalBatchSize") == 8), timeout=datetime.timedelta(seconds=30))

        def patch(body):
            return custom.patch_namespaced_custom_object(
                group, VERSION, namespace, PLURAL, "old", body,
                _content_type="application/merge-patch+json")
        with pytest.raises(ApiException) as err:
            patch({"spec": {"globalBatchSize": 64}})
        message, fields = _invalid(err.value)
        assert "spec.globalBatchSize" in fields and "immutable" in message, message
        # Edits that leave it alone still pass.
        assert patch({"spec": {"elastic": {"workers": 6}}})["spec"]["elastic"]["workers"] == 6
        patch({"metadata": {"annotations": {"a": "b"}}})
    finally:
        ext.delete_custom_resource_definition(name=f"{PLURAL}.{group}")


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
        "NAME", "PHASE", "LAYOUT", "WORKERS", "STEP", "LOSS", "LAST SWITCH", "AGE"]
    (row,) = _table(out)
    assert row["NAME"] == "gpt" and row["PHASE"] == row["LAYOUT"] == row["LAST SWITCH"] == ""

    # Status is a subresource: only its endpoint writes it, and its schema is enforced too.
    status = {
        "phase": "Running", "layout": "dp=4,tp=1,pp=1", "workers": 4, "gpus": 4,
        "selector": "dynatrain.io/job=gpt", "generation": 3, "step": 1200,
        "loss": 3.412057, "tokensPerSecond": 45210.5, "observedGeneration": 1,
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
    assert {k: row[k] for k in ("NAME", "PHASE", "LAYOUT", "WORKERS", "STEP", "LOSS",
                                "LAST SWITCH")} == {
        "NAME": "gpt", "PHASE": "Running", "LAYOUT": "dp=4,tp=1,pp=1", "WORKERS": "4",
        "STEP": "1200", "LOSS": "3.412057", "LAST SWITCH": "scale-up 0.41s"}
    assert row["AGE"]
    (wide,) = _table(kubectl("get", "dtj", "gpt", "-n", namespace, "-o", "wide").stdout)
    assert (wide["GENERATION"], wide["TOKENS/S"], wide["PAUSE"]) == ("3", "45210.5", "0.41")
    assert wide["SWITCHED"]  # a relative age, e.g. "300d"

    with pytest.raises(ApiException) as err:
        custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, "gpt", {"status": {"phase": "Exploded"}},
            _content_type="application/merge-patch+json")
    _, fields = _invalid(err.value)
    assert "status.phase" in fields
    with pytest.raises(ApiException) as err:
        custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, "gpt", {"status": {"tokensPerSecond": -1}},
            _content_type="application/merge-patch+json")
    _, fields = _invalid(err.value)
    assert "status.tokensPerSecond" in fields


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
