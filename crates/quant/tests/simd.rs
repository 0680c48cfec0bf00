//! Every SIMD dot product against the scalar reference, on random blocks.
//!
//! With unit scales (every d, dmin = 1, legacy mins and Q8_1 sums 0) a dot product is an exact
//! integer below 2^24 on every path, so the SIMD integer sums must equal the scalar ones
//! exactly. With random scales only the float accumulation order differs: at most one rounding
//! per block and per lane sum, i.e. (blocks + 8) · 2^-24 relative to Σ|terms|; the tests allow
//! 2^-17 of `abs_scale` (a bound on Σ|terms|), which covers rows up to 16k elements.

mod common;

use common::{abs_scale, dequant, random_acts, random_weights, Rng};
use ember_quant::simd::{available_levels, Level};
use ember_quant::{vec_dot_type, vec_dot_with, GgmlType};
use proptest::prelude::*;

const TYPES: [GgmlType; 11] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::F16,
];

fn check(ty: GgmlType, seed: u64, blocks: usize) -> Result<(), TestCaseError> {
    let n = blocks * ty.block_size().max(256);
    let at = vec_dot_type(ty);
    for unit in [true, false] {
        let mut rng = Rng::new(seed);
        let w = random_weights(&mut rng, ty, n, unit);
        let a = random_acts(&mut rng, at, n, unit);
        let reference = vec_dot_with(Level::Scalar, ty, &w, &a, n).unwrap();
        let scale = abs_scale(&dequant(ty, &w, n), &dequant(at, &a, n));
        for level in available_levels() {
            let got = vec_dot_with(level, ty, &w, &a, n).unwrap();
            if unit && ty != GgmlType::F16 {
                prop_assert_eq!(got, reference, "{} on {:?}, unit scales", ty, level);
            } else {
                let tol = scale / (1u64 << 17) as f64;
                prop_assert!(
                    ((got - reference) as f64).abs() <= tol,
                    "{} on {:?}: {} vs {} (tolerance {})",
                    ty,
                    level,
                    got,
                    reference,
                    tol
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn simd_vec_dot_matches_scalar(seed in any::<u64>(), blocks in 1usize..6, which in 0usize..TYPES.len()) {
        check(TYPES[which], seed, blocks)?;
    }
}

#[test]
fn every_type_on_every_level() {
    for ty in TYPES {
        for seed in 0..8 {
            check(ty, seed, 3).unwrap();
        }
    }
}

#[test]
fn detected_level_is_named() {
    let name = ember_quant::simd::detected();
    // AMX shows as a suffix of the AVX-512 level, where its tiles are in use.
    assert!(["avx512vnni", "avx512vnni+amx", "avx2", "neon", "scalar"].contains(&name));
    assert!(
        name.starts_with(ember_quant::simd::level().name()),
        "{name}"
    );
    assert!(available_levels().contains(&Level::Scalar));
}
