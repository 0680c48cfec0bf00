"""Helpers of the server tests: a real `ember serve` process on the pinned SmolLM2 model (started,
awaited until ready, stopped with SIGTERM and expected to exit 0), and `ember run` for the reference
output of the same model.

The binary is `$EMBER_BIN`, else `target/release/ember` of this checkout; the model is
`$EMBER_TEST_MODEL`, else the pinned name `smollm2-135m-instruct-q4_1`, which `ember` resolves
through its model cache (`cargo xtask test` fetches it first). Every server runs on the CPU with two
threads and port 0, so tests never collide with anything else listening on the machine; the port is
read from the `listening on http://HOST:PORT` line that `ember serve` prints on stderr.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import threading
import time
from typing import Iterator

import openai

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

#: The name the shared server answers to (`--alias`): what `/v1/models` lists and requests send.
MODEL_ALIAS = "smollm2-test"

#: How long a server may take from start to `ready`. Loading the 135M model takes about a second;
#: the margin is for a loaded CI machine, not for a slow server.
STARTUP_TIMEOUT_SECONDS = 120.0

#: How long a server may take to drain and exit after SIGTERM (its default --drain-timeout is 30 s).
SHUTDOWN_TIMEOUT_SECONDS = 45.0

LISTENING_LINE = re.compile(r"listening on (http://\S+)")


def ember_binary() -> pathlib.Path:
    path = pathlib.Path(os.environ.get("EMBER_BIN") or REPO_ROOT / "target" / "release" / "ember")
    if not path.is_file():
        raise RuntimeError(
            f"expected the ember binary at {path} (set EMBER_BIN, or build it with "
            "`cargo build --release -p ember`), found none"
        )
    return path


def model_under_test() -> str:
    return os.environ.get("EMBER_TEST_MODEL", "smollm2-135m-instruct-q4_1")


def server_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child `ember`: this one without an inherited API key (a key set in
    the developer's shell would turn every request of the keyless server into a 401)."""
    environment = {key: value for key, value in os.environ.items() if key != "EMBER_API_KEY"}
    environment.update(extra or {})
    return environment


class EmberServer:
    """One `ember serve` child process: started, awaited until ready, stopped with SIGTERM."""

    def __init__(self, args: list[str], environment: dict[str, str] | None = None):
        self.command = [
            str(ember_binary()),
            "serve",
            "-m",
            model_under_test(),
            "--device",
            "cpu",
            "-t",
            "2",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            *args,
        ]
        self.base_url: str | None = None
        self.output: collections.deque[str] = collections.deque(maxlen=200)
        self._listening = threading.Event()
        self._ready = threading.Event()
        self.process = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=server_environment(environment),
            text=True,
            errors="replace",
            bufsize=1,
        )
        # Both pipes are drained for the whole life of the process: a full pipe would block the
        # server's logging, and the last lines are what a failure message needs.
        self._readers = [
            threading.Thread(target=self._read, args=(self.process.stderr, True), daemon=True),
            threading.Thread(target=self._read, args=(self.process.stdout, False), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, is_stderr: bool) -> None:
        for line in stream:
            line = line.rstrip("\n")
            self.output.append(line)
            if not is_stderr:
                continue
            match = LISTENING_LINE.search(line)
            if match and not self._listening.is_set():
                self.base_url = match.group(1).rstrip("/")
                self._listening.set()
            elif line.strip().startswith("ready"):
                self._ready.set()

    def output_tail(self, lines: int = 30) -> str:
        tail = list(self.output)[-lines:]
        return "\n".join(tail) if tail else "(no output)"

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.is_set():
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"`{' '.join(self.command)}` exited with status {self.process.returncode} "
                    f"before it was ready; its output ends with:\n{self.output_tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"`{' '.join(self.command)}` printed no `ready` within {timeout:.0f} s "
                    f"(listening: {self.base_url}); its output ends with:\n{self.output_tail()}"
                )
            time.sleep(0.05)
        if self.base_url is None:
            raise RuntimeError(
                "the server printed `ready` without a `listening on http://HOST:PORT` line "
                f"before it; its output ends with:\n{self.output_tail()}"
            )

    def stop(self) -> int:
        """SIGTERM, then the exit status once it has drained."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=SHUTDOWN_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(
                f"the server did not exit within {SHUTDOWN_TIMEOUT_SECONDS:.0f} s of SIGTERM; "
                f"its output ends with:\n{self.output_tail()}"
            ) from None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def openai_client(self, api_key: str = "no-key-needed") -> openai.OpenAI:
        # No retries: the client retries 429 and 5xx by default, which would hide exactly the
        # answers these tests are about.
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=120.0
        )

    def async_openai_client(self, api_key: str = "no-key-needed") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=120.0
        )


@contextlib.contextmanager
def running_server(
    args: list[str], environment: dict[str, str] | None = None
) -> Iterator[EmberServer]:
    """A ready server for the body of the `with`; afterwards it must drain and exit 0."""
    server = EmberServer(args, environment)
    try:
        server.wait_ready()
        yield server
    except BaseException:
        server.kill()
        raise
    status = server.stop()
    assert status == 0, (
        f"expected `ember serve` to exit 0 after SIGTERM, found {status}; "
        f"its output ends with:\n{server.output_tail()}"
    )


def ember_run(prompt: str, n_predict: int, chat: bool) -> dict:
    """`ember run --temp 0` on the test model, as the JSON object of `--format json`."""
    command = [
        str(ember_binary()),
        "run",
        "-m",
        model_under_test(),
        "--temp",
        "0",
        "-n",
        str(n_predict),
        "-p",
        prompt,
        "--device",
        "cpu",
        "-t",
        "2",
        "--format",
        "json",
    ]
    if chat:
        command.append("--chat")
    finished = subprocess.run(
        command,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=server_environment(),
        timeout=300,
    )
    if finished.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(command)}` exited with status {finished.returncode}:\n{finished.stderr}"
        )
    return json.loads(finished.stdout)
