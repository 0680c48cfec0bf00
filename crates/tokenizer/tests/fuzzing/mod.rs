//! What the `chat_template` and `tokenizer` fuzz targets (`fuzz/`) do with one input, shared with
//! the stable tests that replay their seeds and crash inputs (`tests/fuzz_replay.rs`) and the seed
//! writer (`examples/fuzz_seeds.rs`), so all three read inputs the same way.
//!
//! Inputs are bytes split into fields by `0xFF` and items by `0xFE`: neither byte occurs in UTF-8,
//! so text fields stay text under mutation and libFuzzer's dictionary-free mutations still reach
//! the fields.
//!
//! - chat template: `template 0xFF message (0xFF message)*`, a message being `role 0xFE content`.
//! - tokenizer: `header 0xFF tokens 0xFF merges 0xFF text`, where tokens and merges are lists of
//!   items; a token item is one attribute byte (token type in the low 3 bits, score in the rest)
//!   followed by its text; the header is described at [`Header`].

#![allow(dead_code)]

use ember_gguf::{Array, Gguf, GgufWriter, Value};
use ember_tokenizer::{ChatMessage, ChatTemplate, StreamDecoder, Tokenizer, TokenizerSpec};

/// Separates fields.
pub const FIELD: u8 = 0xFF;
/// Separates items of a list field.
pub const ITEM: u8 = 0xFE;

/// Most tokens and merges read from one input: enough for every code path (byte tokens, specials,
/// multi-level merges), small enough that one run stays fast.
const MAX_ITEMS: usize = 4096;

/// The pre-tokenizer names an input picks from by index (a few real ones of each regex family,
/// none, and one unknown name).
pub const PRE_NAMES: [Option<&str>; 12] = [
    None,
    Some("default"),
    Some("llama-bpe"),
    Some("qwen2"),
    Some("smollm"),
    Some("gpt-2"),
    Some("deepseek-llm"),
    Some("tekken"),
    Some("falcon"),
    Some("chatglm-bpe"),
    Some("qwen35"),
    Some("no-such-pre"),
];

/// The tokenizer models an input picks from by index.
pub const MODELS: [&str; 4] = ["gpt2", "llama", "gemma4", "no-such-model"];

/// Roles a chat input picks from when its role field is one byte below their count.
const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

fn split(data: &[u8], sep: u8) -> impl Iterator<Item = &[u8]> {
    data.split(move |&b| b == sep)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The memory budget of a fuzzed render. A render past it is stopped for good holding up to this
/// much, so it is small enough that hundreds of stopped renders fit under libFuzzer's RSS limit
/// (`.ci/fuzz.sh`: 3 GiB). It is below the 16 MiB output cap, which the crate's own tests cover.
const FUZZ_RENDER_BUDGET: usize = 4 << 20;

/// Renders a fuzzed template with fuzzed messages through the renderer ember uses (its own
/// thread, fuel, time limit, output cap and, where the program installs the counting allocator,
/// memory budget). Rendering must end in `Ok` or `Err`, never a panic; an accepted output must be
/// within the output cap.
pub fn chat_template_case(data: &[u8]) {
    let mut fields = split(data, FIELD);
    let source = text(fields.next().unwrap_or_default());
    // A render past its memory budget is stopped for good, holding up to the budget; the fuzzer
    // renders thousands of hostile templates in one process, so each may hold little (the
    // default 128 MiB made the parked renders pass libFuzzer's RSS limit).
    let Ok(template) = ChatTemplate::from_source(&source) else {
        return;
    };
    let template = template.with_memory_budget(FUZZ_RENDER_BUDGET);
    let messages: Vec<ChatMessage> = fields
        .take(64)
        .map(|m| {
            let mut parts = m.splitn(2, |&b| b == ITEM);
            let role = parts.next().unwrap_or_default();
            let content = text(parts.next().unwrap_or_default());
            let role = match role {
                [r] if (*r as usize) < ROLES.len() => ROLES[*r as usize].to_owned(),
                other => text(other),
            };
            ChatMessage::new(role, content)
        })
        .collect();
    for add_generation_prompt in [false, true] {
        if let Ok(out) = template.render(&messages, add_generation_prompt, "<s>", "</s>") {
            assert!(out.len() <= 16 << 20, "output over the cap: {}", out.len());
        }
    }
    // The JSON path the server uses, with message content as parts and a tool list.
    let json_messages: Vec<serde_json::Value> = messages
        .iter()
        .map(|m| {
            serde_json::json!({
                "role": m.role,
                "content": [{"type": "text", "text": m.content}],
            })
        })
        .collect();
    let mut extra = serde_json::Map::new();
    extra.insert(
        "tools".into(),
        serde_json::json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    );
    let _ = template.render_json(
        &serde_json::Value::Array(json_messages),
        true,
        "<s>",
        "</s>",
        &extra,
    );
}

/// The first field of a tokenizer input, byte by byte (missing bytes read as 0). The bytes
/// [`Header::to_bytes`] writes stay below `0x80`, clear of the separators.
/// 0: model (index into [`MODELS`], modulo its length);
/// 1: pre-tokenizer (index into [`PRE_NAMES`], modulo);
/// 2: flags: bit 0 scores given, bit 1 token types given, bit 2 merges given, bits 3-4
///    `add_bos` (0 unset, 1 false, 2/3 true), bits 5-6 `add_eos` likewise;
/// 3: bits 0-1 `add_space_prefix` (as `add_bos`), bit 2 a Phi-3 model name, bit 3 build through
///    a GGUF file as well and compare;
/// 4: which of the bos, eos, eot, eom, unk and pad ids are set (bits 0-5);
/// 5..17: those ids, two bytes of 7 bits each, low first.
pub struct Header {
    pub model: &'static str,
    pub pre: Option<&'static str>,
    pub scores: bool,
    pub token_types: bool,
    pub merges: bool,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub via_gguf: bool,
    pub add_space_prefix: Option<bool>,
    pub phi3: bool,
    pub ids: [Option<u32>; 6],
}

fn tristate(bits: u8) -> Option<bool> {
    match bits & 3 {
        0 => None,
        1 => Some(false),
        _ => Some(true),
    }
}

impl Header {
    pub fn parse(bytes: &[u8]) -> Header {
        let at = |i: usize| bytes.get(i).copied().unwrap_or(0);
        let mut ids = [None; 6];
        for (k, id) in ids.iter_mut().enumerate() {
            let v = u32::from(at(5 + 2 * k) & 0x7F) | u32::from(at(6 + 2 * k) & 0x7F) << 7;
            *id = (at(4) >> k & 1 != 0).then_some(v);
        }
        Header {
            model: MODELS[at(0) as usize % MODELS.len()],
            pre: PRE_NAMES[at(1) as usize % PRE_NAMES.len()],
            scores: at(2) & 1 != 0,
            token_types: at(2) & 2 != 0,
            merges: at(2) & 4 != 0,
            add_bos: tristate(at(2) >> 3),
            add_eos: tristate(at(2) >> 5),
            add_space_prefix: tristate(at(3)),
            phi3: at(3) & 4 != 0,
            via_gguf: at(3) & 8 != 0,
            ids,
        }
    }

    /// The header bytes that [`Header::parse`] reads back as `self`. The model and pre-tokenizer
    /// must be entries of [`MODELS`] and [`PRE_NAMES`]; ids are capped at `0x3FFF`.
    pub fn to_bytes(&self) -> Vec<u8> {
        let tri = |v: Option<bool>| match v {
            None => 0u8,
            Some(false) => 1,
            Some(true) => 2,
        };
        let model = MODELS
            .iter()
            .position(|m| *m == self.model)
            .expect("a known model");
        let pre = PRE_NAMES
            .iter()
            .position(|p| *p == self.pre)
            .expect("a known pre");
        let mut out = vec![
            model as u8,
            pre as u8,
            u8::from(self.scores)
                | u8::from(self.token_types) << 1
                | u8::from(self.merges) << 2
                | tri(self.add_bos) << 3
                | tri(self.add_eos) << 5,
            tri(self.add_space_prefix) | u8::from(self.phi3) << 2 | u8::from(self.via_gguf) << 3,
            self.ids
                .iter()
                .enumerate()
                .map(|(k, id)| u8::from(id.is_some()) << k)
                .sum(),
        ];
        for id in self.ids {
            let v = id.unwrap_or(0).min(0x3FFF);
            out.extend_from_slice(&[(v & 0x7F) as u8, (v >> 7) as u8]);
        }
        out
    }
}

/// A token of a tokenizer input: its type (GGUF `tokenizer.ggml.token_type`, 0-7), a score in
/// 0..16 (the input's score is that minus 8 plus a term falling with the index; fuzzed inputs
/// reach 0..32), and its text. Written, the attribute byte stays below `0x80`.
pub struct TokenItem<'a> {
    pub ty: u8,
    pub score: u8,
    pub text: &'a str,
}

/// The bytes of a whole tokenizer input.
pub fn tokenizer_input(
    header: &Header,
    tokens: &[TokenItem<'_>],
    merges: &[&str],
    text: &str,
) -> Vec<u8> {
    let mut out = header.to_bytes();
    out.push(FIELD);
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            out.push(ITEM);
        }
        out.push((t.ty & 7) | (t.score & 15) << 3);
        out.extend_from_slice(t.text.as_bytes());
    }
    out.push(FIELD);
    for (i, m) in merges.iter().enumerate() {
        if i > 0 {
            out.push(ITEM);
        }
        out.extend_from_slice(m.as_bytes());
    }
    out.push(FIELD);
    out.extend_from_slice(text.as_bytes());
    out
}

/// Reads a tokenizer input into the spec it describes and the text to encode.
pub fn tokenizer_spec(data: &[u8]) -> (TokenizerSpec, bool, String) {
    let mut fields = data.splitn(4, |&b| b == FIELD);
    let header = Header::parse(fields.next().unwrap_or_default());
    let token_field = fields.next().unwrap_or_default();
    let merge_field = fields.next().unwrap_or_default();
    let input_text = text(fields.next().unwrap_or_default());
    let mut tokens = Vec::new();
    let mut scores = Vec::new();
    let mut types = Vec::new();
    if !token_field.is_empty() {
        for (i, item) in split(token_field, ITEM).take(MAX_ITEMS).enumerate() {
            let (attr, body) = item.split_first().map_or((0, &[][..]), |(a, b)| (*a, b));
            tokens.push(text(body));
            types.push(i32::from(attr & 7));
            scores.push(f32::from(attr >> 3) - 8.0 - i as f32 / 1024.0);
        }
    }
    let merges: Vec<String> = if merge_field.is_empty() {
        Vec::new()
    } else {
        split(merge_field, ITEM).take(MAX_ITEMS).map(text).collect()
    };
    let [bos, eos, eot, eom, unk, pad] = header.ids;
    let spec = TokenizerSpec {
        model: header.model.to_owned(),
        model_name: header.phi3.then(|| "Phi-3 mini".to_owned()),
        pre: header.pre.map(str::to_owned),
        tokens,
        scores: header.scores.then_some(scores),
        token_types: header.token_types.then_some(types),
        merges: header.merges.then_some(merges),
        bos,
        eos,
        eot,
        eom,
        unk,
        pad,
        add_bos: header.add_bos,
        add_eos: header.add_eos,
        add_space_prefix: header.add_space_prefix,
    };
    (spec, header.via_gguf, input_text)
}

/// The GGUF file whose `tokenizer.*` metadata says what `spec` says.
pub fn spec_to_gguf(spec: &TokenizerSpec) -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String("llama".into()))
        .metadata("tokenizer.ggml.model", Value::String(spec.model.clone()))
        .metadata(
            "tokenizer.ggml.tokens",
            Value::Array(Array::String(spec.tokens.clone())),
        );
    if let Some(name) = &spec.model_name {
        w.metadata("general.name", Value::String(name.clone()));
    }
    if let Some(pre) = &spec.pre {
        w.metadata("tokenizer.ggml.pre", Value::String(pre.clone()));
    }
    if let Some(scores) = &spec.scores {
        w.metadata(
            "tokenizer.ggml.scores",
            Value::Array(Array::F32(scores.clone())),
        );
    }
    if let Some(types) = &spec.token_types {
        w.metadata(
            "tokenizer.ggml.token_type",
            Value::Array(Array::I32(types.clone())),
        );
    }
    if let Some(merges) = &spec.merges {
        w.metadata(
            "tokenizer.ggml.merges",
            Value::Array(Array::String(merges.clone())),
        );
    }
    for (key, id) in [
        ("bos", spec.bos),
        ("eos", spec.eos),
        ("eot", spec.eot),
        ("eom", spec.eom),
        ("unknown", spec.unk),
        ("padding", spec.pad),
    ] {
        if let Some(id) = id {
            w.metadata(&format!("tokenizer.ggml.{key}_token_id"), Value::U32(id));
        }
    }
    for (key, flag) in [
        ("add_bos_token", spec.add_bos),
        ("add_eos_token", spec.add_eos),
        ("add_space_prefix", spec.add_space_prefix),
    ] {
        if let Some(flag) = flag {
            w.metadata(&format!("tokenizer.ggml.{key}"), Value::Bool(flag));
        }
    }
    w.to_bytes()
}

/// Encodes `text` every way and checks what a caller relies on: ids inside the vocabulary,
/// specials added where asked, and decoding (whole, piece by piece, streamed) never failing.
fn exercise(tok: &Tokenizer, text: &str) -> Vec<Vec<u32>> {
    let n = tok.vocab_size();
    let mut all = Vec::new();
    for add_special in [false, true] {
        for parse_special in [false, true] {
            let ids = tok.encode(text, add_special, parse_special);
            for &id in &ids {
                assert!((id as usize) < n, "id {id} outside a vocabulary of {n}");
            }
            if add_special && tok.add_bos() {
                assert_eq!(ids.first().copied(), tok.bos(), "BOS not first");
            }
            if add_special && tok.add_eos() {
                assert_eq!(ids.last().copied(), tok.eos(), "EOS not last");
            }
            for render_special in [false, true] {
                let _ = tok.decode(&ids, render_special);
                let mut stream = StreamDecoder::new(tok).render_special(render_special);
                let mut streamed = String::new();
                for &id in &ids {
                    streamed.push_str(&stream.push(id));
                }
                streamed.push_str(&stream.finish());
            }
            all.push(ids);
        }
    }
    // Ids a model might sample outside the vocabulary decode to nothing rather than failing.
    assert!(tok.token_to_piece(n as u32, true).is_empty());
    let _ = tok.decode(&[u32::MAX, 0, n as u32], true);
    for id in 0..n.min(512) as u32 {
        let _ = (tok.token_to_piece(id, false), tok.token_to_piece(id, true));
        let _ = (tok.is_control(id), tok.is_eog(id), tok.token_text(id));
    }
    all
}

/// Builds a tokenizer from a fuzzed spec (and, when the input asks, from a GGUF file holding the
/// same metadata, which must agree with it), then encodes and decodes fuzzed text.
pub fn tokenizer_case(data: &[u8]) {
    let (spec, via_gguf, input_text) = tokenizer_spec(data);
    let built = Tokenizer::from_spec(&spec);
    let from_spec = built.as_ref().ok().map(|tok| exercise(tok, &input_text));
    if via_gguf {
        let gguf = Gguf::from_bytes(spec_to_gguf(&spec)).expect("a file GgufWriter wrote parses");
        let loaded = Tokenizer::from_gguf(&gguf);
        assert_eq!(
            built.as_ref().err().map(ToString::to_string),
            loaded.as_ref().err().map(ToString::to_string),
            "a spec and the GGUF file holding it disagree on whether it loads"
        );
        if let Ok(tok) = loaded {
            assert_eq!(Some(exercise(&tok, &input_text)), from_spec);
        }
    }
}
