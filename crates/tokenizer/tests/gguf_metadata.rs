//! Loading from GGUF metadata written by `GgufWriter`: a well-formed small vocabulary, and files
//! whose tokenizer keys are missing, mistyped or inconsistent, which must be errors naming the
//! key, never panics.

use ember_gguf::{Array, Gguf, GgufWriter, Value};
use ember_tokenizer::{ChatTemplate, Tokenizer, TokenizerError};

fn strings(items: &[&str]) -> Value {
    Value::Array(Array::String(items.iter().map(|s| s.to_string()).collect()))
}

/// A SentencePiece vocabulary `<unk> <s> </s> ▁ a b ▁a`, with the given keys replaced or added.
fn spm_file(overrides: &[(&str, Option<Value>)]) -> Gguf {
    let mut entries: Vec<(&str, Value)> = vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        (
            "tokenizer.ggml.tokens",
            strings(&["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a"]),
        ),
        (
            "tokenizer.ggml.scores",
            Value::Array(Array::F32(vec![0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -1.5])),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(Array::I32(vec![2, 3, 3, 1, 1, 1, 1])),
        ),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
        (
            "tokenizer.chat_template",
            Value::String("{% for m in messages %}[{{ m.content }}]{% endfor %}".into()),
        ),
    ];
    for (key, value) in overrides {
        entries.retain(|(k, _)| k != key);
        if let Some(value) = value {
            entries.push((key, value.clone()));
        }
    }
    let mut writer = GgufWriter::new();
    for (key, value) in entries {
        writer.metadata(key, value);
    }
    Gguf::from_bytes(writer.to_bytes()).expect("the writer's output parses")
}

fn load_err(overrides: &[(&str, Option<Value>)]) -> String {
    Tokenizer::from_gguf(&spm_file(overrides))
        .unwrap_err()
        .to_string()
}

#[test]
fn a_small_sentencepiece_file_loads_and_encodes() {
    let g = spm_file(&[]);
    let t = Tokenizer::from_gguf(&g).unwrap();
    assert_eq!(t.encode("a a", true, false), [1, 6, 6]);
    assert_eq!(t.decode(&[6, 5], false), "ab");
    let template = ChatTemplate::from_gguf(&g)
        .unwrap()
        .expect("the file has a template");
    let msgs = [ember_tokenizer::ChatMessage::new("user", "x")];
    assert_eq!(template.render(&msgs, false, "", "").unwrap(), "[x]");
}

#[test]
fn integer_scores_and_negative_ids_are_accepted() {
    let g = spm_file(&[
        (
            "tokenizer.ggml.scores",
            Some(Value::Array(Array::I32(vec![0, 0, 0, -1, -2, -2, -1]))),
        ),
        ("tokenizer.ggml.padding_token_id", Some(Value::I32(-1))),
    ]);
    let t = Tokenizer::from_gguf(&g).unwrap();
    assert_eq!(t.pad(), None);
    assert_eq!(
        t.warnings(),
        ["tokenizer.ggml.padding_token_id is -1: treated as not set"]
    );
    assert_eq!(t.encode("a", false, false), [6]);
}

#[test]
fn missing_and_mistyped_keys_name_the_key() {
    let err = load_err(&[("tokenizer.ggml.model", None)]);
    assert!(err.contains("tokenizer.ggml.model"), "{err}");
    let err = load_err(&[("tokenizer.ggml.tokens", None)]);
    assert!(err.contains("tokenizer.ggml.tokens"), "{err}");
    let err = load_err(&[(
        "tokenizer.ggml.tokens",
        Some(Value::Array(Array::I32(vec![1, 2]))),
    )]);
    assert!(err.contains("tokenizer.ggml.tokens"), "{err}");
    let err = load_err(&[("tokenizer.ggml.model", Some(Value::U32(3)))]);
    assert!(err.contains("tokenizer.ggml.model"), "{err}");
    let err = load_err(&[("tokenizer.ggml.scores", Some(Value::String("no".into())))]);
    assert!(err.contains("tokenizer.ggml.scores"), "{err}");
    let err = load_err(&[("tokenizer.ggml.add_bos_token", Some(Value::U8(1)))]);
    assert!(err.contains("tokenizer.ggml.add_bos_token"), "{err}");
}

#[test]
fn inconsistent_vocabularies_are_errors() {
    let err = load_err(&[(
        "tokenizer.ggml.scores",
        Some(Value::Array(Array::F32(vec![0.0; 3]))),
    )]);
    assert_eq!(
        err,
        "tokenizer.ggml.scores has 3 entries but tokenizer.ggml.tokens has 7: expected the same length"
    );
    let err = load_err(&[(
        "tokenizer.ggml.token_type",
        Some(Value::Array(Array::I32(vec![1; 9]))),
    )]);
    assert!(
        err.contains("tokenizer.ggml.token_type has 9 entries"),
        "{err}"
    );
    let err = load_err(&[("tokenizer.ggml.eos_token_id", Some(Value::U32(7)))]);
    assert_eq!(
        err,
        "eos token id 7 is out of range: expected an id below the vocabulary size 7"
    );
    let err = load_err(&[(
        "tokenizer.ggml.tokens",
        Some(strings(&["a", "b", "a", "c", "d", "e", "f"])),
    )]);
    assert!(
        err.contains("duplicate token \"a\" in tokenizer.ggml.tokens at ids 0 and 2"),
        "{err}"
    );
    let err = load_err(&[("tokenizer.ggml.model", Some(Value::String("t5".into())))]);
    assert!(err.contains("unsupported tokenizer model \"t5\""), "{err}");
    let err = load_err(&[("tokenizer.ggml.model", Some(Value::String("gpt2".into())))]);
    assert!(err.contains("tokenizer.ggml.merges is missing"), "{err}");
}

#[test]
fn broken_chat_templates_are_errors() {
    let g = spm_file(&[(
        "tokenizer.chat_template",
        Some(Value::String("{% if %}".into())),
    )]);
    assert!(matches!(
        ChatTemplate::from_gguf(&g),
        Err(TokenizerError::TemplateSyntax(_))
    ));
    let g = spm_file(&[("tokenizer.chat_template", None)]);
    assert!(ChatTemplate::from_gguf(&g).unwrap().is_none());
    let g = spm_file(&[("tokenizer.chat_template", Some(Value::U32(1)))]);
    assert!(ChatTemplate::from_gguf(&g)
        .unwrap_err()
        .to_string()
        .contains("tokenizer.chat_template"));
}

#[test]
fn tokenizer_and_template_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<ChatTemplate>();
}
