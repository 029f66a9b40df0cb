"""The vote's tie-breaking off the CPU: every coordinate's coin made on the device and kept where
tied, with no host synchronisation (finding the ties with ``nonzero`` would wait for the device),
bitwise the codes of the CPU path, which hashes only the tied coordinates."""

import torch
from hypothesis import given, settings, strategies as st

from dlion.vote import VoteRule
from sync_audit import EmulatedDevice


@settings(max_examples=150, deadline=None)
@given(world=st.integers(2, 8), n=st.integers(1, 300), ties=st.sampled_from(["random", "previous"]),
       abstain=st.booleans(), indexed=st.booleans(), start=st.integers(0, 5000), key=st.integers(0, 2**31 - 1),
       data=st.data())
def test_decide_on_the_device_equals_the_cpu(world, n, ties, abstain, indexed, start, key, data):
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    nz = torch.randint(0, world + 1, (n,), generator=g) if abstain else None
    votes = nz if nz is not None else torch.full((n,), world)
    # s has nz's parity (each voter ±1): many exact ties at even counts, and coordinates no one voted on
    plus = (torch.rand(n, generator=g) * (votes + 1)).floor().long().clamp(max=votes)
    s = (2 * plus - votes).to(torch.int32)
    span = start + n + 64
    previous = torch.randint(-1, 2, (span,), generator=g, dtype=torch.int8) if ties == "previous" else None
    index = (torch.randperm(span - start, generator=g)[:n] + start) if indexed else None
    rule = VoteRule("mavo", world, ties=ties)
    want = rule.decide(s, nz, key=key, start=start, index=index, previous=previous)
    with EmulatedDevice() as em:
        dev = [None if x is None else x.to("cuda") for x in (s, nz, index, previous)]
        em.counting = True
        got = rule.decide(dev[0], dev[1], key=key, start=start, index=dev[2], previous=dev[3])
        em.counting = False
        assert em.count() == 0, em.by_site()
    assert got.dtype == want.dtype and torch.equal(got.cpu(), want)
    tied = (s == 0) if nz is None else (s == 0) & (nz > 0)
    assert not bool(((want == 0) & tied).any())  # every tie broken, to ±1
    assert torch.equal(want[~tied], torch.sign(s[~tied]).to(torch.int8))
