"""A worker's state and the agent's side of it: Prepare, Commit, Abort and Status.

:class:`WorkerControl` holds everything a worker process shares between the gRPC server's
threads and its training loop (one lock, one condition to wake the loop) and implements the
agent's :class:`~dynatrain.agent.server.Control` over it: Prepare validates a generation and
starts its background work, Commit hands the prepared generation to the loop and waits for
the switch, Abort drops it, Status reports. The RPCs only exchange small messages with the
loop under the lock, so an RPC (good or bad) never blocks or crashes a step.

A Prepare that replaces the running generation (``recover``, or a ``checkpoint`` on a device
that holds state) cuts the running generation's collectives short, which cannot be undone; so
everything that can refuse it is checked first: the generation (stale?), the state (left,
failed, finished?), the device's place in the layouts, the snapshots a recovery restores, and
the checkpoint path, which must lie under one of the worker's checkpoint roots (its
``--checkpoint-dir`` and each ``--checkpoint-source``; INVALID_ARGUMENT otherwise): loading a
checkpoint unpickles DCP's metadata, so a path from the network must not point anywhere.

The training loop that answers the RPCs is :class:`~dynatrain.agent.worker_loop.TrainingLoop`,
which holds a reference to the :class:`WorkerControl` and takes and leaves its state under the
same lock; :class:`~dynatrain.agent.worker.Worker` owns the two (composition: neither derives
from the other). What only the loop uses (its training log, the retired and abandoned process
groups, the peak FLOP/s of the MFU) is the loop's own.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from dynatrain.spec.job import JobSpec
from dynatrain.trainer.checkpoint import CheckpointPathError, check_checkpoint_path
from dynatrain.trainer.groups import build_groups
from dynatrain.trainer.hostbuffers import HostBuffers
from dynatrain.trainer.redundancy import Redundancy, slot_sizes
from dynatrain.trainer.switch import preallocate
from dynatrain.trainer.trainer import Trainer
from dynatrain.vps import abandon
from dynatrain.vps.generations import DeviceManager
from dynatrain.vps.layout import Layout, bind

from .errors import CommitTimeout, InvalidRequest, PreconditionFailed
from .metrics import REASONS, Metrics
from .requests import PrepareArgs, Recovery
from .store import RendezvousStore
from .v1 import agent_pb2 as pb

State = pb.StatusResponse.State
STEP_RECORDS = 1000
DEFAULT_GRACE_S = 30.0
"""How long a worker told to leave expects to live on (Kubernetes' default
``terminationGracePeriodSeconds``; the worker's ``--grace-seconds``)."""


@dataclass
class Previous:
    """The generation before the running one, its redundancy kept after a planned switch
    until the running generation can be restored on its own (``until``: a step counter)."""

    generation: int
    layout: Layout
    redundancy: Redundancy
    until: int


@dataclass
class Pending:
    """A prepared generation and, once it arrives, its Commit: the checked Prepare
    (``args``, as it arrived) and what the worker adds to it."""

    args: PrepareArgs
    """The Prepare (its ``nodes``, device -> node, say where the mirrors go)."""
    layout: Layout
    """``args.layout`` bound to ``args.devices``: the world the switch goes to."""
    checkpoint: str
    """``args.checkpoint`` resolved under the worker's checkpoint roots (empty: none)."""
    future: Future
    aborted: bool = False
    commit_at: int | None = None
    """None until committed; 0 = agreed boundary; else the step counter to switch at."""
    reply: Future = field(default_factory=Future)

    @property
    def generation(self) -> int:
        return self.args.generation


CHECKPOINT_SIGNAL = float(1 << 20)
"""What a rank holding a Checkpoint adds to its step's signal (a rank holding a Commit adds
1): the sum says how many ranks hold each, exactly (float64, worlds below 2**20)."""


@dataclass
class CheckpointWanted:
    """A Checkpoint the training loop has to write at the first boundary every rank agrees
    on (each rank signals it in a step's all-reduce, like a Commit at step 0)."""

    generation: int
    stop: bool
    reply: Future = field(default_factory=Future)
    signalled: bool = False
    """This rank has put it in a step's signal (set by the loop)."""


class WorkerControl:
    """A worker's state and the agent's :class:`~dynatrain.agent.server.Control` over it
    (agent threads). The training loop (:class:`~dynatrain.agent.worker_loop.TrainingLoop`)
    holds a reference to it and reads and changes this state under :attr:`lock`."""

    def __init__(self, job: JobSpec, device: int, *, backend: str = "gloo",
                 metrics: Metrics | None = None, torch_device: torch.device | None = None,
                 checkpoint_dir: str = "",
                 checkpoint_sources: tuple[str, ...] | list[str] = ()):
        self.job, self.device, self.backend = job, device, backend
        self.torch_device = torch_device or torch.device("cpu")
        self.metrics = metrics or Metrics(namespace=job.namespace, job=job.name,
                                          reasons=REASONS)
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.state = State.STANDBY
        self.trainer: Trainer | None = None
        self.generation = 0
        self.highest_prepared = 0
        self.layout: Layout | None = None
        self.rank = -1
        self.pending: Pending | None = None
        self.wanted: CheckpointWanted | None = None
        """A Checkpoint not yet written (:meth:`checkpoint`)."""
        self.records: collections.deque = collections.deque(maxlen=STEP_RECORDS)
        self.last_switch = pb.SwitchReport()
        self.error = ""
        self.store = None
        self._stores: dict[str, RendezvousStore] = {}
        """Rendezvous address -> its store, kept for the worker's life (see :meth:`_connect`)."""
        self.stopping = False
        self.leaving_at: float | None = None
        """Monotonic time its grace period ends, once told to leave
        (:meth:`~dynatrain.agent.worker_loop.TrainingLoop.leave`)."""
        self.grace_s = DEFAULT_GRACE_S
        self.left_read = threading.Event()
        self.tokens_per_second = 0.0
        self.redundancy: Redundancy | None = None
        self.previous: Previous | None = None
        self.checkpoint_dir = checkpoint_dir or job.recovery.checkpoint_dir
        self.checkpoint_roots = tuple(r for r in (self.checkpoint_dir, *checkpoint_sources) if r)
        """Where a Prepare's checkpoint may come from: the checkpoint dir (where this job's
        own checkpoints go) and the ``--checkpoint-source`` directories (e.g. the local
        runner's ``--resume-from``)."""
        self.checkpoint: tuple[str, int] | None = None
        self.checkpoint_time = 0.0
        """Wall time the newest checkpoint was written (its age is a metric)."""
        self.snapshot_buffers = HostBuffers(pin=self.torch_device.type == "cuda")
        """The snapshot slots' host buffers: exact size, pinned once on a GPU, reused by the
        next generation (reserved in its Prepare, so nothing is pinned inside the pause)."""
        self.mirror_buffers = HostBuffers(pin=False)

    # -- the Control interface (agent threads) ----------------------------------------------
    def prepare(self, args: PrepareArgs) -> None:
        """``args.old_layout`` (with its devices) is the world the switch starts from; None for
        the job's first generation. Joiners learn it here; members check it against their own.
        A ``recovery`` abandons the running generation at once (its collectives are cut short)
        and starts from the in-memory snapshots of ``recovery.restore_step``. ``args`` stays
        whole in the :class:`Pending`, beside the bound layout and the resolved checkpoint."""
        generation, devices, recovery = args.generation, args.devices, args.recovery
        old_layout, timeout_s = args.old_layout, args.timeout_s
        layout = args.layout.with_devices(devices)
        try:
            self.job.train_config(layout)          # fits the model and the batch?
        except ValueError as e:
            raise InvalidRequest(f"layout {layout.to_text()!r} cannot run this job: {e}"
                                 ) from None
        checkpoint = args.checkpoint
        if checkpoint:
            try:
                checkpoint = check_checkpoint_path(checkpoint, self.checkpoint_roots)
            except CheckpointPathError as e:
                raise InvalidRequest(f"device {self.device}: {e}") from None
        # A recovery, or a checkpoint start on a device that holds state, replaces the running
        # generation without moving its live state: cut its collectives short now, so the
        # training loop (or a transfer in flight) raises and waits, INTERRUPTED, for this one.
        abandoning = recovery is not None or bool(checkpoint and self.layout is not None)
        if abandoning:
            # Every refusal that does not depend on the abandon comes before it: once the
            # running generation is cut short, the job must recover.
            with self.lock:
                self._check_can_prepare(generation, devices, checkpoint, old_layout,
                                        abandoning=True)
        if recovery is not None:
            self._check_restorable(recovery, old_layout)
        if abandoning:
            why = (f"devices {sorted(recovery.failed)} failed" if recovery
                   else f"restarting from checkpoint {checkpoint}")
            abandon.abandon(f"generation {self.generation} abandoned: {why} "
                            f"({args.reason or 'recovery'})")
            self._drop_uncommitted()
        with self.lock:
            if abandoning:                # a switch in flight fails on the abandon: let it end
                deadline = time.monotonic() + timeout_s
                while (self.pending is not None and self.pending.commit_at is not None
                       and time.monotonic() < deadline):
                    self.wake.wait(0.05)
            self._check_can_prepare(generation, devices, checkpoint, old_layout,
                                    abandoning=abandoning)
            if self.pending is not None and not self.pending.aborted:
                raise PreconditionFailed(f"generation {self.pending.generation} is still "
                                         "prepared; abort it first")
            mine = _describe(self.layout)
            # A recovery may start from the generation before the running one (its
            # snapshots are kept for a while), and a member that holds nothing of the world
            # it starts from takes part as a joiner.
            from_kept = recovery is not None and old_layout is not None and (
                self.redundancy_for(old_layout) is not None
                or self.device not in old_layout.device_of)
            if self.layout is not None and not checkpoint and not from_kept \
                    and _describe(old_layout) != mine:
                raise PreconditionFailed(f"the switch starts from {_describe(old_layout)} but "
                                         f"device {self.device} runs {mine}")
            self.highest_prepared = generation    # reserved: a second Prepare of g is stale
        # Outside the lock: connecting may wait, and the training loop must not.
        try:
            self._connect(args.rendezvous, timeout_s)
        except PreconditionFailed:
            raise
        except Exception as e:
            raise PreconditionFailed(f"rendezvous store {args.rendezvous} is unreachable from "
                                     f"device {self.device}: {e}") from e
        mgr = DeviceManager(self.store, self.device, backend=self.backend,
                            timeout=timedelta(seconds=timeout_s))
        model = self.job.model
        new_bound = bind(layout, model)

        mirror = self.job.recovery.mirror and layout.world > 1
        # The mirrors go from one host buffer (pinned, under CUDA) to another: always gloo,
        # which NCCL (device memory only) could not carry.
        host = mgr if self.backend == "gloo" else DeviceManager(
            self.store, self.device, backend="gloo", timeout=timedelta(seconds=timeout_s))

        def build_extra(rank):
            # The new generation's host slots, made (and pinned) now, off the pause.
            sizes = slot_sizes(new_bound, rank, args.nodes or args.devices_per_node,
                               mirror=mirror)
            self.snapshot_buffers.reserve([sizes.snapshot] * 2)
            self.mirror_buffers.reserve([sizes.mirror] * 2)
            groups = build_groups(new_bound, rank, mgr.group_factory(generation, layout))
            # Mirrors travel on a group of their own, beside the training's collectives.
            return groups, (host.build_group(generation, "mirror", list(layout.device_of))
                            if mirror else None)

        # The plan's link costs read the real nodes where the Prepare names them (the same
        # names on every worker, so every worker still plans the same switch), as the mirrors do.
        future = mgr.prepare(generation, model, old_layout, layout,
                             staging_bytes=args.staging_bytes, build_extra=build_extra,
                             devices_per_node=args.nodes or args.devices_per_node,
                             dead=recovery.failed if recovery else frozenset(),
                             proxies=recovery.proxies if recovery else None,
                             preallocate=(functools.partial(preallocate, device=self.device)
                                          if self.torch_device.type == "cpu" else None))
        with self.lock:
            self.pending = Pending(args, layout, checkpoint, future)

    def _check_can_prepare(self, generation: int, devices: tuple[int, ...], checkpoint: str,
                           old_layout: Layout | None, *, abandoning: bool) -> None:
        """The state and generation rules of a Prepare (under the lock). Run before an
        abandon, and again after it (the state may have moved on while it waited)."""
        bad = (State.LEFT, State.FAILED, State.FINISHED, State.SUSPENDED)
        if self.state in bad or (self.state == State.SWITCHING and not abandoning):
            raise PreconditionFailed(f"device {self.device} is "
                                     f"{State.Name(self.state)}; it cannot prepare")
        if generation <= max(self.generation, self.highest_prepared):
            raise PreconditionFailed(
                f"generation {generation} is stale: device {self.device} is at generation "
                f"{self.generation} and has prepared up to {self.highest_prepared}")
        if (self.layout is None or checkpoint) and self.device not in devices:
            raise PreconditionFailed(f"device {self.device} holds no state and is not in "
                                     f"the new layout's devices {_ids(devices)}")
        if old_layout is not None and self.device not in old_layout.device_of + tuple(devices):
            raise PreconditionFailed(f"device {self.device} is in neither layout")

    def _check_restorable(self, recovery: Recovery, old_layout: Layout | None) -> None:
        """A recovery can only start from snapshots and mirrors this device really holds."""
        if old_layout is None or self.device not in old_layout.device_of:
            return                                    # holds nothing of the old world
        r = self.redundancy_for(old_layout)
        own, mirrors = r.holdings() if r is not None else ([], [])
        if recovery.restore_step not in own:
            raise PreconditionFailed(f"device {self.device} holds snapshots of steps {own}, "
                                     f"not of step {recovery.restore_step}")
        for dead, proxy in recovery.proxies.items():
            if proxy == self.device and recovery.restore_step not in mirrors:
                raise PreconditionFailed(
                    f"device {self.device} mirrors steps {mirrors} of device {dead}, not step "
                    f"{recovery.restore_step}")

    def redundancy_for(self, layout: Layout | None) -> Redundancy | None:
        """The redundancy of the generation that ran ``layout`` (with its devices): the
        running one's, or the kept previous one's; None if neither."""
        if layout is None:
            return None
        if self.redundancy is not None and _describe(self.layout) == _describe(layout):
            return self.redundancy
        prev = self.previous
        if prev is not None and _describe(prev.layout) == _describe(layout):
            return prev.redundancy
        return None

    def _drop_uncommitted(self) -> None:
        with self.lock:
            p = self.pending
            if p is not None and p.commit_at is None:
                p.aborted = True
                self.pending = None

    def commit(self, generation: int, at_step: int, timeout_s: float) -> pb.CommitResponse:
        """Switch at a step boundary; a repeated Commit (a restarted controller) waits for the
        same switch instead of failing."""
        with self.lock:
            p = self.pending
            if p is None or p.aborted or p.generation != generation:
                have = "nothing" if p is None or p.aborted else f"generation {p.generation}"
                raise PreconditionFailed(f"device {self.device} has {have} prepared, not "
                                         f"generation {generation}")
            if p.commit_at is None:
                if not p.future.done():
                    raise PreconditionFailed(f"generation {generation} is not ready yet on "
                                             f"device {self.device} (Status says when it is)")
                if p.future.exception() is not None:
                    raise PreconditionFailed(f"generation {generation} failed to prepare on "
                                             f"device {self.device}: {p.future.exception()}")
                if self.state == State.FINISHED:
                    raise PreconditionFailed(f"the job finished at step {self.trainer.step}")
                if at_step and self.trainer is not None and self.trainer.step > at_step:
                    raise PreconditionFailed(f"step {at_step} has passed (device "
                                             f"{self.device} is at step {self.trainer.step})")
                p.commit_at = at_step
                self.wake.notify_all()
            reply = p.reply
        return self._answer(reply, timeout_s, f"generation {generation} did not switch")

    def write_checkpoint(self, generation: int, stop: bool,
                         timeout_s: float) -> pb.CheckpointResponse:
        """Write a checkpoint of the running generation at the first step boundary every
        rank agrees on (the training loop writes it; every rank its part), and with ``stop``
        train no further (SUSPENDED: a suspended job's workers wait to be stopped). A
        repeated call (a restarted controller) waits for the same checkpoint."""
        with self.lock:
            w = self.wanted
            if w is None or w.generation != generation:
                if not self.checkpoint_dir:
                    raise PreconditionFailed(
                        f"device {self.device} has no checkpoint directory to write to (the "
                        "worker's --checkpoint-dir; on a cluster, the job's spec.checkpoint)")
                if self.state != State.TRAINING or self.trainer is None:
                    raise PreconditionFailed(f"device {self.device} is "
                                             f"{State.Name(self.state)}; only a training "
                                             "generation can write a checkpoint")
                if generation != self.generation:
                    raise PreconditionFailed(f"generation {generation} is not running on "
                                             f"device {self.device} (it runs generation "
                                             f"{self.generation})")
                if self.pending is not None and not self.pending.aborted:
                    raise PreconditionFailed(f"generation {self.pending.generation} is "
                                             "prepared; commit or abort it first")
                w = self.wanted = CheckpointWanted(generation, stop)
                self.wake.notify_all()
            reply = w.reply
        return self._answer(reply, timeout_s,
                            f"the checkpoint of generation {generation} was not written")

    def _answer(self, reply: Future, timeout_s: float, late: str):
        """What the training loop answers a Commit or Checkpoint with, within ``timeout_s``
        (else :class:`CommitTimeout`, saying ``late``)."""
        try:
            return reply.result(timeout=timeout_s)
        except TimeoutError:
            raise CommitTimeout(f"{late} within {timeout_s} s on device {self.device}") from None

    def abort(self, generation: int, reason: str) -> bool:
        with self.lock:
            p = self.pending
            if p is None or p.generation != generation or p.aborted:
                return False
            if p.commit_at is not None:
                raise PreconditionFailed(f"generation {generation} is committed; a switch in "
                                         "progress cannot be aborted")
            p.aborted = True
            self.pending = None
            return True

    def status(self, since_step: int) -> pb.StatusResponse:
        with self.lock:
            p = self.pending
            out = pb.StatusResponse(
                state=self.state, device=self.device, generation=self.generation,
                layout=self.layout.to_text() if self.layout else "",
                devices=list(self.layout.device_of) if self.layout else [], rank=self.rank,
                step=self.trainer.step if self.trainer else 0,
                data_position=self.trainer.position if self.trainer else 0,
                last_switch=self.last_switch, error=self.error,
                tokens_per_second=self.tokens_per_second,
                collective_wait_seconds=abandon.longest_wait())
            if self.leaving_at is not None:
                out.leaving = True
                out.leaving_in_seconds = max(0.0, self.leaving_at - time.monotonic())
            if p is not None:
                out.prepared_generation = p.generation
                out.prepared_layout = p.layout.to_text()
                out.prepared_devices.extend(p.layout.device_of)
                out.prepared_committed = p.commit_at is not None
                out.prepared_ready = p.future.done() and p.future.exception() is None
                if p.future.done() and p.future.exception() is not None:
                    out.prepared_error = str(p.future.exception())
            out.steps.extend(r for r in self.records if r.step > since_step)
            r = self.redundancy
            out.mirror_of = -1
            if r is not None:
                own, mirrors = r.holdings()
                out.snapshot_steps.extend(own)
                out.mirror_steps.extend(mirrors)
                if r.source is not None and self.layout is not None:
                    out.mirror_of = self.layout.device_of[r.source]
            if self.checkpoint is not None:
                out.checkpoint, out.checkpoint_step = self.checkpoint
            prev = self.previous
            out.previous_mirror_of = -1
            if prev is not None:
                own, mirrors = prev.redundancy.holdings()
                out.previous_generation = prev.generation
                out.previous_layout = prev.layout.to_text()
                out.previous_devices.extend(prev.layout.device_of)
                out.previous_snapshot_steps.extend(own)
                out.previous_mirror_steps.extend(mirrors)
                if prev.redundancy.source is not None:
                    out.previous_mirror_of = prev.layout.device_of[prev.redundancy.source]
            if self.state == State.LEFT:
                self.left_read.set()
            return out

    def _connect(self, rendezvous: str, timeout_s: float) -> None:
        """The controller's rendezvous store (:mod:`dynatrain.controller.rendezvous`, over
        gRPC) at ``rendezvous``: one per address for the worker's life. Every generation's
        groups call it, an aborted one's included, after newer generations have started, and
        its Python object must outlive them all (:mod:`.store`, "Lifetime"); one channel
        carries concurrent calls, so a generation stuck in its rendezvous holds up no other."""
        store = self._stores.get(rendezvous)
        if store is None:
            host, port = rendezvous.rsplit(":", 1)
            store = RendezvousStore(host, int(port), timeout=timedelta(seconds=timeout_s))
            self._stores[rendezvous] = store
        else:
            store.set_timeout(timedelta(seconds=timeout_s))
        self.store = store


def _ids(devices, limit: int = 16) -> str:
    devices = list(devices)
    return str(devices) if len(devices) <= limit else f"{devices[:limit]} ({len(devices)} in all)"


def _describe(layout: Layout | None) -> str:
    if layout is None:
        return "nothing (a fresh start)"
    return f"{layout.to_text()} on devices {list(layout.device_of)}"
