"""Unit tests of the Harbor adapter for aic, with a fake environment (no Harbor, no container).

Run from this directory:  python3 -m unittest -v
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import re
import shlex
import sys
import tempfile
import unittest
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aic_agent  # noqa: E402
from aic_agent import (  # noqa: E402
    AgentTimeoutError,
    AicAgent,
    AicIncompleteError,
    AicKilledError,
    AicNeedsApprovalError,
    AicUsageError,
    NonZeroAgentExitCodeError,
)

# The line that ended the here-document the adapter once wrote long instructions with.
OLD_MARKER = "AIC_INSTRUCTION_EOF_7f3c"


@dataclass
class ExecResult:
    return_code: int = 0
    stdout: str | None = ""
    stderr: str | None = ""


@dataclass
class Call:
    command: str
    user: Any = None
    env: dict[str, str] | None = None
    timeout_sec: Any = None
    cwd: Any = None


@dataclass
class Upload:
    source: Path
    target: str
    data: bytes
    mode: int


Answer = ExecResult | Callable[[Call], Any]


@dataclass
class FakeEnvironment:
    """Records every exec and upload; answers each exec with the first canned rule whose needle it contains.

    A rule's answer is an ExecResult or a function of the call (which may be a coroutine function, or raise)."""

    rules: list[tuple[str, Answer]] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    uploads: list[Upload] = field(default_factory=list)
    default_user: Any = None

    async def exec(self, command, cwd=None, env=None, timeout_sec=None, user=None):
        call = Call(command, user, env, timeout_sec, cwd)
        self.calls.append(call)
        for needle, answer in self.rules:
            if needle in command:
                if not callable(answer):
                    return answer
                result = answer(call)
                return await result if asyncio.iscoroutine(result) else result
        return ExecResult()

    async def upload_file(self, source_path, target_path):
        source = Path(source_path)
        self.uploads.append(Upload(source, str(target_path), source.read_bytes(), source.stat().st_mode & 0o777))

    def find(self, needle: str) -> list[Call]:
        return [c for c in self.calls if needle in c.command]

    def run_call(self) -> Call:
        (call,) = self.find(" aic-run ")
        return call


@dataclass
class NoUploadEnvironment(FakeEnvironment):
    """An environment without upload_file."""

    upload_file = None  # type: ignore[assignment]


def run_params(command: str) -> dict[str, Any]:
    """The run command's parts: what it unsets, and the run script's parameters (files, then aic's argv)."""
    words = shlex.split(command)
    at = words.index("aic-run")
    unset: list[str] = []
    if "unset" in words:
        i = words.index("unset") + 1
        while not words[i].endswith(";"):
            unset.append(words[i])
            i += 1
        unset.append(words[i].rstrip(";"))
    pidfile, settings, stdin, stderr, events, *argv = words[at + 1 :]
    return {
        "unset": unset,
        "pidfile": pidfile,
        "settings": settings,
        "stdin": stdin,
        "stderr": stderr,
        "events": events,
        "argv": argv,
    }


def flag_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


class Context:
    """The fields of Harbor's AgentContext that the adapter fills."""

    def __init__(self) -> None:
        self.n_input_tokens = None
        self.n_cache_tokens = None
        self.n_output_tokens = None
        self.cost_usd = None
        self.metadata = None


def jsonl(*events: dict[str, Any]) -> str:
    return "".join(json.dumps(e) + "\n" for e in events)


def end_event(status="completed", exit_code=0, usage=(1200, 80, 1000), verified=False) -> dict[str, Any]:
    inp, out, cached = usage
    return {
        "type": "end",
        "ts": "2026-12-01T10:00:00.000Z",
        "status": status,
        "exit_code": exit_code,
        "steps": 4,
        "usage": {
            "input_tokens": inp,
            "output_tokens": out,
            "cached_tokens": cached,
            "billable_tokens": inp - cached + out,
        },
        "verified": verified,
    }


def run_output(exit_code=0, status="completed", usage=(1200, 80, 1000), trailing=()) -> ExecResult:
    stdout = jsonl(
        {"type": "start", "model": "gpt-4.1", "request": "x"},
        {"type": "usage", "total": {"input_tokens": 1, "output_tokens": 1, "cached_tokens": 0}},
        end_event(status, exit_code, usage),
        *trailing,
    )
    return ExecResult(return_code=exit_code, stdout=stdout, stderr="")


class AgentTestCase(unittest.IsolatedAsyncioTestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.logs_dir = Path(self._tmp.name)
        # The host's own model settings must not leak into what these tests resolve.
        patcher = mock.patch.dict(
            os.environ, {k: "" for k in os.environ if re.search(r"API_KEY|BASE_URL|API_BASE|^AIC_", k)}
        )
        patcher.start()
        self.addCleanup(patcher.stop)

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def agent(self, model="openai/gpt-4.1", extra_env=None, **kwargs) -> AicAgent:
        env = {"OPENAI_API_KEY": "sk-test"} if extra_env is None else extra_env
        return AicAgent(logs_dir=self.logs_dir, model_name=model, extra_env=env, **kwargs)

    async def run_agent(self, agent: AicAgent, result: ExecResult, instruction="fix the tests", environment=None):
        environment = environment or FakeEnvironment()
        environment.rules.insert(0, (" aic-run ", result))
        context = Context()
        await agent.run(instruction, environment, context)
        return environment, context

    async def run_argv(self, agent: AicAgent, **kwargs) -> list[str]:
        environment, _ = await self.run_agent(agent, run_output(), **kwargs)
        return run_params(environment.run_call().command)["argv"]


class ImportTests(unittest.TestCase):
    def test_imports_with_or_without_harbor(self):
        self.assertEqual(aic_agent.HARBOR_AVAILABLE, importlib.util.find_spec("harbor") is not None)
        self.assertEqual(AicAgent.name(), "aic")
        self.assertTrue(AicAgent.SUPPORTS_ATIF)
        self.assertTrue(issubclass(AicUsageError, NonZeroAgentExitCodeError))
        self.assertTrue(issubclass(AgentTimeoutError, TimeoutError))


HELP_WITH_KEEP_JOBS = "Options:\n  --disable-sandbox  ...\n  --keep-jobs  Keep background jobs running.\n"
HELP_WITHOUT_KEEP_JOBS = "Options:\n  --disable-sandbox  ...\n  --max-time N  ...\n"


class InstallTests(AgentTestCase):
    def binary(self) -> Path:
        path = self.logs_dir / "dist-aic"
        path.write_bytes(b"\x7fELF fake aic")
        return path

    async def test_nothing_to_install_fails_in_one_line_naming_the_three(self):
        environment = FakeEnvironment()
        with self.assertRaises(RuntimeError) as caught:
            await self.agent().setup(environment)  # Harbor's setup() wraps what install() raises
        message = str(caught.exception)
        self.assertNotIn("\n", message)
        for name in ("binary_path", "install_url", "npm_package"):
            self.assertIn(name, message)
        self.assertEqual(environment.find("npm") + environment.find("curl"), [])

    async def test_a_binary_from_the_host_is_uploaded(self):
        environment = FakeEnvironment(rules=[("--help", ExecResult(0, HELP_WITH_KEEP_JOBS, ""))])
        binary = self.binary()
        agent = self.agent(binary_path=str(binary))
        await agent.install(environment)
        self.assertEqual(
            [(u.source, u.target, u.data) for u in environment.uploads],
            [(binary, AicAgent.BINARY, binary.read_bytes())],
        )
        commands = [c.command for c in environment.calls]
        self.assertIn("chmod 755 /usr/local/bin/aic", commands[0])
        self.assertTrue(commands[1].endswith("/usr/local/bin/aic --version"))
        self.assertEqual(environment.find("curl") + environment.find("npm"), [])
        self.assertIn("--keep-jobs", agent.aic_options)

    async def test_the_binary_path_may_come_from_the_environment(self):
        environment = FakeEnvironment()
        binary = self.binary()
        await self.agent(extra_env={"AIC_BINARY_PATH": str(binary)}).install(environment)
        self.assertEqual(environment.uploads[0].target, AicAgent.BINARY)

    async def test_a_missing_binary_is_named(self):
        with self.assertRaisesRegex(ValueError, "not a file"):
            await self.agent(binary_path=str(self.logs_dir / "nope")).install(FakeEnvironment())

    async def test_a_url_needs_its_checksum(self):
        for digest in (None, "abc", "z" * 64):
            with self.subTest(digest=digest), self.assertRaisesRegex(ValueError, "sha256"):
                await self.agent(install_url="https://example.com/aic-linux-x64", sha256=digest).install(
                    FakeEnvironment()
                )

    async def test_a_url_is_fetched_and_its_checksum_verified(self):
        digest = "ab" * 32
        environment = FakeEnvironment()
        url = "https://example.com/releases/aic-linux-x64"
        await self.agent(extra_env={"AIC_INSTALL_URL": url, "AIC_SHA256": digest.upper()}).install(environment)
        (fetch,) = environment.find("curl -fsSL")
        self.assertEqual(fetch.user, "root")
        words = shlex.split(fetch.command.split("set -o pipefail; ", 1)[-1])
        self.assertEqual(words[:3], ["bash", "-c", aic_agent._FETCH_SCRIPT])
        self.assertEqual(words[3:7], ["fetch", url, "/usr/local/bin/aic.download", digest])
        self.assertIn("install -m 755 /usr/local/bin/aic.download /usr/local/bin/aic", fetch.command)
        self.assertEqual(environment.find("npm"), [])

    async def test_a_tarball_url_is_unpacked_after_the_check(self):
        environment = FakeEnvironment()
        await self.agent(install_url="https://example.com/aic.tar.gz", sha256="cd" * 32).install(environment)
        (fetch,) = environment.find("curl -fsSL")
        self.assertLess(fetch.command.index("sha256sum"), fetch.command.index("tar -xzf"))
        self.assertIn("-name aic", fetch.command)

    async def test_npm_only_for_the_package_named(self):
        environment = FakeEnvironment()
        await self.agent(npm_package="@acme/aic", version="0.1.0").install(environment)
        (npm,) = environment.find("npm install -g")
        self.assertIn("npm install -g @acme/aic@0.1.0 ", npm.command)
        self.assertEqual(npm.user, "root")
        environment = FakeEnvironment()
        await self.agent(extra_env={"AIC_NPM_PACKAGE": "aic@0.2.0"}, version="0.1.0").install(environment)
        self.assertIn("npm install -g aic@0.2.0 ", environment.find("npm install -g")[0].command)

    async def test_an_npm_install_that_does_not_start_says_the_package_may_be_unpublished(self):
        hint = "aic: the package @aic/linux-x64@0.1.0 that holds aic's binary is not installed (not published?)"
        environment = FakeEnvironment(rules=[("--version", ExecResult(1, "", hint))])
        with self.assertRaises(NonZeroAgentExitCodeError) as caught:
            await self.agent(npm_package="aic").install(environment)
        self.assertIn("unpublished", str(caught.exception))
        self.assertIn(hint, str(caught.exception))

    async def test_a_failed_install_raises(self):
        environment = FakeEnvironment(rules=[("npm install", ExecResult(1, "", "E404 Not Found"))])
        with self.assertRaises(NonZeroAgentExitCodeError):
            await self.agent(npm_package="aic").install(environment)

    async def test_keep_jobs_only_where_the_installed_aic_has_it(self):
        binary = str(self.binary())
        old = FakeEnvironment(rules=[("--help", ExecResult(0, HELP_WITHOUT_KEEP_JOBS, ""))])
        agent = self.agent(binary_path=binary)
        with self.assertLogs(level="WARNING") as logs:
            await agent.install(old)
        self.assertIn("--keep-jobs", "\n".join(logs.output))
        self.assertNotIn("--keep-jobs", await self.run_argv(agent))
        with self.assertRaisesRegex(RuntimeError, "keep-jobs"):
            await self.agent(binary_path=binary, keep_jobs="true").setup(
                FakeEnvironment(rules=[("--help", ExecResult(0, HELP_WITHOUT_KEEP_JOBS, ""))])
            )

    def test_version_is_parsed(self):
        self.assertEqual(self.agent().parse_version("aic 0.1.0\n"), "0.1.0")


class ConnectionTests(AgentTestCase):
    """Model, endpoint and key as Harbor's adapters resolve them (harbor.agents.model_connection)."""

    def resolve(self, model: str, env: dict[str, str], **kwargs) -> aic_agent.Connection:
        return self.agent(model, extra_env=env, **kwargs).resolve_connection()

    def assertConnection(self, connection, model, api_base, key=None, key_env=None):
        self.assertEqual((connection.model, connection.api_base), (model, api_base))
        self.assertEqual((connection.api_key, connection.key_env), (key, key_env))

    def test_openai_defaults(self):
        self.assertConnection(
            self.resolve("openai/gpt-4.1", {"OPENAI_API_KEY": "sk"}),
            "gpt-4.1", "https://api.openai.com/v1", "sk", "OPENAI_API_KEY",
        )  # fmt: skip
        # A bare name is OpenAI's, as for Harbor's Codex adapter.
        self.assertEqual(self.resolve("gpt-4.1", {}).api_base, "https://api.openai.com/v1")

    def test_openai_api_base_is_honoured(self):
        c = self.resolve("openai/gpt-4.1", {"OPENAI_API_BASE": "http://proxy:4000/v1", "OPENAI_API_KEY": "sk"})
        self.assertConnection(c, "gpt-4.1", "http://proxy:4000/v1", "sk", "OPENAI_API_KEY")
        self.assertEqual(c.base_env, "OPENAI_API_BASE")
        c = self.resolve("openai/gpt-4.1", {"OPENAI_API_BASE": "http://b/v1", "OPENAI_BASE_URL": "http://a/v1"})
        self.assertEqual(c.api_base, "http://a/v1")  # Harbor's order: OPENAI_BASE_URL, then OPENAI_API_BASE

    def test_provider_base_url_is_honoured(self):
        c = self.resolve(
            "openrouter/anthropic/claude-sonnet-4", {"OPENROUTER_BASE_URL": "http://or/v1", "OPENROUTER_API_KEY": "or"}
        )
        self.assertConnection(c, "anthropic/claude-sonnet-4", "http://or/v1", "or", "OPENROUTER_API_KEY")
        c = self.resolve("deepseek/deepseek-chat", {"DEEPSEEK_BASE_URL": "http://ds/v1", "DEEPSEEK_API_KEY": "ds"})
        self.assertConnection(c, "deepseek-chat", "http://ds/v1", "ds", "DEEPSEEK_API_KEY")
        # A provider Harbor does not know: <PROVIDER>_BASE_URL and <PROVIDER>_API_KEY.
        c = self.resolve("acme-ai/big-1", {"ACME_AI_BASE_URL": "http://acme/v1", "ACME_AI_API_KEY": "ak"})
        self.assertConnection(c, "big-1", "http://acme/v1", "ak", "ACME_AI_API_KEY")

    def test_fireworks_ai_api_key_is_found(self):
        c = self.resolve("fireworks_ai/accounts/fireworks/models/kimi-k2", {"FIREWORKS_AI_API_KEY": "fw"})
        self.assertConnection(
            c,
            "accounts/fireworks/models/kimi-k2",
            "https://api.fireworks.ai/inference/v1",
            "fw",
            "FIREWORKS_AI_API_KEY",
        )
        self.assertEqual(self.resolve("fireworks_ai/m", {"FIREWORKS_API_KEY": "fw2"}).key_env, "FIREWORKS_API_KEY")

    def test_google_api_key_is_found_for_gemini(self):
        base = "https://generativelanguage.googleapis.com/v1beta/openai"
        self.assertConnection(
            self.resolve("gemini/gemini-2.5-pro", {"GOOGLE_API_KEY": "g"}),
            "gemini-2.5-pro",
            base,
            "g",
            "GOOGLE_API_KEY",
        )
        self.assertEqual(self.resolve("gemini/gemini-2.5-pro", {"GEMINI_API_KEY": "g2"}).key_env, "GEMINI_API_KEY")
        self.assertEqual(self.resolve("google/gemini-2.5-pro", {"GOOGLE_API_KEY": "g"}).api_base, base)

    def test_litellm_proxy_models(self):
        c = self.resolve(
            "litellm_proxy/anthropic/claude-sonnet-4-5",
            {"LITELLM_PROXY_API_BASE": "http://litellm:4000", "LITELLM_PROXY_API_KEY": "lp"},
        )
        self.assertConnection(c, "anthropic/claude-sonnet-4-5", "http://litellm:4000", "lp", "LITELLM_PROXY_API_KEY")
        c = self.resolve("litellm_proxy/gpt-5", {"OPENAI_API_BASE": "http://litellm:4000/v1", "OPENAI_API_KEY": "sk"})
        self.assertConnection(c, "gpt-5", "http://litellm:4000/v1", "sk", "OPENAI_API_KEY")
        # Nothing set: Harbor treats the prefix as OpenAI's, so does this (no exception).
        self.assertEqual(self.resolve("litellm_proxy/gpt-5", {}).api_base, "https://api.openai.com/v1")

    def test_anthropic_models(self):
        c = self.resolve(
            "anthropic/claude-sonnet-4-5", {"ANTHROPIC_API_KEY": "an", "OPENAI_BASE_URL": "http://not-this/v1"}
        )
        self.assertConnection(c, "claude-sonnet-4-5", "https://api.anthropic.com/v1", "an", "ANTHROPIC_API_KEY")
        c = self.resolve(
            "anthropic/claude-sonnet-4-5", {"ANTHROPIC_BASE_URL": "http://gw/v1", "ANTHROPIC_AUTH_TOKEN": "t"}
        )
        self.assertConnection(c, "claude-sonnet-4-5", "http://gw/v1", "t", "ANTHROPIC_AUTH_TOKEN")

    def test_providers_without_a_public_endpoint(self):
        c = self.resolve("hosted_vllm/qwen3", {"HOSTED_VLLM_API_BASE": "http://10.0.0.2:8000/v1"})
        self.assertConnection(c, "qwen3", "http://10.0.0.2:8000/v1")
        self.assertEqual(self.resolve("hosted_vllm/qwen3", {"OPENAI_API_BASE": "http://v/v1"}).api_base, "http://v/v1")
        with self.assertRaisesRegex(ValueError, "HOSTED_VLLM_API_BASE"):
            self.resolve("hosted_vllm/qwen3", {})
        with self.assertRaisesRegex(ValueError, "model"):
            self.resolve(None, {})

    def test_model_precedence_m_wins_over_ae(self):
        env = {"AIC_MODEL": "from-ae", "OPENAI_API_KEY": "sk"}
        self.assertEqual(self.resolve("openai/gpt-4.1", env).model, "gpt-4.1")
        self.assertEqual(self.resolve(None, env).model, "from-ae")
        kept = self.resolve("hosted_vllm/qwen3", {"AIC_API_BASE": "http://h/v1"}, keep_provider_prefix="true")
        self.assertEqual(kept.model, "hosted_vllm/qwen3")

    def test_endpoint_precedence_ak_wins_over_ae(self):
        env = {"AIC_API_BASE": "http://ae/v1", "OPENAI_BASE_URL": "http://provider/v1"}
        self.assertEqual(self.resolve("openai/gpt-4.1", env, api_base="http://ak/v1").api_base, "http://ak/v1")
        self.assertEqual(self.resolve("openai/gpt-4.1", env).api_base, "http://ae/v1")

    def test_key_precedence(self):
        env = {"AIC_API_KEY": "aic", "ANTHROPIC_API_KEY": "an"}
        self.assertEqual(self.resolve("anthropic/claude-sonnet-4-5", env).key_env, "AIC_API_KEY")
        # --ae wins over the host's environment, as in Harbor's _get_env.
        with mock.patch.dict(os.environ, {"OPENAI_API_KEY": "host"}):
            self.assertEqual(self.resolve("openai/gpt-4.1", {"OPENAI_API_KEY": "ae"}).api_key, "ae")
            self.assertEqual(self.resolve("openai/gpt-4.1", {}).api_key, "host")

    async def test_model_and_endpoint_reach_aic_as_flags(self):
        # Harbor lays --ae variables over every exec's own environment; flags win over aic's environment.
        argv = await self.run_argv(
            self.agent("openai/gpt-4.1", {"AIC_MODEL": "from-ae", "OPENAI_API_KEY": "sk"}, api_base="http://ak/v1")
        )
        self.assertEqual(flag_value(argv, "--model"), "gpt-4.1")
        self.assertEqual(flag_value(argv, "--api-base"), "http://ak/v1")


class CommandTests(AgentTestCase):
    async def test_defaults_fit_a_task_container(self):
        environment, _ = await self.run_agent(self.agent(), run_output())
        call = environment.run_call()
        params = run_params(call.command)
        argv = params["argv"]
        self.assertEqual(
            argv[:6],
            ["/usr/local/bin/aic", "--nogui", "--auto-approve", "--json", "--session", "/logs/agent/aic.session"],
        )
        for flag in ("--disable-sandbox", "--keep-jobs", "--no-checkpoints"):
            self.assertIn(flag, argv)
        self.assertEqual(argv[-1], "-")  # the instruction comes on stdin, from the file written first
        self.assertEqual(params["stdin"], "/logs/agent/aic.instruction.txt")
        self.assertEqual(params["stderr"], "/logs/agent/aic.stderr.txt")
        self.assertEqual(params["events"], "/logs/agent/aic.jsonl")
        self.assertEqual(params["pidfile"], "/logs/agent/aic.pid")
        self.assertIn("exec bash -c ", call.command)
        self.assertIsNone(call.user)  # Harbor's default (agent) user
        self.assertEqual(call.env["NO_COLOR"], "1")
        self.assertRegex(call.env[aic_agent.RUN_MARKER_ENV], r"^[0-9a-f]{32}$")

    async def test_the_sandbox_and_kept_jobs_can_be_turned_off(self):
        argv = await self.run_argv(self.agent(disable_sandbox=False, keep_jobs="false"))
        self.assertNotIn("--disable-sandbox", argv)
        self.assertNotIn("--keep-jobs", argv)
        self.assertNotIn("--disable-sandbox", await self.run_argv(self.agent(disable_sandbox="false")))

    async def test_options_become_flags(self):
        agent = self.agent(
            max_steps="50",
            max_tokens=2_000_000,
            done_when="pytest -q",
            reasoning_effort="high",
            command_timeout_sec=300,
            checkpoints=True,
            extra_args="--compress-alg truncate",
        )
        argv = await self.run_argv(agent)
        for flag, value in (
            ("--max-steps", "50"),
            ("--max-tokens", "2000000"),
            ("--done-when", "pytest -q"),
            ("--reasoning-effort", "high"),
            ("--timeout", "300"),
            ("--compress-alg", "truncate"),
        ):
            self.assertEqual(flag_value(argv, flag), value)
        self.assertNotIn("--no-checkpoints", argv)

    async def test_export_runs_after_the_stop(self):
        environment, _ = await self.run_agent(self.agent(), run_output())
        run, stop, export = environment.calls[-3:]
        self.assertIs(run, environment.run_call())
        self.assertIn(" aic-stop ", stop.command)
        self.assertEqual(stop.user, "root")
        self.assertEqual(shlex.split(stop.command)[-2], "group")  # a run that returned: only aic's own group
        self.assertIn(
            "/usr/local/bin/aic export --format atif --session /logs/agent/aic.session > /logs/agent/trajectory.json.part",
            export.command,
        )
        self.assertIn("mv /logs/agent/trajectory.json.part /logs/agent/trajectory.json", export.command)


class KeyTests(AgentTestCase):
    """aic gets the one key it uses, in a file it reads before its first command; the other keys are unset."""

    ENV = {
        "ANTHROPIC_API_KEY": "sk-ant-secret",
        "OPENAI_API_KEY": "sk-openai-secret",
        "GEMINI_API_KEY": "gem-secret",
        "ACME_API_KEY": "acme-secret",
        "GITHUB_TOKEN": "ghp-task",
        "AIC_MAX_STEPS_NOTE": "not a key",
    }

    async def test_only_the_key_aic_uses_reaches_it(self):
        for environment in (FakeEnvironment(), NoUploadEnvironment()):
            with self.subTest(environment=type(environment).__name__):
                await self.run_agent(
                    self.agent("anthropic/claude-sonnet-4-5", dict(self.ENV)), run_output(), environment=environment
                )
                params = run_params(environment.run_call().command)
                self.assertTrue(params["settings"].startswith("/tmp/aic-harbor-"))
                # The settings file: written by a short exec of its own, as the agent's user, mode 600, from its env.
                (writer,) = environment.find("AIC_SECRET_SETTINGS")
                self.assertIsNone(writer.user)
                self.assertIn("umask 077", writer.command)
                self.assertTrue(writer.command.endswith(f"> {params['settings']}"))
                self.assertEqual(writer.env, {"AIC_SECRET_SETTINGS": "export AIC_API_KEY=sk-ant-secret\n"})
                self.assertLess(environment.calls.index(writer), environment.calls.index(environment.run_call()))
                for name in (
                    "ANTHROPIC_API_KEY",
                    "OPENAI_API_KEY",
                    "GEMINI_API_KEY",
                    "ACME_API_KEY",
                    "AIC_API_KEY",
                    "AIC_HEADERS",
                ):
                    self.assertIn(name, params["unset"])
                self.assertNotIn("GITHUB_TOKEN", params["unset"])  # other services' tokens are the task's
                for call in environment.calls:
                    for secret in ("sk-ant-secret", "sk-openai-secret", "gem-secret", "acme-secret"):
                        self.assertNotIn(secret, call.command)
                        if call is not writer:
                            self.assertNotIn(secret, json.dumps(call.env or {}))
                self.assertNotIn("sk-openai-secret", json.dumps(writer.env))
                self.assertEqual([u for u in environment.uploads if "aic-harbor-" in u.target], [])
                (stop,) = environment.find(" aic-stop ")
                self.assertEqual(shlex.split(stop.command)[-1], params["settings"])  # removed if aic never read it

    async def test_header_values_go_in_the_settings_file_too(self):
        env = {"OPENAI_API_KEY": "sk", "AIC_HEADERS": "X-Team: a b\nX-Secret: it's"}
        environment, _ = await self.run_agent(self.agent("openai/gpt-4.1", env), run_output())
        (writer,) = environment.find("AIC_SECRET_SETTINGS")
        self.assertEqual(
            writer.env["AIC_SECRET_SETTINGS"],
            "export AIC_API_KEY=sk\nexport AIC_HEADERS=" + shlex.quote("X-Team: a b\nX-Secret: it's") + "\n",
        )

    async def test_expose_env_keeps_a_name_visible(self):
        environment, _ = await self.run_agent(
            self.agent("openai/gpt-4.1", dict(self.ENV), expose_env="ACME_API_KEY"), run_output()
        )
        unset = run_params(environment.run_call().command)["unset"]
        self.assertNotIn("ACME_API_KEY", unset)
        self.assertIn("ANTHROPIC_API_KEY", unset)


def huge_instruction() -> str:
    """Over 64 KiB, with the old here-document's end line, shell syntax, quotes, NULs and non-ASCII text."""
    hostile = "\n".join(
        [
            "Fix the build.",
            OLD_MARKER,
            "touch /tmp/aic-owned; $(touch /tmp/aic-owned2) `id` '\"; exit 0; echo \\",
            "EOF",
            "'; rm -rf / #",
            "héllo wörld ✓ \t tab \x00 nul \r cr",
        ]
    )
    return hostile + "\n" + "x" * 70_000 + "\n" + hostile + "\n"


class InstructionTests(AgentTestCase):
    async def test_a_huge_instruction_is_uploaded_byte_exact(self):
        instruction = huge_instruction()
        self.assertGreater(len(instruction.encode()), 64 * 1024)
        environment, _ = await self.run_agent(self.agent(), run_output(), instruction=instruction)
        params = run_params(environment.run_call().command)
        (upload,) = [u for u in environment.uploads if u.target == params["stdin"]]
        self.assertEqual(upload.data, instruction.encode("utf-8"))
        self.assertEqual(upload.mode, 0o644)
        for call in environment.calls:
            self.assertNotIn(OLD_MARKER, call.command)
            self.assertNotIn("aic-owned", call.command)

    async def test_without_upload_file_it_goes_as_base64_lines(self):
        instruction = huge_instruction()
        environment, _ = await self.run_agent(
            self.agent(), run_output(), instruction=instruction, environment=NoUploadEnvironment()
        )
        target = "/logs/agent/aic.instruction.txt"
        chunks = []
        for call in environment.find("base64 -d"):
            body = call.command.split("set -o pipefail; ", 1)[1]
            match = re.fullmatch(r"printf '%s' '([A-Za-z0-9+/=]*)' \| base64 -d >> " + re.escape(target), body)
            self.assertIsNotNone(match, body[:200])
            self.assertLess(len(call.command), 100 * 1024)  # one argv word stays far under Linux's 128 KiB
            chunks.append(base64.b64decode(match.group(1), validate=True))
        self.assertGreater(len(chunks), 1)
        self.assertEqual(b"".join(chunks), instruction.encode("utf-8"))
        self.assertEqual(run_params(environment.run_call().command)["stdin"], target)
        for call in environment.calls:
            self.assertNotIn(OLD_MARKER, call.command)


class TimeoutTests(AgentTestCase):
    async def argv_and_timeout(self, **kwargs) -> tuple[list[str], Any]:
        environment, _ = await self.run_agent(self.agent(**kwargs), run_output())
        run = environment.run_call()
        return run_params(run.command)["argv"], run.timeout_sec

    async def test_harbor_timeout_leaves_a_margin(self):
        argv, timeout = await self.argv_and_timeout(agent_timeout_sec=900)
        self.assertEqual(flag_value(argv, "--max-time"), "810")  # 10 % of 900 s kept for saving and exporting
        self.assertEqual(timeout, 900)

    def test_margin_is_10_percent_or_30_seconds_and_never_below_a_floor(self):
        for timeout, expected in (
            (7200, 6480),
            (900, 810),
            (300, 270),
            (120, 90),
            (60, 30),
            (30, 10),
            (12, 6),
            (5, 2),
            (1, 1),
        ):
            with self.subTest(timeout=timeout):
                self.assertEqual(self.agent(agent_timeout_sec=str(timeout)).max_time_sec(), expected)

    async def test_explicit_max_time_wins(self):
        argv, timeout = await self.argv_and_timeout(agent_timeout_sec=900, max_time_sec=100)
        self.assertEqual(flag_value(argv, "--max-time"), "100")
        self.assertEqual(timeout, 900)

    async def test_max_time_from_the_environment(self):
        argv, timeout = await self.argv_and_timeout(extra_env={"AIC_MAX_TIME": "300", "OPENAI_API_KEY": "k"})
        self.assertEqual(flag_value(argv, "--max-time"), "300")
        self.assertEqual(timeout, 360)

    async def test_no_timeout_known_means_no_flag(self):
        argv, timeout = await self.argv_and_timeout()
        self.assertNotIn("--max-time", argv)
        self.assertIsNone(timeout)

    def test_bad_timeouts_are_refused(self):
        with self.assertRaises(ValueError):
            self.agent(max_time_sec="ten")
        with self.assertRaises(ValueError):
            self.agent(agent_timeout_sec=0)


class CancellationTests(AgentTestCase):
    async def test_a_cancelled_run_stops_everything_then_exports(self):
        def cancelled(call: Call) -> ExecResult:
            raise asyncio.CancelledError()

        environment = FakeEnvironment(rules=[(" aic-run ", cancelled)])
        with self.assertRaises(asyncio.CancelledError):
            await self.agent(agent_timeout_sec=60).run("task", environment, Context())
        (stop,) = environment.find(" aic-stop ")
        # The keys Harbor lays over every exec are unset first, as for the run itself.
        self.assertRegex(stop.command, r"^unset [^;]*\bOPENAI_API_KEY\b[^;]*; exec bash -c ")
        self.assertRegex(environment.find("aic export")[0].command, r"^unset [^;]*\bANTHROPIC_API_KEY\b")
        words = shlex.split(stop.command.split("; exec ", 1)[1])
        self.assertEqual(words[:3], ["bash", "-c", aic_agent._STOP_SCRIPT])
        self.assertEqual(words[4], "/logs/agent/aic.pid")
        self.assertEqual(words[6], "all")
        self.assertRegex(words[5], rf"^{aic_agent.RUN_MARKER_ENV}=[0-9a-f]{{32}}$")
        self.assertEqual(words[5].split("=", 1)[1], environment.run_call().env[aic_agent.RUN_MARKER_ENV])
        self.assertEqual(stop.user, "root")
        self.assertGreater(environment.calls.index(environment.find("aic export")[0]), environment.calls.index(stop))

    async def test_a_failing_exec_stops_everything_too(self):
        def broken(call: Call) -> ExecResult:
            raise RuntimeError("docker exec died")

        environment = FakeEnvironment(rules=[(" aic-run ", broken)])
        with self.assertRaisesRegex(RuntimeError, "docker exec died"):
            await self.agent().run("task", environment, Context())
        self.assertEqual(shlex.split(environment.find(" aic-stop ")[0].command.split("; exec ", 1)[1])[6], "all")

    async def test_a_second_cancellation_does_not_cut_the_cleanup_short(self):
        started, release = asyncio.Event(), asyncio.Event()

        async def hang(call: Call) -> ExecResult:
            await asyncio.Event().wait()  # the run: until Harbor cancels it
            return ExecResult()

        async def slow_stop(call: Call) -> ExecResult:
            started.set()
            await release.wait()
            return ExecResult()

        environment = FakeEnvironment(rules=[(" aic-run ", hang), (" aic-stop ", slow_stop)])
        task = asyncio.ensure_future(self.agent().run("task", environment, Context()))
        while not environment.find(" aic-run "):
            await asyncio.sleep(0)
        task.cancel()
        await started.wait()
        task.cancel()  # cancelled again while stopping the run's processes
        for _ in range(5):
            await asyncio.sleep(0)
        self.assertFalse(task.done())
        release.set()
        with self.assertRaises(asyncio.CancelledError):
            await task
        self.assertEqual(len(environment.find("aic export")), 1)

    async def test_a_failing_stop_or_export_does_not_hide_the_outcome(self):
        environment = FakeEnvironment(
            rules=[
                ("aic export", ExecResult(1, "", "bad")),
                (" aic-stop ", ExecResult(1, "", "still running after SIGKILL: 12")),
            ]
        )
        agent = self.agent()
        with self.assertLogs(level="WARNING") as logs:
            _, context = await self.run_agent(agent, run_output(), environment=environment)
        self.assertIn("still running after SIGKILL: 12", "\n".join(logs.output))
        self.assertEqual(agent.last_stop_output, "still running after SIGKILL: 12")
        self.assertEqual(context.metadata["aic_exit_code"], 0)
        self.assertIsNone(context.metadata["aic_failure_mode"])


class TokenTests(AgentTestCase):
    async def test_tokens_come_from_the_last_end_event(self):
        trailing = [{"type": "job_ended", "id": 1, "pid": 7, "exit_code": None, "how": "stopped_at_exit"}]
        result = run_output(usage=(5000, 300, 4096), trailing=trailing)
        result.stdout = "not json\n" + result.stdout + '{"type": "end", torn'
        _, context = await self.run_agent(self.agent(), result)
        self.assertEqual((context.n_input_tokens, context.n_output_tokens, context.n_cache_tokens), (5000, 300, 4096))
        self.assertIsNone(context.cost_usd)
        self.assertEqual(context.metadata["aic_steps"], 4)

    async def test_without_an_end_event_the_last_usage_total_counts(self):
        result = ExecResult(
            1,
            jsonl(
                {"type": "usage", "total": {"input_tokens": 10, "output_tokens": 2, "cached_tokens": 0}},
                {"type": "usage", "total": {"input_tokens": 30, "output_tokens": 5, "cached_tokens": 8}},
            ),
            "",
        )
        with self.assertRaises(NonZeroAgentExitCodeError):
            await self.run_agent(self.agent(), result)
        context = Context()
        aic_agent.AicAgent._fill_usage(context, aic_agent.usage_from_events(aic_agent.parse_json_lines(result.stdout)))
        self.assertEqual((context.n_input_tokens, context.n_output_tokens, context.n_cache_tokens), (30, 5, 8))

    def test_post_run_reads_the_host_logs(self):
        (self.logs_dir / "aic.jsonl").write_text(jsonl(end_event(usage=(700, 70, 600))))
        context = Context()
        self.agent().populate_context_post_run(context)
        self.assertEqual((context.n_input_tokens, context.n_output_tokens, context.n_cache_tokens), (700, 70, 600))

    def test_post_run_falls_back_to_the_trajectory_then_the_session(self):
        (self.logs_dir / "aic.jsonl").write_text('{"type": "start"}\n')
        (self.logs_dir / "aic.session").write_text(
            json.dumps({"usage": {"input_tokens": 9, "output_tokens": 3, "cached_tokens": 1, "billable_tokens": 11}})
        )
        context = Context()
        self.agent().populate_context_post_run(context)
        self.assertEqual((context.n_input_tokens, context.n_output_tokens, context.n_cache_tokens), (9, 3, 1))
        (self.logs_dir / "trajectory.json").write_text(
            json.dumps({"final_metrics": {"total_prompt_tokens": 40, "total_completion_tokens": 4}})
        )
        context = Context()
        self.agent().populate_context_post_run(context)
        self.assertEqual((context.n_input_tokens, context.n_output_tokens, context.n_cache_tokens), (40, 4, None))

    def test_post_run_keeps_what_run_recorded(self):
        (self.logs_dir / "aic.jsonl").write_text(jsonl(end_event(usage=(1, 1, 0))))
        context = Context()
        context.n_input_tokens, context.n_output_tokens = 500, 50
        self.agent().populate_context_post_run(context)
        self.assertEqual((context.n_input_tokens, context.n_output_tokens), (500, 50))


class ExitCodeTests(AgentTestCase):
    async def outcome(self, exit_code: int, status: str, **kwargs) -> tuple[BaseException | None, Context]:
        context = Context()
        environment = FakeEnvironment(rules=[(" aic-run ", run_output(exit_code, status))])
        try:
            await self.agent(**kwargs).run("task", environment, context)
        except BaseException as error:  # noqa: BLE001 - the tests look at which one
            self.assertEqual(len(environment.find("aic export")), 1)
            return error, context
        return None, context

    async def test_mapping(self):
        cases = [
            (0, "completed", None, None),
            (1, "failed", NonZeroAgentExitCodeError, "agent_error"),
            (2, "failed", AicUsageError, "usage_error"),
            (3, "step_limit", None, "step_limit"),
            (4, "needs_approval", AicNeedsApprovalError, "needs_approval"),
            (5, "token_budget", None, "token_budget"),
            (5, "time_budget", AgentTimeoutError, "time_budget"),
            (6, "unverified", None, "unverified"),
            (7, "stalled", None, "stalled"),
            (130, "interrupted", AicKilledError, "killed"),
            (143, "stopped", AicKilledError, "killed"),
            (137, "", AicKilledError, "killed"),
            (42, "", NonZeroAgentExitCodeError, "exit_42"),
        ]
        for exit_code, status, error, mode in cases:
            with self.subTest(exit_code=exit_code, status=status):
                raised, context = await self.outcome(exit_code, status)
                if error is None:
                    self.assertIsNone(raised)
                else:
                    self.assertIs(type(raised), error)
                    self.assertRegex(str(raised), rf"(code|exit) {exit_code}\b")
                self.assertEqual(context.metadata["aic_exit_code"], exit_code)
                self.assertEqual(context.metadata["aic_failure_mode"], mode)
                self.assertEqual(context.n_input_tokens, 1200)  # counted whatever the outcome

    async def test_incomplete_runs_can_be_made_errors(self):
        for exit_code, status in ((3, "step_limit"), (5, "token_budget"), (6, "unverified"), (7, "stalled")):
            with self.subTest(exit_code=exit_code):
                raised, _ = await self.outcome(exit_code, status, raise_on_incomplete="1")
                self.assertIsInstance(raised, AicIncompleteError)
        raised, _ = await self.outcome(0, "completed", raise_on_incomplete=True)
        self.assertIsNone(raised)

    async def test_verified_completion_is_recorded(self):
        result = run_output()
        result.stdout = result.stdout.replace('"verified": false', '"verified": true')
        _, context = await self.run_agent(self.agent(), result)
        self.assertIs(context.metadata["aic_verified"], True)
        self.assertEqual(context.metadata["aic_status"], "completed")


@unittest.skipUnless(aic_agent.HARBOR_AVAILABLE, "needs Harbor installed")
class WithHarborTests(AgentTestCase):
    """Only where Harbor is importable: its error classifier and its AgentContext."""

    async def test_harbor_classifies_stderr_not_command_output(self):
        from harbor.agents.installed.base import ApiRateLimitError
        from harbor.models.agent.context import AgentContext

        result = run_output(1, "failed")
        result.stdout = jsonl({"type": "command_result", "output": "API Error: rate limit"}) + result.stdout
        environment = FakeEnvironment(rules=[(" aic-run ", result)])
        with self.assertRaises(NonZeroAgentExitCodeError) as caught:
            await self.agent().run("task", environment, AgentContext())
        self.assertNotIsInstance(caught.exception, ApiRateLimitError)
        result.stderr = "error: 429 Too Many Requests (rate limit), retries ran out"
        context = AgentContext()
        with self.assertRaises(ApiRateLimitError):
            await self.agent().run("task", FakeEnvironment(rules=[(" aic-run ", result)]), context)
        self.assertEqual(context.n_input_tokens, 1200)
        self.assertEqual(context.metadata["aic_failure_mode"], "agent_error")


if __name__ == "__main__":
    unittest.main()
