//! Chat templates: the reference models' real templates against the prompt text derived by reading
//! them, the shipped templates against the real ones, and the limits on hostile templates.

mod common;

use std::time::{Duration, Instant};

use common::{model, GEMMA, SMOLLM};
use ember_tokenizer::{ChatMessage, ChatTemplate, TokenizerError};

const SMOLLM_SYSTEM: &str =
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";

fn gemma3_template() -> ChatTemplate {
    let src = include_str!("data/gemma3_chat_template.jinja");
    ChatTemplate::from_source(src).expect("Gemma 3's template compiles")
}

fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
    pairs
        .iter()
        .map(|(r, c)| ChatMessage::new(*r, *c))
        .collect()
}

fn render(t: &ChatTemplate, m: &[ChatMessage], gen: bool) -> String {
    t.render(m, gen, "<bos>", "<eos>")
        .unwrap_or_else(|e| panic!("render failed: {e}"))
}

#[test]
fn smollm_template_from_the_file_is_chatml_with_a_default_system_prompt() {
    let t = model(SMOLLM)
        .template
        .as_ref()
        .expect("SmolLM2 ships a chat template");
    let user = msgs(&[("user", "Write a haiku about GPUs.")]);
    assert_eq!(
        render(t, &user, true),
        format!("{SMOLLM_SYSTEM}<|im_start|>user\nWrite a haiku about GPUs.<|im_end|>\n<|im_start|>assistant\n")
    );
    // The golden chat prompt of greedy.jsonl is this render without the generation prompt.
    assert_eq!(
        render(t, &user, false),
        format!("{SMOLLM_SYSTEM}<|im_start|>user\nWrite a haiku about GPUs.<|im_end|>\n")
    );
    let with_system = msgs(&[
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", "Hello!"),
        ("user", "Bye"),
    ]);
    assert_eq!(
        render(t, &with_system, true),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn rendered_chatml_tokenizes_into_control_tokens() {
    let loaded = model(SMOLLM);
    let t = loaded.template.as_ref().unwrap();
    let prompt = render(t, &msgs(&[("user", "hi")]), true);
    let ids = loaded.tokenizer.encode(&prompt, true, true);
    let im_start = loaded.tokenizer.token_id("<|im_start|>").unwrap();
    let im_end = loaded.tokenizer.token_id("<|im_end|>").unwrap();
    assert_eq!(ids.iter().filter(|&&id| id == im_start).count(), 3);
    assert_eq!(ids.iter().filter(|&&id| id == im_end).count(), 2);
    assert_eq!(loaded.tokenizer.decode(&ids, true), prompt);
}

#[test]
fn gemma3_template_folds_the_system_prompt_into_the_first_turn() {
    let t = gemma3_template();
    assert_eq!(
        render(&t, &msgs(&[("user", "Write a haiku about GPUs.")]), true),
        "<bos><start_of_turn>user\nWrite a haiku about GPUs.<end_of_turn>\n<start_of_turn>model\n"
    );
    assert_eq!(
        render(
            &t,
            &msgs(&[("system", "Be brief."), ("user", "  Hi \n"), ("assistant", "Hello!"), ("user", "Bye")]),
            false
        ),
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n\
         <start_of_turn>user\nBye<end_of_turn>\n"
    );
}

#[test]
fn gemma3_template_raises_on_roles_out_of_order() {
    let err = gemma3_template()
        .render(&msgs(&[("assistant", "first")]), true, "<bos>", "<eos>")
        .unwrap_err();
    assert!(matches!(err, TokenizerError::TemplateRender(_)), "{err:?}");
    assert!(
        err.to_string()
            .contains("Conversation roles must alternate user/assistant/user/assistant/..."),
        "{err}"
    );
}

/// The chat prompt of a model in greedy.jsonl (the text llama.cpp was given).
fn golden_chat_prompt(model_name: &str) -> (String, Vec<u32>) {
    let path = common::golden_path("greedy.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v["model"] == model_name && v["id"] == "chat-haiku" {
            let ids = v["prompt_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap() as u32);
            return (v["prompt"].as_str().unwrap().to_owned(), ids.collect());
        }
    }
    panic!(
        "no chat-haiku prompt for {model_name} in {}",
        path.display()
    );
}

#[test]
fn rendered_prompts_match_the_golden_chat_prompts() {
    let haiku = msgs(&[("user", "Write a haiku about GPUs.")]);

    let (prompt, ids) = golden_chat_prompt(SMOLLM);
    let smollm = model(SMOLLM);
    assert_eq!(
        render(smollm.template.as_ref().unwrap(), &haiku, true),
        prompt
    );
    assert_eq!(smollm.tokenizer.encode(&prompt, true, true), ids);

    // The Gemma prompt was tokenized with add_special, which adds the BOS the template writes.
    let (prompt, ids) = golden_chat_prompt(GEMMA);
    let gemma = model(GEMMA);
    let rendered = render(&gemma3_template(), &haiku, true);
    assert_eq!(rendered.strip_prefix("<bos>"), Some(prompt.as_str()));
    assert_eq!(gemma.tokenizer.encode(&rendered, false, true), ids);
}

#[test]
fn shipped_templates_match_the_models_own() {
    let conversations = [
        msgs(&[("user", "Hello")]),
        msgs(&[
            ("system", "You are terse."),
            ("user", "2+2?"),
            ("assistant", " 4 "),
            ("user", "and 3+3?"),
        ]),
        msgs(&[("user", "multi\nline\n\n text ")]),
    ];
    let gemma =
        ChatTemplate::builtin_for(&model(GEMMA).tokenizer).expect("Gemma has <start_of_turn>");
    let chatml =
        ChatTemplate::builtin_for(&model(SMOLLM).tokenizer).expect("SmolLM has <|im_start|>");
    let real_gemma = gemma3_template();
    for m in &conversations {
        for gen in [false, true] {
            assert_eq!(render(&gemma, m, gen), render(&real_gemma, m, gen));
            let mut expected = String::new();
            for message in m {
                expected.push_str(&format!(
                    "<|im_start|>{}\n{}<|im_end|>\n",
                    message.role, message.content
                ));
            }
            if gen {
                expected.push_str("<|im_start|>assistant\n");
            }
            assert_eq!(render(&chatml, m, gen), expected);
        }
    }
    assert!(ChatTemplate::builtin("no-such-template").is_none());
}

#[test]
fn gemma_file_has_no_template() {
    assert!(model(GEMMA).template.is_none());
}

#[test]
fn python_string_methods_and_helpers_work() {
    let t = ChatTemplate::from_source(
        "{{ messages[0].content.strip().upper() }}|{{ messages[0].content.startswith(' a') }}|\
         {{ messages[0].content.split(',') | length }}|{{ messages | tojson }}|{{ strftime_now('%Y') | length }}",
    )
    .unwrap();
    assert_eq!(
        render(&t, &msgs(&[("user", " a,b ")]), false),
        r#"A,B|True|2|[{"role":"user","content":" a,b "}]|4"#
    );
}

#[test]
fn json_messages_with_content_parts_and_extra_variables() {
    let messages = serde_json::json!([
        {"role": "user", "content": [{"type": "text", "text": " Describe "}, {"type": "image"}]},
        {"role": "assistant", "content": "A cat."},
    ]);
    let mut extra = serde_json::Map::new();
    // `extra` cannot replace the fixed variables.
    extra.insert("bos_token".into(), serde_json::json!("<not-bos>"));
    let rendered = gemma3_template()
        .render_json(&messages, true, "<bos>", "<eos>", &extra)
        .unwrap();
    assert_eq!(
        rendered,
        "<bos><start_of_turn>user\nDescribe<start_of_image><end_of_turn>\n\
         <start_of_turn>model\nA cat.<end_of_turn>\n<start_of_turn>model\n"
    );
    let t = ChatTemplate::from_source("{{ tools | length }} {{ tools[0].name }}").unwrap();
    extra.insert("tools".into(), serde_json::json!([{"name": "get_weather"}]));
    assert_eq!(
        t.render_json(&serde_json::json!([]), false, "", "", &extra)
            .unwrap(),
        "1 get_weather"
    );
}

#[test]
fn template_syntax_errors_are_reported() {
    let err = ChatTemplate::from_source("{% for %}").unwrap_err();
    assert!(matches!(err, TokenizerError::TemplateSyntax(_)), "{err:?}");
}

#[test]
fn endless_templates_run_out_of_fuel() {
    let t = ChatTemplate::from_source(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}{% endfor %}{% endfor %}{% endfor %}",
    )
    .unwrap()
    // The default budget takes seconds to burn in a debug build; the mechanism is the same.
    .with_fuel(1_000_000);
    let started = Instant::now();
    let err = t.render(&[], false, "", "").unwrap_err();
    assert!(
        err.to_string()
            .contains("ran out of fuel after 1000000 instructions"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn huge_output_is_refused() {
    let t = ChatTemplate::from_source("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}")
        .unwrap();
    let err = t.render(&[], false, "", "").unwrap_err();
    assert!(err.to_string().contains("output exceeds"), "{err}");
}

#[test]
fn oversized_templates_are_refused_before_compiling() {
    let src = format!(
        "{{{{ '{}' }}}}",
        "x".repeat(ember_tokenizer::MAX_TEMPLATE_BYTES)
    );
    let err = ChatTemplate::from_source(&src).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "chat template is {} bytes: expected at most {}",
            src.len(),
            ember_tokenizer::MAX_TEMPLATE_BYTES
        )
    );
}
