//! Token sampling: turns one row of logits into the next token id.
//!
//! The chain and its defaults follow llama.cpp's sampler chain (penalties, top-k, top-p, min-p,
//! temperature, then a draw from the distribution), so the same flags mean the same thing in both
//! tools. A temperature of 0 (or below) is greedy decoding: the arg-max after penalties.

use std::collections::HashMap;
use std::collections::VecDeque;

/// Sampling parameters. `Default` gives llama.cpp's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerParams {
    /// Softmax temperature; `<= 0` means greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probabilities sum to at least `top_p`; 1.0 keeps all.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely one's; 0 keeps all.
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of recently seen tokens by this; 1.0 is off.
    pub repeat_penalty: f32,
    /// Subtract `count * frequency_penalty` from a recently seen token's logit.
    pub frequency_penalty: f32,
    /// Subtract `presence_penalty` from the logit of any recently seen token.
    pub presence_penalty: f32,
    /// How many of the most recent tokens the penalties look at; 0 disables them.
    pub penalty_last_n: usize,
    /// Seed of the random generator; the same seed gives the same tokens.
    pub seed: u64,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0x5EED,
        }
    }
}

impl SamplerParams {
    /// Greedy decoding: always the most likely token.
    pub fn greedy() -> Self {
        SamplerParams {
            temperature: 0.0,
            ..SamplerParams::default()
        }
    }
}

/// A sampling parameter that takes a real number: its `ember` flag, its request field, and the
/// range every caller (the command line, the server, the engine's door) accepts. The one place
/// these limits are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SamplingParam {
    Temperature,
    TopP,
    MinP,
    RepeatPenalty,
    PresencePenalty,
    FrequencyPenalty,
}

impl SamplingParam {
    /// Every parameter, in the order [`SamplerParams::validate`] checks them.
    pub const ALL: [SamplingParam; 6] = [
        SamplingParam::Temperature,
        SamplingParam::TopP,
        SamplingParam::MinP,
        SamplingParam::RepeatPenalty,
        SamplingParam::PresencePenalty,
        SamplingParam::FrequencyPenalty,
    ];

    /// The `ember run` flag that sets it.
    pub fn flag(self) -> &'static str {
        match self {
            SamplingParam::Temperature => "--temp",
            SamplingParam::TopP => "--top-p",
            SamplingParam::MinP => "--min-p",
            SamplingParam::RepeatPenalty => "--repeat-penalty",
            SamplingParam::PresencePenalty => "--presence-penalty",
            SamplingParam::FrequencyPenalty => "--frequency-penalty",
        }
    }

    /// The request field (OpenAI's and llama-server's name) that sets it.
    pub fn field(self) -> &'static str {
        match self {
            SamplingParam::Temperature => "temperature",
            SamplingParam::TopP => "top_p",
            SamplingParam::MinP => "min_p",
            SamplingParam::RepeatPenalty => "repeat_penalty",
            SamplingParam::PresencePenalty => "presence_penalty",
            SamplingParam::FrequencyPenalty => "frequency_penalty",
        }
    }

    /// The accepted values, both ends included (OpenAI's ranges where it has one; a repetition
    /// penalty must be positive, so that dividing by it keeps the logits' order).
    pub fn range(self) -> (f64, f64) {
        match self {
            SamplingParam::Temperature => (0.0, 2.0),
            SamplingParam::TopP | SamplingParam::MinP => (0.0, 1.0),
            SamplingParam::RepeatPenalty => (0.01, 10.0),
            SamplingParam::PresencePenalty | SamplingParam::FrequencyPenalty => (-2.0, 2.0),
        }
    }

    fn value(self, params: &SamplerParams) -> f32 {
        match self {
            SamplingParam::Temperature => params.temperature,
            SamplingParam::TopP => params.top_p,
            SamplingParam::MinP => params.min_p,
            SamplingParam::RepeatPenalty => params.repeat_penalty,
            SamplingParam::PresencePenalty => params.presence_penalty,
            SamplingParam::FrequencyPenalty => params.frequency_penalty,
        }
    }
}

/// A sampling parameter outside its range (NaN and the infinities included).
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("{} {value}: expected a number from {} to {}", .param.field(), .param.range().0, .param.range().1)]
pub struct SamplingError {
    pub param: SamplingParam,
    pub value: f32,
}

impl SamplingError {
    /// The same message naming the command-line flag instead of the request field.
    pub fn for_flag(&self) -> String {
        let (min, max) = self.param.range();
        format!(
            "{} {}: expected a number from {min} to {max}",
            self.param.flag(),
            self.value
        )
    }
}

impl SamplerParams {
    /// Checks every real-valued parameter against [`SamplingParam::range`]: the first one
    /// outside it (NaN and the infinities never inside) is the error.
    pub fn validate(&self) -> Result<(), SamplingError> {
        for param in SamplingParam::ALL {
            let value = param.value(self);
            let (min, max) = param.range();
            // The bounds rounded to f32 as a flag's value is, so `--repeat-penalty 0.01` passes.
            if !(value.is_finite() && (min as f32..=max as f32).contains(&value)) {
                return Err(SamplingError { param, value });
            }
        }
        Ok(())
    }
}

/// What a backend's `argmax_rows` gives for a row of logits that holds NaN or +inf (where the
/// backend checks: the CPU does, a device kernel takes the arg-max of the finite values). Never a
/// token id: a vocabulary has fewer than `u32::MAX` tokens.
pub const NON_FINITE_ROW: u32 = u32::MAX;

/// The error a sequence fails with when its logits hold NaN or +inf.
pub const NON_FINITE_MESSAGE: &str = "the model computed NaN or infinite logits for the next token: expected finite values (the model file is broken, or this input overflows it)";

/// Whether a row of logits can be sampled: no NaN and no +inf (-inf is a token ruled out, and
/// is allowed). A model that computes such values is broken for that input, and every choice
/// made from them would be arbitrary.
pub fn logits_are_sane(logits: &[f32]) -> bool {
    // One pass without branches per value: NaN and +inf are exactly the values `v < inf` rejects.
    logits.iter().fold(true, |ok, &v| ok & (v < f32::INFINITY))
}

/// A small, fast, seedable generator: PCG-XSH-RR 32 (O'Neill 2014) with a splitmix64-scrambled
/// seed. Written here so sampling is reproducible across platforms without another dependency.
#[derive(Debug, Clone)]
pub struct Pcg32 {
    state: u64,
    increment: u64,
}

impl Pcg32 {
    const MULTIPLIER: u64 = 6364136223846793005;

    /// A generator whose whole output is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        let initial = splitmix64(&mut sm);
        let stream = splitmix64(&mut sm);
        let mut rng = Pcg32 {
            state: 0,
            increment: (stream << 1) | 1,
        };
        rng.next_u32();
        rng.state = rng.state.wrapping_add(initial);
        rng.next_u32();
        rng
    }

    /// The next 32 random bits.
    pub fn next_u32(&mut self) -> u32 {
        let old = self.state;
        self.state = old
            .wrapping_mul(Self::MULTIPLIER)
            .wrapping_add(self.increment);
        let xorshifted = (((old >> 18) ^ old) >> 27) as u32;
        let rot = (old >> 59) as u32;
        xorshifted.rotate_right(rot)
    }

    /// A uniform float in [0, 1) with 24 random bits (every value exactly representable).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u32() >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
    }
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E3779B97F4A7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
    z ^ (z >> 31)
}

/// The index of the largest value (the first one on ties); `None` for an empty slice.
pub fn argmax(values: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in values.iter().enumerate() {
        // NaN never wins: only a strictly greater value replaces the current best.
        let better = match best {
            Some((_, b)) => v > b,
            None => true,
        };
        if better {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

/// Greedy decoding's choice: the index of the largest logit, the first one on ties; NaN and
/// -inf are never chosen, and a row with nothing else gives 0. The rule of every backend's
/// `argmax_rows` (the device kernel included), so greedy tokens are the same wherever the arg-max
/// is taken.
pub fn greedy_token(logits: &[f32]) -> u32 {
    let mut best = (0u32, f32::NEG_INFINITY);
    for (id, &l) in logits.iter().enumerate() {
        if l > best.1 {
            best = (id as u32, l);
        }
    }
    best.0
}

/// Log-softmax of `logits` computed in f64 for stability; used by perplexity and by tests that
/// compare probabilities.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let log_sum = sum.ln();
    logits.iter().map(|&l| l as f64 - max - log_sum).collect()
}

/// A stateful sampler: it remembers recent tokens for the penalties and owns its generator and
/// scratch space, so sampling a token allocates nothing after the first call.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplerParams,
    rng: Pcg32,
    recent: VecDeque<u32>,
    candidates: Vec<(u32, f32)>,
    counts: HashMap<u32, u32>,
}

impl Sampler {
    /// A sampler with `params`; its generator is seeded with `params.seed`.
    pub fn new(params: SamplerParams) -> Self {
        let rng = Pcg32::new(params.seed);
        Sampler {
            params,
            rng,
            recent: VecDeque::new(),
            candidates: Vec::new(),
            counts: HashMap::new(),
        }
    }

    /// The parameters this sampler was made with.
    pub fn params(&self) -> &SamplerParams {
        &self.params
    }

    /// Records a token as seen (prompt tokens and sampled ones) for the penalties.
    pub fn accept(&mut self, token: u32) {
        if self.params.penalty_last_n == 0 {
            return;
        }
        if self.recent.len() == self.params.penalty_last_n {
            self.recent.pop_front();
        }
        self.recent.push_back(token);
    }

    /// Forgets the tokens seen so far.
    pub fn reset(&mut self) {
        self.recent.clear();
    }

    /// Whether the next [`Sampler::sample`] is the plain arg-max of the logits ([`greedy_token`]):
    /// greedy, with no penalty in effect. The engine then lets the backend take the arg-max
    /// where the logits are.
    pub fn is_plain_greedy(&self) -> bool {
        self.params.temperature <= 0.0 && !self.penalties_active()
    }

    fn penalties_active(&self) -> bool {
        let p = &self.params;
        !self.recent.is_empty()
            && (p.repeat_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0)
    }

    /// Chooses the next token from one row of logits. Does not call [`Sampler::accept`].
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 && !self.penalties_active() {
            // Greedy without penalties: the arg-max, read straight from the logits (the same
            // choice as through the candidate list: the first largest, NaN never chosen).
            return greedy_token(logits);
        }
        self.candidates.clear();
        self.candidates
            .extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        if self.penalties_active() {
            self.apply_penalties();
        }
        if self.params.temperature <= 0.0 {
            return self.greedy_candidate();
        }
        self.sample_candidates()
    }

    fn apply_penalties(&mut self) {
        self.counts.clear();
        for &t in &self.recent {
            *self.counts.entry(t).or_insert(0) += 1;
        }
        let p = &self.params;
        for (&token, &count) in &self.counts {
            let Some(c) = self.candidates.get_mut(token as usize) else {
                continue;
            };
            // Same rule as llama.cpp: the repetition penalty always pushes the logit towards
            // "less likely", whatever its sign.
            if c.1 <= 0.0 {
                c.1 *= p.repeat_penalty;
            } else {
                c.1 /= p.repeat_penalty;
            }
            c.1 -= count as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }

    fn greedy_candidate(&self) -> u32 {
        let mut best = (0u32, f32::NEG_INFINITY);
        for &(id, l) in &self.candidates {
            if l > best.1 {
                best = (id, l);
            }
        }
        best.0
    }

    fn sample_candidates(&mut self) -> u32 {
        let p = self.params.clone();
        let cands = &mut self.candidates;
        // Sort once, by descending logit; every later filter keeps a prefix.
        let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1);
        if p.top_k > 0 && p.top_k < cands.len() {
            cands.select_nth_unstable_by(p.top_k - 1, by_logit_desc);
            cands.truncate(p.top_k);
        }
        cands.sort_unstable_by(by_logit_desc);
        if cands.is_empty() {
            return 0;
        }

        // Probabilities before temperature, as llama.cpp's top-p and min-p see them.
        let max = cands[0].1;
        let mut probs: Vec<f32> = cands.iter().map(|c| (c.1 - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= sum);

        if p.top_p < 1.0 {
            let mut cumulative = 0.0;
            let mut keep = cands.len();
            for (i, &pr) in probs.iter().enumerate() {
                cumulative += pr;
                if cumulative >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cands.truncate(keep);
            probs.truncate(keep);
        }
        if p.min_p > 0.0 {
            let threshold = probs[0] * p.min_p;
            let keep = probs
                .iter()
                .take_while(|&&pr| pr >= threshold)
                .count()
                .max(1);
            cands.truncate(keep);
        }

        // Temperature, then a draw from the renormalized distribution.
        let max = cands[0].1 / p.temperature;
        let mut weights: Vec<f32> = cands
            .iter()
            .map(|c| (c.1 / p.temperature - max).exp())
            .collect();
        let total: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= total);
        let r = self.rng.next_f32();
        let mut cumulative = 0.0;
        for (i, &w) in weights.iter().enumerate() {
            cumulative += w;
            if r < cumulative {
                return cands[i].0;
            }
        }
        cands[cands.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_the_argmax() {
        let mut s = Sampler::new(SamplerParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, -2.0, 2.9]), 1);
    }

    #[test]
    fn greedy_takes_the_first_largest_and_never_nan() {
        let mut s = Sampler::new(SamplerParams::greedy());
        assert_eq!(s.sample(&[f32::NAN, 1.0, 3.0, 3.0, f32::NEG_INFINITY]), 2);
        assert_eq!(s.sample(&[f32::NAN, f32::NAN]), 0);
        // With a penalty window the candidate path decides, and agrees where nothing repeats.
        let mut penalised = Sampler::new(SamplerParams {
            repeat_penalty: 1.5,
            ..SamplerParams::greedy()
        });
        penalised.accept(0);
        assert_eq!(
            penalised.sample(&[f32::NAN, 1.0, 3.0, 3.0, f32::NEG_INFINITY]),
            2
        );
    }

    #[test]
    fn repeat_penalty_changes_the_greedy_choice() {
        let mut s = Sampler::new(SamplerParams {
            repeat_penalty: 2.0,
            ..SamplerParams::greedy()
        });
        s.accept(1);
        // 3.0 / 2 = 1.5 < 2.9
        assert_eq!(s.sample(&[0.1, 3.0, -2.0, 2.9]), 3);
    }

    #[test]
    fn presence_and_frequency_penalties_subtract() {
        let params = SamplerParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplerParams::greedy()
        };
        let mut s = Sampler::new(params);
        s.accept(0);
        s.accept(0);
        // 2.0 - 0.5 - 2 * 0.25 = 1.0 < 1.2
        assert_eq!(s.sample(&[2.0, 1.2]), 1);
    }

    #[test]
    fn penalty_window_forgets_old_tokens() {
        let params = SamplerParams {
            repeat_penalty: 10.0,
            penalty_last_n: 2,
            ..SamplerParams::greedy()
        };
        let mut s = Sampler::new(params);
        s.accept(0);
        s.accept(5);
        s.accept(6);
        assert_eq!(s.sample(&[2.0, 1.9]), 0);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_one_is_greedy() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let params = SamplerParams {
            temperature: 1.5,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(params.clone());
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(params.clone());
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(
            a.iter().collect::<std::collections::HashSet<_>>().len() > 3,
            "draws vary: {a:?}"
        );
        let mut s = Sampler::new(SamplerParams { top_k: 1, ..params });
        let want = argmax(&logits).unwrap() as u32;
        assert!((0..20).all(|_| s.sample(&logits) == want));
    }

    #[test]
    fn min_p_and_top_p_cut_the_tail() {
        // One dominant token: min-p 0.5 must leave only it.
        let logits = [10.0, 0.0, 0.0, 0.0];
        let mut s = Sampler::new(SamplerParams {
            min_p: 0.5,
            top_k: 0,
            top_p: 1.0,
            ..Default::default()
        });
        assert!((0..50).all(|_| s.sample(&logits) == 0));
        let mut s = Sampler::new(SamplerParams {
            min_p: 0.0,
            top_k: 0,
            top_p: 0.5,
            ..Default::default()
        });
        assert!((0..50).all(|_| s.sample(&logits) == 0));
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // Two tokens with probabilities 0.75 and 0.25 at temperature 1.
        let logits = [3f32.ln(), 0.0];
        let params = SamplerParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 7,
            ..Default::default()
        };
        let mut s = Sampler::new(params);
        let n = 20000;
        let zeros = (0..n).filter(|_| s.sample(&logits) == 0).count();
        let frac = zeros as f64 / n as f64;
        // Standard error is sqrt(0.75 * 0.25 / 20000) ~= 0.003; 0.02 is over six of them.
        assert!((frac - 0.75).abs() < 0.02, "fraction of token 0: {frac}");
    }

    #[test]
    fn validation_names_the_parameter_and_refuses_non_finite_values() {
        assert_eq!(SamplerParams::default().validate(), Ok(()));
        assert_eq!(SamplerParams::greedy().validate(), Ok(()));
        let cases = [
            (
                SamplerParams {
                    temperature: f32::NAN,
                    ..Default::default()
                },
                SamplingParam::Temperature,
            ),
            (
                SamplerParams {
                    temperature: f32::INFINITY,
                    ..Default::default()
                },
                SamplingParam::Temperature,
            ),
            (
                SamplerParams {
                    temperature: -1.0,
                    ..Default::default()
                },
                SamplingParam::Temperature,
            ),
            (
                SamplerParams {
                    top_p: 2.0,
                    ..Default::default()
                },
                SamplingParam::TopP,
            ),
            (
                SamplerParams {
                    min_p: 2.0,
                    ..Default::default()
                },
                SamplingParam::MinP,
            ),
            (
                SamplerParams {
                    repeat_penalty: f32::NAN,
                    ..Default::default()
                },
                SamplingParam::RepeatPenalty,
            ),
            (
                SamplerParams {
                    repeat_penalty: 0.0,
                    ..Default::default()
                },
                SamplingParam::RepeatPenalty,
            ),
            (
                SamplerParams {
                    repeat_penalty: -1.0,
                    ..Default::default()
                },
                SamplingParam::RepeatPenalty,
            ),
            (
                SamplerParams {
                    presence_penalty: f32::NEG_INFINITY,
                    ..Default::default()
                },
                SamplingParam::PresencePenalty,
            ),
            (
                SamplerParams {
                    frequency_penalty: 3.0,
                    ..Default::default()
                },
                SamplingParam::FrequencyPenalty,
            ),
        ];
        for (params, param) in cases {
            let error = params.validate().unwrap_err();
            assert_eq!(error.param, param, "{params:?}");
        }
        let error = SamplerParams {
            temperature: f32::NAN,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(
            error.to_string(),
            "temperature NaN: expected a number from 0 to 2"
        );
        assert_eq!(
            error.for_flag(),
            "--temp NaN: expected a number from 0 to 2"
        );
    }

    #[test]
    fn non_finite_logits_are_caught() {
        assert!(logits_are_sane(&[0.0, -1.0, f32::NEG_INFINITY, f32::MAX]));
        assert!(!logits_are_sane(&[0.0, f32::NAN, 1.0]));
        assert!(!logits_are_sane(&[0.0, f32::INFINITY]));
    }

    #[test]
    fn log_softmax_sums_to_one() {
        let ls = log_softmax(&[1.0, 2.0, 3.0]);
        let total: f64 = ls.iter().map(|l| l.exp()).sum();
        assert!((total - 1.0).abs() < 1e-12);
        assert_eq!(argmax(&[1.0, 5.0, 5.0]), Some(1));
        assert_eq!(argmax(&[]), None);
    }
}
