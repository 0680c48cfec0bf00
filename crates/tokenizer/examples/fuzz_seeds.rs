//! Writes the seed corpora of the `chat_template` and `tokenizer` fuzz targets (`fuzz/`): small
//! synthetic inputs written here (never a downloaded template or vocabulary) that between them
//! reach the renderer's statements, filters and helpers, and both tokenizer algorithms with byte
//! tokens, specials, merges and every optional key.
//!
//! `cargo run -p ember-tokenizer --example fuzz_seeds -- fuzz/corpus`

#[path = "../tests/fuzzing/mod.rs"]
mod fuzzing;

use std::path::PathBuf;
use std::process::ExitCode;

use ember_tokenizer::ChatTemplate;
use fuzzing::{tokenizer_input, Header, TokenItem, FIELD, ITEM};

/// Templates in the shapes model files use, written for this corpus.
const TEMPLATES: [(&str, &str); 6] = [
    (
        "header-turns",
        "{{- bos_token }}{%- for m in messages %}{{- '<|start|>' + m['role'] + '<|sep|>\\n\\n' + \
         m['content'] | trim + '<|end|>' }}{%- endfor %}{%- if add_generation_prompt %}\
         {{- '<|start|>assistant<|sep|>\\n\\n' }}{%- endif %}",
    ),
    (
        "system-and-loop",
        "{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}\
         {%- set rest = messages[1:] %}{%- else %}{%- set sys = 'You are helpful. Today is ' ~ \
         strftime_now('%d %b %Y') %}{%- set rest = messages %}{%- endif %}[SYS]{{ sys }}[/SYS]\n\
         {%- for m in rest %}{%- if loop.index0 % 2 == 0 and m.role != 'user' %}\
         {{- raise_exception('roles must alternate') }}{%- endif %}\
         {{- m.role | upper }}: {{ m.content.strip() }}{% if not loop.last %}\n{% endif %}\
         {%- endfor %}{{ eos_token if not add_generation_prompt }}",
    ),
    (
        "namespace-and-macro",
        "{%- macro show(m) -%}{{ m.role }}={{ m.content | replace('\\n', ' ') | truncate(40) }}\
         {%- endmacro -%}{%- set ns = namespace(n=0, last='') -%}{%- for m in messages -%}\
         {%- set ns.n = ns.n + 1 -%}{%- set ns.last = m.role -%}{{ show(m) }};{%- endfor -%}\
         {{ ns.n }} {{ ns.last }}{% if ns.n > 3 %}{% for i in range(ns.n) %}{{ i }}{% endfor %}\
         {% endif %}",
    ),
    (
        "tools-json",
        "{%- if tools is defined and tools %}<tools>{% for t in tools %}{{ t | tojson }}\
         {% endfor %}</tools>{% endif %}{% for m in messages %}{% if m.content is string %}\
         {{ m.content }}{% else %}{% for part in m.content %}{% if part.type == 'text' %}\
         {{ part.text }}{% endif %}{% endfor %}{% endif %}{% endfor %}",
    ),
    (
        "dict-and-string-methods",
        "{% set d = {'a': 1, 'b': [1, 2, 3]} %}{% for k, v in d.items() %}{{ k }}{{ v }}\
         {% endfor %}{% for m in messages %}{{ m.content.split(' ') | join('|') }}\
         {{ m.role.startswith('u') }}{{ m.content | length }}{{ m.content[:5] }}\
         {{ m.content | lower | title }}{% break %}{% endfor %}{{ messages | map(attribute='role') \
         | list | tojson }}",
    ),
    (
        "doubling",
        "{% set a = 'ab' * 1000 %}{% set b = a ~ a %}{% set c = b ~ b %}{{ c | length }}\
         {% for m in messages %}{{ m.content * 3 }}{% endfor %}",
    ),
];

fn chat_seed(template: &str) -> Vec<u8> {
    let mut out = template.as_bytes().to_vec();
    for (role, content) in [
        (0u8, "Be brief."),
        (1, "Hello, how are you?"),
        (2, "Fine.\nAnd you?"),
        (1, "  Tell me a joke  "),
    ] {
        out.push(FIELD);
        out.push(role);
        out.push(ITEM);
        out.extend_from_slice(content.as_bytes());
    }
    out
}

/// GPT-2's byte-to-character alphabet: printable Latin-1 bytes stand for themselves, the others
/// for the code points from U+0100 on.
fn byte_level_alphabet() -> Vec<String> {
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let mut next = 0x100;
    (0u32..256)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(c).expect("a code point").to_string()
        })
        .collect()
}

fn header(model: &'static str, pre: Option<&'static str>, ids: [Option<u32>; 6]) -> Header {
    Header {
        model,
        pre,
        scores: true,
        token_types: true,
        merges: true,
        add_bos: None,
        add_eos: None,
        via_gguf: false,
        add_space_prefix: None,
        phi3: false,
        ids,
    }
}

fn bpe_seed(pre: Option<&'static str>, via_gguf: bool) -> Vec<u8> {
    let alphabet = byte_level_alphabet();
    let merged = [
        "Ġt", "he", "Ġthe", "in", "Ġa", "er", "on", "Ġw", "ll", "Ġhe", "Ġhello", "Ġ1",
    ];
    let merges = [
        "Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ w", "l l", "Ġ he", "Ġhe llo", "Ġ 1",
        "he ll", "hell o",
    ];
    let mut tokens: Vec<TokenItem<'_>> = alphabet
        .iter()
        .map(|t| TokenItem {
            ty: 1,
            score: 8,
            text: t,
        })
        .collect();
    tokens.extend(merged.iter().map(|t| TokenItem {
        ty: 1,
        score: 8,
        text: t,
    }));
    tokens.extend(["hell", "hello", "llo"].iter().map(|t| TokenItem {
        ty: 1,
        score: 8,
        text: t,
    }));
    tokens.push(TokenItem {
        ty: 3,
        score: 8,
        text: "<|endoftext|>",
    });
    tokens.push(TokenItem {
        ty: 3,
        score: 8,
        text: "<|im_start|>",
    });
    tokens.push(TokenItem {
        ty: 4,
        score: 8,
        text: "<tool>",
    });
    let n = tokens.len() as u32;
    let mut h = header(
        "gpt2",
        pre,
        [Some(n - 3), Some(n - 3), None, None, None, None],
    );
    h.add_bos = Some(true);
    h.via_gguf = via_gguf;
    tokenizer_input(
        &h,
        &tokens,
        &merges,
        "<|im_start|>user\nHello the world, 1234 in  two\tspaces... <tool>héllo 🙂 don't<|endoftext|>",
    )
}

fn spm_seed(via_gguf: bool, space_prefix: Option<bool>) -> Vec<u8> {
    let bytes: Vec<String> = (0..256).map(|b| format!("<0x{b:02X}>")).collect();
    let mut tokens = vec![
        TokenItem {
            ty: 2,
            score: 8,
            text: "<unk>",
        },
        TokenItem {
            ty: 3,
            score: 8,
            text: "<s>",
        },
        TokenItem {
            ty: 3,
            score: 8,
            text: "</s>",
        },
    ];
    tokens.extend(bytes.iter().map(|t| TokenItem {
        ty: 6,
        score: 8,
        text: t,
    }));
    for (i, piece) in [
        "▁", "e", "l", "o", "h", "▁h", "ll", "▁he", "llo", "▁hello", "w", "r", "d", "▁w", "or",
        "▁wor", "ld", "▁world", "▁t", "he",
    ]
    .iter()
    .enumerate()
    {
        tokens.push(TokenItem {
            ty: 1,
            score: (15 - i.min(15)) as u8,
            text: piece,
        });
    }
    tokens.push(TokenItem {
        ty: 4,
        score: 8,
        text: "<start_of_turn>",
    });
    tokens.push(TokenItem {
        ty: 5,
        score: 8,
        text: "<unused0>",
    });
    let mut h = header("llama", None, [Some(1), Some(2), None, None, Some(0), None]);
    h.merges = false;
    h.via_gguf = via_gguf;
    h.add_space_prefix = space_prefix;
    tokenizer_input(
        &h,
        &tokens,
        &[],
        "<start_of_turn>hello world\n  héllo wörld 😀 <s> the end</s>",
    )
}

fn main() -> ExitCode {
    let Some(dir) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: fuzz_seeds <corpus folder, e.g. fuzz/corpus>");
        return ExitCode::FAILURE;
    };
    let mut seeds: Vec<(String, Vec<u8>)> = Vec::new();
    for name in ["chatml", "gemma"] {
        let source = ChatTemplate::builtin(name).expect("a shipped template");
        seeds.push((
            format!("chat_template/builtin-{name}"),
            chat_seed(source.source()),
        ));
    }
    for (name, template) in TEMPLATES {
        seeds.push((format!("chat_template/{name}"), chat_seed(template)));
    }
    seeds.push((
        "tokenizer/bpe-llama-bpe".into(),
        bpe_seed(Some("llama-bpe"), false),
    ));
    seeds.push((
        "tokenizer/bpe-qwen2-gguf".into(),
        bpe_seed(Some("qwen2"), true),
    ));
    seeds.push(("tokenizer/bpe-no-pre".into(), bpe_seed(None, false)));
    seeds.push(("tokenizer/spm".into(), spm_seed(false, None)));
    seeds.push((
        "tokenizer/spm-gguf-no-prefix".into(),
        spm_seed(true, Some(false)),
    ));
    for (name, bytes) in seeds {
        let path = dir.join(&name);
        if let Err(e) = std::fs::create_dir_all(path.parent().expect("a folder"))
            .and_then(|()| std::fs::write(&path, &bytes))
        {
            eprintln!("cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("{} ({} bytes)", path.display(), bytes.len());
    }
    ExitCode::SUCCESS
}
