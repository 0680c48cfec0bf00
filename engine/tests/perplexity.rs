//! Perplexity on the golden text by llama-perplexity's protocol (`tests/data/golden/
//! perplexity.json`) is within 1% of llama.cpp's figure for both pinned models.

mod common;

use ember::generate::perplexity;
use ember::model::ContextParams;

fn check(name: &str) {
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::golden_dir().join("perplexity.json")).unwrap(),
    )
    .unwrap();
    let want = golden["models"][name]
        .as_f64()
        .unwrap_or_else(|| panic!("no figure for {name}"));
    let n_ctx = golden["ctx"].as_u64().unwrap() as usize;
    let text =
        std::fs::read_to_string(common::golden_dir().join(golden["text_file"].as_str().unwrap()))
            .unwrap();
    let (model, tokenizer) = common::load(name);
    let tokens = tokenizer.encode(&text, true, false);
    let bos = if tokenizer.add_bos() {
        tokenizer.bos()
    } else {
        None
    };
    let mut ctx = model.new_context(ContextParams::with_ctx(n_ctx));
    let result = perplexity(&model, &mut ctx, &tokens, n_ctx, n_ctx, bos, |c| {
        eprintln!(
            "{name}: [{}/{}] {:.4}",
            c.index + 1,
            c.n_chunks,
            c.running_ppl
        );
    })
    .unwrap();
    let rel = (result.ppl - want).abs() / want;
    eprintln!(
        "{name}: PPL {:.4} +/- {:.4}, llama.cpp {want}, relative difference {rel:.4}",
        result.ppl, result.ppl_stderr
    );
    assert!(
        rel <= 0.01,
        "{name}: PPL {:.4}, llama.cpp {want}: {:.2}% apart, expected at most 1%",
        result.ppl,
        rel * 100.0
    );
    assert_eq!(ctx.kv_stats().used, 0, "every chunk's blocks were returned");
}

#[test]
fn smollm2_perplexity_within_one_percent() {
    check("smollm2-135m-instruct-q4_1");
}

#[test]
fn gemma3_perplexity_within_one_percent() {
    check("gemma3-270m-q4_k_m");
}
