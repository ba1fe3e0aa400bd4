"""Pretrain a causal LM from scratch on a local corpus (train/pretrain.py), and the cached quickstart pair.

``pretrain(recipe)`` runs the accelerate loop written out: corpus -> tokenizer -> packed chunks -> model from a
transformers config class -> AdamW with warm-up + cosine (fitted to ``train.max_minutes`` when set) -> held-out
loss -> a plain HF checkpoint written atomically (``<output_dir>.tmp-XXXX`` renamed into place), so an
interrupted run leaves nothing that looks finished.

``ensure_quickstart_pair()`` builds (or reuses) the two models of the offline quickstart from
recipes/pretrain/quickstart-{target,draft}.yaml under ``~/.cache/draftsmith/quickstart`` (``$DRAFTSMITH_CACHE``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from decode import sources
from decode.sources import is_gguf
from distill.config import (
    ArchConfig,
    PretrainRecipe,
    RecipeError,
    TokenizerConfig,
    dump_recipe,
    load_recipe,
    to_dict,
)
from distill.data.corpus import Corpus, PackedChunks, eval_windows, load_corpus, load_tokenizer, pack, train_tokenizer
from distill.models import resolve_mixed_precision
from distill.training.checkpoints import replace_dir
from distill.training.tracking import tracker_setup

MIN_LR_RATIO = 0.1  # the cosine ends at 10% of the peak learning rate
VOCAB_MULTIPLE = 64  # a vocabulary sized to the tokenizer is rounded up to this (matmul-friendly)
RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "pretrain"
PRETRAIN_SCRIPT = RECIPES.parents[1] / "train" / "pretrain.py"
MARKER = "TRAINING.json"  # written last into a finished checkpoint; its presence marks a dir as ours


# ---------------------------------------------------------------- build_* helpers


def build_tokenizer(cfg: TokenizerConfig, corpus: Corpus):
    """The recipe's tokenizer: loaded from `cfg.path`, or a byte-level BPE trained on the training documents."""
    if cfg.path and is_gguf(cfg.path):  # the target's own tokenizer, read from its GGUF file (full vocab kept)
        tok = sources.load_tokenizer(cfg.path, key="tokenizer.path")
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return tok
    if cfg.path:
        return load_tokenizer(cfg.path)
    return train_tokenizer((d.text for d in corpus.train), cfg.vocab_size)


def resolve_vocab_size(arch: ArchConfig, tokenizer, tokenizer_source: str = "the tokenizer") -> int:
    """`model.extra.vocab_size` when the recipe fixes it (checked against the tokenizer), else len(tokenizer)
    rounded up to a multiple of 64."""
    n = len(tokenizer)
    fixed = arch.extra.get("vocab_size")
    if fixed is None:
        return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if not isinstance(fixed, int) or fixed < n:
        raise RecipeError(
            f"model.extra.vocab_size: {fixed!r} is smaller than {tokenizer_source} ({n} tokens); "
            f"set it >= {n} or remove it (it then follows the tokenizer)"
        )
    return fixed


def build_model(arch: ArchConfig, vocab_size: int, tokenizer):
    """A randomly initialised causal LM of the recipe's architecture (seed it first)."""
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig

    cls = getattr(transformers, arch.config_class, None)
    if not (isinstance(cls, type) and issubclass(cls, PretrainedConfig)):
        import difflib

        names = [n for n in dir(transformers) if n.endswith("Config")]
        close = difflib.get_close_matches(arch.config_class, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else " (e.g. LlamaConfig, Qwen2Config, MistralConfig)"
        raise RecipeError(f"model.config_class: {arch.config_class!r} is not a transformers config class{hint}")
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    ids["pad_token_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ids["eos_token_id"]
    if ids["bos_token_id"] is None:
        ids["bos_token_id"] = ids["eos_token_id"]
    extra = dict(arch.extra)
    attn = extra.pop("attn_implementation", "sdpa")
    extra.pop("vocab_size", None)
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        intermediate_size=arch.intermediate_size,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        **ids,
    )
    try:
        config = cls(**{**kwargs, **extra})
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
        except (ValueError, ImportError):
            if attn != "sdpa":
                raise
            model = AutoModelForCausalLM.from_config(config)  # architectures without SDPA support
    except (TypeError, ValueError, ImportError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RecipeError(
            f"model: cannot build a causal LM from {arch.config_class} ({msg}); fix the model section"
        ) from None
    model.generation_config = GenerationConfig(**ids)
    return model


def count_params(model: torch.nn.Module) -> int:
    """Parameters, tied weights counted once."""
    return sum(p.numel() for p in model.parameters())


def lr_at(step: int, progress: float, peak: float, warmup_steps: int) -> float:
    """Linear warm-up over `warmup_steps`, then cosine from `peak` to MIN_LR_RATIO * peak as `progress` goes 0 -> 1
    (progress = the larger of step / max_steps and elapsed / max_minutes)."""
    warm = min(1.0, (step + 1) / max(1, warmup_steps))
    cosine = MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return peak * warm * cosine


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token NLL (nats) over `windows`  # [n, seq_len]"""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size].to(model.device)  # [b, seq_len]
        logits = model(input_ids=batch).logits.float()  # [b, seq_len, vocab]
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total, count = total + nll.item(), count + batch[:, 1:].numel()
    model.train()
    return total / max(1, count)


# ---------------------------------------------------------------- output directory (atomic)


def _prepare_output(out: Path) -> Path:
    """Check `out` can be written and make the temporary dir the run is written into."""
    if out.exists() and not out.is_dir():
        raise RecipeError(f"output_dir: {out} is a file; choose a directory path for output_dir")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise RecipeError(
            f"output_dir: {out} exists and is not a draftsmith pretrain checkpoint; choose a new output_dir "
            "(a finished checkpoint there would be replaced)"
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        raise RecipeError(
            f"output_dir: cannot write {out} ({e.strerror or e}); choose a writable output_dir"
        ) from None


def _commit_output(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` into place, replacing an earlier checkpoint at `out` (old one aside first)."""
    replace_dir(tmp, out)


def save_checkpoint(model, tokenizer, directory: Path) -> None:
    """Safetensors weights, config, generation_config and tokenizer (AutoModelForCausalLM / AutoTokenizer load it)."""
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def verify_checkpoint(directory: Path, model, probe: torch.Tensor) -> float:
    """Reload `directory` and return the max |logit difference| to the in-memory `model` on `probe`  # [1, t]"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(directory)
    reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        diff = (reloaded(input_ids=probe).logits - model(input_ids=probe.to(model.device)).logits.float().cpu()).abs()
    model.train()
    if diff.max().item() > 1e-3:
        raise RuntimeError(f"the saved checkpoint in {directory} does not reproduce the trained model's logits")
    return diff.max().item()


# ---------------------------------------------------------------- the run


def pretrain(
    recipe: PretrainRecipe, progress: bool = True, mixed_precision: str | None = None, command: str | None = None
) -> Path:
    """Train the recipe's model from scratch and return the checkpoint dir (`recipe.output_dir`).

    mixed_precision: None follows accelerate (``accelerate launch --mixed_precision``); 'no' | 'bf16' | 'fp16'
    autocast the forward pass; 'auto' picks bf16 where it is fast. Collective under ``accelerate launch``: every
    process calls it; the main process writes the checkpoint. Raises RecipeError on bad input, before training.
    """
    from accelerate import Accelerator, PartialState
    from accelerate.utils import parse_flag_from_env, set_seed
    from tqdm.auto import tqdm

    # -- setup
    t_start = time.perf_counter()
    cfg = recipe.train
    command = command or shlex.join([Path(sys.executable).name, *sys.argv])
    out = Path(recipe.output_dir).expanduser()
    # The process group first (as Accelerator would: ACCELERATE_USE_CPU=1 makes N CPU processes one gloo group),
    # so that only the main process makes the output dir, which Accelerator's trackers need at construction.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    tmp = _prepare_output(out) if state.is_main_process else None
    try:
        log_with, init_kwargs = tracker_setup(recipe.log, tmp or out, state.is_main_process, final_dir=out)
        report_to = bool(log_with)
        accelerator = Accelerator(log_with=log_with or None, project_dir=str(tmp) if tmp else None)
        print_ = accelerator.print
        mixed_precision = resolve_mixed_precision(mixed_precision)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision or "no")
        autocast = torch.autocast(accelerator.device.type, dtype=dtype) if dtype else contextlib.nullcontext()
        set_seed(cfg.seed)

        # -- data: corpus, tokenizer, packed streams
        with accelerator.main_process_first():
            corpus = load_corpus(recipe.corpus)
            tokenizer = build_tokenizer(recipe.tokenizer, corpus)
            tok_source = f"tokenizer {recipe.tokenizer.path!r}" if recipe.tokenizer.path else "the trained tokenizer"
            vocab_size = resolve_vocab_size(recipe.model, tokenizer, tok_source)
            train_stream = pack(tokenizer, corpus.train)  # [n_train_tokens]
            held_stream = pack(tokenizer, corpus.heldout)  # [n_heldout_tokens]
        if len(train_stream) < cfg.seq_len:
            raise RecipeError(
                f"corpus.source: {len(train_stream)} training tokens, fewer than train.seq_len={cfg.seq_len}; "
                "add text or lower train.seq_len"
            )
        print_(corpus.describe())
        print_(
            f"tokenizer: {len(tokenizer)} tokens ({recipe.tokenizer.path or 'byte-level BPE trained on the corpus'}); "
            f"{len(train_stream) / 1e6:.2f}M training tokens, {len(held_stream) / 1e6:.2f}M held out "
            f"[{time.perf_counter() - t_start:.0f}s]"
        )

        # -- model
        model = build_model(recipe.model, vocab_size, tokenizer)
        n_params = count_params(model)
        print_(
            f"model: {recipe.model.config_class} {n_params / 1e6:.2f}M params, vocab {vocab_size}, "
            f"mixed precision {mixed_precision or accelerator.mixed_precision}"
        )

        # -- optimizer: no weight decay on norms and biases
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(0.9, 0.95),
        )
        chunks = PackedChunks(train_stream, cfg.seq_len)
        loader = torch.utils.data.DataLoader(
            chunks,
            batch_size=cfg.batch_size,
            shuffle=True,
            drop_last=len(chunks) >= cfg.batch_size,
            generator=torch.Generator().manual_seed(cfg.seed),
        )

        # -- prepare
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        if report_to:
            accelerator.init_trackers(recipe.log.project, config=to_dict(recipe), init_kwargs=init_kwargs)
        metrics_file = (tmp / "metrics.jsonl").open("w") if tmp else None

        # -- loop
        budget_s = cfg.max_minutes * 60
        world = accelerator.num_processes
        step, tokens, epoch, done = 0, 0, 0, False
        window_losses: list[float] = []
        window_t, window_tokens = time.perf_counter(), 0
        last: dict = {}
        bar = tqdm(
            total=cfg.max_steps,
            desc=f"pretrain {out.name}",
            disable=not (progress and accelerator.is_main_process),
            dynamic_ncols=True,
        )
        model.train()
        t0, cpu0 = time.perf_counter(), time.process_time()
        prog = 0.0
        while not done:
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            for batch in loader:  # [batch_size, seq_len]
                lr = lr_at(step, prog, cfg.lr, cfg.warmup_steps)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                with autocast:
                    loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                if cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                tokens += batch.numel() * world
                window_tokens += batch.numel() * world
                window_losses.append(loss.item())
                elapsed = time.perf_counter() - t0
                prog = max(step / cfg.max_steps, elapsed / budget_s if budget_s else 0.0)
                if world > 1:  # every process stops at the same step: the slowest clock decides
                    prog = accelerator.reduce(torch.tensor(prog, device=accelerator.device), "max").item()
                done = prog >= 1.0
                if step % recipe.log.every == 0 or done:
                    now = time.perf_counter()
                    last = {
                        "step": step,
                        "train/loss": sum(window_losses) / len(window_losses),
                        "train/lr": lr,
                        "train/tokens_per_s": window_tokens / max(1e-9, now - window_t),
                        "train/tokens": tokens,
                        "train/minutes": elapsed / 60,
                    }
                    window_losses, window_t, window_tokens = [], now, 0
                    if report_to:
                        accelerator.log({k: v for k, v in last.items() if k != "step"}, step=step)
                    if metrics_file:
                        metrics_file.write(json.dumps(last) + "\n")
                        metrics_file.flush()
                    bar.set_postfix(
                        loss=f"{last['train/loss']:.3f}", lr=f"{lr:.2e}", tok_s=f"{last['train/tokens_per_s']:.0f}"
                    )
                    if not progress:
                        print_(
                            f"step {step}: loss {last['train/loss']:.3f}, lr {lr:.2e}, "
                            f"{last['train/tokens_per_s']:.0f} tok/s, {elapsed / 60:.1f} min"
                        )
                if budget_s and 0 < prog < 1:  # the step count a time budget allows, re-estimated as we go
                    bar.total = max(step + 1, min(cfg.max_steps, round(step / prog)))
                bar.update(1)
                if done:
                    break
            epoch += 1
        bar.total = step
        bar.refresh()
        bar.close()
        train_s, train_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0

        # -- held-out loss and save (main process)
        if accelerator.is_main_process:
            unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
            windows = eval_windows(held_stream, cfg.seq_len, cfg.eval_windows)  # [n, seq_len]
            held = heldout_loss(unwrapped, windows)
            print_(f"held-out loss: {held:.3f} ({len(windows)} windows of {windows.size(1)} tokens)")
            if report_to:
                accelerator.log({"eval/heldout_loss": held}, step=step)
            metrics_file.write(json.dumps({"step": step, "eval/heldout_loss": held}) + "\n")
            metrics_file.close()
            save_checkpoint(unwrapped, tokenizer, tmp)
            (tmp / "resolved_recipe.yaml").write_text(dump_recipe(recipe))
            reload_diff = verify_checkpoint(tmp, unwrapped, windows[:1, :64])
            summary = {
                "params": n_params,
                "steps": step,
                "tokens_seen": tokens,
                "minutes": round(train_s / 60, 3),
                "cpu_minutes": round(train_cpu_s / 60, 3),  # all threads: > minutes when the cores were free
                "total_minutes": round((time.perf_counter() - t_start) / 60, 3),
                "tokens_per_s": round(tokens / train_s, 1),
                "final_loss": last.get("train/loss"),
                "heldout_loss": held,
                "heldout_eval": f"mean token NLL (nats) over {len(windows)} windows of {windows.size(1)} tokens "
                "spread evenly over the held-out documents",
                "mixed_precision": mixed_precision or accelerator.mixed_precision,
                "num_processes": world,
                "batch_size": cfg.batch_size,
                "seq_len": cfg.seq_len,
                "vocab_size": vocab_size,
                "corpus": {
                    "source": corpus.source,
                    "kind": corpus.kind,
                    "holdout_fraction": recipe.corpus.holdout_fraction,
                    "train_documents": len(corpus.train),
                    "heldout_documents": len(corpus.heldout),
                    "train_tokens": len(train_stream),
                    "heldout_tokens": len(held_stream),
                },
                "tokenizer": recipe.tokenizer.path
                or f"byte-level BPE ({len(tokenizer)} tokens) trained on the corpus",
                "reload_max_abs_logit_diff": reload_diff,
                "device": str(accelerator.device),
                "torch": torch.__version__,
                "command": command,
            }
            (tmp / MARKER).write_text(json.dumps(summary, indent=1) + "\n")
        for tracker in accelerator.trackers:  # not end_training(): that would end a caller's process group too
            tracker.finish()
        accelerator.wait_for_everyone()
        if tmp:
            _commit_output(tmp, out)
            print_(f"saved {out} ({n_params / 1e6:.2f}M params, {step} steps, {train_s / 60:.1f} min)")
    except BaseException:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------- the quickstart pair

# Variables a launcher sets for its workers: a build started from one of them must not join their process group.
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR")
_LAUNCHER_PREFIXES = ("MASTER_PORT", "ACCELERATE_", "TORCHELASTIC_")


def quickstart_cache_dir() -> Path:
    """``$DRAFTSMITH_CACHE/quickstart``, by default ``~/.cache/draftsmith/quickstart``."""
    return Path(os.environ.get("DRAFTSMITH_CACHE") or "~/.cache/draftsmith").expanduser() / "quickstart"


def checkout_file(path: Path) -> Path:
    """`path`, a file of the draftsmith source checkout (recipes/, train/), or one error naming the fix: a
    non-editable install (`pip install .`) ships the packages alone."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the quickstart pair is built from a draftsmith source checkout's recipes/ and "
            "train/, which a non-editable install (pip install .) lacks; install the checkout with: pip install -e ."
        )
    return path


def quickstart_recipes(cache_dir: Path | None = None) -> dict[str, tuple[Path, PretrainRecipe]]:
    """{"target": (yaml, recipe), "draft": (yaml, recipe)} with output dirs in the cache; the draft uses the
    target's tokenizer."""
    cache = Path(cache_dir).expanduser() if cache_dir else quickstart_cache_dir()
    out = {}
    for name in ("target", "draft"):
        path = checkout_file(RECIPES / f"quickstart-{name}.yaml")
        recipe = load_recipe(path, cls=PretrainRecipe)
        recipe.output_dir = str(cache / name)
        if name == "draft":
            recipe.tokenizer.path = str(cache / "target")
        out[name] = (path, recipe)
    return out


def _is_built(directory: Path, recipe: PretrainRecipe) -> str | None:
    """None when `directory` holds a finished build of `recipe`, else why it must be (re)built."""
    if not (directory / MARKER).is_file() or not (directory / "model.safetensors").is_file():
        return "missing"
    saved = directory / "resolved_recipe.yaml"
    if not saved.is_file() or saved.read_text() != dump_recipe(recipe):
        return "its recipe changed"
    return None


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """An exclusive file lock (POSIX), so concurrent callers build once and the others wait, then reuse."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        yield
        return
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _wait_stopping_on_signal(proc: subprocess.Popen, grace_s: float = 10.0) -> int:
    """Wait for `proc`; if we are stopped first (SIGTERM, SIGINT, any exception), stop it too.

    SIGTERM would otherwise end this process at once and leave the child training alone; while waiting it is
    turned into KeyboardInterrupt so that the child is terminated (then killed after `grace_s`) on the way out.
    """

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # Only where nobody else handles SIGTERM (train/distill.py installs its own, which also raises).
    own = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if own:
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return proc.wait()
    except BaseException:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    finally:
        if own:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _build_in_child(yaml_path: Path, recipe: PretrainRecipe, progress: bool) -> None:
    """Run train/pretrain.py in a fresh single process: isolated from a caller's accelerate state and process
    group (a caller under `accelerate launch` would otherwise pull the build into its DDP group)."""
    overrides = [f"output_dir={json.dumps(recipe.output_dir)}"]
    if recipe.tokenizer.path:
        overrides.append(f"tokenizer.path={json.dumps(recipe.tokenizer.path)}")
    cmd = [sys.executable, str(PRETRAIN_SCRIPT), "--recipe", str(yaml_path), *overrides, "--mixed-precision", "auto"]
    if not progress:
        cmd.append("--no-progress")
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV and not k.startswith(_LAUNCHER_PREFIXES)}
    rc = _wait_stopping_on_signal(subprocess.Popen(cmd, env=env))
    if rc != 0:
        message = f"building {recipe.output_dir} failed (exit status {rc}, error above); command: {shlex.join(cmd)}"
        raise (RecipeError if rc == 2 else RuntimeError)(message)


def ensure_quickstart_pair(
    rebuild: bool = False, cache_dir: Path | None = None, progress: bool = True
) -> tuple[Path, Path]:
    """(target_dir, draft_dir) of the offline quickstart pair, built from recipes/pretrain/quickstart-*.yaml where
    missing, stale (its recipe changed) or `rebuild`, and reused otherwise.

    The draft uses the target's tokenizer, so a rebuilt target rebuilds the draft. Each build runs
    train/pretrain.py in a child process and is atomic: an interrupted build is redone next time. A file lock
    serialises concurrent callers; under ``accelerate launch`` call it on the main process first (e.g. inside
    ``accelerator.main_process_first()``), so the other processes find the pair built.
    """
    checkout_file(PRETRAIN_SCRIPT)
    recipes = quickstart_recipes(cache_dir)
    target_dir, draft_dir = (Path(recipes[n][1].output_dir) for n in ("target", "draft"))
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target_dir.parent / ".lock"):
        for leftover in target_dir.parent.glob("*.tmp-*"):  # from a killed build; nobody else builds now
            shutil.rmtree(leftover, ignore_errors=True)
        why = "--rebuild" if rebuild else _is_built(target_dir, recipes["target"][1])
        for name in ("target", "draft"):
            yaml_path, recipe = recipes[name]
            if name == "draft":
                why = ("the target was rebuilt" if why else None) or _is_built(draft_dir, recipe)
            if why:
                print(f"quickstart {name}: building {recipe.output_dir} ({why})", flush=True)
                _build_in_child(yaml_path, recipe, progress)
    return target_dir, draft_dir
