"""Q2_K, Q3_K and IQ4_NL quantizers for test files (the gguf package dequantizes these types but
cannot quantize them): plain round-to-nearest per group of 16, packed in ggml's block layouts. They only
need to give blocks whose dequantization is close to the input; the files' readers are checked
against gguf's dequantization of whatever blocks they hold."""

from __future__ import annotations

import numpy as np

QK = 256  # values per super-block


def _f16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 -> (the float16 bytes [n, 2], the float16 values read back as float32 [n, 1])."""
    half = values.astype(np.float16)
    return half.view(np.uint8).reshape(-1, 2), half.astype(np.float32).reshape(-1, 1)


def _two_bit_runs(q: np.ndarray) -> np.ndarray:
    """[n, 256] values of 0..3 -> [n, 64] bytes: each half of 128 is four runs of 32 packed into the
    bit pairs 0-1, 2-3, 4-5, 6-7 of its 32 bytes."""
    runs = q.reshape(-1, 2, 4, 32).astype(np.uint8) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return np.bitwise_or.reduce(runs, axis=2).reshape(-1, 64)


def _blocks(x: np.ndarray) -> np.ndarray:
    assert x.shape[-1] % QK == 0, f"rows of {x.shape[-1]} values are not whole super-blocks"
    return x.astype(np.float32).reshape(-1, QK)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """x [..., k] -> [..., k / 256 * 84] bytes: per 16 values w = d * sc * q - dmin * m, q in 0..3."""
    v = _blocks(x)
    groups = v.reshape(-1, 16, 16)
    mins = np.maximum(-groups.min(axis=2), 0.0)                         # [n, 16], subtracted
    scales = (groups.max(axis=2) + mins) / 3.0
    d_bytes, d = _f16(scales.max(axis=1) / 15.0)
    dmin_bytes, dmin = _f16(mins.max(axis=1) / 15.0)
    sc = np.clip(np.round(scales / np.where(d > 0, d, 1.0)), 0, 15)
    m = np.clip(np.round(mins / np.where(dmin > 0, dmin, 1.0)), 0, 15)
    step = (d * sc)[:, :, None]
    q = np.clip(np.round((groups + (dmin * m)[:, :, None]) / np.where(step > 0, step, 1.0)), 0, 3)
    packed = (sc.astype(np.uint8) | (m.astype(np.uint8) << 4))
    out = np.concatenate([packed, _two_bit_runs(q.reshape(-1, QK)), d_bytes, dmin_bytes], axis=1)
    return out.reshape(*x.shape[:-1], -1)


def _q3_k_scale_bytes(sc: np.ndarray) -> np.ndarray:
    """[n, 16] six-bit scales (stored + 32) -> [n, 12]: low nibbles into bytes 0-7 (scales 0-7 low,
    8-15 high), top bit pairs into bytes 8-11 (scale j at byte 8 + j % 4, bits 2 * (j // 4))."""
    low = (sc[:, 0:8] & 0x0F) | ((sc[:, 8:16] & 0x0F) << 4)
    high = (sc >> 4).reshape(-1, 4, 4) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
    return np.concatenate([low, np.bitwise_or.reduce(high, axis=1)], axis=1).astype(np.uint8)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """x [..., k] -> [..., k / 256 * 110] bytes: per 16 values w = d * s * q, s in -32..31, q in -4..3."""
    v = _blocks(x)
    groups = v.reshape(-1, 16, 16)
    at = np.abs(groups).argmax(axis=2)[:, :, None]
    scales = -np.take_along_axis(groups, at, axis=2)[:, :, 0] / 4.0   # the largest value lands on -4
    d_bytes, d = _f16(np.abs(scales).max(axis=1) / 32.0)
    s = np.clip(np.round(scales / np.where(d > 0, d, 1.0)), -32, 31)
    step = (d * s)[:, :, None]
    q = np.clip(np.round(groups / np.where(step != 0, step, 1.0)), -4, 3).astype(np.int64) + 4   # 0..7
    q = q.reshape(-1, QK)
    high = (q >> 2).reshape(-1, 8, 32).astype(np.uint8) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    hmask = np.bitwise_or.reduce(high, axis=1)                           # bit j of byte l: run j's value l
    out = np.concatenate([hmask, _two_bit_runs(q & 3), _q3_k_scale_bytes((s + 32).astype(np.uint8)), d_bytes],
                         axis=1)
    return out.reshape(*x.shape[:-1], -1)


IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """[..., k] float32 -> IQ4_NL blocks [..., k / 32 * 18]: per 32 values an fp16 scale d that puts
    the largest magnitude on -127, each value the nearest of the sixteen d * IQ4_NL_VALUES, the
    indices in Q4_0's nibble order (values j and j + 16 in byte j)."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    at = np.abs(blocks).argmax(axis=1)[:, None]
    d_bytes, d = _f16(-np.take_along_axis(blocks, at, axis=1)[:, 0] / 127.0)
    scaled = blocks / np.where(d != 0, d, 1.0)
    index = np.abs(scaled[:, :, None] - IQ4_NL_VALUES).argmin(axis=2).astype(np.uint8)
    out = np.concatenate([d_bytes, index[:, :16] | (index[:, 16:] << 4)], axis=1)
    return out.reshape(*x.shape[:-1], -1)


QUANTIZERS = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "IQ4_NL": quantize_iq4_nl}
