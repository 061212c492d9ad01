"""Sampling from any OpenAI-compatible completions endpoint (SGLang, vLLM, Ray Serve).

Uses `POST {base_url}/v1/completions` (the base URL may end in `/v1` or not) with the prompt as
token ids, the ones the trainer's engines get: the server does not tokenize the text again (a
second tokenization can differ from the first, and then so would the prompt's length).

Response lengths are tokens. OpenAI-style servers report `usage` once per request, summed over
its `n` choices, so with one choice that is the response's count; with several, each text is
counted with the tokenizer. Either way the count includes the stop token when the response
stopped on one (the server trims it from the text but generated it), as the trainer's engines
count `output_ids`.

Failures: a 4xx answer is the request's own fault and is not retried; 5xx answers, connection
errors and malformed replies are retried. Every error line carries the server's message, the URL
and the problem.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx

from megatron_dapo.eval.runner import Completion, EvalProblem
from megatron_dapo.http_errors import http_error


class EndpointError(RuntimeError):
    pass


class EndpointUnreachable(EndpointError):
    """The URL is malformed or nothing answers there: bad input, before any sampling."""


def completions_url(base_url: str) -> str:
    """`{base}/v1/completions` for a base URL given with or without `/v1` (and trailing slashes)."""
    base = base_url.strip().rstrip("/")
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise EndpointUnreachable(
            f"--url {base_url!r} is not an http(s) URL; give the server's base URL, e.g. http://host:30000"
        )
    if base.endswith("/completions"):
        base = base[: -len("/completions")]
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return base + "/v1/completions"


def models_url(base_url: str) -> str:
    return completions_url(base_url).removesuffix("/completions") + "/models"


def check_reachable(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> list[dict]:
    """Fail with one line when nothing answers at the endpoint (any HTTP answer will do).

    Returns the model cards of `GET /v1/models` (empty when the server has no such route)."""
    url = models_url(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise EndpointUnreachable(
            f"--url {base_url}: no OpenAI-compatible server answers at {url} ({type(e).__name__}: {e}); "
            "start the server or fix the host/port"
        ) from None
    try:
        cards = r.json().get("data") if r.status_code == 200 else None
    except (ValueError, AttributeError):
        cards = None
    return [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []


def served_context_length(cards: list[dict], model: str) -> int | None:
    """The served model's context (`max_model_len`, which SGLang and vLLM report), or None.

    The card named `model` when there is one, else the first that reports a length (SGLang
    serves one base model and answers any model name)."""
    named = [c for c in cards if c.get("id") == model] or cards
    for card in named:
        value = card.get("max_model_len")
        if isinstance(value, int) and value > 0:
            return value
    return None


def response_tokens(
    choice: dict, n_choices: int, usage: dict | None, count_text: Callable[[str], int]
) -> int:
    """Tokens of one completion choice (see the module docstring)."""
    if n_choices == 1 and isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return usage["completion_tokens"]
    stopped = choice.get("finish_reason") == "stop"
    return count_text(choice.get("text") or "") + int(stopped)


def post_with_retries(
    client: httpx.Client,
    url: str,
    payload: dict,
    *,
    headers: dict,
    what: str,
    timeout_s: float,
    max_retries: int,
    backoff_s: float,
) -> dict:
    """POST ``payload``; the reply's JSON, which has ``choices`` (see the module docstring for
    what is retried)."""
    last = ""
    for attempt in range(max_retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            r = client.post(url, json=payload, headers=headers, timeout=timeout_s)
        except httpx.TransportError as e:
            last = f"{type(e).__name__}: {e} (POST {url}, {what})"
            continue
        if 400 <= r.status_code < 500:
            raise EndpointError(f"{http_error(r, what)}; not retried: the server refused the request")
        if r.status_code >= 500:
            last = http_error(r, what)
            continue
        try:
            reply = r.json()
            if isinstance(reply.get("choices"), list):
                return reply
            last = f"a reply without choices: {r.text[:200]!r} (POST {url}, {what})"
        except (ValueError, AttributeError):
            last = f"a reply that is not JSON: {r.text[:200]!r} (POST {url}, {what})"
    raise EndpointError(f"{what} failed after {max_retries + 1} tries; last: {last}")


def make_endpoint_generator(
    base_url: str,
    *,
    model: str,
    temperature: float,
    top_p: float,
    max_tokens: int,
    count_text: Callable[[str], int],
    api_key: str | None = None,
    timeout_s: float = 600.0,
    concurrency: int = 16,
    max_retries: int = 2,
    backoff_s: float = 0.5,
):
    """A `Generator` for `evaluate` backed by an HTTP endpoint (k samples per request via `n`).

    `count_text(text)` is the tokenizer's token count of a response text."""
    url = completions_url(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def post(client: httpx.Client, prob: EvalProblem, payload: dict) -> dict:
        return post_with_retries(
            client,
            url,
            payload,
            headers=headers,
            what=f"problem {prob.problem_id}",
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
        )

    def one(client: httpx.Client, prob: EvalProblem, k: int) -> list[Completion]:
        payload = {
            "model": model,
            "prompt": list(prob.prompt_ids),
            "n": k,
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": max_tokens,
        }
        reply = post(client, prob, payload)
        choices = reply["choices"]
        if len(choices) != k:
            raise EndpointError(
                f"asked for n={k} completions, got {len(choices)} (POST {url}, problem {prob.problem_id})"
            )
        usage = reply.get("usage")
        return [
            Completion(
                c.get("text") or "",
                response_tokens(c, k, usage, count_text),
                c.get("finish_reason") == "length",
            )
            for c in sorted(choices, key=lambda c: c.get("index", 0))
        ]

    def generate(problems: Sequence[EvalProblem], k: int) -> list[list[Completion]]:
        with httpx.Client() as client:
            pool = ThreadPoolExecutor(concurrency)
            try:
                futures = [pool.submit(one, client, p, k) for p in problems]
                return [f.result() for f in futures]
            finally:
                # after a failure, the problems not yet sent are not sent
                pool.shutdown(wait=True, cancel_futures=True)

    return generate
