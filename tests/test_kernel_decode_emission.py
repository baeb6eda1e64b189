"""The lean step's Eq. 7 emission kernel (optimized/kernels/decode_emission.py) in the interpreter on tiny fp32
shapes, against Eq. 7 written out here in float64 over the whole key sequence: block i = phi(keys [i*d, i*d + l)),
phi = mean or w2^T silu(w1^T flatten(block + pos) + b1) + b2. Rows that complete no block, and padding rows, must
leave the store untouched."""

from __future__ import annotations

import pytest
import torch

from optimized.kernels import decode_emission
from optimized.kernels.decode_emission import emit_step_block
from reference.config import NSAConfig
from reference.contract import PhiWeights

UNTOUCHED = 777.0


def eq7_block(keys: torch.Tensor, i: int, cfg: NSAConfig, w) -> torch.Tensor:
    """Eq. 7 for one (row, head): keys [T, D] float64 -> the compressed token of block i [D]."""
    block = keys[i * cfg.cmp_stride: i * cfg.cmp_stride + cfg.cmp_block]
    if w is None:
        return block.mean(0)
    x = (block + w.pos.double()).flatten()
    hidden = torch.nn.functional.silu(x @ w.w1.double() + w.b1.double())
    return hidden @ w.w2.double() + w.b2.double()


@pytest.mark.parametrize("phi", ["avg", "mlp"])
@pytest.mark.parametrize("l, d", [(4, 2), (4, 4), (6, 3)])
def test_emission_writes_the_completed_block_and_nothing_else(phi, l, d, monkeypatch):
    monkeypatch.setattr(decode_emission, "_hidden_tile", lambda hidden: 16)  # several hidden tiles and chunks
    cfg = NSAConfig(cmp_block=l, cmp_stride=d, sel_block=max(l, d) * 2, n_sel=2, n_init=1, n_local=1, window=4,
                    n_heads=2, n_kv_heads=2, head_dim_qk=16, head_dim_v=12, phi=phi)
    g = torch.Generator().manual_seed(l * 10 + d)
    B, H, T = 6, cfg.n_kv_heads, 24
    # keys before the step, and whether the row gets a key: completing a block, mid-block, too short, padding
    lengths = torch.tensor([l - 1, l - 1 + d, l, l - 2, l - 1 + 2 * d, l - 1 + d])
    n_new = torch.tensor([1, 1, 1, 1, 1, 0])
    phi_w = PhiWeights.init(cfg, 40, generator=g, dtype=torch.float32) if phi == "mlp" else None
    ring = l  # the cache's raw ring: R = l >= l - 1
    stores = []
    for dim, w in ((cfg.head_dim_qk, phi_w.k if phi_w else None), (cfg.head_dim_v, phi_w.v if phi_w else None)):
        keys = torch.randn(B, T, H, dim, generator=g)
        raw = torch.full((B, H, ring + 1, dim), float("nan"))
        for b in range(B):
            for t in range(max(0, int(lengths[b]) - ring), int(lengths[b])):
                raw[b, :, t % ring] = keys[b, t]
        new = torch.stack([keys[b, int(lengths[b])] for b in range(B)])[:, None].contiguous()  # [B, 1, H, D]
        n_blocks = (T - l) // d + 1
        store = torch.full((B, H, n_blocks + 1, dim), UNTOUCHED)
        stores.append((keys, raw, new, store, w))
    (keys_k, raw_k, new_k, store_k, w_k), (keys_v, raw_v, new_v, store_v, w_v) = stores
    emit_step_block(lengths, n_new, new_k, new_v, (raw_k, raw_v), (store_k, store_v), l, d, phi_w)

    for keys, _, _, store, w in stores:
        for b in range(B):
            L = int(lengths[b])
            completes = bool(n_new[b]) and L + 1 >= l and (L + 1 - l) % d == 0
            for h in range(H):
                if completes:
                    i = (L + 1 - l) // d
                    want = eq7_block(keys[b, :, h].double(), i, cfg, w)
                    assert torch.allclose(store[b, h, i].double(), want, atol=1e-5, rtol=1e-5), (b, h, i)
                    others = torch.cat([store[b, h, :i], store[b, h, i + 1:]])
                else:
                    others = store[b, h]
                assert bool((others == UNTOUCHED).all()), f"row {b} head {h}: a slot other than its block written"


def test_emission_refuses_a_short_ring():
    cfg_l, cfg_d = 4, 2
    z = torch.zeros(1, 1, 1, 16)
    with pytest.raises(ValueError, match="raw ring holds 2 keys, fewer than l - 1 = 3"):
        emit_step_block(torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), z, z,
                        (torch.zeros(1, 1, 3, 16), torch.zeros(1, 1, 3, 16)),
                        (torch.zeros(1, 1, 5, 16), torch.zeros(1, 1, 5, 16)), cfg_l, cfg_d)
