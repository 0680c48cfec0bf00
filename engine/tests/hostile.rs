//! Hostile input end to end (issue 13): numbers, files and model files an adversarial user would
//! try, each run through the real `ember` binary as a subprocess under an address-space limit, so
//! a regression fails its case instead of taking the machine down. Every case must end within
//! 10 s with a non-zero exit (not a signal, not a panic), one `error:` line naming the cause, and
//! a peak resident size of at most the model file's size plus 512 MiB.
//!
//! The hostile model files are the pinned SmolLM2 model rewritten: a NaN output norm (non-finite
//! logits), a vocabulary longer than the embedding table, an oversized chat template, and a
//! metadata array of millions of empty strings.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ember_gguf::{Array, GgmlType, Gguf, GgufWriter, Value};

const MODEL: &str = "smollm2-135m-instruct-q4_1";
const DEADLINE: Duration = Duration::from_secs(10);
const MIB: u64 = 1 << 20;

/// How one run ended.
struct Outcome {
    code: Option<i32>,
    signal: Option<i32>,
    stderr: String,
    elapsed: Duration,
    max_rss: u64,
}

/// Runs `ember ARGS` under an address-space limit of `limit` bytes, with a deadline; its peak
/// resident size read from `/proc` while it runs.
fn run_ember(args: &[String], limit: u64, dir: &Path) -> Outcome {
    let stdout = std::fs::File::create(dir.join("stdout")).unwrap();
    let stderr_path = dir.join("stderr");
    let stderr = std::fs::File::create(&stderr_path).unwrap();
    let start = Instant::now();
    let child = Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {} && exec \"$0\" \"$@\"", limit / 1024))
        .arg(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .env("EMBER_LOG", "error")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .expect("spawn ember");
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    let mut killed = false;
    // The peak resident size of ember itself: `ru_maxrss` would count the test process too,
    // whose memory the child shares until it execs.
    let mut max_rss = 0;
    let status_path = format!("/proc/{pid}/status");
    loop {
        if let Ok(text) = std::fs::read_to_string(&status_path) {
            if let Some(kib) = text.lines().find_map(|l| {
                l.strip_prefix("VmHWM:")
                    .and_then(|v| v.trim().strip_suffix("kB"))
                    .and_then(|v| v.trim().parse::<u64>().ok())
            }) {
                max_rss = max_rss.max(kib * 1024);
            }
        }
        // SAFETY: waits for our own child, writing through a valid pointer.
        let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        assert!(done >= 0, "waitpid failed");
        if done == pid {
            break;
        }
        if !killed && start.elapsed() > DEADLINE * 2 {
            // SAFETY: signals our own child, which has not been reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let elapsed = start.elapsed();
    // The child was reaped here; `Child` must not wait for it again.
    std::mem::forget(child);
    Outcome {
        code: libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)),
        signal: libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status)),
        stderr: std::fs::read_to_string(&stderr_path).unwrap_or_default(),
        elapsed,
        max_rss,
    }
}

/// One hostile case: its arguments and a text its `error:` line must contain.
struct Case {
    name: String,
    args: Vec<String>,
    expect: String,
}

fn case(name: &str, args: &[&str], expect: &str) -> Case {
    Case {
        name: name.to_string(),
        args: args.iter().map(|s| s.to_string()).collect(),
        expect: expect.to_string(),
    }
}

/// Runs every case and reports all failures together.
fn check_cases(cases: &[Case], model_bytes: u64, dir: &Path) {
    let rss_cap = model_bytes + 512 * MIB;
    // Address space is reserved far beyond what is resident (thread stacks, malloc arenas, the
    // file mapping): the limit stops a runaway, the resident cap is the stricter check.
    let limit = model_bytes + 2048 * MIB;
    let mut failures = Vec::new();
    for c in cases {
        let out = run_ember(&c.args, limit, dir);
        let errors: Vec<&str> = out
            .stderr
            .lines()
            .filter(|l| l.starts_with("error:"))
            .collect();
        // One line per case, for the record (`--nocapture` shows them).
        eprintln!(
            "{}: exit {}, {:.2} s, peak resident {} MiB: {}",
            c.name,
            out.code
                .map_or_else(|| format!("signal {:?}", out.signal), |c| c.to_string()),
            out.elapsed.as_secs_f64(),
            out.max_rss / MIB,
            errors.first().copied().unwrap_or("(no error line)")
        );
        let mut problems = Vec::new();
        if let Some(signal) = out.signal {
            problems.push(format!("killed by signal {signal}"));
        }
        match out.code {
            Some(0) => problems.push("exit code 0".into()),
            Some(101) => problems.push("exit code 101 (a panic)".into()),
            _ => {}
        }
        if out.stderr.contains("panicked") || out.stderr.contains("memory allocation of") {
            problems.push("a panic or an allocation failure".into());
        }
        if errors.len() != 1 || !errors[0].contains(&c.expect) {
            problems.push(format!("expected one error line containing {:?}", c.expect));
        }
        if out.elapsed > DEADLINE {
            problems.push(format!("took {:?}", out.elapsed));
        }
        if out.max_rss > rss_cap {
            problems.push(format!(
                "peak resident {} MiB, over {} MiB",
                out.max_rss / MIB,
                rss_cap / MIB
            ));
        }
        if !problems.is_empty() {
            failures.push(format!(
                "{} (ember {}): {}\n--- stderr:\n{}",
                c.name,
                c.args.join(" "),
                problems.join("; "),
                out.stderr
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

fn model() -> (String, u64) {
    let path = common::model_path(MODEL);
    let size = std::fs::metadata(&path).unwrap().len();
    (path.to_str().unwrap().to_string(), size)
}

#[test]
fn hostile_numbers_and_files_end_in_one_clear_error() {
    let (m, size) = model();
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let c_fifo = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo reads a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_fifo.as_ptr(), 0o600) }, 0);
    let fifo = fifo.to_str().unwrap().to_string();
    // Sparse files past the caps: a 2 MiB template and a 65 MiB text.
    let big_template = dir.path().join("big.jinja");
    std::fs::File::create(&big_template)
        .unwrap()
        .set_len(2 * MIB)
        .unwrap();
    let big_text = dir.path().join("big.txt");
    std::fs::File::create(&big_text)
        .unwrap()
        .set_len(65 * MIB)
        .unwrap();
    let big_template = big_template.to_str().unwrap().to_string();
    let big_text = big_text.to_str().unwrap().to_string();
    let dirname = dir.path().to_str().unwrap().to_string();
    let max = u64::MAX.to_string();
    let m = m.as_str();
    let run = |extra: &[&str]| -> Vec<String> {
        let mut args = vec!["run", "-m", m, "-p", "hi", "-t", "2", "--device", "cpu"];
        args.extend_from_slice(extra);
        args.iter().map(|s| s.to_string()).collect()
    };
    let named = |name: &str, args: Vec<String>, expect: &str| Case {
        name: name.into(),
        args,
        expect: expect.into(),
    };
    let mut cases = vec![
        // Case 10: sampling parameters, each error naming its flag.
        named(
            "temp NaN",
            run(&["--temp", "NaN"]),
            "--temp NaN: expected a number from 0 to 2",
        ),
        named("temp inf", run(&["--temp", "inf"]), "--temp inf"),
        named("temp negative", run(&["--temp=-1"]), "--temp -1"),
        named(
            "top-p 2",
            run(&["--top-p", "2"]),
            "--top-p 2: expected a number from 0 to 1",
        ),
        named("min-p 2", run(&["--min-p", "2"]), "--min-p 2"),
        named(
            "repeat-penalty NaN",
            run(&["--repeat-penalty", "NaN"]),
            "--repeat-penalty NaN",
        ),
        named(
            "repeat-penalty 0",
            run(&["--repeat-penalty", "0"]),
            "--repeat-penalty 0",
        ),
        named(
            "repeat-penalty -1",
            run(&["--repeat-penalty=-1"]),
            "--repeat-penalty -1",
        ),
        named(
            "presence-penalty -inf",
            run(&["--presence-penalty=-inf"]),
            "--presence-penalty -inf",
        ),
        named(
            "frequency-penalty NaN",
            run(&["--frequency-penalty", "NaN"]),
            "--frequency-penalty NaN",
        ),
        // Cases 4, 5 and 6: contexts beyond the engine and beyond memory.
        named(
            "run -c 1e9",
            run(&["-c", "1000000000"]),
            "-c: a context of 1000000000 tokens: expected at most 16777216",
        ),
        named(
            "run -c u64::MAX",
            run(&["-c", &max]),
            "expected at most 16777216",
        ),
        named(
            "run -c 1e8",
            run(&["-c", "100000000"]),
            "expected at most 16777216",
        ),
        named(
            "run -c 1e7",
            run(&["-c", "10000000"]),
            "of memory available",
        ),
        // Case 9: threads.
        case(
            "run -t 1000",
            &["run", "-m", m, "-p", "hi", "-t", "1000"],
            "-t 1000 threads: expected at most the",
        ),
        // Cases 7, 8 and 15: files that are not regular, or too large.
        named(
            "template FIFO",
            run(&["--chat-template-file", &fifo]),
            "expected a regular file, found a FIFO",
        ),
        named(
            "template /dev/zero",
            run(&["--chat-template-file", "/dev/zero"]),
            "found a character device",
        ),
        named(
            "template directory",
            run(&["--chat-template-file", &dirname]),
            "found a directory",
        ),
        named(
            "template 2 MiB",
            run(&["--chat-template-file", &big_template]),
            "expected at most 1048576",
        ),
    ];
    let perplexity = |file: &str| -> Vec<String> {
        [
            "perplexity",
            "-m",
            m,
            "-f",
            file,
            "-t",
            "2",
            "--device",
            "cpu",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    cases.push(named("perplexity FIFO", perplexity(&fifo), "-f: "));
    cases.push(named(
        "perplexity /dev/zero",
        perplexity("/dev/zero"),
        "found a character device",
    ));
    cases.push(named(
        "perplexity 65 MiB",
        perplexity(&big_text),
        "expected at most 67108864",
    ));
    cases.extend([
        // Cases 3, 4 and 14: bench.
        case(
            "bench -n u64::MAX",
            &[
                "bench", "-m", m, "-t", "2", "--device", "cpu", "-p", "0", "-n", &max,
            ],
            "-n 18446744073709551615: a context of",
        ),
        case(
            "bench -p 1e9",
            &[
                "bench",
                "-m",
                m,
                "-t",
                "2",
                "--device",
                "cpu",
                "-p",
                "1000000000",
            ],
            "-p 1000000000: a context of",
        ),
        case(
            "bench -r 0",
            &["bench", "-m", m, "-t", "2", "--device", "cpu", "-r", "0"],
            "-r 0: expected at least 1",
        ),
        // Cases 3, 4 and 13: stress.
        case(
            "stress --prompts u64::MAX",
            &[
                "stress",
                "-m",
                m,
                "-t",
                "2",
                "--device",
                "cpu",
                "--prompts",
                &max,
            ],
            "--prompts and --gen at most",
        ),
        case(
            "stress --gen u64::MAX",
            &[
                "stress", "-m", m, "-t", "2", "--device", "cpu", "--gen", &max,
            ],
            "--prompts and --gen at most",
        ),
        case(
            "stress --parallel 1e8",
            &[
                "stress",
                "-m",
                m,
                "-t",
                "2",
                "--device",
                "cpu",
                "--parallel",
                "100000000",
            ],
            "--parallel at most 4096",
        ),
        case(
            "stress beyond memory",
            &[
                "stress",
                "-m",
                m,
                "-t",
                "2",
                "--device",
                "cpu",
                "--parallel",
                "4096",
                "--prompts",
                "16000000",
                "--gen",
                "1",
            ],
            "of memory available",
        ),
        case(
            "serve beyond memory",
            &[
                "serve",
                "-m",
                m,
                "-t",
                "2",
                "--device",
                "cpu",
                "-c",
                "1000000",
                "--parallel",
                "256",
            ],
            "of memory available",
        ),
    ]);
    check_cases(&cases, size, dir.path());
}

/// A generation length beyond the context is bounded by the context: it ends cleanly, never
/// allocating for the length asked (case 3 of `run`).
#[test]
fn a_huge_generation_length_ends_at_the_context() {
    let (m, size) = model();
    let dir = tempfile::tempdir().unwrap();
    let args: Vec<String> = [
        "run",
        "-m",
        &m,
        "-p",
        "hi",
        "-t",
        "2",
        "--device",
        "cpu",
        "--temp",
        "0",
        "-c",
        "40",
        "-n",
        &u64::MAX.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let out = run_ember(&args, size + 2048 * MIB, dir.path());
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stderr.contains("stop: context full"), "{}", out.stderr);
    // A debug build generating 40 tokens beside the other tests on two cores: a looser bound.
    assert!(out.elapsed < 3 * DEADLINE, "took {:?}", out.elapsed);
    assert!(out.max_rss < size + 512 * MIB);
}

/// Writes a copy of `src` with its metadata and tensor data edited.
fn rewrite(
    src: &Gguf,
    out: &Path,
    edit_metadata: impl Fn(&str, &Value) -> Option<Value>,
    edit_tensor: impl Fn(&str, GgmlType, &mut Vec<u8>),
) {
    let mut writer = GgufWriter::new();
    if let Some(Value::U32(a)) = src.metadata().get("general.alignment") {
        writer.alignment((*a).into());
    }
    for (key, value) in src.metadata().iter() {
        if key == "general.alignment" {
            continue;
        }
        let value = edit_metadata(key, value).unwrap_or_else(|| value.clone());
        writer.metadata(key, value);
    }
    for t in src.tensors() {
        let mut data = src.tensor_data(t).to_vec();
        edit_tensor(&t.name, t.ty, &mut data);
        writer.tensor(&t.name, &t.dims, t.ty, data);
    }
    writer.write_file(out).unwrap();
}

#[test]
fn hostile_model_files_end_in_one_clear_error() {
    let (m, size) = model();
    let src = Gguf::open(Path::new(&m)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| -> PathBuf { dir.path().join(name) };
    let keep = |_: &str, _: &Value| None;
    let same = |_: &str, _: GgmlType, _: &mut Vec<u8>| {};

    // Case 11: a model whose logits are NaN: every block scale of its (tied) embedding and
    // output table is a NaN.
    rewrite(&src, &path("nan.gguf"), keep, |name, ty, data| {
        if name == "token_embd.weight" {
            // Q8_0 blocks: an f16 scale, then 32 8-bit values.
            assert_eq!(ty, GgmlType::Q8_0);
            for block in data.chunks_exact_mut(34) {
                block[..2].copy_from_slice(&0x7e00u16.to_le_bytes());
            }
        }
    });
    // Case 12: three more tokens than the embedding table has rows.
    rewrite(
        &src,
        &path("vocab.gguf"),
        |key, value| match (key, value) {
            ("tokenizer.ggml.tokens", Value::Array(Array::String(tokens))) => {
                let mut tokens = tokens.clone();
                tokens.extend((0..3).map(|i| format!("<extra_{i}>")));
                Some(Value::Array(Array::String(tokens)))
            }
            ("tokenizer.ggml.token_type", Value::Array(Array::I32(types))) => {
                let mut types = types.clone();
                types.extend([1; 3]);
                Some(Value::Array(Array::I32(types)))
            }
            ("tokenizer.ggml.scores", Value::Array(Array::F32(scores))) => {
                let mut scores = scores.clone();
                scores.extend([0.0; 3]);
                Some(Value::Array(Array::F32(scores)))
            }
            _ => None,
        },
        same,
    );
    // Case 15: a model template past the size cap (a 2 MiB literal).
    rewrite(
        &src,
        &path("template.gguf"),
        |key, _| (key == "tokenizer.chat_template").then(|| Value::String("x".repeat(2 << 20))),
        same,
    );
    // Case 1: templates that build huge values without printing them (string doubling), or
    // join a repeated list (stopped by its memory budget or its time limit, whichever first).
    let doubling = "{% set a = 'x' * 32000000 %}{% set b = a ~ a %}{% set c = b ~ b %}\
                    {% set d = c ~ c %}{% set e = d ~ d %}{% set f = e ~ e %}{{ f | length }}";
    let list = "{% set l = range(10000) | list %}{{ (l * 100000) | join(',') | length }}";
    for (name, template) in [("doubling.gguf", doubling), ("list.gguf", list)] {
        rewrite(
            &src,
            &path(name),
            |key, _| (key == "tokenizer.chat_template").then(|| Value::String(template.into())),
            same,
        );
    }
    // Case 2, scaled to a test: an array of empty strings that is 8 bytes each in the file but
    // a 24-byte `String` each in memory, past the metadata memory cap.
    let n_empty = (ember_gguf::MAX_METADATA_MEMORY / 24 + 1) as usize;
    rewrite(
        &src,
        &path("strings.gguf"),
        |key, _| {
            (key == "general.name")
                .then(|| Value::Array(Array::String(vec![String::new(); n_empty])))
        },
        same,
    );

    let file = |name: &str| path(name).to_str().unwrap().to_string();
    let run = |model: &str, extra: &[&str]| -> Vec<String> {
        let mut args = vec![
            "run", "-m", model, "-p", "hi", "-t", "2", "--device", "cpu", "-n", "4",
        ];
        args.extend_from_slice(extra);
        args.iter().map(|s| s.to_string()).collect()
    };
    let nan = file("nan.gguf");
    let generation = "generation failed: the model computed NaN or infinite logits";
    let nan_logits = "the model computed NaN or infinite logits";
    // Perplexity over a short text: one chunk of 16 tokens, positions 8.. scored.
    let text = dir.path().join("text.txt");
    std::fs::write(
        &text,
        "the quick brown fox jumps over the lazy dog. ".repeat(20),
    )
    .unwrap();
    let text = text.to_str().unwrap().to_string();
    let tool = |args: &[&str]| -> Vec<String> { args.iter().map(|s| s.to_string()).collect() };
    let cpu = ["-t", "2", "--device", "cpu"];
    let perplexity = tool(
        &[
            &[
                "perplexity",
                "-m",
                &nan,
                "-f",
                &text,
                "-c",
                "16",
                "--chunks",
                "1",
            ][..],
            &cpu,
        ]
        .concat(),
    );
    let bench_pp = tool(
        &[
            &["bench", "-m", &nan, "-p", "8", "-n", "0", "-r", "1"][..],
            &cpu,
        ]
        .concat(),
    );
    let bench_tg = tool(
        &[
            &["bench", "-m", &nan, "-p", "0", "-n", "4", "-r", "1"][..],
            &cpu,
        ]
        .concat(),
    );
    let cases = [
        // Perplexity and bench name where the logits stopped being numbers instead of printing
        // a NaN perplexity or a speed for a model that computes nothing.
        Case { name: "NaN logits, perplexity".into(), args: perplexity, expect: format!("chunk 1 of 1, position 8: {nan_logits}") },
        Case { name: "NaN logits, bench pp".into(), args: bench_pp, expect: format!("pp8, the prompt's last position 7: {nan_logits}") },
        Case { name: "NaN logits, bench tg".into(), args: bench_tg, expect: format!("tg4, position 0: {nan_logits}") },
        // Greedy: the arg-max is taken where the logits are, and still caught.
        Case { name: "NaN logits, greedy".into(), args: run(&nan, &["--temp", "0"]), expect: generation.into() },
        Case { name: "NaN logits, sampled".into(), args: run(&nan, &["--temp", "0.7", "--seed", "1"]), expect: generation.into() },
        Case { name: "NaN logits, json".into(), args: run(&nan, &["--temp", "0", "--format", "json"]), expect: generation.into() },
        Case { name: "vocab beyond embeddings".into(), args: run(&file("vocab.gguf"), &[]), expect: "the tokenizer has 49155 tokens, expected at most the 49152 rows of token_embd.weight".into() },
        Case { name: "2 MiB model template".into(), args: run(&file("template.gguf"), &["--chat"]), expect: "bad chat template in the model: chat template is 2097152 bytes: expected at most 1048576".into() },
        Case { name: "template doubling a string".into(), args: run(&file("doubling.gguf"), &["--chat"]), expect: "cannot render the chat template: chat template failed to render: it built values over".into() },
        Case { name: "template repeating a list".into(), args: run(&file("list.gguf"), &["--chat"]), expect: "cannot render the chat template: chat template failed to render: it ".into() },
        Case { name: "metadata growing in memory".into(), args: run(&file("strings.gguf"), &[]), expect: "over the cap of 268435456".into() },
    ];
    check_cases(&cases, size, dir.path());
}
