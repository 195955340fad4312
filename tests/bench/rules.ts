/**
 * What the command rules cost per command (README: "Command rules"): judging
 * a command line (parsing it, looking through wrappers, reading the scripts it
 * names, checking writes and the read-only list) for a mix of the lines models
 * write, with and without a rules file; and what enforcing `deny rm *` at exec
 * adds to starting the sandbox launcher (the Landlock rules that make the
 * binary neither executable nor readable), measured as whole one-step runs of
 * dist/aic.
 */
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { judgeCommand, parseRuleLines } from "../../aic.ts";
import { scratch } from "../helpers.ts";
import { type Benchmark, type Metric, expectRun, median, scriptedCommands, timeAic, unattended } from "./lib.ts";

const LINES = [
  "ls -la",
  "cat src/main.ts | head -40",
  "grep -rn 'TODO' src | wc -l",
  "git status --short && git diff --stat",
  "npm test -- --watch=false 2>&1 | tail -30",
  "cd web && npm run build > build.log 2>&1; echo $?",
  "python3 -m pytest -q tests/test_api.py -k login",
  "find . -name '*.py' -newer setup.py -exec grep -l requests {} +",
  "sed -i 's/old_name/new_name/g' src/app.py && git diff",
  'for f in src/*.ts; do wc -l "$f"; done | sort -n | tail -5',
  "cat > notes.md <<'EOF'\n# Notes\n- one\n- two\nEOF",
  "./scripts/check.sh && echo ok",
];
const RULES = "allow git status *\nallow npm test *\ndeny rm *\ndeny git push *  # pushing needs a person\n";
const REPEATS = 200;
const RUNS = 9;

export const rules: Benchmark = {
  name: "rules",
  description: "judging a command line against the rules, and the launcher start-up with a deny enforced at exec",
  async run(ctx) {
    const dir = scratch("aic-bench-rules-");
    mkdirSync(join(dir, "scripts"));
    writeFileSync(join(dir, "scripts", "check.sh"), "#!/bin/sh\nset -e\nnpm run lint\ngrep -q version package.json\n");
    const withRules = parseRuleLines(RULES).rules;
    const judge = (rulesInForce: typeof withRules) => {
      const times: number[] = [];
      for (let r = 0; r < REPEATS; r++)
        for (const line of LINES) {
          const t = performance.now();
          judgeCommand(rulesInForce, line, { cwd: dir, root: dir });
          times.push(performance.now() - t);
        }
      return times;
    };
    judge(withRules); // warm the parser
    const ruled = judge(withRules);
    const bare = judge([]);
    ctx.log("rules: timing one-step runs with and without deny rm *");
    const oneStep = async (rulesFile: string | undefined) => {
      const cwd = scratch("aic-bench-rules-run-");
      if (rulesFile) writeFileSync(join(cwd, ".aicrules"), rulesFile);
      const times: number[] = [];
      for (let i = 0; i < RUNS; i++) {
        const srv = scriptedCommands((index) => (index === 0 ? "true" : undefined));
        try {
          const run = await timeAic(unattended(srv.url, "--no-checkpoints", "go"), { cwd });
          expectRun("a one-step run", run, srv, { code: 0, requests: 2 });
          times.push(run.ms);
        } finally {
          srv.close();
        }
      }
      return median(times);
    };
    const steps = { plain: await oneStep(undefined), enforced: await oneStep("deny rm *\n") };
    const metrics: Metric[] = [
      {
        name: "judging a command line, with rules",
        value: median(ruled),
        unit: "ms",
        target: 1,
        note: `median of ${ruled.length} (${LINES.length} lines × ${REPEATS}); 99th ${[...ruled].sort((a, b) => a - b)[Math.floor(ruled.length * 0.99)]!.toFixed(3)} ms`,
      },
      {
        name: "judging a command line, no rules file",
        value: median(bare),
        unit: "ms",
        note: "the read-only judgement still parses",
      },
      { name: "one-step run, no rules", value: steps.plain, unit: "ms", note: `median of ${RUNS} whole runs` },
      {
        name: "one-step run, deny rm * enforced at exec",
        value: steps.enforced,
        unit: "ms",
        note: "the launcher's extra Landlock rules",
      },
      { name: "enforcement at exec, added", value: steps.enforced - steps.plain, unit: "ms" },
    ];
    return metrics;
  },
};
