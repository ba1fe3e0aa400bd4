"""Cheap checks of a recipe's inputs, run before a run writes anything (train/distill.py, first thing in `run`).

    check_inputs(recipe)    # ValueError, one line naming the recipe keys and the fix

A bad pair or prompt set is refused before output_dir, resolved_recipe.yaml, a W&B directory or a checkpoint
exists, and before any weights are read: the checks read configs, tokenizers, GGUF headers and JSONL prompt
files only.

* target.model and draft.model: a loadable path, hub id or GGUF file (a GGUF's architecture must be one that
  transformers can load, and the `gguf` package installed);
* the pair's vocabularies: the same tokens, and output widths that cover the target's tokenizer (the decoder's
  rule, :func:`decode.compat.check_vocab_compatible`, applied to the configs);
* the prompt files: each one there, every row of a JSONL file valid JSON and a {"prompt"}, {"messages"} or
  {"conversations"} row (:func:`distill.data.prompts.check_prompt_source`), a `generate:` spec one that exists;
* chat prompts ('messages' rows, generate:magpie) need the target's chat template;
* `data.engine: vllm` needs vLLM installed (the `vllm` extra);
* a standalone draft is not an EAGLE-3 head folder; for draft.kind=eagle3, the target's forward returns its
  per-layer hidden states (probed on one token of a weightless, meta-device copy), and a head folder in
  draft.model was made for this target (vocabulary, hidden size, aux layer ids in its config.json).

What is not known yet is skipped, never guessed: an empty model path (build_pair: quickstart fills it in later),
the draft of `draft.init: truncate` (built from the target, it has the target's vocabulary by construction), and
prompt sources other than JSONL files (datasets directories and hub datasets are checked when they are loaded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from decode import sources
from decode.compat import check_vocab_compatible
from decode.prompts import read_jsonl
from distill import kinds, models
from distill.config import DataConfig, ModelConfig, Recipe
from distill.data import prompt_gen, vllm_rollouts
from distill.data.prompts import check_prompt_source


def check_inputs(recipe: Recipe) -> None:
    """Refuse a recipe whose models or prompts cannot work together; reads no weights and writes nothing.

    Raises:
        ValueError: one line naming the recipe keys involved and the fix.
    """
    later = recipe.build_pair == "quickstart"  # empty model paths are filled in with the quickstart pair
    vllm_rollouts.check_engine(recipe.data.engine)  # data.engine=vllm: vLLM installed
    check_prompt_files(recipe.data, later)
    target = _known_model(recipe.target, "target.model", later)
    kind = kinds.get(recipe.draft.kind)  # a draft LM to load, or one built from the target (an EAGLE-3 head)
    loads = kind.LOADS_DRAFT_MODEL and recipe.draft.init != "truncate"
    draft = _known_model(recipe.draft, "draft.model", later) if loads else None
    kind.check_inputs(
        recipe, target, lambda: sources.load_config(target, key="target.model", **_config_kwargs(recipe.target))
    )
    if target is None:
        return  # nothing to check the draft and the prompts against yet
    tokenizer = models.load_tokenizer(recipe.target.model, recipe.target, key="target.model")
    if draft is not None:
        draft_tokenizer = models.load_tokenizer(recipe.draft.model, recipe.draft, key="draft.model")
        check_pair_vocab(recipe.target, recipe.draft, tokenizer, draft_tokenizer)
    check_chat_prompts(recipe.data, tokenizer, recipe.target.model)


def check_prompt_files(cfg: DataConfig, later: bool = False) -> None:
    """data.train_prompts and data.eval_prompts can be read (an empty data.eval_prompts holds out
    data.eval_split instead; both empty with `later`: the quickstart fills them in)."""
    if prompt_gen.is_generated(cfg.train_prompts):
        prompt_gen.parse_spec(cfg.train_prompts)
    elif cfg.train_prompts or not later:
        check_prompt_source(cfg.train_prompts, key="data.train_prompts", prompt_field=cfg.prompt_field)
    if cfg.eval_prompts:
        check_prompt_source(cfg.eval_prompts, key="data.eval_prompts", prompt_field=cfg.prompt_field)


def _known_model(cfg: ModelConfig, key: str, later: bool) -> str | None:
    """The model `cfg.model` names, checked to be loadable (path, hub cache, GGUF header); None while it is
    empty and built `later`."""
    if not cfg.model and later:
        return None
    return models.resolve_model_path(cfg.model, key, cfg.revision)


def _config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code}
    if cfg.revision is not None:
        kwargs["revision"] = cfg.revision
    return kwargs


def check_pair_vocab(
    target: ModelConfig, draft: ModelConfig, target_tokenizer: Any, draft_tokenizer: Any
) -> int | None:
    """The vocabulary size target and draft share, from their configs and tokenizers (a LoRA draft: its base's);
    None when a config does not say its output width (the loaded models are checked again anyway).

    Raises:
        ValueError: the tokenizers differ, or a model's output is narrower than the target's tokenizer.
    """
    target_shape = sources.config_only(target.model, key="target.model", **_config_kwargs(target))
    draft_shape = sources.config_only(draft.model, key="draft.model", **_config_kwargs(draft))
    if target_shape is None or draft_shape is None:
        return None
    try:
        return check_vocab_compatible(target_shape, draft_shape, target_tokenizer, draft_tokenizer)
    except ValueError as err:
        raise ValueError(f"target.model and draft.model: {err}") from None


def check_chat_prompts(cfg: DataConfig, tokenizer: Any, target_name: str) -> None:
    """Chat prompts (generated ones, 'messages' rows in a JSONL prompt file) need the target's chat template.

    Rows are read (and so validated) only from JSONL files; other sources are checked when they are loaded.
    """
    if getattr(tokenizer, "chat_template", None):
        return
    if not (cfg.apply_chat_template or _wants_magpie(cfg)):
        return  # chat rows are joined as plain text, as asked
    fix = "use an instruction-tuned target, prompt rows with a 'prompt' string, or data.apply_chat_template=false"
    if prompt_gen.is_generated(cfg.train_prompts):
        prompt_gen.parse_spec(cfg.train_prompts)  # an unknown generator is its own error
        if _wants_magpie(cfg):
            fix = "use an instruction-tuned target, or generate:stdlib with data.apply_chat_template=false"
        raise ValueError(
            f"data.train_prompts {cfg.train_prompts!r} writes chat prompts, and target.model {target_name!r} has "
            f"no chat template: {fix}"
        )
    for key, source in (("data.train_prompts", cfg.train_prompts), ("data.eval_prompts", cfg.eval_prompts)):
        path = Path(source).expanduser()
        if not source or path.suffix != ".jsonl" or not path.is_file():
            continue
        rows = read_jsonl(path, cfg.prompt_field)
        first = next((n for n, row in enumerate(rows, 1) if row.get("messages")), None)
        if first is not None:
            raise ValueError(
                f"{key} {source!r} holds chat ('messages') rows (row {first}), and target.model {target_name!r} "
                f"has no chat template: {fix}"
            )


def _wants_magpie(cfg: DataConfig) -> bool:
    """generate:magpie renders the chat template whatever data.apply_chat_template says."""
    return prompt_gen.is_generated(cfg.train_prompts) and "magpie" in cfg.train_prompts
