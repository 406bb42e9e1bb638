"""Serving over HTTP: engines on remote hosts, and an OpenAI-compatible door for
black-box harnesses.

  * `engine_server` serves any `Engine` over HTTP (`python -m gyrejax.serve.engine_server`
    or `EngineServer(engine, token=...).start(host, port)`); `http_engine.HttpEngine` is
    the `Engine` that reaches it by URL, so the proxy routes, drains and retries remote
    engines exactly like local ones.
  * `openai_server` serves `/v1/completions` and `/v1/chat/completions` in front of a
    `Proxy`, one key per execution (an admin key creates them), recording every call
    token-in/token-out as the in-process harness does; `chat` holds the chat templates
    (byte layout, HF) and `generated` the cache that maps re-serialised assistant turns
    back to the policy's exact tokens.
  * `wire` (JSON codecs, field-named validation) and `http` (aiohttp plumbing: auth
    before the body, body/header/connection limits, strict JSON) are shared.

aiohttp is the only HTTP dependency (server and client, both asyncio-native, like the
`Engine` interface); nothing here imports JAX unless a JAX engine is built.
"""
