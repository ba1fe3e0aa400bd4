"""Lossless speculative decoding (Leviathan et al. 2023; Chen et al. 2023) for HF causal LMs.

One round, per batch row:

    draft:   feed the tokens the draft has not cached yet, then propose d_1..d_g one forward at a time (q_i)
    verify:  one target forward over [pending token, d_1..d_g] -> p_1..p_{g+1}
    accept:  d_i with probability min(1, p_i(d_i) / q_i(d_i)) until the first rejection; there sample from
             norm(max(0, p - q)); if all g are accepted, sample a bonus token from p_{g+1}
    rollback: crop both KV caches to what was accepted

Invariants between rounds: the target has cached every token but the last one (the "pending" token, fed
first in the next verify pass, so each round is exactly one target forward and the first round is the
target's prefill). How the draft proposes and what it keeps between rounds is its *kind*'s business
(``decode.kinds``): a standalone LM reads the tokens it has not cached yet; an EAGLE-3 head reads the target's
hidden states of the verify pass (it drafts nothing in the first round: it needs the prompt's features first).

Batch rows accept different numbers of tokens: each model's cache is a ``decode.kv_stream.KVStream``, one
physical KV cache for the batch with per-row holes, so every row decodes as if alone. Finished rows leave the
batch. The acceptance rules are pure functions in ``decode.acceptance``; vocabulary and context checks live in
``decode.compat``; what a call returns and when a row stops in ``decode.output``. This module holds the loops:
``speculative_generate`` and the target-only ``target_generate`` (draft trees: ``decode.tree``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from decode import acceptance, tree
from decode.compat import check_context, logits_width
from decode.draft_length import AutoDraftLength, FixedDraftLength, TreeShape, is_tree_spec, parse_tree
from decode.kinds.dispatch import BLOCK_KINDS, Verified, check_draft_length, drafter_for, kind_of
from decode.kinds.drafting import all_real
from decode.kv_stream import KVStream, decoding
from decode.output import Emitter, SpecOutput, SpecStats, eos_ids, pack
from decode.sampling import process_logits, sample, validate_sampling

DraftLength = FixedDraftLength | AutoDraftLength | TreeShape


def _prepare_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    elif attention_mask.dim() == 1:
        attention_mask = attention_mask[None]
    if input_ids.shape[1] == 0 or bool((attention_mask.sum(1) == 0).any()):
        raise ValueError("every prompt needs at least one token")
    return input_ids, attention_mask.bool()


def _draft_length(num_draft_tokens, draft_cost_ratio: float | None) -> DraftLength:
    if isinstance(num_draft_tokens, (FixedDraftLength, AutoDraftLength, TreeShape)):
        return num_draft_tokens
    if num_draft_tokens == "auto":
        return AutoDraftLength(draft_cost_ratio=draft_cost_ratio)
    if is_tree_spec(num_draft_tokens):
        return parse_tree(num_draft_tokens)
    if isinstance(num_draft_tokens, str):
        if not num_draft_tokens.isdigit():
            raise ValueError(f"num_draft_tokens must be an int >= 1 or 'auto', got {num_draft_tokens!r}")
        num_draft_tokens = int(num_draft_tokens)
    return FixedDraftLength(int(num_draft_tokens))


# ---------------------------------------------------------------------------------------------------------------
# The decoder
# ---------------------------------------------------------------------------------------------------------------
def speculative_generate(
    target: nn.Module,
    draft: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 64,
    num_draft_tokens: int | str | DraftLength = 5,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    stop_strings: str | list[str] | None = None,
    tokenizer=None,
    generator: torch.Generator | None = None,
    draft_cost_ratio: float | None = None,
    vocab: int | None = None,
) -> SpecOutput:
    """Generate with ``target`` as fast as ``draft`` allows, with exactly the target's output distribution.

    Args:
        target, draft: HF causal LMs (or anything with the same forward signature) sharing token ids (check
            with ``decode.compat.check_vocab_compatible``).
        input_ids: ``[batch, prompt_len]`` (left-padded for batch > 1) or ``[prompt_len]``.
        attention_mask: ``[batch, prompt_len]``, 0 on padding; never inferred from token ids (pad may equal EOS).
        max_new_tokens: per-row budget.
        num_draft_tokens: gamma (int), ``"auto"``, or a ``FixedDraftLength`` / ``AutoDraftLength`` to reuse.
        temperature, top_k, top_p: one processing path for p and q; temperature 0 is greedy.
        eos_token_id: int or list; None = the target's ``generation_config.eos_token_id``; ``[]`` = never stop.
        stop_strings: stop after the token that completes any of these (needs ``tokenizer``).
        generator: RNG for sampling (draft tokens, acceptance, resampling).
        draft_cost_ratio: c for ``auto``; measured from the loop's timings when None.
        vocab: the logits width both models are cut to (``check_vocab_compatible``'s result); None = the
            target's full width (a narrower draft then raises). Pass the same value to ``target_generate`` for a
            baseline over the same tokens.

    Returns:
        SpecOutput; greedy ``new_tokens`` equal target-only greedy decoding token for token.
    """
    validate_sampling(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    input_ids, prompt_mask = _prepare_inputs(input_ids, attention_mask)
    vocab = _cut_width(vocab, target, draft)  # callers check tokenizers: check_vocab_compatible
    check_context({"target": target, "draft": draft}, int(prompt_mask.sum(1).max()), max_new_tokens)
    controller = _draft_length(num_draft_tokens, draft_cost_ratio)
    if isinstance(controller, FixedDraftLength):
        check_draft_length(draft, controller.max_gamma)  # a block draft: not above its trained block
    elif isinstance(controller, AutoDraftLength):
        controller.block = kind_of(draft) in BLOCK_KINDS  # its further tokens cost only verify time
    batch = input_ids.shape[0]
    if isinstance(controller, TreeShape):
        tree.check_tree(draft, batch, temperature)
        return tree.tree_generate(
            target, draft, input_ids, prompt_mask, shape=controller, max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id, stop_strings=stop_strings, tokenizer=tokenizer, vocab=vocab,
        )  # fmt: skip
    eos = eos_ids(target, eos_token_id)
    greedy = temperature == 0
    emitter = Emitter(batch, max_new_tokens, eos, stop_strings, tokenizer)
    stats = SpecStats()

    def proc(logits: torch.Tensor) -> torch.Tensor:
        return process_logits(logits, temperature, top_k, top_p)

    with decoding(target, draft):
        tgt = KVStream(target, batch, vocab)
        drafter = drafter_for(draft, batch, vocab, input_ids, prompt_mask)
        rows = list(range(batch))  # original index of each live row
        # Tokens the target has not cached yet, [B, k], with validity (holes left of real tokens; None = all real).
        tgt_ids, tgt_valid = input_ids, prompt_mask
        first = True
        while rows:
            budget = max(emitter.remaining(r) for r in rows)
            gamma_cap = min(controller.max_gamma, budget - 1)  # the round also emits one target token

            # ---- draft: g tokens (the drafter's kind decides how; a standalone draft reads its pending tokens)
            t0 = time.perf_counter()
            draft_tokens, q = drafter.propose(controller, gamma_cap, proc, greedy, generator)
            g = draft_tokens.shape[1]
            t1 = time.perf_counter()

            # ---- verify: one target forward over [pending, d_1..d_g] -> p_1..p_{g+1}
            draft_tokens = draft_tokens.to(tgt.device)
            ids = torch.cat([tgt_ids.to(tgt.device), draft_tokens], 1)
            valid = None if tgt_valid is None else torch.cat([tgt_valid.to(tgt.device), all_real(draft_tokens)], 1)
            features = None
            if drafter.aux_layers is None:
                logits = tgt.feed(ids, valid, keep=g + 1)  # [B, g + 1, V]
            else:
                logits, features = tgt.feed_with_features(ids, valid, keep=g + 1, layers=drafter.aux_layers)
            if greedy:
                accepted, nxt = acceptance.accept_greedy(draft_tokens, logits)
            else:
                accepted, nxt = acceptance.accept_sampled(draft_tokens, q.to(tgt.device), proc(logits), generator)
            acc_list = accepted.tolist()  # the one host sync per round
            t2 = time.perf_counter()

            # ---- rollback: the target keeps [pending, d_1..d_n]; the drafter keeps what it read of d_1..d_n
            tgt.rollback(g, accepted, acc_list)
            drafter.update(Verified(ids, valid, draft_tokens, accepted, acc_list, nxt, features))
            tgt_ids, tgt_valid = nxt[:, None], None
            # The first round is both models' prefill: its times say nothing about per-token costs.
            controller.end_round(g, accepted, None if first else t1 - t0, None if first else t2 - t1)
            first = False

            # ---- emit, count, retire finished rows
            drafted = draft_tokens.tolist()
            nxt_list = nxt.tolist()
            done = []
            for i, r in enumerate(rows):
                before = len(emitter.out[r])
                if emitter.emit(r, drafted[i][: acc_list[i]] + [nxt_list[i]]):
                    done.append(i)
                stats.new_tokens += len(emitter.out[r]) - before
            _count_round(stats, g, acc_list, len(rows))
            if done:
                finished = set(done)
                keep = [i for i in range(len(rows)) if i not in finished]
                if not keep:
                    break
                sel = torch.tensor(keep, dtype=torch.long)
                tgt.select(sel)
                drafter.select(sel)
                rows = [rows[i] for i in keep]
                tgt_ids = tgt_ids[sel.to(tgt_ids.device)]
        stats.target_forwards = tgt.forwards
        stats.draft_forwards = drafter.forwards

    pad = min(eos) if eos else 0
    return SpecOutput(sequences=pack(input_ids, emitter.out, pad), new_tokens=emitter.out, stats=stats)


def _count_round(stats: SpecStats, g: int, accepted: list[int], live_rows: int) -> None:
    stats.rounds += 1
    stats.row_rounds += live_rows
    stats.gamma_used.append(g)
    stats.drafted += g * live_rows
    stats.accepted += sum(accepted)
    if len(stats.per_position_drafted) < g:
        grow = g - len(stats.per_position_drafted)
        stats.per_position_drafted += [0] * grow
        stats.per_position_accepted += [0] * grow
    for a in accepted:
        # Position i was judged iff all before it were accepted: i <= a (and i < g).
        for i in range(min(a + 1, g)):
            stats.per_position_drafted[i] += 1
        for i in range(a):
            stats.per_position_accepted[i] += 1


def _cut_width(vocab: int | None, target: nn.Module, *drafts: nn.Module) -> int:
    """The logits width the loops decode over: ``vocab``, or the target's full width when None.

    A narrower draft needs an explicit ``vocab``: cutting silently would drop target tokens the draft lacks.
    """
    narrowest = min(logits_width(m) for m in (target, *drafts))
    if vocab is None:
        vocab = logits_width(target)
        if narrowest < vocab:
            raise ValueError(
                f"the draft has {narrowest} logits, fewer than the target's {vocab}: pass "
                "vocab=decode.compat.check_vocab_compatible(target, draft, tokenizer) to decode over the shared width"
            )
        return vocab
    if not 0 < vocab <= narrowest:
        raise ValueError(f"vocab={vocab} must be in 1..{narrowest} (the narrowest model's logits width)")
    return vocab


def _drop_rows(
    stream: KVStream, rows: list[int], gone: list[int], tensor: torch.Tensor
) -> tuple[list[int], torch.Tensor]:
    """Rows ``gone`` (indices into ``rows``) leave the batch: the stream's cache, ``rows`` and ``tensor``'s rows."""
    gone_set = set(gone)
    keep = [i for i in range(len(rows)) if i not in gone_set]
    if not keep:
        return [], tensor[:0]
    sel = torch.tensor(keep, dtype=torch.long)
    stream.select(sel)
    return [rows[i] for i in keep], tensor[sel.to(tensor.device)]


def target_generate(
    target: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    vocab: int | None = None,
    observer: Any = None,
) -> SpecOutput:
    """draftsmith's own target-only loop: same KV handling and sampling path as ``speculative_generate``.

    Args:
        input_ids: ``[batch, prompt_len]`` left-padded; attention_mask: ``[batch, prompt_len]``.
        vocab: the logits width to decode over; None = the target's full width. Given the width
            ``speculative_generate`` used, both loops choose among exactly the same tokens.
        observer: sees the target's side of every input, once each (what
            ``decode.kinds.eagle3.train_step.GenerationRecorder`` keeps for training): each forward calls
            ``observer.seen(rows, logits, states, valid)`` with the logits of all its inputs ``[B, q, vocab]``
            and the hidden states at ``observer.layers`` side by side ``[B, q, ...]``; a finished row is fed its
            last token once more before it leaves the batch. The tokens chosen do not change.

    Returns:
        SpecOutput with ``stats.target_forwards`` = forwards run (``drafted`` stays 0).
    """
    validate_sampling(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    input_ids, prompt_mask = _prepare_inputs(input_ids, attention_mask)
    check_context({"target": target}, int(prompt_mask.sum(1).max()), max_new_tokens)
    emitter = Emitter(input_ids.shape[0], max_new_tokens, eos_ids(target, eos_token_id), None, None)
    stats = SpecStats()
    with decoding(target):
        stream = KVStream(target, input_ids.shape[0], _cut_width(vocab, target))
        rows = list(range(input_ids.shape[0]))
        ids, valid = input_ids, prompt_mask
        leaving: list[int] = []  # with an observer: rows done last round, fed their last token for it to see
        while rows:
            if observer is None:
                logits = stream.feed(ids, valid, keep=1)[:, -1]
            else:
                full, states = stream.feed_with_features(ids, valid, ids.shape[1], observer.layers)
                observer.seen(rows, full, states, valid)
                logits = full[:, -1]
            if leaving:
                rows, logits = _drop_rows(stream, rows, leaving, logits)
                leaving = []
                if not rows:
                    break
            if temperature == 0:
                token = logits.argmax(-1)
            else:
                token = sample(process_logits(logits, temperature, top_k, top_p), generator)
            tokens = token.tolist()
            done = [i for i, r in enumerate(rows) if emitter.emit(r, [tokens[i]])]
            stats.rounds += 1
            stats.row_rounds += len(rows)
            stats.new_tokens += len(rows)
            ids, valid = token[:, None], None
            if done and observer is not None:
                leaving = done
            elif done:
                rows, ids = _drop_rows(stream, rows, done, ids)
        stats.target_forwards = stream.forwards
    eos = eos_ids(target, eos_token_id)
    return SpecOutput(
        sequences=pack(input_ids, emitter.out, min(eos) if eos else 0), new_tokens=emitter.out, stats=stats
    )
