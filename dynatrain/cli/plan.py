"""``dynatrain plan``: plan a switch between two layouts and print its cost.

The plan command is the planner's front door: it binds both layouts to the model and devices,
plans, and prints either a readable summary or one JSON object for scripts and benchmarks.
"""

from __future__ import annotations

import argparse
import json

from dynatrain.cli.errors import UsageError
from dynatrain.vps.layout import LayoutError, parse_layout
from dynatrain.vps.presets import load_model
from dynatrain.vps.placement import place_devices
from dynatrain.vps.planner import plan_switch
from dynatrain.vps.presets import PRESETS
from dynatrain.vps.stats import device_traffic, plan_stats
from dynatrain.vps.verify import verify_plan


def register(sub) -> None:
    p = sub.add_parser(
        "plan", help="plan a switch from one layout to another and print its cost",
        description="Plan the switch of a model's training state from one parallelism layout "
        "to another: which bytes each device copies, sends and receives. Layouts are written "
        "like 'dp=4,tp=2,pp=2,ep=2,zero=1,stages=12+10+10' (anything not given is 1; zero "
        "is 0). By default the old layout runs on devices 0..N_old-1 and the new one on "
        "0..N_new-1.",
        epilog="example: dynatrain plan --model gpt-125m --from dp=4 --to dp=2,tp=2,zero=1",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="M",
                   help=f"preset ({', '.join(PRESETS)}) or a .yaml/.json model spec file")
    p.add_argument("--from", dest="old", required=True, metavar="L", help="current layout")
    p.add_argument("--to", dest="new", required=True, metavar="L", help="new layout")
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
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="N",
                   help="devices per node; sources on the receiver's node are preferred "
                   "(default 8)")
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


def run_plan(args) -> int:
    if args.gpus_per_node < 1:
        raise UsageError(f"--gpus-per-node={args.gpus_per_node} must be >= 1")
    model = load_model(args.model)
    old = parse_layout(args.old)
    new = parse_layout(args.new)
    old_devices = parse_devices(args.from_devices, "--from-devices")
    new_devices = parse_devices(args.to_devices, "--to-devices")
    dead = parse_devices(args.dead_devices, "--dead-devices") or ()
    for name, layout, devices in (("--from", old, old_devices), ("--to", new, new_devices)):
        if devices is not None and len(devices) != layout.world:
            raise LayoutError(f"{name} {layout.to_text()} has {layout.world} ranks "
                              f"(dp*tp*pp) but {len(devices)} devices are given")
    old = old.with_devices(old_devices or range(old.world))
    new_devices = new_devices or tuple(range(new.world))
    if args.keep_rank_order:
        new = new.with_devices(new_devices)
    else:
        new = place_devices(model, old, new, new_devices)
    plan = plan_switch(model, old, new, gpus_per_node=args.gpus_per_node, dead=dead)
    if args.verify:
        verify_plan(plan, frozenset(dead))
    stats = plan_stats(plan)
    if args.json:
        out = stats.to_dict()
        out.update(layout_from=plan.old.layout.to_text(), layout_to=plan.new.layout.to_text(),
                   devices_from=list(plan.old.device_of), devices_to=list(plan.new.device_of),
                   ratio_to_bound=round(stats.ratio_to_bound, 4), verified=bool(args.verify))
        print(json.dumps(out))
        return 0
    print(render_plan(plan, stats, verified=args.verify))
    return 0


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

