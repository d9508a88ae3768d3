"""Two GPU models in one job (#38 item 4): the operator reads each worker's GPU from its node's
labels, and a pipeline gets a stage of H100s and a stage of A100s, its layers in proportion to
their speed (controller/mixed.py; tests/controller/test_mixed.py has the split by hand).

The pool is two simulated nodes of this test's own, one GPU each: one labelled an H100, one an
A100. gpt-tiny's 4 layers with a global batch of 1 and no TP leave one layout, a 2-stage
pipeline: even, the H100 would wait for the A100 at every micro-batch; weighted, the H100's
stage takes 3 layers and the A100's 1.
"""

from __future__ import annotations

import pytest
from kubernetes import client

from dynatrain.devcluster.nodes import NodePool, Taint, add_nodes
from harness.operator_process import (POOL_LABEL, apply, condition, events, get, job, job_pods,
                                     on_pool, remove_jobs, running_on, wait)

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


def _node(index: int, pool: str, product: str) -> NodePool:
    return NodePool(count=1, gpus_per_node=1, name_prefix="mixed", first_index=index,
                    labels={"nvidia.com/gpu.product": product, POOL_LABEL: pool},
                    taints=(Taint(key="nvidia.com/gpu", value="present", effect="NoSchedule"),))


def test_a_pipeline_over_two_gpu_models_gets_stages_of_one_model_weighted_by_speed(
        devcluster, kubectl, namespace, operator, tmp_path):
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    pool = namespace
    nodes = []
    try:
        nodes += add_nodes(core, _node(0, pool, "NVIDIA-A100-SXM4-80GB"))
        nodes += add_nodes(core, _node(1, pool, "NVIDIA-H100-80GB-HBM3"))
        doc = on_pool(job("mixed", gpus=1, max_workers=2), pool)
        doc["spec"]["elastic"]["minWorkers"] = 2
        doc["spec"]["globalBatchSize"] = 1
        doc["spec"]["parallelism"] = {"mode": "auto", "limits": {"maxTP": 1}}
        apply(kubectl, namespace, tmp_path, doc)
        st = wait("the job on 2 workers", running_on(custom, namespace, "mixed", 2),
                  timeout=240)
        assert st["layout"] == "dp=1,tp=1,pp=2,stages=3+1", st
        cond = condition(custom, namespace, "mixed", "Hardware")
        assert cond["reason"] == "MixedGPUs" and "in proportion to their speed" in \
            cond["message"], cond
        # Stage 0 (3 layers) is the H100's: the first member of the Started layout runs there.
        started = next(e.message for e in events(core, namespace, "mixed")
                       if e.reason == "Started")
        first = int(started.split("on workers [", 1)[1].split(",")[0])
        node_of = {int(p.metadata.labels["dynatrain.io/device"]): p.spec.node_name
                   for p in job_pods(core, namespace, "mixed")}
        h100 = next(n for n in nodes if core.read_node(n).metadata.labels[
            "nvidia.com/gpu.product"].startswith("NVIDIA-H100"))
        assert node_of[first] == h100, (started, node_of)
        wait("a few steps trained on the weighted stages", lambda: get(
            custom, namespace, "mixed")["status"].get("step", 0) >= 3, timeout=120)
    finally:
        remove_jobs(kubectl, core, namespace, ("mixed",), nodes)
