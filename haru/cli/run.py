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
    p.add_argument(
        "--url",
        default=os.environ.get("HARU_GATEWAY_URL", DEFAULT_URL),
        help="the gateway (env HARU_GATEWAY_URL; default %(default)s)",
    )
    p.add_argument(
        "--fleet",
        default=os.environ.get("HARU_DEFAULT_FLEET") or None,
        help="fleet, sent as X-Haru-Fleet (env HARU_DEFAULT_FLEET; default: the gateway's own default)",
    )
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

    def check(self) -> tuple[ExitStatus, str]:
        """Before the REPL opens: is the model one the gateway knows? (OK, its answer) or (status, why not).
        Raises OSError when the gateway cannot be reached."""
        conn = self._connection()
        try:
            headers = {k: v for k, v in self.headers.items() if k != "Accept"}
            conn.request("GET", self.base + "/v1/models", headers=headers)
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            status = ExitStatus.NOT_FOUND if resp.status == 404 else ExitStatus.ERROR
            return status, describe_error(resp.status, body, None)
        try:
            data = json.loads(body)["data"]
            known = {m["id"]: m for m in data}
        except (ValueError, KeyError, TypeError) as exc:
            return ExitStatus.ERROR, f"{self.url}/v1/models is not a model list ({exc}); is --url a Haru gateway?"
        if self.model not in known:
            listed = ", ".join(sorted(known)) or "none"
            return ExitStatus.NOT_FOUND, (
                f"no model {self.model!r} behind {self.url} (model ids match exactly); it serves: {listed}"
            )
        answer = (known[self.model].get("haru") or {}).get("answer")
        said = answer.get("answer") if isinstance(answer, dict) else answer
        return ExitStatus.OK, said if isinstance(said, str) else ""

    def send(self, messages: list[dict], out) -> str:
        """Stream one answer to `out`; returns its text. Raises Refused or OSError."""
        body: dict = {"model": self.model, "messages": messages, "stream": True}
        if self.max_tokens:
            body["max_tokens"] = self.max_tokens
        conn = self._connection()
        try:
            conn.request(
                "POST", self.base + "/v1/chat/completions", body=json.dumps(body).encode(), headers=self.headers
            )
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
        chat = Chat(
            args.url,
            args.model,
            fleet=args.fleet,
            token=os.environ.get("HARU_API_TOKEN", ""),
            max_tokens=args.max_tokens,
        )
    except ValueError as exc:
        return fail(str(exc), ExitStatus.USAGE)
    interactive = sys.stdin.isatty()
    fleet = f", fleet {args.fleet}" if args.fleet else ""
    try:
        checked, said = chat.check()  # an unknown model is said now, not after the first message
    except (OSError, http.client.HTTPException) as exc:
        return fail(
            f"cannot reach the gateway at {args.url}: {getattr(exc, 'strerror', None) or exc}; is `haru "
            f"gateway` (or `haru up`, `haru serve`) running? pass --url",
            ExitStatus.UNAVAILABLE,
        )
    if checked != ExitStatus.OK:
        return fail(said, checked)
    state = f" ({said})" if said and said != "ready" else ""
    print(f"haru run: {args.model}{state} through {args.url}{fleet}; {HELP}", file=sys.stderr)
    start: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    status = ExitStatus.OK
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            if interactive:  # Ctrl-D: the shell's prompt starts on a line of its own (input() without
                sys.stderr.write("\n")  # readline writes its prompt to stderr: end that line)
                sys.stderr.flush()
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
            return fail(
                f"cannot reach the gateway at {args.url}: {exc.strerror or exc}; is `haru gateway` "
                f"(or `haru up`) running? pass --url",
                ExitStatus.UNAVAILABLE,
            )
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": answer})
    return status
