"""Device profiles: what the cost model knows about a device and its links, and presets.

A :class:`DeviceProfile` holds the figures :mod:`dynatrain.controller.costmodel` prices a
layout with (matmul, attention and elementwise rates, memory and its bandwidth, collective
bandwidth and latency, host time per operator) and how a world of ranks sees them when the
ranks are worker processes sharing one machine's cores. :data:`PROFILES` has presets for
H100, H200, A100 (80 and 40 GB), L40S, L4 and this machine's CPU, and
:func:`profile_for_gpu_name` / :func:`profile_for_node_labels` pick one from what CUDA or a
node's GPU feature discovery labels call the GPU; :mod:`dynatrain.controller.calibrate`
measures the CPU one. Plain data and arithmetic: no torch. It sits in :mod:`dynatrain.spec`
because the worker reads it too (to name its own device).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from dynatrain.vps.topology import DEFAULT_DEVICES_PER_NODE

GiB = 1 << 30
TiB = 1 << 40


@dataclass(frozen=True)
class DeviceProfile:
    """What the cost model needs to know about one device (and its links)."""

    flops_per_second: float
    """Sustained dense matmul throughput of one device in the model's dtype (per core when
    ``shared_cores`` is set)."""
    memory_bytes: int
    """Usable memory per device (the whole machine's when ``shared_cores`` is set)."""
    intra_node_bytes_per_second: float
    """Achieved collective (bus) bandwidth between devices of one node."""
    inter_node_bytes_per_second: float
    """Achieved collective bandwidth per device across nodes."""
    devices_per_node: int = DEFAULT_DEVICES_PER_NODE
    latency_seconds: float = 20e-6
    """Fixed cost of one collective or point-to-point message."""
    group_latency_seconds: tuple[tuple[int, float], ...] = ()
    """(group size, latency) where the latency depends on the group's size, as measured by
    :func:`~dynatrain.controller.calibrate.measure_gloo_link` for ranks sharing cores (a
    group larger than the number of ranks that can run at once must wait for the scheduler
    to run each member). A group of a size not listed takes the entry of the largest listed
    size below it, else ``latency_seconds``."""
    name: str = ""
    memory_bytes_per_second: float = 2e12
    """Sustained memory bandwidth of streaming kernels: the optimizer, bucket copies (per core
    with ``shared_cores``)."""
    elementwise_bytes_per_second: float = 0.0
    """Bytes read + written per second by the activations' elementwise kernels (norms, GELU /
    SiLU, softmax, residual adds); 0 means ``memory_bytes_per_second``. Memory-bound on GPUs;
    on CPUs the transcendental functions make it several times slower than a copy."""
    attention_flops_per_second: float = 0.0
    """Sustained rate of fused attention (scaled_dot_product_attention forward + backward,
    causal flops); 0 means ``flops_per_second``. Flash kernels reach about half the GEMM rate
    on GPUs, CPU kernels a quarter."""
    op_seconds: float = 0.0
    """Host time per operator (dispatch, autograd bookkeeping), paid on the critical path
    when the device runs operators synchronously (CPU); 0 for GPUs, whose asynchronous
    launches overlap it with device work at the sizes this solver is for."""
    reserved_bytes: int = 0
    """Memory per device that training cannot use: runtime context, communicator buffers,
    allocator fragmentation."""
    shared_cores: int = 0
    """0 for accelerators. C > 0: the devices are worker processes sharing C CPU cores of one
    machine (see "Ranks that share CPU cores" in :mod:`dynatrain.controller.costmodel`)."""
    fp32_flops_per_second: float = 0.0
    """Sustained matmul rate of a float32 model: without TF32, which torch leaves off
    (``torch.backends.cuda.matmul.allow_tf32``), a GPU computes float32 on its CUDA cores at
    about a fifteenth of its bf16 tensor-core rate; attention in float32 is bounded by it too.
    0 means ``flops_per_second`` (the CPU, whose rates are float32 already). Measured on an
    H200 (``benchmarks/gpu_cost_model.py``): a float32 gpt-125m step took 6.9x the time the
    bf16 rate predicts."""
    peak_flops_per_second: float = 0.0
    """The datasheet's dense peak in the training dtype, what model-FLOPs utilisation (MFU) is
    measured against; 0 means ``flops_per_second`` (a profile with no datasheet: the CPU)."""

    host_bytes_per_second: float = 0.0
    """Device-to-host copy rate into pinned memory (the snapshots); 0 means
    ``memory_bytes_per_second`` (a CPU "device" copies within its own memory)."""
    host_memory_bytes: int = 0
    """Host RAM of one node (the snapshots and mirrors live there); 0 means ``memory_bytes``
    (a CPU profile's memory is the machine's)."""

    def host_rate(self) -> float:
        return self.host_bytes_per_second or self.memory_bytes_per_second

    def host_memory(self) -> int:
        return self.host_memory_bytes or self.memory_bytes

    def peak_flops(self) -> float:
        """Per device: :attr:`peak_flops_per_second`, else the sustained matmul rate."""
        return self.peak_flops_per_second or self.flops_per_second

    # -- how a world of ``world`` ranks sees this profile ---------------------------------------
    def latency(self, group_size: int) -> float:
        """Fixed cost of one collective among ``group_size`` ranks (2: point-to-point)."""
        best = None
        for n, seconds in sorted(self.group_latency_seconds):
            if n <= group_size:
                best = seconds
        return self.latency_seconds if best is None else best

    def threads_per_rank(self, world: int) -> int:
        return max(1, self.shared_cores // world) if self.shared_cores else 1

    def rank_flops(self, world: int, dtype: str = "bfloat16") -> float:
        """One rank's matmul rate for a model computing in ``dtype``."""
        rate = self.flops_per_second
        if dtype == "float32" and self.fp32_flops_per_second:
            rate = self.fp32_flops_per_second
        return rate * self.threads_per_rank(world)

    def rank_memory_bandwidth(self, world: int) -> float:
        return self.memory_bytes_per_second * self.threads_per_rank(world)

    def elementwise_rate(self) -> float:
        return self.elementwise_bytes_per_second or self.memory_bytes_per_second

    def rank_elementwise_rate(self, world: int) -> float:
        return self.elementwise_rate() * self.threads_per_rank(world)

    def rank_attention_flops(self, world: int, dtype: str = "bfloat16") -> float:
        rate = self.attention_flops_per_second or self.flops_per_second
        if dtype == "float32" and self.fp32_flops_per_second:
            rate = min(rate, self.fp32_flops_per_second)
        return rate * self.threads_per_rank(world)

    def concurrent_ranks(self, world: int) -> float:
        """How many ranks can compute at full speed at the same time."""
        if not self.shared_cores:
            return math.inf
        return self.shared_cores / self.threads_per_rank(world)

    def rank_memory(self, world: int) -> int:
        return self.memory_bytes // world if self.shared_cores else self.memory_bytes


def cpu_cores() -> int:
    """Cores this process may run on (its affinity), or all of the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_quota(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
              ) -> float | None:
    """The CPU limit of this process's cgroup in cores (a pod's ``limits.cpu``: 0.25 for
    250m), the smallest along its cgroup path; None without one.

    Why it matters: torch starts one thread per core it may run on (its affinity), but a
    container limited to a quarter of a core gets a quarter of one core's time, so its threads
    are throttled in turn and wait for each other at every parallel region (on the dev
    cluster's real node, 2026-11-28: gpt-tiny steps of 10 s). cgroup v2 (``cpu.max``) and v1
    (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); a container sees its own cgroup at the
    hierarchy's root (v1, and v2 with a cgroup namespace), the host the full path."""
    base = Path(root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    dirs: list[Path] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        ident, controllers, path = parts
        if ident == "0" and controllers == "" and (base / "cpu.max").exists():
            top = base
        elif "cpu" in controllers.split(","):
            top = next((base / name for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu")
                        if (base / name / "cpu.cfs_quota_us").exists()), None)
            if top is None:
                continue
        else:
            continue
        rel = Path(path.lstrip("/"))
        dirs += [top / p for p in [rel, *rel.parents] if (top / p).is_dir()]
    quotas = [q for q in map(_quota_of, dirs) if q is not None]
    return min(quotas) if quotas else None


def _quota_of(directory: Path) -> float | None:
    try:
        if (directory / "cpu.max").exists():
            quota, period = (directory / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def threads_for_quota(quota: float | None, cores: int) -> int:
    """Torch threads for a process that may run on ``cores`` cores under a CPU limit of
    ``quota`` cores: the whole cores of the limit, at least one, at most ``cores``. (Rounded
    down: a thread beyond the limit is throttled within each period and the others wait for
    it at the next barrier.)"""
    if quota is None:
        return cores
    return max(1, min(cores, int(quota)))


def machine_memory() -> int:
    """Available memory of this machine (MemAvailable), or total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 * GiB


# Presets. Matmul rates are ~2/3 of the datasheet's dense bf16 peak, what large GEMMs sustain
# (and an upper bound for a whole model); attention rates are what FlashAttention-2 reports
# for forward + backward (Dao 2023: ~50-70% of peak on A100, ~350 TFLOPS on H100);
# collective bandwidths are NCCL bus bandwidths that nccl-tests typically report on such
# systems, below the link's nominal one-way rate; 2 GiB reserved covers the CUDA context,
# NCCL buffers and allocator fragmentation.
# Host links: pinned device-to-host copies reach ~50 GB/s on PCIe Gen5 x16 (H100, H200) and
# ~25 GB/s on Gen4 (A100, L40S, L4). Host RAM per node as the vendors' 8-GPU systems ship it
# (DGX H100/H200 and DGX A100 640 GB: 2 TiB; DGX A100 320 GB: 1 TiB; L40S/L4 servers: 1 TiB
# and 512 GiB, typical).
PROFILES: dict[str, DeviceProfile] = {
    # H100 SXM5 80 GB (NVIDIA datasheet: 989 TFLOPS dense bf16, 3.35 TB/s HBM3, NVLink 4 at
    # 450 GB/s per direction; DGX H100: one 400 Gb/s ConnectX-7 NIC per GPU = 50 GB/s).
    "h100": DeviceProfile(
        name="h100", flops_per_second=650e12, memory_bytes=80 * 10**9,
        intra_node_bytes_per_second=360e9, inter_node_bytes_per_second=40e9,
        devices_per_node=8, latency_seconds=20e-6, memory_bytes_per_second=3.0e12,
        attention_flops_per_second=350e12, reserved_bytes=2 * GiB,
        fp32_flops_per_second=45e12, peak_flops_per_second=989e12,
        host_bytes_per_second=50e9, host_memory_bytes=2 * TiB),
    # A100 SXM4 80 GB (312 TFLOPS dense bf16, 2.04 TB/s HBM2e, NVLink 3 at 300 GB/s per
    # direction; DGX A100: one 200 Gb/s HDR NIC per GPU = 25 GB/s).
    "a100": DeviceProfile(
        name="a100", flops_per_second=205e12, memory_bytes=80 * 10**9,
        intra_node_bytes_per_second=230e9, inter_node_bytes_per_second=20e9,
        devices_per_node=8, latency_seconds=25e-6, memory_bytes_per_second=1.8e12,
        attention_flops_per_second=170e12, reserved_bytes=2 * GiB,
        fp32_flops_per_second=13e12, peak_flops_per_second=312e12,
        host_bytes_per_second=25e9, host_memory_bytes=2 * TiB),
    # A100 SXM4 40 GB: the 80 GB part's compute and links, half the memory, 1.56 TB/s HBM2.
    "a100-40gb": DeviceProfile(
        name="a100-40gb", flops_per_second=205e12, memory_bytes=40 * 10**9,
        intra_node_bytes_per_second=230e9, inter_node_bytes_per_second=20e9,
        devices_per_node=8, latency_seconds=25e-6, memory_bytes_per_second=1.4e12,
        attention_flops_per_second=170e12, reserved_bytes=2 * GiB,
        fp32_flops_per_second=13e12, peak_flops_per_second=312e12,
        host_bytes_per_second=25e9, host_memory_bytes=1 * TiB),
    # H200 SXM 141 GB: H100's compute (989 TFLOPS dense bf16) and NVLink 4, 4.8 TB/s HBM3e.
    "h200": DeviceProfile(
        name="h200", flops_per_second=650e12, memory_bytes=141 * 10**9,
        intra_node_bytes_per_second=360e9, inter_node_bytes_per_second=40e9,
        devices_per_node=8, latency_seconds=20e-6, memory_bytes_per_second=4.3e12,
        attention_flops_per_second=350e12, reserved_bytes=2 * GiB,
        fp32_flops_per_second=45e12, peak_flops_per_second=989e12,
        host_bytes_per_second=50e9, host_memory_bytes=2 * TiB),
    # L40S 48 GB (362 TFLOPS dense bf16, 864 GB/s GDDR6): PCIe Gen4 x16 between GPUs, no
    # NVLink (~20 GB/s bus bandwidth through the host), typically 100-200 Gb/s between nodes.
    "l40s": DeviceProfile(
        name="l40s", flops_per_second=240e12, memory_bytes=48 * 10**9,
        intra_node_bytes_per_second=20e9, inter_node_bytes_per_second=12e9,
        devices_per_node=8, latency_seconds=30e-6, memory_bytes_per_second=0.75e12,
        attention_flops_per_second=130e12, reserved_bytes=2 * GiB,
        fp32_flops_per_second=61e12, peak_flops_per_second=362e12,
        host_bytes_per_second=25e9, host_memory_bytes=1 * TiB),
    # L4 24 GB (121 TFLOPS dense bf16, 300 GB/s GDDR6): PCIe Gen4, a 50 Gb/s-class network.
    "l4": DeviceProfile(
        name="l4", flops_per_second=80e12, memory_bytes=24 * 10**9,
        intra_node_bytes_per_second=12e9, inter_node_bytes_per_second=5e9,
        devices_per_node=8, latency_seconds=30e-6, memory_bytes_per_second=0.26e12,
        attention_flops_per_second=40e12, reserved_bytes=1 * GiB,
        fp32_flops_per_second=20e12, peak_flops_per_second=121e12,
        host_bytes_per_second=25e9, host_memory_bytes=TiB // 2),
    # Worker processes on this machine (the local runner): a static guess per core of a
    # recent x86 server core with AVX-512, from the project's 2-core CI VM (~100 GFLOPS fp32
    # for 512^3 matmuls, ~30 GFLOPS for attention at head dim 32, ~13 GB/s through torch's
    # AdamW, ~8 GB/s for a norm/add/GELU mix, ~5 us per operator, gloo over loopback TCP
    # ~1 GB/s and ~0.3 ms per collective while no more ranks than cores). 300 MiB reserved
    # per rank: a torch process's resident baseline. Prefer calibrate.measure_cpu_profile(), and
    # pass it measure_gloo_link(n) when ranks outnumber cores: then a collective costs ms.
    "cpu": DeviceProfile(
        name="cpu", flops_per_second=100e9, memory_bytes=machine_memory(),
        intra_node_bytes_per_second=1e9, inter_node_bytes_per_second=1e9,
        devices_per_node=1 << 16, latency_seconds=300e-6, memory_bytes_per_second=13e9,
        elementwise_bytes_per_second=8e9, attention_flops_per_second=30e9, op_seconds=5e-6,
        reserved_bytes=300 << 20, shared_cores=cpu_cores()),
}


def profile_for_gpu_name(name: str) -> DeviceProfile | None:
    """The preset of a GPU from its name as CUDA reports it (``torch.cuda.get_device_name``:
    "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"), or None for a GPU with no preset."""
    upper = name.upper().replace("-", " ")
    words = set(upper.split())
    if "H200" in words:
        return PROFILES["h200"]
    if "H100" in words:
        return PROFILES["h100"]
    if "A100" in words:
        return PROFILES["a100-40gb" if "40GB" in words else "a100"]
    if "L40S" in words:
        return PROFILES["l40s"]
    if "L4" in words:
        return PROFILES["l4"]
    return None


GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
"""The GPU model of a node, as NVIDIA's GPU feature discovery labels it
("NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-40GB", "NVIDIA-L4")."""
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
"""Its memory in MiB ("40960")."""


def profile_for_node_labels(labels: dict[str, str]) -> DeviceProfile | None:
    """The preset of a node's GPUs from its labels (:data:`GPU_PRODUCT_LABEL`, with
    :data:`GPU_MEMORY_LABEL` telling an A100's 40 GB part from its 80 GB one where the
    product name does not), or None when they name no GPU with a preset."""
    profile = profile_for_gpu_name(labels.get(GPU_PRODUCT_LABEL, ""))
    memory = labels.get(GPU_MEMORY_LABEL, "")
    if profile is not None and profile.name == "a100" and memory.isdigit() \
            and int(memory) < 60 * 1024:
        return PROFILES["a100-40gb"]
    return profile
