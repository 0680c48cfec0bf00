//! Greedy continuations of the golden prompts match llama.cpp's by the rule of
//! `tests/data/golden/README.md`: equal up to the first step k where they part, and at k either
//! llama.cpp disagrees with itself, or ember chose llama.cpp's re-evaluated choice, or the top two
//! probabilities are within 2% of each other. Prompt token ids must be equal.
//!
//! Lines that still break the rule are listed in [`KNOWN_DIVERGENCES`] with the step where they
//! part; for those the test asserts that they either still part exactly there or now meet the rule
//! (reported, since the arithmetic follows the CPU's SIMD level and thread count: a line can match
//! on one machine and not another); parting anywhere else fails until the table is updated.

mod common;

use ember::batch::Batch;
use ember::generate::{eval_tokens, log_prob};
use ember::model::ContextParams;
use ember::sample::argmax;
use serde_json::Value;

/// A golden line whose greedy continuation still breaks the rule: it parts from llama.cpp's at
/// `step`, where ember picks `ember` and llama.cpp (both its runs) `llama`, which are not a near
/// tie.
struct KnownDivergence {
    model: &'static str,
    id: &'static str,
    step: usize,
    ember: u32,
    llama: u32,
}

// Lines that part from llama.cpp's greedy output on the CI machine type by more than the rule
// allows, with the log-probabilities at the parting step (token: ember, llama.cpp). None today:
// every line of both models meets the rule. Entries belong here only with an open issue.
const KNOWN_DIVERGENCES: &[KnownDivergence] = &[];

/// Evaluates the prompt in one batch, then one token at a time (as llama.cpp's generation run
/// did), greedily, without stopping at end-of-generation tokens. Returns the ids and, per step,
/// the log-probabilities of llama.cpp's two top candidates under ember's logits.
fn greedy(
    model: &ember::model::Model<ember::backend::cpu::CpuBackend>,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut ctx = model.new_context(ContextParams::with_ctx(prompt.len() + n + 1));
    let mut logits = eval_tokens(model, &mut ctx, 0, prompt, 512)
        .expect("prompt")
        .to_vec();
    let mut out = Vec::new();
    let mut all_logits = Vec::new();
    for i in 0..n {
        let t = argmax(&logits).expect("non-empty logits") as u32;
        out.push(t);
        all_logits.push(logits.clone());
        if i + 1 == n {
            break;
        }
        let mut batch = Batch::new();
        batch.push(t, (prompt.len() + i) as u32, 0, true);
        logits = model.forward(&mut ctx, &batch).expect("decode").to_vec();
    }
    (out, all_logits)
}

fn check_model(name: &str) {
    let lines: Vec<Value> = common::golden_jsonl("greedy.jsonl")
        .into_iter()
        .filter(|l| l["model"] == name)
        .collect();
    assert!(!lines.is_empty(), "no golden lines for {name}");
    let (model, tokenizer) = common::load(name);
    let mut failures = Vec::new();
    for line in &lines {
        let id = line["id"].as_str().unwrap();
        let prompt = line["prompt"].as_str().unwrap();
        let want_prompt: Vec<u32> = serde_json::from_value(line["prompt_ids"].clone()).unwrap();
        let want: Vec<u32> = serde_json::from_value(line["tokens"].clone()).unwrap();
        let steps = line["steps"].as_array().unwrap();
        let prompt_ids = tokenizer.encode(prompt, true, true);
        if prompt_ids != want_prompt {
            failures.push(format!(
                "{name}/{id}: prompt ids {prompt_ids:?}, expected {want_prompt:?}"
            ));
            continue;
        }
        let known = KNOWN_DIVERGENCES
            .iter()
            .find(|d| d.model == name && d.id == id);
        let (got, logits) = greedy(&model, &prompt_ids, want.len());
        let Some(k) = got.iter().zip(&want).position(|(a, b)| a != b) else {
            if known.is_some() {
                // The rule is met; the table records where the line parts on the machines the
                // project is measured on (the arithmetic follows the CPU's SIMD level), so a
                // machine that now matches is reported, not failed.
                eprintln!(
                    "{name}/{id}: all {} tokens equal here although KNOWN_DIVERGENCES lists it: \
                     remove it from the table once it holds on the CI machine",
                    want.len()
                );
            } else {
                eprintln!("{name}/{id}: all {} tokens equal", want.len());
            }
            continue;
        };
        let step = &steps[k];
        let step_id = step["id"].as_u64().unwrap() as u32;
        let top = step["top"].as_array().unwrap();
        let top_probs: Vec<f64> = top.iter().map(|t| t[1].as_f64().unwrap().exp()).collect();
        let near_tie = top_probs.len() == 2
            && (top_probs[0] - top_probs[1]).abs() <= 0.02 * top_probs[0].max(top_probs[1]);
        let ours: Vec<String> = top
            .iter()
            .map(|t| {
                let tok = t[0].as_u64().unwrap() as usize;
                format!(
                    "{tok}: ours {:.4} theirs {:.4}",
                    log_prob(&logits[k], tok),
                    t[1].as_f64().unwrap()
                )
            })
            .collect();
        let detail = format!(
            "{name}/{id}: parted at step {k}: ember {} llama.cpp {} (re-evaluated {step_id}); {}",
            got[k],
            want[k],
            ours.join(", ")
        );
        let passes = step_id != want[k] || got[k] == step_id || near_tie;
        match known {
            Some(d) if !passes && d.step == k && d.ember == got[k] && d.llama == want[k] => {
                eprintln!("known divergence (FIXME issue 2): {detail}");
            }
            Some(_) if passes => {
                eprintln!("meets the rule here although KNOWN_DIVERGENCES lists it: {detail}");
            }
            Some(_) => failures.push(format!(
                "{detail}; KNOWN_DIVERGENCES says it parts at step {} (ember {}, llama.cpp {}): \
                 update the table",
                known.map_or(0, |d| d.step),
                known.map_or(0, |d| d.ember),
                known.map_or(0, |d| d.llama)
            )),
            None if passes => eprintln!("ok: {detail}"),
            None => failures.push(detail),
        }
    }
    assert!(
        failures.is_empty(),
        "greedy mismatches:\n{}",
        failures.join("\n")
    );
}

#[test]
fn smollm2_greedy_matches_llama_cpp() {
    check_model("smollm2-135m-instruct-q4_1");
}

#[test]
fn gemma3_greedy_matches_llama_cpp() {
    check_model("gemma3-270m-q4_k_m");
}
