"""``nccl-sim`` behaves like ProcessGroupNCCL where recovery depends on it (see
:mod:`dynatrain.vps.ncclsim`): each test names the behaviour it follows. Real processes, one per
rank, over loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dynatrain.ports import free_port as _port

RANKS = Path(__file__).resolve().parents[1] / "harness" / "ncclsim_ranks.py"


def run(name: str, world: int = 2, env: dict | None = None, timeout: float = 60):
    port = _port()
    procs = [subprocess.Popen([sys.executable, str(RANKS), name, str(r), str(world), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **(env or {})})
             for r in range(world)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        last = stdout.strip().splitlines()[-1] if stdout.strip() else "null"
        out.append({"code": p.returncode, "result": json.loads(last), "stderr": stderr})
    return out


def test_wait_returns_at_once_and_the_host_sync_blocks():
    # WorkNCCL::wait only makes the stream wait; the host blocks at a sync of the result.
    r0 = run("wait_does_not_block")[0]
    res = r0["result"]
    # the peer joins 1 s later: wait() returned with the op not done; the sync waited for it
    assert res["completed_after_wait"] is False, res
    assert res["synced"] > 0.8 and res["value"] == [3.0] * 4, res


def test_a_dead_peer_hangs_until_the_watchdog_takes_the_process_down():
    # TORCH_NCCL_ASYNC_ERROR_HANDLING unset: torch's default 3 (SkipCleanUp) aborts the
    # process when an op passes its timeout, where gloo would have failed the op at once.
    r0 = run("dead_peer", env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": ""})[0]
    assert r0["code"] == -6, r0                     # SIGABRT, as std::abort
    assert "[nccl-sim watchdog] allreduce" in r0["stderr"] and "=3" in r0["stderr"]


def test_clean_up_only_aborts_the_communicator_and_the_process_lives():
    r0 = run("dead_peer", env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"})[0]
    assert r0["code"] == 0, r0
    res = r0["result"]
    assert "watchdog aborted the communicator" in res["raised"] and res["after"] > 1.9


def test_abort_frees_a_host_sync_stuck_on_a_dead_peer():
    r0 = run("abort_frees_the_sync")[0]
    res = r0["result"]
    # ended by the abort, not by the watchdog (its timeout is 60 s)
    assert "ncclCommAbort" in res["raised"] and res["after"] > 0.4, res


def test_communicators_are_made_at_first_use_unless_made_eagerly():
    res = run("lazy_setup")[0]["result"]
    # without device_id: nothing when the group is made, the cost in the first collective
    # (counted, and the first call pays the cost: a lower bound, which load cannot break)
    assert res["setups_when_made"] == 0 and res["setups_after_first"] == 1, res
    assert res["first"] >= 0.3, res
    # eagerly (device_id, eager_connect_single_device): when made, not at first use
    assert res["eager_made"] >= 0.3 and res["setups_when_eager_made"] == 2, res
    assert res["setups"] == 2 and res["setup_seconds"] == pytest.approx(0.6)


@pytest.mark.parametrize("name, mismatch", [("order_matched", False),
                                            ("order_mismatched", True)])
def test_the_recorder_finds_a_pair_posted_in_different_orders(name, mismatch):
    r1 = run(name)[1]["result"]
    if mismatch:
        assert "message 0 from rank 0 to rank 1 was posted as 16 bytes, tag 1 by the sender " \
            "and 32 bytes, tag 2 by the receiver" in r1["mismatch"], r1
    else:
        assert r1["mismatch"] is None


def test_a_mismatch_is_named_at_its_first_message_whichever_receive_ends_first():
    # With tags that gloo matches, a pair posted in swapped orders ends its receives in
    # either order; the watchdog may check the second before the first has ended. The
    # recorder must still name message 0 (the CI run of 667fb17 saw "message 1").
    from datetime import timedelta

    import torch.distributed as dist

    from dynatrain.vps.ncclsim import OrderMismatch, SimProcessGroup

    pg = SimProcessGroup(dist.PrefixStore("p", dist.HashStore()), 0, 1, timedelta(seconds=5))
    first = pg._receive_check(0, 32, 2)          # the receiver posted 32 bytes first ...
    second = pg._receive_check(0, 16, 1)
    pg._record_send(0, 16, 1)                    # ... the sender 16 bytes first
    pg._record_send(0, 32, 2)
    with pytest.raises(OrderMismatch, match="message 0 from rank 0 to rank 0 was posted as "
                       "16 bytes, tag 1 by the sender and 32 bytes, tag 2 by the receiver"):
        second()                                 # the later receive ended first
    first()                                      # already checked: nothing left to raise


def test_prepare_warms_up_every_pair_in_one_global_order_without_a_deadlock():
    # ProcessGroupNCCL makes a pair's communicator at the pair's first send/recv
    # (getNCCLComm keyed by the pair); DeviceManager._connect exchanges one message per pair
    # in Prepare (vps.generations.warm_up_pairs). Here a full mesh of 4 ranks, each send
    # blocking until its receive is posted: it ends, in one order the recorder accepts.
    res = run("warm_up_mesh", world=4, env={"DYNATRAIN_NCCL_SIM_SETUP_SECONDS": "0.1"})
    for r, got in enumerate(res):
        assert got["code"] == 0, got["stderr"][-2000:]
        out = got["result"]
        assert out["mismatch"] is None, out
        assert out["made"] == 3 and out["made_after"] == 3, out   # 3 pairs each, no more
        assert out["got"] == [float(r ^ 1 if r % 2 else r)] * 2
        assert "at first use" not in got["stderr"]


def test_a_switched_away_generations_nccl_groups_are_shut_down_and_gloos_left_to_drop():
    # The worker hands the old generation's groups to trainer.groups.shut_down after the next
    # step, on its training thread (ProcessGroupNCCL.shutdown destroys the communicators;
    # doing that on a freeing thread could race the kernels being launched). nccl-sim's
    # shutdown aborts, so any later use of an old group raises.
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from dynatrain.trainer.groups import ParallelGroups, shut_down
    from dynatrain.vps.ncclsim import SimNcclError, SimProcessGroup

    store = dist.HashStore()
    sim = SimProcessGroup(dist.PrefixStore("a", store), 0, 1, timedelta(seconds=5), name="dp")
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("b", store), 0, 1, timedelta(seconds=5))
    groups = ParallelGroups(rank=0, pp_index=0, dp_index=0, tp_index=0, dp=sim, world=sim,
                            tp=gloo)
    assert shut_down(groups) == 1           # the one sim group (twice in it), not gloo's
    with pytest.raises(SimNcclError, match="shut down"):
        sim.allreduce([torch.ones(1)])
    work = gloo.allreduce([torch.ones(1)])  # gloo's is untouched until dropped
    work.wait()
    assert shut_down(None) == 0
