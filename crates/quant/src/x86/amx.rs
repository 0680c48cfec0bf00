//! AMX (Advanced Matrix Extensions, `TDPBSUD`) for Q4_K prompt products, where the CPU has AMX
//! and the OS grants a process its tile state (Linux: `arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`, asked once; without the grant the first tile instruction would fault).
//!
//! One tile product covers sixteen tokens, sixteen weight rows and one pair of Q4_K sub-blocks
//! (64 elements): the A tile is the tokens' 64 Q8_K activation bytes of the pair, read in place
//! (signed), the B tile the rows' 64 weights in the VNNI layout (4-byte step `k` of every row
//! in line `k`), unsigned. The sub-block scales (6 bits) are folded into the weights in two
//! halves, `sc = 8·hi + lo` with `hi, lo < 8`, so each weight times its half still fits a byte
//! (at most 15·7): two products `C_lo = A·B_lo` and `C_hi = A·B_hi` give the exact integer
//! `Σ sc·q·a = 8·C_hi + C_lo` of every (token, row) of the pair. From there the steps are
//! [`super::avx512::q4k_rows16_tokens`]'s, in the same order, one row per lane (the mins by one
//! `vpmaddwd`, the float steps per pair of sub-blocks): every output is bit for bit
//! `repack_order`'s portable definition (tested there).
//!
//! `EMBER_CPU_AMX=off` turns AMX off (the AVX-512 VNNI kernel runs instead).

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use crate::blocks::{q4_k, q8_k};

use super::avx512::{Rows16Scales, ROWS};

/// Tokens one tile product takes (the tile's rows).
pub const TOKENS: usize = 16;

/// Whether AMX tiles can be used: the CPU has AMX-TILE and AMX-INT8, the OS granted the tile
/// state, AVX-512 VNNI is there for the steps around the tiles, and `EMBER_CPU_AMX` is not
/// `off`. Asked once per process.
pub fn usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| {
        if std::env::var("EMBER_CPU_AMX").is_ok_and(|v| v.eq_ignore_ascii_case("off")) {
            return false;
        }
        crate::simd::level() == crate::simd::Level::Avx512Vnni
            && cpu_has_amx_int8()
            && os_grants_tiles()
    })
}

fn cpu_has_amx_int8() -> bool {
    // CPUID exists on every x86-64 CPU; leaf 7 is asked only when the maximum leaf reaches it.
    if __cpuid(0).eax < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    // EDX bit 24: AMX-TILE, bit 25: AMX-INT8.
    edx & (1 << 24) != 0 && edx & (1 << 25) != 0
}

#[cfg(target_os = "linux")]
fn os_grants_tiles() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_ulong = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_ulong = 18;
    // SAFETY: a plain system call with integer arguments; on kernels without it, it fails.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn os_grants_tiles() -> bool {
    false
}

/// The tile configuration: palette 1, tiles 0-7 of 16 rows of 64 bytes (C_lo, C_hi, A of even
/// blocks; B_lo, B_hi; C_lo, C_hi, A of odd blocks).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    const fn new() -> TileConfig {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut t = 0;
        while t < 8 {
            c[16 + 2 * t] = 64; // bytes per row
            c[48 + t] = 16; // rows
            t += 1;
        }
        TileConfig(c)
    }
}

static CONFIG: TileConfig = TileConfig::new();

/// Holds this thread's tile configuration while alive; releases the tiles when dropped (also
/// when a panic unwinds through it).
pub struct Tiles(());

impl Tiles {
    /// Configures this thread's tiles.
    ///
    /// # Safety
    /// [`usable`] must have returned true.
    pub unsafe fn configure() -> Tiles {
        // SAFETY: the caller checked AMX and the OS grant; the configuration is a valid
        // palette-1 layout, 64-byte aligned.
        unsafe { asm!("ldtilecfg [{0}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly)) };
        Tiles(())
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: the tiles were configured by `configure`.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// Tokens one call of [`q4k_rows16_tokens_amx`] takes at most: four tile blocks, whose
/// accumulators stay in the caller's scratch while each pair's weight tiles are loaded once.
pub const CALL_TOKENS: usize = 4 * TOKENS;

/// The scratch of [`q4k_rows16_tokens_amx`], kept by the caller from call to call: the
/// per-token accumulators, one pair's weight tiles and two blocks' tile results.
#[repr(C, align(64))]
pub struct AmxScratch {
    acc: [__m512; CALL_TOKENS],
    acc_min: [__m512; CALL_TOKENS],
    weights: [u8; 2048],
    c: [[[i32; 512]; 4]; 4],
    /// The last block's tokens when fewer than [`TOKENS`] remain, padded with zero rows (a tile
    /// always reads 16).
    padded: Vec<u8>,
}

impl Default for AmxScratch {
    fn default() -> Self {
        AmxScratch {
            // SAFETY: all-zero bits are valid vectors (zeros).
            acc: unsafe { std::mem::zeroed() },
            // SAFETY: as above.
            acc_min: unsafe { std::mem::zeroed() },
            weights: [0; 2048],
            c: [[[0; 512]; 4]; 4],
            padded: Vec::new(),
        }
    }
}

/// Builds one pair's weight tiles: `B_lo` then `B_hi`, 16 lines of 64 bytes each; line `8h + k`
/// holds, in lane `r`, the four weights of row `r` at 4-byte step `k` of sub-block `2p + h`,
/// times the low or the high 3 bits of their scale.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn pair_tiles(
    rows: &[u8],
    offsets: __m512i,
    base: usize,
    scales: [__m512i; 2],
    out: &mut [u8; 2048],
) {
    let low = _mm512_set1_epi8(0x0F);
    // A lane's scale as both words of the lane (each weight byte pair of a word takes it).
    let words = |s: __m512i| _mm512_or_si512(s, _mm512_slli_epi32::<16>(s));
    for k in 0..8 {
        // SAFETY: every lane reads 4 bytes at `r·row_bytes + base + 4k`, inside row r's
        // super-block of the 16 rows (checked by the caller).
        let q =
            unsafe { _mm512_i32gather_epi32::<1>(offsets, rows[base + 4 * k..].as_ptr().cast()) };
        for (h, sc) in scales.iter().enumerate() {
            let (lo, hi) = (
                words(_mm512_and_si512(*sc, _mm512_set1_epi32(7))),
                words(_mm512_srli_epi32::<3>(*sc)),
            );
            let q = if h == 0 { q } else { _mm512_srli_epi16::<4>(q) };
            let q = _mm512_and_si512(q, low);
            // Nibble times a 3-bit half scale: at most 105, no carry into the word's other byte.
            let line = 8 * h + k;
            // SAFETY: 64 writable bytes at each of the two lines.
            unsafe {
                _mm512_storeu_si512(
                    out[64 * line..].as_mut_ptr().cast(),
                    _mm512_mullo_epi16(q, lo),
                );
                _mm512_storeu_si512(
                    out[1024 + 64 * line..].as_mut_ptr().cast(),
                    _mm512_mullo_epi16(q, hi),
                );
            }
        }
    }
}

/// The outputs of 16 consecutive Q4_K rows (`rows`, contiguous, `row_bytes` each, their
/// [`Rows16Scales`] `meta`) for up to [`CALL_TOKENS`] activation rows (`acts`, Q8_K,
/// `act_bytes` apart, `n_tokens` of them): `out[t][r]`, with the gemm's float steps (per pair of
/// sub-blocks).
///
/// Per pair, the weight tiles are loaded once for every block of 16 tokens; blocks alternate
/// between two sets of A and C tiles, so one block's tile products need not wait for the
/// previous block's results to be read (tile registers are not renamed).
///
/// # Safety
/// [`usable`] must have returned true and this thread's tiles must be configured
/// ([`Tiles::configure`]).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn q4k_rows16_tokens_amx(
    rows: &[u8],
    row_bytes: usize,
    meta: &Rows16Scales,
    acts: &[u8],
    act_bytes: usize,
    n_tokens: usize,
    scratch: &mut AmxScratch,
    out: &mut [[f32; ROWS]],
) {
    let nb = row_bytes / q4_k::SIZE;
    assert!(n_tokens <= CALL_TOKENS && out.len() >= n_tokens);
    assert!(rows.len() >= ROWS * row_bytes && ROWS * row_bytes <= i32::MAX as usize);
    assert!(n_tokens == 0 || acts.len() >= (n_tokens - 1) * act_bytes + nb * q8_k::SIZE);
    let AmxScratch {
        acc,
        acc_min,
        weights,
        c,
        padded,
    } = scratch;
    // Tiles read 16 lines of the activations per block: short reads go to a padded copy.
    let blocks = n_tokens.div_ceil(TOKENS);
    let acts = if acts.len() >= blocks * TOKENS * act_bytes {
        acts
    } else {
        padded.clear();
        padded.extend_from_slice(&acts[..(n_tokens.max(1) - 1) * act_bytes + nb * q8_k::SIZE]);
        padded.resize(blocks * TOKENS * act_bytes, 0);
        &padded[..]
    };
    for t in 0..n_tokens {
        acc[t] = _mm512_setzero_ps();
        acc_min[t] = _mm512_setzero_ps();
    }
    let offsets = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(row_bytes as i32),
    );
    for b in 0..nb {
        // The tile products of the super-block's four pairs first, their results read after
        // (measured as fast as reading each pair's results right after its products, within
        // this machine's noise; kept for the one pass over each token's accumulators).
        for p in 0..4 {
            let base = b * q4_k::SIZE + q4_k::QS + 32 * p;
            pair_tiles(
                rows,
                offsets,
                base,
                [meta.scale(b, 2 * p), meta.scale(b, 2 * p + 1)],
                weights,
            );
            // SAFETY: the caller configured the tiles (8 tiles of 16 x 64 bytes); B_lo and
            // B_hi read 1024 bytes each of `weights`.
            unsafe {
                asm!(
                    "tileloadd tmm3, [{w} + {stride}*1]",
                    "tileloadd tmm4, [{whi} + {stride}*1]",
                    w = in(reg) weights.as_ptr(),
                    whi = in(reg) weights.as_ptr().add(1024),
                    stride = in(reg) 64usize,
                    options(nostack, readonly),
                );
            }
            for j in 0..blocks {
                let a =
                    acts[j * TOKENS * act_bytes + b * q8_k::SIZE + q8_k::QS + 64 * p..].as_ptr();
                let cj = &mut c[p][j];
                // SAFETY: A reads 16 lines of 64 bytes `act_bytes` apart, inside `acts` (whole
                // blocks of 16 rows, the pair's bytes inside each); the results are stored into
                // 1024 bytes each of `cj`.
                unsafe {
                    if j % 2 == 0 {
                        asm!(
                            "tilezero tmm0",
                            "tilezero tmm1",
                            "tileloadd tmm2, [{a} + {astride}*1]",
                            "tdpbsud tmm0, tmm2, tmm3",
                            "tdpbsud tmm1, tmm2, tmm4",
                            "tilestored [{clo} + {stride}*1], tmm0",
                            "tilestored [{chi} + {stride}*1], tmm1",
                            a = in(reg) a,
                            astride = in(reg) act_bytes,
                            stride = in(reg) 64usize,
                            clo = in(reg) cj.as_mut_ptr(),
                            chi = in(reg) cj.as_mut_ptr().add(256),
                            options(nostack),
                        );
                    } else {
                        asm!(
                            "tilezero tmm5",
                            "tilezero tmm6",
                            "tileloadd tmm7, [{a} + {astride}*1]",
                            "tdpbsud tmm5, tmm7, tmm3",
                            "tdpbsud tmm6, tmm7, tmm4",
                            "tilestored [{clo} + {stride}*1], tmm5",
                            "tilestored [{chi} + {stride}*1], tmm6",
                            a = in(reg) a,
                            astride = in(reg) act_bytes,
                            stride = in(reg) 64usize,
                            clo = in(reg) cj.as_mut_ptr(),
                            chi = in(reg) cj.as_mut_ptr().add(256),
                            options(nostack),
                        );
                    }
                }
            }
        }
        let (d, dmin) = meta.factors(b);
        for t in 0..n_tokens {
            let (j, l) = (t / TOKENS, t % TOKENS);
            let y = &acts[t * act_bytes + b * q8_k::SIZE..][..q8_k::SIZE];
            let d8 = _mm512_set1_ps(f32::from_le_bytes([y[0], y[1], y[2], y[3]]));
            let scale = _mm512_mul_ps(d, d8);
            let scale_min = _mm512_mul_ps(dmin, d8);
            let bsum =
                |k: usize| i16::from_le_bytes([y[q8_k::BSUMS + 2 * k], y[q8_k::BSUMS + 2 * k + 1]]);
            for (p, cp) in c.iter().enumerate() {
                let cj = &cp[j];
                // SAFETY: 16 i32 per line of each result; unaligned loads.
                let (lo, hi) = unsafe {
                    (
                        _mm512_loadu_si512(cj[16 * l..].as_ptr().cast()),
                        _mm512_loadu_si512(cj[256 + 16 * l..].as_ptr().cast()),
                    )
                };
                let i_p = _mm512_add_epi32(_mm512_slli_epi32::<3>(hi), lo);
                let b0 = bsum(4 * p).wrapping_add(bsum(4 * p + 1)) as u16 as i32;
                let b1 = bsum(4 * p + 2).wrapping_add(bsum(4 * p + 3)) as u16 as i32;
                let m_p =
                    _mm512_madd_epi16(meta.mins_pair(b, p), _mm512_set1_epi32(b0 | (b1 << 16)));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i_p), scale, acc[t]);
                acc_min[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m_p), scale_min, acc_min[t]);
            }
        }
    }
    for (o, (a, m)) in out
        .iter_mut()
        .zip(acc.iter().zip(acc_min.iter()))
        .take(n_tokens)
    {
        // SAFETY: 16 f32 = 64 writable bytes; unaligned store.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), _mm512_sub_ps(*a, *m)) };
    }
}
