"""DynaTrain against TorchFT on the same job: one replica of four is killed, how long until the
survivors complete a step, and what a step costs when nothing fails.

Both sides train gpt-tiny in pure data parallelism on 4 CPU processes (gloo), with the same
global batch, sequence length, step count, initial weights, synthetic token stream, AdamW and
learning-rate schedule (the job manifest of ``dynatrain bench chaos``, built once and read by
both). At step ``--kill-at`` one replica (``--victim``) gets SIGKILL.

- **DynaTrain**: one ``dynatrain bench chaos`` step-kill trial (its local runner: controller,
  agents, workers) under ``dp=4``; the controller recovers in memory to a layout for the 3
  survivors, held to pure DP (``spec.parallelism.limits``: the solver would otherwise be free
  to pick e.g. ``pp=3``). Kill -> next step is the chaos bench's MTTR: from the kill to the
  end of the first step of the recovered generation.
- **TorchFT** (``pip install 'dynatrain[bench]'``, i.e. ``torchft==0.2.0``): a lighthouse on
  127.0.0.1 in this process and 4 replica processes, each one replica group of one rank: a
  ``torchft.Manager`` over torchft's reconfigurable ``ProcessGroupGloo``, the same model as a
  plain ``nn.Module``, gradients flattened into one buffer and averaged with
  ``Manager.allreduce``, the optimizer stepped when ``Manager.should_commit()`` says so (what
  torchft's ``DistributedDataParallel`` + ``OptimizerWrapper`` do, one bucket). The global
  batch stays fixed: each step, participant *r* of *n* trains its share of the step's samples.
  Kill -> next step: from the kill to the first step committed by a quorum without the victim.

Steady-state step time: median interval between consecutive step completions, leaving out the
first steps (warm-up) and the steps from the kill to the first one after the recovery.

    .venv/bin/python benchmarks/vs_torchft.py [--steps 30] [--kill-at 10] [--victim 1]
        [--global-batch 12] [--seq-len 64] [--torchft-config example] [--side both] [--json]

``--torchft-config``: ``example`` (default) uses the timeouts of torchft's own DDP example
(``train_ddp.py``: gloo 5 s, manager 30 s; lighthouse defaults: heartbeat timeout 5 s);
``defaults`` the library's own (every timeout 60 s: with them the job stalls, see
``TORCHFT_CONFIGS``); ``tuned`` (labelled so) a 1 s heartbeat timeout and a 2 s gloo timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

INSTALL_HINT = ("torchft is not installed; it is a benchmark-only dependency: "
                ".venv/bin/pip install 'torchft==0.2.0' (or: pip install -e '.[bench]')")
REPLICAS = 4
PURE_DP = {"maxTP": 1, "maxPP": 1, "maxEP": 1, "zeroStages": [0]}
"""DynaTrain's solver may pick any layout for the survivors; here it is held to plain DP."""
WARMUP_STEPS = 2
"""Intervals ending at these first steps are left out of the steady-state median."""

# torchft 0.2.0's defaults (torchft/manager.py, torchft/process_group.py,
# `torchft_lighthouse --help`). With them a kill of one of four gloo replicas stalls the job:
# the survivors whose ring neighbour died fail at once, the others wait out the gloo timeout
# (60 s), and the first ones' quorum request times out (also 60 s) just before that, raising
# TimeoutError out of Manager.start_quorum in the training loop.
TORCHFT_CONFIGS = {
    "defaults": {"lighthouse_heartbeat_timeout_ms": 5000, "lighthouse_join_timeout_ms": 60000,
                 "lighthouse_quorum_tick_ms": 100, "manager_timeout_s": 60,
                 "manager_quorum_timeout_s": 60, "manager_connect_timeout_s": 60,
                 "manager_heartbeat_interval_ms": 100, "process_group_gloo_timeout_s": 60,
                 "use_async_quorum": True, "min_replicas": REPLICAS - 1}}
# What torchft's own DDP example (train_ddp.py) sets on CPU: gloo 5 s, manager 30 s.
TORCHFT_CONFIGS["example"] = {**TORCHFT_CONFIGS["defaults"], "process_group_gloo_timeout_s": 5,
                              "manager_timeout_s": 30}
# Tuned here (labelled so): a silent replica is dropped after 1 s, a stuck collective after 2 s.
TORCHFT_CONFIGS["tuned"] = {**TORCHFT_CONFIGS["example"], "lighthouse_heartbeat_timeout_ms": 1000,
                            "process_group_gloo_timeout_s": 2}


def torchft_missing() -> str | None:
    """Why torchft cannot be used here (None: it can)."""
    try:
        import torchft  # noqa: F401
        from torchft._torchft import LighthouseServer  # noqa: F401
    except ImportError as e:
        return f"{INSTALL_HINT} ({e})"
    return None


def _spec(steps: int, kill_at: int, victim: int, global_batch: int, seq_len: int):
    from dynatrain.bench.chaos import TrialSpec

    # No checkpoint inside the run (torchft writes none either); no state dump on recovery
    # (the chaos bench's bit-for-bit check, which would add its write to the recovery).
    return TrialSpec(0, "step", f"dp={REPLICAS}", [victim], at_step=kill_at, steps=steps,
                     checkpoint_every=steps + 1, global_batch_size=global_batch,
                     seq_len=seq_len, check_state=False, limits=PURE_DP)


# -- figures from step completion times ----------------------------------------------------------
def step_figures(ends: dict[int, float], kill_time: float, recovered_step: int | None) -> dict:
    """Steady-state step times from {step: wall time it completed}: medians of the intervals
    between consecutive steps, without the warm-up and the steps from the kill up to the
    first one after the recovery."""
    before, after = [], []
    for s in sorted(ends):
        if s - 1 not in ends or s <= WARMUP_STEPS:
            continue
        if ends[s] < kill_time:
            before.append(ends[s] - ends[s - 1])
        elif recovered_step is not None and s > recovered_step + 1:
            after.append(ends[s] - ends[s - 1])
    both = before + after
    med = (lambda xs: statistics.median(xs) if xs else None)
    return {"steady_step_seconds": med(both), "steady_step_seconds_before_kill": med(before),
            "steady_step_seconds_after_kill": med(after), "steady_intervals": len(both)}


# -- DynaTrain ----------------------------------------------------------------------------------
def run_dynatrain(spec, root: Path, timeout_s: float) -> dict:
    from dynatrain.bench.chaos import _judge, _spawn_trial

    raw, seconds = _spawn_trial(spec, root, timeout_s, keep=True)
    judged = _judge(spec, raw, seconds, root)
    out = {"side": "dynatrain", "outcome": judged.outcome, "message": judged.message,
           "steps_completed": judged.steps, "steps": spec.steps, "wall_seconds": seconds,
           "kill_to_next_step_seconds": judged.mttr_seconds, "layout_after": judged.new_layout,
           "restored_from": judged.restored_from, "restored_step": judged.restored_step}
    if not raw or raw.get("outcome") != "finished":
        return out
    kills = raw["kills"]
    rec = raw["recoveries"][0] if raw["recoveries"] else {}
    out["workers_before"], out["workers_after"] = rec.get("workers_before"), rec.get(
        "workers_after")
    out["killed"] = [k["device"] for k in kills]
    ends: dict[int, float] = {}
    first_after: int | None = None
    for gen, step, _start, end in sorted(raw.get("step_times", [])):
        ends[step] = end                             # the newest generation's run of a step
        if rec and gen == rec["generation"] and first_after is None:
            first_after = step
    out["recovered_step"] = first_after
    out.update(step_figures(ends, kills[0]["time"] if kills else float("inf"), first_after))
    return out


# -- TorchFT ------------------------------------------------------------------------------------
def _replica_main(argv: list[str]) -> int:
    """One torchft replica (a process of its own): ``vs_torchft.py _replica JSON``."""
    a = json.loads(argv[0])
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)                  # as DynaTrain's local runner on 2 cores / 4
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from dynatrain.spec.job import load_job
    from dynatrain.trainer.data import token_source
    from dynatrain.trainer.model import StageModel
    from dynatrain.trainer.optim import make_optimizer, set_lr
    from dynatrain.trainer.weights import initial_tensor
    from dynatrain.vps.layout import parse_layout

    cfg = load_job(Path(a["job"])).train_config(parse_layout("dp=1"))
    model = cfg.model
    specs = {t.name: t for t in model.tensors}

    class Replica(torch.nn.Module):
        """gpt-tiny as a plain module: DynaTrain's stage math over one full set of weights."""

        def __init__(self):
            super().__init__()
            self.names = list(specs)
            self.weights = torch.nn.ParameterList(
                [torch.nn.Parameter(initial_tensor(model, specs[n], cfg.seed).float())
                 for n in self.names])
            self.stage = StageModel(model, range(model.num_layers), first=True, last=True,
                                    groups=_NoGroups(), ep=1, vocab_start=0)

        def forward(self, inputs, targets):
            w = dict(zip(self.names, self.weights))
            return self.stage.loss(self.stage.blocks(self.stage.embed(inputs, w), w),
                                   targets, w)

    net = Replica()
    optimizer = make_optimizer(dict(zip(net.names, net.weights)), specs, cfg)
    source = token_source(cfg)

    def state_dict():
        return {"model": net.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(sd):
        net.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    c = a["config"]
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(
                          seconds=c["process_group_gloo_timeout_s"])),
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=c["min_replicas"],
                      timeout=timedelta(seconds=c["manager_timeout_s"]),
                      quorum_timeout=timedelta(seconds=c["manager_quorum_timeout_s"]),
                      connect_timeout=timedelta(seconds=c["manager_connect_timeout_s"]),
                      heartbeat_interval=timedelta(
                          milliseconds=c["manager_heartbeat_interval_ms"]),
                      use_async_quorum=c["use_async_quorum"],
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=a["lighthouse"], replica_id=f"replica_{a['index']}",
                      hostname="127.0.0.1", init_sync=False)
    # Start together: every manager heartbeats before anyone asks for the first quorum.
    parent = dist.TCPStore("127.0.0.1", a["barrier_port"], is_master=False,
                           timeout=timedelta(seconds=120))
    parent.add("ready", 1)
    parent.wait(["go"])

    G = cfg.global_batch_size
    log = open(a["log"], "a", buffering=1)
    while manager.current_step() < cfg.total_steps:
        t0 = time.perf_counter()
        net.zero_grad(set_to_none=True)
        manager.start_quorum()
        n, r = manager.num_participants(), manager.participating_rank()
        step = manager.current_step()
        # This participant's share of the step's global batch (fixed whatever n is).
        lo, hi = (r * G // n, (r + 1) * G // n) if r is not None else (0, 0)
        loss_value = float("nan")
        if hi > lo:
            # One sequence per micro-batch, gradients accumulated: what DynaTrain's trainer
            # does by default (spec.training.microBatchSize 1), so both sides do the same work.
            total = 0.0
            for i in range(lo, hi):
                row = source.sample(step * G + i).unsqueeze(0)
                loss = net(row[:, :-1].contiguous(), row[:, 1:].contiguous())
                # Averaged over the n participants below: the mean over the global batch.
                (loss * n / G).backward()
                total += float(loss.detach())
            loss_value = total / (hi - lo)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in net.weights]
        flat = torch.cat([g.reshape(-1) for g in grads])
        manager.allreduce(flat).wait()
        committed = manager.should_commit()
        if committed:
            offset = 0
            for p in net.weights:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            set_lr(optimizer, cfg.lr_at(step))
            optimizer.step()
        log.write(json.dumps({"step": manager.current_step(), "committed": committed,
                              "participants": n, "rank": r, "loss": loss_value,
                              "seconds": time.perf_counter() - t0, "end": time.time()}) + "\n")
    log.close()
    manager.shutdown(wait=False)
    os._exit(0)


class _NoGroups:
    tp = None
    ep = None


def run_torchft(spec, root: Path, timeout_s: float, *, config: str = "example") -> dict:
    import torch.distributed as dist
    import yaml
    from torchft._torchft import LighthouseServer

    from dynatrain.bench.chaos import _manifest

    conf = TORCHFT_CONFIGS[config]
    os.environ.setdefault("RUST_LOG", "warn")     # the in-process lighthouse's log: quiet
    root.mkdir(parents=True, exist_ok=True)
    job = root / "job.yaml"
    job.write_text(yaml.safe_dump(_manifest(spec)))
    out = {"side": "torchft", "config_name": config, "config": conf, "steps": spec.steps,
           "outcome": "error", "message": ""}
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=conf["min_replicas"],
                                  join_timeout_ms=conf["lighthouse_join_timeout_ms"],
                                  quorum_tick_ms=conf["lighthouse_quorum_tick_ms"],
                                  heartbeat_timeout_ms=conf["lighthouse_heartbeat_timeout_ms"])
    # address() names the host; the server listens on the loopback only.
    lh = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    barrier = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=120))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": lh, "RUST_LOG": "info"}
    procs, logs = [], []
    t0 = time.monotonic()
    kill_time = None
    try:
        for i in range(REPLICAS):
            logs.append(root / f"replica{i}.jsonl")
            arg = json.dumps({"index": i, "job": str(job), "lighthouse": lh,
                              "config": conf, "barrier_port": barrier.port,
                              "log": str(logs[i])})
            with open(root / f"replica{i}.log", "w") as f:
                procs.append(subprocess.Popen([sys.executable, __file__, "_replica", arg],
                                              stdout=f, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
        while barrier.add("ready", 0) < REPLICAS:
            if any(p.poll() is not None for p in procs) or time.monotonic() - t0 > timeout_s:
                raise RuntimeError("a torchft replica did not start; see "
                                   f"{root}/replica*.log")
            time.sleep(0.05)
        time.sleep(0.5)               # a few heartbeats (every 100 ms) reach the lighthouse
        barrier.set("go", "1")
        victim = procs[spec.victims[0]]
        while True:
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"torchft run passed {timeout_s:.0f} s")
            if kill_time is None:
                done = max((r["step"] for r in _records(logs[spec.victims[0]])
                            if r["committed"]), default=0)
                if done >= spec.at_step:
                    victim.send_signal(signal.SIGKILL)
                    kill_time = time.time()
            if all(p.poll() is not None for p in procs):
                break
            time.sleep(0.02)
        out["exit_codes"] = [p.returncode for p in procs]
    except Exception as e:     # noqa: BLE001 - reported, with the replicas' logs to read
        out["message"] = f"{type(e).__name__}: {e}"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        lighthouse.shutdown()
    out["wall_seconds"] = time.monotonic() - t0
    out["killed"] = spec.victims if kill_time is not None else []
    survivors = [i for i in range(REPLICAS) if i not in spec.victims]
    recs = {i: [r for r in _records(logs[i]) if r["committed"]] for i in survivors}
    out["steps_completed"] = min((max((r["step"] for r in v), default=0)
                                  for v in recs.values()), default=0)
    out["start_participants"] = min((r["participants"] for v in recs.values() for r in v
                                     if r["step"] == 1), default=None)
    out["failed_steps"] = sum(not r["committed"] for i in survivors
                              for r in _records(logs[i]))
    if kill_time is None:
        out["message"] = out["message"] or "the kill did not land"
        return out
    ends: dict[int, float] = {}
    for v in recs.values():
        for r in v:
            ends[r["step"]] = max(ends.get(r["step"], 0.0), r["end"])
    after = sorted((r["end"], r["step"], r["participants"]) for v in recs.values() for r in v
                   if r["end"] > kill_time and r["participants"] == REPLICAS - 1)
    out["recovered_step"] = after[0][1] if after else None
    out["kill_to_next_step_seconds"] = after[0][0] - kill_time if after else None
    out["workers_before"] = out["start_participants"]
    out["workers_after"] = after[0][2] if after else None
    out["killed_exit_code"] = out.get("exit_codes", [None] * REPLICAS)[spec.victims[0]]
    out.update(step_figures(ends, kill_time, out["recovered_step"]))
    if not out["message"]:
        ok = out["steps_completed"] == spec.steps and after and all(
            c == 0 for i, c in enumerate(out["exit_codes"]) if i in survivors)
        out["outcome"] = "recovered" if ok else "error"
        if not ok:
            out["message"] = f"survivors finished at step {out['steps_completed']} of " \
                             f"{spec.steps}, exit codes {out['exit_codes']}; see {root}"
    return out


def _records(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:             # a line being written
            pass
    return out


# -- the bench ----------------------------------------------------------------------------------
def bench(*, steps: int = 30, kill_at: int = 10, victim: int = 1, global_batch: int = 12,
          seq_len: int = 64, side: str = "both", torchft_config: str = "example",
          timeout_s: float = 300,
          keep: str | None = None) -> dict:
    if not 0 <= victim < REPLICAS or not 2 < kill_at < steps - 2:
        raise SystemExit(f"need 0 <= --victim < {REPLICAS} and 2 < --kill-at < steps - 2")
    if global_batch % REPLICAS or global_batch % (REPLICAS - 1):
        raise SystemExit(f"--global-batch must split evenly over {REPLICAS} and "
                         f"{REPLICAS - 1} replicas (pure DP before and after the kill)")
    spec = _spec(steps, kill_at, victim, global_batch, seq_len)
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="dynatrain-vs-torchft-"))
    out = {"model": "gpt-tiny", "replicas": REPLICAS, "backend": "gloo (CPU)",
           "global_batch": global_batch, "seq_len": seq_len, "steps": steps,
           "kill_at_step": kill_at, "victim": victim}
    if side in ("both", "dynatrain"):
        out["dynatrain"] = run_dynatrain(spec, root / "dynatrain", timeout_s)
    if side in ("both", "torchft"):
        out["torchft"] = run_torchft(spec, root / f"torchft-{torchft_config}", timeout_s,
                                     config=torchft_config)
    if not keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return out


def table(out: dict) -> str:
    sides = [s for s in ("dynatrain", "torchft") if s in out]
    names = {"dynatrain": "DynaTrain",
             "torchft": f"TorchFT ({out.get('torchft', {}).get('config_name')})"}
    f = (lambda v: "-" if v is None else f"{v:.3f}")
    rows = [("kill -> next step (s)", lambda d: f(d.get("kill_to_next_step_seconds"))),
            ("steady step (s, median)", lambda d: f(d.get("steady_step_seconds"))),
            ("  before kill (4 replicas)", lambda d: f(d.get("steady_step_seconds_before_kill"))),
            ("  after recovery (3)", lambda d: f(d.get("steady_step_seconds_after_kill"))),
            ("steps completed", lambda d: f"{d.get('steps_completed')}/{d.get('steps')}"),
            ("replicas before -> after", lambda d: f"{d.get('workers_before')} -> "
                                                   f"{d.get('workers_after')}"),
            ("outcome", lambda d: d.get("outcome", ""))]
    lines = [f"gpt-tiny, {out['replicas']} CPU replicas (gloo), global batch "
             f"{out['global_batch']} x seq {out['seq_len']}, {out['steps']} steps, SIGKILL of "
             f"replica {out['victim']} at step {out['kill_at_step']}",
             f"{'':28}" + "".join(f"{names[s]:>20}" for s in sides)]
    for label, get in rows:
        lines.append(f"{label:28}" + "".join(f"{get(out[s]):>20}" for s in sides))
    for s in sides:
        if out[s].get("message"):
            lines.append(f"{names[s]}: {out[s]['message']}")
    if "torchft" in out:
        lines.append(f"torchft settings ({out['torchft']['config_name']}): " + ", ".join(
            f"{k}={v}" for k, v in out["torchft"]["config"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_replica"]:
        return _replica_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=10)
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--side", choices=("both", "dynatrain", "torchft"), default="both")
    ap.add_argument("--torchft-config", choices=sorted(TORCHFT_CONFIGS), default="example",
                    help="example: torchft's train_ddp.py timeouts (gloo 5 s, manager 30 s); "
                         "defaults: the library's (60 s); tuned: heartbeat 1 s, gloo 2 s")
    ap.add_argument("--timeout", type=float, default=300.0, help="per side, seconds")
    ap.add_argument("--keep", metavar="DIR", help="keep logs and run directories here")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")     # torchft's Rust log, read at its import
    if args.side != "dynatrain" and (why := torchft_missing()):
        print(f"vs_torchft: {why}", file=sys.stderr)
        return 2
    out = bench(steps=args.steps, kill_at=args.kill_at, victim=args.victim,
                global_batch=args.global_batch, seq_len=args.seq_len, side=args.side,
                torchft_config=args.torchft_config, timeout_s=args.timeout, keep=args.keep)
    print(json.dumps(out, indent=1) if args.json else table(out))
    return 0 if all(out[s]["outcome"] == "recovered" for s in ("dynatrain", "torchft")
                    if s in out) else 1


if __name__ == "__main__":
    sys.exit(main())
