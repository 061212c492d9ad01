"""Sampling from any OpenAI-compatible completions endpoint (SGLang, vLLM, Ray Serve).

Uses `POST {base_url}/v1/completions` (the base URL may end in `/v1` or not) with the already-templated prompt text, so the prompt the
model sees is byte-identical to what the trainer's engines would see.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

from megatron_dapo.eval.runner import Completion, EvalProblem


class EndpointError(RuntimeError):
    pass


class EndpointUnreachable(EndpointError):
    """The URL is malformed or nothing answers there: bad input, before any sampling."""


def completions_url(base_url: str) -> str:
    """`{base}/v1/completions` for a base URL given with or without `/v1` (and trailing slashes)."""
    from urllib.parse import urlsplit

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


def check_reachable(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> None:
    """Fail with one line when nothing answers at the endpoint (any HTTP answer will do)."""
    url = completions_url(base_url).removesuffix("/completions") + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        httpx.get(url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise EndpointUnreachable(
            f"--url {base_url}: no OpenAI-compatible server answers at {url} ({type(e).__name__}: {e}); "
            "start the server or fix the host/port"
        ) from None


def make_endpoint_generator(
    base_url: str,
    *,
    model: str,
    temperature: float,
    top_p: float,
    max_tokens: int,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    concurrency: int = 16,
    max_retries: int = 2,
):
    """A `Generator` for `evaluate` backed by an HTTP endpoint (k samples per request via `n`)."""
    url = completions_url(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def one(client: httpx.Client, prob: EvalProblem, k: int) -> list[Completion]:
        payload = {
            "model": model,
            "prompt": prob.prompt_text,
            "n": k,
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": max_tokens,
        }
        last: Exception | None = None
        for _ in range(max_retries + 1):
            try:
                resp = client.post(url, json=payload, headers=headers, timeout=timeout_s)
                resp.raise_for_status()
                choices = resp.json()["choices"]
                break
            except (httpx.HTTPError, KeyError, ValueError) as e:
                last = e
        else:
            raise EndpointError(
                f"{url}: problem {prob.problem_id} failed after {max_retries + 1} tries: {last}"
            )
        if len(choices) != k:
            raise EndpointError(f"{url}: asked for n={k} completions, got {len(choices)}")
        out = []
        for c in sorted(choices, key=lambda c: c.get("index", 0)):
            usage_tokens = c.get("completion_tokens") or len(c.get("text", "").split())
            out.append(Completion(c.get("text", ""), int(usage_tokens), c.get("finish_reason") == "length"))
        return out

    def generate(problems: Sequence[EvalProblem], k: int) -> list[list[Completion]]:
        with httpx.Client() as client, ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda p: one(client, p, k), problems))

    return generate
