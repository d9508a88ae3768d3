"""The operator tests' pod runner: the dev cluster's kubelet stand-in for the job's worker pods.

Three explicit settings of the harness, all stand-ins a real node would not need:

- the simulated GPU nodes have no CUDA, so a GPU job's workers train on the CPU
  (``cpu_for_gpu_pods``, named in the worker's command as ``--backend gloo --threads 1``);
- those CPU workers run one torch thread each, and train at most one step per
  ``STEP_FLOOR_S`` (``cpu_step_floor_s``, named in the worker's command as
  ``--min-step-seconds``): a GPU trains without taking the node's CPU, while several CPU
  workers with torch's default threads oversubscribed a 2-core CI machine and took it from
  the control plane and the operator whose reactions the tests wait for.
  ``DYNATRAIN_TEST_STEP_FLOOR=0`` lets them train flat out;
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
STEP_FLOOR_ENV = "DYNATRAIN_TEST_STEP_FLOOR"
STEP_FLOOR_S = 1.0
"""Seconds. Measured 2026-11-28 in CI (2 cores, one thread per worker, the suite's load):
the tests' gpt-tiny steps take ~0.17 s (~0.09 s of CPU each), so a floor of 0.1 s did not
bind there and the workers stepped flat out while the tests waited on the operator. The
cluster tests wait for a few steps at most (``step > last + 2``), never for a number of steps
in a time: with 0.4 s, test_operator.py and test_operator_eviction.py took 198 core-s instead
of 225 in the same wall time (2026-11-29, on an idle machine), and the cluster suites passed;
with 1.0 s, 166 core-s instead of 196 at 0.4 s (the workers 94 instead of 122), 170 s of wall
time instead of 177 (2026-11-29, idle machine, `tools/cpu-by-process -- pytest ...`). A cold CI
run is CPU-bound on 2 cores, so the cluster suites' CPU is what its time is made of.
The big saving before was ``--threads 1``: with torch's default threads the same steps took
3.6-7 s."""


def fork_workers() -> bool:
    """Whether worker pods are forked (the default) or exec'd (``DYNATRAIN_TEST_POD_START``)."""
    value = os.environ.get(POD_START_ENV, "forkserver")
    if value not in ("forkserver", "exec"):
        raise ValueError(f"{POD_START_ENV}={value!r} is not one of forkserver, exec")
    return value == "forkserver"


def job_pods(core, workdir: Path, namespace: str) -> PodRunner:
    """A runner for the DynaTrainJob pods of ``namespace`` (not yet started)."""
    return PodRunner(core, workdir, namespace=namespace, selector="dynatrain.io/job",
                     cpu_for_gpu_pods=True, fork_workers=fork_workers(),
                     cpu_step_floor_s=step_floor_s())


def step_floor_s() -> float:
    """The CPU workers' step floor (``DYNATRAIN_TEST_STEP_FLOOR``, default STEP_FLOOR_S)."""
    value = os.environ.get(STEP_FLOOR_ENV, str(STEP_FLOOR_S))
    try:
        floor = float(value)
    except ValueError:
        floor = -1.0
    if not 0 <= floor <= 60:
        raise ValueError(f"{STEP_FLOOR_ENV}={value!r} is not seconds from 0 to 60")
    return floor
