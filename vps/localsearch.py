"""The local search that finishes the planner's choice of senders.

:func:`~.planner.plan_switch` picks a holder for every (region, receiver) of every replica class
in one greedy pass (:func:`~.planner._assign_sources`), against shared per-device loads on
four ports; :func:`improve` then moves single (region, receiver) pairs off the costliest device
while that makes it cheaper and no other device it touches gets costlier than it, within
bounds on the work so that a plan stays fast to compute at 1024 devices. It edits the greedy
pass's choices and port loads in place; everything is a deterministic function of its inputs.

Pure metadata: no torch import.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

#: A choice among more holders than this looks at those on the receiver's node and a window
#: of this many others (rotating from one choice to the next); the local search sees all.
WINDOW = 16

#: Bounds on the local search: moves made, alternatives (and assignments) looked at in all,
#: and the largest assignments of the costliest device looked at per move (alternatives among
#: many holders: those on the receiver's node and a rotating window of ``WINDOW``).
MAX_MOVES = 2000
MAX_TRIES = 400_000
SCAN = 128


def improve(jobs, choice, info, near, node: Mapping[int, str], ports, weights) -> None:
    """Local search after the greedy pass: while some single (region, receiver) can move from
    the costliest device to another holder, or change which holder serves the costliest
    receiver, so that the costliest device gets cheaper and every other device it touches
    either ends below that cost or gets no costlier, make the best such move (the sorted
    costs fall lexicographically, so this ends). Stops when the costliest device cannot be
    relieved (or at ``MAX_MOVES`` moves or ``MAX_TRIES`` alternatives tried: the plan must stay
    fast to compute at 1024 devices)."""
    isd, esd, ird, erd = ports
    wi, we, wb = weights

    def cost(i_s, e_s, i_r, e_r):
        return max(i_s * wi, e_s * we, (i_s + e_s) * wb, i_r * wi, e_r * we, (i_r + e_r) * wb)

    def dev_cost(d):
        return cost(isd[d], esd[d], ird[d], erd[d])

    sends: dict[int, list[int]] = {}
    recvs: dict[int, list[int]] = {}
    for ji, (it, ci, r) in enumerate(jobs):
        holders = info[ci][0]
        if len(holders) > 1:
            sends.setdefault(holders[choice[ji]], []).append(ji)
            recvs.setdefault(r, []).append(ji)
    devices = set(sends) | set(recvs)
    heap = [(-dev_cost(d), d) for d in devices]
    heapq.heapify(heap)
    budget = MAX_TRIES
    for _ in range(MAX_MOVES):
        if budget <= 0:
            return
        while heap:
            c, w = heap[0]
            if -c == dev_cost(w):
                break
            heapq.heapreplace(heap, (-dev_cost(w), w))
        if not heap:
            return
        cw = -heap[0][0]
        if cw <= 1.0 + 1e-9:
            return
        limit = cw * (1 - 1e-9)
        best = None
        mine_s, mine_r = sends.get(w, []), recvs.get(w, [])
        budget -= len(mine_s) + len(mine_r)
        size = lambda j: jobs[j][0].total  # noqa: E731
        cands = heapq.nlargest(SCAN, mine_s, key=size) + heapq.nlargest(SCAN, mine_r, key=size)
        base = {}
        for ji in cands:
            it, ci, r = jobs[ji]
            holders, hnodes, _ = info[ci]
            b = it.total
            rn = node[r]
            cur = choice[ji]
            s0 = holders[cur]
            near0 = hnodes[cur] == rn
            for d in (s0, r):
                if d not in base:
                    base[d] = dev_cost(d)
            k = len(holders)
            if k <= WINDOW:
                alts = range(k)
            else:
                off = (info[ci][2] + ji + _) % k
                alts = [*near[ci].get(rn, ()), *((off + j) % k for j in range(WINDOW))]
            budget -= len(alts)
            for i in alts:
                if i == cur:
                    continue
                h = holders[i]
                near1 = hnodes[i] == rn
                if h not in base:
                    base[h] = dev_cost(h)
                # Port loads after moving b from (s0 -> r) to (h -> r).
                p_s0 = [isd[s0], esd[s0], ird[s0], erd[s0]]
                p_s0[0 if near0 else 1] -= b
                p_h = p_s0 if h == s0 else [isd[h], esd[h], ird[h], erd[h]]
                p_h[0 if near1 else 1] += b
                p_r = [isd[r], esd[r], ird[r], erd[r]]
                p_r[2 if near0 else 3] -= b
                p_r[2 if near1 else 3] += b
                # The costliest device must get cheaper; the others may not pass its cost
                # (or may not get costlier at all when they already share it).
                v = 0.0
                for d, p in ((s0, p_s0), (h, p_h), (r, p_r)):
                    c = cost(*p)
                    if d == w or c > base[d]:
                        v = max(v, c)
                if v < limit:
                    limit, best = v, (ji, i, s0, h, near0, near1)
        if best is None:
            return
        ji, i, s0, h, near0, near1 = best
        b = jobs[ji][0].total
        r = jobs[ji][2]
        if near0:
            isd[s0] -= b
            ird[r] -= b
        else:
            esd[s0] -= b
            erd[r] -= b
        if near1:
            isd[h] += b
            ird[r] += b
        else:
            esd[h] += b
            erd[r] += b
        choice[ji] = i
        sends[s0].remove(ji)
        sends.setdefault(h, []).append(ji)
        for d in (s0, h, r):
            heapq.heappush(heap, (-dev_cost(d), d))
