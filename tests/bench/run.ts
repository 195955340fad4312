/**
 * Benchmark runner: `bun run bench` (builds first) or, against the dist/aic
 * already built, `bun run tests/bench/run.ts [name…]` to run only some.
 * `--list` prints the names; a group name (`field`: the field-* figures, see
 * registry.ts) stands for its benchmarks.
 *
 * Prints one table (measured value, target, PASS/MISS and measured/target; SKIP
 * or INVALID when a figure could not be measured as defined) and
 * writes the same figures as JSON to /tmp/aic-bench.json (outside the
 * repository, so it is never committed by accident). Exits 0 whatever the
 * figures: benchmarks inform, they are not tests. A benchmark that could not
 * measure (aic failed, say) is reported as ERROR and the others still run.
 * Only an unknown benchmark name is an error (exit 2).
 */
import { statSync, writeFileSync } from "node:fs";
import { cpus, loadavg } from "node:os";
import { AIC, type Benchmark, type Metric } from "./lib.ts";
import { BENCHMARKS, GROUPS } from "./registry.ts";

const JSON_OUT = "/tmp/aic-bench.json";

/** Size and modification time of dist/aic, to notice a rebuild in the middle of a run. */
function binaryIdentity(): string {
  try {
    const st = statSync(AIC);
    return `${st.size} bytes, built ${st.mtime.toISOString()}`;
  } catch {
    return "missing";
  }
}

interface Outcome {
  benchmark: string;
  description: string;
  seconds: number;
  metrics: Metric[];
  error?: string;
}

function select(names: string[]): Benchmark[] {
  if (names.length === 0) return [...BENCHMARKS];
  // A group name stands for its benchmarks.
  names = names.flatMap((n) => GROUPS[n] ?? [n]);
  const unknown = names.filter((n) => !BENCHMARKS.some((b) => b.name === n));
  if (unknown.length) {
    console.error(
      `unknown benchmark(s): ${unknown.join(", ")}; known: ${BENCHMARKS.map((b) => b.name).join(", ")}; groups: ${Object.keys(GROUPS).join(", ")}`,
    );
    process.exit(2);
  }
  return BENCHMARKS.filter((b) => names.includes(b.name));
}

function verdict(m: Metric): { status: "PASS" | "MISS" | "info" | "SKIP" | "INVALID"; ratio?: number } {
  if (m.status) return { status: m.status };
  if (m.target === undefined) return { status: "info" };
  // A target of 0 (nothing may be lost) has no meaningful ratio.
  const ratio = m.target === 0 ? undefined : m.value / m.target;
  return { status: m.value <= m.target ? "PASS" : "MISS", ratio };
}

function fmt(v: number, unit: Metric["unit"]): string {
  if (!Number.isFinite(v)) return "—";
  if (unit === "count") return String(Math.round(v));
  return `${v.toFixed(unit === "x" || Math.abs(v) < 10 ? 2 : 1)} ${unit}`;
}

function printTable(outcomes: Outcome[]): void {
  const rows: string[][] = [["benchmark", "metric", "measured", "target", "result", "ratio", "note"]];
  for (const o of outcomes) {
    if (o.error) rows.push([o.benchmark, "—", "—", "—", "ERROR", "—", o.error.split("\n")[0]!]);
    for (const m of o.metrics) {
      const v = verdict(m);
      rows.push([
        o.benchmark,
        m.name,
        fmt(m.value, m.unit),
        m.target === undefined ? "" : `≤ ${fmt(m.target, m.unit)}`,
        v.status,
        v.ratio === undefined ? "" : `${v.ratio.toFixed(2)}×`,
        m.note ?? "",
      ]);
    }
  }
  const widths = rows[0]!.map((_, col) => Math.max(...rows.map((r) => (col === 6 ? 0 : r[col]!.length))));
  const line = (r: string[]) =>
    r
      .map((cell, col) =>
        col === 6
          ? cell
          : col === 2 || col === 3 || col === 5
            ? cell.padStart(widths[col]!)
            : cell.padEnd(widths[col]!),
      )
      .join("  ")
      .trimEnd();
  console.log(line(rows[0]!));
  console.log(widths.map((w, col) => "─".repeat(col === 6 ? 4 : w)).join("  "));
  let previous = "";
  for (const r of rows.slice(1)) {
    console.log(line([r[0] === previous ? "" : r[0]!, ...r.slice(1)]));
    previous = r[0]!;
  }
}

async function main(): Promise<void> {
  const args = process.argv.slice(2);
  if (args.includes("--list")) {
    for (const b of BENCHMARKS) console.log(`${b.name.padEnd(18)} ${b.description}`);
    for (const [g, members] of Object.entries(GROUPS)) console.log(`${g.padEnd(18)} group: ${members.join(" ")}`);
    return;
  }
  const chosen = select(args);
  if (binaryIdentity() === "missing") {
    console.error(`${AIC} is missing: run \`bun run bench\` (builds first) or \`bun run build\``);
    return;
  }
  const log = (message: string) => console.error(`  … ${message}`);
  const binaryBefore = binaryIdentity();
  console.error(
    `aic benchmarks against ${AIC} (${binaryBefore}) · ${cpus().length} CPUs · load ${loadavg()
      .map((l) => l.toFixed(2))
      .join(" ")}`,
  );

  const outcomes: Outcome[] = [];
  for (const b of chosen) {
    const started = performance.now();
    const outcome: Outcome = { benchmark: b.name, description: b.description, seconds: 0, metrics: [] };
    try {
      outcome.metrics = await b.run({ log });
    } catch (error) {
      outcome.error = (error as Error)?.stack ?? String(error);
      console.error(`${b.name}: ERROR: ${outcome.error}`);
    }
    outcome.seconds = (performance.now() - started) / 1000;
    outcomes.push(outcome);
  }

  const binaryAfter = binaryIdentity();
  console.log();
  console.log(`dist/aic: ${binaryBefore}`);
  printTable(outcomes);
  console.log();
  if (binaryAfter !== binaryBefore)
    console.log(
      `WARNING: dist/aic was rebuilt during the run (now ${binaryAfter}); the figures mix two builds, run again (the field-* figures ran a copy taken when the first of them started).`,
    );
  console.log(
    `Load average after: ${loadavg()
      .map((l) => l.toFixed(2))
      .join(" ")} (figures are noisy on a busy machine; compare ratios, rerun a subset by name).`,
  );

  const summary = {
    generated_at: new Date().toISOString(),
    aic: AIC,
    binary: binaryBefore,
    rebuilt_during_run: binaryAfter !== binaryBefore,
    bun: Bun.version,
    cpus: cpus().length,
    loadavg: loadavg(),
    benchmarks: outcomes.map((o) => ({
      ...o,
      metrics: o.metrics.map((m) => ({ ...m, ...verdict(m) })),
    })),
  };
  writeFileSync(JSON_OUT, JSON.stringify(summary, null, 2) + "\n");
  console.log(`JSON summary: ${JSON_OUT}`);
}

await main().catch((error) => console.error(`benchmark runner failed: ${(error as Error)?.stack ?? error}`));
process.exit(0);
