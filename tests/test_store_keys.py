"""``LastingKey``: a key that stays once set is looked for with one ``check`` per look until it is seen, then never."""

from __future__ import annotations

import torch

from ddp_strategy.store import LastingKey


class CountingStore:
    def __init__(self) -> None:
        self.store = torch.distributed.HashStore()
        self.checks = 0

    def check(self, keys: list[str]) -> bool:
        self.checks += 1
        return bool(self.store.check(keys))


def test_a_lasting_key_is_checked_until_it_is_seen_and_then_never_again():
    store = CountingStore()
    peer = LastingKey("position/1")
    assert not peer.is_set(store) and not peer.is_set(store)  # type: ignore[arg-type]
    assert store.checks == 2
    store.store.set("position/1", "{}")
    assert peer.is_set(store) and store.checks == 3  # type: ignore[arg-type]
    for _ in range(5):
        assert peer.is_set(store)  # type: ignore[arg-type]
    assert store.checks == 3  # no round trip once seen: the key stays until the run's close
