"""Hypothesis strategies over small NSA configs and sequence lengths, and the reproducer printed on failure.

Configs keep the convention switches of the checked preset (--preset: phi, window_keys,
cmp_visibility, selection_score, group_reduce, and equal block sizes for `equal_blocks`) and draw
small sizes, so every property runs in milliseconds on the reference yet crosses block, window and
selection boundaries. The example budget comes from the hypothesis profile (root conftest.py:
`ci` bounded, `thorough` long; HYPOTHESIS_PROFILE=thorough).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import note
from hypothesis import strategies as st

from reference.config import NSAConfig


@dataclass(frozen=True)
class SizeSet:
    """The small sizes the strategies draw from (d_k != d_v stays possible in every set)."""

    strides: tuple[int, ...]  # d
    groups: tuple[int, ...]  # query heads per KV head
    head_dims_qk: tuple[int, ...]
    head_dims_v: tuple[int, ...]


CPU_SIZES = SizeSet(strides=(1, 2, 4), groups=(1, 2, 3), head_dims_qk=(2, 4), head_dims_v=(2, 3))
# On CUDA the Triton kernels compile once per (group, d_k, d_v, l', dtype): fewer shapes keep the GPU run's
# JIT time to about a minute.
CUDA_SIZES = SizeSet(strides=(2, 4), groups=(1, 2), head_dims_qk=(4,), head_dims_v=(2,))
_sizes = {"current": CPU_SIZES}


def use_sizes(sizes: SizeSet) -> None:
    """Select the size set (conformance/conftest.py does, from --device)."""
    _sizes["current"] = sizes


def current_sizes() -> SizeSet:
    return _sizes["current"]


def equal_blocks(preset: NSAConfig) -> bool:
    return preset.cmp_block == preset.cmp_stride == preset.sel_block


@st.composite
def configs(draw: st.DrawFn, preset: NSAConfig, *, max_blocks: int = 4, max_window: int = 12,
            phi: str | None = None) -> NSAConfig:
    """A small valid NSAConfig with the preset's conventions (phi overridable, e.g. "avg" for phi-free checks)."""
    sizes = _sizes["current"]
    d = draw(st.sampled_from(sizes.strides))
    if equal_blocks(preset):
        l = lp = d
    else:
        a = draw(st.integers(1, 3))
        l, lp = d * a, d * draw(st.integers(a, max(a, max_blocks)))
    n_init = draw(st.integers(0, 1))
    n_local = draw(st.integers(0, 2))
    n_sel = draw(st.integers(max(1, n_init + n_local), n_init + n_local + 3))
    n_kv = draw(st.integers(1, 2))
    group = draw(st.sampled_from(sizes.groups))
    return preset.replace(
        cmp_block=l, cmp_stride=d, sel_block=lp, n_sel=n_sel, n_init=n_init, n_local=n_local,
        window=draw(st.integers(1, max_window)), n_heads=n_kv * group, n_kv_heads=n_kv,
        head_dim_qk=draw(st.sampled_from(sizes.head_dims_qk)), head_dim_v=draw(st.sampled_from(sizes.head_dims_v)),
        phi=phi or preset.phi,
    )


def boundaries(cfg: NSAConfig, limit: int) -> list[int]:
    """Positions where conventions differ: around the end of compressed blocks (i*d + l - 1), selection
    block starts (k*l'), and the window edge, within 1..limit."""
    out = set()
    for i in range(limit // cfg.cmp_stride + 1):
        end = i * cfg.cmp_stride + cfg.cmp_block - 1
        out.update((end, end + 1))
    for k in range(1, limit // cfg.sel_block + 2):
        out.update((k * cfg.sel_block - 1, k * cfg.sel_block, k * cfg.sel_block + 1))
    out.update((cfg.window_size - 1, cfg.window_size, cfg.window_size + 1))
    return sorted(x for x in out if 1 <= x <= limit)


@st.composite
def lengths(draw: st.DrawFn, cfg: NSAConfig, *, low: int = 1, high: int = 40) -> int:
    """A sequence length in low..high, often one of the config's boundary positions (+1)."""
    edges = [b + 1 for b in boundaries(cfg, high - 1) if low <= b + 1 <= high]
    if edges and draw(st.booleans()):
        return draw(st.sampled_from(edges))
    return draw(st.integers(low, high))


def edge_lengths(cfg: NSAConfig) -> list[int]:
    """Document lengths where per-document conventions meet: empty, one token, shorter than l, exactly l,
    one more stride, exactly l' and l' + 1, the window (and one more)."""
    out = {0, 1, cfg.cmp_block - 1, cfg.cmp_block, cfg.cmp_block + cfg.cmp_stride, cfg.sel_block, cfg.sel_block + 1,
           cfg.window_size, cfg.window_size + 1}
    return sorted(out)


@st.composite
def document_lengths(draw: st.DrawFn, cfg: NSAConfig, *, max_docs: int = 4, max_length: int = 20,
                     min_nonempty: int = 1) -> list[int]:
    """Lengths of the documents of a packed batch (cu_seqlens): 1..max_docs documents, at least min_nonempty of
    them non-empty, each often one of edge_lengths(cfg), in random order."""
    edges = edge_lengths(cfg)
    n_docs = draw(st.integers(max(1, min_nonempty), max(max_docs, min_nonempty)))
    nonempty = st.sampled_from([x for x in edges if x >= 1]) | st.integers(1, max_length)
    anything = st.sampled_from(edges) | st.integers(0, max_length)
    lengths = [draw(nonempty if i < min_nonempty else anything) for i in range(n_docs)]
    return draw(st.permutations(lengths))


def show_reproducer(impl_spec: str, cfg: NSAConfig, call: str, **make_inputs_kwargs) -> str:
    """note() a ready-to-paste python snippet that rebuilds the failing inputs and calls the stage."""
    args = ", ".join(f"{k}={v!r}" for k, v in make_inputs_kwargs.items())
    snippet = (
        "# --- reproducer (paste into python at the repository root) ---\n"
        "import torch\n"
        "from conformance.adapters import load_impl\n"
        "from conformance.helpers import make_inputs\n"
        "from reference.config import NSAConfig\n"
        f"impl = load_impl({impl_spec!r})\n"
        f"cfg = NSAConfig(**{cfg.to_dict()!r})\n"
        f"x = make_inputs(cfg, {args})\n"
        f"{call}\n"
    )
    note(snippet)
    return snippet
