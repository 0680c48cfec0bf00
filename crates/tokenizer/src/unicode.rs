//! Unicode facts the pre-tokenizers need: the general category and whitespace flag of every code
//! point, and GPT-2's reversible byte-to-character mapping.
//!
//! Categories follow llama.cpp's `unicode-data.cpp` (generated from Python's `regex` module): each
//! code point is exactly one of number, letter, separator, mark, punctuation, symbol or "other",
//! where "other" includes unassigned code points. Whitespace is Unicode's `White_Space` property.
//! The tables come from `regex-syntax`, so they follow its Unicode version; code points assigned
//! in one version and not the other are the only place the two can disagree.

use std::sync::OnceLock;

/// `\p{N}`.
pub(crate) const NUMBER: u8 = 1 << 0;
/// `\p{L}`.
pub(crate) const LETTER: u8 = 1 << 1;
/// `\p{Z}`.
pub(crate) const SEPARATOR: u8 = 1 << 2;
/// `\p{M}`.
pub(crate) const ACCENT_MARK: u8 = 1 << 3;
/// `\p{P}`.
pub(crate) const PUNCTUATION: u8 = 1 << 4;
/// `\p{S}`.
pub(crate) const SYMBOL: u8 = 1 << 5;
/// `\p{C}`, including unassigned code points.
pub(crate) const CONTROL: u8 = 1 << 6;
/// `White_Space`; combines with one of the category bits above.
pub(crate) const WHITESPACE: u8 = 1 << 7;

/// Every category bit; a code point has exactly one of them.
pub(crate) const CATEGORY_MASK: u8 = WHITESPACE - 1;

const MAX_CODEPOINT: usize = 0x11_0000;

/// Unicode's `White_Space` code points (the 25 of PropList.txt).
const WHITESPACE_CODEPOINTS: [u32; 25] = [
    0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, 0x2000, 0x2001, 0x2002, 0x2003, 0x2004,
    0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000,
];

/// Category and whitespace flags of a code point. Flags of a position outside the text being
/// split are 0, which every pre-tokenizer rule treats as "no character".
pub(crate) fn flags(c: char) -> u8 {
    table()[c as usize]
}

fn table() -> &'static [u8] {
    static TABLE: OnceLock<Vec<u8>> = OnceLock::new();
    TABLE.get_or_init(build_table)
}

fn build_table() -> Vec<u8> {
    // Everything not claimed by another category is "other" (control, format, private use,
    // surrogate, unassigned), as in llama.cpp, where no code point is left without a category.
    let mut table = vec![CONTROL; MAX_CODEPOINT];
    for (class, flag) in [
        (r"\p{N}", NUMBER),
        (r"\p{L}", LETTER),
        (r"\p{Z}", SEPARATOR),
        (r"\p{M}", ACCENT_MARK),
        (r"\p{P}", PUNCTUATION),
        (r"\p{S}", SYMBOL),
    ] {
        for (start, end) in class_ranges(class) {
            for slot in &mut table[start as usize..=end as usize] {
                *slot = flag;
            }
        }
    }
    for cp in WHITESPACE_CODEPOINTS {
        table[cp as usize] |= WHITESPACE;
    }
    table
}

/// The inclusive code point ranges of a Unicode class such as `\p{L}`.
fn class_ranges(class: &str) -> Vec<(u32, u32)> {
    use regex_syntax::hir::{Class, HirKind};
    // The classes are fixed strings that regex-syntax always accepts; an empty result would only
    // mean a category table is missing, which the unit tests catch.
    let Ok(hir) = regex_syntax::ParserBuilder::new().build().parse(class) else {
        return Vec::new();
    };
    match hir.kind() {
        HirKind::Class(Class::Unicode(ranges)) => ranges
            .ranges()
            .iter()
            .map(|r| (r.start() as u32, r.end() as u32))
            .collect(),
        _ => Vec::new(),
    }
}

/// Lowercase of a code point as llama.cpp's `unicode_tolower` (first char of the full mapping).
pub(crate) fn to_lower(c: char) -> char {
    c.to_lowercase().next().unwrap_or(c)
}

/// GPT-2's byte-level alphabet: printable Latin-1 bytes map to themselves, the other 68 bytes to
/// U+0100 onwards in byte order, so every byte sequence becomes printable, space-free text.
pub(crate) fn byte_to_char(byte: u8) -> char {
    byte_tables().0[byte as usize]
}

/// The inverse of [`byte_to_char`]; `None` for characters outside the 256-character alphabet.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    if cp < 0x180 {
        let b = byte_tables().1[cp as usize];
        (b >= 0).then_some(b as u8)
    } else {
        None
    }
}

#[allow(clippy::type_complexity)]
fn byte_tables() -> &'static ([char; 256], [i16; 0x180]) {
    static TABLES: OnceLock<([char; 256], [i16; 0x180])> = OnceLock::new();
    TABLES.get_or_init(|| {
        let printable = |b: u32| {
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
        };
        let mut to_char = ['\0'; 256];
        let mut to_byte = [-1i16; 0x180];
        let mut next_extra = 0u32;
        for b in 0..256u32 {
            let cp = if printable(b) {
                b
            } else {
                next_extra += 1;
                0xFF + next_extra
            };
            // Both ranges are below U+0180, so every value is a valid char.
            let c = char::from_u32(cp).unwrap_or('\u{FFFD}');
            to_char[b as usize] = c;
            to_byte[cp as usize] = b as i16;
        }
        (to_char, to_byte)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn categories_of_known_code_points() {
        assert_eq!(flags('a'), LETTER);
        assert_eq!(flags('Z'), LETTER);
        assert_eq!(flags('7'), NUMBER);
        assert_eq!(flags('Ⅻ'), NUMBER);
        assert_eq!(flags(' '), SEPARATOR | WHITESPACE);
        assert_eq!(flags('\n'), CONTROL | WHITESPACE);
        assert_eq!(flags('\u{A0}'), SEPARATOR | WHITESPACE);
        assert_eq!(
            flags('\u{200B}'),
            CONTROL,
            "zero-width space is a format character"
        );
        assert_eq!(flags('\u{301}'), ACCENT_MARK);
        assert_eq!(flags('!'), PUNCTUATION);
        assert_eq!(flags('$'), SYMBOL);
        assert_eq!(flags('~'), SYMBOL);
        assert_eq!(flags('日'), LETTER);
        assert_eq!(flags('🦀'), SYMBOL);
        assert_eq!(flags('\u{E000}'), CONTROL, "private use");
        assert_eq!(flags('\u{10FFFF}'), CONTROL, "unassigned");
    }

    #[test]
    fn every_code_point_has_exactly_one_category() {
        for (cp, &f) in table().iter().enumerate() {
            assert_eq!(
                (f & CATEGORY_MASK).count_ones(),
                1,
                "code point {cp:#x} has flags {f:#x}"
            );
        }
    }

    #[test]
    fn byte_alphabet_round_trips() {
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = byte_to_char(b);
            assert!(seen.insert(c), "byte {b} maps to a character already used");
            assert_ne!(c, ' ');
            assert_eq!(char_to_byte(c), Some(b));
        }
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(b'A'), 'A');
        assert_eq!(char_to_byte('日'), None);
    }
}
