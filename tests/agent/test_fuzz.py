"""A live, training agent under thousands of generated requests (issue #21, part 5).

One fuzz run (:func:`dynatrain.bench.fuzz.run_fuzz`, a fixed seed, loopback only) is shared
by the live tests: a target worker trains while its agent gets random, mutated, garbage,
oversized, unauthenticated, stale and unknown-method requests, first one at a time, then from
16 threads; a reference worker trains the same job untouched. The run must show 0 crashes,
health SERVING throughout, only documented gRPC codes (and the code each kind of request must
get), no fuzzed request that changed the agent's state, and the target's losses equal bit for
bit to the reference's. The generator's own rules (cases reproducible from the seed, no
fuzzed Prepare that could be accepted) are checked without processes first.
"""

from __future__ import annotations

import random

import grpc
import pytest

from dynatrain.agent import server as agent_server
from dynatrain.agent.v1 import agent_pb2
from dynatrain.bench import fuzz

SEED = 20210521
REQUESTS = 4000


# -- the generator, without processes ---------------------------------------------------------


def test_cases_are_reproducible_from_seed_and_index():
    a = fuzz.Fuzzer(SEED, rendezvous="127.0.0.1:29500", stale_max=4)
    b = fuzz.Fuzzer(SEED, rendezvous="127.0.0.1:29500", stale_max=4)
    for i in (0, 1, 17, 999, 123456):
        x, y = a.case(i), b.case(i)
        assert (x.kind, x.method, x.payload, x.token, x.port) == \
            (y.kind, y.method, y.payload, y.token, y.port)
    assert len({a.case(i).payload for i in range(50)}) > 40      # and they do differ


def test_no_fuzzed_prepare_could_be_accepted():
    # Every Prepare that gets past the agent's wire checks names a stale generation, so the
    # agent must refuse it: the fuzzer never starts real work by chance.
    f = fuzz.Fuzzer(7, rendezvous="127.0.0.1:29500", stale_max=3)
    past_checks = 0
    for i in range(3000):
        case = f.case(i)
        if case.name != "Prepare":
            continue
        try:
            req = agent_pb2.PrepareRequest.FromString(case.payload)
        except Exception:
            continue
        if len(case.payload) > 65536:
            assert 1 <= req.generation <= 3, (i, case.kind, case.note)
            continue
        try:
            agent_server.check_prepare(req)
        except agent_server.InvalidRequest:
            continue
        past_checks += 1
        assert 1 <= req.generation <= 3, (i, case.kind, case.note, req)
    assert past_checks > 100, "the fuzzer hardly reaches the agent's state checks"


def test_no_fuzzed_checkpoint_names_a_generation_that_could_run():
    # A Checkpoint of the running generation writes one (with stop: training ends): every
    # one that gets past the wire checks names a generation above any the target has seen.
    f = fuzz.Fuzzer(11, rendezvous="127.0.0.1:29500", stale_max=3)
    past_checks = 0
    for i in range(3000):
        case = f.case(i)
        if case.name != "Checkpoint":
            continue
        try:
            req = agent_pb2.CheckpointRequest.FromString(case.payload)
            agent_server.check_checkpoint(req)
        except Exception:
            continue
        past_checks += 1
        assert req.generation > 3, (i, case.kind, case.note, req)
    assert past_checks > 20, "the fuzzer hardly reaches the agent's Checkpoint"


def test_wire_mutations_stay_below_the_library():
    rng = random.Random(1)
    msg = agent_pb2.PrepareRequest(generation=5, layout="dp=2", devices=[0, 1],
                                   rendezvous="127.0.0.1:1")
    data = msg.SerializeToString()
    records = fuzz.split_records(data)
    assert records is not None and b"".join(records) == data and len(records) == 4  # packed
    assert fuzz.split_records(b"\x0b\x0c") is None                  # a group: not ours
    assert fuzz.split_records(fuzz.varint(2 << 3 | 2) + fuzz.varint(99) + b"ab") is None
    kinds, decodable = set(), 0
    for _ in range(400):
        how, out = fuzz.mutate(rng, data)
        kinds.add(how)
        try:
            agent_pb2.PrepareRequest.FromString(out)
            decodable += 1
        except Exception:
            pass
    assert kinds >= {"flip", "truncate", "duplicate", "drop", "shuffle", "unknown", "length",
                     "wiretype", "splice", "varint"}
    assert 50 < decodable < 390        # some still parse (and reach the checks), some do not


# -- the live run ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run():
    result = fuzz.run_fuzz(REQUESTS, seed=SEED, threads=16, flood_seconds=60)
    print("\n" + fuzz.report(result))
    return result


@pytest.mark.slow
def test_fuzz_report_has_no_failures(run):
    # the judge's whole list, so that one failing run names every problem at once
    assert fuzz.failures(run) == [], fuzz.report(run)


@pytest.mark.slow
def test_no_crash_and_health_serving_throughout(run):
    assert run["crashes"] == 0, run["dead"]
    assert run["exit_codes"] == {"target": 0, "reference": 0}
    assert run["health_checks"] >= 10 and run["health_failures"] == []
    assert run["final_health"] is True
    assert run["hangs"] == []


@pytest.mark.slow
def test_every_answer_is_a_documented_code(run):
    assert run["requests"] >= REQUESTS * 0.9, f"only {run['requests']} requests sent"
    assert run["undocumented"] == [], run["undocumented"][:5]
    assert run["unexpected"] == [], run["unexpected"][:5]
    assert run["accepted"] == [], run["accepted"][:5]
    documented = {c.name for c in agent_server.ANSWER_CODES} | {"NOT_FOUND"}  # health's own
    assert set(run["codes"]) <= documented, run["codes"]
    # the fuzzer reaches each check: wire, token, state
    for code in ("INVALID_ARGUMENT", "UNAUTHENTICATED", "FAILED_PRECONDITION", "UNIMPLEMENTED",
                 "RESOURCE_EXHAUSTED", "OK"):
        assert run["codes"].get(code, 0) >= 3, (code, run["codes"])
    for kind in fuzz.KINDS:
        assert run["sent"].get(kind, 0) > 0, f"no {kind} requests sent"
    # a stale Commit is always refused as such; a bad token always as UNAUTHENTICATED
    assert set(run["by_kind"]["bad-token"]) <= {"UNAUTHENTICATED", "RESOURCE_EXHAUSTED"}
    # valid Prepares of the next generation are still accepted (and aborted) amid the fuzz
    assert [d.get("aborted") for d in run["deliberate"]] == [True] * 3, run["deliberate"]


@pytest.mark.slow
def test_training_steps_on_with_the_same_losses(run):
    assert run["steps_during_fuzz"] >= 3
    assert run["final_state"] == "TRAINING" and run["final_generation"] == 1
    assert run["final_error"] == ""
    assert run["generations_in_records"] == [1] and run["records_contiguous"]
    losses = run["losses"]
    assert losses["compared"] >= run["steps_during_fuzz"]
    assert losses["first_step"] == 1 and losses["last_step"] == run["steps_total"]
    assert losses["equal"], losses


def test_documented_codes_are_the_agents():
    # the judge uses the agent's own list, not a copy
    assert fuzz.ANSWER_CODES is agent_server.ANSWER_CODES
    assert grpc.StatusCode.INTERNAL not in fuzz.ANSWER_CODES
