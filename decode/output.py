"""What a decoding call returns and when its rows stop: the counters (:class:`SpecStats`), the output
(:class:`SpecOutput`), the EOS ids and the emitter that cuts each row at EOS, its budget or a stop string.

Shared by every decoding loop: the chain (``decode.speculative``), the draft tree (``decode.tree``) and the
target alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


# ---------------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class SpecStats:
    """Counters of one or more decoding calls (``merge`` adds another call's counters).

    Per-row counts: a batch of 4 in one round adds 4 * gamma to ``drafted`` and 4 to ``row_rounds``.
    """

    drafted: int = 0  # draft tokens proposed (and judged by the target)
    accepted: int = 0  # of those, accepted
    rounds: int = 0  # loop iterations; each is exactly one target forward
    target_forwards: int = 0
    draft_forwards: int = 0
    row_rounds: int = 0  # sum over rounds of the rows still decoding (denominator of tau)
    new_tokens: int = 0  # tokens emitted, all rows (after EOS / budget / stop-string truncation)
    per_position_drafted: list[int] = field(default_factory=list)  # [i]: rows whose draft reached position i
    per_position_accepted: list[int] = field(default_factory=list)  # [i]: of those, accepted at position i
    gamma_used: list[int] = field(default_factory=list)  # draft length of every round

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens emitted per row per target forward."""
        return self.new_tokens / self.row_rounds if self.row_rounds else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(draft token i accepted | tokens < i accepted)."""
        return [a / d if d else 0.0 for a, d in zip(self.per_position_accepted, self.per_position_drafted)]

    @property
    def mean_num_draft_tokens(self) -> float:
        return sum(self.gamma_used) / len(self.gamma_used) if self.gamma_used else 0.0

    def merge(self, other: SpecStats) -> None:
        for name in ("drafted", "accepted", "rounds", "target_forwards", "draft_forwards", "row_rounds", "new_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.per_position_drafted = _add_lists(self.per_position_drafted, other.per_position_drafted)
        self.per_position_accepted = _add_lists(self.per_position_accepted, other.per_position_accepted)
        self.gamma_used.extend(other.gamma_used)


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


@dataclass
class SpecOutput:
    sequences: torch.Tensor  # [batch, prompt_len + max new] left-padded prompt + new tokens, right-padded with pad
    new_tokens: list[list[int]]  # per row: generated ids, EOS included if hit, nothing after
    stats: SpecStats


# ---------------------------------------------------------------------------------------------------------------
# Emission / stopping
# ---------------------------------------------------------------------------------------------------------------
def eos_ids(model: nn.Module, eos_token_id) -> set[int]:
    if eos_token_id is None:
        gen_config = getattr(model, "generation_config", None)
        eos_token_id = getattr(gen_config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}


class Emitter:
    """Collects each row's new tokens and decides when a row is done (EOS, budget, stop string)."""

    def __init__(self, batch: int, max_new_tokens: int, eos: set[int], stop_strings, tokenizer):
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings needs a tokenizer")
        self.out: list[list[int]] = [[] for _ in range(batch)]
        self.max_new = max_new_tokens
        self.eos = eos
        self.stops = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings or [])
        self.tokenizer = tokenizer
        # Tokens to decode when looking for a stop string ending in the newest tokens.
        self.window = max((len(s) for s in self.stops), default=0) + 8

    def emit(self, row: int, tokens: list[int]) -> bool:
        """Append ``tokens`` to ``row``, truncated at EOS / budget / stop string; True when the row is done."""
        out = self.out[row]
        start = len(out)
        done = False
        for tok in tokens:
            out.append(tok)
            if tok in self.eos or len(out) >= self.max_new:
                done = True
                break
        if self.stops:
            cut = self._stop_cut(out, start)
            if cut is not None:
                del out[cut:]
                done = True
        return done

    def _stop_cut(self, out: list[int], start: int) -> int | None:
        for k in range(start + 1, len(out) + 1):
            text = self.tokenizer.decode(out[max(0, k - self.window) : k])
            if any(s in text for s in self.stops):
                return k
        return None

    def remaining(self, row: int) -> int:
        return self.max_new - len(self.out[row])


def pack(input_ids: torch.Tensor, new_tokens: list[list[int]], pad_id: int) -> torch.Tensor:
    width = max((len(t) for t in new_tokens), default=0)
    tail = torch.full((len(new_tokens), width), pad_id, dtype=input_ids.dtype)
    for b, toks in enumerate(new_tokens):
        tail[b, : len(toks)] = torch.tensor(toks, dtype=input_ids.dtype)
    return torch.cat([input_ids.cpu(), tail], 1)
