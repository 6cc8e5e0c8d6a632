"""Open-loop load for the autoscaling simulation (deploy/compose/autoscale.yml): g2p requests at a fixed
rate per step, sent whether or not earlier ones were answered, as independent clients do. Prints one JSON
object: every request's [start, end, final gRPC status, attempts], and the steps as run.

    python deploy/compose/load.py --target 127.0.0.1:8101 --step 8:40 --step 32:90 --step 8:60

Each --step is RATE:SECONDS (requests per second, for that long). A request is retried as a real client
retries (the shipped service.tools.client does the same): on UNAVAILABLE (a replica draining or gone)
with exponential backoff, within the request's deadline; anything else, or UNAVAILABLE past the deadline,
is a failed request. Run it with the repository's virtual environment (grpc and service.protocol).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from a checkout

from service import protocol
from service.tools.client import g2p_outputs, g2p_request

WORDS = ["attention", "transformer", "hello", "world", "sequence", "batch", "docker", "replica"]
BACKOFF_S = (0.05, 1.0)  # first pause, longest pause


def step(text: str) -> tuple[float, float]:
    """RATE:SECONDS -> (rate, seconds)."""
    rate, _, seconds = text.partition(":")
    try:
        out = float(rate), float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a step is RATE:SECONDS, not {text!r}") from None
    if out[0] <= 0 or out[1] <= 0:
        raise argparse.ArgumentTypeError(f"a step's rate and seconds are positive, not {text!r}")
    return out


async def one(stub: Any, word: str, deadline_s: float, lexicon: bool) -> tuple[str, int]:
    """Send one request, retrying UNAVAILABLE until its deadline: (final status, attempts)."""
    end = time.monotonic() + deadline_s
    attempt = 0
    while True:
        attempt += 1
        try:
            left = end - time.monotonic()
            reply = await stub.ModelInfer(g2p_request([word], lexicon=lexicon), timeout=max(left, 0.01))
            g2p_outputs(reply)
            return "OK", attempt
        except grpc.aio.AioRpcError as e:
            pause = min(BACKOFF_S[0] * 2 ** (attempt - 1), BACKOFF_S[1]) * (0.5 + random.random() / 2)
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + pause >= end:
                return e.code().name, attempt
            await asyncio.sleep(pause)


async def run(target: str, steps: list[tuple[float, float]], deadline_s: float, lexicon: bool) -> dict[str, Any]:
    records: list[list[Any]] = []
    ran: list[list[float]] = []
    async with grpc.aio.insecure_channel(target) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = protocol.Stub(channel)
        tasks: set[asyncio.Task[None]] = set()
        sent = 0

        async def record(word: str) -> None:
            start = time.time()
            code, attempts = await one(stub, word, deadline_s, lexicon)
            records.append([round(start, 4), round(time.time(), 4), code, attempts])

        for rate, seconds in steps:
            began, wall = time.monotonic(), time.time()
            k = 0
            while (due := began + k / rate) < began + seconds:  # on schedule, never waiting for answers
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                task = asyncio.create_task(record(WORDS[sent % len(WORDS)]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                k += 1
                sent += 1
            ran.append([rate, round(wall, 4), round(time.time(), 4)])
        if tasks:
            await asyncio.wait(tasks)
    return {"steps": ran, "records": sorted(records)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="host:port of the balancer's gRPC port")
    p.add_argument("--step", type=step, action="append", required=True, help="RATE:SECONDS, repeated")
    p.add_argument("--deadline", type=float, default=30.0, help="seconds a request may take, retries included")
    p.add_argument("--no-lexicon", action="store_true", help="every word through the model, none from its lexicon")
    args = p.parse_args()
    print(json.dumps(asyncio.run(run(args.target, args.step, args.deadline, not args.no_lexicon))))


if __name__ == "__main__":
    main()
