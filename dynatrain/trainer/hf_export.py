"""Hugging Face checkpoints out: a DCP checkpoint of the training state, written as
``config.json`` plus sharded safetensors that ``transformers`` loads unchanged.

The source is a checkpoint of :mod:`.checkpoint` (the elastic job's periodic ``step-*``
directories, or one ``train --save-hf`` writes after its last step), whatever layout saved it:
DCP's own resharding reads each output tensor's box of the working parameters (state
``param``), one output shard at a time, so the exporting process holds one shard (at most
``max_shard_bytes``, or one tensor larger than that), never the model. Names, the split/legacy
forms ``save_pretrained`` writes, and the config come from :mod:`dynatrain.vps.hf`; a model
imported from Hugging Face keeps its original config.json, updated where the spec decides.
Shards are written into a hidden sibling directory that is renamed into place at the end, so
``out`` is either absent or complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from dynatrain.vps.boxes import box_extents, box_numel
from dynatrain.vps.hf import CONFIG, INDEX_FILE, SINGLE_FILE, arch_for, hf_arch, hf_config
from dynatrain.vps.hfnames import export_names
from dynatrain.vps.model import ModelSpec

from .checkpoint import (_METADATA, CheckpointError, CheckpointPathError, _fqn, latest_checkpoint,
                         read_model_record)

DEFAULT_MAX_SHARD = "2GB"
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
              "chat_template.jinja")
"""Files of the source Hugging Face directory that an export copies unchanged."""
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ExportError(ValueError):
    """A checkpoint cannot be exported; the message names the checkpoint and the problem."""


@dataclass(frozen=True)
class ExportResult:
    out: str
    files: tuple[str, ...]
    """The safetensors files written, in order."""
    tensors: int
    bytes: int
    """Bytes of tensor data written (the index's ``total_size``)."""
    seconds: float


def parse_size(text: str | int) -> int:
    """Bytes from ``2GB`` / ``500MB`` / ``1GiB`` / a plain integer (decimal units as
    transformers' ``max_shard_size``)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not m or m.group(2) not in _UNITS:
        raise ExportError(f"size {text!r} is not a size such as 2GB, 500MB, 1GiB or a number of "
                          "bytes")
    size = int(float(m.group(1)) * _UNITS[m.group(2)])
    if size < 1:
        raise ExportError(f"size {text!r} must be at least one byte")
    return size


def resolve_checkpoint(path) -> str:
    """A complete checkpoint directory: ``path`` itself, or the newest ``step-*`` in it (a job's
    folder), or in the only job folder of a checkpoint root (``<root>/<job>/step-*``)."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, _METADATA)):
        return path
    if not os.path.isdir(path):
        raise ExportError(f"checkpoint {path!r} does not exist")
    try:
        found = latest_checkpoint(path)
    except CheckpointPathError as e:      # a root of several jobs' folders
        raise ExportError(str(e)) from None
    if found is None:
        raise ExportError(f"{path!r} is neither a complete checkpoint (no {_METADATA}) nor a "
                          "directory of step-* checkpoints (or of job folders holding them)")
    return found[0]


def _saved_params(path: str, model: ModelSpec) -> torch.dtype:
    """Check the checkpoint holds every parameter of ``model`` in full; their dtype."""
    from .dcp_planners import read_metadata_file

    try:       # never pickle.load: the volume's writers decide what this file holds
        saved = read_metadata_file(os.path.join(path, _METADATA)).state_dict_metadata
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    dtypes, problems = set(), []
    for t in model.tensors:
        md = saved.get(_fqn(t.name, "param"))
        if md is None:
            problems.append(f"no {t.name}")
        elif tuple(md.size) != tuple(t.shape):
            problems.append(f"{t.name} is {tuple(md.size)}, the model says {tuple(t.shape)}")
        else:
            dtypes.add(md.properties.dtype)
    if problems:
        raise ExportError(f"checkpoint {path} does not hold model {model.name!r}: "
                          + "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)"
                                                       if len(problems) > 5 else ""))
    if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPE_NAMES:
        raise ExportError(f"checkpoint {path}: parameters in dtypes {sorted(map(str, dtypes))}; "
                          f"expected one of {', '.join(_DTYPE_NAMES.values())}")
    return dtypes.pop()


def _plan_shards(items: list, max_bytes: int) -> list[list]:
    """Consecutive groups of (hf name, vps name, box, hf shape, bytes), each at most
    ``max_bytes`` unless one tensor alone is larger."""
    shards, current, size = [], [], 0
    for item in items:
        if current and size + item[4] > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(item)
        size += item[4]
    if current:
        shards.append(current)
    return shards


def _load_boxes(path: str, shard: list, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The shard's tensors, each its box of the saved parameters (an expert's box of a stacked
    tensor is that expert's tensor), by one DCP load."""
    from .dcp_planners import PieceLoadPlanner, load_pieces

    chunks: dict[str, list] = {}
    out = {}
    for hf_name, vps_name, box, hf_shape, _ in shard:
        buf = torch.empty(box_extents(box), dtype=dtype)
        chunks.setdefault(_fqn(vps_name, "param"), []).append((tuple(a for a, _ in box), buf))
        out[hf_name] = buf.view(hf_shape)
    try:
        load_pieces(path, PieceLoadPlanner(chunks, rng_key=""))
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    return out


def export_hf(checkpoint, out, *, model: ModelSpec | None = None, base_config: dict | None = None,
              copy_from: str = "", max_shard_size: str | int = DEFAULT_MAX_SHARD,
              progress=None) -> ExportResult:
    """Write the working parameters of ``checkpoint`` as a Hugging Face checkpoint in ``out``.

    ``checkpoint``: a checkpoint directory or a root of ``step-*`` ones (the newest is taken).
    ``model``: the model it holds; default the checkpoint's own record. ``base_config``: the
    config.json to start from (default: the one recorded, for a model imported from Hugging
    Face). ``copy_from``: a Hugging Face directory whose tokenizer and generation files are
    copied along. ``progress(line)`` hears what is being written. ``out`` must not exist or be
    an empty directory.
    """
    t0 = time.perf_counter()
    path = resolve_checkpoint(checkpoint)
    record = read_model_record(path)
    if model is None:
        if record is None:
            raise ExportError(f"checkpoint {path} does not record its model; name it "
                              "(--model: a preset, a spec file or hf:DIR)")
        model = record[0]
    if base_config is None and record is not None and record[0] == model:
        base_config = record[1]
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"output {str(out)!r} exists and is not an empty directory; "
                          "choose a new one")
    max_bytes = parse_size(max_shard_size)

    dtype = _saved_params(path, model)
    model = replace(model, dtype=_DTYPE_NAMES[dtype])  # what was trained is what is written
    arch = hf_arch(base_config) if base_config else arch_for(model)
    config = hf_config(model, base_config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    items = [(hf, vps, box, shape, box_numel(box) * itemsize)
             for hf, vps, box, shape in export_names(arch, model)]
    shards = _plan_shards(items, max_bytes)
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    say = progress or (lambda line: None)
    say(f"exporting {model.name} ({model.num_params:,} params, {_DTYPE_NAMES[dtype]}) from {path} "
        f"as {arch.architecture}: {len(items)} tensors in {len(shards)} file(s)")

    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)          # an interrupted export of the same output
    tmp.mkdir(parents=True)
    try:
        weight_map, total = {}, 0
        for i, (shard, name) in enumerate(zip(shards, names)):
            tensors = _load_boxes(path, shard, dtype)
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
            nbytes = sum(item[4] for item in shard)
            total += nbytes
            weight_map.update({hf: name for hf in tensors})
            say(f"  {name}: {len(tensors)} tensors, {nbytes / 1e6:,.1f} MB "
                f"({i + 1}/{len(shards)})")
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(
                weight_map.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copied = [f for f in SIDE_FILES if copy_from and (Path(copy_from) / f).is_file()]
        for f in copied:
            shutil.copyfile(Path(copy_from) / f, tmp / f)
        if copied:
            say(f"  copied {', '.join(copied)} from {copy_from}")
        if out.exists():
            out.rmdir()                                 # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - t0
    say(f"wrote {out} ({total / 1e6:,.1f} MB in {seconds:.1f} s)")
    return ExportResult(str(out), tuple(names), len(items), total, seconds)
