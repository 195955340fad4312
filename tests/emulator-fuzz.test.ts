/**
 * A fuzz test of the two terminal emulators a command's output goes through: the headless xterm behind the
 * model's screen, the TUI's CommandScreen and its Shell tab (always made through `tameEmulator`), and the TUI
 * Console's ConsoleStream with its SGR parser. A seeded generator writes random and adversarial escape
 * sequences (huge, empty and hundreds of parameters, every CSI final byte, off-screen cursors followed by every
 * erase, scroll regions and margins, tab stops, wide characters in the last cell, unterminated OSC and DCS
 * strings, 8-bit C1 controls, invalid UTF-8, alternate screens interleaved with resizes) mixed with text.
 * Neither emulator may throw, leave an uncaught exception or unhandled rejection behind, or stop answering, and
 * each still shows a line written after the fuzz. The inputs that once ended aic stay below as regression cases.
 *
 * The seeds are fixed, so a failure reproduces; each test's name carries its seed. To try other seeds:
 * EMULATOR_FUZZ_SEED=<n> bun test tests/emulator-fuzz.test.ts
 */
import { describe, expect, test } from "bun:test";
import * as ot from "@opentui/core";
import { createTestRenderer } from "@opentui/core/testing";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import type { Terminal as XTerm } from "@xterm/headless";
import { ConsoleStream, LogPane, loadXterm, tameEmulator } from "../aic.ts";
import { headless, jsonLines, perTestFixtures, runAic, scratch, toolAnswer } from "./helpers.ts";

const fixtures = perTestFixtures();
const Terminal = await loadXterm();

/** The first seed of this run: fixed, unless EMULATOR_FUZZ_SEED names another. */
const SEED = Number(process.env.EMULATOR_FUZZ_SEED ?? 0x5eed_2026) >>> 0;

/** Per-test limit, only to stop a hung test (bun ignores `timeout` in bunfig.toml). */
const FUZZ_MS = 90_000;

// ---------------------------------------------------------------------------------------------
// The generator

/** mulberry32: small, fast and the same on every machine. */
class Rng {
  private state: number;
  constructor(seed: number) {
    this.state = seed >>> 0;
  }
  next(): number {
    let t = (this.state = (this.state + 0x6d2b79f5) >>> 0);
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  }
  /** 0 ≤ n < below. */
  int(below: number): number {
    return Math.floor(this.next() * below);
  }
  /** lo ≤ n ≤ hi. */
  range(lo: number, hi: number): number {
    return lo + this.int(hi - lo + 1);
  }
  pick<T>(items: readonly T[]): T {
    return items[this.int(items.length)]!;
  }
  chance(p: number): boolean {
    return this.next() < p;
  }
}

/** A piece of a sequence: text (sent as UTF-8) or raw bytes (8-bit controls, invalid UTF-8). */
type Part = string | Uint8Array;
const raw = (...bytes: number[]) => Uint8Array.from(bytes);
const encoder = new TextEncoder();

function concat(parts: Part[]): Uint8Array {
  const encoded = parts.map((p) => (typeof p === "string" ? encoder.encode(p) : p));
  const out = new Uint8Array(encoded.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of encoded) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

/** One step of the corpus: bytes a command prints, or a resize of the emulator (a person's pane changed). */
type Op = { bytes: Uint8Array } | { resize: [cols: number, rows: number] };

const HUGE = [
  "2147483647",
  "2147483648",
  "4294967295",
  "4294967296",
  "4294967297",
  "1000000000000",
  "99999999999999999999999999",
  "65535",
  "65536",
  "32767",
  "32768",
];

/** A numeric parameter: empty, zero, small, large, huge or padded with zeros. */
function num(r: Rng): string {
  switch (r.int(9)) {
    case 0:
      return "";
    case 1:
      return "0";
    case 2:
      return "1";
    case 3:
      return String(r.range(2, 12));
    case 4:
      return String(r.range(13, 400));
    case 5:
      return "0".repeat(r.range(1, 40)) + r.range(0, 9);
    default:
      return r.pick(HUGE);
  }
}

/** A parameter list: none, a few, or hundreds, some with ':' sub-parameters. */
function params(r: Rng): string {
  const count = r.pick([0, 1, 1, 1, 2, 2, 3, 4, 5, 16, 31, 32, 33, 64, 200, 500]);
  const out: string[] = [];
  for (let i = 0; i < count; i++) {
    let p = num(r);
    if (r.chance(0.1)) for (let k = r.pick([1, 2, 4, 40]); k > 0; k--) p += ":" + num(r);
    out.push(p);
  }
  return out.join(";");
}

/** A control introducer: 7-bit ESC form, the C1 code point as UTF-8, or the raw 8-bit byte. */
function intro(r: Rng, sevenBit: string, c1: number): Part {
  const n = r.int(10);
  return n < 7 ? sevenBit : n < 9 ? String.fromCharCode(c1) : raw(c1);
}

/** Something that breaks a sequence in the middle: a control, a restart, a stray private marker. */
const BREAKERS = ["\n", "\r", "\x18", "\x1a", "\x1b", "\x7f", "\x00", "\x07", "\b", "<", "=", ">", "?", "\u009c"];

function csi(r: Rng, final?: string, body?: string): Part[] {
  const parts: Part[] = [intro(r, "\x1b[", 0x9b)];
  if (r.chance(0.25)) parts.push(r.pick(["?", ">", "=", "<", "??", "?>"]));
  let p = body ?? params(r);
  if (r.chance(0.04)) {
    const at = r.int(p.length + 1);
    p = p.slice(0, at) + r.pick(BREAKERS) + p.slice(at);
  }
  parts.push(p);
  if (r.chance(0.12)) parts.push(r.pick([" ", "!", '"', "#", "$", "%", "&", "'", "*", "+", "-", "/", " !", "$$"]));
  parts.push(final ?? String.fromCharCode(0x40 + r.int(0x3f)));
  return parts;
}

const plainCsi = (p: string, final: string) => `\x1b[${p}${final}`;

/** Printable text, line ends and the C0 controls a program prints. */
function text(r: Rng): Part[] {
  switch (r.int(10)) {
    case 0:
      return ["\r\n"];
    case 1:
      return ["\n".repeat(r.range(1, 80))];
    case 2:
      return ["x".repeat(r.range(100, 400))]; // wraps
    case 3:
      return [r.pick(["\b", "\t", "\v", "\f", "\x00", "\x7f", "\x0e", "\x0f", "\x05", "\r"]).repeat(r.range(1, 5))];
    case 4:
      return [r.pick(WIDE)];
    default:
      return [
        r.pick(["hello", "world", "$ ls -la", "error: oops", "αβγ", "Ω", " ", "  "]) + (r.chance(0.3) ? "\r\n" : ""),
      ];
  }
}

/** Wide characters, emoji, combining marks and other cells that are not one column wide. */
const WIDE = [
  "中",
  "文字",
  "ＡＢ",
  "😀",
  "👍🏽",
  "👨‍👩‍👧‍👦",
  "🇺🇸",
  "🏴\u{E0067}\u{E0062}\u{E0073}\u{E0063}\u{E0074}\u{E007F}",
  "e\u0301",
  "\u0301",
  "\u0301\u0302\u0303\u0304\u0305\u0306\u0307\u0308",
  "\u200b",
  "\u200d",
  "\u00ad",
  "☃\ufe0f",
  "\ufe0f",
  "\u1100\u1161\u11a8",
  "\u{1F468}\u200d",
  "\u{10FFFF}",
  "\ufffd",
  "\u0e01\u0e31\u0e49",
  "a\u20dd",
  "\u3000",
];

function cursorMove(r: Rng): Part[] {
  switch (r.int(8)) {
    case 0:
      return ["\x1b[99;200H"];
    case 1:
      return [plainCsi(`${num(r)};${num(r)}`, r.pick(["H", "f"]))];
    case 2:
      return [plainCsi(num(r), r.pick(["A", "B", "C", "D", "E", "F", "G", "`", "a", "d", "e", "j", "k"]))];
    case 3:
      return ["\x1b[?6h", plainCsi(`${num(r)};${num(r)}`, "H")]; // origin mode
    case 4:
      return ["\x1b[999999;999999H"];
    case 5:
      return [r.pick(["\x1b8", "\x1b[u", "\x1b[?1048l"])]; // a restore, maybe of a cursor saved before a resize
    case 6:
      return [plainCsi(r.pick(HUGE), "C"), plainCsi(r.pick(HUGE), "B")];
    default:
      return csi(r, r.pick(["H", "A", "B", "C", "D", "G", "d"]));
  }
}

const ERASE_FINALS = ["J", "K", "X", "P", "@", "L", "M", "S", "T", "b", "Z", "I"];

function erase(r: Rng): Part[] {
  if (r.chance(0.4)) return [plainCsi(r.pick(["", "0", "1", "2", "3", "?", "?0", "?1", "?2"]), r.pick(["J", "K"]))];
  if (r.chance(0.5)) return [plainCsi(num(r), r.pick(ERASE_FINALS))];
  return csi(r, r.pick(ERASE_FINALS));
}

function offScreenErase(r: Rng): Part[] {
  const parts = [...cursorMove(r), ...erase(r)];
  if (r.chance(0.3)) parts.push(...erase(r));
  if (r.chance(0.2)) parts.push(...text(r));
  if (r.chance(0.5)) parts.push("\x1b[?6l");
  return parts;
}

function margins(r: Rng): Part[] {
  const parts: Part[] = [];
  if (r.chance(0.6)) parts.push(plainCsi(`${num(r)};${num(r)}`, "r")); // DECSTBM, also top > bottom, 0, huge
  if (r.chance(0.3)) parts.push(r.pick(["\x1b[?6h", "\x1b[?6l"]));
  if (r.chance(0.4)) parts.push("\x1b[?69h", plainCsi(`${num(r)};${num(r)}`, "s")); // DECSLRM
  for (let i = r.range(1, 4); i > 0; i--)
    parts.push(
      r.pick([
        "\x1bD",
        "\x1bE",
        "\x1bM",
        "\n",
        "\x85",
        plainCsi(num(r), "S"),
        plainCsi(num(r), "T"),
        plainCsi(num(r), "L"),
        plainCsi(num(r), "M"),
        plainCsi(num(r), "@"),
        plainCsi(num(r), "P"),
        plainCsi(num(r), " @"), // SL
        plainCsi(num(r), " A"), // SR
        plainCsi(num(r), "'}"), // DECIC
        plainCsi(num(r), "'~"), // DECDC
        "wrap me around the margins",
      ]),
    );
  if (r.chance(0.5)) parts.push(r.pick(["\x1b[r", "\x1b[?69l", "\x1b[?6l\x1b[r\x1b[?69l"]));
  return parts;
}

function tabs(r: Rng): Part[] {
  const parts: Part[] = [];
  for (let i = r.range(1, 5); i > 0; i--)
    parts.push(
      r.pick([
        "\x1bH",
        "\x1b[g",
        "\x1b[0g",
        "\x1b[3g",
        "\t",
        "\t".repeat(r.range(2, 60)),
        plainCsi(num(r), "I"),
        plainCsi(num(r), "Z"),
        plainCsi(num(r), "W"),
        "\x1b[?5W",
        plainCsi(num(r), "G"),
        "\u0088", // HTS as C1
      ]),
    );
  return parts;
}

function wide(r: Rng): Part[] {
  const parts: Part[] = [];
  if (r.chance(0.2)) parts.push(r.pick(["\x1b[?7l", "\x1b[4h", "\x1b[?7l\x1b[4h"])); // no autowrap, insert mode
  parts.push(
    r.pick([
      "\x1b[999;999H", // the last cell
      "\x1b[999G", // the right margin
      "\x1b[159G",
      "\x1b[160G",
      "\x1b[79G",
      "\x1b[80G",
      "\x1b[999;1H",
      "\r",
    ]),
  );
  for (let i = r.range(1, 4); i > 0; i--) parts.push(r.pick(WIDE));
  if (r.chance(0.4)) parts.push(plainCsi(num(r), "b")); // REP after a wide character
  if (r.chance(0.2)) parts.push(plainCsi(num(r), r.pick(["@", "P", "X"])));
  if (r.chance(0.5)) parts.push("\x1b[?7h\x1b[4l");
  return parts;
}

const OSC_NUMBERS = [
  "0",
  "1",
  "2",
  "4",
  "7",
  "8",
  "10",
  "11",
  "12",
  "52",
  "104",
  "110",
  "112",
  "133",
  "633",
  "1337",
  "",
  "99999999999",
];

function oscPayload(r: Rng, n: string): string {
  const big = r.chance(0.01) ? r.range(10_000, 100_000) : r.range(0, 40);
  const filler = (c: string) => c.repeat(big);
  switch (n) {
    case "4":
      return (
        r.pick(["1;rgb:ff/00/00", `${num(r)};?`, `${num(r)};#ffffff;${num(r)};rgb:1/2/3`, ";;;", "256;?"]) + filler("")
      );
    case "8":
      return r.pick([";http://example.com/", "id=x;https://a.b/c", ";;", "", ";", `id=${filler("i")};u`]) + filler("u");
    case "10":
    case "11":
    case "12":
      return r.pick(["?", "rgb:ffff/0000/0000", "#zzz", ""]);
    case "52":
      return r.pick(["c;aGVsbG8=", "c;?", "c;!!!notbase64", ";", "pqrs01234567;" + filler("A")]);
    case "104":
      return r.pick(["", "1;2;3", `${num(r)}`]);
    case "133":
      return r.pick(["A", "B", "C", "D;0", "D;" + num(r), "P;k=i"]);
    case "1337":
      return r.pick([
        "File=name=eA==;inline=1:" + filler("A"),
        "SetMark",
        "CurrentDir=/tmp",
        "SetUserVar=a=" + filler("b"),
      ]);
    default:
      return r.pick(["title", "", "t\u00e9tl\u00e9 中", "\x1b[31m", "\u009b1m"]) + filler("t");
  }
}

/** A string terminator, or none (unterminated), or an ESC that starts something else. */
function terminator(r: Rng): Part {
  return r.pick<Part>(["\x07", "\x1b\\", "\x1b\\", "\u009c", raw(0x9c), "", "", "\x1b[", "\x1b", "\x18"]);
}

function osc(r: Rng): Part[] {
  const n = r.pick(OSC_NUMBERS);
  return [intro(r, "\x1b]", 0x9d), n, r.chance(0.9) ? ";" : "", oscPayload(r, n), terminator(r)];
}

function dcs(r: Rng): Part[] {
  const big = r.chance(0.01) ? r.range(10_000, 100_000) : r.range(0, 30);
  const body = r.pick([
    `q"1;1;${r.pick(HUGE)};${r.pick(HUGE)}#0;2;100;100;100#0!${r.pick(HUGE)}~-$` + "~".repeat(big), // sixel
    `0;1;${num(r)}q#${num(r)};2;${num(r)};${num(r)};${num(r)}` + "?@AB-".repeat(big),
    "$qm",
    "$qr",
    '$q"p',
    "$q q",
    "$qs",
    "$q" + "x".repeat(big),
    "tmux;\x1b\x1b]0;passthrough\x07\x1b\x1b[31m",
    "tmux;" + "\x1b\x1b[2J".repeat(Math.min(big, 300)), // each ED 2 costs xterm a whole screen: kept short
    `${num(r)};${num(r)}|` + "0/41".repeat(big), // DECUDK
    "+q544e", // XTGETTCAP
    "=1s",
  ]);
  const open: Part = r.pick<Part>(["\x1bP", "\x1bP", "\u0090", raw(0x90), "\x1b_G", "\x1bX", "\x1b^"]);
  return [open, body, terminator(r)];
}

const ESCAPES = [
  "\x1b7",
  "\x1b8",
  "\x1bc",
  "\x1bD",
  "\x1bE",
  "\x1bM",
  "\x1b#8", // DECALN
  "\x1b#3",
  "\x1b#4",
  "\x1b#5",
  "\x1b#6",
  "\x1b(0",
  "\x1b)0",
  "\x1b*0",
  "\x1b+0",
  "\x1b(B",
  "\x1b(A",
  "\x1b(<",
  "\x1b(%5",
  "\x1b-A",
  "\x1b.A",
  "\x1b/A",
  "\x1bn",
  "\x1bo",
  "\x1b~",
  "\x1b}",
  "\x1b|",
  "\x1bN",
  "\x1bO",
  "\x0e",
  "\x0f",
  "\x1b=",
  "\x1b>",
  "\x1bZ",
  "\x1b F",
  "\x1b G",
  "\x1b%G",
  "\x1b%@",
  "\x1b\\",
  "\x1b\x1b",
  "\x1b ",
  "\x1b#",
  "\x1b(",
  "\x1bV",
  "\x1bW",
  "\x1bl",
  "\x1bm",
];

function escape(r: Rng): Part[] {
  const parts: Part[] = [];
  for (let i = r.range(1, 3); i > 0; i--) parts.push(r.pick(ESCAPES));
  if (r.chance(0.4)) parts.push(r.pick(["lqqqk", "xax", "mqqqj", "`afgjklmnopqrstuvwxyz{|}~"])); // line drawing
  return parts;
}

function c1(r: Rng): Part[] {
  const code = 0x80 + r.int(0x20);
  const parts: Part[] = [r.chance(0.5) ? raw(code) : String.fromCharCode(code)];
  if (r.chance(0.5)) parts.push(params(r), String.fromCharCode(0x40 + r.int(0x3f)));
  return parts;
}

function badUtf8(r: Rng): Part[] {
  return [
    r.pick<Part>([
      raw(0xc0, 0x80), // overlong NUL
      raw(0xe0, 0x80, 0x80),
      raw(0xed, 0xa0, 0x80), // a surrogate
      raw(0xf4, 0x90, 0x80, 0x80), // beyond U+10FFFF
      raw(0xf8, 0x88, 0x80, 0x80, 0x80),
      raw(0xfe, 0xff),
      raw(0xe4, 0xb8), // truncated, then whatever follows
      raw(0xf0, 0x9f, 0x98),
      raw(0xf0),
      raw(0xc3),
      raw(...Array.from({ length: r.range(1, 16) }, () => 0x80 + r.int(0x80))),
      raw(...Array.from({ length: r.range(1, 16) }, () => r.int(0x100))),
    ]),
  ];
}

const SCREENS = [
  "\x1b[?1049h",
  "\x1b[?1049l",
  "\x1b[?47h",
  "\x1b[?47l",
  "\x1b[?1047h",
  "\x1b[?1047l",
  "\x1b[?1048h",
  "\x1b[?1048l",
];

const SGR_PARAMS = [
  "",
  "0",
  "1;31",
  "38;5;196",
  "48;5;999",
  "38;2;255;0;0",
  "38;2;99999;-1;0",
  "38:2::255:0:0",
  "38:5:21",
  "48;2",
  "38;5",
  "38",
  "4:3",
  "58;2;1;2;3",
  "1;2;3;4;5;7;8;9;21;22;23;24;25;27;28;29",
  "?1",
  ";;;",
];

function sgr(r: Rng): Part[] {
  const list: string[] = [];
  for (let i = r.pick([1, 1, 2, 3, 40]); i > 0; i--) list.push(r.chance(0.7) ? r.pick(SGR_PARAMS) : num(r));
  return [plainCsi(list.join(r.chance(0.9) ? ";" : ":"), "m"), ...text(r)];
}

const MODES = [
  1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 20, 25, 40, 45, 66, 67, 69, 80, 1000, 1002, 1003, 1004, 1005, 1006, 1015, 1016, 1034,
  1049, 2004, 2026, 2027, 9001, 99999,
];

function modes(r: Rng): Part[] {
  return [
    r.pick([
      () => plainCsi(`?${r.pick(MODES)}`, r.pick(["h", "l"])),
      () => plainCsi(`${r.pick(MODES)}`, r.pick(["h", "l"])),
      () => plainCsi(`?${r.pick(MODES)}`, "$p"), // DECRQM
      () => plainCsi(r.pick(["5", "6", "?6", "?15", "?26", "?996"]), "n"), // DSR
      () => plainCsi(r.pick(["", ">", "=", ">0", "?"]), "c"), // DA
      () => plainCsi(`${r.pick(["8", "4", "14", "16", "18", "19", "22", "23", "3", "9"])};${num(r)};${num(r)}`, "t"),
      () => "\x1b[!p", // DECSTR
      () => plainCsi(num(r), " q"), // DECSCUSR
      () => plainCsi(num(r), '"q'), // DECSCA
      () => plainCsi(num(r), '"p'), // DECSCL
      () => plainCsi(`${num(r)};${num(r)};${num(r)};${num(r)};${num(r)}`, "$x"), // DECFRA
      () => plainCsi(`${num(r)};${num(r)};${num(r)};${num(r)}`, "$z"), // DECERA
      () => plainCsi(`${num(r)};${num(r)};${num(r)};${num(r)}`, "*y"), // DECRQCRA
      () => plainCsi(`${num(r)}`, "*|"), // DECSNLS
      () => plainCsi(`${num(r)}`, "$|"), // DECSCPP
    ])(),
  ];
}

/** Kinds of item, weighted. */
const KINDS: [weight: number, make: (r: Rng) => Part[], name: string][] = [
  [20, (r) => csi(r), "random CSI"],
  [12, offScreenErase, "off-screen erase"],
  [5, margins, "margins"],
  [4, tabs, "tabs"],
  [7, wide, "wide"],
  [6, osc, "OSC"],
  [4, dcs, "DCS"],
  [6, escape, "ESC"],
  [4, c1, "C1"],
  [4, badUtf8, "bad UTF-8"],
  [3, (r) => [r.pick(SCREENS)], "screen switch"],
  [6, sgr, "SGR"],
  [5, modes, "modes"],
  [10, text, "text"],
];
const TOTAL_WEIGHT = KINDS.reduce((n, [w]) => n + w, 0);

function kind(r: Rng): (typeof KINDS)[number] {
  let n = r.int(TOTAL_WEIGHT);
  for (const k of KINDS) if ((n -= k[0]) < 0) return k;
  return KINDS[0]!;
}

/** Sizes the emulator is resized to between two pieces of output: 1x1, 2x300, random, and back to the start. */
function resizeTo(r: Rng, home: [number, number]): [number, number] {
  return r.pick<[number, number]>([[1, 1], [2, 300], [r.range(1, 200), r.range(1, 60)], home, home]);
}

/** `count` sequences from `seed`, each maybe followed by text; with `home`, alternate screens interleave with resizes. */
function corpus(seed: number, count: number, home?: [number, number]): Op[] {
  const r = new Rng(seed);
  const ops: Op[] = [];
  for (let i = 0; i < count; i++) {
    const [, make, name] = kind(r);
    const parts = make(r);
    if (r.chance(0.3)) parts.push(...text(r));
    ops.push({ bytes: concat(parts) });
    if (home && r.chance(name === "screen switch" ? 0.5 : 0.002)) ops.push({ resize: resizeTo(r, home) });
  }
  if (home) ops.push({ resize: home });
  return ops;
}

/** The corpus as one stream of bytes (resizes left out). */
function corpusBytes(ops: Op[]): Uint8Array {
  return concat(ops.flatMap((op) => ("bytes" in op ? [op.bytes] : [])));
}

/** `bytes` cut at random points, so sequences and UTF-8 characters are split across writes. */
function chunks(r: Rng, bytes: Uint8Array): Uint8Array[] {
  const out: Uint8Array[] = [];
  for (let at = 0; at < bytes.length;) {
    const size = r.pick([1, 1, 2, 3, 5, 8, 17, 64, 256, 1024, 4096]);
    out.push(bytes.subarray(at, at + size));
    at += size;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Watching for crashes

interface CrashWatch {
  /** Everything thrown where nothing caught it, in order. */
  errors: unknown[];
  /** Settles at the first one, so a test waiting on a write callback that will never come stops waiting. */
  crashed: Promise<void>;
}

/**
 * Runs `body` collecting uncaught exceptions and unhandled rejections, and whatever escapes the write loop of the
 * emulators in `terms`. `bun test` (1.4) never calls process "uncaughtException" listeners: it fails the running
 * test itself, without the seed or the input. So xterm's write loop (a timer, where its parser's exceptions end
 * up) is watched directly, through its private WriteBuffer; the process listeners stay for anything else.
 */
async function collectingCrashes<T>(terms: XTerm[], body: (crash: CrashWatch) => Promise<T>) {
  const errors: unknown[] = [];
  let wake!: () => void;
  const crashed = new Promise<void>((resolve) => (wake = resolve));
  const onError = (error: unknown) => {
    errors.push(error);
    wake();
  };
  for (const term of terms) {
    const loop = (term as unknown as { _core?: { _writeBuffer?: Record<string, unknown> } })._core?._writeBuffer;
    const inner = loop?._innerWrite;
    if (typeof inner === "function")
      loop!._innerWrite = function (this: unknown, ...args: unknown[]) {
        try {
          return inner.apply(this, args);
        } catch (error) {
          onError(error);
        }
      };
  }
  process.on("uncaughtException", onError);
  process.on("unhandledRejection", onError);
  try {
    return { result: await body({ errors, crashed }), errors };
  } finally {
    process.off("uncaughtException", onError);
    process.off("unhandledRejection", onError);
  }
}

const describeError = (e: unknown) => (e instanceof Error ? (e.stack ?? e.message) : String(e)).slice(0, 1500);
const show = (bytes: Uint8Array) => JSON.stringify(new TextDecoder().decode(bytes)).slice(0, 600);

// ---------------------------------------------------------------------------------------------
// xterm

interface Config {
  name: string;
  cols: number;
  rows: number;
  scrollback: number;
}

/** Every configuration aic makes an emulator in: the model's screen, the CommandScreen, a Shell tab. */
const CONFIGS: Config[] = [
  { name: "the model's screen", cols: 160, rows: 50, scrollback: 1074 },
  { name: "the CommandScreen", cols: 160, rows: 50, scrollback: 0 },
  { name: "a Shell tab", cols: 80, rows: 24, scrollback: 10_000 },
];

const emulator = (c: Pick<Config, "cols" | "rows" | "scrollback">) =>
  tameEmulator(
    new Terminal({
      cols: c.cols,
      rows: c.rows,
      scrollback: c.scrollback,
      allowProposedApi: true,
      convertEol: false,
      logLevel: "off",
    }),
  );

/** What is wrong with the emulator's state as aic reads it (the screen, the scrollback, the cells it paints). */
function stateProblems(term: XTerm, deep: boolean): string[] {
  const problems: string[] = [];
  const b = term.buffer.active;
  // xterm 6.0 lets a combining mark right after a control or a sequence advance the cursor without printing, so at
  // the right margin it can stand one past the pending-wrap column (cols + 1); aic's reads at the cursor allow it.
  if (!(b.cursorX >= 0 && b.cursorX <= term.cols + 1))
    problems.push(`cursorX ${b.cursorX} outside 0..${term.cols + 1}`);
  if (!(b.cursorY >= 0 && b.cursorY < term.rows)) problems.push(`cursorY ${b.cursorY} outside 0..${term.rows - 1}`);
  try {
    // As TerminalRenderer.screen and paintTerminal read it. A screen line may be missing: after some reflows xterm 6.0
    // leaves the buffer a line short (see the regression below), and every reader in aic skips a missing line.
    const cell = b.getNullCell();
    for (let y = 0; y < term.rows; y++) {
      const line = b.getLine(b.baseY + y);
      if (!line) continue;
      line.translateToString(true);
      if (!deep) continue;
      for (let x = 0; x < term.cols; x++) {
        line.getCell(x, cell);
        if (cell.getWidth() === 0) continue;
        cell.getChars();
        if (!cell.isFgDefault() && !cell.isFgRGB() && cell.getFgColor() > 255) problems.push(`fg ${cell.getFgColor()}`);
        if (!cell.isBgDefault() && !cell.isBgRGB() && cell.getBgColor() > 255) problems.push(`bg ${cell.getBgColor()}`);
      }
    }
    if (deep)
      // As TerminalRenderer.extract reads the finished lines.
      for (let i = 0; i < b.length; i++) {
        const line = b.getLine(i);
        line?.translateToString(!(b.getLine(i + 1)?.isWrapped ?? false));
      }
  } catch (error) {
    problems.push(`reading the buffer threw: ${describeError(error)}`);
  }
  return problems;
}

/** Writes `chunk` and resolves when xterm has parsed it (its callback ran). */
const written = (term: XTerm, chunk: Uint8Array | string) => new Promise<void>((resolve) => term.write(chunk, resolve));

interface FuzzResult {
  problems: string[];
  writes: number;
  callbacks: number;
}

/**
 * Feeds `ops` to a fresh emulator in random chunks, waiting for every write's callback at each sync point
 * (every 128 writes, and before each resize), then checks it still shows a line written after the fuzz.
 */
async function fuzzXterm(config: Config, seed: number, ops: Op[], make = emulator): Promise<FuzzResult> {
  const r = new Rng(seed ^ 0x9e3779b9);
  const term = make(config);
  let writes = 0;
  let callbacks = 0;
  const problems: string[] = [];
  const { errors } = await collectingCrashes([term], async ({ errors, crashed }) => {
    let pending: Promise<void>[] = [];
    let syncs = 0;
    let fed: Uint8Array[] = []; // the chunks since the last sync point, for the report
    const sync = async (where: string) => {
      const all = Promise.all(pending);
      pending = [];
      await Promise.race([all, crashed]);
      if (errors.length) {
        problems.push(`${where}: crashed after the chunks ${fed.map(show).join(" + ").slice(-1500)}`);
        return false;
      }
      const state = stateProblems(term, ++syncs % 32 === 0);
      if (state.length) problems.push(`${where}: ${state.join("; ")}; after ${fed.map(show).join(" + ").slice(-800)}`);
      fed = [];
      return state.length === 0;
    };
    const write = (chunk: Uint8Array | string) => {
      writes++;
      pending.push(written(term, chunk).then(() => void callbacks++));
    };
    let run: Uint8Array[] = [];
    const feedRun = async (index: number) => {
      for (const chunk of chunks(r, concat(run))) {
        write(chunk);
        fed.push(chunk);
        if (pending.length >= 128 && !(await sync(`op ${index}`))) return false;
      }
      run = [];
      return sync(`op ${index}`);
    };
    for (let i = 0; i < ops.length; i++) {
      const op = ops[i]!;
      if ("bytes" in op) {
        run.push(op.bytes);
        continue;
      }
      if (!(await feedRun(i))) return;
      try {
        term.resize(...op.resize);
      } catch (error) {
        problems.push(`op ${i}: resize to ${op.resize.join("x")} threw: ${describeError(error)}`);
        return;
      }
    }
    if (!(await feedRun(ops.length))) return;
    // The emulator still works: a reset, then a known line.
    write("\x1bcstill-alive");
    if (!(await sync("after the fuzz"))) return;
    const b = term.buffer.active;
    const line = b.getLine(b.baseY + b.cursorY)?.translateToString(true);
    if (line !== "still-alive") problems.push(`after the fuzz the cursor's line reads ${JSON.stringify(line)}`);
    if (b.type !== "normal") problems.push(`after a reset the ${b.type} screen is active`);
    problems.push(...stateProblems(term, true));
  });
  for (const error of errors) problems.push(`uncaught: ${describeError(error)}`);
  if (callbacks !== writes && !errors.length)
    problems.push(`${writes - callbacks} of ${writes} write callbacks never ran`);
  term.dispose();
  return { problems, writes, callbacks };
}

/** With a failure, the first op that crashes a fresh emulator fed one op per write, to put in the report. */
async function locateCrash(config: Config, ops: Op[], make = emulator): Promise<string> {
  const term = make(config);
  const { result } = await collectingCrashes([term], async ({ errors, crashed }) => {
    for (let i = 0; i < ops.length; i++) {
      const op = ops[i]!;
      try {
        if ("resize" in op) term.resize(...op.resize);
        else await Promise.race([written(term, op.bytes), crashed]);
      } catch (error) {
        errors.push(error);
      }
      const state = errors.length ? [] : stateProblems(term, false);
      if (errors.length || state.length) {
        const context = ops
          .slice(Math.max(0, i - 8), i + 1)
          .map((o) => ("resize" in o ? `resize ${o.resize}` : show(o.bytes)));
        const what = errors.length ? describeError(errors[0]) : state.join("; ");
        return `op ${i} breaks it (${what}); the ops up to it:\n${context.join("\n")}`;
      }
    }
    return "fed one op at a time, no op breaks it (the chunking matters)";
  });
  term.dispose();
  return result;
}

/** Sequences the xterm fuzz feeds each configuration (three seeds each); the console and the binary get more. */
const XTERM_SEQUENCES = 12_000;
const XTERM_SEEDS = [SEED, SEED + 1, SEED + 2];
let sequencesFed = 0;

describe("xterm through tameEmulator survives hostile output", () => {
  // The harness itself: an emulator whose parser throws is reported with the input, not waited on forever.
  test("a parser that throws is reported", async () => {
    const planted = (c: Pick<Config, "cols" | "rows" | "scrollback">) => {
      const term = new Terminal({
        cols: c.cols,
        rows: c.rows,
        scrollback: c.scrollback,
        allowProposedApi: true,
        logLevel: "off",
      });
      term.parser.registerCsiHandler({ intermediates: "%", final: "q" }, () => {
        throw new Error("planted");
      });
      return term;
    };
    const ops: Op[] = [{ bytes: encoder.encode("before\x1b[%q after") }];
    const { problems } = await fuzzXterm(CONFIGS[0]!, 1, ops, planted);
    expect(problems.join("\n")).toContain("planted");
    expect(await locateCrash(CONFIGS[0]!, ops, planted)).toMatch(/^op 0 breaks it \(Error: planted/);
  });

  for (const config of CONFIGS)
    for (const seed of XTERM_SEEDS)
      test(
        `${config.name} (${config.cols}x${config.rows}, scrollback ${config.scrollback}), seed ${seed}`,
        async () => {
          const ops = corpus(seed, XTERM_SEQUENCES, [config.cols, config.rows]);
          sequencesFed += XTERM_SEQUENCES;
          const { problems, writes, callbacks } = await fuzzXterm(config, seed, ops);
          if (problems.length) problems.push(`seed ${seed}: ${await locateCrash(config, ops)}`);
          expect(problems).toEqual([]);
          expect(callbacks).toBe(writes);
          expect(writes).toBeGreaterThan(1000);
        },
        FUZZ_MS,
      );
});

// ---------------------------------------------------------------------------------------------
// Regression cases: inputs that once ended aic

/** Fills the screen with text, writes `sequence`, and returns the screen's lines with any crash. */
async function afterSequence(config: Omit<Config, "name">, sequence: string) {
  const term = emulator(config);
  const fill = Array.from({ length: config.rows }, (_, i) => `row-${i}`.padEnd(config.cols, "#")).join("\r\n");
  const { result, errors } = await collectingCrashes([term], async ({ crashed }) => {
    let called = false;
    await Promise.race([written(term, fill + sequence).then(() => void (called = true)), crashed]);
    const b = term.buffer.active;
    const lines = Array.from({ length: config.rows }, (_, y) => b.getLine(b.baseY + y)?.translateToString(true));
    await Promise.race([written(term, "\x1bc\r\nstill-alive"), crashed]);
    const after = term.buffer.active.getLine(1)?.translateToString(true);
    return { called, lines, after };
  });
  term.dispose();
  return { ...result, errors: errors.map(describeError) };
}

describe("regressions", () => {
  // Erase above (ED 1, or DECSED 1) with the cursor sent past the last cell of a screen that never scrolled threw
  // inside xterm wherever there is scrollback (at scrollback 0 it did not, but the screen must be erased all the same).
  test.each([
    [160, 50, 1074],
    [160, 50, 0],
    [80, 24, 10_000],
    [80, 24, 0],
  ])("CUP 99;200 then ED 1 at %dx%d (scrollback %d) erases the screen", async (cols, rows, scrollback) => {
    for (const sequence of ["\x1b[99;200H\x1b[1J", "\x1b[99;200H\x1b[?1J"]) {
      const { called, lines, after, errors } = await afterSequence({ cols, rows, scrollback }, sequence);
      expect(errors).toEqual([]);
      expect(called).toBe(true);
      expect(lines).toEqual(Array(rows).fill(""));
      expect(after).toBe("still-alive");
    }
  });

  // The alternate screens have no scrollback and never tripped it; the erase still covers the whole screen there.
  test.each(["\x1b[?1049h", "\x1b[?47h", "\x1b[?1047h"])(
    "%j then CUP 99;200 and ED 1 erases the screen",
    async (alt) => {
      const { called, lines, errors } = await afterSequence(
        { cols: 160, rows: 50, scrollback: 1074 },
        `${alt}x\x1b[99;200H\x1b[1J`,
      );
      expect(errors).toEqual([]);
      expect(called).toBe(true);
      expect(lines).toEqual(Array(50).fill(""));
    },
  );
});

describe("regressions found by the fuzz", () => {
  // xterm 6.0's Terminal.resize throws (Buffer.resize reads a line past the buffer) on a scrollback-0 emulator after
  // this plain text and these sizes. The CommandScreen has scrollback 0 and follows the Console's size (at least
  // 20x5) while a program is "full screen", which includes application cursor keys (?1h) on the normal screen; a
  // throw there ends aic. tameEmulator guards parsing, not resize: this case fails until resize is guarded too.
  test("resizing a scrollback-0 emulator after wrapped output does not throw", async () => {
    const steps: (string | [number, number])[] = [
      "\x1b[?1h\x1b[160G" + "x".repeat(190) + "   \n" + "x".repeat(134),
      [86, 6],
      "\n\n\n",
      [160, 50],
      "\n".repeat(49),
      [98, 27],
      [160, 50],
    ];
    const term = emulator({ cols: 160, rows: 50, scrollback: 0 });
    const thrown: string[] = [];
    const { result, errors } = await collectingCrashes([term], async ({ crashed }) => {
      for (const step of steps)
        if (typeof step === "string") await Promise.race([written(term, step), crashed]);
        else
          try {
            term.resize(...step);
          } catch (error) {
            thrown.push(`resize to ${step.join("x")}: ${describeError(error)}`);
          }
      await Promise.race([written(term, "\x1bcstill-alive"), crashed]);
      return term.buffer.active.getLine(0)?.translateToString(true);
    });
    term.dispose();
    expect(errors.map(describeError)).toEqual([]);
    expect(thrown).toEqual([]);
    expect(result).toBe("still-alive");
  });

  // Untamed, xterm 6.0 throws in print: at scrollback 0 a wrapped line, CNL 4 and two resizes (64x8, back to 160x50)
  // leave the buffer a line short, and printing on the missing last row reads past it. The CommandScreen is resized
  // so when a person's pane changes size. Tamed, what is printed there is dropped and the emulator goes on.
  test("printing on the row a reflow lost does not throw, and the emulator goes on", async () => {
    const term = emulator({ cols: 160, rows: 50, scrollback: 0 });
    const { result, errors } = await collectingCrashes([term], async ({ crashed }) => {
      await Promise.race([written(term, "x".repeat(285) + "\x1b[4E"), crashed]);
      term.resize(64, 8);
      term.resize(160, 50);
      const calls: string[] = [];
      for (const chunk of [
        "\x1b[50;1Hbottom-line",
        "\x1b[1J\x1b[2K\x1b[5L\x1b[5M\x1b[@\x1b[P\n\n\nafter",
        "\x1bc\r\nstill-alive",
      ])
        await Promise.race([written(term, chunk).then(() => calls.push(chunk)), crashed]);
      return { calls: calls.length, line: term.buffer.active.getLine(1)?.translateToString(true) };
    });
    term.dispose();
    expect(errors.map(describeError)).toEqual([]);
    expect(result).toEqual({ calls: 3, line: "still-alive" });
  });

  // A combining mark right after a sequence advances xterm's cursor without printing: at the right margin it stands
  // one past the pending-wrap column. Nothing may throw there, and the next line is printed as usual.
  test("a combining mark after a sequence at the right margin", async () => {
    const term = emulator({ cols: 2, rows: 5, scrollback: 0 });
    const { result, errors } = await collectingCrashes([term], async ({ crashed }) => {
      await Promise.race([written(term, "ab\x1b[m\u0301"), crashed]);
      const b = term.buffer.active;
      b.getLine(b.baseY + b.cursorY)
        ?.getCell(b.cursorX, b.getNullCell())
        ?.getChars(); // as paintTerminal reads it
      await Promise.race([written(term, "\x1b[5@\x1b[5P\x1b[K\x1b[5X\x1b[2b\x1b[I\x1b[Z\r\nz"), crashed]);
      return { problems: stateProblems(term, true), line: b.getLine(b.baseY + b.cursorY)?.translateToString(true) };
    });
    term.dispose();
    expect(errors.map(describeError)).toEqual([]);
    expect(result.problems).toEqual([]);
    expect(result.line).toStartWith("z");
  });
});

// ---------------------------------------------------------------------------------------------
// ConsoleStream

const CONSOLE_SEQUENCES = 40_000;

describe("ConsoleStream survives hostile output", () => {
  test(
    `the corpus through the SGR parser into a LogPane, seed ${SEED}`,
    async () => {
      await using s = await createTestRenderer({ width: 100, height: 30, exitOnCtrlC: false });
      const pane = new LogPane(ot, s.renderer, { width: "100%", height: "100%" });
      s.renderer.root.add(pane.box);
      const stream = new ConsoleStream(ot, pane, () => {}); // flushed by hand, not once per frame
      const r = new Rng(SEED ^ 0x85ebca6b);
      const problems: string[] = [];
      const { errors } = await collectingCrashes([], async () => {
        let flushes = 0;
        for (const chunk of chunks(r, corpusBytes(corpus(SEED + 100, CONSOLE_SEQUENCES)))) {
          try {
            stream.write(chunk);
            if (r.chance(0.3)) {
              stream.flush();
              if (++flushes % 500 === 0) await s.renderOnce();
            }
          } catch (error) {
            problems.push(`after ${show(chunk)}: ${describeError(error)}`);
            return;
          }
        }
        stream.end();
        stream.write(encoder.encode("\x1b[0m\r\nstill-alive\r\n"));
        stream.flush();
        await s.renderOnce();
        await s.renderOnce();
        if (!s.captureCharFrame().includes("still-alive"))
          problems.push(`the pane does not show still-alive:\n${s.captureCharFrame()}`);
      });
      sequencesFed += CONSOLE_SEQUENCES;
      expect(problems).toEqual([]);
      expect(errors.map(describeError)).toEqual([]);
    },
    FUZZ_MS,
  );
});

// ---------------------------------------------------------------------------------------------
// End to end: the compiled binary

/** Sequences in the file the command cats (a few hundred KB). */
const E2E_SEQUENCES = 20_000;

describe("aic survives a command printing hostile output", () => {
  test(
    `cat of the corpus, then echo after-fuzz, seed ${SEED}`,
    async () => {
      const cwd = scratch();
      const bytes = corpusBytes(corpus(SEED + 200, E2E_SEQUENCES));
      expect(bytes.length).toBeGreaterThan(200_000);
      writeFileSync(join(cwd, "fuzz.bin"), bytes);
      const srv = fixtures.serve([
        { toolCalls: [{ id: "fuzz", arguments: JSON.stringify({ command: "cat fuzz.bin" }) }] },
        { toolCalls: [{ id: "after", arguments: JSON.stringify({ command: "echo after-fuzz" }) }] },
        { content: "TASKCOMPLETE" },
      ]);
      const run = await runAic([...headless(srv.url, "test-model", "--json", "--auto-approve"), "print the file"], {
        cwd,
      });
      sequencesFed += E2E_SEQUENCES;
      const end = jsonLines(run.stdout).find((e) => e.type === "end");
      expect({ code: run.code, end, stderr: run.code ? run.stderr.slice(-3000) : "" }).toMatchObject({
        code: 0,
        end: { status: "completed" },
        stderr: "",
      });
      expect(toolAnswer(srv.requests.at(-1), "fuzz")).not.toBe("");
      expect(toolAnswer(srv.requests.at(-1), "after")).toContain("after-fuzz");
      console.log(`emulator fuzz: ${sequencesFed} sequences fed in this run`);
    },
    FUZZ_MS,
  );
});
