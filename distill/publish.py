"""Publish a distilled draft: merge LoRA, match the target's vocabulary, write a model card, push to the Hub.

The published folder is a plain Transformers repo that HF assisted generation (`assistant_model=`), vLLM
(`method: draft_model`) and SGLang (`STANDALONE`) take unchanged:

    model.safetensors (+ config.json)   merged weights; vocab_size equal to the target's (rows padded if needed)
    tokenizer files                     the target's, so both models tokenize identically
    generation_config.json              num_assistant_tokens = the best measured gamma, constant schedule
    README.md                           model card: measured figures, hardware, prompts, recipe, usage
    draftsmith_eval.json                the same figures, machine-readable (the card is rendered from it)
    resolved_recipe.yaml                the recipe that trained the draft

`build_publish_folder` does everything but the upload; `push_folder` uploads; `publish` is both (or a dry
run). Every user-facing failure is a `PublishError` whose message is one line.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("draftsmith.publish")

# vLLM picks the speculative method from the draft's name when it contains one of these (substring match), so
# a repo or folder named e.g. "gemma-eagle-draft" would be loaded as an EAGLE head instead of a draft model.
FORBIDDEN_NAME_WORDS = ("eagle", "eagle3", "dflash", "dspark")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)
EVAL_KEYS = ("acceptance_rate", "mean_accepted_length", "num_draft_tokens", "speedup", "temperature", "new_tokens")
TAGS = ["speculative-decoding", "draft-model", "draftsmith"]
OFFLINE_MSG = "the Hub is offline (HF_HUB_OFFLINE=1): unset it to upload, or pass --dry-run DIR to write the folder"
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


class PublishError(RuntimeError):
    """Publishing cannot go on; the message is one line that names the fix."""


# ---------------------------------------------------------------- inputs


@dataclass
class PublishSource:
    """What a run or checkpoint directory provides for publishing."""

    model_dir: Path  # HF model dir or peft adapter dir
    eval: dict  # bench JSON of the published checkpoint (docs/bench.md)
    label: str  # "best" or "checkpoints/step-N": where in the run it came from
    report: dict | None = None  # report.json of the run, when found
    recipe_path: Path | None = None
    step: int | None = None
    recipe: dict = field(default_factory=dict)  # resolved recipe as plain data ({} when not found)


def check_repo_id(repo_id: str) -> None:
    """USER/NAME, valid for the Hub, and free of the words that make vLLM switch algorithm."""
    if not isinstance(repo_id, str) or not _REPO_ID_RE.match(repo_id) or ".." in repo_id or "--" in repo_id:
        raise PublishError(f"repo id {repo_id!r} is malformed: use USER/NAME (letters, digits, '-', '_', '.')")
    if repo_id.endswith(".git") or len(repo_id) > 96:
        raise PublishError(f"repo id {repo_id!r} is malformed: at most 96 characters, not ending in .git")
    check_name_words(repo_id, "repo id")


def check_name_words(name: str, what: str) -> None:
    """vLLM switches speculative method when the draft's name contains these words: refuse them."""
    hits = [w for w in FORBIDDEN_NAME_WORDS if w in name.lower()]
    if hits:
        raise PublishError(
            f"{what} {name!r} contains {hits[0]!r}: vLLM would load the draft as {hits[0].upper()} instead of "
            f"a draft model; choose a name without {', '.join(FORBIDDEN_NAME_WORDS)}"
        )


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PublishError(f"cannot read {path}: {e}") from None


def resolve_source(source: str | Path) -> PublishSource:
    """A run directory (best/ + report.json) or a checkpoint directory (its eval.json) -> PublishSource."""
    source = Path(source)
    if not source.is_dir():
        raise PublishError(f"{source} is not a directory: pass a run directory or a checkpoint directory")
    if (source / "report.json").is_file() or (source / "best").is_dir():
        if not (source / "report.json").is_file():
            raise PublishError(
                f"no report.json in {source} (train/distill.py writes it when the run ends); "
                f"publish a checkpoint instead, e.g. {source / 'best'}"
            )
        report = _read_json(source / "report.json")
        if not (source / "best").is_dir():
            raise PublishError(f"no best/ in {source}: the run has not saved a best checkpoint")
        if not isinstance(report, dict) or not isinstance(report.get("best"), dict):
            raise PublishError(f"{source / 'report.json'} has no 'best' entry")
        found = PublishSource(source / "best", report["best"], "best", report, step=report.get("best_step"))
        run_dirs = [source]
    elif (source / "eval.json").is_file():
        run_dirs = [source, source.parent, source.parent.parent]  # best/ or checkpoints/step-N/
        report_file = next((d / "report.json" for d in run_dirs[1:] if (d / "report.json").is_file()), None)
        report = _read_json(report_file) if report_file else None
        match = re.fullmatch(r"step-(\d+)", source.name)
        if match:
            step, label = int(match.group(1)), f"checkpoints/{source.name}"
        else:
            step, label = (report or {}).get("best_step") if source.name == "best" else None, source.name
        found = PublishSource(source, _read_json(source / "eval.json"), label, report, step=step)
        if found.step is None and isinstance(found.eval, dict) and isinstance(found.eval.get("step"), int):
            found.step = found.eval["step"]  # train/distill.py records the step in eval.json too
    else:
        raise PublishError(
            f"no eval.json or report.json in {source}: pass a run directory (train/distill.py output_dir) "
            "or one of its checkpoints (best/ or checkpoints/step-N/)"
        )
    if not isinstance(found.eval, dict):
        raise PublishError(f"the eval figures for {found.label} are not a JSON object")
    missing = [k for k in EVAL_KEYS if k not in found.eval]
    if missing:
        raise PublishError(f"the eval figures for {found.label} lack {', '.join(missing)}: not a bench JSON")
    if not any((found.model_dir / f).is_file() for f in ("config.json", "adapter_config.json")):
        raise PublishError(f"{found.model_dir} holds no model (config.json) or LoRA adapter (adapter_config.json)")
    found.recipe_path = next(
        (d / "resolved_recipe.yaml" for d in run_dirs if (d / "resolved_recipe.yaml").is_file()), None
    )
    if found.recipe_path is not None:
        try:
            found.recipe = yaml.safe_load(found.recipe_path.read_text()) or {}
        except yaml.YAMLError as e:
            raise PublishError(f"{found.recipe_path} is not valid YAML: {e}") from None
    return found


def _recipe_get(recipe: dict, dotted: str, default: Any = None) -> Any:
    node: Any = recipe
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return default if node in (None, "") else node


def is_hub_id(name: str | None) -> bool:
    """A Hub model id (`org/name` or a legacy bare name) rather than a local path."""
    return bool(name) and not Path(name).exists() and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) is not None


def local_hardware() -> str:
    """What this machine has (used only when the eval figures do not record their hardware)."""
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return f"{n} x {torch.cuda.get_device_name(0)}" if n > 1 else torch.cuda.get_device_name(0)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {cpu}, {os.cpu_count()} cores"


# ---------------------------------------------------------------- model


def load_merged_draft(src: PublishSource):
    """The draft as a plain transformers model: a LoRA adapter is merged into its base (in fp32, then cast back).

    Returns (model, base_id): base_id is the model the draft was fine-tuned from.
    """
    import torch
    from transformers import AutoModelForCausalLM

    trust = bool(_recipe_get(src.recipe, "draft.trust_remote_code", False))
    adapter_file = src.model_dir / "adapter_config.json"
    if not adapter_file.is_file():
        model = AutoModelForCausalLM.from_pretrained(src.model_dir, dtype="auto", trust_remote_code=trust)
        return model, _recipe_get(src.recipe, "draft.model") or src.eval.get("draft")
    from peft import PeftModel

    adapter = _read_json(adapter_file)
    base_id = adapter.get("base_model_name_or_path") or _recipe_get(src.recipe, "draft.model")
    if not base_id:
        raise PublishError(f"{adapter_file} names no base model and no recipe was found: cannot merge the LoRA")
    revision = _recipe_get(src.recipe, "draft.revision") if base_id == _recipe_get(src.recipe, "draft.model") else None
    try:
        base = AutoModelForCausalLM.from_pretrained(base_id, dtype="auto", revision=revision, trust_remote_code=trust)
    except OSError as e:
        raise PublishError(f"cannot load the LoRA's base model {base_id!r}: {_first_line(e)}") from None
    dtype = base.dtype
    # Merge in fp32: W + (alpha / r) * B @ A rounded once, not at every bf16 step.
    merged = PeftModel.from_pretrained(base.to(torch.float32), src.model_dir).merge_and_unload()
    return merged.to(dtype), base_id


def declared_dtype(model_id: str | None, trust_remote_code: bool = False) -> str | None:
    """The dtype a model's config.json declares ('bfloat16', ...), or None when its config cannot be read."""
    if not model_id:
        return None
    from transformers import AutoConfig

    try:
        dtype = getattr(AutoConfig.from_pretrained(model_id, trust_remote_code=trust_remote_code), "dtype", None)
    except Exception:  # noqa: BLE001 - offline / gated: keep the weights as they are
        return None
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def match_vocab(model, target_vocab: int) -> tuple[int, int]:
    """Resize the draft's embeddings (and untied lm_head) to the target's vocabulary size.

    Padded rows are the mean of the existing rows: the padded ids never come out of the tokenizer, and an
    lm_head row equal to the mean row gives the mean logit, which can never be the draft's greedy choice.
    Rows beyond the target's vocabulary are dropped (the target's tokenizer never produces them).
    Returns (old, new) vocab sizes.
    """
    import torch

    old = model.get_input_embeddings().weight.shape[0]
    if old != target_vocab:
        model.resize_token_embeddings(target_vocab, mean_resizing=False)
        if target_vocab > old:
            with torch.no_grad():
                emb = model.get_input_embeddings().weight
                emb[old:] = emb[:old].mean(0)
                head = model.get_output_embeddings()
                if head is not None and head.weight.data_ptr() != emb.data_ptr():
                    head.weight[old:] = head.weight[:old].mean(0)
                if head is not None and getattr(head, "bias", None) is not None:
                    head.bias[old:] = head.bias[:old].mean()
    model.config.get_text_config().vocab_size = target_vocab
    return old, target_vocab


def generation_config_for(model, target_gen, num_assistant_tokens: int):
    """The draft's generation config with the target's special tokens and the best measured gamma."""
    gen = model.generation_config
    if target_gen is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(target_gen, key, None) is not None:
                setattr(gen, key, getattr(target_gen, key))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(gen, key, None) is None and getattr(model.config, key, None) is not None:
            setattr(gen, key, getattr(model.config, key))
    # HF assisted generation reads these from the assistant's generation config (its default gamma is 20). The
    # figures were measured with a constant gamma; HF's default confidence threshold (0.4) would end drafts early
    # and change it, so 0 turns that off: the published draft runs as measured.
    gen.num_assistant_tokens = num_assistant_tokens
    gen.num_assistant_tokens_schedule = "constant"
    gen.assistant_confidence_threshold = 0.0
    gen._from_model_config = False  # edited on purpose: transformers must not regenerate it from config.json
    return gen


def best_gamma(ev: dict) -> int:
    """The gamma measured in the eval: num_draft_tokens, or the mean gamma used when it was 'auto'."""
    g = ev.get("num_draft_tokens")
    if isinstance(g, int) and not isinstance(g, bool) and g > 0:
        return g
    return max(1, round(float(ev.get("mean_num_draft_tokens") or 1)))


def _copy_tokenizer(target: str, src: PublishSource, dest: Path, trust: bool, notes: list[str]) -> str:
    """The target's tokenizer files into dest; falls back to the draft's (with a note). Returns "target" or "draft"."""
    if Path(target).is_dir() and any((Path(target) / f).is_file() for f in TOKENIZER_FILES):
        for f in TOKENIZER_FILES:
            if (Path(target) / f).is_file():
                shutil.copy2(Path(target) / f, dest / f)
        return "target"
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(target, trust_remote_code=trust).save_pretrained(dest)
        return "target"
    except Exception as e:  # noqa: BLE001 - offline, gated, missing: all mean "fall back to the draft's"
        reason = _first_line(e)
    for d in (src.model_dir, src.model_dir.parent, src.model_dir.parent.parent):
        if any((d / f).is_file() for f in TOKENIZER_FILES[:2]):
            for f in TOKENIZER_FILES:
                if (d / f).is_file():
                    shutil.copy2(d / f, dest / f)
            notes.append(f"tokenizer files copied from the draft: the target's ({target}) could not be loaded")
            log.warning(f"{notes[-1]} ({reason})")
            return "draft"
    raise PublishError(f"no tokenizer: the target's ({target}) could not be loaded ({reason}) and the draft has none")


# ---------------------------------------------------------------- card


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float):
        return spec.format(value)
    return str(value)


def _rows(ev: dict) -> list[tuple[str, str]]:
    """(label, formatted value) for one bench JSON: the card's table column."""
    tps, sp = ev.get("tokens_per_s") or {}, ev.get("speedup") or {}
    return [
        ("acceptance rate (accepted / drafted tokens)", _fmt(ev.get("acceptance_rate"), "{:.3f}")),
        ("τ, mean accepted length (tokens per target pass)", _fmt(ev.get("mean_accepted_length"), "{:.2f}")),
        ("speedup vs target-only decoding", _fmt(sp.get("vs_target"), "{:.2f}x")),
        ("speedup vs HF assisted generation", _fmt(sp.get("vs_hf_assisted"), "{:.2f}x")),
        ("… with HF on draftsmith's CPU kernels", _fmt(sp.get("vs_hf_assisted_same_kernels"), "{:.2f}x")),
        ("tokens/s: speculative", _fmt(tps.get("speculative"), "{:.1f}")),
        ("tokens/s: target only", _fmt(tps.get("target"), "{:.1f}")),
        ("tokens/s: HF assisted generation", _fmt(tps.get("hf_assisted"), "{:.1f}")),
        ("γ, draft tokens per round", _fmt(ev.get("num_draft_tokens"), "{}")),
        ("draft cost ratio c", _fmt(ev.get("draft_cost_ratio"), "{:.3f}")),
        ("theoretical speedup (forward times only)", _fmt(ev.get("theoretical_speedup"), "{:.2f}x")),
        ("outputs match the target's (greedy)", _fmt(ev.get("outputs_match_target"), "{}")),
    ]


def front_matter(info: dict) -> dict:
    """The card's YAML metadata (Hub model card fields + the target the draft was made for)."""
    meta: dict[str, Any] = {}
    if is_hub_id(info["base_model"]):
        meta["base_model"] = info["base_model"]
        meta["base_model_relation"] = "finetune"
    meta.update(library_name="transformers", pipeline_tag="text-generation", tags=list(TAGS))
    meta["target_model"] = info["target"]
    return meta


def render_model_card(info: dict, repo_id: str, recipe_text: str | None = None) -> str:
    """README.md for the published draft, rendered from `info` (the content of draftsmith_eval.json)."""
    best, base = info["best"], info.get("base")
    target, gamma = info["target"], info["num_assistant_tokens"]
    name = repo_id.split("/")[-1]
    meta = yaml.safe_dump(front_matter(info), sort_keys=False, allow_unicode=True)
    step = f"step {info['best_step']}" if info.get("best_step") is not None else info["checkpoint"]
    lines = [f"---\n{meta}---", "", f"# {name}", ""]
    lines += [
        f"A draft model for speculative decoding with **{target}** as the target, trained from "
        f"**{info['base_model']}** with draftsmith ({info['method']}). Speculative decoding "
        "is lossless: the text is the target's own; the draft only makes it come out faster.",
        "",
        "## Measured speedup",
        "",
        f"Target: `{target}`. Measured by draftsmith's speculative decoder (`python -m decode bench`) on "
        f"held-out prompts, warm-up first, methods interleaved prompt by prompt, median of repeats.",
        "",
    ]
    columns = [_rows(base), _rows(best)] if base else [_rows(best)]
    header = ("| | base draft " if base else "| ") + f"| this draft ({step}) |"
    lines += [header, "|---" * (len(columns) + 1) + "|"]
    for i, (label, _) in enumerate(columns[-1]):
        lines.append(f"| {label} | " + " | ".join(col[i][1] for col in columns) + " |")
    ppa = best.get("per_position_acceptance") or []
    lines += [
        "",
        f"- per-position acceptance (draft token 1, 2, ...): {', '.join(f'{p:.3f}' for p in ppa) or 'n/a'}",
        f"- temperature: {best['temperature']}; new tokens per prompt: {best['new_tokens']}; "
        f"prompts: {best.get('n_prompts', 'n/a')}; batch size: {best.get('batch_size', 'n/a')}",
        f"- prompts file: {info['prompts']}",
        f"- hardware: {info['hardware']}",
        f"- `generation_config.json` sets `num_assistant_tokens: {gamma}` (the measured γ), constant, no early stop",
    ]
    lines += [f"- note: {note}" for note in info.get("notes", [])]
    if info.get("checkpoints"):
        lines += ["", "Evaluations during training:", "", "| step | speedup vs target | acceptance rate | loss |"]
        lines.append("|---|---|---|---|")
        for c in info["checkpoints"]:
            lines.append(
                f"| {c.get('step')} | {_fmt(c.get('speedup'), '{:.2f}x')} | "
                f"{_fmt(c.get('acceptance_rate'), '{:.3f}')} | {_fmt(c.get('loss'), '{:.4f}')} |"
            )
    spec = json.dumps({"model": repo_id, "method": "draft_model", "num_speculative_tokens": gamma})
    prompts_file = info["prompts"] if str(info["prompts"]).endswith(".jsonl") else "PROMPTS.jsonl"
    lines += [
        "",
        "## Usage",
        "",
        "Transformers (assisted generation; the draft's `generation_config.json` carries the measured γ):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{target}")',
        f'target = AutoModelForCausalLM.from_pretrained("{target}", dtype="auto", device_map="auto")',
        f'draft = AutoModelForCausalLM.from_pretrained("{repo_id}", dtype="auto", device_map="auto")',
        'inputs = tokenizer("The key idea of speculative decoding is", return_tensors="pt").to(target.device)',
        "out = target.generate(**inputs, assistant_model=draft, max_new_tokens=128, do_sample=False)",
        "print(tokenizer.decode(out[0], skip_special_tokens=True))",
        "```",
        "",
        "vLLM:",
        "",
        "```python",
        "from vllm import LLM, SamplingParams",
        "",
        f'llm = LLM(model="{target}", speculative_config={spec})',
        "params = SamplingParams(temperature=0, max_tokens=128)",
        'print(llm.generate(["The key idea of speculative decoding is"], params)[0].outputs[0].text)',
        "```",
        "",
        "```bash",
        f"vllm serve {target} --speculative-config '{spec}'",
        "```",
        "",
        "SGLang:",
        "",
        "```bash",
        f"python -m sglang.launch_server --model-path {target} \\",
        f"    --speculative-algorithm STANDALONE --speculative-draft-model-path {repo_id} \\",
        f"    --speculative-num-steps {gamma} --speculative-eagle-topk 1 --speculative-num-draft-tokens {gamma + 1}",
        "```",
        "",
        "## Reproduce",
        "",
        "Train (the recipe below is also in this repo as `resolved_recipe.yaml`) and measure:",
        "",
        "```bash",
        "accelerate launch train/distill.py --recipe resolved_recipe.yaml",
        f"python -m decode bench --target {target} --draft {repo_id} --prompts {prompts_file} "
        f"--num-draft-tokens {best['num_draft_tokens']} --temperature {best['temperature']} "
        f"--max-new-tokens {best['new_tokens']}",
        "```",
        "",
    ]
    if recipe_text:
        lines += ["Recipe:", "", "```yaml", recipe_text.rstrip(), "```", ""]
    else:
        lines += ["The recipe was not found beside the checkpoint.", ""]
    lines += ["The figures above are in `draftsmith_eval.json` in this repo, machine-readable.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- build, push, publish


def _describe_method(recipe: dict, lora: bool) -> str:
    loss = _recipe_get(recipe, "distill.loss")
    source = _recipe_get(recipe, "distill.source")
    how = f"LoRA r={_recipe_get(recipe, 'draft.lora.r', '?')}, merged" if lora else "full fine-tune"
    return f"{loss} distillation on {source} sequences, {how}" if loss else how


def _prompts_name(src: PublishSource) -> str:
    if src.eval.get("prompts"):
        return str(src.eval["prompts"])
    eval_prompts = _recipe_get(src.recipe, "data.eval_prompts")
    if eval_prompts:
        return Path(eval_prompts).name if Path(eval_prompts).is_file() else eval_prompts
    train = _recipe_get(src.recipe, "data.train_prompts")
    if train:
        train = Path(train).name if Path(train).is_file() else train
        return f"held-out {_recipe_get(src.recipe, 'data.eval_split', 0.05)} of {train} (from the recipe)"
    return "not recorded"


def _check_empty_dest(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise PublishError(f"{out_dir} exists and is not empty: choose a new --dry-run directory")


def build_publish_folder(source: str | Path, out_dir: str | Path, repo_id: str) -> Path:
    """Write everything that would be uploaded for `repo_id` into `out_dir` (atomically); return out_dir.

    `source` is a run directory (best/ + report.json) or a checkpoint directory (with eval.json).
    `out_dir` must not exist or be empty; it appears only when complete.
    """
    check_repo_id(repo_id)
    return _build_atomic(resolve_source(source), Path(out_dir), repo_id)


def _build_atomic(src: PublishSource, out_dir: Path, repo_id: str) -> Path:
    _check_empty_dest(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
    try:
        _build_into(src, tmp, repo_id)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _build_into(src: PublishSource, dest: Path, repo_id: str) -> None:
    import torch
    from transformers import AutoConfig, GenerationConfig

    notes: list[str] = []
    recipe = src.recipe
    if src.recipe_path is None:
        notes.append("no resolved_recipe.yaml found beside the checkpoint; target and draft taken from eval.json")
        log.warning(notes[-1])
    target = _recipe_get(recipe, "target.model") or src.eval.get("target")
    if not target:
        raise PublishError("the target model is unknown: no recipe and no 'target' in the eval figures")
    t_rev = _recipe_get(recipe, "target.revision")
    trust = bool(_recipe_get(recipe, "target.trust_remote_code", False))

    model, base_id = load_merged_draft(src)
    base_dtype = declared_dtype(base_id, bool(_recipe_get(recipe, "draft.trust_remote_code", False)))
    if model.dtype == torch.float32 and base_dtype in ("bfloat16", "float16"):
        # A fully fine-tuned draft trains in fp32 master weights; publish it in the dtype it came in (half the size).
        model.to(getattr(torch, base_dtype))
        notes.append(f"weights cast from float32 to {base_dtype}, the dtype of the base draft")
    lora = (src.model_dir / "adapter_config.json").is_file() or bool(_recipe_get(recipe, "draft.lora.enabled"))

    # Vocabulary: the target's config only (never its weights).
    try:
        t_cfg = AutoConfig.from_pretrained(target, revision=t_rev, trust_remote_code=trust)
        target_vocab = t_cfg.get_text_config().vocab_size
    except Exception as e:  # noqa: BLE001 - offline / gated / unknown architecture: keep the draft's vocab
        target_vocab = None
        notes.append(f"the target's config ({target}) could not be loaded, so vocab_size is the draft's, unchecked")
        log.warning(f"{notes[-1]} ({_first_line(e)})")
    old_vocab = model.get_input_embeddings().weight.shape[0]
    if target_vocab is not None and target_vocab != old_vocab:
        match_vocab(model, target_vocab)
        what = "padded" if target_vocab > old_vocab else "truncated"
        notes.append(f"draft vocabulary {what} from {old_vocab} to the target's {target_vocab} rows")
        log.warning(notes[-1])
    vocab = model.get_input_embeddings().weight.shape[0]

    try:
        target_gen = GenerationConfig.from_pretrained(target, revision=t_rev)
    except Exception:  # noqa: BLE001 - many repos have no generation_config.json; the draft's tokens are kept
        target_gen = None
    gamma = best_gamma(src.eval)
    model.generation_config = generation_config_for(model, target_gen, gamma)
    model.save_pretrained(dest)
    tokenizer_from = _copy_tokenizer(target, src, dest, trust, notes)

    from transformers import AutoTokenizer

    n_tokens = len(AutoTokenizer.from_pretrained(dest, trust_remote_code=trust))
    if n_tokens > vocab:
        raise PublishError(f"the tokenizer has {n_tokens} tokens but the draft only {vocab} embedding rows")

    hardware = src.eval.get("hardware")
    if not hardware:
        hardware = f"{local_hardware()} (recorded at publish time; the eval did not record its hardware)"
    info = {
        "repo_id": repo_id,
        "target": target,
        "base_model": base_id or "unknown",
        "checkpoint": src.label,
        "best_step": src.step,
        "method": _describe_method(recipe, lora),
        "num_assistant_tokens": gamma,
        "hardware": hardware,
        "prompts": _prompts_name(src),
        "vocab_size": {"draft": old_vocab, "target": target_vocab, "published": vocab},
        "tokenizer_from": tokenizer_from,
        "notes": notes,
        "best": src.eval,
        "base": (src.report or {}).get("base"),
        "checkpoints": (src.report or {}).get("checkpoints", []),
    }
    if not is_hub_id(info["base_model"]):
        log.warning(f"draft base {info['base_model']!r} is not a Hub id: the card omits base_model")
    recipe_text = src.recipe_path.read_text() if src.recipe_path else None
    if recipe_text:
        (dest / "resolved_recipe.yaml").write_text(recipe_text)
    (dest / "draftsmith_eval.json").write_text(json.dumps(info, indent=2) + "\n")
    (dest / "README.md").write_text(render_model_card(info, repo_id, recipe_text))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as the environment says now."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def check_hub_access() -> str:
    """The logged-in user name; PublishError (one line) when offline or not logged in. No upload happens here."""
    if hub_offline():
        raise PublishError(OFFLINE_MSG)
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    try:
        return HfApi().whoami()["name"]
    except LocalTokenNotFoundError:
        raise PublishError("not logged in to the Hugging Face Hub: set HF_TOKEN or run `hf auth login`") from None
    except OfflineModeIsEnabled:
        raise PublishError(OFFLINE_MSG) from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise PublishError(
                f"the Hub refused the token (HTTP {status}): set a valid HF_TOKEN with write access"
            ) from None
        raise PublishError(f"cannot reach the Hub: {_first_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - transport errors (httpx / requests, by hub version): one line
        raise PublishError(f"cannot reach the Hub: {_first_line(e)}") from None


def push_folder(
    folder: str | Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload a built folder to `repo_id` (created if needed; `revision` is a branch, created if needed).

    Checks offline mode and the login (`whoami`) first; every Hub failure becomes a one-line PublishError.
    Returns the repo URL.
    """
    check_repo_id(repo_id)
    check_hub_access()
    return _upload(Path(folder), repo_id, private, revision, commit_message)


def _upload(folder: Path, repo_id: str, private: bool, revision: str | None, commit_message: str | None) -> str:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            revision=revision,
            repo_type="model",
            commit_message=commit_message or "Upload draft model (draftsmith)",
        )
    except HfHubHTTPError as e:
        raise PublishError(f"upload to {repo_id} failed: {_first_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - transport errors (httpx / requests, by hub version): one line
        raise PublishError(f"upload to {repo_id} failed: {_first_line(e)}") from None
    url = str(url).rstrip("/")
    return f"{url}/tree/{revision}" if revision else url


def publish(
    source: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    dry_run_dir: str | Path | None = None,
    commit_message: str | None = None,
) -> str:
    """Build the publish folder from a run or checkpoint dir and upload it; or, with `dry_run_dir`, only write it.

    Returns the repo URL, or the dry-run folder's path. A bad source, an offline Hub or a missing login fail
    before the (slow) build and before anything is uploaded.
    """
    check_repo_id(repo_id)
    if dry_run_dir is not None:
        check_name_words(str(Path(dry_run_dir).resolve()), "dry-run path")
        return str(build_publish_folder(source, dry_run_dir, repo_id))
    src = resolve_source(source)
    check_hub_access()
    with tempfile.TemporaryDirectory(prefix="draftsmith-publish-") as tmp:
        folder = _build_atomic(src, Path(tmp) / repo_id.split("/")[-1], repo_id)
        return _upload(folder, repo_id, private, revision, commit_message)
