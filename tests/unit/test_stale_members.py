"""Which static members of a group on the embedded broker are named as left behind (kafkatx.app.membership).

tests/test_local_membership.py runs the check against the broker; these pin its rule: another process's static
member is named only when its partitions' records wait with no commit between the two looks, or when the group
rebalanced at both looks; this App's own members and live, committing peers never are."""

from __future__ import annotations

from kafkatx.app.membership import GroupLook, stale_member_message

STABLE, REBALANCING = "ConsumerGroupState.STABLE", "ConsumerGroupState.PREPARING_REBALANCING"
OURS = frozenset({"pod-2-copy-0"})
MEMBERS = {"pod-1-copy-0": (("t", 0), ("t", 1)), "pod-2-copy-0": (("t", 2),)}


def _look(state: str, committed: dict[tuple[str, int], int], waiting: set[tuple[str, int]]) -> GroupLook:
    return GroupLook(state, MEMBERS, committed, waiting)


def test_a_member_whose_waiting_records_see_no_commit_is_named_with_its_partitions_and_the_fix() -> None:
    look = _look(STABLE, {("t", 0): 3, ("t", 1): 0}, {("t", 0)})
    message = stale_member_message("g", OURS, look, look, "127.0.0.1:9092")
    assert message is not None
    assert "'pod-1-copy-0'" in message and "t[0]" in message and "t[1]" not in message
    assert "leave_group('127.0.0.1:9092', 'g', ['pod-1-copy-0'])" in message


def test_a_committing_peer_and_a_peer_with_nothing_to_do_are_not_named() -> None:
    before = _look(STABLE, {("t", 0): 3}, {("t", 0)})
    after = _look(STABLE, {("t", 0): 9}, {("t", 0)})
    assert stale_member_message("g", OURS, before, after, "b:1") is None
    idle = _look(STABLE, {("t", 0): 3}, set())
    assert stale_member_message("g", OURS, idle, idle, "b:1") is None


def test_a_group_rebalancing_at_both_looks_names_the_other_static_members() -> None:
    stuck = GroupLook(REBALANCING, {"pod-1-copy-0": (), "pod-2-copy-0": ()}, {}, set())
    message = stale_member_message("g", OURS, stuck, stuck, "b:1")
    assert message is not None and "'pod-1-copy-0'" in message and "rebalancing" in message
    settled = GroupLook(STABLE, {"pod-1-copy-0": (), "pod-2-copy-0": ()}, {}, set())
    assert stale_member_message("g", OURS, stuck, settled, "b:1") is None


def test_only_this_apps_members_is_nothing_to_say() -> None:
    look = GroupLook(REBALANCING, {"pod-2-copy-0": (("t", 0),)}, {}, {("t", 0)})
    assert stale_member_message("g", OURS, look, look, "b:1") is None
