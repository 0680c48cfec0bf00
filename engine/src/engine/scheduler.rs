//! Continuous batching over one model instance (the scheme of Orca and vLLM).
//!
//! Every [`Scheduler::step`] is one forward pass over the next token of every running sequence
//! plus chunks of the prompts still being read, within a token budget (`ubatch`), so running
//! streams keep decoding while a long prompt is read in pieces.
//!
//! - **Admission by KV blocks.** A waiting request starts when fewer than `parallel` sequences
//!   run and the blocks for all its known tokens fit, after taking what the prefix cache already
//!   holds of its prompt, with one block kept in reserve per running sequence for its growth.
//! - **Preemption.** When a step's blocks do not fit, the youngest running sequence is preempted:
//!   its blocks are freed (its full blocks stay in the prefix cache, so recomputing is often
//!   cheap), and it goes back to the front of the queue to be computed again from its prompt and
//!   the tokens it had generated. Nothing running fails for lack of KV.
//! - **Failures stay with their request.** A forward pass that fails (a device out of memory, a
//!   budget) changes nothing in the cache; its sequences are retried one by one, and only those
//!   that fail alone fail.
//! - **Cancellation** frees a sequence's blocks before the next step.
//! - **Hybrid models** (linear-attention layers with a recurrent state per sequence, see
//!   [`crate::recurrent_state`]) run without the prefix cache: a cached prefix's KV blocks would
//!   come without the recurrent state at that prefix, which is not kept. Preemption frees the
//!   state with the blocks and recomputes from the start, as for any model. A failed pass cannot
//!   give their states back, so it ends their sequences; the one-by-one retry then fails them
//!   with a position error instead of computing on a wrong state (on the CPU, the only backend
//!   that runs these models, a pass does not fail once its layers run).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use ember_tokenizer::Tokenizer;
use rayon::prelude::*;
use tokio::sync::mpsc::UnboundedSender;

use super::request::{Event, FinishReason, GeneratedToken, Timings, TopLogprob, Usage};
use super::stop::TextFilter;
use super::{EngineConfig, Shared, SlotSnapshot, Submission, Totals};
use crate::backend::Backend;
use crate::batch::{Batch, SeqId};
use crate::generate::{log_prob, top_log_probs};
use crate::model::{Context, ForwardError, Model};
use crate::sample::Sampler;

/// One request inside the scheduler.
struct Sequence {
    id: u64,
    /// Its sequence id in the KV cache while running.
    seq_id: Option<SeqId>,
    events: UnboundedSender<Event>,
    submitted_at: Instant,
    first_scheduled: Option<Instant>,
    first_token_at: Option<Instant>,
    n_prompt: usize,
    /// The prompt followed by every generated token.
    tokens: Vec<u32>,
    /// Leading tokens of `tokens` in the KV cache.
    n_computed: usize,
    n_generated: usize,
    max_tokens: Option<usize>,
    logprobs: Option<usize>,
    ignore_eos: bool,
    report_eog: bool,
    sampler: Sampler,
    filter: TextFilter,
    /// Prompt tokens taken from the prefix cache at the first admission.
    cached_tokens: usize,
    preemptions: u32,
    /// Admission order: the largest is the youngest.
    admitted: u64,
}

impl Sequence {
    fn slot(&self, now: Instant) -> SlotSnapshot {
        SlotSnapshot {
            request_id: self.id,
            n_prompt: self.n_prompt,
            n_prompt_done: self.n_computed.min(self.n_prompt),
            n_generated: self.n_generated,
            max_tokens: self.max_tokens,
            age: now.saturating_duration_since(self.submitted_at),
        }
    }
}

/// A running sequence's part of a step.
#[derive(Debug, Clone, Copy)]
struct Member {
    /// Index in `running`.
    index: usize,
    /// Tokens it feeds.
    count: usize,
    /// Whether its last token's logits are wanted (it has fed every known token).
    logits: bool,
}

/// The continuous-batching scheduler of one engine.
pub struct Scheduler {
    config: EngineConfig,
    tokenizer: Arc<Tokenizer>,
    shared: Arc<Shared>,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    free_seq_ids: Vec<SeqId>,
    next_seq_id: SeqId,
    admissions: u64,
    totals: Totals,
    batch: Batch,
    /// Sequences that ended in the current step: (index in `running`, why, an error message).
    ended: Vec<(usize, FinishReason, Option<String>)>,
}

/// Where in a step [`Scheduler::step`] calls its `publish` hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepPoint {
    /// A forward pass is about to run.
    BeforeForward,
    /// A pass has run and sampled; its tokens are about to be sent.
    TokensReady,
}

/// The hook [`Scheduler::step`] calls at each [`StepPoint`] with the running sequences and the
/// context.
pub type Publish<'a, B> = dyn FnMut(StepPoint, &[SlotSnapshot], &Context<B>) + 'a;

/// What one step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Tokens fed to forward passes (retries included).
    pub tokens: usize,
    /// Forward passes run.
    pub passes: usize,
}

impl Scheduler {
    pub(crate) fn new(
        config: EngineConfig,
        tokenizer: Arc<Tokenizer>,
        shared: Arc<Shared>,
    ) -> Self {
        Scheduler {
            config,
            tokenizer,
            shared,
            waiting: VecDeque::new(),
            running: Vec::new(),
            free_seq_ids: Vec::new(),
            next_seq_id: 0,
            admissions: 0,
            totals: Totals::default(),
            batch: Batch::new(),
            ended: Vec::new(),
        }
    }

    /// Whether anything is running or waiting.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Running totals.
    pub fn totals(&self) -> Totals {
        self.totals
    }

    /// Counts an idle trim in the totals.
    pub fn note_idle_trim(&mut self) {
        self.totals.idle_trims += 1;
    }

    /// Requests waiting for a slot.
    pub fn n_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// The running sequences, for snapshots.
    pub fn slots(&self, now: Instant) -> Vec<SlotSnapshot> {
        self.running.iter().map(|s| s.slot(now)).collect()
    }

    /// Queues a submitted request.
    pub(crate) fn enqueue(&mut self, submission: Submission) {
        let Submission {
            id,
            request,
            submitted_at,
            events,
        } = submission;
        let mut sampler = Sampler::new(request.sampling.clone());
        // The penalty window sees the prompt, as `generate` does.
        for &token in &request.prompt {
            sampler.accept(token);
        }
        self.totals.requests_submitted += 1;
        self.totals.prompt_tokens += request.prompt.len() as u64;
        let seq = Sequence {
            id,
            seq_id: None,
            events,
            submitted_at,
            first_scheduled: None,
            first_token_at: None,
            n_prompt: request.prompt.len(),
            tokens: request.prompt,
            n_computed: 0,
            n_generated: 0,
            max_tokens: request.max_tokens,
            logprobs: request.logprobs,
            ignore_eos: request.ignore_eos,
            report_eog: request.report_eog,
            sampler,
            filter: TextFilter::new(&request.stop),
            cached_tokens: 0,
            preemptions: 0,
            admitted: 0,
        };
        if seq.max_tokens == Some(0) {
            // Nothing to generate: done without touching the model.
            self.end(seq, FinishReason::Length, None);
        } else {
            self.waiting.push_back(seq);
        }
    }

    /// Cancels request `id` wherever it is; its blocks are freed now. Unknown ids (requests that
    /// already ended) are ignored.
    pub fn cancel<B: Backend>(&mut self, id: u64, ctx: &mut Context<B>) {
        if let Some(at) = self.waiting.iter().position(|s| s.id == id) {
            if let Some(seq) = self.waiting.remove(at) {
                self.end(seq, FinishReason::Cancelled, None);
            }
            return;
        }
        if let Some(at) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(at);
            self.release(&seq, ctx);
            self.end(seq, FinishReason::Cancelled, None);
        }
    }

    /// Cancels every request.
    pub fn cancel_all<B: Backend>(&mut self, ctx: &mut Context<B>) {
        while let Some(seq) = self.waiting.pop_front() {
            self.end(seq, FinishReason::Cancelled, None);
        }
        while let Some(seq) = self.running.pop() {
            self.release(&seq, ctx);
            self.end(seq, FinishReason::Cancelled, None);
        }
    }

    /// Ends every request with a failure (the engine is stopping on an error).
    pub fn fail_all(&mut self, message: &str) {
        let sequences: Vec<Sequence> = self
            .waiting
            .drain(..)
            .chain(self.running.drain(..))
            .collect();
        for seq in sequences {
            self.end(seq, FinishReason::Cancelled, Some(message.to_string()));
        }
    }

    /// Frees a sequence's KV blocks and its sequence id.
    fn release<B: Backend>(&mut self, seq: &Sequence, ctx: &mut Context<B>) {
        if let Some(seq_id) = seq.seq_id {
            ctx.free_sequence(seq_id);
            self.free_seq_ids.push(seq_id);
        }
    }

    /// Sends a request's last events and counts it out.
    fn end(&mut self, mut seq: Sequence, reason: FinishReason, failure: Option<String>) {
        let now = Instant::now();
        // Counted out before its last event goes: a client that submits again as soon as it
        // reads `Done` (a chat's next turn, with no queue) must find the slot free.
        self.shared.in_flight.fetch_sub(1, Ordering::AcqRel);
        match failure {
            Some(message) => {
                self.totals.requests_failed += 1;
                let _ = seq.events.send(Event::Failed { message });
            }
            None => {
                let rest = seq.filter.finish();
                if !rest.is_empty() {
                    let _ = seq.events.send(Event::Tokens {
                        text: rest,
                        tokens: Vec::new(),
                    });
                }
                self.totals.requests_finished += 1;
                if reason == FinishReason::Cancelled {
                    self.totals.requests_cancelled += 1;
                }
                let _ = seq.events.send(Event::Done {
                    finish_reason: reason,
                    usage: Usage {
                        prompt_tokens: seq.n_prompt,
                        completion_tokens: seq.n_generated,
                        cached_tokens: seq.cached_tokens,
                    },
                    timings: Timings {
                        queued: seq
                            .first_scheduled
                            .unwrap_or(now)
                            .saturating_duration_since(seq.submitted_at),
                        time_to_first_token: seq
                            .first_token_at
                            .unwrap_or(now)
                            .saturating_duration_since(seq.submitted_at),
                        total: now.saturating_duration_since(seq.submitted_at),
                        preemptions: seq.preemptions,
                    },
                });
            }
        }
    }

    fn take_seq_id(&mut self) -> SeqId {
        self.free_seq_ids.pop().unwrap_or_else(|| {
            let id = self.next_seq_id;
            self.next_seq_id += 1;
            id
        })
    }

    /// Starts waiting requests while slots and KV blocks allow.
    fn admit<B: Backend>(&mut self, ctx: &mut Context<B>) {
        while self.running.len() < self.config.parallel {
            if self.waiting.is_empty() {
                break;
            }
            let seq_id = self.take_seq_id();
            let front = &self.waiting[0];
            let n_known = front.tokens.len();
            let prefix_cache = self.config.prefix_cache && !ctx.has_recurrent_state();
            let kv = ctx.kv_mut();
            let mut cached = 0;
            if prefix_cache {
                // At least the last known token is computed, for its logits.
                let blocks = kv.lookup_prefix(&front.tokens[..n_known - 1]);
                kv.attach_prefix(seq_id, &blocks);
                cached = blocks.len() * kv.block_size();
            }
            let reserve = self.running.len();
            let fits = kv.blocks_needed(seq_id, n_known) + reserve <= kv.available_blocks();
            if !fits && !self.running.is_empty() {
                kv.free_sequence(seq_id);
                self.free_seq_ids.push(seq_id);
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            self.admissions += 1;
            seq.admitted = self.admissions;
            seq.seq_id = Some(seq_id);
            seq.n_computed = cached;
            if seq.first_scheduled.is_none() {
                seq.first_scheduled = Some(Instant::now());
                seq.cached_tokens = cached.min(seq.n_prompt);
            }
            self.totals.prompt_tokens_cached += cached as u64;
            self.running.push(seq);
        }
    }

    /// Preempts the youngest running sequence: frees its blocks and queues it first, to be
    /// computed again.
    fn preempt_youngest<B: Backend>(&mut self, ctx: &mut Context<B>) {
        let Some(at) = (0..self.running.len()).max_by_key(|&i| self.running[i].admitted) else {
            return;
        };
        let mut seq = self.running.remove(at);
        self.release(&seq, ctx);
        seq.seq_id = None;
        seq.n_computed = 0;
        seq.preemptions += 1;
        self.totals.preemptions += 1;
        tracing::debug!(request = seq.id, "preempted for lack of KV blocks");
        self.waiting.push_front(seq);
    }

    /// The members of the next forward pass: every sequence with one token left to feed (decode),
    /// then prompt chunks in admission order, within the token budget.
    fn plan_members(&self) -> Vec<Member> {
        let budget = self.config.ubatch;
        let mut members = Vec::new();
        let mut used = 0;
        for (index, seq) in self.running.iter().enumerate() {
            if seq.tokens.len() - seq.n_computed == 1 && used < budget {
                members.push(Member {
                    index,
                    count: 1,
                    logits: true,
                });
                used += 1;
            }
        }
        let mut by_age: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].tokens.len() - self.running[i].n_computed > 1)
            .collect();
        by_age.sort_by_key(|&i| self.running[i].admitted);
        for index in by_age {
            if used >= budget {
                break;
            }
            let seq = &self.running[index];
            let remaining = seq.tokens.len() - seq.n_computed;
            let count = remaining.min(budget - used);
            members.push(Member {
                index,
                count,
                logits: count == remaining,
            });
            used += count;
        }
        members
    }

    /// KV blocks the members need beyond what their sequences hold.
    fn blocks_needed<B: Backend>(&self, members: &[Member], ctx: &Context<B>) -> usize {
        members
            .iter()
            .map(|m| {
                let seq = &self.running[m.index];
                let seq_id = seq.seq_id.expect("running sequences have a sequence id");
                ctx.kv().blocks_needed(seq_id, seq.n_computed + m.count)
            })
            .sum()
    }

    /// One scheduling step: admission, one forward pass (or its per-sequence retries after a
    /// failure), sampling and events. `publish` runs with the running sequences and the context
    /// right before each forward pass ([`StepPoint::BeforeForward`]: the engine publishes them,
    /// so a hung pass is visible) and after each pass, before any of its tokens is sent
    /// ([`StepPoint::TokensReady`]: what a client has received is never ahead of the published
    /// state, such as the KV blocks the pass took).
    pub fn step<B: Backend>(
        &mut self,
        model: &Model<B>,
        ctx: &mut Context<B>,
        publish: &mut Publish<'_, B>,
    ) -> StepReport {
        let mut report = StepReport::default();
        self.admit(ctx);
        let members = loop {
            let members = self.plan_members();
            if members.is_empty() {
                return report;
            }
            if self.blocks_needed(&members, ctx) <= ctx.kv().available_blocks() {
                break members;
            }
            if self.running.len() <= 1 {
                // One sequence alone has outgrown the whole cache: its context is full.
                if let Some(seq) = self.running.pop() {
                    self.release(&seq, ctx);
                    self.end(seq, FinishReason::ContextFull, None);
                }
                return report;
            }
            self.preempt_youngest(ctx);
        };

        self.ended.clear();
        let slots = self.slots(Instant::now());
        publish(StepPoint::BeforeForward, &slots, ctx);
        report.passes += 1;
        report.tokens += members.iter().map(|m| m.count).sum::<usize>();
        if let Err(error) = self.run_pass(model, ctx, &members, publish) {
            self.totals.failed_steps += 1;
            if members.len() == 1 {
                self.ended.push((
                    members[0].index,
                    FinishReason::Cancelled,
                    Some(error.to_string()),
                ));
            } else {
                tracing::warn!(%error, sequences = members.len(), "a batch failed; retrying each sequence alone");
                for member in &members {
                    publish(StepPoint::BeforeForward, &slots, ctx);
                    report.passes += 1;
                    report.tokens += member.count;
                    if let Err(error) =
                        self.run_pass(model, ctx, std::slice::from_ref(member), publish)
                    {
                        self.ended.push((
                            member.index,
                            FinishReason::Cancelled,
                            Some(error.to_string()),
                        ));
                    }
                }
            }
        }
        self.finish_ended(ctx);
        report
    }

    /// Removes the sequences that ended in this step, highest index first so indices stay valid.
    fn finish_ended<B: Backend>(&mut self, ctx: &mut Context<B>) {
        let mut ended = std::mem::take(&mut self.ended);
        ended.sort_by_key(|e| std::cmp::Reverse(e.0));
        ended.dedup_by_key(|e| e.0);
        for (index, reason, failure) in ended.drain(..) {
            let seq = self.running.remove(index);
            self.release(&seq, ctx);
            self.end(seq, reason, failure);
        }
        self.ended = ended;
    }

    /// Sampling (and log-probabilities) of every sequence with a row of logits (`row_of`), in
    /// parallel: each sequence has its own sampler, and a pass over the vocabulary per sequence
    /// is the engine thread's largest cost per step with many sequences running.
    fn sample_rows(
        &mut self,
        logits: &[f32],
        n_vocab: usize,
        row_of: &[Option<usize>],
    ) -> Vec<Option<Result<GeneratedToken, String>>> {
        let tokenizer = &self.tokenizer;
        self.running
            .par_iter_mut()
            .zip(row_of.par_iter())
            .map(|(seq, row)| {
                let row = (*row)?;
                let row_logits = &logits[row * n_vocab..(row + 1) * n_vocab];
                // Any choice made from NaN or +inf would be arbitrary: the sequence fails instead.
                if !crate::sample::logits_are_sane(row_logits) {
                    return Some(Err(crate::sample::NON_FINITE_MESSAGE.to_string()));
                }
                let token = seq.sampler.sample(row_logits);
                seq.sampler.accept(token);
                Some(Ok(GeneratedToken {
                    id: token,
                    logprob: seq.logprobs.map(|_| log_prob(row_logits, token as usize)),
                    top: match seq.logprobs {
                        Some(n) if n > 0 => top_log_probs(row_logits, n)
                            .into_iter()
                            .map(|(id, logprob)| TopLogprob {
                                id,
                                bytes: tokenizer.token_to_piece(id, false),
                                logprob,
                            })
                            .collect(),
                        _ => Vec::new(),
                    },
                    bytes: tokenizer.token_to_piece(token, false),
                }))
            })
            .collect()
    }

    /// One forward pass over `members`; on success their tokens are in the cache and every
    /// member with logits has sampled its next token.
    fn run_pass<B: Backend>(
        &mut self,
        model: &Model<B>,
        ctx: &mut Context<B>,
        members: &[Member],
        publish: &mut Publish<'_, B>,
    ) -> Result<(), ForwardError> {
        self.batch.clear();
        for member in members {
            let seq = &self.running[member.index];
            let seq_id = seq.seq_id.expect("running sequences have a sequence id");
            for offset in 0..member.count {
                let pos = seq.n_computed + offset;
                let last = offset + 1 == member.count;
                self.batch
                    .push(seq.tokens[pos], pos as u32, seq_id, last && member.logits);
            }
        }
        let n_vocab = model.n_vocab();
        let n_ctx = self.config.n_ctx;
        let tokenizer = &self.tokenizer;
        let mut row_of: Vec<Option<usize>> = vec![None; self.running.len()];
        for (row, member) in members.iter().filter(|m| m.logits).enumerate() {
            row_of[member.index] = Some(row);
        }
        // When every sequence that samples in this pass picks the plain arg-max and wants no
        // log-probabilities, the backend takes the arg-max where the logits are and only the
        // token ids come back (on a device: 4 bytes a sequence instead of the vocabulary).
        let plain_greedy = members.iter().filter(|m| m.logits).all(|m| {
            let seq = &self.running[m.index];
            seq.logprobs.is_none() && seq.sampler.is_plain_greedy()
        });
        let mut picks: Vec<Option<Result<GeneratedToken, String>>> = if plain_greedy {
            let greedy = model.forward_greedy(ctx, &self.batch)?;
            self.running
                .iter_mut()
                .zip(&row_of)
                .map(|(seq, row)| {
                    let token = greedy[(*row)?];
                    // NON_FINITE_ROW, or any index a backend got wrong, is no token.
                    if token as usize >= n_vocab {
                        return Some(Err(crate::sample::NON_FINITE_MESSAGE.to_string()));
                    }
                    seq.sampler.accept(token);
                    Some(Ok(GeneratedToken {
                        id: token,
                        logprob: None,
                        top: Vec::new(),
                        bytes: tokenizer.token_to_piece(token, false),
                    }))
                })
                .collect()
        } else {
            let logits = model.forward(ctx, &self.batch)?;
            self.sample_rows(logits, n_vocab, &row_of)
        };
        let now = Instant::now();
        publish(StepPoint::TokensReady, &self.slots(now), ctx);
        for member in members {
            let seq = &mut self.running[member.index];
            seq.n_computed += member.count;
            let prompt_part = seq.n_prompt.saturating_sub(seq.n_computed - member.count);
            self.totals.prompt_tokens_computed += member.count.min(prompt_part) as u64;
            let generated = match picks[member.index].take() {
                None => continue,
                Some(Ok(generated)) => generated,
                Some(Err(message)) => {
                    self.ended
                        .push((member.index, FinishReason::Cancelled, Some(message)));
                    continue;
                }
            };
            let token = generated.id;
            seq.first_token_at.get_or_insert(now);
            if self.tokenizer.is_eog(token) && !seq.ignore_eos {
                if seq.report_eog {
                    let _ = seq.events.send(Event::Tokens {
                        text: String::new(),
                        tokens: vec![generated],
                    });
                }
                self.ended.push((member.index, FinishReason::Stop, None));
                continue;
            }
            seq.tokens.push(token);
            seq.n_generated += 1;
            self.totals.generated_tokens += 1;
            let released = seq.filter.push(&generated.bytes);
            let sent = seq.events.send(Event::Tokens {
                text: released.text,
                tokens: vec![generated],
            });
            let reason = if sent.is_err() {
                // The caller dropped the stream without a cancel reaching us yet.
                Some(FinishReason::Cancelled)
            } else if released.stop {
                Some(FinishReason::Stop)
            } else if seq.max_tokens.is_some_and(|max| seq.n_generated >= max) {
                Some(FinishReason::Length)
            } else if seq.n_computed >= n_ctx {
                Some(FinishReason::ContextFull)
            } else {
                None
            };
            if let Some(reason) = reason {
                self.ended.push((member.index, reason, None));
            }
        }
        // Name the blocks that just filled, so later prompts with the same start share them.
        if self.config.prefix_cache && !ctx.has_recurrent_state() {
            for member in members {
                let seq = &self.running[member.index];
                if let Some(seq_id) = seq.seq_id {
                    ctx.kv_mut()
                        .register_full_blocks(seq_id, &seq.tokens[..seq.n_computed]);
                }
            }
        }
        Ok(())
    }
}
