/**
 * What a CI job needs to trust an unattended run: aic leaves the pipes it
 * shares with its parent as it found them, names the URL and the flag to fix
 * when nothing answers, never prints an answer it later throws away, counts
 * tokens a server does not report, refuses bad command lines in one line,
 * survives content that would stall a tokenizer, and resumes a session without
 * losing or piling up anything. Each test drives the compiled binary against
 * the fake server; how each failure a real server sends is classified and
 * retried is tested on the ModelClient in model-client.test.ts.
 */
import { describe, expect, test } from "bun:test";
import { existsSync, readFileSync, readdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import type { FakeServer, Turn } from "./fake-openai.ts";
import {
  AIC,
  bash,
  cleanEnv,
  has,
  headless,
  httpError,
  jsonLines,
  lineReader,
  perTestFixtures,
  runAic,
  runCommand,
  scratch,
  toolResults,
  waitFor,
} from "./helpers.ts";

const fixtures = perTestFixtures();

/**
 * Runs dist/aic from a parent that holds the write ends of its stdout and
 * stderr pipes (as a CI shell or tee does) and reports, after aic has exited,
 * whether those pipes were left non-blocking. `signal` is sent once the
 * fake server has seen the first request.
 */
async function parentSeesFlags(
  args: string[],
  srv: FakeServer | undefined,
  opts: { signal?: NodeJS.Signals; stdin?: "devnull" } = {},
) {
  const script = `
import fcntl, os, subprocess, sys, json
r, w = os.pipe()
p = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, stdout=w, stderr=w)
print(p.pid, flush=True)
reader = os.fdopen(r, "rb", buffering=0)
chunks = []
# Read in a thread so the child never blocks on a full pipe.
import threading
t = threading.Thread(target=lambda: chunks.append(reader.read()))
t.start()
code = p.wait()
flags = fcntl.fcntl(w, fcntl.F_GETFL)
os.close(w)
t.join()
print(json.dumps({"code": code, "nonblocking": bool(flags & os.O_NONBLOCK), "output": b"".join(chunks).decode("utf8", "replace")}), flush=True)
`;
  const proc = Bun.spawn(["python3", "-c", script, AIC, ...args], {
    cwd: scratch(),
    env: cleanEnv(),
    stdout: "pipe",
    stderr: "inherit",
  });
  const lines = lineReader(proc.stdout);
  const pid = Number(await lines.next());
  if (opts.signal) {
    await waitFor("aic's first model request", () => srv && srv.requests.length >= 1);
    process.kill(pid, opts.signal);
  }
  const result = JSON.parse((await lines.next()) ?? "null") as { code: number; nonblocking: boolean; output: string };
  await proc.exited;
  return result;
}

describe("aic leaves the pipes it shares with its parent as it found them", () => {
  const cases: [string, (url: string) => string[], Turn[], number][] = [
    [
      "exit 0",
      (url) => [...headless(url), "--auto-approve", "task"],
      [bash("seq 1 2000"), { content: "TASKCOMPLETE" }],
      0,
    ],
    ["exit 1", (url) => [...headless(url), "task"], [httpError(401, { error: { message: "bad key" } })], 1],
    [
      "exit 2",
      () => ["--nogui", "--api-base", "http://127.0.0.1:9/v1", "--model", "m", "--timeout", "soon", "task"],
      [],
      2,
    ],
    ["exit 4", (url) => [...headless(url), "task"], [bash("touch needs-approval")], 4],
  ];
  // The parent that checks the pipe's flags is a python3 script; these tests are skipped without python3.
  for (const [label, args, turns, code] of cases) {
    test.skipIf(!has.python3)(`${label}: the parent's stdout/stderr pipe is blocking again`, async () => {
      const srv = fixtures.serve(turns);
      const result = await parentSeesFlags(args(srv.url), srv);
      expect(result.code).toBe(code);
      expect(result.output.length).toBeGreaterThan(0);
      expect(result.nonblocking).toBe(false);
    });
  }

  test.skipIf(!has.python3)("SIGTERM: the parent's pipe is blocking again and the exit code is 143", async () => {
    const srv = fixtures.serve([{ type: "hang" }]);
    const result = await parentSeesFlags([...headless(srv.url), "task"], srv, { signal: "SIGTERM" });
    expect(result.code).toBe(143);
    expect(result.nonblocking).toBe(false);
  });

  // The shell of a CI step under `set -e` keeps writing after aic, through the same pipe.
  test("bash under set -e: aic … 2>&1 | tee log; the next echo still works", async () => {
    const srv = fixtures.serve([bash("seq 1 5000"), { content: "TASKCOMPLETE" }]);
    const cwd = scratch();
    const script = `set -euo pipefail; ${AIC} ${headless(srv.url).join(" ")} --auto-approve task 2>&1 | tee out.log >/dev/null; echo next-step-ok >&2`;
    const { stderr, code } = await runCommand(["bash", "-c", script], { cwd });
    expect(stderr).toContain("next-step-ok");
    expect(code).toBe(0);
    expect(readFileSync(join(cwd, "out.log"), "utf8")).toContain("5000");
  });

  // Needs GNU time at /usr/bin/time; skipped without it.
  test.skipIf(!has.usrBinTime)(
    "/usr/bin/time -v aic exits with aic's own code, 50 runs out of 50",
    async () => {
      const srv = fixtures.serve(() => ({ content: "TASKCOMPLETE" }));
      const cwd = scratch();
      // Each iteration is one run; time's report goes into the same pipe as aic's output, so a pipe
      // left non-blocking could fail its write (EAGAIN) and change its exit code.
      const script = `set -o pipefail; ok=0; for i in $(seq 1 50); do /usr/bin/time -v ${AIC} ${headless(srv.url).join(" ")} task 2>&1 | cat >> report.txt; rc=$?; [ $rc -eq 0 ] && ok=$((ok+1)); done; echo $ok`;
      const { stdout } = await runCommand(["bash", "-c", script], { cwd, killAfterMs: 115_000 });
      expect(stdout.trim()).toBe("50");
      expect(readFileSync(join(cwd, "report.txt"), "utf8").match(/Exit status: 0/g)?.length).toBe(50);
    },
    120_000,
  );
});

describe("an answer that is later discarded never reaches stdout unmarked", () => {
  const junk: Turn[] = [
    {
      type: "stream_error",
      partialContent: "JUNK-ONE ",
      error: { message: "upstream overloaded", type: "server_error" },
    },
    { type: "truncated_stream", partialContent: "JUNK-TWO " },
    { content: "The good answer. TASKCOMPLETE" },
  ];

  test("to a pipe: only the good answer is printed; stderr says what was discarded", async () => {
    const srv = fixtures.serve(junk);
    const run = await runAic([...headless(srv.url), "task"]);
    expect(run.code).toBe(0);
    expect(run.stdout).not.toContain("JUNK");
    expect(run.stdout).toContain("The good answer.");
    expect(run.stderr.match(/partial answer was discarded/g)?.length).toBe(2);
  });

  test("on a terminal: it streams live, and each discarded attempt is followed by a line saying so", async () => {
    const srv = fixtures.serve(junk);
    let screen = "";
    const proc = Bun.spawn([AIC, ...headless(srv.url), "task"], {
      cwd: scratch(),
      env: cleanEnv(),
      terminal: { cols: 200, rows: 50, data: (_t, bytes) => (screen += new TextDecoder().decode(bytes)) },
    });
    const guard = setTimeout(() => proc.kill("SIGKILL"), 100_000);
    await proc.exited;
    clearTimeout(guard);
    proc.terminal?.close();
    const afterOne = screen.slice(screen.indexOf("JUNK-ONE"));
    expect(afterOne.indexOf("[the answer above was discarded")).toBeGreaterThan(0);
    expect(afterOne.indexOf("[the answer above was discarded")).toBeLessThan(afterOne.indexOf("JUNK-TWO"));
    expect(screen.slice(screen.indexOf("JUNK-TWO"))).toContain("[the answer above was discarded");
  });
});

describe("a server that reports no usage is counted by aic", () => {
  test("JSON usage and end are estimated, never 0; text marks them with ~", async () => {
    const srv = fixtures.serve([
      { ...bash("echo hi"), noUsage: true },
      { content: "TASKCOMPLETE", noUsage: true },
    ]);
    const json = await runAic([...headless(srv.url), "--json", "--auto-approve", "task"]);
    expect(json.code).toBe(0);
    const events = jsonLines(json.stdout);
    const usage = events.filter((e) => e.type === "usage");
    expect(usage).toHaveLength(2);
    for (const u of usage) {
      expect(u.estimated).toBe(true);
      expect(u.prompt_tokens).toBeGreaterThan(100);
      expect(u.completion_tokens).toBeGreaterThan(0);
    }
    const end = events.find((e) => e.type === "end");
    expect(end.usage.estimated).toBe(true);
    expect(end.usage.input_tokens).toBe(usage[0].prompt_tokens + usage[1].prompt_tokens);
    const text = await runAic([...headless(fixtures.serve([{ content: "TASKCOMPLETE", noUsage: true }]).url), "task"]);
    expect(text.stderr).toMatch(/~\d+ in \/ ~\d+ out/);
  });
});

describe("an endpoint nobody answers at", () => {
  test("connection refused: gives up after a few quick attempts, naming the URL and --api-base", async () => {
    const url = "http://127.0.0.1:9/v1";
    const run = await runAic(["--nogui", "--json", "--api-base", url, "--model", "m", "task"]);
    expect(run.code).toBe(1);
    const events = jsonLines(run.stdout);
    const waits = events.filter((e) => e.type === "retry").map((e) => e.wait_ms);
    expect(waits.length).toBeLessThanOrEqual(2);
    expect(waits.reduce((a, b) => a + b, 0)).toBeLessThanOrEqual(3000);
    const error = events.find((e) => e.type === "error").message;
    expect(error).toContain(url);
    expect(error).toContain("--api-base");
    expect(error).toContain("refused");
  });

  test("a stream dropped mid-answer is retried and described in aic's words", async () => {
    const srv = fixtures.serve([{ type: "drop_stream", partialContent: "JUNK " }]);
    const run = await runAic([...headless(srv.url), "task"]);
    expect(run.code).toBe(0);
    expect(srv.requests.length).toBe(2);
    expect(run.stderr).toContain("dropped in the middle of the answer");
    expect(run.stderr).not.toContain("verbose: true");
  });
});

describe("--header and AIC_HEADERS", () => {
  test("headers reach the server; their values are never printed or written", async () => {
    const cwd = scratch();
    const secret = "hdr-secret-value-123";
    const srv = fixtures.serve([
      httpError(400, {
        error: {
          message: `gateway says: bad header value ${secret}; Either x-portkey-config or x-portkey-provider header is required`,
        },
      }),
    ]);
    const run = await runAic(
      [...headless(srv.url), "--header", `x-portkey-config: ${secret}`, "--session", "s.json", "--debug", "task"],
      {
        cwd,
        env: { AIC_HEADERS: "x-portkey-provider: openai\nx-trace: 7" },
      },
    );
    expect(run.code).toBe(1);
    const sent = srv.requests[0]!.headers;
    expect([sent["x-portkey-config"], sent["x-portkey-provider"], sent["x-trace"]]).toEqual([secret, "openai", "7"]);
    expect(run.stdout + run.stderr).not.toContain(secret);
    for (const name of readdirSync(cwd)) expect(readFileSync(join(cwd, name), "utf8")).not.toContain(secret);
    expect(run.stderr).toContain("check --header");
  });
});

describe("bad command lines: one line naming the flag, exit 2", () => {
  const base = ["--nogui", "--api-base", "http://127.0.0.1:9/v1", "--model", "m"];
  const cases: [string, string[], string][] = [
    ["-x is an unknown option, never the task", ["--nogui", "-x", "task"], "-x"],
    ["--api-base that is not a URL", ["--nogui", "--api-base", "not a url", "--model", "m", "task"], "--api-base"],
    ["--api-base with ftp://", ["--nogui", "--api-base", "ftp://example.com/v1", "--model", "m", "task"], "--api-base"],
    [
      "--api-base without a scheme",
      ["--nogui", "--api-base", "localhost:8000/v1", "--model", "m", "task"],
      "--api-base",
    ],
    ["a hexadecimal number", [...base, "--timeout", "0x10", "task"], "--timeout"],
    ["a number with a leading space", [...base, "--max-steps", " 5", "task"], "--max-steps"],
    ["1e20 steps", [...base, "--max-steps", "1e20", "task"], "--max-steps"],
    ["1e20 output bytes", [...base, "--max-output-bytes", "1e20", "task"], "--max-output-bytes"],
    ["a huge output cap", [...base, "--max-output-bytes", "99999999999", "task"], "--max-output-bytes"],
    ["1e20 prompt tokens", [...base, "--max-prompt-len", "1e20", "task"], "--max-prompt-len"],
    ["a prompt budget below the system prompt", [...base, "--max-prompt-len", "100", "task"], "--max-prompt-len"],
    [
      "a prompt budget eaten by the output reservation",
      [...base, "--max-prompt-len", "2000", "task"],
      "--max-prompt-len",
    ],
    ["--session in a missing directory", [...base, "--session", "/no/such/dir/s.json", "task"], "--session"],
    ["--header without a colon", [...base, "--header", "secret-only", "task"], "--header"],
  ];
  for (const [label, args, names] of cases) {
    test(label, async () => {
      const run = await runAic(args);
      expect(run.code).toBe(2);
      expect(run.stderr.trim().split("\n")).toHaveLength(1);
      expect(run.stderr).toContain(names);
    });
  }

  test("-h and -V are help and version, not a task", async () => {
    const help = await runAic(["-h"]);
    expect(help.code).toBe(0);
    expect(help.stdout).toContain("Usage:");
    const version = await runAic(["-V"]);
    expect(version.code).toBe(0);
    expect(version.stdout).toMatch(/^aic \d+\.\d+\.\d+/);
  });

  test("a task that starts with a dash goes after --", async () => {
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--", "-x marks the spot"]);
    expect(run.code).toBe(0);
    expect(srv.requests[0]!.body.messages[1].content).toBe("-x marks the spot");
  });
});

describe("content that would stall a tokenizer", () => {
  // 1 MB without a space: tiktoken's cost grows with the square of a word's length.
  test("a 1 MB single-word command neither crashes the run nor its resume", async () => {
    const cwd = scratch();
    const word = "a".repeat(1_000_000);
    const big = {
      toolCalls: [{ arguments: JSON.stringify({ command: `echo ${word} | wc -c` }) }],
      usage: { prompt_tokens: 1000, completion_tokens: 250_000 },
    };
    const done = { content: "TASKCOMPLETE", usage: { prompt_tokens: 251_000, completion_tokens: 1 } };
    const srv = fixtures.serve([big, done, done]);
    const first = await runAic(
      [...headless(srv.url), "--auto-approve", "--session", "s.json", "--max-prompt-len", "10000000", "task"],
      {
        cwd,
      },
    );
    expect(first.stderr).not.toContain("internal error");
    // A megabyte is past the kernel's limit for one argument: the command cannot start, so the run cannot succeed.
    expect(first.stderr).toContain("argument list too long");
    expect(first.code).toBe(1);
    const again = await runAic([...headless(srv.url), "--session", "s.json", "--max-prompt-len", "10000000", "next"], {
      cwd,
    });
    expect(again.stderr).not.toContain("internal error");
    expect(again.code).toBe(0);
  });
});

describe("binary output", () => {
  test("5 MB of random bytes does not flood stderr with emulator dumps", async () => {
    const srv = fixtures.serve([bash("head -c 5M /dev/urandom; echo"), { content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--max-output-bytes", "1000000", "task"]);
    expect(run.code).toBe(0);
    expect(run.stderr).not.toContain("Parsing error");
    expect(run.stderr.length).toBeLessThan(10_000);
  });
});

describe("sessions and resume", () => {
  test("a resumed model still sees its own last answer", async () => {
    const cwd = scratch();
    const srv = fixtures.serve([{ content: "Found 42 files. TASKCOMPLETE" }, { content: "TASKCOMPLETE" }]);
    expect((await runAic([...headless(srv.url), "--session", "s.json", "count"], { cwd })).code).toBe(0);
    const again = await runAic([...headless(srv.url), "--session", "s.json", "and now?"], { cwd });
    expect(again.code).toBe(0);
    const sent = srv.requests[1]!.body.messages;
    expect(sent.map((m: any) => m.role)).toEqual(["system", "user", "assistant", "user"]);
    expect(sent[2].content).toContain("Found 42 files.");
    expect(again.stderr).not.toContain("trailing");
  });

  test("requests whose runs failed before any answer do not pile up", async () => {
    const cwd = scratch();
    const srv = fixtures.serve([
      httpError(401, { error: { message: "bad key" } }),
      httpError(404, { error: { message: "no such model" } }),
      httpError(400, { error: { message: "bad request" } }),
      { content: "TASKCOMPLETE" },
    ]);
    for (const task of ["task one", "task two", "task three"])
      expect((await runAic([...headless(srv.url), "--session", "s.json", task], { cwd })).code).toBe(1);
    expect((await runAic([...headless(srv.url), "--session", "s.json", "task four"], { cwd })).code).toBe(0);
    const users = srv.requests[3]!.body.messages.filter((m: any) => m.role === "user").map((m: any) => m.content);
    expect(users).toEqual(["task four"]);
  });

  test("a saved full output outlives the run that made it, as long as its session", async () => {
    const cwd = scratch();
    const srv = fixtures.serve([bash("seq 1 20000"), { content: "TASKCOMPLETE" }]);
    expect((await runAic([...headless(srv.url), "--auto-approve", "--session", "s.json", "count"], { cwd })).code).toBe(
      0,
    );
    const saved = toolResults(srv)
      .at(-1)
      ?.match(/saved in (\S+\.txt)/)?.[1];
    expect(saved).toBeDefined();
    expect(existsSync(saved!)).toBe(true);
    // The next run of the same session reads it, as the model was told it could.
    const next = fixtures.serve([bash(`tail -n 1 ${saved}`), { content: "TASKCOMPLETE" }]);
    expect(
      (await runAic([...headless(next.url), "--auto-approve", "--session", "s.json", "read it"], { cwd })).code,
    ).toBe(0);
    expect(toolResults(next).at(-1)).toContain("20000");
    expect(JSON.parse(readFileSync(join(cwd, "s.json"), "utf8")).output_dir).toBe(
      saved!.slice(0, saved!.lastIndexOf("/")),
    );
  });

  test("without a session, the saved outputs are removed at exit", async () => {
    const srv = fixtures.serve([bash("seq 1 20000"), { content: "TASKCOMPLETE" }]);
    expect((await runAic([...headless(srv.url), "--auto-approve", "count"])).code).toBe(0);
    const saved = toolResults(srv)
      .at(-1)
      ?.match(/saved in (\S+\.txt)/)?.[1];
    expect(saved).toBeDefined();
    expect(existsSync(saved!)).toBe(false);
  });

  test("a session file names no output directory it did not make", async () => {
    const cwd = scratch();
    writeFileSync(
      join(cwd, "s.json"),
      JSON.stringify({ output_dir: cwd, messages: [{ role: "system", content: "s" }] }),
    );
    const srv = fixtures.serve([bash("seq 1 20000"), { content: "TASKCOMPLETE" }]);
    expect((await runAic([...headless(srv.url), "--auto-approve", "--session", "s.json", "count"], { cwd })).code).toBe(
      0,
    );
    const saved = toolResults(srv)
      .at(-1)
      ?.match(/saved in (\S+\.txt)/)?.[1];
    expect(saved!.startsWith(cwd + "/")).toBe(false);
  });
});
