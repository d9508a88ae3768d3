"""Host buffers for the redundancy's slots: exact size, pinned once, reused across generations.

A rank's snapshot slots hold its whole local state (22 GiB per rank at llama-7b dp=8 ZeRO-1).
Taken from torch's caching host allocator (``torch.empty(..., pin_memory=True)``) each slot
would be rounded up to the next power of two and never returned to the system (torch
``aten/src/ATen/core/CachingHostAllocator.h``): 32 GiB for 22, kept for the process's life,
and pinned again, seconds per slot, after every switch. This pool instead takes ordinary
(pageable) memory of exactly the size asked for and page-locks it with ``cudaHostRegister``,
the way torch's own DCP stager pins its buffers (``torch/cuda/_pin_memory_utils.py``).

A buffer that a generation gives back stays registered in the pool and is handed to the next
generation that asks for a size it can hold, so pinning is paid once per size, not once per
switch; :meth:`HostBuffers.reserve` does it in Prepare (in the background, while the job
trains) for the slots the new generation will take, so nothing is pinned inside the pause.
:meth:`HostBuffers.trim` returns what no generation will take again, at a quiet point (after
the previous generation's slots are released).

Without CUDA (``pin=False``) the same pool hands out plain CPU buffers: nothing to register,
the reuse is the same. A buffer whose exchange was abandoned mid-flight (gloo may still write
into it) is :meth:`lost <HostBuffers.lose>`: kept referenced and registered, never reused.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch


class PinError(RuntimeError):
    """CUDA refused to page-lock a host buffer."""


_PORTABLE = 1
"""``cudaHostRegisterPortable``: pinned for every CUDA context, not only the calling thread's
current device's (Prepare pins from an agent thread, whose current device may not be the
worker's)."""


def _register(t: torch.Tensor) -> None:
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), _PORTABLE))
    if rc != 0:
        raise PinError(f"cudaHostRegister of {t.numel():,} bytes failed (cudaError {rc}); "
                       "the node may be out of lockable memory (ulimit -l, or the pod's "
                       "memory limit)")


def _unregister(t: torch.Tensor) -> None:
    rc = int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))
    if rc != 0:
        raise PinError(f"cudaHostUnregister of {t.numel():,} bytes failed (cudaError {rc})")


@dataclass(eq=False)                   # compared by identity
class _Block:
    buf: torch.Tensor                  # uint8, exactly the size it was made for
    free: bool = True
    lost: bool = False
    reserved: bool = False             # for the generation being prepared: trim keeps it


@dataclass
class PoolStats:
    """What the pool did, for logs and tests."""

    allocated: int = 0
    """Buffers made (and pinned, when pinning)."""
    reused: int = 0
    """Takes served by a buffer an earlier generation gave back (or :meth:`reserve` made)."""
    freed: int = 0
    """Buffers returned to the system by :meth:`HostBuffers.trim`."""
    pin_seconds: float = 0.0
    """Time spent making and page-locking buffers."""


class HostBuffers:
    """A process's pool of host buffers, pinned when ``pin`` (CUDA devices). Thread-safe:
    Prepare reserves from an agent thread while the training loop takes and gives back."""

    def __init__(self, pin: bool = False):
        self.pin = pin
        self._blocks: list[_Block] = []
        self._lock = threading.Lock()
        self.stats = PoolStats()

    # -- internals --------------------------------------------------------------------------
    def _new(self, nbytes: int, *, reserved: bool = False) -> tuple[_Block, float]:
        """A new buffer, pinned when pinning (lock not needed: seconds at 7B, so never under
        it, or the training thread's give/take would wait for it)."""
        t0 = time.perf_counter()
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if self.pin and nbytes:
            _register(buf)
        return _Block(buf, reserved=reserved), time.perf_counter() - t0

    def _add(self, block: _Block, seconds: float) -> None:
        """Count ``block`` in (lock held)."""
        self.stats.pin_seconds += seconds
        self.stats.allocated += 1
        self._blocks.append(block)

    def _fit(self, nbytes: int, exclude=()) -> _Block | None:
        """The smallest free buffer that holds ``nbytes``, not counting ``exclude``."""
        fits = [b for b in self._blocks
                if b.free and not b.lost and b.buf.numel() >= nbytes and b not in exclude]
        return min(fits, key=lambda b: b.buf.numel(), default=None)

    # -- the interface ----------------------------------------------------------------------
    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of exactly ``nbytes`` (a view of a pooled one when one fits)."""
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")
        if nbytes == 0:                    # nothing to pool (and every empty tensor is at 0)
            return torch.empty(0, dtype=torch.uint8)
        with self._lock:
            block = self._fit(nbytes)
            if block is not None:
                self.stats.reused += 1
                block.free, block.reserved = False, False
                return block.buf[:nbytes]
        block, seconds = self._new(nbytes)          # nothing fits: made here, in the pause
        block.free = False
        with self._lock:
            self._add(block, seconds)
        return block.buf[:nbytes]

    def _block_of(self, buf: torch.Tensor) -> _Block:
        ptr = buf.data_ptr()
        for b in self._blocks:
            if b.buf.data_ptr() == ptr:
                return b
        raise ValueError("this buffer was not taken from this pool")

    def give(self, buf: torch.Tensor) -> None:
        """``buf`` (from :meth:`take`) is free for the next generation."""
        if buf.numel() == 0:
            return
        with self._lock:
            self._block_of(buf).free = True

    def lose(self, buf: torch.Tensor) -> None:
        """``buf`` may still be written by an abandoned exchange: never reuse it, never free
        it (it stays referenced here for the process's life, as the abandoned groups do)."""
        if buf.numel() == 0:
            return
        with self._lock:
            b = self._block_of(buf)
            b.lost, b.free = True, False

    def reserve(self, sizes) -> int:
        """Make sure a free buffer exists for each of ``sizes`` (one each, none counted twice),
        making and pinning what is missing now: Prepare calls it, off the training thread, for
        the slots the new generation will take. They are kept from :meth:`trim` until taken;
        a later reserve (the next Prepare, when this one was aborted) replaces the
        reservation. Returns the bytes made."""
        missing = []
        with self._lock:
            for b in self._blocks:
                b.reserved = False
            chosen: list[_Block] = []
            for n in sorted((n for n in sizes if n > 0), reverse=True):
                b = self._fit(n, exclude=chosen)
                if b is None:
                    missing.append(n)
                else:
                    chosen.append(b)
            for b in chosen:
                b.reserved = True
        made = [self._new(n, reserved=True) for n in missing]    # pinned outside the lock
        with self._lock:
            for block, seconds in made:
                self._add(block, seconds)
        return sum(missing)

    def trim(self, keep=()) -> int:
        """Return to the system every free buffer not needed for ``keep`` (sizes a coming
        generation will take; by default none). Call it at a quiet point: unpinning is
        synchronous. Returns the bytes freed."""
        with self._lock:
            kept: list[_Block] = []
            for n in sorted(keep, reverse=True):
                b = self._fit(n, exclude=kept)
                if b is not None:
                    kept.append(b)
            drop = [b for b in self._blocks
                    if b.free and not b.lost and not b.reserved and b not in kept]
            for b in drop:
                if self.pin and b.buf.numel():
                    _unregister(b.buf)
                self._blocks.remove(b)
                self.stats.freed += 1
            return sum(b.buf.numel() for b in drop)

    def bytes_held(self) -> tuple[int, int]:
        """(bytes in use or lost, bytes free in the pool)."""
        with self._lock:
            used = sum(b.buf.numel() for b in self._blocks if not b.free)
            free = sum(b.buf.numel() for b in self._blocks if b.free)
            return used, free
