"""The elastic job's last-resort checkpoint: saved without a default process group, resumed exactly.

Workers build their groups the way the elastic device manager does (``ProcessGroupGloo`` on a
``PrefixStore`` of one rendezvous store, through :class:`DeviceManager`) and never call
``init_process_group``. They train, save periodically with :func:`save_checkpoint`, and the
checkpoint is then loaded under other layouts (bit-exact against the full state the ranks held)
and by fresh processes under the same layout, whose next step must give exactly the loss the
uninterrupted run gave.
"""

import io
import os
import queue as queue_mod
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dynatrain.trainer import processes
from dynatrain.trainer.checkpoint import (CheckpointError, _phase, latest_checkpoint,
                                          load_state, save_checkpoint, save_state)
from dynatrain.trainer.config import make_config
from dynatrain.trainer.groups import ParallelGroups, build_groups
from dynatrain.trainer.state import assemble_full
from dynatrain.trainer.trainer import LocalState, Trainer
from dynatrain.vps.generations import DeviceManager
from dynatrain.vps.layout import bind, parse_layout

KW = dict(global_batch_size=8, seq_len=16)
SAVES = (3, 5)
TIMEOUT = timedelta(seconds=60)


def _groups(rank, world, port, cfg, generation):
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=TIMEOUT)
    mgr = DeviceManager(store, rank, timeout=TIMEOUT)
    layout = cfg.layout.with_devices(range(world))
    groups = build_groups(bind(layout, cfg.model), rank, mgr.group_factory(generation, layout))
    assert not dist.is_initialized()                  # the point: no default process group
    return store, groups


def _put(results, obj):
    # Bytes, not tensors: a queued tensor is a shared-memory handle that dies with its process.
    buf = io.BytesIO()
    torch.save(obj, buf)
    results.put(buf.getvalue())


def _cpu(st: LocalState) -> LocalState:
    return LocalState({k: (t.detach().cpu().clone(), p) for k, (t, p) in st.tensors.items()},
                      st.step, st.data_position, {k: v.clone() for k, v in st.rng.items()})


def _train_worker(rank, world, port, cfg, root, resume_here, results):
    torch.set_num_threads(1)
    _store, groups = _groups(rank, world, port, cfg, 0)
    trainer = Trainer(cfg, groups)
    out = {"rank": rank, "saves": []}
    for step in range(1, max(SAVES) + 1):
        trainer.train_step()
        if step in SAVES:
            saved = save_checkpoint(trainer.local_state(), cfg.model, root, group=groups.world,
                                    group_rank=rank, group_size=world, keep=1)
            out["saves"].append((saved.step, saved.path, saved.seconds, saved.bytes_written,
                                 sorted(os.listdir(root))))
    st = _cpu(trainer.local_state())
    out["state"] = st
    out["loss_next"] = trainer.train_step().loss      # the uninterrupted run's next step
    if resume_here:      # a new trainer on the same groups, from the checkpoint alone
        path, _ = latest_checkpoint(root)
        again = Trainer(cfg, groups, state=load_state(bind(cfg.layout, cfg.model), rank, path))
        r = again.train_step()
        out["resumed"] = (r.step, r.loss)
    # Ranks that disagree on the step are refused on every rank, and nothing is renamed.
    bad = LocalState(st.tensors, st.step + 10 * rank, st.data_position, st.rng)
    try:
        save_checkpoint(bad, cfg.model, root, group=groups.world, keep=1)
        out["disagree"] = None
    except CheckpointError as e:
        out["disagree"] = str(e)
    # A rank whose part of a phase raises makes every rank raise, naming it; a rank reads only
    # the results it keeps, and its own.
    def part():
        if rank == world - 1:
            raise OSError("disk full")
        return rank
    try:
        _phase(groups.world, "test", part)
        out["raised"] = None
    except CheckpointError as e:
        out["raised"] = str(e)
    out["kept"] = _phase(groups.world, "keep", lambda: [rank, str(rank)], keep=lambda r: r == 0)
    _put(results, out)


def _resume_worker(rank, world, port, cfg, path, results):
    torch.set_num_threads(1)
    _store, groups = _groups(rank, world, port, cfg, 0)
    trainer = Trainer(cfg, groups, state=load_state(bind(cfg.layout, cfg.model), rank, path))
    r = trainer.train_step()
    _put(results, {"rank": rank, "step": r.step, "loss": r.loss})


def _spawn(fn, world, *args):
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                          timeout=TIMEOUT)
    results = processes.context().Queue()
    procs = processes.start_ranks(fn, args=(world, store.port, *args, results), nprocs=world)
    out, deadline = [], time.monotonic() + 120
    while len(out) < world:
        try:
            out.append(torch.load(io.BytesIO(results.get(timeout=1.0)), weights_only=False))
        except queue_mod.Empty:
            dead = [p.exitcode for p in procs.processes if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                try:
                    procs.join(timeout=1)       # raises with the failed worker's traceback
                finally:
                    for p in procs.processes:
                        p.kill()
                pytest.fail(f"workers timed out (exit codes {dead})")
    procs.join(timeout=60)
    return sorted(out, key=lambda o: o["rank"])


def _full_equal(a, b, what):
    assert a.tensors.keys() == b.tensors.keys(), what
    for key in a.tensors:
        assert torch.equal(a[key], b[key]), (what, key)
    assert (a.step, a.data_position) == (b.step, b.data_position), what


# The 2-rank case restarts in fresh processes, as a job does; the 4-rank case resumes in the
# same processes (a new trainer from the checkpoint alone) to keep this file fast on 2 cores.
@pytest.mark.parametrize("layout_a, layouts_b, restart", [
    ("dp=2,zero=1", ["tp=2", "dp=1", "dp=2,pp=2,zero=3"], True),
    ("tp=2,pp=2", ["dp=2,zero=1", "dp=4,zero=3"], False),
])
def test_checkpoint_without_default_group_reshards_and_resumes_exactly(tmp_path, layout_a,
                                                                       layouts_b, restart):
    cfg = make_config("gpt-tiny", layout_a, **KW)
    world = cfg.layout.world
    root = tmp_path / "ckpt"
    ranks = _spawn(_train_worker, world, cfg, str(root), not restart)

    # Periodic saves with keep=1: after step 5 only step 5 is left, complete and found.
    for r in ranks:
        assert [s[0] for s in r["saves"]] == list(SAVES)
        assert r["saves"][0][4] == ["step-00000003"]
        assert r["saves"][1][4] == ["step-00000005"]
    path, step = latest_checkpoint(root)
    assert (path, step) == (ranks[0]["saves"][1][1], 5)
    assert os.path.basename(path) == "step-00000005"
    for r in ranks:
        assert r["disagree"] is not None and "ranks disagree" in r["disagree"], r["disagree"]
        assert r["raised"] == (f"checkpoint test failed on rank {world - 1}: OSError: disk "
                               "full"), r["raised"]
        assert r["kept"] == [[i, str(i)] if i in (0, r["rank"]) else None
                             for i in range(world)], r["kept"]
    assert [e for e in os.listdir(root) if e.startswith("step-")] == ["step-00000005"]
    assert latest_checkpoint(root) == (path, 5)        # the refused save left nothing behind

    # Under other layouts: the full state read back equals the one the ranks held, bit for bit.
    held = [r["state"] for r in ranks]
    full_a = assemble_full(cfg.model, held)
    assert (full_a.step, full_a.data_position) == (5, 5 * KW["global_batch_size"])
    for text in [layout_a] + layouts_b:
        bound = bind(parse_layout(text), cfg.model)
        loaded = [load_state(bound, r, path) for r in range(bound.layout.world)]
        _full_equal(assemble_full(cfg.model, loaded), full_a, text)
        for r, st in enumerate(loaded):                 # rank r resumes with saved rank r's RNG
            assert torch.equal(st.rng["cpu"], held[r % world].rng["cpu"]), (text, r)
    assert any(s[3] > 0 for s in ranks[0]["saves"])

    # Under layout A again, from the checkpoint alone: step 6 is the uninterrupted step 6.
    expected = ranks[0]["loss_next"]
    if restart:
        resumed = [(r["step"], r["loss"]) for r in _spawn(_resume_worker, world, cfg, path)]
    else:
        resumed = [r["resumed"] for r in ranks]
    assert resumed == [(6, expected)] * world, (resumed, expected)


def _single_rank():
    cfg = make_config("gpt-tiny", "dp=1", **KW)
    trainer = Trainer(cfg, ParallelGroups(rank=0, pp_index=0, dp_index=0, tp_index=0))
    trainer.train_step()
    return cfg, trainer


def test_an_interrupted_save_is_ignored_and_cleaned_up(tmp_path):
    cfg, trainer = _single_rank()
    root = tmp_path / "ckpt"
    assert latest_checkpoint(root) is None                     # nothing saved yet
    first = save_checkpoint(trainer.local_state(), cfg.model, root)
    assert first.path == str(root / "step-00000001") and os.fspath(first) == first.path
    assert first.seconds > 0 and first.bytes_written > 0
    # A crash mid-save of step 2: a temporary directory with data files and even a .metadata.
    crashed = root / ".step-00000002.tmp"
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"partial")
    (crashed / ".metadata").write_bytes(b"partial")
    (root / "step-00000009").mkdir()                           # not ours: no .metadata
    assert latest_checkpoint(root) == (first.path, 1)
    trainer.train_step()
    second = save_checkpoint(trainer.local_state(), cfg.model, root, keep=2)
    assert latest_checkpoint(root) == (second.path, 2)
    assert not crashed.exists()                                # the leftover is pruned
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002", "step-00000009"]
    st = load_state(bind(cfg.layout, cfg.model), 0, second.path)
    assert (st.step, st.data_position) == (2, 2 * KW["global_batch_size"])


def test_resuming_from_an_earlier_checkpoint_drops_the_abandoned_later_ones(tmp_path):
    cfg, trainer = _single_rank()
    root = tmp_path / "ckpt"
    early = trainer.local_state()
    save_checkpoint(early, cfg.model, root)
    for _ in range(2):
        trainer.train_step()
        save_checkpoint(trainer.local_state(), cfg.model, root, keep=5)
    assert latest_checkpoint(root)[1] == 3
    save_checkpoint(early, cfg.model, root, keep=5)           # step 1 again, after a rollback
    assert sorted(os.listdir(root)) == ["step-00000001"]
    assert latest_checkpoint(root) == (str(root / "step-00000001"), 1)


def test_bad_arguments_and_roots_are_named(tmp_path):
    cfg, trainer = _single_rank()
    st = trainer.local_state()
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    with pytest.raises(NotADirectoryError, match="exists but is not a directory"):
        latest_checkpoint(not_dir)
    with pytest.raises(CheckpointError, match="rank 0: NotADirectoryError"):
        save_checkpoint(st, cfg.model, not_dir)
    with pytest.raises(ValueError, match=r"keep=0: must be an integer >= 1"):
        save_checkpoint(st, cfg.model, tmp_path / "a", keep=0)
    with pytest.raises(ValueError, match="group_size=2 but group is None"):
        save_checkpoint(st, cfg.model, tmp_path / "a", group_size=2)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_state(bind(cfg.layout, cfg.model), 0, tmp_path / "nothing")


def test_a_checkpoint_without_rng_still_loads(tmp_path):
    """Checkpoints written before the RNG was saved (save_state of a state without one)."""
    cfg, trainer = _single_rank()
    st = trainer.local_state()
    old = LocalState(st.tensors, st.step, st.data_position)       # no rng
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single")
        save_state(old, cfg.model, str(tmp_path / "old"))
    back = load_state(bind(cfg.layout, cfg.model), 0, str(tmp_path / "old"))
    assert back.rng == {} and (back.step, back.data_position) == (st.step, st.data_position)
    for key, (t, _) in st.tensors.items():
        assert torch.equal(back.tensors[key][0], t), key
