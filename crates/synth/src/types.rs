//! Which GGML type each tensor gets: a uniform type, or llama-quantize's Q4_K_M mix, with
//! llama-quantize's rules for the output projection and for rows that are not whole blocks.

use ember_gguf::GgmlType;

/// The `--type` of a synthetic model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TypeSpec {
    /// One base type for the matrices (see [`Plan`] for the exceptions).
    Uniform(GgmlType),
    /// llama-quantize's `Q4_K_M`: Q4_K with Q6_K where the rule below asks for more bits.
    Q4KM,
}

/// The accepted `--type` names, in the order `--help` lists them.
pub const TYPE_NAMES: [&str; 14] = [
    "f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k",
    "q6_k", "q4_k_m",
];

impl TypeSpec {
    /// Parses one of [`TYPE_NAMES`], case-insensitively.
    pub fn parse(name: &str) -> Option<TypeSpec> {
        let lower = name.to_ascii_lowercase();
        if lower == "q4_k_m" {
            return Some(TypeSpec::Q4KM);
        }
        if !TYPE_NAMES.contains(&lower.as_str()) {
            return None;
        }
        GgmlType::from_name(&lower).map(TypeSpec::Uniform)
    }

    /// The name as [`TYPE_NAMES`] spells it.
    pub fn name(self) -> String {
        match self {
            TypeSpec::Uniform(ty) => ty.name().to_ascii_lowercase(),
            TypeSpec::Q4KM => "q4_k_m".to_string(),
        }
    }

    /// The type of the matrices no rule singles out.
    pub fn base(self) -> GgmlType {
        match self {
            TypeSpec::Uniform(ty) => ty,
            TypeSpec::Q4KM => GgmlType::Q4_K,
        }
    }

    /// `general.file_type`: llama.cpp's `llama_ftype` for this mix (uniform K-quants are
    /// reported as their `_S` variant, the nearest llama.cpp names).
    pub fn file_type(self) -> u32 {
        use GgmlType::*;
        match self {
            TypeSpec::Q4KM => 15,
            TypeSpec::Uniform(ty) => match ty {
                F32 => 0,
                F16 => 1,
                Q4_0 => 2,
                Q4_1 => 3,
                Q8_0 => 7,
                Q5_0 => 8,
                Q5_1 => 9,
                Q2_K => 10,
                Q3_K => 11,
                Q4_K => 14,
                Q5_K => 16,
                Q6_K => 18,
                BF16 => 32,
                // parse() admits no other type.
                _ => 0,
            },
        }
    }
}

/// What a matrix is, for the rules that depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    TokenEmbd,
    Output,
    AttnQ,
    AttnK,
    AttnV,
    AttnOutput,
    FfnGate,
    FfnUp,
    FfnDown,
}

/// The type of every matrix of one model.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub spec: TypeSpec,
    /// Every matrix in the base type, as `llama-quantize --pure` (only the block-size fallback
    /// still applies). Consistency tests use it so that each type is exercised everywhere.
    pub pure: bool,
    pub tied_embeddings: bool,
    pub n_layer: usize,
}

/// llama-quantize's choice of layers that get more bits in the `_M` mixes: the first and last
/// eighth of the layers and every third layer between.
pub fn use_more_bits(layer: usize, n_layer: usize) -> bool {
    let (i, n) = (layer as i64, n_layer as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

impl Plan {
    /// The type of the matrix `role` of layer `layer` (ignored for embeddings and output) whose
    /// rows have `cols` elements.
    ///
    /// The rules follow `llama_tensor_get_type` in llama.cpp's `src/llama-quant.cpp` (read in
    /// mid-2026):
    /// - the output projection (or the token embeddings when they are tied to it) becomes Q6_K
    ///   for every quantized type except Q8_0, and Q8_0 when its rows are not whole blocks of
    ///   the base type;
    /// - for Q4_K_M, `attn_v` and `ffn_down` become Q6_K in the layers [`use_more_bits`]
    ///   selects; everything else (token embeddings of untied models included) is Q4_K;
    /// - a type whose block does not divide the row falls back: Q4_K to Q5_0, Q5_K to Q5_1,
    ///   Q6_K to Q8_0, and Q2_K and Q3_K to Q4_0 (llama.cpp uses IQ4_NL there, which has the
    ///   same 4.5 bits per weight but no kernels in ember); F16 when even that does not divide.
    ///
    /// Float types (F32, F16, BF16) are used as they are for every matrix.
    pub fn tensor_type(&self, role: Role, layer: usize, cols: usize) -> GgmlType {
        let base = self.spec.base();
        if !base.is_quantized() {
            return base;
        }
        let chosen = if self.pure {
            base
        } else {
            let is_output =
                role == Role::Output || (self.tied_embeddings && role == Role::TokenEmbd);
            if is_output {
                if !cols.is_multiple_of(base.block_size()) {
                    GgmlType::Q8_0
                } else if base != GgmlType::Q8_0 {
                    GgmlType::Q6_K
                } else {
                    base
                }
            } else if self.spec == TypeSpec::Q4KM
                && matches!(role, Role::AttnV | Role::FfnDown)
                && use_more_bits(layer, self.n_layer)
            {
                GgmlType::Q6_K
            } else {
                base
            }
        };
        fallback(chosen, cols)
    }
}

/// The block-size fallback of llama-quantize (see [`Plan::tensor_type`]).
fn fallback(ty: GgmlType, cols: usize) -> GgmlType {
    if cols.is_multiple_of(ty.block_size()) {
        return ty;
    }
    let next = match ty {
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::Q4_0,
        _ => GgmlType::F16,
    };
    if cols.is_multiple_of(next.block_size()) {
        next
    } else {
        GgmlType::F16
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use GgmlType::*;

    fn plan(spec: &str, pure: bool, tied: bool, n_layer: usize) -> Plan {
        Plan {
            spec: TypeSpec::parse(spec).unwrap(),
            pure,
            tied_embeddings: tied,
            n_layer,
        }
    }

    #[test]
    fn names_round_trip() {
        for name in TYPE_NAMES {
            assert_eq!(TypeSpec::parse(name).unwrap().name(), name);
        }
        assert_eq!(TypeSpec::parse("Q4_K_M"), Some(TypeSpec::Q4KM));
        assert_eq!(TypeSpec::parse("iq4_nl"), None);
        assert_eq!(TypeSpec::parse("q8_1"), None);
    }

    #[test]
    fn more_bits_layers_of_a_32_layer_model() {
        let chosen: Vec<usize> = (0..32).filter(|&l| use_more_bits(l, 32)).collect();
        assert_eq!(
            chosen,
            [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
        );
    }

    #[test]
    fn q4_k_m_of_llama3_8b() {
        let p = plan("q4_k_m", false, false, 32);
        assert_eq!(p.tensor_type(Role::Output, 0, 4096), Q6_K);
        assert_eq!(p.tensor_type(Role::TokenEmbd, 0, 4096), Q4_K);
        assert_eq!(p.tensor_type(Role::AttnV, 0, 4096), Q6_K);
        assert_eq!(p.tensor_type(Role::AttnV, 4, 4096), Q4_K);
        assert_eq!(p.tensor_type(Role::AttnV, 6, 4096), Q6_K);
        assert_eq!(p.tensor_type(Role::FfnDown, 5, 14336), Q4_K);
        assert_eq!(p.tensor_type(Role::FfnDown, 31, 14336), Q6_K);
        assert_eq!(p.tensor_type(Role::AttnQ, 0, 4096), Q4_K);
        assert_eq!(p.tensor_type(Role::FfnGate, 0, 4096), Q4_K);
    }

    #[test]
    fn gemma3_270m_q4_k_m_matches_the_published_file() {
        // gemma-3-270m-q4_k_m.gguf: token_embd Q8_0, attn_q Q5_0, attn_v Q8_0 in layer 0,
        // attn_output Q4_K, ffn_down Q6_K in layer 0, ffn_gate Q5_0.
        let p = plan("q4_k_m", false, true, 18);
        assert_eq!(p.tensor_type(Role::TokenEmbd, 0, 640), Q8_0);
        assert_eq!(p.tensor_type(Role::AttnQ, 0, 640), Q5_0);
        assert_eq!(p.tensor_type(Role::AttnV, 0, 640), Q8_0);
        assert_eq!(p.tensor_type(Role::AttnOutput, 0, 1024), Q4_K);
        assert_eq!(p.tensor_type(Role::FfnDown, 0, 2048), Q6_K);
        assert_eq!(p.tensor_type(Role::FfnGate, 0, 640), Q5_0);
    }

    #[test]
    fn plain_types_put_the_output_in_q6_k_unless_pure() {
        let p = plan("q4_0", false, false, 32);
        assert_eq!(p.tensor_type(Role::Output, 0, 4096), Q6_K);
        assert_eq!(p.tensor_type(Role::TokenEmbd, 0, 4096), Q4_0);
        assert_eq!(p.tensor_type(Role::FfnDown, 0, 14336), Q4_0);
        // SmolLM2's tied table of 576 columns: Q6_K does not fit, so Q8_0 (as the real file).
        let p = plan("q4_1", false, true, 30);
        assert_eq!(p.tensor_type(Role::TokenEmbd, 0, 576), Q8_0);
        let p = plan("q8_0", false, false, 32);
        assert_eq!(p.tensor_type(Role::Output, 0, 4096), Q8_0);
        let p = plan("q4_0", true, true, 30);
        assert_eq!(p.tensor_type(Role::TokenEmbd, 0, 576), Q4_0);
        let p = plan("f16", false, false, 32);
        assert_eq!(p.tensor_type(Role::Output, 0, 4096), F16);
    }

    #[test]
    fn rows_that_are_not_whole_blocks_fall_back() {
        let pure = |spec: &str, cols| plan(spec, true, false, 4).tensor_type(Role::AttnQ, 0, cols);
        assert_eq!(pure("q2_k", 576), Q4_0);
        assert_eq!(pure("q3_k", 576), Q4_0);
        assert_eq!(pure("q4_k", 576), Q5_0);
        assert_eq!(pure("q5_k", 576), Q5_1);
        assert_eq!(pure("q6_k", 576), Q8_0);
        assert_eq!(pure("q6_k", 48), F16);
        assert_eq!(pure("q4_0", 48), F16);
        assert_eq!(pure("q6_k", 512), Q6_K);
    }
}
