/**
 * In-process tests of the session store (README: "Session files"): `repairMessages`, `SessionStore` (claim,
 * load, save, release) and `Agent.clear()`, imported from aic.ts and run on real files and real
 * kernel locks in scratch directories. Then a seeded fuzz of a session file: whatever a crash or
 * a person leaves in it, loading never throws, and either yields a history the API accepts or
 * moves the file aside intact. A sample of the fuzzed files also goes through dist/aic.
 */
import { afterEach, describe, expect, test } from "bun:test";
import { existsSync, mkdirSync, readFileSync, readdirSync, rmSync, statSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import {
  Agent,
  CommandRules,
  HeldDirectory,
  OutputStore,
  JobTable,
  SessionStore,
  exitLine,
  parseArgs,
  sandboxOff,
  repairMessages,
  type AgentEvent,
  type EventSink,
  type Sandbox,
} from "../aic.ts";
import { startFakeServer, type FakeServer } from "./fake-openai.ts";
import { headless, loadedHistoryProblems, reapAfterAll, runAic, scratch, toolCall } from "./helpers.ts";

reapAfterAll();

const SYSTEM = "You are a test system prompt.";
const META = { model: "unit-model", apiBase: "http://127.0.0.1:9/v1" };

/** A sink that keeps what the store reports. */
function recorder(): EventSink & { events: AgentEvent[]; warnings(): string[] } {
  const events: AgentEvent[] = [];
  return {
    events,
    emit: (e) => void events.push(e),
    warnings: () => events.flatMap((e) => (e.type === "warning" ? [e.text] : [])),
  };
}

const stores: SessionStore[] = [];
/** Claims a session file and releases it after the test. */
function claim(path: string, sink: EventSink = recorder()): SessionStore {
  const store = SessionStore.claim(path, META, sink);
  stores.push(store);
  return store;
}
afterEach(() => {
  for (const s of stores.splice(0)) s.release();
});

const state = (messages: any[], stepCount = 0) => ({
  messages,
  stepCount,
  usage: { input_tokens: 0, output_tokens: 0, cached_tokens: 0, billable_tokens: 0 },
});

// ---------------------------------------------------------------------------------------------

describe("repairMessages (loading a hand-edited file)", () => {
  // Each of the repairs, alone, with its own report line.
  test("adds a missing system prompt", () => {
    const { messages, reports } = repairMessages([{ role: "user", content: "hi" }], SYSTEM);
    expect(messages).toEqual([
      { role: "system", content: SYSTEM },
      { role: "user", content: "hi" },
    ]);
    expect(reports).toHaveLength(1);
  });

  test("drops tool messages that answer no preceding call", () => {
    const raw: any[] = [
      { role: "system", content: "s" },
      { role: "user", content: "u" },
      { role: "tool", tool_call_id: "nobody", content: "x" },
      { role: "assistant", content: null, tool_calls: [toolCall("a")] },
      { role: "tool", tool_call_id: "a", content: "ok" },
      { role: "tool", tool_call_id: "a", content: "twice" },
    ];
    const { messages, reports } = repairMessages(raw, SYSTEM);
    expect(messages).toEqual([raw[0], raw[1], raw[3], raw[4]]);
    expect(reports).toHaveLength(1);
  });

  test("closes each unanswered call with a [SESSION RECOVERED] tool message right after its call", () => {
    const raw: any[] = [
      { role: "system", content: "s" },
      { role: "user", content: "u" },
      { role: "assistant", content: null, tool_calls: [toolCall("a"), toolCall("b"), toolCall("c")] },
      { role: "tool", tool_call_id: "b", content: "done" },
      { role: "user", content: "later" },
    ];
    const { messages, reports } = repairMessages(raw, SYSTEM);
    expect(messages.map((m) => [m.role, m.tool_call_id])).toEqual([
      ["system", undefined],
      ["user", undefined],
      ["assistant", undefined],
      ["tool", "b"],
      ["tool", "a"],
      ["tool", "c"],
      ["user", undefined],
    ]);
    for (const m of messages.slice(4, 6)) expect(m.content as string).toStartWith("[SESSION RECOVERED]");
    expect(reports).toHaveLength(1);
    expect(loadedHistoryProblems(messages)).toEqual([]);
  });

  // The model's last answer survives a resume, so the resumed model remembers its own conclusion.
  test("keeps a trailing assistant message without tool calls, and reports nothing", () => {
    const raw: any[] = [
      { role: "system", content: "s" },
      { role: "user", content: "u" },
      { role: "assistant", content: "Done: all 12 tests pass. TASKCOMPLETE" },
    ];
    const { messages, reports } = repairMessages(structuredClone(raw), SYSTEM);
    expect(messages).toEqual(raw);
    expect(reports).toEqual([]);
  });

  // Content of the right JSON type but not one the API takes (a number, a list of numbers) becomes text.
  test("turns content that is neither text nor content parts into text", () => {
    const raw: any[] = [
      { role: "system", content: "s" },
      { role: "user", content: 123 },
      { role: "assistant", content: [1, 2] },
      { role: "user", content: [{ type: "text", text: "parts stay" }] },
    ];
    const { messages, reports } = repairMessages(raw, SYSTEM);
    expect(messages.map((m) => m.content)).toEqual(["s", "123", "[1,2]", [{ type: "text", text: "parts stay" }]]);
    expect(reports).toHaveLength(1);
  });

  test("drops messages with an unknown role and names the role", () => {
    const raw: any[] = [
      { role: "system", content: "s" },
      { role: "usr", content: "typo" },
      { role: "user", content: "u" },
    ];
    const { messages, reports } = repairMessages(raw, SYSTEM);
    expect(messages).toEqual([raw[0], raw[2]]);
    expect(reports).toEqual(['dropped 1 message(s) with an unknown role ("usr")']);
  });

  test("drops entries that are not messages", () => {
    const raw: any[] = [
      { role: "system", content: "s" },
      null,
      42,
      "text",
      [],
      { content: "no role" },
      { role: "user", content: "u" },
    ];
    const { messages, reports } = repairMessages(raw, SYSTEM);
    expect(messages).toEqual([raw[0], raw[6]]);
    expect(reports).toHaveLength(1);
  });

  test("a sound history is left exactly as it was, with nothing reported", () => {
    const raw: any[] = [
      { role: "system", content: "s" },
      { role: "user", content: "u" },
      { role: "assistant", content: null, tool_calls: [toolCall("a")] },
      { role: "tool", tool_call_id: "a", content: "ok" },
    ];
    expect(repairMessages(structuredClone(raw), SYSTEM)).toEqual({ messages: raw, reports: [] });
  });
});

describe("SessionStore", () => {
  // flock is per open file: a second claim, even in this process, gets <session>2; release frees it.
  test("claims number the file while it is held and reuse it once released", () => {
    const dir = scratch();
    const base = join(dir, ".aicsession");
    const first = claim(base);
    const sink = recorder();
    const second = claim(base, sink);
    expect([first.path, first.instanceNumber]).toEqual([base, 1]);
    expect([second.path, second.instanceNumber]).toEqual([`${base}2`, 2]);
    expect(sink.warnings().join("\n")).toMatch(/\.aicsession2.*instance 2/);
    first.release();
    const third = claim(base);
    expect([third.path, third.instanceNumber]).toEqual([base, 1]);
  });

  // A new file is created 0600 and holds the documented fields; extra keys from the loaded file are kept.
  test("save writes a 0600 document and keeps unknown keys", () => {
    const dir = scratch();
    const path = join(dir, "s.json");
    writeFileSync(path, JSON.stringify({ custom: { keep: [1, 2] }, messages: [{ role: "system", content: "s" }] }), {
      mode: 0o644,
    });
    const store = claim(path);
    store.load(SYSTEM);
    expect(store.save("tool_result", state([{ role: "system", content: SYSTEM }], 3))).toBe(true);
    const doc = JSON.parse(readFileSync(path, "utf8"));
    expect(doc).toMatchObject({
      aic_session_version: 1,
      reason: "tool_result",
      model: META.model,
      api_base: META.apiBase,
      instance_number: 1,
      step_count: 3,
      custom: { keep: [1, 2] },
    });
    expect(statSync(path).mode & 0o777).toBe(0o600);
  });

  // A failing write returns false, leaves no partial file, and is reported once however often it recurs.
  test("a write failure is reported once and the run can go on", () => {
    const dir = join(scratch(), "vanishing");
    mkdirSync(dir);
    const sink = recorder();
    const store = claim(join(dir, "s.json"), sink);
    // Nothing can be created in a directory that no longer exists, through any descriptor.
    rmSync(dir, { recursive: true });
    const results = Array.from({ length: 5 }, () => store.save("tool_result", state([])));
    expect(results).toEqual([false, false, false, false, false]);
    expect(sink.warnings().filter((w) => w.includes("s.json") && !w.includes(".lock"))).toHaveLength(1);
  });

  // "Never delete a user's file": a broken file is neither moved nor written, at start or on /reload.
  test("a broken file stays as it is, with its place, and nothing is saved over it", () => {
    const dir = scratch();
    const path = join(dir, "s.json");
    for (const [text, place] of [
      ["{broken one", "s.json:1:2: it is not valid JSON"],
      ['{\n  "a": 1,\n}', "s.json:3:1: it is not valid JSON"],
      ['{"no": "messages"}', "s.json:1:1: it is JSON, but no session"],
    ] as const) {
      writeFileSync(path, text);
      const store = claim(path);
      const loaded = store.load(SYSTEM);
      expect(loaded.messages).toBeUndefined();
      expect(loaded.broken).toContain(place);
      expect(store.waitsForReload).toBe(true);
      expect(store.save("tool_result", state([{ role: "system", content: SYSTEM }]))).toBe(false);
      store.release();
      expect(readFileSync(path, "utf8")).toBe(text);
      expect(readdirSync(dir).filter((n) => !n.endsWith(".lock"))).toEqual(["s.json"]);
    }
  });
});

describe("Agent.clear() (/clear)", () => {
  // /clear writes an empty session (reason `cleared`), so the next start restores nothing.
  test("clear() saves an empty history with reason cleared and nothing comes back", () => {
    const dir = scratch();
    const path = join(dir, ".aicsession");
    writeFileSync(
      path,
      JSON.stringify({
        aic_session_version: 1,
        step_count: 4,
        usage: { input_tokens: 10, output_tokens: 2, cached_tokens: 1, billable_tokens: 11 },
        messages: [
          { role: "system", content: "s" },
          { role: "user", content: "old task" },
          { role: "assistant", content: null, tool_calls: [toolCall("a")] },
          { role: "tool", tool_call_id: "a", content: "ok" },
        ],
      }),
    );
    const parsed = parseArgs(
      ["--nogui", "--api-base", META.apiBase, "--model", META.model, "--session", path, "task"],
      {},
    );
    if (parsed.kind !== "run") throw new Error(`parseArgs gave ${parsed.kind}`);
    const sink = recorder();
    const store = claim(path, sink);
    const sandbox: Sandbox = sandboxOff("unit test");
    const agent = new Agent({
      config: parsed.config,
      sink,
      approve: async () => ({ kind: "approve" }),
      sessionId: () => store.sessionId,
      attended: false,
      sandbox,
      systemPrompt: SYSTEM,
      session: store,
      outputs: new OutputStore(false, "unit"),
      workDir: HeldDirectory.open(dir),
      canAnswerInput: () => false,
      jobs: new JobTable(() => {}, new OutputStore(false, "unit-jobs"), 1_000_000),
      rules: CommandRules.load({ rules: undefined }),
    });
    agent.restore(store.load(SYSTEM));
    expect(agent.messages).toHaveLength(4);

    agent.clear();

    const doc = JSON.parse(readFileSync(path, "utf8"));
    expect(doc.reason).toBe("cleared");
    expect(doc.messages).toEqual([]);
    expect(doc.step_count).toBe(0);
    expect(doc.usage).toEqual({ input_tokens: 0, output_tokens: 0, cached_tokens: 0, billable_tokens: 0 });
    store.release();
    const next = claim(path).load(SYSTEM);
    expect(next.messages?.filter((m) => m.role !== "system")).toEqual([]);
    expect(next.stepCount).toBe(0);
  });
});

// ---------------------------------------------------------------------------------------------
// Fuzz

/** mulberry32: small, fast, and the same sequence for the same seed everywhere. */
function prng(seed: number) {
  let a = seed >>> 0;
  const next = () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const int = (n: number) => Math.floor(next() * n);
  const pick = <T>(items: readonly T[]): T => items[int(items.length)]!;
  return { next, int, pick };
}
type Rng = ReturnType<typeof prng>;

/** A realistic file: two turns with commands (one with two calls), non-ASCII output, a summary, an extra key. */
function seedDocument(): any {
  return {
    aic_session_version: 1,
    session_id: "20250101_120000",
    updated_at: "2025-01-01T12:03:00",
    reason: "tool_result",
    model: "qwen3-coder",
    api_base: "http://127.0.0.1:8000/v1",
    cwd: "/home/dev/project",
    instance_number: 1,
    step_count: 3,
    usage: { input_tokens: 5123, output_tokens: 311, cached_tokens: 2048, billable_tokens: 3386 },
    note: "added by hand",
    messages: [
      {
        role: "system",
        content: "You are an autonomous engineer.\n\n[Prior conversation summary]\nThe user wants the tests fixed.",
      },
      { role: "user", content: "Fix the failing test in src/parse.ts — «quotes» and emoji 🚀 included" },
      {
        role: "assistant",
        content: "1. Run the tests\n2. Read the failure",
        tool_calls: [toolCall("call_1", "npm test 2>&1 | tail -20")],
      },
      {
        role: "tool",
        tool_call_id: "call_1",
        content:
          "Command executed with exit code 1.\nOutput:\n✗ parse › handles «quotes»\n  expected 'ü' got 'u'\n1 failed, 41 passed",
      },
      {
        role: "assistant",
        content: null,
        tool_calls: [
          toolCall("call_2", "sed -n '1,40p' src/parse.ts"),
          toolCall("call_3", "grep -n normalize src/*.ts"),
        ],
      },
      {
        role: "tool",
        tool_call_id: "call_2",
        content:
          "Command executed with exit code 0.\nOutput:\nexport function parse(s: string) {\n  return s.normalize('NFD');\n}",
      },
      {
        role: "tool",
        tool_call_id: "call_3",
        content: "Command executed with exit code 0.\nOutput:\nsrc/parse.ts:2:  return s.normalize('NFD');",
      },
      { role: "user", content: "[Suggestion from user] keep the public API unchanged" },
      {
        role: "assistant",
        content: null,
        tool_calls: [toolCall("call_4", "sed -i 's/NFD/NFC/' src/parse.ts && npm test")],
      },
      { role: "tool", tool_call_id: "call_4", content: "Command executed with exit code 0.\nOutput:\n42 passed" },
    ],
  };
}

const ROLES = ["system", "user", "assistant", "tool", "bogus", ""];
const GARBAGE = [
  '"',
  "{",
  "}",
  "[",
  "]",
  ",",
  ":",
  "\\",
  "\u0000",
  "null",
  "💥",
  "\ud800",
  "\n",
  "true,",
  '"role":',
  "]]}}",
  "\\u00",
  "NaN",
];

type Doc = any;
/** Mutations of the parsed document; each returns the new document. */
const STRUCTURAL: Record<string, (doc: Doc, r: Rng) => Doc> = {
  "swap-roles": (doc, r) => {
    const ms = doc?.messages;
    if (!Array.isArray(ms) || ms.length < 2) return doc;
    const i = r.int(ms.length),
      j = r.int(ms.length);
    if (ms[i] && ms[j] && typeof ms[i] === "object" && typeof ms[j] === "object")
      [ms[i].role, ms[j].role] = [ms[j].role, ms[i].role];
    return doc;
  },
  "set-role": (doc, r) => {
    const m = randomMessage(doc, r);
    if (m) m.role = r.pick(ROLES);
    return doc;
  },
  "messages-not-a-list": (doc, r) => {
    if (doc && typeof doc === "object" && !Array.isArray(doc))
      doc.messages = r.pick([42, "messages", { 0: { role: "user" } }, null, true, -1.5]);
    return doc;
  },
  "drop-field": (doc, r) => {
    const m = randomMessage(doc, r);
    const choice = r.int(3);
    if (choice === 0 && m) delete m[r.pick(["role", "content", "tool_call_id", "tool_calls"])];
    else if (choice === 1 && m && Array.isArray(m.tool_calls) && m.tool_calls.length) {
      const c = r.pick(m.tool_calls) as any;
      if (c && typeof c === "object") delete c[r.pick(["id", "function", "type"])];
    } else if (doc && typeof doc === "object" && !Array.isArray(doc))
      delete doc[r.pick(Object.keys(doc).length ? Object.keys(doc) : ["messages"])];
    return doc;
  },
  "content-wrong-type": (doc, r) => {
    const m = randomMessage(doc, r);
    if (m) m.content = r.pick([{}, [1, 2], 42, true, [{ type: "text", text: "part" }], { nested: { deeper: [null] } }]);
    return doc;
  },
  "tool_calls-wrong-type": (doc, r) => {
    const m = randomMessage(doc, r);
    if (m)
      m.tool_calls = r.pick(["abc", 5, {}, [null], [42], [{ id: 7 }], [{}], null, [[toolCall("x")]], { length: 1 }]);
    return doc;
  },
  "tool_call_id-wrong-type": (doc, r) => {
    const m = randomMessage(doc, r);
    if (m) m.tool_call_id = r.pick([5, null, {}, ["call_1"], true]);
    return doc;
  },
  "role-wrong-type": (doc, r) => {
    const m = randomMessage(doc, r);
    if (m) m.role = r.pick([7, null, ["user"], {}, true]);
    return doc;
  },
  "fields-wrong-type": (doc, r) => {
    if (doc && typeof doc === "object" && !Array.isArray(doc)) {
      const key = r.pick(["usage", "step_count", "session_id", "instance_number", "aic_session_version", "reason"]);
      doc[key] = r.pick([null, "12", -3, 1e308, [], { input_tokens: "many" }, true]);
    }
    return doc;
  },
  "null-entry": (doc, r) => insertEntry(doc, r, null),
  "non-object-entry": (doc, r) => insertEntry(doc, r, r.pick([42, "a string", [], true, [{ role: "user" }]])),
  "delete-message": (doc, r) => {
    if (Array.isArray(doc?.messages) && doc.messages.length) doc.messages.splice(r.int(doc.messages.length), 1);
    return doc;
  },
  "duplicate-message": (doc, r) => {
    if (Array.isArray(doc?.messages) && doc.messages.length) {
      const i = r.int(doc.messages.length);
      doc.messages.splice(i, 0, structuredClone(doc.messages[i]));
    }
    return doc;
  },
  shuffle: (doc, r) => {
    if (Array.isArray(doc?.messages)) doc.messages.sort(() => r.next() - 0.5);
    return doc;
  },
  "bare-array": (doc) => (Array.isArray(doc?.messages) ? doc.messages : doc),
  "top-level-scalar": (_doc, r) => r.pick([42, "a string", null, true, []]),
};

function randomMessage(doc: Doc, r: Rng): any {
  const ms = Array.isArray(doc) ? doc : doc?.messages;
  if (!Array.isArray(ms) || !ms.length) return undefined;
  const m = ms[r.int(ms.length)];
  return m && typeof m === "object" && !Array.isArray(m) ? m : undefined;
}

function insertEntry(doc: Doc, r: Rng, entry: unknown): Doc {
  const ms = Array.isArray(doc) ? doc : doc?.messages;
  if (Array.isArray(ms)) ms.splice(r.int(ms.length + 1), 0, entry);
  return doc;
}

/** Mutations of the bytes: what a crash mid-write, a bad editor or a bad paste leaves. */
const TEXTUAL: Record<string, (bytes: Buffer, r: Rng) => Buffer> = {
  "delete-char": (b, r) => {
    const s = b.toString("utf8");
    const i = r.int(s.length);
    return Buffer.from(s.slice(0, i) + s.slice(i + 1), "utf8");
  },
  "insert-garbage": (b, r) => {
    const s = b.toString("utf8");
    const i = r.int(s.length + 1);
    return Buffer.from(s.slice(0, i) + r.pick(GARBAGE) + s.slice(i), "utf8");
  },
  "truncate-bytes": (b, r) => b.subarray(0, r.int(b.length)),
  "flip-byte": (b, r) => {
    const copy = Buffer.from(b);
    if (copy.length) copy[r.int(copy.length)] = r.int(256);
    return copy;
  },
};

interface FuzzCase {
  index: number;
  kinds: string[];
  bytes: Buffer;
}

/** Up to three structural mutations of the seed document, then (often, and always after none) one textual one. */
function fuzzCases(seed: number, count: number): FuzzCase[] {
  const r = prng(seed);
  const structural = Object.keys(STRUCTURAL);
  const textual = Object.keys(TEXTUAL);
  const cases: FuzzCase[] = [];
  for (let index = 0; index < count; index++) {
    const kinds: string[] = [];
    let doc = seedDocument();
    const rounds = r.int(3) + (r.next() < 0.3 ? 0 : 1);
    for (let k = 0; k < rounds; k++) {
      const kind = r.pick(structural);
      kinds.push(kind);
      doc = STRUCTURAL[kind]!(doc, r);
    }
    let bytes: Buffer = Buffer.from(JSON.stringify(doc, null, r.next() < 0.5 ? 2 : 0) ?? "undefined", "utf8");
    if (kinds.length === 0 || r.next() < 0.45) {
      const kind = r.pick(textual);
      kinds.push(kind);
      bytes = TEXTUAL[kind]!(bytes, r);
    }
    cases.push({ index, kinds, bytes });
  }
  return cases;
}

const FUZZ_SEED = 0x5e55_1017;
const FUZZ_COUNT = 1500;

describe("fuzzed session files (loading)", () => {
  const cases = fuzzCases(FUZZ_SEED, FUZZ_COUNT);
  const outcome = new Map<number, "loaded" | "moved" | "untouched">();
  /** Whether the bytes are a JSON document whose aic_session_version is a number above 1. */
  const isNewerFormat = (bytes: Buffer): boolean => {
    try {
      const version = JSON.parse(bytes.toString("utf8"))?.aic_session_version;
      return typeof version === "number" && version > 1;
    } catch {
      return false;
    }
  };

  // Never throws; either a history the API accepts, or the file moved aside holding its original bytes.
  test(`${FUZZ_COUNT} mutated files: load never throws and never loses the file`, () => {
    const dir = scratch("aic-fuzz-");
    const failures: string[] = [];
    for (const c of cases) {
      const name = `case-${c.index}.json`;
      const path = join(dir, name);
      writeFileSync(path, c.bytes);
      const store = SessionStore.claim(path, META, recorder());
      let loaded: ReturnType<SessionStore["load"]> | undefined;
      try {
        loaded = store.load(SYSTEM);
      } catch (error) {
        failures.push(`${name} [${c.kinds}]: load threw ${(error as Error).stack}`);
        continue;
      } finally {
        store.release();
      }
      const aside = readdirSync(dir).filter((n) => n.startsWith(`${name}.corrupt.`));
      if (loaded.messages) {
        outcome.set(c.index, "loaded");
        const problems = loadedHistoryProblems(loaded.messages);
        if (problems.length) failures.push(`${name} [${c.kinds}]: ${problems.join("; ")}`);
        if (aside.length) failures.push(`${name} [${c.kinds}]: loaded and also moved aside`);
      } else if (isNewerFormat(c.bytes)) {
        // A file claiming a newer format is neither read nor moved nor rewritten.
        outcome.set(c.index, "untouched");
        if (aside.length) failures.push(`${name} [${c.kinds}]: a newer-format file was moved aside`);
        if (!existsSync(path) || !readFileSync(path).equals(c.bytes))
          failures.push(`${name} [${c.kinds}]: a newer-format file was changed`);
      } else {
        // Not loaded: left where it is, byte for byte, with the place it breaks.
        outcome.set(c.index, "moved");
        if (aside.length) failures.push(`${name} [${c.kinds}]: no messages, and ${aside.length} files moved aside`);
        if (!existsSync(path) || !readFileSync(path).equals(c.bytes))
          failures.push(`${name} [${c.kinds}]: not loaded, and no longer as it was`);
        if (!/:\d+:\d+: .* — fix it and run aic again/.test(loaded.broken ?? ""))
          failures.push(`${name} [${c.kinds}]: not loaded, and no line:column said so (${loaded.broken})`);
      }
    }
    expect(failures.slice(0, 15)).toEqual([]);
    expect(failures).toHaveLength(0);
    // Both paths were exercised many times over.
    const loaded = [...outcome.values()].filter((o) => o === "loaded").length;
    expect(loaded).toBeGreaterThan(FUZZ_COUNT / 5);
    const moved = [...outcome.values()].filter((o) => o === "moved").length;
    expect(moved).toBeGreaterThan(FUZZ_COUNT / 5);
  });

  // The same files through the real binary: a sample covering every mutation kind, loaded or not; aic never
  // crashes, and either completes with a well-formed history or stops with one line before any request.
  test("a sample of 20 mutated files run through dist/aic: a well-formed request, or exit 2 and no request", async () => {
    expect(outcome.size).toBe(FUZZ_COUNT); // needs the test above
    const sample: FuzzCase[] = [];
    const add = (c: FuzzCase | undefined) => c && !sample.includes(c) && sample.push(c);
    for (const kind of [...Object.keys(STRUCTURAL), ...Object.keys(TEXTUAL)])
      add(
        cases.find((c) => c.kinds.includes(kind) && outcome.get(c.index) === "loaded") ??
          cases.find((c) => c.kinds.includes(kind)),
      );
    for (const want of ["moved", "loaded"] as const)
      for (const c of cases)
        if (
          sample.length < 20 &&
          outcome.get(c.index) === want &&
          sample.filter((s) => outcome.get(s.index) === want).length < 10
        )
          add(c);
    expect(sample.length).toBeGreaterThanOrEqual(20);

    const failures: string[] = [];
    const runOne = async (c: FuzzCase) => {
      const cwd = scratch();
      writeFileSync(join(cwd, "sess.json"), c.bytes);
      const srv: FakeServer = startFakeServer({ turns: [] });
      try {
        const run = await runAic(
          [...headless(srv.url, "test-model", "--auto-approve", "--session", "sess.json"), "carry on"],
          {
            cwd,
            killAfterMs: 60_000,
          },
        );
        const label = `case-${c.index} [${c.kinds}] (${outcome.get(c.index)})`;
        const sent = srv.requests[0]?.body?.messages;
        if (outcome.get(c.index) === "moved") {
          // A file that does not load: exit 2 with one line, no request, the file as it was.
          if (run.code !== 2 || srv.requests.length || run.stderr.trim().split("\n").length !== 1)
            failures.push(`${label}: exit ${run.code}, ${srv.requests.length} requests: ${run.stderr.trim()}`);
          if (!readFileSync(join(cwd, "sess.json")).equals(c.bytes)) failures.push(`${label}: the file changed`);
        } else if (run.code !== 0)
          failures.push(`${label}: exit ${run.code}: ${run.stderr.trim().split("\n").slice(-3).join(" | ")}`);
        else if (/internal error|unexpected failure/i.test(run.stderr)) failures.push(`${label}: ${run.stderr}`);
        else {
          const problems = loadedHistoryProblems(sent);
          if (problems.length) failures.push(`${label}: sent ${problems.join("; ")}`);
          if (JSON.stringify(sent?.at(-1)) !== JSON.stringify({ role: "user", content: "carry on" }))
            failures.push(`${label}: the request is not last`);
        }
      } finally {
        srv.close();
      }
    };
    const queue = [...sample];
    await Promise.all(
      Array.from({ length: 4 }, async () => {
        for (let c = queue.shift(); c; c = queue.shift()) await runOne(c);
      }),
    );
    expect(failures).toEqual([]);
  }, 180_000);
});

// The line left on the terminal after the TUI closes names how to continue: a second instance (.aicsession2)
// is not what a plain `aic` in that directory opens, so it is named by path (a new user was sent to the first).
test("the quit line of a second instance names its session file", () => {
  const dir = scratch("aic-exit-line-");
  const process_ = { cwd: process.cwd() };
  process.chdir(dir);
  try {
    const parsed = parseArgs(["--api-base", META.apiBase, "--model", META.model, "task"], {});
    if (parsed.kind !== "run") throw new Error(`parseArgs gave ${parsed.kind}`);
    const first = claim(join(dir, ".aicsession"));
    const second = claim(join(dir, ".aicsession"));
    expect(first.instanceNumber).toBe(1);
    expect(second.instanceNumber).toBe(2);
    expect(exitLine(first, parsed.config)).toContain("to continue it: cd ");
    expect(exitLine(second, parsed.config)).toContain(`to continue it: aic --session ${join(dir, ".aicsession2")}`);
  } finally {
    process.chdir(process_.cwd);
  }
});
