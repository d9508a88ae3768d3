"""Which torch.distributed backend and which torch device a training process uses.

``--backend`` of ``dynatrain worker``, ``dynatrain run`` and ``dynatrain bench switch`` takes one of
:data:`BACKENDS`:

- ``auto`` (the default): for a job, NCCL on CUDA when it asks for GPUs
  (``spec.resources.gpus >= 1``, what the operator requests as ``nvidia.com/gpu``) and gloo on
  CPU when it asks for none; for ``bench switch``, which has no job, NCCL when every rank can
  have a GPU of its own on this machine, else gloo (as ``dynatrain train`` picks).
- ``nccl``: NCCL on CUDA. A job that asks for no GPU is an error, and so is a machine where
  ``torch.cuda.is_available()`` is False: never a silent fall-back to the CPU.
- ``gloo``: gloo on the CPU, whatever the job asks for (the dev cluster's simulated GPU nodes
  have no CUDA: its pod runner adds ``--backend gloo`` to their workers only when told to).
- ``nccl-sim``: on the CPU with ProcessGroupNCCL's semantics (:mod:`dynatrain.vps.ncclsim`):
  dead peers hang, the watchdog acts on ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, communicators
  are made lazily. A test harness setting for the recovery paths NCCL takes; the mirrors still
  travel on gloo, as they do beside NCCL.

Which GPU: a worker pod sees the GPUs its device plugin gave it (``CUDA_VISIBLE_DEVICES``); the
worker uses ``cuda:0`` of what it sees, unless ``--cuda-device N`` or ``LOCAL_RANK`` (torchrun's)
names another. The local runner gives each worker one GPU of its own through
``CUDA_VISIBLE_DEVICES`` (:func:`visible_gpu`), as a device plugin would, so every worker also
uses ``cuda:0``: background threads (which start on CUDA's device 0) then cannot touch another
worker's GPU.

Every refusal is a :class:`BackendError` whose message is one line: what was asked, why it
cannot be had, what to do instead. Commands print it and exit with code 2.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "nccl", "gloo", "nccl-sim")


class BackendError(ValueError):
    """The backend or device asked for cannot be had here; the message says what to do."""


def job_backend(requested: str, gpus: int) -> str:
    """The backend (``nccl`` or ``gloo``) of a worker of a job with ``spec.resources.gpus =
    gpus`` when asked for ``requested``. Checks the combination, not the machine
    (:func:`require_cuda` does that)."""
    if requested not in BACKENDS:
        raise BackendError(f"--backend {requested!r}: valid values are {', '.join(BACKENDS)}")
    if requested == "auto":
        return "nccl" if gpus >= 1 else "gloo"
    if requested == "nccl" and gpus < 1:
        raise BackendError(f"--backend nccl trains on GPUs, but the job asks for none "
                           f"(spec.resources.gpus: {gpus}); use --backend gloo (or auto) for "
                           "a CPU job, or set spec.resources.gpus: 1")
    return requested


def asked_for(requested: str, gpus: int | None = None) -> str:
    """How the request reads in a message: ``--backend auto with spec.resources.gpus: 1``."""
    if requested == "auto" and gpus is not None:
        return f"--backend auto with spec.resources.gpus: {gpus}"
    return f"--backend {requested}"


JOB_FIX = "pass --backend gloo to train on the CPU, or set spec.resources.gpus: 0"


def require_cuda(asked: str, count: int = 1, fix: str = JOB_FIX) -> None:
    """Raise unless CUDA is available with at least ``count`` visible GPUs. ``asked`` is what
    asked for them (:func:`asked_for`), ``fix`` what to do instead."""
    if not torch.cuda.is_available():
        raise BackendError(
            f"{asked} means NCCL on a GPU, but CUDA is unavailable here "
            f"(torch.cuda.is_available() is False; torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}); {fix}")
    have = torch.cuda.device_count()
    if have < count:
        raise BackendError(f"{asked} needs {count} GPUs (one per process), but {have} "
                           f"{'is' if have == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use fewer "
                           "workers, or --backend gloo to train on the CPU")


def cuda_index(explicit: int | None = None, environ=None) -> int:
    """The CUDA index (of the visible GPUs) a process uses: ``explicit`` (``--cuda-device``),
    else ``LOCAL_RANK``, else 0."""
    if explicit is not None:
        return explicit
    local_rank = (os.environ if environ is None else environ).get("LOCAL_RANK", "")
    if local_rank.strip():
        try:
            return int(local_rank)
        except ValueError:
            raise BackendError(f"LOCAL_RANK={local_rank!r} is not a GPU index") from None
    return 0


def torch_device(backend: str, index: int = 0, *, asked: str = "") -> torch.device:
    """The device a process of ``backend`` trains on; for NCCL also made the current CUDA
    device of the calling thread (NCCL's collectives and DCP's use it)."""
    if backend != "nccl":
        return torch.device("cpu")
    asked = asked or asked_for(backend)
    require_cuda(asked)
    have = torch.cuda.device_count()
    if not 0 <= index < have:
        raise BackendError(f"{asked}: GPU index {index} (--cuda-device or LOCAL_RANK) is not "
                           f"one of the {have} visible GPUs (0..{have - 1}; "
                           f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def visible_gpu(index: int, environ=None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child process that gets the ``index``-th GPU this process
    sees: the index itself, or the ``index``-th entry of our own ``CUDA_VISIBLE_DEVICES``."""
    ours = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if ours is None or not ours.strip():
        return str(index)
    entries = [e.strip() for e in ours.split(",") if e.strip()]
    return entries[index] if index < len(entries) else str(index)


def bench_backend(requested: str, world: int) -> str:
    """``bench switch``'s backend for ``world`` ranks on this machine (no job to ask)."""
    if requested not in BACKENDS:
        raise BackendError(f"--backend {requested!r}: valid values are {', '.join(BACKENDS)}")
    if requested == "auto":
        usable = torch.cuda.is_available() and torch.cuda.device_count() >= world
        return "nccl" if usable else "gloo"
    if requested == "nccl":
        require_cuda("--backend nccl", count=world,
                     fix="run it on a machine with a GPU per rank, or pass --backend gloo")
    # nccl-sim: the live run's groups on the CPU with NCCL's semantics (its default group, for
    # barriers and DCP, and the restart baseline on gloo: bench.switch_worker).
    return requested


NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_CLEAN_UP_ONLY = "2"
"""ProcessGroupNCCL's ``CleanUpOnly``: a collective past its group's timeout has its
communicator aborted and its error raised where it is waited on, and the process lives on.
torch's default (3, ``SkipCleanUp``) and 1 (``TearDown``) take the whole process down
(``SHOULD_TEAR_DOWN`` in torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp): after a member
dies, the survivors' abandoned generation still holds ops that time out, and the watchdog would
kill the very workers a recovery is restoring from."""


def nccl_error_handling(environ=None) -> tuple[str, bool]:
    """Set ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` to :data:`NCCL_CLEAN_UP_ONLY` unless it is set
    already (an operator of the cluster may know better); before any NCCL group exists, as
    ProcessGroupNCCL reads it when a group is made. Returns (the value in force, whether it
    was set here)."""
    env = os.environ if environ is None else environ
    if env.get(NCCL_ERROR_HANDLING, "") != "":
        return env[NCCL_ERROR_HANDLING], False
    env[NCCL_ERROR_HANDLING] = NCCL_CLEAN_UP_ONLY
    return NCCL_CLEAN_UP_ONLY, True
