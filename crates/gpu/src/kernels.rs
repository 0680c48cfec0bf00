//! GPU kernel modules: named by an enum and a const table, loaded lazily and cached per device.
//!
//! `cargo xtask kernels --target T` compiles every `kernels/<stem>.hip` into
//! `kernels/<arch>/<stem>.hsaco` (AMD), `.cubin` or `.ptx` (NVIDIA) beside the binary, or under
//! `EMBER_KERNELS_DIR`. At run time the device's architecture name picks the code object; a device
//! with none gets an error naming its architecture, what this build has, and which build would
//! serve it. The layout follows candle's `candle-kernels` (a module table, functions looked up on
//! first use and cached).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use thiserror::Error;

use crate::driver::{
    DeviceOrdinal, DevicePtr, Driver, DriverError, FunctionHandle, KernelArg, KernelArgs,
    LaunchConfig, ModuleHandle, StreamHandle,
};

/// Environment variable naming the kernels directory (overrides "beside the binary").
pub const KERNELS_DIR_ENV: &str = "EMBER_KERNELS_DIR";

/// A kernel source file in `kernels/`, compiled to one code object per architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelModule {
    Memory,
    Elementwise,
    Norm,
    Rope,
    Softmax,
    Embedding,
    Argmax,
    MatVec,
    Dequantize,
    Attention,
    Gemm,
    ExactElementwise,
    ExactAttention,
    ExactMatmul,
    Mmq,
    Moe,
    DeltaNet,
}

/// A module's file stem and the functions it exports.
#[derive(Debug)]
pub struct ModuleSpec {
    pub module: KernelModule,
    pub stem: &'static str,
    pub functions: &'static [&'static str],
}

/// Every kernel module and its functions; `kernels/*.hip` must export exactly these names.
pub const KERNEL_MODULES: &[ModuleSpec] = &[
    ModuleSpec {
        module: KernelModule::Memory,
        stem: "memory",
        functions: &["ember_fill_u32"],
    },
    ModuleSpec {
        module: KernelModule::Elementwise,
        stem: "elementwise",
        functions: &[
            "ember_add_f32",
            "ember_mul_f32",
            "ember_scale_f32",
            "ember_silu_mul_f32",
            "ember_gelu_mul_f32",
            "ember_softcap_f32",
            "ember_convert_f16_f32",
        ],
    },
    ModuleSpec {
        module: KernelModule::Norm,
        stem: "norm",
        functions: &[
            "ember_rms_norm_f32",
            "ember_rms_norm_scale_mul_f32",
            "ember_rms_norm_add_f32",
            "ember_gemma4_ffn_inputs_f32",
            "ember_add_rms_norm_f32",
        ],
    },
    ModuleSpec {
        module: KernelModule::Rope,
        stem: "rope",
        functions: &[
            "ember_rope_norm_f32",
            "ember_rope_neox_f32",
            "ember_rope_kv_store_norm_f32",
            "ember_rope_kv_store_neox_f32",
        ],
    },
    ModuleSpec {
        module: KernelModule::Softmax,
        stem: "softmax",
        functions: &["ember_softmax_f32"],
    },
    ModuleSpec {
        module: KernelModule::Embedding,
        stem: "embedding",
        functions: &[
            "ember_get_rows_f32",
            "ember_get_rows_f16",
            "ember_get_rows_bf16",
            "ember_get_rows_q4_0",
            "ember_get_rows_q4_1",
            "ember_get_rows_q5_0",
            "ember_get_rows_q5_1",
            "ember_get_rows_q8_0",
            "ember_get_rows_q2_k",
            "ember_get_rows_q3_k",
            "ember_get_rows_q4_k",
            "ember_get_rows_q5_k",
            "ember_get_rows_q6_k",
            "ember_gather_rows_f32",
            "ember_gather_rows_strided_f32",
        ],
    },
    ModuleSpec {
        module: KernelModule::Argmax,
        stem: "argmax",
        functions: &["ember_argmax_partial_f32", "ember_argmax_merge_f32"],
    },
    ModuleSpec {
        module: KernelModule::MatVec,
        stem: "matvec",
        functions: &[
            "ember_matvec_q4_0_t1",
            "ember_matvec_q4_0_t2",
            "ember_matvec_q4_0_t4",
            "ember_matvec_q4_0_t8",
            "ember_matvec_q4_1_t1",
            "ember_matvec_q4_1_t2",
            "ember_matvec_q4_1_t4",
            "ember_matvec_q4_1_t8",
            "ember_matvec_q5_0_t1",
            "ember_matvec_q5_0_t2",
            "ember_matvec_q5_0_t4",
            "ember_matvec_q5_0_t8",
            "ember_matvec_q5_1_t1",
            "ember_matvec_q5_1_t2",
            "ember_matvec_q5_1_t4",
            "ember_matvec_q5_1_t8",
            "ember_matvec_q8_0_t1",
            "ember_matvec_q8_0_t2",
            "ember_matvec_q8_0_t4",
            "ember_matvec_q8_0_t8",
            "ember_matvec_q4_k_t1",
            "ember_matvec_q4_k_t2",
            "ember_matvec_q4_k_t4",
            "ember_matvec_q4_k_t8",
            "ember_matvec_q5_k_t1",
            "ember_matvec_q5_k_t2",
            "ember_matvec_q5_k_t4",
            "ember_matvec_q5_k_t8",
            "ember_matvec_q6_k_t1",
            "ember_matvec_q6_k_t2",
            "ember_matvec_q6_k_t4",
            "ember_matvec_q6_k_t8",
            "ember_matvec_f32_t1",
            "ember_matvec_f32_t8",
            "ember_matvec_f16_t1",
            "ember_matvec_f16_t8",
            "ember_matvec_bf16_t1",
            "ember_matvec_bf16_t8",
            "ember_matvec_swiglu_q4_0_t1",
            "ember_matvec_geglu_q4_0_t1",
            "ember_matvec_swiglu_q4_1_t1",
            "ember_matvec_geglu_q4_1_t1",
            "ember_matvec_swiglu_q5_0_t1",
            "ember_matvec_geglu_q5_0_t1",
            "ember_matvec_swiglu_q5_1_t1",
            "ember_matvec_geglu_q5_1_t1",
            "ember_matvec_swiglu_q8_0_t1",
            "ember_matvec_geglu_q8_0_t1",
            "ember_matvec_swiglu_q4_k_t1",
            "ember_matvec_geglu_q4_k_t1",
            "ember_matvec_swiglu_q5_k_t1",
            "ember_matvec_geglu_q5_k_t1",
            "ember_matvec_swiglu_q6_k_t1",
            "ember_matvec_geglu_q6_k_t1",
            "ember_matvec_swiglu_f32_t1",
            "ember_matvec_geglu_f32_t1",
            "ember_matvec_swiglu_f16_t1",
            "ember_matvec_geglu_f16_t1",
            "ember_matvec_swiglu_bf16_t1",
            "ember_matvec_geglu_bf16_t1",
            "ember_matvec3_q4_0_t1",
            "ember_matvec3_q4_1_t1",
            "ember_matvec3_q5_0_t1",
            "ember_matvec3_q5_1_t1",
            "ember_matvec3_q8_0_t1",
            "ember_matvec3_q4_k_t1",
            "ember_matvec3_q5_k_t1",
            "ember_matvec3_q6_k_t1",
            "ember_moe_matvec_q4_0",
            "ember_moe_matvec_q4_1",
            "ember_moe_matvec_q5_0",
            "ember_moe_matvec_q5_1",
            "ember_moe_matvec_q8_0",
            "ember_moe_matvec_q4_k",
            "ember_moe_matvec_q5_k",
            "ember_moe_matvec_q6_k",
            "ember_moe_swiglu_q4_0",
            "ember_moe_geglu_q4_0",
            "ember_moe_swiglu_q4_1",
            "ember_moe_geglu_q4_1",
            "ember_moe_swiglu_q5_0",
            "ember_moe_geglu_q5_0",
            "ember_moe_swiglu_q5_1",
            "ember_moe_geglu_q5_1",
            "ember_moe_swiglu_q8_0",
            "ember_moe_geglu_q8_0",
            "ember_moe_swiglu_q4_k",
            "ember_moe_geglu_q4_k",
            "ember_moe_swiglu_q5_k",
            "ember_moe_geglu_q5_k",
            "ember_moe_swiglu_q6_k",
            "ember_moe_geglu_q6_k",
            "ember_moe_down_q4_0_l16",
            "ember_moe_down_q4_0_l32",
            "ember_moe_down_q4_1_l16",
            "ember_moe_down_q4_1_l32",
            "ember_moe_down_q5_0_l16",
            "ember_moe_down_q5_0_l32",
            "ember_moe_down_q5_1_l16",
            "ember_moe_down_q5_1_l32",
            "ember_moe_down_q8_0_l16",
            "ember_moe_down_q8_0_l32",
            "ember_moe_down_q4_k_l16",
            "ember_moe_down_q4_k_l32",
            "ember_moe_down_q5_k_l16",
            "ember_moe_down_q5_k_l32",
            "ember_moe_down_q6_k_l16",
            "ember_moe_down_q6_k_l32",
            "ember_quantize_act_q8_0",
            "ember_quantize_act_q8_1",
            "ember_quantize_act_q8_k",
            "ember_matvec3_f32_t1",
            "ember_matvec3_f16_t1",
            "ember_matvec3_bf16_t1",
            "ember_matvec_q2_k_t1",
            "ember_matvec_q2_k_t8",
            "ember_matvec_q3_k_t1",
            "ember_matvec_q3_k_t8",
        ],
    },
    ModuleSpec {
        module: KernelModule::Dequantize,
        stem: "dequantize",
        functions: &[
            "ember_dequantize_f16_bf16",
            "ember_dequantize_f16_q4_0",
            "ember_dequantize_f16_q4_1",
            "ember_dequantize_f16_q5_0",
            "ember_dequantize_f16_q5_1",
            "ember_dequantize_f16_q8_0",
            "ember_dequantize_f16_q2_k",
            "ember_dequantize_f16_q3_k",
            "ember_dequantize_f16_q4_k",
            "ember_dequantize_f16_q5_k",
            "ember_dequantize_f16_q6_k",
        ],
    },
    ModuleSpec {
        module: KernelModule::Attention,
        stem: "attention",
        functions: &[
            "ember_kv_store_f16",
            "ember_attention_decode_partial",
            "ember_attention_decode_reduce",
            "ember_attention_prefill_d64",
            "ember_attention_prefill_d128",
            "ember_attention_prefill_d256",
            "ember_attention_prefill_d512",
            "ember_attention_prefill_mma_d64",
            "ember_attention_prefill_mma_d128",
        ],
    },
    ModuleSpec {
        module: KernelModule::Gemm,
        stem: "gemm",
        functions: &[
            "ember_gemm_f32",
            "ember_gemm_f16",
            "ember_gemm_bf16",
            "ember_gemm_q4_0",
            "ember_gemm_q4_1",
            "ember_gemm_q5_0",
            "ember_gemm_q5_1",
            "ember_gemm_q8_0",
            "ember_gemm_q2_k",
            "ember_gemm_q3_k",
            "ember_gemm_q4_k",
            "ember_gemm_q5_k",
            "ember_gemm_q6_k",
        ],
    },
    ModuleSpec {
        module: KernelModule::ExactAttention,
        stem: "exact_attention",
        functions: &["ember_exact_attention", "ember_exact_expf"],
    },
    ModuleSpec {
        module: KernelModule::ExactElementwise,
        stem: "exact_elementwise",
        functions: &[
            "ember_exact_get_rows_f32",
            "ember_exact_get_rows_f16",
            "ember_exact_get_rows_bf16",
            "ember_exact_get_rows_q4_0",
            "ember_exact_get_rows_q4_1",
            "ember_exact_get_rows_q5_0",
            "ember_exact_get_rows_q5_1",
            "ember_exact_get_rows_q8_0",
            "ember_exact_get_rows_q2_k",
            "ember_exact_get_rows_q3_k",
            "ember_exact_get_rows_q4_k",
            "ember_exact_get_rows_q5_k",
            "ember_exact_get_rows_q6_k",
            "ember_exact_rms_norm_f32",
            "ember_exact_add_rms_norm_f32",
            "ember_exact_swiglu_f32",
            "ember_exact_geglu_f32",
            "ember_exact_rope_norm_f32",
            "ember_exact_rope_neox_f32",
        ],
    },
    ModuleSpec {
        module: KernelModule::ExactMatmul,
        stem: "exact_matmul",
        functions: &[
            "ember_exact_quantize_q8_0",
            "ember_exact_quantize_q8_1",
            "ember_exact_quantize_q8_k",
            "ember_exact_round_f16",
            "ember_exact_round_bf16",
            "ember_exact_matmul_f32",
            "ember_exact_matmul_f16",
            "ember_exact_matmul_bf16",
            "ember_exact_matmul_q4_0",
            "ember_exact_matmul_q4_1",
            "ember_exact_matmul_q5_0",
            "ember_exact_matmul_q5_1",
            "ember_exact_matmul_q8_0",
            "ember_exact_matmul_q2_k",
            "ember_exact_matmul_q3_k",
            "ember_exact_matmul_q4_k",
            "ember_exact_matmul_q5_k",
            "ember_exact_matmul_q6_k",
        ],
    },
    ModuleSpec {
        module: KernelModule::Mmq,
        stem: "mmq",
        functions: &[
            "ember_mmq_quantize_q8_0",
            "ember_mmq_quantize_q8_1",
            "ember_mmq_quantize_q8_k",
            "ember_mmq_q4_0_n16",
            "ember_mmq_q4_0_n32",
            "ember_mmq_q4_0_n64",
            "ember_mmq_q4_1_n16",
            "ember_mmq_q4_1_n32",
            "ember_mmq_q4_1_n64",
            "ember_mmq_q5_0_n16",
            "ember_mmq_q5_0_n32",
            "ember_mmq_q5_0_n64",
            "ember_mmq_q5_1_n16",
            "ember_mmq_q5_1_n32",
            "ember_mmq_q5_1_n64",
            "ember_mmq_q8_0_n16",
            "ember_mmq_q8_0_n32",
            "ember_mmq_q8_0_n64",
            "ember_mmq_q4_k_n16",
            "ember_mmq_q4_k_n32",
            "ember_mmq_q4_k_n64",
            "ember_mmq_q5_k_n16",
            "ember_mmq_q5_k_n32",
            "ember_mmq_q5_k_n64",
            "ember_mmq_q6_k_n16",
            "ember_mmq_q6_k_n32",
            "ember_mmq_q6_k_n64",
            "ember_mmq_moe_q4_0_n16",
            "ember_mmq_moe_q4_0_n32",
            "ember_mmq_moe_q4_0_n64",
            "ember_mmq_moe_q4_1_n16",
            "ember_mmq_moe_q4_1_n32",
            "ember_mmq_moe_q4_1_n64",
            "ember_mmq_moe_q5_0_n16",
            "ember_mmq_moe_q5_0_n32",
            "ember_mmq_moe_q5_0_n64",
            "ember_mmq_moe_q5_1_n16",
            "ember_mmq_moe_q5_1_n32",
            "ember_mmq_moe_q5_1_n64",
            "ember_mmq_moe_q8_0_n16",
            "ember_mmq_moe_q8_0_n32",
            "ember_mmq_moe_q8_0_n64",
            "ember_mmq_moe_q4_k_n16",
            "ember_mmq_moe_q4_k_n32",
            "ember_mmq_moe_q4_k_n64",
            "ember_mmq_moe_q5_k_n16",
            "ember_mmq_moe_q5_k_n32",
            "ember_mmq_moe_q5_k_n64",
            "ember_mmq_moe_q6_k_n16",
            "ember_mmq_moe_q6_k_n32",
            "ember_mmq_moe_q6_k_n64",
            "ember_mmq_reduce",
        ],
    },
    ModuleSpec {
        module: KernelModule::Moe,
        stem: "moe",
        functions: &[
            "ember_moe_route_f32",
            "ember_moe_tiles",
            "ember_moe_combine_f32",
            "ember_moe_add_gated_f32",
        ],
    },
    ModuleSpec {
        module: KernelModule::DeltaNet,
        stem: "delta_net",
        functions: &[
            "ember_split_query_gate_f32",
            "ember_mul_sigmoid_f32",
            "ember_delta_net_conv_f32",
            "ember_delta_net_l2_norm_f32",
            "ember_delta_net_rule_hd64_f32",
            "ember_delta_net_rule_hd128_f32",
            "ember_delta_net_rule_any_f32",
            "ember_delta_net_chunked_hd64_f32",
            "ember_delta_net_chunked_hd128_f32",
            "ember_delta_net_gated_norm_f32",
        ],
    },
];

impl KernelModule {
    pub fn spec(self) -> &'static ModuleSpec {
        KERNEL_MODULES
            .iter()
            .find(|spec| spec.module == self)
            .expect("KERNEL_MODULES lists every KernelModule (checked by a test)")
    }

    pub fn stem(self) -> &'static str {
        self.spec().stem
    }
}

/// Kinds of code object, by file extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodeObjectKind {
    Hsaco,
    Cubin,
    Ptx,
}

impl CodeObjectKind {
    pub fn extension(self) -> &'static str {
        match self {
            CodeObjectKind::Hsaco => "hsaco",
            CodeObjectKind::Cubin => "cubin",
            CodeObjectKind::Ptx => "ptx",
        }
    }
}

#[derive(Debug, Error)]
pub enum KernelError {
    #[error("no {module} kernels for architecture {arch} in {dir}: this build has {}; a build for {} would serve it (cargo xtask build --target {arch})", list_or_none(.available), .would_serve.join(" or "))]
    NoCodeObject {
        arch: String,
        module: &'static str,
        dir: PathBuf,
        available: Vec<String>,
        would_serve: Vec<String>,
    },
    #[error("reading code object {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("module {module} has no function {name}: expected one of {}", .expected.join(", "))]
    UnknownFunction {
        module: &'static str,
        name: String,
        expected: Vec<&'static str>,
    },
    #[error("loading {what} on device {device}: {source}")]
    Driver {
        device: DeviceOrdinal,
        what: String,
        source: DriverError,
    },
}

fn list_or_none(items: &[String]) -> String {
    if items.is_empty() {
        "no kernels at all".to_string()
    } else {
        items.join(", ")
    }
}

/// The architecture name code objects are selected by: `gfx1201` from
/// `gfx1201:sramecc-:xnack-`, `sm_90` from `sm_90` or `SM_90`.
pub fn normalize_arch(raw: &str) -> String {
    let base = raw
        .trim()
        .split(':')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if let Some(digits) = base.strip_prefix("sm") {
        let digits = digits.trim_start_matches('_');
        return format!("sm_{digits}");
    }
    base
}

/// The architecture name of an NVIDIA device with compute capability `major.minor`.
pub fn cuda_arch(major: i32, minor: i32) -> String {
    format!("sm_{major}{minor}")
}

/// Parses `sm_XY` (or `sm_XYa`) into (major, minor).
fn parse_sm(arch: &str) -> Option<(u32, u32)> {
    let digits = arch
        .strip_prefix("sm_")?
        .trim_end_matches(|c: char| c.is_ascii_alphabetic());
    if digits.len() < 2 {
        return None;
    }
    let (major, minor) = digits.split_at(digits.len() - 1);
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// The build targets whose code objects would run on `arch`, best first.
pub fn serving_builds(arch: &str) -> Vec<String> {
    // gfx code objects run only on their own target. On NVIDIA a build for the exact sm_XY is
    // the one to make (older cubins of the same major and older PTX are found by
    // `find_code_object` when present).
    vec![arch.to_string()]
}

/// Architectures present in a kernels directory (its subdirectory names), sorted.
pub fn available_archs(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut archs: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|name| name.starts_with("gfx") || name.starts_with("sm_"))
        .collect();
    archs.sort();
    archs
}

/// Finds the code object of `module` for `arch` in `dir`.
///
/// AMD: `<arch>/<stem>.hsaco` exactly (gfx code objects are not portable across targets).
/// NVIDIA: `<arch>/<stem>.cubin`, else `<arch>/<stem>.ptx`, else a cubin of the same major
/// version and a lower minor, else the PTX of the highest earlier architecture.
pub fn find_code_object(
    dir: &Path,
    arch: &str,
    module: KernelModule,
) -> Result<(PathBuf, CodeObjectKind), KernelError> {
    let stem = module.stem();
    let candidate = |a: &str, kind: CodeObjectKind| {
        let path = dir.join(a).join(format!("{stem}.{}", kind.extension()));
        path.is_file().then_some((path, kind))
    };
    if let Some((major, minor)) = parse_sm(arch) {
        if let Some(found) =
            candidate(arch, CodeObjectKind::Cubin).or_else(|| candidate(arch, CodeObjectKind::Ptx))
        {
            return Ok(found);
        }
        let mut others: Vec<(u32, u32, String)> = available_archs(dir)
            .into_iter()
            .filter_map(|a| parse_sm(&a).map(|(ma, mi)| (ma, mi, a)))
            .filter(|&(ma, mi, _)| (ma, mi) <= (major, minor))
            .collect();
        others.sort();
        for (ma, _, other) in others.iter().rev() {
            if *ma == major {
                if let Some(found) = candidate(other, CodeObjectKind::Cubin) {
                    return Ok(found);
                }
            }
        }
        for (_, _, other) in others.iter().rev() {
            if let Some(found) = candidate(other, CodeObjectKind::Ptx) {
                return Ok(found);
            }
        }
    } else if let Some(found) = candidate(arch, CodeObjectKind::Hsaco) {
        return Ok(found);
    }
    Err(KernelError::NoCodeObject {
        arch: arch.to_string(),
        module: stem,
        dir: dir.to_path_buf(),
        available: available_archs(dir),
        would_serve: serving_builds(arch),
    })
}

/// The kernels directory: `EMBER_KERNELS_DIR`, else `kernels/` beside the running binary.
pub fn default_kernels_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(KERNELS_DIR_ENV) {
        return PathBuf::from(dir);
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|p| p.join("kernels")))
        .unwrap_or_else(|| PathBuf::from("kernels"))
}

/// Loads kernel modules on first use and caches modules and functions per device. One library
/// serves one driver (handles are only meaningful to the driver that made them).
#[derive(Debug)]
pub struct KernelLibrary {
    dir: PathBuf,
    /// Each device's architecture name, asked of the driver once.
    archs: Mutex<HashMap<DeviceOrdinal, String>>,
    modules: Mutex<HashMap<(DeviceOrdinal, KernelModule), ModuleHandle>>,
    functions: Mutex<HashMap<(DeviceOrdinal, &'static str), FunctionHandle>>,
}

impl KernelLibrary {
    pub fn new(dir: PathBuf) -> KernelLibrary {
        KernelLibrary {
            dir,
            archs: Mutex::new(HashMap::new()),
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The architecture name code objects are selected by for `device`.
    pub fn arch(&self, driver: &dyn Driver, device: DeviceOrdinal) -> Result<String, KernelError> {
        let mut archs = self.archs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(arch) = archs.get(&device) {
            return Ok(arch.clone());
        }
        let info = driver
            .device_info(device)
            .map_err(|source| KernelError::Driver {
                device,
                what: "the device's architecture".to_string(),
                source,
            })?;
        archs.insert(device, info.arch.clone());
        Ok(info.arch)
    }

    /// The function `name` of `module` on `device`, loading the module on first use.
    pub fn function(
        &self,
        driver: &dyn Driver,
        device: DeviceOrdinal,
        module: KernelModule,
        name: &str,
    ) -> Result<FunctionHandle, KernelError> {
        let spec = module.spec();
        let Some(&name) = spec.functions.iter().find(|&&f| f == name) else {
            return Err(KernelError::UnknownFunction {
                module: spec.stem,
                name: name.to_string(),
                expected: spec.functions.to_vec(),
            });
        };
        let mut functions = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&function) = functions.get(&(device, name)) {
            return Ok(function);
        }
        let module_handle = self.module(driver, device, module)?;
        let function = driver
            .module_function(device, module_handle, name)
            .map_err(|source| KernelError::Driver {
                device,
                what: format!("function {name} of module {}", spec.stem),
                source,
            })?;
        functions.insert((device, name), function);
        Ok(function)
    }

    fn module(
        &self,
        driver: &dyn Driver,
        device: DeviceOrdinal,
        module: KernelModule,
    ) -> Result<ModuleHandle, KernelError> {
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&handle) = modules.get(&(device, module)) {
            return Ok(handle);
        }
        let arch = self.arch(driver, device)?;
        let arch = arch.as_str();
        let (path, kind) = find_code_object(&self.dir, arch, module)?;
        let mut image = std::fs::read(&path).map_err(|source| KernelError::Read {
            path: path.clone(),
            source,
        })?;
        if kind == CodeObjectKind::Ptx {
            // PTX is loaded as a NUL-terminated string.
            image.push(0);
        }
        let handle = driver
            .module_load(device, &image)
            .map_err(|source| KernelError::Driver {
                device,
                what: format!("code object {}", path.display()),
                source,
            })?;
        tracing::debug!(device, path = %path.display(), "loaded kernel module");
        modules.insert((device, module), handle);
        Ok(handle)
    }

    /// Fills `count` u32 words at `ptr` with `value` using `ember_fill_u32` (the VMM probe's touch).
    pub fn fill_u32(
        &self,
        driver: &dyn Driver,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        count: u64,
        value: u32,
        stream: StreamHandle,
    ) -> Result<(), KernelError> {
        let function = self.function(driver, device, KernelModule::Memory, "ember_fill_u32")?;
        let args = KernelArgs::new()
            .arg(KernelArg::Ptr(ptr))
            .arg(KernelArg::U32(value))
            .arg(KernelArg::U64(count));
        let threads = 256u64;
        let blocks = count.div_ceil(threads).clamp(1, 65_535) as u32;
        // SAFETY: ember_fill_u32(uint32_t*, uint32_t, uint64_t) matches the arguments, and the
        // kernel only writes `count` words from `ptr` (grid-stride loop), which the caller owns.
        unsafe {
            driver.launch(
                device,
                function,
                &LaunchConfig::linear(blocks, threads as u32),
                stream,
                &args,
            )
        }
        .map_err(|source| KernelError::Driver {
            device,
            what: "launching ember_fill_u32".to_string(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_normalize(raw: &str, expected: &str) {
        assert_eq!(normalize_arch(raw), expected, "normalising {raw:?}");
    }

    #[test]
    fn architecture_names_are_normalised() {
        check_normalize("gfx1201:sramecc-:xnack-", "gfx1201");
        check_normalize("gfx90a:sramecc+:xnack-", "gfx90a");
        check_normalize(" gfx1151 ", "gfx1151");
        check_normalize("GFX1100", "gfx1100");
        check_normalize("sm_90", "sm_90");
        check_normalize("SM90", "sm_90");
        assert_eq!(cuda_arch(9, 0), "sm_90");
        assert_eq!(cuda_arch(12, 0), "sm_120");
        assert_eq!(parse_sm("sm_120"), Some((12, 0)));
        assert_eq!(parse_sm("sm_90a"), Some((9, 0)));
    }

    #[test]
    fn every_module_has_a_spec_and_unique_functions() {
        let mut seen = std::collections::HashSet::new();
        for module in [
            KernelModule::Memory,
            KernelModule::Elementwise,
            KernelModule::Norm,
            KernelModule::Rope,
            KernelModule::Softmax,
            KernelModule::Embedding,
            KernelModule::Argmax,
            KernelModule::MatVec,
            KernelModule::Dequantize,
            KernelModule::Attention,
            KernelModule::Gemm,
            KernelModule::ExactMatmul,
            KernelModule::Mmq,
            KernelModule::Moe,
            KernelModule::DeltaNet,
        ] {
            for f in module.spec().functions {
                assert!(seen.insert(*f), "{f} listed twice");
            }
        }
    }

    #[test]
    fn kernel_sources_export_every_listed_function() {
        let kernels = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels");
        for spec in KERNEL_MODULES {
            let path = kernels.join(format!("{}.hip", spec.stem));
            let source = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            for f in spec.functions {
                // Defined directly (`name(`) or through an instantiation macro (`MACRO(name, ...)`).
                let defined =
                    source.contains(&format!("{f}(")) || source.contains(&format!("({f},"));
                assert!(defined, "{} does not define {f}", path.display());
            }
        }
    }

    #[test]
    fn every_kernel_in_the_sources_is_in_the_table() {
        let kernels = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels");
        for spec in KERNEL_MODULES {
            let path = kernels.join(format!("{}.hip", spec.stem));
            let source = std::fs::read_to_string(&path).unwrap();
            // Exported names: `EMBER_KERNEL void name(` and instantiation macros `EMBER_X(name, ...)`.
            let mut exported = Vec::new();
            for line in source.lines() {
                if let Some(rest) = line.strip_prefix("EMBER_KERNEL void ") {
                    exported.push(rest.split('(').next().unwrap().trim().to_string());
                } else if let Some((macro_name, args)) = line.split_once('(') {
                    let is_macro = macro_name.starts_with("EMBER_")
                        && macro_name
                            .chars()
                            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
                    if is_macro && args.starts_with("ember_") {
                        exported.push(args.split(',').next().unwrap().trim().to_string());
                    }
                }
            }
            exported.sort();
            let mut listed: Vec<String> = spec.functions.iter().map(|f| f.to_string()).collect();
            listed.sort();
            assert_eq!(
                exported,
                listed,
                "{} exports differ from KERNEL_MODULES",
                path.display()
            );
        }
    }

    fn touch(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"code").unwrap();
    }

    #[test]
    fn code_objects_are_selected_by_architecture() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        touch(&root.join("gfx1100/norm.hsaco"));
        touch(&root.join("gfx90a/norm.hsaco"));
        touch(&root.join("sm_80/norm.cubin"));
        touch(&root.join("sm_80/norm.ptx"));
        touch(&root.join("sm_90/rope.cubin"));

        let (path, kind) = find_code_object(root, "gfx1100", KernelModule::Norm).unwrap();
        assert_eq!(
            (path, kind),
            (root.join("gfx1100/norm.hsaco"), CodeObjectKind::Hsaco)
        );
        // sm_86 runs the sm_80 cubin (same major, lower minor).
        assert_eq!(
            find_code_object(root, "sm_86", KernelModule::Norm)
                .unwrap()
                .0,
            root.join("sm_80/norm.cubin")
        );
        // sm_90 has no norm cubin of its own and a different major: the sm_80 PTX is JIT-compiled.
        assert_eq!(
            find_code_object(root, "sm_90", KernelModule::Norm).unwrap(),
            (root.join("sm_80/norm.ptx"), CodeObjectKind::Ptx)
        );
        assert_eq!(
            find_code_object(root, "sm_90", KernelModule::Rope)
                .unwrap()
                .1,
            CodeObjectKind::Cubin
        );
    }

    #[test]
    fn missing_architecture_error_names_it_and_the_builds_present() {
        let dir = tempfile::tempdir().unwrap();
        touch(&dir.path().join("gfx1100/norm.hsaco"));
        touch(&dir.path().join("gfx90a/norm.hsaco"));
        let error = find_code_object(dir.path(), "gfx1201", KernelModule::Norm).unwrap_err();
        let text = error.to_string();
        assert!(text.contains("architecture gfx1201"), "{text}");
        assert!(text.contains("this build has gfx1100, gfx90a"), "{text}");
        assert!(
            text.contains("cargo xtask build --target gfx1201"),
            "{text}"
        );
        // gfx code objects never substitute for one another, even within a family.
        assert!(find_code_object(dir.path(), "gfx1101", KernelModule::Norm).is_err());
        let empty = tempfile::tempdir().unwrap();
        let text = find_code_object(empty.path(), "sm_90", KernelModule::Norm)
            .unwrap_err()
            .to_string();
        assert!(text.contains("this build has no kernels at all"), "{text}");
    }

    #[cfg(unix)]
    #[test]
    fn library_loads_a_module_once_per_device_and_rejects_unknown_functions() {
        use crate::host::{HostDriver, HostDriverConfig};
        let dir = tempfile::tempdir().unwrap();
        touch(&dir.path().join("gfx1100/memory.hsaco"));
        let driver = HostDriver::new(HostDriverConfig {
            arch: "gfx1100:sramecc-:xnack-".to_string(),
            ..HostDriverConfig::default()
        });
        driver.register_kernel("ember_fill_u32", |launch| {
            let ptr = launch.ptr_arg(0)?;
            let value = launch.u32_arg(1)?;
            let count = match launch.args().get(2) {
                Some(KernelArg::U64(c)) => *c as usize,
                other => return Err(format!("argument 2: expected a u64, found {other:?}")),
            };
            let bytes: Vec<u8> = std::iter::repeat_n(value.to_le_bytes(), count)
                .flatten()
                .collect();
            launch.write(ptr, &bytes)
        });
        let library = KernelLibrary::new(dir.path().to_path_buf());
        let a = library
            .function(&driver, 0, KernelModule::Memory, "ember_fill_u32")
            .unwrap();
        let b = library
            .function(&driver, 0, KernelModule::Memory, "ember_fill_u32")
            .unwrap();
        assert_eq!(a, b);
        assert_eq!(library.modules.lock().unwrap().len(), 1);
        let error = library
            .function(&driver, 0, KernelModule::Memory, "ember_nope")
            .unwrap_err();
        assert!(
            error.to_string().contains("expected one of ember_fill_u32"),
            "{error}"
        );

        let ptr = driver.alloc(0, 64).unwrap();
        library
            .fill_u32(&driver, 0, ptr, 16, 0xdead_beef, StreamHandle::DEFAULT)
            .unwrap();
        let mut back = [0u8; 64];
        driver
            .download(0, &mut back, ptr, StreamHandle::DEFAULT)
            .unwrap();
        assert!(back
            .chunks_exact(4)
            .all(|w| w == 0xdead_beefu32.to_le_bytes()));
    }
}
