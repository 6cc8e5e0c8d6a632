"""The paper's parts against hand-computed values."""

import math

import torch

from export.model import (
    MultiHeadAttention,
    PositionalEncoding,
    TransformerConfig,
    make_model,
    scaled_dot_product_attention,
    subsequent_mask,
)


def test_attention_matches_a_hand_computed_example() -> None:
    q = torch.tensor([[[[1.0, 0.0]]]])  # (B=1, H=1, Tq=1, K=2)
    k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]])  # Tk=3
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]]])
    out, w = scaled_dot_product_attention(q, k, v)
    s = 1 / math.sqrt(2)  # scores q.k / sqrt(d_k) = [s, 0, s]
    e = torch.tensor([math.exp(s), 1.0, math.exp(s)])
    expected_w = e / e.sum()
    assert torch.allclose(w[0, 0, 0], expected_w, atol=1e-6)
    assert torch.allclose(out[0, 0, 0], expected_w @ v[0, 0], atol=1e-6)


def test_masked_positions_get_zero_weight_and_rows_sum_to_one() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)[:, None, None, :]
    _, w = scaled_dot_product_attention(q, k, v, mask)
    assert torch.all(w[0, :, :, 3:] == 0)
    assert torch.allclose(w.sum(-1), torch.ones(2, 3, 4), atol=1e-6)


def test_subsequent_mask_is_lower_triangular() -> None:
    m = subsequent_mask(3)
    assert m.tolist() == [[[True, False, False], [True, True, False], [True, True, True]]]


def test_positional_encoding_follows_the_formula() -> None:
    c = TransformerConfig(src_vocab=8, tgt_vocab=8, d_model=6, h=2, dropout=0.0, max_len=10)
    pe = PositionalEncoding(c).pe
    pos, i = 7, 1
    assert math.isclose(pe[pos, 2 * i].item(), math.sin(pos / 10000 ** (2 * i / 6)), rel_tol=1e-5)
    assert math.isclose(pe[pos, 2 * i + 1].item(), math.cos(pos / 10000 ** (2 * i / 6)), rel_tol=1e-5)


def test_multi_head_attention_shapes_and_padding_invariance() -> None:
    torch.manual_seed(0)
    c = TransformerConfig(src_vocab=10, tgt_vocab=12, d_model=16, h=4, d_ff=32, dropout=0.0)
    mha = MultiHeadAttention(c).eval()
    x = torch.randn(1, 3, 16)
    padded = torch.cat([x, torch.randn(1, 2, 16)], dim=1)
    mask = torch.tensor([[True, True, True, False, False]])[:, None, None, :]
    alone = mha(x, x, x)
    with_pad = mha(padded, padded, padded, mask)[:, :3]
    assert alone.shape == (1, 3, 16)
    assert torch.allclose(alone, with_pad, atol=1e-5)


def test_decoder_does_not_look_ahead() -> None:
    torch.manual_seed(0)
    c = TransformerConfig(src_vocab=10, tgt_vocab=12, d_model=16, h=4, d_ff=32, dropout=0.0)
    model = make_model(c).eval()
    src = torch.tensor([[4, 5, 6]])
    tgt = torch.tensor([[1, 4, 5, 6]])
    changed = tgt.clone()
    changed[0, 3] = 7
    a, b = model(src, tgt), model(src, changed)
    assert torch.allclose(a[:, :3], b[:, :3], atol=1e-6)
    assert not torch.allclose(a[:, 3], b[:, 3])
