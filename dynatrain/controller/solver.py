"""The layout solver: which layout trains fastest on the devices at hand, within their memory.

The controller asks this module *what is the best layout for n devices?* (:func:`solve`,
:func:`best_for_devices`). It lists every valid layout of the devices whose data-parallel
degree divides the batch (:func:`candidate_layouts`), prices each with
:func:`dynatrain.controller.costmodel.estimate` on a
:class:`~dynatrain.spec.hardware.DeviceProfile`, and ranks the ones that fit in memory
(throughput, then deterministic tie-breaks). When nothing fits it raises
:class:`~dynatrain.controller.costmodel.SolverError` naming why.

The pipeline schedule is part of a layout. Each candidate is priced with GPipe and, where
GPipe's activations do not fit, with 1F1B, which holds at most ``pp - stage`` micro-batches
instead of all of them: the reference trainer runs both in the same time (the same fill and
drain, no overlap of messages with compute in either), so 1F1B is chosen for the memory it
saves, and a job whose GPipe layout fits is not switched for nothing. Activation checkpointing
is the job's choice (``spec.training.activationCheckpointing``), not the solver's: it trades
a forward pass for memory, which the estimates of every candidate then include.
"""

from __future__ import annotations

from dataclasses import replace

from dynatrain.vps.layout import Layout, layout_problems
from dynatrain.vps.model import ModelSpec

from .costmodel import Estimate, SolverError, check_batch, estimate, format_gib
from dynatrain.spec.hardware import DeviceProfile


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _raw_layouts(model: ModelSpec, num_devices: int, zero_stages, max_tp: int | None):
    """Valid layouts of ``num_devices`` ignoring the batch; ZeRO > 0 only where dp > 1 (with
    one data-parallel rank ZeRO shards nothing and only costs)."""
    zero_stages = tuple(dict.fromkeys(zero_stages))
    if not zero_stages or any(z not in (0, 1, 3) for z in zero_stages):
        raise SolverError(f"zero_stages={zero_stages!r} must list ZeRO stages from 0, 1, 3")
    for tp in _divisors(num_devices):
        if max_tp is not None and tp > max_tp:
            continue
        for pp in _divisors(num_devices // tp):
            dp = num_devices // (tp * pp)
            eps = ([e for e in _divisors(dp) if model.num_experts % e == 0] if model.is_moe
                   else [1])
            for ep in eps:
                zeros = zero_stages if dp > 1 else (min(zero_stages),)
                for zero in zeros:
                    layout = Layout(dp=dp, tp=tp, pp=pp, ep=ep, zero=zero)
                    if not layout_problems(layout, model, num_devices):
                        yield layout


def candidate_layouts(model: ModelSpec, num_devices: int, *, global_batch_size: int,
                      micro_batch_size: int = 1, zero_stages=(0, 1, 3),
                      max_tp: int | None = None) -> list[Layout]:
    """Every layout (dp, tp, pp, ep, zero; default stages and order) of exactly
    ``num_devices`` ranks that can run ``model`` and whose dp * micro_batch_size divides the
    global batch. EP only for MoE models (dividing dp and the expert count); tp at most
    ``max_tp`` (the controller passes devices_per_node: TP across nodes never pays). ZeRO
    stages other than the smallest given are left out when dp = 1. Deterministic order:
    tp, then pp, then ep, then zero ascending."""
    if num_devices < 1:
        return []
    return [lay for lay in _raw_layouts(model, num_devices, zero_stages, max_tp)
            if global_batch_size % (lay.dp * micro_batch_size) == 0]


def _rank_key(e: Estimate):
    """Best first: throughput (to 9 significant digits, so float noise cannot outvote the
    tie-breaks), then less memory, fewer tp, fewer pp, fewer ep, lower ZeRO stage, text."""
    lay = e.layout
    return (-float(f"{e.tokens_per_second:.9g}"), e.memory_bytes, lay.tp, lay.pp, lay.ep,
            lay.zero, lay.to_text())


def _no_candidates(model, num_devices, global_batch_size, micro_batch_size, zero_stages,
                   max_tp) -> str:
    raw = list(_raw_layouts(model, num_devices, zero_stages, max_tp))
    if raw:
        dps = sorted({lay.dp for lay in raw})
        return (f"global_batch_size={global_batch_size} is not a multiple of dp * "
                f"micro_batch_size for any layout of {model.name} on {num_devices} devices: "
                f"valid dp values are {', '.join(map(str, dps))} with micro_batch_size="
                f"{micro_batch_size}; choose a global batch divisible by "
                f"{min(dps) * micro_batch_size} (or use a different number of devices)")
    tp_note = f" with tp <= {max_tp}" if max_tp is not None else ""
    return (f"no layout of {num_devices} devices{tp_note} passes validation for {model.name}: "
            + "; ".join(layout_problems(Layout(dp=1, tp=num_devices), model, num_devices)))


def _too_big(model, num_devices, ests: list[Estimate], checkpointing: bool) -> str:
    small = min(ests, key=lambda e: (e.memory_bytes, _rank_key(e)))
    mb = small.memory_breakdown
    hint = "" if checkpointing else ", activation checkpointing (spec.training." \
        "activationCheckpointing)"
    return (f"no layout of {model.name} on {num_devices} devices fits in memory: the "
            f"smallest need is {format_gib(small.memory_bytes)} per device "
            f"({small.layout.to_text()}: state {format_gib(mb['state'])}, grads "
            f"{format_gib(mb['grads'])}, activations {format_gib(mb['activations'])}), available "
            f"{format_gib(small.available_bytes)}; use more devices{hint}, a smaller micro "
            "batch or global batch, or a shorter sequence")


def _scheduled(model: ModelSpec, layout: Layout, profile: DeviceProfile, kw: dict) -> Estimate:
    """The estimate of ``layout`` under GPipe, or under 1F1B where GPipe does not fit and
    1F1B needs less (see the module docstring)."""
    est = estimate(model, layout, profile, **kw)
    if est.fits or layout.schedule != "gpipe":
        return est
    alt = estimate(model, replace(layout, schedule="1f1b"), profile, **kw)
    return alt if alt.memory_bytes < est.memory_bytes else est


def solve(model: ModelSpec, num_devices: int, profile: DeviceProfile, *,
          global_batch_size: int, micro_batch_size: int = 1, seq_len: int,
          fixed: Layout | None = None, zero_stages=(0, 1, 3),
          allow=None, activation_checkpointing: bool = False) -> Estimate:
    """The fastest layout of exactly ``num_devices`` devices that fits in memory, with its
    pipeline schedule (see the module docstring).

    With ``fixed``, only that layout is validated (against the model, the device count and
    the batch) and estimated, under its own schedule. ``allow(layout)`` narrows the
    candidates (a job's ``spec.parallelism.limits``). ``activation_checkpointing`` is the
    job's setting, priced into every estimate. Raises SolverError naming why when nothing
    fits.
    """
    check_batch(model, global_batch_size, micro_batch_size, seq_len)
    kw = dict(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
              seq_len=seq_len, activation_checkpointing=activation_checkpointing)
    if fixed is not None:
        problems = layout_problems(fixed, model, None if fixed.devices else num_devices)
        if fixed.devices is not None and fixed.world != num_devices:
            problems.append(f"it has {fixed.world} ranks but {num_devices} devices are given")
        if problems:
            raise SolverError(f"layout {fixed.to_text()!r} cannot run {model.name} on "
                              f"{num_devices} devices: " + "; ".join(problems))
        est = estimate(model, fixed, profile, **kw)
        if not est.fits:
            mb = est.memory_breakdown
            raise SolverError(
                f"layout {fixed.to_text()!r} of {model.name} needs {format_gib(est.memory_bytes)} "
                f"per device (state {format_gib(mb['state'])}, grads {format_gib(mb['grads'])}, "
                f"activations {format_gib(mb['activations'])}), available "
                f"{format_gib(est.available_bytes)}")
        return est
    if not isinstance(num_devices, int) or num_devices < 1:
        raise SolverError(f"num_devices={num_devices!r} must be a positive integer")
    max_tp = profile.devices_per_node
    layouts = candidate_layouts(model, num_devices, zero_stages=zero_stages, max_tp=max_tp,
                                global_batch_size=global_batch_size,
                                micro_batch_size=micro_batch_size)
    if not layouts:
        raise SolverError(_no_candidates(model, num_devices, global_batch_size,
                                         micro_batch_size, zero_stages, max_tp))
    if allow is not None:
        allowed = [lay for lay in layouts if allow(lay)]
        if not allowed:
            raise SolverError(f"none of the {len(layouts)} layouts of {num_devices} devices "
                              f"is within spec.parallelism.limits (e.g. "
                              f"{layouts[0].to_text()!r} is not)")
        layouts = allowed
    ests = [_scheduled(model, lay, profile, kw) for lay in layouts]
    fitting = [e for e in ests if e.fits]
    if not fitting:
        raise SolverError(_too_big(model, num_devices, ests, activation_checkpointing))
    return min(fitting, key=_rank_key)


def best_for_devices(model: ModelSpec, max_devices: int, profile: DeviceProfile, *,
                     global_batch_size: int, micro_batch_size: int = 1, seq_len: int,
                     min_devices: int = 1, zero_stages=(0, 1, 3),
                     activation_checkpointing: bool = False) -> Estimate:
    """The fastest fitting layout over every device count in ``min_devices..max_devices``
    (the controller may leave devices idle, e.g. when 5 does not divide the batch). Equal
    throughput: the fewer devices win."""
    if max_devices < max(1, min_devices):
        raise SolverError(f"max_devices={max_devices} is below min_devices={min_devices}")
    best, errors = None, []
    for n in range(max(1, min_devices), max_devices + 1):
        try:
            e = solve(model, n, profile, global_batch_size=global_batch_size,
                      micro_batch_size=micro_batch_size, seq_len=seq_len,
                      zero_stages=zero_stages,
                      activation_checkpointing=activation_checkpointing)
        except SolverError as err:
            errors.append((n, str(err)))
            continue
        if best is None or float(f"{e.tokens_per_second:.9g}") > \
                float(f"{best.tokens_per_second:.9g}"):
            best = e
    if best is None:
        n, why = errors[-1]
        raise SolverError(f"no device count in {max(1, min_devices)}..{max_devices} can run "
                          f"{model.name}; with {n}: {why}")
    return best
