"""Starting rank processes on this machine, from a fork server that has torch imported.

Every multi-process run on one machine that is not a product process (``run_local``, the switch
benchmark, calibration, the tests' harnesses) starts its ranks through :func:`start_ranks`.
With ``spawn`` each rank is a new interpreter that imports torch again: about 2.5 s of CPU per
process on a 2-core machine, 4 s with Distributed Checkpoint, and the test suite starts several
hundred. The ``forkserver`` start method imports those libraries once, in a single-threaded
server process, and forks each rank from it, so a rank starts in milliseconds; like ``spawn``
(and unlike ``fork``) a rank inherits no threads, locks or OpenMP state from its caller, and
it gets the caller's ``sys.path``, working directory and main module the same way.

Only third-party libraries are preloaded: this project's modules are imported in each rank, so
what they read from the environment at import time is read there. A rank also gets the caller's
``os.environ`` as it is when :func:`start_ranks` is called (the server's own is the one it
started with). ``DYNATRAIN_START_METHOD=spawn`` goes back to one interpreter per rank.
"""

from __future__ import annotations

import os

import torch.multiprocessing as mp

PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint",
           # What `dynatrain worker` imports besides torch and this project (its agent's gRPC
           # server and TLS, the job spec, its metrics):
           "grpc", "grpc_health.v1.health", "google.protobuf.message", "cryptography.x509",
           "cryptography.hazmat.primitives.serialization", "yaml", "prometheus_client.core")
"""What the fork server imports before it forks anything (third-party only, see above).
``torch._dynamo`` is there because every torch optimizer imports it on first use (2.7 s of CPU
on a 2-core machine): the local runner's workers forked from here (:mod:`dynatrain.controller.
workerstart`) and any rank that trains would each pay it. The worker's other libraries took
0.25 s of CPU in every forked worker (0.39 s of imports in all, measured on this 2-core
machine; cryptography alone 0.21 s), and the test suite forks hundreds. Importing them starts
no thread (gRPC's core starts with its first channel or server, in the worker), so the server
stays single-threaded and safe to fork; a library missing here is skipped by the server and
imported, or reported missing, where it is used."""

START_METHODS = ("forkserver", "spawn")


def start_method() -> str:
    method = os.environ.get("DYNATRAIN_START_METHOD", "forkserver")
    if method not in START_METHODS:
        raise ValueError(f"DYNATRAIN_START_METHOD={method!r}: must be one of {START_METHODS}")
    return method


def context(method: str | None = None):
    """The multiprocessing context ranks start from (for the queues they report on)."""
    method = method or start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Takes effect when the server starts (the first start in this process); later calls
        # are no-ops, so every caller asks for the same list.
        ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _entry(index: int, fn, environ: dict, *args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    fn(index, *args)


def start_ranks(fn, args: tuple, nprocs: int, *, method: str | None = None):
    """Start ``fn(index, *args)`` in ``nprocs`` processes; returns torch's ProcessContext
    (``.processes``, ``.join()``), as ``torch.multiprocessing.start_processes`` does.

    ``method="spawn"`` forces fresh interpreters where their start is what is measured (a
    checkpoint-and-restart baseline)."""
    method = method or start_method()
    context(method)  # the preload list is set before the server can start
    return mp.start_processes(_entry, args=(fn, dict(os.environ), *args), nprocs=nprocs,
                              join=False, start_method=method)
