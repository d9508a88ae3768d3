"""The trainer of one rank: state allocated from the VPS mapping, a GPipe step, state in and out.

Allocation follows :func:`dynatrain.vps.mapping.rank_shards` literally: for every (tensor,
state) the rank holds, a local tensor of the mapping's ``local_shape`` is filled piece by piece
(``local[piece.local] = full[piece.box]``). The same pieces describe the state when it leaves
(:meth:`Trainer.local_state`), and a trainer can be built from local tensors that a switch
delivered (``Trainer(..., state=...)``), so the layout the planner reasons about is the layout
that runs.

Compute uses each tensor's TP/EP-local *working* weight: the parameter itself without ZeRO-3,
or (ZeRO-3) one gathered from the flat shards at the start of the step and dropped after it.
The step runs the layout's pipeline schedule over the rank's micro-batches (activations to the
next stage, gradients back to the previous one), then gradient reduction, clipping to the
global norm, the scheduled learning rate and AdamW (see :mod:`.optim`). The schedules:

GPipe
    every micro-batch forward, then every backward; the stage holds all ``m`` micro-batches'
    activations at the turn.
1F1B (PipeDream-Flush, Megatron's non-interleaved schedule)
    stage ``s`` of ``pp`` runs ``min(m, pp - 1 - s)`` warm-up forwards, then alternates one
    forward with one backward, then drains the remaining backwards; it holds at most
    ``min(m, pp - s)`` micro-batches' activations. Where a stage must both send and receive
    (its forward output and the gradient of an older micro-batch) it posts both before waiting
    on either, as Megatron's ``send_forward_recv_backward`` does: with one blocking operation
    at a time, two neighbours that each send first would wait on each other forever.

Both run the backward passes in micro-batch order 0..m-1 (GPipe could take any order; this
one is 1F1B's), so every weight gradient is the same float sum in the same order, and a
schedule change, live or not, leaves the training bit-identical.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from collections import deque

from dynatrain.vps.abandon import wait, waited_seconds
from dynatrain.vps.boxes import box_extents, box_numel
from dynatrain.vps.layout import bind
from dynatrain.vps.mapping import Piece, counts_once, flat_shard_range, rank_shards, tp_box

from .activations import ActivationMeter
from .config import TrainConfig
from .data import micro_batches, token_source
from .model import StageModel
from .optim import (clip_by_norm, fill_missing_grads, gather_flat_shards, make_optimizer,
                    reduce_gradients, set_lr, square_sum)
from .weights import TORCH_DTYPES, initial_tensor


def warm_up() -> None:
    """Pay torch's one-off lazy initialisation (optimizer machinery, autograd) now.

    A joiner waits in standby and then builds its first trainer inside the switch pause; in a
    fresh process that first construction costs about a second of lazy setup, so standby
    devices call this while they wait.
    """
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.AdamW([w], lr=1e-3, foreach=True)     # as make_optimizer
    (w * 2).sum().backward()
    opt.step()


def _slices(box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


@dataclass
class LocalState:
    """Everything one rank holds of the training state, described by the mapping's pieces."""

    tensors: dict[tuple[str, str], tuple[torch.Tensor, tuple[Piece, ...]]]
    """(tensor name, state kind) -> (local tensor, pieces)."""
    step: int
    data_position: int
    """Global index of the next sample the data stream will produce."""
    rng: dict = field(default_factory=dict)


@dataclass
class StepResult:
    step: int
    loss: float
    seconds: float
    tokens_per_second: float
    signal: float = 0.0
    """Sum over every rank of the ``signal`` each passed to :meth:`Trainer.train_step`."""
    samples: tuple[int, int] = (0, 0)
    """Global samples [begin, end) this rank read as a data reader (first stage, TP index 0);
    an empty range on other ranks, so every sample is counted once per step."""
    grad_norm: float = 0.0
    """Global L2 norm of the step's gradient before clipping (over the logical model, each
    element once); above ``TrainConfig.grad_clip`` (when set) means the step was clipped."""
    lr: float = 0.0
    """The learning rate this step's optimizer update used (the schedule's, at this step)."""
    phases: dict = field(default_factory=dict)
    """This rank's ``seconds`` split: ``communication`` (time spent waiting for collectives
    and pipeline messages, i.e. communication not hidden behind compute), ``redundancy``
    (waiting for the in-memory mirrors before the step's last all-reduce) and ``compute``
    (the rest)."""
    activation_bytes: int = 0
    """This rank's peak bytes of tensors saved for backward during the step, when
    :attr:`Trainer.measure_activations` is on (:class:`.activations.ActivationMeter`); else 0."""
    expert_tokens: tuple[int, ...] = ()
    """MoE: the tokens this rank's micro-batches routed to each expert (global index), over
    its stage's layers; reported by TP index 0 only (the others route the same tokens)."""
    memory_bytes: int = 0
    """This rank's memory at the step: on a GPU the peak allocated during it, on a CPU the
    process's resident memory at its end (0: not known, not Linux)."""


class PartTimer:
    """Seconds a step's forward and backward passes compute, summed over its micro-batches.

    On a CPU: each pass's wall time less its waits in collectives (the step's ``compute``
    phase is measured the same way). On a GPU, whose kernels run after the host has moved on:
    CUDA events on the compute stream around each pass, read once at the end of the step, so
    timing costs no synchronisation inside it (a pass's TP all-reduces, which the stream waits
    for, count in it there)."""

    PARTS = ("forward", "backward")

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.host = dict.fromkeys(self.PARTS, 0.0)
        self.events: dict[str, list] = {k: [] for k in self.PARTS}

    def start(self, part: str):
        if self.cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            return begin
        return time.perf_counter(), waited_seconds()

    def stop(self, part: str, started) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events[part].append((started, end))
        else:
            t, w = started
            self.host[part] += (time.perf_counter() - t) - (waited_seconds() - w)

    def seconds(self) -> dict[str, float]:
        if not self.cuda:
            return dict(self.host)
        out = {}
        for part, pairs in self.events.items():
            if pairs:
                pairs[-1][1].synchronize()
            out[part] = sum(a.elapsed_time(b) for a, b in pairs) / 1e3
        return out


def resident_bytes() -> int:
    """This process's resident memory (Linux's /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Trainer:
    def __init__(self, config: TrainConfig, groups, *, device: torch.device | None = None,
                 state: LocalState | None = None):
        self.cfg = config
        self.model = config.model
        self.bound = bind(config.layout, config.model)
        self.g = groups
        self.device = device or torch.device("cpu")
        lay = self.bound.layout
        self.lay = lay
        self.zero = lay.zero
        self.dtype = TORCH_DTYPES[self.model.dtype]
        self.fp32 = self.model.dtype == "float32"
        stage, j, t = lay.coords(groups.rank)
        self.shards = {(rs.tensor.name, rs.state): rs for rs in rank_shards(self.bound, groups.rank)}
        self.specs = {name: rs.tensor for (name, _), rs in self.shards.items()}
        self.boxes, self.ranges = {}, {}
        for name, spec in self.specs.items():
            expert = spec.expert_dim is not None
            box = tp_box(spec.rule, lay.tp, t, lay.ep if expert else 1, j % lay.ep if expert else 0)
            self.boxes[name] = box
            self.ranges[name] = flat_shard_range(spec.rule, box_numel(box), lay.dp, lay.ep, j)

        local = self._allocate(state)
        self.params = {n: local[(n, "param")] for n in self.specs}
        if self.zero < 3:
            self.working = self.params
            for w in self.working.values():
                w.requires_grad_(True)
        else:
            self.working = {}
        self.masters = self._masters(local)
        self.optimizer = make_optimizer(self.masters, self.specs, config)
        if state is not None:
            self._load_moments(local, state.step)
        self.step = state.step if state else 0
        self.lr = 0.0
        """The learning rate of the last optimizer step."""
        self.position = state.data_position if state else 0
        if state and state.rng.get("cpu") is not None:
            torch.set_rng_state(state.rng["cpu"])
        if state and state.rng.get("cuda") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state.rng["cuda"].cpu(), self.device)

        self.source = token_source(config)
        vocab_box = self.boxes.get("embed.tokens") or self.boxes.get("head.weight")
        self.stage = StageModel(self.model, self.bound.stage_layers(stage),
                                first=groups.first_stage, last=groups.last_stage, groups=groups,
                                ep=lay.ep, vocab_start=vocab_box[0][0] if vocab_box else 0,
                                recompute=config.activation_checkpointing)
        self.measure_activations = False
        """Count the bytes saved for backward in each step (``StepResult.activation_bytes``);
        off by default: the hooks cost a little Python per saved tensor."""
        self.slowdown = 1.0
        """Compute this many times slower (a test's simulated slow device: the worker sets it
        from ``DYNATRAIN_SLOWDOWN``, :func:`dynatrain.vps.faults.slowdown`)."""
        self.parts = PartTimer(self.device)
        """The forward and backward passes' compute seconds in the step (:class:`PartTimer`)."""
        self._dense = [n for n, s in self.specs.items() if s.expert_dim is None]
        self._expert = [n for n, s in self.specs.items() if s.expert_dim is not None]
        # Tensors whose master gradient this rank adds to the global norm. The master
        # gradient is sharded exactly like the AdamW moments, so the mapping's rule for
        # exp_avg decides who stands for each shard.
        self._norm_owned = [n for n, s in self.specs.items()
                            if counts_once(self.bound, s, "exp_avg", groups.rank)]

    # -- allocation --------------------------------------------------------------------------
    def _allocate(self, state: LocalState | None) -> dict[tuple[str, str], torch.Tensor]:
        """Local tensors for every (tensor, state) the mapping gives this rank: from a
        switch's ``state``, read piece by piece from the Hugging Face checkpoint
        ``cfg.init_hf``, or seeded initial values."""
        out = {}
        reader = None
        if state is None and self.cfg.init_hf:
            from .hf import HFReader, read_local  # only runs that start from one need it

            reader = HFReader(self.cfg.init_hf)
        for key, rs in self.shards.items():
            if state is not None:
                if key not in state.tensors:
                    raise KeyError(f"state for layout {self.lay.to_text()} lacks {key[0]} "
                                   f"({key[1]}) on rank {self.g.rank}")
                tensor = state.tensors[key][0].to(self.device)
                if tuple(tensor.shape) != tuple(rs.local_shape):
                    raise ValueError(f"{key[0]} ({key[1]}) on rank {self.g.rank}: got shape "
                                     f"{tuple(tensor.shape)}, the mapping says {rs.local_shape}")
                out[key] = tensor
            elif rs.state in ("param", "master") and reader is not None:
                dtype = self.dtype if rs.state == "param" else torch.float32
                out[key] = read_local(reader, rs, dtype).to(self.device)
            elif rs.state in ("param", "master"):
                full = initial_tensor(self.model, rs.tensor, self.cfg.seed)
                dtype = self.dtype if rs.state == "param" else torch.float32
                local = torch.empty(rs.local_shape, dtype=dtype)
                for piece in rs.pieces:
                    dst = local[_slices(piece.local)]
                    dst.copy_(full[_slices(piece.box)].reshape(dst.shape))
                out[key] = local.to(self.device)
        if reader is not None:
            reader.close()                    # the files are needed at start-up only
        return out

    def _masters(self, local) -> dict[str, torch.Tensor]:
        """The fp32 tensors AdamW updates: a TP-local tensor, or this rank's flat ZeRO range."""
        masters = {}
        for n in self.specs:
            if (n, "master") in local:
                masters[n] = local[(n, "master")]
            elif self.zero == 0 or self.zero == 3:
                masters[n] = self.params[n]          # fp32: the parameter is its own master
            else:
                a, b = self.ranges[n]
                masters[n] = self.params[n].detach().reshape(-1)[a:b].clone()
        return masters

    def _load_moments(self, local, step: int) -> None:
        for n, master in self.masters.items():
            st = self.optimizer.state[master]
            st["step"] = torch.tensor(float(step))
            st["exp_avg"] = local[(n, "exp_avg")]
            st["exp_avg_sq"] = local[(n, "exp_avg_sq")]

    # -- the step ----------------------------------------------------------------------------
    def _gather_zero3(self) -> None:
        """ZeRO-3: TP-local working weights from every rank's flat shard, for this step."""
        self.working = {n: torch.zeros(box_extents(self.boxes[n]), dtype=self.dtype,
                                       device=self.device) for n in self.specs}
        masters = {n: self.params[n] for n in self.specs}
        gather_flat_shards(self.working, masters, self.ranges, self._dense, self.g.dp)
        gather_flat_shards(self.working, masters, self.ranges, self._expert, self.g.edp)
        for w in self.working.values():
            w.requires_grad_(True)

    def _activation_shape(self) -> tuple[int, int, int]:
        return (self.cfg.micro_batch_size, self.cfg.seq_len, self.model.hidden_size)

    def train_step(self, signal: float = 0.0, before_report=None,
                   before_update=None) -> StepResult:
        """One optimizer step. ``signal`` is summed over every rank in the step's own loss
        all-reduce, so all ranks agree on it at the same step boundary at no extra cost (the
        agent uses it to agree on when to switch). ``before_report()`` runs just before that
        final all-reduce: whatever it waits for has happened on every rank once any rank
        completes the step (the redundancy waits for its mirrors there). ``before_update()``
        runs just before the optimizer overwrites the state (a snapshot's copies on a GPU
        side stream are waited for there, by the compute stream)."""
        t0 = time.perf_counter()
        waited0 = waited_seconds()
        if self.zero == 3:
            self._gather_zero3()
        for w in self.working.values():
            w.grad = None
        self.parts.reset()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        cfg, g, w = self.cfg, self.g, self.working
        shares = cfg.micro_batch_shares
        batches = micro_batches(self.source, self.position, cfg.global_batch_size,
                                self.lay.dp, g.dp_index, cfg.micro_batch_size, shares)
        # Every micro-batch of the step weighs 1 / (the step's micro-batches), whatever this
        # rank's share, so the DP ranks' summed gradients are the global mean.
        scale = 1.0 / sum(shares)
        run = self._one_f_one_b if self.lay.schedule == "1f1b" else self._gpipe
        if self.model.is_moe and g.tp_index == 0:
            self.stage.tally = torch.zeros(self.model.num_experts, dtype=torch.int64,
                                           device=self.device)
        c0, cw0 = time.perf_counter(), waited_seconds()
        if self.measure_activations:
            with ActivationMeter(exclude=[*w.values(), *self.params.values()]) as meter:
                losses = run(batches, scale)
            activation_bytes = meter.peak_bytes
        else:
            losses, activation_bytes = run(batches, scale), 0
        tally, self.stage.tally = self.stage.tally, None
        if self.slowdown > 1.0:               # a simulated slower device (vps.faults.slowdown)
            compute = (time.perf_counter() - c0) - (waited_seconds() - cw0)
            time.sleep((self.slowdown - 1.0) * max(0.0, compute))

        fill_missing_grads(self.working)
        reduce_gradients(self.working, self.specs, g)
        if before_update is not None:
            before_update()
        square, norm = self._optimizer_step()
        self.step += 1
        samples = (self.position, self.position)
        if g.first_stage and g.tp_index == 0:
            first = self.position + sum(shares[:g.dp_index]) * cfg.micro_batch_size
            samples = (first, first + shares[g.dp_index] * cfg.micro_batch_size)
        self.position += cfg.global_batch_size

        # float64 so that the signal (small integers) and the loss share one all-reduce exactly.
        # Without clipping the gradient norm's shares ride along (with it they were summed
        # before the optimizer step), so reporting the norm costs no collective of its own.
        report = torch.zeros(3, dtype=torch.float64, device=self.device)
        if g.last_stage and g.tp_index == 0:
            # The mean of this rank's micro-batches, weighted by its share of the step (1.0,
            # exactly, when the shares are even), so the sum over DP ranks / dp is the mean
            # over every micro-batch of the step.
            weight = len(losses) * self.lay.dp / sum(shares)
            report[0] += torch.stack(losses).float().mean().double() * weight
        report[1] = signal
        if norm is None:
            report[2] = square
        mirror_seconds = mirror_waited = 0.0
        if before_report is not None:
            r0, rw0 = time.perf_counter(), waited_seconds()
            before_report()
            mirror_seconds = time.perf_counter() - r0
            mirror_waited = waited_seconds() - rw0
        if g.world is not None:                               # every rank learns the loss
            wait(dist.all_reduce(report, group=g.world, async_op=True))
        loss = float(report[0]) / self.lay.dp
        grad_norm = float(norm) if norm is not None else float(report[2]) ** 0.5
        seconds = time.perf_counter() - t0
        communication = waited_seconds() - waited0 - mirror_waited
        phases = {"compute": max(0.0, seconds - communication - mirror_seconds),
                  "communication": communication, "redundancy": mirror_seconds}
        # A simulated slower device is slower in each pass (its sleep followed the passes).
        phases.update({k: v * max(1.0, self.slowdown) for k, v in self.parts.seconds().items()})
        memory = (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                  else resident_bytes())
        return StepResult(self.step, loss, seconds, cfg.tokens_per_step / seconds,
                          float(report[1]), samples, grad_norm, self.lr, phases,
                          activation_bytes,
                          tuple(tally.tolist()) if tally is not None else (), memory)

    # -- pipeline schedules --------------------------------------------------------------------
    # Messages between neighbouring stages: activations forward under tag 0, their gradients
    # backward under tag 1; gloo matches a receive to the same sender's sends of its tag in
    # order, so each direction is a FIFO of micro-batches.
    _FORWARD, _BACKWARD = 0, 1

    def _exchange(self, send_next=None, send_prev=None, recv_prev=False,
                  recv_next=False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Post every given pipeline send and receive, then wait for all of them: an
        activation to the next stage and/or a gradient to the previous one; an activation
        from the previous stage and/or a gradient from the next one, which are returned."""
        g = self.g
        from_prev = from_next = None
        works = []
        if send_next is not None:
            works.append(g.pp.send([send_next.detach().contiguous()], g.pp_index + 1,
                                   self._FORWARD))
        if send_prev is not None:
            works.append(g.pp.send([send_prev.contiguous()], g.pp_index - 1, self._BACKWARD))
        if recv_prev:
            from_prev = torch.empty(self._activation_shape(), dtype=self.dtype,
                                    device=self.device)
            works.append(g.pp.recv([from_prev], g.pp_index - 1, self._FORWARD))
        if recv_next:
            from_next = torch.empty(self._activation_shape(), dtype=self.dtype,
                                    device=self.device)
            works.append(g.pp.recv([from_next], g.pp_index + 1, self._BACKWARD))
        for work in works:
            wait(work)
        return from_prev, from_next

    def _forward(self, batch, x_in, scale: float, losses: list):
        """One micro-batch through the stage: (its input, what backward starts from: the
        scaled loss on the last stage, else the output, which goes to the next stage)."""
        inputs, targets = batch
        w = self.working
        started = self.parts.start("forward")
        if self.g.first_stage:
            x = self.stage.embed(inputs.to(self.device), w)
        else:
            x = x_in.requires_grad_(True)
        y = self.stage.blocks(x, w)
        if self.g.last_stage:
            loss = self.stage.loss(y, targets.to(self.device), w)
            losses.append(loss.detach())
            y = loss * scale
        self.parts.stop("forward", started)
        return x, y

    def _backward(self, x, y, grad) -> torch.Tensor | None:
        """Backward of one micro-batch; the gradient of its input for the previous stage."""
        started = self.parts.start("backward")
        if grad is None:
            y.backward()                                      # last stage: from the loss
        else:
            y.backward(grad)
        self.parts.stop("backward", started)
        return None if self.g.first_stage else x.grad

    def _gpipe(self, batches, scale: float) -> list:
        g, losses, saved = self.g, [], []
        last, first = g.last_stage, g.first_stage
        for batch in batches:                                 # forward, all micro-batches
            x_in, _ = self._exchange(recv_prev=not first)
            x, y = self._forward(batch, x_in, scale, losses)
            self._exchange(send_next=None if last else y)
            saved.append((x, y))
        for x, y in saved:                                    # backward, micro-batch order
            _, grad = self._exchange(recv_next=not last)
            dx = self._backward(x, y, grad)
            self._exchange(send_prev=dx)
        return losses

    def _one_f_one_b(self, batches, scale: float) -> list:
        g, losses, alive = self.g, [], deque()
        last, first = g.last_stage, g.first_stage
        m = len(batches)
        warmup = min(m, self.lay.pp - 1 - g.pp_index)
        for i in range(warmup):
            x_in, _ = self._exchange(recv_prev=not first)
            x, y = self._forward(batches[i], x_in, scale, losses)
            self._exchange(send_next=None if last else y)
            alive.append((x, y))
        steady = m - warmup
        if steady:
            x_in, _ = self._exchange(recv_prev=not first)
        for i in range(steady):
            x, y = self._forward(batches[warmup + i], x_in, scale, losses)
            alive.append((x, y))
            # Send this output on, take the gradient of the oldest micro-batch in flight.
            _, grad = self._exchange(send_next=None if last else y, recv_next=not last)
            x, y = alive.popleft()
            dx = self._backward(x, y, grad)
            # Send its input gradient back, take the next micro-batch's input.
            x_in, _ = self._exchange(send_prev=dx, recv_prev=not first and i < steady - 1)
        for _ in range(warmup):                               # drain
            x, y = alive.popleft()
            _, grad = self._exchange(recv_next=not last)
            self._exchange(send_prev=self._backward(x, y, grad))
        return losses

    def _optimizer_step(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Clip, schedule and step. Returns this rank's share of the squared gradient norm,
        and the global norm itself when clipping needed it (None otherwise)."""
        for n, master in self.masters.items():
            grad = self.working[n].grad
            if self.zero == 0:
                master.grad = grad if self.fp32 else grad.float()
            else:
                a, b = self.ranges[n]
                master.grad = grad.reshape(-1)[a:b].float()
        square = square_sum([self.masters[n].grad for n in self._norm_owned], self.device)
        norm = None
        if self.cfg.grad_clip > 0:
            total = square.clone()
            if self.g.world is not None:
                wait(dist.all_reduce(total, group=self.g.world, async_op=True))
            norm = total.sqrt()
            clip_by_norm([m.grad for m in self.masters.values()], norm, self.cfg.grad_clip)
        # The step count is part of the state every switch, recovery and checkpoint carries,
        # so the schedule resumes on the same curve under any layout.
        self.lr = self.cfg.lr_at(self.step)
        set_lr(self.optimizer, self.lr)
        with torch.no_grad():
            self.optimizer.step()
            if self.zero == 0 and not self.fp32:
                for n in self.specs:
                    self.params[n].copy_(self.masters[n])
            elif self.zero == 1:
                gather_flat_shards(self.working, self.masters, self.ranges, self._dense, self.g.dp)
                gather_flat_shards(self.working, self.masters, self.ranges, self._expert,
                                   self.g.edp)
            elif self.zero == 3 and not self.fp32:
                for n in self.specs:
                    self.params[n].copy_(self.masters[n])
        for master in self.masters.values():
            master.grad = None
        if self.zero == 3:
            self.working = {}                                 # ZeRO-3 keeps only shards at rest
        return square, norm

    # -- state out ---------------------------------------------------------------------------
    def local_state(self) -> LocalState:
        """This rank's training state, each local tensor with the mapping's pieces."""
        tensors = {}
        for (n, state), rs in self.shards.items():
            master = self.masters[n]
            if state == "param":
                t = self.params[n].detach()
            elif state == "master":
                t = master.detach()
            else:
                t = self.optimizer.state.get(master, {}).get(state)
                if t is None:                                  # before the first step
                    t = torch.zeros_like(master.detach())
            tensors[(n, state)] = (t, rs.pieces)
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":         # the GPU's generator too (dropout, sampling)
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return LocalState(tensors, self.step, self.position, rng)
