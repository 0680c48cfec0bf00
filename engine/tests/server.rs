//! `ember serve` end to end: the real binary on the pinned SmolLM2 model (CPU, 2 threads),
//! spoken to over raw HTTP/1.1 so that malformed requests and dropped connections can be sent
//! as they are.
//!
//! The tests run one at a time (a lock): several of them measure time (a 429 within 100 ms, a
//! stall seen within the watchdog plus 1 s), which two servers sharing two cores would blur.
//! Signals and /proc make them Unix-only.

#![cfg(unix)]

mod common;
#[path = "common/http.rs"]
mod http;

use std::path::PathBuf;
use std::sync::{Arc, Barrier, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use http::{EventStream, Response, ServerProcess};
use serde_json::{json, Value};

const MODEL: &str = "smollm2-135m-instruct-q4_1";

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn model() -> PathBuf {
    common::model_path(MODEL)
}

/// `base` with the fields of `extra` added (both objects).
fn with(base: Value, extra: Value) -> Value {
    let mut base = base;
    if let (Some(target), Some(fields)) = (base.as_object_mut(), extra.as_object()) {
        for (key, value) in fields {
            target.insert(key.clone(), value.clone());
        }
    }
    base
}

fn chat(content: &str, extra: Value) -> Value {
    with(
        json!({"messages": [{"role": "user", "content": content}]}),
        extra,
    )
}

fn completion(prompt: &str, extra: Value) -> Value {
    with(json!({ "prompt": prompt }), extra)
}

/// Asserts a 200 and returns the JSON body.
fn ok_json(response: &Response) -> Value {
    assert_eq!(response.status, 200, "{}", response.text());
    response.json()
}

/// The `data:` payloads of a streamed response, checked to end with `[DONE]`, as JSON.
fn stream_chunks(server: &ServerProcess, path: &str, body: &Value) -> Vec<Value> {
    let mut stream = EventStream::open(server.port, path, body, &[]);
    if stream.status != 200 {
        let status = stream.status;
        panic!(
            "{path}: status {status}: {}",
            String::from_utf8_lossy(&stream.rest())
        );
    }
    assert!(
        stream.headers["content-type"].starts_with("text/event-stream"),
        "{:?}",
        stream.headers
    );
    let events = stream.collect_all();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}")))
        .collect()
}

/// The chat text of streamed chunks.
fn chat_stream_text(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect()
}

fn completion_stream_text(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect()
}

/// The finish_reason of streamed chunks (exactly one chunk carries one).
fn stream_finish_reason(chunks: &[Value]) -> String {
    let reasons: Vec<&str> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
        .collect();
    assert_eq!(reasons.len(), 1, "{chunks:?}");
    reasons[0].to_string()
}

/// Token ids of a text as `ember run -p` and `/v1/completions` read it.
fn prompt_ids(server: &ServerProcess, text: &str) -> Vec<u64> {
    let body =
        ok_json(&server.post_json("/tokenize", &json!({"content": text, "add_special": true})));
    body["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("id"))
        .collect()
}

fn metric(metrics: &std::collections::BTreeMap<String, f64>, series: &str) -> f64 {
    *metrics
        .get(series)
        .unwrap_or_else(|| panic!("no series {series} in /metrics: {metrics:?}"))
}

/// Checks the usage object: totals add up and cached tokens are reported.
fn check_usage(usage: &Value) {
    let prompt = usage["prompt_tokens"].as_u64().expect("prompt_tokens");
    let completion = usage["completion_tokens"]
        .as_u64()
        .expect("completion_tokens");
    assert!(prompt > 0, "{usage}");
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(prompt + completion),
        "{usage}"
    );
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens");
    assert!(cached <= prompt, "{usage}");
}

#[test]
fn chat_and_completions_answer_as_openai_does() {
    let _serial = serial();
    let server = ServerProcess::start_ready(&model(), &[], &[]);
    let started = http_now();

    let models = ok_json(&server.get("/v1/models"));
    assert_eq!(models["object"], "list");
    let id = models["data"][0]["id"]
        .as_str()
        .expect("model id")
        .to_string();
    assert_eq!(id, "SmolLM2-135M-Instruct.Q4_1.gguf");
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["meta"]["n_vocab"], 49152);
    let by_stem = ok_json(&server.get("/v1/models/SmolLM2-135M-Instruct.Q4_1"));
    assert_eq!(by_stem["id"], id.as_str());

    // Non-streaming chat: every field OpenAI documents, and `length` at max_tokens.
    let request = chat(
        "What is the capital of France?",
        json!({"max_tokens": 8, "temperature": 0, "model": id}),
    );
    let answer = ok_json(&server.post_json("/v1/chat/completions", &request));
    assert!(
        answer["id"].as_str().unwrap().starts_with("chatcmpl-"),
        "{answer}"
    );
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["model"], id.as_str());
    assert!(answer["created"].as_u64().unwrap() >= started, "{answer}");
    assert!(
        answer["system_fingerprint"]
            .as_str()
            .unwrap()
            .starts_with("ember-"),
        "{answer}"
    );
    let choice = &answer["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    let content = choice["message"]["content"].as_str().unwrap().to_string();
    assert!(!content.is_empty(), "{answer}");
    assert_eq!(choice["finish_reason"], "length", "{answer}");
    assert_eq!(choice["logprobs"], Value::Null);
    check_usage(&answer["usage"]);
    assert_eq!(answer["usage"]["completion_tokens"], 8);

    // Streaming chat: the role first, the same text, one finish_reason, usage last.
    let chunks = stream_chunks(
        &server,
        "/v1/chat/completions",
        &with(
            request.clone(),
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let stream_id = chunks[0]["id"].as_str().unwrap();
    assert!(stream_id.starts_with("chatcmpl-"));
    for chunk in &chunks {
        assert_eq!(chunk["id"], stream_id, "one id for the whole stream");
        assert_eq!(chunk["object"], "chat.completion.chunk");
    }
    assert_eq!(chat_stream_text(&chunks), content);
    assert_eq!(stream_finish_reason(&chunks), "length");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]), "usage chunk has no choices");
    // The streamed request may reuse the first one's prompt blocks, so only the counts compare.
    for field in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(last["usage"][field], answer["usage"][field], "{field}");
    }
    check_usage(&last["usage"]);
    for chunk in &chunks[..chunks.len() - 1] {
        assert_eq!(chunk["usage"], Value::Null, "{chunk}");
    }

    // Text completions, string prompt and the same prompt as token ids.
    let prompt = "The capital of France is";
    let text_request = completion(prompt, json!({"max_tokens": 16, "temperature": 0}));
    let text_answer = ok_json(&server.post_json("/v1/completions", &text_request));
    assert!(text_answer["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(text_answer["object"], "text_completion");
    let text = text_answer["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(text.contains("Paris"), "{text_answer}");
    assert_eq!(text_answer["choices"][0]["finish_reason"], "length");
    check_usage(&text_answer["usage"]);
    let ids = prompt_ids(&server, prompt);
    assert_eq!(text_answer["usage"]["prompt_tokens"], ids.len());
    let by_ids = ok_json(&server.post_json(
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 16, "temperature": 0}),
    ));
    assert_eq!(by_ids["choices"][0]["text"], text.as_str());
    let text_chunks = stream_chunks(
        &server,
        "/v1/completions",
        &with(text_request.clone(), json!({"stream": true})),
    );
    assert_eq!(completion_stream_text(&text_chunks), text);
    assert_eq!(stream_finish_reason(&text_chunks), "length");
    assert!(text_chunks.iter().all(|c| c.get("usage").is_none()));

    // Stop strings, matched across a token boundary, never in the output.
    let with_logprobs = ok_json(&server.post_json(
        "/v1/completions",
        &with(text_request.clone(), json!({"logprobs": 1})),
    ));
    let tokens: Vec<String> = with_logprobs["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    let boundary = (1..tokens.len())
        .find(|&i| {
            i >= tokens.len() / 3
                && tokens[i - 1].trim().chars().count() >= 2
                && tokens[i].trim().chars().count() >= 2
        })
        .expect("two adjacent word tokens");
    let left: String = tokens[..boundary].concat();
    let tail: String = tokens[boundary - 1]
        .chars()
        .rev()
        .take(2)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let head: String = tokens[boundary].chars().take(2).collect();
    let stop = format!("{tail}{head}");
    let cut = text.find(&stop).expect("the stop string is in the text");
    assert!(cut <= left.len(), "{stop:?} first occurs by the boundary");
    let expected = &text[..cut];
    let stopped = ok_json(&server.post_json(
        "/v1/completions",
        &with(text_request.clone(), json!({"stop": ["never there", stop]})),
    ));
    assert_eq!(stopped["choices"][0]["text"], expected, "stop {stop:?}");
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    let stopped_chunks = stream_chunks(
        &server,
        "/v1/completions",
        &with(text_request.clone(), json!({"stop": stop, "stream": true})),
    );
    assert_eq!(completion_stream_text(&stopped_chunks), expected);
    assert_eq!(stream_finish_reason(&stopped_chunks), "stop");

    // Chat logprobs: one entry per token, log-probabilities at most 0, alternatives sorted, and
    // the greedy choice is the most likely alternative.
    let logprob_answer = ok_json(&server.post_json(
        "/v1/chat/completions",
        &with(
            request.clone(),
            json!({"logprobs": true, "top_logprobs": 3}),
        ),
    ));
    let entries = logprob_answer["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs.content");
    assert_eq!(
        entries.len() as u64,
        logprob_answer["usage"]["completion_tokens"]
            .as_u64()
            .unwrap()
    );
    let mut joined = Vec::new();
    for entry in entries {
        let logprob = entry["logprob"].as_f64().expect("logprob");
        assert!(logprob <= 0.0, "{entry}");
        let bytes: Vec<u8> = entry["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        if let Ok(token) = std::str::from_utf8(&bytes) {
            assert_eq!(entry["token"], token);
        }
        joined.extend_from_slice(&bytes);
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{entry}");
        let values: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(
            values.windows(2).all(|w| w[0] >= w[1]),
            "sorted: {values:?}"
        );
        assert!(values.iter().all(|&v| v <= 0.0));
        assert_eq!(
            top[0]["bytes"], entry["bytes"],
            "greedy picks the likeliest"
        );
        assert!((values[0] - logprob).abs() < 1e-9, "{entry}");
    }
    assert_eq!(String::from_utf8(joined).unwrap(), content);
    let streamed_logprobs = stream_chunks(
        &server,
        "/v1/chat/completions",
        &with(
            request.clone(),
            json!({"logprobs": true, "top_logprobs": 3, "stream": true}),
        ),
    );
    let streamed_entries: Vec<Value> = streamed_logprobs
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&streamed_entries, entries);

    // Completion (legacy) logprobs.
    let legacy = &with_logprobs["choices"][0]["logprobs"];
    assert_eq!(tokens.concat(), text);
    let token_logprobs = legacy["token_logprobs"].as_array().unwrap();
    let tops = legacy["top_logprobs"].as_array().unwrap();
    let offsets = legacy["text_offset"].as_array().unwrap();
    assert_eq!(token_logprobs.len(), tokens.len());
    assert_eq!(tops.len(), tokens.len());
    assert_eq!(offsets[0], 0);
    for (i, token) in tokens.iter().enumerate() {
        let logprob = token_logprobs[i].as_f64().unwrap();
        assert!(logprob <= 0.0);
        let top = tops[i].as_object().unwrap();
        assert_eq!(top.len(), 1);
        assert!((top[token].as_f64().unwrap() - logprob).abs() < 1e-9);
        if i > 0 {
            assert!(offsets[i].as_u64() > offsets[i - 1].as_u64() || tokens[i - 1].is_empty());
        }
    }

    // llama-server's routes.
    let detokenized = ok_json(&server.post_json("/detokenize", &json!({"tokens": ids})));
    assert!(detokenized["content"].as_str().unwrap().ends_with(prompt));
    let props = ok_json(&server.get("/props"));
    assert_eq!(props["total_slots"], 4);
    assert_eq!(props["n_vocab"], 49152);
    // The engine publishes its snapshot after the step that sent the last token, so a client
    // that asks at once can see the finished request's slot for a moment: wait for it to go.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let slots = ok_json(&server.get("/slots"));
        let slots = slots.as_array().unwrap();
        assert_eq!(slots.len(), 4);
        if slots.iter().all(|s| s["is_processing"] == false) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a slot is still processing 10 s after the last response: {slots:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn http_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// `ember run`'s stdout for the same prompt, greedy.
fn ember_run(args: &[&str]) -> String {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_ember"))
        .arg("run")
        .arg("-m")
        .arg(model())
        .args(["--temp", "0", "--device", "cpu", "-t", "2"])
        .args(args)
        .output()
        .expect("run ember run");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("UTF-8 output")
}

#[test]
fn greedy_output_equals_ember_run() {
    let _serial = serial();
    let server = ServerProcess::start_ready(&model(), &[], &[]);
    let prompt = "Once upon a time, in a small village,";
    let cli = ember_run(&["-p", prompt, "-n", "24"]);
    let answer = ok_json(&server.post_json(
        "/v1/completions",
        &completion(prompt, json!({"max_tokens": 24, "temperature": 0})),
    ));
    // `ember run` ends its output with a newline.
    assert_eq!(
        format!("{}\n", answer["choices"][0]["text"].as_str().unwrap()),
        cli
    );

    let question = "Write one sentence about the sea.";
    let cli_chat = ember_run(&["--chat", "-p", question, "-n", "24"]);
    let chat_answer = ok_json(&server.post_json(
        "/v1/chat/completions",
        &chat(question, json!({"max_tokens": 24, "temperature": 0})),
    ));
    assert_eq!(
        format!(
            "{}\n",
            chat_answer["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
        ),
        cli_chat
    );
}

/// A greedy generation: the prompt's token ids, the generated ids and text, and per step the top
/// two log-probabilities.
struct Generation {
    prompt_ids: Vec<u64>,
    ids: Vec<u64>,
    text: String,
    top_two: Vec<(f64, f64)>,
}

fn ids_of(value: &Value) -> Vec<u64> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("token ids: {value}"))
        .iter()
        .map(|id| id.as_u64().unwrap())
        .collect()
}

fn top_two_of(entries: &[Value]) -> Vec<(f64, f64)> {
    entries
        .iter()
        .map(|e| {
            let top = e["top_logprobs"].as_array().unwrap();
            let second = top
                .get(1)
                .map_or(f64::NEG_INFINITY, |t| t["logprob"].as_f64().unwrap());
            (top[0]["logprob"].as_f64().unwrap(), second)
        })
        .collect()
}

/// The greedy choice after `prompt`, evaluated as one prompt (the golden files' "step
/// re-evaluated alone").
fn reevaluate(server: &ServerProcess, prompt: &[u64]) -> u64 {
    let answer = ok_json(&server.post_json(
        "/v1/completions",
        &json!({
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "ignore_eos": true,
            "return_token_ids": true,
        }),
    ));
    ids_of(&answer["choices"][0]["token_ids"])[0]
}

#[test]
fn sixteen_concurrent_streams_each_get_their_solo_text() {
    let _serial = serial();
    // Without the prefix cache every prompt is computed, alone or batched, so a step can be
    // re-evaluated as the golden files' rule asks.
    let server =
        ServerProcess::start_ready(&model(), &["--parallel", "16", "--no-prefix-cache"], &[]);
    let questions: Vec<String> = (0..16)
        .map(|i| format!("Give me a short fact about the number {}.", i * 7 + 3))
        .collect();
    let request = |q: &str| {
        chat(
            q,
            json!({
                "max_tokens": 16,
                "temperature": 0,
                "logprobs": true,
                "top_logprobs": 2,
                "return_token_ids": true,
            }),
        )
    };
    let solo: Vec<Generation> = questions
        .iter()
        .map(|q| {
            let answer = ok_json(&server.post_json("/v1/chat/completions", &request(q)));
            let choice = &answer["choices"][0];
            Generation {
                prompt_ids: ids_of(&answer["prompt_token_ids"]),
                ids: ids_of(&choice["token_ids"]),
                text: choice["message"]["content"].as_str().unwrap().to_string(),
                top_two: top_two_of(choice["logprobs"]["content"].as_array().unwrap()),
            }
        })
        .collect();

    let barrier = Arc::new(Barrier::new(questions.len()));
    let port = server.port;
    let handles: Vec<_> = questions
        .iter()
        .map(|q| {
            let body = with(request(q), json!({"stream": true}));
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                let mut stream = EventStream::open(port, "/v1/chat/completions", &body, &[]);
                assert_eq!(stream.status, 200);
                let events = stream.collect_all();
                assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
                let chunks: Vec<Value> = events[..events.len() - 1]
                    .iter()
                    .map(|e| serde_json::from_str(e).unwrap())
                    .collect();
                let ids: Vec<u64> = chunks
                    .iter()
                    .filter(|c| c["choices"][0].get("token_ids").is_some())
                    .flat_map(|c| ids_of(&c["choices"][0]["token_ids"]))
                    .collect();
                (chat_stream_text(&chunks), ids)
            })
        })
        .collect();
    let together: Vec<(String, Vec<u64>)> = handles
        .into_iter()
        .map(|h| h.join().expect("client thread"))
        .collect();

    // The rule of the golden files, with the solo run standing in for llama.cpp: the ids are
    // equal up to the first step k where they part, and at k either the solo run disagrees with
    // itself (step k re-evaluated as one prompt picks another token), or the concurrent run
    // picked what the re-evaluation picks, or the solo run's top two are within 2%.
    let mut broken = Vec::new();
    for (i, ((text, ids), alone)) in together.iter().zip(&solo).enumerate() {
        let Some(k) = (0..alone.ids.len().min(ids.len())).find(|&k| alone.ids[k] != ids[k]) else {
            assert_eq!(ids, &alone.ids, "client {i}");
            assert_eq!(text, &alone.text, "client {i}");
            continue;
        };
        let mut prefix = alone.prompt_ids.clone();
        prefix.extend_from_slice(&alone.ids[..k]);
        let reevaluated = reevaluate(&server, &prefix);
        let (first, second) = alone.top_two[k];
        let ratio = (second - first).exp();
        if !(reevaluated != alone.ids[k] || reevaluated == ids[k] || ratio >= 0.98) {
            broken.push(format!(
                "client {i} parts from its solo run at step {k} (solo {}, together {}, re-evaluated {reevaluated}; solo p2/p1 = {ratio:.3}): {text:?} vs {:?}",
                alone.ids[k], ids[k], alone.text
            ));
        }
    }
    assert!(
        broken.is_empty(),
        "{} of 16 concurrent clients break the rule:\n{}",
        broken.len(),
        broken.join("\n")
    );
}

#[test]
fn overload_gets_429_at_once_and_every_admitted_request_completes() {
    let _serial = serial();
    let mut server =
        ServerProcess::start_ready(&model(), &["--parallel", "4", "--max-queue", "8"], &[]);
    let ids = prompt_ids(&server, "Tell me a story about a robot.");
    let body = json!({"prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": true});
    let baseline_rss = server.rss_kib();

    // Watch the queue and memory from the side while the burst runs.
    let watching = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let watcher = {
        let watching = Arc::clone(&watching);
        let port = server.port;
        let pid = server.pid();
        std::thread::spawn(move || {
            let (mut most_running, mut most_waiting, mut most_rss) = (0.0f64, 0.0f64, 0u64);
            while watching.load(std::sync::atomic::Ordering::Relaxed) {
                let response = http::request(port, "GET", "/metrics", &[], b"");
                let metrics = http::parse_metrics(&response.text());
                most_running = most_running.max(metric(&metrics, "ember_requests_running"));
                most_waiting = most_waiting.max(metric(&metrics, "ember_requests_waiting"));
                let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
                let rss: u64 = status
                    .lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|r| r.trim().trim_end_matches("kB").trim().parse().ok())
                    .unwrap();
                most_rss = most_rss.max(rss);
                std::thread::sleep(Duration::from_millis(20));
            }
            (most_running, most_waiting, most_rss)
        })
    };

    const CLIENTS: usize = 100;
    let barrier = Arc::new(Barrier::new(CLIENTS));
    let request = http::request_bytes(
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    );
    let port = server.port;
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let barrier = Arc::clone(&barrier);
            let request = request.clone();
            std::thread::spawn(move || {
                let stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
                stream.set_nodelay(true).unwrap();
                barrier.wait();
                let start = Instant::now();
                let response = http::send_and_read(stream, &request).expect("response");
                (response, start.elapsed())
            })
        })
        .collect();
    let results: Vec<(Response, Duration)> =
        clients.into_iter().map(|c| c.join().unwrap()).collect();
    watching.store(false, std::sync::atomic::Ordering::Relaxed);
    let (most_running, most_waiting, most_rss) = watcher.join().unwrap();

    let mut admitted = 0;
    let mut refused = 0;
    for (response, elapsed) in &results {
        match response.status {
            200 => {
                admitted += 1;
                let body = response.json();
                assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
                assert_eq!(body["usage"]["completion_tokens"], 16, "{body}");
            }
            429 => {
                refused += 1;
                assert!(
                    *elapsed < Duration::from_millis(100),
                    "a 429 took {elapsed:?}"
                );
                assert!(response.header("retry-after").is_some(), "{response:?}");
                let error = response.json();
                assert_eq!(error["error"]["type"], "rate_limit_error", "{error}");
                assert_eq!(error["error"]["code"], "queue_full", "{error}");
            }
            other => panic!("status {other}: {}", response.text()),
        }
    }
    assert!(
        admitted >= 12,
        "4 running plus 8 waiting fit: {admitted} admitted"
    );
    assert!(
        refused >= CLIENTS / 2,
        "the burst overflows the queue: {refused} refused"
    );
    assert!(most_running <= 4.0, "running {most_running}");
    assert!(most_waiting <= 8.0, "waiting {most_waiting}");
    assert!(server.alive());
    server.wait_healthy(Duration::from_secs(5));
    // 100 pending connections and 12 short sequences need little memory; unbounded queueing or
    // buffering would show here.
    let grown_mib = most_rss.saturating_sub(baseline_rss) / 1024;
    assert!(
        grown_mib < 256,
        "resident memory grew by {grown_mib} MiB during the burst"
    );
}

#[test]
fn clients_that_leave_mid_request_free_their_kv_blocks() {
    let _serial = serial();
    let mut server = ServerProcess::start_ready(&model(), &["--parallel", "4"], &[]);
    let ids = prompt_ids(&server, "Write a very long story about the ocean.");
    let endless = json!({"prompt": ids, "max_tokens": 2000, "ignore_eos": true, "stream": true});
    let port = server.port;

    // 200 streaming clients, 20 at a time, each leaving after its first tokens.
    const THREADS: usize = 20;
    const PER_THREAD: usize = 10;
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let body = endless.clone();
            std::thread::spawn(move || {
                for _ in 0..PER_THREAD {
                    let mut stream = EventStream::open(port, "/v1/completions", &body, &[]);
                    assert_eq!(stream.status, 200);
                    let first = stream.next_data().expect("a first chunk");
                    let chunk: Value = serde_json::from_str(&first).unwrap();
                    assert_eq!(chunk["choices"][0]["finish_reason"], Value::Null);
                    drop(stream);
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().expect("client thread");
    }
    // And non-streaming clients that hang up while their request runs.
    let request = http::request_bytes(
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        with(endless.clone(), json!({"stream": false}))
            .to_string()
            .as_bytes(),
    );
    let mut hung_up = Vec::new();
    for _ in 0..4 {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        std::io::Write::write_all(&mut stream, &request).unwrap();
        hung_up.push(stream);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&server.metrics(), "ember_requests_running") < 4.0 {
        assert!(
            Instant::now() < deadline,
            "the non-streaming requests never ran"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(hung_up);

    // Every request was cancelled and every KV block given back.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let metrics = server.metrics();
        let used = metric(&metrics, "ember_kv_blocks{state=\"used\"}");
        let running = metric(&metrics, "ember_requests_running");
        let waiting = metric(&metrics, "ember_requests_waiting");
        let cancelled = metric(
            &metrics,
            "ember_requests_ended_total{outcome=\"cancelled\"}",
        );
        if used == 0.0 && running == 0.0 && waiting == 0.0 && cancelled >= 204.0 {
            assert_eq!(metric(&metrics, "vllm:gpu_cache_usage_perc"), 0.0);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after the clients left: used blocks {used}, running {running}, waiting {waiting}, cancelled {cancelled}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(server.alive());
}

#[test]
fn bad_input_gets_a_4xx_with_an_openai_error_and_never_a_5xx() {
    let _serial = serial();
    let mut server =
        ServerProcess::start_ready(&model(), &["--api-key", "sekrit", "-c", "256"], &[]);
    let port = server.port;
    let key = ("Authorization", "Bearer sekrit");
    let json_type = ("Content-Type", "application/json");
    let user = r#""messages": [{"role": "user", "content": "hi"}]"#;
    let chat_with = |extra: &str| format!("{{{user}, {extra}}}").into_bytes();
    let long_prompt = format!("{{\"prompt\": [{}]}}", vec!["1"; 300].join(","));

    struct Case {
        what: &'static str,
        method: &'static str,
        path: &'static str,
        headers: Vec<(&'static str, &'static str)>,
        body: Vec<u8>,
        status: u16,
        param: Option<&'static str>,
    }
    let case = |what, path, body: Vec<u8>, status, param| Case {
        what,
        method: "POST",
        path,
        headers: vec![key, json_type],
        body,
        status,
        param,
    };
    let chat_path = "/v1/chat/completions";
    let mut cases = vec![
        case("malformed JSON", chat_path, b"{\"messages\": [".to_vec(), 400, None),
        case("not an object", chat_path, b"[1, 2]".to_vec(), 400, None),
        case("empty body", chat_path, Vec::new(), 400, None),
        case("invalid UTF-8", "/v1/completions", b"{\"prompt\": \"\xff\xfe\"}".to_vec(), 400, None),
        case("NaN", chat_path, chat_with("\"temperature\": NaN"), 400, None),
        case("a number too large for JSON", chat_path, chat_with("\"temperature\": 1e400"), 400, None),
        case("messages of a wrong type", chat_path, b"{\"messages\": \"hi\"}".to_vec(), 400, Some("messages")),
        case("temperature as a string", chat_path, chat_with("\"temperature\": \"hot\""), 400, Some("temperature")),
        case("negative temperature", chat_path, chat_with("\"temperature\": -1"), 400, Some("temperature")),
        case("huge temperature", chat_path, chat_with("\"temperature\": 1e300"), 400, Some("temperature")),
        case("negative max_tokens", chat_path, chat_with("\"max_tokens\": -5"), 400, Some("max_tokens")),
        case("huge max_tokens", chat_path, chat_with("\"max_tokens\": 1e20"), 400, Some("max_tokens")),
        case("max_tokens as a string", chat_path, chat_with("\"max_tokens\": \"10\""), 400, Some("max_tokens")),
        case("top_p above 1", chat_path, chat_with("\"top_p\": 1.5"), 400, Some("top_p")),
        case("negative top_k", chat_path, chat_with("\"top_k\": -7"), 400, Some("top_k")),
        case("penalty out of range", chat_path, chat_with("\"presence_penalty\": 3"), 400, Some("presence_penalty")),
        case("stream as a string", chat_path, chat_with("\"stream\": \"yes\""), 400, Some("stream")),
        case("n of 2", chat_path, chat_with("\"n\": 2"), 400, Some("n")),
        case("too many top_logprobs", chat_path, chat_with("\"logprobs\": true, \"top_logprobs\": 50"), 400, Some("top_logprobs")),
        case("a fractional seed", chat_path, chat_with("\"seed\": 1.5"), 400, Some("seed")),
        case("tools", chat_path, chat_with("\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]"), 400, Some("tools")),
        case("a JSON schema", chat_path, chat_with("\"response_format\": {\"type\": \"json_schema\"}"), 400, Some("response_format.type")),
        case("logit_bias", chat_path, chat_with("\"logit_bias\": {\"1\": 5}"), 400, Some("logit_bias")),
        case("the tool role", chat_path, b"{\"messages\": [{\"role\": \"tool\", \"content\": \"x\"}]}".to_vec(), 400, Some("messages[0].role")),
        case("an image part", chat_path, b"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\", \"image_url\": {\"url\": \"x\"}}]}]}".to_vec(), 400, Some("messages[0].content[0].type")),
        case("several prompts", "/v1/completions", b"{\"prompt\": [\"a\", \"b\"]}".to_vec(), 400, Some("prompt")),
        case("echo", "/v1/completions", b"{\"prompt\": \"a\", \"echo\": true}".to_vec(), 400, Some("echo")),
        case("a token id past the vocabulary", "/v1/completions", b"{\"prompt\": [1, 99999999]}".to_vec(), 400, Some("prompt")),
        case("a negative token id", "/v1/completions", b"{\"prompt\": [1, -2]}".to_vec(), 400, Some("prompt[1]")),
        case("a prompt longer than the context", "/v1/completions", long_prompt.into_bytes(), 400, Some("prompt")),
        case("an unknown model", chat_path, chat_with("\"model\": \"gpt-17\""), 404, Some("model")),
        case("tokenize without content", "/tokenize", b"{}".to_vec(), 400, Some("content")),
        case("detokenize past the vocabulary", "/detokenize", b"{\"tokens\": [99999999]}".to_vec(), 400, Some("tokens[0]")),
    ];
    cases.push(Case {
        what: "a wrong key",
        method: "POST",
        path: chat_path,
        headers: vec![("Authorization", "Bearer wrong"), json_type],
        body: chat_with("\"max_tokens\": 1"),
        status: 401,
        param: None,
    });
    cases.push(Case {
        what: "no key",
        method: "GET",
        path: "/v1/models",
        headers: vec![],
        body: Vec::new(),
        status: 401,
        param: None,
    });
    cases.push(Case {
        what: "a key that is not a bearer token",
        method: "GET",
        path: "/v1/models",
        headers: vec![("Authorization", "Basic c2Vrcml0")],
        body: Vec::new(),
        status: 401,
        param: None,
    });
    cases.push(Case {
        what: "a model name that is not UTF-8",
        method: "GET",
        path: "/v1/models/%FF",
        headers: vec![key],
        body: Vec::new(),
        status: 400,
        param: Some("model"),
    });
    cases.push(Case {
        what: "an unknown route",
        method: "GET",
        path: "/v2/everything",
        headers: vec![key],
        body: Vec::new(),
        status: 404,
        param: None,
    });
    cases.push(Case {
        what: "a wrong method",
        method: "GET",
        path: chat_path,
        headers: vec![key],
        body: Vec::new(),
        status: 405,
        param: None,
    });
    cases.push(Case {
        what: "a body that is not JSON by its content type",
        method: "POST",
        path: chat_path,
        headers: vec![key, ("Content-Type", "text/plain")],
        body: chat_with("\"max_tokens\": 1"),
        status: 415,
        param: None,
    });
    cases.push(Case {
        what: "a 20 MB body",
        method: "POST",
        path: "/v1/completions",
        headers: vec![key, json_type],
        body: vec![b' '; 20_000_000],
        status: 413,
        param: None,
    });

    for case in &cases {
        let response = http::try_request(port, case.method, case.path, &case.headers, &case.body)
            .unwrap_or_else(|e| panic!("{}: {e}", case.what));
        assert_eq!(
            response.status,
            case.status,
            "{}: {}",
            case.what,
            response.text()
        );
        assert!(
            response
                .header("content-type")
                .is_some_and(|t| t.starts_with("application/json")),
            "{}: {:?}",
            case.what,
            response.headers
        );
        let body = response.json();
        let error = &body["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{}: {body}",
            case.what
        );
        assert!(error["type"].is_string(), "{}: {body}", case.what);
        let fields = error.as_object().unwrap();
        assert!(
            fields.contains_key("param") && fields.contains_key("code"),
            "{}: {body}",
            case.what
        );
        if let Some(param) = case.param {
            assert_eq!(error["param"], param, "{}: {body}", case.what);
        }
    }

    // With the key, the same server answers; /health and /metrics need none.
    let good = http::request(
        port,
        "POST",
        chat_path,
        &[key, json_type],
        &chat_with("\"max_tokens\": 2"),
    );
    assert_eq!(good.status, 200, "{}", good.text());
    assert_eq!(server.get("/health").status, 200);
    let metrics = server.metrics();
    assert!(server.alive());
    // /health answered 503 while the model loaded; that is its meaning, not an error.
    let server_errors: Vec<&String> = metrics
        .keys()
        .filter(|k| {
            k.starts_with("ember_http_requests_total")
                && k.contains("status=\"5")
                && !k.contains("route=\"/health\"")
        })
        .collect();
    assert!(server_errors.is_empty(), "5xx answers: {server_errors:?}");
}

#[test]
fn a_shared_system_prompt_is_computed_once() {
    let _serial = serial();
    let server = ServerProcess::start_ready(&model(), &["--parallel", "2"], &[]);
    let system: String = (0..75)
        .map(|i| format!("Rule {i}: answer in plain words and stay polite. "))
        .collect();
    let system_tokens = prompt_ids(&server, &system).len();
    assert!(
        (900..1400).contains(&system_tokens),
        "system prompt of {system_tokens} tokens"
    );

    // A long generation keeps the engine busy, so that idle trim (which gives the prefix
    // cache's memory back) cannot run between the two requests.
    let keeper_ids = prompt_ids(&server, "Count to one thousand:");
    let mut keeper = EventStream::open(
        server.port,
        "/v1/completions",
        &json!({"prompt": keeper_ids, "max_tokens": 3000, "ignore_eos": true, "stream": true}),
        &[],
    );
    assert_eq!(keeper.status, 200);
    keeper.next_data().expect("the keeper runs");

    // Prompt tokens computed so far, once the engine has published the step that ended the
    // `finished`-th request (an answer can arrive before the snapshot that counts it).
    let computed = |server: &ServerProcess, finished: f64| {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let metrics = server.metrics();
            if metric(&metrics, "ember_requests_ended_total{outcome=\"finished\"}") >= finished {
                return metric(&metrics, "ember_prompt_tokens_total{kind=\"computed\"}");
            }
            assert!(
                Instant::now() < deadline,
                "the engine never published the end of request {finished}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let ask = |question: &str| {
        ok_json(&server.post_json(
            "/v1/chat/completions",
            &json!({
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
                "max_tokens": 1,
                "temperature": 0,
            }),
        ))
    };
    let before = computed(&server, 0.0);
    let first = ask("What is rule 3?");
    let after_first = computed(&server, 1.0);
    let second = ask("Which rule mentions politeness first?");
    let after_second = computed(&server, 2.0);
    drop(keeper);

    let first_computed = after_first - before;
    let second_computed = after_second - after_first;
    let first_prompt = first["usage"]["prompt_tokens"].as_f64().unwrap();
    assert!(
        first_computed >= first_prompt * 0.9,
        "the first request computed {first_computed} of its {first_prompt} prompt tokens"
    );
    assert!(
        second_computed <= 0.1 * first_computed,
        "the second request computed {second_computed} prompt tokens, the first {first_computed}"
    );
    let second_prompt = second["usage"]["prompt_tokens"].as_f64().unwrap();
    let second_cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_f64()
        .unwrap();
    assert!(
        second_cached >= second_prompt - second_computed,
        "usage reports {second_cached} cached of {second_prompt}"
    );
}

#[test]
fn a_stalled_engine_step_turns_health_503_while_metrics_answer() {
    let _serial = serial();
    // Step 3 (the second decode step of the first request) sleeps 4 s, as a hung device would.
    let server = ServerProcess::start_ready(
        &model(),
        &["--watchdog", "1"],
        &[("EMBER_FAULT_STALL_STEP", "3:4")],
    );
    let health = server.get("/health");
    assert_eq!(health.json(), json!({"status": "ok"}));

    let port = server.port;
    let sent = Instant::now();
    let client = std::thread::spawn(move || {
        http::request(
            port,
            "POST",
            "/v1/completions",
            &[("Content-Type", "application/json")],
            json!({"prompt": "Hello", "max_tokens": 4, "ignore_eos": true})
                .to_string()
                .as_bytes(),
        )
    });
    let stalled = loop {
        let response = server.get("/health");
        if response.status == 503 {
            break response;
        }
        assert_eq!(response.status, 200);
        assert!(
            sent.elapsed() < Duration::from_secs(3),
            "/health still says ok {:?} after the request",
            sent.elapsed()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let seen_after = sent.elapsed();
    // The watchdog is 1 s: the stall must show within watchdog + 1 s.
    assert!(
        seen_after <= Duration::from_secs(2),
        "the stall showed after {seen_after:?}"
    );
    let body = stalled.json();
    assert_eq!(body["status"], "stalled", "{body}");
    assert!(
        body["reason"].as_str().is_some_and(|r| !r.is_empty()),
        "{body}"
    );
    assert!(
        body["step_running_seconds"].as_f64().unwrap() > 1.0,
        "{body}"
    );
    assert_eq!(
        body["running_requests"].as_array().map(Vec::len),
        Some(1),
        "{body}"
    );
    assert_eq!(body["waiting_requests"], 0, "{body}");

    // /metrics does not wait on the stuck engine thread.
    let scrape_start = Instant::now();
    let metrics = server.metrics();
    assert!(scrape_start.elapsed() < Duration::from_millis(500));
    assert_eq!(metric(&metrics, "ember_requests_running"), 1.0);
    assert!(metric(&metrics, "ember_engine_seconds_since_last_step") >= 1.0);
    assert_eq!(server.get("/health").status, 503, "still stalled");

    // When the step comes back, so does health, and the request completes.
    let answer = client.join().unwrap();
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(answer.json()["usage"]["completion_tokens"], 4);
    server.wait_healthy(Duration::from_secs(5));
}

#[test]
fn sigterm_lets_running_streams_finish_refuses_new_requests_and_exits_0() {
    let _serial = serial();
    let mut server = ServerProcess::start_ready(&model(), &[], &[]);
    let ids = prompt_ids(&server, "Describe a long walk through a forest.");
    let body = json!({
        "prompt": ids,
        "max_tokens": 48,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let mut streams: Vec<EventStream> = (0..2)
        .map(|_| EventStream::open(server.port, "/v1/completions", &body, &[]))
        .collect();
    for stream in &mut streams {
        assert_eq!(stream.status, 200);
        stream.next_data().expect("the stream started");
    }
    server.signal(libc::SIGTERM);

    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let health = server.get("/health");
        if health.status == 503 {
            assert_eq!(health.json()["status"], "draining");
            break;
        }
        assert!(Instant::now() < deadline, "/health never said draining");
        std::thread::sleep(Duration::from_millis(20));
    }
    let refused = server.post_json("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 1}));
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert!(refused.header("retry-after").is_some());
    assert_eq!(refused.json()["error"]["code"], "server_draining");

    for stream in &mut streams {
        let events = stream.collect_all();
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        assert_eq!(stream_finish_reason(&chunks), "length");
        assert_eq!(
            chunks.last().unwrap()["usage"]["completion_tokens"],
            48,
            "the stream ran to its end"
        );
    }
    let status = server
        .wait_exit(Duration::from_secs(15))
        .expect("the server exits after the drain");
    assert_eq!(status.code(), Some(0), "{}", server.stderr_text());
    assert!(
        server.stderr_text().contains("drained"),
        "{}",
        server.stderr_text()
    );
}

#[test]
fn absurd_flags_are_refused_before_loading() {
    let _serial = serial();
    for (flags, named) in [
        (vec!["--parallel", "0"], "--parallel"),
        (vec!["--ubatch", "0"], "--ubatch"),
        (vec!["-c", "99999999"], "--ctx-size"),
        (vec!["--drain-timeout", "-1"], "--drain-timeout"),
        (vec!["--drain-timeout", "nan"], "--drain-timeout"),
        (vec!["--watchdog", "0"], "--watchdog"),
    ] {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_ember"))
            .args(["serve", "-m"])
            .arg(model())
            .args(["--port", "0", "--device", "cpu"])
            .args(&flags)
            .output()
            .expect("run ember serve");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{flags:?} was accepted");
        assert!(stderr.contains(named), "{flags:?}: {stderr}");
        assert!(
            !stderr.contains("listening on"),
            "{flags:?} got as far as binding: {stderr}"
        );
    }
}

#[test]
fn a_second_signal_exits_at_once() {
    let _serial = serial();
    let mut server = ServerProcess::start_ready(&model(), &[], &[]);
    let mut stream = EventStream::open(
        server.port,
        "/v1/completions",
        &json!({"prompt": "Once", "max_tokens": 3000, "ignore_eos": true, "stream": true}),
        &[],
    );
    assert_eq!(stream.status, 200);
    stream.next_data().expect("the stream started");
    server.signal(libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.get("/health").status != 503 {
        assert!(Instant::now() < deadline, "/health never said draining");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The stream would run for minutes; the second signal does not wait for it.
    server.signal(libc::SIGINT);
    let status = server
        .wait_exit(Duration::from_secs(2))
        .expect("the second signal ends the process at once");
    assert_eq!(
        status.code(),
        Some(128 + libc::SIGINT),
        "{}",
        server.stderr_text()
    );
}

#[test]
fn a_model_that_cannot_be_loaded_ends_the_process_with_an_error() {
    let _serial = serial();
    let directory = tempfile::tempdir().expect("temporary directory");
    let broken = directory.path().join("broken.gguf");
    std::fs::write(&broken, b"GGUF but not really").unwrap();
    let mut server = ServerProcess::start(&broken, &[], &[]);
    // It listens at once and says it is loading until the load fails.
    let health = http::try_request(server.port, "GET", "/health", &[], b"");
    if let Ok(health) = health {
        assert_eq!(health.status, 503);
        assert_eq!(health.json(), json!({"status": "loading"}));
    }
    let status = server
        .wait_exit(Duration::from_secs(30))
        .expect("the process ends when the load fails");
    assert!(!status.success());
    let stderr = server.stderr_text();
    assert!(stderr.contains("error: cannot load"), "{stderr}");
    assert!(stderr.contains("broken.gguf"), "{stderr}");
}

#[test]
fn metrics_over_a_split_give_each_devices_memory() {
    let _serial = serial();
    // -ngl 10 over two simulated devices (an even split: 5 layers each), the rest on the CPU.
    let server = ServerProcess::start_ready(
        &model(),
        &["--device", "sim:0,sim:1", "-ngl", "10", "-c", "256"],
        &[],
    );
    ok_json(&server.post_json(
        "/v1/completions",
        &completion(
            "The capital of France is",
            json!({"max_tokens": 8, "temperature": 0}),
        ),
    ));
    let pool_series = |name: &str, device: &str| format!("{name}{{device=\"{device}\"}}");
    let trims = |metrics: &std::collections::BTreeMap<String, f64>, device: &str| {
        metric(
            metrics,
            &pool_series("ember_device_memory_trims_total", device),
        )
    };
    // The pools' trims so far (the one after load): the idle trim after the request comes
    // later, once the pool has seen no allocation or free for its idle time.
    let after_request = server.metrics();
    let trims_before = [
        trims(&after_request, "sim:0"),
        trims(&after_request, "sim:1"),
    ];
    // The attention shape from the file: a K and a V row of f16 per token and KV head, in
    // blocks of 32 tokens, on each layer.
    let gguf = ember_gguf::Gguf::open(&model()).unwrap();
    let meta = gguf.metadata();
    let n_layer = meta.get_usize("llama.block_count").unwrap();
    let head_dim = meta.get_usize("llama.embedding_length").unwrap()
        / meta.get_usize("llama.attention.head_count").unwrap();
    let layer_block_bytes =
        (32 * meta.get_usize("llama.attention.head_count_kv").unwrap() * head_dim * 2 * 2) as f64;
    let layers = [("cpu", n_layer - 10), ("sim:0", 5), ("sim:1", 5)];
    let series = |device: &str, purpose: &str| {
        format!("ember_device_memory_bytes{{device=\"{device}\",purpose=\"{purpose}\"}}")
    };
    // The engine's block count and the split's byte counts are read at one scrape; an idle
    // trim between two scrapes may change both, so the relation is checked on a settled one.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let metrics = server.metrics();
        let resident = metric(&metrics, "ember_kv_blocks{state=\"resident\"}");
        let settled = layers.iter().all(|&(device, n)| {
            metric(&metrics, &series(device, "kv")) == resident * n as f64 * layer_block_bytes
        });
        if settled || Instant::now() > deadline {
            assert!(resident > 0.0, "{metrics:?}");
            for (device, n) in layers {
                assert_eq!(
                    metric(&metrics, &series(device, "kv")),
                    resident * n as f64 * layer_block_bytes,
                    "{device}: {n} layers of {resident} blocks"
                );
                assert!(
                    metrics.contains_key(&series(device, "scratch")),
                    "{metrics:?}"
                );
            }
            // A simulated device's weights are exactly its layers' tensors, as stored.
            for (device, first) in [("sim:0", n_layer - 10), ("sim:1", n_layer - 5)] {
                let own: u64 = gguf
                    .tensors()
                    .iter()
                    .filter(|t| {
                        t.name
                            .strip_prefix("blk.")
                            .and_then(|r| r.split('.').next()?.parse::<usize>().ok())
                            .is_some_and(|il| (first..first + 5).contains(&il))
                    })
                    .map(|t| t.n_bytes)
                    .sum();
                assert_eq!(metric(&metrics, &series(device, "weights")), own as f64);
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // Each simulated device's pool: it held its weights and more during the request, and once
    // idle its trimmer trims it (a trim after the request's) back to within 5% of what it held
    // after load (`ember stress`'s floor rule).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let metrics = server.metrics();
        let trimmed = ["sim:0", "sim:1"]
            .iter()
            .zip(trims_before)
            .all(|(device, before)| trims(&metrics, device) > before);
        if trimmed || Instant::now() > deadline {
            for (device, before) in ["sim:0", "sim:1"].into_iter().zip(trims_before) {
                assert!(trims(&metrics, device) > before, "{device}: {metrics:?}");
                let held = metric(
                    &metrics,
                    &pool_series("ember_device_memory_held_bytes", device),
                );
                let floor = metric(
                    &metrics,
                    &pool_series("ember_device_memory_floor_bytes", device),
                );
                let peak = metric(
                    &metrics,
                    &pool_series("ember_device_memory_peak_held_bytes", device),
                );
                let weights = metric(&metrics, &series(device, "weights"));
                assert!(floor >= weights && peak > floor, "{device}: {metrics:?}");
                assert!(held <= floor * 1.05, "{device}: held {held}, floor {floor}");
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The recurrent-state bytes `/metrics` reports (the CPU's row of `ember_device_memory_bytes`).
fn recurrent_state_bytes(metrics: &std::collections::BTreeMap<String, f64>) -> f64 {
    metric(
        metrics,
        "ember_device_memory_bytes{device=\"cpu\",purpose=\"recurrent_state\"}",
    )
}

#[test]
fn a_hybrid_model_serves_sixteen_streams_and_frees_the_states_of_cancelled_ones() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let model = common::write_hybrid(dir.path(), "qwen35-serve.gguf", 2048, 23);
    let server = ServerProcess::start_ready(&model, &["--parallel", "16"], &[]);
    let port = server.port;
    assert_eq!(recurrent_state_bytes(&server.metrics()), 0.0);

    // 16 streams at once, prompts of different lengths given as token ids; the even ones run
    // to their end, the odd ones hang up after their first chunks.
    let barrier = Arc::new(Barrier::new(16));
    let handles: Vec<_> = (0..16u64)
        .map(|k| {
            let prompt: Vec<u64> = (0..8 + 5 * k)
                .map(|i| 10 + (i * 37 + k * 11) % 2000)
                .collect();
            let body = json!({
                "prompt": prompt,
                "max_tokens": if k % 2 == 0 { 24 } else { 400 },
                "ignore_eos": true,
                "temperature": 0,
                "stream": true,
            });
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                let mut stream = EventStream::open(port, "/v1/completions", &body, &[]);
                assert_eq!(stream.status, 200);
                if k % 2 == 1 {
                    for _ in 0..3 {
                        stream.next_data().expect("a chunk before hanging up");
                    }
                    return None;
                }
                let chunks: Vec<Value> = stream
                    .collect_all()
                    .iter()
                    .filter(|e| e.as_str() != "[DONE]")
                    .map(|e| serde_json::from_str(e).unwrap())
                    .collect();
                Some(chunks)
            })
        })
        .collect();

    // While the streams run, their states are memory /metrics shows.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut most_state = 0.0f64;
    let mut most_running = 0.0f64;
    while handles.iter().any(|h| !h.is_finished()) {
        let metrics = server.metrics();
        most_state = most_state.max(recurrent_state_bytes(&metrics));
        most_running = most_running.max(metric(&metrics, "ember_requests_running"));
        assert!(Instant::now() < deadline, "the streams did not finish");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut finished = 0;
    for handle in handles {
        if let Some(chunks) = handle.join().expect("client thread") {
            let reason = stream_finish_reason(&chunks);
            assert_eq!(reason, "length", "{chunks:?}");
            finished += 1;
        }
    }
    assert_eq!(finished, 8);
    assert!(
        most_running > 1.0,
        "the streams ran together: {most_running}"
    );
    assert!(most_state > 0.0, "/metrics never showed a recurrent state");

    // Every sequence ended (8 finished, 8 cancelled): no state, no KV block, nothing running.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = server.metrics();
        let state = recurrent_state_bytes(&metrics);
        let used = metric(&metrics, "ember_kv_blocks{state=\"used\"}");
        let running = metric(&metrics, "ember_requests_running");
        let cancelled = metric(
            &metrics,
            "ember_requests_ended_total{outcome=\"cancelled\"}",
        );
        if state == 0.0 && used == 0.0 && running == 0.0 && cancelled >= 8.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after the streams ended: recurrent state {state} bytes, used blocks {used}, running {running}, cancelled {cancelled}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
