"""The router's prefix index (router/prefixindex.py) on its own: precise from events,
approximate from sends within its age, the feed state choosing between them, a pod
forgotten, and the memory bound."""

from __future__ import annotations

import pytest
from sluice_server.router.prefixindex import PrefixIndex


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def chain(tag: str, n: int) -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def test_precise_run_of_leading_blocks_from_events():
    index = PrefixIndex()
    index.feed("a", live=True)
    index.stored("a", chain("s", 6), parent=None)
    assert index.longest_prefix("a", chain("s", 4)) == 4
    assert index.longest_prefix("a", chain("s", 9)) == 6
    # The first miss ends the run even when later blocks are held.
    index.removed("a", ["s2"])
    assert index.longest_prefix("a", chain("s", 6)) == 2
    index.cleared("a")
    assert index.longest_prefix("a", chain("s", 6)) == 0
    assert index.longest_prefix("unknown", chain("s", 6)) == 0


def test_feed_state_chooses_precise_or_approximate():
    index = PrefixIndex(clock=Clock())
    index.sent("a", chain("s", 5))  # the router sent these
    index.stored("a", chain("s", 2))  # the engine says it holds two
    assert index.longest_prefix("a", chain("s", 5)) == 5  # no live feed: what was sent
    index.feed("a", live=True)
    assert index.longest_prefix("a", chain("s", 5)) == 2  # live feed: what the engine holds
    # A lost feed empties the precise set (events were missed) and falls back.
    index.feed("a", live=False)
    assert index.size("a")[0] == 0
    assert index.longest_prefix("a", chain("s", 5)) == 5
    index.feed("a", live=True)
    assert index.longest_prefix("a", chain("s", 5)) == 0


def test_approximate_entries_expire_by_age():
    clock = Clock()
    index = PrefixIndex(approx_age_s=60, clock=clock)
    index.sent("a", chain("old", 3))
    clock.t += 50
    index.sent("a", chain("new", 3))
    clock.t += 20  # "old" is 70 s old, "new" 20 s
    assert index.longest_prefix("a", chain("old", 3)) == 0
    assert index.longest_prefix("a", chain("new", 3)) == 3
    # Re-sending refreshes an entry's age.
    index.sent("a", chain("new", 1))
    clock.t += 45
    assert index.longest_prefix("a", chain("new", 3)) == 1


def test_forget_drops_everything_of_a_pod():
    index = PrefixIndex()
    index.feed("a", live=True)
    index.stored("a", chain("s", 3))
    index.sent("a", chain("s", 3))
    index.sent("b", chain("s", 3))
    index.forget("a")
    assert index.pods() == ["b"]
    assert index.size("a") == (0, 0)
    assert not index.is_live("a")
    assert index.longest_prefix("a", chain("s", 3)) == 0


@pytest.mark.parametrize("kind", ["precise", "approx"])
def test_index_is_bounded_per_pod(kind):
    index = PrefixIndex(max_precise=1000, max_approx=500)
    bound = 1000 if kind == "precise" else 500
    for i in range(200):
        blocks = chain(f"r{i}-", 50)  # 10,000 hashes, 10-20x the bound
        if kind == "precise":
            index.stored("a", blocks)
        else:
            index.sent("a", blocks)
    precise, approx = index.size("a")
    assert (precise if kind == "precise" else approx) == bound
    # The newest are kept, the oldest dropped first.
    if kind == "precise":
        index.feed("a", live=True)
    assert index.longest_prefix("a", chain("r199-", 50)) == 50
    assert index.longest_prefix("a", chain("r0-", 50)) == 0


def test_restored_block_is_newest_again():
    index = PrefixIndex(max_precise=4)
    index.feed("a", live=True)
    index.stored("a", ["x", "y", "z", "w"])
    index.stored("a", ["x"])  # the engine touched x again
    index.stored("a", ["v"])  # over the bound: y goes, not x
    assert index.longest_prefix("a", ["x"]) == 1
    assert index.longest_prefix("a", ["y"]) == 0


def test_bounds_must_be_positive():
    with pytest.raises(ValueError):
        PrefixIndex(max_precise=0)
