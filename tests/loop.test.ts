/**
 * End-to-end tests of the agent loop (README: "Usage" and its options, "How it works" for the loop
 * and the request shape, the approval prompt and JSON Lines of "Output without the TUI"): the compiled dist/aic against the
 * fake OpenAI server, with real commands run in real PTYs inside scratch directories.
 */
import { describe, expect, test } from "bun:test";
import { existsSync, mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import type { RecordedRequest } from "./fake-openai.ts";
import {
  bash,
  documentedOptions,
  headless,
  jsonLines,
  messagesOf,
  perTestFixtures,
  runAic,
  scratch,
  toolAnswer,
} from "./helpers.ts";

const fixtures = perTestFixtures();

const toolMessages = (req: RecordedRequest | undefined) => messagesOf(req).filter((m) => m.role === "tool");

/** Every assistant message with tool calls is followed by exactly one tool message per call, ids in order. */
function expectCallsAnsweredInOrder(messages: any[]) {
  for (let i = 0; i < messages.length; i++) {
    const calls = messages[i].role === "assistant" ? (messages[i].tool_calls ?? []) : [];
    calls.forEach((call: any, k: number) => {
      expect(messages[i + 1 + k]?.role).toBe("tool");
      expect(messages[i + 1 + k]?.tool_call_id).toBe(call.id);
    });
  }
}

/** The JSON.parse error text for `text`, as the same JavaScript engine reports it. */
function parseErrorOf(text: string): string {
  try {
    JSON.parse(text);
  } catch (error) {
    return (error as Error).message;
  }
  throw new Error(`expected invalid JSON: ${text}`);
}

describe("a task end to end", () => {
  // Create, check, finish; the requests have the documented shape and the system prompt never changes.
  test("three-step task with --auto-approve completes and sends well-formed requests", async () => {
    const srv = fixtures.serve([
      bash("echo hello > made.txt", "call_make"),
      bash("cat made.txt", "call_check"),
      { content: "Verified. TASKCOMPLETE" },
    ]);
    const cwd = scratch();
    const run = await runAic([...headless(srv.url, "qwen3-coder", "--auto-approve"), "create made.txt"], { cwd });

    expect(run.code).toBe(0);
    expect(readFileSync(join(cwd, "made.txt"), "utf8")).toBe("hello\n");
    expect(srv.requests).toHaveLength(3);

    for (const req of srv.requests) {
      const b = req.body;
      expect(b.messages[0].role).toBe("system");
      expect(b.messages[1]).toEqual({ role: "user", content: "create made.txt" });
      expect(b.stream).toBe(true);
      expect(b.stream_options).toEqual({ include_usage: true });
      expect(b.tools).toHaveLength(1);
      expect(b.tools[0].type).toBe("function");
      expect(b.tools[0].function.name).toBe("execute_bash");
      expect(b.tools[0].function.parameters.properties.command.type).toBe("string");
      expect(b.tool_choice).toBe("auto");
      expect(b.temperature).toBe(0.2);
      expect(b.max_tokens).toBe(8000);
      expect(b.chat_template_kwargs).toEqual({ enable_thinking: true });
      expect(req.headers["user-agent"]).toMatch(/^Mozilla\/5\.0 \(.+\) .*(Chrome|Firefox|Safari)\//);
      expectCallsAnsweredInOrder(b.messages);
    }

    const final = messagesOf(srv.requests[2]);
    expect(toolAnswer(srv.requests[2], "call_make")).toStartWith("Command executed with exit code 0.");
    expect(toolAnswer(srv.requests[2], "call_check")).toContain("hello");
    expect(final.filter((m) => m.role === "assistant").map((m) => m.tool_calls[0].id)).toEqual([
      "call_make",
      "call_check",
    ]);

    const systemPrompts = new Set(srv.requests.map((r) => r.body.messages[0].content));
    expect(systemPrompts.size).toBe(1);
    expect([...systemPrompts][0]).toContain("TASKCOMPLETE");
  });

  // `max_tokens` and `chat_template_kwargs` are only for models whose name lacks "gpt".
  test("a gpt model gets neither max_tokens nor chat_template_kwargs", async () => {
    const srv = fixtures.serve([bash("true"), { content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url, "gpt-4o-mini", "--auto-approve"), "do it"]);

    expect(run.code).toBe(0);
    expect(srv.requests).toHaveLength(2);
    for (const req of srv.requests) {
      expect(req.body.model).toBe("gpt-4o-mini");
      expect("max_tokens" in req.body).toBe(false);
      expect("chat_template_kwargs" in req.body).toBe(false);
      expect(req.body.tool_choice).toBe("auto");
      expect(req.body.temperature).toBe(0.2);
    }
  });
});

describe("approval gate in --nogui", () => {
  // `y` approves: the command runs and its result goes back to the model.
  test("y approves and the command runs", async () => {
    const srv = fixtures.serve([bash("touch approved.txt", "call_y")]);
    const cwd = scratch();
    const run = await runAic([...headless(srv.url), "make a file"], { cwd, stdin: "y\n" });

    expect(run.code).toBe(0);
    expect(existsSync(join(cwd, "approved.txt"))).toBe(true);
    expect(run.stderr).toContain("Approve command? (y/n/suggestion): touch approved.txt");
    expect(toolAnswer(srv.requests[1], "call_y")).toStartWith("Command executed with exit code 0.\nOutput:\n");
  });

  // An empty line approves, like `y`.
  test("an empty line approves", async () => {
    const srv = fixtures.serve([bash("touch approved.txt", "call_empty")]);
    const cwd = scratch();
    const run = await runAic([...headless(srv.url), "make a file"], { cwd, stdin: "\n" });

    expect(run.code).toBe(0);
    expect(existsSync(join(cwd, "approved.txt"))).toBe(true);
    expect(toolAnswer(srv.requests[1], "call_empty")).toStartWith("Command executed with exit code 0.");
  });

  // `n` rejects: the command does not run and the model is told so in exactly these words.
  test("n rejects and the command does not run", async () => {
    const srv = fixtures.serve([bash("touch rejected.txt", "call_n")]);
    const cwd = scratch();
    const run = await runAic([...headless(srv.url), "make a file"], { cwd, stdin: "n\n" });

    expect(run.code).toBe(0);
    expect(existsSync(join(cwd, "rejected.txt"))).toBe(false);
    expect(toolAnswer(srv.requests[1], "call_n")).toBe("Command execution skipped by user.");
  });

  // Any other answer is a suggestion: skipped result, then the suggestion as a user message.
  test("any other line is a suggestion sent after the tool message", async () => {
    const srv = fixtures.serve([bash("touch suggested.txt", "call_s")]);
    const cwd = scratch();
    const run = await runAic([...headless(srv.url), "make a file"], { cwd, stdin: "please use ls -la\n" });

    expect(run.code).toBe(0);
    expect(existsSync(join(cwd, "suggested.txt"))).toBe(false);
    const tail = messagesOf(srv.requests[1]).slice(-3);
    expect(tail[0].role).toBe("assistant");
    expect(tail[1]).toEqual({ role: "tool", tool_call_id: "call_s", content: "Command execution skipped by user." });
    expect(tail[2]).toEqual({ role: "user", content: "I suggest you please use ls -la" });
  });

  // End of input while an answer is needed: stop with exit 4 and point at --auto-approve, never hang.
  test("stdin at EOF exits 4 promptly without running the command", async () => {
    const srv = fixtures.serve([bash("touch never.txt", "call_eof")]);
    const cwd = scratch();
    const run = await runAic([...headless(srv.url), "make a file"], { cwd, stdin: "", killAfterMs: 60_000 });

    // Exit 4 is aic's own verdict: a run stuck waiting for an answer would meet the 60 s guard's SIGKILL (137).
    expect(run.code).toBe(4);
    expect(run.stderr).toContain("--auto-approve");
    expect(existsSync(join(cwd, "never.txt"))).toBe(false);
    expect(srv.requests).toHaveLength(1);
  });
});

describe("turn handling", () => {
  // Invalid JSON arguments are answered with the parse error and how to write JSON; the run recovers.
  test("malformed tool-call JSON gets an explanatory tool message and the run recovers", async () => {
    const badArgs = `{"command": 'ls'}`;
    const srv = fixtures.serve([
      { toolCalls: [{ id: "call_bad", arguments: badArgs }] },
      bash("touch recovered.txt", "call_good"),
      { content: "TASKCOMPLETE" },
    ]);
    const cwd = scratch();
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "list files"], { cwd });

    expect(run.code).toBe(0);
    expect(srv.requests).toHaveLength(3);
    const answer = toolAnswer(srv.requests[1], "call_bad");
    expect(answer).toContain(parseErrorOf(badArgs));
    expect(answer).toMatch(/double quotes/i);
    expect(existsSync(join(cwd, "recovered.txt"))).toBe(true);
    expect(toolAnswer(srv.requests[2], "call_good")).toStartWith("Command executed with exit code 0.");
  });

  // An answer with neither tools nor the marker gets a continuation message.
  test("an answer without tools or marker is followed by a continuation message", async () => {
    const srv = fixtures.serve([{ content: "I think the files are fine." }, { content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "check the files"]);

    expect(run.code).toBe(0);
    expect(srv.requests).toHaveLength(2);
    const nudge = messagesOf(srv.requests[1]).at(-1);
    expect(nudge.role).toBe("user");
    expect(nudge.content).toMatch(/without (calling )?(a |any )?tools?/i);
    expect(nudge.content).toContain("TASKCOMPLETE");
    expect(nudge.content).toContain("execute_bash");
  });

  // --max-steps, and its exit code 3: a model that never finishes is stopped after exactly N requests.
  test("--max-steps 3 against a model that never finishes exits 3 after 3 requests", async () => {
    const srv = fixtures.serve(() => bash("true"));
    const run = await runAic([
      ...headless(srv.url, "test-model", "--auto-approve", "--max-steps", "3"),
      "loop forever",
    ]);

    expect(run.code).toBe(3);
    expect(srv.requests).toHaveLength(3);
  });

  // Other functions and calls without a command get the documented results.
  test("unknown function and empty arguments get their fixed answers", async () => {
    const srv = fixtures.serve([
      { toolCalls: [{ id: "call_unknown", name: "run_python", arguments: JSON.stringify({ code: "print(1)" }) }] },
      { toolCalls: [{ id: "call_empty", arguments: "{}" }] },
      { content: "TASKCOMPLETE" },
    ]);
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "do it"]);

    expect(run.code).toBe(0);
    expect(srv.requests).toHaveLength(3);
    expect(toolAnswer(srv.requests[1], "call_unknown")).toBe("Unknown function: run_python");
    expect(toolAnswer(srv.requests[2], "call_empty")).toBe("No arguments provided for function call");
    expectCallsAnsweredInOrder(messagesOf(srv.requests[2]));
  });

  // A turn with tool calls is never final, even when its text says TASKCOMPLETE.
  test("TASKCOMPLETE in a turn with tool calls is not final", async () => {
    const srv = fixtures.serve([
      { content: "Finishing up. TASKCOMPLETE", ...bash("touch late.txt", "call_late") },
      { content: "TASKCOMPLETE" },
    ]);
    const cwd = scratch();
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "do it"], { cwd });

    expect(run.code).toBe(0);
    expect(existsSync(join(cwd, "late.txt"))).toBe(true);
    expect(srv.requests).toHaveLength(2);
    expect(toolAnswer(srv.requests[1], "call_late")).toStartWith("Command executed with exit code 0.");
  });

  // A lone `-` as the request reads the task from stdin to EOF.
  test("- reads the request from stdin", async () => {
    const piped = "Count the files in this directory.\nThen report the number.\n";
    const srv = fixtures.serve([]);
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "-"], { stdin: piped });

    expect(run.code).toBe(0);
    const user = messagesOf(srv.requests[0])[1];
    expect(user.role).toBe("user");
    expect(user.content.trimEnd()).toBe(piped.trimEnd());
  });
});

describe("tool-call assembly from the stream", () => {
  // Missing index, id only on the first fragment, arguments in 7 pieces: one call, run once.
  test("fragments without index are assembled into one call", async () => {
    const args = JSON.stringify({ command: "echo once >> once.txt" });
    const srv = fixtures.serve([{ toolCalls: [{ id: "call_frag", arguments: args }], omitIndex: true, argPieces: 7 }]);
    const cwd = scratch();
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "do it"], { cwd });

    expect(run.code).toBe(0);
    expect(readFileSync(join(cwd, "once.txt"), "utf8")).toBe("once\n");
    const assistant = messagesOf(srv.requests[1]).find((m) => m.role === "assistant");
    expect(assistant.tool_calls).toHaveLength(1);
    expect(assistant.tool_calls[0].id).toBe("call_frag");
    expect(assistant.tool_calls[0].function).toEqual({ name: "execute_bash", arguments: args });
    expect(toolMessages(srv.requests[1]).map((m) => m.tool_call_id)).toEqual(["call_frag"]);
  });

  // Two calls in one turn run once each, in order, and are answered in order.
  test("two parallel calls run in order and are both answered", async () => {
    const srv = fixtures.serve([
      {
        toolCalls: [
          { id: "call_first", arguments: JSON.stringify({ command: "echo first >> order.txt" }) },
          { id: "call_second", arguments: JSON.stringify({ command: "echo second >> order.txt" }) },
        ],
        argPieces: 3,
      },
    ]);
    const cwd = scratch();
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "do it"], { cwd });

    expect(run.code).toBe(0);
    expect(readFileSync(join(cwd, "order.txt"), "utf8")).toBe("first\nsecond\n");
    const messages = messagesOf(srv.requests[1]);
    expect(messages.find((m) => m.role === "assistant").tool_calls.map((c: any) => c.id)).toEqual([
      "call_first",
      "call_second",
    ]);
    expect(toolMessages(srv.requests[1]).map((m) => m.tool_call_id)).toEqual(["call_first", "call_second"]);
    expectCallsAnsweredInOrder(messages);
  });

  // A call streamed with no id at all is given one rather than dropped.
  test("a call without an id is given one and answered under it", async () => {
    const srv = fixtures.serve([{ ...bash("touch idless.txt"), omitIds: true }]);
    const cwd = scratch();
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "do it"], { cwd });

    expect(run.code).toBe(0);
    expect(existsSync(join(cwd, "idless.txt"))).toBe(true);
    const messages = messagesOf(srv.requests[1]);
    const assistant = messages.find((m) => m.role === "assistant");
    const id = assistant.tool_calls[0].id;
    expect(typeof id).toBe("string");
    expect(id.length).toBeGreaterThan(0);
    expect(id).not.toBe("call_0_0"); // the id the fake would have sent: aic made this one up
    expect(toolMessages(srv.requests[1]).map((m) => m.tool_call_id)).toEqual([id]);
  });
});

describe("output without the TUI", () => {
  // --json: one JSON object per line with type and ts, covering the documented event types.
  test("--json prints only JSON Lines events with the documented fields", async () => {
    const srv = fixtures.serve([
      bash("echo json-visible > j.txt && cat j.txt", "call_j"),
      { content: "Done. TASKCOMPLETE" },
    ]);
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve", "--json"), "do it"]);

    expect(run.code).toBe(0);
    const lines = run.stdout.split("\n").filter((l) => l !== "");
    expect(lines.length).toBeGreaterThan(0);
    for (const line of lines) expect(() => JSON.parse(line)).not.toThrow();
    const events = jsonLines(run.stdout);
    for (const e of events) {
      expect(typeof e.type).toBe("string");
      expect(Number.isNaN(Date.parse(e.ts))).toBe(false);
    }
    const types = new Set(events.map((e) => e.type));
    for (const t of ["start", "assistant", "command", "approval", "command_result", "usage", "end"])
      expect(types).toContain(t);

    const result = events.find((e) => e.type === "command_result");
    expect(result.exit_code).toBe(0);
    // The output as the person saw it; the model's tool answer is that with aic's words around it.
    expect(result.output).toBe("json-visible");
    expect(toolAnswer(srv.requests[1], "call_j")).toStartWith(
      `Command executed with exit code 0.\nOutput:\n${result.output}`,
    );

    const end = events.at(-1);
    expect(end.type).toBe("end");
    expect(end.status).toBe("completed");
    expect(end.exit_code).toBe(0);
    expect(end.steps).toBe(2);
    expect(typeof end.usage).toBe("object");
    expect(end.usage.input_tokens).toBeGreaterThan(0);
  });

  // The marker is hidden from stdout even when it arrives split across chunks.
  test("TASKCOMPLETE never reaches stdout in text mode, even split across chunks", async () => {
    // 22 characters in 5 pieces: "All d", "one. ", "TASKC", "OMPLE", "TE".
    const srv = fixtures.serve([{ content: "All done. TASKCOMPLETE", contentPieces: 5 }]);
    const run = await runAic([...headless(srv.url), "finish"]);

    expect(run.code).toBe(0);
    expect(run.stdout).toContain("All done.");
    expect(run.stdout).not.toContain("TASKCOMPLETE");
    expect(run.stdout).not.toContain("TASKC");
  });
});

describe("command line", () => {
  const dead = "http://127.0.0.1:9/v1";
  // Bad input: exit 2, one line on stderr naming the flag, and no model call.
  const usageCases: { name: string; args: (url: string) => string[]; mentions: string[] }[] = [
    {
      name: "missing --api-base",
      args: () => ["--nogui", "--model", "m", "task"],
      mentions: ["--api-base", "AIC_API_BASE"],
    },
    { name: "missing --model", args: (u) => ["--nogui", "--api-base", u, "task"], mentions: ["--model", "AIC_MODEL"] },
    { name: "--timeout abc", args: (u) => [...headless(u), "--timeout", "abc", "task"], mentions: ["--timeout"] },
    { name: "--timeout 0", args: (u) => [...headless(u), "--timeout", "0", "task"], mentions: ["--timeout"] },
    {
      name: "--compress-target 1.5",
      args: (u) => [...headless(u), "--compress-target", "1.5", "task"],
      mentions: ["--compress-target"],
    },
    { name: "--nogui without request", args: (u) => headless(u), mentions: ["--nogui"] },
    {
      name: "--json without --nogui",
      args: (u) => ["--json", "--api-base", u, "--model", "m", "task"],
      mentions: ["--json"],
    },
    {
      name: "--session with --no-session",
      args: (u) => [...headless(u), "--session", "x", "--no-session", "task"],
      mentions: ["--session", "--no-session"],
    },
    { name: "unknown flag", args: (u) => [...headless(u), "--frobnicate", "task"], mentions: ["--frobnicate"] },
  ];
  for (const c of usageCases) {
    test(`usage error: ${c.name} exits 2 with one line naming the flag`, async () => {
      const srv = fixtures.serve([]);
      const cwd = scratch();
      const run = await runAic(c.args(srv.url), { cwd, killAfterMs: 30_000 });

      expect(run.code).toBe(2);
      const lines = run.stderr.trimEnd().split("\n");
      expect(lines).toHaveLength(1);
      for (const m of c.mentions) expect(lines[0]).toContain(m);
      expect(srv.requests).toHaveLength(0);
      expect(existsSync(join(cwd, "x"))).toBe(false);
    });
  }

  // Env fallbacks: AIC_API_BASE and AIC_MODEL replace the flags; AIC_API_BASE wins over OPENAI_BASE_URL.
  test("AIC_API_BASE and AIC_MODEL stand in for the flags", async () => {
    const srv = fixtures.serve([]);
    const run = await runAic(["--nogui", "task"], {
      env: { AIC_API_BASE: srv.url, AIC_MODEL: "env-model", OPENAI_BASE_URL: dead },
    });

    expect(run.code).toBe(0);
    expect(srv.requests).toHaveLength(1);
    expect(srv.requests[0]!.body.model).toBe("env-model");
  });

  // OPENAI_BASE_URL is the second fallback for the base URL.
  test("OPENAI_BASE_URL is used when AIC_API_BASE is unset", async () => {
    const srv = fixtures.serve([]);
    const run = await runAic(["--nogui", "task"], { env: { OPENAI_BASE_URL: srv.url, AIC_MODEL: "env-model" } });

    expect(run.code).toBe(0);
    expect(srv.requests).toHaveLength(1);
  });

  test("--version prints a version and exits 0", async () => {
    const run = await runAic(["--version"]);
    expect(run.code).toBe(0);
    expect(run.stdout).toMatch(/\d+\.\d+\.\d+/);
  });

  // --help lists every option of the README's options table.
  test("--help exits 0 and lists every flag", async () => {
    const run = await runAic(["--help"]);
    expect(run.code).toBe(0);
    const flags = documentedOptions();
    expect(flags.length).toBeGreaterThanOrEqual(21);
    for (const flag of flags) expect(run.stdout).toMatch(new RegExp(`(?<![\\w-])${flag}(?![\\w-])`));
  });

  // An unknown --compress-alg is a warning, not an error: the run goes on with truncate.
  test("unknown --compress-alg warns and still runs", async () => {
    const srv = fixtures.serve([]);
    const run = await runAic([...headless(srv.url, "test-model", "--compress-alg", "foo"), "task"]);

    expect(run.code).toBe(0);
    expect(run.stderr).toContain("--compress-alg");
    expect(run.stderr).toContain("foo");
    expect(run.stderr).toContain("truncate");
    expect(srv.requests).toHaveLength(1);
  });
});

describe("project instructions", () => {
  // AGENTS.md files from the git root down to the cwd are appended to the system prompt, root first;
  // one above the git root is not.
  test("AGENTS.md from the git root and the subdirectory are appended, root first", async () => {
    const outer = scratch();
    writeFileSync(join(outer, "AGENTS.md"), "OUTER-RULE: outside the repository.\n");
    const repo = join(outer, "repo");
    const sub = join(repo, "pkg", "sub");
    mkdirSync(sub, { recursive: true });
    const init = Bun.spawnSync(["git", "init", "-q", repo]);
    expect(init.exitCode).toBe(0);
    writeFileSync(join(repo, "AGENTS.md"), "ROOT-RULE: run the tests with make.\n");
    writeFileSync(join(sub, "AGENTS.md"), "SUB-RULE: this package uses tabs.\n");

    const srv = fixtures.serve([bash("true"), { content: "TASKCOMPLETE" }]);
    const run = await runAic([...headless(srv.url, "test-model", "--auto-approve"), "task"], { cwd: sub });

    expect(run.code).toBe(0);
    const system: string = srv.requests[0]!.body.messages[0].content;
    const root = system.indexOf("ROOT-RULE: run the tests with make.");
    const leaf = system.indexOf("SUB-RULE: this package uses tabs.");
    expect(root).toBeGreaterThan(0);
    expect(leaf).toBeGreaterThan(root);
    expect(system.indexOf("TASKCOMPLETE")).toBeLessThan(root);
    expect(system.slice(0, root)).toContain("AGENTS.md");
    expect(system).not.toContain("OUTER-RULE");
    expect(srv.requests[1]!.body.messages[0].content).toBe(system);
  });
});
