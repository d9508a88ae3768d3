"""DynaTrain's steady-state step time beside PyTorch-native parallelism on the same job.

For each layout, one set of rank processes (gloo on CPU, one thread per rank when 2 ranks share
2 cores: :func:`dynatrain.trainer.launch.run_ranks` sets it) trains two copies of the same job
side by side: DynaTrain's trainer under the layout, and the same transformer under what a user
would pick instead in plain PyTorch:

- ``dp=2``: ``DistributedDataParallel`` (gradient accumulation under ``no_sync``);
- ``dp=2,zero=3``: FSDP2 (``fully_shard`` per block and at the root; gradient sync only on the
  last micro-batch, ``set_requires_gradient_sync``);
- ``tp=2``: DTensor tensor parallelism (``parallelize_module``: q/k/v and fc1
  ``ColwiseParallel``, o and fc2 ``RowwiseParallel``, the vocabulary-sharded embedding
  ``RowwiseParallel``, the tied head's logits left vocabulary-sharded and the loss computed
  under ``loss_parallel``; Megatron-style, no sequence parallelism, as DynaTrain's TP);
- ``pp=2``: ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``, the same
  layer split; the tied embedding's gradient summed between first and last stage, as Megatron
  and DynaTrain do).

The same model math (the native module is built from the same initial tensors,
:func:`dynatrain.trainer.weights.initial_tensor`, and computes the blocks op for op as
:class:`dynatrain.trainer.model.StageModel`), the same samples and micro-batches
(:func:`dynatrain.trainer.data.micro_batches`), the same AdamW
(:func:`dynatrain.trainer.optim.make_optimizer`, learning rate from the same schedule). Each
side learns the global loss every step with one scalar all-reduce, as DynaTrain's step does,
and the losses of steps 1 and 2 are compared between the sides (same weights and batch, then
one AdamW step each: they agree up to rounding, or the run exits 1). Steady state: both sides
take ``--warmup`` untimed steps, then alternate blocks of ``--block`` timed steps (default:
one) until each has ``--steps``, so machine noise lands on both; a step's time is the slowest
rank's; ``ratio`` is DynaTrain's median over the native median, ``paired`` the median of the
ratios of neighbouring blocks (less moved by other jobs coming and going). Only gpt-family
dense models (``gpt-tiny``, ``gpt-125m``). Prints a table or, with ``--json``, one JSON object:

    .venv/bin/python benchmarks/vs_native.py [--model gpt-tiny] [--steps 20] [--json]

Where DynaTrain is slower than its peer by more than ``TARGET`` (by either ratio), "where"
splits both steps: DynaTrain's waits on collectives and pipeline messages against its compute
(``StepResult.phases``), and the native side's forward+backward against its optimizer step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dynatrain.trainer.config import ConfigError, make_config  # noqa: E402
from dynatrain.trainer.data import micro_batches, token_source  # noqa: E402
from dynatrain.trainer.groups import build_groups  # noqa: E402
from dynatrain.trainer.launch import run_ranks  # noqa: E402
from dynatrain.trainer.optim import make_optimizer, set_lr  # noqa: E402
from dynatrain.trainer.trainer import Trainer  # noqa: E402
from dynatrain.trainer.weights import initial_tensor  # noqa: E402
from dynatrain.vps.layout import bind  # noqa: E402

PAIRS = {"dp=2": "DDP", "dp=2,zero=3": "FSDP2", "tp=2": "DTensor TP", "pp=2": "pipelining GPipe"}
"""DynaTrain layout -> the PyTorch-native peer it is timed against."""
TARGET = 1.05
"""The issue's target: DynaTrain's step at most 5% slower than the native peer's."""
LOSS_REL = 1e-5
"""Step 1's loss, both sides: same weights and batch, so only rounding differs (measured: at
most 2.3e-8 relative on gpt-tiny; bias-in-addmm vs bias-added-after and DTensor's reduction
order are the differences)."""
LOSS2_REL = 2e-6
"""Step 2's loss, after one AdamW step on each side: the gradients' math (the all-reduce over
ranks, the tied embedding's two uses) is in it too. Measured: at most 1.3e-7 relative (gpt-tiny,
seq 8 and 128, all four pairs); the native side with its gradient all-reduce left out differs
by 3.1e-3, with the tied embedding's gradients not summed between the pipeline stages by
5.0e-5. (Adam is scale-invariant, so a gradient off by a constant factor hardly shows.)"""


# -- the native model: StageModel's math over nn.Modules that torch's parallelisms understand --

class Block(nn.Module):
    """One GPT block, op for op as StageModel._attention and ._mlp (arch "gpt")."""

    def __init__(self, model, i: int, init):
        super().__init__()
        H, eps = model.hidden_size, model.norm_eps
        p = f"layers.{i}"
        self.head_dim = model.head_dim
        self.attn_norm = _layer_norm(H, eps, init, f"{p}.attn_norm")
        self.q = _linear(init, f"{p}.attn.q")
        self.k = _linear(init, f"{p}.attn.k")
        self.v = _linear(init, f"{p}.attn.v")
        self.o = _linear(init, f"{p}.attn.o")
        self.mlp_norm = _layer_norm(H, eps, init, f"{p}.mlp_norm")
        self.fc1 = _linear(init, f"{p}.mlp.fc1")
        self.fc2 = _linear(init, f"{p}.mlp.fc2")

    def forward(self, x):
        B, T, _ = x.shape
        h = self.attn_norm(x)
        # -1 heads: the rank's own under TP (ColwiseParallel hands back local shards).
        q, k, v = (lin(h).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, -1))
        a = F.gelu(self.fc1(self.mlp_norm(x)), approximate="tanh")
        return x + self.fc2(a)


def _linear(init, prefix: str) -> nn.Linear:
    w = init(f"{prefix}.weight")
    bias = init(f"{prefix}.bias", optional=True)
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def _layer_norm(H: int, eps: float, init, prefix: str) -> nn.LayerNorm:
    norm = nn.LayerNorm(H, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(init(f"{prefix}.weight"))
        norm.bias.copy_(init(f"{prefix}.bias"))
    return norm


class Embed(nn.Module):
    def __init__(self, model, init):
        super().__init__()
        self.tokens = nn.Embedding(model.vocab_size, model.hidden_size)
        with torch.no_grad():
            self.tokens.weight.copy_(init("embed.tokens"))
        self.positions = nn.Parameter(init("embed.positions"))

    def forward(self, tokens):
        return self.tokens(tokens) + self.positions[: tokens.shape[1]]


class Head(nn.Module):
    """Final norm and the head; ``weight`` is the embedding's (tied) or a copy of it on the
    last pipeline stage, whose gradient is then summed with the first stage's."""

    def __init__(self, model, init, weight: nn.Parameter | None = None):
        super().__init__()
        self.norm = _layer_norm(model.hidden_size, model.norm_eps, init, "final_norm")
        self.weight = weight if weight is not None else nn.Parameter(init("embed.tokens"))

    def forward(self, x):
        return F.linear(self.norm(x), self.weight).float()       # (B, T, V), fp32 softmax


class NativeGPT(nn.Module):
    """Layers ``layers`` of a gpt-family model; embedding on the first stage, head on the
    last (both, and all layers, without pipelining)."""

    def __init__(self, model, seed: int, layers: range, *, first: bool = True,
                 last: bool = True):
        super().__init__()
        specs = {t.name: t for t in model.tensors}

        def init(name, optional=False):
            if optional and name not in specs:
                return None
            return initial_tensor(model, specs[name], seed).float()

        self.embed = Embed(model, init) if first else None
        self.blocks = nn.ModuleList(Block(model, i, init) for i in layers)
        tied = self.embed.tokens.weight if (first and last) else None
        self.head = Head(model, init, tied) if last else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x

    def logical(self) -> dict[str, nn.Parameter]:
        """Every parameter by name; a (D)Tensor's global shape has the logical tensor's rank,
        which decides AdamW's weight decay (matrices decayed, norms and biases not)."""
        return dict(self.named_parameters())


def check_model(model) -> None:
    """The native module is written for gpt-family dense models (learned positions,
    LayerNorm, GELU MLP, tied head); refuse others before any process starts."""
    if model.arch != "gpt" or model.is_moe or not model.tie_embeddings:
        raise ConfigError(f"vs_native builds gpt-family dense models with a tied head only "
                          f"(gpt-tiny, gpt-125m); {model.name} is arch={model.arch!r}, "
                          f"moe={model.is_moe}, tie_embeddings={model.tie_embeddings}")


class _Shapes:
    """make_optimizer's view of a parameter: its logical shape's rank decides weight decay."""

    def __init__(self, shape):
        self.shape = tuple(shape)


def native_optimizer(params: dict[str, torch.Tensor], cfg) -> torch.optim.AdamW:
    return make_optimizer(params, {n: _Shapes(p.shape) for n, p in params.items()}, cfg)


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# -- the native sides: build once, then step() -> (seconds, loss, forward_backward_seconds) -----

class NativeSide:
    def __init__(self, kind: str, cfg, rank: int, world: int):
        self.kind, self.cfg, self.rank, self.world = kind, cfg, rank, world
        self.source = token_source(cfg)
        self.step_index = 0
        m = cfg.model
        check_model(m)
        if kind == "DDP":
            from torch.nn.parallel import DistributedDataParallel

            self.net = NativeGPT(m, cfg.seed, range(m.num_layers))
            self.opts = [native_optimizer(self.net.logical(), cfg)]
            self.model = DistributedDataParallel(self.net)
        elif kind == "FSDP2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            self.net = NativeGPT(m, cfg.seed, range(m.num_layers))
            for block in self.net.blocks:
                fully_shard(block, mesh=mesh)
            self.model = fully_shard(self.net, mesh=mesh)
            self.opts = [native_optimizer(self.net.logical(), cfg)]
        elif kind == "DTensor TP":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                           parallelize_module)

            self.mesh = init_device_mesh("cpu", (world,))
            self.net = NativeGPT(m, cfg.seed, range(m.num_layers))
            plan = {"embed.tokens": RowwiseParallel(input_layouts=Replicate(),
                                                    output_layouts=Replicate())}
            for i in range(len(self.net.blocks)):
                for name in ("q", "k", "v", "fc1"):
                    plan[f"blocks.{i}.{name}"] = ColwiseParallel()
                for name in ("o", "fc2"):
                    plan[f"blocks.{i}.{name}"] = RowwiseParallel()
            parallelize_module(self.net, self.mesh, plan)
            self.model = self.net
            self._tp_head()
            # foreach AdamW refuses a list that mixes DTensors (the sharded weights) and plain
            # tensors (norms, positions, replicated as in DynaTrain's TP): one AdamW each.
            from torch.distributed.tensor import DTensor

            params = self.net.logical()
            self.opts = [native_optimizer({n: p for n, p in params.items()
                                           if isinstance(p, DTensor) == sharded}, cfg)
                         for sharded in (True, False)]
        elif kind == "pipelining GPipe":
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            bound = bind(cfg.layout, m)
            first, last = rank == 0, rank == world - 1
            self.net = NativeGPT(m, cfg.seed, bound.stage_layers(rank), first=first, last=last)
            self.stage = PipelineStage(self.net, rank, world, torch.device("cpu"))
            n_micro = cfg.global_batch_size // cfg.micro_batch_size
            self.schedule = ScheduleGPipe(self.stage, n_micro, loss_fn=cross_entropy)
            self.opts = [native_optimizer(self.net.logical(), cfg)]
        else:
            raise ValueError(f"native side {kind!r} is not one of {sorted(PAIRS.values())}")

    def _tp_head(self):
        """The tied head over the vocabulary-sharded embedding: logits stay sharded by
        vocabulary (Shard(-1)) and the loss is computed under ``loss_parallel``, so no rank
        builds the whole vocabulary's logits (what DynaTrain's vocab-parallel loss does)."""
        from torch.distributed.tensor import DTensor, Replicate

        head, mesh = self.net.head, self.mesh

        def forward(x):
            h = DTensor.from_local(head.norm(x), mesh, [Replicate()])
            return F.linear(h, self.net.embed.tokens.weight).float()
        head.forward = forward

    def _batches(self, dp: int, dp_index: int):
        cfg = self.cfg
        return micro_batches(self.source, self.step_index * cfg.global_batch_size,
                             cfg.global_batch_size, dp, dp_index, cfg.micro_batch_size)

    def step(self) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        cfg = self.cfg
        for opt in self.opts:
            set_lr(opt, cfg.lr_at(self.step_index))
            opt.zero_grad(set_to_none=True)
        loss = torch.zeros((), dtype=torch.float64)
        if self.kind in ("DDP", "FSDP2"):
            batches = self._batches(self.world, self.rank)
            for i, (inputs, targets) in enumerate(batches):
                last = i == len(batches) - 1
                if self.kind == "DDP":
                    ctx = nullcontext() if last else self.model.no_sync()
                else:
                    self.model.set_requires_gradient_sync(last)
                    ctx = nullcontext()
                with ctx:
                    out = cross_entropy(self.model(inputs), targets)
                    (out / len(batches)).backward()      # DP averages over ranks itself
                loss += out.detach().double() / (len(batches) * self.world)
        elif self.kind == "DTensor TP":
            from torch.distributed.tensor.parallel import loss_parallel

            batches = self._batches(1, 0)
            for inputs, targets in batches:
                with loss_parallel():
                    out = cross_entropy(self.model(inputs), targets)
                    (out / len(batches)).backward()
                loss += out.detach().full_tensor().double() / (len(batches) * self.world)
        else:
            batches = self._batches(1, 0)
            inputs = torch.cat([b[0] for b in batches])
            targets = torch.cat([b[1] for b in batches])
            # return_outputs=False: the last stage need not concatenate the logits of every
            # micro-batch (torchtitan's training loop asks for the losses only, too).
            if self.rank == 0:
                self.schedule.step(inputs, return_outputs=False)
            else:
                losses = []
                self.schedule.step(target=targets, losses=losses, return_outputs=False)
                loss += torch.stack(losses).detach().double().mean()
            # The tied embedding: first and last stage hold a copy each; sum their gradients.
            tied = (self.net.embed.tokens.weight if self.rank == 0 else self.net.head.weight)
            dist.all_reduce(tied.grad)
        backward_done = time.perf_counter()
        for opt in self.opts:
            opt.step()
        dist.all_reduce(loss)                                     # every rank learns the loss
        self.step_index += 1
        end = time.perf_counter()
        return end - t0, float(loss), backward_done - t0


# -- one rank: both sides in the same process, alternating ------------------------------------

def _rank(rank, device, results, cfg, native: str, warmup: int, steps: int, block: int):
    try:
        _sides(rank, device, results, cfg, native, warmup, steps, block)
    except BaseException:
        # run_ranks reports only the exit code; the reason goes to stderr, then it propagates.
        traceback.print_exc()
        raise


def _sides(rank, device, results, cfg, native: str, warmup: int, steps: int, block: int):
    world = cfg.layout.world
    trainer = Trainer(cfg, build_groups(bind(cfg.layout, cfg.model), rank), device=device)
    peer = NativeSide(native, cfg, rank, world)
    out = {"rank": rank, "dynatrain": [], "native": [], "phases": [], "native_fb": [],
           "dynatrain_losses": [], "native_losses": [], "threads": torch.get_num_threads()}

    def dyn_step(record: bool):
        t0 = time.perf_counter()
        r = trainer.train_step()
        sec = time.perf_counter() - t0
        out["dynatrain_losses"].append(r.loss)
        if record:
            out["dynatrain"].append(sec)
            out["phases"].append(r.phases)

    def native_step(record: bool):
        sec, loss, fb = peer.step()
        out["native_losses"].append(loss)
        if record:
            out["native"].append(sec)
            out["native_fb"].append(fb)

    for _ in range(warmup):
        dyn_step(False)
        native_step(False)
    while len(out["dynatrain"]) < steps:
        n = min(block, steps - len(out["dynatrain"]))
        for _ in range(n):
            dyn_step(True)
        for _ in range(n):
            native_step(True)
    results.put(("rank", out))


def run_pair(layout: str, cfg, native: str, *, warmup: int, steps: int, block: int,
             timeout_s: float = 600) -> dict:
    """Both sides of one layout in one set of rank processes; the row's figures."""
    reports = []
    world = cfg.layout.world
    run_ranks(_rank, (cfg, native, warmup, steps, block), world=world, backend="gloo",
              messages=world, on_message=lambda kind, payload: reports.append(payload),
              what=f"vs_native {cfg.layout.to_text()} / {native}", timeout_s=timeout_s)
    reports.sort(key=lambda r: r["rank"])

    def slowest(key):                     # a step ends when its slowest rank is done
        return [max(r[key][i] for r in reports) for i in range(steps)]

    dyn_steps, nat_steps = slowest("dynatrain"), slowest("native")
    dyn, nat = statistics.median(dyn_steps), statistics.median(nat_steps)
    # Each DynaTrain block beside the native block that follows it: the ratio of neighbours
    # cancels the machine's slow drifts (other jobs come and go), the median its spikes.
    paired = statistics.median(d / n for d, n in zip(dyn_steps, nat_steps))
    phases = {k: statistics.median(p[k] for r in reports for p in r["phases"])
              for k in ("compute", "communication")}
    fb = statistics.median(slowest("native_fb"))
    # The k-th step of either side trains on the same samples: step 1 from the same weights
    # (the forward's math), step 2 after one AdamW step on each (the gradients' math too).
    (d1, d2), (n1, n2) = reports[0]["dynatrain_losses"][:2], reports[0]["native_losses"][:2]
    return {"layout": layout, "native": native,
            "dynatrain_ms": 1e3 * dyn, "native_ms": 1e3 * nat, "ratio": dyn / nat,
            "paired_ratio": paired,
            "dynatrain_compute_ms": 1e3 * phases["compute"],
            "dynatrain_communication_ms": 1e3 * phases["communication"],
            "native_forward_backward_ms": 1e3 * fb,
            "native_optimizer_and_loss_ms": 1e3 * (nat - fb),
            "loss_step1_dynatrain": d1, "loss_step1_native": n1,
            "loss_step1_rel_diff": abs(d1 - n1) / abs(n1),
            "loss_step2_rel_diff": abs(d2 - n2) / abs(n2),
            "threads_per_rank": reports[0]["threads"], "world": world}


def bench(*, model: str = "gpt-tiny", layouts=tuple(PAIRS), seq_len: int = 128,
          global_batch: int = 8, micro_batch: int = 1, warmup: int = 3, steps: int = 20,
          block: int = 1) -> dict:
    rows = []
    for layout in layouts:
        if layout not in PAIRS:
            raise ConfigError(f"layout {layout!r} has no native peer here; one of {list(PAIRS)}")
        cfg = make_config(model, layout, seq_len=seq_len, global_batch_size=global_batch,
                          micro_batch_size=micro_batch)
        check_model(cfg.model)
        rows.append(run_pair(layout, cfg, PAIRS[layout], warmup=warmup, steps=steps,
                             block=block))
    return {"model": model, "seq_len": seq_len, "global_batch": global_batch,
            "micro_batch": micro_batch, "warmup": warmup, "steps": steps,
            "torch": torch.__version__, "rows": rows}


def where(row: dict) -> str:
    if max(row["ratio"], row["paired_ratio"]) <= TARGET:
        return ""
    return (f"dynatrain: compute {row['dynatrain_compute_ms']:.1f} + waits "
            f"{row['dynatrain_communication_ms']:.1f} ms; native: fwd+bwd "
            f"{row['native_forward_backward_ms']:.1f} + optimizer/loss "
            f"{row['native_optimizer_and_loss_ms']:.1f} ms")


def table(out: dict) -> str:
    lines = [f"{out['model']}, seq {out['seq_len']}, global batch {out['global_batch']}, "
             f"micro-batch {out['micro_batch']}, median of {out['steps']} steps after "
             f"{out['warmup']} warm-up, torch {out['torch']}, "
             f"{out['rows'][0]['world'] if out['rows'] else '?'} ranks of "
             f"{out['rows'][0]['threads_per_rank'] if out['rows'] else '?'} thread(s)",
             f"{'layout':<14}{'native peer':<18}{'dynatrain ms':>13}{'native ms':>11}"
             f"{'ratio':>8}{'paired':>8}  {'loss rel diff @1':>16}{'@2':>9}  "
             f"where (a ratio > {TARGET})"]
    for r in out["rows"]:
        lines.append(f"{r['layout']:<14}{r['native']:<18}{r['dynatrain_ms']:>13.1f}"
                     f"{r['native_ms']:>11.1f}{r['ratio']:>7.3f}x{r['paired_ratio']:>7.3f}x  "
                     f"{r['loss_step1_rel_diff']:>16.1e}{r['loss_step2_rel_diff']:>9.1e}  "
                     f"{where(r)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--layouts", default=";".join(PAIRS),
                        help=f"';'-separated, from {list(PAIRS)}")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side")
    parser.add_argument("--block", type=int, default=1, help="steps per alternating block")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.block < 1 or args.warmup + args.steps < 2:
        parser.error(f"--steps={args.steps} and --block={args.block} must be positive, and "
                     f"--warmup + --steps = {args.warmup + args.steps} at least 2 (steps 1 "
                     "and 2's losses are compared)")
    out = bench(model=args.model, layouts=tuple(args.layouts.split(";")), seq_len=args.seq_len,
                global_batch=args.global_batch_size, micro_batch=args.micro_batch_size,
                warmup=args.warmup, steps=args.steps, block=args.block)
    print(json.dumps(out) if args.json else table(out))
    bad = [r["layout"] for r in out["rows"] if r["loss_step1_rel_diff"] > LOSS_REL
           or r["loss_step2_rel_diff"] > LOSS2_REL]
    if bad:
        print(f"the sides do not compute the same thing: step 1's loss differs by more than "
              f"{LOSS_REL} or step 2's by more than {LOSS2_REL} (relative) in {bad}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
