"""Distributed engines: sharded (FSDP2) evaluation and saving on rank 0, refusals up front, what really runs.

accelerate on CPU never shards (an FSDP config under ACCELERATE_USE_CPU=1 becomes plain data parallelism), so the
sharded path is tested with torch's own FSDP2 (`fully_shard`) on gloo: two real processes under torchrun, a tiny
Llama, and timeouts everywhere so that a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distill.training.distributed import (
    check_engine,
    describe,
    engine_warning,
    full_draft,
    is_sharded,
    process_group_kwargs,
    requested_engine,
    rollout_draft,
)
from tests.procs import free_port, run_captured

REPO = Path(__file__).resolve().parent.parent


def env() -> dict:
    e = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


# ---------------------------------------------------------------- sharded eval/save, two gloo processes


def _fsdp_worker(draft_dir: str, out: str) -> None:
    """One rank: shard the draft with FSDP2, train a step, gather a plain copy on rank 0, check and save it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from distill.models import save_draft

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, out = dist.get_rank(), Path(out)
    model = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    on_disk = {n: p.detach().clone() for n, p in model.named_parameters()}
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert is_sharded(model) and rollout_draft(model) is None
    x = torch.tensor([[0, 5, 17, 42, 99, 3, 250, 7], [1, 2, 3, 4, 5, 6, 7, 8]])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=x, labels=x).loss.backward()  # a step, so that the gathered weights are not the ones on disk
    opt.step()
    with torch.no_grad():
        sharded_logits = model(input_ids=x).logits  # every rank joins this forward's all-gathers

    plain = full_draft(model, model, is_main=rank == 0)
    if rank == 0:
        time.sleep(3)  # a slow evaluation: rank 1 waits at the barrier meanwhile
        assert not is_sharded(plain)
        assert any(not torch.equal(p, on_disk[n]) for n, p in plain.named_parameters())
        assert plain.lm_head.weight is plain.model.embed_tokens.weight  # tied again
        with torch.no_grad():
            torch.testing.assert_close(plain(input_ids=x).logits, sharded_logits, rtol=1e-5, atol=1e-5)
        save_draft(plain, out / "saved")
        reloaded = AutoModelForCausalLM.from_pretrained(out / "saved", dtype=torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(reloaded(input_ids=x).logits, sharded_logits, rtol=1e-5, atol=1e-5)
    else:
        assert plain is None
    dist.barrier()
    (out / f"rank{rank}.done").write_text("ok")
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_gathered_copy_equals_sharded_model_and_saves(tmp_path):
    from tests.tiny import make_pair

    _, draft = make_pair(tmp_path / "pair")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [__file__, "fsdp-worker", str(draft), str(tmp_path)]
    proc = run_captured(cmd, env=env(), timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "rank0.done").is_file() and (tmp_path / "rank1.done").is_file()
    assert (tmp_path / "saved" / "config.json").is_file()


def test_unsharded_draft_is_rank_0s_own():
    from tests.tiny import tiny_llama

    model = tiny_llama(32, layers=1)
    assert not is_sharded(model)
    assert full_draft(model, model, is_main=True) is model  # nothing gathered, nothing copied
    assert full_draft(model, model, is_main=False) is None
    assert rollout_draft(model) is model


# ---------------------------------------------------------------- train/distill.py


def _write_recipe(tmp: Path, **sections) -> Path:
    from tests.test_distill_e2e import recipe_dict, write_recipe
    from tests.tiny import make_pair, make_prompts

    target, draft = make_pair(tmp / "pair")
    assets = {"target": target, "draft": draft}
    assets["train"], assets["eval"] = make_prompts(tmp / "train.jsonl", 16, seed=1), make_prompts(tmp / "e.jsonl", 3)
    return write_recipe(tmp, recipe_dict(assets, tmp / "run", **sections))


def test_deepspeed_without_the_package_is_refused_before_anything_is_written(tmp_path):
    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed here")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'run'}\n")
    e = dict(env(), ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="2")
    script = str(REPO / "train" / "distill.py")
    proc = subprocess.run(
        [sys.executable, script, "--recipe", str(recipe)], capture_output=True, text=True, env=e, timeout=120, cwd=REPO
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: the launch config asks for DeepSpeed but the deepspeed package is not installed: "
        "`pip install deepspeed`, or launch with recipes/accelerate/multi_gpu.yaml"
    ]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_fsdp_config_on_cpu_runs_data_parallel_and_says_so(tmp_path):
    """accelerate turns the FSDP config into MULTI_CPU under ACCELERATE_USE_CPU=1: the run warns, logs what it
    really used, and evaluates and saves through the same rank-0 path without hanging."""
    recipe = _write_recipe(
        tmp_path,
        distill={"source": "target"},
        train={"max_steps": 2, "batch_size": 2},
        eval={"every": 2},
        log={"report_to": "none", "every": 1},
    )
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/fsdp.yaml"]
    cmd += ["--num_processes", "2", "--main_process_port", str(free_port()), "--mixed_precision", "no"]
    cmd += ["train/distill.py", "--recipe", str(recipe)]
    proc = run_captured(cmd, env=dict(env(), ACCELERATE_USE_CPU="1"), timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "distributed: MULTI_CPU, 2 processes, every process holds the whole draft" in proc.stdout
    assert "warning: the launch config asks for FSDP but accelerate runs MULTI_CPU" in proc.stderr
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["distributed"] == {
        "distributed_type": "MULTI_CPU",
        "num_processes": 2,
        "sharded_parameters": False,
        "requested": "fsdp",
    }
    assert (tmp_path / "run" / "best" / "config.json").is_file()


def test_fsdp_with_on_policy_rollouts_is_refused(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'run'}\ndistill:\n  source: draft\n")
    e = dict(env(), ACCELERATE_USE_FSDP="true")
    script = str(REPO / "train" / "distill.py")
    proc = subprocess.run(
        [sys.executable, script, "--recipe", str(recipe)], capture_output=True, text=True, env=e, timeout=120, cwd=REPO
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: distill.source=draft samples rollouts from the draft") and "source=target" in line
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- refusals and reporting


def _check(requested, **kw):
    args = dict(source="target", quantized=False, lora=False, cuda=True, has_deepspeed=True)
    check_engine(requested, **{**args, **kw})


@pytest.mark.parametrize(
    "requested, kw, needle",
    [
        ("deepspeed", {"has_deepspeed": False}, "pip install deepspeed"),
        ("deepspeed", {"cuda": False}, "needs CUDA"),
        ("deepspeed", {"zero_stage": 3}, "ZeRO-3"),
        ("fsdp", {"source": "mix"}, "distill.source=target"),
        ("fsdp", {"source": "draft"}, "distill.source=target"),
        ("fsdp", {"lora": True}, "draft.lora.enabled=false"),
        ("fsdp", {"ram_efficient_loading": True}, "fsdp_cpu_ram_efficient_loading: true leaves the frozen target"),
    ],
)
def test_impossible_engines_are_refused_with_one_line(requested, kw, needle):
    with pytest.raises(ValueError, match=needle) as err:
        _check(requested, **kw)
    assert "\n" not in str(err.value)


def test_possible_engines_pass():
    for requested in (None, "fsdp", "deepspeed"):
        _check(requested)
    _check("deepspeed", zero_stage=2, source="mix", lora=True)
    _check(None, cuda=False, has_deepspeed=False, source="draft", lora=True, quantized=True)


def test_requested_engine_reads_the_launch_environment():
    assert requested_engine({}) is None
    assert requested_engine({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}) == "fsdp"
    assert requested_engine({"ACCELERATE_USE_DEEPSPEED": "True"}) == "deepspeed"
    assert requested_engine({"ACCELERATE_USE_FSDP": "false"}) is None


def test_fsdp_that_became_data_parallelism_is_named():
    info = {"distributed_type": "MULTI_CPU", "num_processes": 2, "sharded_parameters": False, "requested": "fsdp"}
    assert "asks for FSDP but accelerate runs MULTI_CPU" in engine_warning(info)
    assert describe(info) == "distributed: MULTI_CPU, 2 processes, every process holds the whole draft"
    real = {**info, "distributed_type": "FSDP", "sharded_parameters": True}
    assert engine_warning(real) is None
    assert describe(real) == "distributed: FSDP, 2 processes, draft parameters sharded"
    single = {"distributed_type": "NO", "num_processes": 1, "sharded_parameters": False, "requested": None}
    assert describe(single) == "distributed: NO, 1 process" and engine_warning(single) is None


def test_process_group_timeout():
    (kwargs,) = process_group_kwargs(90)
    assert kwargs.timeout == datetime.timedelta(minutes=90)


if __name__ == "__main__" and sys.argv[1:2] == ["fsdp-worker"]:
    _fsdp_worker(*sys.argv[2:4])


def _built_drafts(target) -> dict:
    """A tiny draft of every kind that builds its draft from the target, as it trains."""
    from decode.kinds.dflash import decoding as dflash
    from decode.kinds.dspark import decoding as dspark
    from decode.kinds.eagle3 import decoding as eagle3
    from decode.kinds.peagle import decoding as peagle

    vocab = list(range(target.config.vocab_size // 2))
    return {
        "eagle3": eagle3.build(target, vocab, aux_layers=[1, 2, 3]),
        "peagle": peagle.build(target, vocab, [1, 2, 3], block_size=3, mask_token_id=0),
        "dflash": dflash.build(target, [0, 1, 2], num_layers=1, block_size=3, mask_token_id=0),
        "dspark": dspark.build(target, None, num_layers=1, block_size=3, mask_token_id=0, markov_rank=4,
                               confidence_min=None),
    }  # fmt: skip


def test_fsdp_is_refused_for_every_kind_whose_draft_rank_0_cannot_rebuild():
    """Rank 0 rebuilds a sharded draft as a causal LM from its gathered state dict (plain_copy): that works for a
    draft LM and fails for every kind that builds its draft from the target, so an FSDP launch is refused, in one
    line naming the kind, for exactly those kinds."""
    from decode import kinds
    from distill.config import load_recipe
    from distill.training.distributed import check_launch, plain_copy
    from tests.tiny import tiny_llama

    target = tiny_llama(64, 0, layers=4)
    plain_copy(target, target.state_dict())  # a causal LM: rebuilt
    built = _built_drafts(target)
    assert set(built) == {n for n, t in kinds.KINDS.items() if not t.loads_draft_model}
    for draft in built.values():
        with pytest.raises(RuntimeError, match="LlamaForCausalLM"):
            plain_copy(draft, draft.state_dict())
    fsdp = {"ACCELERATE_USE_FSDP": "true"}
    for name, traits in kinds.KINDS.items():
        recipe = load_recipe(None, [f"draft.kind={name}", "target.model=t"])
        if traits.loads_draft_model:
            assert check_launch(recipe, fsdp) == "fsdp" and check_launch(recipe, {}) is None
            continue
        with pytest.raises(ValueError, match=rf"^draft.kind={name} trains a draft built from the target") as err:
            check_launch(recipe, fsdp)
        assert "\n" not in str(err.value) and "multi_gpu.yaml" in str(err.value)
        assert check_launch(recipe, {}) is None
