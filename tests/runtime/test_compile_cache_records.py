"""compile_cache's files of records by program key (plans.json, refused.json): processes that record at the
same time all land, whichever writes last."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from jaxtune.runtime.devices import compile_cache


def _record_many(path, worker: int) -> None:
    for i in range(25):
        compile_cache._record(path, f"{worker}-{i}", {"worker": worker, "i": i})


def test_records_written_at_once_by_several_processes_are_all_kept(tmp_path):
    path = tmp_path / "plans.json"
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_record_many, args=(path, w)) for w in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert [w.exitcode for w in workers] == [0] * 4
    found = compile_cache._read(path)
    assert sorted(found) == sorted(f"{w}-{i}" for w in range(4) for i in range(25))
    assert found["3-24"] == {"worker": 3, "i": 24}


class _Lowered:
    def __init__(self, text: str):
        self.text = text

    def as_text(self) -> str:
        return self.text


def _triton_call(ir: str, grid_z: int = 4) -> str:
    return (
        '%0 = stablehlo.custom_call @__gpu$xla.gpu.triton(%arg0) {backend_config = "", mhlo.backend_config = '
        f'{{debug = false, grid_x = 1 : i32, grid_y = 4 : i32, grid_z = {grid_z} : i32, ir = "{ir}", name = "k"}}}}'
    )


def test_a_triton_kernels_bytecode_is_left_out_of_the_key_its_call_is_not():
    """A GPU kernel's bytecode names the files and frames that traced it: /work/main/... in one checkout,
    /tmp/clone/... in another, more or fewer frames after other traces in the same process."""
    here = compile_cache.program_text(_Lowered(_triton_call(r"ML\EFR/work/main/jaxtune/gpu_flash.py\22\00")))
    there = compile_cache.program_text(_Lowered(_triton_call(r"ML\EFR/tmp/clone/jaxtune/gpu_flash.py\00steps.py")))
    assert here == there and "gpu_flash.py" not in here
    assert compile_cache.program_text(_Lowered(_triton_call("ML\\EFR", grid_z=2))) != here


def test_the_suite_reads_the_committed_plans_from_a_copy_outside_the_checkout():
    """tests/conftest.py: a plan compiled for a key that misses is kept in the session's copy, never in the
    tracked tests/targets/plans.json, so that the suite leaves a checkout as it found it."""
    from tests.conftest import COMMITTED_PLANS

    named = Path(os.environ[compile_cache.PLANS_FILE_VARIABLE]).resolve()
    if named == Path(COMMITTED_PLANS).resolve():
        pytest.skip("JAXTUNE_PLANS_FILE names the committed file: this run records plans into it")
    assert not named.is_relative_to(Path(COMMITTED_PLANS).resolve().parents[2])
    assert compile_cache._read(Path(COMMITTED_PLANS)).keys() <= compile_cache._read(named).keys()
