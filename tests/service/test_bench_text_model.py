"""`qkv bench --text-model`'s own parts, without a served model: its texts, their cut, and its table (the
runs themselves are BENCHMARKS.md's, "Text models")."""

from __future__ import annotations

import pytest

from service.tools.bench.text_c1 import STAGES, _stage_means_ms, text_c1_table
from service.tools.bench.text_models import cut_texts, mixed_texts, text_model_table
from tests.service.text_models import minilm_source


def test_the_texts_are_mixed_lengths_of_real_prose() -> None:
    texts = mixed_texts(100)
    words = sorted(len(t.split()) for t in texts)
    assert len(texts) == 100 and words[0] >= 3 and words[-1] > 150  # sentences up to runs of paragraphs
    assert sum(1 for n in words if n <= 20) >= 30


def test_short_texts_are_the_same_texts_cut_to_their_first_words() -> None:
    texts, short = mixed_texts(60), mixed_texts(60, most_words=20)
    assert len(short) == 60 and max(len(t.split()) for t in short) == 20
    for text, cut in zip(texts, short, strict=True):
        assert text.split()[:20] == cut.split()


def test_texts_are_cut_at_a_token_end_so_every_system_runs_the_same_tokens(request: pytest.FixtureRequest) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm_source(request.config.cache) / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    texts = mixed_texts(40)
    cut = cut_texts(texts, tokenizer, 256)
    before = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    after = [len(e.ids) for e in tokenizer.encode_batch(cut)]
    assert max(before) > 256 and max(after) == 256
    for text, short, n, m in zip(texts, cut, before, after, strict=True):
        assert (short == text) == (n <= 256)  # only the long ones are cut, and only as far as needed
        assert text.startswith(short) and m == min(n, 256)


def test_the_table_gives_each_ratio_against_the_runs_beside_it() -> None:
    runs = [{"rps": r, "p50_ms": p, "p99_ms": 2 * p} for r, p in ((45.0, 20.0), (40.0, 22.0), (50.0, 18.0))]
    slow = [{"rps": r, "p50_ms": p, "p99_ms": 2 * p} for r, p in ((15.0, 200.0), (10.0, 220.0), (20.0, 180.0))]
    result = {
        "texts": 256,
        "mean_tokens": 100.0,
        "most_words": 20,
        "single_tokens": 30,
        "ceiling": {"best": "2x1 b4"},
        "c1": [{**x, "in_process_ms": 16.0} for x in runs],
        "c32": [{**x, "ceiling": 50.0, "rows_per_run": 5.0} for x in runs],
        "http_c32": runs,
        "infinity": {"c1": slow, "c32": slow},
        "c32_over_ceiling": 0.9,
        "c1_p50_over_single": 1.25,
        "http_c32_over_infinity": 3.0,
    }
    table = text_model_table(result)
    assert "| in-process ceiling (2x1 b4), beside each c32 run | 50.0 | 5000 | | |" in table
    assert "| qkv, v2 gRPC, text in, c32 | 45.0 | 4500 | 20.00 | 40.00 |" in table
    assert "| qkv, v2 gRPC, text in, c1 | 45.0 | 1350 | 20.00 | 40.00 |" in table  # a 20-word text's tokens
    assert "| infinity-emb (optimum), OpenAI HTTP /embeddings, c32 | 15.0 | 1500 | 200.00 | 400.00 |" in table
    assert "c32 / ceiling: 0.90; c1 p50 / in-process single call: 1.25; mean rows per run at c32: 5.0" in table
    assert "qkv HTTP c32 / infinity-emb c32: 3.00" in table
    assert "texts: 256, 100.0 tokens on average, each at most 20 words" in table
    skipped = {**result, "infinity": {"skipped": "its engine failed"}}
    del skipped["http_c32_over_infinity"]
    assert "infinity-emb not measured: its engine failed" in text_model_table(skipped)


def test_the_c1_table_gives_each_round_s_ratio_and_the_server_s_own_account() -> None:
    before = dict.fromkeys(STAGES, (1.0, 10.0))
    after = {stage: (1.0 + 0.002 * (k + 1) * 100, 110.0) for k, stage in enumerate(STAGES)}
    means = _stage_means_ms(before, after)  # 100 requests more: each stage's mean of them alone
    assert [round(m, 6) for m in means.values()] == [2.0, 4.0, 6.0, 8.0]
    runs = [{"p50_ms": p, "p99_ms": 2 * p, "in_process_ms": 8.0, "server_ms": means} for p in (10.0, 12.0, 9.0)]
    http = [*runs[:2], {**runs[2], "p50_ms": 16.0}]
    result = {"single_tokens": 34, "grpc": runs, "grpc_sync": runs[:1] * 3, "http": http,
              "grpc_p50_over_single": 1.25, "grpc_sync_p50_over_single": 1.25, "http_p50_over_single": 1.5,
              "log": ["the server's choices"]}  # fmt: skip
    table = text_c1_table(result)
    assert "| in-process single call (34 tokens), beside each run | 8.00 | | |" in table
    assert (
        "| qkv, v2 gRPC, text in, c1 (grpc.aio client, as the full run's c1) | 10.00 | 20.00 | 1.25, 1.50, 1.12 |"
        in table
    )
    assert "(synchronous client, as tritonclient.grpc) | 10.00 | 20.00 | 1.25, 1.25, 1.25 |" in table
    assert "| qkv, OpenAI HTTP /v1/embeddings, c1 | 12.00 | 20.00 | 1.25, 1.50, 2.00 |" in table
    assert "| grpc | 2.00 | 4.00 | 6.00 | 8.00 |" in table
    assert "c1 p50 / in-process single call: gRPC 1.25 (sync client 1.25), HTTP 1.50" in table and table.endswith(
        "the server's choices"
    )


def test_infinity_emb_gets_its_own_environment_at_the_repository_s_pins() -> None:
    from service.tools.bench.peers.envs import PEERS, TEXT_PEERS, lock_pin, pins

    wanted = pins("infinity")
    assert "infinity" in TEXT_PEERS and "infinity" not in PEERS  # the text bench's peer, not --peers'
    assert wanted[0] == "infinity-emb[optimum,server]==0.0.78"
    assert "numpy==1.26.4" in wanted  # infinity-emb requires numpy < 2
    for package, lock in (("onnxruntime", "serve"), ("tokenizers", "serve"), ("torch", "hf"), ("optimum", "hf")):
        assert lock_pin(package, lock) in wanted
