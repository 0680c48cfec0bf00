//! A byte-level BPE vocabulary (GGUF tokenizer model `gpt2`) of any size from 256 bytes plus the
//! shape's special tokens upward, so `ember run -p "text"` works on a synthetic model.
//!
//! Tokens are, in order: the 256 byte tokens in GPT-2's printable alphabet, merges learned from
//! the GPL-3 text of the golden data (classic BPE training: repeatedly merge the most frequent
//! adjacent pair), then, when the vocabulary must be larger than that text supports, merges of a
//! space-led learned token with a learned continuation, picked by a fixed hash. The special
//! tokens of the shape's family sit at the front or the back, as in the real vocabularies.
//! Nothing depends on the weight seed: one shape always has one tokenizer.

use std::collections::{HashMap, HashSet};
use std::sync::OnceLock;

use crate::shapes::TokenizerStyle;
use crate::SynthError;

/// Training text for the merges (the GNU GPL v3, which the golden perplexity data uses too).
const CORPUS: &str = include_str!("../../../tests/data/golden/gpl-3.txt");

/// Most merges learned from [`CORPUS`]; beyond this (or when pairs become unique) merges are
/// synthesised.
const MAX_LEARNED_MERGES: usize = 4000;

/// `tokenizer.ggml.token_type` values.
const TOKEN_NORMAL: i32 = 1;
const TOKEN_CONTROL: i32 = 3;

/// The `tokenizer.*` metadata of a synthetic model.
#[derive(Debug, Clone)]
pub struct Vocabulary {
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    pub merges: Vec<String>,
    pub bos: u32,
    pub eos: u32,
    pub padding: u32,
    pub add_bos: bool,
    /// `tokenizer.ggml.pre`.
    pub pre: &'static str,
    pub chat_template: &'static str,
}

const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
const LLAMA3_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
const GEMMA_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}";

/// Special tokens of a family, whether they come first, and which are BOS, EOS and padding
/// (indices into the list).
struct Specials {
    texts: &'static [&'static str],
    first: bool,
    bos: usize,
    eos: usize,
    padding: usize,
    add_bos: bool,
    pre: &'static str,
    chat_template: &'static str,
}

fn specials(style: TokenizerStyle) -> Specials {
    match style {
        TokenizerStyle::Llama3 => Specials {
            texts: &[
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|reserved_special_token_0|>",
                "<|reserved_special_token_1|>",
                "<|finetune_right_pad_id|>",
                "<|reserved_special_token_2|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eom_id|>",
                "<|eot_id|>",
                "<|python_tag|>",
            ],
            first: false,
            bos: 0,
            eos: 9,
            padding: 4,
            add_bos: true,
            pre: "llama-bpe",
            chat_template: LLAMA3_TEMPLATE,
        },
        TokenizerStyle::SmolLm2 => Specials {
            texts: &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            first: true,
            bos: 1,
            eos: 2,
            padding: 2,
            add_bos: false,
            pre: "smollm",
            chat_template: CHATML_TEMPLATE,
        },
        TokenizerStyle::Qwen => Specials {
            texts: &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            first: false,
            bos: 0,
            eos: 2,
            padding: 0,
            add_bos: false,
            pre: "qwen2",
            chat_template: CHATML_TEMPLATE,
        },
        TokenizerStyle::Gemma => Specials {
            texts: &[
                "<pad>",
                "<eos>",
                "<bos>",
                "<unk>",
                "<start_of_turn>",
                "<end_of_turn>",
            ],
            first: true,
            bos: 2,
            eos: 1,
            padding: 0,
            add_bos: true,
            pre: "default",
            chat_template: GEMMA_TEMPLATE,
        },
    }
}

/// GPT-2's map of bytes to printable characters: printable Latin-1 bytes stand for themselves,
/// the others for code points from 256 upward in byte order.
fn byte_chars() -> [char; 256] {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let cp = if printable(b) {
            b
        } else {
            next += 1;
            next - 1
        };
        // Every code point here is below 0x200, so never a surrogate.
        table[b as usize] = char::from_u32(cp).unwrap_or('\u{fffd}');
    }
    table
}

/// Merges and the tokens they create, learned once per process from [`CORPUS`].
struct Learned {
    /// `"left right"`, best first.
    merges: Vec<String>,
    /// The text each merge creates, `None` where an earlier merge already created it.
    created: Vec<Option<String>>,
}

fn learned() -> &'static Learned {
    static LEARNED: OnceLock<Learned> = OnceLock::new();
    LEARNED.get_or_init(|| learn(CORPUS, MAX_LEARNED_MERGES))
}

#[derive(PartialEq, Eq, Clone, Copy)]
enum CharClass {
    Letter,
    Digit,
    Space,
    Other,
}

fn class(c: char) -> CharClass {
    if c.is_alphabetic() {
        CharClass::Letter
    } else if c.is_numeric() {
        CharClass::Digit
    } else if c.is_whitespace() {
        CharClass::Space
    } else {
        CharClass::Other
    }
}

/// Splits text roughly as GPT-2's pre-tokenizer does: runs of letters or of punctuation with at
/// most one leading space, digits in groups of up to three, runs of other whitespace.
fn pre_split(text: &str) -> Vec<&str> {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let mut words = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let start = chars[i].0;
        let mut j = i;
        // A single space joins the run that follows it.
        if chars[j].1 == ' ' && j + 1 < chars.len() && class(chars[j + 1].1) != CharClass::Space {
            j += 1;
        }
        let c = class(chars[j].1);
        let mut end = j + 1;
        while end < chars.len()
            && class(chars[end].1) == c
            && !(c == CharClass::Digit && end - j >= 3)
        {
            end += 1;
        }
        // As GPT-2's `\s+(?!\S)`: a whitespace run leaves its last space to the word after it.
        if c == CharClass::Space && end - j > 1 && end < chars.len() && chars[end - 1].1 == ' ' {
            end -= 1;
        }
        let stop = chars.get(end).map_or(text.len(), |&(at, _)| at);
        words.push(&text[start..stop]);
        i = end;
    }
    words
}

/// Classic BPE training: count adjacent symbol pairs over the words of `text` (weighted by word
/// frequency) and merge the most frequent pair, until `max_merges` or until no pair occurs twice.
/// Ties go to the pair whose symbols come first in byte order, so the result is deterministic.
fn learn(text: &str, max_merges: usize) -> Learned {
    let chars = byte_chars();
    let mut word_counts: HashMap<String, i64> = HashMap::new();
    for word in pre_split(text) {
        let encoded: String = word.bytes().map(|b| chars[b as usize]).collect();
        *word_counts.entry(encoded).or_insert(0) += 1;
    }
    let mut sorted_words: Vec<(String, i64)> = word_counts.into_iter().collect();
    sorted_words.sort();
    let mut words: Vec<(Vec<String>, i64)> = sorted_words
        .into_iter()
        .map(|(w, n)| (w.chars().map(String::from).collect(), n))
        .collect();

    let mut pairs: HashMap<(String, String), i64> = HashMap::new();
    let add_pairs = |pairs: &mut HashMap<(String, String), i64>, symbols: &[String], n: i64| {
        for w in symbols.windows(2) {
            *pairs.entry((w[0].clone(), w[1].clone())).or_insert(0) += n;
        }
    };
    for (symbols, n) in &words {
        add_pairs(&mut pairs, symbols, *n);
    }
    let mut known: HashSet<String> = chars.iter().map(|c| c.to_string()).collect();
    let mut merges = Vec::new();
    let mut created = Vec::new();
    while merges.len() < max_merges {
        let Some(((left, right), count)) = pairs
            .iter()
            .filter(|(_, &n)| n > 0)
            .max_by(|(pa, na), (pb, nb)| na.cmp(nb).then_with(|| pb.cmp(pa)))
            .map(|(p, &n)| (p.clone(), n))
        else {
            break;
        };
        if count < 2 {
            break;
        }
        let joined = format!("{left}{right}");
        for (symbols, n) in &mut words {
            if !symbols.windows(2).any(|w| w[0] == left && w[1] == right) {
                continue;
            }
            for w in symbols.windows(2) {
                if let Some(c) = pairs.get_mut(&(w[0].clone(), w[1].clone())) {
                    *c -= *n;
                }
            }
            let mut merged = Vec::with_capacity(symbols.len());
            let mut k = 0;
            while k < symbols.len() {
                if k + 1 < symbols.len() && symbols[k] == left && symbols[k + 1] == right {
                    merged.push(joined.clone());
                    k += 2;
                } else {
                    merged.push(symbols[k].clone());
                    k += 1;
                }
            }
            *symbols = merged;
            add_pairs(&mut pairs, symbols, *n);
        }
        pairs.retain(|_, n| *n > 0);
        merges.push(format!("{left} {right}"));
        created.push(known.insert(joined.clone()).then_some(joined));
    }
    Learned { merges, created }
}

/// SplitMix64's output function: a fixed, well-mixed hash of `x`.
pub(crate) fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Builds the vocabulary of `style` with exactly `n_vocab` tokens.
pub fn build(style: TokenizerStyle, n_vocab: usize) -> Result<Vocabulary, SynthError> {
    let sp = specials(style);
    let minimum = 256 + sp.texts.len() + 1;
    if n_vocab < minimum {
        return Err(SynthError::VocabTooSmall {
            minimum,
            found: n_vocab,
        });
    }
    let n_regular = n_vocab - sp.texts.len();
    let chars = byte_chars();
    let mut regular: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let mut seen: HashSet<String> = regular.iter().cloned().collect();
    let mut merges = Vec::new();

    let learned = learned();
    for (merge, created) in learned.merges.iter().zip(&learned.created) {
        if regular.len() == n_regular {
            break;
        }
        merges.push(merge.clone());
        if let Some(text) = created {
            seen.insert(text.clone());
            regular.push(text.clone());
        }
    }

    if regular.len() < n_regular {
        // Word-start tokens (a leading GPT-2 space, `Ġ`) joined with continuations: the shapes
        // real vocabularies are full of. Both sides are tokens, so each merge is well-formed.
        let space = chars[b' ' as usize];
        let starts: Vec<String> = regular
            .iter()
            .filter(|t| t.starts_with(space) && t.chars().count() > 1)
            .cloned()
            .collect();
        let continuations: Vec<String> = regular
            .iter()
            .filter(|t| !t.contains(space) && t.chars().all(char::is_alphanumeric))
            .cloned()
            .collect();
        if starts.is_empty() || continuations.is_empty() {
            return Err(SynthError::VocabTooLarge {
                found: n_vocab,
                reason: "the training text gave no tokens to combine".into(),
            });
        }
        let needed = n_regular - regular.len();
        let max_attempts = needed.saturating_mul(64).max(1 << 20);
        let mut attempt = 0u64;
        while regular.len() < n_regular {
            if attempt as usize >= max_attempts {
                return Err(SynthError::VocabTooLarge {
                    found: n_vocab,
                    reason: format!(
                        "only {} distinct tokens could be formed from {} word starts and {} continuations",
                        regular.len() + sp.texts.len(),
                        starts.len(),
                        continuations.len()
                    ),
                });
            }
            let h = mix64(attempt);
            attempt += 1;
            let left = &starts[(h % starts.len() as u64) as usize];
            let right = &continuations[((h >> 32) % continuations.len() as u64) as usize];
            let joined = format!("{left}{right}");
            if seen.insert(joined.clone()) {
                merges.push(format!("{left} {right}"));
                regular.push(joined);
            }
        }
    }

    let special: Vec<String> = sp.texts.iter().map(|s| s.to_string()).collect();
    let (tokens, offset) = if sp.first {
        ([special, regular].concat(), 0)
    } else {
        let offset = regular.len();
        ([regular, special].concat(), offset)
    };
    let special_range = offset..offset + sp.texts.len();
    let token_types = (0..tokens.len())
        .map(|i| {
            if special_range.contains(&i) {
                TOKEN_CONTROL
            } else {
                TOKEN_NORMAL
            }
        })
        .collect();
    Ok(Vocabulary {
        tokens,
        token_types,
        merges,
        bos: (offset + sp.bos) as u32,
        eos: (offset + sp.eos) as u32,
        padding: (offset + sp.padding) as u32,
        add_bos: sp.add_bos,
        pre: sp.pre,
        chat_template: sp.chat_template,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_gpt2s() {
        let c = byte_chars();
        assert_eq!(c[b'a' as usize], 'a');
        assert_eq!(c[b' ' as usize], 'Ġ');
        assert_eq!(c[b'\n' as usize], 'Ċ');
        assert_eq!(c[0], 'Ā');
        let distinct: HashSet<char> = c.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn pre_split_keeps_one_leading_space_and_groups_digits() {
        assert_eq!(
            pre_split("The GNU  license, 12345!"),
            ["The", " GNU", " ", " license", ",", " 123", "45", "!"]
        );
    }

    #[test]
    fn learned_merges_start_with_the_commonest_pairs() {
        let l = learned();
        assert!(l.merges.len() > 1000, "{} merges", l.merges.len());
        assert!(
            l.merges[..20].iter().any(|m| m == "Ġ t"),
            "{:?}",
            &l.merges[..20]
        );
    }

    #[test]
    fn vocabularies_have_exactly_the_asked_size_and_unique_tokens() {
        for (style, n) in [
            (TokenizerStyle::Llama3, 128_256),
            (TokenizerStyle::SmolLm2, 49_152),
            (TokenizerStyle::Gemma, 300),
            (TokenizerStyle::Qwen, 2000),
        ] {
            let v = build(style, n).unwrap();
            assert_eq!(v.tokens.len(), n);
            assert_eq!(v.token_types.len(), n);
            let unique: HashSet<&String> = v.tokens.iter().collect();
            assert_eq!(unique.len(), n, "{style:?}");
            assert_eq!(v.token_types[v.bos as usize], TOKEN_CONTROL);
            assert_eq!(v.token_types[v.eos as usize], TOKEN_CONTROL);
        }
        assert_eq!(
            build(TokenizerStyle::Llama3, 200).unwrap_err(),
            SynthError::VocabTooSmall {
                minimum: 268,
                found: 200
            }
        );
    }

    #[test]
    fn the_same_size_gives_the_same_vocabulary() {
        let a = build(TokenizerStyle::Qwen, 5000).unwrap();
        let b = build(TokenizerStyle::Qwen, 5000).unwrap();
        assert_eq!(a.tokens, b.tokens);
        assert_eq!(a.merges, b.merges);
    }
}
