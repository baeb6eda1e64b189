"""train.cuda_graphs: the trainer replaying each micro-step from CUDA graphs trains exactly as the eager trainer.

Both runs start from the same seed and data (synthetic tokens), in bf16 on the kernel path, with gradient
accumulation over two micro-steps, so a step replays the forward graph and the backward graph twice and the
gradients accumulate outside them; between two steps both run an eager forward, as an evaluation does. The
graphs run the eager step's kernels in the same order, so the losses, the per-layer statistics that replays
refresh in place (gate means, distinct blocks, reads) and the trained weights must be identical, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sentinels.config import load_config
from sentinels.trainer import Trainer

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml"


def _evaluate_at_step_2(trainer: Trainer, step: int) -> None:
    """An eager forward between steps, as the sentinels' evaluations run: it binds new per-layer statistics, which
    the graphed steps after it must not report (the statistics of the next steps come from their own forward)."""
    if step == 2:
        trainer.model.eval()
        with torch.no_grad(), trainer._autocast():
            tokens = torch.randint(0, trainer.cfg.vocab_size(), (1, 96), generator=torch.Generator().manual_seed(1))
            trainer.model(tokens.cuda())
        trainer.model.train()


def _train(out_dir: Path, cuda_graphs: bool, *overrides: str) -> tuple[list[dict], dict[str, torch.Tensor], Trainer]:
    cfg = load_config(TINY, [f"train.out_dir={out_dir}", "train.device=cuda", "train.precision=bf16",
                             "train.seq_len=256", "train.micro_batch_size=2", "train.grad_accum=2", "train.steps=4",
                             "train.warmup_steps=1", "train.save_every=0",
                             f"train.cuda_graphs={str(cuda_graphs).lower()}", *overrides])
    trainer = Trainer(cfg, console=False, save_checkpoints=False, step_hook=_evaluate_at_step_2)
    try:
        result = trainer.train()
        assert result.status == "completed", result.halt_reason
        weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        return result.records, weights, trainer
    finally:
        trainer.close()


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "attention-recomputed"])
def test_graphed_steps_train_exactly_as_eager_steps(tmp_path, recompute):
    """Also with train.activation_checkpointing attention in the graphed run: recomputing each attention sublayer
    inside the recorded backward changes nothing, bit for bit."""
    eager_records, eager_weights, _ = _train(tmp_path / "eager", cuda_graphs=False)
    graph_records, graph_weights, trainer = _train(
        tmp_path / "graphs", True, *(("train.activation_checkpointing=attention",) if recompute else ()))
    assert trainer.graphed_loss is not None and trainer.graphed_loss._graphed is not None  # it did record
    keys = ("loss", "grad_norm", "sel_distinct_blocks", "reads_total", "gate_mean_per_layer", "gate_max_per_layer")
    for eager, graphed in zip(eager_records, graph_records, strict=True):
        for key in keys:
            assert graphed[key] == eager[key], (eager["step"], key, eager[key], graphed[key])
    assert len({r["loss"] for r in graph_records}) == len(graph_records)  # the loss moves: replays see new batches
    for name, w in eager_weights.items():
        assert torch.equal(graph_weights[name], w), name


def test_the_default_auto_records_graphs_where_they_can_run(tmp_path):
    """train.cuda_graphs defaults to auto: on for one CUDA process with contiguous packing (also with the attention
    sublayers recomputed), off (not refused) with whole blocks checkpointed or varlen packing, which graphs cannot
    replay."""
    def trainer(name: str, *overrides: str) -> Trainer:
        cfg = load_config(TINY, [f"train.out_dir={tmp_path / name}", "train.device=cuda", "train.seq_len=64",
                                 "train.steps=1", "train.warmup_steps=0", *overrides])
        assert cfg.train.cuda_graphs == "auto"
        return Trainer(cfg, console=False, save_checkpoints=False)

    for name, overrides, graphed in (("on", (), True), ("ckpt", ("train.activation_checkpointing=true",), False),
                                     ("attn", ("train.activation_checkpointing=attention",), True),
                                     ("varlen", ("data.packing=varlen",), False)):
        t = trainer(name, *overrides)
        try:
            assert (t.graphed_loss is not None) == graphed, name
        finally:
            t.close()
