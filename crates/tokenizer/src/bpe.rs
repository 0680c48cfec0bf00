//! Byte-level BPE (GGUF `tokenizer.ggml.model = "gpt2"`): pre-tokenize into words, map each
//! word's bytes to GPT-2's printable alphabet, then merge adjacent symbols by merge rank until no
//! ranked pair is left. Ties go to the leftmost pair, as in llama.cpp.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::pretokenize::{PreSpec, PreTokenizer};
use crate::unicode;
use crate::vocab::Vocab;
use crate::TokenizerError;

#[derive(Debug)]
pub(crate) struct Bpe {
    /// Merge rank by `"left right"`. Symbols of byte-level BPE never contain a space (GPT-2's
    /// alphabet maps it to `Ġ`), so the joined key is unambiguous.
    ranks: HashMap<String, u32>,
    pre: PreTokenizer,
    ignore_merges: bool,
    /// See [`PreSpec::spm_style`].
    spm_style: bool,
}

/// A symbol of a word being merged: a byte range of the encoded word, linked to its neighbours.
#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Bpe {
    pub(crate) fn new(merges: &[String], spec: &PreSpec) -> Result<Bpe, TokenizerError> {
        let mut ranks = HashMap::with_capacity(merges.len());
        for (rank, merge) in merges.iter().enumerate() {
            // llama.cpp splits at the first space after the first byte, so a merge whose left
            // side is a space still parses. A line without a separator gives llama.cpp the empty
            // pair, which no pair of symbols can match, so it is left out.
            if !merge.bytes().skip(1).any(|b| b == b' ') {
                continue;
            }
            let key = merge.clone();
            // The first occurrence of a pair keeps its rank.
            ranks.entry(key).or_insert(rank as u32);
        }
        let pre = PreTokenizer::new(spec).map_err(TokenizerError::PreTokenizer)?;
        Ok(Bpe {
            ranks,
            pre,
            ignore_merges: spec.ignore_merges,
            spm_style: spec.spm_style,
        })
    }

    /// Whether tokens spell spaces as `▁` (see [`PreSpec::spm_style`]).
    pub(crate) fn spm_style(&self) -> bool {
        self.spm_style
    }

    fn rank(&self, key: &mut String, left: &str, right: &str) -> Option<u32> {
        key.clear();
        key.push_str(left);
        key.push(' ');
        key.push_str(right);
        self.ranks.get(key.as_str()).copied()
    }

    /// Appends the tokens of `text` (a fragment without special tokens) to `out`.
    pub(crate) fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
        let escaped;
        let text = if self.spm_style {
            escaped = text.replace(' ', "\u{2581}");
            escaped.as_str()
        } else {
            text
        };
        let mut encoded = String::new();
        let mut key = String::new();
        let mut symbols: Vec<Symbol> = Vec::new();
        let mut queue: BinaryHeap<Reverse<(u32, usize, usize, usize)>> = BinaryHeap::new();
        for range in self.pre.split(text) {
            encoded.clear();
            if self.spm_style {
                encoded.push_str(&text[range]);
                // A word of newlines that is a token stays whole (llama.cpp's fix for Gemma 4).
                if encoded.bytes().all(|b| b == b'\n') {
                    if let Some(id) = vocab.text_to_token(&encoded) {
                        out.push(id);
                        continue;
                    }
                }
            } else {
                encoded.extend(text[range].bytes().map(unicode::byte_to_char));
            }
            if self.ignore_merges {
                if let Some(id) = vocab.text_to_token(&encoded) {
                    out.push(id);
                    continue;
                }
            }
            symbols.clear();
            queue.clear();
            for (start, c) in encoded.char_indices() {
                let index = symbols.len();
                symbols.push(Symbol {
                    start,
                    len: c.len_utf8(),
                    prev: index.checked_sub(1),
                    next: (start + c.len_utf8() < encoded.len()).then_some(index + 1),
                });
            }
            let add_pair = |queue: &mut BinaryHeap<_>,
                            key: &mut String,
                            symbols: &[Symbol],
                            left: Option<usize>,
                            right: Option<usize>| {
                let (Some(l), Some(r)) = (left, right) else {
                    return;
                };
                let (ls, rs) = (symbols[l], symbols[r]);
                let left_text = &encoded[ls.start..ls.start + ls.len];
                let right_text = &encoded[rs.start..rs.start + rs.len];
                if let Some(rank) = self.rank(key, left_text, right_text) {
                    queue.push(Reverse((rank, l, r, ls.len + rs.len)));
                }
            };
            for i in 1..symbols.len() {
                add_pair(&mut queue, &mut key, &symbols, Some(i - 1), Some(i));
            }
            while let Some(Reverse((_, l, r, size))) = queue.pop() {
                let (ls, rs) = (symbols[l], symbols[r]);
                // A pair whose sides have changed since it was queued is stale.
                if ls.len == 0 || rs.len == 0 || ls.len + rs.len != size {
                    continue;
                }
                symbols[l].len += rs.len;
                symbols[r].len = 0;
                symbols[l].next = rs.next;
                if let Some(n) = rs.next {
                    symbols[n].prev = Some(l);
                }
                add_pair(&mut queue, &mut key, &symbols, symbols[l].prev, Some(l));
                add_pair(&mut queue, &mut key, &symbols, Some(l), symbols[l].next);
            }
            for s in symbols.iter().filter(|s| s.len > 0) {
                let piece = &encoded[s.start..s.start + s.len];
                match vocab.text_to_token(piece) {
                    Some(id) => out.push(id),
                    // SentencePiece-style vocabularies spell bytes as `<0xNN>` tokens.
                    None if self.spm_style => out.extend(
                        piece
                            .bytes()
                            .filter_map(|b| vocab.text_to_token(&format!("<0x{b:02X}>"))),
                    ),
                    // A merge result outside the vocabulary: llama.cpp looks up each byte of the
                    // encoded text alone, which only finds single ASCII characters.
                    None => out.extend(piece.bytes().filter(u8::is_ascii).filter_map(|b| {
                        vocab.text_to_token(char::from(b).encode_utf8(&mut [0; 4]))
                    })),
                }
            }
        }
    }
}
