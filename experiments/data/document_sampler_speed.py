"""Host time per batch of the document sampler against random windows (docs/data.md).

    python -m experiments.data.document_sampler_speed

The built-in corpus at 16 x 512, then a 50 M-token uint16 memmap with 100 k documents at 64 x 2048
(written to a temporary file and removed)."""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from boostjax import data
from experiments import common


def per_batch_ms(it: data.BatchIterator, n: int) -> float:
    it.batch_at(0)
    t = time.perf_counter()
    for k in range(1, n + 1):
        it.batch_at(k)
    return (time.perf_counter() - t) / n * 1e3


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_out(ap, "document_sampler_speed", from_json=False)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    md = common.Lines()
    c = data.stdlib_corpus()
    md(f"stdlib, 16x512: windows {per_batch_ms(data.BatchIterator(c.train, 16, 512, 0), 200):.2f} ms, "
          f"documents {per_batch_ms(data.DocumentIterator(c.train, c.train_docs, 16, 512, 0, segments=True), 200):.2f} ms")
    n = 50_000_000
    fd, path = tempfile.mkstemp(suffix=".bin")
    os.close(fd)
    try:
        np.random.default_rng(0).integers(0, 50000, n, dtype=np.uint16).tofile(path)
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        docs = np.unique(np.append(np.random.default_rng(1).integers(1, n, 100_000), 0)).astype(np.int64)
        it = data.DocumentIterator(tokens, docs, 64, 2048, 0, segments=True)
        t = time.perf_counter()
        it.batch_at(0)
        first = (time.perf_counter() - t) * 1e3
        md(f"memmap {n / 1e6:.0f}M tokens, {len(docs)} documents, 64x2048: first batch {first:.0f} ms "
              f"(epoch permutations), then {per_batch_ms(it, 50):.1f} ms per batch")
    finally:
        os.remove(path)
    common.write(args.out, "document_sampler_speed", md=str(md), echo=False)


if __name__ == "__main__":
    main()
