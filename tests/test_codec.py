"""Property tests for the bit codecs and the vote rules' wire formats."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dlion.vote import VoteRule, coin_key, tie_coins
from dlion.codec import ALIGN, FieldCodec, SignCodec, TritCodec, pack_bits, unpack_bits

lengths = st.integers(min_value=0, max_value=400).map(lambda k: k * ALIGN // 8 * 8)


def ternary(n, seed):
    return torch.randint(-1, 2, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2000).map(lambda k: 8 * k), st.integers(0, 2**31 - 1))
def test_pack_bits_round_trip_and_layout(n, seed):
    bits = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == n // 8
    assert torch.equal(unpack_bits(packed, n), bits)
    # least significant bit first, 8 per byte: byte j = Σ_k bit[8j+k]·2^k
    expect = (bits.view(-1, 8).long() * (2 ** torch.arange(8))).sum(1) if n else torch.zeros(0, dtype=torch.long)
    assert torch.equal(packed.long(), expect)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 500).map(lambda k: 40 * k), st.integers(0, 2**31 - 1))
def test_sign_and_trit_codecs_round_trip(n, seed):
    t = ternary(n, seed)
    packed = TritCodec().encode(t)
    assert packed.numel() == n // 5 and int(packed.max()) <= 242 if n else True
    assert torch.equal(TritCodec().decode(packed, n), t)
    s = torch.where(t == 0, torch.ones_like(t), t)
    assert torch.equal(SignCodec().decode(SignCodec().encode(s), n), s)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 15), st.integers(-20, 20), st.integers(0, 300).map(lambda k: 8 * k), st.integers(0, 2**31 - 1))
def test_field_codec_round_trip_any_width(width, lo, n, seed):
    v = torch.randint(lo, lo + 2**width, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    c = FieldCodec(width, lo)
    packed = c.encode(v)
    assert packed.numel() == c.nbytes(n) == width * n // 8
    out = c.decode(packed, n)
    assert out.dtype == (torch.int16 if -2**15 <= lo and lo + 2**width <= 2**15 else torch.int32)
    assert torch.equal(out.to(torch.int32), v)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([SignCodec(), TritCodec(), FieldCodec(3, -4)]), st.integers(1, 8), st.integers(1, 20),
       st.integers(0, 2**31 - 1))
def test_chunks_encode_independently(codec, parts, chunk_units, seed):
    """Encoding a concatenation of ALIGN-multiple chunks = concatenating their encodings
    (what lets the collectives split packed buffers per rank)."""
    n = chunk_units * ALIGN
    vals = [ternary(n, seed + i) for i in range(parts)]
    if isinstance(codec, SignCodec):
        vals = [torch.where(v == 0, torch.ones_like(v), v) for v in vals]
    whole = codec.encode(torch.cat(vals))
    assert torch.equal(whole, torch.cat([codec.encode(v) for v in vals]))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 15, 16, 31])
@pytest.mark.parametrize("vote", ["mavo", "avg"])
@pytest.mark.parametrize("ties", ["zero", "random", "previous"])
@pytest.mark.parametrize("zeros", [False, True])
def test_result_codec_carries_every_possible_code(n, vote, ties, zeros):
    """For each N, every (s, nz) the ranks can produce is decided, encoded and decoded losslessly."""
    rule = VoteRule(vote, n, ties=ties, seed=3)
    gen = torch.Generator().manual_seed(n)
    votes = torch.randint(-1 if zeros else 0, 2, (n, 8 * ALIGN), generator=gen, dtype=torch.int8)
    if not zeros:
        votes = votes * 2 - 1
    s, nz = votes.sum(0, dtype=torch.int16), votes.abs().sum(0, dtype=torch.int16)
    previous = torch.randint(-1, 2, (s.numel(),), generator=gen, dtype=torch.int8)
    codes = rule.decide(s, nz, key=coin_key(3, 0, 0), previous=previous)
    codec = rule.result_codec(zeros)
    assert torch.equal(codec.decode(codec.encode(codes), codes.numel()).to(codes.dtype), codes)
    expected_bits = {("mavo", False): 1.0 if (n % 2 or ties != "zero") else 1.6,
                     ("mavo", True): 1.6,
                     ("avg", False): float(int(np.ceil(np.log2(n + 1))) or 1),
                     ("avg", True): float(int(np.ceil(np.log2(2 * n + 1))))}[(vote, zeros)]
    assert rule.result_bits(zeros) == pytest.approx(expected_bits)


def test_vote_rules_literal():
    s = torch.tensor([3, -1, 0, 0, 2], dtype=torch.int16)
    nz = torch.tensor([3, 3, 2, 0, 4], dtype=torch.int16)
    assert VoteRule("mavo", 4).decide(s, nz).tolist() == [1, -1, 0, 0, 1]
    assert VoteRule("avg", 4).decide(s, nz).tolist() == [3, -1, 0, 0, 2]
    assert VoteRule("avg", 4).delta(torch.tensor([3, -1, 0, 2], dtype=torch.int16), torch.float32).tolist() == \
        [0.75, -0.25, 0.0, 0.5]
    r = VoteRule("mavo", 4, ties="random").decide(s, nz, key=7, start=10)
    assert r[[0, 1, 4]].tolist() == [1, -1, 1]
    assert r[2].item() == tie_coins(7, 12, 1).item()  # a tie takes the shared coin
    assert r[3].item() == 0  # all abstained: no coin, no drift


def test_previous_ties_repeat_the_last_update_and_fall_back_to_the_coin():
    s = torch.tensor([0, 0, 0, 0, 2, -2, 0], dtype=torch.int16)
    nz = torch.tensor([2, 4, 2, 0, 2, 4, 4], dtype=torch.int16)
    # the whole bucket's last codes; this chunk starts at coordinate 10
    previous = torch.zeros(20, dtype=torch.int8)
    previous[10:17] = torch.tensor([1, -1, 0, 1, -1, 1, 0], dtype=torch.int8)
    rule = VoteRule("mavo", 4, ties="previous")
    r = rule.decide(s, nz, key=7, start=10, previous=previous)
    assert r[[0, 1, 3, 4, 5]].tolist() == [1, -1, 0, 1, -1]  # ties repeat; no vote stays 0; majorities win
    assert r[2].item() == tie_coins(7, 12, 1).item() and r[6].item() == tie_coins(7, 16, 1).item()  # last was 0
    # gathered coordinates (a compacted bucket): the previous codes are read at the original positions
    index = torch.tensor([3, 5], dtype=torch.int64)
    previous = torch.tensor([0, 0, 0, -1, 0, 0, 0, 0], dtype=torch.int8)
    r = rule.decide(torch.tensor([0, 0], dtype=torch.int16), None, key=9, index=index, previous=previous)
    assert r.tolist() == [-1, tie_coins(9, 5, 1).item()]
    # no previous codes given: exactly the random rule
    coin = VoteRule("mavo", 4, ties="random")
    assert torch.equal(rule.decide(s, nz, key=7, start=10), coin.decide(s, nz, key=7, start=10))


def test_tie_coins_are_chunk_independent_and_balanced():
    whole = tie_coins(12345, 0, 10_000)
    assert torch.equal(torch.cat([tie_coins(12345, 0, 4000), tie_coins(12345, 4000, 6000)]), whole)
    assert set(whole.tolist()) == {-1, 1}
    assert abs(int(whole.sum())) < 400  # roughly fair: |mean| < 0.04
    assert not torch.equal(tie_coins(12346, 0, 10_000), whole)
    assert coin_key(0, 1, 0) != coin_key(0, 2, 0) != coin_key(1, 1, 0)


@pytest.mark.parametrize("bad, message", [
    (dict(vote="median"), "Unknown vote 'median'"),
    (dict(vote="mavo", ties="up"), "Unknown ties 'up'"),
])
def test_bad_rule(bad, message):
    with pytest.raises(ValueError, match=message):
        VoteRule(world_size=4, **bad)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 200), st.integers(0, 300), st.sampled_from(["int8", "uint8", "bool"]), st.integers(0, 2**31 - 1))
def test_row_sum_counts_like_a_wide_sum(rows, width, kind, seed):
    from dlion.wire import row_sum

    g = torch.Generator().manual_seed(seed)
    if kind == "int8":  # sign votes, the extremes included (all −1 or all +1 in a column)
        x = torch.randint(-1, 2, (rows, width), generator=g, dtype=torch.int8)
        x[:, :1] = -1
    else:
        x = torch.randint(0, 2, (rows, width), generator=g, dtype=torch.uint8)
        x[:, :1] = 1
        x = x.bool() if kind == "bool" else x
    want = [sum(int(x[r, j]) for r in range(rows)) for j in range(width)]
    got = row_sum(x)
    assert got.dtype == torch.int16 and got.tolist() == want


def _coin_by_hand(key, i):
    """The tie coin of (key, coordinate i) in Python integers, the documented contract: bit i mod 32
    of the 32-bit hash of (key, i // 32)."""
    x = ((i >> 5) ^ key) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (x >> 16) ^ x
    return 1 if (x >> (i & 31)) & 1 else -1


def test_tie_coins_equal_the_hash_written_out_on_both_code_paths():
    from dlion.vote import _tie_coins_at_torch, tie_coins_at

    g = torch.Generator().manual_seed(3)
    index = torch.cat([torch.arange(0, 300), torch.randint(0, 2**40, (300,), generator=g),
                       torch.tensor([2**32 - 1, 2**32, 2**32 + 1, 2**31])])
    for key in (0, 1, 0x9E3779B1, coin_key(5, 7, 2), 0xFFFFFFFF):
        want = torch.tensor([_coin_by_hand(key, int(i)) for i in index], dtype=torch.int8)
        assert torch.equal(tie_coins_at(key, index), want)          # CPU: numpy uint32
        assert torch.equal(_tie_coins_at_torch(key, index), want)   # elsewhere: torch int64


@pytest.mark.parametrize("start, n", [(0, 8), (7000, 4000), (2**32 - 16, 40), (13, 27), (40, 5), (2**37 + 3, 100)])
def test_coin_bits_are_the_coins_packed(start, n):
    from dlion.vote import coin_bits

    want = [_coin_by_hand(12345, i) > 0 for i in range(start, start + n)]
    assert np.unpackbits(coin_bits(12345, start, n), bitorder="little")[:n].tolist() == want
