"""The trainer of one rank: state allocated from the VPS mapping, a GPipe step, state in and out.

Allocation follows :func:`dynatrain.vps.mapping.rank_shards` literally: for every (tensor,
state) the rank holds, a local tensor of the mapping's ``local_shape`` is filled piece by piece
(``local[piece.local] = full[piece.box]``). The same pieces describe the state when it leaves
(:meth:`Trainer.local_state`), and a trainer can be built from local tensors that a switch
delivered (``Trainer(..., state=...)``), so the layout the planner reasons about is the layout
that runs.

Compute uses each tensor's TP/EP-local *working* weight: the parameter itself without ZeRO-3,
or (ZeRO-3) one gathered from the flat shards at the start of the step and dropped after it.
The step is GPipe: every micro-batch forward through the stage (activations to the next stage),
then every backward in reverse (gradients to the previous stage), then gradient reduction,
clipping to the global norm, the scheduled learning rate and AdamW (see :mod:`.optim`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dynatrain.vps.abandon import wait, waited_seconds
from dynatrain.vps.boxes import box_extents, box_numel
from dynatrain.vps.layout import bind
from dynatrain.vps.mapping import Piece, counts_once, flat_shard_range, rank_shards, tp_box

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
    opt = torch.optim.AdamW([w], lr=1e-3, foreach=False)
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

        self.source = token_source(config)
        vocab_box = self.boxes.get("embed.tokens") or self.boxes.get("head.weight")
        self.stage = StageModel(self.model, self.bound.stage_layers(stage),
                                first=groups.first_stage, last=groups.last_stage, groups=groups,
                                ep=lay.ep, vocab_start=vocab_box[0][0] if vocab_box else 0)
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

    def train_step(self, signal: float = 0.0, before_report=None) -> StepResult:
        """One optimizer step. ``signal`` is summed over every rank in the step's own loss
        all-reduce, so all ranks agree on it at the same step boundary at no extra cost (the
        agent uses it to agree on when to switch). ``before_report()`` runs just before that
        final all-reduce: whatever it waits for has happened on every rank once any rank
        completes the step (the redundancy waits for its mirrors there)."""
        t0 = time.perf_counter()
        waited0 = waited_seconds()
        if self.zero == 3:
            self._gather_zero3()
        for w in self.working.values():
            w.grad = None
        cfg, g, stage, w = self.cfg, self.g, self.stage, self.working
        batches = micro_batches(self.source, self.position, cfg.global_batch_size,
                                self.lay.dp, g.dp_index, cfg.micro_batch_size)
        scale = 1.0 / (len(batches) * self.lay.dp)
        saved, losses = [], []
        for inputs, targets in batches:                       # forward, all micro-batches
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            if g.first_stage:
                x = stage.embed(inputs, w)
            else:
                x = torch.empty(self._activation_shape(), dtype=self.dtype, device=self.device)
                wait(g.pp.recv([x], g.pp_index - 1, 0))
                x.requires_grad_(True)
            y = stage.blocks(x, w)
            if g.last_stage:
                loss = stage.loss(y, targets, w)
                losses.append(loss.detach())
                saved.append((x, loss * scale))
            else:
                wait(g.pp.send([y.detach().contiguous()], g.pp_index + 1, 0))
                saved.append((x, y))
        for x, y in reversed(saved):                          # backward, reverse order
            if g.last_stage:
                y.backward()
            else:
                grad = torch.empty_like(y)
                wait(g.pp.recv([grad], g.pp_index + 1, 1))
                y.backward(grad)
            if not g.first_stage:
                wait(g.pp.send([x.grad.contiguous()], g.pp_index - 1, 1))

        fill_missing_grads(self.working)
        reduce_gradients(self.working, self.specs, g)
        square, norm = self._optimizer_step()
        self.step += 1
        samples = (self.position, self.position)
        if g.first_stage and g.tp_index == 0:
            per_rank = cfg.global_batch_size // self.lay.dp
            samples = (self.position + g.dp_index * per_rank,
                       self.position + (g.dp_index + 1) * per_rank)
        self.position += cfg.global_batch_size

        # float64 so that the signal (small integers) and the loss share one all-reduce exactly.
        # Without clipping the gradient norm's shares ride along (with it they were summed
        # before the optimizer step), so reporting the norm costs no collective of its own.
        report = torch.zeros(3, dtype=torch.float64, device=self.device)
        if g.last_stage and g.tp_index == 0:
            report[0] += torch.stack(losses).float().mean().double()
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
        return StepResult(self.step, loss, seconds, cfg.tokens_per_step / seconds,
                          float(report[1]), samples, grad_norm, self.lr, phases)

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
        return LocalState(tensors, self.step, self.position, {"cpu": torch.get_rng_state()})
