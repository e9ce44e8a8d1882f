"""The aux row rides on the last chunk's KV post to the decode rank that writes it (one post per
room instead of two), and goes as a post of its own only where there is no such KV write."""

from __future__ import annotations

from typing import Any

from asynckv.proto import actions as act
from asynckv.proto.states import KVPoll

from .harness import Cluster, ready_room


def posts(c: Cluster, p: Any, room: int) -> list[tuple[str, list[int], tuple[int, int] | None, int]]:
    return [(a.kind, a.dst.tolist(), a.aux, a.nbytes) for _, a in c.actions(act.Post, p) if a.room == room]


def test_the_last_chunk_carries_the_aux_row_and_it_lands_with_the_pages() -> None:
    c, p, d, r, s = ready_room([3, 4, 5], aux=2)
    c.send(p, s, [0], num_pages=3, aux=1)
    c.send(p, s, [1, 2])
    c.run_ms(200)
    page, aux = p.core.page_bytes, p.core.aux_bytes
    assert posts(c, p, 1) == [("kv", [3], None, page), ("kv", [4, 5], (1, 2), 2 * page + aux)]
    assert r.poll() == KVPoll.Success and d.aux_content[2] == (1, r.epoch)
    stats = p.core.stats  # (bytes by kind stay by kind; the row that rode is counted apart)
    assert (stats["aux_riding"], stats["aux_posts"], stats["aux_bytes"]) == (1, 0, aux)
    c.check()


def test_a_last_chunk_without_pages_sends_the_aux_row_alone() -> None:
    c, p, d, r, s = ready_room([], aux=2)  # (decode holds the whole prompt: only the metadata row moves)
    c.send(p, s, [], num_pages=0, aux=1)
    c.run_ms(200)
    assert posts(c, p, 1) == [("aux", [2], None, p.core.aux_bytes)]
    assert r.poll() == KVPoll.Success and d.aux_content[2] == (1, r.epoch)
    c.check()
