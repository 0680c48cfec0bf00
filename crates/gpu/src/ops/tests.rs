//! Tests of the ops layer without a GPU: format sizes against ember-gguf, shape checks, and every
//! launch wrapper run on the host driver against a Rust twin of its kernel.
//!
//! Each twin decodes its arguments exactly as the kernel's C signature in `kernels/*.hip` declares
//! them (argument kinds are checked by `HostLaunch`), and does the work of the blocks its launch
//! configuration asks for, so a wrapper that passes arguments in the wrong order or launches too
//! few blocks fails here. The arithmetic of the real kernels is tested on the GPU by
//! kernels/tests/harness.cu and by the `ops_check` example.

use std::path::Path;

use half::f16;

use super::test_support::{host_fixture, Fixture};
use super::*;
use crate::host::{HostDriver, HostDriverConfig, HostLaunch};
use crate::pool::{PoolConfig, PoolKind};

#[test]
fn weight_format_names_round_trip() {
    for format in WeightFormat::ALL {
        assert_eq!(WeightFormat::from_name(format.name()), Some(format));
        assert_eq!(
            WeightFormat::from_name(&format.name().to_ascii_uppercase()),
            Some(format)
        );
        assert_eq!(
            WeightFormat::from_ggml_type_id(format.ggml_type_id()),
            Some(format)
        );
    }
    assert_eq!(WeightFormat::from_name("q4k"), Some(WeightFormat::Q4K));
    assert_eq!(WeightFormat::from_name("iq2_xxs"), None);
    assert_eq!(WeightFormat::from_ggml_type_id(16), None);
}

#[test]
fn weight_format_sizes_match_ggml() {
    for format in WeightFormat::ALL {
        let ty = ember_quant::GgmlType::from_u32(format.ggml_type_id()).unwrap();
        assert_eq!(
            ty.name().to_ascii_lowercase(),
            format.name().to_ascii_lowercase()
        );
        assert_eq!(format.block_values(), ty.block_size(), "{format}");
        assert_eq!(format.block_bytes(), ty.type_size(), "{format}");
        for cols in [32usize, 256, 4096, 14336, 100] {
            assert_eq!(
                format.row_bytes(cols).map(|b| b as u64),
                ty.row_bytes(cols as u64),
                "{format} with {cols} columns"
            );
        }
    }
}

#[test]
fn matrix_shapes_are_checked() {
    let error = DeviceMatrix::bytes_for(WeightFormat::Q4K, 4, 100).unwrap_err();
    assert_eq!(
        error.to_string(),
        "DeviceMatrix: expected a column count that is a multiple of 256 for q4_K, found 4x100"
    );
    assert_eq!(
        DeviceMatrix::bytes_for(WeightFormat::Q4_0, 3, 64).unwrap(),
        3 * 2 * 18
    );
}

/// A context on the host driver, with a code object file for every module (the host driver
/// "contains" every registered kernel) and Rust twins of the kernels registered.
fn fixture() -> Fixture {
    host_fixture(register_twins)
}

fn read_i32(launch: &HostLaunch<'_>, ptr: DevicePtr, n: usize) -> Result<Vec<i32>, String> {
    let mut bytes = vec![0u8; n * 4];
    launch.read(ptr, &mut bytes)?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Elements a grid-stride kernel covers with its launch.
fn stride_coverage(launch: &HostLaunch<'_>, n: u32) -> Result<usize, String> {
    let threads = launch.config().grid[0] as u64 * launch.config().block[0] as u64;
    if threads == 0 {
        return Err("empty launch".to_string());
    }
    // A grid-stride loop covers everything with any positive launch size.
    Ok(n as usize)
}

fn register_binary(driver: &HostDriver, name: &str, f: fn(f32, f32) -> f32) {
    driver.register_kernel(name, move |l| {
        let (out, a, b) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
        let n = stride_coverage(l, l.u32_arg(3)?)?;
        let (a, b) = (l.read_f32(a, n)?, l.read_f32(b, n)?);
        let values: Vec<f32> = a.iter().zip(&b).map(|(&x, &y)| f(x, y)).collect();
        l.write_f32(out, &values)
    });
}

fn gelu_ggml(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        let h = f16::from_f32(x).to_f32();
        let g = 0.5 * h * (1.0 + (0.797_884_6 * h * (1.0 + 0.044715 * h * h)).tanh());
        f16::from_f32(g).to_f32()
    }
}

fn register_twins(driver: &HostDriver) {
    // ember_add_f32(float* out, const float* a, const float* b, uint32_t n, uint32_t n_b)
    driver.register_kernel("ember_add_f32", |l| {
        let (out, a, b) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
        let n = stride_coverage(l, l.u32_arg(3)?)?;
        let n_b = l.u32_arg(4)? as usize;
        let (a, b) = (l.read_f32(a, n)?, l.read_f32(b, n_b)?);
        let values: Vec<f32> = (0..n).map(|i| a[i] + b[i % n_b]).collect();
        l.write_f32(out, &values)
    });
    // ember_mul_f32(float* out, const float* a, const float* b, uint32_t n, uint32_t n_b)
    driver.register_kernel("ember_mul_f32", |l| {
        let (out, a, b) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
        let n = stride_coverage(l, l.u32_arg(3)?)?;
        let n_b = l.u32_arg(4)? as usize;
        let (a, b) = (l.read_f32(a, n)?, l.read_f32(b, n_b)?);
        let values: Vec<f32> = (0..n).map(|i| a[i] * b[i % n_b]).collect();
        l.write_f32(out, &values)
    });
    // ember_scale_f32(float* out, const float* x, float scale, uint32_t n) and
    // ember_softcap_f32(float* out, const float* x, float cap, uint32_t n)
    for (name, f) in [
        (
            "ember_scale_f32",
            (|x: f32, s: f32| x * s) as fn(f32, f32) -> f32,
        ),
        ("ember_softcap_f32", |x: f32, cap: f32| {
            cap * (x / cap).tanh()
        }),
    ] {
        driver.register_kernel(name, move |l| {
            let (out, x, s) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.f32_arg(2)?);
            let n = stride_coverage(l, l.u32_arg(3)?)?;
            let values: Vec<f32> = l.read_f32(x, n)?.iter().map(|&v| f(v, s)).collect();
            l.write_f32(out, &values)
        });
    }
    // ember_silu_mul_f32 / ember_gelu_mul_f32(float* out, const float* gate, const float* up, uint32_t n)
    register_binary(driver, "ember_silu_mul_f32", |g, u| {
        g / (1.0 + (-g).exp()) * u
    });
    register_binary(driver, "ember_gelu_mul_f32", |g, u| gelu_ggml(g) * u);
    // ember_convert_f16_f32(ember_half* out, const float* x, uint32_t n)
    driver.register_kernel("ember_convert_f16_f32", |l| {
        let (out, x) = (l.ptr_arg(0)?, l.ptr_arg(1)?);
        let n = stride_coverage(l, l.u32_arg(2)?)?;
        let bytes: Vec<u8> = l
            .read_f32(x, n)?
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect();
        l.write(out, &bytes)
    });
    // ember_rms_norm_f32(float* out, const float* x, const float* weight, uint32_t n_cols, float eps);
    // one block per row.
    driver.register_kernel("ember_rms_norm_f32", |l| {
        let (out, x, weight) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
        let (n_cols, eps) = (l.u32_arg(3)? as usize, l.f32_arg(4)?);
        // A null weight: the bare normalisation.
        let weight = if weight == DevicePtr::NULL {
            None
        } else {
            Some(l.read_f32(weight, n_cols)?)
        };
        for row in 0..l.config().grid[0] as u64 {
            let offset = row * n_cols as u64 * 4;
            let values = l.read_f32(x.offset(offset), n_cols)?;
            let mean = values.iter().map(|v| v * v).sum::<f32>() / n_cols as f32;
            let inv = 1.0 / (mean + eps).sqrt();
            let normed: Vec<f32> = match &weight {
                Some(weight) => values
                    .iter()
                    .zip(weight)
                    .map(|(v, w)| v * inv * w)
                    .collect(),
                None => values.iter().map(|v| v * inv).collect(),
            };
            l.write_f32(out.offset(offset), &normed)?;
        }
        Ok(())
    });
    // ember_rms_norm_add_f32(float* dst, float* x, const float* weight, uint32_t n_cols, float
    // eps); one block per row.
    driver.register_kernel("ember_rms_norm_add_f32", |l| {
        let (dst, x, weight) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
        let (n_cols, eps) = (l.u32_arg(3)? as usize, l.f32_arg(4)?);
        let weight = l.read_f32(weight, n_cols)?;
        for row in 0..l.config().grid[0] as u64 {
            let offset = row * n_cols as u64 * 4;
            let values = l.read_f32(x.offset(offset), n_cols)?;
            let mean = values.iter().map(|v| v * v).sum::<f32>() / n_cols as f32;
            let inv = 1.0 / (mean + eps).sqrt();
            let normed: Vec<f32> = values
                .iter()
                .zip(&weight)
                .map(|(v, w)| v * inv * w)
                .collect();
            let sums: Vec<f32> = l
                .read_f32(dst.offset(offset), n_cols)?
                .iter()
                .zip(&normed)
                .map(|(d, v)| d + v)
                .collect();
            l.write_f32(x.offset(offset), &normed)?;
            l.write_f32(dst.offset(offset), &sums)?;
        }
        Ok(())
    });
    // ember_rms_norm_scale_mul_f32(float* out, const float* x, const float* weight, uint32_t
    // n_cols, float eps, float scale); one block per row, the products from the left.
    driver.register_kernel("ember_rms_norm_scale_mul_f32", |l| {
        let (out, x, weight) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
        let (n_cols, eps, scale) = (l.u32_arg(3)? as usize, l.f32_arg(4)?, l.f32_arg(5)?);
        let weight = l.read_f32(weight, n_cols)?;
        for row in 0..l.config().grid[0] as u64 {
            let offset = row * n_cols as u64 * 4;
            let values = l.read_f32(x.offset(offset), n_cols)?;
            let mean = values.iter().map(|v| v * v).sum::<f32>() / n_cols as f32;
            let inv = 1.0 / (mean + eps).sqrt();
            let out_values: Vec<f32> = values
                .iter()
                .zip(&weight)
                .map(|(v, w)| v * inv * scale * w)
                .collect();
            l.write_f32(out.offset(offset), &out_values)?;
        }
        Ok(())
    });
    // ember_gemma4_ffn_inputs_f32(float* x, float* proj, const float* post_attn, float* xn,
    // const float* ffn_norm, float* moe_in, const float* pre_norm, float* router_in, const float*
    // router_weight, uint32_t n_cols, float eps, float router_scale); one block per row, each
    // output as the twin of the kernel it replaces computes it.
    driver.register_kernel("ember_gemma4_ffn_inputs_f32", |l| {
        let (x, proj, post_attn) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
        let (xn, ffn_norm, moe_in) = (l.ptr_arg(3)?, l.ptr_arg(4)?, l.ptr_arg(5)?);
        let (pre_norm, router_in, router_weight) = (l.ptr_arg(6)?, l.ptr_arg(7)?, l.ptr_arg(8)?);
        let (n_cols, eps, scale) = (l.u32_arg(9)? as usize, l.f32_arg(10)?, l.f32_arg(11)?);
        let inv = |values: &[f32]| {
            let mean = values.iter().map(|v| v * v).sum::<f32>() / n_cols as f32;
            1.0 / (mean + eps).sqrt()
        };
        let [post_attn, ffn_norm, pre_norm, router_weight] =
            [post_attn, ffn_norm, pre_norm, router_weight].map(|w| l.read_f32(w, n_cols));
        let (post_attn, ffn_norm, pre_norm, router_weight) =
            (post_attn?, ffn_norm?, pre_norm?, router_weight?);
        for row in 0..l.config().grid[0] as u64 {
            let offset = row * n_cols as u64 * 4;
            let p = l.read_f32(proj.offset(offset), n_cols)?;
            let p_inv = inv(&p);
            let normed: Vec<f32> = p
                .iter()
                .zip(&post_attn)
                .map(|(v, w)| v * p_inv * w)
                .collect();
            let residual: Vec<f32> = l
                .read_f32(x.offset(offset), n_cols)?
                .iter()
                .zip(&normed)
                .map(|(a, b)| a + b)
                .collect();
            let x_inv = inv(&residual);
            let weighted = |w: &[f32], s: f32| -> Vec<f32> {
                residual
                    .iter()
                    .zip(w)
                    .map(|(v, w)| v * x_inv * s * w)
                    .collect()
            };
            l.write_f32(proj.offset(offset), &normed)?;
            l.write_f32(x.offset(offset), &residual)?;
            l.write_f32(xn.offset(offset), &weighted(&ffn_norm, 1.0))?;
            l.write_f32(moe_in.offset(offset), &weighted(&pre_norm, 1.0))?;
            l.write_f32(router_in.offset(offset), &weighted(&router_weight, scale))?;
        }
        Ok(())
    });
    // ember_add_rms_norm_f32(float* out, float* x, const float* proj, const float* weight,
    // uint32_t n_cols, float eps); one block per row.
    driver.register_kernel("ember_add_rms_norm_f32", |l| {
        let (out, x, proj, weight) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?, l.ptr_arg(3)?);
        let (n_cols, eps) = (l.u32_arg(4)? as usize, l.f32_arg(5)?);
        let weight = l.read_f32(weight, n_cols)?;
        for row in 0..l.config().grid[0] as u64 {
            let offset = row * n_cols as u64 * 4;
            let a = l.read_f32(x.offset(offset), n_cols)?;
            let b = l.read_f32(proj.offset(offset), n_cols)?;
            let sum: Vec<f32> = a.iter().zip(&b).map(|(a, b)| a + b).collect();
            l.write_f32(x.offset(offset), &sum)?;
            let mean = sum.iter().map(|v| v * v).sum::<f32>() / n_cols as f32;
            let inv = 1.0 / (mean + eps).sqrt();
            let normed: Vec<f32> = sum.iter().zip(&weight).map(|(v, w)| v * inv * w).collect();
            l.write_f32(out.offset(offset), &normed)?;
        }
        Ok(())
    });
    // ember_rope_{norm,neox}_f32(float* x, const int32_t* positions, const float* freq_factors,
    // uint32_t n_heads, uint32_t head_dim, uint32_t n_dims, float theta_scale, float freq_scale);
    // one block per (token, head).
    for (name, neox) in [
        ("ember_rope_norm_f32", false),
        ("ember_rope_neox_f32", true),
    ] {
        driver.register_kernel(name, move |l| {
            let (x, positions, factors) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
            let (n_heads, head_dim, n_dims) = (
                l.u32_arg(3)? as usize,
                l.u32_arg(4)? as usize,
                l.u32_arg(5)? as usize,
            );
            let (theta_scale, freq_scale) = (l.f32_arg(6)?, l.f32_arg(7)?);
            let n_blocks = l.config().grid[0] as usize;
            let positions = read_i32(l, positions, n_blocks / n_heads)?;
            let factors = if factors == DevicePtr::NULL {
                vec![1.0; n_dims / 2]
            } else {
                l.read_f32(factors, n_dims / 2)?
            };
            for block in 0..n_blocks {
                let head = x.offset((block * head_dim * 4) as u64);
                let mut v = l.read_f32(head, head_dim)?;
                let mut theta_base = positions[block / n_heads] as f32;
                for (i, factor) in factors.iter().enumerate() {
                    let theta = freq_scale * (theta_base / factor);
                    theta_base *= theta_scale;
                    let (ia, ib) = if neox {
                        (i, i + n_dims / 2)
                    } else {
                        (2 * i, 2 * i + 1)
                    };
                    let (a, b) = (v[ia], v[ib]);
                    v[ia] = a * theta.cos() - b * theta.sin();
                    v[ib] = a * theta.sin() + b * theta.cos();
                }
                l.write_f32(head, &v)?;
            }
            Ok(())
        });
    }
    // ember_rope_kv_store_{norm,neox}_f32(float* q, float* k, const float* v, const int32_t*
    // positions, const float* freq_factors, uint32_t n_tokens, uint32_t n_heads, uint32_t
    // n_kv_heads, uint32_t head_dim, uint32_t n_dims, float theta_scale, float freq_scale, const
    // uint64_t* k_blocks, const uint64_t* v_blocks, const int32_t* slots, uint32_t block_size,
    // const float* q_norm, const float* k_norm, float eps); one block per head, q heads first,
    // each normalised first (as ember_rms_norm_f32 above) when its weight is given, with
    // ember_rms_norm_f32's block size for head_dim.
    for (name, neox) in [
        ("ember_rope_kv_store_norm_f32", false),
        ("ember_rope_kv_store_neox_f32", true),
    ] {
        driver.register_kernel(name, move |l| {
            let (q, k, v) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
            let (positions, factors) = (l.ptr_arg(3)?, l.ptr_arg(4)?);
            let dims: Vec<usize> = (5..10)
                .map(|i| l.u32_arg(i).map(|v| v as usize))
                .collect::<Result<_, _>>()?;
            let (n_tokens, n_heads, n_kv_heads, head_dim, n_dims) =
                (dims[0], dims[1], dims[2], dims[3], dims[4]);
            let (theta_scale, freq_scale) = (l.f32_arg(10)?, l.f32_arg(11)?);
            let (k_blocks, v_blocks, slots) = (l.ptr_arg(12)?, l.ptr_arg(13)?, l.ptr_arg(14)?);
            let block_size = l.u32_arg(15)? as usize;
            let (q_norm, k_norm, eps) = (l.ptr_arg(16)?, l.ptr_arg(17)?, l.f32_arg(18)?);
            if l.config().grid[0] as usize != n_tokens * (n_heads + n_kv_heads) {
                return Err(format!("grid {:?}", l.config().grid));
            }
            let norm_weight = |weight: DevicePtr| -> Result<Option<Vec<f32>>, String> {
                if weight == DevicePtr::NULL {
                    return Ok(None);
                }
                Ok(Some(l.read_f32(weight, head_dim)?))
            };
            let (q_weight, k_weight) = (norm_weight(q_norm)?, norm_weight(k_norm)?);
            let norm_threads = (head_dim as u32).next_multiple_of(64).clamp(64, 1024);
            if (q_weight.is_some() || k_weight.is_some()) && l.config().block[0] != norm_threads {
                return Err(format!(
                    "block {:?}: a norm sums in ember_rms_norm_f32's order only with its {norm_threads} threads",
                    l.config().block
                ));
            }
            let positions = read_i32(l, positions, n_tokens)?;
            let slots = read_i32(l, slots, n_tokens)?;
            let factors = if factors == DevicePtr::NULL {
                vec![1.0; n_dims / 2]
            } else {
                l.read_f32(factors, n_dims / 2)?
            };
            let rotate = |head: &mut [f32], pos: i32| {
                let mut theta_base = pos as f32;
                for (i, factor) in factors.iter().enumerate() {
                    let theta = freq_scale * (theta_base / factor);
                    theta_base *= theta_scale;
                    let (ia, ib) = if neox {
                        (i, i + n_dims / 2)
                    } else {
                        (2 * i, 2 * i + 1)
                    };
                    let (a, b) = (head[ia], head[ib]);
                    head[ia] = a * theta.cos() - b * theta.sin();
                    head[ib] = a * theta.sin() + b * theta.cos();
                }
            };
            for (x, heads, weight) in [(q, n_heads, &q_weight), (k, n_kv_heads, &k_weight)] {
                for block in 0..n_tokens * heads {
                    let at = x.offset((block * head_dim * 4) as u64);
                    let mut head = l.read_f32(at, head_dim)?;
                    if let Some(weight) = weight {
                        let mean = head.iter().map(|v| v * v).sum::<f32>() / head_dim as f32;
                        let inv = 1.0 / (mean + eps).sqrt();
                        for (v, w) in head.iter_mut().zip(weight) {
                            *v = *v * inv * w;
                        }
                    }
                    rotate(&mut head, positions[block / heads]);
                    l.write_f32(at, &head)?;
                }
            }
            let row = n_kv_heads * head_dim;
            for (t, &slot) in slots.iter().enumerate() {
                if slot < 0 {
                    continue;
                }
                let (block, offset) = (slot as usize / block_size, slot as usize % block_size);
                let mut addresses = [0u8; 16];
                l.read(k_blocks.offset(block as u64 * 8), &mut addresses[..8])?;
                l.read(v_blocks.offset(block as u64 * 8), &mut addresses[8..])?;
                let k_at = u64::from_le_bytes(addresses[..8].try_into().unwrap());
                let v_at = u64::from_le_bytes(addresses[8..].try_into().unwrap());
                if k_at == 0 || v_at == 0 {
                    continue;
                }
                for (src, dst) in [(k, k_at), (v, v_at)] {
                    let values = l.read_f32(src.offset((t * row * 4) as u64), row)?;
                    let bytes: Vec<u8> = values
                        .iter()
                        .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                        .collect();
                    l.write(DevicePtr(dst).offset((offset * row * 2) as u64), &bytes)?;
                }
            }
            Ok(())
        });
    }
    // ember_get_rows_f32(float* out, const uint8_t* table, const int32_t* ids, uint32_t n_rows,
    // uint32_t n_cols, float scale); one block per id.
    driver.register_kernel("ember_get_rows_f32", |l| {
        let (out, table, ids) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
        let (n_rows, n_cols, scale) = (l.u32_arg(3)?, l.u32_arg(4)? as usize, l.f32_arg(5)?);
        let n = l.config().grid[0] as usize;
        for (t, id) in read_i32(l, ids, n)?.into_iter().enumerate() {
            let row = if id < 0 || id as u32 >= n_rows {
                vec![f32::NAN; n_cols]
            } else {
                let values = l.read_f32(table.offset((id as usize * n_cols * 4) as u64), n_cols)?;
                values.iter().map(|v| v * scale).collect()
            };
            l.write_f32(out.offset((t * n_cols * 4) as u64), &row)?;
        }
        Ok(())
    });
    // ember_gather_rows_f32(float* out, const float* src, const int32_t* rows, uint32_t dim)
    driver.register_kernel("ember_gather_rows_f32", |l| {
        let (out, src, rows) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
        let dim = l.u32_arg(3)? as usize;
        let n = l.config().grid[0] as usize;
        for (i, r) in read_i32(l, rows, n)?.into_iter().enumerate() {
            let values = l.read_f32(src.offset((r as usize * dim * 4) as u64), dim)?;
            l.write_f32(out.offset((i * dim * 4) as u64), &values)?;
        }
        Ok(())
    });
    // ember_gather_rows_strided_f32(float* out, const float* src, uint32_t first, uint32_t
    // stride, uint32_t dim)
    driver.register_kernel("ember_gather_rows_strided_f32", |l| {
        let (out, src) = (l.ptr_arg(0)?, l.ptr_arg(1)?);
        let (first, stride, dim) = (
            l.u32_arg(2)? as usize,
            l.u32_arg(3)? as usize,
            l.u32_arg(4)? as usize,
        );
        for i in 0..l.config().grid[0] as usize {
            let row = first + i * stride;
            let values = l.read_f32(src.offset((row * dim * 4) as u64), dim)?;
            l.write_f32(out.offset((i * dim * 4) as u64), &values)?;
        }
        Ok(())
    });
    // ember_argmax_partial_f32(float* part_values, int32_t* part_indices, const float* x,
    // uint32_t n_cols); block (r, p) takes values 1024 p.. of row r.
    driver.register_kernel("ember_argmax_partial_f32", |l| {
        let (values_out, indices_out, x) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
        let n_cols = l.u32_arg(3)? as usize;
        let [n_rows, n_parts, _] = l.config().grid;
        let (mut values, mut indices) = (Vec::new(), Vec::new());
        for row in 0..n_rows as usize {
            let x = l.read_f32(x.offset((row * n_cols * 4) as u64), n_cols)?;
            for part in 0..n_parts as usize {
                let range = 1024 * part..(1024 * (part + 1)).min(n_cols);
                // The first largest of the part (-inf never chosen: index 0x7fffffff when there
                // is none); -1 for a part holding NaN or +inf.
                let mut best = (i32::MAX, f32::NEG_INFINITY);
                for c in range.clone() {
                    if x[c] > best.1 {
                        best = (c as i32, x[c]);
                    }
                }
                let bad = x[range].iter().any(|v| v.is_nan() || *v == f32::INFINITY);
                values.push(best.1);
                indices.extend((if bad { -1 } else { best.0 }).to_le_bytes());
            }
        }
        l.write_f32(values_out, &values)?;
        l.write(indices_out, &indices)
    });
    // ember_argmax_merge_f32(int32_t* out, const float* part_values, const int32_t*
    // part_indices, uint32_t n_parts); one block per row.
    driver.register_kernel("ember_argmax_merge_f32", |l| {
        let (out, values, indices) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
        let n_parts = l.u32_arg(3)? as usize;
        let n_rows = l.config().grid[0] as usize;
        let values = l.read_f32(values, n_rows * n_parts)?;
        let indices: Vec<i32> = l
            .read_f32(indices, n_rows * n_parts)?
            .iter()
            .map(|v| v.to_bits() as i32)
            .collect();
        let mut bytes = Vec::new();
        for row in 0..n_rows {
            let parts = row * n_parts..(row + 1) * n_parts;
            let bad = indices[parts.clone()].contains(&-1);
            // Parts in order, each the first largest of its values: the first largest part.
            let mut best = (i32::MAX, f32::NEG_INFINITY);
            for p in parts {
                if values[p] > best.1 {
                    best = (indices[p], values[p]);
                }
            }
            let index = if bad {
                -1
            } else if best.0 == i32::MAX {
                0
            } else {
                best.0
            };
            bytes.extend(index.to_le_bytes());
        }
        l.write(out, &bytes)
    });
    // ember_gemm_f32(float* out, const uint8_t* w, const float* x, uint32_t n_tokens,
    // uint32_t n_rows, uint32_t n_cols); block (bx, by) computes rows 64 bx.. and tokens 64 by..
    driver.register_kernel("ember_gemm_f32", |l| {
        let (out, w, x) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
        let (n_tokens, n_rows, n_cols) = (
            l.u32_arg(3)? as usize,
            l.u32_arg(4)? as usize,
            l.u32_arg(5)? as usize,
        );
        let w = l.read_f32(w, n_rows * n_cols)?;
        let x = l.read_f32(x, n_tokens * n_cols)?;
        let mut result = l.read_f32(out, n_tokens * n_rows)?;
        let [grid_x, grid_y, _] = l.config().grid;
        for by in 0..grid_y as usize {
            for bx in 0..grid_x as usize {
                for t in (64 * by..64 * (by + 1)).filter(|&t| t < n_tokens) {
                    for r in (64 * bx..64 * (bx + 1)).filter(|&r| r < n_rows) {
                        result[t * n_rows + r] = (0..n_cols)
                            .map(|c| w[r * n_cols + c] * x[t * n_cols + c])
                            .sum();
                    }
                }
            }
        }
        l.write_f32(out, &result)
    });
}

impl Fixture {
    fn upload(&self, values: &[f32]) -> PoolBuffer {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let buffer = self
            .ctx
            .alloc(Purpose::Scratch, bytes.len().max(4) as u64)
            .unwrap();
        self.ctx.upload(buffer.ptr(), &bytes).unwrap();
        buffer
    }

    fn upload_i32(&self, values: &[i32]) -> PoolBuffer {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let buffer = self
            .ctx
            .alloc(Purpose::Scratch, bytes.len() as u64)
            .unwrap();
        self.ctx.upload(buffer.ptr(), &bytes).unwrap();
        buffer
    }

    fn zeros(&self, n: usize) -> PoolBuffer {
        let buffer = self.ctx.alloc(Purpose::Scratch, (n * 4) as u64).unwrap();
        self.ctx.zero(buffer.ptr(), (n * 4) as u64).unwrap();
        buffer
    }

    fn download(&self, buffer: &PoolBuffer, n: usize) -> Vec<f32> {
        let mut bytes = vec![0u8; n * 4];
        self.ctx.download(buffer.ptr(), &mut bytes).unwrap();
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

/// Deterministic values in [-2, 2).
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let h = (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)).rotate_left(13);
            (h % 4000) as f32 / 1000.0 - 2.0
        })
        .collect()
}

#[test]
fn the_host_context_has_no_blas_and_round_trips_memory() {
    let f = fixture();
    assert!(!f.ctx.blas().is_loaded());
    assert_eq!(f.ctx.arch(), "host");
    let data = values(100, 1);
    let buffer = f.upload(&data);
    assert_eq!(f.download(&buffer, 100), data);
    let copy = f.zeros(100);
    f.ctx.copy(copy.ptr(), buffer.ptr(), 400).unwrap();
    assert_eq!(f.download(&copy, 100), data);
}

#[test]
fn element_wise_wrappers_pass_their_arguments_in_kernel_order() {
    let f = fixture();
    let (n, dim) = (96usize, 32usize);
    let (a, b, bias) = (values(n, 1), values(n, 2), values(dim, 3));
    let (da, db, dbias, out) = (f.upload(&a), f.upload(&b), f.upload(&bias), f.zeros(n));

    add(&f.ctx, out.ptr(), da.ptr(), dbias.ptr(), n, dim).unwrap();
    let expected: Vec<f32> = (0..n).map(|i| a[i] + bias[i % dim]).collect();
    assert_eq!(f.download(&out, n), expected);

    scale(&f.ctx, out.ptr(), da.ptr(), 0.5, n).unwrap();
    assert_eq!(
        f.download(&out, n),
        a.iter().map(|v| v * 0.5).collect::<Vec<_>>()
    );

    swiglu(&f.ctx, out.ptr(), da.ptr(), db.ptr(), n).unwrap();
    let expected: Vec<f32> = (0..n)
        .map(|i| a[i] / (1.0 + (-a[i]).exp()) * b[i])
        .collect();
    assert_eq!(f.download(&out, n), expected);

    geglu(&f.ctx, da.ptr(), da.ptr(), db.ptr(), n).unwrap();
    let expected: Vec<f32> = (0..n).map(|i| gelu_ggml(a[i]) * b[i]).collect();
    assert_eq!(f.download(&da, n), expected, "in place on gate");

    softcap(&f.ctx, db.ptr(), n, 1.5).unwrap();
    let expected: Vec<f32> = b.iter().map(|v| 1.5 * (v / 1.5).tanh()).collect();
    assert_eq!(f.download(&db, n), expected);

    let half = f.ctx.alloc(Purpose::Scratch, (n * 2) as u64).unwrap();
    convert_f32_to_f16(&f.ctx, half.ptr(), dbias.ptr(), dim).unwrap();
    let mut bytes = vec![0u8; dim * 2];
    f.ctx.download(half.ptr(), &mut bytes).unwrap();
    let expected: Vec<u8> = bias
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect();
    assert_eq!(bytes, expected);
}

/// Gemma 4's row ops: the bare RMS normalisation (a null weight) and the broadcast product of
/// every row with one weight vector.
#[test]
fn unit_rms_norm_and_broadcast_mul_wrappers() {
    let f = fixture();
    let (n_rows, dim) = (3usize, 96usize);
    let (x, weight) = (values(n_rows * dim, 7), values(dim, 8));
    let dx = f.upload(&x);
    rms_norm(
        &f.ctx,
        dx.ptr(),
        DevicePtr::NULL,
        n_rows,
        dim,
        1e-6,
        dx.ptr(),
    )
    .unwrap();
    let normed = f.download(&dx, n_rows * dim);
    for r in 0..n_rows {
        let row = &x[r * dim..(r + 1) * dim];
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() / dim as f32 + 1e-6).sqrt();
        for c in 0..dim {
            assert_eq!(normed[r * dim + c], row[c] * inv, "row {r} col {c}");
        }
    }
    let dweight = f.upload(&weight);
    mul(&f.ctx, dx.ptr(), dx.ptr(), dweight.ptr(), n_rows * dim, dim).unwrap();
    let got = f.download(&dx, n_rows * dim);
    for (i, (g, n)) in got.iter().zip(&normed).enumerate() {
        assert_eq!(*g, n * weight[i % dim], "value {i}");
    }
    let error = mul(&f.ctx, dx.ptr(), dx.ptr(), dweight.ptr(), n_rows * dim, 7).unwrap_err();
    assert_eq!(
        error.to_string(),
        "mul: expected a broadcast length dividing 288, found 7"
    );
}

#[test]
fn the_fused_router_input_equals_the_bare_norm_the_scale_and_the_row_product() {
    let f = fixture();
    let (n_rows, dim, scale_value) = (3usize, 96usize, 1.0 / (96f32).sqrt());
    let (x, weight) = (values(n_rows * dim, 9), values(dim, 10));
    let (dx, dweight) = (f.upload(&x), f.upload(&weight));
    let fused = f.upload(&vec![f32::NAN; n_rows * dim]);
    rms_norm_scale_mul(
        &f.ctx,
        dx.ptr(),
        dweight.ptr(),
        n_rows,
        dim,
        1e-6,
        scale_value,
        fused.ptr(),
    )
    .unwrap();
    let steps = f.upload(&x);
    let len = n_rows * dim;
    rms_norm(
        &f.ctx,
        steps.ptr(),
        DevicePtr::NULL,
        n_rows,
        dim,
        1e-6,
        steps.ptr(),
    )
    .unwrap();
    scale(&f.ctx, steps.ptr(), steps.ptr(), scale_value, len).unwrap();
    mul(&f.ctx, steps.ptr(), steps.ptr(), dweight.ptr(), len, dim).unwrap();
    assert_eq!(f.download(&fused, len), f.download(&steps, len));
    // The input is left alone.
    assert_eq!(f.download(&dx, len), x);
}

#[test]
fn the_fused_norm_and_residual_add_equals_the_norm_then_the_add() {
    let f = fixture();
    let (n_rows, dim) = (3usize, 96usize);
    let (x, weight, residual) = (
        values(n_rows * dim, 11),
        values(dim, 12),
        values(n_rows * dim, 13),
    );
    let len = n_rows * dim;
    let dweight = f.upload(&weight);
    let (fused_x, fused_dst) = (f.upload(&x), f.upload(&residual));
    rms_norm_add(
        &f.ctx,
        fused_x.ptr(),
        dweight.ptr(),
        n_rows,
        dim,
        1e-6,
        fused_dst.ptr(),
    )
    .unwrap();
    let (steps_x, steps_dst) = (f.upload(&x), f.upload(&residual));
    rms_norm(
        &f.ctx,
        steps_x.ptr(),
        dweight.ptr(),
        n_rows,
        dim,
        1e-6,
        steps_x.ptr(),
    )
    .unwrap();
    add(
        &f.ctx,
        steps_dst.ptr(),
        steps_dst.ptr(),
        steps_x.ptr(),
        len,
        len,
    )
    .unwrap();
    assert_eq!(f.download(&fused_x, len), f.download(&steps_x, len));
    assert_eq!(f.download(&fused_dst, len), f.download(&steps_dst, len));
}

#[test]
fn row_wrappers_launch_one_block_per_row() {
    let f = fixture();
    let (n_rows, dim) = (3usize, 64usize);
    let (x, weight) = (values(n_rows * dim, 4), values(dim, 5));
    let (dx, dweight, out) = (f.upload(&x), f.upload(&weight), f.zeros(n_rows * dim));
    rms_norm(
        &f.ctx,
        dx.ptr(),
        dweight.ptr(),
        n_rows,
        dim,
        1e-5,
        out.ptr(),
    )
    .unwrap();
    let got = f.download(&out, n_rows * dim);
    for r in 0..n_rows {
        let row = &x[r * dim..(r + 1) * dim];
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() / dim as f32 + 1e-5).sqrt();
        for c in 0..dim {
            assert_eq!(
                got[r * dim + c],
                row[c] * inv * weight[c],
                "row {r} col {c}"
            );
        }
    }

    // The fused residual add + norm equals add followed by rms_norm, on every row.
    let proj = values(n_rows * dim, 6);
    let (dsum, dproj, fused) = (f.upload(&x), f.upload(&proj), f.zeros(n_rows * dim));
    add_rms_norm(
        &f.ctx,
        dsum.ptr(),
        dproj.ptr(),
        dweight.ptr(),
        n_rows,
        dim,
        1e-5,
        fused.ptr(),
    )
    .unwrap();
    let (dref, unfused) = (f.upload(&x), f.zeros(n_rows * dim));
    add(
        &f.ctx,
        dref.ptr(),
        dref.ptr(),
        dproj.ptr(),
        n_rows * dim,
        n_rows * dim,
    )
    .unwrap();
    rms_norm(
        &f.ctx,
        dref.ptr(),
        dweight.ptr(),
        n_rows,
        dim,
        1e-5,
        unfused.ptr(),
    )
    .unwrap();
    let sum: Vec<f32> = x.iter().zip(&proj).map(|(a, b)| a + b).collect();
    assert_eq!(f.download(&dsum, n_rows * dim), sum, "residual");
    assert_eq!(f.download(&dref, n_rows * dim), sum, "reference residual");
    assert_eq!(
        f.download(&fused, n_rows * dim),
        f.download(&unfused, n_rows * dim)
    );
    let error = add_rms_norm(
        &f.ctx,
        dsum.ptr(),
        dproj.ptr(),
        dweight.ptr(),
        n_rows,
        dim,
        1e-5,
        dsum.ptr(),
    )
    .unwrap_err();
    assert_eq!(
        error.to_string(),
        "add_rms_norm: expected an output buffer other than x and proj, found the same buffer"
    );

    let rows = f.upload_i32(&[2, 0]);
    let gathered = f.zeros(2 * dim);
    gather_rows(&f.ctx, dx.ptr(), dim, rows.ptr(), 2, gathered.ptr()).unwrap();
    let got = f.download(&gathered, 2 * dim);
    assert_eq!(&got[..dim], &x[2 * dim..3 * dim]);
    assert_eq!(&got[dim..], &x[..dim]);
    // Rows 0 and 2 as a strided slice (first 0, stride 2), and row 1 alone.
    gather_rows_strided(&f.ctx, dx.ptr(), dim, 0, 2, 2, gathered.ptr()).unwrap();
    let got = f.download(&gathered, 2 * dim);
    assert_eq!(&got[..dim], &x[..dim]);
    assert_eq!(&got[dim..], &x[2 * dim..3 * dim]);
    gather_rows_strided(&f.ctx, dx.ptr(), dim, 1, 0, 1, gathered.ptr()).unwrap();
    assert_eq!(&f.download(&gathered, dim)[..], &x[dim..2 * dim]);

    let index = f.ctx.alloc(Purpose::Scratch, 12).unwrap();
    let parts = f
        .ctx
        .alloc(Purpose::Scratch, argmax_scratch_bytes(n_rows, dim) as u64)
        .unwrap();
    argmax(&f.ctx, dx.ptr(), n_rows, dim, parts.ptr(), index.ptr()).unwrap();
    let mut bytes = [0u8; 12];
    f.ctx.download(index.ptr(), &mut bytes).unwrap();
    for r in 0..n_rows {
        let row = &x[r * dim..(r + 1) * dim];
        let best = (0..dim).fold(0, |b, c| if row[c] > row[b] { c } else { b });
        let got = i32::from_le_bytes(bytes[4 * r..4 * r + 4].try_into().unwrap());
        assert_eq!(got, best as i32, "row {r}");
    }
}

/// Gemma 4's fused step from attention to the FFN blocks gives the values of the four ops it
/// replaces (on the host driver's twins, which compute each op as its kernel does).
#[test]
fn gemma4_ffn_inputs_equal_the_four_ops() {
    let f = fixture();
    let (n_rows, dim, eps, scale) = (3usize, 96usize, 1e-6f32, 0.125f32);
    let values = |seed: usize, n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.0) - 1.0)
            .collect()
    };
    let (x0, proj0) = (values(1, n_rows * dim), values(2, n_rows * dim));
    let weights: Vec<PoolBuffer> = (3..7).map(|s| f.upload(&values(s, dim))).collect();
    // The four ops, one after another.
    let (x, proj) = (f.upload(&x0), f.upload(&proj0));
    let (xn, moe_in, router_in) = (
        f.zeros(n_rows * dim),
        f.zeros(n_rows * dim),
        f.zeros(n_rows * dim),
    );
    rms_norm_add(
        &f.ctx,
        proj.ptr(),
        weights[0].ptr(),
        n_rows,
        dim,
        eps,
        x.ptr(),
    )
    .unwrap();
    rms_norm(
        &f.ctx,
        x.ptr(),
        weights[1].ptr(),
        n_rows,
        dim,
        eps,
        xn.ptr(),
    )
    .unwrap();
    rms_norm(
        &f.ctx,
        x.ptr(),
        weights[2].ptr(),
        n_rows,
        dim,
        eps,
        moe_in.ptr(),
    )
    .unwrap();
    rms_norm_scale_mul(
        &f.ctx,
        x.ptr(),
        weights[3].ptr(),
        n_rows,
        dim,
        eps,
        scale,
        router_in.ptr(),
    )
    .unwrap();
    let want: Vec<Vec<f32>> = [&x, &proj, &xn, &moe_in, &router_in]
        .iter()
        .map(|b| f.download(b, n_rows * dim))
        .collect();
    // The fused op.
    let (x, proj) = (f.upload(&x0), f.upload(&proj0));
    let (xn, moe_in, router_in) = (
        f.zeros(n_rows * dim),
        f.zeros(n_rows * dim),
        f.zeros(n_rows * dim),
    );
    let buffers = Gemma4FfnInputs {
        x: x.ptr(),
        proj: proj.ptr(),
        post_attn_norm: weights[0].ptr(),
        ffn_norm: weights[1].ptr(),
        pre_norm: weights[2].ptr(),
        router_weight: weights[3].ptr(),
        router_scale: scale,
        xn: xn.ptr(),
        moe_in: moe_in.ptr(),
        router_in: router_in.ptr(),
    };
    gemma4_ffn_inputs(&f.ctx, &buffers, n_rows, dim, eps).unwrap();
    for (name, (buffer, want)) in ["x", "proj", "xn", "moe_in", "router_in"]
        .iter()
        .zip([&x, &proj, &xn, &moe_in, &router_in].iter().zip(&want))
    {
        let got = f.download(buffer, n_rows * dim);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(want), "{name}");
    }
}

/// Rows of several 1024-value parts: the winner in the last part, a tie across parts (the lower
/// index wins), NaN or +inf in one part (-1), -inf everywhere (0), -inf around one finite value.
#[test]
fn argmax_over_parts_is_the_first_largest_of_the_row() {
    let f = fixture();
    let n_cols = 4100; // five parts, the last of 4 values
    let mut rows: Vec<Vec<f32>> = Vec::new();
    let base: Vec<f32> = (0..n_cols)
        .map(|c| ((c * 37) % 1000) as f32 / 1000.0)
        .collect();
    let mut last = base.clone();
    last[4099] = 5.0;
    rows.push(last);
    let mut tie = base.clone();
    tie[3000] = 7.0;
    tie[20] = 7.0;
    tie[2048] = 7.0;
    rows.push(tie);
    let mut nan = base.clone();
    nan[2500] = f32::NAN;
    rows.push(nan);
    let mut inf = base.clone();
    inf[1024] = f32::INFINITY;
    rows.push(inf);
    rows.push(vec![f32::NEG_INFINITY; n_cols]);
    let mut lone = vec![f32::NEG_INFINITY; n_cols];
    lone[3333] = -1e30;
    rows.push(lone);
    let want = [4099, 20, -1, -1, 0, 3333];
    let x: Vec<f32> = rows.concat();
    let dx = f.upload(&x);
    let out = f
        .ctx
        .alloc(Purpose::Scratch, 4 * rows.len() as u64)
        .unwrap();
    let parts = f
        .ctx
        .alloc(
            Purpose::Scratch,
            argmax_scratch_bytes(rows.len(), n_cols) as u64,
        )
        .unwrap();
    argmax(&f.ctx, dx.ptr(), rows.len(), n_cols, parts.ptr(), out.ptr()).unwrap();
    let mut bytes = vec![0u8; 4 * rows.len()];
    f.ctx.download(out.ptr(), &mut bytes).unwrap();
    let got: Vec<i32> = bytes
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn get_rows_scales_and_marks_bad_ids() {
    let f = fixture();
    let (rows, cols) = (5usize, 32usize);
    let table_values = values(rows * cols, 6);
    let table = f.upload(&table_values);
    let matrix = DeviceMatrix::new(table, WeightFormat::F32, rows, cols).unwrap();
    let ids = f.upload_i32(&[4, 1, 5]);
    let out = f.zeros(3 * cols);
    get_rows(&f.ctx, &matrix, ids.ptr(), 3, 2.0, out.ptr()).unwrap();
    let got = f.download(&out, 3 * cols);
    let expected: Vec<f32> = table_values[4 * cols..5 * cols]
        .iter()
        .chain(&table_values[cols..2 * cols])
        .map(|v| v * 2.0)
        .collect();
    assert_eq!(&got[..2 * cols], &expected[..]);
    assert!(got[2 * cols..].iter().all(|v| v.is_nan()), "id 5 of 5 rows");
}

#[test]
fn rope_passes_positions_factors_and_the_cpu_theta_scale() {
    let f = fixture();
    let (n_tokens, n_heads, head_dim, n_dims) = (2usize, 2usize, 8usize, 4usize);
    let x = values(n_tokens * n_heads * head_dim, 7);
    let positions = f.upload_i32(&[3, 11]);
    let factors = f.upload(&[1.0, 4.0]);
    for (mode, with_factors) in [(RopeMode::Normal, false), (RopeMode::Neox, true)] {
        let dx = f.upload(&x);
        let factor_ptr = with_factors.then(|| factors.ptr());
        rope(
            &f.ctx,
            dx.ptr(),
            positions.ptr(),
            n_tokens,
            n_heads,
            head_dim,
            n_dims,
            mode,
            10_000.0,
            0.5,
            factor_ptr,
        )
        .unwrap();
        let got = f.download(&dx, x.len());
        let theta_scale = 10_000.0f32.powf(-2.0 / n_dims as f32);
        let mut expected = x.clone();
        for (t, pos) in [3.0f32, 11.0].into_iter().enumerate() {
            for h in 0..n_heads {
                let head = (t * n_heads + h) * head_dim;
                let mut theta_base = pos;
                for i in 0..n_dims / 2 {
                    let factor = if with_factors { [1.0, 4.0][i] } else { 1.0 };
                    let theta = 0.5 * (theta_base / factor);
                    theta_base *= theta_scale;
                    let (ia, ib) = match mode {
                        RopeMode::Normal => (head + 2 * i, head + 2 * i + 1),
                        RopeMode::Neox => (head + i, head + i + n_dims / 2),
                    };
                    let (a, b) = (x[ia], x[ib]);
                    expected[ia] = a * theta.cos() - b * theta.sin();
                    expected[ib] = a * theta.sin() + b * theta.cos();
                }
            }
        }
        assert_eq!(got, expected, "{mode:?}");
        // Values past n_dims are untouched.
        assert_eq!(got[n_dims..head_dim], x[n_dims..head_dim]);
    }
}

#[test]
fn rope_kv_store_equals_rope_rope_and_kv_store() {
    let f = fixture();
    let (n_tokens, n_heads, n_kv_heads, head_dim, n_dims) =
        (2usize, 4usize, 2usize, 8usize, 6usize);
    let (block_size, row) = (4usize, n_kv_heads * head_dim);
    let q = values(n_tokens * n_heads * head_dim, 21);
    let k = values(n_tokens * row, 22);
    let v = values(n_tokens * row, 23);
    let positions = f.upload_i32(&[5, 9]);
    let factors = f.upload(&[1.0, 2.0, 4.0]);
    // Token 0 goes to block 1 slot 2; token 1 has no slot (padding).
    let slots = f.upload_i32(&[block_size as i32 + 2, -1]);
    // With the QK-norm too: each head normalised first, as rms_norm of every head would.
    let (q_weight, k_weight) = (
        f.upload(&values(head_dim, 24)),
        f.upload(&values(head_dim, 25)),
    );
    let eps = 1e-6;
    for (mode, normed) in [
        (RopeMode::Normal, false),
        (RopeMode::Neox, false),
        (RopeMode::Normal, true),
        (RopeMode::Neox, true),
    ] {
        let (dq, dk, dv) = (f.upload(&q), f.upload(&k), f.upload(&v));
        let k_cache = f.zeros(2 * block_size * row / 2);
        let v_cache = f.zeros(2 * block_size * row / 2);
        let tables: Vec<u8> = [0u64, k_cache.ptr().0, 0, v_cache.ptr().0]
            .iter()
            .flat_map(|a| a.to_le_bytes())
            .collect();
        let table = f.ctx.alloc(Purpose::Scratch, 32).unwrap();
        f.ctx.upload(table.ptr(), &tables).unwrap();
        let args = RopeKvStoreArgs {
            q: dq.ptr(),
            k: dk.ptr(),
            v: dv.ptr(),
            positions: positions.ptr(),
            freq_factors: Some(factors.ptr()),
            n_tokens,
            n_heads,
            n_kv_heads,
            head_dim,
            n_dims,
            mode,
            freq_base: 10_000.0,
            freq_scale: 0.5,
            k_blocks: table.ptr(),
            v_blocks: table.ptr().offset(16),
            slots: slots.ptr(),
            block_size,
            q_norm: normed.then(|| q_weight.ptr()),
            k_norm: normed.then(|| k_weight.ptr()),
            norm_eps: eps,
        };
        rope_kv_store(&f.ctx, &args).unwrap();
        // The reference: the separate norm and rope launches on copies.
        let (rq, rk) = (f.upload(&q), f.upload(&k));
        for (x, heads, weight) in [(&rq, n_heads, &q_weight), (&rk, n_kv_heads, &k_weight)] {
            if normed {
                let rows = n_tokens * heads;
                rms_norm(&f.ctx, x.ptr(), weight.ptr(), rows, head_dim, eps, x.ptr()).unwrap();
            }
            rope(
                &f.ctx,
                x.ptr(),
                positions.ptr(),
                n_tokens,
                heads,
                head_dim,
                n_dims,
                mode,
                10_000.0,
                0.5,
                Some(factors.ptr()),
            )
            .unwrap();
        }
        assert_eq!(
            f.download(&dq, q.len()),
            f.download(&rq, q.len()),
            "{mode:?} q (normed: {normed})"
        );
        let roped_k = f.download(&rk, k.len());
        assert_eq!(
            f.download(&dk, k.len()),
            roped_k,
            "{mode:?} k (normed: {normed})"
        );
        let mut cache = vec![0u8; block_size * row * 2];
        f.ctx.download(k_cache.ptr().offset(0), &mut cache).unwrap();
        let slot_bytes = |cache: &[u8]| -> Vec<f32> {
            cache[2 * row * 2..3 * row * 2]
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect()
        };
        let to_f16 =
            |x: &[f32]| -> Vec<f32> { x.iter().map(|&v| f16::from_f32(v).to_f32()).collect() };
        assert_eq!(
            slot_bytes(&cache),
            to_f16(&roped_k[..row]),
            "{mode:?} k cache"
        );
        f.ctx.download(v_cache.ptr(), &mut cache).unwrap();
        assert_eq!(slot_bytes(&cache), to_f16(&v[..row]), "{mode:?} v cache");
        // Only slot 2 of the block was written (token 1 had none).
        let written = cache.iter().enumerate().filter(|(_, &b)| b != 0);
        assert!(written
            .into_iter()
            .all(|(i, _)| (2 * row * 2..3 * row * 2).contains(&i)));
    }
}

#[test]
fn matmul_without_blas_uses_the_tiled_kernel_over_the_whole_grid() {
    let f = fixture();
    // 70 rows and 130 tokens need a 2 x 3 grid of 64 x 64 tiles.
    let (rows, cols, n_tokens) = (70usize, 32usize, 130usize);
    let (w, x) = (values(rows * cols, 8), values(n_tokens * cols, 9));
    let matrix = DeviceMatrix::new(f.upload(&w), WeightFormat::F32, rows, cols).unwrap();
    let (dx, out) = (f.upload(&x), f.zeros(n_tokens * rows));
    matmul(&f.ctx, &matrix, dx.ptr(), n_tokens, out.ptr()).unwrap();
    let got = f.download(&out, n_tokens * rows);
    for t in 0..n_tokens {
        for r in 0..rows {
            let expected: f32 = (0..cols).map(|c| w[r * cols + c] * x[t * cols + c]).sum();
            assert_eq!(got[t * rows + r], expected, "token {t} row {r}");
        }
    }
    let error = matmul_with(
        &f.ctx,
        &matrix,
        dx.ptr(),
        n_tokens,
        out.ptr(),
        MatmulPath::Blas,
    )
    .unwrap_err();
    assert!(
        error
            .to_string()
            .starts_with("matmul (BLAS) does not support this context: no BLAS: turned off"),
        "{error}"
    );
}

#[test]
fn bad_shapes_are_errors_before_any_launch() {
    let f = fixture();
    let buffer = f.zeros(64);
    let p = buffer.ptr();
    let check = |result: Result<(), OpsError>, expected: &str| {
        let error = result.unwrap_err();
        assert!(matches!(error, OpsError::Shape { .. }), "{error:?}");
        assert_eq!(error.to_string(), expected);
    };
    check(
        add(&f.ctx, p, p, p, 10, 3),
        "add: expected a broadcast length dividing 10, found 3",
    );
    check(
        rope(&f.ctx, p, p, 1, 1, 8, 5, RopeMode::Normal, 1e4, 1.0, None),
        "rope: expected an even rotated dimension count of at most the head size 8, found 5",
    );
    check(
        rope(&f.ctx, p, p, 1, 1, 8, 10, RopeMode::Neox, 1e4, 1.0, None),
        "rope: expected an even rotated dimension count of at most the head size 8, found 10",
    );
    check(
        softcap(&f.ctx, p, 4, 0.0),
        "softcap: expected a positive finite cap, found 0",
    );
    check(
        argmax(&f.ctx, p, 1, 0, p, p),
        "argmax: expected a row length between 1 and 67107840, found 0",
    );
    check(
        scale(&f.ctx, p, p, 1.0, 1 << 33),
        "scale: expected an element count below 2^31, found 8589934592",
    );
    let matrix = DeviceMatrix {
        buf: f.zeros(64),
        format: WeightFormat::Q4_0,
        rows: 2,
        cols: 48,
    };
    check(
        matmul(&f.ctx, &matrix, p, 16, p),
        "matmul: expected a column count that is a positive multiple of 32 for q4_0, found 48",
    );
    // Nothing to do is not an error.
    add(&f.ctx, p, p, p, 0, 0).unwrap();
    matmul(&f.ctx, &matrix, p, 0, p).unwrap();
}

#[test]
fn a_missing_code_object_names_the_architecture() {
    let dir = tempfile::tempdir().unwrap();
    let driver: Arc<dyn Driver> = Arc::new(HostDriver::new(HostDriverConfig::default()));
    let pool = DevicePool::with_kind(
        driver,
        0,
        PoolKind::Caching,
        "test".to_string(),
        PoolConfig::default(),
    )
    .unwrap();
    let ctx = GpuContext::with_options(
        Arc::new(pool),
        Arc::new(KernelLibrary::new(dir.path().to_path_buf())),
        &GpuContextOptions { disable_blas: true },
    )
    .unwrap();
    let buffer = ctx.alloc(Purpose::Scratch, 64).unwrap();
    let error = scale(&ctx, buffer.ptr(), buffer.ptr(), 2.0, 16).unwrap_err();
    assert!(matches!(error, OpsError::Kernel(_)), "{error:?}");
    assert!(
        error
            .to_string()
            .starts_with("no elementwise kernels for architecture host in"),
        "{error}"
    );
    assert!(Path::new(dir.path()).exists());
}

#[test]
fn budget_refusals_count_as_out_of_memory() {
    let driver: Arc<dyn Driver> = Arc::new(HostDriver::new(HostDriverConfig::default()));
    let pool = DevicePool::with_kind(
        driver,
        0,
        PoolKind::Caching,
        "test".to_string(),
        PoolConfig {
            budget: Some(1024),
            ..PoolConfig::default()
        },
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ctx = GpuContext::with_options(
        Arc::new(pool),
        Arc::new(KernelLibrary::new(dir.path().to_path_buf())),
        &GpuContextOptions { disable_blas: true },
    )
    .unwrap();
    let error = ctx.alloc(Purpose::Scratch, 4096).unwrap_err();
    assert!(error.is_out_of_memory(), "{error}");
    assert!(matches!(
        error,
        OpsError::Pool(PoolError::BudgetExceeded { .. })
    ));
}
