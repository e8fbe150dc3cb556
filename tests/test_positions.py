from __future__ import annotations

from ddp_strategy.positions import Position, call_site, format_ranks


def test_format_ranks():
    assert format_ranks([]) == ""
    assert format_ranks([3]) == "3"
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert format_ranks([2, 1, 1]) == "1-2"


def test_position_roundtrip_and_describe():
    p = Position(kind="barrier", name="save", site="train.py:3 in main", seq=4, since=100.0, heartbeat=109.0)
    assert Position.from_json(p.to_json()) == p
    text = p.describe(now=110.0)
    assert text == "barrier 'save' at train.py:3 in main (entered 10.0 s ago, last heartbeat 1.0 s ago)"
    step = Position(kind="training step", name="12", since=109.0)
    assert step.describe(now=110.0).startswith("training step 12 (entered 1.0 s ago")
    failed = Position(kind="failed", name="ValueError: boom", since=109.5)
    assert failed.describe(now=110.0) == "failed with ValueError: boom (0.5 s ago)"


def helper_calling_call_site() -> str:
    return call_site(skip=1)


def test_call_site_points_at_user_code():
    site = helper_calling_call_site()
    assert "test_positions.py" in site and "helper_calling_call_site" in site
