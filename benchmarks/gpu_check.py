"""The CUDA paths checked on one GPU, and a local-only switch's pause against the memcpy floor.

Run on a machine with a GPU (``make gpu-check``):

    .venv/bin/python benchmarks/gpu_check.py [--model gpt-125m] [--json] [--skip-run]

Checks, each pass or fail (:mod:`dynatrain.bench.gpu` says what each compares): world-size-1
training on CUDA (losses as on the CPU); the transition engine's adoption and local copies on
CUDA tensors (``dp=1 -> dp=1,zero=1``: bit-identical state, the unswitched trainer's loss; its
commit on a one-rank NCCL group); one-rank NCCL groups made with ``device_id`` (the default
group of a world of one, a ``new_group``, the engine's transition group) running collectives;
a snapshot to pinned host memory and its restore, also through a recovery's switch; a DCP save
and load; four processes sharing the GPU over gloo that switch live ``dp=4 ->
dp=2,tp=2,zero=1`` (bit-identical to DCP's resharding, every tensor on the GPU); the same four
recovering from one of them killed, from the in-memory snapshots (bit-identical to the unfailed
run at the restored step); and (unless ``--skip-run``) ``dynatrain run`` of a one-GPU job that
switches live. Each check's time is printed.

Then the figure: the pause of that local-only switch on ``--model`` (best of ``--repeats``)
against its floor, the bytes it copies at the device-to-device copy bandwidth torch reaches
on this GPU (measured here). The pause includes what the floor does not: the commit's
all-reduce (a fresh NCCL communicator per generation) and the trainer's rebuild.

The whole run must fit in 10 minutes on one GPU (:data:`BUDGET_SECONDS`); the total is printed
against it, and going over is said, not failed (timings are figures here, not verdicts).

Exit code: 0 if every check passed, 1 if one failed, 2 if CUDA is unavailable (nothing runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch

BUDGET_SECONDS = 600
"""What ``make gpu-check`` may take on one GPU, every check and the timed switches together."""


def _detail(name: str, f: dict) -> str:
    """A few of a check's figures for its line (all of them are in ``--json``)."""
    if name == "engine":
        return f"commit on {f['commit_group']}"
    if name == "single-rank":
        return (f"default group {f['default_backend']}, bound to {f['bound_device_id']}; "
                f"engine's {f['engine_group']}")
    if name == "switch4":
        return (f"{f['switch']}: pause {f['pause_seconds'] * 1e3:.1f} ms, "
                f"{f['bytes_copied'] / 2**20:.1f} MiB copied, "
                f"{f['bytes_adopted'] / 2**20:.1f} MiB adopted on {', '.join(f['devices'])}")
    if name == "recovery4":
        return (f"{f['recovery']} without rank {f['killed']}: step {f['restore_step']} "
                f"restored in {f['recovery_seconds'] * 1e3:.0f} ms on {', '.join(f['devices'])}")
    return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-125m",
                        help="model of the timed switch (default gpt-125m; checks use gpt-tiny)")
    parser.add_argument("--repeats", type=int, default=3, help="timed switches (default 3)")
    parser.add_argument("--cuda-device", type=int, default=0, metavar="N")
    parser.add_argument("--skip-run", action="store_true",
                        help="skip the `dynatrain run` check (about half a minute)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is unavailable here (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}): run it on a "
              "machine with an NVIDIA GPU and its driver", file=sys.stderr)
        return 2
    if not 0 <= args.cuda_device < torch.cuda.device_count():
        print(f"gpu_check: --cuda-device {args.cuda_device}: {torch.cuda.device_count()} GPUs "
              "are visible", file=sys.stderr)
        return 2
    from dynatrain.bench import gpu, gpu_ranks

    torch.cuda.set_device(args.cuda_device)
    dev = torch.device("cuda", args.cuda_device)
    say = (lambda *_: None) if args.json else print
    nccl = torch.cuda.nccl.version()
    say(f"{torch.cuda.get_device_name(dev)} (cuda:{args.cuda_device}), torch "
        f"{torch.__version__}, CUDA {torch.version.cuda}, NCCL "
        f"{'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}")
    checks = [("training", gpu.check_training), ("engine", gpu.check_switch),
              ("single-rank", gpu_ranks.check_single_rank_groups),
              ("snapshot", gpu.check_snapshot), ("checkpoint", gpu.check_checkpoint),
              ("switch4", gpu_ranks.check_switch4), ("recovery4", gpu_ranks.check_recovery4)]
    if not args.skip_run:
        checks.append(("run", gpu.check_run))
    out = {"device": torch.cuda.get_device_name(dev), "checks": {}, "failed": [],
           "budget_seconds": BUDGET_SECONDS}
    for name, check in checks:
        t0 = time.perf_counter()
        try:
            figures = check(dev)
            took = time.perf_counter() - t0
            out["checks"][name] = {"ok": True, "seconds": took, **figures}
            detail = _detail(name, figures)
            say(f"  {name:<11} ok    ({took:5.1f} s){'  ' + detail if detail else ''}")
        except Exception as e:  # noqa: BLE001 - every check is reported, then the exit code
            took = time.perf_counter() - t0
            out["checks"][name] = {"ok": False, "seconds": took,
                                   "error": f"{type(e).__name__}: {e}"}
            out["failed"].append(name)
            say(f"  {name:<11} FAILED ({took:.1f} s): {type(e).__name__}: {e}")
            if not args.json:
                traceback.print_exc()
    t0 = time.perf_counter()
    try:
        f = gpu.switch_floor(dev, model=args.model, repeats=args.repeats)
        out["floor"] = f
        say(f"local-only switch {f['switch']} of {f['model']}, best of {args.repeats}:")
        say(f"  pause               {f['pause_seconds'] * 1e3:9.2f} ms   (all: "
            f"{', '.join(f'{p * 1e3:.2f}' for p in f['pauses_seconds'])} ms)")
        say(f"  floor               {f['floor_seconds'] * 1e3:9.2f} ms   "
            f"({f['bytes_copied'] / 2**20:.1f} MiB copied at "
            f"{f['memcpy_bytes_per_second'] / 2**30:.1f} GiB/s device-to-device; "
            f"{f['bytes_adopted'] / 2**20:.1f} MiB adopted, not moved)")
        ratio = f["pause_over_floor"]
        say(f"  pause / floor       {ratio:9.1f}" if ratio else "  pause / floor       -")
        say("  phases (ms)         " + ", ".join(f"{k} {v * 1e3:.2f}"
                                                 for k, v in f["phases"].items()))
    except Exception as e:  # noqa: BLE001
        out["failed"].append("floor")
        out["floor"] = {"error": f"{type(e).__name__}: {e}"}
        say(f"  floor       FAILED: {type(e).__name__}: {e}")
        if not args.json:
            traceback.print_exc()
    out["floor_check_seconds"] = time.perf_counter() - t0
    total = out["total_seconds"] = time.perf_counter() - started
    say(f"  (the timed switches took {out['floor_check_seconds']:.1f} s)")
    say(f"total {total:.1f} s of the "
        f"{BUDGET_SECONDS} s budget (make gpu-check must fit in 10 minutes on one GPU)"
        + ("" if total <= BUDGET_SECONDS else f": OVER BUDGET by {total - BUDGET_SECONDS:.0f} s"))
    if args.json:
        print(json.dumps(out))
    else:
        say("all checks passed" if not out["failed"] else f"FAILED: {', '.join(out['failed'])}")
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
