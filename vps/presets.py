"""Named model presets with the exact shapes of the published models.

Parameter counts match the published models (checked in tests/vps/test_model.py): llama-2-7b
6,738,415,616; llama-2-70b 68,976,648,192; mixtral-8x7b 46,702,792,704; qwen3-235b-a22b
235,093,634,560. The GPT-2 presets pad the vocabulary from 50,257 to 50,304 (a multiple of
128, as nanoGPT and Megatron do) so that tensor parallelism can split it; that adds 0.03%.
The tiny presets exist for tests and the local demo: a few million parameters, trainable on CPU.
:func:`load_model` resolves what a user names: a preset, or a spec file.
"""

from __future__ import annotations

import json
from pathlib import Path

from .model import ModelSpec, ModelSpecError, model_from_dict

_PRESETS = [
    ModelSpec(name="gpt-tiny", arch="gpt", vocab_size=2048, hidden_size=256, num_layers=4,
              num_heads=8, ffn_hidden_size=1024, max_seq_len=128, tie_embeddings=True,
              dtype="float32", description="4-layer GPT for tests and the local demo"),
    ModelSpec(name="moe-tiny", arch="llama", vocab_size=2048, hidden_size=128, num_layers=4,
              num_heads=4, num_kv_heads=2, ffn_hidden_size=512, max_seq_len=128,
              num_experts=8, experts_top_k=2, moe_ffn_hidden_size=256, dtype="float32",
              description="4-layer MoE (8 experts, top-2, GQA) for tests"),
    ModelSpec(name="gpt-125m", arch="gpt", vocab_size=50304, hidden_size=768, num_layers=12,
              num_heads=12, ffn_hidden_size=3072, max_seq_len=1024, tie_embeddings=True,
              dtype="float32", description="GPT-2 small shapes"),
    ModelSpec(name="gpt-350m", arch="gpt", vocab_size=50304, hidden_size=1024, num_layers=24,
              num_heads=16, ffn_hidden_size=4096, max_seq_len=1024, tie_embeddings=True,
              dtype="float32", description="GPT-2 medium shapes"),
    ModelSpec(name="llama-7b", arch="llama", vocab_size=32000, hidden_size=4096, num_layers=32,
              num_heads=32, ffn_hidden_size=11008, max_seq_len=4096,
              description="Llama-2 7B"),
    ModelSpec(name="llama-13b", arch="llama", vocab_size=32000, hidden_size=5120, num_layers=40,
              num_heads=40, ffn_hidden_size=13824, max_seq_len=4096,
              description="Llama-2 13B"),
    ModelSpec(name="llama-70b", arch="llama", vocab_size=32000, hidden_size=8192, num_layers=80,
              num_heads=64, num_kv_heads=8, ffn_hidden_size=28672, max_seq_len=4096,
              description="Llama-2 70B (GQA, 8 kv heads)"),
    ModelSpec(name="mixtral-8x7b", arch="llama", vocab_size=32000, hidden_size=4096,
              num_layers=32, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
              max_seq_len=32768, num_experts=8, experts_top_k=2, moe_ffn_hidden_size=14336,
              description="Mixtral 8x7B (8 experts, top-2)"),
    ModelSpec(name="qwen3-235b-a22b", arch="llama", vocab_size=151936, hidden_size=4096,
              num_layers=94, num_heads=64, num_kv_heads=4, head_dim=128,
              ffn_hidden_size=12288, max_seq_len=40960, num_experts=128, experts_top_k=8,
              moe_ffn_hidden_size=1536, qk_norm=True,
              description="Qwen3-235B-A22B (128 experts, top-8, GQA 64/4)"),
]

PRESETS: dict[str, ModelSpec] = {m.name: m for m in _PRESETS}


def load_model(name_or_path: str) -> ModelSpec:
    """A preset by name, a spec read from a ``.yaml``/``.yml``/``.json`` file, or ``hf:DIR``
    (a Hugging Face checkpoint's ``config.json``, :mod:`.hf`)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path.startswith("hf:"):
        from .hf import model_from_hf

        return model_from_hf(name_or_path[3:])
    path = Path(name_or_path)
    if path.suffix.lower() in (".yaml", ".yml", ".json"):
        if not path.is_file():
            raise ModelSpecError(f"model file {name_or_path!r} does not exist")
        text = path.read_text()
        try:
            if path.suffix.lower() == ".json":
                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
        except Exception as e:  # parse errors: report the file and the parser's words
            raise ModelSpecError(f"model file {name_or_path!r} could not be parsed: {e}") from None
        return model_from_dict(data, source=name_or_path)
    raise ModelSpecError(f"unknown model {name_or_path!r}; valid presets: "
                         f"{', '.join(PRESETS)} (or a .yaml/.json spec file, or hf:DIR)")
