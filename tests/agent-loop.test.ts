/**
 * The loop in-process (README: "How it works"): a scripted model through the
 * Agent's model port, the real run around it (PTYs, rules, checkpoints, the
 * tool-call gate). Behaviours of the loop that need no HTTP and no compiled
 * binary are tested here, each in milliseconds: steering, suggestions, every
 * tool call answered once, --done-when, compression and stall detection. The
 * end-to-end tests (loop, ralph-loop, unattended, compression) keep what only
 * the binary shows: exit codes, stdout and stderr, sessions.
 */
import { describe, expect, test } from "bun:test";
import { existsSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { type Agent, type CompletionRequest, type FrontEnd, type Message } from "../aic.ts";
import { reapAfterAll, requestSequenceProblems, scratch, waitFor } from "./helpers.ts";
import { RecordingSink, ScriptedModel, type ScriptedTurn, runInProcess } from "./scripted-model.ts";

reapAfterAll();

const SKIPPED_BY_USER = "Command execution skipped by user.";
const SKIPPED_AFTER_SUGGESTION =
  "Command not executed: the user rejected an earlier command of this turn with a suggestion.";
const CONTINUE_PREFIX = "You answered without calling a tool.";

/** Runs in a scratch directory that the file's afterAll removes. */
const run = (model: ScriptedModel, flags: string[], request: string, front?: Partial<FrontEnd>) =>
  runInProcess(model, flags, request, { cwd: scratch("aic-loop-"), front });

/** The tool messages of a request, as [id, content]. */
const toolMessages = (messages: Message[]) =>
  messages.filter((m) => m.role === "tool").map((m) => [m.tool_call_id, String(m.content)] as const);

/** A run whose agent the test holds while it works: what steering needs, since a suggestion arrives while a command runs. */
function liveRun(model: ScriptedModel, flags: string[], request: string) {
  const cwd = scratch("aic-live-");
  let agent: Agent | undefined;
  // runInProcess hands the agent over before its first await, so it is there when this returns.
  const done = runInProcess(model, flags, request, { cwd, onAgent: (a) => (agent = a) }).then((r) => r.outcome);
  return { agent: agent!, cwd, done };
}

describe("the loop with a scripted model", () => {
  test("a command runs, its result reaches the model once, and TASKCOMPLETE ends the run", async () => {
    const model = new ScriptedModel([{ content: "Making it.", calls: ["echo hello > made.txt && cat made.txt"] }]);
    const { outcome, sink, cwd } = await run(model, ["--auto-approve"], "make a file");
    expect(outcome.status).toBe("completed");
    expect(existsSync(join(cwd, "made.txt"))).toBe(true);
    const tool = model.messages(1).filter((m) => m.role === "tool");
    expect(tool).toHaveLength(1);
    expect(String(tool[0]!.content)).toContain("hello");
    expect(sink.of("command_result")[0]?.exit_code).toBe(0);
  });
});

describe("steering: text typed while the agent works", () => {
  // The command waits for a file the test makes only after the suggestion is queued, so the suggestion
  // certainly arrives while the command runs.
  test("a suggestion queued during a command joins the next request after the command's result", async () => {
    const model = new ScriptedModel([{ calls: ["touch started; while [ ! -f go ]; do sleep 0.02; done; echo went"] }]);
    const live = liveRun(model, ["--auto-approve"], "wait for go");
    await waitFor("the command to start", () => existsSync(join(live.cwd, "started")));
    live.agent.suggest("use python instead");
    writeFileSync(join(live.cwd, "go"), "");
    const outcome = await live.done;

    expect(outcome.status).toBe("completed");
    expect(model.requests).toHaveLength(2);
    expect(JSON.stringify(model.messages(0))).not.toContain("[Suggestion from user]");
    const [call, tool, steer] = model.messages(1).slice(-3);
    expect(call!.role).toBe("assistant");
    expect(tool!.role).toBe("tool");
    expect(String(tool!.content)).toContain("went");
    expect(steer).toEqual({ role: "user", content: "[Suggestion from user] use python instead" });
  });

  // TASKCOMPLETE is not final while a suggestion typed during that step waits: the model hears it first.
  test("a claim of completion made while a suggestion waits is not final", async () => {
    let live: ReturnType<typeof liveRun> | undefined;
    const model = new ScriptedModel((_req, index) => {
      if (index === 0) live!.agent.suggest("also write a README");
      return { content: "TASKCOMPLETE" };
    });
    live = liveRun(model, ["--auto-approve"], "do it");
    const outcome = await live.done;

    expect(outcome.status).toBe("completed");
    expect(model.requests).toHaveLength(2);
    expect(model.messages(1).at(-1)).toEqual({ role: "user", content: "[Suggestion from user] also write a README" });
  });
});

describe("a suggestion in answer to an approval", () => {
  // The first command is answered with a suggestion: it and the rest of the turn do not run; each call
  // still gets its answer, and the suggestion follows them as the person's words.
  test("skips the rest of the turn, answers every call, and adds 'I suggest you …'", async () => {
    const asked: string[] = [];
    const model = new ScriptedModel([{ calls: ["touch one.txt", "touch two.txt", "touch three.txt"] }]);
    const { outcome, sink, cwd } = await run(model, [], "make three files", {
      approve: async (request) => {
        asked.push(request.command);
        return { kind: "suggest", text: "make them in one command" };
      },
    });

    expect(outcome.status).toBe("completed");
    expect(asked).toEqual(["touch one.txt"]);
    for (const f of ["one.txt", "two.txt", "three.txt"]) expect(existsSync(join(cwd, f))).toBe(false);
    const sent = model.messages(1);
    expect(toolMessages(sent)).toEqual([
      ["call_0_0", SKIPPED_BY_USER],
      ["call_0_1", SKIPPED_AFTER_SUGGESTION],
      ["call_0_2", SKIPPED_AFTER_SUGGESTION],
    ]);
    expect(sent.at(-1)).toEqual({ role: "user", content: "I suggest you make them in one command" });
    expect(requestSequenceProblems(sent)).toEqual([]);
    expect(sink.of("approval").map((a) => [a.id, a.decision, a.suggestion])).toEqual([
      ["call_0_0", "suggestion", "make them in one command"],
    ]);
  });

  // A plain rejection skips only its own command; the next one of the turn is still asked about and runs.
  test("a plain rejection skips only that command", async () => {
    const model = new ScriptedModel([{ calls: ["touch rejected.txt", "touch approved.txt"] }]);
    const { cwd } = await run(model, [], "make files", {
      approve: async (request) => ({ kind: request.command.includes("rejected") ? "reject" : "approve" }),
    });
    expect(existsSync(join(cwd, "rejected.txt"))).toBe(false);
    expect(existsSync(join(cwd, "approved.txt"))).toBe(true);
    const answers = toolMessages(model.messages(1));
    expect(answers[0]).toEqual(["call_0_0", SKIPPED_BY_USER]);
    expect(answers[1]![1]).toStartWith("Command executed with exit code 0.");
    expect(model.messages(1).at(-1)!.role).toBe("tool");
  });
});

describe("every tool call of a turn is answered exactly once", () => {
  // One turn with everything that can go wrong with a call, in order: two commands, an unknown function,
  // empty arguments, arguments that are not JSON, a command answered with a suggestion, and a call after it.
  test("parallel calls, an unknown function, empty and broken arguments, a call after a suggestion", async () => {
    const model = new ScriptedModel([
      {
        calls: [
          "echo first",
          "echo second",
          { id: "unknown", name: "read_file", arguments: JSON.stringify({ path: "x" }) },
          { id: "empty", name: "execute_bash", arguments: "" },
          { id: "no-command", name: "execute_bash", arguments: "{}" },
          { id: "broken", name: "execute_bash", arguments: '{"command": "echo unterminated' },
          { id: "suggested", name: "execute_bash", arguments: JSON.stringify({ command: "touch suggested.txt" }) },
          { id: "after", name: "execute_bash", arguments: JSON.stringify({ command: "touch after.txt" }) },
        ],
      },
    ]);
    const { cwd } = await run(model, [], "do several things", {
      approve: async () => ({ kind: "suggest", text: "stop touching files" }),
    });

    const sent = model.messages(1);
    expect(requestSequenceProblems(sent)).toEqual([]);
    const answers = new Map<string, string[]>();
    for (const [id, content] of toolMessages(sent)) answers.set(id!, [...(answers.get(id!) ?? []), content]);
    const ids = ["call_0_0", "call_0_1", "unknown", "empty", "no-command", "broken", "suggested", "after"];
    expect([...answers.keys()]).toEqual(ids);
    for (const id of ids) expect(answers.get(id)).toHaveLength(1);
    const answer = (id: string) => answers.get(id)![0]!;
    expect(answer("call_0_0")).toContain("first");
    expect(answer("call_0_1")).toContain("second");
    expect(answer("unknown")).toBe("Unknown function: read_file");
    expect(answer("empty")).toBe("No arguments provided for function call");
    expect(answer("no-command")).toBe("No arguments provided for function call");
    expect(answer("broken")).toStartWith("Error: the arguments of your execute_bash call are not valid JSON");
    expect(answer("suggested")).toBe(SKIPPED_BY_USER);
    expect(answer("after")).toBe(SKIPPED_AFTER_SUGGESTION);
    expect(sent.at(-1)).toEqual({ role: "user", content: "I suggest you stop touching files" });
    expect(existsSync(join(cwd, "suggested.txt"))).toBe(false);
    expect(existsSync(join(cwd, "after.txt"))).toBe(false);
  });

  // Nobody to ask (no rules file): the run ends needing approval, and the calls it never reached are
  // answered too, so the history it leaves could be sent as it is.
  test("a run that ends for want of a person halfway through a turn answers the calls it never reached", async () => {
    const model = new ScriptedModel([{ calls: ["echo ran", "touch needs-a-person.txt", "touch never-reached.txt"] }]);
    const { outcome, agent, cwd } = await run(model, [], "do it");

    expect(outcome.status).toBe("needs_approval");
    expect(outcome.exitCode).toBe(4);
    expect(model.requests).toHaveLength(1);
    expect(existsSync(join(cwd, "needs-a-person.txt"))).toBe(false);
    expect(requestSequenceProblems(agent.messages)).toEqual([]);
    const answers = toolMessages(agent.messages);
    expect(answers.map(([id]) => id)).toEqual(["call_0_0", "call_0_1", "call_0_2"]);
    expect(answers[0]![1]).toContain("ran");
    expect(answers[1]![1]).toStartWith("Command not executed");
    expect(answers[2]![1]).toStartWith("Command not executed");
  });
});

describe("claims of completion judged by --done-when", () => {
  const CHECK = "echo checking-done; test -f done.txt";

  test("a failing check refuses the claim with its output; a passing one ends the run verified", async () => {
    const model = new ScriptedModel([
      { content: "TASKCOMPLETE" },
      { calls: ["touch done.txt"] },
      { content: "TASKCOMPLETE" },
    ]);
    const { outcome, sink } = await run(model, ["--auto-approve", "--done-when", CHECK], "make done.txt");

    expect(outcome).toEqual({ status: "completed", exitCode: 0 });
    expect(model.requests).toHaveLength(3);
    expect(sink.of("verify").map((v) => [v.command, v.passed, v.exit_code])).toEqual([
      [CHECK, false, 1],
      [CHECK, true, 0],
    ]);
    const refusal = model.messages(1).at(-1)!;
    expect(refusal.role).toBe("user");
    expect(String(refusal.content)).toStartWith(`[Completion check failed] ${CHECK} exited 1:\nchecking-done`);
    expect(String(refusal.content)).toContain("The task is not finished");
    expect(sink.of("end")[0]).toMatchObject({ status: "completed", exit_code: 0, verified: true });
  });

  test("without --done-when a claim is taken at its word and is not called verified", async () => {
    const model = new ScriptedModel([{ content: "TASKCOMPLETE" }]);
    const { outcome, sink } = await run(model, ["--auto-approve"], "nothing to do");
    expect(outcome.status).toBe("completed");
    expect(sink.of("verify")).toEqual([]);
    expect(sink.of("end")[0]).toMatchObject({ status: "completed", verified: false });
  });

  test("five refused claims in a row end the run: status unverified, exit code 6", async () => {
    const model = new ScriptedModel(() => ({ content: "TASKCOMPLETE" }));
    const { outcome, sink } = await run(model, ["--auto-approve", "--done-when", "test -f never-there.txt"], "go");

    expect(outcome).toEqual({ status: "unverified", exitCode: 6 });
    expect(model.requests).toHaveLength(5);
    expect(sink.of("verify").map((v) => v.passed)).toEqual([false, false, false, false, false]);
    expect(sink.of("warning").some((w) => w.text.includes("--done-when refused 5 claims of completion in a row"))).toBe(
      true,
    );
    expect(sink.of("end")[0]).toMatchObject({ status: "unverified", exit_code: 6, verified: false });
  });

  test("the system prompt names the check", async () => {
    const model = new ScriptedModel([{ content: "TASKCOMPLETE" }]);
    await run(model, ["--done-when", "true"], "go");
    expect(String(model.messages(0)[0]!.content)).toContain("Your claim is checked by running `true`");
  });
});

describe("compression when the history passes --max-prompt-len", () => {
  // A budget of 6,000 tokens (14,000 less the 8,000 reserved for an open-weight model's answer) and
  // commands printing ~2,000 tokens each: the history passes the budget after a few steps.
  const FLAGS = ["--auto-approve", "--max-prompt-len", "14000"];
  const BUDGET = 6000;
  const STEPS = 8;
  const step = (n: number) => `echo batch-${n}; seq ${n * 10000 + 1} ${n * 10000 + 1400}`;
  const SUMMARY_HEADING = "[Prior conversation summary]";

  /** Commands for STEPS normal requests, then TASKCOMPLETE; the summariser's requests get `SUMMARY-k`. */
  function compressingModel() {
    let normal = 0;
    let summaries = 0;
    return new ScriptedModel((req: CompletionRequest): ScriptedTurn => {
      if (!req.tools) return { content: `SUMMARY-${++summaries}: printed the batches so far.` };
      return ++normal <= STEPS ? { calls: [step(normal)] } : { content: "TASKCOMPLETE" };
    });
  }

  test("truncate: old outputs are condensed, no summariser call, every request stays well-formed", async () => {
    const model = compressingModel();
    const { outcome, sink } = await run(model, [...FLAGS, "--compress-alg", "truncate"], "print the batches");

    expect(outcome.status).toBe("completed");
    const compressions = sink.of("compression");
    expect(compressions.length).toBeGreaterThanOrEqual(1);
    for (const c of compressions) {
      expect(c.algorithm).toBe("truncate");
      expect(c.after_tokens).toBeLessThan(c.before_tokens);
      expect(c.before_tokens).toBeGreaterThan(BUDGET);
    }
    expect(model.requests.every((r) => r.tools)).toBe(true);
    expect(model.requests.some((r) => JSON.stringify(r.messages).includes("<condensed tool output>"))).toBe(true);
    for (const r of model.requests) {
      expect(requestSequenceProblems(r.messages)).toEqual([]);
      expect(r.messages[1]).toEqual({ role: "user", content: "print the batches" });
      expect(String(r.messages[0]!.content)).not.toContain(SUMMARY_HEADING);
    }
  });

  test("the summariser: a request with tools off, whose answer leads the next system message", async () => {
    const model = compressingModel();
    const { outcome, sink } = await run(model, [...FLAGS, "--compress-alg", "context-compressor-llm"], "print them");

    expect(outcome.status).toBe("completed");
    const compressions = sink.of("compression");
    expect(compressions.length).toBeGreaterThanOrEqual(1);
    for (const c of compressions) expect(c.algorithm).toBe("context-compressor-llm");
    const at = model.requests.findIndex((r) => !r.tools);
    expect(at).toBeGreaterThan(0);
    const summariser = model.requests[at]!;
    expect(summariser.temperature).toBe(1);
    // What it summarises: the evicted commands' outputs.
    expect(JSON.stringify(summariser.messages)).toContain("batch-1");
    const next = model.requests[at + 1]!;
    expect(next.tools).toBe(true);
    expect(String(next.messages[0]!.content)).toContain(`${SUMMARY_HEADING}\nSUMMARY-1: printed the batches so far.`);
    expect(next.messages[1]).toEqual({ role: "user", content: "print them" });
    expect(requestSequenceProblems(next.messages)).toEqual([]);
    // The first command's turn was evicted into the summary.
    expect(next.messages.some((m) => m.role === "tool" && m.tool_call_id === "call_0_0")).toBe(false);
  });

  test("a short task under the budget is never compressed", async () => {
    const model = new ScriptedModel([{ calls: ["echo small"] }, { calls: ["echo smaller"] }]);
    const { sink } = await run(model, FLAGS, "a short task");
    expect(sink.of("compression")).toEqual([]);
    expect(model.requests.every((r) => r.tools)).toBe(true);
    // Each request extends the one before it.
    for (let i = 1; i < model.requests.length; i++)
      expect(model.messages(i).slice(0, model.messages(i - 1).length)).toEqual(model.messages(i - 1));
  });
});

describe("stall detection in an unattended run", () => {
  test("three replies in a row without a tool call: stalled, exit 7, each reply nudged", async () => {
    const model = new ScriptedModel([
      { content: "Which database should I use?" },
      { content: "Please tell me which database." },
      { content: "I need to know the database." },
      { content: "TASKCOMPLETE" },
    ]);
    const { outcome, sink } = await run(model, ["--auto-approve"], "set up a database");

    expect(outcome).toEqual({ status: "stalled", exitCode: 7 });
    expect(model.requests).toHaveLength(3);
    for (const n of [1, 2]) expect(String(model.messages(n).at(-1)!.content)).toStartWith(CONTINUE_PREFIX);
    expect(sink.of("warning").some((w) => w.text.includes("3 replies in a row without a tool call"))).toBe(true);
    expect(sink.of("end")[0]).toMatchObject({ status: "stalled", exit_code: 7 });
  });

  test("a tool call between tool-less replies starts the count again", async () => {
    const model = new ScriptedModel([
      { content: "Thinking." },
      { content: "Still thinking." },
      { calls: ["echo working"] },
      { content: "Hmm." },
      { content: "Hmm again." },
      { content: "TASKCOMPLETE" },
    ]);
    const { outcome } = await run(model, ["--auto-approve"], "work");
    expect(outcome.status).toBe("completed");
    expect(model.requests).toHaveLength(6);
  });

  test("the same command with the same result five times in a row: stalled, exit 7", async () => {
    const model = new ScriptedModel(() => ({ calls: ["cat missing.txt"] }));
    const { outcome, sink } = await run(model, ["--auto-approve"], "read it");

    expect(outcome).toEqual({ status: "stalled", exitCode: 7 });
    expect(model.requests).toHaveLength(5);
    expect(sink.of("command_result")).toHaveLength(5);
    expect(
      sink.of("warning").some((w) => w.text.includes("the same command with the same result 5 times in a row")),
    ).toBe(true);
  });

  test("the same command with a different result each time is progress, not a stall", async () => {
    const model = new ScriptedModel((_req, index) =>
      index < 7 ? { calls: ["echo x >> tally; wc -l < tally"] } : { content: "TASKCOMPLETE" },
    );
    const { outcome } = await run(model, ["--auto-approve"], "count");
    expect(outcome.status).toBe("completed");
    expect(model.requests).toHaveLength(8);
  });
});

export { RecordingSink };
