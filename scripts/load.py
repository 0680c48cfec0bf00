#!/usr/bin/env python3
"""Load generator for a running OpenAI-compatible server (`ember serve`, or llama-server for
comparison). Not a test: it starts nothing and asserts nothing about speed; it sends concurrent
requests and prints what it measured. Usage and examples: scripts/README.md.

Three modes:

- default: `--clients N` concurrent clients each send `--requests M` requests one after another;
  one line of results.
- `--sweep 1,8,32,64`: the same at each concurrency, one line per level (fresh prompts per level).
- `--soak N`: N mixed requests (prompt lengths drawn log-uniformly from `--soak-prompt-range`,
  `--cancel-fraction` of them dropped mid-stream by closing the connection), with /metrics read
  before and after; exits 1 on any 5xx or KV blocks still in use once the server is idle.

Prompts are lists of token ids sent to `/v1/completions`, so their length is exact: each is drawn at
random (seeded per request) from the ids of a built-in English text tokenized by the server's
`/tokenize`. Every request gets a different prompt, so a prefix cache cannot make the numbers look
better than the workload is.

Figures: throughput is (prompt + generated tokens) per second of wall time of the whole run, as
llama-batched-bench reports it, and generated tokens per second of wall time; TTFT is the time to
the first generated text and TPOT the time per output token after the first,
(end - first token) / (generated - 1), both only with `--stream`; e2e is the whole request.
Percentiles interpolate linearly between samples.

Only Python's standard library (3.9 or newer), so it runs as it is on a machine with no package
index, such as the GPU machine; one thread per client.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import http.client
import json
import math
import queue
import random
import sys
import threading
import time
import urllib.parse

#: Text whose token ids the prompts are drawn from: ordinary prose, so every id is a plain token
#: (no control tokens) that any tokenizer the server uses produces.
VOCABULARY_TEXT = """
The river turned south below the old mill, where the valley widened into fields of barley and
rye. In spring the water ran high and brown with snowmelt; by August it was a clear, slow stream
that children could wade across without wetting their knees. Merchants from the coast came up the
road twice a year with salt, cloth, iron tools, glass beads and news of distant wars. The miller
kept accounts in a leather book: 1,204 sacks ground in 1871, 986 the year after the flood. Numbers,
names and dates filled its pages - Thursday, October, 3.5 pence, 42 barrels, 17 horses.
Scientists measure temperature, pressure, velocity and acceleration; programmers write functions,
loops, classes and tests; cooks combine flour, butter, sugar, eggs, vanilla and a pinch of salt.
Why do clocks tick? How far is the moon? Which language has the most words for snow? Questions
like these fill encyclopedias, newspapers, letters, poems, laws, recipes and software manuals.
"""

#: Prometheus series printed around a soak: vLLM's names and anything about KV blocks or memory.
METRIC_KEYWORDS = ("vllm:", "kv", "block", "memory", "pool", "trim", "prefix")


@dataclasses.dataclass
class Outcome:
    """One request as the client saw it."""

    status: int | str  # HTTP status, or the name of the exception that ended it
    started: float
    ended: float
    first_token: float | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cancelled: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def server_error(self) -> bool:
        return isinstance(self.status, int) and self.status >= 500

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.started

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.generated_tokens < 2 or self.cancelled:
            return None
        return (self.ended - self.first_token) / (self.generated_tokens - 1)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = fraction * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class ServerFailure(Exception):
    """The server answered a setup request (models, tokenize, metrics) wrongly."""


class Server:
    """The server under load. One connection per request (http.client, one thread per client), so
    a dropped stream is a closed connection, as a client that went away looks to the server."""

    def __init__(self, url: str, api_key: str | None, timeout: float):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise SystemExit(f"--url: expected http://HOST:PORT, found {url!r}")
        self.https = parsed.scheme == "https"
        self.host = parsed.hostname
        self.port = parsed.port or (443 if self.https else 80)
        self.prefix = parsed.path.rstrip("/")
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json", "Accept": "*/*"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=self.timeout)

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
        connection = self.connect()
        try:
            payload = None if body is None else json.dumps(body)
            connection.request(method, self.prefix + path, body=payload, headers=self.headers)
            response = connection.getresponse()
            return response.status, response.read().decode("utf-8", "replace")
        finally:
            connection.close()

    def get_json(self, path: str, body: dict | None = None) -> dict:
        status, text = self.call("POST" if body is not None else "GET", path, body)
        if status != 200:
            raise ServerFailure(f"{path}: expected 200, found {status} {text[:300]}")
        return json.loads(text)

    def model(self) -> str:
        models = self.get_json("/v1/models")
        if not models.get("data"):
            raise ServerFailure(f"/v1/models: expected a model, found {models}")
        return models["data"][0]["id"]

    def context_size(self) -> int | None:
        """The per-sequence context from llama-server-style /props, where the server gives it."""
        try:
            props = self.get_json("/props")
        except ServerFailure:
            return None
        settings = props.get("default_generation_settings") or {}
        for value in (settings.get("n_ctx"), props.get("n_ctx")):
            if isinstance(value, int) and value > 0:
                return value
        return None

    def vocabulary_sample(self) -> list[int]:
        tokens = self.get_json("/tokenize", {"content": VOCABULARY_TEXT, "add_special": False})
        ids = sorted(set(tokens["tokens"]))
        if len(ids) < 50:
            raise ServerFailure(f"/tokenize: expected many distinct ids, found {len(ids)}")
        return ids

    def metrics(self) -> str:
        status, text = self.call("GET", "/metrics")
        if status != 200:
            raise ServerFailure(f"/metrics: expected 200, found {status} {text[:300]}")
        return text

    def complete(self, body: dict, stream: bool, cancel_after_chunks: int | None = None) -> Outcome:
        started = time.perf_counter()
        outcome = Outcome(status=0, started=started, ended=started)
        if stream:
            body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        connection = self.connect()
        try:
            connection.request(
                "POST", self.prefix + "/v1/completions", body=json.dumps(body), headers=self.headers
            )
            response = connection.getresponse()
            outcome.status = response.status
            if response.status != 200 or not stream:
                text = response.read()
                outcome.ended = time.perf_counter()
                if response.status == 200:
                    # Not streamed: no time to first token is seen, only the whole answer's.
                    usage = json.loads(text).get("usage") or {}
                    outcome.prompt_tokens = usage.get("prompt_tokens", 0)
                    outcome.generated_tokens = usage.get("completion_tokens", 0)
                return outcome
            text_chunks = 0
            # http.client undoes the chunked transfer coding; server-sent events are lines.
            for raw_line in response:
                line = raw_line.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    outcome.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    outcome.generated_tokens = chunk["usage"].get("completion_tokens", 0)
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    text_chunks += 1
                    if outcome.first_token is None:
                        outcome.first_token = time.perf_counter()
                if cancel_after_chunks is not None and text_chunks >= cancel_after_chunks:
                    # Closing the connection mid-stream (below) is a client that went away,
                    # which the server must notice and cancel.
                    outcome.cancelled = True
                    break
            if not outcome.generated_tokens:
                # No usage chunk (cancelled, or a server without include_usage): count chunks.
                outcome.generated_tokens = text_chunks
                outcome.prompt_tokens = len(body["prompt"])
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as error:
            outcome.status = type(error).__name__
        finally:
            connection.close()
        outcome.ended = time.perf_counter()
        return outcome


def request_body(model: str, prompt: list[int], max_tokens: int, ignore_eos: bool) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if ignore_eos:
        # llama-server's extension (generate exactly max_tokens); a server that does not know the
        # field ignores it, and the generated counts then show where EOS came first.
        body["ignore_eos"] = True
    return body


def random_prompt(sample: list[int], length: int, seed: int) -> list[int]:
    generator = random.Random(seed)
    return [generator.choice(sample) for _ in range(length)]


def run_level(
    server: Server, args, model: str, sample: list[int], clients: int, seed: int
) -> tuple[list[Outcome], float]:
    """`clients` threads, each sending `args.requests` requests one after another."""

    def client(index: int) -> list[Outcome]:
        outcomes = []
        for number in range(args.requests):
            prompt = random_prompt(
                sample, args.prompt_tokens, seed + index * args.requests + number
            )
            body = request_body(model, prompt, args.max_tokens, args.ignore_eos)
            outcomes.append(server.complete(body, args.stream))
        return outcomes

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=clients) as pool:
        per_client = list(pool.map(client, range(clients)))
    wall = time.perf_counter() - started
    return [outcome for outcomes in per_client for outcome in outcomes], wall


HEADER = (
    f"{'clients':>7} {'reqs':>5} {'ok':>5} {'wall s':>7} {'prompt':>7} {'gen':>6} "
    f"{'total t/s':>9} {'gen t/s':>8}  {'ttft ms p50/p90/p99':>19}  {'tpot ms p50/p90/p99':>19}  "
    f"{'e2e ms p50/p90/p99':>19}  errors"
)


def triple(values: list[float]) -> str:
    """p50/p90/p99, or `-` where nothing was measured (TTFT and TPOT need --stream)."""
    if not values:
        return "-"
    points = [percentile(values, q) for q in (0.5, 0.9, 0.99)]
    return "/".join(f"{point:.0f}" if point >= 10 else f"{point:.1f}" for point in points)


def summary_line(clients: int, outcomes: list[Outcome], wall: float) -> str:
    ok = [outcome for outcome in outcomes if outcome.ok]
    prompt = sum(outcome.prompt_tokens for outcome in ok)
    generated = sum(outcome.generated_tokens for outcome in ok)
    ttft = [outcome.ttft * 1000 for outcome in ok if outcome.ttft is not None]
    tpot = [outcome.tpot * 1000 for outcome in ok if outcome.tpot is not None]
    e2e = [(outcome.ended - outcome.started) * 1000 for outcome in ok if not outcome.cancelled]
    errors = collections.Counter(str(outcome.status) for outcome in outcomes if not outcome.ok)
    error_text = (
        ", ".join(f"{status}: {count}" for status, count in sorted(errors.items())) or "none"
    )
    return (
        f"{clients:>7} {len(outcomes):>5} {len(ok):>5} {wall:>7.2f} {prompt:>7} {generated:>6} "
        f"{(prompt + generated) / wall:>9.1f} {generated / wall:>8.1f}  {triple(ttft):>19}  "
        f"{triple(tpot):>19}  {triple(e2e):>19}  {error_text}"
    )


def interesting_metrics(text: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if line
        and not line.startswith("#")
        and any(word in line.split(" ")[0].lower() for word in METRIC_KEYWORDS)
    ]


def metric_value(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            try:
                return float(line.rsplit(" ", 1)[1])
            except ValueError:
                return None
    return None


def soak(server: Server, args, model: str, sample: list[int]) -> int:
    low, high = args.soak_prompt_range
    context = server.context_size()
    if context is not None and high + args.max_tokens > context:
        high = max(low, context - args.max_tokens)
        print(f"soak: prompts up to {high} tokens (the server's context is {context})")
    before = server.metrics()
    print("soak: /metrics before:")
    for line in interesting_metrics(before):
        print(f"  {line}")

    generator = random.Random(args.seed)
    plans: queue.Queue = queue.Queue()
    for index in range(args.soak):
        length = round(math.exp(generator.uniform(math.log(low), math.log(high))))
        max_tokens = generator.randint(min(16, args.max_tokens), args.max_tokens)
        cancel = generator.random() < args.cancel_fraction
        cancel_after = generator.randint(1, max(1, max_tokens // 2)) if cancel else None
        plans.put((index, length, max_tokens, cancel_after))
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    started = time.perf_counter()

    def worker() -> None:
        while True:
            try:
                index, length, max_tokens, cancel_after = plans.get_nowait()
            except queue.Empty:
                return
            prompt = random_prompt(sample, length, args.seed * 1_000_003 + index)
            body = request_body(model, prompt, max_tokens, args.ignore_eos)
            outcome = server.complete(body, stream=True, cancel_after_chunks=cancel_after)
            with lock:
                outcomes.append(outcome)
                done = len(outcomes)
                if done % 100 == 0 or done == args.soak:
                    failures = sum(1 for o in outcomes if o.server_error)
                    elapsed = time.perf_counter() - started
                    print(
                        f"soak: {done}/{args.soak} done in {elapsed:.0f} s, {failures} 5xx",
                        flush=True,
                    )

    workers = [threading.Thread(target=worker) for _ in range(args.clients)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    wall = time.perf_counter() - started

    print(HEADER)
    print(summary_line(args.clients, outcomes, wall))
    cancelled = sum(1 for outcome in outcomes if outcome.cancelled)
    server_errors = sum(1 for outcome in outcomes if outcome.server_error)
    transport_errors = sum(1 for outcome in outcomes if isinstance(outcome.status, str))
    print(
        f"soak: {len(outcomes)} requests, {cancelled} cancelled mid-stream, "
        f"{server_errors} 5xx, {transport_errors} transport errors"
    )

    # Idle: nothing running or waiting, then the 2 s in which memory must go back.
    deadline = time.perf_counter() + 30
    while True:
        after = server.metrics()
        running = metric_value(after, "vllm:num_requests_running")
        waiting = metric_value(after, "vllm:num_requests_waiting")
        if (running == 0 and waiting == 0) or time.perf_counter() > deadline:
            break
        time.sleep(0.2)
    time.sleep(2)
    after = server.metrics()
    print("soak: /metrics after (idle for 2 s):")
    for line in interesting_metrics(after):
        print(f"  {line}")
    usage = metric_value(after, "vllm:gpu_cache_usage_perc")
    # ember also counts blocks by state (`ember_kv_blocks{state="used"}`); show such lines too.
    used_blocks = [
        line
        for line in interesting_metrics(after)
        if "block" in line.split("{")[0] and 'state="used"' in line
    ]
    print(
        f"soak: KV blocks in use after: vllm:gpu_cache_usage_perc {usage}"
        + "".join(f"; {line}" for line in used_blocks)
    )

    problems = []
    if server_errors:
        problems.append(f"{server_errors} requests got a 5xx")
    if transport_errors:
        problems.append(f"{transport_errors} requests broke off without an answer")
    if usage is None:
        problems.append("no vllm:gpu_cache_usage_perc in /metrics")
    elif usage != 0:
        problems.append(f"KV blocks still in use once idle (vllm:gpu_cache_usage_perc {usage})")
    if problems:
        print("soak: FAILED: " + "; ".join(problems))
        return 1
    print("soak: ok: no 5xx, no KV block in use once idle")
    return 0


def concurrency_list(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated client counts, found {text!r}"
        ) from None
    if not levels or any(level < 1 for level in levels):
        raise argparse.ArgumentTypeError(f"expected client counts of 1 or more, found {text!r}")
    return levels


def token_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected LOW,HIGH token counts, found {text!r}"
        ) from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, found {text!r}")
    return low, high


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number, found {text}")
    return value


def parse_arguments(argv: list[str]):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url", default="http://127.0.0.1:8080", help="the server's base URL (default %(default)s)"
    )
    parser.add_argument("--api-key", help="sent as `Authorization: Bearer KEY`")
    parser.add_argument("--model", help="the model name to send (default: the first of /v1/models)")
    parser.add_argument(
        "--clients", type=positive, default=1, help="concurrent clients (default %(default)s)"
    )
    parser.add_argument(
        "--requests",
        type=positive,
        default=1,
        help="requests per client, one after another (default %(default)s)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=positive,
        default=512,
        help="prompt length in tokens (default %(default)s)",
    )
    parser.add_argument(
        "--max-tokens",
        type=positive,
        default=128,
        help="tokens to generate per request (default %(default)s)",
    )
    parser.add_argument(
        "--stream", action="store_true", help="stream the answers (needed for TTFT and TPOT)"
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask the server to generate exactly --max-tokens (llama-server's ignore_eos)",
    )
    parser.add_argument(
        "--sweep",
        type=concurrency_list,
        metavar="N,N,...",
        help="run once per client count, e.g. 1,8,32,64",
    )
    parser.add_argument(
        "--soak",
        type=positive,
        metavar="N",
        help="N mixed requests with cancellations; /metrics before and after",
    )
    parser.add_argument(
        "--soak-prompt-range",
        type=token_range,
        default=(16, 8000),
        metavar="LOW,HIGH",
        help="soak prompt lengths (default 16,8000)",
    )
    parser.add_argument(
        "--cancel-fraction",
        type=float,
        default=0.1,
        help="soak requests dropped mid-stream (default %(default)s)",
    )
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the warm-up request (a prompt of --prompt-tokens, 4 generated) sent first",
    )
    parser.add_argument(
        "--seed", type=int, default=1, help="seed of the prompts (default %(default)s)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds one request may take (default %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.sweep and args.soak:
        parser.error("--sweep and --soak are separate modes; give one")
    if not 0 <= args.cancel_fraction <= 1:
        parser.error(f"--cancel-fraction: expected 0 to 1, found {args.cancel_fraction}")
    return args


def main(argv: list[str]) -> int:
    args = parse_arguments(argv)
    levels = args.sweep or [args.clients]
    server = Server(args.url, args.api_key, args.timeout)
    try:
        model = args.model or server.model()
        sample = server.vocabulary_sample()
    except (OSError, http.client.HTTPException, ServerFailure) as error:
        print(f"load: cannot use the server at {args.url}: {error}", file=sys.stderr)
        return 1
    print(f"load: {args.url}, model {model}, prompts drawn from {len(sample)} token ids")
    if not args.no_warmup:
        # A prompt as long as the measured ones (from a seed no measured prompt uses), so that
        # first-use costs of that shape (buffers, kernels) fall outside the figures, as
        # llama-batched-bench's own warm-up batch does for it.
        warmup_prompt = random_prompt(sample, max(16, args.prompt_tokens), -1)
        warmup = server.complete(request_body(model, warmup_prompt, 4, False), stream=False)
        if not warmup.ok:
            print(f"load: the warm-up request got {warmup.status}", file=sys.stderr)
            return 1
    if args.soak:
        return soak(server, args, model, sample)
    print(
        f"load: prompts of {args.prompt_tokens} tokens, {args.max_tokens} generated, "
        f"{args.requests} request(s) per client, "
        f"{'streaming' if args.stream else 'not streaming'}"
    )
    print(HEADER)
    failed = False
    for number, clients in enumerate(levels):
        level_seed = args.seed * 1_000_003 + number * 100_000
        outcomes, wall = run_level(server, args, model, sample, clients, level_seed)
        print(summary_line(clients, outcomes, wall), flush=True)
        failed = failed or any(not outcome.ok for outcome in outcomes)
        short = sum(
            1 for outcome in outcomes if outcome.ok and outcome.generated_tokens < args.max_tokens
        )
        if short:
            print(
                f"        note: {short} request(s) stopped before {args.max_tokens} tokens "
                "(EOS; --ignore-eos asks the server not to stop there)"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
