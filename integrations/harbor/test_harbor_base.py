"""The adapter driven through Harbor's real base class (harbor.agents.installed.base.BaseInstalledAgent, 0.22).

Harbor cannot be pip-installed here: it needs Python >= 3.12, every compiled wheel the machine's package index
has is for 3.11, and it lacks litellm, shortuuid and dirhash. Harbor's agent base class, its environment base
class and its models do import on 3.11 with small shims, installed by `install_shims()` below:

* `typing.override` (3.12) is typing_extensions' and `typing.TypedDict` is typing_extensions' (pydantic refuses
  typing's on Python < 3.12);
* the `harbor` package is created without running its `__init__.py`, which reads the installed distribution's
  metadata (there is none for a source checkout);
* `shortuuid` and `dirhash`, imported by models the base class pulls in, are stubs (no test uses them).

So this test needs a Harbor 0.22 source checkout and a Python 3.11 with Harbor's pure-Python dependencies:

    python3 -m venv /tmp/harbor-venv
    /tmp/harbor-venv/bin/pip install pydantic jinja2 pyyaml rich typer toml tenacity python-dotenv \\
        requests packaging filelock platformdirs httpx pathspec
    AIC_HARBOR_SRC=/path/to/harbor AIC_HARBOR_PYTHON=/tmp/harbor-venv/bin/python python3 -m unittest test_harbor_base

Without AIC_HARBOR_SRC it is skipped, saying so. With it, a child process (its own interpreter, so the shims
never touch the other tests) imports Harbor, checks that aic_agent then builds on Harbor's classes, and runs
test_aic_agent.py's whole suite plus the cases below against them; it writes a JSON result file that this
process reads.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import os
import subprocess
import sys
import tempfile
import types
import unittest
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC_VAR, PYTHON_VAR = "AIC_HARBOR_SRC", "AIC_HARBOR_PYTHON"


def harbor_src() -> Path | None:
    """The `src` directory of the Harbor checkout named by $AIC_HARBOR_SRC (the checkout or its src/)."""
    root = os.environ.get(SRC_VAR)
    if not root:
        return None
    for candidate in (Path(root), Path(root) / "src"):
        if (candidate / "harbor" / "agents" / "installed" / "base.py").is_file():
            return candidate
    return None


def install_shims(src: Path) -> None:
    import typing

    import typing_extensions

    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    if sys.version_info < (3, 12):
        typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
    package = types.ModuleType("harbor")
    package.__path__ = [str(src / "harbor")]
    package.__spec__ = importlib.machinery.ModuleSpec("harbor", None, is_package=True)
    package.__spec__.submodule_search_locations = package.__path__
    package.__version__ = "0.22.0"
    sys.modules["harbor"] = package
    for name in ("shortuuid", "dirhash"):
        try:
            importlib.import_module(name)
        except ImportError:
            stub = types.ModuleType(name)
            if name == "shortuuid":

                class ShortUUID:
                    def __init__(self, alphabet: str | None = None) -> None:
                        pass

                    def random(self, length: int = 22) -> str:
                        return uuid.uuid4().hex[:length]

                stub.ShortUUID = ShortUUID  # type: ignore[attr-defined]
                stub.uuid = lambda *a, **k: uuid.uuid4().hex  # type: ignore[attr-defined]
            else:
                stub.dirhash = lambda *a, **k: "0" * 64  # type: ignore[attr-defined]
            sys.modules[name] = stub


@unittest.skipUnless(
    harbor_src(),
    "Harbor is not importable here (Harbor 0.22 needs Python >= 3.12; this machine's wheel index has 3.11 wheels "
    f"only, and no litellm, shortuuid, dirhash): set {SRC_VAR} to a Harbor 0.22 checkout and {PYTHON_VAR} to a 3.11 "
    "Python with its pure dependencies to run the adapter through Harbor's real base class (see this file)",
)
class HarborBaseClassTests(unittest.TestCase):
    def test_the_adapter_runs_on_harbors_own_base_class(self):
        python = os.environ.get(PYTHON_VAR) or sys.executable
        with tempfile.TemporaryDirectory() as tmp:
            result_file = Path(tmp) / "result.json"
            child = subprocess.run(
                [python, str(Path(__file__).resolve()), "--child", str(result_file)],
                cwd=HERE,
                env={**os.environ, SRC_VAR: str(harbor_src())},
                capture_output=True,
                text=True,
                timeout=300,
            )
            self.assertTrue(result_file.exists(), f"the child wrote no result:\n{child.stdout}\n{child.stderr[-4000:]}")
            report = json.loads(result_file.read_text())
        self.assertEqual(report["failures"] + report["errors"], [], child.stderr[-4000:])
        self.assertEqual(report["skipped"], {})
        self.assertGreaterEqual(report["ran"], 50)
        self.assertTrue(report["harbor_base"])
        self.assertEqual(child.returncode, 0)


# --------------------------------------------------------------------------------------------------------------
# The child: Harbor imported for real.


def child_cases():
    import aic_agent
    from harbor.agents.installed.base import BaseInstalledAgent, NonZeroAgentExitCodeError
    from harbor.environments.base import BaseEnvironment
    from harbor.models.agent.context import AgentContext
    from test_aic_agent import AgentTestCase, ExecResult, FakeEnvironment, run_output, run_params

    class RealBaseCases(AgentTestCase):
        def test_aic_agent_builds_on_harbors_classes(self):
            self.assertTrue(aic_agent.HARBOR_AVAILABLE)
            self.assertTrue(issubclass(aic_agent.AicAgent, BaseInstalledAgent))
            self.assertIs(aic_agent.NonZeroAgentExitCodeError, NonZeroAgentExitCodeError)
            self.assertEqual(aic_agent.AicAgent.import_path(), "aic_agent:AicAgent")

        async def test_constructed_as_harbors_factory_does(self):
            # AgentFactory.create_agent_from_import_path: logs_dir, model_name, extra_env, logger, then --ak kwargs.
            binary = self.logs_dir / "aic"
            binary.write_bytes(b"fake")
            agent = aic_agent.AicAgent(
                logs_dir=self.logs_dir,
                model_name="fireworks_ai/accounts/fireworks/models/kimi-k2",
                extra_env={"FIREWORKS_AI_API_KEY": "fw", "ANTHROPIC_API_KEY": "an"},
                agent_timeout_sec=900,
                binary_path=str(binary),
                disable_sandbox=True,
            )
            info = agent.to_agent_info()
            self.assertEqual((info.name, info.model_info.provider), ("aic", "fireworks_ai"))
            connection = agent.resolve_connection()
            self.assertEqual((connection.api_key, connection.key_env), ("fw", "FIREWORKS_AI_API_KEY"))
            environment = FakeEnvironment(rules=[("--version", ExecResult(0, "aic 0.1.0\n", ""))])
            await agent.setup(environment)  # Harbor's own setup(): install(), then the version
            self.assertEqual(agent.version(), "0.1.0")
            self.assertTrue(any(c.command.startswith("set -o pipefail; chmod 755") for c in environment.calls))
            environment.rules.insert(0, (" aic-run ", run_output()))
            context = AgentContext()
            await agent.run("do it", environment, context)
            self.assertEqual(context.n_input_tokens, 1200)
            self.assertEqual(run_params(environment.run_call().command)["argv"][-1], "-")

        async def test_harbors_prompt_template_renders_the_instruction(self):
            template = self.logs_dir / "prompt.j2"
            template.write_text("Task:\n{{ instruction }}\n(answer briefly)")
            agent = self.agent(prompt_template_path=template)
            environment, _ = await self.run_agent(agent, run_output(), instruction="fix it")
            (upload,) = [u for u in environment.uploads if u.target.endswith("aic.instruction.txt")]
            self.assertEqual(upload.data.decode(), "Task:\nfix it\n(answer briefly)")

        async def test_install_failures_are_harbors_errors(self):
            environment = FakeEnvironment(
                rules=[("npm install", ExecResult(1, "", "curl: (6) Could not resolve host"))]
            )
            with self.assertRaises(NonZeroAgentExitCodeError) as caught:
                await self.agent(npm_package="aic").install(environment)
            self.assertEqual(type(caught.exception).__name__, "NetworkConnectionError")

        def test_scoped_env_wins_over_the_execs_own(self):
            # The premise of hiding keys in the command itself: Harbor lays the agent's --ae variables (Trial's
            # scoped_exec_env) over each exec's env, so the adapter cannot override them through `env`.
            import contextvars

            stub = types.SimpleNamespace(_persistent_env={}, _exec_env_overlays=contextvars.ContextVar("o", default=()))
            with BaseEnvironment.scoped_exec_env(stub, {"OPENAI_API_KEY": "from-ae"}):
                merged = BaseEnvironment._merge_env(stub, {"OPENAI_API_KEY": "", "NO_COLOR": "1"})
            self.assertEqual(merged, {"OPENAI_API_KEY": "from-ae", "NO_COLOR": "1"})

    return RealBaseCases


def child_main(result_file: Path) -> int:
    src = harbor_src()
    report: dict = {"ran": 0, "failures": [], "errors": [], "skipped": {}, "harbor_base": False}
    try:
        if src is None:
            raise RuntimeError(f"{SRC_VAR} names no Harbor checkout")
        install_shims(src)
        importlib.import_module("harbor.agents.installed.base")
        sys.path.insert(0, str(HERE))
        import aic_agent

        report["harbor_base"] = aic_agent.HARBOR_AVAILABLE
        import test_aic_agent

        from run_tests import RecordingResult

        suite = unittest.TestSuite(
            [
                unittest.defaultTestLoader.loadTestsFromModule(test_aic_agent),
                unittest.defaultTestLoader.loadTestsFromTestCase(child_cases()),
            ]
        )
        result = unittest.TextTestRunner(verbosity=2, resultclass=RecordingResult).run(suite)
        report.update(
            ran=result.testsRun,
            failures=[t.id() + "\n" + tb for t, tb in result.failures],
            errors=[getattr(t, "id", lambda: str(t))() + "\n" + tb for t, tb in result.errors],
            skipped={t.id(): reason for t, reason in result.skipped},
        )
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        report["errors"].append("child setup\n" + "".join(traceback.format_exception(exc)))
    result_file.write_text(json.dumps(report, indent=2))
    return 0 if not report["failures"] and not report["errors"] and report["ran"] else 1


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--child":
    sys.exit(child_main(Path(sys.argv[2])))
elif __name__ == "__main__":
    unittest.main()
