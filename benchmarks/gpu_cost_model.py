"""The cost model against one real GPU: predicted vs measured step time and peak memory.

The solver picks layouts by :func:`dynatrain.controller.costmodel.estimate`, whose GPU presets
(``dynatrain/spec/hardware.py``) come from datasheets and published rates, and whose memory
terms are pinned by hand-computed cases. This trains a few models at world size 1 on one GPU
(``dp=1``: no communication, so compute, optimizer and memory terms alone are compared) and
prints, per model, the estimate next to the measurement:

* step time: median over ``--steps`` timed steps after two warm-up steps (CUDA synchronised),
  against ``Estimate.step_seconds`` on the preset the GPU's name selects;
* peak memory: ``torch.cuda.max_memory_allocated`` over construction and every step (what the
  tensors need) and ``max_memory_reserved`` (what the caching allocator held), against
  ``Estimate.memory_bytes`` and the same without the preset's fixed reserve.

The 7B row uses Llama-2 7B's shapes with ``--llama-layers`` of its 32 layers, so it starts in
seconds (initial values are drawn on the CPU); per-layer terms are what it checks.

    python benchmarks/gpu_cost_model.py [--steps 5] [--llama-layers 4] [--json]
    python benchmarks/gpu_cost_model.py --device cpu      # gpt-tiny only, the CPU profile

Exit code: 0 when every row ran, 1 if one failed, 2 if CUDA is unavailable (and not --device cpu).
Ratios are printed, never judged: they are the calibration the controller's measured ratio
(``Measurement``) applies while a job runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

import torch

GiB = 1 << 30


def _cases(device: str, llama_layers: int) -> list[dict]:
    """(model, batch, sequence, checkpointing) rows: fp32 GPT shapes, bf16 GPT, bf16 Llama-7B."""
    from dynatrain.vps.presets import load_model

    if device == "cpu":
        return [dict(label="gpt-tiny fp32", model=load_model("gpt-tiny"), batch=4, micro=2,
                     seq=128, ac=False)]
    gpt350 = load_model("gpt-350m")
    llama = load_model("llama-7b")
    cut = replace(llama, name=f"llama-7b-{llama_layers}l", num_layers=llama_layers)
    return [
        dict(label="gpt-125m fp32", model=load_model("gpt-125m"), batch=16, micro=8, seq=1024,
             ac=False),
        dict(label="gpt-350m bf16", model=replace(gpt350, dtype="bfloat16"), batch=16, micro=8,
             seq=1024, ac=False),
        dict(label=f"llama-7b shapes, {llama_layers} layers, bf16, checkpointed", model=cut,
             batch=8, micro=2, seq=4096, ac=True),
        dict(label=f"llama-7b shapes, {llama_layers} layers, bf16", model=cut, batch=8, micro=1,
             seq=2048, ac=False),
    ]


def measure(case: dict, dev: torch.device, profile, steps: int) -> dict:
    """One row: the estimate, then the trainer's measured step time and peak memory."""
    from dynatrain.controller.costmodel import estimate
    from dynatrain.trainer.config import TrainConfig
    from dynatrain.trainer.groups import build_groups
    from dynatrain.trainer.trainer import Trainer
    from dynatrain.vps.layout import bind, parse_layout

    model, layout = case["model"], parse_layout("dp=1")
    est = estimate(model, layout, profile, global_batch_size=case["batch"],
                   micro_batch_size=case["micro"], seq_len=case["seq"],
                   activation_checkpointing=case["ac"])
    cfg = TrainConfig(model=model, layout=layout, global_batch_size=case["batch"],
                      micro_batch_size=case["micro"], seq_len=case["seq"],
                      activation_checkpointing=case["ac"])
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, build_groups(bind(layout.with_devices([0]), model), 0), device=dev)
    built = time.perf_counter() - t0
    times = []
    for i in range(steps + 2):
        if cuda:
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        trainer.train_step()
        if cuda:
            torch.cuda.synchronize(dev)
        if i >= 2:
            times.append(time.perf_counter() - t)
    measured = statistics.median(times)
    row = {"label": case["label"], "params": model.num_params,
           "batch": case["batch"], "micro_batch": case["micro"], "seq_len": case["seq"],
           "activation_checkpointing": case["ac"], "build_seconds": built,
           "step_seconds": measured, "predicted_step_seconds": est.step_seconds,
           "step_ratio": est.step_seconds / measured,
           "predicted_breakdown": est.breakdown,
           "predicted_memory_bytes": est.memory_bytes,
           "predicted_memory_breakdown": est.memory_breakdown}
    if cuda:
        allocated = torch.cuda.max_memory_allocated(dev)
        tensors = est.memory_bytes - est.memory_breakdown.get("reserved", 0)
        row.update(peak_allocated_bytes=allocated,
                   peak_reserved_bytes=torch.cuda.max_memory_reserved(dev),
                   memory_ratio=est.memory_bytes / torch.cuda.max_memory_reserved(dev),
                   tensor_ratio=tensors / allocated)
    del trainer
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (default 5)")
    parser.add_argument("--llama-layers", type=int, default=4, metavar="N",
                        help="layers of Llama-2 7B's 32 to build (default 4)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    from dynatrain.spec.hardware import PROFILES, profile_for_gpu_name

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("gpu_cost_model: CUDA is unavailable here (torch.cuda.is_available() is "
                  "False): run it on a machine with an NVIDIA GPU, or pass --device cpu",
                  file=sys.stderr)
            return 2
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        name = torch.cuda.get_device_name(dev)
        profile = profile_for_gpu_name(name)
        if profile is None:
            print(f"gpu_cost_model: no preset for {name!r} (dynatrain/spec/hardware.py has "
                  f"{', '.join(sorted(PROFILES))})", file=sys.stderr)
            return 2
    else:
        dev, name, profile = torch.device("cpu"), "cpu", PROFILES["cpu"]
    say = (lambda *_: None) if args.json else print
    say(f"{name}: preset {profile.name}, torch {torch.__version__}")
    out = {"device": name, "preset": profile.name, "rows": [], "failed": []}
    for case in _cases(args.device, args.llama_layers):
        try:
            row = measure(case, dev, profile, args.steps)
        except Exception as e:  # noqa: BLE001 - a row that fails is reported, then the exit code
            out["failed"].append(case["label"])
            say(f"{case['label']}: FAILED: {type(e).__name__}: {e}")
            continue
        out["rows"].append(row)
        say(f"{row['label']} ({row['params'] / 1e9:.2f} B params, batch {row['batch']} x "
            f"{row['seq_len']}, micro-batch {row['micro_batch']}):")
        say(f"  step    predicted {row['predicted_step_seconds'] * 1e3:8.1f} ms   measured "
            f"{row['step_seconds'] * 1e3:8.1f} ms   predicted/measured "
            f"{row['step_ratio']:.2f}")
        say("          predicted " + ", ".join(f"{k} {v * 1e3:.1f}"
                                               for k, v in row["predicted_breakdown"].items()
                                               if v) + " ms")
        if "peak_allocated_bytes" in row:
            say(f"  memory  predicted {row['predicted_memory_bytes'] / GiB:8.2f} GiB  reserved "
                f"{row['peak_reserved_bytes'] / GiB:8.2f} GiB  predicted/reserved "
                f"{row['memory_ratio']:.2f}")
            say(f"          tensors: predicted {(row['predicted_memory_bytes'] - row['predicted_memory_breakdown'].get('reserved', 0)) / GiB:.2f} GiB, "
                f"allocated {row['peak_allocated_bytes'] / GiB:.2f} GiB, ratio "
                f"{row['tensor_ratio']:.2f}; predicted "
                + ", ".join(f"{k} {v / GiB:.2f}"
                            for k, v in row["predicted_memory_breakdown"].items()) + " GiB")
    if args.json:
        print(json.dumps(out))
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
