"""Fuzz a live, training agent: thousands of generated requests, loopback only, and a judge.

Two real worker processes (``python -m dynatrain.agent.worker``, bearer token) train the same
job, ``dp=1`` each, every one with its own rendezvous store: the *target*, whose agent is
fuzzed, and the *reference*, which nobody but the monitor talks to. The fuzzer sends the
target's agent generated requests, first one at a time (so a failure reproduces in order),
then from many threads at once (a flood bounded in count and time):

- ``random``: a message of each Agent method with random field values (huge, negative, NaN
  and infinite numbers, long strings, random layout texts, rendezvous strings and checkpoint
  paths such as ``../../etc/passwd``, long repeated fields and maps);
- ``template``: a valid-looking Prepare (the one that started the job) with a few fields
  replaced by such values, so requests get past the wire checks to the agent's state checks;
- ``mutated``: a valid message changed on the wire (bit flips, truncation, duplicated,
  dropped or reordered fields, unknown fields, bad lengths and wire types);
- ``garbage``: bytes that are no message at all, sent through a raw channel;
- ``large`` / ``oversized``: long repeated fields or strings within gRPC's 4 MiB limit and
  beyond it;
- ``unknown-method``: paths the agent does not serve;
- ``bad-token``: a valid request with no, a wrong, a malformed or a duplicated token;
- ``stale``: Prepare, Commit and Abort of generations at or below the current one, Prepares
  that carry a checkpoint or a recovery among them (refused before they abandon anything);
- ``status``: Status with random ``since_step``.

No fuzzed request may start real work. Every Prepare payload that would get past the agent's
wire checks (:func:`dynatrain.agent.server.check_prepare`, run here on the decoded bytes) is
rewritten to a stale generation, so it must be refused (and every such Checkpoint to a
generation that does not run); only a few deliberate Prepares of the
next generation, sent while nothing else is in flight, are accepted, and each is aborted at
once. A fuzzed Prepare or Commit that the agent answers OK is reported (and aborted).

The judge: 0 crashes (both processes alive, the target's health SERVING on every check of a
monitor thread and at the end), every answer's gRPC code in the documented set
(``ANSWER_CODES``), per kind the codes it must get (a bad token: UNAUTHENTICATED; a stale
Commit: FAILED_PRECONDITION; ...), no call left unanswered until its deadline, and training
unchanged: the target kept stepping in its generation, its step records contiguous, and the
loss of every step equal, bit for bit, to the reference's at the same step. The tallies
(requests per kind, answers per code, steps trained during the fuzz, requests per second) are
printed by ``benchmarks/agent_fuzz.py``; ``tests/agent/test_fuzz.py`` asserts on them. Each
case is made from ``(seed, index)`` alone, so the printed seed and a case's index regenerate
it (``Fuzzer(seed, rendezvous=..., stale_max=...).case(index)``; ``stale_max`` is 1 in the
one-at-a-time phase and 1 + the deliberate Prepares in the flood), and a failure's report
carries the first bytes of its payload.

Modules, one role each: the requests (:class:`Fuzzer`, :class:`Case`, the value pools and
kinds) are made in :mod:`.fuzz_cases`, with the wire-level mutations in :mod:`.fuzz_wire`;
the worker processes and their :class:`Monitor` are in :mod:`.fuzz_workers`; the judge
(:class:`Sender`, :class:`Tally`, :func:`compare_losses`, :func:`failures`, :func:`report`) is
in :mod:`.fuzz_judge`. This module holds the run (:func:`run_fuzz`) and re-exports the names
others use from it (``__all__``).
"""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from dynatrain.agent.client import AgentCallError, AgentClient
from dynatrain.agent.server import ANSWER_CODES
from dynatrain.agent.v1 import agent_pb2
from dynatrain.ports import free_port as _free_port

# Of the names below, those in __all__ are re-exported: the tests and benchmarks use them from
# here.
from .fuzz_cases import KINDS, METHODS, Case, Fuzzer, token_metadata
from .fuzz_judge import Sender, Tally, _contiguous, compare_losses, failures, report
from .fuzz_wire import mutate, split_records, varint
from .fuzz_workers import Monitor, job_manifest, spawn_worker


# ----------------------------------------------------------------------------------------------
# A run


def run_fuzz(requests: int = 3000, *, seed: int | None = None, threads: int = 16,
             serial_fraction: float = 0.4, flood_seconds: float = 30.0,
             deliberate: int = 3, deadline_s: float = 20.0, workdir: str | None = None,
             kinds: dict[str, float] | None = None, say=print) -> dict:
    """Start the target and the reference, fuzz the target with ``requests`` cases (a
    ``serial_fraction`` of them one at a time, the rest from ``threads`` threads within
    ``flood_seconds``), and return the tallies and verdicts (see the module docstring)."""
    from dynatrain.controller.orchestrator import switch
    from dynatrain.controller.rendezvous import RendezvousServer
    from dynatrain.vps.layout import parse_layout

    if requests < 1 or threads < 1 or not 0 <= serial_fraction <= 1:
        raise ValueError(f"requests={requests}, threads={threads}, serial_fraction="
                         f"{serial_fraction}: expected requests >= 1, threads >= 1 and a "
                         "fraction in [0, 1]")
    seed = secrets.randbits(32) if seed is None else seed
    say(f"fuzz: seed {seed} ({requests} requests, {threads} threads in the flood)")
    tmp = tempfile.TemporaryDirectory(prefix="dynatrain-fuzz-") if workdir is None else None
    root = Path(workdir or tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    job = root / "job.yaml"
    job.write_text(yaml.safe_dump(job_manifest()))
    token_path = root / "token"
    token = secrets.token_urlsafe(24)
    token_path.write_text(token)
    stores = {name: RendezvousServer("127.0.0.1") for name in ("target", "reference")}
    devices = {"target": 0, "reference": 1}
    procs: dict[str, subprocess.Popen] = {}
    clients: dict[str, AgentClient] = {}
    result: dict = {"seed": seed}
    monitor = sender = None
    try:
        started = time.monotonic()
        spawned = {}
        # both start at once (torch's import and warm-up take seconds each)
        with ThreadPoolExecutor(2) as pool:
            for name, d in devices.items():
                # a checkpoint root (the job writes no checkpoints: a Prepare's path can pass
                # its check), and the target also serves health alone on a plaintext port,
                # as on a cluster
                extra = ("--checkpoint-dir", str(root / f"checkpoints-{name}"))
                if name == "target":
                    extra += ("--health-port", str(_free_port()))
                spawned[name] = pool.submit(spawn_worker, root, job, token_path, d,
                                            extra=extra)
            errors = []
            for name, fut in spawned.items():
                try:
                    procs[name], info = fut.result()
                except Exception as e:      # the other one still gets stopped below
                    errors.append(e)
                    continue
                clients[name] = AgentClient(f"127.0.0.1:{info['agent_port']}", token=token)
                result[f"{name}_ready"] = info
            if errors:
                raise errors[0]
        rdv = {name: s.address for name, s in stores.items()}
        for name, d in devices.items():
            clients[name].wait_healthy(30)
            layout = parse_layout("dp=1").with_devices([d])
            switch({d: clients[name]}, 1, None, layout, rdv[name], reason="start")
        say(f"fuzz: target (device 0) and reference (device 1) training dp=1 "
            f"({time.monotonic() - started:.1f} s to start)")
        target = clients["target"]
        health_address = f"127.0.0.1:{result['target_ready']['health_port']}"
        # no token: health is open, as for the kubelet
        health = [AgentClient(target.address), AgentClient(health_address)]
        monitor = Monitor(procs, clients, health)
        deadline = time.monotonic() + 60
        while min(len(v) for v in monitor.records.values()) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not train 2 steps within 60 s")
            monitor.poll()
            time.sleep(0.1)
        monitor.start()

        tally = Tally()
        sender = Sender({"agent": target.address, "health": health_address}, token, tally,
                        deadline_s=deadline_s)
        highest = [1]                                 # the target's highest generation
        ckpt = root / "checkpoints-target"
        fuzzer = Fuzzer(seed, rendezvous=rdv["target"], stale_max=1, kinds=kinds, checkpoints=(
            "quickstart/step-00000004", str(ckpt / "quickstart" / "step-00000001"),
            str(ckpt), "../checkpoints-target/x", "quickstart/../quickstart/step-00000002"))
        abort_lock = threading.Lock()

        def abort_accepted(case, reply):
            # a fuzzed Prepare the agent took (a bug, counted): drop it before a Commit
            with abort_lock:
                try:
                    target.abort(reply.generation, "fuzz: accepted by mistake")
                except AgentCallError as e:
                    say(f"fuzz: could not abort generation {reply.generation}: {e}")
                highest[0] = max(highest[0], reply.generation)
                fuzzer.stale_max = highest[0]
        sender.on_accepted = abort_accepted

        fuzz_started = time.time()
        t0 = time.monotonic()
        n_serial = int(requests * serial_fraction)
        for i in range(n_serial):
            sender.send(fuzzer.case(i))
        serial_s = time.monotonic() - t0
        say(f"fuzz: {n_serial} requests one at a time in {serial_s:.1f} s")

        # A few real Prepares of the next generation, each aborted at once (nothing else is
        # in flight): the agent must still accept a valid request amid the fuzz.
        deliberate_out = []
        for _ in range(deliberate):
            g = highest[0] + 1
            try:
                target.prepare(g, "dp=1", [0], rdv["target"], old_layout="dp=1",
                               old_devices=[0], reason="fuzz-deliberate")
                aborted = target.abort(g, "fuzz: deliberate")
                deliberate_out.append({"generation": g, "prepared": True,
                                       "aborted": aborted})
            except AgentCallError as e:
                deliberate_out.append({"generation": g, "prepared": False,
                                       "error": f"{e.code.name}: {e.details}"})
            highest[0] = g
            fuzzer.stale_max = g

        # The flood: the rest from many threads, bounded in count and time.
        t1 = time.monotonic()
        stop_at = t1 + flood_seconds
        flood = range(n_serial, requests)
        counter = iter(flood)
        counter_lock = threading.Lock()

        def flood_worker():
            while time.monotonic() < stop_at:
                with counter_lock:
                    i = next(counter, None)
                if i is None:
                    return
                sender.send(fuzzer.case(i))

        with ThreadPoolExecutor(threads, thread_name_prefix="fuzz-flood") as pool:
            for f in [pool.submit(flood_worker) for _ in range(threads)]:
                f.result()
        flood_s = time.monotonic() - t1
        fuzz_s = time.monotonic() - t0
        fuzz_ended = time.time()
        flood_sent = sum(tally.sent[k] for k in tally.sent if "/" not in k) - n_serial
        say(f"fuzz: {flood_sent} requests from {threads} threads in {flood_s:.1f} s")

        # After: alive, healthy, in its generation, and stepping on.
        monitor.poll()
        before = monitor.last("target")
        deadline = time.monotonic() + 60
        while monitor.last("target") < before + 3 and time.monotonic() < deadline:
            time.sleep(0.1)
            monitor.poll()
        final_health = monitor.healthy()
        try:
            final = target.status(monitor.last("target"))
        except AgentCallError as e:          # judged below, with everything else
            final = agent_pb2.StatusResponse(error=f"no Status: {e}")
        monitor.stop()
        # the reference catches up with the target's last step (it may be behind or ahead)
        last = monitor.last("target")
        deadline = time.monotonic() + 120
        while monitor.last("reference") < last and time.monotonic() < deadline:
            time.sleep(0.2)
            monitor.pull("reference", clients["reference"])
        rec_t = monitor.records["target"]
        during = [s for s, r in rec_t.items() if fuzz_started <= r.end_time <= fuzz_ended]

        result.update({
            "requests": sum(tally.sent[k] for k in tally.sent if "/" not in k),
            "serial": n_serial, "threads": threads,
            "sent": dict(sorted(tally.sent.items())),
            "codes": dict(tally.codes.most_common()),
            "by_kind": {k: dict(v) for k, v in sorted(tally.by_kind.items())},
            "undocumented": tally.undocumented, "unexpected": tally.unexpected,
            "accepted": tally.accepted, "hangs": tally.hangs,
            "not_sent": dict(tally.not_sent), "megabytes_sent": tally.bytes_sent / 2**20,
            "mean_ms": {k: 1000 * v / tally.sent[k] for k, v in sorted(tally.seconds.items())},
            "slowest": {k: {"ms": 1000 * v[0], "index": v[1]}
                        for k, v in sorted(tally.slowest.items())},
            "deliberate": deliberate_out,
            "seconds": fuzz_s, "serial_seconds": serial_s, "flood_seconds": flood_s,
            "requests_per_s": (sum(tally.sent[k] for k in tally.sent if "/" not in k)
                               / fuzz_s if fuzz_s else 0.0),
            "crashes": len(monitor.dead), "dead": dict(monitor.dead),
            "health_checks": monitor.health_checks,
            "health_failures": monitor.health_failures, "final_health": final_health,
            "status_refusals": dict(monitor.status_refusals),
            "final_state": agent_pb2.StatusResponse.State.Name(final.state),
            "final_generation": final.generation, "final_error": final.error,
            "generations_in_records": sorted({r.generation for r in rec_t.values()}),
            "records_contiguous": _contiguous(rec_t),
            "steps_during_fuzz": len(during),
            "steps_total": max(rec_t),
            "losses": compare_losses(rec_t, monitor.records["reference"]),
        })
        return result
    finally:
        if monitor is not None and monitor.is_alive():
            monitor.stop()
        if sender is not None:
            sender.close()
        for c in list(clients.values()) + (monitor.health_clients if monitor else []):
            c.close()
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)        # stop now (SIGTERM is a notice)
        codes, stop_s = {}, {}
        for name, p in procs.items():
            # it stops at its next step boundary: a step takes seconds on a loaded machine
            t_stop = time.monotonic()
            try:
                codes[name] = p.wait(60)
                stop_s[name] = round(time.monotonic() - t_stop, 1)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGABRT)     # its threads' stacks, into its log
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                log = root / f"worker-{devices[name]}.log"
                codes[name] = ("did not stop within 60 s of SIGINT; its log ends: "
                               + log.read_text(errors="replace")[-4000:])
        result["exit_codes"], result["stop_seconds"] = codes, stop_s
        for store in stores.values():
            store.close()
        if tmp is not None:
            tmp.cleanup()


__all__ = ["ANSWER_CODES", "Case", "Fuzzer", "KINDS", "compare_losses", "failures", "mutate",
           "report", "run_fuzz", "spawn_worker", "split_records",
           # re-exported too, from their new modules
           "METHODS", "Monitor", "Sender", "Tally", "job_manifest", "token_metadata", "varint"]


if __name__ == "__main__":        # a quick look: python -m dynatrain.bench.fuzz
    r = run_fuzz(300, seed=1, threads=8, flood_seconds=10)
    print(report(r))
    for f in failures(r):
        print("FAIL:", f)
    sys.exit(1 if failures(r) else 0)
