"""Atomic checkpoint writes and selection by measured speedup (never by loss)."""

import json

import pytest

from distill.training.checkpoints import (
    CheckpointInfo,
    atomic_dir,
    clean_temporaries,
    list_checkpoints,
    load_infos,
    newest_checkpoint,
    prune_checkpoints,
    select_best,
    steps_to_keep,
    write_json_atomic,
)


def test_atomic_dir_leaves_nothing_on_failure(tmp_path):
    final = tmp_path / "checkpoints" / "step-5"
    final.parent.mkdir()
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "model.safetensors").write_text("half")
            raise RuntimeError("killed mid-write")
    assert not final.exists()
    assert list(final.parent.iterdir()) == []


def test_atomic_dir_replaces_existing_only_when_complete(tmp_path):
    final = tmp_path / "best"
    final.mkdir()
    (final / "old").write_text("old")
    with atomic_dir(final) as tmp:
        (tmp / "new").write_text("new")
        assert (final / "old").exists()  # still the old one while writing
    assert sorted(p.name for p in final.iterdir()) == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["best"]


def test_newest_complete_checkpoint_and_temporaries(tmp_path):
    for step in (2, 10, 4):
        (tmp_path / f"step-{step}" / "state").mkdir(parents=True)
    (tmp_path / "step-12").mkdir()  # no training state: not resumable
    (tmp_path / ".tmp-step-14").mkdir()  # interrupted write
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4, 10, 12]
    assert newest_checkpoint(tmp_path)[0] == 10
    assert [p.name for p in clean_temporaries(tmp_path)] == [".tmp-step-14"]


def test_selection_by_speedup_then_acceptance_never_loss():
    infos = [
        CheckpointInfo(0, speedup=1.10, acceptance_rate=0.40, loss=None),
        CheckpointInfo(10, speedup=1.30, acceptance_rate=0.50, loss=9.0),  # worst loss, best speedup
        CheckpointInfo(20, speedup=1.30, acceptance_rate=0.55, loss=2.0),
        CheckpointInfo(30, speedup=1.20, acceptance_rate=0.60, loss=0.1),  # best loss
    ]
    assert select_best(infos).step == 20
    assert steps_to_keep(infos, keep_top_k=2, newest_step=30) == {10, 20, 30}
    with pytest.raises(ValueError):
        select_best([])


def test_prune_and_load_infos(tmp_path):
    for step, speed in ((0, 1.0), (5, 1.4), (10, 1.2)):
        path = tmp_path / f"step-{step}"
        path.mkdir()
        write_json_atomic(path / "eval.json", {"speedup": {"vs_target": speed}, "acceptance_rate": 0.5})
    assert prune_checkpoints(tmp_path, {5, 10}) == [0]
    assert [(i.step, i.speedup) for i in load_infos(tmp_path)] == [(5, 1.4), (10, 1.2)]
    assert json.loads((tmp_path / "step-5" / "eval.json").read_text())["speedup"]["vs_target"] == 1.4
