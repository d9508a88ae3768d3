"""DCP's planner interface over our pieces: the one place that subclasses DCP's planners.

:mod:`.checkpoint` explains why a checkpoint is written through DCP's planner protocol. The
planners live apart from it so that importing :mod:`.checkpoint` (every worker does, for its
periodic checkpoint) does not import ``torch.distributed.checkpoint``, which pulls in DTensor,
sympy and the elastic agent: about 1.4 s of every worker process's start, paid only by the
processes that actually write or read a checkpoint.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


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
            self.chunks[self.rng_key] = [((self.rng_row % rows, 0),
                                  torch.empty((1, nbytes), dtype=torch.uint8))]
        requests = []
        for fqn, chunks in self.chunks.items():
            if fqn not in saved:
                raise KeyError(f"checkpoint has no {fqn}")
            local = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()) for o, t in chunks]
            requests += create_read_items_for_chunk_list(fqn, saved[fqn], local)
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.chunks[index.fqn][index.index][1]
