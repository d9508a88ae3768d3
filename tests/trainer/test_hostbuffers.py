"""The redundancy's host buffers: exact sizes, reused by the next generation, reserved in
Prepare and kept from a trim until taken, never reused while an abandoned exchange may write.

On this machine the pool runs unpinned (no CUDA); pinning is one ``cudaHostRegister`` per
buffer made, which ``make gpu-check`` exercises on a GPU (dynatrain/bench/gpu.py)."""

from __future__ import annotations

import pytest
import torch

from dynatrain.trainer.config import make_config
from dynatrain.trainer.groups import build_groups
from dynatrain.trainer.hostbuffers import HostBuffers
from dynatrain.trainer.redundancy import Redundancy, slot_sizes
from dynatrain.trainer.trainer import Trainer
from dynatrain.vps.layout import bind


def test_a_buffer_is_exactly_the_size_asked_for_not_a_power_of_two():
    pool = HostBuffers()
    buf = pool.take(3_000_001)
    assert buf.numel() == 3_000_001 and buf.dtype == torch.uint8
    assert pool.bytes_held() == (3_000_001, 0)


def test_a_given_back_buffer_serves_the_next_take_that_fits():
    pool = HostBuffers()
    a = pool.take(1000)
    pool.give(a)
    b = pool.take(800)                    # fits in a's buffer: no new one
    assert b.numel() == 800 and b.data_ptr() == a.data_ptr()
    assert (pool.stats.allocated, pool.stats.reused) == (1, 1)
    c = pool.take(2000)                   # nothing free fits
    assert c.data_ptr() != a.data_ptr() and pool.stats.allocated == 2


def test_the_smallest_free_buffer_that_fits_is_taken():
    pool = HostBuffers()
    big, small = pool.take(4000), pool.take(1000)
    pool.give(big)
    pool.give(small)
    assert pool.take(900).data_ptr() == small.data_ptr()
    assert pool.take(900).data_ptr() == big.data_ptr()


def test_trim_keeps_what_the_next_generation_takes_and_returns_the_rest():
    pool = HostBuffers()
    bufs = [pool.take(n) for n in (100, 200, 300)]
    for b in bufs:
        pool.give(b)
    freed = pool.trim(keep=[150])         # the 200 one serves 150; 100 and 300 go
    assert freed == 400 and pool.bytes_held() == (0, 200)
    assert pool.stats.freed == 2


def test_a_reservation_survives_a_trim_until_it_is_taken():
    pool = HostBuffers()
    made = pool.reserve([500, 500, 0])    # Prepare: two snapshot slots; no mirror
    assert made == 1000 and pool.stats.allocated == 2
    assert pool.trim() == 0               # the training thread's trim keeps them
    a, b = pool.take(500), pool.take(500)
    assert pool.stats.allocated == 2 and pool.stats.reused == 2
    pool.give(a)
    pool.give(b)
    assert pool.trim() == 1000            # taken once, the reservation is over


def test_a_new_reservation_replaces_an_aborted_prepares():
    pool = HostBuffers()
    pool.reserve([500])
    pool.reserve([1000])                  # the next Prepare: 500 is no longer reserved
    assert pool.stats.allocated == 2
    assert pool.trim() == 500
    pool.reserve([400])                   # a free buffer that fits serves it: none made
    assert pool.stats.allocated == 2


def test_a_lost_buffer_is_never_reused_nor_freed():
    pool = HostBuffers()
    a = pool.take(1000)
    pool.lose(a)                          # an abandoned recv may still write into it
    assert pool.take(1000).data_ptr() != a.data_ptr()
    assert pool.trim() == 0
    with pytest.raises(ValueError, match="not taken from this pool"):
        pool.give(torch.empty(10, dtype=torch.uint8))


def test_zero_bytes_take_nothing_from_the_pool():
    pool = HostBuffers()
    z = pool.take(0)
    pool.give(z)
    pool.lose(z)
    assert z.numel() == 0 and pool.stats.allocated == 0
    with pytest.raises(ValueError, match="nbytes=-1"):
        pool.take(-1)


@pytest.mark.parametrize("layout", ["dp=1", "dp=1,zero=1"])
def test_the_next_generation_takes_the_previous_ones_slots(layout):
    """Two generations on one rank sharing the worker's pool: the second makes nothing
    (what Prepare reserved, or what the first gave back, serves it), and its snapshots are
    still exact."""
    cfg = make_config("gpt-tiny", layout, global_batch_size=4, seq_len=16)
    bound = bind(cfg.layout, cfg.model)
    pool = HostBuffers()
    sizes = slot_sizes(bound, 0)
    pool.reserve([sizes.snapshot] * 2)                  # generation 1's Prepare
    trainer = Trainer(cfg, build_groups(bound, 0, lambda kind, ranks: None))
    first = Redundancy(bound, 0, None, buffers=pool)
    assert pool.stats.allocated == 2 and first.slot_bytes().snapshot == sizes.snapshot
    first.snapshot(trainer.local_state())
    trainer.train_step()
    first.close()                                       # generation 1 ends (a switch)

    pool.reserve([sizes.snapshot] * 2)                  # generation 2's Prepare
    second = Redundancy(bound, 0, None, buffers=pool)
    assert pool.stats.allocated == 2, "the second generation pinned buffers of its own"
    state = trainer.local_state()
    second.snapshot(state)
    got = second.restore(trainer.step)
    assert all(torch.equal(got.tensors[k][0], t) for k, (t, _) in state.tensors.items())
    assert pool.trim(keep=[sizes.snapshot] * 2) == 0    # both in use
