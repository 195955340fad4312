/**
 * The Harbor adapter (integrations/harbor/aic_agent.py) in a real container, as a Harbor trial drives it.
 *
 * A private dockerd (tests/docker.ts; only with AIC_TEST_DOCKER=1) runs a bookworm container with Docker's
 * default seccomp profile, started as Harbor starts task containers (`docker run -d --network host IMAGE
 * sleep infinity`, so it reaches the fake model server on the host's loopback). A small Harbor environment on
 * `docker exec` / `docker cp` (integrations/harbor/docker_env_for_tests.py) carries the adapter's calls, and that
 * file's driver runs the trial's phases: setup (install uploads dist/aic from the host), run (the instruction,
 * with the agent's --ae variables laid over every exec as Harbor's Trial does), the logs copied back,
 * populate_context_post_run. It writes what it saw to a JSON file that this test reads.
 *
 * - A completed run: aic is installed (same bytes, mode 755, --version and --help answered), the model's commands
 *   ran in the container (files only the container has), the context's token counts are the server's, the
 *   exported trajectory passes the ATIF schema and has per-step timestamps and per-step metrics (the server's
 *   usage of each turn), and the server the model started with `&` still answers a curl from `docker exec` after
 *   aic ended (--keep-jobs, the adapter's default).
 * - A cancelled run (the asyncio task cancelled while the model's command sleeps): the adapter's stop exec runs,
 *   and `ps -ef` in the container shows no aic, no command and none of the daemons the command left (setsid,
 *   nohup), only zombies: Harbor's PID 1, `sleep infinity`, reaps nothing.
 *
 * The image adds procps (`ps`) and curl to tests/docker.ts's base image with apt in a throwaway container; the
 * .deb files apt fetched are kept under /var/tmp/aic-test-images/ and installed with dpkg by later runs, which then
 * need no network.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import {
  copyFileSync,
  chmodSync,
  existsSync,
  mkdirSync,
  readFileSync,
  readdirSync,
  rmSync,
  statSync,
  writeFileSync,
} from "node:fs";
import { join } from "node:path";
import { createHash } from "node:crypto";
import { isIsoTimestamp, validateAtif } from "./atif.ts";
import { dockerSkipReason, startTestDocker, type TestDocker } from "./docker.ts";
import { AIC, ROOT, bash, has, perTestFixtures, runCommand, scratch, unique, waitFor } from "./helpers.ts";

const fixtures = perTestFixtures();

const DRIVER = join(ROOT, "integrations", "harbor", "docker_env_for_tests.py");
const IMAGE = "aic-test-harbor";
const DEB_CACHE = "/var/tmp/aic-test-images";
const DEB_KIND = "bookworm-harbor-debs-procps+curl";
const CACHE_DAYS = 30;
const API_KEY = "sk-aic-harbor-docker-7d41";
const OTHER_KEY = "sk-other-provider-c9e2"; // an --ae key aic does not use: unset before aic starts

const why = dockerSkipReason() ?? (has.python3 ? undefined : "needs python3 for the adapter");

/** The docker client tests/docker.ts uses. */
const dockerClient = () => (existsSync("/usr/bin/docker") ? "/usr/bin/docker" : (Bun.which("docker") ?? "docker"));

/** A port nothing listens on now, on the loopback the container shares. */
function freePort(): number {
  const socket = Bun.listen({ hostname: "127.0.0.1", port: 0, socket: { data() {} } });
  const port = socket.port;
  socket.stop(true);
  return port;
}

/** The newest cached directory of .deb files for the image, if it is recent. */
function cachedDebs(): string | undefined {
  if (!existsSync(DEB_CACHE)) return undefined;
  const dirs = readdirSync(DEB_CACHE)
    .filter((n) => n.startsWith(`${DEB_KIND}-`))
    .sort()
    .reverse()
    .map((n) => join(DEB_CACHE, n));
  return dirs.find(
    (d) => Date.now() - statSync(d).mtimeMs < CACHE_DAYS * 86_400_000 && readdirSync(d).some((f) => f.endsWith(".deb")),
  );
}

/** Makes IMAGE: the base image with procps and curl, from cached .deb files or else with apt (network). */
async function harborImage(engine: TestDocker): Promise<{ reused: boolean; ms: number }> {
  const began = Date.now();
  const prep = unique("aic-harbor-prep-");
  const debs = cachedDebs();
  const created = await engine.docker([
    "create",
    "--network",
    "host",
    "--name",
    prep,
    engine.image,
    "sleep",
    "infinity",
  ]);
  if (created.code !== 0) throw new Error(`docker create: ${created.stderr}`);
  try {
    if (debs) {
      const cp = await engine.docker(["cp", `${debs}/.`, `${prep}:/var/tmp/debs`]);
      if (cp.code !== 0) throw new Error(`docker cp of the cached debs: ${cp.stderr}`);
    }
    if ((await engine.docker(["start", prep])).code !== 0) throw new Error("docker start of the prep container");
    const script = debs
      ? "dpkg -i /var/tmp/debs/*.deb && rm -rf /var/tmp/debs"
      : `set -e; cd /var/cache/apt/archives; ls *.deb > /tmp/before 2>/dev/null || :
         apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends procps curl
         mkdir -p /var/tmp/new-debs; for f in *.deb; do grep -qxF "$f" /tmp/before || cp "$f" /var/tmp/new-debs/; done`;
    const made = await engine.docker(["exec", prep, "sh", "-c", script], { timeoutMs: 300_000 });
    if (made.code !== 0)
      throw new Error(`installing procps and curl in the image failed:\n${made.stdout}${made.stderr}`);
    if (!debs) {
      const date = new Date().toISOString().slice(0, 10).replaceAll("-", "");
      const target = join(DEB_CACHE, `${DEB_KIND}-${date}`);
      const partial = `${target}.part-${process.pid}`;
      mkdirSync(partial, { recursive: true });
      const out = await engine.docker(["cp", `${prep}:/var/tmp/new-debs/.`, partial]);
      if (out.code === 0 && !existsSync(target)) Bun.spawnSync(["mv", partial, target]);
      rmSync(partial, { recursive: true, force: true });
      await engine.docker(["exec", prep, "rm", "-rf", "/var/tmp/new-debs"]);
    }
    await engine.docker(["stop", "-t", "0", prep]);
    const commit = await engine.docker(["commit", prep, IMAGE]);
    if (commit.code !== 0) throw new Error(`docker commit: ${commit.stderr}`);
  } finally {
    await engine.docker(["rm", "-f", prep]);
  }
  return { reused: !!debs, ms: Date.now() - began };
}

interface DriverResult {
  scenario: string;
  timings_ms: Record<string, number>;
  setup_error: { type: string; text: string } | null;
  version: string | null;
  aic_options: string[];
  cancelled: boolean;
  error: { type: string; text: string } | null;
  exit_code: number | null;
  end_event: any;
  stop_output: string | null;
  context: {
    n_input_tokens: number | null;
    n_output_tokens: number | null;
    n_cache_tokens: number | null;
    cost_usd: null;
    metadata: any;
  };
  execs: { command: string; user: string | null; return_code: number | "cancelled" | null; ms: number }[];
}

// A little shared state for the tests below: the engine, and one container per test.
let engine: TestDocker | undefined;
const containers: string[] = [];

/** Starts a task container as Harbor does: detached, on the host's network, PID 1 `sleep infinity`. */
async function startContainer(): Promise<string> {
  const name = unique("aic-harbor-");
  const started = await engine!.docker(["run", "-d", "--network", "host", "--name", name, IMAGE, "sleep", "infinity"]);
  if (started.code !== 0) throw new Error(`docker run: ${started.stderr}`);
  containers.push(name);
  return name;
}

async function inContainer(name: string, script: string): Promise<{ code: number; out: string }> {
  const r = await engine!.docker(["exec", name, "bash", "-c", script]);
  return { code: r.code, out: r.stdout + r.stderr };
}

/** Runs the driver on `spec`; what it wrote, and the trial's agent/ directory on the host. */
async function drive(
  container: string,
  spec: Record<string, unknown>,
): Promise<{ result: DriverResult; logs: string }> {
  const dir = scratch("aic-harbor-docker-");
  const logs = join(dir, "agent");
  const specFile = join(dir, "spec.json");
  const resultFile = join(dir, "result.json");
  writeFileSync(
    specFile,
    JSON.stringify({ docker: dockerClient(), host: engine!.host, container, logs_dir: logs, ...spec }, null, 2),
  );
  const run = await runCommand(["python3", DRIVER, specFile, resultFile], {
    cwd: dir,
    env: { DOCKER_CONFIG: scratch("aic-harbor-docker-config-"), DOCKER_HOST: engine!.host },
    killAfterMs: 280_000,
  });
  if (run.code !== 0 || !existsSync(resultFile))
    throw new Error(`the driver failed (${run.code}):\n${run.stdout}\n${run.stderr.slice(-4000)}`);
  return { result: JSON.parse(readFileSync(resultFile, "utf8")), logs };
}

const shown = (result: DriverResult, logs: string) =>
  JSON.stringify(
    { ...result, execs: result.execs.map((e) => `${e.return_code} ${e.ms}ms ${e.command.slice(0, 120)}`) },
    null,
    1,
  ) +
  (existsSync(join(logs, "aic.stderr.txt"))
    ? `\n--- aic.stderr.txt ---\n${readFileSync(join(logs, "aic.stderr.txt"), "utf8").slice(-3000)}`
    : "");

const TURN_USAGE = [
  { prompt_tokens: 1200, completion_tokens: 30, cached_tokens: 0 },
  { prompt_tokens: 1300, completion_tokens: 25, cached_tokens: 1024 },
  { prompt_tokens: 1400, completion_tokens: 12, cached_tokens: 1024 },
];
const total = (key: keyof (typeof TURN_USAGE)[number]) => TURN_USAGE.reduce((sum, u) => sum + u[key], 0);

describe.skipIf(why !== undefined)(`Harbor adapter in a Docker container${why ? ` (${why})` : ""}`, () => {
  beforeAll(async () => {
    const started = await startTestDocker();
    if ("skip" in started) throw new Error(started.skip);
    engine = started;
    console.log(
      `harbor-docker: dockerd up in ${engine.timings.daemonMs} ms; base tarball ${engine.tarball.reused ? "reused" : `made by debootstrap in ${engine.timings.debootstrapMs} ms`}; import ${engine.timings.importMs} ms`,
    );
    const image = await harborImage(engine);
    console.log(
      `harbor-docker: ${IMAGE} (procps, curl) made in ${image.ms} ms from ${image.reused ? "cached debs" : "apt"}`,
    );
  }, 1_200_000);

  afterAll(async () => {
    const began = Date.now();
    for (const name of containers.splice(0)) await engine?.docker(["rm", "-f", name]);
    const removed = Date.now();
    await engine?.stop();
    if (engine)
      console.log(
        `harbor-docker: containers removed in ${removed - began} ms, dockerd stopped in ${Date.now() - removed} ms`,
      );
  }, 120_000);

  test("a completed trial: installed from the host, commands run in the container, the server's tokens, a valid trajectory, a kept server", async () => {
    const port = freePort();
    const PROOF =
      "mkdir -p /app/out && echo made-in-container > /app/out/proof.txt && tr '\\0' ' ' < /proc/1/cmdline > /app/out/pid1.txt";
    const SERVE = `python3 -m http.server ${port} --bind 127.0.0.1 --directory /app/out > /app/server.log 2>&1 &`;
    const srv = fixtures.serve([
      { ...bash(PROOF, "call_proof"), usage: TURN_USAGE[0] },
      { ...bash(SERVE, "call_serve"), usage: TURN_USAGE[1] },
      { content: "The proof is served. TASKCOMPLETE", usage: TURN_USAGE[2] },
    ]);
    // The binary as a user hands it over, never the file another build may replace meanwhile.
    const bin = join(scratch("aic-harbor-bin-"), "aic");
    copyFileSync(AIC, bin);
    chmodSync(bin, 0o755);
    const container = await startContainer();

    // Docker's default seccomp profile is the one in force: filter mode, and the namespaces it refuses.
    const info = await engine!.docker(["info", "--format", "{{json .SecurityOptions}}"]);
    expect(info.stdout).toMatch(/name=seccomp,profile=(default|builtin)/);
    const inspect = await engine!.docker(["inspect", "--format", "{{json .HostConfig.SecurityOpt}}", container]);
    expect(inspect.stdout.trim()).toBe("null");
    const confinement = await inContainer(
      container,
      "grep '^Seccomp:' /proc/self/status; unshare --user true 2>/dev/null; echo unshare=$?",
    );
    expect(confinement.out).toMatch(/Seccomp:\s+2/);
    expect(confinement.out).toMatch(/unshare=[1-9]/);

    const { result, logs } = await drive(container, {
      scenario: "complete",
      model_name: "openai/test-model",
      extra_env: { AIC_API_KEY: API_KEY, OPENAI_API_KEY: OTHER_KEY },
      agent: { binary_path: bin, api_base: srv.url, agent_timeout_sec: 240 },
      instruction: "Write the proof files, then serve /app/out on the loopback.",
    });
    const why = shown(result, logs);
    console.log(`harbor-docker: completed trial: ${JSON.stringify(result.timings_ms)}`);

    // Installed: the uploaded bytes at /usr/local/bin/aic, executable, answering --version and --help.
    expect(result.setup_error, why).toBeNull();
    const host = createHash("sha256").update(readFileSync(bin)).digest("hex");
    const installed = await inContainer(
      container,
      "sha256sum /usr/local/bin/aic | cut -d' ' -f1; stat -c %a /usr/local/bin/aic",
    );
    expect(installed.out.trim().split("\n")).toEqual([host, "755"]);
    const hostVersion = await runCommand([bin, "--version"]);
    expect(hostVersion.stdout).toContain(result.version!);
    expect(result.aic_options).toContain("--keep-jobs");

    // A completed run: nothing raised, exit 0.
    expect(result.error, why).toBeNull();
    expect(result.exit_code, why).toBe(0);
    expect(result.context.metadata).toMatchObject({
      aic_exit_code: 0,
      aic_status: "completed",
      aic_failure_mode: null,
    });

    // The commands ran in the container: the files are there (and PID 1 there is Harbor's sleep), not on the host.
    const proof = await inContainer(container, "cat /app/out/proof.txt /app/out/pid1.txt");
    expect(proof.out).toBe("made-in-container\nsleep infinity ");
    expect(existsSync("/app/out/pid1.txt")).toBe(false);

    // The server saw the model and the key the adapter passed; the trial's tokens are the server's.
    expect(srv.requests).toHaveLength(TURN_USAGE.length);
    expect(srv.requests[0]!.body.model).toBe("test-model");
    expect(srv.requests[0]!.headers.authorization).toBe(`Bearer ${API_KEY}`);
    expect(result.context).toMatchObject({
      n_input_tokens: total("prompt_tokens"),
      n_output_tokens: total("completion_tokens"),
      n_cache_tokens: total("cached_tokens"),
      cost_usd: null,
    });

    // The trajectory Harbor gets back: valid ATIF, a timestamp on every user and agent step (in order), each
    // agent step's metrics the usage the server reported for that turn, the totals the context's.
    const trajectory = JSON.parse(readFileSync(join(logs, "trajectory.json"), "utf8"));
    expect(validateAtif(trajectory)).toEqual([]);
    const steps: any[] = trajectory.steps;
    const timed = steps.filter((s) => s.source !== "system");
    expect(timed.length).toBeGreaterThanOrEqual(1 + TURN_USAGE.length);
    for (const step of timed) expect(isIsoTimestamp(step.timestamp), JSON.stringify(step)).toBe(true);
    const times = timed.map((s) => Date.parse(s.timestamp));
    expect(times).toEqual([...times].sort((a, b) => a - b));
    const agentSteps = steps.filter((s) => s.source === "agent");
    expect(agentSteps.map((s) => s.metrics)).toEqual(
      TURN_USAGE.map((u) =>
        expect.objectContaining({
          prompt_tokens: u.prompt_tokens,
          completion_tokens: u.completion_tokens,
          cached_tokens: u.cached_tokens,
        }),
      ),
    );
    expect(trajectory.final_metrics).toMatchObject({
      total_prompt_tokens: total("prompt_tokens"),
      total_completion_tokens: total("completion_tokens"),
      total_cached_tokens: total("cached_tokens"),
    });
    const commands = agentSteps.flatMap((s) => (s.tool_calls ?? []).map((c: any) => c.arguments.command));
    expect(commands).toEqual([PROOF, SERVE]);

    // --keep-jobs: aic has ended, the server it kept answers from inside the container.
    const aicPid = Number(readFileSync(join(logs, "aic.pid"), "utf8").trim());
    const aicState = await inContainer(container, `ps -o stat= -p ${aicPid} || echo gone`);
    expect(aicState.out.trim()).toMatch(/^(Z.*|gone)$/);
    expect(result.end_event.kept.map((k: any) => k.command)).toEqual([SERVE.replace(/ > .*$/, "")]);
    const served = await waitFor(
      "the kept server to answer curl in the container",
      async () => {
        const r = await inContainer(container, `curl -fsS http://127.0.0.1:${port}/proof.txt`);
        return r.code === 0 && r.out;
      },
      20_000,
    );
    expect(served).toBe("made-in-container\n");
  }, 300_000);

  test("a cancelled trial leaves no aic, no command and no daemon of the run in the container", async () => {
    const COMMAND =
      "(setsid sleep 9101 > /dev/null 2>&1 &); nohup sleep 9102 > /dev/null 2>&1 & touch /app/started; sleep 9100; echo never";
    const srv = fixtures.serve([{ ...bash(COMMAND, "call_wait"), usage: TURN_USAGE[0] }]);
    const bin = join(scratch("aic-harbor-bin-"), "aic");
    copyFileSync(AIC, bin);
    chmodSync(bin, 0o755);
    const container = await startContainer();

    const { result, logs } = await drive(container, {
      scenario: "cancel",
      cancel_when: "test -e /app/started && ps -C 'sleep' -o args= | grep -qx 'sleep 9100'",
      model_name: "openai/test-model",
      extra_env: { AIC_API_KEY: API_KEY },
      agent: { binary_path: bin, api_base: srv.url, agent_timeout_sec: 240 },
      instruction: "Wait for a long time.",
    });
    const why = shown(result, logs);
    console.log(`harbor-docker: cancelled trial: ${JSON.stringify(result.timings_ms)}`);
    expect(result.setup_error, why).toBeNull();
    expect(result.cancelled, why).toBe(true);
    expect(result.error, why).toBeNull();
    expect(srv.requests).toHaveLength(1);

    // The run's exec was the one cancelled; the stop exec (as root) ran after it and ended well, then the export.
    const runIndex = result.execs.findIndex((e) => e.command.includes("exec bash -c"));
    expect(result.execs[runIndex]?.return_code, why).toBe("cancelled");
    const after = result.execs.slice(runIndex + 1).filter((e) => !e.command.startsWith("test -e"));
    // Each begins by unsetting the keys Harbor lays over every exec, so nothing the run left can read them there.
    const kind = (c: string) =>
      c.includes("exec bash -c 'pg=") ? "stop" : c.includes(" export --format atif ") ? "export" : c.slice(0, 80);
    expect(
      after.map((e) => [kind(e.command), e.command.startsWith("unset "), e.user, e.return_code]),
      why,
    ).toEqual([
      ["stop", true, "root", 0],
      ["export", true, null, 0],
    ]);
    expect(result.stop_output).toBeNull();

    // Nothing of the run is alive: ps -ef lists only PID 1, ps itself, and zombies PID 1 never reaps.
    const ps = await inContainer(container, "ps -ef");
    console.log(`harbor-docker: ps -ef after the cancel:\n${ps.out.trimEnd()}`);
    const live = ps.out
      .trimEnd()
      .split("\n")
      .slice(1)
      .filter((line) => !line.endsWith("<defunct>"));
    expect(live.map((line) => line.replace(/^(\S+\s+){7}/, ""))).toEqual(["sleep infinity", "ps -ef"]);
    expect(ps.out).not.toMatch(/sleep 91\d\d/);

    // What the run spent, from the logs alone (no end event: aic was stopped), and a trajectory that still validates.
    expect(result.context).toMatchObject({
      n_input_tokens: TURN_USAGE[0]!.prompt_tokens,
      n_output_tokens: TURN_USAGE[0]!.completion_tokens,
    });
    const trajectory = JSON.parse(readFileSync(join(logs, "trajectory.json"), "utf8"));
    expect(validateAtif(trajectory)).toEqual([]);
  }, 300_000);
});
