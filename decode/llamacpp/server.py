"""One ``llama-server`` process, held for the length of a ``with`` block: started on 127.0.0.1 at a free port,
ready once its ``/health`` answers, always terminated on the way out (a bench that ends, fails or is interrupted
with Ctrl-C; on Linux also when the Python process itself dies, through the parent-death signal).

Standard library only: the bench talks to it with ``urllib`` (``/completion``, ``/tokenize``, ``/apply-template``,
``/metrics``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

START_TIMEOUT_S = 600.0  # loading a large GGUF from a slow disk
REQUEST_TIMEOUT_S = 3600.0  # one completion of a large model on a slow CPU


class ServerFailed(ValueError):
    """llama-server did not start, or answered a request with an error; the message has its own last words."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def physical_cores() -> int:
    """The machine's physical CPU cores (llama.cpp runs fastest with one thread per core, not per hyperthread):
    psutil where installed, else the distinct (package, core) pairs of /proc/cpuinfo, else os.cpu_count()."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
        if n:
            return int(n)
    except ImportError:
        pass
    try:
        pairs, package = set(), None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "physical id":
                package = value.strip()
            elif key.strip() == "core id":
                pairs.add((package, value.strip()))
        if pairs:
            return len(pairs)
    except OSError:
        pass
    return os.cpu_count() or 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def last_lines(text: str, n: int = 3) -> str:
    """The last ``n`` non-empty lines of a log, joined with ' | ' (an error message stays one line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[-n:]) if lines else "(no output)"


class Server:
    """``llama-server`` run as ``cmd`` (without ``--host``/``--port``: added here), as a context manager.

    ``name`` is what messages call it ("target-only", "speculative")."""

    def __init__(self, cmd: Sequence[str], name: str, start_timeout: float = START_TIMEOUT_S) -> None:
        self.port = free_port()
        self.cmd = [*map(str, cmd), "--host", "127.0.0.1", "--port", str(self.port)]
        self.name = name
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile(mode="w+b")  # the server's output: quoted when it fails

    # -- lifetime -----------------------------------------------------------------------------------------------
    def __enter__(self) -> Server:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start the process and wait until ``/health`` answers 200; ServerFailed with its last log lines if it
        exits first or does not answer within ``start_timeout`` seconds."""
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=preexec
        )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(
                    f"llama-server ({self.name}) exited with status {self.proc.returncode} while loading: "
                    f"{last_lines(self.log())}"
                )
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):  # not listening yet, or 503 while loading
                pass
            time.sleep(0.2)
        raise ServerFailed(
            f"llama-server ({self.name}) did not become ready in {self.start_timeout:.0f} s: {last_lines(self.log())}"
        )

    def close(self) -> None:
        """Terminate the process (SIGTERM, then SIGKILL after 10 s); safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log.close()

    def log(self) -> str:
        """Everything the server has printed so far."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")

    # -- requests -------------------------------------------------------------------------------------------------
    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
        """POST ``body`` as JSON; the JSON answer. ServerFailed with the server's error message otherwise."""
        req = urllib.request.Request(
            self.url(path), data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        return json.loads(self._send(req, path, timeout))

    def get_text(self, path: str, timeout: float = 60.0) -> str:
        return self._send(urllib.request.Request(self.url(path)), path, timeout)

    def _send(self, req: urllib.request.Request, path: str, timeout: float) -> str:
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.read().decode("utf-8")
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise ServerFailed(f"llama-server ({self.name}) refused {path}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            status = self.proc.poll() if self.proc is not None else None
            gone = f" (it exited with status {status}: {last_lines(self.log())})" if status is not None else ""
            raise ServerFailed(f"llama-server ({self.name}) did not answer {path}: {e}{gone}") from None


def parse_metrics(text: str) -> dict[str, float | list[float]]:
    """llama-server's Prometheus ``/metrics`` as {name: value}, the ``llamacpp:`` prefix dropped; a labelled series
    ``name{position="i"}`` becomes a list indexed by i."""
    out: dict[str, float | list[float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        name = name.removeprefix("llamacpp:")
        try:
            number = float(value)
        except ValueError:
            continue
        if "{" in name:
            base, _, labels = name.partition("{")
            pos = labels.split('position="', 1)[-1].split('"', 1)[0]
            if not pos.isdigit():
                continue
            series = out.setdefault(base, [])
            assert isinstance(series, list)
            series.extend([0.0] * (int(pos) + 1 - len(series)))
            series[int(pos)] = number
        else:
            out[name] = number
    return out
