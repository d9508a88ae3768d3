"""The operator tests' pod runner: the dev cluster's kubelet stand-in for the job's worker pods.

Two explicit settings of the harness, both stand-ins a real node would not need:

- the simulated GPU nodes have no CUDA, so a GPU job's workers train on the CPU
  (``cpu_for_gpu_pods``, named in the worker's command as ``--backend gloo``);
- a worker pod is forked from the fork server that has torch imported
  (``fork_workers``): the same worker main, arguments, environment and exit codes as the
  container's command in a new interpreter, without its ~5 s of CPU for imports, which a
  2-core CI machine would otherwise take from the training the tests check.
  ``DYNATRAIN_TEST_POD_START=exec`` runs every worker pod as a new interpreter instead.
"""

from __future__ import annotations

import os
from pathlib import Path

from dynatrain.devcluster.pods import PodRunner

POD_START_ENV = "DYNATRAIN_TEST_POD_START"


def fork_workers() -> bool:
    """Whether worker pods are forked (the default) or exec'd (``DYNATRAIN_TEST_POD_START``)."""
    value = os.environ.get(POD_START_ENV, "forkserver")
    if value not in ("forkserver", "exec"):
        raise ValueError(f"{POD_START_ENV}={value!r} is not one of forkserver, exec")
    return value == "forkserver"


def job_pods(core, workdir: Path, namespace: str) -> PodRunner:
    """A runner for the DynaTrainJob pods of ``namespace`` (not yet started)."""
    return PodRunner(core, workdir, namespace=namespace, selector="dynatrain.io/job",
                     cpu_for_gpu_pods=True, fork_workers=fork_workers())
