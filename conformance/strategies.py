"""Hypothesis strategies over small NSA configs and sequence lengths inside the envelope of the implementation
under test, and the reproducer printed on failure.

The envelope (Envelope) is the checked conventions (--preset, --set, --config: the NSAConfig convention switches,
and equal block sizes for a preset with l = d = l') intersected with the implementation's declared Capabilities
(conformance/adapters/capabilities.py) and with the small sizes of the device (SizeSet). `configs` draws only
inside it, preferring small sizes so every property runs in milliseconds on the reference yet crosses block,
window and selection boundaries; `Envelope.fit` moves a test's fixed config into it (or reports NOT COVERED
when nothing inside can). The example budget comes from the hypothesis profile (root conftest.py: `ci` bounded,
`thorough` long; HYPOTHESIS_PROFILE=thorough).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import note
from hypothesis import strategies as st

from conformance.adapters import not_covered
from conformance.adapters.capabilities import CONVENTIONS, EVERYTHING, Capabilities
from reference.config import NSAConfig


@dataclass(frozen=True)
class SizeSet:
    """The small sizes the strategies prefer (d_k != d_v stays possible in every set)."""

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


@dataclass(frozen=True)
class Envelope:
    """What the suite may draw: the checked conventions (an NSAConfig whose convention switches are kept and whose
    sizes serve the tests that need real sizes, e.g. Table 4), the implementation's capabilities, the device's
    small sizes."""

    conventions: NSAConfig
    caps: Capabilities = EVERYTHING
    sizes: SizeSet = field(default_factory=current_sizes)

    @property
    def equal_blocks(self) -> bool:
        return self.caps.block_layout == "equal" or equal_blocks(self.conventions)

    def conventions_outside(self) -> list[str]:
        """The checked convention switches the implementation does not declare (each 'name=value (declared ...)')."""
        return [f"{name}={getattr(self.conventions, name)!r} (declared {sorted(getattr(self.caps, name))})"
                for name in CONVENTIONS if getattr(self.conventions, name) not in getattr(self.caps, name)]

    def _require_phi(self, phi: str) -> None:
        if phi not in self.caps.phi:
            not_covered(f"outside the declared capabilities: the test needs phi={phi!r} "
                        f"(declared {sorted(self.caps.phi)})")

    def block_options(self) -> list[tuple[int, int, int]]:
        """Small (l, d, l') layouts inside the envelope, the device's strides first."""
        rule = self.caps.block_sizes
        if self.equal_blocks:
            return [(b, b, b) for b in rule.within(self.sizes.strides)]
        out = []
        for d in rule.within(self.sizes.strides):
            for a in range(1, 4):
                for b in range(a, a + 4):
                    l, lp = d * a, d * b
                    if self.caps.block_layout == "sel_multiple_of_cmp" and lp % l:
                        continue
                    if rule.allows(l) and rule.allows(lp):
                        out.append((l, d, lp))
        return out or [(b, b, b) for b in rule.within(self.sizes.strides)]

    def forced_options(self) -> list[tuple[int, int]]:
        if self.caps.forced_blocks is not None:
            return sorted(self.caps.forced_blocks)
        return [(i, j) for i in range(2) for j in range(3)]

    def fit(self, cfg: NSAConfig, *, equal_block: int | None = None) -> NSAConfig:
        """cfg moved into the envelope: the checked conventions (cfg's phi kept: a test may ask for "avg"), each
        size the nearest allowed value, blocks and forced blocks as declared (equal blocks of `equal_block`, default
        d, where only equal blocks are checked). NOT COVERED (a skip) if nothing fits."""
        caps = self.caps
        self._require_phi(cfg.phi)
        changes: dict = {name: getattr(self.conventions, name) for name in CONVENTIONS if name != "phi"}
        l, d, lp = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block
        if self.equal_blocks and not l == d == lp:
            l = d = lp = equal_block or d
        layout_ok = all(caps.block_sizes.allows(n) for n in (l, d, lp)) and not (
            caps.block_layout == "sel_multiple_of_cmp" and lp % l) and not (caps.block_layout == "equal"
                                                                              and not l == d == lp)
        if not layout_ok:
            b = caps.block_sizes.pick(lp if self.equal_blocks else l)
            if b is None:
                not_covered(f"outside the declared capabilities: no block size fits {caps.block_sizes.describe()}")
            l = d = lp = b
        n_init, n_local = cfg.n_init, cfg.n_local
        if caps.forced_blocks is not None and (n_init, n_local) not in caps.forced_blocks:
            n_init, n_local = self.forced_options()[0]
        n_sel = caps.n_sel.pick(max(cfg.n_sel, n_init + n_local, 1))
        window = caps.window.pick(cfg.window)
        kv = caps.kv_heads.pick(cfg.n_kv_heads)
        group = caps.group_sizes.pick(cfg.group_size)
        dk = caps.head_dims_qk.pick(cfg.head_dim_qk)
        dv = dk if caps.equal_head_dims else caps.head_dims_v.pick(cfg.head_dim_v)
        if None in (n_sel, window, kv, group, dk, dv) or (caps.equal_head_dims and not caps.head_dims_v.allows(dk)):
            not_covered(f"outside the declared capabilities: no size fits {cfg}")
        out = cfg.replace(**changes, cmp_block=l, cmp_stride=d, sel_block=lp, n_init=n_init, n_local=n_local,
                          n_sel=n_sel, window=window, n_kv_heads=kv, n_heads=kv * group, head_dim_qk=dk, head_dim_v=dv)
        why = caps.outside(out)
        if why:
            not_covered(f"outside the declared capabilities: {why}")
        _observe(out)
        return out

    def describe(self) -> dict:
        """The envelope for the reports: the conventions checked and the declared capabilities."""
        return {"conventions": {name: getattr(self.conventions, name) for name in CONVENTIONS},
                "capabilities": self.caps.describe(), "preferred_sizes": self.sizes.__dict__}


def as_envelope(preset: NSAConfig | Envelope) -> Envelope:
    """An Envelope; a bare NSAConfig (a preset) means everything with that preset's conventions."""
    return preset if isinstance(preset, Envelope) else Envelope(preset)


@st.composite
def configs(draw: st.DrawFn, preset: NSAConfig | Envelope, *, max_blocks: int = 4, max_window: int = 12,
            phi: str | None = None) -> NSAConfig:
    """A small valid NSAConfig inside the envelope (phi overridable, e.g. "avg" for phi-free checks: NotCovered
    when the implementation declares no such phi). Every drawn config is recorded for the report
    (conformance.verdict.observe_config)."""
    env = as_envelope(preset)
    caps = env.caps
    phi = phi or env.conventions.phi
    env._require_phi(phi)
    layouts = [t for t in env.block_options() if t[2] <= t[1] * max(max_blocks, 1)] or env.block_options()
    l, d, lp = draw(st.sampled_from(layouts))
    n_init, n_local = draw(st.sampled_from(env.forced_options()))
    forced = n_init + n_local
    n_sel_options = [n for n in range(max(1, forced), forced + 4) if caps.n_sel.allows(n)] or \
        caps.n_sel.smallest(1, at_least=max(1, forced))
    n_sel = draw(st.sampled_from(n_sel_options))
    n_kv = draw(st.sampled_from(caps.kv_heads.within((1, 2))))
    group = draw(st.sampled_from(caps.group_sizes.within(env.sizes.groups)))
    dk = draw(st.sampled_from(caps.head_dims_qk.within(env.sizes.head_dims_qk)))
    dv = dk if caps.equal_head_dims else draw(st.sampled_from(caps.head_dims_v.within(env.sizes.head_dims_v)))
    window = draw(st.sampled_from(caps.window.within(range(1, max_window + 1))))
    cfg = env.conventions.replace(
        cmp_block=l, cmp_stride=d, sel_block=lp, n_sel=n_sel, n_init=n_init, n_local=n_local,
        window=window, n_heads=n_kv * group, n_kv_heads=n_kv, head_dim_qk=dk, head_dim_v=dv, phi=phi,
    )
    _observe(cfg)
    return cfg


def _observe(cfg: NSAConfig) -> None:
    from conformance.verdict import observe_config

    observe_config(cfg)


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
