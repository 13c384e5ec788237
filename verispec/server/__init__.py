"""OpenAI-compatible server over the batched speculative engine (``verispec serve``).

- ``app.py``        FastAPI app: routes, lifespan, the served pair and its engine (``create_app``)
- ``service.py``    one request served: waiting for events, streaming them, the final body
- ``middleware.py`` the API-key and body-size guard, error handlers, the OpenAPI schema
- ``scheduler.py``  the engine thread: queue, admission, rounds, aborts, failure (``Scheduler``)
- ``prepare.py``    OpenAI request body -> ``BatchRequest`` (tokenizing, chat template, EOS, checks)
- ``schemas.py``    request models, error body, response and chunk builders
- ``text.py``       token ids -> text, with streamed deltas that never need taking back
- ``logprobs.py``   per-token logprobs -> OpenAI's logprobs objects, whole or per chunk
- ``metrics.py``    Prometheus metrics named like vLLM's
- ``cli.py``        the ``serve`` subcommand
- ``ray_serve.py``  ``serve --ray``: one engine per Ray Serve replica

FastAPI, uvicorn and prometheus-client come with the ``server`` extra; nothing here is imported by
the rest of the package.
"""
