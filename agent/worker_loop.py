"""A worker's training loop: steps, switches at the committed boundary, redundancy.

:class:`TrainingLoop` runs on the process's main thread. Between steps it takes what the
agent's threads left under the lock of the state it shares with them, its ``control`` (a
:class:`~dynatrain.agent.worker_control.WorkerControl`, which it holds a reference to): a
committed generation is switched to at the step boundary every rank agreed on, a failed step
interrupts the generation and waits for a recovery. After each step it takes the in-memory
snapshot (and mirrors it to the buddy) and, when due, a checkpoint. What only the loop uses
(the training log, the retired and abandoned groups, the MFU's figures) is its own. The two
parts were one class, ``Worker``, split over two files by inheritance; the worker that owns
both is now :class:`~dynatrain.agent.worker.Worker`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path

import torch

from dynatrain.spec.hardware import PROFILES, profile_for_gpu_name
from dynatrain.trainer.checkpoint import load_state, save_checkpoint
from dynatrain.trainer.groups import shut_down
from dynatrain.trainer.redundancy import Redundancy
from dynatrain.trainer.switch import switch
from dynatrain.trainer.trainer import LocalState, Trainer
from dynatrain.vps import abandon, faults
from dynatrain.vps.generations import PreparedSwitch
from dynatrain.vps.layout import bind
from dynatrain.vps.stagecost import training_flops_per_token
from dynatrain.vps.transition import TransitionConfig

from .errors import SwitchAborted
from .metrics import STEP_PHASES, TrainingSample
from .training_log import TrainingLog
from .v1 import agent_pb2 as pb
from .worker_control import CHECKPOINT_SIGNAL, Pending, Previous, State, WorkerControl

LINGER_SECONDS = 5.0


def device_peak_flops(device: torch.device) -> float:
    """Peak FLOP/s of one device, what the modelled MFU divides by: a GPU's preset by its name
    (its datasheet peak), the CPU preset's per-core rate times this process's torch threads;
    NaN for a GPU with no preset (no MFU is claimed for it)."""
    if device.type == "cuda":
        profile = profile_for_gpu_name(torch.cuda.get_device_name(device))
        return profile.peak_flops() if profile is not None else float("nan")
    return PROFILES["cpu"].peak_flops() * torch.get_num_threads()


class TrainingLoop:
    """The training loop (main thread) over the state that it shares with the agent's
    threads: ``control``, whose :attr:`~WorkerControl.lock` guards that state."""

    def __init__(self, control: WorkerControl, *, save_hf: str = "",
                 tensorboard_dir: str = "", log_every: int = 0, share_cores: int = 0,
                 min_step_s: float = 0.0):
        self.control = control
        self.min_step_s = min_step_s
        """A floor on each step's wall time (0: none): a worker that stands in for a GPU on a
        shared CPU (the dev cluster's ``--gpu-pods-on-cpu``) idles the rest of the floor instead
        of training flat out, leaving the cores to the control plane it shares them with. A
        Commit or a checkpoint wakes it at once; a stop or a notice waits out the rest."""
        self.share_cores = share_cores
        """The cores of one machine that the job's workers share (the local runner with
        ``--device-profile shared``): each uses ``share_cores // world`` threads under a layout
        of ``world`` workers, so the cores a released worker gave back go to the others, as
        the cost model that decided the release assumed. 0: the thread count stays."""
        job, device = control.job, control.device
        self.job, self.device = job, device
        self.torch_device, self.metrics = control.torch_device, control.metrics
        """The worker's configuration, as the control holds it (fixed for the worker's life)."""
        self.save_hf = save_hf or job.save_hf
        """Where the trained model goes as a Hugging Face checkpoint when the job completes."""
        self.training_log = TrainingLog(
            job.name, device, steps=job.training.steps, log_every=log_every or job.log_every,
            tensorboard_dir=tensorboard_dir or job.tensorboard_dir(control.checkpoint_dir))
        """The job's step lines and TensorBoard events, while this worker is rank 0."""
        self.flops_per_token = training_flops_per_token(job.model, job.training.seq_len)
        self.peak_flops = device_peak_flops(self.torch_device)
        """Per device, for the modelled MFU (:func:`device_peak_flops`)."""
        self.dump_steps = {int(x) for x in os.environ.get("DYNATRAIN_DUMP_STEPS", "").split(",")
                           if x.strip()}
        """Steps whose state ``dynatrain bench chaos`` asks to keep (read once, not per step)."""
        self._retired_groups: list = []
        """Process groups of generations switched away from, to shut down after a step."""
        self._graveyard: list = []
        """Groups of abandoned generations, and their mirror exchanges still in flight (with
        the buffers gloo may still touch): never used again, never destroyed or waited on
        (tearing down a gloo group with a wait still stuck in it can block)."""

    def run(self) -> int:
        try:
            return self._loop()
        finally:
            self.training_log.close()     # the event file whole, whatever ends the loop

    def _loop(self) -> int:
        told_leaving = False
        while True:
            if self.control.leaving_at is not None and not told_leaving:
                told_leaving = True          # said here: a signal handler must not print
                print(f"device {self.device}: told to leave (SIGTERM); training on until a "
                      f"switch takes this device out of the job, or for at most "
                      f"{self.control.grace_s:g} s", flush=True)
            with self.control.lock:
                if self.control.stopping:
                    return 0
                due = self._due()
                if due is None and (self.control.trainer is None
                                    or self.control.state in (State.FINISHED, State.SUSPENDED)):
                    self.control.wake.wait(timeout=0.2)
                    continue
                signal_value = 1.0 if (self.control.pending
                                       and self.control.pending.commit_at == 0
                                       and self.control.trainer is not None) else 0.0
                wanted = self.control.wanted
                if wanted is not None and self.control.trainer is not None:
                    wanted.signalled = True
                    signal_value += CHECKPOINT_SIGNAL
            if due is not None:
                self._switch(due)
                if self.control.state == State.LEFT:
                    deadline = time.monotonic() + LINGER_SECONDS
                    while not (self.control.left_read.wait(0.2) or self.control.stopping
                               or time.monotonic() > deadline):
                        pass
                    return 0
                continue
            faults.inject("step", self.device)       # a hang here answers Status still
            started = time.monotonic()
            try:
                red = self.control.redundancy
                result = self.control.trainer.train_step(signal_value,
                                                         red.wait_mirror if red else None,
                                                         red.before_update if red else None)
            except Exception as e:                   # a peer died, or we were told so
                self._interrupt(e)
                continue
            # The step is trained: its record (with the samples this reader read) is published
            # before its snapshot, so every step a snapshot holds has a record to account for.
            self._record(result)
            try:
                snapshot_seconds = self._after_step()
            except Exception as e:                   # the mirror exchange met a dead peer
                self._interrupt(e)
                continue
            self._report(result, snapshot_seconds)
            self._shut_down_retired()
            self._release_previous()
            world = self.control.layout.world
            signals = round(result.signal)
            if wanted is not None and (world == 1 or signals // int(CHECKPOINT_SIGNAL) == world):
                try:                                 # every rank agreed: write it now
                    self._write_wanted(wanted)
                except Exception as e:               # a peer died inside the collective save
                    self._interrupt(e)
                    continue
            with self.control.lock:
                if self.control.trainer.step >= self.job.training.steps:
                    self.control.state = State.FINISHED
                p = self.control.pending
                if (p is not None and p.commit_at == 0 and signal_value % CHECKPOINT_SIGNAL
                        and signals % int(CHECKPOINT_SIGNAL) == world):
                    p.commit_at = -1          # agreed: switch at this boundary
                    self.control.wake.notify_all()
                if self.min_step_s and p is None and not self.control.stopping \
                        and self.control.leaving_at is None:
                    rest = self.min_step_s - (time.monotonic() - started)
                    if rest > 0:
                        self.control.wake.wait(timeout=rest)

    def _after_step(self) -> float:
        """Redundancy at the step boundary: the in-memory snapshot (and its mirror to the
        buddy), and the periodic checkpoint when one is due. Returns the snapshot's seconds."""
        t = self.control.trainer
        t0 = time.perf_counter()
        # Every rank snapshots at the same steps (spec.recovery is the same everywhere), as
        # the mirror exchange needs; a generation's first boundary is always snapshotted.
        if self.control.redundancy is not None and t.step % self.job.recovery.snapshot_every == 0:
            self.control.redundancy.snapshot(t.local_state())
        snapshot_seconds = time.perf_counter() - t0
        if t.step in self.dump_steps:
            _dump_state(t, f"step{t.step}")
        if self.save_hf and t.step == self.job.training.steps:
            self._save_hf()
        every = self.job.recovery.checkpoint_interval
        if every and self.control.checkpoint_dir and t.step % every == 0:
            self._save_checkpoint()
        return snapshot_seconds

    def _save_checkpoint(self) -> None:
        """Every rank's part of a DCP checkpoint of this step (collective), into the job's own
        folder of the root (<root>/<job>/step-N): a claim shared with other jobs is pruned per
        job, and Status reports the path in that folder."""
        t = self.control.trainer
        g = t.g
        saved = save_checkpoint(t.local_state(), self.job.model, self.control.checkpoint_dir,
                                group=g.world, group_rank=g.rank,
                                group_size=self.control.layout.world,
                                keep=self.job.recovery.checkpoint_keep,
                                hf_source=self.job.training.init_hf, job=self.job.name)
        with self.control.lock:
            self.control.checkpoint = (saved.path, t.step)
            self.control.checkpoint_time = time.time()

    def _write_wanted(self, wanted) -> None:
        """A Checkpoint every rank agreed on at this boundary: write it (the periodic one of
        this very step, if there is one, is it), answer the call, and with ``stop`` train no
        further."""
        t = self.control.trainer
        t0 = time.perf_counter()
        if self.control.checkpoint is None or self.control.checkpoint[1] != t.step:
            self._save_checkpoint()
        path, step = self.control.checkpoint
        seconds = time.perf_counter() - t0
        with self.control.lock:
            self.control.wanted = None
            if wanted.stop and t.step < self.job.training.steps:
                self.control.state = State.SUSPENDED
        print(f"device {self.device}: wrote the checkpoint of step {step} to {path} in "
              f"{seconds:.2f} s" + ("; suspended: training no further" if wanted.stop
                                    else ""), flush=True)
        wanted.reply.set_result(pb.CheckpointResponse(
            generation=wanted.generation, step=step, path=path, seconds=seconds))

    def _save_hf(self) -> None:
        """The job's last step is trained: every rank writes its part of a DCP checkpoint
        beside the output (on a cluster, the same shared volume), then the job's rank 0 turns
        it into a Hugging Face checkpoint, one output shard in memory at a time, and removes
        it. The job reports finished only after this, so the output is complete when the job
        is. A failed export is said in the log and leaves no output; training is not lost (the
        periodic checkpoints, if any, are untouched)."""
        from dynatrain.trainer.hf_export import export_hf

        t, g, out = self.control.trainer, self.control.trainer.g, Path(self.save_hf)
        root = out.parent / f".{out.name}.checkpoint"
        saved = save_checkpoint(t.local_state(), self.job.model, str(root), group=g.world,
                                group_rank=g.rank, group_size=self.control.layout.world, keep=1,
                                hf_source=self.job.training.init_hf)
        if g.rank != 0:
            return
        try:
            r = export_hf(saved.path, out, copy_from=self.job.training.init_hf,
                          progress=lambda line: print(f"device {self.device}: {line}",
                                                      flush=True))
            print(f"device {self.device}: wrote the trained model (step {t.step}) to {out}: "
                  f"{len(r.files)} safetensors file(s), {r.bytes / 2**20:.1f} MiB", flush=True)
        except Exception as e:       # said, not raised: the job's training is complete
            print(f"device {self.device}: exporting the trained model to {out} failed: {e}",
                  flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _shut_down_retired(self) -> None:
        """The process groups of generations switched away from, shut down here, on the
        training thread, after a step: nothing of theirs is in flight and no kernel of the
        running generation is being launched (:func:`~dynatrain.trainer.groups.shut_down`)."""
        while self._retired_groups:
            shut_down(self._retired_groups.pop())

    def _release_previous(self) -> None:
        """Free the previous generation's snapshots once the running generation can be
        restored on its own (two steps after the switch: its own snapshots and its mirrors
        of a step are then whole everywhere). Their buffers go back to the pools, which keep
        what the next generation is likely to take (this one's sizes) and return the rest."""
        prev = self.control.previous
        if prev is None or (self.control.trainer is not None
                            and self.control.trainer.step < prev.until):
            return
        with self.control.lock:
            self.control.previous = None
        prev.redundancy.close()
        if self.control.redundancy is not None:
            sizes = self.control.redundancy.slot_bytes()
            self.control.snapshot_buffers.trim(keep=[sizes.snapshot] * 2)
            self.control.mirror_buffers.trim(keep=[sizes.mirror] * 2)

    def _interrupt(self, error: Exception) -> None:
        """The running generation failed under this device: drop the live trainer (its state
        may be half-way through a step), keep the snapshots, wait for a recovery Prepare."""
        with self.control.lock:
            trainer, self.control.trainer = self.control.trainer, None
            if trainer is not None:
                self._graveyard.append(trainer.g)
            self.control.state = State.INTERRUPTED
            self.control.error = f"generation {self.control.generation} interrupted: {error}"
            wanted, self.control.wanted = self.control.wanted, None
            if wanted is not None and not wanted.reply.done():
                wanted.reply.set_exception(SwitchAborted(
                    f"the checkpoint was not written: {self.control.error}"))
            self.control.wake.notify_all()
        print(f"device {self.device}: {self.control.error}", flush=True)

    def _due(self) -> Pending | None:
        """The committed generation to switch to now, if any (lock held)."""
        p = self.control.pending
        if p is None or p.commit_at is None:
            return None
        if self.control.trainer is None:              # a joiner / the first generation
            return p
        if p.commit_at == -1 or (p.commit_at > 0 and self.control.trainer.step >= p.commit_at):
            return p
        if p.commit_at == 0 and self.control.layout.world == 1:
            return p                                  # no one to agree with
        return None

    def _switch(self, p: Pending) -> None:
        with self.control.lock:
            self.control.state = State.SWITCHING
        if p.args.recovery is not None or p.checkpoint:
            abandon.reset()        # we are out of the failed generation's collectives now
        prepared: PreparedSwitch = p.future.result()
        groups, mirror_group = prepared.extra if prepared.extra is not None else (None, None)
        prepared = dataclasses.replace(prepared, extra=groups)   # what the trainer is built on
        new_cfg = self.job.train_config(p.layout)
        old_layout = self.control.layout
        step_before = self.control.trainer.step if self.control.trainer is not None else 0
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
                holder = [self.control.trainer] if self.control.trainer is not None else []
                self.control.trainer = None
                restored, mirrored = self._restore(p)
                res = switch(holder, prepared, new_cfg, self.device,
                             config=TransitionConfig(staging_bytes=p.args.staging_bytes,
                                                     timeout=timedelta(seconds=p.args.timeout_s)),
                             torch_device=self.torch_device, restored=restored,
                             mirrored=mirrored, graveyard=self._graveyard)
                trainer, pause, phases = res.trainer, res.pause_seconds, dict(res.phases)
                self._retired_groups.append(res.old_groups)   # shut down after a step
                sent, received = res.transfer.bytes_sent, res.transfer.bytes_received
                local = res.transfer.bytes_local
                print(f"device {self.device}: generation {p.generation}: pause "
                      f"{pause * 1e3:.1f} ms; {res.transfer.bytes_copied} bytes copied, "
                      f"{res.transfer.bytes_carved} carved, {res.transfer.bytes_adopted} "
                      f"adopted, {res.transfer.bytes_allocated} allocated in the pause",
                      flush=True)
            redundancy = None
            if trainer is not None:
                faults.inject("switched", self.device)
                # Own snapshots always (a failure rolls every survivor back to one step);
                # mirrors to the buddy when the job asks for them.
                redundancy = Redundancy(bind(p.layout, self.job.model), prepared.new_rank,
                                        mirror_group, mirror=mirror_group is not None,
                                        devices_per_node=p.args.nodes or p.args.devices_per_node,
                                        wait=abandon.wait, buffers=self.control.snapshot_buffers,
                                        mirror_buffers=self.control.mirror_buffers,
                                        calls_before_update=True)
                redundancy.snapshot(trainer.local_state())   # a failure now restores here
        except Exception as e:      # TransitionError, GenerationAbandoned, anything else
            # The switch did not happen here; the snapshots taken before it still hold (a
            # failed switch is recovered like a failed step).
            with self.control.lock:
                self.control.trainer = None
                if self.control.pending is p:
                    self.control.pending = None
                # Its groups may have waits stuck in them (see _graveyard).
                self._graveyard.append((prepared.transition_group, groups, mirror_group))
                holds_state = self.control.redundancy is not None or old_layout is None
                self.control.state = State.INTERRUPTED if holds_state else State.FAILED
                self.control.error = f"switch to generation {p.generation} failed: {e}"
                self.control.wake.notify_all()
            print(f"device {self.device}: {self.control.error}", flush=True)
            self.metrics.observe_switch(p.args.reason or "unknown", "failed", {}, 0)
            p.reply.set_exception(SwitchAborted(str(e)))
            return
        phases["prepare"] = prepared.seconds
        step = trainer.step if trainer is not None else step_before
        reply = pb.CommitResponse(
            generation=p.generation, step=step, pause_seconds=pause, phase_seconds=phases,
            bytes_sent=sent, bytes_received=received, bytes_local=local,
            new_rank=-1 if prepared.new_rank is None else prepared.new_rank)
        self.metrics.observe_switch(p.args.reason or "unknown", "success",
                                    {"prepare": prepared.seconds, "pause": pause,
                                     "transfer": phases.get("transfer", 0.0)}, sent)
        restoring = p.args.recovery is not None or bool(p.checkpoint)
        with self.control.lock:
            old_redundancy, self.control.redundancy = self.control.redundancy, redundancy
            old_previous, self.control.previous = self.control.previous, None
            old_generation = self.control.generation
            if trainer is not None:
                trainer.slowdown = faults.slowdown(self.device)
            self.control.trainer = trainer
            self.control.generation = p.generation
            abandon.keep_only(p.generation)    # no earlier generation is waited on now
            self.control.pending = None
            self.control.error = ""
            if p.args.recovery is not None or p.checkpoint:
                # Steps after the restored one were lost with the failed generation; they are
                # trained again (and reported again) from here.
                kept = [r for r in self.control.records if r.step <= step]
                self.control.records.clear()
                self.control.records.extend(kept)
            self.control.last_switch = pb.SwitchReport(
                generation=p.generation, from_layout=old_layout.to_text() if old_layout else "",
                to_layout=p.layout.to_text(), step=step, pause_seconds=pause,
                bytes_sent=sent, bytes_received=received)
            if trainer is None:
                self.control.state, self.control.layout, self.control.rank = State.LEFT, None, -1
            else:
                self.control.layout, self.control.rank = p.layout, prepared.new_rank
                self._fit_threads(p.layout.world)
                done = trainer.step >= self.job.training.steps
                self.control.state = State.FINISHED if done else State.TRAINING
                self.metrics.set_layout(p.layout)
            self.metrics.set_generation(p.generation)
            self.control.wake.notify_all()
        held = [r for r in (old_previous.redundancy if old_previous else None,
                            old_redundancy) if r is not None]
        if restoring:
            # The abandoned generations' mirror exchanges may wait on a dead or stuck peer:
            # closing them would hold this reply (and the new generation's first step, on
            # every peer) for the old group's timeout.
            self._graveyard.extend(r.drop() for r in held)
        elif old_redundancy is not None and trainer is not None:
            # A planned switch: the generation it left stays restorable until this one is
            # (a member that just joined must not be the single point of loss).
            if old_previous is not None:
                old_previous.redundancy.close()
            old_redundancy.settle()
            with self.control.lock:
                self.control.previous = Previous(old_generation, old_layout, old_redundancy,
                                                 step + 2)
        else:
            for r in held:
                r.close()
        if trainer is not None and (p.args.recovery is not None or p.checkpoint):
            _dump_state(trainer, f"gen{p.generation}")
        p.reply.set_result(reply)
        self._tell_switch(p, old_layout, step, pause)

    def _fit_threads(self, world: int) -> None:
        """This worker's share of the machine's cores under ``world`` workers (main thread:
        the training loop's own, where torch's intra-op pool takes the setting)."""
        if self.share_cores:
            threads = max(1, self.share_cores // world)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
                print(f"device {self.device}: {threads} threads ({self.share_cores} cores "
                      f"shared by {world} workers)", flush=True)

    def _restore(self, p: Pending):
        """A recovery's old state: this device's snapshot of the restore step (if it was in
        the old world) and the mirrors it holds for failed devices (if it is their proxy)."""
        rec = p.args.recovery
        r = self.control.redundancy_for(p.args.old_layout)
        if rec is None or r is None:
            return None, None
        restored = None
        if self.device in p.args.old_layout.device_of:
            restored = r.restore(rec.restore_step, self.torch_device)
        mirrored = {dead: r.restore_mirror(rec.restore_step, self.torch_device)
                    for dead, proxy in rec.proxies.items() if proxy == self.device}
        return restored, mirrored or None

    def _record(self, r) -> None:
        rec = pb.StepRecord(step=r.step, loss=r.loss, seconds=r.seconds,
                            tokens_per_second=r.tokens_per_second,
                            generation=self.control.generation,
                            sample_begin=r.samples[0], sample_end=r.samples[1],
                            end_time=time.time(),
                            compute_seconds=r.phases.get("compute", 0.0),
                            communication_seconds=r.phases.get("communication", 0.0),
                            redundancy_seconds=r.phases.get("redundancy", 0.0),
                            expert_tokens=r.expert_tokens,
                            forward_seconds=r.phases.get("forward", 0.0),
                            backward_seconds=r.phases.get("backward", 0.0),
                            memory_bytes=r.memory_bytes)
        with self.control.lock:
            self.control.records.append(rec)
            self.control.tokens_per_second = r.tokens_per_second

    def _report(self, r, snapshot_seconds: float) -> None:
        """The step's figures: this device's own on its metrics endpoint (step time and its
        split, GPU memory), and, while it is the job's rank 0, the job's (loss, learning
        rate, gradient norm, samples, modelled MFU, checkpoint age) there, in a step line
        every ``log_every`` steps and in TensorBoard."""
        t, owner = self.control.trainer, self.control.rank == 0
        # The split that sums to the step (forward and backward are parts of compute; the
        # controller reads them from the step record).
        phases = {k: v for k, v in r.phases.items() if k in STEP_PHASES}
        phases["redundancy"] = phases.get("redundancy", 0.0) + snapshot_seconds
        devices = self.control.layout.world * self.job.gpus_per_worker if self.job.gpus_per_worker \
            else self.control.layout.world
        # tokens/s x FLOPs per token over the peak of every device of the job
        mfu = r.tokens_per_second * self.flops_per_token / (devices * self.peak_flops)
        sample = None
        if owner:
            sample = TrainingSample(step=r.step, loss=r.loss, learning_rate=r.lr,
                                    grad_norm=r.grad_norm, samples=t.position, mfu=mfu)
            if self.control.checkpoint is not None:
                self.metrics.observe_checkpoint(self.control.checkpoint[1],
                                                self.control.checkpoint_time)
        self.metrics.observe_step(r.seconds, r.tokens_per_second, r.step, phases=phases,
                                  training=sample, owner=owner)
        if self.torch_device.type == "cuda":
            self.metrics.set_gpu_memory(torch.cuda.memory_allocated(self.torch_device),
                                        torch.cuda.memory_reserved(self.torch_device))
        if owner:
            self.training_log.step(step=r.step, loss=r.loss, learning_rate=r.lr,
                                   grad_norm=r.grad_norm, tokens_per_second=r.tokens_per_second,
                                   mfu=mfu,
                                   layout=self.control.layout.to_text(), phases=phases,
                                   seconds=r.seconds)

    def _tell_switch(self, p: Pending, old_layout, step: int, pause: float) -> None:
        """The new rank 0 says the switch (or recovery, or the job's start) in its log and in
        TensorBoard; a device that is no longer rank 0 ends its tenure there."""
        if self.control.rank != 0:
            self.training_log.end_tenure()
            self.metrics.observe_training_owner(False)
            return
        if p.args.recovery is not None:
            kind = "recovery"
            detail = f"restored step {p.args.recovery.restore_step} from memory"
        elif p.checkpoint:
            kind, detail = "recovery", f"from checkpoint {p.checkpoint}"
        elif old_layout is None:
            kind, detail = "start", ""
        else:
            kind, detail = "switch", ""
        self.training_log.switch(kind=kind, reason=p.args.reason or "unknown",
                                 from_layout=old_layout.to_text() if old_layout else "",
                                 to_layout=p.layout.to_text(), step=step, pause_seconds=pause,
                                 generation=p.generation, detail=detail)

    def stop(self) -> None:
        """Ask the loop to end at the next step boundary. Safe in a signal handler: it takes
        no lock (the handler runs on the main thread, which may hold the lock right then);
        the loop polls the flag at least every 0.2 s."""
        self.control.stopping = True

    def leave(self) -> None:
        """Told to leave (SIGTERM; on Kubernetes every planned removal arrives so, with a
        grace period): a notice, not a stop. A member trains on and reports ``leaving`` in
        its Status, so the controller switches it out live; it exits once it has left (the
        linger after its last switch). A worker that holds no part of the job (standing by,
        finished, already left) has nothing to hand over and stops now. Signal-safe like
        :meth:`stop`."""
        if self.control.leaving_at is None:
            self.control.leaving_at = time.monotonic() + self.control.grace_s
        if self.control.state in (State.STANDBY, State.FINISHED, State.LEFT, State.FAILED,
                                  State.SUSPENDED):
            self.control.stopping = True


def _dump_state(trainer: Trainer, tag: str) -> None:
    """For ``dynatrain bench chaos``: with DYNATRAIN_DUMP_RESTORED=DIR, write the state a
    recovery restored (``DIR/gen<g>-rank<r>.safetensors``), or the state after a step named in
    DYNATRAIN_DUMP_STEPS (``DIR/step<s>-rank<r>.safetensors``), to be compared across runs.
    Safetensors + JSON (:mod:`dynatrain.trainer.state_io`): the bench reads them without
    unpickling anything."""
    from dynatrain.trainer.state_io import write_state

    out = os.environ.get("DYNATRAIN_DUMP_RESTORED")
    if not out:
        return
    st = trainer.local_state()
    write_state(Path(out) / f"{tag}-rank{trainer.g.rank}.safetensors",
                LocalState(st.tensors, st.step, st.data_position),
                layout=trainer.lay.to_text(), world=trainer.lay.world)
