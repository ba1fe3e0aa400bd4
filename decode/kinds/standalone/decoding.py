"""The standalone draft kind: a small causal LM with the target's tokenizer, which sees tokens only.

It keeps its own KV cache (``decode.kv_stream.KVStream``) and proposes one forward per token; after the
target's verify pass its cache is cropped to what was accepted. Served as it is by HF ``assistant_model``, vLLM
``method: draft_model`` and SGLang ``STANDALONE``; saved as an ordinary HF checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from decode.kinds.drafting import Verified, all_real
from decode.kinds.standalone import TRAITS
from decode.kv_stream import KVStream
from decode.sampling import sample

NAME = TRAITS.name


def draft_tokens(
    first_logits: torch.Tensor, step, controller, gamma_cap: int, proc, greedy: bool, generator
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The chain every kind drafts: pick a token from ``first_logits`` [B, V], then ``step(token)`` gives the next
    logits, until ``gamma_cap`` tokens, the draft-length controller stops or ``step`` gives None (the draft's own
    cut). Returns (tokens, q's when sampling).
    """
    tokens: list[torch.Tensor] = []
    qs: list[torch.Tensor] = []
    logits = first_logits
    while True:
        if greedy:
            token = logits.argmax(-1)
        else:
            qs.append(proc(logits))
            token = sample(qs[-1], generator)
        tokens.append(token)
        more = True
        if controller.needs_confidence:
            more = controller.keep_drafting(logits.float().softmax(-1).gather(-1, token[:, None]).squeeze(-1))
        if not more or len(tokens) == gamma_cap:
            return tokens, qs
        logits = step(token)
        if logits is None:
            return tokens, qs


def stack(tokens: list[torch.Tensor], qs: list[torch.Tensor], batch: int, vocab: int, device, greedy: bool):
    """(tokens [B, g], q [B, g, V] or None) from a chain; an empty chain gives [B, 0] (and [B, 0, V])."""
    if not tokens:
        q = None if greedy else torch.zeros(batch, 0, vocab, device=device)
        return torch.zeros(batch, 0, dtype=torch.long, device=device), q
    return torch.stack(tokens, 1), (None if greedy else torch.stack(qs, 1))


class Drafter:
    """A standalone draft's state in one decoding call: its cache and the tokens it has not read yet.

    Invariant between rounds: the draft has cached every token but its own pending ones (usually the last token,
    or [d_g, bonus] when the whole draft was accepted: one 2-token forward; nothing is ever fed twice).
    """

    aux_layers = None

    def __init__(self, draft: nn.Module, batch: int, vocab: int, input_ids: torch.Tensor, prompt_mask: torch.Tensor):
        self.stream = KVStream(draft, batch, vocab)
        self.ids, self.valid = input_ids, prompt_mask

    @property
    def forwards(self) -> int:
        return self.stream.forwards

    def propose(self, controller, gamma_cap: int, proc, greedy: bool, generator):
        """Draft up to ``gamma_cap`` tokens; the last one is not fed back (its KV is only needed if all are accepted).

        Returns:
            (draft tokens ``[B, g]``, their distributions q ``[B, g, V]`` when sampling, else None).
        """
        drf = self.stream
        batch = self.ids.shape[0]
        controller.start_round(batch, gamma_cap)
        tokens, qs = [], []
        if gamma_cap > 0:
            first = drf.feed(self.ids, self.valid, keep=1)[:, -1]  # [B, V]
            step = lambda token: drf.feed(token[:, None], None, keep=1)[:, -1]  # noqa: E731
            tokens, qs = draft_tokens(first, step, controller, gamma_cap, proc, greedy, generator)
        return stack(tokens, qs, batch, drf.vocab, drf.device, greedy)

    def update(self, v: Verified) -> None:
        """Crop the cache to the accepted tokens it read; the pending tokens for the next round."""
        drf = self.stream
        g = v.draft_tokens.shape[1]
        nxt = v.nxt.to(drf.device)[:, None]  # [B, 1]
        if g == 0:
            # The draft read nothing this round: its pending tokens grow by the new one.
            self.valid = None if self.valid is None else torch.cat([self.valid, all_real(nxt)], 1)
            self.ids = torch.cat([self.ids.to(drf.device), nxt], 1)
            return
        fed = g - 1  # d_1..d_{g-1} went through the draft; d_g did not
        drf.rollback(fed, v.accepted.clamp(max=fed).to(drf.device), [min(a, fed) for a in v.acc_list])
        if max(v.acc_list) < g:
            self.ids, self.valid = nxt, None
            return
        # Rows that accepted all g still owe the draft d_g: feed [d_g, next] in one forward (a hole in other rows).
        self.ids = torch.cat([v.draft_tokens[:, -1:].to(drf.device), nxt], 1)
        self.valid = torch.cat([(v.accepted == g).to(drf.device)[:, None], all_real(nxt)], 1)

    def select(self, rows: torch.Tensor) -> None:
        self.stream.select(rows)
        self.ids = self.ids[rows.to(self.ids.device)]
        self.valid = None if self.valid is None else self.valid[rows.to(self.valid.device)]


def drafter(draft: nn.Module, batch: int, vocab: int, input_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Drafter:
    """The kind's drafter for one decoding call (``decode.kinds.drafter_for``)."""
    return Drafter(draft, batch, vocab, input_ids, prompt_mask)


def cost_stream(model: nn.Module, batch: int) -> KVStream:
    """The model's KV-cached forwards as ``decode.metrics.ForwardCostMeter`` times them."""
    from decode.compat import logits_width

    return KVStream(model, batch, logits_width(model))


def block_of(draft: nn.Module) -> None:
    """None: a chain draft has no block."""
    return None


def check_draft_length(draft: nn.Module, gamma: int) -> None:
    """A chain draft drafts any length."""


# ---------------------------------------------------------------------------------------------------------------
# Its saved folder and vLLM (decode.kinds.dispatch asks every kind's decoding module alike)
# ---------------------------------------------------------------------------------------------------------------
def is_folder(path) -> bool:
    """False: a standalone draft is a plain causal LM, which marks no layout of its own (a folder no kind claims
    is read as one: ``decode.kinds.PLAIN``)."""
    return False


def folder_block(path) -> None:
    """None: a draft LM drafts a chain."""
    return None


def check_folder(path, target_config, target_name: str) -> None:
    """Nothing of its own: a draft LM's tokenizer and vocabulary are checked against the target's as any LM's."""


def vllm_problem(version: str, methods: set[str]) -> str | None:
    """None: every vLLM with speculative decoding serves a draft LM (``TRAITS.vllm_method``)."""
    return None


def is_model(draft: nn.Module) -> bool:
    """False: a loaded draft LM that no kind claims is a plain one (``decode.kinds.PLAIN_LM``)."""
    return False
