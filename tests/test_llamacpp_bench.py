"""``python -m decode bench --engine llamacpp``: llama-server with the draft against llama-server target-only.

End to end through the CLI with real llama.cpp binaries, the tiny target and a tiny draft folder
(``tests/llamacpp_helpers.py``; skipped with the reason where llama.cpp is absent); the verify-cost curve and the
choice of K as pure functions; and the bad inputs, each one ``error:`` line, exit 2, nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decode.__main__ import main
from decode.llamacpp.curve import cannot_pay, choose_k, counter_delta, parse_llama_bench, per_position
from tests import llamacpp_helpers as h
from tests.llamacpp_helpers import BLOCK, PROMPTS

llama_cpp, tiny_target, drafts = h.llama_cpp, h.tiny_target, h.drafts  # the session's shared fixtures
NEW_TOKENS = 16


def write_prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return path


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what building the fixtures printed is not the bench's
    code = main(["bench", "--engine", "llamacpp", "--threads", "1", "--no-progress", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """Converted GGUFs go under the test's folder, not the user's cache."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# ---------------------------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_draft_folder_benches_in_llama_server_against_its_target_only(
    tmp_path, capsys, cache, tiny_target, drafts, llama_cpp
):
    """The tiny target's HF folder and a DFlash draft folder, both converted by llama.cpp's converter into the
    cache: greedy outputs equal llama.cpp target-only's token by token, llama-server's own counters count accepted
    tokens per position, and the JSON states the interval, threads, context, batch and the target's quantization."""
    folder = drafts.folder("dflash")
    out = tmp_path / "bench.json"
    code, _, err = run_cli(
        capsys, "--target", tiny_target.hf_dir, "--draft", folder, "--prompts", write_prompts(tmp_path / "p.jsonl"),
        "--max-new-tokens", NEW_TOKENS, "--repeats", 1, "--num-draft-tokens", BLOCK, "--ctx-size", 512,
        "--n-batch", 64, "--llama-cpp", llama_cpp.bin_dir, "--json", out,
    )  # fmt: skip
    assert code == 0, err
    r = json.loads(out.read_text())
    assert r["engine"] == "llamacpp" and r["spec_type"] == "draft-dflash" and r["draft_kind"] == "dflash"
    assert r["llama_cpp_build"] is not None
    assert r["outputs_match_target"] is True and r["greedy_agreement"]["rows"] == len(PROMPTS)
    assert r["acceptance"]["accepted"] > 0 and r["acceptance"]["drafted"] >= r["acceptance"]["accepted"]
    counters = r["spec_decode_counters"]  # /metrics agrees with the replies' draft_n / draft_n_accepted
    assert counters["spec_decode_num_accepted_tokens_total"] == r["acceptance"]["accepted"]
    assert counters["spec_decode_num_draft_tokens_total"] == r["acceptance"]["drafted"]
    assert r["per_position_reported"] and len(r["per_position_acceptance"]) == BLOCK
    assert r["per_position_acceptance"][0] > 0 and r["rounds"] > 0
    assert r["tau"] == pytest.approx(1 + r["acceptance"]["accepted"] / r["rounds"])
    lo, hi = r["speedup"]["interval"]
    assert lo <= hi and r["speedup"]["vs_target"] > 0
    assert (r["threads"], r["ctx"], r["batch"]["n_batch"]) == (1, 512, 64)
    assert r["target_quantization"] == "F32" and r["draft_quantization"] == "F32"
    assert set(r["verify_cost_curve"]) == {str(k) for k in range(1, 17)}
    assert all(v > 0 for v in r["verify_cost_curve"].values())
    assert Path(r["target_gguf"]).parent == cache / "gguf" and Path(r["draft_gguf"]).parent == cache / "gguf"


@pytest.mark.slow
def test_auto_picks_k_from_the_measured_curve_and_says_when_none_pays(
    tmp_path, capsys, cache, tiny_target, drafts, llama_cpp
):
    """--num-draft-tokens auto with GGUF files: a pilot at the block, then the K with the highest bound
    tau / (v(K+1) + draft cost); when that bound is below 1 for every K, one plain line with the numbers."""
    out = tmp_path / "auto.json"
    code, _, err = run_cli(
        capsys, "--target", tiny_target.gguf, "--draft", drafts.gguf("dflash"), "--prompts",
        write_prompts(tmp_path / "p.jsonl"), "--max-new-tokens", NEW_TOKENS, "--repeats", 1, "--num-draft-tokens",
        "auto", "--llama-cpp", llama_cpp.bin_dir, "--json", out,
    )  # fmt: skip
    assert code == 0, err
    r = json.loads(out.read_text())
    auto = r["auto"]
    assert r["num_draft_tokens"] == "auto" and auto["pilot_k"] == BLOCK and auto["max_k"] == BLOCK
    best = max(auto["expected_speedup"], key=auto["expected_speedup"].get)
    assert r["num_draft_tokens_used"] == auto["k"] == int(best)
    assert auto["pays"] == (auto["expected_speedup"][best] >= 1)
    if not auto["pays"]:
        assert f"the best, K={auto['k']}: tau " in err and "below 1 for every K in 1..4" in err


# ---------------------------------------------------------------------------------------------------------------
# The curve and the choice of K (pure)
# ---------------------------------------------------------------------------------------------------------------
def bench_rows(ms: dict[int, list[float]]) -> str:
    """llama-bench's -o json for -p sizes -n 0: one row per prompt size (the keys the parser reads)."""
    rows = [
        {"n_prompt": n, "n_gen": 0, "n_depth": 32, "avg_ns": int(sum(s) / len(s) * 1e6),
         "samples_ns": [int(x * 1e6) for x in s]}
        for n, s in ms.items()
    ]  # fmt: skip
    return json.dumps(rows + [{"n_prompt": 0, "n_gen": 16, "avg_ns": 1, "samples_ns": [1]}])


def test_parse_llama_bench_is_each_batch_over_one_token_by_medians():
    curve = parse_llama_bench(bench_rows({1: [10, 10, 90], 2: [12, 13, 14], 3: [15, 15, 15], 5: [20, 20, 20]}))
    assert curve == {1: pytest.approx(1.3), 2: pytest.approx(1.5), 4: pytest.approx(2.0)}  # a spike is not the median
    assert parse_llama_bench(bench_rows({1: [10], 2: [11], 3: [12]}), max_k=1) == {1: pytest.approx(1.1)}
    with pytest.raises(ValueError, match="no 1-token test"):
        parse_llama_bench(bench_rows({2: [11]}))
    with pytest.raises(ValueError, match="did not print JSON"):
        parse_llama_bench("main: error: failed to load model")


def test_per_position_acceptance_from_llama_server_counters():
    before = {"spec_decode_num_drafts_total": 2.0, "spec_decode_num_accepted_tokens_per_pos_total": [2.0, 1.0]}
    after = {
        "spec_decode_num_drafts_total": 12.0, "spec_decode_num_draft_tokens_total": 30.0,
        "spec_decode_num_accepted_tokens_total": 14.0,
        "spec_decode_num_accepted_tokens_per_pos_total": [10.0, 6.0, 3.0],
    }  # fmt: skip
    counters = counter_delta(before, after)
    assert counters["spec_decode_num_accepted_tokens_per_pos_total"] == [8.0, 5.0, 3.0]
    assert per_position(counters) == pytest.approx([0.8, 5 / 8, 3 / 5])
    del after["spec_decode_num_accepted_tokens_per_pos_total"]  # a build that does not report them: null
    assert per_position(counter_delta(before, after)) is None


def test_choose_k_takes_the_highest_bound_and_a_block_draft_costs_the_same_at_any_k():
    curve = {1: 1.1, 2: 1.2, 3: 1.3, 4: 2.0}
    rates = [0.9, 0.8, 0.5, 0.5]
    cost = {"target_tokens": 0.2, "mean_k": 4.0}
    choice = choose_k(rates, curve, cost, block=True, max_k=4)
    tau = {1: 1.9, 2: 1.9 + 0.72, 3: 1.9 + 0.72 + 0.36, 4: 1.9 + 0.72 + 0.36 + 0.18}
    for k in curve:
        assert choice["expected_speedup"][k] == pytest.approx(tau[k] / (curve[k] + 0.2))
    assert choice["k"] == 3 and choice["pays"]
    chain = choose_k(rates, curve, cost, block=False, max_k=4)  # 0.05 a drafted token
    assert chain["draft"][2] == pytest.approx(0.1) and chain["k"] == 3
    assert choose_k(rates, curve, cost, block=True, max_k=2)["k"] == 2


def test_when_no_k_pays_the_line_says_so_with_the_bound_and_its_numbers():
    """A verify that costs as much as the tokens it checks (a CPU at one thread) and a slow draft: no K pays."""
    curve = {k: 1.0 + 0.9 * k for k in range(1, 17)}
    choice = choose_k([0.6] * 16, curve, {"target_tokens": 3.0, "mean_k": 16.0}, block=False, max_k=16)
    assert not choice["pays"] and choice["k"] == 1
    assert choice["expected_speedup"][1] == pytest.approx(1.6 / (1.9 + 3.0 / 16))
    line = cannot_pay(choice)
    assert "\n" not in line
    assert line.startswith("no draft length can pay in llama.cpp here: the bound tau / (v(K+1) + draft cost)")
    assert "below 1 for every K in 1..16" in line
    assert "K=1: tau 1.60 / (v 1.90 + draft 0.19) = 0.77" in line


# ---------------------------------------------------------------------------------------------------------------
# Bad inputs: one error line, exit 2, nothing written
# ---------------------------------------------------------------------------------------------------------------
def refused(capsys, tmp_path, *args) -> str:
    out = tmp_path / "never.json"
    code, stdout, err = run_cli(capsys, "--prompts", write_prompts(tmp_path / "p.jsonl"), "--json", out, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert not out.exists() and not stdout
    return lines[0]


def test_no_llama_cpp_where_it_was_pointed_says_where_it_looked_and_how_to_get_it(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    line = refused(capsys, tmp_path, "--target", "t.gguf", "--draft", "d.gguf", "--llama-cpp", empty)
    assert f"looked in: {empty} (--llama-cpp)" in line and "bench/build_llama_cpp.sh" in line


def test_a_kind_llama_cpp_does_not_serve_is_refused_naming_it(tmp_path, capsys, tiny_target, llama_cpp):
    """A PARD folder (a causal LM whose config marks its mask token): no llama.cpp speculative type runs it."""
    folder = tmp_path / "pard"
    folder.mkdir()
    config = json.loads((tiny_target.hf_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "pard_token": 3, "block_size": 4}))
    line = refused(capsys, tmp_path, "--target", tiny_target.gguf, "--draft", folder, "--llama-cpp", llama_cpp.bin_dir)
    assert "draft.kind=pard" in line and "cannot be served by llama.cpp" in line and "parallel_drafting" in line


def test_a_draft_whose_vocabulary_does_not_fit_the_gguf_target_is_refused(tmp_path, capsys, tiny_target, llama_cpp):
    """A GGUF draft with another tokenizer (its header written by gguf-py: a byte vocabulary of 260 tokens)."""
    from gguf import GGUFWriter

    draft = tmp_path / "bytes.gguf"
    writer = GGUFWriter(str(draft), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<{i}>" for i in range(260)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    line = refused(capsys, tmp_path, "--target", tiny_target.gguf, "--draft", draft, "--llama-cpp", llama_cpp.bin_dir)
    assert f"--target {tiny_target.gguf.name} and --draft bytes.gguf do not fit" in line
    assert "vocabularies of 49152 and 260 tokens" in line


def test_a_draft_over_another_targets_hidden_states_is_refused(tmp_path, capsys, drafts, llama_cpp):
    """The tiny target's EAGLE-3 head (it reads 64-wide hidden states) beside SmolLM2 (576 wide), same tokenizer."""
    target = h.smollm2_gguf()
    line = refused(
        capsys, tmp_path, "--target", target, "--draft", drafts.gguf("eagle3"), "--llama-cpp", llama_cpp.bin_dir
    )
    assert "the draft reads hidden states 64 wide, the target's embedding_length is 576" in line


def test_a_target_the_converter_cannot_read_is_refused_with_its_reason(tmp_path, capsys, cache, llama_cpp):
    """An HF target with a BPE tokenizer llama.cpp's converter does not know (tests/tiny.py's own)."""
    from tests.tiny import make_pair

    target, draft = make_pair(tmp_path / "pair")
    line = refused(capsys, tmp_path, "--target", target, "--draft", draft, "--llama-cpp", llama_cpp.bin_dir)
    assert "llama.cpp's converter refused" in line and "pre-tokenizer" in line.lower()
    assert not any(cache.rglob("*.gguf"))
