"""`haru run <model>`: a small interactive chat through the gateway, a client of the normal path.

Tokens are printed as they arrive (SSE). `/clear` starts the conversation afresh, `/exit` (or
Ctrl-D) quits, Ctrl-C stops the current answer (which closes the connection, so the gateway cancels
the upstream request). A refusal prints the gateway's own message (why the model cannot answer, and
for how long) and the conversation goes on.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
from urllib.parse import urlsplit

from haru.cli.common import ExitStatus, fail

DEFAULT_URL = "http://127.0.0.1:8700"
HELP = "/clear starts afresh, /exit quits, Ctrl-C stops an answer"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="chat with a model through the gateway (streams tokens; /clear, /exit)",
        description=(
            "An interactive chat with MODEL through the Haru gateway's /v1/chat/completions, streaming "
            "tokens as they arrive. " + HELP + ". The bearer token is HARU_API_TOKEN when set."
        ),
    )
    p.add_argument("model", help="the OpenAI model id, exactly as declared (e.g. qwen3.6:27b)")
    p.add_argument("--url", default=os.environ.get("HARU_GATEWAY_URL", DEFAULT_URL),
                   help="the gateway (env HARU_GATEWAY_URL; default %(default)s)")
    p.add_argument("--fleet", default=os.environ.get("HARU_DEFAULT_FLEET") or None,
                   help="fleet, sent as X-Haru-Fleet (env HARU_DEFAULT_FLEET; default: the gateway's own default)")
    p.add_argument("--system", default="", help="a system prompt for the conversation")
    p.add_argument("--max-tokens", type=int, default=None, help="max_tokens for each answer")
    p.set_defaults(handler=run)


class Refused(Exception):
    """The gateway (or the model behind it) answered with an error."""


class Chat:
    def __init__(self, url: str, model: str, *, fleet: str | None, token: str, max_tokens: int | None) -> None:
        parts = urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url {url!r} is not an http(s) URL")
        self.scheme, self.host, self.port = parts.scheme, parts.hostname, parts.port
        self.base = parts.path.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        self.url = url
        self.model = model
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if fleet:
            self.headers["X-Haru-Fleet"] = fleet
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.max_tokens = max_tokens

    def _connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=None)

    def send(self, messages: list[dict], out) -> str:
        """Stream one answer to `out`; returns its text. Raises Refused or OSError."""
        body: dict = {"model": self.model, "messages": messages, "stream": True}
        if self.max_tokens:
            body["max_tokens"] = self.max_tokens
        conn = self._connection()
        try:
            conn.request("POST", self.base + "/v1/chat/completions", body=json.dumps(body).encode(), headers=self.headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise Refused(describe_error(resp.status, resp.read(), resp.getheader("Retry-After")))
            text: list[str] = []
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    continue
                if isinstance(chunk, dict) and "error" in chunk:
                    raise Refused(describe_error(200, data, None))
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        text.append(piece)
                        out.write(piece)
                        out.flush()
            return "".join(text)
        finally:
            conn.close()


def describe_error(status: int, body: bytes, retry_after: str | None) -> str:
    """The gateway's message, with its code and status: the diagnosis, as the gateway worded it."""
    try:
        err = json.loads(body)["error"]
        message, code = err.get("message") or "", err.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, code = body.decode(errors="replace").strip()[:500], None
    what = f"{message} ({code}, HTTP {status})" if code else f"{message} (HTTP {status})"
    if retry_after:
        what += f"; retry after {retry_after} s"
    return what


def run(args: argparse.Namespace) -> ExitStatus:
    try:
        chat = Chat(args.url, args.model, fleet=args.fleet, token=os.environ.get("HARU_API_TOKEN", ""),
                    max_tokens=args.max_tokens)
    except ValueError as exc:
        return fail(str(exc), ExitStatus.USAGE)
    interactive = sys.stdin.isatty()
    fleet = f", fleet {args.fleet}" if args.fleet else ""
    print(f"haru run: {args.model} through {args.url}{fleet}; {HELP}", file=sys.stderr)
    start: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    status = ExitStatus.OK
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print(file=sys.stderr)
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            break
        if text == "/clear":
            messages = list(start)
            print("(conversation cleared)", file=sys.stderr)
            continue
        if text.startswith("/") and " " not in text:
            print(f"haru run: unknown command {text}; {HELP}", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        try:
            answer = chat.send(messages, sys.stdout)
        except Refused as exc:
            messages.pop()
            status = ExitStatus.ERROR
            print(f"haru: {exc}", file=sys.stderr)
            continue
        except KeyboardInterrupt:
            messages.pop()
            print("\n(interrupted)", file=sys.stderr)
            continue
        except http.client.HTTPException as exc:
            messages.pop()
            status = ExitStatus.ERROR
            print(f"\nharu: the answer broke off: {exc!r}", file=sys.stderr)
            continue
        except OSError as exc:
            messages.pop()
            return fail(f"cannot reach the gateway at {args.url}: {exc.strerror or exc}; is `haru gateway` "
                        f"(or `haru up`) running? pass --url", ExitStatus.UNAVAILABLE)
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": answer})
    return status
