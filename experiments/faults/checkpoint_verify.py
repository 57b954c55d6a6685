"""What checkpoint checksums cost: save and restore of a 1 GB and a 4 GB state with and without verification.

    python -m experiments.faults.checkpoint_verify                       # 1 and 4 GB, in /tmp; results committed
    python -m experiments.faults.checkpoint_verify --sizes-gb 0.05 --hash-mb 64 --out /tmp/cv   # a quick check

1. Hashes: one `--hash-mb` MB file of random bytes hashed by SHA-256 (what boostjax wrote before,
   `hashlib`), BLAKE2b, BLAKE3 on one thread (`boostjax.runs.digest`, what it writes now), BLAKE3 with its
   own threads and xxh3_128 (when `xxhash` is installed), each from the page cache ("warm") and after the
   file was dropped from it (`posix_fadvise(DONTNEED)`: "cold"; in a virtual machine the host may still
   cache it), and a plain read of the cold file (the disk).
2. Checkpoints: a state of `--sizes-gb` GB (float32 "parameters" plus two "optimizer moments", 12
   arrays) saved by `boostjax.runs.checkpoint.Checkpointer` (Orbax, synchronous here so that the time is
   the save's) with and without its checksums (`write_manifest` skipped), then restored after its files
   were dropped from the page cache, with and without verification (`restore_latest`, and the Orbax read
   alone); plus the checksums alone, warm and cold, by BLAKE3 and by the SHA-256 that boostjax used before.
   Each measurement `--repeats` times, the best kept (the machine is shared). The files are deleted.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import shutil
import tempfile
import time

import blake3
import jax
import numpy as np

from experiments import common

from boostjax.runs import checkpoint as ck
from boostjax.runs import digest

N_ARRAYS = 4  # parameter arrays; the optimizer state holds two more of each shape


def drop_cache(paths) -> None:
    """Ask the kernel to forget the pages of `paths` (written back first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def hashers() -> dict:
    out = {"sha256 (hashlib)": hashlib.sha256, "blake2b (hashlib)": hashlib.blake2b,
           "blake3, 1 thread": blake3.blake3, "blake3, its threads": lambda: blake3.blake3(max_threads=blake3.blake3.AUTO)}
    try:
        import xxhash

        out["xxh3_128 (xxhash, not cryptographic)"] = xxhash.xxh3_128
    except ImportError:
        pass
    return out


def _hash_file(path: pathlib.Path, make) -> None:
    h = make() if make is not None else None
    buf = bytearray(digest.CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            if h is not None:
                h.update(view[:n])


def best(fn, repeats: int, before=None) -> float:
    """The shortest of `repeats` timed calls of `fn` (`before` runs untimed ahead of each)."""
    times = []
    for _ in range(repeats):
        if before:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def hash_rates(folder: pathlib.Path, mb: int, repeats: int) -> list[dict]:
    f = folder / "hash-input"
    rng = np.random.default_rng(0)
    with open(f, "wb") as out:
        for _ in range(mb // 64 or 1):
            out.write(rng.integers(0, 256, min(mb, 64) << 20, dtype=np.uint8).tobytes())
    size = f.stat().st_size
    rows = []
    for name, make in [("read only (the disk)", None), *hashers().items()]:
        row = {"hash": name, "load_average": os.getloadavg()[0]}
        if make is not None:
            _hash_file(f, make)  # into the page cache
            row["warm_GBps"] = size / best(lambda: _hash_file(f, make), repeats) / 1e9
        row["cold_GBps"] = size / best(lambda: _hash_file(f, make), repeats, lambda: drop_cache([f])) / 1e9
        rows.append(row)
        common.log(f"{name}: {row}")
    f.unlink()
    return rows


def state(gb: float) -> tuple[dict, dict]:
    """(params, opt_state): float32 arrays of `gb` GB in all, one third parameters."""
    n = int(gb * 1e9 / 4 / 3 / N_ARRAYS)
    rng = np.random.default_rng(1)
    params = {f"w{i}": rng.standard_normal(n, dtype=np.float32) for i in range(N_ARRAYS)}
    opt = {"mu": {k: v * 0.1 for k, v in params.items()}, "nu": {k: v * v for k, v in params.items()}}
    return params, opt


def checkpoint_times(folder: pathlib.Path, gb: float, repeats: int) -> dict:
    params, opt = state(gb)
    nbytes = sum(v.nbytes for v in params.values()) * 3
    real_write = ck.write_manifest
    row: dict = {"state_GB": nbytes / 1e9}
    for verify in (False, True):
        ck.write_manifest = real_write if verify else (lambda *a, **k: None)
        times = []
        for r in range(repeats):
            d = folder / f"run-{gb}-{verify}-{r}"
            c = ck.Checkpointer(d, async_save=False)
            t = time.perf_counter()
            c.save(1, params, opt, {"step": 1})
            c.wait()
            times.append(time.perf_counter() - t)
            c.close()
            shutil.rmtree(d)
        row["save_with_checksums_s" if verify else "save_s"] = min(times)
    ck.write_manifest = real_write
    d = folder / f"run-{gb}"
    c = ck.Checkpointer(d, async_save=False)
    c.save(1, params, opt, {"step": 1})
    c.close()
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, opt))
    del params, opt  # the restores below need the memory
    step = d / "1"
    files = [p for p in step.rglob("*") if p.is_file()]
    row["files"] = len(files)
    row["largest_file_MB"] = max(p.stat().st_size for p in files) / 1e6
    cold = lambda: drop_cache(files)  # noqa: E731
    reader = ck.Checkpointer(d, writer=False)
    row["restore_s"] = best(lambda: reader._restore_state(1, *like), repeats, cold)
    row["restore_verified_s"] = best(lambda: reader.restore_latest(*like), repeats, cold)
    assert reader.verify(1) == (None, True)
    row["verify_warm_s"] = best(lambda: reader.verify(1), repeats)
    row["verify_cold_s"] = best(lambda: reader.verify(1), repeats, cold)
    data = [p for p in files if not p.name.startswith(ck.MANIFEST)]
    row["sha256_warm_s"] = best(lambda: [digest.file_digest(p, digest.SHA256) for p in data], repeats)
    row["sha256_cold_s"] = best(lambda: [digest.file_digest(p, digest.SHA256) for p in data], repeats, cold)
    reader.close()
    shutil.rmtree(d)
    for k in ("verify_warm", "verify_cold", "sha256_warm", "sha256_cold"):
        row[f"{k}_GBps"] = nbytes / row[f"{k}_s"] / 1e9
    row["load_average"] = os.getloadavg()[0]
    common.log(f"{gb} GB: {row}")
    return row


def markdown(res: dict) -> str:
    load = [r["load_average"] for r in res["hashes"] + res["checkpoints"]]
    t = ["# Checkpoint checksums at disk speed", "",
         f"`{res['command']}` on {res['machine']}. Best of {res['repeats']} (a shared machine). Cold: the files "
         "dropped from the page cache with `posix_fadvise(DONTNEED)` before each try (a virtual machine's host "
         "may still cache them, so cold rates are an upper bound on a real disk's). The machine's 1-minute load "
         f"average during the runs: {min(load):.1f} to {max(load):.1f} on {os.cpu_count()} cores (other jobs); a hash "
         "on one thread gets the share of a core that the load leaves it.", "",
         f"## Hashes of one {res['hash_mb']} MB file (GB/s)", "", "| hash | warm | cold |", "| --- | --- | --- |"]
    for r in res["hashes"]:
        warm = f"{r['warm_GBps']:.2f}" if "warm_GBps" in r else "-"
        t.append(f"| {r['hash']} | {warm} | {r['cold_GBps']:.2f} |")
    t += ["", "## Save and restore (seconds)", "",
          "| state | files | save | save + BLAKE3SUMS | restore (cold) | verify + restore (cold) | verify warm "
          "| verify cold | SHA-256 warm (before) | SHA-256 cold (before) |", "| --- | --- | --- | --- | --- | --- | --- "
          "| --- | --- | --- |"]
    for r in res["checkpoints"]:
        t.append(f"| {r['state_GB']:.2f} GB | {r['files']} | {r['save_s']:.2f} | {r['save_with_checksums_s']:.2f} | "
                 f"{r['restore_s']:.2f} | {r['restore_verified_s']:.2f} | {r['verify_warm_s']:.2f} "
                 f"({r['verify_warm_GBps']:.1f} GB/s) | {r['verify_cold_s']:.2f} ({r['verify_cold_GBps']:.1f} GB/s) | "
                 f"{r['sha256_warm_s']:.2f} ({r['sha256_warm_GBps']:.1f} GB/s) | {r['sha256_cold_s']:.2f} "
                 f"({r['sha256_cold_GBps']:.1f} GB/s) |")
    t += ["", "Save: Orbax's synchronous save and commit; + BLAKE3SUMS: the same with boostjax's checksums written "
          "after the commit (from the page cache: the files were just written). Restore: the Orbax read alone; "
          "verify + restore: `restore_latest`, which hashes every file first. Verify: the checksums alone "
          "(`Checkpointer.verify`), BLAKE3 on up to "
          f"{digest.MAX_WORKERS} threads; SHA-256: the same files hashed one after another as boostjax did before.",
          ""]
    return "\n".join(t)


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    p = common.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-gb", type=float, nargs="+", default=[1.0, 4.0], help="state sizes to save and restore")
    p.add_argument("--hash-mb", type=int, default=1024, help="size of the file the hashes are timed on")
    p.add_argument("--repeats", type=int, default=2, help="tries per measurement (the best is kept)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go (deleted afterwards)")
    p.add_argument("--out", default=str(common.RESULTS), help="where checkpoint_verify.{json,md} go")
    return p


def main(argv=None) -> None:
    p = parser()
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    work = pathlib.Path(tempfile.mkdtemp(prefix="checkpoint-verify-", dir=args.dir))
    res = {"command": common.command_line("checkpoint_verify", argv), "repeats": args.repeats,
           "hash_mb": args.hash_mb, "machine": f"{common.machine_line()}, "
           f"blake3 {blake3.__version__}, numpy {np.__version__}", "hashes": [], "checkpoints": []}
    try:  # the results are written after each part, so that a run stopped early keeps what it measured
        res["hashes"] = hash_rates(work, args.hash_mb, args.repeats)
        for gb in args.sizes_gb:
            res["checkpoints"].append(checkpoint_times(work, gb, args.repeats))
            common.write(args.out, "checkpoint_verify", data=res, md=lambda: markdown(res),
                             command=res["command"], started=t0, echo=gb == args.sizes_gb[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
