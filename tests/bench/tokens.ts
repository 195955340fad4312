/**
 * Token accounting: what aic's TokenCounter costs per loop step as the history
 * grows, and how far its estimate is from the server's count before and after
 * calibration (README: "Context budget and compression").
 *
 * A history grows by one assistant call and one ~3 KB tool answer per step, as
 * in a long run. At every step the counter estimates the whole history, as
 * aic does before each model call; thanks to the per-message cache only the
 * two new messages are tokenised, so the cost at step 400 should match the
 * cost at step 10. The "server" count is the fake OpenAI server's own formula
 * (tiktoken × 1.3), computed in this process.
 */
import { TokenCounter, type Message } from "../../aic.ts";
import { countPromptTokens } from "../fake-openai.ts";
import { type Benchmark, type Metric, median } from "./lib.ts";

const STEPS = 400;
const EARLY = 10;
const LATE = STEPS;
/** Steps timed around each point (the point and the 2 on either side), per repeat. */
const HALF_WINDOW = 2;
const REPEATS = 7;
/** A step's accounting should cost no more late in a run than early (flat), within noise. */
const FLATNESS_TARGET = 1.5;
const INFLATION = 1.3;

/** A ~3 KB tool answer, different every step: file paths, numbers and code-like text. */
function toolOutput(step: number): string {
  const lines = ["Command executed with exit code 0.", "Output:"];
  for (let r = 0; lines.join("\n").length < 3000; r++) {
    lines.push(
      `src/module_${step}/part_${r}.ts:${(step * 31 + r * 17) % 997}: const value${r} = compute(${step}, ${r * 7919}); // ok`,
    );
  }
  return lines.join("\n");
}

function stepMessages(step: number): Message[] {
  const id = `call_${step}_0`;
  return [
    {
      role: "assistant",
      content: null,
      tool_calls: [
        {
          id,
          type: "function",
          function: {
            name: "execute_bash",
            arguments: JSON.stringify({ command: `grep -rn compute src/module_${step}` }),
          },
        },
      ],
    },
    { role: "tool", tool_call_id: id, content: toolOutput(step) },
  ];
}

function initialHistory(): Message[] {
  return [
    { role: "system", content: "You are an autonomous engineer working in a Linux shell. ".repeat(40) },
    { role: "user", content: "find every call of compute() in the project and list them" },
  ];
}

const serverCount = (messages: Message[]) => Math.ceil(countPromptTokens(messages) * INFLATION);
const timed = (fn: () => void) => {
  const started = performance.now();
  fn();
  return performance.now() - started;
};

interface Growth {
  /** estimate() time at the steps around EARLY and LATE, just after the step's messages were added. */
  early: number[];
  late: number[];
  /** estimate() again with nothing new (pure cache lookups), at EARLY and LATE. */
  earlyRecount: number;
  lateRecount: number;
  history: Message[];
}

/** One long run's worth of history, estimating at every step as aic does, with a fresh counter (empty cache). */
function grow(counter: TokenCounter): Growth {
  const history = initialHistory();
  const out: Growth = { early: [], late: [], earlyRecount: 0, lateRecount: 0, history };
  counter.estimate(history);
  const recount = () => median(Array.from({ length: 21 }, () => timed(() => counter.estimate(history))));
  for (let step = 1; step <= STEPS; step++) {
    history.push(...stepMessages(step));
    const ms = timed(() => counter.estimate(history));
    if (Math.abs(step - EARLY) <= HALF_WINDOW) out.early.push(ms);
    if (Math.abs(step - LATE) <= HALF_WINDOW) out.late.push(ms);
    if (step === EARLY) out.earlyRecount = recount();
    if (step === LATE) out.lateRecount = recount();
  }
  return out;
}

/** Estimate vs the server's count at `step`: uncalibrated, and calibrated on the step before (as aic does). */
function accuracy(step: number, counter: TokenCounter) {
  const history = initialHistory();
  for (let s = 1; s < step; s++) history.push(...stepMessages(s));
  // The previous call: aic sent `history`, the server answered with its prompt_tokens.
  const rawSent = counter.countRaw(history);
  const previousServer = serverCount(history);
  history.push(...stepMessages(step));
  const server = serverCount(history);
  counter.ratio = 1;
  const before = counter.estimate(history);
  counter.calibrate(rawSent, previousServer);
  const after = counter.estimate(history);
  return { server, before, after };
}

const pct = (estimate: number, server: number) => `${(((estimate - server) / server) * 100).toFixed(2)}%`;

export const tokens: Benchmark = {
  name: "tokens",
  description: `TokenCounter.estimate() per step at step ${EARLY} vs ${LATE} of a history growing ~3 KB a step, and its error vs the server's count`,
  async run(ctx) {
    // TokenCounter.create() loads tiktoken once per process; later counters share it and start with an empty cache.
    const fresh = () => TokenCounter.create();
    ctx.log("tokens: warm-up run");
    grow(await fresh());
    const runs: Growth[] = [];
    for (let r = 1; r <= REPEATS; r++) {
      ctx.log(`tokens: ${STEPS}-step history, repeat ${r}/${REPEATS}`);
      runs.push(grow(await fresh()));
    }
    const early = median(runs.flatMap((g) => g.early));
    const late = median(runs.flatMap((g) => g.late));
    const history = runs[0]!.history;
    const cold: number[] = [];
    for (let r = 0; r < 3; r++) {
      const counter = await fresh();
      cold.push(timed(() => counter.countRaw(history)));
    }
    const uncached = median(cold);

    ctx.log("tokens: estimate vs server count");
    const accEarly = accuracy(EARLY, await fresh());
    const accLate = accuracy(LATE, await fresh());
    const errorMetric = (label: string, estimate: number, server: number): Metric => ({
      name: label,
      value: Math.abs(estimate - server),
      unit: "count",
      note: `${pct(estimate, server)} (estimate ${estimate}, server ${server} tokens)`,
    });

    return [
      {
        name: `estimate() per step, step ${EARLY} (median)`,
        value: early,
        unit: "ms",
        note: `steps ${EARLY - HALF_WINDOW}–${EARLY + HALF_WINDOW} × ${REPEATS} repeats; ${(EARLY + 1) * 2} messages`,
      },
      {
        name: `estimate() per step, step ${LATE} (median)`,
        value: late,
        unit: "ms",
        note: `${(LATE + 1) * 2} messages`,
      },
      {
        name: `per-step cost, step ${LATE} / step ${EARLY}`,
        value: late / early,
        unit: "x",
        target: FLATNESS_TARGET,
        note: "flat when ≈ 1",
      },
      {
        name: `estimate() with nothing new, step ${EARLY}`,
        value: median(runs.map((g) => g.earlyRecount)),
        unit: "ms",
        note: "cache lookups only",
      },
      {
        name: `estimate() with nothing new, step ${LATE}`,
        value: median(runs.map((g) => g.lateRecount)),
        unit: "ms",
        note: "cache lookups only",
      },
      {
        name: `uncached count of the step-${LATE} history`,
        value: uncached,
        unit: "ms",
        note: `what every step would cost without the cache (${(uncached / late).toFixed(0)}× the cached step)`,
      },
      errorMetric(`estimate error before calibrate(), step ${EARLY}`, accEarly.before, accEarly.server),
      errorMetric(`estimate error after calibrate(), step ${EARLY}`, accEarly.after, accEarly.server),
      errorMetric(`estimate error before calibrate(), step ${LATE}`, accLate.before, accLate.server),
      errorMetric(`estimate error after calibrate(), step ${LATE}`, accLate.after, accLate.server),
    ];
  },
};
