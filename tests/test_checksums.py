"""Checkpoint checksums: BLAKE3SUMS in the b3sum format, the SHA256SUMS of older steps still verified, a
multi-process save split into per-process parts that together cover the step, each process hashing only
its own files, and file digests that match the reference implementations."""

import hashlib

import blake3
import numpy as np
import pytest

from boostjax.runs import checkpoint as ck
from boostjax.runs import digest
from boostjax.runtime import multihost

FILES = {"_CHECKPOINT_METADATA": b"meta", "state/manifest.ocdbt": b"root", "state/d/abc": bytes(range(256)) * 300,
         "state/ocdbt.process_0/d/x": b"p0" * 5000, "state/ocdbt.process_1/d/y": b"p1" * 7000,
         "state/array_metadatas/process_1": b"am1"}


def _step(tmp_path):
    step = tmp_path / "4"
    for rel, data in FILES.items():
        (step / rel).parent.mkdir(parents=True, exist_ok=True)
        (step / rel).write_bytes(data)
    return step


def test_file_digests_match_the_reference_implementations(tmp_path):
    paths = []
    for i, n in enumerate([0, 1, digest.CHUNK - 1, digest.CHUNK + 17, 3]):
        p = tmp_path / f"f{i}"
        p.write_bytes(np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes())
        paths.append(p)
    want = [blake3.blake3(p.read_bytes()).hexdigest() for p in paths]
    assert digest.file_digests(paths) == want  # threaded, in the order given
    assert digest.file_digests(paths, workers=1) == want
    assert digest.file_digest(paths[3], digest.SHA256) == hashlib.sha256(paths[3].read_bytes()).hexdigest()


def test_single_process_manifest_is_b3sum_format_and_catches_damage(tmp_path):
    step = _step(tmp_path)
    ck.write_manifest(step)
    lines = (step / ck.MANIFEST).read_text().splitlines()
    assert sorted(line.split("  ", 1)[1] for line in lines) == sorted(FILES)  # every file, b3sum's two spaces
    for line in lines:
        d, rel = line.split("  ", 1)
        assert d == blake3.blake3(FILES[rel]).hexdigest()
    assert ck.verify_manifest(step) == (None, True)
    (step / "state/d/abc").write_bytes(FILES["state/d/abc"][:-1])  # truncated
    assert ck.verify_manifest(step) == ("state/d/abc: checksum mismatch", True)
    (step / "state/d/abc").unlink()
    assert ck.verify_manifest(step) == ("state/d/abc: missing", True)


def test_older_sha256sums_still_verify(tmp_path):
    step = _step(tmp_path)
    (step / ck.LEGACY_MANIFEST).write_text("".join(f"{hashlib.sha256(b).hexdigest()}  {r}\n" for r, b in FILES.items()))
    assert ck.verify_manifest(step) == (None, True)
    (step / "state/ocdbt.process_1/d/y").write_bytes(b"p1" * 6999 + b"xx")
    assert ck.verify_manifest(step) == ("state/ocdbt.process_1/d/y: checksum mismatch", True)
    (step / ck.LEGACY_MANIFEST).write_text("nonsense\n")
    assert ck.verify_manifest(step)[0] == f"{ck.LEGACY_MANIFEST} is malformed"


def test_each_process_hashes_only_its_files_and_the_parts_cover_the_step(tmp_path, monkeypatch):
    step = _step(tmp_path)
    hashed: list[str] = []
    real = digest.file_digests
    monkeypatch.setattr(digest, "file_digests", lambda ps, *a, **k: (hashed.extend(p.name for p in ps), real(ps, *a, **k))[1])
    ck.write_manifest(step, 1, 2)  # process 1 first: the step is not yet covered
    assert sorted(hashed) == ["process_1", "y"] and (step / "BLAKE3SUMS.process_1").is_file()
    assert ck.verify_manifest(step) == (None, False)  # process 0's files are listed nowhere yet: unverified
    (step / "BLAKE3SUMS.process_1").rename(step / "elsewhere")
    with pytest.raises(FileNotFoundError):  # no checksums at all
        ck.verify_manifest(step)
    (step / "elsewhere").rename(step / "BLAKE3SUMS.process_1")
    hashed.clear()
    ck.write_manifest(step, 0, 2)
    assert sorted(hashed) == ["_CHECKPOINT_METADATA", "abc", "manifest.ocdbt", "x"]
    hashed.clear()
    assert ck.verify_manifest(step, 1, 2) == (None, True) and sorted(hashed) == ["process_1", "y"]
    hashed.clear()
    assert ck.verify_manifest(step, 0, 2) == (None, True) and "y" not in hashed
    # damage in process 1's file: only process 1 sees it (the processes then agree: first_of_processes)
    (step / "state/ocdbt.process_1/d/y").write_bytes(b"p1" * 6999 + b"xx")
    assert ck.verify_manifest(step, 0, 2) == (None, True)
    assert ck.verify_manifest(step, 1, 2) == ("state/ocdbt.process_1/d/y: checksum mismatch", True)
    assert ck.verify_manifest(step) == ("state/ocdbt.process_1/d/y: checksum mismatch", True)  # one process: all
    # a process that died before writing its part: its files are unverified, the rest still checked
    (step / "BLAKE3SUMS.process_1").unlink()
    assert ck.verify_manifest(step) == (None, False)


def test_owner_of_orbax_files():
    assert ck.owner("state/ocdbt.process_3/d/x", 4) == 3
    assert ck.owner("state/array_metadatas/process_2", 4) == 2
    assert ck.owner("state/ocdbt.process_3/d/x", 2) == 1  # read by a job of another size
    assert ck.owner("state/_METADATA", 4) == 0 and ck.owner("data/metadata", 1) == 0


def test_first_of_processes_in_one_process():
    assert multihost.first_of_processes(None) is None
    assert multihost.first_of_processes("x: missing") == "x: missing"
