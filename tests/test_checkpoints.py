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


def test_saving_a_tied_draft_drops_only_the_shared_tensor_note_and_it_loads_back_tied(tmp_path, caplog):
    """accelerate notes "Removed shared tensor {'lm_head.weight'} ..." at every save_state of a draft whose output
    layer is its embedding; around draftsmith's saves that one note is dropped (the tie is in the config and comes
    back at load), any other warning of the same logger still shows, and the saved state loads back equal."""
    import logging

    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from distill.training.checkpoints import tied_weights_quiet
    from tests.tiny import tiny_config

    torch.manual_seed(0)
    config = tiny_config("llama", 64)
    config.tie_word_embeddings = True
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(AutoModelForCausalLM.from_config(config))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    caplog.set_level(logging.WARNING, logger="accelerate")

    accelerator.save_state(str(tmp_path / "plain"))  # the control: the note is there without the filter
    assert any("Removed shared tensor" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with tied_weights_quiet():
        accelerator.save_state(str(tmp_path / "quiet"))
        logging.getLogger("accelerate.utils.other").warning("another note")
    assert [r.getMessage() for r in caplog.records] == ["another note"], caplog.text

    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    accelerator.load_state(str(tmp_path / "quiet"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
