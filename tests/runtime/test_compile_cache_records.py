"""compile_cache's files of records by program key (plans.json, refused.json): processes that record at the
same time all land, whichever writes last."""

from __future__ import annotations

import multiprocessing

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
