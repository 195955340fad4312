/**
 * A scripted model for running aic's loop in-process: the ModelPort the Agent
 * talks to, answering each completion with the next scripted turn, streaming
 * its text through the same callbacks the real client uses, and recording
 * every request. With it a test builds a whole run (createRun, with the real
 * sandbox, PTYs, session store and rules) and drives it without an HTTP
 * server or the compiled binary. Failures (a ModelError the retry policy
 * sees) are not scripted here: those belong to the real ModelClient, tested
 * against the fake server with an instant RetryWait.
 */
import { mkdtempSync, realpathSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  type Agent,
  type AgentEvent,
  type AssistantTurn,
  type CompletionRequest,
  type EventSink,
  type FrontEnd,
  type Message,
  type ModelPort,
  createRun,
  parseArgs,
  prepareParts,
} from "../aic.ts";
import { testStateHome } from "./helpers.ts";

/** One scripted answer: text, tool calls (as command lines or raw arguments), the server's token figures. */
export interface ScriptedTurn {
  content?: string;
  reasoning?: string;
  /** Each a shell command for execute_bash, or `{ name, arguments }` for anything else. */
  calls?: (string | { id?: string; name: string; arguments: string })[];
  finishReason?: string;
  usage?: { prompt_tokens: number; completion_tokens: number; cached_tokens?: number };
}

/** A ModelPort that answers from a script (or a function of the request), then TASKCOMPLETE forever. */
export class ScriptedModel implements ModelPort {
  readonly requests: CompletionRequest[] = [];
  runs = 0;
  private next = 0;

  constructor(private readonly script: ScriptedTurn[] | ((req: CompletionRequest, index: number) => ScriptedTurn)) {}

  newRun(): void {
    this.runs++;
  }

  async completeWithRetries(
    request: () => CompletionRequest,
    signal: AbortSignal,
    on: { onContent?(t: string): void; onReasoning?(t: string): void; onThinkingComplete?(): void },
  ): Promise<AssistantTurn> {
    const req = request();
    // What the loop sent, as it was then (the loop mutates its history afterwards).
    this.requests.push(structuredClone(req));
    const index = this.next++;
    const turn =
      typeof this.script === "function" ? this.script(req, index) : (this.script[index] ?? { content: "TASKCOMPLETE" });
    if (signal.aborted) throw new Error("stopped before the scripted turn");
    if (turn.reasoning) {
      on.onReasoning?.(turn.reasoning);
      on.onThinkingComplete?.();
    }
    if (turn.content) on.onContent?.(turn.content);
    const toolCalls = (turn.calls ?? []).map((c, i) =>
      typeof c === "string"
        ? {
            id: `call_${index}_${i}`,
            type: "function" as const,
            function: { name: "execute_bash", arguments: JSON.stringify({ command: c }) },
          }
        : {
            id: c.id ?? `call_${index}_${i}`,
            type: "function" as const,
            function: { name: c.name, arguments: c.arguments },
          },
    );
    const chars = JSON.stringify(req.messages).length;
    return {
      content: turn.content ?? "",
      reasoning: turn.reasoning ?? "",
      toolCalls,
      finishReason: turn.finishReason ?? (toolCalls.length ? "tool_calls" : "stop"),
      usage: {
        prompt_tokens: turn.usage?.prompt_tokens ?? Math.ceil(chars / 4),
        completion_tokens: turn.usage?.completion_tokens ?? 10,
        cached_tokens: turn.usage?.cached_tokens ?? 0,
      },
    };
  }

  /** The messages of the n-th request (0-based). */
  messages(n: number): Message[] {
    return this.requests[n]?.messages ?? [];
  }
}

/** A sink that keeps every event. */
export class RecordingSink implements EventSink {
  readonly events: AgentEvent[] = [];
  emit(event: AgentEvent): void {
    this.events.push(event);
  }
  of<T extends AgentEvent["type"]>(type: T): Extract<AgentEvent, { type: T }>[] {
    return this.events.filter((e): e is Extract<AgentEvent, { type: T }> => e.type === type);
  }
}

/**
 * One whole run of aic in this process, in a fresh directory (the process's
 * working directory moves there for the run and back afterwards): the real
 * configuration from `flags`, session store, rules, command runner and PTYs;
 * the scripted model. The sandbox is off: its launcher is aic's own
 * executable, which a test process is not (the sandbox is tested end to end).
 * aic's state goes to the tests' own state directory.
 */
export async function runInProcess(
  model: ModelPort,
  flags: string[],
  request: string,
  opts: {
    cwd?: string;
    front?: Partial<FrontEnd>;
    sink?: RecordingSink;
    /** Told the agent before it runs (a test that steers it mid-run needs it). */
    onAgent?: (agent: Agent) => void;
  } = {},
) {
  const cwd = opts.cwd ?? realpathSync(mkdtempSync(join(tmpdir(), "aic-inproc-")));
  const before = process.cwd();
  const stateBefore = process.env.XDG_STATE_HOME;
  process.env.XDG_STATE_HOME = testStateHome();
  process.chdir(cwd);
  const sink = opts.sink ?? new RecordingSink();
  try {
    const parsed = parseArgs(
      ["--nogui", "--api-base", "http://127.0.0.1:9/v1", "--model", "scripted", "--disable-sandbox", ...flags, request],
      {},
    );
    if (parsed.kind !== "run") throw new Error(`flags did not make a run: ${JSON.stringify(parsed)}`);
    const config = parsed.config;
    const prepared = prepareParts(config);
    const front: FrontEnd = {
      sink,
      attended: false,
      approve: async () => ({ kind: "no_input" }),
      canAnswerInput: () => false,
      model,
      ...opts.front,
    };
    const run = createRun(config, prepared, front, request);
    opts.onAgent?.(run.agent);
    try {
      const outcome = await run.agent.run(request);
      return { outcome, sink, cwd, agent: run.agent };
    } finally {
      run.close("process_exit");
    }
  } finally {
    process.chdir(before);
    if (stateBefore === undefined) delete process.env.XDG_STATE_HOME;
    else process.env.XDG_STATE_HOME = stateBefore;
  }
}
