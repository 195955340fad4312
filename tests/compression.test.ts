/**
 * End-to-end tests of the context budget and compression (README: "Context budget and
 * compression", and the context-overflow class of "The model endpoint and its failures"): the compiled dist/aic runs long scripted tasks against the fake OpenAI server, whose
 * prompt_tokens are its own tiktoken count × 1.3, so aic must recalibrate to stay in budget.
 */
import { afterAll, describe, expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { countPromptTokens, startFakeServer, type FakeServer, type RecordedRequest, type Turn } from "./fake-openai.ts";
import {
  bash,
  headless,
  jsonLines,
  messagesOf,
  requestSequenceProblems,
  reapAfterAll,
  runAic,
  scratch,
  type AicRun,
} from "./helpers.ts";

reapAfterAll();

const INFLATION = 1.3; // the fake server's default
const BUDGET = 12_000; // --max-prompt-len 16000 with a non-gpt model: a quarter, 4000, is the answer's
const STEPS = 80;
const TASK = "print the numbered rows of each of the 80 batches, one batch per command";

/** A JSON run of the task with a 20,000-token prompt budget and the given compression algorithm. */
const overflowRun = (url: string, alg: string) => [
  ...headless(url, "qwen-test", "--auto-approve", "--json", "--max-prompt-len", "16000", "--compress-alg", alg),
  TASK,
];
const HEADING = "\n\n[Prior conversation summary]\n";

type Alg = "truncate" | "context-compressor-llm";
const ALGS: Alg[] = ["truncate", "context-compressor-llm"];

const servers: FakeServer[] = [];
afterAll(() => {
  for (const s of servers.splice(0)) s.close();
});

/** Step n's command: a batch header and ~3 KB of numbered rows (~1500 tokens), different every step. */
const command = (n: number) => `echo batch ${n}; seq ${n * 10000 + 1} ${n * 10000 + 430}`;
/**
 * A token-dense variant: ~2.9 KB of base64 (gzip'd numbers: as dense as random data, ~2000 tokens,
 * but the same on every run).
 */
const denseCommand = (n: number) => `echo batch ${n}; seq ${n * 7919} 7 ${n * 7919 + 7500} | gzip -9n | base64 -w 100`;

/** A normal agent request offers the tool; the summariser's does not. */
const isSummariser = (req: RecordedRequest) => req.body?.tools === undefined;
const serverCount = (req: RecordedRequest) => Math.ceil(countPromptTokens(messagesOf(req)) * INFLATION);
const bytes = (value: unknown) => Buffer.byteLength(JSON.stringify(value));

/**
 * A fake model that asks for `command(n)` on its n-th normal request up to `steps`, then answers
 * TASKCOMPLETE; summariser requests get `SUMMARY-<k>: …`. `override` may answer the n-th normal
 * request instead (the commands then shift to the requests after it).
 */
function scriptedServer(steps: number, override?: (normal: number) => Turn | undefined, commandFor = command) {
  let normal = 0;
  let issued = 0;
  let summaries = 0;
  const srv = startFakeServer({
    turns: (req): Turn => {
      if (isSummariser(req)) {
        summaries++;
        return { content: `SUMMARY-${summaries}: printed batches 1 to ${issued}; each batch printed its rows.` };
      }
      const special = override?.(++normal);
      if (special) return special;
      return ++issued <= steps ? bash(commandFor(issued)) : { content: "TASKCOMPLETE" };
    },
  });
  servers.push(srv);
  return srv;
}

interface LongRun {
  run: AicRun;
  requests: RecordedRequest[];
  events: any[];
  /** Steps (1-based) that began with a compression. */
  compressedSteps: Set<number>;
}

async function longRun(alg: Alg): Promise<LongRun> {
  const srv = scriptedServer(STEPS);
  const run = await runAic(
    [
      ...headless(srv.url, "qwen-test", "--auto-approve", "--json", "--max-prompt-len", "16000", "--compress-alg", alg),
      TASK,
    ],
    { killAfterMs: 280_000 },
  );
  const events = jsonLines(run.stdout);
  const compressedSteps = new Set<number>();
  let step = 0;
  for (const e of events) {
    if (e.type === "step") step = e.step;
    if (e.type === "compression") compressedSteps.add(step);
  }
  return { run, requests: srv.requests, events, compressedSteps };
}

/** Both long runs start at once (they share the machine, not any state) and are awaited by the tests. */
const runs = new Map<Alg, Promise<LongRun>>();
const longRunOf = (alg: Alg) => {
  if (!runs.has(alg)) runs.set(alg, longRun(alg));
  return runs.get(alg)!;
};

/** How many leading messages of `current` are byte-identical to those of `previous`, and their JSON bytes. */
function sharedPrefix(previous: any[], current: any[]): { messages: number; bytes: number } {
  let n = 0;
  let shared = 0;
  while (n < previous.length && n < current.length && JSON.stringify(previous[n]) === JSON.stringify(current[n]))
    shared += bytes(current[n++]);
  return { messages: n, bytes: shared };
}

/** Mean over the normal requests after the first of the fraction of their bytes shared as a prefix with the one before. */
function meanPrefixShare(normal: RecordedRequest[]): number {
  let sum = 0;
  for (let i = 1; i < normal.length; i++)
    sum += sharedPrefix(messagesOf(normal[i - 1]!), messagesOf(normal[i]!)).bytes / bytes(messagesOf(normal[i]!));
  return sum / (normal.length - 1);
}

describe.each(ALGS)("an 80-step task with ~3 KB per command under a 12,000-token budget (--compress-alg %s)", (alg) => {
  // The run completes, compressing several times, one model request per step.
  test("finishes with exit 0 after compressing more than once", async () => {
    const { run, requests, events, compressedSteps } = await longRunOf(alg);
    expect(run.stderr).not.toContain("internal error");
    expect(run.code).toBe(0);
    const normal = requests.filter((r) => !isSummariser(r));
    expect(normal).toHaveLength(STEPS + 1);
    expect(events.filter((e) => e.type === "retry")).toEqual([]);
    expect(compressedSteps.size).toBeGreaterThanOrEqual(2);
    for (const e of events.filter((e) => e.type === "compression")) {
      expect(e.algorithm).toBe(alg);
      expect(e.after_tokens).toBeLessThan(e.before_tokens);
    }
    // Every command ran, in order.
    const commands = events.filter((e) => e.type === "command").map((e) => e.command);
    expect(commands).toEqual(Array.from({ length: STEPS }, (_, i) => command(i + 1)));
    expect(events.filter((e) => e.type === "command_result").at(-1)?.output).toContain(`batch ${STEPS}`);
  }, 300_000);

  // Recalibration: the server counts 30% more than tiktoken, and still no request exceeds the budget,
  // including the first one after each compression and the summariser's own requests.
  test("no request is over the budget by the server's own count", async () => {
    const { requests } = await longRunOf(alg);
    expect(requests.length).toBeGreaterThan(STEPS);
    const over = requests.flatMap((r, i) =>
      serverCount(r) > BUDGET
        ? [`request ${i}${isSummariser(r) ? " (summariser)" : ""}: ${serverCount(r)} tokens`]
        : [],
    );
    expect(over).toEqual([]);
  }, 300_000);

  // Every request is a valid OpenAI message sequence anchored on the system prompt and the task.
  test("every request is a valid message sequence with the first user message verbatim at index 1", async () => {
    const { requests } = await longRunOf(alg);
    const normal = requests.filter((r) => !isSummariser(r));
    const base = String(messagesOf(normal[0]!)[0].content);
    normal.forEach((req, i) => {
      const messages = messagesOf(req);
      expect({ request: i, problems: requestSequenceProblems(messages) }).toEqual({ request: i, problems: [] });
      expect(messages[1]).toEqual({ role: "user", content: TASK });
      // The system prompt stays byte-identical at the front; only a summary may follow it.
      expect(String(messages[0].content).startsWith(base)).toBe(true);
      expect(req.body.tools).toHaveLength(1);
    });
  }, 300_000);

  if (alg === "truncate") {
    // Truncate never calls the summariser and never touches the system message.
    test("truncate sends no summariser request and keeps the system message unchanged", async () => {
      const { requests } = await longRunOf(alg);
      expect(requests.filter(isSummariser)).toEqual([]);
      const systems = new Set(requests.map((r) => JSON.stringify(messagesOf(r)[0])));
      expect(systems.size).toBe(1);
    }, 300_000);
  } else {
    // One summariser call per compression, without tools; its text is anchored in the next
    // request's system message after [Prior conversation summary]; the previous summary is passed on.
    test("summariser requests carry no tools and their summary leads the next request's system message", async () => {
      const { requests, compressedSteps } = await longRunOf(alg);
      const summarisers = requests.filter(isSummariser);
      expect(summarisers.length).toBe(compressedSteps.size);
      const base = String(messagesOf(requests[0]!)[0].content);
      let k = 0;
      requests.forEach((req, i) => {
        if (!isSummariser(req)) return;
        k++;
        expect(req.body.tool_choice).toBeUndefined();
        expect(req.body.temperature).toBe(1);
        const [system, user] = messagesOf(req);
        expect(system.content).toContain("precise conversation summarizer");
        expect(user.content).toContain(TASK);
        if (k > 1) expect(user.content).toContain(`SUMMARY-${k - 1}:`);
        const next = requests.slice(i + 1).find((r) => !isSummariser(r))!;
        const content = String(messagesOf(next)[0].content);
        expect(content.startsWith(`${base}${HEADING}SUMMARY-${k}: `)).toBe(true);
        expect(messagesOf(next).filter((m) => m.role === "system")).toHaveLength(1);
      });
      expect(k).toBeGreaterThanOrEqual(2);
    }, 300_000);
  }

  // Prompt caching: between compressions each request extends the previous one unchanged.
  test("between compressions each request begins with the previous request's messages", async () => {
    const { requests, compressedSteps } = await longRunOf(alg);
    const normal = requests.filter((r) => !isSummariser(r));
    const broken: string[] = [];
    for (let i = 1; i < normal.length; i++) {
      const step = i + 1; // one normal request per step, no retries in this run
      const previous = messagesOf(normal[i - 1]!);
      const shared = sharedPrefix(previous, messagesOf(normal[i]!));
      if (!compressedSteps.has(step) && shared.messages !== previous.length)
        broken.push(`step ${step}: ${shared.messages}/${previous.length} messages kept`);
    }
    expect(broken).toEqual([]);
  }, 300_000);
});

describe("prefix stability across the whole run", () => {
  // Compression should not destroy prompt-cache reuse: on average more than half of each
  // request's bytes are an unchanged prefix of the request before it. The figures go in the README.
  test("more than half of each request's bytes repeat the previous request, for both algorithms", async () => {
    const shares: Record<string, number> = {};
    for (const alg of ALGS) {
      const { requests } = await longRunOf(alg);
      shares[alg] = meanPrefixShare(requests.filter((r) => !isSummariser(r)));
    }
    console.log(
      `prefix stability (mean share of each request's message bytes that repeat the previous request): ${ALGS.map((a) => `${a} ${(shares[a]! * 100).toFixed(1)}%`).join(", ")}`,
    );
    for (const alg of ALGS) expect({ alg, share: shares[alg]! > 0.5 }).toEqual({ alg, share: true });
  }, 300_000);
});

describe("--debug", () => {
  // Before each model call, commander-debug.txt holds the time, the message count, the
  // estimated tokens, the budget, and each message's role, tool_call_id, tool_calls and length.
  test("writes commander-debug.txt describing the request about to be sent", async () => {
    const srv = scriptedServer(3);
    const cwd = scratch();
    const run = await runAic(
      [...headless(srv.url, "qwen-test", "--auto-approve", "--debug", "--max-prompt-len", "16000"), TASK],
      { cwd },
    );
    expect(run.code).toBe(0);
    const dump = readFileSync(join(cwd, "commander-debug.txt"), "utf8");
    const last = srv.requests.at(-1)!;
    const messages = messagesOf(last);

    expect(dump).toMatch(/time\W+\d{4}-\d\d-\d\dT?\s?\d\d:\d\d/i);
    expect(Number(/messages?\W+(\d+)/i.exec(dump)?.[1])).toBe(messages.length);
    expect(Number(/budget\W+(\d+)/i.exec(dump)?.[1])).toBe(BUDGET);
    // The estimate is in the server's units after calibration: within 2% of what the server counted.
    const estimate = Number(/estimat\w*\W+(\d+)/i.exec(dump)?.[1]);
    expect(Math.abs(estimate - serverCount(last)) / serverCount(last)).toBeLessThan(0.02);

    // Each message, in order: its role, then (in any order, before the next message) its
    // tool_call_id, its calls' ids and its content length.
    const starts: number[] = [];
    let at = 0;
    for (const m of messages) {
      const hit = new RegExp(`role\\W+${m.role}\\b`).exec(dump.slice(at));
      expect({ message: starts.length, role: hit ? m.role : "not found" }).toEqual({
        message: starts.length,
        role: m.role,
      });
      starts.push((at += hit!.index + hit![0].length));
    }
    messages.forEach((m, i) => {
      const section = dump.slice(starts[i], starts[i + 1] ?? dump.length);
      const wanted = [m.tool_call_id, ...(m.tool_calls ?? []).map((c: any) => c.id)].filter(Boolean);
      expect({ message: i, ids: wanted.filter((id) => section.includes(id)) }).toEqual({ message: i, ids: wanted });
      expect(section).toMatch(new RegExp(`length\\W+${String(m.content ?? "").length}\\b`));
    });
  });
});

describe("context too long", () => {
  const TOO_LONG = {
    type: "http_error" as const,
    status: 400,
    body: {
      error: {
        message: "This model's maximum context length is 8192 tokens. However, your messages resulted in 9100 tokens.",
        type: "invalid_request_error",
        code: "context_length_exceeded",
      },
    },
  };

  // A 400 saying the context is too long makes aic compress harder and retry with a smaller request.
  test.each(ALGS)(
    "a context-too-long 400 mid-run is answered by compressing and retrying smaller (--compress-alg %s)",
    async (alg) => {
      let rejected = false;
      // The 4th normal request (history well under aic's own budget) is refused once.
      const srv = scriptedServer(6, (n) => (n === 4 && !rejected ? ((rejected = true), TOO_LONG) : undefined));
      const run = await runAic(overflowRun(srv.url, alg));
      expect(run.code).toBe(0);

      const normal = srv.requests.filter((r) => !isSummariser(r));
      expect(normal).toHaveLength(6 + 1 + 1); // six commands, TASKCOMPLETE, and the refused request
      const refused = normal[3]!;
      const retried = normal[4]!;
      expect(serverCount(retried)).toBeLessThan(serverCount(refused));
      expect(messagesOf(retried)[1]).toEqual({ role: "user", content: TASK });
      expect(requestSequenceProblems(messagesOf(retried))).toEqual([]);
      // The retry is the same step (no new command ran in between), and the step was not lost.
      expect(messagesOf(retried).filter((m) => m.role === "tool").length).toBeLessThanOrEqual(
        messagesOf(refused).filter((m) => m.role === "tool").length,
      );
      const events = jsonLines(run.stdout);
      expect(events.filter((e) => e.type === "compression").length).toBeGreaterThanOrEqual(1);
      expect(events.filter((e) => e.type === "command")).toHaveLength(6);
    },
    120_000,
  );

  // At most 3 compress-and-retry rounds; a server that keeps refusing ends the run with exit 1
  // and one clear error, each retry no bigger than the one before. (413 with a plain-text body.)
  test.each(ALGS)(
    "a server that keeps saying the prompt is too long gets 3 smaller retries, then exit 1 (--compress-alg %s)",
    async (alg) => {
      const refuse: Turn = {
        type: "http_error",
        status: 413,
        body: "Request too large: the prompt is too long for this model.",
      };
      const srv = scriptedServer(6, (n) => (n >= 3 ? refuse : undefined));
      const run = await runAic(overflowRun(srv.url, alg));
      expect(run.code).toBe(1);
      const normal = srv.requests.filter((r) => !isSummariser(r));
      expect(normal).toHaveLength(2 + 1 + 3); // two answered, the first refusal, three retries
      const sizes = normal.slice(2).map(serverCount);
      sizes.slice(1).forEach((size, i) => expect(size).toBeLessThanOrEqual(sizes[i]!));
      expect(sizes.at(-1)!).toBeLessThan(sizes[0]!);
      const errors = jsonLines(run.stdout).filter((e) => e.type === "error");
      expect(errors).toHaveLength(1);
      expect(errors[0].message).toMatch(/too long/i);
    },
    120_000,
  );
});

describe("the summariser's own request", () => {
  // The summariser call is a request to the same model, so it must fit the same budget, also
  // when the evicted output is token-dense (base64, minified code, hashes).
  test("fits the budget when the evicted commands printed token-dense output", async () => {
    const srv = scriptedServer(20, undefined, denseCommand);
    const run = await runAic([...headless(srv.url, "qwen-test", "--auto-approve", "--max-prompt-len", "16000"), TASK]);
    expect(run.code).toBe(0);
    const summarisers = srv.requests.filter(isSummariser);
    expect(summarisers.length).toBeGreaterThanOrEqual(2);
    expect(summarisers.map(serverCount).filter((n) => n > BUDGET)).toEqual([]);
  });
});

describe("under the budget", () => {
  // Compression only runs when the history is over budget: a short task is sent as an
  // ever-growing, unchanged history, with no summariser call.
  test("a short task is never compressed and each request extends the previous one", async () => {
    const srv = scriptedServer(5);
    const run = await runAic([...headless(srv.url, "qwen-test", "--auto-approve", "--json"), TASK]);
    expect(run.code).toBe(0);
    expect(srv.requests).toHaveLength(6);
    expect(srv.requests.filter(isSummariser)).toEqual([]);
    expect(jsonLines(run.stdout).filter((e) => e.type === "compression")).toEqual([]);
    for (let i = 1; i < srv.requests.length; i++) {
      const previous = messagesOf(srv.requests[i - 1]!);
      expect(sharedPrefix(previous, messagesOf(srv.requests[i]!)).messages).toBe(previous.length);
    }
  });
});
