//! The vocabulary: token texts, scores and attributes, the special token ids, and the first stage
//! of encoding, which cuts special-token text out of the input before the model's algorithm runs
//! on the rest (llama.cpp's `tokenizer_st_partition`).

use std::collections::{BTreeSet, HashMap};

use crate::TokenizerError;

/// Token attributes, as llama.cpp's `llama_token_attr` bits.
pub(crate) mod attr {
    pub const UNKNOWN: u16 = 1 << 0;
    pub const UNUSED: u16 = 1 << 1;
    pub const NORMAL: u16 = 1 << 2;
    pub const CONTROL: u16 = 1 << 3;
    pub const USER_DEFINED: u16 = 1 << 4;
    pub const BYTE: u16 = 1 << 5;
    /// The partition strips whitespace before the token.
    pub const LSTRIP: u16 = 1 << 7;
    /// The partition strips whitespace after the token.
    pub const RSTRIP: u16 = 1 << 8;
}

/// `tokenizer.ggml.token_type` values.
fn attr_of_type(token_type: i32) -> u16 {
    match token_type {
        1 => attr::NORMAL,
        2 => attr::UNKNOWN,
        3 => attr::CONTROL,
        4 => attr::USER_DEFINED,
        5 => attr::UNUSED,
        6 => attr::BYTE,
        // 0 ("undefined") and anything newer: no attribute, so the token is never emitted as text.
        _ => 0,
    }
}

#[derive(Debug, Clone)]
pub(crate) struct TokenData {
    pub text: String,
    pub score: f32,
    pub attr: u16,
}

/// Special token ids read from the file or found by their text.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
}

/// The ids a vocabulary needs before its special tokens are resolved.
pub(crate) struct VocabInput<'a> {
    pub tokens: &'a [String],
    pub scores: Option<&'a [f32]>,
    pub token_types: Option<&'a [i32]>,
    pub special: SpecialIds,
    /// Phi-3's rule (llama.cpp recognises the model by `general.name`): whitespace after special
    /// tokens is dropped, except after `<unk>`, `<s>` and `<|endoftext|>`.
    pub rstrip_special: bool,
}

#[derive(Debug)]
pub(crate) struct Vocab {
    pub tokens: Vec<TokenData>,
    token_to_id: TextIndex,
    pub special: SpecialIds,
    /// Tokens that end generation.
    pub eog: BTreeSet<u32>,
    /// Control, user-defined and unknown tokens, longest text first: the order in which the
    /// partition cuts them out of the text.
    special_order: Vec<u32>,
    /// Rank of each token in `special_order` (u32::MAX for tokens not in it).
    special_rank: HashMap<u32, usize>,
    special_trie: Trie,
}

/// Texts that llama.cpp treats as end-of-turn when the file names no EOT token.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Texts whose token ends generation (llama.cpp's list).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Fill-in-the-middle tokens that end generation when present (pad, repository, file separator).
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];

impl Vocab {
    pub(crate) fn new(input: VocabInput<'_>) -> Result<Vocab, TokenizerError> {
        let n_tokens = input.tokens.len();
        if n_tokens == 0 {
            return Err(TokenizerError::EmptyVocabulary);
        }
        if u32::try_from(n_tokens).is_err() {
            return Err(TokenizerError::VocabularyTooLarge { n_tokens });
        }
        for (key, len) in [
            ("tokenizer.ggml.scores", input.scores.map(<[f32]>::len)),
            (
                "tokenizer.ggml.token_type",
                input.token_types.map(<[i32]>::len),
            ),
        ] {
            if let Some(len) = len {
                if len != n_tokens {
                    return Err(TokenizerError::LengthMismatch { key, len, n_tokens });
                }
            }
        }

        let mut tokens: Vec<TokenData> = Vec::with_capacity(n_tokens);
        let mut token_to_id = TextIndex::with_capacity(n_tokens);
        for (i, text) in input.tokens.iter().enumerate() {
            let id = i as u32;
            // llama.cpp renames empty tokens so that every text is unique and non-empty.
            let text = if text.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                text.clone()
            };
            // `id` is pushed right below; the index only reads texts of earlier ids.
            if let Some(first) = token_to_id.insert(&tokens, &text, id) {
                return Err(TokenizerError::DuplicateToken {
                    text,
                    first,
                    second: id,
                });
            }
            let attr = match input.token_types {
                Some(types) => attr_of_type(types[i]),
                None => attr::NORMAL,
            };
            let score = input.scores.map_or(0.0, |s| s[i]);
            tokens.push(TokenData { text, score, attr });
        }

        let mut special = input.special;
        for (name, id) in [
            ("bos", &mut special.bos),
            ("eos", &mut special.eos),
            ("eot", &mut special.eot),
            ("eom", &mut special.eom),
            ("unknown", &mut special.unk),
            ("padding", &mut special.pad),
        ] {
            if let Some(value) = *id {
                if value as usize >= n_tokens {
                    return Err(TokenizerError::SpecialIdOutOfRange {
                        name,
                        id: value,
                        n_tokens,
                    });
                }
            }
        }

        let mut vocab = Vocab {
            tokens,
            token_to_id,
            special,
            eog: BTreeSet::new(),
            special_order: Vec::new(),
            special_rank: HashMap::new(),
            special_trie: Trie::default(),
        };
        vocab.resolve_special_tokens();
        vocab.build_special_index();
        if input.rstrip_special {
            for i in 0..vocab.special_order.len() {
                let id = vocab.special_order[i];
                vocab.tokens[id as usize].attr |= attr::RSTRIP;
            }
            if let Some(id) = vocab.text_to_token("</s>") {
                vocab.tokens[id as usize].attr |= attr::RSTRIP;
            }
            for text in ["<unk>", "<s>", "<|endoftext|>"] {
                if let Some(id) = vocab.text_to_token(text) {
                    vocab.tokens[id as usize].attr &= !attr::RSTRIP;
                }
            }
        }
        Ok(vocab)
    }

    pub(crate) fn text_to_token(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(&self.tokens, text)
    }

    pub(crate) fn attr(&self, id: u32) -> u16 {
        self.tokens.get(id as usize).map_or(0, |t| t.attr)
    }

    /// Finds a token by one of `texts`, preferring the earliest text of the list.
    fn find_any(&self, texts: &[&str]) -> Option<u32> {
        texts.iter().find_map(|t| self.text_to_token(t))
    }

    /// Marks a token found by its text as control, as llama.cpp does for "control-looking" tokens
    /// that a converter left as normal (it then also becomes a special token of the partition).
    fn force_control(&mut self, id: u32) {
        self.tokens[id as usize].attr |= attr::CONTROL;
    }

    /// EOT, FIM and end-of-generation tokens found by their text, as llama.cpp's loader does.
    fn resolve_special_tokens(&mut self) {
        if self.special.eot.is_none() {
            if let Some(id) = self.find_any(EOT_TEXTS) {
                self.special.eot = Some(id);
                self.force_control(id);
            }
        }
        if self.special.eom.is_none() {
            if let Some(id) = self.find_any(&["<|eom_id|>"]) {
                self.special.eom = Some(id);
                self.force_control(id);
            }
        }
        for texts in [FIM_PAD_TEXTS, FIM_REP_TEXTS, FIM_SEP_TEXTS] {
            if let Some(id) = self.find_any(texts) {
                self.force_control(id);
                self.eog.insert(id);
            }
        }
        // Control tokens named "unused..." are reserved slots, never generated text.
        for token in &mut self.tokens {
            if token.attr & attr::CONTROL != 0 && token.text.contains("unused") {
                token.attr |= attr::UNUSED;
            }
        }
        for text in EOG_TEXTS {
            if let Some(id) = self.text_to_token(text) {
                self.eog.insert(id);
                self.force_control(id);
            }
        }
        for id in [self.special.eos, self.special.eot, self.special.eom]
            .into_iter()
            .flatten()
        {
            self.eog.insert(id);
        }
        // Harmony-style vocabularies (<|return|> and <|call|>, or <|calls|> and <|flush|>) use
        // <|end|> between messages of one turn, so it must not stop generation there.
        let has = |t: &str| {
            self.text_to_token(t)
                .is_some_and(|id| self.eog.contains(&id))
        };
        let harmony = has("<|end|>")
            && (has("<|call|>") || has("<|calls|>"))
            && (has("<|return|>") || has("<|flush|>"));
        let tool_response_and_s = has("<|tool_response>") && has("</s>");
        if harmony {
            if let Some(end) = self.text_to_token("<|end|>") {
                self.eog.remove(&end);
                self.tokens[end as usize].attr = attr::USER_DEFINED;
            }
        }
        if tool_response_and_s {
            if let Some(s) = self.text_to_token("</s>") {
                self.eog.remove(&s);
                self.tokens[s as usize].attr = attr::NORMAL;
            }
        }
    }

    fn build_special_index(&mut self) {
        let mut order: Vec<u32> = (0..self.tokens.len() as u32)
            .filter(|&id| {
                self.tokens[id as usize].attr & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN)
                    != 0
            })
            .collect();
        // Longest first, so that a token containing another is cut out before it. llama.cpp's
        // sort leaves ties in no defined order; ids break them here.
        order.sort_by(|&a, &b| {
            let (la, lb) = (
                self.tokens[a as usize].text.len(),
                self.tokens[b as usize].text.len(),
            );
            lb.cmp(&la).then(a.cmp(&b))
        });
        let mut trie = Trie::default();
        for &id in &order {
            trie.insert(self.tokens[id as usize].text.as_bytes(), id);
        }
        self.special_rank = order
            .iter()
            .enumerate()
            .map(|(rank, &id)| (id, rank))
            .collect();
        self.special_order = order;
        self.special_trie = trie;
    }

    /// Cuts the special tokens out of `text`: control and unknown tokens only when
    /// `parse_special`, user-defined tokens always.
    pub(crate) fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut fragments = vec![Fragment::Text(text)];
        // Only tokens that occur somewhere in the text can split it; finding them in one pass
        // over the text keeps the per-token loop below short (Gemma has ~6400 special tokens).
        let mut present: Vec<usize> = Vec::new();
        let bytes = text.as_bytes();
        for start in 0..bytes.len() {
            self.special_trie.for_each_prefix(&bytes[start..], |id| {
                if let Some(&rank) = self.special_rank.get(&id) {
                    present.push(rank);
                }
            });
        }
        present.sort_unstable();
        present.dedup();

        for rank in present {
            let id = self.special_order[rank];
            let token = &self.tokens[id as usize];
            if !parse_special && token.attr & (attr::CONTROL | attr::UNKNOWN) != 0 {
                continue;
            }
            let needle = token.text.as_str();
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(mut rest) = fragment else {
                    next.push(fragment);
                    continue;
                };
                let is_space = |c: char| c.is_ascii_whitespace() || c == '\u{0B}';
                while let Some(at) = rest.find(needle) {
                    let mut left = &rest[..at];
                    if token.attr & attr::LSTRIP != 0 {
                        left = left.trim_end_matches(is_space);
                    }
                    if !left.is_empty() {
                        next.push(Fragment::Text(left));
                    }
                    next.push(Fragment::Token(id));
                    rest = &rest[at + needle.len()..];
                    if token.attr & attr::RSTRIP != 0 {
                        rest = rest.trim_start_matches(is_space);
                    }
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            fragments = next;
        }
        fragments
    }
}

/// Token id by text: an open-addressing table of ids that compares against the token texts
/// themselves, so a 262k-token vocabulary is not stored a second time as hash map keys.
#[derive(Debug, Default)]
struct TextIndex {
    /// Token ids, `u32::MAX` for an empty slot; the length is a power of two.
    slots: Vec<u32>,
}

impl TextIndex {
    const EMPTY: u32 = u32::MAX;

    fn with_capacity(n: usize) -> TextIndex {
        // At most half full, so that probe sequences stay short.
        let len = (n * 2).next_power_of_two().max(16);
        TextIndex {
            slots: vec![Self::EMPTY; len],
        }
    }

    fn hash(text: &[u8]) -> usize {
        // FxHash-style mixing: fast on short keys, and token texts are not attacker-chosen
        // after load (a hostile vocabulary can only slow its own loading).
        let mut h: u64 = text.len() as u64;
        let mut chunks = text.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            h = (h.rotate_left(5) ^ u64::from_le_bytes(word)).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
        for &b in chunks.remainder() {
            h = (h.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
        (h ^ (h >> 29)) as usize
    }

    /// Inserts `id` for `text` unless a token among `tokens` already has that text; returns the
    /// existing id then.
    fn insert(&mut self, tokens: &[TokenData], text: &str, id: u32) -> Option<u32> {
        let mask = self.slots.len() - 1;
        let mut slot = Self::hash(text.as_bytes()) & mask;
        loop {
            match self.slots[slot] {
                Self::EMPTY => {
                    self.slots[slot] = id;
                    return None;
                }
                existing if tokens[existing as usize].text == text => return Some(existing),
                _ => slot = (slot + 1) & mask,
            }
        }
    }

    fn get(&self, tokens: &[TokenData], text: &str) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut slot = Self::hash(text.as_bytes()) & mask;
        loop {
            match self.slots[slot] {
                Self::EMPTY => return None,
                existing if tokens[existing as usize].text == text => return Some(existing),
                _ => slot = (slot + 1) & mask,
            }
        }
    }
}

/// A piece of input after the special-token partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

/// A byte trie of special token texts.
#[derive(Debug, Default)]
struct Trie {
    nodes: Vec<TrieNode>,
}

#[derive(Debug, Default)]
struct TrieNode {
    /// Sorted by byte.
    children: Vec<(u8, u32)>,
    token: Option<u32>,
}

impl Trie {
    fn insert(&mut self, key: &[u8], id: u32) {
        if self.nodes.is_empty() {
            self.nodes.push(TrieNode::default());
        }
        let mut node = 0usize;
        for &b in key {
            let children = &self.nodes[node].children;
            node = match children.binary_search_by_key(&b, |&(c, _)| c) {
                Ok(i) => children[i].1 as usize,
                Err(i) => {
                    let child = self.nodes.len() as u32;
                    self.nodes[node].children.insert(i, (b, child));
                    self.nodes.push(TrieNode::default());
                    child as usize
                }
            };
        }
        self.nodes[node].token.get_or_insert(id);
    }

    /// Calls `f` with every token whose text is a prefix of `bytes`.
    fn for_each_prefix(&self, bytes: &[u8], mut f: impl FnMut(u32)) {
        if self.nodes.is_empty() {
            return;
        }
        let mut node = 0usize;
        for &b in bytes {
            let children = &self.nodes[node].children;
            match children.binary_search_by_key(&b, |&(c, _)| c) {
                Ok(i) => node = children[i].1 as usize,
                Err(_) => return,
            }
            if let Some(id) = self.nodes[node].token {
                f(id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab(tokens: &[&str], types: &[i32]) -> Vocab {
        let tokens: Vec<String> = tokens.iter().map(|s| s.to_string()).collect();
        Vocab::new(VocabInput {
            tokens: &tokens,
            scores: None,
            token_types: Some(types),
            special: SpecialIds::default(),
            rstrip_special: false,
        })
        .unwrap()
    }

    #[test]
    fn partition_cuts_longest_special_tokens_first() {
        let v = vocab(&["<s>", "<s><s>", "a", "<u>"], &[3, 3, 1, 4]);
        use Fragment::*;
        assert_eq!(
            v.partition("x<s><s>y<s>", true),
            [Text("x"), Token(1), Text("y"), Token(0)]
        );
        assert_eq!(v.partition("x<s><s>y<s>", false), [Text("x<s><s>y<s>")]);
        assert_eq!(
            v.partition("<u>a<u>", false),
            [Token(3), Text("a"), Token(3)]
        );
        assert_eq!(v.partition("", true), []);
    }

    #[test]
    fn phi3_special_tokens_swallow_the_whitespace_after_them() {
        let tokens: Vec<String> = ["<s>", "<|user|>", "<|end|>", "a"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let v = Vocab::new(VocabInput {
            tokens: &tokens,
            scores: None,
            token_types: Some(&[3, 3, 3, 1]),
            special: SpecialIds::default(),
            rstrip_special: true,
        })
        .unwrap();
        use Fragment::*;
        assert_eq!(
            v.partition("<s> <|user|>\n a <|end|>\n", true),
            [Token(0), Text(" "), Token(1), Text("a "), Token(2)]
        );
    }

    #[test]
    fn end_of_generation_tokens_are_found_by_text() {
        let v = vocab(
            &[
                "<|endoftext|>",
                "<|im_start|>",
                "<|im_end|>",
                "hi",
                "<reponame>",
            ],
            &[3, 3, 3, 1, 3],
        );
        assert_eq!(v.eog.iter().copied().collect::<Vec<_>>(), [0, 2, 4]);
        assert_eq!(
            v.special.eot,
            Some(2),
            "<|im_end|> comes first in llama.cpp's EOT list"
        );
    }

    #[test]
    fn mismatched_lengths_and_duplicates_are_errors() {
        let tokens = vec!["a".to_string(), "b".to_string()];
        let err = Vocab::new(VocabInput {
            tokens: &tokens,
            scores: Some(&[0.0]),
            token_types: None,
            special: SpecialIds::default(),
            rstrip_special: false,
        })
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "tokenizer.ggml.scores has 1 entries but tokenizer.ggml.tokens has 2: expected the same length"
        );
        let tokens = vec!["a".to_string(), "a".to_string()];
        let err = Vocab::new(VocabInput {
            tokens: &tokens,
            scores: None,
            token_types: None,
            special: SpecialIds::default(),
            rstrip_special: false,
        })
        .unwrap_err();
        assert!(err.to_string().contains("duplicate token \"a\""), "{err}");
        let tokens = vec!["a".to_string()];
        let err = Vocab::new(VocabInput {
            tokens: &tokens,
            scores: None,
            token_types: None,
            special: SpecialIds {
                eos: Some(7),
                ..SpecialIds::default()
            },
            rstrip_special: false,
        })
        .unwrap_err();
        assert!(err.to_string().contains("eos token id 7"), "{err}");
    }
}
