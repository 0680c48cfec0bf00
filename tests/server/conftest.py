"""Fixtures for the server tests: one shared `ember serve` (see ember_server.py) and clients for it:
the official `openai` client, and httpx for what the client would hide."""

from __future__ import annotations

from typing import Iterator

import httpx
import openai
import pytest

from ember_server import MODEL_ALIAS, EmberServer, running_server


@pytest.fixture(scope="session")
def server() -> Iterator[EmberServer]:
    # 16 running sequences, so the concurrency test runs all its clients at once.
    with running_server(["--alias", MODEL_ALIAS, "--parallel", "16"]) as started:
        yield started


@pytest.fixture(scope="session")
def client(server: EmberServer) -> openai.OpenAI:
    return server.openai_client()


@pytest.fixture(scope="session")
def http(server: EmberServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60.0) as raw:
        yield raw
