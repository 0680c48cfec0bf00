//! Encoding cases beyond the golden file on the reference models: expectations derived from the
//! vocabularies, and round trips (`decode(encode(x)) == x`) on hand-picked and random text.

mod common;

use common::{golden_path, model, GEMMA, SMOLLM};
use ember_tokenizer::{StreamDecoder, Tokenizer, TokenizerKind};
use proptest::prelude::*;

fn smollm() -> &'static Tokenizer {
    &model(SMOLLM).tokenizer
}

fn gemma() -> &'static Tokenizer {
    &model(GEMMA).tokenizer
}

fn id(t: &Tokenizer, text: &str) -> u32 {
    t.token_id(text)
        .unwrap_or_else(|| panic!("{text:?} is not a token"))
}

fn round_trip(t: &Tokenizer, text: &str) {
    let ids = t.encode(text, false, false);
    assert_eq!(t.decode(&ids, false), text, "ids {ids:?}");
    // With special tokens parsed the text still comes back, special tokens rendered as text.
    let ids = t.encode(text, false, true);
    assert_eq!(t.decode(&ids, true), text, "ids {ids:?}");
}

#[test]
fn kinds_and_special_tokens() {
    assert_eq!(
        smollm().kind(),
        TokenizerKind::Bpe {
            pre: "smollm".to_owned()
        }
    );
    assert_eq!(gemma().kind(), TokenizerKind::SentencePiece);
    assert_eq!(
        (smollm().vocab_size(), gemma().vocab_size()),
        (49152, 262144)
    );
    assert_eq!(
        (smollm().bos(), smollm().eos(), smollm().add_bos()),
        (Some(1), Some(2), false)
    );
    assert_eq!(
        (gemma().bos(), gemma().eos(), gemma().add_bos()),
        (Some(2), Some(1), true)
    );
    assert!(!smollm().add_eos() && !gemma().add_eos());
    assert!(smollm().warnings().is_empty() && gemma().warnings().is_empty());

    let im_end = id(smollm(), "<|im_end|>");
    assert!(smollm().is_eog(im_end) && smollm().is_eog(id(smollm(), "<|endoftext|>")));
    assert!(
        !smollm().is_eog(id(smollm(), "<|im_start|>")) && !smollm().is_eog(id(smollm(), "Hello"))
    );
    assert_eq!(smollm().eot(), Some(im_end));

    let end_of_turn = id(gemma(), "<end_of_turn>");
    assert!(gemma().is_eog(end_of_turn) && gemma().is_eog(1));
    assert!(!gemma().is_eog(id(gemma(), "<start_of_turn>")) && !gemma().is_eog(2));
    // `</s>` (a user-defined token in Gemma 3) is on llama.cpp's list of end-of-generation texts.
    assert_eq!(
        gemma().eog_tokens().collect::<Vec<_>>(),
        [1, end_of_turn, id(gemma(), "</s>")]
    );
}

#[test]
fn pieces_of_tokens() {
    let t = smollm();
    assert_eq!(t.token_to_piece(id(t, "Ġworld"), false), b" world");
    assert_eq!(t.token_to_piece(id(t, "Ċ"), false), b"\n");
    assert_eq!(t.token_to_piece(1, false), b"");
    assert_eq!(t.token_to_piece(1, true), b"<|im_start|>");
    assert_eq!(t.token_to_piece(u32::MAX, true), b"");

    let g = gemma();
    assert_eq!(g.token_to_piece(id(g, "▁world"), false), b" world");
    assert_eq!(g.token_to_piece(id(g, "<0xE2>"), false), [0xE2]);
    assert_eq!(g.token_to_piece(105, false), b"");
    assert_eq!(g.token_to_piece(105, true), b"<start_of_turn>");
    // User-defined tokens are text whatever `render_special` says.
    assert_eq!(g.token_to_piece(id(g, "\n\n"), false), b"\n\n");
    assert_eq!(g.decode(&[2, 105, u32::MAX, 9259], false), "Hello");
}

#[test]
fn digits_are_single_tokens_in_smollm() {
    let t = smollm();
    let digits: Vec<u32> = "2024".chars().map(|c| id(t, &c.to_string())).collect();
    assert_eq!(t.encode("2024", false, false), digits);
    let mut expected = vec![id(t, "in"), id(t, "Ġ")];
    expected.extend(&digits);
    assert_eq!(t.encode("in 2024", false, false), expected);
}

#[test]
fn special_tokens_inside_text() {
    let t = smollm();
    let (a, b) = (id(t, "a"), id(t, "b"));
    assert_eq!(t.encode("a<|im_end|>b", false, true), [a, 2, b]);
    let plain = t.encode("a<|im_end|>b", false, false);
    assert!(!plain.contains(&2), "{plain:?}");
    assert_eq!(t.encode("<|im_start|><|im_end|>", true, true), [1, 2]);

    let g = gemma();
    assert_eq!(
        g.encode("<start_of_turn><end_of_turn>", true, true),
        [2, 105, 106]
    );
    assert_eq!(g.encode("<bos>", false, true), [2]);
    assert_ne!(g.encode("<bos>", false, false), [2]);
}

#[test]
fn empty_text() {
    assert_eq!(smollm().encode("", true, true), Vec::<u32>::new());
    assert_eq!(gemma().encode("", true, true), [2]);
    assert_eq!(gemma().encode("", false, false), Vec::<u32>::new());
    assert_eq!(gemma().decode(&[], false), "");
}

#[test]
fn long_space_runs_use_gemmas_whitespace_tokens() {
    // Gemma's vocabulary has user-defined tokens for 2..=31 spaces (ids 138..=167); the partition
    // cuts the longest first: 1000 = 32 * 31 + 8.
    let g = gemma();
    let text = format!("{}x", " ".repeat(1000));
    let mut expected = vec![id(g, &" ".repeat(31)); 32];
    expected.push(id(g, &" ".repeat(8)));
    expected.push(id(g, "x"));
    assert_eq!(g.encode(&text, false, false), expected);
    round_trip(g, &text);
    round_trip(smollm(), &text);
    round_trip(smollm(), &"\n".repeat(500));
    round_trip(gemma(), &" \t\n".repeat(300));
}

#[test]
fn hand_picked_texts_round_trip() {
    for text in [
        "Hello, world!",
        "naïve café résumé Ünïcödé",
        "日本語のテキストと中文文本 한국어 텍스트",
        "emoji 🦀🔥 👩‍💻 🏳️‍🌈 family 👨‍👩‍👧‍👦",
        "don't can't I'm we'll they've IT'S O'NEIL",
        "3.14159 1,000,000 0x7fff 1e-9 ١٢٣ ⅫⅣ",
        "tabs\tand\r\nCRLF\u{0B}vertical\u{0C}feed\u{85}next",
        "\u{200B}\u{FEFF}\u{2028}\u{3000}\u{A0}\u{1680}",
        "<|im_start|> <start_of_turn> <bos> <0x41> [multimodal]",
        "Ġ Ċ ĠĠ",
        "\u{10FFFF}\u{E000}\u{FFFD}",
        " leading and trailing ",
    ] {
        round_trip(smollm(), text);
        round_trip(gemma(), text);
    }
}

#[test]
fn gpl3_round_trips() {
    let text = std::fs::read_to_string(golden_path("gpl-3.txt")).unwrap();
    for t in [smollm(), gemma()] {
        let ids = t.encode(&text, true, false);
        assert!(
            ids.len() > 5000 && ids.len() < 12000,
            "{} tokens",
            ids.len()
        );
        assert_eq!(t.decode(&ids, false), text);
    }
}

#[test]
fn stream_decoder_never_splits_characters() {
    for t in [smollm(), gemma()] {
        let text = "emoji 🦀🔥 👩‍💻 日本語 naïve \u{10FFFF}!";
        let ids = t.encode(text, false, false);
        let mut decoder = StreamDecoder::new(t);
        let mut streamed = String::new();
        let mut empty_pushes = 0;
        for &id in &ids {
            let part = decoder.push(id);
            empty_pushes += usize::from(part.is_empty());
            assert!(
                !part.contains('\u{FFFD}'),
                "partial character emitted: {part:?}"
            );
            streamed.push_str(&part);
        }
        streamed.push_str(&decoder.finish());
        assert_eq!(streamed, text);
        if t.kind() != TokenizerKind::SentencePiece {
            assert!(
                empty_pushes > 0,
                "byte tokens of one character must wait for each other"
            );
        }
    }
}

#[test]
fn stream_decoder_flushes_an_incomplete_character_as_replacement() {
    let g = gemma();
    let mut decoder = StreamDecoder::new(g);
    assert_eq!(decoder.push(id(g, "<0xF0>")), "");
    assert_eq!(decoder.push(id(g, "<0x9F>")), "");
    // A byte that cannot continue the character: the broken prefix becomes U+FFFD.
    assert_eq!(decoder.push(id(g, "<0x41>")), "\u{FFFD}A");
    assert_eq!(decoder.push(id(g, "<0xE2>")), "");
    assert_eq!(decoder.finish(), "\u{FFFD}");
    assert_eq!(decoder.finish(), "");
    let mut special = StreamDecoder::new(g).render_special(true);
    assert_eq!(special.push(105), "<start_of_turn>");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn any_text_round_trips(text in "\\PC{0,40}|[ a-z\\n\\t'0-9<|>_]{0,60}|\\p{Han}{0,20}") {
        let ids = smollm().encode(&text, false, false);
        prop_assert_eq!(smollm().decode(&ids, false), text.clone());
        // SentencePiece writes spaces as U+2581, so that character reads back as a space.
        if !text.contains('\u{2581}') {
            let ids = gemma().encode(&text, false, false);
            prop_assert_eq!(gemma().decode(&ids, false), text.clone());
        }
    }

    #[test]
    fn any_bytes_as_text_encode_without_panicking(text in any::<String>()) {
        for t in [smollm(), gemma()] {
            let ids = t.encode(&text, true, true);
            prop_assert!(ids.iter().all(|&id| (id as usize) < t.vocab_size()));
            let decoded = t.decode(&ids, true);
            let expected = if t.add_bos() { format!("<bos>{text}") } else { text.clone() };
            if !text.contains('\u{2581}') {
                prop_assert_eq!(decoded, expected);
            }
        }
    }
}
