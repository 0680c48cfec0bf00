//! The command line says what it means: `info` and `devices` in text and JSON, short device
//! listings with the long list behind `-v`, errors that name the problem, completions. Run on
//! the real binary with the pinned SmolLM2 model; expected values come from another route (the
//! model's own metadata through the library, or the other output format), never written down.

mod common;

use std::process::{Command, Output};

const MODEL: &str = "smollm2-135m-instruct-q4_1";

fn ember(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .env_remove("EMBER_LOG")
        .args(args)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn ok(args: &[&str]) -> String {
    let out = ember(args);
    assert!(
        out.status.success(),
        "{args:?}: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

fn json(args: &[&str]) -> serde_json::Value {
    let stdout = ok(args);
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{args:?}: {e}: {stdout}"))
}

/// Rust debug renderings that must never reach a user (`None`, `Some(..)`, `Linear { .. }`).
fn assert_no_debug_values(output: &str) {
    for word in ["None", "Some(", " { ", "Linear"] {
        assert!(!output.contains(word), "{word:?} in:\n{output}");
    }
}

#[test]
fn info_reports_the_model_in_text_and_json_alike() {
    let model = common::model_path(MODEL);
    let model = model.to_str().unwrap();
    let gguf = ember::load::open_gguf(std::path::Path::new(model)).unwrap();
    let arch = ember::model::architecture_of(&gguf).unwrap();
    let hp = ember::model::HParams::from_metadata(arch, gguf.metadata()).unwrap();

    let report = json(&["info", "-m", model, "--format", "json"]);
    assert_eq!(report["ember_version"], env!("CARGO_PKG_VERSION"));
    assert!(report["build"]["target"].is_string(), "{report:#}");
    assert!(report["build"]["features"].is_array(), "{report:#}");
    assert!(report["cpu"]["physical_cores"].as_u64().unwrap() >= 1);
    let m = &report["model"];
    assert_eq!(m["architecture"], arch.name());
    assert_eq!(m["n_ctx_train"], hp.n_ctx_train);
    assert_eq!(m["n_layer"], hp.n_layer);
    assert_eq!(m["n_embd"], hp.n_embd);
    assert_eq!(m["file_bytes"], gguf.file_size());
    assert_eq!(m["rope"]["scaling"], "none");
    assert!(m["rope"]["scaling_factor"].is_null());
    let tensors: u64 = m["tensor_types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["count"].as_u64().unwrap())
        .sum();
    assert_eq!(tensors as usize, gguf.tensors().len());
    // SmolLM2 was trained on 8192 tokens: the default context is the cap, and says so.
    let cap = ember::model::DEFAULT_N_CTX;
    assert!(
        hp.n_ctx_train > cap,
        "the test needs a model trained beyond the cap"
    );
    let mem = &m["memory"];
    assert_eq!(mem["n_ctx"], cap);
    assert_eq!(mem["n_ctx_source"], "capped");
    assert_eq!(mem["n_ctx_cap"], cap);
    assert_eq!(
        mem["kv_bytes"].as_u64().unwrap(),
        mem["kv_bytes_per_token"].as_u64().unwrap() * cap as u64
    );

    let info = ok(&["info", "-m", model]);
    assert_no_debug_values(&info);
    assert!(
        info.contains(&format!("context (trained): {}", hp.n_ctx_train)),
        "{info}"
    );
    assert!(
        info.contains(&format!("the trained {} capped at {cap}", hp.n_ctx_train)),
        "the cap is explained:\n{info}"
    );
    assert!(info.contains("-c N sizes for another"), "{info}");
    assert!(info.contains("no scaling"), "{info}");

    // -c decides the context, and the figures follow it.
    let sized = json(&["info", "-m", model, "-c", "1024", "--format", "json"]);
    let mem = &sized["model"]["memory"];
    assert_eq!(mem["n_ctx"], 1024);
    assert_eq!(mem["n_ctx_source"], "flag");
    assert_eq!(
        mem["kv_bytes"].as_u64().unwrap(),
        mem["kv_bytes_per_token"].as_u64().unwrap() * 1024
    );
    assert!(ok(&["info", "-m", model, "-c", "1024"]).contains("1024 tokens (as -c asked)"));

    // Without a model: the build and the CPU, and a null model.
    let bare = json(&["info", "--format", "json"]);
    assert!(bare["model"].is_null(), "{bare:#}");
    assert_eq!(bare["build"], report["build"]);
    assert_no_debug_values(&ok(&["info"]));
}

#[test]
fn devices_is_short_by_default_and_complete_with_verbose_and_json() {
    let report = json(&["devices", "--format", "json"]);
    assert!(report["cpu"]["physical_cores"].as_u64().unwrap() >= 1);
    let runtimes = report["runtimes"].as_array().unwrap();
    let backends: Vec<&str> = runtimes
        .iter()
        .map(|r| r["backend"].as_str().unwrap())
        .collect();
    assert_eq!(backends, ["hip", "cuda"], "{report:#}");
    for r in runtimes {
        assert_eq!(
            r["loaded"].as_bool().unwrap(),
            r["error"].is_null(),
            "{r:#}"
        );
    }
    assert!(report["kernels"]["architectures"].is_array());
    let devices = report["devices"].as_array().unwrap();
    let failures = report["failures"].as_array().unwrap();
    // The peer-copy state of every ordered pair of GPUs, under the build's gate.
    let peer = &report["peer_copy"];
    assert!(
        ["on", "off", "probe"].contains(&peer["gate"].as_str().unwrap()),
        "{peer:#}"
    );
    let pairs = peer["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), devices.len() * devices.len().saturating_sub(1));
    // `ember info` shows the same state, from the same implementation: the gate always, each
    // pair's line when there are pairs.
    let info = json(&["info", "--format", "json"]);
    assert_eq!(info["peer_copy"], *peer, "{info:#}");
    let info_text = ok(&["info"]);
    let gate_line = format!("peer    gate {}", peer["gate"].as_str().unwrap());
    assert!(info_text.contains(&gate_line), "{info_text}");
    for p in pairs {
        let pair_line = format!(
            "{} -> {}: ",
            p["src"].as_str().unwrap(),
            p["dst"].as_str().unwrap()
        );
        assert!(
            info_text.contains(&pair_line),
            "{pair_line} missing from:\n{info_text}"
        );
    }

    // Default text: the CPU, one line per runtime, the kernels, one line per device (or the
    // line saying there is none), nothing else, and no line a screen cannot hold in a few rows.
    let short = ok(&["devices"]);
    let lines: Vec<&str> = short.lines().collect();
    let expected_lines = 1
        + runtimes.len()
        + 1
        + if devices.is_empty() && failures.is_empty() {
            1
        } else {
            devices.len() + failures.len()
        }
        + if pairs.is_empty() { 0 } else { 1 + pairs.len() };
    let kernel_error_lines = devices
        .iter()
        .filter(|d| !d["kernels_error"].is_null())
        .count();
    assert_eq!(lines.len(), expected_lines + kernel_error_lines, "{short}");
    for line in &lines {
        assert!(line.chars().count() <= 400, "a long line:\n{line}");
    }
    assert!(!short.contains("tried "), "{short}");
    assert_no_debug_values(&short);

    // -v adds every library name tried, one per line, as the JSON lists them.
    let verbose = ok(&["devices", "-v"]);
    for r in runtimes {
        for attempt in r["attempts"].as_array().unwrap() {
            let candidate = attempt["candidate"].as_str().unwrap();
            assert!(
                verbose
                    .lines()
                    .any(|l| l.trim_start().starts_with(&format!("tried {candidate}:"))),
                "{candidate} missing from:\n{verbose}"
            );
        }
    }
    for line in short.lines() {
        assert!(
            verbose.contains(line),
            "{line:?} missing from -v:\n{verbose}"
        );
    }
}

#[test]
fn a_missing_model_file_says_no_such_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("absent.gguf");
    let out = ember(&["run", "-m", missing.to_str().unwrap(), "-p", "hi"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no such file"), "{stderr}");
    assert!(!stderr.contains("unknown model"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn completions_cover_every_subcommand() {
    use std::collections::BTreeSet;
    let help = ok(&["--help"]);
    // The subcommands as `--help` lists them (two-space indented words after "Commands:").
    let commands: BTreeSet<&str> = help
        .split("Commands:")
        .nth(1)
        .unwrap()
        .lines()
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .collect();
    assert!(
        commands.contains("doctor") && commands.contains("chat"),
        "{help}"
    );
    for shell in ["bash", "zsh", "fish"] {
        let script = ok(&["completions", shell]);
        for command in &commands {
            assert!(script.contains(command), "{shell}: {command} missing");
        }
    }
    let out = ember(&["completions", "tcsh"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("tcsh"), "{}", text(&out.stderr));
}

/// The runtimes `ember devices --format json` found loaded, and whether any GPU is usable.
fn gpus_here() -> (Vec<String>, bool) {
    let report = json(&["devices", "--format", "json"]);
    let loaded = report["runtimes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["loaded"].as_bool().unwrap())
        .map(|r| r["backend"].as_str().unwrap().to_string())
        .collect();
    let usable = report["devices"]
        .as_array()
        .unwrap()
        .iter()
        .any(|d| d["kernels_complete"].as_bool().unwrap());
    (loaded, usable)
}

#[test]
fn gpu_flags_without_a_gpu_say_what_happens() {
    let model = common::model_path(MODEL);
    let model = model.to_str().unwrap();
    let (loaded, usable) = gpus_here();
    if !usable {
        // -ngl without a usable GPU runs on the CPU with a warning, as llama.cpp does.
        let out = ember(&[
            "run", "-m", model, "-p", "Hi", "-n", "2", "-t", "2", "-ngl", "99",
        ]);
        let stderr = text(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(stderr.contains("warning: -ngl"), "{stderr}");
        assert!(stderr.contains("runs on the CPU"), "{stderr}");
        assert!(!stderr.contains("runtime not loaded (hipInit"), "{stderr}");
    }
    if !loaded.iter().any(|b| b == "cuda") {
        // A GPU named with --device is required: an error in one short line that does not claim
        // the CPU takes over, and does not list every library name tried.
        let out = ember(&[
            "run", "-m", model, "-p", "Hi", "-n", "2", "--device", "cuda:0",
        ]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        let error = stderr.lines().find(|l| l.starts_with("error: ")).unwrap();
        assert!(
            error.contains("the cuda runtime is not available"),
            "{error}"
        );
        assert!(
            error.contains("names tried; `ember devices -v` lists them"),
            "{error}"
        );
        assert!(!stderr.contains("runs on the CPU"), "{stderr}");
        assert!(error.len() < 400, "{error}");
    }
}

#[test]
fn gpu_lists_are_one_kind_each_gpu_once_unless_the_testing_aid_says_otherwise() {
    // The flags are refused before any model is opened, so no model is needed.
    let run = |device: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_ember"))
            .env_remove("EMBER_LOG")
            .env_remove("EMBER_ALLOW_REPEATED_DEVICE")
            .args(["run", "-m", "no-such.gguf", "-p", "Hi", "--device", device])
            .output()
            .unwrap();
        (out.status.code(), text(&out.stderr))
    };
    for (device, says) in [
        (
            "cuda:0,cuda:0",
            "set EMBER_ALLOW_REPEATED_DEVICE=1 to run a split over one GPU named twice",
        ),
        ("hip:1,hip:0,hip:1", "each GPU named once"),
        ("cuda:0,hip:1", "CUDA and HIP devices cannot share a split"),
        (
            "cuda:0,cpu",
            "cpu, auto and sim:N cannot be listed with GPUs",
        ),
    ] {
        let (code, stderr) = run(device);
        assert_eq!(code, Some(2), "{device}: {stderr}");
        assert!(stderr.contains(says), "{device}: {stderr}");
        assert!(
            stderr.contains(&format!("{device:?}")),
            "{device}: {stderr}"
        );
    }
}

#[test]
fn run_flags_mean_what_they_say() {
    let model = common::model_path(MODEL);
    let model = model.to_str().unwrap();
    let n_ctx_train = json(&["info", "-m", model, "--format", "json"])["model"]["n_ctx_train"]
        .as_u64()
        .unwrap();

    // -n 0 generates nothing and claims no speed for it.
    let out = ember(&["run", "-m", model, "-p", "Hi", "-n", "0", "-t", "2"]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stats = stderr.lines().find(|l| l.contains(" generated")).unwrap();
    let generated = stats
        .split(", ")
        .find(|p| p.contains(" generated"))
        .unwrap();
    assert!(generated.starts_with("0 generated"), "{stats}");
    assert!(!generated.contains("t/s"), "{stats}");

    // -c beyond the trained context warns, naming both.
    let over = (n_ctx_train * 2).to_string();
    let out = ember(&[
        "run", "-m", model, "-p", "Hi", "-n", "1", "-t", "2", "-c", &over,
    ]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let warning = stderr
        .lines()
        .find(|l| l.starts_with("warning: -c"))
        .unwrap();
    assert!(
        warning.contains(&over) && warning.contains(&n_ctx_train.to_string()),
        "{warning}"
    );
    let out = ember(&[
        "run", "-m", model, "-p", "Hi", "-n", "1", "-t", "2", "-c", "512",
    ]);
    assert!(
        !text(&out.stderr).contains("warning: -c"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn tokenize_parses_special_tokens_unless_asked_not_to() {
    let model = common::model_path(MODEL);
    let model = model.to_str().unwrap();
    let special = "<|im_start|>";
    let parsed = ok(&["tokenize", "-m", model, "-p", special]);
    let plain = ok(&["tokenize", "-m", model, "-p", special, "--no-parse-special"]);
    // As llama-tokenize does by default: the marker is one token, the special one.
    assert_eq!(parsed.lines().count(), 1, "{parsed}");
    assert!(parsed.contains(&format!("'{special}'")), "{parsed}");
    assert!(plain.lines().count() > 1, "{plain}");
}

/// Ctrl-C (SIGINT) during `ember run` stops the generation and still prints the stats line.
#[cfg(unix)]
#[test]
fn ctrl_c_ends_run_with_its_stats_line() {
    use std::io::Read;
    use std::process::Stdio;
    let model = common::model_path(MODEL);
    let mut child = Command::new(env!("CARGO_BIN_EXE_ember"))
        .env_remove("EMBER_LOG")
        .args([
            "run",
            "-m",
            model.to_str().unwrap(),
            "-t",
            "2",
            "-n",
            "2000",
        ])
        .args(["-p", "Once upon a time, in a land far away,"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    // The first streamed bytes: generation is under way.
    let mut first = [0u8; 1];
    assert_eq!(stdout.read(&mut first).unwrap(), 1);
    // SAFETY: kill sends a signal to the child process this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    let stats = stderr
        .lines()
        .find(|l| l.contains(" generated"))
        .unwrap_or_else(|| panic!("no stats line: {stderr}"));
    assert!(stats.contains("stop: cancelled"), "{stats}");
}
