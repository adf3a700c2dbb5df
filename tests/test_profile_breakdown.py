"""benchmarks/analysis/profile_breakdown.py: a jax.profiler trace's ops by category, per step. A real trace taken
here (XLA:CPU's layout), and a TPU trace written as TSL's converter writes one (the layout this CPU
cannot make), with the program's HLO as XLA:TPU prints it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from benchmarks.analysis import profile_breakdown as pb

M, K, N = 512, 256, 384


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory) -> Path:
    """3 steps of a jitted matmul, elementwise ops and a transpose, profiled as the accelerator benchmark's --profile does."""

    @jax.jit
    def f(a, b, c):
        d = jnp.tanh(a @ b) * c + 1.0  # (M, N)
        return d.T, d.sum(0)

    a, b, c = jnp.ones((M, K)), jnp.ones((K, N)), jnp.ones((M, N))
    folder = tmp_path_factory.mktemp("cpu-trace")
    (folder / "f.hlo").write_text(f.lower(a, b, c).compile().as_text())
    jax.block_until_ready(f(a, b, c))
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(str(folder), profiler_options=options):
        for i in range(3):
            with jax.profiler.StepTraceAnnotation(pb.STEP, step_num=i):
                jax.block_until_ready(f(a, b, c))
    return folder


def test_a_cpu_trace_breaks_down_into_the_matmul_and_the_rest(cpu_trace, capsys):
    found = pb.breakdown(cpu_trace)
    rows = {r["category"]: r for r in found["rows"]}
    assert found["steps"] == 3 and found["hlo"] == ["f.hlo"]
    assert rows[pb.MATMULS]["seconds"] > 0 and rows[pb.MATMULS]["ops"] == 1
    assert rows[pb.MATMULS]["flops"] == 2 * M * K * N  # the dot's, read from the HLO: one per step
    assert sum(r["share"] for r in found["rows"]) == pytest.approx(1.0, abs=1e-12)
    assert set(rows) <= set(pb.CATEGORIES) and len(rows) >= 3  # the elementwise ops and the transpose besides
    assert found["step_seconds"] > 0 and found["top_ops"][0]["seconds"] > 0
    pb.main([str(cpu_trace)])
    printed = capsys.readouterr().out
    assert "| category | ms / step | share | ops / step | TFLOP/s |" in printed and "| matmuls |" in printed


def test_the_scopes_are_jaxtunes():
    from jaxtune.runtime.compiled import steps
    from jaxtune.runtime.modeling import loss

    assert (pb.LOSS_SCOPE, pb.OPTIMIZER_SCOPE) == (loss.SCOPE, steps.OPTIMIZER_SCOPE)


# A TPU trace as `jax.profiler.trace` writes it (`<host>.trace.json.gz`): TSL's xplane_to_trace_events.cc
# makes a process of each plane (the host's, pid 701 here as on this CPU, and each device's, pid 1 + its
# plane id) and a thread of each line, named by the line; a device op's event is named by its HLO
# instruction, and its args are its metadata's stats and its own but flops, bytes_accessed,
# program_id and symbol_id, with long_name the instruction's text. The lines and ids are XProf's
# (xprof/convert/events_db/tpu_component.h: Steps 1, XLA Modules 2, XLA Ops 3; tpu_trace_parser_test.cc:
# an op may enclose others, a while loop its body, and its own time excludes theirs); the stats an XLA op
# carries are those xprof/utils/flat_op_metrics_db_utils.cc reads (hlo_category, tf_op, model_flops,
# deduplicated_name). Times in microseconds.
HOST, TPU0, TPU1, PYTHON, STEPS, MODULES, XLA_OPS = 701, 1, 2, 11, 1, 2, 3
STEP_STARTS, STEP_US = (1000.0, 1200.0), 100.0
# (name, start within the step, duration, args): per step, matmul 30 us, the loss 10 + 8 (inside a
# while loop of 30: 12 of its own), attention 12, a copy 3, an all-reduce 2, the optimizer 4, an add 3:
# busy 84 of the step's 100.
TPU_OPS = [
    (
        "fusion.1",
        5,
        30,
        {
            "hlo_category": "convolution fusion",
            "model_flops": "3000000000",
            "long_name": "%fusion.1 = bf16[8,512,1152]{2,1,0:T(8,128)(2,1)} fusion(bf16[8,512,1152]{2,1,0:T(8,128)(2,1)} "
            "%p.1, bf16[1152,1152]{1,0:T(8,128)(2,1)} %p.2), kind=kOutput, calls=%fused_computation.1",
            "tf_op": "jit(train_step)/while/body/closed_call/jvp(linear)/dot_general",
        },
    ),
    (
        "while.2",
        40,
        30,
        {
            "hlo_category": "while",
            "long_name": "%while.2 = (s32[], f32[4096]) while((s32[], f32[4096]) %t.1), "
            "condition=%region_1.cond, body=%region_0.body",
        },
    ),
    (
        "exp_reduce_fusion",
        42,
        10,
        {"hlo_category": "loop fusion", "tf_op": "jit(train_step)/while/body/closed_call/jvp(chunked_loss)/exp"},
    ),
    (
        "fusion.4",
        55,
        8,
        {
            "hlo_category": "convolution fusion",
            "model_flops": "1000000000",
            "tf_op": "jit(train_step)/while/body/closed_call/transpose(jvp(chunked_loss))/dot_general",
        },
    ),
    (
        "splash_mha_fwd_segmented_no_residuals.3",
        72,
        12,
        {
            "hlo_category": "custom-call",
            "model_flops": "500000000",
            "long_name": "%splash_mha_fwd_segmented_no_residuals.3 = bf16[8,4,512,256]{3,2,1,0:T(8,128)(2,1)} "
            'custom-call(%q, %k, %v), custom_call_target="tpu_custom_call"',
            "tf_op": "jit(train_step)/while/body/closed_call/jvp(splash_mha_fwd_segmented_no_residuals)/pallas_call",
        },
    ),
    (
        "copy.5",
        85,
        3,
        {"hlo_category": "data formatting", "long_name": "%copy.5 = bf16[512,8,1152]{2,1,0} copy(%fusion.1)"},
    ),
    ("all-reduce.6", 88, 2, {"hlo_category": "all-reduce"}),
    ("multiply_add_fusion", 90, 4, {"hlo_category": "loop fusion", "tf_op": "jit(train_step)/optimizer/mul"}),
    (
        "add_fusion",
        94,
        3,
        {"hlo_category": "loop fusion", "tf_op": "jit(train_step)/while/body/closed_call/jvp(aten::add.Tensor)/add"},
    ),
]
EXPECTED_US = {
    pb.MATMULS: 30,
    pb.LOSS: 18,
    pb.OTHER: 12,
    pb.ATTENTION: 12,
    pb.LAYOUT: 3,
    pb.COLLECTIVES: 2,
    pb.OPTIMIZER: 4,
    pb.ELEMENTWISE: 3,
    pb.IDLE: 16,
}
EXPECTED_FLOPS = {pb.MATMULS: 3e9, pb.LOSS: 1e9, pb.ATTENTION: 5e8}


def tpu_trace_events() -> list[dict]:
    def named(kind: str, pid: int, name: str, tid: int | None = None) -> dict:
        return {
            "ph": "M",
            "pid": pid,
            "name": kind,
            "args": {"name": name},
            **({"tid": tid} if tid is not None else {}),
        }

    events = [
        named("process_name", HOST, "/host:CPU"),
        named("thread_name", HOST, "python", PYTHON),
        named("process_name", TPU0, "/device:TPU:0"),
        named("process_name", TPU1, "/device:TPU:1"),
    ]
    events += [
        named("thread_name", pid, line, tid)
        for pid in (TPU0, TPU1)
        for tid, line in ((STEPS, "Steps"), (MODULES, "XLA Modules"), (XLA_OPS, "XLA Ops"))
    ]
    for i, start in enumerate(STEP_STARTS):
        events.append(
            {
                "ph": "X",
                "pid": HOST,
                "tid": PYTHON,
                "ts": start,
                "dur": STEP_US,
                "name": pb.STEP,
                "args": {"step_num": str(i)},
            }
        )
        events.append({"ph": "X", "pid": TPU0, "tid": STEPS, "ts": start + 5, "dur": 92, "name": str(i)})
        events.append(
            {
                "ph": "X",
                "pid": TPU0,
                "tid": MODULES,
                "ts": start + 5,
                "dur": 92,
                "name": "jit_train_step(1234)",
                "args": {"run_id": str(i)},
            }
        )
        for name, offset, duration, args in TPU_OPS:
            events.append(
                {
                    "ph": "X",
                    "pid": TPU0,
                    "tid": XLA_OPS,
                    "ts": start + offset,
                    "dur": duration,
                    "name": name,
                    "args": {"deduplicated_name": "", **args},
                }
            )
        # another chip's ops (a slice of several): not counted, every chip running the same program
        events.append(
            {
                "ph": "X",
                "pid": TPU1,
                "tid": XLA_OPS,
                "ts": start + 5,
                "dur": 50,
                "name": "fusion.1",
                "args": {"hlo_category": "convolution fusion"},
            }
        )
    return events


def test_a_tpu_trace_is_read_from_its_first_chips_xla_ops(tmp_path):
    run = tmp_path / "plugins" / "profile" / "2026_12_06_10_00_00"
    run.mkdir(parents=True)
    with gzip.open(run / "t1v-n-0.trace.json.gz", "wt") as f:
        json.dump({"displayTimeUnit": "ns", "metadata": {"highres-ticks": True}, "traceEvents": tpu_trace_events()}, f)
    found = pb.breakdown(tmp_path)
    assert found["steps"] == 2 and found["step_seconds"] == pytest.approx(STEP_US * 1e-6)
    assert found["busy_seconds"] == pytest.approx(84e-6)
    rows = {r["category"]: r for r in found["rows"]}
    assert list(rows) == [c for c in pb.CATEGORIES if c in EXPECTED_US]  # the table's order; no empty rows
    for category, microseconds in EXPECTED_US.items():
        assert rows[category]["seconds"] == pytest.approx(microseconds * 1e-6, rel=1e-9), category
        assert rows[category]["share"] == pytest.approx(microseconds / STEP_US, rel=1e-9), category
        assert rows[category]["flops"] == pytest.approx(EXPECTED_FLOPS.get(category, 0.0)), category
    assert rows[pb.LOSS]["ops"] == 2 and rows[pb.IDLE]["ops"] == 0
    assert found["top_ops"][0] == {"op": "fusion.1", "category": pb.MATMULS, "seconds": pytest.approx(30e-6)}
    table = pb.markdown(found)
    assert "| matmuls | 0.030 | 30.0% | 1 | 100 |" in table  # 3 GFLOP in 30 us
    assert "| idle | 0.016 | 16.0% |  |  |" in table


def test_a_trace_without_ops_or_steps_says_what_it_lacks(tmp_path):
    events = [e for e in tpu_trace_events() if e.get("tid") != XLA_OPS]
    with gzip.open(tmp_path / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    with pytest.raises(ValueError, match="no XLA op events .* threads: .*'Steps'"):
        pb.breakdown(tmp_path)
    with gzip.open(tmp_path / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": [e for e in events if e["name"] != pb.STEP]}, f)
    with pytest.raises(ValueError, match="no 'train' events"):
        pb.breakdown(tmp_path / "host.trace.json.gz")


# XLA:TPU's optimized HLO (libtpu's compile of a splash-attention forward and a matmul's gradient,
# trimmed): a dot is a convolution with dim_labels, and a Pallas kernel's kernel_metadata spans lines.
TPU_HLO = """HloModule jit_train_step, is_scheduled=true

%fused_computation.2 (param_0.4: bf16[512,256], param_1.15: bf16[384,512]) -> bf16[256,384] {
  %param_0.4 = bf16[512,256]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %param_1.15 = bf16[384,512]{1,0:T(8,128)(2,1)S(1)} parameter(1)
  ROOT %convolution.2 = bf16[256,384]{1,0:T(8,128)(2,1)} convolution(%param_0.4, %param_1.15), dim_labels=fb_oi->bf, metadata={op_name="jit(train_step)/transpose(jvp())/dot_general" stack_frame_id=7}
}

ENTRY %main.3 (q.1: bf16[2,2,512,128], x.1: bf16[512,256], w.1: bf16[384,512]) -> (bf16[2,2,512,128], bf16[256,384]) {
  %q.1 = bf16[2,2,512,128]{3,2,1,0:T(8,128)(2,1)} parameter(0), metadata={op_name="q"}
  %x.1 = bf16[512,256]{1,0:T(8,128)(2,1)} parameter(1), metadata={op_name="x"}
  %w.1 = bf16[384,512]{1,0:T(8,128)(2,1)} parameter(2), metadata={op_name="w"}
  %splash_mha_fwd_residuals.1 = (bf16[2,2,512,128]{3,2,1,0:T(8,128)(2,1)S(1)}, f32[2,2,512,128]{3,2,1,0:T(8,128)S(1)}) custom-call(%q.1, %q.1, %q.1), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 128, \\"block_kv\\": 128}"
}}, metadata={op_name="jit(train_step)/jvp(vmap(static_sparsity_splash))/jit(_splash_attention)/splash_mha_fwd_residuals/pallas_call" stack_frame_id=5}, backend_config={"custom_call_config":{"body":"TUzvUgFN"}}
  %pallas_call.2 = bf16[2,2,512,128]{3,2,1,0:T(8,128)(2,1)S(1)} get-tuple-element(%splash_mha_fwd_residuals.1), index=0
  %copy = bf16[2,2,512,128]{2,3,1,0:T(8,128)(2,1)} copy(%pallas_call.2), metadata={op_name="jit(train_step)/jvp(vmap(static_sparsity_splash))/jit(_splash_attention)/splash_mha_fwd_residuals/pallas_call"}
  %fusion = bf16[256,384]{1,0:T(8,128)(2,1)} fusion(%x.1, %w.1), kind=kOutput, calls=%fused_computation.2, metadata={op_name="jit(train_step)/transpose(jvp())/dot_general" stack_frame_id=7}
  ROOT %tuple.3 = (bf16[2,2,512,128]{2,3,1,0:T(8,128)(2,1)}, bf16[256,384]{1,0:T(8,128)(2,1)}) tuple(%copy, %fusion)
}
"""


def test_xla_tpus_hlo_names_each_ops_kind_and_flops():
    ops = pb.hlo_ops(TPU_HLO)
    assert ops["fusion"]["flops"] == 2 * 256 * 384 * 512 and "convolution" in ops["fusion"]["fused"]
    assert ops["splash_mha_fwd_residuals.1"]["op_name"].endswith("splash_mha_fwd_residuals/pallas_call")
    kinds = {
        name: pb.classify(pb.describe({"name": name, "args": {}}, ops))
        for name in ("fusion", "splash_mha_fwd_residuals.1", "copy")
    }
    # the kernel's own op is attention; the copy of its output under the same op_name is a copy
    assert kinds == {"fusion": pb.MATMULS, "splash_mha_fwd_residuals.1": pb.ATTENTION, "copy": pb.LAYOUT}
