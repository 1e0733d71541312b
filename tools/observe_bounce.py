"""Run the bounce variants whose outcome rests on a gap of the embedded broker, and report what each saw.

These variants (broker bounces; copiers back under new ids with group fencing, or after SIGKILL) are not in the
pytest suite: on noida-db 0.2.3 they can lose or duplicate records for reasons that are the broker's
(docs/BROKERS.md), so a test of them could not tell a kafkatx regression from the broker's gap. Each gap has a
strict canary in tests/test_broker_conformance.py that says when the broker fixes it; then the variant belongs back
in tests/test_bounce.py's matrix.

Run by hand (minutes per variant, full size; two cores are enough for one at a time):

    python tools/observe_bounce.py                 # every variant
    python tools/observe_bounce.py broker-clean-group --records 20000
    python tools/observe_bounce.py --list

Each variant prints one line: passed, or the failure class and its message, and whether that class is one the
variant's broker gap explains. A failure the gap does not explain (e.g. a record out of order, a dead letter, a
copier that died) is a finding about kafkatx: the exit status is 1 then, else 0. The harness's statistics are
kept in ``<workdir>/<variant>/bounce-stats.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_bounce import (  # noqa: E402  (the harness lives beside the tests it serves)
    BounceFailure,
    DuplicateRecords,
    HangingTransaction,
    LiveViewDuplicates,
    MissingRecords,
    Scenario,
    Stalled,
    run_bounce_test,
)

_CANARY = "tests/test_broker_conformance.py::"
LOSES_OPEN_TRANSACTIONS = (
    "noida-db 0.2.3 loses a transaction open across its restart yet reports the commit as successful "
    f"({_CANARY}test_a_transaction_open_across_a_clean_broker_restart_commits_or_fails), and leaves what the "
    f"transaction writes after the restart open ({_CANARY}test_a_transaction_committed_after_a_broker_restart_"
    "leaves_nothing_open)"
)
LOSES_RECENT_COMMITS = (
    "noida-db 0.2.3 loses the commits of its last 1-2 s when it is killed "
    f"({_CANARY}test_a_committed_transaction_survives_a_broker_kill), and a transaction open across its restart"
)
STALLS_AFTER_A_KILLED_MEMBER = (
    "noida-db 0.2.3 leaves a group whose dynamic member was killed without partitions for minutes "
    f"({_CANARY}test_a_killed_members_partitions_go_to_the_live_members)"
)
OVERLAPS_OWNERS = (
    "noida-db 0.2.3 lacks KIP-447: rejoining dynamic members get the same partitions at once for a moment and it "
    f"accepts the stale owner's offsets ({_CANARY}test_kip447_offsets_with_a_stale_generation_are_rejected)"
)
LACKS_KIP447 = (
    "noida-db 0.2.3 lacks KIP-447 "
    f"({_CANARY}test_kip447_offset_fetch_waits_for_pending_transactional_offsets), the expiry of a dead producer's "
    f"transaction ({_CANARY}test_a_dead_producers_open_transaction_is_aborted_after_its_timeout) and a group that "
    f"survives a killed member ({_CANARY}test_a_killed_members_partitions_go_to_the_live_members)"
)


@dataclass(frozen=True)
class Variant:
    id: str
    scenario: Scenario
    gap: str
    explained: tuple[type[BounceFailure], ...]  # the failures the gap can cause


def variants() -> list[Variant]:
    found = [
        Variant(
            "copiers-clean-new-ids-group",
            Scenario(copier_failure="clean", new_ids=True, fencing="group"),
            OVERLAPS_OWNERS,
            (DuplicateRecords, Stalled),
        ),
        Variant(
            "copiers-hard-new-ids-group",
            Scenario(copier_failure="hard", new_ids=True, fencing="group"),
            LACKS_KIP447,
            (Stalled, DuplicateRecords),
        ),
        Variant(
            "copiers-hard-new-ids-partition",
            Scenario(copier_failure="hard", new_ids=True, fencing="partition"),
            STALLS_AFTER_A_KILLED_MEMBER,
            (Stalled,),
        ),
    ]
    broker_gaps: dict[Literal["clean", "hard"], tuple[str, tuple[type[BounceFailure], ...]]] = {
        "clean": (LOSES_OPEN_TRANSACTIONS, (MissingRecords, LiveViewDuplicates, HangingTransaction)),
        "hard": (LOSES_RECENT_COMMITS, (MissingRecords, DuplicateRecords, LiveViewDuplicates, HangingTransaction)),
    }
    for fencing in ("group", "partition"):
        for broker, (gap, explained) in broker_gaps.items():
            found.append(
                Variant(f"broker-{broker}-{fencing}", Scenario(broker=broker, fencing=fencing), gap, explained)
            )
            found.append(
                Variant(
                    f"copiers-and-broker-{broker}-{fencing}",
                    Scenario(copier_failure="mixed", broker=broker, fencing=fencing),
                    gap,
                    explained,
                )
            )
    return found


def observe(variant: Variant, workdir: Path) -> tuple[str, bool]:
    """Run one variant; returns its outcome and whether that outcome is a pass or explained by the broker's gap."""
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        run_bounce_test(workdir, variant.scenario)
    except BounceFailure as failure:
        explained = isinstance(failure, variant.explained)
        first_line = str(failure).splitlines()[0] if str(failure) else ""
        verdict = "explained by the broker's gap" if explained else "NOT explained by the broker's gap"
        return f"{type(failure).__name__} ({verdict}): {first_line}", explained
    except AssertionError as failure:
        first_line = str(failure).splitlines()[0] if str(failure) else ""
        return f"AssertionError (NOT explained by the broker's gap): {first_line}", False
    return f"passed in {time.monotonic() - started:.0f}s", True


def main(argv: list[str] | None = None) -> int:
    known = {v.id: v for v in variants()}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", nargs="*", help=f"variants to run (default: all): {', '.join(known)}")
    parser.add_argument("--records", type=int, help="seed this many records instead of the scenario's 100,000")
    parser.add_argument("--workdir", type=Path, help="where the broker, logs and statistics go (default: a temp dir)")
    parser.add_argument("--list", action="store_true", help="list the variants and their broker gaps, run nothing")
    args = parser.parse_args(argv)
    unknown = [i for i in args.ids if i not in known]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(known)}")
    chosen = [known[i] for i in args.ids] if args.ids else list(known.values())
    if args.list:
        for v in chosen:
            print(f"{v.id}: {v.gap}; can cause {', '.join(c.__name__ for c in v.explained)}")
        return 0
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="observe-bounce-"))
    all_explained = True
    for v in chosen:
        scenario = dataclasses.replace(v.scenario, records=args.records) if args.records else v.scenario
        outcome, explained = observe(dataclasses.replace(v, scenario=scenario), workdir / v.id)
        all_explained &= explained
        print(f"{v.id}: {outcome}", flush=True)
    print(f"statistics under {workdir}")
    return 0 if all_explained else 1


if __name__ == "__main__":
    sys.exit(main())
