/**
 * The unattended contract (README: "Unattended runs" and "JSON output"): what
 * a CI job can rely on. `--json` writes JSON Lines and nothing else, even
 * merged with stderr and with stdin closed; the start, command_result and end
 * events carry the documented fields; refused and skipped commands get a
 * result too; `--max-time` (exit 5) and a stalled model (exit 7) end the run
 * with the session saved; commands run in bash with CI=true, starting afresh
 * in the project; a background job's line names the command that stops it.
 * Every test drives the compiled binary against the fake server.
 */
import { describe, expect, test } from "bun:test";
import { existsSync, mkdirSync, readFileSync, statSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import {
  AIC,
  bash,
  has,
  headless,
  httpError,
  jsonLines,
  perTestFixtures,
  runAic,
  runCommand,
  scratch,
  toolAnswer,
} from "./helpers.ts";

const fixtures = perTestFixtures();
const done = { content: "TASKCOMPLETE" };

/** Every line of `text` parses as a JSON object with a type: the whole stream is JSON Lines. */
function everyLineIsJson(text: string): any[] {
  const lines = text.split("\n").filter((l) => l !== "");
  const parsed = lines.map((line, i) => {
    try {
      return JSON.parse(line);
    } catch {
      throw new Error(`line ${i + 1} is not JSON: ${JSON.stringify(line.slice(0, 200))}`);
    }
  });
  for (const p of parsed) expect(typeof p.type).toBe("string");
  return parsed;
}

describe("the JSON stream", () => {
  test("start, command_result and end carry the documented fields; the final answer is the result", async () => {
    const cwd = scratch();
    const srv = fixtures.serve([
      bash("printf 'hello\\nworld\\n'; echo made > made.txt", "c1"),
      { content: "All done: the file is made. TASKCOMPLETE" },
    ]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--json", "make a file"], { cwd });
    expect(run.code).toBe(0);
    const events = everyLineIsJson(run.stdout);
    const start = events.find((e) => e.type === "start");
    expect(start).toMatchObject({
      aic_version: expect.stringMatching(/^\d+\.\d+\.\d+/),
      schema: 1,
      model: "test-model",
    });
    expect(start.model_profile).toBe("open-weights");
    expect(start.session_id).toMatch(/^\d{8}_\d{6}$/);
    expect(start.cwd).toBe(cwd);
    expect(start.sandbox).toMatchObject({
      enabled: expect.any(Boolean),
      jail: expect.stringMatching(/^(namespaces|landlock|off)$/),
      network: expect.stringMatching(/^(on|loopback)$/),
    });
    expect(Array.isArray(start.sandbox.writable)).toBe(true);
    expect(Array.isArray(start.sandbox.unreadable)).toBe(true);
    const result = events.find((e) => e.type === "command_result");
    expect(result).toMatchObject({ id: "c1", status: "exited", exit_code: 0 });
    expect(result.saved_to).toBeUndefined(); // short output: nothing saved aside
    expect(result.duration_ms).toBeGreaterThanOrEqual(0);
    // What the person saw, without aic's own words for the model.
    expect(result.output).toBe("hello\nworld");
    expect(result.changed_files).toEqual({ created: ["made.txt"], modified: [], deleted: [] });
    const end = events.at(-1);
    expect(end).toMatchObject({ type: "end", status: "completed", exit_code: 0, steps: 2, refused: 0 });
    expect(end.session_id).toBe(start.session_id);
    expect(end.result).toBe("All done: the file is made.");
    expect(end.duration_ms).toBeGreaterThanOrEqual(0);
    expect(end.usage.input_tokens).toBeGreaterThan(0);
  });

  test("with stdin closed and 2>&1, a run that needs a person is still nothing but JSON Lines; refused commands get results", async () => {
    const cwd = scratch();
    writeFileSync(join(cwd, ".aicrules"), "allow echo *\ndeny rm *  # nothing is deleted here\n");
    const srv = fixtures.serve([
      bash("echo allowed", "ok"),
      bash("rm -rf stuff", "denied"),
      bash("touch needs-a-person", "asked"),
      done,
    ]);
    // sh merges stderr into stdout exactly as a CI step's `2>&1` would.
    const argv = [AIC, ...headless(srv.url), "--json", "try things"].map((a) => `'${a.replace(/'/g, "'\\''")}'`);
    const run = await runCommand(["sh", "-c", `${argv.join(" ")} 2>&1 </dev/null`], { cwd });
    expect(run.code).toBe(0);
    const events = everyLineIsJson(run.stdout);
    const results = Object.fromEntries(
      events.filter((e) => e.type === "command_result").map((e) => [e.id, [e.status, e.exit_code]]),
    );
    expect(results).toEqual({ ok: ["exited", 0], denied: ["denied", null], asked: ["refused", null] });
    expect(existsSync(join(cwd, "needs-a-person"))).toBe(false);
    expect(events.at(-1)).toMatchObject({ type: "end", status: "completed", refused: 1 });
    expect(run.stdout).not.toContain("Approve command?");
  });

  test("output over the cap: command_result names the file that holds all of it, the one the model is told of", async () => {
    const cwd = scratch();
    const srv = fixtures.serve([bash("seq 1 100000", "long"), done]);
    // With a session the saved outputs outlive the run (without one they go when it ends).
    const run = await runAic([...headless(srv.url), "--auto-approve", "--json", "--session", "s.json", "count"], {
      cwd,
    });
    expect(run.code).toBe(0);
    const result = everyLineIsJson(run.stdout).find((e) => e.type === "command_result");
    expect(typeof result.saved_to).toBe("string");
    expect(toolAnswer(srv.requests[1], "long")).toContain(result.saved_to);
    const whole = readFileSync(result.saved_to, "utf8").trim().split("\n");
    expect(whole).toHaveLength(100000);
    expect(whole.at(-1)).toBe("100000");
  });

  test("--fail-on-refusal turns a run that refused commands into exit 4", async () => {
    const cwd = scratch();
    writeFileSync(join(cwd, ".aicrules"), "allow echo *\n");
    const srv = fixtures.serve([bash("touch x", "asked"), done]);
    const run = await runAic([...headless(srv.url), "--json", "--fail-on-refusal", "go"], { cwd });
    expect(run.code).toBe(4);
    expect(jsonLines(run.stdout).at(-1)).toMatchObject({ type: "end", status: "completed", refused: 1, exit_code: 4 });
  });

  // Python's splitlines() and some JavaScript line readers also break lines at U+0085, U+2028 and U+2029.
  test("output holding Unicode line separators never splits a record", async () => {
    const srv = fixtures.serve([bash("printf 'a\\302\\205b\\342\\200\\250c\\342\\200\\251d'"), done]);
    const run = await runAic([...headless(srv.url), "--json", "--auto-approve", "go"]);
    expect(run.code).toBe(0);
    expect(run.stdout).not.toMatch(/[\u0085\u2028\u2029]/);
    const result = jsonLines(run.stdout).find((e) => e.type === "command_result");
    // (A terminal takes U+0085, NEL, as a new line: the command's screen shows one.)
    expect(result.output).toContain("b\u2028c\u2029d");
  });
});

describe("budgets and stalls end the run, the session saved", () => {
  test("--max-time stops the command in flight: status time_budget, exit 5", async () => {
    const cwd = scratch();
    const session = join(cwd, "s.json");
    const srv = fixtures.serve([bash("echo started; sleep 60", "slow"), done]);
    const run = await runAic(
      [...headless(srv.url), "--auto-approve", "--json", "--max-time", "2", "--session", session, "be slow"],
      { cwd },
    );
    // (Seen once under --parallel: exit 0 after 330 ms. What the run said goes with the failure.)
    if (run.code !== 5) console.error(`--max-time run ended ${run.code}:\n${run.stdout}\n${run.stderr}`);
    expect(run.code).toBe(5);
    const events = jsonLines(run.stdout);
    expect(events.find((e) => e.type === "command_result")).toMatchObject({ id: "slow", status: "stopped" });
    expect(events.at(-1)).toMatchObject({ type: "end", status: "time_budget", exit_code: 5 });
    expect(events.some((e) => e.type === "warning" && e.text.includes("--max-time 2 s"))).toBe(true);
    const saved = JSON.parse(readFileSync(session, "utf8"));
    expect(saved.messages.at(-1)).toMatchObject({ role: "tool", tool_call_id: "slow" });
  });

  test("three replies in a row without a tool call: stalled, exit 7", async () => {
    const srv = fixtures.serve([
      { content: "Which database should I use?" },
      { content: "Please tell me which database." },
      { content: "I need to know the database." },
      done,
    ]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--json", "set up a database"]);
    expect(run.code).toBe(7);
    expect(srv.requests).toHaveLength(3);
    expect(jsonLines(run.stdout).at(-1)).toMatchObject({ type: "end", status: "stalled", exit_code: 7 });
    const warnings = jsonLines(run.stdout).filter((e) => e.type === "warning");
    expect(warnings.some((w) => w.text.includes("3 replies in a row without a tool call"))).toBe(true);
  });

  test("the same command with the same result five times in a row: stalled, exit 7", async () => {
    const turns = Array.from({ length: 8 }, (_, i) => bash("cat missing.txt", `c${i}`));
    const srv = fixtures.serve(turns);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--json", "read it"]);
    expect(run.code).toBe(7);
    expect(srv.requests).toHaveLength(5);
    const warnings = jsonLines(run.stdout).filter((e) => e.type === "warning");
    expect(warnings.some((w) => w.text.includes("the same command with the same result 5 times in a row"))).toBe(true);
  });
});

describe("commands run in bash, afresh, with CI=true", () => {
  test("&> and [[ ]] work, and an error names the line as the model wrote it", async () => {
    const srv = fixtures.serve([
      bash("seq 3 &> out.txt; [[ -s out.txt ]] && echo nonempty; cat out.txt", "bashisms"),
      bash("true\nnot_a_command_anywhere", "lines"),
      done,
    ]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "go"]);
    expect(run.code).toBe(0);
    expect(toolAnswer(srv.requests[1], "bashisms")).toContain("nonempty\n1\n2\n3");
    expect(toolAnswer(srv.requests[2], "lines")).toMatch(/line 2: not_a_command_anywhere: command not found/);
    const system = srv.requests[0]!.body.messages[0].content as string;
    expect(system).toMatch(/Every command runs in bash \(\/bin\/bash -c\), in a fresh shell that starts in /);
  });

  test.skipIf(!has.node)("a watcher that honours CI=true finishes at once instead of watching", async () => {
    const cwd = scratch();
    // What vitest, jest and friends do: watch for changes unless CI is set.
    writeFileSync(
      join(cwd, "watch.js"),
      "if (process.env.CI) { console.log('1 test failed'); process.exit(1); }\nsetInterval(() => {}, 1000); console.log('watching for changes');\n",
    );
    const srv = fixtures.serve([bash("node watch.js", "test"), bash('echo "CI=[$CI]"', "env"), done]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--json", "run the tests"], { cwd });
    expect(run.code).toBe(0);
    const result = jsonLines(run.stdout).find((e) => e.type === "command_result" && e.id === "test");
    expect(result).toMatchObject({ status: "exited", exit_code: 1, output: "1 test failed" });
    expect(toolAnswer(srv.requests[2], "env")).toContain("CI=[true]");
    // --no-ci-env takes it away.
    const plain = fixtures.serve([bash('echo "CI=[$CI]"', "env"), done]);
    expect((await runAic([...headless(plain.url), "--auto-approve", "--no-ci-env", "look"], { cwd })).code).toBe(0);
    expect(toolAnswer(plain.requests[1], "env")).toContain("CI=[]");
  });
});

describe("background jobs the model can stop", () => {
  test.skipIf(!has.node || !has.npm)(
    "a dev server started with npm run dev & is stopped, children and all, by the command its job line names",
    async () => {
      const cwd = scratch();
      writeFileSync(join(cwd, "package.json"), JSON.stringify({ name: "x", scripts: { dev: "node server.js" } }));
      writeFileSync(
        join(cwd, "server.js"),
        "require('fs').writeFileSync('server.pid', String(process.pid)); setInterval(() => {}, 1000);\n",
      );
      let stop = "";
      const srv = fixtures.serve((req, i) => {
        if (i === 0) return bash("npm run dev > dev.log 2>&1 &", "start");
        if (i === 1) return bash("while [ ! -s server.pid ]; do sleep 0.05; done; cat server.pid", "wait");
        if (i === 2) {
          const answer = String(req.body.messages.at(-1).content);
          stop = /stop it with: (kill -- -\d+)/.exec(answer)?.[1] ?? "echo no-stop-command-named";
          return bash(stop, "stop");
        }
        if (i === 3)
          return bash(
            "p=$(cat server.pid); for i in $(seq 100); do kill -0 $p 2>/dev/null || break; sleep 0.05; done; kill -0 $p 2>/dev/null && echo server-alive || echo server-gone",
            "after",
          );
        return done;
      });
      const run = await runAic([...headless(srv.url), "--auto-approve", "--json", "start the dev server"], {
        cwd,
      });
      expect(run.code).toBe(0);
      expect(stop).toMatch(/^kill -- -\d+$/);
      // The server's pid as it saw it (in the jail, the jail's own numbering); gone by the end of the run either way,
      // so the check is the model's own: the stop command's result says the job ended (below).
      expect(Number(readFileSync(join(cwd, "server.pid"), "utf8"))).toBeGreaterThan(1);
      expect(toolAnswer(srv.requests[1], "start")).not.toContain("%1");
      // The stop's own result reports the job ended, once; it is never said to run again.
      expect(toolAnswer(srv.requests[3], "stop")).toMatch(/\[job 1\] ended after/);
      expect(toolAnswer(srv.requests[4], "after")).not.toContain("[job 1]");
      // Seen from inside, where the pid it recorded means what it says: the server itself is gone, not just npm.
      expect(toolAnswer(srv.requests[4], "after")).toContain("server-gone");
    },
  );
});

describe("what the model's endpoint is told and shown", () => {
  test("redaction hides credentials, not words: a routing header's value is shown, a key's is not", async () => {
    const srv = fixtures.serve([
      httpError(400, { error: { message: "provider openai refused: bad token sekrit-token-99 for model" } }),
    ]);
    const run = await runAic([
      ...headless(srv.url),
      "--header",
      "x-portkey-provider: openai",
      "--header",
      "Authorization: Bearer sekrit-token-99",
      "go",
    ]);
    expect(run.code).toBe(1);
    expect(run.stderr).toContain("provider openai refused");
    expect(run.stderr).not.toContain("sekrit-token-99");
    expect(run.stderr).toContain("[redacted]");
    expect(srv.requests[0]!.headers["x-portkey-provider"]).toBe("openai");
  });

  test("OpenAI's own models get no max_tokens or chat_template_kwargs; an open-weight gpt-oss does", async () => {
    for (const [model, sends] of [
      ["gpt-4.1-mini", false],
      ["openai/gpt-oss-120b", true],
    ] as const) {
      const srv = fixtures.serve([done]);
      expect((await runAic([...headless(srv.url, model), "go"])).code).toBe(0);
      const body = srv.requests[0]!.body;
      expect([model, body.max_tokens !== undefined, body.chat_template_kwargs !== undefined]).toEqual([
        model,
        sends,
        sends,
      ]);
    }
  });
});

describe("a command stopped for printing too much", () => {
  // The person is told why, not only the model: the plain line names the limit and the flag it follows.
  test("the plain result line names the runaway limit and its flag", async () => {
    const srv = fixtures.serve([bash("yes | head -c 3000000", "big"), { content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--auto-approve", "--max-output-bytes", "1000", "flood"], {
      cwd: scratch(),
    });
    expect(run.code).toBe(0);
    expect(run.stdout).toMatch(
      /\[stopped: it printed more than 100 × --max-output-bytes, the runaway limit \(exit code \d+\)\]/,
    );
  });
});

// A new user's finding: one "Always allow" clicked in the TUI (the person's own rules, kept in aic's state) made a
// CI run whose fix was refused for want of a person end "completed" with exit 0.
describe("the person's own rules do not change what a refusal means", () => {
  test("with only Always allow rules, a command that needs a person still ends the run with exit 4", async () => {
    const dir = scratch("aic-own-rules-");
    const state = join(dir, ".state");
    const st = statSync(dir);
    const own = join(state, "aic", "own-rules", `${st.dev}-${st.ino}.aicrules`);
    mkdirSync(join(state, "aic", "own-rules"), { recursive: true });
    writeFileSync(own, "allow npm ls *\n");
    writeFileSync(join(dir, "README.md"), "aic\n");
    const srv = fixtures.serve([bash("sed -i s/aic/AIC/ README.md", "fix"), { content: "Done. TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url), "--no-session", "capitalise aic"], {
      cwd: dir,
      env: { XDG_STATE_HOME: state },
    });
    expect(run.code).toBe(4);
    expect(readFileSync(join(dir, "README.md"), "utf8")).toBe("aic\n");
  });
});
