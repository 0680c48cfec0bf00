"""One chat completion through the official `openai` client against a running `ember serve`, for
`cargo xtask smoke --image` (which starts the container and passes its mapped address):

    python tests/server/smoke_chat.py HOST PORT

The model is whatever `/v1/models` lists first, so the script works for any model the container
serves. Prints the reply and exits 0 when the answer is a well-formed chat completion; otherwise
prints what was wrong and exits 1.
"""

from __future__ import annotations

import sys

import openai


def main(arguments: list[str]) -> int:
    if len(arguments) != 2 or not arguments[1].isdigit():
        print(f"usage: {sys.argv[0]} HOST PORT", file=sys.stderr)
        return 2
    host, port = arguments
    client = openai.OpenAI(
        base_url=f"http://{host}:{port}/v1",
        api_key="no-key-needed",
        # The smoke test judges the first answer; retries would hide a 5xx.
        max_retries=0,
        timeout=300.0,
    )
    try:
        models = [model.id for model in client.models.list().data]
        if not models:
            print("expected /v1/models to list the served model, found none", file=sys.stderr)
            return 1
        completion = client.chat.completions.create(
            model=models[0],
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=16,
        )
    except openai.APIError as error:
        print(f"chat completion failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    problems = []
    if len(completion.choices) != 1:
        problems.append(f"expected one choice, found {len(completion.choices)}")
    else:
        choice = completion.choices[0]
        if choice.message.role != "assistant" or not choice.message.content:
            problems.append(f"expected an assistant message with text, found {choice.message!r}")
        if choice.finish_reason not in ("stop", "length"):
            problems.append(
                f"expected finish_reason stop or length, found {choice.finish_reason!r}"
            )
    usage = completion.usage
    if usage is None or usage.completion_tokens <= 0 or usage.prompt_tokens <= 0:
        problems.append(f"expected usage with prompt and completion tokens, found {usage!r}")
    if problems:
        print("; ".join(problems), file=sys.stderr)
        return 1
    print(
        f"model {models[0]}: {completion.choices[0].message.content!r} "
        f"({usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens, "
        f"finish_reason {completion.choices[0].finish_reason})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
