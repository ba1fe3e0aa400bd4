"""Hugging Face Hub access for publishing: offline mode, the login check, the upload.

Nothing here builds a folder (see distill.publishing.publish); every failure is a one-line `PublishError`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

OFFLINE_MSG = "the Hub is offline (HF_HUB_OFFLINE=1): unset it to upload, or pass --dry-run DIR to write the folder"
_HUB_NAME_RE = re.compile(r"[\w.-]+(/[\w.-]+)?")


class PublishError(RuntimeError):
    """Publishing cannot go on; the message is one line that names the fix."""


def hub_offline() -> bool:
    """True when the Hub must not be contacted: HF_HUB_OFFLINE as huggingface_hub read it at import, or as the
    environment says now (a test or a caller may set it after the import)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return env or bool(constants.HF_HUB_OFFLINE)


def is_hub_id(name: str | None) -> bool:
    """A Hub id (`org/name` or a legacy bare name) rather than a local path."""
    if not name or Path(name).expanduser().exists() or name.startswith((".", "~", "/")):
        return False
    return _HUB_NAME_RE.fullmatch(name) is not None


def first_line(e: BaseException) -> str:
    """An exception's first message line (its type name when it has no message)."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


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
        raise PublishError(f"cannot reach the Hub: {first_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - transport errors (httpx / requests, by hub version): one line
        raise PublishError(f"cannot reach the Hub: {first_line(e)}") from None


def upload_folder(
    folder: str | Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload `folder` to the model repo `repo_id` (created if needed; `revision` is a branch, created if needed).

    The caller checks access first (`check_hub_access`). Returns the repo URL (with /tree/REV for a branch).
    """
    from huggingface_hub import HfApi

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
    except Exception as e:  # noqa: BLE001 - HTTP and transport errors (httpx / requests, by hub version): one line
        raise PublishError(f"upload to {repo_id} failed: {first_line(e)}") from None
    url = str(url).rstrip("/")
    return f"{url}/tree/{revision}" if revision else url
