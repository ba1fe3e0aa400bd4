"""Greedy tree drafting from an EAGLE-3 head: the tree the head grows, the target's tree forward (each node sees
its ancestors only), and the loop's output equal to target-only greedy decoding."""

from __future__ import annotations

import pytest
import torch

from decode.draft_length import TreeShape, parse_tree
from decode.kv_stream import KVStream, decoding
from decode.speculative import speculative_generate, target_generate
from decode.tree import DraftTree, accepted_path, ancestor_mask, best_nodes
from tests.test_eagle3 import EAGLE_ARCHS, bench_argv, fit_head, tiny_target
from tests.tiny import CHAR_VOCAB


@pytest.fixture(scope="module")
def llama_pair():
    target = tiny_target("llama")
    return target, fit_head(target, range(0, CHAR_VOCAB - 7))


def test_parse_tree_and_its_errors():
    assert parse_tree("tree:4,5,16") == TreeShape(4, 5, 16) and str(TreeShape(4, 5, 16)) == "tree:4,5,16"
    for bad in ("tree:4,5", "tree:a,5,16", "tree:0,5,16", "tree:2,2,7", "tree"):
        with pytest.raises(ValueError, match="e.g. tree:4,5,16"):
            parse_tree(bad)


def test_ancestor_mask_and_best_nodes():
    #   root -> 0 -> 2 -> 3 ; root -> 1
    mask = ancestor_mask([-1, -1, 0, 2])
    assert mask.tolist() == [
        [True, False, False, False],
        [False, True, False, False],
        [True, False, True, False],
        [True, False, True, True],
    ]
    # Equal scores along a path (a child of probability 1) still keep the parent first.
    scores, parents, depths = [-0.1, -1.0, -0.1, -2.0], [-1, -1, 0, 2], [1, 1, 2, 3]
    assert best_nodes(scores, parents, depths, 3) == [0, 1, 2]
    assert best_nodes(scores, parents, depths, 2) == [0, 2]


def test_accepted_path_follows_the_target_greedy_tokens():
    tree = DraftTree(tokens=[5, 6, 7, 8], parents=[-1, -1, 0, 1], depths=[1, 1, 2, 2])
    # argmax after root, after node 0..3
    assert accepted_path(tree, [6, 0, 0, 0, 0]) == ([1], 0)  # root -> 6 (node 1) -> 0 is not a child of node 1
    assert accepted_path(tree, [5, 7, 0, 9, 0]) == ([0, 2], 9)
    assert accepted_path(tree, [3, 7, 0, 9, 0]) == ([], 3)


def test_a_tree_forward_gives_each_node_its_own_path(llama_pair):
    """Each node's logits in one tree forward equal a plain forward over the committed tokens and its path."""
    target, _ = llama_pair
    prompt = torch.randint(0, CHAR_VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    tree = DraftTree(tokens=[11, 12, 13, 14, 15], parents=[-1, -1, 0, 0, 2], depths=[1, 1, 2, 2, 3])
    root = 9
    with decoding(target):
        stream = KVStream(target, 1, CHAR_VOCAB)
        stream.feed(prompt, None, keep=1)
        ids = torch.tensor([[root, *tree.tokens]])
        parents = [-1] + [p + 1 for p in tree.parents]
        logits, features = stream.feed_tree(ids, torch.tensor([0, *tree.depths]), ancestor_mask(parents), [1, 2])
        for node in range(ids.shape[1]):
            path, at = [], node
            while at >= 0:
                path.insert(0, int(ids[0, at]))
                at = parents[at]
            plain = target(torch.cat([prompt, torch.tensor([path])], 1), output_hidden_states=True)
            torch.testing.assert_close(logits[0, node], plain.logits[0, -1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(features[0, node, : target.config.hidden_size], plain.hidden_states[1][0, -1])
        # Committing the path root -> 11 -> 13 -> 15 leaves the cache a plain forward over that path builds.
        stream.keep(ids.shape[1], [0, 1, 3, 5])
        assert stream.slots == 7 + 4 and int(stream.length) == 11
        nxt = stream.feed(torch.tensor([[3]]), None, keep=1)
        plain = target(torch.cat([prompt, torch.tensor([[root, 11, 13, 15, 3]])], 1)).logits[:, -1]
        torch.testing.assert_close(nxt[:, -1], plain, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", EAGLE_ARCHS)
def test_greedy_tree_equals_target_only_every_architecture(arch):
    target = tiny_target(arch)
    head = fit_head(target, range(CHAR_VOCAB), steps=80)
    prompt = torch.randint(0, CHAR_VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    want = target_generate(target, prompt, max_new_tokens=40, eos_token_id=[]).new_tokens
    chain = speculative_generate(target, head, prompt, max_new_tokens=40, num_draft_tokens=3, eos_token_id=[])
    for spec in ("tree:1,3,3", "tree:3,4,10", "tree:4,5,16"):
        out = speculative_generate(target, head, prompt, max_new_tokens=40, num_draft_tokens=spec, eos_token_id=[])
        assert out.new_tokens == want, (arch, spec)
        s = out.stats
        assert s.accepted > 0 and s.target_forwards == s.rounds
        if spec == "tree:1,3,3":  # a one-wide tree is the chain
            assert s.accepted == chain.stats.accepted and s.rounds == chain.stats.rounds
    wide = speculative_generate(target, head, prompt, max_new_tokens=40, num_draft_tokens="tree:4,5,16")
    assert wide.stats.mean_accepted_length >= chain.stats.mean_accepted_length


def test_tree_budget_eos_and_draft_vocabulary(llama_pair):
    target, head = llama_pair  # its draft vocabulary leaves out the last 7 ids
    prompt = torch.tensor([[4, 5, 6]])
    ref = target_generate(target, prompt, max_new_tokens=5, eos_token_id=[]).new_tokens[0]
    for budget in (1, 2, 5, 23):
        out = speculative_generate(target, head, prompt, max_new_tokens=budget, num_draft_tokens="tree:3,4,9")
        assert out.new_tokens == target_generate(target, prompt, max_new_tokens=budget).new_tokens
    padded = speculative_generate(
        target, head, torch.tensor([[0, 0, 4, 5, 6]]), torch.tensor([[0, 0, 1, 1, 1]]), max_new_tokens=5,
        num_draft_tokens="tree:3,4,9", eos_token_id=[],
    )  # fmt: skip
    assert padded.new_tokens[0] == ref  # left padding of a single prompt is dropped
    eos = ref[3]
    out = speculative_generate(
        target, head, prompt, max_new_tokens=24, num_draft_tokens="tree:3,4,9", eos_token_id=eos
    )
    assert out.new_tokens == target_generate(target, prompt, max_new_tokens=24, eos_token_id=eos).new_tokens


def test_a_tree_over_a_narrow_decoded_width_proposes_only_tokens_inside_it():
    """Decoding over the first 3 token ids leaves each node fewer than TOPK children the head can propose."""
    target = tiny_target("llama")
    head = fit_head(target, [0, 1, 2, *range(60, CHAR_VOCAB)], steps=20)
    prompt = torch.tensor([[1, 2, 0, 1]])
    want = target_generate(target, prompt, max_new_tokens=20, eos_token_id=[], vocab=3).new_tokens
    out = speculative_generate(
        target, head, prompt, max_new_tokens=20, num_draft_tokens="tree:4,3,9", eos_token_id=[], vocab=3
    )
    assert out.new_tokens == want and all(t < 3 for t in out.new_tokens[0])


def test_tree_errors(llama_pair):
    target, head = llama_pair
    prompt = torch.tensor([[4, 5, 6]])
    cases = [
        (dict(temperature=0.8), "decodes greedily"),
        (dict(input_ids=torch.tensor([[4, 5, 6], [7, 8, 9]])), "one prompt at a time"),
        (dict(draft=target), "needs an EAGLE-3 head"),
    ]
    for kwargs, message in cases:
        args = dict(target=target, draft=head, input_ids=prompt, max_new_tokens=8, num_draft_tokens="tree:2,2,4")
        with pytest.raises(ValueError, match=message):
            speculative_generate(**{**args, **kwargs})


def test_bench_cli_measures_a_tree(tmp_path, llama_pair, capsys):
    import json

    from decode.__main__ import main

    target, head = llama_pair
    out = tmp_path / "bench.json"
    argv = bench_argv(tmp_path, target, head, 2, "--max-new-tokens", "12", "--baselines", "target")
    assert main([*argv, "--num-draft-tokens", "tree:2,3,4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["num_draft_tokens"] == "tree:2,3,4" and result["outputs_match_target"] is True
    assert result["mean_num_draft_tokens"] <= 3 and result["mean_accepted_length"] > 1
    assert set(result["forward_ms"]["verify"]) == {"5"}  # the root and the 4 nodes
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*argv, "--num-draft-tokens", "tree:2,3"])
    assert "e.g. tree:4,5,16" in capsys.readouterr().err
    assert main([*argv, "--num-draft-tokens", "tree:2,3,4", "--batch-size", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: a draft tree decodes one prompt")
