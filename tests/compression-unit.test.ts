/**
 * Unit tests of the context budget and compression (README: "Context budget and compression", and
 * the options that pick them): the pure functions exported by aic.ts, run on hand-built histories with the real
 * tiktoken counter. The end-to-end behaviour is in compression.test.ts.
 */
import { beforeAll, describe, expect, test } from "bun:test";
import {
  TokenCounter,
  buildSystemPrompt,
  compressAnchored,
  compressTruncate,
  parseArgs,
  promptBudget,
  splitSummary,
  systemContent,
  type Message,
  sandboxOff,
} from "../aic.ts";
import { countPromptTokens } from "./fake-openai.ts";
import { requestSequenceProblems, toolCall } from "./helpers.ts";

const BASE = "You are a test agent. Run commands with execute_bash and answer TASKCOMPLETE when done.";
const FIRST = "count the rows of every numbered file";
const CONDENSED = "<condensed tool output>";
const HEADING = "[Prior conversation summary]";

let counter: TokenCounter;
beforeAll(async () => {
  counter = await TokenCounter.create();
});

/** ~`rows` lines of deterministic command output, different for every `seed`. */
function output(seed: number, rows = 120): string {
  const lines: string[] = [];
  for (let r = 0; r < rows; r++) lines.push(`row ${seed * 1000 + r}: value ${(seed * 7919 + r * 104729) % 100000}`);
  return `Command executed with exit code 0.\nOutput:\n${lines.join("\n")}`;
}

/**
 * system, first user, then `turns` turns. Turn t: an assistant message with `callsPer(t)` calls
 * and one tool answer per call. Extra shapes on request: a short ("ok") answer in turn 0, a
 * steering user message after turn 3 and a plain assistant note after turn 5.
 */
function history(
  turns: number,
  opts: { callsPer?: (t: number) => number; shortFirst?: boolean; extras?: boolean; rows?: number } = {},
): Message[] {
  const messages: Message[] = [
    { role: "system", content: BASE },
    { role: "user", content: FIRST },
  ];
  for (let t = 0; t < turns; t++) {
    const n = opts.callsPer?.(t) ?? 1;
    const calls = Array.from({ length: n }, (_, k) => toolCall(`call_${t}_${k}`, `cat file-${t}-${k}.txt`));
    messages.push({
      role: "assistant",
      content: t % 2 ? `Step ${t}: reading the next files.` : null,
      tool_calls: calls,
    });
    calls.forEach((c, k) =>
      messages.push({
        role: "tool",
        tool_call_id: c.id,
        content: opts.shortFirst && t === 0 ? "ok" : output(t * 10 + k, opts.rows),
      }),
    );
    if (opts.extras && t === 3)
      messages.push({ role: "user", content: "[Suggestion from user] also count the empty lines" });
    if (opts.extras && t === 5)
      messages.push(
        { role: "assistant", content: "Half of the files are done." },
        { role: "user", content: "Continue." },
      );
  }
  return messages;
}

const total = (messages: readonly Message[]) => counter.countRaw(messages);
const isCondensed = (m: Message) => m.role === "tool" && m.content === CONDENSED;

describe("budget and flags", () => {
  // Non-gpt models reserve 8000 tokens of the window for their answer; gpt models do not.
  test("the budget reserves a quarter of the window, at most 8000 tokens, for the answer of open-weight models, none for OpenAI's", () => {
    expect(promptBudget({ maxPromptLen: 20000, model: "qwen-test" })).toBe(15000);
    expect(promptBudget({ maxPromptLen: 8192, model: "qwen-test" })).toBe(6144);
    expect(promptBudget({ maxPromptLen: 40000, model: "qwen-test" })).toBe(32000);
    // The server's own window, when it said one, decides the answer's share; --max-prompt-len then caps the prompt.
    const window = { tokens: 8192, endpoint: "http://127.0.0.1:8080/props", replyTokens: 2048 };
    expect(promptBudget({ maxPromptLen: 80000, model: "qwen-test", window })).toBe(6144);
    expect(promptBudget({ maxPromptLen: 4000, model: "qwen-test", window })).toBe(4000);
    expect(promptBudget({ maxPromptLen: 80000, model: "llama-3.3-70b" })).toBe(72000);
    expect(promptBudget({ maxPromptLen: 20000, model: "gpt-4o-mini" })).toBe(20000);
    expect(promptBudget({ maxPromptLen: 80000, model: "openai/gpt-4.1" })).toBe(80000);
    // gpt-oss is an open-weight model (served by vLLM and the like) whatever its name holds.
    expect(promptBudget({ maxPromptLen: 80000, model: "openai/gpt-oss-120b" })).toBe(72000);
    // OpenAI's own endpoint, whatever the model is called.
    expect(promptBudget({ maxPromptLen: 80000, model: "ft:custom", apiBase: "https://api.openai.com/v1" })).toBe(80000);
  });

  const run = (...flags: string[]) => {
    const parsed = parseArgs(["--nogui", "--api-base", "http://127.0.0.1:9/v1", "--model", "m", ...flags, "task"], {});
    if (parsed.kind !== "run") throw new Error(`expected a run, got ${parsed.kind}`);
    return parsed.config;
  };

  // The anchored LLM summary is the default algorithm, keeping 40% of the budget.
  test("default algorithm is context-compressor-llm with target 0.4", () => {
    const config = run();
    expect(config.compressAlg).toBe("context-compressor-llm");
    expect(config.compressTarget).toBe(0.4);
    expect(config.warnings).toEqual([]);
    expect(run("--compress-alg", "truncate").compressAlg).toBe("truncate");
  });

  // An unknown algorithm name is not an error: warn, then use truncate.
  test("an unknown algorithm falls back to truncate with a warning", () => {
    const config = run("--compress-alg", "zip-it");
    expect(config.compressAlg).toBe("truncate");
    expect(config.warnings).toHaveLength(1);
    expect(config.warnings[0]).toContain("zip-it");
    expect(config.warnings[0]).toContain("truncate");
  });

  // --fast forces truncate whatever --compress-alg says.
  test("--fast forces truncate", () => {
    const config = run("--fast", "--compress-alg", "context-compressor-llm");
    expect(config.fast).toBe(true);
    expect(config.compressAlg).toBe("truncate");
    expect(config.warnings).toEqual([]);
  });

  // --fast also picks the short system prompt, which still carries the rules the loop relies on.
  test("--fast's system prompt is shorter and keeps TASKCOMPLETE, the truncation sentinel, the timeout and the search recipe", () => {
    const sandbox = sandboxOff("test");
    const facts = {
      timeoutSec: 77,
      maxOutputBytes: 4321,
      sandbox,
      selfCommand: "/opt/aic/bin/aic",
      shell: "/bin/bash",
      cwd: "/work/proj",
      ciEnv: true,
    };
    const full = buildSystemPrompt({ ...facts, fast: false });
    const fast = buildSystemPrompt({ ...facts, fast: true });
    expect(fast.length).toBeLessThan(full.length);
    for (const prompt of [full, fast]) {
      expect(prompt).toContain("TASKCOMPLETE");
      expect(prompt).toContain("output too long: truncated");
      expect(prompt).toContain("77 seconds");
      expect(prompt).toContain('/opt/aic/bin/aic search "');
      // Which shell, that each command starts afresh in the project, and CI=true.
      expect(prompt).toContain("runs in bash (/bin/bash -c), in a fresh shell that starts in /work/proj");
      expect(prompt).toContain("CI=true");
    }
  });

  // The target is a fraction strictly between 0 and 1.
  test("--compress-target outside (0,1) is a usage error naming the flag", () => {
    for (const bad of ["0", "1", "1.5", "-0.2", "half"])
      expect(() => run("--compress-target", bad)).toThrow("--compress-target");
    expect(run("--compress-target", "0.25").compressTarget).toBe(0.25);
  });
});

describe("truncate", () => {
  // Compression is a no-op while the history fits the target.
  test("a history within the target comes back unchanged", () => {
    const messages = history(4);
    const result = compressTruncate(messages, counter, total(messages));
    expect(result.removed).toBe(0);
    expect(result.messages).toHaveLength(messages.length);
    result.messages.forEach((m, i) => expect(m).toBe(messages[i]!));
  });

  // First pass: tool outputs are condensed oldest first, one at a time, only until the total fits.
  test("condenses only as many tool outputs as needed, oldest first, skipping short ones", () => {
    const messages = history(8, { shortFirst: true });
    const toolIdx = messages.flatMap((m, i) => (m.role === "tool" ? [i] : []));
    const saving = (i: number) =>
      counter.countMessage(messages[i]!) - counter.countMessage({ ...messages[i]!, content: CONDENSED });
    // Turn 0's answer is "ok" (≤ 30 characters): never condensed. Condensing turns 1 and 2 just fits.
    const target = total(messages) - saving(toolIdx[1]!) - saving(toolIdx[2]!) + 1;
    const result = compressTruncate(messages, counter, target);

    expect(total(result.messages)).toBeLessThanOrEqual(target);
    expect(result.removed).toBe(0);
    expect(result.messages).toHaveLength(messages.length);
    const condensed = result.messages.flatMap((m, i) => (isCondensed(m) ? [i] : []));
    expect(condensed).toEqual([toolIdx[1]!, toolIdx[2]!]);
    expect(result.messages[toolIdx[0]!]!.content).toBe("ok");
    // Everything else is untouched, and the condensed answers keep their ids.
    result.messages.forEach((m, i) => {
      if (condensed.includes(i)) expect(m.tool_call_id).toBe(messages[i]!.tool_call_id);
      else expect(m).toBe(messages[i]!);
    });
  });

  // Second pass: whole turns are dropped (oldest first) only when condensing everything is not enough.
  test("drops old turns only when condensing is not enough, and only as many as needed", () => {
    const messages = history(12);
    const allCondensed = messages.map((m) => (m.role === "tool" ? { ...m, content: CONDENSED } : m));
    const head = total(messages.slice(0, 2));
    const target = head + Math.floor((total(allCondensed) - head) / 3); // about a third of the condensed turns fit
    const result = compressTruncate(messages, counter, target);
    const out = result.messages;

    expect(total(out)).toBeLessThanOrEqual(target);
    expect(result.removed).toBeGreaterThan(0);
    expect(out.length).toBe(messages.length - result.removed);
    expect(out[0]).toBe(messages[0]!);
    expect(out[1]).toBe(messages[1]!);
    expect(out.filter((m) => m.role === "tool").every(isCondensed)).toBe(true);
    // What is left is the newest suffix of the condensed history…
    const suffix = allCondensed.slice(allCondensed.length - (out.length - 2));
    expect(out.slice(2)).toEqual(suffix);
    // …and keeping one more turn (an assistant call and its answer) would not have fitted.
    const dropped = allCondensed.slice(2, allCondensed.length - suffix.length);
    expect(total(out) + total(dropped.slice(-2))).toBeGreaterThan(target);
    expect(requestSequenceProblems(out)).toEqual([]);
  });

  // Index 0 and 1 stay; no tool answer loses its call and no call loses its answers, whatever the target.
  test("never leaves an orphan tool answer or an unanswered call, and always fits the target", () => {
    const messages = history(14, { callsPer: (t) => 1 + (t % 3), extras: true });
    expect(requestSequenceProblems(messages)).toEqual([]);
    const head = total(messages.slice(0, 2));
    const full = total(messages);
    for (let target = head; target <= full; target += 97) {
      const out = compressTruncate(messages, counter, target).messages;
      expect(out[0]).toBe(messages[0]!);
      expect(out[1]).toBe(messages[1]!);
      expect(requestSequenceProblems(out)).toEqual([]);
      expect(total(out)).toBeLessThanOrEqual(target);
    }
  });
});

describe("anchored LLM summary", () => {
  /** A stand-in for the summariser call: records each request it is given and answers with `reply`. */
  function summariser(reply: (n: number) => string | undefined) {
    const requests: Message[][] = [];
    const fn = async (request: Message[]) => {
      requests.push(request);
      return reply(requests.length);
    };
    return { fn, requests };
  }

  /** The target a real step would use: 40% of what the history holds now. */
  const targetFor = (messages: Message[]) => Math.floor(total(messages) * 0.4);

  // System prompt + summary in one system message, first user verbatim at 1, newest whole turns kept.
  test("puts the summary after the base prompt, keeps the first user message and cuts at a turn boundary", async () => {
    const messages = history(10, { callsPer: (t) => 1 + (t % 2) });
    const target = targetFor(messages);
    const s = summariser((n) => `SUMMARY-${n}: files 0–6 were read.`);
    const result = await compressAnchored(messages, BASE, undefined, counter, target, s.fn, total(messages));
    const out = result.messages;

    expect(result.summary).toBe("SUMMARY-1: files 0–6 were read.");
    expect(out[0]).toEqual({ role: "system", content: `${BASE}\n\n${HEADING}\nSUMMARY-1: files 0–6 were read.` });
    expect(out[0]!.content).toBe(systemContent(BASE, result.summary));
    expect(out[1]).toEqual({ role: "user", content: FIRST });
    expect(out.filter((m) => m.role === "system")).toHaveLength(1);
    // The kept log is the newest suffix, starting on a turn boundary (never a tool answer first).
    expect(out.length).toBeGreaterThan(2);
    expect(out[2]!.role).not.toBe("tool");
    expect(out.slice(2)).toEqual(messages.slice(messages.length - (out.length - 2)));
    expect(result.removed).toBe(messages.length - out.length);
    expect(requestSequenceProblems(out)).toEqual([]);
    expect(total(out)).toBeLessThanOrEqual(target);
    expect(s.requests).toHaveLength(1);
  });

  // The summariser gets its own system line, no tools, and the evicted messages as `[role] content`
  // together with the system prompt and the first user command.
  test("the summariser request carries the evicted segment, the first command and the system prompt", async () => {
    const messages = history(10, { rows: 40 });
    const s = summariser(() => "SUMMARY-1");
    const result = await compressAnchored(
      messages,
      BASE,
      undefined,
      counter,
      targetFor(messages),
      s.fn,
      total(messages),
    );
    const request = s.requests[0]!;

    expect(request.map((m) => m.role)).toEqual(["system", "user"]);
    expect(String(request[0]!.content)).toContain("precise conversation summarizer");
    expect(request.some((m) => m.tool_calls || m.tool_call_id)).toBe(false);
    const ask = String(request[1]!.content);
    expect(ask).toContain(BASE);
    expect(ask).toContain(FIRST);
    expect(ask).toMatch(/5000 characters/);
    expect(ask).toMatch(/not a (request from the user|user request)/i);
    const evicted = messages.slice(2, messages.length - (result.messages.length - 2));
    expect(evicted.length).toBeGreaterThan(0);
    for (const m of evicted) {
      if (m.role === "tool") expect(ask).toContain(`[tool] ${m.content}`);
      else {
        expect(ask).toContain(`[assistant] ${m.content ?? ""}`);
        expect(ask).toContain(JSON.parse(m.tool_calls![0]!.function.arguments).command);
      }
    }
    // Only the evicted segment is summarised: the kept turns are not in the request.
    for (const m of result.messages.slice(2)) if (m.role === "tool") expect(ask).not.toContain(String(m.content));
  });

  // When the evicted segment is too long to send whole, what is left out must be its older
  // part (as the request itself says), so the summary still covers the work just before the cut.
  test("an evicted segment too long for the request keeps its newest messages", async () => {
    const messages = history(40);
    const s = summariser(() => "SUMMARY-1");
    const result = await compressAnchored(
      messages,
      BASE,
      undefined,
      counter,
      targetFor(messages),
      s.fn,
      total(messages),
    );
    const ask = String(s.requests[0]![1]!.content);
    const evicted = messages.slice(2, messages.length - (result.messages.length - 2));
    const newestTool = evicted.findLast((m) => m.role === "tool")!;
    expect(ask).toContain(String(newestTool.content).slice(-200));
  });

  // The previous summary is folded into the next one.
  test("the previous summary is passed to the summariser and replaced by the new one", async () => {
    const messages = history(10);
    messages[0] = { role: "system", content: systemContent(BASE, "SUMMARY-OLD: the first files were empty.") };
    const s = summariser(() => "SUMMARY-NEW: all files counted so far.");
    const result = await compressAnchored(
      messages,
      BASE,
      "SUMMARY-OLD: the first files were empty.",
      counter,
      targetFor(messages),
      s.fn,
      total(messages),
    );

    expect(String(s.requests[0]![1]!.content)).toContain("SUMMARY-OLD: the first files were empty.");
    expect(result.messages[0]!.content).toBe(`${BASE}\n\n${HEADING}\nSUMMARY-NEW: all files counted so far.`);
  });

  // A failed summariser still shrinks the history, with [summary unavailable] in place of the summary.
  test("a failing summariser gives [summary unavailable] and still shrinks", async () => {
    const messages = history(10);
    const target = targetFor(messages);
    const result = await compressAnchored(
      messages,
      BASE,
      undefined,
      counter,
      target,
      async () => undefined,
      total(messages),
    );

    expect(result.summary).toContain("[summary unavailable]");
    expect(result.messages[0]!.content).toBe(`${BASE}\n\n${HEADING}\n${result.summary}`);
    expect(result.messages[1]).toEqual({ role: "user", content: FIRST });
    expect(result.messages.length).toBeLessThan(messages.length);
    expect(total(result.messages)).toBeLessThanOrEqual(target);
    expect(requestSequenceProblems(result.messages)).toEqual([]);
  });

  // Whatever the target, the result is a valid sequence anchored on the first user message, within the target.
  test("never splits a turn, whatever the target", async () => {
    const messages = history(14, { callsPer: (t) => 1 + (t % 3), extras: true });
    const full = total(messages);
    for (let fraction = 0.15; fraction < 1; fraction += 0.1) {
      const target = Math.floor(full * fraction);
      const result = await compressAnchored(
        messages,
        BASE,
        undefined,
        counter,
        target,
        async () => "SUMMARY: short.",
        total(messages),
      );
      const out = result.messages;
      expect(out[1]).toEqual({ role: "user", content: FIRST });
      expect(out[2]?.role).not.toBe("tool");
      expect(requestSequenceProblems(out)).toEqual([]);
      expect(total(out)).toBeLessThanOrEqual(target);
    }
  });

  // The summary lives in the system message and is recovered from it after a restart.
  test("splitSummary round-trips systemContent", () => {
    const summary =
      "SUMMARY-3:\n\n1. Primary request\n- count rows\n\n[Prior conversation summary]\nnested heading text";
    expect(systemContent(BASE, undefined)).toBe(BASE);
    expect(splitSummary(systemContent(BASE, summary))).toEqual({ base: BASE, summary });
    expect(splitSummary(BASE)).toEqual({ base: BASE, summary: undefined });
    const multiline = `${BASE}\n\nMore rules.\n\nEven more.`;
    expect(splitSummary(systemContent(multiline, "S"))).toEqual({ base: multiline, summary: "S" });
  });
});

describe("token counting", () => {
  // Content + tool call name and arguments + 4 per message, o200k_base — the fake server's formula.
  test("counts messages the way the server's tiktoken count does", () => {
    const messages = history(6, { callsPer: (t) => 1 + (t % 3), extras: true });
    const wire = JSON.parse(JSON.stringify(messages.map((m) => ({ ...m, content: m.content ?? "" }))));
    expect(counter.countRaw(messages)).toBe(countPromptTokens(wire));
  });

  // Counts are cached per message, so a step pays only for its new messages. The work is counted,
  // not timed: every text the tokenizer is handed goes through `encoded`, and the second count must
  // hand it nothing. (What the cache saves in time is measured by `bun run tests/bench/run.ts tokens`.)
  test("counting the same 2000 messages a second time costs far less than the first", async () => {
    const real = await TokenCounter.create();
    let encoded = 0;
    const fresh = new TokenCounter({
      count: (text: string) => {
        encoded++;
        return real.tokensOf(text);
      },
    });
    const messages: Message[] = Array.from({ length: 2000 }, (_, i) => ({
      role: "tool",
      tool_call_id: `c${i}`,
      content: output(i, 25),
    }));
    const first = fresh.countRaw(messages);
    const firstWork = encoded;
    const second = fresh.countRaw(messages);
    const secondWork = encoded - firstWork;
    expect(second).toBe(first);
    expect(first).toBe(real.countRaw(messages));
    expect(firstWork).toBeGreaterThanOrEqual(messages.length); // every message encoded once
    expect(secondWork).toBe(0);
  });

  // A cached count must follow an edit of the message (sessions are edited by hand, truncate condenses).
  test("a changed message is counted again", async () => {
    const fresh = await TokenCounter.create();
    const m: Message = { role: "tool", tool_call_id: "c1", content: output(1) };
    const before = fresh.countMessage(m);
    m.content = "short";
    expect(fresh.countMessage(m)).toBe(countPromptTokens([m]));
    expect(fresh.countMessage(m)).toBeLessThan(before);
  });

  // The server's prompt_tokens recalibrates the estimate.
  test("calibrate() learns the ratio of the server's count to the raw count", async () => {
    const fresh = await TokenCounter.create();
    const messages = history(3);
    const raw = fresh.countRaw(messages);
    expect(fresh.ratio).toBe(1);
    expect(fresh.estimate(messages)).toBe(raw);
    fresh.calibrate(raw, Math.ceil(raw * 1.3));
    expect(fresh.ratio).toBeCloseTo(1.3, 2);
    expect(fresh.estimate(messages)).toBe(Math.ceil(raw * fresh.ratio));
    expect(Math.abs(fresh.estimate(messages) - Math.ceil(raw * 1.3))).toBeLessThanOrEqual(1);
    // A response without usage (0 prompt tokens) leaves the learnt ratio alone.
    fresh.calibrate(raw, 0);
    expect(fresh.ratio).toBeCloseTo(1.3, 2);
  });
});
