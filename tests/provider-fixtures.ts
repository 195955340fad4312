/**
 * Provider replies that aic has misjudged, one per shape, each with where its wording and shape
 * were read. Each is played on the wire through the fake OpenAI server: the "retry" and "fatal"
 * ones to the ModelClient (model-client.test.ts), the "cut_off" ones to the compiled dist/aic
 * (provider-regressions.test.ts); the tests check what aic does with it:
 *
 * - "retry":   a passing limit or a failed attempt. aic waits (at least `hintMs`, when the server
 *              names a wait) and asks again; the run completes.
 * - "fatal":   waiting cannot help. aic gives up after that one request with one clear line.
 * - "cut_off": the answer hit the output limit in the middle of a tool call. aic must tell the
 *              model that in the tool answer, naming the limit, instead of advising on JSON quoting.
 *
 * An HTTP error is given as `status` + `headers` + `body` (the exact JSON value, or text, the
 * server sends). A reply inside a 200 stream is given as `frames`: the SSE frames, verbatim.
 *
 * Numbers that set a wait (Retry-After, retryDelay, "Please retry in …") are shortened to about a
 * second so the suite stays quick; everything else is as the sources quote it, and where a body is
 * assembled from two sources the `source` says so.
 */

export type Outcome = "retry" | "fatal" | "cut_off";

export interface ProviderFixture {
  /** Provider and shape, as a person would name them (the test's name). */
  name: string;
  /** Where the wording and shape come from: repo + path, URL, or "reported in <issue URL>". */
  source: string;
  /** HTTP status of the response (200 for a reply inside a stream). */
  status: number;
  /** Response headers that matter (Retry-After and the like). */
  headers?: Record<string, string>;
  /** The HTTP error body: the exact JSON value, or text. */
  body?: unknown;
  /** A 200 SSE stream: each frame verbatim, blank line included. */
  frames?: string[];
  expected: Outcome;
  /** retry: the wait the server asks for, in ms (from Retry-After or from the body); aic must wait at least this. */
  hintMs?: number;
}

/** One `data:` frame of a chat.completion.chunk, as OpenAI-compatible servers stream them. */
function chunk(id: string, model: string, delta: Record<string, unknown>, finishReason: string | null = null): string {
  const payload = {
    id,
    object: "chat.completion.chunk",
    created: 1754500000,
    model,
    choices: [{ index: 0, delta, logprobs: null, finish_reason: finishReason }],
  };
  return `data: ${JSON.stringify(payload)}\n\n`;
}

// ── 1. Groq: the ordinary tokens-per-minute 429 ────────────────────────────────────────────────
// Its message ends with an upsell link to …/settings/billing, which made aic call it an exhausted
// account. It is a per-minute limit: Groq's docs say a 429 carries `retry-after` (seconds).
const GROQ_TPM: ProviderFixture = {
  name: "Groq: tokens-per-minute 429 with an upgrade link to settings/billing",
  source:
    "body reported in https://github.com/ago19800/HomeMind/issues/29 (Error code: 429, 'Need more tokens? Upgrade to Dev Tier today at https://console.groq.com/settings/billing', type 'tokens', code 'rate_limit_exceeded'; same shape in https://github.com/continuedev/continue/issues/10920 and https://github.com/Aider-AI/aider/issues/3265); retry-after on every 429 per https://console.groq.com/docs/rate-limits (quoted in https://dev.to/vectle/groq-429s-your-retry-loop-is-blind-read-the-headers-instead-l0j). Wait shortened: 'Please try again in 1s' with retry-after: 1 (Go-style durations, as Groq prints '1.984999999s', '9m38.016s')",
  status: 429,
  headers: { "retry-after": "1" },
  body: {
    error: {
      message:
        "Rate limit reached for model `llama-3.3-70b-versatile` in organization `org_01kes94v04f9ramd2n1vj4gjnc` service tier `on_demand` on tokens per minute (TPM): Limit 12000, Used 11240, Requested 1234. Please try again in 1s. Need more tokens? Upgrade to Dev Tier today at https://console.groq.com/settings/billing",
      type: "tokens",
      code: "rate_limit_exceeded",
    },
  },
  expected: "retry",
  hintMs: 1000,
};

// ── 2. Gemini: the free tier's per-minute 429 ──────────────────────────────────────────────────
// "You exceeded your current quota, please check your plan and billing details" — Google's words
// for every quota, per-minute ones included. The wait is only in the body: RetryInfo.retryDelay and
// "Please retry in …". No Retry-After header is documented or reported, so none is sent.
const GEMINI_ERROR = {
  code: 429,
  message:
    "You exceeded your current quota, please check your plan and billing details. For more information on this error, head to: https://ai.google.dev/gemini-api/docs/rate-limits. To monitor your current usage, head to: https://ai.dev/rate-limit. \n* Quota exceeded for metric: generativelanguage.googleapis.com/generate_content_free_tier_requests, limit: 10, model: gemini-2.5-flash\nPlease retry in 1.2s.",
  status: "RESOURCE_EXHAUSTED",
  details: [
    {
      "@type": "type.googleapis.com/google.rpc.Help",
      links: [
        { description: "Learn more about Gemini API quotas", url: "https://ai.google.dev/gemini-api/docs/rate-limits" },
      ],
    },
    {
      "@type": "type.googleapis.com/google.rpc.QuotaFailure",
      violations: [
        {
          quotaMetric: "generativelanguage.googleapis.com/generate_content_free_tier_requests",
          quotaId: "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
          quotaDimensions: { location: "global", model: "gemini-2.5-flash" },
          quotaValue: "10",
        },
      ],
    },
    { "@type": "type.googleapis.com/google.rpc.RetryInfo", retryDelay: "1.2s" },
  ],
};

const GEMINI_SOURCE =
  "message, details order (Help, QuotaFailure, RetryInfo) and 'Please retry in …' reported in https://github.com/continuedev/continue/issues/12749 and https://github.com/BerriAI/litellm/issues/33421 (those quote limit: 0); a per-minute free-tier violation (quotaId GenerateRequestsPerMinutePerProjectPerModel-FreeTier, quotaValue '10') reported in https://github.com/RooCodeInc/Roo-Code/issues/3883 and https://dev.to/nils44344/gemini-api-429-resourceexhausted-why-your-limit-is-0-68o ('limit: 5 … requests per minute used up'); assembled, wait shortened to 1.2s";

const GEMINI_ARRAY: ProviderFixture = {
  name: "Gemini (OpenAI-compatible): free-tier per-minute RESOURCE_EXHAUSTED, array-wrapped",
  source: `the OpenAI-compatible endpoint (v1beta/openai/chat/completions) answers a 429 with a JSON array [{"error": {code, message, status}}], reported in https://github.com/n4ze3m/page-assist/issues/406 (curl against that endpoint); ${GEMINI_SOURCE}`,
  status: 429,
  body: [{ error: GEMINI_ERROR }],
  expected: "retry",
  hintMs: 1200,
};

const GEMINI_OBJECT: ProviderFixture = {
  name: "Gemini: free-tier per-minute RESOURCE_EXHAUSTED, plain error object",
  source: `the same google.rpc.Status unwrapped, {"error": {…}}, as Gemini's native endpoint sends it and proxies relay it (https://github.com/BerriAI/litellm/issues/33421, https://github.com/RooCodeInc/Roo-Code/issues/3883); ${GEMINI_SOURCE}`,
  status: 429,
  body: { error: GEMINI_ERROR },
  expected: "retry",
  hintMs: 1200,
};

// ── 3. vLLM: an error object inside a 200 stream (gpt-oss, Harmony parser) ────────────────────
// vLLM's chat_completion_stream_generator catches any exception after the 200 has gone out and
// sends `data: {"error": ErrorResponse}` then `data: [DONE]`; the ErrorResponse is always
// BadRequestError / 400 there, whatever went wrong. With gpt-oss the exception is a HarmonyError
// from the model's own tokens: sampling again usually gets through.
const VLLM_ID = "chatcmpl-4f7d2a9be2a04f0b9a1c6d2e8b3f5a10";
const VLLM_MODEL = "openai/gpt-oss-120b";
const VLLM_HARMONY: ProviderFixture = {
  name: "vLLM (gpt-oss): HarmonyError as an error object inside the 200 stream",
  source:
    'vllm-project/vllm vllm/entrypoints/openai/serving_chat.py @003fe5932dc9 (chat_completion_stream_generator: `except Exception as e: … data = self.create_streaming_error_response(str(e)); yield f"data: {data}\\n\\n"` then `yield "data: [DONE]\\n\\n"`), vllm/entrypoints/openai/serving_engine.py (create_streaming_error_response: err_type "BadRequestError", HTTPStatus.BAD_REQUEST, json.dumps({"error": ErrorResponse.model_dump()})), protocol.py ErrorResponse {object: "error", message, type, param: None, code}; the message and the 200 OK after \'Error in chat completion stream generator.\' reported in https://github.com/openai/harmony/issues/38 (also https://github.com/vllm-project/vllm/issues/23567, and \'errors as 200-OK with code:400\' in https://github.com/tenstorrent/vllm/issues/386)',
  status: 200,
  frames: [
    chunk(VLLM_ID, VLLM_MODEL, { role: "assistant", content: "" }),
    chunk(VLLM_ID, VLLM_MODEL, { reasoning_content: "We need to list the files first." }),
    `data: ${JSON.stringify({
      error: {
        object: "error",
        message: 'unexpected tokens remaining in message header: ["––commentary"]',
        type: "BadRequestError",
        param: null,
        code: 400,
      },
    })}\n\n`,
    "data: [DONE]\n\n",
  ],
  expected: "retry",
};

// ── 4. A tool call cut off by the output limit ────────────────────────────────────────────────
// The stream ends with finish_reason "length" in the middle of the call's arguments, which are
// therefore not valid JSON. The model must be told its answer was cut at the output limit (and
// which limit), not that it quoted its JSON badly.
const CUT_ID = "chatcmpl-9b1e7c3d5a2f4e6081d7c2b4a6e8f0d2";
const CUT_MODEL = "test-model";
export const CUT_OFF_CALL_ID = "call_7Yq2kLm9Np3Rs5Tv8Wx1Za4B";
const CUT_OFF: ProviderFixture = {
  name: "finish_reason length in the middle of a tool call's arguments",
  source:
    'finish_reason "length": \'if the maximum number of tokens specified in the request was reached\' (OpenAI API reference, https://platform.openai.com/docs/api-reference/chat/object); OpenAI and non-streamed vLLM report "length" for a tool call cut by max_tokens, whose streamed arguments do not parse (https://github.com/vllm-project/vllm/issues/53269); tool-call delta frames as quoted in https://github.com/experientiallabs/experiential/issues/758',
  status: 200,
  frames: [
    chunk(CUT_ID, CUT_MODEL, { role: "assistant", content: null }),
    chunk(CUT_ID, CUT_MODEL, {
      tool_calls: [
        { index: 0, id: CUT_OFF_CALL_ID, type: "function", function: { name: "execute_bash", arguments: "" } },
      ],
    }),
    chunk(CUT_ID, CUT_MODEL, { tool_calls: [{ index: 0, function: { arguments: '{"command": "cat > notes.md' } }] }),
    chunk(CUT_ID, CUT_MODEL, {
      tool_calls: [{ index: 0, function: { arguments: " <<'EOF'\\n# Notes\\n\\nThe parser reads the hea" } }],
    }),
    chunk(CUT_ID, CUT_MODEL, {}, "length"),
    "data: [DONE]\n\n",
  ],
  expected: "cut_off",
};

// ── 5. Control: OpenAI's real exhausted quota stays fatal ─────────────────────────────────────
const OPENAI_INSUFFICIENT_QUOTA: ProviderFixture = {
  name: "OpenAI: 429 insufficient_quota without a retry hint",
  source:
    "reported in https://github.com/ChatGPTNextWeb/NextChat/issues/3664 (same body in https://github.com/ChatGPTNextWeb/NextChat/issues/3123; '429 You exceeded your current quota …' in https://github.com/continuedev/continue/issues/11771); no Retry-After header is reported with it",
  status: 429,
  body: {
    error: {
      message:
        "You exceeded your current quota, please check your plan and billing details. For more information on this error, read the docs: https://platform.openai.com/docs/guides/error-codes/api-errors.",
      type: "insufficient_quota",
      param: null,
      code: "insufficient_quota",
    },
  },
  expected: "fatal",
};

export const PROVIDER_FIXTURES: ProviderFixture[] = [
  GROQ_TPM,
  GEMINI_ARRAY,
  GEMINI_OBJECT,
  VLLM_HARMONY,
  CUT_OFF,
  OPENAI_INSUFFICIENT_QUOTA,
];
