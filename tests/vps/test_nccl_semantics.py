"""ProcessGroupNCCL behaviours the code has to respect, checked without NCCL.

No two NCCL ranks can run in this workplace (a lent machine has one GPU), so each behaviour is
modelled as the torch source states it, and the code is checked against the model:

- **Point-to-point rendezvous.** NCCL runs a rank's operations in order on one stream, and a
  large send completes only once its peer has posted the matching receive (NCCL's documented
  p2p semantics: "ncclSend/ncclRecv ... block until the peer posts the matching call" for
  messages beyond its buffers). Posting every send before every receive deadlocks a cycle of
  three devices; the switch engine and the floor probe post in one global (source,
  destination) order, which cannot.
- **Error handling.** ``TORCH_NCCL_ASYNC_ERROR_HANDLING``: 1 (TearDown) and torch's default 3
  (SkipCleanUp) take the process down when an op passes its timeout; 2 (CleanUpOnly) aborts the
  communicator and lets the process live (``SHOULD_TEAR_DOWN`` in ProcessGroupNCCL.hpp). The
  worker sets 2 unless the environment says otherwise.
- **Checksums** of a staging buffer are summed a chunk at a time (not 24 bytes of int64
  temporaries per byte of the buffer on the GPU), with the same result.
"""

from __future__ import annotations

import random

import pytest
import torch

from dynatrain.bench.switch_worker import probe_order
from dynatrain.trainer.backend import NCCL_CLEAN_UP_ONLY, NCCL_ERROR_HANDLING, nccl_error_handling
from dynatrain.vps.transition import CHECKSUM_CHUNK, _checksum


def run_p2p(queues: dict[int, list[tuple[str, int]]]) -> bool:
    """Whether every device's ops complete under NCCL's p2p model: each device runs its ops in
    order; a send to d and d's receive from the sender complete together once both are at
    the head of their devices' queues. False: a deadlock (no head can complete)."""
    heads = {d: 0 for d in queues}
    while any(heads[d] < len(q) for d, q in queues.items()):
        moved = False
        for d, q in queues.items():
            if heads[d] >= len(q):
                continue
            kind, peer = q[heads[d]]
            if kind != "send" or heads[peer] >= len(queues[peer]):
                continue
            if queues[peer][heads[peer]] == ("recv", d):
                heads[d] += 1
                heads[peer] += 1
                moved = True
        if not moved:
            return False
    return True


def _traffic(edges):
    sends = {d: {} for e in edges for d in e}
    recvs = {d: {} for e in edges for d in e}
    for s, t in edges:
        sends[s][t] = recvs[t][s] = 1 << 30          # large: no eager buffer helps
    return sends, recvs


def test_every_send_first_deadlocks_a_cycle_the_global_order_does_not():
    sends, recvs = _traffic([(0, 1), (1, 2), (2, 0)])
    naive = {d: [("send", p) for p in sends[d]] + [("recv", p) for p in recvs[d]]
             for d in sends}
    assert not run_p2p(naive)                      # what the probe did: a hang under NCCL
    ordered = {d: probe_order(d, sends[d], recvs[d]) for d in sends}
    assert run_p2p(ordered)


def test_the_global_order_never_deadlocks_any_traffic():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(2, 9)
        edges = {(s, t) for s in range(n) for t in range(n) if s != t and rng.random() < 0.4}
        if not edges:
            continue
        sends, recvs = _traffic(sorted(edges))
        assert run_p2p({d: probe_order(d, sends[d], recvs[d]) for d in sends}), edges


def test_the_worker_asks_nccl_to_abort_a_timed_out_op_not_the_process():
    env = {}
    assert nccl_error_handling(env) == (NCCL_CLEAN_UP_ONLY, True)
    assert env == {NCCL_ERROR_HANDLING: "2"}
    assert nccl_error_handling({NCCL_ERROR_HANDLING: "1"}) == ("1", False)   # theirs stays
    assert nccl_error_handling({NCCL_ERROR_HANDLING: ""})[1]                  # empty: unset


@pytest.mark.parametrize("size", [0, 1, 63, CHECKSUM_CHUNK, CHECKSUM_CHUNK + 17,
                                  3 * CHECKSUM_CHUNK + 5])
def test_chunked_checksums_equal_the_whole_buffer_ones(size):
    g = torch.Generator().manual_seed(size)
    buf = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    b = buf.to(torch.int64)
    weights = torch.arange(1, size + 1, dtype=torch.int64) % 65521 + 1
    assert _checksum(buf).tolist() == [int(b.sum()), int((b * weights).sum())]
    if size > 1:                                   # a reordering changes the second sum
        swapped = buf.clone()
        swapped[[0, -1]] = buf[[-1, 0]]
        if buf[0] != buf[-1]:
            assert _checksum(swapped)[1] != _checksum(buf)[1]


@pytest.mark.parametrize("old, new", [("pp=3", "dp=3"), ("tp=2,pp=2", "dp=2,tp=2"),
                                      ("pp=4", "dp=2,pp=2,zero=1")])
def test_the_engine_posts_each_round_in_an_order_nccl_completes(old, new):
    # The engine posts a round's messages in the round's order, each device its own
    # (a message's direct regions and packed part in the same order at both ends).
    from dynatrain.vps.layout import parse_layout
    from dynatrain.vps.planner import plan_switch
    from dynatrain.vps.presets import load_model
    from dynatrain.vps.rounds import schedule_rounds

    model = load_model("gpt-tiny")
    a, b = parse_layout(old), parse_layout(new)
    plan = plan_switch(model, a.with_devices(range(a.world)), b.with_devices(range(b.world)))
    rounds = schedule_rounds(plan, 64 << 10)
    assert len(rounds) > 1
    for messages in rounds:
        devices = {d for m in messages for d in (m.src, m.dst)}
        queues = {d: [("send", m.dst) if m.src == d else ("recv", m.src)
                      for m in messages if d in (m.src, m.dst)] for d in devices}
        assert run_p2p(queues)
