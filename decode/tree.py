"""Greedy tree drafting (a kind whose ``TRAITS.draft_tree`` says it grows trees: an EAGLE-3 head): EAGLE-2's
dynamic draft tree, what SGLang serves with ``--speculative-eagle-topk`` above 1.

A chain bets each round on the head's single best guess at every depth; once it misses, the round is over. A
tree keeps several guesses alive: each round the head

    reads the target's features of the tokens accepted last round, and proposes TOPK tokens (depth 1);
    for each further depth, runs ONE forward over the TOPK most likely nodes of the previous depth (each
    attending to the committed context and to its own ancestors) and proposes TOPK children of each;
    keeps the NODES most likely nodes of everything it proposed, a node's likelihood being the product of the
    head's probabilities along its path (a parent is always at least as likely as its child, so the kept
    nodes form a tree).

The target verifies all NODES in one forward (each node sees the committed tokens and its ancestors, at the
position of its depth), then the round keeps the longest path on which every token is the target's greedy
choice, plus the target's own token after it. Every emitted token is the target's argmax given the tokens
before it, so the output is target-only greedy decoding, token for token; a miss at depth 1 still yields
that one target token. Greedy only and batch 1: sampled trees need multi-draft rejection sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from decode import kinds
from decode.draft_length import TreeShape
from decode.kinds.dispatch import MODULES, Verified, kind_of
from decode.kv_stream import KVStream, decoding
from decode.output import Emitter, SpecOutput, SpecStats, eos_ids, pack


# ---------------------------------------------------------------------------------------------------------------
# The tree
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class DraftTree:
    """Draft tokens in an order where every parent comes before its children."""

    tokens: list[int]  # target token ids
    parents: list[int]  # index of each node's parent in this list; -1: the round's pending token (the root)
    depths: list[int]  # 1 for the root's children


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: node i may attend to node j iff j is i or one of i's ancestors (parents precede children)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def best_nodes(scores: list[float], parents: list[int], depths: list[int], n: int) -> list[int]:
    """The ``n`` highest-scoring nodes, parents first. Scores never rise along a path, so sorting by
    (score descending, depth) puts every parent before its children and any prefix is a tree."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], depths[i], i))[:n]
    rank = {node: r for r, node in enumerate(order)}
    assert all(parents[i] < 0 or parents[i] in rank for i in order), "kept nodes must form a tree"
    return sorted(order, key=lambda i: (depths[i], rank[i]))


def prune(pool: tuple[list[int], list[float], list[int], list[int]], nodes: int) -> DraftTree:
    """The tree of the ``nodes`` most likely nodes of a drafter's pool (tokens, path log-likelihoods, parents,
    depths: what a tree drafter's ``grow`` proposes)."""
    tokens, scores, parents, depths = pool
    keep = best_nodes(scores, parents, depths, nodes)
    where = {node: j for j, node in enumerate(keep)}
    return DraftTree(
        tokens=[tokens[i] for i in keep],
        parents=[where[parents[i]] if parents[i] >= 0 else -1 for i in keep],
        depths=[depths[i] for i in keep],
    )


def accepted_path(tree: DraftTree, greedy_tokens: list[int]) -> tuple[list[int], int]:
    """The longest path of nodes that are the target's greedy tokens, and the target's token after it.

    ``greedy_tokens[0]`` is the target's argmax after the root, ``greedy_tokens[1 + i]`` after node i.
    """
    path: list[int] = []
    at = -1
    while True:
        want = greedy_tokens[at + 1]
        nxt = next((i for i, p in enumerate(tree.parents) if p == at and tree.tokens[i] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        at = nxt


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------
def check_tree(draft: nn.Module | str, batch: int, temperature: float) -> None:
    """One ValueError for anything a draft tree cannot decode (``draft``: the draft, or its kind's name)."""
    kind = draft if isinstance(draft, str) else kind_of(draft)
    if not kinds.traits(kind).draft_tree:
        growers = " or ".join(t.description for t in kinds.KINDS.values() if t.draft_tree)
        raise ValueError(f"a draft tree needs {growers}: a {kind} draft drafts a chain or a block (an integer gamma)")
    if temperature != 0:
        raise ValueError("a draft tree decodes greedily: use temperature 0, or a chain (an integer gamma) to sample")
    if batch != 1:
        raise ValueError("a draft tree decodes one prompt at a time: use batch size 1, or a chain for batches")


def tree_generate(
    target: nn.Module,
    draft: nn.Module,
    input_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    shape: TreeShape,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None,
    stop_strings: str | list[str] | None,
    tokenizer,
    vocab: int,
) -> SpecOutput:
    """Greedy speculative decoding of one prompt ``input_ids`` [1, P] (``prompt_mask`` [1, P] bool) with a draft
    tree grown by ``draft``'s kind (its decoding module's ``tree_drafter``; ``decode.speculative.speculative_generate``
    comes here for a ``tree:`` draft length)."""
    emitter = Emitter(1, max_new_tokens, eos_ids(target, eos_token_id), stop_strings, tokenizer)
    stats = SpecStats()
    prompt = input_ids[:, prompt_mask[0].to(input_ids.device)]  # without padding, if any was given
    with decoding(target, draft):
        tgt = KVStream(target, 1, vocab)
        drafter = MODULES[kind_of(draft)].tree_drafter(draft, vocab)
        layers = drafter.aux_layers
        # The first round is the prompt's prefill: the head has no features to draft from yet.
        logits, features = tgt.feed_with_features(prompt, None, keep=1, layers=layers)
        root = int(logits[0, -1].argmax())
        empty = prompt.new_zeros(1, 0)
        one = torch.ones(1, dtype=torch.long)
        drafter.update(Verified(prompt, None, empty, one * 0, [0], one * root, features))
        done = emitter.emit(0, [root])
        stats.new_tokens, stats.rounds, stats.row_rounds = 1, 1, 1
        while not done:
            depth = min(shape.depth, emitter.remaining(0) - 1)  # the round also emits one target token
            tree = prune(drafter.grow(shape.topk, depth, vocab), shape.nodes) if depth > 0 else DraftTree([], [], [])
            ids = torch.tensor([[root, *tree.tokens]], device=tgt.device)
            ancestors = ancestor_mask([-1] + [p + 1 for p in tree.parents])
            logits, features = tgt.feed_tree(ids, torch.tensor([0, *tree.depths]), ancestors, layers)
            path, bonus = accepted_path(tree, logits[0].argmax(-1).tolist())
            kept = [0] + [1 + i for i in path]
            tgt.keep(ids.shape[1], kept)
            path_ids = ids[:, kept]
            n = len(path)
            drafter.update(
                Verified(path_ids, None, path_ids[:, 1:], one * n, [n], one * bonus, features[:, kept])
            )  # fmt: skip
            before = len(emitter.out[0])
            done = emitter.emit(0, [tree.tokens[i] for i in path] + [bonus])
            stats.new_tokens += len(emitter.out[0]) - before
            _count_tree_round(stats, tree, n, depth)
            root = bonus
        stats.target_forwards = tgt.forwards
        stats.draft_forwards = drafter.forwards
    eos = eos_ids(target, eos_token_id)
    return SpecOutput(pack(input_ids, emitter.out, min(eos) if eos else 0), emitter.out, stats)


def _count_tree_round(stats: SpecStats, tree: DraftTree, accepted: int, depth: int) -> None:
    """A tree round in the chain's counters: ``drafted`` counts the nodes verified, ``gamma_used`` the head's
    forwards (what the round's drafting cost), per-position acceptance is by depth."""
    stats.rounds += 1
    stats.row_rounds += 1
    stats.drafted += len(tree.tokens)
    stats.accepted += accepted
    stats.gamma_used.append(depth)
    deepest = max(tree.depths, default=0)
    grow = deepest - len(stats.per_position_drafted)
    if grow > 0:
        stats.per_position_drafted += [0] * grow
        stats.per_position_accepted += [0] * grow
    for i in range(min(accepted + 1, deepest)):
        stats.per_position_drafted[i] += 1
    for i in range(accepted):
        stats.per_position_accepted[i] += 1
