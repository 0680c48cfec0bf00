//! Byte layouts of GGML's quantized blocks, exactly as `ggml-common.h` lays them out.
//!
//! Blocks are read from byte slices at fixed offsets instead of being cast to `#[repr(C)]`
//! structs: tensors in a memory-mapped GGUF file are only as aligned as their block size allows
//! (a 20-byte `block_q4_1` row can start at any even address), and byte access is free of
//! alignment and endianness questions. Every multi-byte field is little-endian, as GGUF is.

use half::{bf16, f16};

/// Elements in a block of the legacy formats (`QK4_0` .. `QK8_1`).
pub const QK: usize = 32;
/// Elements in a K-quant super-block (`QK_K`).
pub const QK_K: usize = 256;
/// Number of 6-bit scale/min bytes in Q3_K/Q4_K/Q5_K blocks (`K_SCALE_SIZE`).
pub const K_SCALE_SIZE: usize = 12;

/// `block_q4_0`: `f16 d; u8 qs[16]` (element j in the low nibble of qs[j], j+16 in the high one).
pub mod q4_0 {
    pub const SIZE: usize = 18;
    pub const D: usize = 0;
    pub const QS: usize = 2;
}

/// `block_q4_1`: `f16 d; f16 m; u8 qs[16]`.
pub mod q4_1 {
    pub const SIZE: usize = 20;
    pub const D: usize = 0;
    pub const M: usize = 2;
    pub const QS: usize = 4;
}

/// `block_q5_0`: `f16 d; u8 qh[4]; u8 qs[16]` (qh bit j is the fifth bit of element j).
pub mod q5_0 {
    pub const SIZE: usize = 22;
    pub const D: usize = 0;
    pub const QH: usize = 2;
    pub const QS: usize = 6;
}

/// `block_q5_1`: `f16 d; f16 m; u8 qh[4]; u8 qs[16]`.
pub mod q5_1 {
    pub const SIZE: usize = 24;
    pub const D: usize = 0;
    pub const M: usize = 2;
    pub const QH: usize = 4;
    pub const QS: usize = 8;
}

/// `block_q8_0`: `f16 d; i8 qs[32]`.
pub mod q8_0 {
    pub const SIZE: usize = 34;
    pub const D: usize = 0;
    pub const QS: usize = 2;
}

/// `block_q8_1`: `f16 d; f16 s; i8 qs[32]`, with `s = d * sum(qs)` rounded to f16.
pub mod q8_1 {
    pub const SIZE: usize = 36;
    pub const D: usize = 0;
    pub const S: usize = 2;
    pub const QS: usize = 4;
}

/// `block_q2_K`: `u8 scales[16]` (low nibble scale, high nibble min); `u8 qs[64]`; `f16 d; f16 dmin`.
pub mod q2_k {
    pub const SIZE: usize = 84;
    pub const SCALES: usize = 0;
    pub const QS: usize = 16;
    pub const D: usize = 80;
    pub const DMIN: usize = 82;
}

/// `block_q3_K`: `u8 hmask[32]; u8 qs[64]; u8 scales[12]` (16 packed 6-bit scales); `f16 d`.
pub mod q3_k {
    pub const SIZE: usize = 110;
    pub const HMASK: usize = 0;
    pub const QS: usize = 32;
    pub const SCALES: usize = 96;
    pub const D: usize = 108;
}

/// `block_q4_K`: `f16 d; f16 dmin; u8 scales[12]` (8 scales and 8 mins of 6 bits); `u8 qs[128]`.
pub mod q4_k {
    pub const SIZE: usize = 144;
    pub const D: usize = 0;
    pub const DMIN: usize = 2;
    pub const SCALES: usize = 4;
    pub const QS: usize = 16;
}

/// `block_q5_K`: `f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]`.
pub mod q5_k {
    pub const SIZE: usize = 176;
    pub const D: usize = 0;
    pub const DMIN: usize = 2;
    pub const SCALES: usize = 4;
    pub const QH: usize = 16;
    pub const QS: usize = 48;
}

/// `block_q6_K`: `u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d`.
pub mod q6_k {
    pub const SIZE: usize = 210;
    pub const QL: usize = 0;
    pub const QH: usize = 128;
    pub const SCALES: usize = 192;
    pub const D: usize = 208;
}

/// `block_q8_K`: `f32 d; i8 qs[256]; i16 bsums[16]` (sums of each 16 quants).
pub mod q8_k {
    pub const SIZE: usize = 292;
    pub const D: usize = 0;
    pub const QS: usize = 4;
    pub const BSUMS: usize = 260;
}

/// Reads a little-endian f16 at `offset` as f32.
#[inline(always)]
pub fn read_f16(block: &[u8], offset: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([block[offset], block[offset + 1]])).to_f32()
}

/// Writes `value` rounded to f16 (nearest, ties to even, as `GGML_FP32_TO_FP16`) at `offset`.
#[inline(always)]
pub fn write_f16(block: &mut [u8], offset: usize, value: f32) {
    block[offset..offset + 2].copy_from_slice(&f16::from_f32(value).to_bits().to_le_bytes());
}

/// Reads a little-endian bf16 at `offset` as f32.
#[inline(always)]
pub fn read_bf16(block: &[u8], offset: usize) -> f32 {
    bf16::from_bits(u16::from_le_bytes([block[offset], block[offset + 1]])).to_f32()
}

/// Reads a little-endian f32 at `offset`.
#[inline(always)]
pub fn read_f32(block: &[u8], offset: usize) -> f32 {
    f32::from_le_bytes([
        block[offset],
        block[offset + 1],
        block[offset + 2],
        block[offset + 3],
    ])
}

/// Reads a little-endian u32 at `offset`.
#[inline(always)]
pub fn read_u32(block: &[u8], offset: usize) -> u32 {
    u32::from_le_bytes([
        block[offset],
        block[offset + 1],
        block[offset + 2],
        block[offset + 3],
    ])
}

/// Reads bsums[i] of a Q8_K block.
#[inline(always)]
pub fn q8k_bsum(block: &[u8], i: usize) -> i16 {
    let o = q8_k::BSUMS + 2 * i;
    i16::from_le_bytes([block[o], block[o + 1]])
}

/// Scale `j` and min `j` (both 6 bits) of the packed 12-byte scales of Q4_K/Q5_K
/// (GGML's `get_scale_min_k4`).
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The 16 signed scales of a Q3_K block, unpacked from their 12-byte 6-bit packing.
#[inline(always)]
pub fn q3k_scales(scales: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 {
            scales[j] & 0xF
        } else {
            scales[j - 8] >> 4
        };
        let high = (scales[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = ((low | (high << 4)) as i8) - 32;
    }
    out
}

/// The 8 scales and 8 mins of a Q4_K/Q5_K block.
#[inline(always)]
pub fn k4_scales_mins(scales: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, scales);
        sc[j] = s;
        mn[j] = m;
    }
    (sc, mn)
}
