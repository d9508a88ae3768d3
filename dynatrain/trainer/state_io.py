"""A rank's training state as bytes without pickle: safetensors for the tensors, JSON for the rest.

A :class:`~.trainer.LocalState` crosses a process boundary in a few places: the ranks of
``train`` hand their final state to the parent, ``bench switch`` workers hand theirs to the
bench, and workers dump the state a recovery restored for ``bench chaos`` to compare. Each
used to be ``torch.save`` of the whole object read back with ``torch.load(weights_only=False)``,
an unpickling that runs whatever the bytes say. Here the tensors are a safetensors payload
(a JSON header and raw data: nothing in it is executed) and everything else -- each tensor's
key and pieces (boxes of ints), the step, the data position and any caller's extra fields --
is JSON in that payload's ``__metadata__``. Reading checks the format tag and the shapes of the
pieces, so a truncated or foreign file is a :class:`StateFormatError` naming the source.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dynatrain.vps.mapping import Piece

from .trainer import LocalState

FORMAT = "dynatrain-local-state/1"
_KEY = "dynatrain"


class StateFormatError(ValueError):
    """Bytes or a file that are not a state :func:`state_to_bytes` wrote; names the source."""


def _box(value) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in value)


def state_to_bytes(state: LocalState, **extra) -> bytes:
    """``state`` (tensors copied to the CPU) as safetensors bytes; ``extra``: JSON-able fields
    returned beside the state by :func:`state_from_bytes` (a dump's layout, say)."""
    tensors, entries, seen = {}, [], set()
    for i, ((name, kind), (t, pieces)) in enumerate(state.tensors.items()):
        t = t.detach().cpu().contiguous()
        if t.untyped_storage().data_ptr() in seen and t.numel():
            t = t.clone()            # safetensors refuses tensors that share memory
        seen.add(t.untyped_storage().data_ptr())
        tensors[f"t{i}"] = t
        entries.append([name, kind, [[list(map(list, p.box)), list(map(list, p.local))]
                                     for p in pieces]])
    for k, t in state.rng.items():
        tensors[f"rng/{k}"] = t.detach().cpu().contiguous().clone()
    meta = {"format": FORMAT, "tensors": entries, "step": int(state.step),
            "data_position": int(state.data_position), "rng": sorted(state.rng),
            "extra": extra}
    return st_save(tensors, metadata={_KEY: json.dumps(meta)})


def _header(data: bytes, source: str) -> dict:
    if len(data) < 8:
        raise StateFormatError(f"{source}: {len(data)} bytes is not a saved state")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise StateFormatError(f"{source}: header of {n} bytes in {len(data)} bytes: truncated "
                               "or not a saved state")
    try:
        meta = json.loads(json.loads(bytes(data[8:8 + n]))["__metadata__"][_KEY])
    except (ValueError, KeyError, TypeError) as e:
        raise StateFormatError(f"{source}: not a saved state ({type(e).__name__}: {e})") from None
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != FORMAT:
        raise StateFormatError(f"{source}: format {found!r}, expected {FORMAT!r}")
    return meta


def state_from_bytes(data: bytes, source: str = "state") -> tuple[LocalState, dict]:
    """(the state, the ``extra`` fields) from bytes :func:`state_to_bytes` wrote."""
    meta = _header(data, source)
    try:
        tensors = st_load(bytes(data))
        out = {}
        for i, (name, kind, pieces) in enumerate(meta["tensors"]):
            out[(str(name), str(kind))] = (tensors[f"t{i}"],
                                           tuple(Piece(_box(b), _box(loc)) for b, loc in pieces))
        rng = {str(k): tensors[f"rng/{k}"] for k in meta["rng"]}
        state = LocalState(out, int(meta["step"]), int(meta["data_position"]), rng)
    except (KeyError, ValueError, TypeError) as e:
        raise StateFormatError(f"{source}: not a saved state ({type(e).__name__}: {e})") from None
    except Exception as e:   # safetensors' own error for a damaged payload
        raise StateFormatError(f"{source}: damaged state ({type(e).__name__}: {e})") from None
    extra = meta.get("extra")
    return state, extra if isinstance(extra, dict) else {}


def write_state(path, state: LocalState, **extra) -> None:
    """:func:`state_to_bytes` into ``path``, atomically (a reader sees all of it or nothing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(state_to_bytes(state, **extra))
    os.replace(tmp, path)


def read_state(path) -> tuple[LocalState, dict]:
    """(the state, the ``extra`` fields) of a file :func:`write_state` wrote."""
    return state_from_bytes(Path(path).read_bytes(), source=os.fspath(path))
