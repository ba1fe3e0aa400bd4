"""What to publish: a run or checkpoint directory resolved into a PublishSource, and the names it goes out under.

`resolve_source` reads the checkpoint's eval.json, the run's report.json and resolved recipe, and any
eval_<engine>.json beside them; it refuses a best/ that the run's history does not select (a run stopped
mid-checkpoint), figures that are not a bench JSON, and a folder with no model. The name checks refuse a repo id
or config.json that would make vLLM load the draft as another speculative method; `scrub` / `scrub_text` /
`public_name` keep this machine's paths out of every uploaded text. Every failure is a one-line `PublishError`.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from decode import kinds
from distill.publishing.hub import PublishError, is_hub_id
from distill.training.run_state import stale_best

# vLLM picks the speculative method from the draft's name or config when they name one of these (substring
# match), so a repo named e.g. "gemma-eagle-draft" would be loaded as an EAGLE head instead of a draft model: its
# methods for drafts other than a draft LM, those of the kinds built from the target among them.
FORBIDDEN_NAME_WORDS = tuple(
    dict.fromkeys(
        [
            "eagle",
            *(t.vllm_method for t in kinds.KINDS.values() if not t.loads_draft_model),
            "medusa",
            "mlp_speculator",
            "mtp",
        ]
    )
)
# ... and in config.json's architectures / model_type (MLPSpeculatorPreTrainedModel has no underscore).
FORBIDDEN_CONFIG_WORDS = (*FORBIDDEN_NAME_WORDS, "speculator")
EVAL_KEYS = ("acceptance_rate", "mean_accepted_length", "num_draft_tokens", "speedup", "temperature", "new_tokens")
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# An absolute path in free text: /..., ~/..., C:\... or C:/..., \\server\...; not preceded by a word character,
# ':' or a separator, so that URLs and Hub ids ("org/name") are left alone. Directory names may hold spaces
# ("/home/Jane Doe/models/t"), so a path runs on through words while another separator follows; its last name
# ends at the first space.
_ABS_PATH_RE = re.compile(
    r"(?<![\w.:/\\~-])(?:~|[A-Za-z]:|\\)?"  # ~, a drive letter, or the first backslash of \\server
    r"(?:[\\/][\w.+@=-]+(?: [\w.+@=-]+)*(?=[\\/]))*"  # directories
    r"[\\/][\w.+@=-]+[\\/]?"  # the last name
)


# ---------------------------------------------------------------- inputs


def read_json(path: Path) -> Any:
    """A JSON file's content; PublishError (one line) when it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PublishError(f"cannot read {path}: {e}") from None


@dataclass
class PublishSource:
    """What a run or checkpoint directory provides for publishing."""

    model_dir: Path  # HF model dir or peft adapter dir
    eval: dict  # bench JSON of the published checkpoint (docs/bench.md), measured by the recipe's eval.engine
    label: str  # "best" or "checkpoints/step-N": where in the run it came from
    report: dict | None = None  # report.json of the run, when found
    recipe_path: Path | None = None
    step: int | None = None
    recipe: dict = field(default_factory=dict)  # resolved recipe as plain data ({} when not found)
    engines: dict = field(default_factory=dict)  # engine -> bench JSON from eval_<engine>.json beside eval.json


def check_repo_id(repo_id: str, names: bool = True) -> None:
    """USER/NAME, valid for the Hub, and (``names``) free of the words that make vLLM switch algorithm."""
    if not isinstance(repo_id, str) or not _REPO_ID_RE.match(repo_id) or ".." in repo_id or "--" in repo_id:
        raise PublishError(f"repo id {repo_id!r} is malformed: use USER/NAME (letters, digits, '-', '_', '.')")
    if repo_id.endswith(".git") or len(repo_id) > 96:
        raise PublishError(f"repo id {repo_id!r} is malformed: at most 96 characters, not ending in .git")
    if names:
        check_name_words(repo_id, "repo id")


def served_kind(model_dir: Path) -> str:
    """The draft kind of a folder to publish (:func:`decode.kinds.dispatch.folder_kind`): the kind its config.json
    records or its layout marks; a plain causal LM or a LoRA adapter is of the plain kind
    (``decode.kinds.PLAIN_LM``)."""
    from decode.kinds.dispatch import folder_kind

    return folder_kind(str(model_dir)) or kinds.PLAIN_LM


def copied_as_saved(model_dir: Path) -> bool:
    """The folder holds a draft built from the target (its kind's ``loads_draft_model`` is false): published in the
    layout its engines serve, as saved, never loaded through transformers; else a draft LM, merged and matched."""
    return not kinds.traits(served_kind(model_dir)).loads_draft_model


def check_name_words(name: str, what: str) -> None:
    """vLLM switches speculative method when the draft's name contains these words: refuse them."""
    hits = [w for w in FORBIDDEN_NAME_WORDS if w in name.lower()]
    if hits:
        raise PublishError(
            f"{what} {name!r} contains {hits[0]!r}: vLLM would load the draft as {hits[0].upper()} instead of "
            f"a draft model; choose a name without {', '.join(FORBIDDEN_NAME_WORDS)}"
        )


def check_plain_draft_config(config: dict) -> None:
    """A config.json whose architectures / model_type name a speculator kind would make vLLM pick that method."""
    names = [str(a) for a in config.get("architectures") or []] + [str(config.get("model_type") or "")]
    for name in names:
        hit = next((w for w in FORBIDDEN_CONFIG_WORDS if w in name.lower().replace("-", "_")), None)
        if hit:
            raise PublishError(
                f"the draft's config names {name!r}, a speculator kind ({hit}): vLLM would not load it as a plain "
                "draft model; publish a causal LM (e.g. LlamaForCausalLM) instead"
            )


def _extra_engines(model_dir: Path) -> dict[str, dict]:
    """eval_<engine>.json beside eval.json: the same draft measured by further engines (e.g. vLLM)."""
    found = {}
    for path in sorted(model_dir.glob("eval_*.json")):
        ev = read_json(path)
        if not isinstance(ev, dict) or "speedup" not in ev:
            raise PublishError(f"{path} is not a bench JSON (no 'speedup'): remove it or re-measure the draft")
        found[str(ev.get("engine") or path.stem.removeprefix("eval_"))] = ev
    return found


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
        report = read_json(source / "report.json")
        if not (source / "best").is_dir():
            raise PublishError(f"no best/ in {source}: the run has not saved a best checkpoint")
        if not isinstance(report, dict) or not isinstance(report.get("best"), dict):
            raise PublishError(f"{source / 'report.json'} has no 'best' entry")
        found = PublishSource(source / "best", report["best"], "best", report, step=report.get("best_step"))
        # a multi-kind run's own recipe lists its candidates; the winner's recipe is the one best/ holds
        run_dirs = [source / "best", source] if (source / "search.json").is_file() else [source]
    elif (source / "eval.json").is_file():
        run_dirs = [source, source.parent, source.parent.parent]  # best/ or checkpoints/step-N/
        report_file = next((d / "report.json" for d in run_dirs[1:] if (d / "report.json").is_file()), None)
        report = read_json(report_file) if report_file else None
        match = re.fullmatch(r"step-(\d+)", source.name)
        if match:
            step, label = int(match.group(1)), f"checkpoints/{source.name}"
        else:
            step, label = (report or {}).get("best_step") if source.name == "best" else None, source.name
        found = PublishSource(source, read_json(source / "eval.json"), label, report, step=step)
        if found.step is None and isinstance(found.eval, dict) and isinstance(found.eval.get("step"), int):
            found.step = found.eval["step"]  # train/distill.py records the step in eval.json too
    else:
        raise PublishError(
            f"no eval.json or report.json in {source}: pass a run directory (train/distill.py output_dir) "
            "or one of its checkpoints (best/ or checkpoints/step-N/)"
        )
    if not isinstance(found.eval, dict):
        raise PublishError(f"the eval figures for {found.label} are not a JSON object")
    if found.label == "best" and (why := stale_best(found.model_dir.parent)):
        raise PublishError(
            f"{why} (the run stopped before it finished): finish it with train/distill.py --resume, then publish"
        )
    missing = [k for k in EVAL_KEYS if k not in found.eval]
    if missing:
        raise PublishError(f"the eval figures for {found.label} lack {', '.join(missing)}: not a bench JSON")
    if not any((found.model_dir / f).is_file() for f in ("config.json", "adapter_config.json")):
        raise PublishError(f"{found.model_dir} holds no model (config.json) or LoRA adapter (adapter_config.json)")
    if (found.model_dir / "config.json").is_file() and not copied_as_saved(found.model_dir):  # an HF checkpoint
        check_plain_draft_config(read_json(found.model_dir / "config.json"))  # before any weight is loaded
    found.engines = _extra_engines(found.model_dir)
    found.recipe_path = next(
        (d / "resolved_recipe.yaml" for d in run_dirs if (d / "resolved_recipe.yaml").is_file()), None
    )
    if found.recipe_path is not None:
        try:
            found.recipe = yaml.safe_load(found.recipe_path.read_text()) or {}
        except yaml.YAMLError as e:
            raise PublishError(f"{found.recipe_path} is not valid YAML: {e}") from None
    return found


# ---------------------------------------------------------------- no local paths in what is uploaded


def _base_name(path: str) -> str:
    """The last name of a POSIX or Windows path, wherever this runs ("" for a root)."""
    return re.split(r"[\\/]", path.rstrip("\\/"))[-1]


def public_name(name: str | None, fallback: str = "a local model") -> str | None:
    """A Hub id as is; a local path as its base name (`fallback` when it has none)."""
    if not name or is_hub_id(name):
        return name
    return _base_name(name) or fallback


def scrub_text(text: str) -> str:
    """Every absolute path in `text` replaced by its base name (URLs and Hub ids stay)."""
    return _ABS_PATH_RE.sub(lambda m: _base_name(m.group()) or "a local path", text)


def scrub(obj: Any) -> Any:
    """`scrub_text` on every string of a JSON-like object."""
    if isinstance(obj, str):
        return scrub_text(obj)
    if isinstance(obj, dict):
        return {k: scrub(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    return obj


# ---------------------------------------------------------------- the recipe as it reruns elsewhere

# Recipe keys that name a model or a file to read (output_dir, a place to write, is kept by its base name).
INPUT_KEYS = ("target.model", "draft.model", "data.train_prompts", "data.eval_prompts")


def _is_absolute(value: str) -> bool:
    return bool(re.match(r"^(?:[\\/~]|[A-Za-z]:[\\/])", value))


def placeholder(name: str) -> str:
    """What an uploaded recipe or command says in place of a local path: the file to supply, by its name."""
    return f"<your copy of {_base_name(name) or 'a local file'}>"


def reproducible_recipe(recipe: dict) -> tuple[dict, dict[str, str]]:
    """The resolved recipe as it reruns on another machine, and the inputs to supply ({recipe key: placeholder}).

    What the run filled in goes back to empty, as the recipe had it: a cut draft's draft.model (draft.init:
    truncate builds it from the target again), the quickstart's models and prompt files (build_pair:
    quickstart), distill.cache_dir. An input read from an absolute path of this machine becomes a placeholder
    naming the file (`<your copy of NAME>`), never a bare base name that would fail as a relative path; an
    absolute output_dir becomes its base name, written under the working directory. Hub ids, relative paths
    and generated prompt sets stay as they are.
    """
    out = copy.deepcopy(recipe)
    needed: dict[str, str] = {}
    if (out.get("draft") or {}).get("init") == "truncate":
        out["draft"]["model"] = ""
    if isinstance((out.get("distill") or {}).get("cache_dir"), str) and _is_absolute(out["distill"]["cache_dir"]):
        out["distill"]["cache_dir"] = ""
    quickstart = out.get("build_pair") == "quickstart"
    for key in INPUT_KEYS:
        section, leaf = key.split(".")
        node = out.get(section)
        value = node.get(leaf) if isinstance(node, dict) else None
        if not isinstance(value, str) or not _is_absolute(value):
            continue
        node[leaf] = "" if quickstart else placeholder(value)
        if not quickstart:
            needed[key] = node[leaf]
    if isinstance(out.get("output_dir"), str) and _is_absolute(out["output_dir"]):
        out["output_dir"] = _base_name(out["output_dir"]) or "run"
    return out, needed
