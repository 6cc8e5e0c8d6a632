"""The reference documents held to the code.

docs/configuration.md against the command-line parsers, ServerSettings and the config.json loader;
docs/design.md against a real server's /metrics, the protocol's RPCs and the error statuses; every
file of the checkout against stale references, broken Markdown links and cited sections that do not
exist. Each test names what is missing from a document and what a document names that the code lacks.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
import urllib.request
from dataclasses import MISSING, dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any, NoReturn
from unittest import mock

import grpc
import pytest

from service import cli, errors, protocol
from service.config import ServerSettings, add_arguments, from_arguments
from service.frontends.statuses import HTTP_STATUS, grpc_status, http_status
from service.observability.metrics import SEQ_LEN_BUCKETS, UNKNOWN_MODEL
from service.repository import layout as repository
from service.repository.layout import ModelConfig
from service.scheduling.config import BatchingConfig
from service.tools.client import PUSHBACK, Client, g2p_request
from tests.conftest import ROOT, RunningServer, start_server

DOCS = ROOT / "docs"
DESIGN = DOCS / "design.md"
CONFIGURATION = DOCS / "configuration.md"
SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
CODE = re.compile(r"`([^`]*)`")
Row = list[str]


# --- reading the documents --------------------------------------------------------------------------


def headings(path: Path) -> list[tuple[int, str, int]]:
    """(level, title, line index) of each heading outside fenced code blocks."""
    found, fenced = [], False
    for i, line in enumerate(path.read_text().splitlines()):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            found.append((len(m.group(1)), m.group(2), i))
    return found


def section(path: Path, title: str) -> str:
    """The text under heading `title`, up to the next heading of the same or a higher level."""
    lines = path.read_text().splitlines()
    marks = headings(path)
    for k, (level, name, start) in enumerate(marks):
        if name == title:
            end = next((i for lv, _, i in marks[k + 1 :] if lv <= level), len(lines))
            return "\n".join(lines[start + 1 : end])
    raise AssertionError(f"{path.relative_to(ROOT)} has no section {title!r}")


def _cells(line: str) -> Row:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def table(text: str, first_column: str) -> list[Row]:
    """The rows of the one Markdown table in `text` whose first header cell is `first_column`."""
    lines, found = text.splitlines(), []
    for i in range(len(lines) - 1):
        if lines[i].startswith("|") and SEPARATOR.match(lines[i + 1]) and _cells(lines[i])[0] == first_column:
            rows = []
            for line in lines[i + 2 :]:
                if not line.startswith("|"):
                    break
                rows.append(_cells(line))
            found.append(rows)
    assert len(found) == 1, f"expected one table headed {first_column!r}, found {len(found)}"
    return found[0]


def codes(cell: str) -> list[str]:
    return CODE.findall(cell)


def documented(rows: list[Row]) -> dict[str, Row]:
    """Each code span of a row's first cell -> the row."""
    return {name: row for row in rows for name in codes(row[0])}


def rendered(value: Any) -> str | None:
    """A default as the reference writes it (None: written as the word none)."""
    if value is None or value == ():  # an empty list of names or declarations: none
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return '""' if value == "" else str(value)


def assert_default(cell: str, value: Any, what: str) -> None:
    want = rendered(value)
    if want is None:
        assert cell.startswith("none"), f"{what}: default documented as {cell!r}, the code has none"
    else:
        got = codes(cell)[:1]
        assert got == [want], f"{what}: default documented as {cell!r}, the code has `{want}`"


def assert_same(documented_names: set[str], actual: set[str], where: str, what: str) -> None:
    missing, stale = sorted(actual - documented_names), sorted(documented_names - actual)
    assert not missing, f"{where} lacks {what}: {missing}"
    assert not stale, f"{where} documents {what} the code does not have: {stale}"


# --- the command-line parsers -------------------------------------------------------------------------


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


@cache
def parser_of(command: str) -> argparse.ArgumentParser:
    """The parser `qkv COMMAND` builds, caught as it is about to parse (nothing runs)."""

    def caught(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
        raise _Parsed(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", caught):
        try:
            cli.main([command])
        except _Parsed as e:
            return e.parser
    raise AssertionError(f"qkv {command} parsed no arguments")


def flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


# --- configuration.md ---------------------------------------------------------------------------------


def test_every_serve_flag_and_environment_variable_is_documented_with_its_default() -> None:
    parser = parser_of("serve")
    actions = flags(parser)
    rows = documented(table(section(CONFIGURATION, "`qkv serve`"), "flag"))
    assert_same(set(rows), set(actions), "docs/configuration.md, `qkv serve`", "flags")
    settings = {f.name: f for f in fields(ServerSettings)}
    for flag, row in rows.items():
        dest = actions[flag].dest
        env = "QKV_" + dest.upper()
        assert codes(row[1]) == [env], f"{flag}: environment documented as {row[1]!r}, the code reads {env}"
        assert dest in settings, f"{flag} is no ServerSettings field"
        assert_default(row[2], settings[dest].default, flag)


def _other_value(name: str, default: Any) -> tuple[str, Any]:
    """An environment value for setting `name` and what it should become: anything but the default."""
    if isinstance(default, bool):
        return ("0", False) if default else ("1", True)
    if isinstance(default, int | float):
        return str(default + 1), type(default)(default + 1)
    choices = next(f.metadata.get("choices") for f in fields(ServerSettings) if f.name == name)
    if choices:
        value = next(c for c in choices if c != default)
        return value, value
    if isinstance(default, tuple):  # a list of names: the variable separates them with commas
        return "one,other", ("one", "other")
    return "elsewhere", Path("elsewhere") if isinstance(default, Path) or default is None else "elsewhere"


def test_every_documented_environment_variable_is_read() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    rows = documented(table(section(CONFIGURATION, "`qkv serve`"), "flag"))
    for env in {codes(row[1])[0] for row in rows.values()}:
        name = env.removeprefix("QKV_").lower()
        default = getattr(ServerSettings(), name)
        text, value = _other_value(name, default)
        settings = from_arguments(parser.parse_args([]), {env: text})
        assert getattr(settings, name) == value, f"{env}={text} left {name} at {getattr(settings, name)!r}"


def _is_raw(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "raw"


def loader_keys() -> set[str]:
    """The top-level config.json keys `load_model_config` reads from the parsed file (`raw`)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(repository.load_model_config)))
    keys: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            if _is_raw(node.func.value) and node.args and isinstance(node.args[0], ast.Constant):
                keys.add(node.args[0].value)
        elif isinstance(node, ast.Subscript) and _is_raw(node.value) and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
        elif isinstance(node, ast.Compare) and any(_is_raw(c) for c in node.comparators):
            if isinstance(node.left, ast.Constant):
                keys.add(node.left.value)
        elif (
            isinstance(node, ast.comprehension)
            and isinstance(node.iter, ast.Tuple | ast.List | ast.Set)
            and any(isinstance(c, ast.Compare) and any(_is_raw(x) for x in c.comparators) for c in node.ifs)
        ):
            keys |= {e.value for e in node.iter.elts if isinstance(e, ast.Constant)}
    return keys


def test_every_top_level_config_key_is_documented_and_read() -> None:
    keys = loader_keys()
    # The scan sees what the loader is known to read, and each plain setting it finds is a ModelConfig field.
    structured = {"kind", "platform", "batching", "max_batch_size", "model_card", "ensemble_scheduling"}
    assert structured <= keys, f"the scan of load_model_config found only {sorted(keys)}"
    settings = {f.name for f in fields(ModelConfig)}
    assert keys - structured <= settings, f"not ModelConfig fields: {sorted(keys - structured - settings)}"
    rows = documented(table(section(CONFIGURATION, "Top-level keys"), "key"))
    assert_same(set(rows), keys, "docs/configuration.md, Top-level keys", "config.json keys")
    defaults = {f.name: f.default for f in fields(ModelConfig) if f.default is not MISSING}
    for key, row in rows.items():
        if key in defaults:
            assert_default(row[1], defaults[key], f"config.json {key}")


def _used_by(key: str) -> set[str]:
    """The model kinds whose scheduler reads batching setting `key`."""
    scheduling = ROOT / "service" / "scheduling"
    files = ("batching.py", "continuous.py")
    read = {f: re.search(rf"(?<!scheduling)\.{key}\b", (scheduling / f).read_text()) is not None for f in files}
    shared = re.search(rf"(?<!scheduling)\.{key}\b", (scheduling / "admission.py").read_text()) is not None
    return {kind for kind, f in (("tensor", "batching.py"), ("g2p", "continuous.py")) if read[f] or shared}


def test_every_batching_key_is_documented_with_its_default_and_kinds() -> None:
    rows = documented(table(section(CONFIGURATION, "`batching`"), "key"))
    settings = {f.name: f for f in fields(BatchingConfig)}
    assert_same(set(rows), set(settings), "docs/configuration.md, `batching`", "batching keys")
    for key, row in rows.items():
        assert_default(row[1], settings[key].default, f"batching.{key}")
        kinds = {"tensor", "g2p"} if row[2] == "both" else {row[2]}
        assert kinds == _used_by(key), f"batching.{key}: documented for {row[2]}, read for {sorted(_used_by(key))}"


def _is_limits(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "limits") or (
        isinstance(node, ast.Attribute) and node.attr == "limits"
    )


def limit_reads() -> dict[tuple[str, str], Any]:
    """(key, kind) -> default of each `limits.get(KEY, DEFAULT)` in the model classes of service/models/tensor/model.py,
    g2p/model.py and generation/model.py."""
    reads: dict[tuple[str, str], Any] = {}
    files = ("tensor/model.py", "g2p/model.py", "generation/model.py")
    trees = [ast.parse((ROOT / "service" / "models" / f).read_text()) for f in files]
    for cls in (n for tree in trees for n in tree.body if isinstance(n, ast.ClassDef)):
        kind = next(
            (
                n.value.value
                for n in cls.body
                if isinstance(n, ast.Assign)
                and isinstance(n.value, ast.Constant)
                and any(isinstance(t, ast.Name) and t.id == "kind" for t in n.targets)
            ),
            None,
        )
        for node in ast.walk(cls):
            if (
                kind is not None
                and isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and _is_limits(node.func.value)
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                default = node.args[1] if len(node.args) > 1 else None
                reads[(node.args[0].value, kind)] = default.value if isinstance(default, ast.Constant) else None
    return reads


def test_every_limit_is_documented_with_its_kind_and_default() -> None:
    reads = limit_reads()
    assert {kind for _, kind in reads} == {"tensor", "g2p", "generation"}, (
        f"the scan of service/models/tensor/, g2p/ and generation/model.py found {sorted(reads)}"
    )
    rows = table(section(CONFIGURATION, "`limits`"), "key")
    docs = {(codes(row[0])[0], row[1]): row for row in rows}
    assert_same(set(docs), set(reads), "docs/configuration.md, `limits`", "(limit, kind) pairs")
    for (key, kind), row in docs.items():
        assert_default(row[2], reads[(key, kind)], f"limits.{key} ({kind})")


def test_every_command_and_its_flags_are_documented() -> None:
    commands = documented(table(section(DESIGN, "Command line"), "command"))
    assert_same(set(commands), {f"qkv {c}" for c in cli.COMMANDS}, 'docs/design.md, "Command line"', "commands")
    for command in cli.COMMANDS:
        if command == "serve":
            continue
        rows = documented(table(section(CONFIGURATION, f"`qkv {command}`"), "flag"))
        where = f"docs/configuration.md, `qkv {command}`"
        assert_same(set(rows), set(flags(parser_of(command))), where, "flags")


# --- design.md ----------------------------------------------------------------------------------------

SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s")
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


class Exposition:
    """A /metrics page: its qkv_ families with their type, label names and histogram buckets."""

    def __init__(self, text: str) -> None:
        types = dict(re.findall(r"^# TYPE (qkv_\w+) (\w+)$", text, re.M))
        self.samples = {m.group(1) for line in text.splitlines() if (m := SAMPLE.match(line))}

        def created(name: str) -> bool:  # prometheus_client writes a counter's or histogram's _created apart
            stem = name.removesuffix("_created")
            return name.endswith("_created") and (
                types.get(stem + "_total") == "counter" or types.get(stem) == "histogram"
            )

        self.types = {name: kind for name, kind in types.items() if not created(name)}
        self.labels: dict[str, set[str]] = {name: set() for name in self.types}
        self.buckets: dict[str, set[float]] = {}
        for line in text.splitlines():
            m = SAMPLE.match(line)
            if not m or not m.group(1).startswith("qkv_"):
                continue
            name, labels = m.group(1), dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            family = next((name.removesuffix(s) for s in HISTOGRAM_SERIES if name.removesuffix(s) in self.types), name)
            if family in self.types:
                self.labels[family] |= set(labels) - {"le"}
                if name.endswith("_bucket") and labels.get("le") != "+Inf":
                    self.buckets.setdefault(family, set()).add(float(labels["le"]))
        self.text = text


@pytest.fixture(scope="module")
def exposition(server: RunningServer) -> Exposition:
    """/metrics of the shared server after one g2p request and one for a model it lacks."""
    with Client(server.url, timeout=30) as client:
        assert client.g2p(["attention"], lexicon=False) == ["AH0 T EH1 N SH AH0 N"]  # decoded: its metrics
        with pytest.raises(grpc.RpcError) as refused:
            client.infer(g2p_request(["attention"], model="no-such-model"))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=10) as ready:
        assert ready.status == 200  # an HTTP request, so that qkv_http_requests_total has a sample
    return Exposition(urllib.request.urlopen(server.metrics_url, timeout=10).read().decode())


def _declared_labels() -> dict[str, set[str]]:
    """Each metric family's label names as the server declares them, by its exposed name."""
    from service.observability.metrics import Metrics

    out: dict[str, set[str]] = {}
    for collector in vars(Metrics()).values():
        if hasattr(collector, "_labelnames"):
            suffix = "_total" if collector._type == "counter" else ""
            out[collector._name + suffix] = set(collector._labelnames)
    return out


def _declared_buckets() -> dict[str, set[float]]:
    """Each histogram's finite bucket bounds as the server declares them."""
    from service.observability.metrics import Metrics

    return {
        c._name: {b for b in c._upper_bounds if b != float("inf")}
        for c in vars(Metrics()).values()
        if getattr(c, "_type", "") == "histogram"
    }


def test_every_exposed_metric_is_documented_with_its_type_and_labels(exposition: Exposition) -> None:
    text = section(DESIGN, "Metrics")
    rows = {codes(row[0])[0]: row for row in table(text, "metric")}
    assert_same(set(rows), set(exposition.types), 'docs/design.md, "Metrics"', "metrics")
    declared = _declared_labels()
    for name, row in rows.items():
        kind = exposition.types[name]
        assert row[1].split()[0] == kind, f"{name}: documented as {row[1]!r}, exposed as a {kind}"
        # the labels its samples carry, or (a family with no sample yet, e.g. the cache's) those it declares
        labels = exposition.labels[name] or declared[name]
        assert set(codes(row[2])) == labels == declared[name], (
            f"{name}: labels documented as {codes(row[2])}, exposed with {sorted(labels)}, "
            f"declared {sorted(declared[name])}"
        )
    mentioned = set(re.findall(r"\bqkv_\w+", text))
    unknown = sorted(mentioned - set(exposition.types) - exposition.samples)
    assert not unknown, f'docs/design.md, "Metrics" names series the server does not expose: {unknown}'


def test_every_histogram_bucket_set_is_documented(exposition: Exposition) -> None:
    rows = {codes(row[0])[0]: row for row in table(section(DESIGN, "Metrics"), "histogram")}
    histograms = {name for name, kind in exposition.types.items() if kind == "histogram"}
    assert_same(set(rows), histograms, 'docs/design.md, "Metrics" buckets', "histograms")
    declared = _declared_buckets()
    for name, row in rows.items():
        # a histogram with no sample on this server (an ensemble's steps): the buckets it declares
        assert name in exposition.buckets or name in declared, f"{name} exposed no buckets to compare"
        documented_buckets = [float(x) for x in re.split(r",\s*", row[1])]
        exposed = sorted(exposition.buckets.get(name, declared.get(name, set())))
        assert documented_buckets == exposed, f"{name}: documented buckets {documented_buckets}, exposed {exposed}"


def test_label_values_of_the_metrics_section(exposition: Exposition) -> None:
    text = section(DESIGN, "Metrics")
    seq_len = ", ".join(map(str, SEQ_LEN_BUCKETS)) + ", inf"
    assert seq_len in text, f'docs/design.md, "Metrics" should list the seq_len values {seq_len}'
    unknown = f'model="{UNKNOWN_MODEL}"'
    assert unknown in text, f'docs/design.md, "Metrics" should name the label value {unknown}'
    assert re.search(rf"^qkv_requests_total\{{[^}}]*{re.escape(unknown)}", exposition.text, re.M), (
        f"a request for a model the server lacks was not counted under {unknown}"
    )


def test_every_http_endpoint_label_is_documented() -> None:
    from types import SimpleNamespace

    from service.frontends.completions_api import ENDPOINTS as COMPLETIONS_ENDPOINTS
    from service.frontends.rest_api import RestServer
    from service.frontends.security import BearerTokens
    from service.frontends.shared_memory import SharedMemoryRegistry
    from service.frontends.text_api import ENDPOINTS as TEXT_ENDPOINTS
    from service.observability.metrics import Metrics

    regions = SharedMemoryRegistry(0, 0, 0)
    rest = RestServer(SimpleNamespace(), Metrics(enabled=False), SimpleNamespace(), BearerTokens([]), None, regions)  # type: ignore[arg-type]
    routes = [*rest._model_routes.values(), *rest._server_routes.values(), *rest._repository_routes.values()]
    shared = [("systemsharedmemory", "region", "r", kind) for kind in ("status", "register", "unregister")]
    routes += [r for path in [*shared, ("cudasharedmemory", "status")] if (r := rest._shared_memory_route(path))]
    rows = table(section(DESIGN, "Metrics"), "label")
    [cell] = [row[1] for row in rows if row[0] == "`endpoint`"]
    documented_endpoints = set(codes(cell)) - {"qkv_http_requests_total"}
    code_endpoints = {r.endpoint for r in routes} | {"unknown"}  # unknown: a path that is no route
    code_endpoints |= {endpoint for endpoint, _ in TEXT_ENDPOINTS.values()}  # OpenAI's and TEI's shapes
    code_endpoints |= {endpoint for endpoint, _ in COMPLETIONS_ENDPOINTS.values()}  # generating models'
    assert_same(documented_endpoints, code_endpoints, 'docs/design.md, "Metrics" endpoint label', "endpoints")


def _status_codes() -> set[str]:
    """Every status the server answers with: the ServingError codes and the ones it aborts with itself."""
    found: set[str] = set()
    pending: list[type[errors.ServingError]] = [errors.ServingError]
    while pending:
        cls = pending.pop()
        found.add(cls.code)
        pending += cls.__subclasses__()
    for path in (
        "frontends/grpc_api.py",
        "frontends/shared_memory_grpc.py",
        "frontends/security.py",
        "protocol/__init__.py",
    ):
        found |= set(re.findall(r"grpc\.StatusCode\.([A-Z_]+)", (ROOT / "service" / path).read_text()))
    return found


def test_every_status_is_documented_with_the_message_bounds() -> None:
    text = section(DESIGN, "Errors")
    statuses = {codes(row[0])[0] for row in table(text, "status")}
    assert_same(statuses, _status_codes(), 'docs/design.md, "Errors"', "statuses")
    for fact in (PUSHBACK, f"{errors.QUOTE_CHARS} characters", f"{errors.MAX_MESSAGE_BYTES:,} bytes"):
        assert fact in text, f'docs/design.md, "Errors" should say {fact!r}'


def test_every_grpc_status_has_its_http_status_as_documented() -> None:
    """docs/design.md's "HTTP/REST" table against HTTP_STATUS, both ways, and every gRPC status in both: none
    falls back to a default; each error the data plane raises is answered with its row's status."""
    rows = table(section(DESIGN, "HTTP/REST"), "gRPC status")
    documented_statuses = {codes(row[0])[0]: int(row[1][:3]) for row in rows}
    every = {c.name for c in grpc.StatusCode}
    where = 'docs/design.md, "HTTP/REST"'
    assert_same(set(documented_statuses), every, where, "gRPC statuses")
    assert_same(set(HTTP_STATUS), every, "service/frontends/statuses.py HTTP_STATUS", "gRPC statuses")
    wrong = {
        code: (status, HTTP_STATUS[code]) for code, status in documented_statuses.items() if HTTP_STATUS[code] != status
    }
    assert not wrong, f"{where} documents these statuses otherwise than the code (documented, code): {wrong}"
    for code in _status_codes():  # every status the server answers with, on gRPC and on REST
        assert grpc.StatusCode[code].name == code
    for cls in [errors.ServingError, *errors.ServingError.__subclasses__()]:  # each error of service/errors.py
        assert http_status(cls("m")) == HTTP_STATUS[cls.code] and grpc_status(cls("m")).name == cls.code
    assert HTTP_STATUS["FAILED_PRECONDITION"] == 400 and HTTP_STATUS["PERMISSION_DENIED"] == 403


def test_every_rpc_is_documented() -> None:
    rpcs = {codes(row[0])[0] for row in table(section(DESIGN, "Wire protocol"), "RPC")}
    assert_same(rpcs, {m.name for m in protocol.SERVICE.methods}, 'docs/design.md, "Wire protocol"', "RPCs")


# --- every file ---------------------------------------------------------------------------------------


@cache
def checkout_files() -> list[Path]:
    """The files git tracks or would track (untracked and not ignored), as they are on disk."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sorted({ROOT / p for p in listed.split("\0") if p and (ROOT / p).is_file()})


def test_no_file_refers_to_material_outside_the_repository() -> None:
    # Spelled in pieces, so that this file does not match itself.
    stale = ("DESIGN" + ".md", ".." + "/shared", "/" + "work/")
    hits = []
    for path in checkout_files():
        data = path.read_bytes()
        if b"\0" in data:
            continue
        text = data.decode(errors="replace")
        hits += [f"{path.relative_to(ROOT)}: {s}" for s in stale if s in text]
    assert not hits, "references to files outside the repository:\n" + "\n".join(hits)


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def test_every_relative_markdown_link_points_to_a_file() -> None:
    broken = []
    for path in (p for p in checkout_files() if p.suffix == ".md"):
        for target in LINK.findall(path.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or an anchor in the same file
            file = target.split("#", 1)[0]
            resolved = ROOT / file.lstrip("/") if file.startswith("/") else path.parent / file
            if not resolved.exists():
                broken.append(f"{path.relative_to(ROOT)}: ]({target})")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


# A title may wrap onto the next line (in a docstring, say): whitespace in it counts as one space.
CITATION = re.compile(r"(docs/[\w./-]+\.md)\)?,?\s+\"([^\"]{1,100})\"")
MD_CITATION = re.compile(r"\]\(([\w./-]+\.md)\),?\s+\"([^\"]{1,100})\"")


def test_every_cited_section_exists() -> None:
    """`(docs/design.md, "Metrics")` in code and `[design.md](design.md), "Errors"` in documents."""
    missing = []
    for path in checkout_files():
        if path.suffix not in (".py", ".md", ".yml", ".yaml", ".sh", ".toml") and path.name != "Makefile":
            continue
        text = path.read_text()
        cited = [(ROOT / doc, " ".join(title.split())) for doc, title in CITATION.findall(text)]
        if path.suffix == ".md":
            cited += [(path.parent / doc, " ".join(title.split())) for doc, title in MD_CITATION.findall(text)]
        for doc, title in cited:
            # A citation may shorten a title to its start: "What a client can reach" for "What a client can
            # reach, and the bound on each".
            if not doc.is_file() or not any(name.startswith(title) for _, name, _ in headings(doc)):
                missing.append(f'{path.relative_to(ROOT)}: {os.path.relpath(doc, ROOT)}, "{title}"')
    assert not missing, "citations of sections that do not exist:\n" + "\n".join(missing)


# --- the examples of docs/ ----------------------------------------------------------------------------

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
NEEDS = re.compile(r"^<!-- needs: (\S.*?) -->$")
# An untagged block is a drawing or a program's output; one holding commands must say its language.
COMMAND = re.compile(r"^\s*(\$ |\.venv/bin/|make |python )", re.M)
EXAMPLE_LANGUAGES = ("bash", "console", "python", "json")


@dataclass(frozen=True)
class Example:
    doc: str  # its file's name in docs/
    line: int  # the line of its opening fence, from 1
    language: str
    text: str
    needs: str  # what a `<!-- needs: ... -->` line just above it says it needs; "" when run here

    @property
    def first(self) -> str:
        return self.text.splitlines()[0] if self.text else ""


def examples() -> list[Example]:
    """Every fenced block of docs/*.md, with its language and what it says it needs."""
    found = []
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text()
        lines = text.splitlines()
        for m in FENCE.finditer(text):
            at = text.count("\n", 0, m.start())
            needs = NEEDS.match(lines[at - 1].strip()) if at else None
            found.append(Example(path.name, at + 1, m.group(1), m.group(2), needs.group(1) if needs else ""))
    return found


def example(doc: str, first: str) -> Example:
    [found] = [e for e in examples() if e.doc == doc and e.first == first]
    return found


INCREMENTAL_BUILD = ".venv/bin/pip install --require-hashes -r requirements/graphs.txt   # onnx, which builds the graph"
# The examples the docs tests run: (document, the block's first line) -> the test that runs it, from the text.
RUN_HERE = {
    ("design.md", '{"sequence_axis": 1, "batching": {"max_batch_size": 32}, "limits": {"max_sequence_length": 512}}'):
        "test_configuration_examples_are_read_by_the_loader",
    ("ensembles.md", "{"): "test_configuration_examples_are_read_by_the_loader",
    ("operations.md", "$ qkv serve --tracing-exporter console        # in one terminal"):
        "test_the_console_tracing_example_prints_what_it_shows",
    ("sequences.md", INCREMENTAL_BUILD):
        "test_the_incremental_decoding_example_answers_as_shown",
    ("sequences.md", "from service.tools.incremental import IncrementalG2P"):
        "test_the_incremental_decoding_example_answers_as_shown",
    ("kinds.md", "import numpy as np"): "test_the_custom_kind_walk_serves_and_answers_as_shown",
    ("kinds.md", "{"): "test_the_custom_kind_walk_serves_and_answers_as_shown",
    ("kinds.md", "PYTHONPATH=. qkv serve --model-repository models &"):
        "test_the_custom_kind_walk_serves_and_answers_as_shown",
}  # fmt: skip


def test_every_example_in_docs_runs_here_or_says_what_it_needs() -> None:
    """A block with a language is an example: the tests below run it, or a `<!-- needs: ... -->` line above
    it says what it needs that a test run does not have (a GPU, hours, the network)."""
    found = examples()
    unrun = [f"docs/{e.doc}:{e.line}" for e in found
             if e.language and not e.needs and (e.doc, e.first) not in RUN_HERE]  # fmt: skip
    assert not unrun, f"examples neither run by tests/test_docs.py (RUN_HERE) nor marked <!-- needs: ... -->: {unrun}"
    unknown = [f"docs/{e.doc}:{e.line} ({e.language})" for e in found if e.language not in ("", *EXAMPLE_LANGUAGES)]
    assert not unknown, f"examples in a language these tests do not know: {unknown}"
    hidden = [f"docs/{e.doc}:{e.line}" for e in found if not e.language and COMMAND.search(e.text)]
    assert not hidden, f"untagged blocks holding commands (say their language, ```bash or ```console): {hidden}"
    stale = [key for key in RUN_HERE if not any((e.doc, e.first) == key for e in found)]
    assert not stale, f"RUN_HERE names examples docs/ no longer has: {stale}"
    assert all(callable(globals().get(test)) for test in RUN_HERE.values()), RUN_HERE


def test_configuration_examples_are_read_by_the_loader(tmp_path: Path) -> None:
    """Each config.json of the docs, as written, is one the repository loader accepts."""
    for e in examples():
        if e.language != "json" or e.needs:
            continue
        model = tmp_path / e.doc.removesuffix(".md") / f"line{e.line}"
        (model / "1").mkdir(parents=True)
        raw = json.loads(e.text)
        for output in raw.get("outputs", []):  # the labels file the document puts beside config.json
            if "label_filename" in output:
                labels = "".join(f"class {i}\n" for i in range(output["shape"][-1]))
                (model / output["label_filename"]).write_text(labels)
        config = repository.load_model_config(model, raw=raw)
        assert config.name == model.name, e
        if "sequence_axis" in raw:
            assert config.sequence_axis == raw["sequence_axis"], e
        if "ensemble_scheduling" in raw:
            assert config.ensemble is not None and len(config.ensemble.steps) == len(raw["ensemble_scheduling"]["step"])


def test_the_console_tracing_example_prints_what_it_shows(tmp_path: Path) -> None:
    """operations.md's two commands, the client finding the server by QKV_URL: the phonemes on stdout,
    the trace id on stderr, and the server's console exporter writing that trace's spans."""
    e = example("operations.md", "$ qkv serve --tracing-exporter console        # in one terminal")
    commands = [line[2:].split("#")[0].split() for line in e.text.splitlines() if line.startswith("$ ")]
    shown = [line for line in e.text.splitlines() if not line.startswith("$ ")]
    (serve, *serve_args), (client, *client_args) = (c[1:] for c in commands)
    assert (serve, client) == ("serve", "infer"), commands
    with start_server(serve_args, tmp_path / "server.log") as s:
        env = {**os.environ, "QKV_URL": s.url}
        done = subprocess.run([sys.executable, "-m", "service.cli", client, *client_args], capture_output=True,
                              text=True, timeout=60, cwd=ROOT, env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [shown[1]], (done.stdout, shown)
        trace = re.fullmatch(r"trace ([0-9a-f]{32})", done.stderr.strip())
        assert trace and re.fullmatch(r"trace [0-9a-f]{32}", shown[0]), (done.stderr, shown)
        deadline = time.monotonic() + 30  # the exporter writes a span within 0.2 s of its end; a loaded machine
        while f'"traceId": "{trace.group(1)}"' not in s.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert f'"traceId": "{trace.group(1)}"' in s.output()


def test_the_custom_kind_walk_serves_and_answers_as_shown(tmp_path: Path) -> None:
    """kinds.md's walk, exactly as written and in at most 60 lines: its module written where the server's
    PYTHONPATH points, its config.json beside an empty version directory, the server it starts, and the
    curl call answered as the block under it shows."""
    walk = section(DOCS / "kinds.md", "A custom kind, complete")
    assert len(walk.strip().splitlines()) <= 60, "the custom kind's walk is over 60 lines"
    blocks = [(m.group(1), m.group(2)) for m in FENCE.finditer(walk)]
    assert [language for language, _ in blocks] == ["python", "json", "bash", ""], blocks
    (_, code), (_, config), (_, commands), (_, shown) = blocks
    module = re.search(r"`(\w+)\.py`", walk)
    assert module and f'"{module.group(1)}:' in config, "config.json names the module the walk writes"
    (tmp_path / f"{module.group(1)}.py").write_text(code)
    name = re.search(r"`models/(\w+)/config.json`", walk)
    assert name, "the walk names its model's directory"
    (tmp_path / "models" / name.group(1) / "1").mkdir(parents=True)
    (tmp_path / "models" / name.group(1) / "config.json").write_text(config)
    serve, curl = " ".join(commands.replace("\\\n", " ").split()).split(" & ")
    assert serve == "PYTHONPATH=. qkv serve --model-repository models", serve
    args = shlex.split(curl)
    assert args[:2] == ["curl", "-s"] and args[3] == "-d", args
    path = args[2].removeprefix("localhost:8000")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    with start_server(["--model-repository", str(tmp_path / "models")], tmp_path / "server.log", env) as s:
        done = subprocess.run(["curl", "-s", f"{s.http_url}{path}", "-d", args[4]], capture_output=True, text=True,
                              timeout=30, check=True)  # fmt: skip
        assert json.loads(done.stdout) == json.loads(shown), done.stdout
    assert "Traceback" not in s.output()


def test_the_incremental_decoding_example_answers_as_shown(tmp_path: Path) -> None:
    """sequences.md's commands, in a directory of the test's instead of /tmp/models: the install line
    brings what building the graph imports, the build and the link make the repository, the server serves
    it, and the Python example returns what its comment shows."""
    build = example("sequences.md", INCREMENTAL_BUILD)
    models = tmp_path / "models"
    lines = [line.split("#")[0].strip().replace("/tmp/models", str(models)) for line in build.text.splitlines()]
    install, make, link, serve = lines
    lock = (ROOT / install.split("-r ")[1]).read_text()
    assert re.search(r"^onnx==", lock, re.M), f"{install}: the lock does not install onnx"
    assert make.startswith(".venv/bin/python -m export.stateful_decoder ") and "import onnx" in (
        ROOT / "export" / "stateful_decoder.py").read_text()  # fmt: skip
    for command in (make.replace(".venv/bin/python", sys.executable), link):
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, (command, done.stderr)
    assert serve.startswith(".venv/bin/qkv serve ")
    with start_server(serve.split()[2:], tmp_path / "server.log") as s:
        code = example("sequences.md", "from service.tools.incremental import IncrementalG2P").text.replace(
            "127.0.0.1:8001", s.url)  # fmt: skip
        *setup, last = code.strip().splitlines()
        expression, _, comment = last.partition("  # ")
        namespace: dict[str, Any] = {}
        exec("\n".join(setup), namespace)  # the document's own code
        assert eval(expression, namespace) == ast.literal_eval(comment), (expression, comment)
