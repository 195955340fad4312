/**
 * aic's own input-wait detector in the shape tests/bench/input-wait.ts loads:
 * `classifyGroups(pgids, screen)`. The bench runs each program as aic runs a
 * command and measures how soon this says it waits.
 */
import { classifyForeground } from "../../aic.ts";

export function classifyGroups(
  pgids: readonly number[],
  screen: { quietMs: number; altScreen: boolean; selfRedraws: number },
): { verdict: "waiting_for_input" | "waiting_on_time" | "busy"; reason?: string } {
  return classifyForeground(pgids, screen);
}
