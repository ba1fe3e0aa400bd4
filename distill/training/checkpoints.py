"""Checkpoints: atomic writes, resume from the newest complete one, keep the best by measured speedup.

A checkpoint directory is written under a temporary name and renamed when complete, so a run killed at any
moment leaves either a whole `checkpoints/step-N/` or nothing under that name. Temporary leftovers
(`.tmp-*`) are removed at the next start.

Selection never trusts one noisy timing: a later checkpoint replaces the incumbent best only when it is faster
beyond the noise, judged on the per-batch speedups both measured on the same prompts (see `beats`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decode.metrics import mean_ci95

STEP_RE = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class CheckpointInfo:
    """What selection needs to know about one evaluated checkpoint.

    `speedup_ci95` is the bench's 95% interval on `speedup` (None when the bench gave none: the interval is
    then the point value itself). `train_minutes` is the train.max_minutes clock at that step (0 at step 0;
    None in rows written before it was recorded), so the checkpoints form a curve against training time.
    `tau` is the mean accepted length (tokens per target pass; None in rows written before it was recorded).
    `per_batch` is the bench's `speedup_per_batch` (each batch's prompt ids and speedup; None when the bench or
    the row has none).
    """

    step: int
    speedup: float
    acceptance_rate: float
    loss: float | None
    speedup_ci95: tuple[float, float] | None = None
    train_minutes: float | None = None
    tau: float | None = None
    per_batch: dict[str, list] | None = None

    @property
    def interval(self) -> tuple[float, float]:
        """(lo, hi) of the speedup; (speedup, speedup) without a measured interval."""
        return tuple(self.speedup_ci95) if self.speedup_ci95 else (self.speedup, self.speedup)

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "speedup": self.speedup,
            "speedup_ci95": list(self.speedup_ci95) if self.speedup_ci95 else None,
            "acceptance_rate": self.acceptance_rate,
            "loss": self.loss,
            "train_minutes": self.train_minutes,
            "mean_accepted_length": self.tau,
            "speedup_per_batch": self.per_batch,
        }

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> CheckpointInfo:
        """Inverse of `as_dict` (rows written before intervals or training minutes were recorded have none)."""
        ci = row.get("speedup_ci95")
        return cls(
            row["step"],
            row["speedup"],
            row["acceptance_rate"],
            row.get("loss"),
            tuple(ci) if ci else None,
            row.get("train_minutes"),
            row.get("mean_accepted_length"),
            row.get("speedup_per_batch"),
        )

    @classmethod
    def from_eval(cls, step: int, result: dict[str, Any]) -> CheckpointInfo:
        """From a bench result (eval.json)."""
        return cls(
            step=step,
            speedup=float(result["speedup"]["vs_target"]),
            acceptance_rate=float(result["acceptance_rate"]),
            loss=result.get("train_loss"),
            speedup_ci95=speedup_ci95(result),
            train_minutes=result.get("train_minutes"),
            tau=result.get("mean_accepted_length"),
            per_batch=result.get("speedup_per_batch"),
        )


def speedup_ci95(result: dict[str, Any]) -> tuple[float, float] | None:
    """The bench's 95% interval on the speedup over target-only (`speedup.vs_target_ci95`), or None."""
    ci = result.get("speedup", {}).get("vs_target_ci95")
    if not ci or len(ci) != 2 or any(v is None or not math.isfinite(v) for v in ci):
        return None
    return (float(ci[0]), float(ci[1]))


# What torch's zip writer (torch.save: optimizer, scheduler, RNG state) raises when a write fails, by where it fails
# (a record, the end of the file); it carries no errno, so a full disk is told by the space left on the filesystem.
WRITER_FAILURES = (
    "inline_container.cc", "PytorchStreamWriter", "unexpected pos", "file write failed", "basic_ios::clear",
    "iostream error",
)  # fmt: skip
LOW_SPACE_BYTES = 16 * 2**20  # below this, a writer's failure is taken for a full disk


class DiskFullError(OSError):
    """Raised (one line) when a checkpoint cannot be written for lack of space; `path` is what was being written."""

    def __init__(self, code: int, message: str, path: Path | None = None) -> None:
        super().__init__(code, message)
        self.path = Path(path) if path is not None else None

    def __str__(self) -> str:
        return self.strerror  # the message alone: it becomes the run's `error:` line


def free_bytes(path: Path) -> int | None:
    """Bytes free (to this user) on the filesystem holding `path` (its nearest existing parent), or None."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def human_bytes(n: int | None) -> str:
    """1536 -> '1.5 KiB'; None -> 'unknown'."""
    if n is None:
        return "unknown"
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def disk_error_message(err: OSError, what: Path) -> str:
    """One-line description of a write failure, naming the fix for the common cases (and, for a full disk, the
    space now free on that filesystem: the partial write is gone by the time this is read)."""
    if err.errno == errno.ENOSPC:
        return (
            f"no space left on device while writing {what} ({human_bytes(free_bytes(what))} free on its filesystem): "
            "free disk space or set output_dir elsewhere, then rerun with --resume"
        )
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {what} ({os.strerror(err.errno)}): choose a writable output_dir"
    return f"cannot write {what}: {err.strerror or err}"


def low_on_space(path: Path) -> bool:
    """Whether the filesystem holding `path` is (nearly) full. Read it before removing a failed write's partial
    files, which free the space again."""
    free = free_bytes(path)
    return free is not None and free < LOW_SPACE_BYTES


def as_disk_error(err: BaseException, what: Path, full: bool | None = None) -> DiskFullError | None:
    """The one-line DiskFullError for a failed write, or None when `err` is not about the disk.

    Writers outside Python's io raise their own types: safetensors' Rust serializer reports the OS error text,
    torch's zip writer only a position mismatch, which a full disk confirms as one (`full`: `low_on_space` read
    when the write failed; read now when not given). A DiskFullError passes through: it names its own path.
    """
    if isinstance(err, DiskFullError):
        return err
    if isinstance(err, OSError) and err.errno is not None:
        return DiskFullError(err.errno, disk_error_message(err, what), what)
    text = str(err)
    if "No space left" in text or "os error 28" in text:
        return DiskFullError(errno.ENOSPC, disk_error_message(OSError(errno.ENOSPC, "no space"), what), what)
    if any(marker in text for marker in WRITER_FAILURES):
        if full if full is not None else low_on_space(what):
            return DiskFullError(errno.ENOSPC, disk_error_message(OSError(errno.ENOSPC, "no space"), what), what)
        line = text.strip().splitlines()[0]
        message = f"cannot write {what} ({line}; {human_bytes(free_bytes(what))} free on its filesystem)"
        return DiskFullError(errno.EIO, message, what)
    return None


class _TiedWeightsNote(logging.Filter):
    """Drops accelerate's "Removed shared tensor {...} while saving" note: a draft with tied input and output
    embeddings (lm_head.weight is embed_tokens.weight) is saved with the tie in its config, and loads back tied."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor" not in record.getMessage()  # accelerate prefixes "[RANK n] "


@contextlib.contextmanager
def tied_weights_quiet() -> Iterator[None]:
    """Around accelerate's save_state: only the shared-tensor note is dropped, every other warning stays."""
    logger = logging.getLogger("accelerate.utils.other")  # where accelerate logs the note
    note = _TiedWeightsNote()
    logger.addFilter(note)
    try:
        yield
    finally:
        logger.removeFilter(note)


@contextlib.contextmanager
def atomic_dir(final: Path, tmp_name: str | None = None) -> Iterator[Path]:
    """Yield a temporary sibling directory; rename it to `final` when the block succeeds.

    On any error the temporary directory is removed and nothing appears under `final`. An existing `final`
    is replaced only after the new one is complete. `tmp_name` lets several processes write into the same
    temporary directory (accelerate's save_state writes one shard per rank); only the caller that owns the
    rename should use this context manager in that case.
    """
    final = Path(final)
    tmp = final.parent / (tmp_name or f"{TMP_PREFIX}{final.name}-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        replace_dir(tmp, final)
    except BaseException as err:
        full = low_on_space(tmp)  # before the partial files go
        shutil.rmtree(tmp, ignore_errors=True)
        disk = as_disk_error(err, final, full)
        if disk is not None and disk.errno == errno.ENOSPC:
            raise disk from None
        raise


def replace_dir(src: Path, dst: Path) -> None:
    """Move the complete directory `src` to `dst`, replacing an existing `dst`.

    Two renames, never a delete first: the old `dst` is renamed aside, `src` renamed in, and only then the old
    one deleted. At every moment `dst` is either the whole old or the whole new directory, except between the
    two renames, where the old one is still complete under its `.tmp-old-*` name.
    """
    src, dst = Path(src), Path(dst)
    old = None
    if dst.exists():
        old = dst.parent / f"{TMP_PREFIX}old-{dst.name}-{os.getpid()}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(dst, old)
    os.replace(src, dst)
    fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def recover_replace(dst: Path) -> bool:
    """Undo a `replace_dir` killed between its two renames: put the old `dst` (complete, set aside) back.
    Call before `clean_temporaries`, which would delete it. True when something was put back."""
    dst = Path(dst)
    aside = sorted(dst.parent.glob(f"{TMP_PREFIX}old-{dst.name}-*")) if dst.parent.is_dir() else []
    if dst.exists() or not aside:
        return False
    os.replace(aside[-1], dst)
    return True


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (a crash after os.replace may otherwise lose it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # platforms that cannot open a directory (Windows) do not need this
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename itself has happened
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON through a temp file + fsync + rename (+ fsync of the directory): readers never see half a
    file, and a power loss never leaves an empty one under the final name."""
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def update_json_atomic(path: Path, change: Callable[[dict], None]) -> bool:
    """Apply ``change`` to the JSON object in ``path`` and write it back whole (:func:`write_json_atomic`): what
    the run adds to report.json once it is written. False (nothing written) where ``path`` is not there."""
    path = Path(path)
    if not path.is_file():
        return False
    obj = json.loads(path.read_text())
    change(obj)
    write_json_atomic(path, obj)
    return True


def write_text_atomic(path: Path, text: str) -> None:
    """`path` holds `text` or, when the write fails (a DiskFullError naming `path`), what it held before."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise DiskFullError(err.errno, disk_error_message(err, path), path) from None


def clean_temporaries(directory: Path) -> list[Path]:
    """Remove leftovers of interrupted writes (`.tmp-*`) in `directory`; return what was removed."""
    removed = []
    if Path(directory).is_dir():
        for child in Path(directory).iterdir():
            if child.name.startswith(TMP_PREFIX):
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
                removed.append(child)
    return removed


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `ckpt_root` as (step, path), oldest first."""
    found = []
    if Path(ckpt_root).is_dir():
        for child in Path(ckpt_root).iterdir():
            match = STEP_RE.match(child.name)
            if match and child.is_dir():
                found.append((int(match.group(1)), child))
    return sorted(found)


def newest_checkpoint(ckpt_root: Path, require: str = "state") -> tuple[int, Path] | None:
    """The newest complete checkpoint that holds `require` (the resumable training state), or None."""
    for step, path in reversed(list_checkpoints(ckpt_root)):
        if (path / require).exists():
            return step, path
    return None


def rank_key(info: CheckpointInfo) -> tuple[float, float, int]:
    """Order for keeping the top-k: measured speedup, then tau (the acceptance rate where tau is missing), then the
    later step. Never the loss."""
    return (info.speedup, info.tau if info.tau is not None else info.acceptance_rate, info.step)


def tokens_per_pass(challenger: CheckpointInfo, incumbent: CheckpointInfo) -> tuple[float, float]:
    """The timing-free figure two checkpoints are compared by: tau when both have it, else the acceptance rate.

    At a fixed gamma the two order checkpoints alike (tau = 1 + gamma x acceptance, but for the last rounds);
    with `num_draft_tokens: auto` only tau does: a draft that is sure more often drafts longer and accepts a
    smaller share of more tokens."""
    if challenger.tau is not None and incumbent.tau is not None:
        return challenger.tau, incumbent.tau
    return challenger.acceptance_rate, incumbent.acceptance_rate


def paired_ratio_ci95(challenger: CheckpointInfo, incumbent: CheckpointInfo) -> tuple[float, float] | None:
    """95% interval on how much faster `challenger` is than `incumbent` on the same prompts (1.0: alike).

    The statistic is the mean over batches of log(challenger's speedup / incumbent's) on each batch, bootstrapped
    over batches and reported as a ratio: a prompt's own difficulty is in both speedups and cancels. None unless
    both carry per-batch figures on the same prompts, batch for batch (pairing different prompts would compare
    the prompts), and there are two batches or more.
    """
    if not challenger.per_batch or not incumbent.per_batch:
        return None
    if challenger.per_batch["prompt_ids"] != incumbent.per_batch["prompt_ids"]:
        return None
    logs = [
        math.log(mine / theirs)
        for mine, theirs in zip(challenger.per_batch["vs_target"], incumbent.per_batch["vs_target"])
        if mine and theirs and mine > 0 and theirs > 0
    ]
    ci = mean_ci95(logs)
    return (math.exp(ci[0]), math.exp(ci[1])) if ci else None


def beats(challenger: CheckpointInfo, incumbent: CheckpointInfo) -> bool:
    """Whether `challenger` should replace `incumbent` as the best checkpoint.

    Where both carry per-batch speedups on the same prompts, by the paired interval (`paired_ratio_ci95`):
    - clearly faster (the interval above 1): yes; clearly slower (below 1): no.
    Otherwise (rows without them, other prompts, one batch) by each one's own interval, whose spread is timing
    noise alone with one batch (its repeats) and holds the prompt spread as well with several:
    - clearly faster (its interval's lower bound above the incumbent's speedup): yes;
    - clearly slower (the incumbent's lower bound above its speedup): no.
    Within the noise, the more tokens per target pass win (tau, else the acceptance rate: properties of the
    tokens, free of timing noise), and on a tie the later step. Without any interval (lo = hi = speedup) this
    is: higher speedup, then tau (else acceptance), then the later step.
    """
    paired = paired_ratio_ci95(challenger, incumbent)
    if paired is not None:
        if paired[0] > 1.0:
            return True
        if paired[1] < 1.0:
            return False
    elif challenger.interval[0] > incumbent.speedup:
        return True
    elif incumbent.interval[0] > challenger.speedup:
        return False
    mine, theirs = tokens_per_pass(challenger, incumbent)
    if mine != theirs:
        return mine > theirs
    return challenger.step > incumbent.step


def clearly_slower(a: CheckpointInfo, b: CheckpointInfo) -> bool:
    """Whether `a` is slower than `b` beyond the timing noise: the paired interval on a / b below 1 where both
    carry per-batch speedups on the same prompts, else `b`'s lower bound above `a`'s speedup."""
    paired = paired_ratio_ci95(a, b)
    return paired[1] < 1.0 if paired is not None else b.interval[0] > a.speedup


def select_best(infos: list[CheckpointInfo]) -> CheckpointInfo:
    """The best checkpoint by measured speedup beyond the timing noise. Never by the loss.

    A checkpoint slower than any other beyond the noise is out; among the rest, walking in step order, each
    replaces the incumbent only when it `beats` it. (A walk alone can end on a checkpoint slower than an early
    one: ties by tau passed on through a noisy middle checkpoint.)"""
    if not infos:
        raise ValueError("no evaluated checkpoints to select from")
    ordered = sorted(infos, key=lambda info: info.step)
    contenders = [i for i in ordered if not any(clearly_slower(i, o) for o in ordered if o is not i)] or ordered
    best = contenders[0]
    for info in contenders[1:]:
        if beats(info, best):
            best = info
    return best


def versus(a: CheckpointInfo, b: CheckpointInfo) -> str:
    """How `a` compares with `b` in words: "faster", "slower" or "inside the noise", with the figure that says so
    (the paired interval where both carry per-batch speedups on the same prompts, else both own intervals)."""
    paired = paired_ratio_ci95(a, b)
    if paired is not None:
        verdict = "faster" if paired[0] > 1.0 else "slower" if paired[1] < 1.0 else "inside the noise"
        return f"{verdict} (paired 95% interval on the ratio [{paired[0]:.2f}, {paired[1]:.2f}])"
    if a.interval[0] > b.speedup:
        return f"faster ({a.speedup:.2f}x [{a.interval[0]:.2f}, {a.interval[1]:.2f}] against {b.speedup:.2f}x)"
    if b.interval[0] > a.speedup:
        return f"slower ({a.speedup:.2f}x against {b.speedup:.2f}x [{b.interval[0]:.2f}, {b.interval[1]:.2f}])"
    return (
        f"inside the noise ({a.speedup:.2f}x [{a.interval[0]:.2f}, {a.interval[1]:.2f}] against "
        f"{b.speedup:.2f}x [{b.interval[0]:.2f}, {b.interval[1]:.2f}])"
    )


def selection_note(infos: list[CheckpointInfo], base: CheckpointInfo | None = None) -> list[str]:
    """In words, what the measurement could tell apart and what decided best/ (printed under the end table and kept
    in report.json as `selection`): whether best/ beat the base draft and the fastest-measured other checkpoint
    beyond the timing noise, and, where it did not, that tau (tokens per target pass) or the later step decided."""
    best = select_best(infos)
    lines = []
    others = [i for i in infos if i.step != best.step]
    if others:
        fastest = max(others, key=lambda i: i.speedup)
        verdict = versus(best, fastest)
        if verdict.startswith("faster"):
            lines.append(f"best/ (step {best.step}) is {verdict} than the next fastest, step {fastest.step}.")
        else:
            mine, theirs = tokens_per_pass(best, fastest)
            decided = (
                f"the more tokens per target pass decided ({mine:.2f} against {theirs:.2f})"
                if mine != theirs
                else "the later step decided"
            )
            lines.append(
                f"best/ (step {best.step}) against step {fastest.step}, the fastest other checkpoint: {verdict}; "
                f"the measurement could not separate them, so {decided}."
            )
    if base is not None and base.step != best.step:
        verdict = versus(best, base)
        if not verdict.startswith("faster"):
            lines.append(
                f"Against the base draft, best/ is {verdict}: the training's gain is not shown beyond the timing "
                "noise (more eval prompts or eval.repeats narrow it)."
            )
    return lines


def steps_to_keep(infos: list[CheckpointInfo], keep_top_k: int, newest_step: int | None) -> set[int]:
    """Steps whose directories stay: the selected best, the top-k by measured speedup, and the newest (needed
    to resume)."""
    ranked = sorted(infos, key=rank_key, reverse=True)[:keep_top_k]
    keep = {info.step for info in ranked}
    if infos:
        keep.add(select_best(infos).step)
    if newest_step is not None:
        keep.add(newest_step)
    return keep


def prune_checkpoints(ckpt_root: Path, keep: set[int]) -> list[int]:
    """Delete checkpoint directories whose step is not in `keep`; return the deleted steps."""
    deleted = []
    for step, path in list_checkpoints(ckpt_root):
        if step not in keep:
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(step)
    return deleted


def load_infos(ckpt_root: Path) -> list[CheckpointInfo]:
    """Read every complete checkpoint's eval.json back (for resume and report.json)."""
    infos = []
    for step, path in list_checkpoints(ckpt_root):
        eval_file = path / "eval.json"
        if eval_file.is_file():
            infos.append(CheckpointInfo.from_eval(step, json.loads(eval_file.read_text())))
    return infos
