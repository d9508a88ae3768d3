"""A real worker process (trainer + agent) under bad requests: it refuses them with the right
gRPC code and keeps training throughout; then it switches live when asked properly."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import yaml

from dynatrain.agent.auth import bearer_metadata
from dynatrain.agent.client import AgentCallError, AgentClient
from dynatrain.agent.v1 import agent_pb2
from dynatrain.bench.fuzz import spawn_worker
from dynatrain.controller.orchestrator import switch
from dynatrain.controller.rendezvous import RendezvousServer
from dynatrain.vps.layout import parse_layout

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _spawn(tmp: Path, job: Path, token: Path, device: int, extra=()):
    proc, info = spawn_worker(tmp, job, token, device, extra=tuple(extra))
    return proc, f"127.0.0.1:{info['agent_port']}"


@pytest.fixture
def workers(tmp_path):
    yield from _workers(tmp_path)


@pytest.fixture
def checkpointing_workers(tmp_path):
    yield from _workers(tmp_path, "--checkpoint-dir", str(tmp_path / "checkpoints"))


def _workers(tmp_path, *extra):
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["spec"]["training"]["steps"] = 100000
    doc["spec"]["globalBatchSize"] = 4
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe(16))
    store = RendezvousServer("127.0.0.1")       # the controller's store, as the runner hosts it
    procs, clients = [], {}
    try:
        for d in range(2):
            proc, addr = _spawn(tmp_path, job, token, d, extra)
            procs.append(proc)
            clients[d] = AgentClient(addr, token_file=str(token))
            clients[d].wait_healthy(30)
        yield clients, store.address, token.read_text(), procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)     # stop now (SIGTERM is a notice)
        for p in procs:
            p.wait(10)
        store.close()


def _wait_steps(client, n, timeout=60):
    deadline = time.monotonic() + timeout
    start = client.status().step
    while client.status().step < start + n:
        assert time.monotonic() < deadline, "the trainer stopped stepping"
        time.sleep(0.05)


def test_bad_requests_are_refused_while_training_goes_on(workers):
    clients, rdv, token, procs = workers
    c0 = clients[0]
    one = parse_layout("dp=1").with_devices([0])
    switch({0: c0}, 1, None, one, rdv, reason="start")
    _wait_steps(c0, 2)
    before = c0.status().step

    def code_of(fn):
        with pytest.raises(AgentCallError) as e:
            fn()
        return e.value.code

    no_token = AgentClient(c0.address)
    assert code_of(no_token.status) == grpc.StatusCode.UNAUTHENTICATED
    wrong = AgentClient(c0.address, token="not-the-token")
    assert code_of(lambda: wrong.prepare(2, "dp=1", [0], rdv)) == grpc.StatusCode.UNAUTHENTICATED
    # a stale generation, a commit of nothing, a layout that does not fit, a wrong old world
    assert code_of(lambda: c0.prepare(1, "dp=1", [0], rdv, old_layout="dp=1",
                                      old_devices=[0])) == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(lambda: c0.commit(7)) == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(lambda: c0.prepare(2, "tp=3", [0, 1, 2], rdv, old_layout="dp=1",
                                      old_devices=[0])) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: c0.prepare(2, "dp=2", [0, 1], rdv, old_layout="dp=2",
                                      old_devices=[0, 1])) == grpc.StatusCode.FAILED_PRECONDITION
    # a checkpoint of a generation that is not running, and one with nowhere to go (this
    # worker has no --checkpoint-dir): refused, and training goes on
    assert code_of(lambda: c0.checkpoint(7)) == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(AgentCallError, match="no checkpoint directory") as e:
        c0.checkpoint(1, stop=True)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with grpc.insecure_channel(c0.address) as ch:
        for method in ("Prepare", "Commit", "Abort", "Status", "Checkpoint"):
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary(f"/dynatrain.agent.v1.Agent/{method}")(
                    b"\xff\xff garbage", metadata=bearer_metadata(token), timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _wait_steps(c0, 2)
    st = c0.status(since_step=before)
    assert st.state == agent_pb2.StatusResponse.TRAINING and not st.error
    assert [r.step for r in st.steps] == list(range(before + 1, st.steps[-1].step + 1))
    assert procs[0].poll() is None

    # ...and a proper two-phase switch still works: device 1 joins, then device 0 leaves.
    two = parse_layout("dp=2").with_devices([0, 1])
    rec = switch(clients, 2, one, two, rdv, reason="scale-up")
    assert rec.result == "success" and rec.bytes > 0
    _wait_steps(clients[1], 2)
    only1 = parse_layout("dp=1").with_devices([1])
    rec = switch(clients, 3, two, only1, rdv, reason="preemption")
    assert rec.bytes == 0          # device 1 already holds the whole replica: nothing moves
    assert clients[0].status().state == agent_pb2.StatusResponse.LEFT
    assert procs[0].wait(15) == 0  # the leaver exits cleanly after its last Status was read
    _wait_steps(clients[1], 2)


def test_sigterm_is_a_notice_the_worker_trains_on_and_leaves_when_switched_out(workers):
    # On Kubernetes every planned removal arrives as SIGTERM with a grace period: a member
    # must not stop (that would be a failure) but say it is leaving and train on until a
    # switch takes it out; then it exits 0. A standby worker stops at once.
    clients, rdv, token, procs = workers
    c0, c1 = clients[0], clients[1]
    two = parse_layout("dp=2").with_devices([0, 1])
    switch(clients, 1, None, two, rdv, reason="start")
    _wait_steps(c0, 2)
    assert not c0.status().leaving
    procs[0].send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not c0.status().leaving:
        assert time.monotonic() < deadline, "the worker did not report that it is leaving"
        time.sleep(0.05)
    st = c0.status()
    assert 0 < st.leaving_in_seconds <= 30          # its --grace-seconds (the default 30)
    _wait_steps(c0, 3)                              # ...and it trains on meanwhile
    assert procs[0].poll() is None
    only1 = parse_layout("dp=1").with_devices([1])
    rec = switch(clients, 2, two, only1, rdv, reason="preemption")
    assert rec.result == "success"
    assert procs[0].wait(15) == 0                   # out of the job: it exits cleanly
    _wait_steps(c1, 2)


def test_a_checkpoint_with_stop_is_written_at_one_agreed_step_and_training_stops(
        checkpointing_workers, tmp_path):
    # A suspend: every rank writes its part at the same boundary (agreed through the step's
    # own all-reduce, whatever step each rank's call arrived at), answers with the same
    # path and step, trains no further, and exits at once when told to leave.
    clients, rdv, token, procs = checkpointing_workers
    two = parse_layout("dp=2").with_devices([0, 1])
    switch(clients, 1, None, two, rdv, reason="start")
    _wait_steps(clients[0], 3)
    with pytest.raises(AgentCallError) as e:
        clients[0].checkpoint(2, stop=True)            # generation 2 does not run
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(clients[0].checkpoint, 1, stop=True, timeout_s=60)
        time.sleep(0.3)                                # the second call arrives steps later
        second = pool.submit(clients[1].checkpoint, 1, stop=True, timeout_s=60)
        replies = [first.result(90), second.result(90)]
    assert replies[0].step == replies[1].step > 3
    assert replies[0].path == replies[1].path
    written = Path(replies[0].path)
    assert written.is_relative_to(tmp_path / "checkpoints") and (written / ".metadata").exists()
    time.sleep(1.0)
    for c in clients.values():
        st = c.status()
        assert st.state == agent_pb2.StatusResponse.SUSPENDED
        assert st.step == replies[0].step                # no step after the checkpoint
        assert (st.checkpoint, st.checkpoint_step) == (replies[0].path, replies[0].step)
    with pytest.raises(AgentCallError) as e:            # suspended: nothing more to write
        clients[0].checkpoint(1)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    for p in procs:
        p.send_signal(signal.SIGTERM)                  # a suspended worker has nothing to
    for p in procs:                                    # hand over: it stops at once
        assert p.wait(15) == 0


# Well above a gpt-tiny step on one CPU thread (~0.1 s), even on a loaded machine.
FLOOR_S = 2.0


@pytest.fixture
def paced_workers(tmp_path):
    yield from _workers(tmp_path, "--min-step-seconds", str(FLOOR_S))


def test_a_step_floor_idles_between_steps_and_a_switch_still_goes_through(paced_workers):
    # `--min-step-seconds` (the dev cluster's CPU stand-ins for GPUs): steps end at least the
    # floor apart, while each step's own time, which the metrics and the cost model read,
    # stays its own (a gpt-tiny step on one CPU thread takes well under the floor).
    clients, rdv, token, procs = paced_workers
    c0 = clients[0]
    one = parse_layout("dp=1").with_devices([0])
    switch({0: c0}, 1, None, one, rdv, reason="start")
    _wait_steps(c0, 1)
    first = c0.status().step
    _wait_steps(c0, 4)
    records = list(c0.status(since_step=first).steps)
    assert len(records) >= 4, records
    # The floor runs from one step's start to the next one's (a step's end minus its time);
    # ends alone may come closer, after a slow step and a fast one.
    starts = [r.end_time - r.seconds for r in records]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert min(gaps) >= FLOOR_S - 0.05, gaps
    assert min(r.seconds for r in records) < FLOOR_S / 2, [r.seconds for r in records]
    two = parse_layout("dp=2").with_devices([0, 1])
    rec = switch(clients, 2, one, two, rdv, reason="scale-up")
    assert rec.result == "success"
    _wait_steps(clients[1], 2)


def test_a_step_floor_out_of_range_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dynatrain", "worker", "--job",
                           str(ROOT / "examples" / "quickstart.yaml"), "--device", "0",
                           "--min-step-seconds", "-1"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "--min-step-seconds -1.0 is invalid; expected 0 (none) to 60" in proc.stderr
