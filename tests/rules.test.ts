/**
 * Command rules (README: "Command rules"): allow, ask and deny lines in
 * `.aicrules` or `--rules FILE`, matched against every simple command a
 * command line can run. First a table of 207 command lines (tests/rules-corpus.ts)
 * against one rules file, each with the verdict, the rule that decided and
 * the simple commands found; then the compiled binary against the fake server:
 * deny beats auto-approve, allow skips the gate, an unanswerable ask is refused
 * and the run goes on, and a command that rewrites the rules file gains nothing.
 */
import { describe, expect, test } from "bun:test";
import { existsSync, mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { UnreadableCommand, commandParts, judgeCommand, parseRuleLines } from "../aic.ts";
import { RULES_CASES, RULES_FILE } from "./rules-corpus.ts";
import { bash, headless, jsonLines, messagesOf, perTestFixtures, runAic, scratch, toolAnswer } from "./helpers.ts";

const fixtures = perTestFixtures();

/** A part as the corpus writes it: known words as themselves, a dynamic word as NUL + its source. */
function corpusParts(command: string): string[][] | "unparseable" {
  try {
    // Writes are judged too, but the corpus lists what a line runs.
    return commandParts(command)
      .filter((part) => !(part[0]?.known && part[0].value === "\u0000write"))
      .map((part) => part.map((w) => (w.known ? w.value : `\u0000${w.text}`)));
  } catch (error) {
    if (error instanceof UnreadableCommand) return "unparseable";
    throw error;
  }
}

/** Parts compared as a multiset, every dynamic word as one marker (its exact source text is not the point). */
function canonical(parts: string[][] | "unparseable"): string {
  if (parts === "unparseable") return parts;
  return parts
    .map((p) => JSON.stringify(p.map((w) => (w.startsWith("\u0000") ? "\u0000" : w))))
    .sort()
    .join("\n");
}

const show = (s: string) => (s.length > 80 ? `${JSON.stringify(s.slice(0, 77))}…` : JSON.stringify(s));

describe("the verdict table", () => {
  const { rules, problems } = parseRuleLines(RULES_FILE);

  test("the corpus rules file reads without problems", () => {
    expect(problems).toEqual([]);
    expect(rules).toHaveLength(27);
  });

  for (const c of RULES_CASES)
    test(`${c.verdict.padEnd(5)} ${show(c.command)} (${c.why})`, () => {
      const verdict = judgeCommand(rules, c.command);
      expect({ verdict: verdict.verdict, rule: verdict.rule?.text }).toEqual({ verdict: c.verdict, rule: c.rule });
      expect(canonical(corpusParts(c.command))).toBe(canonical(c.parts));
    });

  test("the table covers what the rules must see through", () => {
    const has = (re: RegExp) => RULES_CASES.filter((c) => re.test(c.command)).length;
    expect(RULES_CASES.length).toBeGreaterThanOrEqual(80);
    for (const re of [/\|/, /&&/, /\(/, /\$\(/, /bash -lc/, /\benv\b/, /'git' "push"/, /g\\it/, /\n/, /<</, / #/])
      expect(has(re)).toBeGreaterThan(0);
  });
});

describe("reading the rules file", () => {
  test("a broken line is reported with its number and ignored; the others stay in force", () => {
    const { rules, problems } = parseRuleLines(
      ["allow git status", "alow ls", "deny", "deny rm * -rf", `deny rm "x"`, "deny git push  # needs a person"].join(
        "\n",
      ),
    );
    expect(problems).toEqual([
      "line 2: a rule starts with allow, ask or deny: alow ls",
      "line 3: deny needs a pattern (shell words, or * for any command): deny",
      "line 4: * may only be a pattern's last word: deny rm * -rf",
      `line 5: a pattern is plain words as the command's words read after quoting (no quotes, \\, $ or \`): deny rm "x"`,
    ]);
    expect(rules.map((r) => [r.lineNumber, r.written, r.reason])).toEqual([
      [1, "allow git status", undefined],
      [6, "deny git push", "needs a person"],
    ]);
    // A deny without `*` still refuses the command with any further words: refusing too much is the safe side.
    expect(judgeCommand(rules, "git push origin main").verdict).toBe("deny");
    // An allow without `*` is exact.
    expect(judgeCommand(rules, "git status --short").verdict).toBe("ask");
  });
});

describe("rules in a run", () => {
  const RULES = ["allow echo *", "allow npm test *", "deny git push *  # pushing needs a person", ""].join("\n");

  /** A scratch project with the rules file and a fake `npm` on PATH that says it ran. */
  function project(rules = RULES): { dir: string; env: Record<string, string> } {
    const dir = scratch();
    writeFileSync(join(dir, ".aicrules"), rules);
    mkdirSync(join(dir, "bin"));
    writeFileSync(join(dir, "bin", "npm"), '#!/bin/sh\necho "npm-ran: $*"\n', { mode: 0o755 });
    return { dir, env: { PATH: `${join(dir, "bin")}:${process.env.PATH}` } };
  }

  // deny beats --auto-approve: `git status && git push origin main` never runs (not even its first half), and
  // the model is told which rule refused it and why.
  test("a denied command never runs, even with --auto-approve, and the model is told why", async () => {
    const { dir, env } = project();
    const srv = fixtures.serve([
      bash("touch ran.txt; git status && git push origin main", "push"),
      { content: "TASKCOMPLETE" },
    ]);
    const result = await runAic([...headless(srv.url), "--auto-approve", "--json", "ship it"], { cwd: dir, env });
    expect(result.code).toBe(0);
    expect(existsSync(join(dir, "ran.txt"))).toBe(false);
    expect(toolAnswer(srv.requests[1], "push")).toBe(
      `Command refused: \`git push origin main\` is forbidden by the rule "deny git push *" in ${join(dir, ".aicrules")}: pushing needs a person. Nothing ran. Do not try to get around this rule; if the task cannot be done without it, say so.`,
    );
    const events = jsonLines(result.stdout);
    expect(events.find((e) => e.type === "approval")).toMatchObject({
      decision: "denied",
      rule: "deny git push *  # pushing needs a person",
    });
    // Refused commands get a result too, saying so: nothing ran.
    expect(events.filter((e) => e.type === "command_result")).toEqual([
      expect.objectContaining({ id: "push", status: "denied", exit_code: null, output: "", duration_ms: 0 }),
    ]);
  });

  // allow skips the gate: with stdin closed and no --auto-approve, an allowed command runs without asking.
  test("an allowed command runs without asking in --nogui with stdin closed", async () => {
    const { dir, env } = project();
    const srv = fixtures.serve([bash("npm test -- --watch=false", "t"), { content: "TASKCOMPLETE" }]);
    const result = await runAic([...headless(srv.url), "--json", "test it"], { cwd: dir, env });
    expect(result.code).toBe(0);
    expect(toolAnswer(srv.requests[1], "t")).toContain("npm-ran: test -- --watch=false");
    expect(jsonLines(result.stdout).find((e) => e.type === "approval")).toMatchObject({
      decision: "allowed",
      rule: "allow npm test *",
    });
  });

  // An allowed command piped through a program that only reads (`| tail`, `| grep`) runs unasked as well: the
  // person allowed `npm test *`, and the output's last lines change nothing. A pipe into a write is still asked,
  // and so is a change of directory before it.
  test("an allowed command piped into tail or grep runs without asking; piped into tee, or after a cd, it is still asked", async () => {
    const { dir, env } = project();
    const srv = fixtures.serve([
      bash("npm test 2>&1 | tail -n 1", "tail"),
      bash("npm test | grep -c npm-ran", "grep"),
      bash("npm test | tee out.log", "tee"),
      bash("cd /tmp && npm test | tail -n 1", "cd"),
      { content: "TASKCOMPLETE" },
    ]);
    const result = await runAic([...headless(srv.url), "--json", "test it"], { cwd: dir, env });
    expect(result.code).toBe(0);
    expect(toolAnswer(srv.requests[1], "tail")).toContain("npm-ran:");
    expect(toolAnswer(srv.requests[2], "grep")).toContain("1");
    expect(toolAnswer(srv.requests[3], "tee")).toStartWith("Command not run: it needs a person's approval");
    // A cd first would run the allowed command in another project: asked.
    expect(toolAnswer(srv.requests[4], "cd")).toStartWith("Command not run: it needs a person's approval");
    expect(existsSync(join(dir, "out.log"))).toBe(false);
    const approvals = jsonLines(result.stdout).filter((e) => e.type === "approval");
    expect(approvals.map((e) => [e.id, e.decision, e.rule])).toEqual([
      ["tail", "allowed", "allow npm test *"],
      ["grep", "allowed", "allow npm test *"],
      ["tee", "no_input", undefined],
      ["cd", "no_input", undefined],
    ]);
  });

  // --ask-every-command asks for read-only commands too, so a read-only part beside an allowed one is asked.
  test("with --ask-every-command an allowed command piped into tail is asked", async () => {
    const { dir, env } = project();
    const srv = fixtures.serve([bash("npm test 2>&1 | tail -n 1", "tail"), { content: "TASKCOMPLETE" }]);
    const result = await runAic([...headless(srv.url), "--ask-every-command", "--json", "test it"], { cwd: dir, env });
    expect(result.code).toBe(0);
    expect(toolAnswer(srv.requests[1], "tail")).toStartWith("Command not run: it needs a person's approval");
  });

  // An ask with nobody to answer: refused with an explanation naming the allowed commands, and the run goes on
  // to complete with allowed commands (exit 0, not 4).
  test("an ask command is refused when nobody can answer, and the run goes on", async () => {
    const { dir, env } = project();
    const srv = fixtures.serve([bash("rm -rf build", "rm"), bash("echo instead", "echo"), { content: "TASKCOMPLETE" }]);
    const result = await runAic([...headless(srv.url), "clean up"], { cwd: dir, env });
    expect(result.code).toBe(0);
    const refused = toolAnswer(srv.requests[1], "rm");
    expect(refused).toStartWith(
      `Command not run: it needs a person's approval (no rule in ${join(dir, ".aicrules")} allows \`rm -rf build\`), and nobody can answer in this run.`,
    );
    expect(refused).toContain("Commands that run without asking: `echo *`, `npm test *`.");
    expect(toolAnswer(srv.requests[2], "echo")).toContain("instead");
  });

  // Without a rules file nothing changes: an ask with nobody to answer stops the run with exit 4, as before.
  test("without a rules file an unanswerable command still ends the run with exit 4", async () => {
    const dir = scratch();
    // (A read-only command such as `echo hi` would run without asking; touch writes.)
    const srv = fixtures.serve([bash("touch hi")]);
    const result = await runAic([...headless(srv.url), "go"], { cwd: dir });
    expect(result.code).toBe(4);
  });

  // A command must never widen its own permissions: an allowed command rewrites .aicrules to `allow *` (the file
  // allows writing it, so the rewrite runs), and the denied command that follows still never runs; aic says it
  // noticed the change.
  test("rewriting .aicrules during a run gains nothing", async () => {
    const { dir, env } = project(
      ["allow echo *", "allow write .aicrules", "deny touch *  # no touching", ""].join("\n"),
    );
    const srv = fixtures.serve([
      bash("echo 'allow *' > .aicrules", "widen"),
      bash("touch pwned.txt", "touch"),
      { content: "TASKCOMPLETE" },
    ]);
    const result = await runAic([...headless(srv.url), "--json", "go"], { cwd: dir, env });
    expect(result.code).toBe(0);
    expect(readFileSync(join(dir, ".aicrules"), "utf8")).toBe("allow *\n");
    expect(existsSync(join(dir, "pwned.txt"))).toBe(false);
    expect(toolAnswer(srv.requests[2], "touch")).toContain('forbidden by the rule "deny touch *"');
    const warnings = jsonLines(result.stdout)
      .filter((e) => e.type === "warning")
      .map((e) => e.text);
    expect(warnings).toEqual([
      expect.stringContaining(
        `${join(dir, ".aicrules")} changed on disk while aic runs (a command may have written it)`,
      ),
    ]);
  });

  // The model is told the rules in force in one paragraph of the system prompt.
  test("the system prompt names what runs without asking and what is refused", async () => {
    const { dir, env } = project();
    const srv = fixtures.serve([{ content: "TASKCOMPLETE" }]);
    await runAic([...headless(srv.url), "go"], { cwd: dir, env });
    const system = messagesOf(srv.requests[0])[0].content as string;
    expect(system).toContain(
      "these run without asking: `echo *`, `npm test *`; these are refused: `git push *` (pushing needs a person)",
    );
  });

  // A broken line is reported at start with its line number; the run goes on with the other rules.
  test("a broken rule line is reported at start and ignored", async () => {
    const { dir, env } = project("allow echo *\npermit ls\n");
    const srv = fixtures.serve([bash("echo ok", "e"), { content: "TASKCOMPLETE" }]);
    const result = await runAic([...headless(srv.url), "go"], { cwd: dir, env });
    expect(result.code).toBe(0);
    expect(result.stderr).toContain(
      `warning: ${join(dir, ".aicrules")} line 2: a rule starts with allow, ask or deny: permit ls (this line is ignored)`,
    );
    expect(toolAnswer(srv.requests[1], "e")).toContain("ok");
  });

  test("--rules naming a missing file is a usage error", async () => {
    const result = await runAic([...headless("http://127.0.0.1:9/v1"), "--rules", "/nonexistent/rules", "go"]);
    expect(result.code).toBe(2);
    expect(result.stderr.trim()).toBe("aic: error: --rules /nonexistent/rules: no such file");
  });
});
