/**
 * Every text aic sends the model (README: "How it works"), rendered with
 * fixed sample inputs and held by a snapshot: a change to any of them changes
 * what every model is told, so it must show in review as a changed snapshot
 * (`bun test -u` after reading the diff). The catalogue itself is checked to
 * be whole: each of its entries is rendered here, and nothing else builds a
 * model-facing text (the texts live in aic.ts's section "What the model reads").
 */
import { expect, test } from "bun:test";
import { MODEL_TEXTS, commandStatusLine, describeCommandResult, sandboxOff } from "../aic.ts";

const T = MODEL_TEXTS;
const limits = { timeoutSec: 120, maxOutputBytes: 10240, runawayBytes: 1024000, ciEnv: true, sshAgent: false };
const verdict = {
  verdict: "deny" as const,
  part: "rm -rf build",
  rule: { action: "deny" as const, written: "deny rm *", reason: "nothing is deleted here" },
};
const job = {
  id: 2,
  state: "running" as const,
  command: "python3 -m http.server 8123",
  exitCode: null,
  startedAt: Date.now() - 12_000,
  endedAt: undefined,
  group: 41,
  terminal: { path: "/home/p/.local/state/aic/outputs/aic-out-1/job-1.log" },
};
const sandbox = sandboxOff("--disable-sandbox");

/** Each entry of the catalogue as the model reads it, with sample inputs. */
const rendered: Record<keyof typeof T, string> = {
  TRUNCATION_SENTINEL: T.TRUNCATION_SENTINEL,
  CONDENSED_TOOL_OUTPUT: T.CONDENSED_TOOL_OUTPUT,
  SUMMARY_HEADING: T.SUMMARY_HEADING,
  SUMMARY_UNAVAILABLE: T.SUMMARY_UNAVAILABLE,
  CONTINUE_FALLBACK: T.CONTINUE_FALLBACK,
  SESSION_RECOVERED_NOTICE: T.SESSION_RECOVERED_NOTICE,
  SKIPPED_BY_USER: T.SKIPPED_BY_USER,
  NOT_EXECUTED_STOPPED: T.NOT_EXECUTED_STOPPED,
  NOT_EXECUTED_INTERRUPTED: T.NOT_EXECUTED_INTERRUPTED,
  EXECUTE_BASH_TOOL: JSON.stringify(T.EXECUTE_BASH_TOOL, null, 2),
  buildSystemPrompt: [false, true]
    .map((fast) =>
      T.buildSystemPrompt({
        fast,
        timeoutSec: 120,
        maxOutputBytes: 10240,
        sandbox,
        selfCommand: "/usr/local/bin/aic",
        projectInstructions: { files: ["AGENTS.md"], text: "Run the tests with make test." },
        doneWhen: "make test",
        shell: "/bin/bash",
        cwd: "/work/proj",
        ciEnv: true,
        maxTime: fast ? undefined : 1800,
      }),
    )
    .join("\n\n=== fast ===\n\n"),
  invalidArgumentsMessage: T.invalidArgumentsMessage("execute_bash", '{"command": "ls', "Unexpected end of JSON input"),
  cutOffMessage: [T.cutOffMessage("execute_bash", 8000), T.cutOffMessage("", undefined)].join("\n"),
  deniedByRuleMessage: T.deniedByRuleMessage(verdict as never, "/work/proj/.aicrules"),
  unseenCommandMessage: T.unseenCommandMessage("`$x` is only known when it runs", {
    path: "/work/proj/.aicrules",
    rules: [verdict.rule as never],
  }),
  needsPersonMessage: T.needsPersonMessage({ ...verdict, verdict: "ask" } as never, "/work/proj/.aicrules", [
    "ls *",
    "git status",
  ]),
  sandboxRefusalMessage: T.sandboxRefusalMessage([
    { path: "/var/lib/dpkg/lock-frontend", why: "write", detail: "/work/proj, /tmp, /dev and the package caches" },
    {
      path: "/home/p/.aws/credentials",
      why: "secret",
      detail: "the person can lift it with --allow-read /home/p/.aws",
    },
    { path: "/usr/bin/curl", why: "exec", detail: "curl" },
  ]),
  timeLeftLine: [T.timeLeftLine(750_000, 1800), T.timeLeftLine(30_000, 3600), T.timeLeftLine(-5, 60)].join("\n"),
  CONTINUE_MESSAGE: T.CONTINUE_MESSAGE,
  SUMMARISER_SYSTEM: T.SUMMARISER_SYSTEM,
  summariserRequest: JSON.stringify(
    T.summariserRequest("You are a shell agent.", "fix the build", "Earlier: the build was broken.", "[user] ..."),
    null,
    2,
  ),
  systemContent: T.systemContent("You are a shell agent.", "The build is fixed; tests remain."),
  SKIPPED_AFTER_SUGGESTION: T.SKIPPED_AFTER_SUGGESTION,
  NO_ARGUMENTS_MESSAGE: T.NO_ARGUMENTS_MESSAGE,
  unknownFunctionMessage: T.unknownFunctionMessage("read_file"),
  steeringMessage: T.steeringMessage("use pnpm, not npm"),
  suggestionInsteadMessage: T.suggestionInsteadMessage("run the tests first"),
  truncationNote: [
    T.truncationNote(120000, 130240, 4000, { savedTo: "/state/aic/outputs/aic-out-1/output-1.txt" }),
    T.truncationNote(120000, 130240, 4000, { error: "the disk is full" }),
  ].join("\n"),
  changedFilesNote: T.changedFilesNote({
    created: ["a.txt"],
    modified: Array.from({ length: 10 }, (_, i) => `src/m${i}.ts`),
    deleted: ["old.txt"],
  }),
  disarmedMessage: T.disarmedMessage({
    taken: ["/work/proj/new/.git/config: core.fsmonitor (as it was: …)"],
    notes: [],
  }),
  droppedOutputNote: T.droppedOutputNote(4096),
  jobLine: T.jobLine(job as never, 41).replace(/running for \d+ s/, "running for N s"),
  refusedJobsNote: T.refusedJobsNote([{ command: "sleep 100" }, { command: "tail -f log" }]),
  completionRefusal: T.completionRefusal("make test", { exitCode: 2, status: "exited", output: "1 failed" }),
  undoneNote: T.undoneNote("`echo changed > a.txt`"),
  describeCommandResult: (
    ["exited", "timed_out", "waiting_for_input", "runaway", "not_started", "interrupted", "stopped"] as const
  )
    .map((status) =>
      T.describeCommandResult({ exitCode: status === "exited" ? 0 : 143, status, output: "out" }, limits),
    )
    .join("\n---\n"),
  BOTH_COMMAND_AND_INPUT_MESSAGE: T.BOTH_COMMAND_AND_INPUT_MESSAGE,
  NO_WAITING_COMMAND_MESSAGE: T.NO_WAITING_COMMAND_MESSAGE,
  waitingMessage: (["waiting_for_input", "waiting_on_time"] as const)
    .map((verdict) =>
      T.waitingMessage({
        verdict,
        reason: "it is reading its terminal",
        program: "python3",
        output: "earlier line",
        screen: ">>> ",
        fullScreen: verdict === "waiting_on_time",
      }),
    )
    .join("\n---\n"),
  stoppedWaitingNote: [T.stoppedWaitingNote("python3", 143), T.stoppedWaitingNote("less", null)].join("\n"),
  endedBeforeInputNote: T.endedBeforeInputNote("bash"),
  stillWaitingNote: T.stillWaitingNote("python3"),
  typingStoppedNote: T.typingStoppedNote(1, 3, "vim"),
  renderingCutNote: T.renderingCutNote(5000),
};

test("the catalogue of model-facing texts is whole, and each text is as the snapshot holds it", () => {
  expect(Object.keys(rendered).sort()).toEqual(Object.keys(T).sort());
  for (const [name, text] of Object.entries(rendered)) {
    expect(typeof text).toBe("string");
    expect(text.length).toBeGreaterThan(0);
    expect(text).toMatchSnapshot(name);
  }
});

// A new user's finding: `cat` of a 1 MB file passed the runaway limit but had ended by itself, exit 0; the model
// was told "Command stopped" and the pane showed "✗ runaway (exit 0)".
test("a command that passed the runaway limit and ended by itself with exit 0 is not said to be stopped", () => {
  const limits = { timeoutSec: 60, maxOutputBytes: 1000, runawayBytes: 100_000, ciEnv: true } as never;
  const ended = describeCommandResult({ exitCode: 0, status: "runaway", output: "…" }, limits);
  expect(ended).toStartWith("Command executed with exit code 0, but it printed more than 100000 bytes");
  expect(ended).not.toContain("Command stopped");
  const stopped = describeCommandResult({ exitCode: 143, status: "runaway", output: "…" }, limits);
  expect(stopped).toStartWith("Command stopped: it printed more than 100000 bytes");
  const event = (exit_code: number) =>
    ({
      type: "command_result",
      id: "c",
      exit_code,
      status: "runaway",
      duration_ms: 0,
      output: "",
      changed_files: null,
    }) as never;
  expect(commandStatusLine(event(0))).toStartWith("✓ exit 0 · output past the runaway limit not kept");
  expect(commandStatusLine(event(143))).toStartWith("✗ runaway (exit 143)");
});
