"""Attacks on what the server keeps for its clients: shared memory objects and regions, and sequences.

As in tests/service/test_attacks.py, each runs under the probe (a one-word g2p request and a health check
every 50 ms), asserts its outcome, no failed probe and RSS back within 10 %, and records its figures in the
run's summary, section "attacks". The server runs with bearer tokens, --isolate-tokens and --token-share
0.5, a key prefix, and small bounds: 8 shared memory regions, 8 live sequences of the stateful model.

A local user's attack needs a second user: the tests run as root, so the attacker runs as uid 65534
(nobody), a Python process of its own (skipped where the tests are not root, or no interpreter that user may
run imports tritonclient).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as g
import tritonclient.http as h
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from service.tools.bench.servers import variant
from tests.conftest import MODELS, RunningServer, start_server, stop_server
from tests.service.test_attacks import _attack, _still_serves
from tests.service.test_sequence_server import sequence_models
from tests.service.test_shared_memory import SIZE, X0, X1, _simple

NOBODY = 65534
TOKENS = ("alpha", "bravo", "greedy", "victim", "probe")
MAX_REGIONS = 8
MAX_SEQUENCES = 8
SEQUENCE_MODEL = "simple_string_dyna_sequence"  # a running sum kept as implicit state
PREFIX = "qkv_test_"  # --shared-memory-key-prefix
SECRET = bytes(range(100, 188))  # 88 bytes, root's alone


def _key(name: str) -> str:
    return f"/{PREFIX}{os.getpid()}_{name}"


def _auth(token: str) -> dict[str, str]:
    """A fresh dict each call: tritonclient's HTTP client adds its own headers to the one it is given."""
    return {"authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    scratch = tmp_path_factory.mktemp("attacks-state")
    models = variant(MODELS, scratch / "models", {})
    _simple(models / "simple")
    sequence_models(scratch / "sequences")
    config = json.loads((scratch / "sequences" / SEQUENCE_MODEL / "config.json").read_text())
    config["sequence_batching"]["max_sequences"] = MAX_SEQUENCES
    config["sequence_batching"]["max_sequence_idle_microseconds"] = 600_000_000  # live until each test ends it
    (scratch / "sequences" / SEQUENCE_MODEL).rename(models / SEQUENCE_MODEL)
    (models / SEQUENCE_MODEL / "config.json").write_text(json.dumps(config))
    (scratch / "tokens").write_text("\n".join(TOKENS) + "\n")
    args = ["--model-repository", str(models), "--auth-token-file", str(scratch / "tokens"), "--isolate-tokens"]
    args += ["--token-share", "0.5", "--shared-memory-max-regions", str(MAX_REGIONS)]
    args += ["--shared-memory-key-prefix", PREFIX]
    s = start_server(args, scratch / "server.log")
    yield s
    stop_server(s)
    assert "Traceback" not in s.output()


def _attack_as(served: RunningServer, name: str, send: Callable[[], tuple[str, str]]) -> tuple[str, str]:
    """`send` under the probe (which sends the probe's token), its common decisions asserted."""
    outcome = _attack(served, name, send, metadata=(("authorization", "Bearer probe"),))
    _still_serves(served, metadata=(("authorization", "Bearer probe"),))
    return outcome.code, outcome.details


def _status(call: Callable[[], Any]) -> str:
    """OK, or the refusal's status name (gRPC's, or HTTP's code) and message."""
    try:
        call()
        return "OK"
    except InferenceServerException as e:
        return f"{str(e.status()).removeprefix('StatusCode.')}: {e.message()}"


# --- a local user and objects it cannot open ----------------------------------------------------------------

# Run as uid 65534: once imported (it says "ready" and waits for a line, so that the probe times the attack,
# not Python's start), registers root's objects and its own, and uses them, over gRPC and HTTP; prints what
# each call answered, as JSON.
NOBODY_CLIENT = """
import json, sys
import numpy as np
import tritonclient.grpc as g, tritonclient.http as h
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

url, http_url, secret, readable, own, size = sys.argv[1:7]
size = int(size)
headers = {"authorization": "Bearer alpha"}
x0, x1 = np.arange(16, dtype=np.int32).reshape(1, 16), np.full((1, 16), 3, dtype=np.int32)
grpc_client, http_client = g.InferenceServerClient(url), h.InferenceServerClient(http_url)
said = {}
print("ready", flush=True)
sys.stdin.readline()

def status(name, call):
    try:
        result = call()
        said[name] = "OK"
        return result
    except InferenceServerException as e:
        said[name] = str(e.status()).removeprefix("StatusCode.") + ": " + str(e.message())

def infer(region, output=False):
    inputs = [g.InferInput("INPUT0", [1, 16], "INT32"), g.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[1].set_data_from_numpy(x1)
    outputs = [g.InferRequestedOutput("OUTPUT0")]
    if output:
        inputs[0].set_data_from_numpy(x0)
        outputs[0].set_shared_memory(region, size)
    else:
        inputs[0].set_shared_memory(region, size)
    return grpc_client.infer("simple", inputs, outputs=outputs, headers=headers)

def register(client, name, key, byte_size):
    return lambda: client.register_system_shared_memory(name, key, byte_size, headers=headers)

for via, client in (("grpc", grpc_client), ("http", http_client)):
    status(f"register secret {via}", register(client, "secret", secret, size))
status("secret as input", lambda: infer("secret"))
status("secret as output", lambda: infer("secret", output=True))
status("root's region as input", lambda: infer("rootsecret"))
status("root's region as output", lambda: infer("rootsecret", output=True))
status("register readable", register(grpc_client, "readable", readable, size))
status("readable as output", lambda: infer("readable", output=True))
r = status("readable as input", lambda: infer("readable"))
said["readable sum"] = r.as_numpy("OUTPUT0").tolist() if r is not None else None
handle = shm.create_shared_memory_region("own", own, 2 * size)
shm.set_shared_memory_region(handle, [x0])
status("register own", register(grpc_client, "own", own, 2 * size))
status("own as input", lambda: infer("own"))
said["own sum"] = infer("own").as_numpy("OUTPUT0").tolist()
infer("own", output=True)  # OUTPUT0 into the region: its first 64 bytes
said["own written"] = shm.get_contents_as_numpy(handle, np.int32, [1, 16]).tolist()
for name in ("readable", "own"):
    grpc_client.unregister_system_shared_memory(name, headers=headers)
shm.destroy_shared_memory_region(handle)
print(json.dumps(said))
"""


def _as_nobody(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", capture_output=True, text=True, **kwargs
    )


def _started_as_nobody(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    pipe = subprocess.PIPE
    return subprocess.Popen(
        args,
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        cwd="/",
        stdin=pipe,
        stdout=pipe,
        stderr=pipe,
        text=True,
        env=env,
    )


def _nobody_python() -> tuple[str, dict[str, str]]:
    """An interpreter uid 65534 may run that imports tritonclient (this one, or the system's with this one's
    packages), and its environment; skipped where there is none, or the tests are not root."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("a second local user needs the tests to run as root on Linux")
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(site)}
    probe = "import numpy, tritonclient.grpc, tritonclient.http, tritonclient.utils.shared_memory"
    for python in (sys.executable, "/usr/bin/python3"):
        try:
            if _as_nobody([python, "-c", probe], env=env, timeout=60).returncode == 0:
                return python, env
        except OSError:  # not there, or not the user's to run (a home directory it may not enter)
            continue
    pytest.skip("no Python that uid 65534 may run imports tritonclient here")


def _root_object(name: str, data: bytes, mode: int) -> Path:
    path = Path("/dev/shm") / _key(name)[1:]
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    try:
        os.fchmod(fd, mode)  # whatever the umask
        os.write(fd, data)
    finally:
        os.close(fd)
    return path


def _opens(pid: int, path: Path) -> int:
    """How many of the server's file descriptors are `path`."""
    fds = Path(f"/proc/{pid}/fd")
    return sum(1 for fd in fds.iterdir() if os.readlink(fd) in (str(path), f"{path} (deleted)"))


def test_a_local_user_reaches_no_object_it_cannot_open_itself(served: RunningServer) -> None:
    """uid 65534 names root's 0600 object (88 secret bytes): refused on gRPC and HTTP, never opened for it,
    not a byte read or written (before: all 88 read through an error message, 768 written); names root's
    region of that object: refused too. Root's 0644 object it may read, not write: as an input it works, as
    an output it is refused. Its own object works both ways."""
    python, env = _nobody_python()
    secret = _root_object("secret", SECRET, 0o600)
    readable = _root_object("readable", X0.tobytes(), 0o644)
    own = _key("own")
    args = [python, "-c", NOBODY_CLIENT, served.url, served.http_url, _key("secret"), _key("readable"), own]
    client = _started_as_nobody([*args, str(SIZE)], env)
    root = g.InferenceServerClient(served.url)
    root.register_system_shared_memory("rootsecret", _key("secret"), SIZE, headers=_auth("alpha"))  # root's own
    try:
        assert client.stdout is not None and client.stdout.readline() == "ready\n", client.communicate(timeout=60)

        def send() -> tuple[str, str]:
            out, err = client.communicate("go\n", timeout=120)
            assert client.returncode == 0, err[-3000:]
            said = json.loads(out)
            return said["register secret grpc"].split(":")[0], json.dumps(said)

        code, details = _attack_as(served, "shared memory: a local user registers root's 0600 object", send)
        said = json.loads(details)
        assert code == "PERMISSION_DENIED"
        for what in ("register secret grpc", "register secret http"):
            assert "uid 65534 may not open" in said[what] and _key("secret") in said[what], said[what]
            assert "mode 0600" in said[what], said[what]
        assert said["register secret http"].startswith("403"), said
        for what in ("secret as input", "secret as output"):  # never registered: there is no such region
            assert said[what].startswith("NOT_FOUND") and "'secret'" in said[what], said[what]
        for what in ("root's region as input", "root's region as output"):  # root's region, named: its mode holds
            assert said[what].startswith("PERMISSION_DENIED") and "uid 65534 may not open" in said[what], said[what]
        assert said["register readable"] == "OK"
        assert said["readable as output"].startswith("PERMISSION_DENIED"), said
        assert "may not be written" in said["readable as output"] and "'readable'" in said["readable as output"]
        assert said["readable as input"] == "OK" and said["readable sum"] == (X0 + X1).tolist()
        assert said["register own"] == said["own as input"] == "OK"
        assert said["own sum"] == (X0 + X1).tolist() and said["own written"] == (X0 + X1).tolist()
        # not a byte read or written: root's objects are as they were, and the server held the secret open only
        # for root's own region
        root.unregister_system_shared_memory("rootsecret", headers=_auth("alpha"))
        assert secret.read_bytes() == SECRET and readable.read_bytes() == X0.tobytes()
        assert _opens(served.process.pid, secret) == 0
    finally:
        root.unregister_system_shared_memory(headers=_auth("alpha"))
        if client.poll() is None:
            client.kill()
            client.wait()
        secret.unlink()
        readable.unlink()
        Path("/dev/shm", own[1:]).unlink(missing_ok=True)


def test_a_key_outside_the_operators_prefix_is_refused(served: RunningServer) -> None:
    client = g.InferenceServerClient(served.url)
    handle = shm.create_shared_memory_region("elsewhere", f"/qkv_other_{os.getpid()}", SIZE)
    try:
        said = _status(
            lambda: client.register_system_shared_memory(
                "elsewhere", f"/qkv_other_{os.getpid()}", SIZE, headers=_auth("alpha")
            )
        )
        assert said.startswith("PERMISSION_DENIED") and "--shared-memory-key-prefix" in said, said
    finally:
        shm.destroy_shared_memory_region(handle)


# --- one token against another's regions and sequences ------------------------------------------------------


def test_another_tokens_regions_are_not_found(served: RunningServer) -> None:
    """Token B on token A's region (before: B read, wrote and unregistered it): every call NOT_FOUND, while
    B's own region of the same name is B's, and A's region is as A left it."""
    client, http = g.InferenceServerClient(served.url), h.InferenceServerClient(served.http_url)
    handle = shm.create_shared_memory_region("mine", _key("mine"), 2 * SIZE)
    shm.set_shared_memory_region(handle, [X0])
    try:
        client.register_system_shared_memory("mine", _key("mine"), 2 * SIZE, headers=_auth("alpha"))
        said: dict[str, str] = {}

        def infer(output: bool) -> Any:
            inputs = [g.InferInput("INPUT0", [1, 16], "INT32"), g.InferInput("INPUT1", [1, 16], "INT32")]
            inputs[1].set_data_from_numpy(X1)
            outputs = [g.InferRequestedOutput("OUTPUT0")]
            if output:
                inputs[0].set_data_from_numpy(X0)
                outputs[0].set_shared_memory("mine", SIZE, offset=SIZE)
            else:
                inputs[0].set_shared_memory("mine", SIZE)
            return client.infer("simple", inputs, outputs=outputs, headers=_auth("bravo"))

        def send() -> tuple[str, str]:
            b = _auth("bravo")
            said["status"] = _status(lambda: client.get_system_shared_memory_status("mine", headers=b))
            said["read"] = _status(lambda: infer(output=False))
            said["write"] = _status(lambda: infer(output=True))
            said["unregister"] = _status(lambda: client.unregister_system_shared_memory("mine", headers=b))
            said["http status"] = _status(lambda: http.get_system_shared_memory_status("mine", headers=_auth("bravo")))
            said["http unregister"] = _status(
                lambda: http.unregister_system_shared_memory("mine", headers=_auth("bravo"))
            )
            listed = client.get_system_shared_memory_status(headers=b, as_json=True)
            said["listed"] = json.dumps(listed.get("regions", {}))
            return said["read"].split(":")[0], json.dumps(said)

        code, _ = _attack_as(served, "shared memory: token B on token A's region (isolation on)", send)
        assert code == "NOT_FOUND"
        for what in ("status", "read", "write", "unregister", "http status", "http unregister"):
            assert said[what].startswith(("NOT_FOUND", "404")) and "'mine'" in said[what], (what, said[what])
        assert said["listed"] == "{}"
        assert list(client.get_system_shared_memory_status(headers=_auth("alpha")).regions) == ["mine"]
        assert shm.get_contents_as_numpy(handle, np.int32, [2, 16])[1].tolist() == [0] * 16  # nothing written
    finally:
        client.unregister_system_shared_memory(headers=_auth("alpha"))
        shm.destroy_shared_memory_region(handle)


def _sequence_input(value: int, module: Any = g) -> list[Any]:
    x = module.InferInput("INPUT", [1, 1], "INT32")
    x.set_data_from_numpy(np.full((1, 1), value, dtype=np.int32))
    return [x]


def _stream_status(client: Any, inputs: list[Any], sequence_id: str, headers: dict[str, str]) -> str:
    """One request of a sequence on a ModelStreamInfer stream: OK, or its error (the stream's caller is its
    token's)."""
    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put(error or result), headers=headers)
    try:
        client.async_stream_infer(SEQUENCE_MODEL, inputs, sequence_id=sequence_id)
        answer = answers.get(timeout=60)
    finally:
        client.stop_stream()
    return f"{answer.message()}" if isinstance(answer, InferenceServerException) else "OK"


def test_another_tokens_sequence_is_not_found(served: RunningServer) -> None:
    """Token B steps on, reads the state of and ends token A's sequence (before: B decoded A's state): each
    NOT_FOUND; B's own start of that id is a sequence of its own; A's sums go on untouched."""
    client, http = g.InferenceServerClient(served.url), h.InferenceServerClient(served.http_url)
    a, b = _auth("alpha"), _auth("bravo")
    state = [g.InferRequestedOutput("OUTPUT"), g.InferRequestedOutput("STATE_OUT")]

    def total(r: Any) -> int:
        return int(r.as_numpy("OUTPUT")[0, 0])

    assert (
        total(client.infer(SEQUENCE_MODEL, _sequence_input(11), sequence_id="7", sequence_start=True, headers=a)) == 11
    )
    said: dict[str, str] = {}

    def send() -> tuple[str, str]:
        said["step"] = _status(lambda: client.infer(SEQUENCE_MODEL, _sequence_input(1), sequence_id="7", headers=b))
        said["state"] = _status(
            lambda: client.infer(SEQUENCE_MODEL, _sequence_input(0), outputs=state, sequence_id="7", headers=b)
        )
        said["end"] = _status(
            lambda: client.infer(SEQUENCE_MODEL, _sequence_input(0), sequence_id="7", sequence_end=True, headers=b)
        )
        said["http step"] = _status(
            lambda: http.infer(SEQUENCE_MODEL, _sequence_input(1, h), sequence_id="7", headers=_auth("bravo"))
        )
        said["stream step"] = _stream_status(client, _sequence_input(1), "7", b)
        return said["step"].split(":")[0], json.dumps(said)

    code, _ = _attack_as(served, "sequences: token B on token A's sequence (isolation on)", send)
    assert code == "NOT_FOUND"
    for what in ("step", "state", "end", "http step", "stream step"):
        assert said[what].startswith(("NOT_FOUND", "404")) and "sequence '7' is not live" in said[what], said[what]
    start = client.infer(SEQUENCE_MODEL, _sequence_input(100), sequence_id="7", sequence_start=True, headers=b)
    assert total(start) == 100
    assert total(client.infer(SEQUENCE_MODEL, _sequence_input(1), sequence_id="7", headers=a)) == 12
    ended = client.infer(SEQUENCE_MODEL, _sequence_input(0), sequence_id="7", sequence_end=True, headers=b)
    assert total(ended) == 100 + 7
    assert (
        total(client.infer(SEQUENCE_MODEL, _sequence_input(0), sequence_id="7", sequence_end=True, headers=a)) == 12 + 7
    )


# --- one token keeping the others out ---------------------------------------------------------------------------


def test_a_greedy_token_holds_its_share_and_the_victim_still_starts_sequences(served: RunningServer) -> None:
    """max_sequences 8, --token-share 0.5: the greedy token's 20 starts get 4 (before: all 8, and the victim
    0 of 20), the victim's 4 of 4."""
    client = g.InferenceServerClient(served.url)
    share = MAX_SEQUENCES // 2

    def starts(token: str, first: int, count: int) -> list[str]:
        return [
            _status(
                lambda sid=sid: client.infer(
                    SEQUENCE_MODEL, _sequence_input(1), sequence_id=str(sid), sequence_start=True, headers=_auth(token)
                )
            )
            for sid in range(first, first + count)
        ]

    greedy = starts("greedy", 1000, 20)

    def send() -> tuple[str, str]:
        victim = starts("victim", 2000, share)
        return ("OK" if victim == ["OK"] * share else victim[-1].split(":")[0]), json.dumps(victim)

    code, details = _attack_as(served, "sequences: a greedy token starts 20, the victim 4 (share 0.5 of 8)", send)
    assert greedy[:share] == ["OK"] * share and all("this caller's" in s for s in greedy[share:]), greedy
    assert code == "OK", details
    for token, first in (("greedy", 1000), ("victim", 2000)):  # ended: the share is free again
        for sid in range(first, first + share):
            client.infer(
                SEQUENCE_MODEL, _sequence_input(0), sequence_id=str(sid), sequence_end=True, headers=_auth(token)
            )


def test_a_greedy_token_holds_its_share_and_the_victim_still_registers(served: RunningServer) -> None:
    """--shared-memory-max-regions 8, --token-share 0.5: the greedy token gets 4 regions of 8 tries, the
    victim 4 of 4."""
    client = g.InferenceServerClient(served.url)
    handle = shm.create_shared_memory_region("pool", _key("pool"), SIZE)
    share = MAX_REGIONS // 2

    def registers(token: str, count: int) -> list[str]:
        return [
            _status(lambda i=i: client.register_system_shared_memory(f"r{i}", _key("pool"), SIZE, headers=_auth(token)))
            for i in range(count)
        ]

    try:
        greedy = registers("greedy", MAX_REGIONS)

        def send() -> tuple[str, str]:
            victim = registers("victim", share)
            return ("OK" if victim == ["OK"] * share else victim[-1].split(":")[0]), json.dumps(victim)

        code, details = _attack_as(served, "shared memory: a greedy token registers 8, the victim 4 (share 0.5)", send)
        assert greedy[:share] == ["OK"] * share, greedy
        assert all(s.startswith("RESOURCE_EXHAUSTED") and "this caller's share" in s for s in greedy[share:]), greedy
        assert code == "OK", details
    finally:
        for token in ("greedy", "victim"):
            client.unregister_system_shared_memory(headers=_auth(token))
        shm.destroy_shared_memory_region(handle)
