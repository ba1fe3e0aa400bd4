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
* the rows of JSONL prompt files as the run reads them (:func:`check_prompt_rows`): some training row is left
  once the eval rows are held out from training (data.eval_prompts, or the data.eval_split of the training
  rows), some training row has tokens after tokenisation, and so does every eval row an evaluation decodes;
* `data.engine: vllm` needs vLLM installed (the `vllm` extra);
* `eval.extra_engines: [llamacpp]` needs llama.cpp (its `llama-server`, converter and the kind's `--spec-type`) and,
  for the converter, the target's HF folder (:func:`check_llamacpp`; `export.gguf` likewise, where train/distill.py
  keeps its plan);
* a draft folder saved as one kind (:func:`distill.kinds.folder_kind`: a head, a PARD or DFlash draft) is
  trained as that kind only (a kind's ``TRAITS.folder_kinds``: a P-EAGLE head starts from an EAGLE-3 head too);
* the kind's own checks (its ``check_inputs``): for a head or a DFlash draft, the target's forward returns its
  per-layer hidden states (probed on one token of a weightless, meta-device copy), and a folder in draft.model
  was made for this target (vocabulary, hidden size, layer ids in its config.json); a DFlash folder was trained
  for draft.block_size (it keeps its block); draft.mask_token_id is an id of the vocabulary it marks.

What is not known yet is skipped, never guessed: an empty model path (build_pair: quickstart fills it in later),
the draft of `draft.init: truncate` (built from the target, it has the target's vocabulary by construction), and
prompt sources other than JSONL files (datasets directories and hub datasets are checked when they are loaded).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from decode import sources
from decode.compat import check_vocab_compatible
from decode.prompts import encode_prompt, expand_turns, read_jsonl
from distill import kinds, models
from distill.config import DataConfig, ModelConfig, Recipe
from distill.data import prompt_gen, vllm_rollouts
from distill.data.prompts import check_prompt_source, load_train_eval


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
    loads = kind.TRAITS.loads_draft_model and recipe.draft.init != "truncate"
    draft = _known_model(recipe.draft, "draft.model", later) if loads else None
    check_draft_folder(recipe, kind)
    target_config = functools.cache(  # read once, by whichever check needs it first
        lambda: sources.load_config(target, key="target.model", **_config_kwargs(recipe.target))
    )
    kind.check_inputs(recipe, target, target_config)
    check_llamacpp(recipe, target)
    if target is None:
        return  # nothing to check the draft and the prompts against yet
    tokenizer = models.load_tokenizer(recipe.target.model, recipe.target, key="target.model")
    if draft is not None:
        draft_tokenizer = models.load_tokenizer(recipe.draft.model, recipe.draft, key="draft.model")
        check_pair_vocab(recipe.target, recipe.draft, tokenizer, draft_tokenizer)
    check_chat_prompts(recipe.data, tokenizer, recipe.target.model)
    check_prompt_rows(recipe.data, tokenizer, recipe.eval.num_prompts)


def check_llamacpp(recipe: Recipe, target: str | None) -> None:
    """eval.extra_engines llamacpp: llama.cpp found, with the converter and the ``--spec-type`` the kind needs, and
    (a draft built on the target's hidden states) the target's HF folder for the converter. ``export.gguf`` is
    checked where its plan is kept (``distill.publishing.gguf.run_plan``)."""
    from decode.llamacpp import export

    if "llamacpp" not in recipe.eval.extra_engines:
        return
    needs_hf = kinds.get(recipe.draft.kind).TRAITS.reads_hidden_states
    gguf_target = target is not None and target.lower().endswith(".gguf")
    export.plan(
        recipe.draft.kind, target if needs_hf or not gguf_target else None, (), recipe.export.llama_cpp,
        recipe.target.revision,
    )  # fmt: skip


def check_draft_folder(recipe: Recipe, kind: kinds.Kind) -> None:
    """draft.model, a folder saved as one kind of draft (:func:`distill.kinds.folder_kind`), is trained as a kind
    that starts from it (``kind.TRAITS.folder_kinds``): another kind would read its weights as what they are not.

    Raises:
        ValueError: one line naming both kinds, draft.kind and draft.model.
    """
    path = recipe.draft.model
    if not path or recipe.draft.init == "truncate":
        return  # no folder to read: the draft is built from the target
    found = kinds.folder_kind(path)
    if found is None or found in kind.TRAITS.folder_kinds:
        return
    what = kinds.KINDS[found].TRAITS.description if found in kinds.KINDS else f"a {found} draft"
    other = (
        "give another draft.model"
        if kind.TRAITS.loads_draft_model
        else "leave draft.model empty to build one from the target"
    )
    raise ValueError(
        f"draft.model {path!r} is {what} folder (draft.kind={found}), and draft.kind={recipe.draft.kind} trains "
        f"{kind.TRAITS.description}: set draft.kind={found} to continue it, or {other}"
    )


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


def check_prompt_rows(cfg: DataConfig, tokenizer: Any, num_eval: int) -> None:
    """The rows of JSONL prompt files as a run reads them (:func:`distill.data.prompt_gen.load_train_eval`): the
    training rows left once those equal to an eval row are held out, some of them with tokens, and the first
    ``num_eval`` eval rows (eval.num_prompts: what an evaluation decodes) each with tokens. Other sources are
    checked when they are loaded.

    Raises:
        ValueError: one line naming the recipe key, the file and the fix.
    """
    if prompt_gen.is_generated(cfg.train_prompts) or not all(
        map(_is_jsonl, filter(None, (cfg.train_prompts, cfg.eval_prompts)))
    ):
        return
    train, evals = load_train_eval(cfg)
    train, evals = expand_turns(train), expand_turns(evals)
    kept = prompt_gen.without_overlap(train, evals, cfg.prompt_field)
    source = f"data.train_prompts {cfg.train_prompts!r}"
    if not kept:
        if cfg.eval_prompts:
            raise ValueError(
                f"every {source} row is also in data.eval_prompts {cfg.eval_prompts!r} (held out from training): "
                "give a different data.eval_prompts, or leave it empty to hold out data.eval_split of them"
            )
        raise ValueError(
            f"every {source} row is the same as a held-out eval row (data.eval_split): give distinct prompts"
        )

    def tokens(row: dict) -> list[int]:
        return encode_prompt(
            row, tokenizer, prompt_field=cfg.prompt_field, apply_chat_template=cfg.apply_chat_template
        )

    if not any(tokens(row) for row in kept):
        raise ValueError(
            f"none of the {len(kept)} training rows of {source} has any tokens after tokenisation with target.model's "
            f"tokenizer: give rows whose {cfg.prompt_field!r} text (or messages) is not empty"
        )
    where = (
        f"data.eval_prompts {cfg.eval_prompts!r}" if cfg.eval_prompts else f"{source} (held out by data.eval_split)"
    )
    empty = next((n for n, row in enumerate(evals[:num_eval], 1) if not tokens(row)), None)
    if empty is not None:
        raise ValueError(
            f"eval prompt {empty} of {where} has no tokens after tokenisation with target.model's tokenizer, and an "
            f"evaluation decodes the first eval.num_prompts={num_eval}: remove the empty rows or give them text"
        )


def _is_jsonl(source: str) -> bool:
    path = Path(source).expanduser()
    return path.suffix == ".jsonl" and path.is_file()


def _wants_magpie(cfg: DataConfig) -> bool:
    """generate:magpie renders the chat template whatever data.apply_chat_template says."""
    return prompt_gen.is_generated(cfg.train_prompts) and "magpie" in cfg.train_prompts
