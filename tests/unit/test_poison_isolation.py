"""The shared search by halves (listener/failure/poison_isolation.py) and the batch runner's pure rules, no broker."""

from __future__ import annotations

import pytest

from kafkatx import Record, RecordFailedError
from kafkatx.listener.failure.poison_isolation import IsolationStopped, RunFailed, isolate
from kafkatx.listener.runners.batch_runner import failed_index


def _runner(poison: set[int], runs: list[list[int]]):  # type: ignore[no-untyped-def]
    def run(indices: list[int]) -> list[int]:
        runs.append(indices)
        bad = poison.intersection(indices)
        if bad:
            raise RunFailed(ValueError(f"poison {sorted(bad)}"))
        return indices

    return run


@pytest.mark.parametrize("poison", [{0}, {37}, {99}, {3, 50, 98}])
def test_only_the_records_that_fail_alone_are_found_and_the_result_is_one_run_over_all_the_others(
    poison: set[int],
) -> None:
    runs: list[list[int]] = []
    found = isolate(_runner(poison, runs), list(range(100)), ValueError("all"), max_runs=128, stopping=lambda: False)
    assert set(found.poison) == poison
    assert found.result == [i for i in range(100) if i not in poison], "the committed result covers every other record"
    assert found.runs == len(runs) <= len(poison) * 8, "about k·(log2(n) + 1) runs"


def test_the_budget_ends_the_search_with_every_record_of_the_failing_set_a_suspect() -> None:
    runs: list[list[int]] = []
    found = isolate(_runner({5}, runs), list(range(64)), ValueError("all"), max_runs=2, stopping=lambda: False)
    assert 5 in found.poison and len(found.poison) > 1, "suspects, never skipped"
    assert all("max_bisect_jobs=2" in " ".join(getattr(e, "__notes__", [])) for e in found.poison.values())


def test_a_budget_of_zero_makes_the_whole_failing_set_suspect_without_a_run() -> None:
    runs: list[list[int]] = []
    found = isolate(_runner({1}, runs), list(range(8)), ValueError("all"), max_runs=0, stopping=lambda: False)
    assert sorted(found.poison) == list(range(8)) and found.result is None and runs == []


def test_a_data_independent_error_makes_every_record_suspect_at_once() -> None:
    runs: list[list[int]] = []
    found = isolate(
        _runner({1}, runs),
        list(range(8)),
        TypeError("schema"),
        max_runs=128,
        stopping=lambda: False,
        data_independent=lambda e: isinstance(e, TypeError),
    )
    assert sorted(found.poison) == list(range(8)) and runs == []


def test_a_stop_gives_the_search_up() -> None:
    with pytest.raises(IsolationStopped):
        isolate(_runner({1}, []), list(range(8)), ValueError("all"), max_runs=128, stopping=lambda: True)


def test_the_named_record_is_found_by_identity_then_by_coordinates() -> None:
    records = [Record("t", 0, n, None, b"%d" % n) for n in range(5)]
    assert failed_index(RecordFailedError(records[3]), records) == 3
    assert failed_index(RecordFailedError(Record("t", 0, 2, None, b"copy")), records) == 2
    assert failed_index(RecordFailedError(Record("t", 1, 2, None, b"other partition")), records) is None
    assert failed_index(RecordFailedError("not a record"), records) is None
