"""`boostjax plan --auto` / `boostjax.plan_auto`: the cluster string, the search space against train's own
checks, the analytic bounds below the compiled predictions, the ranking and its JSON, the train
command a candidate prints (train's parser reads back the same configuration), and bad input (one
line, exit 2, nothing written)."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace

import pytest

from boostjax.cli import main
from boostjax.config import ConfigError
from boostjax.planning.cluster import parse_cluster
from boostjax.planning.costs import Hardware
from boostjax.planning.cpu import shared_rates
from boostjax.planning.space import comm_lower_bound, enumerate_space, memory_lower_bound, time_lower_bound
from helpers import MICRO, one_error_line

# a CPU-like machine with round numbers (no calibration run in the tests)
HW = Hardware("test", 1e10, 1e10, 1.0, 1e9, 1e-5, 1e9, 1e-5)
MODEL = replace(MICRO, n_layers=2, vocab_size=256)


def test_cluster_strings():
    c = parse_cluster("2x8:a100")
    assert (c.nodes, c.per_node, c.hardware, c.devices) == (2, 8, "A100-80GB", 16)
    assert parse_cluster("1x8:CPU").is_cpu
    assert c.crosses_nodes(2, 8) and not c.crosses_nodes(8, 1) and not c.crosses_nodes(1, 16)
    for bad, needle in (("2x8", "cannot read"), ("2*8:a100", "cannot read"), ("0x8:a100", ">= 1 node"),
                        ("1x8:TPU-v9", "unknown hardware")):
        with pytest.raises(ConfigError, match=needle):
            parse_cluster(bad)


def test_the_space_is_what_train_accepts():
    space, counts = enumerate_space(MODEL, parse_cluster("1x4:cpu"), 4, 32, "float32", "adamw")
    assert space and counts["enumerated"] == counts["invalid"] + len(space)
    for c in space:
        assert c.data * c.stage * c.model == 4 and c.data * c.micro_batch * c.slots == 4
        assert (c.strategy == "none") == (c.model == 1) and c.strategy != "fullrank-tp"  # CoLA: no dense TP
        assert c.zero == 0 or c.data > 1
        assert (c.schedule == "-") == (c.stage == 1)
    assert {c.remat for c in space} == {"none", "lowrank", "full"}
    dense, _ = enumerate_space(replace(MODEL, kind="llama"), parse_cluster("1x4:cpu"), 4, 32, "float32", "adamw")
    assert {c.strategy for c in dense} == {"none", "fullrank-tp"} and "lowrank" not in {c.remat for c in dense}
    # the model axis stays inside a node: 2 nodes of 2 devices never get TP4
    two, _ = enumerate_space(MODEL, parse_cluster("2x2:cpu"), 4, 32, "float32", "adamw")
    assert max(c.model for c in two) == 2


@pytest.fixture(scope="module")
def planned():
    from boostjax.planning.search import plan_auto

    return plan_auto(MODEL, "1x4:cpu", 4, 32, hardware=HW, eta=1.0, budget_bytes=1e9, top=3, max_compiles=3)


def test_ranked_candidates_with_bounds_below_their_predictions(planned):
    rows = planned.candidates
    assert rows and [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    s = planned.search
    assert s["compiled"] <= 3 and s["fitting"] == len(rows)
    assert s["valid"] == s["pruned_memory_bound"] + s["skipped_time_bound"] + s["skipped_remat_not_needed"] \
        + s["skipped_compile_budget"] + s["refused_in_full"] + s["predicted"]
    for r in rows:
        for k in ("step_s", "peak_bytes_per_device", "train_command", "tokens_per_s", "mfu", "bubble_fraction"):
            assert k in r
        assert r["peak_bytes_per_device"] == pytest.approx(r["weight_bytes"] + r["optimizer_bytes"]
                                                           + r["activation_bytes"])
        c = _candidate(r)
        assert memory_lower_bound(MODEL, c, 32, "float32", "adamw") <= r["peak_bytes_per_device"]
        flops = HW.peak_flops / (c.data * c.stage * c.model)  # the CPU's rates are shared by its devices
        hw = shared_rates(HW, c.data * c.stage * c.model)
        comm = comm_lower_bound(MODEL, c, 32, "float32", parse_cluster("1x4:cpu"), hw)
        assert comm <= r["time_s"]["data_comm"] + r["time_s"]["stage_p2p"] + 1e-12
        assert time_lower_bound(MODEL, c, 32, 4, flops) + comm <= r["step_s"]
    assert rows[0]["why_slower"] == "fastest" and all("%" in r["why_slower"] for r in rows[1:])
    json.dumps(planned.to_json())  # serialisable as it is


def _candidate(row):
    from boostjax.planning.timing import candidate_of

    return candidate_of(row)


def test_the_train_command_is_the_planned_configuration(planned):
    from boostjax.cli import build_parser
    from boostjax.cli.train import train_config

    for r in planned.candidates:
        argv = shlex.split(r["train_command"])
        assert argv[:2] == ["boostjax", "train"]
        cfg = train_config(build_parser().parse_args(argv[1:]))
        t = cfg.train
        assert (t.sizes.data, t.sizes.stage, t.sizes.model) == (r["data"], r["stage"], r["model"])
        assert t.batch * t.grad_accum == 4 and t.strategy == r["strategy"] and t.remat == r["remat"]
        assert t.zero == r["zero"] and cfg.model.attention == "xla"
        assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.vocab_size) == (32, 2, 256)


def test_the_memory_of_one_micro_batch_on_one_device_is_the_compiled_step(planned):
    from boostjax.analysis.memory import memory_report

    r = next((r for r in planned.candidates if r["data"] == r["stage"] == 1 and r["slots"] == 1), None)
    assert r is not None, "the fixture's plan holds a single-micro-batch candidate on one data shard"
    got = memory_report(replace(MODEL, attention="xla"), f"data=1,model={r['model']}", r["micro_batch"], 32,
                        r["strategy"], r["remat"], "float32")
    assert r["peak_bytes_per_device"] == pytest.approx(got["peak_bytes_per_device"], rel=0.02)


def test_measure_top_times_the_best_predicted_and_the_fastest_wins(planned):
    """`plan_auto(measure_top=2)` times the two best-predicted candidates' training steps (here on the
    fixture's ranking: a second `plan_auto` would go past its compile budget with the cached measurements)."""
    import copy
    import statistics

    from boostjax.planning.search import _measure_top

    rows = copy.deepcopy(planned.candidates)
    res = replace(planned, candidates=rows, measured=_measure_top(MODEL, rows, 2, 3, 32, "float32", "adamw",
                                                                  parse_cluster("1x4:cpu"), None))
    timed = res.candidates[:2]
    assert res.measured["timed"] == [r["label"] for r in timed] and "measured_step_s" not in res.candidates[2]
    for r in timed:
        assert len(r["measured_steps_s"]) == 3 and r["measured_step_s"] == statistics.median(r["measured_steps_s"])
    assert res.winner is min(timed, key=lambda r: r["measured_step_s"])
    doc = res.to_json()
    assert doc["winner"] == res.winner["label"] and doc["winner_by"] == "measured"
    assert planned.to_json()["winner"] == planned.candidates[0]["label"]
    assert planned.to_json()["winner_by"] == "predicted"
    from boostjax.planning.timing import check_local

    with pytest.raises(ConfigError, match="needs 16 simulated devices and JAX sees 8"):  # conftest: 8 devices
        check_local(parse_cluster("1x16:cpu"))


@pytest.mark.parametrize("argv, needles", [
    (["--cluster", "8:a100"], ("plan.cluster", "cannot read")),
    (["--cluster", "1x8:B300"], ("plan.cluster", "unknown hardware")),
    (["--cluster", "2x4:cpu", "--model", "llama", "--n-layers", "1", "--global-batch", "3"],
     ("plan.global_batch", "data [2, 4, 8]", "multiple of 2, e.g. 4")),
    (["--cluster", "1x1:RTX3090-24GB", "--preset", "30b", "--global-batch", "1"], ("plan.cluster", "short")),
    (["--cluster", "1x4:cpu", "--mesh", "data=4"], ("plan.auto", "--mesh")),
    (["--cluster", "1x4:cpu", "--measure-top", "-1"], ("plan.measure_top", ">= 0")),
    (["--cluster", "1x4:cpu", "--measure-top", "2", "--measure-rounds", "0"], ("plan.measure_rounds", ">= 1")),
    (["--cluster", "2x8:a100", "--measure-top", "2"], ("plan.measure_top", "2 nodes")),
    (["--cluster", "1x8:a100", "--measure-top", "2"], ("plan.measure_top", "not this process's")),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, argv, needles):
    out = tmp_path / "plan.json"
    base = ["plan", "--auto", "--seq", "32", "--global-batch", "4", "--out", str(out)]
    if "--preset" not in argv:
        base += ["--preset", "tiny"]
    assert main([*base, *argv]) == 2
    one_error_line(capsys.readouterr().err, *needles)
    assert not out.exists()


# the calibrated CPU profile (boostjax.planning.cpu) and what the cost model does with it


def test_an_instruction_is_priced_on_its_measured_curve():
    from boostjax.planning.costs import instruction_s

    curve = ((1e3, 2e-6), (1e5, 2e-5), (1e7, 2e-3))
    assert instruction_s(curve, 10) == 2e-6  # below the smallest link: its time (dispatch)
    assert instruction_s(curve, 1e4) == pytest.approx(2e-6 * 10 ** 0.5)  # log-log between points
    assert instruction_s(curve, 1e5) == pytest.approx(2e-5)
    assert instruction_s(curve, 4e7) == pytest.approx(8e-3)  # beyond the largest: linear in size


def test_the_cpu_curves_replace_the_peaks_per_instruction():
    from boostjax.planning.costs import program_time, scaled

    cost = {"gemms": [(2e6, 1e3, False, False), (2e6, 1e8, False, False)], "other_bytes": 3e4, "other_sizes": [1e4, 2e4],
            "score_bytes_excluded": 0, "move_bytes_excluded": 0, "collectives": [("all-reduce", 4e6, 4)]}
    cpu_hw = replace(HW, gemm_curve=((2e3, 1e-6), (2e6, 1e-4)), stream_curve=((1e3, 1e-6), (1e6, 1e-4)))
    t = program_time(cost, cpu_hw, 1.0)
    # the first dot on its GEMM curve, the second bound by its 1e8 bytes on the memory curve (linear beyond)
    assert t["gemm_s"] == pytest.approx(1e-4 + 1e-2)
    # each other instruction separately at its own size (log-log slope 2/3 on this curve), not their sum's
    assert t["memory_s"] == pytest.approx(1e-6 * (10 ** (2 / 3) + 20 ** (2 / 3)))
    assert t["comm_s"] == pytest.approx(HW.alpha_s + 1.5 * 4e6 / HW.bus_bytes_per_s)
    # without curves (GPU profiles) the peaks, as before
    plain = program_time(cost, HW, 0.5)
    assert plain["gemm_s"] == pytest.approx(2e6 / 5e9 + 1e8 / 1e10) and plain["memory_s"] == pytest.approx(3e-6)
    # a ZeRO-sharded update: the same instructions on 1/data of the work (time / data only at fixed rates)
    assert program_time(scaled(cost, 0.25), HW, 0.5)["gemm_s"] == pytest.approx(plain["gemm_s"] / 4)
    assert program_time(scaled(cost, 0.25), cpu_hw, 1.0)["memory_s"] > t["memory_s"] / 4
    # a dot whose lhs contracts a major dimension (a weight gradient) on its own curve, when measured
    major = {**cost, "gemms": [(2e6, 1e3, False, True)]}
    slow = replace(cpu_hw, gemm_t_curve=((2e3, 2e-6), (2e6, 3e-4)))
    assert program_time(major, slow, 1.0)["gemm_s"] == pytest.approx(3e-4)
    assert program_time(major, cpu_hw, 1.0)["gemm_s"] == pytest.approx(1e-4)  # no such curve: the one curve
    # a collective's latency by its group's size where measured (log-linear between sizes), alpha_s otherwise
    grouped = replace(HW, alpha_by_group=((2, 4e-5), (8, 1.6e-4)))
    assert grouped.alpha(2) == pytest.approx(4e-5) and grouped.alpha(4) == pytest.approx(8e-5)
    assert grouped.alpha(8) == pytest.approx(1.6e-4) and HW.alpha(4) == HW.alpha_s


def test_the_cost_lists_every_executed_instruction_once():
    import jax
    import jax.numpy as jnp

    from boostjax.planning.costs import program_cost

    def f(x, w):
        y = jnp.tanh(x @ w)
        return jnp.sum(y * y, axis=1), jnp.max(y)

    x = jnp.ones((64, 32), jnp.float32)
    text = jax.jit(f).lower(x, jnp.ones((32, 32), jnp.float32)).compile().as_text()
    cost = program_cost(text, 64, 1, fused_attention=False, gemm_dtype=None)
    assert len(cost["gemms"]) == 1 and cost["gemms"][0][0] == 2 * 64 * 32 * 32
    assert cost["gemms"][0][3] is False  # x @ w: the lhs contracts its minor dimension
    # one entry per executed instruction of the entry (the reducers' scalar ops run inside theirs)
    entry = [ln for ln in text[text.index("ENTRY"):].splitlines()[1:] if " = " in ln]
    free = ("parameter(", "constant(", "tuple(")
    executed = [ln for ln in entry if not any(k in ln for k in free)]
    assert len(cost["other_sizes"]) == len(executed) - 1 >= 3  # all but the dot's fusion
    assert max(cost["other_sizes"]) == 2 * 64 * 32 * 4  # tanh: reads and writes [64, 32] fp32
    assert sum(cost["other_sizes"]) <= cost["other_bytes"]


def test_in_place_updates_and_slices_count_the_bytes_they_touch():
    import jax
    import jax.numpy as jnp

    from boostjax.analysis import hlo
    from boostjax.planning.costs import lhs_major, traffic_bytes

    def ring(buf, x, i):  # a pipeline tick: write one slot in place, read another through a slice
        buf = jax.lax.dynamic_update_index_in_dim(buf, x * 2.0, i, 0)
        return buf, jax.lax.dynamic_index_in_dim(buf, i + 1, 0, keepdims=False) + 1.0

    buf, x = jnp.ones((16, 64, 64), jnp.float32), jnp.ones((64, 64), jnp.float32)
    mod = hlo.parse_module(jax.jit(ring, donate_argnums=0).lower(buf, x, 3).compile().as_text())
    got = {i.name: traffic_bytes(mod, mod.entry, i) for i in mod.computations[mod.entry]
           if i.opcode not in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")}
    slot = 64 * 64 * 4
    assert got and all(b <= 2 * slot + 64 for b in got.values())  # a slot and an index, never the 256 KiB buffer
    # lhs contracting its major dimension: x^T dy, a weight gradient
    g = hlo.gemms(jax.jit(lambda a, b: a.T @ b).lower(x, x).compile().as_text())
    assert [lhs_major(d) for d in g] == [True]


def test_the_cpu_micro_benchmark_times_one_link_of_a_chain():
    import jax

    from boostjax.analysis import hlo
    from boostjax.planning import cpu

    devs = jax.devices()[:2]
    # chains of SHORT and of 256 [64, 64] matmuls (small work: the most links), the difference per link
    t = cpu._link_s("matmul", 64, 2 * 64 ** 3, devs, 3)
    assert 0 < t < 0.05
    # the memory chain is one loop kernel per link (and one joining the taps): none fused into another
    mesh = cpu._mesh(devs, 1)
    for size in (1 << 12, 1 << 16):
        v, ws, spec = cpu._operands("stream", size, mesh)
        for k in (4, 16):
            mod = hlo.parse_module(cpu._chain("stream", k, mesh, spec).lower(v, ws).compile().as_text())
            kernels = [i for i in mod.computations[mod.entry] if i.opcode in ("fusion", "reduce", "divide")]
            assert len(kernels) == k + 1 and all(i.attr("kind") == "kLoop" for i in kernels)
    assert cpu.stream_link_bytes(1 << 12) == 3 * (1 << 12)  # s and w read, s written
    # a link measured faster than a smaller one is noise: the curve never decreases with size
    assert cpu._curve([(1, 3e-6), (2, 1e-6), (4, 5e-6)]) == ((1, 3e-6), (2, 3e-6), (4, 5e-6))
    shared = cpu.shared_rates(replace(HW, gemm_curve=((2e6, 1e-4),), stream_curve=((1e6, 1e-5),)), 4)
    # a device's peaks: the machine's over the devices, never below what the (shared) curves reached
    assert shared.peak_flops == pytest.approx(2e10) and shared.hbm_bytes_per_s == pytest.approx(1e11)
    assert cpu.shared_rates(HW, 4).peak_flops == HW.peak_flops / 4


def test_the_calibration_times_every_chain_in_passes_and_keeps_its_best():
    from boostjax.planning import cpu

    calls = []

    def chain(name):
        return lambda: calls.append(name)

    best = cpu._best({"a": chain("a"), "b": chain("b")}, repeats=2, passes=3)
    # one warm-up each, then passes over all chains, the order reversed every other pass
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] + ["b", "b", "a", "a"] + ["a", "a", "b", "b"]
    assert set(best) == {"a", "b"} and all(0 <= t < 1 for t in best.values())


def test_cpu_zero_pays_one_collective_per_parameter_array():
    import jax
    from flax import nnx

    from boostjax.models.llama import LLaMA
    from boostjax.planning.cluster import parse_cluster
    from boostjax.planning.measure import Key, measure
    from boostjax.planning.predict import param_arrays, predict
    from boostjax.planning.space import Candidate

    leaves = len(jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: LLaMA(MODEL, rngs=nnx.Rngs(0))), nnx.Param)))
    assert param_arrays(MODEL, MODEL.n_layers) == leaves
    m, _ = measure(Key(MODEL, "none", 1, 1, 32, "none", "float32", fused_attention=False))
    times = {(z, hw): predict(MODEL, Candidate(4, 1, 1, "none", 1, 1, "-", "none", z), m, HW, 1.0,
                              parse_cluster(f"1x4:{hw}"), 32, "float32")["time_s"]["data_comm"]
             for z in (0, 1) for hw in ("cpu", "a100")}
    assert times[1, "cpu"] >= 2 * leaves * HW.alpha_s  # a reduce-scatter and an all-gather per array
    assert times[1, "a100"] < 3 * HW.alpha_s + times[0, "a100"]  # combined into one each off the CPU
    # ZeRO 3 gathers the parameters once per step and keeps them for every micro-batch (its compiled step
    # has one all-gather and one reduce-scatter per array, outside the accumulation loop): ZeRO 1's traffic
    z3 = [predict(MODEL, Candidate(4, 1, 1, "none", 1, s, "-", "none", 3), m, HW, 1.0, parse_cluster("1x4:cpu"), 32,
                  "float32")["time_s"]["data_comm"] for s in (1, 4)]
    assert z3[0] == z3[1] == pytest.approx(times[1, "cpu"])


# flash-length attention: chunked over 4 blocks of 16, so the GPU's memory comes from the chunked compile
LONG = replace(MICRO, n_layers=2, vocab_size=256, attention="chunked", attention_block=16)


def test_gpu_memory_comes_from_the_chunked_compile_and_time_from_the_materialised_one():
    from boostjax.analysis.memory import memory_report
    from boostjax.planning.measure import Key, measure

    key = Key(LONG, "none", 1, 1, 64, "none", "bfloat16")
    assert key.memory_attention == "chunked" and replace(key, seq=16).memory_attention == "xla"
    assert replace(key, fused_attention=False).memory_attention == "xla"
    m, _ = measure(key)
    xla = memory_report(replace(LONG, n_layers=1, attention="xla"), None, 1, 64, "none", "none", "bfloat16")
    chunked = memory_report(replace(LONG, n_layers=1), None, 1, 64, "none", "none", "bfloat16")
    assert m["1"]["memory_attention"] == "chunked"
    assert m["1"]["memory"]["peak_bytes_per_device"] == chunked["peak_bytes_per_device"]
    assert chunked["peak_bytes_per_device"] < xla["peak_bytes_per_device"]  # no [t, t] scores
    assert any(g[2] for g in m["1"]["step"]["gemms"])  # the time still sees every score dot


def test_a_candidate_over_the_budget_runs_with_an_offload_plan(tmp_path):
    """One device, then a pipeline's stages (GPipe and 1F1B)."""
    from boostjax.cli import build_parser
    from boostjax.cli.plan_auto import write_offload_plans
    from boostjax.cli.train import train_config
    from boostjax.offload.fit import check_plan_for
    from boostjax.planning.offloading import credit, pipeline_factor
    from boostjax.planning.search import NothingFits, plan_auto

    from boostjax.planning.space import Candidate

    # the lightest and the heaviest remat (lowrank is never compiled here: max_compiles=0, not included)
    remats = tuple(Candidate(1, 1, 1, "none", 1, 1, "-", r, 0) for r in ("none", "full"))

    def plan(budget, offloads):
        return plan_auto(LONG, "1x1:A100-80GB", 1, 64, budget_bytes=budget, max_compiles=0, top=3,
                         max_offloads=offloads, offload_dir=str(tmp_path), include=remats)

    free = plan(1e12, 0)
    assert not any("offload_plan" in r for r in free.candidates)
    peaks = [r["peak_bytes_per_device"] for r in free.included]
    budget = 0.99 * min(peaks)  # below every remat mode's compiled peak
    with pytest.raises(NothingFits):
        plan(budget, 0)
    res = plan(budget, 1)
    r = res.candidates[0]
    assert r["label"].endswith("+offload") and res.search["offload_plans_fitting"] == 1
    assert r["peak_bytes_per_device"] <= budget < r["compiled_peak_bytes_per_device"]
    assert r["step_s"] > free.included[0]["step_s"] and r["time_s"]["offload"] > 0
    write_offload_plans(res.candidates)
    argv = shlex.split(r["train_command"])
    assert argv[argv.index("--offload-plan") + 1] == str(tmp_path / "offload_D1_TP1_none_mb1.json")
    cfg = train_config(build_parser().parse_args(argv[1:]))
    check_plan_for(cfg.train.offload_plan, cfg)  # train accepts the plan for this configuration

    # two stages, 4 micro-batches: GPipe keeps M + P - 1 = 5 activation slots, the instance's 4 micro-batches
    # and more, so the plan's saving is credited once; 1F1B's ring keeps 2P - 1 = 3, so 3/4 of it
    stages = {s: Candidate(1, 2, 1, "none", 1, 4, s, "none", 0) for s in ("gpipe", "1f1b")}
    assert (credit(stages["gpipe"]), credit(stages["1f1b"])) == (1.0, 0.75)
    assert pipeline_factor(stages["gpipe"]) == 5 / 4  # the added seconds paid by M + P - 1 slots of M
    two = plan_auto(LONG, "1x2:A100-80GB", 4, 64, budget_bytes=1e12, max_compiles=0, max_offloads=0,
                    include=tuple(stages.values()))
    for c, before in zip(stages.values(), two.included):
        budget = 0.9 * before["peak_bytes_per_device"]
        res = plan_auto(LONG, "1x2:A100-80GB", 4, 64, budget_bytes=budget, max_compiles=0, max_offloads=8,
                        offload_dir=str(tmp_path), include=(c,))
        write_offload_plans(res.candidates)
        r = res.included[0]
        assert r["label"].endswith("+offload") and r["fits"] and r["rank"]
        assert r["peak_bytes_per_device"] <= budget < r["compiled_peak_bytes_per_device"]
        assert r["compiled_peak_bytes_per_device"] == before["peak_bytes_per_device"]
        assert r["time_s"]["offload"] > 0
        argv = shlex.split(r["train_command"])
        path = argv[argv.index("--offload-plan") + 1]
        assert path == str(tmp_path / f"offload_D1_PP2_{r['schedule']}x4_TP1_none_mb1.json")
        cfg = train_config(build_parser().parse_args(argv[1:]))
        assert cfg.train.sizes.stage == 2 and cfg.train.pipeline_schedule == r["schedule"]
        check_plan_for(path, cfg)  # train accepts the plan for this pipeline


def test_a_pipeline_keeps_one_traced_residual_per_layer_and_activation_slot():
    """GPipe's compiled temporaries grow, from 2 to 4 micro-batches, by what the planner charges: the two
    more activation slots times the stage's layers' traced residuals. The slots are the schedule's own
    (`activation_slots`: GPipe M + P - 1, 1F1B a ring of 2P - 1 whatever M)."""
    from boostjax.analysis.memory import memory_report
    from boostjax.planning.measure import Key
    from boostjax.planning.residuals import layer_residual_bytes
    from boostjax.planning.space import Candidate, in_flight

    held = {(s, m): in_flight(Candidate(1, 2, 1, "none", 1, m, s, "none", 0)) for s in ("gpipe", "1f1b") for m in (2, 4)}
    assert held == {("gpipe", 2): 3, ("gpipe", 4): 5, ("1f1b", 2): 3, ("1f1b", 4): 3}
    model = replace(MODEL, n_layers=4, attention="xla")  # 2 layers per stage
    temp = {m: memory_report(model, "data=1,stage=2", m, 32, "none", "none", "float32", microbatches=m,
                             pipeline_schedule="gpipe")["temp_bytes"] for m in (2, 4)}
    res = layer_residual_bytes(Key(model, "none", 1, 1, 32, "none", "float32", fused_attention=False))
    charged, grown = 2 * 2 * res, temp[4] - temp[2]  # measured: 0.86 of the charge (XLA drops a few residuals)
    assert 0.75 * charged <= grown <= 1.1 * charged, (grown, charged, res)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_collectives_are_the_compiled_steps(schedule):
    """`space.pipeline_collectives` against the collectives the compiled pipeline step runs over `stage`
    (each counted as often as the loops around it run)."""
    from collections import Counter

    from boostjax.analysis import hlo, memory
    from boostjax.config import Config, validate
    from boostjax.planning.space import Candidate, pipeline_collectives, send_bytes

    c = Candidate(1, 2, 1, "none", 1, 3, schedule, "none", 0)
    cfg = validate(Config(MODEL, memory.train_config(3, 32, "none", "stage=2", "none", "float32", microbatches=3,
                                                     pipeline_schedule=schedule)))
    mod = hlo.parse_module(memory.train_step_compiled(cfg).compiled.as_text())
    got: Counter = Counter()
    for coll in hlo.collectives(mod):
        runs = mod.runs(coll.computation)  # None: a loop without a known trip count
        assert runs is not None and (coll.kind == "collective-permute" or sorted(coll.groups) == [(0, 1)])
        got[coll.kind, sum(a.bytes() for a in coll.results) if len(coll.results) == 1 else "top"] += runs
    feature = send_bytes(MODEL, c, 32, "float32")
    want: Counter = Counter()
    for kind, nbytes, n in pipeline_collectives(c, feature, top_bytes=1.0):
        want[kind, "top" if nbytes == 1.0 else int(nbytes)] += n
    ticks = c.slots + c.stage - 1
    assert want["collective-permute", feature] == 2 * ticks
    # XLA drops 1F1B's last backward send (nothing reads it) where it unrolls the one-tick drain loop
    assert 2 * ticks - 1 <= got.pop(("collective-permute", feature)) <= 2 * ticks
    want.pop(("collective-permute", feature))
    assert got == want


def test_accumulation_adds_every_micro_batch_and_pipeline_tick():
    """`predict` charges the gradient accumulation once per micro-batch (`--grad-accum`) or pipeline tick:
    one add per parameter array of the device, nothing with a single micro-batch and no stages."""
    from boostjax.planning.measure import Key, measure
    from boostjax.planning.predict import accumulation_s, accumulations, param_arrays, predict
    from boostjax.planning.space import Candidate

    m, _ = measure(Key(MODEL, "none", 1, 1, 32, "none", "float32", fused_attention=False))
    cluster = parse_cluster("1x4:a100")
    one = Candidate(1, 1, 1, "none", 1, 1, "-", "none", 0)
    rows = {c: predict(MODEL, c, m, HW, 1.0, cluster, 32, "float32")
            for c in (one, replace(one, slots=3), replace(one, stage=2, slots=3, schedule="1f1b"))}
    assert [accumulations(c) for c in rows] == [0, 3, 4]
    assert rows[one]["time_s"]["accumulate"] == 0.0
    w = rows[one]["weight_bytes"]
    add = accumulation_s(w, param_arrays(MODEL, MODEL.n_layers), 1, HW, 1.0)
    assert add == pytest.approx(3 * w / HW.hbm_bytes_per_s / HW.hbm_efficiency)  # a GPU: both read, one written
    assert rows[replace(one, slots=3)]["time_s"]["accumulate"] == pytest.approx(3 * add)
    for r in rows.values():
        parts = {k: v for k, v in r["time_s"].items() if k != "bubble"}
        assert sum(parts.values()) == pytest.approx(r["step_s"])
