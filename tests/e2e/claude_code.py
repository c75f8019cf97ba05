"""End-to-end: the real Claude Code CLI against ``cairn serve`` (``make test-claude-code``).

Not collected by pytest (no ``test_`` prefix): it needs the CLI, which ships
inside the ``claude-agent-sdk`` wheel (``claude_agent_sdk/_bundled/claude``)
and is installed by the Makefile into its own venv. Run it with the project's
venv, where the server lives::

    .venv/bin/python tests/e2e/claude_code.py --claude-venv .venv-claude-code [--model smollm2]

What it does:
1. writes the model (``--model tiny``, the default: a random-weight 1-layer
   model with SmolLM2's vocabulary and a 128k context, see tiny_long.py; or
   ``smollm2``: the embedded default model served with ``--context-length``);
2. starts ``cairn serve --default-model --clamp-max-tokens`` on a free loopback
   port with a fresh token, and a recording proxy in front of it (recorder.py);
3. runs ``claude -p`` with a temporary HOME and cwd, telemetry off, nothing
   but the proxy reachable (it is also the CLI's HTTPS_PROXY, refusing every
   other host; under ``strace``, where present, every socket the CLI opens is
   checked too), for these cases:
   a. ``claude -p "Say hello"`` with default settings: exit 0, a reply;
   b. ``claude -p ... --continue``: exit 0, and the prefix cache served the
      whole previous turn, answer included (``cache_read_input_tokens`` of
      this turn's main request, cross-checked with /health's
      ``prefix_hit_tokens``);
   c. a wrong token: exit non-zero with Claude Code's authentication error;
   d. the token as ``ANTHROPIC_AUTH_TOKEN`` (Bearer) instead of ``ANTHROPIC_API_KEY``;
   e. thinking shown (``--thinking-display summarized``) and a tool call, then
      ``--continue``, against the scripted test model (tests/scripted_model.py:
      Qwen3's template, which drops earlier turns' thinking, and a tokenizer
      that spends ~3x more tokens), served in this process behind the same
      proxy: the resumed turn reads the previous turn's last request and its
      answer from the cache (the server renders earlier turns as generated);
   net. no connection left loopback;
4. prints every request the CLI sent, one line per case and the wall time;
   exits 1 if a case failed. The server and every CLI process are stopped on
   any exit (Ctrl-C and SIGTERM included).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from recorder import Exchange, Recorder, prompt_tokens, summarize

#: tests/ (the scripted test model and the in-process server helpers).
TESTS = Path(__file__).resolve().parents[1]

#: Claude Code without telemetry, error reports, auto-update or other background traffic.
QUIET_ENV = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
}
#: What Claude Code prints for a rejected credential (its own text, or the server's).
AUTH_ERROR = re.compile(r"Invalid API key|Failed to authenticate|authentication_error|\b401\b")
#: Per model: cairn serve flags, CLAUDE_CODE_MAX_OUTPUT_TOKENS (0: Claude Code's own
#: default, 128000 for its main turn, which --clamp-max-tokens cuts to the context),
#: seconds per CLI run.
#: - tiny: every answer is 21 tokens ended by EOS; a run takes about a second.
#: - smollm2: 12.5k prompt tokens are beyond the 8k it was trained on, so it babbles and
#:   rarely ends by itself. An answer cut at max_tokens makes Claude Code re-send the
#:   conversation with "Output token limit hit. Resume directly" up to 3 times, then fail
#:   ("exceeded the N output token maximum", exit 1); a small cap keeps that short.
#:   Measured on the shared 2-core box: prefill 50 tokens/s cold (4 min for 12.5k),
#:   decode 1-1.5 tokens/s at that length, 8-13 min per request with 512 tokens.
MODELS: dict[str, tuple[list[str], int, int]] = {
    "tiny": ([], 0, 300),
    "smollm2": (["--context-length", "65536"], 64, 3600),
}


@dataclass
class Case:
    name: str
    ok: bool
    detail: str
    seconds: float


@dataclass
class CliRun:
    rc: int
    stdout: str
    stderr: str
    seconds: float


class Harness:
    """The server, the proxy and the CLI runs of one session; :meth:`close` stops them all."""

    def __init__(self, args: argparse.Namespace, root: Path, claude: str) -> None:
        self.args = args
        self.root = root
        self.claude = claude
        self.token = secrets.token_urlsafe(24)
        self.server: subprocess.Popen[bytes] | None = None
        self.recorder: Recorder | None = None
        self.port = 0
        self.strace = shutil.which("strace") if not args.no_strace else None
        #: Connections that did not stay on loopback: "[run] address" (strace and proxy).
        self.outside: list[str] = []
        self._children: list[subprocess.Popen[bytes]] = []

    # ------------------------------------------------------------ server

    def start_server(self) -> None:
        flags, _, _ = MODELS[self.args.model]
        if self.args.model == "tiny":
            from tiny_long import export_tiny_long  # beside this script, like recorder

            start = time.monotonic()
            folder = export_tiny_long(self.root / "tiny-long")
            print(f"model: {folder} written in {time.monotonic() - start:.1f}s", flush=True)
            flags = ["--model", str(folder), *flags]
        self.port = free_port()
        cairn = Path(sys.executable).with_name("cairn")
        cmd = [str(cairn), "serve", *flags, "--default-model", "--clamp-max-tokens"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        log = (self.root / "server.log").open("wb")
        env = {**os.environ, "CAIRN_API_KEY": self.token}
        print("server: " + " ".join(cmd), flush=True)
        self.server = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + 600
        while True:
            if self.server.poll() is not None:
                raise RuntimeError(
                    f"cairn serve exited ({self.server.returncode}):\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"cairn serve was not healthy in 600s:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.2)
        self.recorder = Recorder(self.port)
        self.recorder.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self, url: str | None = None) -> dict[str, Any]:
        """The served model's figures from the authenticated /health (of ``url``)."""
        req = urllib.request.Request(f"{url or self.url}/health", headers={"x-api-key": self.token})
        with urllib.request.urlopen(req, timeout=10) as r:
            return dict(json.load(r)["models"][0]["stats"])

    def log_lines(self) -> list[str]:
        path = self.root / "server.log"
        return path.read_text("utf-8", "replace").splitlines() if path.exists() else []

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_lines()[-lines:])

    def server_notes(self) -> list[str]:
        """Server log lines worth reading: warnings, errors, the reason of each 4xx."""
        keep = re.compile(r"^(WARNING|ERROR|CRITICAL)|^INFO \S+: [45]\d\d |^Claude Code:")
        return [ln for ln in self.log_lines() if keep.search(ln)]

    # ------------------------------------------------------------ CLI

    def cli(self, label: str, argv: list[str], home: str, env_extra: dict[str, str]) -> CliRun:
        """Run ``claude *argv`` with HOME and cwd under ``root/home``; its requests get ``label``."""
        assert self.recorder is not None
        home_dir = self.root / home
        work = home_dir / "work"
        work.mkdir(parents=True, exist_ok=True)
        (home_dir / "tmp").mkdir(exist_ok=True)
        proxy = f"http://127.0.0.1:{self.recorder.port}"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home_dir),
            "TMPDIR": str(home_dir / "tmp"),
            "TERM": "dumb",
            "LANG": "C.UTF-8",
            **QUIET_ENV,
            "ANTHROPIC_BASE_URL": proxy,
            # Anything that would leave the machine goes to the proxy, which refuses it.
            "HTTPS_PROXY": proxy,
            "HTTP_PROXY": proxy,
            "NO_PROXY": "127.0.0.1,localhost",
            **env_extra,
        }
        if self.max_output_tokens:
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(self.max_output_tokens)
        cmd = [self.claude, *argv]
        trace = home_dir / f"strace-{label}.txt"
        if self.strace:
            cmd = [self.strace, "-f", "-qq", "-e", "trace=connect,sendto,sendmsg,sendmmsg"]
            cmd += ["-e", "signal=none", "-o", str(trace), self.claude, *argv]
        self.recorder.label = label
        shown = " ".join(f"{k}=..." for k in env_extra)
        print(f"run {label}: {shown} claude {' '.join(argv)}", flush=True)
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self._children.append(proc)
        try:
            out, err = proc.communicate(timeout=self.timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            kill_group(proc)
            out, err = proc.communicate()
            rc = 124
            err += f"\n[harness: killed after {self.timeout}s]".encode()
        finally:
            kill_group(proc)  # whatever the CLI left behind in its process group
            kill_by_home(home_dir)  # and anything that left the group
        if self.strace:
            self.outside += [f"[{label}] {a}" for a in sockets_outside(trace, self.recorder.port)]
        return CliRun(
            rc,
            out.decode("utf-8", "replace"),
            err.decode("utf-8", "replace"),
            time.monotonic() - start,
        )

    @property
    def max_output_tokens(self) -> int:
        return self.args.max_output_tokens or MODELS[self.args.model][1]

    @property
    def timeout(self) -> int:
        return self.args.timeout or MODELS[self.args.model][2]

    def close(self) -> None:
        for proc in self._children:
            kill_group(proc)
        if self.recorder is not None:
            self.recorder.stop()
        if self.server is not None and self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGTERM)
            try:
                self.server.wait(30)
            except subprocess.TimeoutExpired:
                kill_group(self.server)
                self.server.wait()


def find_claude(args: argparse.Namespace) -> str:
    if args.claude:
        return str(Path(args.claude).resolve())
    venv = Path(args.claude_venv)
    found = sorted(venv.glob("lib/python*/site-packages/claude_agent_sdk/_bundled/claude"))
    if not found:
        raise SystemExit(
            f"no Claude Code CLI under {venv} (pip install claude-agent-sdk there, or pass --claude)"
        )
    return str(found[-1].resolve())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group ``proc`` leads (it was started in a new session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def kill_by_home(home: Path) -> None:
    """Kill processes still running with ``HOME=home`` (a unique temp dir of ours); Linux only."""
    marker = f"HOME={home}\0".encode()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (proc / "environ").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass


_ADDR = re.compile(
    r'htons\((\d+)\), (?:sin_addr=inet_addr\("([^"]+)"\)|.*?inet_pton\(AF_INET6, "([^"]+)")'
)


def sockets_outside(trace: Path, proxy_port: int) -> list[str]:
    """Addresses in an strace log of connect/send calls other than the proxy (DNS included)."""
    if not trace.exists():
        return ["(no strace log)"]
    seen = []
    for line in trace.read_text("utf-8", "replace").splitlines():
        if "AF_INET" not in line:
            continue
        m = _ADDR.search(line)
        if m is None:
            seen.append(line.strip()[:160])
            continue
        port, addr = int(m.group(1)), m.group(2) or m.group(3)
        loopback = addr.startswith("127.") or addr in ("::1", "::ffff:127.0.0.1")
        if not (loopback and port == proxy_port):
            seen.append(f"{addr}:{port}")
    return sorted(set(seen))


# ---------------------------------------------------------------- cases


def main_request(exchanges: list[Exchange]) -> Exchange | None:
    """The agent turn of a run: the /v1/messages request with tools and the largest body."""
    msgs = [e for e in exchanges if e.path.startswith("/v1/messages?") or e.path == "/v1/messages"]
    with_tools = [e for e in msgs if e.body and e.body.get("tools")] or msgs
    return max(with_tools, key=lambda e: e.body_bytes, default=None)


def non_2xx(exchanges: list[Exchange]) -> str:
    """``"; non-2xx: 6x POST /v1/messages 400"`` (query strings left out), or nothing."""
    bad: dict[str, int] = {}
    for e in exchanges:
        if not 200 <= e.status < 300:
            key = f"{e.method} {e.path.split('?')[0]} {e.status}"
            bad[key] = bad.get(key, 0) + 1
    return "; non-2xx: " + ", ".join(f"{n}x {k}" for k, n in bad.items()) if bad else ""


def reply_case(run: CliRun, expect: str | None) -> tuple[bool, str]:
    """Exit 0 and a non-empty reply (the planted one, for the tiny model)."""
    text = run.stdout.strip()
    if run.rc != 0:
        return False, f"exit {run.rc}: {(text or run.stderr.strip())[-300:]!r}"
    if not text:
        return False, f"exit 0 but nothing on stdout (stderr: {run.stderr.strip()[-200:]!r})"
    if expect is not None and expect not in text:
        return False, f"reply {text[:200]!r} is not the model's {expect!r}"
    return True, f"reply {text[:80]!r}"


def run_cases(h: Harness, cases: list[Case]) -> None:
    """Run the CLI cases, appending each result as it comes (so an interruption keeps them)."""
    assert h.recorder is not None
    rec = h.recorder
    expect = None
    if h.args.model == "tiny":
        from tiny_long import REPLY

        expect = REPLY
    key = {"ANTHROPIC_API_KEY": h.token}

    # a. first turn, default settings
    run = h.cli("a", ["-p", "Say hello"], "home-a", key)
    ok, detail = reply_case(run, expect)
    cases.append(Case("a default -p", ok, detail + non_2xx(rec.of("a")), run.seconds))

    # b. second turn: the whole first turn must come from the prefix cache
    before = h.stats()
    run = h.cli("b", ["-p", "Now say goodbye", "--continue"], "home-a", key)
    after = h.stats()
    ok, detail = reply_case(run, expect)
    hit_ok, hit = prefix_check(rec.of("a"), rec.of("b"), before, after)
    cases.append(
        Case("b --continue", ok and hit_ok, f"{detail}; {hit}" + non_2xx(rec.of("b")), run.seconds)
    )

    # c. wrong token. Claude Code retries a 401 up to 10 times with backoff (~3 min)
    # unless the answer carries `x-should-retry: false`, which the server sends: one
    # attempt. CLAUDE_CODE_MAX_RETRIES=2 only bounds the time if that ever regresses.
    wrong = {"ANTHROPIC_API_KEY": "wrong-" + h.token, "CLAUDE_CODE_MAX_RETRIES": "2"}
    run = h.cli("c", ["-p", "Say hello"], "home-c", wrong)
    said = (run.stdout + run.stderr).strip()
    statuses = sorted({e.status for e in rec.of("c")})
    attempts = sum(1 for e in rec.of("c") if e.path.startswith("/v1/messages"))
    ok = run.rc != 0 and bool(AUTH_ERROR.search(said)) and statuses == [401] and attempts == 1
    detail = (
        f"exit {run.rc}, said {said[-160:]!r}; statuses {statuses}; "
        f"{attempts} /v1/messages attempts"
    )
    cases.append(Case("c wrong token", ok, detail, run.seconds))

    # d. the token as a Bearer credential
    run = h.cli("d", ["-p", "Say hello"], "home-d", {"ANTHROPIC_AUTH_TOKEN": h.token})
    ok, detail = reply_case(run, expect)
    schemes = sorted({e.headers.get("authorization", "x-api-key") for e in rec.of("d")})
    bearer = schemes == ["Bearer <redacted>"]
    cases.append(
        Case(
            "d ANTHROPIC_AUTH_TOKEN",
            ok and bearer,
            f"{detail}; credentials sent as {schemes}" + non_2xx(rec.of("d")),
            run.seconds,
        )
    )

    # e. thinking shown and a tool call, then --continue, against the scripted model
    cases.append(thinking_resume_case(h, key))


#: Case e's script: the first turn thinks and runs a command whose output holds
#: the next answer (the scripted model says the last say: directive it reads).
THINK_FLAGS = ["--thinking-display", "summarized", "--allowedTools", "Bash"]


def thinking_resume_case(h: Harness, key: dict[str, str]) -> Case:
    """Case e: the resumed turn reads the previous turn, thinking included, from the cache."""
    assert h.recorder is not None
    sys.path.insert(0, str(TESTS))
    from scripted_model import say

    final = "The command printed what I planned."
    bye = "Goodbye, see you soon!"
    printed = say(f"<think>\nIt worked.\n</think>\n\n{final}")
    args = {"command": f"echo {printed}", "description": "Print the plan"}
    call = json.dumps({"name": "Bash", "arguments": args})
    first = f"<think>\nRun a command first.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
    second = f"<think>\nSay goodbye.\n</think>\n\n{bye}"
    rec = h.recorder
    start = time.monotonic()
    with scripted_server(h.token) as url:
        upstream, rec.upstream = rec.upstream, ("127.0.0.1", int(url.rsplit(":", 1)[1]))
        try:
            run1 = h.cli("e1", ["-p", say(first), *THINK_FLAGS], "home-e", key)
            before = h.stats(url)
            run2 = h.cli("e2", ["-p", say(second), "--continue", *THINK_FLAGS], "home-e", key)
            after = h.stats(url)
        finally:
            rec.upstream = upstream
    ok1, detail1 = reply_case(run1, final)
    ok2, detail2 = reply_case(run2, bye)
    hit_ok, hit = prefix_check(rec.of("e1"), rec.of("e2"), before, after)
    detail = f"{detail1 if not ok1 else detail2}; {hit}" + non_2xx(rec.of("e1") + rec.of("e2"))
    return Case("e thinking, --continue", ok1 and ok2 and hit_ok, detail, time.monotonic() - start)


@contextlib.contextmanager
def scripted_server(token: str) -> Any:
    """The scripted test model served in this process (``--default-model
    --clamp-max-tokens``, the same token); yields its URL."""
    sys.path.insert(0, str(TESTS))
    from live_server import registry_for, serve
    from mlx_cairn.api import ServerConfig
    from mlx_cairn.engine import Engine, EngineConfig
    from scripted_model import scripted_model

    engine = Engine(scripted_model(context_length=131072), EngineConfig(num_blocks=12000))
    config = ServerConfig(api_token=token, clamp_max_tokens=True)
    try:
        with serve(registry_for({"scripted": engine}, default_model=""), config) as srv:
            yield srv.url
    finally:
        engine.close()


def prefix_check(
    first: list[Exchange], second: list[Exchange], before: dict[str, Any], after: dict[str, Any]
) -> tuple[bool, str]:
    """Did turn 2's main request hit the cache for all of turn 1's prompt and answer?

    After turn 1 the KV cache holds its prompt (P1 tokens) and its answer but
    the last sampled token (O1 - 1: the EOS that ended it is never fed back).
    Only full blocks are cached, so the best turn 2 can hit is::

        |<-------- P1 -------->|<- O1-1 ->|
        [blk][blk]...[blk][blk][blk][blk]..     hit >= floor((P1 + O1 - 1) / bs) * bs
    """
    m1, m2 = main_request(first), main_request(second)
    if m1 is None or m2 is None or "usage" not in m1.answer or "usage" not in m2.answer:
        return False, "no answered main request in both turns to compare"
    u1, u2 = m1.answer["usage"], m2.answer["usage"]
    p1, o1 = prompt_tokens(u1), int(u1.get("output_tokens") or 0)
    hit = int(u2.get("cache_read_input_tokens") or 0)
    bs = int(after.get("block_size") or 16)
    bound = (p1 + o1 - 1) // bs * bs
    health = int(after.get("prefix_hit_tokens", 0)) - int(before.get("prefix_hit_tokens", 0))
    detail = (
        f"turn 1: prompt {p1} + answer {o1} tokens; turn 2: prompt {prompt_tokens(u2)}, "
        f"cache_read {hit} (needs >= {bound}, block {bs}); /health prefix_hit_tokens +{health}"
    )
    return hit >= bound and health >= hit, detail


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default=os.environ.get("CC_MODEL", "tiny"))
    p.add_argument("--claude-venv", default=".venv-claude-code")
    p.add_argument("--claude", help="a Claude Code executable (default: the one in --claude-venv)")
    p.add_argument("--max-output-tokens", type=int, help="CLAUDE_CODE_MAX_OUTPUT_TOKENS")
    p.add_argument("--timeout", type=int, help="seconds per CLI run")
    p.add_argument("--no-strace", action="store_true", help="do not trace the CLI's sockets")
    p.add_argument("--save-requests", metavar="FILE", help="write every captured request as JSON")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, HOMEs, model)")
    args = p.parse_args(argv)

    # SIGTERM / SIGHUP unwind like Ctrl-C, so the finally below stops everything.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, f: sys.exit(128 + s))
    wall = time.monotonic()
    claude = find_claude(args)
    root = Path(tempfile.mkdtemp(prefix="cairn-claude-code-"))
    h = Harness(args, root, claude)
    cases: list[Case] = []
    error = ""
    notes: list[str] = []
    tail = ""
    try:
        h.start_server()
        run_cases(h, cases)
    except (Exception, KeyboardInterrupt, SystemExit) as e:  # report what was captured so far
        error = f"{type(e).__name__}: {e}"
    finally:
        h.close()
        notes, tail = h.server_notes(), h.log_tail()
        exchanges = h.recorder.exchanges if h.recorder else []
        if args.save_requests:
            Path(args.save_requests).write_text(
                json.dumps([asdict(e) for e in exchanges], indent=1, default=str)
            )
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    print("\n== requests the CLI sent (via the recording proxy)")
    print(summarize(exchanges) if exchanges else "(none)")
    if notes:
        print("\n== server log: warnings, errors, 4xx reasons")
        print("\n".join(notes))
    if error and tail:
        print("\n== server log (last lines)\n" + tail)
    h.outside += [f"[{e.label}] {e.method} {e.path}" for e in exchanges if e.outside]
    if cases:
        how = "strace and the proxy" if h.strace else "the proxy (no strace here)"
        detail = f"left loopback: {', '.join(h.outside)}" if h.outside else "only the proxy"
        cases.append(Case("net loopback only", not h.outside, f"{detail} (by {how})", 0.0))
    print(f"\n== Claude Code e2e ({args.model} model, CLI {cli_version(h.claude)})")
    for c in cases:
        print(f"{'PASS' if c.ok else 'FAIL'}  {c.name:<22} {c.seconds:6.1f}s  {c.detail}")
    if error:
        print(f"ERROR {error}")
    if args.keep:
        print(f"kept: {root}")
    failed = bool(error) or not cases or not all(c.ok for c in cases)
    print(f"{'FAILED' if failed else 'passed'} in {time.monotonic() - wall:.1f}s")
    return 1 if failed else 0


def cli_version(claude: str) -> str:
    path = Path(claude).with_name("claude.version")
    return path.read_text().split()[0] if path.exists() else "?"


if __name__ == "__main__":
    sys.exit(main())
