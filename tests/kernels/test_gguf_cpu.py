"""The CPU GGUF kernels (``lightwell.kernels.cpu.gguf_cpu``) on random blocks: dequantized
values bit-exact with gguf-py, products against float64 on those values; and the lean GGUF
reader against gguf-py's ``GGUFReader``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightwell.kernels.cpu import gguf_cpu
from lightwell.kernels.gguf_blocks import BLOCKS, gguf_dequantize_ref

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not gguf_cpu.available(), reason="no C compiler with OpenMP")

TYPES = [2, 3, 6, 7, 8]  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0


def random_blocks(rows: int, cols: int, qtype: int, seed: int = 0) -> torch.Tensor:
    """[rows, cols / 32 * block bytes] uint8: random bytes, fp16 scales (and Q4_1 / Q5_1
    minimums) of sane sizes, signs included."""
    values, nbytes = BLOCKS[qtype]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, cols // values, nbytes), dtype=torch.uint8, generator=g)
    d = (torch.rand(rows, cols // values, 1, generator=g) - 0.3) * 0.02
    raw[..., :2] = d.half().view(torch.uint8)
    if qtype in (3, 7):
        m = torch.randn(rows, cols // values, 1, generator=g) * 0.01
        raw[..., 2:4] = m.half().view(torch.uint8)
    return raw.reshape(rows, -1).contiguous()


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_bit_exact_with_gguf(qtype):
    w = random_blocks(37, 96, qtype)
    expected = torch.from_numpy(gguf.dequantize(w.numpy(), gguf.GGMLQuantizationType(qtype)))
    assert torch.equal(gguf_dequantize_ref(w, qtype), expected)
    ids = torch.tensor([5, 0, 36, 5, 17])
    assert torch.equal(gguf_cpu.gguf_dequant_rows(w, qtype, 96, ids), expected[ids])
    long = [i % 37 for i in range(70)]  # (past 64 ids: checked by torch reductions)
    for bad in ([3, 37], [-1, 2], long + [37], [-1] + long):
        with pytest.raises(IndexError, match=r"row ids must be in \[0, 37\)"):
            gguf_cpu.gguf_dequant_rows(w, qtype, 96, torch.tensor(bad))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 6])
def test_mm_matches_float64_on_dequantized_weights(qtype, rows):
    torch.set_num_threads(2)
    w = random_blocks(70, 160, qtype, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    expected = x.double() @ gguf_dequantize_ref(w, qtype).double().T
    out = gguf_cpu.gguf_mm(x, w, qtype)
    scale = expected.abs().max().item()
    assert (out.double() - expected).abs().max().item() < 1e-5 * scale
    # into columns of a wider output (a fused layer's shard)
    wide = torch.full((rows, 100), float("nan"))
    gguf_cpu.gguf_mm(x, w, qtype, wide[:, 20:90])
    assert torch.equal(wide[:, 20:90], out)
    assert wide[:, :20].isnan().all() and wide[:, 90:].isnan().all()


def test_mm_refuses_a_row_size_that_does_not_fit():
    w = random_blocks(4, 64, 3)
    with pytest.raises(ValueError, match="bytes a row"):
        gguf_cpu.gguf_mm(torch.randn(1, 96), w, 3)


def test_lean_reader_matches_gguf_reader(tmp_path):
    from lightwell.models.gguf_file import GGUFFile

    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_rope_freq_base(10000.0)
    w.add_token_list(["a", "bé", "<s>"])
    w.add_token_scores([0.5, -1.0, 2.0])
    w.add_bos_token_id(2)
    w.add_tensor("x.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    blocks = random_blocks(3, 64, 8).numpy()
    w.add_tensor("y.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref, ours = gguf.GGUFReader(path), GGUFFile(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert keys == list(ours.fields)
    for k in keys:
        assert ours.fields[k].contents() == ref.fields[k].contents(), k
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 3
    for a, b in zip(ref.tensors, ours.tensors, strict=True):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, list(b.shape))
        assert np.array_equal(a.data, b.data) and a.data.dtype == b.data.dtype
        assert np.array_equal(b.read(), b.data)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_mm_with_int8_activations_matches_its_reference(qtype, rows):
    torch.set_num_threads(2)
    w = random_blocks(70, 160, qtype, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0  # an all-zero block: scale 0, no NaN
    q = gguf_cpu.quantize_q8_ref(x)
    step = x.reshape(rows, -1, 32).abs().amax(-1, keepdim=True) / 127  # [rows, 5, 1]
    assert ((q - x).reshape(rows, -1, 32).abs() <= step / 2 + 1e-7).all()
    expected = q.double() @ gguf_dequantize_ref(w, qtype).double().T
    out = gguf_cpu.gguf_mm(x, w, qtype, int8_act=True)
    scale = expected.abs().max().item()
    assert (out.double() - expected).abs().max().item() < 2e-6 * scale
    exact = x.double() @ gguf_dequantize_ref(w, qtype).double().T
    assert (out.double() - exact).abs().max().item() > 1e-4 * scale  # really rounded


def test_each_instruction_set_matches_the_reference(gguf_isa_lib, monkeypatch):
    """Every type the kernels read, through the AVX2 and the portable builds: dequantized rows
    bit-exact, products (1 and 3 rows of x; int8 activations for blocks of 32) as above."""
    _, lib = gguf_isa_lib
    monkeypatch.setattr(gguf_cpu, "_lib", lambda: lib)
    torch.set_num_threads(2)
    from tests.kernels.gguf_random import random_blocks as kq_blocks

    for qtype in sorted(gguf_cpu.SUPPORTED):
        k = 512 if qtype in gguf_cpu.KQUANT else 160
        w = random_blocks(37, k, qtype, seed=qtype) if qtype in TYPES else kq_blocks(37, k, qtype)
        ref = gguf_dequantize_ref(w, qtype)
        ids = torch.tensor([5, 0, 36])
        assert torch.equal(gguf_cpu.gguf_dequant_rows(w, qtype, k, ids), ref[ids]), qtype
        for rows in (1, 3):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            expected = x.double() @ ref.double().T
            scale = expected.abs().max().item()
            out = gguf_cpu.gguf_mm(x, w, qtype)
            assert (out.double() - expected).abs().max().item() < 1e-5 * scale, (qtype, rows)
            if qtype in TYPES:
                q8 = gguf_cpu.quantize_q8_ref(x).double() @ ref.double().T
                out = gguf_cpu.gguf_mm(x, w, qtype, int8_act=True)
                assert (out.double() - q8).abs().max().item() < 2e-6 * scale, (qtype, rows)
