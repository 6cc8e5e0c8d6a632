"""Load for the compose tests, run in a container on the stack's network with the qkv image's
Python (grpc and service.tools.client are there). Threads send one-word g2p requests for a while; the
script prints one JSON object: every request's start, end, status and message.

    python stack_load.py --target dns:///qkv:8001 --seconds 10 --threads 4 [--retry] [--round-robin] [--until-refused]

Without --retry each request is sent once and recorded as the server answered it; with --retry it
goes through the shipped client, which retries UNAVAILABLE with backoff within a 30 s deadline. With
--until-refused a thread stops at its first UNAVAILABLE, as a client told the server is going away does:
the server's drain then ends with its clients, whatever the machine's speed.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import grpc

from service import protocol
from service.tools.client import Client, g2p_outputs, g2p_request

WORDS = ["attention", "transformer", "hello", "world", "sequence", "batch", "docker", "replica"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--retry", action="store_true")
    p.add_argument("--round-robin", action="store_true")
    p.add_argument("--until-refused", action="store_true")
    args = p.parse_args()

    client = Client(args.target, timeout=30, load_balancing="round_robin" if args.round_robin else None)
    grpc.channel_ready_future(client.channel).result(timeout=30)
    once = protocol.Stub(client.channel)
    records: list[list[Any]] = []
    answers: dict[str, str] = {}
    lock = threading.Lock()
    end = time.time() + args.seconds

    def worker(k: int) -> None:
        i = k
        while time.time() < end:
            word = WORDS[i % len(WORDS)]
            i += args.threads
            start = time.time()
            code, details, phonemes = "OK", "", ""
            try:
                if args.retry:
                    phonemes = client.g2p([word])[0]
                else:
                    phonemes = g2p_outputs(once.ModelInfer(g2p_request([word]), timeout=30))["PHONEMES"][0]
            except grpc.RpcError as e:
                code, details = e.code().name, (e.details() or "")[:200]
            with lock:
                if code == "OK" and answers.setdefault(word, phonemes) != phonemes:
                    code, details = "WRONG", f"{word}: {phonemes} after {answers[word]}"
                records.append([round(start, 4), round(time.time(), 4), code, details])
            if args.until_refused and code == "UNAVAILABLE":
                return

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    print(json.dumps({"records": records, "answers": answers}))


if __name__ == "__main__":
    main()
