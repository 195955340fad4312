/**
 * The sandbox launcher (README: "Sandbox (Linux)"): with the sandbox on, one confined helper process starts
 * every command. These tests show that commands are still confined when it is, that it holds no secret, that a
 * command which kills it gets a fresh one (still confined) instead of an unconfined shell, and that aic refuses
 * what a launcher taken over by a command might say.
 */
import { describe, expect, test } from "bun:test";
import { chmodSync, existsSync } from "node:fs";
import { homedir } from "node:os";
import { join } from "node:path";
import { SandboxLauncher } from "../aic.ts";
import {
  AIC,
  ROOT,
  bash,
  has,
  headless,
  kernelLandlockAbi,
  perTestFixtures,
  runAic,
  runCommand,
  scratch,
  toolAnswer,
  unique,
} from "./helpers.ts";

const ABI = kernelLandlockAbi();
const fixtures = perTestFixtures();

/** What a command prints about the process that started it: its pid, its command line, its NoNewPrivs flag. */
const PARENT_REPORT = [
  `echo "parent=$PPID"; tr '\\0' ' ' < /proc/$PPID/cmdline; echo; grep NoNewPrivs /proc/$PPID/status`,
  // Every thread of the launcher, not only its main one, was born after the restriction.
  `echo "threads=$(ls /proc/$PPID/task | wc -l) unconfined=$(grep -L 'NoNewPrivs:.*1' /proc/$PPID/task/*/status | wc -l)"`,
].join("; ");

describe.skipIf(ABI < 1)(`the sandbox launcher (kernel Landlock ABI ${ABI})`, () => {
  test("every command is started by one confined launcher", async () => {
    const srv = fixtures.serve([
      bash(PARENT_REPORT, "call_1"),
      bash(PARENT_REPORT, "call_2"),
      { content: "TASKCOMPLETE" },
    ]);
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "who started me"], {
      cwd: fixtures.varTmp("aic-launcher-"),
    });

    expect(run.code).toBe(0);
    const first = toolAnswer(srv.requests.at(-1), "call_1");
    const second = toolAnswer(srv.requests.at(-1), "call_2");
    expect(first).toContain("__sandbox-launcher");
    expect(first).toMatch(/NoNewPrivs:\s+1/);
    expect(Number(/threads=(\d+)/.exec(first)?.[1])).toBeGreaterThan(1);
    expect(first).toContain("unconfined=0");
    // The same launcher, not one per command.
    expect(/parent=(\d+)/.exec(first)?.[1]).toBe(/parent=(\d+)/.exec(second)?.[1]!);
  });

  // Without the jail (Landlock alone) a command shares the launcher's domain and can kill it; in the jail the
  // launcher is the namespace's init, which nothing inside can kill (tested in jail.test.ts).
  test("without the jail, a command that kills the launcher gets a new one for the next command, still confined", async () => {
    const cwd = fixtures.varTmp("aic-launcher-");
    const inHome = fixtures.disposable(join(homedir(), unique("aic-launcher-")));
    const srv = fixtures.serve([
      bash(`echo "before=$PPID"`, "call_before"),
      // The command outlives its launcher until aic has reaped it (noticed it is gone), then ends.
      bash(`kill -9 $PPID; while [ -e /proc/$PPID ]; do sleep 0.01; done; echo survived`, "call_kill"),
      bash(`echo "after=$PPID"; echo x > ${inHome}; echo "home write exit $?"`, "call_after"),
      { content: "TASKCOMPLETE" },
    ]);
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "kill the launcher"], {
      cwd,
      env: { AIC_NO_NAMESPACES: "1" },
    });

    expect(run.code).toBe(0);
    const before = /before=(\d+)/.exec(toolAnswer(srv.requests.at(-1), "call_before"))?.[1];
    const after = toolAnswer(srv.requests.at(-1), "call_after");
    expect(before).toBeDefined();
    expect(/after=(\d+)/.exec(after)?.[1]).toBeDefined();
    expect(/after=(\d+)/.exec(after)?.[1]).not.toBe(before!);
    expect(after).toContain("Permission denied");
    expect(after).toMatch(/home write exit [1-9]/);
    expect(existsSync(inHome)).toBe(false);
  });
});

describe("aic refuses a launcher that lies", () => {
  const lying = (lie: string) =>
    new SandboxLauncher([process.execPath, join(ROOT, "tests", "lying-launcher.ts"), lie, String(process.pid)], false);
  const options = { cwd: ROOT, env: {}, cols: 80, rows: 24, onData() {} };

  for (const [lie, why] of [
    ["foreign-pid", new RegExp(`named pid ${process.pid}, not its child`)],
    ["huge-frame", /sent a frame of \d+ bytes/],
    ["bad-kind", /sent a frame of unknown kind 99/],
  ] as const) {
    test(`${lie}: the command is not run and the launcher is stopped`, async () => {
      const launcher = lying(lie);
      expect(await launcher.start()).toBeUndefined();
      const started = launcher.spawn(["/bin/true"], options);
      await expect(started).rejects.toThrow(why);
      await expect(started).rejects.toThrow(/the command was not run/);
    });
  }
});

// A command can read the launcher's /proc files (as root, or by taking it over): it must hold no secret.
test.skipIf(ABI < 1)("the launcher's environment has no API key in it", async () => {
  const count = `echo "count=$(tr '\\0' '\\n' < /proc/$PPID/environ | grep -c KEY_MARK)"`;
  const srv = fixtures.serve([bash(count, "call_env"), { content: "TASKCOMPLETE" }]);
  const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "read the launcher's environment"], {
    cwd: fixtures.varTmp("aic-launcher-"),
    // (Outside the jail: inside it, /proc/$PPID is the jail's init, whose environment no command may read at all.)
    env: {
      OPENAI_API_KEY: "KEY_MARK-1234",
      AIC_API_KEY: "KEY_MARK-5678",
      KEEP_MARK: "KEY_MARK_VISIBLE",
      AIC_NO_NAMESPACES: "1",
    },
  });
  expect(run.code).toBe(0);
  // Only the harmless variable that merely contains the marker is there, or (commands without capabilities, as
  // root too) the launcher's environment cannot be read at all.
  const answer = toolAnswer(srv.requests.at(-1), "call_env");
  expect(answer).toMatch(/count=1\b|environ: Permission denied[\s\S]*count=0/);
  // (The values whole: a pid in the error message may hold the same digits.)
  expect(answer).not.toMatch(/KEY_MARK-(1234|5678)/);
});

// The launcher's pipe to aic is reachable through /proc/<launcher>/fd only for whoever may trace it: a command that
// is not root may not, since the launcher is not dumpable. Needs root and setpriv to run aic as `nobody`.
test.skipIf(ABI < 1 || !has.root || !has.setpriv)(
  "a command that is not root cannot open the launcher's pipes",
  async () => {
    const cwd = scratch();
    chmodSync(cwd, 0o777);
    const probe = `ls /proc/$PPID/fd >/dev/null 2>&1 && echo fd-listed || echo fd-refused; echo x > /proc/$PPID/fd/1 2>/dev/null && echo fd-written || echo write-refused`;
    const srv = fixtures.serve([bash(probe, "call_fd"), { content: "TASKCOMPLETE" }]);
    const run = await runCommand(
      [
        "setpriv",
        "--reuid=nobody",
        "--regid=nogroup",
        "--clear-groups",
        "--",
        AIC,
        ...headless(srv.url),
        "--auto-approve",
        "poke",
      ],
      { cwd, env: { HOME: cwd }, killAfterMs: 60_000 },
    );
    expect(run.code).toBe(0);
    const answer = toolAnswer(srv.requests.at(-1), "call_fd");
    expect(answer).toContain("fd-refused");
    expect(answer).toContain("write-refused");
  },
);
