//! [`Tokenizer`]: text to token ids and back, built from a GGUF file's `tokenizer.*` metadata, with
//! the same results as llama.cpp's `llama_tokenize` and `llama_detokenize`.

use std::borrow::Cow;

use ember_gguf::Metadata;

use crate::bpe::Bpe;
use crate::pretokenize::{self, PreSpec};
use crate::spm;
use crate::vocab::{attr, Fragment, SpecialIds, Vocab, VocabInput};
use crate::{unicode, TokenizerError};

/// Which algorithm a tokenizer runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerKind {
    /// Byte-level BPE (GGUF model `gpt2`) with the named pre-tokenizer (`tokenizer.ggml.pre`).
    Bpe { pre: String },
    /// SentencePiece BPE with byte fallback (GGUF model `llama`).
    SentencePiece,
}

#[derive(Debug)]
enum Model {
    Bpe(Bpe),
    SentencePiece,
}

/// A tokenizer loaded from GGUF metadata.
pub struct Tokenizer {
    vocab: Vocab,
    model: Model,
    kind: TokenizerKind,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
    warnings: Vec<String>,
}

/// Everything a tokenizer is built from, as read from `tokenizer.ggml.*` keys. Use it to build a
/// tokenizer without a GGUF file (tests, converters).
#[derive(Debug, Clone, Default)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: `"gpt2"`, `"gemma4"` or `"llama"`.
    pub model: String,
    /// `general.name`: llama.cpp changes special-token whitespace handling for Phi-3 by name.
    pub model_name: Option<String>,
    /// `tokenizer.ggml.pre`.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub scores: Option<Vec<f32>>,
    pub token_types: Option<Vec<i32>>,
    pub merges: Option<Vec<String>>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
}

/// [`TokenizerSpec`] borrowed, so that loading from a file copies the vocabulary only once.
struct Parts<'a> {
    model: &'a str,
    model_name: Option<&'a str>,
    pre: Option<&'a str>,
    tokens: &'a [String],
    scores: Option<&'a [f32]>,
    token_types: Option<&'a [i32]>,
    merges: Option<&'a [String]>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: Option<bool>,
    add_eos: Option<bool>,
    add_space_prefix: Option<bool>,
}

const ESCAPED_SPACE: &str = "\u{2581}";

/// Reads a token id key. Some converters write "no token" as -1; that reads as absent, with a
/// warning, rather than as an out-of-range id.
fn read_id(
    md: &Metadata,
    key: &str,
    warnings: &mut Vec<String>,
) -> Result<Option<u32>, TokenizerError> {
    match md.get_u32_opt(key) {
        Ok(id) => Ok(id),
        Err(err) => match md.get_i32_opt(key) {
            Ok(Some(negative)) if negative < 0 => {
                warnings.push(format!("{key} is {negative}: treated as not set"));
                Ok(None)
            }
            _ => Err(err.into()),
        },
    }
}

impl Tokenizer {
    /// Loads the tokenizer of a GGUF file.
    pub fn from_gguf(g: &ember_gguf::Gguf) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_metadata(g.metadata())
    }

    /// Loads a tokenizer from GGUF metadata.
    pub fn from_metadata(md: &Metadata) -> Result<Tokenizer, TokenizerError> {
        let mut warnings = Vec::new();
        // llama.cpp also accepts integer scores.
        let scores: Option<Cow<'_, [f32]>> = match md.get_f32_array_opt("tokenizer.ggml.scores") {
            Ok(scores) => scores.map(Cow::Borrowed),
            Err(err) => match md.get_i32_array_opt("tokenizer.ggml.scores") {
                Ok(Some(ints)) => Some(Cow::Owned(ints.iter().map(|&i| i as f32).collect())),
                _ => return Err(err.into()),
            },
        };
        let parts = Parts {
            model: md.get_str("tokenizer.ggml.model")?,
            model_name: md.get_str_opt("general.name")?,
            pre: md.get_str_opt("tokenizer.ggml.pre")?,
            tokens: md.get_str_array("tokenizer.ggml.tokens")?,
            scores: scores.as_deref(),
            token_types: md.get_i32_array_opt("tokenizer.ggml.token_type")?,
            merges: md.get_str_array_opt("tokenizer.ggml.merges")?,
            bos: read_id(md, "tokenizer.ggml.bos_token_id", &mut warnings)?,
            eos: read_id(md, "tokenizer.ggml.eos_token_id", &mut warnings)?,
            eot: read_id(md, "tokenizer.ggml.eot_token_id", &mut warnings)?,
            eom: read_id(md, "tokenizer.ggml.eom_token_id", &mut warnings)?,
            unk: read_id(md, "tokenizer.ggml.unknown_token_id", &mut warnings)?,
            pad: read_id(md, "tokenizer.ggml.padding_token_id", &mut warnings)?,
            add_bos: md.get_bool_opt("tokenizer.ggml.add_bos_token")?,
            add_eos: md.get_bool_opt("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: md.get_bool_opt("tokenizer.ggml.add_space_prefix")?,
        };
        Tokenizer::build(&parts, warnings)
    }

    /// Builds a tokenizer from its parts.
    pub fn from_spec(spec: &TokenizerSpec) -> Result<Tokenizer, TokenizerError> {
        let parts = Parts {
            model: &spec.model,
            model_name: spec.model_name.as_deref(),
            pre: spec.pre.as_deref(),
            tokens: &spec.tokens,
            scores: spec.scores.as_deref(),
            token_types: spec.token_types.as_deref(),
            merges: spec.merges.as_deref(),
            bos: spec.bos,
            eos: spec.eos,
            eot: spec.eot,
            eom: spec.eom,
            unk: spec.unk,
            pad: spec.pad,
            add_bos: spec.add_bos,
            add_eos: spec.add_eos,
            add_space_prefix: spec.add_space_prefix,
        };
        Tokenizer::build(&parts, Vec::new())
    }

    fn build(spec: &Parts<'_>, mut warnings: Vec<String>) -> Result<Tokenizer, TokenizerError> {
        let n_tokens = spec.tokens.len();
        // Defaults of llama.cpp when the file names no id; a default outside the vocabulary is
        // dropped. (BPE's default of 11 for both is llama.cpp's, kept for old GPT-2 style files.)
        let default_id = |id: u32| ((id as usize) < n_tokens).then_some(id);
        let (model, kind, pre_spec) = match spec.model {
            // llama.cpp's `gemma4` model is BPE whose pre-tokenizer is always `gemma4`.
            "gpt2" | "gemma4" => {
                let pre = if spec.model == "gemma4" {
                    Some("gemma4")
                } else {
                    spec.pre
                };
                let (name, pre_spec) = match pre {
                    None => {
                        warnings.push(
                            "tokenizer.ggml.pre is missing: using the default pre-tokenizer; \
                             tokenization may differ from the model's training"
                                .to_owned(),
                        );
                        ("default".to_owned(), pretokenize::DEFAULT_SPEC)
                    }
                    Some(name) => match pretokenize::lookup(name) {
                        Some(found) => (name.to_owned(), found),
                        None => {
                            warnings.push(format!(
                                "unknown pre-tokenizer {name:?} in tokenizer.ggml.pre: using the \
                                 default pre-tokenizer; tokenization may differ from the model's training"
                            ));
                            (name.to_owned(), pretokenize::DEFAULT_SPEC)
                        }
                    },
                };
                let merges = spec.merges.ok_or(TokenizerError::MissingMerges)?;
                (
                    Model::Bpe(Bpe::new(merges, &pre_spec)?),
                    TokenizerKind::Bpe { pre: name },
                    Some(pre_spec),
                )
            }
            "llama" => (Model::SentencePiece, TokenizerKind::SentencePiece, None),
            other => {
                return Err(TokenizerError::UnsupportedModel {
                    model: other.to_owned(),
                })
            }
        };
        let is_spm = pre_spec.is_none();
        let (default_bos, default_eos, default_unk) = if is_spm {
            (default_id(1), default_id(2), default_id(0))
        } else {
            (default_id(11), default_id(11), None)
        };
        let mut special = SpecialIds {
            bos: spec.bos.or(default_bos),
            eos: spec.eos.or(default_eos),
            eot: spec.eot,
            eom: spec.eom,
            unk: spec.unk.or(default_unk),
            pad: spec.pad,
        };
        if pre_spec.is_some_and(|p: PreSpec| p.no_bos) {
            special.bos = None;
        }
        let vocab = Vocab::new(VocabInput {
            tokens: spec.tokens,
            scores: spec.scores,
            token_types: spec.token_types,
            special,
            rstrip_special: spec.model_name.is_some_and(|n| {
                n.to_lowercase().contains("phi-3") || n.to_lowercase().contains("phi3")
            }),
        })?;
        let add_bos = match pre_spec {
            // llama.cpp adds Gemma 4's BOS even where the file says not to.
            Some(p) if p.spm_style => true,
            Some(p) => spec.add_bos.unwrap_or(p.add_bos),
            None => spec.add_bos.unwrap_or(true),
        };
        let add_eos = spec.add_eos.unwrap_or(false);
        if add_bos && vocab.special.bos.is_none() {
            return Err(TokenizerError::MissingSpecialToken {
                flag: "tokenizer.ggml.add_bos_token",
                name: "BOS",
                id_key: "tokenizer.ggml.bos_token_id",
            });
        }
        if add_eos && vocab.special.eos.is_none() {
            return Err(TokenizerError::MissingSpecialToken {
                flag: "tokenizer.ggml.add_eos_token",
                name: "EOS",
                id_key: "tokenizer.ggml.eos_token_id",
            });
        }
        Ok(Tokenizer {
            vocab,
            model,
            kind,
            add_bos,
            add_eos,
            add_space_prefix: spec.add_space_prefix.unwrap_or(is_spm),
            clean_spaces: pre_spec.is_some_and(|p| p.clean_spaces),
            warnings,
        })
    }

    /// Token ids of `text`, as llama.cpp's `llama_tokenize(add_special, parse_special)`:
    /// `add_special` adds BOS/EOS where the model asks for them; `parse_special` turns the text
    /// of control tokens (such as `<|im_start|>`) into those tokens. User-defined tokens are
    /// always recognised.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.vocab.special.bos);
        }
        let fragments = self.vocab.partition(text, parse_special);
        match &self.model {
            Model::SentencePiece => {
                // A text fragment at the start or right after a special token gets the space
                // prefix (when the model wants one), as SentencePiece sees each as a new text.
                let mut prev_special = true;
                let mut buffer = String::new();
                for fragment in fragments {
                    match fragment {
                        Fragment::Text(t) => {
                            buffer.clear();
                            if self.add_space_prefix && prev_special {
                                buffer.push_str(ESCAPED_SPACE);
                            }
                            buffer.push_str(&t.replace(' ', ESCAPED_SPACE));
                            spm::encode(&self.vocab, &buffer, &mut out);
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            Model::Bpe(bpe) => {
                for fragment in fragments {
                    match fragment {
                        Fragment::Text(t) => bpe.encode(&self.vocab, t, &mut out),
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.vocab.special.eos);
        }
        out
    }

    /// The bytes a token stands for, as llama.cpp's `llama_token_to_piece`: byte-level BPE tokens
    /// decoded from GPT-2's alphabet, SentencePiece `▁` as a space, `<0xNN>` as that byte. Control
    /// and unknown tokens are empty unless `render_special`; ids outside the vocabulary are empty.
    pub fn token_to_piece(&self, id: u32, render_special: bool) -> Vec<u8> {
        let Some(token) = self.vocab.tokens.get(id as usize) else {
            return Vec::new();
        };
        let a = token.attr;
        if a & (attr::UNKNOWN | attr::CONTROL) != 0 {
            return if render_special {
                token.text.as_bytes().to_vec()
            } else {
                Vec::new()
            };
        }
        if a & attr::USER_DEFINED != 0 {
            return token.text.as_bytes().to_vec();
        }
        if a & attr::NORMAL != 0 {
            return match &self.model {
                Model::SentencePiece => token.text.replace(ESCAPED_SPACE, " ").into_bytes(),
                Model::Bpe(bpe) if bpe.spm_style() => {
                    token.text.replace(ESCAPED_SPACE, " ").into_bytes()
                }
                Model::Bpe(_) => decode_byte_level(&token.text),
            };
        }
        if a & attr::BYTE != 0 {
            return parse_byte_token(&token.text)
                .map(|b| vec![b])
                .unwrap_or_default();
        }
        // Unused and undefined tokens have no text.
        Vec::new()
    }

    /// The text of `ids`, as llama.cpp's `llama_detokenize` (special tokens kept): the space the
    /// model's space prefix put before the first token is removed, and BPE vocabularies that ask
    /// for it get their spaces before punctuation cleaned up. Invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], render_special: bool) -> String {
        let mut bytes = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let piece = self.token_to_piece(id, render_special);
            let piece = if i == 0 && self.add_space_prefix && piece.first() == Some(&b' ') {
                &piece[1..]
            } else {
                &piece[..]
            };
            bytes.extend_from_slice(piece);
        }
        if self.clean_spaces {
            clean_up_spaces(&mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Number of tokens.
    pub fn vocab_size(&self) -> usize {
        self.vocab.tokens.len()
    }

    /// The beginning-of-sequence token.
    pub fn bos(&self) -> Option<u32> {
        self.vocab.special.bos
    }

    /// The end-of-sequence token.
    pub fn eos(&self) -> Option<u32> {
        self.vocab.special.eos
    }

    /// The end-of-turn token, from the file or found by its text (`<|im_end|>`, `<end_of_turn>`, ...).
    pub fn eot(&self) -> Option<u32> {
        self.vocab.special.eot
    }

    /// The unknown token.
    pub fn unk(&self) -> Option<u32> {
        self.vocab.special.unk
    }

    /// The padding token.
    pub fn pad(&self) -> Option<u32> {
        self.vocab.special.pad
    }

    /// Whether `encode(.., add_special = true, ..)` starts with BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(.., add_special = true, ..)` ends with EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Whether generating `id` ends the turn: EOS, EOT, EOM and the tokens llama.cpp recognises
    /// by their text (`<|im_end|>`, `<end_of_turn>`, `<|endoftext|>`, FIM repository and file
    /// separators, ...).
    pub fn is_eog(&self, id: u32) -> bool {
        self.vocab.eog.contains(&id)
    }

    /// All end-of-generation tokens, ascending.
    pub fn eog_tokens(&self) -> impl Iterator<Item = u32> + '_ {
        self.vocab.eog.iter().copied()
    }

    /// Whether `id` is a control token (never text of its own, such as `<|im_start|>`).
    pub fn is_control(&self, id: u32) -> bool {
        self.vocab.attr(id) & attr::CONTROL != 0
    }

    /// The id of the token whose text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.text_to_token(text)
    }

    /// The raw vocabulary text of a token (`Ġhello`, `▁hello`, `<0x0A>`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.tokens.get(id as usize).map(|t| t.text.as_str())
    }

    /// Which algorithm this tokenizer runs.
    pub fn kind(&self) -> TokenizerKind {
        self.kind.clone()
    }

    /// Problems found while loading that did not prevent it (an unknown pre-tokenizer replaced
    /// by the default one, a special id of -1); the caller decides how to report them.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }
}

impl std::fmt::Debug for Tokenizer {
    // The derived form would print the whole vocabulary.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos())
            .field("eos", &self.eos())
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .field("add_space_prefix", &self.add_space_prefix)
            .finish_non_exhaustive()
    }
}

/// Decodes GPT-2's byte alphabet back to bytes. A character outside the alphabet is written as
/// `[UNK_BYTE_0x..]` followed by the token text, as llama.cpp does.
fn decode_byte_level(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match unicode::char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                for b in c.encode_utf8(&mut [0; 4]).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
    out
}

/// The byte of a `<0xNN>` token.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

/// llama.cpp's `clean_up_tokenization_spaces`: drop the space before `?!.,`, around a lone
/// apostrophe between spaces, and before the contractions `'s`, `'m`, `'re` and `'ve`.
fn clean_up_spaces(text: &mut Vec<u8>) {
    // Each pass compacts in place: `len` is the length kept so far, and a pass reads
    // `text[i - 1]`, which compaction never overwrites before it is read.
    let n = text.len();
    if n == 0 {
        return;
    }
    let mut len = 1;
    for i in 1..n {
        let x = text[i];
        if text[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            len -= 1;
        }
        text[len] = x;
        len += 1;
    }
    text.truncate(len);

    let n = text.len();
    let mut len = 1;
    let mut i = 1;
    while i < n {
        let x = text[i];
        if x == b'\'' && i + 1 < n && text[i - 1] == b' ' && text[i + 1] == b' ' {
            len -= 1;
            i += 1;
            text[i] = 0;
        }
        text[len] = x;
        len += 1;
        i += 1;
    }
    text.truncate(len);

    let n = text.len();
    let mut len = 1;
    for i in 1..n {
        let x = text[i];
        if text[i - 1] == b' ' && x == b'\'' && i + 1 < n {
            let x1 = text[i + 1];
            if matches!(x1, b's' | b'm') {
                len -= 1;
            } else if !matches!(x1, b't' | b'd') && i + 2 < n {
                let x2 = text[i + 2];
                if matches!((x1, x2), (b'r', b'e') | (b'v', b'e')) {
                    len -= 1;
                }
            }
        }
        text[len] = x;
        len += 1;
    }
    text.truncate(len);
}

/// Incremental detokenizer for streaming: feed ids one at a time and get back only complete
/// UTF-8 text; bytes of a character split across tokens wait for the rest.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    pending: Vec<u8>,
    render_special: bool,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder that leaves control tokens out of the text.
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        StreamDecoder {
            tokenizer,
            pending: Vec::new(),
            render_special: false,
        }
    }

    /// Whether control tokens are written as their text.
    pub fn render_special(mut self, render_special: bool) -> Self {
        self.render_special = render_special;
        self
    }

    /// Adds a token; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        let piece = self.tokenizer.token_to_piece(id, self.render_special);
        self.pending.extend_from_slice(&piece);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(text) => {
                    out.push_str(text);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // Bytes that can never start a character: replace them and go on.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                        // A character cut short: keep its bytes for the next token.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// Ends the stream: returns what is still pending, with an incomplete character as U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_up_matches_llama_cpp() {
        let clean = |s: &str| {
            let mut b = s.as_bytes().to_vec();
            clean_up_spaces(&mut b);
            String::from_utf8(b).unwrap()
        };
        assert_eq!(clean("Hello , world !"), "Hello, world!");
        assert_eq!(clean("it ' s"), "it's");
        assert_eq!(clean("he 's and I 'm"), "he's and I'm");
        assert_eq!(clean("we 're they 've"), "we're they've");
        assert_eq!(clean("don 't I 'll"), "don 't I 'll");
        assert_eq!(clean(""), "");
        assert_eq!(clean(" ."), ".");
    }

    #[test]
    fn byte_tokens_parse() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(b'\n'));
        assert_eq!(parse_byte_token("<0xFF>"), Some(0xFF));
        assert_eq!(parse_byte_token("<0xZZ>"), None);
        assert_eq!(parse_byte_token("hello"), None);
    }
}
