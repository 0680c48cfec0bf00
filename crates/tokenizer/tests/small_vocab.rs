//! The BPE and SentencePiece algorithms on hand-built vocabularies whose results can be worked
//! out by hand: merge order, tie-breaking, byte fallback, space prefix, and load errors.

use ember_tokenizer::{Tokenizer, TokenizerError, TokenizerSpec};

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// A byte-level BPE vocabulary: the given tokens after the single characters `a`..`e` and `Ġ`.
fn bpe(pre: &str, extra: &[&str], merges: &[&str]) -> Tokenizer {
    let mut tokens = strings(&["<|endoftext|>", "a", "b", "c", "d", "e", "Ġ", "!"]);
    tokens.extend(strings(extra));
    let mut types = vec![1; tokens.len()];
    types[0] = 3;
    Tokenizer::from_spec(&TokenizerSpec {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        tokens,
        token_types: Some(types),
        merges: Some(strings(merges)),
        eos: Some(0),
        bos: Some(0),
        ..TokenizerSpec::default()
    })
    .unwrap()
}

fn texts(t: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&id| t.token_text(id).unwrap().to_owned())
        .collect()
}

fn encode_texts(t: &Tokenizer, text: &str) -> Vec<String> {
    texts(t, &t.encode(text, false, false))
}

#[test]
fn bpe_merges_by_rank() {
    let t = bpe("gpt-2", &["ab", "bc", "abc"], &["b c", "a b", "a bc"]);
    assert_eq!(encode_texts(&t, "abc"), ["abc"]);
    let t = bpe("gpt-2", &["ab", "bc", "abc"], &["a b", "b c", "ab c"]);
    assert_eq!(encode_texts(&t, "abc"), ["abc"]);
    // Without the last merge the best first merge decides the split.
    let t = bpe("gpt-2", &["ab", "bc"], &["b c", "a b"]);
    assert_eq!(encode_texts(&t, "abc"), ["a", "bc"]);
    let t = bpe("gpt-2", &["ab", "bc"], &["a b", "b c"]);
    assert_eq!(encode_texts(&t, "abc"), ["ab", "c"]);
}

#[test]
fn bpe_ties_go_to_the_leftmost_pair() {
    let t = bpe("gpt-2", &["aa"], &["a a"]);
    assert_eq!(encode_texts(&t, "aaa"), ["aa", "a"]);
    assert_eq!(encode_texts(&t, "aaaa"), ["aa", "aa"]);
}

#[test]
fn bpe_words_do_not_merge_across_pre_tokenizer_boundaries() {
    let t = bpe("gpt-2", &["Ġa", "a!"], &["Ġ a", "a !"]);
    // GPT-2's pre-tokenizer puts "a" and "!" in separate words.
    assert_eq!(encode_texts(&t, "a! a"), ["a", "!", "Ġa"]);
}

#[test]
fn bpe_merge_results_outside_the_vocabulary_fall_back_to_characters() {
    // "a b" merges to "ab", which is not a token: llama.cpp then emits the ASCII bytes alone.
    let t = bpe("gpt-2", &[], &["a b"]);
    assert_eq!(encode_texts(&t, "ab"), ["a", "b"]);
}

#[test]
fn llama3_pre_tokenizer_takes_whole_words_that_are_tokens() {
    // "abc" is a token but no merge builds it: Llama 3's ignore_merges emits it whole.
    let t = bpe("llama-bpe", &["abc"], &["x y"]);
    assert_eq!(encode_texts(&t, "abc"), ["abc"]);
    assert!(t.add_bos(), "llama3 pre-tokenizers default to adding BOS");
    assert_eq!(t.encode("abc", true, false)[0], 0);
    let t = bpe("gpt-2", &["abc"], &["x y"]);
    assert_eq!(encode_texts(&t, "abc"), ["a", "b", "c"]);
}

#[test]
fn unknown_pre_tokenizer_warns_and_uses_the_default() {
    let t = bpe("no-such-pre", &[], &["a b"]);
    assert_eq!(t.warnings().len(), 1);
    assert!(
        t.warnings()[0].contains("unknown pre-tokenizer \"no-such-pre\""),
        "{:?}",
        t.warnings()
    );
    assert_eq!(encode_texts(&t, "a b"), ["a", "Ġ", "b"]);
}

#[test]
fn bpe_decoding_cleans_up_spaces_when_the_pre_tokenizer_says_so() {
    let t = bpe("gpt-2", &["Ġ!"], &["Ġ !"]);
    let ids = t.encode("a !", false, false);
    assert_eq!(texts(&t, &ids), ["a", "Ġ!"]);
    assert_eq!(
        t.decode(&ids, false),
        "a!",
        "gpt-2 cleans spaces before punctuation"
    );
    let t = bpe("smollm", &["Ġ!"], &["Ġ !"]);
    assert_eq!(
        t.decode(&t.encode("a !", false, false), false),
        "a !",
        "smollm keeps them"
    );
}

/// A SentencePiece vocabulary with byte fallback.
fn spm(extra: &[(&str, f32)], add_space_prefix: Option<bool>) -> Tokenizer {
    let mut tokens = strings(&["<unk>", "<s>", "</s>"]);
    let mut scores = vec![0.0; 3];
    let mut types = vec![2, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        types.push(6);
    }
    for (text, score) in [("▁", -1.0), ("a", -2.0), ("b", -2.0), ("c", -2.0)]
        .iter()
        .chain(extra)
    {
        tokens.push(text.to_string());
        scores.push(*score);
        types.push(1);
    }
    Tokenizer::from_spec(&TokenizerSpec {
        model: "llama".into(),
        tokens,
        scores: Some(scores),
        token_types: Some(types),
        add_space_prefix,
        ..TokenizerSpec::default()
    })
    .unwrap()
}

#[test]
fn spm_merges_the_best_scoring_pair_first() {
    let t = spm(&[("ab", -5.0), ("bc", -3.0)], Some(false));
    assert_eq!(encode_texts(&t, "abc"), ["a", "bc"]);
    let t = spm(&[("ab", -3.0), ("bc", -5.0)], Some(false));
    assert_eq!(encode_texts(&t, "abc"), ["ab", "c"]);
    // Equal scores: the leftmost pair wins.
    let t = spm(&[("ab", -3.0), ("bc", -3.0)], Some(false));
    assert_eq!(encode_texts(&t, "abc"), ["ab", "c"]);
}

#[test]
fn spm_falls_back_to_bytes() {
    let t = spm(&[], Some(false));
    assert_eq!(encode_texts(&t, "aé"), ["a", "<0xC3>", "<0xA9>"]);
    assert_eq!(t.decode(&t.encode("aé", false, false), false), "aé");
}

#[test]
fn spm_space_prefix_and_bos() {
    let t = spm(&[("▁a", -1.5)], None);
    assert!(t.add_bos(), "SentencePiece vocabularies add BOS by default");
    assert_eq!((t.bos(), t.eos(), t.unk()), (Some(1), Some(2), Some(0)));
    let ids = t.encode("a a", true, false);
    assert_eq!(texts(&t, &ids), ["<s>", "▁a", "▁a"]);
    // As llama_detokenize: the prefix space is removed from the first piece only, and a leading
    // BOS is the first piece (empty when special tokens are not rendered).
    assert_eq!(t.decode(&ids[1..], false), "a a");
    assert_eq!(t.decode(&ids, false), " a a");
    assert_eq!(t.decode(&ids, true), "<s> a a");
    // After a special token the next text gets a space prefix too.
    assert_eq!(
        texts(&t, &t.encode("a</s>a", false, true)),
        ["▁a", "</s>", "▁a"]
    );
    let t = spm(&[("▁a", -1.5)], Some(false));
    assert_eq!(encode_texts(&t, "a a"), ["a", "▁a"]);
}

#[test]
fn load_errors_name_what_is_wrong() {
    let err = Tokenizer::from_spec(&TokenizerSpec {
        model: "bert".into(),
        tokens: strings(&["a"]),
        ..TokenizerSpec::default()
    })
    .unwrap_err();
    assert!(matches!(err, TokenizerError::UnsupportedModel { .. }));
    assert_eq!(
        err.to_string(),
        "unsupported tokenizer model \"bert\" in tokenizer.ggml.model: expected \"gpt2\" (byte-level BPE) or \"llama\" (SentencePiece)"
    );

    let err = Tokenizer::from_spec(&TokenizerSpec {
        model: "gpt2".into(),
        tokens: strings(&["a"]),
        ..TokenizerSpec::default()
    })
    .unwrap_err();
    assert!(matches!(err, TokenizerError::MissingMerges), "{err}");

    let err = Tokenizer::from_spec(&TokenizerSpec {
        model: "llama".into(),
        tokens: strings(&["a", "b"]),
        token_types: Some(vec![1]),
        ..TokenizerSpec::default()
    })
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("tokenizer.ggml.token_type has 1 entries"),
        "{err}"
    );

    let err = Tokenizer::from_spec(&TokenizerSpec {
        model: "gpt2".into(),
        pre: Some("gpt-2".into()),
        tokens: strings(&["a", "b"]),
        merges: Some(vec![]),
        add_bos: Some(true),
        bos: None,
        ..TokenizerSpec::default()
    })
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "tokenizer.ggml.add_bos_token is true but the vocabulary has no BOS token: expected tokenizer.ggml.bos_token_id to be set"
    );

    let err = Tokenizer::from_spec(&TokenizerSpec {
        model: "llama".into(),
        tokens: strings(&["a", "b"]),
        eos: Some(9),
        ..TokenizerSpec::default()
    })
    .unwrap_err();
    assert!(
        err.to_string().contains("eos token id 9 is out of range"),
        "{err}"
    );

    let err = Tokenizer::from_spec(&TokenizerSpec {
        model: "llama".into(),
        ..TokenizerSpec::default()
    })
    .unwrap_err();
    assert!(matches!(err, TokenizerError::EmptyVocabulary));
}

/// A Gemma 4 vocabulary (`tokenizer.ggml.model = "gemma4"`): SentencePiece-style BPE over raw
/// UTF-8 with `▁` for spaces and `<0xNN>` byte tokens.
fn gemma4(add_bos: bool) -> Tokenizer {
    let tokens = strings(&[
        "<pad>", "<eos>", "<bos>", "<0x0A>", "<0xC3>", "<0xA9>", "a", "b", "▁", "▁a", "▁ab", "\n\n",
    ]);
    let mut types = vec![1; tokens.len()];
    types[..3].fill(3);
    types[3..6].fill(6);
    Tokenizer::from_spec(&TokenizerSpec {
        model: "gemma4".into(),
        // llama.cpp uses the gemma4 pre-tokenizer for this model whatever the file says.
        pre: Some("default".into()),
        tokens,
        token_types: Some(types),
        merges: Some(strings(&["▁ a", "▁a b"])),
        bos: Some(2),
        eos: Some(1),
        add_bos: Some(add_bos),
        ..TokenizerSpec::default()
    })
    .unwrap()
}

#[test]
fn gemma4_escapes_spaces_falls_back_to_bytes_and_keeps_newline_runs() {
    let t = gemma4(false);
    assert_eq!(encode_texts(&t, "a ab"), ["a", "▁ab"]);
    assert_eq!(encode_texts(&t, " a b"), ["▁a", "▁", "b"]);
    // `é` is no token: its two UTF-8 bytes are.
    assert_eq!(encode_texts(&t, "é"), ["<0xC3>", "<0xA9>"]);
    // Newlines split words; a run of them that is a token stays whole, others fall back to
    // bytes (no merge joins newlines).
    assert_eq!(encode_texts(&t, "a\n\nb"), ["a", "\n\n", "b"]);
    assert_eq!(
        encode_texts(&t, "a\n\n\nb"),
        ["a", "<0x0A>", "<0x0A>", "<0x0A>", "b"]
    );
    // BOS is added although the file says not to, as llama.cpp does for Gemma 4.
    assert_eq!(t.encode("ab", true, false)[0], 2);
    let ids = t.encode(" ab é\n\n", false, false);
    assert_eq!(t.decode(&ids, false), " ab é\n\n");
}
