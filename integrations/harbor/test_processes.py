"""The adapter's shell side really run: processes, files and environments, with a stand-in for aic.

test_end_to_end.py's LocalEnvironment stands for the task's container (a temporary directory; commands run with
bash there, in a process group of their own; a cancelled exec kills only that group, as a killed `docker exec`
leaves the container's processes alone; --ae variables are laid over every exec as Harbor 0.22 does). aic is a
bash script installed the way a real binary is (binary_path, uploaded): it records its argv, its stdin and its
environment, starts what aic's commands would (a job in a session of its own, a double-forked daemon), then
either waits to be stopped or exits. Needs Linux (/proc) and bash; no Harbor, no aic binary, no network.

Run from this directory:  python3 -m unittest test_processes -v
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aic_agent  # noqa: E402
from aic_agent import AicAgent  # noqa: E402
from test_aic_agent import OLD_MARKER, Context, huge_instruction  # noqa: E402
from test_end_to_end import LocalEnvironment, rooted_agent  # noqa: E402

STAND_IN = r"""#!/bin/bash
# A stand-in for aic (see test_processes.py).
d=$AIC_FAKE_DIR
case "$1" in
  --version) echo "aic 9.9.9"; exit 0 ;;
  --help) echo "Options:"; echo "  --disable-sandbox  ..."; echo "  --keep-jobs  ..."; exit 0 ;;
  export) echo '{"schema_version": "ATIF-v1.7", "steps": []}'; exit 0 ;;
esac
printf '%s\n' "$@" > "$d/argv"
[ "${@: -1}" = - ] && cat > "$d/stdin"
env > "$d/env"
tr '\0' '\n' < /proc/$PPID/environ > "$d/parent-env"
echo $$ > "$d/aic.pid"
echo $$ >> "$d/all.pids"
# What aic's commands leave: a job in a session of its own, and a daemon (double fork, reparented away).
setsid sleep 600 < /dev/null > /dev/null 2>&1 &
echo $! > "$d/job.pid"
echo $! >> "$d/all.pids"
( setsid sleep 601 < /dev/null > /dev/null 2>&1 & echo $! > "$d/daemon.pid"; echo $! >> "$d/all.pids" )
echo '{"type": "start"}'
if [ "$AIC_FAKE_MODE" = exit ]; then
  echo '{"type": "end", "status": "completed", "exit_code": 0, "steps": 1, "usage": {"input_tokens": 3, "output_tokens": 2, "cached_tokens": 0}}'
  touch "$d/ready"
  exit 0
fi
touch "$d/ready"
exec sleep 602
"""


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def marked(marker: str) -> list[int]:
    """Every live process whose environment carries `marker` (NAME=VALUE)."""
    found = []
    needle = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0") and alive(int(entry)):
                found.append(int(entry))
        except OSError:
            continue
    return found


async def until(what: str, probe, timeout: float = 30.0):
    """Polls `probe` until it is truthy; the timeout only stops a hung test, naming `what`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := probe()):
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
    return value


class NoUploadLocalEnvironment(LocalEnvironment):
    upload_file = None  # type: ignore[assignment]


@unittest.skipUnless(
    sys.platform == "linux" and shutil.which("bash") and shutil.which("setsid"), "needs Linux, bash and setsid"
)
class ProcessTests(unittest.IsolatedAsyncioTestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="aic-harbor-proc-")
        base = Path(self._tmp.name).resolve()
        self.fake_dir = base / "fake"
        self.fake_dir.mkdir()
        self.stand_in = base / "stand-in-aic"
        self.stand_in.write_text(STAND_IN)
        self.stand_in.chmod(0o755)
        self.logs_dir = base / "host-logs"
        self.logs_dir.mkdir()
        self.environment = self.make_environment(LocalEnvironment, base / "container")

    def make_environment(self, cls, root: Path) -> LocalEnvironment:
        environment = cls(root)
        environment.base_env.update({"AIC_FAKE_DIR": str(self.fake_dir)})
        return environment

    def tearDown(self) -> None:
        # Whatever the stand-in started and a test left running (kept jobs), by pid.
        listed = self.fake_dir / "all.pids"
        for text in listed.read_text().split() if listed.exists() else ():
            if text.isdigit() and alive(int(text)):
                os.kill(int(text), signal.SIGKILL)
        self._tmp.cleanup()

    def agent(self, environment: LocalEnvironment | None = None, **kwargs) -> AicAgent:
        kwargs.setdefault("extra_env", {"OPENAI_API_KEY": "sk-openai-used"})
        return rooted_agent(
            environment or self.environment,
            logs_dir=self.logs_dir,
            model_name="openai/gpt-4.1",
            binary_path=str(self.stand_in),
            api_base="http://127.0.0.1:9/v1",
            **kwargs,
        )

    def pid(self, name: str) -> int:
        return int((self.fake_dir / name).read_text().strip())

    async def test_install_from_an_uploaded_binary(self):
        agent = self.agent()
        await agent.setup(self.environment)
        installed = self.environment.container(AicAgent.BINARY)
        self.assertEqual(installed.read_bytes(), self.stand_in.read_bytes())
        self.assertTrue(os.access(installed, os.X_OK))
        self.assertEqual(agent.version(), "9.9.9")
        self.assertIn("--keep-jobs", agent.aic_options)

    async def test_a_cancelled_run_leaves_no_process_of_the_run(self):
        agent = self.agent()
        await agent.install(self.environment)
        task = asyncio.ensure_future(agent.run("wait", self.environment, Context()))
        await until("the stand-in aic to start its jobs", lambda: (self.fake_dir / "ready").exists())
        started = [self.pid(n) for n in ("aic.pid", "job.pid", "daemon.pid")]
        self.assertTrue(all(alive(p) for p in started))
        marker = next(
            l for l in (self.fake_dir / "env").read_text().splitlines() if l.startswith(aic_agent.RUN_MARKER_ENV + "=")
        )
        # aic leads its own session and group, so the exec's own kill (its process group) cannot reach it.
        self.assertEqual(os.getsid(started[0]), started[0])

        task.cancel()  # what Harbor's asyncio.wait_for does at the agent's timeout
        with self.assertRaises(asyncio.CancelledError):
            await task
        self.assertEqual([p for p in started if alive(p)], [])
        self.assertEqual(marked(marker), [])
        self.assertIsNone(agent.last_stop_output)
        self.assertTrue((self.environment.container("/logs/agent") / "trajectory.json").exists())

    async def test_a_completed_run_leaves_the_jobs_it_kept(self):
        self.environment.base_env["AIC_FAKE_MODE"] = "exit"
        agent = self.agent()
        await agent.install(self.environment)
        context = Context()
        await agent.run("start a server", self.environment, context)
        self.assertEqual(context.metadata["aic_exit_code"], 0)
        self.assertIn("--keep-jobs", (self.fake_dir / "argv").read_text().splitlines())
        self.assertFalse(alive(self.pid("aic.pid")))
        # The graders expect what the agent started to be running: a run that returned keeps it.
        self.assertTrue(alive(self.pid("job.pid")))
        self.assertTrue(alive(self.pid("daemon.pid")))

    async def test_keys_other_than_aics_are_not_visible(self):
        secrets = {
            "OPENAI_API_KEY": "sk-openai-used",
            "ANTHROPIC_API_KEY": "sk-ant-other",
            "GEMINI_API_KEY": "gem-other",
            "FIREWORKS_AI_API_KEY": "fw-other",
            "ACME_API_KEY": "acme-other",
        }
        # As Harbor's Trial does: the agent's --ae variables are laid over every exec of the agent phase.
        self.environment.scoped_env.update(secrets)
        self.environment.base_env["AIC_FAKE_MODE"] = "exit"
        agent = self.agent(extra_env=dict(secrets))
        await agent.install(self.environment)
        await agent.run("show env", self.environment, Context())
        env = dict(l.split("=", 1) for l in (self.fake_dir / "env").read_text().splitlines() if "=" in l)
        self.assertEqual(env.get("AIC_API_KEY"), "sk-openai-used")
        for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "FIREWORKS_AI_API_KEY", "ACME_API_KEY"):
            self.assertNotIn(name, env)
        # Nor in the shell that waits for aic, whose /proc/<pid>/environ a command could read.
        parent = (self.fake_dir / "parent-env").read_text()
        for value in secrets.values():
            self.assertNotIn(value, parent)
        self.assertEqual(list(self.environment.container("/tmp").glob("aic-harbor-*")), [])  # settings file removed
        self.assertNotIn("sk-openai-used", (self.fake_dir / "argv").read_text())

    async def test_a_huge_instruction_reaches_aic_byte_exact_and_runs_nothing(self):
        instruction = huge_instruction()
        self.assertGreater(len(instruction.encode()), 64 * 1024)
        self.assertIn(OLD_MARKER, instruction.splitlines())
        for cls in (LocalEnvironment, NoUploadLocalEnvironment):
            with self.subTest(environment=cls.__name__):
                root = Path(self._tmp.name) / f"container-{cls.__name__}"
                environment = self.make_environment(cls, root)
                environment.base_env["AIC_FAKE_MODE"] = "exit"
                agent = self.agent(environment)
                await agent.install(self.make_environment(LocalEnvironment, root))  # the same container
                (self.fake_dir / "stdin").unlink(missing_ok=True)
                await agent.run(instruction, environment, Context())
                self.assertEqual((self.fake_dir / "stdin").read_bytes(), instruction.encode("utf-8"))
                for owned in ("/tmp/aic-owned", "/tmp/aic-owned2"):
                    self.assertFalse(Path(owned).exists(), f"the instruction ran a command: {owned}")
                    self.assertFalse(environment.container(owned).exists())


@unittest.skipUnless(
    shutil.which("bash") and shutil.which("curl") and shutil.which("sha256sum"), "needs bash, curl, sha256sum"
)
class ChecksumTests(unittest.TestCase):
    """The install_url route's fetch script, run for real on a file:// URL."""

    def test_the_checksum_is_verified(self):
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "aic-linux-x64"
            source.write_bytes(b"release bytes")
            digest = hashlib.sha256(source.read_bytes()).hexdigest()

            def fetch(want: str) -> subprocess.CompletedProcess:
                out = Path(tmp) / "out"
                return subprocess.run(
                    ["bash", "-c", aic_agent._FETCH_SCRIPT, "fetch", source.as_uri(), str(out), want],
                    capture_output=True,
                    text=True,
                )

            ok = fetch(digest)
            self.assertEqual(ok.returncode, 0, ok.stderr)
            self.assertEqual((Path(tmp) / "out").read_bytes(), b"release bytes")
            bad = fetch("0" * 64)
            self.assertNotEqual(bad.returncode, 0)
            self.assertIn(digest, bad.stderr)
            self.assertFalse((Path(tmp) / "out").exists())


if __name__ == "__main__":
    unittest.main()
