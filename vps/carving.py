"""Carving new local tensors out of old ones, and giving old tensors' memory back.

**Carving** (CPU; ``TransitionConfig.carve``, on by default): a new local tensor that one
local copy would fill entirely from one contiguous block of this device's own old tensor (a
row block of a replica that becomes a tensor-parallel shard, say) becomes a view of that block
instead: no copy at all. The old tensor's other pages go back to the OS afterwards
(``madvise(MADV_DONTNEED)``, on the freeing thread, after a successful switch), so memory ends
where a copy would have left it. Carving needs the old tensor's memory to be this device's
alone: any other tensor sharing its storage might read the pages given back, so such a tensor
is copied as usual. (On a GPU a copy runs at memory bandwidth and the caching allocator could
not give part of a block back.)

:func:`free_in_background` drops what the switch retired (old tensors, carved ones after
giving back their pages, abandoned groups) on a thread, so that it overlaps the next step
instead of sitting in the pause; :func:`owned` copies a carved tensor out of the allocation it
shares before it is saved.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
from typing import NamedTuple

import torch

from .planner import Plan
from .regions import region_view

_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
CARVING = sys.platform.startswith("linux") and _storage_use_count is not None
"""Whether this platform can carve: it needs madvise to give pages back, and torch's storage
use count to prove an old tensor's memory is unshared."""
_MADV_DONTNEED = 4
_libc = ctypes.CDLL(None, use_errno=True) if CARVING else None
if _libc is not None:
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def carvable(plan: Plan, device: int, new_pieces: dict) -> dict:
    """(tensor name, state) -> the local copy that alone fills that new local tensor of
    ``device`` from its own old tensor (the new tensor is one piece, and the copy's box is that
    piece). Whether the block is contiguous in the old tensor is for :func:`carve` to say."""
    out = {}
    for m in plan.copies:
        if m.dst != device or m.src_owner != device:
            continue
        for name in plan.groups[m.group].names:
            pieces = new_pieces.get((name, m.state))
            if pieces is not None and len(pieces) == 1 and pieces[0].box == m.box:
                out[(name, m.state)] = m
    return out


def carve(old: torch.Tensor, move, shape, dtype) -> torch.Tensor | None:
    """The new local tensor ``move`` fills, as a view of its block of ``old`` (not an autograd
    view: nothing keeps ``old`` itself alive), or None if the block is not contiguous there.
    Works on meta tensors too, to decide before the pause."""
    if old.dtype != dtype:
        return None
    region = region_view(old, move.src_piece, move.box)
    if not region.is_contiguous():
        return None
    return region.reshape(shape).detach()


def carve_views(plan: Plan, device: int, old: dict, new_shapes: dict, new_pieces: dict) -> dict:
    """(tensor name, state) -> the new local tensor carved from ``old`` (this device's old
    local tensors, or meta tensors of their shapes to decide ahead of the pause), for every
    new tensor that :func:`carvable` allows and whose block is contiguous. Callers leave out
    of ``old`` what they adopt, and what must not be carved."""
    out = {}
    for key, m in carvable(plan, device, new_pieces).items():
        t = old.get(key)
        if t is not None and key in new_shapes:
            view = carve(t, m, *new_shapes[key])
            if view is not None:
                out[key] = view
    return out


def unshared(t: torch.Tensor) -> bool:
    """Whether ``t`` is the only tensor using its storage (the count includes the temporary
    storage object this asks through)."""
    return _storage_use_count(t.untyped_storage()._cdata) == 2


class Trim(NamedTuple):
    """An old tensor that was carved: its bytes outside [keep_lo, keep_hi) (addresses) go back
    to the OS, then it is dropped; the carved view keeps the allocation itself alive."""

    tensor: torch.Tensor
    keep_lo: int
    keep_hi: int


def give_back(trim: Trim) -> None:
    """madvise(MADV_DONTNEED) the whole pages of the old tensor's storage outside the kept
    block: they read as zeros afterwards, which nobody reads (:func:`unshared`), and the
    allocation is freed as usual when the carved tensor dies."""
    storage = trim.tensor.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    page = mmap.PAGESIZE
    for lo, hi in ((start, trim.keep_lo), (trim.keep_hi, end)):
        a, b = -(-lo // page) * page, hi // page * page
        if b > a and _libc.madvise(a, b - a, _MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise({a:#x}, {b - a}, MADV_DONTNEED): {os.strerror(err)}")


def owned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it if it shares a larger allocation (a carved tensor does):
    torch.save writes a tensor's whole storage."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()



def free_in_background(objects: list) -> threading.Thread:
    """Drop ``objects`` (the caller's last references) on a daemon thread, one at a time;
    carved old tensors first give back their pages outside the carved block.

    Returning a large CPU tensor's pages to the OS takes about as long as copying it, and
    tearing down a gloo process group some 20 ms; done here, it overlaps the next training
    step, whose torch kernels release the GIL. The list is emptied.
    """
    batch = list(objects)
    objects.clear()

    def run() -> None:
        while batch:
            item = batch.pop()
            if isinstance(item, Trim):
                give_back(item)
            del item
            time.sleep(0)   # let the training thread take the GIL between frees

    thread = threading.Thread(target=run, name="dynatrain-free-old-state", daemon=True)
    thread.start()
    return thread
