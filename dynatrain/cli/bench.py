"""``dynatrain bench switch``, ``chaos`` and ``goodput``: the arguments and the printout.

The benchmarks themselves are the library's (``dynatrain.bench``); each command's ``--help``
description is its benchmark module's docstring after the first paragraph.
"""

from __future__ import annotations

import argparse
import json
import sys

from dynatrain.bench import chaos, switch
from dynatrain.cli.errors import UsageError
from dynatrain.vps.presets import PRESETS


def _details(module) -> str:
    return module.__doc__.split("\n\n", 1)[1]


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks of the live system",
                           description="Benchmarks that run the real system on this machine.")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    p = bsub.add_parser(
        "switch", help="live switch vs checkpoint-and-restart, verified bit for bit",
        description=_details(switch), formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: dynatrain bench switch --model gpt-tiny --from dp=2,tp=2 --to pp=2,tp=2")
    p.add_argument("--model", required=True, metavar="M", help=f"preset ({', '.join(PRESETS)})")
    p.add_argument("--from", dest="old", required=True, metavar="L")
    p.add_argument("--to", dest="new", required=True, metavar="L")
    p.add_argument("--seq-len", type=int, default=0)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--staging-mib", type=int, default=256, help="staging budget (default 256)")
    p.add_argument("--checksums", action="store_true",
                   help="verify every message's bytes (everything is packed then)")
    p.add_argument("--direct-kib", type=int, default=1024, metavar="K",
                   help="regions of at least K KiB travel unpacked, each as its own message "
                        "(default 1024)")
    p.add_argument("--no-carve", action="store_true",
                   help="copy new tensors that are one block of an old one instead of making "
                        "them views of it (CPU; for comparison)")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo", "nccl-sim"), default="auto",
                   help="auto (default): NCCL with one GPU per rank when this machine has "
                        "enough, else gloo on the CPU; nccl: GPUs or fail; gloo: the CPU; "
                        "nccl-sim: the CPU with NCCL's semantics (a test harness)")
    p.add_argument("--no-baseline", action="store_true", help="skip checkpoint-and-restart")
    p.add_argument("--dump", metavar="DIR", help="write DIR/before.pt and DIR/after.pt")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_bench_switch)
    _register_chaos(bsub)
    _register_goodput(bsub)


def run_bench_switch(args) -> int:
    from dynatrain.trainer.backend import BackendError, bench_backend
    from dynatrain.trainer.config import make_config

    if args.staging_mib < 1:
        raise UsageError(f"--staging-mib={args.staging_mib} must be >= 1")
    if args.direct_kib < 1:
        raise UsageError(f"--direct-kib={args.direct_kib} must be >= 1")
    old_cfg = make_config(args.model, args.old, seq_len=args.seq_len,
                          global_batch_size=args.global_batch_size)
    new_cfg = make_config(args.model, args.new, seq_len=args.seq_len,
                          global_batch_size=args.global_batch_size)
    try:
        backend = bench_backend(args.backend,
                                max(old_cfg.layout.world, new_cfg.layout.world))
    except BackendError as e:
        raise UsageError(str(e)) from None
    result = switch.bench_switch(old_cfg, new_cfg, staging_bytes=args.staging_mib << 20,
                                 backend=backend,
                                 checksums=args.checksums, direct_bytes=args.direct_kib << 10,
                                 carve=not args.no_carve, baseline=not args.no_baseline,
                                 dump=args.dump, timeout_s=args.timeout,
                                 progress=None if args.json else print)
    if args.json:
        print(json.dumps(result))
    else:
        _print_summary(result)
    ok = result["bitwise_equal"] and result["loss_match"] is not False
    return 0 if ok else 1


def _print_summary(r: dict) -> None:
    print(f"switch {r['from']} ({r['ranks_from']} ranks) -> {r['to']} ({r['ranks_to']} ranks), "
          f"{r['model']}, {r['backend']}")
    print(f"  pause (switch_seconds)     {r['switch_seconds']:.4f} s   "
          f"(transfer {r['transfer_seconds']:.4f} s; prepare {r['prepare_seconds']:.3f} s "
          "overlapped with training)")
    print(f"  transfer floor             {r['floor_seconds']:.4f} s   "
          f"({r['bytes_network'] / 2**20:.1f} MiB on the network, busiest device "
          f"{r['max_rank_bytes'] / 2**20:.1f} MiB at {r['p2p_bytes_per_second'] / 2**30:.2f} GiB/s)")
    print(f"  floor, all devices at once {r['floor_concurrent_seconds']:.4f} s   "
          f"(the same bytes, {(r['bytes_copied'] + r['bytes_carved']) / 2**20:.1f} MiB of "
          "them local, moved by one memcpy and one message per peer)")
    if r["bytes_carved"]:
        print(f"  carved, not copied         {r['bytes_carved'] / 2**20:.1f} MiB   (new tensors "
              "that are views of a block of an old one)")
    if r.get("pause_over_floor") is not None:
        print(f"  pause / floor              {r['pause_over_floor']:.2f}")
    else:
        print("  pause / floor              -   (nothing to move: every new tensor was "
              "adopted in place)")
    if r.get("restart_seconds") is not None:
        print(f"  checkpoint-and-restart     {r['restart_seconds']:.3f} s   "
              f"(speedup {r['speedup']:.1f}x)")
    print(f"  bitwise_equal (vs DCP)     {r['bitwise_equal']}")
    print(f"  loss_match                 {r['loss_match']}   losses after: "
          f"{[round(x, 6) for x in r['losses_after']]}")
    worst = max(zip(r["rss_growth_bytes"], r["rss_growth_bound_bytes"]),
                key=lambda gb: gb[0] / max(gb[1], 1))
    what = "peak RSS" if r["memory"] == "rss" else "peak GPU memory"   # nccl: torch's CUDA
    print(f"  {what + ' during switch':<27}{max(r['peak_rss_bytes']) / 2**20:.0f} MiB "
          f"(max over ranks; closest to its bound: growth {worst[0] / 2**20:.1f} MiB of "
          f"{worst[1] / 2**20:.1f} MiB; within bound on every rank: {r['rss_within_bound']})")


def _register_chaos(bsub) -> None:
    p = bsub.add_parser(
        "chaos", help="kill workers at random points; every trial must recover exactly",
        description=_details(chaos), formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: dynatrain bench chaos --trials 10 --json")
    p.add_argument("--trials", type=int, default=10, help="chaos trials (default 10)")
    p.add_argument("--restart-trials", type=int, default=3,
                   help="checkpoint-and-restart trials, for comparison (default 3)")
    p.add_argument("--steps", type=int, default=16, help="steps of each trial's job")
    p.add_argument("--seed", type=int, default=0, help="seed of the trial plan")
    p.add_argument("--first-trial", type=int, default=0, metavar="N",
                   help="run trials N .. N+TRIALS-1 of the seeded plan (default 0): two runs, "
                        "on two backends say, split one plan")
    p.add_argument("--trial-timeout", type=float, default=240.0,
                   help="seconds before a trial counts as hung (default 240)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="trials run N at a time (default 1). Side by side they share the "
                        "cores, which stretches the MTTR figures but not the verdicts: use "
                        "1 for figures, more to check recovery sooner")
    p.add_argument("--keep", metavar="DIR", help="keep every trial's logs and dumps in DIR")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--backend", choices=("gloo", "nccl-sim"), default="gloo",
                   help="the trials' workers: gloo (default), or nccl-sim for NCCL's failure "
                        "semantics (dead peers hang, the watchdog, abort); the bit-for-bit "
                        "references run on gloo")
    p.add_argument("--overlap", type=int, default=0, metavar="N",
                   help="instead: N random scenarios of overlapping events (notices, joins, "
                        "requested layouts, kills, hangs a few steps apart), each judged "
                        "against the job without events (losses, data read exactly once, "
                        "requests answered, every event acted on within one step)")
    p.set_defaults(func=run_bench_chaos)


def run_bench_chaos(args) -> int:
    if args.overlap < 0:
        raise UsageError(f"--overlap={args.overlap} must be >= 0")
    if args.overlap:
        return _run_overlap(args)
    if args.trials < 1:
        raise UsageError(f"--trials={args.trials} must be >= 1")
    if args.steps < 10:
        raise UsageError(f"--steps={args.steps} must be >= 10 (kills land in steps 3..steps-5)")
    if args.restart_trials < 0:
        raise UsageError(f"--restart-trials={args.restart_trials} must be >= 0")
    if args.first_trial < 0:
        raise UsageError(f"--first-trial={args.first_trial} must be >= 0")
    if args.jobs < 1:
        raise UsageError(f"--jobs={args.jobs} must be >= 1")
    out = chaos.bench_chaos(args.trials, seed=args.seed, steps=args.steps,
                            restart_trials=args.restart_trials, timeout_s=args.trial_timeout,
                            keep=args.keep, say=(lambda s: print(s, file=sys.stderr, flush=True))
                            if args.json else print, backend=args.backend,
                            first=args.first_trial, jobs=args.jobs)
    if args.json:
        print(json.dumps(out))
    else:
        brief = {k: v for k, v in out.items() if k != "results"}
        print(json.dumps(brief, indent=2))
    # A worker lost to NCCL's watchdog (nccl-sim) is a recovery that waited for an op's
    # timeout instead of aborting the failed generation: a failure even where it recovered.
    return 0 if (out["hung"] == 0 and out["corrupted"] == 0 and out["errors"] == 0
                 and out["watchdog_kills"] == 0 and out["watchdog_aborts"] == 0) else 1


def _run_overlap(args) -> int:
    from dynatrain.bench import overlap

    say = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else print
    out = overlap.bench_overlap(args.overlap, seed=args.seed, keep=args.keep, say=say)
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps({k: v for k, v in out.items() if k != "results"}, indent=2))
    return 0 if out["passed"] == out["trials"] else 1


def _register_goodput(bsub) -> None:
    from dynatrain.bench import goodput

    p = bsub.add_parser(
        "goodput", help="goodput under a capacity trace: live switches vs checkpoint-and-restart",
        description=_details(goodput), formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: dynatrain bench goodput --trace examples/spot-trace.yaml --json")
    p.add_argument("--trace", required=True, metavar="FILE",
                   help="capacity trace (YAML; format above)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds each of the two runs may take (default 1800)")
    p.add_argument("--keep", metavar="DIR", help="keep both runs' logs in DIR")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (progress goes to stderr)")
    p.set_defaults(func=run_bench_goodput)


def run_bench_goodput(args) -> int:
    from dynatrain.bench import goodput

    if args.timeout <= 0:
        raise UsageError(f"--timeout={args.timeout} must be positive")
    goodput.load_trace(args.trace)          # a bad trace or job stops here, before any run
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else print
    out = goodput.bench_goodput(args.trace, timeout_s=args.timeout, keep=args.keep, say=say)
    if args.json:
        print(json.dumps(out))
    else:
        print(goodput.format_report(out))
    return 0 if all(out[m].get("outcome") == "finished" for m in goodput.MODES) else 1
