"""`qkv serve --workers 2`: two worker processes behind one port, started as a user starts them. Each worker
names itself in every unary gRPC answer's trailing metadata (qkv-worker: INDEX PID); a client on a connection
of its own reaches one worker, so the tests open connections until both have answered."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as g
import tritonclient.utils.shared_memory as shm
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from service import protocol
from service.errors import ConfigError
from service.priority import cpu_budget, default_instances, usable_cores
from service.workers.fork import single_threaded
from service.workers.identity import HEADER
from service.workers.metrics_view import combine
from service.workers.plan import WORKER_BYTES, cores_of, pinned, worker_count
from service.workers.supervisor import MAX_UNIX_PATH, control_directory
from tests.conftest import RunningServer, scale_model, start_server, stop_server
from tests.service.test_sequence_server import _inputs, sequence_models
from tests.service.test_shared_memory import SIZE, X0, X1, _simple

LIVE = f"/{protocol.SERVICE_NAME}/ServerLive"
SCALE_X = np.array([[1.0, 2.0, 3.0]], dtype=np.float32)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Two workers, explicit model control: `scale` and `simple` (shared memory) and the sequence models
    loaded at start, `scale_later` loaded by a test."""
    root = tmp_path_factory.mktemp("workers") / "models"
    sequence_models(root)
    scale_model(root / "scale")
    scale_model(root / "scale_later")
    _simple(root / "simple")
    loads = [a for name in ("scale", "simple", "simple_string_dyna_sequence") for a in ("--load-model", name)]
    args = ["--model-repository", str(root), "--workers", "2", "--model-control-mode", "explicit", *loads,
            "--grace-period", "5"]  # fmt: skip
    s = start_server(args, root.parent / "server.log")
    yield s
    assert stop_server(s) == 0, s.output()  # SIGTERM: every worker drains, the supervisor exits 0


class Connection:
    """A tritonclient on a connection of its own (no subchannel shared with other clients), and the worker
    that serves that connection (index, pid)."""

    def __init__(self, url: str) -> None:
        self.client = g.InferenceServerClient(url, channel_args=[("grpc.use_local_subchannel_pool", 1)])
        self.worker = self.identity()

    def identity(self) -> tuple[int, int]:
        live = self.client._channel.unary_unary(  # the client's own channel: the same connection
            LIVE,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=protocol.message_class("ServerLiveResponse").FromString,
        )
        _, call = live.with_call(protocol.message_class("ServerLiveRequest")())
        [value] = [v for k, v in call.trailing_metadata() if k == HEADER]
        index, pid = value.split()
        return int(index), int(pid)

    def close(self) -> None:
        self.client.close()


def _connections(url: str, each: int = 1, tries: int = 200) -> list[Connection]:
    """Connections until each worker serves `each` of them."""
    kept: dict[int, list[Connection]] = {0: [], 1: []}
    for _ in range(tries):
        c = Connection(url)
        if len(kept[c.worker[0]]) < each:
            kept[c.worker[0]].append(c)
        else:
            c.close()
        if all(len(v) == each for v in kept.values()):
            return [c for i in (0, 1) for c in kept[i]]
    raise AssertionError(f"{tries} connections did not reach both workers: {kept}")


def _scale(client: Any, model: str = "scale") -> np.ndarray:
    x = g.InferInput("x", [1, 3], "FP32")
    x.set_data_from_numpy(SCALE_X)
    return client.infer(model, [x]).as_numpy("y")


def _index(client: Any, name: str) -> str:
    [row] = [m for m in client.get_model_repository_index().models if m.name == name]
    return str(row.state)


def test_a_load_and_an_unload_on_one_worker_apply_on_both(served: RunningServer) -> None:
    first, second = _connections(served.url)
    assert first.worker[1] != second.worker[1]
    for c in (first, second):
        assert not c.client.is_model_ready("scale_later")
    first.client.load_model("scale_later")  # answered once both workers have it
    for c in (first, second):
        assert c.client.is_model_ready("scale_later") and _index(c.client, "scale_later") == "READY"
        np.testing.assert_allclose(_scale(c.client, "scale_later"), SCALE_X * [1, 2, 3])
    second.client.unload_model("scale_later")
    for c in (first, second):
        assert not c.client.is_model_ready("scale_later") and _index(c.client, "scale_later") == "UNAVAILABLE"
    with pytest.raises(InferenceServerException, match=r"must be a JSON object, got list$"):  # as one server says
        first.client.load_model("scale_later", config='["not an object"]')
    first.client.load_model("scale_later")  # a good load after the refused one
    first.client.unload_model("scale_later")
    for c in (first, second):
        c.close()


def test_shared_memory_registered_on_one_worker_is_used_on_the_other(served: RunningServer) -> None:
    first, second = _connections(served.url)
    key = f"/qkv_test_{os.getpid()}_workers"
    region = shm.create_shared_memory_region("in", key, 2 * SIZE)
    try:
        shm.set_shared_memory_region(region, [X0])
        shm.set_shared_memory_region(region, [X1], offset=SIZE)
        first.client.register_system_shared_memory("in", key, 2 * SIZE)
        inputs = [g.InferInput("INPUT0", [1, 16], "INT32"), g.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("in", SIZE)
        inputs[1].set_shared_memory("in", SIZE, offset=SIZE)
        for c in (second, first):
            result = c.client.infer("simple", inputs)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), X0 + X1)
        second.client.unregister_system_shared_memory("in")
        for c in (first, second):
            assert c.client.get_system_shared_memory_status() == {} or not c.client.get_system_shared_memory_status(
                as_json=True
            )
            with pytest.raises(InferenceServerException, match="in"):
                c.client.infer("simple", inputs)
    finally:
        shm.destroy_shared_memory_region(region)
        for c in (first, second):
            c.close()


def test_a_sequence_keeps_its_state_across_connections_to_both_workers(served: RunningServer) -> None:
    connections = _connections(served.url, each=2)
    values = [20, 11, 7, 5, 3, 2, 0, 1]
    for sequence in ("1000", "1001", "1002", "1003"):  # hashed onto both workers
        answers = []
        for i, value in enumerate(values):
            c = connections[i % len(connections)]
            r = c.client.infer("simple_string_dyna_sequence", _inputs(value), sequence_id=sequence,
                               sequence_start=i == 0, sequence_end=i == len(values) - 1)  # fmt: skip
            answers.append(int(r.as_numpy("OUTPUT")[0, 0]))
        # Its state, the running sum of the sequence's inputs; its id added at the end (Triton's example).
        expected = [int(v) for v in np.cumsum(values)]
        expected[-1] += int(sequence)
        assert answers == expected, sequence
    for c in connections:
        c.close()


def _requests(metrics_url: str, model: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "qkv_requests":
            return sum(s.value for s in family.samples if s.name == "qkv_requests_total" and s.labels["model"] == model)
    return 0.0


def _successes(client: Any) -> int:
    [stats] = client.get_inference_statistics("scale").model_stats
    return int(stats.inference_stats.success.count)


def test_metrics_and_statistics_sum_over_the_workers(served: RunningServer) -> None:
    connections = _connections(served.url, each=2)
    before = _requests(served.metrics_url, "scale")
    counted = [_successes(c.client) for c in connections]
    assert len(set(counted)) == 1, counted  # every worker answers with the sum
    for c in connections:
        for _ in range(3):
            _scale(c.client)
    assert _requests(served.metrics_url, "scale") - before == 3 * len(connections)
    for c in connections:
        assert _successes(c.client) - counted[0] == 3 * len(connections)
        c.close()


def test_a_worker_asking_a_stopped_one_for_statistics_goes_on_serving(served: RunningServer) -> None:
    """Worker 1 stopped (SIGSTOP): worker 0's statistics call waits for it, up to its timeout, and leaves it out;
    an inference on worker 0 sent while that call waits is answered first, and counted in its answer."""
    asking, serving, stopped, *rest = _connections(served.url, each=2)
    _scale(stopped.client)  # worker 1 has counts of its own
    before = _successes(asking.client)
    os.kill(stopped.worker[1], signal.SIGSTOP)
    try:
        alone = _successes(asking.client)  # worker 0's own: worker 1 does not answer
        answered: list[tuple[str, int]] = []
        waiting = threading.Thread(target=lambda: answered.append(("statistics", _successes(asking.client))))
        waiting.start()
        time.sleep(0.5)  # (the call reaches worker 0 and waits on worker 1)
        _scale(serving.client)
        answered.append(("infer", 1))
        waiting.join(30)
    finally:
        os.kill(stopped.worker[1], signal.SIGCONT)
    assert alone < before
    assert answered == [("infer", 1), ("statistics", alone + 1)]
    assert _successes(stopped.client) == _successes(asking.client) == before + 1  # both workers answer again
    for c in (asking, serving, stopped, *rest):
        c.close()


def test_a_scrape_waiting_on_a_stopped_worker_leaves_the_supervisors_port_answering(served: RunningServer) -> None:
    """The supervisor collects the workers' metrics off its event loop: while a scrape waits for a stopped
    worker (up to its timeout), the metrics port goes on answering."""
    connections = _connections(served.url)
    stopped = connections[1].worker[1]
    os.kill(stopped, signal.SIGSTOP)
    order: list[str] = []
    try:

        def scrape_all() -> None:
            urllib.request.urlopen(served.metrics_url, timeout=30).read()
            order.append("scrape")

        scrape = threading.Thread(target=scrape_all)
        scrape.start()
        time.sleep(0.5)  # (the scrape reaches the supervisor and waits on worker 1)
        options = urllib.request.Request(served.metrics_url, method="OPTIONS")
        with urllib.request.urlopen(options, timeout=30) as answer:
            order.append(f"options {answer.status}")
        scrape.join(30)
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert order == ["options 200", "scrape"]
    for c in connections:
        c.close()


def _command(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().rstrip("\0").split("\0")


def test_a_killed_worker_is_restarted_and_only_its_requests_fail_retryable(served: RunningServer) -> None:
    loader = Connection(served.url)
    loader.client.load_model("scale_later")  # loaded since the start: a restarted worker must load it too
    loader.close()
    victim_index, victim = _connections(served.url)[0].worker
    assert _command(victim) == _command(served.process.pid)  # forked at the start, from the supervisor
    failures: list[str] = []
    answered = [0]
    lost: list[str] = []
    stop = threading.Event()

    def retried(call: Any) -> Any:
        """`call()`, retried as a client retries a retryable failure; every failure noted."""
        for _ in range(200):
            try:
                return call()
            except InferenceServerException as e:
                failures.append(str(e.status()))
            except grpc.RpcError as e:  # connecting (ServerLive): a connection the killed worker had queued
                failures.append(str(e.code()))
            time.sleep(0.05)
        lost.append("gave up")

    def load() -> None:
        while not stop.is_set():
            c = retried(lambda: Connection(served.url))
            for _ in range(5):
                if retried(partial(_scale, c.client)) is not None:
                    answered[0] += 1
            c.close()

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 120
    restarted = None
    while time.monotonic() < deadline and restarted is None:
        time.sleep(0.05)
        try:
            c = Connection(served.url)
        except grpc.RpcError as e:  # a connection the killed worker's socket had queued: reset, retryable
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            continue
        if c.worker[0] == victim_index and c.worker[1] != victim:
            restarted = c
        else:
            c.close()
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(60)
    assert restarted is not None, "the killed worker was not restarted"
    assert not lost and answered[0] > 0
    assert set(failures) <= {"StatusCode.UNAVAILABLE"}, failures
    # The restarted worker has what was loaded since the start (replayed): scale_later, loaded above.
    assert _command(restarted.worker[1])[-2:] == ["-m", "service.workers.worker"]  # spawned: a restart
    assert restarted.client.is_model_ready("scale")
    assert restarted.client.is_model_ready("scale_later")
    restarted.client.unload_model("scale_later")  # as the other tests find it
    restarted.close()


def test_a_port_another_server_holds_stops_the_start(served: RunningServer, tmp_path: Path) -> None:
    """Even another supervisor's, whose workers share it (SO_REUSEPORT): a second server would split its traffic."""
    port = served.url.rsplit(":", 1)[1]
    ports = ["--grpc-port", port, "--http-port", "-1", "--metrics-port", "-1"]
    command = [sys.executable, "-m", "service.cli", "serve", "--workers", "2", "--host", "127.0.0.1", *ports,
               "--model-repository", str(tmp_path)]  # fmt: skip
    answer = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert answer.returncode == 2
    assert answer.stderr.startswith(f"qkv serve: cannot bind the port 127.0.0.1:{port} (--grpc-port)"), answer.stderr


def test_worker_count_auto_is_one_per_two_cores_within_memory(tmp_path: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(b"\0" * (512 << 20 >> 4))  # 32 MiB of model files
    per_worker = WORKER_BYTES + (512 << 20 >> 4)
    assert worker_count("auto", tmp_path, cores=16, memory=64 * per_worker) == 8
    assert worker_count("auto", tmp_path, cores=16, memory=3 * per_worker + 1) == 3  # the memory bounds it
    assert worker_count("auto", tmp_path, cores=1, memory=64 * per_worker) == 1
    assert worker_count(" 3 ", tmp_path) == 3
    for bad in ("0", "-1", "many", "1000"):
        with pytest.raises(ConfigError, match=r"--workers") as e:
            worker_count(bad, tmp_path)
        assert e.value.key == "--workers"
    assert cores_of(1, 2, [0, 1, 2, 3]) == [1, 3] and cores_of(0, 4, [0, 1]) == [0, 1]


def test_under_a_cpu_quota_auto_counts_its_cpus_and_no_worker_is_pinned(tmp_path: Path) -> None:
    cores = usable_cores()
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # one CPU's worth
    assert cpu_budget(tmp_path) == 1
    if len(cores) > 1:  # a quota below the cores: the kernel places the workers
        assert pinned(0, 2, tmp_path) == [] and pinned(1, 2, tmp_path) == []
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_budget(tmp_path) == len(cores)
    assert pinned(1, 2, tmp_path) == cores_of(1, 2, cores)


def test_serve_refuses_a_worker_count_it_cannot_run(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "service.cli", "serve", "--workers", "none", "--model-repository", str(tmp_path)]
    answer = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert answer.returncode == 2
    assert answer.stderr.strip() == "qkv serve: --workers 'none': give a number of worker processes, or auto"


def _scrape_of(value: float, info: float = 1.0) -> str:
    registry = CollectorRegistry()
    Counter("qkv_requests", "requests", ["model"], registry=registry).labels("m").inc(value)
    Gauge("qkv_utilization", "utilization", ["model"], registry=registry).labels("m").set(value / 10)
    Gauge("qkv_model_info", "model", ["model"], registry=registry).labels("m").set(info)
    Histogram("qkv_request_duration_seconds", "latency", registry=registry, buckets=(0.1, 1.0)).observe(value / 10)
    return generate_latest(registry).decode()


def test_the_metrics_view_sums_counters_and_histograms_and_averages_the_capacity_signal() -> None:
    families = {f.name: f for f in combine([_scrape_of(3.0), _scrape_of(5.0)])}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples["qkv_requests_total", (("model", "m"),)] == 8.0
    assert samples["qkv_utilization", (("model", "m"),)] == pytest.approx(0.4)  # each worker batches on its own
    assert samples["qkv_model_info", (("model", "m"),)] == 1.0
    assert samples["qkv_request_duration_seconds_count", ()] == 2.0
    assert samples["qkv_request_duration_seconds_bucket", (("le", "0.1"),)] == 0.0
    assert samples["qkv_request_duration_seconds_bucket", (("le", "1.0"),)] == 2.0
    assert samples["qkv_request_duration_seconds_sum", ()] == pytest.approx(0.8)
    # What the supervisor answers parses as Prometheus's text format again, with the same values.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerMetricsOf(combine([_scrape_of(3.0), _scrape_of(5.0)])))
    again = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert [s.value for s in again["qkv_requests"].samples if s.name == "qkv_requests_total"] == [8.0]


class WorkerMetricsOf:
    """A collector of fixed families."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Any:
        return iter(self.families)


def test_workers_do_not_outlive_a_killed_supervisor(tmp_path: Path) -> None:
    scale_model(tmp_path / "models" / "scale")
    # (the control sockets' directory under a TMPDIR of the test's: the killed supervisor leaves it behind; a
    # short one, as pytest's tmp_path may be too deep for a socket's path)
    tmp = Path(tempfile.mkdtemp(prefix="qkv-test-", dir="/tmp"))
    args = ["--model-repository", str(tmp_path / "models"), "--workers", "2"]
    s = start_server(args, tmp_path / "server.log", env={"TMPDIR": str(tmp)})
    try:
        pid = s.process.pid
        workers = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        assert len(workers) == 2
        s.process.kill()
        s.process.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(Path(f"/proc/{w}").exists() for w in workers):
            time.sleep(0.1)
        assert not any(Path(f"/proc/{w}").exists() for w in workers), "a worker outlived its supervisor"
    finally:
        stop_server(s)
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_control_sockets_go_under_tmp_where_tmpdir_is_too_deep_for_a_socket(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    directory = control_directory()
    try:
        assert directory.parent == Path("/tmp") and len(str(directory / "worker-255.sock")) <= MAX_UNIX_PATH
        assert directory.stat().st_mode & 0o777 == 0o700 and not list(deep.iterdir())
    finally:
        directory.rmdir()
    short = Path(tempfile.mkdtemp(prefix="q", dir="/tmp"))  # (pytest's tmp_path may itself be too deep)
    monkeypatch.setattr(tempfile, "tempdir", str(short))
    try:
        assert control_directory().parent == short
    finally:
        shutil.rmtree(short)


def test_a_worker_that_cannot_start_stops_the_start(tmp_path: Path) -> None:
    scale_model(tmp_path / "models" / "scale")
    (tmp_path / "models" / "scale" / "config.json").write_text('{"batching": {"typo": 1}}')
    ports = ["--grpc-port", "0", "--http-port", "0", "--metrics-port", "0"]
    command = [sys.executable, "-m", "service.cli", "serve", "--workers", "2", "--host", "127.0.0.1", *ports,
               "--model-repository", str(tmp_path / "models")]  # fmt: skip
    answer = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert answer.returncode == 2, answer.stderr
    assert "unknown setting(s) ['typo']" in answer.stderr and "serving" not in answer.stdout


def _config_entry(options: Any, key: str) -> str:
    try:
        return str(options.get_session_config_entry(key))
    except RuntimeError:  # not set
        return ""


def test_a_model_runs_no_more_sessions_by_default_than_its_cpus_hold(tmp_path: Path) -> None:
    """Two sessions of one thread, unless the process may use fewer CPUs (a worker pinned to one core; a
    container's quota); a config's `instances` is taken as it is."""
    cores = len(usable_cores())
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert default_instances(1, tmp_path) == min(2, cores)
    assert default_instances(2, tmp_path) == max(1, min(2, cores // 2))
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # one CPU's worth
    assert default_instances(1, tmp_path) == 1


SPREAD = """
import os, sys
from pathlib import Path
from service.models.runtime import TensorRuntime
from service.priority import spread_lone_runs, usable_cores
from service.repository.layout import load_model_config

machine = usable_cores()
spread_lone_runs(machine)  # as a worker does, before it pins itself to its share
os.sched_setaffinity(0, machine[:1])
config = load_model_config(Path(sys.argv[1]))
before = set(os.listdir("/proc/self/task"))
runtime = TensorRuntime(config, ["CPUExecutionProvider"])
made = set(os.listdir("/proc/self/task")) - before
print(config.instances, runtime.lone is not None, max(len(os.sched_getaffinity(int(t))) for t in made),
      len(os.sched_getaffinity(0)), len(machine))
"""


@pytest.mark.skipif(len(usable_cores()) < 2, reason="needs two cores: a worker pinned to one of them")
def test_a_pinned_workers_lone_session_spreads_over_the_machines_cores(tmp_path: Path) -> None:
    """A worker pinned to one core runs one session of its model there, and a request alone on the idle
    machine still gets every core: the lone session's threads are made with the machine's cores."""
    scale_model(tmp_path / "scale")
    answer = subprocess.run(
        [sys.executable, "-c", SPREAD, str(tmp_path / "scale")], capture_output=True, text=True, timeout=120
    )
    assert answer.returncode == 0, answer.stderr
    instances, lone, widest_new_thread, own, machine = answer.stdout.split()
    assert (instances, lone, own) == ("1", "True", "1")  # one session on its core, and a lone one
    assert widest_new_thread == machine  # the lone session's pool: every core


def test_the_worker_cpu_arena_choice_reaches_every_session_a_model_does_not_decide_for() -> None:
    import onnxruntime as ort

    from service.models import runtime

    made: list[tuple[str, dict[str, bool], bool, str]] = []
    try:
        for arena in ("off", "shared", "session"):  # what a worker of --worker-cpu-arena sets
            runtime.use_cpu_arena(arena)
            for session in ({}, {"enable_mem_arena": True}):
                options = ort.SessionOptions()
                config: Any = SimpleNamespace(session=session, device="cpu", accelerators=())
                assert runtime.triton_providers(config, options, ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
                shared = _config_entry(options, "session.use_env_allocators")
                made.append((arena, session, options.enable_cpu_mem_arena, shared))
    finally:
        runtime.use_cpu_arena("session")
    assert made == [
        ("off", {}, False, ""),
        ("off", {"enable_mem_arena": True}, True, ""),
        ("shared", {}, True, "1"),
        ("shared", {"enable_mem_arena": True}, True, ""),
        ("session", {}, True, ""),
        ("session", {"enable_mem_arena": True}, True, ""),
    ]


def test_the_supervisor_forks_only_while_no_thread_of_its_own_runs() -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        assert not single_threaded()  # a thread runs: the workers are spawned
    finally:
        release.set()
        thread.join()
