"""Chat prompts without a data set: the target writes its own (Magpie), plus instructions cut from a local corpus.

    data.train_prompts: "generate:magpie"           # the target samples user turns from its chat template
    data.train_prompts: "generate:stdlib"           # "Write a Python function ..." from stdlib docstrings
    data.train_prompts: "generate:magpie+stdlib"    # both; data.generate_num_prompts rows per source

Magpie (Xu et al., 2024): render the chat template up to where a user message begins (system turn included) and
let the target continue. What an instruction-tuned model writes there is a user request drawn from its own idea
of what users ask: training prompts that follow the target's distribution, with no data set at hand.

Generated rows are `{"id", "messages": [{"role": "user", "content": ...}], "source"}`, deduplicated, and cached
as JSONL under the run's cache dir keyed by the target and every generation setting, so reruns and --resume
reuse them. The eval prompts are held out by the content-hash split of distill.data.prompts (or come from
`data.eval_prompts`); no training prompt equals an eval prompt. The held-out rows are also written next to the
cache as `prompts-<key>.eval.jsonl`, a prompt file for `python -m decode bench --prompts`.
"""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from decode.prompts import expand_turns, jsonl_text, read_jsonl, write_jsonl
from decode.speculative import target_generate
from distill.config import DataConfig
from distill.data import prompts
from distill.training.distributed import place

PREFIX = "generate:"
SOURCES = ("magpie", "stdlib")
_SENTINEL = "\x00USER-TURN\x00"
_MIN_CHARS = 12  # shorter "requests" are fragments ("Hi", "?"), not prompts worth training on
_CACHE_VERSION = 3  # 2: Magpie sampled in independently seeded shards; 3: by draftsmith's target loop


def is_generated(spec: str) -> bool:
    """True when `data.train_prompts` asks for generated prompts (`generate:...`)."""
    return spec.startswith(PREFIX)


def parse_spec(spec: str) -> list[str]:
    """`generate:magpie+stdlib` -> ["magpie", "stdlib"]; an unknown source is one clear ValueError."""
    names = [n.strip() for n in spec[len(PREFIX) :].split("+") if n.strip()]
    bad = [n for n in names if n not in SOURCES]
    if not names or bad:
        raise ValueError(
            f"data.train_prompts {spec!r}: unknown prompt generator {bad or '(none)'}; use generate: followed by "
            f"{' or '.join(SOURCES)} joined with '+' (e.g. generate:magpie+stdlib)"
        )
    return names


def require_chat_template(tokenizer: Any, what: str) -> None:
    """Raise one line when the target's tokenizer has no chat template but `what` needs one."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{what} needs a chat template, and the target's tokenizer has none: use an instruction-tuned target, "
            "raw {'prompt': ...} rows, or data.apply_chat_template=false"
        )


def check_chat_rows(rows: list[dict], tokenizer: Any, cfg: DataConfig) -> None:
    """Chat ('messages') rows with a target that has no chat template would be silently flattened: refuse them."""
    if cfg.apply_chat_template and any(r.get("messages") for r in rows):
        require_chat_template(tokenizer, "'messages' prompt rows (data.apply_chat_template=true)")


# ---------------------------------------------------------------- Magpie


def user_turn_prefix(tokenizer: Any) -> str:
    """The chat template rendered up to the first character of a user message (system turn and all)."""
    require_chat_template(tokenizer, "data.train_prompts 'generate:magpie'")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    return text[: text.index(_SENTINEL)]


def user_turn_suffix(tokenizer: Any) -> str:
    """What the template writes right after a user message (e.g. `<|im_end|>`): where a sampled request ends."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    return text[text.index(_SENTINEL) + len(_SENTINEL) :].strip()


def clean_request(text: str, stops: list[str]) -> str | None:
    """A sampled user turn cut at the first stop string and stripped; None when it is too short to use."""
    for stop in stops:
        if stop and stop in text:
            text = text[: text.index(stop)]
    text = text.strip()
    return text if len(text) >= _MIN_CHARS else None


def _shard_seed(seed: int, shard: int) -> int:
    return int.from_bytes(hashlib.sha1(f"magpie:{seed}:{shard}".encode()).digest()[:4], "little") & 0x7FFFFFFF


def _magpie_shard(
    target: torch.nn.Module, prefix: torch.Tensor, rows: int, *, max_new_tokens: int, temperature: float,
    stop_ids: list[int], seed: int,
) -> list[list[int]]:  # fmt: skip
    """`rows` user turns sampled after `prefix` in one batch, seeded by `seed` alone (not by earlier batches).

    draftsmith's own target loop (the decoder's, with its CPU kernels), not HF `generate`: the same sampling, and
    on SmolLM2 on CPU ~4x faster per request, most of a generated-prompt run's time before training."""
    generator = torch.Generator(device=prefix.device).manual_seed(seed)
    out = target_generate(
        target, prefix.expand(rows, -1), torch.ones_like(prefix).expand(rows, -1), max_new_tokens=max_new_tokens,
        temperature=temperature, eos_token_id=stop_ids or None, generator=generator,
    )  # fmt: skip
    return out.new_tokens


def magpie_prompts(
    target: torch.nn.Module, tokenizer: Any, n: int, *, max_new_tokens: int, temperature: float, seed: int,
    batch_size: int = 64, progress: bool = True, accelerator: Any = None,
) -> list[str]:  # fmt: skip
    """Up to `n` distinct user requests sampled from `target` after its chat template's user-turn prefix.

    Requests are sampled in batches ("shards") of `batch_size`, shard i seeded by (`seed`, i) alone. With
    `accelerator` (several processes) every process samples every world-th shard and the shards are gathered in
    order after each round, so the result is the same for any number of processes, and sampling hundreds of
    requests takes 1/world of the time. Sampling stops after 4n attempts even if fewer than `n` distinct
    requests came out. `progress`: a tqdm bar of the distinct requests found (on the main process).
    """
    rank, world, is_main = place(accelerator)
    if world > 1:
        from accelerate.utils import gather_object
    prefix = tokenizer(user_turn_prefix(tokenizer), add_special_tokens=False, return_tensors="pt")["input_ids"]
    suffix = user_turn_suffix(tokenizer)
    stops = [s for s in (suffix.split()[0] if suffix else "", tokenizer.eos_token) if s]
    stop_ids = [i for i in {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(stops[0])} if isinstance(i, int)]
    prefix = prefix.to(next(target.parameters()).device)
    shards = -(-4 * n // batch_size)  # the 4n-attempt cap, in whole shards
    found: dict[str, None] = {}
    bar = tqdm(total=n, desc="magpie prompts", unit="prompt", disable=not (progress and is_main))
    first = 0
    while len(found) < n and first < shards:
        mine = first + rank
        texts: list[str | None] = []
        if mine < shards:
            rows = min(batch_size, 4 * n - mine * batch_size)
            sampled = _magpie_shard(
                target, prefix, rows, max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=stop_ids,
                seed=_shard_seed(seed, mine),
            )  # fmt: skip
            texts = [clean_request(tokenizer.decode(seq, skip_special_tokens=False), stops) for seq in sampled]
        if world > 1:
            rounds = gather_object([texts])  # one list per process, in rank order = shard order
        else:
            rounds = [texts]
        for request in (t for shard in rounds for t in shard):
            if request is not None and len(found) < n and request not in found:
                found[request] = None
                bar.update(1)
        first += world
    bar.close()
    return list(found)


# ---------------------------------------------------------------- corpus instructions


def _signature(fn: ast.FunctionDef) -> str:
    args = [a.arg for a in fn.args.args if a.arg not in ("self", "cls")]
    if fn.args.vararg:
        args.append("*" + fn.args.vararg.arg)
    if fn.args.kwarg:
        args.append("**" + fn.args.kwarg.arg)
    return f"{fn.name}({', '.join(args)})"


def function_instructions(source: str) -> list[str]:
    """ "Write a Python function f(x, y) that ..." for each public top-level function whose docstring has a summary."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node) or ""
        summary = " ".join(doc.split("\n\n")[0].split())
        if len(summary) >= 20:
            out.append(f"Write a Python function {_signature(node)}. {summary}")
    return out


def stdlib_prompts(n: int, seed: int) -> list[str]:
    """Up to `n` distinct instructions from CPython's standard library docstrings.

    Files are visited in a seeded hash order and parsed only until `n` instructions are found (parsing the whole
    library takes a while), so a seed gives a fixed set drawn from across the library.
    """
    from distill.data.corpus import stdlib_files

    found: dict[str, None] = {}
    files = sorted(stdlib_files(), key=lambda f: hashlib.sha1(f"{seed}:{f[0]}".encode()).digest())
    for _, path in files:
        try:
            found.update(dict.fromkeys(function_instructions(path.read_text(encoding="utf-8"))))
        except (OSError, UnicodeDecodeError):
            continue
        if len(found) >= n:
            break
    return list(found)[:n]


# ---------------------------------------------------------------- rows, cache, split


def cache_key(target_name: str, cfg: DataConfig, seed: int) -> str:
    """A short hash of everything the generated prompts depend on."""
    settings = {
        "version": _CACHE_VERSION, "target": target_name, "spec": cfg.train_prompts, "n": cfg.generate_num_prompts,
        "max_new_tokens": cfg.generate_max_tokens, "temperature": cfg.generate_temperature, "seed": seed,
    }  # fmt: skip
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _rows(texts: list[str], source: str) -> list[dict]:
    return [{"id": f"{source}-{i}", "messages": [{"role": "user", "content": t}], "source": source} for i, t in
            enumerate(texts)]  # fmt: skip


def generate_rows(
    cfg: DataConfig, target: torch.nn.Module, tokenizer: Any, seed: int, accelerator: Any = None
) -> list[dict]:
    """Every requested source's rows, deduplicated across sources (first occurrence kept). With `accelerator`,
    every process must call it: they share the Magpie sampling and all get the same rows."""
    rows: list[dict] = []
    for name in parse_spec(cfg.train_prompts):
        if name == "magpie":
            texts = magpie_prompts(
                target, tokenizer, cfg.generate_num_prompts, max_new_tokens=cfg.generate_max_tokens,
                temperature=cfg.generate_temperature, seed=seed, accelerator=accelerator,
            )  # fmt: skip
        else:
            texts = stdlib_prompts(cfg.generate_num_prompts, seed)
        rows += _rows(texts, name)
    seen: set[str] = set()
    unique = []
    for row in rows:
        text = row["messages"][0]["content"]
        if text not in seen:
            seen.add(text)
            unique.append(row)
    return unique


def cached_rows(cfg: DataConfig, target: torch.nn.Module, tokenizer: Any, *, target_name: str, cache_dir: Path,
                seed: int, accelerator: Any = None) -> list[dict]:  # fmt: skip
    """The generated rows from `cache_dir`, generating (and writing atomically, on the main process) on a miss.
    With `accelerator`, every process must call it (see :func:`generate_rows`)."""
    parse_spec(cfg.train_prompts)
    if "magpie" in cfg.train_prompts or cfg.apply_chat_template:
        require_chat_template(tokenizer, f"data.train_prompts {cfg.train_prompts!r}")
    path = Path(cache_dir) / f"prompts-{cache_key(target_name, cfg, seed)}.jsonl"
    if path.is_file():
        return read_jsonl(path)
    rows = generate_rows(cfg, target, tokenizer, seed, accelerator)
    if len(rows) < 2:
        raise ValueError(
            f"data.train_prompts {cfg.train_prompts!r}: only {len(rows)} usable prompt(s) came out; "
            "raise data.generate_max_tokens or data.generate_num_prompts"
        )
    if accelerator is None or accelerator.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(rows, path)
    if accelerator is not None:
        accelerator.wait_for_everyone()  # no process reads a cache another is still writing
    return rows


def heldout_path(cfg: DataConfig, target_name: str, cache_dir: Path, seed: int) -> Path:
    """Where the held-out generated prompts are written, for `python -m decode bench --prompts`."""
    return Path(cache_dir) / f"prompts-{cache_key(target_name, cfg, seed)}.eval.jsonl"


def write_eval_file(rows: list[dict], path: Path) -> None:
    """Write `rows` as a prompt file (atomically; an identical file is left alone)."""
    if path.is_file() and path.read_text(encoding="utf-8") == jsonl_text(rows):
        return
    write_jsonl(rows, path)


def _content(row: dict, prompt_field: str) -> str:
    return json.dumps(row.get("messages") or row.get(prompt_field), sort_keys=True, ensure_ascii=False)


def without_overlap(train: list[dict], evals: list[dict], prompt_field: str = "prompt") -> list[dict]:
    """`train` minus every row whose content (its messages, else its `prompt_field` text) equals an eval row's."""
    held = {_content(r, prompt_field) for r in evals}
    return [r for r in train if _content(r, prompt_field) not in held]


def load_train_eval(
    cfg: DataConfig,
    target: torch.nn.Module,
    tokenizer: Any,
    *,
    target_name: str,
    cache_dir: Path,
    seed: int,
    accelerator: Any = None,
) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows) for `data`: generated when `train_prompts` is `generate:...`, else those of
    distill.data.prompts.

    Eval rows are `data.eval_prompts` when set, else the content-hash split (`data.eval_split`) of the rows;
    a multi-turn conversation then becomes one prompt per assistant turn (decode.prompts.expand_turns), and
    training rows equal to an eval row are dropped either way. Chat rows need the target's chat template. With
    `accelerator` and generated prompts, every process must call it: they sample the Magpie prompts together.
    """
    if not is_generated(cfg.train_prompts):
        train, evals = prompts.load_train_eval(cfg)
    else:
        rows = cached_rows(
            cfg, target, tokenizer, target_name=target_name, cache_dir=cache_dir, seed=seed, accelerator=accelerator
        )
        if cfg.eval_prompts:
            evals = prompts.load_rows(cfg.eval_prompts, key="data.eval_prompts", prompt_field=cfg.prompt_field)
            train = rows
        else:
            train, evals = prompts.split_rows(rows, cfg.eval_split, cfg.prompt_field)
            if not evals:
                raise ValueError(
                    "data.eval_split is 0 with generated prompts: set data.eval_split or data.eval_prompts"
                )
            if accelerator is None or accelerator.is_main_process:
                write_eval_file(evals, heldout_path(cfg, target_name, cache_dir, seed))
        if cfg.max_train_prompts:
            train = train[: cfg.max_train_prompts]
    # a conversation is split into train/eval whole, then into one prompt per assistant turn
    train, evals = expand_turns(train), expand_turns(evals)
    train = without_overlap(train, evals, cfg.prompt_field)
    check_chat_rows(train + evals, tokenizer, cfg)
    return train, evals
