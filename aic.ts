#!/usr/bin/env bun
/**
 * aic — a ralph-loop shell agent.
 *
 * A language model gets one tool, `execute_bash`. aic runs each command it
 * proposes in a real terminal (behind the person's approval unless
 * auto-approve is on), hands the result back, and loops until the model says
 * TASKCOMPLETE. The whole program lives in this file, in sections ordered the
 * way data flows through it, each opening with what it owns (this map names
 * every section by its title; tests/build.test.ts holds it to that):
 *
 *   Constants and defaults → CLI: the configuration and its flags → CLI:
 *   reading the command line → CLI: settings kept between runs → Secrets → What
 *   the model reads → What the model reads: notes in tool results → Events →
 *   Events: how they are worded → Plain and JSON output → Messages and token
 *   accounting → Model failures → Model client → Model client: streaming a turn
 *   → Model client: the server's context window → Context compression → Own
 *   files on hostile ground → Own files: a directory aic holds → Session
 *   repairs → Session file writing → Session store: ids, state and locks →
 *   Session store → Session store: putting the file on disk → Session store:
 *   kept out of commits → Sandbox: what commands may touch → Sandbox: the
 *   programs and paths a run trusts → Sandbox: Landlock and capabilities →
 *   Sandbox: judging each program a command executes → Sandbox: the program an
 *   exec names, and the verdict → Sandbox: a run's sandbox → The jail → The
 *   jail: building it → Repository guard → Repository guard: finding
 *   repositories → Repository guard: the audit → PTY and process groups →
 *   Sandbox launcher → Sandbox launcher: aic's side → Output capture → Output
 *   capture: the terminal emulator → Waiting-for-input detection → Command
 *   runner → Background jobs: finding them → Background jobs: a job and its
 *   terminal → Background jobs: the job table → Checkpoints: snapshot settings
 *   and manifests → Checkpoints: what changed since the last snapshot →
 *   Checkpoints: what git does not record → Checkpoints: the shadow
 *   repository's own files → Checkpoints: files too big to keep → Checkpoints:
 *   the shadow repository → Checkpoints: what a session records of them →
 *   Checkpoints: undo and redo → Checkpoints: putting files back → Checkpoints:
 *   aic undo, redo and diff → Command rules: reading a command line → Command
 *   rules: what a command line runs → Command rules: wrappers and interpreters
 *   → Command rules: programs that run programs, and scripts a line runs →
 *   Command rules: find, sort, watch, flock, awk and sed → Command rules: the
 *   verdict → Command rules: read-only programs and always-allow → Command
 *   rules: the rules file → Tool calls: the approval gate and the command →
 *   Tool calls: keys for a waiting command → Model calls and their tokens →
 *   Agent loop: stalls → Agent loop: the conversation and its checkpoints →
 *   Agent loop: the agent → Run wiring → Headless front end → Web search → TUI
 *   parts: prompt history → TUI parts: figures, footer and banner → TUI parts:
 *   log panes → TUI parts: the shell's screen and its keys → TUI parts: the
 *   approval dialog and the Shell tab → TUI parts: how events look, the prompt,
 *   and the layout → TUI parts: the transcript, keys typed ahead, a program's
 *   screen → TUI parts: pacing → TUI app → TUI app: where keys go → TUI keys
 *   and slash commands → TUI start-up → Export: ATIF trajectories → Main
 *
 * The agent core never touches the terminal: it emits typed events to a sink
 * and awaits an approval function. Plain text, JSON Lines and the TUI are
 * sinks, and all three word events through one function. Both front ends
 * build their run the same way (createRun). Everything runs on one event
 * loop; nothing blocks it.
 */

import { createHash } from "node:crypto";
import * as fs from "node:fs";
import * as os from "node:os";
import * as path from "node:path";
import * as tty from "node:tty";
import { deflateSync } from "node:zlib";

// ════════════════════════════════════════════════════════════════════════════
// Constants and defaults
// Owns: names, limits and exit codes that several sections rely on, and the
// check that a switch over a union leaves no member out.
// ════════════════════════════════════════════════════════════════════════════

const VERSION = "0.1.0";
/** The JSON Lines schema (README: "JSON output"): raised when an event's field changes meaning or goes away. */
const JSON_SCHEMA = 1;
const MARKER = "TASKCOMPLETE";

/** Headers a browser would send, so sites that block bots still answer the model's fetches. */
const BROWSER_USER_AGENT =
  "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/131.0.0.0 Safari/537.36";

/** Non-gpt models get an output reservation; it is subtracted from the prompt budget. */
const OUTPUT_RESERVATION_TOKENS = 8000;

const AGENTS_MD_LIMIT_BYTES = 32 * 1024;

/** Output past this multiple of --max-output-bytes means a runaway command. */
const RUNAWAY_FACTOR = 100;

const KILL_GRACE_MS = 500;
/** How often a group being killed is checked for survivors during the grace. */
const KILL_POLL_MS = 25;
/** Output written just before a command exits can still be in flight when its exit is seen. */
const PTY_DRAIN_GRACE_MS = 100;
/** After a signal, the loop normally winds down at once; past this the process exits anyway (the session saved first). */
/** How long a signalled run may take to wind down before it is closed and the process exits (a hang-up: within 2 s). */
const SIGNAL_SHUTDOWN_GUARD_MS = 1500;
const MAX_TIMEOUT_SEC = Math.floor((2 ** 31 - 1) / 1000);
const MAX_MODEL_ATTEMPTS = 5;
const MAX_CONTEXT_RETRIES = 3;

/** While a run has had no answer, an endpoint where nothing listens is tried this many times, this far apart (×1, ×2): a few seconds in all. */
const UNREACHABLE_FIRST_ATTEMPTS = 3;

const UNREACHABLE_FIRST_WAIT_MS = 500;

/**
 * How long a request may wait for its first chunk (headers, then a local server reading a long prompt can take
 * many minutes); between chunks the limit is STREAM_IDLE_MS. AIC_MODEL_REQUEST_TIMEOUT_MS shortens it (tests).
 */
const MODEL_REQUEST_TIMEOUT_MS =
  Number(process.env.AIC_MODEL_REQUEST_TIMEOUT_MS) > 0
    ? Number(process.env.AIC_MODEL_REQUEST_TIMEOUT_MS)
    : 10 * 60 * 1000;

const BACKOFF_CAP_MS = 60_000;

/** Silence from a model stream between two chunks after which the attempt counts as failed. */
const STREAM_IDLE_MS = Number(process.env.AIC_STREAM_IDLE_MS) > 0 ? Number(process.env.AIC_STREAM_IDLE_MS) : 300_000;

const COMMAND_COLUMNS = 160;
const COMMAND_ROWS = 50;

/** Background jobs running at once; a command that would start one more has its new ones stopped. */
const MAX_JOBS = 8;
/** How often running jobs are looked at (ended? orphans to reap or to adopt?). */
/** How long a job whose groups are empty waits for the jail's init to say its exit code. */
const JOB_EXIT_WAIT_MS = 1000;
/** How long a tool result waits for jobs that were just signalled to end (see JobTable.settle), and how often it looks. */
const JOB_SETTLE_MS = 300;
const JOB_SETTLE_POLL_MS = 20;

/** `s` as one shell word: as it is when nothing in it is special, else in single quotes. */
function shellQuoted(s: string): string {
  return /^[\w@%+=:,./-]+$/.test(s) ? s : `'${s.replace(/'/g, "'\\''")}'`;
}

/** Whether a process has a signal pending that ends it by default (TERM, KILL, INT, HUP, QUIT): it is on its way out. */
function dying(pid: number): boolean {
  try {
    const status = fs.readFileSync(`/proc/${pid}/status`, "utf8");
    const fatal = (1n << 14n) | (1n << 8n) | (1n << 1n) | (1n << 0n) | (1n << 2n); // bits of signals 15, 9, 2, 1, 3
    return ["SigPnd", "ShdPnd"].some((field) => {
      const hex = new RegExp(`^${field}:\\s*([0-9a-f]+)`, "m").exec(status)?.[1];
      return hex !== undefined && (BigInt(`0x${hex}`) & fatal) !== 0n;
    });
  } catch {
    return false;
  }
}
const JOB_POLL_MS = 1000;
/** The environment variable that marks every process a command starts, so its jobs are found even after setsid. */
const JOB_MARKER_ENV = "AIC_COMMAND_ID";

/** Claims of completion refused in a row by --done-when before the run gives up. */
const MAX_REFUSED_CLAIMS = 5;

const EXIT = {
  ok: 0,
  failure: 1,
  usage: 2,
  stepLimit: 3,
  needsApproval: 4,
  tokenBudget: 5,
  /** A spent --max-time: the same code as a spent token budget (a budget is a budget). */
  budget: 5,
  unverified: 6,
  stalled: 7,
  sighup: 129,
  sigint: 130,
  sigterm: 143,
} as const;

/**
 * What commands see unless --no-ci-env: test runners (vitest, jest, Playwright)
 * and many tools stay non-interactive under CI=true: no watch mode, no prompts.
 */
const CI_ENV: Record<string, string> = { CI: "true" };

/** The environment every command gets, so pagers and credential prompts never sit waiting for a person. */
const COMMAND_ENV: Record<string, string> = {
  TERM: "xterm-256color",
  PAGER: "cat",
  GIT_PAGER: "cat",
  MANPAGER: "cat",
  GIT_TERMINAL_PROMPT: "0",
  DEBIAN_FRONTEND: "noninteractive",
  GIT_ASKPASS: "",
  SSH_ASKPASS: "",
  GH_PROMPT_DISABLED: "1",
  GCM_INTERACTIVE: "never",
};

/**
 * The default of a switch that handles every member of a union: a member
 * added later leaves `value` some type other than never, and the build fails
 * here until that switch says what the new member does.
 */
function unreachable(value: never): never {
  throw new Error(`unreachable: ${JSON.stringify(value)}`);
}

// ════════════════════════════════════════════════════════════════════════════
// CLI: the configuration and its flags
// Owns: the Config every part reads (with what is derived from it once: the
// command limits, the session file), and the table of flags, held to Config
// by the compiler. Flags live in a table, not an if-chain.
// ════════════════════════════════════════════════════════════════════════════

type CompressAlg = "context-compressor-llm" | "truncate";

interface Config {
  apiBase: string;
  model: string;
  apiKey: string | undefined;
  /** Extra HTTP headers for every model request (gateways route by them); their values are secrets. */
  headers: Record<string, string>;
  autoApprove: boolean;
  noThinking: boolean;
  timeoutSec: number;
  maxPromptLen: number;
  maxOutputBytes: number;
  maxSteps: number;
  debug: boolean;
  nogui: boolean;
  session: string | undefined;
  noSession: boolean;
  disableSandbox: boolean;
  /** More paths commands may write under (real paths, validated). */
  allowWrite: string[];
  /** Secret stores and credential-shaped files commands may read after all (absolute paths). */
  allowRead: string[];
  allowReadSecrets: boolean;
  compressAlg: CompressAlg;
  compressTarget: number;
  fast: boolean;
  reasoningEffort: string | undefined;
  json: boolean;
  /** A shell command whose exit 0 confirms a claim of completion. */
  doneWhen: string | undefined;
  /** Input plus output tokens this aic process may spend on model calls. */
  maxTokens: number | undefined;
  /** Seconds a run may take (wall clock). */
  maxTime: number | undefined;
  /** A run that refused commands for want of a person exits 4. */
  failOnRefusal: boolean;
  /** Background jobs and every other process of the run keep running after aic exits (a grader expects a server). */
  keepJobs: boolean;
  /** The command rules file (default ./.aicrules, which may be absent). */
  rules: string | undefined;
  noCheckpoints: boolean;
  /** Commands do not get CI=true. */
  noCiEnv: boolean;
  /** Even commands the rules prove read-only wait for approval. */
  askEveryCommand: boolean;
  /** `off`: commands get a network namespace with loopback only. */
  network: "on" | "off";
  /** Commands may use the person's ssh-agent (git push over ssh). */
  allowSshAgent: boolean;
  request: string | undefined;
  /** Warnings found while parsing that are not errors (an unknown algorithm name). */
  warnings: string[];
  /** What parsing wants said that is no problem (the settings a config file gave): shown dim, not as a warning. */
  notices: string[];
  /** Derived once from the flags: what bounds each command. */
  limits: CommandLimits;
  /** Derived once from the flags: the session file this run uses (--session, else .aicsession in the TUI, else none). */
  sessionPath: string | undefined;
  /** Derived at start from the server's context window, when it says one (undefined: the flags alone decide). */
  window?: ServerWindow;
  /** --max-prompt-len was given (on the command line or in the config file), not the default. */
  budgetGiven?: boolean;
}

/** The context window a server says it runs the model with, and the answer's share of it. */
interface ServerWindow {
  tokens: number;
  /** The URL that said so ("" when nothing did and a server's default is assumed). */
  endpoint: string;
  /** max_tokens: what aic asks the model to answer at most, fitted inside the window with the prompt. */
  replyTokens: number;
}

/** What bounds one command, derived once from the flags. */
interface CommandLimits {
  timeoutSec: number;
  /** Most bytes of a command's output the model is handed. */
  maxOutputBytes: number;
  /** Output past which a command is stopped as a runaway. */
  runawayBytes: number;
  /** Commands see CI=true (off with --no-ci-env). */
  ciEnv: boolean;
  /** Commands may use the person's ssh-agent (--allow-ssh-agent). */
  sshAgent: boolean;
}

/** The session file a run uses when the TUI is given none. */
const DEFAULT_SESSION_FILE = ".aicsession";

/**
 * What each kind of flag yields, and so the type of the Config field it may
 * fill: the table below is checked against Config by the compiler (a `bool`
 * flag on a number field, or a choice outside the field's values, does not
 * compile).
 */
interface FlagValues {
  bool: boolean;
  /** Optional text. */
  text: string | undefined;
  /** Text that must be given (an error names the flag when it is not). */
  required: string;
  /** An http(s) URL that must be given. */
  url: string;
  /** A positive whole number with a default. */
  count: number;
  /** A positive whole number, or nothing (no limit). */
  limit: number | undefined;
  /** A number strictly between 0 and 1, with a default. */
  fraction: number;
  header: Record<string, string>;
  paths: string[];
}

/** The Config fields whose type is exactly `V`. */
type FieldsOf<V> = {
  [K in keyof Config]-?: [V] extends [Config[K]] ? ([Config[K]] extends [V] ? K : never) : never;
}[keyof Config];

/** The Config fields that hold one of a fixed set of words. */
type ChoiceFields = {
  [K in keyof Config]-?: Config[K] extends string ? (string extends Config[K] ? never : K) : never;
}[keyof Config];

interface FlagBase {
  name: string;
  env?: string[];
  default?: string;
  /** The largest value a number may take: beyond it a timer, a buffer or a budget would be absurd. */
  max?: number;
  /** For a flag that must be given: what is missing without it ("the model name"). */
  missing?: string;
  help: string;
}

type FlagSpec =
  | { [Kind in keyof FlagValues]: FlagBase & { kind: Kind; key: FieldsOf<FlagValues[Kind]> } }[keyof FlagValues]
  | {
      [K in ChoiceFields]: FlagBase & {
        kind: "choice";
        key: K;
        choices: readonly Config[K][];
        /** Used, with a warning, for a word outside `choices`; without it such a word is a usage error. */
        fallback?: Config[K];
      };
    }[ChoiceFields];

const FLAG_TABLE = [
  {
    name: "--api-base",
    kind: "url",
    key: "apiBase",
    missing: "the model endpoint",
    env: ["AIC_API_BASE", "OPENAI_BASE_URL"],
    help: "OpenAI-compatible base URL, http(s)://…/v1. Required.",
  },
  {
    name: "--model",
    kind: "required",
    key: "model",
    env: ["AIC_MODEL"],
    missing: "the model name",
    help: "Model name. Required.",
  },
  {
    name: "--api-key",
    kind: "text",
    key: "apiKey",
    env: ["AIC_API_KEY", "OPENAI_API_KEY"],
    help: "API key (local servers need none). Never written to any file.",
  },
  {
    name: "--header",
    kind: "header",
    key: "headers",
    env: ["AIC_HEADERS"],
    help: "Extra request header 'Name: value', repeatable (env: one per line). Never shown.",
  },
  { name: "--auto-approve", kind: "bool", key: "autoApprove", help: "Run commands without asking." },
  { name: "--no-thinking", kind: "bool", key: "noThinking", help: "Do not show reasoning tokens." },
  {
    name: "--timeout",
    kind: "count",
    key: "timeoutSec",
    default: "120",
    max: MAX_TIMEOUT_SEC,
    help: "Per-command timeout in seconds.",
  },
  {
    name: "--max-prompt-len",
    kind: "count",
    key: "maxPromptLen",
    default: "80000",
    max: 10_000_000,
    help: "Prompt budget in tokens.",
  },
  {
    name: "--max-output-bytes",
    kind: "count",
    key: "maxOutputBytes",
    default: "10240",
    max: 16 * 1024 * 1024,
    help: "Cap on the command output handed to the model.",
  },
  {
    name: "--max-steps",
    kind: "count",
    key: "maxSteps",
    default: "500",
    max: 1_000_000,
    help: "Loop steps before giving up (exit 3).",
  },
  {
    name: "--debug",
    kind: "bool",
    key: "debug",
    help: "Write the history to commander-debug.txt before each model call.",
  },
  {
    name: "--nogui",
    kind: "bool",
    key: "nogui",
    help: "Plain output, no TUI. No session file unless --session is given.",
  },
  { name: "--session", kind: "text", key: "session", help: "Session file (TUI default: ./.aicsession)." },
  { name: "--no-session", kind: "bool", key: "noSession", help: "No session file at all." },
  { name: "--disable-sandbox", kind: "bool", key: "disableSandbox", help: "Do not confine commands with Landlock." },
  {
    name: "--allow-write",
    kind: "paths",
    key: "allowWrite",
    env: ["AIC_ALLOW_WRITE"],
    help: "Another path commands may write under, repeatable (env: colon-separated).",
  },
  {
    name: "--allow-read",
    kind: "paths",
    key: "allowRead",
    env: ["AIC_ALLOW_READ"],
    help: "A secret store or credential file commands may read after all, repeatable (env: colon-separated).",
  },
  {
    name: "--allow-read-secrets",
    kind: "bool",
    key: "allowReadSecrets",
    help: "Let commands read ~/.ssh, ~/.aws and the other secret stores.",
  },
  {
    name: "--compress-alg",
    kind: "choice",
    key: "compressAlg",
    choices: ["context-compressor-llm", "truncate"],
    fallback: "truncate",
    default: "context-compressor-llm",
    help: "context-compressor-llm (anchored LLM summary) or truncate.",
  },
  {
    name: "--compress-target",
    kind: "fraction",
    key: "compressTarget",
    default: "0.4",
    help: "Fraction of the budget kept after compression, 0 < F < 1.",
  },
  { name: "--fast", kind: "bool", key: "fast", help: "Force truncate and the short system prompt." },
  { name: "--reasoning-effort", kind: "text", key: "reasoningEffort", help: "Passed through as reasoning_effort." },
  { name: "--json", kind: "bool", key: "json", help: "With --nogui: JSON Lines events on stdout." },
  {
    name: "--done-when",
    kind: "text",
    key: "doneWhen",
    env: ["AIC_DONE_WHEN"],
    help: "Shell command that must exit 0 for a claim of completion to count (exit 6 after 5 refusals).",
  },
  {
    name: "--no-checkpoints",
    kind: "bool",
    key: "noCheckpoints",
    help: "Take no snapshot of the files before each command (no /undo, no aic undo).",
  },
  {
    name: "--network",
    kind: "choice",
    key: "network",
    choices: ["on", "off"],
    default: "on",
    help: "off: commands get a network of their own with only loopback (needs the jail).",
  },
  {
    name: "--allow-ssh-agent",
    kind: "bool",
    key: "allowSshAgent",
    help: "Let commands use your ssh-agent (git push over ssh); it is out of their reach otherwise.",
  },
  {
    name: "--ask-every-command",
    kind: "bool",
    key: "askEveryCommand",
    help: "Ask before every command, even those aic proves read-only (ls, cat, grep, git status…).",
  },
  {
    name: "--no-ci-env",
    kind: "bool",
    key: "noCiEnv",
    help: "Do not give commands CI=true (which keeps test runners out of watch mode and tools from prompting).",
  },
  {
    name: "--rules",
    kind: "text",
    key: "rules",
    help: "Command rules file: allow / ask / deny lines (default ./.aicrules when it exists).",
  },
  {
    name: "--max-time",
    kind: "limit",
    key: "maxTime",
    env: ["AIC_MAX_TIME"],
    max: MAX_TIMEOUT_SEC,
    help: "Wall-clock budget for the run in seconds: the command in flight is stopped, the session saved (exit 5).",
  },
  {
    name: "--keep-jobs",
    kind: "bool",
    key: "keepJobs",
    help: "Leave background jobs (and every process the commands started) running when aic exits; the end lists them.",
  },
  {
    name: "--fail-on-refusal",
    kind: "bool",
    key: "failOnRefusal",
    help: "Exit 4 when a command was refused because it needed a person and nobody could answer.",
  },
  {
    name: "--max-tokens",
    kind: "limit",
    key: "maxTokens",
    env: ["AIC_MAX_TOKENS"],
    max: 1_000_000_000_000,
    help: "Token budget for all model calls, input plus output (exit 5 when the next call would pass it).",
  },
] as const satisfies readonly FlagSpec[];
const FLAGS: readonly FlagSpec[] = FLAG_TABLE;

/**
 * Every field of Config is set by a flag, or is one of the few derived from them after (the limits, the session
 * path, whether a budget was given, the server's window) or gathered on the way (warnings, notices, the request):
 * a new field that nothing sets fails the build here, naming itself, instead of slipping through configFromFlags's cast.
 */
type FieldsNoFlagSets = Exclude<
  keyof Config,
  | (typeof FLAG_TABLE)[number]["key"]
  | "warnings"
  | "notices"
  | "request"
  | "limits"
  | "sessionPath"
  | "budgetGiven"
  | "window"
>;
const everyFieldHasAFlag: Record<FieldsNoFlagSets, never> = {};
void everyFieldHasAFlag;

/** --help fits a terminal 80 columns wide: longer lines wrap at a space, under their own column. */
const HELP_WIDTH = 80;
const HELP_COLUMN = 29;

function wrapHelpLine(head: string, text: string, indent: number): string[] {
  const lines: string[] = [];
  let line = head;
  let empty = true;
  for (const word of text.split(" ")) {
    const joined = empty ? `${line}${word}` : `${line} ${word}`;
    if (empty || joined.length <= HELP_WIDTH) line = joined;
    else {
      lines.push(line);
      line = `${" ".repeat(indent)}${word}`;
    }
    empty = false;
  }
  return [...lines, line];
}

/** An entry of --help: its name in the first column, its meaning beside it (or under it, when the name is long). */
function helpEntry(name: string, meaning: string): string[] {
  const head = `  ${name}`;
  if (head.length < HELP_COLUMN - 1) return wrapHelpLine(head.padEnd(HELP_COLUMN), meaning, HELP_COLUMN);
  return [head, ...wrapHelpLine(" ".repeat(HELP_COLUMN), meaning, HELP_COLUMN)];
}

const HELP_USAGE: [string, string][] = [
  ["aic [options] [request…]", "TUI (default); a lone - reads the request from stdin"],
  ["aic --nogui [options] request…", "plain output, for scripts and CI"],
  ["aic search QUERY [--max-results N]", "web search, prints a JSON array"],
  ["aic undo [N] [--session PATH]", "put the files back as before the last N commands (default 1)"],
  ["aic redo [--session PATH]", "undo the last undo"],
  ["aic diff [N] [--session PATH]", "show what the N-th last command changed (default 1)"],
  ["aic export --format atif [--session PATH]", "the session as an ATIF trajectory (JSON on stdout)"],
];

// ════════════════════════════════════════════════════════════════════════════
// CLI: reading the command line
// Owns: the command line and the environment into a Config (or help, version,
// search, undo, redo, diff), every bad value refused with one line naming its
// flag; and the model profile and prompt budget derived from it.
// ════════════════════════════════════════════════════════════════════════════

class UsageError extends Error {}

function helpText(): string {
  const lines = [
    ...wrapHelpLine(
      "",
      `aic ${VERSION} — a shell agent: a language model runs one command at a time until the task is done.`,
      2,
    ),
    "",
    "Usage:",
    ...HELP_USAGE.flatMap(([form, meaning]) => helpEntry(form, meaning)),
    "  A request that starts with a dash goes after --.",
    "",
    "Options:",
  ];
  for (const f of FLAGS) {
    const arg =
      f.kind === "bool"
        ? ""
        : ["count", "limit", "fraction"].includes(f.kind)
          ? " N"
          : f.kind === "choice"
            ? ` ${f.choices.join("|")}`
            : " VALUE";
    const extras = [f.default ? `default ${f.default}` : "", f.env ? `env ${f.env.join(", then ")}` : ""].filter(
      Boolean,
    );
    lines.push(...helpEntry(f.name + arg, `${f.help}${extras.length ? ` (${extras.join("; ")})` : ""}`));
  }
  lines.push(
    ...helpEntry("-V, --version", "Print the version and exit."),
    ...helpEntry("-h, --help", "Print this help and exit."),
  );
  lines.push(
    "",
    ...wrapHelpLine(
      "",
      "Exit codes: 0 done, 1 failure, 2 usage, 3 step limit, 4 approval needed without input, 5 token or time budget spent, 6 completion refused 5 times (--done-when), 7 stalled, 129/130/143 signals.",
      2,
    ),
  );
  return lines.join("\n");
}

type ParsedArgs =
  | { kind: "help" }
  | { kind: "version" }
  | { kind: "search"; query: string; maxResults: number }
  | { kind: "undo" | "redo" | "diff"; count: number; session: string }
  | { kind: "export"; format: "atif"; session: string }
  | { kind: "rules-accept"; rules: string }
  | { kind: "run"; config: Config };

function describeFlag(f: FlagSpec): string {
  return f.env ? `${f.name} (or ${f.env.join(" / ")})` : f.name;
}

/** Whole numbers in plain decimal only: " 5", "0x10", "1e3" and "+5" are typing mistakes, not numbers. */
function parseNumberFlag(f: FlagSpec, raw: string): number {
  if (f.kind === "count" || f.kind === "limit") {
    if (!/^[0-9]+$/.test(raw) || Number(raw) <= 0)
      throw new UsageError(`${describeFlag(f)} needs a positive whole number, got '${raw}'`);
    const value = Number(raw);
    if (f.max !== undefined && value > f.max)
      throw new UsageError(`${describeFlag(f)} can be at most ${f.max}, got '${raw}'`);
    return value;
  }
  const value = Number(raw);
  if (!/^([0-9]+\.?[0-9]*|\.[0-9]+)$/.test(raw) || !(value > 0 && value < 1))
    throw new UsageError(`${describeFlag(f)} needs a fraction between 0 and 1 (exclusive), got '${raw}'`);
  return value;
}

function parseUrlFlag(f: FlagSpec, raw: string): string {
  let url: URL | undefined;
  try {
    url = new URL(raw);
  } catch {
    /* refused below */
  }
  if (!url || (url.protocol !== "http:" && url.protocol !== "https:") || !url.hostname)
    throw new UsageError(
      `${describeFlag(f)} needs an http:// or https:// URL such as http://localhost:8000/v1, got '${raw}'`,
    );
  return raw;
}

/**
 * A path to open for writing: it must exist (Landlock needs it), and must
 * not be / or the home directory itself, which would undo the sandbox.
 */
/** An --allow-read path: absolute, its links followed where it exists (it may name a file made later). */
function readablePath(raw: string): string {
  const absolute = path.resolve(raw);
  try {
    return fs.realpathSync(absolute);
  } catch {
    return absolute;
  }
}

function parseWritablePath(f: FlagSpec, raw: string): string {
  let real: string;
  try {
    real = fs.realpathSync(raw);
  } catch {
    throw new UsageError(`${describeFlag(f)}: ${raw} does not exist`);
  }
  let home = "";
  try {
    home = fs.realpathSync(os.homedir());
  } catch {
    /* no home directory to protect */
  }
  if (real === "/" || real === home)
    throw new UsageError(
      `${describeFlag(f)}: ${raw} would make ${real === "/" ? "everything" : "the whole home directory"} writable; name a narrower path`,
    );
  return real;
}

/** The HTTP token characters a header name may use. */
const HEADER_NAME = /^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/;

/** `Name: value` lines into headers. The value is a secret: an error never repeats it. */
function parseHeaders(f: FlagSpec, lines: string[]): Record<string, string> {
  const headers: Record<string, string> = {};
  for (const line of lines) {
    const colon = line.indexOf(":");
    const name = colon > 0 ? line.slice(0, colon).trim() : "";
    const value = colon > 0 ? line.slice(colon + 1).trim() : "";
    if (!HEADER_NAME.test(name) || /[\r\n\0]/.test(value))
      throw new UsageError(`${describeFlag(f)} needs 'Name: value' (one header each; the value you gave is not shown)`);
    headers[name] = value;
  }
  return headers;
}

function parseArgs(argv: string[], env: Record<string, string | undefined>): ParsedArgs {
  if (argv[0] === "search") return parseSearchArgs(argv.slice(1));
  if (argv[0] === "undo" || argv[0] === "redo" || argv[0] === "diff") return parseUndoArgs(argv[0], argv.slice(1));
  if (argv[0] === "export") return parseExportArgs(argv.slice(1));
  if (argv[0] === "rules") return parseRulesArgs(argv.slice(1));
  const given = new Map<FlagSpec, string[]>();
  const words: string[] = [];
  let onlyWords = false;
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!;
    if (onlyWords || arg === "-" || !arg.startsWith("-")) {
      words.push(arg);
      continue;
    }
    if (arg === "--") {
      onlyWords = true;
      continue;
    }
    if (arg === "--help" || arg === "-h") return { kind: "help" };
    if (arg === "--version" || arg === "-V") return { kind: "version" };
    const eq = arg.startsWith("--") ? arg.indexOf("=") : -1;
    const name = eq >= 0 ? arg.slice(0, eq) : arg;
    const spec = FLAGS.find((f) => f.name === name);
    if (!spec)
      throw new UsageError(`unknown option ${name} (see aic --help; a request that starts with a dash goes after --)`);
    if (spec.kind === "bool") {
      if (eq >= 0) throw new UsageError(`${name} takes no value`);
      given.set(spec, ["1"]);
      continue;
    }
    const value = eq >= 0 ? arg.slice(eq + 1) : argv[++i];
    if (value === undefined) throw new UsageError(`${name} needs a value`);
    given.set(spec, spec.kind === "header" || spec.kind === "paths" ? [...(given.get(spec) ?? []), value] : [value]);
  }
  const file = readConfigFile(env);
  const c = configFromFlags(given, env, file, () => recordedEndpoint(sessionToResume(given)));
  const budgetFlag = FLAGS.find((f) => f.name === "--max-prompt-len")!;
  c.budgetGiven = given.has(budgetFlag) || file.values.has(budgetFlag);
  if (c.json && !c.nogui) throw new UsageError("--json needs --nogui");
  // One of the two from the config file, the other on the command line: the command line wins.
  const onLine = (name: string) => given.has(FLAGS.find((f) => f.name === name)!);
  if (c.session !== undefined && c.noSession && onLine("--session") !== onLine("--no-session")) {
    if (onLine("--session")) c.noSession = false;
    else c.session = undefined;
  }
  if (c.session !== undefined && c.noSession) throw new UsageError("--session and --no-session contradict each other");
  if (c.session === "") throw new UsageError("--session needs a file path");
  if (c.session !== undefined) {
    const dir = path.dirname(path.resolve(c.session));
    if (!fs.statSync(dir, { throwIfNoEntry: false })?.isDirectory())
      throw new UsageError(`--session ${c.session}: the directory ${dir} does not exist`);
  }
  if (c.fast) c.compressAlg = "truncate";
  if (c.doneWhen !== undefined && !c.doneWhen.trim()) throw new UsageError("--done-when needs a command");
  c.sessionPath = c.noSession ? undefined : (c.session ?? (c.nogui ? undefined : DEFAULT_SESSION_FILE));
  c.limits = {
    timeoutSec: c.timeoutSec,
    maxOutputBytes: c.maxOutputBytes,
    runawayBytes: RUNAWAY_FACTOR * c.maxOutputBytes,
    ciEnv: !c.noCiEnv,
    sshAgent: c.allowSshAgent,
  };
  c.request = words.length ? words.join(" ") : undefined;
  if (c.nogui && !c.request) throw new UsageError("--nogui needs a request (the task), or - to read it from stdin");
  return { kind: "run", config: c };
}

/**
 * Every flag's value from the command line (`given`), else the environment,
 * else its default, parsed by its kind. The compiler holds each kind to the
 * type of its Config field; what is not a flag (the request, warnings) is
 * filled in here too and set by the caller.
 */
function configFromFlags(
  given: Map<FlagSpec, string[]>,
  env: Record<string, string | undefined>,
  file: SettingsFile = { path: "", values: new Map() },
  recorded: () => RecordedEndpoint = () => ({}),
): Config {
  // The environment wins over the config file; list flags take the file's entries, then the environment's, then the flags'.
  const envValue = (f: FlagSpec): string | undefined => (f.env ?? []).map((name) => env[name]).find((v) => v);
  const fromEnv = (f: FlagSpec): string | undefined => envValue(f) ?? file.values.get(f)?.[0];
  const fromFileList = (f: FlagSpec): string[] => file.values.get(f) ?? [];
  const config = { warnings: [] as string[], notices: [] as string[], request: undefined } as Partial<Config> &
    Pick<Config, "warnings" | "notices">;
  const set = <K extends keyof Config>(key: K, value: Config[K]) => {
    config[key] = value;
  };
  for (const f of FLAGS) {
    const raw = given.get(f)?.[0] ?? fromEnv(f) ?? f.default;
    // A bad value from the config file names the file: the person never typed that flag.
    const fromFile = !given.has(f) && envValue(f) === undefined && file.values.has(f);
    try {
      setFlag(f, raw);
    } catch (error) {
      if (!(error instanceof UsageError) || !fromFile) throw error;
      throw new UsageError(`${file.path}: ${error.message.replace(f.name, f.name.slice(2))}`);
    }
  }
  const named = FLAGS.filter((f) => file.values.has(f) && !given.has(f) && envValue(f) === undefined);
  if (named.length) config.notices.push(`settings from ${file.path}: ${named.map((f) => f.name.slice(2)).join(", ")}`);
  return config as Config;

  function setFlag(f: FlagSpec, raw: string | undefined): void {
    switch (f.kind) {
      case "header": // from the environment first, then the flags (a flag overrides the same name)
        set(
          f.key,
          parseHeaders(f, [
            ...fromFileList(f),
            ...(envValue(f) ?? "").split("\n").filter((l) => l.trim()),
            ...(given.get(f) ?? []),
          ]),
        );
        break;
      case "paths":
        set(
          f.key,
          [...fromFileList(f), ...(envValue(f) ?? "").split(":").filter(Boolean), ...(given.get(f) ?? [])].map((p) =>
            f.key === "allowRead" ? readablePath(p) : parseWritablePath(f, p),
          ),
        );
        break;
      case "bool":
        set(f.key, raw !== undefined);
        break;
      case "text":
        set(f.key, raw);
        break;
      case "required":
      case "url": {
        const value = raw || recorded()[f.key];
        if (!value) {
          // A session that does not parse says so first: fixing it is what lets the run resume.
          const seen = recorded();
          if (seen.broken) throw new UsageError(seen.broken);
          throw new UsageError(`missing ${f.missing}: give ${describeFlag(f)}${seen.why ?? ""}`);
        }
        set(f.key, f.kind === "url" ? parseUrlFlag(f, value) : value);
        break;
      }
      case "limit":
        set(f.key, raw === undefined ? undefined : parseNumberFlag(f, raw));
        break;
      case "count":
      case "fraction":
        set(f.key, parseNumberFlag(f, raw ?? ""));
        break;
      case "choice":
        setChoice(f, raw, config);
    }
  }
}

/** A choice flag's word, or its fallback (with a warning) when it names none of the choices. */
function setChoice(f: Extract<FlagSpec, { kind: "choice" }>, raw: string | undefined, config: Partial<Config>): void {
  const choices: readonly string[] = f.choices;
  const word = raw ?? f.default ?? "";
  if (choices.includes(word)) return void Object.assign(config, { [f.key]: word });
  if (f.fallback === undefined) throw new UsageError(`${f.name} takes ${choices.join(" or ")}, got '${word}'`);
  config.warnings!.push(`unknown ${f.name} '${word}', using ${f.fallback}`);
  Object.assign(config, { [f.key]: f.fallback });
}

function parseSearchArgs(argv: string[]): ParsedArgs {
  let maxResults = 8;
  const words: string[] = [];
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!;
    if (arg === "--max-results" || arg.startsWith("--max-results=")) {
      const raw = arg.includes("=") ? arg.slice(arg.indexOf("=") + 1) : argv[++i];
      const n = Number(raw);
      if (raw === undefined || !Number.isInteger(n) || n <= 0)
        throw new UsageError(`--max-results needs a positive whole number, got '${raw ?? ""}'`);
      maxResults = n;
    } else if (arg === "--help") {
      return { kind: "help" };
    } else {
      words.push(arg);
    }
  }
  if (!words.length) throw new UsageError('search needs a query: aic search "QUERY"');
  return { kind: "search", query: words.join(" "), maxResults };
}

/** `aic undo [N] [--session PATH]`, `aic redo [--session PATH]`, `aic diff [N] [--session PATH]`. */
/**
 * `aic rules accept [--rules FILE] [--session PATH]`: the rules a command
 * wrote, put in force by the person. The file is ./.aicrules, or the one
 * beside the session file, or FILE.
 */
function parseRulesArgs(argv: string[]): ParsedArgs {
  if (argv[0] === "--help" || argv[0] === "-h") return { kind: "help" };
  const usage = "aic rules accept [--rules FILE] [--session PATH]";
  if (argv[0] !== "accept") throw new UsageError(`rules takes one action: ${usage}`);
  let rules: string | undefined;
  let session: string | undefined;
  for (let i = 1; i < argv.length; i++) {
    const arg = argv[i]!;
    const eq = arg.startsWith("--") ? arg.indexOf("=") : -1;
    const name = eq > 0 ? arg.slice(0, eq) : arg;
    const value = eq > 0 ? arg.slice(eq + 1) : argv[++i];
    if (!value || (name !== "--rules" && name !== "--session")) throw new UsageError(`usage: ${usage} (not '${arg}')`);
    if (name === "--rules") rules = value;
    else session = value;
  }
  return { kind: "rules-accept", rules: rules ?? path.join(session ? path.dirname(session) : ".", RULES_FILE_NAME) };
}

function parseUndoArgs(kind: "undo" | "redo" | "diff", argv: string[]): ParsedArgs {
  let session = DEFAULT_SESSION_FILE;
  let count = 1;
  let counted = false;
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!;
    if (arg === "--help" || arg === "-h") return { kind: "help" };
    if (arg === "--session" || arg.startsWith("--session=")) {
      const value = arg.includes("=") ? arg.slice(arg.indexOf("=") + 1) : argv[++i];
      if (!value) throw new UsageError(`${kind} --session needs a file path`);
      session = value;
    } else if (kind !== "redo" && !counted && /^[0-9]+$/.test(arg) && Number(arg) > 0) {
      count = Number(arg);
      counted = true;
    } else
      throw new UsageError(
        `${kind} takes ${kind === "undo" ? "[N] (how many commands) and " : kind === "diff" ? "[N] (which command, 1 the last) and " : ""}[--session PATH], not '${arg}'`,
      );
  }
  return { kind, count, session };
}

/**
 * What an endpoint accepts, by a name aic shows at start. OpenAI's own API
 * refuses parameters that servers of open-weight models want: those servers
 * (vLLM, llama.cpp, SGLang, Ollama…) get `max_tokens` (without it some stop
 * at a small default) and `chat_template_kwargs` to switch thinking on, and
 * that output is reserved inside the prompt budget.
 */
interface ModelProfile {
  name: "openai" | "open-weights";
  /** The answer's length aic asks for (`max_tokens`), reserved in the budget; undefined: the server's own default. */
  maxTokens: number | undefined;
  chatTemplateKwargs: boolean;
}

/** OpenAI's families (GPT, the o-series, ChatGPT, Codex), not the open-weight gpt-oss. */
const OPENAI_MODEL = /^(gpt-(?!oss)|gpt\d|o\d|chatgpt-|codex-)/i;

function modelProfile(config: Pick<Config, "model"> & Partial<Pick<Config, "apiBase">>): ModelProfile {
  let host = "";
  try {
    host = config.apiBase ? new URL(config.apiBase).hostname : "";
  } catch {
    /* judged by the model's name alone */
  }
  const name = config.model.slice(config.model.lastIndexOf("/") + 1);
  const openai = host === "api.openai.com" || host.endsWith(".openai.azure.com") || OPENAI_MODEL.test(name);
  return openai
    ? { name: "openai", maxTokens: undefined, chatTemplateKwargs: false }
    : { name: "open-weights", maxTokens: OUTPUT_RESERVATION_TOKENS, chatTemplateKwargs: true };
}

/** Budget for the prompt: the answer aic asks for is reserved inside the context window. */
function promptBudget(
  config: Pick<Config, "maxPromptLen" | "model"> & Partial<Pick<Config, "apiBase" | "window">>,
): number {
  // With the server's window: the smaller of what it leaves beside the answer and --max-prompt-len.
  const w = config.window;
  if (w) return Math.max(0, Math.min(w.tokens - w.replyTokens, config.maxPromptLen));
  return Math.max(0, config.maxPromptLen - replyReserve(config));
}

/** The answer's reserve: from the server's window when it said one, else the model profile's. */
function replyReserve(
  config: Pick<Config, "model"> & Partial<Pick<Config, "apiBase" | "window" | "maxPromptLen">>,
): number {
  if (config.window) return config.window.replyTokens;
  const most = modelProfile(config).maxTokens;
  // Without a window from the server, --max-prompt-len is the window: the answer gets a quarter of it, at most `most`.
  return most === undefined ? 0 : Math.min(most, Math.floor((config.maxPromptLen ?? Infinity) / 4));
}

// ════════════════════════════════════════════════════════════════════════════
// CLI: settings kept between runs
// Owns: the person's config file (defaults for any long flag) and the model
// and endpoint a session recorded, used when a resumed run names neither.
// ════════════════════════════════════════════════════════════════════════════

/** The config file's values by flag, as the command line would give them. */
interface SettingsFile {
  path: string;
  values: Map<FlagSpec, string[]>;
}

const MAX_CONFIG_BYTES = 256 * 1024;

/** $XDG_CONFIG_HOME/aic/config.toml, or ~/.config/aic/config.toml. */
function configFilePath(env: Record<string, string | undefined>): string {
  const base = env.XDG_CONFIG_HOME || path.join(env.HOME || os.homedir(), ".config");
  return path.join(base, "aic", "config.toml");
}

/**
 * The person's defaults: `model = "…"`, `auto-approve = true`, `header = ["…"]`
 * (long option names without the dashes). A file that does not parse, an
 * unknown name or a value of the wrong type is a usage error naming the file;
 * an API key in a file others can read is refused.
 */
function readConfigFile(env: Record<string, string | undefined>): SettingsFile {
  const file = configFilePath(env);
  const settings: SettingsFile = { path: file, values: new Map() };
  let text: string;
  try {
    const st = fs.statSync(file);
    if (!st.isFile()) throw new UsageError(`${file} is not a regular file`);
    if (st.size > MAX_CONFIG_BYTES) throw new UsageError(`${file} is larger than ${MAX_CONFIG_BYTES} bytes`);
    text = fs.readFileSync(file, "utf8");
    if ((st.mode & 0o077) !== 0 && /^\s*["']?api-key["']?\s*=/m.test(text))
      throw new UsageError(`${file} holds an API key and others may read it: chmod 600 ${file}`);
  } catch (error) {
    // No file, or a home aic may not look into (run as another user): no settings.
    const code = (error as NodeJS.ErrnoException).code;
    if (
      code === "ENOENT" ||
      code === "ENOTDIR" ||
      (code === "EACCES" && (error as { syscall?: string }).syscall === "stat")
    )
      return settings;
    if (error instanceof UsageError) throw error;
    throw new UsageError(`cannot read ${file}: ${(error as Error).message}`);
  }
  let doc: Record<string, unknown>;
  try {
    doc = Bun.TOML.parse(text) as Record<string, unknown>;
  } catch (error) {
    const what = (error as Error).message.replace(/^TOML Parse error:\s*/, "");
    throw new UsageError(`${file}${tomlErrorLine(text, (error as Error).message)}: ${what}`);
  }
  for (const [key, value] of Object.entries(doc)) {
    const spec = FLAGS.find((f) => f.name === `--${key}`);
    if (!spec)
      throw new UsageError(
        `${file}: unknown setting '${key}' (settings are long option names without --, as in model = "…")`,
      );
    const values = settingValues(file, spec, key, value);
    if (values) settings.values.set(spec, values);
  }
  return settings;
}

/** One setting's value as flag words; false for a switch leaves it at its default. */
function settingValues(file: string, spec: FlagSpec, key: string, value: unknown): string[] | undefined {
  if (spec.kind === "bool") {
    if (typeof value !== "boolean") throw new UsageError(`${file}: ${key} takes true or false`);
    return value ? ["1"] : undefined;
  }
  const many = spec.kind === "header" || spec.kind === "paths";
  const list = Array.isArray(value) && many ? (value as unknown[]) : [value];
  if (!list.every((v) => typeof v === "string" || (typeof v === "number" && Number.isFinite(v))))
    throw new UsageError(`${file}: ${key} takes ${many ? "a string or a list of strings" : "a string or a number"}`);
  return list.map(String);
}

/**
 * Where a TOML error is: Bun's parser does not say, so the first line after
 * which the text fails with the same message is taken (a construct still open
 * on an earlier line fails with another one).
 */
function tomlErrorLine(text: string, message: string): string {
  const lines = text.split("\n");
  for (let n = 1; n <= lines.length; n++) {
    try {
      Bun.TOML.parse(`${lines.slice(0, n).join("\n")}\n`);
    } catch (error) {
      if ((error as Error).message === message) return `, line ${n}`;
    }
  }
  return "";
}

/** The model and endpoint a session recorded, or why they are not used. */
interface RecordedEndpoint {
  model?: string;
  apiBase?: string;
  /** The session file does not parse (`PATH:LINE:COL: …`): said instead of a missing flag. */
  broken?: string;
  /** Appended to the missing-flag error when the session's values were not used. */
  why?: string;
}

/** The session file a run would resume: --session, else the default one of the TUI. */
function sessionToResume(given: Map<FlagSpec, string[]>): string | undefined {
  const named = (name: string) => given.get(FLAGS.find((f) => f.name === name)!);
  if (named("--no-session")) return undefined;
  return named("--session")?.[0] ?? (named("--nogui") ? undefined : DEFAULT_SESSION_FILE);
}

/**
 * A resumed run without --model/--api-base talks to the model the session
 * did. Only a file exactly as aic last wrote it is trusted for that: a
 * command could otherwise point the next run, and its API key, at a server of
 * its choosing.
 */
function recordedEndpoint(sessionFile: string | undefined): RecordedEndpoint {
  if (!sessionFile) return {};
  const absolute = path.resolve(sessionFile);
  let bytes: Buffer;
  let now: string;
  try {
    const dir = HeldDirectory.open(path.dirname(absolute));
    try {
      now = identityOf(dir.at(path.basename(absolute))) ?? "";
      bytes = readOwnFile(dir.at(path.basename(absolute)));
    } finally {
      dir.close();
    }
  } catch {
    return {};
  }
  const head = bytes.subarray(0, 64 * 1024).toString("utf8");
  const last = readWrittenRecord(absolute);
  if (last?.identity !== now || last.hash !== createHash("sha256").update(bytes).digest("hex"))
    return {
      broken: unparsedSessionLine(absolute, bytes.toString("utf8")),
      why: `; ${sessionFile} records one, but aic cannot tell the file is as it wrote it (edited, copied or moved since), so it is not used`,
    };
  const field = (key: string): string | undefined => {
    const m = new RegExp(`"${key}"\\s*:\\s*("(?:[^"\\\\]|\\\\.)*")`).exec(head);
    try {
      const value: unknown = m ? JSON.parse(m[1]!) : undefined;
      return typeof value === "string" && value ? value : undefined;
    } catch {
      return undefined;
    }
  };
  return { model: field("model"), apiBase: field("api_base") };
}

// ════════════════════════════════════════════════════════════════════════════
// Secrets
// Owns: the API key and header values once they are parsed: kept out of every
// command's environment, overwritten where /proc shows them, and redacted
// from anything a server echoes back.
// ════════════════════════════════════════════════════════════════════════════

/** Environment variables whose values are secrets: commands never get them, and /proc shows asterisks. */
const SECRET_ENV = ["AIC_API_KEY", "OPENAI_API_KEY", "AIC_HEADERS"];

/**
 * The other model providers' keys (a harness passes several; aic uses one):
 * kept from commands too, so a prompt-injected command cannot send them
 * anywhere. Other services' tokens (GITHUB_TOKEN, NPM_TOKEN) are the task's.
 */
const PROVIDER_KEY_ENV =
  /^((ANTHROPIC|GEMINI|GOOGLE|VERTEX(AI)?|FIREWORKS(_AI)?|TOGETHER(_AI)?|OPENROUTER|GROQ|MISTRAL|CODESTRAL|DEEPSEEK|XAI|COHERE|CO|PERPLEXITY(AI)?|CEREBRAS|DEEPINFRA|NVIDIA(_NIM)?|NIM|AZURE(_OPENAI|_AI)?|HUGGINGFACE|HF|DASHSCOPE|MOONSHOT|KIMI|ZHIPUAI|ZAI|GLM|MINIMAX|SAMBANOVA|REPLICATE|VOYAGE|LITELLM(_PROXY)?|BASETEN|NEBIUS|HYPERBOLIC|NOVITA|LAMBDA|AI21|ANYSCALE|FRIENDLI|NSCALE|QWEN|OPENAI|GOOGLE_GENERATIVE_AI|TOGETHERAI|HOSTED_VLLM|OLLAMA|LLM|MSWEA|DATABRICKS|DATAROBOT|ALEPH_ALPHA|FEATHERLESS(_AI)?|INFINITY|LLAMA|NLP_CLOUD|OPENCODE|PALM|TETRATE|VERCEL_AI_GATEWAY|VOLCENGINE|DOUBAO)_(API_KEY|API_TOKEN|AUTH_TOKEN|MASTER_KEY|KEY|TOKEN)|HF_TOKEN|HUGGING_FACE_HUB_TOKEN|AWS_BEARER_TOKEN_BEDROCK|CLAUDE_CODE_OAUTH_TOKEN)$/;

/** Whether a variable holds a secret aic keeps from commands. */
const isSecretEnv = (name: string) => SECRET_ENV.includes(name) || PROVIDER_KEY_ENV.test(name);

/** Options whose values are secrets, as `--option VALUE` or `--option=VALUE`. */
const SECRET_OPTIONS = ["--api-key", "--header"];

const PR_SET_DUMPABLE = 4;
const MASK = 0x2a; // "*"

/**
 * Keeps commands from reading the API key (and header values) out of aic's
 * own /proc entries. A non-dumpable process's /proc files belong to root,
 * which stops other users; a root command can still read them, so the
 * secrets' bytes are also overwritten where /proc/<pid>/environ and
 * /proc/<pid>/cmdline read them: the original environment and argument
 * blocks. aic keeps its own copies. Linux only; best effort.
 */
function protectSecrets(): void {
  if (process.platform !== "linux") return;
  libc()?.symbols.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
  try {
    const stat = fs.readFileSync("/proc/self/stat", "latin1");
    // Fields 48–51 of stat(5): arg_start, arg_end, env_start, env_end; the list below starts at field 3.
    const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
    const [argStart, argEnd, envStart, envEnd] = [48, 49, 50, 51].map((n) => Number(fields[n - 3]));
    const { toArrayBuffer } = require("bun:ffi") as typeof import("bun:ffi");
    const block = (start: number | undefined, end: number | undefined) =>
      start && end && end > start && end - start < 1 << 24
        ? new Uint8Array(toArrayBuffer(start as unknown as import("bun:ffi").Pointer, 0, end - start))
        : undefined;
    const args = block(argStart, argEnd);
    const env = block(envStart, envEnd);
    if (args) maskSecretArguments(args);
    if (env) maskSecretVariables(env);
  } catch {
    /* the key is still kept out of the commands' environment */
  }
}

/** The [start, end) ranges of the NUL-separated strings of a /proc block. */
function blockStrings(block: Uint8Array): [number, number][] {
  const ranges: [number, number][] = [];
  for (let start = 0; start < block.length;) {
    let end = block.indexOf(0, start);
    if (end < 0) end = block.length;
    ranges.push([start, end]);
    start = end + 1;
  }
  return ranges;
}

function maskSecretVariables(env: Uint8Array): void {
  for (const [start, end] of blockStrings(env)) {
    const text = Buffer.from(env.buffer, env.byteOffset + start, end - start).toString("latin1");
    const eq = text.indexOf("=");
    if (eq > 0 && isSecretEnv(text.slice(0, eq))) env.fill(MASK, start + eq + 1, end);
  }
}

function maskSecretArguments(args: Uint8Array): void {
  const strings = blockStrings(args);
  for (let i = 1; i < strings.length; i++) {
    const [start, end] = strings[i]!;
    const text = Buffer.from(args.buffer, args.byteOffset + start, end - start).toString("latin1");
    if (text === "--") return; // the task's own words follow
    if (SECRET_OPTIONS.includes(text) && strings[i + 1]) {
      const [valueStart, valueEnd] = strings[++i]!;
      args.fill(MASK, valueStart, valueEnd);
      continue;
    }
    const eq = text.indexOf("=");
    if (eq > 0 && SECRET_OPTIONS.includes(text.slice(0, eq))) args.fill(MASK, start + eq + 1, end);
  }
}

/** Secrets (the API key, credential header values) a server might echo back are never shown. */
let secretsToRedact: string[] = [];

/**
 * A word of a header's name (split at - and _) that says its value is a credential: `Authorization`,
 * `x-api-key`, `x-goog-api-key`, `Cookie`, `x-auth-token`. Other values (a gateway's routing,
 * `x-portkey-provider: openai`, where "portkey" is a name, not a key) are words and are shown.
 */
const CREDENTIAL_WORD =
  /^((api|access|auth|bearer|refresh|session|secret|private|client)?(key|token|secret|auth|password|passwd|credentials?|signature)s?|authorization|cookie|apikey)$/i;

const isCredentialHeader = (name: string) => name.split(/[-_]/).some((word) => CREDENTIAL_WORD.test(word));

/** A token that looks generated rather than written: long, letters and digits mixed (an id, a key inside a JSON config). */
const looksGenerated = (token: string) => token.length >= 12 && /\d/.test(token) && /[A-Za-z]/.test(token);

/**
 * What redaction hides: the API key, the values of credential headers (each
 * word of them too: `Bearer sk-…`), and anything that looks generated in
 * another header's value (a gateway config may carry a key). Short, common
 * words (`openai`) are never hidden.
 */
function credentialsOf(config: Pick<Config, "apiKey" | "headers">): string[] {
  const values = Object.entries(config.headers).flatMap(([name, value]) =>
    isCredentialHeader(name)
      ? [value, ...value.split(/\s+/).slice(1)]
      : value.split(/[^A-Za-z0-9._~+/=-]+/).filter(looksGenerated),
  );
  return [config.apiKey ?? "", ...values].filter((v) => v.length >= 8 || (v.length >= 4 && /\d/.test(v)));
}

function redactSecrets(text: string): string {
  let out = text;
  for (const secret of secretsToRedact) if (secret.length >= 4) out = out.split(secret).join("[redacted]");
  return out;
}

// ════════════════════════════════════════════════════════════════════════════
// What the model reads
// Owns: every text the model receives from aic: the tool, the system prompt,
// the tool results and their notes, the nudges of the loop, the summariser's
// request and the anchored summary's place. These are the most tuned words of
// the program, so they live together.
// ════════════════════════════════════════════════════════════════════════════

const TRUNCATION_SENTINEL = "output too long: truncated";
const CONDENSED_TOOL_OUTPUT = "<condensed tool output>";
const SUMMARY_HEADING = "[Prior conversation summary]";
const SUMMARY_UNAVAILABLE = "[summary unavailable]";
const CONTINUE_FALLBACK = "Continue with the current task.";
const SESSION_RECOVERED = "[SESSION RECOVERED]";
const SESSION_RECOVERED_NOTICE = `${SESSION_RECOVERED} The previous aic process ended while this command was running. It was NOT re-executed; do not assume it had any effect. Check the state and run it again if it is still needed.`;
const SKIPPED_BY_USER = "Command execution skipped by user.";
const NOT_EXECUTED_STOPPED = "Command not executed: the run was stopped before it could run.";
const NOT_EXECUTED_INTERRUPTED = "Command not executed: the user interrupted the run.";

/** The one tool the model may call. */
const EXECUTE_BASH_TOOL = {
  type: "function",
  function: {
    name: "execute_bash",
    description:
      "Run one shell command in a pseudo-terminal in the current working directory and return its exit code and output. A command that waits for input (a prompt, a REPL, an editor, a pager) keeps running and you get its screen: answer it with `input` instead of `command`.",
    parameters: {
      type: "object",
      properties: {
        command: { type: "string", description: "The shell command to run." },
        input: {
          type: "string",
          description:
            "Keys to type into the command that waits for input: text, \\n for Enter, and <Esc>, <C-c>, <C-d>, <Tab>, <Up>, <Down>, <Left>, <Right>, <Backspace> for keys. Give command or input, not both.",
        },
      },
    },
  },
} as const;

interface PromptFacts {
  fast: boolean;
  timeoutSec: number;
  maxOutputBytes: number;
  sandbox: Sandbox;
  /** How to call this very executable, for the search recipe. */
  selfCommand: string;
  projectInstructions?: { files: string[]; text: string };
  /** The --done-when check, which the model is told about. */
  doneWhen?: string;
  /** The shell commands run in, and the directory each starts in. */
  shell: string;
  cwd: string;
  /** Commands see CI=true. */
  ciEnv: boolean;
  /** The run's wall-clock budget in seconds (--max-time), which the model is told and reminded of. */
  maxTime?: number;
}

/** The time left of a --max-time budget, as the last line of every tool result. */
function timeLeftLine(leftMs: number, totalSec: number): string {
  return `[time left: ${durationWords(Math.max(0, leftMs))} of ${durationWords(totalSec * 1000)}]`;
}

/** 750 s as "12 min 30 s", 30 s as "30 s", 3600 s as "1 h". */
function durationWords(ms: number): string {
  const total = Math.round(ms / 1000);
  const [h, m, sec] = [Math.floor(total / 3600), Math.floor((total % 3600) / 60), total % 60];
  const parts = [h ? `${h} h` : "", m ? `${m} min` : "", sec || total === 0 ? `${sec} s` : ""];
  return parts.filter(Boolean).join(" ");
}

function buildSystemPrompt(f: PromptFacts): string {
  const s = f.sandbox;
  const clock =
    f.maxTime === undefined
      ? ""
      : ` The whole task has a time budget of ${durationWords(f.maxTime * 1000)} (wall clock, from the user's request): when it is spent the run is stopped wherever it is. Every tool result ends with the time left; plan for it, keep commands short, and finish (or leave the work in a usable state) before it runs out.`;
  const caches = s.caches.length ? ` (the package-manager caches among them, so installing dependencies works)` : "";
  const secrets = s.secrets.length
    ? ` Files in the usual secret stores (${s.secrets.join(", ")}) cannot be read at all${s.jail === "namespaces" ? " (those directories look empty)" : ""}.`
    : "";
  const sandboxLine = s.enabled
    ? `Commands run inside a Landlock sandbox: they may read and execute almost anything, but may write only under ${s.writable.join(", ")}${caches}.${secrets} A "Permission denied" there comes from the sandbox; do not try to get around it. Installing works inside the project (npm install, a virtualenv: python3 -m venv .venv, then .venv/bin/pip install) and through the package caches; system-wide installs and pip install --user (~/.local) do not.${jailPromptLine(s)}`
    : `No sandbox confines your commands (${s.status}); they can change anything this user can, so be careful with destructive commands.`;
  // Without a network (--network off) there is no web to search: the model is not told of a way that fails.
  const search =
    s.network === "loopback"
      ? ""
      : `To search the web run: ${f.selfCommand} search "QUERY" (it prints a JSON array of {title, href, body}). To read a page, fetch it with curl -sL or wget -qO-.`;
  const capRule = `Each command's output reaches you capped at ${f.maxOutputBytes} bytes. When it is longer you get its head and tail, a line naming a file that holds the whole output, and the final line "${TRUNCATION_SENTINEL}". When you see that, do not re-run the command: read the saved file in slices (sed -n '100,200p', head -c, tail -c) or search it with grep and wc. For commands you expect to be long, redirect their output to a file yourself and read it the same way.`;
  const timeoutRule = `Each command is killed after ${f.timeoutSec} seconds (its result then says it timed out). Start long-running work (a server, a long build) in the background with & and its output redirected (cmd > log 2>&1 &): it keeps running after your command returns, as a background job (at most ${MAX_JOBS} at once), and every later tool result ends with a line per job saying whether it still runs and the exact command that stops it. Poll its log; stop it with that command when you are done with it. Otherwise split the work into smaller steps or bound it with timeout.${clock}`;
  const shellName = path.basename(f.shell);
  const shellRule = `Every command runs in ${shellName} (${f.shell} -c), in a fresh shell that starts in ${f.cwd}: a cd or an export does not carry over to the next command, so chain steps with && or give paths from there.${f.ciEnv ? " Commands see CI=true, so test runners run once instead of watching, and tools do not prompt." : ""}`;
  const doneWhen = f.doneWhen
    ? ` Your claim is checked by running \`${f.doneWhen}\`: if that fails, you get its output and keep working.`
    : "";
  const honesty =
    "Never invent the output of a command or claim a result you have not seen. Do not write execution metadata (exit codes, timings, tool-call syntax) yourself; aic reports those.";
  const marker = `When, and only when, the whole task is finished and you have checked the result, answer with the single word ${MARKER} on its own and no tool call. Never write that word earlier, in a plan, or in a message that also calls a tool.${doneWhen}`;
  if (f.fast) {
    return (
      [
        "You are a shell agent. You complete the user's task by running shell commands with the execute_bash tool, one at a time, and reading each result before the next step.",
        marker,
        shellRule,
        capRule,
        timeoutRule,
        `A command that waits for input keeps running and you get its screen: answer with execute_bash {"input": "..."} (${INPUT_KEYS_HELP}).`,
        honesty,
        search,
      ]
        .filter(Boolean)
        .join("\n\n") + projectSection(f.projectInstructions)
    );
  }
  return (
    [
      "You are an autonomous engineer working in a Linux shell. You complete the user's task by running shell commands through the execute_bash tool and judging what each one printed. You keep working until the task is done.",
      "How to work:\n" +
        "1. Start by writing a numbered task list: the steps you plan to take. Every five steps or so, restate the list with what is done and what remains.\n" +
        "2. Run one command per step. Read its exit code and output carefully before deciding the next step; if it failed, find out why and fix it rather than moving on.\n" +
        "3. Prefer small, checkable steps. Verify your work (run the tests, read back the file, check the service answers) before you call the task finished.\n" +
        "4. Keep going on your own. Ask the user a question only when you have run out of reasonable options.",
      marker,
      shellRule,
      capRule,
      timeoutRule,
      `Commands run in a pseudo-terminal. Prefer non-interactive forms (-y / --yes / --non-interactive flags, DEBIAN_FRONTEND=noninteractive, git --no-pager, here-documents). When a command does wait for input (a prompt, a REPL, an editor, a pager) it keeps running and you get its screen with status waiting_for_input; a program that runs until interrupted (top, watch, tail -f) comes back as waiting_on_time. Answer with execute_bash {"input": "..."}: ${INPUT_KEYS_HELP}. One command waits at a time; a new command stops it first.`,
      sandboxLine,
      honesty,
      search,
    ]
      .filter(Boolean)
      .join("\n\n") + projectSection(f.projectInstructions)
  );
}

/** What the jail means for the model's commands (nothing without it). */
function jailPromptLine(s: Sandbox): string {
  if (s.jail !== "namespaces") return "";
  const network =
    s.network === "loopback"
      ? " They have no network: only loopback (127.0.0.1) works, so downloads and installs from registries fail."
      : "";
  const agent = s.sshAgent ? " The user's ssh-agent is passed through, so git over ssh can authenticate." : "";
  return ` They also run in a jail of their own: they see only their own processes, not the user's terminal or servers, and nothing they start outlives the run. The repository's settings and hooks (.git/config, .git/hooks) are read-only: commit, branch, merge, rebase, stash and push work, but what writes the settings (git config, git remote add, push -u, branch --set-upstream-to) fails with "could not write config file .git/config: Device or resource busy", sometimes with exit code 0, so the setting was NOT made; a hook write fails with "Read-only file system". Ask the user to do those.${network}${agent}`;
}

function projectSection(p: PromptFacts["projectInstructions"]): string {
  if (!p || !p.text) return "";
  return `\n\n# Project instructions (from ${p.files.join(", ")})\n\n${p.text}`;
}

function invalidArgumentsMessage(name: string, args: string, error: string): string {
  return [
    `Error: the arguments of your ${name || "tool"} call are not valid JSON (${error}).`,
    `You sent: ${args.length > 500 ? args.slice(0, 500) + "…" : args}`,
    `Send exactly one JSON object: keys and strings in double quotes, newlines inside strings written as \\n, quotes inside strings escaped as \\", no trailing commas. For example: {"command": "ls -la"}`,
  ].join("\n");
}

/** The tool answer for a call whose arguments the output limit cut off half-way: not a quoting mistake. */
function cutOffMessage(name: string, limit: number | undefined): string {
  const cap = limit ? `the output limit (max_tokens ${limit})` : "the output limit of the server";
  return `Error: your answer was cut off by ${cap} in the middle of this ${name || "tool"} call, so its arguments are incomplete and nothing ran. Send shorter calls: write a long file in parts (cat > f <<'EOF' for the first part, cat >> f <<'EOF' for each next one), or generate it with a short command.`;
}

/** The tool answer for a command a deny rule refused: which part, which rule, why. */
function deniedByRuleMessage(v: RuleVerdict, file: string): string {
  const why = v.rule?.reason ? `: ${v.rule.reason}` : "";
  return `Command refused: \`${v.part}\` is forbidden by the rule "${v.rule?.written}" in ${file}${why}. Nothing ran. Do not try to get around this rule; if the task cannot be done without it, say so.`;
}

/** The tool answer for a command the rules cannot see through while deny rules hold and nobody approves by hand. */
function unseenCommandMessage(unsure: string, rules: { path: string; rules: readonly CommandRule[] }): string {
  const denies = rules.rules.filter(refuses).map((r) => `"${r.written}"`);
  return `Command refused: ${unsure}, so aic cannot tell whether it runs something the deny rules of ${rules.path} forbid (${denies.join(", ")}), and with auto-approve such a command is never run. Nothing ran. Name every program literally (no variables as command names, no code handed to an interpreter in a string), or do without it.`;
}

/** The tool answer for a command that needed a person when nobody can answer (--nogui, no terminal, rules present). */
function needsPersonMessage(v: RuleVerdict, file: string, allowed: string[]): string {
  const why = v.unreadable
    ? `aic could not read it for its rules (${v.unreadable})`
    : v.rule
      ? `the rule "${v.rule.written}" in ${file} asks for a person${v.part ? ` for \`${v.part}\`` : ""}`
      : `no rule in ${file} allows \`${v.part ?? "it"}\``;
  const list = allowed.length
    ? ` Commands that run without asking: ${allowed.map((a) => `\`${a}\``).join(", ")}.`
    : " No command runs without asking in this run.";
  return `Command not run: it needs a person's approval (${why}), and nobody can answer in this run.${list} Use allowed commands, or finish without this one.`;
}

const CONTINUE_MESSAGE = `You answered without calling a tool. Keep working on the task with execute_bash. When the task is truly finished and verified, reply with ${MARKER} alone.`;

/** The summariser sees each evicted message whole up to this size; a longer one keeps its head and tail. */
const TRANSCRIPT_MESSAGE_CHARS = 4000;
const TRANSCRIPT_HEAD_CHARS = 2000;
const TRANSCRIPT_TAIL_CHARS = 1500;
/** The summary is asked for in at most 5000 characters; a longer one is cut here. */
const SUMMARY_MAX_CHARS = 6000;
/** Room kept in the budget for the summary itself (~5000 characters is about 1300 tokens). */
const SUMMARY_ALLOWANCE_TOKENS = 1500;

const SUMMARISER_SYSTEM = "You are a precise conversation summarizer.";

function summariserRequest(
  systemPrompt: string,
  firstUser: string,
  prior: string | undefined,
  evicted: string,
): Message[] {
  const ask = [
    "Below is the older part of a conversation between a user and an autonomous shell agent, which is being removed from the agent's context window.",
    "Write a concise, structured summary of it (5000 characters at most) so the agent can carry on without it. Use these headings:",
    "1. Primary request and intent",
    "2. Key technical concepts",
    "3. Files and code (paths, what changed, important snippets)",
    "4. Errors and fixes",
    "5. Problem solving (what was tried, what worked)",
    "6. All user messages (each one, briefly)",
    "7. Pending tasks",
    "8. Current work (what was being done right before this point)",
    "9. Next step",
    "Fold the previous summary in, if there is one, so nothing it recorded is lost. This request to summarise is bookkeeping, not a request from the user: do not list it among the user's messages.",
    "",
    "=== The agent's system prompt ===",
    systemPrompt,
    "",
    "=== The user's first command ===",
    firstUser,
    "",
    "=== Previous summary ===",
    prior ?? "(none)",
    "",
    "=== Messages being removed ===",
    evicted,
  ].join("\n");
  return [
    { role: "system", content: SUMMARISER_SYSTEM },
    { role: "user", content: ask },
  ];
}

/** The system prompt plus, when present, the anchored summary after it: one system message. */
function systemContent(basePrompt: string, summary: string | undefined): string {
  return summary ? `${basePrompt}\n\n${SUMMARY_HEADING}\n${summary}` : basePrompt;
}

/** Splits a stored system message back into its prompt and its summary (the summary survives restarts). */
function splitSummary(content: string): { base: string; summary: string | undefined } {
  const at = content.indexOf(`\n\n${SUMMARY_HEADING}\n`);
  if (at < 0) return { base: content, summary: undefined };
  return { base: content.slice(0, at), summary: content.slice(at + SUMMARY_HEADING.length + 3) };
}

const SKIPPED_AFTER_SUGGESTION =
  "Command not executed: the user rejected an earlier command of this turn with a suggestion.";
const NO_ARGUMENTS_MESSAGE = "No arguments provided for function call";
const BOTH_COMMAND_AND_INPUT_MESSAGE =
  'Give either "command" (a new command) or "input" (keys for the command that waits), not both: nothing ran.';
const NO_WAITING_COMMAND_MESSAGE =
  'No command is waiting for input, so nothing was typed. Run a command with {"command": "..."}.';
/** The keys `input` may name, and the text that stands for them. */
const INPUT_KEYS_HELP =
  "text, \\n for Enter, and <Esc>, <C-c>, <C-d>, <Tab>, <Up>, <Down>, <Left>, <Right>, <Backspace> for keys";

// ════════════════════════════════════════════════════════════════════════════
// What the model reads: notes in tool results
// Owns: the notes a tool result carries besides the output: a command waiting
// for input, typed keys, cut output, changed files, the repository guard's
// report, jobs, refusals and the sandbox's refusals.
// ════════════════════════════════════════════════════════════════════════════

/** What the model is told when a command waits and keeps running, handed to it with its screen. */
function waitingMessage(o: {
  verdict: "waiting_for_input" | "waiting_on_time";
  reason: string;
  program: string;
  output: string;
  screen: string;
  fullScreen: boolean;
}): string {
  const what =
    o.verdict === "waiting_for_input"
      ? `The command is still running and waits for input (${o.program}: ${o.reason}).`
      : `The command is still running: ${o.program} runs until it is interrupted (${o.reason}).`;
  const scrolled = o.output ? `Output before the screen below:\n${o.output}\n` : "";
  const screen = `${o.fullScreen ? "Its whole screen" : "Its screen"}:\n${o.screen || "(empty)"}`;
  const how =
    o.verdict === "waiting_for_input"
      ? `Answer it with execute_bash {"input": "..."}: ${INPUT_KEYS_HELP}. A call with a command stops it first.`
      : `End it with execute_bash {"input": "q"} or {"input": "<C-c>"}, or type into it as into any program (${INPUT_KEYS_HELP}). A call with a command stops it first.`;
  return `${what}\n${scrolled}${screen}\n${how}`;
}

/** Said before a new command's result when it first stopped the command that waited. */
const stoppedWaitingNote = (program: string, exitCode: number | null) =>
  `(The command that was waiting for input, ${program}, was stopped first${exitCode === null ? "" : ` (exit code ${exitCode})`}.)`;
/** Lines of one input not typed because another program came to read the terminal (they were judged for the first). */
const typingStoppedNote = (typed: number, of: number, program: string) =>
  `Typing stopped after ${typed} of ${of} lines: another program than ${program} now reads the terminal, and keys are judged for the program that reads them. Send the rest again if you still mean it.`;
/** A command's output the emulator could not render in time (hostile escape sequences): the rest is not shown. */
const renderingCutNote = (ms: number) =>
  `[aic stopped rendering this output after ${ms / 1000} s: it asks the terminal for more work than text ever needs]`;
/** Input that was not typed (refused or rejected): the program is still there, waiting. */
const stillWaitingNote = (program: string) =>
  `Nothing was typed: ${program} still waits for input, its screen as before. Type something else, or stop it with {"input": "<C-c>"} or a new command.`;
/** Input for a command that had already ended on its own: nothing was typed; how it ended follows. */
const endedBeforeInputNote = (program: string) =>
  `Nothing was typed: the command that was waiting for input (${program}) had already ended on its own.`;
const unknownFunctionMessage = (name: string) => `Unknown function: ${name}`;
/** A person's text typed while the agent works, heard at the start of the next step. */
const steeringMessage = (text: string) => `[Suggestion from user] ${text}`;
/** A person's answer to an approval that rejects the command and says what to do instead. */
const suggestionInsteadMessage = (text: string) => `I suggest you ${text}`;

/** The line between the head and the tail of a cut output: how much is missing and where the whole of it is. */
function truncationNote(
  omitted: number,
  total: number,
  lines: number,
  where: { savedTo: string } | { error: string },
): string {
  const whole =
    "error" in where
      ? `The whole output could not be saved (${where.error}); redirect it to a file yourself and read that in slices`
      : `The whole output is saved in ${where.savedTo}; read it in slices (sed -n, head -c, tail -c, grep) instead of re-running the command`;
  return `[… ${omitted} bytes left out of ${total} (${lines} lines). ${whole} …]`;
}

/** A file name as one visible word: a newline or carriage return in it is shown, never a line break that forges output. */
function visibleName(name: string): string {
  return visibleControls(name.replace(/\r/g, "\u240d").replace(/\n/g, "\u240a").replace(/\t/g, "\u2409"));
}

/** The line a tool result ends with when the command changed files: the first few names of each kind. */
function changedFilesNote(c: ChangedFiles): string {
  const part = (label: string, list: string[]) =>
    list.length
      ? `${label} ${list.slice(0, 8).map(visibleName).join(", ")}${list.length > 8 ? ` and ${list.length - 8} more` : ""}`
      : "";
  const parts = [part("created", c.created), part("modified", c.modified), part("deleted", c.deleted)].filter(Boolean);
  return parts.length ? `Files changed: ${parts.join("; ")}.` : "";
}

/** What the repository guard did in one look: the settings, hooks and pointers it took out, and words on its search. */
interface GuardReport {
  taken: string[];
  notes: string[];
}

/** A guard report for the model and the person; "" when there is nothing to say. */
const disarmedMessage = (report: GuardReport) =>
  [
    ...(report.taken.length
      ? [`aic took out what would have made git run code outside the sandbox: ${report.taken.join("; ")}.`]
      : []),
    ...report.notes.map((n) => `aic: ${n}.`),
  ].join(" ");

/** Output a command printed faster than it could be rendered, when even pausing it could not keep up. */
const droppedOutputNote = (bytes: number) =>
  `[… ${bytes} bytes arrived faster than they could be rendered and were left out …]`;

/** How the person is told a job ended, by its state. */
const JOB_ENDINGS: Record<Job["state"], string> = {
  running: "ended",
  ended: "ended",
  killed: "stopped",
  stopped_at_exit: "stopped as aic exits",
  kept_at_exit: "left running",
  refused: "stopped",
};

function jobStateText(job: Job): string {
  const code = job.exitCode === null ? "exit code unknown" : `exit code ${job.exitCode}`;
  const took = waitText((job.endedAt ?? Date.now()) - job.startedAt);
  switch (job.state) {
    case "running":
      return `running for ${took}`;
    case "killed":
      return `stopped by the person after ${took}`;
    case "stopped_at_exit":
      return `stopped when aic exited, after ${took}`;
    case "kept_at_exit":
      return `left running when aic exited (--keep-jobs), after ${took}`;
    case "refused":
      return `stopped at once: too many jobs`;
    case "ended":
      return `ended after ${took}, ${code}`;
    default:
      return unreachable(job.state);
  }
}

/**
 * `[job 1] running for 12 s: process group 4242 (python3 -m http.server 8123); stop it with: kill -- -4242; its
 * terminal is logged to /tmp/…/job-….log`. A job is its process group (a dev server's children included), so the
 * line names the one command that stops all of it; `kill %1` would mean nothing to the next command's fresh shell.
 */
function jobLine(job: Job, group = jobGroup(job)): string {
  const running =
    job.state === "running" ? `; stop it with: kill -- -${group}; its terminal is logged to ${job.terminal.path}` : "";
  return `[job ${job.id}] ${jobStateText(job)}: process group ${group} (${job.command})${running}`;
}

/** The line a tool result ends with when the command left more jobs than may run: they were stopped. */
function refusedJobsNote(refused: readonly { command: string }[]): string {
  return `This command left ${refused.length} more process group(s) running, but at most ${MAX_JOBS} background jobs run at once, so aic stopped them: ${refused.map((j) => j.command).join("; ")}. Stop a job you no longer need (kill its pid) before starting another.`;
}

/** What the model is told when the --done-when check refuses its claim of completion. */
function completionRefusal(command: string, result: CommandResult): string {
  const how = result.status === "exited" ? "" : ` (${result.status.replace(/_/g, " ")})`;
  const code = result.exitCode ?? "without an exit code";
  return `[Completion check failed] ${command} exited ${code}${how}:\n${result.output.trim() ? result.output : "(no output)"}\nThe task is not finished: keep working, and claim completion again only once this check would pass.`;
}

/** Added to the conversation when the person undid a command whose turn was compressed away. */
const undoneNote = (what: string) =>
  `[aic] The person undid ${what}: the files are back as they were before it ran. Do not rely on what it did.`;

/** The tool message for one finished command: its exit code and what a person would have seen, or why it ended early. */
function describeCommandResult(r: CommandResult, limits: CommandLimits): string {
  const { timeoutSec } = limits;
  switch (r.status) {
    case "exited":
      return `Command executed with exit code ${r.exitCode}.\nOutput:\n${r.output}`;
    case "timed_out":
      return `Command timed out after ${timeoutSec} seconds and was killed (exit code ${r.exitCode}). For long work start it in the background (cmd > log 2>&1 &) and poll the log, split the work, or wrap it in timeout.\nOutput before it was stopped:\n${r.output}`;
    case "waiting_for_input":
      return `Command stopped: it was waiting for input from the terminal and nobody can answer it (exit code ${r.exitCode}). Re-run it non-interactively: use flags such as -y/--yes/--non-interactive, pipe answers with yes |, or feed a here-document.\nOutput before it was stopped:\n${r.output}`;
    case "runaway":
      // A command that printed its last bytes and ended as the stop came (cat of a big file) was not stopped.
      return r.exitCode === 0
        ? `Command executed with exit code 0, but it printed more than ${limits.runawayBytes} bytes, the runaway-output limit, and what came after that limit is not kept. Redirect big outputs to a file and read slices of it.\nOutput:\n${r.output}`
        : `Command stopped: it printed more than ${limits.runawayBytes} bytes, the runaway-output limit (exit code ${r.exitCode}). Redirect big outputs to a file and read slices of it.\nOutput:\n${r.output}`;
    case "not_started":
      return `Command could not be started: ${r.output}. Nothing ran.`;
    case "interrupted":
      return `Command interrupted by the user (exit code ${r.exitCode}).\nOutput before it was stopped:\n${r.output}`;
    case "stopped":
      return `Command stopped before it finished because the run was stopped (exit code ${r.exitCode}).\nOutput before it was stopped:\n${r.output}`;
  }
}

/** Why the sandbox, not file permissions, refused an operation on a path a failed command names. */
type SandboxRefusal = "secret" | "write" | "exec" | "gitconfig";

/** One line per path the sandbox refused, so the model stops chasing "are you root?" or `--user` installs. */
function sandboxRefusalMessage(refusals: { path: string; why: SandboxRefusal; detail: string }[]): string {
  const reason = (why: SandboxRefusal, detail: string) =>
    ({
      secret: `it is in a secret store commands may not read (${detail})`,
      write: `commands may write only under ${detail}; ask the person to rerun aic with --allow-write for this path, or work inside those directories`,
      exec: `a deny rule forbids running ${detail}`,
      gitconfig: `the jail keeps a repository's config read-only (a setting there could make the person's own git run a program); for one command pass it as git -c NAME=VALUE, or tell the person what to set`,
    })[why];
  return refusals
    .map(
      (r) =>
        `[sandbox] The sandbox refused this, not file permissions or a missing root: ${r.path}: ${reason(r.why, r.detail)}.`,
    )
    .join("\n");
}

/**
 * Every text of this section by name, for the snapshot test that shows each
 * one as the model reads it (tests/model-texts.test.ts): a change to any of
 * them is a change to what every model is told, and shows in review.
 */
const MODEL_TEXTS = {
  TRUNCATION_SENTINEL,
  CONDENSED_TOOL_OUTPUT,
  SUMMARY_HEADING,
  SUMMARY_UNAVAILABLE,
  CONTINUE_FALLBACK,
  SESSION_RECOVERED_NOTICE,
  SKIPPED_BY_USER,
  NOT_EXECUTED_STOPPED,
  NOT_EXECUTED_INTERRUPTED,
  EXECUTE_BASH_TOOL,
  buildSystemPrompt,
  invalidArgumentsMessage,
  cutOffMessage,
  deniedByRuleMessage,
  unseenCommandMessage,
  needsPersonMessage,
  sandboxRefusalMessage,
  timeLeftLine,
  CONTINUE_MESSAGE,
  SUMMARISER_SYSTEM,
  summariserRequest,
  systemContent,
  SKIPPED_AFTER_SUGGESTION,
  NO_ARGUMENTS_MESSAGE,
  unknownFunctionMessage,
  steeringMessage,
  suggestionInsteadMessage,
  truncationNote,
  changedFilesNote,
  disarmedMessage,
  droppedOutputNote,
  jobLine,
  refusedJobsNote,
  completionRefusal,
  undoneNote,
  describeCommandResult,
  BOTH_COMMAND_AND_INPUT_MESSAGE,
  NO_WAITING_COMMAND_MESSAGE,
  waitingMessage,
  stoppedWaitingNote,
  endedBeforeInputNote,
  stillWaitingNote,
  typingStoppedNote,
  renderingCutNote,
} as const;

// ════════════════════════════════════════════════════════════════════════════
// Events
// Owns: the typed events the agent emits, the statuses a command and a run end
// with, and the sink every front end is (the next section words them).
// ════════════════════════════════════════════════════════════════════════════

interface Usage {
  input_tokens: number;
  output_tokens: number;
  cached_tokens: number;
  billable_tokens: number;
  /** Set once any figure was counted by aic because the server reported none. */
  estimated?: boolean;
}

/** What the sandbox gives commands, as the start event reports it. */
interface SandboxFacts {
  enabled: boolean;
  /** One line for people: `on (…)` or `off (why)`. */
  status: string;
  /** How commands are confined: `namespaces` (the jail: Landlock inside namespaces), `landlock` alone, or `off`. */
  jail: "namespaces" | "landlock" | "off";
  /** Why the confinement is no stronger than `jail` (null in the jail). */
  reason: string | null;
  /** What the jail promises that does not hold in this mode, e.g. "processes outlive aic", "sockets". */
  missing: string[];
  writable: string[];
  unreadable: string[];
  /** `on`, or `loopback` (--network off). */
  network: "on" | "loopback";
  /** How many Landlock rules each command's ruleset holds. */
  rules: number;
}

type AgentEvent =
  | {
      type: "start";
      aic_version: string;
      /** The JSON Lines schema (see the README's JSON section): raised when a field changes meaning or goes away. */
      schema: number;
      session_id: string;
      model: string;
      /** What aic sends the model's endpoint (see modelProfile). */
      model_profile: ModelProfile["name"];
      api_base: string;
      cwd: string;
      sandbox: SandboxFacts;
      /** The prompt budget, and where it came from (the server's window, --max-prompt-len, or the default). */
      budget: BudgetFacts;
      /** The command rules file in force, or null when there is none. */
      rules: string | null;
      session: string | null;
      request: string;
    }
  | { type: "info"; text: string }
  | { type: "warning"; text: string }
  | { type: "step"; step: number; max_steps: number }
  | { type: "assistant_delta"; text: string }
  | { type: "reasoning_delta"; text: string }
  | { type: "thinking_complete" }
  | { type: "assistant"; content: string; tool_calls: { id: string; name: string; arguments: string }[] }
  | { type: "reasoning"; text: string }
  | { type: "retry"; attempt: number; wait_ms: number; reason: string }
  /** Waiting for the model's first chunk (a local server reading the prompt); llama.cpp says how far it has read. */
  | { type: "model_wait"; elapsed_ms: number; prompt_progress?: { processed: number; total: number } }
  | { type: "discarded"; reason: string }
  | { type: "context"; estimate: number; budget: number }
  | { type: "command"; id: string; command: string }
  /** Keys the model types into the command that waits (`into`: the program in its foreground; `command_id`: its call). */
  | { type: "input"; id: string; input: string; into: string; command_id: string }
  | {
      type: "approval";
      id: string;
      /** allowed / denied: by a rule of the rules file, named in `rule`. */
      decision: "approved" | "auto" | "allowed" | "read_only" | "denied" | "rejected" | "suggestion" | "no_input";
      suggestion?: string;
      rule?: string;
      /** Lines an "always allow" answer added to the rules file. */
      added_rules?: string[];
    }
  | { type: "command_output"; id: string; data: Uint8Array }
  | { type: "command_waiting"; id: string }
  | {
      type: "command_result";
      id: string;
      exit_code: number | null;
      /**
       * How it ended, or why it never ran (`denied` by a rule, `refused` for want of a person, `rejected` by the
       * person, `skipped`); or `waiting_for_input` / `waiting_on_time` with `exit_code` null: it still runs,
       * handed to the model, `output` its screen.
       */
      status: ResultStatus;
      duration_ms: number;
      /** What the person saw (rendered and capped), without the words aic adds for the model. */
      output: string;
      saved_to?: string;
      /** What the command created, modified and deleted under the start directory (null when checkpoints are off). */
      changed_files: ChangedFiles | null;
    }
  | {
      type: "compression";
      algorithm: string;
      before_tokens: number;
      after_tokens: number;
      removed: number;
      detail: string;
    }
  | { type: "summary_delta"; text: string }
  | {
      type: "usage";
      prompt_tokens: number;
      completion_tokens: number;
      cached_tokens: number;
      estimated: boolean;
      total: Usage;
      context_estimate: number;
      budget: number;
      /** Input plus output tokens of every model call of this process, against --max-tokens (null: no budget). */
      spent: number;
      max_tokens: number | null;
    }
  /** `pid` is the leader's pid as aic sees it; `group` the process group as commands see it (the jail numbers its own). */
  | { type: "job_started"; id: number; pid: number; group: number; command: string; log: string }
  | { type: "job_ended"; id: number; pid: number; exit_code: number | null; how: Job["state"] }
  | {
      type: "verify";
      command: string;
      exit_code: number | null;
      status: CommandStatus;
      passed: boolean;
      output: string;
    }
  | { type: "error"; message: string }
  | {
      type: "end";
      status: RunStatus;
      exit_code: number;
      steps: number;
      usage: Usage;
      /** True when --done-when confirmed the completion. */
      verified: boolean;
      duration_ms: number;
      session_id: string;
      /** Commands refused because they needed a person and nobody could answer. */
      refused: number;
      /** The model's last answer, without the completion marker ("" when it gave none). */
      result: string;
      /** Why a run that looked finished failed: `commands_not_started` when no command could start after the last that failed to. */
      reason?: "commands_not_started";
      /** With --keep-jobs: the background jobs left running (pids as the person sees them)… */
      kept?: { pid: number; command: string; log: string }[];
      /** …and how many other processes of the commands' were left running. */
      kept_others?: number;
    };

type AgentEventType = AgentEvent["type"];

/**
 * The events describeEvent has no words for: streamed text, figures for the
 * footer, the model's own turn. Each front end shows them its own way, so
 * each names every one of them before it words the rest: one added here
 * fails the build in every front end until it says what to do with it.
 */
type OwnWayEventType =
  | "assistant"
  | "assistant_delta"
  | "command_output"
  | "command_waiting"
  | "context"
  | "reasoning"
  | "reasoning_delta"
  | "step"
  | "summary_delta"
  | "thinking_complete"
  | "usage";
/** The events every front end words alike, through describeEvent. */
type WordedEvent = Exclude<AgentEvent, { type: OwnWayEventType }>;

/** Why a command the model proposed never ran. */
type NotRun = "denied" | "refused" | "rejected" | "skipped";
/** How a command_result says its command went. */
type ResultStatus = CommandStatus | NotRun | "waiting_on_time";

/**
 * What each status of a command_result means wherever one is shown or
 * counted: whether the command ran at all (a run none of whose commands can
 * start cannot succeed: see StartWatch), and what a command still running,
 * handed to the model (`exit_code` null), is doing.
 */
const RESULT_STATUSES: Record<ResultStatus, { ran: boolean; stillRuns: string | null }> = {
  exited: { ran: true, stillRuns: null },
  timed_out: { ran: true, stillRuns: null },
  waiting_for_input: { ran: true, stillRuns: "waits for input" },
  waiting_on_time: { ran: true, stillRuns: "runs until interrupted" },
  runaway: { ran: true, stillRuns: null },
  stopped: { ran: true, stillRuns: null },
  interrupted: { ran: true, stillRuns: null },
  not_started: { ran: false, stillRuns: null },
  denied: { ran: false, stillRuns: null },
  refused: { ran: false, stillRuns: null },
  rejected: { ran: false, stillRuns: null },
  skipped: { ran: false, stillRuns: null },
};
type RunStatus =
  | "completed"
  | "step_limit"
  | "stopped"
  | "interrupted"
  | "needs_approval"
  | "failed"
  | "terminal"
  | "token_budget"
  | "time_budget"
  | "unverified"
  | "stalled"
  | "answered";

interface EventSink {
  emit(event: AgentEvent): void;
}

/** C0 controls but tab and newline, DEL, C1 controls, and the bidirectional overrides that make text read otherwise than it runs. */
const CONTROL_CHARACTERS = /[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;

// ════════════════════════════════════════════════════════════════════════════
// Events: how they are worded
// Owns: text made safe for a terminal, the streamed answer's marker filter and
// reducer, and the one wording of every event that plain text, JSON and the TUI
// share.
// ════════════════════════════════════════════════════════════════════════════

/**
 * Text from the model, a server or a file, made safe for a person's
 * terminal: a carriage return is dropped and every other control character
 * is shown (ESC as ␛, BEL as ␇, an override as <U+202E>) instead of acting,
 * so no escape sequence can write the clipboard, retitle the window, clear
 * the screen, or hide part of a command that waits for approval.
 */
function visibleControls(text: string): string {
  return text.replace(CONTROL_CHARACTERS, (c) => {
    const code = c.charCodeAt(0);
    if (code === 0x0d) return "";
    if (code < 0x20) return String.fromCharCode(0x2400 + code);
    if (code === 0x7f) return "\u2421";
    return `<U+${code.toString(16).toUpperCase().padStart(4, "0")}>`;
  });
}

/**
 * Hides the completion marker from what a person reads while it streams:
 * a chunk may end in the middle of "TASKCOMPLETE", so a possible prefix is
 * held back until the next chunk shows what it was.
 */
class MarkerFilter {
  private held = "";
  push(text: string): string {
    const joined = (this.held + text).split(MARKER).join("");
    let keep = 0;
    for (let n = Math.min(MARKER.length - 1, joined.length); n > 0; n--) {
      if (MARKER.startsWith(joined.slice(joined.length - n))) {
        keep = n;
        break;
      }
    }
    this.held = joined.slice(joined.length - keep);
    return joined.slice(0, joined.length - keep);
  }
  flush(): string {
    const rest = this.held;
    this.held = "";
    return rest;
  }
}

/** What a front end draws as a turn's answer streams: the reducer's output, rendered by each in its own way. */
type AnswerAction =
  | { kind: "thinking_start" }
  | { kind: "thinking"; text: string }
  /** Reasoning ended: `announced` when the model said so, otherwise the answer simply began. */
  | { kind: "thinking_end"; announced: boolean }
  /** More of the answer: `text` is new, `whole` all of it so far (control characters shown, the marker left out). */
  | { kind: "text"; text: string; whole: string }
  /** The answer is final: `text` is what was still held back. */
  | { kind: "done"; text: string; whole: string }
  /** The attempt failed and its answer is thrown away (a retry follows). */
  | { kind: "discarded" };

/**
 * The streamed answer as one state machine for every front end: reasoning
 * banners, the completion marker kept from view even split across chunks,
 * the answer so far, and an attempt's answer thrown away on a retry. A
 * front end feeds it events and draws the actions it returns.
 */
class AnswerStream {
  private marker = new MarkerFilter();
  private thinking = false;
  private whole = "";

  constructor(private readonly showThinking: boolean) {}

  reduce(e: AgentEvent): AnswerAction[] {
    switch (e.type) {
      case "reasoning_delta": {
        if (!this.showThinking) return [];
        const start: AnswerAction[] = this.thinking ? [] : [{ kind: "thinking_start" }];
        this.thinking = true;
        return [...start, { kind: "thinking", text: visibleControls(e.text) }];
      }
      case "thinking_complete":
        this.thinking = false;
        return this.showThinking ? [{ kind: "thinking_end", announced: true }] : [];
      case "assistant_delta": {
        const ended: AnswerAction[] = this.thinking ? [{ kind: "thinking_end", announced: false }] : [];
        this.thinking = false;
        const text = visibleControls(this.marker.push(e.text));
        this.whole += text;
        return [...ended, { kind: "text", text, whole: this.whole }];
      }
      case "assistant": {
        const text = visibleControls(this.marker.flush());
        const done: AnswerAction = { kind: "done", text, whole: this.whole + text };
        this.reset();
        return [done];
      }
      case "discarded":
        this.reset();
        return [{ kind: "discarded" }];
      case "command_output":
      case "command_waiting":
      case "context":
      case "reasoning":
      case "step":
      case "summary_delta":
      case "usage":
        return [];
      default:
        // The events every front end words are no part of the answer.
        e satisfies WordedEvent;
        return [];
    }
  }

  private reset(): void {
    this.marker = new MarkerFilter();
    this.thinking = false;
    this.whole = "";
  }
}

/** How a line should look; each sink maps a tone to its colours (or to none). */
type Tone = "dim" | "info" | "warning" | "error" | "command" | "ok" | "bad" | "summary";
/** Where a line belongs: the agent's own account (stderr without the TUI) or the commands' console (stdout). */
type Pane = "agent" | "console";
interface EventLine {
  pane: Pane;
  tone: Tone;
  text: string;
}

/** A wait as words that never break inside a number when wrapped: "500 ms", "8 s". */
function waitText(ms: number): string {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${Math.round(ms / 1000)} s`;
}

/** Token figures, marked `~` when aic counted them itself because the server reported none. */
function usageText(u: Usage): string {
  const about = u.estimated ? "~" : "";
  return `${about}${u.input_tokens} in / ${about}${u.output_tokens} out / ${u.cached_tokens} cached tokens${u.estimated ? " (~ counted by aic: the server reported no usage)" : ""}`;
}

/** How a command ended (or that it waits, handed to the model), and what it changed: the Console's lines. */
function commandResultLines(e: Extract<AgentEvent, { type: "command_result" }>): { tone: Tone; text: string }[] {
  const still = RESULT_STATUSES[e.status].stillRuns;
  if (still && e.exit_code === null) return [{ tone: "info", text: `[${still}: handed to the model]` }];
  const status = e.status.replace(/_/g, " ");
  const note =
    e.status === "exited"
      ? `exit code ${e.exit_code}`
      : e.status === "not_started"
        ? `not started: ${e.output.split("\n")[0]}`
        : e.status === "runaway"
          ? e.exit_code === 0
            ? `exit code 0; it printed more than ${RUNAWAY_FACTOR} × --max-output-bytes, the runaway limit, and the rest is not kept`
            : `stopped: it printed more than ${RUNAWAY_FACTOR} × --max-output-bytes, the runaway limit (exit code ${e.exit_code ?? "unknown"})`
          : e.exit_code === null
            ? status
            : `${status} (exit code ${e.exit_code})`;
  const files = e.changed_files ? changedFilesNote(e.changed_files) : "";
  return [
    { tone: e.exit_code === 0 ? "ok" : "bad", text: `[${note}]` },
    ...(files ? [{ tone: "dim" as Tone, text: files }] : []),
  ];
}

/** The Console's line for an approval: none where the command simply runs, or where the person's own answer is all. */
function approvalLines(e: Extract<AgentEvent, { type: "approval" }>): { tone: Tone; text: string }[] {
  switch (e.decision) {
    case "rejected":
      return [{ tone: "bad", text: "(command rejected)" }];
    case "suggestion":
      return [{ tone: "bad", text: `(command rejected with a suggestion: ${e.suggestion})` }];
    case "denied":
      return [
        {
          tone: "bad",
          text: e.rule ? `(refused by the rule: ${e.rule})` : "(refused: aic cannot see what it would run)",
        },
      ];
    case "allowed":
      return [{ tone: "dim", text: `(runs without asking: ${e.rule})` }];
    case "read_only":
      return [{ tone: "dim", text: "(read-only: runs without asking)" }];
    case "approved":
    case "auto":
    case "no_input":
      return [];
    default:
      return unreachable(e.decision);
  }
}

/** How the run ended, and what it left running (--keep-jobs). */
function endLines(e: Extract<AgentEvent, { type: "end" }>): { tone: Tone; text: string }[] {
  const verified = e.verified ? " · verified by --done-when" : "";
  const refused = e.refused ? ` · ${e.refused} command(s) refused for want of a person` : "";
  const kept = (e.kept ?? []).map((j) => `[kept running: pid ${j.pid}, ${j.command}; log ${j.log}]`);
  const others = e.kept_others ? [`[kept running: ${e.kept_others} other process(es) the commands started]`] : [];
  return [
    {
      tone: e.exit_code === 0 ? "ok" : "warning",
      text: `[${e.status}] ${e.steps} step(s) · ${usageText(e.usage)}${verified}${refused}`,
    },
    ...[...kept, ...others].map((text) => ({ tone: "dim" as Tone, text })),
  ];
}

/**
 * The words a person reads for each event that is not a stream of text
 * (deltas are streamed by each sink as they come). The plain output and the
 * TUI print exactly these lines, so the two never drift apart. Every text
 * from outside aic has its control characters made visible here.
 */
function describeEvent(e: WordedEvent): EventLine[] {
  const agent = (tone: Tone, text: string): EventLine[] => [{ pane: "agent", tone, text: visibleControls(text) }];
  const console = (tone: Tone, text: string): EventLine[] => [{ pane: "console", tone, text: visibleControls(text) }];
  switch (e.type) {
    case "start":
      return [
        ...agent("dim", `aic ${VERSION} · model ${e.model} · ${e.api_base} · ${e.cwd}`),
        ...agent(e.sandbox.enabled ? "ok" : "error", `Sandbox: ${e.sandbox.status}`),
        ...(e.budget.window === null
          ? []
          : agent(
              "dim",
              `Context: the server runs the model with ${e.budget.window} tokens (${e.budget.endpoint}): prompts up to ${e.budget.prompt_tokens}, answers up to ${e.budget.max_tokens}`,
            )),
      ];
    case "info":
      return agent("dim", e.text);
    case "warning":
      return agent("warning", `warning: ${e.text}`);
    case "error":
      return agent("error", `error: ${e.message}`);
    case "retry":
      return agent("warning", `model request failed (${e.reason}); retry ${e.attempt} in ${waitText(e.wait_ms)}`);
    case "model_wait": {
      const p = e.prompt_progress;
      const read = p && p.total ? `; read ${p.processed} of ${p.total} prompt tokens` : "";
      return agent("dim", `waiting for the model (prefill) ${waitText(e.elapsed_ms)}${read}`);
    }
    case "discarded":
      return agent("warning", `the model's attempt failed (${e.reason}); its partial answer was discarded`);
    case "command":
      return console("command", `$ ${e.command}`);
    case "input":
      return console("command", `⌨ ${e.into} ← ${inputShown(e.input)}`);
    case "approval":
      return approvalLines(e).flatMap((l) => console(l.tone, l.text));
    case "command_result":
      return commandResultLines(e).flatMap((l) => console(l.tone, l.text));
    case "compression":
      return agent(
        "summary",
        `[COMPRESSION] ${e.algorithm}: ${e.before_tokens} → ${e.after_tokens} tokens; ${e.detail}`,
      );
    case "job_started":
      return console("info", `[job ${e.id} started: pid ${e.pid}, ${e.command}; its terminal is logged to ${e.log}]`);
    case "job_ended": {
      const code = e.exit_code === null ? "exit code unknown" : `exit code ${e.exit_code}`;
      const how = JOB_ENDINGS[e.how];
      return console("dim", `[job ${e.id} ${how}: pid ${e.pid}, ${code}]`);
    }
    case "verify": {
      const code = e.exit_code === null ? e.status.replace(/_/g, " ") : `exit code ${e.exit_code}`;
      return [
        ...console("command", `$ ${e.command}   (completion check)`),
        ...(e.output.trim() ? console("dim", e.output.trimEnd()) : []),
        ...console(
          e.passed ? "ok" : "bad",
          e.passed ? `[completion verified: ${code}]` : `[completion refused: ${code}]`,
        ),
      ];
    }
    case "end":
      return endLines(e).flatMap((l) => agent(l.tone, l.text));
    default:
      return unreachable(e);
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Plain and JSON output
// Owns: the --nogui sinks: text for people and logs (content and command
// output on stdout, diagnostics on stderr) and JSON Lines for machines.
// ════════════════════════════════════════════════════════════════════════════

const useColor = (stream: NodeJS.WriteStream) => Boolean(stream.isTTY) && !process.env.NO_COLOR;
const paint = (on: boolean, code: string, text: string) => (on ? `\x1b[${code}m${text}\x1b[0m` : text);

/** An escape sequence that may still be incomplete at the end of a chunk. */
const TRAILING_ESCAPE = /\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*|[ -/]+|\x1b?)?$/;

/**
 * `text` split where an escape sequence may still be incomplete: the rest is
 * held for the next chunk (at most 256 characters: beyond that it was never a
 * sequence). Every front end that shows a command's output holds it so.
 */
function holdTrailingEscape(text: string): { ready: string; held: string } {
  const cut = text.search(TRAILING_ESCAPE);
  return cut >= 0 && text.length - cut <= 256
    ? { ready: text.slice(0, cut), held: text.slice(cut) }
    : { ready: text, held: "" };
}

/**
 * A command's output bound for a log or a pipe rather than a terminal:
 * escape sequences and control characters removed, CR LF and lone CR as LF.
 * A sequence or a CR LF split across two chunks is held until the next one.
 */
class LogText {
  private decoder = new TextDecoder();
  private held = "";

  push(bytes: Uint8Array): string {
    let { ready, held } = holdTrailingEscape(this.held + this.decoder.decode(bytes, { stream: true }));
    // A CR may be the first half of a CR LF.
    if (!held && ready.endsWith("\r")) [ready, held] = [ready.slice(0, -1), "\r"];
    this.held = held;
    return Bun.stripANSI(ready).replace(/\r\n?/g, "\n").replace(CONTROL_CHARACTERS, "");
  }

  /** The rest, at the end of a command. */
  end(): string {
    const rest = this.held + this.decoder.decode();
    this.held = "";
    this.decoder = new TextDecoder();
    return Bun.stripANSI(rest).replace(/\r\n?/g, "\n").replace(CONTROL_CHARACTERS, "");
  }
}

const pause = new Int32Array(new SharedArrayBuffer(4));

/**
 * Writes everything, in order. A non-blocking pipe whose reader is slow
 * answers EAGAIN or takes part of the data: wait a moment and write the rest
 * (CI logs must not lose output). A closed pipe (aic … | head) is not an error.
 */
function writeOut(fd: 1 | 2, text: string | Uint8Array): void {
  let rest = typeof text === "string" ? Buffer.from(text) : text;
  while (rest.length) {
    try {
      rest = rest.subarray(fs.writeSync(fd, rest));
    } catch (error) {
      const code = (error as NodeJS.ErrnoException).code;
      // A reader gone (EPIPE) or a terminal hung up (EIO): nobody is left to read it, and exiting must not fail.
      if (code === "EPIPE" || code === "EIO") return;
      if (code !== "EAGAIN") throw error;
      Atomics.wait(pause, 0, 0, 2);
    }
  }
}

/** ANSI colours of each tone in plain text output. */
const ANSI_TONES: Record<Tone, string> = {
  dim: "2",
  info: "2",
  warning: "33",
  error: "31",
  command: "36",
  ok: "32",
  bad: "33",
  summary: "35",
};

/**
 * Text output for people and logs: content and command output on stdout,
 * diagnostics on stderr. Everything but a command's own output has its
 * control characters made visible; a command's output passes through as the
 * person would see it on a terminal, and is cleaned for a log or a pipe.
 */
class PlainSink implements EventSink {
  private readonly out = useColor(process.stdout);
  private readonly outIsTerminal = Boolean(process.stdout.isTTY);
  private readonly log = new LogText();
  private readonly err = useColor(process.stderr);
  private readonly stream: AnswerStream;
  private midLine = false;
  /**
   * Off a terminal, the answer of an attempt waits here until the attempt is
   * known good: an answer a retry discards never reaches a log unmarked.
   */
  private answer: string[] = [];
  constructor(showThinking: boolean) {
    this.stream = new AnswerStream(showThinking);
  }

  private stdout(text: string) {
    if (!text) return;
    writeOut(1, text);
    this.midLine = !text.endsWith("\n");
  }
  private stderr(text: string) {
    if (this.midLine) {
      writeOut(1, "\n");
      this.midLine = false;
    }
    writeOut(2, text.endsWith("\n") ? text : text + "\n");
  }
  private line({ pane, tone, text }: EventLine) {
    if (pane === "agent") return this.stderr(paint(this.err, ANSI_TONES[tone], text));
    if (this.midLine) this.stdout("\n");
    this.stdout(paint(this.out, ANSI_TONES[tone], text) + "\n");
  }

  /** Reasoning on stderr; the answer on stdout, live on a terminal, held until it is final otherwise. */
  private draw(a: AnswerAction): void {
    const dim = (text: string) => paint(this.err, ANSI_TONES.dim, text);
    switch (a.kind) {
      case "thinking_start":
        return this.stderr(dim("[THINKING]"));
      case "thinking":
        return writeOut(2, dim(a.text));
      case "thinking_end":
        return a.announced ? this.stderr(dim("\n[THINKING COMPLETE]")) : undefined;
      case "text":
        if (this.outIsTerminal) this.stdout(a.text);
        else this.answer.push(a.text);
        return;
      case "done":
        this.stdout(this.answer.splice(0).join("") + a.text);
        if (this.midLine) this.stdout("\n");
        return;
      case "discarded":
        this.answer = [];
        if (this.outIsTerminal && this.midLine)
          this.stdout(`\n${paint(this.out, ANSI_TONES.warning, "[the answer above was discarded; asking again]")}\n`);
    }
  }

  emit(e: AgentEvent): void {
    for (const action of this.stream.reduce(e)) this.draw(action);
    switch (e.type) {
      case "reasoning_delta":
      case "thinking_complete":
      case "assistant_delta":
      case "assistant":
        return;
      case "command_output": {
        const text = this.outIsTerminal ? e.data : this.log.push(e.data);
        if (!text.length) return;
        writeOut(1, text);
        this.midLine = typeof text === "string" ? !text.endsWith("\n") : text[text.length - 1] !== 0x0a;
        return;
      }
      case "command_result":
        if (!this.outIsTerminal) this.stdout(this.log.end());
        break;
      case "summary_delta":
        writeOut(2, paint(this.err, ANSI_TONES.dim, visibleControls(e.text)));
        return;
      // Figures for the TUI's footer, the reasoning already streamed (or hidden), a command waiting for keys.
      case "command_waiting":
      case "context":
      case "reasoning":
      case "step":
      case "usage":
        return;
    }
    for (const line of describeEvent(e)) this.line(line);
  }
}

/**
 * One JSON Lines record. JSON.stringify leaves U+0085, U+2028 and U+2029 as
 * they are (valid JSON), but line readers such as Python's splitlines() and
 * some JavaScript tools break lines there: they are escaped, so a command's
 * output can never split a record in two.
 */
function jsonLine(record: unknown): string {
  return `${JSON.stringify(record).replace(/[\u0085\u2028\u2029]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, "0")}`)}\n`;
}

/** JSON Lines for machines: one object per line, each with `type` and `ts`; deltas are folded into whole turns. */
class JsonSink implements EventSink {
  /**
   * Whether an event is a record of its own: a delta is not (the whole turn
   * follows), nor a command's output (its command_result holds it), nor the
   * context figures (each usage record has them).
   */
  private static readonly RECORDS: Record<AgentEventType, boolean> = {
    start: true,
    info: true,
    warning: true,
    step: true,
    assistant_delta: false,
    reasoning_delta: false,
    thinking_complete: false,
    assistant: true,
    reasoning: true,
    retry: true,
    model_wait: true,
    discarded: true,
    context: false,
    command: true,
    input: true,
    approval: true,
    command_output: false,
    command_waiting: true,
    command_result: true,
    compression: true,
    summary_delta: false,
    usage: true,
    job_started: true,
    job_ended: true,
    verify: true,
    error: true,
    end: true,
  };
  emit(e: AgentEvent): void {
    if (!JsonSink.RECORDS[e.type]) return;
    const record = Object.assign({ type: e.type, ts: new Date().toISOString() }, e);
    writeOut(1, jsonLine(record));
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Messages and token accounting
// Owns: the OpenAI message shape as the agent holds it, and the token
// estimate that decides when to compress. Counting uses tiktoken (o200k_base),
// cached per message so a step only pays for its new messages, and scaled by a
// ratio learnt from the server's own prompt_tokens so the trigger follows the
// model's real tokenizer.
// ════════════════════════════════════════════════════════════════════════════

interface ToolCall {
  id: string;
  type: "function";
  function: { name: string; arguments: string };
}

/** A chat message exactly as stored: loose on purpose, since sessions are hand-edited and unknown keys are kept. */
interface Message {
  role: string;
  content?: unknown;
  tool_calls?: ToolCall[];
  tool_call_id?: string;
  /** aic's own record, never sent: when the message was made (ISO 8601), for trajectories. */
  aic_at?: string;
  /** aic's own record, never sent: the token figures of the call that produced an assistant message. */
  aic_usage?: { prompt_tokens: number; completion_tokens: number; cached_tokens: number };
  [key: string]: unknown;
}

/** Where providers stream a model's reasoning, and where each wants it back (DeepSeek, GLM, Kimi: reasoning_content). */
const REASONING_FIELDS = ["reasoning_content", "reasoning", "thinking"] as const;
type ReasoningField = (typeof REASONING_FIELDS)[number];

/** A message stamped with the time it was made (aic's own field, which is never sent). */
function stamped<M extends Message>(m: M): M {
  m.aic_at = new Date().toISOString();
  return m;
}

const PER_MESSAGE_OVERHEAD = 4;

function contentText(content: unknown): string {
  if (typeof content === "string") return content;
  if (content === null || content === undefined) return "";
  return JSON.stringify(content);
}

interface Encoder {
  count(text: string): number;
}

/**
 * BPE costs grow with the square of a word's length (a 100 KB run without
 * spaces took 11 s, and 1 MB aborted inside tiktoken's WASM): a run of
 * non-space characters longer than this is counted in slices of it. Ordinary
 * text has no such runs and is counted exactly.
 */
const LONGEST_WORD = 256;

const LONG_RUN = new RegExp(`\\S{${LONGEST_WORD + 1},}`);

function countBounded(text: string, count: (piece: string) => number): number {
  if (!LONG_RUN.test(text)) return count(text);
  let total = 0;
  let at = 0;
  for (const run of text.matchAll(new RegExp(LONG_RUN.source, "g"))) {
    if (run.index > at) total += count(text.slice(at, run.index));
    for (let i = 0; i < run[0].length; i += LONGEST_WORD) total += count(run[0].slice(i, i + LONGEST_WORD));
    at = run.index + run[0].length;
  }
  if (at < text.length) total += count(text.slice(at));
  return total;
}

// Embedded in the compiled binary: tiktoken's default entry would read the
// WASM from the build machine's node_modules at run time.
import tiktokenWasmPath from "tiktoken/lite/tiktoken_bg.wasm" with { type: "file" };

import o200kPath from "tiktoken/encoders/o200k_base.json" with { type: "file" };
let encoderPromise: Promise<Encoder> | undefined;

/** Loads tiktoken on first use only: `--version`, `--help` and usage errors never pay for it. */
function loadEncoder(): Promise<Encoder> {
  encoderPromise ??= (async () => {
    const { init, Tiktoken } = await import("tiktoken/lite/init");
    // `with { type: "file" }` imports are paths at run time, whatever the type declarations say.
    const wasm = await Bun.file(tiktokenWasmPath as unknown as string).arrayBuffer();
    await init((imports) => WebAssembly.instantiate(wasm, imports));
    const model = (await Bun.file(o200kPath as unknown as string).json()) as {
      bpe_ranks: string;
      special_tokens: Record<string, number>;
      pat_str: string;
    };
    const tiktoken = new Tiktoken(model.bpe_ranks, model.special_tokens, model.pat_str);
    return { count: (text: string) => countBounded(text, (piece) => tiktoken.encode(piece, "all").length) };
  })();
  return encoderPromise;
}

/**
 * A quick guess of the tokens (about four bytes a token for English and
 * code), for figures shown and judged before tiktoken is needed: loading it
 * costs ~55 MB and a few hundred ms, and no decision far from the budget
 * needs an exact count.
 */
function roughTokenEstimate(messages: readonly Message[]): number {
  let total = 0;
  for (const m of messages) total += PER_MESSAGE_OVERHEAD + Math.ceil(countedBytes(m) / 4);
  return total;
}

/** Never fewer than the real count: a byte-level BPE token covers at least one byte. */
function tokenUpperBound(messages: readonly Message[]): number {
  let total = 0;
  for (const m of messages) total += PER_MESSAGE_OVERHEAD + countedBytes(m);
  return total;
}

/** The UTF-8 size of what counts as tokens in a message. */
function countedBytes(m: Message): number {
  return countedTexts(m).reduce((n, t) => n + Buffer.byteLength(t), 0);
}

/** The texts of a message that count as tokens: its content, and each tool call's name and arguments. */
function countedTexts(m: Message): string[] {
  const texts = [contentText(m.content)];
  for (const call of Array.isArray(m.tool_calls) ? m.tool_calls : [])
    texts.push(call.function?.name ?? "", call.function?.arguments ?? "");
  return texts;
}

class TokenCounter {
  /** Real tokens per estimated token, learnt from the server's prompt_tokens. */
  ratio = 1;
  private readonly cache = new WeakMap<Message, { content: unknown; calls: unknown; tokens: number }>();
  constructor(private readonly encoder: Encoder) {}

  static async create(): Promise<TokenCounter> {
    return new TokenCounter(await loadEncoder());
  }

  tokensOf(text: string): number {
    return text ? this.encoder.count(text) : 0;
  }

  /** Raw tiktoken count of one message; cached until its content or calls change. */
  countMessage(m: Message): number {
    const hit = this.cached(m);
    if (hit !== undefined) return hit;
    return this.remember(m, PER_MESSAGE_OVERHEAD + countedTexts(m).reduce((n, t) => n + this.tokensOf(t), 0));
  }

  private cached(m: Message): number | undefined {
    const hit = this.cache.get(m);
    return hit && hit.content === m.content && hit.calls === m.tool_calls ? hit.tokens : undefined;
  }

  private remember(m: Message, tokens: number): number {
    this.cache.set(m, { content: m.content, calls: m.tool_calls, tokens });
    return tokens;
  }

  /**
   * Like countRaw, but a long text not counted yet is encoded in slices with
   * the event loop free in between, so a huge tool result never freezes the UI.
   */
  async countRawYielding(messages: readonly Message[]): Promise<number> {
    let total = 0;
    for (const m of messages) total += this.needsSlices(m) ? await this.countInSlices(m) : this.countMessage(m);
    return total;
  }

  /**
   * Counts from the newest message back, as countRawYielding does, until the
   * count passes `limit`. `from` is the oldest message counted: 0 when all
   * were (`raw` is then the exact count); otherwise `raw` is already over
   * `limit` and the older messages were never encoded, which for a long
   * session resumed far over the budget saves seconds of tiktoken.
   */
  async countRawNewest(messages: readonly Message[], limit: number): Promise<{ raw: number; from: number }> {
    let raw = 0;
    let from = messages.length;
    while (from > 0 && raw <= limit) {
      const m = messages[--from]!;
      raw += this.needsSlices(m) ? await this.countInSlices(m) : this.countMessage(m);
    }
    return { raw, from };
  }

  private needsSlices(m: Message): boolean {
    return this.cached(m) === undefined && contentText(m.content).length > TokenCounter.SLICE;
  }

  private async countInSlices(m: Message): Promise<number> {
    let tokens = PER_MESSAGE_OVERHEAD;
    for (const text of countedTexts(m))
      for (let at = 0; at < text.length; at += TokenCounter.SLICE) {
        tokens += this.tokensOf(text.slice(at, at + TokenCounter.SLICE));
        await new Promise((resolve) => setImmediate(resolve));
      }
    return this.remember(m, tokens);
  }
  private static readonly SLICE = 16_384;

  countRaw(messages: readonly Message[]): number {
    let total = 0;
    for (const m of messages) total += this.countMessage(m);
    return total;
  }

  /** The estimate in the server's units: what the status bar shows and the budget is compared against. */
  estimate(messages: readonly Message[]): number {
    return Math.ceil(this.countRaw(messages) * this.ratio);
  }

  /** Learns the ratio from a finished call; clamped so one odd answer cannot wreck the trigger. */
  calibrate(rawSent: number, promptTokens: number): void {
    if (rawSent <= 0 || !(promptTokens > 0)) return;
    this.ratio = Math.min(4, Math.max(0.25, promptTokens / rawSent));
  }
}

/** The same copy every step, so per-message token counts (cached by object) stay cached. */
const outgoingCopies = new WeakMap<Message, { copy: Message; reasoning: boolean; toolCalls: unknown }>();

/**
 * A message as it is sent: null content as "", aic's own fields left out,
 * and the reasoning left out unless `reasoning` (the turn since the last user
 * message, where thinking models with tools need it back).
 */
function outgoingCopy(m: Message, reasoning: boolean): Message {
  const drop = (key: string) =>
    key.startsWith("aic_") || (!reasoning && (REASONING_FIELDS as readonly string[]).includes(key));
  const keys = Object.keys(m);
  if (m.content !== null && m.content !== undefined && !keys.some(drop)) return m;
  const hit = outgoingCopies.get(m);
  if (hit && hit.reasoning === reasoning && hit.toolCalls === m.tool_calls) return hit.copy;
  const copy: Message = { role: m.role };
  for (const key of keys) if (!drop(key)) copy[key] = m[key];
  if (copy.content === null || copy.content === undefined) copy.content = "";
  outgoingCopies.set(m, { copy, reasoning, toolCalls: m.tool_calls });
  return copy;
}

/**
 * The copy of the history that is sent: null content becomes "", unknown roles
 * and tool messages without an id are dropped, of two assistant messages in a
 * row the older goes. A history that ends in a plain assistant message needs
 * no call at all (`terminal`).
 */
function validateOutgoing(messages: readonly Message[]): { messages: Message[]; terminal: boolean } {
  const out: Message[] = [];
  let lastUser = -1;
  for (let i = messages.length - 1; i >= 0 && lastUser < 0; i--) if (messages[i]!.role === "user") lastUser = i;
  for (const [i, m] of messages.entries()) {
    if (!VALID_ROLES.has(m.role)) continue;
    if (m.role === "tool" && typeof m.tool_call_id !== "string") continue;
    if (m.role === "assistant" && out[out.length - 1]?.role === "assistant") out.pop();
    out.push(outgoingCopy(m, i > lastUser));
  }
  const last = out[out.length - 1];
  return { messages: out, terminal: last?.role === "assistant" && !last.tool_calls?.length };
}

/** Every tool call id gets exactly one answer, also when the run stops halfway through a turn. */
function answerOpenCalls(messages: Message[], content: string): void {
  let i = messages.length - 1;
  const answered = new Set<string>();
  while (i >= 0 && messages[i]!.role === "tool") answered.add(messages[i--]!.tool_call_id ?? "");
  const call = messages[i];
  if (call?.role !== "assistant" || !call.tool_calls) return;
  for (const c of call.tool_calls)
    if (!answered.has(c.id)) messages.push({ role: "tool", tool_call_id: c.id, content });
}

/**
 * A request whose run failed before the model answered it leaves the history
 * (the person still has it, in the prompt history or the command line):
 * otherwise failed attempts would pile up as unanswered requests that a
 * model later takes as still pending. True when it was taken out.
 */
function withdrawUnanswered(messages: Message[], request: Message): boolean {
  const at = messages.indexOf(request);
  if (at < 0 || messages.slice(at).some((m) => m.role === "assistant")) return false;
  messages.splice(at);
  return true;
}

/** One call's token figures, as the server reports them or aic counts them. */
type CallUsage = { prompt_tokens: number; completion_tokens: number; cached_tokens: number };

/** A server that reports no usage still gets counted: tiktoken over what was sent and what came back. */
async function countTurnUsage(
  counter: TokenCounter,
  sent: readonly Message[],
  turn: { content: string; reasoning: string; toolCalls: ToolCall[] },
): Promise<CallUsage> {
  const prompt = Math.ceil((await counter.countRawYielding(sent)) * counter.ratio);
  let completion = counter.tokensOf(turn.content) + counter.tokensOf(turn.reasoning);
  for (const call of turn.toolCalls)
    completion += counter.tokensOf(call.function.name) + counter.tokensOf(call.function.arguments);
  return { prompt_tokens: prompt, completion_tokens: completion, cached_tokens: 0 };
}

// ════════════════════════════════════════════════════════════════════════════
// Model failures
// Owns: what a failed model call means — give up naming what to fix, compress
// harder, or wait and retry — from the HTTP status and the error's own fields,
// whatever shape the server sends.
// ════════════════════════════════════════════════════════════════════════════

type FailureKind = "fatal" | "context" | "retry" | "unreachable";

class ModelError extends Error {
  constructor(
    message: string,
    readonly kind: FailureKind,
    readonly retryAfterMs?: number,
  ) {
    super(message);
  }
}

class StoppedError extends Error {
  constructor() {
    super("stopped");
  }
}

/**
 * Context overflow as OpenAI-compatible servers word it: each phrase is taken
 * from a server's own source or documentation (OpenAI, Azure, vLLM, llama.cpp,
 * Ollama, LM Studio, TGI, SGLang, LiteLLM, OpenRouter, Mistral, Groq,
 * DeepSeek, Together, Anthropic's and Gemini's compatible layers, xAI,
 * Cerebras, Kimi); tests/context-overflow-fixtures.ts keeps one reply per
 * shape with its source.
 */
const CONTEXT_OVERFLOW = new RegExp(
  [
    "context[_ ]length[_ ]exceeded",
    "maximum context length",
    "exceeds? the available context size",
    "exceed_context_size_error",
    "context size has been exceeded",
    "longer than the (model'?s )?context length",
    "greater than the context length",
    "when context the overflows",
    "context length of only",
    "does not fit in (the )?context length",
    "exceeded max context length",
    "prompt is too long",
    "exceeds? (the )?context limit",
    "exceeds the maximum number of tokens allowed",
    "maximum prompt length is",
    "exceeds the maximum allowed length",
    "requested token count exceeds",
    "input tokens exceed the configured limit",
    "`?inputs`? tokens \\+ `?max_new_tokens`? must be <=",
    "`?inputs`? must have less than \\d+ tokens",
    "reduce the length of the messages",
    "exceeded model token limit",
    "exceeded max_prompt_tokens",
    "context length is only \\d+",
    "too large for model with \\d+ maximum context length",
    "too many tokens",
    "input is too long",
  ].join("|"),
  "i",
);

/** Wordings that look like an overflow but are about the requested output or a rate: compressing cannot fix them. */
const NOT_CONTEXT_OVERFLOW =
  /max_tokens is too large: \d+\. This model supports at most|cannot be greater than max_model_len|`?max_completion_tokens`? must be less than or equal|rate_limit_exceeded|tokens per min|upper bound for 0 input tokens/i;

/** An exhausted quota or billing problem: waiting does not help, the account needs attention. */
const QUOTA_EXHAUSTED =
  /insufficient[_ ]quota|exceeded your current quota|billing|credit balance|out of credits|requires more credits|payment required/i;

const AUTH_CODES = [
  "invalid_api_key",
  "authentication_error",
  "permission_denied",
  "permission_error",
  "unauthenticated",
  "unauthorized",
  "invalid_authentication",
];
const MODEL_CODES = ["model_not_found", "not_found", "not_found_error"];
const QUOTA_CODES = ["insufficient_quota", "billing_hard_limit_reached", "billing_not_active"];
const OVERFLOW_CODES = ["context_length_exceeded", "exceed_context_size_error"];
const RATE_CODES = ["rate_limit_exceeded", "rate_limit_error", "resource_exhausted"];

const UNREACHABLE_CODES: Record<string, string> = {
  ECONNREFUSED: "connection refused: nothing is listening there",
  ConnectionRefused: "connection refused: nothing is listening there",
  ENOTFOUND: "the host name does not resolve",
  EAI_AGAIN: "the host name cannot be resolved right now",
  EHOSTUNREACH: "the host is unreachable",
  ENETUNREACH: "the network is unreachable",
  FailedToOpenSocket: "cannot open a connection",
};

/** Reads `Retry-After` (seconds or an HTTP date) or `retry-after-ms` from whatever header shape the SDK hands over. */
/**
 * How long the server asks aic to wait, from wherever it says so: the
 * `Retry-After` / `retry-after-ms` headers, a `google.rpc.RetryInfo` detail
 * (`retryDelay: "1.2s"`), or words such as "try again in 11.5s" / "retry in
 * 1.2s". Undefined when it gives no hint.
 */
function retryHintMs(headers: unknown, body: unknown, text: string): number | undefined {
  const header = retryAfterMs(headers);
  if (header !== undefined) return header;
  let delay: string | undefined;
  const visit = (value: unknown, depth: number): void => {
    if (delay !== undefined || value === null || typeof value !== "object" || depth > 6) return;
    if (Array.isArray(value)) return value.slice(0, 8).forEach((v) => visit(v, depth + 1));
    const o = value as Record<string, unknown>;
    if (typeof o.retryDelay === "string") delay = o.retryDelay;
    for (const v of Object.values(o)) visit(v, depth + 1);
  };
  visit(body, 0);
  const m = /^(\d+(?:\.\d+)?)s$/.exec(delay ?? "") ?? /\b(?:try again|retry) in (\d+(?:\.\d+)?)\s*(ms|s)\b/i.exec(text);
  if (!m) return undefined;
  return Math.ceil(Number(m[1]) * (m[2] === "ms" ? 1 : 1000));
}

function retryAfterMs(headers: unknown): number | undefined {
  const get = (name: string): string | null | undefined => {
    if (!headers) return undefined;
    if (typeof (headers as Headers).get === "function") return (headers as Headers).get(name);
    return (headers as Record<string, string>)[name];
  };
  const ms = Number(get("retry-after-ms"));
  if (Number.isFinite(ms) && ms > 0) return ms;
  const raw = get("retry-after");
  if (!raw) return undefined;
  const seconds = Number(raw);
  if (Number.isFinite(seconds)) return Math.max(0, seconds * 1000);
  const date = Date.parse(raw);
  return Number.isFinite(date) ? Math.max(0, date - Date.now()) : undefined;
}

/** Flattens an error body of any shape (error object or string, flat object, array, nested message, text) into one readable line. */
function errorBodyText(body: unknown, depth = 0): string {
  if (body === undefined || body === null || depth > 5) return "";
  if (typeof body === "string") return body;
  if (typeof body !== "object") return String(body);
  if (Array.isArray(body))
    return body
      .map((b) => errorBodyText(b, depth + 1))
      .filter(Boolean)
      .join("; ");
  const o = body as Record<string, unknown>;
  if (o.error !== undefined && o.error !== null) return errorBodyText(o.error, depth + 1);
  const parts = ["message", "detail", "msg", "type", "code"]
    .map((k) => (typeof o[k] === "object" ? errorBodyText(o[k], depth + 1) : o[k]))
    .filter((v) => typeof v === "string" && v);
  return parts.length ? (parts as string[]).join(" — ") : JSON.stringify(o);
}

/** What an error body says about itself: its text, an HTTP-like status, its code/type names, and llama.cpp's overflow fields. */
interface ErrorFields {
  text: string;
  status: number | undefined;
  codes: string[];
  overflowFields: boolean;
}

function errorFields(body: unknown): ErrorFields {
  const fields: ErrorFields = { text: errorBodyText(body), status: undefined, codes: [], overflowFields: false };
  const visit = (value: unknown, depth: number): void => {
    if (value === null || typeof value !== "object" || depth > 4) return;
    if (Array.isArray(value)) return value.slice(0, 4).forEach((v) => visit(v, depth + 1));
    const o = value as Record<string, unknown>;
    for (const key of ["code", "status", "http_status_code", "status_code", "type", "error_type"]) {
      const v = o[key];
      if (typeof v === "number" && v >= 100 && v < 600) fields.status ??= v;
      else if (typeof v === "string" && /^\d{3}$/.test(v)) fields.status ??= Number(v);
      else if (typeof v === "string") fields.codes.push(v.toLowerCase());
    }
    if ("n_prompt_tokens" in o && "n_ctx" in o) fields.overflowFields = true;
    visit(o.error, depth + 1);
  };
  visit(body, 0);
  return fields;
}

/** A server that counts our requested output alone as too big for its window: no compression can help. */
function outputExceedsWindow(text: string): { output: number; window: number } | undefined {
  const window = Number(
    /maximum context length is (\d+)|context length (?:is|of) (?:only )?(\d+)/i.exec(text)?.slice(1).find(Boolean),
  );
  const output = Number(
    /is too large: (\d+)|requested (\d+) output tokens|max_tokens=(\d+)/i.exec(text)?.slice(1).find(Boolean),
  );
  return window > 0 && output >= window ? { output, window } : undefined;
}

/**
 * Decides what a failed model call means, from the HTTP status and the
 * error's own fields (an error inside a 200 stream carries its status as a
 * numeric code or status, and names such as `invalid_api_key`): give up
 * naming what to fix, compress harder, or wait and retry.
 */
function classifyModelFailure(
  httpStatus: number | undefined,
  body: unknown,
  headers?: unknown,
  /** An error object that arrived inside a stream the server had answered with HTTP 200. */
  inStream = false,
): ModelError {
  const f = errorFields(body);
  const status = httpStatus ?? f.status;
  const has = (names: string[]) => f.codes.some((c) => names.includes(c));
  const where = inStream ? " (inside the answer's stream)" : status === undefined ? "" : ` (HTTP ${status})`;
  const detail = redactSecrets(f.text.replace(/\s+/g, " ").trim()).slice(0, 300) || "no details";
  const fatal = (message: string) => new ModelError(message, "fatal");
  const hint = retryHintMs(headers, body, f.text);
  // A rate limit says when to come back, or names itself; whatever its message says about billing (Groq's
  // upgrade link, Gemini's "check your plan and billing"), waiting is the cure. A quota of zero never refills.
  const rateLimited = (hint !== undefined || has(RATE_CODES)) && !/\blimit: 0\b/.test(f.text);
  if (!rateLimited && (status === 402 || has(QUOTA_CODES) || QUOTA_EXHAUSTED.test(f.text)))
    return fatal(
      `the account behind this API key has no quota or credit left${where}: ${detail} — check the plan and billing of that account with the provider`,
    );
  const overflow =
    (f.overflowFields || has(OVERFLOW_CODES) || CONTEXT_OVERFLOW.test(f.text) || status === 413) &&
    !NOT_CONTEXT_OVERFLOW.test(f.text);
  if (overflow) {
    const tooBig = outputExceedsWindow(f.text);
    if (tooBig)
      return fatal(
        `the model's context window (${tooBig.window} tokens) cannot hold the answer aic asks for (max_tokens ${tooBig.output})${where}: ${detail} — serve the model with a larger context`,
      );
    if (status === undefined || status === 400 || status === 413 || status === 422 || status === 500)
      return new ModelError(`the prompt is too long for the model${where}: ${detail}`, "context");
  }
  if (status === 401 || status === 403 || has(AUTH_CODES))
    return fatal(
      `the endpoint refused the API key${where}: ${detail} — check --api-key (or AIC_API_KEY / OPENAI_API_KEY)${/header/i.test(f.text) ? " and --header" : ""}`,
    );
  if (status === 404 || has(MODEL_CODES))
    return fatal(
      `the endpoint does not know this model or path${where}: ${detail} — check --model (AIC_MODEL) and --api-base (AIC_API_BASE)`,
    );
  // One request bigger than the account's whole per-minute allowance never fits, however long aic waits.
  if (/request too large/i.test(f.text) && /per min/i.test(f.text))
    return fatal(
      `the request is bigger than the account's per-minute token limit${where}: ${detail} — lower --max-prompt-len or raise the account's rate limit`,
    );
  if (status === 429 || rateLimited) return new ModelError(`rate limited${where}: ${detail}`, "retry", hint);
  // A server that already answered 200 and then failed mid-stream (vLLM's parser tripping on a sampled token)
  // mostly succeeds on the next attempt: it is retried like a 5xx, since key, quota and model were judged above.
  if (inStream) return new ModelError(`the model's stream failed${where}: ${detail}`, "retry", hint);
  if (status !== undefined && status >= 400 && status < 500 && status !== 408 && status !== 409) {
    const hint = /header/i.test(f.text)
      ? "check --header (gateways such as Portkey route by header)"
      : "check --model, --api-base and --reasoning-effort";
    return fatal(`the endpoint rejected the request${where}: ${detail} — ${hint}`);
  }
  return new ModelError(status === undefined ? detail : `HTTP ${status}: ${detail}`, "retry", hint);
}

/** Narrows whatever the SDK or fetch threw into a ModelError, in aic's words (never Bun's internals). */
function modelErrorFrom(error: unknown, url: string, midStream: boolean): ModelError {
  if (error instanceof ModelError) return error;
  const e = error as {
    status?: unknown;
    error?: unknown;
    message?: unknown;
    headers?: unknown;
    cause?: { code?: unknown; message?: unknown };
    code?: unknown;
    name?: unknown;
  };
  const status = typeof e?.status === "number" ? e.status : undefined;
  // An HTTP error, or an error object inside the stream (the SDK throws it without a status: the response was a 200).
  if (status !== undefined || (e?.error !== undefined && e?.error !== null))
    return classifyModelFailure(status, e.error ?? e.message, e.headers, status === undefined);
  const code = String(e?.cause?.code ?? e?.code ?? "");
  if (UNREACHABLE_CODES[code])
    return new ModelError(
      `cannot reach ${url} (${UNREACHABLE_CODES[code]}) — check --api-base (AIC_API_BASE / OPENAI_BASE_URL)`,
      "unreachable",
    );
  const message = String(e?.message ?? error).replace(/\s*For more information, pass `verbose: true`.*$/s, "");
  if (code === "ECONNRESET" || /socket connection was closed|ECONNRESET/.test(message))
    return new ModelError(
      midStream
        ? `the connection to ${url} was dropped in the middle of the answer`
        : `the connection to ${url} was closed before any answer`,
      "retry",
    );
  if (e?.name === "APIConnectionTimeoutError") return new ModelError(`no answer from ${url} in time`, "retry");
  return classifyModelFailure(undefined, message);
}

// ════════════════════════════════════════════════════════════════════════════
// Model client
// Owns: the assistant turn a completion comes to, and the tool calls a model
// wrote into its text instead of calling them, rescued as calls. The next
// section streams the completion through the official openai SDK.
// ════════════════════════════════════════════════════════════════════════════

interface AssistantTurn {
  content: string;
  reasoning: string;
  /** The field the provider streamed the reasoning in, which is the field it wants it back in. */
  reasoningField?: ReasoningField;
  toolCalls: ToolCall[];
  /** Why the model stopped (`stop`, `tool_calls`, `length` when the output limit cut it), when the server said. */
  finishReason?: string;
  usage: { prompt_tokens: number; completion_tokens: number; cached_tokens: number } | undefined;
}

/** A sleep that ends early, with StoppedError, when the run is stopped. */
function abortableSleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal.aborted) return reject(new StoppedError());
    const timer = setTimeout(() => {
      signal.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    const onAbort = () => {
      clearTimeout(timer);
      reject(new StoppedError());
    };
    signal.addEventListener("abort", onAbort, { once: true });
  });
}

interface StreamCallbacks {
  onContent?(text: string): void;
  onReasoning?(text: string): void;
  onThinkingComplete?(): void;
}

/** A call the model wrote as text: the function's name and its arguments, as one format spells them. */
interface WrittenCall {
  name: unknown;
  args: unknown;
}

/**
 * The formats in which open models write tool calls when the server's
 * parser misses them (the reply then arrives as plain content): each matches
 * markup at the very end of the reply and reads the calls in it.
 */
const WRITTEN_CALL_FORMATS: { name: string; at: RegExp; read(markup: string): WrittenCall[] | undefined }[] = [
  {
    // Qwen3-Coder: <tool_call><function=NAME><parameter=KEY>VALUE</parameter>…</function></tool_call>
    name: "Qwen3-Coder XML",
    at: /(?:<tool_call>\s*)?<function=[\s\S]*<\/function>\s*(?:<\/tool_call>\s*)?$/,
    read: (markup) =>
      [...markup.matchAll(/<function=([\w.-]+)>([\s\S]*?)<\/function>/g)].map((f) => ({
        name: f[1],
        args: Object.fromEntries(
          [...f[2]!.matchAll(/<parameter=([\w.-]+)>\n?([\s\S]*?)\n?<\/parameter>/g)].map((p) => [p[1], p[2]]),
        ),
      })),
  },
  {
    // Hermes and Qwen2.5: <tool_call>{"name": …, "arguments": …}</tool_call>, one block per call.
    name: "Hermes JSON",
    at: /(?:<tool_call>\s*\{[\s\S]*?\}\s*<\/tool_call>\s*)+$/,
    read: (markup) =>
      [...markup.matchAll(/<tool_call>\s*(\{[\s\S]*?\})\s*<\/tool_call>/g)].map((m) => {
        const call = record(parseJsonOrUndefined(m[1]!));
        return { name: call.name, args: call.arguments ?? call.parameters };
      }),
  },
  {
    // Mistral, newer: [TOOL_CALLS]NAME[ARGS]{…}, repeated per call.
    name: "Mistral [ARGS]",
    at: /(?:\[TOOL_CALLS\][\w.-]+\[ARGS\]\{[\s\S]*?\}\s*)+$/,
    read: (markup) =>
      [...markup.matchAll(/\[TOOL_CALLS\]([\w.-]+)\[ARGS\](\{[\s\S]*?\})(?=\s*(?:\[TOOL_CALLS\]|$))/g)].map((m) => ({
        name: m[1],
        args: parseJsonOrUndefined(m[2]!),
      })),
  },
  {
    // Mistral: [TOOL_CALLS][{"name": …, "arguments": …}, …]
    name: "Mistral JSON",
    at: /\[TOOL_CALLS\]\s*\[[\s\S]*\]\s*$/,
    read: (markup) => {
      const list = parseJsonOrUndefined(markup.slice(markup.indexOf("[", 1)).trim());
      return Array.isArray(list) ? list.map(record).map((c) => ({ name: c.name, args: c.arguments })) : undefined;
    },
  },
  {
    // Llama 3.x: <|python_tag|>{"name": …, "parameters": …}, perhaps ending in <|eom_id|> or <|eot_id|>.
    name: "Llama python_tag",
    at: /<\|python_tag\|>\s*\{[\s\S]*\}\s*(?:<\|eom_id\|>|<\|eot_id\|>)?\s*$/,
    read: (markup) => {
      const body = markup.replace(/^<\|python_tag\|>/, "").replace(/<\|eo[mt]_id\|>\s*$/, "");
      const call = record(parseJsonOrUndefined(body.trim()));
      return [{ name: call.name, args: call.parameters ?? call.arguments }];
    },
  },
];

function parseJsonOrUndefined(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return undefined;
  }
}

/** Whether `at` in `text` lies inside a Markdown code fence (an odd number of ``` lines before it). */
function insideCodeFence(text: string, at: number): boolean {
  return (text.slice(0, at).match(/^\s*```/gm)?.length ?? 0) % 2 === 1;
}

/**
 * A reply without tool calls whose text ends in calls to execute_bash in a
 * format an open model writes (its server's parser missed them) becomes a
 * turn with those calls, the markup gone from its text. Only the model's own
 * words count: markup inside a code fence, followed by more text, calling
 * another function or with arguments that are not a command stays text.
 */
function rescueWrittenCalls(turn: AssistantTurn): AssistantTurn {
  if (turn.toolCalls.length || !turn.content.trim()) return turn;
  for (const format of WRITTEN_CALL_FORMATS) {
    const found = format.at.exec(turn.content);
    if (!found || insideCodeFence(turn.content, found.index)) continue;
    const calls = format.read(found[0]);
    const valid = calls?.length ? calls.map(writtenExecuteBash) : [];
    if (!valid.length || valid.some((c) => c === undefined)) continue;
    const stamp = Date.now().toString(36);
    return {
      ...turn,
      content: turn.content.slice(0, found.index).trimEnd(),
      toolCalls: (valid as string[]).map((args, i) => ({
        id: `call_text_${stamp}_${i + 1}`,
        type: "function",
        function: { name: EXECUTE_BASH_TOOL.function.name, arguments: args },
      })),
      finishReason: "tool_calls",
    };
  }
  return turn;
}

/** A written call's arguments as JSON text, if it calls execute_bash with a command or input. */
function writtenExecuteBash(call: WrittenCall): string | undefined {
  if (call.name !== EXECUTE_BASH_TOOL.function.name) return undefined;
  const args = typeof call.args === "string" ? parseJsonOrUndefined(call.args) : call.args;
  const a = record(args);
  const command = typeof a.command === "string" ? a.command : undefined;
  const input = typeof a.input === "string" ? a.input : undefined;
  if (!command && !input) return undefined;
  return JSON.stringify(command ? { command } : { input });
}

/** The error for a stream that went silent: before its first chunk (the request's limit), or between two. */
function silence(beforeFirstChunk: boolean): ModelError {
  return new ModelError(
    beforeFirstChunk
      ? `no answer from the model within ${MODEL_REQUEST_TIMEOUT_MS / 1000} s`
      : `no data from the model for ${STREAM_IDLE_MS / 1000} s`,
    "retry",
  );
}

// ════════════════════════════════════════════════════════════════════════════
// Model client: streaming a turn
// Owns: one streamed completion from the OpenAI-compatible server: the wait for
// its first chunk, tool calls assembled from deltas, the retry policy and its
// waits, and the usage figures the server reports.
// ════════════════════════════════════════════════════════════════════════════

/**
 * The wait for a model's first chunk, which on a local server reading a long
 * prompt takes minutes: a `model_wait` event after 1 s and every 10 s, and at
 * each change of llama.cpp's prompt progress (chunks that carry only it).
 */
class PrefillWatch {
  private readonly startedAt = Date.now();
  private readonly ticker: ReturnType<typeof setInterval>;
  private shownPercent = -1;
  waiting = true;

  constructor(private readonly emit: (e: AgentEvent) => void) {
    this.ticker = setInterval(() => {
      const seconds = Math.round((Date.now() - this.startedAt) / 1000);
      if (seconds === 1 || seconds % 10 === 0)
        this.emit({ type: "model_wait", elapsed_ms: Date.now() - this.startedAt });
    }, 1000);
    this.ticker.unref?.();
  }

  /** A chunk that only says how far the server has read the prompt: shown, and not the answer's first chunk. */
  sawProgress(chunk: {
    choices?: { delta?: Record<string, unknown> }[];
    prompt_progress?: Record<string, unknown>;
  }): boolean {
    const p = chunk.prompt_progress;
    // llama.cpp sends its progress beside one choice whose delta holds nothing yet.
    const said = (chunk.choices ?? []).some((c) =>
      ["content", "tool_calls", ...REASONING_FIELDS].some(
        (k) => c.delta?.[k] !== undefined && c.delta?.[k] !== null && c.delta?.[k] !== "",
      ),
    );
    if (!this.waiting || !p || said) return false;
    const processed = positiveInt(p.processed) ?? 0;
    const total = positiveInt(p.total) ?? 0;
    const percent = total ? Math.floor((processed / total) * 100) : 0;
    if (percent !== this.shownPercent) {
      this.shownPercent = percent;
      this.emit({ type: "model_wait", elapsed_ms: Date.now() - this.startedAt, prompt_progress: { processed, total } });
    }
    return true;
  }

  answered(): void {
    this.waiting = false;
    clearInterval(this.ticker);
  }
}

/** Builds tool calls from streamed fragments, by index; tolerates a missing index or a missing id. */
class ToolCallAssembler {
  private readonly calls: { id: string; name: string; args: string }[] = [];
  private last = -1;

  add(delta: { index?: unknown; id?: unknown; function?: { name?: unknown; arguments?: unknown } }): void {
    let index = typeof delta.index === "number" ? delta.index : undefined;
    const id = typeof delta.id === "string" && delta.id ? delta.id : undefined;
    if (index === undefined) {
      // No index: a new id that differs from the current call's starts the next call.
      const current = this.calls[this.last];
      index = current && id && current.id && current.id !== id ? this.last + 1 : Math.max(this.last, 0);
    }
    const call = (this.calls[index] ??= { id: "", name: "", args: "" });
    this.last = index;
    if (id && !call.id.endsWith(id)) call.id += id;
    if (typeof delta.function?.name === "string") call.name += delta.function.name;
    if (typeof delta.function?.arguments === "string") call.args += delta.function.arguments;
  }

  finish(): ToolCall[] {
    return this.calls
      .filter((c): c is { id: string; name: string; args: string } => Boolean(c))
      .map((c) => ({
        id: c.id || `call_${crypto.randomUUID().replace(/-/g, "").slice(0, 24)}`,
        type: "function" as const,
        function: { name: c.name, arguments: c.args },
      }));
  }
}

interface CompletionRequest {
  messages: Message[];
  tools: boolean;
  temperature: number;
}

/**
 * What the loop needs of a model: one streamed completion (retried as the
 * port sees fit, each wait told to the sink), and the news that a new run
 * starts. Production passes a ModelClient speaking to the endpoint; tests can
 * pass a scripted model and run the whole loop in-process.
 */
interface ModelPort {
  newRun(): void;
  completeWithRetries(
    request: () => CompletionRequest,
    signal: AbortSignal,
    on: StreamCallbacks & { onDiscard?(reason: string): void },
  ): Promise<AssistantTurn>;
}

/** How a retry waits: a real sleep that the run's stop can cut short (tests pass one that records and returns). */
type RetryWait = (ms: number, signal: AbortSignal) => Promise<void>;

/**
 * One model endpoint. `complete` streams a single attempt; `completeWithRetries`
 * wraps it in the retry policy and reports every wait to the sink.
 */
class ModelClient implements ModelPort {
  private clientPromise: Promise<import("openai").OpenAI> | undefined;
  /** Whether the current attempt's stream carried `data: [DONE]` (seen on the wire: the SDK hides it). */
  private sawDone = false;
  /** Whether any call of this run has been answered: until then, an endpoint nobody answers at is given up on quickly. */
  private answered = false;
  constructor(
    private readonly config: Config,
    private readonly sink: EventSink,
    private readonly wait: RetryWait = abortableSleep,
  ) {}

  private client(): Promise<import("openai").OpenAI> {
    this.clientPromise ??= import("openai").then(
      ({ OpenAI }) =>
        new OpenAI({
          baseURL: this.config.apiBase,
          // Local servers need no key, but the SDK insists on one; it is never written anywhere.
          apiKey: this.config.apiKey || "not-needed",
          maxRetries: 0,
          timeout: MODEL_REQUEST_TIMEOUT_MS,
          defaultHeaders: { "User-Agent": BROWSER_USER_AGENT, ...this.config.headers },
          fetch: (url: string | URL | Request, init?: RequestInit) => this.watchedFetch(url, init),
        }),
    );
    return this.clientPromise;
  }

  /** fetch, with the response body watched for the `data: [DONE]` line that marks a complete stream. */
  private async watchedFetch(url: string | URL | Request, init?: RequestInit): Promise<Response> {
    const response = await fetch(url, init);
    if (!response.ok || !response.body) return response;
    const decoder = new TextDecoder();
    let tail = "";
    const body = response.body.pipeThrough(
      new TransformStream<Uint8Array, Uint8Array>({
        transform: (chunk, controller) => {
          const text = tail + decoder.decode(chunk, { stream: true });
          if (/(^|\n)data: ?\[DONE\]/.test(text)) this.sawDone = true;
          tail = text.slice(-16);
          controller.enqueue(chunk);
        },
      }),
    );
    return new Response(body, { status: response.status, statusText: response.statusText, headers: response.headers });
  }

  /** A new run starts: its first request again gives up quickly on an endpoint where nothing answers. */
  newRun(): void {
    this.answered = false;
  }

  private params(req: CompletionRequest): Record<string, unknown> {
    const params: Record<string, unknown> = {
      model: this.config.model,
      messages: req.messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature: req.temperature,
    };
    if (req.tools) {
      params.tools = [EXECUTE_BASH_TOOL];
      params.tool_choice = "auto";
    }
    if (this.config.reasoningEffort) params.reasoning_effort = this.config.reasoningEffort;
    const profile = modelProfile(this.config);
    // Prompt plus max_tokens must fit the server's window (vLLM and llama.cpp refuse a request that passes it).
    if (profile.maxTokens !== undefined) params.max_tokens = replyReserve(this.config);
    if (profile.chatTemplateKwargs) params.chat_template_kwargs = { enable_thinking: true };
    // llama.cpp streams how far it has read a long prompt when asked (only a server that said it is llama.cpp).
    if (this.config.window?.endpoint.endsWith("/props")) params.return_progress = true;
    return params;
  }

  /** One streamed attempt. Throws ModelError (classified) or StoppedError. */
  async complete(req: CompletionRequest, signal: AbortSignal, cb: StreamCallbacks): Promise<AssistantTurn> {
    const client = await this.client();
    let content = "";
    let reasoning = "";
    let reasoningField: ReasoningField | undefined;
    let chunks = 0;
    let finished = false;
    let finishReason: string | undefined;
    let usage: AssistantTurn["usage"];
    const calls = new ToolCallAssembler();
    this.sawDone = false;
    // The SDK's own timeout ends once headers arrive; a stream that then goes silent would hang forever.
    const idle = new AbortController();
    // Before the first chunk the server may be reading a long prompt: only the request's own limit applies.
    let idleTimer = setTimeout(() => idle.abort(), MODEL_REQUEST_TIMEOUT_MS);
    const prefill = new PrefillWatch((e) => this.sink.emit(e));
    try {
      // The SDK's types do not know chat_template_kwargs; the boundary is narrowed chunk by chunk below.
      const stream = (await client.chat.completions.create(this.params(req) as never, {
        signal: AbortSignal.any([signal, idle.signal]),
      })) as unknown as AsyncIterable<unknown>;
      for await (const raw of stream) {
        chunks++;
        const chunk = raw as {
          error?: unknown;
          choices?: { delta?: Record<string, unknown>; finish_reason?: unknown }[];
          usage?: Record<string, unknown>;
          prompt_progress?: Record<string, unknown>;
        };
        if (prefill.sawProgress(chunk)) continue;
        prefill.answered();
        clearTimeout(idleTimer);
        idleTimer = setTimeout(() => idle.abort(), STREAM_IDLE_MS);
        if (chunk.error) throw classifyModelFailure(undefined, chunk.error, undefined, true);
        if (chunk.usage) usage = readUsage(chunk.usage);
        const reason = chunk.choices?.[0]?.finish_reason;
        if (reason) {
          finished = true;
          finishReason = String(reason);
        }
        const delta = chunk.choices?.[0]?.delta;
        if (!delta) continue;
        const field = REASONING_FIELDS.find((f) => typeof delta[f] === "string" && delta[f] !== "");
        const thought = field && (delta[field] as string);
        if (thought) {
          reasoningField ??= field;
          reasoning += thought;
          cb.onReasoning?.(thought);
        }
        if (typeof delta.content === "string" && delta.content) {
          if (reasoning && !content) cb.onThinkingComplete?.();
          content += delta.content;
          cb.onContent?.(delta.content);
        }
        if (Array.isArray(delta.tool_calls))
          for (const tc of delta.tool_calls) calls.add(tc as Parameters<ToolCallAssembler["add"]>[0]);
      }
    } catch (error) {
      if (signal.aborted) throw new StoppedError();
      if (idle.signal.aborted) throw silence(prefill.waiting);
      throw modelErrorFrom(error, this.config.apiBase, chunks > 0);
    } finally {
      clearTimeout(idleTimer);
      prefill.answered();
    }
    if (signal.aborted) throw new StoppedError();
    // The SDK may end the stream quietly when the silence limit aborts it.
    if (idle.signal.aborted && !finished) throw silence(false);
    if (chunks === 0) throw new ModelError("the stream ended without any data", "retry");
    // A complete stream ends with [DONE] or a finish_reason (the official SDK accepts either); a dropped connection has neither.
    if (!finished && !this.sawDone)
      throw new ModelError("the stream was cut off: it ended with neither a finish_reason nor data: [DONE]", "retry");
    this.answered = true;
    return { content, reasoning, reasoningField, toolCalls: calls.finish(), usage, finishReason };
  }

  /**
   * The retry policy: fatal errors surface at once, a context overflow goes
   * back to the caller (which compresses harder), everything else waits 1 s,
   * 2 s, 4 s … (or Retry-After) up to five attempts. An endpoint where nothing
   * answers at all is given up on after a few seconds while the run has had
   * no answer yet: it is a wrong --api-base, not a busy server.
   */
  async completeWithRetries(
    req: () => CompletionRequest,
    signal: AbortSignal,
    cb: StreamCallbacks & { onDiscard?(reason: string): void },
  ): Promise<AssistantTurn> {
    // Whether the failed attempt showed any text that the person must now be told to disregard.
    let partial = false;
    const watched: StreamCallbacks = {
      onContent: (text) => {
        partial = true;
        cb.onContent?.(text);
      },
      onReasoning: (text) => {
        partial = true;
        cb.onReasoning?.(text);
      },
      onThinkingComplete: () => cb.onThinkingComplete?.(),
    };
    for (let attempt = 1; ; attempt++) {
      try {
        return await this.complete(req(), signal, watched);
      } catch (error) {
        if (partial && !(error instanceof StoppedError))
          cb.onDiscard?.(error instanceof Error ? error.message : String(error));
        partial = false;
        if (!(error instanceof ModelError)) throw error;
        const unreachable = error.kind === "unreachable";
        if (unreachable && !this.answered && attempt >= UNREACHABLE_FIRST_ATTEMPTS)
          throw new ModelError(error.message, "fatal");
        if ((error.kind !== "retry" && !unreachable) || attempt >= MAX_MODEL_ATTEMPTS)
          throw unreachable ? new ModelError(error.message, "fatal") : error;
        const backoff =
          unreachable && !this.answered
            ? UNREACHABLE_FIRST_WAIT_MS * attempt
            : Math.min(BACKOFF_CAP_MS, 1000 * 2 ** (attempt - 1));
        const wait = Math.min(BACKOFF_CAP_MS, error.retryAfterMs ?? backoff);
        this.sink.emit({ type: "retry", attempt, wait_ms: wait, reason: error.message });
        await this.wait(wait, signal);
      }
    }
  }
}

function readUsage(u: Record<string, unknown>): NonNullable<AssistantTurn["usage"]> {
  const num = (v: unknown) => (typeof v === "number" && Number.isFinite(v) ? v : 0);
  const details = (u.prompt_tokens_details ?? {}) as Record<string, unknown>;
  return {
    prompt_tokens: num(u.prompt_tokens),
    completion_tokens: num(u.completion_tokens),
    cached_tokens: num(details.cached_tokens) || num(u.prompt_cache_hit_tokens),
  };
}

// ════════════════════════════════════════════════════════════════════════════
// Model client: the server's context window
// Owns: asking the endpoint at start how large a context it runs the model
// with (vLLM, LM Studio and OpenRouter in /models, llama.cpp's /props,
// Ollama's /api/ps and /api/show), so a small local window is known before
// the server silently cuts the prompt to it.
// ════════════════════════════════════════════════════════════════════════════

/** How long each question about the window may take: a server that does not answer is asked nothing more. */
const WINDOW_PROBE_MS = 3000;
/** Ollama's own default when it says nothing of the model's context (its num_ctx). */
const OLLAMA_DEFAULT_CONTEXT = 4096;

/** One probe's answer: the window, or undefined when this endpoint does not say (or is not there). */
async function probeJson(url: string, config: Config, init: RequestInit = {}): Promise<unknown> {
  try {
    const response = await fetch(url, {
      ...init,
      headers: {
        ...(config.apiKey ? { Authorization: `Bearer ${config.apiKey}` } : {}),
        ...config.headers,
        ...(init.body ? { "Content-Type": "application/json" } : {}),
      },
      signal: AbortSignal.timeout(WINDOW_PROBE_MS),
    });
    return response.ok ? await response.json() : undefined;
  } catch {
    return undefined;
  }
}

const positiveInt = (v: unknown): number | undefined =>
  typeof v === "number" && Number.isFinite(v) && v > 0 ? Math.floor(v) : undefined;
const record = (v: unknown): Record<string, unknown> =>
  v && typeof v === "object" ? (v as Record<string, unknown>) : {};

/** The model's entry in an OpenAI-style list (`data`), or Ollama's (`models`), by id or name. */
function modelEntry(list: unknown, model: string): Record<string, unknown> | undefined {
  const entries = Array.isArray(list) ? list.map(record) : [];
  const names = (e: Record<string, unknown>) => [e.id, e.name, e.model].filter((n) => typeof n === "string");
  return (
    entries.find((e) => names(e).includes(model)) ??
    entries.find((e) => names(e).some((n) => n.startsWith(`${model}:`)))
  );
}

/** What the server says of the window, by the first of its shapes that answers. */
async function askServerWindow(
  config: Config,
): Promise<{ tokens: number; endpoint: string } | { warning: string } | undefined> {
  const base = config.apiBase.replace(/\/+$/, "");
  const origin = new URL(base).origin;
  const [models, props, ps] = await Promise.all([
    probeJson(`${base}/models`, config),
    probeJson(`${origin}/props`, config),
    probeJson(`${origin}/api/ps`, config),
  ]);
  const listed = modelEntry(record(models).data, config.model);
  const fromList =
    positiveInt(listed?.max_model_len) ??
    positiveInt(listed?.context_length) ??
    positiveInt(listed?.max_context_length) ??
    positiveInt(record(listed?.top_provider).context_length);
  if (fromList) return { tokens: fromList, endpoint: `${base}/models` };
  const settings = record(record(props).default_generation_settings);
  const slot = positiveInt(settings.n_ctx) ?? positiveInt(record(props).n_ctx);
  if (slot) return { tokens: slot, endpoint: `${origin}/props` };
  if (ps === undefined) return undefined;
  // Ollama: the loaded model's context, else the num_ctx it was given (context_length in model_info is the trained maximum).
  const loaded = positiveInt(modelEntry(record(ps).models, config.model)?.context_length);
  if (loaded) return { tokens: loaded, endpoint: `${origin}/api/ps` };
  const show = record(
    await probeJson(`${origin}/api/show`, config, { method: "POST", body: JSON.stringify({ model: config.model }) }),
  );
  const numCtx = /(?:^|\n)\s*num_ctx\s+(\d+)/.exec(typeof show.parameters === "string" ? show.parameters : "")?.[1];
  if (numCtx) return { tokens: Number(numCtx), endpoint: `${origin}/api/show` };
  return {
    warning: `Ollama at ${origin} does not say the context of ${config.model} (not loaded, no num_ctx): assuming its default of ${OLLAMA_DEFAULT_CONTEXT} tokens; set OLLAMA_CONTEXT_LENGTH on the server, or --max-prompt-len`,
  };
}

/** Where the prompt budget came from, as the start event reports it. */
interface BudgetFacts {
  prompt_tokens: number;
  window: number | null;
  max_tokens: number | null;
  source: "server" | "flag" | "default";
  endpoint: string | null;
}

/**
 * Fits the budget to the server's window: the answer's reserve is a quarter
 * of the window (at most OUTPUT_RESERVATION_TOKENS), and --max-prompt-len is
 * capped to the window, with a warning when it was given larger. Returns the
 * warnings to show.
 */
async function fitToServerWindow(config: Config, given: boolean): Promise<string[]> {
  const said = await askServerWindow(config);
  if (!said) return [];
  const warnings: string[] = [];
  let tokens: number;
  let endpoint: string;
  if ("warning" in said) {
    warnings.push(said.warning);
    tokens = OLLAMA_DEFAULT_CONTEXT;
    endpoint = "";
  } else ({ tokens, endpoint } = said);
  if (config.maxPromptLen > tokens && given)
    warnings.push(
      `--max-prompt-len ${config.maxPromptLen} is larger than the context window ${endpoint || "the server"} runs the model with (${tokens} tokens): the prompt stays within the window`,
    );
  config.window = { tokens, endpoint, replyTokens: Math.min(OUTPUT_RESERVATION_TOKENS, Math.floor(tokens / 4)) };
  return warnings;
}

function budgetFacts(config: Config, given: boolean): BudgetFacts {
  const reply = replyReserve(config);
  const w = config.window;
  const byFlag = given && (!w || config.maxPromptLen < w.tokens - w.replyTokens);
  return {
    prompt_tokens: promptBudget(config),
    window: w?.tokens ?? null,
    max_tokens: reply || null,
    source: byFlag ? "flag" : w?.endpoint ? "server" : "default",
    endpoint: w?.endpoint || null,
  };
}

// ════════════════════════════════════════════════════════════════════════════
// Context compression
// Owns: keeping the history inside the prompt budget. `truncate` condenses old
// tool output, then drops the oldest turns; the anchored summary evicts the
// oldest turns into a running summary kept in the system message. Both keep
// the system prompt and the first user message, and both cut only at turn
// boundaries so every tool answer keeps its call.
// ════════════════════════════════════════════════════════════════════════════

/** Index ranges [start, end) of turns from `from` on: an assistant message travels with its tool answers. */
function turnsFrom(messages: readonly Message[], from: number): [number, number][] {
  const turns: [number, number][] = [];
  let i = from;
  while (i < messages.length) {
    let end = i + 1;
    if (messages[i]!.role === "assistant") while (end < messages.length && messages[end]!.role === "tool") end++;
    turns.push([i, end]);
    i = end;
  }
  return turns;
}

interface CompressionResult {
  messages: Message[];
  detail: string;
  removed: number;
}

/**
 * `truncate`: condense tool outputs oldest first, one at a time, only until
 * the history fits; if that is not enough, drop whole turns from index 2 on.
 */
function compressTruncate(messages: readonly Message[], counter: TokenCounter, targetRaw: number): CompressionResult {
  const out = messages.slice();
  const condensable = (m: Message) => m.role === "tool" && contentText(m.content).length > 30;
  // The newest messages whose count alone passes the target: every tool output older than them is
  // condensed whatever its size, so it is never counted (a long resumed history would be seconds of tiktoken).
  let from = out.length;
  let total = 0;
  while (from > 2 && total <= targetRaw) total += counter.countMessage(out[--from]!);
  let condensed = 0;
  for (let i = 0; i < from; i++) {
    if (i >= 2 && condensable(out[i]!)) {
      out[i] = { ...out[i]!, content: CONDENSED_TOOL_OUTPUT };
      condensed++;
    }
    total += counter.countMessage(out[i]!);
  }
  for (let i = from; i < out.length && total > targetRaw; i++) {
    const m = out[i]!;
    if (!condensable(m)) continue;
    const before = counter.countMessage(m);
    const replacement = { ...m, content: CONDENSED_TOOL_OUTPUT };
    out[i] = replacement;
    total += counter.countMessage(replacement) - before;
    condensed++;
  }
  // Whole turns from index 2 on, oldest first, cut in one splice (one splice per turn was quadratic).
  let cut = 2;
  for (const [start, end] of turnsFrom(out, 2)) {
    if (total <= targetRaw) break;
    for (let i = start; i < end; i++) total -= counter.countMessage(out[i]!);
    cut = end;
  }
  out.splice(2, cut - 2);
  const dropped = cut - 2;
  const parts = [
    condensed ? `condensed ${condensed} tool output(s)` : "",
    dropped ? `dropped ${dropped} old message(s)` : "",
  ].filter(Boolean);
  return { messages: out, detail: parts.join(", ") || "nothing to remove", removed: dropped };
}

/**
 * Renders messages for the summariser as `[role] content`, tool calls spelt
 * out. When the segment is larger than `maxTokens`, the newest messages are
 * kept (they matter most for "current work" and "next step").
 */
function transcriptOf(messages: readonly Message[], counter: TokenCounter, maxTokens: number): string {
  const lines: string[] = [];
  let used = 0;
  for (let i = messages.length - 1; i >= 0; i--) {
    const m = messages[i]!;
    let text = contentText(m.content);
    for (const call of m.tool_calls ?? [])
      text += `${text ? "\n" : ""}(calls ${call.function.name}: ${call.function.arguments})`;
    if (text.length > TRANSCRIPT_MESSAGE_CHARS)
      text = `${text.slice(0, TRANSCRIPT_HEAD_CHARS)}\n…\n${text.slice(-TRANSCRIPT_TAIL_CHARS)}`;
    const line = `[${m.role}] ${text}`;
    const tokens = counter.tokensOf(line) + 2;
    if (used + tokens > maxTokens) {
      lines.push(`[…] (${i + 1} older message(s) of this segment left out)`);
      break;
    }
    used += tokens;
    lines.push(line);
  }
  return lines.reverse().join("\n\n");
}

/**
 * The anchored summary (in the manner of Factory.ai's compressor): evict the
 * oldest whole turns so the newest suffix fits the retained target, fold only
 * the evicted segment and the previous summary into a new summary with one
 * model call, and keep that summary in the single system message.
 */
async function compressAnchored(
  messages: readonly Message[],
  basePrompt: string,
  priorSummary: string | undefined,
  counter: TokenCounter,
  targetRaw: number,
  summarise: (request: Message[]) => Promise<string | undefined>,
  /** The whole prompt budget in raw tokens: the summariser's own request must fit in it too. */
  budgetRaw: number,
): Promise<CompressionResult & { summary: string }> {
  const head = messages.slice(0, 2);
  // Room kept for the summary itself: ~5000 characters is about 1300 tokens.
  const summaryAllowance = Math.min(SUMMARY_ALLOWANCE_TOKENS, Math.floor(targetRaw / 4));
  const headTokens =
    counter.countMessage({ role: "system", content: basePrompt }) + (head[1] ? counter.countMessage(head[1]) : 0);
  const room = targetRaw - headTokens - summaryAllowance;
  const turns = turnsFrom(messages, 2);
  let keepFrom = messages.length;
  let used = 0;
  for (let t = turns.length - 1; t >= 0; t--) {
    const [start, end] = turns[t]!;
    let size = 0;
    for (let i = start; i < end; i++) size += counter.countMessage(messages[i]!);
    if (used + size > room) break;
    used += size;
    keepFrom = start;
  }
  // Always evict something, or compression could never make progress.
  if (keepFrom === 2 && turns.length) keepFrom = turns.length > 1 ? turns[1]![0] : messages.length;
  // Always keep the newest turn, so the model still sees the result it is acting on; the fallback below condenses it if needed.
  if (keepFrom === messages.length && turns.length > 1) keepFrom = turns[turns.length - 1]![0];
  const evicted = messages.slice(2, keepFrom);
  const firstUser = contentText(head[1]?.content);
  const fixedPart = summariserRequest(basePrompt, firstUser, priorSummary, "");
  const transcriptRoom = Math.max(500, Math.floor(budgetRaw - counter.countRaw(fixedPart) - 200));
  const request = summariserRequest(
    basePrompt,
    firstUser,
    priorSummary,
    transcriptOf(evicted, counter, transcriptRoom),
  );
  const fresh = (await summarise(request))?.trim();
  const summary = fresh
    ? fresh.slice(0, SUMMARY_MAX_CHARS)
    : priorSummary
      ? `${priorSummary}\n${SUMMARY_UNAVAILABLE}`
      : SUMMARY_UNAVAILABLE;
  let out: Message[] = [
    { ...(head[0] ?? { role: "system" }), role: "system", content: systemContent(basePrompt, summary) },
    ...head.slice(1),
    ...messages.slice(keepFrom),
  ];
  if (!out.some((m) => m.role === "user")) out.push({ role: "user", content: CONTINUE_FALLBACK });
  let detail = `summarised ${evicted.length} message(s), kept ${out.length - 2}`;
  // A summary longer than its allowance or one huge newest turn: condense what is left.
  if (counter.countRaw(out) > targetRaw) {
    const squeezed = compressTruncate(out, counter, targetRaw);
    out = squeezed.messages;
    detail += `; then ${squeezed.detail}`;
  }
  return { messages: out, summary, detail, removed: evicted.length };
}

/**
 * When the history is compressed and how far: at the start of a step once it
 * passes the budget, down to `target` of the budget; when the server says a
 * prompt is too long, `OVERFLOW_SHRINK` of the last target below the
 * server's own figure, up to MAX_CONTEXT_RETRIES times.
 */
class CompressionPolicy {
  /** Each "prompt too long" from the server halves the target. */
  static readonly OVERFLOW_SHRINK = 0.5;

  constructor(
    readonly algorithm: CompressAlg,
    /** The fraction of the budget a compression aims at (--compress-target). */
    readonly target: number,
    /** The prompt budget in the server's tokens. */
    readonly budget: number,
  ) {}

  /** The target after the server refused a prompt aimed at `fraction`. */
  afterOverflow(fraction: number): number {
    return fraction * CompressionPolicy.OVERFLOW_SHRINK;
  }

  /** How many raw (tiktoken) tokens to aim at: `fraction` of the budget, or of `ceiling` when the server set a lower one. */
  targetRaw(fraction: number, ratio: number, ceiling = Infinity): number {
    return Math.floor(Math.floor(Math.min(this.budget, ceiling) * fraction) / ratio);
  }
}

/** The history and what stays beside it that compression may change. */
interface History {
  messages: Message[];
  /** The anchored summary of what was evicted so far. */
  summary: string | undefined;
}

/**
 * The history's size in the server's tokens. It is counted from the newest
 * message back and only until `limit` is passed (unless `whole`): a long
 * history resumed far over the budget is never encoded whole. The part left
 * uncounted enters the figure as a guess, at the counted part's tokens per byte.
 */
async function measureHistory(
  messages: Message[],
  counter: TokenCounter,
  limit: number,
  whole: boolean,
): Promise<number> {
  const counted = await counter.countRawNewest(messages, whole ? Infinity : limit / counter.ratio);
  const rest = messages.slice(0, counted.from);
  const uncounted = rest.length
    ? Math.ceil((tokenUpperBound(rest) * counted.raw) / tokenUpperBound(messages.slice(counted.from)))
    : 0;
  return Math.ceil((counted.raw + uncounted) * counter.ratio);
}

/** Compresses `history` down to `targetRaw` with the policy's algorithm; the new history and what happened. */
async function compressHistory(
  history: History,
  policy: CompressionPolicy,
  o: {
    counter: TokenCounter;
    targetRaw: number;
    basePrompt: string;
    summarise: (request: Message[]) => Promise<string | undefined>;
  },
): Promise<History & { result: CompressionResult }> {
  if (policy.algorithm === "truncate") {
    const result = compressTruncate(history.messages, o.counter, o.targetRaw);
    return { messages: result.messages, summary: history.summary, result };
  }
  const budgetRaw = Math.floor(policy.budget / o.counter.ratio);
  const anchored = await compressAnchored(
    history.messages,
    o.basePrompt,
    history.summary,
    o.counter,
    o.targetRaw,
    o.summarise,
    budgetRaw,
  );
  return { messages: anchored.messages, summary: anchored.summary, result: anchored };
}

// ════════════════════════════════════════════════════════════════════════════
// Own files on hostile ground
// Owns: every file aic opens where a command can write (the cwd, /tmp). aic is
// not confined, so a command that plants a link, a FIFO or a device where aic
// keeps its files could make aic write, block or read for it. Here no path is
// followed through a symbolic link, nothing but a regular file within a size
// bound is read or written, nothing is opened in a way a FIFO could block,
// and files are created and replaced relative to a directory descriptor aic
// holds, so renaming or swapping the directory cannot redirect aic's writes.
// ════════════════════════════════════════════════════════════════════════════

/**
 * Linux libc through bun:ffi, opened once (each dlopen compiles its call
 * stubs); undefined elsewhere, where the features that need it (locks,
 * Landlock, restoring stream flags) are reported as unavailable.
 */
let linuxLibc: ReturnType<typeof openLinuxLibc> | null | undefined;

function libc() {
  if (linuxLibc === undefined) {
    try {
      linuxLibc = process.platform === "linux" ? openLinuxLibc() : null;
    } catch {
      linuxLibc = null;
    }
  }
  return linuxLibc ?? undefined;
}

function openLinuxLibc() {
  const { dlopen, FFIType } = require("bun:ffi") as typeof import("bun:ffi");
  return dlopen("libc.so.6", {
    // Every argument as a 64-bit integer: pointers are passed as numbers from ptr().
    // The number and five arguments (move_mount and mount_setattr take five).
    syscall: {
      args: [FFIType.i64, FFIType.i64, FFIType.i64, FFIType.i64, FFIType.i64, FFIType.i64],
      returns: FFIType.i64,
    },
    prctl: { args: [FFIType.i32, FFIType.u64, FFIType.u64, FFIType.u64, FFIType.u64], returns: FFIType.i32 },
    open: { args: [FFIType.cstring, FFIType.i32], returns: FFIType.i32 },
    close: { args: [FFIType.i32], returns: FFIType.i32 },
    execve: { args: [FFIType.cstring, FFIType.ptr, FFIType.ptr], returns: FFIType.i32 },
    flock: { args: [FFIType.i32, FFIType.i32], returns: FFIType.i32 },
    fcntl: { args: [FFIType.i32, FFIType.i32, FFIType.i64], returns: FFIType.i32 },
    waitpid: { args: [FFIType.i32, FFIType.ptr, FFIType.i32], returns: FFIType.i32 },
    // The jail's set-up, in the fresh namespaces (see "The jail").
    mount: { args: [FFIType.ptr, FFIType.ptr, FFIType.ptr, FFIType.u64, FFIType.ptr], returns: FFIType.i32 },
    socket: { args: [FFIType.i32, FFIType.i32, FFIType.i32], returns: FFIType.i32 },
    // The exec judge's listener, handed from the launcher to its supervisor (SCM_RIGHTS).
    socketpair: { args: [FFIType.i32, FFIType.i32, FFIType.i32, FFIType.ptr], returns: FFIType.i32 },
    sendmsg: { args: [FFIType.i32, FFIType.ptr, FFIType.i32], returns: FFIType.i64 },
    recvmsg: { args: [FFIType.i32, FFIType.ptr, FFIType.i32], returns: FFIType.i64 },
    ioctl: { args: [FFIType.i32, FFIType.u64, FFIType.ptr], returns: FFIType.i32 },
    // The checkpoints' watch on the start directory (see ChangeWatch).
    inotify_init1: { args: [FFIType.i32], returns: FFIType.i32 },
    inotify_add_watch: { args: [FFIType.i32, FFIType.ptr, FFIType.u32], returns: FFIType.i32 },
    // The exec supervisor's wait for a call to judge (see "Sandbox: judging each program a command executes").
    poll: { args: [FFIType.ptr, FFIType.u64, FFIType.i32], returns: FFIType.i32 },
    __errno_location: { args: [], returns: FFIType.ptr },
    signal: { args: [FFIType.i32, FFIType.u64], returns: FFIType.u64 },
  });
}

/** Bigger files of aic's own (a session, a lock) are refused whole, never half-read. */
const MAX_OWN_FILE_BYTES = 256 * 1024 * 1024;

const O = fs.constants;

/** Linux can reopen a descriptor through /proc/self/fd, which resolves to the very inode aic holds. */
const PROC_FD = process.platform === "linux" && fs.existsSync("/proc/self/fd");

const O_PATH = 0o10000000;
const O_CLOEXEC = 0o2000000;

/** Why one of aic's own files cannot be used: it is missing, of the wrong type (planted), not ours to open, or something else. */
type OwnFileProblem = "missing" | "type" | "access" | "other";

class OwnFileError extends Error {
  constructor(
    message: string,
    readonly problem: OwnFileProblem = "other",
  ) {
    super(message);
  }
  get missing(): boolean {
    return this.problem === "missing";
  }
}

function fileKind(st: fs.Stats): string {
  if (st.isSymbolicLink()) return "a symbolic link, which aic never follows for its own files";
  if (st.isDirectory()) return "a directory";
  if (st.isFIFO()) return "a FIFO";
  if (st.isSocket()) return "a socket";
  if (st.isCharacterDevice() || st.isBlockDevice()) return "a device";
  return "not a regular file";
}

function ownFileError(error: unknown): OwnFileError {
  if (error instanceof OwnFileError) return error;
  const code = (error as NodeJS.ErrnoException).code;
  if (code === "ENOENT") return new OwnFileError("it does not exist", "missing");
  if (code === "ELOOP")
    return new OwnFileError("it is a symbolic link, which aic never follows for its own files", "type");
  if (code === "ENXIO") return new OwnFileError("it is a FIFO or socket, not a regular file", "type");
  if (code === "EISDIR") return new OwnFileError("it is a directory", "type");
  if (code === "EACCES" || code === "EPERM") return new OwnFileError("permission denied", "access");
  return new OwnFileError((error as Error).message);
}

/**
 * Opens `file` only if it is a regular file (created when `flags` has
 * O_CREAT). On Linux the path is first pinned with O_PATH|O_NOFOLLOW, which
 * opens nothing, and reopened through /proc/self/fd once its type is known:
 * a device or FIFO is never opened at all. Throws OwnFileError.
 */
function openRegular(file: string, flags: number, mode = 0o600): number {
  const create = (flags & O.O_CREAT) !== 0;
  const plain = (flags & ~(O.O_CREAT | O.O_EXCL)) | O.O_NOFOLLOW | O.O_NONBLOCK;
  for (let attempt = 0; attempt < 3; attempt++) {
    let pinned: number;
    try {
      pinned = fs.openSync(file, PROC_FD ? O_PATH | O.O_NOFOLLOW : plain);
    } catch (error) {
      const e = ownFileError(error);
      if (!e.missing || !create) throw e;
      try {
        return fs.openSync(file, (flags & ~O.O_TRUNC) | O.O_EXCL | O.O_NOFOLLOW | O.O_NONBLOCK, mode);
      } catch (raced) {
        if ((raced as NodeJS.ErrnoException).code === "EEXIST") continue; // made meanwhile: look again
        throw ownFileError(raced);
      }
    }
    let keep = false;
    try {
      const st = fs.fstatSync(pinned);
      if (!st.isFile()) throw new OwnFileError(`it is ${fileKind(st)}`, "type");
      if (!PROC_FD) return ((keep = true), pinned);
      return fs.openSync(`/proc/self/fd/${pinned}`, plain & ~O.O_NOFOLLOW);
    } catch (error) {
      throw ownFileError(error);
    } finally {
      if (!keep) fs.closeSync(pinned);
    }
  }
  throw new OwnFileError("it keeps changing while aic opens it", "type");
}

/**
 * Reads one of aic's own files: a regular file only, never through a link.
 * Over `max` bytes it is refused (`head` false) or only its first `max`
 * bytes are read (`head` true, for instructions cut to a budget anyway).
 */
function readOwnFile(file: string, max = MAX_OWN_FILE_BYTES, head = false): Buffer {
  const fd = openRegular(file, O.O_RDONLY);
  try {
    return readOwnFd(fd, max, head);
  } finally {
    fs.closeSync(fd);
  }
}

/** readOwnFile on a descriptor openRegular gave, from its start (so it can be read again). */
function readOwnFd(fd: number, max = MAX_OWN_FILE_BYTES, head = false): Buffer {
  const size = fs.fstatSync(fd).size;
  if (size > max && !head)
    throw new OwnFileError(`it is ${size} bytes, more than the ${max} bytes aic reads of its own files`, "type");
  const buffer = Buffer.alloc(Math.min(size, max) + 1);
  let length = 0;
  for (let n; length < buffer.length && (n = fs.readSync(fd, buffer, length, buffer.length - length, length)) > 0;)
    length += n;
  if (length > max) {
    if (!head) throw new OwnFileError(`it grew past the ${max} bytes aic reads of its own files`, "type");
    length = max;
  }
  return buffer.subarray(0, length);
}

/** Own files are read in slices of this size when they need not be whole in memory. */
const READ_SLICE_BYTES = 1 << 20;

/**
 * readOwnFd (never `head`) in slices handed to `each` as they are read, so
 * the whole file is never in memory at once: each slice is a fresh buffer
 * `each` may keep, or, with `reuse`, the same buffer every time. Returns the
 * number of bytes read.
 */
function readOwnFdInSlices(fd: number, each: (slice: Buffer) => void, reuse = false): number {
  const max = MAX_OWN_FILE_BYTES;
  const size = fs.fstatSync(fd).size;
  if (size > max)
    throw new OwnFileError(`it is ${size} bytes, more than the ${max} bytes aic reads of its own files`, "type");
  const limit = size + 1;
  const scratch = reuse ? Buffer.allocUnsafe(Math.min(READ_SLICE_BYTES, limit)) : undefined;
  let length = 0;
  while (length < limit) {
    const slice = scratch ?? Buffer.allocUnsafe(Math.min(READ_SLICE_BYTES, limit - length));
    const n = fs.readSync(fd, slice, 0, Math.min(slice.length, limit - length), length);
    if (n === 0) break;
    length += n;
    if (length > max) throw new OwnFileError(`it grew past the ${max} bytes aic reads of its own files`, "type");
    each(n === slice.length ? slice : slice.subarray(0, n));
  }
  return length;
}

const randomName = () => Math.random().toString(36).slice(2, 10);

/** The pieces of a file as they are written, each added to `digest` on its way. */
function* hashedAsWritten(pieces: Iterable<Uint8Array>, digest: ReturnType<typeof createHash>): Iterable<Uint8Array> {
  for (const piece of pieces) {
    digest.update(piece);
    yield piece;
  }
}

/**
 * What a file is now, as far as telling a rewrite goes: device, inode, size,
 * and both times (a process can put the modification time back, never the
 * change time). Undefined when there is nothing there. A link is not followed.
 */
function identityOf(file: string): string | undefined {
  try {
    const st = fs.lstatSync(file, { bigint: true });
    return `${st.dev}:${st.ino}:${st.size}:${st.mtimeNs}:${st.ctimeNs}`;
  } catch {
    return undefined;
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Own files: a directory aic holds
// Owns: a directory held open by its descriptor, in which aic reads, stages,
// writes and renames its own files without following a link, and the batched
// writes of many pieces with one call.
// ════════════════════════════════════════════════════════════════════════════

/**
 * A directory aic holds open. Files in it are reached through the
 * descriptor, so a command that renames the directory and puts a link in
 * its place cannot move aic's writes; `isStillAtPath` tells whether the path
 * people and the model are given still leads to it.
 */
class HeldDirectory {
  private closed = false;
  private constructor(
    readonly path: string,
    private readonly fd: number,
  ) {}

  /**
   * Opens `dir` without following a link in its place. A link there that the
   * person chose (`--session linked-dir/s.json`) is resolved once, at start,
   * before any command has run.
   */
  static open(dir: string): HeldDirectory {
    const flags = O.O_RDONLY | O.O_DIRECTORY | O.O_NOFOLLOW;
    try {
      return new HeldDirectory(dir, fs.openSync(dir, flags));
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code !== "ELOOP" && (error as NodeJS.ErrnoException).code !== "ENOTDIR")
        throw error;
      const real = fs.realpathSync(dir);
      return new HeldDirectory(real, fs.openSync(real, flags));
    }
  }

  /** `open`, or undefined when the directory is not there (or not one). */
  static tryOpen(dir: string): HeldDirectory | undefined {
    try {
      return HeldDirectory.open(dir);
    } catch {
      return undefined;
    }
  }

  /** A fresh private directory (0700) in `parent` (made, private, when missing). */
  static createPrivate(parent: string, prefix: string): HeldDirectory {
    fs.mkdirSync(parent, { recursive: true, mode: 0o700 });
    return HeldDirectory.open(fs.mkdtempSync(path.join(parent, prefix)));
  }

  /** The path that reaches `name` through the held descriptor. */
  at(name = ""): string {
    if (!PROC_FD) return path.join(this.path, name);
    return name ? `/proc/self/fd/${this.fd}/${name}` : `/proc/self/fd/${this.fd}`;
  }

  /** The path of `name` as a person (or the model) would write it. */
  display(name: string): string {
    return path.join(this.path, name);
  }

  isStillAtPath(): boolean {
    return this.whyNotAtPath() === undefined;
  }

  /** Why the path no longer leads to the directory aic holds (moved, replaced by a link, gone), or undefined when it does. */
  whyNotAtPath(): string | undefined {
    let there: fs.Stats;
    try {
      there = fs.lstatSync(this.path);
    } catch {
      return `${this.path} is gone (moved or deleted)`;
    }
    if (there.isSymbolicLink()) return `${this.path} was replaced by a symbolic link`;
    const here = fs.fstatSync(this.fd);
    if (!there.isDirectory() || here.ino !== there.ino || here.dev !== there.dev)
      return `${this.path} is no longer the directory aic started in (it was moved or replaced)`;
    return undefined;
  }

  /** The descriptor, for operations made relative to it (and for a child process to inherit). */
  get descriptor(): number {
    return this.fd;
  }

  read(name: string, max?: number): Buffer {
    return readOwnFile(this.at(name), max);
  }

  open(name: string, flags: number): number {
    return openRegular(this.at(name), flags);
  }

  /** A new file that did not exist before: nothing planted under that name can be reused. */
  createExclusive(name: string): number {
    return fs.openSync(this.at(name), O.O_WRONLY | O.O_CREAT | O.O_EXCL | O.O_NOFOLLOW, 0o600);
  }

  /**
   * Replaces `name` atomically: a temporary file created exclusively under
   * a random name, written (and flushed to disk when `durable`), renamed over
   * the old one. A link planted at `name` is replaced, never written through.
   */
  replace(name: string, data: string | Uint8Array | Iterable<Uint8Array>, durable: boolean): void {
    const temporary = `.${name}.${randomName()}.tmp`;
    const fd = this.createExclusive(temporary);
    try {
      try {
        writeAll(fd, data);
        if (durable) fs.fsyncSync(fd);
      } finally {
        fs.closeSync(fd);
      }
      fs.renameSync(this.at(temporary), this.at(name));
      if (durable) fs.fsyncSync(this.fd);
    } catch (error) {
      try {
        fs.unlinkSync(this.at(temporary));
      } catch {
        /* never created, or already renamed */
      }
      throw error;
    }
  }

  /**
   * `replace` in halves, for a writer that must not wait for the disk: the
   * temporary file, written now and left open for `flushInBackground`; then
   * `putInPlace` renames it over `name`, or `dropStaged` removes it.
   */
  stage(name: string, data: string | Uint8Array | Iterable<Uint8Array>): StagedFile {
    const temporary = `.${name}.${randomName()}.tmp`;
    const fd = this.createExclusive(temporary);
    try {
      writeAll(fd, data);
    } catch (error) {
      fs.closeSync(fd);
      this.dropStaged({ temporary, fd });
      throw error;
    }
    return { temporary, fd };
  }

  putInPlace(staged: StagedFile, name: string): void {
    fs.renameSync(this.at(staged.temporary), this.at(name));
  }

  dropStaged(staged: StagedFile): void {
    if (this.closed) return;
    try {
      fs.unlinkSync(this.at(staged.temporary));
    } catch {
      /* already gone */
    }
  }

  /** Flushes the directory (a rename in it) on the thread pool; the descriptor stays open until that is done. */
  async flushInBackground(): Promise<void> {
    this.flushing++;
    try {
      await flushInBackground(this.fd);
    } finally {
      if (--this.flushing === 0 && this.closeAfterFlush) this.close();
    }
  }
  private flushing = 0;
  private closeAfterFlush = false;

  /** Gives `from` the new name `to` unless `to` exists (link, then unlink: no overwrite). */
  renameNoReplace(from: string, to: string): void {
    fs.linkSync(this.at(from), this.at(to));
    fs.unlinkSync(this.at(from));
  }

  /**
   * Removes everything in the directory, then the directory itself if its
   * path still leads to it. Subdirectories (a command may make some) are
   * entered through descriptors opened with O_NOFOLLOW, so a link swapped in
   * mid-way is removed as a link, never followed.
   */
  remove(): void {
    this.empty();
    if (this.isStillAtPath()) {
      try {
        fs.rmdirSync(this.path);
      } catch {
        /* something new appeared in it; leave it */
      }
    }
    this.close();
  }

  /** The subdirectory `name`, held, unless it is a link or not a directory. */
  child(name: string): HeldDirectory | undefined {
    try {
      return new HeldDirectory(
        path.join(this.path, name),
        fs.openSync(this.at(name), O.O_RDONLY | O.O_DIRECTORY | O.O_NOFOLLOW),
      );
    } catch {
      return undefined;
    }
  }

  /**
   * The subdirectory `name` although aic may not read it (a command made it 0311 after putting a repository
   * inside: git finds a `.git` there by its name, which takes only search permission). One of aic's own user is
   * opened by giving its owner read and search for the moment of the open, its mode put back at once; another
   * user's, or a link, is undefined.
   */
  childDespiteMode(name: string): HeldDirectory | undefined {
    let pinned: number;
    try {
      pinned = fs.openSync(this.at(name), O_PATH | O.O_NOFOLLOW | O.O_DIRECTORY | O_CLOEXEC);
    } catch {
      return undefined;
    }
    try {
      const st = fs.fstatSync(pinned);
      if (!st.isDirectory() || st.uid !== process.getuid?.()) return undefined;
      const mode = st.mode & 0o7777;
      // Through the descriptor: the mode changes on the directory opened, never on a link swapped in by name.
      const self = `/proc/self/fd/${pinned}`;
      fs.chmodSync(self, mode | 0o500);
      try {
        return new HeldDirectory(path.join(this.path, name), fs.openSync(self, O.O_RDONLY | O.O_DIRECTORY));
      } finally {
        fs.chmodSync(self, mode);
      }
    } catch {
      return undefined;
    } finally {
      fs.closeSync(pinned);
    }
  }

  /**
   * `entries`, also of a directory of aic's own user that aic may not read (see childDespiteMode): its owner is
   * given read for the moment of the listing, its mode put back at once.
   */
  entriesDespiteMode(): fs.Dirent[] {
    try {
      return fs.readdirSync(this.at(), { withFileTypes: true });
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code !== "EACCES") return [];
    }
    try {
      const st = fs.fstatSync(this.fd);
      if (!st.isDirectory() || st.uid !== process.getuid?.()) return [];
      const mode = st.mode & 0o7777;
      fs.chmodSync(this.at(), mode | 0o500);
      try {
        return fs.readdirSync(this.at(), { withFileTypes: true });
      } finally {
        fs.chmodSync(this.at(), mode);
      }
    } catch {
      return [];
    }
  }

  /** What the held directory holds now (empty when it cannot be read). */
  entries(): fs.Dirent[] {
    try {
      return fs.readdirSync(this.at(), { withFileTypes: true });
    } catch {
      return [];
    }
  }

  private empty(): void {
    let names: string[];
    try {
      names = fs.readdirSync(this.at());
    } catch {
      return;
    }
    for (const name of names) {
      try {
        if (fs.lstatSync(this.at(name)).isDirectory()) {
          const child = new HeldDirectory(
            path.join(this.path, name),
            fs.openSync(this.at(name), O.O_RDONLY | O.O_DIRECTORY | O.O_NOFOLLOW),
          );
          child.empty();
          child.close();
          fs.rmdirSync(this.at(name));
        } else fs.unlinkSync(this.at(name));
      } catch {
        /* changed under us: leave it */
      }
    }
  }

  close(): void {
    if (this.closed) return;
    // A flush on the thread pool still needs the descriptor: it is closed when that is done.
    if (this.flushing > 0) return void (this.closeAfterFlush = true);
    this.closed = true;
    try {
      fs.closeSync(this.fd);
    } catch {
      /* already closed */
    }
  }
}

/** One checkpoint's document (its messages and steps stand in slots) and what tells whether the file holds it. */
interface SessionDocument {
  doc: Record<string, unknown>;
  steps: readonly CheckpointStep[];
  /** The messages, as SessionStore's `durable` compares them. */
  signature: unknown[];
  /** The messages are those of the last write made durable: a rename without fsync can do. */
  durableAlready: boolean;
  firstSinceLoad: boolean;
  /** All it holds but its label, time and step count. */
  content: unknown[];
}

/** A session write of SessionStore.saveSoon on its way to the disk. */
interface WriteOnItsWay {
  staged: StagedFile;
  /** SHA-256 of its bytes, recorded once it is in place. */
  hash: string;
  /** Its messages, as SessionStore's `durable` holds them once it is on disk. */
  signature: unknown[];
  /** Its fsync has started (the descriptor is closed when it is done). */
  flushing: boolean;
  /** A newer write took its place: its temporary file is removed, it is never renamed. */
  dropped: boolean;
  /** It is flushed (file, then directory); false when the write before it, flushed, holds the same messages. */
  durable: boolean;
  /** Resolved once it is renamed into place, dropped, or failed; `done` resolves it. */
  placed: Promise<void>;
  done: () => void;
  /** Its number among the writes put in place, once it is. */
  landing?: number;
}

/** A temporary file HeldDirectory.stage wrote, still open, not yet renamed into place. */
interface StagedFile {
  temporary: string;
  fd: number;
}

/** fsync on the thread pool: the event loop goes on while the disk takes the data. */
function flushInBackground(fd: number): Promise<void> {
  return new Promise((resolve, reject) => fs.fsync(fd, (error) => (error ? reject(error) : resolve())));
}

/** Pieces are handed to the kernel in batches of about this many bytes (and at most IOV_MAX pieces), never copied. */
const WRITE_BATCH_BYTES = 1 << 20;
const WRITE_BATCH_PIECES = 1024;

function writeAll(fd: number, data: string | Uint8Array | Iterable<Uint8Array>): void {
  if (typeof data === "string" || data instanceof Uint8Array) {
    let rest = typeof data === "string" ? Buffer.from(data) : data;
    while (rest.length) rest = rest.subarray(fs.writeSync(fd, rest));
    return;
  }
  let batch: Uint8Array[] = [];
  let size = 0;
  for (const piece of data) {
    batch.push(piece);
    size += piece.length;
    if (size >= WRITE_BATCH_BYTES || batch.length >= WRITE_BATCH_PIECES) {
      writevAll(fd, batch);
      batch = [];
      size = 0;
    }
  }
  if (batch.length) writevAll(fd, batch);
}

/** One writev after another until every byte of `pieces` is written. */
function writevAll(fd: number, pieces: Uint8Array[]): void {
  for (let first = 0; first < pieces.length;) {
    let written = fs.writevSync(fd, first ? pieces.slice(first) : pieces);
    while (first < pieces.length && written >= pieces[first]!.length) written -= pieces[first++]!.length;
    if (written) pieces[first] = pieces[first]!.subarray(written);
  }
}

/** Copies the first `length` bytes of `from` into `to`, a slice at a time. */
function copyOwnFd(from: number, to: number, length: number): void {
  const slice = Buffer.allocUnsafe(Math.max(1, Math.min(READ_SLICE_BYTES, length)));
  for (let at = 0; at < length;) {
    const n = fs.readSync(from, slice, 0, Math.min(slice.length, length - at), at);
    if (n === 0) throw new Error("it became shorter while aic read it");
    writeAll(to, slice.subarray(0, n));
    at += n;
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Session repairs
// Owns: turning whatever a crash or a person left in a session file into a
// history the API accepts, with every change reported in one line: entries
// that are not messages, unknown roles, content that is neither text nor
// parts, malformed tool calls, answers to nothing, calls never answered.
// ════════════════════════════════════════════════════════════════════════════

const VALID_ROLES = new Set(["system", "user", "assistant", "tool"]);

/** Content the API accepts: text, nothing, or a list of typed parts. Anything else is turned into text. */
function isSendableContent(content: unknown): boolean {
  if (content === null || content === undefined || typeof content === "string") return true;
  return (
    Array.isArray(content) &&
    content.every(
      (part) => typeof part === "object" && part !== null && typeof (part as { type?: unknown }).type === "string",
    )
  );
}

/**
 * Repairs a message list so the API accepts it and nothing is silently lost:
 * each repair is reported in one line.
 */
function repairMessages(raw: unknown[], systemPrompt: string): { messages: Message[]; reports: string[] } {
  const reports: string[] = [];
  let messages = onlyMessages(raw, reports);
  messages = withSendableContent(messages, reports);
  messages = withWellFormedCalls(messages, reports);
  if (messages[0]?.role !== "system") {
    messages.unshift({ role: "system", content: systemPrompt });
    reports.push("added the missing system prompt");
  }
  // A trailing assistant message without tool calls is the model's last answer: it stays, so a resumed model remembers its conclusion.
  return { messages: withAnswersAfterCalls(messages, reports), reports };
}

/** The entries that are messages (an object with a role) of a role the API knows. */
function onlyMessages(raw: unknown[], reports: string[]): Message[] {
  let messages = raw.filter(
    (m): m is Message =>
      typeof m === "object" && m !== null && !Array.isArray(m) && typeof (m as Message).role === "string",
  );
  if (messages.length < raw.length)
    reports.push(
      `dropped ${raw.length - messages.length} entr${raw.length - messages.length === 1 ? "y" : "ies"} that were not messages (no role)`,
    );
  const unknownRoles = messages.filter((m) => !VALID_ROLES.has(m.role));
  if (unknownRoles.length) {
    messages = messages.filter((m) => VALID_ROLES.has(m.role));
    reports.push(
      `dropped ${unknownRoles.length} message(s) with an unknown role (${[...new Set(unknownRoles.map((m) => JSON.stringify(m.role)))].join(", ")})`,
    );
  }
  return messages;
}

/** Content the API takes: text or a list of content parts; anything else becomes its JSON text. */
function withSendableContent(messages: Message[], reports: string[]): Message[] {
  let retyped = 0;
  const out = messages.map((m) => {
    if (isSendableContent(m.content)) return m;
    retyped++;
    return { ...m, content: typeof m.content === "string" ? m.content : JSON.stringify(m.content) };
  });
  if (retyped)
    reports.push(
      `turned the content of ${retyped} message(s) into text (it was neither text nor a list of content parts)`,
    );
  return out;
}

/** Tool calls with an id and a function name, their arguments as JSON text; the others dropped. */
function withWellFormedCalls(messages: Message[], reports: string[]): Message[] {
  let badCalls = 0;
  const out = messages.map((m) => {
    if (!("tool_calls" in m)) return m;
    const raw = m.tool_calls as unknown;
    const calls = (Array.isArray(raw) ? raw : []).filter(
      (c): c is ToolCall =>
        typeof c === "object" &&
        c !== null &&
        typeof (c as ToolCall).id === "string" &&
        typeof (c as ToolCall).function?.name === "string",
    );
    badCalls += (Array.isArray(raw) ? raw.length : raw === null || raw === undefined ? 0 : 1) - calls.length;
    const fixed: Message = { ...m };
    if (calls.length)
      fixed.tool_calls = calls.map((c) =>
        typeof c.function.arguments === "string"
          ? c
          : { ...c, function: { ...c.function, arguments: JSON.stringify(c.function.arguments ?? {}) } },
      );
    else delete fixed.tool_calls;
    return calls.length === (Array.isArray(raw) ? raw.length : -1) &&
      calls.every((c) => typeof c.function.arguments === "string")
      ? m
      : fixed;
  });
  if (badCalls)
    reports.push(`dropped ${badCalls} malformed tool call(s) (not an object with an id and a function name)`);
  return out;
}

/**
 * Tool answers right after the assistant call they answer: an answer to no
 * open call is dropped, a call left unanswered (aic ended while it ran) is
 * closed with the SESSION RECOVERED notice.
 */
function withAnswersAfterCalls(messages: Message[], reports: string[]): Message[] {
  const kept: Message[] = [];
  let open = new Set<string>();
  let orphans = 0;
  let recovered = 0;
  const closeOpenCalls = () => {
    for (const id of open) {
      kept.push({ role: "tool", tool_call_id: id, content: SESSION_RECOVERED_NOTICE });
      recovered++;
    }
    open = new Set();
  };
  for (const m of messages) {
    if (m.role === "tool") {
      if (typeof m.tool_call_id === "string" && open.has(m.tool_call_id)) {
        open.delete(m.tool_call_id);
        kept.push(m);
      } else orphans++;
      continue;
    }
    closeOpenCalls();
    kept.push(m);
    if (m.role === "assistant" && Array.isArray(m.tool_calls))
      open = new Set(m.tool_calls.map((c) => c?.id).filter((id): id is string => typeof id === "string"));
  }
  closeOpenCalls();
  if (orphans) reports.push(`dropped ${orphans} tool message(s) that answered no call`);
  if (recovered)
    reports.push(
      `closed ${recovered} unanswered tool call(s) with a ${SESSION_RECOVERED} notice (the command was not re-run)`,
    );
  return kept;
}

/** Decodes a session file's bytes; invalid UTF-8 and a byte-order mark are repairs to report. */
function decodeSessionText(bytes: Uint8Array, reports: string[]): string {
  let text: string;
  try {
    text = new TextDecoder("utf-8", { fatal: true }).decode(bytes);
  } catch {
    text = new TextDecoder("utf-8").decode(bytes);
    reports.push("replaced bytes that were not valid UTF-8 with U+FFFD");
  }
  if (text.startsWith("\uFEFF")) {
    reports.push("removed the byte-order mark at the start");
    text = text.slice(1);
  }
  return text;
}

const isJsonSpace = (b: number | undefined) => b === 0x20 || b === 0x0a || b === 0x0d || b === 0x09;
const MESSAGES_KEY = Buffer.from('"messages"');

/**
 * A session file parsed message by message as its slices are read, so that
 * neither the whole file nor a string of it is ever in memory: the bytes are
 * scanned for the `messages` list and the boundaries of its elements
 * (tracking strings, escapes and depth), each element is decoded and parsed
 * on its own as soon as it is complete (only a message with characters
 * beyond Latin-1 becomes UTF-16), and the slices behind it are let go. The
 * rest of the document is parsed at the end with an empty list in its place.
 * The outcome is what JSON.parse of the whole text gives; anything but the
 * plain shape aic writes (an object with one `messages` list, valid UTF-8,
 * no byte-order mark, valid JSON) gives undefined, and the file is then read
 * whole as before, so every repair is made and reported the same way.
 */
/**
 * Deeper than this, a session is refused as broken: nothing aic writes nests more than a few levels, and
 * the repairs that walk a message (50,000 levels in 100 KB) would overflow the stack.
 */
const MAX_SESSION_NESTING = 1000;

/** Whether JSON text nests `[` and `{` deeper than `limit` (strings skipped), without parsing it. */
function nestedDeeperThan(text: string, limit: number): boolean {
  let depth = 0;
  let inString = false;
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    if (inString) {
      if (c === 0x5c) i++;
      else if (c === 0x22) inString = false;
    } else if (c === 0x22) inString = true;
    else if (c === 0x7b || c === 0x5b) {
      if (++depth > limit) return true;
    } else if (c === 0x7d || c === 0x5d) depth--;
  }
  return false;
}

class SessionReader {
  /** The slices still needed (from `needed` on), and where the first of them starts in the file. */
  private slices: Buffer[] = [];
  private first = 0;
  private total = 0;
  private failed = false;
  private started = false;
  private depth = 0;
  private inString = false;
  /** The slice before ended inside a string with a backslash whose character had not come yet. */
  private escaped = false;
  private stringStart = 0;
  /** The last string read at depth 1: a key when a colon follows. */
  private key: [number, number] | undefined;
  private found = 0;
  private expectList = false;
  private listStart = -1;
  private listEnd = -1;
  private inList = false;
  private elementStart = 0;
  private head = "";
  private readonly messages: unknown[] = [];
  private readonly decoder = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true });
  private fresh = 0;

  push(slice: Buffer): void {
    if (this.failed) return;
    const base = this.total;
    this.slices.push(slice);
    this.total += slice.length;
    for (let i = 0; i < slice.length && !this.failed;) {
      if (this.inString) {
        const end = this.stringEnd(slice, i);
        if (end >= slice.length) break;
        this.inString = false;
        if (this.depth === 1) this.key = [this.stringStart, base + end + 1];
        i = end + 1;
        continue;
      }
      this.structure(slice[i]!, base + i);
      i++;
    }
    this.letGo();
    // The slice is read into again: what is still needed of it is kept as a copy.
    const needed = this.needed();
    if (this.failed || needed >= this.total) {
      this.slices = [];
      this.first = this.total;
    } else if (needed >= base) {
      this.slices = [Buffer.from(slice.subarray(needed - base))];
      this.first = needed;
    } else this.slices[this.slices.length - 1] = Buffer.from(slice);
    // A collection every few megabytes of messages keeps their short-lived texts off the peak. A full one:
    // a young-generation collection would promote the strings still in use at that moment, garbage soon
    // after, that only a full collection frees (measured: a tenth more resident memory at the end).
    if (this.fresh >= COLLECT_EVERY_BYTES / 2) {
      this.fresh = 0;
      Bun.gc(true);
    }
  }

  private needed(): number {
    return this.inList ? this.elementStart : this.listEnd >= 0 ? this.listEnd + 1 : 0;
  }

  /** Where the string being read ends in `slice` (its closing quote), or slice.length when it goes on. */
  private stringEnd(slice: Buffer, from: number): number {
    let at = from;
    if (this.escaped) {
      this.escaped = false;
      at++;
    }
    let quote = slice.indexOf(0x22, at);
    let backslash = slice.indexOf(0x5c, at);
    for (;;) {
      if (backslash < 0 || (quote >= 0 && quote < backslash)) return quote < 0 ? slice.length : quote;
      at = backslash + 2;
      if (at > slice.length) {
        this.escaped = true;
        return slice.length;
      }
      backslash = slice.indexOf(0x5c, at);
      if (quote >= 0 && quote < at) quote = slice.indexOf(0x22, at);
    }
  }

  private structure(b: number, at: number): void {
    if (isJsonSpace(b)) return;
    if (!this.started) {
      if (b !== 0x7b) return this.fail(); // not an object (a byte-order mark included)
      this.started = true;
    }
    if (this.expectList) {
      this.expectList = false;
      if (b !== 0x5b) return this.fail();
      this.listStart = at;
    }
    if (b === 0x22) {
      this.inString = true;
      this.stringStart = at;
    } else if (b === 0x7b || b === 0x5b) {
      if (++this.depth > MAX_SESSION_NESTING) return this.fail(); // read whole, and refused with the reason
      if (at === this.listStart) {
        try {
          this.head = this.text(0, at);
        } catch {
          return this.fail(); // not valid UTF-8
        }
        this.inList = true;
        this.elementStart = at + 1;
      }
    } else if (b === 0x7d || b === 0x5d) {
      this.depth--;
      if (this.depth < 0) return this.fail();
      if (this.inList && this.depth === 1) {
        if (b !== 0x5d) return this.fail();
        this.element(this.elementStart, at, true);
        this.inList = false;
        this.listEnd = at;
      }
    } else if (b === 0x2c) {
      if (this.inList && this.depth === 2) {
        this.element(this.elementStart, at, false);
        this.elementStart = at + 1;
      }
    } else if (b === 0x3a && this.depth === 1 && this.key) {
      // A key of the document. An escaped one could spell `messages` another way: the whole read decides.
      const key = this.bytes(this.key[0], this.key[1]);
      if (key.includes(0x5c)) return this.fail();
      if (key.equals(MESSAGES_KEY)) {
        if (++this.found > 1) return this.fail();
        this.expectList = true;
      }
    }
  }

  /** One element of the list, between `start` and `end` (separators excluded). */
  private element(start: number, end: number, last: boolean): void {
    const bytes = this.bytes(start, end);
    let from = 0;
    let to = bytes.length;
    while (from < to && isJsonSpace(bytes[from])) from++;
    while (to > from && isJsonSpace(bytes[to - 1])) to--;
    if (from === to && last && this.messages.length === 0 && start === this.listStart + 1) return; // []
    try {
      const text = this.decoder.decode(bytes.subarray(from, to));
      this.messages.push(JSON.parse(text));
      this.fresh += text.length;
    } catch {
      this.fail(); // not valid UTF-8 or not valid JSON: the whole read says what is wrong
    }
  }

  /** The file is not in the plain shape: what was read of it is dropped before it is read whole. */
  private fail(): void {
    this.failed = true;
    this.slices = [];
    this.messages.length = 0;
  }

  /** The bytes from `start` to `end`: a view when one slice holds them, else a copy. */
  private bytes(start: number, end: number): Buffer {
    const parts: Buffer[] = [];
    let at = this.first;
    for (const slice of this.slices) {
      const from = Math.max(start, at);
      const to = Math.min(end, at + slice.length);
      if (from < to) parts.push(slice.subarray(from - at, to - at));
      at += slice.length;
      if (at >= end) break;
    }
    return parts.length === 1 ? parts[0]! : Buffer.concat(parts);
  }

  private text(start: number, end: number): string {
    return this.decoder.decode(this.bytes(start, end));
  }

  /** Drops the slices that lie wholly before what is still needed. */
  private letGo(): void {
    const needed = this.needed();
    let drop = 0;
    while (drop < this.slices.length - 1 && this.first + this.slices[drop]!.length <= needed)
      this.first += this.slices[drop++]!.length;
    if (drop) this.slices = this.slices.slice(drop);
  }

  /** The parsed document, or undefined when the file must be read whole. */
  finish(): Record<string, unknown> | undefined {
    if (!this.failed && !this.inString && this.depth === 0 && this.found === 1 && this.listEnd >= 0)
      try {
        const doc = JSON.parse(`${this.head}[]${this.text(this.listEnd + 1, this.total)}`) as Record<string, unknown>;
        this.slices = [];
        doc.messages = this.messages;
        return doc;
      } catch {
        /* not valid JSON or not valid UTF-8 after the list */
      }
    this.fail();
    return undefined;
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Session file writing
// Owns: turning the session document into the bytes of the file, piece by
// piece (never one string of a whole long history), with each message's and
// each checkpoint step's bytes cached until it changes; and the --debug dump.
// ════════════════════════════════════════════════════════════════════════════

/** What JSON.stringify({ messages: [m] }, null, 2) puts around the message. */
const MESSAGE_PREFIX = '{\n  "messages": [\n';
const MESSAGE_SUFFIX = "\n  ]\n}";
const LIST_OPEN = Buffer.from("[\n");
const LIST_COMMA = Buffer.from(",\n");
const LIST_CLOSE = Buffer.from("\n  ]");
const EMPTY_LIST = Buffer.from("[]");
/** Stands in for the checkpoint steps (`checkpoints.done`) as MESSAGES_SLOT does for the messages. */
const STEPS_SLOT = "\u0000aic-checkpoint-steps\u0000";
const STEPS_KEY = `\n    "done": ${JSON.stringify(STEPS_SLOT)}`;
/** What JSON.stringify({ checkpoints: { done: [s] } }, null, 2) puts around the step. */
const STEP_PREFIX = '{\n  "checkpoints": {\n    "done": [\n';
const STEP_SUFFIX = "\n    ]\n  }\n}";
const STEPS_CLOSE = Buffer.from("\n    ]");
/** Bulk work on a long history asks for a garbage collection after about this many bytes of short-lived strings. */
const COLLECT_EVERY_BYTES = 8 << 20;

/**
 * The session document's bytes. Kept apart from the store because a long
 * history makes memory, not correctness, the hard part: what is cached, for
 * how long, and when garbage is collected is decided here.
 */
class SessionWriter {
  private readonly messageText = new WeakMap<Message, { content: unknown; calls: unknown; bytes: Buffer }>();
  private readonly stepText = new WeakMap<
    CheckpointStep,
    { commit: string; call: string; command: string; after: string | undefined; bytes: Buffer }
  >();
  /**
   * The messages load() restored, until the first checkpoint has written
   * them: that one stringifies them without caching their bytes, which for a
   * long session would keep a second copy of the file for the run (most of
   * it compressed away soon after). Later checkpoints cache them as usual.
   */
  restored: WeakSet<Message> | undefined;

  /**
   * The indented JSON of the document, as UTF-8 pieces made as they are
   * written: no string or buffer of the whole file is ever made (for a long
   * history that was three copies of it at once, as UTF-16). Each message's
   * bytes, and each checkpoint step's, are cached until it changes, so a
   * checkpoint costs only the new messages plus the write.
   */
  *pieces(
    doc: Record<string, unknown>,
    messages: readonly Message[],
    steps: readonly CheckpointStep[],
  ): Generator<Uint8Array> {
    const restored = this.restored;
    this.restored = undefined;
    const text = JSON.stringify(doc, null, 2) + "\n";
    const slot = JSON.stringify(MESSAGES_SLOT);
    const at = text.indexOf(slot);
    yield Buffer.from(text.slice(0, at));
    let fresh = 0;
    for (let i = 0; i < messages.length; i++) {
      const m = messages[i]!;
      const hit = this.messageText.get(m);
      let bytes: Buffer;
      if (hit && hit.content === m.content && hit.calls === m.tool_calls) bytes = hit.bytes;
      else {
        // Stringified where the file holds it (a message of `messages`), so the indentation comes out right.
        const whole = Buffer.from(JSON.stringify({ messages: [m] }, null, 2));
        bytes = whole.subarray(MESSAGE_PREFIX.length, whole.length - MESSAGE_SUFFIX.length);
        if (!restored?.has(m)) this.messageText.set(m, { content: m.content, calls: m.tool_calls, bytes });
        // Many new messages at once (the first checkpoint of a long resumed session) leave twice their
        // size in short-lived strings and buffers: a collection every few megabytes keeps that garbage from
        // piling onto the peak. A full one: the pieces waiting to be written survive a young-generation
        // collection, and a promoted buffer is only freed by a full one (measured: +40 MB on a 50 MB session).
        fresh += whole.length;
        if (fresh >= COLLECT_EVERY_BYTES) {
          fresh = 0;
          Bun.gc(true);
        }
      }
      yield i === 0 ? LIST_OPEN : LIST_COMMA;
      yield bytes;
    }
    yield messages.length ? LIST_CLOSE : EMPTY_LIST;
    const rest = at + slot.length;
    const stepsAt = steps.length ? text.indexOf(STEPS_KEY, rest) : -1;
    if (stepsAt < 0) {
      yield Buffer.from(text.slice(rest));
      return;
    }
    yield Buffer.from(text.slice(rest, stepsAt + STEPS_KEY.length - JSON.stringify(STEPS_SLOT).length));
    for (let i = 0; i < steps.length; i++) {
      const s = steps[i]!;
      let hit = this.stepText.get(s);
      if (
        !hit ||
        hit.commit !== s.commit ||
        hit.call !== s.call ||
        hit.command !== s.command ||
        hit.after !== s.after
      ) {
        const whole = Buffer.from(JSON.stringify({ checkpoints: { done: [s] } }, null, 2));
        const bytes = whole.subarray(STEP_PREFIX.length, whole.length - STEP_SUFFIX.length);
        hit = { commit: s.commit, call: s.call, command: s.command, after: s.after, bytes };
        this.stepText.set(s, hit);
      }
      yield i === 0 ? LIST_OPEN : LIST_COMMA;
      yield hit.bytes;
    }
    yield STEPS_CLOSE;
    yield Buffer.from(text.slice(stepsAt + STEPS_KEY.length));
  }
}

/** --debug: the history as it is about to be sent, for diagnosing prompts and compression. */
function writeDebugDump(dir: HeldDirectory, messages: readonly Message[], estimate: number, budget: number): void {
  const lines = [
    `time: ${new Date().toISOString()}`,
    `messages: ${messages.length}`,
    `estimated_tokens: ${estimate}`,
    `budget: ${budget}`,
    "",
  ];
  messages.forEach((m, i) => {
    lines.push(
      `--- [${i}] role=${m.role}${m.tool_call_id ? ` tool_call_id=${m.tool_call_id}` : ""} content_length=${contentText(m.content).length}`,
    );
    if (m.tool_calls?.length) lines.push(`tool_calls: ${JSON.stringify(m.tool_calls)}`);
    lines.push(contentText(m.content));
  });
  try {
    // Replaced, not opened: whatever a command planted under this name (a link, a FIFO) is swapped out, never written through.
    dir.replace("commander-debug.txt", lines.join("\n") + "\n", false);
  } catch {
    /* a debugging aid must never stop the run */
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Session store: ids, state and locks
// Owns: `.aicsession`, the hand-editable mirror of the conversation: claiming a
// file with a kernel flock (released when the process dies, so no lock goes
// stale), atomic writes, and repairing whatever a crash or a person left in it.
// It never deletes or overwrites a file it could not read: broken JSON is moved
// aside, a repaired file's original is kept beside it.
// ════════════════════════════════════════════════════════════════════════════

interface SessionState {
  messages: Message[];
  stepCount: number;
  usage: Usage;
  /** Where the agent works now (the start directory unless it followed the Shell tab). */
  cwd?: string;
  /** The background jobs this process started, and how each ended (stopped when aic exited, say). */
  jobs?: JobRecord[];
  /** The checkpoint taken before each command, and the undos that can be redone. */
  checkpoints?: CheckpointRecord;
}

interface LoadedSession extends Partial<SessionState> {
  sessionId?: string;
  reports: string[];
  /** The file could not be used (shown as a warning, not a status line). */
  failed?: boolean;
  /**
   * At start, the file is no session aic can read (`PATH:LINE:COL: why`): it stays as it is, nothing is
   * written, and no model is asked until the person fixes it (headless: exit 2; the TUI: /reload).
   */
  broken?: string;
}

/**
 * Where `text` stops being JSON, as "line L, column C", for a person fixing a
 * hand-edited session (the parser's own message names no place). A small
 * scanner of the grammar, run only after JSON.parse has refused the text.
 */
function jsonErrorPlace(text: string): { line: number; column: number } | undefined {
  let i = 0;
  const ws = () => {
    while (i < text.length && " \t\n\r".includes(text[i]!)) i++;
  };
  const fail = (): never => {
    throw i;
  };
  const literal = (word: string) => (text.startsWith(word, i) ? void (i += word.length) : fail());
  const string = () => {
    i++;
    while (i < text.length && text[i] !== '"') {
      if (text.charCodeAt(i) < 0x20) fail();
      if (text[i] === "\\") {
        i++;
        if (text[i] === "u") {
          if (!/^[0-9a-fA-F]{4}$/.test(text.slice(i + 1, i + 5))) fail();
          i += 4;
        } else if (!'"\\/bfnrt'.includes(text[i] ?? "x")) fail();
      }
      i++;
    }
    if (i >= text.length) fail();
    i++;
  };
  const value = (): void => {
    ws();
    const c = text[i];
    if (c === "{" || c === "[") return container(c === "{" ? "}" : "]");
    if (c === '"') return string();
    if (c === "t") return literal("true");
    if (c === "f") return literal("false");
    if (c === "n") return literal("null");
    const m = /^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/.exec(text.slice(i, i + 400));
    if (!m) fail();
    i += m![0].length;
  };
  const container = (close: string) => {
    i++;
    ws();
    if (text[i] === close) return void i++;
    for (;;) {
      if (close === "}") {
        ws();
        if (text[i] !== '"') fail();
        string();
        ws();
        if (text[i] !== ":") fail();
        i++;
      }
      value();
      ws();
      if (text[i] === close) return void i++;
      if (text[i] !== ",") fail();
      i++;
    }
  };
  try {
    value();
    ws();
    if (i < text.length) fail();
    return undefined;
  } catch (at) {
    if (typeof at !== "number") throw at;
    const before = text.slice(0, at);
    return { line: before.split("\n").length, column: at - before.lastIndexOf("\n") };
  }
}

/** How a session file that is no session aic can read is named at start: `PATH:LINE:COL: why — fix it…`. */
function brokenSessionLine(file: string, place: { line: number; column: number } | undefined, why: string): string {
  return `${file}:${place ? `${place.line}:${place.column}` : "1:1"}: ${why} — fix it and run aic again (or --no-session)`;
}

/** The broken-session line for `text` that does not parse as JSON, with the parser's own words; undefined when it parses. */
function unparsedSessionLine(file: string, text: string): string | undefined {
  try {
    JSON.parse(text);
    return undefined;
  } catch (error) {
    const message = (error as Error).message.replace(/^JSON Parse error: /, "");
    return brokenSessionLine(file, jsonErrorPlace(text), `it is not valid JSON (${message})`);
  }
}

const emptyUsage = (): Usage => ({ input_tokens: 0, output_tokens: 0, cached_tokens: 0, billable_tokens: 0 });

function newSessionId(now = new Date()): string {
  const p = (n: number) => String(n).padStart(2, "0");
  return `${now.getFullYear()}${p(now.getMonth() + 1)}${p(now.getDate())}_${p(now.getHours())}${p(now.getMinutes())}${p(now.getSeconds())}`;
}

function localIsoSeconds(now = new Date()): string {
  const p = (n: number) => String(n).padStart(2, "0");
  return `${now.getFullYear()}-${p(now.getMonth() + 1)}-${p(now.getDate())}T${p(now.getHours())}:${p(now.getMinutes())}:${p(now.getSeconds())}`;
}

const LOCK_EX = 2;
const LOCK_NB = 4;
const SESSION_VERSION = 1;
const MAX_SESSION_INSTANCES = 1000;

/** Document keys aic writes itself; any other key a person added is kept on rewrite. */
const SESSION_KEYS = new Set([
  "aic_session_version",
  "session_id",
  "updated_at",
  "reason",
  "model",
  "api_base",
  "cwd",
  "instance_number",
  "step_count",
  "usage",
  "messages",
  "output_dir",
  "jobs",
  "checkpoints",
]);

/** Stands in for the message list while the rest of the document is stringified. */
const MESSAGES_SLOT = "\u0000aic-messages\u0000";

/**
 * aic's state directory, `$XDG_STATE_HOME/aic` (`~/.local/state/aic`):
 * checkpoint stores, session locks, saved outputs. Out of commands' reach
 * (the jail covers it; Landlock alone grants no read there).
 */
function aicStateDir(): string | undefined {
  const state = process.env.XDG_STATE_HOME;
  const home = homeDirectory();
  const base = state && path.isAbsolute(state) ? state : home ? path.join(home, ".local", "state") : undefined;
  return base && path.join(base, "aic");
}

/**
 * A lock file for the session file `file` in aic's state directory
 * (`$XDG_STATE_HOME/aic/locks/<hash of its path>`), open; undefined where
 * that directory cannot be made (a read-only home): the lock beside the
 * session file is then all there is.
 */
function stateLockFor(file: string): number | undefined {
  const lock = sessionStateFile(file, "lock");
  if (!lock) return undefined;
  try {
    fs.mkdirSync(path.dirname(lock), { recursive: true, mode: 0o700 });
    return openRegular(lock, O.O_WRONLY | O.O_CREAT | O.O_APPEND);
  } catch {
    return undefined;
  }
}

/**
 * What aic last wrote to the session file `file`, as the next aic reads it:
 * the file's identity (a later change shows at once) and the SHA-256 of the
 * bytes (a change that raced aic's own stat of its write shows too).
 */
interface WrittenRecord {
  identity: string;
  hash: string;
}

/** The record of aic's last write of `file`, or undefined when there is none (or it cannot be read). */
function readWrittenRecord(file: string): WrittenRecord | undefined {
  const at = sessionStateFile(file, "written");
  try {
    const [identity = "", hash = ""] = at ? readOwnFile(at, 4096).toString("utf8").split("\n") : [];
    return identity ? { identity, hash } : undefined;
  } catch {
    return undefined;
  }
}

/** A file of aic's about the session file `file`, in its state directory: `locks/<hash of its path>.<kind>`. */
function sessionStateFile(file: string, kind: "lock" | "written"): string | undefined {
  const state = aicStateDir();
  const hash = createHash("sha256").update(path.resolve(file)).digest("hex").slice(0, 24);
  return state && path.join(state, "locks", `${hash}.${kind}`);
}

// ════════════════════════════════════════════════════════════════════════════
// Session store
// Owns: one claimed session file: claiming it (the first free instance, locked
// in aic's state directory), loading and repairing it, and what each named
// moment's checkpoint holds (the next section puts it on disk).
// ════════════════════════════════════════════════════════════════════════════

/**
 * One claimed session file and its checkpoints. The file sits where commands
 * can write, so it is reached through its held directory: read only if it is
 * a regular file, replaced by an atomic rename, never written through a link.
 */
class SessionStore {
  sessionId = newSessionId();
  /** The directory of saved full outputs that this conversation names. */
  outputDir: string | undefined;
  private extra: Record<string, unknown> = {};
  /** Set when the file could not be read, moved aside or understood: then it is never written over. */
  private frozen = false;
  /** The size of the file load() read (0 before, or when there was none). */
  loadedBytes = 0;
  private readonly writer = new SessionWriter();
  private readonly writes: SessionWrites;

  private constructor(
    private readonly dir: HeldDirectory,
    private readonly name: string,
    readonly instanceNumber: number,
    private readonly lockFd: number | undefined,
    private meta: { model: string; apiBase: string },
    sink: EventSink,
    /** The file as opened and read through while claiming it (undefined: there was none). */
    private claimedFd: number | undefined,
  ) {
    this.writes = new SessionWrites(dir, name, lockFd, sink, () => this.mayWrite());
  }

  get path(): string {
    return this.dir.display(this.name);
  }

  /**
   * Claims `base`, or `base2`, `base3`, … when another live process holds it,
   * or when it cannot be read (a file aic could not read is never replaced).
   * The lock lives in a sidecar `.lock` file because the data file is replaced on every write.
   */
  /**
   * `exact`: only `base` itself will do (`aic undo` edits that very file):
   * if a running aic holds it, that is an error instead of a move to the next.
   */
  static claim(base: string, meta: { model: string; apiBase: string }, sink: EventSink, exact = false): SessionStore {
    const absolute = path.resolve(base);
    const dir = HeldDirectory.open(path.dirname(absolute));
    const name = path.basename(absolute);
    const flock = libc()?.symbols.flock;
    if (!flock)
      sink.emit({
        type: "warning",
        text: "cannot lock the session file on this platform; another aic here could share it",
      });
    const skipped: string[] = [];
    let pendingStateLock: number | undefined;
    for (let n = 1; n < MAX_SESSION_INSTANCES; n++) {
      const candidate = n === 1 ? name : `${name}${n}`;
      let lockFd: number | undefined;
      pendingStateLock = undefined;
      if (flock) {
        try {
          lockFd = dir.open(`${candidate}.lock`, O.O_WRONLY | O.O_CREAT | O.O_APPEND);
        } catch (error) {
          const e = ownFileError(error);
          // Something planted in the lock's place is refused; a directory aic may not write in only costs the lock.
          if (e.problem === "type") {
            skipped.push(`cannot use the lock file ${candidate}.lock (${e.message})`);
            continue;
          }
          sink.emit({
            type: "warning",
            text: `cannot create the session lock ${dir.display(`${candidate}.lock`)} (${e.message}); continuing without a lock`,
          });
        }
        // The lock that decides lives in aic's state directory, where no command reaches: a command that deleted
        // the lock file beside the session cannot make two aic processes take the same file.
        const stateLock = stateLockFor(dir.display(candidate));
        if (
          (lockFd !== undefined && flock(lockFd, LOCK_EX | LOCK_NB) !== 0) ||
          (stateLock !== undefined && flock(stateLock, LOCK_EX | LOCK_NB) !== 0)
        ) {
          if (lockFd !== undefined) fs.closeSync(lockFd);
          if (stateLock !== undefined) fs.closeSync(stateLock);
          if (exact) {
            dir.close();
            throw new Error(`${absolute} is in use by a running aic: undo there (/undo in its TUI), or stop it first`);
          }
          skipped.push(`another aic is using ${candidate} in this directory`);
          continue;
        }
        pendingStateLock = stateLock;
      }
      // Read through to know it can be read (a long session is read again, as it is parsed, by load()).
      let fd: number | undefined;
      try {
        fd = dir.open(candidate, O.O_RDONLY);
        readOwnFdInSlices(fd, () => {}, true);
      } catch (error) {
        if (fd !== undefined) fs.closeSync(fd);
        fd = undefined;
        const e = ownFileError(error);
        if (!e.missing) {
          if (lockFd !== undefined) fs.closeSync(lockFd);
          skipped.push(`cannot read ${candidate} (${e.message}), so it is left untouched`);
          continue;
        }
      }
      if (skipped.length)
        sink.emit({
          type: "warning",
          text: `${skipped.join("; ")}; this instance uses ${candidate} instead (instance ${n})`,
        });
      const store = new SessionStore(dir, candidate, n, lockFd, meta, sink, fd);
      store.stateLockFd = pendingStateLock;
      return store;
    }
    dir.close();
    throw new Error(`could not claim any session file next to ${absolute}`);
  }

  /**
   * Reads the claimed file. Never throws for bad content. A file that cannot
   * be used stays where it is, untouched: at start nothing runs until it is
   * fixed (`broken`); on /reload (`reloading`) the conversation in memory
   * stays too.
   */
  load(systemPrompt?: string, reloading = false): LoadedSession {
    let fd = this.claimedFd;
    this.claimedFd = undefined;
    try {
      fd ??= this.dir.open(this.name, O.O_RDONLY);
    } catch (error) {
      return this.unreadable(error);
    }
    try {
      const loaded = this.loadFrom(fd, systemPrompt, reloading);
      if (!loaded.failed) this.reloadRefused = this.brokenAtStart = false;
      const changed = this.changedSinceWritten();
      return changed ? { ...loaded, reports: [changed, ...loaded.reports] } : loaded;
    } finally {
      fs.closeSync(fd);
    }
  }

  private unreadable(error: unknown): LoadedSession {
    const e = ownFileError(error);
    if (e.missing) return { reports: [`no session yet; this conversation will persist to ${this.path}`] };
    this.frozen = true;
    return {
      reports: [`cannot read ${this.path} (${e.message}); starting clean without saving, so the file stays untouched`],
    };
  }

  private loadFrom(fd: number, systemPrompt: string | undefined, reloading: boolean): LoadedSession {
    const reader = new SessionReader();
    let parsed: unknown;
    /** The whole file, read only when it is not in the plain shape the reader takes. */
    let bytes: Buffer | undefined;
    const reports: string[] = [];
    try {
      this.loadedBytes = readOwnFdInSlices(fd, (slice) => reader.push(slice), true);
      parsed = reader.finish();
      if (parsed === undefined) {
        bytes = readOwnFd(fd);
        this.loadedBytes = bytes.length;
      }
    } catch (error) {
      return this.unreadable(error);
    }
    if (bytes) {
      const text = decodeSessionText(bytes, reports);
      if (nestedDeeperThan(text, MAX_SESSION_NESTING)) {
        const why = `it nests lists or objects deeper than ${MAX_SESSION_NESTING.toLocaleString("en-US")} levels`;
        return reloading ? this.keepAsItIs(why) : this.keepBroken(brokenSessionLine(this.path, undefined, why));
      }
      try {
        parsed = JSON.parse(text);
      } catch (error) {
        const place = jsonErrorPlace(text);
        const message = (error as Error).message.replace(/^JSON Parse error: /, "");
        const why = `it is not valid JSON${place ? ` at line ${place.line}, column ${place.column}` : ""} (${message})`;
        if (reloading) return this.keepAsItIs(why);
        return this.keepBroken(brokenSessionLine(this.path, place, `it is not valid JSON (${message})`));
      }
    }
    let rawMessages: unknown;
    if (Array.isArray(parsed)) rawMessages = parsed;
    else if (parsed && typeof parsed === "object") rawMessages = (parsed as Record<string, unknown>).messages;
    if (!Array.isArray(rawMessages))
      return reloading
        ? this.keepAsItIs("it has no `messages` list")
        : this.keepBroken(
            brokenSessionLine(this.path, undefined, "it is JSON, but no session (it has no `messages` list)"),
          );
    const doc = Array.isArray(parsed) ? {} : (parsed as Record<string, unknown>);
    const version = doc.aic_session_version;
    if (typeof version === "number" && version > SESSION_VERSION) {
      this.frozen = true;
      return {
        reports: [
          `${this.path} was written by a newer aic (session format ${version}; this aic knows ${SESSION_VERSION}); it is left untouched and this run saves nothing`,
        ],
      };
    }
    if (version !== undefined && version !== SESSION_VERSION)
      reports.push(`read the unknown aic_session_version ${JSON.stringify(version)} as ${SESSION_VERSION}`);
    const repaired = repairMessages(rawMessages, systemPrompt ?? "");
    reports.push(...repaired.reports);
    const messages = repaired.messages;
    const storedPrompt = splitSummary(contentText(messages[0]?.content)).base;
    if (
      systemPrompt !== undefined &&
      !repaired.reports.includes("added the missing system prompt") &&
      storedPrompt !== systemPrompt
    )
      reports.push(
        "the system prompt in the file differs from this run's (edited by hand, or written by another aic version or with other options); this run uses its own and keeps the conversation summary",
      );
    this.extra = Object.fromEntries(Object.entries(doc).filter(([k]) => !SESSION_KEYS.has(k)));
    if (typeof doc.session_id === "string" && doc.session_id) this.sessionId = doc.session_id;
    if (typeof doc.output_dir === "string") this.outputDir = doc.output_dir;
    const usage = emptyUsage();
    const storedUsage = (doc.usage ?? {}) as Record<string, unknown>;
    for (const key of ["input_tokens", "output_tokens", "cached_tokens", "billable_tokens"] as const)
      if (typeof storedUsage[key] === "number") usage[key] = storedUsage[key] as number;
    if (storedUsage.estimated === true) usage.estimated = true;
    const stepCount = typeof doc.step_count === "number" && doc.step_count >= 0 ? Math.floor(doc.step_count) : 0;
    if (reports.length) reports.push(this.keepOriginal(bytes ?? fd));
    reports.push(
      `Restored ${messages.length - 1} message(s) from ${this.path} (session ${this.sessionId}, step ${stepCount})`,
    );
    const checkpoints = checkpointRecordFrom(doc.checkpoints, reports);
    // A store claimed without knowing the run (aic undo) keeps the model and endpoint the file names.
    if (!this.meta.model && typeof doc.model === "string")
      this.meta = { model: doc.model, apiBase: typeof doc.api_base === "string" ? doc.api_base : "" };
    const jobs = Array.isArray(doc.jobs) ? (doc.jobs as JobRecord[]) : undefined;
    this.writer.restored = new WeakSet(messages);
    return { messages, stepCount, usage, sessionId: this.sessionId, reports, checkpoints, jobs };
  }

  /**
   * Before a repaired file replaces the one a person may have edited by
   * hand, the original is kept beside it, so a mistyped entry is never lost.
   */
  private keepOriginal(original: Buffer | number): string {
    for (let n = 1; n < MAX_SESSION_INSTANCES; n++) {
      const name = `${this.name}.orig.${newSessionId()}${n > 1 ? `-${n}` : ""}`;
      let fd: number;
      try {
        fd = this.dir.createExclusive(name);
      } catch (error) {
        if ((error as NodeJS.ErrnoException).code === "EEXIST") continue;
        this.frozen = true;
        return `could not keep the original beside it (${ownFileError(error).message}), so this run does not write over it`;
      }
      try {
        if (typeof original === "number") copyOwnFd(original, fd, this.loadedBytes);
        else writeAll(fd, original);
        fs.fsyncSync(fd);
      } finally {
        fs.closeSync(fd);
      }
      return `kept the file as it was before these changes in ${this.dir.display(name)}`;
    }
    this.frozen = true;
    return "could not keep the original beside it, so this run does not write over it";
  }

  /** /reload found the file unusable: it is left as it is and not written over until a /reload succeeds. */
  private keepAsItIs(why: string): LoadedSession {
    this.reloadRefused = true;
    return {
      failed: true,
      reports: [
        `${this.path} could not be loaded: ${why}. The conversation on screen is kept, and aic will not write the file until it loads: fix it and /reload again`,
      ],
    };
  }
  private reloadRefused = false;

  /** At start, a file aic cannot read as a session: left exactly as it is, and not written until a /reload loads it. */
  private keepBroken(broken: string): LoadedSession {
    this.reloadRefused = true;
    this.brokenAtStart = true;
    return { failed: true, broken, reports: [`${broken}; in the TUI, fix it and type /reload`] };
  }

  /** Whether the file could not be read at start, and no /reload has loaded it since: no task runs on it. */
  get waitsForReload(): boolean {
    return this.brokenAtStart;
  }
  private brokenAtStart = false;

  /**
   * Writes one checkpoint atomically, waiting for the disk; a failure is
   * reported once and the run goes on. Writes still on their way from
   * `saveSoon` are older: they are dropped, never put in place after this one.
   */
  save(reason: string, state: SessionState, ifChanged = false): boolean {
    if (!this.mayWrite()) return false;
    const doc = this.document(reason, state);
    if (ifChanged && this.holds(doc.content)) return true;
    return this.put(doc, state, "now");
  }

  /** The same checkpoint without waiting for the disk (SessionWrites.writeSoon says how). */
  saveSoon(reason: string, state: SessionState): boolean {
    if (!this.mayWrite()) return false;
    return this.put(this.document(reason, state), state, "soon");
  }

  private put(doc: SessionDocument, state: SessionState, when: "now" | "soon"): boolean {
    const pieces = this.writer.pieces(doc.doc, state.messages, doc.steps);
    try {
      const written = when === "now" ? this.writes.writeNow(pieces, doc) : this.writes.writeSoon(pieces, doc);
      if (written) this.lastContent = doc.content;
      return written;
    } finally {
      // A long restored history has just been written out: its short-lived strings are collected now,
      // before the run allocates more (the tokenizer, a compression), so that they do not add to the peak.
      if (doc.firstSinceLoad && this.loadedBytes >= COLLECT_EVERY_BYTES) Bun.gc(true);
    }
  }

  /** False while the file must not be written: it could not be read, or a /reload refused it. */
  private mayWrite(): boolean {
    return !this.frozen && !this.reloadRefused;
  }

  /** Resolves when every checkpoint written so far is on disk, its rename too (or failed, which was said). */
  settled(): Promise<void> {
    return this.writes.settled();
  }

  /** Resolves when every checkpoint written so far is in place (a kill -9 from then on finds it). */
  inPlace(): Promise<void> {
    return this.writes.inPlace();
  }

  /** The document of one checkpoint, and what tells whether the file already holds it. */
  private document(reason: string, state: SessionState): SessionDocument {
    const doc: Record<string, unknown> = {
      aic_session_version: SESSION_VERSION,
      session_id: this.sessionId,
      updated_at: localIsoSeconds(),
      reason,
      model: this.meta.model,
      api_base: this.meta.apiBase,
      cwd: state.cwd ?? process.cwd(),
      instance_number: this.instanceNumber,
      step_count: state.stepCount,
      usage: state.usage,
      messages: MESSAGES_SLOT,
    };
    if (this.outputDir) doc.output_dir = this.outputDir;
    if (state.jobs) doc.jobs = state.jobs;
    const firstSinceLoad = this.writer.restored !== undefined;
    // The steps (up to CHECKPOINTS_KEPT of them) are written from cached bytes, as the messages are.
    const steps = state.checkpoints?.done.length ? state.checkpoints.done : [];
    if (state.checkpoints)
      doc.checkpoints = steps.length ? { ...state.checkpoints, done: STEPS_SLOT } : state.checkpoints;
    for (const [key, value] of Object.entries(this.extra)) if (!(key in doc)) doc[key] = value;
    // fsync is most of a checkpoint's cost. When the messages are the ones already made durable
    // (before_command right after assistant_message, say), losing this write to a power cut loses
    // only its label: the rename stays atomic, the fsync is skipped.
    const last = state.messages[state.messages.length - 1];
    const signature = [state.messages, state.messages.length, last, state.messages[0]?.content];
    const durableAlready = this.writes.holdsDurably(signature);
    // What the file would hold besides its label, the time and the step count (see save's ifChanged).
    const record = state.checkpoints;
    const content = [
      ...signature,
      last?.content,
      last?.tool_calls,
      JSON.stringify([
        state.usage,
        state.jobs,
        doc.cwd,
        this.sessionId,
        this.outputDir,
        record && [record.directory, record.done.length, record.done.at(-1), record.redo.length],
      ]),
    ];
    return { doc, steps, signature, durableAlready, firstSinceLoad, content };
  }

  /** What the last checkpoint written holds besides its label (document()'s `content`). */
  private lastContent: unknown[] | undefined;

  /** Whether the last checkpoint written holds `content`: then one more would change only its label and step count. */
  private holds(content: unknown[]): boolean {
    return this.lastContent !== undefined && content.every((v, i) => v === this.lastContent![i]);
  }

  /** Said at load: the file is not what aic last wrote (a person's edit, or a command's while no aic ran). */
  private changedSinceWritten(): string | undefined {
    const last = readWrittenRecord(this.path)?.identity;
    const now = this.writes.identityOnDisk();
    if (!last || now === undefined || now === last) return undefined;
    return `${this.path} changed since aic last wrote it: by you, or by a command while aic was not running; if you did not edit it, read it before you go on`;
  }

  /** The session's lock in aic's state directory (see stateLockFor). */
  stateLockFd: number | undefined;
  /** What /session shows: the file, its id and instance, and what the file on disk holds now. */
  describe(): string[] {
    let onDisk = "nothing yet";
    try {
      const doc = JSON.parse(this.dir.read(this.name).toString("utf8")) as {
        reason?: unknown;
        updated_at?: unknown;
        messages?: unknown;
        step_count?: unknown;
      };
      const count = Array.isArray(doc.messages) ? doc.messages.length : 0;
      onDisk = `${count} message(s), step ${String(doc.step_count ?? 0)}, last written ${String(doc.updated_at ?? "?")} (${String(doc.reason ?? "?")})`;
    } catch (error) {
      if (!ownFileError(error).missing) onDisk = `unreadable (${(error as Error).message})`;
    }
    return [`file ${this.path} · id ${this.sessionId} · instance ${this.instanceNumber}`, `on disk: ${onDisk}`];
  }

  /** Starts a new session id (after /clear). */
  renew(): void {
    this.sessionId = newSessionId();
    this.outputDir = undefined;
  }

  release(): void {
    // Every caller has written its last checkpoint with save(), which dropped what was on its way already.
    this.writes.release();
    if (this.claimedFd !== undefined) fs.closeSync(this.claimedFd);
    this.claimedFd = undefined;
    for (const fd of this.stateLockFd !== undefined ? [this.stateLockFd] : [])
      try {
        fs.closeSync(fd);
      } catch {
        /* already closed */
      }
    if (this.lockFd !== undefined)
      try {
        fs.closeSync(this.lockFd);
      } catch {
        /* already closed */
      }
    this.dir.close();
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Session store: putting the file on disk
// Owns: how a claimed session file reaches the disk: replaced atomically while
// aic waits, or staged now and flushed on the thread pool, one write at a time
// and in order (a newer write drops one still waiting); the record of what aic
// last wrote, for the next start; and noticing a command that changed, deleted
// or linked the file or its lock.
// ════════════════════════════════════════════════════════════════════════════

/**
 * The writes of one claimed session file. SessionStore decides what the file
 * holds and when; this decides how it gets there, so that a crash at any
 * moment leaves one whole document, the newest one put in place.
 */
class SessionWrites {
  /** What the last fsynced write held: the message list, its length, its last message and the system text. */
  private durable: unknown[] | undefined;
  private failureReported = false;

  constructor(
    private readonly dir: HeldDirectory,
    private readonly name: string,
    private readonly lockFd: number | undefined,
    private readonly sink: EventSink,
    /** False while the file must not be written (SessionStore's own reasons). */
    private readonly mayWrite: () => boolean,
  ) {}

  private get path(): string {
    return this.dir.display(this.name);
  }

  /** Whether `signature` names the messages of the last write made durable (a rename without fsync can do). */
  holdsDurably(signature: unknown[]): boolean {
    return this.durable !== undefined && signature.every((v, i) => v === this.durable![i]);
  }

  /**
   * Replaces the file atomically (temporary file, fsync, rename, fsync of the
   * directory) with `pieces`, waiting for the disk; older writes still on
   * their way are dropped. A failure is reported once; returns whether it landed.
   */
  writeNow(pieces: Iterable<Uint8Array>, doc: SessionDocument): boolean {
    for (const w of [...this.onTheirWay]) this.drop(w);
    try {
      this.noticePlantedLink();
      this.noticeTampering();
      const digest = createHash("sha256");
      this.dir.replace(this.name, hashedAsWritten(pieces, digest), !doc.durableAlready);
      this.landed(digest.digest("hex"));
      if (!doc.durableAlready) this.durable = doc.signature;
      return true;
    } catch (error) {
      this.reportFailure(error);
      return false;
    }
  }

  /**
   * `pieces` put in place without waiting for the disk: the temporary file is
   * written now (the bytes are the kernel's, whatever the conversation does
   * next), flushed on the thread pool, renamed into place as soon as it is on
   * disk, and the directory flushed after it. Writes leave in order, one on
   * the disk at a time; one still waiting for its turn when a newer one comes
   * is dropped (the newer holds all it held). `settled()` resolves when every
   * write so far is on disk.
   */
  writeSoon(pieces: Iterable<Uint8Array>, doc: SessionDocument): boolean {
    // Messages already on disk: a rename without fsync, at once, as writeNow does (a power cut could cost the label).
    if (doc.durableAlready && this.onTheirWay.length === 0 && !this.inFlight) return this.writeNow(pieces, doc);
    // Messages on their way to the disk in the write being flushed, and nothing else waiting: this one (the
    // checkpoint before a command, right after its turn) is renamed after that one without a flush of its own.
    const inFlight = this.inFlight;
    const light =
      inFlight !== undefined &&
      !inFlight.dropped &&
      this.onTheirWay.every((w) => w === inFlight) &&
      doc.signature.every((v, i) => v === inFlight.signature[i]);
    let staged: StagedFile;
    const digest = createHash("sha256");
    try {
      staged = this.dir.stage(this.name, hashedAsWritten(pieces, digest));
    } catch (error) {
      this.reportFailure(error);
      return false;
    }
    for (const w of this.onTheirWay.filter((x) => !x.flushing)) this.drop(w);
    let placed!: () => void;
    const write: WriteOnItsWay = {
      staged,
      hash: digest.digest("hex"),
      signature: doc.signature,
      flushing: false,
      dropped: false,
      durable: !light,
      placed: new Promise<void>((resolve) => (placed = resolve)),
      done: () => placed(),
    };
    this.onTheirWay.push(write);
    this.queue = this.queue.then(() => this.putOnDisk(write));
    return true;
  }

  /** Resolves when every checkpoint written so far is on disk, its rename too (or failed, which was said). */
  settled(): Promise<void> {
    return this.queue;
  }

  /**
   * Resolves when every checkpoint written so far is in place (renamed: a
   * kill -9 from then on finds it), before its directory's flush is done.
   */
  async inPlace(): Promise<void> {
    while (this.onTheirWay.length) await Promise.all(this.onTheirWay.map((w) => w.placed));
  }

  /** One write of saveSoon: flushed, renamed into place, the directory flushed; never throws. */
  private async putOnDisk(w: WriteOnItsWay): Promise<void> {
    this.inFlight = w;
    try {
      await this.flushAndPlace(w);
      if (w.landing === undefined || !w.durable) return;
      // A newer write already waiting (with its own flush) flushes the directory for both renames.
      if (this.onTheirWay.some((x) => x.durable)) return;
      await this.dir.flushInBackground();
      // Unless a newer write landed while the directory was flushed: `durable` is that one's then.
      if (w.landing === this.landings) this.durable = w.signature;
    } catch (error) {
      // The queue must never reject: every write after this one would be lost with it.
      this.reportFailure(error);
    } finally {
      w.done();
      if (this.inFlight === w) this.inFlight = undefined;
    }
  }
  /** The write of saveSoon being flushed, from its file's flush to its directory's. */
  private inFlight: WriteOnItsWay | undefined;

  private async flushAndPlace(w: WriteOnItsWay): Promise<void> {
    if (w.dropped) return;
    w.flushing = true;
    let flushed: unknown;
    try {
      if (w.durable) await flushInBackground(w.staged.fd);
    } catch (error) {
      flushed = error;
    }
    fs.closeSync(w.staged.fd);
    // A newer write that waited for the disk (save) took its place meanwhile: this one is gone already.
    if (w.dropped) return;
    // A /reload that could not read the file meanwhile: it is not written until one can.
    if (!this.mayWrite()) return this.drop(w);
    this.onTheirWay = this.onTheirWay.filter((x) => x !== w);
    try {
      if (flushed) throw flushed;
      this.noticePlantedLink();
      this.noticeTampering();
      this.dir.putInPlace(w.staged, this.name);
    } catch (error) {
      this.dir.dropStaged(w.staged);
      return this.reportFailure(error);
    }
    w.landing = this.landed(w.hash);
    w.done();
  }

  /** A write of saveSoon that will not be put in place: its temporary file goes (its descriptor once its flush is done). */
  private drop(w: WriteOnItsWay): void {
    w.dropped = true;
    w.done();
    this.onTheirWay = this.onTheirWay.filter((x) => x !== w);
    if (!w.flushing) fs.closeSync(w.staged.fd);
    this.dir.dropStaged(w.staged);
  }

  /** A write is in place: what the file now is, for noticing anyone else's change. Returns its number. */
  private landed(contentHash: string): number {
    this.written = this.identityOnDisk();
    this.recordWritten(contentHash);
    return ++this.landings;
  }
  /** How many writes were put in place. */
  private landings = 0;

  private reportFailure(error: unknown): void {
    if (this.failureReported) return;
    this.failureReported = true;
    this.sink.emit({
      type: "warning",
      text: `cannot write the session file ${this.path} (${(error as Error).message}); the run goes on, the previous file is unchanged`,
    });
  }

  /** Writes of saveSoon not yet in place, oldest first: at most one is being flushed. */
  private onTheirWay: WriteOnItsWay[] = [];
  private queue: Promise<void> = Promise.resolve();
  private linkReported = false;
  /** What aic last wrote (device, inode, size, time): anything else there now was put there by someone else. */
  private written: string | undefined;

  /**
   * Where aic keeps what it last wrote, so the next aic can tell whether the file changed since. Opened once
   * and rewritten in place at every checkpoint (a write at 0, then the length cut): the name, the open and the
   * truncation were a sixth of a checkpoint's own time. A crash between the two leaves a longer record's tail on
   * a third line, which the reader ignores.
   */
  private recordWritten(contentHash: string): void {
    if (!this.written) return;
    try {
      if (this.recordFd === undefined) {
        const at = sessionStateFile(this.path, "written");
        if (!at) return;
        this.recordFd = openRegular(at, O.O_WRONLY | O.O_CREAT);
      }
      const text = Buffer.from(`${this.written}\n${contentHash}\n`);
      fs.writeSync(this.recordFd, text, 0, text.length, 0);
      fs.ftruncateSync(this.recordFd, text.length);
    } catch {
      /* a read-only state directory: the next start simply cannot tell */
    }
  }
  private recordFd: number | undefined;

  identityOnDisk(name = this.name): string | undefined {
    return identityOf(this.dir.at(name));
  }

  /**
   * The session file and its lock sit where commands can write. A command
   * that rewrote or deleted the file gains nothing (this save puts back what
   * aic holds) and the person is told; a deleted lock file is made again
   * (the lock that decides is the one in aic's state directory, which no
   * command can reach).
   */
  private noticeTampering(): void {
    const now = this.identityOnDisk();
    if (this.written !== undefined && now !== this.written)
      this.sink.emit({
        type: "warning",
        text: `${this.path} was ${now === undefined ? "deleted" : "changed"} by someone else (a command?) since aic wrote it; aic writes it again from the conversation it holds`,
      });
    if (this.lockFd === undefined) return;
    const held = fs.fstatSync(this.lockFd);
    const there = this.identityOnDisk(`${this.name}.lock`);
    if (there?.startsWith(`${held.dev}:${held.ino}:`)) return;
    try {
      const fd = this.dir.open(`${this.name}.lock`, O.O_WRONLY | O.O_CREAT | O.O_APPEND);
      libc()?.symbols.flock(fd, LOCK_EX | LOCK_NB);
      this.extraLocks.push(fd);
      this.sink.emit({
        type: "warning",
        text: `${this.path}.lock had been removed (by a command?); aic made it again`,
      });
    } catch {
      /* the state directory's lock still holds the file */
    }
  }
  private readonly extraLocks: number[] = [];
  /** A command replaced the file with a link: the write replaces the link (never follows it), and the person is told once. */
  private noticePlantedLink(): void {
    if (this.linkReported) return;
    try {
      if (!fs.lstatSync(this.dir.at(this.name)).isSymbolicLink()) return;
    } catch {
      return;
    }
    this.linkReported = true;
    this.sink.emit({
      type: "warning",
      text: `${this.path} had been replaced by a symbolic link (by a command?); aic replaces the link with the session file and never writes through it`,
    });
  }

  /** Drops what is still on its way and closes what it holds (the lock beside the file stays SessionStore's). */
  release(): void {
    for (const w of [...this.onTheirWay]) this.drop(w);
    if (this.recordFd !== undefined) fs.closeSync(this.recordFd);
    this.recordFd = undefined;
    for (const fd of this.extraLocks.splice(0))
      try {
        fs.closeSync(fd);
      } catch {
        /* already closed */
      }
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Session store: kept out of commits
// Owns: the line in the project repository's .git/info/exclude that keeps the
// session file and its lock out of a model's `git add -A`, written through
// descriptors that follow no link.
// ════════════════════════════════════════════════════════════════════════════

/** The most of a repository's .git/info/exclude aic reads before adding its line to it. */
const MAX_EXCLUDE_BYTES = 1024 * 1024;

/**
 * The line that keeps a session file (and its lock beside it) out of git: any
 * default-named session anywhere in the tree, or this one file by its path.
 */
function sessionExcludePattern(relative: string): string {
  const name = path.basename(relative);
  if (name.startsWith(DEFAULT_SESSION_FILE)) return `${DEFAULT_SESSION_FILE}*`;
  return `/${relative.replace(/[*?[\\\]!#]/g, (c) => `\\${c}`)}*`;
}

/**
 * The work tree that holds `dir` (its top, where `.git` is a directory), or
 * undefined. A `.git` file (a worktree or submodule) is not followed: aic only
 * writes in a git directory it finds as a real directory.
 */
function workTreeAbove(dir: string): string | undefined {
  for (let at = dir; ; at = path.dirname(at)) {
    try {
      const git = fs.lstatSync(path.join(at, ".git"));
      if (git.isDirectory()) return at;
      if (git.isFile()) return undefined;
    } catch {
      /* none here: look higher */
    }
    if (path.dirname(at) === at) return undefined;
  }
}

/** A file aic wrote for a repository: its owner's (aic may run as root in someone's project), readable by git. */
function keepReadableByOwner(dir: HeldDirectory, name: string, owner: fs.Stats): void {
  const fd = dir.open(name, O.O_RDONLY);
  try {
    fs.fchmodSync(fd, 0o644);
    if (process.getuid?.() === 0) fs.fchownSync(fd, owner.uid, owner.gid);
  } finally {
    fs.closeSync(fd);
  }
}

/**
 * A model's `git add -A && git commit` must not commit the conversation: when
 * the session file sits in a git work tree, its pattern goes into that
 * repository's .git/info/exclude (never a tracked .gitignore), once. Every
 * step is made through descriptors opened without following links, since a
 * command may have planted one at .git/info or its exclude file.
 */
function excludeSessionFromGit(sessionPath: string): string | undefined {
  const top = workTreeAbove(path.dirname(sessionPath));
  if (top === undefined) return undefined;
  const pattern = sessionExcludePattern(path.relative(top, sessionPath));
  const git = HeldDirectory.tryOpen(path.join(top, ".git"));
  let info: HeldDirectory | undefined;
  try {
    if (!git) return undefined;
    info = git.child("info");
    if (!info) {
      fs.mkdirSync(git.at("info"), { mode: 0o755 });
      info = git.child("info");
    }
    if (!info) return undefined;
    let old = "";
    try {
      // A hard link in its place could be another file of the person's (a key): its bytes must not be copied out.
      if (fs.lstatSync(info.at("exclude")).nlink > 1)
        return `left ${path.join(top, ".git/info/exclude")} alone: it has other names (hard links); do not commit the session`;
      old = info.read("exclude", MAX_EXCLUDE_BYTES).toString("utf8");
    } catch (error) {
      if (!ownFileError(error).missing)
        return `left ${path.join(top, ".git/info/exclude")} alone: ${ownFileError(error).message}`;
    }
    if (old.split("\n").some((line) => line.trim() === pattern)) return undefined;
    const separator = old === "" || old.endsWith("\n") ? "" : "\n";
    info.replace("exclude", `${old}${separator}# aic's conversation (added by aic)\n${pattern}\n`, true);
    keepReadableByOwner(info, "exclude", fs.fstatSync(git.descriptor));
    return `added ${pattern} to ${path.join(top, ".git/info/exclude")}, so git leaves the conversation out of commits`;
  } catch (error) {
    return `could not add the session to ${path.join(top, ".git/info/exclude")} (${(error as Error).message}); do not commit it`;
  } finally {
    info?.close();
    git?.close();
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Sandbox: what commands may touch
// Owns: confining the commands the agent runs with Landlock, through bun:ffi
// since no library does this for Bun.
//
// Where the rules apply: Landlock confines the calling thread and whatever
// it starts afterwards, and Bun runs several threads. Restricting aic's own
// main thread would both leave Bun's worker threads free and lock aic out of
// its own files (~/.aic_history, a --session outside the cwd). So aic never
// confines itself. It starts `aic __sandbox-exec PLAN -- aic
// __sandbox-launcher`: that fresh process, on its main thread, sets
// no_new_privs, builds the ruleset, restricts itself and then execve()s the
// launcher (next section), which starts every command. execve ends every
// other thread, and the domain is inherited by the launcher's threads and by
// every process it ever starts, so the whole tree of every command is
// confined, while aic itself stays free to write its bookkeeping. What the
// kernel lacks (no Landlock) turns the sandbox off with the reason; a
// launcher that cannot confine itself on a kernel that has it runs nothing.
// ════════════════════════════════════════════════════════════════════════════

interface Sandbox {
  /** `on (writes: …)` or `off (reason)` — shown at start, in the status bar and in the system prompt. */
  readonly status: string;
  readonly enabled: boolean;
  /** Where commands may write: the start directory, /tmp, /dev, the package caches, --allow-write paths. */
  readonly writable: readonly string[];
  /** The package-manager caches under the home directory among `writable`. */
  readonly caches: readonly string[];
  /** The secret stores commands may not read (empty with --allow-read-secrets). */
  readonly secrets: readonly string[];
  /** How many Landlock rules each command's ruleset holds. */
  readonly ruleCount: number;
  /** Programs deny rules forbid that commands cannot execute (or read) at all: the kernel refuses them. */
  readonly deniedPrograms: readonly string[];
  /** Deny rules judged at each execve of a command (a subcommand or arguments): see "Sandbox: judging each program…". */
  readonly heldAtExec: readonly string[];
  /** How commands are confined: the jail (Landlock inside namespaces), Landlock alone, or not at all. */
  readonly jail: SandboxFacts["jail"];
  /** Why commands get no more than `jail` (undefined in the jail). */
  readonly weaker: string | undefined;
  readonly network: SandboxFacts["network"];
  /** The person's ssh-agent is passed through to commands (--allow-ssh-agent). */
  readonly sshAgent: boolean;
  /** In the jail, the process every orphan of a command becomes the child of (the launcher, as aic sees it). */
  readonly reaper: number | undefined;
  /** Starts the launcher, once the files the jail keeps read-only (the session's lock) exist. */
  start(own: OwnFiles): void;
  /**
   * Takes out what commands left for the person's git to run outside the
   * sandbox (README: "Threat model"); what it took out, one line each.
   * `deep`: the whole tree, not only the first levels (the end of a run).
   */
  auditRepositories(deep?: boolean): GuardReport;
  /** --keep-jobs at exit: what commands started goes on running once aic has gone (the jail stays up until it empties). */
  keepRunning(): void;
  /**
   * At exit, before the repository guard's last sweep: every process the commands started is ended (in the jail,
   * its init and so the whole namespace; otherwise the orphans aic adopted as their subreaper), so none can plant
   * anything after the sweep.
   */
  stopEverything(): void;
  /** Starts `argv` on a PTY of its own: confined, through the launcher, when on. */
  spawn(argv: string[], opts: PtyOptions): Promise<CommandProcess>;
}

const SANDBOX_EXEC = "__sandbox-exec";

/**
 * Package managers' caches under the home directory. Installing
 * dependencies is most tasks' first step, so commands may write these (and
 * nothing else there): caches, never configuration or credentials.
 */
const CACHE_DIRS = [
  ".npm",
  ".cache",
  ".bun/install/cache",
  ".cargo/registry",
  ".cargo/git",
  "go/pkg/mod",
  ".m2/repository",
  ".gradle/caches",
  // pnpm's store only: its home above it is where `pnpm setup` puts the global bin directory, first on PATH, and a
  // command that could write there would have the person's next `git` be its own.
  ".local/share/pnpm/store",
  ".yarn/berry/cache",
];

/**
 * Where tools keep tokens, keys and what a person typed, under the home
 * directory: commands cannot read them unless --allow-read-secrets. Shell
 * histories are here because people paste tokens into their shells.
 */
const SECRET_STORES = [
  ".ssh",
  ".aws",
  ".azure",
  ".config/gcloud",
  ".gnupg",
  ".kube",
  ".docker/config.json",
  ".netrc",
  ".git-credentials",
  ".npmrc",
  ".pypirc",
  ".config/gh",
  ".config/hub",
  ".pgpass",
  ".vault-token",
  ".cargo/credentials.toml",
  ".cargo/credentials",
  ".terraform.d",
  ".local/share/keyrings",
  ".password-store",
  ".config/op",
  ".mozilla",
  ".config/google-chrome",
  ".config/chromium",
  ".bash_history",
  ".zsh_history",
  ".local/share/fish",
  ".config/aic", // the person's aic settings, which may hold an API key
  ".config/git/credentials",
  ".Xauthority",
  ".ICEauthority",
  ".config/rclone",
  ".s3cfg",
  ".boto",
  ".oci",
  ".config/sops",
  ".age",
  ".minisign",
  ".m2/settings.xml",
  ".m2/settings-security.xml",
  ".gradle/gradle.properties",
  ".gem/credentials",
  ".config/pip",
  ".pip",
  ".config/composer/auth.json",
  ".composer/auth.json",
  ".codex",
  ".claude",
  ".claude.json",
  ".config/github-copilot",
  ".gemini",
  ".config/opencode",
  ".local/share/opencode",
  ".aider.conf.yml",
  ".psql_history",
  ".mysql_history",
  ".sqlite_history",
  ".rediscli_history",
  ".python_history",
  ".node_repl_history",
  ".irb_history",
  ".lesshst",
  // Found readable by the fourth red team: tokens of hosting, cloud and model services, mail and database clients,
  // and more of what a person typed.
  ".cache/huggingface/token",
  ".huggingface",
  ".yarnrc.yml",
  ".kaggle",
  ".config/glab-cli",
  ".config/tea",
  ".config/doctl",
  ".config/hcloud",
  ".fly",
  ".wrangler",
  ".config/netlify",
  ".local/share/com.vercel.cli",
  ".local/share/containers/auth.json",
  ".config/containers/auth.json",
  ".config/configstore",
  ".config/ngrok",
  ".databrickscfg",
  ".terraformrc",
  ".sentryclirc",
  ".my.cnf",
  ".msmtprc",
  ".fetchmailrc",
  ".gitlab-runner",
  ".bundle/config",
  ".local/share/atuin",
  ".histfile",
  ".zhistory",
  ".ipython",
  ".viminfo",
  ".dbshell",
  ".local/state/nvim/shada",
  ".local/share/nvim/shada",
  // Found readable by the fifth red team: package registries' tokens, service and model keys, editors' state.
  ".yarnrc",
  ".config/pnpm/rc",
  ".bunfig.toml",
  ".condarc",
  ".nuget/NuGet/NuGet.Config",
  ".config/helm/repositories.yaml",
  ".config/stripe",
  ".ngrok2",
  ".config/io.datasette.llm",
  ".local/share/io.datasette.llm",
  ".config/aichat",
  ".continue",
  ".env",
  ".config/Code/User/globalStorage",
  ".config/Cursor/User/globalStorage",
];

/** A file or directory whose name says it holds a credential: unreadable too, wherever it is in the home directory. */
const CREDENTIAL_NAME =
  /credential|token|^auth\.json$|\.pem$|_rsa$|_ed25519$|_ecdsa$|\.key$|\.p12$|\.pfx$|secret|api[_-]?keys?|passw(or)?d|^keys?\.(txt|json|ya?ml|toml)$|^\.env(\..+)?$/i;
/** How many entries the search for credential-shaped names looks at, at most (a home of many files costs a bound). */
const CREDENTIAL_SEARCH_LIMIT = 20_000;

/**
 * Files and directories in the home directory (two levels down) and in
 * ~/.config/* and ~/.local/share/* (two levels below each) whose names say they hold a
 * credential; caches and writable trees are not searched. Read at start:
 * one created later is not covered (the README says so).
 */
function credentialShapedPaths(home: string, skip: (p: string) => boolean): string[] {
  const found: string[] = [];
  let budget = CREDENTIAL_SEARCH_LIMIT;
  const walk = (dir: string, depth: number) => {
    let entries: fs.Dirent[];
    try {
      entries = fs.readdirSync(dir, { withFileTypes: true });
    } catch {
      return;
    }
    for (const e of entries) {
      if (budget-- <= 0) return;
      const p = path.join(dir, e.name);
      if (skip(p) || e.isSymbolicLink() || e.name.endsWith(".pub")) continue;
      if (CREDENTIAL_NAME.test(e.name)) found.push(p);
      else if (e.isDirectory() && depth > 1 && !/^(node_modules|\.cache|cache|caches|\.git)$/i.test(e.name))
        walk(p, depth - 1);
    }
  };
  walk(home, 2);
  for (const base of [".config", ".local/share"]) {
    let configs: fs.Dirent[] = [];
    try {
      configs = fs.readdirSync(path.join(home, base), { withFileTypes: true });
    } catch {
      /* no such directory */
    }
    for (const c of configs) if (c.isDirectory()) walk(path.join(home, base, c.name), 2);
  }
  return [...new Set(found)];
}

/**
 * The stores with what --allow-read lifts taken out: a store at or below an
 * allowed path goes; a store that holds one is split into its other entries
 * (so the allowed file reads, its neighbours stay unreadable).
 */
function liftAllowedReads(stores: readonly string[], allowed: readonly string[]): string[] {
  const out: string[] = [];
  const visit = (store: string, depth: number) => {
    if (allowed.some((a) => store === a || isBeneath(store, a))) return;
    const inside = allowed.filter((a) => isBeneath(a, store));
    if (!inside.length || depth > 8) return void out.push(store);
    let names: string[] = [];
    try {
      names = fs.readdirSync(store);
    } catch {
      /* nothing to split: the allowed path is all there is to read there */
    }
    for (const name of names) visit(path.join(store, name), depth + 1);
  };
  for (const s of stores) visit(s, 0);
  return out;
}

/**
 * With --allow-ssh-agent, ssh in a command must still check host keys and
 * read its settings: of ~/.ssh only the other files (the private keys) stay
 * unreadable, each on its own. A file added there later is unreadable too.
 */
function sshPrivateFiles(home: string): string[] {
  const dir = path.join(home, ".ssh");
  try {
    return fs
      .readdirSync(dir)
      .filter((name) => !/^(known_hosts2?|config|authorized_keys|.*\.pub)$/.test(name))
      .map((name) => path.join(dir, name));
  } catch {
    return [];
  }
}

/** One Landlock rule: what commands may do beneath `path`, and the identity `path` had when aic started. */
interface SandboxRule {
  path: string;
  access: "rw" | "w" | "r";
  dev: number;
  ino: number;
}

/** What the launcher confines each command to: reads (and execution) are confined only when some are denied. */
interface SandboxPlan {
  confineReads: boolean;
  /** Some programs may not be executed: a rule's read grant then grants execution too, the rest has none. */
  confineExec: boolean;
  rules: SandboxRule[];
  /** Deny rules the kernel cannot hold by refusing a file (a subcommand, arguments): judged at each execve instead. */
  judgeExec?: string[];
}

/** The sandbox as the start event reports it. */
function sandboxFacts(s: Sandbox): SandboxFacts {
  return {
    enabled: s.enabled,
    status: s.status,
    jail: s.jail,
    reason: s.weaker ?? null,
    missing: s.jail === "namespaces" ? [] : [...JAIL_ONLY_PROPERTIES],
    writable: [...s.writable],
    unreadable: [...s.secrets],
    network: s.network,
    rules: s.ruleCount,
  };
}

/**
 * No sandbox. With --keep-jobs commands still start through a launcher (an
 * unconfined one): it holds their terminals, so a kept server that logs to
 * its terminal goes on working once aic has exited, instead of failing on a
 * terminal that closed with aic.
 */
function sandboxOff(reason: string, keeper?: readonly string[]): Sandbox {
  const launcher = keeper ? new SandboxLauncher([...keeper], false) : undefined;
  return {
    status: `off (${reason})`,
    enabled: false,
    writable: [],
    caches: [],
    secrets: [],
    ruleCount: 0,
    deniedPrograms: [],
    heldAtExec: [],
    jail: "off",
    weaker: reason,
    network: "on",
    sshAgent: false,
    reaper: undefined,
    start: () => void launcher?.start(),
    auditRepositories: () => ({ taken: [], notes: [] }),
    keepRunning: () => launcher?.keepRunning(),
    stopEverything: () => killAdoptedOrphans(),
    spawn: async (argv, opts) => (launcher ? launcher.spawn(argv, opts) : unconfinedCommand(argv, opts)),
  };
}

/** What tools print when a file operation is refused: touch, cp, apt ("are you root?"), pip, npm, Python's errno text. */
const REFUSAL_WORDS =
  /permission denied|operation not permitted|read-only file system|\bEACCES\b|\bEPERM\b|are you root|could not (write|commit|lock) config file/i;
/** git's words when the config it rewrites is the jail's read-only bind (the rename over it is EBUSY). */
const GIT_CONFIG_REFUSED =
  /could not (?:write|commit|lock) config file (.+?): (?:device or resource busy|read-only file system)/i;
/** An absolute path in an error line: after a quote, a bracket, a space or `=`, up to a quote, bracket, comma or space. */
const ERROR_LINE_PATH = /(?:^|[\s'"`(\[=‘“])(\/[^\s'"`()[\],;‘’“”]+)/g;

/**
 * The paths a failed command's output names in a refusal that the sandbox
 * caused: a secret store, a write outside the writable set that aic itself
 * (unconfined, the same user) could make, or a program a deny rule forbids.
 * A refusal that file permissions would make anyway is not the sandbox's.
 */
function sandboxRefusals(
  output: string,
  s: Sandbox,
  cwd: string,
): { path: string; why: SandboxRefusal; detail: string }[] {
  if (!s.enabled || !REFUSAL_WORDS.test(output)) return [];
  const found = new Map<string, { path: string; why: SandboxRefusal; detail: string }>();
  // The exec judge says why in its own line; the shell's "Operation not permitted" after it is that refusal.
  const judgedAtExec = output.includes("aic: refused at exec:");
  for (const line of output.split("\n", 5000)) {
    if (found.size >= 3 || !REFUSAL_WORDS.test(line)) continue;
    if (judgedAtExec && /operation not permitted/i.test(line)) continue;
    const config = GIT_CONFIG_REFUSED.exec(line);
    if (config) {
      const p = path.resolve(cwd, config[1]!);
      if (!found.has(p)) found.set(p, { path: p, why: "gitconfig", detail: "" });
      continue;
    }
    // "/bin/bash: line 1: /etc/x: Permission denied": the shell names itself first; the refused path follows.
    const said = line.replace(/^(\/\S*\/)?(ba|da|z|k|mk)?sh: (line \d+: )?/, "");
    for (const m of said.matchAll(ERROR_LINE_PATH)) {
      const p = path.resolve(cwd, m[1]!.replace(/[.:]+$/, ""));
      const why = whySandboxRefused(p, s);
      if (why && !found.has(p)) found.set(p, { path: p, ...why });
    }
  }
  return [...found.values()].slice(0, 3);
}

function whySandboxRefused(p: string, s: Sandbox): { why: SandboxRefusal; detail: string } | undefined {
  const under = (dirs: readonly string[]) => dirs.some((d) => p === d || isBeneath(p, d));
  const secret = s.secrets.find((d) => p === d || isBeneath(p, d));
  if (secret) return { why: "secret", detail: `the person can lift it with --allow-read ${secret}` };
  const denied = s.deniedPrograms.find((name) => programFiles(name).includes(p));
  if (denied) return { why: "exec", detail: denied };
  if (under(s.writable) || !writableUnconfined(p)) return undefined;
  const shown = s.writable.filter((w) => !s.caches.includes(w));
  return { why: "write", detail: `${shown.join(", ")}${s.caches.length ? " and the package caches" : ""}` };
}

// ════════════════════════════════════════════════════════════════════════════
// Sandbox: the programs and paths a run trusts
// Owns: where commands may write as aic's own programs see it, PATH and git
// resolved once at start from places commands cannot write, the home directory,
// the caches, what stays readable, and the plan of a run's sandbox.
// ════════════════════════════════════════════════════════════════════════════

/**
 * Where commands may write, as far as aic's own programs are concerned:
 * the sandbox's writable set once it is known, and always the start
 * directory and the shared temporary directories.
 */
let commandWritableRoots: string[] = [];

function noteCommandWritable(dirs: readonly string[]): void {
  commandWritableRoots = [...new Set([...dirs, process.cwd(), "/tmp", "/var/tmp", "/dev/shm", "/dev"])];
}

/**
 * For `aic undo`, `redo` and `diff`, which set up no sandbox: where a run's commands could have written by
 * default (the session's directory, the package caches and the rest), so that their git, too, is never one a
 * command planted on PATH (a virtualenv in ~/.cache, a project's .venv/bin).
 */
function noteWritableWithoutARun(session: string): void {
  const home = homeDirectory();
  const caches = home ? CACHE_DIRS.map((d) => path.join(home, d)) : [];
  const xdg = process.env.XDG_CACHE_HOME;
  if (xdg && path.isAbsolute(xdg)) caches.push(xdg);
  const real = (p: string) => {
    try {
      return fs.realpathSync(p);
    } catch {
      return p;
    }
  };
  noteCommandWritable([...new Set([path.dirname(path.resolve(session)), ...caches].flatMap((p) => [p, real(p)]))]);
}

/**
 * The PATH aic's own programs run with: the absolute entries of the PATH aic
 * started with that no command may write (a relative `node_modules/.bin`, a
 * directory in the project or a package cache such as PNPM_HOME is left
 * out), so a `git` a command plants there never runs outside the sandbox.
 */
let trustedPathValue: string | undefined;
function trustedPath(): string {
  if (trustedPathValue !== undefined) return trustedPathValue;
  if (!commandWritableRoots.length) noteCommandWritable([]);
  const writable = (p: string) => commandWritableRoots.some((w) => p === w || isBeneath(p, w));
  const entries = (process.env.PATH ?? "/usr/bin:/bin").split(":").filter((dir) => {
    // Inside a writable directory by its very name: left out without being looked at (a command may own it).
    if (!path.isAbsolute(dir) || writable(dir)) return false;
    try {
      return !writable(fs.realpathSync(dir));
    } catch {
      return false;
    }
  });
  trustedPathValue = entries.join(":");
  return trustedPathValue;
}

/** An argv[0] that cannot start: aic's git where none was found outside the directories commands may write. */
const NO_TRUSTED_GIT = "/nonexistent/aic-found-no-git-outside-the-writable-directories";

/** aic's own git: resolved once, to an absolute path on the trusted PATH; undefined when there is none. */
let gitProgramValue: string | null | undefined;
function gitProgram(): string | undefined {
  if (gitProgramValue === undefined) gitProgramValue = Bun.which("git", { PATH: trustedPath() }) ?? null;
  return gitProgramValue ?? undefined;
}

/** Whether this user could write `p` (or create it, in its nearest existing directory) without the sandbox. */
function writableUnconfined(p: string): boolean {
  for (let at = p; ; at = path.dirname(at)) {
    try {
      fs.accessSync(at, fs.constants.W_OK);
      return true;
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code !== "ENOENT" || at === "/") return false;
    }
  }
}

const isBeneath = (inner: string, outer: string) => inner.startsWith(outer === "/" ? "/" : outer + "/");

/** The person's home directory, resolved, or undefined when there is none worth guarding ("/", missing). */
function homeDirectory(): string | undefined {
  try {
    const home = fs.realpathSync(os.homedir());
    return home !== "/" && fs.statSync(home).isDirectory() ? home : undefined;
  } catch {
    return undefined;
  }
}

/** The cache directories, made if missing (with the person's ownership, since aic runs as the person). */
function prepareCaches(home: string): string[] {
  const dirs = CACHE_DIRS.map((d) => path.join(home, d));
  if (process.env.XDG_CACHE_HOME && path.isAbsolute(process.env.XDG_CACHE_HOME)) dirs.push(process.env.XDG_CACHE_HOME);
  const ready: string[] = [];
  for (const dir of dirs) {
    try {
      fs.mkdirSync(dir, { recursive: true, mode: 0o755 });
      const real = fs.realpathSync(dir);
      if (fs.statSync(real).isDirectory()) ready.push(real);
    } catch {
      /* a read-only home: that cache stays unwritable */
    }
  }
  return ready;
}

/**
 * Landlock only grants, so reading is denied beneath `denied` by granting it
 * on everything else: every entry of a directory on the way to a denied path
 * but that path, recursively. A link is skipped: its target is judged where
 * it lies.
 */
function readableEntries(dir: string, denied: readonly string[], out: string[]): void {
  let names: string[];
  try {
    names = fs.readdirSync(dir);
  } catch {
    return;
  }
  for (const name of names) {
    const entry = dir === "/" ? `/${name}` : `${dir}/${name}`;
    if (denied.includes(entry)) continue;
    let st: fs.Stats;
    try {
      st = fs.lstatSync(entry);
    } catch {
      continue;
    }
    if (st.isSymbolicLink()) continue;
    if (st.isDirectory() && denied.some((d) => isBeneath(d, entry))) readableEntries(entry, denied, out);
    else out.push(entry);
  }
}

/** Where a program named in a deny rule lives: every match on PATH and in the usual directories, resolved. */
function programFiles(name: string): string[] {
  const dirs = name.includes("/")
    ? [""]
    : [
        ...(process.env.PATH ?? "").split(":"),
        "/usr/local/sbin",
        "/usr/local/bin",
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
        // git keeps a second copy of itself (and its helpers) in its exec path: `/usr/lib/git-core/git`.
        ...GIT_EXEC_PATHS,
      ];
  const found = new Set<string>();
  for (const dir of dirs) {
    if (!name.includes("/") && !path.isAbsolute(dir)) continue;
    try {
      const real = fs.realpathSync(name.includes("/") ? path.resolve(name) : path.join(dir, name));
      if (fs.statSync(real).isFile()) found.add(real);
    } catch {
      /* not there */
    }
  }
  return [...found];
}

function planSandbox(
  writable: readonly string[],
  secrets: readonly string[],
  binaries: readonly string[] = [],
): SandboxPlan {
  const identify = (p: string, access: SandboxRule["access"]): SandboxRule | undefined => {
    try {
      const st = fs.lstatSync(p);
      return { path: p, access, dev: st.dev, ino: st.ino };
    } catch {
      return undefined;
    }
  };
  // A store below a directory aic may not search (a HOME of another user's) is out of every command's reach anyway.
  const denied = [...secrets, ...binaries].filter((s) => lstatIfReachable(path.dirname(s)));
  const confineReads = denied.length > 0;
  const confineExec = binaries.length > 0;
  const rules = writable.map((w) => identify(w, "rw"));
  if (confineReads) {
    const readable: string[] = [];
    readableEntries("/", denied, readable);
    const full = new Set(writable);
    for (const entry of readable) if (!full.has(entry)) rules.push(identify(entry, "r"));
  }
  return { confineReads, confineExec, rules: rules.filter((r): r is SandboxRule => r !== undefined) };
}

/** `~/x` for paths in the home directory: the status line stays readable. */
function tildePath(p: string, home: string | undefined): string {
  return home && isBeneath(p, home) ? `~${p.slice(home.length)}` : p;
}

// ════════════════════════════════════════════════════════════════════════════
// Sandbox: Landlock and capabilities
// Owns: the syscalls that confine a process for good: capabilities dropped, no
// new privileges, a Landlock ruleset with its scopes, then execve of the
// launcher (`aic __sandbox-exec PLAN -- …`).
// ════════════════════════════════════════════════════════════════════════════

/** Landlock filesystem rights (linux/landlock.h), with the ABI that introduced each. */
const LANDLOCK_FS = {
  WRITE_FILE: [1n << 1n, 1],
  REMOVE_DIR: [1n << 4n, 1],
  REMOVE_FILE: [1n << 5n, 1],
  MAKE_CHAR: [1n << 6n, 1],
  MAKE_DIR: [1n << 7n, 1],
  MAKE_REG: [1n << 8n, 1],
  MAKE_SOCK: [1n << 9n, 1],
  MAKE_FIFO: [1n << 10n, 1],
  MAKE_BLOCK: [1n << 11n, 1],
  MAKE_SYM: [1n << 12n, 1],
  REFER: [1n << 13n, 2],
  TRUNCATE: [1n << 14n, 3],
  IOCTL_DEV: [1n << 15n, 5],
} as const;

/** Reading a file's contents; listing directories (READ_DIR) is left alone, so names stay visible everywhere. */
const LANDLOCK_READ_FILE = 1n << 2n;
/** Executing a file: handled only when a deny rule names a program outright. */
const LANDLOCK_EXECUTE = 1n << 0n;

/** Landlock ABI 6 scopes (linux/landlock.h). */
const LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET = 1n;
const LANDLOCK_SCOPE_SIGNAL = 2n;

const PR_CAPBSET_DROP = 24;
const PR_SET_SECUREBITS = 28;
const PR_CAP_AMBIENT = 47;
const PR_CAP_AMBIENT_CLEAR_ALL = 4;
const SYS_CAPSET = 126;
/**
 * securebits: NOROOT (+LOCKED) keeps a uid-0 process from regaining every
 * capability at its next execve; NO_SETUID_FIXUP, KEEP_CAPS_LOCKED and
 * NO_CAP_AMBIENT_RAISE (+LOCKED) close the other ways back.
 */
const SECUREBITS_NO_WAY_BACK = 0xef;

/**
 * Drops every capability of the calling thread for good (the thread that is
 * about to execve): securebits first and the bounding set next, which need
 * CAP_SETPCAP, then the ambient set, then capset to nothing. Without
 * CAP_SETPCAP (a non-root aic outside a jail) there is nothing to drop.
 * Returns why it failed, or undefined.
 */
function dropCapabilities(keep = 0): string | undefined {
  const c = libc()?.symbols;
  if (!c) return "cannot open libc.so.6 through bun:ffi";
  const { ptr } = require("bun:ffi") as typeof import("bun:ffi");
  const status = fs.readFileSync("/proc/self/status", "utf8");
  if (/^CapPrm:\s*0+$/m.test(status) && /^CapAmb:\s*0+$/m.test(status)) return undefined;
  // Only what this process holds can be kept: a container's root lacks CAP_SYS_PTRACE (capset would refuse it all).
  keep &= Number(BigInt(`0x${/^CapPrm:\s*([0-9a-f]+)$/m.exec(status)?.[1] ?? "0"}`) & 0xffffffffn);
  if (c.prctl(PR_SET_SECUREBITS, SECUREBITS_NO_WAY_BACK, 0, 0, 0) !== 0) return "prctl(PR_SET_SECUREBITS) was refused";
  const last = Number(fs.readFileSync("/proc/sys/kernel/cap_last_cap", "utf8"));
  for (let cap = 0; cap <= last; cap++)
    if (c.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) !== 0) return `prctl(PR_CAPBSET_DROP, ${cap}) was refused`;
  if (c.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) !== 0)
    return "clearing the ambient capabilities was refused";
  // capset(&{_LINUX_CAPABILITY_VERSION_3, pid 0}, data[2]{effective, permitted, inheritable}): all zero but `keep`
  // (a mask of capabilities 0–31), which stays effective and permitted here and, the bounding set being empty
  // and the securebits locked, reaches nothing this process executes.
  const header = new Uint32Array([0x20080522, 0]);
  const data = new Uint32Array([keep, keep, 0, 0, 0, 0]);
  if (Number(c.syscall(SYS_CAPSET, ptr(header), ptr(data), 0, 0, 0)) !== 0) return "capset was refused";
  return undefined;
}

const SYS_LANDLOCK_CREATE_RULESET = 444;
const SYS_LANDLOCK_ADD_RULE = 445;
const SYS_LANDLOCK_RESTRICT_SELF = 446;
const LANDLOCK_CREATE_RULESET_VERSION = 1;
const LANDLOCK_RULE_PATH_BENEATH = 1;
const PR_SET_NO_NEW_PRIVS = 38;

/** The Landlock ABI version the kernel offers, or the reason there is none. */
function landlockAbi(): number | string {
  if (process.platform !== "linux") return `not Linux (${process.platform})`;
  try {
    const c = libc();
    if (!c) return "cannot open libc.so.6 through bun:ffi";
    const abi = Number(c.symbols.syscall(SYS_LANDLOCK_CREATE_RULESET, 0, 0, LANDLOCK_CREATE_RULESET_VERSION, 0, 0));
    return abi >= 1 ? abi : "this kernel does not offer Landlock";
  } catch (error) {
    return `cannot call the kernel through libc (${(error as Error).message})`;
  }
}

/** Every write-side right this ABI knows: what the ruleset handles (reads and execution stay unrestricted). */
function writeRights(abi: number): bigint {
  let rights = 0n;
  for (const [bit, since] of Object.values(LANDLOCK_FS)) if (abi >= since) rights |= bit;
  return rights;
}

/**
 * Runs in the `__sandbox-exec` child: confines this process to `writable`
 * and replaces it with `argv`. Only returns on failure (exit code 126).
 */
function sandboxExec(plan: SandboxPlan, argv: string[]): number | Promise<number> {
  const fail = (what: string) => {
    writeOut(2, `aic sandbox: ${what}\n`);
    return 126;
  };
  const { ptr } = require("bun:ffi") as typeof import("bun:ffi");
  const c = libc()?.symbols;
  if (!c) return fail("cannot open libc.so.6 through bun:ffi");
  const abi = Number(c.syscall(SYS_LANDLOCK_CREATE_RULESET, 0, 0, LANDLOCK_CREATE_RULESET_VERSION, 0, 0));
  if (abi < 1) return fail("Landlock is not available");
  const write = writeRights(abi);
  const read = (plan.confineReads ? LANDLOCK_READ_FILE : 0n) | (plan.confineExec ? LANDLOCK_EXECUTE : 0n);
  const handled = write | read;
  // struct landlock_ruleset_attr { u64 handled_access_fs; u64 handled_access_net; u64 scoped; }: from ABI 6 the
  // scopes keep commands from signalling any process outside their domain (aic among them) and from connecting
  // to abstract Unix sockets made outside it (an X server's, a D-Bus bus).
  const scoped = abi >= 6 ? LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL : 0n;
  const rulesetAttr = new BigUint64Array([handled, 0n, scoped]);
  const rulesetFd = Number(c.syscall(SYS_LANDLOCK_CREATE_RULESET, ptr(rulesetAttr), abi >= 6 ? 24 : 8, 0, 0, 0));
  if (rulesetFd < 0) return fail("landlock_create_ruleset was refused");
  // struct landlock_path_beneath_attr { u64 allowed_access; s32 parent_fd; } __attribute__((packed))
  const attr = new Uint8Array(12);
  const view = new DataView(attr.buffer);
  for (const rule of plan.rules) {
    const fd = c.open(Buffer.from(rule.path + "\0"), O_PATH | O.O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) continue; // gone since start: nothing to grant
    // A command may have renamed this directory and put a link (to / , say) in its place: the rule must not follow it.
    const st = fs.fstatSync(fd);
    if (st.dev !== rule.dev || st.ino !== rule.ino) {
      c.close(fd);
      if (rule.access === "r") continue; // a read grant on something replaced is simply not given
      return fail(
        `${rule.path} is no longer the directory it was when aic started (moved or replaced by a command), so commands cannot be confined; restart aic`,
      );
    }
    view.setBigUint64(0, (rule.access === "r" ? 0n : write) | (rule.access === "w" ? 0n : read), true);
    view.setInt32(8, fd, true);
    const rc = Number(c.syscall(SYS_LANDLOCK_ADD_RULE, rulesetFd, LANDLOCK_RULE_PATH_BENEATH, ptr(attr), 0, 0));
    c.close(fd);
    if (rc !== 0) return fail(`landlock_add_rule for ${rule.path} was refused`);
  }
  // No capability survives into the launcher or a command: a root command cannot ptrace, take another process's
  // descriptors (pidfd_getfd), type into a terminal (TIOCSTI) or mount. Needs CAP_SETPCAP for its first steps, so
  // it comes before anything else is given up; for a non-root aic there is nothing to drop.
  // The exec supervisor keeps CAP_SYS_PTRACE where it has it (the jail's init; root): it reads the argv of the
  // launcher's children, which share the launcher's non-dumpable memory until they exec.
  const supervising = Boolean(plan.judgeExec?.length);
  const dropped = dropCapabilities(supervising ? 1 << CAP_SYS_PTRACE : 0);
  if (dropped) return fail(dropped);
  if (c.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) !== 0) return fail("prctl(PR_SET_NO_NEW_PRIVS) was refused");
  if (Number(c.syscall(SYS_LANDLOCK_RESTRICT_SELF, rulesetFd, 0, 0, 0, 0)) !== 0)
    return fail("landlock_restrict_self was refused");
  // execve wants NULL-terminated arrays of C strings; the buffers must outlive the call.
  const cStrings = (items: string[]) => {
    const buffers = items.map((s) => Buffer.from(s + "\0"));
    const table = new BigUint64Array(items.length + 1);
    buffers.forEach((b, i) => (table[i] = BigInt(ptr(b))));
    return { buffers, table };
  };
  // Deny rules on subcommands need a judge at each execve: this process stays, as the launcher's parent.
  if (supervising) return superviseLauncher(plan.judgeExec!, argv);
  const args = cStrings(argv);
  const env = cStrings(Object.entries(process.env).map(([k, v]) => `${k}=${v ?? ""}`));
  c.execve(Buffer.from(argv[0] + "\0"), ptr(args.table), ptr(env.table));
  return fail(`cannot execute ${argv[0]}`);
}

/** How to start this very program again: the compiled binary itself, or bun plus this script. */
function selfArgv(): string[] {
  const main = Bun.main;
  const compiled = main.startsWith("/$bunfs/") || main.startsWith("B:/~BUN/");
  return compiled ? [process.execPath] : [process.execPath, main];
}

/** The same, as a shell command line for the system prompt's search recipe. */
function selfCommand(): string {
  return selfArgv().map(shellQuoted).join(" ");
}

/** What aic keeps of its own that no command may read: the checkpoint store, the prompt history, other runs' outputs. */

// ════════════════════════════════════════════════════════════════════════════
// Sandbox: judging each program a command executes
// Owns: holding a deny rule on a subcommand or arguments (`deny git push *`)
// at exec time, whatever route led there (a script, `find -exec`, an editor's
// `:!`, a pager, git's own fsmonitor). The launcher puts itself and every
// command under a seccomp filter that hands each execve to a supervisor, its
// parent (an ancestor of every command, so ptrace rules let it read their
// memory), which reads the program and its argv, judges them with the same
// rules as the parser, and lets the call go on or fails it with EPERM.
// The kernel's own warning holds: letting a call go on after looking at its
// memory is not airtight, since another thread of the caller may rewrite the
// arguments in between (README: "Command rules"); the parser still judges the
// line first, and programs denied outright are refused by Landlock.
// ════════════════════════════════════════════════════════════════════════════

/** Set in the launcher's environment when it must put itself under the filter: "init" when the supervisor is the jail's PID 1. */
const EXEC_JUDGE_ENV = "AIC_EXEC_JUDGE";
/** The launcher's end of the socket pair its supervisor receives the listener on. */
const EXEC_JUDGE_SOCKET_FD = 4;
const SYS_SECCOMP = 317;
const SECCOMP_SET_MODE_FILTER = 1;
const CAP_SYS_PTRACE = 19;
const SECCOMP_FILTER_FLAG_TSYNC = 1;
const SECCOMP_FILTER_FLAG_NEW_LISTENER = 8;
const SECCOMP_FILTER_FLAG_TSYNC_ESRCH = 16;
/** struct seccomp_notif is 80 bytes, struct seccomp_notif_resp 24: the ioctls encode those sizes. */
const SECCOMP_IOCTL_NOTIF_RECV = 0xc0502100;
const SECCOMP_IOCTL_NOTIF_SEND = 0xc0182101;
const SECCOMP_IOCTL_NOTIF_ID_VALID = 0x40082102;
const SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1;
const EPERM = 1;
/** execve and execveat, natively and in the x32 and i386 ABIs (the other two are refused outright). */
const SYSCALL_EXECVE = 59;
const SYSCALL_EXECVEAT = 322;
/** The longest program path, and the most argv bytes read from a caller whose program the rules name; more is refused, not half-judged. */
const EXEC_PATH_MAX = 4096;
const EXEC_ARGV_MAX_BYTES = 32 << 20;

/** Why exec-time judging cannot run here, or undefined. */
function execJudgeMissing(): string | undefined {
  if (process.platform !== "linux") return `not Linux (${process.platform})`;
  if (process.arch !== "x64") return `the exec filter is built for x86-64, not ${process.arch}`;
  return undefined;
}

/**
 * The filter: execve and execveat go to the supervisor; the same calls in the
 * x32 and i386 ABIs, and any new filter with a listener of its own (which
 * would take the calls before this one), fail with EPERM; all else runs.
 */
function execFilterProgram(): Uint8Array {
  const LD = 0x20,
    JEQ = 0x15,
    JSET = 0x45,
    RET = 0x06;
  const ALLOW = 0x7fff0000,
    NOTIFY = 0x7fc00000,
    REFUSE = 0x00050000 | EPERM;
  // [code, jump if true, jump if false, k]; jumps count instructions after the next one.
  const program: [number, number, number, number][] = [
    [LD, 0, 0, 4], // 0: arch
    [JEQ, 0, 9, 0xc000003e], // 1: x86-64, else 11
    [LD, 0, 0, 0], // 2: nr
    [JEQ, 12, 0, SYSCALL_EXECVE], // 3: → 16 notify
    [JEQ, 11, 0, SYSCALL_EXECVEAT], // 4: → 16
    [JEQ, 9, 0, 0x40000000 + 520], // 5: x32 execve → 15 refuse
    [JEQ, 8, 0, 0x40000000 + 545], // 6: x32 execveat → 15
    [JEQ, 0, 6, SYS_SECCOMP], // 7: seccomp(), else → 14 allow
    [LD, 0, 0, 24], // 8: its flags (args[1], low half)
    [JSET, 5, 0, SECCOMP_FILTER_FLAG_NEW_LISTENER], // 9: → 15 refuse
    [RET, 0, 0, ALLOW], // 10
    [LD, 0, 0, 0], // 11: nr, in another ABI (i386 through int 0x80)
    [JEQ, 2, 0, 11], // 12: i386 execve → 15
    [JEQ, 1, 0, 358], // 13: i386 execveat → 15
    [RET, 0, 0, ALLOW], // 14
    [RET, 0, 0, REFUSE], // 15
    [RET, 0, 0, NOTIFY], // 16
  ];
  const bytes = new Uint8Array(program.length * 8);
  const view = new DataView(bytes.buffer);
  program.forEach(([code, jt, jf, k], i) => {
    view.setUint16(i * 8, code, true);
    view.setUint8(i * 8 + 2, jt);
    view.setUint8(i * 8 + 3, jf);
    view.setUint32(i * 8 + 4, k >>> 0, true);
  });
  return bytes;
}

/**
 * In the launcher, before anything else: the filter on every thread of it
 * (and so on every command it starts), its listener sent to the supervisor
 * (and the launcher's own copy closed), then one execve of a path that does
 * not exist, which blocks until the supervisor answers it: proof that it
 * judges. Returns why not.
 */
function putLauncherUnderExecJudge(subreaper: boolean): string | undefined {
  const c = libc()?.symbols;
  if (!c) return "cannot open libc.so.6 through bun:ffi";
  const { ptr } = require("bun:ffi") as typeof import("bun:ffi");
  if (subreaper && c.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) !== 0)
    return `prctl(PR_SET_CHILD_SUBREAPER) was refused: ${lastErrno()}`;
  const filter = execFilterProgram();
  // struct sock_fprog { u16 len; /* 6 bytes of padding */ struct sock_filter *filter; }
  const fprog = new BigUint64Array([BigInt(filter.length / 8), BigInt(ptr(filter))]);
  const flags = SECCOMP_FILTER_FLAG_NEW_LISTENER | SECCOMP_FILTER_FLAG_TSYNC | SECCOMP_FILTER_FLAG_TSYNC_ESRCH;
  const listener = Number(c.syscall(SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, flags, ptr(fprog), 0, 0));
  if (listener < 0) return `the exec filter was refused (seccomp: ${lastErrno()})`;
  const sent = sendDescriptor(EXEC_JUDGE_SOCKET_FD, listener);
  c.close(listener);
  c.close(EXEC_JUDGE_SOCKET_FD);
  if (!sent) return `cannot hand the exec filter's listener to the supervisor: ${lastErrno()}`;
  const none = new BigUint64Array(1);
  c.execve(Buffer.from("/proc/aic-exec-judge-handshake\0"), ptr(none), ptr(none));
  const answered = lastErrno();
  // ENOSYS: the call found no listener, so nobody judges; ENOENT is the kernel's own answer once it went on.
  return answered === "ENOENT" ? undefined : `the exec supervisor did not answer (${answered})`;
}

/**
 * struct msghdr for one byte and one descriptor (SCM_RIGHTS), as x86-64 lays it out: msg_name, msg_namelen,
 * msg_iov, msg_iovlen, msg_control, msg_controllen, msg_flags; with its iovec and control buffers, kept alive.
 */
function descriptorMessage(fd = -1) {
  const { ptr } = require("bun:ffi") as typeof import("bun:ffi");
  const byte = new Uint8Array(1);
  const iov = new BigUint64Array([BigInt(ptr(byte)), 1n]);
  const control = new Uint8Array(24); // struct cmsghdr { size_t len; int level; int type; } + the descriptor, padded
  const view = new DataView(control.buffer);
  view.setBigUint64(0, 20n, true); // CMSG_LEN(sizeof(int))
  view.setInt32(8, 1, true); // SOL_SOCKET
  view.setInt32(12, 1, true); // SCM_RIGHTS
  view.setInt32(16, fd, true);
  const header = new BigUint64Array([0n, 0n, BigInt(ptr(iov)), 1n, BigInt(ptr(control)), 24n, 0n]);
  return { header, byte, iov, control, view };
}

function sendDescriptor(socket: number, fd: number): boolean {
  const { ptr } = require("bun:ffi") as typeof import("bun:ffi");
  const m = descriptorMessage(fd);
  return Number(libc()!.symbols.sendmsg(socket, ptr(m.header), 0)) === 1;
}

/** The descriptor a peer sent on `socket`, or -1 when it sent none (it ended first). */
function receiveDescriptor(socket: number): number {
  const { ptr } = require("bun:ffi") as typeof import("bun:ffi");
  const m = descriptorMessage();
  m.view.setInt32(8, 0, true);
  m.view.setInt32(12, 0, true);
  const MSG_CMSG_CLOEXEC = 0x40000000;
  if (Number(libc()!.symbols.recvmsg(socket, ptr(m.header), MSG_CMSG_CLOEXEC)) !== 1) return -1;
  const ok = m.view.getInt32(8, true) === 1 && m.view.getInt32(12, true) === 1;
  return ok ? m.view.getInt32(16, true) : -1;
}

/** A C string at `address` in the memory of `mem` (a /proc/PID/mem descriptor), up to `max` bytes; undefined past that. */
function readMemoryString(mem: number, address: number, max: number): string | undefined {
  const chunks: Buffer[] = [];
  let total = 0;
  while (total < max) {
    // Up to the end of the page: the next one may not be mapped.
    const size = Math.min(4096 - ((address + total) % 4096), max - total);
    const chunk = Buffer.alloc(size);
    const got = fs.readSync(mem, chunk, 0, size, address + total);
    if (got <= 0) return undefined;
    const end = chunk.subarray(0, got).indexOf(0);
    if (end >= 0) return Buffer.concat([...chunks, chunk.subarray(0, end)]).toString("utf8");
    chunks.push(chunk.subarray(0, got));
    total += got;
  }
  return undefined;
}

/** The NULL-terminated array of C strings at `address`: argv as the caller passed it; undefined when too big or unreadable. */
function readStringArray(mem: number, address: number): string[] | undefined {
  const strings: string[] = [];
  let bytes = 0;
  const slot = Buffer.alloc(8);
  for (let i = 0; address !== 0; i++) {
    if (fs.readSync(mem, slot, 0, 8, address + i * 8) !== 8) return undefined;
    const at = Number(slot.readBigUInt64LE(0));
    if (at === 0) return strings;
    const s = readMemoryString(mem, at, Math.min(EXEC_PATH_MAX * 32, EXEC_ARGV_MAX_BYTES - bytes));
    if (s === undefined) return undefined;
    bytes += s.length + 1;
    strings.push(s);
  }
  return strings;
}

// ════════════════════════════════════════════════════════════════════════════
// Sandbox: the program an exec names, and the verdict
// Owns: finding the program an execve names as the kernel would (by path,
// inode, a plain copy, argv[0], the loader, a #! interpreter), the deny rules'
// verdict on its real argv, and the supervisor that answers every notification
// until the commands are gone.
// ════════════════════════════════════════════════════════════════════════════

/** One execve as the supervisor sees it: the calling thread, the path it gave and where a relative one starts. */
interface ExecCall {
  /** The calling thread's id (its /proc entry has the caller's memory, descriptors and cwd). */
  tid: number;
  /** The path as given (for execveat, relative to `base`; "" with AT_EMPTY_PATH: `base` itself). */
  given: string;
  /** Where a relative path starts, as the kernel will see it: the cwd's path, or /proc/TID/fd/N. */
  base: string;
  /** The caller's working directory (an interpreter's path starts there, and the rules judge from there). */
  cwd: string;
  /** The caller's argv: read only when the program is one the rules name. */
  argv(): string[] | undefined;
}

/** What the supervisor judges with: the rules, the programs they name, and how to know those programs under any name. */
interface ExecJudge {
  rules: CommandRule[];
  /** dev:ino of the supervisor's root directory: paths are resolved there, so a caller must share it. */
  root: string;
  programs: Set<string>;
  /** dev:ino of each file of a named program: links under another name are that program. */
  inodes: Map<string, string>;
  /** dev:ino of the dynamic loaders: `ld.so PROGRAM` runs PROGRAM without another execve. */
  loaders: Set<string>;
  /**
   * Size → hash of the first megabyte → program: a plain copy of a named program's file is that program, and
   * a plain copy of a loader (the program "") a loader.
   */
  copies: Map<number, Map<string, string>>;
}

const LOADER_FILES = [
  "/lib64/ld-linux-x86-64.so.2",
  "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
  "/usr/lib64/ld-linux-x86-64.so.2",
  "/lib/ld-musl-x86_64.so.1",
];
const COPY_HASH_BYTES = 1 << 20;

function execJudgeOf(ruleLines: readonly string[]): ExecJudge {
  const rules = parseRuleLines(ruleLines.join("\n")).rules;
  const programs = new Set(rules.map((r) => baseName(r.words[0] ?? "")).filter(Boolean));
  const top = fs.statSync("/");
  const root = `${top.dev}:${top.ino}`;
  const judge: ExecJudge = { rules, programs, root, inodes: new Map(), loaders: new Set(), copies: new Map() };
  for (const name of programs)
    for (const file of programFiles(name)) {
      const st = fs.statSync(file, { throwIfNoEntry: false });
      if (!st?.isFile()) continue;
      judge.inodes.set(`${st.dev}:${st.ino}`, name);
      const hash = headHash(file, false);
      if (hash) judge.copies.set(st.size, (judge.copies.get(st.size) ?? new Map()).set(hash, name));
    }
  for (const file of LOADER_FILES) {
    const st = fs.statSync(file, { throwIfNoEntry: false });
    if (!st?.isFile()) continue;
    judge.loaders.add(`${st.dev}:${st.ino}`);
    const hash = headHash(fs.realpathSync(file), false);
    if (hash) judge.copies.set(st.size, (judge.copies.get(st.size) ?? new Map()).set(hash, ""));
  }
  return judge;
}

/** A hash of the first megabyte of a regular file (`magic`: a /proc descriptor link, which must be followed). */
function headHash(file: string, magic: boolean): string | undefined {
  try {
    const fd = fs.openSync(file, O.O_RDONLY | O.O_NONBLOCK | (magic ? 0 : O.O_NOFOLLOW));
    try {
      if (!fs.fstatSync(fd).isFile()) return undefined;
      const buf = Buffer.alloc(COPY_HASH_BYTES);
      const got = fs.readSync(fd, buf, 0, buf.length, 0);
      return createHash("sha256").update(buf.subarray(0, got)).digest("hex");
    } finally {
      fs.closeSync(fd);
    }
  } catch {
    return undefined;
  }
}

/** The `#!` line of a regular file: the interpreter's path and its one optional argument. */
function shebangOf(file: string, magic: boolean): { interpreter: string; arg?: string } | undefined {
  try {
    const fd = fs.openSync(file, O.O_RDONLY | O.O_NONBLOCK | (magic ? 0 : O.O_NOFOLLOW));
    try {
      if (!fs.fstatSync(fd).isFile()) return undefined;
      const buf = Buffer.alloc(256);
      const line = buf.toString("latin1", 0, fs.readSync(fd, buf, 0, buf.length, 0)).split("\n")[0]!;
      if (!line.startsWith("#!")) return undefined;
      const m = /^#!\s*(\S+)(?:\s+(.*?))?\s*$/.exec(line);
      return m ? { interpreter: m[1]!, arg: m[2] || undefined } : undefined;
    } finally {
      fs.closeSync(fd);
    }
  } catch {
    return undefined;
  }
}

/** A /proc entry the kernel follows as an object, not as text (a descriptor, a cwd, a root, an executable). */
const PROC_MAGIC_LINK = /^\/proc\/\d+(\/task\/\d+)?\/(fd\/\d+|cwd|root|exe|map_files\/[^/]+)$/;

/**
 * The path the caller's execve will open, resolved the way the kernel does
 * for it (each link followed where it leads, `..` after the link, /proc/self
 * as the caller, a /proc descriptor as its object), as a path that means the
 * same file here; undefined when the kernel will not find it either; "weird"
 * for what this resolver does not follow (refused).
 */
function resolveForCaller(tid: number, given: string, base: string): string | undefined | "weird" {
  const pending = (given.startsWith("/") ? given : `${base}/${given}`).split("/");
  let at = "";
  for (let links = 0; pending.length;) {
    let part = pending.shift()!;
    if (part === "" || part === ".") continue;
    if (part === "..") {
      if (PROC_MAGIC_LINK.test(at)) return "weird";
      at = at.slice(0, Math.max(0, at.lastIndexOf("/")));
      continue;
    }
    if (at === "/proc" && part === "self") part = String(tid);
    else if (at === "/proc" && part === "thread-self") part = `${tid}/task/${tid}`;
    const next = `${at}/${part}`;
    let st: fs.Stats | undefined;
    try {
      st = fs.lstatSync(next, { throwIfNoEntry: false });
    } catch {
      return undefined; // ENOTDIR, EACCES, ELOOP: the kernel's walk ends there too
    }
    if (!st) return undefined;
    if (!st.isSymbolicLink()) {
      at = next;
      continue;
    }
    if (PROC_MAGIC_LINK.test(next)) {
      if (!pending.some((p) => p && p !== ".")) return next;
      const target = fs.readlinkSync(next);
      if (!target.startsWith("/") || target.endsWith(" (deleted)")) return "weird";
      at = target === "/" ? "" : target;
      continue;
    }
    if (++links > 40) return undefined; // ELOOP
    const target = fs.readlinkSync(next);
    pending.unshift(...target.split("/"));
    if (target.startsWith("/")) at = "";
  }
  return at || "/";
}

/** A resolved file as the rules know it: a named program (`via`: how it was known), the dynamic loader, or neither. */
function programOf(
  judge: ExecJudge,
  file: string,
  name: string,
): { program: string; by: "name" | "file" } | "loader" | undefined {
  const magic = PROC_MAGIC_LINK.test(file);
  const st = fs.statSync(file, { throwIfNoEntry: false });
  if (!st?.isFile()) return undefined;
  const key = `${st.dev}:${st.ino}`;
  const linked = judge.inodes.get(key);
  if (linked) return { program: linked, by: "file" };
  if (judge.loaders.has(key)) return "loader";
  const sameSize = judge.copies.get(st.size);
  const copied = sameSize ? sameSize.get(headHash(file, magic) ?? "") : undefined;
  if (copied === "") return "loader";
  if (copied) return { program: copied, by: "file" };
  if (judge.programs.has(name)) return { program: name, by: "name" };
  const dashed = [...judge.programs].find((p) => name.startsWith(`${p}-`) && name.length > p.length + 1);
  return dashed ? { program: dashed, by: "name" } : undefined;
}

/** git's global `-c`/`--config-env` settings that matter at exec: aliases and includes (git runs those in-process). */
function withoutHarmlessGitSettings(args: string[]): string[] {
  const out: string[] = [];
  let i = 0;
  for (; i < args.length && args[i]!.startsWith("-"); i++) {
    const a = args[i]!;
    const pair = a === "-c" || a === "--config-env" ? [a, args[++i] ?? ""] : [a];
    const setting = (pair[1] ?? a.replace(/^(-c|--config-env=)/, "")).toLowerCase();
    const isSetting = a === "-c" || a === "--config-env" || a.startsWith("--config-env=") || /^-c./.test(a);
    if (a.startsWith("--exec-path")) continue; // it only moves where git-WORD programs are found, each judged as it runs
    if (isSetting && !/^(alias\.|include\.|includeif\.)/.test(setting)) continue; // a program it makes git run is judged as it runs
    out.push(...pair);
  }
  return [...out, ...args.slice(i)];
}

/**
 * The command line an exec amounts to for the rules, or undefined when it is
 * none of the programs they name: known by name, by file (a link or plain
 * copy under another name), as `git-push` for `git push` (the way git reads
 * its argv[0]), through the dynamic loader, or as the interpreter of a `#!`
 * script, which the kernel starts without another execve.
 */
function judgedLine(judge: ExecJudge, call: ExecCall, depth = 0): string | undefined | "weird" {
  if (depth > 4) return "weird";
  const file = resolveForCaller(call.tid, call.given, call.base);
  if (file === undefined || file === "weird") return file;
  const name = baseName(call.given === "" ? file : call.given);
  const known = programOf(judge, file, name);
  if (known === undefined) {
    const script = shebangOf(file, PROC_MAGIC_LINK.test(file));
    if (!script) return undefined;
    const argv = () => {
      const given = call.argv();
      return given && [script.interpreter, ...(script.arg ? [script.arg] : []), call.given, ...given.slice(1)];
    };
    return judgedLine(judge, { ...call, given: script.interpreter, base: call.cwd, argv }, depth + 1);
  }
  const argv = call.argv();
  if (!argv) return "weird";
  if (known === "loader") {
    let i = 1;
    let argv0: string | undefined;
    while (i < argv.length && argv[i]!.startsWith("--")) {
      if (argv[i] === "--argv0") argv0 = argv[i + 1];
      i += ["--list", "--verify", "--inhibit-cache", "--inhibit-rpath"].includes(argv[i]!) ? 1 : 2;
    }
    const program = argv[i];
    if (!program) return undefined;
    const rest = [argv0 ?? program, ...argv.slice(i + 1)];
    return judgedLine(judge, { ...call, given: program, base: call.cwd, argv: () => rest }, depth + 1);
  }
  const { program } = known;
  // git takes its command from argv[0]'s name (`git-push`), the file's name from the path (a `git-WORD` program).
  const dashedName = known.by === "file" ? baseName(argv[0] ?? "") : name;
  const sub = dashedName.startsWith(`${program}-`) ? [dashedName.slice(program.length + 1)] : [];
  const rest = program === "git" ? withoutHarmlessGitSettings(argv.slice(1)) : argv.slice(1);
  return [program, ...sub, ...rest].map(shellQuoted).join(" ");
}

/** Reads one notification's call: the path now, the argv on demand; undefined when the caller's memory cannot be read. */
function readExecCall(tid: number, nr: number, args: BigUint64Array, mem: number): ExecCall | undefined {
  const at = (i: number) => Number(args[i]!);
  const execveat = nr === SYSCALL_EXECVEAT;
  const given = readMemoryString(mem, at(execveat ? 1 : 0), EXEC_PATH_MAX);
  if (given === undefined) return undefined;
  const dirfd = execveat ? Number(BigInt.asIntN(32, args[0]!)) : -100; // AT_FDCWD
  const descriptor = `/proc/${tid}/fd/${dirfd}`;
  const cwd = fs.readlinkSync(`/proc/${tid}/cwd`);
  const base = dirfd === -100 ? cwd : given === "" ? descriptor : fs.readlinkSync(descriptor);
  let argv: string[] | undefined | null = null;
  const readArgv = () => (argv === null ? (argv = readStringArray(mem, at(execveat ? 2 : 1))) : argv);
  return { tid, given, base, cwd, argv: readArgv };
}

/** The one line a refused program's caller sees on its standard error (its terminal, for a command). */
function tellRefusedCaller(tid: number, line: string): void {
  try {
    const fd = fs.openSync(`/proc/${tid}/fd/2`, O.O_WRONLY | O.O_APPEND | O.O_NONBLOCK | O.O_NOCTTY);
    try {
      const st = fs.fstatSync(fd);
      if (st.isCharacterDevice() || st.isFIFO()) fs.writeSync(fd, `${line}\n`);
    } finally {
      fs.closeSync(fd);
    }
  } catch {
    /* a caller without a standard error to write to still gets EPERM */
  }
}

/** Judges one call: undefined lets it go on; a string is the refusal the caller is told. */
function judgeExec(judge: ExecJudge, call: ExecCall | undefined): string | undefined {
  if (!call)
    return "aic: refused at exec: the program it starts cannot be read (a process that made itself non-dumpable?)";
  // A caller that changed its root (chroot after unshare(CLONE_NEWUSER)) names files the judge would look up in
  // another tree: its `/usr/bin/true` may be git.
  let root: fs.Stats | undefined;
  try {
    root = fs.statSync(`/proc/${call.tid}/root`, { throwIfNoEntry: false });
  } catch {
    root = undefined;
  }
  if (!root || `${root.dev}:${root.ino}` !== judge.root)
    return `aic: refused at exec: ${oneLine(call.given, 200)}: a process whose root directory is not the sandbox's (chroot), while a deny rule names a program by its arguments`;
  let line: string | undefined | "weird";
  try {
    line = judgedLine(judge, call);
  } catch (error) {
    return `aic: refused at exec: ${call.given}: the judge could not follow it (${(error as Error).message})`;
  }
  if (line === undefined) return undefined;
  if (line === "weird")
    return `aic: refused at exec: ${oneLine(call.given, 200)}: a path or argv the judge cannot follow whole, while a deny rule names a program by its arguments`;
  const verdict = judgeCommand(judge.rules, line, { cwd: call.cwd, root: call.cwd });
  if (RULE_KINDS[verdict.verdict].gate === "refuse")
    return `aic: refused at exec: ${oneLine(line, 200)} — the rule "${verdict.rule?.written}"${verdict.rule?.reason ? ` (${verdict.rule.reason})` : ""}`;
  if (verdict.unsure)
    return `aic: refused at exec: ${oneLine(line, 200)} — it cannot be judged while a deny rule names ${line.split(" ")[0]} (${verdict.unsure})`;
  return undefined;
}

/**
 * `__sandbox-exec` / the jail's init, once confined, when a deny rule names a
 * subcommand or arguments: starts the launcher as its child and judges every
 * execve of it and of its commands until none is left. Returns the
 * launcher's exit code.
 */
async function superviseLauncher(ruleLines: readonly string[], argv: string[]): Promise<number> {
  const c = libc()!.symbols;
  c.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
  if (process.pid === 1) for (const sig of INIT_IGNORED_SIGNALS) c.signal(sig, SIG_IGN);
  const judge = execJudgeOf(ruleLines);
  // Can the supervisor read a non-dumpable launcher's children (CAP_SYS_PTRACE kept, see sandboxExec)?
  const capEff = /^CapEff:\s*([0-9a-f]+)$/m.exec(fs.readFileSync("/proc/self/status", "utf8"))?.[1] ?? "0";
  const reads = (BigInt(`0x${capEff}`) & (1n << BigInt(CAP_SYS_PTRACE))) !== 0n ? "+ptrace" : "";
  const env = { ...process.env, [EXEC_JUDGE_ENV]: (process.pid === 1 ? "init" : "child") + reads };
  // A socket pair for the listener, which the launcher sends once it has made it (pidfd_getfd would be simpler, but
  // Docker's default profile refuses it without CAP_SYS_PTRACE).
  const { ptr } = require("bun:ffi") as typeof import("bun:ffi");
  const pair = new Int32Array(2);
  if (c.socketpair(1 /* AF_UNIX */, 1 /* SOCK_STREAM */ | O_CLOEXEC, 0, ptr(pair)) !== 0)
    return (writeOut(2, `aic sandbox: cannot make the exec judge's socket: ${lastErrno()}\n`), 126);
  // Descriptor 3 (aic's own binary, by which the launcher is started) and the pair's other end (its descriptor 4) go
  // on to it; Bun's types know three entries.
  const stdio = ["inherit", "inherit", "inherit", 3, pair[1]] as unknown as ["inherit", "inherit", "inherit"];
  const launcher = Bun.spawn(argv, { stdio, env });
  fs.closeSync(3);
  fs.closeSync(pair[1]!);
  // Blocking: until the launcher sends the listener, or ends (the pair then reads end of file).
  const listener = receiveDescriptor(pair[0]!);
  fs.closeSync(pair[0]!);
  if (listener >= 0) await judgeExecsUntilDone(judge, listener, launcher);
  return await launcher.exited;
}

/** The supervisor's loop: blocking, since it has nothing else to do; it looks up between calls to see the launcher gone. */
async function judgeExecsUntilDone(judge: ExecJudge, listener: number, launcher: Bun.Subprocess): Promise<void> {
  const c = libc()!.symbols;
  const { ptr } = require("bun:ffi") as typeof import("bun:ffi");
  // struct pollfd { int fd; short events; short revents; }
  const pollfd = new Int32Array([listener, 1 /* POLLIN */]);
  const notif = new BigUint64Array(10); // struct seccomp_notif: id, pid|flags, nr|arch, ip, args[6]
  const response = new BigUint64Array(3); // struct seccomp_notif_resp: id, val, error|flags
  const id = new BigUint64Array(1);
  for (;;) {
    pollfd[1] = 1;
    const ready = c.poll(ptr(pollfd), 1, 250);
    const revents = pollfd[1]! >>> 16;
    if (ready > 0 && revents & 1) {
      notif.fill(0n);
      if (c.ioctl(listener, SECCOMP_IOCTL_NOTIF_RECV, ptr(notif)) !== 0) continue; // the caller died meanwhile
      const tid = Number(notif[1]! & 0xffffffffn);
      const nr = Number(BigInt.asIntN(32, notif[2]! & 0xffffffffn));
      let mem = -1;
      try {
        mem = fs.openSync(`/proc/${tid}/mem`, "r");
      } catch {
        /* not readable (a non-dumpable caller): refused below */
      }
      id[0] = notif[0]!;
      // The thread id may have been reused before its memory was opened: only a call still waiting is judged.
      if (c.ioctl(listener, SECCOMP_IOCTL_NOTIF_ID_VALID, ptr(id)) !== 0) {
        if (mem >= 0) fs.closeSync(mem);
        continue;
      }
      let refusal: string | undefined;
      try {
        refusal = judgeExec(judge, mem < 0 ? undefined : readExecCall(tid, nr, notif.subarray(4, 10), mem));
      } catch {
        refusal = judgeExec(judge, undefined);
      } finally {
        if (mem >= 0) fs.closeSync(mem);
      }
      if (refusal) tellRefusedCaller(tid, refusal);
      response[0] = notif[0]!;
      response[1] = 0n;
      response[2] = refusal ? BigInt(-EPERM >>> 0) : BigInt(SECCOMP_USER_NOTIF_FLAG_CONTINUE) << 32n;
      c.ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, ptr(response));
    } else if (revents & 0x18 /* POLLHUP | POLLERR */) return;
    else if (ready === 0) {
      // Idle: let Bun see the launcher's exit (the kernel keeps the filter while its zombie is unreaped).
      await Bun.sleep(0);
      if (launcher.exitCode !== null || launcher.signalCode !== null) return;
    }
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Sandbox: a run's sandbox
// Owns: what one run sets up: the paths and plan, the jail or the reason for
// none, the launcher started once the session is claimed, the repository
// guard, and the start line that says all of it.
// ════════════════════════════════════════════════════════════════════════════

/** What the jail is told of aic's own files when it starts: the start directory (held), session files to keep read-only, this run's outputs. */
interface OwnFiles {
  workDir: HeldDirectory;
  files: string[];
  keepOutputs: string | undefined;
}

/** aic's own state a command could use: checkpoint stores, locks, saved outputs, and the prompt history. */
function aicStatePaths(home: string | undefined): string[] {
  const state = aicStateDir();
  return [...(state ? [state] : []), ...(home ? [path.join(home, ".aic_history")] : [])];
}

/**
 * How many other runs' saved outputs the jail covers, newest first. Anyone who can write /tmp can make
 * directories of that name, and each one covered is a mount: thousands of them must not stop a run.
 */
const MAX_COVERED_OUTPUT_DIRS = 256;

/** aic's state, and the saved outputs of other runs of this user (the newest): the jail covers them. */
function ownStatePaths(home: string | undefined, keepOutputs: string | undefined): string[] {
  const tmp = HeldDirectory.open(os.tmpdir());
  const uid = process.getuid?.();
  const outputs: { dir: string; at: number }[] = [];
  for (const e of tmp.entries()) {
    if (!e.isDirectory() || !e.name.startsWith(OUTPUT_DIR_PREFIX) || tmp.display(e.name) === keepOutputs) continue;
    const st = fs.lstatSync(tmp.at(e.name), { throwIfNoEntry: false });
    // Another user's are theirs to guard (aic makes them 0700): this user's commands cannot read them.
    if (st?.isDirectory() && st.uid === uid) outputs.push({ dir: tmp.display(e.name), at: st.mtimeMs });
  }
  tmp.close();
  outputs.sort((a, b) => b.at - a.at);
  return [...aicStatePaths(home), ...outputs.slice(0, MAX_COVERED_OUTPUT_DIRS).map((o) => o.dir)];
}

/**
 * One argument may not pass 128 KB (the kernel's MAX_ARG_STRLEN): a plan larger than this goes to the
 * launcher in a private file instead, named after `@`, which aic removes when it exits.
 */
const MAX_PLAN_ARGUMENT = 64 * 1024;

function planArgument(plan: unknown): string {
  const json = JSON.stringify(plan);
  if (json.length <= MAX_PLAN_ARGUMENT) return json;
  const state = aicStateDir();
  let dir: HeldDirectory | undefined;
  try {
    if (state) dir = HeldDirectory.createPrivate(state, "plan-");
  } catch {
    /* a read-only home: /tmp instead, in a directory only this user can enter */
  }
  dir ??= HeldDirectory.createPrivate(os.tmpdir(), "aic-plan-");
  const fd = dir.createExclusive("plan.json");
  try {
    writeAll(fd, json);
  } finally {
    fs.closeSync(fd);
  }
  dir.close();
  // Kept while aic runs: a launcher started again (after the jail was refused) reads it again.
  process.once("exit", () => fs.rmSync(dir.path, { recursive: true, force: true }));
  return `@${path.join(dir.path, "plan.json")}`;
}

/** The plan a launcher was given: the argument itself, or the file `planArgument` wrote. */
function readPlanArgument(arg: string | undefined): unknown {
  if (!arg?.startsWith("@")) return JSON.parse(arg ?? "{}");
  return JSON.parse(readOwnFile(arg.slice(1), MAX_OWN_FILE_BYTES).toString("utf8"));
}

/** The jail's half of the sandbox: whether it is used, and if not, why. */
interface JailChoice {
  /** Why namespaces are not used (undefined: the jail is tried). */
  refused: string | undefined;
  net: boolean;
  allowSshAgent: boolean;
}

/** A deny rule as the sandbox needs it: its words, and its text for the exec judge. */
type DenyRule = Pick<CommandRule, "written" | "words">;

function setUpSandbox(
  config: Config,
  deniedPrograms: readonly string[] = [],
  denyRules: readonly DenyRule[] = [],
): Sandbox {
  // A run asked to keep commands off the network must not quietly run them on it.
  const noNetwork = (why: string) => new UsageError(`--network off needs the jail, which cannot be used here: ${why}`);
  // aic's own binary by descriptor (fd 3 of the launcher), as for the confined launcher below.
  const keeper = config.keepJobs ? ["/proc/self/fd/3", ...selfArgv().slice(1), SANDBOX_LAUNCHER] : undefined;
  if (config.disableSandbox) {
    if (config.network === "off") throw noNetwork("--disable-sandbox");
    return sandboxOff("--disable-sandbox", keeper);
  }
  const abi = landlockAbi();
  if (typeof abi === "string") {
    if (config.network === "off") throw noNetwork(abi);
    return sandboxOff(abi, keeper);
  }
  const home = homeDirectory();
  const paths = sandboxPaths(config, home, deniedPrograms, denyRules);
  noteCommandWritable(paths.writable);
  // The launcher must be something a confined command cannot swap out: aic's own binary by descriptor (fd 3 of
  // the child, opened from /proc/self/exe when it starts), the very inode running now.
  const launcher = selfArgv();
  const script = launcher[1];
  if (script && paths.writable.some((dir) => script === dir || isBeneath(script, dir)))
    return sandboxOff(
      `the aic script ${script} lives where commands may write, so they could change the sandbox launcher; run the compiled binary`,
    );
  const jail: JailChoice = {
    // Decided by trying: a container's seccomp profile or an AppArmor rule refuses what no file says it will.
    refused: namespacesRefused() ?? namespacesTried(config.network === "off"),
    net: config.network === "off",
    allowSshAgent: config.allowSshAgent,
  };
  if (jail.net && jail.refused) throw noNetwork(jail.refused);
  return liveSandbox(config, { abi, home, paths, self: ["/proc/self/fd/3", ...launcher.slice(1)], jail });
}

/** Where commands may write and read, as the Landlock plan holds it, and what the start line says of it. */
interface SandboxPaths {
  caches: string[];
  writable: string[];
  secrets: string[];
  /** Secret stores inside a package cache: hidden by the jail, readable under Landlock alone. */
  inCaches: string[];
  /** Secret stores inside a writable tree: said at start instead of half-protected. */
  exposed: string[];
  /** Programs deny rules forbid outright whose files commands cannot execute or read. */
  enforced: string[];
  plan: SandboxPlan;
}

function sandboxPaths(
  config: Config,
  home: string | undefined,
  deniedPrograms: readonly string[],
  denyRules: readonly DenyRule[],
): SandboxPaths {
  const caches = home ? prepareCaches(home) : [];
  // Real paths, so the launcher can open each without following a link (a command may plant one later).
  const real = (dir: string) => (fs.lstatSync(dir).isSymbolicLink() ? fs.realpathSync(dir) : dir);
  const writable = [...new Set([process.cwd(), "/tmp", "/dev", ...caches, ...config.allowWrite].map(real))];
  const inWritable = (p: string) => writable.some((w) => p === w || isBeneath(p, w));
  const named =
    home && !config.allowReadSecrets
      ? SECRET_STORES.flatMap((s) =>
          s === ".ssh" && config.allowSshAgent ? sshPrivateFiles(home) : [path.join(home, s)],
        )
      : [];
  const covered = (p: string) => inWritable(p) || named.some((s) => p === s || isBeneath(p, s));
  const shaped = home && !config.allowReadSecrets ? credentialShapedPaths(home, covered) : [];
  const stores = liftAllowedReads([...named, ...shaped], config.allowRead);
  // A secret store inside a writable tree (aic started in ~) cannot be kept unreadable: commands may rewrite it
  // anyway, and files they create there later must be readable.
  const inCache = (p: string) =>
    caches.some((c) => isBeneath(p, real(c))) &&
    !writable.some((w) => !caches.includes(w) && (p === w || isBeneath(p, w)));
  // A store inside a package cache (~/.cache/huggingface/token) the jail covers with a file of its own; Landlock,
  // which only grants, cannot take one file out of a tree it lets commands write.
  const inCaches = stores.filter((s) => inWritable(s) && inCache(s));
  const exposed = stores.filter((s) => inWritable(s) && !inCaches.includes(s));
  const secrets = stores.filter((s) => !inWritable(s));
  // A program a deny rule forbids outright cannot be executed, nor read (so it cannot be copied and run).
  const binaries = deniedPrograms.flatMap(programFiles).filter((f) => !writable.some((w) => isBeneath(f, w)));
  // aic's own state is unreadable under Landlock alone too, where it is not in a writable tree (the jail hides it all).
  const state = aicStatePaths(home).filter((p) => !inWritable(p));
  const enforced = deniedPrograms.filter((name) => programFiles(name).some((f) => binaries.includes(f)));
  const plan = planSandbox(writable, [...secrets, ...state], binaries);
  // What the kernel cannot refuse by file (a subcommand, arguments, a program where commands write) is judged at exec.
  const judged = denyRules.filter((r) => r.words.length !== 1 || !enforced.includes(r.words[0]!));
  if (judged.length && !execJudgeMissing()) plan.judgeExec = judged.map((r) => r.written);
  return { caches: caches.map(real), writable, secrets, inCaches, exposed, enforced, plan };
}

/** The sandbox of a run: its facts for the start line and the JSON, and the launcher started once the session is claimed. */
function liveSandbox(
  config: Config,
  o: { abi: number; home: string | undefined; paths: SandboxPaths; self: string[]; jail: JailChoice },
): Sandbox {
  const { abi, home, self, jail } = o;
  const { caches, writable, secrets, inCaches, exposed, enforced, plan } = o.paths;
  const heldAtExec = plan.judgeExec ?? [];
  const seen = { abi, home, writable, caches, secrets, inCaches, exposed, enforced, heldAtExec, jail, config };
  const status = sandboxStatus(seen);
  let commands: SandboxLauncher | undefined;
  let guard: GitGuard | undefined;
  const facts = {
    enabled: true,
    writable,
    caches,
    secrets: plan.confineReads ? secrets : [],
    ruleCount: plan.rules.length,
    deniedPrograms: enforced,
    heldAtExec,
  };
  return {
    ...facts,
    get status() {
      return status();
    },
    get jail() {
      return jail.refused ? "landlock" : "namespaces";
    },
    get weaker() {
      return jail.refused;
    },
    network: jail.net && !jail.refused ? "loopback" : "on",
    sshAgent: config.allowSshAgent,
    get reaper() {
      return commands?.reaper;
    },
    // Started once the session is claimed (its lock file is protected by the jail), and awaited by the first
    // command, so start-up never waits for it. It fails closed: when the kernel offers Landlock but the launcher
    // cannot confine itself, commands are refused with its reason.
    start(own) {
      guard = new GitGuard({
        workDir: own.workDir,
        allowWrite: config.allowWrite,
        writable,
        ownRules: config.rules ?? path.join(own.workDir.path, RULES_FILE_NAME),
      });
      const gitDirs = guard.gitDirs;
      commands = startLauncher({
        self,
        plan,
        jail,
        own,
        home,
        secrets: [...secrets, ...inCaches],
        gitDirs,
        onRefused: (why) => (jail.refused = why),
      });
    },
    auditRepositories: (deep) => guard?.audit(deep) ?? { taken: [], notes: [] },
    keepRunning: () => commands?.keepRunning(),
    stopEverything: () => {
      commands?.stopEverything();
      killAdoptedOrphans();
    },
    spawn: (argv, opts) => {
      if (!commands) throw new Error("the sandbox launcher was never started");
      return commands.spawn(argv, opts);
    },
  };
}

/** The launcher, jailed when namespaces may be tried, else under Landlock alone. */
function startLauncher(o: {
  self: string[];
  plan: SandboxPlan;
  jail: JailChoice;
  own: OwnFiles;
  home: string | undefined;
  secrets: string[];
  gitDirs: string[];
  onRefused(why: string): void;
}): SandboxLauncher {
  // This run's saved outputs lie in aic's state directory, which commands may not read: the model reads them.
  const outputs = o.own.keepOutputs ? identified(o.own.keepOutputs) : undefined;
  const plan =
    outputs && o.plan.confineReads
      ? { ...o.plan, rules: [...o.plan.rules, { ...outputs, access: "r" as const }] }
      : o.plan;
  const plain = [...o.self, SANDBOX_EXEC, planArgument(plan), "--", ...o.self, SANDBOX_LAUNCHER];
  const supervised = Boolean(plan.judgeExec?.length);
  if (o.jail.refused) {
    const launcher = new SandboxLauncher(plain, false, undefined, supervised);
    void launcher.start();
    return launcher;
  }
  const keepSockets =
    o.jail.allowSshAgent && process.env.SSH_AUTH_SOCK ? [path.dirname(process.env.SSH_AUTH_SOCK)] : [];
  const jailPlan = planJail({
    net: o.jail.net,
    home: o.home,
    cwd: o.own.workDir,
    secrets: o.secrets,
    ownFiles: o.own.files,
    hiddenOwn: ownStatePaths(o.home, o.own.keepOutputs),
    keepSockets,
    gitDirs: o.gitDirs,
    reveal: outputs ? [outputs] : [],
  });
  const unshare = [UNSHARE, "--user", "--map-current-user", "--keep-caps", "--mount", "--pid", "--ipc", "--fork"];
  const argv = [...unshare, "--kill-child", ...(o.jail.net ? ["--net"] : []), ...o.self, JAIL];
  const plans = planArgument({ jail: jailPlan, sandbox: plan });
  // Without its own network, commands have no fallback: they are refused rather than run on the network.
  const fallback = o.jail.net
    ? undefined
    : { argv: plain, onRefused: (why: string) => o.onRefused(`namespaces were refused when the jail started: ${why}`) };
  const jailed = new SandboxLauncher([...argv, plans, "--", ...o.self, SANDBOX_LAUNCHER], true, fallback, supervised);
  void jailed.start();
  return jailed;
}

/** The sandbox's one line for people: what commands may write and read, and which of the jail's properties hold. */
function sandboxStatus(o: {
  abi: number;
  home: string | undefined;
  writable: string[];
  caches: string[];
  secrets: string[];
  /** Secret stores inside a package cache: hidden by the jail, readable under Landlock alone. */
  inCaches: string[];
  exposed: string[];
  enforced: string[];
  heldAtExec: readonly string[];
  jail: JailChoice;
  config: Config;
}): () => string {
  const shown = (list: readonly string[]) => list.map((p) => tildePath(p, o.home)).join(", ");
  // The line must fit a terminal: long lists show their first few (the JSON start event has them all).
  const few = (list: readonly string[], n = 3) =>
    list.length <= n + 1 ? shown(list) : `${shown(list.slice(0, n))} and ${list.length - n} more`;
  const caches = o.writable.filter((w) => o.caches.includes(w));
  const writes = `${shown(o.writable.filter((w) => !caches.includes(w)))}${caches.length ? ` and the package caches (${few(caches, 2)})` : ""}`;
  const cached = (jailed: boolean) =>
    o.inCaches.length && !jailed
      ? `; ${shown(o.inCaches)} stay readable (in a package cache commands may write: only the jail covers one file there)`
      : "";
  const unreadable = (jailed: boolean) => [...o.secrets, ...(jailed ? o.inCaches : [])];
  const notes = (jailed: boolean) =>
    (unreadable(jailed).length
      ? `; secret stores unreadable (${few(unreadable(jailed))})`
      : o.config.allowReadSecrets
        ? "; secret stores readable (--allow-read-secrets)"
        : "") +
    cached(jailed) +
    (o.exposed.length
      ? `; ${shown(o.exposed)} stay readable and writable, since aic started in a directory that holds them`
      : "") +
    (o.enforced.length ? `; denied programs cannot be executed: ${o.enforced.join(", ")}` : "") +
    (o.heldAtExec.length ? `; held at exec: ${few(o.heldAtExec.map((r) => r.replace(/^deny\s+/, "")))}` : "");
  return () => {
    const jail = o.jail.refused
      ? `Landlock alone, no jail: ${o.jail.refused}; commands can reach Unix sockets and the terminal, see other processes, write .git/config and hooks, and leave processes running after aic exits`
      : `jail: own PID, mount and IPC namespaces (your processes, sockets and terminal out of reach; .git/config and hooks read-only; nothing outlives aic)${o.jail.net ? "; network: loopback only" : ""}${o.jail.allowSshAgent ? "; ssh-agent passed through (--allow-ssh-agent)" : ""}`;
    return `on (Landlock ABI ${o.abi}; ${jail}; writes only under ${writes}${notes(!o.jail.refused)})`;
  };
}

// ════════════════════════════════════════════════════════════════════════════
// The jail
// Owns: the namespaces commands run in where the kernel lets an unprivileged
// process make them: util-linux `unshare` makes a user (the person's uid mapped
// to itself), mount, PID and IPC namespace (and a network namespace with only
// loopback, --network off) and runs `aic __jail PLAN -- … launcher` as its
// PID 1 with every capability inside. That process builds what commands see,
// by construction rather than by lists of things to block: a fresh /dev with
// its own devpts (no terminal of the person's), a /proc of the new PID
// namespace (no process of the person's), an empty directory over every
// directory holding a Unix socket of the person's and over aic's own state,
// and read-only binds of .git/config and .git/hooks and of aic's lock files.
// Then it drops every capability, applies Landlock and execs the launcher,
// which is PID 1: nothing inside can stop or kill it, and when it ends (aic
// gone, its pipe closed) the kernel ends every process of the namespace.
// Where namespaces are refused, commands run under Landlock alone (with its
// scopes) and the start line says which properties do not hold.
// ════════════════════════════════════════════════════════════════════════════

const JAIL = "__jail";
const UNSHARE = "/usr/bin/unshare";
/** The jail's init exits with this when the namespaces were made but give no power (an AppArmor profile): fall back. */
const JAIL_REFUSED_EXIT = 124;

/** What the jail's init builds before it confines itself (paths as aic saw them, with their identity). */
interface JailPlan {
  /** A network namespace of its own: bring `lo` up. */
  net: boolean;
  /** Directories covered by an empty tmpfs: read-only for secret stores and aic's state, private and writable for socket directories. */
  hideDirs: { path: string; writable: boolean }[];
  /** Files covered by an empty read-only file (a socket directly in /tmp, ~/.netrc, the prompt history). */
  hideFiles: string[];
  /** Bound onto themselves read-only: .git/config, .git/hooks, aic's session and lock files. */
  readOnly: { path: string; dev: number; ino: number }[];
  /** Bound read-only if they are still the file aic saw (aic itself may have replaced a session file meanwhile). */
  ownFiles: { path: string; dev: number; ino: number }[];
  /** Bound onto themselves as they are: git dirs, so that no command can move one aside and put its own in its place. */
  pinned: { path: string; dev: number; ino: number }[];
  /** Shown read-only inside a hidden directory: this run's saved outputs, inside aic's state directory. */
  reveal: { path: string; dev: number; ino: number }[];
}

/** Whether namespaces can be tried at all, from files only (microseconds); undefined: try (the attempt still decides). */
function namespacesRefused(): string | undefined {
  if (process.env.AIC_NO_NAMESPACES === "1") return "AIC_NO_NAMESPACES=1";
  if (process.platform !== "linux") return `not Linux (${process.platform})`;
  const sysctl = (name: string) => {
    try {
      return Number(fs.readFileSync(`/proc/sys/${name}`, "utf8").trim());
    } catch {
      return undefined;
    }
  };
  if (!fs.existsSync("/proc/self/ns/user")) return "this kernel has no user namespaces";
  if (sysctl("user/max_user_namespaces") === 0) return "user.max_user_namespaces is 0";
  const root = process.getuid?.() === 0;
  if (!root && sysctl("kernel/unprivileged_userns_clone") === 0) return "kernel.unprivileged_userns_clone is 0";
  if (!root && sysctl("kernel/apparmor_restrict_unprivileged_userns") === 1)
    return "AppArmor restricts unprivileged user namespaces (kernel.apparmor_restrict_unprivileged_userns=1)";
  if (!fs.existsSync(UNSHARE)) return `${UNSHARE} (util-linux) is missing`;
  return undefined;
}

/** The jail's promises that need namespaces: what Landlock alone does not hold (the JSON start event lists them). */
const JAIL_ONLY_PROPERTIES = [
  "processes outlive aic",
  "sockets",
  "terminal",
  "other processes' /proc",
  ".git/config read-only",
  "private /dev",
] as const;

/**
 * Makes the namespaces the jail needs, once, with a program that only exits
 * (a few milliseconds): where Docker's seccomp profile, Ubuntu's AppArmor
 * rule, gVisor or qemu-user refuses them, the reason, in the kernel's words.
 */
function namespacesTried(net: boolean): string | undefined {
  const argv = [UNSHARE, "--user", "--map-current-user", "--mount", "--pid", "--ipc", "--fork", "--kill-child"];
  try {
    const tried = Bun.spawnSync([...argv, "--mount-proc", ...(net ? ["--net"] : []), UNSHARE, "--version"], {
      stdin: "ignore",
      stdout: "ignore",
      stderr: "pipe",
      env: { PATH: "/usr/bin:/bin", LANG: "C" },
    });
    if (tried.exitCode === 0) return undefined;
    const said =
      tried.stderr
        .toString()
        .trim()
        .split("\n")[0]
        ?.replace(/^unshare: /, "") ?? "";
    return `namespaces refused (${said || `unshare exited ${tried.exitCode ?? tried.signalCode}`}), as in a container or under AppArmor`;
  } catch (error) {
    return `namespaces could not be tried (${(error as Error).message})`;
  }
}

/**
 * `dir` with the links of its last components followed (`/var/run` is
 * `/run`), without opening anything: a command may have bound the socket
 * there, so only lstat and readlink look at it. Undefined unless it ends at
 * a directory.
 */
function directoryBehindLinks(dir: string): string | undefined {
  for (let hops = 0; hops < 8; hops++) {
    // Below a directory aic may not search (another user's): no command can reach it either.
    const st = lstatIfReachable(dir);
    if (!st) return undefined;
    if (st.isDirectory()) return dir;
    if (!st.isSymbolicLink()) return undefined;
    try {
      dir = path.resolve(path.dirname(dir), fs.readlinkSync(dir));
    } catch {
      return undefined; // replaced since the lstat
    }
  }
  return undefined;
}

/**
 * The path of every pathname Unix socket something listens on, from the
 * kernel's own lists (/proc/net/unix, one per network namespace aic can
 * see: a container's or a sandboxed service's sockets are not in aic's own),
 * so no directory is walked. A socket bound by a relative name is found
 * through its owner's working directory.
 */
function listeningSockets(): string[] {
  const tables = new Map<string, number | "self">([["self", "self"]]);
  const own = (() => {
    try {
      return fs.readlinkSync("/proc/self/ns/net");
    } catch {
      return "";
    }
  })();
  for (const entry of fs.readdirSync("/proc")) {
    if (!/^\d+$/.test(entry)) continue;
    try {
      const ns = fs.readlinkSync(`/proc/${entry}/ns/net`);
      if (ns !== own && !tables.has(ns)) tables.set(ns, Number(entry));
    } catch {
      /* gone, or not ours to look at */
    }
  }
  const paths = new Set<string>();
  const relative = new Map<string, string>(); // socket inode → the name it was bound by
  for (const pid of tables.values()) {
    let table: string;
    try {
      table = fs.readFileSync(`/proc/${pid}/net/unix`, "utf8");
    } catch {
      continue;
    }
    for (const line of table.split("\n").slice(1)) {
      // Num RefCount Protocol Flags Type St Inode Path: the path is all that follows (spaces included).
      const m = /^\s*\S+:\s+\S+\s+\S+\s+\S+\s+\S+\s+\S+\s+(\d+) (.+)$/.exec(line);
      if (!m || m[2]!.startsWith("@")) continue; // unnamed, or abstract: Landlock's scope covers those
      if (m[2]!.startsWith("/")) paths.add(m[2]!);
      else relative.set(m[1]!, m[2]!);
    }
  }
  for (const p of relativeSocketPaths(relative)) paths.add(p);
  return [...paths];
}

/** Where sockets bound by a relative name are: the working directory of a process holding each, joined to its name. */
function relativeSocketPaths(names: Map<string, string>): string[] {
  if (names.size === 0) return [];
  const found: string[] = [];
  for (const entry of fs.readdirSync("/proc")) {
    if (!/^\d+$/.test(entry)) continue;
    let fds: string[];
    try {
      fds = fs.readdirSync(`/proc/${entry}/fd`);
    } catch {
      continue;
    }
    for (const fd of fds) {
      try {
        const inode = /^socket:\[(\d+)\]$/.exec(fs.readlinkSync(`/proc/${entry}/fd/${fd}`))?.[1];
        const name = inode && names.get(inode);
        if (!name) continue;
        const candidate = path.join(fs.readlinkSync(`/proc/${entry}/cwd`), name);
        if (fs.lstatSync(candidate, { throwIfNoEntry: false })?.isSocket()) found.push(candidate);
        names.delete(inode);
      } catch {
        /* gone */
      }
    }
    if (names.size === 0) break;
  }
  return found;
}

/**
 * How to hide each listening socket: its directory, unless commands must see
 * that directory (a top-level one like /tmp or $HOME, the start directory or
 * one of its ancestors), when an empty file covers the socket. Sockets under
 * the start directory are the project's own (a dev server's) and stay, unless
 * the start directory is the home directory or above it: then every socket of
 * the person's would be "the project's".
 */
function socketHiding(
  home: string | undefined,
  cwd: string,
  keep: readonly string[],
): { dirs: string[]; files: string[] } {
  const visible = ["/", "/tmp", "/run", "/var/run", "/var/tmp", "/dev/shm", ...(home ? [home] : []), ...keep];
  const projectOwnsSockets = !home || !(cwd === home || isBeneath(home, cwd));
  const dirs = new Set<string>();
  const files = new Set<string>();
  for (const named of listeningSockets()) {
    const dir = directoryBehindLinks(path.dirname(named));
    if (!dir) continue; // gone, or in a mount namespace aic does not see
    if (keep.some((k) => dir === k || isBeneath(dir, k))) continue;
    if (projectOwnsSockets && (dir === cwd || isBeneath(dir, cwd))) continue;
    if (visible.includes(dir) || dir === cwd || isBeneath(cwd, dir)) files.add(path.join(dir, path.basename(named)));
    else dirs.add(dir);
  }
  const list = [...dirs].filter((d) => ![...dirs].some((o) => o !== d && isBeneath(d, o)));
  return { dirs: list, files: [...files].filter((f) => !list.some((d) => isBeneath(f, d))) };
}

/** What a path is now, for a read-only bind that must not follow a link planted later. */
function identified(p: string): JailPlan["readOnly"][number] | undefined {
  try {
    const st = fs.lstatSync(p);
    return st.isSymbolicLink() ? undefined : { path: p, dev: st.dev, ino: st.ino };
  } catch {
    return undefined;
  }
}

/**
 * The jail's plan: what is hidden and what is read-only. `secrets` and
 * `stateDirs` are covered read-only; socket directories get a private,
 * writable tmpfs (tmux inside then starts a server of its own).
 */
function planJail(o: {
  net: boolean;
  home: string | undefined;
  cwd: HeldDirectory;
  secrets: readonly string[];
  ownFiles: readonly string[];
  hiddenOwn: readonly string[];
  keepSockets: readonly string[];
  /** The git dirs the repository guard found at start: each pinned, its config and hooks read-only. */
  gitDirs: readonly string[];
  reveal: JailPlan["reveal"];
}): JailPlan {
  const runtime = process.env.XDG_RUNTIME_DIR;
  const sockets = socketHiding(o.home, o.cwd.path, o.keepSockets);
  const hideDirs: JailPlan["hideDirs"] = [];
  const hideFiles: string[] = [];
  const add = (p: string, writable: boolean) => {
    try {
      const st = fs.lstatSync(p);
      if (st.isSymbolicLink()) return;
      if (st.isDirectory()) hideDirs.push({ path: p, writable });
      else hideFiles.push(p);
    } catch {
      /* nothing there to hide */
    }
  };
  for (const d of sockets.dirs) add(d, true);
  if (runtime && path.isAbsolute(runtime) && !o.keepSockets.some((k) => isBeneath(k, runtime))) add(runtime, true);
  for (const s of [...o.secrets, ...o.hiddenOwn]) add(s, false);
  hideFiles.push(...sockets.files.filter((f) => !hideFiles.includes(f)));
  const gitDirs = o.gitDirs;
  const git = gitDirs.flatMap((g) => [path.join(g, "config"), path.join(g, "hooks")]);
  const readOnly = git.map(identified).filter((r) => r !== undefined);
  const ownFiles = o.ownFiles.map(identified).filter((r) => r !== undefined);
  const pinned = gitDirs.map(identified).filter((r) => r !== undefined);
  const outer = <T extends { path: string }>(list: T[]) =>
    list.filter((d) => !list.some((x) => x !== d && isBeneath(d.path, x.path)));
  return { net: o.net, hideDirs: outer(hideDirs), hideFiles, readOnly, ownFiles, pinned, reveal: o.reveal };
}

// ════════════════════════════════════════════════════════════════════════════
// The jail: building it
// Owns: the mounts PID 1 of the jail makes before it confines itself: a fresh
// /dev and /proc, tmpfs over what is hidden, read-only binds, loopback up.
// ════════════════════════════════════════════════════════════════════════════

const MS_RDONLY = 1;
const MS_NOSUID = 2;
const MS_NODEV = 4;
const MS_NOEXEC = 8;
const MS_REMOUNT = 32;
const MS_BIND = 4096;
const MS_REC = 16384;
const MS_PRIVATE = 1 << 18;
const SYS_OPEN_TREE = 428;
const SYS_MOVE_MOUNT = 429;
const SYS_MOUNT_SETATTR = 442;
const OPEN_TREE_CLONE = 1;
const AT_EMPTY_PATH = 0x1000;
const AT_RECURSIVE = 0x8000;
const MOUNT_ATTR_RDONLY = 1n;
const MOVE_MOUNT_F_EMPTY_PATH = 4;
const MOVE_MOUNT_T_EMPTY_PATH = 0x40;

/** mount(2) through libc; throws with the errno's name. */
function mountOrThrow(
  source: string | null,
  target: string,
  fstype: string | null,
  flags: number,
  data: string | null = null,
): void {
  const c = libc()!.symbols;
  const cs = (s: string | null) => (s === null ? null : Buffer.from(`${s}\0`));
  if (c.mount(cs(source), cs(target)!, cs(fstype), flags, cs(data)) !== 0)
    throw new Error(`mount ${fstype ?? source ?? ""} on ${target}: ${lastErrno()}`);
}

function lastErrno(): string {
  const { read } = require("bun:ffi") as typeof import("bun:ffi");
  const errno = read.i32(libc()!.symbols.__errno_location()!, 0);
  return os.constants.errno
    ? (Object.entries(os.constants.errno).find(([, v]) => v === errno)?.[0] ?? `errno ${errno}`)
    : `errno ${errno}`;
}

/**
 * Binds `fd`'s file or directory (or, with `over`, the file at `over` from
 * `source`) read-only: a detached copy of the mount (open_tree), made
 * read-only before it is ever visible (mount_setattr), moved into place
 * (move_mount). No flag of the original mount has to be known or repeated.
 */
function bindReadOnly(sourceFd: number, targetFd: number, what: string): void {
  const c = libc()!.symbols;
  const { ptr } = require("bun:ffi") as typeof import("bun:ffi");
  const empty = Buffer.from("\0");
  const tree = Number(
    c.syscall(SYS_OPEN_TREE, sourceFd, ptr(empty), OPEN_TREE_CLONE | O_CLOEXEC | AT_EMPTY_PATH | AT_RECURSIVE, 0, 0),
  );
  if (tree < 0) throw new Error(`open_tree ${what}: ${lastErrno()}`);
  try {
    const attr = new BigUint64Array([MOUNT_ATTR_RDONLY, 0n, 0n, 0n]);
    if (Number(c.syscall(SYS_MOUNT_SETATTR, tree, ptr(empty), AT_EMPTY_PATH | AT_RECURSIVE, ptr(attr), 32)) !== 0)
      throw new Error(`mount_setattr ${what}: ${lastErrno()}`);
    // move_mount(tree, "", target, "", F_EMPTY_PATH | T_EMPTY_PATH)
    if (
      Number(
        c.syscall(
          SYS_MOVE_MOUNT,
          tree,
          ptr(empty),
          targetFd,
          ptr(empty),
          MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
        ),
      ) !== 0
    )
      throw new Error(`move_mount ${what}: ${lastErrno()}`);
  } finally {
    c.close(tree);
  }
}

/** An O_PATH descriptor of `p` that is not a link (and, when given, still the file aic identified). */
function pinPath(p: string, identity?: { dev: number; ino: number }): number {
  const fd = fs.openSync(p, O_PATH | O.O_NOFOLLOW);
  const st = fs.fstatSync(fd);
  if (st.isSymbolicLink() || (identity && (st.dev !== identity.dev || st.ino !== identity.ino))) {
    fs.closeSync(fd);
    throw new Error(`${p} changed since aic looked at it`);
  }
  return fd;
}

/** Errors that mean a path is out of reach of the jail's init, and so of every command it starts. */
const UNREACHABLE_ERRORS = new Set(["EACCES", "EPERM", "ENOENT", "ENOTDIR", "ELOOP"]);

/**
 * pinPath for something to hide: one the jail cannot reach (another user's
 * directory, gone since aic looked) needs no hiding, as commands cannot reach
 * it either, and must not keep the jail from being built.
 */
function pinUnlessUnreachable(p: string): number | undefined {
  try {
    return pinPath(p);
  } catch (error) {
    if (UNREACHABLE_ERRORS.has((error as NodeJS.ErrnoException).code ?? "")) return undefined;
    throw error;
  }
}

const JAIL_DEV_NODES = ["null", "zero", "full", "random", "urandom", "tty"];

/**
 * A /dev of the jail's own: the harmless device nodes bound from the host's, a
 * fresh devpts instance (commands' terminals are there; the person's are not),
 * a private /dev/shm, then read-only.
 */
function freshDev(): void {
  const nodes = JAIL_DEV_NODES.map((name) => ({ name, fd: pinPath(`/dev/${name}`) }));
  mountOrThrow("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k,nr_inodes=64");
  for (const { name, fd } of nodes) {
    fs.writeFileSync(`/dev/${name}`, "", { mode: 0o666 });
    mountOrThrow(`/proc/self/fd/${fd}`, `/dev/${name}`, null, MS_BIND);
    fs.closeSync(fd);
  }
  const links: [string, string][] = [
    ["fd", "/proc/self/fd"],
    ["stdin", "/proc/self/fd/0"],
    ["stdout", "/proc/self/fd/1"],
    ["stderr", "/proc/self/fd/2"],
    ["ptmx", "pts/ptmx"],
  ];
  for (const [name, target] of links) fs.symlinkSync(target, `/dev/${name}`);
  fs.mkdirSync("/dev/pts");
  fs.mkdirSync("/dev/shm");
  mountOrThrow("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620");
  mountOrThrow("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
  fs.writeFileSync("/dev/.empty", "", { mode: 0o444 });
  mountOrThrow(null, "/dev", null, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC);
}

/** SIOCSIFFLAGS on lo: up (struct ifreq: name[16], then short ifr_flags at offset 16, 40 bytes in all). */
function loopbackUp(): void {
  const c = libc()!.symbols;
  const s = c.socket(2 /* AF_INET */, 2 /* SOCK_DGRAM */, 0);
  if (s < 0) throw new Error(`socket: ${lastErrno()}`);
  try {
    const ifr = new Uint8Array(40);
    ifr.set(utf8.encode("lo"));
    const view = new DataView(ifr.buffer);
    if (c.ioctl(s, 0x8913 /* SIOCGIFFLAGS */, ifr) !== 0) throw new Error(`SIOCGIFFLAGS lo: ${lastErrno()}`);
    view.setInt16(16, view.getInt16(16, true) | 1 /* IFF_UP */, true);
    if (c.ioctl(s, 0x8914 /* SIOCSIFFLAGS */, ifr) !== 0) throw new Error(`SIOCSIFFLAGS lo: ${lastErrno()}`);
  } finally {
    c.close(s);
  }
}

/**
 * Shows each of `reveals` (held) read-only at its place inside the tmpfs
 * just mounted over `dir`: the directories on the way are made in the
 * tmpfs, the held directory is bound there, and the tmpfs is made read-only.
 */
function revealInside(dir: string, reveals: { path: string; fd: number }[], readOnlyFlags: number): void {
  for (const r of reveals) {
    fs.mkdirSync(r.path, { recursive: true, mode: 0o755 });
    const target = pinPath(r.path);
    try {
      bindReadOnly(r.fd, target, r.path);
    } finally {
      fs.closeSync(target);
    }
  }
  mountOrThrow(null, dir, null, MS_REMOUNT | readOnlyFlags);
}

/** The mounts of the jail, in the fresh namespaces, as PID 1 with every capability there. */
function buildJail(plan: JailPlan): void {
  freshDev();
  mountOrThrow("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC);
  // What is shown inside a hidden directory is held before the directory is covered.
  const reveals = plan.reveal.map((r) => ({ ...r, fd: pinPath(r.path, r) }));
  for (const d of plan.hideDirs) {
    const inside = reveals.filter((r) => isBeneath(r.path, d.path));
    const fd = pinUnlessUnreachable(d.path);
    if (fd === undefined) continue;
    try {
      const options = d.writable ? "mode=0700,size=1m" : `mode=0555,size=${inside.length ? "64k" : "4k,nr_inodes=2"}`;
      const flags = MS_NOSUID | MS_NODEV | MS_NOEXEC | (d.writable || inside.length ? 0 : MS_RDONLY);
      mountOrThrow("tmpfs", `/proc/self/fd/${fd}`, "tmpfs", flags, options);
      if (inside.length) revealInside(d.path, inside, flags | MS_RDONLY);
    } finally {
      fs.closeSync(fd);
    }
  }
  for (const r of reveals) fs.closeSync(r.fd);
  const empty = pinPath("/dev/.empty");
  try {
    for (const f of plan.hideFiles) {
      const fd = pinUnlessUnreachable(f);
      if (fd === undefined) continue;
      try {
        bindReadOnly(empty, fd, f);
      } finally {
        fs.closeSync(fd);
      }
    }
  } finally {
    fs.closeSync(empty);
  }
  for (const r of plan.pinned) {
    const fd = pinPath(r.path, r);
    try {
      mountOrThrow(`/proc/self/fd/${fd}`, `/proc/self/fd/${fd}`, null, MS_BIND);
    } finally {
      fs.closeSync(fd);
    }
  }
  for (const r of plan.readOnly) {
    const fd = pinPath(r.path, r);
    try {
      bindReadOnly(fd, fd, r.path);
    } finally {
      fs.closeSync(fd);
    }
  }
  for (const r of plan.ownFiles) {
    let fd: number;
    try {
      fd = pinPath(r.path, r);
    } catch {
      continue; // replaced by aic's own write meanwhile: aic notices any later change itself
    }
    try {
      bindReadOnly(fd, fd, r.path);
    } finally {
      fs.closeSync(fd);
    }
  }
  if (plan.net) loopbackUp();
}

/**
 * `aic __jail PLANS -- ARGV…`: PID 1 of the fresh namespaces. Builds the jail
 * and goes on as `__sandbox-exec` does (capabilities dropped, Landlock,
 * execve of ARGV, the launcher). Exit 124: the namespaces give no power (fall
 * back); any other failure: 125, and commands are not run.
 */
function jailInit(plans: { jail: JailPlan; sandbox: SandboxPlan }, argv: string[]): number | Promise<number> {
  if (process.pid !== 1) return (writeOut(2, "aic jail: not the first process of a new PID namespace\n"), 125);
  try {
    mountOrThrow(null, "/", null, MS_REC | MS_PRIVATE);
  } catch (error) {
    writeOut(2, `aic jail: namespaces refused: ${(error as Error).message}\n`);
    return JAIL_REFUSED_EXIT;
  }
  try {
    buildJail(plans.jail);
  } catch (error) {
    writeOut(2, `aic jail: ${(error as Error).message}\n`);
    return 125;
  }
  // /dev and /proc are the jail's own now: their grants go to the new ones (the identity check guards the others).
  for (const fresh of ["/dev", "/proc"]) {
    const st = fs.lstatSync(fresh);
    for (const rule of plans.sandbox.rules) if (rule.path === fresh) Object.assign(rule, { dev: st.dev, ino: st.ino });
  }
  return sandboxExec(plans.sandbox, argv);
}

// ════════════════════════════════════════════════════════════════════════════
// Repository guard
// Owns: keeping commands from leaving code for the person's own git to run
// outside the sandbox. git runs programs named in a repository's config
// (core.fsmonitor, a `!` alias, a filter…) and its hooks, in whatever
// repository it finds, walking up from where the person types: the project's
// own, a submodule it recurses into, a repository in a subdirectory, a
// `.git` in a parent directory, a bare repository with a work tree set. The
// jail keeps the config and hooks of the repositories there at start
// read-only; the guard looks after each command, and once more over the
// whole tree at the end, at every git dir below the start directory (hidden
// directories included), at the repository the start directory is in, at
// the gitlinks in its index, at the start directory's parents and at the
// --allow-write trees, and takes out what is new: settings other than known
// harmless ones, hooks, `commondir` redirects, `.git` pointers leading out of
// the project.
// ════════════════════════════════════════════════════════════════════════════

/**
 * Settings that run nothing and read nothing more: identity, remotes,
 * branches, formatting, housekeeping. A setting a command adds that is not
 * one of these is taken out, whatever it is (a list of dangerous keys would
 * always miss one: gpg.ssh.defaultKeyCommand, submodule.*.update, …).
 */
const GIT_INERT_SETTING = new RegExp(
  "^(" +
    [
      "core\\.(repositoryformatversion|filemode|bare|logallrefupdates|ignorecase|precomposeunicode|symlinks|autocrlf|eol|safecrlf|quotepath|compression|loosecompression|bigfilethreshold|sharedrepository|checkstat|trustctime|abbrev|commentchar|whitespace|untrackedcache|splitindex|preloadindex|packedgitlimit|packedgitwindowsize|deltabasecachelimit)",
      "user\\.(name|email|signingkey|useconfigonly)",
      "(author|committer)\\.(name|email)",
      // Not push or mirror: they decide what the person's next `git push` deletes on the remote.
      "remote\\..+\\.(url|pushurl|fetch|tagopt|prune|prunetags|skipdefaultupdate|skipfetchall|promisor|partialclonefilter)",
      "branch\\..+\\.(remote|merge|rebase|pushremote|description)",
      "init\\.defaultbranch",
      "extensions\\.(objectformat|preciousobjects|partialclone|refstorage)",
      "(color|advice|status|log|pack|index|feature|i18n|rerere|fetch|transfer|receive\\.fsck)\\.[^.]+",
      // Not gc.*: gc.recentObjectsHook (git 2.42) runs a program.
      "gc\\.(auto|autopacklimit|autodetach|pruneexpire|reflogexpire|reflogexpireunreachable|aggressivewindow|aggressivedepth|packrefs|writecommitgraph|cruftpacks|bigpackthreshold|logexpiry|worktreepruneexpire|rerereresolved|rerereunresolved)",
      "color\\..+\\.[^.]+",
      "pull\\.(rebase|ff|twohead|octopus)",
      "push\\.(default|autosetupremote|followtags|recursesubmodules)",
      "merge\\.(ff|conflictstyle|log|renamelimit|renormalize|stat|verbosity)",
      "rebase\\.(autosquash|autostash|updaterefs|stat|missingcommitscheck|abbreviatecommands)",
      "format\\.(pretty|signoff|numbered|suffix|thread)",
      "commit\\.(verbose|cleanup|status)",
      "tag\\.(sort|forcesignannotated)",
      "submodule\\..+\\.(url|active|branch|ignore|shallow|fetchrecursesubmodules)",
      "submodule\\.(recurse|fetchjobs|active)",
      "diff\\.(renames|algorithm|mnemonicprefix|noprefix|context|colormoved|statgraphwidth|submodule|ignoresubmodules|interhunkcontext|indentheuristic|relative|orderfile)",
      "help\\.(autocorrect|format)",
      "maintenance\\.[^.]+\\.enabled",
      "lfs\\.repositoryformatversion",
      "alias\\.[^.]+",
      "core\\.fsmonitor",
    ].join("|") +
    ")$",
  "i",
);
/** A config larger than this is no person's: it is moved aside whole. */
const MAX_GIT_CONFIG_BYTES = 1 << 20;
/** How deep, and through how many directories, git dirs are searched for after each command. */
const GIT_SEARCH_DEPTH = 6;
const GIT_SEARCH_LIMIT = 3000;
/** The end of a run searches the whole tree, up to this many directories (node_modules aside). */
const GIT_DEEP_SEARCH_LIMIT = 1_000_000;

/** One setting of a config as git lists it. */
interface GitSetting {
  key: string;
  value: string | undefined;
}

/** Configs already parsed, by their bytes: the guard looks at the same ones after every command. */
const parsedGitConfigs = new Map<string, GitSetting[] | undefined>();

/** A config's settings as git itself parses them (no includes followed, nothing run); undefined when git rejects it. */
function gitSettings(text: Buffer): GitSetting[] | undefined {
  const key = createHash("sha256").update(text).digest("hex");
  if (parsedGitConfigs.has(key)) return parsedGitConfigs.get(key);
  const settings = parseGitConfig(text);
  if (parsedGitConfigs.size >= 256) parsedGitConfigs.clear();
  parsedGitConfigs.set(key, settings);
  return settings;
}

function parseGitConfig(text: Buffer): GitSetting[] | undefined {
  const git = gitProgram();
  if (!git) return undefined;
  // --no-includes: an include is a setting to judge, never followed (and git refuses a relative one read from stdin,
  // which made every config holding one unreadable to the guard).
  const r = Bun.spawnSync([git, "config", "--no-includes", "--file", "-", "--list", "-z"], {
    cwd: "/",
    stdin: text,
    env: {
      PATH: trustedPath(),
      GIT_CONFIG_NOSYSTEM: "1",
      GIT_CONFIG_GLOBAL: "/dev/null",
      HOME: "/",
    },
    stdout: "pipe",
    stderr: "ignore",
  });
  if (r.exitCode !== 0) return undefined;
  return r.stdout
    .toString("utf8")
    .split("\0")
    .filter(Boolean)
    .map((entry) => {
      const nl = entry.indexOf("\n");
      return nl < 0 ? { key: entry, value: undefined } : { key: entry.slice(0, nl), value: entry.slice(nl + 1) };
    });
}

/** Whether a setting may make git run something (or read more settings): anything not known to be inert. */
function runsCode(s: GitSetting): boolean {
  // Any alias: it is a name the person types believing it their own, and git's own subcommands destroy and write
  // as well as any program (`ci = reset --hard`, `st = log --output=~/.bashrc`). None a command adds is kept.
  if (/^alias\./i.test(s.key)) return true;
  // Exactly a boolean, as git reads one: `"yes "` with its space is a program's name to git (and runs /usr/bin/yes).
  if (/^core\.fsmonitor$/i.test(s.key)) return !/^(true|false|yes|no|on|off|1|0|)$/i.test(s.value ?? "");
  return !GIT_INERT_SETTING.test(s.key);
}

/** A git dir's configs as the repository guard last judged them (what it left there). */
type Judged = Partial<Pick<GitDirBaseline, "config" | "worktree" | "links">>;

/** The files a git dir's configs include, absolute (relative ones are relative to the git dir, as git reads them). */
function includedConfigs(gitDir: string, configs: readonly (Buffer | undefined)[]): string[] {
  const home = homeDirectory();
  const files = new Set<string>();
  for (const text of configs) {
    if (!text) continue;
    for (const s of gitSettings(text) ?? []) {
      if (!/^(include\.path|includeif\..+\.path)$/i.test(s.key) || !s.value) continue;
      const value = s.value.startsWith("~/") && home ? path.join(home, s.value.slice(2)) : s.value;
      files.add(path.resolve(gitDir, value));
    }
  }
  return [...files];
}

/**
 * What an included config holds for the guard: its bytes; for something aic does not read (a link, a FIFO), a
 * marker with its identity (a NUL first, which no config text has), so that it changing is seen; undefined if absent.
 */
function includedContent(file: string): Buffer | undefined {
  const text = readConfigAt(file);
  if (text) return text;
  const sig = fileSignature(file);
  return sig ? Buffer.from(`\0not a file: ${sig}`) : undefined;
}

/** A config file anywhere, read as aic reads its own (a regular file, never a link, bounded); undefined if not one. */
function readConfigAt(file: string): Buffer | undefined {
  try {
    return readOwnFile(file, MAX_GIT_CONFIG_BYTES);
  } catch {
    return undefined;
  }
}

/** A config file's text holding `settings`, in git's syntax. */
function gitConfigText(settings: readonly GitSetting[]): string {
  const escape = (v: string) =>
    v.replace(/\\/g, "\\\\").replace(/"/g, '\\"').replace(/\n/g, "\\n").replace(/\t/g, "\\t");
  let out = "";
  let section = "";
  for (const { key, value } of settings) {
    const first = key.indexOf(".");
    const last = key.lastIndexOf(".");
    const header =
      first === last ? `[${key.slice(0, first)}]` : `[${key.slice(0, first)} "${escape(key.slice(first + 1, last))}"]`;
    if (header !== section) out += `${(section = header)}\n`;
    out += `\t${key.slice(last + 1)}${value === undefined ? "" : ` = "${escape(value)}"`}\n`;
  }
  return out;
}

/** Whether anything (a link included) is at `p`. */
const somethingAt = (p: string) => lstatIfReachable(p) !== undefined;

/** lstat, or undefined when nothing is there or aic may not look (EACCES below another user's directory, ELOOP). */
function lstatIfReachable(p: string): fs.Stats | undefined {
  try {
    return fs.lstatSync(p, { throwIfNoEntry: false });
  } catch {
    return undefined;
  }
}

/** A file's size, change time and inode: it changed when these did. */
function fileSignature(p: string): string | undefined {
  try {
    const st = fs.lstatSync(p, { throwIfNoEntry: false });
    return st && `${st.size}:${st.ctimeMs}:${st.ino}`;
  } catch {
    return undefined; // ENOTDIR (a `.git` file, in a worktree), EACCES: nothing to sign
  }
}

/** Whether a directory holding these entries is one git would take for a git dir (HEAD, objects/, refs/). */
function looksLikeGitDir(entries: readonly fs.Dirent[]): boolean {
  const has = (name: string, dir: boolean) =>
    entries.some((e) => e.name === name && (dir ? e.isDirectory() : e.isFile() || e.isSymbolicLink()));
  return has("HEAD", false) && has("objects", true) && has("refs", true);
}

/** Where a paused rebase or cherry-pick keeps what is left to do, relative to the git dir. */
const SEQUENCER_TODOS = ["rebase-merge/git-rebase-todo", "sequencer/todo"];

/** A git dir that is not aic's own checkpoint store (found when aic starts in the home directory): not the guard's. */
function notAicsOwn(dir: HeldDirectory): boolean {
  const state = aicStateDir();
  return !state || !(dir.path === state || isBeneath(dir.path, state));
}

/** A `.git` file or link (its directory held: the caller closes it). */
interface GitPointer {
  parent: HeldDirectory;
  at: string;
  display: string;
}

/**
 * Where a `.git` file or link sends git, read as git reads it (everything after `gitdir: ` but the trailing
 * line ends, spaces and newlines inside included) and followed as the kernel follows it (through every link,
 * `..` after a link included): the real path, or as far as it resolves when it leads nowhere.
 */
function gitPointer(p: GitPointer): string | undefined {
  try {
    const st = fs.lstatSync(p.at);
    if (st.isSymbolicLink()) return realOrAsIs(p.at);
    if (!st.isFile() || st.size > 4096) return undefined;
    const text = readOwnFile(p.at, 4096)
      .toString("utf8")
      .replace(/[\r\n]+$/, "");
    if (!text.startsWith("gitdir: ")) return undefined;
    // Joined as text, never normalised: `..` after a link is the kernel's to follow.
    return realOrAsIs(`${path.dirname(p.display)}/${text.slice(8)}`, text.slice(8));
  } catch {
    return undefined;
  }
}

/** The real path of `p` (links followed by the kernel), or `p` as written when it leads nowhere. */
function realOrAsIs(p: string, written?: string): string {
  const joined = written !== undefined && path.isAbsolute(written) ? written : p;
  try {
    // realpath(3) itself: the JavaScript one normalises `..` as text before it follows anything.
    return fs.realpathSync.native(joined);
  } catch {
    return joined;
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Repository guard: finding repositories
// Owns: the search of the tree for repositories a command may have made or
// changed (listings remembered by inode and times, .git checked first in every
// directory), git's index read in-process for its gitlinks, and where a
// repository's hooks and common directory lie.
// ════════════════════════════════════════════════════════════════════════════

/** The git dirs and `.git` pointers a search found, held: `close` releases them. */
class FoundGit {
  readonly dirs: HeldDirectory[] = [];
  readonly pointers: GitPointer[] = [];
  /** FIFOs and devices where git reads a work tree's rules (see WORK_TREE_GIT_FILES), in their held directories. */
  readonly special: { parent: HeldDirectory; name: string }[] = [];
  /** Rules files (`.aicrules`) on the way, which a run started in their directory reads. */
  readonly rules: { parent: HeldDirectory; name: string }[] = [];
  /** The search stopped at its limit of directories: a git dir beyond it was not seen. */
  exhausted = false;

  close(): void {
    for (const held of [
      ...this.dirs,
      ...this.pointers.map((p) => p.parent),
      ...this.special.map((f) => f.parent),
      ...this.rules.map((f) => f.parent),
    ])
      held.close();
  }
}

/** What the search for git dirs needs of one directory's entries. */
interface GitListing {
  /** Its subdirectories (links are not). */
  subdirs: string[];
  /** It holds a `.git` that is a file or a link. */
  pointer: boolean;
  /** It holds HEAD, objects/ and refs/: a git dir (a bare repository). */
  gitLike: boolean;
  /** Files git reads in a work tree's directories (`.gitignore`, `.mailmap`…) that are FIFOs or devices here. */
  special: string[];
  /** It holds a rules file. */
  rules: boolean;
}

/** What git reads in any directory of a work tree, and at its top: a FIFO there holds the person's git forever. */
const WORK_TREE_GIT_FILES = new Set([".gitignore", ".gitattributes", ".mailmap", ".gitmodules"]);

/** Whether a directory entry (or a stat) is something no read of git's may open: a FIFO, a socket or a device. */
const isSpecialFile = (e: fs.Dirent | fs.Stats) =>
  e.isFIFO() || e.isSocket() || e.isCharacterDevice() || e.isBlockDevice();

/** How many directories' listings a search remembers; past it, it starts again. */
const LISTING_MEMO_LIMIT = 100_000;
/** A directory changed this close to its listing may change again within the same timestamp tick: read again. */
const LISTING_RACY_NS = 50_000_000n;

/**
 * Directory listings remembered by identity and change times. Adding,
 * removing or renaming an entry sets a directory's mtime and ctime, and
 * nobody can set a ctime back, so a directory whose inode and both times
 * are as at the last look holds the same entries: the search after each
 * command reads only the directories commands changed. A listing taken
 * within a timestamp tick of the directory's last change is not trusted
 * (as git treats a racily clean index entry).
 */
class ListingMemo {
  private readonly seen = new Map<string, { stamp: string; listing: GitListing }>();

  listing(dir: HeldDirectory): GitListing {
    let st: fs.BigIntStats;
    try {
      st = fs.fstatSync(dir.descriptor, { bigint: true });
    } catch {
      return gitListingOf(dir.entriesDespiteMode());
    }
    const key = `${st.dev}:${st.ino}`;
    const stamp = `${st.mtimeNs}:${st.ctimeNs}`;
    const known = this.seen.get(key);
    if (known?.stamp === stamp) return known.listing;
    const now = BigInt(Date.now()) * 1_000_000n;
    const listing = gitListingOf(dir.entriesDespiteMode());
    if (st.ctimeNs + LISTING_RACY_NS < now && st.mtimeNs + LISTING_RACY_NS < now) {
      if (this.seen.size >= LISTING_MEMO_LIMIT) this.seen.clear();
      this.seen.set(key, { stamp, listing });
    } else this.seen.delete(key);
    return listing;
  }
}

function gitListingOf(entries: readonly fs.Dirent[]): GitListing {
  return {
    subdirs: entries.filter((e) => e.isDirectory()).map((e) => e.name),
    pointer: entries.some((e) => e.name === ".git" && !e.isDirectory()),
    gitLike: looksLikeGitDir(entries),
    special: entries.filter((e) => WORK_TREE_GIT_FILES.has(e.name) && isSpecialFile(e)).map((e) => e.name),
    rules: entries.some((e) => e.name === RULES_FILE_NAME),
  };
}

/**
 * Every git dir below `root` (root itself included when it is one): each
 * `.git` directory, each directory that looks like a git dir (a bare
 * repository), and every git dir under a git dir's `modules/` (submodule
 * names may hold slashes, and submodules nest) and `worktrees/`; and each
 * `.git` file or link. Hidden directories are searched; node_modules is not
 * (its repositories matter as gitlinks, which the guard reads from the
 * index). Links are never followed.
 */
function searchGitDirs(root: HeldDirectory, depth: number, limit: number, memo = new ListingMemo()): FoundGit {
  const found = new FoundGit();
  let budget = limit;
  const take = (gitDir: HeldDirectory) => {
    found.dirs.push(gitDir);
    for (const name of ["modules", "worktrees"]) {
      const sub = gitDir.child(name);
      if (sub) inside(sub, 8);
      sub?.close();
    }
  };
  // Below modules/ and worktrees/: a directory with a HEAD is a git dir (a worktree's has no objects of its own).
  const inside = (dir: HeldDirectory, left: number) => {
    for (const e of dir.entries()) {
      if (!e.isDirectory() || budget-- <= 0) continue;
      const sub = dir.child(e.name);
      if (!sub) continue;
      if (somethingAt(sub.at("HEAD"))) take(sub);
      else {
        if (left > 1) inside(sub, left - 1);
        sub.close();
      }
    }
  };
  const walk = (dir: HeldDirectory, left: number) => {
    const listing = memo.listing(dir);
    if (listing.pointer) {
      const parent = dir.child(".");
      if (parent) found.pointers.push({ parent, at: parent.at(".git"), display: parent.display(".git") });
    }
    for (const name of listing.special) {
      const parent = dir.child(".");
      if (parent) found.special.push({ parent, name });
    }
    const rulesHere = listing.rules ? dir.child(".") : undefined;
    if (rulesHere) found.rules.push({ parent: rulesHere, name: RULES_FILE_NAME });
    // A `.git` here is looked at whatever the budget: a command cannot hide one behind many directories.
    const ordered = listing.subdirs.includes(".git")
      ? [".git", ...listing.subdirs.filter((n) => n !== ".git")]
      : listing.subdirs;
    for (const name of ordered) {
      if (name === "node_modules") continue;
      if (name !== ".git" && budget-- <= 0) {
        found.exhausted = true;
        continue;
      }
      if (name !== ".git" && left <= 1) continue;
      const sub = dir.child(name) ?? dir.childDespiteMode(name);
      if (!sub) continue;
      if (name === ".git" || memo.listing(sub).gitLike) take(sub);
      else {
        walk(sub, left - 1);
        sub.close();
      }
    }
  };
  const self = memo.listing(root).gitLike ? root.child(".") : undefined;
  if (self) take(self);
  else walk(root, depth);
  return found;
}

/** A project's index larger than this is not read for its gitlinks (200,000 files make about 20 MB). */
const MAX_GIT_INDEX_BYTES = 256 * 1024 * 1024;

/**
 * The paths of the gitlinks (submodules: mode 160000) in a git index file,
 * versions 2 to 4, or undefined when the bytes are not one. Every offset is
 * checked: the file is a command's to write.
 */
function gitlinksInIndex(b: Buffer): string[] | undefined {
  const links: string[] = [];
  const read = indexEntries(b, (name, mode) => {
    if ((mode & 0o170000) === 0o160000) links.push(name.toString("utf8"));
  });
  return read ? links : undefined;
}

/**
 * The shared index a split index names (`git update-index --split-index`: its `link` extension), as the hex of
 * its hash, or undefined; the split one holds only the entries changed since, the rest are in
 * `sharedindex.<hash>` beside it.
 */
function sharedIndexOf(b: Buffer): string | undefined {
  let at = indexEntriesEnd(b);
  while (at !== undefined && at + 8 <= b.length - 20) {
    const size = b.readUInt32BE(at + 4);
    if (b.toString("latin1", at, at + 4) === "link" && size >= 20)
      return b.toString("hex", at + 8, at + 8 + Math.min(size, 32));
    at += 8 + size;
  }
  return undefined;
}

function indexEntriesEnd(b: Buffer): number | undefined {
  let end: number | undefined;
  return indexEntries(
    b,
    () => {},
    (at) => (end = at),
  )
    ? end
    : undefined;
}

/** Calls `visit` with each entry's path and mode, in the index's order; false when the file is not an index git wrote. */
function indexEntries(
  b: Buffer,
  visit: (name: Buffer, mode: number) => void,
  ended: (at: number) => void = () => {},
): boolean {
  if (b.length < 12 || b.toString("latin1", 0, 4) !== "DIRC") return false;
  const version = b.readUInt32BE(4);
  const count = b.readUInt32BE(8);
  if (version < 2 || version > 4) return false;
  let at = 12;
  let previous: Buffer = Buffer.alloc(0);
  for (let i = 0; i < count; i++) {
    const start = at;
    if (at + 62 > b.length) return false;
    const mode = b.readUInt32BE(at + 24);
    const flags = b.readUInt16BE(at + 60);
    at += 62;
    if (version >= 3 && flags & 0x4000) at += 2;
    let name: Buffer;
    if (version === 4) {
      // The path is the previous one less `strip` bytes, then this entry's own bytes (git's offset varint).
      let c = b[at++];
      if (c === undefined) return false;
      let strip = c & 127;
      while (c & 128) {
        c = b[at++];
        if (c === undefined || strip > previous.length) return false;
        strip = ((strip + 1) << 7) | (c & 127);
      }
      const end = b.indexOf(0, at);
      if (end < 0 || strip > previous.length) return false;
      name = Buffer.concat([previous.subarray(0, previous.length - strip), b.subarray(at, end)]);
      at = end + 1;
    } else {
      const end = b.indexOf(0, at);
      if (end < 0) return false;
      name = b.subarray(at, end);
      at = start + ((end - start + 8) & ~7);
    }
    previous = name;
    visit(name, mode);
  }
  ended(at);
  return true;
}

/** What one git dir held at the last look. */
interface GitDirBaseline {
  config: Buffer | undefined;
  /** `config.worktree` (read with extensions.worktreeConfig: every sparse checkout has one). */
  worktree: Buffer | undefined;
  /** The files the configs include (include.path, includeIf.*.path), by absolute path, as they were. */
  included: Map<string, Buffer | undefined>;
  /** Hook name → fileSignature. */
  hooks: Map<string, string>;
  /** A paused rebase's or cherry-pick's todo list → fileSignature (its `exec` lines run at the person's --continue). */
  todos?: Map<string, string>;
  /** Where its `commondir` leads, if it has one. */
  commondir: string | undefined;
  /** Its links (path inside it → where each points): git writes COMMIT_EDITMSG, reflogs and more through one. */
  links?: Map<string, string>;
}

/** How many entries of a git dir are looked at for FIFOs and devices (its refs and loose objects among them). */
const GIT_DIR_ENTRIES_LOOKED_AT = 20_000;

/**
 * Every FIFO, socket, device or link in a git dir (up to GIT_DIR_ENTRIES_LOOKED_AT entries), each as its held
 * directory and name, reached without following a link on the way: git opens its index, refs, loose objects, a
 * paused rebase's state and more for a plain `git status`, and one FIFO among them stalls it. The type comes from
 * the directory listing, so a regular file costs no stat; a link is for the caller to follow and judge.
 */
function gitReadFiles(gitDir: HeldDirectory): { files: [HeldDirectory, string][]; close(): void } {
  const held: HeldDirectory[] = [];
  const files: [HeldDirectory, string][] = [];
  let budget = GIT_DIR_ENTRIES_LOOKED_AT;
  const walk = (d: HeldDirectory, depth: number) => {
    const entries = d.entries();
    // A directory's own entries before its subdirectories': thousands of loose objects cannot hide COMMIT_EDITMSG.
    for (const e of entries) {
      if (e.isDirectory()) continue;
      if (budget-- <= 0) return;
      if (!e.isFile() && !e.name.endsWith(".aic-disabled")) files.push([d, e.name]); // one aic took out stays
    }
    for (const e of entries) {
      if (!e.isDirectory()) continue;
      if (budget-- <= 0) return;
      const sub = depth < 16 ? d.child(e.name) : undefined;
      if (sub) {
        held.push(sub);
        walk(sub, depth + 1);
      }
    }
  };
  walk(gitDir, 0);
  return { files, close: () => held.forEach((d) => d.close()) };
}

/** The hooks of a git dir (samples aside), with their signatures. */
function hooksOf(gitDir: HeldDirectory): Map<string, string> {
  const hooks = new Map<string, string>();
  const dir = gitDir.child("hooks");
  for (const e of dir?.entries() ?? []) {
    const sig = e.name.endsWith(".sample") ? undefined : fileSignature(dir!.at(e.name));
    if (sig) hooks.set(e.name, sig);
  }
  dir?.close();
  return hooks;
}

/** Where a git dir's `commondir` sends git, or undefined when it has none. */
function commondirOf(gitDir: HeldDirectory): string | undefined {
  if (!somethingAt(gitDir.at("commondir"))) return undefined;
  try {
    // As git reads it: only the trailing line ends go; then followed as the kernel follows it (links, `..`).
    const written = readOwnFile(gitDir.at("commondir"), 4096)
      .toString("utf8")
      .replace(/[\r\n]+$/, "");
    return realOrAsIs(`${gitDir.path}/${written}`, written);
  } catch {
    return "(unreadable)";
  }
}

/**
 * Files of a git dir that git reads whole for a plain `git status` or `git log`, and the most each may hold:
 * a sparse 20 GB info/exclude a command made kept the person's git reading zeros for minutes, or out of memory.
 */
const GIT_FILES_READ_WHOLE: readonly [name: string, maxBytes: number][] = [
  ["info/exclude", 64 << 20],
  ["info/attributes", 64 << 20],
  ["info/sparse-checkout", 64 << 20],
  ["info/grafts", 64 << 20],
  ["HEAD", 1 << 20],
  ["ORIG_HEAD", 1 << 20],
  ["FETCH_HEAD", 64 << 20],
  ["MERGE_HEAD", 1 << 20],
  ["MERGE_MSG", 64 << 20],
  ["SQUASH_MSG", 64 << 20],
  ["COMMIT_EDITMSG", 64 << 20],
  ["packed-refs", 2 << 30],
];

/** A size as people read it: MB, or GB with one decimal. */
const sizeInWords = (bytes: number) =>
  bytes >= 1e9 ? `${(bytes / 1e9).toFixed(1)} GB` : `${Math.round(bytes / 1e6)} MB`;

/** Each file of GIT_FILES_READ_WHOLE in `dir` that passes its size, moved aside; the report lines. */
function oversizedGitFiles(dir: HeldDirectory): string[] {
  const done: string[] = [];
  for (const [name, max] of GIT_FILES_READ_WHOLE) {
    const st = fs.lstatSync(dir.at(name), { throwIfNoEntry: false });
    if (st?.isFile() && st.size > max)
      done.push(
        ...moveAside(
          dir.at(name),
          dir.display(name),
          `${dir.display(name)} (${sizeInWords(st.size)}, which git would read whole)`,
        ),
      );
  }
  return done;
}

/** Where the link at `at` points, or undefined when it is no link. */
function linkTarget(at: string): string | undefined {
  try {
    return fs.readlinkSync(at);
  } catch {
    return undefined;
  }
}

/** Renames `at` to `at.aic-disabled`; the report line. */
function moveAside(at: string, shown: string, what: string): string[] {
  try {
    fs.renameSync(at, `${at}.aic-disabled`);
    return [`${what} (now ${shown}.aic-disabled)`];
  } catch (error) {
    return [`${what}, which aic could not move aside: ${(error as Error).message}`];
  }
}

/** The repository a directory is in, when its `.git` lies above it: its git dir and its top. */
function enclosingRepository(dir: string): { gitDir: string; top: string } | undefined {
  for (let d = path.dirname(dir); ; d = path.dirname(d)) {
    const st = fs.lstatSync(path.join(d, ".git"), { throwIfNoEntry: false });
    if (st?.isDirectory()) return { gitDir: path.join(d, ".git"), top: d };
    if (st) return undefined; // a pointer (a worktree, a submodule): its git dir lies elsewhere
    if (path.dirname(d) === d) return undefined;
  }
}

/** Where the guard looks: the start directory, the --allow-write trees; `writable`: where commands may write. */
interface GuardRoots {
  workDir: HeldDirectory;
  allowWrite: readonly string[];
  writable: readonly string[];
  /** The run's own rules file, which the rules themselves watch. */
  ownRules: string;
}

/** Whether `dir` holds a `.git`, or is itself laid out as a git dir (HEAD, objects/, refs/), by lstat alone. */
function gitFindsRepositoryAt(dir: string): boolean {
  const is = (name: string, kind: "dir" | "any") => {
    const st = fs.lstatSync(path.join(dir, name), { throwIfNoEntry: false });
    return st !== undefined && (kind === "any" || st.isDirectory());
  };
  return is(".git", "any") || (is("HEAD", "any") && is("objects", "dir") && is("refs", "dir"));
}

/**
 * The rules files other than the run's own (a subdirectory's `.aicrules`,
 * read by a run started there) that a command made, changed or deleted: at
 * such a start they are not in force until the person accepts them, as the
 * run's own would not be. Seen by the guard's searches, so in an ignored
 * directory and without checkpoints too; one first found after the start
 * counts when it changed since the run began, and a deletion is known by
 * the search of the whole tree at the end.
 */
class OtherRulesFiles {
  private readonly seen = new Map<string, { mark: string; text: string }>();
  private readonly startedMs = Date.now();

  constructor(private readonly own: string) {}

  /**
   * Records what each found rules file holds; the lines saying which a command wrote since the last look
   * (none at the first look, before any command ran: what is there then is the person's).
   */
  look(found: FoundGit, whole: boolean, first = false): string[] {
    const lines: string[] = [];
    const present = new Set<string>();
    for (const { parent, name } of found.rules) {
      const file = parent.display(name);
      present.add(file);
      if (path.resolve(file) === path.resolve(this.own)) continue;
      const now = rulesOnDisk(parent.at(name));
      const before = this.seen.get(file);
      this.seen.set(file, { mark: rulesMarker(now), text: now.kind === "text" ? now.text : "" });
      if (first || (before ? before.mark === rulesMarker(now) : !this.changedSinceStart(parent.at(name)))) continue;
      lines.push(...this.commandWrote(file, now, before?.text));
    }
    if (whole)
      for (const [file, before] of this.seen)
        if (!present.has(file) && !somethingAt(file)) {
          this.seen.delete(file);
          lines.push(...this.commandWrote(file, { kind: "text", text: "", missing: true }, before.text));
        }
    return lines;
  }

  private changedSinceStart(file: string): boolean {
    const st = fs.lstatSync(file, { throwIfNoEntry: false });
    return st !== undefined && st.ctimeMs >= this.startedMs;
  }

  private commandWrote(file: string, now: RulesOnDisk, before: string | undefined): string[] {
    if (RulesTrust.of(file)?.wroteByCommand(now)) return []; // said already: the checkpoints saw it
    RulesTrust.commandWrote(file, now, before);
    return [
      `${file} was written by a command: a run started there keeps the rules it held before until you accept the change (aic rules accept)`,
    ];
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Repository guard: the audit
// Owns: the baselines taken when the launcher starts and the audit after each
// command and at the end of a run: what changed is taken out and reported.
// ════════════════════════════════════════════════════════════════════════════

/**
 * After each command, takes out what commands left for the person's git
 * (see the section's header). Baselines are taken when the launcher starts:
 * what was there then is the person's and stays as it is.
 */
class GitGuard {
  private readonly dirs = new Map<string, GitDirBaseline>();
  private readonly pointers = new Set<string>();
  /** The start directory's parents, when it is in no repository: a `.git` made there would capture it. */
  private readonly parents: { path: string; had: boolean }[] = [];
  private readonly enclosing: { gitDir: string; top: string } | undefined;
  private readonly roots: HeldDirectory[];
  private indexSeen: string | undefined;
  private readonly listings = new ListingMemo();
  private saidExhausted = false;

  constructor(private readonly where: GuardRoots) {
    this.rulesFiles = new OtherRulesFiles(where.ownRules);
    this.enclosing = enclosingRepository(where.workDir.path);
    this.roots = [
      where.workDir,
      ...where.allowWrite.map((p) => HeldDirectory.tryOpen(p)).filter((d) => d !== undefined),
    ];
    // Only parents commands may write to (under /tmp, say): git stops at the first repository it finds going up.
    const cwdIsRepo = somethingAt(where.workDir.at(".git"));
    if (!this.enclosing && !cwdIsRepo)
      for (let d = path.dirname(where.workDir.path); ; d = path.dirname(d)) {
        if (where.writable.some((w) => d === w || isBeneath(d, w)))
          this.parents.push({ path: d, had: gitFindsRepositoryAt(d) });
        if (path.dirname(d) === d) break;
      }
    const found = this.search(false);
    for (const dir of found.dirs.filter(notAicsOwn)) this.dirs.set(dir.path, this.look(dir));
    for (const p of found.pointers) this.pointers.add(`${p.display}\0${fileSignature(p.at) ?? ""}`);
    this.rulesFiles.look(found, false, true);
    found.close();
  }

  /** The other rules files under the roots, and what each held when last seen. */
  private readonly rulesFiles: OtherRulesFiles;

  /** The git dirs the jail keeps read-only: every one found at start. */
  get gitDirs(): string[] {
    return [...this.dirs.keys()];
  }

  /** What was taken out since the last audit, one line each; `deep` searches whole trees (the end of a run). */
  audit(deep = false): GuardReport {
    const done: string[] = [...this.auditParents()];
    const notes: string[] = [];
    const found = this.search(deep);
    if (found.exhausted && (deep || !this.saidExhausted)) {
      this.saidExhausted = true;
      notes.push(
        deep
          ? `the search for git dirs in the whole tree stopped at ${GIT_DEEP_SEARCH_LIMIT.toLocaleString("en-US")} directories (the commands made that many): run \`find . -name .git\` before you trust git in this tree`
          : `the search for git dirs after this command stopped at ${GIT_SEARCH_LIMIT.toLocaleString("en-US")} directories; one deeper in the tree is found when the run ends, by the search of the whole tree`,
      );
    }
    try {
      const known = [...this.dirs.keys(), ...found.dirs.map((d) => d.path)];
      for (const p of found.pointers) done.push(...this.auditPointer(p, known));
      for (const { parent, name } of found.special)
        done.push(...moveAside(parent.at(name), parent.display(name), `${parent.display(name)} (a FIFO or device)`));
      notes.push(...this.rulesFiles.look(found, deep));
      for (const dir of found.dirs.filter(notAicsOwn)) {
        const judged: Judged = {};
        done.push(...this.disarm(dir, this.dirs.get(dir.path), judged));
        // The configs as aic judged (or left) them, never as read again: a job may plant a setting in between, and
        // a baseline that held it would let it stay for good.
        this.dirs.set(dir.path, { ...this.look(dir, false), ...judged });
      }
    } finally {
      found.close();
    }
    return { taken: done, notes };
  }

  /** Every git dir to look at: below each root, the enclosing repository's, and the index's gitlinks. */
  private search(deep: boolean): FoundGit {
    const all = new FoundGit();
    for (const root of this.roots) {
      const found = deep
        ? searchGitDirs(root, Number.MAX_SAFE_INTEGER, GIT_DEEP_SEARCH_LIMIT, this.listings)
        : searchGitDirs(root, GIT_SEARCH_DEPTH, GIT_SEARCH_LIMIT, this.listings);
      all.dirs.push(...found.dirs);
      all.pointers.push(...found.pointers);
      all.special.push(...found.special);
      all.rules.push(...found.rules);
      all.exhausted ||= found.exhausted;
    }
    const enclosing = this.enclosing && HeldDirectory.tryOpen(this.enclosing.gitDir);
    if (enclosing) {
      const inner = searchGitDirs(enclosing, 1, GIT_SEARCH_LIMIT);
      enclosing.close();
      all.dirs.push(...inner.dirs);
    }
    if (deep || this.gitlinksChanged()) {
      for (const rel of this.gitlinks) {
        const held = this.heldInProject(rel);
        if (!held) continue;
        const inner = searchGitDirs(held, 1, 10);
        held.close();
        all.dirs.push(...inner.dirs);
        all.pointers.push(...inner.pointers);
      }
    }
    return all;
  }

  private gitlinks: string[] = [];

  /**
   * Re-reads the gitlinks of the project's index when the index changed (git status recurses into them).
   * The index is parsed here, never by git: git run on the project's git dir reads its config, and a
   * `core.fsmonitor` a command planted there (or in a repository its `commondir` names) would run outside.
   */
  private gitlinksChanged(): boolean {
    const gitDir = this.enclosing?.gitDir ?? path.join(this.where.workDir.path, ".git");
    const sig = fileSignature(path.join(gitDir, "index"));
    if (sig === this.indexSeen) return false;
    this.indexSeen = sig;
    const top = this.enclosing?.top ?? this.where.workDir.path;
    let index: Buffer;
    try {
      index = readOwnFile(path.join(gitDir, "index"), MAX_GIT_INDEX_BYTES);
    } catch {
      return ((this.gitlinks = []), true);
    }
    const inProject = (rel: string) => path.relative(this.where.workDir.path, path.join(top, rel));
    // A split index keeps most entries in its shared index: a gitlink there is as much git's as one here.
    const links = new Set(gitlinksInIndex(index) ?? []);
    const shared = sharedIndexOf(index);
    for (const length of shared ? [40, 64] : []) {
      try {
        const file = path.join(gitDir, `sharedindex.${shared!.slice(0, length)}`);
        for (const link of gitlinksInIndex(readOwnFile(file, MAX_GIT_INDEX_BYTES)) ?? []) links.add(link);
        break;
      } catch {
        /* not this hash's length (SHA-1 or SHA-256), or gone */
      }
    }
    this.gitlinks = [...links].map(inProject).filter((rel) => rel && !rel.startsWith(".."));
    return true;
  }

  /** A directory below the start directory, reached one component at a time (no link followed). */
  private heldInProject(rel: string): HeldDirectory | undefined {
    let dir: HeldDirectory | undefined = this.where.workDir.child(".");
    for (const part of rel.split("/")) {
      const next: HeldDirectory | undefined = part && part !== "." ? dir?.child(part) : dir?.child(".");
      dir?.close();
      dir = next;
    }
    return dir;
  }

  /** A `.git` made in a parent of the start directory (say `/tmp/.git`) would make git read its config there. */
  private auditParents(): string[] {
    const done: string[] = [];
    for (const p of this.parents) {
      if (p.had || !gitFindsRepositoryAt(p.path)) continue;
      const at = path.join(p.path, somethingAt(path.join(p.path, ".git")) ? ".git" : "HEAD");
      done.push(...moveAside(at, at, `${at}, which would make git take ${p.path} for the project's repository`));
    }
    return done;
  }

  private auditPointer(p: GitPointer, known: string[]): string[] {
    // Accepted as it is now: a pointer rewritten later (same path, other bytes) is looked at again.
    const seen = `${p.display}\0${fileSignature(p.at) ?? ""}`;
    if (this.pointers.has(seen)) return [];
    const target = gitPointer(p);
    // A pointer is the person's kind only when it leads to a git dir the guard watches (a submodule's, a worktree's).
    if (target && known.some((k) => realOrAsIs(k) === target)) return (this.pointers.add(seen), []);
    return moveAside(p.at, p.display, `${p.display}, which sends git to ${target ?? "an unknown place"}`);
  }

  /** What `dir` holds now; its links only with `links` (after an audit, the audit's walk has them). */
  private look(dir: HeldDirectory, links = true): GitDirBaseline {
    const read = (name: string) => {
      try {
        return dir.read(name, MAX_GIT_CONFIG_BYTES);
      } catch {
        return undefined;
      }
    };
    const config = read("config");
    const worktree = read("config.worktree");
    const included = new Map(includedConfigs(dir.path, [config, worktree]).map((f) => [f, includedContent(f)]));
    const todos = new Map(
      SEQUENCER_TODOS.flatMap((t) => {
        const sig = fileSignature(dir.at(t));
        return sig ? [[t, sig] as [string, string]] : [];
      }),
    );
    const baseline: GitDirBaseline = {
      config,
      worktree,
      included,
      hooks: hooksOf(dir),
      commondir: commondirOf(dir),
      todos,
    };
    if (!links) return baseline;
    const reads = gitReadFiles(dir);
    baseline.links = new Map();
    for (const [holder, name] of reads.files) {
      const link = linkTarget(holder.at(name));
      if (link !== undefined) baseline.links.set(path.relative(dir.path, holder.display(name)), link);
    }
    reads.close();
    return baseline;
  }

  private disarm(dir: HeldDirectory, before: GitDirBaseline | undefined, judged: Judged): string[] {
    const done: string[] = [];
    const commondir = commondirOf(dir);
    // A worktree's commondir leads to its repository; any other (new) one could lead git to any config at all.
    if (commondir !== undefined && commondir !== before?.commondir && !this.dirs.has(commondir))
      done.push(
        ...moveAside(
          dir.at("commondir"),
          dir.display("commondir"),
          `${dir.display("commondir")}, which points git at ${commondir}`,
        ),
      );
    // A todo list that changed and now runs a program (`exec …`) would run it at the person's `git rebase --continue`.
    for (const todo of SEQUENCER_TODOS) {
      const parent = todo.split("/")[0]!;
      // Never read or rename through a link (git would follow one to a todo anywhere): the link itself goes.
      if (fs.lstatSync(dir.at(parent), { throwIfNoEntry: false })?.isSymbolicLink()) {
        done.push(...moveAside(dir.at(parent), dir.display(parent), `${dir.display(parent)} (a link)`));
        continue;
      }
      const sig = fileSignature(dir.at(todo));
      if (!sig || before?.todos?.get(todo) === sig) continue;
      let text = "";
      try {
        text = readOwnFile(dir.at(todo), MAX_GIT_CONFIG_BYTES).toString("utf8");
      } catch {
        text = "exec (not a file aic can read)";
      }
      if (/^\s*(x|exec)\s/m.test(text))
        done.push(
          ...moveAside(
            dir.at(todo),
            dir.display(todo),
            `${dir.display(todo)}, whose exec lines run at git rebase --continue`,
          ),
        );
    }
    // A FIFO (or a link to one, or a device) where git reads its index, refs or rules stalls the person's git; a
    // link a command made sends what git writes (COMMIT_EDITMSG at the next commit, a reflog) to any file at all.
    const reads = gitReadFiles(dir);
    judged.links = new Map();
    for (const [holder, name] of reads.files) {
      const rel = path.relative(dir.path, holder.display(name));
      const link = linkTarget(holder.at(name));
      if (link !== undefined && before?.links?.get(rel) !== link) {
        done.push(...moveAside(holder.at(name), holder.display(name), `${holder.display(name)} (a link to ${link})`));
        continue;
      }
      if (link !== undefined) judged.links.set(rel, link);
      let st: fs.Stats | undefined;
      try {
        st = fs.statSync(holder.at(name), { throwIfNoEntry: false }); // through a link too
      } catch {
        st = undefined;
      }
      if (st && isSpecialFile(st))
        done.push(...moveAside(holder.at(name), holder.display(name), `${holder.display(name)} (a FIFO or device)`));
    }
    reads.close();
    done.push(...oversizedGitFiles(dir));
    const hooks = dir.child("hooks");
    for (const [name, sig] of hooksOf(dir))
      if (before?.hooks.get(name) !== sig)
        done.push(...moveAside(hooks!.at(name), hooks!.display(name), `the hook ${hooks!.display(name)}`));
    hooks?.close();
    const config = this.disarmConfig(dir, "config", before?.config);
    const worktree = this.disarmConfig(dir, "config.worktree", before?.worktree);
    judged.config = config.judged;
    judged.worktree = worktree.judged;
    done.push(...config.lines, ...worktree.lines);
    done.push(...this.disarmIncluded(dir, before));
    return done;
  }

  /**
   * A file a config includes is read by git as that config: one that
   * changed since the last look and now sets what runs code is moved aside
   * (git skips an include that is missing).
   */
  private disarmIncluded(dir: HeldDirectory, before: GitDirBaseline | undefined): string[] {
    const configs = ["config", "config.worktree"].map((name) => {
      try {
        return dir.read(name, MAX_GIT_CONFIG_BYTES);
      } catch {
        return undefined;
      }
    });
    const done: string[] = [];
    for (const file of includedConfigs(dir.path, configs)) {
      const now = includedContent(file);
      const was = before?.included.get(file);
      if (!now || (was && was.equals(now))) continue;
      // Made a link or a FIFO since aic last looked: git would follow or read it, aic cannot judge it.
      if (now[0] === 0) {
        done.push(
          ...moveAside(file, file, `${file}, which ${dir.display("config")} includes (not a file aic can judge)`),
        );
        continue;
      }
      const old = new Set((was ? (gitSettings(was) ?? []) : []).map((s) => `${s.key}\n${s.value}`));
      const added = (gitSettings(now) ?? []).filter((s) => runsCode(s) && !old.has(`${s.key}\n${s.value}`));
      if (added.length) done.push(...moveAside(file, file, `${file}, which ${dir.display("config")} includes`));
    }
    return done;
  }

  /** One config of a git dir judged: what was taken out, and the content it is judged to have now. */
  private disarmConfig(
    dir: HeldDirectory,
    name: string,
    before: Buffer | undefined,
  ): { lines: string[]; judged: Buffer | undefined } {
    const where = dir.display(name);
    let now: Buffer;
    try {
      now = dir.read(name, MAX_GIT_CONFIG_BYTES);
    } catch (error) {
      if (error instanceof OwnFileError && error.missing) return { lines: [], judged: undefined };
      // A link, a FIFO, a config too big to be a person's: git might read it, aic cannot judge it.
      return { lines: moveAside(dir.at(name), where, `${where} (${(error as Error).message})`), judged: undefined };
    }
    const kept = { lines: [], judged: now };
    if (before?.equals(now)) return kept;
    const settings = gitSettings(now);
    if (settings === undefined) return kept; // git refuses to work with it: nothing in it runs
    const was = new Set((before ? (gitSettings(before) ?? []) : []).map((s) => `${s.key}\n${s.value}`));
    const added = settings.filter((s) => runsCode(s) && !was.has(`${s.key}\n${s.value}`));
    if (added.length === 0) return kept;
    const cleaned = gitConfigText(settings.filter((s) => !added.includes(s)));
    try {
      dir.replace(`${name}.aic-disabled`, now, true);
      dir.replace(name, cleaned, true);
      const line = `${where}: ${added.map((s) => s.key).join(", ")} (as it was: ${dir.display(`${name}.aic-disabled`)})`;
      return { lines: [line], judged: Buffer.from(cleaned) };
    } catch (error) {
      const line = `${where}: ${added.map((s) => s.key).join(", ")}, which aic could not take out: ${(error as Error).message}`;
      return { lines: [line], judged: before };
    }
  }
}

// ════════════════════════════════════════════════════════════════════════════
// PTY and process groups
// Owns: starting a program on a PTY of its own (Bun's; node-pty loses output
// under Bun), and signalling, waiting for and inspecting its process group.
// ════════════════════════════════════════════════════════════════════════════

type CommandStatus =
  "exited" | "timed_out" | "waiting_for_input" | "runaway" | "stopped" | "interrupted" | "not_started";

interface CommandResult {
  exitCode: number | null;
  status: CommandStatus;
  /** What the model receives: rendered, capped, with the sentinel when cut. */
  output: string;
  savedTo?: string;
}

interface PtyProcess {
  proc: Bun.Subprocess;
  terminal: Bun.Terminal;
  /** Resolves when the PTY reports end of file (or closes). */
  eof: Promise<void>;
}

interface PtyOptions {
  cwd: string;
  env: Record<string, string | undefined>;
  cols: number;
  rows: number;
  onData(bytes: Uint8Array): void;
}

/** A command on its PTY as the runner drives it, whether aic started it itself or the sandbox launcher did. */
interface CommandProcess {
  readonly pid: number;
  /**
   * The exit code (128 + signal when killed), or null when it is not known;
   * resolves once what the command printed before exiting has been
   * delivered: at the PTY's end of file, or a grace later when a background
   * job keeps the terminal open.
   */
  readonly exited: Promise<number | null>;
  /** Resolves when the PTY reports end of file. */
  readonly eof: Promise<void>;
  /** Types into the command's terminal. */
  write(data: string | Uint8Array): void;
  /** Gives the command's terminal another size (its programs get SIGWINCH and redraw). */
  resize(cols: number, rows: number): void;
  /** Closes aic's side of the terminal. */
  close(): void;
}

/** A PTY aic started itself, as a CommandProcess. */
function unconfinedCommand(argv: string[], opts: PtyOptions): CommandProcess {
  const { proc, terminal, eof } = spawnPty(argv, opts);
  return {
    pid: proc.pid,
    exited: drainedExit(proc, eof),
    eof,
    write: (data) => terminal.write(data),
    resize: (cols, rows) => terminal.resize(cols, rows),
    close: () => terminal.close(),
  };
}

/**
 * The children Bun itself started and will reap (commands' shells, the Shell
 * tab). Anything else that becomes aic's child is an orphan adopted through
 * the subreaper, which aic must reap itself; these it must never touch.
 */
const bunChildren = new Set<number>();

/** The exit code of `proc` once the output it wrote before exiting has come through its PTY (see CommandProcess). */
async function drainedExit(proc: Bun.Subprocess, eof: Promise<void>): Promise<number | null> {
  await proc.exited;
  await Promise.race([eof, Bun.sleep(PTY_DRAIN_GRACE_MS)]);
  return exitCodeOf(proc);
}

/** Starts `argv` on a fresh PTY; the child leads its own session and process group. Shared by commands and the Shell tab. */
function spawnPty(argv: string[], opts: PtyOptions): PtyProcess {
  let eofReached!: () => void;
  const eof = new Promise<void>((resolve) => (eofReached = resolve));
  const proc = reapedByBun(
    Bun.spawn(argv, {
      cwd: opts.cwd,
      env: opts.env,
      terminal: {
        cols: opts.cols,
        rows: opts.rows,
        name: "xterm-256color",
        data: (_term, bytes) => opts.onData(bytes),
        exit: () => eofReached(),
      },
    }),
  );
  return { proc, terminal: proc.terminal!, eof };
}

/** Registers a child Bun started and will reap, so the zombie reaper never takes a child Bun waits for. */
function reapedByBun<P extends Bun.Subprocess>(proc: P): P {
  bunChildren.add(proc.pid);
  void proc.exited.then(() => bunChildren.delete(proc.pid));
  return proc;
}

/** Bun.spawn for aic's own helper programs (git), registered. */
function spawnOwned<Out extends "pipe" | number, Err extends "pipe" | "ignore" | number>(
  argv: string[],
  opts: { cwd: string; env: Record<string, string>; stdin: "ignore" | Uint8Array; stdout: Out; stderr: Err },
) {
  return reapedByBun(Bun.spawn(argv, opts));
}

/** `env` without its unset variables, as a spawn request and Bun.spawn's strict type want it. */
function definedEnvironment(env: Record<string, string | undefined>): Record<string, string> {
  return Object.fromEntries(Object.entries(env).filter((entry): entry is [string, string] => entry[1] !== undefined));
}

const SIGNAL_NUMBERS = os.constants.signals as Record<string, number>;

function exitCodeOf(proc: Bun.Subprocess): number | null {
  if (typeof proc.exitCode === "number") return proc.exitCode;
  const signal = proc.signalCode;
  return signal && SIGNAL_NUMBERS[signal] ? 128 + SIGNAL_NUMBERS[signal] : null;
}

/** Sends `sig` to one process; one that is already gone is fine. */
function signalProcess(pid: number, sig: NodeJS.Signals): void {
  if (!(pid > 1)) return;
  try {
    process.kill(pid, sig);
  } catch {
    /* already gone */
  }
}

/** Sends `sig` to every process of the group `pgid`; a group that is already gone is fine. */
function signalGroup(pgid: number, sig: NodeJS.Signals): void {
  // 0 would be aic's own group and 1 every process it may signal: a pid aic could not learn is never a group.
  if (!(pgid > 1)) return;
  try {
    process.kill(-pgid, sig);
  } catch {
    /* the group is already gone */
  }
}

/** One process, as its /proc/<pid>/stat line says. */
interface ProcessInfo {
  pid: number;
  ppid: number;
  pgid: number;
  sid: number;
  /** The foreground group of its controlling terminal (meaningful for a session leader). */
  tpgid: number;
  zombie: boolean;
  /** Stopped by a signal (state T). */
  stopped: boolean;
  /** A zombie's exit code (or 128 + signal), as waitpid would report it. */
  exitCode: number | undefined;
}

/** A waitpid status as a shell reports it: the exit code, or 128 + the signal. */
const waitStatusCode = (s: number) => ((s & 0x7f) === 0 ? (s >> 8) & 0xff : 128 + (s & 0x7f));

/** What /proc says about `pid`, or undefined once it is gone. The name in parentheses may hold anything, so fields are read after the last ")". */
function processInfo(pid: number): ProcessInfo | undefined {
  let stat: string;
  try {
    stat = fs.readFileSync(`/proc/${pid}/stat`, "utf8");
  } catch {
    return undefined;
  }
  const f = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  // Dead and being released (state X, its parent already detached: ppid 0, pgid -1): as good as gone.
  if (f[0] === "X" || f[0] === "x" || f[1] === "0") return undefined;
  return {
    pid,
    ppid: Number(f[1]),
    pgid: Number(f[2]),
    sid: Number(f[3]),
    tpgid: Number(f[5]),
    zombie: f[0] === "Z",
    // Field 52, exit_code, in waitpid's form: readable while a zombie waits to be reaped (by the jail's init).
    exitCode: f[0] === "Z" && f[49] !== undefined ? waitStatusCode(Number(f[49])) : undefined,
    stopped: f[0] === "T",
  };
}

/** Every process on the machine (those that vanish meanwhile are left out). */
function allProcesses(): ProcessInfo[] {
  const list: ProcessInfo[] = [];
  for (const entry of fs.readdirSync("/proc")) {
    if (!/^\d+$/.test(entry)) continue;
    const info = processInfo(Number(entry));
    if (info) list.push(info);
  }
  return list;
}

/** Every live process whose process group is `pgid`. */
function processesInGroup(pgid: number): number[] {
  return allProcesses()
    .filter((p) => p.pgid === pgid && !p.zombie)
    .map((p) => p.pid);
}

/**
 * The process groups that make up a command's foreground: its shell's own,
 * and the one the shell made foreground on the terminal (job control gives
 * each pipeline its own group). Background jobs are in neither, so timeouts,
 * stops and the waiting-for-input rule never touch them.
 */
function foregroundGroups(shellPid: number): number[] {
  const tpgid = processInfo(shellPid)?.tpgid ?? 0;
  return tpgid > 0 && tpgid !== shellPid ? [shellPid, tpgid] : [shellPid];
}

/** How long a pause waits for the shell to be stopped before it stops the shell's job. */
const STOP_WAIT_MS = 50;

/** Waits (a moment, blocking) until `pid` is stopped; false if it is not within STOP_WAIT_MS (it then stays unpaused). */
function untilStopped(pid: number): boolean {
  const deadline = performance.now() + STOP_WAIT_MS;
  for (;;) {
    const info = processInfo(pid);
    if (!info || info.zombie) return false;
    if (info.stopped) return true;
    if (performance.now() > deadline) return false;
  }
}

/**
 * SIGTERM to every group of `groups`, SIGKILL half a second later for
 * whatever is left: children in those groups get the same grace as their
 * parent. `wait` sleeps (asynchronously in the loop, synchronously at exit).
 */
async function killGroups(groups: readonly number[]): Promise<void> {
  for (const g of groups) {
    signalGroup(g, "SIGTERM");
    signalGroup(g, "SIGCONT"); // a group paused for back-pressure must wake to act on SIGTERM
  }
  const deadline = Date.now() + KILL_GRACE_MS;
  while (Date.now() < deadline && groups.some(groupAlive)) await Bun.sleep(KILL_POLL_MS);
  for (const g of groups) signalGroup(g, "SIGKILL");
}

/** The same, blocking: for the last moments of the process, when no timer will run again. */
/** How long ending everything at exit may wait for the jail's processes to be gone. */
const STOP_EVERYTHING_MS = 2000;

/** Every descendant of `pid`, at the moment of the call. */
function descendantsOf(pid: number): number[] {
  const found: number[] = [];
  const walk = (p: number, depth: number) => {
    if (depth > 64) return;
    for (const child of childrenOf(p)) {
      found.push(child);
      walk(child, depth + 1);
    }
  };
  walk(pid, 0);
  return found;
}

/**
 * The orphans of commands aic adopted as their subreaper (daemons, jobs that
 * escaped their group; they carry this aic's marker), and everything they
 * started: SIGKILL, group and all. Never one of Bun's own children (the
 * launcher, aic's git), nor what the person started in the Shell tab.
 */
function killAdoptedOrphans(): void {
  // A process that forks, lets its parent exit and calls setsid, over and over, is a new orphan of aic's a few
  // hundred microseconds later, outside every group aic knew: passes repeat until one finds none (bounded, so
  // leaving never hangs). Each orphan is killed as soon as it is seen, before it can fork again.
  const deadline = Date.now() + ORPHAN_HUNT_MS;
  for (let quiet = 0; quiet < 3 && Date.now() < deadline;) {
    if (killOrphansOnce()) quiet = 0;
    else if (++quiet < 3) Bun.sleepSync(1);
  }
  reapAdoptedZombies();
}

/** One pass of killAdoptedOrphans; whether it found any. */
function killOrphansOnce(): boolean {
  const ours = `${process.pid}.`;
  let found = false;
  for (const pid of ownChildren()) {
    // A command's process carries the marker, unless it cleared its environment (`env -i`); under Landlock it also
    // carries no_new_privs, which nothing can clear (the person's own Shell tab has neither).
    if (bunChildren.has(pid) || !(jobMarkerOf(pid)?.startsWith(ours) || noNewPrivs(pid))) continue;
    const info = processInfo(pid);
    if (!info || info.zombie) continue;
    found = true;
    signalProcess(pid, "SIGKILL");
    for (const d of descendantsOf(pid)) signalProcess(d, "SIGKILL");
    if (info.pgid > 1 && info.pgid !== process.pid) signalGroup(info.pgid, "SIGKILL");
  }
  reapAdoptedZombies();
  return found;
}

/** How long leaving aic keeps hunting orphans that keep making new ones. */
const ORPHAN_HUNT_MS = 2000;

/** Whether a process runs with no_new_privs (every process the sandbox confines does). */
function noNewPrivs(pid: number): boolean {
  try {
    return /^NoNewPrivs:\s*1$/m.test(fs.readFileSync(`/proc/${pid}/status`, "utf8"));
  } catch {
    return false;
  }
}

function killGroupsNow(groups: readonly number[]): void {
  for (const g of groups) {
    signalGroup(g, "SIGTERM");
    signalGroup(g, "SIGCONT");
  }
  const deadline = Date.now() + KILL_GRACE_MS;
  while (Date.now() < deadline && groups.some(groupAlive)) {
    reapAdoptedZombies();
    Bun.sleepSync(KILL_POLL_MS);
  }
  for (const g of groups) signalGroup(g, "SIGKILL");
}

function groupAlive(pgid: number): boolean {
  try {
    process.kill(-pgid, 0);
    return process.platform !== "linux" || processesInGroup(pgid).length > 0;
  } catch {
    return false;
  }
}

/**
 * Variables that point a program at a server of the person's (their tmux, ssh-agent, D-Bus bus, Docker, display):
 * commands never get them (with --allow-ssh-agent, SSH_AUTH_SOCK stays).
 */
const SOCKET_ENV = [
  "SSH_AUTH_SOCK",
  "SSH_AGENT_PID",
  "TMUX",
  "TMUX_PANE",
  "STY",
  "DBUS_SESSION_BUS_ADDRESS",
  "DOCKER_HOST",
  "GPG_AGENT_INFO",
  "WAYLAND_DISPLAY",
  "DISPLAY",
  "XAUTHORITY",
];

/** aic's environment minus the API key and the person's server addresses, for commands (the Shell tab keeps the latter). */
function commandEnvironment(keep: { sockets?: boolean; sshAgent?: boolean } = {}): Record<string, string | undefined> {
  const env: Record<string, string | undefined> = { ...process.env };
  for (const name of Object.keys(env)) if (isSecretEnv(name)) delete env[name];
  if (!keep.sockets) for (const name of SOCKET_ENV) if (!(keep.sshAgent && name === "SSH_AUTH_SOCK")) delete env[name];
  return env;
}

/**
 * This directory's sessions and their lock files (this run's and other aic
 * instances'), and this run's session wherever it is: the jail binds each
 * read-only, so no command (`git clean -fdx`, `rm -rf .`) deletes or edits a
 * conversation. aic itself writes them from outside the jail.
 */
function ownSessionFiles(session: string | undefined, workDir: HeldDirectory): string[] {
  const files = new Set<string>();
  if (session) for (const p of [session, `${session}.lock`]) if (fs.existsSync(p)) files.add(p);
  try {
    for (const e of fs.readdirSync(workDir.at(), { withFileTypes: true }))
      if (e.isFile() && e.name.startsWith(".aicsession")) files.add(workDir.display(e.name));
  } catch {
    /* an unreadable directory: nothing to protect there */
  }
  return [...files];
}

// ════════════════════════════════════════════════════════════════════════════
// Sandbox launcher
// Owns: the one confined helper process that starts every command while the
// sandbox is on, and the frames aic and it exchange over its pipes.
//
// Why a helper: starting each command through its own `aic __sandbox-exec`
// paid a whole start of this 130 MB executable per step (~10 ms, most of a
// step). Now aic starts `aic __sandbox-exec PLAN -- aic __sandbox-launcher`
// once: the launcher is confined before it runs a line of its own, so every
// thread it ever has and every command it starts is in the same Landlock
// domain, exactly as strong as before. It only puts commands on PTYs and
// relays their bytes; aic still times, pauses, stops and signals commands
// itself, by process group, as it always did.
//
// What it is trusted with: nothing. It shares its domain with the commands,
// so a command running as root could take it over (ptrace, its /proc fds)
// and write to aic in its name. It would gain nothing it lacks: what the
// launcher says is command output, exit codes and pids, which aic already
// treats as untrusted; a pid it names for a new command must be its own
// child; a frame no honest launcher sends ends it and fails what it held.
// It is made non-dumpable, so a command not running as root cannot reach it.
// ════════════════════════════════════════════════════════════════════════════

const SANDBOX_LAUNCHER = "__sandbox-launcher";

/** The frames: [kind u8][id u32 LE][length u32 LE][payload]. `id` names a command (0 for the launcher itself). */
const FRAME = {
  /** aic → launcher: JSON `LaunchRequest`. */
  spawn: 1,
  /** aic → launcher: bytes for the command's terminal (a person answering a prompt). */
  input: 2,
  /** aic → launcher: aic is done with the command's terminal. */
  close: 3,
  /** aic → launcher: u16 columns, u16 rows: the command's terminal is that size now (a person's pane). */
  resize: 4,
  /** aic → launcher (id 0): aic is leaving with --keep-jobs: outlive it until no command's process is left. */
  keep: 5,
  /** launcher → aic: confined (it got here through restrict and execve, which is the proof). */
  ready: 10,
  /** launcher → aic: i32 pid. */
  spawned: 11,
  /** launcher → aic: bytes the command's terminal printed. */
  output: 12,
  /** launcher → aic: the terminal reached end of file. */
  eof: 13,
  /** launcher → aic: i32 exit code (128 + signal; -1 unknown). */
  exit: 14,
  /** launcher → aic: UTF-8 reason the spawn failed. */
  failed: 15,
  /** launcher → aic (id 0): i32 pid, i32 exit code of an orphan the launcher reaped as the jail's init. */
  reaped: 16,
} as const;

const FRAME_HEADER_BYTES = 9;
/** A spawn frame carries the environment and the command; nothing honest comes near this. */
const MAX_FRAME_BYTES = 16 << 20;
/** How long the launcher may take to confine itself and say so before the sandbox is declared off. */
const LAUNCHER_START_MS = 15_000;

interface Frame {
  kind: number;
  id: number;
  payload: Uint8Array;
}

interface LaunchRequest {
  argv: string[];
  cwd: string;
  env: Record<string, string>;
  cols: number;
  rows: number;
}

function encodeFrame(kind: number, id: number, payload: Uint8Array = new Uint8Array(0)): Uint8Array {
  const frame = new Uint8Array(FRAME_HEADER_BYTES + payload.length);
  const view = new DataView(frame.buffer);
  view.setUint8(0, kind);
  view.setUint32(1, id, true);
  view.setUint32(5, payload.length, true);
  frame.set(payload, FRAME_HEADER_BYTES);
  return frame;
}

function int32Frame(kind: number, id: number, value: number): Uint8Array {
  const payload = new Uint8Array(4);
  new DataView(payload.buffer).setInt32(0, value, true);
  return encodeFrame(kind, id, payload);
}

/** Cuts a byte stream into frames; throws on a length no honest peer sends. */
class FrameReader {
  private pending = new Uint8Array(0);

  push(chunk: Uint8Array): Frame[] {
    let data = chunk;
    if (this.pending.length) {
      data = new Uint8Array(this.pending.length + chunk.length);
      data.set(this.pending);
      data.set(chunk, this.pending.length);
    }
    const frames: Frame[] = [];
    let at = 0;
    while (data.length - at >= FRAME_HEADER_BYTES) {
      const view = new DataView(data.buffer, data.byteOffset + at, FRAME_HEADER_BYTES);
      const length = view.getUint32(5, true);
      if (length > MAX_FRAME_BYTES) throw new Error(`sent a frame of ${length} bytes`);
      if (data.length - at < FRAME_HEADER_BYTES + length) break;
      const start = at + FRAME_HEADER_BYTES;
      frames.push({
        kind: view.getUint8(0),
        id: view.getUint32(1, true),
        payload: data.subarray(start, start + length),
      });
      at = start + length;
    }
    this.pending = data.slice(at);
    return frames;
  }
}

const frameInt = (payload: Uint8Array) =>
  payload.length === 4 ? new DataView(payload.buffer, payload.byteOffset, 4).getInt32(0, true) : undefined;

/**
 * SIGILL, SIGTRAP, SIGABRT, SIGBUS, SIGFPE, SIGSEGV: Bun handles them (for
 * its crash report), so a command could send them to init and end it. Bun
 * also handles SIGPWR and signal 33, which the JavaScript engine itself uses
 * (to stop threads for the collector): those stay, and a command that sends
 * them can at most wedge the launcher, which aic replaces.
 */
const INIT_IGNORED_SIGNALS = [4, 5, 6, 7, 8, 11];
const SIG_IGN = 1;

/**
 * The launcher's whole life, in the confined process: say ready, then start
 * what aic asks for until aic closes the pipe.
 */
async function runSandboxLauncher(): Promise<number> {
  const judged = process.env[EXEC_JUDGE_ENV];
  delete process.env[EXEC_JUDGE_ENV];
  // Non-dumpable, no command without root reaches it. Under the exec judge without CAP_SYS_PTRACE (a person's
  // aic under Landlock alone) it stays dumpable, since the supervisor must read the argv of the children it forks,
  // which share its memory until they exec: a command that takes it over gains what a root command could
  // already (see above), and the listener is gone from it before any command runs.
  if (!judged || judged.endsWith("+ptrace")) libc()?.symbols.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
  if (judged) {
    const why = putLauncherUnderExecJudge(judged.startsWith("init"));
    if (why) return (writeOut(2, `aic sandbox: ${why}\n`), 126);
  }
  /** Every orphan of every command becomes this process's child: as the jail's init, or as its subreaper under the judge. */
  const adopts = process.pid === 1 || Boolean(judged?.startsWith("init"));
  // Descriptor 3 is aic's own binary, by which the launcher was started: commands never inherit it.
  try {
    fs.closeSync(3);
  } catch {
    /* started without it */
  }
  // Once aic has gone (--keep-jobs), nobody reads: frames are dropped, never an EPIPE that ends the jail's init.
  let aicGone = false;
  let keep = false;
  const send = (frame: Uint8Array) => {
    if (aicGone) return;
    try {
      writeOut(1, frame);
    } catch {
      aicGone = true;
    }
  };
  // A namespace's init gets from inside only the signals it handles, and Bun handles crash signals: ignored here, a
  // `kill -SEGV 1` from a command does nothing (a real fault still ends the process, as the kernel forces it).
  if (process.pid === 1) for (const sig of INIT_IGNORED_SIGNALS) libc()?.symbols.signal(sig, SIG_IGN);
  // As the jail's init, every orphan of every command becomes the launcher's child: reaped here, and its exit code
  // told to aic (a background job's leader is such an orphan once its command's shell has exited).
  if (adopts)
    setInterval(() => {
      for (const [pid, code] of reapAdoptedZombies()) {
        const payload = new Uint8Array(8);
        new DataView(payload.buffer).setInt32(0, pid, true);
        new DataView(payload.buffer).setInt32(4, code, true);
        send(encodeFrame(FRAME.reaped, 0, payload));
      }
    }, JOB_POLL_MS / 2).unref();
  const terminals = new Map<number, Bun.Terminal>();
  /** Terminals some process still holds: with --keep-jobs the launcher outlives aic until each reaches its end. */
  const held = new Set<Promise<void>>();
  const spawn = (id: number, request: LaunchRequest) => {
    try {
      const { proc, terminal, eof } = spawnPty(request.argv, {
        ...request,
        onData: (bytes) => send(encodeFrame(FRAME.output, id, bytes)),
      });
      held.add(eof);
      void eof.then(() => {
        held.delete(eof);
        send(encodeFrame(FRAME.eof, id));
      });
      terminals.set(id, terminal);
      send(int32Frame(FRAME.spawned, id, proc.pid));
      // After the output it printed before exiting, which the pipe then delivers in order.
      void drainedExit(proc, eof).then((code) => send(int32Frame(FRAME.exit, id, code ?? -1)));
    } catch (error) {
      send(encodeFrame(FRAME.failed, id, utf8.encode((error as Error).message)));
    }
  };
  send(encodeFrame(FRAME.ready, 0));
  const reader = new FrameReader();
  for await (const chunk of Bun.stdin.stream()) {
    for (const frame of reader.push(chunk)) {
      if (frame.kind === FRAME.spawn) spawn(frame.id, JSON.parse(utf8Decoder.decode(frame.payload)) as LaunchRequest);
      else if (frame.kind === FRAME.input) terminals.get(frame.id)?.write(frame.payload);
      else if (frame.kind === FRAME.resize && frame.payload.length === 4) {
        const size = new DataView(frame.payload.buffer, frame.payload.byteOffset, 4);
        terminals.get(frame.id)?.resize(size.getUint16(0), size.getUint16(2));
      } else if (frame.kind === FRAME.close) {
        terminals.get(frame.id)?.close();
        terminals.delete(frame.id);
      } else if (frame.kind === FRAME.keep) keep = true;
    }
  }
  aicGone = true;
  // aic has gone. With --keep-jobs the launcher stays while a kept process holds one of its terminals (a server that
  // logs there fails once it closes) and, as the jail's init, until its last process ends: the namespaces end with it.
  const busy = () => held.size > 0 || (adopts && childrenOf(process.pid).some((pid) => !processInfo(pid)?.zombie));
  while (keep && busy()) {
    if (adopts) reapAdoptedZombies();
    await Bun.sleep(JOB_POLL_MS);
  }
  return 0; // the commands' terminals close with this process
}

// ════════════════════════════════════════════════════════════════════════════
// Sandbox launcher: aic's side
// Owns: the one launcher process a run keeps: asking it for commands and
// reading its frames, the pid and group a jailed command sees, and freezing and
// killing what commands leave.
// ════════════════════════════════════════════════════════════════════════════

/** A command the launcher was asked for, from aic's side. */
interface LaunchedCommand {
  pid?: number;
  onData(bytes: Uint8Array): void;
  started(pid: number): void;
  refused(error: Error): void;
  exitedWith(code: number | null): void;
  reachedEof(): void;
}

/** One launcher process and the commands it holds. */
interface LauncherProcess {
  proc: Bun.Subprocess<"pipe", "pipe", "pipe">;
  commands: Map<number, LaunchedCommand>;
  /** The launcher's own pid in aic's view: `proc`'s in Landlock alone, the child of `unshare` in the jail. */
  hostPid: number;
  /** Stops it if it stops answering (stopped, or gone silent with commands waiting). */
  watchdog?: ReturnType<typeof setInterval>;
  /** It said it is confined: a launcher that ends after that is started again as it was, never weaker. */
  ready?: boolean;
}

/** How many times the jail is swept for processes to stop before a checkpoint, and how long they may take to stop. */
const FREEZE_ROUNDS = 5;
const FREEZE_SETTLE_MS = 50;

/** How long a launcher may take to say it started a command before it is taken for stuck and replaced (a loaded CI machine took over 5 s). */
const LAUNCHER_ANSWER_MS = 15_000;
/** How often a launcher holding commands is looked at (stopped by a command? then it is replaced). */
const LAUNCHER_WATCH_MS = 500;

/** The pids of `pid`'s children, across its threads. */
function childrenOf(pid: number): number[] {
  const found = new Set<number>();
  try {
    for (const task of fs.readdirSync(`/proc/${pid}/task`))
      for (const child of fs.readFileSync(`/proc/${pid}/task/${task}/children`, "utf8").split(" "))
        if (child.trim()) found.add(Number(child));
  } catch {
    /* gone */
  }
  return [...found];
}

/** A process's pid in the innermost PID namespace it lives in (the jail's), from its status. */
function innermostPid(hostPid: number): number | undefined {
  try {
    const line = /^NSpid:\s*(.*)$/m.exec(fs.readFileSync(`/proc/${hostPid}/status`, "utf8"))?.[1];
    const pids = line?.trim().split(/\s+/).map(Number);
    return pids?.at(-1);
  } catch {
    return undefined;
  }
}

/** A process's group in the innermost PID namespace it lives in (the jail's), from its status. */
function innermostPgid(hostPid: number): number | undefined {
  try {
    const line = /^NSpgid:\s*(.*)$/m.exec(fs.readFileSync(`/proc/${hostPid}/status`, "utf8"))?.[1];
    const groups = line?.trim().split(/\s+/).map(Number);
    return groups?.at(-1);
  } catch {
    return undefined;
  }
}

/** Exit codes of orphans the jail's init reaped, by their pid in the jail (a job's leader is looked up here). */
const jailReapedExitCodes = new Map<number, number>();

/**
 * aic's end of the launcher: starts it (and again, on the next command, if
 * it died or was replaced), sends it commands, and routes what it says to
 * each command. In the jail the launcher reports pids as the jail sees them;
 * aic signals and inspects commands by their pids in its own view, found as
 * the launcher's children.
 */
class SandboxLauncher {
  private live: LauncherProcess | undefined;
  private starting: Promise<string | undefined> | undefined;
  private nextId = 1;

  constructor(
    private argv: string[],
    /** Started through `unshare` into the jail's namespaces (the launcher is then the child of `unshare`). */
    private jailed: boolean,
    /**
     * Where the jail's init turns out to have no power over its namespaces (an AppArmor profile): the
     * launcher under Landlock alone, started from the next command on, and who is told.
     */
    private readonly fallback?: { argv: string[]; onRefused(why: string): void },
    /** Under the exec judge: the launcher is the child of its supervisor, one level further down. */
    private readonly supervised = false,
  ) {
    process.on("exit", () => {
      if (this.keeping) return;
      this.live?.proc.kill("SIGKILL");
      if (this.live && this.live.hostPid !== this.live.proc.pid) signalProcess(this.live.hostPid, "SIGKILL");
    });
  }

  private keeping = false;

  /** --keep-jobs: aic exits and leaves the launcher (the jail's init) to outlive it while commands' processes run. */
  keepRunning(): void {
    const live = this.live;
    if (!live) return;
    this.keeping = true;
    try {
      live.proc.stdin.write(encodeFrame(FRAME.keep, 0));
      void live.proc.stdin.flush();
    } catch {
      /* gone already: nothing to keep */
    }
  }

  /** Ends the launcher now and, in the jail, waits (a bounded while) until every process of the namespace is gone. */
  stopEverything(): void {
    const live = this.live;
    if (!live) return;
    const inside = this.jailed ? descendantsOf(live.hostPid) : [];
    signalProcess(live.hostPid, "SIGKILL");
    live.proc.kill("SIGKILL");
    const deadline = Date.now() + STOP_EVERYTHING_MS;
    while (
      Date.now() < deadline &&
      [live.hostPid, ...inside].some((pid) => processInfo(pid) && !processInfo(pid)?.zombie)
    )
      Bun.sleepSync(KILL_POLL_MS);
  }

  /** The launcher's pid in aic's view while it runs: every orphan in the jail becomes its child. */
  get reaper(): number | undefined {
    return this.jailed ? this.live?.hostPid : undefined;
  }

  /** Starts the launcher unless one runs; resolves once it is confined (undefined) or with why it is not. */
  start(): Promise<string | undefined> {
    if (this.live && !this.starting) return Promise.resolve(undefined);
    return (this.starting ??= this.launchOrFallBack().finally(() => (this.starting = undefined)));
  }

  /** A jail that could not be built degrades to Landlock alone at once: the command that waited runs there. */
  private async launchOrFallBack(): Promise<string | undefined> {
    const wasJailed = this.jailed;
    const why = await this.launch();
    return why && wasJailed && !this.jailed ? this.launch() : why;
  }

  private launch(): Promise<string | undefined> {
    const env = definedEnvironment(commandEnvironment());
    let proc: Bun.Subprocess<"pipe", "pipe", "pipe">;
    // aic's own binary by descriptor (fd 3 of the child): the inode running now, whatever a command put at its path.
    const binary = fs.openSync("/proc/self/exe", O.O_RDONLY);
    try {
      // Its own session: a Ctrl+C at aic's terminal is aic's to handle, not a way to kill every command at once.
      // Bun's types know three stdio entries; a fourth (the binary) is passed as the child's fd 3.
      const stdio = ["pipe", "pipe", "pipe", binary] as unknown as ["pipe", "pipe", "pipe"];
      proc = reapedByBun(Bun.spawn(this.argv, { stdio, env, detached: true }));
    } catch (error) {
      return Promise.resolve(`the sandbox launcher cannot start: ${(error as Error).message}`);
    } finally {
      fs.closeSync(binary);
    }
    const live: LauncherProcess = { proc, commands: new Map(), hostPid: proc.pid };
    this.live = live;
    return new Promise((resolve) => {
      const timer = setTimeout(() => {
        resolve(`the sandbox launcher did not start within ${LAUNCHER_START_MS / 1000} s`);
        proc.kill("SIGKILL");
      }, LAUNCHER_START_MS);
      const ready = (why?: string) => {
        clearTimeout(timer);
        if (!why && this.jailed) live.hostPid = childrenOf(proc.pid)[0] ?? proc.pid;
        if (!why && this.supervised) live.hostPid = childrenOf(live.hostPid)[0] ?? live.hostPid;
        if (!why) live.watchdog = setInterval(() => this.watch(live), LAUNCHER_WATCH_MS);
        live.watchdog?.unref?.();
        resolve(why);
      };
      void this.listen(live, ready);
    });
  }

  /**
   * A launcher stopped (SIGSTOP by a command that shares its Landlock domain,
   * where there is no jail) would leave aic waiting for ever: it is killed, its
   * commands end with their exit code unknown, and the next command starts a
   * new one.
   */
  private watch(live: LauncherProcess): void {
    // Under Landlock alone a command may stop the exec supervisor too (`proc`), which every exec then waits for.
    if (!processInfo(live.hostPid)?.stopped && !processInfo(live.proc.pid)?.stopped) return;
    signalProcess(live.hostPid, "SIGKILL");
    live.proc.kill("SIGKILL");
  }

  /** Reads the launcher's frames until it ends; then fails whatever it still held. */
  private async listen(live: LauncherProcess, ready: (why?: string) => void): Promise<void> {
    const { proc, commands } = live;
    const reader = new FrameReader();
    let broken: string | undefined;
    try {
      for await (const chunk of proc.stdout)
        for (const frame of reader.push(chunk)) {
          if (frame.kind === FRAME.ready) {
            live.ready = true;
            ready();
          } else this.dispatch(live, frame);
        }
    } catch (error) {
      broken = (error as Error).message;
    }
    clearInterval(live.watchdog);
    if (this.live === live) this.live = undefined;
    proc.kill("SIGKILL");
    const why = `the sandbox launcher ${broken ? `was stopped: it ${broken}` : "ended"}`;
    for (const [id, command] of commands) {
      commands.delete(id);
      if (command.pid === undefined) command.refused(new Error(`${why}; the command was not run`));
      else {
        command.reachedEof();
        command.exitedWith(null);
      }
    }
    await proc.exited;
    const said = (await new Response(proc.stderr).text()).trim().replace(/^aic (sandbox|jail): /, "");
    // Whatever kept the jail from being built (namespaces refused, a mount the container forbids), commands still run.
    if (this.jailed && this.fallback && !live.ready) {
      this.argv = this.fallback.argv;
      this.jailed = false;
      this.fallback.onRefused(said);
    }
    ready(said || `the sandbox launcher exited ${exitCodeOf(proc)}`);
  }

  private dispatch(live: LauncherProcess, frame: Frame): void {
    if (frame.kind === FRAME.reaped && frame.id === 0) {
      const view =
        frame.payload.length === 8 ? new DataView(frame.payload.buffer, frame.payload.byteOffset, 8) : undefined;
      if (!view) throw new Error("sent a malformed reaped frame");
      jailReapedExitCodes.set(view.getInt32(0, true), view.getInt32(4, true));
      if (jailReapedExitCodes.size > 1000) jailReapedExitCodes.delete(jailReapedExitCodes.keys().next().value!);
      return;
    }
    const command = live.commands.get(frame.id);
    if (!command) return; // a command aic has closed: late bytes are dropped
    switch (frame.kind) {
      case FRAME.spawned: {
        const said = frameInt(frame.payload);
        if (said === undefined || said <= 1 || command.pid !== undefined) throw new Error("named a pid twice or badly");
        // In the jail the launcher speaks of its own PID namespace: the command is its child with that inner pid.
        const pid = this.jailed ? (childrenOf(live.hostPid).find((p) => innermostPid(p) === said) ?? 0) : said;
        // Gone already (a quick command, reaped) is fine; alive, it must be the launcher's own child.
        const info = pid > 1 ? processInfo(pid) : undefined;
        if (info && !info.zombie && info.ppid !== live.hostPid) throw new Error(`named pid ${pid}, not its child`);
        command.pid = pid;
        return command.started(pid);
      }
      case FRAME.failed:
        live.commands.delete(frame.id);
        return command.refused(new Error(utf8Decoder.decode(frame.payload)));
      case FRAME.output:
        return command.onData(frame.payload);
      case FRAME.eof:
        return command.reachedEof();
      case FRAME.exit: {
        const code = frameInt(frame.payload);
        if (code === undefined) throw new Error("sent a malformed exit code");
        return command.exitedWith(code < 0 ? null : code);
      }
      default:
        throw new Error(`sent a frame of unknown kind ${frame.kind}`);
    }
  }

  /** Starts `argv` confined on a PTY of its own, as spawnPty does unconfined. */
  async spawn(argv: string[], opts: PtyOptions): Promise<CommandProcess> {
    const refused = await this.start();
    const live = this.live;
    if (refused || !live)
      throw new Error(
        `the sandbox cannot start commands (${refused ?? "its launcher ended"}), so the command was not run; aic --disable-sandbox runs commands unconfined`,
      );
    const send = (frame: Uint8Array) => {
      try {
        live.proc.stdin.write(frame);
        void live.proc.stdin.flush();
      } catch {
        /* the launcher has gone; listen() fails its commands */
      }
    };
    const id = this.nextId++;
    let reachedEof!: () => void;
    const eof = new Promise<void>((resolve) => (reachedEof = resolve));
    let exitedWith!: (code: number | null) => void;
    const exited = new Promise<number | null>((resolve) => (exitedWith = resolve));
    const env = definedEnvironment(opts.env);
    const request: LaunchRequest = { argv, cwd: opts.cwd, env, cols: opts.cols, rows: opts.rows };
    const pid = await new Promise<number>((started, refused) => {
      // A launcher that does not answer in time is taken for stuck: killed (the next command starts a new one).
      const stuck = setTimeout(() => {
        signalProcess(live.hostPid, "SIGKILL");
        live.proc.kill("SIGKILL");
      }, LAUNCHER_ANSWER_MS);
      const done =
        <T>(f: (value: T) => void) =>
        (value: T) => {
          clearTimeout(stuck);
          f(value);
        };
      live.commands.set(id, {
        onData: opts.onData,
        started: done(started),
        refused: done(refused),
        exitedWith,
        reachedEof,
      });
      send(encodeFrame(FRAME.spawn, id, utf8.encode(JSON.stringify(request))));
    });
    return {
      pid,
      exited,
      eof,
      write: (data) => send(encodeFrame(FRAME.input, id, typeof data === "string" ? utf8.encode(data) : data)),
      resize: (cols, rows) => {
        const size = new Uint8Array(4);
        new DataView(size.buffer).setUint16(0, cols);
        new DataView(size.buffer).setUint16(2, rows);
        send(encodeFrame(FRAME.resize, id, size));
      },
      close: () => {
        if (live.commands.delete(id)) send(encodeFrame(FRAME.close, id));
      },
    };
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Output capture
// Owns: turning what a command printed into what a person would have seen:
// plain lines cut directly (the next section's emulator takes the rest),
// capped head + tail, the whole rendering saved to a file the model can read
// in slices. Memory stays bounded whatever it prints.
// ════════════════════════════════════════════════════════════════════════════

const utf8 = new TextEncoder();
const utf8Decoder = new TextDecoder();

/** The first `max` UTF-8 bytes of `text`, never splitting a character. */
function headBytes(text: string, max: number): string {
  const bytes = utf8.encode(text);
  if (bytes.length <= max) return text;
  let end = max;
  while (end > 0 && (bytes[end]! & 0xc0) === 0x80) end--;
  return utf8Decoder.decode(bytes.subarray(0, end));
}

/** The last `max` UTF-8 bytes of `text`, never splitting a character. */
function tailBytes(text: string, max: number): string {
  const bytes = utf8.encode(text);
  if (bytes.length <= max) return text;
  let start = bytes.length - max;
  while (start < bytes.length && (bytes[start]! & 0xc0) === 0x80) start++;
  return utf8Decoder.decode(bytes.subarray(start));
}

const OUTPUT_DIR_PREFIX = "aic-out-";

/**
 * Where saved outputs live: `outputs/` in aic's state directory, out of
 * every command's reach (the jail shows a run only its own), or the
 * temporary directory where there is no state directory.
 */
function outputsHome(): string {
  const state = aicStateDir();
  return state ? path.join(state, "outputs") : path.resolve(os.tmpdir());
}
/** The saved output file is written in batches of this size, not line by line. */
const OUTPUT_FILE_WRITE_BYTES = 64 * 1024;
/** Rendering a flood leaves short-lived garbage behind; the collector is nudged after this much parsed output. */
const GC_NUDGE_BYTES = 256 * 1024;
const OUTPUT_DIR_MAX_AGE_MS = 7 * 24 * 3600 * 1000;

/**
 * Where the whole output of a long command is kept so the model can read it
 * in slices. A path the model was given stays valid as long as the
 * conversation naming it: with a session file the directory belongs to the
 * session (its path is saved in it; pruned once unused for a week, removed
 * by /clear); without one it is removed when aic exits.
 */
class OutputStore {
  private dir: HeldDirectory | undefined;
  private tag: string;

  constructor(
    private readonly persistent: boolean,
    tag: string,
    remembered?: string,
    /** Told the directory's path whenever it changes, so the session can record it. */
    private readonly onDirectory: (dir: string | undefined) => void = () => {},
  ) {
    this.tag = OutputStore.safeTag(tag);
    if (remembered) this.dir = OutputStore.adopt(remembered);
    this.announced = this.dir !== undefined;
    this.onDirectory(this.dir?.path);
  }

  /** The directory's path, once there is one (saved in the session). */
  get path(): string | undefined {
    return this.dir?.path;
  }

  /**
   * A directory named in a session file is reused only if it is what aic
   * made: directly in the temporary directory, named like aic's, a real
   * directory owned by this user and private to it. A session file sits
   * where commands can write, so it must not steer aic's writes elsewhere.
   */
  private static adopt(dir: string): HeldDirectory | undefined {
    // (Sessions of older aic versions name a directory directly in /tmp.)
    const parents = [outputsHome(), path.resolve(os.tmpdir())];
    if (!parents.includes(path.dirname(dir)) || !path.basename(dir).startsWith(OUTPUT_DIR_PREFIX)) return undefined;
    try {
      const st = fs.lstatSync(dir);
      if (!st.isDirectory() || st.uid !== process.getuid?.() || (st.mode & 0o077) !== 0) return undefined;
      const held = HeldDirectory.open(dir);
      return held.isStillAtPath() ? held : (held.close(), undefined);
    } catch {
      return undefined;
    }
  }

  /** A new file for one command's whole output (or a job's terminal): its descriptor, and the path to give the model. */
  createFile(kind: "output" | "job" = "output"): { fd: number; path: string } {
    // A command may have renamed the directory and put something else at its path: start a new one.
    if (this.dir && !this.dir.isStillAtPath()) {
      this.dir.close();
      this.dir = undefined;
      this.announced = false;
    }
    const dir = this.ensure();
    // The session names the directory once something is in it.
    if (!this.announced) {
      this.announced = true;
      this.onDirectory(dir.path);
    }
    const name = `${kind}-${Date.now()}-${randomName()}.${kind === "job" ? "log" : "txt"}`;
    return { fd: dir.createExclusive(name), path: dir.display(name) };
  }

  private announced = false;

  /**
   * The directory, made now if there is none yet (the jail shows commands
   * this one, so it is made before the jail starts). In the temporary
   * directory when aic's state directory cannot be made (a read-only home).
   */
  ensure(): HeldDirectory {
    if (!this.dir) {
      const prefix = `${OUTPUT_DIR_PREFIX}${this.tag}-`;
      try {
        this.dir = HeldDirectory.createPrivate(outputsHome(), prefix);
      } catch {
        this.dir = HeldDirectory.createPrivate(path.resolve(os.tmpdir()), prefix);
      }
    }
    return this.dir;
  }

  /** Forgets every saved output (/clear); later outputs go to a new directory. */
  clear(newTag: string): void {
    this.dir?.remove();
    this.dir = undefined;
    this.announced = false;
    this.tag = OutputStore.safeTag(newTag);
    this.onDirectory(undefined);
  }

  /** A session id (hand-edited sessions hold any text, `../..` too) as one safe piece of a name in /tmp. */
  private static safeTag(tag: string): string {
    return tag.replace(/[^A-Za-z0-9_-]/g, "_").slice(0, 64) || "session";
  }

  /** At exit: a session keeps its outputs, and --keep-jobs the logs the end names; otherwise nothing refers to them. */
  close(keep = false): void {
    if (this.persistent || keep) this.dir?.close();
    else this.dir?.remove();
    this.dir = undefined;
  }

  /** Removes this user's output directories left unused for a week (their sessions are long over). */
  static pruneOld(now = Date.now()): void {
    for (const parent of [outputsHome(), os.tmpdir()]) OutputStore.pruneIn(parent, now);
  }

  private static pruneIn(parent: string, now: number): void {
    let names: string[];
    try {
      const held = HeldDirectory.open(parent);
      names = fs.readdirSync(held.at());
      held.close();
    } catch {
      return;
    }
    for (const name of names) {
      if (!name.startsWith(OUTPUT_DIR_PREFIX)) continue;
      const dir = path.join(parent, name);
      try {
        const st = fs.lstatSync(dir);
        if (st.isDirectory() && st.uid === process.getuid?.() && now - st.mtimeMs > OUTPUT_DIR_MAX_AGE_MS)
          HeldDirectory.open(dir).remove();
      } catch {
        /* gone meanwhile, or not ours */
      }
    }
  }
}

/**
 * Keeps the rendered lines of one command: everything while it is small, then
 * a head, a bounded tail and a file with the whole rendering. Blank lines are
 * held back until something follows them, so trailing blanks never reach the
 * model or the file.
 */
class RenderedOutput {
  private lines: string[] = [];
  private bytes = 0;
  private linesOut = 0;
  private blanks = 0;
  private spilled = false;
  private head: string[] = [];
  /** The tail as a queue: lines from `tailStart` on, with their byte sizes. */
  private tail: string[] = [];
  private tailSizes: number[] = [];
  private tailStart = 0;
  private tailBytes = 0;
  /** The full-output file; undefined before the spill, or after writing it failed. */
  private file: number | undefined;
  private fileError: string | undefined;
  private fileBuffer: string[] = [];
  private fileBufferBytes = 0;
  filePath: string | undefined;

  constructor(
    private readonly maxBytes: number,
    private readonly outputs: OutputStore,
  ) {}

  add(line: string): void {
    if (line.trim() === "") {
      this.blanks++;
      return;
    }
    for (; this.blanks > 0; this.blanks--) this.store("");
    this.store(line);
  }

  private store(line: string): void {
    const size = Buffer.byteLength(line) + 1;
    this.bytes += size;
    this.linesOut++;
    if (!this.spilled) {
      this.lines.push(line);
      if (this.bytes > this.maxBytes) this.spill();
      return;
    }
    this.toFile(line, size);
    this.tail.push(line);
    this.tailSizes.push(size);
    this.tailBytes += size;
    while (this.tail.length - this.tailStart > 1 && this.tailBytes - this.tailSizes[this.tailStart]! >= this.maxBytes)
      this.tailBytes -= this.tailSizes[this.tailStart++]!;
    if (this.tailStart > 4096) {
      this.tail = this.tail.slice(this.tailStart);
      this.tailSizes = this.tailSizes.slice(this.tailStart);
      this.tailStart = 0;
    }
  }

  /** Buffered: one write(2) per 64 KB rather than per line. */
  private toFile(line: string, size: number): void {
    if (this.file === undefined) return;
    this.fileBuffer.push(line);
    this.fileBufferBytes += size;
    if (this.fileBufferBytes >= OUTPUT_FILE_WRITE_BYTES) this.flushFile();
  }

  private flushFile(): void {
    if (this.file === undefined || !this.fileBuffer.length) return;
    try {
      fs.writeSync(this.file, this.fileBuffer.join("\n") + "\n");
    } catch (error) {
      this.fileFailed(error);
    }
    this.fileBuffer = [];
    this.fileBufferBytes = 0;
  }

  /** A full /tmp must not cost the command its result: keep head and tail, and say the file is missing. */
  private fileFailed(error: unknown): void {
    this.fileError = (error as Error).message;
    if (this.file !== undefined)
      try {
        fs.closeSync(this.file);
      } catch {
        /* already closed */
      }
    this.file = undefined;
  }

  /** Past the cap: start the file and keep only a head and a tail in memory. */
  private spill(): void {
    this.spilled = true;
    try {
      const created = this.outputs.createFile();
      this.file = created.fd;
      this.filePath = created.path;
      fs.writeSync(this.file, this.lines.join("\n") + "\n");
    } catch (error) {
      this.fileFailed(error);
    }
    let headSize = 0;
    for (const l of this.lines) {
      if (headSize >= this.maxBytes / 2) break;
      this.head.push(l);
      headSize += Buffer.byteLength(l) + 1;
    }
    this.tail = this.lines.slice(this.head.length);
    this.tailSizes = this.tail.map((l) => Buffer.byteLength(l) + 1);
    this.tailBytes = this.tailSizes.reduce((n, b) => n + b, 0);
    this.lines = [];
  }

  /** What the model receives. */
  finish(): { text: string; savedTo?: string } {
    if (!this.spilled) {
      const text = this.lines.join("\n");
      if (Buffer.byteLength(text) <= this.maxBytes) return { text };
      this.spill();
    }
    this.flushFile();
    if (this.file !== undefined) fs.closeSync(this.file);
    const half = Math.floor(this.maxBytes / 2);
    const headText = this.head.join("\n");
    const head = headBytes(headText, half);
    // Lines the head cut (one line longer than the cap, say) end in the tail, before whatever followed them.
    const rest = this.tail.slice(this.tailStart).join("\n");
    const tailSource =
      Buffer.byteLength(headText) > Buffer.byteLength(head) ? [headText, rest].filter(Boolean).join("\n") : rest;
    const tail = tailBytes(tailSource, this.maxBytes - Buffer.byteLength(head));
    const omitted = this.bytes - Buffer.byteLength(head) - Buffer.byteLength(tail);
    const where = this.fileError ? { error: this.fileError } : { savedTo: this.filePath ?? "" };
    const text = [head, truncationNote(omitted, this.bytes, this.linesOut, where), tail, TRUNCATION_SENTINEL].join(
      "\n",
    );
    return { text, savedTo: this.fileError ? undefined : this.filePath };
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Output capture: the terminal emulator
// Owns: the headless xterm a command's output goes through once it holds a byte
// a terminal would act on: tamed against hostile counts, fed only what the
// screen needs, released as soon as its screen is read.
// ════════════════════════════════════════════════════════════════════════════

/** The largest counts sequences may carry: a line's width for characters, a screen's height for lines. */
const MAX_CHARACTER_COUNT = COMMAND_COLUMNS;
const MAX_LINE_COUNT = COMMAND_ROWS;
/** How long rendering what a command printed may take once it has ended; the rest is cut, and said so. */
const RENDER_FINISH_MAX_MS = 5000;

/**
 * A command's output is hostile input for the emulator: xterm allocates a
 * buffer of the count a REP sequence (`CSI 2147483647 b`) asks for, and loops
 * as many times as a scroll or line insertion asks. A count beyond a whole
 * screen does nothing on a real terminal that a screenful would not; here it
 * is dropped, so 20 bytes of `cat` cannot exhaust aic's memory or time.
 */
function tameEmulator(term: XTerm): XTerm {
  const cap = (finals: string[], max: number) => {
    for (const final of finals) term.parser.registerCsiHandler({ final }, (params) => (Number(params[0]) || 0) > max);
  };
  cap(["b", "@", "P", "X", "Z", "I"], MAX_CHARACTER_COUNT);
  cap(["S", "T", "L", "M"], MAX_LINE_COUNT);
  const handler = guardSequenceHandlers(term);
  // xterm 6.0's "erase above" (CSI 1 J) with the cursor in the last cell of a screen that has not scrolled yet reads
  // a line past the buffer and throws: 12 bytes of output ended aic. There it erases the whole screen, as ED 2 does.
  for (const prefix of [undefined, "?"])
    term.parser.registerCsiHandler({ prefix, final: "J" }, (params) => {
      const buffer = term.buffer.active;
      const lastCell = buffer.cursorX >= term.cols - 1 && buffer.cursorY + 1 >= buffer.length;
      if (Number(params[0]) !== 1 || !lastCell || !handler) return false;
      handler.eraseInDisplay({ params: [2] }, prefix === "?");
      return true;
    });
  // Reflowing wrapped lines without scrollback can read past the buffer and throw: then the screen starts afresh.
  const resize = term.resize.bind(term);
  term.resize = (cols: number, rows: number) => {
    try {
      resize(cols, rows);
    } catch {
      term.reset();
      resize(cols, rows);
    }
  };
  return term;
}

/** The emulator's handler of parsed sequences: xterm keeps it private, so it is reached by name and may be missing. */
interface SequenceHandler {
  eraseInDisplay(params: { params: number[] }, selective: boolean): boolean;
}

/**
 * Every method of xterm's sequence handler, made unable to throw: a sequence
 * that trips a bug in the emulator is dropped (what it had drawn so far
 * stays), never an exception that ends aic or wedges the emulator's queue.
 * The fuzz test (tests/emulator-fuzz.test.ts) feeds it what a hostile command prints.
 */
function guardSequenceHandlers(term: XTerm): SequenceHandler | undefined {
  const handler = (term as unknown as { _core?: { _inputHandler?: object } })._core?._inputHandler;
  if (!handler) return undefined;
  const own = handler as Record<string, unknown>;
  for (
    let proto = Object.getPrototypeOf(handler);
    proto && proto !== Object.prototype;
    proto = Object.getPrototypeOf(proto)
  )
    for (const name of Object.getOwnPropertyNames(proto)) {
      const method = Object.getOwnPropertyDescriptor(proto, name)?.value;
      if (name === "constructor" || typeof method !== "function" || Object.hasOwn(own, name)) continue;
      own[name] = function (this: unknown, ...args: unknown[]) {
        try {
          return (method as (...a: unknown[]) => unknown).apply(this, args);
        } catch {
          return true;
        }
      };
    }
  return typeof own.eraseInDisplay === "function" ? (handler as SequenceHandler) : undefined;
}

/**
 * What makes output more than plain text to a terminal: a control character other than CR LF (a lone CR, a
 * lone LF, which moves down without going back, a tab, ESC), DEL and the C1 controls xterm acts on.
 */
const PLAIN_TEXT_BREAKER = /[\x00-\x09\x0b-\x0c\x0e-\x1f\x7f-\x9f]|\r(?!\n)|(?<!\r)\n/;

/** How many bytes at the end of `bytes` may still be completed by the next chunk: a CR, or a UTF-8 character begun. */
function unfinishedTail(bytes: Uint8Array, crToo = true): number {
  const n = bytes.length;
  if (crToo && n && bytes[n - 1] === 0x0d) return 1;
  for (let back = 1; back <= Math.min(3, n); back++) {
    const b = bytes[n - back]!;
    if ((b & 0xc0) === 0x80) continue; // a continuation byte: look further back for the lead
    const need = b >= 0xf0 ? 4 : b >= 0xe0 ? 3 : b >= 0xc0 ? 2 : 1;
    return need > back ? back : 0;
  }
  return 0;
}

/**
 * Turns raw PTY bytes into finished lines for RenderedOutput. Plain text
 * (printable characters and CR LF line ends, which is what most commands
 * print) is cut into lines directly; the first byte of anything else
 * (colours, a lone CR, cursor movement) starts a headless xterm, given the
 * screen as it stands, and from then on every byte goes through it. A line
 * is finished once it scrolls above the screen (no cursor movement can
 * reach it any more); the rest is read when the command ends. Input goes to
 * xterm in 1 KB slices so the scrollback never overflows between two reads.
 */
class TerminalRenderer {
  /** A slice can hold at most this many line feeds, so a scrollback this deep never loses an unread line. */
  private static readonly SLICE = 1024;
  private term: XTerm | undefined;
  private marker: XTermMarker | undefined;
  private pending: string | undefined;
  private cols = COMMAND_COLUMNS;
  private rows = COMMAND_ROWS;
  /** Before xterm: the lines still on the screen (a cursor movement could yet reach them), oldest first. */
  private onScreen: string[] = [];
  /** Before xterm: the line the cursor is on. */
  private partial = "";
  /** Before xterm: the bytes of a chunk's end that may begin a CR LF or a UTF-8 character, kept raw. */
  private held: Uint8Array = new Uint8Array(0);

  constructor(
    private readonly TerminalClass: XTermClass,
    /** Where finished lines go; a command that waits starts a fresh one at each look. */
    public sink: RenderedOutput,
    /** Back-pressure on the command: it is paused while xterm is far behind, so nothing is lost and memory stays flat. */
    private readonly flow: { pause(): void; resume(): void },
  ) {}

  /** The emulator, made with the screen plain text has drawn so far (its lines then leave the sink's side). */
  private emulator(): XTerm {
    if (this.term) return this.term;
    this.term = tameEmulator(
      new this.TerminalClass({
        cols: this.cols,
        rows: this.rows,
        scrollback: TerminalRenderer.SLICE + this.rows,
        allowProposedApi: true,
        convertEol: false,
        logLevel: "off",
      }),
    );
    const drawn = [...this.onScreen, this.partial].join("\r\n");
    this.onScreen = [];
    this.partial = "";
    if (drawn) this.feed(utf8.encode(drawn));
    return this.term;
  }

  /** Plain text with its lines cut, or undefined when `bytes` hold anything a terminal would act on. */
  private plainText(bytes: Uint8Array): string | undefined {
    const all = this.held.length ? Buffer.concat([this.held, bytes]) : bytes;
    const keep = unfinishedTail(all);
    const text = utf8Decoder.decode(all.subarray(0, all.length - keep));
    if (PLAIN_TEXT_BREAKER.test(text)) return undefined;
    this.held = all.slice(all.length - keep);
    return text;
  }

  write(bytes: Uint8Array): void {
    const text = this.term ? undefined : this.plainText(bytes);
    if (text === undefined) return this.toEmulator(bytes);
    const lines = text.split("\r\n");
    this.partial += lines[0]!;
    if (lines.length === 1) return;
    this.onScreen.push(this.partial, ...lines.slice(1, -1));
    this.partial = lines.at(-1)!;
    const over = this.onScreen.length - this.rows;
    if (over > 0) for (const line of this.onScreen.splice(0, over)) this.sink.add(line);
  }

  /** Bytes held for a character's rest, given to xterm as they are (a look, or the end, cannot wait for more). */
  private flushHeld(): void {
    const held = this.held;
    this.held = new Uint8Array(0);
    if (held.length) this.enqueue(held);
  }

  /** The screen before xterm: the lines on it, wrapped at the terminal's width, the newest `rows`. */
  private plainScreen(): string {
    const rows: string[] = [];
    for (const line of [...this.onScreen, this.partial]) {
      const chars = [...line];
      if (!chars.length) rows.push("");
      for (let at = 0; at < chars.length; at += this.cols) rows.push(chars.slice(at, at + this.cols).join(""));
    }
    const lines = rows.slice(-this.rows).map((l) => l.replace(/\s+$/, ""));
    while (lines.length && !lines.at(-1)!.trim()) lines.pop();
    return lines.join("\n");
  }

  /** The command's terminal changed size (a person's pane): the screen the model is shown follows. */
  resize(cols: number, rows: number): void {
    this.cols = cols;
    this.rows = rows;
    this.term?.resize(cols, rows);
  }

  /** Bytes handed to xterm and not parsed yet. */
  private unparsed = 0;
  private parsed = 0;
  /** While xterm is behind: the newest unparsed bytes, bounded; older ones are counted and dropped. */
  private backlog: Uint8Array[] = [];
  private backlogBytes = 0;
  private dropped = 0;
  private static readonly MAX_PENDING = 256 * 1024;
  /** Only bytes already in flight when the command was paused land here; dropping is a last resort. */
  private static readonly BACKLOG_LIMIT = 8 * 1024 * 1024;
  private paused = false;

  /**
   * A PTY delivers faster than xterm parses; past MAX_PENDING the bytes wait
   * in a bounded backlog instead, so memory stays flat whatever a command prints.
   */
  private toEmulator(chunk: Uint8Array): void {
    if (!this.term) this.emulator();
    // A character begun at a chunk's end waits for the rest: xterm drops one whose bytes come in two writes.
    const all = this.held.length ? Buffer.concat([this.held, chunk]) : chunk;
    const keep = unfinishedTail(all, false);
    this.held = all.slice(all.length - keep);
    this.enqueue(all.subarray(0, all.length - keep));
  }

  /** Bytes for xterm: parsed now, or kept in the backlog while it is behind. */
  private enqueue(bytes: Uint8Array): void {
    if (this.unparsed <= TerminalRenderer.MAX_PENDING && !this.backlog.length) return this.feed(bytes);
    if (!this.paused) {
      this.paused = true;
      this.flow.pause();
    }
    this.backlog.push(bytes);
    this.backlogBytes += bytes.length;
    while (this.backlog.length > 1 && this.backlogBytes > TerminalRenderer.BACKLOG_LIMIT) {
      const old = this.backlog.shift()!;
      this.backlogBytes -= old.length;
      this.dropped += old.length;
    }
  }

  private feed(bytes: Uint8Array): void {
    for (let at = 0, end = 0; at < bytes.length; at = end) {
      // Never between the bytes of one character: xterm drops a character whose bytes come in two writes.
      end = Math.min(at + TerminalRenderer.SLICE, bytes.length);
      while (end < bytes.length && end > at + 1 && (bytes[end]! & 0xc0) === 0x80) end--;
      const slice = bytes.subarray(at, end);
      this.unparsed += slice.length;
      this.term!.write(slice, () => {
        this.unparsed -= slice.length;
        this.extract(false);
        // Parsing leaves short-lived garbage behind; a nudge every 256 KB keeps a flood of output from inflating the heap.
        if ((this.parsed += slice.length) >= GC_NUDGE_BYTES) {
          this.parsed = 0;
          Bun.gc(false);
        }
        if ((this.backlog.length || this.paused) && this.unparsed < TerminalRenderer.SLICE * 64) this.catchUp();
      });
    }
  }

  private catchUp(): void {
    if (this.paused) {
      this.paused = false;
      this.flow.resume();
    }
    const chunks = this.backlog;
    this.backlog = [];
    this.backlogBytes = 0;
    if (this.dropped) this.feed(utf8.encode(`\r\n${droppedOutputNote(this.dropped)}\r\n`));
    this.dropped = 0;
    for (const chunk of chunks) this.feed(chunk);
  }

  /**
   * The screen as a person sees it now: everything written is parsed first,
   * and the lines that scrolled away go to the sink. `full` when the program
   * is on the alternate screen (vim, less, top): then the screen is all there is.
   */
  async screen(): Promise<{ text: string; full: boolean }> {
    const term = this.term;
    if (!term) return { text: this.plainScreen(), full: false };
    this.flushHeld();
    if (this.backlog.length) this.catchUp();
    await new Promise<void>((resolve) => term.write("", resolve));
    this.extract(false);
    const buffer = term.buffer.active;
    const lines: string[] = [];
    for (let y = 0; y < term.rows; y++)
      // A full-screen program paints its blank cells with spaces: trailing blanks go, whatever made them.
      lines.push((buffer.getLine(buffer.baseY + y)?.translateToString(true) ?? "").replace(/\s+$/, ""));
    while (lines.length && !lines.at(-1)!.trim()) lines.pop();
    return { text: lines.join("\n"), full: buffer.type === "alternate" };
  }

  /**
   * Waits until everything written is parsed, then reads the screen too. A
   * command's output that costs the emulator more than RENDER_FINISH_MAX_MS
   * (thousands of scrolls or resets a second) is not waited for: what is
   * rendered by then is the result, with a note.
   */
  async finish(): Promise<void> {
    const term = this.term;
    if (!term) {
      const rest = utf8Decoder.decode(this.held).replace(/\r$/, "");
      for (const line of this.onScreen) this.sink.add(line);
      this.sink.add((this.partial + rest).trimEnd());
      this.onScreen = [];
      this.partial = "";
      return;
    }
    this.flushHeld();
    if (this.backlog.length) this.catchUp();
    // A timer cleared at once, not a sleep left pending: a pending sleep kept every finished emulator alive for its 5 s.
    let timer: ReturnType<typeof setTimeout> | undefined;
    const parsed = await Promise.race([
      new Promise<boolean>((resolve) => term.write("", () => resolve(true))),
      new Promise<boolean>((resolve) => (timer = setTimeout(() => resolve(false), RENDER_FINISH_MAX_MS))),
    ]);
    clearTimeout(timer);
    this.extract(true);
    if (!parsed) this.sink.add(renderingCutNote(RENDER_FINISH_MAX_MS));
    term.dispose();
  }

  private extract(all: boolean): void {
    const term = this.term;
    if (!term) return;
    const buffer = term.buffer.active;
    const from = this.marker && !this.marker.isDisposed ? this.marker.line : 0;
    const until = all ? buffer.length : buffer.baseY;
    for (let i = from; i < until; i++) {
      const line = buffer.getLine(i);
      if (!line) continue;
      const nextWraps = buffer.getLine(i + 1)?.isWrapped ?? false;
      const text = line.translateToString(!nextWraps);
      if (line.isWrapped && this.pending !== undefined) this.pending += text;
      else {
        if (this.pending !== undefined) this.sink.add(this.pending);
        this.pending = text;
      }
    }
    if (all) {
      if (this.pending !== undefined) this.sink.add(this.pending.trimEnd());
      this.pending = undefined;
      return;
    }
    if (until > from) {
      this.marker?.dispose();
      this.marker = term.registerMarker(-buffer.cursorY);
    }
  }
}

// @xterm/headless is loaded on a command's first output (a dynamic import); these names are types alone.
import type { IMarker as XTermMarker, Terminal as XTerm } from "@xterm/headless";
type XTermClass = typeof import("@xterm/headless").Terminal;

let xtermClass: Promise<XTermClass> | undefined;

function loadXterm(): Promise<XTermClass> {
  xtermClass ??= import("@xterm/headless").then(
    (m) =>
      (m as unknown as { Terminal?: XTermClass; default?: { Terminal: XTermClass } }).Terminal ?? m.default!.Terminal,
  );
  return xtermClass;
}

// ════════════════════════════════════════════════════════════════════════════
// Waiting-for-input detection
// Owns: telling what a quiet command is doing, from what /proc says each
// thread of its foreground is blocked in (the syscall, the descriptors it
// waits on and its timeout) and what its screen did: waiting for input at
// its terminal, waiting on nothing but time (top, watch, tail -f), or busy
// (sleeping, computing, on the network, waiting for a child).
// ════════════════════════════════════════════════════════════════════════════

/** What a quiet command is doing. */
type WaitVerdict = "waiting_for_input" | "waiting_on_time" | "busy";

/** How one blocking syscall waits, as the detector needs it. */
type SyscallKind =
  | "read"
  | "poll"
  | "ppoll"
  | "select"
  | "pselect6"
  | "epoll_wait"
  | "epoll_pwait2"
  | "wait"
  | "nanosleep"
  | "clock_nanosleep"
  | "idle";

/** Syscall numbers that block, per architecture (x86-64 and arm64). */
const BLOCKING_SYSCALLS: Record<string, Record<number, SyscallKind>> = {
  x64: {
    0: "read",
    17: "read",
    19: "read",
    7: "poll",
    271: "ppoll",
    23: "select",
    270: "pselect6",
    232: "epoll_wait",
    281: "epoll_wait",
    441: "epoll_pwait2",
    61: "wait",
    247: "wait",
    35: "nanosleep",
    230: "clock_nanosleep",
    219: "nanosleep",
    202: "idle",
    34: "idle",
    130: "idle",
    128: "idle",
  },
  arm64: {
    63: "read",
    67: "read",
    65: "read",
    73: "ppoll",
    72: "pselect6",
    22: "epoll_wait",
    441: "epoll_pwait2",
    260: "wait",
    95: "wait",
    101: "nanosleep",
    115: "clock_nanosleep",
    128: "nanosleep",
    98: "idle",
    133: "idle",
  },
};

/** A quiet output this long before anything is concluded (AIC_INPUT_WAIT_MS shortens it for tests). */
const INPUT_QUIET_MS = 1000;
const inputQuietMs = () =>
  Number(process.env.AIC_INPUT_WAIT_MS) > 0 ? Number(process.env.AIC_INPUT_WAIT_MS) : INPUT_QUIET_MS;
/** How often a quiet command is looked at. */
const INPUT_WAIT_POLL_MS = 250;
/** A program waiting on nothing but time is handed to the model after it has run this long. */
const WAITING_ON_TIME_AFTER_MS = 2000;
/** Between two lines the model types, aic waits for the program to read again, looking this often, this long at most. */
const TYPED_LINE_POLL_MS = 15;
const TYPED_LINE_WAIT_MS = 1000;
const TYPED_LINE_QUIET_MS = 150;
/** How often a hand-approved command is looked at: keys typed right after its prompt appears must reach it. */
const PERSON_INPUT_POLL_MS = 100;

/** Programs that run until interrupted and redraw on a timer: known at once, before their first redraw. */
const REDRAWS_ON_A_TIMER = new Set(["top", "htop", "btop", "atop", "iotop", "iftop", "nload", "watch", "glances"]);

/** How one thread of the foreground waits. */
type ThreadWait =
  "running" | "outside" | "stopped" | "child" | "idle" | "tty" | "tty_timed" | "sleep" | "events" | "internal";

/** Bytes of a process's memory (a poll set, a timespec): needs ptrace access, which aic has over its commands. */
function processMemory(pid: number, addr: bigint, length: number): Buffer | undefined {
  if (addr === 0n || length <= 0 || length > 1 << 16) return undefined;
  let fd: number | undefined;
  try {
    fd = fs.openSync(`/proc/${pid}/mem`, "r");
    const buf = Buffer.alloc(length);
    return fs.readSync(fd, buf, 0, length, Number(addr)) === length ? buf : undefined;
  } catch {
    return undefined;
  } finally {
    if (fd !== undefined) fs.closeSync(fd);
  }
}

/** A timeout argument in milliseconds: null when the call waits forever, undefined when unreadable. */
function timeoutArgument(pid: number, addr: bigint, divisor: number): number | null | undefined {
  if (addr === 0n) return null;
  const b = processMemory(pid, addr, 16);
  return b && Number(b.readBigInt64LE(0)) * 1000 + Number(b.readBigInt64LE(8)) / divisor;
}

const fdLink = (pid: number, fd: number) => {
  try {
    return fs.readlinkSync(`/proc/${pid}/fd/${fd}`);
  } catch {
    return "?";
  }
};

/** The descriptors of a poll array. */
function pollSet(pid: number, addr: bigint, nfds: bigint): string[] | undefined {
  const n = Number(nfds);
  const b = n > 0 ? processMemory(pid, addr, n * 8) : Buffer.alloc(0);
  if (!b) return undefined;
  const out: string[] = [];
  for (let i = 0; i < n; i++) if (b.readInt32LE(i * 8) >= 0) out.push(fdLink(pid, b.readInt32LE(i * 8)));
  return out;
}

/** The descriptors of select's three sets. */
function selectSet(pid: number, nfds: bigint, sets: bigint[]): string[] | undefined {
  const n = Number(nfds);
  const fds = new Set<number>();
  for (const addr of sets) {
    if (addr === 0n) continue;
    const b = processMemory(pid, addr, Math.ceil(n / 64) * 8);
    if (!b) return undefined;
    for (let fd = 0; fd < n; fd++) if (b[fd >> 3]! & (1 << (fd & 7))) fds.add(fd);
  }
  return [...fds].map((fd) => fdLink(pid, fd));
}

/** The descriptors an epoll instance watches (its fdinfo's "tfd:" lines). */
function epollSet(pid: number, epfd: number): string[] | undefined {
  try {
    const info = fs.readFileSync(`/proc/${pid}/fdinfo/${epfd}`, "utf8");
    return [...info.matchAll(/^tfd:\s*(\d+)/gm)].map((m) => fdLink(pid, Number(m[1])));
  } catch {
    return undefined;
  }
}

/** What one blocking syscall waits on (its descriptors, undefined when unreadable) and for how long (null: forever). */
function syscallWait(
  pid: number,
  kind: SyscallKind,
  a: bigint[],
): { fds?: string[]; timeoutMs: number | null | undefined } {
  const int32 = (v: bigint | undefined) => Number(BigInt.asIntN(32, v ?? 0n));
  switch (kind) {
    case "read":
      return { fds: [fdLink(pid, int32(a[0]))], timeoutMs: null };
    case "poll":
      return { fds: pollSet(pid, a[0]!, a[1]!), timeoutMs: int32(a[2]) < 0 ? null : int32(a[2]) };
    case "ppoll":
      return { fds: pollSet(pid, a[0]!, a[1]!), timeoutMs: timeoutArgument(pid, a[2]!, 1e6) };
    case "select":
      return { fds: selectSet(pid, a[0]!, [a[1]!, a[2]!, a[3]!]), timeoutMs: timeoutArgument(pid, a[4]!, 1e3) };
    case "pselect6":
      return { fds: selectSet(pid, a[0]!, [a[1]!, a[2]!, a[3]!]), timeoutMs: timeoutArgument(pid, a[4]!, 1e6) };
    case "epoll_wait":
      return { fds: epollSet(pid, int32(a[0])), timeoutMs: int32(a[3]) < 0 ? null : int32(a[3]) };
    case "epoll_pwait2":
      return { fds: epollSet(pid, int32(a[0])), timeoutMs: timeoutArgument(pid, a[3]!, 1e6) };
    default:
      return { timeoutMs: undefined };
  }
}

const isTerminalTarget = (t: string) => /^\/dev\/(pts\/\d+|tty\w*|ptmx)$/.test(t);

/** A descriptor's kind: the terminal, something only this command holds, file events, or the outside world. */
function descriptorKind(target: string, internalPipes: Set<string>): "terminal" | "internal" | "events" | "outside" {
  if (isTerminalTarget(target)) return "terminal";
  if (/^anon_inode:\[?(eventfd|signalfd|timerfd|eventpoll|pidfd)\]?/.test(target)) return "internal";
  if (/^anon_inode:\[?(inotify|fanotify)\]?/.test(target)) return "events";
  if (target.startsWith("pipe:")) return internalPipes.has(target) ? "internal" : "outside";
  return "outside";
}

/** How thread `tid` of `pid` waits. */
function threadWait(pid: number, tid: number, internalPipes: Set<string>): ThreadWait {
  const base = `/proc/${pid}/task/${tid}`;
  let stat: string;
  let raw: string;
  try {
    stat = fs.readFileSync(`${base}/stat`, "utf8");
    raw = fs.readFileSync(`${base}/syscall`, "utf8").trim();
  } catch {
    return "outside"; // unreadable (a setuid program): nothing aic could answer
  }
  const state = stat.slice(stat.lastIndexOf(")") + 2).split(" ")[0] ?? "?";
  if (state === "T" || state === "t") return "stopped";
  if (raw === "running" || state === "R" || state === "D") return "running";
  const f = raw.split(" ");
  if (!raw || f[0] === "-1") return "running";
  const kind = BLOCKING_SYSCALLS[process.arch]?.[Number(f[0])];
  if (!kind) return "outside";
  if (kind === "wait") return "child";
  if (kind === "idle") return "idle";
  if (kind === "nanosleep" || kind === "clock_nanosleep") return "sleep";
  const { fds: set, timeoutMs } = syscallWait(
    pid,
    kind,
    f.slice(1, 7).map((x) => BigInt(x)),
  );
  // A set aic may not read: stdin a terminal and no socket open means it can only be waiting there.
  const fds = set ?? (fallbackTerminalOnly(pid) ? [fdLink(pid, 0)] : ["?"]);
  const kinds = new Set(fds.map((t) => descriptorKind(t, internalPipes)));
  if (kinds.has("outside")) return "outside";
  if (kinds.has("terminal")) return timeoutMs === null ? "tty" : "tty_timed";
  if (kinds.has("events")) return "events";
  if (kind === "read") return "internal";
  return timeoutMs === null ? "idle" : "sleep";
}

function fallbackTerminalOnly(pid: number): boolean {
  try {
    if (!isTerminalTarget(fdLink(pid, 0))) return false;
    return !fs.readdirSync(`/proc/${pid}/fd`).some((fd) => fdLink(pid, Number(fd)).startsWith("socket:"));
  } catch {
    return false;
  }
}

/**
 * How many descriptors one look at a command examines at most: each costs
 * two reads of /proc on aic's one thread, and a command with tens of
 * thousands must not freeze aic (its timeout, the TUI). Beyond it, the
 * command counts as busy.
 */
const MAX_DESCRIPTORS_LOOKED_AT = 4096;

/** Pipes with a reading and a writing end both inside `pids`: waiting on one waits on the command itself. */
function internalPipesOf(pids: readonly number[]): Set<string> | undefined {
  const ends = new Map<string, number>();
  let examined = 0;
  for (const pid of pids) {
    let fds: string[] = [];
    try {
      fds = fs.readdirSync(`/proc/${pid}/fd`);
    } catch {
      continue;
    }
    examined += fds.length;
    if (examined > MAX_DESCRIPTORS_LOOKED_AT) return undefined;
    for (const fd of fds) {
      const target = fdLink(pid, Number(fd));
      if (!target.startsWith("pipe:")) continue;
      let mode = 2;
      try {
        const flags = /^flags:\s*([0-7]+)/m.exec(fs.readFileSync(`/proc/${pid}/fdinfo/${fd}`, "utf8"));
        if (flags) mode = Number.parseInt(flags[1]!, 8) & 3;
      } catch {
        /* gone */
      }
      ends.set(target, (ends.get(target) ?? 0) | (mode === 0 ? 1 : mode === 1 ? 2 : 3));
    }
  }
  return new Set([...ends].filter(([, m]) => m === 3).map(([k]) => k));
}

/** What the screen did, as the command's output showed it. */
interface ScreenFacts {
  /** Milliseconds since the last output (or since the start). */
  quietMs: number;
  /** On the alternate screen (a full-screen program). */
  altScreen: boolean;
  /** Output that resumed after a quiet second with nothing typed: the program redraws by itself. */
  selfRedraws: number;
}

/**
 * The verdict for a quiet command whose foreground is `pgids`. Any thread
 * running, stopped, or blocked on the outside world (a socket, a disk, a pipe
 * to elsewhere) → busy. Else a thread waiting on the terminal → waiting for
 * input, unless that wait has a timeout and the program redraws on a timer
 * (a known one, or one seen redrawing a full screen by itself) → waiting on
 * time. Else file events forever (tail -f) → waiting on time; a sleep on the
 * alternate screen or by a known redrawer (watch) → waiting on time; any
 * other sleep → busy (sleep 30, a retry loop).
 */
function classifyForeground(pgids: readonly number[], screen: ScreenFacts): { verdict: WaitVerdict; reason: string } {
  const procs = allProcesses().filter((p) => pgids.includes(p.pgid) && !p.zombie);
  if (procs.length === 0) return { verdict: "busy", reason: "no process" };
  if (screen.quietMs < inputQuietMs()) return { verdict: "busy", reason: "output moments ago" };
  if (procs.length > MAX_PROCESSES_LOOKED_AT) return { verdict: "busy", reason: "too many processes to look at" };
  const internalPipes = internalPipesOf(procs.map((p) => p.pid));
  if (!internalPipes) return { verdict: "busy", reason: "too many open files to look at" };
  const seen = new Set<ThreadWait>();
  let timerProgram = "";
  for (const p of procs) {
    const comm = commOf(p.pid);
    let tids: string[] = [];
    try {
      tids = fs.readdirSync(`/proc/${p.pid}/task`);
    } catch {
      continue;
    }
    for (const tid of tids) {
      const w = threadWait(p.pid, Number(tid), internalPipes);
      if (w === "running" || w === "outside" || w === "stopped") return { verdict: "busy", reason: `${comm} is ${w}` };
      seen.add(w);
      if ((w === "tty_timed" || w === "sleep") && REDRAWS_ON_A_TIMER.has(comm)) timerProgram = comm;
    }
  }
  const redrawsItself = screen.selfRedraws > 0 && screen.altScreen;
  if (seen.has("tty") || seen.has("tty_timed")) {
    if (!seen.has("tty") && (timerProgram || redrawsItself))
      return { verdict: "waiting_on_time", reason: `${timerProgram || "it"} redraws its screen on a timer` };
    return { verdict: "waiting_for_input", reason: "it is reading its terminal" };
  }
  if (seen.has("events")) return { verdict: "waiting_on_time", reason: "it waits for changes to files (like tail -f)" };
  if (seen.has("sleep") && (timerProgram || screen.altScreen || redrawsItself))
    return { verdict: "waiting_on_time", reason: `${timerProgram || "it"} redraws its screen on a timer` };
  return { verdict: "busy", reason: "sleeping or waiting for a child" };
}

/** Whether `pid` is blocked waiting for a child (git for the editor it started, a shell for its command). */
function waitsForChild(pid: number): boolean {
  const table = BLOCKING_SYSCALLS[process.arch] ?? {};
  try {
    return table[Number(fs.readFileSync(`/proc/${pid}/syscall`, "utf8").split(" ")[0])] === "wait";
  } catch {
    return false;
  }
}

/** How many processes of a command's foreground one look examines at most (see MAX_DESCRIPTORS_LOOKED_AT). */
const MAX_PROCESSES_LOOKED_AT = 256;

/** A process's name (/proc/<pid>/comm). */
function commOf(pid: number): string {
  try {
    return fs.readFileSync(`/proc/${pid}/comm`, "utf8").trim();
  } catch {
    return "?";
  }
}

/** The private modes that switch a terminal to its alternate screen and back: xterm's 1049, the older 1047 and 47. */
const ALTERNATE_SCREEN_MODES = "1049|1047|47";
const ALTERNATE_SCREEN_SWITCH = new RegExp(`\\x1b\\[\\?(?:${ALTERNATE_SCREEN_MODES})([hl])`, "g");

/** The screen facts, from the command's output and what was typed into it. */
class ScreenWatch {
  private lastOutput = performance.now();
  private lastInput = -Infinity;
  private sawOutput = false;
  private alt = false;
  private redraws = 0;
  private tail = "";
  private readonly decoder = new TextDecoder();

  output(bytes: Uint8Array): void {
    const now = performance.now();
    if (this.sawOutput && now - this.lastOutput >= INPUT_QUIET_MS && now - this.lastInput >= INPUT_QUIET_MS)
      this.redraws++;
    this.sawOutput = true;
    this.lastOutput = now;
    const s = this.tail + this.decoder.decode(bytes, { stream: true });
    for (const m of s.matchAll(ALTERNATE_SCREEN_SWITCH)) this.alt = m[1] === "h";
    this.tail = s.slice(-12);
  }

  input(): void {
    this.lastInput = performance.now();
    this.lastOutput = this.lastInput;
  }

  facts(): ScreenFacts {
    return { quietMs: performance.now() - this.lastOutput, altScreen: this.alt, selfRedraws: this.redraws };
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Command runner
// Owns: running one command to its end: PTY, timeout, stop, runaway and
// waiting-for-input rules, and the result the agent turns into a tool message.
// ════════════════════════════════════════════════════════════════════════════

/** How many of the lines given were typed (fewer when the command ended, or another program came to read them). */
interface TypedLines {
  typed: number;
  of: number;
}

/** What a front end gets of a running command for a person at the keyboard: their keys, and their pane's size. */
interface CommandKeyboard {
  write(data: string | Uint8Array): void;
  /** Several lines typed ahead: one at a time, each once the program reads again. */
  type(bytes: string): Promise<TypedLines>;
  resize(cols: number, rows: number): void;
  /** The person hands the waiting program to the model (the footer's key), as under auto-approve. */
  handToModel(): void;
}

/** How long a program the person approved may wait, with nothing typed, before it goes to the model (AIC_HANDOVER_IDLE_S). */
function handoverIdleMs(): number {
  const s = Number(process.env.AIC_HANDOVER_IDLE_S);
  return (Number.isFinite(s) && s > 0 ? s : 10) * 1000;
}

interface RunOptions {
  command: string;
  cwd: string;
  limits: CommandLimits;
  /** The model may type into the command: when it waits, it is handed over (with its screen) and keeps running. */
  modelAnswers?: boolean;
  /** False when nobody can type an answer: then a command stuck on input is stopped. */
  canAnswerInput: boolean;
  signal: AbortSignal;
  sandbox: Sandbox;
  /** Where the whole output of a long command is saved. */
  outputs: OutputStore;
  onData(bytes: Uint8Array): void;
  /** A person can answer (`canAnswerInput`) and the command has been waiting for input a while: told once. */
  onWaitingForInput?(): void;
  /** Lets the caller forward a person's keystrokes to the command; returns a detach function. */
  attachInput?(io: CommandKeyboard): () => void;
  /** Takes over what the command leaves running as background jobs (without one, leftovers die with the terminal). */
  jobs?: JobTable;
}

/** What runCommand adds to a result when the command left processes running. */
interface JobsLeft {
  started: Job[];
  refused: Job[];
}

/** The shell commands run in: bash where there is one (the tool is execute_bash, and models write bash), else /bin/sh. */
function commandShell(): string {
  return fs.existsSync("/bin/bash") ? "/bin/bash" : "/bin/sh";
}

/**
 * What aic puts before every command, on the command's own first line (so a
 * shell's "line N" in an error is the line of the command as the model wrote
 * it): job control, so each `&` job gets a process group of its own that
 * outlives the shell and that the timeout, stops and the input watch (which
 * act on the foreground) never reach; and curl and wget sending a browser's
 * User-Agent.
 */
function commandPreamble(): string {
  const ua = BROWSER_USER_AGENT.replace(/'/g, "");
  return [
    "set -m 2>/dev/null",
    `export HTTP_USER_AGENT='${ua}'`,
    `curl() { command curl -A "$HTTP_USER_AGENT" "$@"; }`,
    `wget() { command wget -U "$HTTP_USER_AGENT" "$@"; }`,
    "",
  ].join("; ");
}

/** What starting one command takes: its argv, environment and terminal size. Pure, so it is tested alone. */
interface CommandRequest {
  argv: string[];
  env: Record<string, string | undefined>;
  cols: number;
  rows: number;
}

function commandRequest(
  command: string,
  o: { marker: string; ciEnv: boolean; shell: string; environment: Record<string, string | undefined> },
): CommandRequest {
  const env = { ...o.environment, ...COMMAND_ENV, ...(o.ciEnv ? CI_ENV : {}) };
  if (o.marker) env[JOB_MARKER_ENV] = o.marker;
  return { argv: [o.shell, "-c", commandPreamble() + command], env, cols: COMMAND_COLUMNS, rows: COMMAND_ROWS };
}

/** Runs one command to its result (see CommandRun). */
async function runCommand(opts: RunOptions): Promise<CommandResult & { jobs?: JobsLeft }> {
  return (await CommandRun.start(opts)).result();
}

/** What one look at a running command found: it ended, or it waits and keeps running. */
type Observation =
  | { kind: "ended"; result: CommandResult & { jobs?: JobsLeft } }
  | {
      kind: "waiting";
      verdict: Exclude<WaitVerdict, "busy">;
      reason: string;
      /** Lines that scrolled off the screen since the last look (capped like any output). */
      output: string;
      savedTo?: string;
      /** The screen now: all of it on the alternate screen, the visible lines otherwise. */
      screen: string;
      fullScreen: boolean;
      /** The program in the foreground (what input would be typed into). */
      program: string;
    };

/**
 * One command on its terminal, from spawn to its end. It owns the terminal's
 * output (rendered for the model, counted against the runaway limit, the
 * foreground paused when rendering falls behind), what stops it (the
 * timeout, the run's stop, a prompt nobody can answer), where its bytes go
 * (held until the process is known, rendered while it runs, handed to a
 * background job's log when the shell exits leaving jobs), and the model at
 * its keyboard: a command that waits for input (or on nothing but time) is
 * handed over with its screen, keeps running, and takes what is typed into it;
 * the timeout counts only while it is not waiting.
 */
class CommandRun {
  private rendered: RenderedOutput;
  /** Made on the first byte: most commands print nothing and need no emulator. */
  private renderer: TerminalRenderer | undefined;
  private rawBytes = 0;
  private readonly screenWatch = new ScreenWatch();
  private status: CommandStatus = "exited";
  private stopping: Promise<void> | undefined;
  /** Output that arrives before the process is known (the launcher may report both in one read). */
  private early: Uint8Array[] | undefined = [];
  private route: (bytes: Uint8Array) => void = (bytes) => this.early?.push(bytes);
  /** The foreground groups stopped for back-pressure, to resume. */
  private paused: number[] = [];
  private child!: CommandProcess;
  private readonly marker: string;
  private readonly startedAt = performance.now();
  /** Whether the command waits for the model's input (handed over, not timed). */
  private handedOver = false;
  /** The look in progress. */
  private observer: ((o: Observation) => void) | undefined;
  private ended!: Promise<CommandResult & { jobs?: JobsLeft }>;
  private unwatch: (() => void) | undefined;
  private timeoutLeft: number;
  private timeoutArmedAt = 0;
  private timeoutTimer: ReturnType<typeof setTimeout> | undefined;

  private constructor(
    private readonly opts: RunOptions,
    private readonly Terminal: XTermClass,
  ) {
    this.rendered = new RenderedOutput(opts.limits.maxOutputBytes, opts.outputs);
    this.marker = opts.jobs?.nextMarker() ?? "";
    this.timeoutLeft = opts.limits.timeoutSec * 1000;
  }

  static async start(opts: RunOptions): Promise<CommandRun> {
    const run = new CommandRun(opts, await loadXterm());
    const request = commandRequest(opts.command, {
      marker: run.marker,
      ciEnv: opts.limits.ciEnv,
      shell: commandShell(),
      environment: commandEnvironment({ sshAgent: opts.limits.sshAgent }),
    });
    run.child = await opts.sandbox.spawn(request.argv, {
      cwd: opts.cwd,
      env: request.env,
      cols: request.cols,
      rows: request.rows,
      onData: (bytes) => run.route(bytes),
    });
    run.route = (bytes) => run.receive(bytes);
    for (const bytes of run.early!.splice(0)) run.receive(bytes);
    run.early = undefined;
    run.unwatch = run.watch();
    run.ended = run.whenExited();
    return run;
  }

  private get shell(): number {
    return this.child.pid;
  }

  /** The program in the foreground now, by its executable (see inputReader). */
  get program(): string {
    return this.reader().program;
  }

  /** The command's terminal at another size, and the emulator that renders it for the model with it. */
  resize(cols: number, rows: number): void {
    if (this.finished) return;
    this.child.resize(cols, rows);
    this.renderer?.resize(cols, rows);
  }

  /** Who would take keys typed now (see inputReader). */
  reader(): InputReader {
    return inputReader(this.shell);
  }

  /** Whether the command has ended (a `read -t` that timed out ends while the model thinks). */
  get finished(): boolean {
    return this.exited;
  }
  private exited = false;

  private receive(bytes: Uint8Array): void {
    if (this.stopping && this.status === "runaway") return;
    this.screenWatch.output(bytes);
    this.rawBytes += bytes.length;
    (this.renderer ??= new TerminalRenderer(this.Terminal, this.rendered, this.flow)).write(bytes);
    this.opts.onData(bytes);
    if (this.rawBytes > this.opts.limits.runawayBytes) this.stop("runaway");
  }

  /** Stops the command (its foreground groups: SIGTERM, then SIGKILL). */
  stop(why: CommandStatus): void {
    if (this.stopping) return;
    this.status = why;
    this.stopping = killGroups(foregroundGroups(this.shell));
  }

  /**
   * Back-pressure pauses what runs in the foreground; a background job writing
   * to the same terminal is not held. A shell with job control that saw its
   * foreground job stop would give up on it and go on (exit 128+19), so the
   * shell is stopped first and resumed last: it never sees the job stopped.
   */
  private readonly flow = {
    pause: () => {
      this.paused = foregroundGroups(this.shell).filter((g) => g !== this.shell);
      signalGroup(this.shell, "SIGSTOP");
      if (this.paused.length && untilStopped(this.shell)) for (const g of this.paused) signalGroup(g, "SIGSTOP");
    },
    resume: () => {
      for (const g of this.paused) signalGroup(g, "SIGCONT");
      signalGroup(this.shell, "SIGCONT");
      this.paused = [];
    },
  };

  /** The timeout counts only while the command is not waiting on the model. */
  private armTimeout(): void {
    this.timeoutArmedAt = performance.now();
    this.timeoutTimer = setTimeout(() => this.stop("timed_out"), Math.max(0, this.timeoutLeft));
  }

  private pauseTimeout(): void {
    clearTimeout(this.timeoutTimer);
    this.timeoutLeft -= performance.now() - this.timeoutArmedAt;
  }

  /** The timeout, the run's stop, and the look at a quiet command; returns what undoes them. */
  private watch(): () => void {
    const { opts } = this;
    this.armTimeout();
    const onAbort = () => this.stop(opts.signal.reason === USER_INTERRUPT ? "interrupted" : "stopped");
    opts.signal.addEventListener("abort", onAbort, { once: true });
    if (opts.signal.aborted) onAbort();
    let told = false;
    // A person who approved the command by hand gets the keyboard as soon as it reads the terminal: no quiet period.
    let personAnswers = opts.canAnswerInput && !opts.modelAnswers;
    // Left alone (nothing typed for a while), or handed over with the footer's key, it goes to the model after all;
    // from then on it is the model's, as under auto-approve.
    let personSince = 0;
    let handNow = false;
    let modelAnswers = opts.modelAnswers;
    const modelTakes = () => {
      handNow = told = personAnswers = false;
      modelAnswers = true;
    };
    const watcher = setInterval(
      () => {
        if (this.stopping || this.handedOver) return;
        if (told) return this.maybeHandToModel(personSince, handNow, modelTakes);
        const facts = this.screenWatch.facts();
        if (!personAnswers && facts.quietMs < inputQuietMs()) return;
        const d = classifyForeground(
          foregroundGroups(this.shell),
          personAnswers ? { ...facts, quietMs: Infinity } : facts,
        );
        if (d.verdict === "busy") return;
        if (personAnswers) {
          told = true;
          personSince = performance.now();
          return opts.onWaitingForInput?.();
        }
        if (d.verdict === "waiting_on_time" && performance.now() - this.startedAt < WAITING_ON_TIME_AFTER_MS) return;
        // The model at the keyboard gets the screen and the command keeps running.
        if (modelAnswers) return void this.handOver(d.verdict, d.reason);
        if (d.verdict === "waiting_on_time") return;
        // With nobody to answer, it is stopped.
        this.stop("waiting_for_input");
      },
      personAnswers ? PERSON_INPUT_POLL_MS : INPUT_WAIT_POLL_MS,
    );
    const detachInput = opts.attachInput?.({
      write: (data) => {
        personSince = performance.now();
        this.child.write(data);
      },
      type: (bytes) => ((personSince = performance.now()), this.typeLines(bytes)),
      resize: (cols, rows) => this.resize(cols, rows),
      handToModel: () => void (handNow = true),
    });
    return () => {
      clearTimeout(this.timeoutTimer);
      clearInterval(watcher);
      opts.signal.removeEventListener("abort", onAbort);
      detachInput?.();
    };
  }

  /**
   * A program the person has the keyboard of goes to the model when they
   * say so, or when it still waits after AIC_HANDOVER_IDLE_S with nothing
   * typed: its screen is the tool result, as for a command nobody approved.
   */
  private maybeHandToModel(personSince: number, asked: boolean, modelTakes: () => void): void {
    if (!asked && performance.now() - personSince < handoverIdleMs()) return;
    const d = classifyForeground(foregroundGroups(this.shell), { ...this.screenWatch.facts(), quietMs: Infinity });
    if (d.verdict === "busy") return;
    modelTakes();
    const why = asked ? "the person handed it to you" : `nothing was typed for ${handoverIdleMs() / 1000} s`;
    void this.handOver(d.verdict, `${d.reason}; ${why}`);
  }

  /** The command waits: the look in progress ends with its screen, and the output so far starts anew. */
  private async handOver(verdict: Exclude<WaitVerdict, "busy">, reason: string): Promise<void> {
    this.handedOver = true;
    this.pauseTimeout();
    const screen = (await this.renderer?.screen()) ?? { text: "", full: false };
    const { text, savedTo } = this.rendered.finish();
    this.rendered = new RenderedOutput(this.opts.limits.maxOutputBytes, this.opts.outputs);
    if (this.renderer) this.renderer.sink = this.rendered;
    const program = this.program;
    this.observer?.({
      kind: "waiting",
      verdict,
      reason,
      output: text,
      savedTo,
      screen: screen.text,
      fullScreen: screen.full,
      program,
    });
  }

  /**
   * Types `bytes` into the waiting command; the next look follows what it does
   * with them. Line by line, as a person types: a program that flushes its
   * input when it prompts (npm init) would lose lines sent in one write.
   */
  async type(bytes: string, stillSameReader?: () => boolean): Promise<TypedLines> {
    this.handedOver = false;
    this.screenWatch.input();
    this.armTimeout();
    return this.typeLines(bytes, stillSameReader);
  }

  /** `bytes` a line at a time, each once the program reads again (see type). */
  async typeLines(bytes: string, stillSameReader: () => boolean = () => true): Promise<TypedLines> {
    const lines = bytes.split(/(?<=\r)/);
    for (const [i, line] of lines.entries()) {
      if (this.finished || this.stopping) return { typed: i, of: lines.length };
      // Keys were judged for the program that read them: a line for a shell vim started is another judgement.
      if (i > 0 && !stillSameReader()) return { typed: i, of: lines.length };
      const outputBefore = this.rawBytes;
      this.child.write(line);
      this.screenWatch.input();
      if (i < lines.length - 1) await this.untilReadingAgain(outputBefore);
    }
    return { typed: lines.length, of: lines.length };
  }

  /** After a typed line: until the program has answered and reads the terminal again (at most a second). */
  private async untilReadingAgain(outputBefore: number): Promise<void> {
    const deadline = performance.now() + TYPED_LINE_WAIT_MS;
    while (performance.now() < deadline && !this.finished && !this.stopping) {
      await Bun.sleep(TYPED_LINE_POLL_MS);
      if (this.rawBytes <= outputBefore) continue;
      // It answered: once it reads again, or has been quiet a moment (a reader aic cannot see in /proc).
      if (this.screenWatch.facts().quietMs >= TYPED_LINE_QUIET_MS || this.reader().reading) return;
    }
  }

  /** Until the command ends, or (for the model at the keyboard) waits again. */
  observe(): Promise<Observation> {
    return new Promise((resolve) => {
      this.observer = resolve;
      void this.ended.then((result) => resolve({ kind: "ended", result }));
    });
  }

  /** Until the command ends (a caller that cannot answer input). */
  async result(): Promise<CommandResult & { jobs?: JobsLeft }> {
    return this.ended;
  }

  /** Waits for the shell to end; what it left running becomes jobs, which take the terminal over. */
  private async whenExited(): Promise<CommandResult & { jobs?: JobsLeft }> {
    let jobs: JobsLeft | undefined;
    let exitCode: number | null = null;
    try {
      exitCode = await this.child.exited;
      this.exited = true;
      if (this.stopping) await this.stopping;
      jobs = this.opts.jobs?.adopt({
        command: this.opts.command,
        session: this.shell,
        marker: this.marker,
        terminal: this.child,
        eof: this.child.eof,
        redirect: (sink) => (this.route = sink),
      });
    } finally {
      this.unwatch?.();
      if (!jobs) this.child.close();
    }
    await this.renderer?.finish();
    const { text, savedTo } = this.rendered.finish();
    return { exitCode, status: this.status, output: text, savedTo, jobs };
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Background jobs: finding them
// Owns: what a command leaves running when its shell exits (a dev server, a
// build started with `&`, a double-forked daemon): found, kept alive, its
// terminal drained to a log, reported on every later tool result, and
// stopped on every way out of aic but kill -9.
//
// How they are found: each command's shell runs with job control (`set -m`),
// so a `&` job gets a process group of its own and survives the shell's exit;
// every process a command starts carries JOB_MARKER_ENV and sits in the
// command's session (until it calls setsid); and aic is a child subreaper,
// so an orphan, daemons included, becomes aic's child instead of init's.
// ════════════════════════════════════════════════════════════════════════════

const PR_SET_CHILD_SUBREAPER = 36;
const WNOHANG = 1;

/** Makes aic the reaper of its orphaned descendants, so a daemon a command starts stays findable. */
function becomeSubreaper(): void {
  libc()?.symbols.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
}

/** The pids of aic's own children, across all its threads (an adopted orphan may be listed under any). */
function ownChildren(): number[] {
  const pids = new Set<number>();
  try {
    for (const task of fs.readdirSync("/proc/self/task"))
      for (const pid of fs.readFileSync(`/proc/self/task/${task}/children`, "utf8").split(" "))
        if (pid.trim()) pids.add(Number(pid));
  } catch {
    /* no /proc: no jobs either */
  }
  return [...pids];
}

/** Exit codes of adopted children aic reaped, by pid: a job's leader is looked up here when its group ends. */
const reapedExitCodes = new Map<number, number>();

/**
 * Waits for every adopted child that has ended (never one of Bun's own,
 * which Bun reaps), so no zombie piles up, and keeps its exit code as a
 * shell does: the code, or 128 + the signal.
 */
function reapAdoptedZombies(): [pid: number, code: number][] {
  const c = libc()?.symbols;
  if (!c) return [];
  const { ptr } = require("bun:ffi") as typeof import("bun:ffi");
  const status = new Int32Array(1);
  const reaped: [number, number][] = [];
  for (const pid of ownChildren()) {
    if (bunChildren.has(pid) || !processInfo(pid)?.zombie) continue;
    if (c.waitpid(pid, ptr(status), WNOHANG) !== pid) continue;
    reaped.push([pid, waitStatusCode(status[0]!)]);
    rememberExitCode(pid, reaped.at(-1)![1]);
  }
  return reaped;
}

function rememberExitCode(pid: number, code: number): void {
  reapedExitCodes.set(pid, code);
  if (reapedExitCodes.size > 1000) reapedExitCodes.delete(reapedExitCodes.keys().next().value!);
}

/** The value of JOB_MARKER_ENV in a process's environment, if it can be read. */
function jobMarkerOf(pid: number): string | undefined {
  let environ: Buffer;
  try {
    environ = fs.readFileSync(`/proc/${pid}/environ`);
  } catch {
    return undefined;
  }
  const prefix = `${JOB_MARKER_ENV}=`;
  for (const entry of environ.toString("utf8").split("\0"))
    if (entry.startsWith(prefix)) return entry.slice(prefix.length);
  return undefined;
}

/** `text` on one line (runs of whitespace made one space), cut to `max` characters. */
function oneLine(text: string, max: number): string {
  const flat = text.replace(/\s+/g, " ").trim();
  return flat.length > max ? `${flat.slice(0, max - 1)}…` : flat;
}

/** A process's command line as one line, for a job's description. */
function commandLineOf(pid: number): string {
  try {
    const argv = fs.readFileSync(`/proc/${pid}/cmdline`, "utf8").split("\0").filter(Boolean);
    return visibleControls(oneLine(argv.join(" "), 120)) || `pid ${pid}`;
  } catch {
    return `pid ${pid}`;
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Background jobs: a job and its terminal
// Owns: what a job is and what the session keeps of it, and a job's terminal,
// drained to its log while the job runs.
// ════════════════════════════════════════════════════════════════════════════

/**
 * The terminal of a command whose jobs outlived it: aic keeps reading it (a
 * job that writes there and finds nobody reading would block), into a log
 * in the private outputs directory. The log is bounded: past `limit` bytes
 * it starts again with a line saying so, keeping the latest output.
 */
class JobTerminal {
  readonly path: string;
  private readonly fd: number;
  private written = 0;
  private closed = false;

  constructor(
    private readonly terminal: { close(): void },
    outputs: OutputStore,
    private readonly limit: number,
  ) {
    try {
      const file = outputs.createFile("job");
      this.fd = file.fd;
      this.path = file.path;
    } catch (error) {
      // The job still runs and its terminal is still drained; only the log is missing, and the model is told why.
      this.fd = -1;
      this.path = `(no log: ${(error as Error).message})`;
    }
  }

  write(bytes: Uint8Array): void {
    if (this.closed || this.fd < 0) return;
    try {
      if (this.written + bytes.length > this.limit) {
        fs.ftruncateSync(this.fd, 0);
        this.written = 0;
        this.append(
          utf8.encode(`[aic: this log passed ${this.limit} bytes at ${localIsoSeconds()} and started again]\n`),
        );
      }
      this.append(bytes);
    } catch {
      /* the log is best effort; the job must not block on it */
    }
  }

  private append(bytes: Uint8Array): void {
    fs.writeSync(this.fd, bytes, 0, bytes.length, this.written);
    this.written += bytes.length;
  }

  close(): void {
    if (this.closed) return;
    this.closed = true;
    if (this.fd >= 0) fs.closeSync(this.fd);
    this.terminal.close();
  }
}

/** One background job: a process group (or several, if it spawned new ones) that outlived the command that started it. */
interface Job {
  id: number;
  /** The process whose exit code is the job's: the group's leader. */
  pid: number;
  /** Its process group's number as commands see it (in the jail, the jail's own numbering). */
  group: number;
  /** In the jail: the leader's pid there, under which the jail's init reports its exit code. */
  innerPid: number | undefined;
  command: string;
  /** The session of the command that started it, and the marker its processes carry. */
  session: number;
  marker: string;
  groups: Set<number>;
  terminal: JobTerminal;
  startedAt: number;
  endedAt?: number;
  /** When its groups were first seen empty while its exit code was still on its way from the jail's init. */
  emptySince?: number;
  exitCode: number | null;
  state: "running" | "ended" | "killed" | "stopped_at_exit" | "kept_at_exit" | "refused";
  /** The model has been told this job ended. */
  told: boolean;
}

/** What a session file keeps of a job. */
interface JobRecord {
  id: number;
  pid: number;
  command: string;
  log: string;
  started_at: string;
  state: Job["state"];
  exit_code: number | null;
}

/** What a command left behind, for `adopt`. */
interface Leftovers {
  /** The command as the model wrote it: the name of a job that is a subshell of it. */
  command: string;
  session: number;
  marker: string;
  /** The command's terminal, which its jobs still write to. */
  terminal: { close(): void };
  eof: Promise<void>;
  /** Points the terminal's output at the job log from now on. */
  redirect(sink: (bytes: Uint8Array) => void): void;
}

/** Every job table of this process: the exit handler stops their jobs on a path that skipped close(). */
const liveJobTables = new Set<JobTable>();
let exitHandlerInstalled = false;

// ════════════════════════════════════════════════════════════════════════════
// Background jobs: the job table
// Owns: the jobs of one aic process: handed over by commands, watched while
// they run, reported in every tool result, listed and killed by the person, and
// stopped when aic exits.
// ════════════════════════════════════════════════════════════════════════════

/**
 * The jobs of one aic process. Commands hand over what they leave running;
 * a timer (only while jobs run) notices when they end; every tool result
 * gets `report()`; the person can list and kill them; `stopAll` ends them
 * when aic exits.
 */
class JobTable {
  private readonly jobs: Job[] = [];
  private nextId = 1;
  private commands = 0;
  private timer: ReturnType<typeof setInterval> | undefined;

  constructor(
    private readonly emit: (event: AgentEvent) => void,
    private readonly outputs: OutputStore,
    private readonly logLimit: number,
    /** In the jail: the launcher, which every orphan of a command becomes the child of (aic itself otherwise). */
    private readonly reaper: () => number | undefined = () => undefined,
  ) {
    liveJobTables.add(this);
    if (!exitHandlerInstalled) {
      exitHandlerInstalled = true;
      // The last resort (process.exit from deep inside, a crash): jobs never outlive aic.
      process.once("exit", () => liveJobTables.forEach((t) => t.stopAll()));
    }
  }

  /**
   * Stops every process in the jail (the launcher's descendants) until the
   * function returned is called, which resumes them: a checkpoint then reads
   * the tree while no job can swap a directory for a link under git's feet.
   * Rounds repeat until a scan finds nothing new (a process may fork before
   * its stop lands). Processes already stopped are left as they are. Only in
   * the jail, and only while jobs run (otherwise nothing of the commands'
   * is left).
   */
  freeze(): () => void {
    const root = this.reaper();
    if (root === undefined || this.running.length === 0) return () => {};
    const stopped = new Set<number>();
    const sweep = (pid: number): number => {
      let fresh = 0;
      for (const child of childrenOf(pid)) {
        const info = stopped.has(child) ? undefined : processInfo(child);
        if (info && !info.zombie && !info.stopped) {
          signalProcess(child, "SIGSTOP");
          stopped.add(child);
          fresh++;
        }
        fresh += sweep(child);
      }
      return fresh;
    };
    for (let round = 0; round < FREEZE_ROUNDS && sweep(root) > 0; round++);
    const until = performance.now() + FREEZE_SETTLE_MS;
    while ([...stopped].some((pid) => processInfo(pid)?.stopped === false) && performance.now() < until);
    return () => {
      for (const pid of stopped) signalProcess(pid, "SIGCONT");
    };
  }

  /** A marker for the next command's environment. */
  nextMarker(): string {
    return `${process.pid}.${++this.commands}`;
  }

  get running(): Job[] {
    return this.jobs.filter((j) => j.state === "running");
  }

  /**
   * Called when a command's shell has exited: whatever of it still runs
   * becomes a job per process group, up to MAX_JOBS; past that, the new
   * ones are stopped and the model is told. Returns undefined (and leaves
   * the terminal to the caller) when nothing is left.
   */
  adopt(left: Leftovers): { started: Job[]; refused: Job[] } | undefined {
    if (process.platform !== "linux") return undefined;
    reapAdoptedZombies();
    // The shell is gone, so whatever of the command lives has an ancestor that is now aic's own child (the
    // subreaper adopts orphans). No such new child, nothing left: the usual case costs no scan of /proc.
    const known = new Set(this.running.flatMap((j) => [...j.groups]));
    const adopted = this.children().filter((pid) => {
      if (bunChildren.has(pid)) return false;
      const info = processInfo(pid);
      return info !== undefined && !info.zombie && !known.has(info.pgid);
    });
    if (adopted.length === 0) return undefined;
    const members = this.membersOf(left.session, left.marker).filter((m) => !known.has(m.pgid));
    if (members.length === 0) return undefined;
    const terminal = new JobTerminal(left.terminal, this.outputs, this.logLimit);
    left.redirect((bytes) => terminal.write(bytes));
    void left.eof.then(() => this.closeTerminalIfIdle(terminal, true));
    const started: Job[] = [];
    const refused: Job[] = [];
    for (const pgid of new Set(members.map((m) => m.pgid))) {
      const inGroup = members.filter((m) => m.pgid === pgid);
      const leader = inGroup.find((m) => m.pid === pgid) ?? inGroup[0]!;
      const line = commandLineOf(leader.pid);
      const job: Job = {
        id: this.nextId++,
        pid: leader.pid,
        // The group as commands see it: in the jail, its number in the jail's PID namespace.
        // Read off a live member: a `( cmd & )` job's group outlives its leader, whose pid is then nobody's.
        group: this.reaper() ? (innermostPgid(leader.pid) ?? pgid) : pgid,
        innerPid: this.reaper() ? innermostPid(leader.pid) : undefined,
        // A `( … ) &` job is a fork of the command's own shell, whose command line is aic's wrapper: name the command instead.
        command: line.startsWith(`${commandShell()} -c set -m`) ? `a subshell of: ${oneLine(left.command, 100)}` : line,
        session: left.session,
        marker: left.marker,
        groups: new Set([pgid]),
        terminal,
        startedAt: Date.now(),
        exitCode: null,
        state: "running",
        told: false,
      };
      this.jobs.push(job);
      if (this.running.length > MAX_JOBS) {
        job.state = "refused";
        refused.push(job);
        void killGroups([...job.groups]);
        continue;
      }
      started.push(job);
      this.emit({
        type: "job_started",
        id: job.id,
        pid: job.pid,
        group: job.group,
        command: job.command,
        log: terminal.path,
      });
    }
    if (started.length === 0) this.closeTerminalIfIdle(terminal);
    this.watch();
    return { started, refused };
  }

  /**
   * The live processes of a command: those still in its session, and those
   * that carry its marker (they left the session with setsid) and descend
   * from aic, which a subreaper's descendants always do.
   */
  private membersOf(session: number, marker: string): ProcessInfo[] {
    const all = allProcesses().filter((p) => !p.zombie);
    const parent = new Map(all.map((p) => [p.pid, p.ppid]));
    const reaper = this.reaper();
    const descendsFrom = (pid: number, ancestor: number) => {
      for (let p = parent.get(pid), depth = 0; p !== undefined && depth < 64; p = parent.get(p), depth++)
        if (p === ancestor) return true;
      return false;
    };
    // In the jail every process but its init is a command's: whatever of it lives (setsid env -i included, which
    // leaves both the session and the marker behind) belongs to the command that just ended.
    if (reaper) return all.filter((p) => p.pid !== reaper && descendsFrom(p.pid, reaper));
    return all.filter(
      (p) =>
        p.pid !== process.pid &&
        !bunChildren.has(p.pid) &&
        (p.sid === session || (descendsFrom(p.pid, process.pid) && jobMarkerOf(p.pid) === marker)),
    );
  }

  /** The processes orphans become the children of: the jail's launcher, or aic (a child subreaper). */
  private children(): number[] {
    const reaper = this.reaper();
    return reaper ? childrenOf(reaper) : ownChildren();
  }

  private watch(): void {
    if (this.timer || this.running.length === 0) return;
    this.timer = setInterval(() => this.poll(), JOB_POLL_MS);
    this.timer.unref?.();
  }

  /** Reaps what ended, adopts orphans of a job that left its groups, and ends jobs whose groups are empty. */
  private poll(force = false): void {
    reapAdoptedZombies();
    const running = this.running;
    for (const pid of this.children()) {
      if (bunChildren.has(pid)) continue;
      const info = processInfo(pid);
      if (!info || info.zombie || running.some((j) => j.groups.has(info.pgid))) continue;
      const marker = jobMarkerOf(pid);
      running.find((j) => j.marker === marker)?.groups.add(info.pgid);
    }
    // A group of zombies has ended too (the jail's init reaps them on its own timer).
    for (const job of running)
      if (this.groupsEmpty(job) && (force || this.exitKnownOrLate(job))) this.finish(job, "ended");
    if (this.running.length === 0 && this.timer) {
      clearInterval(this.timer);
      this.timer = undefined;
    }
  }

  /**
   * In the jail a job's leader is reaped by the jail's init, whose word (the `reaped` frame) can reach aic a
   * moment after its group is seen empty: the job waits for it, up to JOB_EXIT_WAIT_MS, before it ends with
   * its exit code unknown.
   */
  private exitKnownOrLate(job: Job): boolean {
    if (this.exitKnown(job)) return true;
    job.emptySince ??= Date.now();
    return Date.now() - job.emptySince >= JOB_EXIT_WAIT_MS;
  }

  private exitKnown(job: Job): boolean {
    return job.innerPid === undefined || jailReapedExitCodes.has(job.innerPid) || reapedExitCodes.has(job.pid);
  }

  private groupsEmpty(job: Job): boolean {
    return ![...job.groups].some((g) => groupExists(g) && processesInGroup(g).length > 0);
  }

  /**
   * Before a tool result reports the jobs: a job a command just signalled (`kill -- -N`) is given a moment
   * (JOB_SETTLE_MS at most) to end, and an ended one in the jail to have its exit code said, so the result
   * tells the model how it ended rather than that it still runs.
   */
  async settle(): Promise<void> {
    for (const deadline = Date.now() + JOB_SETTLE_MS; this.running.length && Date.now() < deadline;) {
      this.poll();
      const waiting = this.running.some(
        (j) =>
          (this.groupsEmpty(j) && !this.exitKnown(j)) || [...j.groups].some((g) => processesInGroup(g).some(dying)),
      );
      if (!waiting) return;
      await Bun.sleep(JOB_SETTLE_POLL_MS);
    }
  }

  private finish(job: Job, state: Job["state"]): void {
    if (job.state !== "running") return;
    job.state = state;
    job.endedAt = Date.now();
    // Reaped by aic, reaped by the jail's init (which told aic), or a zombie still waiting to be reaped there.
    job.exitCode =
      reapedExitCodes.get(job.pid) ??
      (job.innerPid !== undefined ? jailReapedExitCodes.get(job.innerPid) : undefined) ??
      processInfo(job.pid)?.exitCode ??
      null;
    this.emit({ type: "job_ended", id: job.id, pid: job.pid, exit_code: job.exitCode, how: state });
    this.closeTerminalIfIdle(job.terminal);
  }

  /** A job's terminal is closed once none of its jobs runs, or once every process has closed it (`eof`). */
  private closeTerminalIfIdle(terminal: JobTerminal, eof = false): void {
    if (eof || !this.jobs.some((j) => j.terminal === terminal && j.state === "running")) terminal.close();
  }

  /**
   * The groups that hold a job's processes now, checked in /proc (a group id
   * is never signalled on trust). A group of the same command that no job
   * knows yet (started after the command returned) goes with the command's
   * first running job.
   */
  private liveGroups(job: Job): number[] {
    const siblings = this.jobs.filter((j) => j.marker === job.marker && j !== job);
    const first = this.jobs.find((j) => j.marker === job.marker && j.state === "running") === job;
    const groups = new Set(
      this.membersOf(job.session, job.marker)
        .filter((p) => job.groups.has(p.pgid) || (first && !siblings.some((s) => s.groups.has(p.pgid))))
        .map((p) => p.pgid),
    );
    for (const g of groups) job.groups.add(g);
    return [...groups];
  }

  /** `/jobs kill N`: SIGTERM, then SIGKILL half a second later. */
  async kill(id: number): Promise<string> {
    const job = this.jobs.find((j) => j.id === id);
    if (!job) return `There is no job ${id}.`;
    if (job.state !== "running") return `Job ${id} is not running (${jobStateText(job)}).`;
    await killGroups(this.liveGroups(job));
    reapAdoptedZombies();
    this.finish(job, "killed");
    return `Stopped job ${id} (${job.command}).`;
  }

  /**
   * The ordinary way out, before stopAll: the same signals, but the event loop runs meanwhile, so the jail's
   * word of how each job ended (its init reaps them) arrives before the job is recorded, as for a job that ends
   * by itself. stopAll alone, blocking, may find the exit code already gone.
   */
  async stopAllAndWait(): Promise<void> {
    if (this.running.length) this.poll(); // a job that ended by itself is reported as such, not as stopped
    const running = this.running;
    if (running.length === 0) return;
    await killGroups(running.flatMap((job) => this.liveGroups(job)));
    const deadline = Date.now() + JOB_EXIT_WAIT_MS;
    while (Date.now() < deadline && running.some((job) => !this.exitKnown(job))) await Bun.sleep(KILL_POLL_MS);
    reapAdoptedZombies();
    for (const job of running) this.finish(job, "stopped_at_exit");
  }

  /** On every way out: each running job's groups get SIGTERM, then SIGKILL 0.5 s later. Blocking, so it also works from an exit handler. */
  stopAll(): void {
    liveJobTables.delete(this);
    if (this.running.length) this.poll(); // a job that ended by itself is reported as such, not as stopped
    const running = this.running;
    if (running.length === 0) return;
    killGroupsNow(running.flatMap((job) => this.liveGroups(job)));
    reapAdoptedZombies();
    for (const job of running) this.finish(job, "stopped_at_exit");
    if (this.timer) clearInterval(this.timer);
    this.timer = undefined;
  }

  /**
   * With --keep-jobs, what aic leaves running if it exits now: each running
   * job (pid as the person sees it), and how many other processes of the
   * run's commands live (daemons that left their session, helpers).
   */
  kept(): { jobs: { pid: number; command: string; log: string }[]; others: number } {
    if (this.running.length) this.poll();
    const running = this.running;
    const inJobs = new Set(running.flatMap((job) => [...job.groups]));
    const ours = `${process.pid}.`;
    const others = allProcesses().filter(
      (p) => !p.zombie && !inJobs.has(p.pgid) && jobMarkerOf(p.pid)?.startsWith(ours),
    ).length;
    return { jobs: running.map((job) => ({ pid: job.pid, command: job.command, log: job.terminal.path })), others };
  }

  /** --keep-jobs at exit: nothing is stopped; the jobs are recorded as left running. */
  keepAll(): void {
    liveJobTables.delete(this);
    if (this.timer) clearInterval(this.timer);
    this.timer = undefined;
    for (const job of this.running) {
      job.state = "kept_at_exit";
      job.endedAt = Date.now();
    }
  }

  /** The lines every tool result ends with: each running job, and each that ended since the last result. */
  report(): string {
    if (this.running.length) this.poll(true);
    const lines: string[] = [];
    for (const job of this.jobs) {
      if (job.state === "refused" || job.told) continue;
      if (job.state !== "running") job.told = true;
      lines.push(jobLine(job));
    }
    return lines.join("\n");
  }

  /**
   * `/jobs`: every job this process started, newest last, numbered as the
   * person's own shell sees them (the jail numbers its processes its own way).
   */
  list(): string[] {
    return this.jobs.filter((j) => j.state !== "refused").map((j) => jobLine(j, processInfo(j.pid)?.pgid ?? j.pid));
  }

  records(): JobRecord[] {
    return this.jobs.map((j) => ({
      id: j.id,
      pid: j.pid,
      command: j.command,
      log: j.terminal.path,
      started_at: new Date(j.startedAt).toISOString(),
      state: j.state,
      exit_code: j.exitCode,
    }));
  }
}

function groupExists(pgid: number): boolean {
  try {
    process.kill(-pgid, 0);
    return true;
  } catch {
    return false;
  }
}

/** The process group that is the job (its leader's), as the model's commands see it. */
function jobGroup(job: Job): number {
  return job.group;
}

// ════════════════════════════════════════════════════════════════════════════
// Checkpoints: snapshot settings and manifests
// Owns: what snapshots of the start directory's tree are made with: a git
// repository of aic's own under $XDG_STATE_HOME/aic (never the project's
// .git), the `git` executable, and a configuration that shuts out every
// setting of the person's or the project's git that could run code, prompt,
// rewrite bytes or slow a snapshot down; and the manifest of what git does not
// record (modes, empty directories).
// ════════════════════════════════════════════════════════════════════════════

/** Files to stop snapshotting at: past this a tree is not a project worth checkpointing (node_modules is ignored anyway). */
const MAX_CHECKPOINT_FILES = 50_000;
/** The first snapshot writes every file once; past this, checkpoints cost too much here and are turned off. */
const FIRST_SNAPSHOT_LIMIT_MS = 2000;
/** How long a first snapshot may go on in the background once the first command has stopped waiting for it. */
const FIRST_SNAPSHOT_BACKGROUND_MS = 60_000;
/** How long a tree checkpoints gave up on (too many files, a first snapshot too slow) is left alone by later runs. */
const GIVEN_UP_REMEMBERED_MS = 24 * 60 * 60 * 1000;
/** How many snapshots (commit, tree, manifest) a store keeps in memory. */
const SNAPSHOT_CACHE_ENTRIES = 64;
/** How often a git of aic's that is still running is looked at for an open() a FIFO holds up. */
const FIFO_WATCH_MS = 250;

/** open and openat (x86-64; arm64 has only openat), and openat's "relative to the working directory". */
const SYS_OPEN = process.arch === "x64" ? 2 : -1;
const SYS_OPENAT = process.arch === "x64" ? 257 : process.arch === "arm64" ? 56 : -1;
const AT_FDCWD = -100;

/**
 * A git of aic's own that waits in open() on a FIFO (a `.gitignore` a
 * command made one: git reads every directory's) would wait for ever, and
 * the snapshot with it. The path it waits on is read from its memory (it is
 * aic's child), and the FIFO's other end is opened and closed at once
 * (non-blocking, never through a link, nothing written): git reads it as
 * empty and goes on.
 */
function unblockFifoOpen(pid: number): void {
  try {
    const fields = fs.readFileSync(`/proc/${pid}/syscall`, "utf8").trim().split(" ");
    const nr = Number(fields[0]);
    if (nr !== SYS_OPEN && nr !== SYS_OPENAT) return;
    const dirfd = nr === SYS_OPENAT ? Number(BigInt.asIntN(32, BigInt(fields[1]!))) : AT_FDCWD;
    const at = Number(BigInt(nr === SYS_OPENAT ? fields[2]! : fields[1]!));
    const name = readCString(pid, at);
    if (!name) return;
    const base = path.isAbsolute(name)
      ? ""
      : fs.readlinkSync(dirfd === AT_FDCWD ? `/proc/${pid}/cwd` : `/proc/${pid}/fd/${dirfd}`);
    const file = path.resolve(base, name);
    if (!fs.lstatSync(file).isFIFO()) return;
    const fd = fs.openSync(file, O.O_WRONLY | O.O_NONBLOCK | O.O_NOFOLLOW);
    fs.closeSync(fd);
  } catch {
    /* not waiting on a FIFO, or gone, or no reader yet: looked at again shortly */
  }
}

/** A NUL-terminated string in another process's memory (at most 4 KB). */
function readCString(pid: number, at: number): string | undefined {
  const fd = fs.openSync(`/proc/${pid}/mem`, O.O_RDONLY);
  try {
    return readMemoryString(fd, at, 4096);
  } finally {
    fs.closeSync(fd);
  }
}
/** Later snapshots and restores are bounded too, so a stuck git can never hang a run. */
const GIT_TIME_LIMIT_MS = 60_000;
/** Checkpoints kept per directory; older ones are dropped (and their objects collected) now and then. */
const CHECKPOINTS_KEPT = 200;
/** The checkpoint store's cap, in MB, unless AIC_CHECKPOINT_STORE_MAX_MB says otherwise. */
const CHECKPOINT_STORE_MAX_MB = 2048;

/** A size in bytes from a variable in MB (a positive number), or `fallbackMb` when it is unset or not one. */
function megabytesFromEnv(variable: string, fallbackMb: number): number {
  const given = Number(process.env[variable]);
  return (Number.isFinite(given) && given > 0 ? given : fallbackMb) * 1e6;
}

const checkpointStoreCap = () => megabytesFromEnv("AIC_CHECKPOINT_STORE_MAX_MB", CHECKPOINT_STORE_MAX_MB);
const CHECKPOINT_REF = "refs/aic/cp/";
const LAST_CHECKPOINT_REF = "refs/aic/last";

/** How many repositories inside the tree (and inside those) have their files listed for a snapshot. */
const MAX_NESTED_REPOSITORIES = 1000;

/**
 * The shadow repository's whole config (the person's and the system's are
 * shut out): no hooks, no fsmonitor, no filters, no line-ending changes, no
 * signing, no automatic gc in the middle of a snapshot.
 */
const SHADOW_CONFIG = `[core]
\trepositoryformatversion = 0
\tbare = false
\tfilemode = true
\tsymlinks = true
\tignorecase = false
\tautocrlf = false
\tsafecrlf = false
\teol = lf
\tfsmonitor = false
\thooksPath = /dev/null
\texcludesFile = /dev/null
\tattributesFile = /dev/null
\tuntrackedCache = true
\tpreloadIndex = true
\ttrustctime = true
\tlogAllRefUpdates = false
\tlooseCompression = 1
\tcompression = 1
\tbigFileThreshold = 16m
\tquotePath = false
\tsparseCheckout = false
\tsplitIndex = false
[index]
\tversion = 4
\tthreads = true
[gc]
\tauto = 0
[maintenance]
\tauto = false
[commit]
\tgpgSign = false
[submodule]
\trecurse = false
[diff]
\trenames = false
[advice]
\taddEmbeddedRepo = false
[user]
\tname = aic
\temail = aic@localhost
`;

/** Stronger than any .gitattributes of the project: the bytes are stored and put back exactly (no CRLF, no LFS, no $Id$). */
const SHADOW_ATTRIBUTES = "* -text -eol -filter -ident -working-tree-encoding\n";

/** One checkpoint: its commit, the tree of the files, and the manifest of what git does not record (modes, empty directories). */
interface Snapshot {
  commit: string;
  tree: string;
  manifest: string;
}

/** Where a checkpoint's message starts listing what git does not record. */
const MANIFEST_HEADING = "aic-manifest";
/** How deep, and how many, empty directories a checkpoint records: a tree of empty directories is no project's content. */
const MANIFEST_DIR_DEPTH = 32;
const MANIFEST_DIR_LIMIT = 1000;

/** The work tree a checkpoint store was made with (the second line of its `directory` file; older stores have none). */
function recordedWorkTree(home: string): string | undefined {
  try {
    const line = readOwnFile(path.join(home, "directory"), 64 * 1024)
      .toString("utf8")
      .split("\n")[1]
      ?.trim();
    return line && path.isAbsolute(line) ? line : undefined;
  } catch {
    return undefined;
  }
}

/** The start directory's path no longer leads to the directory aic holds: checkpoints stop, and undo refuses. */
class ProjectMoved extends Error {}

/** The permission bits a fresh file gets (what git's checkout writes): 0666 or 0777, less the umask. */
function checkoutMode(executable: boolean): number {
  return (executable ? 0o777 : 0o666) & ~process.umask();
}

/** A path below the start directory as git stores one: no empty, `.` or `..` component, no NUL. */
function safeRelativePath(rel: string): boolean {
  return rel !== "" && !rel.includes("\0") && rel.split("/").every((c) => c !== "" && c !== "." && c !== "..");
}

/** What a checkpoint's manifest says: permission bits that differ from a checkout's, and the empty directories. */
function parseManifest(text: string): { modes: Map<string, number>; dirs: Set<string> } {
  const modes = new Map<string, number>();
  const dirs = new Set<string>();
  for (const line of text.split("\n")) {
    const m = /^(mode ([0-7]{1,4})|dir) (".*")$/.exec(line);
    if (!m) continue;
    let rel: unknown;
    try {
      rel = JSON.parse(m[3]!);
    } catch {
      continue;
    }
    if (typeof rel !== "string" || !safeRelativePath(rel)) continue;
    if (m[2]) modes.set(rel, Number.parseInt(m[2], 8));
    else dirs.add(rel);
  }
  return { modes, dirs };
}

/** Linux's O_TMPFILE (it includes O_DIRECTORY): an unnamed file in a directory, gone once closed. */
const O_TMPFILE = 0o20000000 | O.O_DIRECTORY;

/** Everything a git call wrote into a capture file. */
function readCapture(fd: number): Buffer {
  const chunks: Buffer[] = [];
  let size = 0;
  for (let chunk = Buffer.alloc(Math.max(fs.fstatSync(fd).size, 64)); ;) {
    const n = fs.readSync(fd, chunk, 0, chunk.length, size);
    if (n === 0) break;
    chunks.push(chunk.subarray(0, n));
    size += n;
    chunk = n === chunk.length ? Buffer.alloc(chunk.length) : chunk.subarray(n);
  }
  return chunks.length === 1 ? chunks[0]! : Buffer.concat(chunks, size);
}

/** The outcome of one git call. */
interface GitResult {
  code: number;
  stdout: Buffer;
  stderr: string;
  timedOut: boolean;
}
/** How one git call of the shadow repository runs. */
interface GitOptions {
  input?: string;
  limitMs?: number;
  env?: Record<string, string>;
}

/**
 * Runs git for a shadow repository: the shut-out environment, stdin closed
 * (or fed), in the work tree, under a time limit, its output captured in
 * files of aic's own rather than pipes.
 */
class ShadowGit {
  constructor(
    private readonly workTree: string,
    /** aic's own directory for the repository: capture files are made here. */
    private readonly home: string,
    private readonly env: Record<string, string>,
  ) {}

  /** `git` with the shut-out environment, stdin closed (or fed), in the work tree, under a time limit. */
  async git(args: string[], opts: GitOptions = {}): Promise<GitResult> {
    // git writes into files, read once it has exited: a pipe costs a read buffer of a quarter megabyte
    // per stream, held until the garbage collector finalises the process object (half a megabyte per
    // call, measured: the bulk of what checkpoints added to the peak resident set of a long run).
    const out = this.captureFile();
    let err: number | undefined;
    try {
      err = this.captureFile();
      const { code, timedOut } = await this.spawnGit(args, opts, out, err);
      return { code, stdout: readCapture(out), stderr: readCapture(err).toString("utf8"), timedOut };
    } finally {
      fs.closeSync(out);
      if (err !== undefined) fs.closeSync(err);
    }
  }

  /** `git` whose output stays in an unnamed file of aic's own, read from its descriptor (the caller closes it). */
  async gitToFile(args: string[], input: string): Promise<number> {
    const out = this.captureFile();
    try {
      const { code, timedOut } = await this.spawnGit(args, { input }, out, "ignore");
      if (code !== 0 || timedOut) throw new Error(`git ${args[0]} failed${timedOut ? ": it took too long" : ""}`);
      return out;
    } catch (error) {
      fs.closeSync(out);
      throw error;
    }
  }

  private async spawnGit(
    args: string[],
    opts: GitOptions,
    stdout: number,
    stderr: number | "ignore",
  ): Promise<{ code: number; timedOut: boolean }> {
    const proc = spawnOwned([gitProgram() ?? NO_TRUSTED_GIT, "--no-pager", ...args], {
      cwd: this.workTree,
      env: opts.env ?? this.env,
      stdin: opts.input === undefined ? "ignore" : utf8.encode(opts.input),
      stdout,
      stderr,
    });
    let timedOut = false;
    const timer = setTimeout(() => {
      timedOut = true;
      proc.kill("SIGTERM"); // git removes its lock files on SIGTERM
      setTimeout(() => proc.kill("SIGKILL"), KILL_GRACE_MS).unref?.();
    }, opts.limitMs ?? GIT_TIME_LIMIT_MS);
    const fifos = setInterval(() => unblockFifoOpen(proc.pid), FIFO_WATCH_MS);
    const code = await proc.exited;
    clearTimeout(timer);
    clearInterval(fifos);
    return { code, timedOut };
  }

  /**
   * A file for one output stream of one git call, in aic's own directory
   * (commands cannot write there): unnamed where Linux allows it
   * (O_TMPFILE), else created under a fresh name and unlinked at once.
   */
  private captureFile(): number {
    if (process.platform === "linux")
      try {
        return fs.openSync(this.home, O_TMPFILE | O.O_RDWR | O.O_NOFOLLOW, 0o600);
      } catch {
        /* a file system without O_TMPFILE: a named file */
      }
    for (;;) {
      const file = path.join(this.home, `.capture-${process.pid}-${randomName()}`);
      let fd: number;
      try {
        fd = fs.openSync(file, O.O_RDWR | O.O_CREAT | O.O_EXCL | O.O_NOFOLLOW, 0o600);
      } catch (error) {
        if ((error as NodeJS.ErrnoException).code === "EEXIST") continue;
        throw error;
      }
      try {
        fs.unlinkSync(file);
      } catch (error) {
        fs.closeSync(fd);
        throw error;
      }
      return fd;
    }
  }

  /** The same, throwing with git's own words when it fails. */
  async gitOk(args: string[], opts: GitOptions = {}): Promise<string> {
    const r = await this.git(args, opts);
    if (r.timedOut) throw new Error(`git ${args[0]} took longer than ${(opts.limitMs ?? GIT_TIME_LIMIT_MS) / 1000} s`);
    if (r.code !== 0)
      throw new Error(`git ${args[0]} failed: ${r.stderr.trim().split("\n").at(-1) ?? `exit ${r.code}`}`);
    return r.stdout.toString("utf8");
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Checkpoints: what changed since the last snapshot
// Owns: the kernel's record of writes under the start directory (inotify on
// every directory the checkpoints keep), which lets a step that wrote nothing
// run no git, and one that wrote look again only where it did.
// ════════════════════════════════════════════════════════════════════════════

/** inotify(7): what counts as a change to a watched directory or a file in it. */
const IN_CHANGES = 0x2 | 0x4 | 0x8 | 0x40 | 0x80 | 0x100 | 0x200 | 0x400 | 0x800; // MODIFY ATTRIB CLOSE_WRITE MOVED_* CREATE DELETE*, MOVE_SELF
const IN_ONLYDIR = 0x01000000;
const IN_DONT_FOLLOW = 0x02000000;
const IN_IGNORED = 0x8000;
const IN_MOVE_SELF = 0x800;
const IN_Q_OVERFLOW = 0x4000;
const IN_NONBLOCK = 0o4000;
/** More directories than this and the tree is not watched: every snapshot asks git, as before. */
const MAX_WATCHED_DIRECTORIES = 20_000;

/**
 * Whether anything under the start directory was written since a snapshot
 * began, from the kernel's own record (inotify on every directory that holds
 * a file the checkpoints keep): a step whose command changed nothing then
 * costs no git process at all. Read synchronously, so every change made
 * before the question is in the answer. It errs one way only: an event it
 * cannot place, an overflow, a directory it has just begun to watch all
 * count as changes. What it cannot see (a file written through a hard link
 * from outside the tree, or through a shared memory mapping) is picked up by
 * the next snapshot that asks git.
 */
class ChangeWatch {
  private fd = -1;
  private readonly watched = new Map<number, string>();
  /** Each watched path, its watch and the directory's identity then: a watch follows an inode, not a path. */
  private readonly byPath = new Map<string, { wd: number; id: string }>();
  private changed = true;
  /** The directories changes were seen in since `restart()`, unless one could not be placed (`whole`). */
  private readonly dirty = new Set<string>();
  private whole = true;
  /** Each entry (relative to the start directory) a change was seen at since `restart()`, unless one could not be placed. */
  private readonly names = new Set<string>();
  private namesWhole = true;
  private readonly buffer = Buffer.alloc(64 * 1024);

  constructor(
    /** The start directory's path; watched paths are relative to it. */
    private readonly root: string,
    /** Names in the start directory that are aic's own (the session and its temporaries): their changes do not count. */
    private readonly own: RegExp[],
  ) {}

  /** True when nothing was written since `restart()`, under every directory `cover()` was given. */
  quiet(): boolean {
    if (this.fd < 0) return false;
    this.drain();
    return !this.changed;
  }

  /** From now on, changes count again: called just before git reads the tree (`failed`: what it read is not kept). */
  restart(failed = false): void {
    if (this.fd >= 0) this.drain();
    this.changed = failed;
    this.whole = failed;
    this.dirty.clear();
    this.names.clear();
    this.namesWhole = failed;
  }

  /**
   * The entries written since `restart()` (files, or directories made), for a look at their size; "unknown"
   * when the record lost track (an overflow, a watch given up); undefined before watching began.
   */
  written(): string[] | "unknown" | undefined {
    if (this.fd === -1) return undefined;
    if (this.fd < 0) return "unknown";
    this.drain();
    return this.namesWhole ? "unknown" : [...this.names];
  }

  /** The directories (relative to the start directory) every change since `restart()` lies beneath; undefined: anywhere. */
  scope(): string[] | undefined {
    if (this.fd < 0) return undefined;
    this.drain();
    return this.whole || this.dirty.has("") ? undefined : [...this.dirty];
  }

  /** Watches `dirs` (relative to the start directory, "" for itself) too; a directory newly watched counts as a change. */
  cover(dirs: Iterable<string>): void {
    if (this.fd === -2) return;
    const c = libc()?.symbols;
    if (!c) return void (this.fd = -2);
    if (this.fd < 0) this.fd = c.inotify_init1(IN_NONBLOCK | O_CLOEXEC);
    if (this.fd < 0) return void (this.fd = -2);
    for (const rel of dirs) {
      const at = path.join(this.root, rel);
      const st = fs.lstatSync(at, { throwIfNoEntry: false, bigint: true });
      // With its birth time: a directory removed and made again at once often gets the freed inode number back.
      const id = st?.isDirectory() ? `${st.dev}:${st.ino}:${st.birthtimeNs}` : "";
      const known = this.byPath.get(rel);
      // Renamed away and made again, or removed while a process held it (no event said so): watched anew.
      if (known && known.id === id) continue;
      if (known) this.byPath.delete(rel);
      if (this.byPath.size >= MAX_WATCHED_DIRECTORIES) return this.giveUp();
      this.changed = true;
      this.whole = true;
      if (!id) continue; // gone since the snapshot: a change, counted
      const wd = c.inotify_add_watch(this.fd, Buffer.from(`${at}\0`), IN_CHANGES | IN_ONLYDIR | IN_DONT_FOLLOW);
      if (wd < 0) return this.giveUp(); // the kernel's watch limit: watching stops
      this.watched.set(wd, rel);
      this.byPath.set(rel, { wd, id });
    }
  }

  close(): void {
    if (this.fd >= 0) fs.closeSync(this.fd);
    this.fd = -2;
    this.watched.clear();
    this.byPath.clear();
  }

  private giveUp(): void {
    this.close();
    this.changed = true;
    this.whole = true;
    this.namesWhole = true;
  }

  private drain(): void {
    for (;;) {
      let got: number;
      try {
        got = fs.readSync(this.fd, this.buffer, 0, this.buffer.length, null);
      } catch {
        return; // EAGAIN: nothing more queued
      }
      if (got <= 0) return;
      for (let at = 0; at + 16 <= got;) {
        const wd = this.buffer.readInt32LE(at);
        const mask = this.buffer.readUInt32LE(at + 4);
        const length = this.buffer.readUInt32LE(at + 12);
        const name = this.buffer.toString("utf8", at + 16, at + 16 + length).replace(/\0+$/, "");
        at += 16 + length;
        if (mask & IN_Q_OVERFLOW) this.changed = this.whole = this.namesWhole = true;
        const rel = this.watched.get(wd);
        if (mask & IN_IGNORED) {
          if (rel !== undefined && this.byPath.get(rel)?.wd === wd) this.byPath.delete(rel);
          this.watched.delete(wd);
          continue;
        }
        // A directory moved away: its watch goes with it, and its path is watched anew at the next cover.
        if (mask & IN_MOVE_SELF && rel !== undefined && this.byPath.get(rel)?.wd === wd) this.byPath.delete(rel);
        if (name && rel !== undefined && rel.startsWith("..")) {
          // Above the start directory only ignore rules matter, and they may change what any directory holds.
          if (name === ".gitignore") this.changed = this.whole = true;
          continue;
        }
        const inTree = rel ? `${rel}/${name}` : name;
        if (name && this.own.some((re) => re.test(inTree))) continue;
        this.changed = true;
        if (rel === undefined) this.whole = this.namesWhole = true;
        else this.dirty.add(rel);
        if (rel !== undefined && name) this.names.add(inTree);
      }
    }
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Checkpoints: what git does not record
// Owns: a snapshot's manifest (permission bits a checkout would not give,
// empty directories) and the stamps of the directories it looked at, which
// tell a later snapshot whether any directory gained or lost a subdirectory.
// ════════════════════════════════════════════════════════════════════════════

/**
 * The manifest of the shadow repository's snapshots. It reads the index
 * `add -A` left and the start directory through the held descriptor, and
 * remembers what it looked at so an unchanged tree's manifest costs no walk.
 */
class SnapshotManifest {
  /** The manifest stopped at its limits: a directory past them is not watched, so the watch is not trusted. */
  cut = false;

  /**
   * The directories the last manifest looked at (relative to the start directory): each one's stamp and
   * the names of its subdirectories, which are all an empty directory's coming or going can change.
   */
  stamps: Map<string, [stamp: string, subdirs: string]> | undefined;

  /**
   * Whether no directory the last manifest looked at gained, lost or renamed a subdirectory. A stamp as
   * recorded answers at once; another (a file came or went: aic's own session file does each step) is
   * settled by listing that directory again.
   */
  dirsUnchanged(): boolean {
    if (!this.stamps) return false;
    for (const [rel, [stamp, subdirs]] of this.stamps) {
      const now = this.dirStamp(rel);
      if (now !== undefined && now === stamp) continue;
      const listed = this.subdirsOf(rel);
      if (listed === undefined || listed !== subdirs) return false;
      if (now !== undefined) this.stamps.set(rel, [now, subdirs]);
    }
    return true;
  }

  /** A directory's inode and change times; undefined when it is gone, or changed too recently to be sure of. */
  private dirStamp(rel: string): string | undefined {
    const st = fs.lstatSync(this.project.at(rel), { bigint: true, throwIfNoEntry: false });
    if (!st?.isDirectory()) return undefined;
    const now = BigInt(Date.now()) * 1_000_000n;
    if (st.ctimeNs + LISTING_RACY_NS >= now || st.mtimeNs + LISTING_RACY_NS >= now) return undefined;
    return `${st.ino}:${st.mtimeNs}:${st.ctimeNs}`;
  }

  /** The names of a directory's subdirectories, in order; undefined when it cannot be read. */
  private subdirsOf(rel: string): string | undefined {
    try {
      const names = fs.readdirSync(this.project.at(rel), { withFileTypes: true });
      return names
        .filter((e) => e.isDirectory())
        .map((e) => e.name)
        .sort()
        .join("\0");
    } catch {
      return undefined;
    }
  }

  /** Stamps and subdirectories of `dirs` (a stamp too recent to trust is left empty: it never matches). */
  private stampsOf(dirs: Iterable<string>): Map<string, [string, string]> | undefined {
    const stamps = new Map<string, [string, string]>();
    for (const rel of dirs) {
      const subdirs = this.subdirsOf(rel);
      if (subdirs === undefined) return undefined;
      stamps.set(rel, [this.dirStamp(rel) ?? "", subdirs]);
    }
    return stamps;
  }

  constructor(
    private readonly project: HeldDirectory,
    private readonly gitDir: string,
    /** A path git printed as one relative to the start directory (undefined outside it). */
    private readonly relative: (gitPath: string) => string | undefined,
  ) {}

  /**
   * What git does not record, as lines for the checkpoint's message (`untrackedDirs`: what `git ls-files -o --directory`
   * lists after add -A): files
   * whose permission bits are not what a checkout would give them (git
   * keeps only the executable bit), and empty directories.
   */
  async make(unchangedSince: Snapshot | undefined, untrackedDirs: () => Promise<string>): Promise<string> {
    const lines: string[] = [];
    /** Every directory holding a tracked file, and each one the empty-directory search entered. */
    const dirs = new Set<string>([""]);
    const parentsOf = (rel: string) => {
      for (let at = rel.lastIndexOf("/"); at > 0; at = rel.lastIndexOf("/", at - 1)) {
        const dir = rel.slice(0, at);
        if (dirs.has(dir)) break;
        dirs.add(dir);
      }
    };
    // The index as `add -A` left it, read here rather than listed by `git ls-files -s` (a process a step).
    const entries: [name: string, mode: number][] = [];
    const index = readOwnFile(path.join(this.gitDir, "index"), MAX_OWN_FILE_BYTES);
    if (!indexEntries(index, (name, mode) => entries.push([name.toString("utf8"), mode])))
      throw new Error("the checkpoint index cannot be read");
    for (const [name, kind] of entries) {
      const inside = this.relative(name);
      if (inside !== undefined) parentsOf(inside);
      const rel = kind === 0o100644 || kind === 0o100755 ? inside : undefined;
      if (rel === undefined) continue;
      const st = fs.lstatSync(this.project.at(rel), { throwIfNoEntry: false });
      const mode = st?.isFile() ? st.mode & 0o7777 : undefined;
      if (mode !== undefined && mode !== checkoutMode(kind === 0o100755))
        lines.push(`mode ${mode.toString(8)} ${JSON.stringify(rel)}`);
    }
    // With no directory changed since the last snapshot, its empty directories are this one's too.
    if (unchangedSince && this.stamps) {
      for (const line of unchangedSince.manifest.split("\n")) if (line.startsWith("dir ")) lines.push(line);
      return lines.join("\n");
    }
    // After add -A every file git would keep is staged: what it still lists as untracked directories holds
    // only empty directories (and ignored files), whose empty leaves are recorded.
    const empty: string[] = [];
    this.cut = false;
    for (const entry of (await untrackedDirs()).split("\0")) {
      const rel = entry.endsWith("/") ? this.relative(entry.slice(0, -1)) : undefined;
      if (rel !== undefined) this.emptyLeaves(rel, empty, 0, dirs);
    }
    for (const rel of empty) lines.push(`dir ${JSON.stringify(rel)}`);
    this.stamps = this.stampsOf(dirs);
    return lines.join("\n");
  }

  /** The empty directories at or below `rel` (a directory git tracks nothing in), walked without following links. */
  private emptyLeaves(rel: string, out: string[], depth: number, seen: Set<string>): void {
    if (depth > MANIFEST_DIR_DEPTH || out.length >= MANIFEST_DIR_LIMIT) return void (this.cut = true);
    let entries: fs.Dirent[];
    try {
      entries = fs.readdirSync(this.project.at(rel), { withFileTypes: true });
    } catch {
      return; // gone meanwhile
    }
    seen.add(rel);
    if (entries.length === 0) out.push(rel);
    for (const e of entries) if (e.isDirectory()) this.emptyLeaves(`${rel}/${e.name}`, out, depth + 1, seen);
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Checkpoints: the shadow repository's own files
// Owns: the files of aic's checkpoint store that are not git objects: made
// once, its settings put back before each git run should anyone change them,
// the excludes written at each start, its lock, the state the next run resumes
// from, and the note that checkpoints gave up on this tree, kept for a day.
// ════════════════════════════════════════════════════════════════════════════

/** Writes one of aic's own small files whole: a regular file only, never through a link. */
function writeOwnFile(file: string, text: string): void {
  const fd = openRegular(file, O.O_WRONLY | O.O_CREAT | O.O_TRUNC);
  try {
    fs.ftruncateSync(fd, 0);
    fs.writeSync(fd, text);
  } finally {
    fs.closeSync(fd);
  }
}

/** Nothing of the person's git environment or config reaches the shadow git; what remains is fixed here. */
function shadowGitEnvironment(gitDir: string, workTree: string): Record<string, string> {
  const env: Record<string, string> = {};
  for (const [name, value] of Object.entries(process.env))
    if (value !== undefined && !name.startsWith("GIT_") && !["PAGER", "EDITOR", "VISUAL", "SSH_ASKPASS"].includes(name))
      env[name] = value;
  return Object.assign(env, {
    GIT_DIR: gitDir,
    GIT_WORK_TREE: workTree,
    GIT_CONFIG_NOSYSTEM: "1",
    GIT_CONFIG_SYSTEM: "/dev/null",
    GIT_CONFIG_GLOBAL: "/dev/null",
    GIT_ATTR_NOSYSTEM: "1",
    GIT_NO_REPLACE_OBJECTS: "1",
    GIT_TERMINAL_PROMPT: "0",
    GIT_ASKPASS: "/bin/false",
    GIT_PAGER: "cat",
    GIT_EDITOR: "false",
    GIT_AUTHOR_NAME: "aic",
    GIT_AUTHOR_EMAIL: "aic@localhost",
    GIT_COMMITTER_NAME: "aic",
    GIT_COMMITTER_EMAIL: "aic@localhost",
    LC_ALL: "C",
    LANG: "C",
  });
}

/**
 * A checkpoint's commit written into the store as git writes a loose object
 * (SHA-1, as `git init` made it), with its refs, and no git process: two
 * fewer a step that changed files. The store lies in aic's state directory,
 * out of commands' reach. Undefined when the store is not one this knows
 * how to write (a SHA-256 tree id, a ref's lock held): git is asked then.
 */
function writeCheckpointCommit(gitDir: string, tree: string, text: string, refs: string[]): string | undefined {
  if (!/^[0-9a-f]{40}$/.test(tree)) return undefined;
  const when = `${Math.floor(Date.now() / 1000)} +0000`;
  const body = Buffer.from(
    `tree ${tree}\nauthor aic <aic@localhost> ${when}\ncommitter aic <aic@localhost> ${when}\n\n${text}`,
  );
  const data = Buffer.concat([Buffer.from(`commit ${body.length}\0`), body]);
  const id = createHash("sha1").update(data).digest("hex");
  try {
    const dir = path.join(gitDir, "objects", id.slice(0, 2));
    const file = path.join(dir, id.slice(2));
    if (!fs.existsSync(file)) {
      fs.mkdirSync(dir, { recursive: true });
      const temp = path.join(dir, `tmp_obj_${process.pid}_${randomName()}`);
      writeNewFile(temp, deflateSync(data, { level: 1 }), 0o444);
      fs.renameSync(temp, file);
    }
    // Each ref as git's files backend writes it: its lock file (a git at work on it makes this fail), then a rename.
    for (const ref of refs) {
      const at = path.join(gitDir, ref);
      fs.mkdirSync(path.dirname(at), { recursive: true });
      writeNewFile(`${at}.lock`, Buffer.from(`${id}\n`), 0o644);
      fs.renameSync(`${at}.lock`, at);
    }
    return id;
  } catch {
    return undefined;
  }
}

/** A file made anew (never through a link, never over one that is there), with `data`. */
function writeNewFile(file: string, data: Buffer, mode: number): void {
  const fd = fs.openSync(file, O.O_WRONLY | O.O_CREAT | O.O_EXCL | O.O_NOFOLLOW, mode);
  try {
    for (let at = 0; at < data.length;) at += fs.writeSync(fd, data, at);
  } finally {
    fs.closeSync(fd);
  }
}

/** What a snapshot knew that lets the next run's first snapshot be one `git add`. */
interface LastSnapshotState {
  commit: string;
  index: string | undefined;
  /** The manifest's directory stamps (SnapshotManifest.stamps), or null when it had none. */
  dirs: [string, [string, string]][] | null;
}

/** The settings and notes of one shadow repository (ShadowRepository runs git on it). */
class ShadowStoreFiles {
  constructor(
    private readonly project: HeldDirectory,
    private readonly gitDir: string,
    private readonly home: string,
    private readonly workTree: string,
    /** The start directory relative to the work tree, "" or "a/b/". */
    private readonly prefix: string,
    private readonly ownFiles: string[],
    private readonly env: Record<string, string>,
    private readonly gitOk: (args: string[], opts?: GitOptions) => Promise<string>,
  ) {}

  /** Removes a run's own store (see `of`), and those of runs that died without removing theirs. */
  removeIfEphemeral(): void {
    const runs = path.dirname(this.home);
    if (path.basename(runs) !== "runs") return;
    try {
      fs.rmSync(this.home, { recursive: true, force: true });
      for (const name of fs.readdirSync(runs)) {
        const pid = Number(name.split("-")[0]);
        if (pid > 0 && pid !== process.pid && !fs.existsSync(`/proc/${pid}`))
          fs.rmSync(path.join(runs, name), { recursive: true, force: true });
      }
    } catch {
      /* no runs directory, or one aic may not write: nothing of this run's is there */
    }
  }
  /** Where a tree checkpoints gave up on is remembered (see Checkpoints.start). */
  givenUpFile: string | undefined;

  /** Why an earlier run gave up on checkpoints for this tree, and when; undefined when none did within a day. */
  givenUpBefore(): { why: string; at: number } | undefined {
    if (!this.givenUpFile) return undefined;
    try {
      const o = JSON.parse(readOwnFile(this.givenUpFile, 64 * 1024).toString("utf8")) as {
        why?: unknown;
        at?: unknown;
      };
      if (typeof o.why !== "string" || typeof o.at !== "number") return undefined;
      return Date.now() - o.at < GIVEN_UP_REMEMBERED_MS ? { why: o.why, at: o.at } : undefined;
    } catch {
      return undefined;
    }
  }

  rememberGivenUp(why: string | undefined): void {
    if (!this.givenUpFile) return;
    try {
      if (why === undefined) fs.rmSync(this.givenUpFile, { force: true });
      else {
        fs.mkdirSync(path.dirname(this.givenUpFile), { recursive: true, mode: 0o700 });
        writeOwnFile(this.givenUpFile, JSON.stringify({ why, at: Date.now() }));
      }
    } catch {
      /* the next run finds out again */
    }
  }

  get exists(): boolean {
    return fs.existsSync(path.join(this.gitDir, "HEAD"));
  }

  /** The identity of the store's config when it was last found to be aic's own. */
  private settingsChecked: string | undefined;

  /**
   * The store's config, attributes and commondir as aic wrote them (or absent), before each git run: where
   * aic's state directory lies among what commands may write (Landlock alone, a HOME under /tmp), a command
   * could add a core.fsmonitor there, which aic's own git would run outside the sandbox. Put back, and said.
   */
  ensureOwnSettings(): void {
    const config = path.join(this.gitDir, "config");
    const now = identityOf(config);
    const extra = ["commondir", "config.worktree"].filter((f) => fs.existsSync(path.join(this.gitDir, f)));
    if (now !== undefined && now === this.settingsChecked && !extra.length) return;
    let text = "";
    try {
      text = readOwnFile(config, 1024 * 1024).toString("utf8");
    } catch {
      /* missing or planted: written again below */
    }
    const attributes = path.join(this.gitDir, "info", "attributes");
    let attrs = "";
    try {
      attrs = readOwnFile(attributes, 1024 * 1024).toString("utf8");
    } catch {
      /* written again below */
    }
    if (text !== SHADOW_CONFIG || attrs !== SHADOW_ATTRIBUTES || extra.length) {
      for (const f of extra) fs.rmSync(path.join(this.gitDir, f), { force: true, recursive: true });
      for (const f of [config, attributes]) fs.rmSync(f, { force: true, recursive: true });
      writeOwnFile(config, SHADOW_CONFIG);
      fs.mkdirSync(path.dirname(attributes), { recursive: true });
      writeOwnFile(attributes, SHADOW_ATTRIBUTES);
      if (this.settingsChecked !== undefined || text)
        this.tampered?.(
          `the checkpoint store's settings (${this.gitDir}) were changed by someone else; aic put its own back`,
        );
    }
    this.settingsChecked = identityOf(config);
  }

  /** Told when the store's settings had to be put back (see ensureOwnSettings). */
  tampered: ((text: string) => void) | undefined;

  /** Creates the repository (once) and writes what it must ignore (every time: the session's name may differ). */
  async prepare(): Promise<void> {
    if (!this.exists) {
      fs.mkdirSync(this.home, { recursive: true, mode: 0o700 });
      const { GIT_DIR: _dir, GIT_WORK_TREE: _tree, ...env } = this.env;
      // --template= : no sample hooks and no template directory from anyone's config.
      await this.gitOk(["init", "--quiet", "--bare", "--template=", "--initial-branch=aic", this.gitDir], { env });
      writeOwnFile(path.join(this.gitDir, "config"), SHADOW_CONFIG);
      fs.mkdirSync(path.join(this.gitDir, "info"), { recursive: true });
      writeOwnFile(path.join(this.gitDir, "info", "attributes"), SHADOW_ATTRIBUTES);
      writeOwnFile(path.join(this.home, "directory"), `${this.project.path}\n${this.workTree}\n`);
    }
    this.writeExcludes();
  }

  /**
   * aic's own files in the start directory (anchored there: an unanchored
   * `*.lock` would lose yarn.lock), the shadow repository itself when it lies
   * inside the tree, the project's .git/info/exclude and the person's global
   * ignore file (editor swap files).
   */
  private writeExcludes(): void {
    const anchored = (p: string) => `/${this.prefix}${p}`;
    const lines = ["# aic's own files", ...this.ownFiles.map(anchored)];
    // aic's whole state directory (this store, locks, saved outputs), should it lie inside the tree.
    const inside = path.relative(this.workTree, aicStateDir() ?? this.home);
    if (inside && !inside.startsWith("..") && !path.isAbsolute(inside)) lines.push(`/${inside}/`);
    const read = (file: string) => {
      try {
        return readOwnFile(file, 1024 * 1024).toString("utf8");
      } catch {
        return "";
      }
    };
    lines.push("# the project's .git/info/exclude", read(path.join(this.workTree, ".git", "info", "exclude")));
    const config = process.env.XDG_CONFIG_HOME || path.join(os.homedir(), ".config");
    lines.push("# the person's global ignore file", read(path.join(config, "git", "ignore")));
    fs.mkdirSync(path.join(this.gitDir, "info"), { recursive: true });
    writeOwnFile(path.join(this.gitDir, "info", "exclude"), `${lines.join("\n")}\n`);
  }

  private get lastStateFile(): string {
    return path.join(this.home, "last-state.json");
  }

  /**
   * What the last snapshot knew (its commit, the index's identity, the directories' stamps), for the next
   * run: its first snapshot of an unchanged tree is then one `git add`, as every later one is.
   */
  keepLastState(state: LastSnapshotState): void {
    const text = JSON.stringify(state);
    if (text === this.lastStateWritten) return;
    try {
      writeOwnFile(this.lastStateFile, text);
      this.lastStateWritten = text;
    } catch {
      /* the next run takes the long way once more */
    }
  }
  private lastStateWritten: string | undefined;

  /** What the last run's last snapshot knew, every field checked; undefined when there is none to trust. */
  lastState(): (LastSnapshotState & { index: string }) | undefined {
    let state: { commit?: unknown; index?: unknown; dirs?: unknown };
    try {
      state = JSON.parse(readOwnFile(this.lastStateFile, 64 * 1024 * 1024).toString("utf8")) as typeof state;
    } catch {
      return undefined;
    }
    if (typeof state.commit !== "string" || typeof state.index !== "string") return undefined;
    const entry = (d: unknown) =>
      Array.isArray(d) && d.length === 2 && typeof d[0] === "string" && Array.isArray(d[1]) && d[1].length === 2;
    const dirs =
      Array.isArray(state.dirs) && state.dirs.every(entry) ? (state.dirs as LastSnapshotState["dirs"]) : null;
    return { commit: state.commit, index: state.index, dirs };
  }

  /** Whether a run before this one left its state: the tree was counted and snapshotted then. */
  get snapshottedBefore(): boolean {
    return fs.existsSync(this.lastStateFile);
  }

  /**
   * Holds the repository for one operation: two aic processes in the same
   * directory take turns. Holding it, an index.lock or a half-written pack
   * can only be what a killed git left behind (a first snapshot stopped at
   * its time limit leaves a pack as big as what it had read of the tree,
   * every time aic starts there), and is removed.
   */
  lock(): () => void {
    const fd = openRegular(path.join(this.home, "aic.lock"), O.O_WRONLY | O.O_CREAT | O.O_APPEND);
    libc()?.symbols.flock(fd, LOCK_EX);
    fs.rmSync(path.join(this.gitDir, "index.lock"), { force: true });
    // Listed through a descriptor opened without following a link, like every path aic opens (the state
    // directory may be under /tmp); removing a name never follows one.
    const packs = path.join(this.gitDir, "objects", "pack");
    let dir = -1;
    try {
      dir = fs.openSync(packs, O.O_RDONLY | O.O_DIRECTORY | O.O_NOFOLLOW);
      for (const name of fs.readdirSync(`/proc/self/fd/${dir}`))
        if (name.startsWith("tmp_pack_") || name.startsWith("tmp_idx_"))
          fs.rmSync(path.join(packs, name), { force: true });
    } catch {
      /* no pack directory yet */
    } finally {
      if (dir >= 0) fs.closeSync(dir);
    }
    return () => fs.closeSync(fd);
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Checkpoints: files too big to keep
// Owns: the files a snapshot leaves out because one alone passes the per-file
// cap, found among the entries the kernel saw written, and said once each.
// ════════════════════════════════════════════════════════════════════════════

/** One file bigger than this (MB) is left out of checkpoints, unless AIC_CHECKPOINT_FILE_MAX_MB says otherwise. */
const CHECKPOINT_FILE_MAX_MB = 256;
/** A directory a command made is looked into for big files up to this many entries; past it, git lists them. */
const OVERSIZE_LOOK_LIMIT = 5_000;
/** More files than this over the cap and checkpoints go off, said, rather than keep a list without end. */
const MAX_LEFT_OUT = 10_000;

const checkpointFileCap = () => megabytesFromEnv("AIC_CHECKPOINT_FILE_MAX_MB", CHECKPOINT_FILE_MAX_MB);

/**
 * Paths under a held directory, each of its directories reached through a
 * descriptor that follows no link (a command may swap one for a link) and
 * kept open for the next path, until `close`.
 */
class HeldTree {
  private readonly held = new Map<string, HeldDirectory | undefined>();

  constructor(root: HeldDirectory) {
    this.held.set("", root);
  }

  /** The directory at `rel` ("" for the root), or undefined when a link or nothing is on the way. */
  dir(rel: string): HeldDirectory | undefined {
    if (this.held.has(rel)) return this.held.get(rel);
    const d = this.dir(HeldTree.parentOf(rel))?.child(path.posix.basename(rel));
    this.held.set(rel, d);
    return d;
  }

  /** What is at `rel`, the last name not followed. */
  lstat(rel: string): fs.Stats | undefined {
    const parent = this.dir(HeldTree.parentOf(rel));
    return parent && fs.lstatSync(parent.at(path.posix.basename(rel)), { throwIfNoEntry: false });
  }

  close(): void {
    for (const [rel, d] of this.held) if (rel) d?.close();
  }

  private static parentOf(rel: string): string {
    const up = path.posix.dirname(rel);
    return up === "." ? "" : up;
  }
}

/**
 * Files no snapshot takes: git reads every byte of a file it adds, so one
 * 30 GB sparse file (`truncate -s 30G`) would hold a snapshot for minutes,
 * past its time limit, and turn checkpoints off for the run. Such a file is
 * left out (an exclude pathspec, so no name can escape it) and said once; a
 * tracked file that grows past the cap leaves the index, so an undo keeps
 * its big version aside rather than overwrite it. What the kernel saw
 * written is looked at; when its record lost track, git lists what a
 * snapshot would read. A run's first snapshot reads every file as before.
 * The list is kept in the store, so a later run (`aic undo`) leaves out the
 * same files.
 */
class OversizedFiles {
  /** Each file left out (relative to the start directory), with its size when last seen. */
  private readonly left = new Map<string, number>();
  private loaded = false;
  warn: (text: string) => void = () => {};

  constructor(
    private readonly project: HeldDirectory,
    /** Where the list is kept, in the store. */
    private readonly file: string,
  ) {}

  /**
   * Looks at what was written (up to `budget` entries, directories made looked into) and at what was left
   * out before: the files newly left out, and whether the look covered everything it was given.
   */
  update(written: readonly string[], budget = OVERSIZE_LOOK_LIMIT): { fresh: string[]; complete: boolean } {
    this.load();
    const cap = checkpointFileCap();
    const fresh: string[] = [];
    const before = this.left.size;
    let complete = true;
    const held = new HeldTree(this.project);
    const look = (rel: string, depth: number) => {
      if (budget-- <= 0) return void (complete = false);
      const st = held.lstat(rel);
      if (st?.isDirectory()) {
        if (depth >= 32) return void (complete = false);
        for (const e of held.dir(rel)?.entries() ?? []) look(`${rel}/${e.name}`, depth + 1);
      } else if (st?.isFile() && st.size > cap && !this.left.has(rel)) {
        this.left.set(rel, st.size);
        fresh.push(rel);
      }
    };
    try {
      // A file left out before that shrank or went is taken again.
      for (const rel of this.left.keys()) {
        const st = held.lstat(rel);
        if (!st?.isFile() || st.size <= cap) this.left.delete(rel);
      }
      for (const rel of written) look(rel, 0);
    } finally {
      held.close();
    }
    if (this.left.size > MAX_LEFT_OUT)
      throw new Error(
        `more than ${MAX_LEFT_OUT.toLocaleString("en-US")} files are over the per-file cap of ${Math.round(cap / 1e6)} MB (AIC_CHECKPOINT_FILE_MAX_MB)`,
      );
    if (fresh.length) this.warn(this.said(fresh, cap));
    if (fresh.length || this.left.size !== before) this.save();
    return { fresh, complete };
  }

  /** Files written past the per-file cap are left out from now on; a tracked one leaves the index too. */
  async leaveOut(
    shadow: Pick<ShadowRepository, "gitOk" | "relative" | "prefix" | "pathspec">,
    written: string[] | "unknown" | undefined,
    afterFirst: boolean,
  ): Promise<void> {
    let { fresh, complete } = this.update(Array.isArray(written) ? written : []);
    // The kernel's record lost track, or a command wrote more than a look covers: git lists what an add would read.
    if (afterFirst && (written === "unknown" || !complete)) {
      const listed = await shadow.gitOk(["ls-files", "-z", "-o", "-m", "--exclude-standard", ...shadow.pathspec]);
      const rels = listed.split("\0").flatMap((p) => (p ? (shadow.relative(p) ?? []) : []));
      fresh = [...fresh, ...this.update(rels, Infinity).fresh];
    }
    if (fresh.length)
      await shadow.gitOk(["update-index", "-z", "--force-remove", "--stdin"], {
        input: `${fresh.map((rel) => `${shadow.prefix}${rel}`).join("\0")}\0`,
      });
  }
  /** The files left out (relative to the start directory). */
  names(): string[] {
    this.load();
    return [...this.left.keys()];
  }

  /** `:(exclude)` pathspecs for the files left out, as git names them (`prefix`: the start directory in the work tree). */
  excludes(prefix: string): string[] {
    this.load();
    return [...this.left.keys()].map((rel) => `:(top,literal,exclude)${prefix}${rel}`);
  }

  private load(): void {
    if (this.loaded) return;
    this.loaded = true;
    try {
      const kept: unknown = JSON.parse(readOwnFile(this.file, 64 << 20).toString("utf8"));
      for (const e of Array.isArray(kept) ? kept : [])
        if (Array.isArray(e) && typeof e[0] === "string" && typeof e[1] === "number") this.left.set(e[0], e[1]);
    } catch {
      /* none kept yet */
    }
  }

  private save(): void {
    try {
      if (this.left.size) writeOwnFile(this.file, JSON.stringify([...this.left]));
      else fs.rmSync(this.file, { force: true });
    } catch {
      /* a later run reads these files once more */
    }
  }

  private said(files: string[], cap: number): string {
    const gb = sizeInWords;
    const named = files.slice(0, 5).map((rel) => `${this.project.display(rel)} (${gb(this.left.get(rel) ?? 0)})`);
    const more = files.length > 5 ? ` and ${files.length - 5} more` : "";
    return `left out of checkpoints, each over ${gb(cap)} (AIC_CHECKPOINT_FILE_MAX_MB): ${named.join(", ")}${more}; undo neither removes nor brings back these files`;
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Checkpoints: the shadow repository
// Owns: the git repository of aic's own that snapshots the start directory: a
// snapshot (only where something was written, add, write-tree, a commit only
// when the tree changed), its size and pruning, and reading a checkpoint back.
// ════════════════════════════════════════════════════════════════════════════

/**
 * A git repository of aic's own that snapshots `workTree` (the project's
 * top when aic starts inside a repository, so every .gitignore applies as git
 * applies it; `prefix` then limits every snapshot to the start directory).
 */
class ShadowRepository {
  readonly gitDir: string;
  /** The start directory relative to the work tree, "" or "a/b/". */
  readonly prefix: string;
  private readonly env: Record<string, string>;
  /** The newest checkpoint, its tree and manifest, so an unchanged tree costs no commit. */
  private last: Snapshot | undefined;
  /**
   * The index file's identity (inode, size, times) when `last.tree` was
   * written from it. git replaces the index by rename whenever it changes
   * anything, so an `add -A` that leaves it identical staged nothing, and
   * the tree is `last.tree` without asking `write-tree`.
   */
  private indexAtLast: string | undefined;

  constructor(
    /** The start directory, held open: every snapshot and restore first checks that its path still leads there. */
    readonly project: HeldDirectory,
    readonly workTree: string,
    readonly home: string,
    ownFiles: string[],
  ) {
    this.gitDir = path.join(home, "git");
    const directory = project.path;
    this.prefix = workTree === directory ? "" : `${path.relative(workTree, directory).split(path.sep).join("/")}/`;
    this.env = shadowGitEnvironment(this.gitDir, workTree);
    this.runner = new ShadowGit(workTree, home, this.env);
    this.watch = new ChangeWatch(directory, ownFiles.map(writePattern));
    this.manifests = new SnapshotManifest(project, this.gitDir, (gitPath) => this.relative(gitPath));
    this.oversized = new OversizedFiles(project, path.join(home, "left-out.json"));
    this.files = new ShadowStoreFiles(project, this.gitDir, home, workTree, this.prefix, ownFiles, this.env, (a, o) =>
      this.gitOk(a, o),
    );
  }

  /** The store's settings, excludes and notes. */
  readonly files: ShadowStoreFiles;

  /** What git does not record of each snapshot, and the directories it looked at. */
  private readonly manifests: SnapshotManifest;

  /** What was written under the start directory since the last snapshot began: nothing, and git need not be asked. */
  private readonly watch: ChangeWatch;

  /** Files no snapshot takes, each over the per-file cap. */
  readonly oversized: OversizedFiles;

  private readonly runner: ShadowGit;

  get directory(): string {
    return this.project.path;
  }

  /**
   * The shadow repository of the held start directory:
   * `$XDG_STATE_HOME/aic/checkpoints/<hash of its real path>`, or, for a run
   * nobody can undo later (no session file), one of its own under
   * `…/aic/runs/`, removed when the run ends.
   */
  static of(project: HeldDirectory, ownFiles: string[], ephemeral = false): ShadowRepository {
    // The start directory comes from getcwd (or the session file's own directory), so it is already a real path.
    const real = path.resolve(project.path);
    let top: string | undefined;
    for (let d = real; ; d = path.dirname(d)) {
      if (fs.existsSync(path.join(d, ".git"))) {
        top = d;
        break;
      }
      if (path.dirname(d) === d) break;
    }
    const state = aicStateDir() ?? path.join(os.homedir(), ".local", "state", "aic");
    const hash = createHash("sha256").update(real).digest("hex").slice(0, 16);
    const home = ephemeral
      ? path.join(state, "runs", `${process.pid}-${randomName()}`)
      : path.join(state, "checkpoints", hash);
    // The store's snapshots are relative to the work tree it was made with: a `.git` a command made above the
    // project (`mkdir ../.git`) must not move them, or a restore would read every path under another prefix.
    const recorded = recordedWorkTree(home);
    if (recorded && (recorded === real || isBeneath(real, recorded))) top = recorded;
    const shadow = new ShadowRepository(project, top ?? real, home, ownFiles);
    // Kept where a run's own store is not: the next run, with a session or without, learns of it.
    shadow.files.givenUpFile = path.join(state, "checkpoints", `${hash}.given-up`);
    return shadow;
  }

  /** `git` with the shut-out environment, stdin closed (or fed), in the work tree, under a time limit. */
  git(args: string[], opts: GitOptions = {}): Promise<GitResult> {
    return this.runner.git(args, opts);
  }

  /** `git` whose output stays in an unnamed file of aic's own, read from its descriptor (the caller closes it). */
  gitToFile(args: string[], input: string): Promise<number> {
    return this.runner.gitToFile(args, input);
  }

  /** The same as `git`, throwing with git's own words when it fails. */
  gitOk(args: string[], opts: GitOptions = {}): Promise<string> {
    return this.runner.gitOk(args, opts);
  }

  /** Limits a command to the start directory (nothing when it is the work tree's top). */
  get pathspec(): string[] {
    const excludes = this.oversized.excludes(this.prefix);
    if (!this.prefix && !excludes.length) return [];
    return ["--", ...(this.prefix ? [`:(top,literal)${this.prefix}`] : []), ...excludes];
  }

  /**
   * How many files a first snapshot would take (ignore rules honoured),
   * stopping at `limit`; over the limit, or taking over `limitMs`, is "too big".
   */
  async countFiles(
    limit: number,
    limitMs: number,
  ): Promise<{ count: number; tooBig: boolean; top: [string, number][] }> {
    const emptyIndex = path.join(this.home, `count-${process.pid}.index`); // absent: every file counts as new
    const proc = spawnOwned(
      [gitProgram() ?? NO_TRUSTED_GIT, "ls-files", "-o", "--exclude-standard", "-z", ...this.pathspec],
      {
        cwd: this.workTree,
        env: { ...this.env, GIT_INDEX_FILE: emptyIndex },
        stdin: "ignore",
        stdout: "pipe",
        stderr: "ignore",
      },
    );
    let timedOut = false;
    const timer = setTimeout(() => ((timedOut = true), proc.kill("SIGKILL")), limitMs);
    let count = 0;
    // Per top-level directory of the start directory: where most of a big tree's files are (node_modules, say).
    const perDir = new Map<string, number>();
    let pending = "";
    for await (const chunk of proc.stdout) {
      const names = (pending + utf8Decoder.decode(chunk, { stream: true })).split("\0");
      pending = names.pop() ?? "";
      for (const name of names) {
        count++;
        const rel = this.relative(name);
        const slash = rel?.indexOf("/") ?? -1;
        if (rel && slash > 0) perDir.set(rel.slice(0, slash), (perDir.get(rel.slice(0, slash)) ?? 0) + 1);
      }
      if (count > limit) {
        proc.kill("SIGKILL");
        break;
      }
    }
    clearTimeout(timer);
    await proc.exited;
    const top = [...perDir].sort((a, b) => b[1] - a[1]).slice(0, 3);
    return { count, tooBig: count > limit || timedOut, top };
  }

  /**
   * One checkpoint of the tree as it is now; its commit. Unchanged files
   * cost only a stat (git's index), and an unchanged tree no commit at all.
   * The start directory must still be where it was, before and after: a
   * snapshot taken while a command swapped it for a link is thrown away, so
   * nothing read through the link stays in the store.
   */
  async snapshot(message: string, limitMs = GIT_TIME_LIMIT_MS, bulk = false): Promise<Snapshot> {
    this.ensureInPlace();
    // A first snapshot stores every file: streamed into one pack instead of a file per object, it is several
    // times faster on a busy disk (measured: 0.58 s against 2.67 s for 5,000 files). Later ones store a few
    // files, where loose objects are cheaper than a new pack each time.
    const bulkCheckIn = bulk ? ["-c", "core.bigFileThreshold=1"] : [];
    if (!this.last) await this.resumeLastState();
    if (this.last && this.watch.quiet()) {
      await this.confirmInPlace(undefined);
      return this.last;
    }
    await this.oversized.leaveOut(this, this.watch.written(), this.last !== undefined);
    // Only where something was written is looked at again (a directory's pathspec takes its whole subtree).
    const scope = this.last ? this.scopedPathspec(this.watch.scope()) : undefined;
    this.watch.restart();
    try {
      return await this.snapshotWithGit(message, limitMs, bulkCheckIn, scope);
    } catch (error) {
      this.watch.restart(true);
      throw error;
    }
  }

  /** `-- :(top,literal)DIR…` for the directories that still exist; undefined (the whole tree) when none does. */
  private scopedPathspec(dirs: string[] | undefined): string[] | undefined {
    const present = (dirs ?? []).filter((rel) =>
      fs.lstatSync(this.project.at(rel), { throwIfNoEntry: false })?.isDirectory(),
    );
    if (!present.length) return undefined;
    return [
      "--",
      ...present.map((rel) => `:(top,literal)${this.prefix}${rel}`),
      ...this.oversized.excludes(this.prefix),
    ];
  }

  private async snapshotWithGit(
    message: string,
    limitMs: number,
    bulkCheckIn: string[],
    scope?: string[],
  ): Promise<Snapshot> {
    this.files.ensureOwnSettings();
    const add = await this.git(
      [...bulkCheckIn, "add", "-A", "--ignore-errors", "--verbose", ...(scope ?? this.pathspec)],
      {
        limitMs,
      },
    );
    if (add.timedOut) throw new Error(`taking the snapshot took longer than ${limitMs / 1000} s`);
    // --ignore-errors stages everything it can; a nested repository (a clone, a submodule) needs its files listed.
    if (add.code !== 0 || add.stderr) await this.includeNestedRepositories();
    // git rewrites the index whenever a file's content, mode or directory changed: the same index, and the
    // same directories (an empty one made or removed leaves the index as it was), are the same checkpoint.
    const dirsAsBefore = this.manifests.dirsUnchanged();
    if (this.last && this.indexAtLast !== undefined && this.indexIdentity() === this.indexAtLast && dirsAsBefore) {
      await this.confirmInPlace(undefined);
      this.coverWatch();
      return this.last;
    }
    const tree = (await this.gitOk(["write-tree"])).trim();
    // A changed .gitignore may show or hide empty directories whose parents did not change.
    const ignoresChanged = /\.gitignore'?\s*$/m.test(add.stdout.toString("utf8"));
    const manifest = await this.manifests.make(dirsAsBefore && !ignoresChanged ? this.last : undefined, () =>
      this.gitOk(["ls-files", "-z", "-o", "--directory", "--exclude-standard", ...this.pathspec]),
    );
    if (!this.last) {
      const head = await this.git(["rev-parse", "--verify", "-q", `${LAST_CHECKPOINT_REF}^{commit}`]);
      const commit = head.code === 0 ? head.stdout.toString().trim() : "";
      if (commit) this.last = await this.snapshotOf(commit);
    }
    const same = this.last?.tree === tree && this.last.manifest === manifest;
    const made = same ? this.last! : await this.commit(tree, message, manifest);
    // Read after write-tree, which may have stored its cache in the index.
    this.indexAtLast = this.indexIdentity();
    await this.confirmInPlace(same ? undefined : made);
    this.keepLastState(made);
    this.coverWatch();
    return made;
  }

  /** The watch covers every directory the manifest knows: each holding a file of the index, and the empty ones. */
  private coverWatch(): void {
    if (this.manifests.cut) return this.watch.restart(true);
    // The manifest's directories: every one holding a file of the index, and each the empty-directory search entered.
    if (this.manifests.stamps) this.watch.cover(this.manifests.stamps.keys());
    // In a repository above the start directory, git reads the .gitignore files of every directory between.
    const up = this.prefix
      .split("/")
      .filter(Boolean)
      .map((_, i) =>
        Array(i + 1)
          .fill("..")
          .join("/"),
      );
    this.watch.cover(up);
  }

  /** The state the next run resumes from (see ShadowStoreFiles.keepLastState). */
  private keepLastState(made: Snapshot): void {
    const dirs = this.manifests.stamps ? [...this.manifests.stamps] : null;
    this.files.keepLastState({ commit: made.commit, index: this.indexAtLast, dirs });
  }

  /** A run's first snapshot: the last one's state, when the store's newest checkpoint is still the one it names. */
  private async resumeLastState(): Promise<void> {
    const state = this.files.lastState();
    if (!state) return;
    const head = await this.git(["rev-parse", "--verify", "-q", `${LAST_CHECKPOINT_REF}^{commit}`]);
    if (head.code !== 0 || head.stdout.toString().trim() !== state.commit) return;
    this.last = await this.snapshotOf(state.commit);
    this.indexAtLast = state.index;
    if (state.dirs) this.manifests.stamps = new Map(state.dirs);
  }

  /** Throws ProjectMoved when the start directory's path no longer leads to the directory aic holds. */
  ensureInPlace(): void {
    const why = this.project.whyNotAtPath();
    if (why) throw new ProjectMoved(why);
  }

  /**
   * After a git call that read the tree: if the directory was swapped
   * meanwhile, the snapshot `made` (if new) is dropped and its objects are
   * collected, so what git may have read through a link is not kept.
   */
  private async confirmInPlace(made: Snapshot | undefined): Promise<void> {
    const why = this.project.whyNotAtPath();
    if (!why) return;
    this.last = undefined;
    this.indexAtLast = undefined;
    if (made) {
      const refs = (await this.gitOk(["for-each-ref", "--format=%(refname)", `--points-at=${made.commit}`])).split(
        "\n",
      );
      await this.git(["update-ref", "--stdin", "-z"], {
        input: refs
          .filter(Boolean)
          .map((r) => `delete ${r}\0\0`)
          .join(""),
      });
    }
    // The index holds what add -A staged through the link: emptied, and every object no ref reaches removed.
    await this.git(["read-tree", "--empty"]);
    await this.git(["gc", "--quiet", "--prune=now"]);
    throw new ProjectMoved(why);
  }

  /** A path git printed (relative to its work tree) as a path relative to the start directory, or undefined outside it. */
  relative(gitPath: string): string | undefined {
    if (!gitPath.startsWith(this.prefix)) return undefined;
    const rel = gitPath.slice(this.prefix.length);
    return safeRelativePath(rel) ? rel : undefined;
  }

  /** A checkpoint commit as a snapshot: its tree and the manifest in its message. */
  /** The paths (relative to the start directory) whose content or kind differs between two checkpoints. */
  async changedPaths(from: string, to: string): Promise<Set<string>> {
    try {
      const raw = await this.gitOk(["diff-tree", "-r", "-z", "--no-renames", "--name-only", from, to]);
      return new Set(raw.split("\0").flatMap((p) => this.relative(p) ?? []));
    } catch {
      return new Set(); // a checkpoint the store no longer holds: nothing is known to be the person's
    }
  }

  async snapshotOf(commit: string): Promise<Snapshot> {
    // A commit never changes: each is read from the store once (a step that changed nothing read two, twice).
    const known = this.snapshots.get(commit);
    if (known) return known;
    const body = await this.gitOk(["cat-file", "commit", commit]);
    const tree = /^tree ([0-9a-f]+)$/m.exec(body)?.[1] ?? "";
    const at = body.indexOf(`\n${MANIFEST_HEADING}\n`);
    const manifest = at < 0 ? "" : body.slice(at + MANIFEST_HEADING.length + 2).replace(/\n$/, "");
    return this.remember({ commit, tree, manifest });
  }

  private remember(snapshot: Snapshot): Snapshot {
    if (this.snapshots.size >= SNAPSHOT_CACHE_ENTRIES) this.snapshots.delete(this.snapshots.keys().next().value!);
    this.snapshots.set(snapshot.commit, snapshot);
    return snapshot;
  }

  /** Snapshots read or made, by commit (bounded: a manifest can be long). */
  private readonly snapshots = new Map<string, Snapshot>();

  private indexIdentity(): string | undefined {
    return identityOf(path.join(this.gitDir, "index"));
  }

  /** A parentless commit of `tree` (its manifest in the message) with a ref of its own (dropping the ref frees it), made the newest. */
  async commit(tree: string, message: string, manifest: string): Promise<Snapshot> {
    this.indexAtLast = undefined;
    const text = manifest ? `${message}\n\n${MANIFEST_HEADING}\n${manifest}\n` : `${message}\n`;
    const ref = `${CHECKPOINT_REF}${String(Date.now()).padStart(14, "0")}-${process.pid}-${randomName()}`;
    let commit = writeCheckpointCommit(this.gitDir, tree, text, [ref, LAST_CHECKPOINT_REF]);
    if (!commit) {
      commit = (await this.gitOk(["commit-tree", "--no-gpg-sign", tree, "-F", "-"], { input: text })).trim();
      await this.gitOk(["update-ref", "--stdin", "-z"], {
        input: `update ${ref}\0${commit}\0\0update ${LAST_CHECKPOINT_REF}\0${commit}\0\0`,
      });
    }
    this.last = { commit, tree, manifest };
    this.remember(this.last);
    return this.last;
  }

  /**
   * A repository inside the tree is recorded by `add -A` as a bare commit
   * pointer (useless for undo), or refused when it has no commit yet. Its
   * files are listed through the shadow git instead (its own config and
   * hooks are never read, its .git never stored), and so are those of the
   * repositories inside it, to any depth; `add -A` then descends into them
   * like any directory. No pointer is left in the index: for one there, the
   * next `add -A` runs `git status` inside that repository, with its config
   * (a core.fsmonitor a command put there ran outside the sandbox).
   */
  private async includeNestedRepositories(): Promise<void> {
    const found = new Set<string>();
    for (const entry of (await this.gitOk(["ls-files", "-s", "-z"])).split("\0"))
      if (entry.startsWith("160000 ")) found.add(entry.slice(entry.indexOf("\t") + 1));
    for (const p of (await this.gitOk(["ls-files", "-o", "--exclude-standard", "-z", ...this.pathspec])).split("\0"))
      if (p.endsWith("/")) found.add(p.slice(0, -1));
    if (found.size === 0) return;
    await this.dropGitlinks([...found]);
    const queue = [...found];
    for (let listed = 0; queue.length && listed < MAX_NESTED_REPOSITORIES; listed++) {
      const dir = queue.shift()!;
      const index = path.join(this.home, `nested-${process.pid}.index`);
      const env = { ...this.env, GIT_WORK_TREE: path.join(this.workTree, dir), GIT_INDEX_FILE: index };
      const listing = (await this.gitOk(["ls-files", "-o", "--exclude-standard", "-z"], { env })).split("\0");
      fs.rmSync(index, { force: true });
      // A repository inside this one is listed as its directory: its files are listed in turn.
      for (const f of listing) if (f.endsWith("/")) queue.push(`${dir}/${f.slice(0, -1)}`);
      const files = listing.filter((f) => f && !f.endsWith("/"));
      if (files.length)
        await this.gitOk(["update-index", "--add", "-z", "--stdin"], {
          input: `${files.map((f) => `${dir}/${f}`).join("\0")}\0`,
        });
    }
    await this.git(["add", "-A", "--ignore-errors", ...this.pathspec]);
    // What add made a pointer of again (past the limit, or a repository with no file) leaves the index.
    const left = (await this.gitOk(["ls-files", "-s", "-z"]))
      .split("\0")
      .filter((e) => e.startsWith("160000 "))
      .map((e) => e.slice(e.indexOf("\t") + 1));
    if (left.length) await this.dropGitlinks(left);
  }

  private async dropGitlinks(paths: string[]): Promise<void> {
    await this.gitOk(["update-index", "-z", "--force-remove", "--stdin"], { input: `${paths.join("\0")}\0` });
  }

  /** Drops all but the newest CHECKPOINTS_KEPT checkpoints and collects their objects, once they pile up. */
  /** Bytes the store's objects take (loose and packed), as git counts them. */
  async storeBytes(): Promise<number> {
    const out = await this.gitOk(["count-objects", "-v"]);
    const kib = (key: string) => Number(new RegExp(`^${key}: (\\d+)`, "m").exec(out)?.[1] ?? 0);
    return (kib("size") + kib("size-pack") + kib("size-garbage")) * 1024;
  }

  /** Every checkpoint but those in `keep` dropped, and what no ref reaches any more removed. */
  async pruneAllBut(keep: Set<string>): Promise<void> {
    const refs = (await this.gitOk(["for-each-ref", "--format=%(refname) %(objectname)", CHECKPOINT_REF]))
      .split("\n")
      .filter(Boolean);
    const drop = refs.filter((r) => !keep.has(r.split(" ")[1]!));
    if (drop.length)
      await this.gitOk(["update-ref", "--stdin", "-z"], {
        input: drop.map((r) => `delete ${r.split(" ")[0]}\0\0`).join(""),
      });
    await this.gitOk(["gc", "--quiet", "--prune=now"]);
  }

  async pruneIfNeeded(keep: Set<string>): Promise<void> {
    const refs = (await this.gitOk(["for-each-ref", "--format=%(refname) %(objectname)", CHECKPOINT_REF]))
      .split("\n")
      .filter(Boolean)
      .sort();
    if (refs.length <= CHECKPOINTS_KEPT + CHECKPOINTS_KEPT / 2) return;
    const drop = refs.slice(0, refs.length - CHECKPOINTS_KEPT).filter((r) => !keep.has(r.split(" ")[1]!));
    await this.gitOk(["update-ref", "--stdin", "-z"], {
      input: drop.map((r) => `delete ${r.split(" ")[0]}\0\0`).join(""),
    });
    await this.gitOk(["gc", "--quiet", "--prune=now"]);
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Checkpoints: what a session records of them
// Owns: the list of checkpoints the session keeps (so undo works after a
// resume or a kill -9), read back with every field checked, and the limits of
// an undo. Used by the TUI's /undo and /redo and by `aic undo` / `aic redo`.
// ════════════════════════════════════════════════════════════════════════════

/** One command that ran, and the checkpoint of the files just before it. */
interface CheckpointStep {
  commit: string;
  /** The tool call that ran it: the conversation is cut back to the assistant turn holding it. */
  call: string;
  command: string;
  /** The checkpoint just after it ran: what it changed is the difference (absent for a command still running, or a kill -9). */
  after?: string;
}

/** What one command did to the files of the start directory (paths relative to it; an empty directory ends in /). */
interface ChangedFiles {
  created: string[];
  modified: string[];
  deleted: string[];
}

/** An undo that can be redone: the files as they were before it, the steps it undid, the messages it cut. */
interface RedoEntry {
  commit: string;
  steps: CheckpointStep[];
  messages: Message[];
  /** The snapshot the undo left the files in: what differs from it when redoing is the person's. */
  left?: string;
}

/** What a session file keeps of the checkpoints. */
interface CheckpointRecord {
  directory: string;
  done: CheckpointStep[];
  redo: RedoEntry[];
}

/**
 * The checkpoints of a session file, if they are well formed. The file may
 * have been edited by hand: a malformed record is dropped (and said), which
 * only costs the undo list, never the conversation.
 */
function checkpointRecordFrom(raw: unknown, reports: string[]): CheckpointRecord | undefined {
  if (raw === undefined) return undefined;
  const isCommit = (c: unknown) => typeof c === "string" && /^[0-9a-f]{40,64}$/.test(c);
  const isStep = (s: unknown): s is CheckpointStep => {
    const o = s as Record<string, unknown> | null;
    return (
      !!o &&
      isCommit(o.commit) &&
      typeof o.call === "string" &&
      typeof o.command === "string" &&
      (o.after === undefined || isCommit(o.after))
    );
  };
  const o = raw as Record<string, unknown> | null;
  const redo = Array.isArray(o?.redo) ? (o.redo as Record<string, unknown>[]) : undefined;
  const ok =
    !!o &&
    typeof o.directory === "string" &&
    Array.isArray(o.done) &&
    o.done.every(isStep) &&
    !!redo &&
    redo.every(
      (r) =>
        isStep({ ...r, call: "", command: "" }) &&
        Array.isArray(r.steps) &&
        r.steps.every(isStep) &&
        Array.isArray(r.messages),
    );
  if (ok) return o as unknown as CheckpointRecord;
  reports.push("the `checkpoints` entry is not what aic writes, so it was dropped: earlier commands cannot be undone");
  return undefined;
}

/** What a restore changed, relative to the start directory. */
interface RestoreReport {
  restored: string[];
  recreated: string[];
  removed: string[];
  /** Paths that could not be put back, and why (something aic never snapshotted is in the way). */
  skipped: string[];
  /** Versions no snapshot held that the restore would have overwritten: moved aside first, each "path → where". */
  keptAside?: string[];
  /** Files left out of checkpoints as too big, left as they are. */
  leftOut?: string[];
}

/** The note every undo and redo ends with: what checkpoints cannot cover. */
const undoLimits = (directory: string) =>
  `Not covered: files outside ${directory}, ignored files (node_modules/, …), and effects beyond files (network calls, databases, the project's git history).`;

// ════════════════════════════════════════════════════════════════════════════
// Checkpoints: undo and redo
// Owns: one conversation's checkpoints of one start directory: taken before and
// after each command, undone and redone by whole commands, and off, with the
// reason said once, when they cannot work.
// ════════════════════════════════════════════════════════════════════════════

/**
 * The checkpoints of one start directory for one conversation: taken
 * before and after each command, undone and redone by whole commands. Off
 * (with the reason said once) when git is missing, the tree is too big, the
 * first snapshot too slow, a snapshot fails, or the start directory's path
 * no longer leads to it; the run goes on without them.
 */
class Checkpoints {
  done: CheckpointStep[] = [];
  redo: RedoEntry[] = [];
  /** Why checkpoints are off, once they are. */
  off: string | undefined;
  private ready = false;

  /** Stops the commands' processes while a snapshot reads the tree; calling what it returns resumes them. */
  freeze: () => () => void = () => () => {};
  /** Where news that is not a problem goes (a first snapshot still being taken, then done). */
  notice: (text: string) => void = (text) => this.warn(text);

  /** Takes the run's first snapshot ahead of the first command (its checkpoint, when nothing changes meanwhile). */
  warmUp(): void {
    void this.take("start");
  }

  constructor(
    readonly shadow: ShadowRepository,
    private readonly warn: (text: string) => void,
  ) {
    shadow.files.tampered = warn;
    shadow.oversized.warn = warn;
  }

  /** The checkpoints of the held start directory; aic's own files there (the session, its locks and backups) are never in them. */
  static forDirectory(
    project: HeldDirectory,
    sessionFile: string | undefined,
    warn: (text: string) => void,
    ephemeral = false,
  ): Checkpoints {
    const own = [".aicsession*", "..aicsession*.tmp", "commander-debug.txt", ".commander-debug.txt.*.tmp"];
    const rel = sessionFile ? path.relative(path.resolve(project.path), path.resolve(sessionFile)) : "..";
    if (rel && !rel.startsWith("..") && !path.isAbsolute(rel)) {
      // The session anywhere in the tree (--session sub/s.json): its file, lock and temporaries are aic's own.
      const escape = (s: string) => s.replace(/[*?[\\]/g, "\\$&");
      const dir = path.dirname(rel) === "." ? "" : `${escape(path.dirname(rel))}/`;
      const name = escape(path.basename(rel));
      own.push(`${dir}${name}*`, `${dir}.${name}*.tmp`);
    }
    return new Checkpoints(ShadowRepository.of(project, own, ephemeral), warn);
  }

  /** The run ends: a store of the run's own (no session file) is removed; a directory's shared store stays. */
  dispose(): void {
    this.shadow.files.removeIfEphemeral();
  }

  adopt(record: CheckpointRecord | undefined): void {
    if (!record || record.directory !== this.shadow.directory) return;
    this.done = record.done;
    this.redo = record.redo;
  }

  record(): CheckpointRecord | undefined {
    if (this.done.length === 0 && this.redo.length === 0) return undefined;
    return { directory: this.shadow.directory, done: this.done, redo: this.redo };
  }

  private turnOff(reason: string): void {
    this.off = reason;
    this.warn(`checkpoints are off: ${reason}; commands still run, but /undo and aic undo cannot put files back`);
  }

  /** The first time: git must be there, the tree not too big; the first snapshot must be quick. */
  private async start(): Promise<boolean> {
    if (this.ready) return true;
    if (!gitProgram())
      return (this.turnOff("git was not found on PATH, outside the directories commands may write"), false);
    this.shadow.ensureInPlace();
    const earlier = this.shadow.files.givenUpBefore();
    if (earlier) {
      const when = new Date(earlier.at).toISOString().slice(0, 16).replace("T", " ");
      return (
        this.turnOff(
          `${earlier.why} (found by an earlier run, ${when} UTC; tried again a day later, or at once if you delete ${this.shadow.files.givenUpFile})`,
        ),
        false
      );
    }
    await this.shadow.files.prepare();
    // A tree an earlier run snapshotted was counted then: its next first step is one `git add`, not a count.
    if (this.shadow.files.snapshottedBefore) return (this.ready = true);
    const counted = await this.shadow.countFiles(MAX_CHECKPOINT_FILES, FIRST_SNAPSHOT_LIMIT_MS);
    this.counted = counted;
    if (counted.tooBig) {
      const why =
        counted.count > MAX_CHECKPOINT_FILES
          ? `${this.shadow.directory} holds more than ${MAX_CHECKPOINT_FILES} files that are not ignored${this.bigDirectories()}`
          : `counting the files of ${this.shadow.directory} took over ${FIRST_SNAPSHOT_LIMIT_MS / 1000} s`;
      return (this.giveUp(why), false);
    }
    this.ready = true;
    return true;
  }

  /** One snapshot under the shadow repository's lock; a failure (or a moved directory) turns checkpoints off. */
  /** Snapshots of this process one at a time: the store's lock is a blocking flock, which a second would wait on for ever. */
  private queue: Promise<unknown> = Promise.resolve();

  private take(message: string): Promise<Snapshot | undefined> {
    const next = this.queue.then(() => this.takeNow(message));
    this.queue = next.catch(() => undefined);
    return next;
  }

  private async takeNow(message: string): Promise<Snapshot | undefined> {
    if (this.off || this.firstRun) return undefined;
    const first = !this.firstTaken;
    try {
      if (!(await this.start())) return undefined;
      const release = this.shadow.files.lock();
      const thaw = this.freeze();
      let handedOver = false;
      try {
        if (!first) return await this.shadow.snapshot(message);
        this.firstTaken = true;
        const made = await this.firstSnapshot(message, () => {
          handedOver = true;
          thaw();
          return release;
        });
        if (made) await this.shadow.pruneIfNeeded(this.keptCommits());
        return made;
      } finally {
        if (!handedOver) {
          thaw();
          release();
        }
      }
    } catch (error) {
      const why = (error as Error).message;
      this.turnOff(
        error instanceof ProjectMoved
          ? `${why}, so aic no longer snapshots or restores anything there`
          : first && /longer than/.test(why)
            ? `the first snapshot took over ${FIRST_SNAPSHOT_LIMIT_MS / 1000} s`
            : `a snapshot failed (${why})`,
      );
      return undefined;
    }
  }

  /** Before a command runs: a checkpoint of the files, recorded against its tool call. */
  async beforeCommand(call: string, command: string): Promise<void> {
    const made = await this.take(`before: ${oneLine(command, 200)}`);
    if (!made) return;
    this.done.push({ commit: made.commit, call, command });
    this.redo = []; // a new command forks the history: what was undone stays undone
    if (this.done.length > CHECKPOINTS_KEPT) this.done.splice(0, this.done.length - CHECKPOINTS_KEPT);
  }

  /** After the command of `call` ran: the checkpoint after it, and what it changed (undefined when checkpoints are off). */
  async afterCommand(call: string): Promise<ChangedFiles | undefined> {
    const step = this.done.at(-1);
    if (!step || step.call !== call) return undefined;
    const made = await this.take(`after: ${oneLine(step.command, 200)}`);
    if (!made) return undefined;
    step.after = made.commit;
    let changed: ChangedFiles | undefined;
    try {
      changed = await this.changesOf(step);
    } catch (error) {
      this.warn(`could not list what the command changed: ${(error as Error).message}`);
    }
    if (made.commit !== step.commit && this.storeMayHaveGrown(changed)) await this.keepUnderCap();
    return changed;
  }

  /**
   * The rules files (named `name`) the command of `call` created, changed or deleted, each with the text it held
   * before the command ("" when there was none): what the person's rules there were.
   */
  async rulesWritten(call: string, changed: ChangedFiles, name: string): Promise<{ file: string; before: string }[]> {
    const step = this.done.findLast((s) => s.call === call);
    const out: { file: string; before: string }[] = [];
    for (const rel of [...changed.created, ...changed.modified, ...changed.deleted]) {
      if (path.basename(rel) !== name) continue;
      let before = "";
      if (step && !changed.created.includes(rel))
        before = await this.shadow
          .gitOk(["cat-file", "blob", `${step.commit}:${this.shadow.prefix}${rel}`])
          .catch(() => "");
      out.push({ file: path.join(this.shadow.directory, rel), before: before.slice(0, MAX_RULES_BYTES) });
    }
    return out;
  }

  /** What commands wrote since the store's size was last asked (a git process): asked again past a megabyte, or every 32 changes. */
  private grownBytes = 0;
  private grownSteps = 0;

  private storeMayHaveGrown(changed: ChangedFiles | undefined): boolean {
    for (const rel of changed ? [...changed.created, ...changed.modified] : [])
      this.grownBytes += fs.lstatSync(path.join(this.shadow.directory, rel), { throwIfNoEntry: false })?.size ?? 0;
    this.grownSteps++;
    if (changed && this.grownBytes < 1 << 20 && this.grownSteps < 32) return false;
    this.grownBytes = 0;
    this.grownSteps = 0;
    return true;
  }

  /**
   * The store stays under its cap (AIC_CHECKPOINT_STORE_MAX_MB, default CHECKPOINT_STORE_MAX_MB): a command
   * that writes and deletes big files would otherwise grow it for good, where no command can delete it.
   * Other runs' checkpoints go first, then this conversation's oldest commands (said once); a store over
   * its cap with only the last command's checkpoints turns checkpoints off.
   */
  private async keepUnderCap(): Promise<void> {
    const cap = checkpointStoreCap();
    const lock = this.shadow.files.lock();
    try {
      if ((await this.shadow.storeBytes()) <= cap) return;
      await this.shadow.pruneAllBut(this.keptCommits());
      let dropped = 0;
      while ((await this.shadow.storeBytes()) > cap && this.done.length > 1) {
        this.done.shift();
        this.redo = [];
        dropped++;
        await this.shadow.pruneAllBut(this.keptCommits());
      }
      const mb = (bytes: number) => `${Math.round(bytes / 1e6)} MB`;
      if (dropped)
        this.warn(
          `the checkpoint store passed its cap of ${mb(cap)} (AIC_CHECKPOINT_STORE_MAX_MB): the oldest ${dropped} command(s) of this conversation can no longer be undone`,
        );
      const left = await this.shadow.storeBytes();
      if (left > cap)
        this.turnOff(
          `the checkpoint store holds ${mb(left)}, over its cap of ${mb(cap)}, with only the last command's checkpoints`,
        );
    } finally {
      lock();
    }
  }

  /** What one recorded command changed: its checkpoint before against the one after. */
  async changesOf(step: CheckpointStep): Promise<ChangedFiles> {
    if (!step.after)
      throw new Error("there is no checkpoint after this command (it was still running, or aic was killed)");
    const changed: ChangedFiles = { created: [], modified: [], deleted: [] };
    // The same checkpoint before and after: the command changed nothing, and git need not be asked.
    if (step.commit === step.after) return changed;
    const [before, after] = await Promise.all([
      this.shadow.snapshotOf(step.commit),
      this.shadow.snapshotOf(step.after),
    ]);
    const entries = await this.shadow.gitOk([
      "diff-tree",
      "-r",
      "-z",
      "--no-renames",
      "--name-status",
      before.tree,
      after.tree,
    ]);
    const parts = entries.split("\0");
    for (let i = 0; i + 1 < parts.length; i += 2) {
      const rel = this.shadow.relative(parts[i + 1]!);
      if (rel === undefined) continue;
      (parts[i] === "A" ? changed.created : parts[i] === "D" ? changed.deleted : changed.modified).push(rel);
    }
    // Permission bits git does not record, and empty directories.
    const was = parseManifest(before.manifest);
    const now = parseManifest(after.manifest);
    const touched = new Set([...changed.created, ...changed.modified, ...changed.deleted]);
    for (const rel of new Set([...was.modes.keys(), ...now.modes.keys()]))
      if (!touched.has(rel) && was.modes.get(rel) !== now.modes.get(rel)) changed.modified.push(rel);
    for (const dir of now.dirs) if (!was.dirs.has(dir)) changed.created.push(`${dir}/`);
    for (const dir of was.dirs) if (!now.dirs.has(dir)) changed.deleted.push(`${dir}/`);
    for (const list of Object.values(changed)) list.sort();
    return changed;
  }

  /** The unified diff of what the N-th last command changed (binary files named, not dumped). */
  async diffOf(n: number, color: boolean): Promise<string> {
    const withAfter = this.done.filter((s) => s.after);
    const step = withAfter[withAfter.length - n];
    if (!step)
      throw new Error(
        withAfter.length === 0
          ? this.off
            ? `checkpoints are off: ${this.off}`
            : "no command has run with checkpoints yet"
          : `only ${withAfter.length} command(s) have a recorded change`,
      );
    const relative = this.shadow.prefix ? [`--relative=${this.shadow.prefix}`] : [];
    const args = ["diff", "--no-ext-diff", "--no-textconv", `--color=${color ? "always" : "never"}`, ...relative];
    const text = await this.shadow.gitOk([...args, step.commit, step.after!, ...this.shadow.pathspec]);
    const changed = await this.changesOf(step);
    // Read without colour: on a terminal the header's escape codes sit between the name and its line end.
    const plain = color ? text.replace(/\x1b\[[0-9;]*m/g, "") : text;
    const modesOnly = changed.modified.filter((f) => !plain.includes(` b/${f}\n`));
    const dirs = [...changed.created, ...changed.deleted].filter((f) => f.endsWith("/"));
    const notes = [
      ...modesOnly.map((f) => `(permissions of ${f} changed)`),
      ...dirs.map((d) => `(empty directory ${d} ${changed.created.includes(d) ? "created" : "removed"})`),
    ];
    const head = `# ${oneLine(step.command, 200)}\n`;
    return head + (text || notes.length ? text + notes.map((l) => `${l}\n`).join("") : "(no files changed)\n");
  }

  /**
   * The first snapshot writes every file once. Right after a tree was
   * written (a checkout, an unpacked archive) a busy disk can make that slow
   * once, so one more try is given: git keeps what the first one stored.
   */
  /** The first snapshot of this run while it outlasts FIRST_SNAPSHOT_LIMIT_MS: commands run without checkpoints until it ends. */
  private firstRun: Promise<Snapshot> | undefined;
  private firstTaken = false;

  /**
   * The run's first snapshot. A big tree's can take seconds (every file read and stored once): the first
   * command waits FIRST_SNAPSHOT_LIMIT_MS at most, then runs without a checkpoint while the snapshot goes on
   * in the background (holding the store's lock: `handOver` thaws the jobs and returns the release), and
   * checkpoints start with the first command after it ends. Later runs start from it: the cost is paid once.
   */
  private async firstSnapshot(message: string, handOver: () => () => void): Promise<Snapshot | undefined> {
    const run = this.shadow.snapshot(message, FIRST_SNAPSHOT_BACKGROUND_MS, true);
    let timer: ReturnType<typeof setTimeout> | undefined;
    const late = new Promise<"late">((resolve) => (timer = setTimeout(() => resolve("late"), FIRST_SNAPSHOT_LIMIT_MS)));
    const made = await Promise.race([run, late]).finally(() => clearTimeout(timer));
    if (made !== "late") return made;
    const release = handOver();
    const started = Date.now();
    this.firstRun = run;
    this.notice(
      `checkpoints: the first snapshot of ${this.shadow.directory} takes a while${this.bigDirectories()}; commands run without checkpoints until it is done, and later runs start from it (a run that ends first stops it, and the next run takes it again)`,
    );
    run
      .then(
        () =>
          this.notice(
            `checkpoints: on from the next command (the first snapshot took ${((Date.now() - started + FIRST_SNAPSHOT_LIMIT_MS) / 1000).toFixed(1)} s)`,
          ),
        (error: Error) =>
          this.giveUp(
            `the first snapshot failed or took over ${FIRST_SNAPSHOT_BACKGROUND_MS / 60000} minutes (${error.message})`,
          ),
      )
      .finally(() => {
        this.firstRun = undefined;
        release();
      });
    return undefined;
  }

  /** " (N of its M files … are in node_modules/: …)" when one directory holds most of what is not ignored. */
  private bigDirectories(): string {
    const top = this.counted?.top ?? [];
    const total = this.counted?.count ?? 0;
    const [dir, n] = top[0] ?? ["", 0];
    if (total < 1000 || n * 2 < total) return "";
    return ` (${n.toLocaleString("en-US")} of its ${total.toLocaleString("en-US")} files that are not ignored are in ${dir}/: add it to .gitignore to leave it out)`;
  }

  /** What the count at start found: the number of files not ignored, and the top-level directories holding most. */
  private counted: { count: number; top: [string, number][] } | undefined;

  /** Checkpoints off for this tree, and remembered for a day so later runs do not pay for finding out again. */
  private giveUp(why: string): void {
    this.shadow.files.rememberGivenUp(why);
    this.turnOff(why);
  }

  private keptCommits(): Set<string> {
    return new Set([
      ...this.done.flatMap((s) => (s.after ? [s.commit, s.after] : [s.commit])),
      ...this.redo.map((r) => r.commit),
    ]);
  }

  /** Why nothing can be undone now, or undefined. */
  cannotUndo(n: number): string | undefined {
    if (this.firstRun) return "the first snapshot of the tree is still being taken; try again once it is done";
    if (this.done.length === 0)
      return this.off ? `checkpoints are off: ${this.off}` : "nothing to undo: no command has run with a checkpoint";
    if (n > this.done.length) return `only ${this.done.length} command(s) can be undone`;
    const why = this.shadow.project.whyNotAtPath();
    if (why) return `${why}; undo puts nothing back there`;
    return undefined;
  }

  /** Files back to before the last `n` commands; returns what changed and the steps undone (newest last). */
  async undo(n: number): Promise<{ report: RestoreReport; steps: CheckpointStep[]; before: string; left: string }> {
    const target = this.done[this.done.length - n]!;
    const { report, before, left } = await this.restore(target.commit, this.done.at(-1)?.after);
    return { report, steps: this.done.splice(this.done.length - n, n), before, left };
  }

  /** Files back to before the newest undo, its steps back on the undo list; returns the messages it had cut. */
  async redoLast(): Promise<{ report: RestoreReport; entry: RedoEntry }> {
    if (this.firstRun)
      throw new Error("the first snapshot of the tree is still being taken; try again once it is done");
    const entry = this.redo.at(-1)!;
    const { report } = await this.restore(entry.commit, entry.left);
    this.redo.pop();
    this.done.push(...entry.steps);
    return { report, entry };
  }

  /**
   * Puts the tree back to checkpoint `target`: first a snapshot of now (the
   * redo target), then every file that differs is written, re-created or
   * removed through descriptors beneath the held start directory (no link
   * is followed; a link is restored as a link), permission bits and empty
   * directories as the target's manifest says. Only what the snapshot of
   * now saw is ever removed. A last snapshot checks the result.
   */
  private async restore(
    target: string,
    /** The snapshot aic last left the files in: a file that differs from it now is the person's, and is kept aside. */
    left: string | undefined,
  ): Promise<{ report: RestoreReport; before: string; left: string }> {
    if (!(await this.start())) throw new Error(`checkpoints are off: ${this.off}`);
    const s = this.shadow;
    const release = s.files.lock();
    try {
      const now = await s.snapshot("before an undo");
      const goal = await s.snapshotOf(target);
      const theirs = left ? await s.changedPaths(left, now.commit) : new Set<string>();
      const report = await new TreeRestore(s, now, goal, theirs).run();
      report.leftOut = s.oversized.names();
      s.ensureInPlace();
      const after = await s.snapshot(`restored ${target}`);
      if (after.tree !== goal.tree && !report.skipped.length) {
        // What was kept aside is new beside the checkpoint's files by design; anything else changed meanwhile.
        const aside = new Set((report.keptAside ?? []).map((k) => k.split(" → ")[1]));
        const differ = [...(await s.changedPaths(goal.commit, after.commit))].filter((p) => !aside.has(p));
        report.skipped.push(
          ...differ.map(
            (p) => `${p} (differs from the checkpoint after the restore: a job may have changed it meanwhile)`,
          ),
        );
      }
      return { report, before: now.commit, left: after.commit };
    } catch (error) {
      if (error instanceof ProjectMoved) throw new Error(`${error.message}; undo puts nothing back there`);
      throw error;
    } finally {
      release();
    }
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Checkpoints: putting files back
// Owns: restoring a checkpoint's tree through the held start directory (no
// link followed, modes and empty directories as recorded).
// ════════════════════════════════════════════════════════════════════════════

/** One entry of `git diff-tree --raw`: modes and blobs on each side, and the path relative to the start directory. */
interface TreeChange {
  fromMode: string;
  toMode: string;
  toBlob: string;
  status: string;
  rel: string;
}

const GIT_SYMLINK = "120000";
const isGitFile = (mode: string) => mode === "100644" || mode === "100755" || mode === GIT_SYMLINK;

/**
 * One restore of the start directory to a checkpoint. Every file operation
 * goes through descriptors of directories opened component by component
 * from the held start directory with O_NOFOLLOW: whatever a command renamed
 * or linked, nothing outside the directory is read, written or removed.
 */
class TreeRestore {
  private readonly dirs = new Map<string, number>();
  private readonly report: RestoreReport = { restored: [], recreated: [], removed: [], skipped: [] };

  constructor(
    private readonly shadow: ShadowRepository,
    private readonly now: Snapshot,
    private readonly goal: Snapshot,
    /** Paths the person changed since aic last left the files: kept aside before anything overwrites or removes them. */
    private readonly theirs: ReadonlySet<string> = new Set(),
  ) {}

  async run(): Promise<RestoreReport> {
    try {
      const changes = await this.changes();
      const contents = await this.blobs(changes.filter((c) => isGitFile(c.toMode)).map((c) => c.toBlob));
      try {
        // A file the checkpoint does not hold goes last, once the checkpoint's .gitignore files are back: one
        // they ignore was never the checkpoint's to hold (a command that emptied .gitignore made it visible), and
        // stays where it is.
        // …unless it stands where something is written: a link replacing its directory, a directory replacing it.
        const inTheWay = (rel: string) =>
          changes.some((o) => isGitFile(o.toMode) && (o.rel.startsWith(`${rel}/`) || rel.startsWith(`${o.rel}/`)));
        const gone = changes.filter((c) => isGitFile(c.fromMode) && c.toMode === "000000" && !inTheWay(c.rel));
        for (const c of changes) if (isGitFile(c.fromMode) && !gone.includes(c)) this.remove(c);
        const written = new Set<string>();
        for (const c of changes) if (isGitFile(c.toMode) && this.write(c, contents)) written.add(c.rel);
        const ignored = await this.ignoredNow(gone.map((c) => c.rel));
        for (const c of gone)
          if (ignored.has(c.rel))
            this.report.skipped.push(`${c.rel} (ignored by the checkpoint's .gitignore: left in place)`);
          else this.remove(c);
        this.fixModes(changes, written);
        this.fixEmptyDirectories();
      } finally {
        fs.closeSync(contents.fd);
      }
      return this.report;
    } finally {
      for (const fd of this.dirs.values()) fs.closeSync(fd);
    }
  }

  /** Which of `rels` the ignore rules now in the tree ignore (git check-ignore, through the shadow's git). */
  private async ignoredNow(rels: string[]): Promise<Set<string>> {
    if (!rels.length) return new Set();
    const r = await this.shadow.git(["check-ignore", "--no-index", "-z", "--stdin"], {
      input: rels.map((rel) => `${this.shadow.prefix}${rel}\0`).join(""),
    });
    const out = r.stdout.toString("utf8").split("\0").filter(Boolean);
    return new Set(out.map((p) => this.shadow.relative(p)).filter((p): p is string => p !== undefined));
  }

  private async changes(): Promise<TreeChange[]> {
    const raw = await this.shadow.gitOk([
      "diff-tree",
      "-r",
      "-z",
      "--no-renames",
      "--raw",
      this.now.tree,
      this.goal.tree,
    ]);
    const parts = raw.split("\0");
    const out: TreeChange[] = [];
    for (let i = 0; i + 1 < parts.length; i += 2) {
      const [fromMode, toMode, , toBlob, status] = parts[i]!.replace(/^:/, "").split(" ");
      const rel = this.shadow.relative(parts[i + 1]!);
      if (rel === undefined || !fromMode || !toMode || !toBlob || !status) continue;
      out.push({ fromMode, toMode, toBlob, status, rel });
    }
    return out;
  }

  /** The contents of `blobs` in one `git cat-file --batch` capture: where each starts in it and its size. */
  private async blobs(blobs: string[]): Promise<{ fd: number; at: Map<string, { start: number; size: number }> }> {
    const r = await this.shadow.gitToFile(["cat-file", "--batch"], blobs.map((b) => `${b}\n`).join(""));
    const at = new Map<string, { start: number; size: number }>();
    const head = Buffer.alloc(256);
    for (let offset = 0, n = 0; n < blobs.length; n++) {
      const got = fs.readSync(r, head, 0, head.length, offset);
      const nl = head.subarray(0, got).indexOf(0x0a);
      const m = nl > 0 ? /^([0-9a-f]+) blob (\d+)$/.exec(head.subarray(0, nl).toString()) : null;
      if (!m) break;
      const size = Number(m[2]);
      at.set(m[1]!, { start: offset + nl + 1, size });
      offset += nl + 1 + size + 1;
    }
    return { fd: r, at };
  }

  /** A directory beneath the start directory, as a descriptor (made when `create`); undefined when a non-directory or a link is in the way. */
  private dir(rel: string, create: boolean): number | undefined {
    if (rel === "") return this.shadow.project.descriptor;
    const known = this.dirs.get(rel);
    if (known !== undefined) return known;
    const parent = this.dir(parentOf(rel), create);
    if (parent === undefined) return undefined;
    const at = `/proc/self/fd/${parent}/${baseName(rel)}`;
    const open = () => fs.openSync(at, O_PATH | O.O_DIRECTORY | O.O_NOFOLLOW);
    let fd: number;
    try {
      fd = open();
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code !== "ENOENT" || !create) return undefined;
      try {
        fs.mkdirSync(at, 0o777 & ~process.umask());
        fd = open();
      } catch {
        return undefined;
      }
    }
    this.dirs.set(rel, fd);
    return fd;
  }

  /** `/proc/self/fd/<parent>/<name>` for `rel`: its last component is never followed by what is done to it. */
  private entry(rel: string, create: boolean): string | undefined {
    const parent = this.dir(parentOf(rel), create);
    return parent === undefined ? undefined : `/proc/self/fd/${parent}/${baseName(rel)}`;
  }

  /** Removes a file or link the snapshot of now saw; then its parent directories that became empty. */
  private remove(c: TreeChange): void {
    const at = this.entry(c.rel, false);
    const st = at ? fs.lstatSync(at, { throwIfNoEntry: false }) : undefined;
    if (!at || !st || !(st.isFile() || st.isSymbolicLink())) return;
    if (this.theirs.has(c.rel)) {
      if (!this.keepAside(c.rel, at)) return;
    } else {
      fs.unlinkSync(at);
      if (!isGitFile(c.toMode)) this.report.removed.push(c.rel);
    }
    const keep = parseManifest(this.goal.manifest).dirs;
    for (let dir = parentOf(c.rel); dir !== "" && !keep.has(dir); dir = parentOf(dir))
      if (!this.removeDirIfEmpty(dir)) break;
  }

  private removeDirIfEmpty(rel: string): boolean {
    const at = this.entry(rel, false);
    if (!at) return false;
    try {
      const fd = this.dirs.get(rel);
      if (fd !== undefined) {
        this.dirs.delete(rel);
        fs.closeSync(fd);
      }
      fs.rmdirSync(at);
      return true;
    } catch {
      return false;
    }
  }

  /** Writes one file or link of the goal; true when done. Something else in the way (never snapshotted) is left alone and named. */
  private write(c: TreeChange, contents: { fd: number; at: Map<string, { start: number; size: number }> }): boolean {
    const blob = contents.at.get(c.toBlob);
    const at = this.entry(c.rel, true);
    const st = at ? fs.lstatSync(at, { throwIfNoEntry: false }) : undefined;
    if (!blob || !at || (st && !st.isFile())) {
      this.report.skipped.push(
        `${c.rel} (${!blob ? "its content is missing from the store" : "something aic never snapshotted is in the way"})`,
      );
      return false;
    }
    // A file on disk that the snapshot of now did not hold (git-ignored, say, after the person rewrote it) is a
    // version no snapshot has: it is moved aside, never overwritten.
    if (st && (c.status === "A" || this.theirs.has(c.rel)) && !this.keepAside(c.rel, at)) return false;
    if (c.toMode === GIT_SYMLINK) {
      const target = Buffer.alloc(blob.size);
      fs.readSync(contents.fd, target, 0, blob.size, blob.start);
      if (st) fs.unlinkSync(at);
      fs.symlinkSync(target.toString(), at);
    } else {
      const fd = fs.openSync(at, O.O_WRONLY | O.O_CREAT | O.O_TRUNC | O.O_NOFOLLOW, 0o600);
      try {
        copyOwnRange(contents.fd, blob.start, fd, blob.size);
        fs.fchmodSync(fd, this.wantedMode(c.rel, c.toMode === "100755"));
      } finally {
        fs.closeSync(fd);
      }
    }
    (c.status === "A" ? this.report.recreated : this.report.restored).push(c.rel);
    return true;
  }

  /** Renames `at` (the entry for `rel`) to a free `rel.aic-kept-N` beside it; false (and said) when it cannot. */
  private keepAside(rel: string, at: string): boolean {
    for (let n = 1; n < 100; n++) {
      const aside = `${at}.aic-kept-${n}`;
      if (lstatIfReachable(aside)) continue;
      try {
        fs.renameSync(at, aside);
        (this.report.keptAside ??= []).push(`${rel} → ${rel}.aic-kept-${n}`);
        return true;
      } catch (error) {
        this.report.skipped.push(
          `${rel} (a version no snapshot holds could not be moved aside: ${(error as Error).message})`,
        );
        return false;
      }
    }
    this.report.skipped.push(`${rel} (a version no snapshot holds is in the way, and ${rel}.aic-kept-1…99 are taken)`);
    return false;
  }

  private wantedMode(rel: string, executable: boolean): number {
    return parseManifest(this.goal.manifest).modes.get(rel) ?? checkoutMode(executable);
  }

  /** Permission bits of files whose content did not change but whose bits did (git keeps only the executable bit). */
  private fixModes(changes: TreeChange[], written: Set<string>): void {
    const was = parseManifest(this.now.manifest).modes;
    const goal = parseManifest(this.goal.manifest).modes;
    const changed = new Set(changes.map((c) => c.rel));
    for (const rel of new Set([...was.keys(), ...goal.keys()])) {
      if (written.has(rel) || changed.has(rel)) continue;
      const at = this.entry(rel, false);
      if (!at) continue;
      let fd: number;
      try {
        fd = fs.openSync(at, O_PATH | O.O_NOFOLLOW);
      } catch {
        continue;
      }
      try {
        const st = fs.fstatSync(fd);
        const wanted = goal.get(rel) ?? checkoutMode((st.mode & 0o100) !== 0);
        if (!st.isFile() || (st.mode & 0o7777) === wanted) continue;
        fs.chmodSync(`/proc/self/fd/${fd}`, wanted);
        this.report.restored.push(rel);
      } finally {
        fs.closeSync(fd);
      }
    }
  }

  /** Empty directories as the goal had them: made where missing, removed (when still empty) where the goal had none. */
  private fixEmptyDirectories(): void {
    const was = parseManifest(this.now.manifest).dirs;
    const goal = parseManifest(this.goal.manifest).dirs;
    for (const dir of goal)
      if (this.dir(dir, false) === undefined && this.dir(dir, true) !== undefined)
        this.report.recreated.push(`${dir}/`);
    for (const dir of was) {
      if (goal.has(dir) || !this.removeDirIfEmpty(dir)) continue;
      this.report.removed.push(`${dir}/`);
      // Parents that only held it go too (mkdir -p made them), unless the goal has them.
      for (let up = parentOf(dir); up !== "" && !goal.has(up); up = parentOf(up)) if (!this.removeDirIfEmpty(up)) break;
    }
  }
}

const parentOf = (rel: string) => (rel.includes("/") ? rel.slice(0, rel.lastIndexOf("/")) : "");

/** Copies `length` bytes of `from` starting at `start` into `to`, a slice at a time. */
function copyOwnRange(from: number, start: number, to: number, length: number): void {
  const slice = Buffer.allocUnsafe(Math.max(1, Math.min(READ_SLICE_BYTES, length)));
  for (let at = 0; at < length;) {
    const n = fs.readSync(from, slice, 0, Math.min(slice.length, length - at), start + at);
    if (n === 0) throw new Error("the store's copy of a file is shorter than it says");
    writeAll(to, slice.subarray(0, n));
    at += n;
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Checkpoints: aic undo, redo and diff
// Owns: undoing and redoing commands with the conversation cut back to the turn
// that proposed them, and the aic undo, aic redo and aic diff subcommands run
// from a shell.
// ════════════════════════════════════════════════════════════════════════════

/**
 * Where the conversation is cut for an undo of `calls` (oldest first): the assistant turn that proposed the
 * first of them, or -1 when one is gone (compressed). Found from the end, each before the next: servers
 * number call ids per answer (call_1 again and again), so an id alone does not name one turn.
 */
function turnOfCalls(messages: readonly Message[], calls: readonly string[]): number {
  let at = messages.length - 1;
  const proposes = (m: Message, call: string) => m.role === "assistant" && m.tool_calls?.some((c) => c.id === call);
  for (let i = calls.length - 1; i >= 0; i--) {
    // One turn may propose several of them: the next one back may be in the same turn.
    while (at >= 0 && !proposes(messages[at]!, calls[i]!)) at--;
    if (at < 0) return -1;
  }
  return at;
}

/**
 * A rules file an undo or redo wrote holds a version a command made (the one it undoes, or its own): on
 * record for `aic rules accept`, unless it is the person's own text. Written outside any run, it would
 * otherwise pass for the person's edit at the next start (`allow *` then ruled).
 */
function recordRestoredRules(report: RestoreReport, directory: string): void {
  for (const rel of [...report.restored, ...report.recreated, ...report.removed]) {
    if (path.basename(rel) !== RULES_FILE_NAME) continue;
    const file = path.join(directory, rel);
    const now = rulesOnDisk(file);
    if (now.kind === "text" && now.text === RulesTrust.of(file)?.trustedText) continue;
    RulesTrust.commandWrote(file, now);
  }
}

/** The lines an undo or redo shows: what changed, and what checkpoints cannot cover. */
function restoreLines(report: RestoreReport, directory: string): string[] {
  const list = (label: string, files: string[]) =>
    files.length
      ? [
          `${label} (${files.length}): ${files.slice(0, 50).map(visibleControls).join(", ")}${files.length > 50 ? ", …" : ""}`,
        ]
      : [];
  const lines = [
    ...list("restored", report.restored),
    ...list("re-created", report.recreated),
    ...list("removed", report.removed),
    ...list("kept aside, as no snapshot held them", report.keptAside ?? []),
    ...list("not put back", report.skipped),
    ...list("left as they are, too big for checkpoints (AIC_CHECKPOINT_FILE_MAX_MB)", report.leftOut ?? []),
  ];
  return [...(lines.length ? lines : ["no file differed"]), undoLimits(directory)];
}

/**
 * Undo in a conversation: files back to before the last `n` commands, and the
 * messages from the turn that proposed the first of them cut away (kept for
 * redo). Returns the lines to show.
 */
async function undoCommands(
  checkpoints: Checkpoints,
  conversation: { messages: Message[] },
  n: number,
): Promise<string[]> {
  const problem = checkpoints.cannotUndo(n);
  if (problem) throw new Error(problem);
  const { report, steps, before, left } = await checkpoints.undo(n);
  recordRestoredRules(report, checkpoints.shadow.directory);
  const at = turnOfCalls(
    conversation.messages,
    steps.map((s) => s.call),
  );
  const cut = at > 0 ? conversation.messages.splice(at) : [];
  checkpoints.redo.push({ commit: before, steps, messages: cut, left });
  const what =
    steps.length === 1
      ? `\`${oneLine(steps[0]!.command, 80)}\``
      : `${steps.length} commands, from \`${oneLine(steps[0]!.command, 60)}\``;
  const conversationLine =
    at > 0
      ? `The conversation is cut back to before the turn that proposed ${what} (${cut.length} message(s) set aside; redo puts them back).`
      : "The turn that proposed it is no longer in the conversation (compressed away, or cleared with /clear), so the conversation is left as it is.";
  if (at <= 0) conversation.messages.push({ role: "user", content: undoneNote(what) });
  return [
    `Undid ${what}: the files are as they were before it ran${report.leftOut?.length ? ", but for those too big for checkpoints" : ""}.`,
    ...restoreLines(report, checkpoints.shadow.directory),
    conversationLine,
  ];
}

/**
 * `aic undo [N]` / `aic redo` on a session file (a --nogui run's, or one no
 * TUI holds now): the same as /undo and /redo, saved back to the file.
 */
/**
 * The project of a session file for `aic undo|redo|diff`: the directory the
 * file lives in, held open. The checkpoints' directory written inside the
 * file must be that one: a session sits where commands write, so what it
 * says is never a reason to touch another directory.
 */
function projectOfSession(sessionFile: string, record: CheckpointRecord): HeldDirectory {
  const directory = path.dirname(fs.realpathSync(sessionFile));
  if (record.directory !== directory)
    throw new Error(
      `${sessionFile} says its checkpoints cover ${record.directory}, but the session file lives in ${directory}; aic only undoes, redoes or shows changes in the directory that holds the session file (was the project moved, or the session edited?), so nothing was touched`,
    );
  return HeldDirectory.open(directory);
}

/**
 * `aic undo [N]` / `aic redo` on a session file (a --nogui run's, or one no
 * TUI holds now): the same as /undo and /redo, saved back to the file.
 */
async function runUndo(kind: "undo" | "redo", count: number, sessionPath: string): Promise<number> {
  const fail = (message: string) => (writeOut(2, `aic: error: ${message}\n`), EXIT.failure);
  if (!fs.existsSync(sessionPath))
    return fail(
      `there is no session file ${path.resolve(sessionPath)} (give --session PATH; a --nogui run keeps one only when given --session)`,
    );
  const sink: EventSink = {
    emit: (e) => {
      if (e.type === "warning") writeOut(2, `aic: warning: ${e.text}\n`);
    },
  };
  let store: SessionStore;
  try {
    store = SessionStore.claim(sessionPath, { model: "", apiBase: "" }, sink, true);
  } catch (error) {
    return fail((error as Error).message);
  }
  let project: HeldDirectory | undefined;
  try {
    const loaded = store.load();
    if (!loaded.messages) return fail(loaded.reports[0] ?? `${store.path} holds no conversation`);
    const record = loaded.checkpoints;
    if (!record)
      return fail(`nothing to ${kind}: ${store.path} records no checkpoint (no command ran with checkpoints on)`);
    project = projectOfSession(store.path, record);
    const checkpoints = Checkpoints.forDirectory(project, store.path, (text) => sink.emit({ type: "warning", text }));
    checkpoints.adopt(record);
    const conversation = { messages: loaded.messages };
    const lines =
      kind === "undo"
        ? await undoCommands(checkpoints, conversation, count)
        : await redoCommands(checkpoints, conversation);
    const saved = store.save(kind, {
      messages: conversation.messages,
      stepCount: loaded.stepCount ?? 0,
      usage: loaded.usage ?? emptyUsage(),
      cwd: record.directory,
      jobs: loaded.jobs,
      checkpoints: checkpoints.record(),
    });
    writeOut(1, `${lines.join("\n")}\n`);
    if (!saved) return fail(`the files were put back, but ${store.path} could not be saved`);
    return EXIT.ok;
  } catch (error) {
    return fail((error as Error).message);
  } finally {
    project?.close();
    store.release();
  }
}

/** `aic diff [N] [--session PATH]`: the unified diff of the N-th last command's changes. Reads the session, never writes it. */
/**
 * A diff for a terminal: git's colours kept, every other control character the files hold shown and never
 * sent (a command's file could set the clipboard with OSC 52, or clear the screen over what changed). Piped
 * to a file, the diff stays a patch, byte for byte.
 */
function diffForTerminal(text: string): string {
  return text
    .split(/(\x1b\[[0-9;]*m)/)
    .map((piece, i) => (i % 2 ? piece : visibleControls(piece)))
    .join("");
}

async function runDiff(count: number, sessionPath: string): Promise<number> {
  const fail = (message: string) => (writeOut(2, `aic: error: ${message}\n`), EXIT.failure);
  let project: HeldDirectory | undefined;
  try {
    let doc: Record<string, unknown>;
    try {
      doc = JSON.parse(readOwnFile(sessionPath).toString("utf8")) as Record<string, unknown>;
    } catch (error) {
      const e = ownFileError(error);
      return fail(
        e.missing
          ? `there is no session file ${path.resolve(sessionPath)} (give --session PATH)`
          : `cannot read ${path.resolve(sessionPath)}: ${e.message}`,
      );
    }
    const reports: string[] = [];
    const record = checkpointRecordFrom(doc?.checkpoints, reports);
    if (!record)
      return fail(
        reports[0] ?? `${path.resolve(sessionPath)} records no checkpoint (no command ran with checkpoints on)`,
      );
    project = projectOfSession(path.resolve(sessionPath), record);
    const checkpoints = Checkpoints.forDirectory(project, sessionPath, () => {});
    checkpoints.adopt(record);
    const diff = await checkpoints.diffOf(count, useColor(process.stdout));
    writeOut(1, process.stdout.isTTY ? diffForTerminal(diff) : diff);
    return EXIT.ok;
  } catch (error) {
    return fail((error as Error).message);
  } finally {
    project?.close();
  }
}

/** Redo in a conversation: the files as they were before the newest undo, and the messages it cut put back. */
async function redoCommands(checkpoints: Checkpoints, conversation: { messages: Message[] }): Promise<string[]> {
  if (checkpoints.redo.length === 0) throw new Error("nothing to redo");
  const { report, entry } = await checkpoints.redoLast();
  recordRestoredRules(report, checkpoints.shadow.directory);
  conversation.messages.push(...entry.messages);
  return [
    `Redid ${entry.steps.length} command(s): the files are as they were before the undo.`,
    ...restoreLines(report, checkpoints.shadow.directory),
    entry.messages.length
      ? `The ${entry.messages.length} message(s) the undo set aside are back in the conversation.`
      : "",
  ].filter(Boolean);
}

// ════════════════════════════════════════════════════════════════════════════
// Command rules: reading a command line
// Owns: turning the text of a command into the simple commands it can run,
// through the `unbash` parser (chosen by measurement: the only JavaScript
// parser that split every line of the test corpus as bash runs it). Each word
// is known (its value after quote removal) or dynamic (only known when it
// runs). Code that bash would run out of data ("hidden code": arithmetic on
// a string, ${!x}, test -v 'a[$(…)]') is reported so it can never be allowed.
// ════════════════════════════════════════════════════════════════════════════

/** A word of a simple command: its value when it is known before it runs, else only its source text. */
type ShellWord = { known: true; value: string; text: string } | { known: false; text: string };

/** What a shell run by a command would read as its script from standard input. */
interface StdinScript {
  kind: "heredoc" | "herestring";
  /** A here-document whose delimiter is quoted: its body is taken literally. */
  quoted: boolean;
  body: string;
  /** The body or word holds expansions, so the script is only known when it runs. */
  dynamic: boolean;
  text: string;
}

/** A simple command as the parser found it, before wrappers are looked through. */
interface ParsedCommand {
  words: ShellWord[];
  /** Leading NAME=value assignments (and bare ones). */
  assignments: { name: string; text: string; subscript?: string }[];
  stdin: StdinScript[];
  /** The files its redirections write or truncate (`>`, `>>`, `&>`, `>|`, `2>` to a file, `<>`). */
  writes: ShellWord[];
}

/** Redirection operators that open their target for writing. */
const WRITING_REDIRECTS = new Set([">", ">>", ">|", "&>", "&>>", "<>", ">&"]);

/** Targets a redirection writes without changing a file: the null device, the standard streams, a descriptor. */
const HARMLESS_TARGET = /^(\/dev\/(null|stdout|stderr|tty|fd\/\d+)|-|\d+)$/;

/** The file a redirection writes, or undefined (a read, a duplicated descriptor, /dev/null). */
function writtenBy(r: import("unbash").Redirection): ShellWord | undefined {
  if (r.type !== "Redirect" || !r.target) return undefined;
  const target = shellWord(r.target); // refuses $'…' in a file name, read or written
  if (!WRITING_REDIRECTS.has(r.operator) || (target.known && HARMLESS_TARGET.test(target.value))) return undefined;
  return target;
}

/** A command line the rules refuse to read: it is then always asked about. */
class UnreadableCommand extends Error {}

/** Arithmetic made only of numbers and operators: anything else (a name, a subscript) may run code. */
const PLAIN_ARITHMETIC = /^[\s0-9+\-*/%<>=!&|^~?:,()]*$/;
const NUMBER = /^-?(0[xX][0-9a-fA-F]+|[0-9]+)$/;
const IDENTIFIER = /^[A-Za-z_][A-Za-z0-9_]*$/;
const ARITHMETIC_TESTS = new Set(["-eq", "-ne", "-lt", "-le", "-gt", "-ge"]);

type Unbash = typeof import("unbash");
type UnbashNode = import("unbash").SyntaxNode;
type UnbashWordPart = import("unbash").WordPart | import("unbash").DoubleQuotedChild;

let unbash: Unbash | undefined;

/**
 * Whether a word part is only known when the command runs. `$'…'` and `$"…"`
 * are refused outright: /bin/sh is dash on many systems, and dash splits
 * `echo $'\' ; git push ; echo '\'` into three commands where bash sees one.
 */
function partIsDynamic(part: UnbashWordPart): boolean {
  switch (part.type) {
    case "Literal":
    case "SingleQuoted":
      return false;
    case "AnsiCQuoted":
    case "LocaleString":
      throw new UnreadableCommand(
        `${part.type === "AnsiCQuoted" ? "$'…'" : '$"…"'} quoting (dash and bash read it differently)`,
      );
    case "DoubleQuoted":
      return part.parts.some(partIsDynamic);
    default:
      return true; // an expansion, a glob, brace expansion
  }
}

const wordIsDynamic = (w: import("unbash").Word | undefined) => Boolean(w?.parts?.some(partIsDynamic));

function shellWord(w: import("unbash").Word | import("unbash").Assignment): ShellWord {
  if (w.type === "Assignment") {
    const v = w.value;
    if (v.type !== "Word" || wordIsDynamic(v) || wordIsDynamic(w.index)) return { known: false, text: w.text };
    const index = w.index ? `[${w.index.value}]` : "";
    return { known: true, value: `${w.name}${index}${w.append ? "+=" : "="}${v.value}`, text: w.text };
  }
  // A leading unquoted ~ becomes a home directory only when the command runs.
  if (w.text.startsWith("~") || wordIsDynamic(w)) return { known: false, text: w.text };
  return { known: true, value: w.value, text: w.text };
}

/** Whether an arithmetic expression of a C-style for loop holds anything but numbers. */
function arithmeticRunsCode(e: import("unbash").ArithmeticExpression | undefined): boolean {
  if (!e) return false;
  switch (e.type) {
    case "ArithmeticWord":
      return !NUMBER.test(e.value) || e.parts !== undefined;
    case "ArithmeticCommandExpansion":
      return true;
    case "ArithmeticBinary":
      return arithmeticRunsCode(e.left) || arithmeticRunsCode(e.right);
    case "ArithmeticUnary":
      return arithmeticRunsCode(e.operand);
    case "ArithmeticTernary":
      return arithmeticRunsCode(e.test) || arithmeticRunsCode(e.consequent) || arithmeticRunsCode(e.alternate);
    case "ArithmeticGroup":
      return arithmeticRunsCode(e.expression);
  }
}

/** Whether a [[ ]] test evaluates a string as arithmetic or as a variable name with a subscript. */
function testRunsCode(e: import("unbash").TestExpression | undefined): boolean {
  if (!e) return false;
  switch (e.type) {
    case "TestBinary":
      return (
        ARITHMETIC_TESTS.has(e.operator) && [e.left, e.right].some((w) => wordIsDynamic(w) || !NUMBER.test(w.value))
      );
    case "TestUnary":
      return e.operator === "-v" && (wordIsDynamic(e.operand) || !IDENTIFIER.test(e.operand.value));
    case "TestLogical":
      return e.operands.some(testRunsCode);
    case "TestNot":
      return testRunsCode(e.operand);
    case "TestGroup":
      return testRunsCode(e.expression);
  }
}

/** A ${…} that runs code out of data: indirection, prompt expansion, a computed subscript, offset or length. */
function expansionRunsCode(p: import("unbash").ParameterExpansionPart): boolean {
  const op = p.operation;
  const i = p.index;
  const indexOk = !i || (!wordIsDynamic(i) && (NUMBER.test(i.value) || i.value === "@" || i.value === "*"));
  const sliceOk =
    op?.type !== "Slice" ||
    [op.offset, op.length].every((w) => !w || (!wordIsDynamic(w) && PLAIN_ARITHMETIC.test(w.value)));
  const prompt = op?.type === "Transform" && op.operand.value === "P";
  return p.prefix === "!" || prompt || !indexOk || !sliceOk;
}

/**
 * The simple commands of `source` (in every list, pipeline, compound,
 * function body, substitution and here-document), and the hidden code in it.
 * Throws UnreadableCommand for anything the rules cannot be sure of.
 */
function readCommandLine(source: string): { commands: ParsedCommand[]; hidden: string[] } {
  unbash ??= require("unbash") as Unbash;
  const commands: ParsedCommand[] = [];
  const hidden: string[] = [];
  const visit = (node: UnbashNode, text: string, inSubstitution: boolean): void => {
    switch (node.type) {
      case "Script":
        if (node.errors?.length) throw new UnreadableCommand(node.errors[0]!.message);
        if (node.source !== undefined) text = node.source;
        break;
      case "Command":
        commands.push(parsedCommand(node, inSubstitution));
        break;
      case "Redirected": {
        // `{ …; } > f`, `while …; done >> log`: the group's redirections write too.
        const writes = node.redirects.map(writtenBy).filter((w): w is ShellWord => w !== undefined);
        if (writes.length) commands.push({ words: [], assignments: [], stdin: [], writes });
        break;
      }
      case "AnsiCQuoted":
      case "LocaleString":
        partIsDynamic(node);
        break;
      case "ArithmeticExpansion": {
        const inner = node.text.startsWith("$((") ? node.text.slice(3, -2) : node.text.slice(2, -1);
        if (!PLAIN_ARITHMETIC.test(inner)) hidden.push(node.text);
        break;
      }
      case "ArithmeticCommand":
        if (!PLAIN_ARITHMETIC.test(node.body)) hidden.push(text.slice(node.pos, node.end));
        break;
      case "ArithmeticFor":
        if ([node.initialize, node.test, node.update].some(arithmeticRunsCode))
          hidden.push(text.slice(node.pos, node.body.pos));
        break;
      case "ParameterExpansion":
        if (expansionRunsCode(node)) hidden.push(node.text);
        break;
      case "TestCommand":
        if (testRunsCode(node.expression)) hidden.push(text.slice(node.pos, node.end));
        break;
    }
    const nested =
      inSubstitution ||
      node.type === "CommandExpansion" ||
      node.type === "ProcessSubstitution" ||
      node.type === "ArithmeticCommandExpansion";
    unbash!.forEachChild(node, (child) => visit(child, text, nested));
  };
  visit(unbash.parse(source), source, false);
  return { commands, hidden };
}

function parsedCommand(node: import("unbash").Command, inSubstitution: boolean): ParsedCommand {
  const words: ShellWord[] = node.name ? [shellWord(node.name)] : [];
  const assignments: ParsedCommand["assignments"] = [];
  const stdin: StdinScript[] = [];
  const writes: ShellWord[] = [];
  for (const p of node.prefix)
    if (p.type === "Assignment") {
      shellWord(p); // refuses $'…' in the value
      const subscript = p.index ? (wordIsDynamic(p.index) ? p.index.text : p.index.value) : undefined;
      assignments.push({ name: p.name, text: p.text, subscript });
    }
  for (const s of node.suffix) if (s.type === "Word" || s.type === "Assignment") words.push(shellWord(s));
  for (const r of node.redirects) {
    const fromStdin =
      r.descriptor === undefined || (r.descriptor.type === "FileDescriptor" && r.descriptor.value === 0);
    if (r.type === "HereDoc") {
      if (!r.closing) throw new UnreadableCommand("a here-document without its end line");
      // bash 5.2 re-reads such a substitution and loses a ; after the here-document: what runs is not what is read.
      if (inSubstitution) throw new UnreadableCommand("a here-document inside a command substitution");
      if (fromStdin)
        stdin.push({
          kind: "heredoc",
          quoted: Boolean(r.delimiter?.quoted),
          body: r.body.text,
          dynamic: Boolean(r.body.parts?.some(partIsDynamic)),
          text: r.body.text,
        });
    } else if (r.type === "HereString" && r.target) {
      const w = shellWord(r.target);
      if (fromStdin)
        stdin.push({
          kind: "herestring",
          quoted: false,
          body: w.known ? w.value : "",
          dynamic: !w.known,
          text: w.text,
        });
    } else {
      const written = writtenBy(r);
      if (written) writes.push(written);
    }
  }
  return { words, assignments, stdin, writes };
}

// ════════════════════════════════════════════════════════════════════════════
// Command rules: what a command line runs
// Owns: the parts a rule is matched against: every simple command of a line,
// with wrappers looked through (`env`, `timeout`, `nohup`, `nice`, `command`,
// `exec`, `time`, `xargs`, `sudo`), the scripts of shells (`sh -c`,
// `bash -lc`, a here-document fed to `sh`), `eval` and `trap`, and a part
// that can never be allowed for each piece of hidden code or risky variable.
// ════════════════════════════════════════════════════════════════════════════

/** One simple command a line can run, as the rules match it. */
type CommandPart = ShellWord[];

/**
 * Variables that make programs run code or read other files: setting one on
 * a command (`GIT_PAGER=… git log`, `env LD_PRELOAD=… ls`) changes what an
 * allowed program does, so such an assignment is a part of its own.
 */
const RISKY_VARIABLE =
  /^(PATH|HOME|XDG_CONFIG_HOME|XDG_CONFIG_DIRS|XDG_DATA_HOME|ZDOTDIR|INPUTRC|LESSKEY|PYTHONUSERBASE|LD_\w*|BASH_ENV|ENV|PROMPT_COMMAND|PS4|IFS|SHELLOPTS|BASHOPTS|BASH_FUNC_.*|GIT_\w*|PAGER|MANPAGER|LESSOPEN|LESSCLOSE|EDITOR|VISUAL|SHELL|BROWSER|NODE_OPTIONS|NODE_PATH|PYTHONPATH|PYTHONSTARTUP|PYTHONHOME|PERL5OPT|PERL5LIB|PERLLIB|RUBYOPT|RUBYLIB|npm_config_\w*|NPM_CONFIG_\w*)$/;
const NUMERIC_SUBSCRIPT = /^(0[xX][0-9a-fA-F]+|[0-9]+(#[0-9A-Za-z@_]+)?)$/;
const SHELL_PROGRAMS = new Set([
  "sh",
  "bash",
  "rbash",
  "dash",
  "zsh",
  "ksh",
  "mksh",
  "lksh",
  "pdksh",
  "ash",
  "yash",
  "posh",
  "csh",
  "tcsh",
  "fish",
]);
/** Scripts inside scripts (sh -c "sh -c '…'") deeper than this are not read. */
const MAX_SCRIPT_DEPTH = 20;

const known = (value: string): ShellWord => ({ known: true, value, text: value });
const dynamic = (text: string): ShellWord => ({ known: false, text });
/** The arguments xargs adds from its input. */
const XARGS_INPUT: ShellWord = dynamic("");
const baseName = (s: string) => s.slice(s.lastIndexOf("/") + 1);
const valueOf = (w: ShellWord | undefined) => (w?.known ? w.value : undefined);
/** A part that is only known when it runs: the whole text of what could not be looked through. */
const opaque = (words: ShellWord[]): CommandPart[] => [[dynamic(words.map((w) => w.text).join(" "))]];

/** What judging a command line needs beyond its text: where it runs, so the scripts it names can be read. */
interface JudgeContext {
  cwd?: string;
}

/** Stands for a file a command line writes: such a part is `[WRITE_WORD, path]`. */
const WRITE_WORD: ShellWord = { known: true, value: "\u0000write", text: "" };
const writePart = (target: ShellWord): CommandPart => [WRITE_WORD, target];
const isWritePart = (p: CommandPart) => p[0]?.known === true && p[0].value === WRITE_WORD.value;

/** Every simple command `source` can run, wrappers and nested scripts looked through, and every file it writes. Throws UnreadableCommand. */
function commandParts(source: string, depth = 0, ctx: JudgeContext = {}): CommandPart[] {
  if (depth > MAX_SCRIPT_DEPTH) throw new UnreadableCommand("scripts nested too deep");
  const { commands, hidden } = readCommandLine(source);
  const parts: CommandPart[] = [];
  for (const c of commands) {
    for (const a of c.assignments)
      if (RISKY_VARIABLE.test(a.name) || (a.subscript !== undefined && !NUMERIC_SUBSCRIPT.test(a.subscript)))
        parts.push([dynamic(a.text)]);
    parts.push(...partsOf(c.words, c, depth, ctx));
    for (const w of c.writes) parts.push(writePart(w));
  }
  for (const h of hidden) parts.push([dynamic(h)]);
  return parts;
}

/** How a wrapper's options look: letters without and with an argument, long options, `-N` numbers. */
interface OptionSyntax {
  flags: string;
  withArgument: string;
  /** Letters whose argument may be attached or absent (xargs -i). */
  optionalArgument?: string;
  long?: Record<string, "flag" | "argument" | "optional">;
  numeric?: boolean;
}

/**
 * Reads a wrapper's options from `start`; returns where its operands begin,
 * or -1 at an option it does not know (then it cannot be looked through).
 * `seen` collects each option given and its argument.
 */
function skipOptions(
  words: ShellWord[],
  start: number,
  syntax: OptionSyntax,
  seen = new Map<string, string | true>(),
): number {
  let i = start;
  while (i < words.length) {
    const w = words[i]!;
    if (!w.known) return /^['"]?-/.test(w.text) ? -1 : i;
    const a = w.value;
    if (a === "--") return i + 1;
    if (!a.startsWith("-") || a === "-") return i;
    const next = valueOf(words[i + 1]);
    if (a.startsWith("--")) {
      const eq = a.indexOf("=");
      const name = eq < 0 ? a.slice(2) : a.slice(2, eq);
      const kind = syntax.long?.[name];
      if (!kind || (kind === "flag" && eq >= 0)) return -1;
      if (kind === "argument" && eq < 0) {
        if (next === undefined) return -1;
        seen.set(name, next);
        i += 2;
      } else {
        seen.set(name, eq < 0 ? true : a.slice(eq + 1));
        i++;
      }
      continue;
    }
    if (syntax.numeric && /^-[0-9]+$/.test(a)) {
      i++;
      continue;
    }
    let step = 1;
    for (let j = 1; j < a.length; j++) {
      const c = a[j]!;
      if (syntax.flags.includes(c)) {
        seen.set(c, true);
        continue;
      }
      if (syntax.withArgument.includes(c)) {
        if (j + 1 < a.length) seen.set(c, a.slice(j + 1));
        else if (next === undefined) return -1;
        else {
          seen.set(c, next);
          step = 2;
        }
        break;
      }
      if (syntax.optionalArgument?.includes(c)) {
        seen.set(c, j + 1 < a.length ? a.slice(j + 1) : true);
        break;
      }
      return -1;
    }
    i += step;
  }
  return i;
}

const XARGS_SYNTAX: OptionSyntax = {
  flags: "0rtpxo",
  withArgument: "adELnPsI",
  optionalArgument: "iel",
  long: {
    null: "flag",
    "no-run-if-empty": "flag",
    verbose: "flag",
    interactive: "flag",
    exit: "flag",
    "open-tty": "flag",
    "show-limits": "flag",
    "arg-file": "argument",
    delimiter: "argument",
    "max-lines": "optional",
    "max-args": "argument",
    "max-procs": "argument",
    "max-chars": "argument",
    "process-slot-var": "argument",
    replace: "optional",
    eof: "optional",
  },
};

const SUDO_SYNTAX: OptionSyntax = {
  flags: "AbEeHiKklnPSsVv",
  withArgument: "ugCDhprtTU",
  long: Object.fromEntries([
    ...["login", "shell", "non-interactive", "set-home", "stdin", "background"].map((n) => [n, "flag" as const]),
    ["preserve-env", "optional" as const],
    ...[
      "user",
      "group",
      "close-from",
      "chdir",
      "chroot",
      "host",
      "prompt",
      "role",
      "type",
      "command-timeout",
      "other-user",
    ].map((n) => [n, "argument" as const]),
  ]),
};

// ════════════════════════════════════════════════════════════════════════════
// Command rules: wrappers and interpreters
// Owns: the programs that only wrap another (nice, timeout, sudo …) and the
// interpreters that run code given in a string, as the rules see through them.
// ════════════════════════════════════════════════════════════════════════════

/** Wrappers that run their operands as a command, after options of this syntax (and `skip` operands: timeout's duration). */
const SIMPLE_WRAPPERS: Record<string, OptionSyntax & { skip?: number; noCommandWith?: string }> = {
  timeout: {
    flags: "fpv",
    withArgument: "sk",
    long: {
      signal: "argument",
      "kill-after": "argument",
      foreground: "flag",
      "preserve-status": "flag",
      verbose: "flag",
    },
    skip: 1,
  },
  nice: { flags: "", withArgument: "n", long: { adjustment: "argument" }, numeric: true },
  nohup: { flags: "", withArgument: "" },
  builtin: { flags: "", withArgument: "" },
  exec: { flags: "cl", withArgument: "a" },
  time: {
    flags: "pvqa",
    withArgument: "fo",
    long: {
      portability: "flag",
      verbose: "flag",
      quiet: "flag",
      append: "flag",
      format: "argument",
      output: "argument",
    },
  },
  setsid: { flags: "cfw", withArgument: "", long: { ctty: "flag", fork: "flag", wait: "flag" } },
  stdbuf: { flags: "", withArgument: "ioe", long: { input: "argument", output: "argument", error: "argument" } },
  ionice: {
    flags: "t",
    withArgument: "cnpPu",
    long: {
      class: "argument",
      classdata: "argument",
      ignore: "flag",
      pid: "argument",
      pgid: "argument",
      uid: "argument",
    },
    noCommandWith: "pPu",
  },
  // taskset [-a] [-c] MASK CMD…; with -p it changes a running process instead.
  taskset: {
    flags: "acp",
    withArgument: "",
    long: { "all-tasks": "flag", "cpu-list": "flag", pid: "flag" },
    skip: 1,
    noCommandWith: "p",
  },
  chroot: {
    flags: "",
    withArgument: "",
    long: { userspec: "argument", groups: "argument", "skip-chdir": "flag" },
    skip: 1,
  },
  doas: { flags: "ns", withArgument: "uC" },
  unbuffer: { flags: "p", withArgument: "" },
};

/** Interpreters and the options that hand them code on the command line (which no rule can read). */
const INLINE_CODE: Record<string, string[]> = {
  python: ["-c"],
  perl: ["-e", "-E"],
  ruby: ["-e"],
  node: ["-e", "-p", "--eval", "--print"],
  nodejs: ["-e", "-p", "--eval", "--print"],
  bun: ["-e", "-p", "--eval", "--print"],
  deno: ["eval"],
  php: ["-r"],
  lua: ["-e"],
  luajit: ["-e"],
  Rscript: ["-e"],
  julia: ["-e", "-E"],
  osascript: ["-e"],
  pwsh: ["-c", "-Command", "-command"],
  tclsh: [],
  jshell: [],
};

/** The interpreter family of a program name: python3.11 is python. */
const interpreterOf = (name: string) => (/^python\d*(\.\d+)?$/.test(name) ? "python" : name);

/** The script a word holds, read as a command line of its own (a dynamic word stays one opaque part). */
function scriptParts(w: ShellWord, depth: number, ctx: JudgeContext): CommandPart[] {
  return w.known ? commandParts(w.value, depth + 1, ctx) : [[w]];
}

/** What the words of one simple command run: the command itself, or what its wrapper runs. */
function partsOf(words: ShellWord[], c: ParsedCommand, depth: number, ctx: JudgeContext): CommandPart[] {
  const first = words[0];
  if (!first) return [];
  if (!first.known) return [words];
  const name = baseName(first.value);
  const rest = (i: number) => partsOf(words.slice(i), c, depth, ctx);
  const simple = SIMPLE_WRAPPERS[name];
  if (simple) {
    const seen = new Map<string, string | true>();
    const i = skipOptions(words, 1, simple, seen);
    if (i < 0) return opaque(words);
    if ([...(simple.noCommandWith ?? "")].some((letter) => seen.has(letter))) return [words];
    const at = i + (simple.skip ?? 0);
    // chroot without a command runs the new root's shell: what that runs is not on the line.
    if (name === "chroot" && at >= words.length) return [words, ...opaque(words)];
    return at >= words.length ? [words] : rest(at);
  }
  const special = PROGRAMS_THAT_RUN_PROGRAMS[name];
  if (special) return special(words, c, depth, ctx);
  if (SHELL_PROGRAMS.has(name)) return shellParts(words, c, depth, ctx);
  const inline = INLINE_CODE[interpreterOf(name)];
  if (inline && words.slice(1).some((w) => !w.known || inline.includes(w.value) || /^-[ce]./.test(w.value)))
    return [words, [dynamic(`${words.map((w) => w.text).join(" ")} (code on the command line)`)]];
  // A script named by its path (./build.sh) is read and judged as what it runs.
  if (first.value.includes("/")) return [words, ...scriptFileParts(first, depth, ctx)];
  return [words, ...hiddenInBuiltin(name, words)];
}

type PartsReader = (words: ShellWord[], c: ParsedCommand, depth: number, ctx: JudgeContext) => CommandPart[];

/**
 * Programs that run a command their arguments name (or that the shell's
 * history, bindings or another terminal hold), in syntaxes the rules do not
 * read: each is itself and something unknown, so a deny rule the kernel cannot
 * enforce keeps it from running unattended. `shopt -s expand_aliases` is
 * among them: after it an alias defined on one line is a program on the next.
 */
const RUNS_WHAT_IT_IS_GIVEN = [
  "unshare",
  "nsenter",
  "strace",
  "ltrace",
  "valgrind",
  "perf",
  "gdb",
  "prlimit",
  "setpriv",
  "chrt",
  "numactl",
  "cgexec",
  "cpulimit",
  "trickle",
  "runuser",
  "su",
  "doas",
  "pkexec",
  "sg",
  "faketime",
  "fakeroot",
  "fakechroot",
  "proot",
  "torsocks",
  "proxychains",
  "proxychains4",
  "systemd-run",
  "systemd-nspawn",
  "dbus-run-session",
  "xvfb-run",
  "firejail",
  "bwrap",
  "entr",
  "parallel",
  "rlwrap",
  "unbuffer",
  "expect",
  "tmux",
  "screen",
  "at",
  "batch",
  "setarch",
  "linux32",
  "linux64",
  "chpst",
  "catchsegv",
  "sshpass",
  "ld.so",
  "ld-linux.so.2",
  "ld-linux-x86-64.so.2",
  "ld-linux-aarch64.so.1",
  "fc",
  "bind",
];

/**
 * Programs that run other programs from their arguments, or write files they
 * are given: each says what a rule must see (the program it runs, the file it
 * writes) besides itself.
 */
const PROGRAMS_THAT_RUN_PROGRAMS: Record<string, PartsReader> = {
  env: (w, c, d, x) => envParts(w, c, d, x),
  command: (words, c, depth, ctx) => {
    const seen = new Map<string, string | true>();
    const i = skipOptions(words, 1, { flags: "pvV", withArgument: "" }, seen);
    if (i < 0) return opaque(words);
    return seen.has("v") || seen.has("V") || i >= words.length ? [words] : partsOf(words.slice(i), c, depth, ctx);
  },
  xargs: (w, c, d, x) => xargsParts(w, c, d, x),
  sudo: (words, c, depth, ctx) => {
    // sudo needs a rule of its own, and what it runs must still meet every deny rule.
    const seen = new Map<string, string | true>();
    const i = skipOptions(words, 1, SUDO_SYNTAX, seen);
    if (i < 0) return [words, ...opaque(words)];
    return seen.has("e") || i >= words.length ? [words] : [words, ...partsOf(words.slice(i), c, depth, ctx)];
  },
  eval: (words, _c, depth, ctx) => {
    const args = words.slice(1);
    const unknown = args.find((w) => !w.known);
    if (unknown) return [[unknown]];
    return args.length ? commandParts(args.map((w) => valueOf(w)).join(" "), depth + 1, ctx) : [];
  },
  trap: (words, _c, depth, ctx) => {
    const ops = words.slice(valueOf(words[1]) === "--" ? 2 : 1);
    const action = ops[0];
    if (ops.length < 2 || !action || (action.known && (action.value.startsWith("-") || action.value === "")))
      return [words];
    return [words, ...scriptParts(action, depth, ctx)];
  },
  alias: (words, _c, depth, ctx) => [
    words,
    ...words.slice(1).flatMap((w) => {
      const eq = w.known ? w.value.indexOf("=") : -1;
      if (!w.known) return [[w]];
      return eq > 0 ? commandParts(w.value.slice(eq + 1), depth + 1, ctx) : [];
    }),
  ],
  source: (words, _c, depth, ctx) => [words, ...(words[1] ? scriptFileParts(words[1], depth, ctx) : [])],
  ".": (words, _c, depth, ctx) => [words, ...(words[1] ? scriptFileParts(words[1], depth, ctx) : [])],
  busybox: (words, c, depth, ctx) => (words.length > 1 ? [words, ...partsOf(words.slice(1), c, depth, ctx)] : [words]),
  toybox: (words, c, depth, ctx) => (words.length > 1 ? [words, ...partsOf(words.slice(1), c, depth, ctx)] : [words]),
  git: (w) => gitParts(w),
  find: (w, c, d, x) => findParts(w, c, d, x),
  awk: (w, _c, d, x) => awkParts(w, d, x),
  gawk: (w, _c, d, x) => awkParts(w, d, x),
  mawk: (w, _c, d, x) => awkParts(w, d, x),
  nawk: (w, _c, d, x) => awkParts(w, d, x),
  sed: (w) => sedParts(w),
  sort: (w, c, d, x) => sortParts(w, c, d, x),
  tee: (words) => [
    words,
    ...words
      .slice(1)
      .filter((w) => !w.known || !w.value.startsWith("-"))
      .map(writePart),
  ],
  uniq: (words) => {
    // `-` is an operand (standard input): `uniq - OUT` writes OUT.
    const operands = words.slice(1).filter((w) => !w.known || w.value === "-" || !w.value.startsWith("-"));
    return operands[1] ? [words, writePart(operands[1])] : [words];
  },
  watch: (w, _c, d, x) => watchParts(w, d, x),
  script: (w, _c, d, x) => scriptProgramParts(w, d, x),
  flock: (w, c, d, x) => flockParts(w, c, d, x),
  ...Object.fromEntries(RUNS_WHAT_IT_IS_GIVEN.map((name) => [name, (words: ShellWord[]) => [words, ...opaque(words)]])),
  shopt: (words) => (words.some((w) => !w.known || w.value === "expand_aliases") ? [words, ...opaque(words)] : [words]),
};

/** `env [options] [NAME=value…] command…`: the command, and a part for each risky variable it sets. */
function envParts(words: ShellWord[], c: ParsedCommand, depth: number, ctx: JudgeContext): CommandPart[] {
  const seen = new Map<string, string | true>();
  let i = skipOptions(
    words,
    1,
    {
      flags: "i0v",
      withArgument: "uCS",
      long: {
        "ignore-environment": "flag",
        null: "flag",
        debug: "flag",
        unset: "argument",
        chdir: "argument",
        "split-string": "argument",
      },
    },
    seen,
  );
  if (i < 0) return opaque(words);
  // env -S 'cmd args': the string is split into the command's words (quotes honoured), as a command line.
  const split = seen.get("S") ?? seen.get("split-string");
  if (typeof split === "string")
    return [words, ...commandParts([split, ...words.slice(i).map((w) => w.text)].join(" "), depth + 1, ctx)];
  if (valueOf(words[i]) === "-") i++;
  const parts: CommandPart[] = [];
  for (; i < words.length; i++) {
    const w = words[i]!;
    const assignment = /^([A-Za-z_][A-Za-z0-9_]*)=/.exec(w.known ? w.value : w.text);
    if (!assignment) break;
    if (RISKY_VARIABLE.test(assignment[1]!)) parts.push([dynamic(w.text)]);
  }
  return i >= words.length ? [...parts, words] : [...parts, ...partsOf(words.slice(i), c, depth, ctx)];
}

/** `xargs [options] command…`: the command with its input's words added (or, with -I R, every word holding R unknown). */
function xargsParts(words: ShellWord[], c: ParsedCommand, depth: number, ctx: JudgeContext): CommandPart[] {
  const seen = new Map<string, string | true>();
  const i = skipOptions(words, 1, XARGS_SYNTAX, seen);
  if (i < 0) return opaque(words);
  const I = seen.get("I");
  const legacy = seen.get("i") ?? seen.get("replace");
  const replace = typeof I === "string" ? I : legacy === undefined ? undefined : legacy === true ? "{}" : legacy;
  let inner = words.slice(i);
  if (inner.length === 0) inner = [known("echo")];
  inner =
    replace === undefined
      ? [...inner, XARGS_INPUT]
      : inner.map((w) => (w.known && w.value.includes(replace) ? dynamic(w.text) : w));
  return partsOf(inner, c, depth, ctx);
}

/** A shell: the script of -c, or the here-document or here-string it reads as its script; `bash file.sh` is itself. */
function shellParts(words: ShellWord[], c: ParsedCommand, depth: number, ctx: JudgeContext): CommandPart[] {
  let i = 1;
  let script = false;
  let fromStdin = false;
  for (; i < words.length; i++) {
    const w = words[i]!;
    if (!w.known) return [[w]];
    const a = w.value;
    if (a === "--" || a === "-") {
      i++;
      break;
    }
    if (a === "--rcfile" || a === "--init-file") {
      i++;
      continue;
    }
    if (a.startsWith("--")) continue;
    if (!/^[-+][A-Za-z]+$/.test(a)) break;
    for (const letter of a.slice(1)) {
      if (letter === "c") script = true;
      else if (letter === "s") fromStdin = true;
      else if (letter === "o" || letter === "O") i++;
    }
  }
  const operands = words.slice(i);
  if (script) return operands[0] ? scriptParts(operands[0], depth, ctx) : opaque(words);
  // `bash file.sh`: the script file is read and judged as what it runs.
  if (operands.length > 0 && !fromStdin) return [words, ...scriptFileParts(operands[0]!, depth, ctx)];
  // No script at all, or one from a pipe or a file: what runs is only known when it runs.
  const input = c.stdin.at(-1);
  if (!input) return [[dynamic(words[0]!.text)]];
  if (input.kind === "heredoc" && input.quoted) return commandParts(input.body, depth + 1, ctx);
  if (input.dynamic) return [[dynamic(input.text)]];
  if (input.kind === "herestring") return commandParts(input.body, depth + 1, ctx);
  // An unquoted here-document's backslashes escape $, ` and \ and join lines, as the shell that reads it sees it.
  return commandParts(
    input.body.replace(/\\([$`\\\n])/g, (_m, ch: string) => (ch === "\n" ? "" : ch)),
    depth + 1,
    ctx,
  );
}

/**
 * Builtins that evaluate a variable-name operand as code when it carries a
 * subscript (`test -v 'a[$(git push)]'`, `printf -v`, `read`, `declare`…):
 * one opaque part per such operand.
 */
function hiddenInBuiltin(name: string, words: ShellWord[]): CommandPart[] {
  const args = words.slice(1);
  const plainName = (w: ShellWord) => w.known && IDENTIFIER.test(w.value);
  const afterOption = (option: string) =>
    args.filter((w, k) => k > 0 && valueOf(args[k - 1]) === option && !plainName(w));
  let suspicious: ShellWord[] = [];
  switch (name) {
    case "test":
    case "[":
      suspicious = afterOption("-v");
      break;
    case "printf":
      suspicious = afterOption("-v");
      break;
    case "wait":
      suspicious = afterOption("-p");
      break;
    case "read":
    case "mapfile":
    case "readarray":
    case "unset":
    case "getopts":
      suspicious = args.filter((w) => !w.known || (!w.value.startsWith("-") && /[[\]]/.test(w.value)));
      break;
    case "declare":
    case "typeset":
    case "local":
    case "export":
    case "readonly":
      suspicious = args.filter((w) => {
        if (w.known && w.value.startsWith("-")) return false;
        const m = /^([A-Za-z_][A-Za-z0-9_]*)(\+?=|$)/.exec(w.known ? w.value : w.text);
        return !m || (RISKY_VARIABLE.test(m[1]!) && Boolean(m[2]));
      });
      break;
    case "let":
      suspicious = args.filter((w) => !w.known || !PLAIN_ARITHMETIC.test(w.value));
      break;
  }
  return suspicious.map((w) => [dynamic(w.text)]);
}

// ════════════════════════════════════════════════════════════════════════════
// Command rules: programs that run programs, and scripts a line runs
// Owns: seeing through git's global options and its `-c` settings that run
// code, and the shell scripts a line runs by name (`./s.sh`, `sh s.sh`,
// `. s.sh`), read from disk as they are now. The next section takes the other
// programs that run programs from their arguments.
// ════════════════════════════════════════════════════════════════════════════

/** Scripts are read for judging up to this size; a bigger one (a generated configure) cannot be seen through. */
const MAX_JUDGED_SCRIPT_BYTES = 256 * 1024;

/** The shells a script's first line may name for it to be read as shell code. */
const SHELL_SHEBANG = /^#!\s*(\S*\/)?(env\s+(-\S+\s+)*)?(sh|bash|dash|zsh|ksh|mksh|ash)\b/;

/**
 * The commands of a shell script a line runs (`./s.sh`, `sh s.sh`, `. s.sh`),
 * read from where the line runs, as it is now: another program (an ELF binary,
 * a `#!/usr/bin/env python3` script) adds nothing (it is judged by its name);
 * what cannot be read is one opaque part.
 */
function scriptFileParts(w: ShellWord, depth: number, ctx: JudgeContext): CommandPart[] {
  const cannot = (why: string): CommandPart[] => [[dynamic(`${w.text} (${why})`)]];
  if (!w.known) return cannot("a script named at run time");
  if (ctx.cwd === undefined) return cannot("a script aic did not read");
  let text: string;
  try {
    const file = path.resolve(ctx.cwd, w.value);
    // Non-blocking and type-checked: a FIFO planted under a script's name must not hang the judgement.
    const fd = fs.openSync(file, O.O_RDONLY | O.O_NONBLOCK);
    try {
      const st = fs.fstatSync(fd);
      if (!st.isFile()) return cannot("not a regular file");
      if (st.size > MAX_JUDGED_SCRIPT_BYTES) return cannot(`a script over ${MAX_JUDGED_SCRIPT_BYTES / 1024} KB`);
      const bytes = readOwnFd(fd, MAX_JUDGED_SCRIPT_BYTES);
      if (bytes.subarray(0, 4).equals(Buffer.from("\x7fELF"))) return [];
      text = bytes.toString("utf8");
    } finally {
      fs.closeSync(fd);
    }
  } catch {
    return cannot("a script that does not exist yet or cannot be read");
  }
  if (text.startsWith("#!") && !SHELL_SHEBANG.test(text)) return [];
  try {
    return commandParts(text, depth + 1, ctx);
  } catch (error) {
    if (error instanceof UnreadableCommand) return cannot(`a script aic cannot read: ${error.message}`);
    throw error;
  }
}

/** git's options before the subcommand: those that take a value, and those whose value makes git run a program. */
const GIT_GLOBAL_VALUE = new Set([
  "-C",
  "-c",
  "--git-dir",
  "--work-tree",
  "--namespace",
  "--super-prefix",
  "--config-env",
  "--exec-path",
  "--list-cmds",
]);
const GIT_GLOBAL_FLAG =
  /^(-p|-P|--paginate|--no-pager|--bare|--no-replace-objects|--literal-pathspecs|--no-literal-pathspecs|--glob-pathspecs|--noglob-pathspecs|--icase-pathspecs|--no-optional-locks|--no-advice|--no-lazy-fetch)$/;
/** git's global options that print something and end: what follows them is not a command git runs. */
const GIT_INFO_OPTION = /^(-h|--help|--version|--html-path|--man-path|--info-path)$/;
/** `git -c` settings that make git run a program or read more settings. */
const GIT_CODE_SETTING =
  /^(alias\.|core\.(fsmonitor|pager|editor|sshcommand|hookspath|askpass|gitproxy|attributesfile|excludesfile)$|diff\.|difftool\.|merge\.|mergetool\.|filter\.|credential\.|sequence\.editor|gpg\.|uploadpack\.|receivepack\.|include\.|includeif\.|remote\..*\.(uploadpack|receivepack|proxy)$|http\..*proxy|protocol\.|pager\.|web\.browser|browser\.|instaweb\.|ssh\.|hook\.|init\.templatedir|safe\.)/i;

/**
 * git's own commands (git 2.39, `git --list-cmds=main,nohelpers`). Any other
 * word is a `git-WORD` program on PATH or in git's exec path, or an alias
 * from some config, which can be anything (`alias.p = push`).
 */
const GIT_COMMANDS = new Set(
  `
  add am annotate apply archive bisect blame branch bugreport bundle cat-file check-attr check-ignore
  check-mailmap check-ref-format checkout checkout-index cherry cherry-pick clean clone column commit
  commit-graph commit-tree config count-objects credential credential-cache credential-store daemon
  describe diagnose diff diff-files diff-index diff-tree difftool fast-export fast-import fetch fetch-
  pack filter-branch fmt-merge-msg for-each-ref for-each-repo format-patch fsck fsck-objects gc get-tar-
  commit-id grep hash-object help hook http-backend http-fetch http-push imap-send index-pack init init-
  db instaweb interpret-trailers log ls-files ls-remote ls-tree mailinfo mailsplit maintenance merge
  merge-base merge-file merge-index merge-octopus merge-one-file merge-ours merge-recursive merge-
  recursive-ours merge-recursive-theirs merge-resolve merge-subtree merge-tree mergetool mktag mktree
  multi-pack-index mv name-rev notes pack-objects pack-redundant pack-refs patch-id pickaxe prune prune-
  packed pull push quiltimport range-diff read-tree rebase receive-pack reflog remote remote-ext remote-
  fd remote-ftp remote-ftps remote-http remote-https repack replace request-pull rerere reset restore
  rev-list rev-parse revert rm send-pack shell shortlog show show-branch show-index show-ref sparse-
  checkout stage stash status stripspace submodule subtree switch symbolic-ref tag unpack-file unpack-
  objects update-index update-ref update-server-info upload-archive upload-pack var verify-commit
  verify-pack verify-tag version whatchanged worktree write-tree
`
    .trim()
    .split(/\s+/),
);
/** Commands that push under another name (receive-pack is a push's far half, which a local push starts): a rule about `git push` covers them. */
const GIT_PUSHES = new Set(["send-pack", "http-push", "receive-pack"]);
/** Where git looks for `git-WORD` programs besides PATH. */
const GIT_EXEC_PATHS = ["/usr/lib/git-core", "/usr/libexec/git-core", "/usr/local/libexec/git-core"];

/** What `git WORD` runs when WORD is not one of git's own commands: a program, or undefined for an alias. */
function gitExternalCommand(word: string): string | undefined {
  if (word.includes("/")) return undefined;
  const dirs = [...(process.env.PATH ?? "").split(":"), ...GIT_EXEC_PATHS].filter((d) => path.isAbsolute(d));
  return dirs.some((d) => fs.existsSync(path.join(d, `git-${word}`))) ? `git-${word}` : undefined;
}

/**
 * `git [global options] SUBCOMMAND …` as the rules see it: `git -C . --no-pager push` is `git push`. A `-c`
 * setting that runs code (an alias starting with !, core.fsmonitor, a pager, a filter…), --exec-path or
 * --config-env is a part of its own that no rule can allow, and so is a subcommand that is neither git's own
 * nor a `git-WORD` program: an alias, which can stand for anything. `git send-pack` is also `git push`.
 */
function gitParts(words: ShellWord[]): CommandPart[] {
  const parts: CommandPart[] = [];
  let elsewhere = false;
  let i = 1;
  for (; i < words.length; i++) {
    const w = words[i]!;
    if (!w.known) break; // a word known only as it runs: the part keeps it, and may match a rule
    const eq = w.value.indexOf("=");
    const option = w.value.startsWith("--") && eq > 0 ? w.value.slice(0, eq) : w.value;
    if (GIT_GLOBAL_FLAG.test(option)) continue;
    if (!GIT_GLOBAL_VALUE.has(option)) break;
    if (["-C", "--git-dir", "--work-tree"].includes(option)) elsewhere = true;
    const value = eq > 0 && option !== w.value ? known(w.value.slice(eq + 1)) : words[++i];
    if (!value?.known) return [words, ...opaque(words)];
    const setting = option === "-c" ? value.value.split("=")[0]! : "";
    if (option === "--exec-path" || option === "--config-env" || GIT_CODE_SETTING.test(setting))
      parts.push([dynamic(`git ${option} ${value.value} (makes git run a program)`)]);
  }
  const sub = valueOf(words[i]);
  // A global option this list does not know (git gains some in every release) may take the next word as its value:
  // what git then runs cannot be told, so it is judged as unknown, never as the words after it.
  if (sub?.startsWith("-") && !GIT_INFO_OPTION.test(sub))
    parts.push([dynamic(`git ${sub} (a global option aic does not know: what git runs after it cannot be told)`)]);
  if (sub && GIT_PUSHES.has(sub)) parts.push([words[0]!, known("push"), ...words.slice(i + 1)]);
  else if (sub && !sub.startsWith("-") && !GIT_COMMANDS.has(sub) && !gitExternalCommand(sub))
    parts.push([dynamic(`git ${sub} (not one of git's own commands: an alias, which can stand for anything)`)]);
  const runs = sub ? gitRunsWhatItIsGiven(sub, words.slice(i + 1)) : undefined;
  if (runs) parts.push([dynamic(`git ${sub} ${runs} (runs a program it is given)`)]);
  // log, diff, show and archive write the file of --output (-o for archive) instead of printing.
  for (let k = i + 1; k < words.length; k++) {
    const v = valueOf(words[k]);
    if (v?.startsWith("--output=")) parts.push(writePart(known(v.slice("--output=".length))));
    else if ((v === "--output" || (v === "-o" && valueOf(words[i]) === "archive")) && words[k + 1])
      parts.push(writePart(words[++k]!));
  }
  const main: CommandPart = [words[0]!, ...words.slice(i)];
  if (elsewhere) gitPointedElsewhere.add(main);
  return [main, ...parts];
}

/**
 * git parts whose global options (-C, --git-dir, --work-tree) point git at
 * another repository, whose config a command may have written: the rules
 * judge them as the subcommand they run, but they are never read-only.
 */
const gitPointedElsewhere = new WeakSet<CommandPart>();

/**
 * git subcommands' own options (and operands) that run a command they are
 * given: `rebase --exec`, `bisect run`, `fetch --upload-pack=`, `submodule
 * foreach`, `difftool -x`, `grep -O`, filter-branch's filters. Global options
 * that do so are read in gitParts.
 */
const GIT_SUBCOMMAND_RUNS: Record<string, { options: string[]; operands?: string[] }> = {
  rebase: { options: ["--exec", "-x"] },
  bisect: { options: [], operands: ["run"] },
  submodule: { options: [], operands: ["foreach"] },
  fetch: { options: ["--upload-pack"] },
  pull: { options: ["--upload-pack"] },
  clone: { options: ["--upload-pack", "-u", "--template"] },
  "ls-remote": { options: ["--upload-pack", "--exec"] },
  push: { options: ["--receive-pack", "--exec"] },
  "send-pack": { options: ["--receive-pack", "--exec"] },
  "fetch-pack": { options: ["--upload-pack", "--exec"] },
  archive: { options: ["--exec"] },
  difftool: { options: ["-x", "--extcmd", "-t", "--tool"] },
  mergetool: { options: ["-t", "--tool"] },
  grep: { options: ["-O", "--open-files-in-pager"] },
  "filter-branch": {
    options: [
      "--env-filter",
      "--tree-filter",
      "--index-filter",
      "--parent-filter",
      "--msg-filter",
      "--commit-filter",
      "--tag-name-filter",
    ],
  },
};

/** The option or operand of `git SUB ARGS…` that runs a program it is given, if any. */
function gitRunsWhatItIsGiven(sub: string, args: ShellWord[]): string | undefined {
  const spec = GIT_SUBCOMMAND_RUNS[sub];
  if (!spec) return undefined;
  for (const w of args) {
    if (!w.known) continue;
    const name = w.value.includes("=") ? w.value.slice(0, w.value.indexOf("=")) : w.value;
    if (spec.options.some((o) => name === o || (o.length === 2 && name.startsWith(o) && !o.startsWith("--"))))
      return w.value;
    if (spec.operands?.includes(w.value)) return w.value;
  }
  return undefined;
}

// ════════════════════════════════════════════════════════════════════════════
// Command rules: find, sort, watch, flock, awk and sed
// Owns: the programs whose options or scripts name a command to run or a file
// to write: what each of them runs and writes, as parts the verdict judges.
// ════════════════════════════════════════════════════════════════════════════

/** find's actions that run a command (up to `;` or `+`), and those that write a file they name. */
const FIND_RUNS = new Set(["-exec", "-execdir", "-ok", "-okdir"]);
const FIND_WRITES: Record<string, number> = { "-fprint": 1, "-fprint0": 1, "-fls": 1, "-fprintf": 1 };

/** `find … -exec CMD {} ;`: CMD (with `{}` a word only known as it runs); `-delete` is rm; `-fprint FILE` writes FILE. */
function findParts(words: ShellWord[], c: ParsedCommand, depth: number, ctx: JudgeContext): CommandPart[] {
  const parts: CommandPart[] = [words];
  for (let i = 1; i < words.length; i++) {
    const w = words[i]!;
    if (!w.known) continue;
    if (w.value === "-delete") parts.push([known("rm"), dynamic("{} (find -delete)")]);
    else if (FIND_WRITES[w.value] !== undefined && words[i + 1]) parts.push(writePart(words[++i]!));
    else if (FIND_RUNS.has(w.value)) {
      let end = i + 1;
      while (end < words.length && !(words[end]!.known && [";", "+"].includes(valueOf(words[end])!))) end++;
      const inner = words.slice(i + 1, end).map((x) => (x.known && x.value.includes("{}") ? dynamic(x.text) : x));
      if (inner.length) parts.push(...partsOf(inner, c, depth, ctx));
      i = end;
    }
  }
  return parts;
}

/** `sort --compress-program=PROG` runs PROG; `sort -o FILE` writes FILE. */
function sortParts(words: ShellWord[], c: ParsedCommand, depth: number, ctx: JudgeContext): CommandPart[] {
  const parts: CommandPart[] = [words];
  for (let i = 1; i < words.length; i++) {
    const w = words[i]!;
    if (!w.known) continue;
    const [option, attached] = w.value.startsWith("--") ? w.value.split(/=(.*)/s) : [w.value, undefined];
    // GNU sort takes any unambiguous prefix: --compress-prog, --outp.
    if (isOption(option!, "--compress-program")) {
      const prog = attached !== undefined ? known(attached) : words[++i];
      if (prog) parts.push(...partsOf([prog], c, depth, ctx));
    } else if (isOption(option!, "--output")) {
      const file = attached !== undefined ? known(attached) : words[++i];
      if (file) parts.push(writePart(file));
    } else if (/^-[A-Za-z]*o/.test(w.value) && !w.value.startsWith("--")) {
      const after = w.value.slice(w.value.indexOf("o") + 1);
      const file = after ? known(after) : words[++i];
      if (file) parts.push(writePart(file));
    }
  }
  return parts;
}

/** `watch [options] CMD…` runs its words joined, through `sh -c` (or directly with -x). */
function watchParts(words: ShellWord[], depth: number, ctx: JudgeContext): CommandPart[] {
  const i = skipOptions(words, 1, {
    flags: "bcdeghtpx",
    withArgument: "nq",
    long: Object.fromEntries(
      [
        ["interval", "argument"],
        ["differences", "optional"],
        ["no-title", "flag"],
        ["beep", "flag"],
        ["errexit", "flag"],
        ["chgexit", "flag"],
        ["exec", "flag"],
        ["color", "flag"],
        ["no-color", "flag"],
        ["precise", "flag"],
        ["no-wrap", "flag"],
        ["equexit", "argument"],
        ["no-linewrap", "flag"],
      ].map(([k, v]) => [k!, v as "flag" | "argument" | "optional"]),
    ),
  });
  if (i < 0 || words.slice(i).some((w) => !w.known)) return [words, ...opaque(words)];
  return i >= words.length
    ? [words]
    : [
        words,
        ...commandParts(
          words
            .slice(i)
            .map((w) => w.text)
            .join(" "),
          depth + 1,
          ctx,
        ),
      ];
}

/** `script [-c CMD] [FILE]`: the command it runs (a shell, without -c), and the typescript file it writes. */
function scriptProgramParts(words: ShellWord[], depth: number, ctx: JudgeContext): CommandPart[] {
  const seen = new Map<string, string | true>();
  const i = skipOptions(
    words,
    1,
    {
      flags: "aeEfqkT",
      withArgument: "cIOBtmE",
      long: {
        command: "argument",
        append: "flag",
        quiet: "flag",
        flush: "flag",
        return: "flag",
        timing: "optional",
        "log-io": "argument",
        "log-in": "argument",
        "log-out": "argument",
        echo: "argument",
      },
    },
    seen,
  );
  if (i < 0) return [words, ...opaque(words)];
  const command = seen.get("c") ?? seen.get("command");
  const parts: CommandPart[] = [words];
  if (typeof command === "string") parts.push(...commandParts(command, depth + 1, ctx));
  else parts.push([dynamic(`${words.map((w) => w.text).join(" ")} (an interactive shell)`)]);
  if (words[i]) parts.push(writePart(words[i]!));
  return parts;
}

/** `flock [options] LOCKFILE CMD…` or `flock … LOCKFILE -c CMDSTRING` (a number instead of a file: no command). */
function flockParts(words: ShellWord[], c: ParsedCommand, depth: number, ctx: JudgeContext): CommandPart[] {
  const seen = new Map<string, string | true>();
  const syntax: OptionSyntax = {
    flags: "sxunoFeh",
    withArgument: "wEc",
    long: {
      shared: "flag",
      exclusive: "flag",
      unlock: "flag",
      nonblock: "flag",
      close: "flag",
      "no-fork": "flag",
      verbose: "flag",
      timeout: "argument",
      "conflict-exit-code": "argument",
      command: "argument",
    },
  };
  const i = skipOptions(words, 1, syntax, seen);
  if (i < 0) return [words, ...opaque(words)];
  const j = skipOptions(words, i + 1, syntax, seen);
  if (j < 0) return [words, ...opaque(words)];
  const command = seen.get("c") ?? seen.get("command");
  if (typeof command === "string") return [words, ...commandParts(command, depth + 1, ctx)];
  return j >= words.length ? [words] : [words, ...partsOf(words.slice(j), c, depth, ctx)];
}

/** The text of each double-quoted string literal of awk code, and where it ends. */
const AWK_STRING = /"((?:[^"\\]|\\.)*)"/g;

/**
 * An awk program: `system("CMD")`, `"CMD" | getline` and `print | "CMD"` run
 * CMD through a shell; `print > "FILE"` writes FILE. A literal CMD or FILE is
 * judged like any other; one built at run time cannot be seen through.
 */
function awkParts(words: ShellWord[], depth: number, ctx: JudgeContext): CommandPart[] {
  const seen = new Map<string, string | true>();
  const i = skipOptions(
    words,
    1,
    { flags: "", withArgument: "fFv", long: { file: "argument", "field-separator": "argument", assign: "argument" } },
    seen,
  );
  if (i < 0) return [words, ...opaque(words)];
  if (seen.has("f") || seen.has("file"))
    return [words, [dynamic(`${words[0]!.text} -f (an awk program aic did not read)`)]];
  const program = words[i];
  if (!program) return [words];
  if (!program.known) return [words, [program]];
  const parts: CommandPart[] = [words];
  const code = program.value;
  const literal = (at: number) => {
    AWK_STRING.lastIndex = at;
    const m = AWK_STRING.exec(code);
    return m && m.index === at ? m : undefined;
  };
  const unseen = (what: string) => parts.push([dynamic(`${what} in ${words[0]!.text} code`)]);
  // awk joins adjacent strings (`"cat" "; id"` is "cat; id"): a literal counts only when nothing is joined to it.
  const endsHere = (at: number) => /^[ \t]*($|[;}\n)|])/.test(code.slice(at));
  const startsHere = (at: number) => /(^|[;{(\n]|&&|\|\|)[ \t]*$/.test(code.slice(0, at));
  for (const m of code.matchAll(/\bsystem\s*\(\s*/g)) {
    const s = literal(m.index + m[0].length);
    if (s && /^\s*\)/.test(code.slice(s.index + s[0].length)))
      parts.push(...commandParts(awkUnescape(s[1]!), depth + 1, ctx));
    else unseen("system() of a command built at run time");
  }
  for (const m of code.matchAll(/(\|&?|>>?)\s*/g)) {
    if (m[0].startsWith("|") && (code[m.index - 1] === "|" || code[m.index + 1] === "|")) continue; // ||
    const found = literal(m.index + m[0].length);
    const s = found && endsHere(found.index + found[0].length) ? found : undefined;
    const quoted = /"((?:[^"\\]|\\.)*)"\s*$/.exec(code.slice(0, m.index));
    const before = quoted && startsHere(quoted.index) ? quoted : undefined;
    if (m[0].startsWith(">")) {
      if (s) parts.push(writePart(known(awkUnescape(s[1]!))));
      else if (found) unseen("a file name joined from strings");
      continue; // `a > b` outside a print is a comparison
    }
    const cmd = s?.[1] ?? (/^\s*getline/.test(code.slice(m.index + m[0].length)) ? before?.[1] : undefined);
    if (cmd !== undefined) parts.push(...commandParts(awkUnescape(cmd), depth + 1, ctx));
    else unseen("a pipe to or from a command built at run time");
  }
  return parts;
}

const awkUnescape = (s: string) =>
  s.replace(/\\(.)/g, (_m, ch: string) => ({ n: "\n", t: "\t", '"': '"', "\\": "\\" })[ch] ?? ch);

/** sed's options: -e SCRIPT, -f FILE, -i[SUFFIX] (edit files in place), -l N. */
const SED_SYNTAX: OptionSyntax = {
  flags: "nrEsuz",
  withArgument: "efl",
  optionalArgument: "i",
  long: Object.fromEntries(
    [
      ["expression", "argument"],
      ["file", "argument"],
      ["in-place", "optional"],
      ["line-length", "argument"],
      ["quiet", "flag"],
      ["silent", "flag"],
      ["regexp-extended", "flag"],
      ["separate", "flag"],
      ["unbuffered", "flag"],
      ["null-data", "flag"],
      ["zero-terminated", "flag"],
      ["debug", "flag"],
      ["posix", "flag"],
      ["sandbox", "flag"],
      ["follow-symlinks", "flag"],
    ].map(([k, v]) => [k!, v as "flag" | "argument" | "optional"]),
  ),
};

/** `sed`: its script's `e` command and `s///e` run commands; `w FILE` and `-i` write files. */
function sedParts(words: ShellWord[]): CommandPart[] {
  const seen = new Map<string, string | true>();
  const i = skipOptions(words, 1, SED_SYNTAX, seen);
  if (i < 0) return [words, ...opaque(words)];
  // Every script given with -e (skipOptions keeps only the last): -e S, --expression=S, -neS.
  const given: ShellWord[] = [];
  for (let k = 1; k < i; k++) {
    const v = valueOf(words[k]);
    if (v === "-e" || v === "--expression") given.push(words[++k]!);
    else if (v?.startsWith("--expression=")) given.push(known(v.slice("--expression=".length)));
    else if (v && /^-[nrEsuz]*e./.test(v)) given.push(known(v.slice(v.indexOf("e") + 1)));
  }
  const operands = words.slice(i);
  const script = given.length ? given : operands.slice(0, 1);
  const files = given.length ? operands : operands.slice(1);
  const parts: CommandPart[] = [words];
  if (seen.has("f") || seen.has("file")) parts.push([dynamic(`${words[0]!.text} -f (a sed script aic did not read)`)]);
  if (seen.has("i") || seen.has("in-place")) parts.push(...files.map(writePart));
  if (seen.has("sandbox")) return parts; // sed refuses e, w and r itself
  for (const w of script) parts.push(...(w.known ? sedEffects(w.value) : [[w]]));
  return parts;
}

/** What one sed script does beyond printing: `e` runs commands (unseen), `w FILE` writes FILE. Unparseable: unseen. */
function sedEffects(script: string): CommandPart[] {
  const out: CommandPart[] = [];
  const runs = () => out.push([dynamic(`sed e (runs a command from the text)`)]);
  let i = 0;
  const at = () => script[i] ?? "";
  const toLineEnd = () => {
    const end = script.indexOf("\n", i);
    const text = script.slice(i, end < 0 ? script.length : end);
    i = end < 0 ? script.length : end;
    return text.trim();
  };
  // GNU sed ends a label (: b t T) and the number of q Q l L at a semicolon too: `:a;w f` writes f.
  const toSemicolon = () => {
    while (i < script.length && !/[;\n]/.test(at())) i++;
  };
  const regex = () => {
    const delim = at() === "\\" ? script[++i] : "/";
    i++;
    while (i < script.length && at() !== delim) i += at() === "\\" ? 2 : 1;
    i++;
  };
  while (i < script.length) {
    while (/[\s;]/.test(at())) i++;
    if (i >= script.length) break;
    // Addresses: numbers, $, /regex/, \cregexc, with , ~ + and !.
    for (let n = 0; n < 2; n++) {
      if (/[0-9$]/.test(at())) while (/[0-9$~+]/.test(at())) i++;
      else if (at() === "/" || at() === "\\") regex();
      if (at() === ",") i++;
      else break;
    }
    while (/[\s!]/.test(at())) i++;
    const cmd = at();
    i++;
    if (cmd === "e") {
      runs();
      toLineEnd();
    } else if (cmd === "w" || cmd === "W") out.push(writePart(known(toLineEnd())));
    else if ("aicrR".includes(cmd)) toLineEnd();
    else if (":btTvqQlL".includes(cmd)) toSemicolon();
    else if (cmd === "s" || cmd === "y") {
      const delim = at();
      if (!delim || delim === "\n" || delim === "\\") return [[dynamic(`sed script ${JSON.stringify(script)}`)]];
      for (let k = 0; k < 2; k++) {
        i++;
        while (i < script.length && at() !== delim) i += at() === "\\" ? 2 : 1;
      }
      i++;
      if (cmd === "s")
        while (i < script.length && !/[\s;}]/.test(at())) {
          const flag = at();
          i++;
          if (flag === "e") runs();
          if (flag === "w") {
            out.push(writePart(known(toLineEnd())));
            break;
          }
        }
    } else if (!"{}=dDgGhHnNpPxzF#".includes(cmd)) return [[dynamic(`sed script ${JSON.stringify(script)}`)]];
    else if (cmd === "#") toLineEnd();
  }
  return out;
}

// ════════════════════════════════════════════════════════════════════════════
// Command rules: the verdict
// Owns: `.aicrules` (or --rules FILE): reading it as hostile ground (it sits
// where commands write), its lines and what is wrong with them, the verdict
// for a command (deny beats ask beats allow; a part no rule allows is asked),
// noticing that the file changed on disk (a change takes no effect until the
// person reloads it), and the line an "always allow" answer adds.
// ════════════════════════════════════════════════════════════════════════════

type RuleAction = "allow" | "ask" | "deny";

/** What one kind of rule does, wherever rules are read. */
interface RuleKind {
  /** Which kind decides when rules of several kinds fit one part (or the parts of one line): the higher. */
  rank: number;
  /**
   * The verdict a rule of this kind gives a part it surely fits, and one a
   * word known only as it runs may make it fit (null: it is passed over).
   */
  fits: { yes: RuleAction; maybe: RuleAction | null };
  /**
   * Its pattern errs toward matching: any further words, as if it ended in
   * `*`, and a command word by its base name (`/usr/bin/git push` is `git
   * push`). Otherwise it matches only what it says (`./git status` is not git).
   */
  wide: boolean;
  /**
   * At the approval gate: `run` without asking (decision `allowed` in JSON),
   * `refuse` even under auto-approve (`denied`, also the command_result's
   * status), or `ask`: being read-only, auto-approve or the person decide, the
   * dialog offers "Always allow", and with nobody to answer it is refused for
   * want of a person. A refusing rule's reason is told to the model, and
   * while one holds, what aic cannot see through never runs unapproved.
   */
  gate: "run" | "refuse" | "ask";
  /** How the system prompt names the commands such rules match: "these are refused: `git push *`". */
  prompt: string;
}

/**
 * Every kind of rule, in the order the system prompt lists them: the one
 * place that says what allow, ask and deny do, so a new kind is one more
 * entry here, with every question answered.
 */
const RULE_KINDS: Record<RuleAction, RuleKind> = {
  allow: { rank: 0, fits: { yes: "allow", maybe: null }, wide: false, gate: "run", prompt: "run without asking" },
  deny: { rank: 2, fits: { yes: "deny", maybe: "ask" }, wide: true, gate: "refuse", prompt: "are refused" },
  ask: {
    rank: 1,
    fits: { yes: "ask", maybe: "ask" },
    wide: true,
    gate: "ask",
    prompt: "always wait for a person's approval",
  },
};

/** Whether a rules file line's first word names a kind of rule. */
function isRuleAction(word: string | undefined): word is RuleAction {
  return word !== undefined && Object.hasOwn(RULE_KINDS, word);
}

/** A rule that refuses what it matches: what it names never runs, whoever approves. */
function refuses(rule: CommandRule): boolean {
  return RULE_KINDS[rule.action].gate === "refuse";
}

/** One line of the rules file. */
interface CommandRule {
  action: RuleAction;
  /** The pattern's words, without a trailing `*`. For a write rule (`allow write build/*`): the path pattern alone. */
  words: string[];
  /** The pattern ends in `*`: any further words match. deny and ask patterns always match this way. */
  anyRest: boolean;
  /** A write rule: it judges the files a line writes, by path (`*` matches any characters, `/` included). */
  write?: RegExp;
  /** The line as written, for messages: which rule decided. */
  text: string;
  /** The rule without its comment: `deny git push *`. */
  written: string;
  lineNumber: number;
  /** What follows ` # ` on the line: the reason a deny gives the model. */
  reason?: string;
}

/** What the rules say about one command line. */
interface RuleVerdict {
  verdict: RuleAction;
  /** The rule that decided (none: no rule allows a part, or the line could not be read). */
  rule?: CommandRule;
  /** The part that decided, as words. */
  part?: string;
  /** Why the line could not be read, when it could not. */
  unreadable?: string;
  /** Every part, for an "always allow" answer. */
  parts?: CommandPart[];
  /** Provably read-only: no write, no delete, no command run from data, no network (see READ_ONLY). */
  readOnly?: boolean;
  /**
   * The allow rule that lets every part run once read-only parts are let run unasked too
   * (`npm test 2>&1 | tail -20` under `allow npm test *`); undefined when some part is neither.
   */
  allowedBesideReads?: CommandRule;
  /**
   * What the judgement cannot see through: a program named only as it runs, code on the command line, a
   * script that cannot be read, a deny rule a word known only at run time could match. Undefined when
   * every part is known.
   */
  unsure?: string;
}

const RULES_FILE_NAME = ".aicrules";
/** A rules file is a page of text; a bigger one is refused, not half-read. */
const MAX_RULES_BYTES = 256 * 1024;
/** How many patterns of each kind the system prompt names. */
const PROMPT_RULES_LISTED = 30;

/** A write rule's path pattern as a regular expression: `*` is any characters (a whole subtree), `?` one. */
function writePattern(glob: string): RegExp {
  const body = glob
    .replace(/[.+^${}()|[\]\\]/g, "\\$&")
    .replace(/\*/g, ".*")
    .replace(/\?/g, ".");
  return new RegExp(`^${body}$`);
}

/** Rule lines and, for each line that is not a rule, what is wrong with it (reported, then ignored). */
function parseRuleLines(text: string, firstLine = 1): { rules: CommandRule[]; problems: string[] } {
  const rules: CommandRule[] = [];
  const problems: string[] = [];
  text.split("\n").forEach((raw, index) => {
    const line = raw.trim();
    if (!line || line.startsWith("#")) return;
    const lineNumber = index + firstLine;
    const problem = (why: string) => problems.push(`line ${lineNumber}: ${why}: ${visibleControls(line)}`);
    const hash = line.search(/\s#/);
    const body = (hash < 0 ? line : line.slice(0, hash)).trim();
    const reason = hash < 0 ? undefined : line.slice(hash).replace(/^\s*#\s*/, "") || undefined;
    const [action, ...words] = body.split(/\s+/);
    if (!isRuleAction(action)) {
      const kinds = Object.keys(RULE_KINDS).sort();
      return problem(`a rule starts with ${kinds.slice(0, -1).join(", ")} or ${kinds.at(-1)}`);
    }
    if (words.length === 0) return problem(`${action} needs a pattern (shell words, or * for any command)`);
    if (words.some((w) => /['"\\`$]/.test(w)))
      return problem("a pattern is plain words as the command's words read after quoting (no quotes, \\, $ or `)");
    const base = { action, text: line, written: body, lineNumber, reason } as const;
    if (words[0] === "write") {
      if (words.length !== 2) return problem("a write rule names one path pattern: allow write build/*");
      return void rules.push({ ...base, words: [words[1]!], anyRest: false, write: writePattern(words[1]!) });
    }
    const anyRest = words.at(-1) === "*";
    if (anyRest) words.pop();
    if (words.includes("*")) return problem("* may only be a pattern's last word");
    rules.push({ ...base, words, anyRest: anyRest || RULE_KINDS[action].wide });
  });
  return { rules, problems };
}

/**
 * Whether `rule` matches `part`: "yes"; "maybe" when a word only known as it
 * runs could make it match; "no". A wide pattern (deny, ask) also matches a
 * command word by its base name (`/usr/bin/git push` is `git push`); allow
 * patterns need it exactly (`./git status` is not git). Write rules match
 * only the files a line writes, by path from the start directory.
 */
function ruleFits(rule: CommandRule, part: CommandPart, ctx: VerdictContext = {}): "yes" | "maybe" | "no" {
  if (isWritePart(part) || rule.write) {
    if (!isWritePart(part) || !rule.write) return "no";
    const target = part[1]!;
    if (!target.known) return "maybe";
    return writtenPaths(target.value, ctx).some((p) => rule.write!.test(p)) ? "yes" : "no";
  }
  const pattern = rule.words;
  for (let k = 0; k < part.length; k++) {
    const w = part[k]!;
    if (k >= pattern.length) {
      if (rule.anyRest) return "yes";
      return !w.known && part.slice(k).every((x) => !x.known) ? "maybe" : "no";
    }
    if (!w.known) return "maybe";
    const same =
      w.value === pattern[k] || (k === 0 && RULE_KINDS[rule.action].wide && baseName(w.value) === pattern[0]);
    if (!same) return "no";
  }
  return part.length === pattern.length ? "yes" : "no";
}

/** Where a line is judged: the agent's directory (relative writes), and the start directory (write rules' paths). */
interface VerdictContext extends JudgeContext {
  root?: string;
}

/** The ways a write rule may name a written file: relative to the start directory (when inside it), and absolute. */
function writtenPaths(target: string, ctx: VerdictContext): string[] {
  const absolute = path.resolve(ctx.cwd ?? ctx.root ?? "/", target);
  const relative = ctx.root ? path.relative(ctx.root, absolute) : target;
  return relative && !relative.startsWith("..") && !path.isAbsolute(relative) ? [relative, absolute] : [absolute];
}

/**
 * The verdict for one part: the first rule of the highest-ranked kind that
 * fits decides, one whose fit gives the stronger verdict first (a matching
 * deny; a deny it may match, asked; an ask rule; an allow rule); else asked.
 */
function partVerdict(
  rules: readonly CommandRule[],
  part: CommandPart,
  ctx: VerdictContext = {},
): { verdict: RuleAction; rule?: CommandRule } {
  if (part.length === 0 || !part[0]!.known) return { verdict: "ask" };
  let best: { verdict: RuleAction; rule: CommandRule; rank: number; strength: number } | undefined;
  for (const rule of rules) {
    const fit = ruleFits(rule, part, ctx);
    const verdict = fit === "no" ? null : RULE_KINDS[rule.action].fits[fit];
    if (verdict === null) continue;
    const rank = RULE_KINDS[rule.action].rank;
    const strength = RULE_KINDS[verdict].rank;
    if (!best || rank > best.rank || (rank === best.rank && strength > best.strength))
      best = { verdict, rule, rank, strength };
  }
  return best ? { verdict: best.verdict, rule: best.rule } : { verdict: "ask" };
}

const partText = (part: CommandPart) =>
  isWritePart(part)
    ? `writing ${part[1]!.known ? part[1]!.value : part[1]!.text}`
    : part.map((w) => (w.known ? w.value : w.text)).join(" ");

/** Writes into a repository's config or hooks change what git runs later: never seen through. */
const GIT_CODE_PATH = /(^|\/)\.git\/(config|hooks(\/|$)|info\/attributes|modules\/)/;

/**
 * The verdict for a whole line: its strictest part's (deny if any part is
 * denied, else ask if any part is asked, else allow), one a rule decided
 * first. A refused line needs no more reading.
 */
function judgeCommand(rules: readonly CommandRule[], command: string, ctx: VerdictContext = {}): RuleVerdict {
  let parts: CommandPart[];
  try {
    parts = commandParts(command, 0, ctx);
  } catch (error) {
    if (!(error instanceof UnreadableCommand)) throw error;
    return { verdict: "ask", unreadable: error.message, unsure: `aic cannot read the command line (${error.message})` };
  }
  const judged = parts.map((part) => ({ part, ...partVerdict(rules, part, ctx) }));
  const decide = (v: (typeof judged)[number] | undefined): RuleVerdict =>
    v ? { verdict: v.verdict, rule: v.rule, part: partText(v.part), parts } : { verdict: "allow", parts };
  const top = Math.max(...judged.map((v) => RULE_KINDS[v.verdict].rank));
  const strictest = judged.filter((v) => RULE_KINDS[v.verdict].rank === top);
  const verdict = decide(strictest.find((v) => v.rule) ?? strictest[0]);
  if (RULE_KINDS[verdict.verdict].gate === "refuse") return verdict;
  const unsure = unsureAbout(judged);
  const elsewhere = gitElsewhere(parts);
  const readOnly = parts.length > 0 && parts.every(isReadOnlyPart) && !elsewhere;
  return {
    ...verdict,
    unsure,
    readOnly,
    allowedBesideReads: unsure || elsewhere ? undefined : allowedBesideReads(judged),
  };
}

/** The allow rule of a line whose every other part only reads: what the person allowed, piped through `tail`. */
function allowedBesideReads(
  judged: { part: CommandPart; verdict: RuleAction; rule?: CommandRule }[],
): CommandRule | undefined {
  const allowed = judged.find((v) => v.rule && RULE_KINDS[v.verdict].gate === "run")?.rule;
  // A change of directory is no mere read here: it would run the allowed command in another project.
  const moves = (part: CommandPart) => part[0]?.known && ["cd", "pushd", "popd"].includes(part[0].value);
  const rest = judged.every(
    (v) => RULE_KINDS[v.verdict].gate === "run" || (!v.rule && isReadOnlyPart(v.part) && !moves(v.part)),
  );
  return allowed && rest ? allowed : undefined;
}

/**
 * A line that changes directory before running git may point it at a
 * repository outside the project, whose config the command could have
 * written (core.fsmonitor runs a program): never read-only then.
 */
function gitElsewhere(parts: readonly CommandPart[]): boolean {
  const moved = parts.findIndex((p) => p[0]?.known && ["cd", "pushd"].includes(p[0].value) && p.length > 1);
  return moved >= 0 && parts.slice(moved + 1).some((p) => p[0]?.known && baseName(p[0].value) === "git");
}

/** The first thing about a line's parts that the judgement cannot see through, worded for the model. */
function unsureAbout(judged: { part: CommandPart; verdict: RuleAction; rule?: CommandRule }[]): string | undefined {
  for (const { part, verdict, rule } of judged) {
    const first = part[0];
    if (!first?.known) return `\`${oneLine(first?.text ?? "", 80)}\` is only known when it runs`;
    if (isWritePart(part) && (!part[1]!.known || GIT_CODE_PATH.test(part[1]!.value)))
      return part[1]!.known
        ? `it writes ${part[1]!.value}, which changes what git runs later`
        : `it writes a file named only as it runs (${part[1]!.text})`;
    if (rule && refuses(rule) && verdict !== rule.action)
      return `\`${oneLine(partText(part), 80)}\` could turn out to be what the rule "${rule.written}" forbids once its words are known`;
  }
  return undefined;
}

// ════════════════════════════════════════════════════════════════════════════
// Command rules: read-only programs and always-allow
// Owns: which command lines only read (they run without asking) and the rule
// lines an "always allow" answer may add (a program and subcommand, never a
// literal argument).
// ════════════════════════════════════════════════════════════════════════════

/** A read-only program's check of its words (after the program): true when this use of it only reads. */
type ReadOnlyCheck = (args: ShellWord[]) => boolean;

const anyArgs: ReadOnlyCheck = () => true;
const knownArgs: ReadOnlyCheck = (args) => args.every((w) => w.known);
/**
 * Whether `word` is `option` as getopt reads it: `--output=F`, an
 * unambiguous prefix such as `--outp=F` (GNU tools accept those), or a short
 * option inside a group (`-uo F` is `-u -o F`).
 */
function isOption(word: string, option: string): boolean {
  if (option.startsWith("--")) {
    const name = word.split("=")[0]!;
    return name.length > 2 && name.startsWith("--") && option.startsWith(name);
  }
  return word === option || (/^-[^-]/.test(word) && word.includes(option[1]!));
}

/** No word is one of these options (a dynamic word might be one). */
const without =
  (...options: string[]): ReadOnlyCheck =>
  (args) =>
    args.every((w) => w.known && !options.some((o) => isOption(w.value, o)));
/** At most `n` operands (uniq IN OUT, xxd IN OUT write the second; `-` is an operand: standard input). */
const operandsAtMost =
  (n: number): ReadOnlyCheck =>
  (args) =>
    knownArgs(args) && args.filter((w) => w.known && (w.value === "-" || !w.value.startsWith("-"))).length <= n;

/** `date` shows the time unless told to set it: `-s`/`--set`, or an operand that is not a +FORMAT (`date 010100002000`). */
function dateOnlyReads(args: ShellWord[]): boolean {
  for (let i = 0; i < args.length; i++) {
    const w = args[i]!;
    if (!w.known || isOption(w.value, "-s") || isOption(w.value, "--set")) return false;
    if (["-d", "--date", "-r", "--reference", "-f", "--file"].includes(w.value)) i++;
    else if (!w.value.startsWith("-") && !w.value.startsWith("+")) return false;
  }
  return true;
}

/** A word that assigns a variable as it expands: `${NAME:=value}`, `${NAME=value}` (an exported one reaches what runs next). */
const ASSIGNING_EXPANSION = /\$\{[A-Za-z_][A-Za-z0-9_]*:?=/;

/** git subcommands that only read, with the options that would make them write or run a program refused. */
const GIT_READ_ONLY: Record<string, ReadOnlyCheck> = {
  status: without("--output", "-o"),
  log: without("--output", "--ext-diff", "--textconv"),
  diff: without("--output", "--ext-diff", "--textconv", "--no-index"),
  show: without("--output", "--ext-diff", "--textconv"),
  // Listing only: any name would create a branch, and these options change one.
  branch: (args) =>
    knownArgs(args) &&
    (args.some((w) => w.known && ["-l", "--list"].includes(w.value)) ||
      args.every((w) => w.known && w.value.startsWith("-"))) &&
    !args.some(
      (w) =>
        w.known &&
        /^(-[dDmMcCfu]|--(delete|move|copy|force|set-upstream-to|unset-upstream|edit-description|track|no-track|create-reflog)\b)/.test(
          w.value,
        ),
    ),
};

/**
 * Programs that only read, and how each must be used for that to hold: no
 * write, no delete, no command run from data, no network. What the rules
 * prove read-only runs without asking (unless --ask-every-command).
 */
const READ_ONLY: Record<string, ReadOnlyCheck> = {
  ...Object.fromEntries(
    [
      "ls",
      "cat",
      "head",
      "tail",
      "wc",
      "grep",
      "egrep",
      "fgrep",
      "stat",
      "du",
      "df",
      "pwd",
      "echo",
      "true",
      "false",
      "test",
      "[",
      "basename",
      "dirname",
      "realpath",
      "readlink",
      "which",
      "type",
      "whoami",
      "id",
      "uname",
      "nproc",
      "arch",
      "groups",
      "locale",
      "uptime",
      "free",
      "cut",
      "tr",
      "nl",
      "od",
      "hexdump",
      "column",
      "fold",
      "rev",
      "tac",
      "comm",
      "cmp",
      "diff",
      "expand",
      "unexpand",
      "paste",
      "join",
      "seq",
      "strings",
      "sleep",
      "md5sum",
      "sha1sum",
      "sha224sum",
      "sha256sum",
      "sha384sum",
      "sha512sum",
      "b2sum",
      "cksum",
      "jq",
      "cd",
      ":",
      "printenv",
      "lsblk",
      "ps",
    ].map((name) => [name, anyArgs]),
  ),
  env: (args) => args.length === 0,
  command: (args) => args.some((w) => w.known && ["-v", "-V"].includes(w.value)),
  hostname: (args) => args.length === 0,
  // `printf -v NAME` assigns a shell variable (an exported GIT_PAGER or PATH, say) for what runs after it.
  printf: (args) => args.length === 0 || (args[0]!.known && !args[0]!.value.startsWith("-v")),
  date: dateOnlyReads,
  find: (args) =>
    knownArgs(args) &&
    !args.some((w) => w.known && /^-(exec|execdir|ok|okdir|delete|fprint0?|fprintf|fls)$/.test(w.value)),
  sort: without("-o", "--output", "--compress-program"),
  // file -C compiles a magic file into the current directory.
  file: without("-C", "--compile"),
  rg: without("--pre", "--pre-glob"),
  tree: without("-o"),
  uniq: operandsAtMost(1),
  xxd: (args) => operandsAtMost(1)(args) && !args.some((w) => w.known && w.value === "-r"),
  sed: (args) => knownArgs(args) && !args.some((w) => w.known && /^(-[A-Za-z]*[if]|--(in-place|file)\b)/.test(w.value)),
  awk: (args) =>
    knownArgs(args) &&
    !args.some((w) => w.known && (/^-f|^--file/.test(w.value) || /[>|]|system|getline/.test(w.value))),
  git: (args) => {
    const sub = args[0];
    return Boolean(sub?.known && GIT_READ_ONLY[sub.value]?.(args.slice(1)));
  },
};

/** Whether one part only reads: a read-only program used read-only. Writes and parts known only as they run never are. */
function isReadOnlyPart(part: CommandPart): boolean {
  const program = part[0];
  if (!program?.known || isWritePart(part) || gitPointedElsewhere.has(part)) return false;
  if (part.some((w) => ASSIGNING_EXPANSION.test(w.text))) return false;
  // A path (./ls, /tmp/cat) may be anything: only programs found on PATH by name.
  if (program.value.includes("/") && !/^\/(usr\/)?bin\/[^/]+$/.test(program.value)) return false;
  const check = READ_ONLY[baseName(program.value)];
  return Boolean(check?.(part.slice(1)));
}

/** Programs whose second word names what they do (`git log`, `npm test`); "always allow" keeps it. */
const SUBCOMMAND_PROGRAMS = new Set([
  "git",
  "npm",
  "pnpm",
  "yarn",
  "bun",
  "npx",
  "cargo",
  "go",
  "docker",
  "podman",
  "kubectl",
  "helm",
  "pip",
  "pip3",
  "poetry",
  "uv",
  "gh",
  "apt",
  "apt-get",
  "dnf",
  "yum",
  "brew",
  "systemctl",
  "dotnet",
  "mvn",
  "gradle",
  "make",
  "terraform",
  "conda",
  "rustup",
  "deno",
  "composer",
  "bundle",
  "rails",
  "mix",
  "stack",
  "cabal",
  "swift",
]);

/** Programs that "always allow" never proposes a rule for: what they run is in their arguments or input, not their name. */
const NEVER_ALWAYS_ALLOWED = new Set([
  ...SHELL_PROGRAMS,
  ...Object.keys(INLINE_CODE),
  ...Object.keys(SIMPLE_WRAPPERS),
  ...Object.keys(PROGRAMS_THAT_RUN_PROGRAMS).filter(
    (name) => !["git", "tee", "uniq", "sort", "sed", "find"].includes(name),
  ),
  "python",
  "python2",
  "python3",
  "sudo",
  "su",
  "ssh",
  "parallel",
  // Editors, pagers and clients that run commands of their own from what is typed into them (vim's :!, less's !,
  // sqlite3's .shell): allowing the program would let every keystroke and every -c through.
  ...["vi", "vim", "nvim", "view", "vimdiff", "rvim", "ex", "ed", "red", "emacs", "nano", "mc"],
  ...["less", "more", "most", "man", "info", "sqlite3", "psql", "mysql", "mongosh", "ftp", "telnet"],
  // Programs that destroy what they are given: one click on "Always allow" for `rm -rf build` would let every later
  // rm of anything run unasked.
  ...["rm", "rmdir", "shred", "dd", "truncate", "mkfs", "wipefs", "kill", "pkill", "killall", "chmod", "chown"],
]);

/** The rule lines that would let every asked part of `verdict` run from now on, or undefined when no such line can be written. */
function alwaysAllowLines(
  rules: readonly CommandRule[],
  verdict: RuleVerdict,
  ctx: VerdictContext = {},
): string[] | undefined {
  if (RULE_KINDS[verdict.verdict].gate !== "ask" || !verdict.parts || verdict.unsure) return undefined;
  const lines = new Set<string>();
  for (const part of verdict.parts) {
    const v = partVerdict(rules, part, ctx);
    if (RULE_KINDS[v.verdict].gate === "run") continue;
    // A part asked by a rule (or one a deny may match) stays asked whatever allow line is added; a write is asked
    // each time (the person allows writes by path in the file themselves).
    if (v.rule || isWritePart(part)) return undefined;
    const line = allowLineFor(part);
    if (!line) return undefined;
    lines.add(line);
  }
  return lines.size ? [...lines] : undefined;
}

/**
 * `allow PROGRAM [SUBCOMMAND] *` for one part: the program by name and, for
 * programs whose second word says what they do, that word (`allow git log *`,
 * `allow npm run test *`); never its literal arguments, and never for a shell,
 * an interpreter or a wrapper, whose arguments are what runs.
 */
function allowLineFor(part: CommandPart): string | undefined {
  const [program, sub, third] = part;
  if (!program?.known || !/^[\w.+-]+$/.test(program.value) || NEVER_ALWAYS_ALLOWED.has(interpreterOf(program.value)))
    return undefined;
  const word = (w: ShellWord | undefined) => (w?.known && /^[a-z][\w:.-]*$/i.test(w.value) ? w.value : undefined);
  if (!SUBCOMMAND_PROGRAMS.has(program.value) || !word(sub)) return `allow ${program.value} *`;
  const script = sub!.known && sub!.value === "run" ? word(third) : undefined;
  return `allow ${program.value} ${word(sub)}${script ? ` ${script}` : ""} *`;
}

// ════════════════════════════════════════════════════════════════════════════
// Command rules: the rules file
// Owns: reading .aicrules (or --rules FILE) as hostile ground, its problems
// reported by line, noticing that it changed on disk, and adding the lines a
// person approves.
// ════════════════════════════════════════════════════════════════════════════

/** The rules file as it is on disk: its text ("" when there is none), or why it cannot be read (a link, a FIFO…). */
type RulesOnDisk =
  { kind: "text"; text: string; missing: boolean } | { kind: "unreadable"; why: string; identity: string };

/** What a rules file holds, as one string to compare: its text's hash, or the identity of what cannot be read. */
const rulesMarker = (now: RulesOnDisk) => (now.kind === "text" ? sha256(now.text) : `unreadable:${now.identity}`);

function rulesOnDisk(file: string): RulesOnDisk {
  try {
    return { kind: "text", text: readOwnFile(file, MAX_RULES_BYTES).toString("utf8"), missing: false };
  } catch (error) {
    const e = ownFileError(error);
    return e.missing
      ? { kind: "text", text: "", missing: true }
      : { kind: "unreadable", why: e.message, identity: fileIdentity(file) };
  }
}

const sha256 = (text: string) => createHash("sha256").update(text).digest("hex");

/** `file` replaced whole: a new file beside it (never through a link, made by this call), then renamed over it. */
function writeFreshThenRename(file: string, data: string | Uint8Array): void {
  const fresh = `${file}.${process.pid}.new`;
  fs.rmSync(fresh, { force: true });
  const fd = openRegular(fresh, O.O_WRONLY | O.O_CREAT | O.O_EXCL, 0o600);
  try {
    fs.writeSync(fd, typeof data === "string" ? utf8.encode(data) : data);
  } finally {
    fs.closeSync(fd);
  }
  fs.renameSync(fresh, file);
}

/**
 * What aic knows of a rules file's history, in its state directory (out of
 * commands' reach): the content the person last wrote or accepted, and what
 * a command left there, if a command was the last to change it. Keyed by
 * the file's absolute path.
 */
class RulesTrust {
  private constructor(
    /** The person's own text (undefined: there was none; "" an empty or absent file). */
    readonly trustedText: string | undefined,
    /** sha256 of the text a command left, or the identity of what a command put there that cannot be read. */
    private readonly byCommand: string | undefined,
  ) {}

  private static where(rules: string): string | undefined {
    const state = aicStateDir();
    return state && path.join(state, "rules", `${sha256(path.resolve(rules)).slice(0, 32)}.json`);
  }

  static of(rules: string): RulesTrust | undefined {
    const where = RulesTrust.where(rules);
    if (!where) return undefined;
    try {
      const doc = JSON.parse(readOwnFile(where, 4 * MAX_RULES_BYTES).toString("utf8")) as Record<string, unknown>;
      const text = typeof doc.trusted === "string" ? doc.trusted : undefined;
      return new RulesTrust(text, typeof doc.by_command === "string" ? doc.by_command : undefined);
    } catch {
      return undefined;
    }
  }

  /** Whether what is on disk now is what a command left there (nothing the person did since). */
  wroteByCommand(now: RulesOnDisk): boolean {
    return this.byCommand !== undefined && this.byCommand === rulesMarker(now);
  }

  static trust(rules: string, text: string): void {
    RulesTrust.save(rules, { trusted: text });
  }

  /** A command left `now` in `rules`; `before`: the person's text there, when aic knows it and has no record yet. */
  static commandWrote(rules: string, now: RulesOnDisk, before?: string): void {
    const known = RulesTrust.of(rules);
    RulesTrust.save(rules, { trusted: known?.trustedText ?? before ?? "", by_command: rulesMarker(now) });
  }

  private static save(rules: string, doc: { trusted: string; by_command?: string }): void {
    const where = RulesTrust.where(rules);
    if (!where) return;
    try {
      fs.mkdirSync(path.dirname(where), { recursive: true, mode: 0o700 });
      writeFreshThenRename(where, JSON.stringify({ rules: path.resolve(rules), ...doc }));
    } catch {
      /* a state directory aic cannot write: the rules on disk are then all there is, as before */
    }
  }

  /** The lines that differ between the person's rules and what is on disk, for `aic rules accept`. */
  diff(now: string): string[] {
    const was = (this.trustedText ?? "").split("\n").filter(Boolean);
    const is = now.split("\n").filter(Boolean);
    return [
      ...was.filter((l) => !is.includes(l)).map((l) => `-${l}`),
      ...is.filter((l) => !was.includes(l)).map((l) => `+${l}`),
    ];
  }
}

/** `aic rules accept`: shows what a command changed in the rules file and puts it in force from the next start. */
function runRulesAccept(rules: string): number {
  const file = path.resolve(rules);
  const trust = RulesTrust.of(file);
  const onDisk = rulesOnDisk(file);
  if (onDisk.kind === "unreadable") {
    writeOut(2, `aic: error: ${file} cannot be accepted: ${onDisk.why} (rules must be a regular file)\n`);
    return EXIT.usage;
  }
  if (!trust?.wroteByCommand(onDisk)) {
    writeOut(1, `${file}: nothing to accept (no command changed it since you last wrote or accepted it)\n`);
    return EXIT.ok;
  }
  const lines = trust.diff(onDisk.text);
  writeOut(
    1,
    `${file}, as a command left it:\n${(lines.length ? lines : ["(only blank lines changed)"]).map(visibleControls).join("\n")}\n`,
  );
  RulesTrust.trust(file, onDisk.text);
  writeOut(1, "accepted: these rules are in force from the next start of aic\n");
  return EXIT.ok;
}

/** What identifies the rules file's content on disk, to notice a change ("absent" when there is none). */
function fileIdentity(file: string): string {
  try {
    const st = fs.lstatSync(file);
    return `${st.dev}:${st.ino}:${st.size}:${st.mtimeMs}:${st.isFile()}`;
  } catch {
    return "absent";
  }
}

/**
 * The person's own rules for the project at `root`: in aic's state directory, named by the directory's
 * device and inode (a project moved keeps them; another at the same path does not inherit them).
 */
function personalRulesPath(root: string): string | undefined {
  const state = aicStateDir();
  if (!state) return undefined;
  try {
    const st = fs.statSync(root);
    return path.join(state, "own-rules", `${st.dev}-${st.ino}.aicrules`);
  } catch {
    return undefined;
  }
}

/**
 * The rules in force and where they come from. They are read when aic
 * starts and when the person reloads them (`/rules reload`, or an "always
 * allow" answer): never because the file changed, since the commands it
 * governs can write it. A change is noticed and said once.
 */
class CommandRules {
  /** The project's rules file's rules (the team's, which it may commit). */
  private projectRules: CommandRule[] = [];
  /** The person's own ("Always allow"), kept in aic's state directory for this project, out of commands' reach. */
  private personalRules: CommandRule[] = [];
  problems: string[] = [];
  /** Whether either file existed when last read; without one, aic behaves as it always did. */
  present = false;
  /** Whether the project's rules file existed when last read. */
  projectPresent = false;
  /** Where the person's own rules for this project live (undefined: nowhere to keep them; the project file takes them). */
  readonly personalPath: string | undefined;
  loadedAt = "";
  /** What the last read found wrong (lines ignored, a file that could not be read): said at start and on reload. */
  reports: string[] = [];
  private identity = "absent";
  private noticed = "absent";

  private constructor(
    readonly path: string,
    /** The start directory: write rules name paths from there. */
    readonly root: string,
  ) {
    this.personalPath = personalRulesPath(root);
  }

  /** Every rule in force: the project's, then the person's own (a deny in either wins: see judgeCommand). */
  get rules(): CommandRule[] {
    return [...this.projectRules, ...this.personalRules];
  }

  /** `--rules FILE` must exist; the default `.aicrules` may not. */
  static load(config: Pick<Config, "rules">): CommandRules {
    const rules = new CommandRules(path.resolve(config.rules ?? RULES_FILE_NAME), process.cwd());
    rules.read();
    if (config.rules !== undefined && !rules.projectPresent)
      throw new UsageError(`--rules ${config.rules}: ${rules.reports[0] ?? "no such file"}`);
    return rules;
  }

  /** Reads the file again; returns what to tell the person (also kept in `reports`). */
  read(): string[] {
    const reports = this.readProject();
    this.readPersonal();
    return reports;
  }

  /** The person's own rules: written only by aic, where no command reaches, so read as they are. */
  private readPersonal(): void {
    this.personalRules = [];
    if (!this.personalPath) return;
    const onDisk = rulesOnDisk(this.personalPath);
    if (onDisk.kind === "unreadable") {
      this.reports.push(`cannot read your own rules ${this.personalPath}: ${onDisk.why}; they are not in force`);
      return;
    }
    if (onDisk.missing) return;
    const parsed = parseRuleLines(onDisk.text);
    this.personalRules = parsed.rules;
    this.reports.push(...parsed.problems.map((p) => `${this.personalPath} ${p} (this line is ignored)`));
    this.present = true;
  }

  private readProject(): string[] {
    this.identity = this.noticed = fileIdentity(this.path);
    this.loadedAt = localIsoSeconds();
    const trust = RulesTrust.of(this.path);
    const onDisk = rulesOnDisk(this.path);
    // What a command wrote stays out of force until the person accepts it; the rules they last had stay in.
    if (trust?.wroteByCommand(onDisk)) {
      // The person's rules from before; "" was no file (or an empty one): then none are in force, as without a file.
      const kept = trust.trustedText;
      this.apply(kept ? kept : undefined);
      this.reports.unshift(
        `rules: ${this.path} changed by a command in the last run — not in force (the rules from before stay); 'aic rules accept' to use them`,
      );
      return this.reports;
    }
    if (onDisk.kind !== "unreadable") RulesTrust.trust(this.path, onDisk.text);
    if (onDisk.kind === "unreadable") {
      this.apply(undefined);
      this.reports = [`cannot read ${this.path}: ${onDisk.why}; no rules are in force`];
      return this.reports;
    }
    // No file at all is not an empty file: without one, aic behaves as it always did (and --rules FILE must exist).
    this.apply(onDisk.missing ? undefined : onDisk.text);
    return this.reports;
  }

  /** The rules of `text` in force (none when undefined), and its problems reported by line. */
  private apply(text: string | undefined): void {
    if (text === undefined) {
      this.projectRules = [];
      this.present = this.projectPresent = false;
      this.problems = [];
      this.reports = [];
      return;
    }
    ({ rules: this.projectRules, problems: this.problems } = parseRuleLines(text));
    this.present = this.projectPresent = true;
    this.reports = this.problems.map((p) => `${this.path} ${p} (this line is ignored)`);
  }

  /** The verdict for a command run in `cwd` (without a rules file, every command that is not read-only is asked). */
  judge(command: string, cwd: string = this.root): RuleVerdict {
    return judgeCommand(this.present ? this.rules : [], command, { cwd, root: this.root });
  }

  /** The lines an "always allow" answer would add for `command`, if such lines can be written. */
  alwaysAllowFor(command: string, verdict: RuleVerdict, cwd: string = this.root): string[] | undefined {
    if (RULE_KINDS[verdict.verdict].gate !== "ask" || verdict.unreadable) return undefined;
    const ctx = { cwd, root: this.root };
    return alwaysAllowLines(this.rules, verdict.parts ? verdict : judgeCommand(this.rules, command, ctx), ctx);
  }

  /** Programs a deny rule forbids whatever their arguments (`deny rm *`): these the jail can refuse to execute. */
  deniedPrograms(): string[] {
    const programs = this.rules.filter((r) => refuses(r) && !r.write && r.words.length === 1);
    return [...new Set(programs.map((r) => r.words[0]!))];
  }

  /** Deny rules on what runs (not on writes): the sandbox holds them by file or at exec. */
  denyRules(): CommandRule[] {
    return this.rules.filter((r) => refuses(r) && !r.write);
  }

  /** Whether some deny rule in force is held by nothing but the parser: not by file, not at exec (writes, say). */
  hasDenyBeyond(enforced: readonly string[], heldAtExec: readonly string[] = []): boolean {
    return this.rules.some(
      (r) =>
        refuses(r) &&
        !heldAtExec.includes(r.written) &&
        (r.write !== undefined || r.words.length !== 1 || !enforced.includes(r.words[0]!)),
    );
  }

  /** Only what a person said (never a command) may widen the rules: which commands run without asking. */
  allowedPatterns(): string[] {
    return this.present
      ? this.rules
          .filter((r) => RULE_KINDS[r.action].gate === "run")
          .map((r) => r.written.slice(r.action.length).trimStart())
      : [];
  }

  /** A change on disk not yet told: the words to tell, once per change (and, from a command, on record). */
  changeNotice(): string | undefined {
    const now = fileIdentity(this.path);
    if (now === this.noticed) return undefined;
    this.noticed = now;
    if (now === this.identity) return undefined;
    // It changed while a command ran: at the next start it is not in force until the person accepts it.
    RulesTrust.commandWrote(this.path, rulesOnDisk(this.path));
    return `${this.path} changed on disk while aic runs (a command may have written it): the rules in force stay the ones read at ${this.loadedAt}; the change takes effect only when you reload it (/rules reload in the TUI), or at a later start once you accept it (aic rules accept)`;
  }

  /**
   * Appends lines (the person's "always allow") to the file and to the rules
   * in force, as loaded: the file is never read again for it, since a command
   * may have rewritten it meanwhile. Never follows a link; creates the file if needed.
   */
  append(lines: string[]): void {
    if (this.personalPath) return this.appendPersonal(lines, this.personalPath);
    const unchanged = fileIdentity(this.path) === this.identity;
    const fd = openRegular(this.path, O.O_WRONLY | O.O_APPEND | O.O_CREAT);
    try {
      const size = fs.fstatSync(fd).size;
      let prefix = "";
      if (size > 0) {
        const last = Buffer.alloc(1);
        const read = fs.openSync(`/proc/self/fd/${fd}`, O.O_RDONLY);
        try {
          fs.readSync(read, last, 0, 1, size - 1);
        } finally {
          fs.closeSync(read);
        }
        if (last[0] !== 0x0a) prefix = "\n";
      }
      fs.writeSync(fd, `${prefix}${lines.join("\n")}\n`);
    } finally {
      fs.closeSync(fd);
    }
    const next = Math.max(0, ...this.projectRules.map((r) => r.lineNumber)) + 1;
    const added = parseRuleLines(lines.join("\n"), next);
    this.projectRules.push(...added.rules);
    this.present = true;
    // Our own write is no change to tell about; a change a command made before it still is.
    if (unchanged) {
      this.identity = this.noticed = fileIdentity(this.path);
      const onDisk = rulesOnDisk(this.path);
      if (onDisk.kind !== "unreadable") RulesTrust.trust(this.path, onDisk.text);
    }
  }

  /** "Always allow" into the person's own file (made private, in aic's state directory), and into force. */
  private appendPersonal(lines: string[], file: string): void {
    fs.mkdirSync(path.dirname(file), { recursive: true, mode: 0o700 });
    const fd = openRegular(file, O.O_WRONLY | O.O_APPEND | O.O_CREAT);
    try {
      const size = fs.fstatSync(fd).size;
      if (size === 0)
        fs.writeSync(
          fd,
          `# ${this.root}: rules you chose with "Always allow" (aic keeps them here, out of the project)\n`,
        );
      fs.writeSync(fd, `${lines.join("\n")}\n`);
    } finally {
      fs.closeSync(fd);
    }
    const next = Math.max(0, ...this.personalRules.map((r) => r.lineNumber)) + 1;
    this.personalRules.push(...parseRuleLines(lines.join("\n"), next).rules);
    this.present = true;
  }

  /** Where "Always allow" writes, for the messages that say so. */
  get allowFile(): string {
    return this.personalPath ?? this.path;
  }

  /** One paragraph for the system prompt, so the model does not spend steps on refused commands. */
  promptNote(): string {
    if (!this.present || this.rules.length === 0) return "";
    const list = (action: RuleAction) => {
      const rules = this.rules.filter((r) => r.action === action);
      const shown = rules.slice(0, PROMPT_RULES_LISTED).map((r) => {
        const pattern = `\`${[...r.words, ...(r.anyRest ? ["*"] : [])].join(" ")}\``;
        return refuses(r) && r.reason ? `${pattern} (${r.reason})` : pattern;
      });
      if (rules.length > shown.length) shown.push(`and ${rules.length - shown.length} more`);
      return shown.join(", ");
    };
    const parts = (Object.keys(RULE_KINDS) as RuleAction[])
      .map((action) => [RULE_KINDS[action].prompt, list(action)])
      .filter(([, l]) => l)
      .map(([what, l]) => `these ${what}: ${l}`);
    const denies = this.rules.some(refuses)
      ? " Name every program literally: while deny rules hold, a command aic cannot see through (a program named by a variable, code handed to an interpreter in a string, a script that cannot be read) is refused when nobody approves it by hand."
      : "";
    return `\n\nCommand rules (${this.path}) apply to every simple command of a command line, also inside sh -c, $( ), pipelines, find -exec and the scripts it runs, and to every file it writes (redirections, tee): ${parts.join("; ")}. Any other command, and any other write, needs a person's approval unless auto-approve is on.${denies} Never try to get around a refused command.`;
  }

  /** `/rules`: where they come from and each rule in force. */
  describe(): string[] {
    const own = this.personalPath
      ? this.personalRules.length
        ? [
            `Your own rules ("Always allow") from ${this.personalPath}:`,
            ...this.personalRules.map((r) => `  line ${r.lineNumber}: ${visibleControls(r.text)}`),
          ]
        : [`Your own rules ("Always allow") go to ${this.personalPath}: none yet.`]
      : [];
    if (!this.present)
      return [
        `No rules in force: ${this.path} ${this.reports[0] ? "could not be read" : "does not exist"}, so every command goes through approval.`,
        ...own,
        ...this.reports,
      ];
    const changed =
      fileIdentity(this.path) !== this.identity ? " (changed on disk since: /rules reload to use it)" : "";
    const project = this.projectRules.length
      ? [
          `Rules from ${this.path}, read at ${this.loadedAt}${changed}:`,
          ...this.projectRules.map((r) => `  line ${r.lineNumber}: ${visibleControls(r.text)}`),
        ]
      : [`The project's rules file ${this.path}: ${fs.existsSync(this.path) ? "no rules" : "none"}${changed}.`];
    return [...project, ...this.problems.map((p) => `  ignored: ${p}`), ...own];
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Tool calls: the approval gate and the command
// Owns: answering one tool call of the model: its arguments read, the person
// asked (unless auto-approve is on), the command run, and the tool message
// that answers it. Every call gets exactly one answer, whatever happens.
// ════════════════════════════════════════════════════════════════════════════

type Approval =
  | { kind: "approve" }
  /** Approve, and add the request's `alwaysAllow` lines to the rules file. */
  | { kind: "always" }
  | { kind: "reject" }
  | { kind: "suggest"; text: string }
  | { kind: "no_input" };
/** A command waiting for approval: `index` of `total` when the model proposed several in one turn. */
interface ApprovalRequest {
  id: string;
  /** The command; for input, what will be typed into what (`type into \`python3\`: print(2**100)⏎`). */
  command: string;
  /** Set for input: the program it is typed into. */
  typedInto?: string;
  index: number;
  total: number;
  /** The rule lines an "always allow" answer adds (absent when none can be written for this command). */
  alwaysAllow?: string[];
}
type ApproveFn = (request: ApprovalRequest) => Promise<Approval>;

interface AgentOptions {
  config: Config;
  sink: EventSink;
  approve: ApproveFn;
  sandbox: Sandbox;
  systemPrompt: string;
  session?: SessionStore;
  /** Where cut command outputs are saved in full. */
  outputs: OutputStore;
  /** The directory aic started in, held open: the debug dump is written there. */
  workDir: HeldDirectory;
  /** Whether a person can type into a running command (decides the stuck-on-input rule). */
  canAnswerInput: () => boolean;
  attachInput?: RunOptions["attachInput"];
  /** Runs right before each command starts (the TUI syncs the cwd with its shell here). */
  beforeCommand?: () => void;
  /** Takes over what commands leave running. */
  jobs: JobTable;
  /** allow / ask / deny, for every command before the approval gate. */
  rules: CommandRules;
  /** A snapshot of the files before each command, for undo (absent: none are taken). */
  checkpoints?: Checkpoints;
  /** The session's id (or the run's own, without a session file), for the end event. */
  sessionId(): string;
  /** A person sits at the keyboard: a reply without a tool call hands the turn back instead of being nudged. */
  attended: boolean;
  /** The model (default: a ModelClient for the configured endpoint). */
  model?: ModelPort;
}

/** What answering one tool call came to: a tool message, a rejection with the person's suggestion, or no one to ask. */
type ToolAnswer =
  { kind: "done"; content: string } | { kind: "suggestion"; content: string; text: string } | { kind: "no_input" };

interface ToolCallContext {
  options: AgentOptions;
  /** The output limit cut the model's turn off (`finish_reason: "length"`): broken arguments are not a quoting mistake. */
  cutOff: boolean;
  autoApprove: boolean;
  /** Where the command runs, asked right before it starts (the TUI's Shell tab may just have moved the agent). */
  cwd(): string;
  /** Which of the turn's calls this is, and of how many (the approval dialog says so). */
  index: number;
  total: number;
  signal: AbortSignal;
  emit(event: AgentEvent): void;
  /** The rules file was read again (the person added a rule): the system prompt follows. */
  rulesChanged(): void;
  /** Right before the command runs: the checkpoint of the files, saved with the session. */
  beforeRun(call: string, command: string): Promise<void>;
  /** Right after it ran: the checkpoint after it, and what it changed (undefined when checkpoints are off). */
  afterRun(call: string): Promise<ChangedFiles | undefined>;
  /** A command was refused because it needed a person and nobody could answer: counted for the end of the run. */
  refusedForWantOfPerson(): void;
  /** The command that waits for the model's input, if one does (kept by the Agent across calls). */
  waiting: { current: WaitingCommand | undefined };
}

/** The command the model is at the keyboard of: one at a time, kept across its calls. */
interface WaitingCommand {
  run: CommandRun;
  /** The call that started it. */
  id: string;
  command: string;
  program: string;
}

/** What a call asks for: a new command, keys for the waiting one, or nothing runnable (its answer). */
type ToolRequest = { command: string } | { input: string } | { answer: ToolAnswer };

/** Reads the call's arguments: malformed JSON, an unknown function or neither field get their fixed answers. */
function readToolArguments(call: ToolCall, ctx: ToolCallContext): ToolRequest {
  const name = call.function.name;
  const rawArgs = call.function.arguments ?? "";
  let args: unknown = {};
  if (rawArgs.trim()) {
    try {
      args = JSON.parse(rawArgs);
    } catch (error) {
      const limit = modelProfile(ctx.options.config).maxTokens;
      const content = ctx.cutOff
        ? cutOffMessage(name, limit)
        : invalidArgumentsMessage(name, rawArgs, (error as Error).message);
      return { answer: { kind: "done", content } };
    }
  }
  if (name !== EXECUTE_BASH_TOOL.function.name)
    return { answer: { kind: "done", content: unknownFunctionMessage(name) } };
  const field = (key: string) => {
    const v = args && typeof args === "object" ? (args as Record<string, unknown>)[key] : undefined;
    return typeof v === "string" && v !== "" ? v : undefined;
  };
  const command = field("command")?.trim() ? field("command") : undefined;
  const input = field("input");
  if (command !== undefined && input !== undefined)
    return { answer: { kind: "done", content: BOTH_COMMAND_AND_INPUT_MESSAGE } };
  if (input !== undefined) return { input };
  if (command !== undefined) return { command };
  return { answer: { kind: "done", content: NO_ARGUMENTS_MESSAGE } };
}

/** Reads the call's arguments, asks for approval, runs the command (or types into the waiting one), words the result. */
async function answerToolCall(call: ToolCall, ctx: ToolCallContext): Promise<ToolAnswer> {
  const request = readToolArguments(call, ctx);
  if ("answer" in request) return request.answer;
  if ("input" in request) return typeIntoWaiting(call.id, request.input, ctx);
  const note = await stopWaitingCommand(ctx);
  const answer = await runToolCommand(call.id, request.command, ctx);
  return note && answer.kind === "done" ? { ...answer, content: `${note}\n${answer.content}` } : answer;
}

/** A call with a command while another waits: the waiting one is stopped first; the note that says so. */
async function stopWaitingCommand(ctx: ToolCallContext): Promise<string> {
  const w = ctx.waiting.current;
  if (!w) return "";
  ctx.waiting.current = undefined;
  w.run.stop("stopped");
  const ended = await w.run.result();
  ctx.emit({ type: "info", text: `[input] stopped ${w.program}, which waited for input, before the next command` });
  return stoppedWaitingNote(w.program, ended.exitCode);
}

/** The answer for a command that could not run: its status in the JSON, the model's answer. */
function notRunResult(id: string, status: NotRun, ctx: ToolCallContext): void {
  ctx.emit({
    type: "command_result",
    id,
    exit_code: null,
    status,
    duration_ms: 0,
    output: "",
    changed_files: null,
  });
}

/** One new command: the gate, the run, and what the model is told (its result, or its screen while it waits). */
async function runToolCommand(id: string, command: string, ctx: ToolCallContext): Promise<ToolAnswer> {
  const { options: o, signal, emit } = ctx;
  emit({ type: "command", id, command });
  const gate = await passApprovalGate(id, command, ctx);
  if (!gate.run) return (notRunResult(id, gate.status, ctx), gate.answer);
  if (signal.aborted) return (notRunResult(id, "skipped", ctx), { kind: "done", content: notExecuted(signal) });
  o.beforeCommand?.();
  await ctx.beforeRun(id, command);
  const startedAt = performance.now();
  const started = await startForAgent(
    command,
    o,
    ctx.cwd(),
    signal,
    {
      // Only a command a person approved by hand gets their keys when it waits for input; the model types into the others.
      canAnswerInput: o.canAnswerInput() && gate.byHand,
      modelAnswers: !(o.canAnswerInput() && gate.byHand),
      onData: (data) => emit({ type: "command_output", id, data }),
      onWaitingForInput: () => emit({ type: "command_waiting", id }),
      attachInput: o.attachInput,
    },
    gate.byHand,
  );
  if (!(started instanceof CommandRun))
    return finishObservation(id, { kind: "ended", result: started }, ctx, startedAt);
  const observed = await started.observe();
  if (observed.kind === "waiting") ctx.waiting.current = { run: started, id, command, program: observed.program };
  return finishObservation(id, observed, ctx, startedAt);
}

/**
 * What the model is told of one look at a command: how it ended (with what it
 * changed, what the repository guard took out, jobs it could not keep), or,
 * while it waits, its screen; and the `command_result` event either way.
 */
async function finishObservation(
  id: string,
  observed: Observation,
  ctx: ToolCallContext,
  startedAt: number,
  note = "",
): Promise<ToolAnswer> {
  const o = ctx.options;
  const durationMs = Math.round(performance.now() - startedAt);
  const changed = await ctx.afterRun(id);
  const result: CommandResult & { jobs?: JobsLeft } =
    observed.kind === "ended"
      ? observed.result
      : { exitCode: null, status: "waiting_for_input", output: observed.screen, savedTo: observed.savedTo };
  let content = observed.kind === "ended" ? describeCommandResult(result, o.config.limits) : waitingMessage(observed);
  if (note) content = `${note}\n${content}`;
  if (changed && changedFilesNote(changed)) content += `\n${changedFilesNote(changed)}`;
  // Whatever the exit code: a pipeline (`apt-get install … | tail`) hides the failure's.
  const refused = sandboxRefusals(result.output, o.sandbox, ctx.cwd());
  if (refused.length) content += `\n${sandboxRefusalMessage(refused)}`;
  const said = disarmedMessage(o.sandbox.auditRepositories());
  if (said) {
    content += `\n${said}`;
    ctx.emit({ type: "warning", text: said });
  }
  if (result.jobs?.refused.length) content += `\n${refusedJobsNote(result.jobs.refused)}`;
  ctx.emit({
    type: "command_result",
    id,
    exit_code: result.exitCode,
    status: observed.kind === "waiting" ? observed.verdict : result.status,
    duration_ms: durationMs,
    output: result.output,
    saved_to: result.savedTo,
    changed_files: changed ?? null,
  });
  const notice = o.rules.changeNotice();
  if (notice) ctx.emit({ type: "warning", text: notice });
  if (changed && o.checkpoints) await noteOtherRulesWritten(o.checkpoints, id, changed, o.rules.path, ctx);
  return { kind: "done", content };
}

/**
 * A rules file other than this run's own (a subdirectory's `.aicrules`, which a run started there reads) written
 * by a command: at a start there it is not in force until the person accepts it, as this run's own would be.
 */
async function noteOtherRulesWritten(
  checkpoints: Checkpoints,
  call: string,
  changed: ChangedFiles,
  own: string,
  ctx: ToolCallContext,
): Promise<void> {
  for (const { file, before } of await checkpoints.rulesWritten(call, changed, RULES_FILE_NAME)) {
    if (path.resolve(file) === path.resolve(own)) continue;
    const now = rulesOnDisk(file);
    if (RulesTrust.of(file)?.wroteByCommand(now)) continue; // said already: the repository guard saw it
    RulesTrust.commandWrote(file, now, before);
    ctx.emit({
      type: "warning",
      text: `${file} was written by a command: a run started there keeps the rules it held before until you accept the change (aic rules accept)`,
    });
  }
}

/** Whether the command may run (and whether a person approved it by hand), or the answer the model gets instead and why. */
type GateOutcome = { run: true; byHand: boolean } | { run: false; answer: ToolAnswer; status: NotRun };

/**
 * The approval gate: the rules first (deny never runs, even with
 * auto-approve; allow runs without asking), then auto-approve, then the
 * person. Nobody to ask: with a rules file the command is refused and the
 * run goes on; without one the run stops as it always did (exit 4).
 */
async function passApprovalGate(
  id: string,
  command: string,
  ctx: ToolCallContext,
  input?: { shown: string; typedInto: string; verdict: RuleVerdict },
): Promise<GateOutcome> {
  const { options: o, signal, emit } = ctx;
  const refuse = (content: string, status: NotRun): GateOutcome => ({
    run: false,
    answer: { kind: "done", content },
    status,
  });
  const ruled = input?.verdict ?? o.rules.judge(command, ctx.cwd());
  const ruling = RULE_KINDS[ruled.verdict].gate;
  if (ruling === "refuse") {
    emit({ type: "approval", id, decision: "denied", rule: ruled.rule?.text });
    return refuse(deniedByRuleMessage(ruled, o.rules.path), "denied");
  }
  // Without a person, what the judgement cannot see through never runs while a deny rule it could hide holds
  // (one the kernel cannot enforce by refusing to execute a program).
  const unseen = ruled.unsure !== undefined && o.rules.hasDenyBeyond(o.sandbox.deniedPrograms, o.sandbox.heldAtExec);
  // What only reads runs unasked, alone or beside what a rule allows, unless the person asked to see every command.
  const readsUnasked = !o.config.askEveryCommand;
  const besideReads = readsUnasked ? ruled.allowedBesideReads : undefined;
  const readOnly = readsUnasked && ruled.readOnly;
  if (ruling === "run" || besideReads || readOnly || (ctx.autoApprove && !unseen)) {
    const decision = ruling === "run" || besideReads ? "allowed" : readOnly ? "read_only" : "auto";
    const rule = ruling === "run" ? ruled.rule : besideReads;
    emit({ type: "approval", id, decision, rule: decision === "allowed" ? rule?.text : undefined });
    return { run: true, byHand: false };
  }
  if (ctx.autoApprove) {
    emit({ type: "approval", id, decision: "denied", rule: undefined });
    return refuse(unseenCommandMessage(ruled.unsure!, o.rules), "denied");
  }
  // Input is approved each time: no "always allow" line is written for keys typed into a program.
  const alwaysAllow = input ? undefined : o.rules.alwaysAllowFor(command, ruled, ctx.cwd());
  const shown = input ? { command: input.shown, typedInto: input.typedInto } : { command };
  const answer = await untilAborted(
    o.approve({ id, ...shown, index: ctx.index, total: ctx.total, alwaysAllow }),
    signal,
  );
  if (!answer) return refuse(notExecuted(signal), "skipped");
  switch (answer.kind) {
    case "no_input":
      emit({ type: "approval", id, decision: "no_input" });
      ctx.refusedForWantOfPerson();
      // Only the project's rules (the team's, on purpose) make a run go on past a refusal: an "Always allow"
      // clicked once in the TUI must not turn a CI run that needed a person from exit 4 into exit 0.
      return o.rules.projectPresent
        ? refuse(needsPersonMessage(ruled, o.rules.path, o.rules.allowedPatterns()), "refused")
        : { run: false, answer: { kind: "no_input" }, status: "refused" };
    case "reject":
      emit({ type: "approval", id, decision: "rejected" });
      return refuse(SKIPPED_BY_USER, "rejected");
    case "suggest":
      emit({ type: "approval", id, decision: "suggestion", suggestion: answer.text });
      return {
        run: false,
        answer: { kind: "suggestion", content: SKIPPED_BY_USER, text: answer.text },
        status: "rejected",
      };
    case "always":
      emit({ type: "approval", id, decision: "approved", added_rules: alwaysAllow && addRules(alwaysAllow, ctx) });
      return { run: true, byHand: true };
    case "approve":
      emit({ type: "approval", id, decision: "approved" });
      return { run: true, byHand: true };
  }
}

/** The person's "always allow": the lines go into the rules file, which is read again. Returns what was added. */
function addRules(lines: string[], ctx: ToolCallContext): string[] | undefined {
  const rules = ctx.options.rules;
  try {
    rules.append(lines);
  } catch (error) {
    ctx.emit({
      type: "warning",
      text: `could not add to ${rules.allowFile}: ${(error as Error).message}; approved this once`,
    });
    return undefined;
  }
  ctx.emit({ type: "info", text: `[rules] added to ${rules.allowFile}: ${lines.join("; ")}` });
  for (const report of rules.reports) ctx.emit({ type: "warning", text: report });
  ctx.rulesChanged();
  return lines;
}

/**
 * Starts a command with the run's settings (timeout, output cap, sandbox,
 * saved outputs, jobs). A command that cannot even start is a result: the
 * model can do something about it (a vanished cwd, say), and the run goes on.
 */
async function startForAgent(
  command: string,
  o: AgentOptions,
  cwd: string,
  signal: AbortSignal,
  io: Pick<RunOptions, "canAnswerInput" | "modelAnswers" | "onData" | "onWaitingForInput" | "attachInput">,
  /** A person approved it by hand: it is never stopped for printing much (what is kept of it stays bounded). */
  byHand = false,
): Promise<CommandRun | (CommandResult & { jobs?: JobsLeft })> {
  const limits = byHand ? { ...o.config.limits, runawayBytes: Infinity } : o.config.limits;
  try {
    return await CommandRun.start({
      command,
      cwd,
      limits,
      signal,
      sandbox: o.sandbox,
      outputs: o.outputs,
      jobs: o.jobs,
      ...io,
    });
  } catch (error) {
    // A spawn error names the shell it could not start; the usual cause is the directory, gone under aic.
    const gone = !fs.existsSync(cwd) ? `the directory commands start in, ${cwd}, no longer exists` : undefined;
    return { exitCode: null, status: "not_started", output: gone ?? (error as Error).message };
  }
}

/**
 * Runs the --done-when check like any command (the cwd, the sandbox, the
 * timeout) but without asking: the person gave it. Passed only on exit 0.
 * A failure is worded for the model with the check's output, head and tail.
 */
async function checkCompletion(
  command: string,
  ctx: Pick<ToolCallContext, "options" | "cwd" | "signal" | "emit">,
): Promise<{ passed: boolean; refusal: string }> {
  const started = await startForAgent(command, ctx.options, ctx.cwd(), ctx.signal, {
    canAnswerInput: false,
    onData: () => {},
  });
  const result = started instanceof CommandRun ? await started.result() : started;
  const passed = result.status === "exited" && result.exitCode === 0;
  ctx.emit({
    type: "verify",
    command,
    exit_code: result.exitCode,
    status: result.status,
    passed,
    output: result.output,
  });
  return { passed, refusal: completionRefusal(command, result) };
}

/** The abort reason of a run the person interrupted (rather than one stopped by a signal or /stop). */
const USER_INTERRUPT = "interrupted by the user";
/** The abort reason of a run whose --max-time is spent. */
const TIME_BUDGET = "the time budget is spent";
const stoppedStatus = (signal: AbortSignal): RunStatus =>
  signal.reason === USER_INTERRUPT ? "interrupted" : signal.reason === TIME_BUDGET ? "time_budget" : "stopped";
const notExecuted = (signal: AbortSignal) =>
  signal.reason === USER_INTERRUPT ? NOT_EXECUTED_INTERRUPTED : NOT_EXECUTED_STOPPED;

/** Resolves with `promise`, or with undefined as soon as the run is stopped. */
function untilAborted<T>(promise: Promise<T>, signal: AbortSignal): Promise<T | undefined> {
  if (signal.aborted) return Promise.resolve(undefined);
  return new Promise((resolve, reject) => {
    const onAbort = () => resolve(undefined);
    signal.addEventListener("abort", onAbort, { once: true });
    promise.then(
      (value) => {
        signal.removeEventListener("abort", onAbort);
        resolve(value);
      },
      (error) => {
        signal.removeEventListener("abort", onAbort);
        reject(error);
      },
    );
  });
}

// ════════════════════════════════════════════════════════════════════════════
// Tool calls: keys for a waiting command
// Owns: typing the model's `input` into the command that waits: who reads the
// terminal, how the rules judge the keys (each line a shell reads, code for an
// interpreter, data for the rest), and the bytes a terminal would send for
// them.
// ════════════════════════════════════════════════════════════════════════════

/** Who takes keys typed into a waiting command, and what they make of them. */
interface InputReader {
  /** The program, by the name of its executable (a process can rename itself, not its executable). */
  program: string;
  /**
   * A shell runs each line as a command; an interpreter runs what it reads as
   * code; anything else takes data (so does the command's own shell at a
   * `read`: what its script does with the data was judged with the command).
   */
  kind: "shell" | "interpreter" | "data";
  /** More than one program reads the terminal: which one gets the keys is theirs to decide. */
  several: boolean;
  /** Whether some process is blocked reading the terminal now. */
  reading: boolean;
  /** The reader is the command's own shell at a `read` (its script takes the line as data). */
  scriptRead: boolean;
}

/** Programs whose input is shell code, and interpreters whose input is code in their language. */
const SHELL_NAMES = /^(ba|da|z|k|mk|pdk|fi|a|y|c|tc|rba|r)?sh$|^busybox$/;
const INTERPRETER_NAMES =
  /^(python\d*(\.\d+)?|pypy\d*|node(js)?|deno|bun|perl[\d.]*|ruby[\d.]*|irb|php[\d.]*|lua[\d.]*|luajit|tclsh[\d.]*|wish[\d.]*|Rscript|R|julia|guile[\d.]*|gawk|awk|mawk|nawk|gdb|jshell|ghci|erl|iex|sqlite3|psql|mysql)$/;

/**
 * The processes of the command's foreground that are reading the terminal
 * (not the one before them in a pipe, not the one waiting for its editor),
 * judged by their executables, the strictest kind first.
 */
function inputReader(shellPid: number): InputReader {
  const pgids = foregroundGroups(shellPid);
  const procs = allProcesses()
    .filter((p) => pgids.includes(p.pgid) && !p.zombie)
    .slice(0, MAX_PROCESSES_LOOKED_AT);
  const readsTerminal = (pid: number) => {
    try {
      return fs.readdirSync(`/proc/${pid}/task`).some((tid) => {
        const w = threadWait(pid, Number(tid), new Set());
        return w === "tty" || w === "tty_timed";
      });
    } catch {
      return false;
    }
  };
  const readers = procs.filter((p) => readsTerminal(p.pid));
  // Nobody reads the terminal (tail -f, a redraw on a timer): the newest process that is not waiting for a child.
  const fallback = procs.filter((p) => !waitsForChild(p.pid)).at(-1) ?? procs.at(-1);
  const named = (readers.length ? readers : fallback ? [fallback] : []).map((p) => ({
    pid: p.pid,
    name: executableName(p.pid),
  }));
  const kindOf = (r: { pid: number; name: string }): InputReader["kind"] =>
    r.pid === shellPid && isCommandShell(shellPid)
      ? "data"
      : SHELL_NAMES.test(r.name)
        ? "shell"
        : INTERPRETER_NAMES.test(r.name)
          ? "interpreter"
          : "data";
  const kinds = named.map(kindOf);
  const kind = kinds.includes("shell") ? "shell" : kinds.includes("interpreter") ? "interpreter" : "data";
  const chosen = named[kinds.indexOf(kind)];
  return {
    program: chosen?.name ?? "?",
    kind,
    several: new Set(named.map((n) => n.name)).size > 1,
    reading: readers.length > 0,
    scriptRead: chosen !== undefined && chosen.pid === shellPid && kind === "data" && isCommandShell(shellPid),
  };
}

/** Whether `pid` is still the shell aic started for the command (not something it exec'd into). */
function isCommandShell(pid: number): boolean {
  try {
    return fs.readFileSync(`/proc/${pid}/cmdline`, "utf8").includes(`\0-c\0${commandPreamble()}`);
  } catch {
    return false;
  }
}

/** The name of the executable `pid` runs (a deleted one keeps its name), or its comm when that cannot be read. */
function executableName(pid: number): string {
  try {
    return path.basename(fs.readlinkSync(`/proc/${pid}/exe`).replace(/ \(deleted\)$/, ""));
  } catch {
    return commOf(pid);
  }
}

/** Keys for the command that waits: the gate (judged as what they are typed into), then what it does with them. */
async function typeIntoWaiting(id: string, input: string, ctx: ToolCallContext): Promise<ToolAnswer> {
  const w = ctx.waiting.current;
  if (!w) return { kind: "done", content: NO_WAITING_COMMAND_MESSAGE };
  if (w.run.finished) {
    ctx.waiting.current = undefined;
    const ended = await w.run.result();
    return finishObservation(
      id,
      { kind: "ended", result: ended },
      ctx,
      performance.now(),
      endedBeforeInputNote(w.program),
    );
  }
  const reader = w.run.reader();
  const program = reader.program;
  ctx.emit({ type: "input", id, input, into: program, command_id: w.id });
  // The command's own shell at a `read` takes data: the dialog must not suggest the keys run as a command.
  const into = reader.scriptRead ? `the command's read (${program})` : program;
  const gate = await passApprovalGate(id, `${program} ⌨ ${input}`, ctx, {
    shown: `type into \`${into}\`: ${inputShown(input)}`,
    typedInto: into,
    verdict: judgeInput(ctx.options.rules, reader, input, ctx.cwd()),
  });
  if (!gate.run) {
    notRunResult(id, gate.status, ctx);
    if (gate.answer.kind !== "done") return gate.answer;
    return { kind: "done", content: `${gate.answer.content}\n${stillWaitingNote(program)}` };
  }
  await ctx.beforeRun(id, `${w.command} ⌨ ${inputShown(input)}`);
  const startedAt = performance.now();
  const same = (r: InputReader) => r.program === reader.program && r.kind === reader.kind;
  const typed = await w.run.type(inputBytes(input), () => same(w.run.reader()));
  const observed = await w.run.observe();
  if (observed.kind === "ended") ctx.waiting.current = undefined;
  const stopped =
    typed.typed < typed.of && observed.kind === "waiting" ? typingStoppedNote(typed.typed, typed.of, program) : "";
  return finishObservation(id, observed, ctx, startedAt, stopped);
}

/**
 * Even the command's own `read` is not plain data: `read -e` runs readline
 * (Esc Ctrl+E expands `$(…)`), an integer variable evaluates what it is given,
 * and keys it does not take are left for the next program to read.
 */
const UNSEEN_SCRIPT_READ =
  "keys typed into a script's read can run code (read -e, integer variables) or be left for the next program";

/** Why keys typed into each kind of program are more than the rules can read. */
const UNSEEN_INPUT: Record<InputReader["kind"], string> = {
  shell:
    "keys typed into an interactive shell run with its aliases, functions, history and key bindings, which aic cannot see",
  interpreter: "keys typed into an interpreter are code that aic does not read",
  data: "keys typed into a program that can run commands of its own (vim's :!, less's !) are not read by the rules",
};

/**
 * The rules' verdict on keys typed into `reader`. A line a shell will read
 * that a deny rule names is denied outright. Otherwise keys typed into a
 * program are never something a rule allows or aic proves read-only: an
 * interactive shell has aliases and history aic cannot see, an interpreter
 * runs code, vim and less run commands of their own, and even a script's
 * `read` can (see UNSEEN_SCRIPT_READ). They are unsure, so a person is asked,
 * and under --auto-approve they are refused while a deny rule holds that only
 * this judgement enforces.
 */
function judgeInput(rules: CommandRules, reader: InputReader, input: string, cwd: string): RuleVerdict {
  const lines = inputBytes(input)
    .split(/[\r\n]/)
    .filter((l) => l.trim());
  if (reader.kind === "shell") {
    const denied = lines.map((line) => rules.judge(line, cwd)).find((v) => RULE_KINDS[v.verdict].gate === "refuse");
    if (denied) return denied;
  }
  if (reader.several) return { verdict: "ask", unsure: "more than one program reads the terminal" };
  return { verdict: "ask", unsure: reader.scriptRead ? UNSEEN_SCRIPT_READ : UNSEEN_INPUT[reader.kind] };
}

/** Input as a person reads it in a dialog or a log: Enter as ⏎, keys by their names. */
const inputShown = (input: string) => input.replace(/\r?\n/g, "⏎");

/** The keys `input` names, as a terminal sends them: `\n` is Enter (CR), `<C-c>` Ctrl+C, `<Esc>`, arrows, … */
function inputBytes(input: string): string {
  const named: Record<string, string> = {
    esc: "\x1b",
    tab: "\t",
    enter: "\r",
    backspace: "\x7f",
    space: " ",
    up: "\x1b[A",
    down: "\x1b[B",
    right: "\x1b[C",
    left: "\x1b[D",
  };
  return input.replace(/<(C-.|[A-Za-z]+)>|\r?\n/g, (whole, key?: string) => {
    if (!key) return "\r";
    if (key.startsWith("C-")) return String.fromCharCode(key.charCodeAt(2) & 0x1f);
    return named[key.toLowerCase()] ?? whole;
  });
}

// ════════════════════════════════════════════════════════════════════════════
// Model calls and their tokens
// Owns: each model call of the agent (turns and the summariser), what it
// costs against --max-tokens, the context figure, and noticing a server that
// reports far fewer prompt tokens than aic sent (it is cutting the prompt to
// a smaller window than aic thinks it has).
// ════════════════════════════════════════════════════════════════════════════

/** Thrown before a model call that would pass --max-tokens: the run ends with exit 5, the session saved. */
class TokenBudgetError extends Error {}

/** A prompt reported at under this fraction of what aic counted looks cut by the server. */
const TRUNCATION_SUSPECT_RATIO = 0.5;

/**
 * The run's token spending and its trust in the server's prompt figures.
 * Every model call counts, the summariser's too: the server's usage, or
 * aic's own count where it reports none.
 */
class TokenLedger {
  /** The conversation's totals (restored with a session, so they span runs). */
  usage: Usage = emptyUsage();
  /** Input plus output tokens of every model call of this process. */
  spent = 0;
  private lowReportsInRow = 0;
  private warned = false;

  constructor(
    private readonly config: Pick<Config, "maxTokens" | "maxPromptLen" | "sessionPath">,
    private readonly emit: (event: AgentEvent) => void,
  ) {}

  get maxTokens(): number | undefined {
    return this.config.maxTokens;
  }

  /** Whether a call of at most `bound` tokens could pass the budget (then it is counted exactly first). */
  mightPass(bound: number): boolean {
    return this.config.maxTokens !== undefined && this.spent + bound > this.config.maxTokens;
  }

  /** Before a call that sends about `input` tokens: refuses it when it would pass the budget. */
  beforeCall(input: number, what: string): void {
    const max = this.config.maxTokens;
    if (max === undefined || this.spent + input <= max) return;
    throw new TokenBudgetError(
      `the token budget is spent: ${this.spent} of --max-tokens ${max} used, and the next ${what} would send about ${input} more; stopped before it (${this.config.sessionPath ? "the session is saved; a larger --max-tokens goes on from here" : "no session file keeps this run: --session PATH would let a larger --max-tokens go on"})`,
    );
  }

  /** Counts one call (`estimated`: by aic, since the server reported nothing) and tells the sink. */
  record(u: CallUsage, estimated: boolean, contextEstimate: number, budget: number): void {
    const t = this.usage;
    t.input_tokens += u.prompt_tokens;
    t.output_tokens += u.completion_tokens;
    t.cached_tokens += u.cached_tokens;
    t.billable_tokens = t.input_tokens - t.cached_tokens + t.output_tokens;
    if (estimated) t.estimated = true;
    this.spent += u.prompt_tokens + u.completion_tokens;
    this.emit({
      type: "usage",
      prompt_tokens: u.prompt_tokens,
      completion_tokens: u.completion_tokens,
      cached_tokens: u.cached_tokens,
      estimated,
      total: { ...t },
      context_estimate: contextEstimate,
      budget,
      spent: this.spent,
      max_tokens: this.config.maxTokens ?? null,
    });
  }

  /**
   * Whether the server's prompt figure can be believed. Under half of what
   * aic counted, it is not used to calibrate anything; twice in a row, the
   * person is told once that the server is probably cutting the prompt.
   */
  trustsPromptReport(reported: number, counted: number): boolean {
    const low = counted > 0 && reported < counted * TRUNCATION_SUSPECT_RATIO;
    this.lowReportsInRow = low ? this.lowReportsInRow + 1 : 0;
    if (this.lowReportsInRow >= 2 && !this.warned) {
      this.warned = true;
      this.emit({
        type: "warning",
        text: `the server reported ${reported} prompt tokens for a prompt aic counts at about ${counted}, twice in a row: it is probably cutting the prompt to a smaller context window than --max-prompt-len ${this.config.maxPromptLen} (Ollama's num_ctx, llama.cpp's -c). Give the server a larger context or lower --max-prompt-len to what it holds; aic does not adjust its estimates from these figures`,
      });
    }
    return !low;
  }
}

/**
 * The agent's side of the model: every call streamed through the client,
 * what it costs counted (against --max-tokens too), and the token counter
 * and context figure that compression reads. The conversation itself stays
 * with the Agent; this class only sends what it is given.
 */
class ModelCalls {
  readonly ledger: TokenLedger;
  /** tiktoken, once loaded; until then sizes are bounded by byte counts. */
  counter: TokenCounter | undefined;
  private counterLoading: Promise<TokenCounter> | undefined;
  /** The last estimate of the prompt, in the server's tokens; every change is told to the sink as a `context` event. */
  private context = 0;

  constructor(
    private readonly config: Config,
    private readonly sink: EventSink,
    private readonly client: ModelPort = new ModelClient(config, sink),
  ) {
    this.ledger = new TokenLedger(config, (e) => sink.emit(e));
  }

  private get budget(): number {
    return promptBudget(this.config);
  }

  get contextEstimate(): number {
    return this.context;
  }

  set contextEstimate(tokens: number) {
    if (tokens === this.context) return;
    this.context = tokens;
    this.sink.emit({ type: "context", estimate: tokens, budget: this.budget });
  }

  /** Loading tiktoken takes a moment of CPU; it starts during the first model call instead of before it. */
  tokenCounter(): Promise<TokenCounter> {
    this.counterLoading ??= TokenCounter.create().then((counter) => (this.counter = counter));
    return this.counterLoading;
  }

  newRun(): void {
    this.client.newRun();
  }

  /**
   * One streamed turn of the agent. `beforeSending` gets the prompt's
   * estimate first (the debug dump, the checkpoint); then the budget may
   * refuse the call; afterwards the server's figures are judged, counted,
   * and (when believable) calibrate the counter.
   */
  async turn(
    messages: Message[],
    signal: AbortSignal,
    beforeSending: (estimate: number) => void,
  ): Promise<AssistantTurn> {
    // tiktoken is loaded only when a decision needs an exact count: a budget the byte bound might pass, or the
    // debug dump, whose figure a person compares with the server's.
    const bound = tokenUpperBound(messages);
    if (!this.counter && (this.config.debug || this.ledger.mightPass(bound))) await this.tokenCounter();
    const counter = this.counter;
    const rawSent = counter ? counter.countRaw(messages) : undefined;
    this.contextEstimate =
      counter && rawSent !== undefined ? Math.ceil(rawSent * counter.ratio) : roughTokenEstimate(messages);
    beforeSending(this.contextEstimate);
    this.ledger.beforeCall(counter ? this.contextEstimate : bound, "model call");
    let thinking = false;
    const emit = (e: AgentEvent) => this.sink.emit(e);
    const turn = await this.client.completeWithRetries(() => ({ messages, tools: true, temperature: 0.2 }), signal, {
      onContent: (text) => emit({ type: "assistant_delta", text }),
      onReasoning: (text) => {
        thinking = true;
        emit({ type: "reasoning_delta", text });
      },
      onThinkingComplete: () => {
        if (thinking) emit({ type: "thinking_complete" });
        thinking = false;
      },
      onDiscard: (reason) => emit({ type: "discarded", reason }),
    });
    if (turn.usage) {
      // The server's figure is judged against aic's count: tiktoken's when loaded, else the quick guess.
      const counted = rawSent ?? roughTokenEstimate(messages);
      const trusted = this.ledger.trustsPromptReport(turn.usage.prompt_tokens, counted);
      if (trusted && counter && rawSent !== undefined) counter.calibrate(rawSent, turn.usage.prompt_tokens);
      this.addUsage(turn.usage, false, trusted);
    } else this.addUsage(await countTurnUsage(await this.tokenCounter(), messages, turn), true);
    return turn;
  }

  /** Counts a call's tokens; unless the prompt figure looks cut by the server, it becomes the context figure. */
  private addUsage(u: CallUsage, estimated: boolean, trusted = true): void {
    if (trusted) this.contextEstimate = u.prompt_tokens;
    this.ledger.record(u, estimated, this.contextEstimate, this.budget);
  }

  /** The summariser call: no tools, temperature 1.0, its text shown as [SESSION SUMMARY] away from the agent's own output. */
  async summarise(request: Message[], signal: AbortSignal): Promise<string | undefined> {
    const bound = tokenUpperBound(request);
    if (this.ledger.mightPass(bound)) {
      const counter = await this.tokenCounter();
      this.ledger.beforeCall(Math.ceil(counter.countRaw(request) * counter.ratio), "summariser call");
    }
    this.sink.emit({ type: "summary_delta", text: "[SESSION SUMMARY]\n" });
    try {
      const turn = await this.client.completeWithRetries(
        () => ({ messages: request, tools: false, temperature: 1.0 }),
        signal,
        {
          onContent: (text) => this.sink.emit({ type: "summary_delta", text }),
        },
      );
      this.sink.emit({ type: "summary_delta", text: "\n" });
      this.addUsage(turn.usage ?? (await countTurnUsage(await this.tokenCounter(), request, turn)), !turn.usage);
      return turn.content;
    } catch (error) {
      if (error instanceof StoppedError) throw error;
      this.sink.emit({
        type: "warning",
        text: `the summariser failed (${(error as Error).message}); using ${SUMMARY_UNAVAILABLE}`,
      });
      return undefined;
    }
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Agent loop: stalls
// Owns: telling that a model is going round in circles: replies without a tool
// call in a row, the same command with the same result again and again.
// ════════════════════════════════════════════════════════════════════════════

/** Tool-less replies in a row after which an unattended run is stalled (each got the nudge). */
const STALL_TOOLLESS_REPLIES = 3;
/** The same command with the same result this many times in a row: the model is not learning from it. */
const STALL_REPEATS = 5;

/**
 * Notices a model going round in circles, which would otherwise burn tokens
 * until the step limit: replies without a tool call in a row, and the same
 * command with the same result in a row.
 */
class StallWatch {
  private toollessInRow = 0;
  private lastPair = "";
  private repeats = 0;
  reason = "";

  /** One more reply without a tool call; true when that makes a stall. */
  toolless(): boolean {
    this.repeats = 0;
    this.lastPair = "";
    if (++this.toollessInRow < STALL_TOOLLESS_REPLIES) return false;
    this.reason = `${this.toollessInRow} replies in a row without a tool call`;
    return true;
  }

  /** One command and its result; true when the same pair has come STALL_REPEATS times in a row. */
  repeated(command: string, result: string): boolean {
    this.toollessInRow = 0;
    const pair = JSON.stringify([command, result]);
    this.repeats = pair === this.lastPair ? this.repeats + 1 : 1;
    this.lastPair = pair;
    if (this.repeats < STALL_REPEATS) return false;
    this.reason = `the same command with the same result ${this.repeats} times in a row`;
    return true;
  }
}

function keptFields(kept: ReturnType<JobTable["kept"]>): { kept: typeof kept.jobs; kept_others: number } {
  return { kept: kept.jobs, kept_others: kept.others };
}

/**
 * Whether a run's commands could start at all (the sandbox, the launcher or
 * the shell failing): a run cannot end in success on the marker while the
 * last command it tried never started, nor end quietly when none ever did.
 */
class StartWatch {
  private ran = false;
  private notStarted: string | undefined;

  seen(e: AgentEvent): void {
    if (e.type !== "command_result") return;
    if (e.status === "not_started") this.notStarted = e.output.split("\n")[0] || "the command could not start";
    else if (RESULT_STATUSES[e.status].ran) {
      this.ran = true;
      this.notStarted = undefined;
    }
  }

  /** The cause, when `status` must become `failed`. */
  blocks(status: RunStatus): string | undefined {
    if (!this.notStarted) return undefined;
    const unstarted = RUN_ENDINGS[status].unstarted;
    switch (unstarted) {
      case "fails":
        return this.notStarted;
      case "fails_if_none_ran":
        return this.ran ? undefined : this.notStarted;
      case "stands":
        return undefined;
      default:
        return unreachable(unstarted);
    }
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Agent loop: the conversation and its checkpoints
// Owns: the agent's history (messages, the step count, the summary under the
// system prompt, where commands run), taking over a restored session, /clear,
// /undo, /redo and /diff on it, and each named checkpoint a session store
// writes.
// ════════════════════════════════════════════════════════════════════════════

/**
 * What the agent remembers between steps and runs. The loop appends to it and
 * compresses it; everything else that edits it (a restore, an undo, a clear)
 * happens here, while no run is going on.
 */
class Conversation {
  messages: Message[] = [];
  stepCount = 0;
  /** The summary kept under the system prompt by compression. */
  summary: string | undefined;
  /** Where commands run: the start directory, or wherever the person's Shell tab went. */
  cwd = process.cwd();

  constructor(
    private readonly o: AgentOptions,
    /** The system prompt without the rules' paragraph, which `basePrompt` adds as the rules are now. */
    private readonly fixedPrompt: string,
    private readonly model: ModelCalls,
    private readonly emit: (e: AgentEvent) => void,
  ) {}

  get basePrompt(): string {
    return fullSystemPrompt({ systemPrompt: this.fixedPrompt, rules: this.o.rules });
  }

  /** The system prompt first, fresh (the rules may have changed since), then the new request. */
  begin(request: Message): void {
    if (this.messages.length === 0)
      this.messages.push({ role: "system", content: systemContent(this.basePrompt, this.summary) });
    else this.refreshSystemPrompt();
    this.messages.push(request);
  }

  /** The person reloaded the rules (or added one): the system prompt names the ones now in force. */
  rulesChanged(): void {
    if (this.messages.length) this.refreshSystemPrompt();
  }

  /** Runs the next commands in `dir` (the TUI's Shell tab went there). */
  moveTo(dir: string): void {
    if (dir === this.cwd) return;
    this.cwd = dir;
    this.emit({ type: "info", text: `[cwd] the agent now works in ${dir} (followed the Shell tab)` });
  }

  /** Takes over a restored session; the stored summary stays after the fresh system prompt. */
  restore(loaded: LoadedSession): void {
    this.o.checkpoints?.adopt(loaded.checkpoints);
    if (!loaded.messages) return;
    this.summary = undefined;
    this.messages = loaded.messages;
    this.stepCount = loaded.stepCount ?? 0;
    this.model.ledger.usage = loaded.usage ?? emptyUsage();
    this.refreshSystemPrompt();
    // The context figure shows the restored history at once, as a quick guess: counting a long history
    // exactly would cost tiktoken's load and seconds of CPU before anything is needed (the first step's
    // compression counts it when the history may not fit).
    this.model.contextEstimate = roughTokenEstimate(this.messages);
  }

  private refreshSystemPrompt(): void {
    const first = this.messages[0];
    if (first?.role === "system") {
      this.summary = splitSummary(contentText(first.content)).summary;
      first.content = systemContent(this.basePrompt, this.summary);
    } else this.messages.unshift({ role: "system", content: systemContent(this.basePrompt, this.summary) });
  }

  /**
   * /undo N: the files back to before the last N commands, and the
   * conversation cut back to before the turn that proposed the first of them.
   * Only while the agent is stopped. Returns the lines to show.
   */
  async undo(n: number): Promise<string[]> {
    if (!this.o.checkpoints) throw new Error("checkpoints are off (--no-checkpoints)");
    const lines = await undoCommands(this.o.checkpoints, this, n);
    this.afterCut("undo");
    return lines;
  }

  /** /diff N: the unified diff of what the N-th last command changed. */
  async diff(n: number): Promise<string> {
    if (!this.o.checkpoints) throw new Error("checkpoints are off (--no-checkpoints)");
    return this.o.checkpoints.diffOf(n, false);
  }

  /** /redo: the newest undo undone, files and conversation. */
  async redo(): Promise<string[]> {
    if (!this.o.checkpoints) throw new Error("checkpoints are off (--no-checkpoints)");
    const lines = await redoCommands(this.o.checkpoints, this);
    this.afterCut("redo");
    return lines;
  }

  private afterCut(reason: string): void {
    this.model.contextEstimate = this.model.counter
      ? this.model.counter.estimate(this.messages)
      : roughTokenEstimate(this.messages);
    this.checkpoint(reason);
  }

  /** Forgets everything (/clear). */
  clear(): void {
    this.messages = [];
    this.summary = undefined;
    this.stepCount = 0;
    this.model.ledger.usage = emptyUsage();
    this.model.contextEstimate = 0;
    this.o.session?.renew();
    this.o.outputs.clear(this.o.session?.sessionId ?? String(process.pid));
    this.checkpoint("cleared");
  }

  /**
   * Saves the session at a named moment (README: "Session files"). A step's
   * own checkpoints (`soon`) do not wait for the disk: their fsyncs run while
   * the model is asked or the files' snapshot is taken, and a command waits
   * for them before it runs (toolCallContext's beforeRun). `if_changed`: not
   * written when the file already holds all of it but the label and the step
   * count (otherwise written at once, as the others are).
   */
  checkpoint(reason: string, soon?: "soon" | "if_changed"): void {
    const jobs = this.o.jobs.records();
    const state: SessionState = {
      messages: this.messages,
      stepCount: this.stepCount,
      usage: this.model.ledger.usage,
      cwd: this.cwd,
      jobs: jobs.length ? jobs : undefined,
      checkpoints: this.o.checkpoints?.record(),
    };
    if (soon === "soon") this.o.session?.saveSoon(reason, state);
    else this.o.session?.save(reason, state, soon === "if_changed");
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Agent loop: the agent
// Owns: the ralph loop — steering suggestions, compression at the start of
// each step, one streamed model turn, the approval gate and the commands, and
// how a run ends. It talks to the outside only through the sink, `approve` and
// its model port, and is moved only through its methods.
// ════════════════════════════════════════════════════════════════════════════

/**
 * The ralph loop: one run per request, step after step until the model
 * marks the task complete, the step limit, a stop or a failure. It owns the
 * history and keeps every tool call answered exactly once.
 */
class Agent {
  /** The history, its checkpoints, and where commands run. */
  readonly history: Conversation;
  private autoApprove: boolean;
  private isRunning = false;
  private suggestions: string[] = [];
  private abort: AbortController | undefined;
  /** The model side: calls, token counts, the context figure, the budget. */
  private readonly model: ModelCalls;
  /** Claims of completion --done-when refused during this run, and whether the last one was confirmed. */
  private refusedClaims = 0;
  private verified = false;
  /** Commands of this run refused because they needed a person and nobody could answer. */
  private refused = 0;
  /** Whether the model is going round in circles (tool-less replies, the same command and result again). */
  private stall = new StallWatch();
  private starts = new StartWatch();
  /** When this run's --max-time budget is spent (the model is told the time left in every tool result). */
  private deadline: number | undefined;
  /** The command the model is at the keyboard of, kept across its calls (ended with the run). */
  private readonly waiting: { current: WaitingCommand | undefined } = { current: undefined };
  private readonly compression: CompressionPolicy;

  constructor(private readonly o: AgentOptions) {
    this.autoApprove = o.config.autoApprove;
    this.model = new ModelCalls(o.config, o.sink, o.model);
    this.history = new Conversation(o, o.systemPrompt, this.model, (e) => this.emit(e));
    this.compression = new CompressionPolicy(o.config.compressAlg, o.config.compressTarget, promptBudget(o.config));
  }

  get budget(): number {
    return promptBudget(this.o.config);
  }

  get messages(): Message[] {
    return this.history.messages;
  }

  /** Takes over a restored session (see Conversation.restore). */
  restore(loaded: LoadedSession): void {
    this.history.restore(loaded);
  }

  /** Forgets everything (/clear), the suggestions not yet used too. */
  clear(): void {
    this.suggestions = [];
    this.history.clear();
  }

  /** The conversation's token totals. */
  get usage(): Usage {
    return this.model.ledger.usage;
  }

  get running(): boolean {
    return this.isRunning;
  }

  get autoApproving(): boolean {
    return this.autoApprove;
  }

  /** Turns auto-approve on or off; it takes effect for the next command. */
  setAutoApprove(on: boolean): void {
    this.autoApprove = on;
  }

  get contextEstimate(): number {
    return this.model.contextEstimate;
  }

  /** A command still waiting for the model's input when the run ends is stopped: nobody will type into it. */
  private async endWaitingCommand(): Promise<void> {
    const w = this.waiting.current;
    if (!w) return;
    this.waiting.current = undefined;
    w.run.stop("stopped");
    await w.run.result();
    this.emit({ type: "info", text: `[input] stopped ${w.program}, which still waited for input when the run ended` });
  }

  /** Starts loading what the first model call needs (the SDK), for a UI that would rather not pause later. */
  warmUp(): void {
    void import("openai");
  }

  /** Queues a person's steering text; it joins the history at the start of the next step. */
  suggest(text: string): void {
    this.suggestions.push(text);
  }

  /** The steering text no step used (the run ended first): handed back, so it never joins the next, other task. */
  takeUnusedSuggestions(): string[] {
    return this.suggestions.splice(0);
  }

  /** Stops the run; `exitCode` is what its `end` event reports (130 unless a signal says otherwise). */
  stop(exitCode: number = EXIT.sigint): void {
    this.stopExitCode = exitCode;
    this.abort?.abort();
  }

  /**
   * The person interrupts what the agent is doing (Escape in the TUI): the
   * running command is stopped, the stream cut, the step answered
   * "interrupted by the user", and the run ends; the next prompt starts anew.
   */
  interrupt(): void {
    this.abort?.abort(USER_INTERRUPT);
  }
  private stopExitCode: number = EXIT.sigint;

  private emit(e: AgentEvent): void {
    this.starts.seen(e);
    this.o.sink.emit(e);
  }

  private tokenCounter(): Promise<TokenCounter> {
    return this.model.tokenCounter();
  }

  async run(request: string): Promise<RunOutcome> {
    const abort = (this.abort = new AbortController());
    const startedAt = Date.now();
    this.isRunning = true;
    const requestMessage: Message = stamped({ role: "user", content: request });
    this.history.begin(requestMessage);
    this.model.newRun();
    this.refusedClaims = 0;
    this.refused = 0;
    this.stall = new StallWatch();
    this.starts = new StartWatch();
    // A new request moves the conversation on: what was undone before it stays undone.
    if (this.o.checkpoints) this.o.checkpoints.redo = [];
    this.verified = false;
    this.history.checkpoint("user_request");
    const maxTime = this.o.config.maxTime;
    const clock = maxTime === undefined ? undefined : setTimeout(() => abort.abort(TIME_BUDGET), maxTime * 1000);
    this.deadline = maxTime === undefined ? undefined : Date.now() + maxTime * 1000;
    let status: RunStatus = "step_limit";
    let steps = 0;
    try {
      for (; !abort.signal.aborted && steps < this.o.config.maxSteps;) {
        steps++;
        this.history.stepCount++;
        const outcome = await this.step(steps, abort.signal);
        if (outcome) {
          status = outcome;
          break;
        }
      }
      if (abort.signal.aborted) status = stoppedStatus(abort.signal);
    } catch (error) {
      status = this.failure(error, abort.signal);
    } finally {
      clearTimeout(clock);
      await this.endWaitingCommand();
      answerOpenCalls(this.history.messages, notExecuted(abort.signal));
      if (status === "failed" && withdrawUnanswered(this.history.messages, requestMessage))
        this.emit({
          type: "info",
          text: "the request was taken back out of the conversation, since the model never answered it",
        });
      this.isRunning = false;
      this.abort = undefined;
      this.history.checkpoint(status === "stopped" || status === "interrupted" ? "interrupted" : "loop_terminated");
    }
    return this.finishRun(status, steps, Date.now() - startedAt);
  }

  /** One step: steering, compression, one model turn, its tool calls. A final status, or undefined to go on. */
  private async step(step: number, signal: AbortSignal): Promise<RunStatus | undefined> {
    this.emit({ type: "step", step, max_steps: this.o.config.maxSteps });
    for (const text of this.suggestions.splice(0))
      this.history.messages.push({ role: "user", content: steeringMessage(text) });
    await this.compressIfNeeded(signal, this.compression.target);
    if (validateOutgoing(this.history.messages).terminal) return "terminal";
    const turn = await this.callModel(signal);
    return this.handleTurn(turn, signal);
  }

  /** What an exception out of a step means for the run; the person is told. */
  private failure(error: unknown, signal: AbortSignal): RunStatus {
    if (error instanceof StoppedError || signal.aborted) return stoppedStatus(signal);
    if (error instanceof TokenBudgetError) {
      this.emit({ type: "warning", text: error.message });
      return "token_budget";
    }
    this.emit({
      type: "error",
      message: error instanceof ModelError ? error.message : `unexpected failure: ${(error as Error)?.stack ?? error}`,
    });
    return "failed";
  }

  /** The run's last words: a warning for a limit, and the `end` event with its exit code. */
  private finishRun(status: RunStatus, steps: number, durationMs: number): RunOutcome {
    const saved = this.o.session ? " and the session saved" : "";
    const limits: Partial<Record<RunStatus, string>> = {
      step_limit: `stopped after ${this.o.config.maxSteps} steps (--max-steps) without the task being marked complete`,
      time_budget: `the time budget is spent (--max-time ${this.o.config.maxTime} s): the run was stopped${saved}`,
      stalled: `the model is going round in circles (${this.stall.reason}): the run was stopped${saved}`,
    };
    const limit = limits[status];
    if (limit) this.emit({ type: "warning", text: limit });
    const notStarted = this.starts.blocks(status);
    if (notStarted) {
      this.emit({ type: "error", message: `no command could be run, so the task cannot be done: ${notStarted}` });
      status = "failed";
    }
    let exitCode = status === "stopped" ? this.stopExitCode : RUN_ENDINGS[status].exit;
    if (exitCode === EXIT.ok && this.refused > 0 && this.o.config.failOnRefusal) exitCode = EXIT.needsApproval;
    const last = [...this.history.messages].reverse().find((m) => m.role === "assistant");
    this.emit({
      type: "end",
      status,
      exit_code: exitCode,
      steps,
      usage: { ...this.usage },
      verified: status === "completed" && this.verified,
      duration_ms: durationMs,
      session_id: this.o.sessionId(),
      refused: this.refused,
      // A claim no command could back is not the run's result.
      result: notStarted ? "" : contentText(last?.content).split(MARKER).join("").trim(),
      ...(notStarted ? { reason: "commands_not_started" as const } : {}),
      ...(this.o.config.keepJobs ? keptFields(this.o.jobs.kept()) : {}),
    });
    return { status, exitCode };
  }

  /** Streams one model turn; a context overflow compresses harder and tries again. */
  private async callModel(signal: AbortSignal): Promise<AssistantTurn> {
    // The last result in place (renamed; its directory may still be flushing) before the model is asked:
    // a kill -9 during the call finds it in the file.
    await this.o.session?.inPlace();
    let fraction = this.compression.target;
    for (let overflow = 0; ; overflow++) {
      const { messages } = validateOutgoing(this.history.messages);
      try {
        return await this.model.turn(messages, signal, (estimate) => {
          if (this.o.config.debug) writeDebugDump(this.o.workDir, messages, estimate, this.budget);
          // Right after a command's result nothing but the label would change: not written. A steering message
          // or a nudge since is.
          this.history.checkpoint("before_llm_call", "if_changed");
        });
      } catch (error) {
        if (!(error instanceof ModelError) || error.kind !== "context" || overflow >= MAX_CONTEXT_RETRIES) throw error;
        fraction = this.compression.afterOverflow(fraction);
        this.emit({
          type: "warning",
          text: `${error.message}; compressing harder (target ${(fraction * 100).toFixed(0)}% of the budget) and retrying`,
        });
        // The server disagrees with our estimate: trust it and squeeze below the halved target.
        await this.compressIfNeeded(signal, fraction, true, this.contextEstimate);
      }
    }
  }

  /** Stores the assistant turn and acts on it; returns a final status, or undefined to go on. */
  private async handleTurn(streamed: AssistantTurn, signal: AbortSignal): Promise<RunStatus | undefined> {
    const turn = rescueWrittenCalls(streamed);
    const message: Message = stamped({
      role: "assistant",
      content: turn.content || (turn.toolCalls.length ? null : ""),
    });
    if (turn.toolCalls.length) message.tool_calls = turn.toolCalls;
    // Kept in the provider's own field: thinking models that call tools refuse the next request without it.
    if (turn.reasoning) message[turn.reasoningField ?? "reasoning_content"] = turn.reasoning;
    if (turn.usage) message.aic_usage = turn.usage;
    if (this.history.messages[this.history.messages.length - 1]?.role === "assistant") this.history.messages.pop();
    this.history.messages.push(message);
    if (turn.reasoning) this.emit({ type: "reasoning", text: turn.reasoning });
    this.emit({
      type: "assistant",
      content: turn.content,
      tool_calls: turn.toolCalls.map((c) => ({ id: c.id, name: c.function.name, arguments: c.function.arguments })),
    });
    this.history.checkpoint("assistant_message", "soon");
    if (!turn.toolCalls.length) {
      // A suggestion typed during the last step is heard before the task counts as done.
      if (turn.content.includes(MARKER)) return this.suggestions.length ? undefined : this.judgeClaim(signal);
      // A person at the keyboard answers a question themselves; nobody there: the model is nudged, a few times.
      if (this.o.attended) return this.suggestions.length ? undefined : "answered";
      if (this.stall.toolless()) return "stalled";
      this.history.messages.push({ role: "user", content: CONTINUE_MESSAGE });
      return undefined;
    }
    return this.runToolCalls(turn, signal);
  }

  /** Each tool call of a turn in order, each answered once; a suggestion skips the rest. */
  private async runToolCalls(turn: AssistantTurn, signal: AbortSignal): Promise<RunStatus | undefined> {
    let suggestion: string | undefined;
    for (const [index, call] of turn.toolCalls.entries()) {
      if (signal.aborted) break;
      if (suggestion !== undefined) {
        this.answer(call.id, SKIPPED_AFTER_SUGGESTION);
        continue;
      }
      const result = await answerToolCall(call, this.toolCallContext(turn, index, signal));
      if (result.kind === "no_input") {
        answerOpenCalls(this.history.messages, NOT_EXECUTED_STOPPED);
        return "needs_approval";
      }
      await this.o.jobs.settle();
      this.answer(call.id, result.content);
      if (result.kind === "suggestion") suggestion = result.text;
      if (this.stall.repeated(call.function.arguments, result.content)) return "stalled";
    }
    if (suggestion !== undefined)
      this.history.messages.push({ role: "user", content: suggestionInsteadMessage(suggestion) });
    return signal.aborted ? stoppedStatus(signal) : undefined;
  }

  private toolCallContext(turn: AssistantTurn, index: number, signal: AbortSignal): ToolCallContext {
    return {
      options: this.o,
      cutOff: turn.finishReason === "length",
      autoApprove: this.autoApprove,
      cwd: () => this.history.cwd,
      index: index + 1,
      total: turn.toolCalls.length,
      signal,
      emit: (event) => this.emit(event),
      rulesChanged: () => this.history.rulesChanged(),
      beforeRun: async (id, command) => {
        if (this.o.checkpoints) {
          await this.o.checkpoints.beforeCommand(id, command);
          this.history.checkpoint("before_command", "soon"); // so that undo works even after a kill -9 during the command
        }
        // The turn that asked for the command (and its checkpoint) on disk before it runs: a kill -9 or a power
        // cut during the command finds the call in the file, answered [SESSION RECOVERED], never run again.
        await this.o.session?.settled();
      },
      afterRun: async (id) => this.o.checkpoints?.afterCommand(id),
      refusedForWantOfPerson: () => this.refused++,
      waiting: this.waiting,
    };
  }

  /**
   * A claim of completion: taken at its word without --done-when; with it,
   * the check decides. A refusal goes back to the model with the check's
   * output; MAX_REFUSED_CLAIMS in a row end the run (exit 6).
   */
  private async judgeClaim(signal: AbortSignal): Promise<RunStatus | undefined> {
    const check = this.o.config.doneWhen;
    if (!check) return "completed";
    const { passed, refusal } = await checkCompletion(check, {
      options: this.o,
      cwd: () => this.history.cwd,
      signal,
      emit: (e) => this.emit(e),
    });
    if (signal.aborted) return stoppedStatus(signal);
    if (passed) {
      this.verified = true;
      return "completed";
    }
    this.history.messages.push({ role: "user", content: refusal });
    this.history.checkpoint("completion_refused");
    if (++this.refusedClaims < MAX_REFUSED_CLAIMS) return undefined;
    this.emit({
      type: "warning",
      text: `--done-when refused ${this.refusedClaims} claims of completion in a row (${check} kept failing); giving up`,
    });
    return "unverified";
  }

  /** Every tool result ends with the background jobs' lines: those running, and those that ended since the last. */
  private answer(id: string, content: string): void {
    const jobs = this.o.jobs.report();
    const maxTime = this.o.config.maxTime;
    const clock =
      this.deadline !== undefined && maxTime !== undefined ? timeLeftLine(this.deadline - Date.now(), maxTime) : "";
    const text = [content, jobs, clock].filter(Boolean).join("\n");
    this.history.messages.push(stamped({ role: "tool", tool_call_id: id, content: text }));
    this.history.checkpoint("tool_result", "soon");
  }

  /**
   * Compression at the start of a step; a no-op while the history
   * fits. After a context overflow `ceiling` is the refused prompt's size, so
   * the retry is smaller than what the server refused even when the budget
   * overstates the server's real window.
   */
  private async compressIfNeeded(
    signal: AbortSignal,
    fraction: number,
    force = false,
    ceiling = Infinity,
  ): Promise<void> {
    if (this.history.messages.length <= 2) return;
    // Before tiktoken is loaded, a byte count bounds the tokens: a short history needs no counting at all.
    if (!force && !this.model.counter && tokenUpperBound(this.history.messages) <= this.budget) return;
    const counter = await this.tokenCounter();
    const before = await measureHistory(this.history.messages, counter, this.budget, force);
    this.model.contextEstimate = before;
    if (!force && before <= this.budget) return;
    const policy = this.compression;
    const { messages, summary, result } = await compressHistory(
      { messages: this.history.messages, summary: this.history.summary },
      policy,
      {
        counter,
        targetRaw: policy.targetRaw(fraction, counter.ratio, ceiling),
        basePrompt: this.history.basePrompt,
        summarise: (request) => this.model.summarise(request, signal),
      },
    );
    this.history.messages = messages;
    this.history.summary = summary;
    const after = counter.estimate(this.history.messages);
    this.model.contextEstimate = after;
    this.emit({
      type: "compression",
      algorithm: policy.algorithm,
      before_tokens: before,
      after_tokens: after,
      removed: result.removed,
      detail: result.detail,
    });
    this.history.checkpoint("compressed");
  }
}

// ════════════════════════════════════════════════════════════════════════════
// Run wiring
// Owns: what both front ends share: the sandbox and system prompt made before
// anything runs, the session, outputs and agent of one run, exit signals and
// crashes, and the standard streams' flags put back on every exit.
// ════════════════════════════════════════════════════════════════════════════

interface PreparedRun {
  sandbox: Sandbox;
  /** The system prompt without the rules' paragraph (which follows the rules as the person reloads them). */
  systemPrompt: string;
  rules: CommandRules;
  /** What preparing found worth a warning line at start (the server's window smaller than --max-prompt-len). */
  startWarnings?: string[];
}

/** The whole system prompt: the fixed part, then the rules in force. */
const fullSystemPrompt = (p: Pick<PreparedRun, "systemPrompt" | "rules">) => p.systemPrompt + p.rules.promptNote();

/** A budget must leave room for a conversation beside the system prompt, or nothing could ever be compressed into it. */
const MIN_CONVERSATION_TOKENS = 1024;

async function checkPromptRoom(config: Config, systemPrompt: string): Promise<void> {
  const budget = promptBudget(config);
  // Bytes bound tokens from above: most budgets are clearly big enough without loading tiktoken.
  if (budget >= Buffer.byteLength(systemPrompt) + PER_MESSAGE_OVERHEAD + MIN_CONVERSATION_TOKENS) return;
  const prompt = (await loadEncoder()).count(systemPrompt) + PER_MESSAGE_OVERHEAD;
  if (budget >= prompt + MIN_CONVERSATION_TOKENS) return;
  const reserved = replyReserve(config);
  const reserve = reserved
    ? ` after the ${reserved} tokens reserved for the model's answer (model profile ${modelProfile(config).name})`
    : "";
  const need = prompt + MIN_CONVERSATION_TOKENS;
  // The answer's reserve grows with --max-prompt-len (a quarter of it, up to the profile's most); with a server's
  // window it is fixed.
  const most = modelProfile(config).maxTokens;
  const least =
    config.window || most === undefined ? need + reserved : need <= 3 * most ? Math.ceil((4 * need) / 3) : need + most;
  throw new UsageError(
    `--max-prompt-len ${config.maxPromptLen} leaves no room for the conversation: the budget is ${budget} tokens${reserve}, and the system prompt alone takes ${prompt}; give at least ${least}`,
  );
}

/** AGENTS.md files from the git root down to `cwd`, root first, at most 32 KiB together. */
function readProjectInstructions(cwd: string): PromptFacts["projectInstructions"] {
  const chain: string[] = [];
  let dir = path.resolve(cwd);
  for (;;) {
    chain.unshift(dir);
    if (fs.existsSync(path.join(dir, ".git"))) break;
    const parent = path.dirname(dir);
    if (parent === dir) {
      chain.splice(0, chain.length - 1); // no git root: only the cwd itself
      break;
    }
    dir = parent;
  }
  const files: string[] = [];
  const parts: string[] = [];
  let budget = AGENTS_MD_LIMIT_BYTES;
  for (const d of chain) {
    const file = path.join(d, "AGENTS.md");
    let text: string;
    try {
      text = readOwnFile(file, AGENTS_MD_LIMIT_BYTES, true).toString("utf8").trim();
    } catch {
      continue; // missing, or not a regular file: a command may have planted a FIFO there
    }
    if (!text || budget <= 0) continue;
    text = headBytes(text, budget);
    budget -= utf8.encode(text).length;
    files.push(file);
    parts.push(text);
  }
  return files.length ? { files, text: parts.join("\n\n") } : undefined;
}

/** The sandbox and the system prompt that describes it. */
function prepareParts(config: Config): PreparedRun {
  const rules = CommandRules.load(config);
  const sandbox = setUpSandbox(config, rules.deniedPrograms(), rules.denyRules());
  const projectInstructions = readProjectInstructions(process.cwd());
  const systemPrompt = buildSystemPrompt({
    fast: config.fast,
    timeoutSec: config.timeoutSec,
    maxOutputBytes: config.maxOutputBytes,
    sandbox,
    selfCommand: selfCommand(),
    projectInstructions,
    doneWhen: config.doneWhen,
    shell: commandShell(),
    cwd: process.cwd(),
    ciEnv: !config.noCiEnv,
    maxTime: config.maxTime,
  });
  return { sandbox, systemPrompt, rules };
}

/** What either front end needs before anything runs: the sandbox, the system prompt, and a budget with room in it. */
async function prepareRun(config: Config): Promise<PreparedRun> {
  const warnings = await fitToServerWindow(config, config.budgetGiven === true);
  const prepared = prepareParts(config);
  prepared.startWarnings = warnings;
  await checkPromptRoom(config, fullSystemPrompt(prepared));
  return prepared;
}

interface RunOutcome {
  status: RunStatus;
  exitCode: number;
}

/**
 * What each way a run ends means: its exit code (`stopped` takes the
 * signal's), and what a last command that could not start does to it
 * (StartWatch): `fails` (a completion no command backs), `fails_if_none_ran`
 * (the model gave up, and no command ever ran), or `stands`.
 */
const RUN_ENDINGS: Record<RunStatus, { exit: number; unstarted: "fails" | "fails_if_none_ran" | "stands" }> = {
  completed: { exit: EXIT.ok, unstarted: "fails" },
  terminal: { exit: EXIT.ok, unstarted: "stands" },
  step_limit: { exit: EXIT.stepLimit, unstarted: "fails_if_none_ran" },
  needs_approval: { exit: EXIT.needsApproval, unstarted: "stands" },
  failed: { exit: EXIT.failure, unstarted: "stands" },
  stopped: { exit: EXIT.sigint, unstarted: "stands" },
  interrupted: { exit: EXIT.sigint, unstarted: "stands" },
  token_budget: { exit: EXIT.tokenBudget, unstarted: "fails_if_none_ran" },
  time_budget: { exit: EXIT.budget, unstarted: "fails_if_none_ran" },
  unverified: { exit: EXIT.unverified, unstarted: "fails_if_none_ran" },
  stalled: { exit: EXIT.stalled, unstarted: "fails_if_none_ran" },
  answered: { exit: EXIT.ok, unstarted: "fails_if_none_ran" },
};

/** What a front end gives a run: where its events go, how approvals are answered, and who can type into a command. */
interface FrontEnd {
  sink: EventSink;
  /** A person sits at the keyboard (the TUI): a reply without a tool call hands the turn back to them. */
  attended: boolean;
  approve: ApproveFn;
  /** Whether a person can type into a running command (decides the stuck-on-input rule). */
  canAnswerInput(): boolean;
  attachInput?: RunOptions["attachInput"];
  /** Runs right before each command starts (the TUI checks where its shell went). */
  beforeCommand?(): void;
  /** The model (default: a ModelClient for the configured endpoint; tests script one). */
  model?: ModelPort;
}

/** One run of aic, built the same way for both front ends. */
interface Run {
  readonly agent: Agent;
  readonly session: SessionStore | undefined;
  /** What commands left running (the TUI's /jobs). */
  readonly jobs: JobTable;
  /** What the session file restored, if anything (its usage shows at once). */
  readonly restored: LoadedSession | undefined;
  /** Saves the session with `reason`, releases its lock, keeps or removes the saved outputs: once, on every exit path. */
  close(reason: string): void;
}

/**
 * The session file (when there is one), the store of saved outputs that
 * belongs with it, and the agent, wired to a front end. The `start` event
 * goes out once the session file is claimed (its instance number is known);
 * what loading it repaired follows.
 */
/** The `start` event: what this run is, and the rules file's own reports. */
function announceStart(
  sink: EventSink,
  o: { config: Config; prepared: PreparedRun; sessionId: string; session: string | undefined; request: string },
): void {
  const { config, prepared } = o;
  sink.emit({
    type: "start",
    aic_version: VERSION,
    schema: JSON_SCHEMA,
    session_id: o.sessionId,
    model: config.model,
    model_profile: modelProfile(config).name,
    api_base: config.apiBase,
    cwd: process.cwd(),
    sandbox: sandboxFacts(prepared.sandbox),
    budget: budgetFacts(config, config.budgetGiven === true),
    rules: prepared.rules.present ? prepared.rules.path : null,
    session: o.session ?? null,
    request: o.request,
  });
  for (const report of prepared.rules.reports) sink.emit({ type: "warning", text: report });
  for (const text of prepared.startWarnings ?? []) sink.emit({ type: "warning", text });
  if (config.keepJobs)
    sink.emit({
      type: "info",
      text: "--keep-jobs: what commands leave running stays running after aic exits; the repository guard and the command rules no longer watch it then",
    });
}

/**
 * The run's checkpoints (none with --no-checkpoints). Without a session file
 * nobody can undo later, but each command's changed files are still shown:
 * its snapshots then go to a store of the run's own, removed when it ends.
 */
function runCheckpoints(
  config: Config,
  workDir: HeldDirectory,
  session: SessionStore | undefined,
  jobs: JobTable,
  sink: EventSink,
): Checkpoints | undefined {
  if (config.noCheckpoints) return undefined;
  const checkpoints = Checkpoints.forDirectory(
    workDir,
    session?.path,
    (text) => sink.emit({ type: "warning", text }),
    !session,
  );
  // A job must not swap a directory for a link while a snapshot reads the tree: its processes wait meanwhile.
  checkpoints.freeze = () => jobs.freeze();
  checkpoints.notice = (text) => sink.emit({ type: "info", text });
  // The first snapshot starts now, while the model reads the task: the first command seldom waits for it.
  checkpoints.warmUp();
  return checkpoints;
}

/** Where the run's cut outputs are saved: the session's directory (recorded in it), or one of the run's own. */
function runOutputs(session: SessionStore | undefined): OutputStore {
  return new OutputStore(
    session !== undefined,
    session?.sessionId ?? String(process.pid),
    session?.outputDir,
    (dir) => {
      if (session) session.outputDir = dir;
    },
  );
}

/** A session file that does not parse, at the start of a headless run: one line, exit 2, nothing asked or written. */
class BrokenSession extends Error {}

function createRun(config: Config, prepared: PreparedRun, front: FrontEnd, request: string): Run {
  const sessionPath = config.sessionPath;
  OutputStore.pruneOld();
  let session: SessionStore | undefined;
  try {
    session = sessionPath
      ? SessionStore.claim(sessionPath, { model: config.model, apiBase: config.apiBase }, front.sink)
      : undefined;
  } catch (error) {
    // Every name taken (planted FIFOs, a thousand instances) or the file in use: one line, not a crash.
    throw new BrokenSession(
      `aic: error: ${(error as Error).message} (--session PATH names another, --no-session saves none)`,
    );
  }
  const loaded = session?.load(fullSystemPrompt(prepared));
  if (loaded?.broken && config.nogui) {
    session!.release();
    throw new BrokenSession(loaded.broken);
  }
  // A run without a session file still has an id: the JSON events and the end line name it.
  const runId = newSessionId();
  const sessionId = () => session?.sessionId ?? runId;
  announceStart(front.sink, { config, prepared, sessionId: sessionId(), session: session?.path, request });
  const excluded = session ? excludeSessionFromGit(session.path) : undefined;
  if (excluded) front.sink.emit({ type: "info", text: `[SESSION] ${excluded}` });
  // What reading a long session left (the last of its texts; for a file read whole, its bytes and their
  // decoded text) is garbage once it is parsed: collected now, before the first checkpoint allocates
  // again, so the peak is not their sum.
  if (session && session.loadedBytes >= COLLECT_EVERY_BYTES) Bun.gc(true);
  const outputs = runOutputs(session);
  const workDir = HeldDirectory.open(process.cwd());
  // The jail keeps the session's lock file (and those of other aic instances here) read-only, and shows commands this
  // run's saved outputs: it starts once they exist.
  try {
    if (prepared.sandbox.enabled) outputs.ensure();
  } catch (error) {
    // Nowhere to keep outputs (a read-only container, /tmp included): a long output is then cut without a copy.
    front.sink.emit({ type: "warning", text: `whole outputs cannot be kept: ${(error as Error).message}` });
  }
  prepared.sandbox.start({ workDir, files: ownSessionFiles(session?.path, workDir), keepOutputs: outputs.path });
  // Before the first command: a daemon it double-forks must become aic's, to be found and stopped later.
  becomeSubreaper();
  const jobs = new JobTable(
    (e) => front.sink.emit(e),
    outputs,
    config.limits.runawayBytes,
    () => prepared.sandbox.reaper,
  );
  const checkpoints = runCheckpoints(config, workDir, session, jobs, front.sink);
  const agent = new Agent({
    config,
    sink: front.sink,
    approve: front.approve,
    sandbox: prepared.sandbox,
    systemPrompt: prepared.systemPrompt,
    rules: prepared.rules,
    checkpoints,
    session,
    outputs,
    workDir,
    canAnswerInput: front.canAnswerInput,
    attachInput: front.attachInput,
    beforeCommand: front.beforeCommand,
    jobs,
    sessionId,
    attended: front.attended,
    model: front.model,
  });
  if (loaded) {
    for (const line of loaded.reports)
      front.sink.emit(
        loaded.failed ? { type: "warning", text: `[SESSION] ${line}` } : { type: "info", text: `[SESSION] ${line}` },
      );
    agent.restore(loaded);
  } else if (!config.nogui) front.sink.emit({ type: "info", text: "[SESSION] off (--no-session): nothing is saved" });
  let closed = false;
  return {
    agent,
    session,
    jobs,
    restored: loaded,
    close(reason) {
      if (closed) return;
      closed = true;
      // Jobs first, so the session records how each of them ended.
      if (config.keepJobs) {
        jobs.keepAll();
        prepared.sandbox.keepRunning();
      } else {
        jobs.stopAll();
        prepared.sandbox.stopEverything();
      }
      const said = disarmedMessage(prepared.sandbox.auditRepositories(true));
      if (said) front.sink.emit({ type: "warning", text: said });
      agent.history.checkpoint(reason);
      session?.release();
      outputs.close(config.keepJobs);
      checkpoints?.dispose();
      workDir.close();
    },
  };
}

const EXIT_SIGNALS = { SIGINT: EXIT.sigint, SIGTERM: EXIT.sigterm, SIGHUP: EXIT.sighup } as const;
type ExitSignal = keyof typeof EXIT_SIGNALS;

/**
 * How a front end ends on a signal or a crash: `onSignal` gets the exit
 * code and the session's checkpoint reason of the first SIGINT, SIGTERM or
 * SIGHUP; `onCrash` gets anything thrown outside the loop's own handling (a
 * PTY or emulator callback), so the session is still saved first.
 */
function onExitEvents(onSignal: (code: number, reason: string) => void, onCrash: (error: unknown) => void): void {
  let signalled = false;
  for (const sig of Object.keys(EXIT_SIGNALS) as ExitSignal[])
    process.on(sig, () => {
      if (signalled) return;
      signalled = true;
      onSignal(EXIT_SIGNALS[sig], `signal_${os.constants.signals[sig]}`);
    });
  process.on("uncaughtException", onCrash);
  process.on("unhandledRejection", onCrash);
}

/**
 * Both front ends end on a signal the same way: the run is asked to stop and
 * normally winds down at once; should that wedge (a terminal that hung up, a
 * stuck write), the run is closed (session saved, launcher and jobs stopped)
 * and the process exits anyway.
 */
function guardShutdown(code: number, close: () => void): void {
  setTimeout(() => {
    try {
      close();
    } finally {
      process.exit(code);
    }
  }, SIGNAL_SHUTDOWN_GUARD_MS).unref();
}

/** A crash report, for stderr once the terminal is usable. */
const crashReport = (error: unknown) => `aic: internal error: ${(error as Error)?.stack ?? error}\n`;

const F_GETFL = 3;
const F_SETFL = 4;

/**
 * Remembers the file-status flags of stdin, stdout and stderr, and returns
 * what puts them back. Bun makes a pipe it writes to non-blocking, and the
 * flag lives on the open file description shared with the parent (a CI
 * shell, tee, /usr/bin/time), whose own writes would then fail with EAGAIN.
 */
function rememberStreamFlags(): () => void {
  const c = libc()?.symbols;
  if (!c) return () => {};
  const saved = [0, 1, 2].map((fd) => c.fcntl(fd, F_GETFL, 0));
  return () =>
    saved.forEach((flags, fd) => {
      if (flags >= 0 && c.fcntl(fd, F_GETFL, 0) !== flags) c.fcntl(fd, F_SETFL, flags);
    });
}

// ════════════════════════════════════════════════════════════════════════════
// Headless front end
// Owns: --nogui: standard input for approvals and for keystrokes to a running
// command, and the run's outcome as an exit code, with everything saved first.
// ════════════════════════════════════════════════════════════════════════════

/**
 * Standard input for --nogui: lines for the approval prompt and, while a
 * command runs on a terminal, keystrokes passed through to the command.
 */
class StdinReader {
  private buffer = "";
  private ended = false;
  private started = false;
  private waiters: ((line: string | null) => void)[] = [];
  private forward: ((data: string | Uint8Array) => void) | undefined;
  private stream: NodeJS.ReadableStream = process.stdin;

  private start(): void {
    if (this.started) return;
    this.started = true;
    this.listen(process.stdin);
  }

  /**
   * On a terminal, Ctrl+D at the start of a line ends the stream: while a
   * command has the keys it was meant for the command (python's exit), so it
   * gets an end-of-file character and aic reads the terminal afresh.
   */
  private listen(stdin: NodeJS.ReadableStream): void {
    this.stream = stdin;
    let done = false;
    stdin.on("data", (chunk: Buffer) => {
      if (this.forward) return this.forward(chunk);
      this.buffer += chunk.toString("utf8");
      this.drain();
    });
    const end = () => {
      if (done) return;
      done = true;
      if (this.forward && process.stdin.isTTY) {
        this.forward("\x04");
        return this.listen(new tty.ReadStream(0));
      }
      this.ended = true;
      this.drain();
    };
    stdin.on("end", end);
    stdin.on("error", end);
    stdin.on("close", end);
  }

  private drain(): void {
    while (this.waiters.length) {
      const nl = this.buffer.indexOf("\n");
      if (nl >= 0) {
        const line = this.buffer.slice(0, nl).replace(/\r$/, "");
        this.buffer = this.buffer.slice(nl + 1);
        this.waiters.shift()!(line);
      } else if (this.ended) {
        const rest = this.buffer;
        this.buffer = "";
        this.waiters.shift()!(rest ? rest : null);
      } else break;
    }
    if (!this.waiters.length && this.started && !this.forward) this.stream.pause();
  }

  /** Standard input was consumed elsewhere (the request, read with `-`): there is nothing left to answer with. */
  markEnded(): void {
    this.started = true;
    this.ended = true;
  }

  /** The next line, or null at end of input. */
  readLine(): Promise<string | null> {
    this.start();
    this.stream.resume();
    return new Promise((resolve) => {
      this.waiters.push(resolve);
      this.drain();
    });
  }

  attach(write: (data: string | Uint8Array) => void): () => void {
    this.start();
    this.forward = write;
    this.stream.resume();
    return () => {
      this.forward = undefined;
      this.stream.pause();
    };
  }
}

/**
 * The --nogui approval prompt: y/yes/empty approves, n/no rejects, anything
 * else is a suggestion. With --json and no terminal on stdin the prompt is
 * not written: a CI job's stderr holds diagnostics only (the `command` event
 * already names what waits).
 */
function plainApproval(stdin: StdinReader, prompt: boolean): ApproveFn {
  return async ({ command, typedInto }) => {
    if (prompt)
      writeOut(2, `Approve ${typedInto ? "input" : "command"}? (y/n/suggestion): ${visibleControls(command)}\n> `);
    const line = await stdin.readLine();
    if (line === null) return { kind: "no_input" };
    const answer = line.trim();
    if (answer === "" || /^(y|yes)$/i.test(answer)) return { kind: "approve" };
    if (/^(n|no)$/i.test(answer)) return { kind: "reject" };
    return { kind: "suggest", text: answer };
  };
}

async function runHeadless(config: Config, prepared: PreparedRun): Promise<number> {
  const sink: EventSink = config.json ? new JsonSink() : new PlainSink(!config.noThinking);
  for (const text of config.notices) sink.emit({ type: "info", text });
  for (const w of config.warnings) sink.emit({ type: "warning", text: w });
  const stdin = new StdinReader();
  let request = config.request!;
  if (request === "-") {
    request = (await Bun.stdin.text()).trim();
    // The task used up stdin: approvals must not be answered by the task's own lines.
    stdin.markEnded();
    if (!request) {
      writeOut(2, "aic: error: the request read from stdin (-) is empty\n");
      return EXIT.usage;
    }
  }
  const stdinIsTerminal = Boolean(process.stdin.isTTY);
  let run: Run;
  try {
    run = createRun(
      config,
      prepared,
      {
        sink,
        approve: plainApproval(stdin, !config.json || Boolean(process.stdin.isTTY)),
        attended: false,
        canAnswerInput: () => stdinIsTerminal,
        attachInput: stdinIsTerminal ? (io) => stdin.attach(io.write) : undefined,
      },
      request,
    );
  } catch (error) {
    if (!(error instanceof BrokenSession)) throw error;
    writeOut(2, `${error.message}\n`);
    return EXIT.usage;
  }
  const finish = (code: number, reason: string) => {
    run.close(reason);
    return code;
  };
  let signalled: { code: number; reason: string } | undefined;
  onExitEvents(
    (code, reason) => {
      signalled = { code, reason };
      run.agent.stop(code);
      guardShutdown(code, () => finish(code, reason));
    },
    (error) => {
      writeOut(2, crashReport(error));
      process.exit(finish(EXIT.failure, "process_exit"));
    },
  );
  const outcome = await run.agent.run(request);
  if (signalled) return finish(signalled.code, signalled.reason);
  // (With --json the end event says so: stdout stays the one place a CI job reads.)
  if (outcome.status === "needs_approval" && !config.json)
    writeOut(2, "aic: a command needs approval but standard input has ended; use --auto-approve for unattended runs\n");
  if (!config.keepJobs) await run.jobs.stopAllAndWait();
  return finish(outcome.exitCode, "process_exit");
}

// ════════════════════════════════════════════════════════════════════════════
// Web search
// Owns: `aic search QUERY`, the model's way to the web: DuckDuckGo through
// duck-duck-scrape, printed as a JSON array of {title, href, body}.
// ════════════════════════════════════════════════════════════════════════════

const SEARCH_TIMEOUT_MS = 20_000;

function stripTags(html: string): string {
  return html
    .replace(/<[^>]*>/g, "")
    .replace(/&#x27;|&#39;/g, "'")
    .replace(/&quot;/g, '"')
    .replace(/&lt;/g, "<")
    .replace(/&gt;/g, ">")
    .replace(/&amp;/g, "&")
    .trim();
}

function lookupHost(host: string): Promise<void> {
  return new Promise((resolve, reject) =>
    (require("node:dns") as typeof import("node:dns")).lookup(host, (error) =>
      error
        ? reject(new Error(`cannot resolve ${host} (${error.code ?? error.message}); is the network reachable?`))
        : resolve(),
    ),
  );
}

async function runSearch(query: string, maxResults: number): Promise<number> {
  try {
    // duck-duck-scrape's HTTP client still calls url.parse(); its deprecation notice would be noise on stderr.
    process.noDeprecation = true;
    // The library reports any network failure as "Failed to get the VQD"; name the real cause first.
    await lookupHost("duckduckgo.com");
    const { search, SafeSearchType } = await import("duck-duck-scrape");
    const timeout = new Promise<never>((_, reject) =>
      setTimeout(() => reject(new Error(`no answer within ${SEARCH_TIMEOUT_MS / 1000} s`)), SEARCH_TIMEOUT_MS).unref(),
    );
    const found = await Promise.race([search(query, { safeSearch: SafeSearchType.MODERATE }), timeout]);
    const results = (found.noResults ? [] : found.results).slice(0, maxResults).map((r) => ({
      title: stripTags(r.title ?? ""),
      href: r.url ?? "",
      body: stripTags(r.description ?? ""),
    }));
    writeOut(1, JSON.stringify(results, null, 2) + "\n");
    return EXIT.ok;
  } catch (error) {
    const e = error as Error & { code?: string };
    writeOut(2, `aic search: error: the search failed: ${e.code ? `${e.code} ` : ""}${e.message.split("\n")[0]}\n`);
    return EXIT.failure;
  }
}

// ════════════════════════════════════════════════════════════════════════════
// TUI parts: prompt history
// Owns: the prompt history file shared by every aic of the person (locked,
// merged, replaced atomically, saved in typing order), and walking it with
// Up/Down and Ctrl+R. Loaded only by the TUI.
// ════════════════════════════════════════════════════════════════════════════

const HISTORY_LIMIT = 1000;

/** One prompt per line: backslashes and newlines escaped so a multi-line prompt stays one entry. */
function escapeHistoryLine(prompt: string): string {
  return prompt.replace(/\\/g, "\\\\").replace(/\n/g, "\\n").replace(/\r/g, "\\r");
}

function unescapeHistoryLine(line: string): string {
  return line.replace(/\\(\\|n|r)/g, (_, c: string) => (c === "n" ? "\n" : c === "r" ? "\r" : "\\"));
}

/** Adds `prompt` unless it repeats the newest entry, keeping the newest HISTORY_LIMIT. */
function appendHistoryEntry(entries: string[], prompt: string): string[] {
  const next = entries[entries.length - 1] === prompt ? entries.slice() : [...entries, prompt];
  return next.slice(-HISTORY_LIMIT);
}

function readHistoryFile(file: string): string[] {
  try {
    return fs
      .readFileSync(file, "utf8")
      .split("\n")
      .filter((l) => l !== "")
      .map(unescapeHistoryLine)
      .slice(-HISTORY_LIMIT);
  } catch {
    return [];
  }
}

/**
 * The prompt history in ~/.aic_history. Several aic processes may save at
 * once: each save locks the file (proper-lockfile), re-reads it, appends and
 * replaces it atomically (write-file-atomic), so no process drops another's
 * entries.
 */
class PromptHistory {
  entries: string[];
  /** This process's saves, one after another: the lock's randomized retries would let a later one win. */
  private saving: Promise<void> = Promise.resolve();
  constructor(readonly file: string) {
    this.entries = readHistoryFile(file);
  }

  /** Adds `prompt` now, and saves it after every earlier save of this process (the promise says how that went). */
  add(prompt: string): Promise<void> {
    if (!prompt.trim()) return Promise.resolve();
    this.entries = appendHistoryEntry(this.entries, prompt);
    const saved = this.saving.then(() => this.save(prompt));
    this.saving = saved.catch(() => undefined);
    return saved;
  }

  /** Resolves once every save begun so far has ended (at quit, so the last prompt is not lost). */
  settled(): Promise<void> {
    return this.saving;
  }

  private async save(prompt: string): Promise<void> {
    const lockfile = require("proper-lockfile") as typeof import("proper-lockfile");
    const writeFileAtomic = require("write-file-atomic") as typeof import("write-file-atomic");
    if (!fs.existsSync(this.file)) fs.writeFileSync(this.file, "", { mode: 0o600, flag: "a" });
    const release = await lockfile.lock(this.file, {
      realpath: false,
      stale: 5000,
      retries: { retries: 200, minTimeout: 2, maxTimeout: 50, randomize: true },
    });
    try {
      const merged = appendHistoryEntry(readHistoryFile(this.file), prompt);
      writeFileAtomic.sync(this.file, merged.map(escapeHistoryLine).join("\n") + "\n", { mode: 0o600 });
    } finally {
      await release();
    }
  }
}

/** Readline-style Up/Down walking of the history that keeps the line in progress. */
class HistoryCursor {
  private index: number;
  private draft = "";
  constructor(private readonly history: () => readonly string[]) {
    this.index = history().length;
  }
  reset(): void {
    this.index = this.history().length;
    this.draft = "";
  }
  /** The entry before the current one, or undefined at the oldest. */
  older(current: string): string | undefined {
    const entries = this.history();
    if (this.index > entries.length) this.index = entries.length;
    if (this.index === 0) return undefined;
    if (this.index === entries.length) this.draft = current;
    return entries[--this.index];
  }
  /** The entry after the current one; past the newest, the line that was in progress. */
  newer(): string | undefined {
    const entries = this.history();
    if (this.index >= entries.length) return undefined;
    this.index++;
    return this.index === entries.length ? this.draft : entries[this.index];
  }
}

/** Ctrl+R: newest-first, case-insensitive substring search; Ctrl+R again steps to the next older match. */
class ReverseSearch {
  query = "";
  /** Index in the history of the current match, or -1. */
  match = -1;
  constructor(private readonly history: () => readonly string[]) {}

  private find(before: number): number {
    const entries = this.history();
    const q = this.query.toLowerCase();
    for (let i = Math.min(before, entries.length) - 1; i >= 0; i--) if (entries[i]!.toLowerCase().includes(q)) return i;
    return -1;
  }
  /** The query changed: search again from the newest entry. */
  setQuery(query: string): void {
    this.query = query;
    this.match = this.find(this.history().length);
  }
  /** Ctrl+R pressed again: the next older match (stays put when there is none). */
  next(): void {
    const older = this.find(this.match < 0 ? this.history().length : this.match);
    if (older >= 0) this.match = older;
  }
  get text(): string | undefined {
    return this.match >= 0 ? this.history()[this.match] : undefined;
  }
}

// ════════════════════════════════════════════════════════════════════════════
// TUI parts: figures, footer and banner
// Owns: the footer's figures as events move them, its fields fitted to the
// width, the history search line, the status bar and the start banner.
// ════════════════════════════════════════════════════════════════════════════

/** Tokens per second over the last second of streaming; 0 once the stream has been idle for 2 s. */
class TokenRate {
  private static readonly WINDOW_MS = 1000;
  /** With no token for this long the rate reads 0. */
  private static readonly IDLE_MS = 2000;
  private samples: { at: number; tokens: number }[] = [];
  add(tokens: number, now = Date.now()): void {
    this.samples.push({ at: now, tokens });
  }
  rate(now = Date.now()): number {
    this.samples = this.samples.filter((s) => now - s.at <= TokenRate.IDLE_MS);
    const last = this.samples[this.samples.length - 1];
    if (!last || now - last.at > TokenRate.IDLE_MS) return 0;
    const window = this.samples.filter((s) => now - s.at <= TokenRate.WINDOW_MS);
    return window.reduce((n, s) => n + s.tokens, 0);
  }
}

/** 950, 12.3k, 1.2M: token counts that fit a status line. */
function compactCount(n: number): string {
  if (n < 10_000) return String(n);
  if (n < 1_000_000) return `${(n / 1000).toFixed(n < 100_000 ? 1 : 0)}k`;
  return `${(n / 1_000_000).toFixed(1)}M`;
}

/** NO_COLOR set (to anything): the TUI keeps to the terminal's own colours; bold, underline and reverse stay. */
const noColor = (): boolean => Boolean(process.env.NO_COLOR);

/** A foreground for the TUI: `color`, or the terminal's own under NO_COLOR. */
function fgColor(ot: OpenTui, color: string): RGBA {
  return noColor() ? ot.RGBA.defaultForeground() : ot.parseColor(color);
}

/** A background for the TUI: `color`, or the terminal's own under NO_COLOR. */
function bgColor(ot: OpenTui, color: string): RGBA {
  return noColor() ? ot.RGBA.defaultBackground() : ot.parseColor(color);
}

/** The figures the footer shows, kept up to date from the agent's events. */
interface FooterFigures {
  sandboxOn: boolean;
  step: number;
  maxSteps: number;
  context: number;
  budget: number;
  tokens: number;
  /** Spent against --max-tokens, when there is a budget. */
  spending?: { spent: number; max: number };
  /** Background jobs running now. */
  jobs: number;
  rate: number;
  state: "pending" | "running" | "idle";
  autoApprove: boolean;
  model: string;
  session: string;
  /** A notice that must be seen now ("Ctrl+C again to quit", "keys go to the command"). */
  notice?: string;
  /** What the run waits on now, since when: the signs of life a silent model or a quiet command leaves out. */
  activity?: Activity;
}

/** The model's turn (from the step's start to its answer, with the tokens streamed so far), or a command running. */
interface Activity {
  kind: "model" | "command";
  since: number;
  tokens: number;
}

/** The spinner's frames and how often it turns (the footer is redrawn only then, and only while something runs). */
const SPINNER_FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏";
const SPINNER_MS = 125;

/** The activity as the footer shows it: `⠋ model 12s · 340 tok` (the frame follows the clock). */
function activityField(a: Activity, now: number): FooterField {
  const frame = SPINNER_FRAMES[Math.floor(now / SPINNER_MS) % SPINNER_FRAMES.length];
  const seconds = `${Math.max(0, Math.floor((now - a.since) / 1000))}s`;
  const label = a.kind === "model" ? "waiting for the model" : "command running";
  const tokens = a.kind === "model" && a.tokens ? ` · ${compactCount(a.tokens)} tok` : "";
  return {
    text: `${frame} ${label} ${seconds}${tokens}`,
    short: `${frame} ${a.kind} ${seconds}`,
    keep: 0,
    color: COLORS.info,
  };
}

/** The figures the TUI keeps itself; the rest (rate, state, auto-approve) are read when the footer is drawn. */
type TuiFigures = Omit<FooterFigures, "rate" | "state" | "autoApprove">;

/** The status line's figures before anything ran. */
function initialFigures(config: Config, prepared: PreparedRun): TuiFigures {
  return {
    sandboxOn: prepared.sandbox.enabled,
    step: 0,
    maxSteps: config.maxSteps,
    context: 0,
    budget: promptBudget(config),
    tokens: 0,
    spending: config.maxTokens === undefined ? undefined : { spent: 0, max: config.maxTokens },
    jobs: 0,
    model: config.model,
    session: "no session",
  };
}

/** What an agent event changes in the footer's figures; true when it changed something. */
function updateFigures(f: TuiFigures, e: AgentEvent, now = Date.now()): boolean {
  switch (e.type) {
    case "step":
      f.step = e.step;
      f.activity = { kind: "model", since: now, tokens: 0 };
      return true;
    case "assistant_delta":
    case "reasoning_delta":
      if (f.activity?.kind !== "model") return false;
      f.activity.tokens++;
      return false;
    case "command":
      f.activity = { kind: "command", since: now, tokens: 0 };
      return true;
    case "approval":
      // The approval comes after the command's event: one that runs keeps its seconds counting from now.
      f.activity = ["approved", "auto", "allowed", "read_only"].includes(e.decision)
        ? { kind: "command", since: now, tokens: 0 }
        : undefined;
      return true;
    case "assistant":
    case "command_result":
    case "end":
      f.activity = undefined;
      return true;
    case "usage":
      f.tokens = e.total.billable_tokens;
      f.context = e.context_estimate;
      if (e.max_tokens !== null) f.spending = { spent: e.spent, max: e.max_tokens };
      return true;
    case "context":
      f.context = e.estimate;
      f.budget = e.budget;
      return true;
    // Each job starts once and ends once, so the two events keep the count.
    case "job_started":
      f.jobs++;
      return true;
    case "job_ended":
      f.jobs = Math.max(0, f.jobs - 1);
      return true;
    case "command_output":
    case "command_waiting":
    case "reasoning":
    case "summary_delta":
    case "thinking_complete":
      return false;
    default:
      // Of the events every front end words, the ones above are all that move a figure.
      e satisfies WordedEvent;
      return false;
  }
}

/** One field of the footer; a lower `keep` is more important. 0 is never dropped. */
interface FooterField {
  text: string;
  short?: string;
  keep: number;
  color?: string;
}

function footerFields(f: FooterFigures): FooterField[] {
  const fields: FooterField[] = [
    {
      text: `Sandbox: ${f.sandboxOn ? "on" : "off"}`,
      short: `SB ${f.sandboxOn ? "on" : "off"}`,
      keep: 3,
      color: f.sandboxOn ? COLORS.ok : COLORS.error,
    },
  ];
  if (f.notice) fields.push({ text: f.notice, keep: 0, color: COLORS.warning });
  fields.push(
    f.state === "pending"
      ? { text: "⚠ approval pending", short: "⚠ pending", keep: 0, color: COLORS.warning }
      : f.state === "running" && f.activity
        ? activityField(f.activity, Date.now())
        : { text: f.state, keep: 4 },
    { text: `auto-approve ${f.autoApprove ? "ON" : "off"}`, short: `AA ${f.autoApprove ? "ON" : "off"}`, keep: 0 },
    { text: `step ${f.step}/${f.maxSteps}`, short: `${f.step}/${f.maxSteps}`, keep: 1 },
    {
      text: `ctx ${compactCount(f.context)}/${compactCount(f.budget)}`,
      short: `ctx ${compactCount(f.context)}`,
      keep: 1,
    },
    f.spending
      ? {
          text: `${compactCount(f.spending.spent)}/${compactCount(f.spending.max)} tok`,
          keep: 1,
          color: f.spending.spent > 0.9 * f.spending.max ? COLORS.warning : undefined,
        }
      : { text: `${compactCount(f.tokens)} tok`, keep: 5 },
    ...(f.jobs ? [{ text: `${f.jobs} job${f.jobs === 1 ? "" : "s"}`, keep: 2 }] : []),
    { text: `${f.rate} tok/s`, keep: 6 },
    // The session id is what resumes a run; the model's name is in the banner: it goes first.
    { text: f.model, short: f.model.length > 14 ? `${f.model.slice(0, 13)}…` : undefined, keep: 8 },
    { text: f.session, short: f.session.includes("#") ? f.session.slice(f.session.indexOf("#")) : undefined, keep: 7 },
  );
  return fields;
}

/**
 * The footer for `width` columns: the least important fields are shortened
 * first, then dropped, so what a person needs most (a pending approval, the
 * auto-approve state, the step, the context) stays whole at any width.
 */
function fitFooter(fields: FooterField[], width: number): FooterField[] {
  const length = (list: FooterField[]) => 1 + list.reduce((n, f) => n + Bun.stringWidth(f.text) + 1, 0);
  const out = fields.map((f) => ({ ...f }));
  // Least important first: shortened, then dropped if that is not enough, before anything more important is touched.
  for (const f of [...out].sort((a, b) => b.keep - a.keep)) {
    if (length(out) <= width) break;
    if (f.short !== undefined) f.text = f.short;
    if (length(out) > width && f.keep > 0) out.splice(out.indexOf(f), 1);
  }
  return out;
}

/**
 * Ctrl+R over the prompt history, drawn on one line above the prompt:
 * typing narrows the search, Ctrl+R steps to an older match, Enter takes the
 * match, Escape or Ctrl+G puts the prompt back as it was.
 */
class SearchLine {
  readonly node: TextNode;
  private readonly search: ReverseSearch;
  private saved: string | undefined;

  constructor(
    ot: OpenTui,
    r: CliRenderer,
    history: () => readonly string[],
    /** Puts a value into the prompt when the search ends. */
    private readonly done: (value: string) => void,
  ) {
    this.node = new ot.TextRenderable(r, {
      height: 1,
      width: "100%",
      fg: fgColor(ot, "#ffd75f"),
      content: "",
      visible: false,
    });
    this.search = new ReverseSearch(history);
  }

  get active(): boolean {
    return this.saved !== undefined;
  }

  start(current: string): void {
    this.saved = current;
    this.search.setQuery("");
    this.draw();
  }

  /** A key while searching; "quit" when the person pressed Ctrl+C. */
  key(key: KeyEvent, id: string): "quit" | undefined {
    key.preventDefault();
    if (id === "C-c") return "quit";
    if (id === "C-r") this.search.next();
    else if (id === "return") return void this.end(this.search.text ?? this.saved ?? "");
    else if (id === "escape" || id === "C-g") return void this.cancel();
    else if (id === "backspace") this.search.setQuery(this.search.query.slice(0, -1));
    else if (!key.ctrl && !key.meta && key.sequence && !key.sequence.startsWith("\x1b") && key.sequence >= " ")
      this.search.setQuery(this.search.query + key.sequence);
    this.draw();
    return undefined;
  }

  /** Ends the search leaving the prompt as it was (a dialog opened, the tab changed). */
  cancel(): void {
    if (this.saved !== undefined) this.end(this.saved);
  }

  private end(value: string): void {
    this.saved = undefined;
    this.node.visible = false;
    this.done(value);
  }

  private draw(): void {
    const match = this.search.text;
    const failed = this.search.query && match === undefined ? "failing " : "";
    this.node.content = `(${failed}reverse-i-search)\`${this.search.query}': ${match ?? ""}   [Ctrl+R older · Enter accept · Esc cancel]`;
    this.node.visible = true;
  }
}

/** How long the warning that commands run for real stays up, unless an approval is pending. */
const BANNER_HIDE_MS = 20_000;

/**
 * The footer line and the banner above the prompt: the banner warns that
 * commands run for real (for a while after start), or names the command that
 * waits for approval. Both fit the terminal's width.
 */
class StatusBar {
  readonly footer: TextNode;
  readonly banner: TextNode;
  private footerText = "";
  private readonly startedAt = Date.now();

  constructor(
    private readonly ot: OpenTui,
    r: CliRenderer,
  ) {
    this.banner = new ot.TextRenderable(r, {
      height: 1,
      width: "100%",
      bg: bgColor(ot, "#5f0000"),
      fg: fgColor(ot, "#ffffaf"),
      content: "",
    });
    this.footer = new ot.TextRenderable(r, {
      height: 1,
      width: "100%",
      fg: fgColor(ot, "#b0b0b0"),
      bg: bgColor(ot, "#202020"),
      content: "",
    });
  }

  draw(figures: FooterFigures, pending: ApprovalRequest | undefined, width: number): void {
    const fields = fitFooter(footerFields(figures), width);
    const text = fields.map((f) => f.text).join("│");
    if (text !== this.footerText) {
      this.footerText = text;
      const { ot } = this;
      const chunks: TextChunk[] = [];
      fields.forEach((f, i) =>
        chunks.push({
          __isChunk: true,
          text: `${i ? "│" : " "}${f.text}`,
          fg: f.color ? fgColor(ot, f.color) : undefined,
        } as TextChunk),
      );
      this.footer.content = new ot.StyledText(chunks);
    }
    const banner = bannerText(pending, !figures.autoApprove && Date.now() - this.startedAt < BANNER_HIDE_MS, width);
    if (this.banner.content.toString() !== banner) this.banner.content = banner;
    this.banner.visible = banner !== "";
  }
}

/** The banner's words for `width` columns: the longest variant that fits. */
function bannerText(pending: ApprovalRequest | undefined, warn: boolean, width: number): string {
  const fits = (t: string) => Bun.stringWidth(t) <= width;
  if (pending) {
    const which = pending.total > 1 ? ` (${pending.index} of ${pending.total})` : "";
    const hint = "  —  Y/Enter approves · N/Esc rejects · type to suggest";
    const head = ` ⚠ Approval needed${which}: `;
    const command = visibleControls(pending.command.split("\n")[0] ?? "");
    const room = width - Bun.stringWidth(head) - (fits(head + command + hint) ? Bun.stringWidth(hint) : 0);
    const shown = Bun.stringWidth(command) <= room ? command : `${command.slice(0, Math.max(0, room - 1))}…`;
    return head + shown + (fits(head + command + hint) ? hint : "");
  }
  if (!warn) return "";
  return (
    [
      " ⚠ Commands the agent proposes run for real on this machine once you approve them. /aa turns on auto-approve.",
      " ⚠ Approved commands run for real on this machine · /aa turns on auto-approve",
      " ⚠ Approved commands run for real",
    ].find(fits) ?? ""
  );
}

// ════════════════════════════════════════════════════════════════════════════
// TUI parts: log panes
// Owns: the scrolling log panes and the Console's live command output,
// cheap to append to whatever a command or the model streams.
// ════════════════════════════════════════════════════════════════════════════

// OpenTUI is loaded only by the TUI (a dynamic import); a type-only import is erased from the --nogui path.
import type {
  BoxRenderable as BoxNode,
  CliRenderer,
  KeyEvent,
  OptimizedBuffer,
  RGBA,
  RenderContext,
  RenderableOptions,
  ScrollBoxOptions,
  ScrollBoxRenderable as ScrollBoxNode,
  TextChunk,
  TextRenderable as TextNode,
  MarkdownRenderable as MarkdownNode,
  SyntaxStyle,
  TextareaRenderable as TextareaNode,
} from "@opentui/core";
type OpenTui = typeof import("@opentui/core");
type TerminalViewNode = InstanceType<ReturnType<typeof defineTerminalView>>;
/** Between two frames the Console keeps only the newest bytes of a flood: more than a pane can show. */
const CONSOLE_FRAME_BYTES = 4 * 1024 * 1024;
const TUI_MIN_WIDTH = 60;
const TUI_MIN_HEIGHT = 15;
const PANE_MAX_LINES = 5000;

const COLORS = {
  dim: "#8a8a8a",
  thinking: "#7a7a9a",
  info: "#9e9e9e",
  warning: "#ffd75f",
  error: "#ff5f5f",
  command: "#5fd7ff",
  ok: "#5fd75f",
  bad: "#ff875f",
  summary: "#af87ff",
  tabOn: "#87afff",
} as const;

/** A pane entry: a block of up to BLOCK plain lines in one text node, or one Markdown message. */
type PaneEntry =
  { kind: "text"; node: TextNode; lines: TextChunk[][] } | { kind: "markdown"; node: MarkdownNode; lines: number };

/** A Markdown message that is still streaming into a pane. */
interface MarkdownStream {
  /** The whole text so far; drawn once per frame. */
  update(text: string): void;
  /** The message is complete: its last block is parsed as final. */
  finish(): void;
}

/**
 * A scrollable log that keeps at most `maxLines` lines and follows new text
 * unless the person has scrolled up. Plain lines live in blocks of 64, one
 * text node each: an append re-encodes only the last block (once per frame)
 * and trimming drops whole entries, so a long stream stays cheap. The model's
 * own messages are Markdown nodes between the blocks. Lines wrap at word
 * boundaries.
 */
class LogPane {
  private static readonly BLOCK = 64;
  readonly box: ScrollBoxNode;
  private entries: PaneEntry[] = [];
  private total = 0;
  private dirty = new Set<PaneEntry>();
  private scheduled = false;
  private readonly pending = new Map<MarkdownNode, string>();

  constructor(
    private readonly ot: OpenTui,
    private readonly renderer: CliRenderer,
    options: ScrollBoxOptions,
    private readonly maxLines = PANE_MAX_LINES,
  ) {
    this.box = new ot.ScrollBoxRenderable(renderer, { stickyScroll: true, stickyStart: "bottom", ...options });
    this.box.focusable = false;
  }

  private lastText(): Extract<PaneEntry, { kind: "text" }> {
    const last = this.entries[this.entries.length - 1];
    if (last?.kind === "text") return last;
    const entry: PaneEntry = {
      kind: "text",
      node: new this.ot.TextRenderable(this.renderer, { content: "", width: "100%", wrapMode: "word" }),
      lines: [[]],
    };
    this.entries.push(entry);
    this.box.add(entry.node);
    this.total++;
    return entry;
  }

  private chunk(text: string, color?: string): TextChunk {
    return { __isChunk: true, text, fg: color ? fgColor(this.ot, color) : undefined } as TextChunk;
  }

  /** Appends text (newlines start new lines) in one colour. */
  append(text: string, color?: string): void {
    this.appendLines(text.split("\n").map((part) => (part ? [this.chunk(part, color)] : [])));
  }

  /** What wrote the pane's last line through `lineOnce`, until anything else is written. */
  private lastKey: string | undefined;

  /** A line that replaces the last one when that one came from the same `key` (a retry's next attempt). */
  lineOnce(key: string, text: string, color?: string): void {
    const entry = this.entries[this.entries.length - 1];
    if (this.lastKey === key && entry?.kind === "text" && entry.lines.length >= 2 && !entry.lines.at(-1)!.length) {
      entry.lines[entry.lines.length - 2] = [this.chunk(text, color)];
      this.dirty.add(entry);
      this.schedule();
    } else this.line(text, color);
    this.lastKey = key;
  }

  /** Appends styled lines: the first continues the line in progress, each next one starts a new line. */
  appendLines(lines: TextChunk[][]): void {
    this.lastKey = undefined;
    let entry = this.lastText();
    lines.forEach((chunks, i) => {
      if (i > 0) {
        if (entry.lines.length >= LogPane.BLOCK) {
          this.dirty.add(entry);
          entry = {
            kind: "text",
            node: new this.ot.TextRenderable(this.renderer, { content: "", width: "100%", wrapMode: "word" }),
            lines: [[]],
          };
          this.entries.push(entry);
          this.box.add(entry.node);
        } else entry.lines.push([]);
        this.total++;
      }
      entry.lines[entry.lines.length - 1]!.push(...chunks);
    });
    this.dirty.add(entry);
    this.trim();
    this.schedule();
  }

  /** Replaces the line in progress (a command's partial line, a progress bar). */
  rewriteLastLine(chunks: TextChunk[]): void {
    const entry = this.lastText();
    entry.lines[entry.lines.length - 1] = chunks;
    this.dirty.add(entry);
    this.schedule();
  }

  /** Whether the last line is empty (so a message can start on a fresh line). */
  get atLineStart(): boolean {
    const last = this.entries[this.entries.length - 1];
    return !last || last.kind === "markdown" || last.lines[last.lines.length - 1]!.length === 0;
  }

  line(text: string, color?: string): void {
    this.append(`${this.atLineStart ? "" : "\n"}${text}\n`, color);
  }

  /** Starts a Markdown message (the model's text): headings, emphasis, lists and highlighted code blocks. */
  markdown(syntaxStyle: SyntaxStyle, text = "", streaming = true): MarkdownStream {
    this.lastKey = undefined;
    if (!this.atLineStart) this.append("\n");
    const node = new this.ot.MarkdownRenderable(this.renderer, {
      content: text,
      syntaxStyle,
      streaming,
      width: "100%",
    });
    const entry: PaneEntry = { kind: "markdown", node, lines: Math.max(1, text.split("\n").length) };
    this.entries.push(entry);
    this.box.add(node);
    this.total += entry.lines;
    this.trim();
    return {
      update: (next) => {
        this.total += Math.max(1, next.split("\n").length) - entry.lines;
        entry.lines = Math.max(1, next.split("\n").length);
        this.pending.set(node, next);
        this.schedule();
      },
      finish: () => {
        const next = this.pending.get(node);
        if (next !== undefined) node.content = next;
        this.pending.delete(node);
        node.streaming = false;
      },
    };
  }

  private trim(): void {
    let dropped = 0;
    while (this.total > this.maxLines && this.entries.length > 1) {
      const old = this.entries.shift()!;
      dropped += old.node.height;
      this.total -= old.kind === "text" ? old.lines.length : old.lines;
      this.dirty.delete(old);
      if (old.kind === "markdown") this.pending.delete(old.node);
      this.box.remove(old.node);
      old.node.destroy();
    }
    // Someone reading older lines keeps the same lines in view.
    if (dropped && !this.following) this.box.scrollTop = Math.max(0, this.box.scrollTop - dropped);
  }

  private schedule(): void {
    if (this.scheduled) return;
    this.scheduled = true;
    this.renderer.requestAnimationFrame(() => this.flush());
  }

  flush(): void {
    this.scheduled = false;
    for (const entry of this.dirty) {
      if (entry.kind !== "text") continue;
      const chunks: TextChunk[] = [];
      entry.lines.forEach((l, i) => {
        if (i) chunks.push(this.chunk("\n"));
        chunks.push(...l);
      });
      entry.node.content = new this.ot.StyledText(chunks);
    }
    this.dirty.clear();
    for (const [node, text] of this.pending) node.content = text;
    this.pending.clear();
  }

  get following(): boolean {
    return this.box.scrollTop >= this.box.scrollHeight - this.box.viewport.height - 1;
  }

  get lineCount(): number {
    return this.total;
  }

  page(direction: -1 | 1): void {
    this.box.scrollBy(direction * 0.8, "viewport");
  }

  /** Back to the newest line, following new ones again. */
  toEnd(): void {
    this.box.scrollTo(Infinity);
  }

  clear(): void {
    for (const entry of this.entries) {
      this.box.remove(entry.node);
      entry.node.destroy();
    }
    this.entries = [];
    this.total = 0;
    this.dirty.clear();
    this.pending.clear();
    // Whatever the reader had scrolled to is gone: follow new text again.
    this.box.scrollTo(Number.MAX_SAFE_INTEGER);
  }
}

/** Any escape sequence: CSI (SGR among them), OSC ended by BEL or ST, or a two-byte one. */
// CSI and OSC, then the rest as ECMA-48 has them: intermediates and a final (ESC ( B), or one final (ESC =, ESC 7).
const ESCAPE_SEQUENCE = /\x1b(?:\[([0-9;:?<=>]*)([ -/]*[@-~])|\][^\x07\x1b]*(?:\x07|\x1b\\)|[ -/]+[0-~]|[0-~])/g;
/** Control characters a pane cannot show; tab, newline and carriage return are handled by the stream. */
const PANE_CONTROLS = /[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]/g;

/**
 * Select Graphic Rendition, streamed: a command's colours and bold/italic/
 * underline become styled chunks; every other escape sequence is dropped, so
 * nothing but colour reaches the person's terminal. The style carries over
 * from one piece of output to the next.
 */
class SgrParser {
  private fg: RGBA | undefined;
  private bg: RGBA | undefined;
  private attributes = 0;

  constructor(private readonly ot: OpenTui) {}

  parse(text: string): TextChunk[] {
    const out: TextChunk[] = [];
    let last = 0;
    ESCAPE_SEQUENCE.lastIndex = 0;
    for (let m: RegExpExecArray | null; (m = ESCAPE_SEQUENCE.exec(text));) {
      if (m.index > last) out.push(this.chunk(text.slice(last, m.index)));
      last = ESCAPE_SEQUENCE.lastIndex;
      if (m[2] === "m") this.apply(m[1] ?? "");
    }
    if (last < text.length) out.push(this.chunk(text.slice(last)));
    return out;
  }

  reset(): void {
    this.fg = this.bg = undefined;
    this.attributes = 0;
  }

  private chunk(text: string): TextChunk {
    const plain = noColor();
    return {
      __isChunk: true,
      text: text.replace(PANE_CONTROLS, ""),
      fg: plain ? undefined : this.fg,
      bg: plain ? undefined : this.bg,
      attributes: this.attributes || undefined,
    } as TextChunk;
  }

  private apply(params: string): void {
    const A = this.ot.TextAttributes;
    const toggles: Record<number, [number, boolean]> = {
      1: [A.BOLD, true],
      2: [A.DIM, true],
      3: [A.ITALIC, true],
      4: [A.UNDERLINE, true],
      7: [A.INVERSE, true],
      9: [A.STRIKETHROUGH, true],
      22: [A.BOLD | A.DIM, false],
      23: [A.ITALIC, false],
      24: [A.UNDERLINE, false],
      27: [A.INVERSE, false],
      29: [A.STRIKETHROUGH, false],
    };
    const p = params === "" ? [0] : params.split(/[;:]/).map((x) => (x === "" ? 0 : Number(x)));
    for (let i = 0; i < p.length; i++) {
      const n = p[i]!;
      const toggle = toggles[n];
      if (n === 0) this.reset();
      else if (toggle) this.attributes = toggle[1] ? this.attributes | toggle[0] : this.attributes & ~toggle[0];
      else if (n >= 30 && n <= 37) this.fg = this.ot.RGBA.fromIndex(n - 30);
      else if (n >= 90 && n <= 97) this.fg = this.ot.RGBA.fromIndex(n - 90 + 8);
      else if (n >= 40 && n <= 47) this.bg = this.ot.RGBA.fromIndex(n - 40);
      else if (n >= 100 && n <= 107) this.bg = this.ot.RGBA.fromIndex(n - 100 + 8);
      else if (n === 39) this.fg = undefined;
      else if (n === 49) this.bg = undefined;
      else if (n === 38 || n === 48) {
        let color: RGBA | undefined;
        if (p[i + 1] === 5) {
          color = this.ot.RGBA.fromIndex((p[i + 2] ?? 0) & 255);
          i += 2;
        } else if (p[i + 1] === 2) {
          color = this.ot.RGBA.fromInts(p[i + 2] ?? 0, p[i + 3] ?? 0, p[i + 4] ?? 0, 255);
          i += 4;
        }
        if (n === 38) this.fg = color;
        else this.bg = color;
      }
    }
  }
}

/**
 * Turns a command's raw output into console-pane lines as it streams: its
 * colours kept, other escape sequences dropped, `\r` restarting the line in
 * progress (so a progress bar updates in place). Text is gathered and handed
 * to the pane once per frame, and of a flood only the lines the pane can keep
 * are ever parsed and turned into text nodes.
 */
class ConsoleStream {
  private decoder = new TextDecoder();
  private readonly sgr: SgrParser;
  /** The line in progress, and an escape sequence cut off at the end of the last piece. */
  private current: TextChunk[] = [];
  private held = "";
  private incoming: { text: string; bytes: number }[] = [];
  private incomingBytes = 0;
  private scheduled = false;

  constructor(
    ot: OpenTui,
    private readonly pane: LogPane,
    private readonly schedule: (flush: () => void) => void,
  ) {
    this.sgr = new SgrParser(ot);
  }

  write(bytes: Uint8Array): void {
    this.incoming.push({ text: this.decoder.decode(bytes, { stream: true }), bytes: bytes.length });
    this.incomingBytes += bytes.length;
    // Between two frames, keep only what can still be shown: the newest bytes.
    while (this.incoming.length > 1 && this.incomingBytes > CONSOLE_FRAME_BYTES)
      this.incomingBytes -= this.incoming.shift()!.bytes;
    if (!this.scheduled) {
      this.scheduled = true;
      this.schedule(() => this.flush());
    }
  }

  flush(): void {
    this.scheduled = false;
    if (!this.incoming.length) return;
    const { ready, held } = holdTrailingEscape(this.held + this.incoming.map((c) => c.text).join(""));
    this.incoming = [];
    this.incomingBytes = 0;
    this.held = held;
    let text = ready.replace(/\r\n/g, "\n");
    // More finished lines than the pane keeps: only the last ones can be seen, so only they are parsed.
    let newlines = 0;
    let from = text.length;
    while (newlines <= PANE_MAX_LINES && from > 0) {
      from = text.lastIndexOf("\n", from - 1);
      if (from < 0) break;
      newlines++;
    }
    if (from > 0 && newlines > PANE_MAX_LINES) {
      this.pane.clear();
      this.current = [];
      this.sgr.reset();
      text = text.slice(from + 1);
    }
    const finished: TextChunk[][] = [];
    for (const chunk of this.sgr.parse(text)) {
      const pieces = chunk.text.split("\n");
      pieces.forEach((piece, i) => {
        if (i > 0) {
          finished.push(this.current);
          this.current = [];
        }
        const cr = piece.lastIndexOf("\r");
        if (cr >= 0) this.current = [];
        const rest = cr >= 0 ? piece.slice(cr + 1) : piece;
        if (rest) this.current.push({ ...chunk, text: rest } as TextChunk);
      });
    }
    if (finished.length) {
      this.pane.rewriteLastLine(finished[0]!);
      this.pane.appendLines([[], ...finished.slice(1), []]);
    }
    this.pane.rewriteLastLine(this.current);
  }

  end(): void {
    this.flush();
    if (this.current.length) this.pane.append("\n");
    this.current = [];
    this.held = "";
    this.sgr.reset();
    this.decoder = new TextDecoder();
  }
}

// ════════════════════════════════════════════════════════════════════════════
// TUI parts: the shell's screen and its keys
// Owns: painting an emulated terminal (the Shell tab) into the TUI, and the
// bytes a shell expects for each key the person presses.
// ════════════════════════════════════════════════════════════════════════════

/** xterm's 256-colour palette as hex. */
function xtermPalette(): string[] {
  const base = [
    "#000000",
    "#cd0000",
    "#00cd00",
    "#cdcd00",
    "#0000ee",
    "#cd00cd",
    "#00cdcd",
    "#e5e5e5",
    "#7f7f7f",
    "#ff0000",
    "#00ff00",
    "#ffff00",
    "#5c5cff",
    "#ff00ff",
    "#00ffff",
    "#ffffff",
  ];
  const hex = (r: number, g: number, b: number) => `#${[r, g, b].map((v) => v.toString(16).padStart(2, "0")).join("")}`;
  const levels = [0, 95, 135, 175, 215, 255];
  const palette = base.slice();
  for (let i = 16; i < 232; i++) {
    const n = i - 16;
    palette.push(hex(levels[Math.floor(n / 36)]!, levels[Math.floor(n / 6) % 6]!, levels[n % 6]!));
  }
  for (let i = 232; i < 256; i++) {
    const g = 8 + (i - 232) * 10;
    palette.push(hex(g, g, g));
  }
  return palette;
}

/**
 * The Shell tab's screen: paints an @xterm/headless terminal, with colours
 * and cursor, into its own off-screen buffer only when xterm changed; each
 * frame just copies that buffer (painting every cell every frame is slow).
 */
function defineTerminalView(ot: OpenTui) {
  const colors = terminalColors(ot);
  return class TerminalView extends ot.Renderable {
    showCursor = true;
    private cache: OptimizedBuffer | null = null;
    private stale = true;
    private readonly subscriptions: { dispose(): void }[] = [];
    constructor(
      ctx: RenderContext,
      readonly term: XTerm,
      options: RenderableOptions,
    ) {
      super(ctx, options);
      this.subscriptions.push(
        term.onWriteParsed(() => this.invalidate()),
        term.onScroll(() => this.invalidate()),
      );
      this.onMouseScroll = (e) => {
        const lines = e.scroll?.direction === "up" ? -3 : e.scroll?.direction === "down" ? 3 : 0;
        if (lines) {
          this.term.scrollLines(lines);
          this.invalidate();
        }
      };
    }
    invalidate(): void {
      this.stale = true;
      this.requestRender();
    }
    protected override renderSelf(target: OptimizedBuffer): void {
      const { width, height } = this;
      if (width <= 0 || height <= 0) return;
      if (!this.cache || this.cache.width !== width || this.cache.height !== height) {
        this.cache?.destroy();
        this.cache = ot.OptimizedBuffer.create(width, height, this.ctx.widthMethod, {
          owner: (this.ctx as unknown as { nativeScene: unknown }).nativeScene,
        } as never);
        this.stale = true;
      }
      if (this.stale) {
        paintTerminal(this.term, this.cache, colors, this.showCursor);
        this.stale = false;
      }
      target.drawFrameBuffer(this.x, this.y, this.cache);
    }
    protected override destroySelf(): void {
      for (const s of this.subscriptions) s.dispose();
      this.cache?.destroy();
      this.cache = null;
      super.destroySelf();
    }
  };
}

/** The colours and attributes an xterm cell maps to on OpenTUI's buffer. */
interface TerminalColors {
  palette: RGBA[];
  fg: RGBA;
  bg: RGBA;
  rgb(n: number): RGBA;
  attrs: { bold: number; dim: number; italic: number; underline: number };
}

function terminalColors(ot: OpenTui): TerminalColors {
  const cache = new Map<number, RGBA>();
  if (noColor()) {
    // A program's colours become the terminal's own; its reverse video and bold still show.
    const fg = ot.RGBA.defaultForeground();
    const bg = ot.RGBA.defaultBackground();
    return { palette: xtermPalette().map(() => fg), fg, bg, rgb: () => fg, attrs: terminalAttributes(ot) };
  }
  return {
    palette: xtermPalette().map((h) => ot.RGBA.fromHex(h)),
    fg: ot.RGBA.fromHex("#d0d0d0"),
    bg: ot.RGBA.fromHex("#101010"),
    rgb: (n) => {
      let c = cache.get(n);
      if (!c) cache.set(n, (c = ot.RGBA.fromInts((n >> 16) & 255, (n >> 8) & 255, n & 255, 255)));
      return c;
    },
    attrs: terminalAttributes(ot),
  };
}

function terminalAttributes(ot: OpenTui): TerminalColors["attrs"] {
  return {
    bold: ot.TextAttributes.BOLD,
    dim: ot.TextAttributes.DIM,
    italic: ot.TextAttributes.ITALIC,
    underline: ot.TextAttributes.UNDERLINE,
  };
}

/** The emulator's visible screen drawn onto `buffer`, runs of equal style as one text each, and its cursor. */
function paintTerminal(term: XTerm, buffer: OptimizedBuffer, colors: TerminalColors, showCursor: boolean): void {
  const active = term.buffer.active;
  const cell = active.getNullCell();
  const rows = Math.min(buffer.height, term.rows);
  const cols = Math.min(buffer.width, term.cols);
  buffer.clear(colors.bg);
  for (let y = 0; y < rows; y++) {
    const line = active.getLine(active.viewportY + y);
    if (line) paintTerminalLine(line, cell, y, cols, buffer, colors);
  }
  if (showCursor && active.viewportY === active.baseY && active.cursorY < rows && active.cursorX < cols) {
    const ch =
      active
        .getLine(active.baseY + active.cursorY)
        ?.getCell(active.cursorX, cell)
        ?.getChars() || " ";
    buffer.setCell(active.cursorX, active.cursorY, ch, colors.bg, colors.fg, 0);
  }
}

type XTermLine = NonNullable<ReturnType<XTerm["buffer"]["active"]["getLine"]>>;
type XTermCell = ReturnType<XTerm["buffer"]["active"]["getNullCell"]>;

function paintTerminalLine(
  line: XTermLine,
  cell: XTermCell,
  y: number,
  cols: number,
  buffer: OptimizedBuffer,
  c: TerminalColors,
): void {
  let run = "";
  let runX = 0;
  let runFg = c.fg;
  let runBg = c.bg;
  let runAttr = 0;
  const flush = () => {
    if (run) buffer.drawText(run, runX, y, runFg, runBg, runAttr);
    run = "";
  };
  for (let x = 0; x < cols; x++) {
    line.getCell(x, cell);
    if (cell.getWidth() === 0) continue;
    let fg = cell.isFgDefault() ? c.fg : cell.isFgRGB() ? c.rgb(cell.getFgColor()) : c.palette[cell.getFgColor()]!;
    let bg = cell.isBgDefault() ? c.bg : cell.isBgRGB() ? c.rgb(cell.getBgColor()) : c.palette[cell.getBgColor()]!;
    let attr = 0;
    if (cell.isBold()) attr |= c.attrs.bold;
    if (cell.isDim()) attr |= c.attrs.dim;
    if (cell.isItalic()) attr |= c.attrs.italic;
    if (cell.isUnderline()) attr |= c.attrs.underline;
    if (cell.isInverse()) [fg, bg] = [bg, fg];
    if (fg !== runFg || bg !== runBg || attr !== runAttr) {
      flush();
      runX = x;
      runFg = fg;
      runBg = bg;
      runAttr = attr;
    } else if (!run) runX = x;
    run += cell.getChars() || " ";
  }
  flush();
}

const CSI_TILDE_KEYS: Record<string, number> = {
  insert: 2,
  delete: 3,
  pageup: 5,
  pagedown: 6,
  f5: 15,
  f6: 17,
  f7: 18,
  f8: 19,
  f9: 20,
  f10: 21,
  f11: 23,
  f12: 24,
};
const CSI_LETTER_KEYS: Record<string, string> = { up: "A", down: "B", right: "C", left: "D", home: "H", end: "F" };
const SS3_KEYS: Record<string, string> = { f1: "P", f2: "Q", f3: "R", f4: "S" };
const CTRL_SYMBOLS: Record<string, string> = {
  "@": "\x00",
  "2": "\x00",
  "[": "\x1b",
  "3": "\x1b",
  "\\": "\x1c",
  "4": "\x1c",
  "]": "\x1d",
  "5": "\x1d",
  "^": "\x1e",
  "6": "\x1e",
  _: "\x1f",
  "7": "\x1f",
  "-": "\x1f",
  "/": "\x1f",
  "8": "\x7f",
  "?": "\x7f",
};

/**
 * The bytes a shell on a PTY expects for a key. Built from the key's name
 * and modifiers, never from its raw sequence: under the kitty keyboard
 * protocol the raw bytes of Ctrl+C are `ESC[99;5u`, which a shell ignores.
 */
function keyToBytes(key: KeyEvent, applicationCursor = false): string {
  const mod = 1 + (key.shift ? 1 : 0) + (key.meta ? 2 : 0) + (key.ctrl ? 4 : 0);
  const name = key.name;
  const letter = CSI_LETTER_KEYS[name];
  if (letter) return mod > 1 ? `\x1b[1;${mod}${letter}` : applicationCursor ? `\x1bO${letter}` : `\x1b[${letter}`;
  const tilde = CSI_TILDE_KEYS[name];
  if (tilde) return mod > 1 ? `\x1b[${tilde};${mod}~` : `\x1b[${tilde}~`;
  const ss3 = SS3_KEYS[name];
  if (ss3) return mod > 1 ? `\x1b[1;${mod}${ss3}` : `\x1bO${ss3}`;
  const alt = key.meta ? "\x1b" : "";
  switch (name) {
    case "return":
    case "enter":
    case "kpenter":
      return alt + "\r";
    case "linefeed":
      return alt + "\n";
    case "tab":
      return key.shift ? "\x1b[Z" : alt + "\t";
    case "backspace":
      return alt + (key.ctrl ? "\x08" : "\x7f");
    case "escape":
      return alt + "\x1b";
    case "space":
      return alt + (key.ctrl ? "\x00" : " ");
  }
  if (key.ctrl && name.length === 1) {
    const c = name.toLowerCase();
    if (c >= "a" && c <= "z") return alt + String.fromCharCode(c.charCodeAt(0) - 96);
    if (CTRL_SYMBOLS[c]) return alt + CTRL_SYMBOLS[c];
  }
  const seq = key.sequence;
  if (seq && !/^\x1b\[[\d;:]*u$/.test(seq)) return key.meta && !seq.startsWith("\x1b") ? "\x1b" + seq : seq;
  return "";
}

// ════════════════════════════════════════════════════════════════════════════
// TUI parts: the approval dialog and the Shell tab
// Owns: the dialog that shows the command waiting for approval (and the
// request it waits on), and the person's own shell (not sandboxed) behind the
// Shell tab. The app decides which keys reach them.
// ════════════════════════════════════════════════════════════════════════════

/**
 * The approval dialog: the whole command, scrollable when long (its end,
 * the part that runs last, is in view when it opens), with the hint and the
 * buttons always on screen. It only shows and hides; which keys answer it is
 * the app's decision.
 */
class ApprovalDialog {
  readonly overlay: BoxNode;
  /** "Always allow": approves and adds the request's rule lines to the rules file. Only a click or /always gives it. */
  private readonly always: BoxNode & { label: TextNode };
  private readonly alwaysRow: BoxNode;
  private waiting: { request: ApprovalRequest; resolve(a: Approval): void } | undefined;
  private readonly body: ScrollBoxNode;
  private readonly text: TextNode;

  constructor(ot: OpenTui, r: CliRenderer, onAnswer: (answer: Approval) => void) {
    // Only as big as the dialog, so the wheel still scrolls the panes around it.
    this.overlay = new ot.BoxRenderable(r, {
      position: "absolute",
      left: "10%",
      top: 1,
      width: "80%",
      maxHeight: "75%",
      zIndex: 50,
      visible: false,
      border: true,
      borderStyle: "rounded",
      title: " Approve command? ",
      backgroundColor: bgColor(ot, "#1c1c3a"),
      flexDirection: "column",
      paddingLeft: 1,
      paddingRight: 1,
    });
    this.body = new ot.ScrollBoxRenderable(r, {
      flexGrow: 0,
      flexShrink: 1,
      width: "100%",
      stickyScroll: true,
      stickyStart: "bottom",
    });
    this.text = new ot.TextRenderable(r, { content: "", wrapMode: "char", width: "100%" });
    this.body.add(this.text);
    const hint = new ot.TextRenderable(r, {
      content:
        "Enter approves (or type y) · Escape rejects (or type n) · any other line you type is a suggestion · PgUp/PgDn scroll",
      fg: fgColor(ot, COLORS.dim),
      flexShrink: 0,
      wrapMode: "word",
    });
    const buttons = new ot.BoxRenderable(r, {
      flexDirection: "row",
      justifyContent: "center",
      gap: 4,
      height: 1,
      flexShrink: 0,
    });
    const button = (label: string, color: string, answer: Approval) => {
      const b = new ot.BoxRenderable(r, {
        backgroundColor: bgColor(ot, color),
        paddingLeft: 1,
        paddingRight: 1,
        height: 1,
      });
      b.onMouseDown = (e) => {
        e.stopPropagation();
        onAnswer(answer);
      };
      const text = new ot.TextRenderable(r, { content: label, fg: fgColor(ot, "#000000") });
      b.add(text);
      return Object.assign(b, { label: text });
    };
    buttons.add(button("[Enter] Approve", COLORS.ok, { kind: "approve" }));
    buttons.add(button("[Esc] Reject", COLORS.bad, { kind: "reject" }));
    // "Always allow" names the rule it adds, which can be long: a row of its own, cut to the dialog's width.
    this.always = button("", COLORS.info, { kind: "always" });
    this.always.visible = false;
    const alwaysRow = new ot.BoxRenderable(r, {
      flexDirection: "row",
      justifyContent: "center",
      height: 1,
      flexShrink: 0,
    });
    alwaysRow.add(this.always);
    // The row takes its line only while the button is offered.
    alwaysRow.visible = false;
    this.alwaysRow = alwaysRow;
    this.overlay.add(this.body);
    this.overlay.add(hint);
    this.overlay.add(buttons);
    this.overlay.add(alwaysRow);
    r.root.add(this.overlay);
    this.screenWidth = () => r.width;
  }
  private readonly screenWidth: () => number;

  /** Shows `request` and resolves with the person's answer (keys, buttons or slash commands give it through `answer`). */
  ask(request: ApprovalRequest): Promise<Approval> {
    return new Promise((resolve) => {
      this.waiting = { request, resolve };
      this.show(request);
    });
  }

  /** Answers the request waiting in the dialog; false when none waits. */
  answer(answer: Approval): boolean {
    const waiting = this.waiting;
    if (!waiting) return false;
    this.waiting = undefined;
    this.hide();
    waiting.resolve(answer);
    return true;
  }

  /** The run that asked has ended: nothing waits any longer, and the dialog must not swallow the next key. */
  withdraw(): void {
    this.waiting = undefined;
    this.hide();
  }

  /** The command waiting for an answer, if any. */
  get request(): ApprovalRequest | undefined {
    return this.waiting?.request;
  }

  private show(request: ApprovalRequest): void {
    const lines = request.command.split("\n").length;
    const which = request.total > 1 ? ` ${request.index} of ${request.total}` : "";
    this.overlay.title = ` Approve ${request.typedInto ? "input" : "command"}${which}? · ${lines} line${lines === 1 ? "" : "s"} `;
    this.text.content = visibleControls(request.command);
    this.body.scrollTo(Number.MAX_SAFE_INTEGER);
    this.always.visible = request.alwaysAllow !== undefined;
    this.alwaysRow.visible = this.always.visible;
    // The dialog is 80% of the screen, less its border, padding and the button's own padding.
    const room = Math.max(12, Math.floor(this.screenWidth() * 0.8) - 6);
    if (request.alwaysAllow)
      this.always.label.content = oneLine(`Always allow: ${visibleControls(request.alwaysAllow.join("; "))}`, room);
    this.overlay.visible = true;
  }

  private hide(): void {
    this.overlay.visible = false;
  }

  get visible(): boolean {
    return this.overlay.visible;
  }

  page(direction: -1 | 1): void {
    this.body.scrollBy(direction * 0.8, "viewport");
  }
}

/** How often the Shell tab looks where its shell went, for the info line (commands check again right before they run). */
const SHELL_CWD_POLL_MS = 300;
const SHELL_SCROLLBACK_LINES = 2000;

/**
 * The Shell tab: the person's own $SHELL on a PTY, shown through an
 * emulated screen, every key forwarded while it has focus. It is not
 * confined: the sandbox is for the agent's commands, and the tab says so.
 */
class ShellTab {
  readonly box: BoxNode;
  private shell:
    | { pty: PtyProcess; term: XTerm; view: TerminalViewNode; cwdTimer: ReturnType<typeof setInterval>; cwd: string }
    | undefined;

  constructor(
    private readonly ot: OpenTui,
    private readonly r: CliRenderer,
    private readonly Terminal: XTermClass,
    private readonly events: { onCwd(dir: string): void; onExit(): void; onError(message: string): void },
  ) {
    this.box = new ot.BoxRenderable(r, { flexGrow: 1, width: "100%", visible: false, flexDirection: "column" });
    this.box.add(
      new ot.TextRenderable(r, {
        content: "Your own shell, not sandboxed. Tab goes back to the console.",
        fg: fgColor(ot, COLORS.dim),
        height: 1,
        width: "100%",
      }),
    );
  }

  get running(): boolean {
    return this.shell !== undefined;
  }

  /** Starts the shell if it is not running; false when it cannot start. */
  start(): boolean {
    if (this.shell) return true;
    const { ot, r } = this;
    const cols = Math.max(20, Math.floor(r.width / 2) - 2);
    const rows = Math.max(5, r.height - 8);
    const shellPath =
      process.env.SHELL && fs.existsSync(process.env.SHELL)
        ? process.env.SHELL
        : fs.existsSync("/bin/bash")
          ? "/bin/bash"
          : "/bin/sh";
    // Output that arrives before the emulator exists waits here (a few bytes of prompt at most).
    let early: Uint8Array[] | undefined = [];
    let term: XTerm | undefined;
    let pty: PtyProcess;
    try {
      pty = spawnPty([shellPath, "-i"], {
        cwd: process.cwd(),
        env: { ...commandEnvironment({ sockets: true }), TERM: "xterm-256color" },
        cols,
        rows,
        onData: (bytes) => (term ? term.write(bytes) : early?.push(bytes)),
      });
    } catch (error) {
      this.events.onError(`cannot start the shell ${shellPath}: ${(error as Error).message}`);
      return false;
    }
    const started = tameEmulator(
      new this.Terminal({
        cols,
        rows,
        scrollback: SHELL_SCROLLBACK_LINES,
        allowProposedApi: true,
        logLevel: "off",
      }),
    );
    term = started;
    for (const bytes of early ?? []) started.write(bytes);
    early = undefined;
    const TerminalView = defineTerminalView(ot);
    const view = new TerminalView(r, started, { flexGrow: 1, width: "100%", height: "100%" });
    started.onData((data) => pty.terminal.write(data));
    view.onSizeChange = () => {
      if (view.width < 2 || view.height < 2) return;
      started.resize(view.width, view.height);
      pty.terminal.resize(view.width, view.height);
    };
    this.box.add(view);
    const cwdTimer = setInterval(() => this.checkCwd(), SHELL_CWD_POLL_MS);
    this.shell = { pty, term: started, view, cwdTimer, cwd: process.cwd() };
    void pty.proc.exited.then(() => {
      if (this.shell?.pty !== pty) return;
      this.dispose();
      this.events.onExit();
    });
    return true;
  }

  showCursor(on: boolean): void {
    if (this.shell) this.shell.view.showCursor = on;
  }

  /** Forwards a key; Shift+Tab is the shell's Tab (completion), since Tab itself switches panes. */
  key(key: KeyEvent, id: string): void {
    const shell = this.shell;
    if (!shell) return;
    const bytes = id === "S-tab" ? "\t" : keyToBytes(key, shell.term.modes.applicationCursorKeysMode);
    if (!bytes) return;
    shell.term.scrollToBottom(); // typing brings a scrolled-back view back, as in any terminal
    shell.pty.terminal.write(bytes);
  }

  paste(bytes: Uint8Array): void {
    const shell = this.shell;
    if (!shell) return;
    shell.term.scrollToBottom();
    const text = new TextDecoder().decode(bytes);
    shell.pty.terminal.write(shell.term.modes.bracketedPasteMode ? `\x1b[200~${text}\x1b[201~` : text);
  }

  /** Tells the app when the shell changed directory, so the agent can follow it. */
  checkCwd(): void {
    const shell = this.shell;
    if (!shell) return;
    let now: string;
    try {
      now = fs.readlinkSync(`/proc/${shell.pty.proc.pid}/cwd`);
    } catch {
      return;
    }
    if (now === shell.cwd) return;
    shell.cwd = now;
    this.events.onCwd(now);
  }

  /** Hangs up the shell's whole group (on quitting). */
  stop(): void {
    const shell = this.shell;
    if (!shell) return;
    signalGroup(shell.pty.proc.pid, "SIGHUP");
    this.dispose();
  }

  private dispose(): void {
    const shell = this.shell;
    if (!shell) return;
    this.shell = undefined;
    clearInterval(shell.cwdTimer);
    shell.pty.terminal.close();
    this.box.remove(shell.view);
    shell.view.destroy();
    shell.term.dispose();
  }
}

// ════════════════════════════════════════════════════════════════════════════
// TUI parts: how events look, the prompt, and the layout
// Owns: drawing the agent's events into the two panes, the prompt line with
// its history (Up/Down, Ctrl+R) shared by every aic of the person, and where
// every part of the screen goes.
// ════════════════════════════════════════════════════════════════════════════

/** How the model's Markdown looks: headings, emphasis, inline code, lists, quotes, links and highlighted code. */
const MARKDOWN_STYLES: Record<string, { fg?: string; bold?: boolean; italic?: boolean; underline?: boolean }> = {
  default: { fg: "#d0d0d0" },
  "markup.heading": { fg: "#87afff", bold: true },
  ...Object.fromEntries([1, 2, 3, 4, 5, 6].map((n) => [`markup.heading.${n}`, { fg: "#87afff", bold: true }])),
  "markup.strong": { fg: "#ffffff", bold: true },
  "markup.italic": { fg: "#d0d0d0", italic: true },
  "markup.raw": { fg: "#ffd75f" },
  "markup.list": { fg: "#5fd7ff" },
  "markup.quote": { fg: "#9e9e9e", italic: true },
  "markup.link.url": { fg: "#87afff", underline: true },
  conceal: { fg: "#666666" },
  keyword: { fg: "#ff5f87", bold: true },
  string: { fg: "#5fd75f" },
  comment: { fg: "#8a8a8a", italic: true },
  number: { fg: "#ffaf5f" },
  function: { fg: "#87d7ff" },
  type: { fg: "#d7af87" },
};
/** After a resume the agent pane shows this many of the newest turns; older ones are counted. */
const RESTORED_TURNS = 20;
/** A restored message longer than this is shown cut, with its length. */
const RESTORED_MESSAGE_CHARS = 2000;

/**
 * How the agent's events look: the model's text rendered as Markdown as it
 * streams into the agent pane (its reasoning as [THINKING]), commands and
 * their live, coloured output in the console pane, and describeEvent's lines
 * wherever they belong.
 */
class AgentView {
  readonly agentPane: LogPane;
  readonly consolePane: LogPane;
  private readonly consoleStream: ConsoleStream;
  private readonly stream: AnswerStream;
  private answer: MarkdownStream | undefined;
  private syntax: SyntaxStyle | undefined;

  /** A full-screen program's screen, drawn in the Console's place while it is on the alternate screen. */
  readonly screen: CommandScreen;

  constructor(
    private readonly ot: OpenTui,
    private readonly r: CliRenderer,
    showThinking: boolean,
    Terminal: XTermClass,
  ) {
    this.stream = new AnswerStream(showThinking);
    this.agentPane = new LogPane(ot, r, {
      width: "50%",
      flexShrink: 0,
      height: "100%",
      border: true,
      title: " Agent Output ",
    });
    this.consolePane = new LogPane(ot, r, { flexGrow: 1, width: "100%" });
    this.consoleStream = new ConsoleStream(ot, this.consolePane, (flush) => r.requestAnimationFrame(flush));
    this.screen = new CommandScreen(ot, r, Terminal, (full) => {
      // The Console's size as laid out, taken before it gives its place to the screen.
      if (full) this.consoleSize = { cols: this.consolePane.box.width, rows: this.consolePane.box.height };
      this.consolePane.box.visible = !full;
      this.onFullScreen?.(full);
    });
  }

  private style(): SyntaxStyle {
    // Under NO_COLOR the Markdown keeps its bold, italics and underlines, in the terminal's own colour.
    const styles = noColor()
      ? Object.fromEntries(Object.entries(MARKDOWN_STYLES).map(([k, { fg: _fg, ...rest }]) => [k, rest]))
      : MARKDOWN_STYLES;
    this.syntax ??= this.ot.SyntaxStyle.fromStyles(styles, this.r.nativeScene);
    return this.syntax;
  }

  /** Reasoning and the answer in the agent pane, the answer as Markdown that grows as it streams. */
  private draw(a: AnswerAction): void {
    const agent = this.agentPane;
    switch (a.kind) {
      case "thinking_start":
        return agent.line("[THINKING]", COLORS.thinking);
      case "thinking":
        return agent.append(a.text, COLORS.thinking);
      case "thinking_end":
        return a.announced ? agent.line("[THINKING COMPLETE]", COLORS.thinking) : agent.append("\n");
      case "text":
        if (a.whole) (this.answer ??= agent.markdown(this.style())).update(a.whole);
        return;
      case "done":
        if (a.whole.trim()) {
          (this.answer ??= agent.markdown(this.style())).update(a.whole);
          this.answer.finish();
        }
        this.answer = undefined;
        return;
      case "discarded":
        this.answer?.finish();
        this.answer = undefined;
    }
  }

  show(e: AgentEvent): void {
    const agent = this.agentPane;
    for (const action of this.stream.reduce(e)) this.draw(action);
    switch (e.type) {
      case "start":
        this.started = e;
        return agent.line(startBanner(e), e.sandbox.enabled ? COLORS.dim : COLORS.error);
      case "reasoning_delta":
      case "thinking_complete":
      case "assistant_delta":
      case "assistant":
        return;
      case "command":
        this.screen.reset();
        break;
      case "command_output":
        for (const piece of this.screen.write(e.data)) this.consoleStream.write(piece);
        return;
      case "command_result":
        if (e.exit_code !== null || !RESULT_STATUSES[e.status].stillRuns) this.screen.reset();
        this.consoleStream.end();
        break;
      case "summary_delta":
        return this.consolePane.append(visibleControls(e.text), COLORS.summary);
      // Figures for the footer (updateFigures), the reasoning already streamed (or hidden), a wait Tui.emit acts on.
      case "command_waiting":
      case "context":
      case "reasoning":
      case "step":
      case "usage":
        return;
    }
    // The attempts of one failing request share one line, updated in place: the newest attempt is what matters.
    if (e.type === "retry" || e.type === "model_wait")
      for (const line of describeEvent(e)) agent.lineOnce(e.type, line.text, TUI_TONES[line.tone]);
    else
      for (const line of describeEvent(e))
        (line.pane === "agent" ? agent : this.consolePane).line(line.text, TUI_TONES[line.tone]);
    for (const line of transcriptLines(e)) agent.line(line.text, TUI_TONES[line.tone]);
  }

  /** After a resume: the newest turns of the restored conversation as they looked, older ones counted. */
  showConversation(messages: readonly Message[]): void {
    const turns = turnsFrom(messages, 1);
    const shown = turns.slice(-RESTORED_TURNS);
    const pane = this.agentPane;
    if (turns.length > shown.length)
      pane.line(`(… ${turns.length - shown.length} earlier turn(s) of this conversation are not shown)`, COLORS.dim);
    const cut = (text: string) =>
      text.length > RESTORED_MESSAGE_CHARS
        ? `${text.slice(0, RESTORED_MESSAGE_CHARS)} … (${text.length} characters)`
        : text;
    for (const [start, end] of shown) {
      for (const m of messages.slice(start, end)) {
        const text = visibleControls(cut(contentText(m.content)));
        if (m.role === "user") pane.line(`> ${text}`, COLORS.command);
        else if (m.role === "assistant") {
          const shownText = text.split(MARKER).join("").trim();
          if (shownText) pane.markdown(this.style(), shownText, false).finish();
          for (const call of m.tool_calls ?? []) pane.line(visibleControls(cut(callShown(call))), COLORS.command);
        } else if (m.role === "tool") pane.line(`  → ${text.split("\n")[0] ?? ""}`, COLORS.dim);
      }
    }
    pane.line("── restored conversation above ──", COLORS.dim);
  }

  clear(): void {
    this.agentPane.clear();
    this.consolePane.clear();
  }

  /** Where a full-screen program is drawn: the Console's place. */
  consoleSize = { cols: 0, rows: 0 };
  /** Told when a full-screen program comes on or leaves (the TUI fits the command's terminal to the pane). */
  onFullScreen: ((full: boolean) => void) | undefined;

  /** The run's start event, for /sandbox. */
  started: Extract<AgentEvent, { type: "start" }> | undefined;
}

/** The TUI's start line: version, model, endpoint and confinement, one line; /sandbox has the rest. */
function startBanner(e: Extract<AgentEvent, { type: "start" }>): string {
  let host = e.api_base;
  try {
    host = new URL(e.api_base).host;
  } catch {
    /* shown as given */
  }
  const jail = e.sandbox.jail === "namespaces" ? "jail" : e.sandbox.jail === "landlock" ? "Landlock" : "OFF";
  return `aic ${VERSION} · ${e.model} @ ${host} · sandbox: ${jail}${e.sandbox.network === "loopback" ? ", no network" : ""} · /sandbox, /help`;
}

/** /sandbox: how commands are confined, in full. */
function sandboxDetails(e: Extract<AgentEvent, { type: "start" }> | undefined): string[] {
  if (!e) return ["The run has not started yet."];
  const s = e.sandbox;
  return [
    `Sandbox: ${s.status}`,
    `  network: ${s.network === "loopback" ? "loopback only (--network off)" : "on"}`,
    `  writable: ${s.writable.join(", ") || "nothing"}`,
    `  unreadable: ${s.unreadable.join(", ") || "nothing"}`,
    `  rules file: ${e.rules ?? "none"} · working directory ${e.cwd}`,
  ];
}

/** What stands in for the layout while the terminal is too small to show it: nothing may be typed blind. */
function tooSmallOverlay(ot: OpenTui, r: CliRenderer): BoxNode {
  const overlay = new ot.BoxRenderable(r, {
    position: "absolute",
    left: 0,
    top: 0,
    width: "100%",
    height: "100%",
    zIndex: 100,
    backgroundColor: bgColor(ot, "#000000"),
    justifyContent: "center",
    alignItems: "center",
    visible: false,
  });
  overlay.add(
    new ot.TextRenderable(r, {
      content: `The terminal is too small for aic (needs at least ${TUI_MIN_WIDTH}×${TUI_MIN_HEIGHT}). Enlarge it, or press Ctrl+C to quit.`,
      wrapMode: "word",
    }),
  );
  return overlay;
}

/** The prompt grows with its text up to this many rows, then scrolls. */
const PROMPT_MAX_LINES = 8;
const PROMPT_PLACEHOLDER = "Type a task, or /help for commands and keys… (Alt+Enter or Ctrl+J: new line)";

/**
 * The prompt and its history: a multi-line text area (a paste keeps its
 * newlines; Alt+Enter or Ctrl+J starts a new line; Enter submits). Up/Down
 * (or Ctrl+P/Ctrl+N) walk the history from the first/last line, keeping the
 * text in progress; Ctrl+R searches it; what is submitted joins the history.
 */
class PromptBar {
  readonly input: TextareaNode;
  readonly history: PromptHistory;
  readonly search: SearchLine;
  /** The slash commands matching what is typed, under the prompt. */
  readonly hint: TextNode;
  private readonly cursor: HistoryCursor;

  constructor(ot: OpenTui, r: CliRenderer, historyFile: string, onSubmit: (value: string) => void) {
    this.hint = new ot.TextRenderable(r, {
      height: 1,
      width: "100%",
      fg: fgColor(ot, "#87afd7"),
      content: "",
      visible: false,
    });
    this.history = new PromptHistory(historyFile);
    this.cursor = new HistoryCursor(() => this.history.entries);
    this.search = new SearchLine(
      ot,
      r,
      () => this.history.entries,
      (value) => {
        this.value = value;
        this.cursor.reset();
      },
    );
    this.input = new ot.TextareaRenderable(r, {
      width: "100%",
      minHeight: 1,
      maxHeight: PROMPT_MAX_LINES,
      wrapMode: "word",
      placeholder: PROMPT_PLACEHOLDER,
      backgroundColor: bgColor(ot, "#1c1c1c"),
      focusedBackgroundColor: bgColor(ot, "#262626"),
      keyBindings: [
        { name: "return", action: "submit" },
        { name: "kpenter", action: "submit" },
        { name: "return", meta: true, action: "newline" },
        { name: "return", shift: true, action: "newline" },
        { name: "linefeed", action: "newline" },
        { name: "j", ctrl: true, action: "newline" },
      ],
      onSubmit: () => onSubmit(this.input.plainText),
      onContentChange: () => this.showHint(),
    });
  }

  private showHint(): void {
    const hint = slashHint(this.input.plainText);
    if (this.hint.content.toString() !== hint) this.hint.content = hint;
    this.hint.visible = hint !== "";
  }

  /** Tab on a partly typed slash command: completes it; false when there is nothing to complete. */
  complete(): boolean {
    const done = completeSlash(this.value);
    if (done === undefined) return /^\/\S*$/.test(this.value);
    this.value = done;
    return true;
  }

  get value(): string {
    return this.input.plainText;
  }

  set value(text: string) {
    this.input.setText(text);
    this.input.gotoBufferEnd();
  }

  set placeholder(text: string) {
    this.input.placeholder = text;
  }

  /** Empties the prompt for the next task. */
  clear(): void {
    this.value = "";
    this.cursor.reset();
  }

  /** Adds a submitted prompt to the history file; `onError` hears why it could not be saved. */
  remember(text: string, onError: (message: string) => void): void {
    this.history.add(text).catch((error) => onError((error as Error).message));
    this.cursor.reset(); // again: the history just grew by this prompt
  }

  /** Up walks the history only from the first line, so the lines of a longer prompt can still be reached. */
  older(): boolean {
    if (this.input.logicalCursor.row > 0) return false;
    const entry = this.cursor.older(this.value);
    if (entry !== undefined) this.value = entry;
    return true;
  }

  newer(): boolean {
    if (this.input.logicalCursor.row < this.input.lineCount - 1) return false;
    const entry = this.cursor.newer();
    if (entry !== undefined) this.value = entry;
    return true;
  }

  focus(on: boolean): void {
    if (on) this.input.focus();
    else this.input.blur();
  }
}

/**
 * The screen: [agent | console/shell tabs] over the banner, the search line,
 * the prompt and the footer. Clicking a tab's title switches to it.
 */
function layOutTui(
  ot: OpenTui,
  r: CliRenderer,
  view: AgentView,
  shellBox: BoxNode,
  prompt: PromptBar,
  status: StatusBar,
  onTab: (tab: "console" | "shell") => void,
): { root: BoxNode; tabConsole: TextNode; tabShell: TextNode } {
  const root = new ot.BoxRenderable(r, { flexDirection: "column", width: "100%", height: "100%" });
  const top = new ot.BoxRenderable(r, { flexDirection: "row", flexGrow: 1, flexShrink: 1, width: "100%" });
  const right = new ot.BoxRenderable(r, { flexDirection: "column", flexGrow: 1, height: "100%", border: true });
  const tabs = new ot.BoxRenderable(r, { flexDirection: "row", height: 1, gap: 1 });
  const tabConsole = new ot.TextRenderable(r, { content: " Console Output " });
  const tabShell = new ot.TextRenderable(r, { content: " Shell " });
  tabConsole.onMouseDown = () => onTab("console");
  tabShell.onMouseDown = () => onTab("shell");
  tabs.add(tabConsole);
  tabs.add(tabShell);
  right.add(tabs);
  right.add(view.consolePane.box);
  right.add(view.screen.node);
  right.add(shellBox);
  top.add(view.agentPane.box);
  top.add(right);
  for (const child of [top, status.banner, prompt.search.node, prompt.hint, prompt.input, status.footer])
    root.add(child);
  r.root.add(root);
  return { root, tabConsole, tabShell };
}

// ════════════════════════════════════════════════════════════════════════════
// TUI parts: the transcript, keys typed ahead, a program's screen
// Owns: how a command appears in the one transcript (its line and its status
// line), the keys a person types right after approving a command, and the
// screen of a full-screen program drawn in the Console's place.
// ════════════════════════════════════════════════════════════════════════════

/** How long after the terminal is resized the layout is taken as settled. */
const RESIZE_SETTLE_MS = 50;

/** The footer while a command has the person's keys (short: the footer keeps its other fields whole at 80 columns). */
const KEYS_TO_COMMAND_NOTICE = "⌨ keys go to the command · Ctrl+O hands it to the model · Ctrl+C twice stops it";

/** How long after a command starts by the person's approval their typing is held for it (see TypeAhead). */
const TYPE_AHEAD_MS = 1500;

/**
 * A person who approves `read -p 'Name? '` types the answer at once, before
 * aic can see that the command reads the terminal. What they type in the
 * first moments of a hand-approved command is held: it goes to the command
 * when it turns out to read the keyboard, else into the prompt, as typed.
 */
class TypeAhead {
  private held: { bytes: string; text: string; enter: boolean }[] = [];
  private until = 0;
  private timer: ReturnType<typeof setTimeout> | undefined;

  constructor(private readonly intoPrompt: (text: string, submit: boolean) => void) {}

  /** Opens the window, at the person's approval. */
  start(): void {
    this.held = [];
    this.open();
  }

  /** The approved command has started (a snapshot may have taken a while): the window counts from now. */
  extend(): void {
    if (Date.now() <= this.until) this.open();
  }

  private open(): void {
    this.until = Date.now() + TYPE_AHEAD_MS;
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.toPrompt(), TYPE_AHEAD_MS);
  }

  /**
   * Holds a typed key while the window is open. aic's own keys (Ctrl+C, Tab,
   * paging) are never held, nor Escape before anything else was typed: then it
   * still stops the command. After typing, it is vim's Escape.
   */
  hold(key: KeyEvent, id: string): boolean {
    if (Date.now() > this.until || key.ctrl || key.meta || id === "tab" || TUI_PAGING.has(id)) return false;
    if (id === "escape" && !this.held.length) return false;
    const enter = id === "return" || id === "kpenter";
    const text = key.sequence.length === 1 && key.sequence >= " " ? key.sequence : "";
    if (!enter && !text && id !== "backspace" && id !== "escape") return false;
    this.held.push({ bytes: keyToBytes(key), text, enter });
    return true;
  }

  toCommand(type: (bytes: string) => void): void {
    this.close();
    const bytes = this.held
      .splice(0)
      .map((key) => key.bytes)
      .join("");
    if (bytes) type(bytes);
  }

  toPrompt(): void {
    this.close();
    let text = "";
    for (const key of this.held.splice(0)) {
      if (key.enter) {
        this.intoPrompt(text, true);
        text = "";
      } else if (key.text) text += key.text;
      else if (key.bytes === "\x7f") text = text.slice(0, -1);
    }
    if (text) this.intoPrompt(text, false);
  }

  private close(): void {
    this.until = 0;
    clearTimeout(this.timer);
  }
}

/**
 * A full-screen program announces itself: the alternate screen (see
 * ALTERNATE_SCREEN_MODES: vim, less), or application cursor keys (DECCKM, 1:
 * top, which draws on the ordinary screen); the same sequence with `l` ends it.
 */
const FULL_SCREEN_MODE = new RegExp(`\\x1b\\[\\?(?:${ALTERNATE_SCREEN_MODES}|1)[hl]`);

/**
 * vim, less, top or git's editor: their screen is drawn as a terminal draws
 * it, in the Console's place, from the moment they announce themselves until
 * they leave. Only then are the bytes fed to an emulator, so a long build log
 * costs nothing here. A program the model drives keeps its 160×50 terminal,
 * shown from its top-left corner; one the person drives is given the pane's
 * size (Tui.fitCommandScreen).
 */
class CommandScreen {
  readonly node: TerminalViewNode;
  private readonly term: XTerm;
  private active = false;
  private full = false;

  constructor(
    ot: OpenTui,
    r: CliRenderer,
    private readonly Terminal: XTermClass,
    private readonly onFullScreen: (full: boolean) => void,
  ) {
    this.term = this.fresh();
    const TerminalView = defineTerminalView(ot);
    this.node = new TerminalView(r, this.term, { flexGrow: 1, width: "100%", visible: false });
  }

  private fresh(): XTerm {
    return tameEmulator(
      new this.Terminal({
        cols: COMMAND_COLUMNS,
        rows: COMMAND_ROWS,
        scrollback: 0,
        allowProposedApi: true,
        logLevel: "off",
      }),
    );
  }

  /** Whether a full-screen program is on screen now (Escape then goes to it). */
  get fullScreen(): boolean {
    return this.full;
  }

  /**
   * Takes a piece of the command's output; returns what of it belongs to the
   * ordinary screen (for the Console's lines): a full-screen program's
   * drawing is the emulator's alone, never the log's.
   */
  write(bytes: Uint8Array): Uint8Array[] {
    // Most output holds no escape at all: nothing to decode or look for.
    if (!this.active && bytes.indexOf(0x1b) < 0) return [bytes];
    const text = Buffer.from(bytes).toString("latin1");
    if (!this.active && !FULL_SCREEN_MODE.test(text)) return [bytes];
    this.active = true;
    const normal: Uint8Array[] = [];
    let from = 0;
    for (const m of text.matchAll(new RegExp(FULL_SCREEN_MODE.source, "g"))) {
      if (!this.inFullScreen && m.index > from) normal.push(bytes.subarray(from, m.index));
      const on = m[0].endsWith("h");
      if (m[0].startsWith("\x1b[?1") && m[0].length === 5) this.appCursor = on;
      else this.alternate = on;
      from = m.index + m[0].length;
    }
    if (!this.inFullScreen && from < bytes.length) normal.push(bytes.subarray(from));
    const full = this.inFullScreen;
    this.term.write(bytes, () => this.sync(full));
    return normal;
  }
  /** The modes the bytes seen so far set (the emulator's own state follows a moment later). */
  private alternate = false;
  private appCursor = false;
  private get inFullScreen(): boolean {
    return this.alternate || this.appCursor;
  }

  private sync(full: boolean): void {
    if (full === this.full) return;
    this.full = full;
    this.node.visible = full;
    this.node.invalidate();
    this.onFullScreen(full);
  }

  /** The emulator at the size the command's terminal was given. */
  resize(cols: number, rows: number): void {
    this.term.resize(cols, rows);
    this.node.invalidate();
  }

  /** A new command, or the end of one: back to the Console's lines. */
  reset(): void {
    if (!this.active) return;
    this.active = false;
    this.alternate = false;
    this.appCursor = false;
    this.term.reset();
    this.term.resize(COMMAND_COLUMNS, COMMAND_ROWS);
    this.sync(false);
  }
}

/**
 * The agent pane is the one transcript: each command under the sentence that
 * proposed it, then one status line (how it ended, how long, what it changed);
 * its output stays in the Console.
 */
function transcriptLines(e: AgentEvent): { tone: Tone; text: string }[] {
  switch (e.type) {
    case "command":
      return transcriptCommand(e.command).map((text) => ({ tone: "command", text }));
    case "input":
      return [
        {
          tone: "command",
          text: visibleControls(oneLine(`⌨ ${e.into} ← ${inputShown(e.input)}`, TRANSCRIPT_COMMAND_CHARS)),
        },
      ];
    case "command_result":
      return [
        { tone: e.exit_code === 0 ? "dim" : e.exit_code === null ? "info" : "bad", text: `  ${commandStatusLine(e)}` },
      ];
    case "approval":
      // What the person said instead of running it belongs under the command it answered.
      return e.decision === "suggestion" && e.suggestion
        ? [{ tone: "info", text: visibleControls(`  your suggestion instead: ${oneLine(e.suggestion, 300)}`) }]
        : [];
    // The answer and the reasoning stream into the pane by themselves; the rest are figures, or the Console's.
    case "assistant":
    case "assistant_delta":
    case "command_output":
    case "command_waiting":
    case "context":
    case "reasoning":
    case "reasoning_delta":
    case "step":
    case "summary_delta":
    case "thinking_complete":
    case "usage":
      return [];
    default:
      // The rest is worded by describeEvent, which the pane shows as well.
      e satisfies WordedEvent;
      return [];
  }
}

/** The longest command line the transcript shows (the Console has all of it). */
const TRANSCRIPT_COMMAND_CHARS = 300;
/** A multi-line command shows this many of its lines in the transcript (the Console and the dialog show them all). */
const TRANSCRIPT_COMMAND_LINES = 12;

/** A command as the transcript shows it: its own lines (a script reads as one), each cut, the first after `$ `. */
function transcriptCommand(command: string): string[] {
  const lines = command.replace(/\r/g, "").trim().split("\n");
  const cut = (line: string) =>
    line.length > TRANSCRIPT_COMMAND_CHARS ? `${line.slice(0, TRANSCRIPT_COMMAND_CHARS - 1)}…` : line;
  const shown = lines
    .slice(0, TRANSCRIPT_COMMAND_LINES)
    .map((line, i) => visibleControls(`${i ? "  " : "$ "}${cut(line)}`));
  if (lines.length > TRANSCRIPT_COMMAND_LINES)
    shown.push(`  … (${lines.length - TRANSCRIPT_COMMAND_LINES} more lines: the Console shows them all)`);
  return shown;
}

/** "✓ exit 0 · 1.2 s · 2 changed: a.txt, b.txt": how a command ended, in one line. */
function commandStatusLine(e: Extract<AgentEvent, { type: "command_result" }>): string {
  const still = e.exit_code === null ? RESULT_STATUSES[e.status].stillRuns : null;
  const how =
    e.status === "exited"
      ? `${e.exit_code === 0 ? "✓" : "✗"} exit ${e.exit_code}`
      : e.status === "runaway" && e.exit_code === 0
        ? "✓ exit 0 · output past the runaway limit not kept"
        : still
          ? `⌨ ${still}`
          : `✗ ${e.status.replace(/_/g, " ")}${e.exit_code === null ? "" : ` (exit ${e.exit_code})`}`;
  const parts = [how];
  if (e.duration_ms > 0) parts.push(`${(e.duration_ms / 1000).toFixed(1)} s`);
  const files = e.changed_files ? changedFilesNote(e.changed_files) : "";
  if (files) parts.push(files.replace(/^Files changed: /, "").replace(/\.$/, ""));
  return parts.join(" · ");
}

/** A restored tool call as the transcript shows it: the command (or the keys typed), never its JSON. */
function callShown(call: ToolCall): string {
  let args: unknown;
  try {
    args = JSON.parse(call.function.arguments || "{}");
  } catch {
    return `$ ${call.function.arguments}`;
  }
  const a = (args ?? {}) as { command?: unknown; input?: unknown };
  if (typeof a.command === "string" && a.command) return `$ ${a.command}`;
  if (typeof a.input === "string") return `⌨ ${inputShown(a.input)}`;
  return `$ ${call.function.arguments}`;
}

// ════════════════════════════════════════════════════════════════════════════
// TUI parts: pacing
// Owns: the TUI's timers, so that nothing ticks at rest: the footer's tok/s
// while tokens stream, keys drawn at once while the panes stream, and a run's
// garbage collected in one go once the person is reading the answer.
// ════════════════════════════════════════════════════════════════════════════

/** How often the footer's tok/s is redrawn while tokens stream. */
const RATE_REFRESH_MS = 500;
/**
 * How long after a run ends its garbage is collected (once its last frames are
 * drawn and its session saved), and how long the keyboard must have been
 * quiet for it.
 */
const COLLECT_AFTER_RUN_MS = 1000;

/**
 * Drops garbage and the JIT's code, and hands freed memory back to the
 * system (JavaScriptCore's shrinkFootprint, run as soon as no JavaScript is
 * on the stack); a full collection where a Bun no longer has Bun.shrink.
 * Dropped code is compiled again when it runs again.
 */
function shrinkHeap(): void {
  if (typeof Bun.shrink === "function") Bun.shrink();
  else Bun.gc(true);
}

/** When the TUI draws and collects outside the renderer's own requests; every timer here stops by itself. */
class TuiPacing {
  private readonly tokens = new TokenRate();
  /** Runs only while tokens stream and until tok/s has decayed to 0. */
  private rateTimer: ReturnType<typeof setInterval> | undefined;
  private collectTimer: ReturnType<typeof setTimeout> | undefined;
  private keyFrameQueued = false;
  private lastKeyAt = 0;

  constructor(
    private readonly r: CliRenderer,
    private readonly tui: { refresh(): void; idle(): boolean },
  ) {}

  rate(): number {
    return this.tokens.rate();
  }

  /** One more streamed token: the footer's tok/s follows it, and decays to 0 once the stream is idle. */
  token(): void {
    this.tokens.add(1);
    this.rateTimer ??= setInterval(() => {
      this.tui.refresh();
      if (this.tokens.rate() === 0) {
        clearInterval(this.rateTimer);
        this.rateTimer = undefined;
      }
    }, RATE_REFRESH_MS);
  }

  /**
   * While the panes stream, the renderer is live and paces its frames at
   * targetFps (30 a second), so a key could wait a whole frame interval (and
   * more on a busy machine) before it shows: the keys of one read are drawn
   * at once instead, once whoever takes them has handled them. At rest the
   * prompt's own request for a frame is answered within a frame (maxFps).
   */
  keysHandled(): void {
    this.lastKeyAt = performance.now();
    if (!this.r.isRunning || this.keyFrameQueued) return;
    this.keyFrameQueued = true;
    queueMicrotask(() => {
      this.keyFrameQueued = false;
      if (this.r.isRunning) this.r.intermediateRender();
    });
  }

  runStarted(): void {
    clearTimeout(this.collectTimer);
  }

  /**
   * A run leaves tens of MB of garbage (a command's flood of output, the
   * streamed text, the requests) and the JIT's code for its hot paths. Left
   * alone, Bun collects it piecemeal with its once-a-second collections
   * through the first idle seconds, each of them dearer for the code. Shrunk
   * in one go instead (a pause of a few tens of ms) while the person reads the
   * answer and does not type, the TUI then sits nearly still.
   */
  runEnded(delay = COLLECT_AFTER_RUN_MS): void {
    clearTimeout(this.collectTimer);
    this.collectTimer = setTimeout(() => {
      this.collectTimer = undefined;
      if (!this.tui.idle()) return;
      const quietFor = performance.now() - this.lastKeyAt;
      if (quietFor < COLLECT_AFTER_RUN_MS) return this.runEnded(COLLECT_AFTER_RUN_MS - quietFor);
      shrinkHeap();
    }, delay);
    this.collectTimer.unref?.();
  }

  stop(): void {
    clearInterval(this.rateTimer);
    clearTimeout(this.collectTimer);
  }
}

// ════════════════════════════════════════════════════════════════════════════
// TUI app
// Owns: the split-pane @opentui/core interface: one more sink for the agent's
// events and the approval function it awaits. Loaded only without --nogui, so
// the headless path never pays for OpenTUI. Nothing here blocks: the model
// stream, the PTYs and the keyboard all share one event loop.
// ════════════════════════════════════════════════════════════════════════════

/** How long the TUI waits for a stopped run to wind down, and for the terminal to take its restore bytes, when quitting. */
const QUIT_RUN_WAIT_MS = 3000;
const QUIT_TERMINAL_WAIT_MS = 1000;
/** After a hang-up, each wait is short: aic must be gone within 2 s. */
const QUIT_HANGUP_WAIT_MS = 400;
/** Loading the tokenizer costs a few hundred ms of CPU: paid just after the first screen, not mid-stream. */
const WARM_UP_DELAY_MS = 50;
/** The first Ctrl+C interrupts; a second one within this long quits. */
const CTRL_C_QUIT_WINDOW_MS = 2000;
const SHELL_TAB_PLACEHOLDER = "The Shell tab has your keys: it is your own shell. Tab goes back to the console.";

/**
 * The split-pane interface: agent output on the left, the commands' console
 * and the person's own shell on the right, a prompt and a status footer
 * below. It is one more EventSink for the agent and the approval function the
 * agent awaits; it moves the agent only through the agent's methods, and its
 * figures come from the agent's events.
 */
class Tui implements EventSink {
  readonly agent: Agent;
  readonly session: SessionStore | undefined;
  readonly prompt: PromptBar;
  readonly run: Run;
  /** The sandbox, the system prompt and the rules this TUI runs with. */
  readonly prepared: PreparedRun;
  private readonly r: CliRenderer;
  readonly view: AgentView;
  private readonly root: BoxNode;
  private readonly tabConsole: TextNode;
  private readonly tabShell: TextNode;
  readonly shellTab: ShellTab;
  private readonly status: StatusBar;
  readonly dialog: ApprovalDialog;
  readonly tooSmall: BoxNode;
  tab: "console" | "shell" = "console";
  private running: Promise<RunOutcome> | undefined;
  private readonly pacing: TuiPacing;
  readonly figures: TuiFigures;
  /** Where the person's keys go for a command that waits for input (auto-approve off): set while one runs. */
  /** The running command's keyboard while it runs (its keys, its size), for a person to type into. */
  keyboard: CommandKeyboard | undefined;
  commandWaiting = false;

  /**
   * A full-screen program the person drives gets a terminal the size of the
   * Console, so all of it shows (vim's status line, less's prompt); it gets
   * the usual size back when it leaves the alternate screen.
   */
  private fitCommandScreen(): void {
    if (!this.keyboard || !this.commandWaiting) return;
    const node = this.view.screen.node;
    // The screen's own size once it is laid out; before that, the Console's whose place it takes.
    const { cols, rows } =
      node.visible && node.width > 0 ? { cols: node.width, rows: node.height } : this.view.consoleSize;
    if (this.view.screen.fullScreen && cols >= 20 && rows >= 5) {
      this.view.screen.resize(cols, rows);
      this.keyboard.resize(cols, rows);
    } else if (!this.view.screen.fullScreen) this.keyboard.resize(COMMAND_COLUMNS, COMMAND_ROWS);
  }
  /** Where the person's keys go, and what Escape, Ctrl+C and Ctrl+D mean at the moment. */
  readonly keys: TuiKeys;
  private exiting = false;

  constructor(readonly o: TuiOptions) {
    const { config, renderer: r, ot } = o;
    this.r = r;
    this.keys = new TuiKeys(this);
    this.pacing = new TuiPacing(r, {
      refresh: () => this.refreshStatus(),
      idle: () => !this.exiting && !this.running,
    });
    const prepared = o.prepared ?? prepareParts(config);
    this.prepared = prepared;
    this.prompt = new PromptBar(
      ot,
      r,
      o.historyFile ?? path.join(os.homedir(), ".aic_history"),
      (value) => void this.submit(value),
    );
    this.figures = initialFigures(config, prepared);

    this.view = new AgentView(ot, r, !config.noThinking, o.Terminal);
    this.view.onFullScreen = () => this.fitCommandScreen();
    this.shellTab = new ShellTab(ot, r, o.Terminal, {
      onCwd: (dir) => this.agent.history.moveTo(dir),
      onError: (message) => this.agentPane.line(message, COLORS.error),
      onExit: () => {
        if (this.exiting) return;
        this.agentPane.line("[shell] the shell exited; Tab to it again for a new one", COLORS.info);
        if (this.tab === "shell") this.setTab("console");
      },
    });
    this.status = new StatusBar(ot, r);
    ({
      root: this.root,
      tabConsole: this.tabConsole,
      tabShell: this.tabShell,
    } = layOutTui(ot, r, this.view, this.shellTab.box, this.prompt, this.status, (tab) => this.setTab(tab)));

    this.dialog = new ApprovalDialog(ot, r, (answer) => this.answerApproval(answer));
    this.tooSmall = tooSmallOverlay(ot, r);
    r.root.add(this.tooSmall);
    r.on("resize", () => {
      this.checkSize();
      // A full-screen program follows the pane, once the layout has its new size.
      if (this.view.screen.fullScreen) setTimeout(() => this.fitCommandScreen(), RESIZE_SETTLE_MS);
    });
    this.checkSize();

    r.keyInput.on("keypress", (key: KeyEvent) => this.keys.onKey(key));
    r.keyInput.on("paste", (event: { bytes: Uint8Array; preventDefault(): void }) => this.keys.onPaste(event));
    // After the prompt (or whoever takes the key) has handled it.
    r.keyInput.on("keypress", () => this.pacing.keysHandled());
    r.keyInput.on("paste", () => this.pacing.keysHandled());

    this.run = createRun(config, prepared, this.frontEnd(), config.request ?? "");
    this.agent = this.run.agent;
    this.session = this.run.session;
    if (this.session) this.figures.session = `${path.basename(this.session.path)}#${this.session.sessionId}`;
    this.figures.tokens = this.run.restored?.usage?.billable_tokens ?? 0;
    if (this.run.restored?.messages) this.view.showConversation(this.run.restored.messages);
    this.setTab("console");
    for (const n of config.notices) this.agentPane.line(n, COLORS.info);
    for (const w of config.warnings) this.agentPane.line(`warning: ${w}`, COLORS.warning);
    this.refreshStatus();
    // The start-up warning goes after its time even if nothing else redraws the status (one timer, not a tick).
    setTimeout(() => !this.exiting && this.refreshStatus(), BANNER_HIDE_MS + 100).unref();
    if (config.request) void this.submit(config.request);
    setTimeout(() => {
      if (this.exiting) return;
      this.agent.warmUp();
      require("proper-lockfile");
      require("write-file-atomic");
    }, WARM_UP_DELAY_MS);
  }

  /** What the run gets from the TUI: its events, approvals, and a person's keys for a command that waits for input. */
  private frontEnd(): FrontEnd {
    return {
      sink: this,
      approve: (request) => this.requestApproval(request),
      attended: true,
      // A person sits at the TUI: with auto-approve off, a command waiting for input gets their keys instead of being stopped.
      canAnswerInput: () => true,
      attachInput: (io) => {
        this.keyboard = io;
        this.keys.typeAhead.extend();
        return () => {
          this.keyboard = undefined;
          this.commandWaiting = false;
          this.figures.notice = undefined;
          this.keys.typeAhead.toPrompt();
        };
      },
      beforeCommand: () => this.shellTab.checkCwd(),
    };
  }

  /** Whether a command waits for the person's approval. */
  get awaitingApproval(): boolean {
    return this.dialog.request !== undefined;
  }

  /** The command waiting for the person's approval, if any. */
  get waitingRequest(): ApprovalRequest | undefined {
    return this.dialog.request;
  }

  /** The run the agent is doing now, if any (/clear waits for it to wind down). */
  get runInFlight(): Promise<RunOutcome> | undefined {
    return this.running;
  }

  get history(): PromptHistory {
    return this.prompt.history;
  }

  get agentPane(): LogPane {
    return this.view.agentPane;
  }

  get consolePane(): LogPane {
    return this.view.consolePane;
  }

  // ── approval ─────────────────────────────────────────────────────────────

  /** An approval brings the person back to the console, whichever tab they were on, and shows the dialog. */
  private requestApproval(request: ApprovalRequest): Promise<Approval> {
    this.prompt.search.cancel();
    const answer = this.dialog.ask(request);
    // The dialog is about the newest lines: the panes show them, whatever the person was reading.
    this.agentPane.toEnd();
    this.consolePane.toEnd();
    if (this.tab !== "console") this.setTab("console");
    this.refreshStatus();
    return answer;
  }

  answerApproval(answer: Approval): void {
    if (!this.dialog.answer(answer)) return this.agentPane.line("No command is waiting for approval.", COLORS.warning);
    if (answer.kind === "approve") this.keys.typeAhead.start();
    this.refreshStatus();
  }

  // ── prompt, runs, slash commands ─────────────────────────────────────────

  /**
   * A submitted prompt: a slash command; text answering a pending approval
   * (a suggestion instead of the command); a steering suggestion while the
   * agent works; or a new task.
   */
  async submit(raw: string): Promise<void> {
    const text = raw.trim();
    this.prompt.clear();
    if (!text) return;
    // What answers it (a slash command's lines, the run) is at the end: show the end.
    this.agentPane.toEnd();
    if (text.startsWith("/")) return this.runSlash(text);
    // A y or n answering the dialog is an answer, not a prompt worth keeping in the history.
    const word = text.toLowerCase();
    if (this.awaitingApproval && APPROVE_WORDS.has(word)) return this.answerApproval({ kind: "approve" });
    if (this.awaitingApproval && REJECT_WORDS.has(word)) return this.answerApproval({ kind: "reject" });
    this.prompt.remember(text, (why) => this.agentPane.line(`cannot save the prompt history: ${why}`, COLORS.warning));
    if (this.awaitingApproval) return this.answerApproval({ kind: "suggest", text });
    if (this.agent.running) {
      this.agent.suggest(text);
      this.agentPane.line(`[queued suggestion] ${text}`, COLORS.info);
      return;
    }
    this.startRun(text);
  }

  private startRun(request: string): void {
    if (this.session?.waitsForReload) {
      // Nothing runs on a conversation that could not be read: the task waits in the prompt.
      this.prompt.value = request;
      return this.agentPane.line(
        `[SESSION] ${this.session.path} does not load: fix it and type /reload (or start aic with --no-session); the task is back in the prompt`,
        COLORS.warning,
      );
    }
    this.agentPane.toEnd();
    this.agentPane.line(`> ${visibleControls(request)}`, COLORS.command);
    this.figures.step = 0;
    this.pacing.runStarted();
    this.running = this.agent.run(request);
    this.running.finally(() => {
      this.running = undefined;
      this.giveBackUnusedSuggestions();
      this.refreshStatus();
      this.pacing.runEnded();
    });
  }

  /** Text typed while the agent worked that no turn used goes back into the prompt, never into the next task. */
  private giveBackUnusedSuggestions(): void {
    const unused = this.agent.takeUnusedSuggestions();
    if (!unused.length) return;
    const text = unused.join("\n");
    this.prompt.value = this.prompt.value ? `${this.prompt.value}\n${text}` : text;
    this.agentPane.line("[suggestion not used: it is back in the prompt]", COLORS.info);
  }

  private async runSlash(text: string): Promise<void> {
    const [word = "", ...rest] = text.split(/\s+/);
    const command = SLASH_COMMANDS.find((c) => c.names.includes(word.toLowerCase()));
    if (!command) {
      // The longest start of the word that some command shares (at least a letter after the slash).
      let close: string[] = [];
      for (let n = word.length; n >= 2 && !close.length; n--)
        close = slashMatches(word.slice(0, n)).map((c) => c.names[0]!);
      return this.agentPane.line(
        `Unknown command ${visibleControls(word)}${close.length ? ` (did you mean ${close.join(", ")}?)` : ""}; /help lists them all.`,
        COLORS.warning,
      );
    }
    await command.run(this, text.slice(word.length).trim() || rest.join(" "));
  }

  stopAgent(): void {
    if (!this.agent.running) return this.agentPane.line("The agent is not running.", COLORS.info);
    this.interrupt();
  }

  /** Escape, Ctrl+C or /stop: the running command stops, the stream is cut, the step is answered "interrupted by the user". */
  interrupt(): void {
    if (!this.agent.running) return;
    this.agentPane.line("Interrupted: the agent stops; type the next task when you are ready.", COLORS.warning);
    this.agent.interrupt();
    this.dialog.withdraw();
    this.refreshStatus();
  }

  // ── panes and tabs ───────────────────────────────────────────────────────

  setTab(tab: "console" | "shell"): void {
    this.prompt.search.cancel();
    if (tab === "shell" && !this.shellTab.start()) tab = "console";
    this.tab = tab;
    this.consolePane.box.visible = tab === "console";
    this.shellTab.box.visible = tab === "shell";
    const ot = this.o.ot;
    const label = (node: TextNode, on: boolean) => {
      node.fg = fgColor(ot, on ? "#000000" : COLORS.dim);
      node.bg = on ? bgColor(ot, COLORS.tabOn) : "transparent";
      // Without colours the tab in front is told by reverse video.
      if (noColor()) node.attributes = on ? ot.TextAttributes.INVERSE : 0;
    };
    label(this.tabConsole, tab === "console");
    label(this.tabShell, tab === "shell");
    this.shellTab.showCursor(tab === "shell");
    this.prompt.placeholder = tab === "shell" ? SHELL_TAB_PLACEHOLDER : PROMPT_PLACEHOLDER;
    this.prompt.focus(tab !== "shell");
    this.refreshStatus();
  }

  private checkSize(): void {
    const small = this.r.width < TUI_MIN_WIDTH || this.r.height < TUI_MIN_HEIGHT;
    this.tooSmall.visible = small;
    this.root.visible = !small;
    if (!small) this.refreshStatus();
  }

  // ── status ───────────────────────────────────────────────────────────────

  refreshStatus(): void {
    const state = this.awaitingApproval ? "pending" : this.agent?.running ? "running" : "idle";
    const autoApprove = this.agent?.autoApproving ?? this.o.config.autoApprove;
    // While the dialog or the model has the turn, keys do not go to the waiting command: the footer does not say so.
    const elsewhere = this.awaitingApproval || this.figures.activity?.kind === "model";
    const notice = this.figures.notice === KEYS_TO_COMMAND_NOTICE && elsewhere ? undefined : this.figures.notice;
    this.status.draw(
      { ...this.figures, notice, rate: this.pacing.rate(), state, autoApprove },
      this.dialog.request,
      this.r.width,
    );
  }

  private spinner: ReturnType<typeof setInterval> | undefined;

  /**
   * Ctrl+Z, as a shell's job control would: the terminal given back as it
   * was, aic stopped; `fg` (SIGCONT) redraws it. The raw terminal sends
   * Ctrl+Z as a key, so aic stops itself.
   */
  async suspendToShell(): Promise<void> {
    if (this.exiting) return;
    await this.r.suspend();
    process.once("SIGCONT", () => {
      void this.r.resume().then(() => {
        this.checkSize();
        this.r.requestRender();
      });
    });
    process.kill(process.pid, "SIGTSTP");
  }

  /** While the run waits on the model or a command, the footer's spinner turns and its seconds count. */
  private spinWhileBusy(): void {
    if (this.figures.activity && !this.spinner)
      this.spinner = setInterval(() => {
        if (this.exiting || !this.figures.activity || !this.agent?.running) {
          clearInterval(this.spinner);
          this.spinner = undefined;
          return;
        }
        this.refreshStatus();
      }, SPINNER_MS);
  }

  // ── events from the agent ────────────────────────────────────────────────

  emit(e: AgentEvent): void {
    if (updateFigures(this.figures, e)) {
      this.refreshStatus();
      this.spinWhileBusy();
    }
    switch (e.type) {
      case "step":
      case "usage":
      case "context":
        return;
      case "reasoning_delta":
      case "assistant_delta":
        this.pacing.token();
        break;
      case "command_waiting":
        this.commandWaiting = this.keyboard !== undefined;
        // The terminal takes the pane's size first: keys typed ahead then reach a program drawn as it will be seen.
        this.fitCommandScreen();
        const keyboard = this.keyboard;
        if (keyboard) this.keys.typeAhead.toCommand((bytes) => void keyboard.type(bytes));
        if (this.commandWaiting) this.figures.notice = KEYS_TO_COMMAND_NOTICE;
        this.refreshStatus();
        break;
      case "end":
        // A stopped run no longer waits for an answer: the dialog must not swallow the next key.
        this.dialog.withdraw();
        break;
      case "assistant":
      case "command_output":
      case "reasoning":
      case "summary_delta":
      case "thinking_complete":
        break;
      default:
        // Whatever else is worded is only shown.
        e satisfies WordedEvent;
    }
    this.view.show(e);
    if (e.type === "end") this.refreshStatus();
  }

  // ── leaving ──────────────────────────────────────────────────────────────

  /**
   * Stops the agent, saves the session, ends the shell, restores the
   * terminal, and exits with `code`; `message` (a crash report, say) and the
   * exit line go to stderr once the terminal is back to normal.
   */
  /** The run's end: the session saved, the launcher and jobs stopped (once; later calls do nothing). */
  closeRun(reason: string): void {
    this.run.close(reason);
  }

  async quit(code: number, reason: string, message?: string): Promise<void> {
    if (this.exiting) return;
    this.exiting = true;
    this.pacing.stop();
    this.keys.stop();
    this.agent.stop(code);
    this.dialog.answer({ kind: "reject" });
    // A hung-up terminal leaves nobody to wait for: the guard's time is all there is.
    const hungUp = reason === `signal_${os.constants.signals.SIGHUP}`;
    if (this.running) await Promise.race([this.running, Bun.sleep(hungUp ? QUIT_HANGUP_WAIT_MS : QUIT_RUN_WAIT_MS)]);
    // The last prompt typed is saved before the process ends (a save waits for the other aics' locks: bounded).
    await Promise.race([this.prompt.history.settled(), Bun.sleep(hungUp ? 0 : QUIT_RUN_WAIT_MS)]);
    const stopped = this.o.config.keepJobs ? [] : this.run.jobs.running.map(stoppedJobLine);
    if (!this.o.config.keepJobs && !hungUp) await this.run.jobs.stopAllAndWait();
    this.closeRun(reason);
    this.shellTab.stop();
    try {
      this.r.destroy();
      // A hung-up terminal cannot take the restore bytes: `closed` then rejects, and exiting must not depend on it.
      await Promise.race([
        this.r.closed.catch(() => undefined),
        Bun.sleep(hungUp ? QUIT_HANGUP_WAIT_MS : QUIT_TERMINAL_WAIT_MS),
      ]);
    } catch {
      /* the terminal is gone; nothing left to restore */
    } finally {
      writeOut(2, (message ?? "") + stopped.join("") + exitLine(this.session, this.o.config));
      this.o.onExit(code);
    }
  }
}

// ════════════════════════════════════════════════════════════════════════════
// TUI app: where keys go
// Owns: routing each key and paste (the history search, Tab, the Shell tab, a
// command waiting for the person, the dialog, the TUI's own keys), keys typed
// ahead of a command, and what Escape, Ctrl+C and Ctrl+D mean at the moment.
// ════════════════════════════════════════════════════════════════════════════

/** The TUI's keyboard: it reads the TUI's state and moves it only through its methods. */
class TuiKeys {
  /** Keys typed right after approving a command, held until aic knows whether the command reads them. */
  readonly typeAhead: TypeAhead;
  private ctrlCAt = 0;
  /** The last Ctrl+C that went to a waiting command: a second within 2 s stops the command (never aic). */
  private commandCtrlCAt = 0;
  private ctrlCTimer: ReturnType<typeof setTimeout> | undefined;

  constructor(private readonly t: Tui) {
    this.typeAhead = new TypeAhead((text, submit) => {
      t.prompt.value = t.prompt.value + text;
      if (submit) void t.submit(t.prompt.value);
    });
  }

  /** Quitting: a pending Ctrl+C notice is not redrawn. */
  stop(): void {
    clearTimeout(this.ctrlCTimer);
  }

  /**
   * Where a key goes, most specific first: a too-small screen takes nothing;
   * the history search; Tab; the Shell tab; a command waiting for the
   * person's input; the approval dialog (only Y/Enter, N/Escape answer it,
   * and only while the prompt is empty: any other key is typed into the
   * prompt, so prose typed at that moment never approves anything); then the
   * TUI's own keys; everything else is typing.
   */
  onKey(key: KeyEvent): void {
    const id = `${key.ctrl ? "C-" : ""}${key.meta ? "M-" : ""}${key.shift ? "S-" : ""}${key.name}`;
    const take = () => key.preventDefault();
    if (this.t.tooSmall.visible) {
      take();
      if (id === "C-c") this.ctrlC();
      return;
    }
    if (this.t.prompt.search.active) {
      if (this.t.prompt.search.key(key, id) === "quit") this.ctrlC();
      return;
    }
    if (id === "tab") {
      take();
      if (this.t.prompt.complete()) return;
      if (this.t.awaitingApproval)
        return this.t.agentPane.line(
          "A command waits for your approval: answer it first (Enter or Escape).",
          COLORS.warning,
        );
      return this.t.setTab(this.t.tab === "console" ? "shell" : "console");
    }
    if (this.t.tab === "shell" && this.t.shellTab.running) {
      take();
      return this.t.shellTab.key(key, id);
    }
    if (!this.t.commandWaiting && this.t.prompt.value === "" && this.typeAhead.hold(key, id)) return take();
    // An approval the model asks for (its keys for a program handed to it) answers before the program gets keys.
    if (this.t.commandWaiting && this.t.keyboard && !this.t.dialog.visible) {
      take();
      if (id === "C-c") return this.ctrlCToCommand(this.t.keyboard.write);
      if (id === "C-o") return this.t.keyboard.handToModel();
      // A full-screen program needs Escape (vim's normal mode); a line program is stopped by it.
      if (id === "escape" && !this.t.view.screen.fullScreen) return this.t.interrupt();
      const bytes = keyToBytes(key);
      if (bytes) this.t.keyboard.write(bytes);
      return;
    }
    if (this.t.dialog.visible) {
      if (TUI_PAGING.has(id)) {
        take();
        return this.t.dialog.page(id.endsWith("up") ? -1 : 1);
      }
      if (this.t.prompt.value === "" && APPROVE_KEYS.has(id)) {
        take();
        return this.t.answerApproval({ kind: "approve" });
      }
      if (this.t.prompt.value === "" && REJECT_KEYS.has(id)) {
        take();
        return this.t.answerApproval({ kind: "reject" });
      }
    }
    const action = TUI_KEYS[id];
    if (action && action(this.t) !== false) take();
  }

  onPaste(event: { bytes: Uint8Array; preventDefault(): void }): void {
    if (this.t.tooSmall.visible) return event.preventDefault();
    if (this.t.tab === "shell" && this.t.shellTab.running) {
      event.preventDefault();
      return this.t.shellTab.paste(event.bytes);
    }
    if (this.t.commandWaiting && this.t.keyboard) {
      event.preventDefault();
      this.t.keyboard.write(event.bytes);
    }
    // Otherwise the prompt takes the paste, newlines and all.
  }

  /** Escape: clears the prompt if it holds text, else interrupts the agent. */
  escape(): boolean {
    if (this.t.prompt.value !== "") this.t.prompt.clear();
    else if (this.t.agent.running) this.t.interrupt();
    else return false;
    return true;
  }

  /** Ctrl+C: the first clears or interrupts like Escape; a second one within 2 s quits. */
  ctrlC(): void {
    if (Date.now() - this.ctrlCAt < CTRL_C_QUIT_WINDOW_MS) return void this.t.quit(EXIT.ok, "process_exit");
    this.ctrlCAt = Date.now();
    if (!this.t.tooSmall.visible) this.escape();
    // Quitting stops what the commands left running: the notice says so before the second press.
    const jobs = this.t.o.config.keepJobs ? 0 : this.t.run.jobs.running.length;
    const notice = jobs ? `Ctrl+C again to quit and stop ${jobs} job${jobs === 1 ? "" : "s"}` : "Ctrl+C again to quit";
    this.t.figures.notice = notice;
    clearTimeout(this.ctrlCTimer);
    this.ctrlCTimer = setTimeout(() => {
      if (this.t.figures.notice === notice) this.t.figures.notice = undefined;
      this.t.refreshStatus();
    }, CTRL_C_QUIT_WINDOW_MS);
    this.t.refreshStatus();
  }

  /** Ctrl+C while a command has the keyboard: the first goes to it, as in a terminal; a second within 2 s stops it. */
  private ctrlCToCommand(write: (data: string | Uint8Array) => void): void {
    // A press that reached the program never arms "twice quits": only presses aic itself handled count for that,
    // so a Ctrl+C that ends `npm init` and the next one, on aic's prompt, never quit aic.
    this.ctrlCAt = 0;
    if (Date.now() - this.commandCtrlCAt < CTRL_C_QUIT_WINDOW_MS) {
      this.commandCtrlCAt = 0;
      return this.t.interrupt();
    }
    this.commandCtrlCAt = Date.now();
    write("\x03");
    this.t.figures.notice = "Ctrl+C again stops the command";
    clearTimeout(this.ctrlCTimer);
    this.ctrlCTimer = setTimeout(() => {
      if (this.t.figures.notice === "Ctrl+C again stops the command") this.t.figures.notice = KEYS_TO_COMMAND_NOTICE;
      this.t.refreshStatus();
    }, CTRL_C_QUIT_WINDOW_MS);
    this.t.refreshStatus();
  }

  /** Ctrl+D quits on an empty prompt (and deletes a character otherwise). */
  ctrlD(): boolean {
    if (this.t.prompt.value !== "") return false;
    void this.t.quit(EXIT.ok, "process_exit");
    return true;
  }

  historyOlder(): boolean {
    return this.t.prompt.older();
  }

  historyNewer(): boolean {
    return this.t.prompt.newer();
  }

  page(pane: "agent" | "console", direction: -1 | 1): void {
    (pane === "agent" ? this.t.agentPane : this.t.consolePane).page(direction);
  }

  startSearch(): void {
    this.t.prompt.search.start(this.t.prompt.value);
  }
}

// ════════════════════════════════════════════════════════════════════════════
// TUI keys and slash commands
// Owns: the tables of what the person can type (keys handled by the TUI
// itself, slash commands) and what each slash command does.
// ════════════════════════════════════════════════════════════════════════════

interface SlashCommand {
  names: string[];
  args?: string;
  help: string;
  run(tui: Tui, argument: string): void | Promise<void>;
}

const SLASH_COMMANDS: readonly SlashCommand[] = [
  {
    names: ["/autoapprove", "/aa"],
    help: "toggle auto-approve (takes effect for the next command)",
    run: (t) => toggleAutoApprove(t),
  },
  {
    names: ["/approve"],
    help: "run the command waiting for approval",
    run: (t) => t.answerApproval({ kind: "approve" }),
  },
  {
    names: ["/reject"],
    help: "skip the command waiting for approval",
    run: (t) => t.answerApproval({ kind: "reject" }),
  },
  {
    names: ["/suggest"],
    args: "<text>",
    help: "skip it and tell the agent what to do instead",
    run: (t, text) => suggestInstead(t, text),
  },
  {
    names: ["/clear", "/new"],
    help: "forget the conversation and start a new session",
    run: (t) => clearConversation(t),
  },
  { names: ["/session"], help: "show the session file and what is saved in it", run: (t) => showSession(t) },
  { names: ["/reload"], help: "re-read the session file (agent stopped)", run: (t) => reloadSession(t) },
  { names: ["/stop"], help: "interrupt the agent", run: (t) => t.stopAgent() },
  {
    names: ["/always"],
    help: "approve the waiting command and add an allow rule for it to the rules file",
    run: (t) => alwaysAllow(t),
  },
  {
    names: ["/rules"],
    args: "[reload]",
    help: "show the command rules in force; /rules reload reads the file again",
    run: (t, text) => rulesCommand(t, text),
  },
  {
    names: ["/undo"],
    args: "[N]",
    help: "put the files back as before the last N commands (default 1), and cut the conversation back",
    run: (t, text) => undoOrRedo(t, "undo", text),
  },
  { names: ["/redo"], help: "undo the last /undo: files and conversation", run: (t) => undoOrRedo(t, "redo", "") },
  {
    names: ["/diff"],
    args: "[N]",
    help: "show what the N-th last command changed (default 1: the last)",
    run: (t, text) => showDiff(t, text),
  },
  {
    names: ["/jobs"],
    args: "[kill N]",
    help: "list what commands left running; /jobs kill N stops job N",
    run: (t, text) => jobsCommand(t, text),
  },
  {
    names: ["/sandbox"],
    help: "how commands are confined: jail, network, what they may write and may not read",
    run: (t) => {
      for (const line of sandboxDetails(t.view.started)) t.agentPane.line(line, COLORS.info);
    },
  },
  { names: ["/help"], help: "these commands and the keys", run: (t) => showHelp(t) },
  { names: ["/quit", "/exit"], help: "stop the agent and quit", run: (t) => t.quit(EXIT.ok, "process_exit") },
];

/** The slash commands whose names start with what was typed (the word after "/"). */
function slashMatches(typed: string): SlashCommand[] {
  const word = typed.toLowerCase();
  return word.startsWith("/") ? SLASH_COMMANDS.filter((c) => c.names.some((n) => n.startsWith(word))) : [];
}

/**
 * The line under the prompt while a slash command is typed: the matching
 * commands, or the one that matches with its help. Tab completes.
 */
function slashHint(text: string): string {
  if (!/^\/\S*$/.test(text)) return "";
  const matches = slashMatches(text);
  if (!matches.length) return `no command starts with ${text} · /help lists them`;
  if (matches.length === 1) {
    const c = matches[0]!;
    return `${[c.names[0], c.args].filter(Boolean).join(" ")}: ${c.help}`;
  }
  return `${matches.map((c) => c.names.find((n) => n.startsWith(text.toLowerCase())) ?? c.names[0]).join("  ")}   (Tab completes)`;
}

/** What Tab makes of a partly typed slash command: the longest start all matches share (a single one, completed). */
function completeSlash(text: string): string | undefined {
  const names = slashMatches(text).flatMap((c) => c.names.filter((n) => n.startsWith(text.toLowerCase())));
  if (!names.length) return undefined;
  if (names.length === 1) return `${names[0]} `;
  let common = names[0]!;
  for (const n of names) while (!n.startsWith(common)) common = common.slice(0, -1);
  return common.length > text.length ? common : undefined;
}

/** /help: the commands, then the keys. */
function showHelp(t: Tui): void {
  t.agentPane.line("Commands:", COLORS.info);
  for (const c of SLASH_COMMANDS)
    t.agentPane.line(`  ${[c.names.join(", "), c.args].filter(Boolean).join(" ").padEnd(24)} ${c.help}`, COLORS.info);
  t.agentPane.line("Keys:", COLORS.info);
  for (const [keys, what] of TUI_KEY_HELP) t.agentPane.line(`  ${keys.padEnd(24)} ${what}`, COLORS.info);
}

/** /undo [N] and /redo, while the agent is stopped: what changed is listed in the agent pane. */
async function undoOrRedo(t: Tui, kind: "undo" | "redo", args: string): Promise<void> {
  if (t.agent.running)
    return t.agentPane.line(`The agent is working: interrupt it first (Escape), then /${kind}.`, COLORS.warning);
  const n = args.trim() ? Number(args.trim()) : 1;
  if (!Number.isInteger(n) || n < 1)
    return t.agentPane.line("Usage: /undo [N], N a positive whole number", COLORS.warning);
  try {
    const lines = kind === "undo" ? await t.agent.history.undo(n) : await t.agent.history.redo();
    for (const line of lines) t.agentPane.line(line, COLORS.info);
  } catch (error) {
    t.agentPane.line(`/${kind}: ${(error as Error).message}`, COLORS.warning);
  }
  t.refreshStatus();
}

/** /diff [N]: the unified diff of the N-th last command, coloured in the agent pane. */
/** The most lines /diff puts in the agent pane. */
const TUI_DIFF_LINES = 400;

async function showDiff(t: Tui, args: string): Promise<void> {
  const n = args.trim() ? Number(args.trim()) : 1;
  if (!Number.isInteger(n) || n < 1)
    return t.agentPane.line("Usage: /diff [N], N a positive whole number", COLORS.warning);
  try {
    const lines = (await t.agent.history.diff(n)).replace(/\n$/, "").split("\n");
    // A whole tree's diff would push the conversation out of the pane's scrollback.
    const shown = lines.slice(0, TUI_DIFF_LINES);
    for (const line of shown) {
      const color = line.startsWith("+")
        ? COLORS.ok
        : line.startsWith("-")
          ? COLORS.error
          : line.startsWith("@@")
            ? COLORS.command
            : COLORS.info;
      t.agentPane.line(visibleControls(line), color);
    }
    if (lines.length > shown.length)
      t.agentPane.line(
        `… ${lines.length - shown.length} more line(s): \`aic diff${n > 1 ? ` ${n}` : ""}\` in a shell shows the whole diff`,
        COLORS.warning,
      );
  } catch (error) {
    t.agentPane.line(`/diff: ${(error as Error).message}`, COLORS.warning);
  }
}

/** /always: the dialog's "Always allow" from the keyboard; only where a rule line can be written for the command. */
function alwaysAllow(t: Tui): void {
  const request = t.waitingRequest;
  if (!request) return t.agentPane.line("No command is waiting for approval.", COLORS.warning);
  if (!request.alwaysAllow)
    return t.agentPane.line(
      `No allow rule can be written for this command (a rule asks for it, or its program is only known when it runs); approve it with Y, or edit ${t.prepared.rules.allowFile} yourself.`,
      COLORS.warning,
    );
  t.answerApproval({ kind: "always" });
}

/** /rules shows the rules in force and where they come from; /rules reload reads the file again (the person's own act). */
function rulesCommand(t: Tui, args: string): void {
  const rules = t.prepared.rules;
  if (args.trim() === "reload") {
    const reports = rules.read();
    t.agent.history.rulesChanged();
    t.agentPane.line(`[rules] read ${rules.path} again: ${rules.rules.length} rule(s) in force`, COLORS.info);
    for (const r of reports) t.agentPane.line(r, COLORS.warning);
    return;
  }
  if (args.trim()) return t.agentPane.line("Usage: /rules, or /rules reload", COLORS.warning);
  for (const line of rules.describe()) t.agentPane.line(line, COLORS.info);
}

/** `/jobs` lists the background jobs; `/jobs kill N` stops one (SIGTERM, then SIGKILL). */
async function jobsCommand(t: Tui, args: string): Promise<void> {
  const kill = /^kill\s+(\d+)$/.exec(args.trim());
  if (kill) {
    t.agentPane.line(await t.run.jobs.kill(Number(kill[1])), COLORS.info);
    return t.refreshStatus();
  }
  if (args.trim()) return t.agentPane.line("Usage: /jobs, or /jobs kill N", COLORS.warning);
  const lines = t.run.jobs.list();
  if (!lines.length) return t.agentPane.line("No background jobs: no command has left anything running.", COLORS.info);
  for (const line of lines) t.agentPane.line(visibleControls(line), COLORS.info);
}

/** /clear: a new conversation and session, only while the agent is stopped (a slip of the keys mid-run lost a long one). */
function clearConversation(t: Tui): void {
  if (t.runInFlight)
    return t.agentPane.line(
      "The agent is working: /clear does nothing now. Interrupt it first (Escape), then /clear.",
      COLORS.warning,
    );
  t.agent.clear();
  t.figures.step = 0;
  t.figures.tokens = 0;
  t.view.clear();
  t.agentPane.line(`[SESSION] cleared; new session ${t.session?.sessionId ?? "(not saved)"}`, COLORS.info);
  if (t.session) t.figures.session = `${path.basename(t.session.path)}#${t.session.sessionId}`;
  t.refreshStatus();
}

/** /session: the session file, its id and what is on disk. */
function showSession(t: Tui): void {
  if (!t.session) return t.agentPane.line("[SESSION] off (--no-session): nothing is saved.", COLORS.info);
  t.agentPane.line(
    t.session
      .describe()
      .map((l) => `[SESSION] ${l}`)
      .join("\n"),
    COLORS.info,
  );
}

/** /reload: the session file as it is now on disk (a person may have edited it), while the agent is stopped. */
function reloadSession(t: Tui): void {
  if (t.agent.running)
    return t.agentPane.line("/reload works only while the agent is stopped (/stop first).", COLORS.warning);
  if (!t.session) return t.agentPane.line("[SESSION] off (--no-session): nothing to reload.", COLORS.info);
  const loaded = t.session.load(fullSystemPrompt(t.prepared), true);
  for (const line of loaded.reports)
    t.agentPane.line(`[SESSION] ${line}`, loaded.failed ? COLORS.warning : COLORS.info);
  if (loaded.failed) return;
  t.agent.restore(loaded.messages ? loaded : { ...loaded, messages: [], stepCount: 0, usage: emptyUsage() });
  if (loaded.messages) t.view.showConversation(loaded.messages);
  t.figures.step = 0;
  t.figures.tokens = loaded.usage?.billable_tokens ?? 0;
  t.refreshStatus();
}

/** /suggest: instead of the pending command; queued while the agent works; back in the prompt when there is nothing to steer. */
function suggestInstead(t: Tui, text: string): void {
  if (!text.trim()) return t.agentPane.line("Usage: /suggest <what the agent should do instead>", COLORS.warning);
  if (t.awaitingApproval) return t.answerApproval({ kind: "suggest", text: text.trim() });
  if (t.agent.running) {
    t.agent.suggest(text.trim());
    return t.agentPane.line(`[queued suggestion] ${text.trim()}`, COLORS.info);
  }
  // Nothing to steer: the text is not lost, it goes back where it was typed.
  t.prompt.value = `/suggest ${text.trim()}`;
  t.agentPane.line(
    "No command is waiting for approval and the agent is idle; your text is back in the prompt.",
    COLORS.warning,
  );
}

/** /aa: auto-approve on or off, from the next command. */
function toggleAutoApprove(t: Tui): void {
  const on = !t.agent.autoApproving;
  t.agent.setAutoApprove(on);
  t.agentPane.line(
    `Auto-approve is now ${on ? "ON: commands run without asking" : "OFF: each command waits for your approval"}.`,
    on ? COLORS.warning : COLORS.ok,
  );
  t.refreshStatus();
}

/** The one line left on the restored terminal: where the conversation is, and how to continue it. */
/** A job quitting stopped, as the last lines after the TUI closes say it. */
function stoppedJobLine(job: Job): string {
  return `aic: stopped job ${job.id} (pid ${job.pid}): ${visibleControls(oneLine(job.command, 200))}\n`;
}

function exitLine(session: SessionStore | undefined, config: Config): string {
  if (!session) return "aic: nothing was saved (--no-session).\n";
  const how =
    config.session === undefined && session.instanceNumber === 1
      ? `cd ${shellQuoted(process.cwd())} && aic`
      : `aic --session ${shellQuoted(session.path)}`;
  return `aic: the conversation is saved in ${session.path} (session ${session.sessionId}); to continue it: ${how}\n`;
}

// ════════════════════════════════════════════════════════════════════════════
// TUI start-up
// Owns: what a TUI is started with, loading OpenTUI (its native library from a
// place commands cannot write), the renderer, and runTui, which hands the
// terminal back on every way out.
// ════════════════════════════════════════════════════════════════════════════

interface TuiOptions {
  config: Config;
  renderer: CliRenderer;
  ot: OpenTui;
  Terminal: XTermClass;
  /** Called once, when the TUI has shut down and wants the process to end with `code`. */
  onExit(code: number): void;
  /** The sandbox and system prompt; made here when not given (tests). */
  prepared?: PreparedRun;
  historyFile?: string;
}

/** Colours of each tone of describeEvent in the panes. */
const TUI_TONES: Record<Tone, string> = {
  dim: COLORS.info,
  info: COLORS.info,
  warning: COLORS.warning,
  error: COLORS.error,
  command: COLORS.command,
  ok: COLORS.ok,
  bad: COLORS.bad,
  summary: COLORS.summary,
};

const TUI_PAGING = new Set(["pageup", "pagedown", "S-pageup", "S-pagedown"]);
/** With the approval dialog open and the prompt empty, these answer it; any other key is typing. */
/**
 * The approval dialog reads a line, as --nogui does (as Codex and Claude Code
 * users expect of a prompt that takes text): Enter on an empty field
 * approves, Escape rejects, and every printable key, y and n included, goes
 * into the field; the line y/yes approves, n/no rejects, anything else is a
 * suggestion ("no need, use printf" must reach the model).
 */
const APPROVE_KEYS = new Set(["return", "kpenter"]);
const REJECT_KEYS = new Set(["escape", "M-escape"]);
const APPROVE_WORDS = new Set(["y", "yes"]);
const REJECT_WORDS = new Set(["n", "no"]);

/**
 * Keys the TUI handles itself while the prompt has focus; everything else
 * goes to the prompt. An action that returns false lets the prompt have the
 * key after all (Up inside a multi-line prompt moves the cursor).
 */
const TUI_KEYS: Record<string, (tui: Tui) => boolean | void> = {
  up: (t) => t.keys.historyOlder(),
  "C-p": (t) => t.keys.historyOlder(),
  down: (t) => t.keys.historyNewer(),
  "C-n": (t) => t.keys.historyNewer(),
  "C-r": (t) => t.keys.startSearch(),
  pageup: (t) => t.keys.page("agent", -1),
  pagedown: (t) => t.keys.page("agent", 1),
  "S-pageup": (t) => t.keys.page("console", -1),
  "S-pagedown": (t) => t.keys.page("console", 1),
  escape: (t) => t.keys.escape(),
  // Two quick Escapes reach us as one Alt+Escape (the parser waits to see whether ESC starts a sequence).
  "M-escape": (t) => t.keys.escape(),
  "C-c": (t) => t.keys.ctrlC(),
  "C-d": (t) => t.keys.ctrlD(),
  "C-z": (t) => void t.suspendToShell(),
};

/** The keys as /help lists them. */
const TUI_KEY_HELP: readonly [string, string][] = [
  [
    "Enter",
    "send the prompt (a task, a suggestion while the agent works, or a suggestion instead of a pending command)",
  ],
  ["Alt+Enter, Ctrl+J", "new line in the prompt (a paste keeps its lines too)"],
  ["Up/Down, Ctrl+P/Ctrl+N", "walk the prompt history"],
  ["Ctrl+R", "search the prompt history (Ctrl+R again: older; Enter takes it; Esc cancels)"],
  ["Enter / Esc", "approve / reject the command in the dialog (the lines y and n too; any other line is a suggestion)"],
  ["PgUp/PgDn", "scroll the agent pane, or the approval dialog while it is open"],
  ["Shift+PgUp/PgDn", "scroll the console pane"],
  ["Tab", "switch between the Console and the Shell tab (your own shell, not sandboxed)"],
  ["Shift+Tab", "Tab inside the Shell tab (completion)"],
  ["Esc", "clear the prompt; with an empty prompt, interrupt the agent"],
  ["Ctrl+C", "the same as Esc; twice within 2 s quits"],
  ["Ctrl+O", "hand a program you approved, waiting for input, to the model"],
  ["Ctrl+D", "quit, on an empty prompt"],
  ["Ctrl+Z", "suspend aic to the shell (fg brings it back; the run pauses meanwhile)"],
];

/**
 * OpenTUI, its native library loaded from a copy in aic's state directory
 * that aic checks byte for byte against its own at each start. Left to Bun,
 * the library is unpacked into the shared temporary directory, and any file
 * there of the same size and owner is reused unchecked: a command could plant
 * one that the person's next TUI start loads outside the jail.
 */
async function importOpenTui(): Promise<OpenTui> {
  const root = await checkedNativeRoot();
  const before = process.env.OTUI_ASSET_ROOT;
  if (root) process.env.OTUI_ASSET_ROOT = root;
  try {
    const ot = await import("@opentui/core");
    return noColor() ? plainOpenTui(ot) : ot;
  } finally {
    if (before === undefined) delete process.env.OTUI_ASSET_ROOT;
    else process.env.OTUI_ASSET_ROOT = before;
  }
}

/**
 * OpenTUI under NO_COLOR: every part aic makes draws in the terminal's own
 * colours unless it names one (and fgColor/bgColor turn those into the
 * terminal's own too); OpenTUI's own default is white text and borders.
 */
function plainOpenTui(ot: OpenTui): OpenTui {
  const fg = ot.RGBA.defaultForeground();
  const borders = ["borderColor", "focusedBorderColor"];
  const fill = <T extends object>(options: T, keys: string[]): T => {
    const out = { ...options } as Record<string, unknown>;
    // A border colour on a box without a border would give it one.
    if (keys === borders && !out.border) return options;
    for (const key of keys) if (out[key] === undefined) out[key] = fg;
    return out as T;
  };
  type Options<C extends abstract new (...a: never[]) => unknown> = ConstructorParameters<C>[1];
  return {
    ...ot,
    TextRenderable: class extends ot.TextRenderable {
      constructor(r: CliRenderer, o: Options<typeof ot.TextRenderable>) {
        super(r, fill(o ?? {}, ["fg"]));
      }
    },
    MarkdownRenderable: class extends ot.MarkdownRenderable {
      constructor(r: CliRenderer, o: Options<typeof ot.MarkdownRenderable>) {
        super(r, fill(o, ["fg"]));
      }
    },
    BoxRenderable: class extends ot.BoxRenderable {
      constructor(r: CliRenderer, o: Options<typeof ot.BoxRenderable>) {
        super(r, fill(o ?? {}, borders));
      }
    },
    ScrollBoxRenderable: class extends ot.ScrollBoxRenderable {
      constructor(r: CliRenderer, o: Options<typeof ot.ScrollBoxRenderable>) {
        super(r, fill(o ?? {}, borders));
      }
    },
    TextareaRenderable: class extends ot.TextareaRenderable {
      constructor(r: CliRenderer, o: Options<typeof ot.TextareaRenderable>) {
        super(r, fill(o ?? {}, ["textColor", "focusedTextColor", "placeholderColor"]));
      }
    },
  } as OpenTui;
}

/** OpenTUI's asset root for its native library in aic's state directory, written anew unless it holds aic's own bytes. */
async function checkedNativeRoot(): Promise<string | undefined> {
  const state = aicStateDir();
  if (process.platform !== "linux" || process.arch !== "x64" || !state) return undefined;
  let embedded: string;
  try {
    embedded = String((await import("@opentui/core-linux-x64")).default);
  } catch {
    return undefined;
  }
  // Run from node_modules (a developer's checkout), nothing is unpacked: the library is loaded where it lies.
  if (!embedded.startsWith("/$bunfs/")) return undefined;
  const root = path.join(state, "native");
  const dir = path.join(root, "@opentui", "core-linux-x64");
  const file = path.join(dir, "libopentui.so");
  try {
    const want = Buffer.from(await Bun.file(embedded).bytes());
    fs.mkdirSync(dir, { recursive: true, mode: 0o700 });
    let have: Buffer | undefined;
    try {
      have = readOwnFile(file, want.length + 1);
    } catch {
      /* missing, a link, or not ours: written anew below */
    }
    if (!have?.equals(want)) writeFreshThenRename(file, want);
    return root;
  } catch {
    return undefined; // a state directory aic cannot write: Bun's own unpacking, as before
  }
}

async function runTui(config: Config, prepared: PreparedRun): Promise<number> {
  if (!process.stdin.isTTY || !process.stdout.isTTY) {
    writeOut(
      2,
      "aic: error: the terminal UI needs a terminal on stdin and stdout; use --nogui for scripts and pipes\n",
    );
    return EXIT.usage;
  }
  if (config.request === "-") {
    writeOut(2, "aic: error: reading the request from stdin (-) needs --nogui\n");
    return EXIT.usage;
  }
  const [ot, Terminal] = await Promise.all([importOpenTui(), loadXterm()]);
  let renderer: CliRenderer;
  try {
    renderer = await ot.createCliRenderer({
      exitOnCtrlC: false,
      exitSignals: [],
      autoFocus: false,
      openConsoleOnError: false,
      useMouse: true,
      maxFps: 60,
      ...(noColor() ? { backgroundColor: ot.RGBA.defaultBackground() } : {}),
    });
  } catch (error) {
    writeOut(
      2,
      `aic: error: cannot start the terminal UI (${(error as Error).message}); check that $TMPDIR is writable, or use --nogui\n`,
    );
    return EXIT.failure;
  }
  return new Promise<number>((resolve) => {
    let tui: Tui;
    try {
      tui = new Tui({ config, renderer, ot, Terminal, onExit: resolve, prepared });
    } catch (error) {
      if (!(error instanceof BrokenSession)) throw error;
      renderer.destroy();
      writeOut(2, `${error.message}\n`);
      return resolve(EXIT.usage);
    }
    onExitEvents(
      (code, reason) => {
        void tui.quit(code, reason);
        guardShutdown(code, () => tui.closeRun(reason));
      },
      (error) => void tui.quit(EXIT.failure, "process_exit", crashReport(error)),
    );
  });
}

// ════════════════════════════════════════════════════════════════════════════
// Export: ATIF trajectories
// Owns: `aic export --format atif [--session PATH]`: a session file as the
// Agent Trajectory Interchange Format of Harbor (ATIF-v1.7), on stdout. The
// file is only read (as `aic diff` reads it: a regular file, never through a
// link, size-bounded), never claimed, locked, repaired on disk or moved aside,
// so it can be exported while, or after, another aic writes it.
// ════════════════════════════════════════════════════════════════════════════

/** The ATIF version written: the newest that Harbor's published schema accepts. */
const ATIF_VERSION = "ATIF-v1.7";

/** The formats `aic export` writes. */
const EXPORT_FORMATS = ["atif"] as const;
type ExportFormat = (typeof EXPORT_FORMATS)[number];

interface AtifToolCall {
  tool_call_id: string;
  function_name: string;
  /** Always an object: arguments that are not a JSON object are kept as text under `raw_arguments`. */
  arguments: Record<string, unknown>;
}

interface AtifObservationResult {
  source_call_id: string | null;
  content: string;
}

interface AtifMetrics {
  /** Every input token of the call, cached ones included. */
  prompt_tokens: number;
  completion_tokens: number;
  /** The part of prompt_tokens served from a cache. */
  cached_tokens: number;
}

interface AtifStep {
  step_id: number;
  /** When the message was made, where the session recorded it. */
  timestamp?: string;
  source: "system" | "user" | "agent";
  message: string;
  /** Agent steps only (ATIF forbids these on system and user steps). */
  model_name?: string | null;
  reasoning_content?: string;
  tool_calls?: AtifToolCall[];
  observation?: { results: AtifObservationResult[] };
  metrics?: AtifMetrics;
}

interface AtifFinalMetrics {
  total_prompt_tokens: number;
  total_completion_tokens: number;
  total_cached_tokens: number;
  total_steps: number;
  extra: { aic_model_calls: number; billable_tokens: number; estimated: boolean };
}

interface AtifTrajectory {
  schema_version: typeof ATIF_VERSION;
  session_id: string | null;
  agent: { name: "aic"; version: string; model_name: string | null };
  steps: AtifStep[];
  notes?: string;
  final_metrics: AtifFinalMetrics;
  extra: { aic_session_version: number; updated_at: string | null; reason: string | null };
}

/** What an export needs of a session file: its repaired conversation and the figures the file names. */
interface ExportedSession {
  messages: Message[];
  usage: Usage;
  /** Model calls the session counted (`step_count`). */
  stepCount: number;
  sessionId: string | undefined;
  /** The model the file names; undefined when it names none. */
  model: string | undefined;
  updatedAt: string | undefined;
  reason: string | undefined;
}

// ── command line ────────────────────────────────────────────────────────────

/** `aic export --format atif [--session PATH]` (the session defaults to ./.aicsession, as for undo). */
function parseExportArgs(argv: string[]): ParsedArgs {
  let format: string | undefined;
  let session = DEFAULT_SESSION_FILE;
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!;
    if (arg === "--help" || arg === "-h") return { kind: "help" };
    const name = arg.startsWith("--") && arg.includes("=") ? arg.slice(0, arg.indexOf("=")) : arg;
    if (name !== "--format" && name !== "--session")
      throw new UsageError(`export takes --format atif and [--session PATH], not '${arg}'`);
    const value = arg.includes("=") ? arg.slice(arg.indexOf("=") + 1) : argv[++i];
    if (!value) throw new UsageError(`export ${name} needs a value`);
    if (name === "--format") format = value;
    else session = value;
  }
  if (format === undefined) throw new UsageError("export needs --format atif");
  if (!isExportFormat(format))
    throw new UsageError(`export --format takes ${EXPORT_FORMATS.join(" or ")}, got '${format}'`);
  return { kind: "export", format, session };
}

function isExportFormat(word: string): word is ExportFormat {
  return (EXPORT_FORMATS as readonly string[]).includes(word);
}

/** Prints the session as an ATIF trajectory; a session that cannot be read is one line on stderr, exit 2. */
function runExport(sessionPath: string): number {
  let trajectory: AtifTrajectory;
  try {
    trajectory = sessionToAtif(readSessionForExport(sessionPath), { version: VERSION });
  } catch (error) {
    writeOut(2, `aic: error: ${(error as Error).message}\n`);
    return EXIT.usage;
  }
  writeOut(1, `${JSON.stringify(trajectory, null, 2)}\n`);
  return EXIT.ok;
}

// ── reading the session file ────────────────────────────────────────────────

/**
 * The session file read as `aic diff` reads it (readOwnFile: a regular file, never a link, at most
 * MAX_OWN_FILE_BYTES) and repaired in memory as SessionStore.load repairs it (decodeSessionText,
 * repairMessages), so the export shows the conversation a resumed run would send. Throws an Error
 * whose message is the one line to print.
 */
function readSessionForExport(file: string): ExportedSession {
  const where = path.resolve(file);
  const doc = parseSessionDocument(where);
  const version = doc.aic_session_version;
  if (typeof version === "number" && version > SESSION_VERSION)
    throw new Error(
      `${where} was written by a newer aic (session format ${version}; this aic knows ${SESSION_VERSION})`,
    );
  const raw = Array.isArray(doc.messages) ? doc.messages : undefined;
  if (!raw) throw new Error(`cannot export ${where}: it has no \`messages\` list`);
  return {
    messages: repairMessages(raw, "").messages,
    usage: usageOf(doc.usage),
    stepCount: typeof doc.step_count === "number" && doc.step_count >= 0 ? Math.floor(doc.step_count) : 0,
    sessionId: textOf(doc.session_id),
    model: textOf(doc.model),
    updatedAt: textOf(doc.updated_at),
    reason: textOf(doc.reason),
  };
}

/** The file's JSON as an object (an old file that is a bare message list becomes `{messages}`). */
function parseSessionDocument(where: string): Record<string, unknown> {
  let bytes: Buffer;
  try {
    bytes = readOwnFile(where);
  } catch (error) {
    const e = ownFileError(error);
    throw new Error(
      e.missing
        ? `there is no session file ${where} (give --session PATH)`
        : `cannot read the session file ${where}: ${e.message}`,
    );
  }
  let parsed: unknown;
  try {
    parsed = JSON.parse(decodeSessionText(bytes, []));
  } catch (error) {
    throw new Error(`cannot export ${where}: it is not valid JSON (${(error as Error).message})`);
  }
  if (Array.isArray(parsed)) return { messages: parsed };
  if (parsed && typeof parsed === "object") return parsed as Record<string, unknown>;
  throw new Error(`cannot export ${where}: it is not a session (neither an object nor a message list)`);
}

function usageOf(raw: unknown): Usage {
  const stored = raw && typeof raw === "object" ? (raw as Record<string, unknown>) : {};
  const count = (key: string) => (typeof stored[key] === "number" ? Math.max(0, Math.floor(stored[key])) : 0);
  return {
    input_tokens: count("input_tokens"),
    output_tokens: count("output_tokens"),
    cached_tokens: count("cached_tokens"),
    billable_tokens: count("billable_tokens"),
    estimated: stored.estimated === true,
  };
}

const textOf = (value: unknown): string | undefined => (typeof value === "string" && value ? value : undefined);

// ── the mapping ─────────────────────────────────────────────────────────────

/**
 * The session as an ATIF trajectory: each system and user message a step of that source; each
 * assistant message an agent step with its text, its reasoning (when the message kept any) and
 * its tool calls, whose answers (the tool messages after it) are that step's observation; token
 * counts per step where the message records them (`usage`), and the session's totals in
 * final_metrics.
 */
function sessionToAtif(session: ExportedSession, meta: { version: string }): AtifTrajectory {
  const steps = stepsOf(session.messages, session.model ?? null);
  if (!steps.length) throw new Error("the session holds no messages to export");
  const summarised = splitSummary(contentText(session.messages[0]?.content)).summary !== undefined;
  return {
    schema_version: ATIF_VERSION,
    session_id: session.sessionId ?? null,
    agent: { name: "aic", version: meta.version, model_name: session.model ?? null },
    steps,
    ...(summarised
      ? {
          notes:
            "Earlier steps were compressed into the summary at the end of the system step; final_metrics count the tokens of the whole session.",
        }
      : {}),
    final_metrics: {
      total_prompt_tokens: session.usage.input_tokens,
      total_completion_tokens: session.usage.output_tokens,
      total_cached_tokens: session.usage.cached_tokens,
      total_steps: steps.length,
      extra: {
        aic_model_calls: session.stepCount,
        billable_tokens: session.usage.billable_tokens,
        estimated: session.usage.estimated === true,
      },
    },
    extra: {
      aic_session_version: SESSION_VERSION,
      updated_at: session.updatedAt ?? null,
      reason: session.reason ?? null,
    },
  };
}

/** The steps, numbered from 1; a tool message becomes a result of the agent step whose call it answers. */
function stepsOf(messages: readonly Message[], model: string | null): AtifStep[] {
  const steps: AtifStep[] = [];
  for (const m of messages) {
    if (m.role === "tool") {
      attachResult(steps, m);
      continue;
    }
    const step = stepOf(m, steps.length + 1, model);
    if (step) steps.push(step);
  }
  return steps;
}

function stepOf(m: Message, stepId: number, model: string | null): AtifStep | undefined {
  const message = atifText(m.content);
  const at = typeof m.aic_at === "string" && !Number.isNaN(Date.parse(m.aic_at)) ? { timestamp: m.aic_at } : {};
  if (m.role === "system") return message ? { step_id: stepId, ...at, source: "system", message } : undefined;
  if (m.role === "user") return { step_id: stepId, ...at, source: "user", message };
  if (m.role !== "assistant") return undefined;
  const step: AtifStep = { step_id: stepId, ...at, source: "agent", message, model_name: model };
  const reasoning = reasoningOf(m);
  if (reasoning) step.reasoning_content = reasoning;
  if (m.tool_calls?.length) {
    step.tool_calls = m.tool_calls.map(atifToolCall);
    step.observation = { results: [] };
  }
  const metrics = metricsOf(m.aic_usage ?? m.usage);
  if (metrics) step.metrics = metrics;
  return step;
}

function atifToolCall(call: ToolCall): AtifToolCall {
  return {
    tool_call_id: call.id,
    function_name: call.function.name,
    arguments: argumentsObject(call.function.arguments),
  };
}

/** A call's arguments as ATIF wants them, an object; text that is not a JSON object is kept whole. */
function argumentsObject(text: string): Record<string, unknown> {
  try {
    const parsed: unknown = JSON.parse(text);
    if (parsed && typeof parsed === "object" && !Array.isArray(parsed)) return parsed as Record<string, unknown>;
  } catch {
    /* kept as text below */
  }
  return { raw_arguments: text };
}

/** A tool answer, as a result of the latest agent step that made the call it answers. */
function attachResult(steps: AtifStep[], m: Message): void {
  const id = typeof m.tool_call_id === "string" ? m.tool_call_id : undefined;
  const owner = [...steps]
    .reverse()
    .find((s) => s.source === "agent" && s.tool_calls?.some((c) => c.tool_call_id === id));
  if (!owner?.observation) return; // repairMessages already dropped answers to no call
  owner.observation.results.push({ source_call_id: id ?? null, content: atifText(m.content) });
}

/** Message content as text: a string as is, the text of content parts joined, anything else as JSON. */
function atifText(content: unknown): string {
  if (Array.isArray(content) && content.every(isTextPart)) return content.map((p) => p.text).join("");
  return contentText(content);
}

function isTextPart(part: unknown): part is { type: "text"; text: string } {
  return (
    typeof part === "object" &&
    part !== null &&
    (part as { type?: unknown }).type === "text" &&
    typeof (part as { text?: unknown }).text === "string"
  );
}

/** The model's reasoning, where the message kept it (providers name it reasoning_content, reasoning or thinking). */
function reasoningOf(m: Message): string | undefined {
  const text = [m.reasoning_content, m.reasoning, m.thinking].find((v) => typeof v === "string" && v);
  return typeof text === "string" ? text : undefined;
}

/** Per-call token counts, where the message records them as the API reports them (`usage`). */
function metricsOf(raw: unknown): AtifMetrics | undefined {
  if (!raw || typeof raw !== "object") return undefined;
  const u = raw as Record<string, unknown>;
  const n = (v: unknown) => (typeof v === "number" && Number.isFinite(v) ? Math.max(0, Math.floor(v)) : 0);
  if (typeof u.prompt_tokens !== "number" && typeof u.completion_tokens !== "number") return undefined;
  return {
    prompt_tokens: n(u.prompt_tokens),
    completion_tokens: n(u.completion_tokens),
    cached_tokens: n(u.cached_tokens),
  };
}

// ════════════════════════════════════════════════════════════════════════════
// Main
// Owns: choosing the mode from the parsed command line and turning the outcome
// into an exit code.
// ════════════════════════════════════════════════════════════════════════════

async function main(argv: string[]): Promise<number> {
  if (argv[0] === SANDBOX_EXEC) {
    const separator = argv.indexOf("--");
    return sandboxExec(readPlanArgument(argv[1]) as SandboxPlan, argv.slice(separator + 1));
  }
  if (argv[0] === JAIL) {
    const separator = argv.indexOf("--");
    return jailInit(readPlanArgument(argv[1]) as { jail: JailPlan; sandbox: SandboxPlan }, argv.slice(separator + 1));
  }
  if (argv[0] === SANDBOX_LAUNCHER) return await runSandboxLauncher();
  process.on("exit", rememberStreamFlags());
  try {
    const parsed = parseArgs(argv, process.env);
    switch (parsed.kind) {
      case "help":
        writeOut(1, helpText() + "\n");
        return EXIT.ok;
      case "version":
        writeOut(1, `aic ${VERSION}\n`);
        return EXIT.ok;
      case "search":
        return await runSearch(parsed.query, parsed.maxResults);
      case "undo":
      case "redo":
        noteWritableWithoutARun(parsed.session);
        return await runUndo(parsed.kind, parsed.count, parsed.session);
      case "diff":
        noteWritableWithoutARun(parsed.session);
        return await runDiff(parsed.count, parsed.session);
      case "export":
        return runExport(parsed.session);
      case "rules-accept":
        return runRulesAccept(parsed.rules);
      case "run": {
        const config = parsed.config;
        secretsToRedact = credentialsOf(config);
        protectSecrets();
        const prepared = await prepareRun(config);
        return config.nogui ? await runHeadless(config, prepared) : await runTui(config, prepared);
      }
    }
  } catch (error) {
    if (!(error instanceof UsageError)) throw error;
    writeOut(2, `aic: error: ${error.message}\n`);
    return EXIT.usage;
  }
}

if (import.meta.main) {
  main(process.argv.slice(2)).then(
    (code) => process.exit(code),
    (error) => {
      writeOut(2, `aic: internal error: ${(error as Error)?.stack ?? error}\n`);
      process.exit(EXIT.failure);
    },
  );
}

export {
  exitLine,
  Agent,
  classifyForeground,
  COMMAND_ENV,
  INPUT_QUIET_MS,
  INPUT_WAIT_POLL_MS,
  judgeInput,
  MODEL_TEXTS,
  ModelClient,
  ModelError,
  StoppedError,
  commandStatusLine,
  createRun,
  describeCommandResult,
  prepareParts,
  SandboxLauncher,
  Checkpoints,
  undoCommands,
  redoCommands,
  CommandRules,
  JobTable,
  commandParts,
  judgeCommand,
  alwaysAllowLines,
  parseRuleLines,
  UnreadableCommand,
  sandboxOff,
  HeldDirectory,
  OutputStore,
  HistoryCursor,
  LogPane,
  PromptHistory,
  ReverseSearch,
  SLASH_COMMANDS,
  TokenRate,
  Tui,
  keyToBytes,
  loadXterm,
  tameEmulator,
  ConsoleStream,
  JsonSink,
  MarkerFilter,
  PlainSink,
  RenderedOutput,
  SessionStore,
  TokenCounter,
  ToolCallAssembler,
  buildSystemPrompt,
  classifyModelFailure,
  compressAnchored,
  compressTruncate,
  errorBodyText,
  loadEncoder,
  parseArgs,
  promptBudget,
  repairMessages,
  runCommand,
  spawnPty,
  splitSummary,
  systemContent,
  validateOutgoing,
};

export type {
  AgentEvent,
  AssistantTurn,
  CompletionRequest,
  Config,
  EventSink,
  FlagSpec,
  FrontEnd,
  Message,
  ModelPort,
  RetryWait,
  Sandbox,
  TuiOptions,
};
