"""Publish a distilled draft to the Hugging Face Hub, with a model card that states its measured speedup.

    # a run directory (uses best/, report.json, resolved_recipe.yaml) or one checkpoint (its eval.json)
    python train/publish.py runs/gemma2-9b-it_gemma2-2b-it --repo-id USER/gemma-2-2b-it-draft-for-9b-it
    python train/publish.py runs/x/checkpoints/step-400 --repo-id USER/NAME --private --revision v1
    # write exactly what would be uploaded, upload nothing
    python train/publish.py runs/quickstart --repo-id USER/quickstart-draft --dry-run out/quickstart-draft
    # a QLoRA run: the merged draft is re-measured before the upload; --no-remeasure keeps the 4-bit figures
    python train/publish.py runs/x --repo-id USER/NAME --license apache-2.0 --no-remeasure
    # with the draft as GGUF for llama.cpp (draft-f16.gguf; --gguf f32,q8_0 for others)
    python train/publish.py runs/x --repo-id USER/NAME --gguf

The folder (docs/publish.md): merged safetensors with the target's vocab_size, the target's tokenizer files,
generation_config.json with the best measured num_assistant_tokens, README.md (model card with the figures
of every engine that measured the draft, in model-index too, hardware, prompts, recipe and HF / vLLM / SGLang
usage), draftsmith_eval.json and resolved_recipe.yaml, with --gguf draft-<type>.gguf for llama.cpp; local paths
appear only as base names. Uploads use HF_TOKEN or a saved `hf auth login`. Python shipped with a model (`auto_map`)
runs only with --trust-remote-code. Errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

# The repo root first: run as a script, this folder (which holds train/distill.py) would shadow the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="run directory (train/distill.py output_dir) or a checkpoint directory")
    p.add_argument("--repo-id", required=True, help="USER/NAME on the Hub (also used in the card's snippets)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", default=None, help="branch to push to (created if missing); default main")
    p.add_argument("--dry-run", metavar="OUT_DIR", default=None, help="write the folder here, upload nothing")
    p.add_argument("--commit-message", default=None, help="commit message on the Hub")
    p.add_argument("--license", default=None, help="license id for the card (default: the base draft's)")
    p.add_argument(
        "--verifier",
        default=None,
        help="EAGLE-3 head: the target (Hub id or path) its config.json names, so that `vllm serve REPO` needs no "
        "speculative flags (default: the recipe's target.model when it is a Hub id; a local one names none)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the Python the folder or its target ships (auto_map in config.json) when loading them; without "
        "it such a model is refused, whatever the run's recipe says",
    )
    p.add_argument(
        "--no-remeasure",
        action="store_true",
        help="QLoRA: publish the training-time (4-bit) figures with a note instead of re-measuring the merged draft",
    )
    p.add_argument(
        "--gguf",
        nargs="?",
        const="f16",
        default=None,
        metavar="TYPES",
        help="also write the draft as draft-<type>.gguf for llama.cpp (llama-server -md, its kind's --spec-type): "
        "f16 when given bare, or f32, f16, bf16, q8_0 (comma-separated for several); the card gets the llama-server "
        "line. Needs llama.cpp's converter and the target's HF folder or Hub id",
    )
    p.add_argument(
        "--llama-cpp",
        metavar="DIR",
        default=None,
        help="llama.cpp checkout or build folder for --gguf (default: $DRAFTSMITH_LLAMA_CPP, draftsmith's cache, "
        "PATH)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # imported once the arguments parse: it loads torch and transformers (seconds), which --help does not need
    from decode.llamacpp.export import parse_types
    from distill.publishing.publish import PublishError, publish

    handler = logging.StreamHandler()  # the library's warnings, one line each
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    logging.getLogger("draftsmith.publish").addHandler(handler)
    try:
        gguf = parse_types(args.gguf)
    except ValueError as e:
        print(f"error: --gguf: {e}", file=sys.stderr)
        return 2
    try:
        where = publish(
            args.source,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            dry_run_dir=args.dry_run,
            commit_message=args.commit_message,
            remeasure=not args.no_remeasure,
            license=args.license,
            verifier=args.verifier,
            trust_remote_code=args.trust_remote_code,
            gguf=gguf,
            llama_cpp=args.llama_cpp,
        )
    except PublishError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"dry run: wrote {where} (nothing uploaded)" if args.dry_run else f"published: {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
