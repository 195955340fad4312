/**
 * A validator for ATIF trajectories (the Agent Trajectory Interchange Format of Harbor), for the
 * tests of `aic export --format atif`. No dependency: it interprets the subset of JSON Schema that
 * tests/fixtures/atif-schema.json uses ($ref to "#" and "#/$defs/…", type, enum, const, required,
 * properties, additionalProperties, items, minItems, minimum, anyOf, allOf, not, if/then, format
 * "date-time"), then checks by hand the rules the schema lists under "x-atif-rules", which JSON
 * Schema cannot express (sequential step ids, tool call references, embedded subagent ids).
 *
 * `validateAtif(doc)` returns every error found, each a line `<path>: <what is wrong>` with a path
 * such as `trajectory.steps[2].tool_calls[0].arguments`; an empty list means the document is valid.
 */
import atifSchema from "./fixtures/atif-schema.json";

/** The part of JSON Schema the ATIF schema file uses. */
export interface JsonSchema {
  $ref?: string;
  $defs?: Record<string, JsonSchema>;
  type?: string | string[];
  enum?: unknown[];
  const?: unknown;
  required?: string[];
  properties?: Record<string, JsonSchema>;
  additionalProperties?: boolean | JsonSchema;
  items?: JsonSchema;
  minItems?: number;
  minimum?: number;
  anyOf?: JsonSchema[];
  allOf?: JsonSchema[];
  not?: JsonSchema;
  if?: JsonSchema;
  then?: JsonSchema;
  else?: JsonSchema;
  format?: string;
  [annotation: string]: unknown;
}

export const ATIF_SCHEMA = atifSchema as unknown as JsonSchema;

/** The schema_version values the schema accepts, newest last. */
export const ATIF_VERSIONS: readonly string[] = (ATIF_SCHEMA.properties?.schema_version?.enum ?? []) as string[];

const KEYWORDS_HANDLED = new Set([
  "$schema",
  "$comment",
  "$id",
  "$ref",
  "$defs",
  "title",
  "description",
  "x-atif-rules",
  "type",
  "enum",
  "const",
  "required",
  "properties",
  "additionalProperties",
  "items",
  "minItems",
  "minimum",
  "anyOf",
  "allOf",
  "not",
  "if",
  "then",
  "else",
  "format",
]);

type JsonType = "null" | "boolean" | "integer" | "number" | "string" | "array" | "object";

function typeOf(value: unknown): JsonType | "other" {
  if (value === null) return "null";
  if (Array.isArray(value)) return "array";
  switch (typeof value) {
    case "boolean":
      return "boolean";
    case "number":
      return Number.isInteger(value) ? "integer" : Number.isFinite(value) ? "number" : "other";
    case "string":
      return "string";
    case "object":
      return "object";
    default:
      return "other";
  }
}

function hasType(value: unknown, type: string): boolean {
  const actual = typeOf(value);
  return actual === type || (type === "number" && actual === "integer");
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeOf(value) === "object";
}

function deepEqual(a: unknown, b: unknown): boolean {
  if (a === b) return true;
  if (Array.isArray(a) && Array.isArray(b)) return a.length === b.length && a.every((x, i) => deepEqual(x, b[i]));
  if (isObject(a) && isObject(b)) {
    const keys = Object.keys(a);
    return keys.length === Object.keys(b).length && keys.every((k) => k in b && deepEqual(a[k], b[k]));
  }
  return false;
}

function describe(value: unknown): string {
  const text = JSON.stringify(value);
  return text === undefined ? String(value) : text.length > 60 ? `${text.slice(0, 57)}...` : text;
}

const DAYS_IN_MONTH = [31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];

/**
 * The timestamps Harbor accepts: what Python 3.11's datetime.fromisoformat parses once a trailing
 * "Z" is read as "+00:00" — a calendar date, optionally followed by "T" or a space and a time
 * (hours, then optional minutes, seconds and a fraction), optionally with a UTC offset.
 */
export function isIsoTimestamp(text: string): boolean {
  const match =
    /^(\d{4})-?(\d{2})-?(\d{2})(?:[T ](\d{2})(?::?(\d{2})(?::?(\d{2})(?:[.,]\d{1,9})?)?)?(Z|[+-]\d{2}(?::?\d{2}(?::?\d{2}(?:\.\d{1,6})?)?)?)?)?$/.exec(
      text,
    );
  if (!match) return false;
  const [, year, month, day, hour, minute, second] = match;
  const m = Number(month);
  const d = Number(day);
  if (m < 1 || m > 12 || d < 1 || d > DAYS_IN_MONTH[m - 1]!) return false;
  if (m === 2 && d === 29) {
    const y = Number(year);
    if (!(y % 4 === 0 && (y % 100 !== 0 || y % 400 === 0))) return false;
  }
  if (Number(year) < 1) return false;
  return (
    (hour === undefined || Number(hour) < 24) &&
    (minute === undefined || Number(minute) < 60) &&
    (second === undefined || Number(second) < 60)
  );
}

class SchemaChecker {
  constructor(private readonly root: JsonSchema) {}

  resolve(ref: string): JsonSchema {
    if (ref === "#") return this.root;
    const prefix = "#/$defs/";
    const target = ref.startsWith(prefix) ? this.root.$defs?.[ref.slice(prefix.length)] : undefined;
    if (!target) throw new Error(`atif.ts: unsupported or unknown $ref ${ref}`);
    return target;
  }

  check(value: unknown, schema: JsonSchema, path: string, errors: string[]): void {
    for (const key of Object.keys(schema))
      if (!KEYWORDS_HANDLED.has(key)) throw new Error(`atif.ts: schema keyword ${key} at ${path} is not supported`);
    if (schema.$ref !== undefined) this.check(value, this.resolve(schema.$ref), path, errors);

    if (schema.type !== undefined) {
      const types = Array.isArray(schema.type) ? schema.type : [schema.type];
      if (!types.some((t) => hasType(value, t))) {
        errors.push(
          `${path}: expected ${types.join(" or ")}, got ${value === null ? "null" : `${typeOf(value)} ${describe(value)}`}`,
        );
        return; // the other keywords would only repeat the same mistake
      }
    }
    if (schema.enum !== undefined && !schema.enum.some((v) => deepEqual(v, value)))
      errors.push(`${path}: must be one of ${schema.enum.map((v) => describe(v)).join(", ")}, got ${describe(value)}`);
    if ("const" in schema && !deepEqual(schema.const, value))
      errors.push(`${path}: must be ${describe(schema.const)}, got ${describe(value)}`);
    if (schema.minimum !== undefined && typeof value === "number" && value < schema.minimum)
      errors.push(`${path}: must be at least ${schema.minimum}, got ${value}`);
    if (schema.format === "date-time" && typeof value === "string" && !isIsoTimestamp(value))
      errors.push(`${path}: not an ISO 8601 timestamp: ${describe(value)}`);

    if (Array.isArray(value)) {
      if (schema.minItems !== undefined && value.length < schema.minItems)
        errors.push(`${path}: must have at least ${schema.minItems} item(s), has ${value.length}`);
      if (schema.items)
        for (const [i, item] of value.entries()) this.check(item, schema.items, `${path}[${i}]`, errors);
    }

    if (isObject(value)) {
      for (const key of schema.required ?? [])
        if (!(key in value)) errors.push(`${path}.${key}: required field is missing`);
      for (const [key, item] of Object.entries(value)) {
        const propertySchema = schema.properties?.[key];
        if (propertySchema) this.check(item, propertySchema, `${path}.${key}`, errors);
        else if (schema.additionalProperties === false)
          errors.push(`${path}.${key}: unexpected field (not part of the ATIF schema)`);
        else if (isObject(schema.additionalProperties))
          this.check(item, schema.additionalProperties, `${path}.${key}`, errors);
      }
    }

    if (schema.anyOf) {
      const attempts = schema.anyOf.map((branch) => {
        const branchErrors: string[] = [];
        this.check(value, branch, path, branchErrors);
        return branchErrors;
      });
      if (attempts.every((a) => a.length > 0)) {
        // Report the branch that came closest, which is the one meant in all but odd cases.
        const closest = attempts.reduce((best, a) => (a.length < best.length ? a : best));
        errors.push(...closest);
      }
    }
    for (const branch of schema.allOf ?? []) this.check(value, branch, path, errors);
    if (schema.not && this.passes(value, schema.not, path))
      errors.push(`${path}: must not match ${describe(schema.not)}`);
    if (schema.if) {
      const next = this.passes(value, schema.if, path) ? schema.then : schema.else;
      if (next) this.check(value, next, path, errors);
    }
  }

  passes(value: unknown, schema: JsonSchema, path: string): boolean {
    const scratch: string[] = [];
    this.check(value, schema, path, scratch);
    return scratch.length === 0;
  }
}

/** The rules of "x-atif-rules": run on a document the schema already found well-shaped enough to read. */
function checkCrossFieldRules(doc: unknown, path: string, errors: string[]): void {
  if (!isObject(doc)) return;
  const steps = Array.isArray(doc.steps) ? doc.steps : [];
  for (const [i, step] of steps.entries()) {
    if (!isObject(step)) continue;
    // step-ids-sequential
    if (typeof step.step_id === "number" && step.step_id !== i + 1)
      errors.push(`${path}.steps[${i}].step_id: expected ${i + 1} (sequential from 1), got ${step.step_id}`);
    // source-call-id-known
    const callIds = new Set<unknown>();
    if (Array.isArray(step.tool_calls))
      for (const call of step.tool_calls) if (isObject(call)) callIds.add(call.tool_call_id);
    const results =
      isObject(step.observation) && Array.isArray(step.observation.results) ? step.observation.results : [];
    for (const [j, result] of results.entries()) {
      if (!isObject(result) || result.source_call_id === undefined || result.source_call_id === null) continue;
      if (!callIds.has(result.source_call_id))
        errors.push(
          `${path}.steps[${i}].observation.results[${j}].source_call_id: ${describe(result.source_call_id)} is not the tool_call_id of any tool call of step ${describe(step.step_id)}`,
        );
    }
  }
  // subagent-trajectory-id, then the same rules inside each embedded trajectory
  const subagents = Array.isArray(doc.subagent_trajectories) ? doc.subagent_trajectories : [];
  const seen = new Set<unknown>();
  for (const [i, sub] of subagents.entries()) {
    const where = `${path}.subagent_trajectories[${i}]`;
    if (!isObject(sub)) continue;
    if (sub.trajectory_id === undefined || sub.trajectory_id === null)
      errors.push(`${where}.trajectory_id: required for an embedded subagent trajectory`);
    else if (seen.has(sub.trajectory_id))
      errors.push(`${where}.trajectory_id: ${describe(sub.trajectory_id)} is not unique within subagent_trajectories`);
    else seen.add(sub.trajectory_id);
    checkCrossFieldRules(sub, where, errors);
  }
}

/** Every way `doc` breaks the ATIF rules; empty when it is a valid trajectory. */
export function validateAtif(doc: unknown, schema: JsonSchema = ATIF_SCHEMA): string[] {
  const errors: string[] = [];
  new SchemaChecker(schema).check(doc, schema, "trajectory", errors);
  checkCrossFieldRules(doc, "trajectory", errors);
  return errors;
}

/** Parses `text` as JSON and validates it; a parse failure is reported as the one error. */
export function validateAtifText(text: string): string[] {
  let doc: unknown;
  try {
    doc = JSON.parse(text);
  } catch (error) {
    return [`trajectory: not valid JSON: ${(error as Error).message}`];
  }
  return validateAtif(doc);
}

/** Throws one Error listing every problem when `doc` is not a valid ATIF trajectory. */
export function assertValidAtif(doc: unknown): void {
  const errors = validateAtif(doc);
  if (errors.length) throw new Error(`invalid ATIF trajectory (${errors.length} error(s)):\n  ${errors.join("\n  ")}`);
}
