"""PyTorch Distributed Checkpoint (DCP) of the training state, described by the mapping's pieces.

Our shards are lists of boxes (a ZeRO flat range of a TP shard is a few of them), which neither
DTensor placements nor ShardedTensor (it insists on a full, non-overlapping global layout at
every rank) can express. DCP's planner interface can: the save planner writes one chunk per
piece (DCP itself drops the duplicates that replicas write), and the load planner asks DCP's own
``create_read_items_for_chunk_list`` which saved chunks cover each new piece. So resharding,
the part a live switch is checked against, is entirely DCP's. This is also the checkpoint-and-
restart path the live switch is compared with, and the last-resort checkpoint.

Besides the tensors a checkpoint holds the scalars a job needs to resume exactly: step and data
position, and every saving rank's CPU RNG state as one row of a ``[world, state bytes]`` tensor.
A rank of the loading layout gets the row of the same rank (modulo the saved world, so a larger
layout still gets a state); checkpoints written before the RNG was saved load with ``rng={}``.

:func:`save_checkpoint` is the elastic job's periodic last-resort checkpoint. Every rank of the
layout calls it at the same step boundary; ranks write into ``dir/.step-00000042.tmp``, and
only once every rank has finished does the lowest rank write the metadata, rename the directory
to ``dir/step-00000042`` (atomic), and prune to ``keep`` checkpoints. A ``step-*`` directory is
therefore always complete, and :func:`latest_checkpoint` ignores anything else. ``dir`` is the
job's own folder under the checkpoint root (:func:`job_checkpoint_dir`, ``<root>/<job>``): a
claim that several jobs share holds one folder per job, so no job prunes another's steps. Each also
records the model it holds as JSON (:data:`MODEL_RECORD`: the spec's fields and, for a model
imported from Hugging Face, that checkpoint's config.json), so it can be exported without
naming the model again (:mod:`.hf_export`).

Why not ``dcp.save(process_group=group)``: the elastic workers build every group directly
(``ProcessGroupGloo(PrefixStore(...), ...)``) and never create a default process group, because
the world changes with every generation. DCP then silently treats the call as a single-process
save (``no_dist`` is forced when ``dist.is_initialized()`` is false, and ``process_group`` is
ignored): every rank writes ``__0_0.distcp`` and ``.metadata`` into the same directory and they
overwrite each other. Registering a group needs a default group, and DCP's experimental
``use_collectives=False`` mode takes each rank's file names from that same (absent) default
group and writes per-rank metadata that resharding cannot read without merging it by hand.
Instead :func:`save_checkpoint` drives DCP's documented save protocol itself (``SavePlanner`` /
``StorageWriter``: local plans on every rank, the global plan and the metadata on the
coordinator, writes on every rank, ``finish`` on the coordinator), moving the plans between
ranks with an all-gather over the group's own methods, which works for any group object. The
result is the checkpoint ``dcp.save`` writes with a registered group: DCP's own deduplication
of replicas and coverage checks, data files named by DCP, one ``.metadata``, and ordinary DCP
loading (with resharding) by :func:`load_state`. Any rank's failure in any phase is raised on
every rank, naming the rank, so no rank renames a half-written checkpoint or waits for ever.

Nothing read from outside this process is unpickled. Checkpoint files are written by whoever
can write the volume, and a checkpoint path may arrive in a Prepare or a job's
``spec.recovery.resumeFrom``: a path is accepted only under the job's checkpoint roots
(:func:`check_checkpoint_path`); DCP's ``.metadata`` (a pickle by DCP's design) is read by
:class:`~.dcp_planners.SafeFileSystemReader`, which rebuilds only DCP's own metadata classes;
tensor data is read by ``torch.load(weights_only=True)``, and items DCP would ``torch.load``
in full (``BytesIO`` ones, which we never write) are refused. The plans the ranks exchange
while saving travel as JSON (:func:`~.dcp_planners.encode_plan`), not pickles.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dynatrain.vps import abandon
from dynatrain.vps.mapping import rank_shards
from dynatrain.vps.regions import piece_view

from .checkpoint_errors import CheckpointError, CheckpointPathError, UnsafeCheckpointError
from .trainer import LocalState
from .weights import TORCH_DTYPES

__all__ = ["CheckpointError", "CheckpointPathError", "UnsafeCheckpointError"]
"""Not the whole API: the errors, re-exported from :mod:`.checkpoint_errors` (see there)."""

_SCALARS = "__dynatrain_scalars__"
_RNG = "__dynatrain_rng_cpu__"
_METADATA = ".metadata"  # DCP's FileSystemWriter name; it is written last, by the coordinator
_STEP_DIR = re.compile(r"step-(\d+)")
MODEL_RECORD = "model.json"
"""The model a checkpoint holds, as JSON (never pickle: it is read back by tools)."""


def job_checkpoint_dir(root, job: str) -> str:
    """Where job ``job`` writes its checkpoints under the checkpoint root ``root`` (a claim
    several jobs may share): its own sub-folder, so that no job prunes another's steps."""
    if (not isinstance(job, str) or not job or job.startswith(".") or "/" in job
            or "\\" in job or "\x00" in job):
        raise CheckpointPathError(f"job name {job!r} cannot name a checkpoint folder: it must "
                                  "be a non-empty name without '/', '\\' or a leading '.' "
                                  "(a Kubernetes object name is one)")
    return os.path.join(os.fspath(root), job)


def check_checkpoint_path(path, roots) -> str:
    """``path`` resolved (symlinks and ``..`` followed) if it lies inside one of ``roots``;
    else :class:`CheckpointPathError` naming the path and the roots.

    Loading a checkpoint reads files that decide what runs in every worker, so a path that
    arrives over the network (a Prepare, ``spec.recovery.resumeFrom``) is accepted only under
    the job's own checkpoint root. A relative ``path`` is relative to the first root (the
    claim's mount, ``--checkpoint-dir``): ``other-job/step-00000120`` names a checkpoint on the
    volume the same way on every worker, whatever the volume's mount point.
    """
    text = os.fspath(path)
    allowed = [os.path.realpath(os.fspath(r)) for r in roots if os.fspath(r)]
    if not allowed:
        raise CheckpointPathError(f"checkpoint {text!r} refused: this worker has no checkpoint "
                                  "root (--checkpoint-dir / spec.checkpoint) to read from")
    if not isinstance(text, str) or not text or "\x00" in text:
        raise CheckpointPathError(f"checkpoint {text!r} is not a path")
    real = os.path.realpath(os.path.join(allowed[0], text))   # an absolute text stays itself
    for root in allowed:
        if os.path.commonpath([real, root]) == root:
            return real
    raise CheckpointPathError(f"checkpoint {text!r} (resolved {real!r}) is outside the job's "
                              f"checkpoint root{'s' if len(allowed) > 1 else ''} "
                              f"{', '.join(map(repr, allowed))}; only checkpoints under it "
                              "are loaded")


def _fqn(name: str, state: str) -> str:
    return f"{name}/{state}"


def write_model_record(path, model, hf_source: str = "") -> None:
    """Record ``model`` in checkpoint directory ``path``; ``hf_source``, the Hugging Face
    directory it was imported from, contributes its config.json (export starts from it)."""
    from dynatrain.vps.hf import read_hf_config
    from dynatrain.vps.model import ModelSpecError

    hf_config = None
    if hf_source:
        try:
            hf_config = read_hf_config(hf_source)
        except ModelSpecError as e:  # the weights are safe either way: export builds a config
            warnings.warn(f"checkpoint {path}: the model's Hugging Face config is not "
                          f"recorded ({e}); an export will write one from the model spec")
    record = {"model": model.to_dict(), "hf_config": hf_config}
    with open(os.path.join(os.fspath(path), MODEL_RECORD), "w") as f:
        json.dump(record, f, indent=1)


def read_model_record(path):
    """(ModelSpec, Hugging Face config or None) recorded in checkpoint ``path``; None for a
    checkpoint that records no model (one written before records existed)."""
    from dynatrain.vps.model import model_from_dict

    file = os.path.join(os.fspath(path), MODEL_RECORD)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        record = json.load(f)
    return model_from_dict(record["model"], source=file), record.get("hf_config")


def _chunks(tensors: dict) -> dict[str, list[tuple[tuple, torch.Tensor]]]:
    """(name, state) -> (local tensor, pieces)  ==>  fqn -> [(offsets, piece view)]."""
    out = {}
    for (name, state), (local, pieces) in tensors.items():
        out[_fqn(name, state)] = [(tuple(a for a, _ in p.box), piece_view(local, p))
                                  for p in pieces]
    return out


def _state_chunks(state: LocalState, model, rank: int, world: int):
    """What one rank writes of ``state``: its pieces, the scalars, its RNG row (if it has one)."""
    chunks = _chunks(state.tensors)
    specs = {t.name: t for t in model.tensors}
    sizes = {_fqn(n, s): torch.Size(specs[n].shape) for n, s in state.tensors}
    scalars = torch.tensor([state.step, state.data_position], dtype=torch.int64)
    chunks[_SCALARS] = [((0,), scalars)]
    sizes[_SCALARS] = torch.Size([2])
    rng = state.rng.get("cpu")
    if rng is not None:
        row = rng.detach().to("cpu", torch.uint8).reshape(1, -1)
        chunks[_RNG] = [((rank, 0), row)]
        sizes[_RNG] = torch.Size([world, row.shape[1]])
    return chunks, sizes


def save_state(state: LocalState, model, path: str, process_group=None) -> None:
    """Write this rank's state (collective over ``process_group``: every old rank calls it).

    Needs a default process group (``dist.init_process_group``); without one use
    :func:`save_checkpoint`.
    """
    rank, world = 0, 1
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    import torch.distributed.checkpoint as dcp

    from .dcp_planners import PieceSavePlanner

    chunks, sizes = _state_chunks(state, model, rank, world)
    dcp.save({}, checkpoint_id=path, planner=PieceSavePlanner(chunks, sizes),
             process_group=process_group)


def load_state(bound, rank: int, path: str, device=None) -> LocalState:
    """This rank's state under ``bound``'s layout, resharded by DCP from the checkpoint.

    Reads in this process only (no collective), so any number of ranks of any layout can load
    the same checkpoint. ``rng`` is ``{"cpu": ByteTensor}`` when the checkpoint has RNG states.
    Raises :class:`UnsafeCheckpointError` for a checkpoint whose files would run code or read
    outside it (see the module's last paragraph); the caller checks ``path`` against the job's
    roots first where it came from elsewhere (:func:`check_checkpoint_path`).
    """
    from .dcp_planners import PieceLoadPlanner, load_pieces

    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, _METADATA)):
        raise FileNotFoundError(f"{path!r} is not a complete checkpoint (it has no {_METADATA}); "
                                "latest_checkpoint(root) finds the newest complete one")
    tensors = {}
    for rs in rank_shards(bound, rank):
        dtype = TORCH_DTYPES[rs.tensor.dtype] if rs.state == "param" else torch.float32
        tensors[(rs.tensor.name, rs.state)] = (torch.empty(rs.local_shape, dtype=dtype),
                                               rs.pieces)
    chunks = _chunks(tensors)
    scalars = torch.zeros(2, dtype=torch.int64)
    chunks[_SCALARS] = [((0,), scalars)]
    planner = PieceLoadPlanner(chunks, rng_key=_RNG, rng_row=rank)
    load_pieces(path, planner)
    if device is not None:
        tensors = {k: (t.to(device), p) for k, (t, p) in tensors.items()}
    rng = {"cpu": planner.chunks[_RNG][0][1][0].clone()} if _RNG in planner.chunks else {}
    return LocalState(tensors, int(scalars[0]), int(scalars[1]), rng)


# -- the periodic checkpoint of the elastic job ------------------------------------------------

@dataclass(frozen=True)
class SavedCheckpoint:
    """A completed :func:`save_checkpoint`; usable as the checkpoint's path (``os.fspath``)."""

    path: str
    step: int
    seconds: float
    """Wall time of the save on this rank: from the call until the checkpoint was in place."""
    bytes_written: int
    """Bytes this rank wrote (replicas write their shared pieces once, between them)."""

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint of ``step`` (zero-padded: names sort by step)."""
    return f"step-{step:08d}"


def _group_device(group) -> torch.device:
    """Where the group's collectives take their tensors: NCCL wants the current GPU."""
    if (group.name() if hasattr(group, "name") else "") == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wait(work) -> None:
    # The one place a save blocks on its peers: a lost peer surfaces here as the backend's
    # error after the group's timeout, or at once when the agent abandons the generation.
    abandon.wait(work)


def _all_gather_bytes(group, data: bytes) -> list[bytes]:
    """Every rank's ``data``, in group-rank order, by the group's own ``allgather``. What a
    save's phases exchange is JSON (:func:`~.dcp_planners.encode_plan`: plain values and DCP's
    plan dataclasses by an allowlisted name), so a rank can only ever receive data;
    ``dist.all_gather_object`` also works on a group built directly, but through a path torch
    warns is deprecated for such groups, and it pickles (a peer's bytes would be unpickled
    here)."""
    device = _group_device(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(group.size())]
    _wait(group.allgather([sizes], [size]))
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    bufs = [torch.empty_like(buf) for _ in range(group.size())]
    _wait(group.allgather([bufs], [buf]))
    return [b[:int(s)].cpu().numpy().tobytes() for b, s in zip(bufs, sizes)]


_SEPARATOR = b"\0"
"""Between a phase's outcome and its value on the wire: JSON never holds a raw NUL byte."""


def _phase(group, what: str, fn, keep=None) -> list:
    """Run ``fn`` on this rank, then share every rank's result; a failure anywhere raises on
    every rank (so no rank goes on to the next phase and waits there for ever).

    ``keep(r)`` says whose results this rank reads (default: everyone's); the others are
    None here. A save's local plans and write results are read by the coordinator alone:
    decoding every rank's on every rank was half of a gpt-tiny worker's time in its periodic
    checkpoint (py-spy), and ~6% of its CPU in a job that checkpoints every 4 steps. This
    rank's own result is its own object, never a decoded copy."""
    from .dcp_planners import decode_plan, encode_plan

    error = None
    try:
        mine = fn()
        outcome = ("ok", "")
    except Exception as e:  # shared with every rank below, then raised
        error, mine, outcome = e, None, ("error", f"{type(e).__name__}: {e}")
    if group is None:
        sent = [encode_plan(outcome)]
        me = 0
    else:
        sent = _all_gather_bytes(group, encode_plan(outcome) + _SEPARATOR + encode_plan(mine))
        me = group.rank()
    failed, values = [], []
    for r, data in enumerate(sent):
        head, _, body = data.partition(_SEPARATOR)
        kind, msg = decode_plan(head)
        if kind == "error":
            failed.append((r, msg))
        if r == me:
            values.append(mine)
        else:
            values.append(decode_plan(body) if kind == "ok" and (keep is None or keep(r))
                          else None)
    if failed:
        raise CheckpointError(f"checkpoint {what} failed on " + "; ".join(
            f"rank {r}: {msg}" for r, msg in failed)) from error
    return values


def _fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable (where the platform lets us open a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in ``root``, oldest first."""
    found = []
    for entry in os.scandir(root):
        m = _STEP_DIR.fullmatch(entry.name)
        if m and entry.is_dir() and os.path.isfile(os.path.join(entry.path, _METADATA)):
            found.append((int(m.group(1)), entry.path))
    return sorted(found)


def latest_checkpoint(root, job: str = "") -> tuple[str, int] | None:
    """(path, step) of the newest complete checkpoint under ``root``; None if there is none.

    ``root`` is a job's folder (``step-*`` directly in it, as every root was before jobs had
    folders of their own) or a checkpoint root of job folders: with ``job``, that job's folder
    (:func:`job_checkpoint_dir`) is looked in first; otherwise the only job folder that holds
    checkpoints (several are ambiguous: :class:`CheckpointPathError` names them).
    Directories of saves still in progress or interrupted (``.step-*.tmp``) are never complete.
    """
    root = os.fspath(root)
    if not os.path.exists(root):
        return None
    if not os.path.isdir(root):
        raise NotADirectoryError(f"checkpoint root {root!r} exists but is not a directory; "
                                 "pass the directory the checkpoints are saved in")
    if job:
        mine = job_checkpoint_dir(root, job)
        found = _complete_checkpoints(mine) if os.path.isdir(mine) else []
        if found:
            return found[-1][1], found[-1][0]
    found = _complete_checkpoints(root)
    if not found:
        jobs = sorted((e.name, c) for e in os.scandir(root)
                      if e.is_dir() and not e.name.startswith(".")
                      and not _STEP_DIR.fullmatch(e.name) and (c := _complete_checkpoints(e.path)))
        if len(jobs) > 1:
            raise CheckpointPathError(
                f"checkpoint root {root!r} holds the checkpoints of several jobs "
                f"({', '.join(n for n, _ in jobs)}): name one, e.g. "
                f"{os.path.join(root, jobs[0][0])!r}")
        found = jobs[0][1] if jobs else []
    if not found:
        return None
    step, path = found[-1]
    return path, step


def _prune(root: str, current: int, keep: int) -> None:
    """Keep the ``keep`` newest checkpoints up to ``current``; drop everything else.

    Checkpoints of steps after ``current`` can only exist if the job was resumed from an earlier
    one: they belong to the abandoned run, and a later restart must not jump back into it.
    Hidden ``.step-*`` directories are interrupted saves or replaced checkpoints (no save is in
    flight while the lowest rank prunes: saves are collective and one at a time).
    """
    complete = _complete_checkpoints(root)
    older = [p for s, p in complete if s <= current]
    doomed = [p for s, p in complete if s > current] + older[:max(0, len(older) - keep)]
    doomed += [e.path for e in os.scandir(root) if e.name.startswith(".step-") and e.is_dir()]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(state: LocalState, model, root, *, group=None, group_rank: int | None = None,
                    group_size: int | None = None, keep: int = 2, hf_source: str = "",
                    job: str = "") -> SavedCheckpoint:
    """Save the job's state at ``state.step`` as ``root/<job>/step-00000042`` (with ``job``,
    the job's own folder, :func:`job_checkpoint_dir`) or ``root/step-00000042``; collective.

    Every rank of the layout calls it at the same step boundary with its own ``state``.
    ``group`` is the layout's whole world (``ParallelGroups.world``; None for one rank), any
    process-group object (a ``ProcessGroupGloo`` built directly works; no default process group
    is needed). ``group_rank`` / ``group_size``, if given, are checked against the group. ``root``
    must be storage every rank sees (one shared directory); the folder the steps go in (and
    that ``keep`` prunes) belongs to this job alone, which ``job`` ensures on a shared root.
    Returns when the checkpoint is complete and in place on every rank; raises
    :class:`CheckpointError` on every rank if any rank failed, leaving no ``step-*`` directory.
    ``hf_source``: the Hugging Face directory the model came from, for the model record.
    """
    from torch.distributed.checkpoint import FileSystemWriter

    from .dcp_planners import PieceSavePlanner

    t0 = time.perf_counter()
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r}: must be an integer >= 1 (the checkpoints to retain)")
    rank, size = (0, 1) if group is None else (group.rank(), group.size())
    if group is None and group_size not in (None, 1):
        raise ValueError(f"group_size={group_size} but group is None: pass the layout's world "
                         "group (ParallelGroups.world) when more than one rank saves")
    if (group_rank is not None and group_rank != rank) or (group_size is not None
                                                           and group_size != size):
        raise ValueError(f"group_rank={group_rank}, group_size={group_size} do not match the "
                         f"group (rank {rank} of {size})")
    root = job_checkpoint_dir(root, job) if job else os.fspath(root)
    name = checkpoint_name(state.step)
    final, tmp = os.path.join(root, name), os.path.join(root, f".{name}.tmp")
    coordinator = rank == 0
    what = f"of step {state.step}"

    def prepare():
        if coordinator:
            if os.path.exists(root) and not os.path.isdir(root):
                raise NotADirectoryError(f"checkpoint root {root!r} is not a directory")
            shutil.rmtree(tmp, ignore_errors=True)   # an interrupted save of this step
            os.makedirs(tmp)
        rng = state.rng.get("cpu")
        return state.step, state.data_position, None if rng is None else rng.numel()

    # Also the barrier that keeps every rank from writing before the directory is fresh.
    seen = _phase(group, f"{what} (prepare)", prepare)
    if len(set(seen)) > 1:
        raise CheckpointError("ranks disagree on what to save; (step, data position, RNG bytes) "
                              "by rank: " + ", ".join(f"{r}: {v}" for r, v in enumerate(seen)))

    chunks, sizes = _state_chunks(state, model, rank, size)
    planner = PieceSavePlanner(chunks, sizes)
    writer = FileSystemWriter(tmp)

    def local_plan():
        planner.set_up_planner({}, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
        writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    plans = _phase(group, f"{what} (local plan)", local_plan, keep=lambda r: coordinator)
    metadata = None

    def global_plan():
        nonlocal metadata
        if not coordinator:
            return None
        global_plans, metadata = planner.create_global_plan(plans)
        return writer.prepare_global_plan(global_plans)

    central = _phase(group, f"{what} (global plan)", global_plan, keep=lambda r: r == 0)[0][rank]

    def write():
        final_plan = planner.finish_plan(central)
        future = writer.write_data(final_plan, planner)
        future.wait()
        return future.value(), sorted(os.listdir(tmp))

    wrote = _phase(group, f"{what} (write)", write, keep=lambda r: coordinator)

    def commit():
        if not coordinator:
            return
        here = set(os.listdir(tmp))
        for r, (_, seen) in enumerate(wrote):
            if not here.issuperset(seen):
                raise FileNotFoundError(
                    f"rank {r} wrote {sorted(set(seen) - here)} into {tmp}, which rank 0 does "
                    "not see there: the checkpoint root must be storage every rank shares")
        write_model_record(tmp, model, hf_source)
        writer.finish(metadata, [results for results, _ in wrote])   # .metadata: all there
        if os.path.exists(final):                    # the same step saved before: replace it
            aside = os.path.join(root, f".{name}.replaced")
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(final, aside)
        os.rename(tmp, final)
        _fsync_dir(root)
        try:
            _prune(root, state.step, keep)
        except OSError as e:  # the new checkpoint is in place; stale ones only cost space
            warnings.warn(f"checkpoint {final}: pruning {root} failed: {e}")

    _phase(group, f"{what} (commit)", commit)
    nbytes = sum(r.size_in_bytes for r in wrote[rank][0])
    return SavedCheckpoint(final, state.step, time.perf_counter() - t0, nbytes)
