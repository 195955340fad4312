"""Harbor installed-agent adapter for aic, the ralph-loop shell agent.

Use it with Harbor's custom-agent import path, for example::

    harbor run -d terminal-bench@2.0 -m openai/gpt-4.1 \\
        --agent aic_agent:AicAgent --ak agent_timeout_sec=900

(``--agent-import-path aic_agent:AicAgent`` on older Harbor releases), with this
directory on ``PYTHONPATH``. See README.md next to this file.

What it does, in the shape of Harbor's ``BaseInstalledAgent`` subclasses
(mini-swe-agent, codex, claude-code, opencode):

* ``install``: puts one ``aic`` executable at ``/usr/local/bin/aic`` inside the
  task environment: uploaded from the host (``binary_path`` / ``$AIC_BINARY_PATH``),
  downloaded (``install_url`` / ``$AIC_INSTALL_URL``, a raw binary or a .tar.gz
  holding one), or installed with npm (``npm_package`` / ``$AIC_NPM_PACKAGE``,
  default ``aic``, at ``version`` when given).
* ``run``: ``aic --nogui --auto-approve --json --session /logs/agent/aic.session
  [--max-time N] ... -- <instruction> < /dev/null``, its JSON Lines teed to
  ``/logs/agent/aic.jsonl``; then, whatever happened (non-zero exit, Harbor's
  timeout cancelling the run), ``aic export --format atif`` writes
  ``/logs/agent/trajectory.json``. The ``end`` event gives the token counts and
  the exit code is mapped to a failure mode (``EXIT_CODES``).
* ``populate_context_post_run``: after Harbor copied the logs back, fills the
  token counts from the host copies of those files (the ``end`` event, else the
  last ``usage`` event, else the trajectory's ``final_metrics``, else the
  session file), so a run Harbor killed still reports what it spent.

The module imports without Harbor installed (a small stand-in base class is used
then), so its unit tests run on a bare Python 3.11.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

try:  # pragma: no cover - exercised only where Harbor is installed
    from harbor.agents.installed.base import (
        BaseInstalledAgent,
        NonZeroAgentExitCodeError,
        with_prompt_template,
    )

    HARBOR_AVAILABLE = True
except ImportError:  # Harbor is not installed: a stand-in with the few methods used here.
    HARBOR_AVAILABLE = False

    class NonZeroAgentExitCodeError(RuntimeError):
        """Stand-in for harbor.agents.installed.base.NonZeroAgentExitCodeError."""

    def with_prompt_template(fn):  # type: ignore[no-redef]
        """Stand-in for Harbor's decorator: renders the instruction through the template, if any."""

        async def wrapper(self, instruction, *args, **kwargs):
            return await fn(self, self.render_instruction(instruction), *args, **kwargs)

        wrapper.__name__ = fn.__name__
        wrapper.__doc__ = fn.__doc__
        return wrapper

    class BaseInstalledAgent:  # type: ignore[no-redef]
        """Stand-in for harbor.agents.installed.base.BaseInstalledAgent (only what AicAgent uses)."""

        SUPPORTS_ATIF: bool = False

        def __init__(
            self,
            logs_dir: Path,
            model_name: str | None = None,
            logger: logging.Logger | None = None,
            *args: Any,
            prompt_template_path: Path | str | None = None,
            version: str | None = None,
            extra_env: dict[str, str] | None = None,
            **kwargs: Any,
        ) -> None:
            self.logs_dir = Path(logs_dir)
            self.model_name = model_name
            self.logger = (logger or logging.getLogger("aic_agent")).getChild(__name__)
            self._extra_env = dict(extra_env or {})
            self._version = version
            self._prompt_template_path = prompt_template_path
            self.session_id: str | None = None

        def _get_env(self, key: str, *alternatives: str) -> str | None:
            for source in (self._extra_env, os.environ):
                for name in (key, *alternatives):
                    if name in source:
                        return source[name]
            return None

        def version(self) -> str | None:
            return self._version

        def render_instruction(self, instruction: str) -> str:
            if self._prompt_template_path:
                raise RuntimeError("prompt templates need Harbor installed")
            return instruction

        async def _exec(self, environment: Any, command: str, user: Any = None, **kwargs: Any) -> Any:
            result = await environment.exec(command=f"set -o pipefail; {command}", user=user, **kwargs)
            if result.return_code != 0:
                raise NonZeroAgentExitCodeError(
                    f"Command failed (exit {result.return_code}): {command}\n"
                    f"stdout: {result.stdout}\nstderr: {result.stderr}"
                )
            return result

        async def exec_as_root(self, environment: Any, command: str, **kwargs: Any) -> Any:
            return await self._exec(environment, command, user="root", **kwargs)

        async def exec_as_agent(self, environment: Any, command: str, **kwargs: Any) -> Any:
            return await self._exec(environment, command, **kwargs)

        async def ensure_system_dependencies(self, environment: Any, dependencies: tuple[str, ...]) -> None:
            return None

        async def setup(self, environment: Any) -> None:
            await self.install(environment)
            if self._version is None:
                result = await environment.exec(command=self.get_version_command())
                if result.return_code == 0 and result.stdout:
                    self._version = self.parse_version(result.stdout)

        def populate_context_post_run(self, context: Any) -> None:
            return None


try:  # pragma: no cover - exercised only where Harbor is installed
    from harbor.trial.errors import AgentTimeoutError
except ImportError:

    class AgentTimeoutError(asyncio.TimeoutError):  # type: ignore[no-redef]
        """Stand-in for harbor.trial.errors.AgentTimeoutError."""


class AicUsageError(NonZeroAgentExitCodeError):
    """aic refused its command line (exit 2): a bug in this adapter or its settings; retrying cannot help."""


class AicNeedsApprovalError(NonZeroAgentExitCodeError):
    """aic stopped for an approval (exit 4), which --auto-approve should make impossible."""


class AicKilledError(NonZeroAgentExitCodeError):
    """aic was stopped by a signal (exit 129, 130, 137, 143)."""


class AicIncompleteError(NonZeroAgentExitCodeError):
    """aic ended without completing the task (step limit, token budget, refused claims, stalled).

    Raised only with ``raise_on_incomplete=True``; by default these outcomes are left to the verifier.
    """


@dataclass(frozen=True)
class _ExecOutcome:
    """What Harbor's error classifier reads of a finished command."""

    return_code: int
    stdout: str | None
    stderr: str | None


@dataclass(frozen=True)
class ExitMeaning:
    failure_mode: str | None  # None: aic completed the task
    error: type[BaseException] | None  # what run() raises; None: nothing
    incomplete: bool = False  # the task was not completed, but aic itself worked as configured


# aic's exit codes (README "Exit codes"; 5 covers both the --max-tokens and the --max-time budget).
EXIT_CODES: dict[int, ExitMeaning] = {
    0: ExitMeaning(None, None),
    1: ExitMeaning("agent_error", NonZeroAgentExitCodeError),
    2: ExitMeaning("usage_error", AicUsageError),
    3: ExitMeaning("step_limit", None, incomplete=True),
    4: ExitMeaning("needs_approval", AicNeedsApprovalError),
    5: ExitMeaning("budget_exhausted", None, incomplete=True),  # refined by the end event's status
    6: ExitMeaning("unverified", None, incomplete=True),
    7: ExitMeaning("stalled", None, incomplete=True),
    129: ExitMeaning("killed", AicKilledError),
    130: ExitMeaning("killed", AicKilledError),
    137: ExitMeaning("killed", AicKilledError),
    143: ExitMeaning("killed", AicKilledError),
}
TIME_BUDGET = ExitMeaning("time_budget", AgentTimeoutError)
TOKEN_BUDGET = ExitMeaning("token_budget", None, incomplete=True)


def exit_meaning(exit_code: int, end_status: str | None = None) -> ExitMeaning:
    """The failure mode of an aic exit code; exit 5 is split by the end event's status."""
    if exit_code == 5:
        return TOKEN_BUDGET if end_status == "token_budget" else TIME_BUDGET
    return EXIT_CODES.get(exit_code, ExitMeaning(f"exit_{exit_code}", NonZeroAgentExitCodeError))


# OpenAI-compatible endpoints for Harbor model prefixes ("provider/model"), and the key each reads.
PROVIDER_API_BASES: dict[str, str] = {
    "openai": "https://api.openai.com/v1",
    "openrouter": "https://openrouter.ai/api/v1",
    "deepseek": "https://api.deepseek.com/v1",
    "groq": "https://api.groq.com/openai/v1",
    "together_ai": "https://api.together.xyz/v1",
    "fireworks_ai": "https://api.fireworks.ai/inference/v1",
    "mistral": "https://api.mistral.ai/v1",
    "xai": "https://api.x.ai/v1",
    "gemini": "https://generativelanguage.googleapis.com/v1beta/openai",
}
PROVIDER_KEY_ENVS: dict[str, str] = {
    "together_ai": "TOGETHER_API_KEY",
    "fireworks_ai": "FIREWORKS_API_KEY",
    "gemini": "GEMINI_API_KEY",
}

# An argument longer than this goes through stdin (`-`) instead of argv (Linux caps one argument at 128 KiB).
MAX_ARGV_INSTRUCTION_BYTES = 64 * 1024


def parse_json_lines(text: str | None) -> list[dict[str, Any]]:
    """Every JSON object line of `text`; other lines (stray output, a torn last line) are skipped."""
    events: list[dict[str, Any]] = []
    for line in (text or "").splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def last_end_event(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last `end` event (job_ended lines may follow it)."""
    for event in reversed(events):
        if event.get("type") == "end":
            return event
    return None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def usage_from_events(events: list[dict[str, Any]]) -> dict[str, int | None] | None:
    """Token totals from the `end` event, else from the last `usage` event's running total."""
    end = last_end_event(events)
    total = end.get("usage") if end else None
    if not isinstance(total, dict):
        for event in reversed(events):
            if event.get("type") == "usage" and isinstance(event.get("total"), dict):
                total = event["total"]
                break
    if not isinstance(total, dict):
        return None
    return {
        "input_tokens": _int_or_none(total.get("input_tokens")),
        "output_tokens": _int_or_none(total.get("output_tokens")),
        "cached_tokens": _int_or_none(total.get("cached_tokens")),
    }


def split_model(model_name: str | None) -> tuple[str | None, str | None]:
    """Harbor's "provider/model" into (provider, model); a name without a slash has no provider."""
    if not model_name:
        return None, None
    if "/" not in model_name:
        return None, model_name
    provider, model = model_name.split("/", 1)
    return provider.lower(), model


class AicAgent(BaseInstalledAgent):
    """Runs aic headless in the task environment and exports its session as an ATIF trajectory."""

    SUPPORTS_ATIF: bool = True

    # Where install() puts aic in the environment; run() and the export find it there, its directory first on PATH.
    # A subclass may move it (the end-to-end test roots the "container" in a temporary directory).
    BINARY = "/usr/local/bin/aic"
    SESSION_FILE = "aic.session"
    EVENTS_FILE = "aic.jsonl"
    STDERR_FILE = "aic.stderr.txt"
    TRAJECTORY_FILE = "trajectory.json"
    INSTRUCTION_FILE = "aic.instruction.txt"

    def __init__(
        self,
        *args: Any,
        max_time_sec: int | float | str | None = None,
        agent_timeout_sec: int | float | str | None = None,
        api_base: str | None = None,
        keep_provider_prefix: bool | str = False,
        max_steps: int | str | None = None,
        max_tokens: int | str | None = None,
        done_when: str | None = None,
        reasoning_effort: str | None = None,
        command_timeout_sec: int | str | None = None,
        checkpoints: bool | str = False,
        disable_sandbox: bool | str = False,
        extra_args: str | None = None,
        binary_path: str | None = None,
        install_url: str | None = None,
        npm_package: str | None = None,
        raise_on_incomplete: bool | str = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._api_base = api_base
        self._keep_provider_prefix = _as_bool(keep_provider_prefix)
        self._max_steps = _as_int(max_steps, "max_steps")
        self._max_tokens = _as_int(max_tokens, "max_tokens")
        self._done_when = done_when
        self._reasoning_effort = reasoning_effort
        self._command_timeout_sec = _as_int(command_timeout_sec, "command_timeout_sec")
        self._checkpoints = _as_bool(checkpoints)
        self._disable_sandbox = _as_bool(disable_sandbox)
        self._extra_args = shlex.split(extra_args) if extra_args else []
        self._binary_path = binary_path
        self._install_url = install_url
        self._npm_package = npm_package
        self._raise_on_incomplete = _as_bool(raise_on_incomplete)
        self._explicit_max_time = _as_int(max_time_sec, "max_time_sec")
        self._agent_timeout_sec = _as_float(agent_timeout_sec, "agent_timeout_sec")
        self.last_exit_code: int | None = None
        self.last_end_event: dict[str, Any] | None = None

    # -- identity ---------------------------------------------------------------------------------

    @staticmethod
    def name() -> str:
        return "aic"

    def get_version_command(self) -> str | None:
        return "aic --version"

    def parse_version(self, stdout: str) -> str:
        match = re.search(r"(\d+\.\d+\S*)", stdout)
        return match.group(1) if match else stdout.strip()

    # -- settings ---------------------------------------------------------------------------------

    def _env(self, key: str) -> str | None:
        getter = getattr(self, "_get_env", None)
        value = getter(key) if getter else os.environ.get(key)
        return value or None

    @property
    def _agent_dir(self) -> PurePosixPath:
        """The logs directory inside the environment (Harbor syncs it to ``self.logs_dir``)."""
        return PurePosixPath(str(getattr(self, "environment_logs_dir", None) or "/logs/agent"))

    def _remote(self, name: str) -> str:
        return (self._agent_dir / name).as_posix()

    def max_time_sec(self) -> int | None:
        """aic's --max-time: explicit, else the Harbor agent timeout less a margin, else $AIC_MAX_TIME.

        The margin leaves time, before Harbor cancels the run, for aic to save its session and for
        the export to run: 5 % of the timeout, at least 10 s and at most 120 s.
        """
        if self._explicit_max_time is not None:
            return self._explicit_max_time
        if self._agent_timeout_sec is not None:
            margin = min(120.0, max(10.0, self._agent_timeout_sec * 0.05))
            return max(1, int(self._agent_timeout_sec - margin))
        return _as_int(self._env("AIC_MAX_TIME"), "AIC_MAX_TIME")

    def resolve_endpoint(self) -> dict[str, str]:
        """The AIC_* variables naming the model, its endpoint and its key."""
        provider, model = split_model(self.model_name)
        if model is None:
            model = self._env("AIC_MODEL")
        elif self._keep_provider_prefix and provider:
            model = self.model_name
        if not model:
            raise ValueError("aic needs a model: pass -m provider/model to Harbor or set AIC_MODEL")
        api_base = (
            self._api_base
            or self._env("AIC_API_BASE")
            or (self._env("OPENAI_BASE_URL") if provider in (None, "openai") else None)
            or PROVIDER_API_BASES.get(provider or "")
        )
        if not api_base:
            raise ValueError(
                f"aic needs an OpenAI-compatible endpoint for provider {provider!r}: "
                "set AIC_API_BASE (--ae AIC_API_BASE=...) or --ak api_base=..."
            )
        env = {"AIC_MODEL": model, "AIC_API_BASE": api_base}
        key_envs = ["AIC_API_KEY"]
        if provider:
            key_envs.append(PROVIDER_KEY_ENVS.get(provider, f"{provider.upper()}_API_KEY"))
        if provider in (None, "openai"):
            key_envs.append("OPENAI_API_KEY")
        for name in key_envs:
            if key := self._env(name):
                env["AIC_API_KEY"] = key
                break
        if headers := self._env("AIC_HEADERS"):
            env["AIC_HEADERS"] = headers
        return env

    def aic_flags(self) -> list[str]:
        flags = ["--nogui", "--auto-approve", "--json", "--session", self._remote(self.SESSION_FILE)]
        if (max_time := self.max_time_sec()) is not None:
            flags += ["--max-time", str(max_time)]
        if self._max_steps is not None:
            flags += ["--max-steps", str(self._max_steps)]
        if self._max_tokens is not None:
            flags += ["--max-tokens", str(self._max_tokens)]
        if self._command_timeout_sec is not None:
            flags += ["--timeout", str(self._command_timeout_sec)]
        if self._done_when:
            flags += ["--done-when", self._done_when]
        if self._reasoning_effort:
            flags += ["--reasoning-effort", self._reasoning_effort]
        if not self._checkpoints:
            flags.append("--no-checkpoints")
        if self._disable_sandbox:
            flags.append("--disable-sandbox")
        return flags + self._extra_args

    # -- install ----------------------------------------------------------------------------------

    async def install(self, environment: Any) -> None:
        binary_path = self._binary_path or self._env("AIC_BINARY_PATH")
        install_url = self._install_url or self._env("AIC_INSTALL_URL")
        if binary_path:
            await environment.upload_file(Path(binary_path).expanduser(), self.BINARY)
            await self.exec_as_root(environment, command=f"chmod 755 {self.BINARY}")
        elif install_url:
            await self.ensure_system_dependencies(environment, ("curl", "tar"))
            url = shlex.quote(install_url)
            if re.search(r"\.(tar\.gz|tgz)(\?.*)?$", install_url):
                fetch = (
                    "tmp=$(mktemp -d) && "
                    f'curl -fsSL --retry 3 {url} | tar -xz -C "$tmp" && '
                    f'install -m 755 "$(find "$tmp" -type f -name aic | head -n 1)" {self.BINARY} && '
                    'rm -rf "$tmp"'
                )
            else:
                part = f"{self.BINARY}.part"
                fetch = f"curl -fsSL --retry 3 -o {part} {url} && install -m 755 {part} {self.BINARY} && rm -f {part}"
            await self.exec_as_root(environment, command=f"set -euo pipefail; {fetch}")
        else:
            await self.ensure_system_dependencies(environment, ("nodejs", "npm"))
            package = self._npm_package or self._env("AIC_NPM_PACKAGE") or "aic"
            version = self.version()
            spec = f"{package}@{version}" if version else package
            await self.exec_as_root(
                environment,
                command=(
                    f"set -euo pipefail; npm install -g {shlex.quote(spec)} && "
                    f'src="$(npm prefix -g)/bin/aic" && '
                    f'{{ [ "$src" = {self.BINARY} ] || ln -sf "$src" {self.BINARY}; }}'
                ),
            )
        await self.exec_as_root(environment, command=f"{self.BINARY} --version")

    # -- run --------------------------------------------------------------------------------------

    def _path_export(self) -> str:
        """Puts the directory of BINARY first on PATH, so the plain ``aic`` below is the one install() put there."""
        return f'export PATH={shlex.quote(PurePosixPath(self.BINARY).parent.as_posix())}:"$PATH"; '

    def run_command(self, instruction: str) -> tuple[str, str | None]:
        """The shell command that runs aic, and the instruction file to write first (long instructions)."""
        events = self._remote(self.EVENTS_FILE)
        stderr = self._remote(self.STDERR_FILE)
        flags = " ".join(shlex.quote(f) for f in self.aic_flags())
        if len(instruction.encode()) <= MAX_ARGV_INSTRUCTION_BYTES:
            task, stdin, instruction_file = f"-- {shlex.quote(instruction)}", "/dev/null", None
        else:  # too long for one argv word: aic reads a lone "-" from stdin
            instruction_file = self._remote(self.INSTRUCTION_FILE)
            task, stdin = "-", instruction_file
        command = (
            f"set -o pipefail; {self._path_export()}"
            f"mkdir -p {shlex.quote(self._agent_dir.as_posix())} && "
            f"aic {flags} {task} < {shlex.quote(stdin)} 2> {shlex.quote(stderr)} | tee {shlex.quote(events)}"
        )
        return command, instruction_file

    def export_command(self) -> str:
        session = shlex.quote(self._remote(self.SESSION_FILE))
        trajectory = shlex.quote(self._remote(self.TRAJECTORY_FILE))
        partial = shlex.quote(self._remote(self.TRAJECTORY_FILE + ".part"))
        stderr = shlex.quote(self._remote(self.STDERR_FILE))
        return (
            f"{self._path_export()}"
            f"aic export --format atif --session {session} > {partial} 2>> {stderr} "
            f"&& mv {partial} {trajectory} || {{ rc=$?; rm -f {partial}; exit $rc; }}"
        )

    def exec_timeout_sec(self) -> int | None:
        """The exec's own limit, a backstop past --max-time: the Harbor timeout when known."""
        if self._agent_timeout_sec is not None:
            return int(self._agent_timeout_sec)
        max_time = self.max_time_sec()
        return None if max_time is None else max_time + 60

    @with_prompt_template
    async def run(self, instruction: str, environment: Any, context: Any) -> None:
        env = self.resolve_endpoint()
        env["NO_COLOR"] = "1"
        command, instruction_file = self.run_command(instruction)
        if instruction_file:
            marker = "AIC_INSTRUCTION_EOF_7f3c"
            await self.exec_as_agent(
                environment,
                command=(
                    f"mkdir -p {shlex.quote(self._agent_dir.as_posix())} && "
                    f"cat > {shlex.quote(instruction_file)} <<'{marker}'\n{instruction}\n{marker}"
                ),
            )
        result = None
        try:
            result = await environment.exec(command=command, env=env, timeout_sec=self.exec_timeout_sec())
        finally:
            # Runs even when Harbor cancels the run at its timeout: the session file is always whole.
            try:
                await environment.exec(command=self.export_command(), env=env, timeout_sec=120)
            except Exception as exc:  # the trajectory is best effort; the run's outcome matters more
                self.logger.debug(f"aic export failed: {exc}")
        self._record_outcome(result, context)

    def _record_outcome(self, result: Any, context: Any) -> None:
        events = parse_json_lines(getattr(result, "stdout", None))
        end = last_end_event(events)
        exit_code = result.return_code
        self.last_exit_code, self.last_end_event = exit_code, end
        end_status = end.get("status") if end else None
        meaning = exit_meaning(exit_code, end_status)
        self._fill_usage(context, usage_from_events(events))
        metadata = dict(getattr(context, "metadata", None) or {})
        metadata.update(
            {
                "aic_exit_code": exit_code,
                "aic_status": end_status,
                "aic_failure_mode": meaning.failure_mode,
                "aic_verified": bool(end.get("verified")) if end else None,
                "aic_steps": end.get("steps") if end else None,
            }
        )
        context.metadata = metadata
        error = meaning.error
        if error is None and meaning.incomplete and self._raise_on_incomplete:
            error = AicIncompleteError
        if error is None:
            return
        detail = (
            f"aic exited with code {exit_code} ({meaning.failure_mode}; end status {end_status!r})\n"
            f"stderr: {_tail(getattr(result, 'stderr', None))}"
        )
        if error is NonZeroAgentExitCodeError and hasattr(self, "_classify_exec_error"):
            # Harbor's own patterns tell a rate limit, an auth failure, a network error... apart. They
            # see aic's stderr and its error events only: the commands' output (in the other events)
            # could mention "rate limit" without meaning it.
            errors = "\n".join(str(e.get("message", "")) for e in events if e.get("type") == "error")
            raise self._classify_exec_error(
                f"aic --nogui ... (end status {end_status!r})",
                _ExecOutcome(return_code=exit_code, stdout=errors, stderr=getattr(result, "stderr", None))
            )
        raise error(detail)

    # -- after the run ----------------------------------------------------------------------------

    @staticmethod
    def _fill_usage(context: Any, usage: dict[str, int | None] | None) -> None:
        if not usage:
            return
        context.n_input_tokens = usage.get("input_tokens")
        context.n_output_tokens = usage.get("output_tokens")
        context.n_cache_tokens = usage.get("cached_tokens")

    def usage_from_logs(self) -> dict[str, int | None] | None:
        """Token totals from the host copies of the logs, best source first."""
        events_path = self.logs_dir / self.EVENTS_FILE
        if events_path.exists():
            usage = usage_from_events(parse_json_lines(events_path.read_text(errors="replace")))
            if usage:
                return usage
        trajectory = _read_json(self.logs_dir / self.TRAJECTORY_FILE)
        metrics = trajectory.get("final_metrics") if isinstance(trajectory, dict) else None
        if isinstance(metrics, dict):
            return {
                "input_tokens": _int_or_none(metrics.get("total_prompt_tokens")),
                "output_tokens": _int_or_none(metrics.get("total_completion_tokens")),
                "cached_tokens": _int_or_none(metrics.get("total_cached_tokens")),
            }
        session = _read_json(self.logs_dir / self.SESSION_FILE)
        usage = session.get("usage") if isinstance(session, dict) else None
        if isinstance(usage, dict):
            return {k: _int_or_none(usage.get(k)) for k in ("input_tokens", "output_tokens", "cached_tokens")}
        return None

    def populate_context_post_run(self, context: Any) -> None:
        if context.n_input_tokens is None and context.n_output_tokens is None:
            self._fill_usage(context, self.usage_from_logs())
        if not (self.logs_dir / self.TRAJECTORY_FILE).exists():
            self.logger.debug("aic left no trajectory.json (the export failed or never ran)")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tail(text: str | None, limit: int = 1500) -> str:
    text = (text or "").strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def _as_bool(value: bool | str | None) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _as_int(value: Any, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a whole number of seconds or a count, got {value!r}") from None
    if number != int(number) or number < 0:
        raise ValueError(f"{name} must be a non-negative whole number, got {value!r}")
    return int(number)


def _as_float(value: Any, name: str) -> float | None:
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if number <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return number
