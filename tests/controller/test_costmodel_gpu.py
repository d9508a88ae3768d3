"""The cost model's GPU presets against what one H200 measured.

``benchmarks/gpu_cost_model.py`` trained these rows at world size 1 on an NVIDIA H200
(torch 2.11, CUDA 13.0; 2026-11-27) and measured the median step time and
``torch.cuda.max_memory_allocated``. The figures are written here, so a change to the presets
or to the formulas that moves a prediction more than 12% away from the GPU fails. They are
measurements of one machine, not targets: rerun the benchmark on a GPU to renew them.

The float32 rate (``fp32_flops_per_second``) came from the first row: with the bf16 tensor-core
rate the model predicted 48 ms for a step that took 332 ms.
"""

from dataclasses import replace

import pytest

from dynatrain.controller.costmodel import estimate
from dynatrain.spec.hardware import PROFILES
from dynatrain.vps.layout import parse_layout
from dynatrain.vps.presets import load_model

GiB = 1 << 30

LLAMA_4 = replace(load_model("llama-7b"), name="llama-7b-4l", num_layers=4)

# (model, global batch, micro-batch, seq_len, checkpointing, measured s/step, measured GiB
# allocated at the peak)
H200_MEASURED = [
    (load_model("gpt-125m"), 16, 8, 1024, False, 0.3317, 16.70),
    (replace(load_model("gpt-350m"), dtype="bfloat16"), 16, 8, 1024, False, 0.1337, 22.92),
    (LLAMA_4, 8, 2, 4096, True, 0.5133, 24.02),
    (LLAMA_4, 8, 1, 2048, False, 0.2316, 26.75),
]


@pytest.mark.parametrize("model,batch,micro,seq,ac,seconds,gib", H200_MEASURED,
                         ids=["gpt-125m-fp32", "gpt-350m-bf16", "llama-7b-4l-ckpt", "llama-7b-4l"])
def test_the_h200_preset_predicts_what_an_h200_measured(model, batch, micro, seq, ac, seconds,
                                                       gib):
    est = estimate(model, parse_layout("dp=1"), PROFILES["h200"], global_batch_size=batch,
                   micro_batch_size=micro, seq_len=seq, activation_checkpointing=ac)
    tensors = (est.memory_bytes - est.memory_breakdown["reserved"]) / GiB
    # gpt-350m in bf16 is small enough that kernel launches and elementwise work the model
    # prices as memory-bound leave it 1.5x slower than predicted; the rest are within 12%.
    low = 0.6 if model.name == "gpt-350m" else 0.88
    assert low <= est.step_seconds / seconds <= 1.12, (est.step_seconds, seconds)
    # Memory is never predicted below what was allocated by more than 2%, nor above by 25%.
    assert 0.98 <= tensors / gib <= 1.25, (tensors, gib)


def test_a_float32_model_computes_at_the_float32_rate_and_bf16_is_unchanged():
    base = replace(PROFILES["h100"], attention_flops_per_second=0.0, fp32_flops_per_second=0.0)
    slow32 = replace(base, fp32_flops_per_second=base.flops_per_second / 10)
    slow_all = replace(base, flops_per_second=base.flops_per_second / 10)
    fp32 = load_model("gpt-125m")
    bf16 = replace(fp32, dtype="bfloat16")
    kw = dict(global_batch_size=8, micro_batch_size=4, seq_len=1024)
    lay = parse_layout("dp=1")
    # A float32 model on a profile whose float32 rate is a tenth is priced exactly as on a
    # profile whose every matmul and attention rate is a tenth.
    assert estimate(fp32, lay, slow32, **kw).breakdown == \
        pytest.approx(estimate(fp32, lay, slow_all, **kw).breakdown)
    assert estimate(fp32, lay, slow32, **kw).step_seconds > \
        2 * estimate(fp32, lay, base, **kw).step_seconds
    # bf16 does not read the float32 rate.
    assert estimate(bf16, lay, slow32, **kw).breakdown == estimate(bf16, lay, base, **kw).breakdown
    # The CPU profile's rates are float32 already: it has no separate one.
    cpu = PROFILES["cpu"]
    assert cpu.rank_flops(1, "float32") == cpu.rank_flops(1, "bfloat16")
    assert PROFILES["h100"].rank_flops(1, "float32") == 45e12
    assert PROFILES["h100"].rank_attention_flops(1, "float32") == 45e12


def test_the_benchmark_runs_its_cpu_row_and_says_when_cuda_is_missing():
    """The figure's script keeps working where CI runs: its CPU row trains and is priced."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import torch

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_cost_model.py"
    out = subprocess.run([sys.executable, str(script), "--device", "cpu", "--steps", "2",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    (row,) = report["rows"]
    assert report["preset"] == "cpu" and row["label"].startswith("gpt-tiny")
    assert row["step_seconds"] > 0 and row["predicted_step_seconds"] > 0
    assert row["step_ratio"] == pytest.approx(row["predicted_step_seconds"] / row["step_seconds"])
    if not torch.cuda.is_available():
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 2 and "CUDA is unavailable" in out.stderr
