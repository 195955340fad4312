"""A Docker container as a Harbor environment, and a driver that runs the adapter in it as a Harbor trial would.

For tests/harbor-docker.test.ts (and by hand). The container is one the caller started, as
``docker run -d --network host IMAGE sleep infinity``; this file never starts or removes containers.

``DockerExecEnvironment`` does what Harbor 0.22's DockerEnvironment does for the calls the adapter
makes, on plain ``docker exec`` / ``docker cp`` instead of ``docker compose``:

* ``exec(command, cwd, env, timeout_sec, user)``: ``docker exec [-w cwd] [-e K=V ...] [-u user] C bash -c
  command``, stdin from /dev/null, stderr folded into stdout (Harbor reads both through one pipe, so
  ``stderr`` is None). The environment's variables, then the exec's ``env``, then the ``scoped_exec_env``
  overlays (Trial puts the agent's ``--ae`` variables there for the setup and run phases) win in that
  order. At ``timeout_sec`` the client is killed and RuntimeError raised, as Harbor does. A cancelled exec
  kills the ``docker exec`` client; like a killed ``docker exec``, that leaves what runs inside the
  container alone, which is what the adapter's stop step is for.
* ``upload_file`` / ``upload_dir`` / ``download_file`` / ``download_dir``: ``docker cp``, as Harbor does.

Driver: ``python3 docker_env_for_tests.py SPEC.json RESULT.json``. SPEC holds:

    docker, host            the docker client and the engine's -H address
    container               the running container's name
    scenario                "complete": setup, run, logs back, populate_context_post_run
                            "cancel":   setup, run as a task, cancelled once `cancel_when` (a shell test run
                                        in the container) holds, then the same
    agent                   keyword arguments for AicAgent (binary_path, api_base, agent_timeout_sec, ...)
    model_name, extra_env   as Harbor passes them (extra_env is also laid over every exec, as Trial does)
    instruction             the instruction (or instruction_b64: its UTF-8 bytes in base64, for NUL bytes)
    logs_dir                the trial's agent/ directory on the host, where /logs/agent is copied back
    no_upload               true: an environment without upload_file (the adapter's base64 route)
    workdir                 the exec's default cwd (default /app, made by the driver)

RESULT gets what the test asserts on: the context, the outcome (error type and text), the adapter's view
(exit code, options, version, stop output) and each exec with its time.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from aic_agent import AicAgent  # noqa: E402


@dataclass
class ExecResult:
    """Harbor's ExecResult."""

    stdout: str | None = None
    stderr: str | None = None
    return_code: int = 0


class Context:
    """The fields of Harbor's AgentContext that the adapter fills."""

    def __init__(self) -> None:
        self.n_input_tokens = None
        self.n_cache_tokens = None
        self.n_output_tokens = None
        self.cost_usd = None
        self.metadata = None

    def as_dict(self) -> dict[str, Any]:
        fields = ("n_input_tokens", "n_cache_tokens", "n_output_tokens", "cost_usd", "metadata")
        return {f: getattr(self, f) for f in fields}


class DockerExecEnvironment:
    """The calls the adapter makes of a Harbor environment, on `docker exec` and `docker cp` (see the module's text)."""

    def __init__(
        self,
        container: str,
        docker: str = "docker",
        host: str | None = None,
        workdir: str | None = "/app",
        default_user: str | int | None = None,
        persistent_env: dict[str, str] | None = None,
    ) -> None:
        self.container = container
        self._client = [docker, *(["-H", host] if host else [])]
        self.workdir = workdir
        self.default_user = default_user
        self._persistent_env = dict(persistent_env or {})
        self._overlays: contextvars.ContextVar[tuple[dict[str, str], ...]] = contextvars.ContextVar(
            "overlays", default=()
        )
        self.log: list[dict[str, Any]] = []  # every exec: command, user, return code, ms

    @contextlib.contextmanager
    def scoped_exec_env(self, env: dict[str, str] | None):
        """Harbor's overlay: `env` reaches every exec made in this task while the block runs, and wins."""
        if not env:
            yield
            return
        token = self._overlays.set((*self._overlays.get(), dict(env)))
        try:
            yield
        finally:
            self._overlays.reset(token)

    def _merged_env(self, env: dict[str, str] | None) -> dict[str, str]:
        merged = {**self._persistent_env, **(env or {})}
        for overlay in self._overlays.get():
            merged.update(overlay)
        return merged

    async def _client_run(self, args: list[str], timeout_sec: float | None = None) -> tuple[int, bytes]:
        proc = await asyncio.create_subprocess_exec(
            *self._client,
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout_sec)
        except BaseException as exc:  # its time limit, or a cancellation: the client goes, the container's processes stay
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            await proc.wait()
            if isinstance(exc, asyncio.TimeoutError):
                raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from None
            raise
        return proc.returncode or 0, out or b""

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        args = ["exec"]
        if cwd or self.workdir:
            args += ["-w", str(cwd or self.workdir)]
        for key, value in self._merged_env(env).items():
            args += ["-e", f"{key}={value}"]
        user = self.default_user if user is None else user
        if user is not None:
            args += ["-u", str(user)]
        args += [self.container, "bash", "-c", command]
        began = time.monotonic()
        entry: dict[str, Any] = {"command": command[:2000], "user": user, "return_code": None}
        self.log.append(entry)
        try:
            code, out = await self._client_run(args, timeout_sec)
        except asyncio.CancelledError:
            entry["return_code"] = "cancelled"
            raise
        finally:
            entry["ms"] = round((time.monotonic() - began) * 1000)
        entry["return_code"] = code
        return ExecResult(stdout=out.decode(errors="replace") or None, stderr=None, return_code=code)

    async def _cp(self, source: str, target: str) -> None:
        code, out = await self._client_run(["cp", source, target])
        if code != 0:
            raise RuntimeError(f"docker cp {source} {target} failed ({code}): {out.decode(errors='replace')}")

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        await self._cp(str(source_path), f"{self.container}:{target_path}")

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await self._cp(f"{source_dir}/.", f"{self.container}:{target_dir}")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        await self._cp(f"{self.container}:{source_path}", str(target_path))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        Path(target_dir).mkdir(parents=True, exist_ok=True)
        await self._cp(f"{self.container}:{source_dir}/.", str(target_dir))


class WithoutUpload:
    """The same environment with no upload_file (for the instruction): the adapter then writes it in base64 lines."""

    def __init__(self, inner: DockerExecEnvironment) -> None:
        self._inner = inner
        self.default_user = inner.default_user
        self.exec = inner.exec


def _error(exc: BaseException | None) -> dict[str, Any] | None:
    if exc is None:
        return None
    return {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "text": str(exc)[-4000:]}


async def drive(spec: dict[str, Any]) -> dict[str, Any]:
    env = DockerExecEnvironment(
        spec["container"], docker=spec.get("docker", "docker"), host=spec.get("host"), workdir=spec.get("workdir", "/app")
    )
    logs_dir = Path(spec["logs_dir"])
    logs_dir.mkdir(parents=True, exist_ok=True)
    extra_env = dict(spec.get("extra_env") or {})
    agent = AicAgent(logs_dir=logs_dir, model_name=spec.get("model_name"), extra_env=extra_env, **spec.get("agent", {}))
    if "instruction_b64" in spec:
        instruction = base64.b64decode(spec["instruction_b64"]).decode("utf-8")
    else:
        instruction = spec["instruction"]
    result: dict[str, Any] = {"scenario": spec["scenario"], "timings_ms": {}}
    timings = result["timings_ms"]

    # What Harbor's compose file gives every task container: the logs directories and the workdir.
    made = await env.exec(
        "mkdir -p /logs/agent /logs/verifier " + (spec.get("workdir") or "/app"), cwd="/", user="root"
    )
    assert made.return_code == 0, made.stdout

    began = time.monotonic()
    setup_error = None
    with env.scoped_exec_env(agent.extra_env):  # Trial lays the agent's --ae variables over its setup...
        try:
            await agent.setup(env)
        except Exception as exc:  # noqa: BLE001 - reported
            setup_error = exc
    timings["setup"] = round((time.monotonic() - began) * 1000)
    result["setup_error"] = _error(setup_error)
    result["version"] = agent.version()
    result["aic_options"] = sorted(agent.aic_options or ())
    if setup_error is not None:
        result["execs"] = env.log
        return result

    context = Context()
    run_env: Any = WithoutUpload(env) if spec.get("no_upload") else env
    outcome: BaseException | None = None
    cancelled = False
    began = cancel_at = time.monotonic()
    with env.scoped_exec_env(agent.extra_env):  # ...and its run
        task = asyncio.ensure_future(agent.run(instruction, run_env, context))
        try:
            if spec["scenario"] == "cancel":
                probe = spec["cancel_when"]
                while not task.done():  # polls the container, as a person watching it would
                    done, _ = await asyncio.wait({task}, timeout=0.1)
                    if done:
                        break
                    if (await env.exec(probe)).return_code == 0:
                        timings["until_cancel"] = round((time.monotonic() - began) * 1000)
                        cancel_at = time.monotonic()
                        task.cancel()
                        break
            await task
        except asyncio.CancelledError:
            cancelled = True
            timings["cancel_to_return"] = round((time.monotonic() - cancel_at) * 1000)
        except Exception as exc:  # noqa: BLE001 - reported: what Harbor would record as the trial's exception
            outcome = exc
    timings["run"] = round((time.monotonic() - began) * 1000)

    # Harbor copies the environment's logs back to the trial's directory, then asks for the context.
    try:
        await env.download_dir("/logs/agent", logs_dir)
    except RuntimeError as exc:
        result["download_error"] = str(exc)
    agent.populate_context_post_run(context)

    result.update(
        {
            "cancelled": cancelled,
            "error": _error(outcome),
            "exit_code": agent.last_exit_code,
            "end_event": agent.last_end_event,
            "stop_output": agent.last_stop_output,
            "context": context.as_dict(),
            "execs": env.log,
        }
    )
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: docker_env_for_tests.py SPEC.json RESULT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[1]).read_text())
    result = asyncio.run(drive(spec))
    Path(argv[2]).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
