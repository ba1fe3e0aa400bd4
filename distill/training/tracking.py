"""Experiment trackers for train/distill.py and train/pretrain.py: W&B (offline without a login), TensorBoard."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from distill.config import LogConfig, RecipeError


def wandb_has_credentials() -> bool:
    """True when W&B can log online: an API key in the environment or a saved login (~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def tracker_setup(
    log: LogConfig, output_dir: Path, is_main: bool, final_dir: Path | None = None, run_id: str | None = None
) -> tuple[list[str], dict[str, Any]]:
    """accelerate's `log_with` and `init_kwargs` for the recipe's tracker, W&B files under `output_dir`.

    `final_dir` is where `output_dir` ends up when it is a temporary directory renamed at the end (the
    name shown to the user). `run_id` (distill.training.run_state.prepare_output_dir's) is the W&B run's id, with
    `resume="allow"`: a resumed run logs into the run it continues. Raises RecipeError when the tracker is not
    installed (accelerate would drop it silently). With no W&B login, `wandb.init` raises instead of falling
    back; we switch to offline mode ourselves and say once how to upload the run later.
    """
    if log.report_to == "none":
        return [], {}
    module = {"wandb": "wandb", "tensorboard": "tensorboard"}[log.report_to]
    if importlib.util.find_spec(module) is None:
        raise RecipeError(f"log.report_to: {module} is not installed; pip install {module} or set log.report_to=none")
    if log.report_to == "tensorboard":
        return ["tensorboard"], {}
    shown = Path(final_dir or output_dir)
    if not os.environ.get("WANDB_MODE") and not wandb_has_credentials():
        os.environ["WANDB_MODE"] = "offline"
        if is_main:
            print(f"W&B: no login found, logging offline; upload later with `wandb sync {shown}/wandb/offline-run-*`")
    os.environ.setdefault("WANDB_DIR", str(output_dir))
    os.environ.setdefault("WANDB_SILENT", "true")
    init = {"name": log.run_name or shown.name, "dir": str(output_dir)}
    if log.group:
        init["group"] = log.group
    if run_id:
        init.update(id=run_id, resume="allow")
    return ["wandb"], {"wandb": init}
