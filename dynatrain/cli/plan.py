"""``dynatrain plan``: plan a switch between two layouts and print its cost.

The plan command is the planner's front door: it binds both layouts to the model and devices,
plans, and prints either a readable summary or one JSON object for scripts and benchmarks.
Besides bytes it reports the modelled pause on a two-tier network (NVLink inside a node, a NIC
per GPU between nodes; :mod:`dynatrain.vps.timemodel`) and its lower bound. ``--estimate``
prints that pause for the paper's cases (or for the one given) next to the published figures.
``--memory`` prints GPU and host memory and the redundancy's cost per step
(:mod:`dynatrain.controller.memory`) for the built-in 7B and 70B cases or the layout given.
"""

from __future__ import annotations

import argparse
import json

from dynatrain.cli.errors import UsageError
from dynatrain.vps.layout import LayoutError, parse_layout
from dynatrain.vps.topology import DEFAULT_DEVICES_PER_NODE
from dynatrain.vps.presets import load_model
from dynatrain.vps.placement import place_devices
from dynatrain.vps.planner import plan_switch
from dynatrain.vps.presets import PRESETS
from dynatrain.vps.stats import device_traffic, plan_stats
from dynatrain.vps.timemodel import DEFAULT_INTER_GBPS, DEFAULT_INTRA_GBPS, Links
from dynatrain.vps.verify import verify_plan

#: The paper's headline switches on H100 nodes (arXiv 2605.18815: 70B dense in under 2 s,
#: Qwen3-235B-A22B MoE 1024 -> 896 GPUs in 4.36 s), in layouts a user would run. Each is
#: (name, model, from, to, devices of the new layout or None for 0..N-1, dead devices,
#: published seconds or None, what the published figure is). A node that goes is a node
#: with notice (preemption, drain): it sends its state before it leaves, as on Kubernetes.
PAPER_CASES = [
    ("70B lose a node, pp 4 -> 5", "llama-70b", "tp=8,pp=4,dp=4,zero=1",
     "tp=8,pp=5,dp=3,zero=1", [d for d in range(128) if d // 8 != 5], (),
     2.0, "< 2 s"),
    ("70B lose a node, drop a replica", "llama-70b", "tp=8,pp=4,dp=4,zero=1",
     "tp=8,pp=4,dp=3,zero=1", [d for d in range(128) if d // 8 != 5][:96], (),
     2.0, "< 2 s"),
    ("70B scale up 64 -> 128", "llama-70b", "tp=8,pp=4,dp=2,zero=1", "tp=8,pp=4,dp=4,zero=1",
     None, (), 2.0, "< 2 s"),
    ("235B 1024 -> 896, pp 8 -> 7", "qwen3-235b-a22b", "tp=4,pp=8,dp=32,ep=32,zero=1",
     "tp=4,pp=7,dp=32,ep=32,zero=1", None, (), 4.36, "4.36 s"),
    ("235B 1024 -> 896, tp=2 pp 8 -> 7", "qwen3-235b-a22b", "tp=2,pp=8,dp=64,ep=64,zero=1",
     "tp=2,pp=7,dp=64,ep=64,zero=1", None, (), 4.36, "4.36 s"),
    ("235B 1024 -> 896, pp 16 -> 14", "qwen3-235b-a22b", "tp=4,pp=16,dp=16,ep=16,zero=1",
     "tp=4,pp=14,dp=16,ep=16,zero=1", None, (), 4.36, "4.36 s"),
]


def register(sub) -> None:
    p = sub.add_parser(
        "plan", help="plan a switch from one layout to another and print its cost",
        description="Plan the switch of a model's training state from one parallelism layout "
        "to another: which bytes each device copies, sends and receives. Layouts are written "
        "like 'dp=4,tp=2,pp=2,ep=2,zero=1,stages=12+10+10' (anything not given is 1; zero "
        "is 0). By default the old layout runs on devices 0..N_old-1 and the new one on "
        "0..N_new-1.",
        epilog="examples:\n  dynatrain plan --model gpt-125m --from dp=4 --to dp=2,tp=2,zero=1\n"
        "  dynatrain plan --estimate\n"
        "  dynatrain plan --memory\n"
        "  dynatrain plan --memory --model llama-7b --from dp=8,zero=1 --to dp=4,zero=1 "
        "--profile a100-40gb\n"
        "  dynatrain plan --estimate --model llama-70b --from tp=8,pp=4,dp=4 "
        "--to tp=8,pp=4,dp=3",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="M",
                   help=f"preset ({', '.join(PRESETS)}) or a .yaml/.json model spec file "
                   "(required unless --estimate runs the built-in cases)")
    p.add_argument("--from", dest="old", metavar="L", help="current layout")
    p.add_argument("--to", dest="new", metavar="L", help="new layout")
    p.add_argument("--from-devices", metavar="D,D,…",
                   help="devices of the current layout's ranks (default 0..N_old-1)")
    p.add_argument("--to-devices", metavar="D,D,…",
                   help="devices the new layout runs on, e.g. after losing device 3 "
                   "(default 0..N_new-1)")
    p.add_argument("--dead-devices", metavar="D,D,…", default="",
                   help="devices whose state is lost (not usable as sources)")
    p.add_argument("--keep-rank-order", action="store_true",
                   help="give new rank i the i-th device of --to-devices; by default the "
                   "planner picks which device takes which rank so that data stays in place")
    p.add_argument("--devices-per-node", "--gpus-per-node", type=int,
                   default=DEFAULT_DEVICES_PER_NODE, metavar="N",
                   help="devices per node: device d is on node d // N; transfers inside a "
                   "node use --intra-gbps, others --inter-gbps (default 8)")
    p.add_argument("--intra-gbps", type=float, default=DEFAULT_INTRA_GBPS, metavar="G",
                   help="bandwidth per GPU and direction inside a node, Gb/s (default "
                   f"{DEFAULT_INTRA_GBPS:g}: H100 NVLink, 450 GB/s)")
    p.add_argument("--inter-gbps", type=float, default=DEFAULT_INTER_GBPS, metavar="G",
                   help="bandwidth per GPU and direction between nodes, Gb/s (default "
                   f"{DEFAULT_INTER_GBPS:g}: one 400G NIC per GPU)")
    p.add_argument("--estimate", action="store_true",
                   help="print the modelled pause (bytes over those links, each device's "
                   "four ports in parallel, slowest device) and its lower bound. Alone, for "
                   "the paper's cases (Llama-2 70B and Qwen3-235B-A22B on H100 nodes) next to "
                   "the published figures; with --model/--from/--to, for that switch")
    p.add_argument("--memory", action="store_true",
                   help="print GPU memory per device (a training step, and the switch), host "
                   "memory per node (the snapshots and mirrors, also while a switch keeps the "
                   "previous generation's) and the per-step cost of the redundancy, against "
                   "--profile. Alone, for llama-7b dp=8 ZeRO-1 and llama-70b tp=8,pp=4,dp=4 "
                   "each losing a node; with --model/--from (and --to), for that layout")
    p.add_argument("--profile", default="h100", metavar="P",
                   help="device profile of --memory (default h100; see dynatrain.controller."
                   "hardware.PROFILES)")
    p.add_argument("--global-batch", type=int, default=256, metavar="N",
                   help="--memory: sequences per step (default 256)")
    p.add_argument("--micro-batch", type=int, default=1, metavar="N",
                   help="--memory: sequences per micro-batch (default 1)")
    p.add_argument("--seq-len", type=int, default=4096, metavar="N",
                   help="--memory: tokens per sequence (default 4096)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="--memory: with per-block activation checkpointing")
    p.add_argument("--mirror-gbps", type=float, default=None, metavar="G",
                   help="--memory: rate of the mirrors between nodes, Gb/s (default: the "
                   "profile's inter-node rate, at most 24 Gb/s, what gloo's TCP reaches)")
    p.add_argument("--verify", action="store_true",
                   help="also check the plan element by element against the mapping "
                   "(slow for large models)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_plan)



def parse_devices(text: str | None, what: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        devices = tuple(int(x) for x in text.replace(" ", "").split(",") if x != "")
    except ValueError:
        raise UsageError(f"{what}={text!r} is not a comma-separated list of device numbers, "
                         "e.g. 0,1,2,4") from None
    if any(d < 0 for d in devices):
        raise UsageError(f"{what}={text!r}: device numbers must be >= 0")
    return devices


def _links(args) -> Links:
    for flag, value in (("--intra-gbps", args.intra_gbps), ("--inter-gbps", args.inter_gbps)):
        if not value > 0 or value == float("inf"):
            raise UsageError(f"{flag}={value:g} must be a positive bandwidth in Gb/s, e.g. "
                             f"{DEFAULT_INTRA_GBPS:g} (NVLink) or {DEFAULT_INTER_GBPS:g} (NIC)")
    return Links.from_gbps(args.intra_gbps, args.inter_gbps)


def _plan(model, old, new, old_devices, new_devices, dead, keep_rank_order, devices_per_node,
          links):
    for name, layout, devices in (("--from", old, old_devices), ("--to", new, new_devices)):
        if devices is not None and len(devices) != layout.world:
            raise LayoutError(f"{name} {layout.to_text()} has {layout.world} ranks "
                              f"(dp*tp*pp) but {len(devices)} devices are given")
    old = old.with_devices(old_devices or range(old.world))
    new_devices = new_devices or tuple(range(new.world))
    if keep_rank_order:
        new = new.with_devices(new_devices)
    else:
        new = place_devices(model, old, new, new_devices)
    return plan_switch(model, old, new, devices_per_node=devices_per_node, dead=dead, links=links)


def run_plan(args) -> int:
    if args.devices_per_node < 1:
        raise UsageError(f"--devices-per-node={args.devices_per_node} must be >= 1")
    links = _links(args)
    given = [f for f, v in (("--model", args.model), ("--from", args.old), ("--to", args.new))
             if v is not None]
    if args.memory:
        return run_memory(args, given)
    if args.estimate and not given:
        return run_estimate(args, links)
    if len(given) < 3:
        missing = [f for f in ("--model", "--from", "--to") if f not in given]
        raise UsageError(f"{', '.join(missing)} missing: give --model, --from and --to "
                         "(or --estimate alone for the paper's cases)")
    model = load_model(args.model)
    old = parse_layout(args.old)
    new = parse_layout(args.new)
    old_devices = parse_devices(args.from_devices, "--from-devices")
    new_devices = parse_devices(args.to_devices, "--to-devices")
    dead = parse_devices(args.dead_devices, "--dead-devices") or ()
    plan = _plan(model, old, new, old_devices, new_devices, dead, args.keep_rank_order,
                 args.devices_per_node, links)
    if args.verify:
        verify_plan(plan, frozenset(dead))
    stats = plan_stats(plan)
    if args.estimate:
        row = _estimate_row("this switch", plan, stats, None, "")
        print(json.dumps(_estimate_json([row], args, links)) if args.json
              else render_estimate([row], args, links))
        return 0
    if args.json:
        out = stats.to_dict()
        out.update(layout_from=plan.old.layout.to_text(), layout_to=plan.new.layout.to_text(),
                   devices_from=list(plan.old.device_of), devices_to=list(plan.new.device_of),
                   ratio_to_bound=round(stats.ratio_to_bound, 4),
                   time_ratio_to_bound=round(stats.time_ratio_to_bound, 4),
                   devices_per_node=args.devices_per_node, intra_gbps=args.intra_gbps,
                   inter_gbps=args.inter_gbps, verified=bool(args.verify))
        print(json.dumps(out))
        return 0
    print(render_plan(plan, stats, verified=args.verify))
    return 0


def run_memory(args, given) -> int:
    """``--memory``: :mod:`dynatrain.controller.memory`'s figures, for the built-in cases or
    for the layout (and switch) given."""
    from dynatrain.controller.costmodel import SolverError
    from dynatrain.spec.hardware import PROFILES
    from dynatrain.controller.memory import builtin_reports, memory_report, render

    if args.profile not in PROFILES:
        raise UsageError(f"--profile={args.profile!r} is not a device profile; valid: "
                         f"{', '.join(PROFILES)}")
    profile = PROFILES[args.profile]
    for flag, value in (("--global-batch", args.global_batch),
                        ("--micro-batch", args.micro_batch), ("--seq-len", args.seq_len)):
        if value < 1:
            raise UsageError(f"{flag}={value} must be >= 1")
    if args.mirror_gbps is not None and not 0 < args.mirror_gbps < float("inf"):
        raise UsageError(f"--mirror-gbps={args.mirror_gbps:g} must be a positive rate in Gb/s")
    mirror = args.mirror_gbps * 1e9 / 8 if args.mirror_gbps else None
    if not given:
        reports = builtin_reports(profile, mirror_bytes_per_second=mirror)
    else:
        if args.model is None or args.old is None:
            raise UsageError("--memory with a layout needs --model and --from (--to adds the "
                             "switch); alone it prints the built-in cases")
        model = load_model(args.model)
        old = parse_layout(args.old)
        old_devices = parse_devices(args.from_devices, "--from-devices")
        if old_devices is not None and len(old_devices) != old.world:
            raise UsageError(f"--from {old.to_text()} has {old.world} ranks but "
                             f"{len(old_devices)} devices are given")
        old = old.with_devices(old_devices or range(old.world))
        new = None
        if args.new is not None:
            new_devices = parse_devices(args.to_devices, "--to-devices")
            new = parse_layout(args.new)
            new_devices = new_devices or tuple(range(new.world))
            if len(new_devices) != new.world:
                raise UsageError(f"--to {new.to_text()} has {new.world} ranks but "
                                 f"{len(new_devices)} devices are given")
            new = (new.with_devices(new_devices) if args.keep_rank_order
                   else place_devices(model, old, new, new_devices))
        try:
            rep = memory_report(model, old, profile, global_batch_size=args.global_batch,
                                micro_batch_size=args.micro_batch, seq_len=args.seq_len,
                                new_layout=new, nodes=args.devices_per_node,
                                activation_checkpointing=args.activation_checkpointing,
                                mirror_bytes_per_second=mirror)
        except SolverError as e:
            raise UsageError(str(e)) from None
        reports = [("this layout", rep)]
    if args.json:
        print(json.dumps({"cases": [{"name": n, **r.summary()} for n, r in reports]}))
    else:
        print("\n\n".join(f"{n}:\n{render(r)}" for n, r in reports))
    return 0


def _estimate_row(name, plan, stats, published, published_text) -> dict:
    return {"case": name, "model": stats.model, "from": plan.old.layout.to_text(),
            "to": plan.new.layout.to_text(), "ranks_from": stats.ranks_from,
            "ranks_to": stats.ranks_to, "max_rank_bytes": stats.max_rank_bytes,
            "lower_bound_max_rank_bytes": stats.lower_bound_max_rank_bytes,
            "modelled_seconds": round(stats.modelled_seconds, 4),
            "lower_bound_seconds": round(stats.lower_bound_seconds, 4),
            "time_ratio_to_bound": round(stats.time_ratio_to_bound, 4),
            "published_seconds": published, "published": published_text}


def _estimate_json(rows, args, links) -> dict:
    return {"devices_per_node": args.devices_per_node, "intra_gbps": args.intra_gbps,
            "inter_gbps": args.inter_gbps, "cases": rows}


def run_estimate(args, links) -> int:
    rows = []
    for name, model, old, new, to_devices, dead, published, text in PAPER_CASES:
        plan = _plan(load_model(model), parse_layout(old), parse_layout(new), None,
                     tuple(to_devices) if to_devices is not None else None, tuple(dead),
                     False, args.devices_per_node, links)
        rows.append(_estimate_row(name, plan, plan_stats(plan), published, text))
    print(json.dumps(_estimate_json(rows, args, links)) if args.json
          else render_estimate(rows, args, links))
    return 0


def render_estimate(rows, args, links) -> str:
    lines = [f"modelled pause on nodes of {args.devices_per_node} GPUs, {args.intra_gbps:g} Gb/s "
             f"inside a node, {args.inter_gbps:g} Gb/s between",
             "  nodes (per GPU and direction)",
             "  model: each device's NVLink and NIC ports send and receive at once; the pause",
             "  is the slowest device's slowest port (transfer only, no latency or setup)", "",
             f"  {'switch':<34}{'model':<17}{'GPUs':>12}{'busiest':>11}{'modelled':>10}"
             f"{'bound':>8}{'ratio':>7}{'published':>11}"]
    for r in rows:
        gpus = f"{r['ranks_from']} -> {r['ranks_to']}"
        lines.append(f"  {r['case']:<34}{r['model']:<17}{gpus:>12}"
                     f"{fmt_bytes(r['max_rank_bytes']):>11}{r['modelled_seconds']:>9.2f}s"
                     f"{r['lower_bound_seconds']:>7.2f}s{r['time_ratio_to_bound']:>7.3f}"
                     f"{r['published']:>11}")
    if len(rows) == 1 and rows[0]["published_seconds"] is None:
        r = rows[0]
        lines.append(f"\n  {r['from']} -> {r['to']}")
    if any(r["published_seconds"] is not None for r in rows):
        lines += ["", "  published: the paper's measured end-to-end switch pause (arXiv "
                  "2605.18815). The model",
                  "  counts only moving the bytes at the links' nominal rate, so it is a floor "
                  "for the transfer;",
                  "  the rest of a measured pause is setup, synchronisation, staging and the "
                  "rate actually reached."]
    return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _device_ranges(devices) -> str:
    devs = list(devices)
    lo, hi = min(devs), max(devs)
    span = f"{lo}-{hi}" if len(devs) > 1 else str(lo)
    if devs == list(range(lo, hi + 1)):
        return span
    if sorted(devs) == list(range(lo, hi + 1)):
        return f"{span}, reordered to keep data in place (--json lists them)"
    text = ",".join(map(str, devs))
    return text if len(text) <= 60 else text[:57] + "... (--json lists them)"


def render_plan(plan, stats, verified: bool = False) -> str:
    replica = stats.state_bytes
    lines = [
        f"switch plan for {stats.model}: {stats.params:,} params, "
        f"{fmt_bytes(replica)} of state per replica",
        f"  from  {plan.old.layout.to_text():<40} {stats.ranks_from:>5} ranks on devices "
        f"{_device_ranges(plan.old.device_of)}",
        f"  to    {plan.new.layout.to_text():<40} {stats.ranks_to:>5} ranks on devices "
        f"{_device_ranges(plan.new.device_of)}",
        "",
        f"  {'network bytes':<28}{fmt_bytes(stats.bytes_network):>14}   "
        f"({stats.bytes_network / replica:.2f} replicas)",
        f"  {'local copies':<28}{fmt_bytes(stats.bytes_local):>14}",
        f"  {'busiest device':<28}{fmt_bytes(stats.max_rank_bytes):>14}   "
        f"(send {fmt_bytes(stats.max_rank_send_bytes)}, recv "
        f"{fmt_bytes(stats.max_rank_recv_bytes)})",
        f"  {'lower bound':<28}{fmt_bytes(stats.lower_bound_max_rank_bytes):>14}   "
        f"(busiest / bound = {stats.ratio_to_bound:.3f})",
        f"  {'modelled pause':<28}{stats.modelled_seconds:>12.3f} s   "
        f"(NVLink {plan.links.intra * 8 / 1e9:g} Gb/s, NIC {plan.links.inter * 8 / 1e9:g} "
        f"Gb/s, {plan.devices_per_node} GPUs per node)",
        f"  {'lower bound on the pause':<28}{stats.lower_bound_seconds:>12.3f} s   "
        f"(modelled / bound = {stats.time_ratio_to_bound:.3f})",
        *([f"  {'both bounds at once':<28}{'':>14}   no plan is within "
           f"{stats.lower_bound_joint_ratio:.3f}x of both: they conflict"]
          if stats.lower_bound_joint_ratio > 1.0005 else []),
        f"  {'transfers':<28}{stats.transfers:>14,}   ({stats.transfer_records:,} records "
        f"over {len(plan.groups)} tensor groups)",
        f"  {'plan time':<28}{stats.plan_seconds:>12.3f} s",
    ]
    if verified:
        lines.append(f"  {'verified':<28}{'yes':>14}   (every element once, from a holder)")
    devices = sorted(set(plan.old.device_of) | set(plan.new.device_of))
    if len(devices) <= 16:
        send, recv, local = device_traffic(plan)
        lines += ["", f"  {'device':>6} {'old rank':>8} {'new rank':>8} {'send':>12} "
                      f"{'recv':>12} {'local':>12}"]
        for d in devices:
            o = plan.old.rank_of_device.get(d, "-")
            n = plan.new.rank_of_device.get(d, "-")
            lines.append(f"  {d:>6} {o:>8} {n:>8} {fmt_bytes(send.get(d, 0)):>12} "
                         f"{fmt_bytes(recv.get(d, 0)):>12} {fmt_bytes(local.get(d, 0)):>12}")
    return "\n".join(lines)

