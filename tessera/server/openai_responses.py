"""OpenAI's Responses API, `POST /v1/responses`, for text and image input, text output and
function tools (as the OpenAI Agents SDK, Codex and other newer clients call it; vLLM
serves it too).

A request becomes a chat request (responses_input.py) and runs as /v1/chat/completions
runs: the chat template, images, sampling defaults, a reasoning parser's split, and tool
calls planned as chat plans them (a named function or "required" constrain the output;
"auto" needs the server's --tool-call-parser). The reply is a `response` object whose
output items are built by responses_output.py: a reasoning item (under a reasoning
parser), a message, and a function_call item per call; streamed, the event sequence
response.created ... response.completed. Nothing is stored (`store` is taken and ignored);
the message's logprobs come with `include: ["message.output_text.logprobs"]` or
`top_logprobs`, for plain answers (not with tools or a reasoning parser)."""
from __future__ import annotations

import uuid

from fastapi import APIRouter, Request

from tessera.server.chat_items import prepare_chat, respond
from tessera.server.openai_common import state_of
from tessera.server.protocol import ResponsesRequest
from tessera.server.responses_input import chat_request
from tessera.server.responses_output import ResponseWriter

router = APIRouter(prefix="/v1")


@router.post("/responses")
async def responses(request: Request, body: ResponsesRequest):
    state = state_of(request)
    chat = await prepare_chat(state, chat_request(body), logprobs_param="include")
    writer = ResponseWriter(f"resp_{uuid.uuid4().hex}", chat.served, body, len(chat.ids),
                            lambda text: len(state.tokenizer(text, add_special_tokens=False).input_ids))
    return await respond(request, state, chat, writer, body.stream)
