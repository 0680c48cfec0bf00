//! SentencePiece BPE (GGUF `tokenizer.ggml.model = "llama"`), as llama.cpp runs it: split the
//! text (spaces already escaped as `▁`) into UTF-8 characters, repeatedly merge the adjacent pair
//! whose concatenation is the highest-scoring vocabulary token (leftmost on ties), then emit each
//! remaining symbol as its token or, when it is not one, as byte-fallback tokens `<0xNN>`.
//!
//! llama.cpp also keeps a map to re-split a final symbol into the pair it was merged from; a
//! merged symbol is always a token (pairs are only queued when their concatenation is one), so
//! only unmerged single characters can miss the vocabulary and the map is never consulted.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use crate::vocab::Vocab;

#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A queued pair, ordered by score (highest first), then by left position (lowest first).
#[derive(Debug, Clone, Copy)]
struct Pair {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Pair {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Pair {}
impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pair {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| Reverse(self.left).cmp(&Reverse(other.left)))
    }
}

/// Appends the tokens of `text` (whitespace already escaped) to `out`.
pub(crate) fn encode(vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (start, c) in text.char_indices() {
        let index = symbols.len();
        let end = start + c.len_utf8();
        symbols.push(Symbol {
            start,
            len: c.len_utf8(),
            prev: index.checked_sub(1),
            next: (end < text.len()).then_some(index + 1),
        });
    }
    if symbols.is_empty() {
        return;
    }
    let mut queue = BinaryHeap::new();
    let try_add = |queue: &mut BinaryHeap<Pair>,
                   symbols: &[Symbol],
                   left: Option<usize>,
                   right: Option<usize>| {
        let (Some(l), Some(r)) = (left, right) else {
            return;
        };
        // Adjacent symbols are contiguous in the text, so their concatenation is a slice.
        let (ls, rs) = (symbols[l], symbols[r]);
        let joined = &text[ls.start..rs.start + rs.len];
        if let Some(id) = vocab.text_to_token(joined) {
            queue.push(Pair {
                score: vocab.tokens[id as usize].score,
                left: l,
                right: r,
                size: joined.len(),
            });
        }
    };
    for i in 1..symbols.len() {
        try_add(&mut queue, &symbols, Some(i - 1), Some(i));
    }
    while let Some(pair) = queue.pop() {
        let (ls, rs) = (symbols[pair.left], symbols[pair.right]);
        if ls.len == 0 || rs.len == 0 || ls.len + rs.len != pair.size {
            continue;
        }
        symbols[pair.left].len += rs.len;
        symbols[pair.right].len = 0;
        symbols[pair.left].next = rs.next;
        if let Some(n) = rs.next {
            symbols[n].prev = Some(pair.left);
        }
        try_add(
            &mut queue,
            &symbols,
            symbols[pair.left].prev,
            Some(pair.left),
        );
        try_add(
            &mut queue,
            &symbols,
            Some(pair.left),
            symbols[pair.left].next,
        );
    }
    let mut index = Some(0);
    while let Some(i) = index {
        let s = symbols[i];
        let piece = &text[s.start..s.start + s.len];
        match vocab.text_to_token(piece) {
            Some(id) => out.push(id),
            None => {
                for &b in piece.as_bytes() {
                    if let Some(id) = byte_token(vocab, b) {
                        out.push(id);
                    }
                }
            }
        }
        index = s.next;
    }
}

/// The token of a raw byte: `<0xNN>`, else a one-character token of that byte, else the unknown
/// token (llama.cpp aborts there; a vocabulary without byte fallback has nothing better).
pub(crate) fn byte_token(vocab: &Vocab, byte: u8) -> Option<u32> {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let name = [
        b'<',
        b'0',
        b'x',
        HEX[usize::from(byte >> 4)],
        HEX[usize::from(byte & 15)],
        b'>',
    ];
    let name = std::str::from_utf8(&name).unwrap_or_default();
    vocab
        .text_to_token(name)
        .or_else(|| {
            byte.is_ascii()
                .then(|| vocab.text_to_token(char::from(byte).encode_utf8(&mut [0; 4])))
                .flatten()
        })
        .or(vocab.special.unk)
}
