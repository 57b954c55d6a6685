"""The CP-SAT formulation of the offload plan (`_Model`): decision literals, per-window traffic,
recompute and memory as linear expressions, the relaxation with symmetry breaking, hints and
decoding. `boostjax.offload.planner.solve` drives it."""

from __future__ import annotations

import math

from ortools.sat.python import cp_model

from boostjax.offload.costmodel import ALL, BOUNDARY, MODES, PlanInstance
from boostjax.offload.decisions import (Decisions, base_durations, bwd_window, flat_allowed, fwd_window,
                                        head_window, n_windows)


# ----------------------------------------------------------------------------- CP-SAT model


def _mem_unit(inst: PlanInstance) -> int:
    """A power-of-two byte unit that keeps every memory number of the instance below ~2^26 units."""
    top = inst.fixed_bytes + inst.head_work_bytes + max(inst.work_fwd_bytes + inst.work_bwd_bytes) + sum(
        a + max(ob) + max(md) + 3 * sm + g for a, ob, md, sm, g in
        zip(inst.boundary_bytes, inst.option_bytes, inst.mode_device_bytes, inst.stream_mem_bytes,
            inst.grad_device_bytes))
    return 1 << max(0, int(math.floor(math.log2(max(top, 1.0) / 2 ** 26))))


class _Windows:
    """Per-window terms `(coefficient, literal)` the parts of `_Model` add to: transfers each way,
    inner and boundary recompute, memory held, and constants (relaxation hiding, resident bytes)."""

    def __init__(self, n: int):
        self.n = n
        self.h2d: list[list] = [[] for _ in range(n)]
        self.d2h: list[list] = [[] for _ in range(n)]
        self.rec: list[list] = [[] for _ in range(n)]  # inner recompute (objective, and hiding unless relaxed)
        self.regen_rec: list[list] = [[] for _ in range(n)]  # boundary regeneration
        self.hide_extra = [0] * n  # relaxation: constant hiding capacity instead of the inner recompute
        self.mem: list[list] = [[] for _ in range(n)]
        self.const = [0] * n

    def hold(self, a: int, b: int, coef: int, lit) -> None:
        """`coef` units resident in windows a..b (clipped to the windows) while `lit` holds."""
        for w in range(max(a, 0), min(b, self.n - 1) + 1):
            self.mem[w].append((coef, lit))


def _us(sec: float) -> int:
    """Seconds as integer microseconds."""
    return int(round(sec * 1e6))


class _Model:
    """The CP-SAT formulation. Time in integer microseconds, memory in `unit` bytes (rounded up, the
    budget rounded down, so a plan the model accepts fits exactly). Per-window traffic, recompute and
    memory are aggregated linear expressions over the decision literals (no per-tensor-per-window
    booleans beyond the few lead/lag choices); recompute segments are a path (unit flow) over
    boundary nodes 0..L whose edge literals carry the placement and fetch lead of the start boundary
    (yD, yH) and the flat flavour (yF). Stalls: stall_w >= traffic_w - duration_w per direction, plus
    the valid cut stall_w >= Σ (t_j - base_w)·x_j - recompute_w over single transfers longer than
    the window's base compute (tightens the LP where streamed layers overflow their windows)."""

    def __init__(self, inst: PlanInstance, min_peak: bool = False, relax: bool = False):
        """`relax=True`: every B_k window hides transfers under its largest possible inner recompute
        (a lower bound of the true objective), which makes identical consecutive layers swappable, so
        their inner options are ordered by saved bytes (symmetry breaking, valid for the relaxation).
        The parts are added in a fixed order (variables and constraints numbered alike every time)."""
        self.inst, self.m = inst, cp_model.CpModel()
        self.unit = _mem_unit(inst)
        win = _Windows(n_windows(inst.n_layers))
        static = self._add_parameter_modes(win)
        static_var = self.m.NewIntVar(0, sum(c for c, _ in static), "static")
        self.m.Add(static_var == sum(c * v for c, v in static))
        flat_ok = flat_allowed(inst)
        self._add_inner_options(win, flat_ok)
        flat_cover = self._add_boundaries(win, flat_ok)
        self._add_flow_and_options(flat_cover)
        if relax:
            self._break_symmetry(flat_cover)
        obj = self._add_stalls(win, relax)
        self.mem_exprs = [win.const[w] + static_var + sum(c * v for c, v in win.mem[w]) for w in range(win.n)]
        self._add_host_budget()
        self._set_objective(win, static, obj, min_peak)

    def _mu(self, b: float) -> int:
        """Bytes in memory units, rounded up."""
        return int(math.ceil(b / self.unit - 1e-9))

    def _add_parameter_modes(self, win: _Windows) -> list[tuple[int, object]]:
        """Each layer's parameter mode and, for host-kept ones, the lead / lag of their transfers;
        returns the static memory terms of the modes."""
        inst, m, mu, hold = self.inst, self.m, self._mu, win.hold
        L, h2d, d2h = inst.n_layers, win.h2d, win.d2h
        W = win.n
        self.mode = [{md: m.NewBoolVar(f"mode{k}_{md}") for md in inst.param_modes} for k in range(L)]
        self.pf, self.pb, self.gs = [], [], []
        static = []
        for k in range(L):
            F, B, mv = fwd_window(k), bwd_window(L, k), self.mode[k]
            m.AddExactlyOne(mv.values())
            static += [(mu(inst.mode_device_bytes[k][MODES.index(md)]), v) for md, v in mv.items()]
            if "device" in mv:
                hold(B, W - 1, mu(inst.grad_device_bytes[k]), mv["device"])
            t_s, sm = _us(inst.stream_bytes[k] / inst.h2d_bytes_per_s), mu(inst.stream_mem_bytes[k])
            t_g = _us(inst.stream_bytes[k] / inst.d2h_bytes_per_s)
            pf = {(md, ld): m.NewBoolVar(f"pf{k}_{md}_{ld}") for md in ("opt-host", "host") if md in mv
                  for ld in range(1, min(inst.h2d_lead, k + 1) + 1)}
            pb = {ld: m.NewBoolVar(f"pb{k}_{ld}") for ld in range(1, inst.h2d_lead + 1)} if "host" in mv else {}
            gs = {lg: m.NewBoolVar(f"gs{k}_{lg}") for lg in range(1, min(inst.d2h_lag, k + 1) + 1)} \
                if set(mv) & {"opt-host", "host"} else {}
            for md in ("opt-host", "host"):
                if md in mv:
                    m.Add(sum(v for (mm, _), v in pf.items() if mm == md) == mv[md])
            if pb:
                m.Add(sum(pb.values()) == mv["host"])
            if gs:
                m.Add(sum(gs.values()) == sum(mv[md] for md in ("opt-host", "host") if md in mv))
            for (md, ld), v in pf.items():
                h2d[F - ld].append((t_s, v))
                if md == "host":
                    hold(F - ld, F, sm, v)
            for ld, v in pb.items():
                h2d[B - ld].append((t_s, v))
                hold(B - ld, B, sm, v)
            for lg, v in gs.items():
                d2h[B + lg].append((t_g, v))
                hold(B, B + lg, sm, v)
            self.pf.append(pf), self.pb.append(pb), self.gs.append(gs)
        if inst.uniform_modes:  # one mode for all layers (a pipeline's stacked parameters)
            for k in range(1, L):
                for md in inst.param_modes:
                    m.Add(self.mode[k][md] == self.mode[0][md])
        return static

    def _add_inner_options(self, win: _Windows, flat_ok: bool) -> None:
        """Each layer's inner activation option (exactly one, or none when a flat segment contains the
        layer: the flat edge literal then carries the segment's recompute), its bytes and recompute;
        the windows' constant bytes."""
        inst, m, mu = self.inst, self.m, self._mu
        L = inst.n_layers
        self.i_all = inst.option_names.index(ALL) if flat_ok else -1
        self.i_bnd = inst.option_names.index(BOUNDARY) if flat_ok else -1
        self.opt, self.inner_bytes = [], []
        for k in range(L):
            ov = [m.NewBoolVar(f"opt{k}_{j}") for j in range(len(inst.option_names))]
            self.opt.append(ov)
            F, B = fwd_window(k), bwd_window(L, k)
            win.rec[B] += [(_us(inst.option_recompute_s[k][j]), v) for j, v in enumerate(ov)]
            win.hide_extra[B] = max(_us(x) for x in inst.option_recompute_s[k])
            ib = [mu(inst.option_bytes[k][j]) for j in range(len(ov))]
            iv = m.NewIntVar(0, max(ib), f"inner{k}")
            m.Add(iv == sum(c * v for c, v in zip(ib, ov)))
            win.hold(F + 1, B - 1, 1, iv)
            self.inner_bytes.append(iv)
            win.const[F] += mu(inst.boundary_bytes[k] + inst.work_fwd_bytes[k])
            win.const[B] += mu(inst.work_bwd_bytes[k])
        win.const[head_window(L)] += mu(inst.head_work_bytes)
        win.const[:] = [c + mu(inst.fixed_bytes) for c in win.const]

    def _add_boundaries(self, win: _Windows, flat_ok: bool) -> list[list]:
        """The boundaries: path edges (s, e) with the placement of s and the fetch lead on the edge
        (their regeneration and its memory), and each boundary's device / host choice and offload lag.
        Returns the flat edges containing each layer."""
        inst, m, mu, hold = self.inst, self.m, self._mu, win.hold
        L, T, h2d, d2h, mem = inst.n_layers, head_window(inst.n_layers), win.h2d, win.d2h, win.mem
        self.yD, self.yH, self.ye, self.yF = {}, {}, {}, {}
        flat_cover: list[list] = [[] for _ in range(L)]  # flat edges containing layer k
        self.zD, self.zH, self.lag = [], [], []
        for s in range(L):
            A, tA = mu(inst.boundary_bytes[s]), _us(inst.boundary_bytes[s] / inst.h2d_bytes_per_s)
            F, B = fwd_window(s), bwd_window(L, s)
            for e in range(s + 1, min(L, s + inst.max_segment) + 1):
                need = bwd_window(L, e - 1)
                yd = self.yD[s, e] = m.NewBoolVar(f"yD{s}_{e}")
                yh = self.yH[s, e] = {ld: m.NewBoolVar(f"yH{s}_{e}_{ld}") for ld in range(1, inst.h2d_lead + 1)
                                      if need - ld >= T}
                ye = self.ye[s, e] = m.NewBoolVar(f"y{s}_{e}")
                m.Add(ye == yd + sum(yh.values()))
                for ld, v in yh.items():
                    h2d[need - ld].append((tA, v))
                    hold(need - ld, B, A, v)
                regen = sum(inst.fwd_s[s:e - 1])
                if e - s >= 2:
                    win.regen_rec[need].append((_us(regen), ye))
                    acc = 0
                    for mid in range(s + 1, e):  # regenerated boundaries s+1..mid resident in B_mid
                        acc += mu(inst.boundary_bytes[mid])
                        mem[bwd_window(L, mid)].append((acc, ye))
                    if flat_ok:  # flat flavour of the edge
                        yf = self.yF[s, e] = m.NewBoolVar(f"yF{s}_{e}")
                        m.Add(yf <= ye)
                        for k in range(s, e):
                            flat_cover[k].append(yf)
                        win.rec[need].append((_us(inst.option_recompute_s[e - 1][self.i_bnd]), yf))  # last layer
                        acc = 0
                        for mid in range(s + 1, e):  # full tensors of layers s..mid-1 resident in B_mid
                            acc += mu(inst.option_bytes[mid - 1][self.i_all])
                            mem[bwd_window(L, mid)].append((acc, yf))
            zd, zh = m.NewBoolVar(f"zD{s}"), m.NewBoolVar(f"zH{s}")
            m.Add(zd == sum(self.yD[s, e] for e in range(s + 1, min(L, s + inst.max_segment) + 1)))
            m.Add(zh == sum(v for e in range(s + 1, min(L, s + inst.max_segment) + 1) for v in self.yH[s, e].values()))
            (m.Add(zd + zh == 1) if s == 0 else m.Add(zd + zh <= 1))
            self.zD.append(zd), self.zH.append(zh)
            hold(F + 1, B, A, zd)
            lags = {g: m.NewBoolVar(f"lag{s}_{g}") for g in range(inst.d2h_lag) if F + g <= fwd_window(L - 1)}
            m.Add(sum(lags.values()) == zh)
            self.lag.append(lags)
            t_d = _us(inst.boundary_bytes[s] / inst.d2h_bytes_per_s)
            for g, v in lags.items():
                d2h[F + g].append((t_d, v))
                hold(F + 1, F + g, A, v)
        return flat_cover

    def _add_flow_and_options(self, flat_cover: list[list]) -> None:
        """Flow conservation on the boundary path, and one inner option per layer outside flat segments."""
        inst, m, L = self.inst, self.m, self.inst.n_layers
        for v in range(1, L + 1):  # flow conservation: a node is materialised iff one edge enters it
            incoming = [self.ye[s, v] for s in range(max(0, v - inst.max_segment), v)]
            m.Add(sum(incoming) == (1 if v == L else self.zD[v] + self.zH[v]))
        for k in range(L):
            if flat_cover[k]:  # layer k in a flat segment: no option literal, the edge carries its cost
                cov = m.NewBoolVar(f"flat{k}")
                m.Add(cov == sum(flat_cover[k]))
                m.AddExactlyOne(self.opt[k] + [cov])
            else:
                m.AddExactlyOne(self.opt[k])

    def _break_symmetry(self, flat_cover: list[list]) -> None:
        """The relaxation: identical consecutive layers outside flat segments keep bigger saved sets later."""
        inst, m = self.inst, self.m
        for k in range(1, inst.n_layers):
            if _same_layer(inst, k - 1, k):
                c = m.Add(self.inner_bytes[k - 1] <= self.inner_bytes[k])
                if flat_cover[k - 1] or flat_cover[k]:  # only between layers outside flat segments
                    nf = [m.NewBoolVar(f"nf{j}") for j in (k - 1, k)]
                    for lit, j in zip(nf, (k - 1, k)):
                        m.Add(lit == sum(self.opt[j]))
                    c.OnlyEnforceIf(nf)

    def _add_stalls(self, win: _Windows, relax: bool) -> list[tuple[int, object]]:
        """Each window's stall (transfers beyond its compute and the recompute that hides them);
        returns the objective's terms: recompute and stalls."""
        m = self.m
        base = [_us(x) for x in base_durations(self.inst)]
        self.stall = []
        obj = []
        for w in range(win.n):
            h2d, d2h = win.h2d[w], win.d2h[w]
            obj += win.rec[w] + win.regen_rec[w]
            hide = win.regen_rec[w] + ([] if relax else win.rec[w])
            rec_e = sum(c * v for c, v in hide) + (win.hide_extra[w] if relax else 0)
            if h2d or d2h:
                ub = max(sum(c for c, _ in h2d), sum(c for c, _ in d2h))
                st = m.NewIntVar(0, ub, f"stall{w}")
                for terms in (h2d, d2h):
                    if terms:
                        m.Add(st >= sum(c * v for c, v in terms) - base[w] - rec_e)
                        big = [(c - base[w], v) for c, v in terms if c > base[w]]
                        if big:  # valid cut (superadditivity), tight where single transfers overflow
                            m.Add(st >= sum(c * v for c, v in big) - rec_e)
                self.stall.append(st)
                obj.append((1, st))
        return obj

    def _add_host_budget(self) -> None:
        """Host memory of host-kept parameters and boundaries within the host budget (if any)."""
        inst, mu, L = self.inst, self._mu, self.inst.n_layers
        if inst.host_budget_bytes > 0:
            host_terms = [(mu(inst.mode_host_bytes[k][MODES.index(md)]), v)
                          for k in range(L) for md, v in self.mode[k].items()]
            host_terms += [(mu(inst.boundary_bytes[k]), self.zH[k]) for k in range(L)]
            self.m.Add(sum(c * v for c, v in host_terms) <= int(math.floor(inst.host_budget_bytes / self.unit + 1e-9)))

    def _set_objective(self, win: _Windows, static: list, obj: list, min_peak: bool) -> None:
        """`min_peak`: minimise the peak window memory; else every window within the budget, minimise
        recompute plus stalls."""
        m = self.m
        if min_peak:
            top = sum(win.const) + sum(c for c, _ in static) + sum(c for w in range(win.n) for c, _ in win.mem[w])
            self.peak = m.NewIntVar(0, top, "peak")
            for e in self.mem_exprs:
                m.Add(self.peak >= e)
            m.Minimize(self.peak)
        else:
            cap = int(math.floor(self.inst.budget_bytes / self.unit + 1e-9))
            for e in self.mem_exprs:
                m.Add(e <= cap)
            self.obj_expr = sum(c * v for c, v in obj)
            m.Minimize(self.obj_expr)

    def hint(self, d: Decisions) -> None:
        m, L = self.m, self.inst.n_layers
        m.ClearHints()
        segs = {s: e for s, e in d.segments()}
        for (s, e), v in self.yD.items():
            m.AddHint(v, int(segs.get(s) == e and d.boundary[s] == "device"))
        for (s, e), hs in self.yH.items():
            for ld, v in hs.items():
                m.AddHint(v, int(segs.get(s) == e and d.boundary[s] == "host" and d.fetch_lead[s] == ld))
        for (s, e), v in self.ye.items():
            m.AddHint(v, int(segs.get(s) == e))
        for (s, e), v in self.yF.items():
            m.AddHint(v, int(segs.get(s) == e and d.flat[s]))
        for k in range(L):
            m.AddHint(self.zD[k], int(d.boundary[k] == "device"))
            m.AddHint(self.zH[k], int(d.boundary[k] == "host"))
            for g, v in self.lag[k].items():
                m.AddHint(v, int(d.boundary[k] == "host" and d.offload_lag[k] == g))
            in_flat = any(d.flat[s] and s <= k < e for s, e in d.segments())
            for j, v in enumerate(self.opt[k]):
                m.AddHint(v, int(self.inst.option_names[j] == d.inner[k] and not in_flat))
            for md, v in self.mode[k].items():
                m.AddHint(v, int(d.mode[k] == md))
            for (md, ld), v in self.pf[k].items():
                m.AddHint(v, int(d.mode[k] == md and d.param_fwd_lead[k] == ld))
            for ld, v in self.pb[k].items():
                m.AddHint(v, int(d.mode[k] == "host" and d.param_bwd_lead[k] == ld))
            for lg, v in self.gs[k].items():
                m.AddHint(v, int(d.mode[k] != "device" and d.grad_lag[k] == lg))

    def decode(self, sol: cp_model.CpSolver) -> Decisions:
        inst, L = self.inst, self.inst.n_layers
        bnd, lag, lead = ["recompute"] * L, [0] * L, [0] * L
        for (s, e), v in self.yD.items():
            if sol.Value(v):
                bnd[s] = "device"
        for (s, e), hs in self.yH.items():
            for ld, v in hs.items():
                if sol.Value(v):
                    bnd[s], lead[s] = "host", ld
        for k in range(L):
            for g, v in self.lag[k].items():
                if sol.Value(v):
                    lag[k] = g
        inner = [next((inst.option_names[j] for j, v in enumerate(self.opt[k]) if sol.Value(v)), BOUNDARY)
                 for k in range(L)]
        mode = [next(md for md, v in self.mode[k].items() if sol.Value(v)) for k in range(L)]
        pfl = [next((ld for (_, ld), v in self.pf[k].items() if sol.Value(v)), 0) for k in range(L)]
        pbl = [next((ld for ld, v in self.pb[k].items() if sol.Value(v)), 0) for k in range(L)]
        gsl = [next((lg for lg, v in self.gs[k].items() if sol.Value(v)), 0) for k in range(L)]
        flat = [False] * L
        for (s, e), v in self.yF.items():
            if sol.Value(v):
                flat[s] = True
        return Decisions(tuple(bnd), tuple(inner), tuple(mode), tuple(lag), tuple(lead), tuple(pfl), tuple(pbl),
                         tuple(gsl), tuple(flat))


def _same_layer(inst: PlanInstance, j: int, k: int) -> bool:
    return all(getattr(inst, f)[j] == getattr(inst, f)[k] for f in (
        "boundary_bytes", "fwd_s", "bwd_s", "work_fwd_bytes", "work_bwd_bytes", "option_bytes",
        "option_recompute_s", "stream_bytes", "stream_mem_bytes", "mode_device_bytes", "mode_host_bytes",
        "grad_device_bytes"))
