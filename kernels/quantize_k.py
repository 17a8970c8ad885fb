"""Quantizing float weights into Q4_K, round to nearest (numpy).

The `gguf` package reads every K-quant but writes none, so `--quantization
q4_k` needs a quantizer of its own. This one rounds to nearest at each of
Q4_K's two levels, as llama.cpp's reference quantizer does at heart (its
make_qkx2_quants then searches a little around that grid to lower the error;
not done here):

    a super-block of 256 weights = 8 sub-blocks of 32
    sub-block j:  w ~ (d * sc_j) * q - (dmin * m_j)        q in 0..15
    sc_j, m_j:    6-bit integers, the sub-block's step and offset in units
                  of the super-block's fp16 d and dmin

Bytes, as gguf.quants.dequantize reads them (144 per super-block):

    d (fp16) | dmin (fp16) | 12 bytes: the 8 sc and 8 m, 6 bits each | 128 bytes of q:
    byte l of 32-byte chunk c holds q[64c + l] (low nibble) and q[64c + 32 + l] (high)

The 6-bit pairs pack as llama.cpp's get_scale_min_k4 unpacks them: sc_j and
m_j of j < 4 in the low 6 bits of bytes j and j + 4; for j >= 4 their low 4
bits in byte j + 4 (sc low nibble, m high nibble) and their top 2 bits in the
top 2 bits of bytes j - 4 (sc) and j (m).
"""

from __future__ import annotations

import numpy as np

QK_K = 256
SUB = 32


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """[rows, cols] float32 (cols a multiple of 256) -> uint8 [rows, cols / 256 * 144]."""
    rows, cols = weight.shape
    if cols % QK_K:
        raise ValueError(f"Q4_K needs in_features divisible by {QK_K}, got {cols}")
    sub = weight.astype(np.float32).reshape(-1, QK_K // SUB, SUB)  # [blocks, 8, 32]
    low = np.minimum(sub.min(-1), 0.0)
    step = (sub.max(-1) - low) / 15  # the sub-block's grid, before its 6-bit rounding
    offset = -low  # >= 0: subtracted after scaling
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = (offset.max(-1) / 63).astype(np.float16)
    sc = _round_6bit(step, d)
    m = _round_6bit(offset, dmin)
    scale = d.astype(np.float32)[:, None] * sc  # what the reader will compute
    shift = dmin.astype(np.float32)[:, None] * m
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[..., None] > 0, np.rint((sub + shift[..., None]) / scale[..., None]), 0)
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, SUB)  # [blocks, chunk, half, l]
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                             _pack_scales(sc, m), qs], axis=1)
    return blocks.reshape(rows, -1)


def _round_6bit(values: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """values / unit rounded into 0..63 (0 where the unit is 0)."""
    unit = unit.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(unit > 0, values / unit, 0)
    return np.clip(np.rint(ratio), 0, 63).astype(np.uint8)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit (sc, m) pairs per block into its 12 scale bytes."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out
