//! Loops built on the forward pass: evaluating a prompt, generating tokens, and measuring
//! perplexity. The CLI, the tests and (later) the server share these so they all evaluate a
//! prompt the same way.

use crate::backend::Backend;
use crate::batch::{Batch, SeqId};
use crate::model::{Context, ForwardError, Model};
use crate::sample::Sampler;

/// Evaluates `tokens` as the continuation of sequence `seq_id`, in batches of at most `n_batch`
/// tokens, and returns the logits of the last one.
pub fn eval_tokens<'c, B: Backend>(
    model: &Model<B>,
    ctx: &'c mut Context<B>,
    seq_id: SeqId,
    tokens: &[u32],
    n_batch: usize,
) -> Result<&'c [f32], ForwardError> {
    if tokens.is_empty() {
        return Err(ForwardError::EmptyBatch);
    }
    let n_batch = n_batch.max(1);
    let mut batch = Batch::new();
    let n_chunks = tokens.len().div_ceil(n_batch);
    for (i, chunk) in tokens.chunks(n_batch).enumerate() {
        batch.clear();
        let start = ctx.seq_len(seq_id) as u32;
        for (j, &t) in chunk.iter().enumerate() {
            batch.push(
                t,
                start + j as u32,
                seq_id,
                i + 1 == n_chunks && j + 1 == chunk.len(),
            );
        }
        model.forward(ctx, &batch)?;
    }
    Ok(ctx.logits())
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced an end-of-generation token.
    EndOfGeneration,
    /// `n_predict` tokens were generated.
    Length,
    /// The sequence filled the context.
    ContextFull,
    /// The caller's callback asked to stop.
    Stopped,
}

/// Generates up to `n_predict` tokens after `prompt` in sequence `seq_id` (which must be empty or
/// hold exactly what precedes `prompt`). `on_token` sees each token as it is chosen (end-of-
/// generation tokens included) and returns `false` to stop. Returns the generated ids and why it
/// stopped. Prompt tokens are fed to the sampler's penalty window.
#[allow(clippy::too_many_arguments)]
pub fn generate<B: Backend>(
    model: &Model<B>,
    ctx: &mut Context<B>,
    seq_id: SeqId,
    prompt: &[u32],
    n_predict: usize,
    n_batch: usize,
    sampler: &mut Sampler,
    is_eog: impl Fn(u32) -> bool,
    on_token: impl FnMut(u32) -> bool,
) -> Result<(Vec<u32>, StopReason), ForwardError> {
    generate_observed(
        model,
        ctx,
        seq_id,
        prompt,
        n_predict,
        n_batch,
        sampler,
        is_eog,
        |_| {},
        on_token,
    )
}

/// [`generate`], with `on_logits` seeing the logits each token is sampled from, before sampling
/// (so before penalties and temperature), in the order the tokens are generated.
#[allow(clippy::too_many_arguments)]
pub fn generate_observed<B: Backend>(
    model: &Model<B>,
    ctx: &mut Context<B>,
    seq_id: SeqId,
    prompt: &[u32],
    n_predict: usize,
    n_batch: usize,
    sampler: &mut Sampler,
    is_eog: impl Fn(u32) -> bool,
    mut on_logits: impl FnMut(&[f32]),
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<(Vec<u32>, StopReason), ForwardError> {
    // Generation stops at the end of the context, so that bounds the tokens whatever `n_predict`.
    let mut generated = Vec::with_capacity(n_predict.min(ctx.params().n_ctx));
    if n_predict == 0 {
        return Ok((generated, StopReason::Length));
    }
    for &t in prompt {
        sampler.accept(t);
    }
    let n_ctx = ctx.params().n_ctx;
    let logits = eval_tokens(model, ctx, seq_id, prompt, n_batch)?;
    on_logits(logits);
    let mut token = sampler.sample(logits);
    let mut batch = Batch::new();
    loop {
        sampler.accept(token);
        generated.push(token);
        if !on_token(token) {
            return Ok((generated, StopReason::Stopped));
        }
        if is_eog(token) {
            return Ok((generated, StopReason::EndOfGeneration));
        }
        if generated.len() >= n_predict {
            return Ok((generated, StopReason::Length));
        }
        let pos = ctx.seq_len(seq_id);
        if pos >= n_ctx {
            return Ok((generated, StopReason::ContextFull));
        }
        batch.clear();
        batch.push(token, pos as u32, seq_id, true);
        let logits = model.forward(ctx, &batch)?;
        on_logits(logits);
        token = sampler.sample(logits);
    }
}

/// The `k` most likely tokens of `logits` with their log-probabilities (log softmax, as
/// [`log_prob`] computes it), most likely first; ties go to the lower id.
pub fn top_log_probs(logits: &[f32], k: usize) -> Vec<(u32, f64)> {
    if logits.is_empty() || k == 0 {
        return Vec::new();
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_sum = logits
        .iter()
        .map(|&l| ((l - max) as f64).exp())
        .sum::<f64>()
        .ln();
    // A partial selection: k is tiny next to the vocabulary.
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (id, &logit) in logits.iter().enumerate() {
        if best.len() == k && logit <= best[k - 1].1 {
            continue;
        }
        let at = best.partition_point(|&(_, l)| l >= logit);
        best.insert(at, (id as u32, logit));
        best.truncate(k);
    }
    best.into_iter()
        .map(|(id, logit)| (id, (logit - max) as f64 - log_sum))
        .collect()
}

/// One chunk's result in a perplexity run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChunkReport {
    /// 0-based chunk index.
    pub index: usize,
    /// Number of chunks in all.
    pub n_chunks: usize,
    /// Perplexity over every token scored so far.
    pub running_ppl: f64,
}

/// The result of a perplexity run.
#[derive(Debug, Clone, PartialEq)]
pub struct Perplexity {
    /// `exp(mean negative log-likelihood)`.
    pub ppl: f64,
    /// Standard error of `ppl` (llama.cpp's `±`): the standard error of the mean NLL times `ppl`.
    pub ppl_stderr: f64,
    /// Tokens scored.
    pub n_scored: usize,
    /// Chunks evaluated.
    pub n_chunks: usize,
}

/// Why a perplexity run could not be done.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PerplexityError {
    /// The text is shorter than one chunk.
    #[error("the text has {n_tokens} tokens: expected at least {needed} (two chunks of the context of {n_ctx} are recommended)")]
    TooShort {
        n_tokens: usize,
        needed: usize,
        n_ctx: usize,
    },
    /// The context is too small to score anything.
    #[error("context of {n_ctx} tokens: expected at least 4")]
    ContextTooSmall { n_ctx: usize },
    /// The logits of a scored position hold NaN or +inf: the perplexity would be a NaN printed
    /// as a number.
    #[error("chunk {} of {n_chunks}, position {pos}: {}", .chunk + 1, crate::sample::NON_FINITE_MESSAGE)]
    NonFiniteLogits {
        /// 0-based chunk index.
        chunk: usize,
        n_chunks: usize,
        /// Position in the chunk whose logits (predicting the token after it) are not finite.
        pos: usize,
    },
    /// A forward pass failed.
    #[error(transparent)]
    Forward(#[from] ForwardError),
}

/// Perplexity by llama-perplexity's protocol: `tokens` (the whole text, tokenized once) is cut into
/// `tokens.len() / n_ctx` chunks of `n_ctx`; each chunk is evaluated from an empty cache with its
/// first token replaced by `bos` (when given), and the predictions of its second half (positions
/// `n_ctx / 2 .. n_ctx - 1` predicting the next token) are scored. `on_chunk` sees the running
/// estimate after each chunk.
pub fn perplexity<B: Backend>(
    model: &Model<B>,
    ctx: &mut Context<B>,
    tokens: &[u32],
    n_ctx: usize,
    n_batch: usize,
    bos: Option<u32>,
    mut on_chunk: impl FnMut(ChunkReport),
) -> Result<Perplexity, PerplexityError> {
    perplexity_rows(
        model,
        ctx,
        tokens,
        n_ctx,
        n_batch,
        bos,
        |_| {},
        &mut on_chunk,
    )
}

/// One scored position of a perplexity run: the logits at `pos` of chunk `chunk`, which predict
/// `next`.
pub struct ScoredRow<'a> {
    pub chunk: usize,
    pub pos: usize,
    pub logits: &'a [f32],
    pub next: u32,
}

/// [`perplexity`], also handing every scored row of logits to `on_row` in order (chunk by chunk,
/// position by position: the order of llama-perplexity's base-logits file, see
/// [`crate::kl_divergence`]).
#[allow(clippy::too_many_arguments)]
pub fn perplexity_rows<B: Backend>(
    model: &Model<B>,
    ctx: &mut Context<B>,
    tokens: &[u32],
    n_ctx: usize,
    n_batch: usize,
    bos: Option<u32>,
    mut on_row: impl FnMut(ScoredRow<'_>),
    mut on_chunk: impl FnMut(ChunkReport),
) -> Result<Perplexity, PerplexityError> {
    if n_ctx < 4 {
        return Err(PerplexityError::ContextTooSmall { n_ctx });
    }
    let n_chunks = tokens.len() / n_ctx;
    if n_chunks == 0 {
        return Err(PerplexityError::TooShort {
            n_tokens: tokens.len(),
            needed: n_ctx,
            n_ctx,
        });
    }
    let n_batch = n_batch.clamp(1, n_ctx);
    let first = n_ctx / 2;
    let n_vocab = model.n_vocab();
    let seq_id: SeqId = 0;
    let (mut nll_sum, mut nll2_sum, mut count) = (0f64, 0f64, 0usize);
    let mut batch = Batch::new();
    let mut chunk_tokens = vec![0u32; n_ctx];
    for index in 0..n_chunks {
        let start = index * n_ctx;
        chunk_tokens.copy_from_slice(&tokens[start..start + n_ctx]);
        if let Some(bos) = bos {
            chunk_tokens[0] = bos;
        }
        ctx.free_sequence(seq_id);
        for batch_start in (0..n_ctx).step_by(n_batch) {
            let batch_end = (batch_start + n_batch).min(n_ctx);
            batch.clear();
            for (pos, &token) in chunk_tokens
                .iter()
                .enumerate()
                .take(batch_end)
                .skip(batch_start)
            {
                // Logits of positions first .. n_ctx - 2 predict tokens first + 1 .. n_ctx - 1.
                let scored = pos >= first && pos + 1 < n_ctx;
                batch.push(token, pos as u32, seq_id, scored);
            }
            let logits = model.forward(ctx, &batch)?;
            let scored_positions =
                (batch_start..batch_end).filter(|&p| p >= first && p + 1 < n_ctx);
            for (row, pos) in scored_positions.enumerate() {
                let target = tokens[start + pos + 1] as usize;
                let row_logits = &logits[row * n_vocab..(row + 1) * n_vocab];
                if !crate::sample::logits_are_sane(row_logits) {
                    ctx.free_sequence(seq_id);
                    return Err(PerplexityError::NonFiniteLogits {
                        chunk: index,
                        n_chunks,
                        pos,
                    });
                }
                on_row(ScoredRow {
                    chunk: index,
                    pos,
                    logits: row_logits,
                    next: target as u32,
                });
                let nll = -log_prob(row_logits, target);
                nll_sum += nll;
                nll2_sum += nll * nll;
                count += 1;
            }
        }
        on_chunk(ChunkReport {
            index,
            n_chunks,
            running_ppl: (nll_sum / count as f64).exp(),
        });
    }
    ctx.free_sequence(seq_id);
    let mean = nll_sum / count as f64;
    let ppl = mean.exp();
    let variance = (nll2_sum / count as f64 - mean * mean).max(0.0);
    let stderr_mean = if count > 1 {
        (variance / (count - 1) as f64).sqrt()
    } else {
        0.0
    };
    Ok(Perplexity {
        ppl,
        ppl_stderr: stderr_mean * ppl,
        n_scored: count,
        n_chunks,
    })
}

/// `log softmax(logits)[target]`, max-subtracted with the sum in f64.
pub fn log_prob(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    (logits[target] - max) as f64 - sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_log_probs_are_sorted_with_ties_to_the_lower_id() {
        let logits = [1.0, 3.0, 2.0, 3.0, -1.0];
        let top = top_log_probs(&logits, 2);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3]);
        assert!((top[0].1 - log_prob(&logits, 1)).abs() < 1e-12);
        assert!((top[1].1 - log_prob(&logits, 3)).abs() < 1e-12);
        let top = top_log_probs(&logits, 4);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3, 2, 0]);
        assert_eq!(top_log_probs(&logits, 9).len(), 5);
        assert!(top_log_probs(&[], 2).is_empty());
    }

    #[test]
    fn log_prob_of_uniform_logits() {
        let lp = log_prob(&[0.5; 4], 2);
        assert!((lp - (0.25f64).ln()).abs() < 1e-12);
    }
}
