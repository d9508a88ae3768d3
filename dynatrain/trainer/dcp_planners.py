"""DCP's interfaces over our pieces, made safe to read: the one place that subclasses DCP.

:mod:`.checkpoint` explains why a checkpoint is written through DCP's planner protocol. The
planners live apart from it so that importing :mod:`.checkpoint` (every worker does, for its
periodic checkpoint) does not import ``torch.distributed.checkpoint``, which pulls in DTensor,
sympy and the elastic agent: about 1.4 s of every worker process's start, paid only by the
processes that actually write or read a checkpoint.

A checkpoint's files come from whoever can write the volume, so reading one must not run code.
DCP's ``FileSystemReader.read_metadata`` calls ``pickle.load`` on ``.metadata`` (DCP's format
is a pickle); :class:`SafeFileSystemReader` reads it with an unpickler that rebuilds only the
classes DCP's metadata is made of (:data:`METADATA_GLOBALS`) and refuses any other global,
naming the file and the global, then checks that every data file it names lies inside the
checkpoint directory. Tensor data DCP reads with ``torch.load(weights_only=True)``; a
``BytesIO`` item it would ``torch.load(weights_only=False)``, so :class:`PieceLoadPlanner`
refuses those (we never write any: the scalars and the RNG states are tensors).

The save plans the ranks exchange travel as JSON, not pickles: :func:`encode_plan` writes plain
values and DCP's plan dataclasses by an allowlisted name (:data:`PLAN_CLASSES`), and
:func:`decode_plan` rebuilds only those.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pathlib
import pickle
import warnings

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .checkpoint_errors import CheckpointError, UnsafeCheckpointError


class PieceSavePlanner(DefaultSavePlanner):
    """Writes one chunk per piece: ``chunks`` fqn -> [(global offsets, tensor)]."""

    def __init__(self, chunks: dict[str, list[tuple[tuple, torch.Tensor]]],
                 sizes: dict[str, torch.Size]):
        super().__init__()
        self.chunks, self.sizes = chunks, sizes
        self._lookup = {(f, tuple(o)): t for f, cs in chunks.items() for o, t in cs}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        self.state_dict, self.is_coordinator = state_dict, is_coordinator
        self.mappings = {}  # DefaultSavePlanner's flattening map: nothing is flattened here

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, chunks in self.chunks.items():
            for offsets, t in chunks:
                items.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.size()),
                        properties=TensorProperties.create_from_tensor(t),
                        size=self.sizes[fqn])))
        self.plan = SavePlan(items, planner_data={})
        return self.plan

    def resolve_data(self, write_item):
        return self._lookup[(write_item.index.fqn, tuple(write_item.index.offset))]


MAX_RNG_STATE_BYTES = 1 << 20
"""A CPU generator's state is about 5 KB; a checkpoint claiming more than this is not ours."""


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads ``chunks`` (all required) and, when the checkpoint has one, RNG row ``rng_row``
    of the tensor saved as ``rng_key``."""

    def __init__(self, chunks: dict[str, list[tuple[tuple, torch.Tensor]]], *,
                 rng_key: str, rng_row: int | None = None):
        super().__init__()
        self.chunks, self.rng_key, self.rng_row = chunks, rng_key, rng_row

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        if self.rng_row is not None and self.rng_key in saved:
            # Its size is only known from the checkpoint: allocate it now. Older checkpoints
            # have no RNG and load without one.
            rows, nbytes = saved[self.rng_key].size
            if not (0 < rows and 0 < nbytes <= MAX_RNG_STATE_BYTES):
                # The size comes from the file: bound what it makes us allocate.
                raise CheckpointError(f"checkpoint RNG states of {rows} x {nbytes} bytes: "
                                      f"expected at least one row of 1..{MAX_RNG_STATE_BYTES} "
                                      "bytes")
            self.chunks[self.rng_key] = [((self.rng_row % rows, 0),
                                  torch.empty((1, nbytes), dtype=torch.uint8))]
        requests = []
        for fqn, chunks in self.chunks.items():
            if fqn not in saved:
                raise KeyError(f"checkpoint has no {fqn}")
            if not isinstance(saved[fqn], TensorStorageMetadata):
                raise UnsafeCheckpointError(f"checkpoint item {fqn!r} is "
                                            f"{type(saved[fqn]).__name__}, not a tensor: only "
                                            "tensors are read from a checkpoint")
            local = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()) for o, t in chunks]
            requests += create_read_items_for_chunk_list(fqn, saved[fqn], local)
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.chunks[index.fqn][index.index][1]

    def load_bytes(self, read_item, value) -> None:
        # DCP's default would torch.load(weights_only=False) the item: code, not data. We never
        # write one, and the plan above asks for tensors only; this is the last line.
        raise UnsafeCheckpointError(f"checkpoint item {read_item.dest_index.fqn!r} is pickled "
                                    "bytes: refused (only tensors are read from a checkpoint)")


# -- reading DCP's .metadata without running code ----------------------------------------------

def _dtype_names() -> frozenset[str]:
    return frozenset(n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype))


METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}) | _dtype_names(),
    "torch.serialization": frozenset({"_get_layout"}),   # layout by name, e.g. "torch.strided"
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),   # StorageMeta.checkpoint_id
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset"}),
}
"""The globals a ``.metadata`` may name (module -> names): the classes DCP's ``Metadata`` of our
checkpoints is built from, found by unpickling real ones (``torch.Size``, every ``torch``
dtype, DCP's metadata dataclasses and its memory-format enum, ``_StorageInfo``, the layout by
name, the path DCP records as the checkpoint id) and a few containers older DCP versions used.
Each only builds a value; none runs anything else."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        if name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.source}: refused to unpickle global {module}.{name}: a checkpoint's metadata "
            "may only hold DCP's metadata classes, torch.Size and torch dtypes; this file was "
            "not written by DCP (or was altered), and loading it could run code")

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self.source}: refused a persistent id in the metadata "
                                    "(DCP writes none)")


def read_metadata_file(path) -> dcp_md.Metadata:
    """DCP's ``Metadata`` from the ``.metadata`` file ``path``, rebuilt from
    :data:`METADATA_GLOBALS` only; :class:`UnsafeCheckpointError` names any other global."""
    source = os.fspath(path)
    with open(source, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f, source).load()
        except UnsafeCheckpointError:
            raise
        except Exception as e:   # truncated, garbage, wrong protocol: not a usable checkpoint
            raise CheckpointError(f"{source} is not DCP metadata: {type(e).__name__}: {e}") \
                from e
    if not isinstance(metadata, dcp_md.Metadata):
        raise CheckpointError(f"{source} holds a {type(metadata).__name__}, not DCP's Metadata")
    _check_storage(metadata, source)
    return metadata


def _check_storage(metadata: dcp_md.Metadata, source: str) -> None:
    """Every data file the metadata names is a plain file name in the checkpoint directory, with
    no stream transforms (we write none): nothing outside the checkpoint is read."""
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(f"{source}: storage_data is a {type(storage).__name__}, not a dict")
    for index, info in storage.items():
        if not isinstance(info, dcp_fs._StorageInfo):
            raise CheckpointError(f"{source}: the storage of {index} is a "
                                  f"{type(info).__name__}, not DCP's _StorageInfo")
        name = info.relative_path
        if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
                or "\\" in name or "\x00" in name):
            raise UnsafeCheckpointError(f"{source}: data file {name!r} (for {index.fqn!r}) is not "
                                        "a file name inside the checkpoint directory")
        if info.transform_descriptors:
            raise UnsafeCheckpointError(f"{source}: data for {index.fqn!r} has stream "
                                        f"transforms {list(info.transform_descriptors)!r}; "
                                        "our checkpoints have none")


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with :func:`read_metadata_file` in place of ``pickle.load``;
    ``metadata``: the checkpoint's metadata, read already (:func:`load_pieces` reads it first,
    so that a refusal is raised as itself rather than inside DCP's fallback to per-rank
    metadata files, which are read the same safe way)."""

    def __init__(self, path, metadata: dcp_md.Metadata | None = None):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> dcp_md.Metadata:
        rank = kwargs.get("rank")
        metadata = (self._metadata if rank is None and self._metadata is not None
                    else read_metadata_file(self._get_metadata_path(rank)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_pieces(path, planner: PieceLoadPlanner) -> None:
    """DCP's load of checkpoint ``path`` into ``planner``'s pieces, in this process only, through
    :class:`SafeFileSystemReader`. DCP reports any failure as a ``CheckpointException`` (a
    ``BaseException`` that ``except Exception`` does not catch); ours surface as themselves
    (:class:`UnsafeCheckpointError` naming the file and what was refused), others as one
    :class:`CheckpointError` naming the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = os.fspath(path)
    metadata = read_metadata_file(os.path.join(path, dcp_fs._metadata_fn))
    try:
        with warnings.catch_warnings():  # a single-process load is exactly what we ask for
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a "
                                    "single")
            dcp.load({}, checkpoint_id=path, storage_reader=SafeFileSystemReader(path, metadata),
                     planner=planner, no_dist=True)
    except CheckpointException as e:
        errors = [err for err, _ in e.failures.values()]
        ours = next((err for err in errors if isinstance(err, CheckpointError)), None)
        if ours is not None:
            raise ours from None
        raise CheckpointError(f"loading checkpoint {path} failed: " + "; ".join(
            f"{type(err).__name__}: {err}" for err in errors)) from errors[0] if errors else e


# -- the plans the ranks exchange, as JSON ----------------------------------------------------

PLAN_CLASSES: dict[str, type] = {cls.__name__: cls for cls in (
    dcp_planner.SavePlan, dcp_planner.WriteItem, dcp_planner.TensorWriteData,
    dcp_planner.BytesIOWriteData, dcp_planner.WriteItemType, dcp_storage.WriteResult,
    dcp_md.MetadataIndex, dcp_md.ChunkStorageMetadata, dcp_md.TensorProperties,
    dcp_md.TensorStorageMetadata, dcp_md.BytesStorageMetadata, dcp_md.StorageMeta,
    dcp_md.Metadata, dcp_fs._StorageInfo, dcp_fs._StoragePrefix)}
"""The dataclasses and enums :func:`decode_plan` rebuilds, by class name: what a save's phases
exchange (local and global ``SavePlan`` s, ``WriteResult`` s) and DCP's ``Metadata``."""
_TORCH_ENUMS = (torch.dtype, torch.layout, torch.memory_format)
_FIELD_ORDER: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls))
    for cls in PLAN_CLASSES.values() if dataclasses.is_dataclass(cls)}
"""Each plan dataclass's fields (``dataclasses.fields`` per object was a fifth of encoding)."""


def _encode(obj):
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Size):                 # a tuple subclass: before tuple
        return {"$size": [int(v) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v) for v in obj]
    if isinstance(obj, tuple):
        return {"$tuple": [_encode(v) for v in obj]}
    if isinstance(obj, dict):
        return {"$dict": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if isinstance(obj, _TORCH_ENUMS):
        return {"$torch": str(obj).removeprefix("torch.")}
    if isinstance(obj, pathlib.PurePath):
        return {"$path": str(obj)}
    cls = type(obj)
    if PLAN_CLASSES.get(cls.__name__) is cls:
        if isinstance(obj, enum.Enum):
            return {"$enum": cls.__name__, "name": obj.name}
        return {"$class": cls.__name__,
                "fields": {name: _encode(getattr(obj, name)) for name in _FIELD_ORDER[cls]}}
    raise TypeError(f"cannot encode a {cls.__module__}.{cls.__qualname__} for the ranks' plan "
                    f"exchange: only plain values and {', '.join(sorted(PLAN_CLASSES))}")


class _Fields(dict):
    """A JSON object without a tag: valid only as the ``fields`` of a ``$class``."""


_FIELD_NAMES = {cls: frozenset(names) for cls, names in _FIELD_ORDER.items()}


class _Decoder:
    """One :func:`decode_plan`: ``json.loads`` calls :meth:`hook` on every object, innermost
    first (in C, as it parses), and the hook rebuilds the tagged values of :func:`_encode`.

    A save's plans are thousands of small objects (gpt-tiny on four ranks: ~470 KB of JSON
    for one checkpoint's exchanges, all of them); a recursive walk in Python over the parsed
    JSON took 28.6 ms for that, letting the parser drive takes 13.8 ms. An untagged object
    becomes a :class:`_Fields`, which only a ``$class`` may take; counting them made and taken
    keeps any other untagged object an error, as before."""

    def __init__(self) -> None:
        self.untagged = 0

    def hook(self, obj: dict):
        if len(obj) == 1:
            (tag, value), = obj.items()
            if tag == "$size":
                return torch.Size([int(v) for v in _list(value)])
            if tag == "$tuple":
                return tuple(_list(value))
            if tag == "$dict":
                return {k: v for k, v in _list(value)}
            if tag == "$torch":
                found = getattr(torch, str(value), None)
                if not isinstance(found, _TORCH_ENUMS):
                    raise ValueError(f"torch.{value} is not a dtype, layout or memory format")
                return found
            if tag == "$path":
                return pathlib.Path(str(value))
        elif len(obj) == 2 and ("$class" in obj or "$enum" in obj):
            name = obj.get("$enum") or obj.get("$class")
            cls = PLAN_CLASSES.get(name)
            if cls is None:
                raise ValueError(f"class {name!r} is not one a plan may hold "
                                 f"({', '.join(sorted(PLAN_CLASSES))})")
            if "$enum" in obj:
                return cls[str(obj["name"])]
            given = obj["fields"]
            if type(given) is not _Fields or not _FIELD_NAMES[cls].issuperset(given):
                raise ValueError(f"{name}: fields {str(given)[:200]} are not its fields "
                                 f"{sorted(_FIELD_NAMES[cls])}")
            self.untagged -= 1
            return cls(**given)
        self.untagged += 1
        return _Fields(obj)


def _list(value) -> list:
    if not isinstance(value, list):
        raise ValueError(f"expected a list, found {str(value)[:200]}")
    return value


def encode_plan(obj) -> bytes:
    """``obj`` (plain values, tuples, dicts with any such keys, DCP's plan and metadata
    dataclasses) as UTF-8 JSON; :func:`decode_plan` gives back an equal value."""
    return json.dumps(_encode(obj), separators=(",", ":")).encode()


def decode_plan(data: bytes):
    """The value :func:`encode_plan` wrote; ``ValueError`` for anything else."""
    decoder = _Decoder()
    try:
        value = json.loads(bytes(data).decode(), object_hook=decoder.hook)
        if decoder.untagged:
            raise ValueError(f"{decoder.untagged} object(s) without a tag outside a $class")
        return value
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"not an encoded plan ({type(e).__name__}: {e})") from e
