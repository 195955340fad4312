/**
 * The README against the tables of aic.ts it restates by hand: the secret stores commands may not
 * read (README: "Sandbox (Linux)"), the TUI's slash commands ("Keys") and the JSON Lines events
 * with their fields ("JSON Lines (`--json`)"). Each list is checked both ways, so an entry added
 * on one side only fails here.
 *
 * Tables aic.ts does not export are read from its source with the TypeScript parser, by their
 * declarations; a declaration or README section that is not found throws, so nothing passes empty.
 * AIC_README_PATH points the tests at another copy of the README (an edited one, to see them fail).
 */
import { describe, expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import ts from "typescript";
import { JsonSink, SLASH_COMMANDS } from "../aic.ts";
import { ROOT } from "./helpers.ts";

const README = readFileSync(process.env.AIC_README_PATH || join(ROOT, "README.md"), "utf8");
const SOURCE = ts.createSourceFile("aic.ts", readFileSync(join(ROOT, "aic.ts"), "utf8"), ts.ScriptTarget.Latest);

// ── the README ──────────────────────────────────────────────────────────────

/** The lines under the README heading `title` (any level), up to the next heading of that level or higher. */
function section(title: string): string[] {
  const lines = README.split("\n");
  // Headings outside fenced code only: a `# comment` in a shell example is not one.
  let fenced = false;
  const level = lines.map((line) => {
    if (line.startsWith("```")) fenced = !fenced;
    return fenced ? 0 : (/^(#+) /.exec(line)?.[1]?.length ?? 0);
  });
  const start = lines.findIndex((line, i) => level[i]! > 0 && line.replace(/^#+ /, "") === title);
  if (start < 0) throw new Error(`the README has no section "${title}"`);
  const end = level.findIndex((l, i) => i > start && l > 0 && l <= level[start]!);
  return lines.slice(start + 1, end < 0 ? undefined : end);
}

/** The cells of each row of the table whose header line matches `header`. */
function tableRows(lines: string[], header: RegExp): string[][] {
  const at = lines.findIndex((line) => header.test(line));
  if (at < 0) throw new Error(`the README has no table with the header ${header}`);
  const rows: string[][] = [];
  for (const line of lines.slice(at + 2)) {
    if (!line.startsWith("|")) break;
    rows.push(
      line
        .split(/(?<!\\)\|/)
        .slice(1, -1)
        .map((cell) => cell.trim()),
    );
  }
  if (!rows.length) throw new Error(`the README's table ${header} has no rows`);
  return rows;
}

/** The text of each `code span` in `text`. */
const spans = (text: string): string[] => [...text.matchAll(/`([^`]+)`/g)].map((m) => m[1]!);

/** The keys an object written as `{a, b (why), c [what]}` or `[{a, b}]` names. */
function objectKeys(span: string): string[] {
  let body = span.replace(/^\[(.*)\]$/s, "$1").replace(/^\{(.*)\}$/s, "$1");
  // Explanations in parentheses and brackets hold commas of their own.
  for (let before = ""; before !== body;) [before, body] = [body, body.replace(/\([^()]*\)|\[[^[\]]*\]/g, "")];
  return body.split(",").map((item) => {
    const key = item.trim();
    if (!/^[a-z][a-z0-9_]*$/.test(key)) throw new Error(`"${key}" in ${span} is not a field name`);
    return key;
  });
}

interface DocumentedField {
  name: string;
  /** Keys of the objects the README shows after this field (`{…}`, `[{…}]`). */
  keys: string[];
}

/**
 * The fields a cell of the event table names: code spans that are field names outside any
 * parenthesis or bracket (inside them are values and explanations), each with the keys of the
 * `{…}` spans that follow it.
 */
function documentedFields(cell: string): DocumentedField[] {
  const fields: DocumentedField[] = [];
  let depth = 0;
  for (const [token, span] of cell.matchAll(/`([^`]+)`|[([)\]]/g)) {
    if (span === undefined) depth += token === "(" || token === "[" ? 1 : -1;
    else if (/^\[?\{/.test(span)) {
      const owner = fields.at(-1);
      if (!owner) throw new Error(`${span} comes before any field in: ${cell}`);
      owner.keys.push(...objectKeys(span));
    } else if (depth === 0 && /^[a-z][a-z0-9_]*$/.test(span)) fields.push({ name: span, keys: [] });
  }
  return fields;
}

// ── aic.ts ──────────────────────────────────────────────────────────────────

/** The top-level declaration of aic.ts named `name` that `is` accepts. */
function declaration<T extends ts.Node>(name: string, is: (node: ts.Node) => node is T): T {
  for (const statement of SOURCE.statements) {
    const nodes = ts.isVariableStatement(statement) ? statement.declarationList.declarations : [statement];
    for (const node of nodes) {
      const id = (node as { name?: ts.Node }).name;
      if (is(node) && id && ts.isIdentifier(id) && id.text === name) return node;
    }
  }
  throw new Error(`aic.ts has no declaration of ${name}`);
}

/** The strings of `const name = [ "…", … ]` in aic.ts. */
function stringArray(name: string): string[] {
  const init = declaration(name, ts.isVariableDeclaration).initializer;
  if (!init || !ts.isArrayLiteralExpression(init)) throw new Error(`${name} in aic.ts is not an array literal`);
  return init.elements.map((e) => {
    if (!ts.isStringLiteral(e)) throw new Error(`${name} in aic.ts holds something else than a string`);
    return e.text;
  });
}

/** The properties of an object type, through arrays, `| null` and the interfaces and aliases of aic.ts. */
function propertiesOf(type: ts.TypeNode): Map<string, ts.TypeNode> | undefined {
  if (ts.isParenthesizedTypeNode(type)) return propertiesOf(type.type);
  if (ts.isArrayTypeNode(type)) return propertiesOf(type.elementType);
  if (ts.isUnionTypeNode(type)) return type.types.map(propertiesOf).find((p) => p !== undefined);
  if (ts.isTypeLiteralNode(type)) return members(type.members);
  if (ts.isTypeReferenceNode(type) && ts.isIdentifier(type.typeName)) {
    const name = type.typeName.text;
    const found = SOURCE.statements.find(
      (s) => (ts.isInterfaceDeclaration(s) || ts.isTypeAliasDeclaration(s)) && s.name.text === name,
    );
    if (found && ts.isInterfaceDeclaration(found)) return members(found.members);
    if (found && ts.isTypeAliasDeclaration(found)) return propertiesOf(found.type);
  }
  return undefined;
}

function members(list: ts.NodeArray<ts.TypeElement>): Map<string, ts.TypeNode> {
  const out = new Map<string, ts.TypeNode>();
  for (const m of list)
    if (ts.isPropertySignature(m) && ts.isIdentifier(m.name) && m.type) out.set(m.name.text, m.type);
  return out;
}

/** Each member of the AgentEvent union by its `type`, with its properties. */
function agentEvents(): Map<string, Map<string, ts.TypeNode>> {
  const union = declaration("AgentEvent", ts.isTypeAliasDeclaration).type;
  if (!ts.isUnionTypeNode(union)) throw new Error("AgentEvent in aic.ts is not a union");
  const events = new Map<string, Map<string, ts.TypeNode>>();
  for (const member of union.types) {
    const props = propertiesOf(member);
    const tag = props?.get("type");
    if (!props || !tag || !ts.isLiteralTypeNode(tag) || !ts.isStringLiteral(tag.literal))
      throw new Error("a member of AgentEvent in aic.ts has no literal `type`");
    events.set(tag.literal.text, props);
  }
  return events;
}

/** Both directions at once, so a failure names every entry on the side that lacks it. */
function difference(code: Iterable<string>, readme: Iterable<string>) {
  const [c, r] = [new Set(code), new Set(readme)];
  return {
    missingFromReadme: [...c].filter((x) => !r.has(x)),
    missingFromCode: [...r].filter((x) => !c.has(x)),
  };
}

// ── the tests ───────────────────────────────────────────────────────────────

describe("the README names what aic.ts defines", () => {
  test("the secret stores commands may not read (the sandbox's Reads rule)", () => {
    const code = stringArray("SECRET_STORES");
    expect(code.length).toBeGreaterThanOrEqual(40);

    const bullet = section("Sandbox (Linux)").join("\n");
    const start = bullet.indexOf("- **Reads**");
    // The list ends where the stores found by name begin (`~/.config/*` is a search, not a store).
    const end = bullet.indexOf("On top of the list", start);
    if (start < 0 || end < 0)
      throw new Error('the README\'s Sandbox section has no "- **Reads**" … "On top of the list"');
    const readme = spans(bullet.slice(start, end))
      .filter((s) => s.startsWith("~/"))
      .map((s) => s.slice(2));
    expect(readme.length).toBeGreaterThanOrEqual(40);

    expect(difference(code, readme)).toEqual({ missingFromReadme: [], missingFromCode: [] });
  });

  test("the slash commands of the TUI", () => {
    const code = SLASH_COMMANDS.flatMap((c) => c.names);
    expect(code.length).toBeGreaterThanOrEqual(15);

    // First cell: `/undo [N]`, `/redo`, … — the name is a span's first word.
    const rows = tableRows(section("Keys"), /^\|\s*command\s*\|\s*action\s*\|/);
    const readme = rows.flatMap(([names]) => spans(names ?? "").map((s) => s.split(" ")[0]!));
    for (const name of readme) expect(name).toMatch(/^\/[a-z]+$/);

    expect(difference(code, readme)).toEqual({ missingFromReadme: [], missingFromCode: [] });
  });

  describe("the JSON Lines events", () => {
    const rows = () => tableRows(section("JSON Lines (`--json`)"), /^\|\s*type\s*\|\s*fields\s*\|/);
    // --json writes the events JsonSink's table marks as records of their own (not streaming fragments, not the
    // context estimate); the table names every event type, so its false entries are what it skips.
    const records = (JsonSink as unknown as { RECORDS: Record<string, boolean> }).RECORDS;
    const skipped = new Set(Object.keys(records ?? {}).filter((type) => !records[type]));

    test("every event --json writes has a row, and every row is such an event", () => {
      expect(Object.keys(records ?? {}).length).toBeGreaterThan(15);
      expect(skipped.size).toBeGreaterThan(0);
      const events = agentEvents();
      for (const type of skipped) expect(events.has(type)).toBe(true);
      const code = [...events.keys()].filter((type) => !skipped.has(type));
      expect(code.length).toBeGreaterThanOrEqual(15);

      const readme = rows().flatMap(([types]) => spans(types ?? ""));
      expect(difference(code, readme)).toEqual({ missingFromReadme: [], missingFromCode: [] });
    });

    test("every field a row names is a field of that event", () => {
      const events = agentEvents();
      const unknown: string[] = [];
      let checked = 0;
      for (const [types, cell] of rows()) {
        const fields = documentedFields(cell ?? "");
        for (const type of spans(types ?? "")) {
          const props = events.get(type);
          if (!props) continue; // the test above names it
          // Keys belong to the nearest field before them that is an object (`kept` and `kept_others` share one note).
          let object: { name: string; props: Map<string, ts.TypeNode> } | undefined;
          for (const { name, keys } of fields) {
            checked++;
            const field = props.get(name);
            if (!field) {
              unknown.push(`${type}.${name}`);
              continue;
            }
            const nested = propertiesOf(field);
            if (nested) object = { name, props: nested };
            for (const key of keys) if (!object?.props.has(key)) unknown.push(`${type}.${object?.name ?? name}.${key}`);
          }
        }
      }
      expect(checked).toBeGreaterThanOrEqual(60);
      expect(unknown).toEqual([]);
    });
  });
});
