"""The operator's side of a pool shared between jobs (operator/sharing.py), without processes or
a cluster: each job's claim from its worker pods, the share it reads back from one board, the
``Share`` condition and Events that say it, the hysteresis, and the pool a template makes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import yaml

from dynatrain.operator import sharing
from dynatrain.operator.basics import JobContext, Settings
from dynatrain.operator.cluster import WorkerPod
from dynatrain.operator.status import Conditions
from dynatrain.spec.job import job_from_manifest

ROOT = Path(__file__).resolve().parents[2]


def _job(name: str, created: str, lo: int = 2, hi: int = 4) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "dev-job.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                       "creationTimestamp": created}
    doc["spec"]["elastic"] = {"minWorkers": lo, "maxWorkers": hi}
    return doc


class Job:
    """One job as the operator's runtime holds it, reduced to what its share reads."""

    def __init__(self, board, name, created, started=False, **kw):
        self.body = _job(name, created, **kw)
        self.spec = job_from_manifest(self.body)
        self.conditions, self.events = Conditions(), []
        self.layout = object() if started else None
        ctx = JobContext(core=None, namespace="ns", name=name, uid=f"uid-{name}",
                         settings=Settings(), log=lambda _: None,
                         event=lambda *e: self.events.append(e), conditions=self.conditions,
                         job=lambda: self.spec, body=lambda: self.body, generation=lambda: 1,
                         controller=lambda: SimpleNamespace(layout=self.layout))
        self.share = sharing.JobShare(ctx, board=board, priorities=None)
        self.pods = SimpleNamespace(wanted=lambda: self.spec.max_workers, left=set())

    def update(self, placed: int, waiting: int = 0):
        workers = {d: WorkerPod(f"w{d}", d, "node-a", "127.0.0.1", "Running", False, 0.0)
                   for d in range(placed)}
        for d in range(placed, placed + waiting):
            workers[d] = WorkerPod(f"w{d}", d, None, None, "Pending", False, 0.0,
                                   unschedulable="0/3 nodes are available: 3 Insufficient "
                                                 "nvidia.com/gpu")
        return self.share.update(workers, self.pods)


def test_a_job_over_its_share_is_told_and_the_waiting_one_sees_the_contention():
    board = sharing.Board()
    a = Job(board, "a", "2026-11-26T10:00:00Z", started=True)
    b = Job(board, "b", "2026-11-26T10:01:00Z", started=True)
    assert not a.update(placed=4).contended               # alone: no bound
    assert a.conditions.get("Share")["reason"] == "Uncontended"
    share_b = b.update(placed=2, waiting=2)
    assert share_b.contended and share_b.workers == 3
    share_a = a.update(placed=4)
    assert share_a.contended and share_a.workers == 3 and share_a.cap(4) == 3
    cond = a.conditions.get("Share")
    assert (cond["status"], cond["reason"]) == ("False", "OverShare")
    assert "share 3 workers (3 GPUs) of the 6 GPUs its pool's 2 jobs hold" in cond["message"]
    assert [e[1] for e in a.events] == ["OverShare"]
    assert "gives back 1 workers" in a.events[0][2]
    assert b.conditions.get("Share")["reason"] == "WithinShare"


def test_a_job_whose_minimum_does_not_fit_waits_holding_nothing():
    board = sharing.Board()
    a = Job(board, "a", "2026-11-26T10:00:00Z", lo=3)
    b = Job(board, "b", "2026-11-26T10:01:00Z", lo=3)
    a.update(placed=2, waiting=1)
    share = b.update(placed=2, waiting=1)
    assert share.workers == 0 and share.cap(4) == 0
    cond = b.conditions.get("Share")
    assert (cond["status"], cond["reason"]) == ("False", "WaitingForShare")
    assert [e[1] for e in b.events] == ["WaitingForShare"]


def test_the_share_binds_a_while_after_the_contention_ends(monkeypatch):
    board = sharing.Board()
    a = Job(board, "a", "2026-11-26T10:00:00Z", started=True)
    b = Job(board, "b", "2026-11-26T10:01:00Z", started=True)
    now = [1000.0]
    monkeypatch.setattr(sharing.time, "monotonic", lambda: now[0])
    b.update(placed=2, waiting=2)
    assert a.update(placed=4).contended
    b.update(placed=3)                                     # b got its GPU: nobody waits
    now[0] += 1.0
    assert a.update(placed=3).contended                    # still bound (hysteresis)
    now[0] += sharing.SHARE_HOLD_S
    assert not a.update(placed=3).contended


def test_a_gpu_let_go_stays_the_pools_while_the_waiting_pod_is_placed(monkeypatch):
    """A and B shrink from 3 to 2 for C. For a moment C has one pod placed and the other not
    yet on the GPU just freed (5 held): the board still divides the 6 GPUs the pool held
    within SHARE_HOLD_S, so C keeps its share. Once the 6th GPU stays gone that long (a node
    lost), C's gang no longer fits."""
    board = sharing.Board()
    now = [1000.0]
    monkeypatch.setattr(sharing.time, "monotonic", lambda: now[0])
    a = Job(board, "a", "2026-11-26T10:00:00Z", started=True)
    b = Job(board, "b", "2026-11-26T10:01:00Z", started=True)
    c = Job(board, "c", "2026-11-26T10:02:00Z")
    a.update(placed=3)
    b.update(placed=3)
    assert c.update(placed=0, waiting=4).workers == 2
    assert a.update(placed=3).cap(4) == 2                  # OverShare: a shrinks live
    now[0] += 5.0
    a.update(placed=2)
    b.update(placed=2)
    share = c.update(placed=1, waiting=1)                  # 5 held: the 6th is being placed
    assert share.workers == 2 and share.contended
    assert c.conditions.get("Share")["reason"] == "WithinShare"
    assert a.update(placed=2).cap(4) == 2                  # a does not grow into it
    now[0] += sharing.SHARE_HOLD_S + 1
    a.update(placed=2)
    b.update(placed=2)
    # 5 for that long: a GPU was lost. C's gang no longer fits; nobody waits below a share,
    # so nothing binds (C's pending pod is demand an autoscaler sees).
    share = c.update(placed=1, waiting=1)
    assert share.workers == 0 and not share.contended


def test_ended_and_silent_jobs_leave_the_board(monkeypatch):
    board = sharing.Board()
    a = Job(board, "a", "2026-11-26T10:00:00Z", started=True)
    b = Job(board, "b", "2026-11-26T10:01:00Z", started=True)
    a.update(placed=4)
    b.update(placed=2, waiting=2)
    b.share.drop()
    assert [c.job for c in board.claims()] == ["ns/a"]
    now = sharing.time.monotonic() + sharing.STALE_S + 1
    monkeypatch.setattr(sharing.time, "monotonic", lambda: now)
    b.update(placed=1)
    assert [c.job for c in board.claims()] == ["ns/b"]    # a's claim went stale


def test_the_pool_is_the_placement_and_the_gpus_per_worker():
    base = {"resources": {"gpus": 1}}
    placed = {**base, "template": {"spec": {"nodeSelector": {"pool": "h100"},
                                            "priorityClassName": "low"}}}
    assert sharing.pool_of(base) == sharing.pool_of({"resources": {"gpus": 1},
                                                     "template": {"metadata": {}}})
    assert sharing.pool_of(placed) != sharing.pool_of(base)
    # The priority class is not the pool: jobs of different priorities compete.
    assert sharing.pool_of(placed) == sharing.pool_of(
        {**base, "template": {"spec": {"nodeSelector": {"pool": "h100"}}}})
    assert sharing.pool_of({"resources": {"gpus": 8}}) != sharing.pool_of(base)
