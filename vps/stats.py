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
evaluate this for every holder set that occurs in the plan (replica groups, single holders,
each with the data of the smaller holder sets inside it) and for the set of all holders, and
take the largest bound of all. The bound is valid for
every single-hop plan, not only ours; multi-hop schemes (trees) are outside the plan model.

The same plan is also measured in time on a two-tier network (NVLink inside a node, a NIC per
GPU between nodes) against a lower bound in that model: :mod:`.timemodel`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .mapping import state_bytes
from .planner import Plan
from .timemodel import (lower_bound_bytes, lower_bound_ratio, lower_bound_seconds, makespan,
                        port_bytes)


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
    modelled_seconds: float = 0.0
    """The modelled pause on the plan's links (:mod:`.timemodel`)."""
    lower_bound_seconds: float = 0.0
    """Lower bound on the modelled pause of any single-hop plan."""
    lower_bound_joint_ratio: float = 1.0
    """Lower bound on max(modelled / lower_bound_seconds, busiest / lower_bound_max_rank_bytes)
    for any single-hop plan: above 1 where the two bounds cannot both be met."""

    @property
    def ratio_to_bound(self) -> float:
        if self.lower_bound_max_rank_bytes == 0:
            return 1.0 if self.max_rank_bytes == 0 else float("inf")
        return self.max_rank_bytes / self.lower_bound_max_rank_bytes

    @property
    def time_ratio_to_bound(self) -> float:
        if self.lower_bound_seconds == 0:
            return 1.0 if self.modelled_seconds == 0 else float("inf")
        return self.modelled_seconds / self.lower_bound_seconds

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
    return lower_bound_bytes(plan.demand)


def modelled_seconds(plan: Plan) -> float:
    """The plan's modelled pause on its links (:mod:`.timemodel`)."""
    sizes = [len(g.names) for g in plan.groups]
    ports = port_bytes(((m.src, m.dst, m.nbytes * sizes[m.group]) for m in plan.transfers),
                       plan.devices_per_node)
    return makespan(ports, plan.links)


def lower_bound_time(plan: Plan) -> float:
    """Lower bound on the modelled pause of every single-hop plan (:mod:`.timemodel`)."""
    return lower_bound_seconds(plan.demand, plan.devices_per_node, plan.links)


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
        modelled_seconds=modelled_seconds(plan),
        lower_bound_seconds=(t_lb := lower_bound_time(plan)),
        lower_bound_joint_ratio=lower_bound_ratio(plan.demand, plan.devices_per_node, plan.links,
                                                  t_lb, lower_bound(plan)),
    )
