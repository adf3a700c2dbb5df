"""Scripts run in a plain Python process that imports neither jaxtune, torchax nor JAX.

One such process per test process, started on first use and kept: each script then pays for
importing PyTorch, transformers and PEFT once per session instead of on every call (about 5 s
of CPU each). Every script runs in fresh globals, with `sys.argv` set as `python -c SCRIPT ARGS`
would set it; what it prints comes back. A script that raises fails the caller with its
traceback and what the process wrote to stderr.
"""

from __future__ import annotations

import atexit
import json
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOOP = r"""
import contextlib, io, json, sys, traceback
reply_to = sys.stdout
for line in sys.stdin:
    request, out = json.loads(line), io.StringIO()
    sys.argv = ["-c", *request["argv"]]
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(request["script"], "<script>", "exec"), {"__name__": "__main__"})
        reply = {"stdout": out.getvalue()}
    except BaseException:
        reply = {"stdout": out.getvalue(), "error": traceback.format_exc()}
    reply_to.write(json.dumps(reply) + "\n")
    reply_to.flush()
"""

_process: subprocess.Popen | None = None
_stderr: Path | None = None


def _started() -> subprocess.Popen:
    global _process, _stderr
    if _process is None or _process.poll() is not None:
        _stderr = Path(tempfile.mkstemp(prefix="plain-process-", suffix=".log")[1])
        _process = subprocess.Popen(
            [sys.executable, "-c", LOOP],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=_stderr.open("w"),
            text=True,
            bufsize=1,
        )
        atexit.register(_process.kill)
    return _process


def run_plain(script: str, *argv: str, timeout: float = 900) -> str:
    """What `python -c script *argv` prints, run in the session's plain process."""
    process = _started()
    process.stdin.write(json.dumps({"script": script, "argv": list(argv)}) + "\n")
    process.stdin.flush()
    deadline = time.monotonic() + timeout
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline() if ready else ""
    if not line:
        process.kill()
        why = f"no reply within {timeout:.0f} s" if time.monotonic() >= deadline else f"exited {process.wait()}"
        raise AssertionError(f"the plain process {why}:\n{_stderr.read_text()[-3000:]}")
    reply = json.loads(line)
    assert "error" not in reply, f"{reply['error']}\n{_stderr.read_text()[-3000:]}"
    return reply["stdout"]
