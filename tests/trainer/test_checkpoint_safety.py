"""Checkpoints from outside run no code, stay in their job's folder, and load only from the roots.

A checkpoint's files are written by whoever can write the volume, and its path may come from a
Prepare or ``spec.recovery.resumeFrom``. These tests plant what such a writer could: a
``.metadata`` pickle that runs a command when unpickled (shown to run under plain ``pickle``,
then refused by every loader before it runs), a data file outside the checkpoint, a pickled
``BytesIO`` item. They check that two jobs sharing one root keep their own steps, that paths
outside the job's roots are refused, and that the plain formats that replaced our own pickles
(JSON for the ranks' save plans, safetensors + JSON for a rank's state) round-trip exactly.
"""

from __future__ import annotations

import os
import pickle
import shlex

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from dynatrain.trainer.checkpoint import (CheckpointError, CheckpointPathError,
                                          UnsafeCheckpointError, _phase,
                                          check_checkpoint_path, job_checkpoint_dir,
                                          latest_checkpoint, load_state, save_checkpoint)
from dynatrain.trainer.config import make_config
from dynatrain.trainer.dcp_planners import (PieceLoadPlanner, PieceSavePlanner, decode_plan,
                                            encode_plan, read_metadata_file)
from dynatrain.trainer.groups import ParallelGroups
from dynatrain.trainer.hf_export import ExportError, export_hf
from dynatrain.trainer.state_io import StateFormatError, state_from_bytes, state_to_bytes
from dynatrain.trainer.trainer import LocalState, Trainer
from dynatrain.vps.layout import bind


@pytest.fixture(scope="module")
def trained():
    cfg = make_config("gpt-tiny", "dp=1", global_batch_size=8, seq_len=16)
    trainer = Trainer(cfg, ParallelGroups(rank=0, pp_index=0, dp_index=0, tp_index=0))
    trainer.train_step()
    return cfg, trainer


class _RunsCommand:
    """Unpickling this runs ``touch MARKER`` (what a volume's writer could plant)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def _rewrite_metadata(ckpt: str, edit) -> None:
    path = os.path.join(ckpt, ".metadata")
    md = read_metadata_file(path)
    edit(md)
    with open(path, "wb") as f:
        pickle.dump(md, f)


def test_two_jobs_on_one_root_keep_their_own_steps(tmp_path, trained):
    cfg, trainer = trained
    st = trainer.local_state()
    root = tmp_path / "claim"
    for step in (1, 2, 3):                       # job a saves often and keeps 1
        save_checkpoint(LocalState(st.tensors, step, st.data_position, st.rng), cfg.model,
                        root, keep=1, job="a")
    b = save_checkpoint(LocalState(st.tensors, 2, st.data_position, st.rng), cfg.model, root,
                        keep=1, job="b")
    assert b.path == os.path.join(job_checkpoint_dir(root, "b"), "step-00000002")
    # A step of a is pruned by a's save only; b's step 2 survives a's later step 3 (before
    # job folders, a's prune removed it: same root, older step).
    assert sorted(os.listdir(root)) == ["a", "b"]
    assert os.listdir(root / "a") == ["step-00000003"] and os.listdir(root / "b") == \
        ["step-00000002"]
    assert latest_checkpoint(root, "a") == (str(root / "a" / "step-00000003"), 3)
    assert latest_checkpoint(root, "b") == (b.path, 2)
    assert latest_checkpoint(root / "b") == (b.path, 2)           # a job's folder itself
    with pytest.raises(CheckpointPathError, match=r"several jobs \(a, b\)"):
        latest_checkpoint(root)                                   # which one? say so
    # A root written before job folders (step-* directly in it) is still found.
    old = tmp_path / "old-root"
    save_checkpoint(st, cfg.model, old)
    assert latest_checkpoint(old, "any-job") == (str(old / "step-00000001"), 1)
    # The only job folder of a root is found without naming the job (export, resume).
    single = tmp_path / "single"
    save_checkpoint(st, cfg.model, single, job="only")
    assert latest_checkpoint(single) == (str(single / "only" / "step-00000001"), 1)
    for bad in ("", "../x", "a/b", ".hidden"):
        with pytest.raises(CheckpointPathError, match="cannot name a checkpoint folder"):
            job_checkpoint_dir(root, bad)


def test_checkpoint_paths_are_accepted_only_under_the_roots(tmp_path):
    root, source = tmp_path / "claim", tmp_path / "mine"
    (root / "job" / "step-00000001").mkdir(parents=True)
    (source / "step-00000004").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    inside = str(root / "job" / "step-00000001")
    assert check_checkpoint_path(inside, [root]) == inside
    # Relative: to the first root (the claim's mount), the same on every worker.
    assert check_checkpoint_path("job/step-00000001", [root, source]) == inside
    assert check_checkpoint_path(source / "step-00000004", [root, source]) == \
        str(source / "step-00000004")
    os.symlink(tmp_path / "outside", root / "job" / "link")
    for bad in (tmp_path / "outside", f"{root}/../outside", "../outside", root / "job" / "link",
                f"{root}-evil/x"):
        with pytest.raises(CheckpointPathError, match="outside the job's checkpoint root"):
            check_checkpoint_path(bad, [root])
    with pytest.raises(CheckpointPathError, match="no checkpoint root"):
        check_checkpoint_path(inside, [])
    with pytest.raises(CheckpointPathError, match="is not a path"):
        check_checkpoint_path("a\x00b", [root])


def test_a_metadata_pickle_that_runs_code_is_refused_before_it_runs(tmp_path, trained):
    cfg, trainer = trained
    saved = save_checkpoint(trainer.local_state(), cfg.model, tmp_path / "ckpt", job="j")
    marker = tmp_path / "marker"
    payload = pickle.dumps(_RunsCommand(marker))
    pickle.loads(payload)                        # the payload is live: plain pickle runs it
    assert marker.exists()
    marker.unlink()
    with open(os.path.join(saved.path, ".metadata"), "wb") as f:
        f.write(payload)
    bound = bind(cfg.layout, cfg.model)
    with pytest.raises(UnsafeCheckpointError) as e:
        load_state(bound, 0, saved.path)
    text = str(e.value)
    assert os.path.join(saved.path, ".metadata") in text and "system" in text, text
    with pytest.raises(ExportError, match="refused to unpickle global"):
        export_hf(saved.path, tmp_path / "out")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_data_files_outside_the_checkpoint_and_pickled_bytes_items_are_refused(tmp_path,
                                                                               trained):
    cfg, trainer = trained
    bound = bind(cfg.layout, cfg.model)
    saved = save_checkpoint(trainer.local_state(), cfg.model, tmp_path / "a", job="j")

    def escape(md):
        for info in md.storage_data.values():
            info.relative_path = "../../elsewhere.distcp"
    _rewrite_metadata(saved.path, escape)
    with pytest.raises(UnsafeCheckpointError, match=r"data file '\.\./\.\./elsewhere\.distcp'"):
        load_state(bound, 0, saved.path)

    saved = save_checkpoint(trainer.local_state(), cfg.model, tmp_path / "b", job="j")
    victim = sorted(k for k in read_metadata_file(os.path.join(saved.path, ".metadata"))
                    .state_dict_metadata if k.endswith("/param"))[0]

    def as_bytes(md):
        md.state_dict_metadata[victim] = BytesStorageMetadata()
    _rewrite_metadata(saved.path, as_bytes)
    with pytest.raises(UnsafeCheckpointError, match=f"{victim!r} is BytesStorageMetadata"):
        load_state(bound, 0, saved.path)
    with pytest.raises(UnsafeCheckpointError, match="pickled bytes: refused"):
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

        item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex(victim), torch.Size([0]),
                        MetadataIndex(victim), torch.Size([0]), torch.Size([0]))
        PieceLoadPlanner({}, rng_key="").load_bytes(item, None)
    # Not a pickle at all: a clear error, not an unpickling traceback.
    with open(os.path.join(saved.path, ".metadata"), "wb") as f:
        f.write(b"garbage")
    with pytest.raises(CheckpointError, match="is not DCP metadata"):
        load_state(bound, 0, saved.path)


def test_a_normal_checkpoint_still_loads_exactly(tmp_path, trained):
    cfg, trainer = trained
    st = trainer.local_state()
    saved = save_checkpoint(st, cfg.model, tmp_path / "ckpt", job="j")
    back = load_state(bind(cfg.layout, cfg.model), 0, saved.path)
    assert (back.step, back.data_position) == (st.step, st.data_position)
    assert torch.equal(back.rng["cpu"], st.rng["cpu"])
    for key, (t, _) in st.tensors.items():
        assert torch.equal(back.tensors[key][0], t.cpu()), key


def test_the_plans_the_ranks_exchange_are_json_and_round_trip(tmp_path, trained):
    cfg, trainer = trained
    saved = save_checkpoint(trainer.local_state(), cfg.model, tmp_path / "ckpt")
    md = read_metadata_file(os.path.join(saved.path, ".metadata"))
    data = encode_plan(md)
    assert data.startswith(b'{"$class":"Metadata"')          # JSON, not a pickle
    assert decode_plan(data) == md
    from dynatrain.trainer.checkpoint import _state_chunks

    plan = PieceSavePlanner(*_state_chunks(trainer.local_state(), cfg.model, 0, 1)) \
        .create_local_plan()                     # what each rank sends in the local-plan phase
    assert len(plan.items) > 10
    phase = ("ok", [plan, None, (1, 2, None)])
    assert decode_plan(encode_plan(phase)) == phase
    assert _phase(None, "test", lambda: phase) == [phase]
    for hostile in (b'{"$class":"Popen","fields":{}}', b'{"$torch":"load"}',
                    b'{"$class":"SavePlan","fields":{"items":[],"__class__":1}}', b"\x80\x04.",
                    b'{"$tuple":[{"items":[]}]}', b'{"$class":"SavePlan","fields":{"$size":[]}}',
                    b'{"$class":"WriteItemType","fields":{}}', b'{"$dict":[[[1],2]]}'):
        with pytest.raises(ValueError, match="not an encoded plan"):
            decode_plan(hostile)
    with pytest.raises(TypeError, match="cannot encode a .*_RunsCommand"):
        encode_plan(_RunsCommand(tmp_path / "never"))


def test_a_ranks_state_travels_as_safetensors_and_json(trained):
    _, trainer = trained
    st = trainer.local_state()
    data = state_to_bytes(st, layout="dp=1", world=1)
    back, extra = state_from_bytes(data)
    assert extra == {"layout": "dp=1", "world": 1}
    assert (back.step, back.data_position) == (st.step, st.data_position)
    assert torch.equal(back.rng["cpu"], st.rng["cpu"])
    assert back.tensors.keys() == st.tensors.keys()
    for key, (t, pieces) in st.tensors.items():
        assert torch.equal(back.tensors[key][0], t.cpu()) and back.tensors[key][1] == pieces
    with pytest.raises(StateFormatError, match="rank 3: .*not a saved state"):
        state_from_bytes(pickle.dumps(st.step), source="rank 3")
    with pytest.raises(StateFormatError, match="truncated"):     # a header longer than the data
        state_from_bytes((10**9).to_bytes(8, "little") + data[8:200], source="x")
