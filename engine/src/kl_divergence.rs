//! KL divergence of a model's token distributions against a base run, from llama-perplexity's
//! base-logits file (`llama-perplexity --kl-divergence-base FILE` without `--kl-divergence`
//! writes one), so that ember's fast paths are measured against llama.cpp's, or one ember run
//! against another, on exactly the same tokens.
//!
//! The file (as llama.cpp's perplexity tool writes it): the 8 bytes `_logits_`, then
//! little-endian `u32 n_ctx`, `i32 n_vocab`, `i32 n_chunk`, the `n_ctx * n_chunk` evaluated
//! tokens as `i32`, then for each chunk and each scored position (`n_ctx / 2 .. n_ctx - 2`, whose
//! logits predict the next token) one row of `nv = 2 * ((n_vocab + 1) / 2) + 4` `u16`: two `f32`
//! (`scale`, `min_log_prob`) in the first four, then each token's log-probability quantised as
//! `log_prob = scale * q + min_log_prob` (log-probabilities more than 16 below the largest are
//! stored as 0, that is clamped to the minimum).
//!
//! The statistics follow llama-perplexity's `--kl-divergence`: per position
//! `KLD = sum_i p_base(i) (log p_base(i) - log p(i))` over the tokens whose base log-probability
//! is above -16, whether the arg-max agrees, and `p - p_base` of the token that follows; over all
//! positions their means with standard errors and the median, percentiles and maximum of the KLD.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

/// Why a base-logits file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KldError {
    #[error("cannot read the base logits file {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{path} is not a llama-perplexity base logits file (it does not start with `_logits_`)"
    )]
    NotBaseLogits { path: String },
    #[error("{path}: {what}")]
    Malformed { path: String, what: String },
    #[error("the base logits have {file} tokens in the vocabulary and the model has {model}: they come from another model")]
    VocabMismatch { file: usize, model: usize },
}

/// The header and tokens of a base-logits file, and a reader positioned at its first row.
pub struct BaseLogits {
    path: String,
    reader: BufReader<File>,
    /// Tokens per chunk.
    pub n_ctx: usize,
    pub n_vocab: usize,
    pub n_chunk: usize,
    /// The evaluated tokens, `n_ctx * n_chunk` of them (chunk by chunk, before any BOS
    /// replacement).
    pub tokens: Vec<u32>,
    bytes: Vec<u8>,
}

impl BaseLogits {
    /// Opens `path` and checks that its size is exactly what its header announces, so a
    /// truncated or padded file is refused before any token is evaluated.
    pub fn open(path: &Path) -> Result<BaseLogits, KldError> {
        let name = path.display().to_string();
        let io = |source| KldError::Io {
            path: name.clone(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        let mut reader = BufReader::with_capacity(1 << 20, file);
        let mut head = [0u8; 20];
        if file_len < 20 {
            return Err(KldError::NotBaseLogits { path: name });
        }
        reader.read_exact(&mut head).map_err(io)?;
        if &head[..8] != b"_logits_" {
            return Err(KldError::NotBaseLogits { path: name });
        }
        let word = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().unwrap());
        let (n_ctx, n_vocab, n_chunk) = (word(8) as u64, word(12) as i32, word(16) as i32);
        let malformed = |what: String| KldError::Malformed {
            path: name.clone(),
            what,
        };
        if n_vocab <= 0 || n_chunk <= 0 || n_ctx < 4 {
            return Err(malformed(format!(
                "header says {n_ctx} tokens per chunk, a vocabulary of {n_vocab} and {n_chunk} chunks"
            )));
        }
        let (n_vocab, n_chunk) = (n_vocab as u64, n_chunk as u64);
        let nv = 2 * n_vocab.div_ceil(2) + 4;
        let rows = n_chunk * (n_ctx - 1 - n_ctx / 2);
        let expected = n_ctx
            .checked_mul(n_chunk)
            .and_then(|t| t.checked_mul(4))
            .and_then(|t| rows.checked_mul(nv * 2).and_then(|r| r.checked_add(t)))
            .and_then(|b| b.checked_add(20));
        if expected != Some(file_len) {
            return Err(malformed(format!(
                "{file_len} bytes, but its header ({n_ctx} tokens per chunk, vocabulary {n_vocab}, \
                 {n_chunk} chunks) needs {}",
                expected.map_or("more than 2^64".to_string(), |e| e.to_string())
            )));
        }
        let n_tokens = (n_ctx * n_chunk) as usize;
        let mut raw = vec![0u8; n_tokens * 4];
        reader.read_exact(&mut raw).map_err(io)?;
        let tokens: Vec<u32> = raw
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .map(|t| {
                u32::try_from(t)
                    .ok()
                    .filter(|&t| (t as u64) < n_vocab)
                    .ok_or(t)
            })
            .collect::<Result<_, i32>>()
            .map_err(|t| malformed(format!("token {t} is outside the vocabulary of {n_vocab}")))?;
        Ok(BaseLogits {
            path: name,
            reader,
            n_ctx: n_ctx as usize,
            n_vocab: n_vocab as usize,
            n_chunk: n_chunk as usize,
            tokens,
            bytes: vec![0u8; nv as usize * 2],
        })
    }

    /// Positions scored per chunk (`n_ctx / 2 .. n_ctx - 2`).
    pub fn scored_per_chunk(&self) -> usize {
        self.n_ctx - 1 - self.n_ctx / 2
    }

    /// Reads the next row of base log-probabilities (in file order: chunk by chunk, position by
    /// position).
    pub fn next_row(&mut self) -> Result<BaseRow<'_>, KldError> {
        self.reader
            .read_exact(&mut self.bytes)
            .map_err(|source| KldError::Io {
                path: self.path.clone(),
                source,
            })?;
        let f = |at: usize| f32::from_le_bytes(self.bytes[at..at + 4].try_into().unwrap());
        Ok(BaseRow {
            scale: f(0),
            min_log_prob: f(4),
            q: &self.bytes[8..8 + 2 * self.n_vocab],
        })
    }
}

/// Writes a base-logits file in llama-perplexity's format, so that a run of ember (the CPU, or
/// reference numerics) can be the base of another.
pub struct BaseWriter {
    out: std::io::BufWriter<File>,
    row: Vec<u8>,
}

impl BaseWriter {
    /// Creates `path` with the header and `tokens` (`n_chunk * n_ctx` of them).
    pub fn create(
        path: &Path,
        n_ctx: usize,
        n_vocab: usize,
        tokens: &[u32],
    ) -> std::io::Result<BaseWriter> {
        use std::io::Write;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, File::create(path)?);
        out.write_all(b"_logits_")?;
        out.write_all(&(n_ctx as u32).to_le_bytes())?;
        out.write_all(&(n_vocab as i32).to_le_bytes())?;
        out.write_all(&((tokens.len() / n_ctx) as i32).to_le_bytes())?;
        for &t in tokens {
            out.write_all(&(t as i32).to_le_bytes())?;
        }
        let nv = 2 * n_vocab.div_ceil(2) + 4;
        Ok(BaseWriter {
            out,
            row: vec![0u8; 2 * nv],
        })
    }

    /// Appends one scored row: log-probabilities quantised to 16 bits over the 16 units below
    /// the largest, as llama-perplexity stores them.
    pub fn push(&mut self, logits: &[f32]) -> std::io::Result<()> {
        use std::io::Write;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let min = logits
            .iter()
            .copied()
            .fold(f32::INFINITY, f32::min)
            .max(max - 16.0);
        let log_sum = logits
            .iter()
            .map(|&l| ((l - max) as f64).exp())
            .sum::<f64>()
            .ln() as f32;
        let scale = (max - min) / 65535.0;
        self.row.fill(0);
        self.row[..4].copy_from_slice(&scale.to_le_bytes());
        self.row[4..8].copy_from_slice(&(min - max - log_sum).to_le_bytes());
        if scale > 0.0 {
            let inv = 1.0 / scale;
            for (i, &l) in logits.iter().enumerate() {
                // Round half to even, as llama.cpp's nearest_int does.
                let q = if l > min {
                    (inv * (l - min)).round_ties_even() as u16
                } else {
                    0
                };
                self.row[8 + 2 * i..10 + 2 * i].copy_from_slice(&q.to_le_bytes());
            }
        }
        self.out.write_all(&self.row)
    }

    /// Flushes the file.
    pub fn finish(mut self) -> std::io::Result<()> {
        use std::io::Write;
        self.out.flush()
    }
}

/// One position's base log-probabilities, quantised.
pub struct BaseRow<'a> {
    scale: f32,
    min_log_prob: f32,
    q: &'a [u8],
}

impl BaseRow<'_> {
    fn log_prob(&self, i: usize) -> f32 {
        let q = u16::from_le_bytes([self.q[2 * i], self.q[2 * i + 1]]);
        self.scale * q as f32 + self.min_log_prob
    }
}

/// Running KL-divergence statistics.
#[derive(Debug, Default, Clone)]
pub struct KldStats {
    kld: Vec<f64>,
    sum_kld: f64,
    sum_kld2: f64,
    n_same_top: usize,
    sum_nll: f64,
    sum_nll_base: f64,
    sum_p_diff: f64,
    sum_p_diff2: f64,
    max_p_diff: f64,
}

/// The summary of a comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct KldSummary {
    pub count: usize,
    pub mean_kld: f64,
    pub mean_kld_stderr: f64,
    pub median_kld: f64,
    pub p99_kld: f64,
    pub max_kld: f64,
    /// Fraction of positions where the two arg-maxes agree.
    pub same_top: f64,
    /// Perplexity of this run and of the base on the same tokens.
    pub ppl: f64,
    pub ppl_base: f64,
    /// Root mean square of `p - p_base` of the next token.
    pub rms_p_diff: f64,
    pub max_p_diff: f64,
}

impl KldStats {
    /// Adds one position: this run's `logits` against the base row, `next` the token that
    /// follows.
    pub fn add(&mut self, logits: &[f32], base: &BaseRow<'_>, next: usize) {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let top = crate::sample::greedy_token(logits) as usize;
        let log_sum: f64 = logits
            .iter()
            .map(|&l| ((l - max) as f64).exp())
            .sum::<f64>()
            .ln();
        let log_p = |i: usize| (logits[i] - max) as f64 - log_sum;
        let mut kld = 0f64;
        let (mut top_base, mut top_base_lp) = (0usize, f32::NEG_INFINITY);
        for i in 0..logits.len() {
            let lp_base = base.log_prob(i);
            if lp_base > top_base_lp {
                (top_base, top_base_lp) = (i, lp_base);
            }
            if lp_base > -16.0 {
                kld += (lp_base as f64).exp() * (lp_base as f64 - log_p(i));
            }
        }
        self.kld.push(kld);
        self.sum_kld += kld;
        self.sum_kld2 += kld * kld;
        self.n_same_top += usize::from(top == top_base);
        let nll = -log_p(next);
        let nll_base = -(base.log_prob(next) as f64);
        self.sum_nll += nll;
        self.sum_nll_base += nll_base;
        let p_diff = (-nll).exp() - (-nll_base).exp();
        self.sum_p_diff += p_diff;
        self.sum_p_diff2 += p_diff * p_diff;
        self.max_p_diff = self.max_p_diff.max(p_diff.abs());
    }

    /// Positions added so far.
    pub fn count(&self) -> usize {
        self.kld.len()
    }

    pub fn summary(&self) -> KldSummary {
        let n = self.kld.len().max(1) as f64;
        let mean = self.sum_kld / n;
        let variance = (self.sum_kld2 / n - mean * mean).max(0.0);
        let mut sorted = self.kld.clone();
        sorted.sort_by(f64::total_cmp);
        let at = |q: f64| {
            sorted
                .get(((sorted.len() as f64 - 1.0) * q).round() as usize)
                .copied()
                .unwrap_or(0.0)
        };
        KldSummary {
            count: self.kld.len(),
            mean_kld: mean,
            mean_kld_stderr: if self.kld.len() > 1 {
                (variance / (n - 1.0)).sqrt()
            } else {
                0.0
            },
            median_kld: at(0.5),
            p99_kld: at(0.99),
            max_kld: sorted.last().copied().unwrap_or(0.0),
            same_top: self.n_same_top as f64 / n,
            ppl: (self.sum_nll / n).exp(),
            ppl_base: (self.sum_nll_base / n).exp(),
            rms_p_diff: (self.sum_p_diff2 / n).sqrt(),
            max_p_diff: self.max_p_diff,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes a base file the way llama-perplexity does, from full logit rows.
    fn write_base(path: &Path, n_ctx: u32, n_vocab: usize, tokens: &[i32], rows: &[Vec<f32>]) {
        let mut bytes = b"_logits_".to_vec();
        bytes.extend(n_ctx.to_le_bytes());
        bytes.extend((n_vocab as i32).to_le_bytes());
        bytes.extend(((tokens.len() as u32 / n_ctx) as i32).to_le_bytes());
        for t in tokens {
            bytes.extend(t.to_le_bytes());
        }
        let nv = 2 * n_vocab.div_ceil(2) + 4;
        for logits in rows {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let min = logits
                .iter()
                .copied()
                .fold(f32::INFINITY, f32::min)
                .max(max - 16.0);
            let log_sum = (logits
                .iter()
                .map(|&l| ((l - max) as f64).exp())
                .sum::<f64>())
            .ln() as f32;
            let scale = (max - min) / 65535.0;
            let mut row = vec![0u16; nv];
            let mut head = scale.to_le_bytes().to_vec();
            head.extend((min - max - log_sum).to_le_bytes());
            for (i, pair) in head.chunks_exact(2).enumerate() {
                row[i] = u16::from_le_bytes([pair[0], pair[1]]);
            }
            for (i, &l) in logits.iter().enumerate() {
                row[4 + i] = if l > min {
                    ((1.0 / scale) * (l - min)).round_ties_even() as u16
                } else {
                    0
                };
            }
            for v in row {
                bytes.extend(v.to_le_bytes());
            }
        }
        std::fs::write(path, bytes).unwrap();
    }

    fn rows(n: usize, n_vocab: usize, shift: f32) -> Vec<Vec<f32>> {
        (0..n)
            .map(|r| {
                (0..n_vocab)
                    .map(|i| {
                        ((i * 7 + r * 13) % 11) as f32 * 0.9 + if i == r { shift } else { 0.0 }
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn identical_logits_give_zero_divergence_and_full_agreement() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("base.kld");
        let (n_ctx, n_vocab) = (8u32, 5usize);
        let tokens: Vec<i32> = (0..16).map(|i| i % 5).collect();
        let scored = 2 * (n_ctx as usize - 1 - n_ctx as usize / 2);
        let base = rows(scored, n_vocab, 0.0);
        write_base(&path, n_ctx, n_vocab, &tokens, &base);
        let mut file = BaseLogits::open(&path).unwrap();
        assert_eq!((file.n_ctx, file.n_vocab, file.n_chunk), (8, 5, 2));
        assert_eq!(file.tokens.len(), 16);
        let mut same = KldStats::default();
        let mut moved = KldStats::default();
        let other = rows(scored, n_vocab, 3.0);
        for (r, logits) in base.iter().enumerate() {
            let row = file.next_row().unwrap();
            same.add(logits, &row, r % n_vocab);
            moved.add(&other[r], &row, r % n_vocab);
        }
        let s = same.summary();
        assert_eq!(s.count, scored);
        // Only the 16-bit quantisation of the base separates them: a step of at most 10 / 65535
        // here, so every log-probability is off by under 1e-4, and so is the divergence.
        assert!(s.mean_kld.abs() < 1e-4, "{s:?}");
        assert_eq!(s.same_top, 1.0);
        assert!((s.ppl / s.ppl_base - 1.0).abs() < 1e-3, "{s:?}");
        let m = moved.summary();
        assert!(m.mean_kld > 0.1 && m.same_top < 1.0, "{m:?}");
    }

    #[test]
    fn a_file_ember_writes_reads_back_as_llama_perplexity_writes_it() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.kld"), dir.path().join("b.kld"));
        let tokens: Vec<i32> = (0..16).map(|i| (i * 3) % 5).collect();
        let base = rows(6, 5, 1.5);
        write_base(&a, 8, 5, &tokens, &base);
        let ids: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
        let mut writer = BaseWriter::create(&b, 8, 5, &ids).unwrap();
        for logits in &base {
            writer.push(logits).unwrap();
        }
        writer.finish().unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    }

    #[test]
    fn truncated_or_foreign_files_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("base.kld");
        let tokens: Vec<i32> = (0..16).map(|i| i % 5).collect();
        write_base(&path, 8, 5, &tokens, &rows(6, 5, 0.0));
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        let e = BaseLogits::open(&path).err().unwrap().to_string();
        assert!(
            e.contains("bytes, but its header") && e.contains("needs"),
            "{e}"
        );
        std::fs::write(&path, b"GGUF and then some more bytes").unwrap();
        let e = BaseLogits::open(&path).err().unwrap().to_string();
        assert!(
            e.contains("is not a llama-perplexity base logits file"),
            "{e}"
        );
        let mut bad = bytes.clone();
        bad[20..24].copy_from_slice(&9i32.to_le_bytes());
        std::fs::write(&path, &bad).unwrap();
        let e = BaseLogits::open(&path).err().unwrap().to_string();
        assert!(e.contains("token 9 is outside the vocabulary of 5"), "{e}");
    }
}
