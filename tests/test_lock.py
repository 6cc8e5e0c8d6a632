"""The locks in requirements/ held to pyproject.toml, and to what installs them.

Every dependency set of pyproject.toml has a lock written by pip-compile (`make lock`): each
requirement of the set (extras expanded) is pinned there at a version its specifier allows, every
pinned distribution carries its sha256 hashes, and no two locks pin one distribution at two
versions. The Makefile and both Dockerfiles install from a lock with --require-hashes and then the
project with --no-deps, so what is installed is exactly what was locked. No network: the files only.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "requirements"
PYPROJECT = ROOT / "pyproject.toml"
# Each lock and the extras of pyproject.toml it covers (serve: the [project] dependencies alone).
SETS: dict[str, tuple[str, ...]] = {
    "serve": (),
    "plot": ("plot",),
    "trace": ("trace",),
    "export": ("export",),
    "client": ("client",),
    "graphs": ("graphs",),
    "hf": ("hf",),
    "dev": ("dev",),
}
# The CUDA image's lock: the serving set with onnxruntime-gpu in place of onnxruntime.
CUDA_SWAP = ("onnxruntime", "onnxruntime-gpu")
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


@dataclass
class Pin:
    name: NormalizedName
    version: Version
    hashes: list[str]
    via: list[str] = field(default_factory=list)


@dataclass
class Lock:
    header: list[str]
    pins: dict[NormalizedName, Pin]


@cache
def read_lock(name: str) -> Lock:
    """A pip-compile output: its header comment, and each pin with its hashes and `# via` notes."""
    path = REQUIREMENTS / f"{name}.txt"
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing: run `make lock`"
    header: list[str] = []
    pins: dict[NormalizedName, Pin] = {}
    current: Pin | None = None
    entry = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if entry or (line and not line.startswith("#")):
            entry += line.removesuffix("\\").strip() + " "
            if line.endswith("\\"):
                continue
            m = PIN.match(entry)
            assert m, f"{path.name}: not a pin: {entry.strip()}"
            current = Pin(canonicalize_name(m.group(1)), Version(m.group(2)), HASH.findall(entry))
            rest = HASH.sub("", entry[m.end() :]).strip()
            assert not rest, f"{path.name}: {current.name}: unexpected {rest!r}"
            assert current.name not in pins, f"{path.name}: {current.name} pinned twice"
            pins[current.name] = current
            entry = ""
        elif line.startswith("#"):
            if current is None:
                header.append(line)
            else:
                current.via.append(line.lstrip("#").strip().removeprefix("via").strip())
    assert not entry, f"{path.name}: dangling line continuation"
    return Lock(header, pins)


@cache
def project() -> dict:
    return tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]


def requirements_of(extras: tuple[str, ...]) -> list[Requirement]:
    """The [project] dependencies and those of `extras`, self-references (qkv[...]) expanded."""
    name = canonicalize_name(project()["name"])
    optional = project()["optional-dependencies"]
    found: list[Requirement] = [Requirement(r) for r in project()["dependencies"]]
    pending, seen = list(extras), set()
    while pending:
        extra = pending.pop()
        if extra in seen:
            continue
        seen.add(extra)
        assert extra in optional, f"pyproject.toml has no extra {extra!r}"
        for text in optional[extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == name:
                pending += sorted(req.extras)
            else:
                found.append(req)
    return [r for r in found if r.marker is None or r.marker.evaluate()]


def cuda_requirements() -> list[Requirement]:
    path = REQUIREMENTS / "cuda.in"
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [Requirement(line) for line in lines if line and not line.startswith("#")]


def check_pinned(lock_name: str, requirements: list[Requirement]) -> None:
    pins = read_lock(lock_name).pins
    for req in requirements:
        pin = pins.get(canonicalize_name(req.name))
        assert pin, f"requirements/{lock_name}.txt lacks {req}: run `make lock`"
        assert req.specifier.contains(pin.version, prereleases=True), (
            f"requirements/{lock_name}.txt pins {pin.name}=={pin.version}, outside pyproject.toml's {req}: "
            "run `make lock`"
        )


# --- the locks against pyproject.toml ----------------------------------------------------------------


@pytest.mark.parametrize("lock_name", SETS)
def test_every_requirement_of_the_set_is_pinned_within_its_specifier(lock_name: str) -> None:
    check_pinned(lock_name, requirements_of(SETS[lock_name]))


@pytest.mark.parametrize("lock_name", SETS)
def test_no_lock_keeps_a_requirement_pyproject_dropped(lock_name: str) -> None:
    """pip-compile notes `via qkv (pyproject.toml)` on a set's own requirements: each must still be one."""
    wanted = {canonicalize_name(r.name) for r in requirements_of(SETS[lock_name])}
    direct = {n for n, pin in read_lock(lock_name).pins.items() if "qkv (pyproject.toml)" in pin.via}
    assert direct <= wanted, f"requirements/{lock_name}.txt: no longer in pyproject.toml: {sorted(direct - wanted)}"


@pytest.mark.parametrize("lock_name", [*SETS, "cuda"])
def test_each_lock_is_written_by_pip_compile_with_hashes(lock_name: str) -> None:
    header = " ".join(read_lock(lock_name).header)
    command = re.search(r"#\s+(pip-compile .*)", "\n".join(read_lock(lock_name).header))
    assert command, f"requirements/{lock_name}.txt has no pip-compile header"
    args = command.group(1).split()
    assert "--generate-hashes" in args and f"--output-file=requirements/{lock_name}.txt" in args, header
    extras = sorted(a.removeprefix("--extra=") for a in args if a.startswith("--extra="))
    assert tuple(extras) == SETS.get(lock_name, ()), f"requirements/{lock_name}.txt compiled for {extras}"
    assert args[-1] == ("requirements/cuda.in" if lock_name == "cuda" else "pyproject.toml"), args
    # The others are resolved within the dev lock, so one distribution has one version everywhere.
    assert (lock_name == "dev") == ("--constraint=requirements/dev.txt" not in args), args


@pytest.mark.parametrize("lock_name", [*SETS, "cuda"])
def test_every_pin_carries_its_hashes(lock_name: str) -> None:
    lock = read_lock(lock_name)
    assert lock.pins
    unhashed = [str(pin.name) for pin in lock.pins.values() if not pin.hashes]
    assert not unhashed, f"requirements/{lock_name}.txt: no --hash=sha256: for {unhashed}"


def test_every_line_of_every_lock_is_a_comment_or_part_of_a_hashed_pin() -> None:
    for path in sorted(REQUIREMENTS.glob("*.txt")):
        assert path.stem in {*SETS, "cuda"}, f"{path.name}: a lock no set names (add it to SETS)"
        entry = ""
        for line in path.read_text(encoding="utf-8").splitlines():
            if not entry and (not line.strip() or line.lstrip().startswith("#")):
                continue
            entry += line + "\n"
            if not line.endswith("\\"):
                assert HASH.search(entry), f"{path.name}: no --hash=sha256: in {entry.strip()}"
                entry = ""


def test_the_locks_agree_on_every_version() -> None:
    versions: dict[NormalizedName, dict[Version, list[str]]] = {}
    for lock_name in [*SETS, "cuda"]:
        for pin in read_lock(lock_name).pins.values():
            versions.setdefault(pin.name, {}).setdefault(pin.version, []).append(lock_name)
    split = {name: found for name, found in versions.items() if len(found) > 1}
    assert not split, f"one distribution at several versions: {split}"


def test_the_known_good_pins_are_kept() -> None:
    dev = read_lock("dev").pins
    assert str(dev[canonicalize_name("grpcio")].version) == "1.85.3"
    for name in ("grpcio-health-checking", "grpcio-reflection", "grpcio-tools"):
        assert str(dev[canonicalize_name(name)].version) == "1.81.1", name
    assert dev[canonicalize_name("protobuf")].version.major == 6
    assert str(dev[canonicalize_name("tritonclient")].version) == "2.73.0"
    assert dev[canonicalize_name("torch")].version.public == "2.13.0"
    assert "torch" not in read_lock("serve").pins, "the serving lock must not carry torch"


def test_the_cuda_lock_is_the_serving_set_with_onnxruntime_gpu() -> None:
    cpu, gpu = CUDA_SWAP
    serve = {canonicalize_name(r.name): r for r in requirements_of(())}
    cuda = {canonicalize_name(r.name): r for r in cuda_requirements()}
    assert cpu in serve and gpu in cuda and cpu not in cuda
    del serve[canonicalize_name(cpu)], cuda[canonicalize_name(gpu)]
    assert {n: str(r) for n, r in cuda.items()} == {n: str(r) for n, r in serve.items()}, (
        "requirements/cuda.in differs from pyproject.toml's [project] dependencies"
    )
    check_pinned("cuda", cuda_requirements())
    assert cpu not in read_lock("cuda").pins, "both onnxruntime wheels provide the module onnxruntime"
    [gpu_requirement] = [r for r in cuda_requirements() if canonicalize_name(r.name) == gpu]
    assert re.fullmatch(r"==\d+\.\d+\.\d+", str(gpu_requirement.specifier)), "pin onnxruntime-gpu exactly"


# --- what installs the locks ---------------------------------------------------------------------


def makefile() -> tuple[dict[str, str], dict[str, tuple[list[str], list[str]]]]:
    """The Makefile's variables and its rules (target -> prerequisites, recipe lines), continuations joined."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    variables: dict[str, str] = {}
    rules: dict[str, tuple[list[str], list[str]]] = {}
    target = None
    for line in text.splitlines():
        if line.startswith("\t") and target:
            rules[target][1].append(line.strip())
            continue
        target = None
        if m := re.match(r"^([A-Z_]+)\s*[:?]?=\s*(.*)$", line):
            variables[m.group(1)] = m.group(2).strip()
        elif (m := re.match(r"^([^\s#:=][^:=]*):(?!=)(.*)$", line)) and not line.startswith("."):
            target = m.group(1).strip()
            rules[target] = (m.group(2).split(), [])
    return variables, rules


def expand(text: str, variables: dict[str, str]) -> str:
    for _ in range(10):
        text = re.sub(r"\$\(([A-Z_]+)\)", lambda m: variables.get(m.group(1), m.group(0)), text)
    return text


@pytest.mark.parametrize(("target", "extras"), [("$(VENV)/.installed", ("plot", "client")), ("$(VENV)/.dev", ("dev",))])
def test_the_makefile_installs_the_locks_with_hashes_then_the_project_alone(
    target: str, extras: tuple[str, ...]
) -> None:
    variables, rules = makefile()
    prerequisites, recipe = rules[target]
    installs = [expand(line, variables) for line in recipe if "pip install" in expand(line, variables)]
    locked = [line for line in installs if "--require-hashes" in line]
    assert locked, f"{target} installs nothing with --require-hashes: {installs}"
    files = [f for line in locked for f in re.findall(r"-r\s+(requirements/\S+\.txt)", line)]
    assert files, locked
    for line in installs:
        assert line in locked or re.search(r"--no-deps\s+-e\s+\.$", line), f"{target}: an unlocked install: {line}"
    assert installs[-1] not in locked, f"{target} does not install the project (`--no-deps -e .`) last"
    # The locks installed cover the set, and the stamp is remade when one of them changes.
    covered = {n for f in files for n in read_lock(Path(f).stem).pins}
    wanted = {canonicalize_name(r.name) for r in requirements_of(extras)}
    assert wanted <= covered, f"{target} misses {sorted(wanted - covered)}"
    assert set(files) <= set(prerequisites), f"{target} does not depend on {files}"


def test_make_lock_writes_every_lock() -> None:
    variables, rules = makefile()
    recipe = " ".join(expand(line, variables) for line in rules["lock"][1])
    assert "pip-compile" in recipe and "--generate-hashes" in recipe
    assert "--upgrade" in variables["COMPILE"] and "UPGRADE" in variables["COMPILE"]
    for lock_name in ["dev", "serve", "cuda"]:
        assert f"-o requirements/{lock_name}.txt" in recipe, lock_name
    for extra in ("plot", "trace", "export", "client", "graphs"):
        assert re.search(rf"for extra in [^;]*\b{extra}\b", recipe), extra


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if not line.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        keyword, _, args = line.strip().partition(" ")
        if keyword:
            found.append((keyword.upper(), " ".join(args.split())))
    return found


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_the_images_install_their_lock_with_hashes_then_the_wheel_alone(dockerfile: str) -> None:
    lock_name = {"Dockerfile": "serve", "Dockerfile.cuda": "cuda"}[dockerfile]
    instructions = dockerfile_instructions(ROOT / "deploy" / "docker" / dockerfile)
    copies = [args for kw, args in instructions if kw == "COPY" and args.startswith(f"requirements/{lock_name}.txt ")]
    assert copies, f"{dockerfile} does not copy requirements/{lock_name}.txt"
    [destination] = {c.split()[-1] for c in copies}
    assert destination == "/opt/qkv/requirements.lock"
    runs = [args for kw, args in instructions if kw == "RUN"]
    installs = [part.strip() for run in runs for part in run.split("&&") if "pip install" in part]
    assert installs, dockerfile
    for install in installs:
        hashed = "--require-hashes" in install and f"-r {destination}" in install
        assert hashed or ("--no-deps" in install and "/wheels/" in install), f"{dockerfile}: unlocked: {install}"
    assert any("--require-hashes" in i for i in installs) and any("--no-deps" in i for i in installs), installs
    # The lock and the list of what was installed stay in the image.
    final = instructions[max(i for i, (kw, _) in enumerate(instructions) if kw == "FROM") :]
    kept = " ".join(args for kw, args in final if kw == "COPY")
    assert "/opt/qkv/requirements.lock" in kept and "/opt/qkv/sbom.txt" in kept, kept
    assert any("pip list --format=freeze" in run and "/opt/qkv/sbom.txt" in run for run in runs), runs


def test_the_offline_wheelhouse_is_the_serving_lock() -> None:
    script = (ROOT / "deploy" / "docker" / "offline-bases.sh").read_text(encoding="utf-8")
    assert "lock=$root/requirements/serve.txt" in script
    assert re.search(r'--require-hashes -r "\$lock"', script), "the stand-in wheelhouse is not the hash-checked lock"
