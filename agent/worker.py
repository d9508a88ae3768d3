"""One training process: the reference trainer, driven by the agent that runs beside it.

The process starts in *standby*: the agent serves (gRPC and metrics), no state is held, torch's
lazy setup has been paid. Everything else arrives through the agent:

- ``Prepare(g, layout, devices, rendezvous)`` starts the background work of generation ``g``
  (:meth:`DeviceManager.prepare`: plan, rounds, the transition group, the new layout's
  groups) while the training loop keeps stepping. The first generation has no old layout: its
  preparation only builds the groups, and its commit builds a fresh trainer from the seed.
- ``Commit(g)`` is answered by the training loop at a step boundary. With ``at_step = 0`` the
  boundary is agreed without guessing: every rank adds 1 to the step's own loss all-reduce once
  it holds the commit (``Trainer.train_step(signal=...)``), so all ranks see the same sum at the
  same step and switch together right after it. Joiners hold no state and enter the switch at
  once; the transfer's first collective waits for the old world to arrive.
- A device that leaves in a switch answers its Commit, lingers until its last Status has been
  read (or a few seconds), and exits 0.

RPCs run on the gRPC server's threads and only exchange small messages with the training loop
under a lock, so an RPC (good or bad) never blocks or crashes a step.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dynatrain.controller.job import JobSpec, load_job
from dynatrain.trainer.checkpoint import load_state, save_checkpoint
from dynatrain.trainer.groups import build_groups
from dynatrain.trainer.redundancy import Redundancy
from dynatrain.trainer.switch import preallocate, switch
from dynatrain.trainer.trainer import Trainer, warm_up
from dynatrain.vps import abandon
from dynatrain.vps.generations import DeviceManager, PreparedSwitch
from dynatrain.vps.layout import Layout, bind
from dynatrain.vps.transition import TransitionConfig

from .metrics import REASONS, Metrics
from .server import (CommitTimeout, InvalidRequest, PreconditionFailed, Recovery,
                     SwitchAborted, serve)
from .v1 import agent_pb2 as pb

State = pb.StatusResponse.State
STEP_RECORDS = 1000
LINGER_SECONDS = 5.0


@dataclass
class _Pending:
    """A prepared generation and, once it arrives, its Commit."""

    generation: int
    layout: Layout
    reason: str
    future: Future
    timeout_s: float
    staging_bytes: int
    devices_per_node: int = 1
    old_layout: Layout | None = None
    recovery: Recovery | None = None
    checkpoint: str = ""
    aborted: bool = False
    commit_at: int | None = None
    """None until committed; 0 = agreed boundary; else the step counter to switch at."""
    reply: Future = field(default_factory=Future)


class Worker:
    """The training loop and the agent's :class:`~dynatrain.agent.server.Control`."""

    def __init__(self, job: JobSpec, device: int, *, backend: str = "gloo",
                 metrics: Metrics | None = None, torch_device: torch.device | None = None,
                 checkpoint_dir: str = ""):
        self.job, self.device, self.backend = job, device, backend
        self.torch_device = torch_device or torch.device("cpu")
        self.metrics = metrics or Metrics(reasons=REASONS)
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.state = State.STANDBY
        self.trainer: Trainer | None = None
        self.generation = 0
        self.highest_prepared = 0
        self.layout: Layout | None = None
        self.rank = -1
        self.pending: _Pending | None = None
        self.records: collections.deque = collections.deque(maxlen=STEP_RECORDS)
        self.last_switch = pb.SwitchReport()
        self.error = ""
        self.store = None
        self.stopping = False
        self.left_read = threading.Event()
        self.tokens_per_second = 0.0
        self.redundancy: Redundancy | None = None
        self.checkpoint_dir = checkpoint_dir or job.recovery.checkpoint_dir
        self.checkpoint: tuple[str, int] | None = None
        self.dump_steps = {int(x) for x in os.environ.get("DYNATRAIN_DUMP_STEPS", "").split(",")
                           if x.strip()}
        """Steps whose state ``dynatrain bench chaos`` asks to keep (read once, not per step)."""
        self._graveyard: list = []
        """Groups of abandoned generations: never used again, never destroyed (tearing down
        a gloo group with a wait still stuck in it can block)."""

    # -- the Control interface (agent threads) ----------------------------------------------
    def prepare(self, generation: int, layout: Layout, devices: tuple[int, ...],
                rendezvous: str, devices_per_node: int, staging_bytes: int, timeout_s: float,
                reason: str = "", old_layout: Layout | None = None,
                recovery: Recovery | None = None, checkpoint: str = "") -> None:
        """``old_layout`` (with its devices) is the world the switch starts from; None for the
        job's first generation. Joiners learn it here; members check it against their own.
        A ``recovery`` abandons the running generation at once (its collectives are cut short)
        and starts from the in-memory snapshots of ``recovery.restore_step``."""
        layout = layout.with_devices(devices)
        try:
            self.job.train_config(layout)          # fits the model and the batch?
        except ValueError as e:
            raise InvalidRequest(f"layout {layout.to_text()!r} cannot run this job: {e}"
                                 ) from None
        # A recovery, or a checkpoint start on a device that holds state, replaces the running
        # generation without moving its live state: cut its collectives short now, so the
        # training loop (or a transfer in flight) raises and waits, INTERRUPTED, for this one.
        abandoning = recovery is not None or bool(checkpoint and self.layout is not None)
        if recovery is not None:
            self._check_restorable(recovery, old_layout)
        if abandoning:
            why = (f"devices {sorted(recovery.failed)} failed" if recovery
                   else f"restarting from checkpoint {checkpoint}")
            abandon.abandon(f"generation {self.generation} abandoned: {why} "
                            f"({reason or 'recovery'})")
            self._drop_uncommitted()
        with self.lock:
            if abandoning:                # a switch in flight fails on the abandon: let it end
                deadline = time.monotonic() + timeout_s
                while (self.pending is not None and self.pending.commit_at is not None
                       and time.monotonic() < deadline):
                    self.wake.wait(0.05)
            bad = (State.LEFT, State.FAILED, State.FINISHED)
            if self.state in bad or (self.state == State.SWITCHING and not abandoning):
                raise PreconditionFailed(f"device {self.device} is "
                                         f"{State.Name(self.state)}; it cannot prepare")
            if generation <= max(self.generation, self.highest_prepared):
                raise PreconditionFailed(
                    f"generation {generation} is stale: device {self.device} is at generation "
                    f"{self.generation} and has prepared up to {self.highest_prepared}")
            if self.pending is not None and not self.pending.aborted:
                raise PreconditionFailed(f"generation {self.pending.generation} is still "
                                         "prepared; abort it first")
            if (self.layout is None or checkpoint) and self.device not in devices:
                raise PreconditionFailed(f"device {self.device} holds no state and is not in "
                                         f"the new layout's devices {list(devices)}")
            mine = _describe(self.layout)
            if self.layout is not None and not checkpoint and _describe(old_layout) != mine:
                raise PreconditionFailed(f"the switch starts from {_describe(old_layout)} but "
                                         f"device {self.device} runs {mine}")
            old = old_layout
            if old is not None and self.device not in old.device_of + tuple(devices):
                raise PreconditionFailed(f"device {self.device} is in neither layout")
            self.highest_prepared = generation    # reserved: a second Prepare of g is stale
        # Outside the lock: connecting may wait, and the training loop must not.
        try:
            self._connect(rendezvous, timeout_s)
        except PreconditionFailed:
            raise
        except Exception as e:
            raise PreconditionFailed(f"rendezvous store {rendezvous} is unreachable from "
                                     f"device {self.device}: {e}") from e
        mgr = DeviceManager(self.store, self.device, backend=self.backend,
                            timeout=timedelta(seconds=timeout_s))
        model = self.job.model
        new_bound = bind(layout, model)

        mirror = self.job.recovery.mirror and layout.world > 1

        def build_extra(rank):
            groups = build_groups(new_bound, rank, mgr.group_factory(generation, layout))
            # Mirrors travel on a group of their own, beside the training's collectives.
            return groups, (mgr.build_group(generation, "mirror", list(layout.device_of))
                            if mirror else None)

        future = mgr.prepare(generation, model, old, layout, staging_bytes=staging_bytes,
                             build_extra=build_extra, gpus_per_node=devices_per_node,
                             dead=recovery.failed if recovery else frozenset(),
                             proxies=recovery.proxies if recovery else None,
                             preallocate=(functools.partial(preallocate, device=self.device)
                                          if self.torch_device.type == "cpu" else None))
        with self.lock:
            self.pending = _Pending(generation, layout, reason, future, timeout_s, staging_bytes,
                                    devices_per_node, old, recovery, checkpoint)

    def _check_restorable(self, recovery: Recovery, old_layout: Layout | None) -> None:
        """A recovery can only start from snapshots and mirrors this device really holds."""
        if old_layout is None or self.device not in old_layout.device_of:
            return                                    # holds nothing of the old world
        r = self.redundancy
        own, mirrors = r.holdings() if r is not None else ([], [])
        if recovery.restore_step not in own:
            raise PreconditionFailed(f"device {self.device} holds snapshots of steps {own}, "
                                     f"not of step {recovery.restore_step}")
        for dead, proxy in recovery.proxies.items():
            if proxy == self.device and recovery.restore_step not in mirrors:
                raise PreconditionFailed(
                    f"device {self.device} mirrors steps {mirrors} of device {dead}, not step "
                    f"{recovery.restore_step}")

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
        try:
            return reply.result(timeout=timeout_s)
        except TimeoutError:
            raise CommitTimeout(f"generation {generation} did not switch within {timeout_s} s "
                                f"on device {self.device}") from None

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
                tokens_per_second=self.tokens_per_second)
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
            if self.state == State.LEFT:
                self.left_read.set()
            return out

    # -- the training loop (main thread) ----------------------------------------------------
    def run(self) -> int:
        while True:
            with self.lock:
                if self.stopping:
                    return 0
                due = self._due()
                if due is None and (self.trainer is None or self.state == State.FINISHED):
                    self.wake.wait(timeout=0.2)
                    continue
                signal_value = 1.0 if (self.pending and self.pending.commit_at == 0
                                       and self.trainer is not None) else 0.0
            if due is not None:
                self._switch(due)
                if self.state == State.LEFT:
                    deadline = time.monotonic() + LINGER_SECONDS
                    while not (self.left_read.wait(0.2) or self.stopping
                               or time.monotonic() > deadline):
                        pass
                    return 0
                continue
            try:
                result = self.trainer.train_step(
                    signal_value, self.redundancy.wait_mirror if self.redundancy else None)
                self._after_step()
            except Exception as e:                   # a peer died, or we were told so
                self._interrupt(e)
                continue
            self._record(result)
            with self.lock:
                if self.trainer.step >= self.job.training.steps:
                    self.state = State.FINISHED
                p = self.pending
                world = self.layout.world
                if (p is not None and p.commit_at == 0 and signal_value
                        and round(result.signal) == world):
                    p.commit_at = -1          # agreed: switch at this boundary
                    self.wake.notify_all()

    def _after_step(self) -> None:
        """Redundancy at the step boundary: the in-memory snapshot (and its mirror to the
        buddy), and the periodic checkpoint when one is due."""
        t = self.trainer
        if self.redundancy is not None:
            self.redundancy.snapshot(t.local_state())
        if t.step in self.dump_steps:
            _dump_state(t, f"step{t.step}")
        every = self.job.recovery.checkpoint_interval
        if every and self.checkpoint_dir and t.step % every == 0:
            g = t.g
            saved = save_checkpoint(t.local_state(), self.job.model, self.checkpoint_dir,
                                    group=g.world, group_rank=g.rank,
                                    group_size=self.layout.world,
                                    keep=self.job.recovery.checkpoint_keep)
            with self.lock:
                self.checkpoint = (saved.path, t.step)

    def _interrupt(self, error: Exception) -> None:
        """The running generation failed under this device: drop the live trainer (its state
        may be half-way through a step), keep the snapshots, wait for a recovery Prepare."""
        with self.lock:
            trainer, self.trainer = self.trainer, None
            if trainer is not None:
                self._graveyard.append(trainer.g)
            self.state = State.INTERRUPTED
            self.error = f"generation {self.generation} interrupted: {error}"
            self.wake.notify_all()
        print(f"device {self.device}: {self.error}", flush=True)

    def _due(self) -> _Pending | None:
        """The committed generation to switch to now, if any (lock held)."""
        p = self.pending
        if p is None or p.commit_at is None:
            return None
        if self.trainer is None:                      # a joiner / the first generation
            return p
        if p.commit_at == -1 or (p.commit_at > 0 and self.trainer.step >= p.commit_at):
            return p
        if p.commit_at == 0 and self.layout.world == 1:
            return p                                  # no one to agree with
        return None

    def _switch(self, p: _Pending) -> None:
        with self.lock:
            self.state = State.SWITCHING
        if p.recovery is not None or p.checkpoint:
            abandon.reset()        # we are out of the failed generation's collectives now
        prepared: PreparedSwitch = p.future.result()
        groups, mirror_group = prepared.extra if prepared.extra is not None else (None, None)
        prepared = dataclasses.replace(prepared, extra=groups)   # what the trainer is built on
        new_cfg = self.job.train_config(p.layout)
        old_layout = self.layout
        step_before = self.trainer.step if self.trainer is not None else 0
        t0 = time.perf_counter()
        try:
            if prepared.plan is None:                 # the first generation
                state = None
                if p.checkpoint:                      # ... from a checkpoint, any layout
                    state = load_state(bind(p.layout, self.job.model), prepared.new_rank,
                                       p.checkpoint, device=self.torch_device)
                trainer = Trainer(new_cfg, groups, device=self.torch_device, state=state)
                pause = time.perf_counter() - t0
                phases = {"rebuild": pause}
                sent = received = local = 0
            else:
                holder = [self.trainer] if self.trainer is not None else []
                self.trainer = None
                restored, mirrored = self._restore(p)
                res = switch(holder, prepared, new_cfg, self.device,
                             config=TransitionConfig(staging_bytes=p.staging_bytes,
                                                     timeout=timedelta(seconds=p.timeout_s)),
                             torch_device=self.torch_device, restored=restored,
                             mirrored=mirrored, graveyard=self._graveyard)
                trainer, pause, phases = res.trainer, res.pause_seconds, dict(res.phases)
                sent, received = res.transfer.bytes_sent, res.transfer.bytes_received
                local = res.transfer.bytes_local
                print(f"device {self.device}: generation {p.generation}: pause "
                      f"{pause * 1e3:.1f} ms; {res.transfer.bytes_copied} bytes copied, "
                      f"{res.transfer.bytes_carved} carved, {res.transfer.bytes_adopted} "
                      f"adopted, {res.transfer.bytes_allocated} allocated in the pause",
                      flush=True)
            redundancy = None
            if trainer is not None:
                # Own snapshots always (a failure rolls every survivor back to one step);
                # mirrors to the buddy when the job asks for them.
                redundancy = Redundancy(bind(p.layout, self.job.model), prepared.new_rank,
                                        mirror_group, mirror=mirror_group is not None,
                                        ranks_per_node=p.devices_per_node, wait=abandon.wait)
                redundancy.snapshot(trainer.local_state())   # a failure now restores here
        except Exception as e:      # TransitionError, GenerationAbandoned, anything else
            # The switch did not happen here; the snapshots taken before it still hold (a
            # failed switch is recovered like a failed step).
            with self.lock:
                self.trainer = None
                if self.pending is p:
                    self.pending = None
                # Its groups may have waits stuck in them (see _graveyard).
                self._graveyard.append((prepared.transition_group, groups, mirror_group))
                holds_state = self.redundancy is not None or old_layout is None
                self.state = State.INTERRUPTED if holds_state else State.FAILED
                self.error = f"switch to generation {p.generation} failed: {e}"
                self.wake.notify_all()
            print(f"device {self.device}: {self.error}", flush=True)
            self.metrics.observe_switch(p.reason or "unknown", "failed", {}, 0)
            p.reply.set_exception(SwitchAborted(str(e)))
            return
        phases["prepare"] = prepared.seconds
        step = trainer.step if trainer is not None else step_before
        reply = pb.CommitResponse(
            generation=p.generation, step=step, pause_seconds=pause, phase_seconds=phases,
            bytes_sent=sent, bytes_received=received, bytes_local=local,
            new_rank=-1 if prepared.new_rank is None else prepared.new_rank)
        self.metrics.observe_switch(p.reason or "unknown", "success",
                                    {"prepare": prepared.seconds, "pause": pause,
                                     "transfer": phases.get("transfer", 0.0)}, sent)
        with self.lock:
            old_redundancy, self.redundancy = self.redundancy, redundancy
            self.trainer = trainer
            self.generation = p.generation
            self.pending = None
            self.error = ""
            if p.recovery is not None or p.checkpoint:
                # Steps after the restored one were lost with the failed generation; they are
                # trained again (and reported again) from here.
                kept = [r for r in self.records if r.step <= step]
                self.records.clear()
                self.records.extend(kept)
            self.last_switch = pb.SwitchReport(
                generation=p.generation, from_layout=old_layout.to_text() if old_layout else "",
                to_layout=p.layout.to_text(), step=step, pause_seconds=pause,
                bytes_sent=sent, bytes_received=received)
            if trainer is None:
                self.state, self.layout, self.rank = State.LEFT, None, -1
            else:
                self.layout, self.rank = p.layout, prepared.new_rank
                done = trainer.step >= self.job.training.steps
                self.state = State.FINISHED if done else State.TRAINING
                self.metrics.set_layout(p.layout)
            self.metrics.set_generation(p.generation)
            self.wake.notify_all()
        if old_redundancy is not None:
            old_redundancy.close()
        if trainer is not None and (p.recovery is not None or p.checkpoint):
            _dump_state(trainer, f"gen{p.generation}")
        p.reply.set_result(reply)

    def _restore(self, p: _Pending):
        """A recovery's old state: this device's snapshot of the restore step (if it was in
        the old world) and the mirrors it holds for failed devices (if it is their proxy)."""
        rec = p.recovery
        if rec is None or self.redundancy is None:
            return None, None
        restored = None
        if p.old_layout is not None and self.device in p.old_layout.device_of:
            restored = self.redundancy.restore(rec.restore_step)
        mirrored = {dead: self.redundancy.restore_mirror(rec.restore_step)
                    for dead, proxy in rec.proxies.items() if proxy == self.device}
        return restored, mirrored or None

    def _record(self, r) -> None:
        rec = pb.StepRecord(step=r.step, loss=r.loss, seconds=r.seconds,
                            tokens_per_second=r.tokens_per_second, generation=self.generation,
                            sample_begin=r.samples[0], sample_end=r.samples[1],
                            end_time=time.time())
        with self.lock:
            self.records.append(rec)
            self.tokens_per_second = r.tokens_per_second
        self.metrics.observe_step(r.seconds, r.tokens_per_second, r.step)

    def _connect(self, rendezvous: str, timeout_s: float) -> None:
        """A fresh connection to the rendezvous store for each generation: a generation
        whose preparation is stuck (a member died while its groups were being built) keeps
        its connection busy until its timeout, and must not hold up the next one."""
        host, port = rendezvous.rsplit(":", 1)
        self.store = dist.TCPStore(host, int(port), is_master=False,
                                   timeout=timedelta(seconds=timeout_s))

    def stop(self) -> None:
        """Ask the loop to end at the next step boundary. Safe in a signal handler: it takes
        no lock (the handler runs on the main thread, which may hold the lock right then);
        the loop polls the flag at least every 0.2 s."""
        self.stopping = True


def _watch_parent(pid: int, worker: Worker) -> None:
    """Stop when the runner that started us is gone (killed with no chance to stop us), so a
    crashed runner leaves no workers training on."""
    def watch():
        while os.getppid() == pid:
            time.sleep(1.0)
        print(f"device {worker.device}: parent process {pid} is gone; stopping", flush=True)
        worker.stop()
        time.sleep(10)
        os._exit(1)                   # the training loop did not stop in time (a hung wait)

    threading.Thread(target=watch, name="dynatrain-parent-watch", daemon=True).start()


def _dump_state(trainer: Trainer, tag: str) -> None:
    """For ``dynatrain bench chaos``: with DYNATRAIN_DUMP_RESTORED=DIR, write the state a
    recovery restored (``DIR/gen<g>-rank<r>.pt``), or the state after a step named in
    DYNATRAIN_DUMP_STEPS (``DIR/step<s>-rank<r>.pt``), to be compared across runs."""
    out = os.environ.get("DYNATRAIN_DUMP_RESTORED")
    if not out:
        return
    st = trainer.local_state()
    cpu = {k: (t.detach().cpu().clone(), pieces) for k, (t, pieces) in st.tensors.items()}
    path = Path(out) / f"{tag}-rank{trainer.g.rank}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"tensors": cpu, "step": st.step, "data_position": st.data_position,
                "layout": trainer.lay.to_text(), "world": trainer.lay.world}, str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)


def _describe(layout: Layout | None) -> str:
    if layout is None:
        return "nothing (a fresh start)"
    return f"{layout.to_text()} on devices {list(layout.device_of)}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="dynatrain worker",
        description="One training process with its agent (started by `dynatrain run` or the "
                    "operator's worker pods). It waits in standby until the controller "
                    "prepares and commits a generation that includes it.")
    parser.add_argument("--job", required=True, help="the DynaTrainJob manifest (YAML)")
    parser.add_argument("--device", type=int, required=True, help="this worker's device id")
    parser.add_argument("--host", default="127.0.0.1", help="address the agent binds")
    parser.add_argument("--agent-port", type=int, default=0, help="gRPC port (0: any free)")
    parser.add_argument("--metrics-port", type=int, default=0, help="metrics port (0: any)")
    parser.add_argument("--token-file", help="file holding the callers' bearer token")
    parser.add_argument("--insecure", action="store_true",
                        help="accept unauthenticated callers (tests on loopback only)")
    parser.add_argument("--ready-file", help="write {agent_port, metrics_port, pid} here "
                        "once serving")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--parent-pid", type=int, default=0,
                        help="exit when this process (the local runner) is gone")
    parser.add_argument("--checkpoint-dir", default="",
                        help="where periodic checkpoints go (default: the job's "
                             "spec.recovery.checkpoint.dir)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    job = load_job(args.job)
    metrics = Metrics(reasons=REASONS)
    _, metrics_port = metrics.serve(port=args.metrics_port, addr=args.host)
    worker = Worker(job, args.device, metrics=metrics, checkpoint_dir=args.checkpoint_dir)
    # torch's one-off lazy setup (~1 s) before the agent answers: a joiner that is prepared
    # and committed while still warming up would make every sender wait for it in the switch.
    warm_up()
    server = serve(worker, host=args.host, port=args.agent_port, token_file=args.token_file,
                   insecure=args.insecure)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    if args.parent_pid:
        _watch_parent(args.parent_pid, worker)
    if args.ready_file:
        tmp = Path(args.ready_file + ".tmp")
        tmp.write_text(json.dumps({"agent_port": server.port, "metrics_port": metrics_port,
                                   "pid": os.getpid(), "device": args.device}))
        tmp.rename(args.ready_file)
    try:
        return worker.run()
    finally:
        server.stop(1.0)


if __name__ == "__main__":
    sys.exit(main())
