"""The CPU profile of `--cluster NxD:cpu`, measured by a micro-benchmark on this machine's simulated devices.

The simulated devices are threads of one process sharing the cores, so every curve is timed on all
`devices` at once (`shard_map`) as seconds per instruction at a few sizes, each chain's best of
`PASSES` passes: GEMM curves (`v @ w_i` and `v^T @ w_i`), a memory curve (a tapped divide chain,
`TAPPED`), all-reduce latency per group size and bus, and the machine's peaks (`shared_rates`). The
cost model charges a dot the GEMM curve and every other instruction the memory curve. Nothing is
fitted to training runs. Every curve's design and limits: docs/planning.md ("The CPU profile").
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from boostjax.planning.costs import Hardware

GEMM_N = 768
STREAM_BYTES = 64 << 20
REDUCE_BYTES = (1 << 12, 1 << 20)  # per device, fp32
CURVE_GEMM_N = (16, 48, 128, 384)
CURVE_STREAM_BYTES = (1 << 13, 1 << 16, 1 << 19, 1 << 22)  # per device: the bytes of s
COLD_WEIGHTS = 32  # different weights a GEMM chain ([n, n]) or a stream chain ([size]) reads in turn
COLD_STREAM_BYTES = 64 << 20  # per device: a stream chain's weights together at most (16 of 4 MiB)
SHORT = 16  # links of the short chain: past XLA:CPU's 8-thunk threshold for sequential execution
LINK_WORK = 1 << 27  # FLOPs or bytes per device of a long chain: K2 = SHORT + 16 + LINK_WORK / work links, <= 256
PASSES = 3  # passes over a curve's chains; each chain's best time over all of them is kept (`_best`)


def _best(fns: dict, repeats: int, passes: int = 1) -> dict:
    """Best seconds of each zero-argument callable of `fns`: each compiled and touched once, then `passes`
    passes over all of them (the order reversed every other pass), `repeats` calls each per pass. A burst
    of other work on a shared machine lasts seconds: consecutive repeats all fall into it, passes spread a
    callable's samples over the whole calibration."""
    for fn in fns.values():
        jax.block_until_ready(fn())  # compile, first touch
    best = dict.fromkeys(fns, float("inf"))
    keys = list(fns)
    for p in range(passes):
        for k in keys if p % 2 == 0 else keys[::-1]:
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fns[k]())
                best[k] = min(best[k], time.perf_counter() - t0)
    return best


def _mesh(devices: list, group: int) -> Mesh:
    """`devices` as ("r", "g"): groups of `group` devices along "g" (a collective's group), all at once."""
    return Mesh(np.array(devices).reshape(-1, group), ("r", "g"))


ROWS = P(("r", "g"))  # a chain's `v`: split over every device


def _chain(link: str, k: int, mesh: Mesh, w_spec: P):
    """`k` links `v = LINKS[link](v, ws[i % len(ws)])`, i = 0 .. k-1, on every device of `mesh`, jitted. A
    TAPPED link's first element also feeds the result: a second consumer of each link's `v`, so that XLA
    keeps every link a kernel of its own (one fused chain would be one kernel)."""
    step, tap = LINKS[link], link in TAPPED

    def body(v, ws):
        taps = []
        for i in range(k):
            v = step(v, ws[i % len(ws)])
            taps.append(v[:1])
        return v + jnp.concatenate(taps).sum() if tap else v

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(ROWS, w_spec), out_specs=ROWS))


def _operands(link: str, size: int, mesh: Mesh) -> tuple[jax.Array, list[jax.Array], P]:
    """The chain's `v` and `ws` for `link` at `size` (matmuls: n; stream: w's bytes; psum: v's bytes) per
    device. A matmul chain reads COLD_WEIGHTS different weights in turn, as a step's GEMMs read their
    layers' (one weight would stay in cache from link to link: 1.3-1.6x faster at n = 128). A stream chain
    does too: with one w its 8 KiB link measured 0.0-1.8 us over five calibrations (the short chain's time,
    subtracted, is of the same order), with 32 2.4-3.8 us; its 64 KiB link 24-42 us against 31-34 us."""
    d = mesh.size
    if link in ("matmul", "matmul_t"):
        v, spec = jnp.full((d * size, size), 0.5), P()
        ws = [jnp.full((size, size), (1.0 + i / COLD_WEIGHTS) / size) for i in range(COLD_WEIGHTS)]
    elif link == "stream":  # w, too, rotates over different arrays (at most COLD_STREAM_BYTES of them)
        rows, k = max(size // 4, 1), max(1, min(COLD_WEIGHTS, COLD_STREAM_BYTES // max(size, 1)))
        v, spec = jnp.full((d * rows,), 0.5), ROWS
        ws = [jnp.full((d * rows,), 1.0 + i / k) for i in range(k)]
    else:
        v, ws, spec = jnp.full((d * (size // 4),), 0.5), [jnp.zeros((1,))], P()
    put = lambda a, sp: jax.device_put(a.astype(jnp.float32), NamedSharding(mesh, sp))  # noqa: E731
    return put(v, ROWS), [put(w, spec) for w in ws], spec


def _link_chains(link: str, size: int, work: float, devices: list, group: int = 1) -> tuple[list, int]:
    """The chains whose difference is one link of `link` at `size`, all devices running it at once (a psum
    over groups of `group`): SHORT links and K2 (more for small links), as zero-argument callables; and K2."""
    mesh = _mesh(devices, group)
    v, w, spec = _operands(link, size, mesh)
    k2 = int(min(256, SHORT + 16 + LINK_WORK // max(work, 1)))
    return [functools.partial(_chain(link, k, mesh, spec), v, w) for k in (SHORT, k2)], k2


def _links_s(links: dict, devices: list, repeats: int, passes: int) -> dict:
    """Seconds one link costs each device, for each `key: (link, size, work, group)` of `links`: the two
    chains' best times (`_best`, all of `links` timed in the same passes), their difference over the links
    between."""
    chains = {key: _link_chains(link, size, work, devices, group) for key, (link, size, work, group) in links.items()}
    best = _best({(key, i): fn for key, (fns, _) in chains.items() for i, fn in enumerate(fns)}, repeats, passes)
    return {key: max(best[key, 1] - best[key, 0], 0.0) / (k2 - SHORT) for key, (_, k2) in chains.items()}


def _link_s(link: str, size: int, work: float, devices: list, repeats: int, group: int = 1) -> float:
    """Seconds one link of `link`'s chain at `size` costs each device (`_links_s` of one link, one pass)."""
    return _links_s({link: (link, size, work, group)}, devices, repeats, 1)[link]


def _curve(times: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """(size, seconds) points made non-decreasing in size (a link measured faster than a smaller one
    is noise: it gets the smaller one's time)."""
    out, floor = [], 1e-9
    for size, t in times:
        floor = max(floor, t)
        out.append((size, floor))
    return tuple(out)


def _matmul(v, w):
    return v @ w


def _matmul_t(v, w):
    return jax.lax.dot_general(v, w, (((0,), (0,)), ((), ())))  # v^T w: the lhs contracts its major dimension


def _stream(s, w):
    return w / (1.0 + s)  # a divide: XLA never duplicates it into a second consumer


def _psum(v, w):
    return jax.lax.psum(v, "g")


LINKS = {"matmul": _matmul, "matmul_t": _matmul_t, "stream": _stream, "psum": _psum}
TAPPED = {"stream"}  # links XLA would fuse into one kernel without a second consumer


def stream_link_bytes(s_bytes: int) -> float:
    """Operand + result bytes of one stream link whose `s` has `s_bytes` (s and w in, s out)."""
    return 3.0 * s_bytes


@functools.lru_cache(maxsize=4)
def calibrate(devices: int, dtype: str = "float32", repeats: int = 3, passes: int = PASSES) -> tuple[Hardware, dict]:
    """This machine's rates (and the raw timings) from the micro-benchmark over `devices` simulated devices:
    each curve's chains timed together in `passes` passes, the best of each kept (`_best`)."""
    dt = jnp.dtype(dtype)
    a = jnp.ones((GEMM_N, GEMM_N), dt)
    x = jnp.ones((STREAM_BYTES // 4,), jnp.float32)
    mm, stream = jax.jit(lambda y: y @ y), jax.jit(lambda v: v * 1.5 + 1.0)
    peaks = _best({"gemm": lambda: mm(a), "stream": lambda: stream(x)}, repeats, passes)
    gemm_s, stream_s = peaks["gemm"], peaks["stream"]
    flops = 2 * GEMM_N ** 3 / gemm_s
    hbm = 2 * STREAM_BYTES / stream_s
    devs = jax.devices()[:devices]
    t = len(devs)
    groups = [g for g in range(2, t + 1) if t % g == 0]
    alphas: list[tuple[int, float]] = []
    if groups:
        (b1, b2) = REDUCE_BYTES
        psums = _links_s({"big": ("psum", b2, 8 * b2, t), **{g: ("psum", b1, 8 * b1, g) for g in groups}}, devs,
                         repeats, passes)
        t1, t2 = psums[t], psums["big"]
        ring = 2 * (t - 1) / t
        bus = ring * (b2 - b1) / max(t2 - t1, 1e-9)
        for g in groups:  # all groups of g at once; the latency of a group of g: the small psum less its bytes
            alphas.append((g, max(psums[g] - 2 * (g - 1) / g * b1 / bus, 1e-9)))
        alpha = alphas[-1][1]
    else:
        t1 = t2 = 0.0
        bus, alpha = hbm, 0.0

    def curve(link: str, sizes: tuple[int, ...], work, size_of) -> tuple[tuple[float, float], ...]:
        got = _links_s({n: (link, n, work(n), 1) for n in sizes}, devs, repeats, passes)
        return _curve([(size_of(n), got[n]) for n in sizes])

    gemm_curve = curve("matmul", CURVE_GEMM_N, lambda n: 2 * n ** 3, lambda n: 2.0 * n ** 3)
    gemm_t_curve = curve("matmul_t", CURVE_GEMM_N, lambda n: 2 * n ** 3, lambda n: 2.0 * n ** 3)
    stream_curve = curve("stream", CURVE_STREAM_BYTES, lambda b: b, stream_link_bytes)
    hw = Hardware(f"cpu ({t} simulated devices, calibrated)", flops, hbm, 1.0, bus, alpha, bus, alpha,
                  gemm_curve=gemm_curve, stream_curve=stream_curve, gemm_t_curve=gemm_t_curve,
                  alpha_by_group=tuple(alphas))
    raw = {"gemm_n": GEMM_N, "gemm_s": gemm_s, "gemm_flops_per_s": flops, "stream_bytes": STREAM_BYTES,
           "stream_s": stream_s, "memory_bytes_per_s": hbm, "allreduce_devices": t,
           "allreduce_bytes": list(REDUCE_BYTES), "allreduce_s": [t1, t2], "allreduce_bus_bytes_per_s": bus,
           "allreduce_alpha_s": alpha, "allreduce_alpha_by_group": [list(a) for a in alphas], "dtype": dtype,
           "stream_link": "divide", "repeats": repeats, "passes": passes,
           "gemm_curve_n": list(CURVE_GEMM_N), "gemm_curve_s": [t for _, t in gemm_curve],
           "gemm_t_curve_s": [t for _, t in gemm_t_curve], "stream_curve_bytes": list(CURVE_STREAM_BYTES),
           "stream_curve_s": [t for _, t in stream_curve]}
    return hw, raw


def shared_rates(hw: Hardware, devices: int) -> Hardware:
    """One device's share of the machine when `devices` simulated devices run at once: the peaks over
    `devices` (never below what a device reached in the curves, which were measured shared already)."""
    n = max(devices, 1)
    peak = max([hw.peak_flops / n, *(f / t for f, t in hw.gemm_curve)])
    hbm = max([hw.hbm_bytes_per_s / n, *(b / t for b, t in hw.stream_curve)])
    return replace(hw, peak_flops=peak, hbm_bytes_per_s=hbm)


__all__ = ["calibrate", "shared_rates"]
