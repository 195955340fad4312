/**
 * Helper process for tests/tui.test.ts: adds COUNT prompts `PREFIX-<i>` to the prompt history FILE,
 * each through a fresh PromptHistory (as separate aic processes would), one after the other.
 * Usage: bun tests/history-writer.ts FILE PREFIX COUNT
 */
import { PromptHistory } from "../aic.ts";

const [file, prefix, count] = process.argv.slice(2);
if (!file || !prefix || !count) throw new Error("usage: bun tests/history-writer.ts FILE PREFIX COUNT");
for (let i = 0; i < Number(count); i++) await new PromptHistory(file).add(`${prefix}-${i}`);
