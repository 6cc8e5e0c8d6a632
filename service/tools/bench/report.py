"""What `qkv bench --suite` reports: bench.png and the targets table (targets.md), with the bounds
this machine allows printed under it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["plots", "targets_table"]


def plots(results: dict[str, Any], out: Path) -> None:
    """bench.png: latency by sequence length (mixed) and the seq-64 concurrency sweep against the
    ceiling (ceiling); only when both sections ran. matplotlib is imported here, when plotting."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install '.[plot]'): no PNG plots")
        return
    if "latency_by_seq_len" not in results or "encoder_seq64_sweep" not in results:
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    table = results["latency_by_seq_len"]
    names = list(table)
    for q in ("p50", "p95", "p99"):
        ax[0].plot(names, [table[n][q] for n in names], marker="o", label=q)
    ax[0].set(xlabel="sequence length (tokens)", ylabel="latency (ms)",
              title="g2p_encoder, mixed lengths, concurrency 32")  # fmt: skip
    ax[0].tick_params(axis="x", rotation=45)
    ax[0].legend()
    sweep = results["encoder_seq64_sweep"]
    cs = sorted(sweep, key=int)
    ax[1].plot(cs, [sweep[c]["rps"] for c in cs], marker="o", label="served")
    ax[1].axhline(results["encoder_seq64_c32"]["ceiling"]["best"], color="gray", ls="--", label="onnxruntime ceiling")
    ax[1].set(xlabel="concurrency", ylabel="requests/s", title="g2p_encoder, seq 64", xscale="log")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=110)
    plt.close(fig)


class _Target(NamedTuple):
    """One BENCHMARKS.md target: the results section it reads, what it measures, the target (the check
    is read from it: ">= 0.8" is met by 0.8 and above), the measured figure, and how it is printed."""

    section: str
    what: str
    target: str
    measured: Callable[[dict[str, Any]], float]
    fmt: str = "{:.2f}"


_TARGETS = (
    _Target("encoder_seq64_c32", "g2p_encoder seq 64 c32: served / raw onnxruntime ceiling", ">= 0.8",
            lambda v: v["ratio"]),
    _Target("encoder_mixed", "g2p_encoder mixed 4..256: padded share of computed tokens", "<= 15 %",
            lambda v: 100 * v["length_aware"]["padding_share"], "{:.1f} %"),
    _Target("encoder_mixed", "same: length-aware / pad-to-longest FIFO throughput", ">= 1.5",
            lambda v: v["ratio"]),
    _Target("g2p_c64", "g2p test words c64: words/s batched / batching off", ">= 4",
            lambda v: v["ratio"]),
    _Target("kv_cache", "g2p decode, 20 tokens, batch 32: with kv cache vs without (speed-up)", ">= 2x",
            lambda v: v["speedup"], "{:.2f}x"),
    _Target("g2p_short_p99", "g2p short words p99: continuous / static batching", "<= 0.6",
            lambda v: v["ratio"]),
    _Target("encoder_seq16_c1", "c1 seq 16: p50 served - p50 in-process compute", "<= 1 ms",
            lambda v: v["overhead_ms"], "{:.2f} ms"),
    _Target("overload", "10x overload: p99 time to RESOURCE_EXHAUSTED", "<= 5 ms",
            lambda v: v["refusal_p99_ms"], "{:.2f} ms"),
    _Target("overload", "10x overload: admitted p99 / p99 at 80 % load", "<= 2",
            lambda v: v["ratio"]),
    _Target("metrics_overhead", "metrics recording: requests/s lost (seq 16, c16)", "< 3 %",
            lambda v: 100 * v["overhead"], "{:.1f} %"),
)  # fmt: skip
_COMPARE = {">=": operator.ge, "<=": operator.le, "<": operator.lt}


def _met(x: float, target: str) -> bool:
    """Whether `x` meets a target written ">= 2x", "<= 15 %", "< 3 %": an operator, then a number."""
    op, bound = target.split()[:2]
    return bool(_COMPARE[op](x, float(bound.removesuffix("x"))))


def targets_table(r: dict[str, Any]) -> str:
    """The BENCHMARKS.md table for the sections that ran."""
    rows = ["| what | target | measured | |", "|---|---|---|---|"]
    for t in _TARGETS:
        if t.section in r and "skipped" not in r[t.section]:
            x = t.measured(r[t.section])
            rows.append(f"| {t.what} | {t.target} | {t.fmt.format(x)} | {'met' if _met(x, t.target) else 'NOT met'} |")
    return "\n".join(rows + _bound_notes(r)) + "\n"


def _bound_notes(r: dict[str, Any]) -> list[str]:
    """The lines under the table: what this machine allows at best (the gRPC floor, g2p compute alone,
    a server refusing everything), beam search's ratio, and the short-word p99 round by round."""
    notes: list[str] = []
    c32 = r.get("encoder_seq64_c32", {})
    if "bare_rpc" in c32:
        b = c32["bare_rpc"]
        notes.append(
            f"\nPython gRPC's floor here: a bare ServerLive costs {b['server_cpu_us']:.0f} us of server CPU and "
            f"{b['client_cpu_us']:.0f} us in the load generator (c16); a served seq-64 request cost "
            f"{c32['server_cpu_per_request_ms']:.2f} ms of server CPU against "
            f"{c32['compute_cpu_per_sequence_ms']:.2f} ms of raw compute per sequence. With nothing but that "
            f"floor added, served / ceiling could reach at most "
            f"{c32['ratio_bound_from_bare_rpc']:.2f}."
        )
    bound = r.get("g2p_c64", {}).get("compute_only")
    if bound:
        notes.append(
            f"\ng2p decoding in process, one thread, no server: {bound['words_per_s_batch1']:.0f} words/s a word "
            f"at a time, {bound['words_per_s_batch32']:.0f} with 32 together, so compute alone allows a "
            f"batched / off ratio of {bound['ratio']:.2f}." + _g2p_floor_bound(bound, c32.get("bare_rpc"))
        )
    bare = r.get("overload", {}).get("refusing_all")
    if bare:
        o = r["overload"]
        notes.append(
            f"\nAt 10x ({o['offered_rps']:.0f} requests/s), a server that refuses everything and computes nothing "
            f"has a refusal p99 of {bare['refusal_p99_ms']:.1f} ms, using {bare['server_cpu_share']:.2f} of a core "
            f"while the load generator uses {bare['client_cpu_share']:.2f}: the RPC layer's own bound at that rate."
        )
    beam = r.get("g2p_beam_c16")
    if beam:
        notes.append(
            f"\ng2p beam search ({beam['beam_size']} beams), one word a request, c16: {beam['batched']['rps']:.0f} "
            f"words/s with waiting requests decoded together, {beam['unbatched']['rps']:.0f} one request at a "
            f"time ({beam['ratio']:.2f}x, median of paired rounds)."
        )
    tracing = r.get("tracing_overhead")
    if tracing:
        notes.append(
            f"\nTracing every request (sampling 1.0, OTLP/gRPC to a receiver on this machine), seq 16, c16: "
            f"{tracing['on']['rps']:.0f} requests/s against {tracing['off']['rps']:.0f} with tracing off "
            f"({100 * tracing['overhead']:.1f} % lost, p50 x{tracing['p50_ratio']:.2f}, median of paired rounds); "
            f"{tracing['spans_per_request']:.1f} spans exported per request."
        )
    short = r.get("g2p_short_p99", {})
    if "rounds" in short.get("continuous", {}):
        by_round = {k: ", ".join(f"{x['p99_ms']:.1f}" for x in short[k]["rounds"]) for k in ("continuous", "static")}
        notes.append(
            f"\ng2p short-word p99 by round (ms), continuous: {by_round['continuous']}; static: {by_round['static']}."
        )
    return notes


def _g2p_floor_bound(compute: dict[str, float], floor: dict[str, float] | None) -> str:
    """The batched / off ratio allowed by compute plus the gRPC floor each one-word request pays (server
    and load generator CPU on the same cores): (1/r1 + f) / (1/r32 + f)."""
    if not floor:
        return ""
    f = (floor["server_cpu_us"] + floor["client_cpu_us"]) / 1e6
    ratio = (1 / compute["words_per_s_batch1"] + f) / (1 / compute["words_per_s_batch32"] + f)
    return (f" With the gRPC floor above added to every one-word request ({f * 1e3:.2f} ms of CPU), "
            f"at most {ratio:.2f}.")  # fmt: skip
