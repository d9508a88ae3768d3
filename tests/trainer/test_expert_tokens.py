"""An MoE step reports the tokens it routed to each expert (StepResult.expert_tokens, the
controller's measured expert load: dynatrain.controller.measured). One process, dp=1: every
token goes to top_k experts in each of the stage's layers, so the counts sum to
tokens x top_k x layers, once per step, with activation checkpointing (whose backward runs each
block's forward again) as without, and the routing itself (the counts) is the same."""

from __future__ import annotations

import torch

from dynatrain.trainer.config import make_config
from dynatrain.trainer.launch import bind, build_groups
from dynatrain.trainer.trainer import Trainer


def _steps(model: str, n: int, **kw) -> list:
    cfg = make_config(model, "dp=1", global_batch_size=4, micro_batch_size=2, seq_len=16,
                      lr=1e-3, **kw)
    trainer = Trainer(cfg, build_groups(bind(cfg.layout, cfg.model), 0),
                      device=torch.device("cpu"))
    return [trainer.train_step() for _ in range(n)]


def test_each_step_counts_the_tokens_routed_to_each_expert_once():
    plain = _steps("moe-tiny", 2)
    recomputed = _steps("moe-tiny", 2, activation_checkpointing=True)
    m = make_config("moe-tiny", "dp=1", global_batch_size=4, seq_len=16).model
    for r in plain + recomputed:
        assert len(r.expert_tokens) == m.num_experts == 8
        assert sum(r.expert_tokens) == 4 * 16 * m.experts_top_k * m.num_layers     # 512
    assert [r.expert_tokens for r in plain] == [r.expert_tokens for r in recomputed]
    assert plain[0].expert_tokens != plain[1].expert_tokens        # each step its own batch
    assert [r.loss for r in plain] == [r.loss for r in recomputed]


def test_a_dense_model_reports_no_experts():
    assert _steps("gpt-tiny", 1)[0].expert_tokens == ()
