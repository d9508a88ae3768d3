"""The CUDA paths checked on one device, and a local-only switch's pause against the device's
memory-copy floor: what ``benchmarks/gpu_check.py`` (``make gpu-check``) runs on a GPU and
``tests/gpu/test_cuda.py`` asserts.

Every check takes the torch device to run on and returns its figures as a dict, or raises
:class:`CheckFailed` saying what differs. On ``cuda`` they are the real thing; the same code
also runs on ``cpu`` (tests/gpu does that on every machine, so the checks cannot rot where no
GPU is), where only the pinned-memory expectation and the backend of one-rank groups (gloo for
NCCL) differ.

- :func:`check_training`: a world-size-1 trainer on the device; every local tensor lives
  there, and its losses match the same steps on the CPU (within 1e-3: other kernels).
- :func:`check_switch`: ``dp=1 -> dp=1,zero=1`` on the one device, the real engine
  (:func:`dynatrain.trainer.switch.switch`) over a one-rank group of the device's backend
  (NCCL on CUDA: ``commit_group`` in its figures names it): tensors that keep their pieces are
  adopted (the same storage), ZeRO's flat ones are copied locally, nothing travels. The full
  state is bit-identical before and after, the new tensors are on the device, the next loss is
  the unswitched trainer's.
- :func:`check_snapshot`: the redundancy's snapshot (pinned host memory when CUDA is there),
  restored bit for bit; a trainer built from it continues with the same loss; and a switch
  that starts from the restored snapshot (a recovery's path) puts its state on the device.
- :func:`check_checkpoint`: a DCP checkpoint saved from the device and loaded back onto it.
- :func:`check_run`: the whole worker path, ``dynatrain run`` of a one-GPU job (NCCL through
  ``--backend auto``) that switches live to ``dp=1,zero=1`` mid-run.
- :func:`~.gpu_ranks.check_switch4`: four processes share the device, their groups gloo's (NCCL refuses
  two ranks of a communicator on one GPU), and switch live ``dp=4 -> dp=2,tp=2,zero=1``
  (:data:`~.gpu_ranks.SWITCH4`): every rank's state lives on the device before and after, the switched
  state is bit-identical to DCP's resharding of the state saved just before the switch, and
  the next losses are a restart's from that checkpoint.
- :func:`~.gpu_ranks.check_recovery4`: the same four processes train ``dp=4`` with the in-memory
  redundancy (own snapshots every step, pinned under CUDA); one is killed (SIGKILL); the
  survivors agree on the step to restore from their holdings, restore their snapshots onto
  the device and switch to ``dp=3,zero=1`` (:data:`~.gpu_ranks.RECOVERY4`) on themselves. The recovered
  state is on the device and bit-identical to the unfailed run's at the restored step (DCP,
  saved by all four at that step), and training continues as a restart would. With
  ``dp=4,zero=1 -> dp=3,zero=1`` (:data:`~.gpu_ranks.RECOVERY4_MIRRORED`, CPU only: see below) the dead
  rank's unique ZeRO shard comes from its buddy's mirror.
- :func:`~.gpu_ranks.check_single_rank_groups`: one-rank groups of the device's backend in a process of
  their own: ``init_process_group`` of a world of one with ``device_id`` (bound to the
  device; NCCL's communicator made eagerly), a one-rank ``new_group`` with ``device_id``, and
  the engine's transition group as :class:`~dynatrain.vps.generations.DeviceManager` makes it;
  collectives on device tensors on each, and the commit's all-reduce on the engine's.
- :func:`memcpy_bandwidth` and :func:`switch_floor`: the pause of the switch above against
  ``bytes copied / device-to-device copy bandwidth``, both measured here. On a GPU the engine's
  own phase timings stop when the copies are queued; the pause ends at the commit's
  all-reduce, which waits for them, so the pause is the honest figure.

Gloo carries CUDA tensors in its all-reduce and broadcast only, not in send/recv (torch's
backend table): so the four-process checks use layouts whose steps only all-reduce (no
pipeline stages) and switches whose moves all stay on their device, and refuse by name a plan
that would send CUDA tensors through gloo; the engine's network rounds under CUDA are NCCL's,
which needs a GPU per rank.
"""

from __future__ import annotations

import glob
import json
import math
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from dynatrain.spec.job import load_job

from dynatrain.trainer.checkpoint import load_state, save_checkpoint
from dynatrain.trainer.config import make_config
from dynatrain.trainer.groups import build_groups
from dynatrain.trainer.hostbuffers import HostBuffers
from dynatrain.trainer.redundancy import Redundancy, slot_sizes
from dynatrain.trainer.state import assemble_full
from dynatrain.trainer.switch import switch
from dynatrain.trainer.trainer import LocalState, Trainer
from dynatrain.vps.generations import DeviceManager
from dynatrain.vps.layout import bind
from dynatrain.vps.transition import TransitionConfig

OLD, NEW = "dp=1", "dp=1,zero=1"
"""The local-only switch one device can do: ZeRO-1's flat optimizer shards are new tensors
(copied), the params keep their pieces (adopted)."""


class CheckFailed(AssertionError):
    """A correctness check failed; the message says which and how."""


def _config(model: str, layout: str, seq_len: int):
    return make_config(model, layout, seq_len=seq_len, global_batch_size=2)


def _trainer(cfg, dev: torch.device, state: LocalState | None = None) -> Trainer:
    # World size 1: every group has one rank, so none is built (build_groups skips them).
    return Trainer(cfg, build_groups(bind(cfg.layout.with_devices([0]), cfg.model), 0),
                   device=dev, state=state)


def _clone(state: LocalState, dev: torch.device | None = None) -> LocalState:
    """A copy of ``state`` that later steps cannot change (local_state() shares storage)."""
    return LocalState({k: (t.detach().to(dev or t.device, copy=True), p)
                       for k, (t, p) in state.tensors.items()},
                      state.step, state.data_position,
                      {k: v.clone() for k, v in state.rng.items()})


def _same(a: LocalState, b: LocalState, what: str, model=None) -> None:
    """Bit for bit, compared on the CPU (the two may live on different devices); with
    ``model``, the full tensors (the two may be of different layouts)."""
    if (a.step, a.data_position) != (b.step, b.data_position):
        raise CheckFailed(f"{what}: step/data position {(a.step, a.data_position)} != "
                          f"{(b.step, b.data_position)}")
    if set(a.tensors) != set(b.tensors):
        raise CheckFailed(f"{what}: tensors differ: {sorted(set(a.tensors) ^ set(b.tensors))}")
    if model is not None:
        fa, fb = assemble_full(model, [a]).tensors, assemble_full(model, [b]).tensors
    else:
        fa = {k: t for k, (t, _) in a.tensors.items()}
        fb = {k: t for k, (t, _) in b.tensors.items()}
    for k, t in fa.items():
        u = fb[k]
        if t.shape != u.shape or t.dtype != u.dtype or not torch.equal(t.cpu(), u.cpu()):
            raise CheckFailed(f"{what}: {k[0]} ({k[1]}) differs ({tuple(t.shape)} {t.dtype} "
                              f"vs {tuple(u.shape)} {u.dtype})")


def _canonical(dev: torch.device) -> torch.device:
    """``dev`` with its index: ``cuda`` is the current CUDA device (tensors report their
    index; ``torch.device("cuda") != torch.device("cuda", 0)``)."""
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def _on(state: LocalState, dev: torch.device, what: str) -> None:
    dev = _canonical(dev)
    wrong = [k for k, (t, _) in state.tensors.items() if t.device != dev]
    if wrong:
        raise CheckFailed(f"{what}: {len(wrong)} local tensors are not on {dev}, e.g. "
                          f"{wrong[0]} on {state.tensors[wrong[0]][0].device}")


def _close(a: float, b: float, rel: float, what: str) -> None:
    if not (math.isfinite(a) and math.isfinite(b)) or abs(a - b) > rel * max(abs(b), 1e-12):
        raise CheckFailed(f"{what}: {a!r} vs {b!r} (allowed relative difference {rel:g})")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def backend_of(dev: torch.device) -> str:
    return "nccl" if dev.type == "cuda" else "gloo"


def check_training(dev: torch.device, *, model: str = "gpt-tiny", steps: int = 3,
                   seq_len: int = 32) -> dict:
    """World size 1 on ``dev``: state on the device, losses as on the CPU; each step reports
    its forward and backward passes within its compute (CUDA events on a GPU) and its
    memory."""
    cfg = _config(model, OLD, seq_len)
    t = _trainer(cfg, dev)
    _on(t.local_state(), dev, "a fresh trainer")
    results = [t.train_step() for _ in range(steps)]
    losses = [r.loss for r in results]
    _on(t.local_state(), dev, f"the trainer after {steps} steps")
    for r in results:
        fwd, bwd, compute = (r.phases.get(k, 0.0) for k in ("forward", "backward", "compute"))
        if not (0 < fwd and 0 < bwd and fwd + bwd <= compute * 1.05 + 1e-4):
            raise CheckFailed(f"step {r.step} on {dev}: forward {fwd:.6f} s + backward "
                              f"{bwd:.6f} s must be positive and within compute {compute:.6f} s")
        if r.memory_bytes <= 0:
            raise CheckFailed(f"step {r.step} on {dev} reported no memory")
    ref = _trainer(cfg, torch.device("cpu"))
    cpu = [ref.train_step().loss for _ in range(steps)]
    for i, (a, b) in enumerate(zip(losses, cpu)):
        _close(a, b, 1e-3, f"loss of step {i + 1} on {dev} vs the CPU")
    return {"losses": losses, "cpu_losses": cpu,
            "forward_seconds": [r.phases["forward"] for r in results],
            "backward_seconds": [r.phases["backward"] for r in results],
            "memory_bytes": [r.memory_bytes for r in results]}


class _World:
    """A one-device world's generations: a store, and the device manager over it."""

    def __init__(self, dev: torch.device, timeout_s: float = 120.0):
        self.dev = dev
        self.store = dist.HashStore()
        self.mgr = DeviceManager(self.store, 0, backend=backend_of(dev),
                                 timeout=timedelta(seconds=timeout_s))
        self.generation = 0

    def prepare(self, old_cfg, new_cfg):
        """Generation g+1, ``old_cfg.layout -> new_cfg.layout`` on device 0, prepared."""
        self.generation += 1
        g, model = self.generation, new_cfg.model
        old = old_cfg.layout.with_devices([0])
        new = new_cfg.layout.with_devices([0])
        bound = bind(new, model)
        return self.mgr.prepare(g, model, old, new, staging_bytes=64 << 20,
                                build_extra=lambda r: build_groups(
                                    bound, r, self.mgr.group_factory(g, new))
                                ).result(timeout=120)

    def switch(self, holder, prepared, new_cfg, **kw):
        # Carving is CPU-only; off, a CPU run of these checks takes the path a GPU takes.
        return switch(holder, prepared, new_cfg, 0, config=TransitionConfig(carve=False),
                      torch_device=self.dev, **kw)


def check_switch(dev: torch.device, *, model: str = "gpt-tiny", seq_len: int = 32,
                 steps_before: int = 2, world: _World | None = None) -> dict:
    """The engine's adoption and local copies on ``dev``: ``dp=1 -> dp=1,zero=1``."""
    world = world or _World(dev)
    old_cfg, new_cfg = _config(model, OLD, seq_len), _config(model, NEW, seq_len)
    t = _trainer(old_cfg, dev)
    for _ in range(steps_before):
        t.train_step()
    before = _clone(t.local_state())
    ptrs = {k: v.data_ptr() for k, (v, _) in t.local_state().tensors.items()}
    prepared = world.prepare(old_cfg, new_cfg)
    # The commit's all-reduce runs on this group: on CUDA a one-rank NCCL group.
    g = prepared.transition_group
    commit_group = f"{type(g).__name__} of {g.size()} rank(s)"
    if g.size() != 1 or (dev.type == "cuda" and not isinstance(g, dist.ProcessGroupNCCL)):
        raise CheckFailed(f"the one-device switch's commit group is {commit_group}, not a "
                          f"one-rank {backend_of(dev)} group")
    _sync(dev)
    res = world.switch([t], prepared, new_cfg)
    del t
    after = res.trainer.local_state()
    _on(after, dev, "the switched trainer")
    _same(before, after, f"the state across {OLD} -> {NEW} on {dev}", old_cfg.model)
    s = res.transfer
    if s.bytes_sent or s.bytes_received:
        raise CheckFailed(f"a one-device switch used the network: {s.bytes_sent} bytes sent, "
                          f"{s.bytes_received} received")
    if not s.bytes_copied or not s.bytes_adopted:
        raise CheckFailed(f"{OLD} -> {NEW} should copy some tensors and adopt others; copied "
                          f"{s.bytes_copied}, adopted {s.bytes_adopted} bytes")
    kept = [k for k, (v, _) in after.tensors.items() if ptrs.get(k) == v.data_ptr()]
    adopted = sum(after.tensors[k][0].numel() * after.tensors[k][0].element_size()
                  for k in kept)
    if adopted != s.bytes_adopted:
        raise CheckFailed(f"the engine reports {s.bytes_adopted} bytes adopted, but the new "
                          f"tensors that are the old ones' storage hold {adopted}")
    # The unswitched trainer, from the same state: the first loss is a forward of the same
    # parameters (exact); later ones follow different optimizer code paths and, on CUDA,
    # backward kernels with atomics.
    ref = _trainer(old_cfg, dev, _clone(before))
    got = [res.trainer.train_step().loss for _ in range(3)]
    want = [ref.train_step().loss for _ in range(3)]
    _close(got[0], want[0], 1e-6, f"the first loss after the switch on {dev}")
    for i in (1, 2):
        _close(got[i], want[i], 1e-4, f"loss {i + 1} after the switch on {dev}")
    return {"pause_seconds": res.pause_seconds, "phases": dict(res.phases),
            "commit_group": commit_group, "bytes_copied": s.bytes_copied,
            "bytes_adopted": s.bytes_adopted, "bytes_allocated": s.bytes_allocated,
            "losses_after": got, "losses_unswitched": want}


def check_snapshot(dev: torch.device, *, model: str = "gpt-tiny", seq_len: int = 32,
                   world: _World | None = None) -> dict:
    """A snapshot to (pinned) host memory, restored; and a switch starting from it."""
    world = world or _World(dev)
    cfg, new_cfg = _config(model, OLD, seq_len), _config(model, NEW, seq_len)
    t = _trainer(cfg, dev)
    t.train_step()
    bound = bind(cfg.layout.with_devices([0]), cfg.model)
    # The worker's pool: exact-size buffers, page-locked with cudaHostRegister under CUDA.
    pool = HostBuffers(pin=dev.type == "cuda")
    pool.reserve([slot_sizes(bound, 0, mirror=False).snapshot] * 2)       # as Prepare does
    r = Redundancy(bound, 0, None, mirror=False, buffers=pool)
    t0 = time.perf_counter()
    r.snapshot(t.local_state())             # copies on a side stream under CUDA
    snapshot_s = time.perf_counter() - t0
    # Device-to-host copies want page-locked buffers (its slots are private: this is the one
    # place that looks).
    pinned = all(s.buf.is_pinned() for s in r._slots)
    if dev.type == "cuda" and not pinned:
        raise CheckFailed("the redundancy's snapshot buffers are not pinned under CUDA")
    exact = slot_sizes(bound, 0, mirror=False).snapshot
    if any(s.buf.numel() != exact for s in r._slots):
        raise CheckFailed(f"snapshot slots of {[s.buf.numel() for s in r._slots]} bytes, not "
                          f"the {exact} the state needs")
    before = _clone(t.local_state())
    restored = r.restore(t.step)
    _same(before, restored, f"the snapshot of step {t.step} restored")
    again = _trainer(cfg, dev, _clone(restored, dev))
    _close(again.train_step().loss, t.train_step().loss, 1e-6,
           f"the loss after restoring the snapshot on {dev}")
    # A recovery switches from the restored host copy (no live trainer): the switch must put
    # it on the device before the engine adopts it.
    res = world.switch([], world.prepare(cfg, new_cfg), new_cfg, restored=r.restore(before.step))
    after = res.trainer.local_state()
    _on(after, dev, "the trainer switched from a restored snapshot")
    _same(before, after, f"the state switched from the snapshot ({OLD} -> {NEW})",
          cfg.model)
    held = r.memory_bytes()
    r.close()
    # The next generation takes the same buffers: nothing is pinned again; a trim unpins.
    made = pool.stats.allocated
    again = Redundancy(bound, 0, None, mirror=False, buffers=pool)
    if pool.stats.allocated != made:
        raise CheckFailed("a second generation of the same size pinned buffers of its own")
    again.snapshot(t.local_state())
    _same(_clone(t.local_state()), again.restore(t.step), "a snapshot in reused buffers")
    again.close()
    unpinned = pool.trim()
    return {"pinned": pinned, "snapshot_seconds": snapshot_s, "snapshot_bytes": held,
            "pin_seconds": pool.stats.pin_seconds, "buffers_made": made,
            "unpinned_bytes": unpinned}


def check_checkpoint(dev: torch.device, *, model: str = "gpt-tiny", seq_len: int = 32) -> dict:
    """DCP: saved from ``dev``, loaded back onto it, bit for bit."""
    cfg = _config(model, OLD, seq_len)
    t = _trainer(cfg, dev)
    t.train_step()
    state = _clone(t.local_state())
    with tempfile.TemporaryDirectory(prefix="dynatrain-gpu-ckpt-") as root:
        t0 = time.perf_counter()
        saved = save_checkpoint(state, cfg.model, root)
        save_s = time.perf_counter() - t0
        loaded = load_state(bind(cfg.layout.with_devices([0]), cfg.model), 0, saved.path,
                            device=dev)
    _on(loaded, dev, "the loaded checkpoint")
    _same(state, loaded, f"the checkpoint of step {state.step} loaded onto {dev}")
    if not torch.equal(loaded.rng["cpu"], state.rng["cpu"]):
        raise CheckFailed("the checkpoint's RNG state differs from the saved one")
    return {"save_seconds": save_s, "bytes_written": saved.bytes_written}


def check_run(dev: torch.device, *, steps: int = 16, timeout_s: float = 300.0) -> dict:
    """The whole worker path: ``dynatrain run`` of a one-worker job (``spec.resources.gpus:
    1`` on CUDA, so ``--backend auto`` means NCCL; 0 on the CPU) whose scenario requests
    ``dp=1,zero=1`` mid-run: the worker switches live on its device, every sample is read
    exactly once."""
    with tempfile.TemporaryDirectory(prefix="dynatrain-gpu-run-") as d:
        job = {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
               "metadata": {"name": "gpu-check"},
               "spec": {"image": "dynatrain:dev", "model": {"preset": "gpt-tiny"},
                        "resources": {"gpus": 1 if dev.type == "cuda" else 0},
                        "elastic": {"minWorkers": 1, "maxWorkers": 1},
                        "parallelism": {"mode": "auto"}, "globalBatchSize": 4,
                        "training": {"steps": steps, "seqLen": 64, "seed": 0}}}
        scenario = {"events": [{"atStep": steps // 3, "layout": NEW}]}
        paths = {name: f"{d}/{name}.yaml" for name in ("job", "scenario")}
        for name, doc in (("job", job), ("scenario", scenario)):
            with open(paths[name], "w") as f:
                yaml.safe_dump(doc, f)
        load_job(paths["job"])                             # a bad manifest fails here, clearly
        out = subprocess.run([sys.executable, "-m", "dynatrain", "run", paths["job"],
                              "--scenario", paths["scenario"], "--run-dir", f"{d}/run",
                              "--summary-json", f"{d}/summary.json"],
                             capture_output=True, text=True, timeout=timeout_s)
        if out.returncode != 0:
            logs = "".join(Path(p).read_text()[-2000:]
                           for p in sorted(glob.glob(f"{d}/run/worker-*.log")))
            raise CheckFailed(f"dynatrain run exited {out.returncode}:\n{out.stdout[-3000:]}"
                              f"{out.stderr[-3000:]}\n{logs}")
        with open(f"{d}/summary.json") as f:
            summary = json.load(f)
    done = [s for s in summary["switches"] if s["result"] == "success"]
    if len(done) != 1 or not summary["samples_exactly_once"]:
        raise CheckFailed(f"expected one live switch and every sample once: switches "
                          f"{summary['switches']}, exactly once {summary['samples_exactly_once']}")
    return {"pause_seconds": done[0]["pause_seconds"], "final_loss": summary["final_loss"],
            "wall_seconds": summary["wall_seconds"]}


def memcpy_bandwidth(dev: torch.device, nbytes: int = 1 << 30, tries: int = 5) -> float:
    """Bytes per second torch copies from one buffer of ``dev`` to another (best try)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)                                  # first touch, not timed
    best = float("inf")
    for _ in range(tries):
        _sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def switch_floor(dev: torch.device, *, model: str, seq_len: int = 64, repeats: int = 3,
                 copy_bytes: int = 1 << 30) -> dict:
    """The local-only switch's pause (best of ``repeats``, each a fresh trainer and a fresh
    generation) against ``bytes copied / memcpy bandwidth``."""
    world = _World(dev)
    runs = [check_switch(dev, model=model, seq_len=seq_len, steps_before=1, world=world)
            for _ in range(repeats)]
    best = min(runs, key=lambda r: r["pause_seconds"])
    bw = memcpy_bandwidth(dev, copy_bytes)
    floor = best["bytes_copied"] / bw
    return {"model": model, "switch": f"{OLD} -> {NEW}", "device": str(dev),
            "pauses_seconds": [r["pause_seconds"] for r in runs],
            "pause_seconds": best["pause_seconds"], "phases": best["phases"],
            "bytes_copied": best["bytes_copied"], "bytes_adopted": best["bytes_adopted"],
            "memcpy_bytes_per_second": bw, "floor_seconds": floor,
            "pause_over_floor": best["pause_seconds"] / floor if floor else None}
