"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), built from its parts.

Shape legend used in the comments:
    B  batch             S  source length (graphemes)   T  target length (phonemes)
    H  heads (h)         D  d_model                     K  d_k = d_model / h
    L  layers            V  vocabulary size

Departures from the paper, each for a reason:
- Pre-norm residual blocks (x + sublayer(norm(x))) with a final norm, as in the Annotated
  Transformer: trains stably with a short warm-up on a small CPU budget.
- The target embedding and the generator share one weight matrix (Section 3.4 ties all three;
  source and target vocabularies differ here, so only the target side is tied).
- Masks are boolean, True where attention is allowed; masked scores get -1e9 rather than -inf
  so that a fully padded row stays finite.

The incremental pieces at the bottom (`EncoderGraph`, `DecoderStep`) are the same weights
rearranged for inference: the encoder also emits every decoder layer's cross-attention keys and
values (computed once per word), and one decoder step extends a key/value cache.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Protocol, TypeVar

import torch
from torch import Tensor, nn

__all__ = [
    "Decoder",
    "DecoderLayer",
    "DecoderStep",
    "Encoder",
    "EncoderGraph",
    "EncoderLayer",
    "MultiHeadAttention",
    "PositionalEncoding",
    "PositionwiseFeedForward",
    "SublayerConnection",
    "Transformer",
    "TransformerConfig",
    "cached_attention",
    "make_model",
    "scaled_dot_product_attention",
    "subsequent_mask",
]

NEG_INF = -1e9

M = TypeVar("M", bound=nn.Module, covariant=True)


class Layers(Protocol[M]):
    """An nn.ModuleList seen as the layers it holds (torch types its items as plain Modules)."""

    def __iter__(self) -> Iterator[M]: ...
    def __getitem__(self, index: int) -> M: ...


@dataclass(frozen=True)
class TransformerConfig:
    """Every size of the model. The paper's base model is d_model=512, h=8, N=6, d_ff=2048."""

    src_vocab: int
    tgt_vocab: int
    d_model: int = 256
    h: int = 4
    n_encoder: int = 3
    n_decoder: int = 3
    d_ff: int = 1024
    dropout: float = 0.1
    max_len: int = 64  # longest sequence the positional table covers
    pad_id: int = 0

    @property
    def d_k(self) -> int:
        return self.d_model // self.h

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout: nn.Module | None = None
) -> tuple[Tensor, Tensor]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V  (Section 3.2.1, Equation 1).

    q: (B, H, Tq, K), k and v: (B, H, Tk, K), mask broadcastable to (B, H, Tq, Tk), True = keep.
    Returns the output (B, H, Tq, K) and the weights (B, H, Tq, Tk) the pictures are drawn from.
    """
    d_k = q.size(-1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)  # (B, H, Tq, K) x (B, H, K, Tk) -> (B, H, Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF)
    weights = scores.softmax(dim=-1)
    attended = dropout(weights) if dropout is not None else weights
    return attended @ v, weights  # (B, H, Tq, Tk) x (B, H, Tk, K) -> (B, H, Tq, K)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O  (Section 3.2.2)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.h, self.d_k = config.h, config.d_k
        self.w_q = nn.Linear(config.d_model, config.d_model)
        self.w_k = nn.Linear(config.d_model, config.d_model)
        self.w_v = nn.Linear(config.d_model, config.d_model)
        self.w_o = nn.Linear(config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.weights: Tensor | None = None  # last attention weights, for inspection

    def split_heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.h, self.d_k).transpose(1, 2)  # (B, T, D) -> (B, H, T, K)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of `memory` (B, Tk, D), each (B, H, Tk, K): cacheable."""
        return self.split_heads(self.w_k(memory)), self.split_heads(self.w_v(memory))

    def attend(self, query: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Steps 1-4 with the keys and values already projected."""
        q = self.split_heads(self.w_q(query))  # 1. project the queries: (B, Tq, D) -> (B, H, Tq, K)
        x, self.weights = scaled_dot_product_attention(q, k, v, mask, self.dropout)  # 2. attend per head
        b, _, tq, _ = x.shape
        x = x.transpose(1, 2).reshape(b, tq, self.h * self.d_k)  # 3. concat: (B, H, Tq, K) -> (B, Tq, D)
        return self.w_o(x)  # 4. final linear W^O

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None) -> Tensor:
        k = self.split_heads(self.w_k(key))
        v = self.split_heads(self.w_v(value))
        return self.attend(query, k, v, mask)


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2  (Section 3.3)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.w_1 = nn.Linear(config.d_model, config.d_ff)
        self.w_2 = nn.Linear(config.d_ff, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.dropout(self.w_1(x).relu()))


class PositionalEncoding(nn.Module):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(...)  (Section 3.5)."""

    pe: Tensor  # (max_len, D), a buffer

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        position = torch.arange(config.max_len).unsqueeze(1)  # (max_len, 1)
        div_term = torch.exp(torch.arange(0, config.d_model, 2) * (-math.log(10000.0) / config.d_model))
        pe = torch.zeros(config.max_len, config.d_model)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe, persistent=False)  # (max_len, D)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """x: (B, T, D); positions (B, T) when the rows are not all at 0..T-1 (cached decoding)."""
        pe = self.pe[: x.size(1)] if positions is None else self.pe[positions]
        return self.dropout(x + pe)


class SublayerConnection(nn.Module):
    """Residual + layer norm around a sublayer: x + Dropout(Sublayer(LayerNorm(x))) (pre-norm)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, sublayer: nn.Module) -> Tensor:
        return x + self.dropout(sublayer(self.norm(x)))


class Embeddings(nn.Module):
    """Token embeddings scaled by sqrt(d_model)  (Section 3.4)."""

    def __init__(self, vocab: int, config: TransformerConfig) -> None:
        super().__init__()
        self.lut = nn.Embedding(vocab, config.d_model, padding_idx=config.pad_id)
        self.scale = math.sqrt(config.d_model)

    def forward(self, ids: Tensor) -> Tensor:
        return self.lut(ids) * self.scale


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each in a residual block  (Figure 1, left)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(config)
        self.feed_forward = PositionwiseFeedForward(config)
        self.sublayer = nn.ModuleList([SublayerConnection(config) for _ in range(2)])

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = self.sublayer[0](x, lambda y: self.self_attn(y, y, y, mask))
        return self.sublayer[1](x, self.feed_forward)


class Encoder(nn.Module):
    """A stack of N encoder layers with a final norm."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([EncoderLayer(config) for _ in range(config.n_encoder)])
        self.norm = nn.LayerNorm(config.d_model)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention over the memory, feed-forward  (Figure 1, right)."""

    sublayer: Layers[SublayerConnection]  # DecoderStep reads their norms

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(config)
        self.src_attn = MultiHeadAttention(config)
        self.feed_forward = PositionwiseFeedForward(config)
        self.sublayer = nn.ModuleList([SublayerConnection(config) for _ in range(3)])  # type: ignore[assignment]

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor, tgt_mask: Tensor) -> Tensor:
        x = self.sublayer[0](x, lambda y: self.self_attn(y, y, y, tgt_mask))
        x = self.sublayer[1](x, lambda y: self.src_attn(y, memory, memory, src_mask))
        return self.sublayer[2](x, self.feed_forward)


class Decoder(nn.Module):
    """A stack of N decoder layers with a final norm."""

    layers: Layers[DecoderLayer]  # EncoderGraph and DecoderStep read their parts

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.n_decoder)])  # type: ignore[assignment]
        self.norm = nn.LayerNorm(config.d_model)

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor, tgt_mask: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.norm(x)


def subsequent_mask(size: int, device: torch.device | None = None) -> Tensor:
    """(1, T, T) lower-triangular: position i may attend to positions <= i."""
    return torch.ones(size, size, dtype=torch.bool, device=device).tril().unsqueeze(0)


class Transformer(nn.Module):
    """Encoder-decoder with embeddings, positional encodings and a generator  (Figure 1)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.src_embed = Embeddings(config.src_vocab, config)
        self.tgt_embed = Embeddings(config.tgt_vocab, config)
        self.src_position = PositionalEncoding(config)
        self.tgt_position = PositionalEncoding(config)
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.generator = nn.Linear(config.d_model, config.tgt_vocab)
        self.generator.weight = self.tgt_embed.lut.weight  # tied (Section 3.4)

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        """src (B, S) ids, src_mask (B, 1, 1, S) -> memory (B, S, D)."""
        return self.encoder(self.src_position(self.src_embed(src)), src_mask)

    def decode(self, memory: Tensor, src_mask: Tensor, tgt: Tensor, tgt_mask: Tensor) -> Tensor:
        """tgt (B, T) ids -> decoder states (B, T, D)."""
        return self.decoder(self.tgt_position(self.tgt_embed(tgt)), memory, src_mask, tgt_mask)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """Teacher-forced logits (B, T, V) for target inputs `tgt` (B, T)."""
        pad = self.config.pad_id
        src_mask = (src != pad)[:, None, None, :]  # (B, 1, 1, S)
        tgt_mask = (tgt != pad)[:, None, None, :] & subsequent_mask(tgt.size(1), tgt.device)[:, None]  # (B, 1, T, T)
        memory = self.encode(src, src_mask)
        return self.generator(self.decode(memory, src_mask, tgt, tgt_mask))


def make_model(config: TransformerConfig) -> Transformer:
    """Build the model with Glorot-uniform weights, as the reference implementation does."""
    model = Transformer(config)
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    return model


class EncoderGraph(nn.Module):
    """Inference encoder: ids -> memory and every decoder layer's cross-attention keys/values.

    Outputs memory (B, S, D), cross_keys and cross_values (L, B, H, S, K).
    """

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        src_mask = (attention_mask != 0)[:, None, None, :]  # (B, 1, 1, S)
        memory = self.model.encode(input_ids, src_mask)
        kv = [layer.src_attn.project_kv(memory) for layer in self.model.decoder.layers]
        cross_keys = torch.stack([k for k, _ in kv])  # L x (B, H, S, K) -> (L, B, H, S, K)
        cross_values = torch.stack([v for _, v in kv])
        return memory, cross_keys, cross_values


def cached_attention(
    q: Tensor, cache_k: Tensor, cache_v: Tensor, k_new: Tensor, v_new: Tensor, keep_cache: Tensor
) -> Tensor:
    """Equation 1 for one new query over a key/value cache plus the new token's own key and value.

    The same as concatenating the cache and the new token and attending (Section 3.2.1), without the
    concatenation: that would copy the whole cache every step. q, k_new, v_new: (B, H, 1, K); cache_k,
    cache_v: (B, H, C, K); keep_cache (B, 1, 1, C), True where a cache slot is real (the new token always is).
    """
    d_k = q.size(-1)
    to_cache = q @ cache_k.transpose(-2, -1)  # (B, H, 1, K) x (B, H, K, C) -> (B, H, 1, C)
    to_self = (q * k_new).sum(-1, keepdim=True)  # (B, H, 1, 1)
    scores = torch.cat([to_cache, to_self], dim=-1) / math.sqrt(d_k)  # (B, H, 1, C + 1)
    keep = torch.cat([keep_cache, torch.ones_like(keep_cache[..., :1])], dim=-1)
    weights = scores.masked_fill(~keep, NEG_INF).softmax(dim=-1)
    c = cache_k.size(2)
    return weights[..., :c] @ cache_v + weights[..., c:] * v_new  # (B, H, 1, C) x (B, H, C, K) -> (B, H, 1, K)


class DecoderStep(nn.Module):
    """One decoder step: every row takes one new token, each at its own position.

    A row is a (B, D) vector here, not a (B, 1, D) sequence, so that each linear layer is one
    matrix product with its bias (a Gemm in ONNX). The self-attention cache is the caller's: it is
    read in place (one input per layer, so no slicing copies it either) and the step returns only
    this token's keys and values, which the caller writes into the cache's next free slot.

    Inputs:  tokens (B,), positions (B,), cache_mask (B, C) 1 where a cache slot is real,
             memory_mask (B, S), then for each decoder layer i: cache_keys_i, cache_values_i
             (B, H, C, K), cross_keys_i, cross_values_i (B, H, S, K).
    Outputs: log_probs (B, V), new_keys/new_values (L, B, H, K), and the last layer's cross-attention
             averaged over heads (B, S).
    """

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, tokens: Tensor, positions: Tensor, cache_mask: Tensor, memory_mask: Tensor, *per_layer: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        m = self.model
        b, h, d_k = tokens.size(0), m.config.h, m.config.d_k
        x = m.tgt_embed(tokens) + m.tgt_position.pe[positions]  # (B, D)
        keep_cache = (cache_mask != 0)[:, None, None, :]  # (B, 1, 1, C)
        keep_src = (memory_mask != 0)[:, None, None, :]  # (B, 1, 1, S)

        def heads(y: Tensor) -> Tensor:
            return y.view(b, h, 1, d_k)  # (B, D) -> (B, H, 1, K)

        new_k, new_v = [], []
        cross = x.new_zeros(())
        for i, layer in enumerate(m.decoder.layers):
            cache_k, cache_v, cross_k, cross_v = per_layer[4 * i : 4 * i + 4]
            y = layer.sublayer[0].norm(x)
            a = layer.self_attn
            k, v = heads(a.w_k(y)), heads(a.w_v(y))
            new_k.append(k[:, :, 0])
            new_v.append(v[:, :, 0])
            x = x + a.w_o(cached_attention(heads(a.w_q(y)), cache_k, cache_v, k, v, keep_cache).reshape(b, -1))
            y = layer.sublayer[1].norm(x)
            a = layer.src_attn
            attended, cross = scaled_dot_product_attention(heads(a.w_q(y)), cross_k, cross_v, keep_src)
            x = x + a.w_o(attended.reshape(b, -1))
            x = x + layer.feed_forward(layer.sublayer[2].norm(x))
        logits = m.generator(m.decoder.norm(x))  # (B, D) -> (B, V)
        attention = cross.mean(dim=1)[:, 0]  # (B, H, 1, S) -> (B, S)
        return logits.log_softmax(dim=-1), torch.stack(new_k), torch.stack(new_v), attention
