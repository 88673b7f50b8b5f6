"""What a request asks of a model and what comes back: a generation's parameters (chat messages,
constraints, embedding and transcription inputs) and the chunks of its answer (text, tool calls,
logprobs, transcript segments).

Split from exo/core/types.py, which keeps the cluster's own records (cards, instances, tasks).
Struct names and fields are the wire format: renaming one breaks older logs and peers.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from exo.core.ids import CommandId

FinishReason = Literal["stop", "length", "cancelled", "error"]


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    content: str = ""
    images: list[str] = []  # sha256 hex of each image, in the object store exo-images


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True):
    """What the answer must be (constrained decoding): any JSON object, JSON valid for `json_schema`,
    text matching `pattern`, exactly one of `choices`, or text of `grammar` (Lark or GBNF)."""

    type: Literal["json_object", "json_schema", "regex", "choice", "grammar"]
    json_schema: dict[str, Any] = {}  # the schema itself, for "json_schema"
    name: str = ""
    pattern: str = ""  # for "regex": the whole answer matches it (Rust regex syntax, as llguidance reads it)
    choices: list[str] = []  # for "choice"
    grammar: str = ""  # for "grammar", written in `syntax`
    syntax: Literal["lark", "gbnf"] = "lark"  # llguidance's Lark, or llama.cpp's GBNF


class EmbedInputs(msgspec.Struct, frozen=True, kw_only=True):
    """What to embed: texts, or token ids as given (OpenAI's token-array input); one vector each."""

    texts: list[str] = []
    token_ids: list[list[int]] = []
    dimensions: int | None = None  # keep this many leading dimensions, then normalize again (Matryoshka)
    query: str | None = None  # set (a cross-encoder): score each text as a document for this query, one float each


class TranscribeInputs(msgspec.Struct, frozen=True, kw_only=True):
    """Speech to text (a Whisper model): the audio file by digest, stored as chat images are."""

    audio: str  # sha256 hex of the audio file's bytes, in the object store exo-images
    seconds: float = 0.0  # its length, read by the API from the file
    task: Literal["transcribe", "translate"] = "transcribe"  # translate: into English
    language: str = ""  # the spoken language's ISO-639-1 code; "": the model detects it
    prompt: str = ""  # text the speech follows, to steer spelling and style (Whisper's initial prompt)
    temperature: float = 0.0  # 0: Whisper's own fallback, from 0 up while the text looks wrong
    word_timestamps: bool = False


class TranscriptWord(msgspec.Struct, frozen=True, kw_only=True):
    word: str
    start: float  # seconds from the audio's start
    end: float


class TranscriptSegment(msgspec.Struct, frozen=True, kw_only=True):
    """One stretch of a transcript, with Whisper's measures of it (OpenAI's verbose_json segment)."""

    id: int
    seek: int  # the window it was decoded in, in 10 ms frames
    start: float  # seconds from the audio's start
    end: float
    text: str
    tokens: list[int] = []
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0
    words: list[TranscriptWord] = []  # with word timestamps


class SpeakInputs(msgspec.Struct, frozen=True, kw_only=True):
    """Text to speech (a model of an mlx-audio TTS family): what to say, in which voice, how fast."""

    text: str
    voice: str = ""  # one of the model's voices (exo/runner/speech_engine.py); "": its default
    speed: float = 1.0  # 0.25-4.0, as OpenAI's; other than 1 only for a model whose generate takes a speed


REPETITION_CONTEXT = 20  # recent tokens a repetition penalty looks at: mlx-lm's default (and mlx_lm.server's)


class GenerationParams(msgspec.Struct, frozen=True, kw_only=True):
    """A text generation request as the runner sees it (already validated by the API)."""

    messages: list[ChatMessage] = []
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # with n > 1, choice i samples with seed + i
    # Choices generated from one prefill (OpenAI's n), and the candidates they are the likeliest of
    # (completions' best_of; 0: n). Old logs decode: one choice.
    n: int = 1
    best_of: int = 0
    stop: list[str] = []
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None  # 0: off
    min_p: float | None = None
    logit_bias: dict[int, float] = {}  # token id -> added to its logit (OpenAI's; str keys in JSON, as theirs)
    repetition_penalty: float | None = None  # mlx-lm's: divides a recent token's positive logit, multiplies a negative one
    repetition_context_size: int = REPETITION_CONTEXT  # how many recent tokens it looks at; -1: all of them
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token, when logprobs is on
    tools: list[dict[str, Any]] = []  # OpenAI-style function tools, given to the chat template
    tools_required: bool = False  # tool_choice "required" or a named tool: the answer must call one (constrained)
    tool_turns: list[ToolTurn] = []  # tool calls and results of earlier turns (see ToolTurn)
    prompt: str | None = None  # raw prompt text (completions): used as is, no chat template
    enable_thinking: bool | None = None  # the chat template's switch; None: the model's default
    response_format: ResponseFormat | None = None  # constrains the answer (exo/runner/constraint.py)
    embed: EmbedInputs | None = None  # set: embed these inputs instead of generating (an embedding model)
    transcribe: TranscribeInputs | None = None  # set: turn this audio into text (a speech-to-text model)
    speak: SpeakInputs | None = None  # set: turn this text into audio (a text-to-speech model)
    # Whose prompt-cache entries it may reuse and add to (keys.cache_scope_of): set by the master from its key.
    cache_scope: str = ""


def rows_of(params: GenerationParams) -> int:
    """How many rows of a batch the request decodes: its n choices, or its best_of candidates. The
    master counts it that many times in queues, key limits and token reservations: n=16 is 16
    requests' work, and must not pass for one beside another tenant's."""
    return max(params.n, params.best_of)


class ChoiceEnd(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How one choice of a request with n > 1 ended (its text came in the chunks with its `choice`)."""

    choice: int
    finish_reason: FinishReason
    completion_tokens: int = 0
    stop_sequence: str = ""
    logprob: float = 0.0  # the sum of its tokens' logprobs, with best_of: what ranks the candidates


class TokenChunk(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One piece of generated text on exo.tokens.<command_id> (data plane, not the event log)."""

    command_id: CommandId
    index: int
    text: str = ""  # the answer's text (content)
    reasoning: str = ""  # the model's thinking, split from the content at its thinking markers
    token_count: int = 0  # completion tokens so far
    prompt_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str = ""
    logprobs: list[TokenLogprob] = []  # one per generated token, when asked for
    tool_calls: list[ToolCall] = []  # parsed from the model's output by the tokenizer's tool parser
    stop_sequence: str = ""  # the stop string that ended generation, if one did
    cached_tokens: int = 0  # on the last chunk: prompt tokens reused from the runner's prompt cache
    error_code: str = ""  # with finish_reason "error": what kind, e.g. "context_length_exceeded" (a client's 400)
    # The ids of the tokens whose text this chunk completes (every token since the previous chunk):
    # a runner that takes over a generation (a migration) prefills the prompt plus these.
    token_ids: list[int] = []
    attempt: int = 0  # which run of the task sent it: 0 first, +1 per migration; older runs' late chunks are dropped
    draft_tokens: int = 0  # on the last chunk: completion tokens a draft model proposed and the model accepted
    choice: int = 0  # which of the request's choices (GenerationParams.n) this text belongs to
    # With n > 1 (or best_of): how choices ended, each once: in a choice's own last chunk when it ended
    # before the request, else in the request's last chunk.
    choices: list[ChoiceEnd] = []
    # An embedding request's vector for input `index` (one chunk per input, in order): little-endian
    # float32, base64, as OpenAI's encoding_format "base64" (a vector of 4,096 floats is 22 KB).
    embedding: str = ""
    # A transcription's segment `index` (one chunk per segment, in order); its last chunk's `text` is
    # the whole transcript and `language` the language spoken.
    segment: TranscriptSegment | None = None
    language: str = ""
    # Speech as it is generated: 16-bit little-endian mono PCM, base64, at `sample_rate` (every chunk of
    # a speech task carries the rate; its first has no audio, so the rate comes before any sample).
    audio: str = ""
    sample_rate: int = 0


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolTurn(msgspec.Struct, frozen=True, kw_only=True):
    """The tool side of messages[index]: an assistant's calls, or which call a tool message answers."""

    index: int
    tool_calls: list[ToolCall] = []
    tool_call_id: str = ""
    name: str = ""


class TopLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = []
