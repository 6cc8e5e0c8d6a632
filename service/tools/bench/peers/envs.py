"""The peers' virtual environments: one per peer, from pinned versions, made once and kept in a cache.

onnxruntime, numpy, grpcio and protobuf are taken at requirements/serve.txt's pins, so that every server
runs the same onnxruntime as qkv; where a peer cannot, the exception is pinned and says why. infinity-emb,
the text-model bench's peer (`qkv bench --text-model`), also takes torch, transformers and optimum at
requirements/hf.txt's pins. Each
environment's folder is named by a hash of its pins, so that a changed pin makes a new one; `pip freeze`
of each is written beside it and recorded with the results.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

__all__ = ["CACHE", "PEERS", "TEXT_PEERS", "ensure", "freeze", "lock_pin", "pins", "serve_pin"]

ROOT = Path(__file__).resolve().parents[4]
CACHE = Path(os.environ.get("QKV_PEERS_CACHE", ROOT / ".peers"))  # gitignored
PEERS = ("plain", "triton", "mlserver")
TEXT_PEERS = ("infinity",)  # qkv bench --text-model's
INFINITY = "infinity-emb[optimum,server]==0.0.78"  # its ONNX engine (optimum) and its OpenAI-style server


def lock_pin(package: str, lock: str) -> str:
    """`package==version` as requirements/LOCK.txt pins it."""
    text = (ROOT / "requirements" / f"{lock}.txt").read_text()
    m = re.search(rf"^{re.escape(package)}==(\S+)", text, re.MULTILINE)
    if not m:
        raise LookupError(f"requirements/{lock}.txt pins no {package}")
    return f"{package}=={m.group(1)}"


def serve_pin(package: str) -> str:
    """`package==version` as requirements/serve.txt pins it."""
    return lock_pin(package, "serve")


def pins(peer: str) -> tuple[str, ...]:
    """What `pip install` puts into `peer`'s environment."""
    onnxruntime, numpy = serve_pin("onnxruntime"), serve_pin("numpy")
    if peer == "plain":
        return serve_pin("grpcio"), serve_pin("protobuf"), numpy, onnxruntime
    if peer == "triton":
        return "nvidia-pytriton==0.7.0", "numpy==1.26.4", onnxruntime  # PyTriton 0.7.0 requires numpy < 2
    if peer == "mlserver":
        # uvloop 0.22 removed the implicit event loop that MLServer 1.7.1's worker processes ask for: they die
        return "mlserver==1.7.1", numpy, onnxruntime, "uvloop==0.21.0"
    if peer == "infinity":
        hf = [lock_pin(p, "hf") for p in ("torch", "transformers", "optimum", "optimum-onnx", "huggingface-hub")]
        return INFINITY, "numpy==1.26.4", onnxruntime, serve_pin("tokenizers"), *hf  # infinity-emb requires numpy < 2
    raise ValueError(f"no peer {peer!r} (choose from {', '.join(PEERS)})")


def ensure(peer: str, cache: Path = CACHE) -> Path:
    """The Python of `peer`'s environment, made (venv + pip install of `pins`) if not made already."""
    wanted = pins(peer)
    folder = cache / f"{peer}-{hashlib.sha256(' '.join(wanted).encode()).hexdigest()[:10]}"
    python = folder / "bin" / "python"
    if (folder / "freeze.txt").exists():  # written last: an environment whose install broke off is redone
        return python
    cache.mkdir(parents=True, exist_ok=True)
    print(f"peers: making {folder} ({' '.join(wanted)})", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(folder)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *wanted], check=True)
    (folder / "freeze.txt").write_text("\n".join(freeze(python)) + "\n")
    return python


def freeze(python: Path) -> list[str]:
    """`pip freeze` of the environment `python` belongs to."""
    done = subprocess.run([str(python), "-m", "pip", "freeze"], capture_output=True, text=True, check=True)
    return done.stdout.split()
