/**
 * The flag table is checked against Config by the compiler: each line below
 * is a flag whose kind does not fit its field, and `tsc` (run by
 * tests/build.test.ts, "aic.ts and the tests type-check") fails if any of them
 * compiles. Nothing here runs.
 */
import type { FlagSpec } from "../aic.ts";

export const wrongKinds: FlagSpec[] = [
  // @ts-expect-error a switch cannot fill a number
  { name: "--timeout", kind: "bool", key: "timeoutSec", help: "" },
  // @ts-expect-error an optional number cannot fill a field that always has one
  { name: "--max-steps", kind: "limit", key: "maxSteps", help: "" },
  // @ts-expect-error optional text cannot fill the model name, which must be given
  { name: "--model", kind: "text", key: "model", help: "" },
  // @ts-expect-error a path list cannot fill the headers
  { name: "--header", kind: "paths", key: "headers", help: "" },
  // @ts-expect-error a choice must be one of the field's own words
  { name: "--network", kind: "choice", key: "network", choices: ["on", "sometimes"], help: "" },
  // @ts-expect-error a choice flag needs a field of fixed words
  { name: "--session", kind: "choice", key: "session", choices: ["a"], help: "" },
];

/** And the right kinds compile. */
export const rightKinds: FlagSpec[] = [
  { name: "--timeout", kind: "count", key: "timeoutSec", default: "120", help: "" },
  { name: "--max-time", kind: "limit", key: "maxTime", help: "" },
  { name: "--network", kind: "choice", key: "network", choices: ["on", "off"], help: "" },
];
