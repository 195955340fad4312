/**
 * The unattended ralph loop, finished (README: "Background jobs", "Verified
 * completion", "Token budget"): what a command leaves running lives on as a
 * job until aic exits, and never longer; a claim of completion can be checked
 * by a command the person gave; a token budget stops the run before the call
 * that would pass it; a server that cuts the prompt is noticed. Each test
 * drives the compiled binary against the fake server and looks at /proc, the
 * requests the model received, the JSON events and the session file.
 */
import { describe, expect, test } from "bun:test";
import { existsSync, readFileSync, readdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import type { Turn } from "./fake-openai.ts";
import {
  alive,
  bash,
  headless,
  jsonLines,
  messagesOf,
  perTestFixtures,
  runAic,
  scratch,
  testStateHome,
  startAic,
  toolAnswer,
  waitFor,
} from "./helpers.ts";

const fixtures = perTestFixtures();

/**
 * Live processes started by the commands of the aic process `aicPid`: every
 * one carries AIC_COMMAND_ID=<aic pid>.<n> in its environment, daemons that
 * called setsid included. What must be empty once aic is gone.
 */
function processesOf(aicPid: number): number[] {
  const found: number[] = [];
  for (const entry of readdirSync("/proc")) {
    if (!/^\d+$/.test(entry) || !alive(Number(entry))) continue;
    try {
      const environ = readFileSync(`/proc/${entry}/environ`, "utf8");
      if (environ.split("\0").some((v) => v.startsWith(`AIC_COMMAND_ID=${aicPid}.`))) found.push(Number(entry));
    } catch {
      /* gone, or not ours to read */
    }
  }
  return found;
}

/** A loopback port nothing listens on right now. */
function freePort(): number {
  const probe = Bun.serve({ hostname: "127.0.0.1", port: 0, fetch: () => new Response("") });
  const port = probe.port!;
  probe.stop(true);
  return port;
}

const hang: Turn = { type: "hang" };
const done: Turn = { content: "TASKCOMPLETE" };

describe("background jobs", () => {
  // A dev server started with & keeps answering: the next two commands reach it, both results end with its
  // job line, and when aic is done the server and a double-forked daemon are gone from /proc.
  test("a dev server outlives its command, is listed on every later result, and dies with aic", async () => {
    const port = freePort();
    const server = `${process.execPath} -e 'Bun.serve({hostname: "127.0.0.1", port: ${port}, fetch: () => new Response("hello-from-job")})' > server.log 2>&1 &`;
    const srv = fixtures.serve([
      bash(`${server} (setsid sleep 302 &); echo started`, "start"),
      bash(`until curl -sf 127.0.0.1:${port}/; do sleep 0.1; done`, "first"),
      bash(`curl -sf 127.0.0.1:${port}/`, "second"),
      done,
    ]);
    const aic = startAic([...headless(srv.url), "--auto-approve", "--json", "serve it"]);
    const result = await aic.done;
    expect(result.code).toBe(0);
    const events = jsonLines(result.stdout);
    const started = events.filter((e) => e.type === "job_started");
    expect(started.map((e) => e.command)).toEqual([expect.stringContaining("Bun.serve"), "sleep 302"]);
    const [web, daemon] = started.map((e) => e.pid as number) as [number, number];
    // The group as the model's commands see it (in the jail, the jail's own numbering).
    const webGroup = started[0].group as number;

    for (const [request, id] of [
      [srv.requests[2], "first"],
      [srv.requests[3], "second"],
    ] as const) {
      const answer = toolAnswer(request, id);
      expect(answer).toContain("hello-from-job");
      expect(answer).toMatch(
        new RegExp(
          `\\[job 1\\] running for \\d+ (ms|s): process group ${webGroup} \\(.*Bun\\.serve.*\\); stop it with: kill -- -${webGroup};`,
        ),
      );
      expect(answer).toContain(`[job 2] running for`);
      expect(answer).toContain(`(sleep 302); stop it with: kill -- -`);
      expect(daemon).toBeGreaterThan(1);
    }
    const ended = events.filter((e) => e.type === "job_ended");
    expect(ended.map((e) => [e.id, e.how])).toEqual([
      [1, "stopped_at_exit"],
      [2, "stopped_at_exit"],
    ]);
    expect(alive(web)).toBe(false);
    expect(alive(daemon)).toBe(false);
    expect(processesOf(aic.proc.pid)).toEqual([]);
  });

  // A job that writes to its terminal without redirecting: what it prints after its command returned is in
  // the job's log, not lost.
  test("what a job prints to its terminal goes to its log", async () => {
    // The job prints once the test, having seen it become a job, opens its gate.
    const cwd = scratch();
    const srv = fixtures.serve([
      bash("(until [ -e print-now ]; do sleep 0.01; done; echo late-line-from-job; sleep 300) & echo started"),
      hang,
    ]);
    const aic = startAic([...headless(srv.url), "--auto-approve", "--json", "print later"], { cwd });
    const started = await aic.waitForEvent("the job", (e) => e.type === "job_started");
    // In aic's state directory (the tests' own $XDG_STATE_HOME), out of other commands' reach.
    expect(started.log).toStartWith(`${testStateHome()}/aic/outputs/aic-out-`);
    expect(started.log).toMatch(/\/job-.*\.log$/);
    writeFileSync(join(cwd, "print-now"), "");
    await waitFor("the job's line in its log", () => readFileSync(started.log, "utf8").includes("late-line-from-job"));
    aic.proc.kill("SIGTERM");
    expect((await aic.done).code).toBe(143);
    expect(processesOf(aic.proc.pid)).toEqual([]);
  });

  // On SIGTERM, SIGHUP and SIGINT aic stops every job, a double-forked daemon included, before it exits.
  for (const [signal, code] of [
    ["SIGTERM", 143],
    ["SIGHUP", 129],
    ["SIGINT", 130],
  ] as const) {
    test(`${signal} to aic stops its jobs and a daemon too`, async () => {
      const srv = fixtures.serve([bash("sleep 300 & (setsid sleep 301 &); echo started"), hang]);
      const aic = startAic([...headless(srv.url), "--auto-approve", "--json", "start jobs"]);
      const jobsStarted = () => aic.events().filter((e) => e.type === "job_started");
      await waitFor(
        "the request after the command and both job_started events",
        () => srv.requests.length >= 2 && jobsStarted().length >= 2,
      );
      const pids = jobsStarted().map((e) => e.pid as number);
      expect(pids).toHaveLength(2);
      expect(processesOf(aic.proc.pid).sort()).toEqual([...pids].sort());
      aic.proc.kill(signal);
      const result = await aic.done;
      expect(result.code).toBe(code);
      for (const pid of pids) expect(alive(pid)).toBe(false);
      expect(processesOf(aic.proc.pid)).toEqual([]);
    });
  }

  // The timeout concerns the foreground only: the command is killed at its timeout, the job it started
  // with & keeps running and is listed as such on the next result.
  test("a timeout kills the foreground and leaves the command's job running", async () => {
    const srv = fixtures.serve([bash("sleep 300 & sleep 60", "slow"), bash("echo next", "next"), done]);
    const result = await runAic([...headless(srv.url), "--auto-approve", "--json", "--timeout", "1", "go"]);
    expect(result.code).toBe(0);
    const events = jsonLines(result.stdout);
    expect(events.find((e) => e.type === "command_result" && e.id === "slow")?.status).toBe("timed_out");
    expect(toolAnswer(srv.requests[2], "next")).toMatch(/\[job 1\] running for .*: process group \d+ \(sleep 300\)/);
    expect(events.find((e) => e.type === "job_ended")?.how).toBe("stopped_at_exit");
  });

  // Stopping concerns the foreground only: a command waiting on `read`, stopped when the model runs the
  // next command instead of answering it, leaves the job it started first running.
  test("a waiting command stopped by the next one leaves its job running", async () => {
    const srv = fixtures.serve([
      bash("sleep 300 & read -r answer; echo never", "ask"),
      bash("echo next", "next"),
      done,
    ]);
    const result = await runAic([...headless(srv.url), "--auto-approve", "--json", "go"], {
      env: { AIC_INPUT_WAIT_MS: "300" },
    });
    expect(result.code).toBe(0);
    const events = jsonLines(result.stdout);
    expect(events.find((e) => e.type === "command_result" && e.id === "ask")?.status).toBe("waiting_for_input");
    expect(toolAnswer(srv.requests[2], "next")).toStartWith(
      "(The command that was waiting for input, bash, was stopped first",
    );
    expect(toolAnswer(srv.requests[2], "next")).toMatch(/\[job 1\] running for .*: process group \d+ \(sleep 300\)/);
  });

  // At most 8 jobs: a command that starts nine gets eight, the ninth is stopped and the model is told why.
  test("a ninth job is refused with a message", async () => {
    const srv = fixtures.serve([bash("for i in 1 2 3 4 5 6 7 8 9; do sleep 300 & done; echo started", "many"), hang]);
    const aic = startAic([...headless(srv.url), "--auto-approve", "--json", "many jobs"]);
    await waitFor(
      "the next request and the 8 job_started events",
      () => srv.requests.length >= 2 && aic.events().filter((e) => e.type === "job_started").length >= 8,
    );
    const answer = toolAnswer(srv.requests[1], "many");
    expect(answer).toContain("at most 8 background jobs run at once, so aic stopped them: sleep 300");
    expect(answer.match(/\[job \d\] running/g)).toHaveLength(8);
    expect(aic.events().filter((e) => e.type === "job_started")).toHaveLength(8);
    await waitFor("the ninth to be gone", () => processesOf(aic.proc.pid).length === 8);
    aic.proc.kill("SIGTERM");
    await aic.done;
    expect(processesOf(aic.proc.pid)).toEqual([]);
  });

  // A job that ends by itself is reported once, with its exit code, on the next result.
  test("a job that ends is reported once with its exit code", async () => {
    // The job waits for a gate the next command opens; that command then waits until the job has exited
    // (gone, or a zombie aic has yet to reap), so the result after it is the first to report the end.
    const srv = fixtures.serve([
      bash("(until [ -e end-now ]; do sleep 0.01; done; exit 7) & echo $! > job.pid; echo started", "start"),
      bash(
        "touch end-now; p=$(cat job.pid); while [ -e /proc/$p ] && ! grep -q ') Z ' /proc/$p/stat 2>/dev/null; do sleep 0.01; done",
        "wait",
      ),
      bash("echo again", "again"),
      done,
    ]);
    const result = await runAic([...headless(srv.url), "--auto-approve", "--json", "go"]);
    expect(result.code).toBe(0);
    expect(toolAnswer(srv.requests[2], "wait")).toMatch(
      /\[job 1\] ended after \d+ m?s, exit code 7: process group \d+/,
    );
    expect(toolAnswer(srv.requests[3], "again")).not.toContain("[job 1]");
    const ended = jsonLines(result.stdout).filter((e) => e.type === "job_ended");
    expect(ended).toEqual([expect.objectContaining({ id: 1, exit_code: 7, how: "ended" })]);
  });

  // The session file says which jobs there were and that aic stopped them when it exited.
  test("the session records the jobs aic stopped", async () => {
    const dir = scratch();
    const srv = fixtures.serve([bash("sleep 300 & echo started"), done]);
    const session = join(dir, "s.json");
    const result = await runAic([...headless(srv.url), "--auto-approve", "--session", session, "go"], { cwd: dir });
    expect(result.code).toBe(0);
    const saved = JSON.parse(readFileSync(session, "utf8"));
    expect(saved.jobs).toEqual([
      expect.objectContaining({ id: 1, command: "sleep 300", state: "stopped_at_exit", exit_code: 143 }),
    ]);
  });
});

describe("verified completion (--done-when)", () => {
  // A claim before the file exists is refused with the check's output; after `touch done.txt` the next
  // claim ends the run, verified.
  test("a claim is refused until the check passes, then the run ends verified", async () => {
    const dir = scratch();
    const srv = fixtures.serve([done, bash("touch done.txt"), done]);
    const result = await runAic(
      [...headless(srv.url), "--auto-approve", "--json", "--done-when", "echo checking-done; test -f done.txt", "go"],
      { cwd: dir },
    );
    expect(result.code).toBe(0);
    const events = jsonLines(result.stdout);
    expect(events.filter((e) => e.type === "verify").map((e) => [e.passed, e.exit_code])).toEqual([
      [false, 1],
      [true, 0],
    ]);
    const refusal = messagesOf(srv.requests[1]).at(-1);
    expect(refusal.role).toBe("user");
    expect(refusal.content).toStartWith(
      "[Completion check failed] echo checking-done; test -f done.txt exited 1:\nchecking-done",
    );
    const end = events.find((e) => e.type === "end");
    expect(end).toMatchObject({ status: "completed", exit_code: 0, verified: true });
    expect(existsSync(join(dir, "done.txt"))).toBe(true);
  });

  // Five claims refused in a row end the run with exit 6; the checks are shown on stdout. AIC_DONE_WHEN
  // sets the check as the flag does.
  test("five refused claims end with exit 6, each check shown on stdout", async () => {
    const srv = fixtures.serve([done, done, done, done, done, done]);
    const result = await runAic([...headless(srv.url), "--auto-approve", "go"], {
      env: { AIC_DONE_WHEN: "test -f never-there.txt" },
    });
    expect(result.code).toBe(6);
    expect(srv.requests).toHaveLength(5);
    expect(result.stdout.match(/\$ test -f never-there\.txt {3}\(completion check\)/g)).toHaveLength(5);
    expect(result.stdout.match(/\[completion refused: exit code 1\]/g)).toHaveLength(5);
    expect(result.stderr).toContain("--done-when refused 5 claims of completion in a row");
  });

  // The system prompt tells the model its claims are checked, and by what.
  test("the model is told which check confirms completion", async () => {
    const srv = fixtures.serve([done]);
    const result = await runAic([...headless(srv.url), "--done-when", "true", "go"]);
    expect(result.code).toBe(0);
    expect(messagesOf(srv.requests[0])[0].content).toContain("Your claim is checked by running `true`");
  });

  test("an empty --done-when is a usage error", async () => {
    const result = await runAic([...headless("http://127.0.0.1:9/v1"), "--done-when", "", "go"]);
    expect(result.code).toBe(2);
    expect(result.stderr.trim()).toBe("aic: error: --done-when needs a command");
  });
});

describe("token budget (--max-tokens) and the truncation watchdog", () => {
  // Each call reports 3,000 prompt tokens and 100 completion tokens. With a budget of 7,000 the third call
  // would pass it: the run stops before it with exit 5, and the session, resumed with a larger budget,
  // goes on from there.
  // A new user's finding: without a session file the stop said "the session is saved".
  test("without a session file, the budget's stop does not say the session is saved", async () => {
    const step = (n: number): Turn => ({
      ...bash(`echo step-${n}`),
      usage: { prompt_tokens: 3000, completion_tokens: 100 },
    });
    const srv = fixtures.serve([step(1), step(2), step(3), done]);
    const run = await runAic(
      [...headless(srv.url), "--auto-approve", "--json", "--no-session", "--max-tokens", "7000", "go"],
      {
        cwd: scratch(),
      },
    );
    expect(run.code).toBe(5);
    const stop = jsonLines(run.stdout).find((e) => e.type === "warning");
    expect(stop.text).not.toContain("the session is saved");
    expect(stop.text).toContain("no session file keeps this run");
  });

  test("the run stops before the call that would pass the budget, and resumes", async () => {
    const dir = scratch();
    const session = join(dir, "s.json");
    const step = (n: number): Turn => ({
      ...bash(`echo step-${n}`),
      usage: { prompt_tokens: 3000, completion_tokens: 100 },
    });
    const srv = fixtures.serve([step(1), step(2), step(3), done]);
    const args = [...headless(srv.url), "--auto-approve", "--json", "--session", session];
    const first = await runAic([...args, "--max-tokens", "7000", "go"], { cwd: dir });
    expect(first.code).toBe(5);
    expect(srv.requests).toHaveLength(2);
    const events = jsonLines(first.stdout);
    const usage = events.filter((e) => e.type === "usage");
    expect(usage.map((e) => [e.spent, e.max_tokens])).toEqual([
      [3100, 7000],
      [6200, 7000],
    ]);
    expect(events.find((e) => e.type === "end")).toMatchObject({ status: "token_budget", exit_code: 5 });
    const stop = events.find((e) => e.type === "warning");
    expect(stop.text).toStartWith("the token budget is spent: 6200 of --max-tokens 7000 used");
    expect(stop.text).toContain("the session is saved");
    const saved = JSON.parse(readFileSync(session, "utf8"));
    expect(saved.messages.filter((m: any) => m.role === "tool")).toHaveLength(2);

    const second = await runAic([...args, "--max-tokens", "100000", "go on"], { cwd: dir });
    expect(second.code).toBe(0);
    const resumed = messagesOf(srv.requests[2]);
    expect(resumed.filter((m: any) => m.role === "tool").map((m: any) => m.content)).toEqual([
      expect.stringContaining("step-1"),
      expect.stringContaining("step-2"),
    ]);
  });

  // A server that reports no usage is still counted (aic's own estimate): the budget holds all the same.
  test("a server without usage figures is counted by aic's estimate", async () => {
    const turns = Array.from({ length: 10 }, (_, i): Turn => ({ ...bash(`echo step-${i}`), noUsage: true }));
    const srv = fixtures.serve(turns);
    const result = await runAic([...headless(srv.url), "--auto-approve", "--json", "--max-tokens", "3000", "go"]);
    expect(result.code).toBe(5);
    const usage = jsonLines(result.stdout).filter((e) => e.type === "usage");
    expect(usage.length).toBeGreaterThan(0);
    expect(usage.every((e) => e.estimated === true && e.spent > 0 && e.spent <= 3000)).toBe(true);
    expect(srv.requests.length).toBe(usage.length);
    expect(srv.requests.length).toBeLessThan(10);
  });

  // A server that reports a third of the prompt tokens aic sent: one warning after the second such
  // report, and the figures never replace aic's own estimate.
  test("a server reporting a third of the prompt gets one warning and no recalibration", async () => {
    const srv = fixtures.serve([bash("echo a"), bash("echo b"), bash("echo c"), bash("echo d"), done], {
      inflation: 1 / 3,
    });
    const result = await runAic([...headless(srv.url), "--auto-approve", "--json", "go"]);
    expect(result.code).toBe(0);
    const events = jsonLines(result.stdout);
    const warnings = events.filter((e) => e.type === "warning" && e.text.includes("probably cutting the prompt"));
    expect(warnings).toHaveLength(1);
    expect(warnings[0].text).toContain("--max-prompt-len 80000");
    // The warning comes with the second report (before its usage event), not with the first.
    const order = events.filter((e) => e.type === "usage" || e === warnings[0]).map((e) => e.type);
    expect(order.slice(0, 3)).toEqual(["usage", "warning", "usage"]);
    for (const u of events.filter((e) => e.type === "usage"))
      expect(u.context_estimate).toBeGreaterThan(2 * u.prompt_tokens);
  });

  // A server whose figures are about right never triggers it.
  test("a server with plausible figures gets no warning", async () => {
    const srv = fixtures.serve([bash("echo a"), bash("echo b"), bash("echo c"), done], { inflation: 0.8 });
    const result = await runAic([...headless(srv.url), "--auto-approve", "--json", "go"]);
    expect(result.code).toBe(0);
    expect(jsonLines(result.stdout).filter((e) => e.type === "warning")).toEqual([]);
  });
});
