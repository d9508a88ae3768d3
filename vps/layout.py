"""Layouts: how a job's ranks are arranged (dp, tp, pp, ep, ZeRO) and which device each uses.

A :class:`Layout` is a value: parallel degrees, ZeRO stage, pipeline stage sizes, the rank order
(which axis varies fastest) and the rank → device list. It has a text form for the CLI
(``dp=4,tp=2,pp=2,ep=2,zero=1,stages=12+10+10``; anything not given is 1, zero is 0) and is
checked against a model by :func:`validate`, which reports every problem at once, each naming
the value and what would be valid.

The pipeline schedule (``schedule=gpipe`` or ``schedule=1f1b``) is part of the layout although
it places no shard differently: it is how the layout *runs* (1F1B keeps at most ``pp - stage``
micro-batches' activations alive, GPipe all of them), so the solver weighs it with the other
axes and a change of schedule is an ordinary switch, at a step boundary, that moves no bytes.

Data-parallel shares (``shares=5+5+4+2``: micro-batches per data-parallel rank) are also
part of how a layout runs and place no shard: by default the global batch is split evenly,
and a device measured slower can be given fewer micro-batches. The step is the same whatever
the shares: every rank scales its micro-batches' losses by 1 / (micro-batches of the whole
step), so the summed gradient is the global mean, and the DP ranks still take contiguous runs
of the global batch in order (:func:`micro_batch_shares`). Shares need ``ep=1``: an MoE
layer's token exchange pairs the EP ranks' micro-batches one to one.

Rank coordinates follow Megatron's default order ``tp-dp-pp`` (tp fastest, pp slowest), so a
TP group is a run of consecutive ranks and, with 8 devices a node, stays inside one node.
Expert parallelism is carved out of data parallelism: the dp index ``j`` splits into
``ep_rank = j % ep`` and the expert-data-parallel index ``j // ep``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from itertools import permutations

from .boxes import even_split
from .model import FIRST, LAST, ModelSpec

AXES = ("tp", "dp", "pp")
ZERO_STAGES = (0, 1, 3)
DEFAULT_ORDER = ("tp", "dp", "pp")
SCHEDULES = ("gpipe", "1f1b")
"""Pipeline schedules: every forward then every backward (GPipe), or one forward one backward
once the pipeline is full (1F1B, PipeDream-Flush). Both run the backward passes in micro-batch
order, so they accumulate gradients in the same order and train bit-identically."""
_KEYS = ("dp", "tp", "pp", "ep", "zero", "stages", "shares", "order", "schedule")


class LayoutError(ValueError):
    """A layout is malformed or does not fit the model / devices; the message names the value."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A parallelism layout of one job."""

    dp: int = 1
    """Data-parallel degree (EP ranks are carved out of it)."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (number of stages)."""
    ep: int = 1
    """Expert-parallel degree; must divide dp and the expert count."""
    zero: int = 0
    """ZeRO stage: 0 (nothing sharded), 1 (master + moments sharded over DP), 3 (params too)."""
    stages: tuple[int, ...] | None = None
    """Layers per pipeline stage; None means as even as possible, first stages take the rest."""
    shares: tuple[int, ...] | None = None
    """Micro-batches per data-parallel rank; None means the global batch split evenly (equal
    shares are stored as None)."""
    order: tuple[str, ...] = DEFAULT_ORDER
    """Rank order, fastest-varying axis first."""
    devices: tuple[int, ...] | None = None
    """Device of each rank; None means devices 0..world-1."""
    schedule: str = "gpipe"
    """Pipeline schedule, one of :data:`SCHEDULES`; it changes no shard, only activation
    memory (also with pp = 1, where 1F1B is plain gradient accumulation)."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("dp", "tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name}={value!r} must be a positive integer")
        if self.zero not in ZERO_STAGES:
            problems.append(f"zero={self.zero!r} is not a ZeRO stage; valid: 0, 1, 3")
        if sorted(self.order) != sorted(AXES):
            problems.append(f"order={'-'.join(self.order)!r} must be a permutation of "
                            f"tp, dp, pp (e.g. {'-'.join(DEFAULT_ORDER)})")
        if self.schedule not in SCHEDULES:
            problems.append(f"schedule={self.schedule!r} is not a pipeline schedule; valid: "
                            f"{', '.join(SCHEDULES)}")
        if self.shares is not None:
            shares = tuple(self.shares)
            text = "+".join(map(str, shares))
            if len(shares) != self.dp:
                problems.append(f"shares={text} lists {len(shares)} data-parallel ranks but "
                                f"dp={self.dp}")
            if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in shares):
                problems.append(f"shares={text}: every data-parallel rank needs >= 1 "
                                "micro-batch")
            if self.ep != 1:
                problems.append(f"shares={text} needs ep=1 (an MoE layer's token exchange "
                                f"pairs the EP ranks' micro-batches one to one), not ep={self.ep}")
            # Equal shares are the even split: one value, one text.
            object.__setattr__(self, "shares", shares if len(set(shares)) > 1 else None)
        if problems:
            raise LayoutError("; ".join(problems))
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(self.devices))
        if self.stages is not None:
            object.__setattr__(self, "stages", tuple(self.stages))

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: replicas of each expert."""
        return self.dp // self.ep

    @cached_property
    def device_of(self) -> tuple[int, ...]:
        """Device of each rank (rank → device)."""
        return self.devices if self.devices is not None else tuple(range(self.world))

    @cached_property
    def _strides(self) -> dict[str, int]:
        sizes = {"tp": self.tp, "dp": self.dp, "pp": self.pp}
        strides, s = {}, 1
        for axis in self.order:
            strides[axis] = s
            s *= sizes[axis]
        return strides

    def rank(self, pp: int, dp: int, tp: int) -> int:
        """The rank at pipeline stage ``pp``, data-parallel index ``dp``, TP index ``tp``."""
        st = self._strides
        return pp * st["pp"] + dp * st["dp"] + tp * st["tp"]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) of ``rank``."""
        st = self._strides
        return ((rank // st["pp"]) % self.pp, (rank // st["dp"]) % self.dp,
                (rank // st["tp"]) % self.tp)

    def with_devices(self, devices) -> "Layout":
        return replace(self, devices=tuple(devices))

    def same_shape(self, other: "Layout | None") -> bool:
        """The same layout, whatever devices each runs on: what a request, a running layout
        and a switch's target are compared by (a layout's equality also compares devices).
        Two layouts are the same shape exactly when their canonical texts are equal."""
        return other is not None and self.to_text() == other.to_text()

    def to_text(self) -> str:
        """Canonical text form; parse(to_text()) gives an equal layout (devices aside)."""
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        if self.ep != 1:
            parts.append(f"ep={self.ep}")
        if self.zero:
            parts.append(f"zero={self.zero}")
        if self.stages is not None and self.pp > 1:
            parts.append("stages=" + "+".join(map(str, self.stages)))
        if self.shares is not None:
            parts.append("shares=" + "+".join(map(str, self.shares)))
        if self.order != DEFAULT_ORDER:
            parts.append("order=" + "-".join(self.order))
        if self.schedule != "gpipe":
            parts.append(f"schedule={self.schedule}")
        return ",".join(parts)

    def __str__(self) -> str:
        return self.to_text()


def parse_layout(text: str) -> Layout:
    """Parse ``dp=4,tp=2,pp=2,ep=2,zero=1,stages=12+10+10,order=tp-dp-pp,schedule=1f1b``."""
    if not isinstance(text, str) or not text.strip():
        raise LayoutError(f"layout {text!r} is empty; expected e.g. 'dp=4,tp=2,pp=2,zero=1'")
    values: dict = {}
    problems = []
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        key, sep, raw = item.partition("=")
        key = key.lower()
        if not sep or not raw:
            problems.append(f"{item!r} is not key=value")
            continue
        if key not in _KEYS:
            problems.append(f"unknown key {key!r}; valid keys: {', '.join(_KEYS)}")
            continue
        if key in values:
            problems.append(f"{key} is given twice")
            continue
        try:
            if key in ("stages", "shares"):
                values[key] = tuple(int(x) for x in raw.split("+"))
            elif key == "order":
                values[key] = tuple(raw.split("-"))
            elif key == "schedule":
                values[key] = raw.lower()
            else:
                values[key] = int(raw)
        except ValueError:
            hint = {"stages": "layer counts joined by '+', e.g. 12+10+10",
                    "shares": "micro-batch counts joined by '+', e.g. 5+5+4+2"
                    }.get(key, "an integer")
            problems.append(f"{key}={raw!r} is not {hint}")
    if problems:
        raise LayoutError(f"layout {text!r}: " + "; ".join(problems))
    try:
        return Layout(**values)
    except LayoutError as e:
        raise LayoutError(f"layout {text!r}: {e}") from None


def micro_batch_shares(layout: Layout, global_batch: int, micro_batch: int) -> tuple[int, ...]:
    """Micro-batches of each data-parallel rank in one step (rank ``j`` takes the run of the
    global batch after ranks ``0..j-1``'s). Raises LayoutError, naming the values, when the
    layout's shares do not sum to the step's micro-batches or the batch does not split evenly."""
    total, rest = divmod(global_batch, micro_batch)
    if rest or total < 1:
        raise LayoutError(f"global_batch_size={global_batch} must be a positive multiple of "
                          f"micro_batch_size={micro_batch}")
    if layout.shares is None:
        if total % layout.dp:
            raise LayoutError(f"global_batch_size={global_batch} must be a multiple of dp * "
                              f"micro_batch_size = {layout.dp} * {micro_batch} (or give "
                              "uneven shares=..., one micro-batch count per data-parallel "
                              "rank)")
        return (total // layout.dp,) * layout.dp
    if sum(layout.shares) != total:
        raise LayoutError(f"shares={'+'.join(map(str, layout.shares))} sum to "
                          f"{sum(layout.shares)} micro-batches, but a step has "
                          f"global_batch_size / micro_batch_size = {global_batch} / "
                          f"{micro_batch} = {total}")
    return layout.shares


def default_stages(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage, as even as possible; the first stages take the remainder."""
    return tuple(b - a for a, b in (even_split(num_layers, pp, s) for s in range(pp)))


def layout_problems(layout: Layout, model: ModelSpec, num_devices: int | None = None) -> list[str]:
    """Every reason ``layout`` cannot run ``model`` (empty if it can)."""
    p = []
    m, tp, ep = model, layout.tp, layout.ep
    if m.num_heads % tp:
        p.append(f"tp={tp} must divide the attention heads ({m.num_heads}) of {m.name}")
    if m.num_kv_heads != m.num_heads and m.num_kv_heads % tp and tp % m.num_kv_heads:
        p.append(f"tp={tp} must divide the kv heads ({m.num_kv_heads}) of {m.name} or be a "
                 f"multiple of them (kv heads are then replicated)")
    ffn = m.moe_ffn_hidden_size if m.is_moe else m.ffn_hidden_size
    if ffn % tp:
        p.append(f"tp={tp} must divide the FFN width ({ffn}) of {m.name}")
    # The vocabulary is split by rows, unevenly where tp does not divide it (a real checkpoint's
    # 32,001 or 151,665 tokens); every rank needs at least one row.
    if m.vocab_size < tp:
        p.append(f"tp={tp} exceeds the vocabulary ({m.vocab_size} rows) of {m.name}")
    if ep > 1 and not m.is_moe:
        p.append(f"ep={ep} needs an MoE model; {m.name} is dense (use ep=1)")
    elif m.is_moe and m.num_experts % ep:
        p.append(f"ep={ep} must divide the expert count ({m.num_experts}) of {m.name}")
    if layout.dp % ep:
        p.append(f"ep={ep} must divide dp={layout.dp} (EP ranks are carved out of DP)")
    if layout.pp > m.num_layers:
        p.append(f"pp={layout.pp} exceeds the {m.num_layers} layers of {m.name}")
    if layout.stages is not None:
        if len(layout.stages) != layout.pp:
            p.append(f"stages={'+'.join(map(str, layout.stages))} lists {len(layout.stages)} "
                     f"stages but pp={layout.pp}")
        if any(s < 1 for s in layout.stages):
            p.append(f"stages={'+'.join(map(str, layout.stages))}: every stage needs >= 1 layer")
        if sum(layout.stages) != m.num_layers:
            p.append(f"stages={'+'.join(map(str, layout.stages))} sum to "
                     f"{sum(layout.stages)}, but {m.name} has {m.num_layers} layers")
    world = layout.world
    if layout.devices is not None:
        devs = layout.devices
        if len(devs) != world:
            p.append(f"dp*tp*pp = {layout.dp}*{layout.tp}*{layout.pp} = {world} ranks but "
                     f"{len(devs)} devices are given")
        if len(set(devs)) != len(devs):
            p.append("the device list names a device twice")
        if any((not isinstance(d, int)) or d < 0 for d in devs):
            p.append("device ids must be non-negative integers")
    elif num_devices is not None and world != num_devices:
        p.append(f"dp*tp*pp = {layout.dp}*{layout.tp}*{layout.pp} = {world} must equal the "
                 f"number of devices ({num_devices})")
    return p


def bind(layout: Layout, model: ModelSpec, num_devices: int | None = None) -> "BoundLayout":
    """Check ``layout`` against ``model`` and resolve its stages and devices.

    Raises LayoutError listing every problem, so a user fixes them all in one go.
    """
    problems = layout_problems(layout, model, num_devices)
    if problems:
        raise LayoutError(f"layout {layout.to_text()!r} does not fit {model.name}: "
                          + "; ".join(problems))
    stages = layout.stages or default_stages(model.num_layers, layout.pp)
    return BoundLayout(replace(layout, stages=stages), model)


class BoundLayout:
    """A layout validated against one model: stage of every layer, ranks of every stage."""

    def __init__(self, layout: Layout, model: ModelSpec):
        self.layout = layout
        self.model = model
        stage_of_layer = []
        for s, n in enumerate(layout.stages):
            stage_of_layer.extend([s] * n)
        self.stage_of_layer = tuple(stage_of_layer)
        self.rank_of_device = {d: r for r, d in enumerate(layout.device_of)}
        # stage_devices[s][j * tp + t] = device of rank (s, j, t): the planner's hot lookup.
        self.stage_devices = tuple(
            tuple(layout.device_of[layout.rank(s, j, t)]
                  for j in range(layout.dp) for t in range(layout.tp))
            for s in range(layout.pp))

    def __getattr__(self, name):  # dp, tp, rank(), device_of, ... come from the layout
        return getattr(self.layout, name)

    def stages_of(self, layer: int, tied_to_last: bool = False) -> tuple[int, ...]:
        """Pipeline stages that hold a tensor of ``layer`` (two for a tied embedding)."""
        if layer == FIRST:
            first = 0
        elif layer == LAST:
            first = self.layout.pp - 1
        else:
            first = self.stage_of_layer[layer]
        if tied_to_last and self.layout.pp - 1 != first:
            return (first, self.layout.pp - 1)
        return (first,)

    def stage_layers(self, stage: int) -> range:
        start = sum(self.layout.stages[:stage])
        return range(start, start + self.layout.stages[stage])


def all_orders() -> list[tuple[str, ...]]:
    """Every valid rank order (for property tests)."""
    return list(permutations(AXES))
