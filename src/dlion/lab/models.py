"""Small models for the demo, benchmarks and experiments.

All models are plain ``torch.nn.Module`` objects without batch-norm buffers or
other state outside their parameters, so data-parallel replicas stay identical
when their parameters do. Construction draws only from torch's global RNG, so
``torch.manual_seed(s)`` followed by the same constructor call gives the same
weights.

``DigitsCNN``
    A small CNN for scikit-learn's 8x8 digits.
``MLP1D`` / ``CNN1D``
    An MLP and a small 1-D CNN for MNIST-1D (40 features, 10 classes).
``CharGPT``
    A minimal nanoGPT-style decoder-only transformer for character-level
    language modelling.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["DigitsCNN", "MLP1D", "CNN1D", "CharGPT", "num_params"]


def num_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of distinct parameter elements of ``model`` (tied weights count once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


# ---------------------------------------------------------------------------
# Image and signal classifiers
# ---------------------------------------------------------------------------


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 single-channel digit images.

    Three 3x3 convolutions with ReLU (``1 -> width -> 2*width -> 2*width``
    channels) and two 2x2 max-pools (8x8 -> 4x4 -> 2x2), then a linear
    classifier. About 58 k parameters at the default ``width=32``. With batch
    size 32, five epochs of Adam (lr 3e-3) or Lion (lr 1e-3) reach about 97 %
    test accuracy on the split of :func:`dlion.lab.data.load_digits_split`.

    Input: float tensor of shape ``(N, 1, 8, 8)`` or ``(N, 64)``.
    Output: logits of shape ``(N, num_classes)``.
    """

    def __init__(self, num_classes: int = 10, width: int = 32):
        super().__init__()
        if num_classes < 1 or width < 1:
            raise ValueError(f"num_classes and width must be positive, got {num_classes} and {width}")
        self.features = nn.Sequential(
            nn.Conv2d(1, width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(2 * width * 2 * 2, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = x.reshape(x.shape[0], 1, 8, 8)
        return self.classifier(self.features(x).flatten(1))


class MLP1D(nn.Module):
    """A multilayer perceptron for MNIST-1D.

    ``depth`` hidden layers of ``hidden`` units with ReLU, then a linear
    classifier. About 79 k parameters at the defaults.

    Input: float tensor of shape ``(N, in_features)`` or ``(N, 1, in_features)``.
    Output: logits of shape ``(N, num_classes)``.
    """

    def __init__(self, in_features: int = 40, num_classes: int = 10, hidden: int = 256, depth: int = 2):
        super().__init__()
        if min(in_features, num_classes, hidden, depth) < 1:
            raise ValueError("in_features, num_classes, hidden and depth must be positive")
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x.flatten(1))


class CNN1D(nn.Module):
    """A small 1-D CNN for MNIST-1D, after the reference ``ConvBase`` model.

    Three strided 1-D convolutions with ReLU (lengths 40 -> 19 -> 10 -> 5) and a
    linear classifier. About 5.2 k parameters at the default ``channels=25``;
    30 epochs of Adam (lr 1e-2) or Lion (lr 1e-3) at batch size 100 reach about
    90 % test accuracy (the MLP reaches about 60 %).

    Input: float tensor of shape ``(N, 40)`` or ``(N, 1, 40)``.
    Output: logits of shape ``(N, num_classes)``.
    """

    def __init__(self, in_features: int = 40, num_classes: int = 10, channels: int = 25):
        super().__init__()
        if min(in_features, num_classes, channels) < 1:
            raise ValueError("in_features, num_classes and channels must be positive")
        self.in_features = in_features
        self.features = nn.Sequential(
            nn.Conv1d(1, channels, kernel_size=5, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(channels, channels, kernel_size=3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(channels, channels, kernel_size=3, stride=2, padding=1),
            nn.ReLU(),
        )
        with torch.no_grad():
            out_features = self.features(torch.zeros(1, 1, in_features)).numel()
        self.classifier = nn.Linear(out_features, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = x.reshape(x.shape[0], 1, self.in_features)
        return self.classifier(self.features(x).flatten(1))


# ---------------------------------------------------------------------------
# Character-level GPT (after nanoGPT)
# ---------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection."""

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.dropout = dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The transformer block's feed-forward part: expand 4x, GELU, project back."""

    def __init__(self, n_embd: int, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class CharGPT(nn.Module):
    """A minimal decoder-only transformer for character-level language modelling.

    Token and learned position embeddings, ``n_layer`` pre-LN blocks, a final
    LayerNorm and a language-model head whose weight is tied to the token
    embedding. Weights are initialised as in GPT-2 / nanoGPT (normal, std 0.02;
    residual projections scaled by ``1/sqrt(2 * n_layer)``), so the loss at
    initialisation is close to ``ln(vocab_size)``.

    Args:
        vocab_size: number of distinct tokens.
        block_size: maximum context length.
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``n_embd``.
        n_embd: embedding width.
        dropout: dropout probability (embeddings, attention, residuals).
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
    ):
        super().__init__()
        if min(vocab_size, block_size, n_layer, n_head, n_embd) < 1:
            raise ValueError("vocab_size, block_size, n_layer, n_head and n_embd must be positive")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Compute next-token logits and, if ``targets`` is given, the mean cross-entropy.

        Args:
            idx: int64 token ids of shape ``(B, T)`` with ``T <= block_size``.
            targets: optional int64 next-token ids of shape ``(B, T)``.

        Returns:
            ``(logits, loss)``: logits of shape ``(B, T, vocab_size)`` and a scalar
            loss, or ``None`` when no targets are given.
        """
        B, T = idx.shape
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Extend ``idx`` (shape ``(B, T)``) by sampling ``max_new_tokens`` tokens.

        The context is cropped to the last ``block_size`` tokens at each step.
        ``top_k`` keeps only the ``k`` most likely tokens; ``generator`` makes
        sampling reproducible.
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.block_size :])
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            next_idx = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, next_idx), dim=1)
        return idx
