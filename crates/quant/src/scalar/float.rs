//! The unquantized types F32, F16 and BF16: conversions and dot products.
//!
//! GGML dots F16 weights with F16 activations and BF16 with BF16, each product taken in f32;
//! the sums here use eight f32 lanes, the shape GGML's SIMD paths use, so the compiler can
//! vectorize them without a hand-written kernel.

use half::f16;

/// GGML's `GGML_FP32_TO_BF16`: round to nearest even, NaN kept quiet.
#[inline(always)]
pub fn f32_to_bf16_bits(v: f32) -> u16 {
    let u = v.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        ((u >> 16) | 64) as u16
    } else {
        ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
    }
}

#[inline(always)]
fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

#[inline(always)]
fn f16_bits_to_f32(b: u16) -> f32 {
    f16::from_bits(b).to_f32()
}

#[inline(always)]
fn u16_at(src: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([src[2 * i], src[2 * i + 1]])
}

pub fn quantize_f32(src: &[f32], dst: &mut [u8]) {
    for (v, d) in src.iter().zip(dst.chunks_exact_mut(4)) {
        d.copy_from_slice(&v.to_le_bytes());
    }
}

pub fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    for (v, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes());
    }
}

pub fn quantize_bf16(src: &[f32], dst: &mut [u8]) {
    for (v, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&f32_to_bf16_bits(*v).to_le_bytes());
    }
}

pub fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (s, d) in src.chunks_exact(4).zip(dst.iter_mut()) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
}

pub fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (s, d) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *d = f16_bits_to_f32(u16::from_le_bytes([s[0], s[1]]));
    }
}

pub fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (s, d) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *d = bf16_bits_to_f32(u16::from_le_bytes([s[0], s[1]]));
    }
}

/// Dot product with eight independent f32 lanes; `get` reads element `i` of each operand.
#[inline(always)]
fn lanes_dot(n: usize, get: impl Fn(usize) -> (f32, f32)) -> f32 {
    let mut acc = [0.0f32; 8];
    let full = n / 8 * 8;
    for base in (0..full).step_by(8) {
        for (l, a) in acc.iter_mut().enumerate() {
            let (x, y) = get(base + l);
            *a += x * y;
        }
    }
    let mut tail = 0.0f32;
    for i in full..n {
        let (x, y) = get(i);
        tail += x * y;
    }
    let pairs = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    (pairs[0] + pairs[2]) + (pairs[1] + pairs[3]) + tail
}

pub fn vec_dot_f32(w: &[u8], a: &[u8], n: usize) -> f32 {
    let rd = |s: &[u8], i: usize| {
        f32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]])
    };
    lanes_dot(n, |i| (rd(w, i), rd(a, i)))
}

pub fn vec_dot_f16(w: &[u8], a: &[u8], n: usize) -> f32 {
    lanes_dot(n, |i| {
        (f16_bits_to_f32(u16_at(w, i)), f16_bits_to_f32(u16_at(a, i)))
    })
}

pub fn vec_dot_bf16(w: &[u8], a: &[u8], n: usize) -> f32 {
    lanes_dot(n, |i| {
        (
            bf16_bits_to_f32(u16_at(w, i)),
            bf16_bits_to_f32(u16_at(a, i)),
        )
    })
}
