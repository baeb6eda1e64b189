"""Planted causal leaks for the sentinel self-test, each one a bug that NSA code has shipped or that the paper's text
invites. A plant is applied from outside the model, in one of two ways:

  * a DEBUG switch of the model (model.debug.leak / leak_scope, sentinels/config.py): the keys and values handed
    to the NSA call are shifted before the call, so the leak runs through whatever path the model takes (the
    Triton kernels on CUDA included);
  * a replaced convention seam of `optimized` (optimized.masks, looked up at call time, as the conformance
    self-test plants its bugs): the rule itself is wrong. A seam plant reaches only a path that reads that seam;
    the count of calls tells whether it did (`PlantHandle.calls`), so a path that computes the rule itself reports
    the plant as not applicable instead of missed.

Every plant is a real leak: changing some token t moves a logit at a position p < t (tests/test_sentinels_plants.py
checks one such (p, t) per plant with a direct comparison).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch


# -- replaced seams (each takes the original rule and returns the broken one) ---------------------------------
def _window_next_key(original: Callable) -> Callable:
    def window_key_visible(key, pos, cfg):  # the window holds key p + 1 too
        return original(key, pos, cfg) | (key == pos + 1)
    return window_key_visible


def _cmp_visible_early(original: Callable) -> Callable:
    def compressed_block_visible(block_idx, pos, cfg):  # Eq. 7 read as i*d + l - 2 <= p
        return original(block_idx, pos + 1, cfg)
    return compressed_block_visible


def _selected_unclipped(original: Callable) -> Callable:
    def selected_token_visible(token, pos, cfg):  # every token of a selected block, block J's future ones too
        return torch.ones_like(original(token, pos, cfg))
    return selected_token_visible


def _next_sel_block(original: Callable) -> Callable:
    def current_sel_block(pos, cfg):  # Eq. 11 ranks blocks 0..J+1 and forces J+1 as a local block
        return original(pos, cfg) + 1
    return current_sel_block


def _clip_inside_current_block(original: Callable) -> Callable:
    def selected_token_visible(token, pos, cfg):  # the clip to p applied inside block J only
        after_current = token >= (torch.div(pos, cfg.sel_block, rounding_mode="floor") + 1) * cfg.sel_block
        return original(token, pos, cfg) | after_current
    return selected_token_visible


def _score_all_blocks(original: Callable) -> Callable:
    def cmp_importance(logits, visible, cfg):  # Eq. 8 softmax over every compressed block, visible or not
        return original(logits, torch.ones_like(visible), cfg)
    return cmp_importance


@dataclass(frozen=True)
class Plant:
    name: str
    what: str  # the bug, one line
    leak_class: str  # which positions/parts see the future
    debug: dict[str, str] = field(default_factory=dict)  # model.debug overrides
    seams: dict[str, Callable[[Callable], Callable]] = field(default_factory=dict)  # optimized.masks attribute
    last_layer_only: bool = False  # seam plants: the replaced rule applies inside the model's last layer only

    @property
    def overrides(self) -> dict[str, Any]:
        """Dotted run-config overrides that switch the plant's DEBUG switches on (empty for seam plants)."""
        return {f"model.debug.{key}": value for key, value in self.debug.items()}

    @property
    def reaches_kernels(self) -> bool:
        """DEBUG plants change the inputs of the NSA call, so every path (kernels included) computes the leak."""
        return not self.seams

    @contextlib.contextmanager
    def installed(self, model: torch.nn.Module | None = None) -> Iterator["PlantHandle"]:
        """Replace the plant's seams (restored on exit). With last_layer_only, `model`'s last block switches the
        replaced rule on while it runs. DEBUG plants need nothing here (their config overrides do it)."""
        handle = PlantHandle(self)
        if not self.seams:
            yield handle
            return
        from optimized import masks

        originals = {name: getattr(masks, name) for name in self.seams}
        hooks = []
        handle.active = not self.last_layer_only
        if self.last_layer_only:
            if model is None:
                raise ValueError(f"plant {self.name}: last_layer_only needs the model")
            last = model.blocks[-1]
            hooks.append(last.register_forward_pre_hook(lambda *_: handle.set_active(True)))
            hooks.append(last.register_forward_hook(lambda *_: handle.set_active(False)))
        for name, make in self.seams.items():
            setattr(masks, name, handle.counted(name, originals[name], make(originals[name])))
        try:
            yield handle
        finally:
            for name, original in originals.items():
                setattr(masks, name, original)
            for hook in hooks:
                hook.remove()


class PlantHandle:
    """An installed plant: whether its rule is on now, and how often a replaced seam was called while on."""

    def __init__(self, plant: Plant):
        self.plant = plant
        self.active = True
        self.calls_by_seam = {name: 0 for name in plant.seams}

    def set_active(self, value: bool) -> None:
        self.active = value

    def counted(self, name: str, original: Callable, broken: Callable) -> Callable:
        def seam(*args, **kwargs):
            if not self.active:
                return original(*args, **kwargs)
            self.calls_by_seam[name] += 1
            return broken(*args, **kwargs)
        return seam

    @property
    def calls(self) -> int:
        return sum(self.calls_by_seam.values())

    @property
    def uncalled(self) -> list[str]:
        """The replaced seams the model's path never called while the plant was on."""
        return sorted(name for name, n in self.calls_by_seam.items() if n == 0)

    @property
    def reached(self) -> bool:
        """Every replaced seam was called: a plant made of two rules (a wider pick, then a clip only inside block
        J) is a leak only where the path reads both, so a path that reads one of them does not apply it."""
        return not self.uncalled


PLANTS: dict[str, Plant] = {p.name: p for p in (
    Plant("kv_next_token", "every branch's keys/values at p are those of p+1", "every position, every branch",
          debug={"leak": "kv_next_token"}),
    Plant("cmp_block_early", "compressed keys/values shifted by d: block i holds tokens up to i*d+l-1+d",
          "every position past l-1, compressed branch", debug={"leak": "cmp_block_early"}),
    Plant("cmp_one_early", "compressed keys/values shifted by one: the query at i*d+l-1 reads token p+1",
          "1 position in d, compressed branch (and the selection scores)", debug={"leak": "cmp_one_early"}),
    Plant("cmp_visible_early", "Eq. 7 read as i*d+l-2 <= p: a compressed block is visible one token early",
          "1 position in d, compressed branch (and the selection scores)",
          seams={"compressed_block_visible": _cmp_visible_early}),
    Plant("cmp_visible_early_last_layer", "as cmp_visible_early, in the last layer only",
          "1 position in d, one layer", seams={"compressed_block_visible": _cmp_visible_early}, last_layer_only=True),
    Plant("window_next_key", "the sliding window includes key p+1", "every position, window branch",
          seams={"window_key_visible": _window_next_key}),
    Plant("win_next_token_last_layer", "window keys/values at p are those of p+1, last layer only",
          "every position, one layer", debug={"leak": "win_next_token", "leak_scope": "last_layer"}),
    Plant("win_next_token_one_head", "window keys/values at p are those of p+1, query head 0 only",
          "every position, one head", debug={"leak": "win_next_token", "leak_scope": "one_head"}),
    Plant("slc_values_next_token", "the selected branch reads the values of p+1 (its keys are right)",
          "every position, selected branch", debug={"leak": "slc_values_next_token"}),
    Plant("sel_block_unclipped", "the tokens of a selected block are not clipped to <= p (block J is whole)",
          "positions before the end of their block, selected branch",
          seams={"selected_token_visible": _selected_unclipped}),
    Plant("sel_next_block", "Eq. 11 may pick block J+1 (forced as local), clipped to p only inside block J",
          "every position, selected branch",
          seams={"current_sel_block": _next_sel_block, "selected_token_visible": _clip_inside_current_block}),
    Plant("sel_block_end_kv", "the selected branch's keys/values at each token are those of its block's last "
          "token: a query inside block J reads block J's end", "positions before the end of their block, selected "
          "branch", debug={"leak": "slc_block_end"}),
    Plant("sel_scores_next_block", "Eq. 8 scores the compressed keys shifted by d (a block is scored on tokens up "
          "to d past its end); the attention itself is clean", "selection only: future tokens change which past "
          "blocks are picked", debug={"leak": "sel_scores_next_block"}),
    Plant("sel_score_all_blocks", "Eq. 8 scores are a softmax over every compressed block, visible or not",
          "selection only: future blocks change which past blocks are picked",
          seams={"cmp_importance": _score_all_blocks}),
)}
