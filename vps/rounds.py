"""The rounds of a switch's network transfers and the staging they need, alike on every device.

Every device derives the same rounds from the same full plan (:func:`schedule_rounds`), so
sends and receives always pair up and the schedule cannot deadlock: in a round each device
posts all its sends and receives at once, one message per peer, that peer's small regions
packed into one contiguous staging buffer. Regions of at least ``direct_bytes`` travel as
messages of their own, straight from the old tensor into the new one (:func:`split_direct`),
because for them packing costs a whole extra copy on each side and saves one message's
overhead of microseconds. Rounds are filled greedily so that no device stages more than
``staging_bytes`` (sent plus received) in one round; a single region larger than the budget
travels alone. A direct region that is contiguous at both ends (:func:`contiguous`) stages
nothing, so it costs no budget: every such region goes in the first round, and all of a
device's peers stream to it at once. (Counted against the budget, they split a switch into
rounds of 256 MiB, each waiting for its slowest pair while other pairs sit idle: ``pp=4 ->
dp=2`` on gpt-125m took 6 rounds, the first with one pair of the six busy.)
:func:`staging_need` sizes the one staging buffer a device reuses in every round. Pure
arithmetic over the plan, no torch: rounds are scheduled before the pause.
"""

from __future__ import annotations

from typing import NamedTuple

from .planner import Plan

MiB = 1 << 20
DIRECT_BYTES = 1 * MiB
"""Default size from which a region travels as a message of its own
(:attr:`~dynatrain.vps.transition.TransitionConfig.direct_bytes`)."""
DEFAULT_STAGING_BYTES = 256 * MiB
"""Default staging budget of a switch: the most bytes a device stages (sent plus received) in
one round (the engine's, the agent's when a Prepare names none, the memory model's)."""


class Item(NamedTuple):
    """One region of one tensor: a Move expanded to a single tensor of its group."""

    move: int
    """Index into ``plan.transfers``."""
    name: str
    nbytes: int


class Message(NamedTuple):
    src: int
    dst: int
    items: tuple[Item, ...]
    nbytes: int


def contiguous(piece, box) -> bool:
    """Whether ``box`` of ``piece`` is one contiguous block of its local tensor (what
    :func:`~dynatrain.vps.regions.region_view` returns is then contiguous; pure arithmetic).

    A piece is either a 1-d range of a flat local tensor (ZeRO) or the whole of an N-d one
    (the mapping's two kinds), so its elements are contiguous, in row-major order of its box;
    a sub-box of that is contiguous when every dim after the first one it spans more than
    one index of is whole. A piece of any other kind answers False (safe: the region is then
    counted as staged)."""
    local = piece.local
    if len(local) != 1 and any(a != 0 or b - a != e - s
                               for (a, b), (s, e) in zip(local, piece.box)):
        return False
    spanning = False
    for (s, e), (ps, pe) in zip(box, piece.box):
        if spanning and (s, e) != (ps, pe):
            return False
        spanning = spanning or e - s > 1
    return True


def staged_bytes(plan: Plan, move: int, direct_bytes: int | None) -> int:
    """Staging bytes one tensor's region of ``plan.transfers[move]`` needs: none if it travels
    direct (``direct_bytes``, see :func:`split_direct`) and is contiguous at both ends, where
    it is sent from the old tensor and received into the new one; else its size."""
    m = plan.transfers[move]
    if (direct_bytes is not None and m.nbytes >= direct_bytes
            and contiguous(m.src_piece, m.box) and contiguous(m.dst_piece, m.box)):
        return 0
    return m.nbytes


def schedule_rounds(plan: Plan, staging_bytes: int,
                    direct_bytes: int | None = DIRECT_BYTES) -> list[list[Message]]:
    """The rounds of network messages, the same on every device (it reads the full plan).

    Messages go per (sending process, receiver) pair: what a proxy sends from its own old
    tensors and from a mirror to the same receiver shares one queue, in plan order, which is
    the same on every device because the plan is. ``direct_bytes`` must be the engine's
    (``None`` when everything is packed, as with checksums): regions that travel direct and
    contiguous stage nothing and cost no budget (:func:`staged_bytes`).
    """
    queues: dict[tuple[int, int], list[Item]] = {}
    cost: dict[int, int] = {}
    for i, m in enumerate(plan.transfers):
        cost[i] = staged_bytes(plan, i, direct_bytes)
        for name in plan.groups[m.group].names:
            queues.setdefault((m.src, m.dst), []).append(Item(i, name, m.nbytes))
    pairs = sorted(queues)
    heads = {p: 0 for p in pairs}
    rounds: list[list[Message]] = []
    while pairs:
        used: dict[int, int] = {}
        messages = []
        for pair in pairs:
            src, dst = pair
            q, h = queues[pair], heads[pair]
            take, size, staged = h, 0, 0
            while take < len(q):
                n = cost[q[take].move]
                fits = (used.get(src, 0) + staged + n <= staging_bytes
                        and used.get(dst, 0) + staged + n <= staging_bytes)
                alone = take == h and used.get(src, 0) == 0 and used.get(dst, 0) == 0
                if not (fits or alone):
                    break
                size += q[take].nbytes
                staged += n
                take += 1
                if not fits:  # an oversized region travels alone
                    break
            if take > h:
                messages.append(Message(src, dst, tuple(q[h:take]), size))
                used[src] = used.get(src, 0) + staged
                used[dst] = used.get(dst, 0) + staged
                heads[pair] = take
        rounds.append(messages)
        pairs = [p for p in pairs if heads[p] < len(queues[p])]
    return rounds


CHECKSUM_BYTES = 16
"""Room after a message's payload for its two 64-bit checksums (when they are on)."""
_ALIGN = 64
"""Messages start at multiples of this in the staging buffer, so any dtype can view them."""


def slot_bytes(nbytes: int) -> int:
    """Staging bytes one message occupies: payload, room for its checksums, alignment."""
    return -(-(nbytes + CHECKSUM_BYTES) // _ALIGN) * _ALIGN


def split_direct(msg: Message, direct_bytes: int | None) -> tuple[list[int], list[int]]:
    """Indices of ``msg``'s items that are packed, and of those that travel direct. Both ends
    decide from sizes alone, so they agree without asking."""
    packed, direct = [], []
    for j, it in enumerate(msg.items):
        (direct if direct_bytes is not None and it.nbytes >= direct_bytes else packed).append(j)
    return packed, direct


def staging_need(rounds: list[list[Message]], device: int,
                 direct_bytes: int | None = DIRECT_BYTES) -> int:
    """Bytes of staging ``device`` packs into in its busiest round: the size of one buffer
    that every round can reuse (``direct_bytes=None``: everything packed, as with checksums)."""
    def slot(msg):
        packed = split_direct(msg, direct_bytes)[0]
        return slot_bytes(sum(msg.items[j].nbytes for j in packed)) if packed else 0
    return max([sum(slot(m) for m in messages if device in (m.src, m.dst))
                for messages in rounds] + [0])
