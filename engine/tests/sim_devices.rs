//! `ember run` over simulated devices (`--device sim:0,sim:1,...`) on both pinned models: a
//! layer split gives the same greedy tokens as one simulated device and as the CPU (the
//! simulated devices run the CPU's ops and the split moves activations bit-exactly, so the
//! tokens are equal, which the golden rule accepts trivially); partial offload (`-ngl`) puts
//! the first layers on the CPU with the same tokens, also when the prompt's products of the
//! CPU's layers are streamed to a simulated GPU; a corrupting peer pair is reported at
//! start, falls back to host staging, and the tokens stay the same. A device whose weights are
//! observed in host memory (`EMBER_SIM_HOST_WEIGHTS`) is refused naming it, or warned about
//! with `--allow-host-weights`; `--vram-budget` is each device's pool's budget. Bad flag values
//! are refused naming the flag.

mod common;

use std::process::Command;

const PROMPT: &str = "The capital of France is";

fn run(model: &str, args: &[&str], corrupt: Option<&str>) -> (Vec<u64>, String) {
    let env: Vec<(&str, &str)> = corrupt
        .map(|pairs| ("EMBER_SIM_CORRUPT_PEER", pairs))
        .into_iter()
        .collect();
    let (out, stderr) = run_with_env(model, args, &env);
    assert!(out.status.success(), "{model} {args:?}: {stderr}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{model} {args:?}: {e}: {stderr}"));
    let tokens = json["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    (tokens, stderr)
}

/// `ember run` of 12 greedy tokens with `args`, the simulated devices' test hooks set only as
/// `env` says.
fn run_with_env(
    model: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> (std::process::Output, String) {
    let path = common::model_path(model);
    let mut command = Command::new(env!("CARGO_BIN_EXE_ember"));
    command
        .env_remove("EMBER_LOG")
        .env_remove("EMBER_SIM_CORRUPT_PEER")
        .env_remove("EMBER_SIM_HOST_WEIGHTS")
        .arg("run")
        .arg("-m")
        .arg(&path)
        .args([
            "-p", PROMPT, "-n", "12", "--temp", "0", "-t", "2", "-c", "256",
        ])
        .args(["--format", "json"])
        .args(args)
        .envs(env.iter().copied());
    let out = command.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stderr)
}

fn check_model(model: &str) {
    let (cpu, _) = run(model, &["--device", "cpu"], None);
    assert_eq!(cpu.len(), 12, "{model}: {cpu:?}");
    let (one, stderr) = run(model, &["--device", "sim:0"], None);
    assert_eq!(one, cpu, "{model}: sim:0 against the CPU");
    assert!(
        stderr.contains("load plan:\n   sim:0: layers 0.."),
        "{stderr}"
    );

    let split = [
        "--device",
        "sim:0,sim:1",
        "--split-mode",
        "layer",
        "--tensor-split",
        "1,1",
    ];
    let (two, stderr) = run(model, &split, None);
    assert_eq!(two, one, "{model}: sim:0,sim:1 against sim:0");
    assert!(
        stderr.contains("sim:0 -> sim:1: peer copies (self-test passed both ways)"),
        "{stderr}"
    );

    // Partial offload: the last 3 layers on sim:0, sim:1 and sim:2, the rest on the CPU.
    let (partial, stderr) = run(model, &["--device", "sim:0,sim:1,sim:2", "-ngl", "3"], None);
    assert_eq!(partial, cpu, "{model}: -ngl 3 against the CPU");
    assert!(stderr.contains("     cpu: layers 0.."), "{stderr}");
    // The prompt's products of the CPU's layers streamed to a simulated GPU (from 2 tokens
    // here, so the short prompt streams): the same tokens.
    let (out, stderr) = run_with_env(
        model,
        &["--device", "sim:0", "-ngl", "2"],
        &[("EMBER_STREAM_MIN_TOKENS", "2")],
    );
    assert!(out.status.success(), "{stderr}");
    let streamed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let streamed: Vec<u64> = streamed["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(streamed, cpu, "{model}: -ngl 2, prompt products streamed");

    let (corrupted, stderr) = run(model, &split, Some("0,1"));
    assert_eq!(corrupted, one, "{model}: a corrupting pair falls back");
    assert!(
        stderr.contains(
            "warning: EMBER_SIM_CORRUPT_PEER: peer copies from sim:0 to sim:1 corrupt (simulated)"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("sim:0 -> sim:1: host staging (self-test failed: a copy of 1 bytes"),
        "{stderr}"
    );
}

#[test]
fn smollm2_split_over_simulated_devices_gives_the_same_tokens() {
    check_model("smollm2-135m-instruct-q4_1");
}

#[test]
fn gemma3_split_over_simulated_devices_gives_the_same_tokens() {
    check_model("gemma3-270m-q4_k_m");
}

#[test]
fn bad_split_flags_are_refused_naming_the_flag() {
    let path = common::model_path("smollm2-135m-instruct-q4_1");
    let refused = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_ember"))
            .env_remove("EMBER_SIM_CORRUPT_PEER")
            .arg("run")
            .arg("-m")
            .arg(&path)
            .args(["-p", "a", "-n", "1", "-t", "2"])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = refused(&["--device", "sim:0,sim:1", "--tensor-split", "1,1,1"]);
    assert!(
        e.contains(
            "--tensor-split: expected at most one proportion per GPU (2: sim:0, sim:1), found 3"
        ),
        "{e}"
    );
    let e = refused(&["--device", "sim:0", "--tensor-split", "1,-2"]);
    assert!(e.contains("--tensor-split: expected non-negative"), "{e}");
    let e = refused(&["--device", "sim:1"]);
    assert!(
        e.contains("--device: expected simulated devices numbered from 0"),
        "{e}"
    );
    let e = refused(&[
        "--device",
        "sim:0,sim:1",
        "--main-gpu",
        "5",
        "--split-mode",
        "none",
    ]);
    assert!(
        e.contains("--main-gpu: expected a GPU index below 2"),
        "{e}"
    );
}

/// `--memory-report` over simulated devices and the CPU: after the run, each device's KV cache
/// at peak is its layers' blocks, computed here from the file's attention shape, and its
/// weights are exactly its layers' tensors as stored (a device without the output layer).
fn check_memory_report(model: &str) {
    let path = common::model_path(model);
    let gguf = ember_gguf::Gguf::open(&path).unwrap();
    let meta = gguf.metadata();
    let arch = meta.get_str("general.architecture").unwrap().to_string();
    let key = |name: &str| format!("{arch}.{name}");
    let n_layer = meta.get_usize(&key("block_count")).unwrap();
    let n_head_kv = meta.get_usize(&key("attention.head_count_kv")).unwrap();
    let head_dim = meta
        .get_usize_opt(&key("attention.key_length"))
        .unwrap()
        .unwrap_or_else(|| {
            meta.get_usize(&key("embedding_length")).unwrap()
                / meta.get_usize(&key("attention.head_count")).unwrap()
        });
    // One block of 32 tokens holds the 5 prompt tokens and the 11 fed back of 12 generated:
    // a K and a V row of f16 per token and KV head, on each layer.
    let block_bytes = 32 * n_head_kv * head_dim * 2 * 2;

    let (_, stderr) = run(
        model,
        &["--device", "sim:0,sim:1", "-ngl", "4", "--memory-report"],
        None,
    );
    let after_run = stderr
        .rsplit("memory report of the split's devices as the split counts them")
        .next()
        .unwrap();
    let mut layers_seen = 0;
    for device in ["cpu", "sim:0", "sim:1"] {
        // The load plan's line: `   sim:0: layers 26..28 (2); ...`.
        let plan_line = stderr
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{device}: layers ")))
            .unwrap_or_else(|| panic!("no plan line for {device}: {stderr}"));
        let range = plan_line.split("layers ").nth(1).unwrap();
        let (first, rest) = range.split_once("..").unwrap();
        let end = rest.split(' ').next().unwrap();
        let (first, end): (usize, usize) = (first.parse().unwrap(), end.parse().unwrap());
        layers_seen += end - first;
        let report_line = after_run
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{device}: weights ")))
            .unwrap_or_else(|| panic!("no report line for {device}: {stderr}"));
        let kv = ember_gpu::pool::format_bytes(((end - first) * block_bytes) as u64);
        assert!(
            report_line.contains(&format!("kv cache 0 B now ({kv} at peak)")),
            "{model} {device}: expected {} layers of KV ({kv}): {report_line}",
            end - first
        );
        assert!(report_line.contains("scratch 0 B now ("), "{report_line}");
        if device != "cpu" {
            let own: u64 =
                gguf.tensors()
                    .iter()
                    .filter(|t| {
                        let layer = t.name.strip_prefix("blk.").and_then(|r| {
                            r.split('.').next().and_then(|i| i.parse::<usize>().ok())
                        });
                        layer.is_some_and(|il| (first..end).contains(&il))
                    })
                    .map(|t| t.n_bytes)
                    .sum();
            let weights = ember_gpu::pool::format_bytes(own);
            assert!(
                report_line.contains(&format!("{device}: weights {weights},")),
                "{model} {device}: expected {weights}: {report_line}"
            );
        }
    }
    assert_eq!(layers_seen, n_layer, "{stderr}");
}

#[test]
fn the_memory_report_counts_each_simulated_devices_kv_and_weights() {
    check_memory_report("smollm2-135m-instruct-q4_1");
    check_memory_report("gemma3-270m-q4_k_m");
}

#[test]
fn a_device_whose_weights_are_in_host_memory_is_refused_or_warned_about_naming_it() {
    let model = "smollm2-135m-instruct-q4_1";
    let split = ["--device", "sim:0,sim:1"];
    let host_weights = [("EMBER_SIM_HOST_WEIGHTS", "1")];
    let hook = "warning: EMBER_SIM_HOST_WEIGHTS: the weights of sim:1 are observed in host memory (simulated)";

    let (out, stderr) = run_with_env(model, &split, &host_weights);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains(hook), "{stderr}");
    // sim:0 passes its check; sim:1 is refused, by name, with the way out.
    assert!(
        stderr.contains("sim:0: 33.8 MiB of weights placed"),
        "{stderr}"
    );
    assert!(
        stderr.contains("on sim:1: weights are not in VRAM on device 1 (sim:1): 128 of 128 weight buffers (58.3 MiB of 58.3 MiB) are not device memory, e.g. token_embd.weight is host memory"),
        "{stderr}"
    );
    assert!(
        stderr.contains("pass --allow-host-weights to run anyway"),
        "{stderr}"
    );

    // Over 1, 2, 3 and 4 devices, the last one's weights in host memory: refused, naming it.
    for n in 1..=4 {
        let devices: Vec<String> = (0..n).map(|i| format!("sim:{i}")).collect();
        let last = n - 1;
        let (out, stderr) = run_with_env(
            model,
            &["--device", &devices.join(",")],
            &[("EMBER_SIM_HOST_WEIGHTS", &last.to_string())],
        );
        assert!(!out.status.success(), "{n} devices: {stderr}");
        assert!(
            stderr.contains(&format!(
                "on sim:{last}: weights are not in VRAM on device {last} (sim:{last}): "
            )),
            "{n} devices: {stderr}"
        );
    }

    let (one, _) = run(model, &["--device", "sim:0"], None);
    let allowed = ["--device", "sim:0,sim:1", "--allow-host-weights"];
    let (out, stderr) = run_with_env(model, &allowed, &host_weights);
    assert!(out.status.success(), "{stderr}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let tokens: Vec<u64> = json["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(tokens, one, "the warning changes nothing else");
    assert!(stderr.contains(hook), "{stderr}");
    assert!(
        stderr.contains("sim:1: 58.3 MiB of weights placed, device free memory dropped by ")
            && stderr.contains("\n  warning: 128 of 128 weight buffers (58.3 MiB of 58.3 MiB) are not device memory, e.g. token_embd.weight is host memory"),
        "{stderr}"
    );
    // sim:0's weights are in its VRAM: its verdict carries no warning.
    let lines: Vec<&str> = stderr.lines().collect();
    let sim0 = lines
        .iter()
        .position(|l| l.starts_with("sim:0: 33.8 MiB of weights placed"))
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(!lines[sim0 + 1].starts_with("  warning"), "{stderr}");
}

#[test]
fn each_simulated_device_has_its_own_pool_and_budget_in_the_memory_report() {
    let model = "smollm2-135m-instruct-q4_1";
    let args = [
        "--device",
        "sim:0,sim:1,sim:2",
        "--vram-budget",
        "1GiB",
        "--memory-report",
    ];
    let (_, stderr) = run(model, &args, None);
    for device in 0..3 {
        assert!(
            stderr.contains(&format!(
                "device {device} (sim:{device}): caching pool, budget 1.0 GiB, idle floor 0 B"
            )),
            "{stderr}"
        );
    }
}

/// `ember stress` over four simulated devices: once the waves are done and the engine idles,
/// every device's pool gives its KV blocks and activations back, within 2 s, down to within 5%
/// of the memory it held after load (the command fails otherwise, naming the device).
#[test]
fn after_stress_each_simulated_devices_memory_returns_to_its_floor() {
    let path = common::model_path("smollm2-135m-instruct-q4_1");
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .env_remove("EMBER_SIM_CORRUPT_PEER")
        .env_remove("EMBER_SIM_HOST_WEIGHTS")
        .arg("stress")
        .arg("-m")
        .arg(&path)
        .args(["-t", "2", "--device", "sim:0,sim:1,sim:2,sim:3"])
        .args([
            "--waves",
            "2",
            "--parallel",
            "2",
            "--prompts",
            "32,48",
            "--gen",
            "8",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for device in 0..4 {
        assert!(
            stdout.contains(&format!(
                "device memory of sim:{device} was back within 5% of the post-load floor "
            )),
            "{stdout}"
        );
    }
}
