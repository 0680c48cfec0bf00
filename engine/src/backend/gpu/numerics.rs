//! The GPU backend's numerics modes: `fast` (the default: the tuned kernels, fused decode
//! kernels and decode graphs, rounding as suits the GPU) and `reference` (every op bit-exact:
//! the GPU context's `ember_gpu::ops::Numerics` makes each op's wrapper pick its exact kernel,
//! so the logits equal the CPU backend's bit for bit and greedy generations match llama.cpp's
//! reference outputs token for token).
//!
//! Reference mode turns the fused kernels and decode graphs off (each op runs on its own, as
//! the CPU runs it) and computes on the host what the CPU takes from libm, with the CPU's own
//! code: the rotary cosines and sines of each batch ([`rope_cos_sin`]) and the f16 GELU table
//! ([`gelu_table`]), which the device then reads. What has no exact kernel is refused when the
//! model is loaded ([`reference_unsupported`]): Gemma 2's final logit soft-capping (glibc's
//! `tanhf` on the CPU, which differs between glibc releases and has no device port here), and
//! the linear-attention layers of Qwen 3.5 / 3.6 ([`reference_unsupported_recurrent`]).
//!
//! The CPU attention's split-KV path (a single token over 512 or more cached positions) cuts the
//! cache into one chunk per CPU thread, so the CPU's thread count shows in its digits; the
//! reference mode is told which count to reproduce: `EMBER_REFERENCE_THREADS`, default 2, the
//! thread count of llama.cpp's reference runs (and of `top_logprobs`' default). A comparison
//! with the CPU backend must run the CPU with that many threads (`--device cpu -t 2`).
//!
//! Selection: `--numerics fast|reference` on `ember run`, `bench`, `perplexity` (and `stress`),
//! else `EMBER_GPU_NUMERICS`, else `fast`.

use std::fmt;
use std::str::FromStr;

/// Environment variable choosing the numerics mode when no `--numerics` flag does: `fast` or
/// `reference`.
pub const NUMERICS_ENV: &str = "EMBER_GPU_NUMERICS";

/// Environment variable: the CPU thread count whose split-KV attention the reference mode
/// reproduces (see the module docs).
pub const REFERENCE_THREADS_ENV: &str = "EMBER_REFERENCE_THREADS";

/// The reference thread count when [`REFERENCE_THREADS_ENV`] is not set: llama.cpp's reference
/// outputs were made with 2 threads.
pub const DEFAULT_REFERENCE_THREADS: usize = 2;

/// How the GPU backend rounds. See the module docs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Numerics {
    /// The tuned kernels (the default).
    #[default]
    Fast,
    /// Every op bit-identical to the CPU backend's.
    Reference,
}

impl Numerics {
    pub const ALL: [Numerics; 2] = [Numerics::Fast, Numerics::Reference];

    /// The name the flag and the environment variable take.
    pub fn name(self) -> &'static str {
        match self {
            Numerics::Fast => "fast",
            Numerics::Reference => "reference",
        }
    }

    /// The mode [`NUMERICS_ENV`] names, `fast` when it is unset or empty.
    pub fn from_env() -> Result<Numerics, NumericsError> {
        Numerics::from_env_value(std::env::var(NUMERICS_ENV).ok().as_deref())
    }

    /// [`Numerics::from_env`] for a given value of the variable (`None`: unset).
    pub fn from_env_value(value: Option<&str>) -> Result<Numerics, NumericsError> {
        match value.map(str::trim) {
            None | Some("") => Ok(Numerics::Fast),
            Some(text) => parse(NUMERICS_ENV, text),
        }
    }

    /// The mode to run in: the flag's when given, else the environment's.
    pub fn resolve(flag: Option<Numerics>) -> Result<Numerics, NumericsError> {
        match flag {
            Some(numerics) => Ok(numerics),
            None => Numerics::from_env(),
        }
    }
}

impl fmt::Display for Numerics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Numerics {
    type Err = NumericsError;

    fn from_str(text: &str) -> Result<Numerics, NumericsError> {
        parse("--numerics", text)
    }
}

fn parse(source_name: &'static str, text: &str) -> Result<Numerics, NumericsError> {
    let wanted = text.trim().to_ascii_lowercase();
    Numerics::ALL
        .into_iter()
        .find(|n| n.name() == wanted)
        .ok_or_else(|| NumericsError::UnknownMode {
            source_name,
            found: text.to_string(),
        })
}

/// A numerics setting that could not be used; the message says what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NumericsError {
    /// A flag or environment value that names no mode.
    #[error("{source_name}: expected fast or reference, found {found:?}")]
    UnknownMode {
        source_name: &'static str,
        found: String,
    },
    /// [`REFERENCE_THREADS_ENV`] is not a positive count.
    #[error("{REFERENCE_THREADS_ENV}: expected a thread count of at least 1, found {found:?}")]
    BadThreads { found: String },
    /// The model needs an op the reference mode has no exact kernel for.
    #[error("reference numerics cannot run this model: {reason}; use --numerics fast, or --device cpu for the reference results")]
    Unsupported { reason: String },
}

/// The reference thread count [`REFERENCE_THREADS_ENV`] names, [`DEFAULT_REFERENCE_THREADS`]
/// when it is unset or empty.
pub fn reference_threads_from_env() -> Result<usize, NumericsError> {
    reference_threads_from_value(std::env::var(REFERENCE_THREADS_ENV).ok().as_deref())
}

/// [`reference_threads_from_env`] for a given value of the variable (`None`: unset).
pub fn reference_threads_from_value(value: Option<&str>) -> Result<usize, NumericsError> {
    match value.map(str::trim) {
        None | Some("") => Ok(DEFAULT_REFERENCE_THREADS),
        Some(text) => match text.parse::<usize>() {
            Ok(n) if n >= 1 => Ok(n),
            _ => Err(NumericsError::BadThreads {
                found: text.to_string(),
            }),
        },
    }
}

/// Why the reference mode cannot run a model whose attention heads have `head_dim` values and
/// whose logits are soft-capped at `final_logit_softcap` (if they are), if it cannot.
pub fn reference_unsupported(
    head_dim: usize,
    final_logit_softcap: Option<f32>,
) -> Option<NumericsError> {
    if let Some(cap) = final_logit_softcap {
        return Some(NumericsError::Unsupported {
            reason: format!(
                "the model soft-caps its logits (final_logit_softcapping = {cap}), and the CPU's tanhf (glibc) has no bit-exact device kernel"
            ),
        });
    }
    if head_dim > ember_gpu::ops::EXACT_MAX_HEAD_DIM {
        return Some(NumericsError::Unsupported {
            reason: format!(
                "the exact attention handles heads of at most {} values, and this model's have {head_dim}",
                ember_gpu::ops::EXACT_MAX_HEAD_DIM
            ),
        });
    }
    None
}

/// Why the reference mode cannot run a model with linear-attention layers (Qwen 3.5's Gated
/// DeltaNet), or `None` for a model without them: the delta-net kernels round as suits the GPU
/// and have no bit-exact twins.
pub fn reference_unsupported_recurrent(has_recurrent_state: bool) -> Option<NumericsError> {
    has_recurrent_state.then(|| NumericsError::Unsupported {
        reason: "the model has linear-attention (Gated DeltaNet) layers, which have no bit-exact device kernels".into(),
    })
}

// The host-side values the reference mode uploads are the CPU backend's own: the f16 GELU table
// and the rotary cosines and sines, computed by the same functions.
pub use crate::backend::cpu::{gelu_table, rope_cos_sin};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::RopeParams;

    #[test]
    fn modes_parse_from_the_flag_and_the_environment() {
        assert_eq!("fast".parse(), Ok(Numerics::Fast));
        assert_eq!(" Reference ".parse(), Ok(Numerics::Reference));
        assert_eq!(
            "exact".parse::<Numerics>().unwrap_err().to_string(),
            "--numerics: expected fast or reference, found \"exact\""
        );
        assert_eq!(Numerics::from_env_value(None), Ok(Numerics::Fast));
        assert_eq!(Numerics::from_env_value(Some(" ")), Ok(Numerics::Fast));
        assert_eq!(
            Numerics::from_env_value(Some("reference")),
            Ok(Numerics::Reference)
        );
        assert_eq!(
            Numerics::from_env_value(Some("ref"))
                .unwrap_err()
                .to_string(),
            "EMBER_GPU_NUMERICS: expected fast or reference, found \"ref\""
        );
        for mode in Numerics::ALL {
            assert_eq!(mode.name().parse(), Ok(mode));
            assert_eq!(mode.to_string(), mode.name());
            // A flag wins over whatever the environment says.
            assert_eq!(Numerics::resolve(Some(mode)), Ok(mode));
        }
        assert_eq!(Numerics::default(), Numerics::Fast);
    }

    #[test]
    fn reference_threads_default_to_two() {
        assert_eq!(reference_threads_from_value(None), Ok(2));
        assert_eq!(reference_threads_from_value(Some("")), Ok(2));
        assert_eq!(reference_threads_from_value(Some(" 8 ")), Ok(8));
        for bad in ["0", "-1", "two", "1.5"] {
            assert_eq!(
                reference_threads_from_value(Some(bad))
                    .unwrap_err()
                    .to_string(),
                format!(
                    "EMBER_REFERENCE_THREADS: expected a thread count of at least 1, found {bad:?}"
                )
            );
        }
    }

    #[test]
    fn reference_numerics_refuse_what_has_no_exact_kernel() {
        assert_eq!(reference_unsupported(64, None), None);
        assert_eq!(reference_unsupported(256, None), None);
        let error = reference_unsupported(64, Some(30.0)).expect("refused");
        assert_eq!(
            error.to_string(),
            "reference numerics cannot run this model: the model soft-caps its logits (final_logit_softcapping = 30), and the CPU's tanhf (glibc) has no bit-exact device kernel; use --numerics fast, or --device cpu for the reference results"
        );
        assert_eq!(reference_unsupported_recurrent(false), None);
        let error = reference_unsupported_recurrent(true).expect("refused");
        assert!(
            error
                .to_string()
                .contains("linear-attention (Gated DeltaNet) layers, which have no bit-exact"),
            "{error}"
        );
        let error = reference_unsupported(512, None).expect("refused");
        assert!(
            error
                .to_string()
                .contains("at most 256 values, and this model's have 512"),
            "{error}"
        );
    }

    #[test]
    fn rope_table_rows_hold_cosine_then_sine_per_pair() {
        let params = RopeParams {
            n_dims: 4,
            freq_base: 10000.0,
            freq_scale: 1.0,
            freq_factors: None,
        };
        let mut out = Vec::new();
        rope_cos_sin(&[0, 3], &params, &mut out);
        assert_eq!(out.len(), 8);
        assert_eq!(
            &out[..4],
            &[1.0, 0.0, 1.0, 0.0],
            "position 0 turns by nothing"
        );
        assert_eq!(out[4], 3.0f32.cos());
        assert_eq!(out[5], 3.0f32.sin());
        let theta = 3.0 * 10000f32.powf(-0.5);
        assert_eq!(out[6], theta.cos());
        assert_eq!(out[7], theta.sin());
    }
}
