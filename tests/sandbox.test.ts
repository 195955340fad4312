/**
 * End-to-end tests of the Landlock sandbox (README: "Sandbox (Linux)"): the compiled dist/aic, run headless with
 * --auto-approve against the fake OpenAI server, confines every command it runs (and everything
 * those commands start) to writes under the start directory, /tmp and /dev, while aic itself
 * keeps writing its own bookkeeping anywhere.
 *
 * Whether this kernel offers Landlock is decided here, independently of aic, with a raw
 * landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION) call. With Landlock the
 * "on" behaviour is tested; without it, that aic says the sandbox is off and why; the other describe
 * is reported as skipped.
 */
import { describe, expect, test } from "bun:test";
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { homedir } from "node:os";
import { join } from "node:path";
import type { FakeServer } from "./fake-openai.ts";
import {
  bash,
  has,
  headless,
  jsonLines,
  kernelLandlockAbi,
  messagesOf,
  perTestFixtures,
  runAic,
  sandboxLine,
  toolAnswer,
  unique,
} from "./helpers.ts";

const ABI = kernelLandlockAbi();
const HOME = homedir();

const fixtures = perTestFixtures();

/**
 * A start directory outside /tmp (under /var/tmp), so that "the cwd is writable" is proved on
 * its own and not through the /tmp rule.
 */
const startDir = (): string => fixtures.varTmp("aic-sbx-cwd-");

const systemPrompt = (srv: FakeServer): string => messagesOf(srv.requests[0])[0]?.content ?? "";
const exitCodeOf = (answer: string): number => Number(/exit code (-?\d+)/.exec(answer)?.[1] ?? NaN);

// Which of the two describes runs depends on the kernel; the other one is reported as skipped.
describe.skipIf(ABI < 1)(`sandbox on (kernel Landlock ABI ${ABI})`, () => {
  // Writes outside the cwd, /tmp and /dev are refused; the model sees the refusal; nothing is written.
  test("writing to $HOME or /var/tmp is refused with Permission denied, and the model is told", async () => {
    const inHome = fixtures.disposable(join(HOME, unique("aic-sbx-")));
    const inVarTmp = fixtures.disposable(join("/var/tmp", unique("aic-sbx-")));
    const victim = fixtures.disposable(join(HOME, unique("aic-sbx-keep-")));
    writeFileSync(victim, "keep me\n");
    const srv = fixtures.serve([
      bash(`echo x > ${inHome}`, "call_home"),
      bash(`echo x > ${inVarTmp}`, "call_vartmp"),
      bash(`rm -f ${victim}`, "call_rm"),
    ]);
    const cwd = startDir();
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "write outside"], { cwd });

    expect(run.code).toBe(0);
    for (const id of ["call_home", "call_vartmp", "call_rm"]) {
      const answer = toolAnswer(srv.requests.at(-1), id);
      expect(answer).toContain("Permission denied");
      expect(exitCodeOf(answer)).toBeGreaterThan(0);
    }
    expect(existsSync(inHome)).toBe(false);
    expect(existsSync(inVarTmp)).toBe(false);
    expect(readFileSync(victim, "utf8")).toBe("keep me\n");
  });

  // Writes under the start directory and /tmp still work.
  test("writing under the cwd and /tmp works", async () => {
    const cwd = startDir();
    const inTmp = fixtures.disposable(join("/tmp", unique("aic-sbx-")));
    const srv = fixtures.serve([
      bash("mkdir -p sub && echo cwd-ok > sub/in-cwd.txt && cat sub/in-cwd.txt", "call_cwd"),
      bash(`echo tmp-ok > ${inTmp} && cat ${inTmp}`, "call_tmp"),
    ]);
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "write inside"], { cwd });

    expect(run.code).toBe(0);
    expect(exitCodeOf(toolAnswer(srv.requests.at(-1), "call_cwd"))).toBe(0);
    expect(exitCodeOf(toolAnswer(srv.requests.at(-1), "call_tmp"))).toBe(0);
    expect(readFileSync(join(cwd, "sub", "in-cwd.txt"), "utf8")).toBe("cwd-ok\n");
    expect(readFileSync(inTmp, "utf8")).toBe("tmp-ok\n");
  });

  // Reads anywhere and the network stay untouched; PTYs (/dev, IOCTL_DEV) work inside the sandbox.
  // The PTY probe inside the sandbox is a python3 script; skipped without python3.
  test.skipIf(!has.python3)("reading /etc, loopback HTTP and PTYs work while confined", async () => {
    const srv = fixtures.serve([
      bash("cat /etc/hostname", "call_read"),
      bash('curl -s "$FAKE_URL/models"', "call_curl"),
      bash("script -qc 'echo inside-$((6*7))' /dev/null", "call_script"),
      bash(
        `python3 -c 'import pty,os; pid,fd=pty.fork(); pid or os.execlp("sh","sh","-c","echo pty-$((6*7))"); print(os.read(fd,100).decode().strip()); os.waitpid(pid,0)'`,
        "call_pty",
      ),
    ]);
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "read and talk"], {
      cwd: startDir(),
      env: { FAKE_URL: srv.url },
    });

    expect(run.code).toBe(0);
    const hostname = readFileSync("/etc/hostname", "utf8").trim();
    expect(hostname).not.toBe("");
    expect(toolAnswer(srv.requests.at(-1), "call_read")).toContain(hostname);
    expect(exitCodeOf(toolAnswer(srv.requests.at(-1), "call_read"))).toBe(0);
    expect(toolAnswer(srv.requests.at(-1), "call_curl")).toContain('"fake-model-mini"');
    expect(toolAnswer(srv.requests.at(-1), "call_script")).toContain("inside-42");
    expect(exitCodeOf(toolAnswer(srv.requests.at(-1), "call_script"))).toBe(0);
    expect(toolAnswer(srv.requests.at(-1), "call_pty")).toContain("pty-42");
    expect(exitCodeOf(toolAnswer(srv.requests.at(-1), "call_pty"))).toBe(0);
  });

  // The confinement is inherited by every process a command starts, even in a new session.
  test("grandchildren and setsid'd processes are confined too", async () => {
    const nested = fixtures.disposable(join(HOME, unique("aic-sbx-gc-")));
    const detached = fixtures.disposable(join(HOME, unique("aic-sbx-setsid-")));
    const srv = fixtures.serve([
      bash(`sh -c 'sh -c "echo x > ${nested}"'`, "call_nested"),
      bash(`setsid -w sh -c 'echo x > ${detached}'`, "call_setsid"),
    ]);
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "escape"], { cwd: startDir() });

    expect(run.code).toBe(0);
    for (const id of ["call_nested", "call_setsid"]) {
      expect(toolAnswer(srv.requests.at(-1), id)).toContain("Permission denied");
      expect(exitCodeOf(toolAnswer(srv.requests.at(-1), id))).toBeGreaterThan(0);
    }
    expect(existsSync(nested)).toBe(false);
    expect(existsSync(detached)).toBe(false);
  });

  // The status shows `Sandbox: on` and the system prompt states the writable paths.
  test("start line says Sandbox: on and the system prompt names the cwd and /tmp as writable", async () => {
    const cwd = startDir();
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "nothing"], { cwd });

    expect(run.code).toBe(0);
    expect(sandboxLine(run.stderr)).toStartWith("Sandbox: on");
    const paragraph = systemPrompt(srv)
      .split("\n\n")
      .find((p) => /sandbox/i.test(p));
    expect(paragraph).toBeDefined();
    expect(paragraph).not.toMatch(/no sandbox/i);
    expect(paragraph).toContain(cwd);
    expect(paragraph).toMatch(/\/tmp\b/);
  });

  // --disable-sandbox turns it off: the same $HOME write now succeeds and the status says why.
  test("--disable-sandbox lets a command write to $HOME and says Sandbox: off (--disable-sandbox)", async () => {
    const inHome = fixtures.disposable(join(HOME, unique("aic-sbx-")));
    const srv = fixtures.serve([bash(`echo free > ${inHome}`, "call_home")]);
    const run = await runAic(
      [...headless(srv.url, "test-model", "--auto-approve", "--disable-sandbox"), "write home"],
      {
        cwd: startDir(),
      },
    );

    expect(run.code).toBe(0);
    expect(exitCodeOf(toolAnswer(srv.requests.at(-1), "call_home"))).toBe(0);
    expect(readFileSync(inHome, "utf8")).toBe("free\n");
    expect(sandboxLine(run.stderr)).toBe("Sandbox: off (--disable-sandbox)");
    expect(systemPrompt(srv)).toMatch(/no sandbox/i);
  });

  // aic's own bookkeeping is not confined: a session file outside cwd and /tmp, and the debug dump.
  test("aic still writes its session file (outside cwd and /tmp) and the debug dump", async () => {
    const cwd = startDir();
    const session = fixtures.disposable(join("/var/tmp", `${unique("aic-sbx-sess-")}.json`));
    fixtures.disposable(`${session}.lock`);
    const marker = unique("marker-");
    const srv = fixtures.serve([bash(`echo ${marker}`, "call_echo"), { content: "Done. TASKCOMPLETE" }]);
    const run = await runAic(
      [...headless(srv.url, "test-model", "--auto-approve", "--session", session, "--debug"), "echo the marker"],
      {
        cwd,
      },
    );

    expect(run.code).toBe(0);
    expect(run.stderr).not.toMatch(/session.*(fail|error)|cannot (save|write)/i);
    expect(sandboxLine(run.stderr)).toStartWith("Sandbox: on");
    const saved = JSON.parse(readFileSync(session, "utf8"));
    const roles = saved.messages.map((m: any) => m.role);
    expect(roles).toEqual(["system", "user", "assistant", "tool", "assistant"]);
    expect(saved.messages[1].content).toBe("echo the marker");
    expect(saved.messages[3].tool_call_id).toBe("call_echo");
    expect(saved.messages[3].content).toContain(marker);
    const dump = readFileSync(join(cwd, "commander-debug.txt"), "utf8");
    expect(dump).toContain(marker);
  });

  // The JSON Lines start event carries the sandbox state.
  test("--json start event reports sandbox on", async () => {
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve", "--json"), "nothing"], {
      cwd: startDir(),
    });

    expect(run.code).toBe(0);
    const start = jsonLines(run.stdout).find((e) => e.type === "start");
    expect(start).toBeDefined();
    expect(start.sandbox.enabled).toBe(true);
    expect(start.sandbox.status).toStartWith("on");
  });
});

describe.skipIf(ABI >= 1)("sandbox off (kernel offers no Landlock)", () => {
  // Best effort — without Landlock aic runs unconfined and says so, with the reason.
  test("start line says Sandbox: off (reason) and the system prompt says there is no sandbox", async () => {
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "nothing"], { cwd: startDir() });

    expect(run.code).toBe(0);
    expect(sandboxLine(run.stderr)).toMatch(/^Sandbox: off \(.+\)$/);
    expect(systemPrompt(srv)).toMatch(/no sandbox/i);
  });

  // The JSON Lines start event carries the sandbox state.
  test("--json start event reports sandbox off", async () => {
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve", "--json"), "nothing"], {
      cwd: startDir(),
    });

    expect(run.code).toBe(0);
    const start = jsonLines(run.stdout).find((e) => e.type === "start");
    expect(start?.sandbox.enabled).toBe(false);
    expect(start?.sandbox.status).toMatch(/^off \(.+\)$/);
  });
});
