"""Publish a distilled draft to the Hugging Face Hub, with a model card that states its measured speedup.

    # a run directory (uses best/, report.json, resolved_recipe.yaml) or one checkpoint (its eval.json)
    python train/publish.py runs/gemma2-9b-it_gemma2-2b-it --repo-id USER/gemma-2-2b-it-draft-for-9b-it
    python train/publish.py runs/x/checkpoints/step-400 --repo-id USER/NAME --private --revision v1
    # write exactly what would be uploaded, upload nothing
    python train/publish.py runs/quickstart --repo-id USER/quickstart-draft --dry-run out/quickstart-draft
    # a QLoRA run: the merged draft is re-measured before the upload; --no-remeasure keeps the 4-bit figures
    python train/publish.py runs/x --repo-id USER/NAME --license apache-2.0 --no-remeasure

The folder (docs/publish.md): merged safetensors with the target's vocab_size, the target's tokenizer files,
generation_config.json with the best measured num_assistant_tokens, README.md (model card with the figures
of every engine that measured the draft, in model-index too, hardware, prompts, recipe and HF / vLLM / SGLang
usage), draftsmith_eval.json and resolved_recipe.yaml; local paths appear only as base names. Uploads use
HF_TOKEN or a saved `hf auth login`. Python shipped with a model (`auto_map`) runs only with --trust-remote-code.
Errors print one line and exit 2.
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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # imported once the arguments parse: it loads torch and transformers (seconds), which --help does not need
    from distill.publishing.publish import PublishError, publish

    handler = logging.StreamHandler()  # the library's warnings, one line each
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    logging.getLogger("draftsmith.publish").addHandler(handler)
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
        )
    except PublishError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"dry run: wrote {where} (nothing uploaded)" if args.dry_run else f"published: {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
