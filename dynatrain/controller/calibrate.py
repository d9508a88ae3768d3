"""Calibration on this machine: a measured CPU device profile and measured gloo links.

:func:`measure_cpu_profile` probes this machine's matmul, attention, elementwise and
streaming rates and its host time per operator (~0.2 s); :func:`measure_gloo_link` starts
processes to time gloo collectives among the ranks the local runner would start, whose
latency grows to milliseconds when ranks outnumber cores. Both give the figures of a
:class:`~dynatrain.spec.hardware.DeviceProfile`; the only code of the solver that
touches torch (imported lazily, inside the functions).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from dynatrain.vps.model import ModelSpec

from .costmodel import ADAMW_BYTES_PER_ELEMENT
from dynatrain.spec.hardware import PROFILES, DeviceProfile, cpu_cores, machine_memory
from dynatrain.vps.stagecost import BLOCK_OPS


def _best_rate(fn, work: float, repeats: int, budget_s: float) -> float:
    """work / the fastest of ``repeats`` timed calls (other load only ever slows a call)."""
    fn()                                   # warm-up: allocation, kernel selection
    best, deadline = math.inf, time.perf_counter() + budget_s
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() > deadline:
            break
    return work / best


@dataclass(frozen=True)
class GlooLink:
    """What :func:`measure_gloo_link` found among the ranks of one machine."""

    latency_seconds: float
    """Latency of a collective over all the ranks."""
    bytes_per_second: float
    """Ring all-reduce bandwidth over all the ranks."""
    group_latency_seconds: tuple[tuple[int, float], ...] = ()
    """(group size, latency) for every group size that divides the world (2: pairs)."""


def measure_cpu_profile(threads: int | None = None, *,
                        link: GlooLink | None = None) -> DeviceProfile:
    """A profile of this machine for ranks run by the local runner, probed in ~0.2 s.

    * flops: the best of several fp32 512 x 512 x 512 matmuls;
    * ``memory_bytes_per_second``: one step of torch's per-tensor AdamW on 1 M floats, as
      :data:`ADAMW_BYTES_PER_ELEMENT` bytes per element (the optimizer is the main
      streaming kernel of a step);
    * ``elementwise_bytes_per_second``: bytes read and written by a layer norm, a residual
      add, a GELU and a copy of 512 K floats (a transformer block's elementwise mix: the
      GELU, compute-bound on a CPU, takes most of the time);
    * ``attention_flops_per_second``: causal ``scaled_dot_product_attention`` forward +
      backward at 128 tokens, 8 heads of 32 (the tiny presets; longer sequences and wider
      heads run faster, so larger models get a pessimistic figure);
    * ``op_seconds``: one forward + backward of the trainer's GPT block at a negligible size,
      divided by its operator count.

    All run with ``threads`` threads (default 1) and are divided by it: the profile is per
    core, ``shared_cores`` is this machine's core count, and the cost model gives a rank of a
    W-rank world ``max(1, cores // W)`` threads and lets at most ``cores / threads`` ranks
    compute at once (see :mod:`dynatrain.controller.costmodel`). ``link`` is what
    :func:`measure_gloo_link` measured among the ranks; without it, the :data:`PROFILES`
    ``cpu`` preset's gloo-over-loopback figures are assumed.
    """
    import torch
    import torch.nn.functional as F

    cores = cpu_cores()
    threads = threads or 1
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        flops = _best_rate(lambda: a @ b, 2 * n ** 3, repeats=10, budget_s=0.2) / threads

        # AdamW's arithmetic by torch's functional adam, what AdamW(foreach=False).step runs:
        # constructing any torch.optim optimizer imports torch._dynamo, 1.1 s of CPU that
        # every `dynatrain run` paid before its job started.
        from torch.optim.adam import adam

        p = torch.zeros(1 << 20)
        g, m, v, step = torch.randn_like(p), torch.zeros_like(p), torch.zeros_like(p), \
            torch.tensor(0.0)

        def adamw_step():
            adam([p], [g], [m], [v], [], [step], foreach=False, decoupled_weight_decay=True,
                 amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.01, eps=1e-8,
                 maximize=False)
        streaming = _best_rate(adamw_step, ADAMW_BYTES_PER_ELEMENT * p.numel(), repeats=5,
                               budget_s=0.2) / threads

        x = torch.randn(2048, 256)
        w, bias = torch.ones(256), torch.zeros(256)
        y = torch.empty_like(x)

        def mix():
            u = F.layer_norm(x, (256,), w, bias)       # read n, write n
            v = torch.add(x, u)                        # read 2n, write n
            g = F.gelu(v, approximate="tanh")          # read n, write n
            y.copy_(g)                                 # read n, write n
        elementwise = _best_rate(mix, 9 * 4 * x.numel(), repeats=10, budget_s=0.2) / threads

        # the attention of the tiny presets the local runner trains: 128 tokens, head dim 32
        q, k, v = (torch.randn(1, 8, 128, 32, requires_grad=True) for _ in range(3))

        def attention():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        attn = _best_rate(attention, 3 * 2 * 128 * 128 * 8 * 32, repeats=10,
                          budget_s=0.2) / threads
        op_seconds = _probe_op_seconds()
    finally:
        torch.set_num_threads(previous)
    link = link or GlooLink(PROFILES["cpu"].latency_seconds,
                            PROFILES["cpu"].intra_node_bytes_per_second)
    latency, bandwidth = link.latency_seconds, link.bytes_per_second
    return DeviceProfile(name="cpu (measured)", flops_per_second=flops,
                         memory_bytes=machine_memory(), intra_node_bytes_per_second=bandwidth,
                         inter_node_bytes_per_second=bandwidth, devices_per_node=1 << 16,
                         latency_seconds=latency,
                         group_latency_seconds=link.group_latency_seconds,
                         memory_bytes_per_second=streaming,
                         elementwise_bytes_per_second=elementwise,
                         attention_flops_per_second=attn, op_seconds=op_seconds,
                         reserved_bytes=PROFILES["cpu"].reserved_bytes, shared_cores=cores)


def _probe_op_seconds() -> float:
    """Host seconds per operator: one forward + backward of the trainer's own GPT block at a
    size where the arithmetic is negligible (8 tokens, width 32), divided by its
    :data:`BLOCK_OPS` count."""
    import torch

    from dynatrain.trainer.model import StageModel
    from dynatrain.trainer.weights import initial_tensor

    class _NoGroups:                     # a single rank: no TP or EP collectives
        tp = ep = None

    spec = ModelSpec(name="probe", arch="gpt", vocab_size=64, hidden_size=32, num_layers=1,
                     num_heads=4, ffn_hidden_size=128, max_seq_len=8, dtype="float32")
    weights = {t.name: initial_tensor(spec, t, 0).clone().requires_grad_(True)
               for t in spec.tensors}
    block = StageModel(spec, range(1), first=False, last=False, groups=_NoGroups, ep=1,
                       vocab_start=0)
    x = torch.randn(1, 8, 32, requires_grad=True)

    def run():
        block.blocks(x, weights).sum().backward()
    return 1 / _best_rate(run, BLOCK_OPS["gpt"], repeats=20, budget_s=0.2)


def _link_worker(rank: int, world: int, port: int, message: int, large: int, repeats: int,
                 results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, cpu_cores() // world))     # as run_local does
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        # Groups of every size that divides the world, consecutive ranks, all of them busy at
        # once (every rank must create every group, in the same order).
        sizes = [n for n in range(2, world + 1) if world % n == 0]
        mine = {}
        for n in sizes:
            for start in range(0, world, n):
                group = dist.new_group(list(range(start, start + n)))
                if start <= rank < start + n:
                    mine[n] = group
        # ~1 ms of single-core matmul between collectives, like a small model's TP segment,
        # and a message of a small model's activation
        a = torch.randn(400, 400)
        one, big = torch.zeros(message // 4), torch.zeros(large // 4)
        for n in sizes:
            dist.all_reduce(one, group=mine[n])
        for _ in range(3):
            dist.all_reduce(big)

        def loop(tensor, group, compute: bool = True, iterations: int = repeats) -> float:
            """Seconds per iteration, the best of three loops (others' load only adds)."""
            best = math.inf
            for _ in range(3):
                dist.barrier()
                t = time.perf_counter()
                for _ in range(iterations):
                    if compute:
                        a @ a
                    if tensor is not None:
                        dist.all_reduce(tensor, group=group)
                best = min(best, (time.perf_counter() - t) / iterations)
            return best

        compute = loop(None, None)
        timings = {"compute": compute,
                   "groups": {n: loop(one, mine[n]) - compute for n in sizes},
                   "small": loop(one, None, compute=False),
                   "large": loop(big, None, compute=False, iterations=max(3, repeats // 5))}
        if rank == 0:
            results.put(timings)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_gloo_link(world: int, *, message_bytes: int = 128 << 10,
                      large_bytes: int = 4 << 20, repeats: int = 30,
                      timeout_s: float = 300.0) -> GlooLink:
    """Latency and bandwidth of gloo collectives among ``world`` processes on this machine,
    each with the threads run_local would give it. Starts processes: takes a few seconds.

    Latency, for every group size n dividing the world, is what an all-reduce of
    ``message_bytes`` (a small model's activation, 128 KiB) in groups of n adds to a loop of
    ~1 ms matmuls that every rank runs, less its bandwidth term; not its time in an otherwise
    idle loop. In training, collectives sit between compute, and when ranks outnumber cores
    (4 ranks on 2 cores) each of a ring's 2 (n - 1) steps may wait for the scheduler to run
    the peer, which costs milliseconds: ten times the idle figure, and more for larger
    groups. Bandwidth comes from a ``large_bytes`` all-reduce over the world via the ring
    formula."""
    if world < 2:
        return GlooLink(PROFILES["cpu"].latency_seconds,
                        PROFILES["cpu"].intra_node_bytes_per_second)
    import queue
    import socket

    from dynatrain.trainer import processes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = processes.context().Queue()
    procs = processes.start_ranks(_link_worker, args=(world, port, message_bytes, large_bytes,
                                                      repeats, results), nprocs=world)
    try:
        t = results.get(timeout=timeout_s)
    except queue.Empty:
        for p in procs.processes:
            p.terminate()
        raise RuntimeError(f"gloo link probe with {world} processes did not finish in "
                           f"{timeout_s:.0f} s") from None
    procs.join(timeout=60)
    bandwidth = 2 * (world - 1) / world * (large_bytes - message_bytes) \
        / max(t["large"] - t["small"], 1e-9)
    groups = tuple((n, max(seconds - 2 * (n - 1) / n * message_bytes / bandwidth, 1e-6))
                   for n, seconds in sorted(t["groups"].items()))
    return GlooLink(dict(groups)[world], bandwidth, groups)
