"""Metrics, prompt files, ``run_bench`` and the ``python -m decode bench`` CLI (docs/bench.md)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEV_PROMPTS, PAIR

from decode.__main__ import main
from decode.bench import greedy_agreement, run_bench
from decode.metrics import (
    _interpolate,
    expected_tokens_per_round,
    leviathan_bound,
    solve_acceptance,
    speedup_ci95,
    theoretical_speedup,
)
from decode.prompts import encode_prompts, load_prompts
from decode.sources import load_tokenizer
from tests.tiny import char_tokenizer, save_padded_pair, save_tiny_pair, swap_ids, tiny_pair

REPO = Path(__file__).resolve().parent.parent

CONTRACT_KEYS = {
    "target", "draft", "n_prompts", "new_tokens", "temperature", "batch_size", "num_draft_tokens",
    "acceptance_rate", "mean_accepted_length", "per_position_acceptance", "mean_num_draft_tokens",
    "draft_cost_ratio", "verify_cost_ratio", "leviathan_bound", "theoretical_speedup", "tokens_per_s", "speedup",
    "outputs_match_target",
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------
def test_leviathan_formulas():
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    for a in (0.1, 0.44, 0.8, 0.97):
        for g in (1, 3, 5, 2.6):
            assert solve_acceptance(expected_tokens_per_round(a, g), g) == pytest.approx(a, abs=1e-9)
    assert solve_acceptance(1.0, 5) == 0.0 and solve_acceptance(7.0, 5) == 1.0
    # (1 - a^(g+1)) / ((1 - a)(g c + 1)), e.g. a = 0.5, g = 2, c = 0.25: 1.75 / 1.5
    assert leviathan_bound(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)
    assert theoretical_speedup(2.0, 3, 0.1, 1.2) == pytest.approx(2.0 / 1.5)
    assert _interpolate({1: 10.0, 4: 13.0}, 3.5) == pytest.approx(12.5)
    assert _interpolate({1: 10.0, 2: 11.0, 3: 14.0}, 2) == 11.0
    assert _interpolate({1: 10.0, 2: 11.0, 3: 14.0}, 5) == pytest.approx(20.0)  # extrapolates the last segment


def _units(rates: list[float], seconds: float = 1.0) -> list[tuple[float, float]]:
    return [(r * seconds, seconds) for r in rates]


def test_speedup_ci95_brackets_the_estimate_and_narrows_with_less_noise():
    base = _units([10.0] * 8)
    assert speedup_ci95(_units([20.0] * 8), base) == pytest.approx([2.0, 2.0])  # no spread: no doubt
    noisy = _units([14.0, 26.0, 18.0, 22.0, 15.0, 25.0, 19.0, 21.0])
    quiet = _units([19.0, 21.0, 19.5, 20.5, 19.0, 21.0, 20.0, 20.0])
    lo, hi = speedup_ci95(noisy, base)
    assert lo < 2.0 < hi and speedup_ci95(noisy, base) == [lo, hi]  # fixed seed: the same interval every time
    qlo, qhi = speedup_ci95(quiet, base)
    assert lo < qlo < 2.0 < qhi < hi
    # Paired: a prompt that is slow for both methods moves neither end.
    shared = [((20.0 if i % 2 else 40.0) * s, s) for i, s in enumerate([1.0, 3.0] * 4)]
    shared_base = [((10.0 if i % 2 else 20.0) * s, s) for i, s in enumerate([1.0, 3.0] * 4)]
    assert speedup_ci95(shared, shared_base) == pytest.approx([2.0, 2.0])
    assert speedup_ci95(_units([20.0]), _units([10.0])) is None  # one unit: no interval
    with pytest.raises(ValueError, match="paired timings differ in length"):
        speedup_ci95(_units([20.0, 21.0]), _units([10.0]))


def test_speedup_ci95_covers_the_true_speedup():
    import random

    rng = random.Random(1)
    covered = wrong = 0
    for _ in range(60):  # per-prompt speedups scattered around a true 1.5 (lognormal, sd 0.2)
        base = [(64.0, rng.uniform(0.5, 2.0)) for _ in range(12)]
        fast = [(n, t / (1.5 * math.exp(rng.gauss(0, 0.2)))) for n, t in base]
        lo, hi = speedup_ci95(fast, base, resamples=500)
        # The population speedup: sum t / sum (t e^-g / 1.5) -> 1.5 / E[e^-g] = 1.5 e^-0.02.
        covered += lo <= 1.5 * math.exp(-0.02) <= hi
        wrong += lo <= 1.1 <= hi  # about 4.5 standard errors of the estimate away
    assert covered >= 51 and wrong <= 2  # about 95% nominal; 85% allows for a percentile bootstrap on 12 prompts


# ---------------------------------------------------------------------------------------------------------------
# Prompt files
# ---------------------------------------------------------------------------------------------------------------
def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_prompts_text_and_chat(tmp_path):
    path = _write(
        tmp_path / "p.jsonl",
        [
            json.dumps({"id": "a", "prompt": "def f():", "source": "x.py"}),
            "",
            json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        ],
    )
    items = load_prompts(path)
    assert [i["id"] for i in items] == ["a", "p-1"] and items[0]["source"] == "x.py"
    tok = char_tokenizer(chat_template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}>")
    items = load_prompts(path, tokenizer=tok)
    assert items[1]["prompt"] == "<user>hi>"
    assert tok.decode(encode_prompts(tok, items)[1]) == "<user>hi>"


@pytest.mark.parametrize(
    "lines,message",
    [
        ([], "prompt file is empty"),
        (["", "  "], "prompt file is empty"),
        ([json.dumps({"prompt": "ok"}), "{not json"], r"p.jsonl:2: not valid JSON"),
        ([json.dumps({"text": "x"})], r"p.jsonl:1: needs \"prompt\""),
        ([json.dumps(["prompt"])], r"p.jsonl:1: expected a JSON object"),
    ],
)
def test_load_prompts_errors(tmp_path, lines, message):
    with pytest.raises(ValueError, match=message):
        load_prompts(_write(tmp_path / "p.jsonl", lines))


def test_load_prompts_missing_file(tmp_path):
    with pytest.raises(ValueError, match="prompt file not found"):
        load_prompts(tmp_path / "nope.jsonl")


def test_chat_prompt_without_template_is_a_clear_error(tmp_path):
    path = _write(tmp_path / "p.jsonl", [json.dumps({"messages": [{"role": "user", "content": "hi"}]})])
    with pytest.raises(ValueError, match="chat template"):
        load_prompts(path, tokenizer=char_tokenizer())


# ---------------------------------------------------------------------------------------------------------------
# run_bench on tiny models
# ---------------------------------------------------------------------------------------------------------------
PROMPTS = [{"id": f"t{i}", "prompt": p} for i, p in enumerate(["def f(x):", "import os\n", "class A:\n    x = 1"])]


def _pair():
    target, draft = tiny_pair("llama", noise=0.1)
    for m in (target, draft):
        m.generation_config.eos_token_id = m.generation_config.pad_token_id = 0
    return target, draft


@pytest.mark.parametrize("gamma", [3, "auto"])
def test_run_bench_greedy_contract(tmp_path, gamma):
    target, draft = _pair()
    samples = tmp_path / "s.jsonl"
    result = run_bench(
        target, draft, char_tokenizer(), PROMPTS, target_name="t", draft_name="d", max_new_tokens=12,
        num_draft_tokens=gamma, repeats=1, samples_out=samples, progress=False,
    )  # fmt: skip
    assert CONTRACT_KEYS <= set(result)
    # On CPU HF assisted also runs once on draftsmith's kernels (decode.kernels), for the kernel-neutral figure.
    assert set(result["tokens_per_s"]) == {
        "speculative", "target", "hf_assisted", "hf_assisted_same_kernels", "hf_assisted_published",
    }  # fmt: skip
    assert set(result["speedup"]) == {
        "vs_target", "vs_target_ci95", "vs_hf_assisted", "vs_hf_assisted_same_kernels", "vs_hf_assisted_published",
    }  # fmt: skip
    assert result["engine"] == "draftsmith" and isinstance(result["engine_version"], str)
    lo, hi = result["speedup"]["vs_target_ci95"]  # three prompts: three paired batches
    assert 0 < lo <= hi
    assert all(0 < lo <= hi for lo, hi in result["hf_assisted_ci95"].values())
    # Per batch, the speedup beside its prompts: what best/ selection pairs two checkpoints on.
    per_batch = result["speedup_per_batch"]
    assert per_batch["prompt_ids"] == [["t0"], ["t1"], ["t2"]]
    assert len(per_batch["vs_target"]) == 3 and all(s > 0 for s in per_batch["vs_target"])
    # Under auto the published gamma is the rounded mean of the warm-up run (timing-driven, so not re-derivable
    # from the timed runs' mean): a whole number of tokens within auto's range.
    published = 3 if gamma == 3 else result["hf_assisted_settings"]["published"]["num_assistant_tokens"]
    assert isinstance(published, int) and 1 <= published <= 12
    assert result["hf_assisted_settings"] == {
        "defaults": {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                     "assistant_confidence_threshold": 0.4},
        "published": {"num_assistant_tokens": published, "num_assistant_tokens_schedule": "constant",
                      "assistant_confidence_threshold": 0.0},
    }  # fmt: skip
    assert result["num_draft_tokens"] == gamma and result["n_prompts"] == 3
    assert result["outputs_match_target"] is True
    assert 0 <= result["acceptance_rate"] <= 1 and result["mean_accepted_length"] >= 1
    assert all(v > 0 for v in result["tokens_per_s"].values())
    assert result["speedup"]["vs_target"] == pytest.approx(
        result["tokens_per_s"]["speculative"] / result["tokens_per_s"]["target"]
    )
    assert result["target_tokens_per_s"]["loop"] <= result["tokens_per_s"]["target"]
    agreement = result["greedy_agreement"]
    assert agreement["rows"] == 3 and agreement["divergences"] == []
    assert set(agreement["rows_equal"]) == {
        "speculative", "target_loop", "hf_assisted", "hf_assisted_same_kernels", "hf_assisted_published",
    }  # fmt: skip
    assert set(agreement["rows_equal"].values()) == {3}
    json.dumps(result)  # serialisable as is
    lines = [json.loads(x) for x in samples.read_text().splitlines()]
    methods = {"speculative", "target", "hf_assisted", "hf_assisted_published"}
    assert len(lines) == 3 * 4 and {x["method"] for x in lines} == methods
    by = {(x["id"], x["method"]): x["new_token_ids"] for x in lines}
    assert all(by[(p["id"], "speculative")] == by[(p["id"], "target")] for p in PROMPTS)


def test_greedy_agreement_measures_the_margin_at_a_divergence():
    target, _ = _pair()
    ids = torch.tensor([[0, 5, 6, 7], [3, 4, 5, 6]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])  # row 0 left-padded
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([[5, 6, 7]])).logits[0, -1]
    top2 = logits.topk(2).indices.tolist()
    reference = [[top2[0], 9], [1, 2]]
    outputs = {
        "target_generate": {0: reference},
        "speculative": {0: [[top2[1], 9], [1, 2]]},  # row 0 takes the runner-up at position 0
        "target_loop": {0: [[top2[0], 9], [1]]},  # row 1 stops early: a prefix, not a flipped argmax
    }
    got = greedy_agreement(target, [(ids, mask)], outputs)
    assert got["rows"] == 2 and got["rows_equal"] == {"speculative": 1, "target_loop": 1}
    flip, stop = got["divergences"]
    assert (flip["method"], flip["row"], flip["position"]) == ("speculative", 0, 0)
    assert flip["margin"] == pytest.approx(float(logits[top2[0]] - logits[top2[1]]), abs=1e-5)
    assert flip["margin_in_spacings"] > 1  # fp32: far above rounding, i.e. a real disagreement
    assert (stop["method"], stop["row"], stop["position"]) == ("target_loop", 1, 1) and "margin" not in stop
    assert got["max_margin_in_spacings"] == flip["margin_in_spacings"]


def test_run_bench_sampling_batched_target_only():
    target, draft = _pair()
    result = run_bench(
        target, draft, char_tokenizer(), PROMPTS, target_name="t", draft_name="d", max_new_tokens=8,
        temperature=0.8, top_p=0.95, batch_size=2, repeats=1, baselines=("target",), progress=False,
    )  # fmt: skip
    assert result["outputs_match_target"] is None  # only defined for greedy
    assert result["tokens_per_s"]["hf_assisted"] is None and result["speedup"]["vs_hf_assisted"] is None
    assert result["hf_assisted_settings"] is None and result["speedup"]["vs_hf_assisted_published"] is None
    assert result["batch_size"] == 2 and result["speedup"]["vs_target"] > 0
    assert result["speedup_per_batch"]["prompt_ids"] == [["t0", "t1"], ["t2"]]  # as make_batches cuts them


def test_hf_baselines_ignore_the_models_generation_configs():
    # Instruct models ship generation settings that change what generate does; the bench must not inherit them.
    target, draft = _pair()
    for model in (target, draft):
        gen = model.generation_config
        gen.repetition_penalty, gen.no_repeat_ngram_size, gen.min_new_tokens = 3.0, 2, 12
        gen.suppress_tokens = list(range(1, 40))
    draft.generation_config.num_assistant_tokens, draft.generation_config.assistant_confidence_threshold = 7, 0.9
    draft.generation_config.num_assistant_tokens_schedule = "heuristic"
    shipped = {m: m.generation_config.to_dict() for m in (target, draft)}
    seen = set()  # the assistant settings the draft carries whenever it runs a forward

    def record(module, args):
        gen = module.generation_config
        seen.add((gen.num_assistant_tokens, gen.num_assistant_tokens_schedule, gen.assistant_confidence_threshold))

    draft.register_forward_pre_hook(record)
    result = run_bench(
        target, draft, char_tokenizer(), PROMPTS, target_name="t", draft_name="d", max_new_tokens=12,
        num_draft_tokens=3, repeats=1, progress=False,
    )  # fmt: skip
    assert result["outputs_match_target"] is True
    assert set(result["greedy_agreement"]["rows_equal"].values()) == {3}  # every HF baseline too
    assert {(20, "constant", 0.4), (3, "constant", 0.0)} <= seen  # what hf_assisted_settings says ran
    assert result["hf_assisted_config"].startswith("num_assistant_tokens=20, constant schedule")
    assert {m: m.generation_config.to_dict() for m in (target, draft)} == shipped  # given back as they were


def test_run_bench_prompt_past_context_is_a_clear_error():
    target, draft = _pair()
    long = [{"prompt": "x" * 250}]
    with pytest.raises(ValueError, match="exceeds the target model's context of 256"):
        run_bench(target, draft, char_tokenizer(), long, target_name="t", draft_name="d", max_new_tokens=10)


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


def test_cli_bench_writes_json_plot_and_samples(tmp_path, saved_pair, capsys):
    target, draft = saved_pair
    prompts = _write(tmp_path / "p.jsonl", [json.dumps(p) for p in PROMPTS])
    out, png, samples = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "s.jsonl"
    argv = ["bench", "--target", target, "--draft", draft, "--prompts", str(prompts), "--max-new-tokens", "6",
            "--limit", "2", "--repeats", "1", "--num-draft-tokens", "auto", "--json", str(out), "--plot", str(png),
            "--samples-out", str(samples), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert CONTRACT_KEYS <= set(result) and result["n_prompts"] == 2 and result["num_draft_tokens"] == "auto"
    assert result["outputs_match_target"] is True
    assert png.stat().st_size > 1000 and len(samples.read_text().splitlines()) == 2 * 4
    assert json.loads(capsys.readouterr().out)["n_prompts"] == 2


@pytest.mark.parametrize(
    "case,message",
    [
        ("missing", "error: prompt file not found"),
        ("empty", "error: prompt file is empty"),
        ("long", "error: prompt of 300 tokens"),
        ("vocab", "error: vocabulary mismatch"),
    ],
)
def test_cli_errors_exit_2_with_one_line(tmp_path, saved_pair, capsys, case, message):
    target, draft = saved_pair
    prompts = tmp_path / "p.jsonl"
    if case == "empty":
        prompts.write_text("")
    elif case == "long":
        _write(prompts, [json.dumps({"prompt": "x" * 300})])
    else:
        _write(prompts, [json.dumps({"prompt": "x"})])
    if case == "vocab":
        # Same model, tokenizer with two ids swapped.
        other = tmp_path / "other"
        from transformers import AutoModelForCausalLM

        swap_ids(char_tokenizer(), 5, 6).save_pretrained(other)
        AutoModelForCausalLM.from_pretrained(draft).save_pretrained(other)
        draft = str(other)
    path = str(tmp_path / "nope.jsonl") if case == "missing" else str(prompts)
    code = main(["bench", "--target", target, "--draft", draft, "--prompts", path, "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith(message), err


def test_cli_entry_point_runs(tmp_path, saved_pair):
    target, draft = saved_pair
    prompts = _write(tmp_path / "p.jsonl", [json.dumps(PROMPTS[0])])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "decode", "bench", "--target", target, "--draft", draft, "--prompts", str(prompts),
           "--max-new-tokens", "4", "--repeats", "1", "--baselines", "target", "--no-progress",
           "--dtype", "bfloat16", "--draft-dtype", "float32"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["tokens_per_s"]["hf_assisted"] is None
    assert (result["dtype"], result["draft_dtype"]) == ("bfloat16", "float32")


def _bench_cli(target: str, draft: str, prompts: Path, *args: str, env: dict | None = None):
    """``python -m decode bench`` in a fresh process on a tiny pair: 2 new tokens, 1 repeat, target baseline."""
    cmd = [sys.executable, "-m", "decode", "bench", "--target", target, "--draft", draft, "--prompts", str(prompts),
           "--max-new-tokens", "2", "--repeats", "1", "--baselines", "target", "--no-progress", *args]  # fmt: skip
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=full_env, timeout=300)


def _one_error(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_cli_unwritable_output_paths_are_refused_before_anything_loads(tmp_path, saved_pair):
    target, draft = saved_pair
    prompts = _write(tmp_path / "p.jsonl", [json.dumps(PROMPTS[0])])
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-file").write_text("")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.geteuid() == 0:  # root writes through a mode of 555: /proc is a directory where nobody creates files
        read_only = Path("/proc")
    cases = [
        ("--json", tmp_path / "a-dir", "is a directory"),
        ("--plot", tmp_path / "a-file" / "new-dir" / "r.png", "is a file, so no directory can be made there"),
        ("--samples-out", read_only / "s.jsonl", "no file can be created in"),
        ("--json", read_only / "new-dir" / "r.json", "no file can be created in"),
    ]
    before = sorted(p.name for p in tmp_path.iterdir())
    for flag, path, why in cases:
        proc = _bench_cli(target, draft, prompts, flag, str(path))
        line = _one_error(proc)
        assert proc.returncode == 2 and proc.stdout == "", (flag, path, proc.stderr)
        assert line.startswith(f"error: {flag} {path}: ") and why in line, line
        assert not path.exists() or path.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == before and list((tmp_path / "a-dir").iterdir()) == []


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a device whose writes fail: disk full)")
@pytest.mark.parametrize("flag", ["--json", "--samples-out"])
def test_cli_write_failing_after_the_measurement_still_prints_the_figures(tmp_path, saved_pair, flag):
    """A write that fails once the bench has measured (/dev/full: every write is 'No space left on device') loses
    no figures: the result object is on stdout, then one error line; the other outputs are still written."""
    target, draft = saved_pair
    prompts = _write(tmp_path / "p.jsonl", [json.dumps(PROMPTS[0])])
    other = ["--json", str(tmp_path / "new" / "dir" / "r.json")] if flag == "--samples-out" else []
    proc = _bench_cli(target, draft, prompts, flag, "/dev/full", *other)
    assert proc.returncode == 1, proc.stderr
    result = json.loads(proc.stdout)
    assert CONTRACT_KEYS <= set(result) and result["n_prompts"] == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {flag} /dev/full: not written (No space left on device)"), proc.stderr
    assert sum(line.startswith("error:") for line in proc.stderr.splitlines()) == 1
    if other:  # the JSON the failed samples file did not stop, in directories made for it
        assert json.loads(Path(other[1]).read_text()) == result
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()]  # no temporary file left behind


def test_cli_runs_a_models_shipped_code_only_with_trust_remote_code(tmp_path, saved_pair):
    """A --draft whose config.json has auto_map: refused without --trust-remote-code (its code never imported,
    nothing written); with the flag its code runs."""
    import shutil

    from tests.tiny import ship_code

    target, draft = saved_pair
    shipped = ship_code(Path(shutil.copytree(draft, tmp_path / "shipped")))
    prompts = _write(tmp_path / "p.jsonl", [json.dumps(PROMPTS[0])])
    marker, out = tmp_path / "IMPORTED", tmp_path / "r.json"
    env = {"SHIPPED_CODE_MARKER": str(marker)}
    proc = _bench_cli(target, str(shipped), prompts, "--json", str(out), env=env)
    line = _one_error(proc)
    assert proc.returncode == 2 and "auto_map in its config.json" in line and "--trust-remote-code" in line, line
    assert not marker.exists() and not out.exists()
    proc = _bench_cli(target, str(shipped), prompts, "--json", str(out), "--trust-remote-code", env=env)
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text() == "imported" and json.loads(out.read_text())["n_prompts"] == 1


@pytest.fixture(scope="module")
def padded_pair(tmp_path_factory):
    return save_padded_pair(tmp_path_factory.mktemp("padded"))


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_cli_hf_baseline_runs_a_pair_padded_to_different_widths(tmp_path, padded_pair, temperature):
    """A target padded past its tokenizer (384 rows over 320 tokens) and its draft padded otherwise (352): HF
    assisted generation is timed (it refuses configs of another vocab_size), sampled too (its acceptance test
    compares the two models' distributions row by row)."""
    target, draft = padded_pair
    prompts = _write(tmp_path / "p.jsonl", [json.dumps(p) for p in PROMPTS[:2]])
    out = tmp_path / "r.json"
    argv = ["bench", "--target", target, "--draft", draft, "--prompts", str(prompts), "--max-new-tokens", "6",
            "--repeats", "1", "--temperature", temperature, "--json", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["tokens_per_s"]["hf_assisted"] > 0 and result["tokens_per_s"]["hf_assisted_published"] > 0
    if temperature == "0":
        assert result["outputs_match_target"] is True


def test_hf_baseline_leaves_a_padded_pairs_draft_as_it_was(padded_pair):
    """The draft is padded to the target's width for HF's calls alone: draftsmith's loop and the caller keep the
    draft as it is (352 rows, config vocab_size 352)."""
    from decode.sources import load_model

    target, draft = (load_model(path).eval() for path in padded_pair)
    before = {n: p.clone() for n, p in draft.state_dict().items()}
    layers = (draft.get_input_embeddings(), draft.get_output_embeddings())
    result = run_bench(
        target, draft, load_tokenizer(padded_pair[0]), PROMPTS[:1], target_name="t", draft_name="d",
        max_new_tokens=6, num_draft_tokens=2, repeats=1, progress=False,
    )  # fmt: skip
    assert result["tokens_per_s"]["hf_assisted"] > 0
    assert (draft.get_input_embeddings(), draft.get_output_embeddings()) == layers
    assert draft.config.vocab_size == 352 and draft.get_output_embeddings().weight.shape[0] == 352
    assert all(torch.equal(p, before[n]) for n, p in draft.state_dict().items())


def test_in_run_evaluation_with_hf_assisted_on_a_padded_pair(padded_pair):
    """train/distill.py's evaluation (eval.hf_assisted, on by default) of the same pair."""
    from distill.config import ModelConfig, Recipe
    from distill.models import load_draft, load_target
    from distill.training.helpers import evaluate

    recipe = Recipe()
    recipe.target.model, recipe.draft.model = padded_pair
    recipe.eval.max_new_tokens, recipe.eval.num_draft_tokens, recipe.eval.repeats = 6, 2, 1
    assert recipe.eval.hf_assisted
    target = load_target(ModelConfig(model=padded_pair[0]), device="cpu")
    draft = load_draft(ModelConfig(model=padded_pair[1]), device="cpu")
    result = evaluate(target, draft, load_tokenizer(padded_pair[0]), PROMPTS[:2], recipe)
    assert result["tokens_per_s"]["hf_assisted"] > 0
    assert result["speedup"]["vs_hf_assisted"] > 0


def test_kernels_off_means_no_same_kernels_baseline(monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CPU_KERNELS", "0")
    target, draft = _pair()
    result = run_bench(
        target, draft, char_tokenizer(), PROMPTS[:1], target_name="t", draft_name="d", max_new_tokens=6,
        num_draft_tokens=2, repeats=1, progress=False,
    )  # fmt: skip
    assert result["tokens_per_s"]["hf_assisted"] > 0
    assert result["tokens_per_s"]["hf_assisted_same_kernels"] is None
    assert result["speedup"]["vs_hf_assisted_same_kernels"] is None
    assert result["outputs_match_target"] is True


# ---------------------------------------------------------------------------------------------------------------
# The reference pair (the shared fixtures beside the checkout; skipped where absent)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.shared
def test_reference_pair_greedy_is_lossless():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(PAIR / "draft", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(PAIR / "target")
    prompts = load_prompts(DEV_PROMPTS)[:2]
    result = run_bench(
        target, draft, tok, prompts, target_name="target", draft_name="draft", max_new_tokens=24,
        num_draft_tokens=3, repeats=1, baselines=("target",), progress=False,
    )  # fmt: skip
    assert result["outputs_match_target"] is True
    assert result["acceptance_rate"] > 0.2 and result["mean_accepted_length"] > 1.3


def test_block_tokens_and_the_best_block_from_acceptance_and_verify_costs():
    """A block of K: 1 + sum_j prod_{i<=j} a_i tokens a round for one draft forward and one (K+1)-token verify; the
    best K follows the curve: a flat curve takes the longest block that still adds tokens, a steep one stops early."""
    from decode.metrics import best_block, block_tokens

    per_position = [0.8, 0.5, 0.5]
    assert block_tokens(per_position, 1) == pytest.approx(1.8)
    assert block_tokens(per_position, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert block_tokens(per_position, 4) == pytest.approx(1 + 0.8 + 0.4 + 0.2 + 0.1)  # the last rate carries on
    assert block_tokens([], 3) == 1.0
    flat = {k: 1.0 for k in range(1, 9)}
    steep = {k: 1.0 + 0.5 * k for k in range(1, 9)}
    assert best_block(per_position, flat, 0.1, 8)["k"] == 8
    choice = best_block(per_position, steep, 0.1, 8)
    assert choice["k"] == 1 and choice["expected_speedup"][1] == pytest.approx(1.8 / 1.6)
