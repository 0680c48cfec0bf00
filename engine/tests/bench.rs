//! `ember bench` as llama-bench's users drive it, on the pinned SmolLM2 model: the JSON output
//! holds one result per test and depth, and a depth past the context cap is refused up front.

mod common;

use std::process::Command;

const MODEL: &str = "smollm2-135m-instruct-q4_1";

fn bench(args: &[&str]) -> std::process::Output {
    let model = common::model_path(MODEL);
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .env_remove("EMBER_LOG")
        .arg("bench")
        .arg("-m")
        .arg(&model)
        .args(["-t", "2", "--device", "cpu"])
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn depth_tests_run_after_an_untimed_fill_and_are_named_as_llama_bench_names_them() {
    let out = bench(&["-p", "8", "-n", "2", "-d", "0,40", "-r", "2", "-o", "json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let results: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let seen: Vec<(String, u64, u64, u64)> = results
        .iter()
        .map(|r| {
            (
                r["test"].as_str().unwrap().to_string(),
                r["n_prompt"].as_u64().unwrap(),
                r["n_gen"].as_u64().unwrap(),
                r["n_depth"].as_u64().unwrap(),
            )
        })
        .collect();
    let want = [
        ("pp8", 8, 0, 0),
        ("tg2", 0, 2, 0),
        ("pp8 @ d40", 8, 0, 40),
        ("tg2 @ d40", 0, 2, 40),
    ];
    assert_eq!(
        seen,
        want.map(|(t, p, n, d)| (t.to_string(), p, n, d)).to_vec()
    );
    for r in &results {
        let samples = r["samples_ts"].as_array().unwrap();
        assert_eq!(samples.len(), 2, "{r}");
        for s in samples {
            let ts = s.as_f64().unwrap();
            assert!(ts.is_finite() && ts > 0.0, "{r}");
        }
    }
}

#[test]
fn a_depth_past_the_context_cap_is_refused_before_anything_runs() {
    let out = bench(&["-p", "0", "-n", "1", "-d", "1000000000000", "-r", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("-d"), "{stderr}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
