/**
 * What OpenAI-compatible servers actually send when a prompt does not fit the model's context
 * window, and a control set of ordinary request errors from the same servers that are NOT
 * context overflow. Used by context-overflow.test.ts to check that aic recognises the first kind
 * (compresses and retries) and gives up at once on the second.
 *
 * Every entry names where its wording and shape were read: a server's own source file, its docs,
 * or an issue/PR quoting a real response body. Where a body is assembled from two sources (real
 * wording from one, the server's envelope from another) or a field had to be completed, the
 * `source` says so explicitly. Numbers inside messages are the ones quoted in the source.
 *
 * `status` is the HTTP status. For `inStream` entries the status is 200: the server opened an SSE
 * stream and then sent `data: {"error": …}` (or an `event: error` frame when `eventFrame` is set).
 * For those, `body` is the whole JSON object carried by the data frame; the test hands
 * `body.error ?? body` to the fake server, which wraps it as `{"error": …}` again.
 */

export interface ErrorFixture {
  /** Server or provider, as a person would name it. */
  server: string;
  /** Few words that tell this fixture apart from the server's others (used in the test name). */
  short: string;
  /** Where the wording and shape come from: repo + path, URL, or "reported in <issue URL>". */
  source: string;
  /** HTTP status of the response (200 for in-stream errors). */
  status: number;
  /** The exact JSON value (or text) the server sends. */
  body: unknown;
  /** The error arrives inside a 200 SSE stream instead of as an HTTP error. */
  inStream?: boolean;
  /** In-stream error sent as `event: error` + `data:` (LM Studio 0.4), not a bare `data:` frame. */
  eventFrame?: boolean;
}

// ---------------------------------------------------------------------------------------------
// Context overflow: the prompt (or prompt + requested output) does not fit the context window.
// Compressing the history and retrying is the right response to every one of these.
//
// Borderline cases kept here, with the reason:
// - "prompt + max_tokens exceed the window" (vLLM 'max_tokens' … is too large, SGLang "Requested
//   token count", Anthropic "input length and `max_tokens` exceed context limit", TGI
//   "`inputs` tokens + `max_new_tokens` must be <="): aic sends max_tokens=8000 to every non-GPT
//   model, so these fire exactly when the history has grown; shrinking the prompt fixes them as
//   long as the output part alone fits (see NOT_OVERFLOW for the case where it does not).
// - llama.cpp HTTP 500 "Context size has been exceeded.": a 5xx, but the text is explicit and a
//   blind same-size retry can only fail again; compressing is the useful response.
// ---------------------------------------------------------------------------------------------

export const CONTEXT_OVERFLOW_FIXTURES: ErrorFixture[] = [
  // ── OpenAI ──────────────────────────────────────────────────────────────────────────────────
  {
    server: "OpenAI",
    short: "messages resulted in N tokens",
    source: "reported in https://github.com/chathub-dev/chathub/issues/126",
    status: 400,
    body: {
      error: {
        message:
          "This model's maximum context length is 4097 tokens. However, your messages resulted in 4294 tokens. Please reduce the length of the messages.",
        type: "invalid_request_error",
        param: "messages",
        code: "context_length_exceeded",
      },
    },
  },
  {
    server: "OpenAI",
    short: "messages + completion",
    source: "reported in https://github.com/mckaywrigley/chatbot-ui/issues/102",
    status: 400,
    body: {
      error: {
        message:
          "This model's maximum context length is 4097 tokens. However, you requested 4120 tokens (3120 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.",
        type: "invalid_request_error",
        param: "messages",
        code: "context_length_exceeded",
      },
    },
  },
  {
    server: "OpenAI",
    short: "GPT-5 configured input limit",
    source:
      "message reported in https://github.com/BerriAI/litellm/issues/18927 (gpt-5.1); the issue quotes only the message, so the other error fields (OpenAI sends code context_length_exceeded) are left out here on purpose",
    status: 400,
    body: { error: { message: "Input tokens exceed the configured limit of 272000 tokens." } },
  },

  // ── Azure OpenAI ────────────────────────────────────────────────────────────────────────────
  {
    server: "Azure OpenAI",
    short: "context_length_exceeded",
    source: "reported in https://github.com/microsoft/kernel-memory/issues/516 (Azure.RequestFailedException content)",
    status: 400,
    body: {
      error: {
        message:
          "This model's maximum context length is 8192 tokens. However, your messages resulted in 10383 tokens. Please reduce the length of the messages.",
        type: "invalid_request_error",
        param: "messages",
        code: "context_length_exceeded",
      },
    },
  },

  // ── vLLM ────────────────────────────────────────────────────────────────────────────────────
  {
    server: "vLLM",
    short: "≤0.10.0 flat object",
    source:
      "reported in https://github.com/vllm-project/vllm/issues/20409 (flat {object:'error',…} envelope of vllm/entrypoints/openai/protocol.py ErrorResponse before v0.10.1; trailing ' None' is vLLM's)",
    status: 400,
    body: {
      object: "error",
      message:
        "This model's maximum context length is 16384 tokens. However, you requested 19591 tokens (9591 in the messages, 10000 in the completion). Please reduce the length of the messages or completion. None",
      type: "BadRequestError",
      param: null,
      code: 400,
    },
  },
  {
    server: "vLLM",
    short: "'max_tokens' is too large (prompt grew)",
    source:
      "reported in github.com/HasanAldhahi/cross-precision-llm-deployment-biomni biomni/agent/SUMMARIZATION_FIX.md (vLLM 0.10–0.17 wording from vllm/entrypoints/openai/serving_engine.py _validate_input); 8192 output fits the 65536 window, the prompt is what grew",
    status: 400,
    body: {
      error: {
        message:
          "'max_tokens' or 'max_completion_tokens' is too large: 8192. This model's maximum context length is 65536 tokens and your request has 57879 input tokens (8192 > 65536 - 57879). None",
        type: "BadRequestError",
        param: null,
        code: 400,
      },
    },
  },
  {
    server: "vLLM",
    short: "renderer 'You passed N input tokens'",
    source:
      "wording from vllm-project/vllm vllm/renderers/params.py TokenizeParams._token_len_check (param 'input_tokens'); message as reported in https://github.com/proxysoul/Empryo/issues/52; envelope vllm ErrorResponse{error: ErrorInfo}",
    status: 400,
    body: {
      error: {
        message:
          "You passed 202753 input tokens and requested 0 output tokens. However, the model's context length is only 202752 tokens, resulting in a maximum input length of 202752 tokens.",
        type: "BadRequestError",
        param: "input_tokens",
        code: 400,
      },
    },
  },

  // ── llama.cpp server (llama-server) ─────────────────────────────────────────────────────────
  {
    server: "llama.cpp",
    short: "exceed_context_size_error 400",
    source:
      "ggml-org/llama.cpp tools/server/server-context.cpp (send_error … ERROR_TYPE_EXCEED_CONTEXT_SIZE), server-common.cpp format_error_response (400, 'exceed_context_size_error'), server-task.cpp (adds n_prompt_tokens, n_ctx); body reported in https://github.com/ggml-org/llama.cpp/issues/19774 (quote cut after 'n_prompt_token…', last two fields completed from server-task.cpp)",
    status: 400,
    body: {
      error: {
        code: 400,
        message: "request (4390 tokens) exceeds the available context size (4096 tokens), try increasing it",
        type: "exceed_context_size_error",
        n_prompt_tokens: 4390,
        n_ctx: 4096,
      },
    },
  },
  {
    server: "llama.cpp",
    short: "in-stream before PR 16486",
    source:
      "reported in https://github.com/oobabooga/textgen/issues/7257 (HTTP 200 stream carrying the error); fixed upstream by https://github.com/ggml-org/llama.cpp/pull/16486, older builds still do this",
    status: 200,
    inStream: true,
    body: {
      error: {
        code: 400,
        message:
          "the request exceeds the available context size. try increasing the context size or enable context shift",
        type: "exceed_context_size_error",
        n_prompt_tokens: 14429,
        n_ctx: 8192,
      },
    },
  },
  {
    // Borderline: 5xx, but the text says exactly what is wrong; see the note at the top.
    server: "llama.cpp",
    short: "500 Context size has been exceeded",
    source:
      "reported in https://github.com/ggml-org/llama.cpp/issues/19774 (server_error from the decode path of tools/server/server-context.cpp)",
    status: 500,
    body: { error: { code: 500, message: "Context size has been exceeded.", type: "server_error" } },
  },

  // ── llama-cpp-python server ─────────────────────────────────────────────────────────────────
  {
    server: "llama-cpp-python",
    short: "OpenAI-style context_length_exceeded",
    source:
      "abetlen/llama-cpp-python llama_cpp/server/errors.py ErrorResponseFormatters.context_length_exceeded (message template and fields; numbers illustrative)",
    status: 400,
    body: {
      error: {
        message:
          "This model's maximum context length is 4096 tokens. However, you requested 12108 tokens (4108 in the messages, 8000 in the completion). Please reduce the length of the messages or completion.",
        type: "invalid_request_error",
        param: "messages",
        code: "context_length_exceeded",
      },
    },
  },

  // ── Ollama ──────────────────────────────────────────────────────────────────────────────────
  {
    server: "Ollama",
    short: "/v1 prompt longer than the context length",
    source:
      "ollama/ollama llm/llama_server.go (api.StatusError 400 with this message), middleware/openai.go writeError + openai/openai.go NewError (400 → type invalid_request_error, param null, code null)",
    status: 400,
    body: {
      error: {
        message:
          "the prompt is longer than the context length currently available to the model; shorten the prompt, adjust the context length in settings, or use a model with a longer context length",
        type: "invalid_request_error",
        param: null,
        code: null,
      },
    },
  },
  {
    server: "Ollama Cloud",
    short: "flat error string",
    source: "reported in https://github.com/dyad-sh/dyad/issues/3498 (cloud models; server code not public)",
    status: 400,
    body: {
      error:
        "prompt too long; exceeded max context length by 540451 tokens (ref: 00ad71bb-fea0-4639-9dc9-3ad800192057)",
    },
  },

  // ── LM Studio (closed source) ───────────────────────────────────────────────────────────────
  {
    server: "LM Studio",
    short: "n_keep >= n_ctx flat string",
    source: "reported in https://github.com/Gitlawb/openclaude/issues/353 (API Error: 400 with this body)",
    status: 400,
    body: {
      error:
        "The number of tokens to keep from the initial prompt is greater than the context length (n_keep: 13055>= n_ctx: 4096). Try to load the model with a larger context length, or provide a shorter input.",
    },
  },
  {
    server: "LM Studio",
    short: "Trying to keep the first N tokens",
    source:
      "reported in https://github.com/dyad-sh/dyad/issues/925 (body) and https://github.com/lmstudio-ai/lmstudio-bug-tracker/issues/237 (HTTP 400 with this wording)",
    status: 400,
    body: {
      error:
        "Trying to keep the first 14538 tokens when context the overflows. However, the model is loaded with context length of only 2048 tokens, which is not enough. Try to load the model with a larger context length, or provide a shorter input",
    },
  },
  {
    server: "LM Studio",
    short: "0.4 event: error in 200 stream",
    source:
      "reported in https://github.com/aaif-goose/goose/issues/11318 and https://github.com/lmstudio-ai/lmstudio-bug-tracker/issues/2322 (mitmweb capture, LM Studio 0.4.21); the frame also repeats the text as a top-level 'message', which the fake server drops",
    status: 200,
    inStream: true,
    eventFrame: true,
    body: {
      error: {
        message:
          "Input does not fit in context length. The input has 31430 tokens, but the context length only supports 30000 tokens.",
      },
      message:
        "Input does not fit in context length. The input has 31430 tokens, but the context length only supports 30000 tokens.",
    },
  },

  // ── Hugging Face TGI ────────────────────────────────────────────────────────────────────────
  {
    server: "TGI",
    short: "in-stream MaxTotalTokens",
    source:
      "huggingface/text-generation-inference router/src/server.rs chat_completions (stream: `Err(err) => yield Ok(err.into_openai_event())`), router/src/infer/mod.rs into_openai_event ({error:{message, http_status_code:422}}, 'Input validation error: {0}'), router/src/validation.rs ValidationError::MaxTotalTokens (numbers illustrative)",
    status: 200,
    inStream: true,
    body: {
      error: {
        message:
          "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 32768. Given: 24900 `inputs` tokens and 8000 `max_new_tokens`",
        http_status_code: 422,
      },
    },
  },
  {
    server: "TGI",
    short: "422 InputLength (non-stream)",
    source:
      "huggingface/text-generation-inference router/src/server.rs impl From<InferError> for (StatusCode, Json<ErrorResponse>) (ValidationError → 422, {error, error_type:'validation'}), router/src/validation.rs ValidationError::InputLength (numbers illustrative)",
    status: 422,
    body: {
      error: "Input validation error: `inputs` must have less than 4095 tokens. Given: 5310",
      error_type: "validation",
    },
  },

  // ── Together ────────────────────────────────────────────────────────────────────────────────
  {
    server: "Together",
    short: "TGI wording in OpenAI envelope",
    source: "reported in https://github.com/BerriAI/litellm/issues/4934 (Together_aiException body)",
    status: 400,
    body: {
      error: {
        message:
          "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4097. Given: 80125 `inputs` tokens and 4096 `max_new_tokens`",
        type: "invalid_request_error",
        param: "max_tokens",
        code: null,
      },
    },
  },

  // ── SGLang ──────────────────────────────────────────────────────────────────────────────────
  {
    server: "SGLang",
    short: "input longer than context length",
    source:
      "reported in https://github.com/QwenLM/Qwen3/issues/1321 (full body); wording from sgl-project/sglang python/sglang/srt/managers/tokenizer_manager.py _validate_one_request",
    status: 400,
    body: {
      object: "error",
      message: "The input (61709 tokens) is longer than the model's context length (40960 tokens).",
      type: "BadRequestError",
      param: null,
      code: 400,
    },
  },
  {
    server: "SGLang",
    short: "Requested token count (input + max_new_tokens)",
    source:
      "sgl-project/sglang python/sglang/srt/managers/tokenizer_manager.py _validate_one_request (message template; numbers illustrative); flat envelope as in https://github.com/QwenLM/Qwen3/issues/1321",
    status: 400,
    body: {
      object: "error",
      message:
        "Requested token count exceeds the model's maximum context length of 32768 tokens. You requested a total of 33210 tokens: 25210 tokens from the input messages and 8000 tokens for the completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit.",
      type: "BadRequestError",
      param: null,
      code: 400,
    },
  },
  {
    server: "SGLang",
    short: "exceeds the maximum allowed length",
    source:
      "message reported in https://github.com/sgl-project/sglang/issues/4048 (issue title; only the first sentence is quoted); flat envelope as in https://github.com/QwenLM/Qwen3/issues/1321",
    status: 400,
    body: {
      object: "error",
      message: "Input length (160062 tokens) exceeds the maximum allowed length (59862 tokens).",
      type: "BadRequestError",
      param: null,
      code: 400,
    },
  },

  // ── LiteLLM proxy ───────────────────────────────────────────────────────────────────────────
  {
    server: "LiteLLM proxy",
    short: "ContextWindowExceededError wrapped, code '400'",
    source: "reported in https://github.com/BerriAI/litellm/issues/7259 (proxy body, Anthropic upstream)",
    status: 400,
    body: {
      error: {
        message:
          'litellm.BadRequestError: litellm.ContextWindowExceededError: AnthropicError - {"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 200480 tokens > 200000 maximum"}}\nReceived Model Group=anthropic/claude-3-5-sonnet-20241022\nAvailable Model Group Fallbacks=None',
        type: null,
        param: null,
        code: "400",
      },
    },
  },
  {
    server: "LiteLLM proxy",
    short: "input length and max_tokens exceed context limit",
    source:
      "reported in https://github.com/BrokkAi/brokk-app/issues/540 (proxy body, not mapped to ContextWindowExceededError)",
    status: 400,
    body: {
      error: {
        message:
          'litellm.BadRequestError: AnthropicException - b\'{"type":"error","error":{"type":"invalid_request_error","message":"input length and `max_tokens` exceed context limit: 179413 + 32768 > 200000, decrease input length or `max_tokens` and try again"}}\'. Received Model Group=anthropic/claude-sonnet-4-20250514\nAvailable Model Group Fallbacks=None',
        type: null,
        param: null,
        code: "400",
      },
    },
  },
  {
    server: "LiteLLM proxy",
    short: "in-stream ProxyException",
    source:
      "BerriAI/litellm litellm/proxy/proxy_server.py async_data_generator (`yield f\"data: {json.dumps({'error': proxy_exception.to_dict()})}\"` once the stream has started; 200 status per https://github.com/BerriAI/litellm/issues/6629); message text taken from https://github.com/BerriAI/litellm/issues/7259 — the pairing is assembled, not one captured frame",
    status: 200,
    inStream: true,
    body: {
      error: {
        message:
          'litellm.BadRequestError: litellm.ContextWindowExceededError: AnthropicError - {"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 200480 tokens > 200000 maximum"}}',
        type: null,
        param: null,
        code: "400",
      },
    },
  },

  // ── OpenRouter ──────────────────────────────────────────────────────────────────────────────
  {
    server: "OpenRouter",
    short: "endpoint's maximum context length, middle-out",
    source:
      "message reported in https://github.com/refly-ai/refly/issues/1177 (400); envelope {error:{code,message,metadata}} per https://openrouter.ai/docs/api/reference/errors-and-debugging and https://github.com/tailcallhq/forgecode/issues/1143 (metadata.provider_name)",
    status: 400,
    body: {
      error: {
        message:
          'This endpoint\'s maximum context length is 32768 tokens. However, you requested about 42832 tokens (42832 of text input). Please reduce the length of either one, or use the "middle-out" transform to compress your prompt automatically.',
        code: 400,
        metadata: { provider_name: null },
      },
    },
  },
  {
    server: "OpenRouter",
    short: "error after processing started (200)",
    source:
      "body reported in https://github.com/Aider-AI/aider/issues/3721 (arrived with a 200, no choices); OpenRouter docs: once the model started processing, errors come with status 200 in the body or as an SSE data event",
    status: 200,
    inStream: true,
    body: {
      error: {
        message:
          'This endpoint\'s maximum context length is 131072 tokens. However, you requested about 141607 tokens (10535 of text input, 131072 in the output). Please reduce the length of either one, or use the "middle-out" transform to compress your prompt automatically.',
        code: 400,
        metadata: { provider_name: "Chutes" },
      },
    },
  },

  // ── Mistral ─────────────────────────────────────────────────────────────────────────────────
  {
    server: "Mistral",
    short: "too large for model with N maximum context length",
    source:
      "message reported in https://portkey.ai/error-library/context-length-exceeded-error-13710000 (400; docs.mistral.ai/resources/known-limitations confirms 400 for context overflow); envelope {object:'error',message,type,param,code} as in https://github.com/solbrowse/extension/issues/16 — assembled",
    status: 400,
    body: {
      object: "error",
      message: "Prompt contains 66385 tokens, too large for model with 32768 maximum context length",
      type: "invalid_request_error",
      param: null,
      code: null,
    },
  },

  // ── Groq ────────────────────────────────────────────────────────────────────────────────────
  {
    server: "Groq",
    short: "context_length_exceeded, no numbers",
    source:
      "reported in https://github.com/letta-ai/letta/issues/1963 and https://github.com/thepersonalaicompany/amurex-backend/issues/51",
    status: 400,
    body: {
      error: {
        message: "Please reduce the length of the messages or completion.",
        type: "invalid_request_error",
        param: "messages",
        code: "context_length_exceeded",
      },
    },
  },

  // ── DeepSeek ────────────────────────────────────────────────────────────────────────────────
  {
    server: "DeepSeek",
    short: "code invalid_request_error",
    source:
      "reported in https://github.com/netease-youdao/LobsterAI/issues/60 (also https://github.com/evalstate/fast-agent/issues/621)",
    status: 400,
    body: {
      error: {
        message:
          "This model's maximum context length is 131072 tokens. However, you requested 141403 tokens (133211 in the messages, 8192 in the completion). Please reduce the length of the messages or completion.",
        type: "invalid_request_error",
        param: null,
        code: "invalid_request_error",
      },
    },
  },

  // ── Anthropic (OpenAI-compatible endpoint) ──────────────────────────────────────────────────
  {
    server: "Anthropic",
    short: "prompt is too long",
    source:
      "reported in https://github.com/anthropics/claude-code/issues/62560 (Messages API body); the OpenAI-compat docs (docs.claude.com/en/api/openai-sdk) do not show a different envelope, and the OpenAI SDK reads `error` the same way from either",
    status: 400,
    body: {
      type: "error",
      error: { type: "invalid_request_error", message: "prompt is too long: 211180 tokens > 200000 maximum" },
      request_id: "req_011CbRHLp6ffMfsnsULngXLv",
    },
  },
  {
    server: "Anthropic",
    short: "input length and max_tokens exceed context limit",
    source:
      "reported in https://github.com/continuedev/continue/issues/6080 (also https://github.com/docker/docker-agent/issues/569)",
    status: 400,
    body: {
      type: "error",
      error: {
        type: "invalid_request_error",
        message:
          "input length and `max_tokens` exceed context limit: 199759 + 8192 > 200000, decrease input length or `max_tokens` and try again",
      },
    },
  },

  // ── Google Gemini (OpenAI-compatible endpoint) ──────────────────────────────────────────────
  {
    server: "Gemini",
    short: "array-wrapped INVALID_ARGUMENT",
    source:
      "the OpenAI-compat endpoint answers with a JSON array of {error:{code,message,status}} (reported in https://github.com/Simpleyyt/ai-manus/issues/101, see also https://github.com/cyberchitta/openai_ex/pull/126); overflow wording reported in https://github.com/google-gemini/gemini-cli/issues/6678 — assembled",
    status: 400,
    body: [
      {
        error: {
          code: 400,
          message: "The input token count (1200293) exceeds the maximum number of tokens allowed (1048576).",
          status: "INVALID_ARGUMENT",
        },
      },
    ],
  },

  // ── Others with a different shape ───────────────────────────────────────────────────────────
  {
    server: "xAI",
    short: "maximum prompt length, flat {code, error}",
    source:
      "message reported in https://github.com/cline/cline/issues/3120 (400); xAI's flat {code:'Client specified an invalid argument', error:string} envelope as in https://github.com/nocmt/LLMSearchPlus/issues/2 — assembled",
    status: 400,
    body: {
      code: "Client specified an invalid argument",
      error: "This model's maximum prompt length is 131072 but the request contains 136973 tokens.",
    },
  },
  {
    server: "Cerebras",
    short: "Current length is N while limit is M",
    source:
      "message reported in https://github.com/cline/cline/issues/5140 (400, also https://github.com/anomalyco/opencode/issues/1551); the issues quote only the message, so only the message is given",
    status: 400,
    body: {
      error: {
        message: "Please reduce the length of the messages or completion. Current length is 42328 while limit is 40000",
      },
    },
  },
  {
    server: "FastChat",
    short: "flat object with numeric code 40303",
    source: "reported in https://github.com/lm-sys/FastChat/issues/2432",
    status: 400,
    body: {
      object: "error",
      message:
        "This model's maximum context length is 2048 tokens. However, you requested 3583 tokens (583 in the messages, 3000 in the completion). Please reduce the length of the messages or completion.",
      code: 40303,
    },
  },
  {
    server: "Kimi (Moonshot)",
    short: "exceeded model token limit",
    source:
      "message reported in https://github.com/multica-ai/multica/issues/4130 (API Error: 400); the issue quotes only the message, so only the message is given",
    status: 400,
    body: {
      error: { message: "Invalid request: Your request exceeded model token limit: 262144 (requested: 275363)" },
    },
  },
  {
    server: "unnamed GLM-5.1 host",
    short: "flat {code: 20015, message, data}",
    source:
      "reported in https://github.com/leookun/cursor-byok/issues/129 (openai adapter status=400; the host is not named in the issue)",
    status: 400,
    body: {
      code: 20015,
      message: "number of input tokens (204703) has exceeded max_prompt_tokens (202752) limit.",
      data: null,
    },
  },
];

// ---------------------------------------------------------------------------------------------
// Not context overflow: ordinary request errors from the same servers. aic must give up at once
// (exit 1, one request). Several are chosen because a loose overflow matcher would catch them
// ("context_window", "maximum context length", "max_tokens", "tokens", "too large", "at most").
//
// Borderline cases placed here, with the reason:
// - The requested OUTPUT alone is larger than the window or than the model's output cap
//   (OpenAI "max_tokens is too large … supports at most N completion tokens", vLLM
//   "max_tokens=… cannot be greater than max_model_len", Groq "max_completion_tokens must be less
//   than or equal to", vLLM "'max_tokens' … is too large: 8000 … context length is 4096"). No
//   amount of history compression can fix these; compressing three times and then failing only
//   hides the real fix (a smaller max_tokens, or a model with a bigger window). Two of them carry
//   overflow-like wording, so telling them apart needs the numbers: output ≥ window means "not
//   overflow".
// - Groq 413 "Request too large … tokens per minute (TPM)": a per-minute quota, not the window.
//   Waiting does not help (one request is over the whole minute's budget) and with aic's fixed
//   max_tokens=8000 a 6000-TPM tier can never be met by compressing.
// - OpenRouter 402 "requires more credits, or fewer max_tokens": billing, not context.
// ---------------------------------------------------------------------------------------------

export const NOT_OVERFLOW_FIXTURES: ErrorFixture[] = [
  {
    server: "OpenAI",
    short: "max_tokens above the model's output cap",
    source:
      "reported in https://github.com/ChatGPTNextWeb/NextChat/issues/3195 (also https://github.com/algorithmicsuperintelligence/optillm/issues/4)",
    status: 400,
    body: {
      error: {
        message:
          "max_tokens is too large: 8192. This model supports at most 4096 completion tokens, whereas you provided 8192.",
        type: "invalid_request_error",
        param: "max_tokens",
        code: null,
      },
    },
  },
  {
    server: "OpenAI",
    short: "unsupported temperature",
    source:
      "message reported in github.com/webgptorg/promptbook prompts/done/old-done/2025-10-0000-auto-fix-temperature.md ('400 Unsupported value: …'); only the message is quoted, so only the message is given",
    status: 400,
    body: {
      error: {
        message:
          "Unsupported value: 'temperature' does not support 0.7 with this model. Only the default (1) value is supported.",
      },
    },
  },
  {
    server: "vLLM",
    short: "auto tool choice not enabled",
    source:
      "vLLM's reply to tool_choice 'auto' on a server started without --enable-auto-tool-choice/--tool-call-parser (documented at docs.vllm.ai features/tool_calling; quoted verbatim in many deployment notes found by code search; the raising file moved between releases and was not read here); envelope vllm ErrorResponse{error: ErrorInfo} from vllm/entrypoints/openai/protocol.py",
    status: 400,
    body: {
      error: {
        message: '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
        type: "BadRequestError",
        param: null,
        code: 400,
      },
    },
  },
  {
    server: "vLLM",
    short: "max_tokens greater than max_model_len",
    source:
      "reported in https://github.com/vllm-project/vllm/pull/40324 (body before the spacing fix; wording from vllm/renderers/params.py TokenizeParams.__post_init__)",
    status: 400,
    body: {
      error: {
        message:
          "max_tokens=38000cannot be greater than max_model_len=max_total_tokens=32768. Please request fewer output tokens. (parameter=max_tokens, value=38000)",
        type: "BadRequestError",
        param: "max_tokens",
        code: 400,
      },
    },
  },
  {
    // Borderline: overflow wording, but 8000 output tokens alone exceed the 4096 window.
    server: "vLLM",
    short: "'max_tokens' is too large: output alone exceeds the window",
    source:
      "reported in github.com/andrewcho-dev/opsconductor-ng vLLM_transition/TOKEN_LIMIT_FIX.md (vLLM HTTP error: 400 body; max_tokens=8000 is what aic sends)",
    status: 400,
    body: {
      error: {
        message:
          "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context length is 4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778). None",
        type: "BadRequestError",
        param: null,
        code: 400,
      },
    },
  },
  {
    // Borderline: overflow wording, but the requested output (131072) is the whole window.
    server: "vLLM",
    short: "character pre-check, output is the whole window",
    source: "reported in https://github.com/gi-dellav/zerostack/issues/22 (vLLM ≥0.18 _text_len_check wording)",
    status: 400,
    body: {
      error: {
        message:
          "This model's maximum context length is 131072 tokens. However, you requested 131072 output tokens and your prompt contains 14233 characters (more than 0 characters, which is the upper bound for 0 input tokens). Please reduce the length of the input prompt or the number of requested output tokens. (parameter=input_text, value=14233)",
        type: "BadRequestError",
        param: "input_text",
        code: 400,
      },
    },
  },
  {
    // Trap: mentions `context_window`, but it is the output cap.
    server: "Groq",
    short: "max_completion_tokens cap mentions context_window",
    source:
      "error object reported in https://github.com/Alishahryar1/free-claude-code/issues/1354 (printed as 'Upstream error'); wrapped in Groq's usual {error: …} envelope as in https://github.com/letta-ai/letta/issues/1963",
    status: 400,
    body: {
      error: {
        message:
          "`max_completion_tokens` must be less than or equal to `16384`, the maximum value for `max_completion_tokens` is less than the `context_window` for this model",
        type: "invalid_request_error",
        param: "max_completion_tokens",
      },
    },
  },
  {
    server: "Groq",
    short: "413 tokens-per-minute quota",
    source:
      "body reported in https://github.com/ITSpecialist111/ai_automation_suggester/issues/61; 413 for 'Request Entity Too Large' per https://console.groq.com/docs/errors",
    status: 413,
    body: {
      error: {
        message:
          "Request too large for model `llama-3.3-70b-versatile` in organization `org_01jp8byqwpfx9sp1m0dbhb6a1e` service tier `on_demand` on tokens per minute (TPM): Limit 6000, Requested 14810, please reduce your message size and try again. Visit https://console.groq.com/docs/rate-limits for more information.",
        type: "tokens",
        code: "rate_limit_exceeded",
      },
    },
  },
  {
    server: "TGI",
    short: "422 temperature must be strictly positive",
    source:
      "huggingface/text-generation-inference router/src/validation.rs ValidationError::Temperature, router/src/infer/mod.rs ('Input validation error: {0}', error_type 'validation'), router/src/server.rs (ValidationError → 422)",
    status: 422,
    body: { error: "Input validation error: `temperature` must be strictly positive", error_type: "validation" },
  },
  {
    server: "Ollama",
    short: "model does not support tools",
    source:
      "ollama/ollama server/images.go CheckCapabilities (errCapabilities 'does not support' + 'tools'), server/routes.go scheduleRunner ('%s %w' with the model name) + handleScheduleError (400), middleware/openai.go + openai/openai.go NewError",
    status: 400,
    body: {
      error: {
        message: "registry.ollama.ai/library/gemma3:4b does not support tools",
        type: "invalid_request_error",
        param: null,
        code: null,
      },
    },
  },
  {
    server: "LM Studio",
    short: "response_format type",
    source: "reported in https://github.com/t59688/arboris-novel/issues/23",
    status: 400,
    body: { error: "'response_format.type' must be 'json_schema' or 'text'" },
  },
  {
    server: "Mistral",
    short: "422 extra_forbidden, message is an object",
    source: "reported in https://github.com/editor-code-assistant/eca/issues/231",
    status: 422,
    body: {
      object: "error",
      message: {
        detail: [
          {
            type: "extra_forbidden",
            loc: ["body", "max_completion_tokens"],
            msg: "Extra inputs are not permitted",
            input: 32000,
          },
        ],
      },
      type: "invalid_request_error",
      param: null,
      code: null,
    },
  },
  {
    server: "Mistral",
    short: "422 FastAPI detail array",
    source: "reported in https://github.com/Gitlawb/openclaude/issues/739",
    status: 422,
    body: {
      detail: [
        { type: "extra_forbidden", loc: ["body", "store"], msg: "Extra inputs are not permitted", input: false },
        {
          type: "extra_forbidden",
          loc: ["body", "max_completion_tokens"],
          msg: "Extra inputs are not permitted",
          input: 8192,
        },
      ],
    },
  },
  {
    server: "Mistral",
    short: "last role must be user or tool",
    source: "reported in https://github.com/NEKOparapa/AiNiee/issues/641",
    status: 400,
    body: {
      object: "error",
      message: "Expected last role User or Tool (or Assistant with prefix True) for serving but got assistant",
      type: "invalid_request_error",
      param: null,
      code: null,
    },
  },
  {
    server: "Gemini",
    short: "array-wrapped unsupported function calling",
    source: "reported in https://github.com/Simpleyyt/ai-manus/issues/101 (OpenAI-compat endpoint)",
    status: 400,
    body: [
      {
        error: {
          code: 400,
          message: "Function calling with a response mime type: 'application/json' is unsupported",
          status: "INVALID_ARGUMENT",
        },
      },
    ],
  },
  {
    server: "xAI",
    short: "single text element per message",
    source: "reported in https://github.com/nocmt/LLMSearchPlus/issues/2",
    status: 400,
    body: {
      code: "Client specified an invalid argument",
      error: "The model expects a single `text` element per message.",
    },
  },
  {
    server: "Anthropic",
    short: "model string too long",
    source: "reported in https://github.com/anthropics/claude-code/issues/5676",
    status: 400,
    body: {
      type: "error",
      error: { type: "invalid_request_error", message: "model: String should have at most 256 characters" },
    },
  },
  {
    server: "OpenRouter",
    short: "402 more credits or fewer max_tokens",
    source:
      "reported in github.com/PawanYN/Dravin.ai assign/Assistant_api/OpenAI_documentation/temp.js (openai.APIStatusError: Error code: 402 body)",
    status: 402,
    body: {
      error: {
        message:
          "This request requires more credits, or fewer max_tokens. You requested up to 16384 tokens, but can only afford 3661. To increase, visit https://openrouter.ai/settings/credits and upgrade to a paid account",
        code: 402,
        metadata: { provider_name: null },
      },
      user_id: "user_2zM7P6YUJbL3MfDR56phOu5jvnX",
    },
  },
];
