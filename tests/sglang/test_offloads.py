"""The linker's offload queue (kvd_client.sglang.offloads) without SGLang or a GPU: SGLang's
order kept, GPU slot ids submitted once their copy arrived, failures as failed offloads."""

from __future__ import annotations

import time

from kvd_client.sglang.offloads import Offload, Offloads
from kvd_protocol.errors import DaemonUnavailable


class Sent:
    """What ``submit`` returns: a store in flight (kvd_client.transfer.Transfer's fields)."""
    def __init__(self, tokens: int):
        self.done, self.ok, self.tokens, self.waited = False, True, tokens, False

    def wait(self):
        self.waited = self.done = True


class Arrival:
    """A CUDA event of a slot-id copy: ``query()`` is True once the copy ran."""
    def __init__(self):
        self.arrived = False

    def query(self) -> bool:
        return self.arrived


def queue(refuse=()):
    sent = []

    def submit(keys, ids, pages):
        if keys in refuse:
            return None
        if keys == "unreachable":
            raise DaemonUnavailable("gone")
        sent.append((keys, list(ids), pages))
        return Sent(pages * 64)
    return Offloads(submit, timeout_s=5.0), sent


def deferred(q: Offloads, keys: str, timeout: float = 5.0) -> Arrival:
    """An offload whose slot ids are still being copied from the GPU (what ``add`` queues)."""
    ev = Arrival()
    q.queue.append(Offload(keys, 1, 64, ids=[0] * 64, ready=ev, deadline=time.monotonic() + timeout))
    return ev


def test_host_ids_are_submitted_at_once_and_done_counts_from_the_front():
    q, sent = queue()
    q.add("a", list(range(64)), 1, 64)
    q.add("b", list(range(64, 192)), 2, 128)
    assert [s[0] for s in sent] == ["a", "b"] and q.poll() == 0
    q.queue[1].transfer.done = True
    assert q.poll() == 0  # "a" still runs: SGLang pops in its own order
    q.queue[0].transfer.done = True
    assert q.poll() == 2
    first = q.pop()
    assert first.keys == "a" and first.ok and q.pop().ok


def test_a_store_waits_for_its_slot_ids_and_keeps_sglangs_order():
    q, sent = queue()
    ev = deferred(q, "gpu")
    q.add("host", list(range(64)), 1, 64)
    assert sent == [] and q.poll() == 0  # behind ids still in flight: not sent ahead of them
    ev.arrived = True
    assert q.poll() == 0 and [s[0] for s in sent] == ["gpu", "host"]


def test_ids_that_never_arrive_fail_their_offload_and_free_the_rest():
    q, sent = queue()
    deferred(q, "stuck", timeout=0.0)
    q.add("next", list(range(64)), 1, 64)
    assert q.poll() == 1 and [s[0] for s in sent] == ["next"]
    assert q.pop().ok is False


def test_a_refused_or_unsendable_store_is_a_failed_offload_and_nothing_raises():
    q, _ = queue(refuse=("misaligned",))
    q.add("misaligned", [1] * 64, 1, 64)
    q.add("unreachable", list(range(64)), 1, 64)
    q.add_noop()  # an MLA rank other than 0: nothing to store, a success
    assert q.poll() == 3
    assert [q.pop().ok for _ in range(3)] == [False, False, True]


def test_a_store_that_landed_fewer_tokens_than_asked_is_not_ok():
    q, _ = queue()
    q.add("a", list(range(128)), 2, 128)
    q.queue[0].transfer.tokens, q.queue[0].transfer.done = 64, True
    assert q.poll() == 1 and q.pop().ok is False


def test_wait_all_waits_for_what_was_sent_and_drops_the_rest():
    q, sent = queue()
    q.add("a", list(range(64)), 1, 64)
    deferred(q, "never")
    a = q.queue[0].transfer
    q.wait_all()
    assert a.waited and not q.queue and [s[0] for s in sent] == ["a"]
