"""`qkv bench --text-model`'s own parts, without a model: its texts and its table (the runs themselves are
BENCHMARKS.md's, "Text models")."""

from __future__ import annotations

from service.tools.bench.text_models import mixed_texts, text_model_table


def test_the_texts_are_mixed_lengths_of_real_prose() -> None:
    texts = mixed_texts(100)
    words = sorted(len(t.split()) for t in texts)
    assert len(texts) == 100 and words[0] >= 3 and words[-1] > 150  # sentences up to runs of paragraphs
    assert sum(1 for n in words if n <= 20) >= 30


def test_the_table_gives_each_ratio_against_the_runs_beside_it() -> None:
    runs = [{"rps": r, "p50_ms": p, "p99_ms": 2 * p} for r, p in ((45.0, 20.0), (40.0, 22.0), (50.0, 18.0))]
    result = {
        "ceiling": {"best": "2x1 b4", "texts_per_s": 50.0},
        "c1": [{**x, "in_process_ms": 16.0} for x in runs],
        "c32": [{**x, "ceiling": 50.0} for x in runs],
        "c32_over_ceiling": 0.9,
        "c1_p50_over_single": 1.25,
    }
    table = text_model_table(result)
    assert "| qkv, text in, c32 | 45.0 | 20.00 | 40.00 |" in table
    assert "c32 / ceiling: 0.90; c1 p50 / in-process single call: 1.25" in table
