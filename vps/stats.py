"""Plan statistics and a provable lower bound on the busiest device's traffic.

Traffic of a device = max(bytes it sends, bytes it receives) over the network; the plan's
quality figure is the busiest device's traffic against the lower bound below.

**Derivation.** Plans are single-hop: every element a device receives comes straight from a
device that held it under the old layout. Let ``need(d)`` be the bytes of ``d``'s new state
that ``d`` does not hold under the old layout. Whatever the plan, ``d`` receives at least
``need(d)``, so the busiest device moves at least ``max_d need(d)``. For sending, take any set
``G`` of devices and the data whose every holder is in ``G``: each such element must reach
each of its receivers (devices that need it and do not hold it) from a member of ``G``. So the
members of ``G`` send at least ``L(G)`` bytes together, where ``L(G)`` sums, over that data,
its size times its number of receivers, and one of them sends at least ``L(G) / |G|``. We
evaluate this for every holder set that occurs in the plan (replica groups, single holders)
and for the set of all devices, and take the largest bound of all. The bound is valid for
every single-hop plan, not only ours; multi-hop schemes (trees) are outside the plan model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .mapping import state_bytes
from .planner import Plan


@dataclass(frozen=True)
class PlanStats:
    model: str
    params: int
    state_bytes: int
    """One full replica of the training state a switch moves."""
    ranks_from: int
    ranks_to: int
    bytes_local: int
    bytes_network: int
    max_rank_send_bytes: int
    max_rank_recv_bytes: int
    max_rank_bytes: int
    """Busiest device: max over devices of max(sent, received)."""
    lower_bound_max_rank_bytes: int
    transfers: int
    """Network transfers, one per (tensor, state, region, source, destination)."""
    transfer_records: int
    """The same, counting each tensor group once (what the plan stores)."""
    local_copies: int
    plan_seconds: float

    @property
    def ratio_to_bound(self) -> float:
        if self.lower_bound_max_rank_bytes == 0:
            return 1.0 if self.max_rank_bytes == 0 else float("inf")
        return self.max_rank_bytes / self.lower_bound_max_rank_bytes

    def to_dict(self) -> dict:
        return asdict(self)


def device_traffic(plan: Plan) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """(sent, received, copied locally) bytes per device."""
    send: dict[int, int] = {}
    recv: dict[int, int] = {}
    local: dict[int, int] = {}
    sizes = [len(g.names) for g in plan.groups]
    for m in plan.transfers:
        b = m.nbytes * sizes[m.group]
        send[m.src] = send.get(m.src, 0) + b
        recv[m.dst] = recv.get(m.dst, 0) + b
    for m in plan.copies:
        local[m.dst] = local.get(m.dst, 0) + m.nbytes * sizes[m.group]
    return send, recv, local


def lower_bound(plan: Plan) -> int:
    """Lower bound on the busiest device's network bytes (see the module docstring)."""
    best = max(plan.need.values(), default=0)
    loads = plan.class_loads
    singles = {next(iter(h)): v for h, v in loads.items() if len(h) == 1}
    multi = [(frozenset(h), v) for h, v in loads.items() if len(h) > 1]
    for g, v in multi:
        total = v + sum(singles.get(x, 0) for x in g)
        total += sum(v2 for g2, v2 in multi if g2 < g)
        best = max(best, -(-total // len(g)))
    everyone = set(plan.old.device_of)
    if everyone:
        best = max(best, -(-sum(loads.values()) // len(everyone)))
    for h, v in singles.items():
        best = max(best, v)
    return best


def plan_stats(plan: Plan) -> PlanStats:
    send, recv, local = device_traffic(plan)
    devices = set(send) | set(recv) | {0}
    traffic = max(max(send.get(d, 0), recv.get(d, 0)) for d in devices)
    sizes = [len(g.names) for g in plan.groups]
    return PlanStats(
        model=plan.model.name,
        params=plan.model.num_params,
        state_bytes=state_bytes(plan.model),
        ranks_from=plan.old.world,
        ranks_to=plan.new.world,
        bytes_local=sum(local.values()),
        bytes_network=sum(send.values()),
        max_rank_send_bytes=max(send.values(), default=0),
        max_rank_recv_bytes=max(recv.values(), default=0),
        max_rank_bytes=traffic,
        lower_bound_max_rank_bytes=lower_bound(plan),
        transfers=sum(sizes[m.group] for m in plan.transfers),
        transfer_records=len(plan.transfers),
        local_copies=sum(sizes[m.group] for m in plan.copies),
        plan_seconds=round(plan.plan_seconds, 6),
    )
