"""The controller's rendezvous store (:mod:`dynatrain.controller.rendezvous`) and the workers'
torch side of it (:class:`dynatrain.agent.store.RendezvousStore`).

torch's own ``TCPStore`` is the reference: the same operations on both give the same answers,
and c10d builds gloo groups through ours in worker processes (``init_process_group``,
``new_group``, a ``PrefixStore`` per generation, as the worker does). The rest pins what a
user meets when it goes wrong: a wait that times out names its key, an unreachable store is an
error naming its address within the timeout, a malformed request is INVALID_ARGUMENT.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from datetime import timedelta

import grpc
import pytest
import torch
import torch.distributed as dist

from dynatrain.agent.store import RendezvousStore, StoreError
from dynatrain.agent.v1 import agent_pb2, agent_pb2_grpc
from dynatrain.controller.rendezvous import MAX_KEY, RendezvousServer
from dynatrain.ports import free_port


@pytest.fixture
def server():
    s = RendezvousServer("127.0.0.1")
    yield s
    s.close()


def _script(store) -> list:
    """One sequence of store operations and what each answered."""
    out = []
    store.set("a", b"1")
    out.append(store.get("a"))
    store.set("a", "text")                       # a str value is its UTF-8 bytes
    out.append(store.get("a"))
    out.append(store.add("n", 3))
    out.append(store.add("n", -1))
    out.append(store.get("n"))                   # a counter reads as its decimal text
    out.append(store.compare_set("c", b"", b"first"))        # missing, expected empty: set
    out.append(store.compare_set("c", b"wrong", b"second"))  # held, not expected: unchanged
    out.append(store.compare_set("c", b"first", b"second"))  # held as expected: set
    out.append(store.compare_set("m", b"x", b"y"))           # missing, expected given
    out.append(store.check(["a", "n"]))
    out.append(store.check(["a", "missing"]))
    store.wait(["a", "c"], timedelta(seconds=1))
    out.append(store.delete_key("a"))
    out.append(store.delete_key("a"))
    out.append(store.check(["a"]))
    return out


def test_the_operations_answer_as_torchs_tcpstore_does(server):
    ours = RendezvousStore("127.0.0.1", server.port, timeout=timedelta(seconds=5))
    reference = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=5))
    got, want = _script(ours), _script(reference)
    assert got == want
    assert got[0] == b"1" and got[4] == b"2" and got[-1] is False
    # our store counts exactly the keys the script left (a, deleted; n, c)
    assert ours.num_keys() == 2


def test_through_a_prefix_store_as_c10d_calls_it_every_operation_answers(server):
    """c10d calls a Python store from C++ (by its C++ names: getNumKeys, deleteKey) and clones
    it for threads of its own; the clone must be the same object, which the worker keeps alive
    (agent/store.py, "Lifetime")."""
    ours = RendezvousStore("127.0.0.1", server.port, timeout=timedelta(seconds=5))
    reference = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=5))
    answers = []
    for store in (dist.PrefixStore("gen7", ours), dist.PrefixStore("gen7", reference)):
        store.set("a", "1")
        answers.append([store.add("n", 5), store.check(["a", "n"]), store.delete_key("a"),
                        store.check(["a"]), store.compare_set("c", "", "x"),
                        store.multi_get(["n", "c"])])
        store.wait(["n"], timedelta(seconds=1))
    assert answers[0] == answers[1] == [5, True, True, False, b"x", [b"5", b"x"]]
    assert dist.PrefixStore("gen7", ours).num_keys() == 2           # n and c, under gen7/
    assert ours.clone() is ours
    ours.set_timeout(timedelta(seconds=1))                           # as c10d may
    with pytest.raises(StoreError, match="within 1 s"):
        ours.get("never")


def test_a_get_waits_for_the_key_and_a_missing_one_times_out_naming_it(server):
    store = RendezvousStore("127.0.0.1", server.port, timeout=timedelta(seconds=1))
    other = RendezvousStore("127.0.0.1", server.port, timeout=timedelta(seconds=5))
    threading.Timer(0.3, other.set, args=("late", b"here")).start()
    t0 = time.monotonic()
    assert store.get("late") == b"here"
    assert 0.2 < time.monotonic() - t0 < 1.0
    with pytest.raises(StoreError, match=r"Get 'never'.*DEADLINE_EXCEEDED.*'never' was not "
                                         r"set within 1 s"):
        store.get("never")
    with pytest.raises(StoreError, match=r"Wait.*\['gone'\] were not set within 0.2 s"):
        store.wait(["late", "gone"], timedelta(seconds=0.2))


def test_an_unreachable_store_is_an_error_naming_it():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"127.0.0.1:{port} did not answer within 1 s"):
        RendezvousStore("127.0.0.1", port, timeout=timedelta(seconds=1))
    assert time.monotonic() - t0 < 5


def test_malformed_requests_are_invalid_argument(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = agent_pb2_grpc.RendezvousStub(channel)
        for method, req, text in [
                ("Set", agent_pb2.StoreRequest(key=""), "key is empty"),
                ("Set", agent_pb2.StoreRequest(key="k" * (MAX_KEY + 1)), "over the limit"),
                ("Get", agent_pb2.StoreRequest(key="k", timeout_s=-1), "timeout_s=-1"),
                ("Wait", agent_pb2.StoreRequest(keys=["k"], timeout_s=float("nan")),
                 "timeout_s=nan"),
                ("Wait", agent_pb2.StoreRequest(keys=["k", ""]), "a key is empty")]:
            with pytest.raises(grpc.RpcError) as e:
                getattr(stub, method)(req, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, req)
            assert text in e.value.details(), e.value.details()
        stub.Set(agent_pb2.StoreRequest(key="n", value=b"abc"), timeout=5)
        with pytest.raises(grpc.RpcError) as e:
            stub.Add(agent_pb2.StoreRequest(key="n", amount=1), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "holds b'abc', not a counter" in e.value.details()


def _rank(rank: int, world: int, port: int, out) -> None:
    store = RendezvousStore("127.0.0.1", port, timeout=timedelta(seconds=30))
    # as the worker does: a generation's groups under their own prefix
    pg = dist.ProcessGroupGloo(dist.PrefixStore("generation-1", store), rank, world,
                               timedelta(seconds=30))
    t = torch.full((3,), float(rank + 1))
    pg.allreduce([t]).wait()
    dist.init_process_group("gloo", store=dist.PrefixStore("generation-2", store),
                            rank=rank, world_size=world)
    pair = dist.new_group([0, 1])
    x = torch.tensor([float(rank)])
    if rank < 2:
        dist.all_reduce(x, group=pair)
    dist.barrier()
    dist.destroy_process_group()
    out.put((rank, t.tolist(), x.item()))


def test_gloo_groups_are_built_through_it_by_worker_processes(server):
    world = 3
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, server.port, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=120) for _ in range(world))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * world
    assert results == [(0, [6.0] * 3, 1.0), (1, [6.0] * 3, 1.0), (2, [6.0] * 3, 2.0)]
