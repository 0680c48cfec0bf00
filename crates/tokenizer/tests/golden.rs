//! Token ids of the reference models against llama.cpp's (tests/data/golden, see its README):
//! every line of `tokenize.jsonl` and the prompts and generations of `greedy.jsonl`.

mod common;

use common::{golden_path, model, GEMMA, SMOLLM};
use serde::Deserialize;

#[derive(Deserialize)]
struct TokenizeCase {
    model: String,
    text: String,
    ids_add_special_parse_special: Vec<u32>,
    ids_plain: Vec<u32>,
}

#[derive(Deserialize)]
struct GreedyCase {
    model: String,
    id: String,
    prompt: String,
    prompt_ids: Vec<u32>,
    tokens: Vec<u32>,
    text: String,
}

fn read_jsonl<T: for<'de> Deserialize<'de>>(name: &str) -> Vec<T> {
    let path = golden_path(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("{}:{}: {e}", path.display(), i + 1))
        })
        .collect()
}

#[test]
fn tokenize_jsonl_matches_llama_cpp() {
    let cases: Vec<TokenizeCase> = read_jsonl("tokenize.jsonl");
    assert!(cases.iter().any(|c| c.model == SMOLLM) && cases.iter().any(|c| c.model == GEMMA));
    let mut failures = Vec::new();
    for case in &cases {
        let t = &model(&case.model).tokenizer;
        let special = t.encode(&case.text, true, true);
        if special != case.ids_add_special_parse_special {
            failures.push(format!(
                "{} {:?} (add_special, parse_special):\n  expected {:?}\n  found    {:?}",
                case.model, case.text, case.ids_add_special_parse_special, special
            ));
        }
        let plain = t.encode(&case.text, false, false);
        if plain != case.ids_plain {
            failures.push(format!(
                "{} {:?} (plain):\n  expected {:?}\n  found    {:?}",
                case.model, case.text, case.ids_plain, plain
            ));
        }
        // Plain encoding reads special-token text as text, so decoding gives the input back.
        let decoded = t.decode(&case.ids_plain, false);
        if decoded != case.text {
            failures.push(format!(
                "{} decode of {:?} gave {:?}",
                case.model, case.text, decoded
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn greedy_prompts_and_generations_match_llama_cpp() {
    let cases: Vec<GreedyCase> = read_jsonl("greedy.jsonl");
    let mut failures = Vec::new();
    for case in &cases {
        let t = &model(&case.model).tokenizer;
        let ids = t.encode(&case.prompt, true, true);
        if ids != case.prompt_ids {
            let first_diff = ids.iter().zip(&case.prompt_ids).position(|(a, b)| a != b);
            failures.push(format!(
                "{} {}: prompt ids differ (lengths {} and {}, first difference at {:?})",
                case.model,
                case.id,
                case.prompt_ids.len(),
                ids.len(),
                first_diff
            ));
        }
        let text = t.decode(&case.tokens, false);
        if text != case.text {
            failures.push(format!(
                "{} {}: generated text\n  expected {:?}\n  found    {:?}",
                case.model, case.id, case.text, text
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
