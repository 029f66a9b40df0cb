"""The codes' way back by voters (:class:`dlion.wire._ByVoters`) on the device gives the host's bytes and codes.

Off the CPU, :meth:`_ByVoters.encode` finds a block's exceptions with ``nonzero_static`` in the list's fixed
room and writes its header on the device, the per-coordinate formats go there as index tensors from pinned
memory, and :meth:`_ByVoters.decode` takes every chunk's received exceptions there in one copy: no host
synchronisation. The values run on emulated CUDA tensors (:class:`sync_audit.EmulatedDevice`), so the device
branches are the ones taken; the reference is the CPU path on the same codes. Voter counts are drawn per
parameter (one count for all, the common case, or mixed; parameters left out of the payload have size 0),
codes mostly in their coordinate's format, with misfits drawn around the list's room (exactly ``capacity``
fits, one more sends the chunk's header to −1: every rank gathers the codes again in a plain format)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dlion import wire
from dlion.vote import VoteRule
from sync_audit import EmulatedDevice, to_device


def _fitting(v: int, avg: bool, ties: str, draw) -> int:
    """A code that coordinate's format holds (v voters)."""
    if v == 0:
        return 0
    if avg:  # the number of +1 votes p ∈ [0, v]: s = 2p − v
        return 2 * draw(st.integers(0, v)) - v
    if v % 2 == 1 or ties != "zero":
        return draw(st.sampled_from([-1, 1]))
    return draw(st.sampled_from([-1, 0, 1]))


def _misfit(v: int, avg: bool, world: int, draw) -> int:
    """A code that coordinate's format cannot hold (an exception), or any code where none is possible."""
    if avg:
        choices = [s for s in range(-world, world + 1) if v == 0 and s != 0 or v > 0 and ((s + v) % 2 or abs(s) > v)]
    else:
        choices = [-1, 1] if v == 0 else [0]
    return draw(st.sampled_from(choices or [0]))


@st.composite
def cases(draw):
    """(rule, per-parameter voters, sizes, n, blocks, capacity, codes (n,))."""
    world = draw(st.integers(1, 6))
    vote = draw(st.sampled_from(["mavo", "avg"]))
    ties = draw(st.sampled_from(["zero", "random"])) if vote == "mavo" else "zero"
    rule = VoteRule(vote, world, ties=ties)
    blocks = world
    width = 8 * draw(st.integers(1, 6))
    n = blocks * width
    numel = draw(st.integers(1, n))
    cuts = sorted(set(draw(st.lists(st.integers(0, numel), max_size=5))) | {0, numel})
    sizes = [b - a for a, b in zip(cuts, cuts[1:])]
    for _ in range(draw(st.integers(0, 2))):  # parameters left out of the payload
        sizes.insert(draw(st.integers(0, len(sizes))), 0)
    if draw(st.booleans()):  # one voter count for every parameter (the usual case)
        one = draw(st.integers(0, world))
        voters = [one] * len(sizes)
    else:
        voters = draw(st.lists(st.integers(0, world), min_size=len(sizes), max_size=len(sizes)))
    capacity = draw(st.integers(1, 6))
    v = torch.zeros(n, dtype=torch.int64)
    v[:numel] = torch.repeat_interleave(torch.tensor(voters), torch.tensor(sizes))
    codes = [_fitting(int(x), vote == "avg", ties, draw) for x in v]
    for j in range(blocks):  # misfits per chunk around the room: none, some, exactly capacity, one more
        k = min(width, draw(st.sampled_from([0, 1, capacity, capacity + 1, draw(st.integers(0, width))])))
        for at in draw(st.lists(st.integers(0, width - 1), min_size=k, max_size=k, unique=True)):
            codes[j * width + at] = _misfit(int(v[j * width + at]), vote == "avg", world, draw)
    dtype = torch.int16 if vote == "avg" else torch.int8
    return (rule, torch.tensor(voters, dtype=torch.int16), sizes, n, blocks, capacity,
            torch.tensor(codes, dtype=dtype))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_by_voters_on_the_device_is_the_host_path(case):
    rule, voters, sizes, n, blocks, capacity, codes = case
    width = n // blocks
    host = wire._ByVoters(rule, voters, sizes, n, blocks, capacity)
    sent = [host.encode(codes[j * width:(j + 1) * width], j) for j in range(blocks)]
    gathered = torch.cat(sent)
    want = host.decode(gathered)
    if want is not None:  # (the host path's own round trip)
        assert torch.equal(want, codes)
    heads = wire.read_heads([(gathered, (blocks, host.head // 4))])[0].headers
    event("fallback (a chunk's exceptions exceed the room)" if want is None else
          "exceptions listed" if bool((heads[:, 0] > 0).any()) else "no exception")
    event("one voter count" if host.uniform is not None else "mixed voter counts")
    if any((heads[j, 0] < 0) for j in range(blocks)):
        assert want is None

    em = EmulatedDevice()
    with em:
        dev = wire._ByVoters(rule, voters, sizes, n, blocks, capacity)  # (made on the host from the headers)
        dev_codes = to_device(codes)
        # (the codecs' lookup tables go to a device once per process, as in any step after the first)
        wire._ByVoters(rule, voters, sizes, n, blocks, capacity).decode(
            wire.Received(to_device(gathered), heads.clone()))
        em.counting = True
        dev_sent = [dev.encode(dev_codes[j * width:(j + 1) * width], j) for j in range(blocks)]
        dev_gathered = torch.cat(dev_sent)
        em.counting = False
        # the driver reads the headers on the host (wire.read_heads: the round's one read, not counted here)
        received = wire.read_heads([(dev_gathered, (blocks, dev.head // 4))])[0]
        assert torch.equal(received.headers, heads)
        em.counting = True
        got = dev.decode(received)
        em.counting = False
        assert all(s.is_cuda for s in dev_sent) and (got is None or got.is_cuda)
        sent_back = [s.cpu() for s in dev_sent]
        got_back = None if got is None else got.cpu()
    assert not em.errors, em.errors
    assert em.count() == 0, dict(em.syncs)
    assert all(torch.equal(a, b) for a, b in zip(sent_back, sent))  # the same bytes on the wire
    assert (got_back is None) == (want is None)
    if want is not None:
        assert got_back.dtype == want.dtype and torch.equal(got_back, want)
