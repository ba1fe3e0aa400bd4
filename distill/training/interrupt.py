"""Ctrl-C and SIGTERM during training: finish the step, save its resume state, stop (train/distill.py).

    interrupt.install()                        # main(): SIGINT and SIGTERM handlers
    interrupt.arm(accelerator, state, lambda: step, save)  # from here an interrupt saves a resume state
    interrupt.check()                          # at each step's start: every process stops at the same step
    result = interrupt.evaluation(state, loss, evaluate)  # an evaluation is cut short at once (None)
    interrupt.finish()                         # the loop is over: stop as check() does, else disarm
    fail(interrupt.stopped(err))               # main()'s `except KeyboardInterrupt`: save, say what was saved

Outside the armed part (loading, generating the continuations, the run's end) a signal raises KeyboardInterrupt
at once, as Ctrl-C does in any Python program: nothing trained is lost there. Inside it the first signal is noted
and the run stops at the next step's start, where the processes agree (one all-reduce) and save, together, the
state of the step they all completed: accelerate's `save_state` (and a sharded draft's gather) is collective and
safe only when every process makes it at the same point, never from wherever a signal happened to land.

An evaluation is the exception: it changes no training state, so it is cut short at once, and the checkpoint it
was to write becomes a resume-only one whose trainer_state.json says its evaluation is still due: --resume
measures that step first, and nothing measured before is measured again.

A signal within REPEAT_S of the first is the same stop (launchers pass a Ctrl-C on to processes that the
terminal signalled already); a later one stops at once and saves nothing more.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REPEAT_S = 3.0


class StopRequested(KeyboardInterrupt):
    """Raised by `check` on every process at the same step: the state of that step can be saved collectively."""


@dataclass
class _Armed:
    accelerator: Any
    state: Any  # distill.training.run_state.RunState
    step: Callable[[], int]  # the optimizer steps completed so far
    save: Callable[[int], None]  # the resume-only checkpoint of a step (collective: every process calls it)


@dataclass
class _Stop:
    armed: _Armed | None = None
    requested_s: float | None = None  # time.monotonic() of the first signal while armed
    evaluating: bool = False  # inside an evaluation: the first signal raises at once
    aborted: bool = False  # a later signal stopped the run at once: nothing more is saved


_STOP = _Stop()


def install() -> None:
    """SIGINT and SIGTERM (a scheduler's or `kill`'s stop) go through `_on_signal`; forgets an earlier run's
    stop. Where it cannot (not the main thread) Python's own Ctrl-C handling stays."""
    global _STOP
    _STOP = _Stop()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_signal)
        signal.signal(signal.SIGTERM, _on_signal)


def arm(accelerator: Any, state: Any, step: Callable[[], int], save: Callable[[int], None]) -> None:
    """From here an interrupt stops the run at a step's start and saves that step's state with `save(step)`."""
    _STOP.armed = _Armed(accelerator, state, step, save)


def disarm() -> None:
    """A signal raises KeyboardInterrupt at once again; a pending stop is dropped."""
    _STOP.armed, _STOP.requested_s, _STOP.evaluating = None, None, False


def finish() -> None:
    """After the training loop (every process): stop as `check` does when interrupted (in the last step or its
    evaluation: the report is left to --resume), else disarm."""
    check()
    disarm()


def _on_signal(signum: int, frame: object) -> None:
    stop, now = _STOP, time.monotonic()
    if stop.armed is None:
        raise KeyboardInterrupt(f"signal {signum}")
    if stop.requested_s is None:
        stop.requested_s = now
        if not stop.evaluating:
            _note(
                f"interrupted (signal {signum}): stopping after this step to save its resume state; interrupt again "
                f"after {REPEAT_S:.0f} s to stop at once without it"
            )
    elif now - stop.requested_s >= REPEAT_S:
        stop.aborted = True
        raise KeyboardInterrupt(f"signal {signum} again")
    if stop.evaluating:
        stop.evaluating = False  # once: the evaluation's own clean-up must not be interrupted in turn
        raise KeyboardInterrupt(f"signal {signum}")


def _note(line: str) -> None:
    """One line on stderr from a signal handler (os.write: print may not be re-entered), main process only."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"\n{line}\n".encode())


def any_process(accelerator: Any, flag: bool) -> bool:
    """True on every process when `flag` is true on any (collective with several processes)."""
    if accelerator.num_processes == 1:
        return flag
    import torch

    value = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(value, reduction="sum") > 0)


def check() -> None:
    """At a step's start (every process): raise StopRequested on all of them when any was interrupted."""
    armed = _STOP.armed
    if armed is not None and any_process(armed.accelerator, _STOP.requested_s is not None):
        raise StopRequested("interrupted")


def evaluation(state: Any, loss: float | None, evaluate: Callable[[], dict]) -> dict | None:
    """`evaluate()` (the main process's evaluation of a checkpoint), cut short by an interrupt: then, or when a stop
    is pending already, None, and `state.pending_eval` records the evaluation (with the step's `loss`) so that the
    checkpoint is saved as a resume-only one that --resume evaluates first."""
    stop = _STOP
    if stop.armed is None:
        return evaluate()
    if stop.requested_s is None:
        stop.evaluating = True
        try:
            return evaluate()
        except KeyboardInterrupt:
            if stop.aborted:
                raise
            stop.requested_s = stop.requested_s or time.monotonic()  # a KeyboardInterrupt of its own making
        finally:
            stop.evaluating = False
    state.pending_eval = {"loss": loss}
    return None


def stopped(err: BaseException) -> str:
    """The `error:` line of an interrupted run, after saving the resume state of the step it stopped at (every
    process calls it: the save is collective). Only a StopRequested (every process at the same step's start)
    is saved; an interrupt anywhere else (before training, a second signal, after the last step) names the
    checkpoint --resume continues from instead."""
    armed, stop = _STOP.armed, _STOP
    if armed is None:
        return "interrupted; resume with --resume"
    try:
        step = armed.step()
        if stop.aborted:
            return f"interrupted again before step {step + 1} ended: nothing more saved; {_continues(armed)}"
        if not isinstance(err, StopRequested):  # not a signal: raised by code the run called (on_step)
            return f"interrupted in step {step + 1}: nothing more saved; {_continues(armed)}"
        try:
            return _save(armed, step)
        except KeyboardInterrupt:  # a signal REPEAT_S after the first: the state is not saved
            return f"interrupted again while saving step {step}: nothing more saved; {_continues(armed)}"
    finally:
        disarm()


def _save(armed: _Armed, step: int) -> str:
    from distill.training.checkpoints import newest_checkpoint

    root = armed.state.ckpt_root
    newest = newest_checkpoint(root) if armed.accelerator.is_main_process else None
    have = any_process(armed.accelerator, newest is not None and newest[0] == step)  # the main process decides
    where = f"{root.name}/step-{step}"
    if have:
        due = " (its evaluation was cut short: --resume runs it first)" if _pending(root / f"step-{step}") else ""
        return f"interrupted at step {step}; its resume state is {where}{due}; resume with --resume"
    if step == 0:
        return "interrupted before the first step: nothing trained to save; resume with --resume"
    try:
        armed.save(step)
    except Exception as err:  # a full disk, a failed write: the older checkpoints are still there
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"interrupted at step {step}; saving its resume state failed ({why}); {_continues(armed)}"
    return (
        f"interrupted at step {step}; saved a resume state ({where}: weights, optimizer, scheduler, data "
        "position, RNG); resume with --resume"
    )


def _pending(checkpoint: Any) -> bool:
    import json

    try:
        return json.loads((checkpoint / "trainer_state.json").read_text()).get("pending_eval") is not None
    except (OSError, ValueError):
        return False


def _continues(armed: _Armed) -> str:
    from distill.training.checkpoints import newest_checkpoint

    found = newest_checkpoint(armed.state.ckpt_root)
    return f"--resume continues from {armed.state.ckpt_root.name}/step-{found[0]}" if found else "--resume starts over"
