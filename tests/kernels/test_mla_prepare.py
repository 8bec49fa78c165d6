"""The kernels around MLA's decode attention (kernels/mla_prepare.py) vs the layer's torch ops:
RMSNorm + RoPE of the latent entry (and its store, padding slots skipped), the absorbed query
(q_nope @ W_UK, RoPE on q_pe) and the absorbed output (o @ W_UV^T: the tile kernel, and the
few-token kernel against it), both RoPE styles, token counts of one and of two tiles;
the entry and the query in one launch (``prepare_decode``) against the two. CPU under
TRITON_INTERPRET=1 (fp32/fp16), compiled on CUDA."""

from __future__ import annotations

import pytest
import torch

from lightwell.kernels.mla_output import absorb_output
from lightwell.kernels.mla_prepare import absorb_query, latent_entry, prepare_decode
from lightwell.layers.norm import RMSNorm
from lightwell.layers.rotary import RotaryEmbedding
from tests.kernels.interpreter import DEVICE

LATENT, ROPE, NOPE, VDIM, HEADS = 32, 8, 16, 24, 3
TOL = 1e-5 if DEVICE == "cpu" else 2e-2


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("tokens", [2, 3, 20])
def test_prepare_kernels_match_the_torch_ops(neox, tokens):
    gen = torch.Generator().manual_seed(tokens)
    rot = RotaryEmbedding(ROPE, ROPE, 64, 10000.0, neox)
    norm = RMSNorm(LATENT, 1e-6)
    norm.weight.data = torch.rand(LATENT, generator=gen) + 0.5
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    kv = torch.randn(tokens, LATENT + ROPE, generator=gen)
    q = torch.randn(tokens, HEADS * (NOPE + ROPE), generator=gen)
    w = torch.randn(HEADS * (NOPE + VDIM), LATENT, generator=gen) / 4
    o = torch.randn(tokens, HEADS, LATENT, generator=gen)
    # the layer's torch ops
    c, k_pe = kv.split([LATENT, ROPE], dim=-1)
    qh = q.view(tokens, HEADS, NOPE + ROPE)
    q_nope, q_pe = qh.split([NOPE, ROPE], dim=-1)
    q_pe, k_pe = rot(positions, q_pe.reshape(tokens, -1).clone(), k_pe.contiguous())
    want_entry = torch.cat([norm(c.contiguous()), k_pe], dim=-1)
    w_uk, w_uv = w.view(HEADS, NOPE + VDIM, LATENT).split([NOPE, VDIM], dim=1)
    q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
    want_q = torch.cat([q_lat, q_pe.view(tokens, HEADS, ROPE)], dim=-1)
    want_o = torch.einsum("thr,hvr->thv", o, w_uv).reshape(tokens, HEADS * VDIM)
    # the kernels
    dev = [t.to(DEVICE) for t in (positions, kv, q, w, o)]
    cache = torch.full((1, 8, 4, 1, LATENT + ROPE), 7.0, device=DEVICE)
    slots = torch.arange(tokens, device=DEVICE) * 3 % 32
    slots[1] = -1  # padding: not stored
    cs = rot.cos_sin_cache.to(DEVICE)
    entry = latent_entry(dev[0], dev[1], norm.weight.to(DEVICE), 1e-6, cs, neox, cache, slots)
    assert _rel(entry.cpu(), want_entry) < TOL
    flat = cache.view(-1, LATENT + ROPE).cpu()
    keep = (slots >= 0).cpu()
    assert torch.equal(flat[slots.cpu()[keep]], entry.cpu()[keep])
    assert (flat[3] == 7.0).all()  # token 1's slot untouched
    got_q = absorb_query(dev[0], dev[2], dev[3], (NOPE, ROPE, VDIM), cs, neox)
    assert got_q.shape == (tokens, HEADS, LATENT + ROPE) and _rel(got_q.cpu(), want_q) < TOL
    got_o = absorb_output(dev[4], dev[3], (NOPE, VDIM))
    assert got_o.shape == (tokens, HEADS * VDIM) and _rel(got_o.cpu(), want_o) < TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_absorb_output_few_token_kernel_matches_the_tile_kernel(dtype, monkeypatch):
    """One and two tokens through the few-token kernel (its W_UV slice in registers, products
    on the CUDA cores) give what the tile kernel gives; a latent of 40 padded to 64, 24 value
    dims in 16-wide chunks (the second masked)."""
    import lightwell.kernels.mla_output as mo

    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(HEADS * (NOPE + VDIM), 40, generator=gen) / 4).to(DEVICE, dtype)
    o = torch.randn(2, HEADS, 40, generator=gen).to(DEVICE, dtype)
    want = torch.einsum("thr,hvr->thv", o.float(), w.view(HEADS, NOPE + VDIM, 40)[:, NOPE:].float())
    for tokens in (1, 2):
        monkeypatch.setattr(mo, "FEW_TOKENS", 2)
        few = absorb_output(o[:tokens], w, (NOPE, VDIM))
        monkeypatch.setattr(mo, "FEW_TOKENS", 0)
        tile = absorb_output(o[:tokens], w, (NOPE, VDIM))
        assert few.shape == (tokens, HEADS * VDIM)
        assert _rel(few, want[:tokens].reshape(tokens, -1)) < (
            TOL if dtype == torch.float32 else 2e-3
        )
        assert _rel(few, tile) < (TOL if dtype == torch.float32 else 2e-3)


LONG_LATENT = 160  # two latent chunks of absorb_query (128 + a masked 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 70])
def test_prepare_decode_is_the_entry_and_query_launches_in_one(dtype, tokens):
    """``prepare_decode``: the cache rows ``latent_entry`` stores (padding slots untouched) and
    the queries ``absorb_query`` makes, bit for bit, from q and kv with strided rows (views of
    one fused projection's output), over one and two token tiles and two latent chunks."""
    latent = LONG_LATENT
    gen = torch.Generator().manual_seed(30 + tokens)
    rot = RotaryEmbedding(ROPE, ROPE, 64, 10000.0, False)
    weight = (torch.rand(latent, generator=gen) + 0.5).to(DEVICE, dtype)
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE)
    fused = torch.randn(tokens, HEADS * (NOPE + ROPE) + latent + ROPE, generator=gen)
    q, kv = fused.to(DEVICE, dtype).split([HEADS * (NOPE + ROPE), latent + ROPE], dim=-1)
    w = (torch.randn(HEADS * (NOPE + VDIM), latent, generator=gen) / 8).to(DEVICE, dtype)
    cs, dims = rot.cos_sin_cache.to(DEVICE), (NOPE, ROPE, VDIM)
    slots = (torch.arange(tokens) * 7 % 80).to(DEVICE)  # distinct (7 is prime to 80)
    slots[-1] = -1 if tokens > 1 else slots[-1]  # padding: not stored
    caches = [torch.full((1, 20, 4, 1, latent + ROPE), 7.0, device=DEVICE, dtype=dtype)
              for _ in range(2)]  # fmt: skip
    latent_entry(positions, kv, weight, 1e-6, cs, False, caches[0], slots)
    want = absorb_query(positions, q, w, dims, cs, False)
    got = prepare_decode(positions, q, kv, (weight, 1e-6), w, dims, (cs, False), caches[1], slots)
    assert torch.equal(got, want)
    assert torch.equal(caches[1], caches[0])
    assert (caches[1].view(-1, latent + ROPE)[slots[slots >= 0]] != 7.0).any()
    with pytest.raises(ValueError, match="does not fit the latent cache"):
        prepare_decode(positions, q, kv[:, 1:], (weight, 1e-6), w, dims, (cs, False),
                       caches[1], slots)  # fmt: skip


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_prepare_decode_quantizes_entries_into_an_8bit_cache(kv_dtype):
    """With an 8-bit cache ``prepare_decode`` and ``latent_entry`` store each entry quantized
    with one scale over its latent and RoPE parts: bit for bit quant/kv_cache.py's
    ``write_rows`` of the entries ``latent_entry`` returns (padding slots untouched)."""
    from lightwell.quant.kv_cache import write_rows

    latent, tokens, dtype = LONG_LATENT, 5, torch.float16
    gen = torch.Generator().manual_seed(40)
    rot = RotaryEmbedding(ROPE, ROPE, 64, 10000.0, False)
    weight = (torch.rand(latent, generator=gen) + 0.5).to(DEVICE, dtype)
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE)
    q = torch.randn(tokens, HEADS * (NOPE + ROPE), generator=gen).to(DEVICE, dtype)
    kv = (torch.randn(tokens, latent + ROPE, generator=gen) * 3).to(DEVICE, dtype)
    w = (torch.randn(HEADS * (NOPE + VDIM), latent, generator=gen) / 8).to(DEVICE, dtype)
    cs, dims = rot.cos_sin_cache.to(DEVICE), (NOPE, ROPE, VDIM)
    slots = torch.tensor([9, 0, 33, -1, 78], device=DEVICE)
    shape = (1, 20, 4, 1, latent + ROPE + 4)
    caches = [torch.zeros(shape, dtype=kv_dtype, device=DEVICE) for _ in range(3)]
    entries = latent_entry(positions, kv, weight, 1e-6, cs, False, caches[0], slots)
    prepare_decode(positions, q, kv, (weight, 1e-6), w, dims, (cs, False), caches[1], slots)
    keep = slots >= 0
    write_rows(caches[2][0], entries[keep][:, None, :], slots[keep])
    raw = [c.view(torch.uint8) for c in caches]
    assert torch.equal(raw[0], raw[2]) and torch.equal(raw[1], raw[2])
    assert raw[2].count_nonzero() > 0
