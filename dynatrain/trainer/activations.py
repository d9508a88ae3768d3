"""Measuring activation memory: the bytes autograd keeps alive for the backward pass.

On a GPU ``torch.cuda.max_memory_allocated`` shows the peak, but it mixes activations with
weights, gradients and optimizer state, and the CPU allocator keeps no such count at all. So
:class:`ActivationMeter` counts what the pipeline schedules actually differ in: every tensor
autograd saves for backward passes through :func:`torch.autograd.graph.saved_tensors_hooks`;
the meter holds it in a small wrapper whose lifetime is the saved tensor's (autograd frees
it when the backward pass has used it, or when the graph is dropped), and counts the bytes of
its *storage* once however many saved tensors view it (q, k, v as views of one projection;
a transpose of its input). Storages of the weights (``exclude``) are not counted: they are
state, alive whatever the schedule. The result is the peak over a step of the bytes held, the
figure the cost model's ``activations`` term predicts.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class _Held:
    """One saved tensor while autograd keeps it; its storage is counted while any is alive."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: "ActivationMeter", key: int, nbytes: int):
        self.tensor, self.meter, self.key = tensor, meter, key
        meter._hold(key, nbytes)

    def __del__(self):
        self.meter._release(self.key)


class ActivationMeter:
    """``with ActivationMeter(weights) as meter:`` ... ``meter.peak_bytes``.

    Counts, for the code run inside, the bytes of tensor storages saved for backward:
    ``alive_bytes`` now, ``peak_bytes`` the most at any moment. Weights' storages
    (``exclude``) are left out. Use it around forward *and* backward so that the peak sees
    the frees of finished micro-batches (and, with activation checkpointing, the blocks
    recomputed in the backward pass).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[int, list[int]] = {}          # storage -> [saved tensors, bytes]
        self.alive_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._excluded:
            return t
        return _Held(t, self, key, storage.nbytes())

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _hold(self, key: int, nbytes: int) -> None:
        ref = self._refs.get(key)
        if ref is None:
            self._refs[key] = [1, nbytes]
            self.alive_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.alive_bytes)
        else:
            ref[0] += 1

    def _release(self, key: int) -> None:
        ref = self._refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[key]
            self.alive_bytes -= ref[1]

    def __enter__(self) -> "ActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
