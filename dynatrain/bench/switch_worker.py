"""The processes of the switch benchmark (:mod:`dynatrain.bench.switch`), and their probes.

:func:`live_worker` is one device of the live run: it trains under the old layout, prepares
and performs the switch, measures the pause, the bandwidth and the floor, and checks what
arrived against DCP's resharding of the saved state. :func:`restart_worker` is one process of
the checkpoint-and-restart baseline. Both report through a multiprocessing queue. Both run on
the CPU under gloo, or under NCCL with rank ``i`` on ``cuda:i``; on a GPU every timed probe
waits for the device (:func:`_sync`), and memory is measured as torch's CUDA allocations.
Under ``nccl-sim`` (:mod:`dynatrain.vps.ncclsim`) the live run's training, transition and
probe groups have ProcessGroupNCCL's semantics on the CPU, as a worker's do; the default group
(barriers, DCP's checkpoint) and the restart baseline stay on gloo.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta


def _default_backend(backend: str) -> str:
    """The default process group's backend: nccl-sim is no registered torch backend (its
    groups are made by :class:`~dynatrain.vps.generations.DeviceManager`); gloo then, as a
    worker's mirrors travel on gloo beside NCCL."""
    return "gloo" if backend == "nccl-sim" else backend


def _rss() -> tuple[int, int]:
    """(current, peak) resident set size of this process, in bytes."""
    cur = peak = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return cur, peak


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


def _memory(dev) -> tuple[int, int]:
    """(current, peak) bytes the switch's state occupies: the process's RSS on the CPU, torch's
    CUDA allocations on a GPU (where the state lives; the host's RSS hardly moves)."""
    import torch

    if dev.type == "cuda":
        return torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev)
    return _rss()


def _reset_peak(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        _reset_peak_rss()


def _sync(dev) -> None:
    """CUDA copies and NCCL works return before the GPU is done: wait for it before timing."""
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _probe_bandwidth(group, group_rank, device: int, nbytes: int = 64 << 20,
                     dev=None) -> float:
    """Bytes/s from device 0 to device 1 over ``group`` (best of 3); 0 on other devices."""
    import torch

    if device not in (0, 1):
        return 0.0
    buf = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    _sync(buf.device)
    best = float("inf")
    for i in range(3):
        t0 = time.perf_counter()
        if device == 0:
            group.send([buf], group_rank[1], 100 + i).wait()
            group.recv([buf[:1]], group_rank[1], 200 + i).wait()
        else:
            group.recv([buf], group_rank[0], 100 + i).wait()
            group.send([buf[:1]], group_rank[0], 200 + i).wait()
        _sync(buf.device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def probe_order(device: int, sends, recvs) -> list[tuple[str, int]]:
    """The order ``device`` posts its probe messages in: ("send", peer) / ("recv", peer), by
    (source, destination) pair, the order the engine posts a round in
    (:func:`dynatrain.vps.rounds.schedule_rounds` sorts a round's messages so). Every device
    derives it from the same global order, so the two ends of a pair meet without either
    waiting behind an op its peer posts later: under NCCL, where a large send blocks until its
    receive is posted, every send before every receive deadlocks a cycle of three devices."""
    pairs = [((device, d), "send", d) for d in sends] + [((s, device), "recv", s) for s in recvs]
    return [(kind, peer) for _, kind, peer in sorted(pairs)]


def _probe_floor(group, group_rank, device: int, copied: int, sends: dict, recvs: dict,
                 dev=None) -> list[float]:
    """Seconds this device takes to move its switch's bytes by the simplest means, with every
    device doing the same at the same moment, for each of 3 tries (a barrier before each).

    The same bytes as its part of the switch: ``copied`` bytes by one memcpy, then one message
    per peer (``sends``/``recvs``: peer device -> bytes) straight from and into ready buffers:
    no rounds, no packing, no page faults. On one machine the devices share its cores and
    memory, so a copy or a pair measured alone would overstate what each device gets; the
    floor is the best try's slowest device (:func:`dynatrain.bench.switch.bench_switch`)."""
    import torch
    import torch.distributed as dist

    src = torch.ones(copied, dtype=torch.uint8, device=dev)
    dst = torch.zeros_like(src)
    out = {d: torch.ones(n, dtype=torch.uint8, device=dev) for d, n in sorted(sends.items())}
    into = {d: torch.zeros(n, dtype=torch.uint8, device=dev) for d, n in sorted(recvs.items())}
    _sync(src.device)
    tries = []
    for i in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        if copied:
            dst.copy_(src)
        works = [group.send([out[peer]], group_rank[peer], 300 + i) if kind == "send"
                 else group.recv([into[peer]], group_rank[peer], 300 + i)
                 for kind, peer in probe_order(device, out, into)]
        for w in works:
            w.wait()
        _sync(src.device)
        tries.append(time.perf_counter() - t0)
    return tries


def _state_bytes(local_state) -> int:
    return sum(t.numel() * t.element_size() for t, _ in local_state.tensors.values())


def live_worker(device, world, port, old_cfg, new_cfg, new_layout, engine, ckpt,
                 dump, threads, results, timeout_s, steps, backend="gloo"):
    """Device ``device`` of the live run; under NCCL it trains and switches on ``cuda:device``
    (one GPU per rank, on this machine)."""

    import torch
    import torch.distributed as dist

    from dynatrain.trainer.backend import torch_device
    from dynatrain.trainer.checkpoint import load_state, save_state
    from dynatrain.trainer.groups import build_groups
    from dynatrain.trainer.switch import preallocate, switch
    from dynatrain.trainer.trainer import Trainer, warm_up
    from dynatrain.vps.generations import DeviceManager
    from dynatrain.vps.layout import bind
    from dynatrain.vps.transition import TransitionConfig

    torch.set_num_threads(threads)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dev = torch_device(backend, device)               # and the current CUDA device, for NCCL
    dist.init_process_group(_default_backend(backend), store=dist.PrefixStore("default", store),
                            rank=device, world_size=world, timeout=timeout)
    model = old_cfg.model
    n_old = old_cfg.layout.world
    old_layout = old_cfg.layout.with_devices(range(n_old))
    save_group = dist.new_group(list(range(n_old)))        # DCP needs a registered group
    mgr = DeviceManager(store, device, backend=backend, timeout=timeout)
    holder = []
    if device < n_old:
        groups = build_groups(bind(old_layout, model), device, mgr.group_factory(0, old_layout))
        holder.append(Trainer(old_cfg, groups, device=dev))
    else:
        warm_up()                                           # a joiner in standby
    new_bound = bind(new_layout, model)
    config = TransitionConfig(**engine, timeout=timeout)
    future = mgr.prepare(1, model, old_layout, new_layout, staging_bytes=config.staging_bytes,
                         build_extra=lambda r: build_groups(new_bound, r,
                                                            mgr.group_factory(1, new_layout)),
                         # CPU only, as in the worker: on a GPU allocation is cheap
                         preallocate=((lambda p: preallocate(p, device, config))
                                      if dev.type == "cpu" else None),
                         direct_bytes=None if config.checksums else config.direct_bytes)
    losses_before = [holder[0].train_step().loss for _ in range(steps[0])] if holder else []
    prepared = future.result(timeout=timeout_s)
    bandwidth = _probe_bandwidth(prepared.transition_group, prepared.group_rank, device,
                                 dev=dev)

    old_bytes = 0
    save_s = 0.0
    if holder:
        st = holder[0].local_state()
        old_bytes = _state_bytes(st)
        t0 = time.perf_counter()
        save_state(st, model, ckpt, save_group)
        save_s = time.perf_counter() - t0
        if dump:
            _put_state(results, "before", st)
        del st
    # The reference checkpoint just written sits in the page cache as dirty pages; the kernel
    # writing them back during the pause would slow the switch's copies by up to a third.
    os.sync()
    dist.barrier()
    _reset_peak(dev)
    rss_before, _ = _memory(dev)
    dist.barrier()                                          # everyone starts the pause together
    res = switch(holder, prepared, new_cfg, device, config=config, torch_device=dev)
    _, peak = _memory(dev)
    if res.freeing is not None:
        res.freeing.join()                                  # the probe needs a quiet machine
    sends, recvs = {}, {}
    for msg in (m for msgs in prepared.rounds for m in msgs):
        if msg.src == device:
            sends[msg.dst] = sends.get(msg.dst, 0) + msg.nbytes
        if msg.dst == device:
            recvs[msg.src] = recvs.get(msg.src, 0) + msg.nbytes
    # Carved bytes count as copied: the floor is of the plan's data movement, which carving
    # avoids rather than does faster.
    floor_tries = _probe_floor(prepared.transition_group, prepared.group_rank, device,
                               res.transfer.bytes_local, sends, recvs, dev=dev)
    bitwise, losses_after, new_bytes = True, [], 0
    if res.trainer is not None:
        got = res.trainer.local_state()
        new_bytes = _state_bytes(got)
        ref = load_state(new_bound, prepared.new_rank, ckpt, device=dev)
        bitwise = (got.step == ref.step and got.data_position == ref.data_position
                   and all(torch.equal(got.tensors[k][0], ref.tensors[k][0]) for k in ref.tensors))
        if dump:
            _put_state(results, "after", got)
        del got, ref
        losses_after = [res.trainer.train_step().loss for _ in range(steps[1])]
    results.put(("device", {
        "device": device, "pause": res.pause_seconds, "transfer": res.transfer.seconds,
        "prepare": prepared.seconds, "save": save_s, "bandwidth": bandwidth,
        "floor_tries": floor_tries,
        "copied": res.transfer.bytes_copied, "adopted": res.transfer.bytes_adopted,
        "preallocated": res.transfer.bytes_preallocated, "carved": res.transfer.bytes_carved,
        "allocated": res.transfer.bytes_allocated,
        "bitwise": bitwise, "losses_before": losses_before, "losses_after": losses_after,
        "rss_before": rss_before, "peak_rss": peak, "old_bytes": old_bytes,
        "new_bytes": new_bytes, "sent": res.transfer.bytes_sent,
        "received": res.transfer.bytes_received, "staging_peak": res.transfer.peak_staging_bytes,
        "rounds": res.transfer.rounds, "phases": res.phases,
        "messages": [res.transfer.messages_sent, res.transfer.messages_received]}))
    dist.barrier()
    dist.destroy_process_group()


def _put_state(results, tag, st) -> None:
    from dynatrain.trainer.state_io import state_to_bytes
    from dynatrain.trainer.trainer import LocalState
    from dynatrain.vps.carving import owned

    # Safetensors + JSON (.state_io), not a pickle the bench would have to unpickle.
    tensors = {k: (owned(t.detach().cpu()), p) for k, (t, p) in st.tensors.items()}
    results.put((tag, state_to_bytes(LocalState(tensors, 0, 0))))


def restart_worker(rank, world, port, new_cfg, new_layout, ckpt, threads, results, timeout_s,
                    steps, backend="gloo"):
    import torch
    import torch.distributed as dist

    from dynatrain.trainer.backend import torch_device
    from dynatrain.trainer.checkpoint import load_state
    from dynatrain.trainer.groups import build_groups
    from dynatrain.trainer.trainer import Trainer
    from dynatrain.vps.layout import bind

    torch.set_num_threads(threads)
    dev = torch_device(backend, rank)
    dist.init_process_group(_default_backend(backend), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    bound = bind(new_layout, new_cfg.model)
    groups = build_groups(bound, rank)
    state = load_state(bound, rank, ckpt, device=dev)
    trainer = Trainer(new_cfg, groups, device=dev, state=state)
    dist.barrier()
    ready = time.time()
    losses = [trainer.train_step().loss for _ in range(steps)]
    results.put(("restart", {"rank": rank, "ready": ready, "losses": losses}))
    dist.barrier()
    dist.destroy_process_group()
