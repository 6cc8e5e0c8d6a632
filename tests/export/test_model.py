"""The paper's parts against hand-computed values."""

import math

import torch

from export.model import (
    DecoderStep,
    EncoderGraph,
    MultiHeadAttention,
    PositionalEncoding,
    TransformerConfig,
    cached_attention,
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


def test_cached_attention_is_attention_over_the_cache_and_the_new_token() -> None:
    torch.manual_seed(0)
    q, k_new, v_new = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8)
    cache_k, cache_v = torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    real = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0]], dtype=torch.bool)  # the rest: stale slots
    out = cached_attention(q, cache_k, cache_v, k_new, v_new, real[:, None, None, :])
    for b in range(2):
        keys = torch.cat([cache_k[b : b + 1, :, real[b]], k_new[b : b + 1]], dim=2)
        values = torch.cat([cache_v[b : b + 1, :, real[b]], v_new[b : b + 1]], dim=2)
        expected, _ = scaled_dot_product_attention(q[b : b + 1], keys, values)
        assert torch.allclose(out[b : b + 1], expected, atol=1e-6)


def test_decoding_step_by_step_with_the_cache_equals_the_teacher_forced_model() -> None:
    """DecoderStep, one token at a time into a cache with spare slots, against the whole-sequence
    forward pass of the paper's model (Figure 1): the same log-probabilities at every position."""
    torch.manual_seed(0)
    c = TransformerConfig(src_vocab=10, tgt_vocab=12, d_model=16, h=4, n_decoder=2, d_ff=32, dropout=0.0)
    model = make_model(c).eval()
    src, tgt = torch.tensor([[4, 5, 6, 7], [8, 9, 0, 0]]), torch.tensor([[1, 4, 5, 6, 7], [1, 9, 8, 4, 5]])
    with torch.no_grad():
        expected = model(src, tgt).log_softmax(-1)  # (B, T, V)
        _, cross_k, cross_v = EncoderGraph(model)(src, (src != 0).long())
        step = DecoderStep(model)
        cache_k, cache_v = torch.randn(2, 2, 4, 8, 4), torch.randn(2, 2, 4, 8, 4)  # (L, B, H, C, K), stale values
        cache_mask = torch.zeros(2, 8, dtype=torch.int64)
        for t in range(tgt.size(1)):
            per_layer = [a[i] for i in range(2) for a in (cache_k, cache_v, cross_k, cross_v)]
            log_probs, new_k, new_v, _ = step(tgt[:, t], torch.full((2,), t), cache_mask, (src != 0).long(), *per_layer)
            assert torch.allclose(log_probs, expected[:, t], atol=1e-5), t
            cache_k[:, :, :, t], cache_v[:, :, :, t], cache_mask[:, t] = new_k, new_v, 1
