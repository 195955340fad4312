"""End to end: the adapter drives the real aic binary in a local stand-in for the task's container.

Skipped unless two variables are set (tests/harbor.test.ts sets them, against its fake OpenAI server):

    AIC_E2E_BINARY=/path/to/dist/aic  AIC_E2E_API_BASE=http://127.0.0.1:PORT/v1  python3 -m unittest -v

Optional: AIC_E2E_USAGE="prompt,completion,cached", the token totals the server reported over the run (asserted
equal to the context's counts); AIC_E2E_KEEP=DIR, where the logs Harbor would get back (trajectory.json, aic.jsonl,
aic.session, aic.stderr.txt) and the context (context.json) are copied for the caller to inspect.

The container is a temporary directory: every path the adapter uses in it (/usr/local/bin/aic, /logs/agent) is
re-rooted there, commands really run with bash in it (cwd /app, HOME /root, XDG directories, all under it), uploads
are file copies into it, and nothing outside it is written but AIC_E2E_KEEP.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import unittest
from pathlib import Path, PurePosixPath

sys.path.insert(0, str(Path(__file__).resolve().parent))

from aic_agent import AicAgent  # noqa: E402
from test_aic_agent import Context, ExecResult  # noqa: E402

BINARY_VAR, API_BASE_VAR, USAGE_VAR, KEEP_VAR = "AIC_E2E_BINARY", "AIC_E2E_API_BASE", "AIC_E2E_USAGE", "AIC_E2E_KEEP"
INSTRUCTION = "Write a greeting to greeting.txt, then show it."
API_KEY = "sk-aic-e2e-test"


def host_environment(root: Path) -> dict[str, str]:
    """What a command in the stand-in container starts with: this process's environment without its model
    settings (a container has none of the host's AIC_* or OPENAI_* variables; the marker AIC_TEST_RUN of
    tests/helpers.ts stays, so a test run can find what it started), and a home of its own under `root`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k == "AIC_TEST_RUN" or not (k.startswith(("AIC_", "OPENAI_")) or k.startswith("XDG_"))
    }
    for name, sub in (
        ("HOME", "root"),
        ("XDG_STATE_HOME", "root/.local/state"),
        ("XDG_CONFIG_HOME", "root/.config"),
        ("XDG_CACHE_HOME", "root/.cache"),
    ):
        path = root / sub
        path.mkdir(parents=True, exist_ok=True)
        env[name] = str(path)
    return env


class LocalEnvironment:
    """FakeEnvironment's interface (exec, upload_file), really carried out: bash runs each command in a process
    group of its own, in `root`/app by default; an upload copies the file with its mode (as `docker cp` does).
    `container(path)` is where a container path lives under `root`. Paths outside `root` are refused, as a
    container could not reach them either.

    As in Harbor 0.22, `scoped_env` (Trial's overlay of the agent's --ae variables) reaches every command and wins
    over the exec's own `env`; a cancelled exec kills its own process group only, as a killed `docker exec` leaves
    what runs inside the container alone."""

    default_user = None

    def __init__(self, root: Path) -> None:
        self.root = root
        self.workdir = self.container("/app")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.base_env = host_environment(root)
        self.scoped_env: dict[str, str] = {}
        self.commands: list[tuple[str, int]] = []

    def container(self, path: str) -> Path:
        return self.root / PurePosixPath(path).relative_to("/")

    def _inside(self, path: Path | str) -> Path:
        resolved = Path(path).resolve()
        if not resolved.is_relative_to(self.root.resolve()):
            raise AssertionError(f"{path} is outside the environment's root {self.root}")
        return resolved

    async def exec(self, command, cwd=None, env=None, timeout_sec=None, user=None) -> ExecResult:
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            command,
            cwd=self._inside(cwd) if cwd else self.workdir,
            env={**self.base_env, **(env or {}), **self.scoped_env},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout_sec)
        except BaseException:  # the exec's time limit, or the caller cancelled it: nothing may outlive the exec
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
            raise
        self.commands.append((command, proc.returncode))
        return ExecResult(proc.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace"))

    async def upload_file(self, source_path, target_path) -> None:
        target = self._inside(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source_path, target)


def rooted_agent(environment: LocalEnvironment, **kwargs) -> AicAgent:
    """The adapter as Harbor runs it, with its container paths moved under the environment's root."""
    agent = AicAgent(**kwargs)
    agent.BINARY = str(environment.container(AicAgent.BINARY))
    agent.SCRATCH_DIR = str(environment.container(AicAgent.SCRATCH_DIR))
    environment.container(AicAgent.SCRATCH_DIR).mkdir(parents=True, exist_ok=True)
    # Harbor's own attribute for the logs directory inside the environment (default /logs/agent).
    agent.environment_logs_dir = PurePosixPath(environment.container("/logs/agent"))
    return agent


def tokens(context: Context) -> tuple:
    return context.n_input_tokens, context.n_output_tokens, context.n_cache_tokens


@unittest.skipUnless(
    os.environ.get(BINARY_VAR) and os.environ.get(API_BASE_VAR),
    f"needs {BINARY_VAR} (a built dist/aic) and {API_BASE_VAR} (a fake OpenAI server); tests/harbor.test.ts sets them",
)
class EndToEndTests(unittest.IsolatedAsyncioTestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="aic-harbor-e2e-")
        base = Path(self._tmp.name).resolve()
        self.environment = LocalEnvironment(base / "container")
        self.logs_dir = base / "host-logs"  # the trial's agent/ directory on the host
        self.logs_dir.mkdir()

    def tearDown(self) -> None:
        self._tmp.cleanup()

    async def test_a_completed_run_installs_runs_exports_and_counts(self):
        environment = self.environment
        agent = rooted_agent(
            environment,
            logs_dir=self.logs_dir,
            model_name="openai/test-model",
            extra_env={"AIC_API_KEY": API_KEY},
            binary_path=os.environ[BINARY_VAR],
            api_base=os.environ[API_BASE_VAR],
        )

        await agent.install(environment)
        installed = environment.container("/usr/local/bin/aic")
        self.assertTrue(os.access(installed, os.X_OK), "install() left no executable aic")
        self.assertTrue(any(c.endswith(f"{installed} --version") and rc == 0 for c, rc in environment.commands))
        self.assertIn("--disable-sandbox", agent.aic_options or ())  # install() read the options aic has

        context = Context()
        try:
            await agent.run(INSTRUCTION, environment, context)  # a completed run raises nothing
        finally:
            # Harbor copies the environment's logs directory back to the trial's, then asks for the context.
            if environment.container("/logs/agent").is_dir():
                shutil.copytree(environment.container("/logs/agent"), self.logs_dir, dirs_exist_ok=True)
            agent.populate_context_post_run(context)
            self.keep(context)

        self.assertEqual(agent.last_exit_code, 0)
        self.assertEqual(context.metadata["aic_exit_code"], 0)
        self.assertEqual(context.metadata["aic_status"], "completed")
        self.assertIsNone(context.metadata["aic_failure_mode"])
        self.assertIsInstance(context.metadata["aic_steps"], int)
        self.assertGreater(context.metadata["aic_steps"], 0)

        # Token counts: what the server reported over the run, from the end event of the run's output; the
        # same again from the host copies of the logs alone (a run Harbor cut short has only those).
        self.assertIsNotNone(context.n_input_tokens)
        if expected := os.environ.get(USAGE_VAR):
            self.assertEqual(tokens(context), tuple(int(n) for n in expected.split(",")))
        from_logs = Context()
        agent.populate_context_post_run(from_logs)
        self.assertEqual(tokens(from_logs), tokens(context))
        self.assertIsNone(context.cost_usd)

        # The files Harbor gets back, the trajectory an ATIF document whose totals are the context's.
        for name in (agent.EVENTS_FILE, agent.STDERR_FILE, agent.SESSION_FILE, agent.TRAJECTORY_FILE):
            self.assertTrue((self.logs_dir / name).is_file(), f"{name} is missing from the logs")
        self.assertFalse((self.logs_dir / (agent.TRAJECTORY_FILE + ".part")).exists())
        trajectory = json.loads((self.logs_dir / agent.TRAJECTORY_FILE).read_text())
        self.assertTrue(str(trajectory.get("schema_version")).startswith("ATIF-v1"), trajectory.get("schema_version"))
        self.assertEqual(trajectory["agent"]["name"], "aic")
        self.assertEqual(trajectory["agent"]["model_name"], "test-model")
        metrics = trajectory["final_metrics"]
        self.assertEqual(
            (metrics["total_prompt_tokens"], metrics["total_completion_tokens"], metrics["total_cached_tokens"]),
            tokens(context),
        )
        self.assertIn(INSTRUCTION, [step.get("message") for step in trajectory["steps"]])

    def keep(self, context: Context) -> None:
        """Copies the logs and the context to $AIC_E2E_KEEP, when set, for the caller to inspect."""
        keep = os.environ.get(KEEP_VAR)
        if not keep:
            return
        shutil.copytree(self.logs_dir, keep, dirs_exist_ok=True)
        fields = ("n_input_tokens", "n_output_tokens", "n_cache_tokens", "cost_usd", "metadata")
        (Path(keep) / "context.json").write_text(json.dumps({f: getattr(context, f) for f in fields}, indent=2))


if __name__ == "__main__":
    unittest.main()
