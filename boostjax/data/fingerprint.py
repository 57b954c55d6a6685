"""Data known by its content: the fingerprint a run stores, so that a resumed run accepts its data
at another path and refuses other data at the same path (`boostjax.training.prepare.open_run`).

A fingerprint is ``blake3:<hex>``, the BLAKE3 digest of the `b3sum` lines (``<digest>  <name>``) of
the files that make up the data, in the order the data is read:

    a tokenised folder   train.bin, train.docs.npy, val.bin, val.docs.npy, where a split's ``.bin`` is its
                         stream, the concatenation of its shards (so the fingerprint is the same for any
                         shard size and for a version 1 folder of the same tokens); written into meta.json
                         by `boostjax tokenize`, by hand in the folder (docs/tokenised-data.md):
                         ``{ cat train-*.bin | b3sum --no-names | sed 's/$/  train.bin/'; b3sum
                         train.docs.npy; cat val-*.bin | b3sum --no-names | sed 's/$/  val.bin/'; b3sum
                         val.docs.npy; } | b3sum --no-names``; a version 1 folder written before
                         fingerprints existed is hashed when a run needs it (meta.json is left as it is)
    a folder of text     its text files, named relative to the folder
    '' (the stdlib)      this interpreter's stdlib sources, named relative to the stdlib: another
                         Python's stdlib is other data
    a .bin or text file  its bytes alone (the name is not part of it)

Hashing runs at disk speed (`boostjax.runs.digest`), so even the files hashed at a run's start cost
about as much as the one read that checks their token ids.
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import Iterable

from boostjax.runs import digest

PREFIX: str = "blake3:"
PATTERN = re.compile(r"blake3:[0-9a-f]{64}")


def of_digests(named: Iterable[tuple[str, str]]) -> str:
    """The fingerprint of files given as (name, BLAKE3 hex digest), in reading order."""
    return PREFIX + digest.digest_of_lines(f"{d}  {name}\n" for name, d in named)


def of_files(root: pathlib.Path, files: list[pathlib.Path]) -> str:
    """The fingerprint of `files`, named relative to `root` (hashed on several threads)."""
    return of_digests((p.relative_to(root).as_posix(), d) for p, d in zip(files, digest.file_digests(files)))


def of_file(path: str | os.PathLike) -> str:
    """A single file's fingerprint: its bytes' digest (the file's name is not part of it)."""
    return PREFIX + digest.file_digest(path)
