"""Memory and redundancy cost of a layout and of a switch, per device and per node, as the code
allocates them: what ``dynatrain plan --memory`` prints.

The cost model (:mod:`.costmodel`) answers what a training step needs on a device. A job that
can change its layout and survive losing a node needs more, and this module adds it up from
the same sources the running code sizes its buffers with, so that a 7B-70B job can be judged
before it runs on hardware this project never had:

**GPU, per device.** The training step's peak (:func:`.costmodel.estimate`: state, gradients,
activations or the all-reduce bucket, reserved). A switch holds the old local state and the
new one at once (:mod:`dynatrain.vps.transition`: an old tensor goes when its last reader is
done, a new one that is exactly an old one is adopted, not copied) plus the staging buffer of
its busiest network round (:func:`dynatrain.vps.rounds.staging_need`, bounded by the staging
budget); activations and gradients are gone at the step boundary where a switch happens.

**Host, per node.** Each rank's :class:`~dynatrain.trainer.redundancy.Redundancy` keeps two
snapshot slots of its whole local state (pinned when CUDA is there: device-to-host copies
want pinned memory) and two mirror slots of its source's unique state (pageable), sized by
:func:`~dynatrain.trainer.redundancy.slot_sizes`. The slots come from
:class:`~dynatrain.trainer.hostbuffers.HostBuffers`: exact size, page-locked with
``cudaHostRegister``. Beside it the report shows what torch's ``CachingHostAllocator`` would
have taken (every block rounded up to a power of two and never returned, torch
``aten/src/ATen/core/CachingHostAllocator.h``), which the slots used before. After a planned
switch the previous generation's slots are kept until the new one has a whole mirrored step
of its own (``Status.previous_*``), so for those steps a node holds both generations' slots;
the pool then keeps one generation's worth for the next switch.

**Time, per step.** After a step the worker copies its whole local state into a snapshot
slot (device to host, at the profile's host link rate) and then sends the unique part to its
buddy on another node (gloo over the NIC, at best the profile's inter-node rate); the next
step waits for both just before its final (loss) all-reduce. On a GPU the copy runs on a side
stream, overlapping the next step's compute (only its optimizer update waits for it), so the
exposed cost is whatever of copy + mirror outlasts one step; on the CPU the copy is
synchronous and exposed whole. Snapshotting every ``k`` steps
(``spec.recovery.snapshotEverySteps``) divides it by ``k`` at the price of up to ``k - 1``
steps trained again after a loss; :attr:`RedundancyCost.every_for` is the smallest ``k``
under a target share. The GPU-side figures are modelled, not measured: no GPU ran them.

Plain arithmetic over the mapping and the planner (no processes, no device memory): the
built-in cases (llama-7b dp=8 ZeRO-1; llama-70b tp=8,pp=4,dp=4) take about a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dynatrain.trainer.redundancy import slot_sizes
from dynatrain.vps.layout import Layout, bind
from dynatrain.vps.mapping import rank_shards, state_itemsize
from dynatrain.vps.model import ModelSpec
from dynatrain.vps.planner import plan_switch
from dynatrain.vps.rounds import (DEFAULT_STAGING_BYTES, DIRECT_BYTES, schedule_rounds,
                                  staging_need)
from dynatrain.vps.topology import Nodes, node_of

from .costmodel import Estimate, estimate
from dynatrain.spec.hardware import DeviceProfile

GiB = 1 << 30
GLOO_TCP_BYTES_PER_SECOND = 3e9
"""What the mirrors' transport is assumed to reach per connection at best: gloo's TCP pairs
move one socket per peer from one thread each and rarely pass a few GB/s, whatever the NIC
(an assumption, not a measurement here; ``--mirror-gbps`` overrides it)."""
SLOTS = 2
"""Snapshot (and mirror) slots a Redundancy keeps: the step being written and the last whole
one."""


def pinned_block(nbytes: int) -> int:
    """What torch's caching host allocator reserves for ``nbytes`` of pinned memory: the next
    power of two (0 for 0)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


@dataclass(frozen=True)
class RankHost:
    """One rank's host buffers (bytes)."""

    device: int
    node: str
    snapshot: int
    unique: int
    mirror: int

    @property
    def pinned(self) -> int:
        """The snapshot slots, registered at their exact size (what the code pins)."""
        return SLOTS * self.snapshot

    @property
    def pinned_rounded(self) -> int:
        """What the same slots would take from torch's caching host allocator."""
        return SLOTS * pinned_block(self.snapshot)

    @property
    def pageable(self) -> int:
        return SLOTS * self.mirror


@dataclass(frozen=True)
class NodeHost:
    """A node's host memory for the job's ranks on it (bytes)."""

    node: str
    ranks: int
    pinned: int
    pinned_rounded: int
    pageable: int

    @property
    def total(self) -> int:
        return self.pinned + self.pageable


@dataclass(frozen=True)
class RedundancyCost:
    """Seconds per step the snapshots and mirrors cost, against the modelled step."""

    copy_seconds: float
    """The busiest rank's device-to-host copy of its whole local state."""
    mirror_seconds: float
    """Its unique state to the buddy over the inter-node link (overlaps the next step)."""
    step_seconds: float
    copy_overlaps: bool = True
    """The copy runs on a side stream beside the next step (a GPU); else it blocks (CPU)."""

    @property
    def exposed_seconds(self) -> float:
        if self.copy_overlaps:          # the mirror leaves once the copy is whole
            return max(0.0, self.copy_seconds + self.mirror_seconds - self.step_seconds)
        return self.copy_seconds + max(0.0, self.mirror_seconds - self.step_seconds)

    @property
    def blocking_share(self) -> float:
        """The share if the copy blocked the step (the code before the side stream)."""
        return (self.copy_seconds + max(0.0, self.mirror_seconds - self.step_seconds)
                ) / self.step_seconds

    @property
    def share(self) -> float:
        """Exposed seconds over the step's, snapshotting every step."""
        return self.exposed_seconds / self.step_seconds

    def every_for(self, target: float) -> int:
        """The fewest steps between snapshots that keep the share at or under ``target``."""
        return max(1, math.ceil(self.share / target - 1e-12))


@dataclass(frozen=True)
class SwitchGpu:
    """One device's GPU bytes during a switch (the busiest device's)."""

    device: int
    old_state: int
    new_state: int
    adopted: int
    """Bytes of new local state that are old local tensors kept as they are (no copy)."""
    staging: int

    @property
    def peak(self) -> int:
        return self.old_state + self.new_state - self.adopted + self.staging


@dataclass(frozen=True)
class MemoryReport:
    model: ModelSpec
    layout: Layout
    profile: DeviceProfile
    step: Estimate
    hosts: tuple[RankHost, ...]
    redundancy: RedundancyCost
    new_layout: Layout | None = None
    switch_gpu: SwitchGpu | None = None
    new_hosts: tuple[RankHost, ...] = field(default_factory=tuple)

    def nodes(self, *, during_switch: bool = False) -> list[NodeHost]:
        """Host memory per node; ``during_switch``: with the new generation's slots beside the
        old one's (the previous generation is kept for a few steps after a switch)."""
        ranks = list(self.hosts) + (list(self.new_hosts) if during_switch else [])
        by: dict[str, list[RankHost]] = {}
        for r in ranks:
            by.setdefault(r.node, []).append(r)
        return [NodeHost(n, len({r.device for r in rs}), sum(r.pinned for r in rs),
                         sum(r.pinned_rounded for r in rs), sum(r.pageable for r in rs))
                for n, rs in sorted(by.items())]

    def busiest_node(self, *, during_switch: bool = False) -> NodeHost:
        return max(self.nodes(during_switch=during_switch), key=lambda n: n.total)

    def summary(self) -> dict:
        """The figures as one JSON-ready dict (bytes, seconds)."""
        node = self.busiest_node()
        during = self.busiest_node(during_switch=self.new_layout is not None)
        out = {
            "model": self.model.name, "layout": self.layout.to_text(),
            "profile": self.profile.name, "devices_per_node": self.profile.devices_per_node,
            "gpu_bytes": self.profile.memory_bytes,
            "host_bytes_per_node": self.profile.host_memory(),
            "step_gpu_peak": self.step.memory_bytes,
            "step_gpu_breakdown": dict(self.step.memory_breakdown),
            "step_seconds": self.step.step_seconds,
            "host_pinned_per_node": node.pinned,
            "host_pinned_rounded_per_node": node.pinned_rounded,
            "host_pageable_per_node": node.pageable,
            "host_during_switch_per_node": during.total,
            "host_during_switch_rounded_per_node": during.pinned_rounded + during.pageable,
            "redundancy_copy_seconds": self.redundancy.copy_seconds,
            "redundancy_mirror_seconds": self.redundancy.mirror_seconds,
            "redundancy_share": self.redundancy.share,
            "redundancy_share_blocking": self.redundancy.blocking_share,
            "snapshot_every_for_5_percent": self.redundancy.every_for(0.05),
        }
        if self.switch_gpu is not None:
            sw = self.switch_gpu
            out.update(new_layout=self.new_layout.to_text(), switch_gpu_peak=sw.peak,
                       switch_gpu_device=sw.device, switch_old_state=sw.old_state,
                       switch_new_state=sw.new_state, switch_adopted=sw.adopted,
                       switch_staging=sw.staging)
        return out


def _hosts(model: ModelSpec, layout: Layout, nodes: Nodes) -> tuple[RankHost, ...]:
    bound = bind(layout, model)
    return tuple(RankHost(d, node_of(nodes, d), s.snapshot, s.unique, s.mirror)
                 for r, d in enumerate(layout.device_of)
                 for s in [slot_sizes(bound, r, nodes)])


def _state_bytes(bound, rank: int) -> dict[tuple[str, str], tuple[int, tuple]]:
    """(tensor, state) -> (bytes, pieces) of ``rank``'s local state."""
    out = {}
    for rs in rank_shards(bound, rank):
        numel = math.prod(rs.local_shape)
        out[(rs.tensor.name, rs.state)] = (numel * state_itemsize(rs.tensor, rs.state),
                                           rs.pieces)
    return out


def switch_gpu(model: ModelSpec, old: Layout, new: Layout, nodes: Nodes,
               staging_bytes: int = DEFAULT_STAGING_BYTES) -> SwitchGpu:
    """The busiest device's GPU bytes while ``old`` becomes ``new`` (both with devices)."""
    plan = plan_switch(model, old, new, devices_per_node=nodes)
    rounds = schedule_rounds(plan, staging_bytes, DIRECT_BYTES)
    best = None
    for d in sorted(set(old.device_of) | set(new.device_of)):
        o_rank, n_rank = plan.old.rank_of_device.get(d), plan.new.rank_of_device.get(d)
        o = _state_bytes(plan.old, o_rank) if o_rank is not None else {}
        n = _state_bytes(plan.new, n_rank) if n_rank is not None else {}
        adopted = sum(b for k, (b, pieces) in n.items() if k in o and o[k][1] == pieces)
        sw = SwitchGpu(d, sum(b for b, _ in o.values()), sum(b for b, _ in n.values()),
                       adopted, staging_need(rounds, d, DIRECT_BYTES))
        if best is None or sw.peak > best.peak:
            best = sw
    return best


def memory_report(model: ModelSpec, layout: Layout, profile: DeviceProfile, *,
                  global_batch_size: int, seq_len: int, micro_batch_size: int = 1,
                  new_layout: Layout | None = None, nodes: Nodes | None = None,
                  staging_bytes: int = DEFAULT_STAGING_BYTES,
                  activation_checkpointing: bool = False,
                  mirror_bytes_per_second: float | None = None) -> MemoryReport:
    """The memory and redundancy figures of ``layout`` (and of a switch to ``new_layout``,
    both with their devices) on ``profile``; ``nodes`` defaults to the profile's devices per
    node, devices packed in order; the mirrors move at ``mirror_bytes_per_second``, by default
    the profile's inter-node rate capped at :data:`GLOO_TCP_BYTES_PER_SECOND`."""
    nodes = profile.devices_per_node if nodes is None else nodes
    step = estimate(model, layout, profile, global_batch_size=global_batch_size,
                    micro_batch_size=micro_batch_size, seq_len=seq_len,
                    activation_checkpointing=activation_checkpointing)
    hosts = _hosts(model, layout, nodes)
    busiest = max(hosts, key=lambda h: (h.snapshot, h.unique))
    cost = RedundancyCost(
        copy_seconds=busiest.snapshot / profile.host_rate(),
        mirror_seconds=max(h.unique for h in hosts) / (
            mirror_bytes_per_second or min(profile.inter_node_bytes_per_second,
                                           GLOO_TCP_BYTES_PER_SECOND))
        if layout.world > 1 else 0.0,
        step_seconds=step.step_seconds, copy_overlaps=profile.name != "cpu")
    sw, new_hosts = None, ()
    if new_layout is not None:
        sw = switch_gpu(model, layout, new_layout, nodes, staging_bytes)
        new_hosts = _hosts(model, new_layout, nodes)
    return MemoryReport(model, layout, profile, step, hosts, cost, new_layout, sw, new_hosts)


def render(rep: MemoryReport) -> str:
    """The report as a person reads it: each figure against what the hardware has."""
    p, s = rep.profile, rep.summary()
    gib = lambda n: f"{n / GiB:,.1f} GiB"          # noqa: E731
    node, during = rep.busiest_node(), rep.busiest_node(during_switch=rep.new_layout is not None)
    h = max(rep.hosts, key=lambda x: x.snapshot)
    lines = [f"{rep.model.name} {rep.layout.to_text()} on {p.name} ({p.devices_per_node} per "
             f"node, {gib(p.memory_bytes)} each, {gib(p.host_memory())} host per node)"]
    br = s["step_gpu_breakdown"]
    lines.append(f"  GPU, training step: {gib(s['step_gpu_peak'])} per device ("
                 + ", ".join(f"{k} {gib(v)}" for k, v in br.items() if v) + ")"
                 + ("" if rep.step.fits else "  DOES NOT FIT"))
    if rep.switch_gpu is not None:
        sw = rep.switch_gpu
        lines.append(f"  GPU, switch to {rep.new_layout.to_text()}: {gib(sw.peak)} on device "
                     f"{sw.device} (old {gib(sw.old_state)} + new {gib(sw.new_state)} - "
                     f"adopted {gib(sw.adopted)} + staging {gib(sw.staging)})"
                     + ("" if sw.peak <= p.memory_bytes else "  DOES NOT FIT"))
    lines.append(f"  host per node: pinned {gib(node.pinned)} ({node.ranks} ranks x {SLOTS} "
                 f"snapshot slots of {gib(h.snapshot)} at exact size; torch's caching "
                 f"allocator would reserve {gib(node.pinned_rounded)}), pageable mirrors "
                 f"{gib(node.pageable)}; total {gib(node.total)} = "
                 f"{node.total / p.host_memory():.0%} of the node")
    if rep.new_layout is not None:
        rounded = during.pinned_rounded + during.pageable
        lines.append(f"  host per node while the previous generation is kept after the "
                     f"switch: {gib(during.total)} = {during.total / p.host_memory():.0%} "
                     f"of the node ({gib(rounded)} = {rounded / p.host_memory():.0%} with "
                     "power-of-two blocks)")
    r = rep.redundancy
    how = ("on a side stream beside the next step" if r.copy_overlaps else "blocking")
    lines.append(f"  redundancy per step: copy {r.copy_seconds:.3f} s ({how}) + mirror "
                 f"{r.mirror_seconds:.3f} s (exposed {r.exposed_seconds:.3f} s) vs a "
                 f"{r.step_seconds:.3f} s step: {r.share:.1%} ({r.blocking_share:.1%} with a "
                 f"blocking copy); a snapshot every "
                 f"{r.every_for(0.05)} steps keeps it <= 5% (spec.recovery."
                 "snapshotEverySteps)")
    return "\n".join(lines)


#: The cases of the memory model's targets, on H100 nodes with a 400 Gb/s NIC per GPU:
#: (name, model, layout, switch target, devices the target keeps (None: 0..N-1), global
#: batch, sequence length, activation checkpointing). Each loses a node with notice (the
#: second of its nodes), as a preemption does: the switch's peak is on the survivors.
MEMORY_CASES = [
    ("7B lose a node: dp 8 -> 4", "llama-7b", "dp=8,zero=1,schedule=1f1b",
     "dp=4,zero=1,schedule=1f1b", [0, 1, 2, 3], 256, 4096, False),
    ("70B lose a node: dp 4 -> 3", "llama-70b", "tp=8,pp=4,dp=4,zero=1,schedule=1f1b",
     "tp=8,pp=4,dp=3,zero=1,schedule=1f1b", [d for d in range(128) if d // 8 != 1][:96],
     1024, 4096, True),
]


def builtin_reports(profile: DeviceProfile, *, mirror_bytes_per_second: float | None = None
                    ) -> list[tuple[str, MemoryReport]]:
    """:data:`MEMORY_CASES` on ``profile``, each switch placed as the policy places one
    (:func:`~dynatrain.vps.placement.place_devices`: the devices keep what they can)."""
    from dynatrain.vps.layout import parse_layout
    from dynatrain.vps.placement import place_devices
    from dynatrain.vps.presets import load_model

    out = []
    for name, m, old_text, new_text, keep, batch, seq, ckpt in MEMORY_CASES:
        model = load_model(m)
        old = parse_layout(old_text)
        old = old.with_devices(range(old.world))
        new = place_devices(model, old, parse_layout(new_text), keep)
        out.append((name, memory_report(model, old, profile, global_batch_size=batch,
                                        seq_len=seq, new_layout=new,
                                        activation_checkpointing=ckpt,
                                        mirror_bytes_per_second=mirror_bytes_per_second)))
    return out
