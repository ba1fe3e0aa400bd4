"""Lossless speculative decoding (Leviathan et al. 2023; Chen et al. 2023) for HF causal LMs.

One round, per batch row:

    draft:   feed the tokens the draft has not cached yet, then propose d_1..d_g one forward at a time (q_i)
    verify:  one target forward over [pending token, d_1..d_g] -> p_1..p_{g+1}
    accept:  d_i with probability min(1, p_i(d_i) / q_i(d_i)) until the first rejection; there sample from
             norm(max(0, p - q)); if all g are accepted, sample a bonus token from p_{g+1}
    rollback: crop both KV caches to what was accepted

Invariants between rounds: the target has cached every token but the last one (the "pending" token, fed
first in the next verify pass, so each round is exactly one target forward and the first round is the
target's prefill); the draft has cached every token but its own pending ones — usually just the last token,
or [d_g, bonus] when the whole draft was accepted (one 2-token forward; nothing is ever fed twice).

Batch rows accept different numbers of tokens. Each model keeps ONE physical KV cache for the batch plus a
per-row mask of which slots hold real tokens: when a row rejects drafts another row kept, its slots become
holes — masked in attention and skipped by position ids — so every row attends to exactly its own tokens at
their own positions, as if decoded alone. Columns no row kept are cropped. Holes cost a little attention
compute and no copies; for sliding-window models (the window is measured in cache slots) the cache is
compacted before holes could enter a window. Finished rows leave the batch.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from decode.draft_length import AutoDraftLength, FixedDraftLength
from decode.kernels import CpuLinears
from decode.sampling import process_logits, sample, validate_sampling

DraftLength = FixedDraftLength | AutoDraftLength


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
# Compatibility checks
# ---------------------------------------------------------------------------------------------------------------
def _logits_width(model: nn.Module) -> int:
    emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        return int(emb.weight.shape[0])
    return int(_text_config(model).vocab_size)


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _name(obj) -> str:
    return getattr(obj, "name_or_path", None) or getattr(getattr(obj, "config", None), "_name_or_path", None) or "?"


def check_vocab_compatible(target: nn.Module, draft: nn.Module, target_tokenizer=None, draft_tokenizer=None) -> int:
    """Return the shared vocabulary size both models' logits are cut to; raise ValueError on a real mismatch.

    Embeddings padded past the tokenizer (Qwen2.5-0.5B: 151936 rows, 7B: 152064) are fine: the ids below the
    smaller logits width are compared. With both tokenizers given, every id both tokenizers define must be the
    same token string, else one line names both tokenizers and the first differing id.
    """
    shared = min(_logits_width(target), _logits_width(draft))
    if target_tokenizer is not None and draft_tokenizer is not None and target_tokenizer is not draft_tokenizer:
        n = min(len(target_tokenizer), len(draft_tokenizer), shared)
        t_tokens = target_tokenizer.convert_ids_to_tokens(list(range(n)))
        d_tokens = draft_tokenizer.convert_ids_to_tokens(list(range(n)))
        if t_tokens != d_tokens:
            i = next(i for i, (a, b) in enumerate(zip(t_tokens, d_tokens)) if a != b)
            raise ValueError(
                f"vocabulary mismatch: target tokenizer {_name(target_tokenizer)!r} and draft tokenizer "
                f"{_name(draft_tokenizer)!r} differ first at id {i}: {t_tokens[i]!r} vs {d_tokens[i]!r}"
            )
    return shared


def context_length(model: nn.Module) -> int | None:
    """The model's maximum number of positions, or None when the config does not say."""
    config = _text_config(model)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def cpu_has_native_bf16() -> bool:
    """True on a CPU whose oneDNN runs bf16 matmuls natively (AVX512-BF16 or AMX).

    There a frozen model is best run in bf16: a 5-token verify forward costs ~1.1x a 1-token one against ~1.6x in
    float32 (measured on the reference pair), which is the difference between speculative decoding paying or not.
    Without native support bf16 is emulated and slower than float32.
    """
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def check_context(models: dict[str, nn.Module], prompt_len: int, max_new_tokens: int) -> None:
    """Raise ValueError if prompt + max_new_tokens does not fit every model's context."""
    for role, model in models.items():
        limit = context_length(model)
        if limit is not None and prompt_len + max_new_tokens > limit:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} exceeds the {role} model's context "
                f"of {limit} tokens (max_position_embeddings of {_name(model)})"
            )


def _sliding_window(model: nn.Module) -> int | None:
    window = getattr(_text_config(model), "sliding_window", None)
    return window if isinstance(window, int) and window > 0 else None


# ---------------------------------------------------------------------------------------------------------------
# One model's KV cache over a batch with per-row holes
# ---------------------------------------------------------------------------------------------------------------
def _innermost(model: nn.Module) -> nn.Module:
    """The module whose ``forward`` really takes the inputs: PEFT and accelerate wrappers forward ``**kwargs``."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "get_base_model", None)
        if callable(inner):
            model = inner()
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):  # DDP / accelerate wrappers
            model = model.module
    return model


@functools.cache
def _cache_keyword_of(forward_cls: type) -> str:
    params = inspect.signature(forward_cls.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    # A forward that names neither (``**kwargs`` only): ask an HF model of this release what it takes.
    from transformers import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_keyword(model: nn.Module) -> str:
    """The forward keyword that takes a KV cache: ``cache`` (recent releases) or ``past_key_values``.

    Passing the wrong one is silently swallowed by ``**kwargs`` and the model runs without a cache, so every
    forward of draftsmith's loops goes through this name (and :meth:`KVStream.feed` checks the cache grew).
    """
    return _cache_keyword_of(type(_innermost(model)))


class KVStream:
    """A model, its KV cache, and per row which cache slots hold real tokens.

    ``valid`` is ``[batch, slots]`` bool, or None while every slot of every row is real (batch 1 never leaves
    that fast path: no mask is built and SDPA runs its plain causal kernel). ``length[b]`` is row b's number of
    real tokens, i.e. the position id of its next token.
    """

    def __init__(self, model: nn.Module, batch_size: int, vocab: int):
        self.model = model
        self.cache = DynamicCache()
        self.valid: torch.Tensor | None = None
        self.slots = 0
        self.device = next(model.parameters()).device
        self.length = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.vocab = vocab
        self.window = _sliding_window(model)
        self.forwards = 0
        self.cache_kw = cache_keyword(model)

    def feed(self, ids: torch.Tensor, valid: torch.Tensor | None, keep: int) -> torch.Tensor:
        """Append ``ids`` ``[B, q]`` (``valid`` ``[B, q]`` bool or None = all real) to the cache.

        Returns the logits of the last ``keep`` inputs, ``[B, keep, vocab]``, cut to the shared vocabulary.
        """
        ids = ids.to(self.device)
        batch, q = ids.shape
        if valid is not None and bool(valid.all()):
            valid = None
        if valid is None and self.valid is None:
            position_ids = torch.arange(self.slots, self.slots + q, device=self.device).expand(batch, q)
            mask = None
            self.length += q
        else:
            valid = torch.ones_like(ids, dtype=torch.bool) if valid is None else valid.to(self.device)
            if self.valid is None:
                self.valid = torch.ones(batch, self.slots, dtype=torch.bool, device=self.device)
            if self.window is not None and self.slots + q > self.window:
                self._compact()
            # Holes take no position: row b's real tokens get consecutive positions from length[b].
            position_ids = (self.length[:, None] + valid.cumsum(1) - 1).clamp_min(0)
            self.valid = torch.cat([self.valid, valid], 1)
            mask = self.valid.long()
            self.length += valid.sum(1)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=keep,
            **{self.cache_kw: self.cache},
        )
        self.slots += q
        if self.forwards == 0 and self.cache.get_seq_length() == 0:
            raise RuntimeError(
                f"{_name(self.model)} ignored the KV cache passed as {self.cache_kw}= (its forward takes the cache "
                "under another keyword): report it with the output of `pip show transformers`"
            )
        self.forwards += 1
        return out.logits[:, -keep:, : self.vocab]

    def rollback(self, num_new: int, keep: torch.Tensor, keep_list: list[int]) -> None:
        """Of the last ``num_new`` slots (all real), keep the first ``keep[b]`` for row b.

        Slots no row keeps are cropped; a row keeping fewer than the longest is left with holes.
        """
        most = max(keep_list)
        drop = num_new - most
        if drop > 0:
            self.cache.crop(-drop)
            self.slots -= drop
            if self.valid is not None:
                self.valid = self.valid[:, : self.slots]
        self.length -= num_new - keep.to(self.device)
        if most > 0 and min(keep_list) < most:
            if self.valid is None:
                self.valid = torch.ones(len(keep_list), self.slots, dtype=torch.bool, device=self.device)
            hole = torch.arange(most, device=self.device)[None, :] >= keep.to(self.device)[:, None]  # [B, most]
            self.valid[:, self.slots - most :] &= ~hole

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (1-D long)."""
        rows = rows.to(self.device)
        if self.slots:
            self.cache.batch_select_indices(rows)
        self.length = self.length[rows]
        if self.valid is not None:
            self.valid = self.valid[rows]
            if bool(self.valid.all()):
                self.valid = None

    def _compact(self) -> None:
        """Move every row's real slots to the right end (holes become left padding): sliding windows count slots."""
        assert self.valid is not None
        # Holes only matter inside a row's tokens; left padding alone is what HF itself does with windows.
        inner = self.valid.int().cummax(1).values.bool() & ~self.valid
        if not bool(inner.any()):
            return
        width = int(self.valid.sum(1).max())
        idx = torch.sort(self.valid.int(), dim=1, stable=True).indices[:, -width:]  # [B, width] real slots, in order
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            for name in ("keys", "values"):
                states = getattr(layer, name)  # [B, heads, slots, dim]
                index = idx[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[-1])
                setattr(layer, name, states.gather(2, index))
        self.valid = self.valid.gather(1, idx)
        self.slots = width


# ---------------------------------------------------------------------------------------------------------------
# Acceptance rules (pure functions)
# ---------------------------------------------------------------------------------------------------------------
def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: accept while the draft token is the target's argmax; the next token is the target's argmax.

    Exactly ``accept_sampled`` with one-hot p and q, without building them.

    Args:
        draft_tokens: ``[B, g]``; target_logits: ``[B, g + 1, V]``.

    Returns:
        (accepted ``[B]`` in 0..g, next token ``[B]``).
    """
    best = target_logits.argmax(-1)  # [B, g + 1]
    g = draft_tokens.shape[1]
    accepted = (draft_tokens == best[:, :g]).int().cumprod(1).sum(1)
    return accepted, best.gather(1, accepted[:, None]).squeeze(1)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) up to normalisation, ``[B, V]``; falls back to p where p == q (rejection had prob 0)."""
    residual = (p - q).clamp_min(0)
    return torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)


def accept_sampled(
    draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: accept d_i w.p. min(1, p_i(d_i)/q_i(d_i)); resample the first rejection.

    Args:
        draft_tokens: ``[B, g]`` drawn from q; q: ``[B, g, V]``; p: ``[B, g + 1, V]`` (processed probabilities).

    Returns:
        (accepted ``[B]`` in 0..g, next token ``[B]``: the resampled or the bonus token).
    """
    batch, g = draft_tokens.shape
    idx = draft_tokens[..., None]
    p_d = p[:, :g].gather(-1, idx).squeeze(-1)  # [B, g]
    q_d = q.gather(-1, idx).squeeze(-1)  # [B, g], > 0 since d ~ q
    u = torch.rand(batch, g, generator=generator, device=p.device) if g else p_d
    accepted = (u * q_d < p_d).int().cumprod(1).sum(1)  # u < p/q without dividing
    rows = torch.arange(batch, device=p.device)
    p_n = p[rows, accepted]  # [B, V]
    # Past the last draft token q is 0, so the bonus token is drawn from p itself.
    q_n = torch.cat([q, torch.zeros_like(p[:, :1])], 1)[rows, accepted]
    return accepted, sample(residual_distribution(p_n, q_n), generator)


# ---------------------------------------------------------------------------------------------------------------
# Emission / stopping
# ---------------------------------------------------------------------------------------------------------------
def _eos_ids(model: nn.Module, eos_token_id) -> set[int]:
    if eos_token_id is None:
        gen_config = getattr(model, "generation_config", None)
        eos_token_id = getattr(gen_config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}


class _Emitter:
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


def _pack(input_ids: torch.Tensor, new_tokens: list[list[int]], pad_id: int) -> torch.Tensor:
    width = max((len(t) for t in new_tokens), default=0)
    tail = torch.full((len(new_tokens), width), pad_id, dtype=input_ids.dtype)
    for b, toks in enumerate(new_tokens):
        tail[b, : len(toks)] = torch.tensor(toks, dtype=input_ids.dtype)
    return torch.cat([input_ids.cpu(), tail], 1)


def _draft_length(num_draft_tokens, draft_cost_ratio: float | None) -> DraftLength:
    if isinstance(num_draft_tokens, (FixedDraftLength, AutoDraftLength)):
        return num_draft_tokens
    if num_draft_tokens == "auto":
        return AutoDraftLength(draft_cost_ratio=draft_cost_ratio)
    if isinstance(num_draft_tokens, str):
        if not num_draft_tokens.isdigit():
            raise ValueError(f"num_draft_tokens must be an int >= 1 or 'auto', got {num_draft_tokens!r}")
        num_draft_tokens = int(num_draft_tokens)
    return FixedDraftLength(int(num_draft_tokens))


class _EvalMode:
    """Put models in eval mode (no dropout) for the call and restore their mode after."""

    def __init__(self, *models: nn.Module):
        self.models = models

    def __enter__(self):
        self.modes = [m.training for m in self.models]
        for m in self.models:
            m.eval()

    def __exit__(self, *exc):
        for m, mode in zip(self.models, self.modes):
            m.train(mode)


@contextlib.contextmanager
def _decoding(*models: nn.Module) -> Iterator[None]:
    """The form every decoding loop and every cost measurement runs the models in: inference mode, eval mode,
    draftsmith's CPU kernels (one place, so the timed forwards are always the forwards the loops run)."""
    with torch.inference_mode(), _EvalMode(*models), CpuLinears(*models):
        yield


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
) -> SpecOutput:
    """Generate with ``target`` as fast as ``draft`` allows, with exactly the target's output distribution.

    Args:
        target, draft: HF causal LMs (or anything with the same forward signature) sharing token ids.
        input_ids: ``[batch, prompt_len]`` (left-padded for batch > 1) or ``[prompt_len]``.
        attention_mask: ``[batch, prompt_len]``, 0 on padding; never inferred from token ids (pad may equal EOS).
        max_new_tokens: per-row budget.
        num_draft_tokens: gamma (int), ``"auto"``, or a ``FixedDraftLength`` / ``AutoDraftLength`` to reuse.
        temperature, top_k, top_p: one processing path for p and q; temperature 0 is greedy.
        eos_token_id: int or list; None = the target's ``generation_config.eos_token_id``; ``[]`` = never stop.
        stop_strings: stop after the token that completes any of these (needs ``tokenizer``).
        generator: RNG for sampling (draft tokens, acceptance, resampling).
        draft_cost_ratio: c for ``auto``; measured from the loop's timings when None.

    Returns:
        SpecOutput; greedy ``new_tokens`` equal target-only greedy decoding token for token.
    """
    validate_sampling(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    input_ids, prompt_mask = _prepare_inputs(input_ids, attention_mask)
    vocab = check_vocab_compatible(target, draft, tokenizer, tokenizer)
    check_context({"target": target, "draft": draft}, int(prompt_mask.sum(1).max()), max_new_tokens)
    controller = _draft_length(num_draft_tokens, draft_cost_ratio)
    eos = _eos_ids(target, eos_token_id)
    greedy = temperature == 0
    batch = input_ids.shape[0]
    emitter = _Emitter(batch, max_new_tokens, eos, stop_strings, tokenizer)
    stats = SpecStats()

    def proc(logits: torch.Tensor) -> torch.Tensor:
        return process_logits(logits, temperature, top_k, top_p)

    with _decoding(target, draft):
        tgt = KVStream(target, batch, vocab)
        drf = KVStream(draft, batch, vocab)
        rows = list(range(batch))  # original index of each live row
        # Tokens each model has not cached yet, [B, k], with validity (holes left of real tokens; None = all real).
        tgt_ids, tgt_valid = input_ids, prompt_mask
        drf_ids, drf_valid = input_ids, prompt_mask
        first = True
        while rows:
            budget = max(emitter.remaining(r) for r in rows)
            gamma_cap = min(controller.max_gamma, budget - 1)  # the round also emits one target token

            # ---- draft: g tokens, one forward each (the first also reads the draft's pending tokens)
            t0 = time.perf_counter()
            draft_tokens, q = _propose(drf, drf_ids, drf_valid, controller, gamma_cap, proc, greedy, generator)
            g = draft_tokens.shape[1]
            t1 = time.perf_counter()

            # ---- verify: one target forward over [pending, d_1..d_g] -> p_1..p_{g+1}
            draft_tokens = draft_tokens.to(tgt.device)
            ids = torch.cat([tgt_ids.to(tgt.device), draft_tokens], 1)
            valid = None if tgt_valid is None else torch.cat([tgt_valid.to(tgt.device), _all_real(draft_tokens)], 1)
            logits = tgt.feed(ids, valid, keep=g + 1)  # [B, g + 1, V]
            if greedy:
                accepted, nxt = accept_greedy(draft_tokens, logits)
            else:
                accepted, nxt = accept_sampled(draft_tokens, q.to(tgt.device), proc(logits), generator)
            acc_list = accepted.tolist()  # the one host sync per round
            t2 = time.perf_counter()

            # ---- rollback: the target keeps [pending, d_1..d_n]; the draft keeps what it read of d_1..d_n
            tgt.rollback(g, accepted, acc_list)
            tgt_ids, tgt_valid = nxt[:, None], None
            drf_ids, drf_valid = _rollback_draft(drf, drf_ids, drf_valid, draft_tokens, accepted, acc_list, nxt)
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
                drf.select(sel)
                rows = [rows[i] for i in keep]
                tgt_ids = tgt_ids[sel.to(tgt_ids.device)]
                drf_ids = drf_ids[sel.to(drf_ids.device)]
                drf_valid = None if drf_valid is None else drf_valid[sel.to(drf_valid.device)]
        stats.target_forwards = tgt.forwards
        stats.draft_forwards = drf.forwards

    pad = min(eos) if eos else 0
    return SpecOutput(sequences=_pack(input_ids, emitter.out, pad), new_tokens=emitter.out, stats=stats)


def _propose(
    drf: KVStream,
    pending_ids: torch.Tensor,
    pending_valid: torch.Tensor | None,
    controller: DraftLength,
    gamma_cap: int,
    proc,
    greedy: bool,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft up to ``gamma_cap`` tokens; the last one is not fed back (its KV is only needed if all are accepted).

    Returns:
        (draft tokens ``[B, g]``, their distributions q ``[B, g, V]`` when sampling, else None).
    """
    batch = pending_ids.shape[0]
    controller.start_round(batch, gamma_cap)
    tokens: list[torch.Tensor] = []
    qs: list[torch.Tensor] = []
    if gamma_cap > 0:
        logits = drf.feed(pending_ids, pending_valid, keep=1)[:, -1]  # [B, V]
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
                break
            logits = drf.feed(token[:, None], None, keep=1)[:, -1]
    if not tokens:
        return torch.zeros(batch, 0, dtype=torch.long, device=drf.device), _empty_q(batch, drf, greedy)
    return torch.stack(tokens, 1), (None if greedy else torch.stack(qs, 1))


def _all_real(ids: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(ids, dtype=torch.bool)


def _empty_q(batch: int, drf: KVStream, greedy: bool) -> torch.Tensor | None:
    return None if greedy else torch.zeros(batch, 0, drf.vocab, device=drf.device)


def _rollback_draft(
    drf: KVStream,
    pending_ids: torch.Tensor,
    pending_valid: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    accepted: torch.Tensor,
    acc_list: list[int],
    nxt: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Crop the draft's cache to the accepted tokens it read; return its pending tokens for the next round."""
    g = draft_tokens.shape[1]
    nxt = nxt.to(drf.device)[:, None]  # [B, 1]
    if g == 0:
        # The draft read nothing this round: its pending tokens grow by the new one.
        valid = None if pending_valid is None else torch.cat([pending_valid, _all_real(nxt)], 1)
        return torch.cat([pending_ids.to(drf.device), nxt], 1), valid
    fed = g - 1  # d_1..d_{g-1} went through the draft; d_g did not
    drf.rollback(fed, accepted.clamp(max=fed).to(drf.device), [min(a, fed) for a in acc_list])
    if max(acc_list) < g:
        return nxt, None
    # Rows that accepted all g still owe the draft d_g: feed [d_g, next] in one forward (a hole in other rows).
    ids = torch.cat([draft_tokens[:, -1:].to(drf.device), nxt], 1)
    return ids, torch.cat([(accepted == g).to(drf.device)[:, None], _all_real(nxt)], 1)


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
) -> SpecOutput:
    """draftsmith's own target-only loop: same KV handling and sampling path as ``speculative_generate``.

    Args:
        input_ids: ``[batch, prompt_len]`` left-padded; attention_mask: ``[batch, prompt_len]``.

    Returns:
        SpecOutput with ``stats.target_forwards`` = forwards run (``drafted`` stays 0).
    """
    validate_sampling(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    input_ids, prompt_mask = _prepare_inputs(input_ids, attention_mask)
    check_context({"target": target}, int(prompt_mask.sum(1).max()), max_new_tokens)
    emitter = _Emitter(input_ids.shape[0], max_new_tokens, _eos_ids(target, eos_token_id), None, None)
    stats = SpecStats()
    with _decoding(target):
        stream = KVStream(target, input_ids.shape[0], _logits_width(target))
        rows = list(range(input_ids.shape[0]))
        ids, valid = input_ids, prompt_mask
        while rows:
            logits = stream.feed(ids, valid, keep=1)[:, -1]
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
            if done:
                finished = set(done)
                keep = [i for i in range(len(rows)) if i not in finished]
                if not keep:
                    break
                sel = torch.tensor(keep, dtype=torch.long)
                stream.select(sel)
                rows = [rows[i] for i in keep]
                ids = ids[sel.to(ids.device)]
        stats.target_forwards = stream.forwards
    eos = _eos_ids(target, eos_token_id)
    return SpecOutput(
        sequences=_pack(input_ids, emitter.out, min(eos) if eos else 0), new_tokens=emitter.out, stats=stats
    )
