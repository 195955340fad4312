"""Unit tests of the Harbor adapter for aic, with a fake environment (no Harbor, no container).

Run from this directory:  python3 -m unittest -v
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shlex
import sys
import tempfile
import unittest
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

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
class FakeEnvironment:
    """Records every exec and upload; answers each exec with the first canned rule whose needle it contains."""

    rules: list[tuple[str, ExecResult | Callable[[], ExecResult]]] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    uploads: list[tuple[Path, str]] = field(default_factory=list)

    async def exec(self, command, cwd=None, env=None, timeout_sec=None, user=None):
        self.calls.append(Call(command, user, env, timeout_sec, cwd))
        for needle, answer in self.rules:
            if needle in command:
                return answer() if callable(answer) else answer
        return ExecResult()

    async def upload_file(self, source_path, target_path):
        self.uploads.append((Path(source_path), str(target_path)))

    def find(self, needle: str) -> list[Call]:
        return [c for c in self.calls if needle in c.command]


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

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def agent(self, model="openai/gpt-4.1", extra_env=None, **kwargs) -> AicAgent:
        env = {"OPENAI_API_KEY": "sk-test"} if extra_env is None else extra_env
        return AicAgent(logs_dir=self.logs_dir, model_name=model, extra_env=env, **kwargs)

    async def run_agent(self, agent: AicAgent, result: ExecResult, instruction="fix the tests") -> tuple:
        environment = FakeEnvironment(rules=[("--nogui", result)])
        context = Context()
        await agent.run(instruction, environment, context)
        return environment, context


class ImportTests(unittest.TestCase):
    def test_imports_with_or_without_harbor(self):
        self.assertEqual(aic_agent.HARBOR_AVAILABLE, importlib.util.find_spec("harbor") is not None)
        self.assertEqual(AicAgent.name(), "aic")
        self.assertTrue(AicAgent.SUPPORTS_ATIF)
        self.assertTrue(issubclass(AicUsageError, NonZeroAgentExitCodeError))
        self.assertTrue(issubclass(AgentTimeoutError, TimeoutError))


class InstallTests(AgentTestCase):
    async def test_npm_is_the_default_and_pins_the_version(self):
        environment = FakeEnvironment()
        await self.agent(version="0.1.0").install(environment)
        (npm,) = environment.find("npm install -g")
        self.assertIn("npm install -g aic@0.1.0", npm.command)
        self.assertEqual(npm.user, "root")
        self.assertTrue(environment.calls[-1].command.endswith("/usr/local/bin/aic --version"))

    async def test_npm_package_can_be_renamed(self):
        environment = FakeEnvironment()
        await self.agent(extra_env={"AIC_NPM_PACKAGE": "@acme/aic", "OPENAI_API_KEY": "k"}).install(environment)
        self.assertIn("npm install -g @acme/aic ", environment.find("npm install")[0].command)

    async def test_release_url_from_the_environment(self):
        environment = FakeEnvironment()
        url = "https://example.com/releases/aic-linux-x64"
        await self.agent(extra_env={"AIC_INSTALL_URL": url}).install(environment)
        (download,) = environment.find("curl -fsSL")
        self.assertIn(f"curl -fsSL --retry 3 -o /usr/local/bin/aic.part {url}", download.command)
        self.assertIn("install -m 755 /usr/local/bin/aic.part /usr/local/bin/aic", download.command)
        self.assertEqual(download.user, "root")
        self.assertEqual(environment.find("npm install"), [])

    async def test_release_tarball_is_unpacked(self):
        environment = FakeEnvironment()
        await self.agent(install_url="https://example.com/aic.tar.gz").install(environment)
        (download,) = environment.find("curl -fsSL")
        self.assertIn("tar -xz", download.command)
        self.assertIn("-name aic", download.command)

    async def test_host_binary_is_uploaded(self):
        environment = FakeEnvironment()
        await self.agent(binary_path="/opt/aic/dist/aic").install(environment)
        self.assertEqual(environment.uploads, [(Path("/opt/aic/dist/aic"), "/usr/local/bin/aic")])
        self.assertEqual(environment.find("curl -fsSL") + environment.find("npm install"), [])
        self.assertIn("chmod 755 /usr/local/bin/aic", environment.calls[0].command)

    async def test_failed_install_raises(self):
        environment = FakeEnvironment(rules=[("npm install", ExecResult(1, "", "E404 Not Found"))])
        with self.assertRaises(NonZeroAgentExitCodeError):
            await self.agent().install(environment)

    def test_version_is_parsed(self):
        self.assertEqual(self.agent().parse_version("aic 0.1.0\n"), "0.1.0")


class CommandTests(AgentTestCase):
    async def test_run_and_export_commands(self):
        environment, _ = await self.run_agent(self.agent(), run_output(), instruction="say 'hi' & $(rm -rf /)")
        run, export = environment.calls
        self.assertIn(
            "aic --nogui --auto-approve --json --session /logs/agent/aic.session --no-checkpoints -- ", run.command
        )
        self.assertIn("-- " + shlex.quote("say 'hi' & $(rm -rf /)") + " < /dev/null", run.command)
        self.assertIn("2> /logs/agent/aic.stderr.txt | tee /logs/agent/aic.jsonl", run.command)
        self.assertTrue(run.command.startswith("set -o pipefail;"))
        self.assertIsNone(run.user)  # Harbor's default (agent) user
        self.assertIn(
            "aic export --format atif --session /logs/agent/aic.session > /logs/agent/trajectory.json.part",
            export.command,
        )
        self.assertIn("mv /logs/agent/trajectory.json.part /logs/agent/trajectory.json", export.command)

    async def test_endpoint_and_key_go_in_the_environment_not_argv(self):
        environment, _ = await self.run_agent(self.agent(), run_output())
        run = environment.calls[0]
        self.assertEqual(run.env["AIC_MODEL"], "gpt-4.1")
        self.assertEqual(run.env["AIC_API_BASE"], "https://api.openai.com/v1")
        self.assertEqual(run.env["AIC_API_KEY"], "sk-test")
        self.assertNotIn("sk-test", run.command)

    def test_provider_prefixes(self):
        env = self.agent("openrouter/anthropic/claude-sonnet-4", extra_env={"OPENROUTER_API_KEY": "or"})
        self.assertEqual(
            env.resolve_endpoint(),
            {
                "AIC_MODEL": "anthropic/claude-sonnet-4",
                "AIC_API_BASE": "https://openrouter.ai/api/v1",
                "AIC_API_KEY": "or",
            },
        )
        local = self.agent("hosted_vllm/qwen3", extra_env={"AIC_API_BASE": "http://10.0.0.2:8000/v1"})
        self.assertEqual(local.resolve_endpoint(), {"AIC_MODEL": "qwen3", "AIC_API_BASE": "http://10.0.0.2:8000/v1"})
        kept = self.agent("hosted_vllm/qwen3", extra_env={"AIC_API_BASE": "http://h/v1"}, keep_provider_prefix="true")
        self.assertEqual(kept.resolve_endpoint()["AIC_MODEL"], "hosted_vllm/qwen3")
        with self.assertRaisesRegex(ValueError, "AIC_API_BASE"):
            self.agent("hosted_vllm/qwen3", extra_env={}).resolve_endpoint()
        with self.assertRaisesRegex(ValueError, "model"):
            self.agent(None, extra_env={}).resolve_endpoint()

    async def test_options_become_flags(self):
        agent = self.agent(
            max_steps="50",
            max_tokens=2_000_000,
            done_when="pytest -q",
            reasoning_effort="high",
            command_timeout_sec=300,
            checkpoints=True,
            disable_sandbox="true",
            extra_args="--compress-alg truncate",
        )
        environment, _ = await self.run_agent(agent, run_output())
        command = environment.calls[0].command
        for flag in (
            "--max-steps 50",
            "--max-tokens 2000000",
            "--done-when 'pytest -q'",
            "--reasoning-effort high",
            "--timeout 300",
            "--disable-sandbox",
            "--compress-alg truncate",
        ):
            self.assertIn(flag, command)
        self.assertNotIn("--no-checkpoints", command)

    async def test_a_huge_instruction_goes_through_stdin(self):
        instruction = "x" * (aic_agent.MAX_ARGV_INSTRUCTION_BYTES + 1)
        environment, _ = await self.run_agent(self.agent(), run_output(), instruction=instruction)
        write, run, _export = environment.calls
        self.assertIn("cat > /logs/agent/aic.instruction.txt <<'AIC_INSTRUCTION_EOF_7f3c'", write.command)
        self.assertIn(instruction, write.command)
        self.assertIn(" - < /logs/agent/aic.instruction.txt ", run.command)
        self.assertNotIn(instruction, run.command)


class TimeoutTests(AgentTestCase):
    async def command_and_timeout(self, **kwargs) -> tuple[str, Any]:
        environment, _ = await self.run_agent(self.agent(**kwargs), run_output())
        return environment.calls[0].command, environment.calls[0].timeout_sec

    async def test_harbor_timeout_leaves_a_margin(self):
        command, timeout = await self.command_and_timeout(agent_timeout_sec=900)
        self.assertIn("--max-time 855 ", command)  # 5 % of 900 s kept for saving and exporting
        self.assertEqual(timeout, 900)

    async def test_margin_is_at_least_10_and_at_most_120_seconds(self):
        self.assertEqual(self.agent(agent_timeout_sec="60").max_time_sec(), 50)
        self.assertEqual(self.agent(agent_timeout_sec=7200).max_time_sec(), 7080)
        self.assertEqual(self.agent(agent_timeout_sec=5).max_time_sec(), 1)

    async def test_explicit_max_time_wins(self):
        command, timeout = await self.command_and_timeout(agent_timeout_sec=900, max_time_sec=100)
        self.assertIn("--max-time 100 ", command)
        self.assertEqual(timeout, 900)

    async def test_max_time_from_the_environment(self):
        command, timeout = await self.command_and_timeout(extra_env={"AIC_MAX_TIME": "300", "OPENAI_API_KEY": "k"})
        self.assertIn("--max-time 300 ", command)
        self.assertEqual(timeout, 360)

    async def test_no_timeout_known_means_no_flag(self):
        command, timeout = await self.command_and_timeout()
        self.assertNotIn("--max-time", command)
        self.assertIsNone(timeout)

    def test_bad_timeouts_are_refused(self):
        with self.assertRaises(ValueError):
            self.agent(max_time_sec="ten")
        with self.assertRaises(ValueError):
            self.agent(agent_timeout_sec=0)

    async def test_export_runs_when_harbor_cancels_the_run(self):
        def cancelled() -> ExecResult:
            raise asyncio.CancelledError()

        environment = FakeEnvironment(rules=[("--nogui", cancelled)])
        with self.assertRaises(asyncio.CancelledError):
            await self.agent(agent_timeout_sec=60).run("task", environment, Context())
        self.assertEqual(len(environment.find("aic export --format atif")), 1)

    async def test_a_failing_export_does_not_hide_the_outcome(self):
        environment = FakeEnvironment(rules=[("--nogui", run_output()), ("aic export", ExecResult(1, "", "bad"))])
        context = Context()
        await self.agent().run("task", environment, context)
        self.assertEqual(context.metadata["aic_failure_mode"], None)


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
        environment = FakeEnvironment(rules=[("--nogui", run_output(exit_code, status))])
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
        environment = FakeEnvironment(rules=[("--nogui", result)])
        with self.assertRaises(NonZeroAgentExitCodeError) as caught:
            await self.agent().run("task", environment, AgentContext())
        self.assertNotIsInstance(caught.exception, ApiRateLimitError)
        result.stderr = "error: 429 Too Many Requests (rate limit), retries ran out"
        context = AgentContext()
        with self.assertRaises(ApiRateLimitError):
            await self.agent().run("task", FakeEnvironment(rules=[("--nogui", result)]), context)
        self.assertEqual(context.n_input_tokens, 1200)
        self.assertEqual(context.metadata["aic_failure_mode"], "agent_error")


if __name__ == "__main__":
    unittest.main()
