//! Replays the `chat_template` and `tokenizer` fuzz targets' seeds (`fuzz/corpus/`) and the inputs
//! they once failed on (`tests/fuzz-failures/`) as ordinary tests on the stable toolchain, through
//! the same code the targets run. The global allocator counts render memory, as in the `ember`
//! binary and the chat-template target.

mod fuzzing;

use std::path::{Path, PathBuf};

use ember_tokenizer::RenderBudgetAllocator;

#[global_allocator]
static ALLOCATOR: RenderBudgetAllocator = RenderBudgetAllocator;

/// The files of `dir` (none if it does not exist), leaving out READMEs.
fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("a readable folder").path())
        .filter(|p| p.is_file() && p.extension().is_none_or(|e| e != "md"))
        .collect();
    files.sort();
    files
}

fn replay(target: &str, case: fn(&[u8])) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let seeds = inputs(&root.join("../../fuzz/corpus").join(target));
    let failures = inputs(&root.join("tests/fuzz-failures").join(target));
    assert!(!seeds.is_empty(), "no seeds for {target} under fuzz/corpus");
    for path in seeds.iter().chain(&failures) {
        eprintln!("{}", path.display());
        case(&std::fs::read(path).expect("a readable input"));
    }
    println!(
        "{target}: replayed {} seeds and {} failure inputs",
        seeds.len(),
        failures.len()
    );
}

#[test]
fn chat_template_seeds_and_failures_replay() {
    replay("chat_template", fuzzing::chat_template_case);
}

#[test]
fn tokenizer_seeds_and_failures_replay() {
    replay("tokenizer", fuzzing::tokenizer_case);
}

/// The seeds reach what they are written for: each builds a tokenizer that encodes its text, and
/// the GGUF route agrees with the direct one (checked inside the case).
#[test]
fn tokenizer_seeds_build_tokenizers() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/tokenizer");
    for path in inputs(&dir) {
        let (spec, _, text) = fuzzing::tokenizer_spec(&std::fs::read(&path).unwrap());
        let tok = ember_tokenizer::Tokenizer::from_spec(&spec)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(
            !tok.encode(&text, false, true).is_empty(),
            "{}",
            path.display()
        );
    }
}

/// Encoding a seed's input and parsing it back gives the same header.
#[test]
fn tokenizer_header_round_trips() {
    for model in fuzzing::MODELS {
        for pre in fuzzing::PRE_NAMES {
            let header = fuzzing::Header {
                model,
                pre,
                scores: true,
                token_types: false,
                merges: true,
                add_bos: Some(false),
                add_eos: None,
                via_gguf: true,
                add_space_prefix: Some(true),
                phi3: true,
                ids: [Some(1), None, Some(3), None, Some(0), Some(70000)],
            };
            let back = fuzzing::Header::parse(&header.to_bytes());
            assert_eq!((back.model, back.pre), (model, pre));
            assert_eq!(
                (
                    back.scores,
                    back.token_types,
                    back.merges,
                    back.via_gguf,
                    back.phi3
                ),
                (true, false, true, true, true)
            );
            assert_eq!(
                (back.add_bos, back.add_eos, back.add_space_prefix),
                (Some(false), None, Some(true))
            );
            assert_eq!(
                back.ids,
                [Some(1), None, Some(3), None, Some(0), Some(0x3FFF)]
            );
        }
    }
}
