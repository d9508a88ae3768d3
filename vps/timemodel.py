"""The switch's modelled time on a two-tier network, and provable lower bounds on it and on bytes.

**The model.** Devices sit on nodes: ``devices_per_node`` is the node map of :mod:`.topology`,
either devices per node (device ``d`` is on node ``d // devices_per_node``) or device -> the node
it really runs on. A transfer between two devices of one node runs over the intra-node
link (NVLink: ``intra`` bytes/s per direction), any other over the inter-node link (a NIC per
GPU: ``inter`` bytes/s per direction). Each device has four independent **ports**: intra-send,
intra-recv, inter-send, inter-recv. A port's time is its bytes over its bandwidth, a device's
time is the max of its four ports, and the **modelled pause** (makespan) is the max over
devices. Latency, congestion inside the fabric and contention between NVLink and PCIe are left
out: the model is what a switch with full bisection bandwidth and large messages approaches.
Local copies cost nothing in it (they run at HBM speed, orders of magnitude faster).

**Lower bound on the makespan** (valid for every single-hop plan: each element goes straight
from a device that holds it under the old layout to a device that needs it). The inputs are the
plan's demand: for each holder set ``H`` (the live devices holding some data, or the proxies
standing in for dead ones) and each receiver ``r``, the bytes ``D(H, r)`` that ``r`` needs and
holds no copy of. Any plan with makespan ``T`` obeys:

* *Receive side.* Receiver ``r`` needs ``need(r) = sum_H D(H, r)``. Of it, ``far(r)`` has no
  holder on ``r``'s node and must arrive over inter-recv, and ``near_only(r)`` has every holder
  on ``r``'s node and must arrive over intra-recv. The two ports carry at most ``T * inter`` and
  ``T * intra``, so ``T >= far(r) / inter``, ``T >= near_only(r) / intra`` and
  ``T >= need(r) / (intra + inter)``.
* *Send side.* Take a set ``G`` of devices and the data whose every holder is in ``G``
  (``sum over H subset of G``); of its demand from the ``R_n`` receivers on node ``n``,
  ``near_n`` has a holder on ``n`` and ``far_n`` has none. Only members of ``G`` can send it.
  Into node ``n`` it flows over NVLink from members on ``n`` (``near_n`` only, at most
  ``T min(|G ∩ n|, R_n) intra``: the senders' and the receivers' intra ports both limit it),
  and over NICs from members elsewhere (at most ``T min(|G \\ n|, R_n) inter``). So
  ``e_n(T) = far_n + max(0, near_n - T min(|G ∩ n|, R_n) intra)`` must go over NICs. This
  is a transportation problem (senders with capacities, receiver nodes with demands): by
  Hall's condition every set ``S`` of receiver nodes needs no more than the capacity that can
  reach it. For ``S = {n}``: ``e_n(T) <= T min(|G \\ n|, R_n) inter``; for all nodes:
  ``sum_n e_n(T) <= T min(|G|, sum_n R_n) inter``. ``T`` is at least the smallest value
  meeting these, which :func:`_send_seconds` finds exactly (the left-hand sides are convex,
  piecewise linear and decreasing in ``T``: walk their breakpoints).

  ``G`` ranges, as for the byte bound, over every holder set that occurs (with the data of
  every smaller holder set inside it) and the set of all holders; and, for the ``S = {n}``
  condition, over ``G_n``, the union of the holder sets with demand on node ``n`` (what a
  node's receivers need, against every holder on their node that can serve any of it).

The bound is the max of all of these. It ignores that a device's ports serve several holder
sets at once, so it can be below the best plan's time; :func:`lower_bound_seconds` is what the
planner's modelled time is measured against (``modelled / bound`` = how far from optimal at
worst). Checked against the exact optimum of the fractional plan (a linear program over every
(holder, receiver) split) on random small switches: never above it, and often equal.

**When both bounds cannot be met.** The time bound and the byte bound are each reachable on
their own more often than together: when a node's receivers need much data that few holders on
their node have, the fast plan sends it over those holders' NVLink, more bytes than their share.
:func:`lower_bound_ratio` bounds ``rho = max(pause / T_lb, busiest bytes / B_lb)`` from below
for every plan: at ratio ``rho`` a port carries at most ``rho min(T_lb bw, B_lb)``, so the
conditions above with those capacities give ``rho >= far / a`` and ``rho >= (far + near) /
(c + a)``, with ``c = min(on, R_n) min(T_lb intra, B_lb)`` and ``a = min(off, R_n) min(T_lb
inter, B_lb)``, for every holder set and every ``G_n``. And every byte is sent by a holder on
some node ``m`` (``k_m`` holders): at most ``min(near_m, rho c_m) + rho k_m min(T_lb inter,
B_lb)`` of it, and at most ``rho k_m B_lb`` in all, so the sum of ``min`` of the two over the
nodes must reach the total demand (solved for ``rho`` by bisection; it is where nodes whose
NICs limit them meet a node whose NVLink holders are short of bytes). The same count holds for
each holder set ``G`` that occurs, with the data of every holder set inside it (only ``G``'s
members can send that), which is tighter where one set has
few holders on a node that needs much of it: llama-7b (8 layers) dp=9,pp=8 -> dp=8,tp=4,pp=3
has a set of 9 holders, 8 on one node and 1 on the node of 7 of its receivers; that one
sends its byte share at most, so the 8 send the rest over their NICs, and no plan does better
than ``rho = 1.136`` (the count over all sets at once gave 1.0). Where it is above 1, no
plan meets both bounds; the planner minimises ``rho``.

**Lower bound on the busiest device's bytes** (max of sent and received, over the network): see
:mod:`.stats`; :func:`lower_bound_bytes` computes it from the same demand.

Pure metadata: no torch import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .topology import Nodes, check_nodes, node_of, node_table

#: H100 SXM NVLink: 900 GB/s bidirectional = 450 GB/s per direction = 3600 Gb/s.
DEFAULT_INTRA_GBPS = 3600.0
#: One 400 Gb/s NIC (InfiniBand NDR / RoCE) per GPU.
DEFAULT_INTER_GBPS = 400.0


@dataclass(frozen=True)
class Links:
    """Bandwidth per direction of one device's intra-node and inter-node link, bytes/s."""

    intra: float = DEFAULT_INTRA_GBPS * 1e9 / 8
    inter: float = DEFAULT_INTER_GBPS * 1e9 / 8

    @classmethod
    def from_gbps(cls, intra_gbps: float = DEFAULT_INTRA_GBPS,
                  inter_gbps: float = DEFAULT_INTER_GBPS) -> "Links":
        for name, v in (("intra_gbps", intra_gbps), ("inter_gbps", inter_gbps)):
            if not v > 0 or v == float("inf"):
                raise ValueError(f"{name}={v} must be a positive, finite bandwidth in Gb/s")
        return cls(intra_gbps * 1e9 / 8, inter_gbps * 1e9 / 8)

    def __post_init__(self):
        for name in ("intra", "inter"):
            v = getattr(self, name)
            if not v > 0 or v == float("inf"):
                raise ValueError(f"Links.{name}={v} must be a positive, finite bandwidth (bytes/s)")


Demand = Mapping[tuple[int, ...], Mapping[int, int]]
"""holders -> receiver -> bytes the receiver needs from data held exactly by those holders."""

INTRA_SEND, INTRA_RECV, INTER_SEND, INTER_RECV = range(4)


def port_bytes(transfers: Iterable[tuple[int, int, int]], devices_per_node: Nodes
               ) -> dict[int, list[int]]:
    """Per device, bytes on its [intra-send, intra-recv, inter-send, inter-recv] ports, from
    ``(src, dst, bytes)`` triples."""
    check_nodes(devices_per_node, "devices_per_node")
    node: dict[int, str] = {}   # filled as devices appear: the triples may be a generator
    ports: dict[int, list[int]] = {}
    for s, r, b in transfers:
        ns = node.get(s)
        if ns is None:
            ns = node[s] = node_of(devices_per_node, s)
        nr = node.get(r)
        if nr is None:
            nr = node[r] = node_of(devices_per_node, r)
        same = ns == nr
        ps = ports.get(s)
        if ps is None:
            ps = ports[s] = [0, 0, 0, 0]
        pr = ports.get(r)
        if pr is None:
            pr = ports[r] = [0, 0, 0, 0]
        if same:
            ps[INTRA_SEND] += b
            pr[INTRA_RECV] += b
        else:
            ps[INTER_SEND] += b
            pr[INTER_RECV] += b
    return ports


def device_seconds(ports: Mapping[int, list[int]], links: Links) -> dict[int, float]:
    """Modelled time of each device: the max of its four ports' bytes / bandwidth."""
    intra, inter = links.intra, links.inter
    return {d: max(max(p[0], p[1]) / intra, max(p[2], p[3]) / inter) for d, p in ports.items()}


def makespan(ports: Mapping[int, list[int]], links: Links) -> float:
    """The modelled pause: the slowest device's time."""
    return max(device_seconds(ports, links).values(), default=0.0)


def _node_seconds(far: int, near: int, on: int, off: int, receivers: int, links: Links
                  ) -> float:
    """Smallest ``T`` at which ``near + far`` bytes reach ``receivers`` devices of one node from
    ``on`` holders on that node (NVLink, ``near`` bytes only) and ``off`` holders elsewhere
    (NICs): ``far + max(0, near - T c) <= T a`` (module docstring)."""
    c = min(on, receivers) * links.intra
    a = min(off, receivers) * links.inter
    if a == 0:
        return near / c if near else 0.0
    t = (far + near) / (c + a)
    if c == 0 or t > near / c:
        t = far / a
    return t


def _send_seconds(loads: Mapping[str, list], members: Mapping[str, int], size: int,
                  links: Links) -> float:
    """Smallest ``T`` at which holder set ``G`` (``members[node]`` of its ``size`` devices on
    each node) can deliver ``loads[node] = [far, near, receivers]`` bytes to the receivers on
    each node: ``far`` has no holder on that node, ``near`` has one (module docstring)."""
    intra, inter = links.intra, links.inter
    best = 0.0
    total = 0
    n_receivers = 0
    breaks = []
    for n, (far, near, rs) in loads.items():
        if far + near <= 0:
            continue
        total += far + near
        on = members.get(n, 0)
        best = max(best, _node_seconds(far, near, on, size - on, len(rs), links))  # S = {n}
        n_receivers += len(rs)
        c = min(on, len(rs)) * intra
        if c and near:
            breaks.append((near / c, near, c))
    slope = min(size, n_receivers) * inter + sum(c for _, _, c in breaks)
    breaks.sort()
    for t_n, near, c in breaks:  # sum_n e_n(T) <= T |G| inter, over the active pieces
        t = total / slope
        if t <= t_n:
            return max(best, t)
        total -= near
        slope -= c
    return max(best, total / slope)


def _contained(sets: list[frozenset]) -> dict[frozenset, list[frozenset]]:
    """For every multi-device holder set, the occurring holder sets inside it (itself included).
    Singletons are looked up by member; larger sets are compared pairwise (few of them)."""
    singles = {next(iter(s)): s for s in sets if len(s) == 1}
    multi = [s for s in sets if len(s) > 1]
    out = {}
    for g in multi:
        inside = [singles[x] for x in g if x in singles]
        inside += [g2 for g2 in multi if g2 <= g]
        out[g] = inside
    return out


def _sum_loads(parts: Iterable[Mapping[str, list]]) -> dict[str, list]:
    out: dict[str, list] = {}
    for per_n in parts:
        for n, (far, near, rs) in per_n.items():
            acc = out.get(n)
            if acc is None:
                out[n] = [far, near, set(rs)]
            else:
                acc[0] += far
                acc[1] += near
                acc[2] |= rs
    return out


def _node_loads(per_r: Mapping[int, int], holder_nodes, node: Mapping[int, str],
                into: dict[str, list]) -> dict[str, list]:
    """Add one holder set's demand to ``into``, per receiver node (``node[r]``): [bytes with
    no holder on that node (far), bytes with one there (near), the receivers]."""
    for r, b in per_r.items():
        n = node[r]
        acc = into.get(n)
        if acc is None:
            acc = into[n] = [0, 0, set()]
        acc[n in holder_nodes] += b
        acc[2].add(r)
    return into


def _demand_nodes(demand: Demand, devices_per_node: Nodes) -> dict[int, str]:
    """The node of every holder and receiver in ``demand``."""
    devices = set().union(*demand)
    for per_r in demand.values():
        devices.update(per_r)
    return node_table(devices_per_node, devices)


def lower_bound_seconds(demand: Demand, devices_per_node: Nodes, links: Links) -> float:
    """Lower bound on the makespan of every single-hop plan for ``demand`` (module docstring)."""
    if not demand:
        return 0.0
    node = _demand_nodes(demand, devices_per_node)
    intra, inter = links.intra, links.inter
    best = 0.0
    # Receive side.
    need: dict[int, list[int]] = {}  # r -> [need, far, near_only]
    for holders, per_r in demand.items():
        nodes = {node[h] for h in holders}
        for r, b in per_r.items():
            acc = need.get(r)
            if acc is None:
                acc = need[r] = [0, 0, 0]
            acc[0] += b
            n = node[r]
            if n not in nodes:
                acc[1] += b
            elif len(nodes) == 1:
                acc[2] += b
    for total, far, near_only in need.values():
        best = max(best, far / inter, near_only / intra, total / (intra + inter))
    # Send side: per-node loads of every holder set, then of the sets containing them.
    sets: dict[frozenset, dict[str, list]] = {}  # G -> node -> [far, near, receivers]
    for holders, per_r in demand.items():
        _node_loads(per_r, {node[h] for h in holders}, node,
                    sets.setdefault(frozenset(holders), {}))

    def members_of(g) -> dict[str, int]:
        m: dict[str, int] = {}
        for h in g:
            m[node[h]] = m.get(node[h], 0) + 1
        return m

    keys = list(sets)
    contained = _contained(keys)
    for g in keys:
        if len(g) == 1:
            loads = sets[g]
        else:
            loads = _sum_loads(sets[h] for h in contained[g])
        best = max(best, _send_seconds(loads, members_of(g), len(g), links))
    everyone = frozenset().union(*keys)
    loads = _sum_loads(sets.values())
    best = max(best, _send_seconds(loads, members_of(everyone), len(everyone), links))
    # Per receiver node n, G_n = the union of the holder sets with demand there.
    at_node: dict[str, list[frozenset]] = {}
    for g, per_n in sets.items():
        for n in per_n:
            at_node.setdefault(n, []).append(g)
    for n, gs in at_node.items():
        g_n = frozenset().union(*gs)
        on = sum(1 for h in g_n if node[h] == n)
        far, near, rs = _sum_loads({n: sets[g][n]} for g in gs)[n]
        best = max(best, _node_seconds(far, near, on, len(g_n) - on, len(rs), links))
    return best


def lower_bound_ratio(demand: Demand, devices_per_node: Nodes, links: Links, seconds: float,
                      nbytes: int) -> float:
    """Lower bound on ``max(pause / seconds, busiest bytes / nbytes)`` over all single-hop plans,
    given the two bounds ``seconds`` and ``nbytes`` (module docstring: where it is above 1 the
    two bounds cannot both be met, whatever the plan)."""
    if not demand or seconds <= 0 or nbytes <= 0:
        return 1.0
    node = _demand_nodes(demand, devices_per_node)
    per_intra = min(seconds * links.intra, nbytes)  # what one port may carry at ratio 1
    per_inter = min(seconds * links.inter, nbytes)
    best = 1.0

    def ratio(far, near, on, off, receivers):
        c = min(on, receivers) * per_intra
        a = min(off, receivers) * per_inter
        if a == 0:
            return near / c if near else 0.0
        return max(far / a, (far + near) / (c + a))

    at_node: dict[str, list] = {}  # node -> [(holders, far, near, receivers)]
    keyed: dict[frozenset, list] = {}  # holder set -> its per-node loads (for the count below)
    for holders, per_r in demand.items():
        nodes = [node[h] for h in holders]
        loads = _node_loads(per_r, nodes, node, {})
        keyed.setdefault(frozenset(holders), []).append(loads)
        for n, (far, near, rs) in loads.items():
            on = nodes.count(n)
            best = max(best, ratio(far, near, on, len(holders) - on, len(rs)))
            at_node.setdefault(n, []).append((holders, far, near, rs))
    holders_on = _count_nodes(frozenset().union(*demand), node)
    total = 0
    near_at: dict[str, tuple[int, int]] = {}  # node -> (near bytes, receivers)
    for n, parts in at_node.items():
        g_n = frozenset().union(*(h for h, _, _, _ in parts))
        on = sum(1 for h in g_n if node[h] == n)
        rs = set().union(*(r for _, _, _, r in parts))
        far, near = sum(p[1] for p in parts), sum(p[2] for p in parts)
        best = max(best, ratio(far, near, on, len(g_n) - on, len(rs)))
        total += far + near
        near_at[n] = (near, len(rs))
    caps = (per_intra, per_inter, nbytes)
    best = _sending_ratio(best, total, holders_on, near_at, caps)
    # The same count for each holder set G that occurs, with the data of every holder set
    # inside it: only G's members can send that.
    inside = _contained(list(keyed))
    for g in keyed:
        loads = _sum_loads(p for h in inside.get(g, [g]) for p in keyed[h])
        near_g = {n: (near, len(rs)) for n, (_, near, rs) in loads.items()}
        best = _sending_ratio(best, sum(far + near for far, near, _ in loads.values()),
                              _count_nodes(g, node), near_g, caps)
    return best


def _count_nodes(devices, node: Mapping[int, str]) -> dict[str, int]:
    """Node -> how many of ``devices`` are on it."""
    out: dict[str, int] = {}
    for d in devices:
        out[node[d]] = out.get(node[d], 0) + 1
    return out


def _sending_ratio(best: float, total: int, holders_on: Mapping[str, int],
                   near_at: Mapping[str, tuple[int, int]], caps: tuple[float, float, int]
                   ) -> float:
    """The smallest ``rho >= best`` at which holders (``holders_on``: node -> how many) can
    send ``total`` bytes: a holder on node ``m`` sends at most ``near_at[m]``'s near bytes over
    NVLink (within ``rho`` of its receivers' and its own intra ports) plus ``rho`` NIC's worth,
    and ``rho`` byte shares in all (module docstring)."""
    per_intra, per_inter, per_byte = caps

    def capacity(rho: float) -> float:
        cap = 0.0
        for m, k in holders_on.items():
            near, receivers = near_at.get(m, (0, 0))
            intra = min(near, rho * min(k, receivers) * per_intra)
            cap += min(intra + rho * k * per_inter, rho * k * per_byte)
        return cap

    if capacity(best) < total:
        lo, hi = best, best
        while capacity(hi) < total:
            lo, hi = hi, hi * 2
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if capacity(mid) >= total else (mid, hi)
        best = hi
    return best


def lower_bound_bytes(demand: Demand) -> int:
    """Lower bound on the busiest device's network bytes, max(sent, received) (see
    :mod:`.stats` for the derivation): every receiver's need, and for every holder set ``G``
    that occurs, and for the set of all holders, the data only ``G`` holds times its receivers,
    shared evenly by ``G``'s members."""
    need: dict[int, int] = {}
    loads: dict[frozenset, int] = {}
    for holders, per_r in demand.items():
        g = frozenset(holders)
        for r, b in per_r.items():
            need[r] = need.get(r, 0) + b
            loads[g] = loads.get(g, 0) + b
    best = max(need.values(), default=0)
    keys = list(loads)
    for g, inside in _contained(keys).items():
        best = max(best, -(-sum(loads[h] for h in inside) // len(g)))
    for g in keys:
        if len(g) == 1:
            best = max(best, loads[g])
    if keys:
        everyone = frozenset().union(*keys)
        best = max(best, -(-sum(loads.values()) // len(everyone)))
    return best


__all__ = ["DEFAULT_INTER_GBPS", "DEFAULT_INTRA_GBPS", "Demand", "Links", "device_seconds",
           "lower_bound_bytes", "lower_bound_ratio", "lower_bound_seconds", "makespan",
           "port_bytes"]
