"""The elastic device manager: numbered generations of worlds, built from a rendezvous store.

A generation is one layout's world. Its process groups are built straight from the rendezvous
store under a per-generation prefix (``dynatrain/gen{g}/{name}``), by their members only, with
``ProcessGroupGloo`` / ``ProcessGroupNCCL`` constructed directly: no collective over a fixed
default world is needed, so devices that were not in the previous world (joiners) can take
part, and construction can run in a background thread while the old world keeps training.

:meth:`DeviceManager.prepare` does all of a switch's work that does not need the training to
stop, in the background: plan (the full plan, which every device computes identically), the
round schedule, the transition group over old ∪ new devices, and, through caller-supplied
callbacks, the new layout's own groups and its preallocated local tensors. The training pause is
then only the transfer.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from . import abandon, faults
from .layout import Layout
from .model import ModelSpec
from .planner import Plan, plan_switch
from .regions import warm_up_regions
from .rounds import DIRECT_BYTES, Message, schedule_rounds
from .topology import DEFAULT_DEVICES_PER_NODE, Nodes


class GenerationError(RuntimeError):
    """A generation's groups could not be built (a member never arrived, a timeout)."""


@dataclass
class PreparedSwitch:
    generation: int
    plan: Plan | None
    """None for a job's first generation (nothing to move)."""
    rounds: list[list[Message]]
    transition_group: object | None
    group_rank: dict[int, int]
    """Device -> rank in the transition group."""
    new_rank: int | None
    """This device's rank in the new layout, or None if it leaves."""
    extra: object = None
    """Whatever the caller's callback built (the trainer's groups for the new layout)."""
    seconds: float = 0.0
    preallocated: dict | None = None
    """New local tensors allocated and touched in the background by the caller's
    ``preallocate`` callback, for :func:`~dynatrain.vps.transition.execute_transition`."""
    staging: object = None
    """A staging buffer for the network rounds, allocated the same way (a uint8 tensor)."""


class DeviceManager:
    def __init__(self, store, device: int, *, backend: str = "gloo",
                 timeout: timedelta = timedelta(seconds=60)):
        self.store, self.device, self.backend, self.timeout = store, device, backend, timeout
        self._built: dict[int, list[tuple[str, object]]] = {}
        """Generation -> (name, group) of its NCCL groups not yet connected (:meth:`_connect`)."""

    def build_group(self, generation: int, name: str, members: list[int]):
        """The group of ``members`` (devices, in rank order); None if this device is not one."""
        if self.device not in members:
            return None
        store = dist.PrefixStore(f"dynatrain/gen{generation}/{name}", self.store)
        rank, size = members.index(self.device), len(members)
        try:
            if self.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                group = dist.ProcessGroupNCCL(store, rank, size, opts)
            elif self.backend == "nccl-sim":      # the test harness's NCCL, on CPU
                from .ncclsim import SimProcessGroup

                group = SimProcessGroup(store, rank, size, self.timeout, ordered=True,
                                        name=f"gen{generation}/{name}")
            else:
                return dist.ProcessGroupGloo(store, rank, size, self.timeout)
            # A thread stuck in one of its ops is freed only by aborting it (abandon).
            abandon.track(generation, group)
            self._built.setdefault(generation, []).append((name, group))
            return group
        except Exception as e:  # a member never arrived: name the group and its members
            raise GenerationError(f"generation {generation}: group {name!r} of devices "
                                  f"{members} could not be built on device {self.device}: {e}"
                                  ) from e

    def _connect(self, generation: int, rounds: list[list[Message]],
                 members: list[int]) -> None:
        """Make the generation's NCCL communicators now, in the background, not at their first
        use, which would be inside the pause (the transfer, the commit's all-reduce, the first
        step). A communicator's setup is collective over its members, so every device makes
        its groups in one order (by name). Then the point-to-point communicators this device
        will use (a pipeline stage's neighbours, the transition group's pairs of this device's
        rounds): NCCL makes one per pair at the pair's first message, so each pair exchanges
        one tiny message now (:func:`warm_up_pairs`); nccl-sim makes the pair first
        (``connect_pair``), so that a pair made at first use is still said, then exchanges
        the same messages, whose order its recorder checks."""
        built = sorted(self._built.pop(generation, []), key=lambda item: item[0])
        for name, group in built:
            if hasattr(group, "eager_connect"):            # nccl-sim
                group.eager_connect()
            else:
                import torch

                group.eager_connect_single_device(
                    torch.device("cuda", torch.cuda.current_device()))
        for name, group in built:               # a pipeline's stages talk to neighbours
            if name.startswith("pp/"):
                r = group.rank()
                warm_up_pairs(group, [p for p in (r - 1, r + 1) if 0 <= p < group.size()])
        transition = next((g for name, g in built if name == "transition"), None)
        if transition is not None:
            rank = {d: i for i, d in enumerate(members)}
            peers = {rank[m.dst if m.src == self.device else m.src]
                     for messages in rounds for m in messages
                     if self.device in (m.src, m.dst) and m.src != m.dst}
            warm_up_pairs(transition, sorted(peers))

    def group_factory(self, generation: int, layout: Layout) -> Callable:
        """make_group(kind, ranks) for a layout's groups in ``generation`` (ranks -> devices)."""
        def make_group(kind: str, ranks: list[int]):
            devices = [layout.device_of[r] for r in ranks]
            return self.build_group(generation, f"{kind}/{'-'.join(map(str, ranks))}", devices)
        return make_group

    def prepare(self, generation: int, model: ModelSpec, old: Layout | None, new: Layout, *,
                staging_bytes: int, build_extra: Callable[[int], object] | None = None,
                devices_per_node: Nodes = DEFAULT_DEVICES_PER_NODE,
                dead: frozenset[int] = frozenset(),
                proxies: dict[int, int] | None = None,
                preallocate: Callable[[PreparedSwitch], None] | None = None,
                direct_bytes: int | None = DIRECT_BYTES) -> "Future[PreparedSwitch]":
        """Start the background work of switching ``old`` -> ``new``; returns a future.

        ``build_extra(new_rank)`` runs on devices of the new layout, in the same thread, after
        the transition group exists (e.g. to build the trainer's groups). ``old=None`` is a
        job's first generation: nothing moves, so there is no plan and no transition group.
        ``dead`` old devices (a recovery) are neither sources nor members of the transition
        group; ``proxies`` name the live devices that hold their mirrored state.
        ``devices_per_node`` is the plan's node map (:mod:`.topology`): devices per node, or device
        -> node name; every device of the switch must be given the same, or their plans differ
        (0 or an empty map: 8 per node).
        ``preallocate(prepared)`` runs last, on every device of a switch with a plan, to fill
        in ``prepared.preallocated`` and ``prepared.staging`` ahead of the pause.
        ``direct_bytes`` must be the engine's (``None`` with checksums): see
        :func:`~.rounds.schedule_rounds`.
        """
        future: Future = Future()

        def work():
            t0 = time.perf_counter()
            try:
                faults.inject("prepare", self.device)
                if old is None:
                    plan, rounds, members, group = None, [], [], None
                    new_rank = (new.device_of.index(self.device)
                                if self.device in new.device_of else None)
                else:
                    plan = plan_switch(model, old, new, devices_per_node=devices_per_node or 8,
                                       dead=dead, proxies=proxies or {})
                    rounds = schedule_rounds(plan, staging_bytes, direct_bytes)
                    warm_up_regions(plan, self.device)
                    members = sorted((set(old.device_of) | set(new.device_of)) - set(dead))
                    group = self.build_group(generation, "transition", members)
                    new_rank = plan.new.rank_of_device.get(self.device)
                extra = build_extra(new_rank) if (build_extra and new_rank is not None) else None
                self._connect(generation, rounds, members)
                prepared = PreparedSwitch(
                    generation, plan, rounds, group, {d: i for i, d in enumerate(members)},
                    new_rank, extra)
                if preallocate is not None and plan is not None:
                    preallocate(prepared)
                prepared.seconds = time.perf_counter() - t0
                future.set_result(prepared)
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)

        threading.Thread(target=work, name=f"dynatrain-prepare-gen{generation}",
                         daemon=True).start()
        return future


_WARM_UP_TAG = 0x3A4D


def warm_up_pairs(group, peers: list[int]) -> None:
    """One 4-byte exchange with each of ``peers`` (ranks of ``group``, an NCCL or nccl-sim
    group), so that each pair's communicator exists before the pause. Both sides of a pair
    must call it with each other in ``peers``.

    Pairs go in one global order, by (lower rank, higher rank): the lower rank sends then
    receives, the higher receives then sends. NCCL runs each pair on its own stream, so the
    pairs cannot block each other there; where a send blocks until its receive is posted
    (nccl-sim, gloo underneath), the smallest pair not yet done always has both ranks at it,
    so the exchange cannot deadlock."""
    if not peers:
        return
    import torch

    me = group.rank()
    device = (torch.device("cuda", torch.cuda.current_device())
              if not hasattr(group, "connect_pair") else torch.device("cpu"))
    out = torch.ones(1, dtype=torch.float32, device=device)
    works = []
    for peer in sorted(set(peers), key=lambda p: (min(me, p), max(me, p))):
        if hasattr(group, "connect_pair"):                 # nccl-sim: made now, not "used"
            group.connect_pair(peer)
        got = torch.empty(1, dtype=torch.float32, device=device)
        send = lambda: group.send([out], peer, _WARM_UP_TAG)   # noqa: E731
        recv = lambda: group.recv([got], peer, _WARM_UP_TAG)   # noqa: E731
        works += [send(), recv()] if me < peer else [recv(), send()]
    for w in works:
        w.wait()
    if device.type == "cuda":      # NCCL's wait only orders the stream: the host waits here
        torch.cuda.current_stream(device).synchronize()
