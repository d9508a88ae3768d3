"""The fuzz run's judge: each answer checked as it comes, and the run's verdicts and report.

The judging side of :mod:`.fuzz`: :class:`Tally` (everything counted), :class:`Sender` (sends
a case's bytes through raw channels and judges the answer: a documented code, the code its
kind must get, no hang, no fuzzed request that changed the agent's state), the training
checks (:func:`compare_losses`, bit for bit against the reference, and contiguous step
records), :func:`failures` (what a run shows wrong) and :func:`report` (the printed counts).
Separate because it holds the rules a run is judged by, apart from how the requests are made
and how the workers are run.
"""

from __future__ import annotations

import collections
import random
import struct
import threading
import time
from dataclasses import dataclass, field

import grpc

from dynatrain.agent.server import ANSWER_CODES
from dynatrain.agent.v1 import agent_pb2

from .fuzz_cases import METHODS, C, Case, token_metadata

# ----------------------------------------------------------------------------------------------
# Sending and judging


@dataclass
class Tally:
    """Everything counted in a run (thread-safe through ``lock``)."""

    sent: collections.Counter = field(default_factory=collections.Counter)
    """Requests per kind (``kind`` and ``kind/Method``)."""
    codes: collections.Counter = field(default_factory=collections.Counter)
    by_kind: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    undocumented: list = field(default_factory=list)
    unexpected: list = field(default_factory=list)
    accepted: list = field(default_factory=list)
    """Fuzzed Prepares/Commits answered OK, or Aborts that aborted something."""
    hangs: list = field(default_factory=list)
    """Calls that got no answer before the client's deadline."""
    not_sent: collections.Counter = field(default_factory=collections.Counter)
    """Cases the client library refused to send (e.g. metadata it cannot encode)."""
    bytes_sent: int = 0
    seconds: collections.Counter = field(default_factory=collections.Counter)
    """Seconds spent waiting for answers, per kind."""
    slowest: dict = field(default_factory=dict)
    """The slowest answer per kind: (seconds, case index)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def example(self, case: Case, code, details: str) -> dict:
        return {"index": case.index, "kind": case.kind, "method": case.method,
                "port": case.port, "token": case.token, "note": case.note.strip(),
                "bytes": len(case.payload), "payload_hex": case.payload[:96].hex(),
                "code": code.name if code else None, "details": (details or "")[:400]}


class Sender:
    """Sends cases through raw channels (bytes in, bytes out) and judges each answer."""

    def __init__(self, addresses: dict[str, str], token: str, tally: Tally, *,
                 channels: int = 4, deadline_s: float = 20.0):
        self.token, self.tally, self.deadline_s = token, tally, deadline_s
        # Sending up to 5 MiB must not be refused by this side's own limits.
        options = [("grpc.max_send_message_length", -1),
                   ("grpc.max_receive_message_length", 64 << 20)]
        self.channels = {port: [grpc.insecure_channel(address, options)
                                for _ in range(channels)]
                         for port, address in addresses.items()}
        self._calls: dict = {}
        self._calls_lock = threading.Lock()
        self.on_accepted = None
        """Called with (case, response) when a fuzzed Prepare was accepted (to abort it)."""

    def _call(self, case: Case):
        channels = self.channels.get(case.port) or self.channels["agent"]
        key = (case.port, case.index % len(channels), case.method)
        with self._calls_lock:
            if key not in self._calls:
                # no serializers: the payload bytes go out as they are, the reply comes back
                # as bytes
                self._calls[key] = channels[key[1]].unary_unary(case.method)
            return self._calls[key]

    def send(self, case: Case) -> grpc.StatusCode | None:
        rng = random.Random(case.index)
        metadata = token_metadata(case.token, self.token, rng)
        t0 = time.monotonic()
        response, details = None, ""
        try:
            response = self._call(case)(case.payload, metadata=metadata,
                                        timeout=self.deadline_s)
            code = C.OK
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        except (ValueError, TypeError) as e:     # this side would not send it
            with self.tally.lock:
                self.tally.not_sent[f"{case.kind}: {type(e).__name__}"] += 1
            return None
        elapsed = time.monotonic() - t0
        self.judge(case, code, details, response, elapsed)
        return code

    def judge(self, case: Case, code, details: str, response: bytes | None,
              elapsed: float) -> None:
        t = self.tally
        name = case.name
        problem = None
        if code == C.DEADLINE_EXCEEDED and elapsed >= self.deadline_s * 0.95:
            hang = True
        else:
            hang = False
        if code == C.OK and name in METHODS:
            try:
                reply = METHODS[name][1].FromString(response or b"")
            except Exception as e:
                reply, problem = None, f"OK with an undecodable {name} reply: {e}"
            if name == "Prepare":
                problem = "a fuzzed Prepare was accepted"
                if self.on_accepted is not None and reply is not None:
                    self.on_accepted(case, reply)
            elif name == "Commit":
                problem = "a fuzzed Commit switched the target"
            elif name == "Abort" and reply is not None and reply.aborted:
                problem = "a fuzzed Abort aborted a prepared generation"
        with t.lock:
            t.sent[case.kind] += 1
            t.sent[f"{case.kind}/{name}"] += 1
            t.bytes_sent += len(case.payload)
            t.seconds[case.kind] += elapsed
            if elapsed > t.slowest.get(case.kind, (0.0, -1))[0]:
                t.slowest[case.kind] = (elapsed, case.index)
            t.codes[code.name] += 1
            t.by_kind[case.kind][code.name] += 1
            if hang:
                t.hangs.append(t.example(case, code, f"no answer in {elapsed:.1f} s"))
            elif code not in ANSWER_CODES | case.protocol_codes:
                t.undocumented.append(t.example(case, code, details))
            elif case.expect is not None and code not in case.expect | {C.RESOURCE_EXHAUSTED}:
                t.unexpected.append(t.example(case, code, details)
                                    | {"expected": sorted(c.name for c in case.expect)})
            if problem:
                t.accepted.append(t.example(case, code, problem))

    def close(self) -> None:
        for channels in self.channels.values():
            for ch in channels:
                ch.close()


def compare_losses(target: dict[int, agent_pb2.StepRecord],
                   reference: dict[int, agent_pb2.StepRecord]) -> dict:
    """Step by step, bit for bit: the steps both trained, how many differ, the first that
    does, and the largest relative difference."""
    common = sorted(set(target) & set(reference))
    differ = [s for s in common
              if struct.pack("<d", target[s].loss) != struct.pack("<d", reference[s].loss)]
    rel = max((abs(target[s].loss - reference[s].loss) / max(abs(reference[s].loss), 1e-30)
               for s in common), default=0.0)
    first = differ[0] if differ else None
    return {"compared": len(common), "first_step": common[0] if common else None,
            "last_step": common[-1] if common else None, "differ": len(differ),
            "equal": bool(common) and not differ, "max_rel_diff": rel,
            "first_mismatch": None if first is None else {
                "step": first, "target": target[first].loss,
                "reference": reference[first].loss}}


def _contiguous(records: dict[int, agent_pb2.StepRecord]) -> bool:
    steps = sorted(records)
    return bool(steps) and steps == list(range(steps[0], steps[-1] + 1))


def failures(result: dict, *, min_each: int = 3) -> list[str]:
    """What a run shows wrong (empty: it passed): crashes, undocumented codes, requests that
    got a code their kind must not, fuzzed requests accepted, hangs, health, training."""
    out = []
    if result["crashes"]:
        out.append(f"processes died: {result['dead']}")
    for key, what in (("undocumented", "answers with an undocumented code"),
                      ("unexpected", "answers with a code their kind must not get"),
                      ("accepted", "fuzzed requests that changed the agent's state"),
                      ("hangs", "calls with no answer before the deadline")):
        if result[key]:
            out.append(f"{len(result[key])} {what}, e.g. {result[key][:3]}")
    if result["health_failures"] or not result["final_health"]:
        out.append(f"health not SERVING: {result['health_failures'][:5]}, at the end "
                   f"{result['final_health']}")
    for d in result["deliberate"]:
        if not d.get("prepared") or not d.get("aborted"):
            out.append(f"a valid Prepare of the next generation, then Abort: {d}")
    if result["final_state"] != "TRAINING" or result["final_generation"] != 1 \
            or result["final_error"]:
        out.append(f"the target ended {result['final_state']} in generation "
                   f"{result['final_generation']} (error {result['final_error']!r}); expected "
                   "TRAINING in generation 1")
    if result["generations_in_records"] != [1] or not result["records_contiguous"]:
        out.append(f"step records of generations {result['generations_in_records']}, "
                   f"contiguous: {result['records_contiguous']}")
    if result["steps_during_fuzz"] < 1:
        out.append("the target trained no step during the fuzz")
    loss = result["losses"]
    if not loss["equal"]:
        out.append(f"losses differ from the reference's: {loss}")
    for code in ("INVALID_ARGUMENT", "UNAUTHENTICATED", "FAILED_PRECONDITION"):
        if result["codes"].get(code, 0) < min_each:
            out.append(f"only {result['codes'].get(code, 0)} answers {code}: the fuzzer does "
                       "not reach that check")
    if any(c != 0 for c in result.get("exit_codes", {}).values()):
        out.append(f"exit codes after SIGINT: {result['exit_codes']}")
    return out


def report(result: dict) -> str:
    """The printed counts."""
    lines = [f"seed {result['seed']}: {result['requests']} requests in "
             f"{result['seconds']:.1f} s ({result['requests_per_s']:.0f}/s; "
             f"{result['serial']} one at a time, the rest from {result['threads']} threads in "
             f"{result['flood_seconds']:.1f} s), {result['megabytes_sent']:.1f} MiB"]
    lines.append("requests per kind:")
    for kind, codes in result["by_kind"].items():
        per = ", ".join(f"{m.split('/')[1]} {n}" for m, n in result["sent"].items()
                        if m.startswith(kind + "/"))
        lines.append(f"  {kind:15s} {result['sent'][kind]:6d}  ({per})  -> "
                     + ", ".join(f"{c} {n}" for c, n in sorted(codes.items()))
                     + f"; {result['mean_ms'][kind]:.1f} ms mean, slowest "
                     f"{result['slowest'][kind]['ms']:.0f} ms "
                     f"(#{result['slowest'][kind]['index']})")
    lines.append("answers per code: " + ", ".join(f"{c} {n}" for c, n in
                                                  result["codes"].items()))
    lines.append(f"undocumented codes: {len(result['undocumented'])}; unexpected for their "
                 f"kind: {len(result['unexpected'])}; fuzzed requests accepted: "
                 f"{len(result['accepted'])}; hangs: {len(result['hangs'])}; not sent: "
                 f"{sum(result['not_sent'].values())}")
    lines.append(f"crashes: {result['crashes']}; health SERVING on "
                 f"{result['health_checks'] - len(result['health_failures'])}/"
                 f"{result['health_checks']} checks, at the end {result['final_health']}; "
                 f"exit codes {result.get('exit_codes')} (stopped in "
                 f"{result.get('stop_seconds')} s)")
    good = sum(1 for d in result["deliberate"] if d.get("prepared") and d.get("aborted"))
    lines.append(f"deliberate Prepare+Abort of the next generation: {good}/"
                 f"{len(result['deliberate'])} accepted and aborted")
    loss = result["losses"]
    lines.append(f"training: {result['steps_during_fuzz']} steps during the fuzz, "
                 f"{result['steps_total']} in all, ended {result['final_state']} in "
                 f"generation {result['final_generation']}; losses of steps "
                 f"{loss['first_step']}..{loss['last_step']} ({loss['compared']}) vs the "
                 f"reference: {'equal bit for bit' if loss['equal'] else 'DIFFERENT'} "
                 f"(max rel diff {loss['max_rel_diff']:.2e})")
    return "\n".join(lines)
