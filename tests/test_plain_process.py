"""The plain process the export checks compute in: one process reused, fresh globals per script,
argv as `python -c` sets it, and a failing script failing its caller."""

import json

import pytest

from tests.plain_process import run_plain

REPORT = """
import json, os, sys
print("noise first")
print(json.dumps({"pid": os.getpid(), "argv": sys.argv, "seen": "marker" in globals(),
                  "jax": "jax" in sys.modules or "torchax" in sys.modules}))
marker = 1
"""


def test_scripts_share_one_plain_process_and_nothing_else():
    first, second = (json.loads(run_plain(REPORT, "a b", "c").splitlines()[-1]) for _ in range(2))
    assert first["argv"] == ["-c", "a b", "c"]
    assert first["pid"] == second["pid"]  # imported once
    assert not first["seen"] and not second["seen"]  # each script starts from empty globals
    assert not first["jax"] and not second["jax"]


def test_a_failing_script_fails_the_caller_with_its_traceback_and_the_process_serves_on():
    with pytest.raises(AssertionError, match=r"(?s)Traceback.*ZeroDivisionError: division by zero"):
        run_plain("print('before'); 1 / 0")
    assert run_plain("print(6 * 7)") == "42\n"
