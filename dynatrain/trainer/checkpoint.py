"""PyTorch Distributed Checkpoint (DCP) of the training state, described by the mapping's pieces.

Our shards are lists of boxes (a ZeRO flat range of a TP shard is a few of them), which neither
DTensor placements nor ShardedTensor (it insists on a full, non-overlapping global layout at
every rank) can express. DCP's planner interface can: the save planner writes one chunk per
piece (DCP itself drops the duplicates that replicas write), and the load planner asks DCP's own
``create_read_items_for_chunk_list`` which saved chunks cover each new piece. So resharding,
the part a live switch is checked against, is entirely DCP's. This is also the checkpoint-and-
restart path the live switch is compared with, and the last-resort checkpoint.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dynatrain.vps.mapping import rank_shards
from dynatrain.vps.transition import piece_view

from .trainer import LocalState
from .weights import TORCH_DTYPES

_SCALARS = "__dynatrain_scalars__"


def _fqn(name: str, state: str) -> str:
    return f"{name}/{state}"


class _PieceSavePlanner(DefaultSavePlanner):
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


class _PieceLoadPlanner(DefaultLoadPlanner):
    def __init__(self, chunks: dict[str, list[tuple[tuple, torch.Tensor]]]):
        super().__init__()
        self.chunks = chunks

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for fqn, chunks in self.chunks.items():
            if fqn not in self.metadata.state_dict_metadata:
                raise KeyError(f"checkpoint has no {fqn}")
            local = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()) for o, t in chunks]
            requests += create_read_items_for_chunk_list(
                fqn, self.metadata.state_dict_metadata[fqn], local)
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.chunks[index.fqn][index.index][1]


def _chunks(tensors: dict) -> dict[str, list[tuple[tuple, torch.Tensor]]]:
    """(name, state) -> (local tensor, pieces)  ==>  fqn -> [(offsets, piece view)]."""
    out = {}
    for (name, state), (local, pieces) in tensors.items():
        out[_fqn(name, state)] = [(tuple(a for a, _ in p.box), piece_view(local, p))
                                  for p in pieces]
    return out


def save_state(state: LocalState, model, path: str, process_group=None) -> None:
    """Write this rank's state (collective over ``process_group``: every old rank calls it)."""
    chunks = _chunks(state.tensors)
    specs = {t.name: t for t in model.tensors}
    sizes = {_fqn(n, s): torch.Size(specs[n].shape) for n, s in state.tensors}
    scalars = torch.tensor([state.step, state.data_position], dtype=torch.int64)
    chunks[_SCALARS] = [((0,), scalars)]
    sizes[_SCALARS] = torch.Size([2])
    dcp.save({}, checkpoint_id=path, planner=_PieceSavePlanner(chunks, sizes),
             process_group=process_group)


def load_state(bound, rank: int, path: str, device=None) -> LocalState:
    """This rank's state under ``bound``'s layout, resharded by DCP from the checkpoint."""
    tensors = {}
    for rs in rank_shards(bound, rank):
        dtype = TORCH_DTYPES[rs.tensor.dtype] if rs.state == "param" else torch.float32
        tensors[(rs.tensor.name, rs.state)] = (torch.empty(rs.local_shape, dtype=dtype),
                                               rs.pieces)
    chunks = _chunks(tensors)
    scalars = torch.zeros(2, dtype=torch.int64)
    chunks[_SCALARS] = [((0,), scalars)]
    with warnings.catch_warnings():  # a single-process load is exactly what we ask for
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        dcp.load({}, checkpoint_id=path, planner=_PieceLoadPlanner(chunks), no_dist=True)
    if device is not None:
        tensors = {k: (t.to(device), p) for k, (t, p) in tensors.items()}
    return LocalState(tensors, int(scalars[0]), int(scalars[1]))
