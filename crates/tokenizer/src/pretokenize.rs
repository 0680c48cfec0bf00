//! Pre-tokenizers of byte-level BPE vocabularies: the regexes that cut text into words before BPE
//! merges run inside each word, chosen by the GGUF key `tokenizer.ggml.pre`.
//!
//! The behaviour follows llama.cpp (`llama-vocab.cpp`, `unicode.cpp`) exactly, because token ids
//! must match what the model was trained with as llama.cpp reproduces it:
//!
//! - A pre-tokenizer is a list of regexes applied in turn. Each one re-splits every piece the
//!   previous one produced; the text between two matches becomes a piece of its own.
//! - The GPT-2 and Llama 3 patterns are hand-written scanners (as in llama.cpp, whose scanners
//!   differ from a real regex engine in a few corner cases that we must reproduce).
//! - Other patterns run on a "collapsed" copy of the text where every non-ASCII code point is
//!   replaced by one stand-in character per Unicode category (non-ASCII whitespace by U+000B), and
//!   each `\p{..}` in the pattern by a class of that stand-in plus the ASCII members llama.cpp
//!   assigns to it. So `\p{S}` does not match `~` (llama.cpp's ASCII symbol set omits it) and
//!   upper/lower case is only told apart for ASCII letters, both as in llama.cpp.

use fancy_regex::Regex;

use crate::unicode::{
    self, ACCENT_MARK, CATEGORY_MASK, LETTER, NUMBER, PUNCTUATION, SYMBOL, WHITESPACE,
};

/// GPT-2's pattern, run by the hand-written [`split_gpt2`].
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's pattern (case-insensitive contractions spelled out), run by [`split_llama3`].
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const JAIS2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}";

/// Mistral's Tekken: the original's `\p{Lu}`/`\p{Ll}` runs written with lookaheads, as llama.cpp
/// does, so that case is told apart for ASCII letters only.
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const PORO: &str = r" ?[^(\s|.,!?…。，、।۔،)]+";

const DEEPSEEK3_MAIN: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;

const SEED_CODER: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+";

const BAILINGMOE: &str = r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";

const UFAKZEKA: &str =
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const EXAONE_MOE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+";

const MINICPM5_MAIN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// What a `tokenizer.ggml.pre` name selects: the regexes and the vocabulary flags llama.cpp ties
/// to that name.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PreSpec {
    pub regexes: &'static [&'static str],
    /// A word that is itself a token is emitted whole, without merges (Llama 3, Tekken).
    pub ignore_merges: bool,
    /// The default of `add_bos_token` when the file does not say.
    pub add_bos: bool,
    /// Detokenizing removes spaces before punctuation and some contractions.
    pub clean_spaces: bool,
    /// The vocabulary has no BOS token whatever the file says (ChatGLM 4).
    pub no_bos: bool,
    /// SentencePiece-style BPE (Gemma 4): spaces become `▁` before splitting, words are merged
    /// as raw UTF-8 characters rather than GPT-2's byte alphabet, a symbol outside the
    /// vocabulary falls back to `<0xNN>` byte tokens, a word of newlines that is itself a token
    /// is emitted whole, and BOS is added whatever `add_bos_token` says (llama.cpp's
    /// `LLAMA_VOCAB_PRE_TYPE_GEMMA4`).
    pub spm_style: bool,
}

const fn spec(regexes: &'static [&'static str], clean_spaces: bool) -> PreSpec {
    PreSpec {
        regexes,
        ignore_merges: false,
        add_bos: false,
        clean_spaces,
        no_bos: false,
        spm_style: false,
    }
}

const DEFAULT_REGEXES: &[&str] = &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"];

/// The pre-tokenizer used when the name is missing or unknown, as llama.cpp's `default`.
pub(crate) const DEFAULT_SPEC: PreSpec = spec(DEFAULT_REGEXES, true);

/// The pre-tokenizer llama.cpp selects for `name`, or `None` for a name it does not know.
pub(crate) fn lookup(name: &str) -> Option<PreSpec> {
    let llama3 = PreSpec {
        ignore_merges: true,
        add_bos: true,
        ..spec(&[LLAMA3], true)
    };
    Some(match name {
        "default" => DEFAULT_SPEC,
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => llama3,
        "dbrx" | "smaug-bpe" => spec(&[LLAMA3], true),
        "glm4" | "chatglm-bpe" => PreSpec {
            no_bos: true,
            ..spec(&[LLAMA3], true)
        },
        "jais-2" => spec(&[JAIS2], true),
        "deepseek-llm" => spec(
            &[
                "[\r\n]",
                r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+",
                r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
                r"\s+$",
                "[一-龥ࠀ-一가-퟿]+",
                r"\p{N}+",
            ],
            false,
        ),
        "deepseek-coder" => spec(
            &[
                "[\r\n]",
                r"\s?\p{L}+",
                r"\s?\p{P}+",
                "[一-龥ࠀ-一가-퟿]+",
                r"\p{N}",
            ],
            false,
        ),
        "deepseek-v3" | "hunyuan-dense" | "joyai-llm" | "hy_v4" => {
            spec(&[r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+", DEEPSEEK3_MAIN], false)
        }
        "falcon" => spec(&[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"], true),
        "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
            spec(&[r"\p{N}", GPT2], true)
        }
        "command-r" | "smollm" => spec(&[r"\p{N}", GPT2], false),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "modern-bert" | "exaone4" | "mpt" | "olmo" | "jais"
        | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" => spec(&[GPT2], true),
        "trillion" | "granite-docling" => spec(&[GPT2], false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "hunyuan" | "solar-open" => {
            spec(&[QWEN2], false)
        }
        "megrez" | "stablelm2" => spec(&[QWEN2], true),
        "qwen35" => spec(&[QWEN35], false),
        "poro-chat" => spec(&[PORO], false),
        "bloom" | "gpt3-finnish" => spec(&[PORO], true),
        "viking" => spec(&[PORO, r"\p{N}"], false),
        "tekken" => PreSpec {
            ignore_merges: true,
            add_bos: true,
            ..spec(&[TEKKEN], false)
        },
        "chameleon" => PreSpec {
            add_bos: true,
            ..spec(
                &[
                    "<sentinel:[0-9]+>",
                    "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                    "([\\t\\n]|    |  )",
                    r"\p{N}",
                    r"[\p{P}!-/:-@\[-`{-~]",
                    GPT2,
                ],
                false,
            )
        },
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => spec(&[GPT4O], false),
        "bailingmoe" | "bailingmoe2" | "llada-moe" => spec(&[BAILINGMOE], false),
        "seed-coder" => spec(&[SEED_CODER], false),
        "grok-2" => spec(&[QWEN2], false),
        "ufakzeka" => spec(&[UFAKZEKA], false),
        "laguna" => spec(&["[^\\n]+|[\\n]+", QWEN2], false),
        "exaone-moe" => spec(&[EXAONE_MOE], false),
        "gemma4" | "granite-embed-multi-311m" => PreSpec {
            add_bos: true,
            spm_style: true,
            ..spec(&["[^\\n]+|[\\n]+"], true)
        },
        "minicpm5" => PreSpec {
            ignore_merges: true,
            ..spec(&[r"\p{N}{1,3}", MINICPM5_MAIN], true)
        },
        _ => return None,
    })
}

/// A compiled pre-tokenizer.
#[derive(Debug)]
pub(crate) struct PreTokenizer {
    steps: Vec<Step>,
    /// Whether any step runs on the collapsed text.
    needs_collapse: bool,
}

#[derive(Debug)]
enum Step {
    Gpt2,
    Llama3,
    Regex { regex: Box<Regex>, collapsed: bool },
}

/// The Unicode classes llama.cpp's collapse knows, and what each becomes in a collapsed pattern:
/// the stand-in character of the category plus the ASCII characters llama.cpp puts in it.
const COLLAPSED_CLASSES: &[(&str, &str)] = &[
    (r"\p{N}", r"\x{D1}0-9"),
    (r"\p{L}", r"\x{D2}A-Za-z"),
    (r"\p{P}", r"\x{D3}!-#%-*,-/:-;?-@\[-\]_\{\}"),
    (r"\p{M}", r"\x{D4}"),
    (r"\p{S}", r"\x{D5}\$\+<->\^`\|"),
    (r"\p{Lu}", r"\x{D2}A-Za-z"),
    (r"\p{Ll}", r"\x{D2}A-Za-z"),
    (r"\p{Lt}", r"\x{D2}A-Za-z"),
    (r"\p{Lm}", r"\x{D2}A-Za-z"),
    (r"\p{Lo}", r"\x{D2}A-Za-z"),
];

/// The stand-in character of a non-ASCII code point in the collapsed text.
fn collapse_char(c: char) -> char {
    if c.is_ascii() {
        return c;
    }
    let flags = unicode::flags(c);
    if flags & WHITESPACE != 0 {
        return '\u{0B}';
    }
    match flags & CATEGORY_MASK {
        NUMBER => '\u{D1}',
        LETTER => '\u{D2}',
        PUNCTUATION => '\u{D3}',
        ACCENT_MARK => '\u{D4}',
        SYMBOL => '\u{D5}',
        _ => '\u{D0}',
    }
}

fn uses_categories(pattern: &str) -> bool {
    COLLAPSED_CLASSES
        .iter()
        .any(|(class, _)| pattern.contains(class))
}

/// Rewrites `\p{..}` classes of `pattern` for the collapsed text, inside or outside brackets.
fn collapse_pattern(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len() * 2);
    let mut inside_brackets = false;
    let mut prev: Option<char> = None;
    let mut rest = pattern;
    while let Some(c) = rest.chars().next() {
        if c == '[' && prev != Some('\\') {
            inside_brackets = true;
        } else if c == ']' && inside_brackets && prev != Some('\\') {
            inside_brackets = false;
        } else if let Some((class, body)) = COLLAPSED_CLASSES
            .iter()
            .find(|(class, _)| rest.starts_with(class))
        {
            if inside_brackets {
                out.push_str(body);
            } else {
                out.push('[');
                out.push_str(body);
                out.push(']');
            }
            rest = &rest[class.len()..];
            prev = Some('}');
            continue;
        }
        out.push(c);
        prev = Some(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

impl PreTokenizer {
    /// Compiles the regexes of `spec`.
    pub(crate) fn new(spec: &PreSpec) -> Result<PreTokenizer, String> {
        let mut steps = Vec::with_capacity(spec.regexes.len());
        for &pattern in spec.regexes {
            let step = if pattern == GPT2 {
                Step::Gpt2
            } else if pattern == LLAMA3 {
                Step::Llama3
            } else {
                let collapsed = uses_categories(pattern);
                let source = if collapsed {
                    collapse_pattern(pattern)
                } else {
                    pattern.to_owned()
                };
                let regex = Regex::new(&source).map_err(|e| {
                    format!("pre-tokenizer regex {pattern:?} does not compile: {e}")
                })?;
                Step::Regex {
                    regex: Box::new(regex),
                    collapsed,
                }
            };
            steps.push(step);
        }
        let needs_collapse = steps.iter().any(|s| {
            matches!(
                s,
                Step::Regex {
                    collapsed: true,
                    ..
                }
            )
        });
        Ok(PreTokenizer {
            steps,
            needs_collapse,
        })
    }

    /// Cuts `text` into words, returned as byte ranges of `text` in order.
    pub(crate) fn split(&self, text: &str) -> Vec<std::ops::Range<usize>> {
        let cpts: Vec<char> = text.chars().collect();
        if cpts.is_empty() {
            return Vec::new();
        }
        let collapsed: Vec<char> = if self.needs_collapse {
            cpts.iter().map(|&c| collapse_char(c)).collect()
        } else {
            Vec::new()
        };
        let mut lengths = vec![cpts.len()];
        for step in &self.steps {
            lengths = match step {
                Step::Gpt2 => split_gpt2(&cpts, &lengths),
                Step::Llama3 => split_llama3(&cpts, &lengths),
                Step::Regex {
                    regex,
                    collapsed: true,
                } => split_regex(regex, &collapsed, &lengths),
                Step::Regex {
                    regex,
                    collapsed: false,
                } => {
                    // Without categories llama.cpp matches the code points themselves, with
                    // non-ASCII whitespace replaced by U+000B so that `\s` sees it.
                    let replaced: Vec<char> = cpts
                        .iter()
                        .map(|&c| {
                            if !c.is_ascii() && unicode::flags(c) & WHITESPACE != 0 {
                                '\u{0B}'
                            } else {
                                c
                            }
                        })
                        .collect();
                    split_regex(regex, &replaced, &lengths)
                }
            };
        }
        // Code point lengths to byte ranges.
        let mut ranges = Vec::with_capacity(lengths.len());
        let mut byte = 0;
        let mut cp = 0;
        for len in lengths {
            let start = byte;
            for c in &cpts[cp..cp + len] {
                byte += c.len_utf8();
            }
            cp += len;
            ranges.push(start..byte);
        }
        ranges
    }
}

/// Emits the pieces of one input piece as code point lengths, dropping empty ones.
struct Pieces<'a> {
    out: &'a mut Vec<usize>,
    prev_end: usize,
}

impl Pieces<'_> {
    fn emit(&mut self, end: usize) {
        if end > self.prev_end {
            self.out.push(end - self.prev_end);
        }
        self.prev_end = end;
    }
}

/// One piece `[start, end)` of the text with out-of-piece positions reading as "no character".
struct Window<'a> {
    cpts: &'a [char],
    end: usize,
}

impl Window<'_> {
    fn cpt(&self, pos: usize) -> Option<char> {
        (pos < self.end).then(|| self.cpts[pos])
    }

    fn flags(&self, pos: usize) -> u8 {
        self.cpt(pos).map_or(0, unicode::flags)
    }
}

fn is_word_class(flags: u8) -> bool {
    flags & (WHITESPACE | LETTER | NUMBER) != 0
}

/// GPT-2's pattern as llama.cpp scans it: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
/// ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
fn split_gpt2(cpts: &[char], lengths: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(lengths.len());
    let mut start = 0;
    for &len in lengths {
        let end = start + len;
        let w = Window { cpts, end };
        let mut pieces = Pieces {
            out: &mut out,
            prev_end: start,
        };
        let mut pos = start;
        while pos < end {
            let c = cpts[pos];
            let flags = unicode::flags(c);
            if c == '\'' && pos + 1 < end {
                let next = cpts[pos + 1];
                if matches!(next, 's' | 't' | 'm' | 'd') {
                    pos += 2;
                    pieces.emit(pos);
                    continue;
                }
                if pos + 2 < end {
                    let next2 = cpts[pos + 2];
                    if matches!((next, next2), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                        pos += 3;
                        pieces.emit(pos);
                        continue;
                    }
                }
            }
            let lead_space = usize::from(c == ' ');
            let mut flags2 = if c == ' ' { w.flags(pos + 1) } else { flags };
            if flags2 & LETTER != 0 {
                pos += lead_space;
                while flags2 & LETTER != 0 {
                    pos += 1;
                    flags2 = w.flags(pos);
                }
                pieces.emit(pos);
                continue;
            }
            if flags2 & NUMBER != 0 {
                pos += lead_space;
                while flags2 & NUMBER != 0 {
                    pos += 1;
                    flags2 = w.flags(pos);
                }
                pieces.emit(pos);
                continue;
            }
            if !is_word_class(flags2) && flags2 != 0 {
                pos += lead_space;
                while !is_word_class(flags2) && flags2 != 0 {
                    pos += 1;
                    flags2 = w.flags(pos);
                }
                pieces.emit(pos);
                continue;
            }
            let mut n_spaces = 0;
            while w.flags(pos + n_spaces) & WHITESPACE != 0 {
                n_spaces += 1;
            }
            if n_spaces > 1 && w.cpt(pos + n_spaces).is_some() {
                // `\s+(?!\S)`: leave the last space to prefix the next word.
                pos += n_spaces - 1;
                pieces.emit(pos);
                continue;
            }
            if n_spaces > 0 {
                pos += n_spaces;
                pieces.emit(pos);
                continue;
            }
            pos += 1;
            pieces.emit(pos);
        }
        start = end;
    }
    out
}

/// Llama 3's pattern as llama.cpp scans it: `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|
/// \p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
fn split_llama3(cpts: &[char], lengths: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(lengths.len());
    let mut start = 0;
    for &len in lengths {
        let end = start + len;
        let w = Window { cpts, end };
        let mut pieces = Pieces {
            out: &mut out,
            prev_end: start,
        };
        let mut pos = start;
        while pos < end {
            let c = cpts[pos];
            let flags = unicode::flags(c);
            if c == '\'' && pos + 1 < end {
                let next = unicode::to_lower(cpts[pos + 1]);
                if matches!(next, 's' | 't' | 'm' | 'd') {
                    pos += 2;
                    pieces.emit(pos);
                    continue;
                }
                if pos + 2 < end {
                    let next2 = unicode::to_lower(cpts[pos + 2]);
                    if matches!((next, next2), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                        pos += 3;
                        pieces.emit(pos);
                        continue;
                    }
                }
            }
            // `[^\r\n\p{L}\p{N}]?\p{L}+`
            if !(c == '\r' || c == '\n' || flags & NUMBER != 0)
                && (flags & LETTER != 0 || w.flags(pos + 1) & LETTER != 0)
            {
                pos += 1;
                while w.flags(pos) & LETTER != 0 {
                    pos += 1;
                }
                pieces.emit(pos);
                continue;
            }
            // `\p{N}{1,3}`
            if flags & NUMBER != 0 {
                let mut group_start = pos;
                while w.flags(pos) & NUMBER != 0 {
                    pos += 1;
                    if pos - group_start >= 3 {
                        pieces.emit(pos);
                        group_start = pos;
                    }
                }
                pieces.emit(pos);
                continue;
            }
            // ` ?[^\s\p{L}\p{N}]+[\r\n]*`; llama.cpp tests the current character's flags for
            // being a character at all, not the one after the optional space.
            let mut flags2 = if c == ' ' { w.flags(pos + 1) } else { flags };
            if !is_word_class(flags2) && flags != 0 {
                pos += usize::from(c == ' ');
                while !is_word_class(flags2) && flags2 != 0 {
                    pos += 1;
                    flags2 = w.flags(pos);
                }
                while matches!(w.cpt(pos), Some('\r' | '\n')) {
                    pos += 1;
                }
                pieces.emit(pos);
                continue;
            }
            let mut n_spaces = 0;
            let mut last_newline_end = None;
            while w.flags(pos + n_spaces) & WHITESPACE != 0 {
                if matches!(w.cpt(pos + n_spaces), Some('\r' | '\n')) {
                    last_newline_end = Some(pos + n_spaces + 1);
                }
                n_spaces += 1;
            }
            // `\s*[\r\n]+`
            if let Some(newline_end) = last_newline_end {
                pos = newline_end;
                pieces.emit(pos);
                continue;
            }
            if n_spaces > 1 && w.cpt(pos + n_spaces).is_some() {
                pos += n_spaces - 1;
                pieces.emit(pos);
                continue;
            }
            if n_spaces > 0 {
                pos += n_spaces;
                pieces.emit(pos);
                continue;
            }
            pos += 1;
            pieces.emit(pos);
        }
        start = end;
    }
    out
}

/// Splits each piece by the matches of `regex` over `chars` (collapsed or not); the text between
/// matches stays a piece of its own.
fn split_regex(regex: &Regex, chars: &[char], lengths: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(lengths.len());
    let mut start = 0;
    let mut piece = String::new();
    for &len in lengths {
        let end = start + len;
        piece.clear();
        piece.extend(&chars[start..end]);
        // Match positions come back as byte offsets; walk them forward to code point counts.
        let mut cursor_byte = 0;
        let mut cursor_cp = 0;
        let mut to_cp = |byte: usize| {
            cursor_cp += piece[cursor_byte..byte].chars().count();
            cursor_byte = byte;
            cursor_cp
        };
        let mut pieces = Pieces {
            out: &mut out,
            prev_end: 0,
        };
        for found in regex.find_iter(&piece) {
            // A match that exhausts the backtracking limit leaves the rest of the piece whole,
            // which is what the gap handling below does.
            let Ok(m) = found else { break };
            let m_start = to_cp(m.start());
            let m_end = to_cp(m.end());
            pieces.emit(m_start);
            pieces.emit(m_end);
        }
        pieces.emit(len);
        start = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(name: &str, text: &str) -> Vec<String> {
        let spec = lookup(name).expect("known pre-tokenizer");
        let pre = PreTokenizer::new(&spec).expect("regexes compile");
        pre.split(text)
            .into_iter()
            .map(|r| text[r].to_owned())
            .collect()
    }

    const ALL_NAMES: &[&str] = &[
        "default",
        "llama3",
        "dbrx",
        "glm4",
        "jais-2",
        "deepseek-llm",
        "deepseek-coder",
        "deepseek-v3",
        "falcon",
        "starcoder",
        "smollm",
        "gpt-2",
        "qwen2",
        "qwen35",
        "poro-chat",
        "viking",
        "tekken",
        "chameleon",
        "gpt-4o",
        "bailingmoe",
        "seed-coder",
        "grok-2",
        "ufakzeka",
        "laguna",
        "exaone-moe",
        "minicpm5",
    ];

    /// Every pre-tokenizer, compiled once (fancy-regex compiles slowly in debug builds).
    fn compiled() -> &'static [(&'static str, PreTokenizer)] {
        static ALL: std::sync::OnceLock<Vec<(&'static str, PreTokenizer)>> =
            std::sync::OnceLock::new();
        ALL.get_or_init(|| {
            ALL_NAMES
                .iter()
                .map(|&name| (name, PreTokenizer::new(&lookup(name).unwrap()).unwrap()))
                .collect()
        })
    }

    #[test]
    fn every_known_pre_tokenizer_compiles() {
        for name in ALL_NAMES {
            let spec = lookup(name).unwrap();
            let pre = PreTokenizer::new(&spec).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(
                pre.split("Hello, world! 123 ü ").concat_len(),
                "Hello, world! 123 ü ".len()
            );
        }
    }

    trait ConcatLen {
        fn concat_len(&self) -> usize;
    }
    impl ConcatLen for Vec<std::ops::Range<usize>> {
        fn concat_len(&self) -> usize {
            let mut expected_start = 0;
            for r in self {
                assert_eq!(r.start, expected_start, "pieces must tile the text");
                expected_start = r.end;
            }
            expected_start
        }
    }

    #[test]
    fn gpt2_words() {
        assert_eq!(words("gpt-2", "Hello  world"), ["Hello", " ", " world"]);
        assert_eq!(words("gpt-2", "don't stop"), ["don", "'t", " stop"]);
        assert_eq!(words("gpt-2", "a   "), ["a", "   "]);
        assert_eq!(words("gpt-2", "x = 42;"), ["x", " =", " 42", ";"]);
        assert_eq!(words("gpt-2", "DON'T"), ["DON", "'", "T"]);
    }

    #[test]
    fn smollm_splits_every_digit() {
        assert_eq!(
            words("smollm", "in 2024!"),
            ["in", " ", "2", "0", "2", "4", "!"]
        );
    }

    #[test]
    fn llama3_words() {
        assert_eq!(words("llama3", "Hello world"), ["Hello", " world"]);
        assert_eq!(words("llama3", "1234567"), ["123", "456", "7"]);
        assert_eq!(words("llama3", "DON'T"), ["DON", "'T"]);
        assert_eq!(words("llama3", "a\n\n  b"), ["a", "\n\n", " ", " b"]);
        assert_eq!(words("llama3", "x..\n"), ["x", "..\n"]);
    }

    #[test]
    fn qwen2_regex_on_collapsed_text() {
        assert_eq!(
            words("qwen2", "naïve 12 über"),
            ["naïve", " ", "1", "2", " über"]
        );
        assert_eq!(words("qwen2", "a  \n b"), ["a", "  \n", " b"]);
    }

    #[test]
    fn tekken_splits_camel_case() {
        assert_eq!(words("tekken", "CamelCase"), ["Camel", "Case"]);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Every pre-tokenizer cuts any text into non-empty pieces that tile it.
        #[test]
        fn pieces_tile_any_text(text in "\\PC{0,80}|[ a-zA-Z0-9'\\n\\r\\t.,!]{0,80}") {
            for (name, pre) in compiled() {
                let ranges = pre.split(&text);
                proptest::prop_assert!(ranges.iter().all(|r| !r.is_empty()), "{}: empty piece", name);
                proptest::prop_assert_eq!(ranges.concat_len(), text.len());
            }
        }
    }

    #[test]
    fn collapsed_pattern_rewrites_classes() {
        assert_eq!(collapse_pattern(r"\p{N}+"), r"[\x{D1}0-9]+");
        assert_eq!(collapse_pattern(r"[^\s\p{L}]"), r"[^\s\x{D2}A-Za-z]");
        assert_eq!(collapse_pattern(r"\[\p{M}"), r"\[[\x{D4}]");
    }
}
