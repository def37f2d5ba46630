"""A stand-in for llama.cpp's llama-server, for the runtime contract tests (there is no GGUF here).

    python fake_llama_server.py -m <gguf> --host 127.0.0.1 --port P --alias NAME

Like llama-server, its HTTP listener is up before the model: /health answers 503
{"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}} for FAKE_LOAD_MS,
then 200 {"status": "ok"}. It writes its argv to FAKE_ARGV_FILE when set.
"""

import argparse
import json
import os
import sys
import time

from aiohttp import web


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--alias", required=True)
    args, _rest = p.parse_known_args()
    if os.environ.get("FAKE_ARGV_FILE"):
        with open(os.environ["FAKE_ARGV_FILE"], "w") as f:
            json.dump(sys.argv[1:], f)
    ready_at = time.monotonic() + int(os.environ.get("FAKE_LOAD_MS", "300")) / 1000

    async def health(request):
        if time.monotonic() < ready_at:
            return web.json_response(
                {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}, status=503
            )
        return web.json_response({"status": "ok"})

    async def models(request):
        if time.monotonic() < ready_at:
            return web.json_response({"error": {"code": 503, "message": "Loading model"}}, status=503)
        return web.json_response({"object": "list", "data": [{"id": args.alias, "object": "model"}]})

    async def completions(request):
        if time.monotonic() < ready_at:
            return web.json_response({"error": {"code": 503, "message": "Loading model"}}, status=503)
        body = await request.json()
        if body.get("model") not in (args.alias, None):
            return web.json_response({"error": {"code": 404, "message": "model not found"}}, status=404)
        return web.json_response(
            {
                "object": "text_completion",
                "model": args.alias,
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            }
        )

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=True)


if __name__ == "__main__":
    main()
