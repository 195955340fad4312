"""Harbor installed-agent adapter for aic, the ralph-loop shell agent.

Use it with Harbor's custom-agent import path, for example::

    harbor run -d terminal-bench@2.0 -m openai/gpt-4.1 \\
        --agent aic_agent:AicAgent --ak binary_path=/path/to/aic/dist/aic \\
        --ak agent_timeout_sec=900

(``--agent-import-path aic_agent:AicAgent`` on older Harbor releases), with this
directory on ``PYTHONPATH``. See README.md next to this file.

What it does, in the shape of Harbor's ``BaseInstalledAgent`` subclasses
(codex, claude-code, openhands, mini-swe-agent):

* ``install``: puts one ``aic`` executable at ``/usr/local/bin/aic`` inside the
  task environment, from the source it is given and nothing else: a binary on
  the host (``binary_path``, uploaded), a URL with its checksum (``install_url``
  and ``sha256``, fetched and verified inside the environment), or an npm
  package spec (``npm_package``). With none of them, setup fails.
* ``run``: writes the instruction into the environment as data (``upload_file``,
  else base64 chunks), then runs ``aic --nogui --auto-approve --json ... -``
  reading it from that file, in a session and process group of its own whose
  leader's pid is kept in a file. The task container is the sandbox (as for
  Harbor's Codex and Claude Code adapters), so ``--disable-sandbox`` and
  ``--keep-jobs`` are the defaults. aic gets the one API key it uses (through a
  file it reads before its first command); every other provider key Harbor
  would pass is unset first. Afterwards, whatever happened, the adapter stops
  what must not outlive the run (everything aic started, when the run was
  cancelled or failed to return) in an exec shielded from the cancellation,
  and ``aic export --format atif`` writes ``/logs/agent/trajectory.json``.
* ``populate_context_post_run``: after Harbor copied the logs back, fills the
  token counts from the host copies of those files (the ``end`` event, else the
  last ``usage`` event, else the trajectory's ``final_metrics``, else the
  session file), so a run Harbor killed still reports what it spent.

The module imports without Harbor installed (a small stand-in base class is used
then), so its unit tests run on a bare Python 3.11.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import shlex
import tempfile
import uuid
from collections.abc import Mapping
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
        """Stand-in for Harbor 0.22's BaseInstalledAgent (only what AicAgent uses, with the same precedence)."""

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
            environment_logs_dir: PurePosixPath | None = None,
            **kwargs: Any,
        ) -> None:
            self.logs_dir = Path(logs_dir)
            self.environment_logs_dir = PurePosixPath(environment_logs_dir or "/logs/agent")
            self.model_name = model_name
            self.logger = (logger or logging.getLogger("aic_agent")).getChild(__name__)
            self._extra_env = dict(extra_env or {})
            self._version = version
            self._prompt_template_path = prompt_template_path
            self.session_id: str | None = None

        @property
        def extra_env(self) -> dict[str, str]:
            return dict(self._extra_env)

        def _env_sources(self) -> tuple[Mapping[str, str], ...]:
            return (self._extra_env, os.environ)

        def _resolve_env(self, key: str, *alternatives: str) -> tuple[str, str] | None:
            for source in self._env_sources():
                for name in (key, *alternatives):
                    if name in source:
                        return name, source[name]
            return None

        def _get_env(self, key: str, *alternatives: str) -> str | None:
            resolved = self._resolve_env(key, *alternatives)
            return resolved[1] if resolved else None

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
            try:
                await self.install(environment)
            except RuntimeError:
                raise
            except Exception as exc:  # as Harbor's setup() does
                raise RuntimeError(f"Agent install failed: {exc}") from exc
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


# ------------------------------------------------------------------------------------------------
# Model providers, resolved as Harbor 0.22 resolves them for its own agents
# (harbor.agents.model_connection): the prefix of "provider/model" names the provider, a few
# prefixes are aliases (gemini -> google, litellm_proxy -> openai-like, together_ai -> together),
# and each provider has API-key variables, base-URL variables and a default endpoint. aic speaks
# the OpenAI chat-completions API, so the defaults here are each provider's OpenAI-compatible URL.


@dataclass(frozen=True)
class Provider:
    key_envs: tuple[str, ...]
    base_url: str | None = None  # the OpenAI-compatible endpoint, when the provider has a public one
    base_url_envs: tuple[str, ...] = ()


_OPENAI_BASE_ENVS = ("OPENAI_BASE_URL", "OPENAI_API_BASE")

PROVIDERS: dict[str, Provider] = {
    "openai": Provider(("OPENAI_API_KEY",), "https://api.openai.com/v1", _OPENAI_BASE_ENVS),
    # litellm's own names first; Harbor treats the prefix as OpenAI's.
    "litellm_proxy": Provider(
        ("LITELLM_PROXY_API_KEY", "OPENAI_API_KEY"),
        "https://api.openai.com/v1",
        ("LITELLM_PROXY_API_BASE", "LITELLM_PROXY_BASE_URL", *_OPENAI_BASE_ENVS),
    ),
    "anthropic": Provider(
        ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"), "https://api.anthropic.com/v1", ("ANTHROPIC_BASE_URL",)
    ),
    "google": Provider(
        ("GOOGLE_API_KEY", "GEMINI_API_KEY", "GOOGLE_GENERATIVE_AI_API_KEY"),
        "https://generativelanguage.googleapis.com/v1beta/openai",
        ("GOOGLE_BASE_URL", "GEMINI_BASE_URL", "GEMINI_API_BASE"),
    ),
    "fireworks_ai": Provider(
        ("FIREWORKS_AI_API_KEY", "FIREWORKS_API_KEY"),
        "https://api.fireworks.ai/inference/v1",
        ("FIREWORKS_AI_BASE_URL", "FIREWORKS_AI_API_BASE", "FIREWORKS_API_BASE"),
    ),
    "together": Provider(
        ("TOGETHER_API_KEY", "TOGETHERAI_API_KEY", "TOGETHER_AI_API_KEY"),
        "https://api.together.xyz/v1",
        ("TOGETHER_BASE_URL", "TOGETHER_AI_BASE_URL", "TOGETHERAI_API_BASE"),
    ),
    "openrouter": Provider(("OPENROUTER_API_KEY",), "https://openrouter.ai/api/v1", ("OPENROUTER_BASE_URL",)),
    "deepseek": Provider(("DEEPSEEK_API_KEY",), "https://api.deepseek.com/v1", ("DEEPSEEK_BASE_URL",)),
    "groq": Provider(("GROQ_API_KEY",), "https://api.groq.com/openai/v1", ("GROQ_BASE_URL",)),
    "mistral": Provider(("MISTRAL_API_KEY",), "https://api.mistral.ai/v1", ("MISTRAL_BASE_URL",)),
    "xai": Provider(("XAI_API_KEY",), "https://api.x.ai/v1", ("XAI_BASE_URL",)),
    "moonshot": Provider(("MOONSHOT_API_KEY",), "https://api.moonshot.cn/v1", ("MOONSHOT_BASE_URL",)),
    "nvidia": Provider(("NVIDIA_API_KEY",), "https://integrate.api.nvidia.com/v1", ("NVIDIA_BASE_URL",)),
    "nvidia_nim": Provider(("NVIDIA_NIM_API_KEY",), "https://integrate.api.nvidia.com/v1", ("NVIDIA_NIM_BASE_URL",)),
    "cerebras": Provider(("CEREBRAS_API_KEY",), "https://api.cerebras.ai/v1", ("CEREBRAS_BASE_URL",)),
    "deepinfra": Provider(("DEEPINFRA_API_KEY",), "https://api.deepinfra.com/v1/openai", ("DEEPINFRA_BASE_URL",)),
    "hosted_vllm": Provider(("HOSTED_VLLM_API_KEY",), None, ("HOSTED_VLLM_API_BASE", "VLLM_API_BASE")),
    "ollama": Provider(("OLLAMA_API_KEY",), None, ("OLLAMA_BASE_URL", "OLLAMA_API_BASE")),
}
PROVIDER_ALIASES = {"gemini": "google", "together_ai": "together", "bedrock": "amazon-bedrock"}

# Model providers' key variables, unset before aic starts unless aic uses that key (it gets it as
# AIC_API_KEY): Harbor puts every --ae variable into every command of the agent phase, and with the
# sandbox off a prompt-injected command could read them. Harbor's own provider table's keys, plus
# any --ae name of that shape. Other services' tokens (GITHUB_TOKEN, NPM_TOKEN...) are the task's.
PROVIDER_KEY_NAMES: tuple[str, ...] = tuple(
    sorted(
        {name for p in PROVIDERS.values() for name in p.key_envs}
        | {
            "AI21_API_KEY", "ALEPH_ALPHA_API_KEY", "AZURE_API_KEY", "AZURE_OPENAI_API_KEY", "ANYSCALE_API_KEY",
            "BASETEN_API_KEY", "CLOUDFLARE_API_KEY", "CODESTRAL_API_KEY", "COHERE_API_KEY", "CO_API_KEY",
            "DASHSCOPE_API_KEY", "DATABRICKS_TOKEN", "DATAROBOT_API_TOKEN", "DOUBAO_API_KEY",
            "FEATHERLESS_AI_API_KEY", "HF_TOKEN", "HUGGINGFACE_API_KEY", "HUGGING_FACE_HUB_TOKEN",
            "INFINITY_API_KEY", "KIMI_API_KEY", "LLAMA_API_KEY", "MINIMAX_API_KEY", "NEBIUS_API_KEY",
            "NLP_CLOUD_API_KEY", "NOVITA_API_KEY", "OPENCODE_API_KEY", "PALM_API_KEY", "PERPLEXITYAI_API_KEY",
            "PERPLEXITY_API_KEY", "REPLICATE_API_KEY", "SAMBANOVA_API_KEY", "TETRATE_API_KEY",
            "VERCEL_AI_GATEWAY_API_KEY", "VOLCENGINE_API_KEY", "VOYAGE_API_KEY", "ZAI_API_KEY",
            "AWS_BEARER_TOKEN_BEDROCK", "LLM_API_KEY", "MSWEA_API_KEY", "CLAUDE_CODE_OAUTH_TOKEN",
            "AIC_API_KEY", "AIC_HEADERS",
        }  # fmt: skip
    )
)
_KEY_SHAPED = re.compile(r"^[A-Z][A-Z0-9_]*_(API_KEY|API_TOKEN|AUTH_TOKEN|MASTER_KEY)$")
_SHELL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def split_model(model_name: str | None) -> tuple[str | None, str | None]:
    """Harbor's "provider/model" into (provider, model); a name without a slash has no provider."""
    if not model_name:
        return None, None
    if "/" not in model_name:
        return None, model_name
    provider, model = model_name.split("/", 1)
    return provider.lower(), model


def provider_access(prefix: str | None) -> tuple[str, Provider, bool]:
    """The provider a model prefix names (an alias resolved), its access, and whether it is a known one.

    A bare model name is OpenAI's (aic is an OpenAI-compatible client, as Harbor's Codex adapter
    assumes). An unknown prefix P reads P_API_KEY and P_BASE_URL / P_API_BASE (Harbor's and litellm's
    conventions) and has no default endpoint.
    """
    name = PROVIDER_ALIASES.get(prefix or "openai", prefix or "openai")
    if name in PROVIDERS:
        return name, PROVIDERS[name], True
    env = re.sub(r"[^A-Z0-9]", "_", (prefix or name).upper())
    return name, Provider((f"{env}_API_KEY",), None, (f"{env}_BASE_URL", f"{env}_API_BASE")), False


@dataclass(frozen=True)
class Connection:
    """The model aic talks to: where it comes from matters for the tests and the logs, never the key's value."""

    provider: str
    model: str
    api_base: str
    api_key: str | None = None
    key_env: str | None = None  # which variable the key came from
    base_env: str | None = None  # which variable the base URL came from (None: a kwarg or the default)

    def __repr__(self) -> str:  # the key stays out of logs and tracebacks
        key = "set" if self.api_key else "none"
        return f"Connection({self.provider}, {self.model!r}, {self.api_base!r}, key {key} from {self.key_env})"


# ------------------------------------------------------------------------------------------------
# JSON Lines helpers


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


# ------------------------------------------------------------------------------------------------
# Shell pieces. Each is a fixed text; what varies reaches it as positional parameters, so no value
# (a path, an instruction, a key) is ever spliced into shell syntax.

# Runs aic: $1 pid file, $2 settings file ('' for none), $3 stdin, $4 stderr, $5 events, then aic's argv.
# aic leads a session and process group of its own (setsid, where the environment has it): its pid,
# written by the `sh` that becomes aic, is that group's id. The settings file (the API key) is read
# and removed before aic starts, so no command ever sees it.
_RUN_SCRIPT = r"""set -o pipefail
pidfile=$1 settings=$2 stdin=$3 stderr=$4 events=$5
shift 5
launch=
command -v setsid >/dev/null 2>&1 && launch=setsid
$launch sh -c 'echo $$ 2>/dev/null > "$1"
if [ -n "$2" ]; then . "$2" || exit 1; rm -f "$2"; fi
shift 2
exec "$@"' sh "$pidfile" "$settings" "$@" < "$stdin" 2> "$stderr" | tee "$events"
"""

# Stops what must not outlive the run: $1 pid file, $2 the run's marker (NAME=VALUE), $3 "all" to also
# stop every process carrying the marker in its environment (what aic and its commands started, in
# whatever session, daemons included), $4 a settings file to remove. SIGTERM, up to 5 s, then SIGKILL.
# Pure bash over /proc: no procps in minimal images. Prints what it could not stop.
_STOP_SCRIPT = r"""pg=$(cat "$1" 2>/dev/null)
case $pg in '' | *[!0-9]* | 0 | 1) pg= ;; esac
marker=$2 all=$3
[ -n "$4" ] && rm -f "$4"
members() {
  local d p st v only=$1
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [ "$p" = "$$" ] && continue
    { read -r st < "$d/stat"; } 2>/dev/null || continue
    st=${st##*) }
    set -- $st
    [ "$1" = Z ] && continue
    if [ -n "$pg" ] && [ "$3" = "$pg" ]; then echo "$p"; continue; fi
    [ "$all" = all ] && [ "$only" != group ] || continue
    { while IFS= read -r -d '' v; do [ "$v" = "$marker" ] && { echo "$p"; break; }; done < "$d/environ"; } 2>/dev/null
  done
}
# aic's own group first, and alone until it is gone: a command killed before aic would end with a result that aic
# hands to the model, which is then asked again after the trial was cancelled.
first=$(members group)
if [ -n "$first" ]; then
  kill -TERM $first 2>/dev/null
  i=0
  while [ $i -lt 50 ] && [ -n "$(members group)" ]; do sleep 0.1; i=$((i + 1)); done
  first=$(members group)
  [ -n "$first" ] && kill -KILL $first 2>/dev/null
fi
left=$(members)
[ -z "$left" ] && exit 0
kill -TERM $left 2>/dev/null
i=0
while [ $i -lt 50 ]; do
  left=$(members)
  [ -z "$left" ] && exit 0
  sleep 0.1
  i=$((i + 1))
done
kill -KILL $left 2>/dev/null
left=$(members)
[ -z "$left" ] && exit 0
echo "still running after SIGKILL: $left" >&2
exit 1
"""

# Fetches $1 to $2 and checks its sha256 against $3 (lower-case hex); says both digests when they differ.
_FETCH_SCRIPT = r"""set -eu
url=$1 out=$2 want=$3
curl -fsSL --retry 3 -o "$out" "$url"
got=$( (sha256sum "$out" 2>/dev/null || shasum -a 256 "$out" 2>/dev/null || true) | cut -d' ' -f1)
if [ "$got" != "$want" ]; then
  rm -f "$out"
  echo "aic: the sha256 of $url is ${got:-unknown (no sha256sum here)}, not $want" >&2
  exit 1
fi
"""

# Marks every process of one run (aic, its commands, what they leave behind) so the stop script finds them.
RUN_MARKER_ENV = "AIC_HARBOR_RUN"

# One base64 line per exec when the environment has no upload_file: 48 KiB of instruction, 64 KiB
# of text, well under Linux's 128 KiB limit on one argument (the command is one argument to bash).
BASE64_CHUNK_BYTES = 48 * 1024

NOTHING_TO_INSTALL = (
    "aic_agent: nothing to install aic from: pass --ak binary_path=PATH (an aic executable on this machine), "
    "--ak install_url=URL with --ak sha256=HEX, or --ak npm_package=SPEC"
)


class AicAgent(BaseInstalledAgent):
    """Runs aic headless in the task environment and exports its session as an ATIF trajectory."""

    SUPPORTS_ATIF: bool = True

    # Where install() puts aic in the environment, and where the run keeps files that are not logs
    # (the settings file with the key). The end-to-end tests root their "container" in a temporary
    # directory by moving these.
    BINARY = "/usr/local/bin/aic"
    SCRATCH_DIR = "/tmp"
    SESSION_FILE = "aic.session"
    EVENTS_FILE = "aic.jsonl"
    STDERR_FILE = "aic.stderr.txt"
    TRAJECTORY_FILE = "trajectory.json"
    INSTRUCTION_FILE = "aic.instruction.txt"
    PID_FILE = "aic.pid"

    # --max-time from Harbor's timeout: this much less (the larger), for aic to save its session and
    # for the export to run before Harbor cancels the run, but never below the floor.
    MARGIN_FRACTION = 0.10
    MARGIN_MIN_SEC = 30.0
    MAX_TIME_FLOOR_SEC = 10.0

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
        disable_sandbox: bool | str = True,
        keep_jobs: bool | str | None = None,
        expose_env: str | list[str] | None = None,
        extra_args: str | None = None,
        binary_path: str | None = None,
        install_url: str | None = None,
        sha256: str | None = None,
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
        # None: on wherever the installed aic has the flag; True: required; False: off.
        self._keep_jobs = None if keep_jobs is None else _as_bool(keep_jobs)
        if isinstance(expose_env, str):
            expose_env = [n for n in re.split(r"[,\s]+", expose_env) if n]
        self._expose_env = set(expose_env or ())
        self._extra_args = shlex.split(extra_args) if extra_args else []
        self._binary_path = binary_path
        self._install_url = install_url
        self._sha256 = sha256
        self._npm_package = npm_package
        self._raise_on_incomplete = _as_bool(raise_on_incomplete)
        self._explicit_max_time = _as_int(max_time_sec, "max_time_sec")
        self._agent_timeout_sec = _as_float(agent_timeout_sec, "agent_timeout_sec")
        # The options the installed aic lists in --help (install() reads them); None: not known.
        self.aic_options: set[str] | None = None
        self.last_exit_code: int | None = None
        self.last_end_event: dict[str, Any] | None = None
        self.last_stop_output: str | None = None

    # -- identity ---------------------------------------------------------------------------------

    @staticmethod
    def name() -> str:
        return "aic"

    def get_version_command(self) -> str | None:
        return f"{shlex.quote(self.BINARY)} --version"

    def parse_version(self, stdout: str) -> str:
        match = re.search(r"(\d+\.\d+\S*)", stdout)
        return match.group(1) if match else stdout.strip()

    # -- settings ---------------------------------------------------------------------------------

    def _lookup(self, *names: str) -> tuple[str, str] | None:
        """The first of `names` set (non-empty) in Harbor's sources, in their precedence: --ae, then the host."""
        for source in self._env_sources():
            for name in names:
                value = source.get(name)
                if value:
                    return name, value
        return None

    def _env(self, key: str) -> str | None:
        found = self._lookup(key)
        return found[1] if found else None

    @property
    def _agent_dir(self) -> PurePosixPath:
        """The logs directory inside the environment (Harbor syncs it to ``self.logs_dir``)."""
        return PurePosixPath(str(getattr(self, "environment_logs_dir", None) or "/logs/agent"))

    def _remote(self, name: str) -> str:
        return (self._agent_dir / name).as_posix()

    def max_time_sec(self) -> int | None:
        """aic's --max-time: explicit, else Harbor's agent timeout less a margin, else $AIC_MAX_TIME.

        The margin is 10 % of the timeout or 30 s, whichever is more, and leaves time for aic to save
        its session and for the export to run before Harbor cancels the run; --max-time never goes
        below 10 s (or half the timeout, when that is shorter).
        """
        if self._explicit_max_time is not None:
            return self._explicit_max_time
        timeout = self._agent_timeout_sec
        if timeout is not None:
            margin = max(timeout * self.MARGIN_FRACTION, self.MARGIN_MIN_SEC)
            return max(1, int(max(timeout - margin, min(self.MAX_TIME_FLOOR_SEC, timeout / 2))))
        return _as_int(self._env("AIC_MAX_TIME"), "AIC_MAX_TIME")

    def resolve_connection(self) -> Connection:
        """Model, endpoint and key, as Harbor's adapters resolve them.

        * model: ``-m provider/model`` less its prefix (all of it with keep_provider_prefix), else $AIC_MODEL;
        * endpoint: ``--ak api_base``, else $AIC_API_BASE, else the provider's base-URL variables
          (``OPENAI_BASE_URL``/``OPENAI_API_BASE`` for openai, ``<PROVIDER>_BASE_URL`` for the others),
          else, for a provider without a public endpoint, ``OPENAI_BASE_URL``/``OPENAI_API_BASE``, else the
          provider's OpenAI-compatible URL;
        * key: $AIC_API_KEY, else the provider's key variables (``FIREWORKS_AI_API_KEY``,
          ``GOOGLE_API_KEY``/``GEMINI_API_KEY``, ``<PROVIDER>_API_KEY``...).

        Each variable is looked up in --ae first, then the host's environment (Harbor's order). -m and
        --ak win over --ae because they reach aic as flags, which win over its environment.
        """
        prefix, model = split_model(self.model_name)
        if model is not None and self._keep_provider_prefix and prefix:
            model = self.model_name
        if model is None:
            model = self._env("AIC_MODEL")
        if not model:
            raise ValueError("aic needs a model: pass -m provider/model to Harbor or --ae AIC_MODEL=...")
        provider, access, known = provider_access(prefix)

        base_env: str | None = None
        api_base = self._api_base
        if not api_base:
            base_envs = ("AIC_API_BASE", *access.base_url_envs)
            if access.base_url is None:
                base_envs += tuple(n for n in _OPENAI_BASE_ENVS if n not in base_envs)
            found = self._lookup(*base_envs)
            if found:
                base_env, api_base = found
            else:
                api_base = access.base_url
        if not api_base:
            names = ", ".join(("AIC_API_BASE", *access.base_url_envs))
            raise ValueError(
                f"aic needs an OpenAI-compatible endpoint for provider {provider!r}: set one of {names} "
                "(--ae NAME=URL) or --ak api_base=URL"
            )
        key = self._lookup("AIC_API_KEY", *access.key_envs)
        return Connection(
            provider=provider,
            model=model,
            api_base=api_base,
            api_key=key[1] if key else None,
            key_env=key[0] if key else None,
            base_env=base_env,
        )

    def keep_jobs(self) -> bool:
        """Whether aic gets --keep-jobs: by default wherever the installed aic has it."""
        if self._keep_jobs is False:
            return False
        if self.aic_options is None or "--keep-jobs" in self.aic_options:
            return True
        if self._keep_jobs:
            raise AicUsageError("keep_jobs=true, but the installed aic has no --keep-jobs (see aic --help)")
        return False

    def aic_flags(self, connection: Connection) -> list[str]:
        flags = ["--nogui", "--auto-approve", "--json", "--session", self._remote(self.SESSION_FILE)]
        flags += ["--model", connection.model, "--api-base", connection.api_base]
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
        if self.keep_jobs():
            flags.append("--keep-jobs")
        return flags + self._extra_args

    def hidden_env_names(self) -> list[str]:
        """Variables unset before aic starts: every model provider's key, and any --ae name shaped like one.

        aic gets its own key (and header values) from the settings file instead. ``expose_env`` keeps
        names visible to the task's commands.
        """
        names = set(PROVIDER_KEY_NAMES) | {n for n in self.extra_env if _KEY_SHAPED.match(n)}
        names |= set(provider_access(split_model(self.model_name)[0])[1].key_envs)
        return sorted(n for n in names - self._expose_env if _SHELL_NAME.match(n))

    # -- install ----------------------------------------------------------------------------------

    async def install(self, environment: Any) -> None:
        binary_path = self._binary_path or self._env("AIC_BINARY_PATH")
        install_url = self._install_url or self._env("AIC_INSTALL_URL")
        npm_package = self._npm_package or self._env("AIC_NPM_PACKAGE")
        binary = shlex.quote(self.BINARY)
        if binary_path:
            source = Path(binary_path).expanduser()
            if not source.is_file():
                raise ValueError(f"aic_agent: binary_path {source} is not a file on this machine")
            await environment.upload_file(source, self.BINARY)
            await self.exec_as_root(environment, command=f"chmod 755 {binary}")
        elif install_url:
            digest = (self._sha256 or self._env("AIC_SHA256") or "").strip().lower()
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ValueError(
                    "aic_agent: install_url needs its checksum: --ak sha256=<64 hex digits> "
                    "(the aic-<target>.sha256 file of the release)"
                )
            await self.ensure_system_dependencies(environment, ("curl", "tar"))
            download = f"{self.BINARY}.download"
            fetch = f"bash -c {shlex.quote(_FETCH_SCRIPT)} fetch " + " ".join(
                shlex.quote(p) for p in (install_url, download, digest)
            )
            if re.search(r"\.(tar\.gz|tgz)(\?.*)?$", install_url):
                place = (
                    f'tmp=$(mktemp -d) && tar -xzf {shlex.quote(download)} -C "$tmp" && '
                    f'install -m 755 "$(find "$tmp" -type f -name aic | head -n 1)" {binary} && '
                    f'rm -rf "$tmp" {shlex.quote(download)}'
                )
            else:
                place = f"install -m 755 {shlex.quote(download)} {binary} && rm -f {shlex.quote(download)}"
            await self.exec_as_root(environment, command=f"{fetch} && {place}")
        elif npm_package:
            await self.ensure_system_dependencies(environment, ("nodejs", "npm"))
            version = self.version()
            spec = f"{npm_package}@{version}" if version and "@" not in npm_package.lstrip("@") else npm_package
            await self.exec_as_root(
                environment,
                command=(
                    f"npm install -g {shlex.quote(spec)} && "
                    f'src="$(npm prefix -g)/bin/aic" && '
                    f'{{ [ "$src" = {binary} ] || ln -sf "$src" {binary}; }}'
                ),
            )
        else:
            raise ValueError(NOTHING_TO_INSTALL)
        try:
            await self.exec_as_root(environment, command=f"{binary} --version")
        except NonZeroAgentExitCodeError as exc:
            if not (binary_path or install_url) and npm_package:
                raise NonZeroAgentExitCodeError(
                    f"aic from npm ({npm_package}) does not start; its launcher says why (an unpublished "
                    f"platform package is reported as such):\n{exc}"
                ) from exc
            raise
        listed = await environment.exec(command=f"{binary} --help")
        if listed.return_code == 0 and listed.stdout:
            self.aic_options = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", listed.stdout))
        if self._keep_jobs is None and self.aic_options is not None and "--keep-jobs" not in self.aic_options:
            self.logger.warning(
                "this aic has no --keep-jobs: servers the agent starts stop when aic exits, before the verifier runs"
            )
        self.keep_jobs()  # keep_jobs=true with an aic that lacks it fails here, at setup

    # -- run --------------------------------------------------------------------------------------

    async def write_instruction(self, environment: Any, instruction: str) -> str:
        """Puts the instruction into the environment as data; returns its path there.

        With the environment's upload_file it is a file copy. Without one, base64 lines on the
        command line, which nothing in an instruction can end or escape (no here-document).
        """
        target = self._remote(self.INSTRUCTION_FILE)
        data = instruction.encode("utf-8")
        if callable(getattr(environment, "upload_file", None)):
            await self._upload_bytes(environment, data, target, mode=0o644)
            return target
        quoted = shlex.quote(target)
        await self.exec_as_agent(
            environment, command=f"mkdir -p {shlex.quote(self._agent_dir.as_posix())} && : > {quoted}"
        )
        for start in range(0, len(data), BASE64_CHUNK_BYTES):
            line = base64.b64encode(data[start : start + BASE64_CHUNK_BYTES]).decode("ascii")
            await self.exec_as_agent(environment, command=f"printf '%s' '{line}' | base64 -d >> {quoted}")
        return target

    async def _upload_bytes(self, environment: Any, data: bytes, target: str, mode: int) -> None:
        with tempfile.TemporaryDirectory(prefix="aic-harbor-") as tmp:
            local = Path(tmp) / PurePosixPath(target).name
            local.write_bytes(data)
            local.chmod(mode)
            await environment.upload_file(local, target)
        # upload_file copies as root; the agent's user must be able to read it.
        user = getattr(environment, "default_user", None)
        if user is not None:
            await self.exec_as_root(
                environment,
                command=f"chown {shlex.quote(str(user))} {shlex.quote(target)} && chmod {mode:o} {shlex.quote(target)}",
            )

    async def write_settings(self, environment: Any, connection: Connection, run_id: str) -> str:
        """The secrets aic needs (its key, its header values) in a file only the agent's user reads; aic's
        launcher reads it and removes it before aic starts, so no command of the run ever sees it.

        Written by a short exec as the agent's user (so the file is theirs, mode 600, whatever user the
        image runs as), from that exec's environment: it ends before aic, and any command, starts.
        """
        lines = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in self._secrets(connection).items())
        target = (PurePosixPath(self.SCRATCH_DIR) / f"aic-harbor-{run_id}.env").as_posix()
        await self.exec_as_agent(
            environment,
            command=f'umask 077 && printf %s "$AIC_SECRET_SETTINGS" > {shlex.quote(target)}',
            env={"AIC_SECRET_SETTINGS": lines},  # "SECRET": Harbor's logs redact it
        )
        return target

    def _secrets(self, connection: Connection) -> dict[str, str]:
        secrets = {}
        if connection.api_key:
            secrets["AIC_API_KEY"] = connection.api_key
        if headers := self._env("AIC_HEADERS"):
            secrets["AIC_HEADERS"] = headers
        return secrets

    def run_command(self, connection: Connection, instruction_path: str, settings_path: str) -> str:
        """The shell command that runs aic on the instruction file: other keys unset, then the run script."""
        hidden = self.hidden_env_names()
        argv = [self.BINARY, *self.aic_flags(connection), "-"]
        params = [
            self._remote(self.PID_FILE),
            settings_path,
            instruction_path,
            self._remote(self.STDERR_FILE),
            self._remote(self.EVENTS_FILE),
            *argv,
        ]
        # `exec` replaces the shell Harbor started, whose /proc/<pid>/environ would still show the
        # unset keys for the whole run: the new image's environment is the cleaned one.
        return (
            f"mkdir -p {shlex.quote(self._agent_dir.as_posix())} || exit 1; "
            + (f"unset {' '.join(hidden)}; " if hidden else "")
            + f"exec bash -c {shlex.quote(_RUN_SCRIPT)} aic-run "
            + " ".join(shlex.quote(p) for p in params)
        )

    def stop_command(self, run_id: str, everything: bool, settings_path: str | None) -> str:
        marker = f"{RUN_MARKER_ENV}={run_id}"
        params = [self._remote(self.PID_FILE), marker, "all" if everything else "group", settings_path or ""]
        # Harbor lays every --ae variable over every exec of the agent phase: the keys are unset here too, so
        # a process the run left behind (kept by --keep-jobs) cannot read them from this exec's environment.
        return self._without_keys() + f"exec bash -c {shlex.quote(_STOP_SCRIPT)} aic-stop " + " ".join(
            shlex.quote(p) for p in params
        )

    def _without_keys(self) -> str:
        """A shell prefix that unsets every key the run's commands must not see (see hidden_env_names)."""
        hidden = self.hidden_env_names()
        return f"unset {' '.join(hidden)}; " if hidden else ""

    def export_command(self) -> str:
        binary = shlex.quote(self.BINARY)
        session = shlex.quote(self._remote(self.SESSION_FILE))
        trajectory = shlex.quote(self._remote(self.TRAJECTORY_FILE))
        partial = shlex.quote(self._remote(self.TRAJECTORY_FILE + ".part"))
        stderr = shlex.quote(self._remote(self.STDERR_FILE))
        return (
            self._without_keys()
            + f"{binary} export --format atif --session {session} > {partial} 2>> {stderr} "
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
        connection = self.resolve_connection()
        self.aic_flags(connection)  # a setting aic cannot take fails here, before anything is written
        run_id = uuid.uuid4().hex
        env = {"NO_COLOR": "1", RUN_MARKER_ENV: run_id}
        settings_path: str | None = None
        result = None
        try:
            instruction_path = await self.write_instruction(environment, instruction)
            settings_path = await self.write_settings(environment, connection, run_id)
            result = await environment.exec(
                command=self.run_command(connection, instruction_path, settings_path),
                env=env,
                timeout_sec=self.exec_timeout_sec(),
            )
        finally:
            # Whatever ended the run, Harbor's cancellation included: the stop and the export run to
            # their end, shielded from a cancellation that arrives meanwhile.
            await _run_to_completion(self._after_run(environment, run_id, result is None, settings_path))
        self._record_outcome(result, context)

    async def _after_run(self, environment: Any, run_id: str, everything: bool, settings_path: str | None) -> None:
        """Stops aic's process group (and, when the run did not return, every process of the run), then exports."""
        try:
            stopped = await environment.exec(
                command=self.stop_command(run_id, everything, settings_path), user="root", timeout_sec=30
            )
            self.last_stop_output = (stopped.stderr or "").strip() or None
            if stopped.return_code != 0:
                self.logger.warning(f"aic_agent: stopping the run's processes: {self.last_stop_output}")
        except Exception as exc:  # noqa: BLE001 - the export still runs
            self.logger.warning(f"aic_agent: could not stop the run's processes: {exc}")
        try:
            await environment.exec(command=self.export_command(), timeout_sec=120)
        except Exception as exc:  # noqa: BLE001 - the trajectory is best effort; the run's outcome matters more
            self.logger.debug(f"aic export failed: {exc}")

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
                "aic_kept": end.get("kept") if end else None,
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
                _ExecOutcome(return_code=exit_code, stdout=errors, stderr=getattr(result, "stderr", None)),
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


async def _run_to_completion(coro: Any) -> None:
    """Awaits `coro` to its end even if the caller is cancelled meanwhile; then re-raises that cancellation."""
    task = asyncio.ensure_future(coro)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as exc:
            if task.done() and task.cancelled():
                raise
            cancelled = exc
    if cancelled is not None:
        raise cancelled
    task.result()


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
