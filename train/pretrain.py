"""Train a causal LM from scratch on a local corpus: draft pretraining, and the offline quickstart pair.

    python train/pretrain.py --recipe recipes/pretrain/quickstart-target.yaml
    python train/pretrain.py --recipe recipes/pretrain/quickstart-draft.yaml train.max_minutes=1 output_dir=runs/d
    accelerate launch --config_file recipes/accelerate/cpu.yaml train/pretrain.py --recipe R.yaml
    python train/pretrain.py --recipe R.yaml --print-config        # the resolved recipe, then exit

The recipe (distill/config.py: PretrainRecipe) names the architecture (any transformers config class), the corpus
(python-stdlib, a folder, a glob, a JSONL file or a datasets dataset), the tokenizer (an existing one, or a
byte-level BPE trained on the corpus) and the schedule. `key.sub=value` arguments override recipe keys.
The checkpoint in output_dir is a plain HF model dir (safetensors, config, generation_config, tokenizer) plus
resolved_recipe.yaml, metrics.jsonl and TRAINING.json (params, steps, tokens, minutes, held-out loss, command).
Bad input (missing corpus, recipe typo, unwritable output_dir, tokenizer larger than the vocab) prints one
`error: ...` line and exits with status 2, leaving no output behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

# The repo root first: train/distill.py would otherwise shadow the `distill` package (sys.path[0] is train/).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # we tokenize in the main process only, before any fork


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", help="YAML recipe (default: the built-in PretrainRecipe defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. train.lr=1e-3 output_dir=runs/x")
    parser.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    parser.add_argument(
        "--mixed-precision",
        choices=["auto", "no", "bf16", "fp16"],
        default=None,
        help="autocast the forward pass (auto: bf16 where the hardware has fast bf16); default: accelerate's setting",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs still print)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # `kill` (SIGTERM) unwinds like Ctrl-C, so the temporary output dir is removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from distill.config import PretrainRecipe, RecipeError, dump_recipe, load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides, cls=PretrainRecipe)
        if args.print_config:
            print(dump_recipe(recipe), end="")
            return 0
        from distill.training.pretraining import pretrain

        pretrain(recipe, progress=not args.no_progress, mixed_precision=args.mixed_precision)
    except (RecipeError, ValueError, FileNotFoundError, OSError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; nothing was saved", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
