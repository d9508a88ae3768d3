"""Reading a Hugging Face checkpoint box by box, so a rank loads only its own shards.

:class:`HFReader` opens a checkpoint directory (``model.safetensors``, or the shards an
``model.safetensors.index.json`` names) and serves :meth:`HFReader.read_box`: any box of any
VPS tensor, read with safetensors' ``get_slice`` so that only that region's bytes come off
disk. Where the VPS tensor lives among the HF tensors (split or fused projections, one tensor
per expert or stacked experts) is :mod:`dynatrain.vps.hf`'s rule; the reader picks the first
form the checkpoint holds. :func:`read_local` fills one rank's local tensor of one (tensor,
state) from the mapping's pieces, which is how the trainer starts from a checkpoint: no rank
ever holds more of the model than the mapping gives it.

Files are opened once per reader and kept open (safetensors maps them; a slice costs a copy of
its bytes only); :meth:`HFReader.close` lets them go.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from dynatrain.vps.boxes import Box, box_extents
from dynatrain.vps.hf import (INDEX_FILE, SINGLE_FILE, HFCheckpointError, hf_arch,
                              model_from_hf_config, read_hf_config)
from dynatrain.vps.hfnames import HFSource, hf_sources
from dynatrain.vps.model import TensorSpec

from .weights import TORCH_DTYPES


class HFReader:
    """Sliced reads of one Hugging Face checkpoint directory.

    ``bytes_read`` counts the bytes every read took from the files (in the files' dtype), so
    callers and tests can see that a rank read its share and no more.
    """

    def __init__(self, directory):
        self.dir = Path(directory)
        config = read_hf_config(self.dir)
        self.arch = hf_arch(config, source=str(self.dir / "config.json"))
        self.model = model_from_hf_config(config, name=self.dir.name,
                                          source=str(self.dir / "config.json"))
        self._shapes = {t.name: t.shape for t in self.model.tensors}
        self._files: dict[str, object] = {}
        self.weight_map = self._weight_map()
        self._sources: dict[str, HFSource] = {}
        self.bytes_read = 0

    def _weight_map(self) -> dict[str, str]:
        """HF tensor name -> the file (name within the directory) that holds it."""
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                data = json.loads(index.read_text())
                weight_map = data["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise HFCheckpointError(f"{index} is not a safetensors index (a JSON object "
                                        f"with a 'weight_map'): {e}") from None
            missing = sorted({f for f in weight_map.values() if not (self.dir / f).is_file()})
            if missing:
                raise HFCheckpointError(f"{index} names shard file(s) {', '.join(missing)} "
                                        f"that are not in {self.dir}")
            return dict(weight_map)
        single = self.dir / SINGLE_FILE
        if single.is_file():
            return {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}
        others = sorted(p.name for p in self.dir.glob("*.bin"))
        hint = f" (found {', '.join(others)}: PyTorch pickles are not read; convert them to " \
               "safetensors)" if others else ""
        raise HFCheckpointError(f"{self.dir} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")

    def _open(self, file: str):
        handle = self._files.get(file)
        if handle is None:
            handle = self._files[file] = safe_open(str(self.dir / file), framework="pt")
        return handle

    def close(self) -> None:
        self._files.clear()

    def __enter__(self) -> "HFReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def source(self, tensor: TensorSpec) -> HFSource:
        """Where ``tensor`` lives in this checkpoint (checked against the files' shapes)."""
        found = self._sources.get(tensor.name)
        if found is not None:
            return found
        expected = self._shapes.get(tensor.name)
        if expected is None or tuple(expected) != tuple(tensor.shape):
            raise HFCheckpointError(
                f"{tensor.name} {tuple(tensor.shape)} is not a tensor of {self.dir}'s model "
                f"(its config.json gives {'none' if expected is None else tuple(expected)})")
        candidates = hf_sources(self.arch, self.model, tensor.name)
        for src in candidates:
            if all(n in self.weight_map for n in src.names):
                break
        else:
            tried = " or ".join(f"{c.names[0]}" + (f" (one per expert, {len(c.names)})"
                                                    if c.per_expert else "")
                                for c in candidates)
            where = INDEX_FILE if (self.dir / INDEX_FILE).is_file() else SINGLE_FILE
            raise HFCheckpointError(f"{self.dir}: no tensor holds {tensor.name}: looked for "
                                    f"{tried} in {where}")
        for name in src.names:
            file = self.weight_map[name]
            try:
                shape = tuple(self._open(file).get_slice(name).get_shape())
            except Exception as e:  # an index that names a tensor its file lacks, say
                raise HFCheckpointError(f"{name} in {self.dir / file}: cannot be read ({e})") \
                    from None
            if shape != tuple(src.hf_shape):
                raise HFCheckpointError(f"{name} in {self.dir / file} has shape {shape}; "
                                        f"{self.arch.architecture} with this config.json needs "
                                        f"{tuple(src.hf_shape)} (for {tensor.name})")
        self._sources[tensor.name] = src
        return src

    def read_box(self, tensor: TensorSpec, box: Box, dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
        """``box`` of the VPS tensor, read from the files alone, as ``dtype`` (default: the
        tensor's own dtype); shape ``box_extents(box)``."""
        src = self.source(tensor)
        parts = []
        for name, hf_box in src.hf_boxes(box):
            part = self._open(self.weight_map[name]).get_slice(name)[
                tuple(slice(a, b) for a, b in hf_box)]
            self.bytes_read += part.numel() * part.element_size()
            parts.append(part)
        out = torch.stack(parts) if src.per_expert else parts[0]
        out = out.to(dtype or TORCH_DTYPES[tensor.dtype]).contiguous()
        if tuple(out.shape) != box_extents(box):   # a rule's arithmetic gone wrong, never data
            raise AssertionError(f"{tensor.name} box {box}: read {tuple(out.shape)}")
        return out


def read_local(reader: HFReader, shard, dtype: torch.dtype) -> torch.Tensor:
    """One rank's local tensor of one (tensor, state) (a mapping ``RankShard``): every piece
    read from the checkpoint into its place, as ``dtype``."""
    local = torch.empty(shard.local_shape, dtype=dtype)
    for piece in shard.pieces:
        dst = local[tuple(slice(a, b) for a, b in piece.local)]
        dst.copy_(reader.read_box(shard.tensor, piece.box, dtype).reshape(dst.shape))
    return local
