"""`ember serve` through the official `openai` Python client, as users drive an OpenAI-compatible
server: chat and completions, streaming or not, stop strings, finish reasons, usage, logprobs,
`/v1/models`, greedy output equal to `ember run`, many concurrent streams, and API keys; raw HTTP
(httpx) for `/health` and `/metrics`, whose content the client does not read.

Overload, disconnects, malformed input, stalls and SIGTERM are tested with raw HTTP in
`engine/tests/server.rs`; they are not repeated here.

Every generation is greedy (`temperature=0`) unless a test is about sampling, so expected texts are
exact, and short (`max_tokens` of 8 to 24) so the suite stays well under two minutes on two cores.

`cargo xtask test` runs this suite in a venv it builds from `requirements.txt`; by hand, after a
`cargo build --release -p ember`: `target/server-tests-venv/bin/python -m pytest tests/server`.
"""

from __future__ import annotations

import asyncio
import math
import re
import time

import httpx
import openai
import pytest

from ember_server import MODEL_ALIAS, ember_run, running_server

CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
COMPLETION_PROMPT = "The capital of France is"

# ---------------------------------------------------------------------------------------------
# Helpers.


def greedy_chat(client: openai.OpenAI, **extra):
    return client.chat.completions.create(
        model=MODEL_ALIAS, messages=CHAT_MESSAGES, temperature=0, **extra
    )


def greedy_completion(client: openai.OpenAI, **extra):
    extra.setdefault("prompt", COMPLETION_PROMPT)
    return client.completions.create(model=MODEL_ALIAS, temperature=0, **extra)


def check_usage(usage, completion_tokens: int | None = None) -> None:
    assert usage is not None, "expected usage, found none"
    assert usage.prompt_tokens > 0, usage
    assert usage.completion_tokens > 0, usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage
    if completion_tokens is not None:
        assert usage.completion_tokens == completion_tokens, usage


def tokenize(http: httpx.Client, text: str) -> list[int]:
    """llama-server's `/tokenize`, with special tokens added as a completion prompt gets them."""
    response = http.post("/tokenize", json={"content": text, "add_special": True})
    assert response.status_code == 200, response.text
    tokens = response.json()["tokens"]
    assert tokens and all(isinstance(token, int) for token in tokens), tokens
    return tokens


PROMETHEUS_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{[^}]*\})?\s+(?P<value>\S+)(\s+\d+)?$"
)


def metric_samples(text: str) -> dict[str, list[float]]:
    """Prometheus text format: every sample's value by metric name (all label sets together).
    A line that is neither a comment nor a sample fails the test."""
    samples: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = PROMETHEUS_SAMPLE.match(line)
        assert match, f"expected a Prometheus sample line, found {line!r}"
        samples.setdefault(match["name"], []).append(float(match["value"]))
    return samples


def read_metrics(http: httpx.Client) -> dict[str, list[float]]:
    response = http.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain"), response.headers
    return metric_samples(response.text)


def gauge(samples: dict[str, list[float]], name: str) -> float:
    assert name in samples, f"expected {name} in /metrics, found {sorted(samples)}"
    values = samples[name]
    assert len(values) == 1, f"expected one sample of {name}, found {values}"
    return values[0]


# ---------------------------------------------------------------------------------------------
# Models, health, metrics.


def test_models_list_names_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL_ALIAS]
    assert models.data[0].object == "model"


def test_health_is_ok_when_ready(http: httpx.Client) -> None:
    response = http.get("/health")
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "ok"


def test_metrics_show_a_running_request_and_its_kv_blocks(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    idle = read_metrics(http)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert gauge(idle, name) == 0, f"expected {name} 0 while idle"
    assert 0 <= gauge(idle, "vllm:gpu_cache_usage_perc") <= 1

    # Counting goes on for far longer than the 48 tokens allowed, so the request is still
    # running when the first chunk arrives and /metrics is read.
    stream = client.completions.create(
        model=MODEL_ALIAS, prompt="1, 2, 3, 4, 5,", max_tokens=48, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks)
    busy = read_metrics(http)
    assert gauge(busy, "vllm:num_requests_running") >= 1, busy
    assert (
        0 < gauge(busy, "vllm:gpu_cache_usage_perc") <= 1
    ), "expected KV blocks in use while a request runs"
    finish_reasons = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finish_reasons[-1] == "length"

    # The snapshot is refreshed by the engine loop; give it a moment to see the request go.
    deadline = time.monotonic() + 5
    while True:
        after = read_metrics(http)
        if gauge(after, "vllm:num_requests_running") == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert gauge(after, "vllm:num_requests_running") == 0, after
    assert gauge(after, "vllm:num_requests_waiting") == 0, after


# ---------------------------------------------------------------------------------------------
# Chat completions.


def test_chat_non_streaming(client: openai.OpenAI) -> None:
    started = time.time()
    completion = greedy_chat(client, max_tokens=24)
    assert completion.object == "chat.completion"
    assert completion.id, completion
    assert completion.model == MODEL_ALIAS
    assert started - 5 <= completion.created <= time.time() + 5, completion.created
    assert completion.system_fingerprint, "expected a system_fingerprint from the build manifest"
    assert len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content, choice
    assert choice.finish_reason in ("stop", "length")
    check_usage(completion.usage)
    if choice.finish_reason == "length":
        assert completion.usage.completion_tokens == 24


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    whole = greedy_chat(client, max_tokens=24)
    stream = greedy_chat(client, max_tokens=24, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks, "expected chunks, found an empty stream"
    assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk.id for chunk in chunks}) == 1, "expected one id across the stream"
    with_choices = [chunk for chunk in chunks if chunk.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in with_choices)
    assert text == whole.choices[0].message.content
    finish_reasons = [
        c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason
    ]
    assert finish_reasons == [whole.choices[0].finish_reason]
    # include_usage: one last chunk with no choices carries the usage of the whole request.
    assert chunks[-1].choices == [], chunks[-1]
    check_usage(chunks[-1].usage)
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_chat_finish_reason_length(client: openai.OpenAI) -> None:
    for limit in ({"max_tokens": 5}, {"max_completion_tokens": 5}):
        completion = greedy_chat(client, **limit)
        assert completion.choices[0].finish_reason == "length", limit
        check_usage(completion.usage, completion_tokens=5)


def test_chat_logprobs(client: openai.OpenAI) -> None:
    completion = greedy_chat(client, max_tokens=12, logprobs=True, top_logprobs=3)
    choice = completion.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content, choice
    entries = choice.logprobs.content
    assert len(entries) == completion.usage.completion_tokens
    assert "".join(entry.token for entry in entries) == choice.message.content
    assert all(entry.bytes is not None for entry in entries), "expected the bytes of every token"
    assert b"".join(bytes(entry.bytes) for entry in entries).decode() == choice.message.content
    for entry in entries:
        assert entry.logprob <= 0, entry
        top = entry.top_logprobs
        assert len(top) == 3, entry
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True), entry
        assert sum(math.exp(t.logprob) for t in top) <= 1 + 1e-4, entry
        # Greedy: the chosen token is the most likely one.
        assert entry.token == top[0].token, entry
        assert entry.logprob == pytest.approx(top[0].logprob, abs=1e-5), entry


def test_chat_stop_string_across_token_boundaries(client: openai.OpenAI) -> None:
    reference = greedy_chat(client, max_tokens=24, logprobs=True)
    text = reference.choices[0].message.content
    tokens = [entry.token for entry in reference.choices[0].logprobs.content]
    # A stop string made of the end of one token and the start of the next, whose first
    # occurrence in the text is exactly there, so only matching across the boundary finds it.
    stop = None
    offset = 0
    for index in range(len(tokens) - 1):
        offset += len(tokens[index])
        left, right = tokens[index], tokens[index + 1]
        if index < 2 or len(left.strip()) < 2 or len(right.strip()) < 2:
            continue
        candidate = left[-2:] + right[:2]
        if text.find(candidate) == offset - 2:
            stop = candidate
            break
    assert stop is not None, f"expected two adjacent tokens of 2+ characters in {tokens}"
    expected = text[: text.index(stop)]

    stopped = greedy_chat(client, max_tokens=24, stop=["no such text", stop])
    assert stopped.choices[0].message.content == expected
    assert stopped.choices[0].finish_reason == "stop"

    stream = greedy_chat(client, max_tokens=24, stop=[stop], stream=True)
    chunks = [chunk for chunk in stream if chunk.choices]
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert streamed == expected, f"stop {stop!r}"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_greedy_equals_ember_run(client: openai.OpenAI) -> None:
    prompt = CHAT_MESSAGES[0]["content"]
    reference = ember_run(prompt, n_predict=24, chat=True)
    completion = greedy_chat(client, max_tokens=24)
    assert completion.choices[0].message.content == reference["text"]
    assert completion.usage.completion_tokens == len(reference["tokens"])
    assert completion.usage.prompt_tokens == len(reference["prompt_ids"])


def test_chat_seeded_sampling_repeats(client: openai.OpenAI) -> None:
    def sample() -> str:
        completion = client.chat.completions.create(
            model=MODEL_ALIAS,
            messages=CHAT_MESSAGES,
            temperature=1.0,
            top_p=0.95,
            seed=1234,
            max_tokens=16,
        )
        return completion.choices[0].message.content

    assert sample() == sample()


def chatml(messages: list[dict]) -> str:
    """SmolLM2's chat template (ChatML, with its default system prompt when none is given), written
    out by hand so the server's rendering is checked against an independent one."""
    rendered = ""
    if messages[0]["role"] != "system":
        rendered += (
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
            "<|im_end|>\n"
        )
    for message in messages:
        rendered += f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n"
    return rendered + "<|im_start|>assistant\n"


def test_chat_multi_turn_renders_every_message(client: openai.OpenAI, http: httpx.Client) -> None:
    messages = [
        {"role": "system", "content": "You answer with one word."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    completion = client.chat.completions.create(
        model=MODEL_ALIAS, messages=messages, temperature=0, max_tokens=8
    )
    assert completion.choices[0].message.content, completion
    response = http.post(
        "/tokenize", json={"content": chatml(messages), "add_special": True, "parse_special": True}
    )
    assert response.status_code == 200, response.text
    assert completion.usage.prompt_tokens == len(response.json()["tokens"])


# ---------------------------------------------------------------------------------------------
# Completions.


def test_completion_non_streaming_and_streaming(client: openai.OpenAI, http: httpx.Client) -> None:
    completion = greedy_completion(client, max_tokens=8)
    assert completion.object == "text_completion"
    assert completion.model == MODEL_ALIAS
    choice = completion.choices[0]
    assert choice.text.startswith(" Paris"), choice.text
    assert choice.finish_reason == "length"
    check_usage(completion.usage, completion_tokens=8)
    assert completion.usage.prompt_tokens == len(tokenize(http, COMPLETION_PROMPT))

    stream = greedy_completion(
        client, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    with_choices = [chunk for chunk in chunks if chunk.choices]
    assert "".join(chunk.choices[0].text for chunk in with_choices) == choice.text
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.model_dump() == completion.usage.model_dump()


def test_completion_prompt_as_token_ids(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = tokenize(http, COMPLETION_PROMPT)
    from_text = greedy_completion(client, max_tokens=8)
    from_ids = greedy_completion(client, prompt=ids, max_tokens=8)
    assert from_ids.choices[0].text == from_text.choices[0].text
    assert from_ids.usage.prompt_tokens == len(ids)


def test_completion_greedy_equals_ember_run(client: openai.OpenAI) -> None:
    reference = ember_run(COMPLETION_PROMPT, n_predict=16, chat=False)
    completion = greedy_completion(client, max_tokens=16)
    assert completion.choices[0].text == reference["text"]


def test_completion_stop_string(client: openai.OpenAI) -> None:
    text = greedy_completion(client, max_tokens=16).choices[0].text
    # A word from the middle of the output (" Paris.\n\nThe United States ..." for SmolLM2),
    # given as a plain string rather than a list.
    words = [word for word in re.findall(r"[A-Za-z]{4,}", text) if text.index(word) > 0]
    assert len(words) >= 2, f"expected a few words in {text!r}"
    stop = words[1]
    stopped = greedy_completion(client, max_tokens=16, stop=stop)
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text


def test_completion_logprobs(client: openai.OpenAI) -> None:
    completion = greedy_completion(client, max_tokens=6, logprobs=2)
    choice = completion.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None, choice
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert "".join(logprobs.tokens) == choice.text
    assert len(logprobs.top_logprobs) == 6
    for token, token_logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs
    ):
        assert len(top) == 2, top
        assert token_logprob <= 0
        # Greedy: the chosen token has the highest log-probability of the step.
        assert token_logprob == pytest.approx(max(top.values()), abs=1e-5), (token, top)
        assert top.get(token) == pytest.approx(token_logprob, abs=1e-5), (token, top)


# ---------------------------------------------------------------------------------------------
# Concurrency.

CONCURRENT_CLIENTS = 16
CONCURRENT_TOKENS = 16


def concurrent_prompt(index: int) -> list[dict]:
    topics = [
        "the sea",
        "a mountain",
        "bread",
        "the moon",
        "a river",
        "winter",
        "a library",
        "coffee",
        "a bicycle",
        "the desert",
        "a violin",
        "rain",
        "a lighthouse",
        "honey",
        "a forest",
        "glass",
    ]
    return [{"role": "user", "content": f"Write one sentence about {topics[index]}."}]


def reevaluated_step(
    client: openai.OpenAI,
    http: httpx.Client,
    messages: list[dict],
    solo_tokens: list[str],
    step: int,
) -> tuple[str, list[tuple[str, float]]]:
    """The solo run's step `step` evaluated again on its own: the rendered prompt plus the solo
    run's first `step` tokens as one prompt of token ids, one new greedy token. Returns that token
    and the two most likely tokens with their log-probabilities, as `steps[i]` of
    `tests/data/golden/greedy.jsonl` records them for llama.cpp."""
    rendered = http.post(
        "/tokenize", json={"content": chatml(messages), "add_special": True, "parse_special": True}
    )
    assert rendered.status_code == 200, rendered.text
    ids = rendered.json()["tokens"]
    for token in solo_tokens[:step]:
        # Each generated token's text tokenizes back to that one token.
        answer = http.post(
            "/tokenize", json={"content": token, "add_special": False, "parse_special": False}
        )
        assert answer.status_code == 200, answer.text
        token_ids = answer.json()["tokens"]
        assert len(token_ids) == 1, f"expected {token!r} to be one token, found {token_ids}"
        ids.extend(token_ids)
    completion = client.completions.create(
        model=MODEL_ALIAS, prompt=ids, max_tokens=1, temperature=0, logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    top = sorted(logprobs.top_logprobs[0].items(), key=lambda item: -item[1])
    return logprobs.tokens[0], top


def agreement_problem(solo, concurrent: list[str], reevaluate) -> str | None:
    """Greedy tokens of a request served among many (`concurrent`) against the same request served
    alone (`solo`, its logprobs entries), by the rule of `tests/data/golden/README.md` with the solo
    run standing in for llama.cpp: equal up to the first step k where they part, and at k either
    the solo run disagrees with itself (`reevaluate(k)`, the step evaluated again on its own,
    chooses another token than it did), or the concurrent run chose what the re-evaluation chose,
    or the two most likely tokens there are within 2% in probability. Batched arithmetic may round
    differently; only such places may show it. Nothing after k is compared."""
    solo_tokens = [entry.token for entry in solo]
    for step, (alone, among) in enumerate(zip(solo_tokens, concurrent)):
        if alone == among:
            continue
        chosen, top = reevaluate(step)
        first, second = math.exp(top[0][1]), math.exp(top[1][1])
        if chosen != alone or among == chosen or second >= 0.98 * first:
            return None
        return (
            f"step {step}: alone {alone!r}, among others {among!r}; evaluated again alone, the "
            f"step chose {chosen!r} with the top two {top[0][0]!r} (p {first:.4f}) and "
            f"{top[1][0]!r} (p {second:.4f}): no self-disagreement and no near tie"
        )
    if len(solo_tokens) != len(concurrent):
        return (
            f"alone {len(solo_tokens)} tokens, among others {len(concurrent)}, equal as far "
            "as both go"
        )
    return None


def test_sixteen_concurrent_streams_match_their_solo_runs(
    client: openai.OpenAI, http: httpx.Client, server
) -> None:
    request = {
        "temperature": 0,
        "max_tokens": CONCURRENT_TOKENS,
        "logprobs": True,
        "top_logprobs": 2,
    }
    solo = []
    for index in range(CONCURRENT_CLIENTS):
        completion = client.chat.completions.create(
            model=MODEL_ALIAS, messages=concurrent_prompt(index), **request
        )
        solo.append(completion.choices[0])

    async def one_stream(async_client: openai.AsyncOpenAI, index: int):
        stream = await async_client.chat.completions.create(
            model=MODEL_ALIAS, messages=concurrent_prompt(index), stream=True, **request
        )
        text, entries, finish_reason, first_at = [], [], None, None
        async for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            if first_at is None:
                first_at = time.monotonic()
            text.append(choice.delta.content or "")
            if choice.logprobs and choice.logprobs.content:
                entries.extend(choice.logprobs.content)
            finish_reason = choice.finish_reason or finish_reason
        return "".join(text), entries, finish_reason, first_at, time.monotonic()

    async def all_streams():
        async with server.async_openai_client() as async_client:
            return await asyncio.gather(
                *(one_stream(async_client, index) for index in range(CONCURRENT_CLIENTS))
            )

    results = asyncio.run(all_streams())
    problems = []
    for index, (alone, (text, entries, finish_reason, _, _)) in enumerate(zip(solo, results)):
        if finish_reason not in ("stop", "length"):
            problems.append(f"client {index}: expected a finish_reason, found {finish_reason!r}")
            continue
        if text == alone.message.content:
            continue
        if "".join(entry.token for entry in entries) != text:
            problems.append(f"client {index}: its logprobs tokens do not spell its text {text!r}")
            continue
        tokens = [entry.token for entry in entries]
        problem = agreement_problem(
            alone.logprobs.content,
            tokens,
            lambda step, index=index, alone=alone: reevaluated_step(
                client,
                http,
                concurrent_prompt(index),
                [entry.token for entry in alone.logprobs.content],
                step,
            ),
        )
        if problem:
            problems.append(
                f"client {index}: {problem}\n    alone: {alone.message.content!r}\n    among: {text!r}"
            )
    assert not problems, "\n".join(problems)
    # With --parallel 16 every stream is admitted at once: each has its first token before any
    # has finished. Requests served one after another would not overlap at all.
    last_first_token = max(result[3] for result in results)
    first_finish = min(result[4] for result in results)
    assert last_first_token < first_finish, "expected the 16 streams to run at the same time"


# ---------------------------------------------------------------------------------------------
# API keys.

API_KEY = "ember-test-key"


@pytest.fixture(scope="module", params=["--api-key", "EMBER_API_KEY"])
def keyed_server(request):
    if request.param == "--api-key":
        context = running_server(["--alias", MODEL_ALIAS, "--api-key", API_KEY])
    else:
        context = running_server(["--alias", MODEL_ALIAS], environment={"EMBER_API_KEY": API_KEY})
    with context as started:
        yield started


def test_wrong_api_key_is_refused(keyed_server) -> None:
    with pytest.raises(openai.AuthenticationError) as refused:
        keyed_server.openai_client(api_key="not-the-key").models.list()
    assert refused.value.status_code == 401
    error = refused.value.body
    assert isinstance(error, dict) and error.get("message"), error

    completion = keyed_server.openai_client(api_key=API_KEY).completions.create(
        model=MODEL_ALIAS, prompt=COMPLETION_PROMPT, max_tokens=2, temperature=0
    )
    assert completion.usage.completion_tokens == 2

    with httpx.Client(base_url=keyed_server.base_url, timeout=30) as raw:
        missing = raw.post(
            "/v1/completions", json={"model": MODEL_ALIAS, "prompt": "Hi", "max_tokens": 2}
        )
        assert missing.status_code == 401, missing.text
        assert missing.json()["error"]["message"], missing.text
        # Health stays open: container and load-balancer probes carry no key.
        assert raw.get("/health").status_code == 200
